//! Fuzz tests of the three parsers that read untrusted input, through the public API:
//! key normalisation (raw keys from request paths and query strings), config parsing (a
//! TOML file edited by hand) and snapshot reading (a file on disk that may be cut short,
//! damaged or forged). Every property checks that any input gives a value or an error,
//! never a panic, and then the invariants that make the value safe to use. It does not
//! run the proxy; case counts are bounded so the whole file takes seconds in a debug build.

use std::alloc::{GlobalAlloc, Layout, System};
use std::borrow::Cow;
use std::cell::Cell;
use std::fs;
use std::io::Write;
use std::sync::OnceLock;

use bloomgate::config::{Config, ConfigError, Normalize, Problem};
use bloomgate::filter::snapshot::{self, FORMAT_VERSION, MAGIC, Snapshot, SnapshotError};
use bloomgate::filter::{BLOCK_BITS, BloomFilter, BloomParams, MAX_BITS};
use bloomgate::key::{KeyBytes, KeyError, NormKey, normalize};
use bloomgate::watermark::Watermark;
use proptest::collection::vec;
use proptest::prelude::*;
use proptest::sample::{Index, select};
use tempfile::{NamedTempFile, TempDir};

/// Cases per key property: a case takes microseconds.
const KEY_CASES: u32 = 10_000;

/// Cases per config property: a case takes about a millisecond in a debug build.
const CONFIG_CASES: u32 = 2_000;

/// Cases per snapshot property: a case writes, reads and removes a small file.
const SNAPSHOT_CASES: u32 = 2_000;

// ---------------------------------------------------------------------------------------
// Measuring allocations
// ---------------------------------------------------------------------------------------

/// The system allocator, recording the largest single request a thread makes inside
/// [`largest_allocation`] and refusing any larger than [`ALLOCATION_LIMIT`] there, so a
/// reader that trusts a forged length aborts the test at once ("memory allocation of N
/// bytes failed") instead of exhausting the machine.
struct Measuring;

#[global_allocator]
static ALLOCATOR: Measuring = Measuring;

/// No snapshot in this file is larger than a few KiB; 64 MiB is absurd for all of them.
const ALLOCATION_LIMIT: usize = 64 << 20;

/// What a read may allocate beyond the size of the file: paths, error messages, the
/// filter's header.
const ALLOCATION_SLACK: usize = 4096;

thread_local! {
    /// Whether this thread is inside [`largest_allocation`].
    static MEASURING: Cell<bool> = const { Cell::new(false) };
    /// The largest request seen while measuring.
    static LARGEST: Cell<usize> = const { Cell::new(0) };
}

/// Records a request for `size` bytes; `true` if it must be refused.
fn note(size: usize) -> bool {
    if !MEASURING.with(Cell::get) {
        return false;
    }
    LARGEST.with(|l| l.set(l.get().max(size)));
    size > ALLOCATION_LIMIT
}

// SAFETY: every call is forwarded unchanged to the system allocator, except requests over
// the limit while measuring, which get the null pointer that signals a failed allocation.
// The bookkeeping touches only const-initialised thread-locals, which do not allocate.
unsafe impl GlobalAlloc for Measuring {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if note(layout.size()) {
            return std::ptr::null_mut();
        }
        // SAFETY: same contract as the caller's.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        if note(layout.size()) {
            return std::ptr::null_mut();
        }
        // SAFETY: same contract as the caller's.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if note(new_size) {
            return std::ptr::null_mut();
        }
        // SAFETY: same contract as the caller's.
        unsafe { System.realloc(ptr, layout, new_size) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: same contract as the caller's.
        unsafe { System.dealloc(ptr, layout) }
    }
}

/// Ends a measurement even if the measured code panics.
struct MeasureGuard;

impl Drop for MeasureGuard {
    fn drop(&mut self) {
        MEASURING.with(|m| m.set(false));
    }
}

/// Runs `f` and returns its result with the largest single allocation it requested.
fn largest_allocation<T>(f: impl FnOnce() -> T) -> (T, usize) {
    LARGEST.with(|l| l.set(0));
    MEASURING.with(|m| m.set(true));
    let guard = MeasureGuard;
    let out = f();
    drop(guard);
    (out, LARGEST.with(Cell::get))
}

// ---------------------------------------------------------------------------------------
// 1. Key normalisation
// ---------------------------------------------------------------------------------------

/// White space that `str::trim` removes, ASCII and not.
const SPACES: &str = " \t\n\r\u{0b}\u{0c}\u{85}\u{a0}\u{1680}\u{2028}\u{3000}";

/// Characters a normaliser can get wrong: white space and invisible characters, controls,
/// signs and separators, digits of other scripts, and letters whose lower case differs
/// in length or is not a plain mapping (`İ` and `Ⱥ` grow, the Kelvin sign `\u{212a}`
/// shrinks, `ǅ` is title case, `𝐀` has no lower case, `Σ` depends on its position).
const TRICKY: &str =
    " \t\n\0\u{7f}\u{85}\u{a0}\u{3000}\u{feff}\u{200b}+-.,ex%/0٣０𝟗aZÉéİǅΣßẞ\u{212a}Ⱥ𝐀\u{10ffff}";

/// One of the characters of `set`.
fn one_of(set: &str) -> impl Strategy<Value = char> + use<> {
    select(set.chars().collect::<Vec<_>>())
}

