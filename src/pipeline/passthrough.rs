//! Plain reverse proxying for requests that are not on a guarded route: method, path,
//! query, headers (minus hop-by-hop ones) and streamed bodies both ways, with the
//! forwarded headers rewritten (see `forwarded`) and Via added. No gate, no cache.

use std::net::SocketAddr;

use bytes::Bytes;
use http::header::{
    CONNECTION, CONTENT_LENGTH, HOST, HeaderName, PROXY_AUTHENTICATE, PROXY_AUTHORIZATION, TE,
    TRAILER, TRANSFER_ENCODING, UPGRADE, VIA,
};
use http::request::Parts;
use http::{HeaderMap, HeaderValue, Request, Response, Version};
use http_body_util::{Either, Empty};
use hyper::body::Incoming;

use crate::origin::client::{self, Upstream};
use crate::pipeline::error::ProxyError;
use crate::pipeline::error::error_response;
use crate::pipeline::forwarded;
use crate::pipeline::metrics::PassthroughMetrics;
use crate::pipeline::outcome::BYPASS;
use crate::pipeline::response::{self, ProxyBody, X_BLOOMGATE};
use crate::server::ConnectionInfo;
use bloomgate_core::pattern::cidrs::Cidrs;

const VIA_VALUE: &str = "1.1 bloomgate";

/// Headers that describe one hop and are never forwarded (RFC 9110 §7.6.1, plus the
/// legacy ones proxies still see), and `Transfer-Encoding`, whose framing hyper decides
/// again for the next hop.
static HOP_BY_HOP: [HeaderName; 9] = [
    CONNECTION,
    HeaderName::from_static("keep-alive"),
    HeaderName::from_static("proxy-connection"),
    PROXY_AUTHENTICATE,
    PROXY_AUTHORIZATION,
    TE,
    TRAILER,
    UPGRADE,
    TRANSFER_ENCODING,
];

