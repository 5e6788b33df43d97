//! Route matching and key extraction on the canonical path (see `path`): which guarded
//! route a request belongs to, the raw key it carries (a path segment or one query
//! parameter), the query parameters the route forwards, and the one canonical request
//! target an upstream origin is sent for a key. It does not normalise keys (see `key`)
//! and looks nothing up. Matching a canonical request allocates nothing.

use std::borrow::Cow;

use percent_encoding::{AsciiSet, NON_ALPHANUMERIC, percent_decode_str, utf8_percent_encode};

use crate::config::model::KeySource;
use crate::key::KeyError;
use crate::pattern::path::PathError;

/// Everything but RFC 3986 unreserved characters is escaped in the targets we build.
const ESCAPED: &AsciiSet = &NON_ALPHANUMERIC
    .remove(b'-')
    .remove(b'.')
    .remove(b'_')
    .remove(b'~');

/// One segment of a path pattern.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Segment {
    Literal(String),
    Param,
}

/// How literally a pattern matches a canonical path.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MatchOptions {
    /// Literal segments match only in the same case (default: any case, as most
    /// upstream frameworks route).
    pub case_sensitive: bool,
    /// `/a/b/` is another resource than `/a/b` (default: the same).
    pub strict_trailing_slash: bool,
    /// A key segment may contain `.` (default: refused, since many upstreams read
    /// `42.json` as key 42 in JSON).
    pub key_allows_dot: bool,
}

impl MatchOptions {
    /// The options a configured route asks for.
    pub fn of(route: &crate::config::model::RouteConfig) -> Self {
        Self {
            case_sensitive: route.case_sensitive,
            strict_trailing_slash: route.strict_trailing_slash,
            key_allows_dot: route.key_allows_dot,
        }
    }
}

/// A compiled path pattern such as `/api/products/{id}`.
#[derive(Debug, Clone)]
pub struct PathPattern {
    segments: Vec<Segment>,
    key: KeySource,
    options: MatchOptions,
}

/// Why a path pattern does not compile. The messages are reasons for the config field
/// that holds the pattern.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PatternError {
    /// The pattern does not start with `/`.
    #[error("must start with '/'")]
    NotAbsolute,
    /// A `?` or `#`: patterns are paths only.
    #[error("must not contain '?' or '#'; name query keys with key = {{ query = … }}")]
    QueryOrFragment,
    /// A malformed percent-escape.
    #[error(transparent)]
    Path(#[from] PathError),
    /// The pattern is not written as requests are matched; carries the canonical form.
    #[error(
        "must be written in canonical form (no `.`/`..` or empty segments, escapes only for reserved characters, in upper case): `{0}`"
    )]
    NotCanonical(String),
    /// A trailing `/` on a pattern other than `/`.
    #[error("must not end with '/'; use strict_trailing_slash for routes where it matters")]
    TrailingSlash,
    /// More than one `{param}` segment.
    #[error("at most one {{param}} segment is supported")]
    SecondParam,
    /// A `{}` segment.
    #[error("a {{param}} segment needs a name")]
    UnnamedParam,
    /// A segment such as `x{id}`.
    #[error("segment `{0}` mixes text and braces")]
    MixedSegment(String),
    /// The key segment named by the config is not in the path.
    #[error("key = {{ segment = \"{0}\" }} needs a `{{{0}}}` segment in the path")]
    MissingKeySegment(String),
    /// A `{param}` segment although the key comes from the query.
    #[error("the key comes from the query, so the path must not have a {{{0}}} segment")]
    ParamWithQueryKey(String),
    /// `key = { query = "" }`.
    #[error("the query parameter name must not be empty")]
    EmptyQueryName,
}

