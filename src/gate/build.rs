//! Filling a gate: the warm start from a snapshot, the full build from the source query
//! (sized from the source count when it outgrew capacity, with a fresh secret seed),
//! the atomic swap, the snapshot written after it, and the loader task that retries with
//! backoff and rebuilds on schedule, on request and on capacity. Serving is not here.

use std::collections::HashSet;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use futures_util::FutureExt;
use rand::TryRngCore;

use super::membership::Membership;
use super::{BuildPhase, Filter, LoadOrigin, LoadResult, LoadStatus, RebuildReason, lock};
use bloomgate_core::config::FilterConfig;
use bloomgate_core::db::Db;
use bloomgate_core::db::binlog::BinlogError;
use bloomgate_core::filter::snapshot;
use bloomgate_core::filter::{BloomFilter, BloomParams};
use bloomgate_core::key::{KeyBytes, OwnedKey};
use bloomgate_core::metrics::unix_now;
use bloomgate_core::report::Chain;
use bloomgate_core::watermark::Watermark;

mod scan;
pub use scan::{Filled, fill, start_watermark};

/// Why a build failed.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// The filter could not be sized.
    #[error("cannot size the filter")]
    Params(#[from] bloomgate_core::filter::FilterError),
    /// A query failed.
    #[error("source query failed")]
    Db(#[from] bloomgate_core::db::DbError),
    /// The operating system's random source failed (no seed can be drawn).
    #[error("cannot draw a random seed")]
    Seed(#[from] rand::rand_core::OsError),
    /// Binlog mode: the consistent scan, or the server's binary log, failed.
    #[error("binlog mode")]
    Binlog(#[from] BinlogError),
}

/// A source this much larger than capacity sizes the filter from the count.
const HEADROOM: f64 = 1.25;

impl Filter {
    /// Runs until aborted: warm start from the snapshot if there is a good one, otherwise
    /// a full build retried with exponential backoff while the source is unavailable
    /// (requests fail open meanwhile); then rebuilds on request, on schedule and when
    /// items outgrow capacity.
    pub async fn run_loader(self: Arc<Self>, db: Db) {
        let config = self.config();
        let warm = match config.snapshot_path.clone() {
            Some(path) => self.load_snapshot(&path).await,
            None => false,
        };
        if warm && config.sync.is_none() {
            // Without sync nothing brings keys created since the snapshot was written:
            // rebuild now, while the snapshot serves.
            self.request_rebuild(RebuildReason::Startup);
        }
        if !warm {
            let mut delay = config.load_retry_initial;
            while let Err(e) = self.build_once(&db, RebuildReason::Startup).await {
                tracing::warn!(filter = %self.name, error = %Chain(&e), retry_in_ms = delay.as_millis() as u64,
                    "filter load failed; requests fail open until it succeeds");
                tokio::time::sleep(jitter(delay)).await;
                delay = (delay * 2).min(self.config().load_retry_max);
            }
        }
        self.rebuild_loop(db).await
    }

    /// Runs every rebuild that comes due (see [`Filter::next_rebuild`]), for ever.
    pub async fn rebuild_loop(self: Arc<Self>, db: Db) {
        loop {
            let reason = self.next_rebuild().await;
            tracing::info!(filter = %self.name, reason = reason.as_str(), "rebuilding; the current filter keeps serving");
            if let Err(e) = self.build_once(&db, reason).await {
                tracing::error!(filter = %self.name, error = %Chain(&e), reason = reason.as_str(),
                    "rebuild failed; the previous filter keeps serving");
            }
        }
    }

    /// Waits until a rebuild is due: asked for (by the admin API or a capacity
    /// crossing), or `rebuild_interval` after this call. Returns why.
    pub async fn next_rebuild(&self) -> RebuildReason {
        let mut config = self.watch_config();
        loop {
            // A reload may change the schedule: the wait starts over with the new one.
            let every = config.borrow_and_update().rebuild_interval;
            let scheduled = async {
                match every {
                    Some(every) => tokio::time::sleep(every).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                _ = self.rebuild.notified() => return *lock(&self.rebuild_reason),
                _ = scheduled => return RebuildReason::Scheduled,
                changed = config.changed() => {
                    if changed.is_err() {
                        // The sender lives as long as `self`; this cannot happen.
                        std::future::pending::<()>().await;
                    }
                }
            }
        }
    }

    /// Swaps in a filter built elsewhere (a fleet's shared generation), after adding
    /// `replay` (keys admitted since that filter's build started) and every key this
    /// instance admitted that no build has confirmed. Admitted keys the new filter
    /// already holds are confirmed: the filter it came from carries them on. `watermark`
    /// is where sync resumes if this instance syncs later.
    pub fn install(
        &self,
        filter: BloomFilter,
        watermark: Option<Watermark>,
        replay: &[OwnedKey],
        reason: RebuildReason,
    ) {
        let started = Instant::now();
        let p = filter.params();
        self.target_capacity
            .fetch_max(p.expected_items, Ordering::AcqRel);
        {
            let mut admissions = lock(&self.admissions);
            let membership = Membership::Local(filter);
            admissions.confirm_held(&membership);
            let mut bytes = KeyBytes::new();
            for key in replay {
                membership.insert(bytes.of(&key.as_norm()));
            }
            admissions.replay(&membership);
            self.metrics.set_unconfirmed(admissions.len());
            self.live.store(Some(Arc::new(membership)));
        }
        if let Some(w) = watermark {
            self.advance_watermark(w);
        }
        self.deletes_rebuilt();
        self.capacity_warned.store(false, Ordering::Relaxed);
        // A capacity crossing of the filter this one replaces does not apply to it: the
        // next admission judges the new one (a follower whose old filter filled up must
        // not start a scan of its own later, when it goes on alone).
        self.capacity_rebuild_pending
            .store(false, Ordering::Release);
        if *lock(&self.rebuild_reason) == RebuildReason::Capacity {
            let _ = self.rebuild.notified().now_or_never();
        }
        self.metrics.set_built_at(unix_now());
        self.metrics.set_ready(true);
        let now = unix_now();
        self.update_status(|s| {
            *s = LoadStatus {
                result: LoadResult::Ok,
                origin: Some(LoadOrigin::Fleet),
                reason: Some(reason),
                finished_at: Some(now),
                duration_ms: Some(started.elapsed().as_millis() as u64),
                ..LoadStatus::default()
            }
        });
        self.publish_metrics();
        self.watch_capacity();
    }

    /// The live filter as snapshot bytes, with the watermark sync resumes from; `None`
    /// before the first load.
    pub fn encode_live(&self) -> Option<(Vec<u8>, Option<Watermark>, u64)> {
        let live = self.live.load_full()?;
        let mark = self.watermark().map(|m| self.sync_restart_mark(m));
        let Membership::Local(f) = &*live;
        // The count the snapshot records, not one read after it: admissions go on while
        // it is encoded, and a follower refuses a record that disagrees with its bytes.
        let (bytes, items) = snapshot::encode_counted(f, mark);
        Some((bytes, mark, items))
    }

    /// Loads the snapshot at `path` if it is valid and matches the config. Returns
    /// whether the gate is now ready. Every rejection is logged with its reason.
    async fn load_snapshot(&self, path: &Path) -> bool {
        let started = Instant::now();
        let owned = path.to_owned();
        let read = tokio::task::spawn_blocking(move || snapshot::read(&owned)).await;
        let snap = match read {
            Ok(Ok(s)) => s,
            Ok(Err(snapshot::SnapshotError::Io { source, .. }))
                if source.kind() == std::io::ErrorKind::NotFound =>
            {
                tracing::info!(filter = %self.name, path = %path.display(), "no snapshot yet; building from the source");
                return false;
            }
            Ok(Err(e)) => {
                tracing::warn!(filter = %self.name, path = %path.display(), error = %Chain(&e),
                    "snapshot rejected; building from the source instead");
                self.metrics.snapshot_load(false);
                return false;
            }
            Err(e) => {
                tracing::error!(filter = %self.name, error = %Chain(&e), "snapshot reader task failed");
                return false;
            }
        };
        let p = snap.filter.params();
        let config = self.config();
        if let Err(why) = fits_config(p, &config) {
            tracing::warn!(filter = %self.name, path = %path.display(),
                snapshot_capacity = p.expected_items, snapshot_rate = p.false_positive_rate,
                config_capacity = config.expected_items, config_rate = config.false_positive_rate,
                mismatch = %why, "snapshot parameters do not match the config; building from the source instead");
            self.metrics.snapshot_load(false);
            return false;
        }
        if config.sync.is_some() && snap.watermark.is_none() {
            tracing::warn!(filter = %self.name, path = %path.display(),
                "snapshot has no sync watermark but sync is configured; building from the source instead");
            self.metrics.snapshot_load(false);
            return false;
        }
        self.target_capacity
            .fetch_max(p.expected_items, Ordering::AcqRel);
        let items = snap.filter.items();
        let built_at = snap
            .created_at
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        {
            // Keys admitted before the snapshot was read are not in it.
            let admissions = lock(&self.admissions);
            let membership = Membership::Local(snap.filter);
            admissions.replay(&membership);
            self.live.store(Some(Arc::new(membership)));
        }
        if let Some(w) = snap.watermark {
            self.advance_watermark(w);
        }
        self.deletes_rebuilt();
        let took = started.elapsed();
        self.metrics.snapshot_load(true);
        self.metrics.set_built_at(built_at);
        self.metrics.set_ready(true);
        self.update_status(|s| {
            *s = LoadStatus {
                result: LoadResult::Ok,
                origin: Some(LoadOrigin::Snapshot),
                reason: Some(RebuildReason::Startup),
                finished_at: Some(unix_now()),
                duration_ms: Some(took.as_millis() as u64),
                ..LoadStatus::default()
            }
        });
        self.publish_metrics();
        tracing::info!(filter = %self.name, path = %path.display(), items, took_ms = took.as_millis() as u64,
            watermark = snap.watermark.map(|w| w.to_string()), "filter loaded from snapshot");
        true
    }

    /// Builds a fresh filter from the source query and swaps it in. On failure the
    /// current filter (if any) stays.
    /// Returns the watermark sync resumes from after this build (`None` without sync).
    pub async fn build_once(
        &self,
        db: &Db,
        reason: RebuildReason,
    ) -> Result<Option<Watermark>, LoadError> {
        let started = Instant::now();
        self.update_status(|s| s.loading = true);
        let result = self.build_inner(db).await;
        let took = started.elapsed();
        let now = unix_now();
        self.capacity_rebuild_pending
            .store(false, Ordering::Release);
        match &result {
            Ok(((rows, skipped), _)) => {
                let stats = self.stats();
                tracing::info!(filter = %self.name, reason = reason.as_str(), rows, skipped,
                    took_ms = took.as_millis() as u64, items = stats.map(|s| s.items),
                    capacity = stats.map(|s| s.capacity), "filter loaded");
                if *skipped > 0 {
                    tracing::warn!(filter = %self.name, skipped, "source rows had keys that failed normalisation; they were not inserted");
                }
                self.metrics.record_load(true, took, *skipped, now);
                self.update_status(|s| {
                    *s = LoadStatus {
                        result: LoadResult::Ok,
                        origin: Some(LoadOrigin::Source),
                        reason: Some(reason),
                        finished_at: Some(now),
                        duration_ms: Some(took.as_millis() as u64),
                        rows: Some(*rows),
                        skipped: Some(*skipped),
                        error: None,
                        consecutive_failures: 0,
                        loading: false,
                    }
                });
            }
            Err(e) => {
                self.metrics.record_load(false, took, 0, now);
                self.update_status(|s| {
                    s.result = LoadResult::Error;
                    s.reason = Some(reason);
                    s.finished_at = Some(now);
                    s.duration_ms = Some(took.as_millis() as u64);
                    s.error = Some(Chain(e).to_string());
                    s.consecutive_failures += 1;
                    s.loading = false;
                });
            }
        }
        self.publish_metrics();
        let (_, start_mark) = result?;
        // A restart resumes from the snapshot's mark: never above an open gap.
        let mark = start_mark.map(|m| self.sync_restart_mark(m));
        self.write_snapshot(mark).await;
        Ok(mark)
    }

    /// Returns ((rows, skipped), the watermark sync may resume from).
    async fn build_inner(&self, db: &Db) -> Result<((u64, u64), Option<Watermark>), LoadError> {
        // The keys admitted so far that no build has confirmed: the scan looks for them.
        // Keys admitted from here on are replayed at the swap like these, and confirmed by
        // a later build.
        let wanted = lock(&self.admissions).snapshot();
        self.phase(BuildPhase::Sizing).await;
        // Read the resume point before the source, so no row falls between the two.
        let start_mark = self.start_watermark(db).await?;
        let mut capacity = self.target_capacity.load(Ordering::Acquire);
        match db.count_rows(&self.source_query).await {
            Ok(count) if count > capacity => {
                let sized = ((count as f64) * HEADROOM).ceil() as u64;
                tracing::warn!(filter = %self.name, source_rows = count, capacity, new_capacity = sized,
                    "the source holds more keys than the configured capacity; sizing the filter from the count");
                capacity = sized;
                self.target_capacity.fetch_max(sized, Ordering::AcqRel);
            }
            Ok(_) => {}
            Err(e) => {
                tracing::warn!(filter = %self.name, error = %Chain(&e), "cannot count the source; sizing from capacity");
            }
        }
        let params = BloomParams::optimal(capacity, self.config().false_positive_rate)?;
        let seed = secret_seed()?;
        let filter = BloomFilter::new(params, seed);
        self.phase(BuildPhase::Scanning).await;
        let mut listed = HashSet::new();
        let filled = fill(
            db,
            &self.source_query,
            self.binlog_source.as_ref().map(|b| b.url.as_str()),
            &self.normalize,
            &filter,
            |_| {},
            |bytes| {
                if !wanted.is_empty() && wanted.contains(bytes) {
                    listed.insert(Box::from(bytes));
                }
            },
        )
        .await?;
        let (rows, skipped) = (filled.rows, filled.skipped);
        // In binlog mode the scan says where the log goes on.
        let start_mark = filled.log_position.map(Watermark::Binlog).or(start_mark);
        self.phase(BuildPhase::Swapping).await;
        {
            let mut admissions = lock(&self.admissions);
            // Every admitted key goes in before the swap, under the lock that admissions
            // take: none can fall between the replay and the swap.
            let membership = Membership::Local(filter);
            admissions.replay(&membership);
            admissions.confirm(&listed);
            self.metrics.set_unconfirmed(admissions.len());
            self.live.store(Some(Arc::new(membership)));
        }
        self.capacity_warned.store(false, Ordering::Relaxed);
        if let Some(m) = start_mark {
            self.start_sync_at(m);
        }
        self.deletes_rebuilt();
        self.metrics.set_ready(true);
        self.phase(BuildPhase::Swapped).await;
        Ok(((rows, skipped), start_mark))
    }

    /// Waits for the build hook, if one is set.
    async fn phase(&self, phase: BuildPhase) {
        let hook = lock(&self.build_hook).clone();
        if let Some(hook) = hook {
            hook(phase).await;
        }
    }

    async fn start_watermark(&self, db: &Db) -> Result<Option<Watermark>, LoadError> {
        start_watermark(&self.config(), db).await
    }

    /// Writes the live filter to `snapshot_path` (if configured), off the async threads.
    async fn write_snapshot(&self, watermark: Option<Watermark>) {
        let (Some(path), Some(filter)) =
            (self.config().snapshot_path.clone(), self.live.load_full())
        else {
            return;
        };
        let shown = path.display().to_string();
        let written = tokio::task::spawn_blocking(move || filter.snapshot(&path, watermark)).await;
        match written {
            Ok(Ok(info)) => {
                self.metrics.snapshot_write(true);
                tracing::info!(filter = %self.name, path = %shown, bytes = info.bytes,
                    took_ms = info.took.as_millis() as u64, "snapshot written");
            }
            Ok(Err(e)) => {
                self.metrics.snapshot_write(false);
                tracing::error!(filter = %self.name, path = %shown, error = %Chain(&e), "snapshot write failed");
            }
            Err(e) => {
                tracing::error!(filter = %self.name, error = %Chain(&e), "snapshot writer task failed")
            }
        }
    }
}

/// How a filter built elsewhere differs from the configuration it would serve.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum Mismatch {
    /// Built for another false-positive rate.
    #[error("false-positive rate {built} where the config says {configured}")]
    Rate {
        /// The filter's rate.
        built: f64,
        /// `false_positive_rate` in the config.
        configured: f64,
    },
    /// Built for fewer keys than the config expects.
    #[error("capacity {built} below the configured {configured}")]
    Capacity {
        /// The filter's capacity.
        built: u64,
        /// `expected_items` in the config.
        configured: u64,
    },
}

/// Whether a filter built elsewhere (a snapshot file, a fleet generation) with
/// parameters `p` can serve `config`: the same false-positive rate, and at least the
/// configured capacity. The error says what differs.
pub fn fits_config(p: BloomParams, config: &FilterConfig) -> Result<(), Mismatch> {
    if (p.false_positive_rate - config.false_positive_rate).abs() >= 1e-12 {
        return Err(Mismatch::Rate {
            built: p.false_positive_rate,
            configured: config.false_positive_rate,
        });
    }
    if p.expected_items < config.expected_items {
        return Err(Mismatch::Capacity {
            built: p.expected_items,
            configured: config.expected_items,
        });
    }
    Ok(())
}

/// A fresh secret seed from the operating system's random source, so nobody outside
/// can compute which absent keys this filter lets through.
pub fn secret_seed() -> Result<u32, LoadError> {
    Ok(rand::rngs::OsRng.try_next_u32()?)
}

/// Up to 20% random extra delay, so many instances do not retry in step.
fn jitter(d: Duration) -> Duration {
    d + d.mul_f64(rand::random::<f64>() * 0.2)
}

#[cfg(test)]
mod tests {
    use std::error::Error as StdError;

    use super::*;
    use bloomgate_core::config::Normalize;
    use bloomgate_core::db::{DbError, PoolSettings};

    #[tokio::test]
    async fn a_failing_source_query_keeps_the_database_error_as_its_cause() {
        let db = Db::connect_lazy("sqlite::memory:", &PoolSettings::default()).expect("url");
        let filter = BloomFilter::new(BloomParams::optimal(100, 0.01).expect("params"), 7);
        let err = fill(
            &db,
            &Arc::from("SELECT id FROM no_such_table"),
            None,
            &Normalize::Integer,
            &filter,
            |_| {},
            |_| {},
        )
        .await
        .expect_err("a scan of a missing table must fail");
        assert!(matches!(err, LoadError::Db(DbError::Query(_))), "{err:?}");
        let db_error = err
            .source()
            .and_then(|c| c.downcast_ref::<DbError>())
            .expect("the direct cause is the DbError");
        let sqlx_error = db_error
            .source()
            .and_then(|c| c.downcast_ref::<sqlx::Error>())
            .expect("whose cause is sqlx's");
        assert!(
            sqlx_error.to_string().contains("no_such_table"),
            "{sqlx_error}"
        );
    }
}
