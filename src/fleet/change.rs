//! Entries of the change stream: what one instance tells the others. An entry is a
//! Redis Stream entry whose fields are `op` (`admit`, `invalidate`, `gen` or `rebuild`),
//! `f` (the filter's name), `src` (the writing instance), and for `admit` `forget`
//! (`absence` or `everything`) and `keys`, for `invalidate` `keys`, for `gen` `g` (the
//! generation); `rebuild` (a rebuild asked on an instance that does not build) has no
//! other field.
//!
//! `keys` holds keys in their canonical text, each as a 4-byte big-endian length and
//! its bytes. Whoever can write to Redis can write an entry, so reading one trusts
//! nothing: an unknown op, a missing field, a length past the end, a key that is not
//! UTF-8, or one that is not canonical under its filter's rule refuses the whole entry.

use std::borrow::Cow;
use std::collections::HashMap;
use std::sync::Arc;

use redis::Value;

use crate::gate::admit::Forget;
pub use crate::gate::admit::{Change, MAX_KEYS_PER_ENTRY};
use bloomgate_core::config::Normalize;
use bloomgate_core::key::{KeyBytes, OwnedKey, normalize};

/// A change as read back, or a generation announcement.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Entry {
    /// See [`Change`].
    Change(Change),
    /// The builder made generation `generation` of `filter` current.
    Generation {
        /// The filter's name.
        filter: Arc<str>,
        /// The generation.
        generation: u64,
    },
    /// A rebuild of `filter` was asked for on an instance that is not its builder.
    Rebuild {
        /// The filter's name.
        filter: Arc<str>,
    },
}

