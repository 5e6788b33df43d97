//! The rows incremental sync has already applied, so that it can tell a changed row from
//! one it reads again. Polls overlap (timestamps reach back by `overlap`, integer ids
//! start from the lowest open gap): most rows a poll reads were read by an earlier one.
//! A row is *changed* when its (key, watermark value) pair was not seen by an earlier
//! poll; sync drops every cache entry of a changed row and only the negative entries of
//! the others. Pure bookkeeping: it runs no queries and touches no cache.
//!
//! The memory is bounded. Pairs whose watermark is below a poll's start point cannot be
//! read again and are forgotten. Past [`MAX_REMEMBERED_ROWS`], a poll reports every row it
//! read as changed and the memory starts over: an unneeded drop costs one origin call,
//! a skipped one serves an old row for a whole TTL.

use std::collections::HashMap;

use bloomgate_core::watermark::Watermark;

/// (key, watermark) pairs kept at most. A poll whose window holds more reports all its
/// rows as changed.
pub const MAX_REMEMBERED_ROWS: usize = 500_000;

/// The watermark values seen for one key: one, unless the sync query returns several
/// rows per key (a change log, a join).
#[derive(Debug)]
enum Marks {
    One(Watermark),
    Many(Vec<Watermark>),
}

impl Marks {
    fn contains(&self, w: Watermark) -> bool {
        match self {
            Marks::One(m) => *m == w,
            Marks::Many(ms) => ms.contains(&w),
        }
    }

    fn push(&mut self, w: Watermark) {
        match self {
            Marks::One(m) => *self = Marks::Many(vec![*m, w]),
            Marks::Many(ms) => ms.push(w),
        }
    }

    /// Keeps the marks at or above `start`; returns how many it dropped, and whether
    /// none is left.
    fn retain_from(&mut self, start: Watermark) -> (usize, bool) {
        match self {
            Marks::One(m) if *m < start => (1, true),
            Marks::One(_) => (0, false),
            Marks::Many(ms) => {
                let before = ms.len();
                ms.retain(|m| *m >= start);
                (before - ms.len(), ms.is_empty())
            }
        }
    }
}

/// What one poll's rows are, and what happened to the memory.
#[derive(Debug, Default)]
pub struct SeenPoll {
    /// One flag per row, in the order given: true when the row changed.
    pub changed: Vec<bool>,
    /// The rows did not fit under the cap: every row was reported as changed and the
    /// memory was cleared.
    pub overflowed: bool,
    /// This poll overflowed and the one before did not (for logging once per episode).
    pub overflow_began: bool,
    /// Pairs forgotten because their watermark is below the poll's start point.
    pub pruned: usize,
}

impl SeenPoll {
    /// How many rows changed.
    pub fn changed_rows(&self) -> usize {
        self.changed.iter().filter(|c| **c).count()
    }
}

/// The (canonical key bytes, watermark) pairs read by recent polls of one filter.
#[derive(Debug)]
pub struct SeenRows {
    /// Canonical key bytes → the watermark values read for it.
    by_key: HashMap<Box<[u8]>, Marks>,
    /// Pairs held over all keys.
    pairs: usize,
    /// At most this many pairs are held.
    cap: usize,
    /// The last poll overflowed.
    overflowing: bool,
}

impl SeenRows {
    /// An empty memory holding at most `cap` pairs. The first poll of an empty memory
    /// reports every row it reads as changed (after a start, that drops the cache entries
    /// of the rows in the first window once: a cost, never a stale answer).
    pub fn new(cap: usize) -> SeenRows {
        SeenRows {
            by_key: HashMap::new(),
            pairs: 0,
            cap: cap.max(1),
            overflowing: false,
        }
    }

    /// Pairs held.
    pub fn len(&self) -> usize {
        self.pairs
    }

    /// True when no pair is held.
    pub fn is_empty(&self) -> bool {
        self.pairs == 0
    }

