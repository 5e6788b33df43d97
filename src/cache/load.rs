//! Filling the cache from the origin: coalesced loading (concurrent misses for one key
//! make one origin call), loading for a request with credentials (never coalesced), and
//! storing "not found" as a negative entry unless the key was admitted meanwhile.

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use super::{CacheKey, ResponseCache};
use crate::origin::{CachedResponse, Fetched, OriginError};

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

impl ResponseCache {
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

    /// Stores a negative entry, then drops it again if the key was admitted since its
    /// lookup began. Checking after the insert closes the race with an admission: one
    /// that came before the check is seen by it, and one that comes after it drops the
    /// entry itself (admissions move the fence before they drop negative entries).
    pub(super) async fn store_absence(&self, key: CacheKey, negative: &Negative<'_>) {
        self.negative.insert(key.clone(), negative.ttl).await;
        if !(negative.still_absent)() {
            self.negative.invalidate(&key).await;
            tracing::debug!(key = %key.key, "the key was admitted during its lookup; negative entry dropped");
        }
    }
}
