//! Incremental sync: polls each filter's sync query every `interval` for keys changed
//! since the watermark (timestamps reach back by the overlap; integer ids start from the
//! lowest open gap, see `sync::gaps`) and admits them (`Admit::admit`: the filter, the
//! next filter a build swaps in, and the negative cache entries), so a key created after
//! it was a false positive is served at once. A row no earlier poll read with the same
//! watermark value (see `sync::seen`) is a change: its positive cache entries go too, so
//! an updated row is served fresh after the next poll instead of after its TTL. It does
//! not rebuild (see `gate::build`).
//!
//! Updates are seen only with a timestamp watermark that every update moves (`updated_at`
//! with `ON UPDATE CURRENT_TIMESTAMP(6)`, or set by the writer). An integer watermark
//! (an auto-increment id) moves only when a row is inserted: sync sees new rows, and
//! cached rows follow their updates only when their TTL ends.

pub mod binlog;
pub mod gaps;
pub mod seen;

use std::borrow::Cow;
use std::sync::Arc;
use std::time::Instant;

use tokio::time::MissedTickBehavior;

use super::admit::{Admit, Forget};
use crate::gate::Filter;
use bloomgate_core::config::{SyncConfig, WatermarkKind};
use bloomgate_core::db::Db;
use bloomgate_core::key::{KeyBytes, OwnedKey, normalize};
use bloomgate_core::metrics::unix_now;
use bloomgate_core::report::Chain;
use bloomgate_core::watermark::Watermark;
use seen::{MAX_REMEMBERED_ROWS, SeenRows};

/// Runs the sync loop of `filter` until aborted. A filter without sync waits for a
/// reload that gives it one; a reload that changes its sync settings starts the loop
/// over with them.
pub async fn run(filter: Arc<Filter>, admit: Arc<Admit>, db: Db) {
    let mut config = filter.watch_config();
    loop {
        let sync = config.borrow_and_update().sync.clone();
        tokio::select! {
            () = poll_forever(&filter, &admit, &db, sync) => {}
            changed = config.changed() => {
                if changed.is_err() {
                    // The filter holds the sender; it outlives this loop.
                    return;
                }
                tracing::info!(filter = filter.name(), "sync settings reloaded");
            }
        }
    }
}

/// Polls every `sync.interval` for ever, or in binlog mode follows the binary log;
/// never resolves without sync.
async fn poll_forever(filter: &Filter, admit: &Admit, db: &Db, sync: Option<SyncConfig>) {
    let Some(sync) = sync else {
        return std::future::pending().await;
    };
    if sync.watermark == WatermarkKind::Binlog {
        return binlog::follow(filter, admit, db, &sync).await;
    }
    let Some(query) = sync.query.as_deref().map(Arc::<str>::from) else {
        // Refused by validation: polling needs its query.
        return std::future::pending().await;
    };
    let mut ticker = tokio::time::interval(sync.interval);
    ticker.set_missed_tick_behavior(MissedTickBehavior::Delay);
    ticker.tick().await;
    // The rows read by recent polls. Empty at start, so the first poll takes every row
    // it reads for a change and drops the cache entries of the rows in its window once:
    // a few origin calls, never an old row served.
    let mut seen = SeenRows::new(MAX_REMEMBERED_ROWS);
    loop {
        // Before the first build there is nothing to add to, and no watermark: wait for
        // it, then poll at once (after a warm start, that catches up on the snapshot).
        let Some(mark) = filter.watermark().filter(|_| filter.has_local_copy()) else {
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            continue;
        };
        poll_once(filter, admit, db, &sync, &query, mark, &mut seen).await;
        ticker.tick().await;
    }
}

/// One poll: applies every key changed since `mark` minus the overlap (timestamps), or
/// since the lowest open gap below `mark` (integer ids). Rows that `seen` does not hold
/// yet drop all their cache entries; rows read again only their negative ones.
pub async fn poll_once(
    filter: &Filter,
    admit: &Admit,
    db: &Db,
    sync: &SyncConfig,
    query: &Arc<str>,
    mark: Watermark,
    seen: &mut SeenRows,
) {
    let since = start_point(filter, mark, sync);
    let rule = filter.normalize_rule().clone();
    let mut added: Vec<OwnedKey> = Vec::new();
    let mut marks: Vec<Option<Watermark>> = Vec::new();
    let mut newest: Option<Watermark> = None;
    let mut ids: Vec<i64> = Vec::new();
    let started = Instant::now();
    let mut bad = 0u64;
    let result = db
        .for_each_change(query, sync.watermark, since, |raw, w| {
            match normalize(&rule, Cow::Borrowed(raw)) {
                Ok(key) => {
                    added.push(key.to_owned_key());
                    marks.push(w);
                }
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
            // Only once the whole poll has been read: a poll that fails half-way must not
            // leave its rows remembered, or the next one would take them for known.
            let changed = admit_rows(filter, admit, seen, since, added, &marks).await;
            filter.record_sync_poll(started);
            match mark {
                // The gaps and the watermark move together, under one lock.
                Watermark::Int(prev) => record_gaps(filter, prev, &mut ids, started),
                Watermark::TimeMicros(_) => {
                    if let Some(w) = newest {
                        filter.advance_watermark(w);
                    }
                }
                // Never polled (binlog mode follows the log).
                Watermark::Binlog(_) => {}
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
            tracing::debug!(filter = filter.name(), rows, changed, since = %since,
                open_gaps = filter.sync_open_gaps(), "sync poll applied");
        }
        Err(e) => {
            filter.metrics().record_sync(false, 0, unix_now());
            tracing::warn!(filter = filter.name(), error = %Chain(&e), "sync poll failed; retrying next interval");
        }
    }
}

/// Admits the keys of one poll that read from `since`: the rows `seen` reports changed
/// with [`Forget::Everything`], the others with [`Forget::Absence`]. Returns how many
/// rows changed.
async fn admit_rows(
    filter: &Filter,
    admit: &Admit,
    seen: &mut SeenRows,
    since: Watermark,
    keys: Vec<OwnedKey>,
    marks: &[Option<Watermark>],
) -> usize {
    let report = seen.poll(since, keys.iter().map(canonical).zip(marks.iter().copied()));
    if report.overflow_began {
        tracing::warn!(
            filter = filter.name(),
            rows = keys.len(),
            cap = MAX_REMEMBERED_ROWS,
            "sync read more rows than it can remember; until its window fits again, every row a poll reads drops all its cache entries"
        );
    }
    if report.overflowed {
        filter.metrics().sync_seen_overflow();
    }
    let (mut changed, mut again) = (Vec::new(), Vec::new());
    for (key, is_changed) in keys.into_iter().zip(report.changed) {
        if is_changed {
            changed.push(key);
        } else {
            again.push(key);
        }
    }
    admit.admit(filter, &again, Forget::Absence).await;
    admit.admit(filter, &changed, Forget::Everything).await;
    filter.metrics().sync_changed_rows(changed.len());
    changed.len()
}

/// The bytes the filter hashes for `key`, borrowed where they are already held.
fn canonical(key: &OwnedKey) -> Cow<'_, [u8]> {
    match key {
        OwnedKey::Text(s) => Cow::Borrowed(s.as_bytes()),
        OwnedKey::Int(_) => Cow::Owned(KeyBytes::new().of(&key.as_norm()).to_vec()),
    }
}

/// Where the next poll of `filter` starts; `None` without sync or before the first build.
pub fn next_start(filter: &Filter) -> Option<Watermark> {
    let config = filter.config();
    let sync = config.sync.as_ref()?;
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
        Watermark::Binlog(_) => mark,
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
