//! Benchmarks of `bloomgate::filter` at one million keys and a 1% false-positive rate:
//! filling an empty filter, and lookups of present and of absent keys. Keys are u64
//! ids in decimal, the even numbers inserted and the odd ones absent.
//!
//! Run with `cargo bench --bench filter`. Each run first prints the machine it ran on
//! and the filter's measured false-positive rate and bits per key to stderr.

use std::hint::black_box;
use std::time::Duration;

use bloomgate::filter::{BloomFilter, BloomParams};
use criterion::{BatchSize, Criterion, Throughput, criterion_group, criterion_main};

const N: u64 = 1_000_000;
const P: f64 = 0.01;
const SEED: u32 = 0x5eed_b100;

/// The keys `2i + offset` for `i` in `0..N`, as decimal bytes.
fn keys(offset: u64) -> Vec<Box<[u8]>> {
    (0..N)
        .map(|i| (2 * i + offset).to_string().into_bytes().into_boxed_slice())
        .collect()
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

fn bench_filter(c: &mut Criterion) {
    let params = BloomParams::optimal(N, P).expect("valid parameters");
    let present = keys(0);
    let absent = keys(1);
    let filter = BloomFilter::new(params, SEED);
    for key in &present {
        filter.insert(key);
    }

    let false_positives = absent.iter().filter(|key| filter.contains(key)).count();
    let stats = filter.stats();
    eprintln!("machine: {}", machine());
    eprintln!(
        "filter: n = {N}, p = {P}: {} bits ({:.2} bits per key, {} bytes), {} hashes; \
         measured false-positive rate {:.5} over {N} absent keys, estimated {:.5}",
        stats.bits,
        stats.bits as f64 / N as f64,
        stats.bytes,
        stats.hashes,
        false_positives as f64 / N as f64,
        stats.estimated_fpp,
    );

    let mut group = c.benchmark_group("filter_1m_p1");

    group.throughput(Throughput::Elements(N));
    group.sample_size(10);
    group.measurement_time(Duration::from_secs(10));
    group.bench_function("insert_1m_into_empty", |b| {
        b.iter_batched(
            || BloomFilter::new(params, SEED),
            |fresh| {
                for key in &present {
                    fresh.insert(black_box(key));
                }
                fresh
            },
            BatchSize::PerIteration,
        );
    });

    group.throughput(Throughput::Elements(1));
    group.sample_size(50);
    group.measurement_time(Duration::from_secs(5));
    for (name, keys) in [("contains_present", &present), ("contains_absent", &absent)] {
        group.bench_function(name, |b| {
            let mut next = keys.iter().cycle();
            b.iter(|| {
                let key = next.next().expect("cycle over a non-empty list");
                filter.contains(black_box(key))
            });
        });
    }
    group.finish();
}

criterion_group!(benches, bench_filter);
criterion_main!(benches);
