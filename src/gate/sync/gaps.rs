//! Gap tracking for integer sync watermarks. Auto-increment ids are handed out at insert
//! but become visible at commit, in any order: a poll can see id 9 while id 7 is still in
//! an open transaction. The ids below the watermark that no poll has seen are kept here
//! as open ranges; each poll starts from the lowest one (so it reads them again), a range
//! shrinks or splits as its rows appear, and what is left expires after `gap_timeout`
//! (a rolled-back insert leaves a gap that never fills). Pure bookkeeping: it runs no
//! queries and reads no clock (callers pass the instants).

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

/// Open ranges kept at most; past it the oldest are dropped (and counted), so a table
/// full of holes cannot make the tracker grow without bound.
pub const MAX_OPEN_RANGES: usize = 10_000;

/// A run of consecutive ids that no poll has seen, and when it was opened.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GapRange {
    /// Lowest id of the range.
    pub first: i64,
    /// Highest id of the range (inclusive).
    pub last: i64,
    /// When a poll (or a build) first found these ids missing.
    pub opened: Instant,
}

impl GapRange {
    /// How many ids the range holds.
    pub fn ids(&self) -> u64 {
        span(self.first, self.last)
    }
}

/// What one poll did to the open gaps.
#[derive(Debug, Default)]
pub struct PollGaps {
    /// Ranges opened for ids the poll skipped over.
    pub opened: usize,
    /// Ids that were open and that the poll read.
    pub closed: u64,
    /// Ranges that stayed open for `gap_timeout` and are no longer read again.
    pub expired: Vec<GapRange>,
    /// The oldest ranges, dropped because more than the cap were open.
    pub dropped: Vec<GapRange>,
}

/// The open gaps of one filter.
#[derive(Debug)]
pub struct Gaps {
    /// First id → (last id, when opened). Ranges never overlap.
    open: BTreeMap<i64, (i64, Instant)>,
    /// How long a gap is read again before it is given up.
    timeout: Duration,
    /// How many ids below a build's start mark are opened as gaps.
    reach_back: u64,
    /// At most this many ranges stay open after a poll.
    max_ranges: usize,
}

impl Gaps {
    /// No open gaps. `timeout` is how long a gap is read again, `reach_back` how many ids
    /// below a full build's start mark the next poll reads again, `max_ranges` the cap.
    pub fn new(timeout: Duration, reach_back: u64, max_ranges: usize) -> Gaps {
        Gaps {
            open: BTreeMap::new(),
            timeout,
            reach_back,
            max_ranges: max_ranges.max(1),
        }
    }

    /// The lowest open id, if any.
    pub fn lowest(&self) -> Option<i64> {
        self.open.keys().next().copied()
    }

    /// Where the next poll starts when the watermark is `mark`: the lowest open gap, or
    /// the watermark itself when that is lower or nothing is open.
    pub fn resume_from(&self, mark: i64) -> i64 {
        self.lowest().map_or(mark, |low| low.min(mark))
    }

    /// The watermark to persist for a restart: `mark`, or the id just below the lowest
    /// open gap when that is lower. A restart starts with no gaps and takes its watermark
    /// as read up to there, so its first poll reads the gap's ids again (`>=`) and, for
    /// those still missing, opens them again.
    pub fn restart_mark(&self, mark: i64) -> i64 {
        self.lowest()
            .map_or(mark, |low| low.saturating_sub(1).min(mark))
    }

    /// The watermark a snapshot of a build that started at `start` records: the
    /// [`restart_mark`](Gaps::restart_mark), and also below the `reach_back` window under
    /// `start`. The build did not see rows in flight in that window, and a poll that has
    /// read past them may not have recorded its gaps yet.
    pub fn snapshot_mark(&self, start: i64) -> i64 {
        let below_window = match i64::try_from(self.reach_back) {
            Ok(0) => start,
            Ok(n) => start.saturating_sub(n).saturating_sub(1),
            Err(_) => i64::MIN,
        };
        self.restart_mark(start).min(below_window)
    }

    /// Open ranges.
    pub fn len(&self) -> usize {
        self.open.len()
    }

    /// True when no gap is open.
    pub fn is_empty(&self) -> bool {
        self.open.is_empty()
    }

