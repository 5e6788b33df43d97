//! The configuration model: the serde structs and enums behind `config.toml`, and their
//! defaults. Reading and checking a file is the parent module's.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::audit::AuditConfig;
use super::origins::{BreakerConfig, OriginLimits};
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

/// Fleet mode: instances that share their filters through Redis.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FleetConfig {
    /// `redis://[user:password@]host:port[/db]`, or `rediss://` for TLS. The password
    /// is never logged.
    pub redis_url: String,
    /// Prefix of every key this fleet writes; fleets sharing one Redis need distinct ones.
    #[serde(default = "default_fleet_namespace")]
    pub namespace: String,
    /// This instance's name in leases and stream entries; default: the host name and a
    /// random suffix.
    #[serde(default)]
    pub instance_id: Option<String>,
    /// How long a builder's lease lasts without renewal; failover takes this plus one
    /// `retry_interval` at most.
    #[serde(default = "default_lease_ttl", with = "humantime_serde")]
    pub lease_ttl: Duration,
    /// How often a builder renews its lease (well below `lease_ttl`).
    #[serde(default = "default_lease_renew", with = "humantime_serde")]
    pub lease_renew: Duration,
    /// How often a follower tries to take a free lease, checks the current generation
    /// and Redis's epoch, and how often an instance retries Redis after losing it.
    #[serde(default = "default_fleet_retry", with = "humantime_serde")]
    pub retry_interval: Duration,
    /// How long a superseded generation stays readable after a newer one is current.
    #[serde(default = "default_generation_grace", with = "humantime_serde")]
    pub generation_grace: Duration,
    /// Bytes per Redis string of a published snapshot.
    #[serde(default = "default_chunk_bytes")]
    pub chunk_bytes: usize,
    /// Once the change stream holds more entries than this past the current
    /// generation's start, the builder publishes a fresh generation so older ones can go.
    #[serde(default = "default_stream_max_entries")]
    pub stream_max_entries: u64,
    /// Timeout of one Redis command (blocking stream reads excepted).
    #[serde(default = "default_redis_timeout", with = "humantime_serde")]
    pub command_timeout: Duration,
}

fn default_fleet_namespace() -> String {
    "bloomgate".into()
}
fn default_lease_ttl() -> Duration {
    Duration::from_secs(10)
}
fn default_lease_renew() -> Duration {
    Duration::from_secs(3)
}
fn default_fleet_retry() -> Duration {
    Duration::from_secs(1)
}
fn default_generation_grace() -> Duration {
    Duration::from_secs(300)
}
fn default_chunk_bytes() -> usize {
    1 << 20
}
fn default_stream_max_entries() -> u64 {
    100_000
}
fn default_redis_timeout() -> Duration {
    Duration::from_secs(2)
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

/// Data-plane listener and request limits.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ServerConfig {
    /// Address of the data plane.
    pub listen: SocketAddr,
    /// A client has this long to send the request head; then the connection is closed.
    #[serde(with = "humantime_serde")]
    pub header_read_timeout: Duration,
    /// Request bodies larger than this are refused with 413.
    pub max_body_bytes: u64,
    /// On SIGINT/SIGTERM, in-flight requests get this long to finish.
    #[serde(with = "humantime_serde")]
    pub shutdown_grace: Duration,
    /// Largest request head (request line and headers) accepted; past it: 431.
    pub max_header_bytes: usize,
    /// Longest request target (path and query) accepted; past it: 414.
    pub max_uri_bytes: usize,
    /// Address ranges of proxies in front of bloomgate (load balancers) whose
    /// `X-Forwarded-For`, `X-Forwarded-Proto` and `Forwarded` headers are believed. From
    /// any other peer those headers are replaced, and the peer is the client.
    pub trusted_proxies: Vec<String>,
    /// Who sees the `x-bloomgate` header: `always`, `trusted` (clients in
    /// `outcome_header_clients` only) or `never`. Metrics and logs carry the outcome in
    /// every case.
    pub outcome_header: OutcomeHeaderPolicy,
    /// Client address ranges that see the `x-bloomgate` header under `trusted`.
    pub outcome_header_clients: Vec<String>,
    /// Serve HTTP/2 too: `h2` chosen by ALPN on TLS, and cleartext `h2c` from clients
    /// that start with the HTTP/2 preface (prior knowledge). `Upgrade: h2c` is not
    /// offered. Off: HTTP/1.1 only.
    pub http2: bool,
    /// Most data-plane connections open at once; past it a new connection is accepted
    /// and closed at once (counted in `bloomgate_connections_refused_total`).
    pub max_connections: usize,
    /// Most concurrent requests (streams) on one HTTP/2 connection, advertised to the
    /// client in its SETTINGS.
    pub http2_max_concurrent_streams: u32,
    /// TLS termination on the data plane. Off when absent: plain HTTP.
    pub tls: Option<TlsConfig>,
    /// How data-plane connections are spread over threads: `per_core` (one
    /// single-threaded runtime per serving thread, each accepting on a listener of its
    /// own bound with `SO_REUSEPORT`) or `shared` (one multi-threaded runtime, shared
    /// with background work).
    pub threading: Threading,
    /// Serving threads under `per_core`; 0 is one per CPU core.
    pub workers: usize,
}