    /// Applies one poll that read from `start` (its query's `>= ?`): forgets the pairs
    /// below `start`, then tells for each row (canonical key bytes, watermark) whether
    /// it changed, and remembers it. A row without a watermark value (NULL) is always
    /// changed: there is nothing to recognise it by.
    pub fn poll<K: AsRef<[u8]>>(
        &mut self,
        start: Watermark,
        rows: impl IntoIterator<Item = (K, Option<Watermark>)>,
    ) -> SeenPoll {
        let mut report = SeenPoll {
            pruned: self.forget_below(start),
            ..SeenPoll::default()
        };
        for (key, mark) in rows {
            let changed = match mark {
                None => true,
                Some(_) if report.overflowed => true,
                Some(w) => self.remember(key.as_ref(), w),
            };
            report.changed.push(changed);
            if self.pairs > self.cap && !report.overflowed {
                report.overflowed = true;
                self.by_key.clear();
                self.pairs = 0;
            }
        }
        if report.overflowed {
            report.changed.iter_mut().for_each(|c| *c = true);
        }
        report.overflow_began = report.overflowed && !self.overflowing;
        self.overflowing = report.overflowed;
        report
    }

    /// Records `(key, w)`; true if it was not held yet.
    fn remember(&mut self, key: &[u8], w: Watermark) -> bool {
        if let Some(marks) = self.by_key.get_mut(key) {
            if marks.contains(w) {
                return false;
            }
            marks.push(w);
        } else {
            self.by_key.insert(key.into(), Marks::One(w));
        }
        self.pairs += 1;
        true
    }

