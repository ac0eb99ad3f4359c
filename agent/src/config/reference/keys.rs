//! The keys the parser accepts, found by walking the config's `Deserialize` impls with
//! a deserializer that answers every request with a placeholder and records each leaf.

use std::collections::BTreeMap;

use serde::de::{self, DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};

/// Every key the parser accepts, with its TOML type as the parser reads it.
pub fn keys() -> BTreeMap<String, &'static str> {
    let mut found = BTreeMap::new();
    // The walk feeds every field a placeholder of the type it asks for; RawConfig's
    // Deserialize takes any such input, so this cannot fail.
    let _ = <crate::config::RawConfig as serde::Deserialize>::deserialize(Walk {
        path: String::new(),
        found: &mut found,
        record: true,
    });
    found
}

/// A deserializer that answers every request with a placeholder of the asked type and
/// records the path of every leaf.
struct Walk<'a> {
    path: String,
    found: &'a mut BTreeMap<String, &'static str>,
    /// False for map keys and span bookkeeping, which are no config keys.
    record: bool,
}

/// toml's `Spanned<T>`: a struct of this name with a start, an end and the value.
const SPANNED: &str = "$__serde_spanned_private_Spanned";
const SPANNED_VALUE: &str = "$__serde_spanned_private_value";

impl Walk<'_> {
    fn leaf(&mut self, ty: &'static str) {
        if self.record && !self.path.is_empty() {
            // A sequence's element reports after the sequence: keep "array".
            self.found.entry(self.path.clone()).or_insert(ty);
        }
    }

    fn child(&mut self, key: &str) -> Walk<'_> {
        let path = if self.path.is_empty() {
            key.to_owned()
        } else {
            format!("{}.{key}", self.path)
        };
        Walk {
            path,
            found: self.found,
            record: self.record,
        }
    }
}

impl<'de> Deserializer<'de> for Walk<'_> {
    type Error = de::value::Error;

    fn deserialize_any<V: Visitor<'de>>(mut self, v: V) -> Result<V::Value, Self::Error> {
        // Only untagged enums ask for "anything" (an integer or a quantity string).
        self.leaf("any");
        v.visit_i64(0)
    }
    fn deserialize_bool<V: Visitor<'de>>(mut self, v: V) -> Result<V::Value, Self::Error> {
        self.leaf("boolean");
        v.visit_bool(false)
    }
    fn deserialize_i8<V: Visitor<'de>>(self, v: V) -> Result<V::Value, Self::Error> {
        self.deserialize_u64(v)
    }
    fn deserialize_i16<V: Visitor<'de>>(self, v: V) -> Result<V::Value, Self::Error> {
        self.deserialize_u64(v)
    }
    fn deserialize_i32<V: Visitor<'de>>(self, v: V) -> Result<V::Value, Self::Error> {
        self.deserialize_u64(v)
    }
    fn deserialize_i64<V: Visitor<'de>>(self, v: V) -> Result<V::Value, Self::Error> {
        self.deserialize_u64(v)
    }
    fn deserialize_u8<V: Visitor<'de>>(self, v: V) -> Result<V::Value, Self::Error> {
        self.deserialize_u64(v)
    }
    fn deserialize_u16<V: Visitor<'de>>(self, v: V) -> Result<V::Value, Self::Error> {
        self.deserialize_u64(v)
    }
    fn deserialize_u32<V: Visitor<'de>>(self, v: V) -> Result<V::Value, Self::Error> {
        self.deserialize_u64(v)
    }
    fn deserialize_u64<V: Visitor<'de>>(mut self, v: V) -> Result<V::Value, Self::Error> {
        self.leaf("integer");
        v.visit_u64(0)
    }
    fn deserialize_f32<V: Visitor<'de>>(self, v: V) -> Result<V::Value, Self::Error> {
        self.deserialize_f64(v)
    }
    fn deserialize_f64<V: Visitor<'de>>(mut self, v: V) -> Result<V::Value, Self::Error> {
        self.leaf("float");
        v.visit_f64(0.0)
    }
    fn deserialize_char<V: Visitor<'de>>(self, v: V) -> Result<V::Value, Self::Error> {
        self.deserialize_str(v)
    }
    fn deserialize_str<V: Visitor<'de>>(mut self, v: V) -> Result<V::Value, Self::Error> {
        self.leaf("string");
        v.visit_str("x")
    }
    fn deserialize_string<V: Visitor<'de>>(self, v: V) -> Result<V::Value, Self::Error> {
        self.deserialize_str(v)
    }
    fn deserialize_bytes<V: Visitor<'de>>(self, v: V) -> Result<V::Value, Self::Error> {
        self.deserialize_str(v)
    }
    fn deserialize_byte_buf<V: Visitor<'de>>(self, v: V) -> Result<V::Value, Self::Error> {
        self.deserialize_str(v)
    }
    fn deserialize_option<V: Visitor<'de>>(self, v: V) -> Result<V::Value, Self::Error> {
        v.visit_some(self)
    }
    fn deserialize_unit<V: Visitor<'de>>(self, v: V) -> Result<V::Value, Self::Error> {
        v.visit_unit()
    }
    fn deserialize_unit_struct<V: Visitor<'de>>(
        self,
        _: &'static str,
        v: V,
    ) -> Result<V::Value, Self::Error> {
        v.visit_unit()
    }
    fn deserialize_newtype_struct<V: Visitor<'de>>(
        self,
        _: &'static str,
        v: V,
    ) -> Result<V::Value, Self::Error> {
        v.visit_newtype_struct(self)
    }
    fn deserialize_seq<V: Visitor<'de>>(self, v: V) -> Result<V::Value, Self::Error> {
        let Walk {
            path,
            found,
            record,
        } = self;
        let r = v.visit_seq(OneElement(Some(Walk {
            path: path.clone(),
            found: &mut *found,
            record,
        })));
        // An array of tables (`[[device]]`) is a path of tables, not a key; an array of
        // values is one key, whatever its element recorded.
        let prefix = format!("{path}.");
        if record && !path.is_empty() && !found.keys().any(|k| k.starts_with(&prefix)) {
            found.insert(path, "array");
        }
        r
    }
    fn deserialize_tuple<V: Visitor<'de>>(self, _: usize, v: V) -> Result<V::Value, Self::Error> {
        self.deserialize_seq(v)
    }
    fn deserialize_tuple_struct<V: Visitor<'de>>(
        self,
        _: &'static str,
        _: usize,
        v: V,
    ) -> Result<V::Value, Self::Error> {
        self.deserialize_seq(v)
    }
    fn deserialize_map<V: Visitor<'de>>(mut self, v: V) -> Result<V::Value, Self::Error> {
        // A table of user-named tables: one entry, named `<name>`.
        v.visit_map(Fields {
            fields: &["<name>"],
            at: 0,
            walk: self.child("<name>"),
            key_walk: true,
        })
    }
    fn deserialize_struct<V: Visitor<'de>>(
        self,
        name: &'static str,
        fields: &'static [&'static str],
        v: V,
    ) -> Result<V::Value, Self::Error> {
        v.visit_map(Fields {
            fields,
            at: 0,
            walk: self,
            key_walk: name == SPANNED,
        })
    }
    fn deserialize_enum<V: Visitor<'de>>(
        self,
        _: &'static str,
        _: &'static [&'static str],
        _: V,
    ) -> Result<V::Value, Self::Error> {
        Err(de::Error::custom(
            "the config has no externally tagged enums",
        ))
    }
    fn deserialize_identifier<V: Visitor<'de>>(self, v: V) -> Result<V::Value, Self::Error> {
        v.visit_str("x")
    }
    fn deserialize_ignored_any<V: Visitor<'de>>(self, v: V) -> Result<V::Value, Self::Error> {
        v.visit_unit()
    }
}

