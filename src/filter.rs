//! The Bloom filter itself: sizing parameters, murmur3 double hashing and a lock-free
//! array of atomic bits that any number of threads may insert into and query at once.
//! It does not load keys or decide what a "maybe" means for a request; it only answers
//! "definitely absent" or "maybe present" for key bytes. Its raw words can be read out and
//! a filter rebuilt from them; the file format that does so lives in [`snapshot`].
//!
//! # Hashing
//!
//! A key is hashed once with `murmur3_x64_128` under the filter's seed. The low half
//! `h1` and the high half `h2` (forced odd) give probe values by plain double hashing,
//! `x_i = h1 + i * h2` in wrapping 64-bit arithmetic. Each `x_i` then goes through a
//! 64-bit finaliser so that all of its bits, the high ones included, depend on all of
//! `h1` and `h2`, and is mapped into `0..bits` by Lemire's multiply-shift reduction,
//! `(x * bits) >> 64`, instead of a division. The reduction reads the *high* bits of
//! its input; without the finaliser, neighbouring probes `x_i` and `x_{i+1}` would only
//! be a fixed stride apart on the circle and any structure in `h2` would show up in the
//! indexes. Because `h2` is odd the `x_i` of one key are distinct, and the finaliser is a
//! bijection, so the `k` probe values are distinct before reduction.
//!
//! # Memory ordering
//!
//! Bits are only ever set, never cleared, and every access is a single atomic operation
//! on one 64-bit word, so `Relaxed` is enough for the guarantee callers rely on: if an
//! `insert(key)` happens-before a `contains(key)` on another thread through any other
//! synchronisation (a join, a channel, a mutex, an `ArcSwap` store and load), then by
//! write-read coherence each load in `contains` sees the `fetch_or` of that insert or a
//! later value of the same word, and later values only have more bits set. So a
//! completed insert is never missed. `Acquire`/`Release` would add only one thing: the
//! filter could itself publish other data ("seeing the key implies seeing what the
//! inserter wrote before"), which nothing should rely on. A `contains` that races with
//! an `insert` of the same key may see some of its bits and answer `false`; that is the
//! answer it would have given had it run just before the insert.

pub mod snapshot;

use std::f64::consts::LN_2;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};

/// The largest bit array [`BloomParams::optimal`] will size: 2^40 bits, 128 GiB.
pub const MAX_BITS: u64 = 1 << 40;

/// Why a set of Bloom filter parameters was refused.
#[derive(Debug, thiserror::Error)]
pub enum FilterError {
    /// The expected number of items was 0; a filter must be sized for at least one.
    #[error("expected items must be at least 1, got {0}")]
    InvalidExpectedItems(u64),
    /// The false-positive rate was not strictly between 0 and 1 (or was NaN).
    #[error("false-positive rate must be strictly between 0 and 1, got {0}")]
    InvalidFalsePositiveRate(f64),
    /// The filter would need more than [`MAX_BITS`] bits.
    #[error("filter would need {bits} bits, more than the limit of {MAX_BITS}")]
    TooLarge {
        /// The number of bits the requested parameters call for.
        bits: u64,
    },
    /// Raw words given to [`BloomFilter::from_raw`] do not fit the parameters with them.
    #[error("raw bit array does not fit {bits} bits and {hashes} hashes: {problem}")]
    BadLayout {
        /// The bit count of the parameters.
        bits: u64,
        /// The hash count of the parameters.
        hashes: u32,
        /// What is wrong, with the numbers involved.
        problem: String,
    },
}

/// The size of a Bloom filter: what it was sized for and the resulting bits and hashes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BloomParams {
    /// The number of distinct keys the filter is sized for (`n`).
    pub expected_items: u64,
    /// The false-positive rate aimed for at `expected_items` keys (`p`).
    pub false_positive_rate: f64,
    /// The number of bits in the array (`m`).
    pub bits: u64,
    /// The number of bit probes per key (`k`).
    pub hashes: u32,
}