/// The stream fields of a rebuild request for `filter`, written by instance `src`.
pub fn rebuild_fields(filter: &str, src: &str) -> [(&'static str, Vec<u8>); 3] {
    [
        ("op", b"rebuild".to_vec()),
        ("f", filter.as_bytes().to_vec()),
        ("src", src.as_bytes().to_vec()),
    ]
}

/// Why an entry was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EntryError {
    /// A field the op needs is absent or not a string.
    #[error("field {0} is missing")]
    Missing(&'static str),
    /// The op is not one this build knows.
    #[error("unknown op {0:?}")]
    UnknownOp(String),
    /// The filter is not configured here.
    #[error("unknown filter {0:?}")]
    UnknownFilter(String),
    /// A field's value cannot be read.
    #[error("field {0} is malformed")]
    Malformed(&'static str),
    /// A key is not in its filter's canonical form.
    #[error("key {0:?} is not canonical for its filter")]
    NotCanonical(String),
}

impl Change {
    /// The stream fields of this change, written by instance `src`.
    pub fn fields(&self, src: &str) -> Vec<(&'static str, Vec<u8>)> {
        match self {
            Change::Admit {
                filter,
                keys,
                forget,
            } => vec![
                ("op", b"admit".to_vec()),
                ("f", filter.as_bytes().to_vec()),
                ("src", src.as_bytes().to_vec()),
                ("forget", forget_name(*forget).as_bytes().to_vec()),
                ("keys", encode_keys(keys)),
            ],
            Change::Invalidate { filter, keys } => vec![
                ("op", b"invalidate".to_vec()),
                ("f", filter.as_bytes().to_vec()),
                ("src", src.as_bytes().to_vec()),
                ("keys", encode_keys(keys)),
            ],
        }
    }

    /// The filter this change is about.
    pub fn filter(&self) -> &str {
        match self {
            Change::Admit { filter, .. } | Change::Invalidate { filter, .. } => filter,
        }
    }
}

fn forget_name(f: Forget) -> &'static str {
    match f {
        Forget::Absence => "absence",
        Forget::Everything => "everything",
    }
}

/// Keys as lengths and bytes.
pub fn encode_keys(keys: &[OwnedKey]) -> Vec<u8> {
    let mut out = Vec::new();
    let mut bytes = KeyBytes::new();
    for k in keys {
        let norm = k.as_norm();
        let b = bytes.of(&norm);
        // Keys are bounded far below 4 GiB by the request limits.
        out.extend_from_slice(&(b.len() as u32).to_be_bytes());
        out.extend_from_slice(b);
    }
    out
}

/// Reads keys written by [`encode_keys`], each checked canonical under `rule`.
pub fn decode_keys(mut raw: &[u8], rule: &Normalize) -> Result<Vec<OwnedKey>, EntryError> {
    let mut keys = Vec::new();
    while !raw.is_empty() {
        let Some((len, rest)) = raw.split_first_chunk::<4>() else {
            return Err(EntryError::Malformed("keys"));
        };
        let len = u32::from_be_bytes(*len) as usize;
        if rest.len() < len || keys.len() >= MAX_KEYS_PER_ENTRY {
            return Err(EntryError::Malformed("keys"));
        }
        let (key, rest) = rest.split_at(len);
        let text = std::str::from_utf8(key).map_err(|_| EntryError::Malformed("keys"))?;
        let norm = normalize(rule, Cow::Borrowed(text))
            .map_err(|_| EntryError::NotCanonical(text.to_owned()))?;
        let mut bytes = KeyBytes::new();
        if bytes.of(&norm) != key {
            return Err(EntryError::NotCanonical(text.to_owned()));
        }
        keys.push(norm.to_owned_key());
        raw = rest;
    }
    Ok(keys)
}

/// Reads one stream entry's fields; `rule_of` gives the normalisation rule of a
/// configured filter (and its name, shared), `None` for an unknown one.
pub fn decode(
    fields: &HashMap<String, Value>,
    rule_of: impl Fn(&str) -> Option<(Arc<str>, Normalize)>,
) -> Result<(Entry, Option<String>), EntryError> {
    let text = |name: &'static str| -> Result<&[u8], EntryError> {
        match fields.get(name) {
            Some(Value::BulkString(b)) => Ok(b.as_slice()),
            Some(Value::SimpleString(s)) => Ok(s.as_bytes()),
            _ => Err(EntryError::Missing(name)),
        }
    };
    let src = text("src")
        .ok()
        .and_then(|s| std::str::from_utf8(s).ok())
        .map(str::to_owned);
    let op = text("op")?;
    let name = std::str::from_utf8(text("f")?).map_err(|_| EntryError::Malformed("f"))?;
    let (filter, rule) = rule_of(name).ok_or_else(|| EntryError::UnknownFilter(name.to_owned()))?;
    let entry = match op {
        b"admit" => {
            let forget = match text("forget")? {
                b"absence" => Forget::Absence,
                b"everything" => Forget::Everything,
                _ => return Err(EntryError::Malformed("forget")),
            };
            Entry::Change(Change::Admit {
                filter,
                keys: decode_keys(text("keys")?, &rule)?,
                forget,
            })
        }
        b"invalidate" => Entry::Change(Change::Invalidate {
            filter,
            keys: decode_keys(text("keys")?, &rule)?,
        }),
        b"gen" => {
            let g = std::str::from_utf8(text("g")?)
                .ok()
                .and_then(|s| s.parse::<u64>().ok())
                .ok_or(EntryError::Malformed("g"))?;
            Entry::Generation {
                filter,
                generation: g,
            }
        }
        b"rebuild" => Entry::Rebuild { filter },
        other => return Err(EntryError::UnknownOp(String::from_utf8_lossy(other).into())),
    };
    Ok((entry, src))
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn rules(name: &str) -> Option<(Arc<str>, Normalize)> {
        match name {
            "ints" => Some((Arc::from("ints"), Normalize::Integer)),
            "texts" => Some((
                Arc::from("texts"),
                Normalize::String {
                    lowercase: false,
                    max_len: 128,
                },
            )),
            _ => None,
        }
    }

    fn as_map(fields: Vec<(&'static str, Vec<u8>)>) -> HashMap<String, Value> {
        fields
            .into_iter()
            .map(|(k, v)| (k.to_owned(), Value::BulkString(v)))
            .collect()
    }

    proptest! {
        /// Whatever keys an admission carries, the reader gets them back as written.
        #[test]
        fn admissions_read_back_as_written(ints in proptest::collection::vec(any::<u64>(), 0..50),
                                           everything in any::<bool>()) {
            let forget = if everything { Forget::Everything } else { Forget::Absence };
            let change = Change::Admit {
                filter: Arc::from("ints"),
                keys: ints.iter().map(|n| OwnedKey::Int(*n)).collect(),
                forget,
            };
            let (entry, src) = decode(&as_map(change.fields("a-1")), rules).expect("decodes");
            prop_assert_eq!(entry, Entry::Change(change));
            prop_assert_eq!(src.as_deref(), Some("a-1"));
        }

        /// Any bytes in `keys` either decode to canonical keys or refuse the entry; they
        /// never panic and never yield a key its filter would not produce.
        #[test]
        fn arbitrary_key_bytes_are_refused_or_canonical(raw in proptest::collection::vec(any::<u8>(), 0..64)) {
            if let Ok(keys) = decode_keys(&raw, &Normalize::Integer) {
                prop_assert_eq!(encode_keys(&keys), raw);
            }
        }
    }

    #[test]
    fn entries_written_by_hand_are_refused_for_what_is_wrong() {
        let ok = || {
            as_map(
                Change::Admit {
                    filter: Arc::from("ints"),
                    keys: vec![OwnedKey::Int(7)],
                    forget: Forget::Absence,
                }
                .fields("a"),
            )
        };
        type Spoil = Box<dyn Fn(&mut HashMap<String, Value>)>;
        let cases: Vec<(&str, Spoil, EntryError)> = vec![
            (
                "no op",
                Box::new(|m| {
                    m.remove("op");
                }),
                EntryError::Missing("op"),
            ),
            (
                "unknown op",
                Box::new(|m| {
                    m.insert("op".into(), Value::BulkString(b"drop".to_vec()));
                }),
                EntryError::UnknownOp("drop".into()),
            ),
            (
                "unknown filter",
                Box::new(|m| {
                    m.insert("f".into(), Value::BulkString(b"other".to_vec()));
                }),
                EntryError::UnknownFilter("other".into()),
            ),
            (
                "bad forget",
                Box::new(|m| {
                    m.insert("forget".into(), Value::BulkString(b"all".to_vec()));
                }),
                EntryError::Malformed("forget"),
            ),
            (
                "length past the end",
                Box::new(|m| {
                    m.insert("keys".into(), Value::BulkString(vec![0, 0, 0, 9, b'1']));
                }),
                EntryError::Malformed("keys"),
            ),
            (
                "leading zero",
                Box::new(|m| {
                    m.insert("keys".into(), Value::BulkString(encode_raw(&[b"007"])));
                }),
                EntryError::NotCanonical("007".into()),
            ),
            (
                "not a number",
                Box::new(|m| {
                    m.insert("keys".into(), Value::BulkString(encode_raw(&[b"x"])));
                }),
                EntryError::NotCanonical("x".into()),
            ),
            (
                "not UTF-8",
                Box::new(|m| {
                    m.insert("keys".into(), Value::BulkString(encode_raw(&[&[0xff]])));
                }),
                EntryError::Malformed("keys"),
            ),
            (
                "integer value",
                Box::new(|m| {
                    m.insert("keys".into(), Value::Int(7));
                }),
                EntryError::Missing("keys"),
            ),
        ];
        for (what, spoil, want) in cases {
            let mut m = ok();
            spoil(&mut m);
            assert_eq!(decode(&m, rules).map(|e| e.0), Err(want), "{what}");
        }
        assert!(decode(&ok(), rules).is_ok());
    }

    #[test]
    fn a_rebuild_request_reads_back_for_a_known_filter_only() {
        let (entry, src) =
            decode(&as_map(rebuild_fields("ints", "a").to_vec()), rules).expect("decodes");
        assert_eq!(
            (entry, src.as_deref()),
            (
                Entry::Rebuild {
                    filter: Arc::from("ints")
                },
                Some("a")
            )
        );
        assert_eq!(
            decode(&as_map(rebuild_fields("nope", "a").to_vec()), rules),
            Err(EntryError::UnknownFilter("nope".into()))
        );
    }

    #[test]
    fn text_keys_must_be_in_their_filters_canonical_form() {
        let rule = Normalize::String {
            lowercase: false,
            max_len: 128,
        };
        let canonical = encode_keys(&[OwnedKey::Text(Arc::from("abc"))]);
        assert_eq!(
            decode_keys(&canonical, &rule),
            Ok(vec![OwnedKey::Text(Arc::from("abc"))])
        );
        let spaced = encode_raw(&[b" abc "]);
        assert!(matches!(
            decode_keys(&spaced, &rule),
            Err(EntryError::NotCanonical(_))
        ));
    }

    #[test]
    fn a_generation_announcement_names_its_filter_and_number() {
        let mut m = HashMap::new();
        for (k, v) in [("op", "gen"), ("f", "ints"), ("g", "42"), ("src", "b")] {
            m.insert(k.to_owned(), Value::BulkString(v.as_bytes().to_vec()));
        }
        let (entry, _) = decode(&m, rules).expect("decodes");
        assert_eq!(
            entry,
            Entry::Generation {
                filter: Arc::from("ints"),
                generation: 42
            }
        );
        m.insert("g".into(), Value::BulkString(b"-1".to_vec()));
        assert_eq!(
            decode(&m, rules).map(|e| e.0),
            Err(EntryError::Malformed("g"))
        );
    }

    fn encode_raw(keys: &[&[u8]]) -> Vec<u8> {
        let mut out = Vec::new();
        for k in keys {
            out.extend_from_slice(&(k.len() as u32).to_be_bytes());
            out.extend_from_slice(k);
        }
        out
    }
}