/// Whitespace padding of up to three characters.
fn padding() -> impl Strategy<Value = String> {
    vec(one_of(SPACES), 0..3).prop_map(String::from_iter)
}

/// A decimal spelling of `n`: padded, maybe signed, maybe with leading zeros.
fn spell(n: u128) -> impl Strategy<Value = String> {
    (padding(), any::<bool>(), 0usize..25, padding()).prop_map(move |(left, plus, zeros, right)| {
        let sign = if plus { "+" } else { "" };
        format!("{left}{sign}{}{n}{right}", "0".repeat(zeros))
    })
}

/// Numbers in and just out of the `u64` range, small ones and huge ones.
fn number() -> impl Strategy<Value = u128> {
    let max = u128::from(u64::MAX);
    prop_oneof![
        (0u128..1000),
        any::<u64>().prop_map(u128::from),
        (max - 1000..=max),
        (max + 1..=max + 1000),
        any::<u128>(),
    ]
}

/// Raw keys as a client could send them.
fn raw_key() -> impl Strategy<Value = String> {
    prop_oneof![
        3 => vec(prop_oneof![3 => one_of(TRICKY), 1 => any::<char>()], 0..24)
            .prop_map(String::from_iter),
        3 => number().prop_flat_map(spell),
        1 => "[0-9]{15,80}",
        1 => (number(), "[^0-9]").prop_map(|(n, junk)| format!("{n}{junk}")),
        2 => any::<String>(),
    ]
}

/// A string rule with a small `max_len`, so keys hit the bound often.
fn string_rule() -> impl Strategy<Value = Normalize> {
    (any::<bool>(), 1usize..48)
        .prop_map(|(lowercase, max_len)| Normalize::String { lowercase, max_len })
}

/// Either rule.
fn rule() -> impl Strategy<Value = Normalize> {
    prop_oneof![Just(Normalize::Integer), string_rule()]
}

/// What `Normalize::Integer` promises, written for clarity rather than speed: trimmed,
/// one optional `+`, ASCII digits only, at most `u64::MAX`.
fn reference_integer(raw: &str) -> Result<u64, KeyError> {
    let trimmed = raw.trim();
    if trimmed.is_empty() {
        return Err(KeyError::Empty);
    }
    let digits = trimmed.strip_prefix('+').unwrap_or(trimmed);
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return Err(KeyError::NotAnInteger);
    }
    let significant = digits.trim_start_matches('0');
    let max = u64::MAX.to_string();
    if (significant.len(), significant) > (max.len(), max.as_str()) {
        return Err(KeyError::OutOfRange);
    }
    Ok(significant
        .bytes()
        .fold(0, |n, b| n * 10 + u64::from(b - b'0')))
}

/// What `Normalize::String` promises: trimmed, non-empty, free of control characters,
/// lowercased if asked, and at most `max_len` bytes as the filter sees it.
fn reference_text(raw: &str, lowercase: bool, max_len: usize) -> Result<String, KeyError> {
    let trimmed = raw.trim();
    if trimmed.is_empty() {
        return Err(KeyError::Empty);
    }
    if trimmed.len() > max_len {
        return Err(KeyError::TooLong(max_len));
    }
    if trimmed.chars().any(char::is_control) {
        return Err(KeyError::InvalidCharacters);
    }
    let key = if lowercase {
        trimmed.to_lowercase()
    } else {
        trimmed.to_owned()
    };
    if key.len() > max_len {
        return Err(KeyError::TooLong(max_len));
    }
    Ok(key)
}

/// Normalises `raw` under `rule`, checks every invariant of the result, and returns it
/// owned with its canonical bytes.
fn checked_normalize(
    rule: &Normalize,
    raw: &str,
) -> Result<Result<(NormKey<'static>, Vec<u8>), KeyError>, TestCaseError> {
    let key = match normalize(rule, Cow::Borrowed(raw)) {
        Ok(key) => key,
        Err(e) => {
            prop_assert!(!e.to_string().is_empty());
            prop_assert!(!e.code().is_empty());
            return Ok(Err(e));
        }
    };
    let owned = key.to_owned_key();
    prop_assert_eq!(&owned.as_norm(), &key, "owned copy of {:?}", raw);
    let bytes = KeyBytes::new().of(&key).to_vec();
    prop_assert_eq!(owned.to_string().into_bytes(), bytes.clone());

    match (rule, &key) {
        (Normalize::Integer, NormKey::Int(n)) => {
            prop_assert!(
                bytes == b"0" || bytes[0] != b'0',
                "leading zero in {:?}",
                bytes
            );
            let text = std::str::from_utf8(&bytes).expect("decimal digits are UTF-8");
            prop_assert_eq!(text.parse::<u64>().ok(), Some(*n));
        }
        (Normalize::String { lowercase, max_len }, NormKey::Text(s)) => {
            prop_assert!(!s.is_empty());
            prop_assert!(s.len() <= *max_len, "{:?} is over {} bytes", s, max_len);
            prop_assert!(!s.chars().any(char::is_control), "control in {:?}", s);
            prop_assert_eq!(s.trim(), s.as_ref());
            if *lowercase {
                prop_assert_eq!(&s.to_lowercase(), s.as_ref(), "not lower case");
            }
        }
        _ => prop_assert!(false, "{:?} gave a key of the other kind: {:?}", rule, key),
    }

    // Idempotent: the canonical bytes are their own canonical form.
    let text = std::str::from_utf8(&bytes).expect("canonical bytes are UTF-8");
    let again = normalize(rule, Cow::Borrowed(text));
    prop_assert_eq!(again.as_ref(), Ok(&key), "normalising {:?} again", text);

    let key = match key {
        NormKey::Int(n) => NormKey::Int(n),
        NormKey::Text(s) => NormKey::Text(Cow::Owned(s.into_owned())),
    };
    Ok(Ok((key, bytes)))
}

