//! Binlog mode: the keys deleted from the source since the filter's position. A Bloom
//! filter cannot take a key out, so a deleted key's bits stay set and every lookup of it
//! passes the gate until the next build: the filter's effective false-positive rate
//! rises above the one it was built for. This file estimates that rate, publishes it
//! and asks for a rebuild once it reaches `sync.binlog.effective_rate_rebuild` times the
//! target. It counts; the binlog stream (`gate::sync::binlog`) tells it what to count.

use std::sync::atomic::Ordering;

use super::metrics::binlog::BinlogRebuild;
use super::{Filter, RebuildReason};
use bloomgate_core::filter::blocked_false_positive_rate;

/// The effective false-positive rate of a filter holding `items` keys, `deleted` of
/// them deleted from the source, that answers for the rest at `rate`: a lookup of an
/// absent key passes when it names a deleted key (taken to be as likely as the share
/// of the filter's keys that are deleted) or, otherwise, at `rate`.
pub fn effective_rate(rate: f64, items: u64, deleted: u64) -> f64 {
    let dead = if items == 0 {
        0.0
    } else {
        (deleted as f64 / items as f64).min(1.0)
    };
    rate + (1.0 - rate) * dead
}

impl Filter {
    /// Counts `keys` deleted from the source, as read by the stream started at
    /// `restart` (nothing when a new position has been set since), publishes the
    /// effective rate and, once it reaches its bound, asks for a rebuild (once per
    /// crossing).
    pub fn record_deleted(&self, restart: u64, keys: u64) {
        let Some(deleted) = self.count_deleted(restart, keys) else {
            return;
        };
        let Some(rate) = self.effective_fpp_with(deleted) else {
            return;
        };
        self.metrics.set_deletes(deleted, rate);
        let config = self.config();
        let Some(sync) = &config.sync else { return };
        let bound = sync.binlog.effective_rate_rebuild * config.false_positive_rate;
        if rate >= bound && !self.deletes_rebuild_pending.swap(true, Ordering::AcqRel) {
            self.metrics.binlog.rebuild(BinlogRebuild::Deletes);
            tracing::warn!(filter = %self.name, deleted, effective_rate = rate, bound,
                "keys deleted from the source raised the effective false-positive rate to its bound; rebuilding");
            self.request_rebuild(RebuildReason::Deletes);
        }
    }

    /// Binlog mode: the effective false-positive rate now (see [`effective_rate`]);
    /// `None` before the first load.
    pub fn effective_fpp(&self) -> Option<f64> {
        self.effective_fpp_with(self.deleted_keys())
    }

    fn effective_fpp_with(&self, deleted: u64) -> Option<f64> {
        let live = self.live_membership()?;
        let filter = live.local()?;
        let p = filter.params();
        let items = filter.items();
        let rate = blocked_false_positive_rate(items, p.bits, p.hashes);
        Some(effective_rate(rate, items, deleted))
    }

    /// A new filter serves: its rebuild for deletes, if one was asked for, is done.
    pub(super) fn deletes_rebuilt(&self) {
        self.deletes_rebuild_pending.store(false, Ordering::Release);
        if self.binlog_source.is_some() {
            let rate = self.effective_fpp().unwrap_or(0.0);
            self.metrics.set_deletes(self.deleted_keys(), rate);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_effective_rate_grows_with_the_share_of_deleted_keys() {
        assert_eq!(effective_rate(0.01, 1000, 0), 0.01);
        assert!((effective_rate(0.01, 1000, 5) - (0.01 + 0.99 * 0.005)).abs() < 1e-12);
        assert_eq!(effective_rate(0.01, 1000, 1000), 1.0);
        assert_eq!(effective_rate(0.01, 1000, 5000), 1.0);
        assert_eq!(effective_rate(0.0, 0, 3), 0.0);
        // At a 1% target and the default bound of 1.5, about one key in 200 deleted
        // brings a rebuild.
        assert!(effective_rate(0.01, 100_000, 510) >= 0.015);
        assert!(effective_rate(0.01, 100_000, 500) < 0.015);
    }
}
