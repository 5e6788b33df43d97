//! Incremental sync: polls each filter's sync query every `interval` for keys changed
//! since the watermark (reaching back by the overlap) and admits them (`Proxy::admit`:
//! the filter, the next filter a build swaps in, and the negative cache entries), so a
//! key created after it was a false positive is served at once. It does not rebuild
//! (see `gate::build`).

use std::borrow::Cow;
use std::sync::Arc;

use tokio::time::MissedTickBehavior;

use crate::config::SyncConfig;
use crate::db::Db;
use crate::gate::{Gate, unix_now};
use crate::key::{OwnedKey, normalize};
use crate::proxy::{Forget, Proxy};
use crate::watermark::Watermark;

/// Runs the sync loop of `gate` until aborted; returns at once if it has no sync.
pub async fn run(gate: Arc<Gate>, proxy: Arc<Proxy>, db: Db) {
    let Some(sync) = gate.config().sync.clone() else {
        return;
    };
    let query: Arc<str> = Arc::from(sync.query.as_str());
    let mut ticker = tokio::time::interval(sync.interval);
    ticker.set_missed_tick_behavior(MissedTickBehavior::Delay);
    ticker.tick().await;
    loop {
        // Before the first build there is nothing to add to, and no watermark: wait for
        // it, then poll at once (after a warm start, that catches up on the snapshot).
        let Some(mark) = gate.watermark().filter(|_| gate.is_ready()) else {
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            continue;
        };
        poll_once(&gate, &proxy, &db, &sync, &query, mark).await;
        ticker.tick().await;
    }
}

/// One poll: applies every key changed since `mark` minus the overlap.
pub async fn poll_once(
    gate: &Gate,
    proxy: &Proxy,
    db: &Db,
    sync: &SyncConfig,
    query: &Arc<str>,
    mark: Watermark,
) {
    let since = reach_back(mark, sync);
    let rule = gate.normalize_rule().clone();
    let mut added: Vec<OwnedKey> = Vec::new();
    let mut newest: Option<Watermark> = None;
    let mut bad = 0u64;
    let result = db
        .for_each_change(query, sync.watermark, since, |raw, w| {
            match normalize(&rule, Cow::Borrowed(raw)) {
                Ok(key) => added.push(key.to_owned_key()),
                Err(_) => bad += 1,
            }
            if let Some(w) = w {
                newest = newest.max(Some(w));
            }
        })
        .await;
    match result {
        Ok(rows) => {
            proxy.admit(gate, &added, Forget::Absence).await;
            if let Some(w) = newest {
                gate.advance_watermark(w);
            }
            if let Some(Watermark::TimeMicros(us)) = gate.watermark() {
                let lag = (unix_now() - us as f64 / 1e6).max(0.0);
                gate.metrics().set_sync_lag(lag);
            }
            gate.metrics().record_sync(true, rows, unix_now());
            if bad > 0 {
                tracing::warn!(
                    filter = gate.name(),
                    skipped = bad,
                    "sync rows had keys that failed normalisation"
                );
            }
            tracing::debug!(filter = gate.name(), rows, since = %since, "sync poll applied");
        }
        Err(e) => {
            gate.metrics().record_sync(false, 0, unix_now());
            tracing::warn!(filter = gate.name(), error = %e, "sync poll failed; retrying next interval");
        }
    }
}

/// The watermark a poll starts from: `mark` minus the configured overlap.
fn reach_back(mark: Watermark, sync: &SyncConfig) -> Watermark {
    match mark {
        Watermark::TimeMicros(us) => {
            let overlap = i64::try_from(sync.overlap.as_micros()).unwrap_or(i64::MAX);
            Watermark::TimeMicros(us.saturating_sub(overlap))
        }
        Watermark::Int(v) => {
            let overlap = i64::try_from(sync.overlap_ids).unwrap_or(i64::MAX);
            Watermark::Int(v.saturating_sub(overlap))
        }
    }
}
