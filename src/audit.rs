//! The gate audits itself: a small sample of the keys the gate refuses is checked
//! against their origin in the background, to prove in production what shadow mode
//! proves before rollout, that the gate refuses no key that exists. A key the origin has
//! is admitted at once and judged later: a false negative, or the documented sync lag.
//!
//! - `sampler`: on the request path; picks refused keys (a rate, a per-second bound)
//!   and queues them without waiting.
//! - `check`: the background task that asks the origin, admits what it finds, and
//!   judges it once sync has covered the refusal.
//! - `ledger`: the keys waiting for their decision, marked when another admission
//!   brings them in.
//! - `metrics`: its families.
//!
//! It adds keys only through `Admit`, and it does not change what a request is answered.

pub mod check;
pub mod ledger;
pub mod metrics;
pub mod sampler;

use std::sync::Arc;

use prometheus::Registry;
use tokio::sync::mpsc;

pub use check::Auditor;
pub use ledger::Ledger;
pub use metrics::AuditMetrics;
pub use sampler::{Sample, Sampler};

use bloomgate_core::config::AuditConfig;
use ledger::MAX_WAITING;
use metrics::DropReason;

/// The audit's parts, made together: the sampler goes to the request path, the ledger to
/// `Admit` as its watcher, and the auditor runs in the background.
pub struct Audit {
    /// For the proxy's intercept point.
    pub sampler: Sampler,
    /// For `Admit::with_watcher`.
    pub ledger: Arc<Ledger>,
    /// The background task, to run with the app.
    pub auditor: Auditor,
}

impl Audit {
    /// The audit `config` asks for over the guarded routes labelled `routes`, its
    /// metrics registered on `registry`; `None` when it is off. `fleet`: the instance
    /// belongs to a fleet (see `check` for what that changes).
    pub fn new<'a>(
        config: &AuditConfig,
        routes: impl IntoIterator<Item = &'a str>,
        fleet: bool,
        registry: &Registry,
    ) -> prometheus::Result<Option<Audit>> {
        if !config.enabled {
            return Ok(None);
        }
        let metrics = AuditMetrics::register(registry, routes)?;
        let (queue, samples) = mpsc::channel(config.queue);
        let ledger = Arc::new(Ledger::new(
            MAX_WAITING,
            metrics.dropped(DropReason::LedgerFull),
        ));
        Ok(Some(Audit {
            sampler: Sampler::new(config.rate, config.max_per_second, queue, &metrics),
            auditor: Auditor::new(samples, Arc::clone(&ledger), metrics, fleet),
            ledger,
        }))
    }
}

#[cfg(test)]
mod tests;