/// Two spellings of one key: the second re-pads the first, and under a lowercasing rule
/// flips the case of its ASCII letters.
fn respell(raw: &str, left: &str, right: &str, flip_case: bool) -> String {
    let core: String = raw
        .trim()
        .chars()
        .map(|c| match c {
            c if flip_case && c.is_ascii_lowercase() => c.to_ascii_uppercase(),
            c if flip_case && c.is_ascii_uppercase() => c.to_ascii_lowercase(),
            c => c,
        })
        .collect();
    format!("{left}{core}{right}")
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(KEY_CASES))]

    #[test]
    fn integer_keys_match_the_reference(raw in raw_key()) {
        let got = checked_normalize(&Normalize::Integer, &raw)?;
        let want = reference_integer(&raw);
        match (got, want) {
            (Ok((NormKey::Int(n), _)), Ok(m)) => prop_assert_eq!(n, m, "{:?}", raw),
            (Err(e), Err(f)) => prop_assert_eq!(e, f, "{:?}", raw),
            (got, want) => prop_assert!(false, "{:?}: got {:?}, want {:?}", raw, got, want),
        }
    }

    #[test]
    fn string_keys_match_the_reference(
        raw in raw_key(),
        (lowercase, max_len) in (any::<bool>(), 1usize..48),
    ) {
        let rule = Normalize::String { lowercase, max_len };
        let got = checked_normalize(&rule, &raw)?;
        match (got, reference_text(&raw, lowercase, max_len)) {
            (Ok((NormKey::Text(s), _)), Ok(t)) => prop_assert_eq!(s.as_ref(), t, "{:?}", raw),
            (Err(e), Err(f)) => prop_assert_eq!(e, f, "{:?}", raw),
            (got, want) => prop_assert!(false, "{:?}: got {:?}, want {:?}", raw, got, want),
        }
    }

    #[test]
    fn one_key_has_one_spelling_in_the_cache(
        rule in rule(),
        a in raw_key(),
        other in raw_key(),
        (left, right, flip) in (padding(), padding(), any::<bool>()),
        related in any::<bool>(),
    ) {
        let lowercase = matches!(rule, Normalize::String { lowercase: true, .. });
        let b = if related { respell(&a, &left, &right, flip && lowercase) } else { other };
        let ka = checked_normalize(&rule, &a)?;
        let kb = checked_normalize(&rule, &b)?;
        if related {
            prop_assert_eq!(&ka, &kb, "{:?} and {:?} spell one key", a, b);
        }
        if let (Ok((ka, bytes_a)), Ok((kb, bytes_b))) = (ka, kb) {
            // Equal keys have equal bytes, and equal bytes mean equal keys: the cache and
            // the filter can never tell two spellings of one key apart, nor confuse two keys.
            prop_assert_eq!(ka == kb, bytes_a == bytes_b, "{:?} and {:?}", a, b);
        }
    }
}

// ---------------------------------------------------------------------------------------
// 2. Config parsing
// ---------------------------------------------------------------------------------------

/// A config using every section: both origin kinds, both key sources, write-through.
const BASE_CONFIG: &str = r#"
[server]
listen = "127.0.0.1:0"
header_read_timeout = "5s"
max_body_bytes = 65536
shutdown_grace = "3s"

[admin]
listen = "127.0.0.1:0"
token = "fuzz-admin-token"

[upstream]
url = "http://127.0.0.1:3000"
timeout = "2s"
pool_max_idle = 8

[database]
url = "sqlite://fuzz.db"
max_connections = 4
min_connections = 1
acquire_timeout = "250ms"

[cache]
max_entries = 1000
ttl = "1m"
negative_ttl = "10s"

[filters.products]
source_query = "SELECT sku_id FROM products"
expected_items = 10000
false_positive_rate = 0.01
normalize = { kind = "integer" }
rebuild_interval = "1h"

[[routes]]
name = "product"
path = "/api/products/{id}"
key = { segment = "id" }
filter = "products"
origin = { kind = "sql", query = "SELECT * FROM products WHERE sku_id = ?", timeout = "1s" }
ttl = "30s"

[[routes]]
name = "product-info"
path = "/api/product/info"
key = { query = "sku_id" }
filter = "products"
origin = { kind = "upstream", not_found_statuses = [404, 410] }
mode = "shadow"

[[write_through]]
path = "/api/products"
methods = ["POST", "PUT"]
statuses = [201]
filter = "products"
key = { json = "data.sku_id" }

[log]
format = "json"
level = "info"
"#;

/// The top-level sections: the first part of every field an error can name.
const SECTIONS: &[&str] = &[
    "server",
    "admin",
    "upstream",
    "database",
    "cache",
    "filters",
    "routes",
    "write_through",
    "log",
];

/// One edit of a config file.
#[derive(Debug, Clone)]
enum Edit {
    DeleteLine(Index),
    DuplicateLine(Index),
    /// Replaces the value after one of the `=` signs.
    ReplaceValue(Index, Replacement),
    /// Cuts the file at a byte offset.
    Truncate(Index),
}

