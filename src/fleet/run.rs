//! The loops of fleet mode: the watcher (is Redis there, is it the Redis we knew, how
//! far behind is this instance), and per filter a supervisor that takes, renews or gives
//! up the builder lease, loads what the builder publishes, and falls back to standalone
//! work while Redis is away.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use tokio::task::JoinSet;

use super::generation::{self, Current, GenerationError, Publication};
use super::lease::{self, Attempt, Lease};
use super::stream::{self, StreamPos};
use super::{Fleet, Member, Role, lock};
use crate::gate::RebuildReason;
use crate::gate::redis_held;

impl Fleet {
    /// Runs every fleet loop until aborted (its tasks are aborted with it).
    pub async fn run(self: Arc<Self>) {
        let mut tasks = JoinSet::new();
        tasks.spawn(Arc::clone(&self).watch());
        tasks.spawn(stream::read_loop(Arc::clone(&self), self.reader.clone()));
        if let Some(outbox) = lock(&self.outbox).take() {
            tasks.spawn(stream::append_loop(Arc::clone(&self), outbox));
        }
        for member in self.members.values() {
            tasks.spawn(Arc::clone(&self).supervise(Arc::clone(member)));
        }
        while let Some(done) = tasks.join_next().await {
            if let Err(e) = done
                && e.is_panic()
            {
                tracing::error!(error = %e, "a fleet task panicked");
            }
        }
    }

    /// Gives up every lease this instance holds, so another instance takes over at once
    /// rather than after the lease expires.
    pub async fn release_leases(&self) {
        let mut conn = self.conn.clone();
        for m in self.members.values() {
            let held = {
                let mut s = lock(&m.status);
                s.lease.take().or(s.lapsed.take())
            };
            if let Some(l) = held {
                match lease::release(&mut conn, &self.keys.lease(&m.name), &l).await {
                    Ok(true) => {
                        self.metrics.lease_change(&m.name, "released");
                        tracing::info!(filter = %m.name, "builder lease released");
                    }
                    Ok(false) => {}
                    Err(e) => tracing::warn!(filter = %m.name, error = %e,
                        "could not release the builder lease; it expires on its own"),
                }
            }
        }
    }

    /// Checks Redis every `retry_interval`, and at once when a call failed: reachable, same data as before (the epoch
    /// token), stream lag, and entries trimmed past this instance's position.
    async fn watch(self: Arc<Self>) {
        loop {
            match self.check_epoch().await {
                Ok(reset) => {
                    if !self.redis_up.swap(true, Ordering::AcqRel) {
                        self.set_held_up(true);
                        tracing::info!(instance = %self.instance, "fleet Redis reachable");
                        self.metrics.set_redis_up(true);
                        self.changed.notify_waiters();
                    }
                    if reset {
                        self.on_reset();
                    }
                    self.check_eviction_policy().await;
                    if let Err(e) = self.measure_lag().await {
                        self.redis_failed("lag check", &e);
                    }
                }
                Err(e) => self.redis_down(&e),
            }
            self.checked.send_replace(true);
            tokio::select! {
                _ = tokio::time::sleep(self.config.retry_interval) => {}
                _ = self.recheck.notified() => {}
            }
        }
    }

    /// Reads the epoch token, setting it when absent. True when it is not the one seen
    /// before (Redis lost its data), or a lease epoch went backwards (Redis went back to
    /// an older copy).
    async fn check_epoch(&self) -> redis::RedisResult<bool> {
        let mut conn = self.conn.clone();
        let key = self.keys.epoch();
        let fresh = format!(
            "{:016x}{:016x}",
            rand::random::<u64>(),
            rand::random::<u64>()
        );
        let _: Option<String> = redis::cmd("SET")
            .arg(&key)
            .arg(&fresh)
            .arg("NX")
            .query_async(&mut conn)
            .await?;
        let token: Option<String> = redis::cmd("GET").arg(&key).query_async(&mut conn).await?;
        let reset = {
            let mut known = lock(&self.token);
            let reset = matches!((&*known, &token), (Some(k), Some(t)) if k != t);
            *known = token;
            reset
        };
        let mut older = false;
        for m in self.members.values() {
            let held = lock(&m.status).lease.as_ref().map(|l| l.epoch);
            if let Some(epoch) = held {
                let fence: Option<u64> = redis::cmd("GET")
                    .arg(self.keys.fence(&m.name))
                    .query_async(&mut conn)
                    .await?;
                older |= fence.unwrap_or(0) < epoch;
            }
        }
        Ok(reset || older)
    }

