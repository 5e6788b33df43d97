//! Refreshing a stale positive entry: one background refresh per key at a time
//! ([`RefreshClaim`]), and the refresh itself, which replaces, drops or keeps the entry
//! by what the origin answers.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use moka::ops::compute::{CompResult, Op};

use super::{CacheKey, LoadMiss, Loaded, Negative, ResponseCache};
use crate::origin::{CachedResponse, Fetched, OriginError};

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
}
