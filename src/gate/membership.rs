//! Membership: the one place that answers "is this key maybe present", takes "this key
//! is present now", says how full the set is and snapshots it. The in-process blocked
//! Bloom filter is its one kind today.
//!
//! A kind held elsewhere (a filter in Redis, another process) joins as another arm of
//! [`Membership`] and of [`Probe`]: its check is sent and awaited, while the local arm
//! stays a plain synchronous call. The hot path matches on [`Probe`] and awaits only the
//! remote arm, so the local check gains no boxed future, no allocation and no dynamic
//! dispatch from the seam.

use std::path::Path;

use bloomgate_core::filter::snapshot::{self, SnapshotError, SnapshotInfo};
use bloomgate_core::filter::{BloomFilter, FilterStats};
use bloomgate_core::watermark::Watermark;

/// Where a filter's members are held.
#[derive(Debug)]
pub enum Membership {
    /// A Bloom filter in this process's memory.
    Local(BloomFilter),
}

/// The answer to a membership check.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Probe {
    /// Answered at once: `true` if the key may be present, `false` if it certainly is not.
    Ready(bool),
}

impl Membership {
    /// Checks a key's canonical bytes.
    #[inline]
    pub fn probe(&self, key: &[u8]) -> Probe {
        match self {
            Membership::Local(f) => Probe::Ready(f.contains(key)),
        }
    }

    /// The in-process filter, when the set is one.
    pub fn local(&self) -> Option<&BloomFilter> {
        match self {
            Membership::Local(f) => Some(f),
        }
    }

    /// Adds a key's canonical bytes; true if the set changed (see [`BloomFilter::insert`]).
    pub fn insert(&self, key: &[u8]) -> bool {
        match self {
            Membership::Local(f) => f.insert(key),
        }
    }

    /// How many distinct keys were added, approximately.
    pub fn items(&self) -> u64 {
        match self {
            Membership::Local(f) => f.items(),
        }
    }

    /// Size and fill.
    pub fn stats(&self) -> FilterStats {
        match self {
            Membership::Local(f) => f.stats(),
        }
    }

    /// Writes the set to a snapshot file at `path` recording `watermark`. Blocking I/O:
    /// call it from a blocking thread.
    ///
    /// # Errors
    ///
    /// The snapshot writer's, naming the step that failed.
    pub fn snapshot(
        &self,
        path: &Path,
        watermark: Option<Watermark>,
    ) -> Result<SnapshotInfo, SnapshotError> {
        match self {
            Membership::Local(f) => snapshot::write(path, f, watermark),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bloomgate_core::filter::BloomParams;

    fn local(n: u64) -> Membership {
        let params = BloomParams::optimal(n, 0.01).expect("valid params");
        Membership::Local(BloomFilter::new(params, 7))
    }

    #[test]
    fn a_local_set_answers_at_once_and_never_forgets() {
        let m = local(10_000);
        for i in 0..5_000u32 {
            m.insert(format!("k{i}").as_bytes());
        }
        for i in 0..5_000u32 {
            assert_eq!(m.probe(format!("k{i}").as_bytes()), Probe::Ready(true));
        }
        let refused = (0..5_000u32)
            .filter(|i| m.probe(format!("absent{i}").as_bytes()) == Probe::Ready(false))
            .count();
        assert!(
            refused > 4_800,
            "only {refused} of 5000 absent keys refused"
        );
        let stats = m.stats();
        assert_eq!(stats.items, m.items());
        assert!(stats.items > 4_900 && stats.items <= 5_000, "{stats:?}");
    }

    #[test]
    fn a_local_snapshot_reads_back_as_the_same_set() {
        let m = local(1_000);
        for i in 0..800u32 {
            m.insert(format!("k{i}").as_bytes());
        }
        let dir = std::env::temp_dir().join(format!("bloomgate-membership-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let path = dir.join("set.bgf");
        m.snapshot(&path, Some(Watermark::Int(42)))
            .expect("snapshot");
        let read = snapshot::read(&path).expect("read back");
        let _ = std::fs::remove_dir_all(&dir);
        assert_eq!(read.watermark, Some(Watermark::Int(42)));
        let back = Membership::Local(read.filter);
        for i in 0..800u32 {
            assert_eq!(back.probe(format!("k{i}").as_bytes()), Probe::Ready(true));
        }
        assert_eq!(back.items(), m.items());
    }
}
