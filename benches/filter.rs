//! Benchmarks of `bloomgate::filter` against the `fastbloom` and `bloomfilter` crates in
//! one run, each filter sized by its own constructor for the same `n` keys at the same
//! target false-positive rate `p`: filling an empty filter, and lookups of present and of
//! absent keys. Nothing around the filter (gate, cache, proxy) is measured here.
//!
//! Keys are u64 ids in decimal, which is what bloomgate hashes: the even numbers are
//! inserted and the odd ones are absent. At one million keys, fills are also timed with
//! short SKU-like keys (`sku-000123`). `fastbloom` is its `AtomicBloomFilter`, which like
//! ours inserts through `&self` with atomic bit sets; its lookups are the same code as its
//! plain `BloomFilter`'s. `bloomfilter` has no concurrent variant and inserts through
//! `&mut self`.
//!
//! Run with `cargo bench --bench filter` (about ten minutes on 2 cores). A run first prints
//! the machine and crate versions to stderr, then for each configuration and crate the bits
//! per key against the optimum `1.44 log2(1/p)` and the false-positive rate measured over
//! one million absent keys.
//!
//! `cargo test --all-targets` runs this target once in test mode in the debug profile;
//! there it builds a single configuration of 10,000 keys so that it stays quick.

use std::hint::black_box;
use std::io::Write as _;
use std::time::Duration;

use criterion::measurement::WallTime;
use criterion::{
    BatchSize, BenchmarkGroup, BenchmarkId, Criterion, SamplingMode, Throughput, criterion_group,
    criterion_main,
};

/// The murmur3 seed of our filter; the other crates get seeds derived from it.
const SEED: u32 = 0x5eed_b100;

/// What one run measures: the full matrix under `cargo bench`, a token one under test.
struct Plan {
    /// `(n, p)` pairs, each a configuration of its own.
    configs: &'static [(u64, f64)],
    /// Absent keys looked up to measure the false-positive rate.
    absent: u64,
    /// The `n` at which fills are also timed with SKU-like keys.
    sku_n: u64,
}

const FULL: Plan = Plan {
    configs: &[
        (1_000_000, 0.01),
        (1_000_000, 0.001),
        (10_000_000, 0.01),
        (10_000_000, 0.001),
    ],
    absent: 1_000_000,
    sku_n: 1_000_000,
};

const TEST: Plan = Plan {
    configs: &[(10_000, 0.01)],
    absent: 10_000,
    sku_n: 10_000,
};

/// Whether this is a real benchmark run. Criterion benchmarks only when cargo passed
/// `--bench` (i.e. under `cargo bench`) and neither `--test` nor `--list` was given;
/// otherwise it runs each routine once, and building 10M-key filters would be wasted.
fn benchmarking() -> bool {
    let args: Vec<String> = std::env::args().collect();
    let has = |flag: &str| args.iter().any(|a| a == flag);
    has("--bench") && !has("--test") && !has("--list")
}

/// A Bloom filter under test, behind the few calls the benchmarks make.
trait Contender {
    /// The crate's name, as benchmark ids and the stats lines show it.
    const NAME: &'static str;
    /// An empty filter sized by the crate's own constructor for `n` keys at rate `p`.
    fn sized_for(n: u64, p: f64) -> Self;
    /// Adds a key.
    fn insert(&mut self, key: &[u8]);
    /// `false` if the key was definitely never inserted.
    fn contains(&self, key: &[u8]) -> bool;
    /// The size of the bit array in bits, as allocated (headers not counted).
    fn bits(&self) -> u64;
    /// Bit probes per key.
    fn hashes(&self) -> u32;
}

impl Contender for bloomgate::filter::BloomFilter {
    const NAME: &'static str = "bloomgate";

    fn sized_for(n: u64, p: f64) -> Self {
        let params = bloomgate::filter::BloomParams::optimal(n, p).expect("valid parameters");
        Self::new(params, SEED)
    }
    fn insert(&mut self, key: &[u8]) {
        bloomgate::filter::BloomFilter::insert(self, key);
    }
    fn contains(&self, key: &[u8]) -> bool {
        bloomgate::filter::BloomFilter::contains(self, key)
    }
    fn bits(&self) -> u64 {
        self.stats().bytes * 8
    }
    fn hashes(&self) -> u32 {
        self.stats().hashes
    }
}

impl Contender for fastbloom::AtomicBloomFilter {
    const NAME: &'static str = "fastbloom";

    fn sized_for(n: u64, p: f64) -> Self {
        Self::with_false_pos(p)
            .seed(&u128::from(SEED))
            .expected_items(usize::try_from(n).expect("n fits a usize"))
    }
    fn insert(&mut self, key: &[u8]) {
        fastbloom::AtomicBloomFilter::insert(self, key);
    }
    fn contains(&self, key: &[u8]) -> bool {
        fastbloom::AtomicBloomFilter::contains(self, key)
    }
    fn bits(&self) -> u64 {
        self.num_bits() as u64
    }
    fn hashes(&self) -> u32 {
        self.num_hashes()
    }
}

