//! Amounts by capacity name, as a share holds them: what it consumes and what was read
//! back. A share names one capacity, or two (each direction of a link), so they are kept
//! in a vector sorted by name rather than a `BTreeMap`, whose first entry allocates a
//! whole node (640 bytes for these keys and values): with 100,000 live shares the maps
//! were a tenth of the agent's memory. Iteration is in name order, as a `BTreeMap`'s, so
//! the stored JSON is the same. Names are [`Name`]s: a capacity name is short, so it
//! sits inline instead of in an allocation of its own.

use std::collections::BTreeMap;

use serde::{Deserialize, Deserializer, Serialize, Serializer, de::Error as _, ser::SerializeMap};
use shareguard_common::Quantity;

use crate::record::Name;

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Amounts(Vec<(Name, Quantity)>);

impl Amounts {
    pub fn new() -> Self {
        Self::default()
    }

    fn find(&self, name: &str) -> Result<usize, usize> {
        self.0.binary_search_by(|(k, _)| k.as_str().cmp(name))
    }

    pub fn get(&self, name: &str) -> Option<&Quantity> {
        self.find(name).ok().map(|i| &self.0[i].1)
    }

    pub fn contains_key(&self, name: &str) -> bool {
        self.find(name).is_ok()
    }

    /// Sets `name`'s amount; the one it replaced, if any.
    pub fn insert(&mut self, name: impl Into<Name>, q: Quantity) -> Option<Quantity> {
        let name = name.into();
        match self.find(&name) {
            Ok(i) => Some(std::mem::replace(&mut self.0[i].1, q)),
            Err(i) => {
                self.0.insert(i, (name, q));
                None
            }
        }
    }

    pub fn remove(&mut self, name: &str) -> Option<Quantity> {
        self.find(name).ok().map(|i| self.0.remove(i).1)
    }

    pub fn clear(&mut self) {
        // Not `Vec::clear`: an empty share's amounts hold no allocation.
        self.0 = Vec::new();
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// In name order.
    pub fn iter(&self) -> impl ExactSizeIterator<Item = (&str, &Quantity)> {
        self.0.iter().map(|(k, v)| (k.as_str(), v))
    }

    pub fn keys(&self) -> impl ExactSizeIterator<Item = &str> {
        self.0.iter().map(|(k, _)| k.as_str())
    }
}

impl<'a> IntoIterator for &'a Amounts {
    type Item = (&'a str, &'a Quantity);
    type IntoIter = std::iter::Map<
        std::slice::Iter<'a, (Name, Quantity)>,
        fn(&'a (Name, Quantity)) -> (&'a str, &'a Quantity),
    >;

    fn into_iter(self) -> Self::IntoIter {
        self.0.iter().map(|(k, v)| (k.as_str(), v))
    }
}

impl FromIterator<(String, Quantity)> for Amounts {
    /// A name given twice keeps its last amount, as a `BTreeMap` would.
    fn from_iter<I: IntoIterator<Item = (String, Quantity)>>(iter: I) -> Self {
        let mut a = Amounts::new();
        for (k, v) in iter {
            a.insert(k, v);
        }
        a.0.shrink_to_fit();
        a
    }
}

impl From<BTreeMap<String, Quantity>> for Amounts {
    fn from(m: BTreeMap<String, Quantity>) -> Self {
        // Already in name order: no search needed.
        let mut v: Vec<(Name, Quantity)> = m.into_iter().map(|(k, q)| (k.into(), q)).collect();
        v.shrink_to_fit();
        Amounts(v)
    }
}

impl From<&Amounts> for BTreeMap<String, Quantity> {
    fn from(a: &Amounts) -> Self {
        a.0.iter().map(|(k, q)| (k.to_string(), *q)).collect()
    }
}

impl PartialEq<BTreeMap<String, Quantity>> for Amounts {
    fn eq(&self, other: &BTreeMap<String, Quantity>) -> bool {
        self.len() == other.len()
            && self
                .iter()
                .zip(other)
                .all(|((ka, qa), (kb, qb))| ka == kb && qa == qb)
    }
}

/// Quantities persist in canonical string form, exactly as the API shows them.
impl Serialize for Amounts {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut m = s.serialize_map(Some(self.len()))?;
        for (k, v) in self {
            m.serialize_entry(k, &v.to_string())?;
        }
        m.end()
    }
}

impl<'de> Deserialize<'de> for Amounts {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let raw = BTreeMap::<String, String>::deserialize(d)?;
        raw.into_iter()
            .map(|(k, v)| {
                let q = Quantity::parse(&v).map_err(|e| D::Error::custom(format!("{k}: {e}")))?;
                Ok((k, q))
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn q(s: &str) -> Quantity {
        Quantity::parse(s).unwrap()
    }

    #[test]
    fn kept_in_name_order_and_read_like_a_map() {
        let mut a = Amounts::new();
        assert_eq!(a.insert("tx", q("2G")), None);
        assert_eq!(a.insert("rx", q("1G")), None);
        assert_eq!(a.insert("tx", q("3G")), Some(q("2G")));
        assert_eq!(a.keys().collect::<Vec<_>>(), ["rx", "tx"]);
        assert_eq!(a.get("tx"), Some(&q("3G")));
        assert!(a.contains_key("rx") && !a.contains_key("memory"));
        let m: BTreeMap<String, Quantity> = (&a).into();
        assert_eq!(a, m);
        assert_eq!(Amounts::from(m.clone()), a);
        assert_eq!(a.remove("rx"), Some(q("1G")));
        assert_ne!(a, m);
        a.clear();
        assert!(a.is_empty() && a.0.capacity() == 0);
    }

    #[test]
    fn stored_as_the_map_of_quantity_strings_it_was() {
        let m: BTreeMap<String, Quantity> =
            [("tx".into(), q("2G")), ("rx".into(), q("500M"))].into();
        let a = Amounts::from(m.clone());
        let before = serde_json::json!({"rx": "500M", "tx": "2G"});
        assert_eq!(serde_json::to_value(&a).unwrap(), before);
        let back: Amounts = serde_json::from_value(before).unwrap();
        assert_eq!(back, a);
        let bad = serde_json::from_value::<Amounts>(serde_json::json!({"rx": "lots"}));
        assert!(bad.unwrap_err().to_string().contains("rx"));
    }
}
