//! The metric families of filters (size and fill, readiness, loads and snapshots,
//! sync, its gaps and its changed rows, admissions) and the handles one filter resolves
//! once; binlog mode's are in `metrics::binlog`.

pub mod binlog;

use std::time::Duration;

use prometheus::{Gauge, GaugeVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Registry};

use binlog::{BinlogFamilies, BinlogMetrics};
use bloomgate_core::filter::FilterStats;
use bloomgate_core::metrics::{clamp_i64, family};

/// The filter families, registered together.
#[derive(Clone)]
pub struct FilterFamilies {
    items: IntGaugeVec,
    capacity: IntGaugeVec,
    bits: IntGaugeVec,
    hashes: IntGaugeVec,
    fill_ratio: GaugeVec,
    estimated_fpp: GaugeVec,
    ready: IntGaugeVec,
    last_sync: GaugeVec,
    last_build: GaugeVec,
    loads: IntCounterVec,
    load_duration: GaugeVec,
    keys_skipped: IntCounterVec,
    capacity_rebuilds: IntCounterVec,
    snapshot_loads: IntCounterVec,
    snapshot_writes: IntCounterVec,
    sync_lag: GaugeVec,
    unconfirmed_keys: IntGaugeVec,
    sync_keys: IntCounterVec,
    sync_polls: IntCounterVec,
    sync_open_gaps: IntGaugeVec,
    sync_gaps_expired: IntCounterVec,
    sync_gaps_dropped: IntCounterVec,
    sync_changed_rows: IntCounterVec,
    sync_memory_overflows: IntCounterVec,
    target_fpp: GaugeVec,
    sync_interval: GaugeVec,
    redis_checks: IntCounterVec,
    redis_writes: IntCounterVec,
    binlog: BinlogFamilies,
}