    /// Redis came back without the data this instance saw: nothing it held can be
    /// trusted. Read the new stream from its start and load the next generation.
    fn on_reset(&self) {
        self.resets.fetch_add(1, Ordering::Relaxed);
        self.metrics.reset();
        tracing::warn!(instance = %self.instance,
            "fleet Redis lost its data (restarted empty or restored from an older copy); rejoining from the next generation");
        *lock(&self.position) = StreamPos::default();
        for m in self.members.values() {
            if let Some(held) = m.filter.held() {
                held.reset();
            }
            m.status.lock().map(|mut s| s.force_reload = true).ok();
        }
        self.changed.notify_waiters();
    }

    async fn measure_lag(&self) -> redis::RedisResult<()> {
        let mut conn = self.conn.clone();
        let key = self.keys.stream();
        let at = self.position();
        let (entries, first) = stream::behind(&mut conn, &key, at, 1000).await?;
        let seconds = first.map_or(0.0, |f| {
            (generation::unix_ms().saturating_sub(f.ms)) as f64 / 1000.0
        });
        self.metrics.set_lag(entries as u64, seconds);
        if let Some(deleted) = stream::max_deleted(&mut conn, &key).await?
            && deleted > at
            && at != StreamPos::default()
        {
            tracing::warn!(position = %at, trimmed_to = %deleted,
                "change stream entries this instance had not read were trimmed; reloading the current generations");
            for m in self.members.values() {
                lock(&m.status).force_reload = true;
                m.announced.notify_one();
            }
        }
        Ok(())
    }

    /// The lifecycle of one filter on this instance.
    async fn supervise(self: Arc<Self>, m: Arc<Member>) {
        // Whether Redis answers is known only after the first check: deciding before it
        // would send every instance off on its own build at start.
        let mut checked = self.checked.subscribe();
        if checked.wait_for(|done| *done).await.is_err() {
            return;
        }
        let mut work: JoinSet<()> = JoinSet::new();
        let mut role = Role::Follower;
        loop {
            let next = if !self.redis_up() {
                if role != Role::Standalone {
                    work.abort_all();
                    self.standalone(&m, &mut work);
                }
                Role::Standalone
            } else {
                match role {
                    Role::Standalone => {
                        work.abort_all();
                        tracing::info!(filter = %m.name, "Redis is back; rejoining the fleet");
                        self.follow(&m, &mut work).await
                    }
                    Role::Follower => self.follow(&m, &mut work).await,
                    Role::Builder => self.keep_building(&m, &mut work).await,
                }
            };
            if next == Role::Follower && !m.filter.wants_local_copy() {
                // Only the builder of a filter held in Redis alone keeps a copy.
                m.filter.release_copy();
            }
            if next != Role::Standalone {
                self.refresh_held(&m, next).await;
            }
            if next != role {
                tracing::info!(filter = %m.name, from = role.as_str(), to = next.as_str(), "fleet role changed");
                self.metrics.set_role(&m.name, next.as_str());
                lock(&m.status).role = next;
                role = next;
            }
            let wait = match role {
                Role::Builder => self.config.lease_renew,
                _ => self.config.retry_interval,
            };
            tokio::select! {
                _ = tokio::time::sleep(wait) => {}
                _ = m.announced.notified() => {}
                _ = self.changed.notified() => {}
            }
        }
    }

