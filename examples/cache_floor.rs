//! Resident bytes per cached entry: bloomgate's response cache against a bare moka cache
//! with the same keys, the same body sizes and the same per-entry expiry, each filled in
//! a process of its own so that neither inherits the other's heap.
//!
//!   cargo run --release --example cache_floor -- [ENTRIES] [BODY_BYTES] [MAX_BYTES]
//!
//! runs three children (`bare`, `bare-no-expiry` and `bloomgate`), each reporting the
//! growth of its resident size (VmRSS) over inserting ENTRIES (1,000,000) entries of a
//! BODY_BYTES-byte (88) JSON body, then prints one table. With MAX_BYTES, a fourth child
//! inserts the same entries into bloomgate's cache bounded by `max_bytes = MAX_BYTES`
//! and reports how its resident growth compares with the bound. `bare` is moka's floor for this
//! shape: a `moka::future::Cache<CacheKey, Bytes>` with a per-entry expiry, as
//! bloomgate's positive cache has. `bloomgate` fills `cache::ResponseCache` through its
//! load path, with the answers an SQL origin makes. Used by `benches/load/memory`'s
//! table in docs/BENCHMARKS.md.

use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bloomgate::cache::{CacheKey, Loaded, Negative, ResponseCache};
use bloomgate::config::{CacheConfig, StaleWindows};
use bloomgate::key::OwnedKey;
use bloomgate::origin::{CachedResponse, Fetched, ResponseMeta, Stamp};
use bytes::Bytes;
use http::StatusCode;
use moka::Expiry;
use moka::future::Cache;

/// The allocator the `bloomgate` binary runs on, so that the floor and the entry are
/// measured as it holds them.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    if let Some(mode) = args.get(1).filter(|a| a.starts_with("--child=")) {
        let entries: u64 = args.get(2).map_or(Ok(1_000_000), |a| a.parse())?;
        let body: usize = args.get(3).map_or(Ok(88), |a| a.parse())?;
        let max_bytes: Option<u64> = args.get(4).map(|a| a.parse()).transpose()?;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()?;
        let grown = runtime.block_on(child(&mode["--child=".len()..], entries, body, max_bytes))?;
        println!("{:.1} {} {}", grown.per_entry, grown.entries, grown.bytes);
        return Ok(());
    }
    let entries = args.get(1).map_or("1000000", String::as_str);
    let body = args.get(2).map_or("88", String::as_str);
    let max_bytes = args.get(3);
    let me = std::env::current_exe()?;
    let run = |mode: &str| -> anyhow::Result<Vec<f64>> {
        let mut cmd = Command::new(&me);
        cmd.arg(format!("--child={mode}")).args([entries, body]);
        if mode == "bounded" {
            cmd.args(max_bytes);
        }
        let out = cmd.output()?;
        anyhow::ensure!(
            out.status.success(),
            "{mode}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout)
            .split_whitespace()
            .map(|v| Ok(v.parse()?))
            .collect()
    };
    println!("{entries} entries, {body}-byte bodies: resident bytes per entry");
    println!("| cache | bytes per entry | above the body |");
    println!("|---|--:|--:|");
    let body_len: f64 = body.parse()?;
    for mode in ["bare", "bare-no-expiry", "bloomgate"] {
        let per_entry = run(mode)?[0];
        println!("| {mode} | {per_entry:.0} | {:.0} |", per_entry - body_len);
    }
    if let Some(max) = max_bytes {
        let got = run("bounded")?;
        let (per_entry, kept, estimated) = (got[0], got[1], got[2]);
        let resident = per_entry * entries.parse::<f64>()?;
        println!();
        println!(
            "max_bytes = {max}: {kept} entries kept, estimated {estimated} bytes, resident \
             growth {resident:.0} bytes ({:.2} of the bound)",
            resident / max.parse::<f64>()?
        );
    }
    Ok(())
}

/// What one child measured.
struct Grown {
    /// Resident growth over the entries inserted.
    per_entry: f64,
    /// Entries in the cache at the end.
    entries: u64,
    /// The cache's estimate of its bytes at the end (0 when not bounded in bytes).
    bytes: u64,
}

