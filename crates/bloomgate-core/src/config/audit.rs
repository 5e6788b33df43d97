//! The `[audit]` table: how many of the keys the gate refuses are checked against their
//! origin afterwards (see `crate::audit`), and the rules its values must keep.

use serde::{Deserialize, Serialize};

use super::validate::Problems;

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

impl AuditConfig {
    /// Records every rule these settings break. Checked whether or not the audit is
    /// enabled, so that turning it on never meets a value that was refused later.
    pub(super) fn check(&self, p: &mut Problems) {
        if !(0.0..=1.0).contains(&self.rate) {
            p.add(
                "audit.rate",
                "must be between 0 and 1 (0.001 checks one refusal in a thousand)",
            );
        }
        if !(1..=10_000).contains(&self.max_per_second) {
            p.add("audit.max_per_second", "must be between 1 and 10000");
        }
        if !(1..=65_536).contains(&self.queue) {
            p.add("audit.queue", "must be between 1 and 65536");
        }
    }
}
