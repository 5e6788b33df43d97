//! The gate: the live Bloom filter of one named filter behind an `ArcSwapOption`, its
//! verdict for a key, readiness, capacity tracking, the sync watermark, and admissions:
//! keys that become present between builds. Checking a key takes no lock and allocates
//! nothing. Loading, rebuilding and snapshots live in `gate::build`; the gate does not
//! answer requests.
//!
//! Admissions are kept until a build's source scan lists them (`Admissions`), so that
//! no filter swapped in can lack a key admitted before or during its build, whatever the
//! source returns (a lagging replica, a key the source does not hold). Each admission
//! also moves a counter of its key's stripe, which the origin lookup reads before it
//! asks and checks after it stored a negative entry ([`Fence`]).

mod admissions;
pub mod admit;
mod build;
pub mod held;
pub mod membership;
pub mod metrics;
pub mod redis_held;
pub mod sync;
mod verdict;

use std::hash::BuildHasher;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use arc_swap::ArcSwapOption;
use serde::Serialize;
use tokio::sync::{Notify, watch};

pub use build::{LoadError, fill, fits_config, secret_seed, start_watermark};

use crate::config::{FilterConfig, Normalize};
use crate::filter::FilterStats;
use crate::gate::metrics::FilterMetrics;
use crate::gate::sync::gaps::{Gaps, MAX_OPEN_RANGES, PollGaps};
use crate::key::{KeyBytes, NormKey};
use crate::watermark::Watermark;
use admissions::Admissions;
use membership::{Membership, Probe};

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

/// The result of the last load or rebuild, for `/admin/filters`.
#[derive(Debug, Clone, Default, Serialize)]
pub struct LoadStatus {
    /// How the last attempt ended.
    pub result: LoadResult,
    /// How the live filter was obtained.
    pub origin: Option<LoadOrigin>,
    /// Why the last build ran.
    pub reason: Option<RebuildReason>,
    /// Unix seconds when the last attempt finished.
    pub finished_at: Option<f64>,
    /// Duration of the last attempt.
    pub duration_ms: Option<u64>,
    /// Source rows read by the last successful build.
    pub rows: Option<u64>,
    /// Rows whose key failed normalisation in the last successful build.
    pub skipped: Option<u64>,
    /// Message of the last failure, if the last attempt failed.
    pub error: Option<String>,
    /// Failed attempts since the last success.
    pub consecutive_failures: u32,
    /// Whether a build is running now.
    pub loading: bool,
}

/// How the last load or rebuild ended; `"ok"`, `"error"` or `"never"` in the admin API.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum LoadResult {
    /// No attempt has finished yet.
    #[default]
    Never,
    /// The filter was loaded.
    Ok,
    /// The attempt failed (see [`LoadStatus::error`]).
    Error,
}

/// Where the live filter came from; `"source"` or `"snapshot"` in the admin API.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum LoadOrigin {
    /// A full build from the source query.
    Source,
    /// The snapshot file, at start-up.
    Snapshot,
    /// A generation published by the fleet's builder.
    Fleet,
}

/// Why a rebuild was asked for; serialised as [`RebuildReason::as_str`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum RebuildReason {
    /// The first build at start-up.
    Startup,
    /// `POST /admin/filters/{name}/rebuild`.
    Requested,
    /// `rebuild_interval` elapsed.
    Scheduled,
    /// Items exceeded capacity.
    Capacity,
    /// The fleet's builder published a generation.
    Published,
    /// A configuration reload changed the filter's sizing.
    Reload,
}

impl RebuildReason {
    /// Label for logs and the admin API.
    pub fn as_str(self) -> &'static str {
        match self {
            RebuildReason::Startup => "startup",
            RebuildReason::Requested => "requested",
            RebuildReason::Scheduled => "scheduled",
            RebuildReason::Capacity => "capacity",
            RebuildReason::Published => "published",
            RebuildReason::Reload => "reload",
        }
    }
}

/// The steps of a full build, in order, as a build hook sees them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BuildPhase {
    /// The build has begun: it reads the sync start mark and counts the source next.
    Sizing,
    /// The new filter is allocated; the source scan is next.
    Scanning,
    /// The scan is done; the admitted keys are replayed and the filter swapped in next.
    Swapping,
    /// The new filter serves.
    Swapped,
}

/// Called at each phase `P` of a lifecycle step and awaited before the step goes on: a
/// way to watch it, or to hold it at one phase.
pub type PhaseHook<P> =
    Arc<dyn Fn(P) -> std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>> + Send + Sync>;

