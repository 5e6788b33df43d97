//! The Bloom filter itself: sizing parameters, murmur3 hashing into cache-line blocks and
//! a lock-free array of atomic bits that any number of threads may insert into and query
//! at once. It does not load keys or decide what a "maybe" means for a request; it only
//! answers "definitely absent" or "maybe present" for key bytes. Its raw words can be read
//! out and a filter rebuilt from them; the file format that does so lives in [`snapshot`].
//!
//! # Layout
//!
//! The bit array is cut into blocks of 512 bits, one 64-byte cache line each, and the
//! array is allocated aligned to 64 bytes. All `k` probes of a key fall into one block,
//! so a lookup touches one cache line: a classic filter with its probes spread over the
//! whole array takes about two cache misses for an absent key at the optimal fill (each
//! probe finds a set bit with probability one half) and `k` for a present one, and once
//! the array is larger than the CPU caches those misses are the cost of a lookup.
//!
//! The price is accuracy at a given size: keys are not spread evenly over blocks (their
//! number per block is close to Poisson), and an overfull block answers "maybe" more
//! often than an underfull one answers "no". [`BloomParams::optimal`] pays for that with
//! a few percent more bits than the classic optimum, found by evaluating the blocked
//! false-positive rate directly, so the *measured* rate still meets the target: at
//! p = 1% it sizes 9.97 bits per key (the classic optimum is 9.59) and at p = 0.1% 15.53
//! (against 14.38).
//!
//! # Hashing
//!
//! A key is hashed once with `murmur3_x64_128` under the filter's seed (`murmur`). The
//! low half `h1` picks the block by Lemire's multiply-shift reduction,
//! `(h1 * blocks) >> 64`, which reads the high bits of `h1` and needs no division. The
//! high half `h2` supplies the bit positions inside the block, nine bits per probe from
//! the low end up: seven probes per 64-bit word. A filter with more than seven hashes
//! continues with `mix64(h2)`, then `mix64` of that, and so on; `mix64` is a bijective
//! finaliser, so every further word is as well mixed as `h2`. Two probes of one key may
//! land on the same bit; the sizing accounts for that.
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

mod murmur;
pub mod snapshot;

use std::f64::consts::LN_2;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};

/// The largest bit array [`BloomParams::optimal`] will size: 2^40 bits, 128 GiB.
pub const MAX_BITS: u64 = 1 << 40;

/// The bits of one block, a 64-byte cache line: every filter's bit count is a multiple.
pub const BLOCK_BITS: u64 = 512;

/// The 64-bit words of one block.
const BLOCK_WORDS: usize = 8;

/// The in-block position takes nine bits of hash: `2^9 = BLOCK_BITS`.
const PROBE_BITS: u32 = 9;

/// Probes drawn from one 64-bit word of hash before the next word is mixed.
const PROBES_PER_WORD: u32 = 64 / PROBE_BITS;

/// The most hashes [`BloomParams::optimal`] will choose (and a snapshot may declare);
/// enough for any rate above 10^-18.
pub const MAX_OPTIMAL_HASHES: u32 = 64;

/// The largest number of 1% steps [`BloomParams::optimal`] adds to the classic size while
/// looking for one whose blocked rate meets the target.
const MAX_SIZING_STEPS: u32 = 300;

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
    /// The smallest size whose false-positive rate, with `expected_items` keys spread over
    /// 512-bit blocks, is at most `false_positive_rate`, and the fewest hashes that get
    /// there at that size.
    ///
    /// The search starts from the classic optimum `m0 = ceil(-n ln p / (ln 2)^2)` and grows
    /// it in steps of 1% of `m0`, each rounded up to whole blocks, until some `k` brings
    /// [`blocked_false_positive_rate`] to `p` or below. It gives up after 300 steps (four
    /// times `m0`) and keeps the last size with its best `k`; no rate a filter is
    /// configured with comes near that.
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
        let classic = (-n * p.ln() / (LN_2 * LN_2)).ceil().max(1.0);
        let mut last = (BLOCK_BITS, 1);
        for step in 0..=MAX_SIZING_STEPS {
            let wanted = classic * (1.0 + f64::from(step) / 100.0);
            let bits = (wanted / BLOCK_BITS as f64).ceil() * BLOCK_BITS as f64;
            if bits > MAX_BITS as f64 {
                // `as` saturates, so an absurd request reports u64::MAX rather than wrapping.
                return Err(FilterError::TooLarge { bits: bits as u64 });
            }
            let bits = bits as u64;
            if step > 0 && last.0 == bits {
                continue;
            }
            match fewest_hashes(expected_items, bits, p) {
                Ok(hashes) => {
                    last = (bits, hashes);
                    break;
                }
                Err(best) => last = (bits, best),
            }
        }
        let (bits, hashes) = last;
        Ok(Self {
            expected_items,
            false_positive_rate: p,
            bits,
            hashes,
        })
    }
}

