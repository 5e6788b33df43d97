//! Every Prometheus metric bloomgate exports, registered on a registry that is passed in
//! (never the global one), so several proxies can live in one process. Per-route label
//! handles are resolved once at start-up: the request path only increments. It does not
//! serve `/metrics` (see `admin`).

use std::time::Duration;

use prometheus::{
    Gauge, GaugeVec, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge,
    IntGaugeVec, Opts, Registry,
};

use crate::filter::FilterStats;
use crate::pipeline::outcome::Outcome;

/// Histogram buckets for request latency: from 50 µs (an intercepted request) to 10 s.
const LATENCY_BUCKETS: &[f64] = &[
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
    2.5, 5.0, 10.0,
];

/// All metric families.
#[derive(Clone)]
pub struct Metrics {
    requests: IntCounterVec,
    request_duration: HistogramVec,
    origin_duration: HistogramVec,
    filter_items: IntGaugeVec,
    filter_capacity: IntGaugeVec,
    filter_bits: IntGaugeVec,
    filter_hashes: IntGaugeVec,
    filter_fill_ratio: GaugeVec,
    filter_estimated_fpp: GaugeVec,
    filter_ready: IntGaugeVec,
    filter_last_sync: GaugeVec,
    filter_last_build: GaugeVec,
    filter_loads: IntCounterVec,
    filter_load_duration: GaugeVec,
    filter_keys_skipped: IntCounterVec,
    cache_entries: IntGaugeVec,
    passthrough: IntCounterVec,
    false_negatives: IntCounterVec,
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
    write_through: IntCounterVec,
    origin_errors: IntCounterVec,
    route_info: IntGaugeVec,
    filter_target_fpp: GaugeVec,
    filter_sync_interval: GaugeVec,
}

/// Label handles for one route, resolved once.
#[derive(Clone)]
pub struct RouteMetrics {
    requests: Vec<IntCounter>,
    durations: Vec<Histogram>,
    origin: Histogram,
    origin_errors: IntCounter,
    false_negatives: IntCounter,
}

impl RouteMetrics {
    /// Counts a finished request and its latency.
    pub fn observe(&self, outcome: Outcome, elapsed: Duration) {
        self.requests[outcome.index()].inc();
        self.durations[outcome.index()].observe(elapsed.as_secs_f64());
    }

    /// Records the duration of one origin call.
    pub fn observe_origin(&self, elapsed: Duration) {
        self.origin.observe(elapsed.as_secs_f64());
    }

    /// Counts one failed origin call: a timeout, a connection or database error, or an
    /// answer that is neither found nor not-found.
    pub fn origin_error(&self) {
        self.origin_errors.inc();
    }