/// Called at each [`BuildPhase`] of every full build.
pub type BuildHook = PhaseHook<BuildPhase>;

/// One named filter and its lifecycle.
pub struct Filter {
    name: Arc<str>,
    /// Replaced by [`Filter::reconfigure`]; its source (query, normalisation, watermark
    /// kind) never changes: a filter with another source is another `Filter`.
    /// Its receivers (the sync loop, the loader) wake when it changes.
    config: watch::Sender<Arc<FilterConfig>>,
    normalize: Normalize,
    source_query: Arc<str>,
    /// The filter that answers [`Filter::check`]; `None` until the first load completes.
    live: ArcSwapOption<Membership>,
    /// Admitted keys that no build has confirmed yet. Its lock serialises admissions
    /// against the swap of a build (never taken by `check`): a key is either admitted
    /// before the swap, and replayed into the new filter, or after it, into the new one.
    admissions: Mutex<Admissions>,
    /// Admission counters by key stripe, for [`Filter::fence`].
    stripes: Box<[AtomicU64]>,
    /// Keyed randomly at start: which keys share a stripe is not predictable.
    stripe_hasher: std::collections::hash_map::RandomState,
    /// Capacity the next build is sized for; grows when items outrun it.
    target_capacity: AtomicU64,
    /// A capacity rebuild has been asked for and not started yet.
    capacity_rebuild_pending: AtomicBool,
    /// The warning threshold is currently crossed (so it is logged once per crossing).
    capacity_warned: AtomicBool,
    /// Wakes the loader for a rebuild.
    rebuild: Notify,
    /// Why the next rebuild was asked for (the last request wins).
    rebuild_reason: Mutex<RebuildReason>,
    /// How far incremental sync has read, and what it skipped over.
    watermark: Mutex<SyncPosition>,
    /// See [`Filter::set_build_hook`].
    build_hook: Mutex<Option<BuildHook>>,
    status: Mutex<LoadStatus>,
    metrics: FilterMetrics,
    /// The copy held in Redis (`backend = "redis"`), set once at start.
    held: std::sync::OnceLock<Arc<held::HeldGate>>,
    /// Whether admissions are kept in `admissions` for the next build or load to replay.
    /// Off only on an instance that holds no copy of a filter held in Redis
    /// (`redis.local_copy = false`) and does not build it: nothing would replay them.
    keeps_admissions: AtomicBool,
}

impl Filter {
    /// A gate with no filter loaded (it fails open until its loader succeeds).
    pub fn new(name: &str, config: FilterConfig, metrics: FilterMetrics) -> Filter {
        metrics.set_ready(false);
        let source_query = Arc::from(config.source_query.as_str());
        let position = SyncPosition::new(&config);
        Filter {
            name: Arc::from(name),
            target_capacity: AtomicU64::new(config.expected_items),
            normalize: config.normalize.clone(),
            config: watch::Sender::new(Arc::new(config)),
            source_query,
            live: ArcSwapOption::empty(),
            admissions: Mutex::new(Admissions::default()),
            stripes: (0..FENCE_STRIPES).map(|_| AtomicU64::new(0)).collect(),
            stripe_hasher: std::collections::hash_map::RandomState::new(),
            capacity_rebuild_pending: AtomicBool::new(false),
            capacity_warned: AtomicBool::new(false),
            rebuild: Notify::new(),
            rebuild_reason: Mutex::new(RebuildReason::Requested),
            watermark: Mutex::new(position),
            build_hook: Mutex::new(None),
            status: Mutex::new(LoadStatus::default()),
            metrics,
            held: std::sync::OnceLock::new(),
            keeps_admissions: AtomicBool::new(true),
        }
    }

    /// The filter's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The normalisation rule of this filter's keys.
    pub fn normalize_rule(&self) -> &Normalize {
        &self.normalize
    }

    /// The filter's configuration, as last set.
    pub fn config(&self) -> Arc<FilterConfig> {
        Arc::clone(&self.config.borrow())
    }

    /// A receiver that sees each configuration [`Filter::reconfigure`] sets from now on.
    pub fn watch_config(&self) -> watch::Receiver<Arc<FilterConfig>> {
        self.config.subscribe()
    }

