//! A set of records looked up by a key each record carries.
//!
//! The agent keeps every live share in memory (100,000 on a large node), so how a record
//! sits in its table matters: a `HashMap<String, Record>` holds a copy of the key beside
//! each record and the whole record (several hundred bytes) in every slot of a table that
//! is up to half empty, and while it grows, both tables at once. Here each slot holds one
//! pointer to a boxed record, and lookups borrow the key from the record itself.

use std::{
    borrow::Borrow,
    collections::HashSet,
    hash::{Hash, Hasher},
};

/// A record with a key that identifies it in its set.
pub trait Keyed {
    fn key(&self) -> &str;
}

/// A boxed record, equal and hashed as its key, so the set can be asked by `&str`.
#[derive(Debug)]
struct ByKey<T>(Box<T>);

impl<T: Keyed> Borrow<str> for ByKey<T> {
    fn borrow(&self) -> &str {
        self.0.key()
    }
}

impl<T: Keyed> Hash for ByKey<T> {
    // The same hash as the `&str` a lookup borrows (what `Borrow` requires).
    fn hash<H: Hasher>(&self, h: &mut H) {
        self.0.key().hash(h);
    }
}

impl<T: Keyed> PartialEq for ByKey<T> {
    fn eq(&self, other: &Self) -> bool {
        self.0.key() == other.0.key()
    }
}

impl<T: Keyed> Eq for ByKey<T> {}

#[derive(Debug)]
pub struct KeyedSet<T>(HashSet<ByKey<T>>);

impl<T> Default for KeyedSet<T> {
    fn default() -> Self {
        Self(HashSet::new())
    }
}

impl<T: Keyed> KeyedSet<T> {
    pub fn get(&self, key: &str) -> Option<&T> {
        self.0.get(key).map(|b| &*b.0)
    }

    pub fn contains_key(&self, key: &str) -> bool {
        self.0.contains(key)
    }

    pub fn values(&self) -> impl Iterator<Item = &T> {
        self.0.iter().map(|b| &*b.0)
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Makes room for `n` more records at once, as a start that loads them all does,
    /// instead of growing (and rehashing) step by step.
    pub fn reserve(&mut self, n: usize) {
        self.0.reserve(n);
    }

    /// Puts `value` in, returning the record it replaced under the same key.
    pub fn insert(&mut self, value: T) -> Option<T> {
        self.insert_boxed(Box::new(value)).map(|b| *b)
    }

    /// [`Self::insert`] for a record already boxed, as a start decodes them: moved in,
    /// not copied into a box of its own.
    pub fn insert_boxed(&mut self, value: Box<T>) -> Option<Box<T>> {
        self.0.replace(ByKey(value)).map(|b| b.0)
    }

    pub fn remove(&mut self, key: &str) -> Option<T> {
        self.0.take(key).map(|b| *b.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, PartialEq)]
    struct Rec {
        key: String,
        n: u32,
    }

    impl Keyed for Rec {
        fn key(&self) -> &str {
            &self.key
        }
    }

    fn rec(key: &str, n: u32) -> Rec {
        Rec {
            key: key.to_owned(),
            n,
        }
    }

    #[test]
    fn a_record_is_found_by_its_key_and_replaced_by_one_with_the_same_key() {
        let mut s = KeyedSet::default();
        assert_eq!(s.insert(rec("a", 1)), None);
        assert_eq!(s.insert(rec("b", 2)), None);
        assert_eq!(s.get("a"), Some(&rec("a", 1)));
        assert_eq!(s.insert(rec("a", 3)), Some(rec("a", 1)));
        assert_eq!(s.get("a").map(|r| r.n), Some(3));
        assert_eq!(s.len(), 2);
        assert!(s.contains_key("b"));
        assert!(!s.contains_key("c"));
        let mut all: Vec<u32> = s.values().map(|r| r.n).collect();
        all.sort_unstable();
        assert_eq!(all, [2, 3]);
        assert_eq!(s.remove("a"), Some(rec("a", 3)));
        assert_eq!(s.remove("a"), None);
        assert_eq!(s.get("a"), None);
        assert_eq!(s.len(), 1);
        assert!(!s.is_empty());
    }

    #[test]
    fn a_boxed_record_is_moved_in_not_copied() {
        let mut s = KeyedSet::default();
        let boxed = Box::new(rec("a", 1));
        let at: *const Rec = &*boxed;
        assert_eq!(s.insert_boxed(boxed), None);
        assert!(std::ptr::eq(s.get("a").unwrap(), at));
        let replaced = s.insert_boxed(Box::new(rec("a", 2))).unwrap();
        assert!(std::ptr::eq(&*replaced, at));
        assert_eq!(s.get("a").map(|r| r.n), Some(2));
    }
}
