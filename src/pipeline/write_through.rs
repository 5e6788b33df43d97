//! Write-through: when a write that passes through to the upstream succeeds (configured
//! methods, path and statuses), the key it created is added to a filter at once and any
//! negative cache entry for it dropped, so the new key is never refused while waiting for
//! the next sync. It reads the key from the path, a response header, or a JSON field of
//! the response body; it does not forward anything itself (see `passthrough`).

use std::borrow::Cow;
use std::sync::Arc;

use bytes::Bytes;
use http::header::CONTENT_LENGTH;
use http::{Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Either, Full, Limited};
use percent_encoding::percent_decode_str;
use prometheus::IntCounter;

use super::ProxyBody;
use crate::gate::Filter;
use crate::gate::admit::{Admit, Forget};
use bloomgate_core::config::{CompiledWriteThrough, WriteKey};
use bloomgate_core::key::normalize;
use bloomgate_core::pattern::route::PathPattern;
use bloomgate_core::report::Chain;

/// Largest response body read to find a JSON key field.
const MAX_JSON_BODY: usize = 1024 * 1024;

/// Where a rule reads the created key: a [`WriteKey`], compiled.
#[derive(Debug)]
enum KeyFrom {
    /// The key segment of the request path.
    Segment,
    /// The last path segment of this response header.
    Header(String),
    /// The field of the JSON response body at this JSON pointer (RFC 6901).
    Json(String),
}

impl KeyFrom {
    fn of(key: &WriteKey) -> KeyFrom {
        match key {
            WriteKey::Segment(_) => KeyFrom::Segment,
            WriteKey::Header(name) => KeyFrom::Header(name.clone()),
            WriteKey::Json(field) => KeyFrom::Json(json_pointer(field)),
        }
    }
}

/// One compiled write-through rule.
pub struct WriteThrough {
    pattern: PathPattern,
    methods: Vec<Method>,
    statuses: Vec<StatusCode>,
    key: KeyFrom,
    filter: Arc<Filter>,
    admit: Arc<Admit>,
    added: IntCounter,
}

impl WriteThrough {
    fn accepts(&self, status: StatusCode) -> bool {
        if self.statuses.is_empty() {
            status.is_success()
        } else {
            self.statuses.contains(&status)
        }
    }

    /// A rule from its compiled form; `filter` is the filter at `rule.filter`.
    pub fn from_compiled(
        rule: CompiledWriteThrough,
        filter: Arc<Filter>,
        admit: Arc<Admit>,
        added: IntCounter,
    ) -> WriteThrough {
        WriteThrough {
            pattern: rule.pattern,
            methods: rule.methods,
            statuses: rule.statuses,
            key: KeyFrom::of(&rule.key),
            filter,
            admit,
            added,
        }
    }

    /// Inspects the upstream's answer to a matching write and, on success, adds the key.
    /// The response is returned unchanged (buffered when the key is in its JSON body).
    pub async fn apply(
        &self,
        resp: Response<ProxyBody>,
        segment: Option<String>,
    ) -> Response<ProxyBody> {
        if !self.accepts(resp.status()) {
            return resp;
        }
        let (raw, resp) = match &self.key {
            KeyFrom::Segment => (segment, resp),
            KeyFrom::Header(name) => {
                let raw = resp
                    .headers()
                    .get(name.as_str())
                    .and_then(|v| v.to_str().ok())
                    .and_then(last_segment);
                (raw, resp)
            }
            KeyFrom::Json(pointer) => json_key(resp, pointer).await,
        };
        let Some(raw) = raw else {
            tracing::warn!(filter = self.filter.name(), key_from = ?self.key,
                "write-through: a successful write carried no key where configured");
            return resp;
        };
        match normalize(self.filter.normalize_rule(), Cow::Borrowed(raw.as_str())) {
            Ok(key) => {
                self.admit
                    .admit(&self.filter, &[key.to_owned_key()], Forget::Absence)
                    .await;
                self.added.inc();
                tracing::debug!(filter = self.filter.name(), key = %key.to_owned_key(), "write-through added a key");
            }
            Err(e) => {
                tracing::warn!(filter = self.filter.name(), error = %Chain(&e), "write-through: the created key failed normalisation");
            }
        }
        resp
    }
}

/// The first rule matching the request's method and canonical path (every spelling of a
/// write path counts), with the path segment (owned, percent-decoded) when the rule
/// takes its key from there.
pub fn matching<'r, B>(
    rules: &'r [WriteThrough],
    req: &Request<B>,
) -> Option<(&'r WriteThrough, Option<String>)> {
    if !rules.iter().any(|r| r.methods.contains(req.method())) {
        return None;
    }
    let path = bloomgate_core::pattern::path::canonical(req.uri().path()).ok()?;
    rules.iter().find_map(|rule| {
        if !rule.methods.contains(req.method()) {
            return None;
        }
        let segment = rule.pattern.matches(&path)?;
        let owned = match rule.key {
            KeyFrom::Segment => percent_decode_str(segment)
                .decode_utf8()
                .ok()
                .map(|s| s.into_owned()),
            _ => None,
        };
        Some((rule, owned))
    })
}

