//! The server's own answer to an over-long request target: a 414 made before any
//! handler sees the request (`server.max_uri_bytes`), with the JSON body every
//! data-plane refusal carries.

use bytes::Bytes;
use http::header::{CONNECTION, CONTENT_TYPE};
use http::{HeaderValue, Request, Response, StatusCode, Version};
use http_body_util::{Either, Full};
use hyper::body::Incoming;

use bloomgate_core::report::Chain;

/// What a connection answers with: a refusal the server made itself (this module's 414),
/// or the handler's response.
pub(super) type ServedBody<B> = Either<Full<Bytes>, B>;

/// A request target (path and query) longer than `server.max_uri_bytes`: answered 414
/// by the server itself, before any handler sees the request.
#[derive(Debug, thiserror::Error)]
#[error("the request target is {len} bytes long; at most {limit} are accepted")]
struct UriTooLong {
    /// Length of the path and query received.
    len: usize,
    /// The configured limit.
    limit: usize,
}

impl UriTooLong {
    /// The error code of its JSON body, as every data-plane refusal carries one.
    const CODE: &'static str = "uri_too_long";
}

/// The 414 for a request whose target (path and query) is longer than `limit`, or
/// `None` when it fits. An HTTP/1.1 connection is closed after the answer; HTTP/2 has no
/// connection header, and only the stream ends.
pub(super) fn refuse_long_target<B>(
    req: &Request<Incoming>,
    limit: usize,
    listener: &'static str,
) -> Option<Response<ServedBody<B>>> {
    let len = req.uri().path_and_query().map_or(0, |pq| pq.as_str().len());
    if len <= limit {
        return None;
    }
    let error = UriTooLong { len, limit };
    tracing::debug!(route = listener, code = UriTooLong::CODE, error = %Chain(&error), "request refused");
    let body = serde_json::json!({ "error": UriTooLong::CODE, "message": error.to_string() });
    let mut resp = Response::new(Either::Left(Full::new(Bytes::from(body.to_string()))));
    *resp.status_mut() = StatusCode::URI_TOO_LONG;
    resp.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    if req.version() < Version::HTTP_2 {
        resp.headers_mut()
            .insert(CONNECTION, HeaderValue::from_static("close"));
    }
    Some(resp)
}