/// The fewest hashes `k` with which `items` keys in `bits` bits have a
/// [`blocked_false_positive_rate`] of at most `target`; fewer hashes make every insert and
/// every lookup of a present key cheaper. If no `k` in `1..=64` gets there, the `k` with
/// the lowest rate, as the error. The rate falls and then rises with `k`, so the search
/// stops at the first `k` that does worse than the one before.
fn fewest_hashes(items: u64, bits: u64, target: f64) -> Result<u32, u32> {
    let mut best = (0, f64::INFINITY);
    for k in 1..=MAX_OPTIMAL_HASHES {
        let rate = blocked_false_positive_rate(items, bits, k);
        if rate <= target {
            return Ok(k);
        }
        if rate >= best.1 {
            break;
        }
        best = (k, rate);
    }
    Err(best.0)
}

/// The expected false-positive rate of a blocked filter of `bits` bits (a multiple of
/// 512) holding `items` random keys with `hashes` probes each.
///
/// A block receives `x` keys with probability close to Poisson with mean
/// `lambda = items / blocks`. With `x` keys in it, a given bit of the block is still clear
/// with probability `(1 - 1/512)^(k x)`, and an absent key mapped there is a false
/// positive if all of its `k` probes find set bits: `(1 - (1 - 1/512)^(k x))^k`. The rate
/// is the Poisson-weighted sum of that over `x`, taken far enough past the mean that the
/// rest is negligible.
pub fn blocked_false_positive_rate(items: u64, bits: u64, hashes: u32) -> f64 {
    let blocks = (bits / BLOCK_BITS).max(1) as f64;
    let lambda = items as f64 / blocks;
    let k = f64::from(hashes);
    let clear_per_probe = (1.0 - 1.0 / BLOCK_BITS as f64).ln();
    let last = (lambda + 12.0 * lambda.sqrt() + 12.0).ceil() as u64;
    let first = (lambda - 12.0 * lambda.sqrt()).floor().max(0.0) as u64;
    // ln P(x) = -lambda + x ln(lambda) - ln(x!), with ln(x!) accumulated as x grows.
    let ln_lambda = lambda.ln();
    let mut ln_factorial = 0.0;
    let mut rate = 0.0;
    for x in 0..=last {
        if x > 0 {
            ln_factorial += (x as f64).ln();
        }
        if x < first {
            continue;
        }
        let xf = x as f64;
        let weight = (-lambda + xf * ln_lambda - ln_factorial).exp();
        let set = 1.0 - (clear_per_probe * k * xf).exp();
        rate += weight * set.powf(k);
    }
    rate
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

/// One 512-bit block of the array, aligned to a cache line so that a lookup touches one.
#[repr(C, align(64))]
struct Block([AtomicU64; BLOCK_WORDS]);

impl Block {
    fn new(words: [u64; BLOCK_WORDS]) -> Self {
        Self(words.map(AtomicU64::new))
    }

    /// The word holding in-block bit `pos` (`0..512`) and the mask of that bit in it.
    #[inline]
    fn locate(&self, pos: u32) -> (&AtomicU64, u64) {
        // `pos < 512`, so `pos / 64 < 8`: the index is in bounds.
        (&self.0[(pos / 64) as usize], 1 << (pos % 64))
    }
}

/// A Bloom filter over key bytes whose insert and lookup both take `&self` and never
/// lock or allocate, so one filter can be filled and queried from many threads at once.
pub struct BloomFilter {
    /// The size this filter was built with: `bits` a multiple of [`BLOCK_BITS`] and
    /// `hashes` at least 1.
    params: BloomParams,
    /// The murmur3 seed; a snapshot is only valid with the seed it was built under.
    seed: u32,
    /// The bit array: bit `i` is bit `i % 64` of word `i / 64`, and word `w` is word
    /// `w % 8` of block `w / 8`. Bits only go from 0 to 1.
    blocks: Box<[Block]>,
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
    /// adjusted so the filter stays usable: `bits` is clamped to `1..=MAX_BITS` and
    /// rounded up to whole blocks, `hashes` to at least 1; [`params`](Self::params)
    /// returns the adjusted values.
    pub fn new(params: BloomParams, seed: u32) -> Self {
        let params = BloomParams {
            bits: params.bits.clamp(1, MAX_BITS).next_multiple_of(BLOCK_BITS),
            hashes: params.hashes.max(1),
            ..params
        };
        let blocks = (0..params.bits / BLOCK_BITS)
            .map(|_| Block::new([0; BLOCK_WORDS]))
            .collect();
        Self {
            params,
            seed,
            blocks,
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
    /// [`FilterError::BadLayout`] unless `params.bits` is a multiple of [`BLOCK_BITS`] in
    /// `1..=MAX_BITS`, `params.hashes` is at least 1 and there are exactly `bits / 64`
    /// words. Unlike [`new`](Self::new), nothing is adjusted: raw words only mean
    /// something under the exact parameters they were set under.
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
        if !params.bits.is_multiple_of(BLOCK_BITS) {
            return Err(bad(format!(
                "the bit count must be a multiple of the {BLOCK_BITS}-bit block"
            )));
        }
        if params.hashes == 0 {
            return Err(bad("the hash count must be at least 1".to_owned()));
        }
        let expected = params.bits / 64;
        if words.len() as u64 != expected {
            return Err(bad(format!(
                "expected {expected} words, got {}",
                words.len()
            )));
        }
        let ones = words.iter().map(|w| u64::from(w.count_ones())).sum();
        let blocks = words
            .chunks_exact(BLOCK_WORDS)
            .map(|chunk| {
                let mut block = [0; BLOCK_WORDS];
                block.copy_from_slice(chunk);
                Block::new(block)
            })
            .collect();
        Ok(Self {
            params,
            seed,
            blocks,
            items: AtomicU64::new(items),
            ones: AtomicU64::new(ones),
        })
    }

    /// The number of 64-bit words in the bit array: `bits / 64`.
    pub fn word_count(&self) -> usize {
        self.blocks.len() * BLOCK_WORDS
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
        (0..self.word_count())
            .map(|w| self.blocks[w / BLOCK_WORDS].0[w % BLOCK_WORDS].load(Ordering::Relaxed))
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
        let (block, probes) = self.probes(key);
        let mut newly_set = 0;
        for pos in probes {
            let (word, mask) = block.locate(pos);
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
    /// Takes `&self`, no lock and no allocation, and reads one cache line of the array.
    #[inline]
    pub fn contains(&self, key: &[u8]) -> bool {
        let (block, mut probes) = self.probes(key);
        probes.all(|pos| {
            let (word, mask) = block.locate(pos);
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
    ///
    /// `estimated_fpp` is `fill_ratio ^ hashes`, the rate if set bits were spread evenly;
    /// blocks fill unevenly, so the real rate is somewhat higher at the same fill (at
    /// p = 1% and the sized capacity, about 1.2 times).
    pub fn stats(&self) -> FilterStats {
        let bits = self.params.bits;
        let ones = self.ones.load(Ordering::Relaxed);
        let fill_ratio = (ones as f64 / bits as f64).min(1.0);
        FilterStats {
            items: self.items(),
            capacity: self.params.expected_items,
            bits,
            hashes: self.params.hashes,
            bytes: self.word_count() as u64 * 8,
            fill_ratio,
            estimated_fpp: fill_ratio.powf(f64::from(self.params.hashes)),
        }
    }

    /// The block of a key and its `k` bit positions inside it.
    #[inline]
    fn probes(&self, key: &[u8]) -> (&Block, Probes) {
        let (index, probes) = locate(key, self.seed, self.blocks.len() as u64, self.params.hashes);
        // `locate` returns an index below the block count it was given.
        (&self.blocks[index as usize], probes)
    }
}

/// Where a key falls in a filter of `blocks` blocks with `hashes` probes under `seed`:
/// the block's index (below `blocks`, for any `blocks` of at least 1) and the key's bit
/// positions inside that block, each in `0..512`. This is the whole hash scheme, shared
/// by the in-process filter and the copy held in Redis (`gate::redis_held`): position
/// `p` of block `b` is bit `p % 8` (counting from the least significant) of byte
/// `64 * b + p / 8` of the filter's bytes, the 64-bit words stored little-endian.
#[inline]
pub fn locate(key: &[u8], seed: u32, blocks: u64, hashes: u32) -> (u64, Probes) {
    let (h1, h2) = murmur::murmur3_x64_128(key, seed);
    // Lemire's reduction: the high 64 bits of h1 * blocks lie in 0..blocks.
    let index = ((u128::from(h1) * u128::from(blocks.max(1))) >> 64) as u64;
    let probes = Probes {
        word: h2,
        rest: h2,
        left_in_word: PROBES_PER_WORD,
        left: hashes,
    };
    (index, probes)
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

/// The in-block bit positions of one key (see the module docs), from [`locate`].
#[derive(Debug, Clone)]
pub struct Probes {
    /// The whole hash word the current probes come from; the next word is `mix64` of it.
    word: u64,
    /// What is left of `word` once the probes taken so far are shifted out.
    rest: u64,
    /// Probes still to take from `rest`.
    left_in_word: u32,
    /// Probes still to yield.
    left: u32,
}

impl Iterator for Probes {
    type Item = u32;

    #[inline]
    fn next(&mut self) -> Option<u32> {
        if self.left == 0 {
            return None;
        }
        self.left -= 1;
        if self.left_in_word == 0 {
            self.word = mix64(self.word);
            self.rest = self.word;
            self.left_in_word = PROBES_PER_WORD;
        }
        self.left_in_word -= 1;
        let pos = (self.rest % BLOCK_BITS) as u32;
        self.rest >>= PROBE_BITS;
        Some(pos)
    }
}

/// A bijective 64-bit finaliser (xor-shift / multiply rounds): every output bit depends
/// on every input bit.
#[inline]
fn mix64(mut x: u64) -> u64 {
    x ^= x >> 30;
    x = x.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x ^= x >> 27;
    x = x.wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

#[cfg(test)]
mod tests;
