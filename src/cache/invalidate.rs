//! Dropping entries: a route's key (with its variants, and its negative entry), a key's
//! negative entry alone (sync), and every positive entry of a route that is gone.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use super::{CacheKey, ResponseCache};
use bloomgate_core::key::OwnedKey;

impl ResponseCache {
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
}
