//! What an upstream origin is sent besides the key: the query parameters and request
//! headers a route forwards, and the headers it sets, checked against the headers
//! bloomgate handles itself.

use std::collections::HashSet;

use http::{HeaderName, HeaderValue};

use super::super::validate::Problems;
use super::super::{KeySource, OriginConfig, RouteConfig};

/// Request headers that are never forwarded to an origin as declared headers: they
/// describe the connection or the hop, or bloomgate sets them itself.
const NOT_FORWARDABLE: [&str; 12] = [
    "host",
    "connection",
    "keep-alive",
    "proxy-connection",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "content-length",
    "if-none-match",
    "if-modified-since",
];

/// What an upstream origin sends besides the key.
#[derive(Default)]
pub(super) struct Forwarding {
    /// `forward_headers`, lower case.
    pub(super) headers: Vec<HeaderName>,
    /// `upstream_headers`.
    pub(super) set: Vec<(HeaderName, HeaderValue)>,
}

pub(super) fn compile_forwarding(
    r: &RouteConfig,
    at: &dyn Fn(&str) -> String,
    p: &mut Problems,
) -> Forwarding {
    let mut out = Forwarding::default();
    if !matches!(r.origin, OriginConfig::Upstream { .. }) {
        if !r.forward_query.is_empty()
            || !r.forward_headers.is_empty()
            || !r.upstream_headers.is_empty()
        {
            p.add(
                at("forward_query"),
                "forward_query, forward_headers and upstream_headers apply to upstream origins only",
            );
        }
        return out;
    }
    let mut seen = HashSet::new();
    for name in &r.forward_query {
        if name.is_empty() || !seen.insert(name.to_ascii_lowercase()) {
            p.add(
                at("forward_query"),
                format!("`{name}` is empty or listed twice (names match in any case)"),
            );
        } else if let KeySource::Query(key) = &r.key
            && key.eq_ignore_ascii_case(name)
        {
            p.add(
                at("forward_query"),
                format!("`{name}` is the key parameter; it is always sent, canonical"),
            );
        }
    }
    let mut seen = HashSet::new();
    let mut declare = |field: &str, name: &str, p: &mut Problems| -> Option<HeaderName> {
        let lower = name.to_ascii_lowercase();
        let Ok(header) = HeaderName::from_bytes(lower.as_bytes()) else {
            p.add(at(field), format!("`{name}` is not a header name"));
            return None;
        };
        if NOT_FORWARDABLE.contains(&lower.as_str()) {
            p.add(
                at(field),
                format!(
                    "`{name}` is a hop-by-hop or conditional header that bloomgate handles itself"
                ),
            );
            return None;
        }
        if !seen.insert(lower) {
            p.add(
                at(field),
                format!("`{name}` is listed twice (forward_headers and upstream_headers included)"),
            );
            return None;
        }
        Some(header)
    };
    for name in &r.forward_headers {
        out.headers.extend(declare("forward_headers", name, p));
    }
    for (name, value) in &r.upstream_headers {
        let header = declare("upstream_headers", name, p);
        let Ok(value) = HeaderValue::from_str(value) else {
            p.add(
                at("upstream_headers"),
                format!("the value of `{name}` is not a valid header value"),
            );
            continue;
        };
        out.set.extend(header.map(|h| (h, value)));
    }
    out
}
