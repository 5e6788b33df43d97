//! `[[routes]]` and `[[write_through]]`: guarded routes, the origin behind each, and
//! the writes that add a key at once.

use std::collections::BTreeMap;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::Normalize;

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