impl Contender for bloomfilter::Bloom<[u8]> {
    const NAME: &'static str = "bloomfilter";

    fn sized_for(n: u64, p: f64) -> Self {
        let mut seed = [0; 32];
        for (i, chunk) in seed.chunks_exact_mut(4).enumerate() {
            chunk.copy_from_slice(&(SEED ^ i as u32).to_le_bytes());
        }
        let n = usize::try_from(n).expect("n fits a usize");
        Self::new_for_fp_rate_with_seed(n, p, &seed).expect("valid parameters")
    }
    fn insert(&mut self, key: &[u8]) {
        self.set(key);
    }
    fn contains(&self, key: &[u8]) -> bool {
        self.check(key)
    }
    fn bits(&self) -> u64 {
        self.len()
    }
    fn hashes(&self) -> u32 {
        self.number_of_hash_functions()
    }
}

/// Keys laid end to end in one buffer, so that fetching the next key is a sequential read
/// and the timings are the filters' own rather than a pointer chase per key.
struct Keys {
    bytes: Vec<u8>,
    /// Key `i` ends at `ends[i]` and starts where key `i - 1` ends.
    ends: Vec<usize>,
}

impl Keys {
    /// `count` keys, key `i` written by `write(i, buffer)`.
    fn generate(count: u64, mut write: impl FnMut(u64, &mut Vec<u8>)) -> Self {
        let mut keys = Self {
            bytes: Vec::new(),
            ends: Vec::with_capacity(usize::try_from(count).expect("count fits a usize")),
        };
        for i in 0..count {
            write(i, &mut keys.bytes);
            keys.ends.push(keys.bytes.len());
        }
        keys
    }

    /// The ids `2i + offset` for `i` in `0..count`, in decimal.
    fn decimal(count: u64, offset: u64) -> Self {
        Self::generate(count, |i, out| {
            write!(out, "{}", 2 * i + offset).expect("writing to a Vec cannot fail");
        })
    }

    /// `sku-000000`, `sku-000001`, …: short keys with a common prefix.
    fn sku(count: u64) -> Self {
        Self::generate(count, |i, out| {
            write!(out, "sku-{i:06}").expect("writing to a Vec cannot fail");
        })
    }

    fn len(&self) -> usize {
        self.ends.len()
    }

    fn get(&self, i: usize) -> &[u8] {
        let start = if i == 0 { 0 } else { self.ends[i - 1] };
        &self.bytes[start..self.ends[i]]
    }

    fn iter(&self) -> impl Iterator<Item = &[u8]> {
        (0..self.len()).map(|i| self.get(i))
    }
}

/// A filter of type `F` sized for `n` keys at `p` and holding `keys`.
fn filled<F: Contender>(n: u64, p: f64, keys: &Keys) -> F {
    let mut filter = F::sized_for(n, p);
    for key in keys.iter() {
        filter.insert(key);
    }
    filter
}

/// Prints one line of a configuration's accuracy table: memory, hashes and the measured
/// false-positive rate. Panics on a false negative among the first `absent.len()`
/// present keys, which would mean the contender is wired up wrongly.
fn print_accuracy<F: Contender>(filter: &F, n: u64, p: f64, present: &Keys, absent: &Keys) {
    let missed = present
        .iter()
        .take(absent.len())
        .filter(|key| !filter.contains(key))
        .count();
    assert_eq!(missed, 0, "{} lost inserted keys", F::NAME);
    let false_positives = absent.iter().filter(|key| filter.contains(key)).count();
    let bits_per_key = filter.bits() as f64 / n as f64;
    let optimum = std::f64::consts::LOG2_E * (1.0 / p).log2();
    eprintln!(
        "  {:<11} {:>11} bits = {:>5.2} bits/key ({:.3}x the optimum {:.2}), k = {:>2}, \
         fpp {:.5} over {} absent keys (target {p})",
        F::NAME,
        filter.bits(),
        bits_per_key,
        bits_per_key / optimum,
        optimum,
        filter.hashes(),
        false_positives as f64 / absent.len() as f64,
        absent.len(),
    );
}

/// Times filling an empty filter of type `F` with `keys`; the filter is built before the
/// clock starts and dropped after it stops.
fn bench_fill<F: Contender>(
    group: &mut BenchmarkGroup<'_, WallTime>,
    name: &str,
    (n, p): (u64, f64),
    keys: &Keys,
) {
    group.bench_function(BenchmarkId::new(name, F::NAME), |b| {
        b.iter_batched(
            || F::sized_for(n, p),
            |mut fresh| {
                for key in keys.iter() {
                    fresh.insert(black_box(key));
                }
                fresh
            },
            BatchSize::PerIteration,
        );
    });
}