    /// Redis is away: go on alone. Sync keeps admitting new keys; a filter that has
    /// nothing loaded builds its own.
    fn standalone(&self, m: &Arc<Member>, work: &mut JoinSet<()>) {
        self.metrics.fallback();
        {
            let mut s = lock(&m.status);
            if let Some(l) = s.lease.take() {
                s.lapsed = Some(l);
            }
            s.holder = None;
        }
        let local = m.filter.has_local_copy();
        if !local && !m.filter.wants_local_copy() {
            // Held in Redis alone: this instance has no copy to keep up and builds none
            // (the filter may not fit in its memory). It fails open until Redis is back.
            tracing::warn!(filter = %m.name,
                "Redis unreachable: the filter is held there alone, so its requests fail open until it is back");
            return;
        }
        tracing::warn!(filter = %m.name, ready = local,
            "Redis unreachable: syncing on this instance alone until it is back");
        // Alone, it runs its own builds: the first if it has no filter, then every
        // scheduled, capacity or requested rebuild.
        if local {
            work.spawn(Arc::clone(&m.filter).rebuild_loop(self.db.clone()));
        } else {
            work.spawn(Arc::clone(&m.filter).run_loader(self.db.clone()));
        }
        work.spawn(crate::gate::sync::run(
            Arc::clone(&m.filter),
            Arc::clone(&self.admit),
            self.db.clone(),
        ));
    }

    /// As a follower: take the lease if it is free, else load a newer generation.
    async fn follow(self: &Arc<Self>, m: &Arc<Member>, work: &mut JoinSet<()>) -> Role {
        let mut conn = self.conn.clone();
        let ttl = self.config.lease_ttl.as_millis() as u64;
        match lease::acquire(
            &mut conn,
            &self.keys.lease(&m.name),
            &self.keys.fence(&m.name),
            &self.instance,
            ttl,
        )
        .await
        {
            Ok(Attempt::Taken(l)) => {
                tracing::info!(filter = %m.name, epoch = l.epoch, "took the builder lease");
                self.metrics.lease_change(&m.name, "acquired");
                self.start_building(m, l, work).await
            }
            Ok(Attempt::Held(holder)) => {
                let lapsed = lock(&m.status).lapsed.take();
                if let Some(l) = lapsed.filter(|l| l.value == holder) {
                    // Nobody took it while Redis was away: the fencing epoch is still
                    // this instance's, so renewing it (compare-and-set) is safe.
                    match lease::renew(&mut conn, &self.keys.lease(&m.name), &l, ttl).await {
                        Ok(true) => {
                            tracing::info!(filter = %m.name, epoch = l.epoch,
                                "kept the builder lease through the Redis outage");
                            return self.start_building(m, l, work).await;
                        }
                        Ok(false) => {}
                        Err(e) => {
                            self.redis_failed("lease", &e);
                            lock(&m.status).lapsed = Some(l);
                            return Role::Follower;
                        }
                    }
                }
                lock(&m.status).holder = Some(holder);
                // Without a copy of its own, a follower only notes the generation.
                let install = m.filter.wants_local_copy();
                self.load_current(m, install).await;
                Role::Follower
            }
            Err(e) => {
                self.redis_failed("lease", &e);
                Role::Follower
            }
        }
    }

    /// Holding lease `l`: catch up with what was published, then build and publish.
    async fn start_building(
        self: &Arc<Self>,
        m: &Arc<Member>,
        l: Lease,
        work: &mut JoinSet<()>,
    ) -> Role {
        {
            let mut s = lock(&m.status);
            s.lease = Some(l.clone());
            s.lapsed = None;
            s.holder = Some(l.value.clone());
        }
        if !m.filter.wants_local_copy() {
            self.prepare_copy(m).await;
        }
        // A newer generation than this instance serves is the better start.
        self.load_current(m, true).await;
        work.spawn(Arc::clone(self).build(Arc::clone(m), l));
        Role::Builder
    }

