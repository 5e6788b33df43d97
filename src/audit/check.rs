//! The audit's background task: asks the origin about each sampled key, admits at once a
//! key the origin has (so the next request for it is served), and later judges whether
//! its refusal was a false negative or the documented sync lag. It never answers a
//! request and never delays one.
//!
//! A found key is judged once sync has had its chance: on an instance that syncs the
//! filter, once a sync poll that started at least `sync.overlap` after the origin
//! answered has succeeded (the watermark alone cannot tell: it moves only when rows
//! change); on a fleet follower, which does not sync, once `overlap + 2 × interval` and
//! a grace have passed since then, for the builder's poll to reach it through the
//! stream. If no admission but the audit's own brought the key in by then, it is a
//! false negative. Keys of filters without sync are admitted and counted as found, never
//! judged: without sync, a key created after the build is refused until the next one.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::mpsc;
use tokio::time::MissedTickBehavior;

use super::ledger::{Ledger, Ticket, Watch};
use super::metrics::{AuditMetrics, CheckResult};
use super::sampler::Sample;
use crate::gate::Verdict;
use crate::gate::admit::{Admit, Forget};
use crate::origin::{Fetched, OriginError};
use bloomgate_core::key::{KeyBytes, OwnedKey};
use bloomgate_core::report::Chain;

/// How often the found keys are looked at for a decision.
const DECIDE_EVERY: Duration = Duration::from_millis(250);

/// On a fleet follower: how long past `overlap + 2 × interval` the builder's sync and
/// the change stream get before a found key is judged.
pub const FLEET_GRACE: Duration = Duration::from_secs(5);

/// Most false-negative keys remembered, so that each is logged once.
const LOGGED_LIMIT: usize = 4096;

/// The background check. Runs until its queue closes.
pub struct Auditor {
    queue: mpsc::Receiver<Sample>,
    ledger: Arc<Ledger>,
    metrics: AuditMetrics,
    /// Whether this instance belongs to a fleet (it may be a follower that never syncs).
    fleet: bool,
    /// False-negative keys already logged, by filter.
    logged: HashSet<(Arc<str>, OwnedKey)>,
}

impl Auditor {
    /// Reads samples from `queue`; `ledger` is the watcher that `Admit` tells.
    pub fn new(
        queue: mpsc::Receiver<Sample>,
        ledger: Arc<Ledger>,
        metrics: AuditMetrics,
        fleet: bool,
    ) -> Auditor {
        Auditor {
            queue,
            ledger,
            metrics,
            fleet,
            logged: HashSet::new(),
        }
    }

    /// Checks samples as they come and judges found keys as their time comes.
    pub async fn run(mut self, admit: Arc<Admit>) {
        let mut decide = tokio::time::interval(DECIDE_EVERY);
        decide.set_missed_tick_behavior(MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                sample = self.queue.recv() => match sample {
                    Some(sample) => self.check(&admit, sample).await,
                    None => return,
                },
                _ = decide.tick() => self.decide(Instant::now()),
            }
        }
    }

    /// Asks the origin about one refused key; admits it if the origin has it.
    async fn check(&mut self, admit: &Admit, s: Sample) {
        let judged = s.filter.config().sync.is_some();
        let ticket = if judged {
            match self.ledger.watch(&s.route, &s.filter, &s.key) {
                Some(ticket) => Some(ticket),
                // Already being checked or waiting for its decision.
                None => return,
            }
        } else {
            None
        };
        // Watched first, then looked at: an admission from now on reaches the ledger,
        // and one since the refusal moved the key's stripe and set its bits.
        if let Some(ticket) = ticket
            && s.filter.admitted_since(&s.mark)
            && s.filter.check(KeyBytes::new().of(&s.key.as_norm())) != Verdict::Absent
        {
            self.ledger.bring_in(ticket);
        }
        let fetched = s.origin.fetch(&s.key, None).await;
        let result = match &fetched {
            Ok(Fetched::Found(_)) => CheckResult::Found,
            Ok(Fetched::NotFound) => CheckResult::Absent,
            Err(_) => CheckResult::Error,
        };
        self.metrics.checked(&s.route, result);
        match fetched {
            Ok(Fetched::Found(_)) => {
                let at = Instant::now();
                admit
                    .admit_unwatched(&s.filter, std::slice::from_ref(&s.key), Forget::Absence)
                    .await;
                tracing::info!(route = %s.route, filter = s.filter.name(), key = %s.key,
                    refused_ms_ago = s.refused_at.elapsed().as_millis() as u64,
                    "audit: the origin has a key the gate refused; admitted it");
                if let Some(ticket) = ticket {
                    self.ledger.found(ticket, at);
                }
            }
            Ok(Fetched::NotFound) => self.forget(ticket),
            Err(e) => {
                log_error(&s, &e);
                self.forget(ticket);
            }
        }
        self.metrics.set_pending(self.ledger.len());
    }

    fn forget(&self, ticket: Option<Ticket>) {
        if let Some(ticket) = ticket {
            self.ledger.forget(ticket);
        }
    }

    /// Judges every found key whose time has come.
    fn decide(&mut self, now: Instant) {
        let fleet = self.fleet;
        for watch in self.ledger.take_ready(|w| due(w, now, fleet)) {
            if watch.brought_in {
                tracing::debug!(route = %watch.route, filter = watch.filter.name(), key = %watch.key,
                    "audit: another admission brought the key in; the sync lag, not a false negative");
                self.metrics.sync_lag(&watch.route);
            } else {
                self.false_negative(&watch);
            }
        }
        self.metrics.set_pending(self.ledger.len());
    }

    fn false_negative(&mut self, w: &Watch) {
        self.metrics.false_negative(&w.route);
        let name: Arc<str> = Arc::from(w.filter.name());
        if self.logged.len() < LOGGED_LIMIT && self.logged.insert((name, w.key.clone())) {
            tracing::error!(route = %w.route, filter = w.filter.name(), key = %w.key,
                "audit: false negative: the gate refused a key the origin has, and sync had not brought it in once it covered the refusal");
        }
    }
}

/// Whether `w`'s decision is due at `now`; see the module's comment.
pub(super) fn due(w: &Watch, now: Instant, fleet: bool) -> bool {
    let (Some(found_at), Some(sync)) = (w.found_at, &w.filter.config().sync) else {
        return true;
    };
    let covered = found_at + sync.overlap;
    w.filter.synced_since(covered) || (fleet && now >= covered + sync.interval * 2 + FLEET_GRACE)
}

fn log_error(s: &Sample, e: &OriginError) {
    tracing::debug!(route = %s.route, filter = s.filter.name(), key = %s.key, error = %Chain(e),
        "audit: the origin could not be asked about a refused key");
}