    /// Open ids over all ranges.
    pub fn ids(&self) -> u64 {
        self.open.iter().fold(0u64, |n, (&first, &(last, _))| {
            n.saturating_add(span(first, last))
        })
    }

    /// The open ranges, lowest first.
    pub fn ranges(&self) -> impl Iterator<Item = GapRange> + '_ {
        self.open.iter().map(|(&first, &(last, opened))| GapRange {
            first,
            last,
            opened,
        })
    }

    /// A full build read the source up to `mark`: opens the `reach_back` ids below it,
    /// whose transactions may still have been open while the build scanned. Ids already
    /// open keep their older opening time.
    pub fn open_below(&mut self, mark: i64, now: Instant) {
        if self.reach_back == 0 || mark == i64::MIN {
            return;
        }
        let first = mark.saturating_sub(i64::try_from(self.reach_back).unwrap_or(i64::MAX));
        self.open(first, mark - 1, now);
    }

    /// Applies one poll. `prev` is the watermark before the poll, `seen` the ids it read
    /// (sorted, without duplicates; every id at or above its start point that was visible),
    /// `started` when its query was sent and `now` when it finished.
    ///
    /// Ids the poll read close their gaps; ids between `prev` and the largest id read
    /// that it did not read open new ones; gaps opened `timeout` or longer before the poll
    /// started expire (a row committed before then was visible to this poll, so it was
    /// read first). When `prev` is `i64::MIN` (the source was empty at the last build)
    /// the smallest id read stands in for a build's start mark.
    pub fn record_poll(
        &mut self,
        prev: i64,
        seen: &[i64],
        started: Instant,
        now: Instant,
    ) -> PollGaps {
        debug_assert!(
            seen.windows(2).all(|w| w[0] < w[1]),
            "ids sorted and unique"
        );
        let mut report = PollGaps::default();
        for &id in seen {
            if self.close(id) {
                report.closed += 1;
            }
        }
        let floor = match (prev, seen.first()) {
            (i64::MIN, Some(&low)) => {
                self.open_below(low, now);
                low
            }
            _ => prev,
        };
        let mut next = floor.checked_add(1);
        for &id in seen.iter().filter(|&&id| id > floor) {
            let Some(expected) = next else { break };
            if id > expected {
                self.open(expected, id - 1, now);
                report.opened += 1;
            }
            next = id.checked_add(1);
        }
        report.expired = self.expire(started);
        report.dropped = self.cap();
        report
    }

    /// Removes `id` from the range holding it (splitting the range); false if not open.
    fn close(&mut self, id: i64) -> bool {
        let Some((&first, &(last, opened))) = self.open.range(..=id).next_back() else {
            return false;
        };
        if last < id {
            return false;
        }
        self.open.remove(&first);
        if first < id {
            self.open.insert(first, (id - 1, opened));
        }
        if id < last {
            self.open.insert(id + 1, (last, opened));
        }
        true
    }

    /// Opens the ids of `[first, last]` that are not open yet.
    fn open(&mut self, first: i64, last: i64, now: Instant) {
        if first > last {
            return;
        }
        let mut cursor = Some(first);
        // Ranges that overlap [first, last]: the one starting at or before `first`, and
        // those starting inside.
        let before = self
            .open
            .range(..=first)
            .next_back()
            .map(|(&f, &(l, _))| (f, l));
        let inside: Vec<(i64, i64)> = self
            .open
            .range(first..=last)
            .map(|(&f, &(l, _))| (f, l))
            .collect();
        for (f, l) in before.into_iter().chain(inside) {
            let Some(from) = cursor else { break };
            if l < from {
                continue;
            }
            if f > from {
                self.open.insert(from, (f - 1, now));
            }
            cursor = l.checked_add(1);
        }
        if let Some(from) = cursor.filter(|&from| from <= last) {
            self.open.insert(from, (last, now));
        }
    }

    /// Removes and returns the ranges opened `timeout` or longer before `started`.
    fn expire(&mut self, started: Instant) -> Vec<GapRange> {
        let timeout = self.timeout;
        let expired: Vec<GapRange> = self
            .ranges()
            .filter(|r| started.saturating_duration_since(r.opened) >= timeout)
            .collect();
        for r in &expired {
            self.open.remove(&r.first);
        }
        expired
    }

    /// Drops the oldest ranges (the lowest first among equally old) beyond the cap.
    fn cap(&mut self) -> Vec<GapRange> {
        let excess = self.open.len().saturating_sub(self.max_ranges);
        if excess == 0 {
            return Vec::new();
        }
        let mut all: Vec<GapRange> = self.ranges().collect();
        all.sort_by_key(|r| (r.opened, r.first));
        all.truncate(excess);
        for r in &all {
            self.open.remove(&r.first);
        }
        all
    }
}

