//! Configuration: the serde structs behind `config.toml`, their defaults, environment
//! overrides (`BLOOMGATE__SECTION__FIELD`) and `validate()`. It reads and checks; it does
//! not open sockets or databases.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use figment::Figment;
use figment::providers::{Env, Format, Toml};
use serde::{Deserialize, Serialize};

/// Prefix of the environment variables that override config fields; nested fields are
/// separated by a double underscore: `BLOOMGATE__SERVER__LISTEN=0.0.0.0:8081`.
pub const ENV_PREFIX: &str = "BLOOMGATE__";

/// A config that could not be read or does not make sense. Both variants name the field.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file or an environment variable could not be parsed into the structs
    /// (unknown field, wrong type, bad duration, …). figment's message names the key path.
    #[error("{0}")]
    Parse(String),
    /// The values parsed but break a rule.
    #[error("invalid config: `{field}`: {reason}")]
    Invalid {
        /// Dotted path of the offending field, e.g. `routes[0].origin.query`.
        field: String,
        /// Why it is refused.
        reason: String,
    },
}

impl ConfigError {
    fn invalid(field: impl Into<String>, reason: impl Into<String>) -> Self {
        ConfigError::Invalid {
            field: field.into(),
            reason: reason.into(),
        }
    }
}

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
    /// How many false positives each client may push through to the origin per window.
    /// Off when absent.
    #[serde(default)]
    pub false_positive_budget: Option<BudgetConfig>,
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
        }
    }
}

/// Admin-plane listener and credentials.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AdminConfig {
    /// Address of the admin plane; keep it on loopback or a private network.
    pub listen: SocketAddr,
    /// Bearer token for mutating admin calls. When unset, those calls are refused.
    pub token: Option<String>,
}

