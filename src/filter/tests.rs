//! Tests of the Bloom filter: pinned sizing, no false negatives, the false-positive rate
//! at a million keys, concurrent use and the counters behind `stats()`.

use super::*;
use proptest::prelude::*;
use std::sync::atomic::AtomicU64;
use std::thread;

const SEED: u32 = 0x5eed_b100;

/// `n` in decimal, written into `buf` without allocating: the keys the loops below use.
fn decimal(mut n: u64, buf: &mut [u8; 20]) -> &[u8] {
    let mut start = buf.len();
    loop {
        start -= 1;
        buf[start] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            return &buf[start..];
        }
    }
}

fn filter(n: u64, p: f64) -> BloomFilter {
    let params = BloomParams::optimal(n, p).expect("valid parameters");
    BloomFilter::new(params, SEED)
}

/// Set bits counted by scanning the array, to check the `ones` counter against.
fn popcount(filter: &BloomFilter) -> u64 {
    filter
        .words
        .iter()
        .map(|w| u64::from(w.load(Ordering::Relaxed).count_ones()))
        .sum()
}

#[test]
fn decimal_writes_digits() {
    let mut buf = [0; 20];
    assert_eq!(decimal(0, &mut buf), b"0");
    assert_eq!(decimal(1_000_007, &mut buf), b"1000007");
    assert_eq!(decimal(u64::MAX, &mut buf), u64::MAX.to_string().as_bytes());
}

#[test]
fn optimal_params_are_pinned_at_one_percent() {
    let params = BloomParams::optimal(1_000_000, 0.01).unwrap();
    assert_eq!(params.bits, 9_585_059);
    assert_eq!(params.hashes, 7);
    assert_eq!(params.expected_items, 1_000_000);
    assert_eq!(params.false_positive_rate, 0.01);
}

#[test]
fn optimal_params_are_pinned_at_a_tenth_of_a_percent() {
    let params = BloomParams::optimal(1_000_000, 0.001).unwrap();
    assert_eq!(params.bits, 14_377_588);
    assert_eq!(params.hashes, 10);
}

#[test]
fn optimal_params_of_a_tiny_filter() {
    // m = ceil(1.44...) = 2, k = round(2 * ln 2) = 1.
    let params = BloomParams::optimal(1, 0.5).unwrap();
    assert_eq!((params.bits, params.hashes), (2, 1));
    // A rate just below 1 still gets one bit and one hash.
    let params = BloomParams::optimal(1, 0.999_999).unwrap();
    assert_eq!((params.bits, params.hashes), (1, 1));
}

#[test]
fn optimal_rejects_zero_items() {
    let err = BloomParams::optimal(0, 0.01).unwrap_err();
    assert!(
        matches!(err, FilterError::InvalidExpectedItems(0)),
        "{err:?}"
    );
}

#[test]
fn optimal_rejects_rates_outside_zero_to_one() {
    for p in [
        0.0,
        1.0,
        -0.01,
        1.5,
        f64::NAN,
        f64::INFINITY,
        f64::NEG_INFINITY,
    ] {
        let err = BloomParams::optimal(1_000, p).unwrap_err();
        assert!(
            matches!(err, FilterError::InvalidFalsePositiveRate(got) if got.to_bits() == p.to_bits()),
            "p = {p}: {err:?}"
        );
    }
}

#[test]
fn optimal_rejects_filters_over_the_size_limit() {
    // 10^12 keys at 1% need about 9.6 * 10^12 bits, past 2^40.
    let err = BloomParams::optimal(1_000_000_000_000, 0.01).unwrap_err();
    assert!(
        matches!(err, FilterError::TooLarge { bits } if bits > MAX_BITS),
        "{err:?}"
    );
    let err = BloomParams::optimal(u64::MAX, 0.5).unwrap_err();
    assert!(matches!(err, FilterError::TooLarge { .. }), "{err:?}");
    assert!(err.to_string().contains("limit"), "{err}");
}

#[test]
fn new_clamps_hand_built_params() {
    let params = BloomParams {
        expected_items: 10,
        false_positive_rate: 0.01,
        bits: 0,
        hashes: 0,
    };
    let filter = BloomFilter::new(params, SEED);
    assert_eq!((filter.params().bits, filter.params().hashes), (1, 1));
    assert!(filter.insert(b"key"));
    assert!(filter.contains(b"key"));
    assert_eq!(filter.stats().bytes, 8);
}

#[test]
fn insert_reports_new_bits_and_counts_items() {
    let filter = filter(1_000, 0.01);
    assert_eq!(filter.seed(), SEED);
    assert!(!filter.contains(b"/users/42"));
    assert!(filter.insert(b"/users/42"));
    assert!(filter.contains(b"/users/42"));
    assert!(!filter.insert(b"/users/42"), "a repeat sets no new bit");
    assert_eq!(filter.items(), 1);
    let stats = filter.stats();
    assert_eq!(stats.items, 1);
    assert_eq!(popcount(&filter), filter.ones.load(Ordering::Relaxed));
    assert!(stats.fill_ratio > 0.0 && stats.fill_ratio <= 1.0);
}

