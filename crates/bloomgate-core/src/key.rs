//! Key normalisation: the one function that turns a raw key (from a request or from a
//! database row) into the canonical form the filter and the cache see. Requests and the
//! loader share it, so "007" in a URL and 7 in a column can never disagree. It does not
//! extract keys from requests (see `pattern::route`).

use std::borrow::Cow;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

/// How a raw key becomes the canonical bytes that the filter and cache see.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase", deny_unknown_fields)]
pub enum Normalize {
    /// An unsigned 64-bit integer in canonical decimal form (`007` and `+7` become `7`).
    #[default]
    Integer,
    /// Text: trimmed, optionally lowercased, at most `max_len` bytes.
    String {
        /// Fold ASCII and Unicode letters to lower case.
        #[serde(default)]
        lowercase: bool,
        /// Longest accepted key, in bytes after trimming and lowercasing.
        #[serde(default = "default_max_len")]
        max_len: usize,
    },
}

fn default_max_len() -> usize {
    128
}

/// Why a raw key was refused. Every variant becomes a 400 before any lookup.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KeyError {
    /// The query parameter (named from the config) is absent.
    #[error("the query parameter `{0}` is missing")]
    Missing(String),
    /// Present but empty after trimming.
    #[error("the key is empty")]
    Empty,
    /// Not an unsigned decimal integer.
    #[error("the key must be an unsigned decimal integer")]
    NotAnInteger,
    /// Digits, but larger than 18446744073709551615.
    #[error("the key is out of range for a 64-bit unsigned integer")]
    OutOfRange,
    /// Longer than the route allows.
    #[error("the key is longer than {0} bytes")]
    TooLong(usize),
    /// Contains control characters or invalid percent-encoding.
    #[error("the key contains characters that are not allowed")]
    InvalidCharacters,
    /// A key segment that an upstream could read as another key: `;` parameters, an
    /// escaped `/` or `\`, NUL, or a `.suffix` on a route that does not allow dots.
    #[error("the key segment is not in canonical form (no ';', escaped '/' or '\\', or '.suffix')")]
    NotCanonical,
    /// The parameter (named from the config) appears twice, or in another case too.
    #[error("the query parameter `{0}` is given more than once")]
    Ambiguous(String),
    /// A query parameter the route neither reads nor forwards, on a route that refuses
    /// them.
    #[error("the query parameter `{0}` is not accepted on this route")]
    Undeclared(String),
}

impl KeyError {
    /// Stable machine-readable code, used in JSON error bodies.
    pub fn code(&self) -> &'static str {
        match self {
            KeyError::Missing(_) => "missing_key",
            KeyError::Empty => "empty_key",
            KeyError::NotAnInteger => "key_not_an_integer",
            KeyError::OutOfRange => "key_out_of_range",
            KeyError::TooLong(_) => "key_too_long",
            KeyError::InvalidCharacters => "key_invalid_characters",
            KeyError::NotCanonical => "key_not_canonical",
            KeyError::Ambiguous(_) => "ambiguous_key",
            KeyError::Undeclared(_) => "undeclared_parameter",
        }
    }
}

/// A key in canonical form. Borrowed from the request where no rewriting was needed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NormKey<'a> {
    /// An integer key; its canonical bytes are its decimal digits.
    Int(u64),
    /// A text key after trimming and optional lowercasing.
    Text(Cow<'a, str>),
}

/// Stack space for the canonical bytes of a key, so hashing an integer key allocates nothing.
pub struct KeyBytes {
    buf: itoa::Buffer,
}

impl KeyBytes {
    /// An empty buffer.
    pub fn new() -> Self {
        KeyBytes {
            buf: itoa::Buffer::new(),
        }
    }

    /// The bytes the filter hashes for `key`.
    pub fn of<'k>(&'k mut self, key: &'k NormKey<'_>) -> &'k [u8] {
        match key {
            NormKey::Int(n) => self.buf.format(*n).as_bytes(),
            NormKey::Text(s) => s.as_bytes(),
        }
    }
}

