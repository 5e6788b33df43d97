//! One instance's side of a filter held in Redis (`backend = "redis"`): which generation
//! it trusts, the checks of keys its local copy refuses, the admissions it mirrors into
//! Redis, and (on the fleet's builder) the publication of a new generation.
//!
//! The local copy answers first. Redis is asked only about keys the local copy refuses
//! (or every key while no local copy is loaded), so an answer from Redis can only turn
//! a refusal into a "maybe": a Redis that lost admissions or went back to an older copy
//! cannot refuse a key this instance knows. A check that Redis does not answer within
//! `check_timeout`, or answers for a shard it no longer holds, leaves the local verdict.
//!
//! With `redis.local_copy = false` only the builder holds a local copy; every other
//! instance asks Redis about every key, and answers "maybe" itself for the keys it
//! admitted lately (see `Recent`), so its own admissions pass at once. Redis's
//! refusals are trusted only while its eviction policy is `noeviction`.
//!
//! While the builder writes a new generation, admissions are recorded; once the new
//! shards are written they are written into both generations, and the recorded ones
//! are replayed into the new one before it is made current, so no admission made during
//! the upload is missing from it.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use arc_swap::ArcSwapOption;
use bloomgate_core::redis_conn::RedisConn;

use super::redis_held::{self, HeldError, HeldKeys, Layout, Scripts, Upload};
use crate::gate::metrics::FilterMetrics;
use bloomgate_core::config::HeldConfig;
use bloomgate_core::filter::BloomFilter;
use bloomgate_core::report::Chain;

/// Admissions recorded during one upload before the recording gives up (and the
/// generation is written again): a bound on memory, not a limit anyone should reach.
const MAX_RECORDED: usize = 1_000_000;

/// How long an instance without a local copy keeps answering "maybe" itself for a key
/// it admitted, after writing it into the generation it checks. Far longer than the
/// change stream takes to bring the admission to the builder, whose next generation
/// then holds it.
const RECENT_KEEP: Duration = Duration::from_secs(60);

/// The steps of writing a Redis-held generation ([`HeldGate::publish`]), in order, as a
/// publish hook sees them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PublishPhase {
    /// Admissions are recorded from now on; the local bits are read and written next.
    Reading,
    /// The new generation's shards are written; the admissions recorded so far are
    /// replayed into it next, and admissions go to it as well from then on.
    Written,
    /// The recorded admissions are in it; it is made current next.
    Replayed,
    /// It is current in Redis; this instance checks it next.
    Flipped,
}

/// Called at each [`PublishPhase`] and awaited before the publication goes on: a way to
/// hold a publication at one step while an admission arrives.
pub type PublishHook = super::PhaseHook<PublishPhase>;

/// This instance's handle on a filter held in Redis.
pub struct HeldGate {
    name: Arc<str>,
    keys: HeldKeys,
    scripts: Scripts,
    conn: RedisConn,
    /// The generation checked and written; `None` while none is trusted.
    layout: ArcSwapOption<Layout>,
    /// The generation being published by this instance, written to as well.
    pending: ArcSwapOption<Layout>,
    /// Admissions since an upload began reading the local bits.
    recording: Mutex<Option<Vec<Box<[u8]>>>>,
    /// The highest generation adopted: one numbered lower is never trusted again.
    highest: AtomicU64,
    /// A write failed: the copy in Redis may lack an admission until a new generation.
    stale: AtomicBool,
    /// Whether the fleet's last check found Redis reachable: while it is not, no check
    /// waits for a timeout.
    up: AtomicBool,
    /// Whether Redis's eviction policy is `noeviction`, as last read: a Redis that may
    /// evict a shard or drop a write is not trusted to refuse.
    keeps_everything: AtomicBool,
    /// With no local copy: keys admitted here lately (see [`Recent`]).
    recent: Mutex<Recent>,
    config: HeldConfig,
    metrics: FilterMetrics,
    hook: Mutex<Option<PublishHook>>,
}

impl HeldGate {
    /// A handle with no trusted generation yet; `conn` is the fleet's connection.
    pub fn new(
        name: &str,
        namespace: &str,
        conn: RedisConn,
        config: HeldConfig,
        metrics: FilterMetrics,
    ) -> HeldGate {
        HeldGate {
            name: Arc::from(name),
            keys: HeldKeys::new(namespace, name),
            scripts: Scripts::new(),
            conn,
            layout: ArcSwapOption::empty(),
            pending: ArcSwapOption::empty(),
            recording: Mutex::new(None),
            highest: AtomicU64::new(0),
            stale: AtomicBool::new(false),
            up: AtomicBool::new(true),
            keeps_everything: AtomicBool::new(true),
            recent: Mutex::new(Recent::default()),
            config,
            metrics,
            hook: Mutex::new(None),
        }
    }