struct OneElement<'a>(Option<Walk<'a>>);

impl<'de> SeqAccess<'de> for OneElement<'_> {
    type Error = de::value::Error;
    fn next_element_seed<T: DeserializeSeed<'de>>(
        &mut self,
        seed: T,
    ) -> Result<Option<T::Value>, Self::Error> {
        match self.0.take() {
            Some(w) => seed.deserialize(w).map(Some),
            None => Ok(None),
        }
    }
}

/// A struct's fields (or a map's one `<name>` entry), each walked under its key.
struct Fields<'a> {
    fields: &'static [&'static str],
    at: usize,
    walk: Walk<'a>,
    /// For a Spanned wrapper and a map: the entries do not extend the path (the span's
    /// fields are bookkeeping; the map's value already has `<name>` in its path).
    key_walk: bool,
}

impl<'de> MapAccess<'de> for Fields<'_> {
    type Error = de::value::Error;
    fn next_key_seed<K: DeserializeSeed<'de>>(
        &mut self,
        seed: K,
    ) -> Result<Option<K::Value>, Self::Error> {
        let Some(f) = self.fields.get(self.at) else {
            return Ok(None);
        };
        if *f == "<name>" {
            // A map key: walked, recorded as nothing (a Spanned<String> key is a struct).
            return seed
                .deserialize(Walk {
                    path: String::new(),
                    found: &mut *self.walk.found,
                    record: false,
                })
                .map(Some);
        }
        seed.deserialize(de::value::BorrowedStrDeserializer::new(f))
            .map(Some)
    }
    fn next_value_seed<V: DeserializeSeed<'de>>(
        &mut self,
        seed: V,
    ) -> Result<V::Value, Self::Error> {
        let f = self.fields.get(self.at).copied().unwrap_or_default();
        self.at += 1;
        if self.key_walk {
            let record = self.walk.record && (f == SPANNED_VALUE || f == "<name>");
            return seed.deserialize(Walk {
                path: self.walk.path.clone(),
                found: &mut *self.walk.found,
                record,
            });
        }
        seed.deserialize(self.walk.child(f))
    }
}