impl BloomParams {
    /// The optimal size for `expected_items` keys at `false_positive_rate`:
    /// `m = ceil(-n ln p / (ln 2)^2)` bits and `k = max(1, round(m / n * ln 2))` hashes.
    ///
    /// # Errors
    ///
    /// [`FilterError::InvalidExpectedItems`] if `expected_items` is 0,
    /// [`FilterError::InvalidFalsePositiveRate`] unless `0 < false_positive_rate < 1`, and
    /// [`FilterError::TooLarge`] if `m` would exceed [`MAX_BITS`].
    pub fn optimal(expected_items: u64, false_positive_rate: f64) -> Result<Self, FilterError> {
        let p = false_positive_rate;
        if expected_items == 0 {
            return Err(FilterError::InvalidExpectedItems(expected_items));
        }
        if p.is_nan() || p <= 0.0 || p >= 1.0 {
            return Err(FilterError::InvalidFalsePositiveRate(p));
        }
        let n = expected_items as f64;
        let bits = (-n * p.ln() / (LN_2 * LN_2)).ceil().max(1.0);
        if bits > MAX_BITS as f64 {
            // `as` saturates, so an absurd request reports u64::MAX rather than wrapping.
            return Err(FilterError::TooLarge { bits: bits as u64 });
        }
        let hashes = (bits / n * LN_2).round().max(1.0) as u32;
        Ok(Self {
            expected_items,
            false_positive_rate: p,
            bits: bits as u64,
            hashes,
        })
    }
}

/// A point-in-time summary of a filter, for metrics and the admin endpoints.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FilterStats {
    /// Inserts that set at least one new bit: see [`BloomFilter::items`].
    pub items: u64,
    /// The number of keys the filter was sized for (`expected_items`).
    pub capacity: u64,
    /// The number of bits in the array.
    pub bits: u64,
    /// The number of bit probes per key.
    pub hashes: u32,
    /// The memory held by the bit array, in bytes.
    pub bytes: u64,
    /// The share of bits set, in `[0, 1]`.
    pub fill_ratio: f64,
    /// The false-positive rate implied by the current fill: `fill_ratio ^ hashes`.
    pub estimated_fpp: f64,
}

/// A Bloom filter over key bytes whose insert and lookup both take `&self` and never
/// lock or allocate, so one filter can be filled and queried from many threads at once.
pub struct BloomFilter {
    /// The size this filter was built with, with `bits` and `hashes` at least 1.
    params: BloomParams,
    /// The murmur3 seed; a snapshot is only valid with the seed it was built under.
    seed: u32,
    /// The bit array, 64 bits a word: bit `i` is bit `i % 64` of word `i / 64`. Bits past
    /// `params.bits` in the last word are never set. Bits only go from 0 to 1.
    words: Box<[AtomicU64]>,
    /// Inserts that set at least one new bit; kept so `items()` is a load, not a scan.
    items: AtomicU64,
    /// Set bits. Each 0 -> 1 transition is seen by exactly one `fetch_or` (the one whose
    /// previous value had the bit clear), so counting from previous values is exact even
    /// under contention, and `stats()` needs no scan of the array.
    ones: AtomicU64,
}

impl BloomFilter {
    /// An empty filter of the given size whose keys are hashed under `seed`.
    ///
    /// `params` normally comes from [`BloomParams::optimal`]. Hand-built values are
    /// clamped so the filter stays usable: `bits` to `1..=MAX_BITS`, `hashes` to at
    /// least 1; [`params`](Self::params) returns the clamped values.
    pub fn new(params: BloomParams, seed: u32) -> Self {
        let params = BloomParams {
            bits: params.bits.clamp(1, MAX_BITS),
            hashes: params.hashes.max(1),
            ..params
        };
        let words = (0..params.bits.div_ceil(64))
            .map(|_| AtomicU64::new(0))
            .collect();
        Self {
            params,
            seed,
            words,
            items: AtomicU64::new(0),
            ones: AtomicU64::new(0),
        }
    }

