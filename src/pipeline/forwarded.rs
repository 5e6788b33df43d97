//! The forwarded-header family (`X-Forwarded-For`, `X-Forwarded-Proto`,
//! `X-Forwarded-Host`, `Forwarded`) as the next hop sees it: kept and extended when the
//! peer is a trusted proxy, replaced by what bloomgate itself knows otherwise. Used by
//! pass-through and by upstream origin fetches; who the client is lives in `client`.

use std::net::IpAddr;

use bytes::{BufMut, BytesMut};
use http::header::{FORWARDED, HeaderName};
use http::{HeaderMap, HeaderValue};

use crate::pipeline::client::X_FORWARDED_FOR;
use bloomgate_core::pattern::cidrs::{Cidrs, canonical_ip};

/// The `X-Forwarded-Proto` header name.
pub const X_FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");
/// The `X-Forwarded-Host` header name.
pub const X_FORWARDED_HOST: HeaderName = HeaderName::from_static("x-forwarded-host");

/// The protocol of the hop bloomgate saw: `https` when it terminated TLS itself.
fn proto(tls: bool) -> HeaderValue {
    HeaderValue::from_static(if tls { "https" } else { "http" })
}

/// Rewrites the family in `headers`, a request about to be forwarded as received from
/// `peer`, over TLS when `tls`.
///
/// From a peer in `trusted`, the `X-Forwarded-For` chain (all its lines, in order) is
/// kept with the peer appended, and the other headers of the family are kept; a missing
/// `X-Forwarded-Proto` becomes this hop's protocol. From any other peer, whatever the
/// client wrote is removed: `X-Forwarded-For` is the peer alone, `X-Forwarded-Proto` is
/// `https` on TLS and `http` otherwise, and neither `X-Forwarded-Host` nor `Forwarded`
/// is sent. IPv4-mapped IPv6 peers are written (and matched) as IPv4.
pub fn rewrite(headers: &mut HeaderMap, peer: IpAddr, trusted: &Cidrs, tls: bool) {
    let peer = canonical_ip(peer);
    let peer_value = ip_value(peer);
    if trusted.contains(peer) {
        let chain = appended_chain(headers, &peer_value);
        headers.insert(X_FORWARDED_FOR, chain);
        if !headers.contains_key(&X_FORWARDED_PROTO) {
            headers.insert(X_FORWARDED_PROTO, proto(tls));
        }
        return;
    }
    // Seldom sent by a client: a pass over the few names spares two lookups.
    if headers
        .keys()
        .any(|name| *name == X_FORWARDED_HOST || *name == FORWARDED)
    {
        headers.remove(&X_FORWARDED_HOST);
        headers.remove(FORWARDED);
    }
    headers.insert(X_FORWARDED_FOR, peer_value);
    headers.insert(X_FORWARDED_PROTO, proto(tls));
}

/// The family for a request built from scratch (an upstream origin fetch): what
/// [`rewrite`] would leave of the client's `headers`, appended to `out`.
pub fn copy_rewritten(
    client: &HeaderMap,
    peer: IpAddr,
    trusted: &Cidrs,
    tls: bool,
    out: &mut HeaderMap,
) {
    let mut family = HeaderMap::new();
    if trusted.contains(peer) {
        for name in [
            X_FORWARDED_FOR,
            X_FORWARDED_PROTO,
            X_FORWARDED_HOST,
            FORWARDED,
        ] {
            for value in client.get_all(&name) {
                family.append(name.clone(), value.clone());
            }
        }
    }
    rewrite(&mut family, peer, trusted, tls);
    for (name, value) in family.iter() {
        out.append(name.clone(), value.clone());
    }
}

/// The address as a header value (IPv6 without brackets, as `X-Forwarded-For` has it).
fn ip_value(ip: IpAddr) -> HeaderValue {
    HeaderValue::try_from(ip.to_string()).unwrap_or(HeaderValue::from_static("unknown"))
}

