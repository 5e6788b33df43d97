//! How much each origin (the database, the upstream) is asked at once and when it counts
//! as failing: the `[database.breaker]` / `[upstream.breaker]` tables, the bound on
//! lookups in flight, and their defaults resolved into one [`OriginLimits`].

use std::time::Duration;

use serde::{Deserialize, Serialize};

/// How many calls an origin takes at once, how many wait, and its breaker.
#[derive(Debug, Clone)]
pub struct OriginLimits {
    /// Most calls in flight.
    pub max_in_flight: usize,
    /// Most calls waiting for a slot.
    pub max_queued: usize,
    /// Longest wait for a slot.
    pub queue_timeout: Duration,
    /// The breaker.
    pub breaker: BreakerConfig,
}

impl OriginLimits {
    pub(super) fn resolve(
        max_in_flight: usize,
        max_queued: Option<usize>,
        queue_timeout: Duration,
        breaker: &BreakerConfig,
    ) -> OriginLimits {
        OriginLimits {
            max_in_flight,
            max_queued: max_queued.unwrap_or(max_in_flight.saturating_mul(4)),
            queue_timeout,
            breaker: breaker.clone(),
        }
    }
}

pub(super) fn default_queue_timeout() -> Duration {
    Duration::from_millis(100)
}

/// When an origin counts as failing, and for how long it is then left alone.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct BreakerConfig {
    /// `false` turns the breaker off: every call waits on the origin.
    pub enabled: bool,
    /// Open after this many failed calls in a row.
    pub consecutive_failures: u32,
    /// Or open once this share of the calls within `window` failed...
    pub failure_ratio: f64,
    /// ...and the window holds at least this many calls.
    pub min_calls: u32,
    /// The span over which the failure ratio is measured.
    #[serde(with = "humantime_serde")]
    pub window: Duration,
    /// How long it stays open before one probe call is let through.
    #[serde(with = "humantime_serde")]
    pub open_for: Duration,
}

impl Default for BreakerConfig {
    fn default() -> Self {
        BreakerConfig {
            enabled: true,
            consecutive_failures: 5,
            failure_ratio: 0.5,
            min_calls: 20,
            window: Duration::from_secs(10),
            open_for: Duration::from_secs(5),
        }
    }
}
