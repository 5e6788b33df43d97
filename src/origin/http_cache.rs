//! HTTP caching rules for upstream answers (RFC 9111, the parts a shared cache must
//! honour): whether an answer may be stored and for how long (`Cache-Control`, `Vary`),
//! whether it may be reused for a request that carries credentials (§3.5), and
//! conditional requests answered from a stored entry (`If-None-Match`,
//! `If-Modified-Since` → 304). It reads headers and decides; it stores nothing.

use std::time::{Duration, SystemTime};

use http::header::{
    AUTHORIZATION, CACHE_CONTROL, ETAG, HeaderName, IF_MODIFIED_SINCE, IF_NONE_MATCH,
    LAST_MODIFIED, VARY,
};
use http::{HeaderMap, HeaderValue};

use bloomgate_core::config::StaleWindows;

/// What a shared cache may do with one upstream answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Storage {
    /// How long the answer may be reused; `None`: not stored at all.
    pub ttl: Option<Duration>,
    /// Whether the stored answer may also be reused for requests carrying
    /// `Authorization` (`public`, `s-maxage` or `must-revalidate`).
    pub with_credentials: bool,
    /// How long past its lifetime the answer may be served (see [`stale_windows`]).
    pub stale: StaleWindows,
}

/// How long past its lifetime an answer may be served, given the route's `windows`:
/// the answer's own `stale-if-error` and `stale-while-revalidate` (RFC 5861) replace the
/// route's; `must-revalidate`, `proxy-revalidate` and `s-maxage` forbid serving it stale
/// (RFC 9111 §4.2.4) unless it carries `stale-if-error` itself, which then applies to
/// errors only. (`no-cache` answers are not stored at all.)
fn stale_windows(
    windows: StaleWindows,
    if_error: Option<Duration>,
    while_revalidate: Option<Duration>,
    revalidate: bool,
) -> StaleWindows {
    if revalidate {
        return StaleWindows {
            if_error: if_error.unwrap_or(Duration::ZERO),
            while_revalidate: Duration::ZERO,
        };
    }
    StaleWindows {
        if_error: if_error.unwrap_or(windows.if_error),
        while_revalidate: while_revalidate.unwrap_or(windows.while_revalidate),
    }
}

/// Decides whether an upstream answer may be stored, and for how long: at most
/// `route_ttl`, less when `s-maxage` (or else `max-age`) says so. `no-store`, `private`,
/// `no-cache`, a zero lifetime, `Vary: *` and a `Vary` naming a request header that the
/// route does not forward (`forwarded`, lower-case) make it unstorable.
pub fn storage(
    headers: &HeaderMap,
    route_ttl: Duration,
    route_stale: StaleWindows,
    forwarded: &[HeaderName],
) -> Storage {
    let mut ttl = Some(route_ttl);
    let mut max_age = None;
    let mut s_maxage = None;
    let mut with_credentials = false;
    let mut revalidate = false;
    let mut if_error = None;
    let mut while_revalidate = None;
    for value in headers.get_all(CACHE_CONTROL) {
        let Ok(text) = value.to_str() else {
            // A directive we cannot read could be `no-store`: do not store.
            ttl = None;
            continue;
        };
        for directive in text.split(',') {
            let (name, arg) = match directive.split_once('=') {
                Some((n, a)) => (n.trim(), Some(a.trim().trim_matches('"'))),
                None => (directive.trim(), None),
            };
            let seconds = || arg.and_then(|a| a.parse::<u64>().ok());
            match name.to_ascii_lowercase().as_str() {
                "no-store" | "private" | "no-cache" => ttl = None,
                "max-age" => match seconds() {
                    Some(s) => max_age = Some(s),
                    None => ttl = None,
                },
                "s-maxage" => {
                    with_credentials = true;
                    revalidate = true;
                    match seconds() {
                        Some(s) => s_maxage = Some(s),
                        None => ttl = None,
                    }
                }
                "must-revalidate" => {
                    with_credentials = true;
                    revalidate = true;
                }
                "proxy-revalidate" => revalidate = true,
                "public" => with_credentials = true,
                // A window that cannot be read is no window: never serve it stale.
                "stale-if-error" => if_error = Some(Duration::from_secs(seconds().unwrap_or(0))),
                "stale-while-revalidate" => {
                    while_revalidate = Some(Duration::from_secs(seconds().unwrap_or(0)))
                }
                _ => {}
            }
        }
    }
    if let Some(lifetime) = s_maxage.or(max_age) {
        ttl = ttl.map(|t| t.min(Duration::from_secs(lifetime)));
    }
    if ttl.is_some_and(|t| t.is_zero()) || !vary_is_covered(headers, forwarded) {
        ttl = None;
    }
    Storage {
        ttl,
        with_credentials,
        stale: stale_windows(route_stale, if_error, while_revalidate, revalidate),
    }
}

