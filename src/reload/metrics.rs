//! The metric families of configuration reloads: how each ended, and whether the last one
//! was applied (for an alert on a file that stopped loading).

use prometheus::{Gauge, IntCounterVec, IntGauge, Registry};

use bloomgate_core::metrics::family;

/// How a reload ended, as counted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReloadResult {
    /// Applied.
    Ok,
    /// The file could not be read or broke a rule; nothing changed.
    Invalid,
    /// The file changes settings that only a restart applies; nothing changed.
    NeedsRestart,
    /// Applying failed (an access log path that cannot be opened); nothing changed.
    Failed,
}

impl ReloadResult {
    /// Label value.
    pub fn as_str(self) -> &'static str {
        match self {
            ReloadResult::Ok => "ok",
            ReloadResult::Invalid => "invalid",
            ReloadResult::NeedsRestart => "needs_restart",
            ReloadResult::Failed => "failed",
        }
    }
}

/// The reload families, registered together.
#[derive(Clone)]
pub struct ReloadMetrics {
    reloads: IntCounterVec,
    last_successful: IntGauge,
    last_success: Gauge,
}

impl ReloadMetrics {
    /// Creates the families and registers them on `registry`; the start counts as a
    /// successful load.
    pub fn register(registry: &Registry) -> prometheus::Result<Self> {
        let reloads: IntCounterVec = family(
            registry,
            "bloomgate_config_reloads_total",
            "Configuration reloads (SIGHUP or POST /admin/reload), by result: ok, invalid, needs_restart, failed.",
            &["result"],
        )?;
        for r in [
            ReloadResult::Ok,
            ReloadResult::Invalid,
            ReloadResult::NeedsRestart,
            ReloadResult::Failed,
        ] {
            reloads.with_label_values(&[r.as_str()]);
        }
        let last_successful = IntGauge::new(
            "bloomgate_config_last_reload_successful",
            "1 if the last configuration reload was applied (or none was tried), 0 if it was refused.",
        )?;
        registry.register(Box::new(last_successful.clone()))?;
        let last_success = Gauge::new(
            "bloomgate_config_last_reload_success_timestamp_seconds",
            "Unix time the configuration in force was loaded (start-up or the last applied reload).",
        )?;
        registry.register(Box::new(last_success.clone()))?;
        last_successful.set(1);
        last_success.set(bloomgate_core::metrics::unix_now());
        Ok(ReloadMetrics {
            reloads,
            last_successful,
            last_success,
        })
    }

    /// Counts a reload that ended with `result`.
    pub fn record(&self, result: ReloadResult) {
        self.reloads.with_label_values(&[result.as_str()]).inc();
        let ok = result == ReloadResult::Ok;
        self.last_successful.set(i64::from(ok));
        if ok {
            self.last_success.set(bloomgate_core::metrics::unix_now());
        }
    }
}
