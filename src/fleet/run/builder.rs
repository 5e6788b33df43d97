//! The builder of one filter, while it holds the lease: starts from the newest
//! generation (or the admissions the stream holds, for a filter held in Redis alone),
//! renews the lease, and builds, syncs and rebuilds, publishing each filter it builds.
//! Losing the lease ends the work (the supervisor aborts it).

use std::sync::Arc;

use tokio::task::JoinSet;

use crate::fleet::generation;
use crate::fleet::lease::{self, Lease};
use crate::fleet::stream::{self, StreamPos};
use crate::fleet::{Fleet, Member, Role, lock};
use crate::gate::RebuildReason;
use bloomgate_core::report::Chain;

impl Fleet {
    /// Holding lease `l`: catch up with what was published, then build and publish.
    pub(super) async fn start_building(
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
    pub(super) async fn keep_building(&self, m: &Arc<Member>, work: &mut JoinSet<()>) -> Role {
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
                        tracing::warn!(filter = %m.name, error = %Chain(&e), retry_in_ms = delay.as_millis() as u64,
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
                        Err(e) => tracing::error!(filter = %m.name, error = %Chain(&e),
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
}

/// Aborts a spawned task when dropped (with the builder's work).
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}