impl ServerConfig {
    /// The serving threads `per_core` starts (`workers`, or one per CPU core when it is
    /// 0); 0 under `shared`.
    pub fn serving_threads(&self) -> usize {
        match (self.threading, self.workers) {
            (Threading::Shared, _) => 0,
            (Threading::PerCore, 0) => std::thread::available_parallelism().map_or(1, |n| n.get()),
            (Threading::PerCore, n) => n,
        }
    }
}

/// How the data plane runs its connections (`server.threading`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Threading {
    /// A thread per core, each with its own runtime and listener; a connection stays on
    /// the thread that accepted it. Background work (sync, builds, fleet, admin) runs on
    /// a runtime of its own.
    #[default]
    PerCore,
    /// One work-stealing runtime for connections and background work alike.
    Shared,
}

/// The data plane's certificate and key, read at start and again on SIGHUP.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TlsConfig {
    /// PEM file: the server's certificate first, then any intermediates.
    pub cert_file: std::path::PathBuf,
    /// PEM file: the private key of that certificate (PKCS#8, PKCS#1 or SEC1).
    pub key_file: std::path::PathBuf,
}

/// Who is told, in the `x-bloomgate` response header, which stage answered.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OutcomeHeaderPolicy {
    /// Every client (the demo's choice; handy while rolling out).
    #[default]
    Always,
    /// Only clients whose address is in `server.outcome_header_clients`.
    Trusted,
    /// Nobody.
    Never,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            listen: SocketAddr::from(([0, 0, 0, 0], 8080)),
            header_read_timeout: Duration::from_secs(10),
            max_body_bytes: 1024 * 1024,
            shutdown_grace: Duration::from_secs(10),
            max_header_bytes: 16 * 1024,
            max_uri_bytes: 8 * 1024,
            trusted_proxies: Vec::new(),
            outcome_header: OutcomeHeaderPolicy::Always,
            outcome_header_clients: Vec::new(),
            http2: true,
            max_connections: 10_000,
            http2_max_concurrent_streams: 128,
            tls: None,
            threading: Threading::PerCore,
            workers: 0,
        }
    }
}

/// Admin-plane listener and credentials.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AdminConfig {
    /// Address of the admin plane; keep it on loopback or a private network.
    pub listen: SocketAddr,
    /// Bearer token for mutating admin calls. When unset (and `token_file` too), those
    /// calls are refused.
    pub token: Option<String>,
    /// A file holding the token instead (a container or systemd secret); its trailing
    /// line break is dropped. Compiling reads it into `token` and clears this field, so a
    /// compiled config names its token in one place; a reload reads the file again.
    pub token_file: Option<std::path::PathBuf>,
}

