//! The response cache: moka caches for positive entries (found keys, their response) and
//! negative entries (the gate's false positives), each with its own bound and a per-entry
//! TTL, and coalesced loading so concurrent misses for one key make one origin call. It
//! does not decide what to fetch (see `origin`) nor what to answer (see `proxy`).

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{HeaderValue, StatusCode};
use moka::Expiry;
use moka::future::Cache;

use crate::config::CacheConfig;
use crate::key::OwnedKey;
use crate::origin::{Fetched, OriginError};

/// A cache key: the route's index and the canonical key.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct CacheKey {
    /// Index of the guarded route (routes may share keys but not answers).
    pub route: u16,
    /// The normalised key.
    pub key: OwnedKey,
}

/// A cached answer. Cloning is cheap: the body and header are reference counted.
#[derive(Debug, Clone)]
pub struct CachedResponse {
    /// Status to replay (a 2xx).
    pub status: StatusCode,
    /// Content type to replay, if the origin gave one.
    pub content_type: Option<HeaderValue>,
    /// The body.
    pub body: Bytes,
    /// How long this entry lives.
    pub ttl: Duration,
}

/// What the cache knows about a key.
pub enum Lookup {
    /// A positive entry.
    Hit(CachedResponse),
    /// A negative entry: the origin recently said "not found".
    NegativeHit,
    /// Nothing cached.
    Miss,
}

/// The result of a coalesced load.
pub enum Loaded {
    /// Found; `leader` is true for the one request whose origin call produced it.
    Found {
        /// The answer (now cached).
        response: CachedResponse,
        /// Whether this request made the origin call.
        leader: bool,
    },
    /// The origin said "not found"; a negative entry was stored.
    NotFound {
        /// Whether this request made the origin call.
        leader: bool,
    },
    /// The origin call failed; nothing was cached. Waiters share the leader's error.
    Failed {
        /// The shared error (always [`LoadMiss::Origin`]).
        error: Arc<LoadMiss>,
        /// Whether this request made the origin call.
        leader: bool,
    },
}

/// Why a coalesced load did not produce a value (moka stores only successes, so "not
/// found" travels as an error too).
#[derive(Debug, thiserror::Error)]
pub enum LoadMiss {
    /// The origin has no such key.
    #[error("not found")]
    NotFound,
    /// The origin call failed.
    #[error(transparent)]
    Origin(#[from] OriginError),
}

struct PositiveExpiry;

impl Expiry<CacheKey, CachedResponse> for PositiveExpiry {
    fn expire_after_create(
        &self,
        _: &CacheKey,
        value: &CachedResponse,
        _: Instant,
    ) -> Option<Duration> {
        Some(value.ttl)
    }
}

struct NegativeExpiry;

impl Expiry<CacheKey, Duration> for NegativeExpiry {
    fn expire_after_create(&self, _: &CacheKey, ttl: &Duration, _: Instant) -> Option<Duration> {
        Some(*ttl)
    }
}

/// Positive and negative caches.
#[derive(Clone)]
pub struct ResponseCache {
    positive: Cache<CacheKey, CachedResponse>,
    negative: Cache<CacheKey, Duration>,
}

impl ResponseCache {
    /// Builds both caches with the configured bounds.
    pub fn new(config: &CacheConfig) -> ResponseCache {
        ResponseCache {
            positive: Cache::builder()
                .name("bloomgate-positive")
                .max_capacity(config.max_entries)
                .expire_after(PositiveExpiry)
                .build(),
            negative: Cache::builder()
                .name("bloomgate-negative")
                .max_capacity(config.negative_max_entries)
                .expire_after(NegativeExpiry)
                .build(),
        }
    }

    /// Looks a key up: positive first, then negative.
    pub async fn lookup(&self, key: &CacheKey) -> Lookup {
        if let Some(hit) = self.positive.get(key).await {
            return Lookup::Hit(hit);
        }
        if self.negative.contains_key(key) {
            return Lookup::NegativeHit;
        }
        Lookup::Miss
    }

    /// Loads a missing key through `fetch`, coalescing concurrent callers for the same key
    /// into one call. A found answer becomes a positive entry; "not found" becomes a
    /// negative entry that lives `negative_ttl`; an error caches nothing.
    pub async fn load<F>(&self, key: CacheKey, negative_ttl: Duration, fetch: F) -> Loaded
    where
        F: Future<Output = Result<Fetched, OriginError>>,
    {
        let leader = AtomicBool::new(false);
        let result = self
            .positive
            .try_get_with(key.clone(), async {
                leader.store(true, Ordering::Relaxed);
                match fetch.await? {
                    Fetched::Found(response) => Ok(response),
                    Fetched::NotFound => Err(LoadMiss::NotFound),
                }
            })
            .await;
        let leader = leader.load(Ordering::Relaxed);
        match result {
            Ok(response) => Loaded::Found { response, leader },
            Err(miss) => match &*miss {
                LoadMiss::NotFound => {
                    if leader {
                        self.negative.insert(key, negative_ttl).await;
                    }
                    Loaded::NotFound { leader }
                }
                LoadMiss::Origin(_) => Loaded::Failed {
                    error: miss,
                    leader,
                },
            },
        }
    }

    /// Drops any entry (positive or negative) for `key`.
    pub async fn invalidate(&self, key: &CacheKey) {
        self.positive.invalidate(key).await;
        self.negative.invalidate(key).await;
    }

    /// Drops a negative entry for `key`, leaving a positive one alone.
    pub async fn invalidate_negative(&self, key: &CacheKey) {
        // Sync re-applies whole windows of keys; most have no negative entry.
        if self.negative.contains_key(key) {
            self.negative.invalidate(key).await;
        }
    }

    /// Approximate entry counts: (positive, negative).
    pub fn entry_counts(&self) -> (u64, u64) {
        (self.positive.entry_count(), self.negative.entry_count())
    }

    /// Applies moka's pending maintenance so counts are current (used before reporting).
    pub async fn sync(&self) {
        self.positive.run_pending_tasks().await;
        self.negative.run_pending_tasks().await;
    }
}
