//! The metric families of guarded routes (requests by outcome, latency, origin calls,
//! false negatives) and the handles one route resolves once at start-up, so that a
//! request only increments.

use std::time::Duration;

use prometheus::{Histogram, HistogramVec, IntCounter, IntCounterVec, IntGaugeVec, Registry};

use crate::pipeline::outcome::Outcome;
use bloomgate_core::metrics::family;
use bloomgate_core::metrics::timed::{Timed, TimedVec};

/// The route families, registered together.
#[derive(Clone)]
pub struct RouteFamilies {
    /// `bloomgate_requests_total` and `bloomgate_request_duration_seconds`: every
    /// guarded request is counted and timed once, on its serving thread's cells.
    requests: TimedVec,
    origin_duration: HistogramVec,
    false_negatives: IntCounterVec,
    origin_errors: IntCounterVec,
    route_info: IntGaugeVec,
}

impl RouteFamilies {
    /// Creates the families and registers them on `registry`.
    pub fn register(registry: &Registry) -> prometheus::Result<Self> {
        Ok(RouteFamilies {
            requests: TimedVec::register(
                registry,
                (
                    "bloomgate_requests_total",
                    "Requests on guarded routes, by route and outcome.",
                ),
                (
                    "bloomgate_request_duration_seconds",
                    "Time to answer a guarded request, by route and outcome.",
                ),
                &["route", "outcome"],
            )?,
            origin_duration: family(
                registry,
                "bloomgate_origin_duration_seconds",
                "Duration of origin calls (database lookups or upstream requests), by route.",
                &["route"],
            )?,
            false_negatives: family(
                registry,
                "bloomgate_false_negatives_total",
                "Keys the gate called absent that the origin found (shadow mode); must stay 0.",
                &["route"],
            )?,
            origin_errors: family(
                registry,
                "bloomgate_origin_errors_total",
                "Origin calls that failed (timeout, connection or database error, unexpected status), by route.",
                &["route"],
            )?,
            route_info: family(
                registry,
                "bloomgate_route_info",
                "Always 1 per guarded route; labels name the filter that gates it and its mode.",
                &["route", "filter", "mode"],
            )?,
        })
    }

    /// Resolves the handles for one route, guarded by `filter` in `mode`; every outcome
    /// series exists from the start, so rates are 0 rather than absent before the first
    /// request.
    pub fn handles(&self, route: &str, filter: &str, mode: &str) -> RouteMetrics {
        self.route_info
            .with_label_values(&[route, filter, mode])
            .set(1);
        RouteMetrics {
            requests: Outcome::ALL
                .iter()
                .map(|o| self.requests.with_label_values(&[route, o.as_str()]))
                .collect(),
            origin: self.origin_duration.with_label_values(&[route]),
            origin_errors: self.origin_errors.with_label_values(&[route]),
            false_negatives: self.false_negatives.with_label_values(&[route]),
        }
    }
}

/// Label handles for one route, resolved once.
#[derive(Clone)]
pub struct RouteMetrics {
    requests: Vec<Timed>,
    origin: Histogram,
    origin_errors: IntCounter,
    false_negatives: IntCounter,
}

impl RouteMetrics {
    /// Counts a finished request and its latency.
    pub fn observe(&self, outcome: Outcome, elapsed: Duration) {
        self.requests[outcome.index()].observe(elapsed);
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

/// Counters for pass-through responses by status class.
#[derive(Clone)]
pub struct PassthroughMetrics {
    by_class: [IntCounter; 5],
}

impl PassthroughMetrics {
    /// Resolves the handle of each status class of `family` (labelled by `status`).
    pub fn new(family: &IntCounterVec) -> PassthroughMetrics {
        PassthroughMetrics {
            by_class: ["1xx", "2xx", "3xx", "4xx", "5xx"].map(|c| family.with_label_values(&[c])),
        }
    }

    /// Counts one pass-through response.
    pub fn observe(&self, status: u16) {
        let class = usize::from(status / 100).clamp(1, 5) - 1;
        self.by_class[class].inc();
    }
}
