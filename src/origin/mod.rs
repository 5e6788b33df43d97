//! The origin stage: where a key the gate let through is finally looked up, either a
//! parameterised SQL query (the row becomes a JSON object) or the upstream API. It answers
//! Found or NotFound; it does not cache (see `cache`) and is never reached for a key the
//! gate refused.

pub mod breaker;
pub mod client;
pub mod guard;
pub mod http_cache;
pub mod metrics;
mod sql;
mod upstream;

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::header::HeaderName;
use http::{HeaderValue, StatusCode};

pub use sql::SqlOrigin;
pub use upstream::UpstreamOrigin;

use crate::origin::client::UpstreamError;
use bloomgate_core::config::StaleWindows;
use bloomgate_core::db::DbError;
use bloomgate_core::key::OwnedKey;

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

/// A cached answer. Cloning is cheap: the body and the rest are reference counted.
///
/// Kept small, since the cache holds one per entry: what answers of one shape share (an
/// SQL route's content type and stale windows) sits behind one [`ResponseMeta`] for all
/// of them.
#[derive(Debug, Clone)]
pub struct CachedResponse {
    /// The body.
    pub body: Bytes,
    /// When the origin gave this answer: its age is counted from here.
    pub stored_at: Stamp,
    /// Its lifetime, headers and stale windows.
    pub meta: Arc<ResponseMeta>,
    /// Status to replay (a 2xx).
    pub status: StatusCode,
    /// Whether the answer may be reused for requests carrying credentials.
    pub with_credentials: bool,
}

/// What an answer carries besides its body, status and lifetime.
#[derive(Debug, Clone, Default)]
pub struct ResponseMeta {
    /// How long the answer lives; `None`: it may not be stored (HTTP caching rules),
    /// and only the requests that waited for it get it.
    pub ttl: Option<Duration>,
    /// Content type to replay, if the origin gave one.
    pub content_type: Option<HeaderValue>,
    /// `ETag` and `Last-Modified`, replayed and used to answer conditional requests.
    pub validators: Validators,
    /// Other end-to-end headers to replay (content encoding and language, `Vary`, and
    /// `Cache-Control` of answers that are not stored).
    pub headers: Box<[(HeaderName, HeaderValue)]>,
    /// How long past `ttl` it may still be served.
    pub stale: StaleWindows,
    /// Shared by every answer of a route (counted once, not per entry, in
    /// [`CachedResponse::own_bytes`]).
    pub shared: bool,
}

impl ResponseMeta {
    /// What every answer of an SQL route carries: a JSON body, the route's TTL and
    /// windows.
    pub fn json_rows(ttl: Duration, stale: StaleWindows) -> Arc<ResponseMeta> {
        Arc::new(ResponseMeta {
            ttl: Some(ttl),
            content_type: Some(HeaderValue::from_static("application/json")),
            validators: Validators::default(),
            headers: Box::new([]),
            stale,
            shared: true,
        })
    }

    /// Heap bytes of one entry's own meta: the struct, and the header bytes it holds.
    fn own_bytes(&self) -> usize {
        let value = |v: &HeaderValue| v.len();
        std::mem::size_of::<ResponseMeta>()
            + self.content_type.as_ref().map_or(0, value)
            + self.validators.etag.as_ref().map_or(0, value)
            + self.validators.last_modified.as_ref().map_or(0, value)
            + self
                .headers
                .iter()
                .map(|(n, v)| n.as_str().len() + v.len() + HEADER_OVERHEAD)
                .sum::<usize>()
    }
}

/// Bytes of a stored header pair beyond its name and value (two `Bytes` handles), as
/// the cache's byte bound counts it.
pub const HEADER_OVERHEAD: usize = 80;

impl CachedResponse {
    /// How long past its TTL the entry is at `now`: `None` while it is fresh.
    pub fn staleness(&self, now: Instant) -> Option<Duration> {
        let age = self.stored_at.age(now);
        let ttl = self.meta.ttl.unwrap_or(Duration::ZERO);
        (age >= ttl).then(|| age - ttl)
    }

    /// Its age in whole seconds at `now`, for the `Age` header.
    pub fn age_secs(&self, now: Instant) -> u64 {
        self.stored_at.age(now).as_secs()
    }

    /// Whether it may be stored at all.
    pub fn storable(&self) -> bool {
        self.meta.ttl.is_some()
    }

