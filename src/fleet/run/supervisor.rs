//! The supervisor of one filter on this instance: decides its role (builder, follower,
//! or standalone while Redis is away), switches the work that role runs, and keeps the
//! Redis-held copy fresh. Going on alone is here; following and building are in
//! `follower` and `builder`.

use std::sync::Arc;

use tokio::task::JoinSet;

use crate::fleet::{Fleet, Member, Role, lock};

impl Fleet {
    /// The lifecycle of one filter on this instance.
    pub(super) async fn supervise(self: Arc<Self>, m: Arc<Member>) {
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
}
