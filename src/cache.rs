//! The response cache: moka caches for positive entries (found keys, their response) and
//! negative entries (the gate's false positives), each with its own bound (entries, bytes
//! or both; what an entry weighs is `weight`'s) and a per-entry TTL, and coalesced loading so concurrent misses for one key make one origin call. It
//! does not decide what to fetch (see `origin`) nor what to answer (see `proxy`).

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use moka::Expiry;
use moka::future::Cache;
use moka::ops::compute::{CompResult, Op};

use crate::config::CacheConfig;
use crate::key::OwnedKey;
use crate::origin::{CachedResponse, Fetched, OriginError, Variant};

mod weight;

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

/// How a load stores "not found".
#[derive(Clone, Copy)]
pub struct Negative<'a> {
    /// How long the negative entry lives.
    pub ttl: Duration,
    /// Checked after the entry is stored: false when the key was admitted since the
    /// lookup began, and the entry must go (see `gate::Filter::fence`).
    pub still_absent: &'a (dyn Fn() -> bool + Sync),
}

/// The result of a coalesced load.
// Returned once per origin load, never stored: boxing the answer would cost an
// allocation to save a copy.
#[allow(clippy::large_enum_variant)]
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
        /// The origin's error, shared by every request that waited on the load.
        error: Arc<OriginError>,
        /// Whether this request made the origin call.
        leader: bool,
    },
}

/// Why a coalesced load did not produce a value to store (moka stores only successes,
/// so "not found" and answers that may not be stored travel as errors too).
#[derive(Debug, thiserror::Error)]
#[allow(clippy::large_enum_variant)]
pub enum LoadMiss {
    /// The origin has no such key.
    #[error("not found")]
    NotFound,
    /// Found, but HTTP caching rules forbid storing the answer.
    #[error("found, not storable")]
    Unstored(CachedResponse),
    /// The origin call failed (in an `Arc`, so each waiter can take its own handle).
    #[error(transparent)]
    Origin(Arc<OriginError>),
}

struct PositiveExpiry;

impl Expiry<CacheKey, CachedResponse> for PositiveExpiry {
    fn expire_after_create(
        &self,
        _: &CacheKey,
        value: &CachedResponse,
        _: Instant,
    ) -> Option<Duration> {
        Some(kept_for(value))
    }

    fn expire_after_update(
        &self,
        _: &CacheKey,
        value: &CachedResponse,
        _: Instant,
        _: Option<Duration>,
    ) -> Option<Duration> {
        // A refreshed entry lives as long as its new answer says, not the old one.
        Some(kept_for(value))
    }
}

/// How long an answer stays in the cache: its TTL, then as long as it may be served
/// stale. Answers without a lifetime are never inserted; zero would expire one at once.
fn kept_for(value: &CachedResponse) -> Duration {
    value
        .meta
        .ttl
        .map_or(Duration::ZERO, |ttl| ttl + value.meta.stale.longest())
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
    /// Whether any route forwards parameters or headers, so that invalidating a key
    /// must also look for its variants.
    has_variants: Arc<AtomicBool>,
    /// Keys whose background refresh is running: one task per key at a time.
    refreshing: Arc<std::sync::Mutex<std::collections::HashSet<CacheKey>>>,
    /// How the positive and the negative cache are bounded.
    bounds: (Bound, Bound),
}

/// A background refresh of one key, claimed by [`ResponseCache::claim_refresh`]; the
/// key is free for another once this is dropped.
pub struct RefreshClaim {
    key: CacheKey,
    refreshing: Arc<std::sync::Mutex<std::collections::HashSet<CacheKey>>>,
}