/// A new value for some field: of the old value's type (a quoted string for a string,
/// a number for a number) when `same_type`, so that the edit gets past the parser to
/// `validate`; else anything.
#[derive(Debug, Clone)]
struct Replacement {
    same_type: bool,
    number: String,
    text: String,
    any: String,
}

impl Replacement {
    /// The value to put where `old` was.
    fn for_value(&self, old: &str) -> &str {
        match old.chars().next() {
            Some('"') if self.same_type => &self.text,
            Some('-' | '0'..='9') if self.same_type => &self.number,
            _ => &self.any,
        }
    }
}

/// Numbers around the limits a config checks. Not here: a false-positive rate within
/// about 1e-6 of 1 together with billions of expected items, which makes validation run
/// for minutes (`BloomParams::optimal` sums a Poisson series term by term up to
/// `expected_items / blocks`); uniform floats in [0, 1) come that close once in a million.
fn number_token() -> impl Strategy<Value = String> {
    let fixed = select(vec![
        "-1",
        "0",
        "1",
        "0.0",
        "1.0",
        "0.5",
        "1e309",
        "-1e309",
        "nan",
        "inf",
        "4097",
        "99999",
        "18446744073709551615",
        "18446744073709551616",
        "9223372036854775807",
    ])
    .prop_map(str::to_owned);
    prop_oneof![
        3 => fixed,
        1 => any::<i64>().prop_map(|n| n.to_string()),
        1 => (0u32..1000).prop_map(|n| n.to_string()),
        1 => (0.0f64..1.0).prop_map(|x| x.to_string()),
    ]
}

/// Quoted strings a config check could trip on: durations, addresses, URLs, queries,
/// path patterns, methods, enum names.
fn text_token() -> impl Strategy<Value = String> {
    let fixed = select(vec![
        "",
        "0s",
        "-1s",
        "1h",
        "1ns",
        "five minutes",
        "?",
        "? ?",
        "x",
        " ",
        "127.0.0.1:0",
        "0.0.0.0:99999",
        "localhost",
        "http://",
        "https://example.test",
        "http://[::1]:1/x",
        "http://127.0.0.1:1",
        "mysql://",
        "sqlite:",
        "postgres://db",
        "/",
        "api",
        "/api/{id}/{sku}",
        "/api/{}",
        "/api/x{id}",
        "/api/?q",
        "{id}",
        "GET",
        "BAD METHOD",
        "off",
        "shadow",
        "string",
        "products",
        "has space",
        "short",
    ])
    .prop_map(toml_string);
    prop_oneof![
        3 => fixed,
        1 => "[ -~]{0,16}".prop_map(|s| toml_string(&s)),
        1 => "\\PC{0,8}".prop_map(|s| toml_string(&s)),
    ]
}

