//! Redis's eviction policy, read on every check of Redis: a filter held in Redis is
//! asked there only while the policy is `noeviction` (an evicted shard or a dropped bit
//! would refuse a present key), and any other policy is logged when it appears.

use super::{Fleet, lock};

impl Fleet {
    /// Reads Redis's `maxmemory-policy` (CONFIG GET, else INFO memory) on every check:
    /// it can be changed at run time. Anything but `noeviction`, or a policy that cannot
    /// be read, is logged when it changes, and a filter held in Redis stops trusting
    /// Redis's refusals until it is `noeviction` again.
    pub(super) async fn check_eviction_policy(&self) {
        let Some(policy) = self.eviction_policy().await else {
            // Redis did not answer: the next check reads it again.
            return;
        };
        let keeps = policy.as_deref() == Some("noeviction");
        let changed = {
            let mut known = lock(&self.policy);
            let changed = known.as_ref() != Some(&policy);
            *known = Some(policy.clone());
            changed
        };
        if changed && !keeps {
            match &policy {
                Some(p) => tracing::warn!(policy = %p,
                    "Redis's maxmemory-policy is not noeviction: an evicted chunk, stream entry or shard loses fleet state (set maxmemory-policy noeviction)"),
                None => tracing::warn!(
                    "cannot read Redis's maxmemory-policy (CONFIG GET and INFO are both refused); a filter held in Redis is not checked there until it can be read as noeviction"
                ),
            }
        }
        for m in self.members.values() {
            if let Some(held) = m.filter.held() {
                held.set_keeps_everything(keeps);
            }
        }
    }

    /// The policy; `Some(None)` when Redis refuses both ways of reading it, `None` when
    /// it did not answer.
    async fn eviction_policy(&self) -> Option<Option<String>> {
        let unanswered = |e: &redis::RedisError| {
            e.is_io_error()
                || e.is_timeout()
                || e.is_connection_dropped()
                || e.is_connection_refusal()
        };
        let mut conn = self.conn.clone();
        let config: redis::RedisResult<Vec<String>> = redis::cmd("CONFIG")
            .arg("GET")
            .arg("maxmemory-policy")
            .query_async(&mut conn)
            .await;
        match config {
            Ok(v) if v.len() == 2 => return Some(v.get(1).cloned()),
            Err(e) if unanswered(&e) => return None,
            _ => {}
        }
        let info: redis::RedisResult<String> = redis::cmd("INFO")
            .arg("memory")
            .query_async(&mut conn)
            .await;
        match info {
            Ok(info) => Some(
                info.lines()
                    .find_map(|l| l.strip_prefix("maxmemory_policy:"))
                    .map(|p| p.trim().to_owned()),
            ),
            Err(e) if unanswered(&e) => None,
            Err(_) => Some(None),
        }
    }
}
