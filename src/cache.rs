//! The response cache: moka caches for positive entries (found keys, their response) and
//! negative entries (the gate's false positives), each with its own bound (entries, bytes
//! or both; what an entry weighs is `weight`'s) and a per-entry TTL (`expiry`), and
//! coalesced loading so concurrent misses for one key make one origin call (`load`);
//! stale entries are refreshed in `refresh`, entries dropped in `invalidate`. It does
//! not decide what to fetch (see `origin`) nor what to answer (see `proxy`).

use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

use moka::future::Cache;

use crate::origin::{CachedResponse, Variant};
use bloomgate_core::config::CacheConfig;
use bloomgate_core::key::OwnedKey;

mod expiry;
mod invalidate;
mod load;
mod refresh;
mod weight;

use expiry::{NegativeExpiry, PositiveExpiry};

pub use load::{LoadMiss, Loaded, Negative};
pub use refresh::RefreshClaim;
pub use weight::{
    Bound, NEGATIVE_ENTRY_OVERHEAD, POSITIVE_ENTRY_OVERHEAD, negative_entry_bytes,
    positive_entry_bytes,
};

/// A cache key: the route's index, the canonical key, and the values of what the route
/// forwards to its origin (declared query parameters and headers), if any.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct CacheKey {
    /// Stable id of the guarded route (routes may share keys but not answers; see
    /// `reload::RouteIds`).
    pub route: u32,
    /// The normalised key.
    pub key: OwnedKey,
    /// What else the origin request carries; `None` for the plain canonical request.
    pub variant: Option<Arc<Variant>>,
}

impl CacheKey {
    /// The key of the route and canonical key alone: negative entries are stored under
    /// it, because whether a key exists does not depend on a forwarded parameter (so
    /// varying one cannot replay a false positive past its negative entry).
    pub fn absence(&self) -> std::borrow::Cow<'_, CacheKey> {
        if self.variant.is_none() {
            return std::borrow::Cow::Borrowed(self);
        }
        std::borrow::Cow::Owned(CacheKey {
            route: self.route,
            key: self.key.clone(),
            variant: None,
        })
    }
}

/// What the cache knows about a key.
pub enum Lookup {
    /// A positive entry.
    Hit(CachedResponse),
    /// A positive entry past its TTL, kept to be served stale (see
    /// [`CachedResponse::staleness`]).
    Stale(CachedResponse),
    /// A negative entry: the origin recently said "not found".
    NegativeHit,
    /// Nothing cached.
    Miss,
}

/// Positive and negative caches.
#[derive(Clone)]
pub struct ResponseCache {
    positive: Cache<CacheKey, CachedResponse>,
    negative: Cache<CacheKey, Duration>,
    /// Whether any route forwards parameters or headers, so that invalidating a key
    /// must also look for its variants.
    has_variants: Arc<AtomicBool>,
    /// Keys whose background refresh is running: one task per key at a time.
    refreshing: Arc<std::sync::Mutex<std::collections::HashSet<CacheKey>>>,
    /// How the positive and the negative cache are bounded.
    bounds: (Bound, Bound),
}

impl ResponseCache {
    /// Builds both caches with the configured bounds. `has_variants`: some route forwards
    /// parameters or headers to its origin.
    pub fn new(config: &CacheConfig, has_variants: bool) -> ResponseCache {
        let positive_bound = Bound::of(config.max_entries, config.max_bytes);
        let negative_bound = Bound::of(config.negative_max_entries, config.negative_max_bytes);
        let mut positive = Cache::builder()
            .name("bloomgate-positive")
            .max_capacity(positive_bound.capacity())
            .expire_after(PositiveExpiry);
        if positive_bound.weighs() {
            positive = positive.weigher(move |k: &CacheKey, v: &CachedResponse| {
                positive_bound.weight(positive_entry_bytes(k, v))
            });
        }
        let mut negative = Cache::builder()
            .name("bloomgate-negative")
            .max_capacity(negative_bound.capacity())
            .expire_after(NegativeExpiry);
        if negative_bound.weighs() {
            negative = negative.weigher(move |k: &CacheKey, _: &Duration| {
                negative_bound.weight(negative_entry_bytes(k))
            });
        }
        ResponseCache {
            has_variants: Arc::new(AtomicBool::new(has_variants)),
            refreshing: Arc::default(),
            positive: positive.build(),
            negative: negative.build(),
            bounds: (positive_bound, negative_bound),
        }
    }

    /// The estimated bytes the entries of each cache bounded in bytes take now, as that
    /// bound counts them: (positive, negative), `None` for a cache bounded by entries
    /// alone. Under both bounds an entry weighs at least its share of the entry bound,
    /// so this reads high while the entry bound is the one that binds.
    pub fn estimated_bytes(&self) -> (Option<u64>, Option<u64>) {
        let bytes = |bound: Bound, weighted: u64| match bound {
            Bound::Entries(_) => None,
            Bound::Bytes(_) => Some(weighted),
            Bound::Both { bytes, .. } => {
                let share =
                    u128::from(weighted) * u128::from(bytes) / u128::from(bound.capacity().max(1));
                Some(u64::try_from(share).unwrap_or(u64::MAX))
            }
        };
        (
            bytes(self.bounds.0, self.positive.weighted_size()),
            bytes(self.bounds.1, self.negative.weighted_size()),
        )
    }

    /// Looks a key up: positive first, then negative (under [`CacheKey::absence`]).
    pub async fn lookup(&self, key: &CacheKey) -> Lookup {
        if let Some(hit) = self.positive.get(key).await {
            if hit.staleness(std::time::Instant::now()).is_some() {
                return Lookup::Stale(hit);
            }
            return Lookup::Hit(hit);
        }
        if self.negative.contains_key(&*key.absence()) {
            return Lookup::NegativeHit;
        }
        Lookup::Miss
    }

    /// [`ResponseCache::lookup`] when it needs no waiting: `None` when moka's lookup
    /// would wait (another thread holds its maintenance lock), and the caller awaits
    /// `lookup` instead. Nearly every lookup is ready at once; a lookup dropped
    /// unfinished is one moka expects (it retries what was interrupted on the next).
    pub fn lookup_now(&self, key: &CacheKey) -> Option<Lookup> {
        let lookup = std::pin::pin!(self.lookup(key));
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        match lookup.poll(&mut cx) {
            std::task::Poll::Ready(found) => Some(found),
            std::task::Poll::Pending => None,
        }
    }

    /// Approximate entry counts: (positive, negative).
    pub fn entry_counts(&self) -> (u64, u64) {
        (self.positive.entry_count(), self.negative.entry_count())
    }

    /// Applies moka's pending maintenance so counts are current (used before reporting).
    pub async fn run_pending_maintenance(&self) {
        self.positive.run_pending_tasks().await;
        self.negative.run_pending_tasks().await;
    }
}

#[cfg(test)]
mod tests;