/// `s` as a TOML basic string.
fn toml_string(s: &str) -> String {
    let mut out = String::from('"');
    for c in s.chars() {
        match c {
            '"' | '\\' => {
                out.push('\\');
                out.push(c);
            }
            c if c.is_control() => out.push_str(&format!("\\u{:04x}", u32::from(c))),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// Values of any type, and text that is no TOML value at all.
fn any_token() -> impl Strategy<Value = String> {
    let fixed = select(vec![
        "true",
        "[]",
        "{}",
        "[1, \"a\"]",
        "[\"GET\", 7]",
        "{ kind = \"string\", max_len = 0 }",
        "{ kind = \"string\", lowercase = true }",
        "{ kind = \"sql\" }",
        "{ segment = \"sku\" }",
        "{ query = \"\" }",
        "'''\n'''",
        "\"\\u0000\"",
        "1979-05-27T07:32:00Z",
    ])
    .prop_map(str::to_owned);
    prop_oneof![
        2 => fixed,
        1 => number_token(),
        1 => text_token(),
        1 => "[ -~]{0,16}",
    ]
}

/// Mostly value replacements, which reach the most checks; some line edits and cuts.
fn edit() -> impl Strategy<Value = Edit> {
    let replacement = (
        prop::bool::weighted(0.8),
        number_token(),
        text_token(),
        any_token(),
    )
        .prop_map(|(same_type, number, text, any)| Replacement {
            same_type,
            number,
            text,
            any,
        });
    prop_oneof![
        1 => any::<Index>().prop_map(Edit::DeleteLine),
        1 => any::<Index>().prop_map(Edit::DuplicateLine),
        6 => (any::<Index>(), replacement).prop_map(|(at, v)| Edit::ReplaceValue(at, v)),
        1 => any::<Index>().prop_map(Edit::Truncate),
    ]
}

/// Where the values of `text` start: after each `= ` outside a quoted string.
fn value_starts(text: &str) -> Vec<usize> {
    let mut quoted = false;
    let mut starts = Vec::new();
    for (i, c) in text.char_indices() {
        match c {
            '"' => quoted = !quoted,
            '\n' => quoted = false,
            '=' if !quoted && text[i..].starts_with("= ") => starts.push(i + 2),
            _ => {}
        }
    }
    starts
}

/// Where the value that starts at byte `start` of `text` ends: at the first `,`, `}`,
/// `]` or line end outside brackets and quotes.
fn value_end(text: &str, start: usize) -> usize {
    let mut depth = 0u32;
    let mut quoted = false;
    for (i, c) in text[start..].char_indices() {
        match c {
            '"' => quoted = !quoted,
            _ if quoted => {}
            '{' | '[' => depth += 1,
            '}' | ']' if depth > 0 => depth -= 1,
            ',' | '}' | ']' | '\n' if depth == 0 => return start + i,
            _ => {}
        }
    }
    text.len()
}

/// `text` with `edit` applied.
fn apply(text: &str, edit: &Edit) -> String {
    let lines: Vec<&str> = text.lines().collect();
    match edit {
        Edit::DeleteLine(at) if !lines.is_empty() => {
            let mut lines = lines;
            lines.remove(at.index(lines.len()));
            lines.join("\n")
        }
        Edit::DuplicateLine(at) if !lines.is_empty() => {
            let mut lines = lines;
            let i = at.index(lines.len());
            lines.insert(i, lines[i]);
            lines.join("\n")
        }
        Edit::ReplaceValue(at, value) => {
            let starts = value_starts(text);
            if starts.is_empty() {
                return text.to_owned();
            }
            let start = starts[at.index(starts.len())];
            let end = value_end(text, start);
            let value = value.for_value(&text[start..end]);
            format!("{}{value}{}", &text[..start], &text[end..])
        }
        Edit::Truncate(at) => {
            let bytes = text.as_bytes();
            let cut = at.index(bytes.len() + 1);
            String::from_utf8_lossy(&bytes[..cut]).into_owned()
        }
        Edit::DeleteLine(_) | Edit::DuplicateLine(_) => text.to_owned(),
    }
}

/// Parses `text` and checks the result: an accepted config keeps every rule `validate`
/// enforces; a refused one says why, naming the field when a rule was broken.
fn check_config(text: &str) -> Result<(), TestCaseError> {
    match Config::from_toml_str(text) {
        Ok(config) => {
            prop_assert!(config.validate().is_ok());
            for route in &config.routes {
                prop_assert!(config.filters.contains_key(&route.filter));
            }
            for write in &config.write_through {
                prop_assert!(config.filters.contains_key(&write.filter));
            }
            let mut labels: Vec<&str> = config.routes.iter().map(|r| r.label()).collect();
            labels.sort_unstable();
            labels.dedup();
            prop_assert_eq!(labels.len(), config.routes.len(), "route names are unique");
        }
        Err(e) => {
            let message = e.to_string();
            prop_assert!(!message.trim().is_empty(), "empty message for {:?}", e);
            if let ConfigError::Invalid(problems) = &e {
                prop_assert!(!problems.is_empty(), "{:?}", e);
                for Problem { field, reason } in problems {
                    prop_assert!(!reason.trim().is_empty(), "{:?}", e);
                    prop_assert!(message.contains(field.as_str()), "{}", message);
                    let section = field.split(['.', '[']).next().unwrap_or_default();
                    prop_assert!(SECTIONS.contains(&section), "{:?} names no field", field);
                }
            }
        }
    }
    Ok(())
}

#[test]
fn the_base_config_is_valid() {
    let config = Config::from_toml_str(BASE_CONFIG).expect("the base config of the fuzzing");
    assert_eq!(config.routes.len(), 2);
    assert_eq!(config.filters.len(), 1);
    assert_eq!(config.write_through.len(), 1);
    assert!(config.upstream.is_some() && config.database.is_some());
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(CONFIG_CASES))]

    #[test]
    fn any_text_is_a_config_or_an_error(text in any::<String>()) {
        check_config(&text)?;
    }

    #[test]
    fn any_bytes_are_a_config_or_an_error(bytes in vec(any::<u8>(), 0..512)) {
        check_config(&String::from_utf8_lossy(&bytes))?;
    }

    #[test]
    fn toml_like_text_is_a_config_or_an_error(
        text in "(\\[{1,2}[a-z_.]{0,12}\\]{1,2}\n|[a-z_]{1,12} = [-0-9a-z\"{}\\[\\], .:=]{0,24}\n){0,12}",
    ) {
        check_config(&text)?;
    }

    #[test]
    fn edited_configs_are_accepted_or_refused_with_a_reason(edits in vec(edit(), 1..4)) {
        let text = edits.iter().fold(BASE_CONFIG.to_owned(), |text, e| apply(&text, e));
        check_config(&text)?;
    }

    #[test]
    fn retyped_values_are_validated(
        at in any::<Index>(),
        (number, text, any) in (number_token(), text_token(), any_token()),
    ) {
        // One value replaced by another of its type: mostly past the parser, into the rules.
        let value = Replacement { same_type: true, number, text, any };
        check_config(&apply(BASE_CONFIG, &Edit::ReplaceValue(at, value)))?;
    }
}

// ---------------------------------------------------------------------------------------
// 3. Snapshot reading
// ---------------------------------------------------------------------------------------

/// The header length written by format version 2.
const HEADER_LEN: usize = 73;

/// A new file under the system temp dir holding `bytes`, removed on drop.
fn temp_file(bytes: &[u8]) -> NamedTempFile {
    let mut file = NamedTempFile::new().expect("create a file in the temp dir");
    file.write_all(bytes)
        .expect("write a fuzzed snapshot to the temp dir");
    file
}

/// Reads `bytes` as a snapshot file, with both public readers; checks that they agree and
/// that neither allocated much more than the file holds.
fn read_snapshot(bytes: &[u8]) -> Result<Result<Snapshot, SnapshotError>, TestCaseError> {
    let file = temp_file(bytes);
    let (read, largest) = largest_allocation(|| snapshot::read(file.path()));
    prop_assert!(
        largest <= bytes.len() + ALLOCATION_SLACK,
        "reading a {}-byte file allocated {} bytes at once",
        bytes.len(),
        largest
    );
    let (inspected, largest) = largest_allocation(|| snapshot::inspect(file.path()));
    prop_assert!(largest <= bytes.len() + ALLOCATION_SLACK);
    match (&read, &inspected) {
        (Ok(_), Ok(summary)) => {
            prop_assert_eq!(summary.file_bytes, bytes.len() as u64);
            prop_assert_eq!(summary.version, 2);
        }
        (Err(a), Err(b)) => {
            prop_assert_eq!(a.to_string(), b.to_string());
            prop_assert!(!a.to_string().is_empty());
            // A cut file is reported with its own size and more than that as needed.
            if let SnapshotError::Truncated { expected, actual } = a {
                prop_assert_eq!(*actual, bytes.len() as u64, "{}", a);
                prop_assert!(expected > actual, "{}", a);
            }
        }
        _ => prop_assert!(
            false,
            "read and inspect disagree: {:?} / {:?}",
            read,
            inspected
        ),
    }
    Ok(read)
}

/// Bytes before the header proper: the magic, the format version and the header length.
const PREAMBLE_LEN: usize = MAGIC.len() + 8;

/// The refusal the reader's first checks give for `bytes`, in their documented order,
/// when one of them applies: a start that is not the magic (a file shorter than the
/// magic need only start like it), then a file too short for the version and header
/// length, then a version other than [`FORMAT_VERSION`]. `None` once these pass.
fn early_refusal(bytes: &[u8]) -> Option<String> {
    let seen = bytes.len().min(MAGIC.len());
    if bytes[..seen] != MAGIC[..seen] {
        return Some(SnapshotError::BadMagic.to_string());
    }
    if bytes.len() < PREAMBLE_LEN {
        return Some("truncated".to_owned());
    }
    let version = u32::from_le_bytes(bytes[8..12].try_into().expect("4 bytes"));
    (version != FORMAT_VERSION).then(|| SnapshotError::UnsupportedVersion(version).to_string())
}

/// Checks that `read` is the refusal [`early_refusal`] names for `bytes`, if it names one.
fn check_early_refusal(
    bytes: &[u8],
    read: &Result<Snapshot, SnapshotError>,
) -> Result<(), TestCaseError> {
    match (early_refusal(bytes), read) {
        (None, _) => {}
        (Some(want), Err(e @ SnapshotError::Truncated { .. })) => {
            prop_assert_eq!(want, "truncated", "{:?}", e)
        }
        (Some(want), Err(e)) => prop_assert_eq!(want, e.to_string()),
        (Some(want), Ok(_)) => prop_assert!(false, "accepted, not refused: {}", want),
    }
    Ok(())
}

/// Checks an accepted snapshot against the bytes it was read from: the filter holds
/// exactly the header's parameters and the file's words.
fn check_accepted(snap: &Snapshot, bytes: &[u8]) -> Result<(), TestCaseError> {
    let u32_at = |at: usize| u32::from_le_bytes(bytes[at..at + 4].try_into().expect("4 bytes"));
    let u64_at = |at: usize| u64::from_le_bytes(bytes[at..at + 8].try_into().expect("8 bytes"));
    let header_len = u32_at(12) as usize;
    let params = snap.filter.params();
    prop_assert_eq!(&bytes[..8], &MAGIC[..]);
    prop_assert_eq!(u32_at(8), FORMAT_VERSION);
    prop_assert_eq!(params.bits, u64_at(16));
    prop_assert_eq!(params.hashes, u32_at(24));
    prop_assert_eq!(snap.filter.seed(), u32_at(44));
    prop_assert_eq!(snap.filter.items(), u64_at(48));
    prop_assert_eq!(
        header_len + snap.filter.word_count() * 8 + 4,
        bytes.len(),
        "the file holds exactly the words"
    );
    let words = bytes[header_len..bytes.len() - 4]
        .chunks_exact(8)
        .map(|w| u64::from_le_bytes(w.try_into().expect("8 bytes")));
    prop_assert!(snap.filter.iter_words().eq(words));
    Ok(())
}

/// Checks that `snap`, written again by the public writer, reads back as the same filter
/// and watermark (the header's own length and the creation time may differ).
fn check_round_trip(snap: &Snapshot) -> Result<(), TestCaseError> {
    let params = snap.filter.params();
    let dir = TempDir::new().expect("create a temp dir");
    let path = dir.path().join("again.snap");
    snapshot::write(&path, &snap.filter, snap.watermark).expect("write it again");
    let again = snapshot::read(&path);
    let again = again.map_err(|e| TestCaseError::fail(format!("written again, refused: {e}")))?;
    prop_assert_eq!(again.filter.params(), params);
    prop_assert_eq!(again.filter.seed(), snap.filter.seed());
    prop_assert_eq!(again.filter.items(), snap.filter.items());
    prop_assert!(again.filter.iter_words().eq(snap.filter.iter_words()));
    prop_assert_eq!(&again.watermark, &snap.watermark);
    Ok(())
}

/// Replaces the trailing checksum with the right one for the rest of `bytes`.
fn reseal(bytes: &mut [u8]) {
    if let Some(at) = bytes.len().checked_sub(4) {
        let crc = crc32fast::hash(&bytes[..at]);
        bytes[at..].copy_from_slice(&crc.to_le_bytes());
    }
}

/// A header with the given length, bit count and hash count, the other fields random,
/// followed by `body` bytes of words and checksum.
fn forged(header_len: u32, bits: u64, hashes: u32, fields: &[u8], body: usize) -> Vec<u8> {
    let mut out = Vec::new();
    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
    out.extend_from_slice(&header_len.to_le_bytes());
    out.extend_from_slice(&bits.to_le_bytes());
    out.extend_from_slice(&hashes.to_le_bytes());
    out.extend_from_slice(fields);
    out.resize(out.len() + body, 0xa5);
    out
}

/// A file that passes the magic and version checks with header fields drawn around every
/// limit, often sized as its header implies and often with a correct checksum: it reaches
/// the checks after the length, and the bit array.
fn forged_snapshot() -> impl Strategy<Value = Vec<u8>> {
    let bits = prop_oneof![
        select(vec![
            0,
            1,
            BLOCK_BITS,
            BLOCK_BITS + 1,
            MAX_BITS - BLOCK_BITS,
            MAX_BITS,
            MAX_BITS + BLOCK_BITS,
            u64::MAX - (BLOCK_BITS - 1),
            u64::MAX,
        ]),
        (1u64..16).prop_map(|b| b * BLOCK_BITS),
        any::<u64>(),
    ];
    let header_len = prop_oneof![
        4 => Just(HEADER_LEN as u32),
        1 => 0u32..100,
        1 => any::<u32>(),
    ];
    let hashes = prop_oneof![1u32..20, Just(0), any::<u32>()];
    // Expected items, rate, seed, items (28 bytes), then the watermark tag, its value and
    // the creation time.
    let fields = (
        vec(any::<u8>(), 28),
        prop_oneof![0u8..3, any::<u8>()],
        any::<[u8; 8]>(),
        any::<u64>(),
    )
        .prop_map(|(mut fields, tag, value, created)| {
            fields.push(tag);
            fields.extend_from_slice(&value);
            fields.extend_from_slice(&created.to_le_bytes());
            fields
        });
    (
        header_len,
        bits,
        hashes,
        fields,
        any::<bool>(),
        0usize..256,
        any::<bool>(),
    )
        .prop_map(
            |(header_len, bits, hashes, fields, sized, random_body, sealed)| {
                let extra = (header_len as usize).saturating_sub(HEADER_LEN);
                let implied = extra + (bits / 8) as usize + 4;
                let body = if sized && bits <= 64 * BLOCK_BITS && extra <= 256 {
                    implied
                } else {
                    random_body
                };
                let mut bytes = forged(header_len, bits, hashes, &fields, body);
                if sealed {
                    reseal(&mut bytes);
                }
                bytes
            },
        )
}

/// A small filter's snapshot and what it answers for a sample of keys.
struct Original {
    bytes: Vec<u8>,
    filter: BloomFilter,
}

/// Keys of the sample: half inserted, half not.
fn sample_key(i: u64) -> Vec<u8> {
    format!("/products/{i}").into_bytes()
}

/// Sampled keys: `0..SAMPLE / 2` are in the original filter.
const SAMPLE: u64 = 400;

/// The snapshot every corruption starts from, written once by the public writer.
fn original() -> &'static Original {
    static ORIGINAL: OnceLock<Original> = OnceLock::new();
    ORIGINAL.get_or_init(|| {
        let params = BloomParams::optimal(300, 0.01).expect("valid parameters");
        let filter = BloomFilter::new(params, 0x0f0f_1234);
        for i in 0..SAMPLE / 2 {
            filter.insert(&sample_key(i));
        }
        let dir = TempDir::new().expect("create a temp dir");
        let path = dir.path().join("original.snap");
        snapshot::write(&path, &filter, Some(Watermark::Int(42)))
            .expect("write the original snapshot");
        let bytes = fs::read(&path).expect("read the original snapshot back");
        Original { bytes, filter }
    })
}