impl Default for AdminConfig {
    fn default() -> Self {
        AdminConfig {
            listen: SocketAddr::from(([127, 0, 0, 1], 9090)),
            token: None,
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
    /// Most idle keep-alive connections kept open to the upstream.
    #[serde(default = "default_pool_max_idle")]
    pub pool_max_idle: usize,
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
    /// Most positive entries (found keys).
    pub max_entries: u64,
    /// Lifetime of a positive entry.
    #[serde(with = "humantime_serde")]
    pub ttl: Duration,
    /// Most negative entries (the gate's false positives); a separate bound, so a flood
    /// of absent keys cannot push found keys out.
    pub negative_max_entries: u64,
    /// Lifetime of a negative entry. A key admitted by sync, write-through or the admin
    /// API drops its negative entries at once, so this mostly bounds how often one absent
    /// key can reach the origin.
    #[serde(with = "humantime_serde")]
    pub negative_ttl: Duration,
}

impl Default for CacheConfig {
    fn default() -> Self {
        CacheConfig {
            max_entries: 100_000,
            ttl: Duration::from_secs(300),
            negative_max_entries: 100_000,
            negative_ttl: Duration::from_secs(300),
        }
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

/// How a raw key becomes the canonical bytes that the filter and cache see.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase", deny_unknown_fields)]
pub enum Normalize {
    /// An unsigned 64-bit integer in canonical decimal form (`007` and `+7` become `7`).
    #[default]
    Integer,
    /// Text: trimmed, optionally lowercased, at most `max_len` bytes.
    String {
        /// Fold ASCII and Unicode letters to lower case.
        #[serde(default)]
        lowercase: bool,
        /// Longest accepted key, in bytes after trimming and lowercasing.
        #[serde(default = "default_max_len")]
        max_len: usize,
    },
}

fn default_max_len() -> usize {
    128
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

    /// How literally the route's path matches.
    pub fn match_options(&self) -> crate::proxy::route::MatchOptions {
        crate::proxy::route::MatchOptions {
            case_sensitive: self.case_sensitive,
            strict_trailing_slash: self.strict_trailing_slash,
            key_allows_dot: self.key_allows_dot,
        }
    }
}

/// Request headers that are never forwarded to an origin as declared headers: they
/// describe the connection or the hop, or bloomgate sets them itself.
const NOT_FORWARDABLE: [&str; 12] = [
    "host",
    "connection",
    "keep-alive",
    "proxy-connection",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "content-length",
    "if-none-match",
    "if-modified-since",
];

fn validate_forwarding(r: &RouteConfig, at: &dyn Fn(&str) -> String) -> Result<(), ConfigError> {
    let upstream = matches!(r.origin, OriginConfig::Upstream { .. });
    if !upstream
        && (!r.forward_query.is_empty()
            || !r.forward_headers.is_empty()
            || !r.upstream_headers.is_empty())
    {
        return Err(ConfigError::invalid(
            at("forward_query"),
            "forward_query, forward_headers and upstream_headers apply to upstream origins only",
        ));
    }
    let mut seen = std::collections::HashSet::new();
    for name in &r.forward_query {
        if name.is_empty() || !seen.insert(name.to_ascii_lowercase()) {
            return Err(ConfigError::invalid(
                at("forward_query"),
                format!("`{name}` is empty or listed twice (names match in any case)"),
            ));
        }
        if let KeySource::Query(key) = &r.key
            && key.eq_ignore_ascii_case(name)
        {
            return Err(ConfigError::invalid(
                at("forward_query"),
                format!("`{name}` is the key parameter; it is always sent, canonical"),
            ));
        }
    }
    let mut seen = std::collections::HashSet::new();
    for (field, names) in [
        (
            "forward_headers",
            r.forward_headers.iter().collect::<Vec<_>>(),
        ),
        ("upstream_headers", r.upstream_headers.keys().collect()),
    ] {
        for name in names {
            let lower = name.to_ascii_lowercase();
            if http::HeaderName::from_bytes(lower.as_bytes()).is_err() {
                return Err(ConfigError::invalid(
                    at(field),
                    format!("`{name}` is not a header name"),
                ));
            }
            if NOT_FORWARDABLE.contains(&lower.as_str()) {
                return Err(ConfigError::invalid(
                    at(field),
                    format!(
                        "`{name}` is a hop-by-hop or conditional header that bloomgate handles itself"
                    ),
                ));
            }
            if !seen.insert(lower) {
                return Err(ConfigError::invalid(
                    at(field),
                    format!(
                        "`{name}` is listed twice (forward_headers and upstream_headers included)"
                    ),
                ));
            }
        }
    }
    for (name, value) in &r.upstream_headers {
        if http::HeaderValue::from_str(value).is_err() {
            return Err(ConfigError::invalid(
                at("upstream_headers"),
                format!("the value of `{name}` is not a valid header value"),
            ));
        }
    }
    Ok(())
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

/// Log line format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    /// Readable lines for a terminal.
    Human,
    /// One JSON object per line, for log shippers.
    Json,
}

impl Config {
    /// Parses a TOML string, without environment overrides, and validates it.
    pub fn from_toml_str(toml: &str) -> Result<Config, ConfigError> {
        Self::extract(Figment::from(Toml::string(toml)))
    }

    /// Reads a TOML file, applies `BLOOMGATE__…` environment overrides, validates.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        if !path.exists() {
            return Err(ConfigError::Parse(format!(
                "config file {} does not exist",
                path.display()
            )));
        }
        let figment = Figment::from(Toml::file_exact(path)).merge(env_overrides());
        Self::extract(figment)
    }

    /// Builds a config from a TOML string and the environment overrides.
    pub fn from_toml_str_with_env(toml: &str) -> Result<Config, ConfigError> {
        Self::extract(Figment::from(Toml::string(toml)).merge(env_overrides()))
    }

    fn extract(figment: Figment) -> Result<Config, ConfigError> {
        let config: Config = figment
            .extract()
            .map_err(|e| ConfigError::Parse(describe_figment_error(e)))?;
        config.validate()?;
        Ok(config)
    }

    /// Checks the rules that serde cannot express. Errors name the field.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.server.max_body_bytes == 0 {
            return Err(ConfigError::invalid(
                "server.max_body_bytes",
                "must be greater than 0",
            ));
        }
        // hyper buffers at least 8 KiB of a request head, so a smaller bound cannot hold.
        if !(8192..=1024 * 1024).contains(&self.server.max_header_bytes) {
            return Err(ConfigError::invalid(
                "server.max_header_bytes",
                "must be between 8192 and 1048576",
            ));
        }
        // hyper answers targets over 65534 bytes with its own 414 before we see them.
        if self.server.max_uri_bytes < 256
            || self.server.max_uri_bytes > self.server.max_header_bytes
            || self.server.max_uri_bytes > 65534
        {
            return Err(ConfigError::invalid(
                "server.max_uri_bytes",
                "must be at least 256, at most 65534 and at most server.max_header_bytes",
            ));
        }
        for (field, list) in [
            ("server.trusted_proxies", &self.server.trusted_proxies),
            (
                "server.outcome_header_clients",
                &self.server.outcome_header_clients,
            ),
        ] {
            crate::client::Cidrs::parse(list)
                .map_err(|reason| ConfigError::invalid(field, reason))?;
        }
        if self.server.outcome_header == OutcomeHeaderPolicy::Trusted
            && self.server.outcome_header_clients.is_empty()
        {
            return Err(ConfigError::invalid(
                "server.outcome_header_clients",
                "outcome_header = \"trusted\" needs at least one address range here (or use \"never\")",
            ));
        }
        if self.server.header_read_timeout.is_zero() {
            return Err(ConfigError::invalid(
                "server.header_read_timeout",
                "must be greater than 0",
            ));
        }
        if let Some(token) = &self.admin.token
            && token.trim().len() < 8
        {
            return Err(ConfigError::invalid(
                "admin.token",
                "must be at least 8 characters (or left unset to disable mutating admin calls)",
            ));
        }
        if let Some(up) = &self.upstream {
            validate_upstream_url(&up.url)?;
            if up.timeout.is_zero() {
                return Err(ConfigError::invalid(
                    "upstream.timeout",
                    "must be greater than 0",
                ));
            }
        }
        if let Some(db) = &self.database {
            if !(db.url.starts_with("mysql:")
                || db.url.starts_with("mariadb:")
                || db.url.starts_with("sqlite:"))
            {
                return Err(ConfigError::invalid(
                    "database.url",
                    "scheme must be mysql://, mariadb:// or sqlite:",
                ));
            }
            if db.max_connections == 0 {
                return Err(ConfigError::invalid(
                    "database.max_connections",
                    "must be greater than 0",
                ));
            }
            if db.min_connections > db.max_connections {
                return Err(ConfigError::invalid(
                    "database.min_connections",
                    "must not exceed database.max_connections",
                ));
            }
            if db.acquire_timeout.is_zero() {
                return Err(ConfigError::invalid(
                    "database.acquire_timeout",
                    "must be greater than 0",
                ));
            }
        }
        let c = &self.cache;
        for (field, v) in [
            ("cache.max_entries", c.max_entries),
            ("cache.negative_max_entries", c.negative_max_entries),
        ] {
            if v == 0 {
                return Err(ConfigError::invalid(field, "must be greater than 0"));
            }
        }
        for (name, f) in &self.filters {
            let at = |field: &str| format!("filters.{name}.{field}");
            if !is_identifier(name) {
                return Err(ConfigError::invalid(
                    format!("filters.{name}"),
                    "filter names use letters, digits, '_' and '-' only",
                ));
            }
            if f.source_query.trim().is_empty() {
                return Err(ConfigError::invalid(
                    at("source_query"),
                    "must not be empty",
                ));
            }
            if self.database.is_none() {
                return Err(ConfigError::invalid(
                    "database",
                    format!("filter `{name}` loads from the database, but [database] is missing"),
                ));
            }
            // A gate that lets more than half of the absent keys through protects nothing,
            // and sizing a filter for a rate near 1 takes time that grows with the items.
            if f.false_positive_rate > 0.5 {
                return Err(ConfigError::invalid(
                    at("false_positive_rate"),
                    format!("{} is above 0.5", f.false_positive_rate),
                ));
            }
            crate::filter::BloomParams::optimal(f.expected_items, f.false_positive_rate).map_err(
                |e| {
                    let field = if f.expected_items == 0 {
                        "expected_items"
                    } else {
                        "false_positive_rate"
                    };
                    ConfigError::invalid(at(field), e.to_string())
                },
            )?;
            validate_normalize(&f.normalize, &at("normalize"))?;
            if !(f.capacity_warn_ratio > 0.0 && f.capacity_warn_ratio <= 1.0) {
                return Err(ConfigError::invalid(
                    at("capacity_warn_ratio"),
                    "must be in (0, 1]",
                ));
            }
            if f.rebuild_interval
                .is_some_and(|d| d < Duration::from_secs(1))
            {
                return Err(ConfigError::invalid(
                    at("rebuild_interval"),
                    "must be at least 1s",
                ));
            }
            if let Some(sync) = &f.sync {
                let marks = sync.query.matches('?').count();
                if marks != 1 {
                    return Err(ConfigError::invalid(
                        at("sync.query"),
                        format!(
                            "needs exactly one `?` placeholder for the watermark, found {marks}"
                        ),
                    ));
                }
                if sync.interval.is_zero() {
                    return Err(ConfigError::invalid(
                        at("sync.interval"),
                        "must be greater than 0",
                    ));
                }
                if sync.gap_timeout.is_zero() {
                    return Err(ConfigError::invalid(
                        at("sync.gap_timeout"),
                        "must be greater than 0",
                    ));
                }
                if sync.watermark == WatermarkKind::Integer && sync.start_query.is_none() {
                    return Err(ConfigError::invalid(
                        at("sync.start_query"),
                        "integer watermarks need a start query, e.g. SELECT MAX(id) FROM products",
                    ));
                }
            }
            if f.load_retry_initial.is_zero() || f.load_retry_max < f.load_retry_initial {
                return Err(ConfigError::invalid(
                    at("load_retry_max"),
                    "retry delays must be > 0 and load_retry_max >= load_retry_initial",
                ));
            }
        }
        let mut names = std::collections::HashSet::new();
        for (i, r) in self.routes.iter().enumerate() {
            let at = |field: &str| format!("routes[{i}].{field}");
            crate::proxy::route::PathPattern::parse(&r.path, &r.key, r.match_options())
                .map_err(|reason| ConfigError::invalid(at("path"), reason))?;
            validate_forwarding(r, &at)?;
            if !names.insert(r.label().to_owned()) {
                return Err(ConfigError::invalid(
                    at("name"),
                    format!("route name `{}` is used twice", r.label()),
                ));
            }
            let Some(filter) = self.filters.get(&r.filter) else {
                return Err(ConfigError::invalid(
                    at("filter"),
                    format!("no filter named `{}` in [filters]", r.filter),
                ));
            };
            if let Some(n) = &r.normalize
                && n != &filter.normalize
            {
                return Err(ConfigError::invalid(
                    at("normalize"),
                    format!(
                        "must match filters.{}.normalize, or the loader and the route would disagree on keys",
                        r.filter
                    ),
                ));
            }
            match &r.origin {
                OriginConfig::Sql { query, timeout } => {
                    if self.database.is_none() {
                        return Err(ConfigError::invalid(
                            "database",
                            "a route has an sql origin, but [database] is missing",
                        ));
                    }
                    let marks = query.matches('?').count();
                    if query.trim().is_empty() {
                        return Err(ConfigError::invalid(
                            at("origin.query"),
                            "must not be empty",
                        ));
                    }
                    if marks != 1 {
                        return Err(ConfigError::invalid(
                            at("origin.query"),
                            format!("needs exactly one `?` placeholder for the key, found {marks}"),
                        ));
                    }
                    if timeout.is_zero() {
                        return Err(ConfigError::invalid(
                            at("origin.timeout"),
                            "must be greater than 0",
                        ));
                    }
                }
                OriginConfig::Upstream { not_found_statuses } => {
                    if self.upstream.is_none() {
                        return Err(ConfigError::invalid(
                            "upstream",
                            "a route has an upstream origin, but [upstream] is missing",
                        ));
                    }
                    if let Some(bad) = not_found_statuses
                        .iter()
                        .find(|s| !(100..=599).contains(*s))
                    {
                        return Err(ConfigError::invalid(
                            at("origin.not_found_statuses"),
                            format!("{bad} is not an HTTP status"),
                        ));
                    }
                }
            }
            for (field, ttl) in [("ttl", r.ttl), ("negative_ttl", r.negative_ttl)] {
                if ttl.is_some_and(|t| t.is_zero()) {
                    return Err(ConfigError::invalid(at(field), "must be greater than 0"));
                }
            }
        }
        for (i, w) in self.write_through.iter().enumerate() {
            let at = |field: &str| format!("write_through[{i}].{field}");
            crate::proxy::route::PathPattern::parse_write(&w.path, &w.key)
                .map_err(|reason| ConfigError::invalid(at("path"), reason))?;
            if !self.filters.contains_key(&w.filter) {
                return Err(ConfigError::invalid(
                    at("filter"),
                    format!("no filter named `{}` in [filters]", w.filter),
                ));
            }
            if self.upstream.is_none() {
                return Err(ConfigError::invalid(
                    "upstream",
                    "write_through needs [upstream]: writes pass through to it",
                ));
            }
            if w.methods.is_empty() {
                return Err(ConfigError::invalid(at("methods"), "must not be empty"));
            }
            if let Some(bad) = w
                .methods
                .iter()
                .find(|m| http::Method::from_bytes(m.as_bytes()).is_err())
            {
                return Err(ConfigError::invalid(
                    at("methods"),
                    format!("`{bad}` is not an HTTP method"),
                ));
            }
            if let Some(bad) = w.statuses.iter().find(|s| !(100..=599).contains(*s)) {
                return Err(ConfigError::invalid(
                    at("statuses"),
                    format!("{bad} is not an HTTP status"),
                ));
            }
        }
        if let Some(b) = &self.false_positive_budget {
            if b.per_client == 0 {
                return Err(ConfigError::invalid(
                    "false_positive_budget.per_client",
                    "must be greater than 0 (leave the section out to turn the budget off)",
                ));
            }
            if b.window < Duration::from_secs(1) {
                return Err(ConfigError::invalid(
                    "false_positive_budget.window",
                    "must be at least 1s",
                ));
            }
            if !(64..=1 << 22).contains(&b.slots) {
                return Err(ConfigError::invalid(
                    "false_positive_budget.slots",
                    "must be between 64 and 4194304",
                ));
            }
        }
        if self.cache.ttl.is_zero() || self.cache.negative_ttl.is_zero() {
            return Err(ConfigError::invalid(
                "cache.negative_ttl",
                "cache.ttl and cache.negative_ttl must be greater than 0",
            ));
        }
        Ok(())
    }