impl Drop for RefreshClaim {
    fn drop(&mut self) {
        self.refreshing
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&self.key);
    }
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

    /// Loads a key for a request that carries credentials: never coalesced with other
    /// requests (their answers are not this request's), stored only when the answer
    /// allows reuse for credentialed requests (RFC 9111 §3.5). "Not found" is stored as
    /// a negative entry like any other: absence does not depend on who asks.
    pub async fn load_private<F>(&self, key: CacheKey, negative: Negative<'_>, fetch: F) -> Loaded
    where
        F: Future<Output = Result<Fetched, OriginError>>,
    {
        match fetch.await {
            Ok(Fetched::Found(response)) => {
                if response.storable() && response.with_credentials {
                    self.positive.insert(key, response.clone()).await;
                }
                Loaded::Found {
                    response,
                    leader: true,
                }
            }
            Ok(Fetched::NotFound) => {
                self.store_absence(key.absence().into_owned(), &negative)
                    .await;
                Loaded::NotFound { leader: true }
            }
            Err(e) => Loaded::Failed {
                error: Arc::new(e),
                leader: true,
            },
        }
    }

    /// Loads a missing key through `fetch`, coalescing concurrent callers for the same key
    /// into one call. A found answer becomes a positive entry; "not found" becomes a
    /// negative entry that lives `negative.ttl`, unless the key was admitted meanwhile;
    /// an error caches nothing.
    ///
    /// Two orderings keep a repeated absent key at one origin call. The negative entry is
    /// stored inside the shared load, before the callers waiting on it are released, so a
    /// request arriving just after them finds it. And a new load first looks for a
    /// negative entry again: a caller whose own `lookup` missed may reach this point only
    /// after another caller's load has finished and stored one.
    pub async fn load<F>(&self, key: CacheKey, negative: Negative<'_>, fetch: F) -> Loaded
    where
        F: Future<Output = Result<Fetched, OriginError>>,
    {
        let leader = AtomicBool::new(false);
        let result = self
            .positive
            .try_get_with(key.clone(), async {
                let absence = key.absence();
                if self.negative.contains_key(&*absence) {
                    return Err(LoadMiss::NotFound);
                }
                leader.store(true, Ordering::Relaxed);
                match fetch.await.map_err(|e| LoadMiss::Origin(Arc::new(e)))? {
                    Fetched::Found(response) if response.storable() => Ok(response),
                    Fetched::Found(response) => Err(LoadMiss::Unstored(response)),
                    Fetched::NotFound => {
                        self.store_absence(absence.into_owned(), &negative).await;
                        Err(LoadMiss::NotFound)
                    }
                }
            })
            .await;
        let leader = leader.load(Ordering::Relaxed);
        match result {
            Ok(response) => Loaded::Found { response, leader },
            Err(miss) => match &*miss {
                LoadMiss::NotFound => Loaded::NotFound { leader },
                LoadMiss::Unstored(response) => Loaded::Found {
                    response: response.clone(),
                    leader,
                },
                LoadMiss::Origin(error) => Loaded::Failed {
                    error: Arc::clone(error),
                    leader,
                },
            },
        }
    }

    /// Claims the background refresh of `key`: `None` while another runs.
    pub fn claim_refresh(&self, key: &CacheKey) -> Option<RefreshClaim> {
        let mut refreshing = self.refreshing.lock().unwrap_or_else(|p| p.into_inner());
        refreshing.insert(key.clone()).then(|| RefreshClaim {
            key: key.clone(),
            refreshing: Arc::clone(&self.refreshing),
        })
    }

    /// Refreshes a stale entry through `fetch`. Refreshes of one key run one after
    /// another, and one that finds the entry fresh again (the one before it refreshed
    /// it) takes it without calling the origin; with `if_idle`, a refresh is skipped
    /// (`Loaded::Found`, not the leader) while another runs. Found: the entry is
    /// replaced. Not found: it goes, and a negative entry is stored. An error keeps the
    /// stale entry, for the caller to serve within its `stale_if_error`.
    pub async fn refresh<F>(
        &self,
        key: CacheKey,
        negative: Negative<'_>,
        fetch: F,
        if_idle: bool,
    ) -> Loaded
    where
        F: Future<Output = Result<Fetched, OriginError>>,
    {
        let leader = AtomicBool::new(false);
        let absence = key.absence().into_owned();
        let compute = |entry: Option<moka::Entry<CacheKey, CachedResponse>>| async {
            if entry.is_some_and(|e| e.value().staleness(std::time::Instant::now()).is_none()) {
                return Ok(Op::Nop);
            }
            leader.store(true, Ordering::Relaxed);
            match fetch.await {
                Ok(Fetched::Found(response)) if response.storable() => Ok(Op::Put(response)),
                Ok(Fetched::Found(response)) => Err(LoadMiss::Unstored(response)),
                Ok(Fetched::NotFound) => {
                    self.store_absence(absence, &negative).await;
                    Ok(Op::Remove)
                }
                Err(e) => Err(LoadMiss::Origin(Arc::new(e))),
            }
        };
        let selector = self.positive.entry(key.clone());
        let result = if if_idle {
            selector.and_try_compute_if_nobody_else(compute).await
        } else {
            selector.and_try_compute_with(compute).await
        };
        let leader = leader.load(Ordering::Relaxed);
        match result {
            Ok(
                CompResult::Inserted(e) | CompResult::ReplacedWith(e) | CompResult::Unchanged(e),
            ) => Loaded::Found {
                response: e.into_value(),
                leader,
            },
            Ok(CompResult::Removed(_) | CompResult::StillNone(_)) | Err(LoadMiss::NotFound) => {
                Loaded::NotFound { leader }
            }
            Err(LoadMiss::Unstored(response)) => {
                // The new answer may not be stored: the old one must not be served either.
                self.positive.invalidate(&key).await;
                Loaded::Found { response, leader }
            }
            Err(LoadMiss::Origin(error)) => Loaded::Failed { error, leader },
        }
    }

    /// Stores a negative entry, then drops it again if the key was admitted since its
    /// lookup began. Checking after the insert closes the race with an admission: one
    /// that came before the check is seen by it, and one that comes after it drops the
    /// entry itself (admissions move the fence before they drop negative entries).
    async fn store_absence(&self, key: CacheKey, negative: &Negative<'_>) {
        self.negative.insert(key.clone(), negative.ttl).await;
        if !(negative.still_absent)() {
            self.negative.invalidate(&key).await;
            tracing::debug!(key = %key.key, "the key was admitted during its lookup; negative entry dropped");
        }
    }

    /// Drops every entry (positive, of any variant, and negative) for a route's key.
    pub async fn invalidate(&self, route: u32, key: &OwnedKey) {
        let plain = CacheKey {
            route,
            key: key.clone(),
            variant: None,
        };
        self.positive.invalidate(&plain).await;
        self.negative.invalidate(&plain).await;
        if self.has_variants.load(Ordering::Relaxed) {
            // Variants are found by a scan: rare (an admin call or an admission), and only
            // when some route forwards parameters or headers.
            self.invalidate_positive_where(|k| k.route == route && k.key == *key)
                .await;
        }
    }

    /// Drops the positive entries whose keys match, found by a scan of the whole cache.
    /// An entry stored while the scan runs may be missed, as one stored just after it.
    /// (moka's invalidation closures would spare the scan, at 32 bytes more per entry
    /// for as long as the entry lives.)
    async fn invalidate_positive_where(&self, matches: impl Fn(&CacheKey) -> bool) {
        let doomed: Vec<Arc<CacheKey>> = self
            .positive
            .iter()
            .filter(|(k, _)| matches(k))
            .map(|(k, _)| k)
            .collect();
        for key in doomed {
            self.positive.invalidate(&*key).await;
        }
    }

    /// Drops a negative entry for a route's key, leaving positive ones alone.
    pub async fn invalidate_negative(&self, route: u32, key: &OwnedKey) {
        let plain = CacheKey {
            route,
            key: key.clone(),
            variant: None,
        };
        // Sync re-applies whole windows of keys; most have no negative entry.
        if self.negative.contains_key(&plain) {
            self.negative.invalidate(&plain).await;
        }
    }

    /// Records whether some route forwards parameters or headers (after a reload).
    pub fn set_has_variants(&self, has_variants: bool) {
        self.has_variants.store(has_variants, Ordering::Relaxed);
    }

    /// Drops the positive entries of a route id no route has any more (a reload removed
    /// or reshaped it); its negative entries end with their short TTL.
    pub async fn invalidate_route(&self, route: u32) {
        self.invalidate_positive_where(|k| k.route == route).await;
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
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU64;

    fn cache() -> ResponseCache {
        ResponseCache::new(&CacheConfig::default(), false)
    }

    fn key(n: u64) -> CacheKey {
        CacheKey {
            route: 0,
            key: OwnedKey::Int(n),
            variant: None,
        }
    }

    /// Negative entries that nothing fences.
    fn kept(ttl: Duration) -> Negative<'static> {
        Negative {
            ttl,
            still_absent: &|| true,
        }
    }

    /// An origin that knows no key, counting its calls; each call takes `delay`.
    async fn absent(calls: &AtomicU64, delay: Duration) -> Result<Fetched, OriginError> {
        calls.fetch_add(1, Ordering::SeqCst);
        tokio::time::sleep(delay).await;
        Ok(Fetched::NotFound)
    }

    #[tokio::test]
    async fn a_load_after_a_finished_not_found_does_not_call_the_origin() {
        // The caller's own lookup missed, but by the time it loads, another load has
        // stored the negative entry: no second origin call.
        let cache = cache();
        let calls = AtomicU64::new(0);
        let ttl = Duration::from_secs(30);
        let first = cache
            .load(key(7), kept(ttl), absent(&calls, Duration::ZERO))
            .await;
        assert!(matches!(first, Loaded::NotFound { leader: true }));
        let second = cache
            .load(key(7), kept(ttl), absent(&calls, Duration::ZERO))
            .await;
        assert!(matches!(second, Loaded::NotFound { leader: false }));
        assert_eq!(calls.load(Ordering::SeqCst), 1);
        assert!(matches!(cache.lookup(&key(7)).await, Lookup::NegativeHit));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn waves_of_requests_for_one_absent_key_make_one_origin_call() {
        // Requests keep arriving while the first load runs and right after it ends;
        // whatever their timing, the negative entry exists before any of them is
        // released, so every later request is a negative hit.
        let cache = cache();
        let calls = Arc::new(AtomicU64::new(0));
        let mut tasks = Vec::new();
        for i in 0..200u64 {
            let (cache, calls) = (cache.clone(), Arc::clone(&calls));
            tasks.push(tokio::spawn(async move {
                tokio::time::sleep(Duration::from_micros(i * 50)).await;
                match cache.lookup(&key(9)).await {
                    Lookup::NegativeHit => false,
                    Lookup::Hit(_) | Lookup::Stale(_) => {
                        panic!("a positive entry for an absent key")
                    }
                    Lookup::Miss => {
                        let loaded = cache
                            .load(key(9), kept(Duration::from_secs(30)), async {
                                absent(&calls, Duration::from_millis(3)).await
                            })
                            .await;
                        matches!(loaded, Loaded::NotFound { leader: true })
                    }
                }
            }));
        }
        let mut leaders = 0;
        for t in tasks {
            leaders += u64::from(t.await.expect("task"));
        }
        assert_eq!(calls.load(Ordering::SeqCst), 1);
        assert_eq!(leaders, 1);
    }

    #[tokio::test]
    async fn a_negative_entry_fenced_off_during_its_lookup_is_not_kept() {
        // The key is admitted while the origin is answering "not found": that answer may
        // predate the key's row, so neither load keeps it.
        let cache = cache();
        for private in [false, true] {
            let admitted = AtomicBool::new(false);
            let still_absent = || !admitted.load(Ordering::SeqCst);
            let negative = Negative {
                ttl: Duration::from_secs(30),
                still_absent: &still_absent,
            };
            let fetch = async {
                admitted.store(true, Ordering::SeqCst);
                Ok(Fetched::NotFound)
            };
            let loaded = if private {
                cache.load_private(key(5), negative, fetch).await
            } else {
                cache.load(key(5), negative, fetch).await
            };
            assert!(matches!(loaded, Loaded::NotFound { leader: true }));
            assert!(matches!(cache.lookup(&key(5)).await, Lookup::Miss));
        }
        // Unfenced, the same answer is kept.
        let loaded = cache
            .load(key(5), kept(Duration::from_secs(30)), async {
                Ok(Fetched::NotFound)
            })
            .await;
        assert!(matches!(loaded, Loaded::NotFound { leader: true }));
        assert!(matches!(cache.lookup(&key(5)).await, Lookup::NegativeHit));
    }

    #[tokio::test]
    async fn errors_are_not_cached() {
        let cache = cache();
        let calls = AtomicU64::new(0);
        for _ in 0..2 {
            let loaded = cache
                .load(key(3), kept(Duration::from_secs(30)), async {
                    calls.fetch_add(1, Ordering::SeqCst);
                    Err(OriginError::Timeout(Duration::from_millis(1)))
                })
                .await;
            assert!(matches!(loaded, Loaded::Failed { leader: true, .. }));
        }
        assert_eq!(calls.load(Ordering::SeqCst), 2);
        assert!(matches!(cache.lookup(&key(3)).await, Lookup::Miss));
    }

    #[test]
    fn a_key_has_one_background_refresh_at_a_time() {
        let cache = cache();
        let first = cache.claim_refresh(&key(4));
        assert!(first.is_some());
        assert!(cache.claim_refresh(&key(4)).is_none());
        assert!(cache.claim_refresh(&key(5)).is_some());
        drop(first);
        assert!(cache.claim_refresh(&key(4)).is_some());
    }
}