    /// Forgets the pairs whose watermark is below `start`; returns how many.
    fn forget_below(&mut self, start: Watermark) -> usize {
        let mut pruned = 0;
        self.by_key.retain(|_, marks| {
            let (dropped, empty) = marks.retain_from(start);
            pruned += dropped;
            !empty
        });
        self.pairs -= pruned;
        pruned
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use proptest::collection::vec;
    use proptest::prelude::*;

    use super::*;

    fn t(us: i64) -> Watermark {
        Watermark::TimeMicros(us)
    }

    fn poll(seen: &mut SeenRows, start: i64, rows: &[(&str, i64)]) -> Vec<bool> {
        let r = seen.poll(
            t(start),
            rows.iter().map(|(k, w)| (k.as_bytes(), Some(t(*w)))),
        );
        assert!(!r.overflowed);
        r.changed
    }

    #[test]
    fn overlapping_polls_report_each_pair_once() {
        let mut seen = SeenRows::new(100);
        // The first poll knows nothing yet: all changed.
        assert_eq!(poll(&mut seen, 0, &[("a", 10), ("b", 12)]), [true, true]);
        // Read again through the overlap, plus a new row.
        assert_eq!(
            poll(&mut seen, 5, &[("a", 10), ("b", 12), ("c", 14)]),
            [false, false, true]
        );
        // `a` updated: a new watermark for the same key.
        assert_eq!(
            poll(&mut seen, 8, &[("b", 12), ("c", 14), ("a", 16)]),
            [false, false, true]
        );
        assert_eq!(seen.len(), 4);
        // Start past 12: (a, 10) and (b, 12) can no longer be read and are forgotten.
        let r = seen.poll(t(13), [("c".as_bytes(), Some(t(14)))]);
        assert_eq!((r.changed, r.pruned), (vec![false], 2));
        assert_eq!(seen.len(), 2);
    }

    #[test]
    fn a_row_without_a_watermark_is_always_changed() {
        let mut seen = SeenRows::new(100);
        for _ in 0..3 {
            let r = seen.poll(t(0), [(&b"k"[..], None)]);
            assert_eq!(r.changed, [true]);
        }
        assert!(seen.is_empty());
    }

    #[test]
    fn several_rows_per_key_are_told_apart_by_watermark() {
        let mut seen = SeenRows::new(100);
        assert_eq!(poll(&mut seen, 0, &[("k", 1), ("k", 2)]), [true, true]);
        assert_eq!(
            poll(&mut seen, 0, &[("k", 2), ("k", 1), ("k", 3)]),
            [false, false, true]
        );
        let r = seen.poll(t(2), [(&b"k"[..], Some(t(2)))]);
        assert_eq!((r.changed, r.pruned), (vec![false], 1));
        assert_eq!(seen.len(), 2);
    }

    #[test]
    fn integer_watermarks_are_remembered_the_same_way() {
        let mut seen = SeenRows::new(100);
        let rows = |ids: &[i64]| -> Vec<(Vec<u8>, Option<Watermark>)> {
            ids.iter()
                .map(|id| (format!("sku{id}").into_bytes(), Some(Watermark::Int(*id))))
                .collect()
        };
        let first = rows(&[7, 9]);
        let r = seen.poll(
            Watermark::Int(7),
            first.iter().map(|(k, w)| (k.as_slice(), *w)),
        );
        assert_eq!(r.changed, [true, true]);
        // The gap at 8 is read again from 7: 7 and 9 are known, 8 is new.
        let again = rows(&[7, 8, 9]);
        let r = seen.poll(
            Watermark::Int(7),
            again.iter().map(|(k, w)| (k.as_slice(), *w)),
        );
        assert_eq!(r.changed, [false, true, false]);
    }

    #[test]
    fn past_the_cap_every_row_of_the_poll_is_changed_and_the_memory_starts_over() {
        let mut seen = SeenRows::new(3);
        assert_eq!(poll(&mut seen, 0, &[("a", 1), ("b", 1)]), [true, true]);
        // Two known pairs and two new ones: four do not fit in three.
        let r = seen.poll(
            t(0),
            [("a", 1), ("b", 1), ("c", 1), ("d", 1)]
                .iter()
                .map(|(k, w)| (k.as_bytes(), Some(t(*w)))),
        );
        assert!(r.overflowed && r.overflow_began);
        assert_eq!(r.changed, [true; 4]);
        assert!(seen.is_empty());
        // The window still does not fit: again every row.
        let r = seen.poll(
            t(0),
            [("a", 1), ("b", 1), ("c", 1), ("d", 1)]
                .iter()
                .map(|(k, w)| (k.as_bytes(), Some(t(*w)))),
        );
        assert!(r.overflowed && !r.overflow_began);
        assert_eq!(r.changed, [true; 4]);
        // Once the window fits, the memory works again (its first poll reports all).
        assert_eq!(poll(&mut seen, 1, &[("c", 1), ("d", 1)]), [true, true]);
        assert_eq!(poll(&mut seen, 1, &[("c", 1), ("d", 1)]), [false, false]);
    }

    /// One poll: its start, as a step forward from the previous one, and the rows it
    /// reads (key, watermark as an offset from its start).
    fn polls() -> impl Strategy<Value = Vec<(i64, Vec<(u8, i64)>)>> {
        vec((0i64..4, vec((0u8..12, 0i64..10), 0..16)), 1..40)
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        /// Polls with moving, overlapping windows. Without a cap: a pair is reported
        /// changed the first time it is read and never again (below the start it cannot
        /// be read, so pruning loses nothing), and the memory holds exactly the pairs at
        /// or above the last start. With a cap too small for some windows: a poll
        /// overflows exactly when its window holds more pairs than the cap, then reports
        /// every row; and no row is ever reported unchanged unless an earlier read saw
        /// its pair.
        #[test]
        fn each_new_pair_is_reported_once_and_never_a_changed_one_missed(
            polls in polls(),
            cap in prop_oneof![Just(usize::MAX), 1usize..20],
        ) {
            let mut seen = SeenRows::new(cap);
            // Every pair read so far, and what the memory should hold.
            let mut read: HashSet<(u8, i64)> = HashSet::new();
            let mut held: HashSet<(u8, i64)> = HashSet::new();
            let mut start = 0i64;
            for (step, rows) in polls {
                start += step;
                let rows: Vec<(u8, i64)> = rows.into_iter().map(|(k, d)| (k, start + d)).collect();
                let keys: Vec<[u8; 1]> = rows.iter().map(|(k, _)| [*k]).collect();
                let r = seen.poll(
                    t(start),
                    keys.iter().zip(&rows).map(|(k, (_, w))| (&k[..], Some(t(*w)))),
                );
                prop_assert_eq!(r.changed.len(), rows.len());
                let mut known = read.clone();
                for (row, changed) in rows.iter().zip(&r.changed) {
                    if !changed {
                        prop_assert!(known.contains(row), "{:?} reported unchanged, never read", row);
                    }
                    if cap == usize::MAX {
                        prop_assert_eq!(*changed, !known.contains(row), "{:?}", row);
                    }
                    known.insert(*row);
                }
                held.retain(|(_, w)| *w >= start);
                held.extend(rows.iter().copied());
                prop_assert_eq!(r.overflowed, held.len() > cap);
                if r.overflowed {
                    prop_assert!(r.changed.iter().all(|c| *c));
                    held.clear();
                }
                prop_assert_eq!(seen.len(), held.len());
                read = known;
            }
        }
    }
}