/// Whether `filter` answers like the original for every sampled key.
fn answers_like_original(filter: &BloomFilter) -> bool {
    let original = &original().filter;
    (0..SAMPLE).all(|i| filter.contains(&sample_key(i)) == original.contains(&sample_key(i)))
}

/// One way a file can be damaged.
#[derive(Debug, Clone)]
enum Damage {
    /// XORs one byte with a non-zero mask.
    Flip(Index, u8),
    /// Cuts the file short.
    Truncate(Index),
    /// Adds bytes at the end.
    Append(Vec<u8>),
}

/// Flips mostly, some cuts and some appended bytes.
fn damage() -> impl Strategy<Value = Damage> {
    prop_oneof![
        3 => (any::<Index>(), 1u8..=255).prop_map(|(at, mask)| Damage::Flip(at, mask)),
        1 => any::<Index>().prop_map(Damage::Truncate),
        1 => vec(any::<u8>(), 1..16).prop_map(Damage::Append),
    ]
}

/// `bytes` with `damage` applied; a cut always removes at least one byte.
fn damaged(mut bytes: Vec<u8>, damage: &Damage) -> Vec<u8> {
    match damage {
        Damage::Flip(at, mask) if !bytes.is_empty() => {
            let i = at.index(bytes.len());
            bytes[i] ^= mask;
        }
        Damage::Truncate(at) if !bytes.is_empty() => bytes.truncate(at.index(bytes.len())),
        Damage::Append(tail) => bytes.extend_from_slice(tail),
        Damage::Flip(..) | Damage::Truncate(_) => {}
    }
    bytes
}

