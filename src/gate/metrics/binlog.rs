//! The metric families of binlog mode: changes read from the log, how far behind it the
//! stream is, reconnects and the rebuilds the log asked for, and the keys deleted from
//! the source with the effective false-positive rate they leave.

use prometheus::{Gauge, GaugeVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Registry};

use bloomgate_core::metrics::{clamp_i64, family};

/// The binlog families, registered with the other filter families.
#[derive(Clone)]
pub struct BinlogFamilies {
    changes: IntCounterVec,
    lag: GaugeVec,
    reconnects: IntCounterVec,
    rebuilds: IntCounterVec,
    deleted: IntGaugeVec,
    effective_fpp: GaugeVec,
}

impl BinlogFamilies {
    /// Creates the families and registers them on `registry`.
    pub fn register(registry: &Registry) -> prometheus::Result<Self> {
        Ok(BinlogFamilies {
            changes: family(
                registry,
                "bloomgate_filter_binlog_changes_total",
                "Row changes of the source table read from the binary log, by change: insert, update, delete.",
                &["filter", "change"],
            )?,
            lag: family(
                registry,
                "bloomgate_filter_binlog_lag_seconds",
                "How far the binary log stream is behind the server: now minus the time of the newest transaction applied, 0 once the server has nothing newer.",
                &["filter"],
            )?,
            reconnects: family(
                registry,
                "bloomgate_filter_binlog_reconnects_total",
                "Times the binary log stream was opened again from the last applied position after it failed or went silent.",
                &["filter"],
            )?,
            rebuilds: family(
                registry,
                "bloomgate_filter_binlog_rebuilds_total",
                "Full rebuilds binlog mode asked for, by reason: position_gone (the log no longer holds the position), table_changed (a statement changed the table without row events), deletes (the effective false-positive rate reached its bound).",
                &["filter", "reason"],
            )?,
            deleted: family(
                registry,
                "bloomgate_filter_deleted_keys",
                "Keys deleted from the source since the filter's build, whose bits are still set (binlog mode).",
                &["filter"],
            )?,
            effective_fpp: family(
                registry,
                "bloomgate_filter_effective_fpp",
                "Estimated false-positive rate with the deleted keys' bits still set: the rate the filter's items imply, plus the share of its keys deleted from the source (binlog mode).",
                &["filter"],
            )?,
        })
    }

    /// The handles of one filter.
    pub fn handles(&self, filter: &str) -> BinlogMetrics {
        let change = |c: &str| self.changes.with_label_values(&[filter, c]);
        let rebuild = |r: &str| self.rebuilds.with_label_values(&[filter, r]);
        BinlogMetrics {
            inserts: change("insert"),
            updates: change("update"),
            deletes: change("delete"),
            lag: self.lag.with_label_values(&[filter]),
            reconnects: self.reconnects.with_label_values(&[filter]),
            position_gone: rebuild("position_gone"),
            table_changed: rebuild("table_changed"),
            deletes_rebuilds: rebuild("deletes"),
            deleted: self.deleted.with_label_values(&[filter]),
            effective_fpp: self.effective_fpp.with_label_values(&[filter]),
        }
    }
}

/// Why binlog mode asked for a rebuild.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BinlogRebuild {
    /// The log no longer holds the filter's position.
    PositionGone,
    /// A statement changed the table without row events.
    TableChanged,
    /// The effective false-positive rate reached its bound.
    Deletes,
}

/// One filter's binlog handles, resolved once.
#[derive(Clone)]
pub struct BinlogMetrics {
    inserts: IntCounter,
    updates: IntCounter,
    deletes: IntCounter,
    lag: Gauge,
    reconnects: IntCounter,
    position_gone: IntCounter,
    table_changed: IntCounter,
    deletes_rebuilds: IntCounter,
    deleted: IntGauge,
    effective_fpp: Gauge,
}

impl BinlogMetrics {
    /// Counts the row changes of one transaction.
    pub fn changes(&self, inserts: u64, updates: u64, deletes: u64) {
        self.inserts.inc_by(inserts);
        self.updates.inc_by(updates);
        self.deletes.inc_by(deletes);
    }

    /// Seconds behind the server.
    pub fn set_lag(&self, seconds: f64) {
        self.lag.set(seconds);
    }

    /// Counts a reconnect.
    pub fn reconnect(&self) {
        self.reconnects.inc();
    }

    /// Counts a rebuild binlog mode asked for.
    pub fn rebuild(&self, why: BinlogRebuild) {
        match why {
            BinlogRebuild::PositionGone => self.position_gone.inc(),
            BinlogRebuild::TableChanged => self.table_changed.inc(),
            BinlogRebuild::Deletes => self.deletes_rebuilds.inc(),
        }
    }

    /// Publishes the keys deleted since the build and the effective rate they leave.
    pub fn set_deletes(&self, deleted: u64, effective_fpp: f64) {
        self.deleted.set(clamp_i64(deleted));
        self.effective_fpp.set(effective_fpp);
    }
}