    /// As the builder: renew the lease; on losing it, stop building.
    async fn keep_building(&self, m: &Arc<Member>, work: &mut JoinSet<()>) -> Role {
        let Some(l) = lock(&m.status).lease.clone() else {
            work.abort_all();
            return Role::Follower;
        };
        let mut conn = self.conn.clone();
        let ttl = self.config.lease_ttl.as_millis() as u64;
        match lease::renew(&mut conn, &self.keys.lease(&m.name), &l, ttl).await {
            Ok(true) => {
                if let Ok(Some(c)) = generation::current(&mut conn, &self.keys, &m.name).await {
                    self.metrics.set_current(&m.name, c.generation, true);
                    lock(&m.status).current = Some(c);
                }
                Role::Builder
            }
            Ok(false) => {
                tracing::warn!(filter = %m.name, epoch = l.epoch, "lost the builder lease; following");
                self.metrics.lease_change(&m.name, "lost");
                work.abort_all();
                lock(&m.status).lease = None;
                Role::Follower
            }
            Err(e) => {
                // Unknown whether it was renewed: keep building until Redis is
                // declared down (then standalone) or the lease is seen lost.
                self.redis_failed("lease renewal", &e);
                Role::Builder
            }
        }
    }

    /// About to build a filter held in Redis alone, with no copy here yet: keep the
    /// admissions from now on for the build or load to replay, and the ones the stream
    /// holds since the current generation's build started (all of them when there is
    /// none: the stream is not trimmed then). Loading that generation replays them too;
    /// if there is none, or it is refused, the build starts from a scan, which does not
    /// list a key admitted that the source lacks.
    async fn prepare_copy(&self, m: &Arc<Member>) {
        m.filter.keep_admissions();
        let mut conn = self.conn.clone();
        let from = match generation::current(&mut conn, &self.keys, &m.name).await {
            Ok(current) => current.map_or(StreamPos::default(), |c| c.start),
            Err(_) => return,
        };
        match stream::admitted_since(self, &mut conn, &m.name, from).await {
            Ok(admitted) => {
                for (_, key) in &admitted {
                    m.filter.add_key(&key.as_norm());
                }
            }
            Err(e) => self.redis_failed("stream replay", &e),
        }
    }

    /// Loads the current generation if it is newer than the one served (or a reload is
    /// forced), checks it, replays the stream since its start on top, and swaps it in.
    /// With `install` false it only records which generation is current.
    async fn load_current(&self, m: &Arc<Member>, install: bool) {
        let mut conn = self.conn.clone();
        let current = match generation::current(&mut conn, &self.keys, &m.name).await {
            Ok(c) => c,
            Err(GenerationError::Redis(e)) => {
                self.redis_failed("generation read", &e);
                return;
            }
            Err(e) => {
                self.refuse(m, None, &e);
                return;
            }
        };
        let holder = lock(&m.status).holder.is_some();
        self.metrics.set_current(
            &m.name,
            current.as_ref().map_or(0, |c| c.generation),
            holder,
        );
        let Some(current) = current else {
            lock(&m.status).current = None;
            return;
        };
        let (serving, forced) = {
            let mut s = lock(&m.status);
            s.current = Some(current.clone());
            if !install {
                s.serving = None;
                return;
            }
            (s.serving.clone(), std::mem::take(&mut s.force_reload))
        };
        let newer = serving
            .as_ref()
            .is_none_or(|s| current.at_ms > s.at_ms || (forced && *s != current));
        if !newer {
            return;
        }
        let snap = match generation::fetch(&mut conn, &self.keys, &m.name, &current).await {
            Ok(s) => s,
            Err(GenerationError::Redis(e)) => {
                self.redis_failed("generation fetch", &e);
                return;
            }
            Err(e) => {
                self.refuse(m, Some(&current), &e);
                return;
            }
        };
        let recent: Vec<_> = lock(&m.recent).iter().cloned().collect();
        let live_items = m.filter.stats().map(|s| s.items);
        if let Err(e) = generation::judge(&snap, &current, &m.filter.config(), live_items, &recent)
        {
            self.refuse(m, Some(&current), &e);
            return;
        }
        let replay = match stream::admitted_since(self, &mut conn, &m.name, current.start).await {
            Ok(r) => r,
            Err(e) => {
                self.redis_failed("stream replay", &e);
                return;
            }
        };
        let keys: Vec<_> = replay.into_iter().map(|(_, k)| k).collect();
        let items = snap.filter.items();
        m.filter
            .install(snap.filter, snap.watermark, &keys, RebuildReason::Published);
        tracing::info!(filter = %m.name, generation = current.generation, items, replayed = keys.len(),
            published_by = %current.by, "loaded the fleet's current generation");
        self.metrics.generation(&m.name, "loaded");
        self.metrics.set_generation(&m.name, current.generation);
        let mut s = lock(&m.status);
        s.serving = Some(current);
        s.refused = None;
    }

