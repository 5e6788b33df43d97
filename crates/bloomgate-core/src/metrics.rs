//! The toolkit every metric family of bloomgate is made with: a family is declared with
//! one call to [`family`] on a registry that is passed in (never the global one), so
//! several proxies can live in one process; latency histograms share one set of buckets;
//! [`unix_now`] stamps the `*_timestamp_seconds` gauges. The families themselves live
//! beside what they count (`gate::metrics`, `origin::metrics`, `pipeline::metrics`,
//! `fleet::metrics`, `reload::metrics`, `audit::metrics`, `server::metrics`), and
//! `stages::metrics` registers them all. It does not serve `/metrics` (see `admin`).

use std::time::{SystemTime, UNIX_EPOCH};

use prometheus::core::Collector;
use prometheus::{
    GaugeVec, HistogramOpts, HistogramVec, IntCounterVec, IntGaugeVec, Opts, Registry,
};

pub mod timed;

/// Upper bounds of the request latency buckets, in nanoseconds: from 50 µs (an
/// intercepted request) to 10 s.
const LATENCY_BOUNDS_NS: [u64; 17] = [
    50_000,
    100_000,
    250_000,
    500_000,
    1_000_000,
    2_500_000,
    5_000_000,
    10_000_000,
    25_000_000,
    50_000_000,
    100_000_000,
    250_000_000,
    500_000_000,
    1_000_000_000,
    2_500_000_000,
    5_000_000_000,
    10_000_000_000,
];

/// The latency buckets in seconds, as histograms show them (each the double nearest to
/// its bound: an integer division is correctly rounded).
fn latency_buckets() -> Vec<f64> {
    #[allow(clippy::cast_precision_loss)]
    LATENCY_BOUNDS_NS
        .iter()
        .map(|ns| *ns as f64 / 1e9)
        .collect()
}

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
            HistogramOpts::new(name, help).buckets(latency_buckets()),
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

/// A count as a gauge value, saturating at `i64::MAX`.
pub fn clamp_i64(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

/// Seconds since the Unix epoch, as the `*_timestamp_seconds` gauges show them (0 if the
/// clock reads before 1970).
pub fn unix_now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}
