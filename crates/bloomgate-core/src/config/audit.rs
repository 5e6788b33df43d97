//! The `[audit]` table: how many of the keys the gate refuses are checked against their
//! origin afterwards (see `crate::audit`); its rules are checked in `validate`.

use serde::{Deserialize, Serialize};

/// The gate's self-audit: a sample of refused keys, asked of the origin in the background.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AuditConfig {
    /// `false` turns the audit off: no refused key is sampled.
    pub enabled: bool,
    /// The share of intercepted requests whose key is checked, in [0, 1].
    pub rate: f64,
    /// Most keys sampled per second across all routes; past it, samples are dropped
    /// (counted), so a flood of absent keys cannot turn into a flood of origin calls.
    pub max_per_second: u32,
    /// Sampled keys waiting for the background check; past it, samples are dropped
    /// (counted) rather than making a request wait.
    pub queue: usize,
}

impl Default for AuditConfig {
    fn default() -> Self {
        AuditConfig {
            enabled: true,
            rate: 0.001,
            max_per_second: 10,
            queue: 256,
        }
    }
}
