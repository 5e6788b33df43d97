//! The gate: the live Bloom filter of one named filter behind an `ArcSwapOption`, its
//! verdict for a key, readiness, and the background loader that fills it from the source
//! query (retrying with backoff while the database is down) and rebuilds it on request.
//! Checking a key takes no lock and allocates nothing. The gate does not answer requests.

use std::borrow::Cow;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use arc_swap::ArcSwapOption;
use serde::Serialize;
use tokio::sync::Notify;

use crate::config::{FilterConfig, Normalize};
use crate::db::Db;
use crate::filter::{BloomFilter, BloomParams, FilterStats};
use crate::key::{KeyBytes, NormKey, normalize};
use crate::metrics::FilterMetrics;

/// What the gate says about a key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Certainly not in the source: answer 404 without any lookup.
    Absent,
    /// Possibly in the source: go on to the cache and the origin.
    MaybePresent,
    /// No filter is loaded yet: fail open (go on, and count it).
    Unavailable,
}

/// Why a load failed.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// The filter could not be sized (config validation normally prevents this).
    #[error("cannot size the filter: {0}")]
    Params(#[from] crate::filter::FilterError),
    /// The source query failed.
    #[error("source query failed: {0}")]
    Db(#[from] crate::db::DbError),
}

/// The result of the last load, for `/admin/filters`.
#[derive(Debug, Clone, Default, Serialize)]
pub struct LoadStatus {
    /// `"ok"`, `"error"`, or `"never"` before the first attempt finishes.
    pub result: &'static str,
    /// Unix seconds when the last attempt finished.
    pub finished_at: Option<f64>,
    /// Duration of the last attempt.
    pub duration_ms: Option<u64>,
    /// Source rows read by the last successful load.
    pub rows: Option<u64>,
    /// Rows whose key failed normalisation in the last successful load.
    pub skipped: Option<u64>,
    /// Message of the last failure, if the last attempt failed.
    pub error: Option<String>,
    /// Failed attempts since the last success.
    pub consecutive_failures: u32,
    /// Whether a load is running now.
    pub loading: bool,
}

/// One named filter and its lifecycle.
pub struct Gate {
    name: Arc<str>,
    config: FilterConfig,
    source_query: Arc<str>,
    /// The filter that answers [`Gate::check`]; `None` until the first load completes.
    live: ArcSwapOption<BloomFilter>,
    /// The filter being built, so keys added during a rebuild reach it as well.
    building: ArcSwapOption<BloomFilter>,
    /// Serialises key additions against the start and the swap of a build (never taken
    /// by `check`): without it a key added between "read live" and "swap" could miss the
    /// new filter.
    writers: Mutex<()>,
    rebuild: Notify,
    status: Mutex<LoadStatus>,
    metrics: FilterMetrics,
}

impl Gate {
    /// A gate with no filter loaded (it fails open until [`Gate::load_until_ready`] succeeds).
    pub fn new(name: &str, config: FilterConfig, metrics: FilterMetrics) -> Gate {
        metrics.set_ready(false);
        let source_query = Arc::from(config.source_query.as_str());
        Gate {
            name: Arc::from(name),
            config,
            source_query,
            live: ArcSwapOption::empty(),
            building: ArcSwapOption::empty(),
            writers: Mutex::new(()),
            rebuild: Notify::new(),
            status: Mutex::new(LoadStatus {
                result: "never",
                ..LoadStatus::default()
            }),
            metrics,
        }
    }

    /// The filter's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The normalisation rule of this filter's keys.
    pub fn normalize_rule(&self) -> &Normalize {
        &self.config.normalize
    }

    /// The verdict for a key's canonical bytes. Lock-free; no allocation.
    pub fn check(&self, key: &[u8]) -> Verdict {
        match self.live.load().as_deref() {
            None => Verdict::Unavailable,
            Some(f) if f.contains(key) => Verdict::MaybePresent,
            Some(_) => Verdict::Absent,
        }
    }

    /// True once a filter is loaded.
    pub fn is_ready(&self) -> bool {
        self.live.load().is_some()
    }

    /// Adds a key to the live filter and to one being built. Returns false if no filter
    /// is loaded yet (the load in progress will read the key from the source instead).
    pub fn add_key(&self, key: &NormKey<'_>) -> bool {
        let mut bytes = KeyBytes::new();
        let bytes = bytes.of(key);
        let _guard = self.writers.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(b) = self.building.load().as_deref() {
            b.insert(bytes);
        }
        match self.live.load().as_deref() {
            Some(f) => {
                f.insert(bytes);
                true
            }
            None => false,
        }
    }

    /// Asks the loader for a full rebuild; the current filter keeps serving meanwhile.
    pub fn request_rebuild(&self) {
        self.rebuild.notify_one();
    }

    /// Statistics of the live filter.
    pub fn stats(&self) -> Option<FilterStats> {
        self.live.load().as_deref().map(BloomFilter::stats)
    }

    /// Refreshes the filter gauges (called at scrape time).
    pub fn publish_metrics(&self) {
        if let Some(s) = self.stats() {
            self.metrics.set_stats(&s);
        }
        self.metrics.set_ready(self.is_ready());
    }

    /// A copy of the last load's status.
    pub fn load_status(&self) -> LoadStatus {
        self.status
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// The configured capacity and target rate.
    pub fn config(&self) -> &FilterConfig {
        &self.config
    }

    /// Runs forever: loads the filter (retrying with exponential backoff while the source
    /// is unavailable), then waits for rebuild requests. Abort the task to stop it.
    pub async fn run_loader(self: Arc<Self>, db: Db) {
        let mut delay = self.config.load_retry_initial;
        loop {
            match self.build_once(&db).await {
                Ok(()) => break,
                Err(e) => {
                    let failures = self
                        .status
                        .lock()
                        .map(|s| s.consecutive_failures)
                        .unwrap_or(0);
                    tracing::warn!(filter = %self.name, error = %e, retry_in_ms = delay.as_millis() as u64,
                        failures, "filter load failed; requests fail open until it succeeds");
                    tokio::time::sleep(jitter(delay)).await;
                    delay = (delay * 2).min(self.config.load_retry_max);
                }
            }
        }
        loop {
            self.rebuild.notified().await;
            tracing::info!(filter = %self.name, "rebuild requested");
            if let Err(e) = self.build_once(&db).await {
                tracing::error!(filter = %self.name, error = %e, "rebuild failed; the previous filter keeps serving");
            }
        }
    }

    /// Builds a fresh filter from the source query and swaps it in. On failure the
    /// current filter (if any) stays.
    pub async fn build_once(&self, db: &Db) -> Result<(), LoadError> {
        let started = Instant::now();
        self.update_status(|s| s.loading = true);
        let result = self.build_inner(db).await;
        let took = started.elapsed();
        let now = unix_now();
        match &result {
            Ok((rows, skipped)) => {
                let stats = self.stats();
                tracing::info!(filter = %self.name, rows, skipped, took_ms = took.as_millis() as u64,
                    items = stats.map(|s| s.items), fill_ratio = stats.map(|s| s.fill_ratio), "filter loaded");
                if *skipped > 0 {
                    tracing::warn!(filter = %self.name, skipped, "source rows had keys that failed normalisation; they were not inserted");
                }
                self.metrics.record_load(true, took, *skipped, now);
                self.update_status(|s| {
                    *s = LoadStatus {
                        result: "ok",
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
                    s.result = "error";
                    s.finished_at = Some(now);
                    s.duration_ms = Some(took.as_millis() as u64);
                    s.error = Some(e.to_string());
                    s.consecutive_failures += 1;
                    s.loading = false;
                });
            }
        }
        self.publish_metrics();
        result.map(|_| ())
    }

    async fn build_inner(&self, db: &Db) -> Result<(u64, u64), LoadError> {
        let params =
            BloomParams::optimal(self.config.expected_items, self.config.false_positive_rate)?;
        let filter = Arc::new(BloomFilter::new(params, rand::random()));
        {
            let _guard = self.writers.lock().unwrap_or_else(|p| p.into_inner());
            self.building.store(Some(Arc::clone(&filter)));
        }
        let rule = self.config.normalize.clone();
        let mut bytes = KeyBytes::new();
        let mut skipped = 0u64;
        let rows = db
            .for_each_key(&self.source_query, |raw| {
                match normalize(&rule, Cow::Borrowed(raw)) {
                    Ok(key) => {
                        filter.insert(bytes.of(&key));
                    }
                    Err(_) => skipped += 1,
                }
            })
            .await;
        let _guard = self.writers.lock().unwrap_or_else(|p| p.into_inner());
        match rows {
            Ok(rows) => {
                // Swap first, then stop mirroring: a key added in between lands in both.
                self.live.store(Some(filter));
                self.building.store(None);
                self.metrics.set_ready(true);
                Ok((rows, skipped))
            }
            Err(e) => {
                self.building.store(None);
                Err(e.into())
            }
        }
    }

    fn update_status(&self, f: impl FnOnce(&mut LoadStatus)) {
        let mut s = self.status.lock().unwrap_or_else(|p| p.into_inner());
        f(&mut s);
    }
}

fn unix_now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

/// Up to 20% random extra delay, so many instances do not retry in step.
fn jitter(d: Duration) -> Duration {
    d + d.mul_f64(rand::random::<f64>() * 0.2)
}
