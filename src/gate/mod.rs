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
//!
//! This file holds the `Filter` itself: its construction, configuration, verdict and
//! capacity tracking. Beside it: `status` (the last load's status and readiness, as the
//! admin API and the metrics read them), `fence` (a key admitted into the filter, and
//! the fences of the origin lookups) and `position` (where sync stands: watermark, gaps,
//! last poll).

mod admissions;
pub mod admit;
mod build;
mod deletes;
mod fence;
pub mod held;
pub mod membership;
pub mod metrics;
mod position;
pub mod redis_held;
mod status;
pub mod sync;
mod verdict;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use arc_swap::ArcSwapOption;
use tokio::sync::{Notify, watch};

pub use build::{Filled, LoadError, Mismatch, fill, fits_config, secret_seed, start_watermark};
pub use fence::{AdmissionMark, Fence};
pub use status::{LoadOrigin, LoadResult, LoadStatus, RebuildReason};

use crate::gate::metrics::FilterMetrics;
use admissions::Admissions;
use bloomgate_core::config::{BinlogSource, FilterConfig, Normalize};
use fence::FENCE_STRIPES;
use membership::{Membership, Probe};
use position::SyncPosition;

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
    /// Binlog mode: the table and key column the source query scans and the replication
    /// URL (as compiled); its changes are read from the binary log.
    binlog_source: Option<BinlogSource>,
    /// Binlog mode: a rebuild for deleted keys has been asked for and not started yet.
    deletes_rebuild_pending: AtomicBool,
}

impl Filter {
    /// A gate with no filter loaded (it fails open until its loader succeeds).
    /// `binlog_source` is what the source query scans, in binlog mode.
    pub fn new(
        name: &str,
        config: FilterConfig,
        binlog_source: Option<BinlogSource>,
        metrics: FilterMetrics,
    ) -> Filter {
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
            binlog_source,
            deletes_rebuild_pending: AtomicBool::new(false),
        }
    }

    /// Binlog mode: the table and key column the source query scans, and the
    /// replication URL.
    pub fn binlog_source(&self) -> Option<&BinlogSource> {
        self.binlog_source.as_ref()
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

    /// False for a filter held in Redis with `redis.local_copy = false`: only the
    /// instance that builds it holds a copy.
    pub fn wants_local_copy(&self) -> bool {
        let config = self.config.borrow();
        config.backend == bloomgate_core::config::Backend::Local || config.redis.local_copy
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

/// Locks a mutex whose data stays valid even if a holder panicked.
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}