#[test]
fn the_original_snapshot_reads_back() {
    let original = original();
    let file = temp_file(&original.bytes);
    let snap = snapshot::read(file.path()).expect("the original snapshot");
    assert_eq!(snap.watermark, Some(Watermark::Int(42)));
    assert_eq!(snap.filter.params(), original.filter.params());
    assert!(answers_like_original(&snap.filter));
    assert!((0..SAMPLE / 2).all(|i| snap.filter.contains(&sample_key(i))));
}

#[test]
fn a_forged_bit_count_is_refused_before_allocating() {
    // 2^40 bits is 128 GiB of words; the largest value the reader could be talked into.
    for bits in [
        MAX_BITS,
        MAX_BITS - BLOCK_BITS,
        1 << 36,
        MAX_BITS + BLOCK_BITS,
        u64::MAX,
    ] {
        for body in [0, 4, 4096] {
            let mut bytes = forged(HEADER_LEN as u32, bits, 7, &[0; 45], body);
            reseal(&mut bytes);
            let file = temp_file(&bytes);
            let (result, largest) = largest_allocation(|| snapshot::read(file.path()));
            let err = result.expect_err("a header far larger than its file");
            assert!(
                matches!(
                    err,
                    SnapshotError::Truncated { .. } | SnapshotError::BadHeader(_)
                ),
                "bits = {bits}: {err:?}"
            );
            assert!(
                largest <= bytes.len() + ALLOCATION_SLACK,
                "bits = {bits}, {} bytes: allocated {largest} at once",
                bytes.len()
            );
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(SNAPSHOT_CASES))]

    #[test]
    fn arbitrary_bytes_are_refused(bytes in vec(any::<u8>(), 0..1024)) {
        let read = read_snapshot(&bytes)?;
        prop_assert!(read.is_err(), "{} random bytes were accepted", bytes.len());
        check_early_refusal(&bytes, &read)?;
    }

    #[test]
    fn bytes_after_the_magic_are_refused(rest in vec(any::<u8>(), 0..1024)) {
        let bytes = [&MAGIC[..], &rest].concat();
        let read = read_snapshot(&bytes)?;
        prop_assert!(read.is_err());
        check_early_refusal(&bytes, &read)?;
    }

    #[test]
    fn forged_headers_are_refused_or_read_exactly(bytes in forged_snapshot()) {
        if let Ok(snap) = read_snapshot(&bytes)? {
            check_accepted(&snap, &bytes)?;
        }
    }

    #[test]
    fn one_damaged_byte_or_length_is_refused(damage in damage()) {
        let bytes = damaged(original().bytes.clone(), &damage);
        let err = read_snapshot(&bytes)?.err();
        let err = err.ok_or_else(|| TestCaseError::fail(format!("{damage:?} was accepted")))?;
        if let Damage::Truncate(_) = damage {
            prop_assert!(matches!(err, SnapshotError::Truncated { .. }), "{:?}", err);
        }
    }

    #[test]
    fn damaged_snapshots_are_refused_or_answer_as_before(damages in vec(damage(), 1..5)) {
        let bytes = damages.iter().fold(original().bytes.clone(), damaged);
        if let Ok(snap) = read_snapshot(&bytes)? {
            prop_assert!(answers_like_original(&snap.filter), "{:?} changed the answers", damages);
        }
    }

    #[test]
    fn resealed_damage_is_refused_or_read_exactly(
        damages in vec(damage(), 1..4),
    ) {
        let mut bytes = damages.iter().fold(original().bytes.clone(), damaged);
        reseal(&mut bytes);
        if let Ok(snap) = read_snapshot(&bytes)? {
            check_accepted(&snap, &bytes)?;
            if snap.filter.params().hashes <= 64 {
                // Still a working filter, though its answers may differ (its words
                // changed): an answer does not change by asking again, and a key added
                // to it is there from then on.
                let keys: Vec<Vec<u8>> = (0..SAMPLE).step_by(8).map(sample_key).collect();
                for key in &keys {
                    let before = snap.filter.contains(key);
                    prop_assert_eq!(snap.filter.contains(key), before, "{:?}", damages);
                    snap.filter.insert(key);
                    prop_assert!(snap.filter.contains(key), "{:?}: lost {:?}", damages, key);
                }
                prop_assert!(keys.iter().all(|key| snap.filter.contains(key)));
            }
        }
    }
}

proptest! {
    // Each accepted case writes and syncs a file: fewer cases.
    #![proptest_config(ProptestConfig::with_cases(SNAPSHOT_CASES / 10))]

    #[test]
    fn accepted_snapshots_write_back_as_they_read(
        damages in vec(damage(), 0..3),
        sealed in any::<bool>(),
    ) {
        let mut bytes = damages.iter().fold(original().bytes.clone(), damaged);
        if sealed {
            reseal(&mut bytes);
        }
        if let Ok(snap) = read_snapshot(&bytes)? {
            check_round_trip(&snap)?;
        }
    }
}
