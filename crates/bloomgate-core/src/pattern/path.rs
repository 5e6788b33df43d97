//! Request-path normalisation, before any route is matched: the one spelling of a path
//! that every other spelling of the same resource is reduced to. Percent-escapes of
//! unreserved characters are decoded, other escapes upper-cased, `.` and `..` segments
//! resolved and repeated slashes collapsed (RFC 3986 §6.2.2). A second, lenient reading
//! (every escape decoded, `\` as `/`, `;parameters` dropped) tells whether a path that
//! matches nothing canonically would still reach a guarded resource on a lenient upstream.
//! It does not match routes (see `route`) and allocates only for paths that need rewriting.

use std::borrow::Cow;

/// Why a request path cannot be normalised: answered 400 before any lookup.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum PathError {
    /// A `%` not followed by two hex digits.
    #[error("the path contains a malformed percent-escape")]
    BadEscape,
    /// A path that does not start with `/` (an asterisk-form or empty target).
    #[error("the path must start with '/'")]
    NotAbsolute,
}

/// The canonical spelling of `path` (no query): unreserved escapes decoded, the others
/// upper-cased, dot segments resolved (never above the root), slashes collapsed. A
/// trailing slash is kept: whether it matters is a route's choice. Borrowed when the
/// path is already canonical, which is the common case.
pub fn canonical(path: &str) -> Result<Cow<'_, str>, PathError> {
    if !path.starts_with('/') {
        return Err(PathError::NotAbsolute);
    }
    if is_canonical(path) {
        return Ok(Cow::Borrowed(path));
    }
    let decoded = decode_unreserved(path)?;
    Ok(Cow::Owned(resolve_segments(&decoded)))
}

/// The lenient reading of `path`: every escape decoded (invalid UTF-8 replaced), `\`
/// taken as `/`, `;parameters` cut from every segment, NUL dropped, then dot segments
/// and slashes resolved as in [`canonical`]. Used only to refuse what a lenient upstream
/// would read as a guarded resource; never sent anywhere.
pub fn lenient(path: &str) -> String {
    let bytes = path.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let b = bytes[i];
        if b == b'%'
            && let Some(v) = hex_pair(bytes, i + 1)
        {
            out.push(v);
            i += 3;
            continue;
        }
        out.push(b);
        i += 1;
    }
    let text = String::from_utf8_lossy(&out)
        .replace('\\', "/")
        .replace('\0', "");
    let cut: Vec<&str> = text
        .split('/')
        .map(|seg| seg.split(';').next().unwrap_or(""))
        .collect();
    resolve_segments(&cut.join("/"))
}

/// Whether a path needs no rewriting: no escape, no empty inner segment, no dot segment.
/// One pass over the bytes: this runs for every request.
fn is_canonical(path: &str) -> bool {
    let bytes = path.as_bytes();
    // Segments after the leading '/'; `start` is where the current one began. An empty
    // segment is allowed only last (a trailing slash).
    let mut start = 1;
    for i in 1..=bytes.len() {
        let b = bytes.get(i).copied();
        match b {
            Some(b'%') => return false,
            Some(b'/') | None => {
                let seg = &bytes[start.min(i)..i];
                let last = b.is_none();
                if seg == b"." || seg == b".." || (seg.is_empty() && !last && bytes.len() > 1) {
                    return false;
                }
                start = i + 1;
            }
            Some(_) => {}
        }
    }
    true
}

fn hex_digit(b: u8) -> Option<u8> {
    match b {
        b'0'..=b'9' => Some(b - b'0'),
        b'a'..=b'f' => Some(b - b'a' + 10),
        b'A'..=b'F' => Some(b - b'A' + 10),
        _ => None,
    }
}

fn hex_pair(bytes: &[u8], at: usize) -> Option<u8> {
    let hi = hex_digit(*bytes.get(at)?)?;
    let lo = hex_digit(*bytes.get(at + 1)?)?;
    Some(hi << 4 | lo)
}

/// RFC 3986 unreserved characters: the ones whose escaped and plain forms are equal.
pub fn is_unreserved(b: u8) -> bool {
    b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~')
}

fn decode_unreserved(path: &str) -> Result<String, PathError> {
    const HEX: &[u8; 16] = b"0123456789ABCDEF";
    let bytes = path.as_bytes();
    let mut out = Vec::with_capacity(path.len());
    let mut i = 0;
    while i < bytes.len() {
        let b = bytes[i];
        if b != b'%' {
            out.push(b);
            i += 1;
            continue;
        }
        let v = hex_pair(bytes, i + 1).ok_or(PathError::BadEscape)?;
        if is_unreserved(v) {
            out.push(v);
        } else {
            out.extend_from_slice(&[b'%', HEX[usize::from(v >> 4)], HEX[usize::from(v & 0xf)]]);
        }
        i += 3;
    }
    // Only ASCII escapes were replaced by ASCII bytes, so UTF-8 input stays UTF-8.
    String::from_utf8(out).map_err(|_| PathError::BadEscape)
}

