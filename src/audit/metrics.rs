//! The audit's metric families, registered where the audit is built: checks by result,
//! false negatives, keys that sync brought in (the documented lag), samples dropped and
//! keys waiting for their decision.

use prometheus::{IntCounter, IntCounterVec, IntGauge, Registry};

use bloomgate_core::metrics::family;

/// What the origin said about a sampled key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CheckResult {
    /// The origin does not have it: the refusal was right.
    Absent,
    /// The origin has it: it was admitted at once, and is decided later.
    Found,
    /// The origin could not be asked (an error, a timeout, its breaker open).
    Error,
}

impl CheckResult {
    /// Label value.
    pub fn as_str(self) -> &'static str {
        match self {
            CheckResult::Absent => "absent",
            CheckResult::Found => "found",
            CheckResult::Error => "error",
        }
    }

    const ALL: [CheckResult; 3] = [CheckResult::Absent, CheckResult::Found, CheckResult::Error];
}

/// Why a sampled key was not checked or not decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DropReason {
    /// Past `audit.max_per_second`.
    RateLimited,
    /// The queue to the background check was full.
    QueueFull,
    /// The ledger of keys waiting for their decision was full; the oldest went.
    LedgerFull,
}

impl DropReason {
    /// Label value.
    pub fn as_str(self) -> &'static str {
        match self {
            DropReason::RateLimited => "rate_limited",
            DropReason::QueueFull => "queue_full",
            DropReason::LedgerFull => "ledger_full",
        }
    }

    const ALL: [DropReason; 3] = [
        DropReason::RateLimited,
        DropReason::QueueFull,
        DropReason::LedgerFull,
    ];
}

/// The audit's families. Cheap to clone.
#[derive(Clone)]
pub struct AuditMetrics {
    checks: IntCounterVec,
    false_negatives: IntCounterVec,
    sync_lag: IntCounterVec,
    dropped: IntCounterVec,
    pending: IntGauge,
}

impl AuditMetrics {
    /// Registers the families on `registry`, with every series of each route in `routes`
    /// at 0, so that rates read 0 rather than nothing before the first sample.
    pub fn register<'a>(
        registry: &Registry,
        routes: impl IntoIterator<Item = &'a str>,
    ) -> prometheus::Result<AuditMetrics> {
        let pending = IntGauge::new(
            "bloomgate_audit_pending",
            "Keys the audit found at their origin after the gate refused them, waiting for sync to cover the refusal before they are judged.",
        )?;
        registry.register(Box::new(pending.clone()))?;
        let m = AuditMetrics {
            checks: family(
                registry,
                "bloomgate_audit_checks_total",
                "Refused keys the audit asked their origin about, by route and result (absent, found, error).",
                &["route", "result"],
            )?,
            false_negatives: family(
                registry,
                "bloomgate_audit_false_negatives_total",
                "Keys the gate refused that the origin had and that sync had not brought in once it covered the refusal; must stay 0.",
                &["route"],
            )?,
            sync_lag: family(
                registry,
                "bloomgate_audit_sync_lag_total",
                "Keys the audit found at their origin that another admission (sync, write-through, admin API, fleet) brought in before the decision: the documented sync lag.",
                &["route"],
            )?,
            dropped: family(
                registry,
                "bloomgate_audit_dropped_total",
                "Sampled keys the audit let go, by reason (rate_limited, queue_full, ledger_full).",
                &["reason"],
            )?,
            pending,
        };
        for route in routes {
            for result in CheckResult::ALL {
                m.checks.with_label_values(&[route, result.as_str()]);
            }
            m.false_negatives.with_label_values(&[route]);
            m.sync_lag.with_label_values(&[route]);
        }
        for reason in DropReason::ALL {
            m.dropped.with_label_values(&[reason.as_str()]);
        }
        Ok(m)
    }

    /// Counts one check of a key of `route`.
    pub fn checked(&self, route: &str, result: CheckResult) {
        self.checks
            .with_label_values(&[route, result.as_str()])
            .inc();
    }

    /// Counts one false negative of `route`.
    pub fn false_negative(&self, route: &str) {
        self.false_negatives.with_label_values(&[route]).inc();
    }

    /// Counts one key of `route` that another admission brought in.
    pub fn sync_lag(&self, route: &str) {
        self.sync_lag.with_label_values(&[route]).inc();
    }

    /// The counter of one drop reason, resolved once.
    pub fn dropped(&self, reason: DropReason) -> IntCounter {
        self.dropped.with_label_values(&[reason.as_str()])
    }

    /// Publishes how many keys wait for their decision.
    pub fn set_pending(&self, n: usize) {
        self.pending.set(i64::try_from(n).unwrap_or(i64::MAX));
    }
}