/// A JSON product row whose text is `len` bytes long.
fn product_row(sku: u64, len: usize) -> serde_json::Value {
    let head = format!("{{\"sku_id\":{sku},\"name\":\"");
    let tail = "\"}";
    let pad = len.saturating_sub(head.len() + tail.len());
    serde_json::json!({ "sku_id": sku, "name": "x".repeat(pad) })
}

fn key(sku: u64) -> CacheKey {
    CacheKey {
        route: 0,
        key: OwnedKey::Int(sku),
        variant: None,
    }
}

struct Ttl;

impl Expiry<CacheKey, Bytes> for Ttl {
    fn expire_after_create(&self, _: &CacheKey, _: &Bytes, _: Instant) -> Option<Duration> {
        Some(Duration::from_secs(3600))
    }
}

/// Fills one cache; returns the resident growth per entry.
async fn child(
    mode: &str,
    entries: u64,
    body: usize,
    max_bytes: Option<u64>,
) -> anyhow::Result<Grown> {
    // The rows are made before the first reading and kept until after the last, so that
    // neither their memory nor its reuse is measured; each body is serialised from its
    // row in the measured loop, as the SQL origin does.
    let rows: Vec<serde_json::Value> = (0..entries).map(|i| product_row(i, body)).collect();
    let text = |i: usize| serde_json::to_vec(&rows[i]).unwrap_or_default();
    let before = rss_bytes()?;
    let mut kept = entries;
    let mut estimated = 0;
    let after = match mode {
        "bare" | "bare-no-expiry" => {
            let mut builder = Cache::builder().max_capacity(entries);
            if mode == "bare" {
                builder = builder.expire_after(Ttl);
            }
            let cache: Cache<CacheKey, Bytes> = builder.build();
            for i in 0..rows.len() {
                // The floor: one allocation of exactly the body's length.
                cache
                    .insert(key(i as u64), Bytes::copy_from_slice(&text(i)))
                    .await;
            }
            cache.run_pending_tasks().await;
            anyhow::ensure!(cache.entry_count() == entries, "bare cache lost entries");
            let after = rss_bytes()?;
            drop(cache);
            after
        }
        "bloomgate" | "bounded" => {
            let config = if mode == "bounded" {
                CacheConfig {
                    max_bytes,
                    ..CacheConfig::default()
                }
            } else {
                CacheConfig {
                    max_entries: Some(entries),
                    ..CacheConfig::default()
                }
            };
            let cache = ResponseCache::new(&config, false);
            let stale = StaleWindows {
                if_error: Duration::from_secs(3600),
                while_revalidate: Duration::ZERO,
            };
            let never = || true;
            let meta = ResponseMeta::json_rows(Duration::from_secs(300), stale);
            for i in 0..rows.len() {
                // What `SqlOrigin` makes of a row.
                let answer = CachedResponse {
                    body: Bytes::copy_from_slice(&text(i)),
                    stored_at: Stamp::now(),
                    meta: Arc::clone(&meta),
                    status: StatusCode::OK,
                    with_credentials: false,
                };
                let negative = Negative {
                    ttl: Duration::from_secs(30),
                    still_absent: &never,
                };
                let fetch = async move { Ok(Fetched::Found(answer)) };
                if !matches!(
                    cache.load(key(i as u64), negative, fetch).await,
                    Loaded::Found { .. }
                ) {
                    anyhow::bail!("a load did not store its entry");
                }
            }
            cache.run_pending_maintenance().await;
            let (positive, _) = cache.entry_counts();
            if mode == "bloomgate" {
                anyhow::ensure!(positive == entries, "bloomgate's cache lost entries");
            }
            kept = positive;
            estimated = cache.estimated_bytes().0.unwrap_or(0);
            rss_bytes()?
        }
        other => anyhow::bail!("unknown mode {other}"),
    };
    let grown = after.saturating_sub(before);
    drop(rows);
    Ok(Grown {
        per_entry: grown as f64 / entries as f64,
        entries: kept,
        bytes: estimated,
    })
}

/// VmRSS of this process.
fn rss_bytes() -> anyhow::Result<u64> {
    let status = std::fs::read_to_string("/proc/self/status")?;
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .ok_or_else(|| anyhow::anyhow!("no VmRSS in /proc/self/status"))?;
    Ok(kib * 1024)
}