/// Forwards `req` to the upstream and streams the answer back. `trusted` are the
/// proxies whose forwarded headers are kept.
pub async fn forward(
    upstream: Option<&Upstream>,
    req: Request<Option<Incoming>>,
    peer: SocketAddr,
    max_body: u64,
    metrics: &PassthroughMetrics,
    trusted: &Cidrs,
) -> Response<ProxyBody> {
    let mut resp = match upstream {
        None => no_upstream(),
        Some(up) => match forward_inner(up, req, peer, max_body, trusted).await {
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
    req: Request<Option<Incoming>>,
    peer: SocketAddr,
    max_body: u64,
    trusted: &Cidrs,
) -> Result<Response<ProxyBody>, ProxyError> {
    let declared = req
        .headers()
        .get(CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > max_body) {
        return Err(ProxyError::BodyTooLarge);
    }
    let tls = req
        .extensions()
        .get::<ConnectionInfo>()
        .is_some_and(|c| c.tls);
    let (mut parts, body) = req.into_parts();
    host_from_absolute_target(&mut parts);
    parts.uri = upstream.uri_for(std::mem::take(&mut parts.uri).into_parts().path_and_query)?;
    parts.version = Version::HTTP_11;
    strip_hop_by_hop(&mut parts.headers);
    append_forwarded(&mut parts.headers, peer, trusted, tls);
    let limit = usize::try_from(max_body).unwrap_or(usize::MAX);
    let body = match body {
        Some(body) => client::client_body(body, limit),
        None => Either::Left(Empty::new()),
    };
    let upstream_req = Request::from_parts(parts, body);
    let resp = upstream.send(upstream_req).await?;
    let (mut parts, body) = resp.into_parts();
    if parts.headers.contains_key(TRANSFER_ENCODING) {
        // The body is framed by its Transfer-Encoding; a Content-Length beside it does
        // not describe it and must not be passed on (RFC 9112 §6.3). hyper's client
        // keeps it; the own client has dropped it already.
        parts.headers.remove(CONTENT_LENGTH);
    }
    strip_hop_by_hop(&mut parts.headers);
    parts
        .headers
        .append(VIA, HeaderValue::from_static(VIA_VALUE));
    Ok(Response::from_parts(parts, Either::Right(body)))
}

/// Removes hop-by-hop headers, including every header the `Connection` header names.
pub fn strip_hop_by_hop(headers: &mut HeaderMap) {
    let hop = |name: &HeaderName| HOP_BY_HOP.contains(name);
    // Most messages carry none: one pass over their few names spares nine lookups.
    if !headers.keys().any(hop) {
        return;
    }
    // What `Connection` names besides the hop-by-hop headers themselves (the common
    // `Connection: keep-alive` names none), then the hop-by-hop headers present, each
    // found in one pass over the names rather than looked up.
    let named: Vec<HeaderName> = headers
        .get_all(CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(str::trim)
        .filter(|token| {
            !HOP_BY_HOP
                .iter()
                .any(|h| h.as_str().eq_ignore_ascii_case(token))
        })
        .filter_map(|token| HeaderName::from_bytes(token.as_bytes()).ok())
        .collect();
    for name in named {
        headers.remove(name);
    }
    let present: Vec<HeaderName> = headers.keys().filter(|n| hop(n)).cloned().collect();
    for name in present {
        headers.remove(name);
    }
}

/// Gives the upstream the Host the client's request was for.
///
/// An HTTP/2 request names its host in the `:authority` pseudo-header, which hyper puts
/// in the URI (a `Host` header is optional there, and the authority wins over it, RFC
/// 9113 §8.3.1); the upstream, spoken to in HTTP/1.1, gets it as `Host`. A target in
/// absolute form (`GET http://a.example/p`) names its host, and RFC 9112
/// §3.2.2 makes that authority win over any Host header; a proxy forwarding it must
/// generate Host from the target. We do that rather than refuse a mismatch: the client
/// controls Host on every other request anyway, so this gives it nothing new, and the
/// upstream then sees exactly the host every RFC-following hop in front of us used.
fn host_from_absolute_target(parts: &mut Parts) {
    let Some(authority) = parts.uri.authority() else {
        return;
    };
    // Host never carries userinfo (`user@`), which an authority may.
    let host = match authority.port() {
        Some(port) => format!("{}:{port}", authority.host()),
        None => authority.host().to_owned(),
    };
    match HeaderValue::from_str(&host) {
        Ok(value) => {
            parts.headers.insert(HOST, value);
        }
        // Unreachable for a parsed authority; dropping the client's Host is the safe side.
        Err(_) => {
            parts.headers.remove(HOST);
        }
    }
}

/// The forwarded headers as the upstream should see them, and this hop's Via.
fn append_forwarded(headers: &mut HeaderMap, peer: SocketAddr, trusted: &Cidrs, tls: bool) {
    forwarded::rewrite(headers, peer.ip(), trusted, tls);
    headers.append(VIA, HeaderValue::from_static(VIA_VALUE));
}

fn no_upstream() -> Response<ProxyBody> {
    response::json(
        http::StatusCode::NOT_FOUND,
        Bytes::from_static(
            br#"{"error":"no_route","message":"no guarded route matches and no upstream is configured"}"#,
        ),
    )
    .map(Either::Left)
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

    proptest::proptest! {
        /// Whatever mix of hop-by-hop, Connection-named and end-to-end headers a message
        /// carries, the first two kinds go and the last stays whole.
        #[test]
        fn only_hop_by_hop_headers_are_removed(
            picks in proptest::collection::vec((0usize..14, 0usize..3), 0..12),
            named in proptest::collection::vec(0usize..14, 0..4),
        ) {
            let pool: Vec<HeaderName> = HOP_BY_HOP
                .iter()
                .cloned()
                .chain(["x-a", "x-b", "accept", "cookie", "x-c"].map(HeaderName::from_static))
                .collect();
            let mut h = HeaderMap::new();
            for (i, v) in &picks {
                h.append(pool[*i].clone(), HeaderValue::from(*v));
            }
            if !named.is_empty() {
                let list: Vec<&str> = named.iter().map(|i| pool[*i].as_str()).collect();
                let value = HeaderValue::from_str(&list.join(" , ")).expect("a token list");
                h.append(CONNECTION, value);
            }
            let before = h.clone();
            strip_hop_by_hop(&mut h);
            let gone = |n: &HeaderName| {
                HOP_BY_HOP.contains(n) || (!named.is_empty() && named.iter().any(|i| pool[*i] == n))
            };
            for name in before.keys() {
                if gone(name) {
                    proptest::prop_assert!(!h.contains_key(name), "{name} kept");
                } else {
                    let a: Vec<_> = before.get_all(name).iter().collect();
                    let b: Vec<_> = h.get_all(name).iter().collect();
                    proptest::prop_assert_eq!(a, b, "{} changed", name);
                }
            }
            proptest::prop_assert!(h.keys().all(|n| before.contains_key(n)));
        }
    }

    #[test]
    fn forwarded_headers_depend_on_the_peer() {
        use crate::pipeline::client::X_FORWARDED_FOR;
        let trusted = Cidrs::parse(&["127.0.0.1/32"]).expect("valid");
        let peer = SocketAddr::from(([127, 0, 0, 1], 5555));
        let mut h = HeaderMap::new();
        h.insert(X_FORWARDED_FOR, HeaderValue::from_static("10.0.0.1"));
        append_forwarded(&mut h, peer, &trusted, false);
        assert_eq!(
            h.get(X_FORWARDED_FOR).map(|v| v.as_bytes()),
            Some(&b"10.0.0.1, 127.0.0.1"[..])
        );
        assert_eq!(h.get(VIA).map(|v| v.as_bytes()), Some(VIA_VALUE.as_bytes()));

        let mut h = HeaderMap::new();
        h.insert(X_FORWARDED_FOR, HeaderValue::from_static("10.0.0.1"));
        append_forwarded(&mut h, peer, &Cidrs::default(), false);
        assert_eq!(
            h.get(X_FORWARDED_FOR).map(|v| v.as_bytes()),
            Some(&b"127.0.0.1"[..])
        );
    }

    fn parts_of(target: &str, host: Option<&str>) -> Parts {
        let mut req = Request::builder().uri(target);
        if let Some(h) = host {
            req = req.header(HOST, h);
        }
        req.body(()).expect("request").into_parts().0
    }

    #[test]
    fn an_absolute_target_decides_the_host() {
        let host = |p: &Parts| p.headers.get(HOST).map(|v| v.as_bytes().to_vec());
        let mut p = parts_of("http://other.example/echo", Some("good.example"));
        host_from_absolute_target(&mut p);
        assert_eq!(host(&p), Some(b"other.example".to_vec()));
        let mut p = parts_of("http://user:pw@other.example:8081/x?q", None);
        host_from_absolute_target(&mut p);
        assert_eq!(host(&p), Some(b"other.example:8081".to_vec()));
        assert_eq!(p.headers.get_all(HOST).iter().count(), 1);
        // Origin form: the client's Host stays.
        let mut p = parts_of("/echo", Some("good.example"));
        host_from_absolute_target(&mut p);
        assert_eq!(host(&p), Some(b"good.example".to_vec()));
    }
}