    /// The normaliser in force for route `i` (its own, or its filter's).
    pub fn route_normalize(&self, route: &RouteConfig) -> Normalize {
        route.normalize.clone().unwrap_or_else(|| {
            self.filters
                .get(&route.filter)
                .map(|f| f.normalize.clone())
                .unwrap_or_default()
        })
    }
}

fn env_overrides() -> Env {
    Env::prefixed(ENV_PREFIX).split("__")
}

fn describe_figment_error(e: figment::Error) -> String {
    // figment keeps one error per problem; report them all, each with its key path.
    e.into_iter()
        .map(|one| {
            let path = one.path.join(".");
            let source = one
                .metadata
                .as_ref()
                .map(|m| m.name.to_string())
                .unwrap_or_default();
            if path.is_empty() {
                format!("invalid config: {} ({source})", one.kind)
            } else {
                format!("invalid config: `{path}`: {} ({source})", one.kind)
            }
        })
        .collect::<Vec<_>>()
        .join("; ")
}

fn validate_upstream_url(url: &str) -> Result<(), ConfigError> {
    let uri: http::Uri = url
        .parse()
        .map_err(|e| ConfigError::invalid("upstream.url", format!("not a URL: {e}")))?;
    if uri.scheme_str() != Some("http") {
        return Err(ConfigError::invalid(
            "upstream.url",
            "must start with http:// (terminate TLS in front of the upstream)",
        ));
    }
    if uri.authority().is_none() {
        return Err(ConfigError::invalid(
            "upstream.url",
            "needs a host and port",
        ));
    }
    if uri.path() != "/" && !uri.path().is_empty() {
        return Err(ConfigError::invalid(
            "upstream.url",
            "must not carry a path: requests keep their own path",
        ));
    }
    Ok(())
}