    /// A filter from its raw parts, as [`iter_words`](Self::iter_words),
    /// [`items`](Self::items), [`seed`](Self::seed) and [`params`](Self::params) gave them
    /// out: the inverse of reading a filter out word by word. The count of set bits is
    /// recomputed from the words.
    ///
    /// # Errors
    ///
    /// [`FilterError::BadLayout`] unless `params.bits` is in `1..=MAX_BITS`,
    /// `params.hashes` is at least 1, there are exactly `ceil(bits / 64)` words and no
    /// bit at or past `bits` is set. Unlike [`new`](Self::new), nothing is clamped: raw
    /// words only mean something under the exact parameters they were set under.
    pub fn from_raw(
        params: BloomParams,
        seed: u32,
        items: u64,
        words: Vec<u64>,
    ) -> Result<Self, FilterError> {
        let bad = |problem: String| FilterError::BadLayout {
            bits: params.bits,
            hashes: params.hashes,
            problem,
        };
        if !(1..=MAX_BITS).contains(&params.bits) {
            return Err(bad(format!("the bit count must be in 1..={MAX_BITS}")));
        }
        if params.hashes == 0 {
            return Err(bad("the hash count must be at least 1".to_owned()));
        }
        let expected = params.bits.div_ceil(64);
        if words.len() as u64 != expected {
            return Err(bad(format!(
                "expected {expected} words, got {}",
                words.len()
            )));
        }
        let tail = params.bits % 64;
        if let Some(&last) = words.last()
            && tail != 0
            && last >> tail != 0
        {
            let bit = params.bits - tail + u64::from(63 - last.leading_zeros());
            return Err(bad(format!("bit {bit} is set, past the end of the array")));
        }
        let ones = words.iter().map(|w| u64::from(w.count_ones())).sum();
        Ok(Self {
            params,
            seed,
            words: words.into_iter().map(AtomicU64::new).collect(),
            items: AtomicU64::new(items),
            ones: AtomicU64::new(ones),
        })
    }

    /// The number of 64-bit words in the bit array: `ceil(bits / 64)`.
    pub fn word_count(&self) -> usize {
        self.words.len()
    }

