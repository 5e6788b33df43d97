//! The origin stage: where a key the gate let through is finally looked up, either a
//! parameterised SQL query (the row becomes a JSON object) or the upstream API. It answers
//! Found or NotFound; it does not cache (see `cache`) and is never reached for a key the
//! gate refused.

use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::header::{CONTENT_TYPE, HOST, VIA};
use http::uri::PathAndQuery;
use http::{HeaderMap, HeaderValue, Method, Request, StatusCode};
use http_body_util::{BodyExt, Either, Empty, Limited};

use crate::cache::CachedResponse;
use crate::client::Cidrs;
use crate::db::{Db, DbError, KeyParam};
use crate::forwarded;
use crate::key::OwnedKey;
use crate::upstream::{Upstream, UpstreamError};

/// Largest upstream body that will be cached; larger answers fail with 502.
pub const MAX_CACHED_BODY: usize = 8 * 1024 * 1024;

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
    UpstreamBody(String),
    /// The row could not be encoded as JSON.
    #[error("cannot encode the row: {0}")]
    Encode(#[from] serde_json::Error),
}

/// The client whose request led to an origin call, as forwarded headers describe it.
/// With coalesced misses, it is the request that made the call.
#[derive(Clone, Copy)]
pub struct Client<'a> {
    /// The socket peer.
    pub peer: IpAddr,
    /// The client's request headers (only the forwarded family is read).
    pub headers: &'a HeaderMap,
    /// Proxies whose forwarded headers are believed.
    pub trusted: &'a Cidrs,
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
    /// A GET to the upstream API with the request's own path and query.
    Upstream {
        /// The shared client.
        upstream: Arc<Upstream>,
        /// Statuses meaning "no such key".
        not_found: Vec<StatusCode>,
        /// Positive TTL for what it finds.
        ttl: Duration,
    },
}

impl Origin {
    /// Looks `key` up. `path_and_query` is the client's, for upstream origins, and
    /// `client` gives their forwarded headers (none without it).
    pub async fn fetch(
        &self,
        key: &OwnedKey,
        path_and_query: Option<&PathAndQuery>,
        client: Option<Client<'_>>,
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
                        ttl: *ttl,
                    })),
                }
            }
            Origin::Upstream {
                upstream,
                not_found,
                ttl,
            } => fetch_upstream(upstream, not_found, *ttl, path_and_query, client).await,
        }
    }
}

async fn fetch_upstream(
    upstream: &Upstream,
    not_found: &[StatusCode],
    ttl: Duration,
    path_and_query: Option<&PathAndQuery>,
    client: Option<Client<'_>>,
) -> Result<Fetched, OriginError> {
    let authority = HeaderValue::from_str(upstream.authority().as_str())
        .map_err(|e| OriginError::UpstreamBody(e.to_string()))?;
    let mut req = Request::builder()
        .method(Method::GET)
        .uri(upstream.uri_for(path_and_query)?)
        .header(HOST, authority)
        .header(VIA, HeaderValue::from_static("1.1 bloomgate"))
        .body(Either::Left(Empty::new()))
        .map_err(UpstreamError::from)?;
    if let Some(c) = client {
        forwarded::copy_rewritten(c.headers, c.peer, c.trusted, req.headers_mut());
    }
    let resp = upstream.send(req).await?;
    let status = resp.status();
    if not_found.contains(&status) {
        return Ok(Fetched::NotFound);
    }
    if !status.is_success() {
        return Err(OriginError::UpstreamStatus(status));
    }
    let content_type = resp.headers().get(CONTENT_TYPE).cloned();
    let body = tokio::time::timeout(
        upstream.timeout(),
        Limited::new(resp.into_body(), MAX_CACHED_BODY).collect(),
    )
    .await
    .map_err(|_| OriginError::Timeout(upstream.timeout()))?
    .map_err(|e| OriginError::UpstreamBody(e.to_string()))?
    .to_bytes();
    Ok(Fetched::Found(CachedResponse {
        status,
        content_type,
        body,
        ttl,
    }))
}