impl Default for KeyBytes {
    fn default() -> Self {
        Self::new()
    }
}

impl NormKey<'_> {
    /// An owned copy fit for a cache key.
    pub fn to_owned_key(&self) -> OwnedKey {
        match self {
            NormKey::Int(n) => OwnedKey::Int(*n),
            NormKey::Text(s) => OwnedKey::Text(Arc::from(s.as_ref())),
        }
    }
}

/// An owned canonical key, cheap to clone (used in cache keys and logs).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum OwnedKey {
    /// See [`NormKey::Int`].
    Int(u64),
    /// See [`NormKey::Text`].
    Text(Arc<str>),
}

impl OwnedKey {
    /// Borrowed view, for hashing and binding.
    pub fn as_norm(&self) -> NormKey<'_> {
        match self {
            OwnedKey::Int(n) => NormKey::Int(*n),
            OwnedKey::Text(s) => NormKey::Text(Cow::Borrowed(s)),
        }
    }
}

impl std::fmt::Display for OwnedKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            OwnedKey::Int(n) => write!(f, "{n}"),
            OwnedKey::Text(s) => f.write_str(s),
        }
    }
}

/// Applies `rule` to `raw`.
pub fn normalize<'a>(rule: &Normalize, raw: Cow<'a, str>) -> Result<NormKey<'a>, KeyError> {
    match rule {
        Normalize::Integer => parse_u64(raw.trim()).map(NormKey::Int),
        Normalize::String { lowercase, max_len } => {
            normalize_text(raw, *lowercase, *max_len).map(NormKey::Text)
        }
    }
}

fn parse_u64(s: &str) -> Result<u64, KeyError> {
    let digits = s.strip_prefix('+').unwrap_or(s);
    if digits.is_empty() {
        return Err(if s.is_empty() {
            KeyError::Empty
        } else {
            KeyError::NotAnInteger
        });
    }
    // Every byte is checked before any is added up, so that text which merely starts
    // with many digits is "not an integer" rather than "out of range".
    if !digits.bytes().all(|b| b.is_ascii_digit()) {
        return Err(KeyError::NotAnInteger);
    }
    let mut n: u64 = 0;
    for b in digits.bytes() {
        n = n
            .checked_mul(10)
            .and_then(|n| n.checked_add(u64::from(b - b'0')))
            .ok_or(KeyError::OutOfRange)?;
    }
    Ok(n)
}

fn normalize_text(
    raw: Cow<'_, str>,
    lowercase: bool,
    max_len: usize,
) -> Result<Cow<'_, str>, KeyError> {
    let trimmed: Cow<'_, str> = match raw {
        Cow::Borrowed(s) => Cow::Borrowed(s.trim()),
        Cow::Owned(s) => {
            let t = s.trim();
            if t.len() == s.len() {
                Cow::Owned(s)
            } else {
                Cow::Owned(t.to_owned())
            }
        }
    };
    if trimmed.is_empty() {
        return Err(KeyError::Empty);
    }
    if trimmed.len() > max_len {
        return Err(KeyError::TooLong(max_len));
    }
    if trimmed.chars().any(char::is_control) {
        return Err(KeyError::InvalidCharacters);
    }
    if lowercase && trimmed.chars().any(changes_when_lowercased) {
        // Lower case can be longer (`Ⱥ` is 2 bytes, `ⱥ` 3), and the bound is on the key
        // the filter and the cache see.
        let lower = trimmed.to_lowercase();
        if lower.len() > max_len {
            return Err(KeyError::TooLong(max_len));
        }
        return Ok(Cow::Owned(lower));
    }
    Ok(trimmed)
}