    /// Applies a reloaded configuration of the same source (see
    /// [`Reconfigure::classify`]; another source needs another `Filter`). A new sizing,
    /// or sync switched on, asks for a rebuild, which the current filter serves through;
    /// anything else (sync settings, schedule, snapshot path, retries) takes effect
    /// without one.
    pub fn reconfigure(&self, new: FilterConfig) -> Reconfigure {
        let change = Reconfigure::classify(&self.config(), &new);
        if change == Reconfigure::Unchanged {
            return change;
        }
        let rebuild = change == Reconfigure::Rebuild;
        if rebuild {
            self.target_capacity
                .store(new.expected_items, Ordering::Release);
        }
        self.config.send_replace(Arc::new(new));
        if rebuild {
            self.request_rebuild(RebuildReason::Reload);
        }
        change
    }

    /// The verdict for a key's canonical bytes. Lock-free; no allocation.
    pub fn check(&self, key: &[u8]) -> Verdict {
        match self.live.load().as_deref().map(|m| m.probe(key)) {
            None => Verdict::Unavailable,
            Some(Probe::Ready(true)) => Verdict::MaybePresent,
            Some(Probe::Ready(false)) => Verdict::Absent,
        }
    }

    /// Attaches the copy held in Redis; a second call is ignored.
    pub fn set_held(&self, gate: Arc<held::HeldGate>) {
        let _ = self.held.set(gate);
    }

    /// The copy held in Redis, with `backend = "redis"`.
    pub fn held(&self) -> Option<&Arc<held::HeldGate>> {
        self.held.get()
    }

    /// The verdict for a key that the local copy gave `local` (not
    /// [`Verdict::MaybePresent`]: a key the local copy may hold is not sent to Redis),
    /// asking the copy held in Redis (see [`held`]). Redis can only turn a refusal or
    /// a missing local copy into an answer; when it does not answer, `local` stands.
    pub async fn ask_held(&self, held: &held::HeldGate, key: &[u8], local: Verdict) -> Verdict {
        if local == Verdict::MaybePresent {
            return local;
        }
        match held.check(key).await {
            Some(true) => Verdict::MaybePresent,
            Some(false) => Verdict::Absent,
            None => local,
        }
    }

    /// The live filter's own bits, for writing them elsewhere.
    pub fn live_membership(&self) -> Option<Arc<Membership>> {
        self.live.load_full()
    }

    /// True once a filter is loaded here, or (for a filter held in Redis) once a
    /// generation in Redis was adopted. It stays true whatever happens to Redis after
    /// (requests that cannot be gated fail open, counted, as on any instance): an outage
    /// or a restart of Redis does not take every instance out of its load balancer.
    pub fn is_ready(&self) -> bool {
        self.has_local_copy() || self.held.get().is_some_and(|h| h.adopted_any())
    }

    /// True once this instance holds a copy of its own (built, loaded or restored).
    pub fn has_local_copy(&self) -> bool {
        self.live.load().is_some()
    }

    /// False for a filter held in Redis with `redis.local_copy = false`: only the
    /// instance that builds it holds a copy.
    pub fn wants_local_copy(&self) -> bool {
        let config = self.config.borrow();
        config.backend == crate::config::Backend::Local || config.redis.local_copy
    }

    /// Stops holding a copy (an instance that does not build a filter held in Redis
    /// alone): drops the live filter, and the admissions kept for a build or load to
    /// replay (nothing would replay them). Cheap when there is neither to drop.
    pub fn release_copy(&self) {
        if !self.keeps_admissions.load(Ordering::Acquire) && self.live.load().is_none() {
            return;
        }
        {
            let mut admissions = lock(&self.admissions);
            self.keeps_admissions.store(false, Ordering::Release);
            admissions.forget_all();
            self.metrics.set_unconfirmed(0);
            if self.live.swap(None).is_some() {
                tracing::info!(filter = %self.name, "dropped this instance's copy of the filter; the copy in Redis answers");
            }
        }
        self.metrics.clear_stats();
        self.publish_metrics();
    }

    /// Keeps admissions for a build or load to replay again (see `keeps_admissions`):
    /// this instance is about to hold a copy.
    pub fn keep_admissions(&self) {
        let _admissions = lock(&self.admissions);
        self.keeps_admissions.store(true, Ordering::Release);
    }