/// Whether every header named in `Vary` is one the route forwards (and so part of the
/// cache key). `Vary: *` never is.
fn vary_is_covered(headers: &HeaderMap, forwarded: &[HeaderName]) -> bool {
    headers.get_all(VARY).iter().all(|value| {
        let Ok(text) = value.to_str() else {
            return false;
        };
        text.split(',')
            .map(str::trim)
            .filter(|n| !n.is_empty())
            .all(|n| n != "*" && forwarded.iter().any(|f| f.as_str().eq_ignore_ascii_case(n)))
    })
}

/// Whether the request carries credentials, so that a stored answer may be reused for
/// it only if the answer allows that.
pub fn has_credentials(request: &HeaderMap) -> bool {
    request.contains_key(AUTHORIZATION)
}

/// Whether a stored answer with these validators satisfies the request's conditions,
/// so that 304 Not Modified can be sent instead of the body (RFC 9110 §13.2.2:
/// `If-None-Match` decides when present, else `If-Modified-Since`).
pub fn not_modified(
    request: &HeaderMap,
    etag: Option<&HeaderValue>,
    last_modified: Option<&HeaderValue>,
) -> bool {
    if request.contains_key(IF_NONE_MATCH) {
        let Some(etag) = etag.and_then(|e| e.to_str().ok()) else {
            return false;
        };
        return request
            .get_all(IF_NONE_MATCH)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .map(str::trim)
            .any(|tag| tag == "*" || weak_eq(tag, etag));
    }
    let (Some(since), Some(modified)) = (
        request.get(IF_MODIFIED_SINCE).and_then(http_date),
        last_modified.and_then(http_date),
    ) else {
        return false;
    };
    modified <= since
}

/// The validators of an answer, kept with its entry.
pub fn validators(headers: &HeaderMap) -> (Option<HeaderValue>, Option<HeaderValue>) {
    (
        headers.get(ETAG).cloned(),
        headers.get(LAST_MODIFIED).cloned(),
    )
}

/// Weak comparison of two entity tags (RFC 9110 §8.8.3.2): equal opaque tags, whether
/// or not either is marked `W/`.
fn weak_eq(a: &str, b: &str) -> bool {
    let opaque = |t: &str| t.strip_prefix("W/").unwrap_or(t).to_owned();
    let (a, b) = (opaque(a), opaque(b));
    a.len() >= 2 && a.starts_with('"') && a.ends_with('"') && a == b
}

