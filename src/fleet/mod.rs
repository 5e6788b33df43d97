//! Fleet mode: several instances that share one truth through Redis. Per filter, one
//! instance (the builder, holding a lease) scans the database, syncs it, and publishes
//! each filter it builds as a shared generation; the others (followers) load the current
//! generation and never scan. Every admission and invalidation, on any instance, goes
//! through the change stream that every instance applies. When Redis is unreachable,
//! each instance goes on alone (its own sync; its own build if it has no filter) and
//! rejoins when Redis is back. Lookups stay local: no request waits on Redis, except
//! for the keys a filter held in Redis too (`backend = "redis"`, `gate::held`) refuses,
//! or every key of one held there alone (`redis.local_copy = false`: only its builder
//! holds a copy, and the other instances neither load generations nor build).
//!
//! `keys` names every key, `lease` the builder lease, `generation` the shared
//! snapshots, `stream` the change stream, `change` its entries, `run` the loops,
//! `policy` Redis's eviction policy.

pub mod change;
pub mod generation;
pub mod keys;
pub mod lease;
pub mod metrics;
mod policy;
mod run;
pub mod stream;

use std::collections::{BTreeMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use serde_json::{Value, json};
use tokio::sync::{Notify, mpsc};

use crate::fleet::metrics::FleetMetrics;
use crate::gate::admit::Admit;
use crate::gate::{Filter, RebuildReason};
use bloomgate_core::config::FleetConfig;
use bloomgate_core::db::Db;
use bloomgate_core::key::OwnedKey;
use bloomgate_core::redis_conn::{self as connect, RedisConn};
use bloomgate_core::report::Chain;
use change::{Change, Entry};
use generation::Current;
use keys::Keys;
use lease::Lease;
use stream::{Fields, StreamPos};

/// Recently applied keys remembered per filter, to check generations against.
const RECENT_KEYS: usize = 256;

/// Why fleet mode could not be set up, or a fleet request not be sent.
#[derive(Debug, thiserror::Error)]
pub enum FleetError {
    /// The Redis URL or client settings were refused, or a Redis call failed.
    #[error("redis")]
    Redis(#[from] redis::RedisError),
    /// The connection to Redis could not be set up.
    #[error(transparent)]
    Connect(#[from] connect::ConnectError),
}

/// What this instance is for one filter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// It holds the lease: it builds, syncs and publishes.
    Builder,
    /// It loads what the builder publishes.
    Follower,
    /// Redis is unreachable: it syncs on its own (and builds if it has no filter).
    Standalone,
}

impl Role {
    /// Label for metrics and the admin API.
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Builder => "builder",
            Role::Follower => "follower",
            Role::Standalone => "standalone",
        }
    }
}

/// The fleet state of one filter on this instance.
pub struct Member {
    name: Arc<str>,
    filter: Arc<Filter>,
    /// Woken when the stream announces a generation of this filter.
    announced: Notify,
    status: Mutex<MemberStatus>,
    /// Keys applied from the stream, with their positions (newest last).
    recent: Mutex<VecDeque<(StreamPos, OwnedKey)>>,
}

#[derive(Debug, Clone)]
struct MemberStatus {
    role: Role,
    lease: Option<Lease>,
    /// The lease held when Redis went away: if Redis still holds it unchanged on return,
    /// this instance takes it back at once instead of waiting for it to expire.
    lapsed: Option<Lease>,
    holder: Option<String>,
    /// The generation this instance serves (loaded or published).
    serving: Option<Current>,
    /// The generation Redis names current, as last read.
    current: Option<Current>,
    /// Why the last generation was refused.
    refused: Option<String>,
    /// Load the current generation even if it is not newer (entries were trimmed away).
    force_reload: bool,
}