#[test]
fn the_seed_changes_the_bits() {
    let params = BloomParams::optimal(1_000, 0.01).unwrap();
    let a = BloomFilter::new(params, 1);
    let b = BloomFilter::new(params, 2);
    a.insert(b"same key");
    b.insert(b"same key");
    let words = |f: &BloomFilter| -> Vec<u64> {
        f.words.iter().map(|w| w.load(Ordering::Relaxed)).collect()
    };
    assert_ne!(words(&a), words(&b));
}

/// A key of either kind the proxy sees: arbitrary bytes, or a u64 id in decimal.
fn key() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        proptest::collection::vec(any::<u8>(), 0..64),
        any::<u64>().prop_map(|n| n.to_string().into_bytes()),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    #[test]
    fn inserted_keys_are_always_present(
        keys in proptest::collection::vec(key(), 0..3_000),
        n in 1u64..5_000,
        p in 1e-6f64..0.5,
        seed in any::<u32>(),
    ) {
        let filter = BloomFilter::new(BloomParams::optimal(n, p).unwrap(), seed);
        for key in &keys {
            filter.insert(key);
        }
        for key in &keys {
            prop_assert!(filter.contains(key), "false negative for {key:?}");
        }
        let stats = filter.stats();
        prop_assert!(stats.items <= keys.len() as u64);
        prop_assert_eq!(popcount(&filter), filter.ones.load(Ordering::Relaxed));
        prop_assert!((0.0..=1.0).contains(&stats.fill_ratio));
    }
}

/// Fills a filter sized for a million keys with the even numbers `0, 2, ..` and returns
/// it with the share of a million odd numbers (never inserted) it reports present.
fn false_positive_rate_at_a_million(p: f64) -> (BloomFilter, f64) {
    const N: u64 = 1_000_000;
    let filter = filter(N, p);
    let mut buf = [0; 20];
    for i in 0..N {
        filter.insert(decimal(2 * i, &mut buf));
    }
    let false_positives = (0..N)
        .filter(|i| filter.contains(decimal(2 * i + 1, &mut buf)))
        .count();
    (filter, false_positives as f64 / N as f64)
}

fn assert_false_positive_rate(p: f64) {
    let (filter, measured) = false_positive_rate_at_a_million(p);
    let stats = filter.stats();
    eprintln!("p = {p}: measured false-positive rate {measured:.5}, stats {stats:?}");
    assert!(measured <= 1.2 * p, "measured {measured} for p = {p}");
    assert_eq!(stats.bytes, filter.params().bits.div_ceil(64) * 8);
    let mut buf = [0; 20];
    assert!(filter.contains(decimal(0, &mut buf)));
    assert!(filter.contains(decimal(1_999_998, &mut buf)));
}

#[test]
fn false_positive_rate_at_one_percent() {
    assert_false_positive_rate(0.01);
}

#[test]
fn false_positive_rate_at_a_tenth_of_a_percent() {
    assert_false_positive_rate(0.001);
}

#[test]
fn stats_estimate_the_rate_after_n_inserts() {
    const N: u64 = 200_000;
    let p = 0.01;
    let filter = filter(N, p);
    let mut buf = [0; 20];
    for i in 0..N {
        filter.insert(decimal(i, &mut buf));
    }
    let stats = filter.stats();
    assert_eq!(stats.capacity, N);
    assert_eq!((stats.bits, stats.hashes), (filter.params().bits, 7));
    // At the optimum about half the bits are set.
    assert!((0.45..=0.55).contains(&stats.fill_ratio), "{stats:?}");
    assert!(
        (0.5 * p..=1.5 * p).contains(&stats.estimated_fpp),
        "{stats:?}"
    );
    // Distinct keys all count unless all their bits were set already (rate < p).
    assert!(
        stats.items <= N && stats.items as f64 >= N as f64 * (1.0 - p),
        "{stats:?}"
    );
    assert_eq!(popcount(&filter), filter.ones.load(Ordering::Relaxed));
}