    /// Counts a key the gate called absent that the origin found (shadow mode).
    pub fn false_negative(&self) {
        self.false_negatives.inc();
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

    /// Admitted keys that no build's source has listed yet.
    pub fn set_unconfirmed(&self, keys: usize) {
        self.unconfirmed_keys.set(clamp_i64(keys as u64));
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
}

fn clamp_i64(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

impl Metrics {
    /// Creates every family and registers it on `registry`.
    pub fn new(registry: &Registry) -> prometheus::Result<Metrics> {
        let requests = IntCounterVec::new(
            Opts::new(
                "bloomgate_requests_total",
                "Requests on guarded routes, by route and outcome.",
            ),
            &["route", "outcome"],
        )?;
        let request_duration = HistogramVec::new(
            HistogramOpts::new(
                "bloomgate_request_duration_seconds",
                "Time to answer a guarded request, by route and outcome.",
            )
            .buckets(LATENCY_BUCKETS.to_vec()),
            &["route", "outcome"],
        )?;
        let origin_duration = HistogramVec::new(
            HistogramOpts::new(
                "bloomgate_origin_duration_seconds",
                "Duration of origin calls (database lookups or upstream requests), by route.",
            )
            .buckets(LATENCY_BUCKETS.to_vec()),
            &["route"],
        )?;
        let filter_gauge =
            |name: &str, help: &str| IntGaugeVec::new(Opts::new(name, help), &["filter"]);
        let filter_items = filter_gauge(
            "bloomgate_filter_items",
            "Keys inserted into the live filter.",
        )?;
        let filter_capacity = filter_gauge(
            "bloomgate_filter_capacity",
            "Keys the live filter was sized for.",
        )?;
        let filter_bits =
            filter_gauge("bloomgate_filter_bits", "Size of the live filter in bits.")?;
        let filter_hashes = filter_gauge(
            "bloomgate_filter_hashes",
            "Hash probes per key in the live filter.",
        )?;
        let filter_ready = filter_gauge(
            "bloomgate_filter_ready",
            "1 when the filter is loaded and gating, 0 while requests fail open.",
        )?;
        let filter_fill_ratio = GaugeVec::new(
            Opts::new(
                "bloomgate_filter_fill_ratio",
                "Share of the live filter's bits that are set.",
            ),
            &["filter"],
        )?;
        let filter_estimated_fpp = GaugeVec::new(
            Opts::new(
                "bloomgate_filter_estimated_fpp",
                "False-positive rate estimated from the fill ratio (fill_ratio ^ hashes).",
            ),
            &["filter"],
        )?;
        let filter_last_sync = GaugeVec::new(
            Opts::new(
                "bloomgate_filter_last_sync_timestamp_seconds",
                "Unix time at which the live filter last finished loading keys from its source.",
            ),
            &["filter"],
        )?;
        let filter_last_build = GaugeVec::new(
            Opts::new(
                "bloomgate_filter_last_build_timestamp_seconds",
                "Unix time at which the live filter's last successful full build finished.",
            ),
            &["filter"],
        )?;
        let filter_loads = IntCounterVec::new(
            Opts::new(
                "bloomgate_filter_loads_total",
                "Full filter loads from the source query, by result.",
            ),
            &["filter", "result"],
        )?;
        let filter_load_duration = GaugeVec::new(
            Opts::new(
                "bloomgate_filter_load_duration_seconds",
                "Duration of the last successful full load.",
            ),
            &["filter"],
        )?;
        let filter_keys_skipped = IntCounterVec::new(
            Opts::new(
                "bloomgate_filter_keys_skipped_total",
                "Source rows whose key failed normalisation and was not inserted.",
            ),
            &["filter"],
        )?;
        let cache_entries = IntGaugeVec::new(
            Opts::new(
                "bloomgate_cache_entries",
                "Entries in the response cache (approximate), by kind.",
            ),
            &["kind"],
        )?;
        let passthrough = IntCounterVec::new(
            Opts::new(
                "bloomgate_passthrough_requests_total",
                "Requests on routes that are not guarded, by response status class.",
            ),
            &["status"],
        )?;
        let false_negatives = IntCounterVec::new(
            Opts::new(
                "bloomgate_false_negatives_total",
                "Keys the gate called absent that the origin found (shadow mode); must stay 0.",
            ),
            &["route"],
        )?;
        let capacity_rebuilds = IntCounterVec::new(
            Opts::new(
                "bloomgate_filter_capacity_rebuilds_total",
                "Rebuilds started because items exceeded capacity.",
            ),
            &["filter"],
        )?;
        let snapshot_loads = IntCounterVec::new(
            Opts::new(
                "bloomgate_filter_snapshot_loads_total",
                "Snapshots read at start-up, by result (ok or rejected).",
            ),
            &["filter", "result"],
        )?;
        let snapshot_writes = IntCounterVec::new(
            Opts::new(
                "bloomgate_filter_snapshot_writes_total",
                "Snapshots written after builds, by result.",
            ),
            &["filter", "result"],
        )?;
        let unconfirmed_keys = IntGaugeVec::new(
            Opts::new(
                "bloomgate_filter_unconfirmed_keys",
                "Admitted keys (sync, write-through, admin API) that no full build has read from its source yet; every build adds them again.",
            ),
            &["filter"],
        )?;
        let sync_lag = GaugeVec::new(
            Opts::new(
                "bloomgate_filter_sync_lag_seconds",
                "Freshness lag: now minus the newest change applied by incremental sync.",
            ),
            &["filter"],
        )?;
        let sync_keys = IntCounterVec::new(
            Opts::new(
                "bloomgate_filter_sync_keys_total",
                "Keys applied to the live filter by incremental sync.",
            ),
            &["filter"],
        )?;
        let sync_polls = IntCounterVec::new(
            Opts::new(
                "bloomgate_filter_sync_polls_total",
                "Incremental sync polls, by result.",
            ),
            &["filter", "result"],
        )?;
        let sync_open_gaps = IntGaugeVec::new(
            Opts::new(
                "bloomgate_filter_sync_open_gaps",
                "Id ranges that incremental sync skipped over and reads again until their rows appear or gap_timeout passes (integer watermarks).",
            ),
            &["filter"],
        )?;
        let sync_gaps_expired = IntCounterVec::new(
            Opts::new(
                "bloomgate_filter_sync_gaps_expired_total",
                "Sync gap ranges given up after gap_timeout without their rows appearing.",
            ),
            &["filter"],
        )?;
        let sync_gaps_dropped = IntCounterVec::new(
            Opts::new(
                "bloomgate_filter_sync_gaps_dropped_total",
                "Sync gap ranges dropped, oldest first, because too many were open.",
            ),
            &["filter"],
        )?;
        let write_through = IntCounterVec::new(
            Opts::new(
                "bloomgate_write_through_keys_total",
                "Keys added to a filter by successful writes passing through the proxy.",
            ),
            &["filter"],
        )?;
        let origin_errors = IntCounterVec::new(
            Opts::new(
                "bloomgate_origin_errors_total",
                "Origin calls that failed (timeout, connection or database error, unexpected status), by route.",
            ),
            &["route"],
        )?;
        let route_info = IntGaugeVec::new(
            Opts::new(
                "bloomgate_route_info",
                "Always 1 per guarded route; labels name the filter that gates it and its mode.",
            ),
            &["route", "filter", "mode"],
        )?;
        let filter_target_fpp = GaugeVec::new(
            Opts::new(
                "bloomgate_filter_target_fpp",
                "The configured false-positive rate the filter is sized for.",
            ),
            &["filter"],
        )?;
        let filter_sync_interval = GaugeVec::new(
            Opts::new(
                "bloomgate_filter_sync_interval_seconds",
                "The configured incremental sync interval; only filters with sync have it.",
            ),
            &["filter"],
        )?;
        let build_info = IntGaugeVec::new(
            Opts::new(
                "bloomgate_build_info",
                "Always 1; labels carry the version.",
            ),
            &["version"],
        )?;
        build_info
            .with_label_values(&[env!("CARGO_PKG_VERSION")])
            .set(1);

        registry.register(Box::new(requests.clone()))?;
        registry.register(Box::new(request_duration.clone()))?;
        registry.register(Box::new(origin_duration.clone()))?;
        registry.register(Box::new(filter_items.clone()))?;
        registry.register(Box::new(filter_capacity.clone()))?;
        registry.register(Box::new(filter_bits.clone()))?;
        registry.register(Box::new(filter_hashes.clone()))?;
        registry.register(Box::new(filter_fill_ratio.clone()))?;
        registry.register(Box::new(filter_estimated_fpp.clone()))?;
        registry.register(Box::new(filter_ready.clone()))?;
        registry.register(Box::new(filter_last_sync.clone()))?;
        registry.register(Box::new(filter_last_build.clone()))?;
        registry.register(Box::new(filter_loads.clone()))?;
        registry.register(Box::new(filter_load_duration.clone()))?;
        registry.register(Box::new(filter_keys_skipped.clone()))?;
        registry.register(Box::new(cache_entries.clone()))?;
        registry.register(Box::new(passthrough.clone()))?;
        registry.register(Box::new(false_negatives.clone()))?;
        registry.register(Box::new(capacity_rebuilds.clone()))?;
        registry.register(Box::new(snapshot_loads.clone()))?;
        registry.register(Box::new(snapshot_writes.clone()))?;
        registry.register(Box::new(sync_lag.clone()))?;
        registry.register(Box::new(unconfirmed_keys.clone()))?;
        registry.register(Box::new(sync_keys.clone()))?;
        registry.register(Box::new(sync_polls.clone()))?;
        registry.register(Box::new(sync_open_gaps.clone()))?;
        registry.register(Box::new(sync_gaps_expired.clone()))?;
        registry.register(Box::new(sync_gaps_dropped.clone()))?;
        registry.register(Box::new(write_through.clone()))?;
        registry.register(Box::new(origin_errors.clone()))?;
        registry.register(Box::new(route_info.clone()))?;
        registry.register(Box::new(filter_target_fpp.clone()))?;
        registry.register(Box::new(filter_sync_interval.clone()))?;
        registry.register(Box::new(build_info))?;
        #[cfg(target_os = "linux")]
        registry.register(Box::new(
            prometheus::process_collector::ProcessCollector::for_self(),
        ))?;

        Ok(Metrics {
            requests,
            request_duration,
            origin_duration,
            filter_items,
            filter_capacity,
            filter_bits,
            filter_hashes,
            filter_fill_ratio,
            filter_estimated_fpp,
            filter_ready,
            filter_last_sync,
            filter_last_build,
            filter_loads,
            filter_load_duration,
            filter_keys_skipped,
            cache_entries,
            passthrough,
            false_negatives,
            capacity_rebuilds,
            snapshot_loads,
            snapshot_writes,
            sync_lag,
            unconfirmed_keys,
            sync_keys,
            sync_polls,
            sync_open_gaps,
            sync_gaps_expired,
            sync_gaps_dropped,
            write_through,
            origin_errors,
            route_info,
            filter_target_fpp,
            filter_sync_interval,
        })
    }

    /// Resolves the handles for one route, gated by `filter` in `mode`; every outcome
    /// series exists from the start, so rates are 0 rather than absent before the first
    /// request.
    pub fn route(&self, route: &str, filter: &str, mode: &str) -> RouteMetrics {
        self.route_info
            .with_label_values(&[route, filter, mode])
            .set(1);
        RouteMetrics {
            requests: Outcome::ALL
                .iter()
                .map(|o| self.requests.with_label_values(&[route, o.as_str()]))
                .collect(),
            durations: Outcome::ALL
                .iter()
                .map(|o| {
                    self.request_duration
                        .with_label_values(&[route, o.as_str()])
                })
                .collect(),
            origin: self.origin_duration.with_label_values(&[route]),
            origin_errors: self.origin_errors.with_label_values(&[route]),
            false_negatives: self.false_negatives.with_label_values(&[route]),
        }
    }

    /// Resolves the handles for one filter sized for `target_fpp`, and publishes that
    /// target and the sync interval (if the filter has sync) for rules to compare with.
    pub fn filter(
        &self,
        filter: &str,
        target_fpp: f64,
        sync_interval: Option<Duration>,
    ) -> FilterMetrics {
        self.filter_target_fpp
            .with_label_values(&[filter])
            .set(target_fpp);
        if let Some(interval) = sync_interval {
            self.filter_sync_interval
                .with_label_values(&[filter])
                .set(interval.as_secs_f64());
        }
        FilterMetrics {
            items: self.filter_items.with_label_values(&[filter]),
            capacity: self.filter_capacity.with_label_values(&[filter]),
            bits: self.filter_bits.with_label_values(&[filter]),
            hashes: self.filter_hashes.with_label_values(&[filter]),
            fill_ratio: self.filter_fill_ratio.with_label_values(&[filter]),
            estimated_fpp: self.filter_estimated_fpp.with_label_values(&[filter]),
            ready: self.filter_ready.with_label_values(&[filter]),
            last_sync: self.filter_last_sync.with_label_values(&[filter]),
            last_build: self.filter_last_build.with_label_values(&[filter]),
            loads_ok: self.filter_loads.with_label_values(&[filter, "ok"]),
            loads_failed: self.filter_loads.with_label_values(&[filter, "error"]),
            load_duration: self.filter_load_duration.with_label_values(&[filter]),
            keys_skipped: self.filter_keys_skipped.with_label_values(&[filter]),
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
        }
    }

    /// Publishes the cache sizes.
    pub fn set_cache_entries(&self, positive: u64, negative: u64) {
        self.cache_entries
            .with_label_values(&["positive"])
            .set(clamp_i64(positive));
        self.cache_entries
            .with_label_values(&["negative"])
            .set(clamp_i64(negative));
    }

    /// Counter of keys added by write-through for one filter.
    pub fn write_through(&self, filter: &str) -> IntCounter {
        self.write_through.with_label_values(&[filter])
    }

    /// Handles for pass-through counting, one per status class.
    pub fn passthrough(&self) -> PassthroughMetrics {
        PassthroughMetrics {
            by_class: ["1xx", "2xx", "3xx", "4xx", "5xx"]
                .map(|c| self.passthrough.with_label_values(&[c])),
        }
    }
}

/// Counters for pass-through responses by status class.
#[derive(Clone)]
pub struct PassthroughMetrics {
    by_class: [IntCounter; 5],
}

impl PassthroughMetrics {
    /// Counts one pass-through response.
    pub fn observe(&self, status: u16) {
        let class = usize::from(status / 100).clamp(1, 5) - 1;
        self.by_class[class].inc();
    }
}
