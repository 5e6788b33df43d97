//! The loops of fleet mode: the watcher (is Redis there, is it the Redis we knew, how
//! far behind is this instance), and per filter a supervisor that takes, renews or gives
//! up the builder lease, loads what the builder publishes, and falls back to standalone
//! work while Redis is away.
//!
//! This file starts them all and gives up the leases at shutdown. Each loop has its own
//! file beside it: `watcher`, `supervisor` (the role of one filter), `follower` (taking
//! the lease, or loading the current generation), `builder` (holding the lease: build,
//! sync, rebuild) and `publisher` (writing a generation, its Redis-held copy, trimming
//! the stream).

mod builder;
mod follower;
mod publisher;
mod supervisor;
mod watcher;

use std::sync::Arc;

use tokio::task::JoinSet;

use super::lease;
use super::stream;
use super::{Fleet, lock};
use bloomgate_core::report::Chain;

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
                tracing::error!(error = %Chain(&e), "a fleet task panicked");
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
                    Err(e) => tracing::warn!(filter = %m.name, error = %Chain(&e),
                        "could not release the builder lease; it expires on its own"),
                }
            }
        }
    }
}