/// Ids over `ranges` (saturating: a range can span most of the id space).
pub fn total_ids(ranges: &[GapRange]) -> u64 {
    ranges.iter().fold(0u64, |n, r| n.saturating_add(r.ids()))
}

/// Ids in `[first, last]`.
fn span(first: i64, last: i64) -> u64 {
    u64::try_from(i128::from(last) - i128::from(first) + 1).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use proptest::collection::vec;
    use proptest::prelude::*;

    use super::*;

    const MIN: Duration = Duration::from_secs(60);

    fn gaps() -> Gaps {
        Gaps::new(MIN, 0, MAX_OPEN_RANGES)
    }

    fn spans(g: &Gaps) -> Vec<(i64, i64)> {
        g.ranges().map(|r| (r.first, r.last)).collect()
    }

    #[test]
    fn skipped_ids_open_gaps_and_the_next_poll_starts_from_the_lowest() {
        let t = Instant::now();
        let mut g = gaps();
        let r = g.record_poll(10, &[10, 12, 13, 17], t, t);
        assert_eq!(r.opened, 2);
        assert_eq!(spans(&g), [(11, 11), (14, 16)]);
        assert_eq!(g.ids(), 4);
        assert_eq!(g.resume_from(17), 11);
        assert_eq!(g.restart_mark(17), 10);
        assert_eq!(gaps().resume_from(17), 17);
        assert_eq!(gaps().restart_mark(17), 17);
    }

    #[test]
    fn a_jump_is_one_range_and_an_id_inside_splits_it() {
        let t = Instant::now();
        let mut g = gaps();
        g.record_poll(0, &[1_000_001], t, t);
        assert_eq!(spans(&g), [(1, 1_000_000)]);
        let r = g.record_poll(1_000_001, &[500, 1_000_001], t, t);
        assert_eq!(r.closed, 1);
        assert_eq!(spans(&g), [(1, 499), (501, 1_000_000)]);
        // The ends of a range, and an id that is not open.
        g.record_poll(1_000_001, &[1, 499, 1_000_000, 1_000_001], t, t);
        assert_eq!(spans(&g), [(2, 498), (501, 999_999)]);
        assert_eq!(g.ids(), 497 + 999_499);
    }

    #[test]
    fn closing_every_id_empties_the_tracker() {
        let t = Instant::now();
        let mut g = gaps();
        g.record_poll(0, &[5], t, t);
        let r = g.record_poll(5, &[1, 2, 3, 4, 5], t, t);
        assert_eq!(r.closed, 4);
        assert!(g.is_empty());
        assert_eq!(g.resume_from(5), 5);
    }

    #[test]
    fn gaps_expire_after_the_timeout_counted_from_the_poll_start() {
        let t = Instant::now();
        let mut g = gaps();
        g.record_poll(0, &[3], t, t + Duration::from_secs(1));
        g.record_poll(
            3,
            &[3, 6],
            t + Duration::from_secs(30),
            t + Duration::from_secs(30),
        );
        assert_eq!(spans(&g), [(1, 2), (4, 5)]);
        // A poll that started 60 s after the first gap opened expires it; one that
        // started a moment earlier but finished later does not.
        let r = g.record_poll(
            6,
            &[6],
            t + Duration::from_secs(60),
            t + Duration::from_secs(99),
        );
        assert!(r.expired.is_empty());
        let r = g.record_poll(
            6,
            &[6],
            t + Duration::from_secs(61),
            t + Duration::from_secs(61),
        );
        assert_eq!(r.expired.len(), 1);
        assert_eq!((r.expired[0].first, r.expired[0].last), (1, 2));
        assert_eq!(spans(&g), [(4, 5)]);
        // An id read in the same poll as the expiry is closed first.
        let r = g.record_poll(
            6,
            &[4, 6],
            t + Duration::from_secs(90),
            t + Duration::from_secs(90),
        );
        assert_eq!(r.closed, 1);
        assert_eq!(r.expired[0].ids(), 1);
        assert!(g.is_empty());
    }

    #[test]
    fn a_split_range_keeps_its_opening_time() {
        let t = Instant::now();
        let mut g = gaps();
        g.record_poll(0, &[10], t, t);
        g.record_poll(
            10,
            &[5, 10],
            t + Duration::from_secs(59),
            t + Duration::from_secs(59),
        );
        let r = g.record_poll(10, &[10], t + MIN, t + MIN);
        assert_eq!(r.expired.len(), 2);
        assert!(g.is_empty());
    }

    #[test]
    fn past_the_cap_the_oldest_ranges_are_dropped() {
        let t = Instant::now();
        let mut g = Gaps::new(MIN, 0, 3);
        g.record_poll(0, &[2, 4], t, t);
        let later = t + Duration::from_secs(1);
        let r = g.record_poll(4, &[4, 6, 8, 10], later, later);
        assert_eq!(r.opened, 3);
        assert_eq!(
            r.dropped.iter().map(|d| d.first).collect::<Vec<_>>(),
            [1, 3]
        );
        assert_eq!(spans(&g), [(5, 5), (7, 7), (9, 9)]);
    }

    #[test]
    fn a_build_opens_the_ids_below_its_start_mark() {
        let t = Instant::now();
        let mut g = Gaps::new(MIN, 1000, MAX_OPEN_RANGES);
        g.open_below(5_000, t);
        assert_eq!(spans(&g), [(4_000, 4_999)]);
        assert_eq!(g.resume_from(5_000), 4_000);
        assert_eq!(g.restart_mark(5_000), 3_999);
        assert_eq!(Gaps::new(MIN, 1000, 1).snapshot_mark(5_000), 3_999);
        assert_eq!(Gaps::new(MIN, 0, 1).snapshot_mark(5_000), 5_000);
        assert_eq!(Gaps::new(MIN, u64::MAX, 1).snapshot_mark(5_000), i64::MIN);
        // A restart from that mark, with its first poll before the insert at 4_500
        // commits, finds the same ids missing.
        let mut restarted = Gaps::new(MIN, 1000, MAX_OPEN_RANGES);
        let seen: Vec<i64> = (3_999..=5_000).filter(|&id| id != 4_500).collect();
        restarted.record_poll(3_999, &seen, t, t);
        assert_eq!(spans(&restarted), [(4_500, 4_500)]);
        // Ids that are already open keep their range and its age.
        let mut g = Gaps::new(MIN, 10, MAX_OPEN_RANGES);
        g.record_poll(0, &[3, 7], t, t);
        g.open_below(12, t + Duration::from_secs(1));
        assert_eq!(spans(&g), [(1, 2), (3, 3), (4, 6), (7, 11)]);
        let opened: Vec<Instant> = g.ranges().map(|r| r.opened).collect();
        assert_eq!(
            opened,
            [t, t + Duration::from_secs(1), t, t + Duration::from_secs(1)]
        );
    }

    #[test]
    fn nothing_opens_at_the_edges_of_the_id_space() {
        let t = Instant::now();
        let mut g = Gaps::new(MIN, 1000, MAX_OPEN_RANGES);
        g.open_below(i64::MIN, t);
        assert!(g.is_empty());
        g.record_poll(i64::MAX - 1, &[i64::MAX], t, t);
        assert!(g.is_empty());
        let mut g = Gaps::new(MIN, u64::MAX, MAX_OPEN_RANGES);
        g.open_below(i64::MIN + 2, t);
        assert_eq!(spans(&g), [(i64::MIN, i64::MIN + 1)]);
        assert_eq!(g.ids(), 2);
    }

    #[test]
    fn after_an_empty_source_the_first_ids_read_stand_in_for_a_start_mark() {
        let t = Instant::now();
        let mut g = Gaps::new(MIN, 3, MAX_OPEN_RANGES);
        g.record_poll(i64::MIN, &[10, 12], t, t);
        assert_eq!(spans(&g), [(7, 9), (11, 11)]);
        let mut g = Gaps::new(MIN, 3, MAX_OPEN_RANGES);
        g.record_poll(i64::MIN, &[], t, t);
        assert!(g.is_empty());
    }

    /// One insert: its id, and when it committed (`None`: rolled back). Ids are handed
    /// out in order, each commit comes within the timeout of its id being handed out.
    #[derive(Debug, Clone, Copy)]
    struct Insert {
        id: i64,
        commit: Option<u64>,
    }

    const TIMEOUT_S: u64 = 20;

    /// Inserts in id order; each commits within the timeout (or rolls back), so commits
    /// arrive out of id order. `skip` leaves ids never handed out at all.
    fn inserts() -> impl Strategy<Value = Vec<Insert>> {
        // Half the commits come in the last seconds before the timeout, the hard case.
        let delay = prop_oneof![0..TIMEOUT_S, TIMEOUT_S - 3..TIMEOUT_S];
        vec((0u64..3, 0u64..3, delay, any::<bool>(), 0u8..8), 1..80).prop_map(|raw| {
            let (mut id, mut at) = (0i64, 0u64);
            raw.into_iter()
                .map(|(skip, wait, delay, keep, roll)| {
                    id += 1 + skip as i64;
                    at += wait;
                    let commit = (keep || roll > 0).then_some(at + delay);
                    Insert { id, commit }
                })
                .collect()
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(1024))]

        /// A full build at `build_at` then polls at random intervals, each taking a random
        /// time and reading what had committed at a random moment while it ran, with a
        /// restart from a mark saved earlier (as a snapshot is): every committed id is
        /// read by the build or a poll, and every gap ends closed or expired.
        #[test]
        fn every_committed_id_is_eventually_read(
            ins in inserts(),
            build_at in 0u64..40,
            polls in vec((0u64..6, 0u64..4, 0u64..4), 400),
            saved_at in 0usize..25,
            restart_after in 0usize..8,
            extra_reach in 0u64..3,
        ) {
            let t0 = Instant::now();
            let at = |s: u64| t0 + Duration::from_secs(s);
            let visible = |i: &Insert, s: u64| i.commit.is_some_and(|c| c <= s);
            // The build: the start mark first, then a scan of what is visible.
            let mut mark = ins.iter().filter(|i| visible(i, build_at)).map(|i| i.id).max()
                .unwrap_or(i64::MIN);
            // Just enough to reach the lowest insert open during the build (the documented
            // condition on overlap_ids); after an empty build, enough for every id.
            let open_low = ins.iter().filter(|i| i.id < mark && !visible(i, build_at))
                .map(|i| i.id).min();
            let reach_back = match open_low {
                _ if mark == i64::MIN => 3 * ins.len() as u64 + 3,
                Some(low) => (mark - low) as u64 + extra_reach,
                None => extra_reach,
            };
            let mut g = Gaps::new(Duration::from_secs(TIMEOUT_S), reach_back, MAX_OPEN_RANGES);
            let mut read: BTreeSet<i64> =
                ins.iter().filter(|i| visible(i, build_at)).map(|i| i.id).collect();
            g.open_below(mark, at(build_at));
            let last_commit = ins.iter().filter_map(|i| i.commit).max().unwrap_or(0);
            let mut clock = build_at;
            let (mut saved, mut restarted_at) = (mark, 0);
            for (n, (wait, took, snapshot)) in polls.into_iter().enumerate() {
                if n == saved_at {
                    saved = g.restart_mark(mark);
                }
                if n == saved_at + restart_after {
                    g = Gaps::new(Duration::from_secs(TIMEOUT_S), reach_back, MAX_OPEN_RANGES);
                    mark = saved;
                    restarted_at = clock;
                }
                let started = clock + wait;
                let finished = started + took;
                let sees = started + snapshot.min(took);
                let since = g.resume_from(mark);
                let seen: Vec<i64> = ins
                    .iter()
                    .filter(|i| i.id >= since && visible(i, sees))
                    .map(|i| i.id)
                    .collect();
                g.record_poll(mark, &seen, at(started), at(finished));
                read.extend(&seen);
                mark = mark.max(seen.last().copied().unwrap_or(i64::MIN));
                clock = finished;
            }
            prop_assume!(clock > last_commit.max(build_at).max(restarted_at) + 3 * TIMEOUT_S);
            for i in ins.iter().filter(|i| i.commit.is_some()) {
                prop_assert!(read.contains(&i.id), "id {} committed at {:?} never read", i.id, i.commit);
            }
            prop_assert!(g.is_empty(), "still open: {:?}", g.ranges().collect::<Vec<_>>());
        }
    }
}
