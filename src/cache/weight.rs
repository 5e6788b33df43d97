//! What the cache's bounds count: the estimated resident bytes of an entry, and how an
//! entry bound, a byte bound or both become moka's capacity and an entry's weight.

use crate::origin::{CachedResponse, HEADER_OVERHEAD, Variant};
use bloomgate_core::config::DEFAULT_MAX_ENTRIES;
use bloomgate_core::key::OwnedKey;

use super::CacheKey;

/// Resident bytes of a positive entry besides its body, stored headers and key, as
/// measured at 1,000,000 entries (`examples/cache_floor.rs`, docs/BENCHMARKS.md): moka's
/// own entry with its per-entry expiry, the key, the answer's fixed part and the body's
/// reference count. An estimate: it is what the byte bound counts per entry.
pub const POSITIVE_ENTRY_OVERHEAD: usize = 480;

/// The same for a negative entry (no body, no answer).
pub const NEGATIVE_ENTRY_OVERHEAD: usize = 400;

/// How one of the two caches is bounded: by entries, by estimated bytes, or by both
/// (whichever is reached first).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Bound {
    /// At most this many entries.
    Entries(u64),
    /// At most this many estimated bytes.
    Bytes(u64),
    /// At most `entries` entries and at most `bytes` bytes.
    Both {
        /// The entry bound.
        entries: u64,
        /// The byte bound.
        bytes: u64,
    },
}

/// Under [`Bound::Both`], the weight of an entry when the entry bound is what counts:
/// moka's capacity is then `entries · ENTRY_UNIT`, and an entry weighs the larger of
/// `ENTRY_UNIT` and its share of the byte bound in the same units, so that neither bound
/// can be passed.
const ENTRY_UNIT: u64 = 1024;

impl Bound {
    /// The bound of `max_entries` and `max_bytes`, either of which may be unset.
    pub fn of(max_entries: Option<u64>, max_bytes: Option<u64>) -> Bound {
        match (max_entries, max_bytes) {
            (Some(entries), Some(bytes)) => Bound::Both { entries, bytes },
            (None, Some(bytes)) => Bound::Bytes(bytes),
            (Some(entries), None) => Bound::Entries(entries),
            (None, None) => Bound::Entries(DEFAULT_MAX_ENTRIES),
        }
    }

    /// moka's `max_capacity`, in the units of [`Bound::weight`].
    pub fn capacity(self) -> u64 {
        match self {
            Bound::Entries(n) => n,
            Bound::Bytes(b) => b,
            Bound::Both { entries, .. } => entries.saturating_mul(ENTRY_UNIT),
        }
    }

    /// The weight of an entry of `bytes` estimated bytes.
    pub fn weight(self, bytes: usize) -> u32 {
        let units = match self {
            Bound::Entries(_) => 1,
            Bound::Bytes(_) => bytes as u128,
            Bound::Both {
                entries,
                bytes: max,
            } => {
                let share = (bytes as u128 * u128::from(entries) * u128::from(ENTRY_UNIT))
                    .div_ceil(u128::from(max.max(1)));
                share.max(u128::from(ENTRY_UNIT))
            }
        };
        u32::try_from(units).unwrap_or(u32::MAX)
    }

    /// Whether entries are weighed at all.
    pub(super) fn weighs(self) -> bool {
        !matches!(self, Bound::Entries(_))
    }
}

/// Estimated heap bytes of a key beyond what every entry has.
fn key_bytes(key: &CacheKey) -> usize {
    let text = match &key.key {
        OwnedKey::Int(_) => 0,
        // The `Arc<str>`'s counts and text.
        OwnedKey::Text(s) => 16 + s.len(),
    };
    let variant = key.variant.as_ref().map_or(0, |v| {
        std::mem::size_of::<Variant>()
            + v.query.as_ref().map_or(0, String::len)
            + v.headers
                .iter()
                .map(|(n, v)| n.as_str().len() + v.len() + HEADER_OVERHEAD)
                .sum::<usize>()
    });
    text + variant
}

/// The estimated resident bytes of a positive entry.
pub fn positive_entry_bytes(key: &CacheKey, value: &CachedResponse) -> usize {
    POSITIVE_ENTRY_OVERHEAD + key_bytes(key) + value.own_bytes()
}

/// The estimated resident bytes of a negative entry.
pub fn negative_entry_bytes(key: &CacheKey) -> usize {
    NEGATIVE_ENTRY_OVERHEAD + key_bytes(key)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// Whatever the entries' sizes, entries whose weights fit the capacity keep both
        /// bounds: no more than `entries` of them, no more than `bytes` bytes in all.
        #[test]
        fn weights_that_fit_keep_both_bounds(
            entries in 1u64..100_000,
            bytes in 65_536u64..(1 << 40),
            sizes in proptest::collection::vec(0usize..(16 << 20), 1..400),
        ) {
            for bound in [
                Bound::Both { entries, bytes },
                Bound::Bytes(bytes),
                Bound::Entries(entries),
            ] {
                let mut used = 0u64;
                let (mut count, mut total) = (0u64, 0u64);
                for &size in &sizes {
                    let w = u64::from(bound.weight(size));
                    prop_assert!(w >= 1);
                    if used + w > bound.capacity() {
                        break;
                    }
                    used += w;
                    count += 1;
                    total += size as u64;
                }
                if let Bound::Both { .. } | Bound::Entries(_) = bound {
                    prop_assert!(count <= entries, "{bound:?}: {count} entries");
                }
                if let Bound::Both { .. } | Bound::Bytes(_) = bound {
                    prop_assert!(total <= bytes, "{bound:?}: {total} bytes");
                }
            }
        }
    }

    #[test]
    fn an_unset_bound_is_the_default_entry_bound() {
        assert_eq!(Bound::of(None, None), Bound::Entries(DEFAULT_MAX_ENTRIES));
        assert_eq!(Bound::of(None, Some(70_000)), Bound::Bytes(70_000));
        assert_eq!(
            Bound::of(Some(5), Some(70_000)),
            Bound::Both {
                entries: 5,
                bytes: 70_000
            }
        );
    }
}
