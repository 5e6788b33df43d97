//! Every Prometheus metric bloomgate exports, registered on a registry that is passed in
//! (never the global one), so several proxies can live in one process. Per-route label
//! handles are resolved once at start-up: the request path only increments. It does not
//! serve `/metrics` (see `admin`).

mod filter;
mod fleet;
mod origin;
mod reload;
mod route;

use prometheus::core::Collector;
use prometheus::{
    GaugeVec, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGaugeVec, Opts, Registry,
};

pub use filter::{FilterFamilies, FilterMetrics};
pub use fleet::FleetMetrics;
pub use origin::{OriginFamilies, OriginMetrics};
pub use reload::{ReloadMetrics, ReloadResult};
pub use route::{RouteFamilies, RouteMetrics};

/// Histogram buckets for request latency: from 50 µs (an intercepted request) to 10 s.
const LATENCY_BUCKETS: &[f64] = &[
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
    2.5, 5.0, 10.0,
];

/// A metric family that can be made from a name, a help text and label names.
pub trait Family: Collector + Clone + Sized + 'static {
    /// Makes the family (not registered yet).
    fn make(name: &str, help: &str, labels: &[&str]) -> prometheus::Result<Self>;
}

impl Family for IntCounterVec {
    fn make(name: &str, help: &str, labels: &[&str]) -> prometheus::Result<Self> {
        IntCounterVec::new(Opts::new(name, help), labels)
    }
}

impl Family for IntGaugeVec {
    fn make(name: &str, help: &str, labels: &[&str]) -> prometheus::Result<Self> {
        IntGaugeVec::new(Opts::new(name, help), labels)
    }
}

impl Family for GaugeVec {
    fn make(name: &str, help: &str, labels: &[&str]) -> prometheus::Result<Self> {
        GaugeVec::new(Opts::new(name, help), labels)
    }
}

/// Latency histograms: every histogram bloomgate exports measures a duration.
impl Family for HistogramVec {
    fn make(name: &str, help: &str, labels: &[&str]) -> prometheus::Result<Self> {
        HistogramVec::new(
            HistogramOpts::new(name, help).buckets(LATENCY_BUCKETS.to_vec()),
            labels,
        )
    }
}

/// Makes a family and registers it on `registry`: declaring a metric is this one call.
pub fn family<F: Family>(
    registry: &Registry,
    name: &str,
    help: &str,
    labels: &[&str],
) -> prometheus::Result<F> {
    let f = F::make(name, help, labels)?;
    registry.register(Box::new(f.clone()))?;
    Ok(f)
}

/// Every metric family, by concern.
#[derive(Clone)]
pub struct Metrics {
    /// Guarded routes.
    pub routes: RouteFamilies,
    /// Filters.
    pub filters: FilterFamilies,
    /// Origins (the database, the upstream).
    pub origins: OriginFamilies,
    /// Configuration reloads.
    pub reload: ReloadMetrics,
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
            reload: ReloadMetrics::register(registry)?,
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

fn clamp_i64(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}