    /// Admits a key: it is present from now on. Adds it to the live filter, keeps it
    /// until a build's source lists it (so the next swap cannot lose it), and moves its
    /// fence stripe. Returns false if no filter is loaded yet; the key is then added when
    /// the first one is. (A filter held in Redis alone has no filter of its own to wait
    /// for: true.) Callers drop the key's negative cache entries afterwards (the
    /// order the fence relies on: filter, stripe, cache).
    pub fn add_key(&self, key: &NormKey<'_>) -> bool {
        let mut bytes = KeyBytes::new();
        let bytes = bytes.of(key);
        let added = {
            let mut admissions = lock(&self.admissions);
            if self.keeps_admissions.load(Ordering::Acquire) {
                admissions.record(bytes);
                self.metrics.set_unconfirmed(admissions.len());
            }
            match self.live.load().as_deref() {
                Some(f) => {
                    f.insert(bytes);
                    true
                }
                None => false,
            }
        };
        self.stripe(bytes).fetch_add(1, Ordering::SeqCst);
        if let Some(held) = self.held.get() {
            held.admit(bytes);
        }
        if added {
            self.watch_capacity();
        }
        // Held in Redis alone: the key is in the copy that answers (or this instance
        // answers for it until it is), with no copy of its own to wait for.
        added || self.held.get().is_some_and(|h| !h.local_copy())
    }