impl FilterFamilies {
    /// Creates the families and registers them on `registry`.
    pub fn register(registry: &Registry) -> prometheus::Result<Self> {
        Ok(FilterFamilies {
            items: family(
                registry,
                "bloomgate_filter_items",
                "Keys inserted into the live filter.",
                &["filter"],
            )?,
            capacity: family(
                registry,
                "bloomgate_filter_capacity",
                "Keys the live filter was sized for.",
                &["filter"],
            )?,
            bits: family(
                registry,
                "bloomgate_filter_bits",
                "Size of the live filter in bits.",
                &["filter"],
            )?,
            hashes: family(
                registry,
                "bloomgate_filter_hashes",
                "Hash probes per key in the live filter.",
                &["filter"],
            )?,
            fill_ratio: family(
                registry,
                "bloomgate_filter_fill_ratio",
                "Share of the live filter's bits that are set.",
                &["filter"],
            )?,
            estimated_fpp: family(
                registry,
                "bloomgate_filter_estimated_fpp",
                "False-positive rate estimated from the fill ratio (fill_ratio ^ hashes).",
                &["filter"],
            )?,
            ready: family(
                registry,
                "bloomgate_filter_ready",
                "1 when the filter is loaded and gating, 0 while requests fail open.",
                &["filter"],
            )?,
            last_sync: family(
                registry,
                "bloomgate_filter_last_sync_timestamp_seconds",
                "Unix time at which the live filter last finished loading keys from its source.",
                &["filter"],
            )?,
            last_build: family(
                registry,
                "bloomgate_filter_last_build_timestamp_seconds",
                "Unix time at which the live filter's last successful full build finished.",
                &["filter"],
            )?,
            loads: family(
                registry,
                "bloomgate_filter_loads_total",
                "Full filter loads from the source query, by result.",
                &["filter", "result"],
            )?,
            load_duration: family(
                registry,
                "bloomgate_filter_load_duration_seconds",
                "Duration of the last successful full load.",
                &["filter"],
            )?,
            keys_skipped: family(
                registry,
                "bloomgate_filter_keys_skipped_total",
                "Source rows whose key failed normalisation and was not inserted.",
                &["filter"],
            )?,
            capacity_rebuilds: family(
                registry,
                "bloomgate_filter_capacity_rebuilds_total",
                "Rebuilds started because items exceeded capacity.",
                &["filter"],
            )?,
            snapshot_loads: family(
                registry,
                "bloomgate_filter_snapshot_loads_total",
                "Snapshots read at start-up, by result (ok or rejected).",
                &["filter", "result"],
            )?,
            snapshot_writes: family(
                registry,
                "bloomgate_filter_snapshot_writes_total",
                "Snapshots written after builds, by result.",
                &["filter", "result"],
            )?,
            sync_lag: family(
                registry,
                "bloomgate_filter_sync_lag_seconds",
                "Freshness lag: now minus the newest change applied by incremental sync.",
                &["filter"],
            )?,
            unconfirmed_keys: family(
                registry,
                "bloomgate_filter_unconfirmed_keys",
                "Admitted keys (sync, write-through, admin API) that no full build has read from its source yet; every build adds them again.",
                &["filter"],
            )?,
            sync_keys: family(
                registry,
                "bloomgate_filter_sync_keys_total",
                "Keys applied to the live filter by incremental sync.",
                &["filter"],
            )?,
            sync_polls: family(
                registry,
                "bloomgate_filter_sync_polls_total",
                "Incremental sync polls, by result.",
                &["filter", "result"],
            )?,
            sync_open_gaps: family(
                registry,
                "bloomgate_filter_sync_open_gaps",
                "Id ranges that incremental sync skipped over and reads again until their rows appear or gap_timeout passes (integer watermarks).",
                &["filter"],
            )?,
            sync_gaps_expired: family(
                registry,
                "bloomgate_filter_sync_gaps_expired_total",
                "Sync gap ranges given up after gap_timeout without their rows appearing.",
                &["filter"],
            )?,
            sync_gaps_dropped: family(
                registry,
                "bloomgate_filter_sync_gaps_dropped_total",
                "Sync gap ranges dropped, oldest first, because too many were open.",
                &["filter"],
            )?,
            sync_changed_rows: family(
                registry,
                "bloomgate_filter_sync_changed_rows_total",
                "Rows read by sync with a (key, watermark) pair no earlier poll had read: their cached entries, positive and negative, were dropped.",
                &["filter"],
            )?,
            sync_memory_overflows: family(
                registry,
                "bloomgate_filter_sync_memory_overflows_total",
                "Sync polls that read more rows than sync remembers; each dropped the cached entries of every row it read.",
                &["filter"],
            )?,
            redis_checks: family(
                registry,
                "bloomgate_filter_redis_checks_total",
                "Checks of keys in the filter's Redis-held copy (backend = \"redis\"), by answer: maybe, absent, or none (an error, a timeout, a missing shard or no trusted generation; the local copy answered).",
                &["filter", "answer"],
            )?,
            redis_writes: family(
                registry,
                "bloomgate_filter_redis_writes_total",
                "Writes to the filter's Redis-held copy, by kind (admission, generation) and result (ok, error).",
                &["filter", "kind", "result"],
            )?,
            target_fpp: family(
                registry,
                "bloomgate_filter_target_fpp",
                "The configured false-positive rate the filter is sized for.",
                &["filter"],
            )?,
            sync_interval: family(
                registry,
                "bloomgate_filter_sync_interval_seconds",
                "The configured incremental sync interval (in binlog mode, the heartbeat); only filters with sync have it.",
                &["filter"],
            )?,
            binlog: BinlogFamilies::register(registry)?,
        })
    }