impl Default for AdminConfig {
    fn default() -> Self {
        AdminConfig {
            listen: SocketAddr::from(([127, 0, 0, 1], 9090)),
            token: None,
            token_file: None,
        }
    }
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

/// One Bloom filter and where its keys come from.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FilterConfig {
    /// Query whose first column lists every key that exists, e.g. `SELECT sku_id FROM products`.
    pub source_query: String,
    /// Number of keys the filter is sized for.
    pub expected_items: u64,
    /// Target false-positive rate at `expected_items`, in (0, 1).
    #[serde(default = "default_fpp")]
    pub false_positive_rate: f64,
    /// How keys are normalised, for the loader and every route gated by this filter.
    #[serde(default)]
    pub normalize: Normalize,
    /// First wait before retrying a failed load; doubles up to `load_retry_max`.
    #[serde(default = "default_retry_initial", with = "humantime_serde")]
    pub load_retry_initial: Duration,
    /// Longest wait between load attempts.
    #[serde(default = "default_retry_max", with = "humantime_serde")]
    pub load_retry_max: Duration,
    /// Incremental sync of new keys between full builds. Without it keys only arrive
    /// through rebuilds, write-through and the admin API.
    #[serde(default)]
    pub sync: Option<SyncConfig>,
    /// Period of full rebuilds from `source_query` (how deleted keys leave the filter).
    /// Without it, rebuilds happen on demand and when capacity runs out.
    #[serde(default, with = "humantime_serde")]
    pub rebuild_interval: Option<Duration>,
    /// Share of capacity at which a warning is logged (once per crossing).
    #[serde(default = "default_capacity_warn")]
    pub capacity_warn_ratio: f64,
    /// The filter is saved here after each build and loaded from here at start-up.
    #[serde(default)]
    pub snapshot_path: Option<std::path::PathBuf>,
    /// Where requests are gated: this instance's copy only (`"local"`), or also a copy
    /// held in the fleet's Redis that every instance and other services ask
    /// (`"redis"`; needs `[fleet]`).
    #[serde(default)]
    pub backend: Backend,
    /// The Redis-held copy, with `backend = "redis"`.
    #[serde(default)]
    pub redis: HeldConfig,
}

/// Where a filter's verdicts come from.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Backend {
    /// The filter in this instance's memory.
    #[default]
    Local,
    /// A copy in the fleet's Redis, asked for every key the local copy refuses.
    Redis,
}

/// Settings of a filter held in Redis (`backend = "redis"`).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HeldConfig {
    /// Longest wait for Redis's answer to one check; past it, the local copy answers.
    #[serde(default = "default_held_timeout", with = "humantime_serde")]
    pub check_timeout: Duration,
    /// Bytes per Redis string holding the filter's bits (a multiple of 64, at most
    /// 512 MiB, Redis's largest string).
    #[serde(default = "default_shard_bytes")]
    pub shard_bytes: u64,
    /// Whether every instance keeps its own copy of the filter in memory as well
    /// (`true`, the default: refusals are answered locally, Redis is asked only about
    /// keys the local copy refuses). With `false` only the builder holds one (it builds
    /// and writes it); the other instances ask Redis about every key and fail open
    /// while it cannot answer.
    #[serde(default = "default_local_copy")]
    pub local_copy: bool,
}

impl Default for HeldConfig {
    fn default() -> Self {
        HeldConfig {
            check_timeout: default_held_timeout(),
            shard_bytes: default_shard_bytes(),
            local_copy: true,
        }
    }
}

fn default_held_timeout() -> Duration {
    Duration::from_millis(5)
}

fn default_local_copy() -> bool {
    true
}

/// The most a Redis string holds by default (`proto-max-bulk-len`, 512 MB): the largest
/// shard of a filter held in Redis.
pub const MAX_SHARD_BYTES: u64 = 512 * 1024 * 1024;

/// Shard size unless configured: half the most a Redis string may hold.
pub const DEFAULT_SHARD_BYTES: u64 = MAX_SHARD_BYTES / 2;

fn default_shard_bytes() -> u64 {
    DEFAULT_SHARD_BYTES
}