    /// A fence for a negative entry of `key`: taken before the origin is asked, it tells
    /// afterwards whether the key was admitted in between (so a "not found" read just
    /// before the key's row was committed is not kept).
    pub fn fence(&self, key: &NormKey<'_>) -> Fence<'_> {
        let mut bytes = KeyBytes::new();
        let cell = self.stripe(bytes.of(key));
        Fence {
            cell,
            seen: cell.load(Ordering::SeqCst),
        }
    }

    /// Where `key`'s fence stripe stands now, kept by value: [`Filter::admitted_since`]
    /// tells later whether a key of that stripe was admitted in between.
    pub fn admission_mark(&self, key: &NormKey<'_>) -> AdmissionMark {
        let mut bytes = KeyBytes::new();
        let stripe = self.stripe_index(bytes.of(key));
        AdmissionMark {
            stripe,
            seen: self.stripes[stripe].load(Ordering::SeqCst),
        }
    }

    /// True if a key of `mark`'s stripe (taken on this filter) was admitted since.
    pub fn admitted_since(&self, mark: &AdmissionMark) -> bool {
        self.stripes
            .get(mark.stripe)
            .is_some_and(|c| c.load(Ordering::SeqCst) != mark.seen)
    }

    fn stripe(&self, bytes: &[u8]) -> &AtomicU64 {
        &self.stripes[self.stripe_index(bytes)]
    }

    fn stripe_index(&self, bytes: &[u8]) -> usize {
        self.stripe_hasher.hash_one(bytes) as usize & (FENCE_STRIPES - 1)
    }

    /// How many admitted keys no build has confirmed yet.
    pub fn unconfirmed_keys(&self) -> usize {
        lock(&self.admissions).len()
    }

    /// Logs once per crossing of the warning threshold, and asks for a larger rebuild
    /// when items exceed capacity (so the false-positive rate stays near its target).
    fn watch_capacity(&self) {
        let Some(stats) = self.stats() else { return };
        let ratio = stats.items as f64 / stats.capacity.max(1) as f64;
        if ratio >= self.config.borrow().capacity_warn_ratio {
            if !self.capacity_warned.swap(true, Ordering::Relaxed) {
                tracing::warn!(filter = %self.name, items = stats.items, capacity = stats.capacity,
                    ratio, "filter is filling up; it is rebuilt larger once items exceed capacity");
            }
        } else {
            self.capacity_warned.store(false, Ordering::Relaxed);
        }
        if stats.items > stats.capacity
            && !self.capacity_rebuild_pending.swap(true, Ordering::AcqRel)
        {
            let next = stats.capacity.saturating_mul(2);
            self.target_capacity.fetch_max(next, Ordering::AcqRel);
            tracing::warn!(filter = %self.name, items = stats.items, capacity = stats.capacity,
                new_capacity = next, "items exceed capacity; rebuilding at a larger capacity");
            self.metrics.capacity_rebuild();
            self.request_rebuild(RebuildReason::Capacity);
        }
    }

    /// Sets the hook that every full build awaits at each of its phases.
    pub fn set_build_hook(&self, hook: Option<BuildHook>) {
        *lock(&self.build_hook) = hook;
    }

    /// Asks the loader for a full rebuild; the current filter keeps serving meanwhile.
    pub fn request_rebuild(&self, reason: RebuildReason) {
        *lock(&self.rebuild_reason) = reason;
        self.rebuild.notify_one();
    }

    /// Statistics of the live filter.
    pub fn stats(&self) -> Option<FilterStats> {
        self.live.load().as_deref().map(Membership::stats)
    }

    /// The current sync watermark: the largest value sync or a build has reached.
    pub fn watermark(&self) -> Option<Watermark> {
        lock(&self.watermark).mark
    }

    /// Moves the sync watermark forward (never back).
    pub fn advance_watermark(&self, to: Watermark) {
        lock(&self.watermark).advance(to);
    }

    /// Where a poll computed from `mark` starts: for integer watermarks, the lowest open
    /// gap if that is lower (the query's `>=` reads it again).
    pub fn sync_poll_start(&self, mark: Watermark) -> Watermark {
        let p = lock(&self.watermark);
        match mark {
            Watermark::Int(id) => Watermark::Int(p.gaps.resume_from(id)),
            other => other,
        }
    }

    /// What a snapshot of a build that started at `mark` records: for integer
    /// watermarks, a mark below the `overlap_ids` window and below the lowest open gap,
    /// so a restart from it reads them again and finds the ids still missing.
    pub fn sync_restart_mark(&self, mark: Watermark) -> Watermark {
        let p = lock(&self.watermark);
        match mark {
            Watermark::Int(id) => Watermark::Int(p.gaps.snapshot_mark(id)),
            other => other,
        }
    }

    /// Records a successful sync poll whose query was sent at `started`, once its rows
    /// are admitted: what sync can see of rows committed before then is in the filter.
    pub fn record_sync_poll(&self, started: Instant) {
        let mut p = lock(&self.watermark);
        p.synced_from = p.synced_from.max(Some(started));
    }

    /// Whether a sync poll on this instance that started at or after `at` has succeeded.
    /// (The watermark cannot tell: it moves only when rows change.)
    pub fn synced_since(&self, at: Instant) -> bool {
        lock(&self.watermark).synced_from.is_some_and(|s| s >= at)
    }

    /// Open gap ranges, for `/admin/filters`; `None` unless sync uses integer watermarks.
    pub fn sync_open_gaps(&self) -> Option<usize> {
        let p = lock(&self.watermark);
        matches!(p.mark, Some(Watermark::Int(_))).then(|| p.gaps.len())
    }

    /// A full build read the source from `start`: moves the watermark there if that is
    /// ahead, and then (integer watermarks) opens the `overlap_ids` ids below it as gaps,
    /// for rows whose transactions were still open while the build scanned. When sync is
    /// already past `start`, nothing changes.
    pub fn start_sync_at(&self, start: Watermark) {
        let mut p = lock(&self.watermark);
        if p.advance(start) {
            if let Watermark::Int(id) = start {
                p.gaps.open_below(id, Instant::now());
            }
            self.metrics.set_sync_open_gaps(p.gaps.len());
        }
    }

    /// Applies the ids an integer-watermark poll read (any order; sorted here): closes
    /// the gaps they fill, opens gaps for the ids between `prev` (the watermark the poll
    /// was computed from) and the largest id read that it skipped, expires old gaps,
    /// and moves the watermark to the largest id. `started` is when its query was sent.
    pub fn record_poll_ids(&self, prev: i64, ids: &mut Vec<i64>, started: Instant) -> PollGaps {
        ids.sort_unstable();
        ids.dedup();
        let mut p = lock(&self.watermark);
        let report = p.gaps.record_poll(prev, ids, started, Instant::now());
        if let Some(&newest) = ids.last() {
            p.advance(Watermark::Int(newest));
        }
        self.metrics.set_sync_open_gaps(p.gaps.len());
        report
    }

    /// Refreshes the filter gauges (called at scrape time and after changes).
    pub fn publish_metrics(&self) {
        if let Some(s) = self.stats() {
            self.metrics.set_stats(&s);
        }
        self.metrics.set_ready(self.is_ready());
    }

    /// Metric handles of this filter.
    pub fn metrics(&self) -> &FilterMetrics {
        &self.metrics
    }

    /// A copy of the last load's status.
    pub fn load_status(&self) -> LoadStatus {
        lock(&self.status).clone()
    }

    fn update_status(&self, f: impl FnOnce(&mut LoadStatus)) {
        f(&mut lock(&self.status));
    }
}

/// The sync watermark and the gaps below it, behind one lock so that a poll's update and
/// a build's swap never interleave.
struct SyncPosition {
    /// The largest watermark applied; `None` before the first build or without sync.
    mark: Option<Watermark>,
    /// Ids below `mark` that no poll has read yet (integer watermarks only).
    gaps: Gaps,
    /// When the latest successful poll on this instance started.
    synced_from: Option<Instant>,
}

impl SyncPosition {
    fn new(config: &FilterConfig) -> SyncPosition {
        let gaps = match &config.sync {
            Some(s) => Gaps::new(s.gap_timeout, s.overlap_ids, MAX_OPEN_RANGES),
            None => Gaps::new(std::time::Duration::ZERO, 0, MAX_OPEN_RANGES),
        };
        SyncPosition {
            mark: None,
            gaps,
            synced_from: None,
        }
    }