    /// Resolves the handles for one filter sized for `target_fpp`, and publishes that
    /// target and the sync interval (if the filter has sync) for rules to compare with.
    pub fn handles(
        &self,
        filter: &str,
        target_fpp: f64,
        sync_interval: Option<Duration>,
    ) -> FilterMetrics {
        self.target_fpp.with_label_values(&[filter]).set(target_fpp);
        if let Some(interval) = sync_interval {
            self.sync_interval
                .with_label_values(&[filter])
                .set(interval.as_secs_f64());
        }
        FilterMetrics {
            items: self.items.with_label_values(&[filter]),
            capacity: self.capacity.with_label_values(&[filter]),
            bits: self.bits.with_label_values(&[filter]),
            hashes: self.hashes.with_label_values(&[filter]),
            fill_ratio: self.fill_ratio.with_label_values(&[filter]),
            estimated_fpp: self.estimated_fpp.with_label_values(&[filter]),
            ready: self.ready.with_label_values(&[filter]),
            last_sync: self.last_sync.with_label_values(&[filter]),
            last_build: self.last_build.with_label_values(&[filter]),
            loads_ok: self.loads.with_label_values(&[filter, "ok"]),
            loads_failed: self.loads.with_label_values(&[filter, "error"]),
            load_duration: self.load_duration.with_label_values(&[filter]),
            keys_skipped: self.keys_skipped.with_label_values(&[filter]),
            capacity_rebuilds: self.capacity_rebuilds.with_label_values(&[filter]),
            snapshot_loads_ok: self.snapshot_loads.with_label_values(&[filter, "ok"]),
            snapshot_loads_rejected: self.snapshot_loads.with_label_values(&[filter, "rejected"]),
            snapshot_writes_ok: self.snapshot_writes.with_label_values(&[filter, "ok"]),
            snapshot_writes_failed: self.snapshot_writes.with_label_values(&[filter, "error"]),
            sync_lag: self.sync_lag.with_label_values(&[filter]),
            unconfirmed_keys: self.unconfirmed_keys.with_label_values(&[filter]),
            sync_keys: self.sync_keys.with_label_values(&[filter]),
            sync_polls_ok: self.sync_polls.with_label_values(&[filter, "ok"]),
            sync_polls_failed: self.sync_polls.with_label_values(&[filter, "error"]),
            sync_open_gaps: self.sync_open_gaps.with_label_values(&[filter]),
            sync_gaps_expired: self.sync_gaps_expired.with_label_values(&[filter]),
            sync_gaps_dropped: self.sync_gaps_dropped.with_label_values(&[filter]),
            sync_changed_rows: self.sync_changed_rows.with_label_values(&[filter]),
            sync_memory_overflows: self.sync_memory_overflows.with_label_values(&[filter]),
            redis_maybe: self.redis_checks.with_label_values(&[filter, "maybe"]),
            redis_absent: self.redis_checks.with_label_values(&[filter, "absent"]),
            redis_none: self.redis_checks.with_label_values(&[filter, "none"]),
            redis_writes: self.redis_writes.clone(),
            binlog: self.binlog.handles(filter),
            name: std::sync::Arc::from(filter),
        }
    }
}

/// Gauge handles for one filter, resolved once.
#[derive(Clone)]
pub struct FilterMetrics {
    items: IntGauge,
    capacity: IntGauge,
    bits: IntGauge,
    hashes: IntGauge,
    fill_ratio: Gauge,
    estimated_fpp: Gauge,
    ready: IntGauge,
    last_sync: Gauge,
    last_build: Gauge,
    loads_ok: IntCounter,
    loads_failed: IntCounter,
    load_duration: Gauge,
    keys_skipped: IntCounter,
    capacity_rebuilds: IntCounter,
    snapshot_loads_ok: IntCounter,
    snapshot_loads_rejected: IntCounter,
    snapshot_writes_ok: IntCounter,
    snapshot_writes_failed: IntCounter,
    sync_lag: Gauge,
    unconfirmed_keys: IntGauge,
    sync_keys: IntCounter,
    sync_polls_ok: IntCounter,
    sync_polls_failed: IntCounter,
    sync_open_gaps: IntGauge,
    sync_gaps_expired: IntCounter,
    sync_gaps_dropped: IntCounter,
    sync_changed_rows: IntCounter,
    sync_memory_overflows: IntCounter,
    redis_maybe: IntCounter,
    redis_absent: IntCounter,
    redis_none: IntCounter,
    redis_writes: IntCounterVec,
    /// Binlog mode's handles.
    pub binlog: BinlogMetrics,
    name: std::sync::Arc<str>,
}

impl FilterMetrics {
    /// Publishes the live filter's statistics.
    pub fn set_stats(&self, s: &FilterStats) {
        self.items.set(clamp_i64(s.items));
        self.capacity.set(clamp_i64(s.capacity));
        self.bits.set(clamp_i64(s.bits));
        self.hashes.set(i64::from(s.hashes));
        self.fill_ratio.set(s.fill_ratio);
        self.estimated_fpp.set(s.estimated_fpp);
    }

    /// Zeroes the size gauges: this instance holds no copy of the filter.
    pub fn clear_stats(&self) {
        self.items.set(0);
        self.capacity.set(0);
        self.bits.set(0);
        self.hashes.set(0);
        self.fill_ratio.set(0.0);
        self.estimated_fpp.set(0.0);
    }

    /// Marks the filter ready (1) or not (0).
    pub fn set_ready(&self, ready: bool) {
        self.ready.set(i64::from(ready));
    }