/// The last non-empty path segment of a header value such as `Location: /api/products/42`
/// or an absolute URL.
fn last_segment(value: &str) -> Option<String> {
    let path = value.split(['?', '#']).next().unwrap_or(value);
    let seg = path.trim_end_matches('/').rsplit('/').next()?;
    if seg.is_empty() {
        return None;
    }
    percent_decode_str(seg)
        .decode_utf8()
        .ok()
        .map(|s| s.into_owned())
}

/// The configured field, dotted for nesting (`data.sku_id`), as a JSON pointer
/// (`/data/sku_id`). Each name is escaped as RFC 6901 asks: `~` as `~0`, then `/` as `~1`,
/// so names holding either are found; a name of digits also picks an array element.
fn json_pointer(field: &str) -> String {
    let mut pointer = String::with_capacity(field.len() + 1);
    for name in field.split('.') {
        pointer.push('/');
        pointer.push_str(&name.replace('~', "~0").replace('/', "~1"));
    }
    pointer
}

/// Buffers a response whose declared length is small enough and reads the value at
/// `pointer` from its JSON body. Bodies without a length, or larger, are passed on
/// unread.
async fn json_key(
    resp: Response<ProxyBody>,
    pointer: &str,
) -> (Option<String>, Response<ProxyBody>) {
    let declared = resp
        .headers()
        .get(CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<usize>().ok());
    if declared.is_none_or(|n| n > MAX_JSON_BODY) {
        return (None, resp);
    }
    let (parts, body) = resp.into_parts();
    let bytes = match Limited::new(body, MAX_JSON_BODY).collect().await {
        Ok(b) => b.to_bytes(),
        Err(e) => {
            tracing::warn!(error = %Chain(&*e), "write-through: cannot read the upstream body");
            let mut r = Response::from_parts(parts, Either::Left(Full::new(Bytes::new())));
            *r.status_mut() = StatusCode::BAD_GATEWAY;
            return (None, r);
        }
    };
    let key = serde_json::from_slice::<serde_json::Value>(&bytes)
        .ok()
        .and_then(|v| match v.pointer(pointer)? {
            serde_json::Value::String(s) => Some(s.clone()),
            serde_json::Value::Number(n) => Some(n.to_string()),
            _ => None,
        });
    (
        key,
        Response::from_parts(parts, Either::Left(Full::new(bytes))),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn location_headers_yield_their_last_segment() {
        assert_eq!(last_segment("/api/products/42").as_deref(), Some("42"));
        assert_eq!(
            last_segment("http://h/api/products/42/?x=1").as_deref(),
            Some("42")
        );
        assert_eq!(last_segment("/a%2Fb/7").as_deref(), Some("7"));
        assert_eq!(last_segment("/"), None);
    }

    #[test]
    fn dotted_fields_become_escaped_json_pointers() {
        assert_eq!(json_pointer("sku_id"), "/sku_id");
        assert_eq!(json_pointer("data.sku_id"), "/data/sku_id");
        assert_eq!(json_pointer("a~b.c/d"), "/a~0b/c~1d");
        // `~1` in a name is the two characters, not an escaped `/`.
        assert_eq!(json_pointer("x~1y"), "/x~01y");
        assert_eq!(json_pointer(""), "/");
    }

    /// The key `json_key` reads at `field` from a response with this body.
    async fn key_in(body: serde_json::Value, field: &str) -> Option<String> {
        let bytes = Bytes::from(body.to_string());
        let resp = Response::builder()
            .header(CONTENT_LENGTH, bytes.len())
            .body(Either::Left(Full::new(bytes.clone())))
            .expect("response");
        let (key, resp) = json_key(resp, &json_pointer(field)).await;
        let passed_on = resp.into_body().collect().await.expect("body").to_bytes();
        assert_eq!(passed_on, bytes, "the body is passed on unchanged");
        key
    }

    #[tokio::test]
    async fn json_keys_are_found_by_pointer() {
        use serde_json::json;
        let body = json!({
            "data": {"sku_id": 42, "name": "x"},
            "a~b": {"c/d": "7"},
            "x~1y": "literal",
            "x/y": "slash",
            "items": [{"id": "first"}],
            "flag": true,
        });
        assert_eq!(
            key_in(body.clone(), "data.sku_id").await.as_deref(),
            Some("42")
        );
        assert_eq!(key_in(body.clone(), "a~b.c/d").await.as_deref(), Some("7"));
        assert_eq!(
            key_in(body.clone(), "x~1y").await.as_deref(),
            Some("literal")
        );
        assert_eq!(key_in(body.clone(), "x/y").await.as_deref(), Some("slash"));
        assert_eq!(
            key_in(body.clone(), "items.0.id").await.as_deref(),
            Some("first")
        );
        assert_eq!(key_in(body.clone(), "data.missing").await, None);
        assert_eq!(
            key_in(body.clone(), "data").await,
            None,
            "an object is no key"
        );
        assert_eq!(key_in(body, "flag").await, None, "a boolean is no key");
    }
}