    /// Moves the mark forward; true if it moved.
    fn advance(&mut self, to: Watermark) -> bool {
        let ahead = self.mark.is_none_or(|cur| to > cur);
        if ahead {
            self.mark = Some(to);
        }
        ahead
    }
}

/// What a reloaded configuration changes for a filter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reconfigure {
    /// Nothing.
    Unchanged,
    /// Settings that need no rebuild: sync, schedule, snapshot path, retries, warnings.
    Settings,
    /// `expected_items` or `false_positive_rate` (rebuilt at the new size), or sync
    /// switched on (a build records where sync starts): the current filter holds the
    /// same keys and serves until the swap.
    Rebuild,
    /// The source query, the key normalisation or the kind of sync watermark: the
    /// current filter's keys (or its sync position) may not be the new source's, so it
    /// cannot serve on.
    NewSource,
}

impl Reconfigure {
    /// Compares two configurations of a filter.
    pub fn classify(old: &FilterConfig, new: &FilterConfig) -> Reconfigure {
        let kind = |c: &FilterConfig| c.sync.as_ref().map(|s| s.watermark);
        let kinds_differ = matches!((kind(old), kind(new)), (Some(a), Some(b)) if a != b);
        if old.source_query != new.source_query || old.normalize != new.normalize || kinds_differ {
            return Reconfigure::NewSource;
        }
        if old.expected_items != new.expected_items
            || old.false_positive_rate.to_bits() != new.false_positive_rate.to_bits()
            || (old.sync.is_none() && new.sync.is_some())
        {
            return Reconfigure::Rebuild;
        }
        if serde_json::to_value(old).ok() == serde_json::to_value(new).ok() {
            Reconfigure::Unchanged
        } else {
            Reconfigure::Settings
        }
    }
}

/// Stripes of admission counters per gate (a power of two). Two keys share a stripe with
/// probability 1/1024, and then an admission of one only costs the other a negative
/// entry that is not kept.
const FENCE_STRIPES: usize = 1024;

/// Proof that no key of a stripe was admitted since it was taken; see [`Filter::fence`].
pub struct Fence<'g> {
    cell: &'g AtomicU64,
    seen: u64,
}

impl Fence<'_> {
    /// True while no key of this stripe has been admitted since the fence was taken.
    pub fn holds(&self) -> bool {
        self.cell.load(Ordering::SeqCst) == self.seen
    }
}

/// A key's fence stripe at one moment, by value; see [`Filter::admission_mark`].
#[derive(Debug, Clone, Copy)]
pub struct AdmissionMark {
    stripe: usize,
    seen: u64,
}

/// Locks a mutex whose data stays valid even if a holder panicked.
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

#[cfg(test)]
mod tests {
    use serde_json::{Value, json};

    use super::*;

    #[test]
    fn load_status_keeps_the_admin_api_strings() {
        let never = serde_json::to_value(LoadStatus::default()).expect("serialise");
        assert_eq!(never["result"], "never");
        assert_eq!(never["origin"], Value::Null);
        assert_eq!(never["reason"], Value::Null);

        let loaded = serde_json::to_value(LoadStatus {
            result: LoadResult::Ok,
            origin: Some(LoadOrigin::Snapshot),
            reason: Some(RebuildReason::Startup),
            ..LoadStatus::default()
        })
        .expect("serialise");
        assert_eq!(loaded["result"], "ok");
        assert_eq!(loaded["origin"], "snapshot");
        assert_eq!(loaded["reason"], "startup");
        assert_eq!(
            serde_json::to_value(LoadResult::Error).expect("serialise"),
            "error"
        );
        assert_eq!(
            serde_json::to_value(LoadOrigin::Source).expect("serialise"),
            "source"
        );
        for reason in [
            RebuildReason::Startup,
            RebuildReason::Requested,
            RebuildReason::Scheduled,
            RebuildReason::Capacity,
        ] {
            assert_eq!(
                serde_json::to_value(reason).expect("serialise"),
                json!(reason.as_str())
            );
        }
    }
}