    /// Sets the hook every publication awaits at each of its phases.
    pub fn set_publish_hook(&self, hook: Option<PublishHook>) {
        *lock(&self.hook) = hook;
    }

    async fn phase(&self, phase: PublishPhase) {
        let hook = lock(&self.hook).clone();
        if let Some(hook) = hook {
            hook(phase).await;
        }
    }

    /// The generation checked now, if any.
    pub fn layout(&self) -> Option<Arc<Layout>> {
        self.layout.load_full()
    }

    /// Whether every instance holds a copy of its own (`redis.local_copy`).
    pub fn local_copy(&self) -> bool {
        self.config.local_copy
    }

    /// True once any generation was adopted, whatever happened to Redis since.
    pub fn adopted_any(&self) -> bool {
        self.highest.load(Ordering::Acquire) > 0
    }

    /// True while checks are sent: a generation is trusted, Redis is reachable and
    /// keeps everything it is given.
    pub fn answers(&self) -> bool {
        self.trusted().is_some()
    }

    fn trusted(&self) -> Option<Arc<Layout>> {
        if self.up.load(Ordering::Acquire) && self.keeps_everything.load(Ordering::Acquire) {
            self.layout.load_full()
        } else {
            None
        }
    }

    /// Redis's answer for a key: `Some(true)` maybe, `Some(false)` absent, `None` when
    /// there is no trusted generation, Redis fails or is slower than `check_timeout`.
    pub async fn check(&self, key: &[u8]) -> Option<bool> {
        let layout = self.trusted();
        let answer = match layout {
            None => None,
            Some(layout) => {
                let mut conn = self.conn.clone();
                let call = self.scripts.check(&mut conn, &self.keys, &layout, key);
                match tokio::time::timeout(self.config.check_timeout, call).await {
                    Ok(Ok(true)) => Some(true),
                    Ok(Ok(false)) => self.recent_answer(key),
                    Ok(Err(HeldError::Missing { generation, shard })) => {
                        self.distrust(generation, &format!("shard {shard} is missing"));
                        None
                    }
                    Ok(Err(e)) => {
                        tracing::debug!(filter = %self.name, error = %Chain(&e), "Redis-held check failed; the local copy answers");
                        None
                    }
                    Err(_) => None,
                }
            }
        };
        self.metrics.redis_check(answer);
        answer
    }

    /// Redis refused `key`: the answer, unless this instance admitted it lately (its
    /// write may not have landed yet, or the generation checked may predate it).
    fn recent_answer(&self, key: &[u8]) -> Option<bool> {
        if self.config.local_copy {
            return Some(false);
        }
        let recent = lock(&self.recent);
        if recent.keys.contains_key(key) {
            Some(true)
        } else if recent.overflow_until.is_some_and(|t| Instant::now() < t) {
            // Admissions were made here that it could not keep: any key may be one.
            None
        } else {
            Some(false)
        }
    }

    /// Records whether the fleet found Redis reachable.
    pub fn set_up(&self, up: bool) {
        self.up.store(up, Ordering::Release);
    }

    /// Records whether Redis keeps every key it is given (`maxmemory-policy noeviction`).
    /// While it may evict, its refusals are not trusted: a lost shard or bit would be a
    /// false negative.
    pub fn set_keeps_everything(&self, keeps: bool) {
        if self.keeps_everything.swap(keeps, Ordering::AcqRel) == keeps {
            return;
        }
        if keeps {
            tracing::info!(filter = %self.name, "Redis keeps every key again (noeviction); its copy is checked once a newer generation is written");
        } else {
            tracing::error!(filter = %self.name,
                "Redis may evict keys (maxmemory-policy is not noeviction): its copy of the filter is not asked until the policy is noeviction again");
            // What it held may lose a shard or a bit from now on: only a generation
            // written since is trusted again.
            self.reset();
        }
    }

    /// Redis lost its data or went back to an older copy: trust no generation read
    /// before, and (on the builder) write the next one.
    pub fn reset(&self) {
        self.layout.store(None);
        self.stale.store(true, Ordering::Release);
    }

    /// Stops trusting generation `generation` (if it is the one checked): checks go to
    /// the local copy until a newer generation is adopted.
    fn distrust(&self, generation: u64, why: &str) {
        let current = self.layout.load();
        if current.as_ref().is_some_and(|l| l.generation == generation) {
            self.layout.store(None);
            self.stale.store(true, Ordering::Release);
            tracing::warn!(filter = %self.name, generation, why,
                "no longer trusting the filter's Redis-held copy; the local copy answers alone until a newer generation");
        }
    }

