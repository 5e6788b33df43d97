//! Binlog mode (`watermark = "binlog"`): follows the server's binary log from the
//! filter's position, as a replica does, and applies every committed change of the
//! source table through the one admission path. An insert admits its key; an update
//! drops the row's cache entries on every instance (and, when the key column changed,
//! admits the new key and counts the old one deleted); a delete drops the cache entries
//! and counts the key deleted (see `gate::deletes`).
//!
//! The stream starts from the position of the filter it feeds (a build's consistent scan,
//! a snapshot, a fleet generation) and starts again from a new filter's position when a
//! build or load sets one. A connection that fails or goes silent is opened again, with
//! backoff, from the last transaction applied; a position the server no longer has
//! (purged, or another server's without a GTID to go by) brings a full rebuild, and the
//! stream goes on from the new filter's position. It does not build (`gate::build` does).

use std::time::Duration;

use bloomgate_core::config::SyncConfig;
use bloomgate_core::db::Db;
use bloomgate_core::db::binlog::stream::{
    LogEvent, LogReader, ReplicaSettings, RowChange, StreamError,
};
use bloomgate_core::key::{OwnedKey, normalize};
use bloomgate_core::metrics::unix_now;
use bloomgate_core::report::Chain;

use crate::gate::admit::{Admit, Forget};
use crate::gate::metrics::binlog::BinlogRebuild;
use crate::gate::{Filter, RebuildReason};

/// First wait before opening the stream again; doubles up to [`MAX_BACKOFF`].
const FIRST_BACKOFF: Duration = Duration::from_millis(100);
/// Longest wait between attempts.
const MAX_BACKOFF: Duration = Duration::from_secs(10);

/// Exponential backoff with jitter, started over by [`Backoff::reset`].
struct Backoff {
    next: Duration,
}

impl Backoff {
    fn new() -> Self {
        Backoff {
            next: FIRST_BACKOFF,
        }
    }

    /// The wait before the next attempt (up to a fifth more, so instances do not retry
    /// in step); the one after is twice as long, up to the bound.
    fn next(&mut self) -> Duration {
        let wait = self.next + self.next.mul_f64(rand::random::<f64>() * 0.2);
        self.next = (self.next * 2).min(MAX_BACKOFF);
        wait
    }

    fn reset(&mut self) {
        self.next = FIRST_BACKOFF;
    }
}

/// Follows the binary log for `filter` for ever. A filter without a binlog source (not
/// binlog mode) waits for ever.
pub async fn follow(filter: &Filter, admit: &Admit, db: &Db, sync: &SyncConfig) {
    let Some(source) = filter.binlog_source() else {
        return std::future::pending().await;
    };
    let server_id = sync
        .binlog
        .server_id
        .unwrap_or_else(|| default_server_id(filter.name()));
    let mut backoff = Backoff::new();
    loop {
        // Before the first build there is no position to read from.
        let Some((from, restart)) = filter.binlog_position() else {
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        };
        let (server, key) = match db.binlog_check(&source.table).await {
            Ok(checked) => checked,
            Err(e) => {
                tracing::error!(filter = filter.name(), error = %Chain(&e),
                    "binlog mode cannot read this server's binary log; keys created meanwhile are refused until it can");
                tokio::time::sleep(backoff.next()).await;
                continue;
            }
        };
        let settings = ReplicaSettings {
            url: source.url.clone(),
            server_id,
            heartbeat: sync.binlog.heartbeat,
            flavor: server.flavor,
            base: server.base.clone(),
        };
        let mut reader = match LogReader::open(&settings, from, key).await {
            Ok(reader) => reader,
            Err(StreamError::PositionGone(why)) => {
                position_gone(filter, restart, &why).await;
                continue;
            }
            Err(e) => {
                tracing::warn!(filter = filter.name(), error = %Chain(&e), "binary log stream could not be opened; trying again");
                filter.metrics().binlog.reconnect();
                tokio::time::sleep(backoff.next()).await;
                continue;
            }
        };
        tracing::info!(filter = filter.name(), from = %bloomgate_core::watermark::Watermark::Binlog(from),
            server_id, server = %server.version, "reading the binary log");
        loop {
            match reader.next().await {
                Ok(event) => {
                    backoff.reset();
                    if !apply(filter, admit, restart, event).await {
                        break;
                    }
                }
                Err(StreamError::PositionGone(why)) => {
                    position_gone(filter, restart, &why).await;
                    break;
                }
                Err(e) => {
                    tracing::warn!(filter = filter.name(), error = %Chain(&e),
                        "binary log stream lost; opening it again from the last transaction applied");
                    filter.metrics().binlog.reconnect();
                    tokio::time::sleep(backoff.next()).await;
                    break;
                }
            }
        }
    }
}

