//! Every metric family bloomgate exports, registered together on one registry: the
//! families of each stage (made beside the stage, see `bloomgate_core::metrics`) and the few that
//! count the process as a whole (cache sizes, pass-through, write-through, the access
//! log, the runtime). Per-route label handles are resolved once at start-up: the request
//! path only increments.

use prometheus::{IntCounter, IntCounterVec, IntGaugeVec, Registry};

use crate::gate::metrics::FilterFamilies;
use crate::origin::metrics::OriginFamilies;
use crate::pipeline::metrics::{PassthroughMetrics, RouteFamilies};
use bloomgate_core::metrics::{clamp_i64, family};

/// Every metric family, by concern.
#[derive(Clone)]
pub struct Metrics {
    /// Guarded routes.
    pub routes: RouteFamilies,
    /// Filters.
    pub filters: FilterFamilies,
    /// Origins (the database, the upstream).
    pub origins: OriginFamilies,
    cache_entries: IntGaugeVec,
    cache_bytes: IntGaugeVec,
    passthrough: IntCounterVec,
    write_through: IntCounterVec,
    access_log_lines: IntCounterVec,
    runtime: IntGaugeVec,
}

impl Metrics {
    /// Creates every family and registers it on `registry`.
    pub fn new(registry: &Registry) -> prometheus::Result<Metrics> {
        let build_info: IntGaugeVec = family(
            registry,
            "bloomgate_build_info",
            "Always 1; labels carry the version.",
            &["version"],
        )?;
        build_info
            .with_label_values(&[env!("CARGO_PKG_VERSION")])
            .set(1);
        #[cfg(target_os = "linux")]
        registry.register(Box::new(
            prometheus::process_collector::ProcessCollector::for_self(),
        ))?;
        Ok(Metrics {
            routes: RouteFamilies::register(registry)?,
            filters: FilterFamilies::register(registry)?,
            origins: OriginFamilies::register(registry)?,
            cache_entries: family(
                registry,
                "bloomgate_cache_entries",
                "Entries in the response cache (approximate), by kind.",
                &["kind"],
            )?,
            cache_bytes: family(
                registry,
                "bloomgate_cache_bytes",
                "Estimated bytes of the response cache's entries, by kind, as its byte bound \
                 (cache.max_bytes, cache.negative_max_bytes) counts them; only for a kind \
                 bounded in bytes.",
                &["kind"],
            )?,
            passthrough: family(
                registry,
                "bloomgate_passthrough_requests_total",
                "Requests on routes that are not guarded, by response status class.",
                &["status"],
            )?,
            write_through: family(
                registry,
                "bloomgate_write_through_keys_total",
                "Keys added to a filter by successful writes passing through the proxy.",
                &["filter"],
            )?,
            runtime: family(
                registry,
                "bloomgate_runtime",
                "The async runtime at the last scrape: alive_tasks (tasks not finished yet: connections, requests, background work) and workers.",
                &["kind"],
            )?,
            access_log_lines: family(
                registry,
                "bloomgate_access_log_lines_total",
                "Access log lines: queued (the request was sampled), written, or dropped because the writer was behind.",
                &["result"],
            )?,
        })
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

    /// Publishes the estimated cache bytes of each kind bounded in bytes.
    pub fn set_cache_bytes(&self, (positive, negative): (Option<u64>, Option<u64>)) {
        for (kind, bytes) in [("positive", positive), ("negative", negative)] {
            if let Some(b) = bytes {
                self.cache_bytes
                    .with_label_values(&[kind])
                    .set(clamp_i64(b));
            }
        }
    }

    /// Publishes the runtime's task and worker counts.
    pub fn set_runtime(&self, alive_tasks: usize, workers: usize) {
        for (kind, n) in [("alive_tasks", alive_tasks), ("workers", workers)] {
            self.runtime
                .with_label_values(&[kind])
                .set(clamp_i64(n as u64));
        }
    }

    /// Counters of access log lines: `queued`, `written`, `dropped`.
    pub fn access_log_lines(&self) -> [IntCounter; 3] {
        ["queued", "written", "dropped"].map(|r| self.access_log_lines.with_label_values(&[r]))
    }

    /// Counter of keys added by write-through for one filter.
    pub fn write_through(&self, filter: &str) -> IntCounter {
        self.write_through.with_label_values(&[filter])
    }

    /// Handles for pass-through counting, one per status class.
    pub fn passthrough(&self) -> PassthroughMetrics {
        PassthroughMetrics::new(&self.passthrough)
    }
}
