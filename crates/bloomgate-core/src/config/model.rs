//! The configuration model: the serde structs and enums behind `config.toml`, and their
//! defaults. Reading and checking a file is the parent module's.

use std::collections::BTreeMap;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::audit::AuditConfig;
pub use super::filters::*;
pub use super::fleet::*;
use super::origins::{BreakerConfig, OriginLimits};
pub use super::routes::*;
pub use super::server::*;
pub use crate::key::Normalize;

/// The whole configuration.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// The data plane.
    #[serde(default)]
    pub server: ServerConfig,
    /// The admin plane: metrics, health, admin API.
    #[serde(default)]
    pub admin: AdminConfig,
    /// The upstream API: target of pass-through and of `upstream` origins.
    #[serde(default)]
    pub upstream: Option<UpstreamConfig>,
    /// The database that filters load from and `sql` origins query.
    #[serde(default)]
    pub database: Option<DatabaseConfig>,
    /// The response cache.
    #[serde(default)]
    pub cache: CacheConfig,
    /// Bloom filters by name.
    #[serde(default)]
    pub filters: BTreeMap<String, FilterConfig>,
    /// Guarded routes, matched in order.
    #[serde(default)]
    pub routes: Vec<RouteConfig>,
    /// Writes passing through to the upstream whose success adds a key to a filter.
    #[serde(default)]
    pub write_through: Vec<WriteThroughConfig>,
    /// Logging.
    #[serde(default)]
    pub log: LogConfig,
    /// One line per data-plane request. Off when absent.
    #[serde(default)]
    pub access_log: Option<AccessLogConfig>,
    /// How many false positives each client may push through to the origin per window.
    /// Off when absent.
    #[serde(default)]
    pub false_positive_budget: Option<BudgetConfig>,
    /// Several instances sharing one builder, snapshots and a change stream through
    /// Redis. Off when absent: each instance builds and syncs on its own.
    #[serde(default)]
    pub fleet: Option<FleetConfig>,
    /// The gate's self-audit: a sample of refused keys checked against their origin.
    /// On by default, at a small rate.
    #[serde(default)]
    pub audit: AuditConfig,
}

/// The per-client budget of requests for absent keys that reach the origin.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BudgetConfig {
    /// False positives one client address may cause per window; past it, its requests
    /// that would need an origin call get 429 until the window ends.
    pub per_client: u32,
    /// Length of a window.
    #[serde(default = "default_budget_window", with = "humantime_serde")]
    pub window: Duration,
    /// Counters per row of the sketch (four rows of 8-byte cells): 16384 is 512 KiB and
    /// keeps thousands of hunting clients apart.
    #[serde(default = "default_budget_slots")]
    pub slots: usize,
}

fn default_budget_window() -> Duration {
    Duration::from_secs(60)
}
fn default_budget_slots() -> usize {
    16_384
}

/// The upstream HTTP API.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UpstreamConfig {
    /// Base URL, `http://host:port` (plain HTTP; TLS is terminated elsewhere).
    pub url: String,
    /// Time allowed for an upstream response head; past it the client gets 504.
    #[serde(default = "default_upstream_timeout", with = "humantime_serde")]
    pub timeout: Duration,
    /// Idle keep-alive connections are closed after this long.
    #[serde(default = "default_pool_idle", with = "humantime_serde")]
    pub pool_idle_timeout: Duration,
    /// Most idle keep-alive connections kept open to the upstream, per serving thread
    /// (each thread under `per_core` keeps its own pool).
    #[serde(default = "default_pool_max_idle")]
    pub pool_max_idle: usize,
    /// Most lookups in flight to the upstream at once (default 256).
    #[serde(default)]
    pub max_in_flight: Option<usize>,
    /// Most lookups waiting for a free slot (default: 4 × `max_in_flight`).
    #[serde(default)]
    pub max_queued: Option<usize>,
    /// How long a lookup waits for a free slot before its 503.
    #[serde(
        default = "super::origins::default_queue_timeout",
        with = "humantime_serde"
    )]
    pub queue_timeout: Duration,
    /// The upstream's circuit breaker.
    #[serde(default)]
    pub breaker: BreakerConfig,
}

impl UpstreamConfig {
    /// The concurrency bound and breaker of the upstream, defaults resolved.
    pub fn limits(&self) -> OriginLimits {
        OriginLimits::resolve(
            self.max_in_flight.unwrap_or(256),
            self.max_queued,
            self.queue_timeout,
            &self.breaker,
        )
    }
}

fn default_upstream_timeout() -> Duration {
    Duration::from_secs(5)
}
fn default_pool_idle() -> Duration {
    Duration::from_secs(90)
}
fn default_pool_max_idle() -> usize {
    256
}

