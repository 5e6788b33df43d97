//! Incremental sync: polls each filter's sync query every `interval` for keys changed
//! since the watermark (timestamps reach back by the overlap; integer ids start from the
//! lowest open gap, see `sync::gaps`) and admits them (`Admit::admit`: the filter, the
//! next filter a build swaps in, and the negative cache entries), so a key created after
//! it was a false positive is served at once. It does not rebuild (see `gate::build`).

pub mod gaps;

use std::borrow::Cow;
use std::sync::Arc;
use std::time::Instant;

use tokio::time::MissedTickBehavior;

use super::admit::{Admit, Forget};
use crate::config::SyncConfig;
use crate::db::Db;
use crate::gate::{Filter, unix_now};
use crate::key::{OwnedKey, normalize};
use crate::watermark::Watermark;

/// Runs the sync loop of `filter` until aborted; returns at once if it has no sync.
pub async fn run(filter: Arc<Filter>, admit: Arc<Admit>, db: Db) {
    let Some(sync) = filter.config().sync.clone() else {
        return;
    };
    let query: Arc<str> = Arc::from(sync.query.as_str());
    let mut ticker = tokio::time::interval(sync.interval);
    ticker.set_missed_tick_behavior(MissedTickBehavior::Delay);
    ticker.tick().await;
    loop {
        // Before the first build there is nothing to add to, and no watermark: wait for
        // it, then poll at once (after a warm start, that catches up on the snapshot).
        let Some(mark) = filter.watermark().filter(|_| filter.is_ready()) else {
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            continue;
        };
        poll_once(&filter, &admit, &db, &sync, &query, mark).await;
        ticker.tick().await;
    }
}

/// One poll: applies every key changed since `mark` minus the overlap (timestamps), or
/// since the lowest open gap below `mark` (integer ids).
pub async fn poll_once(
    filter: &Filter,
    admit: &Admit,
    db: &Db,
    sync: &SyncConfig,
    query: &Arc<str>,
    mark: Watermark,
) {
    let since = start_point(filter, mark, sync);
    let rule = filter.normalize_rule().clone();
    let mut added: Vec<OwnedKey> = Vec::new();
    let mut newest: Option<Watermark> = None;
    let mut ids: Vec<i64> = Vec::new();
    let started = Instant::now();
    let mut bad = 0u64;
    let result = db
        .for_each_change(query, sync.watermark, since, |raw, w| {
            match normalize(&rule, Cow::Borrowed(raw)) {
                Ok(key) => added.push(key.to_owned_key()),
                Err(_) => bad += 1,
            }
            if let Some(w) = w {
                newest = newest.max(Some(w));
                if let Watermark::Int(id) = w {
                    ids.push(id);
                }
            }
        })
        .await;
    match result {
        Ok(rows) => {
            admit.admit(filter, &added, Forget::Absence).await;
            match mark {
                // The gaps and the watermark move together, under one lock.
                Watermark::Int(prev) => record_gaps(filter, prev, &mut ids, started),
                Watermark::TimeMicros(_) => {
                    if let Some(w) = newest {
                        filter.advance_watermark(w);
                    }
                }
            }
            if let Some(Watermark::TimeMicros(us)) = filter.watermark() {
                let lag = (unix_now() - us as f64 / 1e6).max(0.0);
                filter.metrics().set_sync_lag(lag);
            }
            filter.metrics().record_sync(true, rows, unix_now());
            if bad > 0 {
                tracing::warn!(
                    filter = filter.name(),
                    skipped = bad,
                    "sync rows had keys that failed normalisation"
                );
            }
            tracing::debug!(filter = filter.name(), rows, since = %since,
                open_gaps = filter.sync_open_gaps(), "sync poll applied");
        }
        Err(e) => {
            filter.metrics().record_sync(false, 0, unix_now());
            tracing::warn!(filter = filter.name(), error = %e, "sync poll failed; retrying next interval");
        }
    }
}

/// Where the next poll of `filter` starts; `None` without sync or before the first build.
pub fn next_start(filter: &Filter) -> Option<Watermark> {
    let sync = filter.config().sync.as_ref()?;
    filter
        .watermark()
        .map(|mark| start_point(filter, mark, sync))
}

/// The watermark a poll starts from: `mark` minus the configured overlap (timestamps),
/// or the lowest open gap if that is below `mark` (integer ids; the query's `>=` reads
/// the gaps again).
fn start_point(filter: &Filter, mark: Watermark, sync: &SyncConfig) -> Watermark {
    match mark {
        Watermark::TimeMicros(us) => {
            let overlap = i64::try_from(sync.overlap.as_micros()).unwrap_or(i64::MAX);
            Watermark::TimeMicros(us.saturating_sub(overlap))
        }
        Watermark::Int(_) => filter.sync_poll_start(mark),
    }
}

/// Updates the gaps of an integer-watermark poll that started from `prev` and read
/// `ids`; logs and counts the gaps it gave up.
fn record_gaps(filter: &Filter, prev: i64, ids: &mut Vec<i64>, started: Instant) {
    let report = filter.record_poll_ids(prev, ids, started);
    let name = filter.name();
    if !report.expired.is_empty() {
        for r in &report.expired {
            tracing::debug!(
                filter = name,
                first = r.first,
                last = r.last,
                ids = r.ids(),
                open_for_ms = r.opened.elapsed().as_millis() as u64,
                "sync gap expired"
            );
        }
        let ids = gaps::total_ids(&report.expired);
        tracing::info!(
            filter = name,
            ranges = report.expired.len(),
            ids,
            lowest = report.expired.iter().map(|r| r.first).min(),
            "sync gaps expired: no row appeared for these ids within gap_timeout; they are no longer read again"
        );
        filter.metrics().sync_gaps_expired(report.expired.len());
    }
    if !report.dropped.is_empty() {
        let ids = gaps::total_ids(&report.dropped);
        tracing::warn!(
            filter = name,
            ranges = report.dropped.len(),
            ids,
            cap = gaps::MAX_OPEN_RANGES,
            "too many open sync gaps; dropped the oldest, whose rows are no longer read again if they commit late"
        );
        filter.metrics().sync_gaps_dropped(report.dropped.len());
    }
    if report.opened > 0 || report.closed > 0 {
        tracing::debug!(
            filter = name,
            opened = report.opened,
            closed = report.closed,
            open = filter.sync_open_gaps(),
            "sync gaps updated"
        );
    }
}
