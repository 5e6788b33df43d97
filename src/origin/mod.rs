//! The origin stage: where a key the gate let through is finally looked up, either a
//! parameterised SQL query (the row becomes a JSON object) or the upstream API. It answers
//! Found or NotFound; it does not cache (see `cache`) and is never reached for a key the
//! gate refused.

pub mod client;
pub mod http_cache;

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::header::{
    CACHE_CONTROL, CONTENT_ENCODING, CONTENT_LANGUAGE, CONTENT_TYPE, EXPIRES, HOST, HeaderName,
    VARY, VIA,
};
use http::{HeaderMap, HeaderValue, Method, Request, StatusCode};
use http_body_util::{BodyExt, Either, Empty, Limited};

use crate::db::{Db, DbError, KeyParam};
use crate::key::{KeyBytes, OwnedKey};
use crate::origin::client::{Upstream, UpstreamError};
use crate::pipeline::route::PathPattern;

/// An error of the body stream, as `http-body-util` reports it.
type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Largest upstream body that will be cached; larger answers fail with 502.
pub const MAX_CACHED_BODY: usize = 8 * 1024 * 1024;

/// The forwarded parts of a canonical origin request, part of the cache key.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Variant {
    /// Declared query parameters, canonical (`a=1&b=2`), if any were sent.
    pub query: Option<String>,
    /// Declared request headers that were sent, in declared order.
    pub headers: Vec<(HeaderName, HeaderValue)>,
}

/// A cached answer. Cloning is cheap: the body and headers are reference counted.
#[derive(Debug, Clone)]
pub struct CachedResponse {
    /// Status to replay (a 2xx).
    pub status: StatusCode,
    /// Content type to replay, if the origin gave one.
    pub content_type: Option<HeaderValue>,
    /// The body.
    pub body: Bytes,
    /// How long this entry lives; `None`: the answer may not be stored (HTTP caching
    /// rules), and only the requests that waited for it get it.
    pub ttl: Option<Duration>,
    /// `ETag` and `Last-Modified`, replayed and used to answer conditional requests.
    pub validators: Validators,
    /// Other end-to-end headers to replay (content encoding and language, `Vary`, and
    /// `Cache-Control` of answers that are not stored).
    pub headers: Option<Arc<[(HeaderName, HeaderValue)]>>,
    /// Whether the answer may be reused for requests carrying credentials.
    pub with_credentials: bool,
}

/// The validators of a cached answer.
#[derive(Debug, Clone, Default)]
pub struct Validators {
    /// `ETag`.
    pub etag: Option<HeaderValue>,
    /// `Last-Modified`.
    pub last_modified: Option<HeaderValue>,
}

/// What the origin said about a key.
pub enum Fetched {
    /// The key exists; this is the answer to cache and return.
    Found(CachedResponse),
    /// The key does not exist (a false positive of the gate, or fail-open traffic).
    NotFound,
}

/// Why an origin call failed. None of these are cached.
#[derive(Debug, thiserror::Error)]
pub enum OriginError {
    /// The lookup took longer than the route's timeout.
    #[error("origin did not answer within {0:?}")]
    Timeout(Duration),
    /// The database could not be reached or no connection was free in time.
    #[error("database unavailable: {0}")]
    DbUnavailable(#[source] DbError),
    /// The lookup query failed.
    #[error("lookup query failed: {0}")]
    Db(#[source] DbError),
    /// The upstream could not be reached or did not answer in time.
    #[error(transparent)]
    Upstream(#[from] UpstreamError),
    /// The upstream answered with a status that is neither 2xx nor "not found".
    #[error("upstream answered {0}")]
    UpstreamStatus(StatusCode),
    /// Reading the upstream body failed or it was too large to cache.
    #[error("upstream body: {0}")]
    UpstreamBody(#[source] BoxError),
    /// The upstream's `host:port` is not a valid `Host` header value.
    #[error("the upstream authority is not a valid Host header: {0}")]
    UpstreamHost(#[source] http::header::InvalidHeaderValue),
    /// The row could not be encoded as JSON.
    #[error("cannot encode the row: {0}")]
    Encode(#[from] serde_json::Error),
}

/// A route's origin.
pub enum Origin {
    /// `SELECT … WHERE key = ?` through the sqlx pool.
    Sql {
        /// The pool.
        db: Db,
        /// The lookup query, with one `?` for the key.
        query: Arc<str>,
        /// Limit on the whole lookup, pool wait included.
        timeout: Duration,
        /// Positive TTL for what it finds.
        ttl: Duration,
    },
    /// A GET to the upstream API: the canonical request for the key, built from the
    /// route's pattern, never from the client's own path and query.
    Upstream(UpstreamOrigin),
}

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
    /// Request headers the route forwards (their values come in the [`Variant`]).
    pub forward_headers: Vec<HeaderName>,
    /// Headers set on every request, e.g. an API key.
    pub headers: Vec<(HeaderName, HeaderValue)>,
}

impl Origin {
    /// Looks `key` up; `variant` is what an upstream origin forwards besides the key.
    pub async fn fetch(
        &self,
        key: &OwnedKey,
        variant: Option<&Variant>,
    ) -> Result<Fetched, OriginError> {
        match self {
            Origin::Sql {
                db,
                query,
                timeout,
                ttl,
            } => {
                let param = match key {
                    OwnedKey::Int(n) => KeyParam::Int(*n),
                    OwnedKey::Text(s) => KeyParam::Text(s),
                };
                let row = tokio::time::timeout(*timeout, db.lookup(query, param))
                    .await
                    .map_err(|_| OriginError::Timeout(*timeout))?
                    .map_err(|e| {
                        if e.is_unavailable() {
                            OriginError::DbUnavailable(e)
                        } else {
                            OriginError::Db(e)
                        }
                    })?;
                match row {
                    None => Ok(Fetched::NotFound),
                    Some(map) => Ok(Fetched::Found(CachedResponse {
                        status: StatusCode::OK,
                        content_type: Some(HeaderValue::from_static("application/json")),
                        body: Bytes::from(serde_json::to_vec(&map)?),
                        ttl: Some(*ttl),
                        validators: Validators::default(),
                        headers: None,
                        with_credentials: false,
                    })),
                }
            }
            Origin::Upstream(origin) => origin.fetch(key, variant).await,
        }
    }

    /// The headers this origin forwards from client requests (empty for SQL).
    pub fn forward_headers(&self) -> &[HeaderName] {
        match self {
            Origin::Sql { .. } => &[],
            Origin::Upstream(u) => &u.forward_headers,
        }
    }
}

impl UpstreamOrigin {
    /// The canonical GET for `key`: the route's target, the forwarded parameters and
    /// headers of `variant`, the configured headers, and nothing else the client sent.
    async fn fetch(
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
        let storage = http_cache::storage(resp.headers(), self.ttl, &self.forward_headers);
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
            status,
            content_type,
            body,
            ttl: storage.ttl,
            validators: Validators {
                etag,
                last_modified,
            },
            headers: replayed,
            with_credentials: storage.with_credentials,
        }))
    }
}

/// End-to-end headers of an upstream answer that are replayed with it. The freshness
/// headers of a stored answer are not: they described the answer when it was fetched,
/// and a client would take them as fresh from the moment of replay.
fn replayed_headers(headers: &HeaderMap, stored: bool) -> Option<Arc<[(HeaderName, HeaderValue)]>> {
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
    (!kept.is_empty()).then(|| Arc::from(kept))
}