#[test]
fn concurrent_inserts_and_lookups_lose_nothing() {
    const WRITERS: u64 = 3;
    const PER_WRITER: u64 = 100_000;
    let filter = filter(WRITERS * PER_WRITER, 0.01);
    // How many keys each writer has finished, published with Release so that a reader
    // that loads it with Acquire has every one of those inserts happen-before its lookup.
    let done: Vec<AtomicU64> = (0..WRITERS).map(|_| AtomicU64::new(0)).collect();
    let key = |writer: u64, i: u64| writer * PER_WRITER + i;

    thread::scope(|s| {
        for writer in 0..WRITERS {
            let (filter, done) = (&filter, &done);
            s.spawn(move || {
                let mut buf = [0; 20];
                for i in 0..PER_WRITER {
                    filter.insert(decimal(key(writer, i), &mut buf));
                    assert!(filter.contains(decimal(key(writer, i), &mut buf)));
                    done[writer as usize].store(i + 1, Ordering::Release);
                }
            });
        }
        for reader in 0..2 {
            let (filter, done) = (&filter, &done);
            s.spawn(move || {
                let mut buf = [0; 20];
                while done.iter().any(|d| d.load(Ordering::Acquire) < PER_WRITER) {
                    for (writer, d) in done.iter().enumerate() {
                        let finished = d.load(Ordering::Acquire);
                        // Check the newest finished key and an older one.
                        for i in [finished.saturating_sub(1), finished / 2 + reader] {
                            if i < finished {
                                let k = key(writer as u64, i);
                                assert!(filter.contains(decimal(k, &mut buf)), "lost {k}");
                            }
                        }
                    }
                    let stats = filter.stats();
                    assert!((0.0..=1.0).contains(&stats.fill_ratio), "{stats:?}");
                }
            });
        }
    });

    let mut buf = [0; 20];
    for k in 0..WRITERS * PER_WRITER {
        assert!(filter.contains(decimal(k, &mut buf)), "lost {k}");
    }
    let stats = filter.stats();
    let ones = filter.ones.load(Ordering::Relaxed);
    assert_eq!(ones, popcount(&filter), "ones counter drifted");
    assert!(ones <= stats.bits);
    assert!((0.0..=1.0).contains(&stats.fill_ratio), "{stats:?}");
    assert!(stats.items <= WRITERS * PER_WRITER, "{stats:?}");
    assert!(
        stats.items as f64 >= WRITERS as f64 * PER_WRITER as f64 * 0.98,
        "{stats:?}"
    );
}

#[test]
fn indexes_stay_below_the_bit_count() {
    for bits in [1, 2, 63, 64, 65, 1_000_003, MAX_BITS] {
        let probes = Probes {
            next: u64::MAX,
            step: u64::MAX,
            left: 3,
            bits,
        };
        assert!(probes.into_iter().all(|i| i < bits), "bits = {bits}");
    }
    let edge = Probes {
        next: 0,
        step: 1,
        left: 2,
        bits: 10,
    };
    assert!(edge.into_iter().all(|i| i < 10));
}

#[test]
fn from_raw_restores_what_iter_words_gave_out() {
    let original = filter(10_000, 0.01);
    let mut buf = [0; 20];
    for i in 0..5_000 {
        original.insert(decimal(i, &mut buf));
    }
    let words: Vec<u64> = original.iter_words().collect();
    assert_eq!(words.len(), original.word_count());
    let restored =
        BloomFilter::from_raw(original.params(), original.seed(), original.items(), words)
            .expect("a valid layout");
    assert_eq!(restored.stats(), original.stats());
    assert_eq!(restored.seed(), SEED);
    assert_eq!(
        restored.ones.load(Ordering::Relaxed),
        original.ones.load(Ordering::Relaxed)
    );
    assert!((0..5_000).all(|i| restored.contains(decimal(i, &mut buf))));
}

#[test]
fn from_raw_counts_ones_from_the_words() {
    let params = BloomParams {
        expected_items: 10,
        false_positive_rate: 0.01,
        bits: 130,
        hashes: 2,
    };
    let filter = BloomFilter::from_raw(params, SEED, 3, vec![u64::MAX, 0b1011, 0b11])
        .expect("a valid layout");
    assert_eq!(filter.ones.load(Ordering::Relaxed), 64 + 3 + 2);
    assert_eq!(popcount(&filter), 69);
    assert_eq!(filter.items(), 3);
    assert_eq!(filter.params(), params);
}

#[test]
fn from_raw_rejects_a_layout_that_does_not_fit() {
    let params = |bits, hashes| BloomParams {
        expected_items: 10,
        false_positive_rate: 0.01,
        bits,
        hashes,
    };
    let cases = [
        (params(130, 2), vec![0, 0], "expected 3 words, got 2"),
        (params(130, 2), vec![0; 4], "expected 3 words, got 4"),
        // Bit 130 is bit 2 of the last word: the first bit past the end.
        (params(130, 2), vec![0, 0, 0b100], "bit 130 is set"),
        (params(130, 2), vec![0, 0, 1 << 63], "bit 191 is set"),
        (params(0, 2), vec![], "bit count"),
        (params(MAX_BITS + 1, 2), vec![], "bit count"),
        (params(64, 0), vec![0], "hash count"),
    ];
    for (params, words, expected) in cases {
        let err = BloomFilter::from_raw(params, SEED, 0, words).expect_err("a bad layout");
        assert!(
            matches!(&err, FilterError::BadLayout { problem, .. } if problem.contains(expected)),
            "{expected}: {err:?}"
        );
    }
    // A full last word is all inside the array.
    let full = BloomFilter::from_raw(params(128, 2), SEED, 0, vec![u64::MAX; 2]);
    assert!(full.is_ok_and(|f| f.stats().fill_ratio == 1.0));
}