    /// The words of the bit array in order (bit `i` is bit `i % 64` of word `i / 64`),
    /// each read by its own `Relaxed` load as the iterator reaches it, so that a filter
    /// can be streamed out without a second copy of the array.
    ///
    /// Under concurrent inserts the words are not one atomic picture: an insert that
    /// races with the iteration may be included, partly included or missed. That is
    /// harmless for a snapshot as long as the caller re-applies every key inserted after
    /// it started iterating (as incremental sync does from the snapshot's watermark):
    /// bits only go from 0 to 1, so a partial insert is completed by the replay and never
    /// turns into a false negative for a key inserted before the iteration began.
    pub fn iter_words(&self) -> impl ExactSizeIterator<Item = u64> + '_ {
        self.words.iter().map(|w| w.load(Ordering::Relaxed))
    }

    /// The parameters this filter was built with.
    pub fn params(&self) -> BloomParams {
        self.params
    }

    /// The murmur3 seed keys are hashed under.
    pub fn seed(&self) -> u32 {
        self.seed
    }

    /// Adds a key (its normalised bytes). Returns `true` if at least one of its bits was
    /// newly set, `false` if all were set already (a repeat, or a key the filter already
    /// reported as maybe present).
    ///
    /// Takes `&self` and no lock: safe while other threads insert and look up.
    pub fn insert(&self, key: &[u8]) -> bool {
        let Some(probes) = self.probes(key) else {
            // Unreachable (see `probes`). Hashing is deterministic in the key bytes, so
            // `contains` fails the same way for this key and answers "maybe present".
            return false;
        };
        let mut newly_set = 0;
        for bit in probes {
            let (word, mask) = self.locate(bit);
            // A plain load first: a bit already set needs no read-modify-write, which
            // would take the cache line exclusively away from concurrent readers.
            if word.load(Ordering::Relaxed) & mask != 0 {
                continue;
            }
            if word.fetch_or(mask, Ordering::Relaxed) & mask == 0 {
                newly_set += 1;
            }
        }
        if newly_set == 0 {
            return false;
        }
        self.ones.fetch_add(newly_set, Ordering::Relaxed);
        self.items.fetch_add(1, Ordering::Relaxed);
        true
    }

    /// Looks a key up: `false` means definitely never inserted, `true` means maybe.
    ///
    /// Takes `&self`, no lock and no allocation.
    pub fn contains(&self, key: &[u8]) -> bool {
        let Some(mut probes) = self.probes(key) else {
            // Unreachable (see `probes`); "maybe present" is the answer that can never be
            // a false negative.
            return true;
        };
        probes.all(|bit| {
            let (word, mask) = self.locate(bit);
            word.load(Ordering::Relaxed) & mask != 0
        })
    }

    /// The number of `insert` calls that set at least one new bit: an approximate count
    /// of distinct keys. Repeats are not counted, which is why this counts new bits
    /// rather than calls; the price is that a new key whose bits were all set already (a
    /// false positive at insert time, about `estimated_fpp` of inserts near capacity) is
    /// not counted either, and two threads inserting the same new key at the same moment
    /// may both count it.
    pub fn items(&self) -> u64 {
        self.items.load(Ordering::Relaxed)
    }

    /// A summary of size and fill. Under concurrent inserts the counters are read one
    /// after the other, so they may be a few inserts apart.
    pub fn stats(&self) -> FilterStats {
        let bits = self.params.bits;
        let ones = self.ones.load(Ordering::Relaxed);
        let fill_ratio = (ones as f64 / bits as f64).min(1.0);
        FilterStats {
            items: self.items(),
            capacity: self.params.expected_items,
            bits,
            hashes: self.params.hashes,
            bytes: self.words.len() as u64 * 8,
            fill_ratio,
            estimated_fpp: fill_ratio.powf(f64::from(self.params.hashes)),
        }
    }

    /// The `k` bit indexes of a key. `None` only if murmur3's reader fails, which a byte
    /// slice never does; the `Option` spares the hot path an `unwrap`.
    fn probes(&self, key: &[u8]) -> Option<Probes> {
        let mut reader = key;
        let hash = murmur3::murmur3_x64_128(&mut reader, self.seed).ok()?;
        Some(Probes {
            next: hash as u64,
            step: (hash >> 64) as u64 | 1,
            left: self.params.hashes,
            bits: self.params.bits,
        })
    }

    /// The word holding bit `bit` and the mask of that bit within it.
    fn locate(&self, bit: u64) -> (&AtomicU64, u64) {
        // `bit < params.bits`, so the word index is within the array and fits a usize.
        (&self.words[(bit / 64) as usize], 1 << (bit % 64))
    }
}

impl fmt::Debug for BloomFilter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BloomFilter")
            .field("params", &self.params)
            .field("seed", &self.seed)
            .field("items", &self.items())
            .field("ones", &self.ones.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

/// The bit indexes of one key, by double hashing (see the module docs).
struct Probes {
    /// `h1 + i * h2` for the next probe `i`.
    next: u64,
    /// `h2`, odd.
    step: u64,
    /// Probes still to yield.
    left: u32,
    /// The number of bits indexes are reduced into.
    bits: u64,
}

impl Iterator for Probes {
    type Item = u64;

    fn next(&mut self) -> Option<u64> {
        if self.left == 0 {
            return None;
        }
        self.left -= 1;
        let x = mix64(self.next);
        self.next = self.next.wrapping_add(self.step);
        // Lemire's reduction: the high 64 bits of x * bits lie in 0..bits.
        Some(((u128::from(x) * u128::from(self.bits)) >> 64) as u64)
    }
}

/// A bijective 64-bit finaliser (xor-shift / multiply rounds): every output bit depends
/// on every input bit, so the high bits the reduction reads are well mixed.
fn mix64(mut x: u64) -> u64 {
    x ^= x >> 30;
    x = x.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x ^= x >> 27;
    x = x.wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

#[cfg(test)]
mod tests;