/// Resolves `.`, `..` and empty segments of an absolute path; `..` at the root stays at
/// the root. A path that ended in `/`, `/.` or `/..` keeps one trailing slash.
fn resolve_segments(path: &str) -> String {
    let mut out: Vec<&str> = Vec::new();
    let mut trailing = false;
    for seg in path.split('/') {
        trailing = false;
        match seg {
            "" => trailing = true,
            "." => trailing = true,
            ".." => {
                out.pop();
                trailing = true;
            }
            s => out.push(s),
        }
    }
    let mut s = String::with_capacity(path.len());
    for seg in &out {
        s.push('/');
        s.push_str(seg);
    }
    if trailing || out.is_empty() {
        s.push('/');
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn c(p: &str) -> String {
        canonical(p).expect("normalisable").into_owned()
    }

    #[test]
    fn canonical_paths_are_borrowed() {
        for p in ["/", "/api/products/42", "/api/products/", "/a.b/c~d"] {
            assert!(matches!(canonical(p), Ok(Cow::Borrowed(_))), "{p}");
        }
    }

    #[test]
    fn spellings_of_one_path_meet() {
        let want = "/api/products/42";
        for p in [
            "/api/products/42",
            "//api/products/42",
            "/api//products///42",
            "/api/./products/42",
            "/api/x/../products/42",
            "/../api/products/42",
            "/%61pi/products/%34%32",
            "/api/products/%2e/42",
            "/api/zz/%2E%2E/products/42",
        ] {
            assert_eq!(c(p), want, "{p}");
        }
        assert_eq!(c("/api/products/42/"), "/api/products/42/");
        assert_eq!(c("/api/products/42/."), "/api/products/42/");
        assert_eq!(c("/api/products/42/x/.."), "/api/products/42/");
        assert_eq!(c("/.."), "/");
    }

    #[test]
    fn reserved_escapes_stay_escaped_in_upper_case() {
        assert_eq!(c("/a%2fb"), "/a%2Fb");
        assert_eq!(c("/a%3bb"), "/a%3Bb");
        assert_eq!(c("/caf%c3%a9"), "/caf%C3%A9");
    }

    #[test]
    fn malformed_paths_are_refused() {
        assert_eq!(canonical("/a%2"), Err(PathError::BadEscape));
        assert_eq!(canonical("/a%zz"), Err(PathError::BadEscape));
        assert_eq!(canonical("*"), Err(PathError::NotAbsolute));
        assert_eq!(canonical(""), Err(PathError::NotAbsolute));
    }

    #[test]
    fn the_lenient_reading_decodes_everything() {
        assert_eq!(lenient("/api%2Fproducts/42"), "/api/products/42");
        assert_eq!(lenient("/api\\products\\42"), "/api/products/42");
        assert_eq!(lenient("/api;v=1/products/42;x"), "/api/products/42");
        assert_eq!(
            lenient("/api/products/%2e%2e/products/4%002"),
            "/api/products/42"
        );
    }

    /// What [`is_canonical`] answers, spelled plainly (segment by segment).
    fn is_canonical_by_segments(path: &str) -> bool {
        if path.contains('%') {
            return false;
        }
        let rest = &path[1..];
        let mut segments = rest.split('/').peekable();
        while let Some(seg) = segments.next() {
            let last = segments.peek().is_none();
            if seg == "." || seg == ".." || (seg.is_empty() && !last && !rest.is_empty()) {
                return false;
            }
        }
        true
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        /// The one-pass check answers as the segment-by-segment reading does, for any
        /// absolute path.
        #[test]
        fn one_pass_check_agrees(raw in "/(/|[a-z.%;]|\\.\\.){0,24}") {
            prop_assert_eq!(is_canonical(&raw), is_canonical_by_segments(&raw), "{}", raw);
        }

        /// Any input is an error or a canonical path: idempotent, absolute, no dot
        /// segment, no empty inner segment, no lower-case escape. Never a panic.
        #[test]
        fn canonical_is_a_fixed_point(raw in "(/|[a-zA-Z0-9%./;\\\\~_-]|%[0-9a-fA-F]{2}){0,40}") {
            if let Ok(once) = canonical(&raw) {
                let twice = canonical(&once).expect("a canonical path normalises");
                prop_assert_eq!(&*twice, &*once);
                prop_assert!(once.starts_with('/'));
                prop_assert!(is_canonical(&once) || once.contains('%'));
                for seg in once[1..].split('/') {
                    prop_assert!(seg != "." && seg != "..");
                }
            }
            let _ = lenient(&raw);
        }

        /// Arbitrary bytes (as a lossy string) never panic either normaliser.
        #[test]
        fn arbitrary_input_never_panics(raw in any::<Vec<u8>>()) {
            let s = String::from_utf8_lossy(&raw);
            let _ = canonical(&s);
            let _ = lenient(&s);
        }
    }
}