    /// Records a finished load: its result, duration, skipped keys and completion time.
    pub fn record_load(&self, ok: bool, took: Duration, skipped: u64, finished_unix: f64) {
        if ok {
            self.loads_ok.inc();
            self.load_duration.set(took.as_secs_f64());
            self.last_sync.set(finished_unix);
            self.last_build.set(finished_unix);
            self.keys_skipped.inc_by(skipped);
        } else {
            self.loads_failed.inc();
        }
    }

    /// Sets when the live filter's bits were built, for a filter restored from a snapshot
    /// (the time the snapshot's build finished, not the time it was read).
    pub fn set_built_at(&self, unix: f64) {
        self.last_build.set(unix);
    }

    /// Counts a rebuild started because items exceeded capacity.
    pub fn capacity_rebuild(&self) {
        self.capacity_rebuilds.inc();
    }

    /// Counts a snapshot accepted (true) or rejected (false) at start-up.
    pub fn snapshot_load(&self, ok: bool) {
        if ok {
            self.snapshot_loads_ok.inc();
        } else {
            self.snapshot_loads_rejected.inc();
        }
    }

    /// Counts a snapshot write.
    pub fn snapshot_write(&self, ok: bool) {
        if ok {
            self.snapshot_writes_ok.inc();
        } else {
            self.snapshot_writes_failed.inc();
        }
    }

    /// Records a sync poll: its result, the keys it applied, and when it finished.
    pub fn record_sync(&self, ok: bool, keys: u64, finished_unix: f64) {
        if ok {
            self.sync_polls_ok.inc();
            self.sync_keys.inc_by(keys);
            self.last_sync.set(finished_unix);
        } else {
            self.sync_polls_failed.inc();
        }
    }

    /// Binlog mode: a transaction (or a heartbeat) read from the log, with the keys it
    /// admitted; the stream has no polls to count.
    pub fn record_streamed(&self, keys: u64, finished_unix: f64) {
        self.sync_keys.inc_by(keys);
        self.last_sync.set(finished_unix);
    }

    /// Admitted keys that no build's source has listed yet.
    pub fn set_unconfirmed(&self, keys: usize) {
        self.unconfirmed_keys.set(clamp_i64(keys as u64));
    }

    /// Binlog mode: the keys deleted since the build and the effective rate.
    pub fn set_deletes(&self, deleted: u64, effective_fpp: f64) {
        self.binlog.set_deletes(deleted, effective_fpp);
    }

    /// Freshness lag: now minus the newest change applied, in seconds.
    pub fn set_sync_lag(&self, seconds: f64) {
        self.sync_lag.set(seconds);
    }

    /// Publishes how many id ranges sync is reading again (integer watermarks).
    pub fn set_sync_open_gaps(&self, ranges: usize) {
        self.sync_open_gaps
            .set(i64::try_from(ranges).unwrap_or(i64::MAX));
    }

    /// Counts gap ranges given up after `gap_timeout`.
    pub fn sync_gaps_expired(&self, ranges: usize) {
        self.sync_gaps_expired.inc_by(ranges as u64);
    }

    /// Counts gap ranges dropped because too many were open.
    pub fn sync_gaps_dropped(&self, ranges: usize) {
        self.sync_gaps_dropped.inc_by(ranges as u64);
    }

    /// Counts rows whose cached entries sync dropped because they changed.
    pub fn sync_changed_rows(&self, rows: usize) {
        self.sync_changed_rows.inc_by(rows as u64);
    }

    /// Counts a poll that read more rows than sync remembers.
    pub fn sync_seen_overflow(&self) {
        self.sync_memory_overflows.inc();
    }

    /// Counts one check of the Redis-held copy: `Some(true)` maybe, `Some(false)` absent,
    /// `None` no answer.
    pub fn redis_check(&self, answer: Option<bool>) {
        match answer {
            Some(true) => self.redis_maybe.inc(),
            Some(false) => self.redis_absent.inc(),
            None => self.redis_none.inc(),
        }
    }

    /// Counts one write to the Redis-held copy.
    pub fn redis_write(&self, kind: &str, ok: bool) {
        let result = if ok { "ok" } else { "error" };
        self.redis_writes
            .with_label_values(&[&*self.name, kind, result])
            .inc();
    }
}