impl PathPattern {
    /// Compiles `path` for a key read from `key`.
    pub fn parse(
        path: &str,
        key: &KeySource,
        options: MatchOptions,
    ) -> Result<PathPattern, PatternError> {
        let Some(rest) = path.strip_prefix('/') else {
            return Err(PatternError::NotAbsolute);
        };
        if path.contains(['?', '#']) {
            return Err(PatternError::QueryOrFragment);
        }
        let canonical = super::path::canonical(path)?;
        if canonical != path {
            return Err(PatternError::NotCanonical(canonical.into_owned()));
        }
        if path.len() > 1 && path.ends_with('/') {
            return Err(PatternError::TrailingSlash);
        }
        let mut segments = Vec::new();
        let mut param: Option<&str> = None;
        for seg in rest.split('/') {
            if let Some(name) = seg.strip_prefix('{').and_then(|s| s.strip_suffix('}')) {
                if param.is_some() {
                    return Err(PatternError::SecondParam);
                }
                if name.is_empty() {
                    return Err(PatternError::UnnamedParam);
                }
                param = Some(name);
                segments.push(Segment::Param);
            } else if seg.contains(['{', '}']) {
                return Err(PatternError::MixedSegment(seg.to_owned()));
            } else {
                segments.push(Segment::Literal(seg.to_owned()));
            }
        }
        match (key, param) {
            (KeySource::Segment(want), Some(have)) if want == have => {}
            (KeySource::Segment(want), _) => {
                return Err(PatternError::MissingKeySegment(want.clone()));
            }
            (KeySource::Query(_), Some(p)) => {
                return Err(PatternError::ParamWithQueryKey(p.to_owned()));
            }
            (KeySource::Query(name), None) if name.is_empty() => {
                return Err(PatternError::EmptyQueryName);
            }
            (KeySource::Query(_), None) => {}
        }
        Ok(PathPattern {
            segments,
            key: key.clone(),
            options,
        })
    }

    /// Compiles the path of a write-through rule: a `{param}` segment is optional unless
    /// the key comes from the path, in which case its name must match.
    pub fn parse_write(
        path: &str,
        key: &crate::config::model::WriteKey,
    ) -> Result<PathPattern, PatternError> {
        use crate::config::model::WriteKey;
        let options = MatchOptions::default();
        let param = match key {
            WriteKey::Segment(name) => name.clone(),
            // A {param} is allowed here: write-through keys from headers or bodies ignore
            // it, so the pattern compiles as if the key came from that segment.
            _ => match path
                .split('/')
                .find_map(|s| s.strip_prefix('{').and_then(|s| s.strip_suffix('}')))
            {
                Some(name) => name.to_owned(),
                None => return Self::parse(path, &KeySource::Query("_".into()), options),
            },
        };
        Self::parse(path, &KeySource::Segment(param), options)
    }

    /// Where the key comes from.
    pub fn key_source(&self) -> &KeySource {
        &self.key
    }

    /// Matches a canonical request path (see `path::canonical`); on a match returns the
    /// raw path segment that holds the key (for segment keys) or `""` (for query keys).
    pub fn matches<'p>(&self, path: &'p str) -> Option<&'p str> {
        let path = if self.options.strict_trailing_slash || path.len() <= 1 {
            path
        } else {
            path.strip_suffix('/').unwrap_or(path)
        };
        let rest = path.strip_prefix('/')?;
        let mut captured = "";
        let mut parts = rest.split('/');
        for seg in &self.segments {
            let part = parts.next()?;
            match seg {
                Segment::Literal(lit) => {
                    let same = if self.options.case_sensitive {
                        lit == part
                    } else {
                        lit.eq_ignore_ascii_case(part)
                    };
                    if !same {
                        return None;
                    }
                }
                Segment::Param => captured = part,
            }
        }
        if parts.next().is_some() {
            return None;
        }
        Some(captured)
    }

    /// Whether a path in its lenient reading (see `path::lenient`) would name this
    /// route's resource on a lenient upstream: any case, any trailing slash, any
    /// non-empty key segment.
    pub fn lenient_matches(&self, lenient: &str) -> bool {
        let path = if lenient.len() > 1 {
            lenient.strip_suffix('/').unwrap_or(lenient)
        } else {
            lenient
        };
        let Some(rest) = path.strip_prefix('/') else {
            return false;
        };
        let mut parts = rest.split('/');
        for seg in &self.segments {
            let Some(part) = parts.next() else {
                return false;
            };
            let ok = match seg {
                Segment::Literal(lit) => lit.eq_ignore_ascii_case(part),
                Segment::Param => !part.is_empty(),
            };
            if !ok {
                return false;
            }
        }
        parts.next().is_none()
    }

    /// Reads the raw (percent-decoded, not yet normalised) key from a matched segment.
    /// A segment that an upstream could read as something else than the key (`;`
    /// parameters, an escaped `/` or `\`, NUL, a `.suffix` unless allowed) is refused.
    pub fn segment_key<'r>(&self, segment: &'r str) -> Result<Cow<'r, str>, KeyError> {
        // The common spelling: nothing escaped and nothing to refuse, read in one pass.
        let dot = self.options.key_allows_dot;
        if segment.bytes().all(|b| {
            b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'~') || (dot && b == b'.')
        }) {
            return Ok(Cow::Borrowed(segment));
        }
        self.decode_segment(segment)
    }

    /// [`PathPattern::segment_key`] for any spelling: escapes decoded, then refused if
    /// they spell a separator, a parameter, NUL or (unless allowed) a dot.
    fn decode_segment<'r>(&self, segment: &'r str) -> Result<Cow<'r, str>, KeyError> {
        if segment.contains(';') {
            return Err(KeyError::NotCanonical);
        }
        let decoded = percent_decode_str(segment)
            .decode_utf8()
            .map_err(|_| KeyError::InvalidCharacters)?;
        if decoded.contains(['/', '\\', ';', '\0'])
            || (!self.options.key_allows_dot && decoded.contains('.'))
        {
            return Err(KeyError::NotCanonical);
        }
        Ok(decoded)
    }

    /// The request target an upstream origin is sent for a key: the pattern with the key
    /// (canonical bytes, escaped) in its segment, or the path with the key as the one
    /// query parameter; then the forwarded parameters, already canonical.
    pub fn upstream_target(&self, key: &[u8], forwarded: Option<&str>) -> String {
        let key = String::from_utf8_lossy(key);
        let mut target = String::with_capacity(64);
        for seg in &self.segments {
            target.push('/');
            match seg {
                Segment::Literal(lit) => target.push_str(lit),
                Segment::Param => target.extend(utf8_percent_encode(&key, ESCAPED)),
            }
        }
        let mut sep = '?';
        if let KeySource::Query(name) = &self.key {
            target.push(sep);
            target.extend(utf8_percent_encode(name, ESCAPED));
            target.push('=');
            target.extend(utf8_percent_encode(&key, ESCAPED));
            sep = '&';
        }
        if let Some(q) = forwarded.filter(|q| !q.is_empty()) {
            target.push(sep);
            target.push_str(q);
        }
        target
    }
}

