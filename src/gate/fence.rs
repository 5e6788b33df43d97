//! A filter's own side of an admission, and the fences that origin lookups take. Adding
//! a key ([`Filter::add_key`]) puts it in the live filter, keeps it for the next build or
//! load to replay (see `gate::admissions`), and moves its fence stripe; a fence taken
//! before the origin is asked tells afterwards whether a key of its stripe was admitted
//! in between. The cache and the fleet's side of an admission live in `gate::admit`.

use std::hash::BuildHasher;
use std::sync::atomic::{AtomicU64, Ordering};

use super::{Filter, lock};
use bloomgate_core::key::{KeyBytes, NormKey};

impl Filter {
    /// Admits a key: it is present from now on. Adds it to the live filter, keeps it
    /// until a build's source lists it (so the next swap cannot lose it), and moves its
    /// fence stripe. Returns false if no filter is loaded yet; the key is then added when
    /// the first one is. (A filter held in Redis alone has no filter of its own to wait
    /// for: true.) Callers drop the key's negative cache entries afterwards (the
    /// order the fence relies on: filter, stripe, cache).
    pub fn add_key(&self, key: &NormKey<'_>) -> bool {
        let mut bytes = KeyBytes::new();
        let bytes = bytes.of(key);
        let added = {
            let mut admissions = lock(&self.admissions);
            if self.keeps_admissions.load(Ordering::Acquire) {
                admissions.record(bytes);
                self.metrics.set_unconfirmed(admissions.len());
            }
            match self.live.load().as_deref() {
                Some(f) => {
                    f.insert(bytes);
                    true
                }
                None => false,
            }
        };
        self.stripe(bytes).fetch_add(1, Ordering::SeqCst);
        if let Some(held) = self.held.get() {
            held.admit(bytes);
        }
        if added {
            self.watch_capacity();
        }
        // Held in Redis alone: the key is in the copy that answers (or this instance
        // answers for it until it is), with no copy of its own to wait for.
        added || self.held.get().is_some_and(|h| !h.local_copy())
    }

    /// How many admitted keys no build has confirmed yet.
    pub fn unconfirmed_keys(&self) -> usize {
        lock(&self.admissions).len()
    }

    /// Keeps admissions for a build or load to replay again (see `keeps_admissions`):
    /// this instance is about to hold a copy.
    pub fn keep_admissions(&self) {
        let _admissions = lock(&self.admissions);
        self.keeps_admissions.store(true, Ordering::Release);
    }
    /// Stops holding a copy (an instance that does not build a filter held in Redis
    /// alone): drops the live filter, and the admissions kept for a build or load to
    /// replay (nothing would replay them). Cheap when there is neither to drop.
    pub fn release_copy(&self) {
        if !self.keeps_admissions.load(Ordering::Acquire) && self.live.load().is_none() {
            return;
        }
        {
            let mut admissions = lock(&self.admissions);
            self.keeps_admissions.store(false, Ordering::Release);
            admissions.forget_all();
            self.metrics.set_unconfirmed(0);
            if self.live.swap(None).is_some() {
                tracing::info!(filter = %self.name, "dropped this instance's copy of the filter; the copy in Redis answers");
            }
        }
        self.metrics.clear_stats();
        self.publish_metrics();
    }

    /// A fence for a negative entry of `key`: taken before the origin is asked, it tells
    /// afterwards whether the key was admitted in between (so a "not found" read just
    /// before the key's row was committed is not kept).
    pub fn fence(&self, key: &NormKey<'_>) -> Fence<'_> {
        let mut bytes = KeyBytes::new();
        let cell = self.stripe(bytes.of(key));
        Fence {
            cell,
            seen: cell.load(Ordering::SeqCst),
        }
    }

    /// Where `key`'s fence stripe stands now, kept by value: [`Filter::admitted_since`]
    /// tells later whether a key of that stripe was admitted in between.
    pub fn admission_mark(&self, key: &NormKey<'_>) -> AdmissionMark {
        let mut bytes = KeyBytes::new();
        let stripe = self.stripe_index(bytes.of(key));
        AdmissionMark {
            stripe,
            seen: self.stripes[stripe].load(Ordering::SeqCst),
        }
    }

    /// True if a key of `mark`'s stripe (taken on this filter) was admitted since.
    pub fn admitted_since(&self, mark: &AdmissionMark) -> bool {
        self.stripes
            .get(mark.stripe)
            .is_some_and(|c| c.load(Ordering::SeqCst) != mark.seen)
    }

    fn stripe(&self, bytes: &[u8]) -> &AtomicU64 {
        &self.stripes[self.stripe_index(bytes)]
    }

    fn stripe_index(&self, bytes: &[u8]) -> usize {
        self.stripe_hasher.hash_one(bytes) as usize & (FENCE_STRIPES - 1)
    }
}

/// Stripes of admission counters per gate (a power of two). Two keys share a stripe with
/// probability 1/1024, and then an admission of one only costs the other a negative
/// entry that is not kept.
pub(super) const FENCE_STRIPES: usize = 1024;

/// Proof that no key of a stripe was admitted since it was taken; see [`Filter::fence`].
pub struct Fence<'g> {
    cell: &'g AtomicU64,
    seen: u64,
}

impl Fence<'_> {
    /// True while no key of this stripe has been admitted since the fence was taken.
    pub fn holds(&self) -> bool {
        self.cell.load(Ordering::SeqCst) == self.seen
    }
}

/// A key's fence stripe at one moment, by value; see [`Filter::admission_mark`].
#[derive(Debug, Clone, Copy)]
pub struct AdmissionMark {
    stripe: usize,
    seen: u64,
}
