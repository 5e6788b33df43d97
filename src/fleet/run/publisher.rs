//! What the builder publishes: the live filter as a new generation (tried again until
//! it is out or the lease is lost), the Redis-held copy of a filter held in Redis, and
//! the trim of the change stream below the oldest current generation's start.

use std::sync::Arc;

use crate::fleet::generation::{self, Current, GenerationError, Publication};
use crate::fleet::lease::Lease;
use crate::fleet::stream::StreamPos;
use crate::fleet::{Fleet, Member, Role, lock};
use crate::gate::redis_held;
use bloomgate_core::report::Chain;

impl Fleet {
    pub(super) async fn publish_live(&self, m: &Arc<Member>, l: &Lease) {
        let start = self.position();
        self.publish_at(m, l, start).await;
    }

    /// Publishes the live filter as a new generation whose build started at `start`,
    /// then trims the stream up to the oldest current generation's start.
    pub(super) async fn publish_at(&self, m: &Arc<Member>, l: &Lease, start: StreamPos) {
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
                    tracing::error!(filter = %m.name, error = %Chain(&e),
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
    pub(super) async fn refresh_held(&self, m: &Arc<Member>, role: Role) {
        let Some(held) = m.filter.held() else { return };
        if role == Role::Builder && held.is_stale() {
            self.publish_held(m).await;
        }
        if let Err(e) = held.refresh().await {
            tracing::debug!(filter = %m.name, error = %Chain(&e), "could not read the Redis-held generation");
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
                tracing::warn!(filter = %m.name, error = %Chain(&e),
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
                Err(e) => tracing::warn!(error = %Chain(&e), "change stream trim failed"),
            }
        }
    }
}
