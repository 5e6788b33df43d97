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
use hyper::body::Incoming;
use percent_encoding::percent_decode_str;
use prometheus::IntCounter;

use super::ProxyBody;
use super::route::{PathPattern, PatternError};
use crate::config::{WriteKey, WriteThroughConfig};
use crate::gate::Filter;
use crate::gate::admit::{Admit, Forget};
use crate::key::normalize;

/// Largest response body read to find a JSON key field.
const MAX_JSON_BODY: usize = 1024 * 1024;

/// Why a write-through rule does not compile. The messages are reasons for the rule's
/// config.
#[derive(Debug, thiserror::Error)]
pub enum RuleError {
    /// The path pattern.
    #[error(transparent)]
    Path(#[from] PatternError),
    /// A method name that is not a valid token.
    #[error(transparent)]
    Method(#[from] http::method::InvalidMethod),
    /// A status outside 100..=999.
    #[error(transparent)]
    Status(#[from] http::status::InvalidStatusCode),
}

/// One compiled write-through rule.
pub struct WriteThrough {
    pattern: PathPattern,
    methods: Vec<Method>,
    statuses: Vec<StatusCode>,
    key: WriteKey,
    filter: Arc<Filter>,
    admit: Arc<Admit>,
    added: IntCounter,
}

impl WriteThrough {
    /// Compiles a rule; `filter` is the filter it names.
    pub fn new(
        config: &WriteThroughConfig,
        filter: Arc<Filter>,
        admit: Arc<Admit>,
        added: IntCounter,
    ) -> Result<WriteThrough, RuleError> {
        Ok(WriteThrough {
            pattern: PathPattern::parse_write(&config.path, &config.key)?,
            methods: config
                .methods
                .iter()
                .map(|m| Method::from_bytes(m.to_ascii_uppercase().as_bytes()))
                .collect::<Result<_, _>>()?,
            statuses: config
                .statuses
                .iter()
                .map(|s| StatusCode::from_u16(*s))
                .collect::<Result<_, _>>()?,
            key: config.key.clone(),
            filter,
            admit,
            added,
        })
    }

    fn accepts(&self, status: StatusCode) -> bool {
        if self.statuses.is_empty() {
            status.is_success()
        } else {
            self.statuses.contains(&status)
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
            WriteKey::Segment(_) => (segment, resp),
            WriteKey::Header(name) => {
                let raw = resp
                    .headers()
                    .get(name.as_str())
                    .and_then(|v| v.to_str().ok())
                    .and_then(last_segment);
                (raw, resp)
            }
            WriteKey::Json(field) => json_key(resp, field).await,
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
                tracing::warn!(filter = self.filter.name(), error = %e, "write-through: the created key failed normalisation");
            }
        }
        resp
    }
}

/// The first rule matching the request's method and canonical path (every spelling of a
/// write path counts), with the path segment (owned, percent-decoded) when the rule
/// takes its key from there.
pub fn matching<'r>(
    rules: &'r [WriteThrough],
    req: &Request<Incoming>,
) -> Option<(&'r WriteThrough, Option<String>)> {
    if !rules.iter().any(|r| r.methods.contains(req.method())) {
        return None;
    }
    let path = super::path::canonical(req.uri().path()).ok()?;
    rules.iter().find_map(|rule| {
        if !rule.methods.contains(req.method()) {
            return None;
        }
        let segment = rule.pattern.matches(&path)?;
        let owned = match rule.key {
            WriteKey::Segment(_) => percent_decode_str(segment)
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

/// Buffers a response whose declared length is small enough and reads `field` (dotted
/// for nesting) from its JSON body. Bodies without a length, or larger, are passed on
/// unread.
async fn json_key(resp: Response<ProxyBody>, field: &str) -> (Option<String>, Response<ProxyBody>) {
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
            tracing::warn!(error = %e, "write-through: cannot read the upstream body");
            let mut r = Response::from_parts(parts, Either::Left(Full::new(Bytes::new())));
            *r.status_mut() = StatusCode::BAD_GATEWAY;
            return (None, r);
        }
    };
    let key = serde_json::from_slice::<serde_json::Value>(&bytes)
        .ok()
        .and_then(|v| field.split('.').try_fold(v, |v, part| v.get(part).cloned()))
        .and_then(|v| match v {
            serde_json::Value::String(s) => Some(s),
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
}
