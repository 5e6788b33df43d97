//! Every response the data plane makes itself: JSON errors and refusals, replayed cache
//! entries (with conditional requests answered by 304), and the body type they share with
//! passed-through upstream answers.

use bytes::Bytes;
use http::header::{CONTENT_TYPE, ETAG, HeaderName, LAST_MODIFIED};
use http::{HeaderMap, HeaderValue, Response, StatusCode};
use http_body_util::{Either, Full};

use crate::origin::client::AnswerBody;
use crate::origin::http_cache;
use crate::origin::{CachedResponse, Validators};

/// Response bodies: a buffer we made, or the upstream's stream passed through.
pub type ProxyBody = Either<Full<Bytes>, AnswerBody>;

/// The header that tells clients and tests which stage answered.
pub const X_BLOOMGATE: HeaderName = HeaderName::from_static("x-bloomgate");

const NOT_FOUND_BODY: &[u8] = br#"{"error":"not_found"}"#;

/// A JSON response: the one place that sets the status and content type of a JSON body
/// (data-plane errors, refusals and the admin API all build theirs here).
pub fn json(status: StatusCode, body: impl Into<Bytes>) -> Response<Full<Bytes>> {
    let mut resp = Response::new(Full::new(body.into()));
    *resp.status_mut() = status;
    resp.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    resp
}

pub(super) fn not_found() -> Response<ProxyBody> {
    json(StatusCode::NOT_FOUND, Bytes::from_static(NOT_FOUND_BODY)).map(Either::Left)
}

/// The response for a cached (or just fetched) answer: 304 when the request's
/// conditions hold for its validators, else the answer itself.
/// [`replay`] of an entry past its TTL, with its `Age` (RFC 9111 §5.1).
pub(super) fn replay_stale(
    cached: CachedResponse,
    request: &HeaderMap,
    now: std::time::Instant,
) -> Response<ProxyBody> {
    let age = cached.age_secs(now);
    let mut resp = replay(cached, request);
    resp.headers_mut()
        .insert(http::header::AGE, HeaderValue::from(age));
    resp
}

pub(super) fn replay(cached: CachedResponse, request: &HeaderMap) -> Response<ProxyBody> {
    let meta = &*cached.meta;
    let Validators {
        etag,
        last_modified,
    } = &meta.validators;
    let conditional = (etag.is_some() || last_modified.is_some())
        && http_cache::not_modified(request, etag.as_ref(), last_modified.as_ref());
    let mut resp = if conditional {
        let mut r = Response::new(Either::Left(Full::new(Bytes::new())));
        *r.status_mut() = StatusCode::NOT_MODIFIED;
        r
    } else {
        let mut r = Response::new(Either::Left(Full::new(cached.body)));
        *r.status_mut() = cached.status;
        if let Some(ct) = &meta.content_type {
            r.headers_mut().insert(CONTENT_TYPE, ct.clone());
        }
        r
    };
    let headers = resp.headers_mut();
    if let Some(v) = etag {
        headers.insert(ETAG, v.clone());
    }
    if let Some(v) = last_modified {
        headers.insert(LAST_MODIFIED, v.clone());
    }
    for (name, value) in meta.headers.iter() {
        headers.append(name.clone(), value.clone());
    }
    resp
}
