//! Offline commands: `bloomgate filter build` (stream the source into a filter with a
//! progress bar and write its snapshot, e.g. before a deploy) and `bloomgate filter
//! inspect` (read and verify a snapshot). They share the loader's code; they never serve.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use indicatif::{ProgressBar, ProgressStyle};

use bloomgate::config::{Config, FilterConfig, WatermarkKind};
use bloomgate::db::{Db, PoolSettings};
use bloomgate::filter::{BloomFilter, BloomParams, snapshot};
use bloomgate::gate::sync::gaps::Gaps;
use bloomgate::gate::{fill, secret_seed, start_watermark};
use bloomgate::watermark::Watermark;

/// Builds the snapshot of `filter` (or of every filter that has a `snapshot_path` when
/// `None`) from the database, writing to `out` or the configured path.
pub async fn build(
    config: &Config,
    filter: Option<&str>,
    out: Option<&Path>,
) -> anyhow::Result<()> {
    let db_config = config
        .database
        .as_ref()
        .context("the config has no [database] to build from")?;
    let db = Db::connect_lazy(
        &db_config.url,
        &PoolSettings {
            max_connections: 2,
            min_connections: 0,
            acquire_timeout: Duration::from_secs(30),
            idle_timeout: None,
        },
    )?;
    let selected: Vec<(&String, &bloomgate::config::FilterConfig)> = config
        .filters
        .iter()
        .filter(|(name, _)| filter.is_none_or(|f| f == name.as_str()))
        .collect();
    if selected.is_empty() {
        bail!(
            "no filter named {:?} in the config",
            filter.unwrap_or("(any)")
        );
    }
    if out.is_some() && selected.len() > 1 {
        bail!("--out needs --filter when the config has several filters");
    }
    for (name, f) in selected {
        let path: PathBuf = match (out, &f.snapshot_path) {
            (Some(p), _) => p.to_owned(),
            (None, Some(p)) => p.clone(),
            (None, None) => bail!("filter `{name}` has no snapshot_path; pass --out PATH"),
        };
        let source: Arc<str> = Arc::from(f.source_query.as_str());
        let mark = start_watermark(f, &db).await?.map(|m| resume_point(m, f));
        let count = db
            .count_rows(&source)
            .await
            .context("counting the source rows")?;
        let capacity = if count > f.expected_items {
            let sized = (count as f64 * 1.25).ceil() as u64;
            eprintln!(
                "filter {name}: the source holds {count} keys, more than expected_items = {}; sizing for {sized}",
                f.expected_items
            );
            sized
        } else {
            f.expected_items
        };
        let params = BloomParams::optimal(capacity, f.false_positive_rate)?;
        let bloom = BloomFilter::new(params, secret_seed()?);
        let bar = ProgressBar::new(count);
        bar.set_style(
            ProgressStyle::with_template(
                "{msg} [{bar:40}] {human_pos}/{human_len} rows  {per_sec}  ETA {eta}",
            )
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> "),
        );
        bar.set_message(format!("filter {name}"));
        let started = Instant::now();
        // Binlog mode: the snapshot records the log position its scan is consistent with.
        let replica = f
            .sync
            .as_ref()
            .filter(|s| s.watermark == WatermarkKind::Binlog)
            .map(|s| {
                s.binlog
                    .url
                    .clone()
                    .unwrap_or_else(|| db_config.url.clone())
            });
        let filled = fill(
            &db,
            &source,
            replica.as_deref(),
            &f.normalize,
            &bloom,
            |n| bar.set_position(n),
            |_| {},
        )
        .await?;
        let (rows, skipped) = (filled.rows, filled.skipped);
        // In binlog mode the scan says where the log goes on.
        let mark = filled.log_position.map(Watermark::Binlog).or(mark);
        bar.finish();
        let took = started.elapsed();
        let info = snapshot::write(&path, &bloom, mark)
            .with_context(|| format!("writing {}", path.display()))?;
        let stats = bloom.stats();
        println!(
            "filter {name}: {rows} rows ({skipped} skipped) in {took:.2?}, {:.0} rows/s; {} bits, {} hashes, fill {:.3}, estimated fpp {:.5}; wrote {} ({} bytes)",
            rows as f64 / took.as_secs_f64().max(1e-9),
            stats.bits,
            stats.hashes,
            stats.fill_ratio,
            stats.estimated_fpp,
            path.display(),
            info.bytes
        );
    }
    db.close().await;
    Ok(())
}

/// The watermark a snapshot built from `start` records: for integer watermarks, below
/// the `overlap_ids` ids under it (rows whose transactions were open during the scan),
/// as a live build's snapshot does, so the first poll after loading reads them.
fn resume_point(start: Watermark, f: &FilterConfig) -> Watermark {
    match (start, &f.sync) {
        (Watermark::Int(id), Some(sync)) => {
            let gaps = Gaps::new(sync.gap_timeout, sync.overlap_ids, 1);
            Watermark::Int(gaps.snapshot_mark(id))
        }
        _ => start,
    }
}

/// Prints a snapshot's header and statistics after verifying it.
pub fn inspect(path: &Path) -> anyhow::Result<()> {
    let summary = snapshot::inspect(path)?;
    println!("{}", super::inspect::Report(&summary));
    Ok(())
}
