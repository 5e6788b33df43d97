//! The keys a filter was given that no build has confirmed: what every swap replays.

use std::collections::HashSet;

use super::membership::{Membership, Probe};

/// Keys admitted since start-up that no completed build has read from its source, as
/// canonical key bytes. Every swap replays them into the new filter; a build removes the
/// ones its scan listed. What stays is what the source does not hold (yet): those keys
/// are carried from build to build.
#[derive(Default)]
pub(super) struct Admissions {
    keys: HashSet<Box<[u8]>>,
}

impl Admissions {
    pub(super) fn record(&mut self, bytes: &[u8]) {
        if !self.keys.contains(bytes) {
            self.keys.insert(bytes.into());
        }
    }

    pub(super) fn len(&self) -> usize {
        self.keys.len()
    }

    /// Inserts every kept key into `filter`.
    pub(super) fn replay(&self, filter: &Membership) {
        for k in &self.keys {
            filter.insert(k);
        }
    }

    /// A copy of the keys, for a build to look for in its source.
    pub(super) fn snapshot(&self) -> HashSet<Box<[u8]>> {
        self.keys.clone()
    }

    /// Forgets the keys `filter` already holds (a filter built elsewhere that carries them).
    pub(super) fn confirm_held(&mut self, filter: &Membership) {
        self.keys
            .retain(|k| !matches!(filter.probe(k), Probe::Ready(true)));
    }

    /// Forgets the keys a build's source listed.
    pub(super) fn confirm(&mut self, listed: &HashSet<Box<[u8]>>) {
        if !listed.is_empty() {
            self.keys.retain(|k| !listed.contains(k));
        }
    }

    /// Forgets every key (nothing will replay them).
    pub(super) fn forget_all(&mut self) {
        self.keys = HashSet::new();
    }
}
