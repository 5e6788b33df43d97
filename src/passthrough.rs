//! Plain reverse proxying for requests that are not on a guarded route: method, path,
//! query, headers (minus hop-by-hop ones) and streamed bodies both ways, with
//! X-Forwarded-For, X-Forwarded-Proto and Via added. No gate, no cache.

use std::net::SocketAddr;

use http::header::{CONNECTION, CONTENT_LENGTH, HeaderName, VIA};
use http::{HeaderMap, HeaderValue, Request, Response, Version};
use http_body_util::{Either, Full, Limited};
use hyper::body::Incoming;

use crate::error::ProxyError;
use crate::metrics::PassthroughMetrics;
use crate::outcome::BYPASS;
use crate::proxy::{ProxyBody, X_BLOOMGATE, error_response};
use crate::upstream::Upstream;

const X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
const X_FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");
const VIA_VALUE: &str = "1.1 bloomgate";

/// Headers that describe one hop and are never forwarded (RFC 9110 §7.6.1, plus the
/// legacy ones proxies still see).
const HOP_BY_HOP: [&str; 8] = [
    "connection",
    "keep-alive",
    "proxy-connection",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "upgrade",
];

/// Forwards `req` to the upstream and streams the answer back.
pub async fn forward(
    upstream: Option<&Upstream>,
    req: Request<Incoming>,
    peer: SocketAddr,
    max_body: u64,
    metrics: &PassthroughMetrics,
) -> Response<ProxyBody> {
    let mut resp = match upstream {
        None => no_upstream(),
        Some(up) => match forward_inner(up, req, peer, max_body).await {
            Ok(resp) => resp,
            Err(e) => {
                e.log("passthrough");
                error_response(e)
            }
        },
    };
    metrics.observe(resp.status().as_u16());
    resp.headers_mut()
        .insert(X_BLOOMGATE, HeaderValue::from_static(BYPASS));
    resp
}

async fn forward_inner(
    upstream: &Upstream,
    req: Request<Incoming>,
    peer: SocketAddr,
    max_body: u64,
) -> Result<Response<ProxyBody>, ProxyError> {
    let declared = req
        .headers()
        .get(CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > max_body) {
        return Err(ProxyError::BodyTooLarge);
    }
    let (mut parts, body) = req.into_parts();
    parts.uri = upstream.uri_for(parts.uri.path_and_query())?;
    parts.version = Version::HTTP_11;
    strip_hop_by_hop(&mut parts.headers);
    append_forwarded(&mut parts.headers, peer);
    let limit = usize::try_from(max_body).unwrap_or(usize::MAX);
    let upstream_req = Request::from_parts(parts, Either::Right(Limited::new(body, limit)));
    let resp = upstream.send(upstream_req).await?;
    let (mut parts, body) = resp.into_parts();
    strip_hop_by_hop(&mut parts.headers);
    parts
        .headers
        .append(VIA, HeaderValue::from_static(VIA_VALUE));
    Ok(Response::from_parts(parts, Either::Right(body)))
}

/// Removes hop-by-hop headers, including every header the `Connection` header names.
pub fn strip_hop_by_hop(headers: &mut HeaderMap) {
    let named: Vec<HeaderName> = headers
        .get_all(CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|name| HeaderName::from_bytes(name.trim().as_bytes()).ok())
        .collect();
    for name in named {
        headers.remove(name);
    }
    for name in HOP_BY_HOP {
        headers.remove(name);
    }
    // Framing is re-decided by hyper for the next hop.
    headers.remove(http::header::TRANSFER_ENCODING);
}

fn append_forwarded(headers: &mut HeaderMap, peer: SocketAddr) {
    let ip = peer.ip().to_string();
    let xff = match headers.get(&X_FORWARDED_FOR).and_then(|v| v.to_str().ok()) {
        Some(prior) => format!("{prior}, {ip}"),
        None => ip,
    };
    if let Ok(v) = HeaderValue::from_str(&xff) {
        headers.insert(X_FORWARDED_FOR, v);
    }
    if !headers.contains_key(&X_FORWARDED_PROTO) {
        headers.insert(X_FORWARDED_PROTO, HeaderValue::from_static("http"));
    }
    headers.append(VIA, HeaderValue::from_static(VIA_VALUE));
}

fn no_upstream() -> Response<ProxyBody> {
    let mut resp = Response::new(Either::Left(Full::from(
        r#"{"error":"no_route","message":"no guarded route matches and no upstream is configured"}"#,
    )));
    *resp.status_mut() = http::StatusCode::NOT_FOUND;
    resp.headers_mut().insert(
        http::header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    resp
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hop_by_hop_and_connection_named_headers_are_removed() {
        let mut h = HeaderMap::new();
        h.insert(
            CONNECTION,
            HeaderValue::from_static("keep-alive, X-Secret-Hop"),
        );
        h.insert("x-secret-hop", HeaderValue::from_static("1"));
        h.insert("keep-alive", HeaderValue::from_static("timeout=5"));
        h.insert("te", HeaderValue::from_static("trailers"));
        h.insert("x-kept", HeaderValue::from_static("1"));
        strip_hop_by_hop(&mut h);
        assert!(h.get("x-secret-hop").is_none());
        assert!(h.get("keep-alive").is_none());
        assert!(h.get("te").is_none());
        assert!(h.get(CONNECTION).is_none());
        assert_eq!(h.get("x-kept").map(|v| v.as_bytes()), Some(&b"1"[..]));
    }

    #[test]
    fn forwarded_for_appends() {
        let mut h = HeaderMap::new();
        h.insert(X_FORWARDED_FOR, HeaderValue::from_static("10.0.0.1"));
        append_forwarded(&mut h, SocketAddr::from(([127, 0, 0, 1], 5555)));
        assert_eq!(
            h.get(X_FORWARDED_FOR).map(|v| v.as_bytes()),
            Some(&b"10.0.0.1, 127.0.0.1"[..])
        );
        assert_eq!(
            h.get(X_FORWARDED_PROTO).map(|v| v.as_bytes()),
            Some(&b"http"[..])
        );
        assert_eq!(h.get(VIA).map(|v| v.as_bytes()), Some(VIA_VALUE.as_bytes()));
    }
}