/// One instance's membership in a fleet.
pub struct Fleet {
    config: FleetConfig,
    instance: Arc<str>,
    keys: Keys,
    /// `single`, `sentinel` or `cluster`, as `fleet.redis_url` says.
    redis_kind: &'static str,
    /// Commands (leases, generations, appends).
    conn: RedisConn,
    /// Blocking stream reads only.
    reader: RedisConn,
    members: BTreeMap<String, Arc<Member>>,
    admit: Arc<Admit>,
    db: Db,
    position: Mutex<StreamPos>,
    token: Mutex<Option<String>>,
    /// Redis's `maxmemory-policy` as last read (`Some(None)`: it could not be read).
    policy: Mutex<Option<Option<String>>>,
    redis_up: AtomicBool,
    /// Woken when Redis goes away, comes back, or is found reset.
    changed: Notify,
    /// Woken when a Redis call fails: the watcher checks Redis at once.
    recheck: Notify,
    /// Set once the first check of Redis has finished (either way): until then no
    /// filter knows whether to follow or go on alone.
    checked: tokio::sync::watch::Sender<bool>,
    /// How many times Redis was found to have lost its data (for `/admin/fleet`).
    resets: AtomicU64,
    metrics: FleetMetrics,
    outbox: Mutex<Option<mpsc::Receiver<Change>>>,
}

impl Fleet {
    /// Sets up fleet mode for `filters`; connects lazily (nothing fails here because
    /// Redis is down). `outbox` is the receiving end of the channel given to [`Admit`].
    pub fn new(
        config: FleetConfig,
        filters: &[Arc<Filter>],
        admit: Arc<Admit>,
        db: Db,
        outbox: mpsc::Receiver<Change>,
        metrics: FleetMetrics,
    ) -> Result<Fleet, FleetError> {
        let timeouts = connect::Timeouts {
            connect: config.command_timeout,
            response: config.command_timeout,
            retry: config.retry_interval,
        };
        let conn = RedisConn::open(&config, timeouts)?;
        // A blocked read waits up to a second for entries, plus the usual timeout.
        let reader = RedisConn::open(
            &config,
            connect::Timeouts {
                response: config.command_timeout + std::time::Duration::from_secs(1),
                ..timeouts
            },
        )?;
        let instance: Arc<str> = Arc::from(
            config
                .instance_id
                .clone()
                .unwrap_or_else(default_instance_id)
                .as_str(),
        );
        // A filter held in Redis checks and writes through the fleet's connection:
        // one multiplexed connection pipelines every request's check.
        for f in filters {
            let fc = f.config();
            if fc.backend == bloomgate_core::config::Backend::Redis {
                f.set_held(Arc::new(crate::gate::held::HeldGate::new(
                    f.name(),
                    &config.namespace,
                    conn.clone(),
                    fc.redis.clone(),
                    f.metrics().clone(),
                )));
            }
        }
        let members = filters
            .iter()
            .map(|f| {
                metrics.set_role(f.name(), Role::Follower.as_str());
                (
                    f.name().to_owned(),
                    Arc::new(Member {
                        name: Arc::from(f.name()),
                        filter: Arc::clone(f),
                        announced: Notify::new(),
                        status: Mutex::new(MemberStatus {
                            role: Role::Follower,
                            lease: None,
                            lapsed: None,
                            holder: None,
                            serving: None,
                            current: None,
                            refused: None,
                            force_reload: false,
                        }),
                        recent: Mutex::new(VecDeque::new()),
                    }),
                )
            })
            .collect();
        metrics.set_redis_up(false);
        Ok(Fleet {
            keys: Keys::new(&config.namespace),
            redis_kind: bloomgate_core::config::RedisTarget::parse(&config.redis_url)
                .map_or("single", |t| t.kind()),
            config,
            instance,
            conn,
            reader,
            members,
            admit,
            db,
            position: Mutex::new(StreamPos::default()),
            token: Mutex::new(None),
            policy: Mutex::new(None),
            redis_up: AtomicBool::new(false),
            changed: Notify::new(),
            recheck: Notify::new(),
            checked: tokio::sync::watch::Sender::new(false),
            resets: AtomicU64::new(0),
            metrics,
            outbox: Mutex::new(Some(outbox)),
        })
    }