/// What a guarded route does with query parameters other than its key.
#[derive(Debug, Clone, Default)]
pub struct QueryRules {
    /// The key's parameter name, for query-key routes.
    pub key: Option<String>,
    /// Parameters forwarded to the upstream origin (and part of the cache key), in the
    /// order they are sent.
    pub forward: Vec<String>,
    /// Refuse a request with any other parameter instead of dropping it.
    pub reject_undeclared: bool,
}

/// The parts of a query that matter to a guarded route.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct QueryRead<'q> {
    /// The key parameter's value (query-key routes).
    pub key: Option<Cow<'q, str>>,
    /// The forwarded parameters in canonical form (`a=1&b=2`, declared order, escaped),
    /// or `None` when the request has none of them.
    pub forwarded: Option<String>,
}

impl QueryRules {
    /// Reads `query`. The key parameter, or a forwarded one, given twice (or once more
    /// in another case, as `SKU_ID` beside `sku_id`) is ambiguous: which one an upstream
    /// would read is its own choice, so the request is refused.
    pub fn read<'q>(&self, query: Option<&'q str>) -> Result<QueryRead<'q>, KeyError> {
        let mut read = QueryRead::default();
        let Some(query) = query else {
            return Ok(read);
        };
        let mut forwarded: Vec<Option<Cow<'q, str>>> = Vec::new();
        for (name, value) in form_urlencoded::parse(query.as_bytes()) {
            if let Some(key) = &self.key {
                if name == key.as_str() {
                    if read.key.is_some() {
                        return Err(KeyError::Ambiguous(key.clone()));
                    }
                    read.key = Some(value);
                    continue;
                }
                if name.eq_ignore_ascii_case(key) {
                    return Err(KeyError::Ambiguous(key.clone()));
                }
            }
            if let Some(i) = self
                .forward
                .iter()
                .position(|f| f.eq_ignore_ascii_case(&name))
            {
                if forwarded.is_empty() {
                    forwarded.resize(self.forward.len(), None);
                }
                if forwarded[i].is_some() || name != self.forward[i].as_str() {
                    return Err(KeyError::Ambiguous(self.forward[i].clone()));
                }
                forwarded[i] = Some(value);
                continue;
            }
            if self.reject_undeclared && !name.is_empty() {
                // The name is the client's: bounded before it is echoed in the error body.
                return Err(KeyError::Undeclared(name.chars().take(64).collect()));
            }
        }
        if forwarded.iter().any(Option::is_some) {
            let mut out = form_urlencoded::Serializer::new(String::new());
            for (name, value) in self.forward.iter().zip(&forwarded) {
                if let Some(v) = value {
                    out.append_pair(name, v);
                }
            }
            read.forwarded = Some(out.finish());
        }
        Ok(read)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn seg(p: &str) -> PathPattern {
        PathPattern::parse(p, &KeySource::Segment("id".into()), MatchOptions::default())
            .expect("valid")
    }

    fn query_rules(forward: &[&str], reject: bool) -> QueryRules {
        QueryRules {
            key: Some("sku_id".into()),
            forward: forward.iter().map(|s| (*s).to_owned()).collect(),
            reject_undeclared: reject,
        }
    }

    #[test]
    fn segment_patterns_match_and_capture() {
        let p = seg("/api/products/{id}");
        assert_eq!(p.matches("/api/products/42"), Some("42"));
        assert_eq!(p.matches("/API/Products/42"), Some("42"));
        assert_eq!(p.matches("/api/products/42/"), Some("42"));
        assert_eq!(p.matches("/api/products/42/reviews"), None);
        assert_eq!(p.matches("/api/products"), None);
        assert_eq!(p.matches("/api/product/42"), None);
        assert_eq!(p.segment_key("4%32").as_deref(), Ok("42"));
        assert_eq!(p.segment_key("%ff"), Err(KeyError::InvalidCharacters));
    }

    #[test]
    fn strict_options_match_exactly() {
        let strict = MatchOptions {
            case_sensitive: true,
            strict_trailing_slash: true,
            key_allows_dot: false,
        };
        let p = PathPattern::parse(
            "/api/products/{id}",
            &KeySource::Segment("id".into()),
            strict,
        )
        .expect("valid");
        assert_eq!(p.matches("/api/products/42"), Some("42"));
        assert_eq!(p.matches("/API/products/42"), None);
        assert_eq!(p.matches("/api/products/42/"), None);
        // The lenient reading ignores both, for refusing rather than passing through.
        assert!(p.lenient_matches("/API/products/42/"));
    }

    #[test]
    fn key_segments_that_an_upstream_could_read_otherwise_are_refused() {
        let p = seg("/api/products/{id}");
        for raw in [
            "42;v=1", "4%2F2", "4%5C2", "4%002", "42.json", "4%3B2", "%2E",
        ] {
            assert_eq!(p.segment_key(raw), Err(KeyError::NotCanonical), "{raw}");
        }
        let dotted = PathPattern::parse(
            "/p/{id}",
            &KeySource::Segment("id".into()),
            MatchOptions {
                key_allows_dot: true,
                ..MatchOptions::default()
            },
        )
        .expect("valid");
        assert_eq!(dotted.segment_key("v1.2").as_deref(), Ok("v1.2"));
    }

    #[test]
    fn query_keys_are_read_once_and_unambiguously() {
        let r = query_rules(&[], false);
        let read = r.read(Some("a=1&sku_id=12%33")).expect("valid");
        assert_eq!(read.key.as_deref(), Some("123"));
        assert_eq!(read.forwarded, None);
        assert_eq!(r.read(Some("a=1")).expect("valid").key, None);
        assert_eq!(r.read(None).expect("valid").key, None);
        for q in [
            "sku_id=1&sku_id=2",
            "sku_id=1&sku_id=1",
            "sku_id=1&SKU_ID=2",
            "sku%5Fid=1&sku_id=2",
            "Sku_Id=2",
        ] {
            assert_eq!(
                r.read(Some(q)),
                Err(KeyError::Ambiguous("sku_id".into())),
                "{q}"
            );
        }
    }

    #[test]
    fn forwarded_parameters_are_canonical_and_the_rest_dropped_or_refused() {
        let r = query_rules(&["lang", "currency"], false);
        let read = r
            .read(Some("currency=EUR&utm=x&sku_id=7&lang=fr%20CH"))
            .expect("valid");
        assert_eq!(read.forwarded.as_deref(), Some("lang=fr+CH&currency=EUR"));
        assert_eq!(
            r.read(Some("lang=fr&lang=de&sku_id=7")),
            Err(KeyError::Ambiguous("lang".into()))
        );
        let strict = query_rules(&["lang"], true);
        assert_eq!(
            strict.read(Some("sku_id=7&utm=x")),
            Err(KeyError::Undeclared("utm".into()))
        );
        assert!(strict.read(Some("sku_id=7&lang=fr")).is_ok());
    }

    #[test]
    fn upstream_targets_are_built_from_the_key() {
        let p = seg("/api/products/{id}");
        assert_eq!(p.upstream_target(b"42", None), "/api/products/42");
        assert_eq!(p.upstream_target(b"a/b c", None), "/api/products/a%2Fb%20c");
        assert_eq!(
            p.upstream_target(b"42", Some("lang=fr")),
            "/api/products/42?lang=fr"
        );
        let q = PathPattern::parse(
            "/api/product/info",
            &KeySource::Query("sku_id".into()),
            MatchOptions::default(),
        )
        .expect("valid");
        assert_eq!(q.upstream_target(b"7", None), "/api/product/info?sku_id=7");
        assert_eq!(
            q.upstream_target(b"7&x=1", Some("lang=fr")),
            "/api/product/info?sku_id=7%26x%3D1&lang=fr"
        );
    }

    #[test]
    fn bad_patterns_are_refused() {
        let o = MatchOptions::default();
        let q = KeySource::Query("k".into());
        let s = KeySource::Segment("id".into());
        let err = |p: &str, k: &KeySource| PathPattern::parse(p, k, o).expect_err(p);
        assert_eq!(err("api", &q), PatternError::NotAbsolute);
        assert_eq!(
            err("/a/{id}", &q),
            PatternError::ParamWithQueryKey("id".into())
        );
        assert_eq!(
            err("/a/b", &s),
            PatternError::MissingKeySegment("id".into())
        );
        assert_eq!(err("/a/{id}/{x}", &s), PatternError::SecondParam);
        assert_eq!(
            err("/a/x{id}", &s),
            PatternError::MixedSegment("x{id}".into())
        );
        assert_eq!(
            err("/a//{id}", &s),
            PatternError::NotCanonical("/a/{id}".into())
        );
        assert_eq!(
            err("/a/./{id}", &s),
            PatternError::NotCanonical("/a/{id}".into())
        );
        assert_eq!(
            err("/a/%7e/{id}", &s),
            PatternError::NotCanonical("/a/~/{id}".into())
        );
        assert_eq!(
            err("/a/%zz/{id}", &s),
            PatternError::Path(PathError::BadEscape)
        );
        assert_eq!(err("/a/b/", &q), PatternError::TrailingSlash);
        // The messages are the config's reasons.
        assert_eq!(
            err("/a/b", &s).to_string(),
            "key = { segment = \"id\" } needs a `{id}` segment in the path"
        );
        assert_eq!(
            err("/a/{id}", &q).to_string(),
            "the key comes from the query, so the path must not have a {id} segment"
        );
        assert!(PathPattern::parse("/", &q, o).is_ok());
    }

    #[test]
    fn write_patterns_take_an_optional_param() {
        use crate::config::model::WriteKey;
        let header = WriteKey::Header("location".into());
        assert!(PathPattern::parse_write("/api/products", &header).is_ok());
        assert!(PathPattern::parse_write("/api/products/{id}", &header).is_ok());
        let segment = WriteKey::Segment("id".into());
        assert!(PathPattern::parse_write("/api/products/{id}", &segment).is_ok());
        assert_eq!(
            PathPattern::parse_write("/api/products", &segment).expect_err("no segment"),
            PatternError::MissingKeySegment("id".into())
        );
        // The real reason, not a generic one.
        assert_eq!(
            PathPattern::parse_write("api/products", &header).expect_err("relative"),
            PatternError::NotAbsolute
        );
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(1024))]

        /// The one-pass reading of a plain key segment gives what decoding it gives, with
        /// and without dots allowed, for every spelling (escapes, separators, NUL, UTF-8).
        #[test]
        fn plain_segments_read_as_decoded(
            segment in "([a-zA-Z0-9._~;/\\\\-]|%[0-9a-fA-F]{2}|%|\\x00|é){0,16}",
            dot in any::<bool>(),
        ) {
            let options = MatchOptions { key_allows_dot: dot, ..MatchOptions::default() };
            let p = PathPattern::parse("/p/{id}", &KeySource::Segment("id".into()), options)
                .expect("valid");
            prop_assert_eq!(p.segment_key(&segment), p.decode_segment(&segment));
        }
    }
}
