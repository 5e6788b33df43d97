//! The metric families of the origins (the database, the upstream): the circuit breaker's
//! state and transitions, calls refused without reaching the origin, and the calls in
//! flight and waiting for a slot.

use prometheus::{IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Registry};

use crate::origin::breaker::BreakerState;
use bloomgate_core::metrics::family;

/// The origin families, registered together.
#[derive(Clone)]
pub struct OriginFamilies {
    state: IntGaugeVec,
    transitions: IntCounterVec,
    refused: IntCounterVec,
    calls: IntCounterVec,
    in_flight: IntGaugeVec,
    queued: IntGaugeVec,
}

impl OriginFamilies {
    /// Creates the families and registers them on `registry`.
    pub fn register(registry: &Registry) -> prometheus::Result<Self> {
        Ok(OriginFamilies {
            state: family(
                registry,
                "bloomgate_origin_breaker_state",
                "1 for the state the origin's circuit breaker is in (closed, open, half_open).",
                &["origin", "state"],
            )?,
            transitions: family(
                registry,
                "bloomgate_origin_breaker_transitions_total",
                "Moves of the origin's circuit breaker, by the state moved to.",
                &["origin", "to"],
            )?,
            refused: family(
                registry,
                "bloomgate_origin_refused_total",
                "Origin calls answered at once without reaching the origin: breaker open (circuit_open), queue full or wait for a slot too long.",
                &["origin", "reason"],
            )?,
            calls: family(
                registry,
                "bloomgate_origin_calls_total",
                "Origin calls made, by result: success (any answer) or failure (timeout, unreachable, 5xx), as the breaker counts them.",
                &["origin", "result"],
            )?,
            in_flight: family(
                registry,
                "bloomgate_origin_in_flight",
                "Origin calls in flight now.",
                &["origin"],
            )?,
            queued: family(
                registry,
                "bloomgate_origin_queued",
                "Origin calls waiting for a free slot now.",
                &["origin"],
            )?,
        })
    }

    /// The handles of origin `origin`; every series exists from the start.
    pub fn handles(&self, origin: &str) -> OriginMetrics {
        OriginMetrics {
            state: BreakerState::ALL.map(|s| self.state.with_label_values(&[origin, s.as_str()])),
            transitions: BreakerState::ALL
                .map(|s| self.transitions.with_label_values(&[origin, s.as_str()])),
            refused: ["circuit_open", "queue_full", "queue_timeout"]
                .map(|r| self.refused.with_label_values(&[origin, r])),
            calls: ["success", "failure"].map(|r| self.calls.with_label_values(&[origin, r])),
            in_flight: self.in_flight.with_label_values(&[origin]),
            queued: self.queued.with_label_values(&[origin]),
        }
    }
}

/// The series of one origin.
#[derive(Clone)]
pub struct OriginMetrics {
    state: [IntGauge; 3],
    transitions: [IntCounter; 3],
    refused: [IntCounter; 3],
    calls: [IntCounter; 2],
    in_flight: IntGauge,
    queued: IntGauge,
}

impl OriginMetrics {
    /// Marks `state` as the breaker's state.
    pub fn set_state(&self, state: BreakerState) {
        for (s, g) in BreakerState::ALL.iter().zip(&self.state) {
            g.set(i64::from(*s == state));
        }
    }

    /// Counts a move to `to` and marks it as the state.
    pub fn transition(&self, to: BreakerState) {
        let i = BreakerState::ALL.iter().position(|s| *s == to).unwrap_or(0);
        self.transitions[i].inc();
        self.set_state(to);
    }

    /// Counts a refused call (`circuit_open`, `queue_full`, `queue_timeout`).
    pub fn refused(&self, reason: &str) {
        let i = match reason {
            "circuit_open" => 0,
            "queue_full" => 1,
            _ => 2,
        };
        self.refused[i].inc();
    }

    /// Counts a call made: a `failure` (as the breaker counts them) or a `success`.
    pub fn call(&self, failed: bool) {
        self.calls[usize::from(failed)].inc();
    }

    /// Moves the in-flight gauge by `by`.
    pub fn in_flight(&self, by: i64) {
        self.in_flight.add(by);
    }

    /// Moves the queued gauge by `by`.
    pub fn queued(&self, by: i64) {
        self.queued.add(by);
    }
}