/// Times one lookup at a time, cycling through `keys`.
fn bench_lookup<F: Contender>(
    group: &mut BenchmarkGroup<'_, WallTime>,
    name: &str,
    filter: &F,
    keys: &Keys,
) {
    group.bench_function(BenchmarkId::new(name, F::NAME), |b| {
        let mut i = 0;
        b.iter(|| {
            let key = keys.get(i);
            i = if i + 1 == keys.len() { 0 } else { i + 1 };
            filter.contains(black_box(key))
        });
    });
}

/// `1M`, `10M`, `10k`: a key count as benchmark ids show it.
fn count_label(n: u64) -> String {
    match n {
        n if n % 1_000_000 == 0 => format!("{}M", n / 1_000_000),
        n if n % 1_000 == 0 => format!("{}k", n / 1_000),
        n => n.to_string(),
    }
}

/// Accuracy lines, then fills and lookups of all three crates, for one `(n, p)`.
fn bench_config(c: &mut Criterion, plan: &Plan, (n, p): (u64, f64)) {
    type Ours = bloomgate::filter::BloomFilter;
    type Fastbloom = fastbloom::AtomicBloomFilter;
    type Bloomfilter = bloomfilter::Bloom<[u8]>;

    let present = Keys::decimal(n, 0);
    let absent = Keys::decimal(plan.absent, 1);
    let ours: Ours = filled(n, p, &present);
    let fb: Fastbloom = filled(n, p, &present);
    let bf: Bloomfilter = filled(n, p, &present);

    let label = format!("{}_{}%", count_label(n), p * 100.0);
    eprintln!("\n{label}: n = {n}, p = {p}");
    print_accuracy(&ours, n, p, &present, &absent);
    print_accuracy(&fb, n, p, &present, &absent);
    print_accuracy(&bf, n, p, &present, &absent);

    let mut group = c.benchmark_group(label);

    // One fill of 10M keys takes seconds here, so criterion warns that ten samples do not
    // fit the target time and then takes one fill per sample, which is all we want.
    group.sampling_mode(SamplingMode::Flat);
    group.sample_size(10);
    group.warm_up_time(Duration::from_secs(1));
    group.measurement_time(Duration::from_secs_f64((n as f64 * 1.2e-6).max(3.0)));
    group.throughput(Throughput::Elements(n));
    bench_fill::<Ours>(&mut group, "insert_u64", (n, p), &present);
    bench_fill::<Fastbloom>(&mut group, "insert_u64", (n, p), &present);
    bench_fill::<Bloomfilter>(&mut group, "insert_u64", (n, p), &present);
    if n == plan.sku_n {
        let skus = Keys::sku(n);
        bench_fill::<Ours>(&mut group, "insert_sku", (n, p), &skus);
        bench_fill::<Fastbloom>(&mut group, "insert_sku", (n, p), &skus);
        bench_fill::<Bloomfilter>(&mut group, "insert_sku", (n, p), &skus);
    }

    group.sampling_mode(SamplingMode::Auto);
    group.sample_size(20);
    group.measurement_time(Duration::from_secs(4));
    group.throughput(Throughput::Elements(1));
    for (name, keys) in [("contains_present", &present), ("contains_absent", &absent)] {
        bench_lookup(&mut group, name, &ours, keys);
        bench_lookup(&mut group, name, &fb, keys);
        bench_lookup(&mut group, name, &bf, keys);
    }
    group.finish();
}

/// The CPU model, core count and target, for the header of a run's results.
fn machine() -> String {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|info| {
            info.lines()
                .find_map(|line| line.strip_prefix("model name"))
                .map(|rest| rest.trim_start_matches([' ', '\t', ':']).to_owned())
        })
        .unwrap_or_else(|| "unknown cpu".to_owned());
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    format!(
        "{cpu}, {cores} cores, {}-{}",
        std::env::consts::ARCH,
        std::env::consts::OS
    )
}

/// The version of `name` pinned in Cargo.lock when this benchmark was built.
fn locked_version(name: &str) -> &'static str {
    const LOCK: &str = include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/Cargo.lock"));
    LOCK.split_once(&format!("name = \"{name}\"\nversion = \""))
        .and_then(|(_, rest)| rest.split_once('"'))
        .map_or("unknown", |(version, _)| version)
}

fn bench_filters(c: &mut Criterion) {
    let (plan, mode) = if benchmarking() {
        (&FULL, "benchmark")
    } else {
        (&TEST, "test mode: one small configuration")
    };
    let build = if cfg!(debug_assertions) {
        "debug"
    } else {
        "optimised"
    };
    eprintln!("machine: {}", machine());
    eprintln!(
        "crates: bloomgate {}, fastbloom {}, bloomfilter {}; {build} build, {mode}",
        env!("CARGO_PKG_VERSION"),
        locked_version("fastbloom"),
        locked_version("bloomfilter"),
    );
    for &config in plan.configs {
        bench_config(c, plan, config);
    }
}

criterion_group!(benches, bench_filters);
criterion_main!(benches);