/// Connection pool settings for the database.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DatabaseConfig {
    /// `mysql://user:pass@host:3306/db`, `mariadb://…` or `sqlite://path/to.db`.
    pub url: String,
    /// Upper bound of pooled connections.
    #[serde(default = "default_max_connections")]
    pub max_connections: u32,
    /// Connections kept open when idle.
    #[serde(default)]
    pub min_connections: u32,
    /// How long a lookup waits for a free connection before answering 503.
    #[serde(default = "default_acquire_timeout", with = "humantime_serde")]
    pub acquire_timeout: Duration,
    /// Most lookups in flight at once (default: `max_connections`).
    #[serde(default)]
    pub max_in_flight: Option<usize>,
    /// Most lookups waiting for a free slot (default: 4 × `max_in_flight`).
    #[serde(default)]
    pub max_queued: Option<usize>,
    /// How long a lookup waits for a free slot before its 503.
    #[serde(
        default = "super::origins::default_queue_timeout",
        with = "humantime_serde"
    )]
    pub queue_timeout: Duration,
    /// The database's circuit breaker.
    #[serde(default)]
    pub breaker: BreakerConfig,
}

impl DatabaseConfig {
    /// The concurrency bound and breaker of the database, defaults resolved.
    pub fn limits(&self) -> OriginLimits {
        OriginLimits::resolve(
            self.max_in_flight.unwrap_or(self.max_connections as usize),
            self.max_queued,
            self.queue_timeout,
            &self.breaker,
        )
    }
}

fn default_max_connections() -> u32 {
    16
}
fn default_acquire_timeout() -> Duration {
    Duration::from_millis(500)
}

/// Bounds and lifetimes of cached responses.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CacheConfig {
    /// Most positive entries (found keys). With neither this nor `max_bytes` set, the
    /// bound is [`DEFAULT_MAX_ENTRIES`] entries.
    pub max_entries: Option<u64>,
    /// Most bytes the positive entries take, as estimated per entry (body, stored
    /// headers, key, and the cache's own overhead for an entry); with `max_entries`
    /// too, whichever is reached first. An approximate bound: see docs/configuration.md.
    pub max_bytes: Option<u64>,
    /// Lifetime of a positive entry.
    #[serde(with = "humantime_serde")]
    pub ttl: Duration,
    /// Most negative entries (the gate's false positives); a separate bound, so a flood
    /// of absent keys cannot push found keys out. With neither this nor
    /// `negative_max_bytes` set, [`DEFAULT_MAX_ENTRIES`].
    pub negative_max_entries: Option<u64>,
    /// Most bytes the negative entries take (key and per-entry overhead, estimated).
    pub negative_max_bytes: Option<u64>,
    /// Lifetime of a negative entry. A key admitted by sync, write-through or the admin
    /// API drops its negative entries at once, so this mostly bounds how often one absent
    /// key can reach the origin.
    #[serde(with = "humantime_serde")]
    pub negative_ttl: Duration,
    /// How long past its TTL a positive entry may still be served when the origin fails,
    /// times out or its breaker is open (RFC 5861 `stale-if-error`); 0 turns it off.
    #[serde(with = "humantime_serde")]
    pub stale_if_error: Duration,
    /// How long past its TTL a positive entry is served at once while one background
    /// request refreshes it (RFC 5861 `stale-while-revalidate`); 0 (the default) turns
    /// it off.
    #[serde(with = "humantime_serde")]
    pub stale_while_revalidate: Duration,
}

/// The entry bound of each cache when no bound is configured for it.
pub const DEFAULT_MAX_ENTRIES: u64 = 100_000;

impl Default for CacheConfig {
    fn default() -> Self {
        CacheConfig {
            max_entries: None,
            max_bytes: None,
            ttl: Duration::from_secs(300),
            negative_max_entries: None,
            negative_max_bytes: None,
            negative_ttl: Duration::from_secs(300),
            stale_if_error: Duration::from_secs(3600),
            stale_while_revalidate: Duration::ZERO,
        }
    }
}

/// How long past its TTL an entry may still be served: when the origin fails, and while
/// it is refreshed in the background.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StaleWindows {
    /// `stale-if-error`.
    pub if_error: Duration,
    /// `stale-while-revalidate`.
    pub while_revalidate: Duration,
}

impl StaleWindows {
    /// The longer of the two: how long past its TTL an entry is kept at all.
    pub fn longest(&self) -> Duration {
        self.if_error.max(self.while_revalidate)
    }
}

/// Log output.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LogConfig {
    /// `human` or `json`.
    pub format: LogFormat,
    /// An `EnvFilter` directive, e.g. `info` or `bloomgate=debug,info`; `RUST_LOG` wins.
    pub level: String,
}

impl Default for LogConfig {
    fn default() -> Self {
        LogConfig {
            format: LogFormat::Human,
            level: "info".to_owned(),
        }
    }
}

/// The access log: one line per data-plane request.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AccessLogConfig {
    /// `json` (one object per line) or `text` (a compact line).
    pub format: AccessLogFormat,
    /// A file to append to (reopened on SIGUSR1), or `-` for standard output.
    pub path: Option<std::path::PathBuf>,
    /// The share of requests logged, drawn at random: 1 logs every request.
    pub sample: f64,
}

impl Default for AccessLogConfig {
    fn default() -> Self {
        AccessLogConfig {
            format: AccessLogFormat::Json,
            path: None,
            sample: 1.0,
        }
    }
}

/// Access log line format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum AccessLogFormat {
    /// `{"time":…,"client":…,…}`.
    Json,
    /// `time client "method path" status outcome route bytes duration_ms`.
    Text,
}

/// Log line format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    /// Readable lines for a terminal.
    Human,
    /// One JSON object per line, for log shippers.
    Json,
}