/// Incremental sync: a query polled on an interval that returns keys changed since a
/// watermark.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SyncConfig {
    /// Two columns, the key and the watermark, with one `?` bound to the watermark, e.g.
    /// `SELECT sku_id, updated_at FROM products WHERE updated_at >= ?`.
    pub query: String,
    /// What the watermark column holds.
    #[serde(default)]
    pub watermark: WatermarkKind,
    /// Returns the watermark to start from just before a full build (one row, one column),
    /// e.g. `SELECT MAX(id) FROM products`. Required for integer watermarks; timestamp
    /// watermarks default to bloomgate's clock at the start of the build.
    #[serde(default)]
    pub start_query: Option<String>,
    /// How often the query runs.
    #[serde(default = "default_sync_interval", with = "humantime_serde")]
    pub interval: Duration,
    /// Each poll reaches back this far before the watermark (timestamp watermarks), so
    /// rows committed late or stamped by a skewed clock are not missed.
    #[serde(default = "default_sync_overlap", with = "humantime_serde")]
    pub overlap: Duration,
    /// Integer watermarks: how many ids below a full build's start mark the first poll
    /// after that build reads again; ids missing there are tracked as gaps.
    #[serde(default = "default_sync_overlap_ids")]
    pub overlap_ids: u64,
    /// Integer watermarks: how long an id that a poll skipped over (its transaction had
    /// not committed) is read again before it is given up. Keep it above the longest
    /// write transaction.
    #[serde(default = "default_sync_gap_timeout", with = "humantime_serde")]
    pub gap_timeout: Duration,
}

/// The type of the sync watermark column.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum WatermarkKind {
    /// A TIMESTAMP/DATETIME column, compared in UTC.
    #[default]
    Timestamp,
    /// An integer column such as an auto-increment id.
    Integer,
}

fn default_capacity_warn() -> f64 {
    0.85
}
fn default_sync_interval() -> Duration {
    Duration::from_secs(5)
}
fn default_sync_overlap() -> Duration {
    Duration::from_secs(10)
}
fn default_sync_overlap_ids() -> u64 {
    1000
}
fn default_sync_gap_timeout() -> Duration {
    Duration::from_secs(120)
}

fn default_fpp() -> f64 {
    0.01
}
fn default_retry_initial() -> Duration {
    Duration::from_millis(500)
}
fn default_retry_max() -> Duration {
    Duration::from_secs(30)
}

/// A guarded route.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RouteConfig {
    /// Name used in metric labels and logs; defaults to the path.
    #[serde(default)]
    pub name: Option<String>,
    /// Path pattern: literal segments and at most one `{param}` segment,
    /// e.g. `/api/products/{id}` or `/api/product/info`.
    pub path: String,
    /// Where the key comes from.
    pub key: KeySource,
    /// Name of the filter that gates this route.
    pub filter: String,
    /// Normalisation; must equal the filter's, which it defaults to.
    #[serde(default)]
    pub normalize: Option<Normalize>,
    /// Where found keys are fetched from.
    pub origin: OriginConfig,
    /// Positive TTL for this route, overriding `cache.ttl`.
    #[serde(default, with = "humantime_serde")]
    pub ttl: Option<Duration>,
    /// Negative TTL for this route, overriding `cache.negative_ttl`.
    #[serde(default, with = "humantime_serde")]
    pub negative_ttl: Option<Duration>,
    /// `stale_if_error` for this route, overriding `cache.stale_if_error`.
    #[serde(default, with = "humantime_serde")]
    pub stale_if_error: Option<Duration>,
    /// `stale_while_revalidate` for this route, overriding the cache's.
    #[serde(default, with = "humantime_serde")]
    pub stale_while_revalidate: Option<Duration>,
    /// `enforce` (refuse keys the gate calls absent) or `shadow` (only count them).
    #[serde(default)]
    pub mode: RouteMode,
    /// Literal path segments match only in the same case (default: any case).
    #[serde(default)]
    pub case_sensitive: bool,
    /// A trailing slash names another resource (default: the same one).
    #[serde(default)]
    pub strict_trailing_slash: bool,
    /// Segment keys may contain `.` (default: refused with 400, since many upstreams
    /// read `/products/42.json` as key 42).
    #[serde(default)]
    pub key_allows_dot: bool,
    /// Query parameters sent on to an upstream origin; each is part of the cache key.
    #[serde(default)]
    pub forward_query: Vec<String>,
    /// Other query parameters: `drop` them from the origin request (default) or
    /// `reject` the request with 400.
    #[serde(default)]
    pub undeclared_query: UndeclaredQuery,
    /// Request headers sent on to an upstream origin; each is part of the cache key.
    #[serde(default)]
    pub forward_headers: Vec<String>,
    /// Headers set on every origin request of this route, e.g. an API key.
    #[serde(default)]
    pub upstream_headers: BTreeMap<String, String>,
}

