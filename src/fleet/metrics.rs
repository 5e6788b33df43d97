//! The metric families of fleet mode: Redis reachability, each filter's role and
//! generation, the change stream's lag and traffic, lease changes, fallbacks and resets.
//! Registered only when `[fleet]` is configured.

use prometheus::{GaugeVec, IntCounterVec, IntGaugeVec, Registry};

use bloomgate_core::metrics::family;

/// The roles an instance can hold for a filter, as the `role` label says them.
pub const ROLES: [&str; 3] = ["builder", "follower", "standalone"];

/// The fleet families, registered together.
#[derive(Clone)]
pub struct FleetMetrics {
    redis_up: IntGaugeVec,
    role: IntGaugeVec,
    generation: IntGaugeVec,
    current_generation: IntGaugeVec,
    builder_present: IntGaugeVec,
    lag_entries: IntGaugeVec,
    lag_seconds: GaugeVec,
    lease_changes: IntCounterVec,
    fallbacks: IntCounterVec,
    resets: IntCounterVec,
    generations: IntCounterVec,
    entries: IntCounterVec,
}

impl FleetMetrics {
    /// Creates the families and registers them on `registry`.
    pub fn register(registry: &Registry) -> prometheus::Result<Self> {
        Ok(FleetMetrics {
            redis_up: family(
                registry,
                "bloomgate_fleet_redis_up",
                "1 while this instance reaches the fleet's Redis, else 0.",
                &[],
            )?,
            role: family(
                registry,
                "bloomgate_fleet_role",
                "1 for the role this instance holds for a filter (builder, follower, standalone).",
                &["filter", "role"],
            )?,
            generation: family(
                registry,
                "bloomgate_fleet_generation",
                "The shared generation this instance's filter was loaded from or published as (0: none).",
                &["filter"],
            )?,
            current_generation: family(
                registry,
                "bloomgate_fleet_current_generation",
                "The generation Redis names current, as this instance last read it.",
                &["filter"],
            )?,
            builder_present: family(
                registry,
                "bloomgate_fleet_builder_present",
                "1 while some instance holds the filter's builder lease, as this instance last read it.",
                &["filter"],
            )?,
            lag_entries: family(
                registry,
                "bloomgate_fleet_stream_lag_entries",
                "Change stream entries this instance has not applied yet (at most 1000 counted).",
                &[],
            )?,
            lag_seconds: family(
                registry,
                "bloomgate_fleet_stream_lag_seconds",
                "Age of the oldest change stream entry this instance has not applied yet.",
                &[],
            )?,
            lease_changes: family(
                registry,
                "bloomgate_fleet_lease_changes_total",
                "Builder leases this instance acquired, lost or released, by filter.",
                &["filter", "change"],
            )?,
            fallbacks: family(
                registry,
                "bloomgate_fleet_fallbacks_total",
                "Times this instance lost Redis and went on alone (own sync, own build if it had no filter).",
                &[],
            )?,
            resets: family(
                registry,
                "bloomgate_fleet_redis_resets_total",
                "Times this instance found Redis empty or older than it had seen it.",
                &[],
            )?,
            generations: family(
                registry,
                "bloomgate_fleet_generations_total",
                "Shared generations published, loaded, or refused (corrupt or implausible), by filter.",
                &["filter", "result"],
            )?,
            entries: family(
                registry,
                "bloomgate_fleet_stream_entries_total",
                "Change stream entries appended, applied, rejected (malformed) or dropped (outbox full).",
                &["direction"],
            )?,
        })
    }

    /// Sets whether Redis answers.
    pub fn set_redis_up(&self, up: bool) {
        self.redis_up
            .with_label_values::<&str>(&[])
            .set(i64::from(up));
    }

    /// Sets the role held for `filter` (one of [`ROLES`]).
    pub fn set_role(&self, filter: &str, role: &str) {
        for r in ROLES {
            self.role
                .with_label_values(&[filter, r])
                .set(i64::from(r == role));
        }
    }

    /// Sets the generation this instance serves for `filter`.
    pub fn set_generation(&self, filter: &str, generation: u64) {
        self.generation
            .with_label_values(&[filter])
            .set(bloomgate_core::metrics::clamp_i64(generation));
    }

    /// Sets the generation Redis names current for `filter`, and whether a builder holds
    /// its lease.
    pub fn set_current(&self, filter: &str, generation: u64, builder: bool) {
        self.current_generation
            .with_label_values(&[filter])
            .set(bloomgate_core::metrics::clamp_i64(generation));
        self.builder_present
            .with_label_values(&[filter])
            .set(i64::from(builder));
    }

    /// Sets the change stream lag.
    pub fn set_lag(&self, entries: u64, seconds: f64) {
        self.lag_entries
            .with_label_values::<&str>(&[])
            .set(bloomgate_core::metrics::clamp_i64(entries));
        self.lag_seconds.with_label_values::<&str>(&[]).set(seconds);
    }

    /// Counts a lease change (`acquired`, `lost`, `released`).
    pub fn lease_change(&self, filter: &str, change: &str) {
        self.lease_changes
            .with_label_values(&[filter, change])
            .inc();
    }

    /// Counts a fallback to standalone behaviour.
    pub fn fallback(&self) {
        self.fallbacks.with_label_values::<&str>(&[]).inc();
    }

    /// Counts a detected Redis reset.
    pub fn reset(&self) {
        self.resets.with_label_values::<&str>(&[]).inc();
    }

    /// Counts a generation `published`, `loaded` or `refused`.
    pub fn generation(&self, filter: &str, result: &str) {
        self.generations.with_label_values(&[filter, result]).inc();
    }

    /// Counts `n` stream entries in `direction`.
    pub fn entries(&self, direction: &str, n: u64) {
        self.entries.with_label_values(&[direction]).inc_by(n);
    }
}