    /// The bytes this answer holds that are its own: the body, and its meta unless
    /// that is shared by its route. (The cache adds its own per-entry overhead.)
    pub fn own_bytes(&self) -> usize {
        let meta = if self.meta.shared {
            0
        } else {
            self.meta.own_bytes()
        };
        self.body.len() + meta
    }
}

/// A moment, in 8 bytes instead of an `Instant`'s 16: nanoseconds since the first
/// stamp this process made (good for 584 years).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Stamp(u64);

/// The moment stamps count from.
static EPOCH: std::sync::LazyLock<Instant> = std::sync::LazyLock::new(Instant::now);

impl Stamp {
    /// Now.
    pub fn now() -> Stamp {
        Stamp::at(Instant::now())
    }

    /// `at`, which must not be before the first stamp (it saturates to it).
    pub fn at(at: Instant) -> Stamp {
        let since = at.saturating_duration_since(*EPOCH).as_nanos();
        Stamp(u64::try_from(since).unwrap_or(u64::MAX))
    }

    /// How long before `now` this was (zero if it is later).
    pub fn age(self, now: Instant) -> Duration {
        Stamp::at(now)
            .0
            .checked_sub(self.0)
            .map_or(Duration::ZERO, Duration::from_nanos)
    }
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
// Made once per origin call and moved into the cache: boxing the answer would cost an
// allocation to save a copy.
#[allow(clippy::large_enum_variant)]
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
    #[error("database unavailable")]
    DbUnavailable(#[source] DbError),
    /// The lookup query failed.
    #[error("lookup query failed")]
    Db(#[source] DbError),
    /// The upstream could not be reached or did not answer in time.
    #[error(transparent)]
    Upstream(#[from] UpstreamError),
    /// The upstream answered with a status that is neither 2xx nor "not found".
    #[error("upstream answered {0}")]
    UpstreamStatus(StatusCode),
    /// Reading the upstream body failed or it was too large to cache.
    #[error("upstream body")]
    UpstreamBody(#[source] BoxError),
    /// The upstream's `host:port` is not a valid `Host` header value.
    #[error("the upstream authority is not a valid Host header")]
    UpstreamHost(#[source] http::header::InvalidHeaderValue),
    /// The row could not be encoded as JSON.
    #[error("cannot encode the row")]
    Encode(#[from] serde_json::Error),
    /// The call was not made: the origin's breaker is open, or no slot came free.
    #[error("{origin} not called: {}", refusal.as_str())]
    Refused {
        /// The origin's name.
        origin: &'static str,
        /// Why.
        refusal: guard::Refusal,
    },
}

impl OriginError {
    /// Whether this failure says the origin is unavailable (what the breaker counts): a
    /// timeout, a database or upstream that cannot be reached, an upstream 5xx. A wrong
    /// query or an answer that cannot be used says nothing about availability.
    pub fn is_outage(&self) -> bool {
        match self {
            OriginError::Timeout(_) | OriginError::DbUnavailable(_) => true,
            OriginError::Upstream(e) => !matches!(e, UpstreamError::Uri(_)),
            OriginError::UpstreamStatus(s) => s.is_server_error(),
            OriginError::Db(_)
            | OriginError::UpstreamBody(_)
            | OriginError::UpstreamHost(_)
            | OriginError::Encode(_)
            | OriginError::Refused { .. } => false,
        }
    }
}

/// A route's origin: one kind per file of this module.
pub enum Origin {
    /// `SELECT … WHERE key = ?` through the sqlx pool.
    Sql(SqlOrigin),
    /// A GET to the upstream API: the canonical request for the key, built from the
    /// route's pattern, never from the client's own path and query.
    Upstream(UpstreamOrigin),
}

impl Origin {
    /// Looks `key` up; `variant` is what an upstream origin forwards besides the key.
    pub async fn fetch(
        &self,
        key: &OwnedKey,
        variant: Option<&Variant>,
    ) -> Result<Fetched, OriginError> {
        match self {
            Origin::Sql(origin) => origin.guard.call(origin.fetch(key)).await,
            Origin::Upstream(origin) => origin.guard.call(origin.fetch(key, variant)).await,
        }
    }

    /// The headers this origin forwards from client requests (empty for SQL).
    pub fn forward_headers(&self) -> &[HeaderName] {
        match self {
            Origin::Sql(_) => &[],
            Origin::Upstream(u) => &u.forward_headers,
        }
    }
}