/// Applies one event of the stream started at `restart`. False when the stream must
/// start again: a build or load set a new position, or the table changed shape.
async fn apply(filter: &Filter, admit: &Admit, restart: u64, event: LogEvent) -> bool {
    let metrics = filter.metrics();
    match event {
        LogEvent::Committed {
            changes,
            unreadable,
            at,
            written,
        } => {
            let counts = apply_changes(filter, admit, &changes).await;
            if !filter.advance_binlog(restart, at) {
                return false;
            }
            if counts.deleted > 0 {
                filter.record_deleted(restart, counts.deleted);
            }
            metrics
                .binlog
                .changes(counts.inserts, counts.updates, counts.deletes);
            if unreadable + counts.unusable > 0 {
                tracing::warn!(
                    filter = filter.name(),
                    rows = unreadable + counts.unusable,
                    "binary log rows had keys that could not be read or failed normalisation"
                );
            }
            let now = unix_now();
            metrics.binlog.set_lag((now - f64::from(written)).max(0.0));
            metrics.record_streamed(counts.inserts, now);
            true
        }
        LogEvent::CaughtUp { at } => {
            metrics.binlog.set_lag(0.0);
            metrics.record_streamed(0, unix_now());
            filter.advance_binlog(restart, at)
        }
        LogEvent::TableChanged { what, at } => {
            tracing::warn!(filter = filter.name(), statement = %what,
                "the source table changed without row events; rebuilding, and reading its key column again");
            metrics.binlog.rebuild(BinlogRebuild::TableChanged);
            filter.request_rebuild(RebuildReason::Binlog);
            filter.advance_binlog(restart, at);
            false
        }
    }
}

/// What one transaction did to the filter.
#[derive(Debug, Default)]
struct Counts {
    inserts: u64,
    updates: u64,
    deletes: u64,
    /// Keys gone from the source: deletes, and the old keys of updates that changed them.
    deleted: u64,
    /// Keys that failed normalisation.
    unusable: u64,
}

/// Admits the keys `changes` insert, drops the cache entries of the rows they update
/// or delete (on every instance), and counts.
async fn apply_changes(filter: &Filter, admit: &Admit, changes: &[RowChange]) -> Counts {
    let mut counts = Counts::default();
    let mut admitted: Vec<OwnedKey> = Vec::new();
    let mut renamed: Vec<OwnedKey> = Vec::new();
    let mut gone: Vec<OwnedKey> = Vec::new();
    let key = |raw: &str, counts: &mut Counts| match normalize(
        filter.normalize_rule(),
        std::borrow::Cow::Borrowed(raw),
    ) {
        Ok(k) => Some(k.to_owned_key()),
        Err(_) => {
            counts.unusable += 1;
            None
        }
    };
    for change in changes {
        match change {
            RowChange::Insert(k) => {
                counts.inserts += 1;
                admitted.extend(key(k, &mut counts));
            }
            RowChange::Update { before, after } => {
                counts.updates += 1;
                if before == after {
                    gone.extend(key(before, &mut counts));
                } else {
                    counts.deleted += 1;
                    gone.extend(key(before, &mut counts));
                    renamed.extend(key(after, &mut counts));
                }
            }
            RowChange::Delete(k) => {
                counts.deletes += 1;
                counts.deleted += 1;
                gone.extend(key(k, &mut counts));
            }
        }
    }
    admit.admit(filter, &admitted, Forget::Absence).await;
    // A key an update moved a row to: it exists now, and nothing cached of it holds.
    admit.admit(filter, &renamed, Forget::Everything).await;
    admit.invalidate_keys(filter.name(), &gone).await;
    counts
}

/// The position is gone from the server: asks for a rebuild and waits until a new
/// filter brings a new position (the loader retries a failing build on its own).
async fn position_gone(filter: &Filter, restart: u64, why: &str) {
    tracing::error!(
        filter = filter.name(),
        reason = why,
        "the server's binary log no longer holds the filter's position; rebuilding from the source"
    );
    filter.metrics().binlog.rebuild(BinlogRebuild::PositionGone);
    filter.request_rebuild(RebuildReason::Binlog);
    while filter.binlog_position().is_none_or(|(_, r)| r == restart) {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A replica id for `filter` when none is configured: in 1,000,000,000..2,000,000,000,
/// from the filter's name and this host's name, so that two hosts streaming the same
/// filter do not take each other's place on the server.
fn default_server_id(filter: &str) -> u32 {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .or_else(|_| std::fs::read_to_string("/etc/hostname"))
        .unwrap_or_default();
    let mut h = crc32fast::Hasher::new();
    h.update(filter.as_bytes());
    h.update(b"@");
    h.update(host.trim().as_bytes());
    1_000_000_000 + h.finalize() % 1_000_000_000
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_to_its_bound_and_starts_over() {
        let mut b = Backoff::new();
        let first = b.next();
        assert!(first >= FIRST_BACKOFF && first <= FIRST_BACKOFF.mul_f64(1.2));
        for _ in 0..20 {
            b.next();
        }
        let late = b.next();
        assert!(
            late >= MAX_BACKOFF && late <= MAX_BACKOFF.mul_f64(1.2),
            "{late:?}"
        );
        b.reset();
        assert!(b.next() <= FIRST_BACKOFF.mul_f64(1.2));
    }

    #[test]
    fn default_replica_ids_are_in_their_range_and_differ_by_filter() {
        let a = default_server_id("products");
        let b = default_server_id("articles");
        assert!((1_000_000_000..2_000_000_000).contains(&a));
        assert!((1_000_000_000..2_000_000_000).contains(&b));
        assert_ne!(a, b);
        assert_eq!(a, default_server_id("products"));
    }
}