/// Whether lowercasing rewrites `c`: upper-case letters, and also title-case ones such as
/// `ǅ`, which `char::is_uppercase` does not count.
fn changes_when_lowercased(c: char) -> bool {
    let mut lower = c.to_lowercase();
    lower.next() != Some(c) || lower.next().is_some()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn int(s: &str) -> Result<NormKey<'_>, KeyError> {
        normalize(&Normalize::Integer, Cow::Borrowed(s))
    }

    #[test]
    fn integers_take_canonical_form() {
        assert_eq!(int("123"), Ok(NormKey::Int(123)));
        assert_eq!(int("007"), Ok(NormKey::Int(7)));
        assert_eq!(int(" +42 "), Ok(NormKey::Int(42)));
        assert_eq!(int("18446744073709551615"), Ok(NormKey::Int(u64::MAX)));
        let mut b = KeyBytes::new();
        assert_eq!(b.of(&NormKey::Int(7)), b"7");
    }

    #[test]
    fn malformed_integers_are_refused() {
        assert_eq!(int(""), Err(KeyError::Empty));
        assert_eq!(int("+"), Err(KeyError::NotAnInteger));
        assert_eq!(int("-1"), Err(KeyError::NotAnInteger));
        assert_eq!(int("12a"), Err(KeyError::NotAnInteger));
        assert_eq!(int("1.0"), Err(KeyError::NotAnInteger));
        assert_eq!(int("١٢"), Err(KeyError::NotAnInteger));
        assert_eq!(int("18446744073709551616"), Err(KeyError::OutOfRange));
        // Too many digits for a u64, but not digits only: not an integer at all.
        assert_eq!(int("99999999999999999999x"), Err(KeyError::NotAnInteger));
        assert_eq!(int("18446744073709551616¡"), Err(KeyError::NotAnInteger));
    }

    #[test]
    fn strings_trim_fold_and_bound() {
        let rule = Normalize::String {
            lowercase: true,
            max_len: 8,
        };
        let k = normalize(&rule, Cow::Borrowed("  AbC ")).expect("valid");
        assert_eq!(k, NormKey::Text(Cow::Borrowed("abc")));
        let k = normalize(&rule, Cow::Borrowed("abc")).expect("valid");
        assert!(matches!(k, NormKey::Text(Cow::Borrowed("abc"))));
        assert_eq!(
            normalize(&rule, Cow::Borrowed("123456789")),
            Err(KeyError::TooLong(8))
        );
        assert_eq!(normalize(&rule, Cow::Borrowed("   ")), Err(KeyError::Empty));
        assert_eq!(
            normalize(&rule, Cow::Borrowed("a\u{0}b")),
            Err(KeyError::InvalidCharacters)
        );
    }

    #[test]
    fn lowercasing_folds_title_case_and_keeps_the_bound() {
        let rule = |max_len| Normalize::String {
            lowercase: true,
            max_len,
        };
        // Title case (Lt) is not upper case (Lu) but still has a lower case: all three
        // spellings of the digraph are one key.
        for raw in ["\u{1c4}", "\u{1c5}", "\u{1c6}"] {
            let k = normalize(&rule(8), Cow::Borrowed(raw)).expect("valid");
            assert_eq!(k, NormKey::Text(Cow::Borrowed("\u{1c6}")), "{raw:?}");
        }
        // `Ⱥ` (2 bytes) lowercases to `ⱥ` (3 bytes): the bound holds after folding.
        assert_eq!(
            normalize(&rule(2), Cow::Borrowed("\u{23a}")),
            Err(KeyError::TooLong(2))
        );
        let k = normalize(&rule(3), Cow::Borrowed("\u{23a}")).expect("valid");
        assert_eq!(k, NormKey::Text(Cow::Borrowed("\u{2c65}")));
        // A letter without a lower case is left alone and borrowed.
        let k = normalize(&rule(8), Cow::Borrowed("\u{1d400}")).expect("valid");
        assert!(matches!(k, NormKey::Text(Cow::Borrowed("\u{1d400}"))));
    }
}