fn validate_normalize(n: &Normalize, field: &str) -> Result<(), ConfigError> {
    if let Normalize::String { max_len, .. } = n
        && (*max_len == 0 || *max_len > 4096)
    {
        return Err(ConfigError::invalid(
            format!("{field}.max_len"),
            "must be between 1 and 4096",
        ));
    }
    Ok(())
}

fn is_identifier(s: &str) -> bool {
    !s.is_empty()
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = r#"
        [server]
        listen = "127.0.0.1:0"
        [upstream]
        url = "http://127.0.0.1:3000"
        [database]
        url = "sqlite://data/x.db"
        [filters.products]
        source_query = "SELECT sku_id FROM products"
        expected_items = 1000
        [[routes]]
        path = "/api/products/{id}"
        key = { segment = "id" }
        filter = "products"
        origin = { kind = "sql", query = "SELECT * FROM products WHERE sku_id = ?" }
    "#;

    fn err(toml: &str) -> String {
        match Config::from_toml_str(toml) {
            Ok(_) => panic!("config was accepted:\n{toml}"),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn good_config_gets_defaults() {
        let c = Config::from_toml_str(GOOD).expect("valid");
        assert_eq!(c.cache.negative_ttl, Duration::from_secs(300));
        assert_eq!(c.filters["products"].false_positive_rate, 0.01);
        assert_eq!(c.route_normalize(&c.routes[0]), Normalize::Integer);
        assert_eq!(c.routes[0].label(), "/api/products/{id}");
        assert_eq!(c.admin.listen.port(), 9090);
    }

    #[test]
    fn unknown_field_is_named() {
        let e = err(&GOOD.replace("[server]", "[server]\nlisten_port = 3"));
        assert!(e.contains("listen_port"), "{e}");
    }

    #[test]
    fn bad_duration_is_named() {
        let e = err(&format!("{GOOD}\n[cache]\nttl = \"five minutes\"\n"));
        assert!(e.contains("cache.ttl"), "{e}");
    }

    #[test]
    fn missing_lookup_query_is_named() {
        let e = err(&GOOD.replace(
            r#"origin = { kind = "sql", query = "SELECT * FROM products WHERE sku_id = ?" }"#,
            r#"origin = { kind = "sql" }"#,
        ));
        assert!(e.contains("routes.0.origin") && e.contains("query"), "{e}");
    }

    #[test]
    fn lookup_query_needs_one_placeholder() {
        let e = err(&GOOD.replace("sku_id = ?", "sku_id = 1"));
        assert!(e.contains("routes[0].origin.query"), "{e}");
    }

    #[test]
    fn unknown_filter_and_bad_rate_are_named() {
        let e = err(&GOOD.replace("filter = \"products\"", "filter = \"nope\""));
        assert!(e.contains("routes[0].filter"), "{e}");
        let e = err(&GOOD.replace(
            "expected_items = 1000",
            "expected_items = 1000\nfalse_positive_rate = 1.5",
        ));
        assert!(e.contains("filters.products.false_positive_rate"), "{e}");
    }

    #[test]
    fn rates_near_one_are_refused_before_sizing() {
        // Sizing a filter for a rate near 1 used to take minutes at this size.
        let e = err(&GOOD.replace(
            "expected_items = 1000",
            "expected_items = 10000000000\nfalse_positive_rate = 0.99999999",
        ));
        assert!(e.contains("filters.products.false_positive_rate"), "{e}");
        assert!(e.contains("above 0.5"), "{e}");
    }

    #[test]
    fn path_must_name_the_segment() {
        let e = err(&GOOD.replace("{ segment = \"id\" }", "{ segment = \"sku\" }"));
        assert!(e.contains("routes[0].path"), "{e}");
    }

    #[test]
    fn head_and_target_limits_are_bounded() {
        let with = |fields: &str| GOOD.replace("[server]", &format!("[server]\n{fields}"));
        let e = err(&with("max_header_bytes = 4096"));
        assert!(e.contains("server.max_header_bytes"), "{e}");
        let e = err(&with("max_uri_bytes = 20000"));
        assert!(e.contains("server.max_uri_bytes"), "{e}");
        // Beyond what hyper itself lets through, even with a large head limit.
        let e = err(&with("max_header_bytes = 131072\nmax_uri_bytes = 65535"));
        assert!(e.contains("server.max_uri_bytes"), "{e}");
        let c = Config::from_toml_str(&with("max_header_bytes = 131072\nmax_uri_bytes = 65534"))
            .expect("valid");
        assert_eq!(c.server.max_uri_bytes, 65534);
        let e = err(&with("trusted_proxies = [\"10.0.0.0/33\"]"));
        assert!(e.contains("server.trusted_proxies"), "{e}");
    }

    #[test]
    fn upstream_url_is_checked() {
        let e = err(&GOOD.replace("http://127.0.0.1:3000", "https://example.test"));
        assert!(e.contains("upstream.url"), "{e}");
    }

    #[test]
    fn sync_defaults_and_gap_timeout() {
        let sync = "\n[filters.products.sync]\nquery = \"SELECT sku_id, id FROM products WHERE id >= ?\"\nwatermark = \"integer\"\nstart_query = \"SELECT MAX(id) FROM products\"\n";
        let c = Config::from_toml_str(&format!("{GOOD}{sync}")).expect("valid");
        let s = c.filters["products"].sync.as_ref().expect("sync");
        assert_eq!(s.overlap_ids, 1000);
        assert_eq!(s.gap_timeout, Duration::from_secs(120));
        let c =
            Config::from_toml_str(&format!("{GOOD}{sync}gap_timeout = \"1s\"\n")).expect("valid");
        let s = c.filters["products"].sync.as_ref().expect("sync");
        assert_eq!(s.gap_timeout, Duration::from_secs(1));
        let e = err(&format!("{GOOD}{sync}gap_timeout = \"0s\"\n"));
        assert!(e.contains("filters.products.sync.gap_timeout"), "{e}");
    }

    #[test]
    fn string_normaliser_parses() {
        let toml = GOOD.replace(
            "expected_items = 1000",
            "expected_items = 1000\nnormalize = { kind = \"string\", lowercase = true, max_len = 32 }",
        );
        let c = Config::from_toml_str(&toml).expect("valid");
        assert_eq!(
            c.filters["products"].normalize,
            Normalize::String {
                lowercase: true,
                max_len: 32
            }
        );
    }
}