    /// Mirrors an admission into Redis (the trusted generation and the one being
    /// published), in a task of its own; a failure marks the copy stale.
    pub fn admit(self: &Arc<Self>, key: &[u8]) {
        if !self.config.local_copy {
            lock(&self.recent).remember(key);
        }
        if let Some(recorded) = lock(&self.recording).as_mut() {
            if recorded.len() < MAX_RECORDED {
                recorded.push(key.into());
            } else {
                self.stale.store(true, Ordering::Release);
            }
        }
        let targets: Vec<Arc<Layout>> = [self.layout.load_full(), self.pending.load_full()]
            .into_iter()
            .flatten()
            .collect();
        if targets.is_empty() {
            return;
        }
        if !self.up.load(Ordering::Acquire) {
            // Redis is away: the write would fail. The builder writes a whole new
            // generation once it is back.
            self.stale.store(true, Ordering::Release);
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            self.stale.store(true, Ordering::Release);
            return;
        };
        let gate = Arc::clone(self);
        let key: Box<[u8]> = key.into();
        runtime.spawn(async move {
            let mut conn = gate.conn.clone();
            for layout in targets {
                let done = gate.scripts.add(&mut conn, &gate.keys, &layout, &key).await;
                gate.metrics.redis_write("admission", done.is_ok());
                if done.is_ok() && !gate.config.local_copy {
                    lock(&gate.recent).written(&key, layout.generation);
                }
                if let Err(e) = done {
                    tracing::warn!(filter = %gate.name, generation = layout.generation, error = %Chain(&e),
                        "an admission did not reach the filter's Redis-held copy; it is written again with the next generation");
                    gate.stale.store(true, Ordering::Release);
                    if matches!(e, HeldError::Missing { .. }) {
                        gate.distrust(layout.generation, "a shard is missing");
                    }
                }
            }
        });
    }

    /// Reads `current` and adopts it if it is newer than anything adopted before.
    pub async fn refresh(&self) -> Result<(), HeldError> {
        let mut conn = self.conn.clone();
        if let Some(layout) = redis_held::current(&mut conn, &self.keys).await? {
            self.adopt(layout);
        }
        Ok(())
    }

    /// With no local copy: writes the keys admitted here lately into the generation
    /// checked now, where they are not yet (admitted while Redis was away or before
    /// that generation was adopted), and forgets the ones written there long enough
    /// ago. Called on every fleet poll.
    pub async fn settle_recent(&self) {
        if self.config.local_copy {
            return;
        }
        let Some(layout) = self.trusted() else { return };
        let unwritten = lock(&self.recent).settle(layout.generation, Instant::now());
        let mut conn = self.conn.clone();
        for key in unwritten {
            let done = self.scripts.add(&mut conn, &self.keys, &layout, &key).await;
            self.metrics.redis_write("admission", done.is_ok());
            match done {
                Ok(_) => lock(&self.recent).written(&key, layout.generation),
                Err(e) => {
                    tracing::debug!(filter = %self.name, error = %Chain(&e), "an admission is written again on the next poll");
                    return;
                }
            }
        }
    }

    /// What `/admin/filters` shows of the copy in Redis.
    pub fn status_json(&self) -> serde_json::Value {
        let layout = self.layout.load_full();
        serde_json::json!({
            "generation": layout.as_ref().map(|l| l.generation),
            "items": layout.as_ref().map(|l| l.items),
            "shards": layout.as_ref().map(|l| l.shards()),
            "checked": self.answers(),
            "reachable": self.up.load(Ordering::Acquire),
            "noeviction": self.keeps_everything.load(Ordering::Acquire),
            "stale": self.is_stale(),
            "recent_admissions": self.recent_keys(),
        })
    }

    /// How many keys admitted lately this instance answers for itself.
    pub fn recent_keys(&self) -> usize {
        lock(&self.recent).keys.len()
    }

    fn adopt(&self, layout: Layout) {
        let seen = self.highest.fetch_max(layout.generation, Ordering::AcqRel);
        if layout.generation > seen {
            tracing::info!(filter = %self.name, generation = layout.generation, items = layout.items,
                "checking the filter's Redis-held generation");
            self.layout.store(Some(Arc::new(layout)));
        }
    }

    /// True when a write failed since the last publication (the builder publishes again).
    pub fn is_stale(&self) -> bool {
        self.stale.load(Ordering::Acquire)
    }

    /// Writes `filter` (this instance's live copy) as a new generation, replays the
    /// admissions made while it was read, and makes it current.
    ///
    /// # Errors
    ///
    /// Redis's, or a shard gone before the flip; the old generation stays current.
    pub async fn publish(
        &self,
        filter: &BloomFilter,
        grace: Duration,
    ) -> Result<Layout, HeldError> {
        self.stale.store(false, Ordering::Release);
        *lock(&self.recording) = Some(Vec::new());
        self.phase(PublishPhase::Reading).await;
        let result = self.publish_recorded(filter, grace).await;
        *lock(&self.recording) = None;
        // Adopted before the pending generation is let go: an admission always finds
        // the new generation in one of the two.
        match &result {
            Ok(layout) => {
                self.metrics.redis_write("generation", true);
                self.phase(PublishPhase::Flipped).await;
                self.adopt(layout.clone());
            }
            Err(_) => {
                self.metrics.redis_write("generation", false);
                self.stale.store(true, Ordering::Release);
            }
        }
        self.pending.store(None);
        result
    }