/// What a guarded route does with query parameters it neither reads nor forwards.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum UndeclaredQuery {
    /// Leave them out of the origin request and the cache key.
    #[default]
    Drop,
    /// Answer 400 `undeclared_parameter`.
    Reject,
}

/// Whether a route acts on the gate's verdict.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RouteMode {
    /// "Definitely absent" answers 404 at once.
    #[default]
    Enforce,
    /// The verdict is counted (`would_intercept`) but every request goes on to the cache
    /// and origin; a key the origin finds after the gate called it absent is a false
    /// negative. For rolling out safely.
    Shadow,
    /// The gate is not consulted: only the cache (with its negative entries) stands
    /// between clients and the origin. For comparisons and emergencies.
    Off,
}

impl RouteMode {
    /// The mode as the config spells it, for metric labels and logs.
    pub fn as_str(self) -> &'static str {
        match self {
            RouteMode::Enforce => "enforce",
            RouteMode::Shadow => "shadow",
            RouteMode::Off => "off",
        }
    }
}

/// A write that, when the upstream accepts it, adds a key to a filter at once.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WriteThroughConfig {
    /// Path pattern of the write, with at most one `{param}` segment.
    pub path: String,
    /// Methods that count as writes.
    #[serde(default = "default_write_methods")]
    pub methods: Vec<String>,
    /// Upstream statuses that mean success; empty means any 2xx.
    #[serde(default)]
    pub statuses: Vec<u16>,
    /// The filter that receives the key.
    pub filter: String,
    /// Where the new key is read from.
    pub key: WriteKey,
}

fn default_write_methods() -> Vec<String> {
    vec!["POST".into(), "PUT".into(), "PATCH".into()]
}

/// Where write-through reads the created key.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "lowercase")]
pub enum WriteKey {
    /// The `{name}` segment of the request path: `{ segment = "id" }`.
    Segment(String),
    /// The last path segment of a response header such as `Location`: `{ header = "location" }`.
    Header(String),
    /// A field of the JSON response body, dotted for nesting: `{ json = "data.sku_id" }`.
    Json(String),
}

impl RouteConfig {
    /// The label used for this route in metrics and logs.
    pub fn label(&self) -> &str {
        self.name.as_deref().unwrap_or(&self.path)
    }
}

/// Where a route's key is read from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "lowercase")]
pub enum KeySource {
    /// A query parameter: `key = { query = "sku_id" }`.
    Query(String),
    /// The `{name}` segment of the path: `key = { segment = "id" }`.
    Segment(String),
}

/// Where a guarded route fetches what the gate let through.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase", deny_unknown_fields)]
pub enum OriginConfig {
    /// A parameterised query with one `?` for the key; the first row is returned as JSON.
    Sql {
        /// e.g. `SELECT sku_id, name, price, updated_at FROM products WHERE sku_id = ?`.
        query: String,
        /// Longest time a lookup may take (pool wait included) before the client gets 504.
        #[serde(default = "default_origin_timeout", with = "humantime_serde")]
        timeout: Duration,
    },
    /// The request is forwarded to `[upstream]`.
    Upstream {
        /// Upstream statuses that mean "no such key" (false positive), default 404 and 410.
        #[serde(default = "default_not_found")]
        not_found_statuses: Vec<u16>,
    },
}

fn default_origin_timeout() -> Duration {
    Duration::from_secs(2)
}
fn default_not_found() -> Vec<u16> {
    vec![404, 410]
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
