//! Where a filter's incremental sync stands: the watermark it has read up to, the id
//! gaps below it that no poll has read yet (see `gate::sync::gaps`), and when the latest
//! poll succeeded; in binlog mode, the log position, how many times the stream had to
//! start again from a new filter's position, and the keys deleted since. The sync loops
//! (`gate::sync`) and the builds (`gate::build`) move it; the admin API and the audit
//! read it.

use std::time::Instant;

use super::sync::gaps::{Gaps, MAX_OPEN_RANGES, PollGaps};
use super::{Filter, lock};
use bloomgate_core::config::FilterConfig;
use bloomgate_core::watermark::{BinlogMark, Watermark};

impl Filter {
    /// The current sync watermark: the largest value sync or a build has reached.
    pub fn watermark(&self) -> Option<Watermark> {
        lock(&self.watermark).mark
    }

    /// Moves the sync watermark forward (never back). A binlog position comes with a
    /// filter that was built or loaded there: the stream starts again from it.
    pub fn advance_watermark(&self, to: Watermark) {
        lock(&self.watermark).advance(to);
    }

    /// Binlog mode: where the stream resumes from, and the count of restarts the
    /// position has seen (a build or load sets a new one; see
    /// [`Filter::advance_binlog`]).
    pub fn binlog_position(&self) -> Option<(BinlogMark, u64)> {
        let p = lock(&self.watermark);
        match p.mark {
            Some(Watermark::Binlog(m)) => Some((m, p.restarts)),
            _ => None,
        }
    }

    /// Binlog mode: the stream started at restart `restart` has applied everything
    /// before `at`. False, and nothing moves, when a build or load has set a new
    /// position since: the stream must start again from there.
    pub fn advance_binlog(&self, restart: u64, at: BinlogMark) -> bool {
        let mut p = lock(&self.watermark);
        if p.restarts != restart {
            return false;
        }
        p.mark = Some(Watermark::Binlog(at));
        true
    }

    /// Binlog mode: counts `keys` deleted from the source by the stream started at
    /// `restart`, and returns the count since the filter's position; `None` when a new
    /// position was set since (the count starts over from it).
    pub fn count_deleted(&self, restart: u64, keys: u64) -> Option<u64> {
        let mut p = lock(&self.watermark);
        if p.restarts != restart {
            return None;
        }
        p.deleted += keys;
        Some(p.deleted)
    }

    /// Binlog mode: source keys deleted since the filter's position, whose bits are
    /// still set.
    pub fn deleted_keys(&self) -> u64 {
        lock(&self.watermark).deleted
    }

    /// Where a poll computed from `mark` starts: for integer watermarks, the lowest open
    /// gap if that is lower (the query's `>=` reads it again).
    pub fn sync_poll_start(&self, mark: Watermark) -> Watermark {
        let p = lock(&self.watermark);
        match mark {
            Watermark::Int(id) => Watermark::Int(p.gaps.resume_from(id)),
            other => other,
        }
    }

    /// What a snapshot of a build that started at `mark` records: for integer
    /// watermarks, a mark below the `overlap_ids` window and below the lowest open gap,
    /// so a restart from it reads them again and finds the ids still missing.
    pub fn sync_restart_mark(&self, mark: Watermark) -> Watermark {
        let p = lock(&self.watermark);
        match mark {
            Watermark::Int(id) => Watermark::Int(p.gaps.snapshot_mark(id)),
            other => other,
        }
    }

    /// Records a successful sync poll whose query was sent at `started`, once its rows
    /// are admitted: what sync can see of rows committed before then is in the filter.
    pub fn record_sync_poll(&self, started: Instant) {
        let mut p = lock(&self.watermark);
        p.synced_from = p.synced_from.max(Some(started));
    }

    /// Whether a sync poll on this instance that started at or after `at` has succeeded.
    /// (The watermark cannot tell: it moves only when rows change.)
    pub fn synced_since(&self, at: Instant) -> bool {
        lock(&self.watermark).synced_from.is_some_and(|s| s >= at)
    }

    /// Open gap ranges, for `/admin/filters`; `None` unless sync uses integer watermarks.
    pub fn sync_open_gaps(&self) -> Option<usize> {
        let p = lock(&self.watermark);
        matches!(p.mark, Some(Watermark::Int(_))).then(|| p.gaps.len())
    }

    /// A full build read the source from `start`: moves the watermark there if that is
    /// ahead, and then (integer watermarks) opens the `overlap_ids` ids below it as gaps,
    /// for rows whose transactions were still open while the build scanned. When sync is
    /// already past `start`, nothing changes.
    pub fn start_sync_at(&self, start: Watermark) {
        let mut p = lock(&self.watermark);
        if p.advance(start) {
            if let Watermark::Int(id) = start {
                p.gaps.open_below(id, Instant::now());
            }
            self.metrics.set_sync_open_gaps(p.gaps.len());
        }
    }

    /// Applies the ids an integer-watermark poll read (any order; sorted here): closes
    /// the gaps they fill, opens gaps for the ids between `prev` (the watermark the poll
    /// was computed from) and the largest id read that it skipped, expires old gaps,
    /// and moves the watermark to the largest id. `started` is when its query was sent.
    pub fn record_poll_ids(&self, prev: i64, ids: &mut Vec<i64>, started: Instant) -> PollGaps {
        ids.sort_unstable();
        ids.dedup();
        let mut p = lock(&self.watermark);
        let report = p.gaps.record_poll(prev, ids, started, Instant::now());
        if let Some(&newest) = ids.last() {
            p.advance(Watermark::Int(newest));
        }
        self.metrics.set_sync_open_gaps(p.gaps.len());
        report
    }
}

/// The sync watermark and the gaps below it, behind one lock so that a poll's update and
/// a build's swap never interleave.
pub(super) struct SyncPosition {
    /// The largest watermark applied; `None` before the first build or without sync.
    mark: Option<Watermark>,
    /// Ids below `mark` that no poll has read yet (integer watermarks only).
    gaps: Gaps,
    /// When the latest successful poll on this instance started.
    synced_from: Option<Instant>,
    /// Binlog mode: how many times a build or load set a new position (the stream
    /// compares it with the one it started from).
    restarts: u64,
    /// Binlog mode: source keys deleted since the position.
    deleted: u64,
}

impl SyncPosition {
    pub(super) fn new(config: &FilterConfig) -> SyncPosition {
        let gaps = match &config.sync {
            Some(s) => Gaps::new(s.gap_timeout, s.overlap_ids, MAX_OPEN_RANGES),
            None => Gaps::new(std::time::Duration::ZERO, 0, MAX_OPEN_RANGES),
        };
        SyncPosition {
            mark: None,
            gaps,
            synced_from: None,
            restarts: 0,
            deleted: 0,
        }
    }

    /// Moves the mark forward; true if it moved. A binlog position is a filter's own
    /// (built or loaded there): it replaces the mark, whatever the stream had reached,
    /// and the stream starts again from it, counting deletes afresh.
    fn advance(&mut self, to: Watermark) -> bool {
        if let Watermark::Binlog(_) = to {
            self.mark = Some(to);
            self.restarts += 1;
            self.deleted = 0;
            return true;
        }
        let ahead = self.mark.is_none_or(|cur| to > cur);
        if ahead {
            self.mark = Some(to);
        }
        ahead
    }
}