fn http_date(v: &HeaderValue) -> Option<SystemTime> {
    httpdate::parse_http_date(v.to_str().ok()?).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(
                HeaderName::from_bytes(k.as_bytes()).expect("name"),
                HeaderValue::from_str(v).expect("value"),
            );
        }
        h
    }

    const FIVE_MIN: Duration = Duration::from_secs(300);

    #[test]
    fn storage_follows_cache_control() {
        let s = |cc: &str| {
            storage(
                &headers(&[("cache-control", cc)]),
                FIVE_MIN,
                StaleWindows::default(),
                &[],
            )
            .ttl
        };
        assert_eq!(
            storage(&HeaderMap::new(), FIVE_MIN, StaleWindows::default(), &[]).ttl,
            Some(FIVE_MIN)
        );
        assert_eq!(s("no-store"), None);
        assert_eq!(s("private, max-age=60"), None);
        assert_eq!(s("Private"), None);
        assert_eq!(s("no-cache"), None);
        assert_eq!(s("max-age=60"), Some(Duration::from_secs(60)));
        assert_eq!(s("max-age=3600"), Some(FIVE_MIN));
        assert_eq!(s("max-age=60, s-maxage=10"), Some(Duration::from_secs(10)));
        assert_eq!(s("s-maxage=\"20\""), Some(Duration::from_secs(20)));
        assert_eq!(s("max-age=0"), None);
        assert_eq!(s("max-age=soon"), None);
        assert_eq!(s("public, max-age=30"), Some(Duration::from_secs(30)));
    }

    #[test]
    fn vary_must_name_forwarded_headers_only() {
        let lang = [HeaderName::from_static("accept-language")];
        let v = |vary: &str, fwd: &[HeaderName]| {
            storage(
                &headers(&[("vary", vary)]),
                FIVE_MIN,
                StaleWindows::default(),
                fwd,
            )
            .ttl
        };
        assert_eq!(v("*", &lang), None);
        assert_eq!(v("Accept-Encoding", &lang), None);
        assert_eq!(v("Accept-Language", &lang), Some(FIVE_MIN));
        assert_eq!(v("accept-language, cookie", &lang), None);
        assert_eq!(v("accept-language", &[]), None);
    }

    #[test]
    fn credentials_need_an_explicit_permission() {
        let c = |cc: &str| {
            storage(
                &headers(&[("cache-control", cc)]),
                FIVE_MIN,
                StaleWindows::default(),
                &[],
            )
            .with_credentials
        };
        assert!(!c("max-age=60"));
        assert!(c("public, max-age=60"));
        assert!(c("s-maxage=60"));
        assert!(c("must-revalidate"));
    }

    #[test]
    fn conditions_are_evaluated_like_an_origin_would() {
        let etag = HeaderValue::from_static("\"v1\"");
        let lm = HeaderValue::from_static("Wed, 02 Dec 2026 10:00:00 GMT");
        let nm = |req: &[(&str, &str)]| not_modified(&headers(req), Some(&etag), Some(&lm));
        assert!(nm(&[("if-none-match", "\"v1\"")]));
        assert!(nm(&[("if-none-match", "W/\"v1\"")]));
        assert!(nm(&[("if-none-match", "\"v0\", \"v1\"")]));
        assert!(nm(&[("if-none-match", "*")]));
        assert!(!nm(&[("if-none-match", "\"v2\"")]));
        // If-None-Match decides even when If-Modified-Since would say "not modified".
        assert!(!nm(&[
            ("if-none-match", "\"v2\""),
            ("if-modified-since", "Thu, 03 Dec 2026 10:00:00 GMT")
        ]));
        assert!(nm(&[(
            "if-modified-since",
            "Wed, 02 Dec 2026 10:00:00 GMT"
        )]));
        assert!(!nm(&[(
            "if-modified-since",
            "Tue, 01 Dec 2026 10:00:00 GMT"
        )]));
        assert!(!nm(&[("if-modified-since", "yesterday")]));
        assert!(!nm(&[]));
        assert!(!not_modified(
            &headers(&[("if-none-match", "\"v1\"")]),
            None,
            None
        ));
    }

    #[test]
    fn stale_windows_follow_the_answer_and_rfc_9111() {
        let route = StaleWindows {
            if_error: Duration::from_secs(3600),
            while_revalidate: Duration::from_secs(60),
        };
        let w = |cc: &str| storage(&headers(&[("cache-control", cc)]), FIVE_MIN, route, &[]).stale;
        let secs = |e: u64, r: u64| StaleWindows {
            if_error: Duration::from_secs(e),
            while_revalidate: Duration::from_secs(r),
        };
        assert_eq!(w("max-age=60"), route);
        assert_eq!(w("max-age=60, stale-if-error=10"), secs(10, 60));
        assert_eq!(w("max-age=60, stale-while-revalidate=5"), secs(3600, 5));
        assert_eq!(w("max-age=60, stale-if-error=0"), secs(0, 60));
        // Unreadable: no window rather than the route's.
        assert_eq!(w("max-age=60, stale-if-error=soon"), secs(0, 60));
        for forbids in [
            "must-revalidate",
            "proxy-revalidate",
            "s-maxage=60",
            "MUST-REVALIDATE",
        ] {
            assert_eq!(
                w(&format!("max-age=60, {forbids}")),
                secs(0, 0),
                "{forbids}"
            );
            assert_eq!(
                w(&format!(
                    "{forbids}, stale-if-error=30, stale-while-revalidate=30"
                )),
                secs(30, 0),
                "{forbids}"
            );
        }
    }
}