    fn refuse(&self, m: &Member, current: Option<&Current>, e: &GenerationError) {
        tracing::error!(filter = %m.name, generation = current.map(|c| c.generation), error = %e,
            "refused the fleet's current generation; keeping the filter this instance serves");
        self.metrics.generation(&m.name, "refused");
        lock(&m.status).refused = Some(e.to_string());
    }

    /// The builder's work, until its lease is lost (then the supervisor aborts it):
    /// publish what it serves or build it, sync, and rebuild and publish when asked, on
    /// schedule, or when the stream grew long.
    async fn build(self: Arc<Self>, m: Arc<Member>, l: Lease) {
        let sync = tokio::spawn(crate::gate::sync::run(
            Arc::clone(&m.filter),
            Arc::clone(&self.admit),
            self.db.clone(),
        ));
        let _sync = AbortOnDrop(sync);
        if m.filter.has_local_copy() {
            // A filter is served already (loaded from the last generation and kept up
            // by the stream): publish it as the next generation, no scan needed.
            self.publish_live(&m, &l).await;
        } else {
            let mut delay = m.filter.config().load_retry_initial;
            loop {
                let start = self.position();
                match m.filter.build_once(&self.db, RebuildReason::Startup).await {
                    Ok(_) => {
                        self.publish_at(&m, &l, start).await;
                        break;
                    }
                    Err(e) => {
                        tracing::warn!(filter = %m.name, error = %e, retry_in_ms = delay.as_millis() as u64,
                            "filter build failed; requests fail open until it succeeds");
                        tokio::time::sleep(delay).await;
                        delay = (delay * 2).min(m.filter.config().load_retry_max);
                    }
                }
            }
        }
        let mut length_check = tokio::time::interval(self.config.retry_interval * 5);
        loop {
            tokio::select! {
                reason = m.filter.next_rebuild() => {
                    tracing::info!(filter = %m.name, reason = reason.as_str(), "rebuilding; the current filter keeps serving");
                    let start = self.position();
                    match m.filter.build_once(&self.db, reason).await {
                        Ok(_) => self.publish_at(&m, &l, start).await,
                        Err(e) => tracing::error!(filter = %m.name, error = %e,
                            "rebuild failed; the previous filter keeps serving"),
                    }
                }
                _ = length_check.tick() => {
                    let mut conn = self.conn.clone();
                    let len: redis::RedisResult<u64> =
                        redis::cmd("XLEN").arg(self.keys.stream()).query_async(&mut conn).await;
                    if let Ok(len) = len && len > self.config.stream_max_entries {
                        tracing::info!(filter = %m.name, entries = len,
                            "change stream is long; publishing a fresh generation so older entries can be trimmed");
                        self.publish_live(&m, &l).await;
                    }
                }
            }
        }
    }

    async fn publish_live(&self, m: &Arc<Member>, l: &Lease) {
        let start = self.position();
        self.publish_at(m, l, start).await;
    }