/// Every `X-Forwarded-For` line joined into one list with `peer` at its end. Empty lines
/// are skipped; the entries themselves are passed on as the trusted proxy wrote them.
fn appended_chain(headers: &HeaderMap, peer: &HeaderValue) -> HeaderValue {
    let mut joined = BytesMut::new();
    let lines = headers.get_all(&X_FORWARDED_FOR).iter().chain([peer]);
    for line in lines.filter(|v| !v.as_bytes().trim_ascii().is_empty()) {
        if !joined.is_empty() {
            joined.put_slice(b", ");
        }
        joined.put_slice(line.as_bytes().trim_ascii());
    }
    // The parts were valid header values and ", " is too; keep the peer if not.
    HeaderValue::from_maybe_shared(joined.freeze()).unwrap_or_else(|_| peer.clone())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().expect("address")
    }

    fn trusted() -> Cidrs {
        Cidrs::parse(&["10.0.0.0/8", "fd00::/8"]).expect("valid")
    }

    fn values(h: &HeaderMap, name: &HeaderName) -> Vec<String> {
        h.get_all(name)
            .iter()
            .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
            .collect()
    }

    fn claims() -> HeaderMap {
        let mut h = HeaderMap::new();
        h.append(X_FORWARDED_FOR, HeaderValue::from_static("6.6.6.6"));
        h.append(
            X_FORWARDED_FOR,
            HeaderValue::from_static("not-an-ip, 7.7.7.7"),
        );
        h.insert(X_FORWARDED_PROTO, HeaderValue::from_static("https"));
        h.insert(X_FORWARDED_HOST, HeaderValue::from_static("admin.internal"));
        h.insert(
            FORWARDED,
            HeaderValue::from_static("for=6.6.6.6;proto=https"),
        );
        h
    }

    #[test]
    fn an_untrusted_peer_replaces_every_claim() {
        for peer in ["203.0.113.9", "2001:db8::7", "::ffff:203.0.113.9"] {
            let mut h = claims();
            rewrite(&mut h, ip(peer), &trusted(), false);
            let expected = peer.trim_start_matches("::ffff:");
            assert_eq!(values(&h, &X_FORWARDED_FOR), [expected], "{peer}");
            assert_eq!(values(&h, &X_FORWARDED_PROTO), ["http"]);
            assert!(h.get(X_FORWARDED_HOST).is_none());
            assert!(h.get(FORWARDED).is_none());
        }
        // No trusted proxies at all: everyone is untrusted.
        let mut h = claims();
        rewrite(&mut h, ip("10.0.0.1"), &Cidrs::default(), false);
        assert_eq!(values(&h, &X_FORWARDED_FOR), ["10.0.0.1"]);
    }

    #[test]
    fn a_trusted_peer_keeps_the_chain_and_is_appended() {
        let mut h = claims();
        rewrite(&mut h, ip("::ffff:10.1.2.3"), &trusted(), false);
        assert_eq!(
            values(&h, &X_FORWARDED_FOR),
            ["6.6.6.6, not-an-ip, 7.7.7.7, 10.1.2.3"]
        );
        assert_eq!(values(&h, &X_FORWARDED_PROTO), ["https"]);
        assert_eq!(values(&h, &X_FORWARDED_HOST), ["admin.internal"]);
        assert_eq!(values(&h, &FORWARDED), ["for=6.6.6.6;proto=https"]);

        let mut h = HeaderMap::new();
        h.append(X_FORWARDED_FOR, HeaderValue::from_static("  "));
        rewrite(&mut h, ip("fd00::1"), &trusted(), false);
        assert_eq!(values(&h, &X_FORWARDED_FOR), ["fd00::1"]);
        assert_eq!(values(&h, &X_FORWARDED_PROTO), ["http"]);
    }

    #[test]
    fn over_tls_the_hop_is_https_unless_a_trusted_proxy_said_otherwise() {
        let mut h = claims();
        h.insert(X_FORWARDED_PROTO, HeaderValue::from_static("http"));
        rewrite(&mut h, ip("203.0.113.9"), &trusted(), true);
        assert_eq!(values(&h, &X_FORWARDED_PROTO), ["https"]);

        let mut h = HeaderMap::new();
        rewrite(&mut h, ip("10.0.0.7"), &trusted(), true);
        assert_eq!(values(&h, &X_FORWARDED_PROTO), ["https"]);

        let mut h = HeaderMap::new();
        h.insert(X_FORWARDED_PROTO, HeaderValue::from_static("http"));
        rewrite(&mut h, ip("10.0.0.7"), &trusted(), true);
        assert_eq!(
            values(&h, &X_FORWARDED_PROTO),
            ["http"],
            "the proxy saw the client"
        );
    }

    #[test]
    fn a_fresh_request_gets_only_the_family() {
        let mut client = claims();
        client.insert("cookie", HeaderValue::from_static("secret"));
        let mut out = HeaderMap::new();
        out.insert("via", HeaderValue::from_static("1.1 bloomgate"));
        copy_rewritten(&client, ip("10.0.0.5"), &trusted(), false, &mut out);
        assert_eq!(
            values(&out, &X_FORWARDED_FOR),
            ["6.6.6.6, not-an-ip, 7.7.7.7, 10.0.0.5"]
        );
        assert_eq!(values(&out, &FORWARDED), ["for=6.6.6.6;proto=https"]);
        assert!(out.get("cookie").is_none());
        assert!(out.get("via").is_some());

        let mut out = HeaderMap::new();
        copy_rewritten(&client, ip("192.0.2.1"), &trusted(), false, &mut out);
        assert_eq!(values(&out, &X_FORWARDED_FOR), ["192.0.2.1"]);
        assert_eq!(values(&out, &X_FORWARDED_PROTO), ["http"]);
        assert_eq!(out.len(), 2);
    }
}
