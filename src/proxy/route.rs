//! Route matching and key extraction: which guarded route a request path belongs to, and
//! the raw key it carries (query parameter or path segment), percent-decoded. It does not
//! normalise (see `key`) and does not look anything up. Matching allocates nothing.

use std::borrow::Cow;

use percent_encoding::percent_decode_str;

use crate::config::KeySource;
use crate::key::KeyError;

/// One segment of a path pattern.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Segment {
    Literal(String),
    Param,
}

/// A compiled path pattern such as `/api/products/{id}`.
#[derive(Debug, Clone)]
pub struct PathPattern {
    segments: Vec<Segment>,
    key: KeySource,
}

impl PathPattern {
    /// Compiles `path` for a key read from `key`. The error is a reason for the config.
    pub fn parse(path: &str, key: &KeySource) -> Result<PathPattern, String> {
        let Some(rest) = path.strip_prefix('/') else {
            return Err("must start with '/'".to_owned());
        };
        if path.contains(['?', '#']) {
            return Err(
                "must not contain '?' or '#'; name query keys with key = { query = … }".to_owned(),
            );
        }
        let mut segments = Vec::new();
        let mut param: Option<&str> = None;
        for seg in rest.split('/') {
            if let Some(name) = seg.strip_prefix('{').and_then(|s| s.strip_suffix('}')) {
                if param.is_some() {
                    return Err("at most one {param} segment is supported".to_owned());
                }
                if name.is_empty() {
                    return Err("a {param} segment needs a name".to_owned());
                }
                param = Some(name);
                segments.push(Segment::Param);
            } else if seg.contains(['{', '}']) {
                return Err(format!("segment `{seg}` mixes text and braces"));
            } else {
                segments.push(Segment::Literal(seg.to_owned()));
            }
        }
        match (key, param) {
            (KeySource::Segment(want), Some(have)) if want == have => {}
            (KeySource::Segment(want), _) => {
                return Err(format!(
                    "key = {{ segment = \"{want}\" }} needs a `{{{want}}}` segment in the path"
                ));
            }
            (KeySource::Query(_), Some(p)) => {
                return Err(format!(
                    "the key comes from the query, so the path must not have a {{{p}}} segment"
                ));
            }
            (KeySource::Query(name), None) if name.is_empty() => {
                return Err("the query parameter name must not be empty".to_owned());
            }
            (KeySource::Query(_), None) => {}
        }
        Ok(PathPattern {
            segments,
            key: key.clone(),
        })
    }

    /// Compiles the path of a write-through rule: a `{param}` segment is optional unless
    /// the key comes from the path, in which case its name must match.
    pub fn parse_write(path: &str, key: &crate::config::WriteKey) -> Result<PathPattern, String> {
        use crate::config::WriteKey;
        if let WriteKey::Segment(name) = key {
            return Self::parse(path, &KeySource::Segment(name.clone()));
        }
        match Self::parse(path, &KeySource::Query("_".into())) {
            Ok(p) => Ok(p),
            // A {param} is allowed here: write-through keys from headers or bodies ignore it.
            Err(_) => {
                let name = path
                    .split('/')
                    .find_map(|s| s.strip_prefix('{').and_then(|s| s.strip_suffix('}')))
                    .ok_or_else(|| "invalid path pattern".to_owned())?;
                Self::parse(path, &KeySource::Segment(name.to_owned()))
            }
        }
    }

    /// Matches a request path; on a match returns the raw path segment that holds the key
    /// (for segment keys) or `""` (for query keys).
    pub fn matches<'p>(&self, path: &'p str) -> Option<&'p str> {
        let rest = path.strip_prefix('/')?;
        let mut captured = "";
        let mut parts = rest.split('/');
        for seg in &self.segments {
            let part = parts.next()?;
            match seg {
                Segment::Literal(lit) => {
                    if lit != part {
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

    /// Reads the raw (percent-decoded, not yet normalised) key from a matched request.
    pub fn raw_key<'r>(
        &self,
        segment: &'r str,
        query: Option<&'r str>,
    ) -> Result<Cow<'r, str>, KeyError> {
        match &self.key {
            KeySource::Segment(_) => percent_decode_str(segment)
                .decode_utf8()
                .map_err(|_| KeyError::InvalidCharacters),
            KeySource::Query(name) => query
                .and_then(|q| {
                    form_urlencoded::parse(q.as_bytes())
                        .find(|(k, _)| k == name.as_str())
                        .map(|(_, v)| v)
                })
                // The name comes from the config, never from the request.
                .ok_or_else(|| KeyError::Missing(name.clone())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seg(p: &str) -> PathPattern {
        PathPattern::parse(p, &KeySource::Segment("id".into())).expect("valid")
    }

    #[test]
    fn segment_patterns_match_and_capture() {
        let p = seg("/api/products/{id}");
        assert_eq!(p.matches("/api/products/42"), Some("42"));
        assert_eq!(p.matches("/api/products/42/reviews"), None);
        assert_eq!(p.matches("/api/products"), None);
        assert_eq!(p.matches("/api/product/42"), None);
        assert_eq!(p.raw_key("4%32", None).as_deref(), Ok("42"));
        assert_eq!(p.raw_key("%ff", None), Err(KeyError::InvalidCharacters));
    }

    #[test]
    fn query_patterns_read_the_parameter() {
        let p = PathPattern::parse("/api/product/info", &KeySource::Query("sku_id".into()))
            .expect("valid");
        assert_eq!(p.matches("/api/product/info"), Some(""));
        assert_eq!(p.matches("/api/product/info/x"), None);
        assert_eq!(
            p.raw_key("", Some("a=1&sku_id=12%33")).as_deref(),
            Ok("123")
        );
        assert_eq!(
            p.raw_key("", Some("a=1")),
            Err(KeyError::Missing("sku_id".into()))
        );
        assert_eq!(p.raw_key("", None), Err(KeyError::Missing("sku_id".into())));
    }

    #[test]
    fn bad_patterns_are_refused() {
        let q = KeySource::Query("k".into());
        assert!(PathPattern::parse("api", &q).is_err());
        assert!(PathPattern::parse("/a/{id}", &q).is_err());
        assert!(PathPattern::parse("/a/b", &KeySource::Segment("id".into())).is_err());
        assert!(PathPattern::parse("/a/{id}/{x}", &KeySource::Segment("id".into())).is_err());
        assert!(PathPattern::parse("/a/x{id}", &KeySource::Segment("id".into())).is_err());
    }
}
