//! The watcher: checks Redis every `retry_interval` (and at once after a failed call):
//! is it reachable, is it the Redis this instance knew (the epoch token, the lease
//! epochs), how far behind the change stream this instance reads, and whether entries
//! it had not read were trimmed. It takes no lease and loads nothing itself: it tells
//! the supervisors.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use crate::fleet::generation;
use crate::fleet::stream::{self, StreamPos};
use crate::fleet::{Fleet, lock};

impl Fleet {
    /// Checks Redis every `retry_interval`, and at once when a call failed: reachable, same data as before (the epoch
    /// token), stream lag, and entries trimmed past this instance's position.
    pub(super) async fn watch(self: Arc<Self>) {
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
}