    /// This instance's id.
    pub fn instance(&self) -> &str {
        &self.instance
    }

    /// Whether Redis answered the last check.
    pub fn redis_up(&self) -> bool {
        self.redis_up.load(Ordering::Acquire)
    }

    /// How far this instance has applied the change stream.
    pub fn position(&self) -> StreamPos {
        *lock(&self.position)
    }

    /// Moves the position from `from` to `to`, unless it was reset meanwhile.
    fn advance_position(&self, from: StreamPos, to: StreamPos) {
        let mut p = lock(&self.position);
        if *p >= from && to > *p {
            *p = to;
        }
    }

    /// Records a failed Redis call and asks the watcher to check Redis now. One failed
    /// call (a timeout under load) does not make Redis count as down: the watcher's
    /// check decides, so a filter is not sent off on its own by a single slow reply.
    fn redis_failed(&self, what: &str, e: &redis::RedisError) {
        tracing::debug!(during = what, error = %Chain(e), "fleet Redis call failed; checking Redis");
        self.recheck.notify_one();
    }

    /// Redis failed the watcher's check: it counts as down until the next good check.
    fn redis_down(&self, e: &redis::RedisError) {
        if self.redis_up.swap(false, Ordering::AcqRel) {
            self.set_held_up(false);
            tracing::warn!(error = %Chain(e), "lost the fleet's Redis; each filter goes on alone until it is back");
            self.metrics.set_redis_up(false);
            self.changed.notify_waiters();
        }
    }

    /// Tells every filter held in Redis whether Redis is reachable.
    fn set_held_up(&self, up: bool) {
        for m in self.members.values() {
            if let Some(held) = m.filter.held() {
                held.set_up(up);
            }
        }
    }

    /// Applies one stream entry read at `at`.
    async fn apply_entry(&self, at: StreamPos, fields: &Fields) {
        match self.decode(fields) {
            Ok((Entry::Change(change), src)) => {
                let Some(member) = self.members.get(change.filter()) else {
                    return;
                };
                let ours = src.as_deref() == Some(&*self.instance);
                self.admit.apply(&member.filter, &change, ours).await;
                if let Change::Admit { keys, .. } = &change {
                    let mut recent = lock(&member.recent);
                    for k in keys.iter().rev().take(RECENT_KEYS).rev() {
                        if recent.len() == RECENT_KEYS {
                            recent.pop_front();
                        }
                        recent.push_back((at, k.clone()));
                    }
                }
                self.metrics.entries("applied", 1);
            }
            Ok((Entry::Rebuild { filter }, src)) => {
                if let Some(m) = self.members.get(&*filter)
                    && lock(&m.status).role == Role::Builder
                {
                    tracing::info!(filter = %filter, asked_on = src.as_deref().unwrap_or("?"),
                        "rebuild asked for on another instance");
                    m.filter.request_rebuild(RebuildReason::Requested);
                }
                self.metrics.entries("applied", 1);
            }
            Ok((Entry::Generation { filter, .. }, _)) => {
                if let Some(m) = self.members.get(&*filter) {
                    m.announced.notify_one();
                }
                self.metrics.entries("applied", 1);
            }
            Err(e) => {
                tracing::warn!(position = %at, error = %Chain(&e), "refused a change stream entry");
                self.metrics.entries("rejected", 1);
            }
        }
    }