    async fn publish_recorded(
        &self,
        filter: &BloomFilter,
        grace: Duration,
    ) -> Result<Layout, HeldError> {
        let mut conn = self.conn.clone();
        let upload = Upload {
            shard_bytes: self.config.shard_bytes,
            upload_ttl: grace.max(Duration::from_secs(600)),
            grace,
        };
        let after = self.highest.load(Ordering::Acquire);
        let written = redis_held::write(&mut conn, &self.keys, filter, upload, after).await?;
        self.phase(PublishPhase::Written).await;
        // From here admissions go to the new generation too; the ones made while its
        // bits were read are replayed into it.
        self.pending.store(Some(Arc::new(written.clone())));
        let recorded = lock(&self.recording).take().unwrap_or_default();
        for key in &recorded {
            self.scripts
                .add(&mut conn, &self.keys, &written, key)
                .await?;
        }
        self.phase(PublishPhase::Replayed).await;
        redis_held::flip(&mut conn, &self.keys, &written, upload).await?;
        Ok(written)
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Keys admitted lately on an instance without a local copy. A key is kept until it has
/// been written into the generation checked and [`RECENT_KEEP`] has passed: until then
/// a refusal from Redis is overruled for it, so an admission is seen here at once, and
/// a generation adopted meanwhile (read before the builder had the key) gets it too.
#[derive(Default)]
struct Recent {
    /// When each key was admitted, and the generation it was last written into (0:
    /// none yet).
    keys: HashMap<Box<[u8]>, (Instant, u64)>,
    /// A key could not be kept (too many at once): until then, no refusal is trusted.
    overflow_until: Option<Instant>,
}

impl Recent {
    fn remember(&mut self, key: &[u8]) {
        let now = Instant::now();
        if let Some(entry) = self.keys.get_mut(key) {
            *entry = (now, 0);
        } else if self.keys.len() < MAX_RECORDED {
            self.keys.insert(key.into(), (now, 0));
        } else {
            self.overflow_until = Some(now + RECENT_KEEP);
        }
    }

    fn written(&mut self, key: &[u8], generation: u64) {
        if let Some(entry) = self.keys.get_mut(key) {
            entry.1 = generation;
        }
    }

    /// Forgets the keys written into `generation` more than [`RECENT_KEEP`] ago and
    /// returns the ones not written into it.
    fn settle(&mut self, generation: u64, now: Instant) -> Vec<Box<[u8]>> {
        self.keys.retain(|_, (at, written)| {
            *written != generation || now.duration_since(*at) < RECENT_KEEP
        });
        self.keys
            .iter()
            .filter(|(_, (_, written))| *written != generation)
            .map(|(k, _)| k.clone())
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_recent_admission_is_kept_until_written_into_the_generation_checked_and_old() {
        let mut recent = Recent::default();
        let t0 = Instant::now();
        recent.remember(b"a");
        recent.remember(b"b");
        // Nothing written yet: both are to be written, and kept however old.
        let mut unwritten = recent.settle(7, t0 + RECENT_KEEP * 2);
        unwritten.sort();
        assert_eq!(unwritten, [b"a".as_slice().into(), b"b".as_slice().into()]);
        recent.written(b"a", 7);
        recent.written(b"b", 6);
        // Written into 7, but young: kept (the builder may not have it yet).
        assert_eq!(recent.settle(7, t0), [b"b".as_slice().into()]);
        assert_eq!(recent.keys.len(), 2);
        // Old and in 7: forgotten. In an older generation only: written again.
        assert_eq!(
            recent.settle(7, t0 + RECENT_KEEP * 2),
            [b"b".as_slice().into()]
        );
        assert!(!recent.keys.contains_key(b"a".as_slice()));
        // A newer generation was adopted: a key written into 7 is to be written again.
        recent.remember(b"c");
        recent.written(b"c", 7);
        let mut unwritten = recent.settle(8, t0);
        unwritten.sort();
        assert_eq!(unwritten, [b"b".as_slice().into(), b"c".as_slice().into()]);
    }

    #[test]
    fn admitting_a_key_again_restarts_its_keep() {
        let mut recent = Recent::default();
        recent.remember(b"k");
        recent.written(b"k", 3);
        recent.remember(b"k");
        assert_eq!(recent.keys.get(b"k".as_slice()).map(|e| e.1), Some(0));
    }
}
