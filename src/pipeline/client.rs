//! Who the client is: the address a request came from, taken from the socket peer or,
//! when the peer is a proxy the operator trusts, from the `X-Forwarded-For` chain that
//! proxy reports. Used for the forwarded headers, the outcome-header policy and the
//! false-positive budget. It does not decide what to do with the address.

use std::net::IpAddr;

use http::HeaderMap;
use http::header::HeaderName;

use bloomgate_core::pattern::cidrs::{Cidrs, canonical_ip};

/// The `X-Forwarded-For` header name.
pub const X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");

/// The client's address for a request that arrived from `peer`.
///
/// When `peer` is not a trusted proxy, it is the client and whatever the request claims
/// is ignored. When it is, the `X-Forwarded-For` chain is walked from the right (the
/// entries the trusted proxies appended) and the first address that is not itself a
/// trusted proxy is the client. An entry that is not an address ends the walk: the
/// last trusted hop is then taken as the client, never a value the client wrote.
pub fn client_ip(peer: IpAddr, headers: &HeaderMap, trusted: &Cidrs) -> IpAddr {
    let peer = canonical_ip(peer);
    if trusted.is_empty() || !trusted.contains(peer) {
        return peer;
    }
    let mut client = peer;
    // Several X-Forwarded-For lines form one list, in order (RFC 9110 §5.3).
    let lines: Vec<&str> = headers
        .get_all(&X_FORWARDED_FOR)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .collect();
    for entry in lines.iter().rev().flat_map(|l| l.rsplit(',')) {
        let Some(ip) = parse_forwarded_ip(entry) else {
            return client;
        };
        client = ip;
        if !trusted.contains(ip) {
            return ip;
        }
    }
    client
}

/// One `X-Forwarded-For` entry: an address, optionally with a port (`1.2.3.4:5`,
/// `[::1]:5`).
fn parse_forwarded_ip(entry: &str) -> Option<IpAddr> {
    let s = entry.trim();
    if let Ok(ip) = s.parse::<IpAddr>() {
        return Some(canonical_ip(ip));
    }
    if let Some(rest) = s.strip_prefix('[') {
        let (inner, _) = rest.split_once(']')?;
        return inner.parse::<IpAddr>().ok().map(canonical_ip);
    }
    let (host, port) = s.rsplit_once(':')?;
    port.parse::<u16>().ok()?;
    host.parse::<std::net::Ipv4Addr>().ok().map(IpAddr::V4)
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    fn ip(s: &str) -> IpAddr {
        s.parse().expect("address")
    }

    fn xff(values: &[&str]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for v in values {
            h.append(X_FORWARDED_FOR, HeaderValue::from_str(v).expect("value"));
        }
        h
    }

    #[test]
    fn ranges_parse_and_match() {
        let c = Cidrs::parse(&["10.0.0.0/8", "192.168.1.7", "fd00::/8"]).expect("valid");
        assert!(c.contains(ip("10.1.2.3")));
        assert!(c.contains(ip("192.168.1.7")));
        assert!(!c.contains(ip("192.168.1.8")));
        assert!(c.contains(ip("fd12::1")));
        assert!(c.contains(ip("::ffff:10.9.9.9")));
        assert!(Cidrs::parse(&["10.0.0.0/33"]).is_err());
        assert!(Cidrs::parse(&["proxy.internal"]).is_err());
    }

    #[test]
    fn an_untrusted_peer_is_the_client_whatever_it_claims() {
        let trusted = Cidrs::parse(&["10.0.0.0/8"]).expect("valid");
        let h = xff(&["1.1.1.1"]);
        assert_eq!(
            client_ip(ip("203.0.113.9"), &h, &trusted),
            ip("203.0.113.9")
        );
        assert_eq!(
            client_ip(ip("203.0.113.9"), &h, &Cidrs::default()),
            ip("203.0.113.9")
        );
    }

    #[test]
    fn a_trusted_chain_is_walked_from_the_right() {
        let trusted = Cidrs::parse(&["10.0.0.0/8"]).expect("valid");
        // The client forged 6.6.6.6; the load balancer appended the real address.
        let h = xff(&["6.6.6.6, 198.51.100.4", "10.0.0.2"]);
        assert_eq!(client_ip(ip("10.0.0.1"), &h, &trusted), ip("198.51.100.4"));
        // Garbage in the chain stops the walk at the last trusted hop.
        let h = xff(&["198.51.100.4, not-an-ip"]);
        assert_eq!(client_ip(ip("10.0.0.1"), &h, &trusted), ip("10.0.0.1"));
        // Only trusted hops: the leftmost of them.
        let h = xff(&["10.0.0.3"]);
        assert_eq!(client_ip(ip("10.0.0.1"), &h, &trusted), ip("10.0.0.3"));
        // Ports are tolerated.
        let h = xff(&["198.51.100.4:5555"]);
        assert_eq!(client_ip(ip("10.0.0.1"), &h, &trusted), ip("198.51.100.4"));
    }
}