    /// Publishes the live filter as a new generation whose build started at `start`,
    /// then trims the stream up to the oldest current generation's start.
    async fn publish_at(&self, m: &Arc<Member>, l: &Lease, start: StreamPos) {
        let filter = Arc::clone(&m.filter);
        let encoded = tokio::task::spawn_blocking(move || filter.encode_live()).await;
        let Ok(Some((bytes, _mark, items))) = encoded else {
            return;
        };
        let after = {
            let s = lock(&m.status);
            let number = |c: &Option<Current>| c.as_ref().map_or(0, |c| c.generation);
            number(&s.serving).max(number(&s.current))
        };
        let mut conn = self.conn.clone();
        // A failed upload or flip (a Redis error, a chunk gone before the flip) is tried
        // again while this instance builds: until a generation is out, followers that
        // start have nothing to load. A lost lease ends it, as does the role ending
        // (this task is aborted then).
        loop {
            let published = generation::publish(
                &mut conn,
                &self.keys,
                Publication {
                    filter: &m.name,
                    lease: l,
                    bytes: &bytes,
                    items,
                    start,
                    instance: &self.instance,
                    after,
                    chunk_bytes: self.config.chunk_bytes,
                    grace_ms: self.config.generation_grace.as_millis() as u64,
                    upload_ttl_ms: (self.config.generation_grace.as_millis() as u64).max(600_000),
                },
            )
            .await;
            match published {
                Ok(c) => {
                    tracing::info!(filter = %m.name, generation = c.generation, items, bytes = bytes.len(),
                        start = %start, "published a generation");
                    self.metrics.generation(&m.name, "published");
                    self.metrics.set_generation(&m.name, c.generation);
                    self.metrics.set_current(&m.name, c.generation, true);
                    {
                        let mut s = lock(&m.status);
                        s.serving = Some(c.clone());
                        s.current = Some(c);
                    }
                    self.trim().await;
                    self.publish_held(m).await;
                    return;
                }
                Err(GenerationError::Fenced) => {
                    tracing::warn!(filter = %m.name, "not published: the builder lease was lost");
                    return;
                }
                Err(e) => {
                    tracing::error!(filter = %m.name, error = %e,
                        retry_in_ms = self.config.retry_interval.as_millis() as u64,
                        "publishing a generation failed");
                    if let GenerationError::Redis(e) = &e {
                        self.redis_failed("publish", e);
                    }
                    tokio::time::sleep(self.config.retry_interval).await;
                }
            }
        }
    }

    /// For a filter held in Redis: adopts a newer generation of the Redis-held copy, and
    /// as the builder writes one again when a write to it failed (an admission that did
    /// not reach it, a lost shard).
    async fn refresh_held(&self, m: &Arc<Member>, role: Role) {
        let Some(held) = m.filter.held() else { return };
        if role == Role::Builder && held.is_stale() {
            self.publish_held(m).await;
        }
        if let Err(e) = held.refresh().await {
            tracing::debug!(filter = %m.name, error = %e, "could not read the Redis-held generation");
        }
        held.settle_recent().await;
    }

    /// Writes the live filter as a new generation of its Redis-held copy (builder only).
    async fn publish_held(&self, m: &Arc<Member>) {
        let Some(held) = m.filter.held() else { return };
        let Some(live) = m.filter.live_membership() else {
            return;
        };
        let Some(bloom) = live.local() else { return };
        match held.publish(bloom, self.config.generation_grace).await {
            Ok(layout) => tracing::info!(filter = %m.name, generation = layout.generation,
                shards = layout.shards(), items = layout.items, "published the Redis-held copy"),
            Err(e) => {
                tracing::warn!(filter = %m.name, error = %e,
                    "publishing the Redis-held copy failed; the local copies answer alone, and it is tried again");
                if let redis_held::HeldError::Redis(e) = &e {
                    self.redis_failed("Redis-held publish", e);
                }
            }
        }
    }

    /// Trims the stream below the oldest start among the filters' current generations:
    /// no follower loading one of them can need an older entry.
    async fn trim(&self) {
        let mut conn = self.conn.clone();
        let mut oldest: Option<StreamPos> = None;
        for name in self.members.keys() {
            match generation::current(&mut conn, &self.keys, name).await {
                Ok(Some(c)) => oldest = Some(oldest.map_or(c.start, |o| o.min(c.start))),
                // A filter with no generation yet needs the whole stream.
                _ => return,
            }
        }
        if let Some(min) = oldest
            && min != StreamPos::default()
        {
            let trimmed: redis::RedisResult<u64> = redis::cmd("XTRIM")
                .arg(self.keys.stream())
                .arg("MINID")
                .arg(min.to_string())
                .query_async(&mut conn)
                .await;
            match trimmed {
                Ok(n) if n > 0 => {
                    tracing::debug!(entries = n, below = %min, "change stream trimmed")
                }
                Ok(_) => {}
                Err(e) => tracing::warn!(error = %e, "change stream trim failed"),
            }
        }
    }
}

/// Aborts a spawned task when dropped (with the builder's work).
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}