    /// Sends a rebuild request for filter `name` to its builder through the stream when
    /// this instance only follows it; returns the builder asked. `None`: this instance
    /// builds the filter itself (it holds the lease, or goes on alone while Redis is
    /// away), so the caller asks for the rebuild here.
    pub async fn send_rebuild(&self, name: &str) -> Result<Option<String>, FleetError> {
        let Some(m) = self.members.get(name) else {
            return Ok(None);
        };
        let (role, holder) = {
            let s = lock(&m.status);
            (s.role, s.holder.clone())
        };
        if role != Role::Follower {
            return Ok(None);
        }
        let mut cmd = redis::cmd("XADD");
        cmd.arg(self.keys.stream()).arg("*");
        for (field, value) in change::rebuild_fields(name, &self.instance) {
            cmd.arg(field).arg(value);
        }
        let mut conn = self.conn.clone();
        cmd.query_async::<()>(&mut conn).await?;
        Ok(Some(
            holder
                .as_deref()
                .map(lease::holder)
                .unwrap_or("")
                .to_owned(),
        ))
    }

    /// The state of every filter, for `/admin/fleet`.
    pub fn status_json(&self) -> Value {
        let filters: Vec<Value> = self.members.values().map(|m| self.member_json(m)).collect();
        json!({
            "instance": &*self.instance,
            "namespace": self.config.namespace,
            "redis": {
                "url": redacted(&self.config.redis_url),
                "kind": self.redis_kind,
                "up": self.redis_up(),
                "epoch": lock(&self.token).clone(),
                "resets_seen": self.resets.load(Ordering::Relaxed),
                "maxmemory_policy": lock(&self.policy).clone().flatten(),
            },
            "stream": { "position": self.position().to_string() },
            "filters": filters,
        })
    }

    /// The fleet state of filter `name`, for `/admin/filters`.
    pub fn filter_json(&self, name: &str) -> Option<Value> {
        self.members.get(name).map(|m| self.member_json(m))
    }

    fn member_json(&self, m: &Member) -> Value {
        let s = lock(&m.status).clone();
        let gen_json = |c: &Option<Current>| {
            c.as_ref().map(|c| {
                json!({
                    "generation": c.generation,
                    "items": c.items,
                    "bytes": c.bytes,
                    "start": c.start.to_string(),
                    "published_by": c.by,
                    "published_at_ms": c.at_ms,
                })
            })
        };
        json!({
            "name": &*m.name,
            "role": s.role.as_str(),
            "lease_holder": s.holder.as_deref().map(lease::holder),
            "lease_epoch": s.lease.as_ref().map(|l| l.epoch),
            "serving": gen_json(&s.serving),
            "current": gen_json(&s.current),
            "last_refusal": s.refused,
        })
    }
}

/// The URL without its password.
pub fn redacted(url: &str) -> String {
    match (url.split_once("://"), url.rfind('@')) {
        (Some((scheme, rest)), Some(at)) => {
            let userinfo = &rest[..at - scheme.len() - 3];
            let user = userinfo.split_once(':').map_or(userinfo, |(u, _)| u);
            format!("{scheme}://{user}:***@{}", &url[at + 1..])
        }
        _ => url.to_owned(),
    }
}

/// The host name and a random suffix.
fn default_instance_id() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .unwrap_or_else(|| "bloomgate".into());
    let host: String = host
        .trim()
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' {
                c
            } else {
                '-'
            }
        })
        .take(64)
        .collect();
    format!("{host}-{:08x}", rand::random::<u32>())
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_password_in_the_url_is_never_shown() {
        assert_eq!(
            redacted("redis://app:s3cret@redis.internal:6379/2"),
            "redis://app:***@redis.internal:6379/2"
        );
        assert_eq!(redacted("rediss://:s3cret@r:6380"), "rediss://:***@r:6380");
        assert_eq!(redacted("redis://127.0.0.1:6379"), "redis://127.0.0.1:6379");
        assert_eq!(redacted("redis://u:p@ss:w@rd@h:1"), "redis://u:***@h:1");
    }

    #[test]
    fn the_default_instance_id_is_a_valid_name_and_differs_per_start() {
        let a = default_instance_id();
        let b = default_instance_id();
        assert_ne!(a, b);
        assert!(
            a.bytes().all(|c| c.is_ascii_alphanumeric() || c == b'-'),
            "{a}"
        );
    }
}
