//! A follower of one filter: tries to take the builder lease (or takes back the one it
//! held through a Redis outage), and otherwise loads the generation the builder
//! published when it is newer than the one served, checked and with the change stream
//! replayed on top. A generation that fails its checks is refused and the filter served
//! stays.

use std::sync::Arc;

use tokio::task::JoinSet;

use crate::fleet::generation::{self, Current, GenerationError};
use crate::fleet::lease::{self, Attempt};
use crate::fleet::stream;
use crate::fleet::{Fleet, Member, Role, lock};
use crate::gate::RebuildReason;
use bloomgate_core::report::Chain;

impl Fleet {
    /// As a follower: take the lease if it is free, else load a newer generation.
    pub(super) async fn follow(self: &Arc<Self>, m: &Arc<Member>, work: &mut JoinSet<()>) -> Role {
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

    /// Loads the current generation if it is newer than the one served (or a reload is
    /// forced), checks it, replays the stream since its start on top, and swaps it in.
    /// With `install` false it only records which generation is current.
    pub(super) async fn load_current(&self, m: &Arc<Member>, install: bool) {
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
        tracing::error!(filter = %m.name, generation = current.map(|c| c.generation), error = %Chain(e),
            "refused the fleet's current generation; keeping the filter this instance serves");
        self.metrics.generation(&m.name, "refused");
        lock(&m.status).refused = Some(Chain(e).to_string());
    }
}
