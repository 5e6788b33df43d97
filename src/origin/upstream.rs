//! The upstream origin: the canonical GET for a key to the upstream API, built from the
//! route's pattern; HTTP caching rules decide how long its answer may be kept.

use std::sync::Arc;
use std::time::Duration;

use http::header::{
    CACHE_CONTROL, CONTENT_ENCODING, CONTENT_LANGUAGE, CONTENT_TYPE, EXPIRES, HOST, HeaderName,
    VARY, VIA,
};
use http::{HeaderMap, HeaderValue, Method, Request, StatusCode};
use http_body_util::{BodyExt, Either, Empty, Limited};

use super::client::{Upstream, UpstreamError};
use super::guard::OriginGuard;
use super::http_cache;
use super::{
    CachedResponse, Fetched, MAX_CACHED_BODY, OriginError, ResponseMeta, Stamp, Validators, Variant,
};
use bloomgate_core::config::StaleWindows;
use bloomgate_core::key::{KeyBytes, OwnedKey};
use bloomgate_core::pattern::route::PathPattern;

/// An upstream origin of one route.
pub struct UpstreamOrigin {
    /// The shared client.
    pub upstream: Arc<Upstream>,
    /// The route's pattern, which builds the canonical target for a key.
    pub pattern: PathPattern,
    /// Statuses meaning "no such key".
    pub not_found: Vec<StatusCode>,
    /// Positive TTL for what it finds (HTTP caching rules may shorten it).
    pub ttl: Duration,
    /// How long past the TTL what it finds may be served (the answer's own
    /// `Cache-Control` may change it).
    pub stale: StaleWindows,
    /// Request headers the route forwards (their values come in the [`Variant`]).
    pub forward_headers: Vec<HeaderName>,
    /// Headers set on every request, e.g. an API key.
    pub headers: Vec<(HeaderName, HeaderValue)>,
    /// The upstream's breaker and concurrency bound, shared by its routes.
    pub guard: Arc<OriginGuard>,
}

impl UpstreamOrigin {
    /// The canonical GET for `key`: the route's target, the forwarded parameters and
    /// headers of `variant`, the configured headers, and nothing else the client sent.
    pub(super) async fn fetch(
        &self,
        key: &OwnedKey,
        variant: Option<&Variant>,
    ) -> Result<Fetched, OriginError> {
        let mut bytes = KeyBytes::new();
        let norm = key.as_norm();
        let target = self
            .pattern
            .upstream_target(bytes.of(&norm), variant.and_then(|v| v.query.as_deref()));
        let authority = HeaderValue::from_str(self.upstream.authority().as_str())
            .map_err(OriginError::UpstreamHost)?;
        let mut req = Request::builder()
            .method(Method::GET)
            .uri(self.upstream.uri_for_target(&target)?)
            .header(HOST, authority)
            .header(VIA, HeaderValue::from_static("1.1 bloomgate"))
            .body(Either::Left(Empty::new()))
            .map_err(UpstreamError::from)?;
        let headers = req.headers_mut();
        for (name, value) in variant.iter().flat_map(|v| &v.headers) {
            headers.append(name.clone(), value.clone());
        }
        for (name, value) in &self.headers {
            headers.insert(name.clone(), value.clone());
        }
        let resp = self.upstream.send(req).await?;
        let status = resp.status();
        if self.not_found.contains(&status) {
            return Ok(Fetched::NotFound);
        }
        if !status.is_success() {
            return Err(OriginError::UpstreamStatus(status));
        }
        let storage =
            http_cache::storage(resp.headers(), self.ttl, self.stale, &self.forward_headers);
        let (etag, last_modified) = http_cache::validators(resp.headers());
        let content_type = resp.headers().get(CONTENT_TYPE).cloned();
        let replayed = replayed_headers(resp.headers(), storage.ttl.is_some());
        let body = tokio::time::timeout(
            self.upstream.timeout(),
            Limited::new(resp.into_body(), MAX_CACHED_BODY).collect(),
        )
        .await
        .map_err(|_| OriginError::Timeout(self.upstream.timeout()))?
        .map_err(OriginError::UpstreamBody)?
        .to_bytes();
        Ok(Fetched::Found(CachedResponse {
            body,
            stored_at: Stamp::now(),
            meta: Arc::new(ResponseMeta {
                ttl: storage.ttl,
                content_type,
                validators: Validators {
                    etag,
                    last_modified,
                },
                headers: replayed,
                stale: storage.stale,
                shared: false,
            }),
            status,
            with_credentials: storage.with_credentials,
        }))
    }
}

/// End-to-end headers of an upstream answer that are replayed with it. The freshness
/// headers of a stored answer are not: they described the answer when it was fetched,
/// and a client would take them as fresh from the moment of replay.
fn replayed_headers(headers: &HeaderMap, stored: bool) -> Box<[(HeaderName, HeaderValue)]> {
    let mut names = vec![CONTENT_ENCODING, CONTENT_LANGUAGE, VARY];
    if !stored {
        names.extend([CACHE_CONTROL, EXPIRES]);
    }
    let kept: Vec<(HeaderName, HeaderValue)> = names
        .into_iter()
        .flat_map(|name| {
            headers
                .get_all(&name)
                .iter()
                .map(move |v| (name.clone(), v.clone()))
                .collect::<Vec<_>>()
        })
        .collect();
    kept.into_boxed_slice()
}
