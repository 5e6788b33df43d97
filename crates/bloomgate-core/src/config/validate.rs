//! The rules of a config that serde cannot express, for the values the runtime takes as
//! they are: bounds of limits, timeouts and sizes, and which sections need which. Values
//! that become something else (patterns, address ranges, filter sizes, header names) are
//! checked where they are made, in `compile`, which also runs these rules. Every broken
//! rule is reported, each naming its field by its TOML path; a rule that depends on
//! another field is skipped while that field is itself refused, so one mistake is one
//! problem.

use std::fmt::Display;
use std::time::Duration;

use super::{
    Backend, BreakerConfig, Config, ConfigError, FilterConfig, Normalize, OriginConfig,
    OutcomeHeaderPolicy, Problem, RouteConfig, SyncConfig, WatermarkKind,
};

/// Smallest byte bound of a cache: a few hundred entries.
const MIN_CACHE_BYTES: u64 = 64 * 1024;

/// Most serving threads `server.workers` may ask for.
const MAX_WORKERS: usize = 1024;

/// The problems found so far in one config.
#[derive(Debug, Default)]
pub(super) struct Problems(Vec<Problem>);

impl Problems {
    /// Records that `field` breaks a rule.
    pub(super) fn add(&mut self, field: impl Into<String>, reason: impl Display) {
        self.0.push(Problem {
            field: field.into(),
            reason: reason.to_string(),
        });
    }

    /// Keeps the value of a check that passed; records the reason of one that failed.
    pub(super) fn check<T, E: Display>(
        &mut self,
        field: impl Into<String>,
        result: Result<T, E>,
    ) -> Option<T> {
        result.map_err(|reason| self.add(field, reason)).ok()
    }

    /// How many problems were found so far.
    pub(super) fn len(&self) -> usize {
        self.0.len()
    }

    /// `Ok` when no rule was broken, else every problem.
    pub(super) fn into_result(self) -> Result<(), ConfigError> {
        if self.0.is_empty() {
            Ok(())
        } else {
            Err(ConfigError::Invalid(self.0))
        }
    }
}

impl Config {
    /// Checks every rule, those of `compile` included. The error lists every broken
    /// rule, each naming its field.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.compile().map(|_| ())
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

    pub(super) fn check_server(&self, p: &mut Problems) {
        if let Some(a) = &self.access_log
            && !(a.sample > 0.0 && a.sample <= 1.0)
        {
            p.add("access_log.sample", "must be greater than 0 and at most 1");
        }
        let s = &self.server;
        if s.max_body_bytes == 0 {
            p.add("server.max_body_bytes", "must be greater than 0");
        }
        // hyper buffers at least 8 KiB of a request head, so a smaller bound cannot hold.
        let head_ok = (8192..=1024 * 1024).contains(&s.max_header_bytes);
        if !head_ok {
            p.add(
                "server.max_header_bytes",
                "must be between 8192 and 1048576",
            );
        }
        // hyper answers targets over 65534 bytes with its own 414 before we see them. The
        // head limit is compared only when it is valid itself.
        if s.max_uri_bytes < 256
            || s.max_uri_bytes > 65534
            || (head_ok && s.max_uri_bytes > s.max_header_bytes)
        {
            p.add(
                "server.max_uri_bytes",
                "must be at least 256, at most 65534 and at most server.max_header_bytes",
            );
        }
        if s.outcome_header == OutcomeHeaderPolicy::Trusted && s.outcome_header_clients.is_empty() {
            p.add(
                "server.outcome_header_clients",
                "outcome_header = \"trusted\" needs at least one address range here (or use \"never\")",
            );
        }
        if s.header_read_timeout.is_zero() {
            p.add("server.header_read_timeout", "must be greater than 0");
        }
        self.check_connection_bounds(p);
    }

    /// `server.max_connections`, `server.http2_max_concurrent_streams` and
    /// `server.workers`. (The files of
    /// `[server.tls]` are read in `compile`.)
    fn check_connection_bounds(&self, p: &mut Problems) {
        let s = &self.server;
        if !(1..=1_000_000).contains(&s.max_connections) {
            p.add("server.max_connections", "must be between 1 and 1000000");
        }
        if !(1..=10_000).contains(&s.http2_max_concurrent_streams) {
            p.add(
                "server.http2_max_concurrent_streams",
                "must be between 1 and 10000",
            );
        }
        if s.workers > MAX_WORKERS {
            p.add(
                "server.workers",
                format!("must be at most {MAX_WORKERS} (0 is one per CPU core)"),
            );
        }
    }

    /// `admin.token`, or `admin.token_file` read: the token in force, or `None` with a
    /// problem when the file cannot give one.
    pub(super) fn check_admin(&self, p: &mut Problems) -> Option<String> {
        let (field, token) = match (&self.admin.token, &self.admin.token_file) {
            (Some(_), Some(_)) => {
                p.add(
                    "admin.token_file",
                    "set admin.token or admin.token_file, not both",
                );
                return None;
            }
            (Some(token), None) => ("admin.token", token.clone()),
            (None, Some(path)) => match read_token_file(path) {
                Ok(token) => ("admin.token_file", token),
                Err(reason) => {
                    p.add("admin.token_file", reason);
                    return None;
                }
            },
            (None, None) => return None,
        };
        if token.trim().len() < 8 {
            p.add(
                field,
                "must be at least 8 characters (or left unset to disable mutating admin calls)",
            );
            return None;
        }
        Some(token)
    }

    /// `[upstream]` and `[database]`, and the sections that need them: a missing one is
    /// one problem, naming every field that uses it. (`upstream.url` is read in `compile`.)
    pub(super) fn check_backends(&self, p: &mut Problems) {
        if let Some(up) = &self.upstream {
            if up.timeout.is_zero() {
                p.add("upstream.timeout", "must be greater than 0");
            }
            check_limits(p, "upstream", up.max_in_flight, &up.breaker);
        } else {
            let users: Vec<String> = self
                .routes
                .iter()
                .enumerate()
                .filter(|(_, r)| matches!(r.origin, OriginConfig::Upstream { .. }))
                .map(|(i, _)| format!("routes[{i}].origin"))
                .chain((0..self.write_through.len()).map(|i| format!("write_through[{i}]")))
                .collect();
            if !users.is_empty() {
                p.add(
                    "upstream",
                    format!(
                        "[upstream] is missing, but {} send requests to it",
                        and_list(&users)
                    ),
                );
            }
        }
        if let Some(db) = &self.database {
            if !(db.url.starts_with("mysql:")
                || db.url.starts_with("mariadb:")
                || db.url.starts_with("sqlite:"))
            {
                p.add(
                    "database.url",
                    "scheme must be mysql://, mariadb:// or sqlite:",
                );
            }
            if db.max_connections == 0 {
                p.add("database.max_connections", "must be greater than 0");
            } else if db.min_connections > db.max_connections {
                p.add(
                    "database.min_connections",
                    "must not exceed database.max_connections",
                );
            }
            if db.acquire_timeout.is_zero() {
                p.add("database.acquire_timeout", "must be greater than 0");
            }
            check_limits(p, "database", db.max_in_flight, &db.breaker);
        } else {
            let users: Vec<String> = self
                .filters
                .keys()
                .map(|name| format!("filters.{name}"))
                .chain(
                    self.routes
                        .iter()
                        .enumerate()
                        .filter(|(_, r)| matches!(r.origin, OriginConfig::Sql { .. }))
                        .map(|(i, _)| format!("routes[{i}].origin")),
                )
                .collect();
            if !users.is_empty() {
                p.add(
                    "database",
                    format!(
                        "[database] is missing, but {} read from it",
                        and_list(&users)
                    ),
                );
            }
        }
    }

    pub(super) fn check_cache(&self, p: &mut Problems) {
        let c = &self.cache;
        for (field, v) in [
            ("cache.max_entries", c.max_entries),
            ("cache.negative_max_entries", c.negative_max_entries),
        ] {
            if v == Some(0) {
                p.add(field, "must be greater than 0");
            }
        }
        for (field, v) in [
            ("cache.max_bytes", c.max_bytes),
            ("cache.negative_max_bytes", c.negative_max_bytes),
        ] {
            if v.is_some_and(|b| b < MIN_CACHE_BYTES) {
                p.add(
                    field,
                    format!("must be at least {MIN_CACHE_BYTES} (64 KiB), or left unset"),
                );
            }
        }
        for (field, ttl) in [("cache.ttl", c.ttl), ("cache.negative_ttl", c.negative_ttl)] {
            if ttl.is_zero() {
                p.add(field, "must be greater than 0");
            }
        }
    }

    pub(super) fn check_budget(&self, p: &mut Problems) {
        let Some(b) = &self.false_positive_budget else {
            return;
        };
        if b.per_client == 0 {
            p.add(
                "false_positive_budget.per_client",
                "must be greater than 0 (leave the section out to turn the budget off)",
            );
        }
        if b.window < Duration::from_secs(1) {
            p.add("false_positive_budget.window", "must be at least 1s");
        }
        if !(64..=1 << 22).contains(&b.slots) {
            p.add(
                "false_positive_budget.slots",
                "must be between 64 and 4194304",
            );
        }
    }
}

impl Config {
    /// Records every rule the `[audit]` settings break. Checked whether or not the audit
    /// is enabled, so that turning it on never meets a value that was refused later.
    pub(super) fn check_audit(&self, p: &mut Problems) {
        let a = &self.audit;
        if !(0.0..=1.0).contains(&a.rate) {
            p.add(
                "audit.rate",
                "must be between 0 and 1 (0.001 checks one refusal in a thousand)",
            );
        }
        if !(1..=10_000).contains(&a.max_per_second) {
            p.add("audit.max_per_second", "must be between 1 and 10000");
        }
        if !(1..=65_536).contains(&a.queue) {
            p.add("audit.queue", "must be between 1 and 65536");
        }
    }

    pub(super) fn check_fleet(&self, p: &mut Problems) {
        let Some(f) = &self.fleet else {
            for (name, filter) in &self.filters {
                if filter.backend == Backend::Redis {
                    p.add(
                        format!("filters.{name}.backend"),
                        "\"redis\" needs [fleet]: the filter is held in the fleet's Redis",
                    );
                }
            }
            return;
        };
        let target = super::RedisTarget::parse(&f.redis_url);
        match &target {
            Err(why) => p.add("fleet.redis_url", why),
            Ok(super::RedisTarget::Single(url)) => {
                if redis::IntoConnectionInfo::into_connection_info(url.as_str()).is_err() {
                    p.add("fleet.redis_url", "is not a valid Redis URL");
                }
            }
            Ok(super::RedisTarget::Cluster(nodes)) => {
                if nodes
                    .iter()
                    .any(|n| redis::IntoConnectionInfo::into_connection_info(n.as_str()).is_err())
                {
                    p.add(
                        "fleet.redis_url",
                        "names a node that is not a valid Redis address",
                    );
                }
            }
            Ok(super::RedisTarget::Sentinel { .. }) => {}
        }
        let tls = target.as_ref().is_ok_and(super::RedisTarget::tls);
        for (field, file) in [
            ("fleet.tls_ca_file", &f.tls_ca_file),
            ("fleet.tls_cert_file", &f.tls_cert_file),
            ("fleet.tls_key_file", &f.tls_key_file),
        ] {
            if file.is_some() && !tls {
                p.add(field, "applies to rediss:// only: the URL does not use TLS");
            }
        }
        if f.tls_cert_file.is_some() != f.tls_key_file.is_some() {
            p.add(
                "fleet.tls_cert_file",
                "and fleet.tls_key_file go together: give both or neither",
            );
        }
        if f.sentinel_password.is_some()
            && !matches!(target, Ok(super::RedisTarget::Sentinel { .. }))
        {
            p.add(
                "fleet.sentinel_password",
                "applies to redis+sentinel:// only",
            );
        }
        if !is_identifier(&f.namespace) || f.namespace.len() > 64 {
            p.add(
                "fleet.namespace",
                "use 1 to 64 letters, digits, '_' and '-'",
            );
        }
        if let Some(id) = &f.instance_id
            && (!is_identifier(id) || id.len() > 128)
        {
            p.add(
                "fleet.instance_id",
                "use 1 to 128 letters, digits, '_' and '-'",
            );
        }
        if f.lease_ttl < Duration::from_secs(1) {
            p.add("fleet.lease_ttl", "must be at least 1s");
        } else if f.lease_renew.is_zero() || f.lease_renew * 2 > f.lease_ttl {
            p.add(
                "fleet.lease_renew",
                "must be greater than 0 and at most half of fleet.lease_ttl",
            );
        }
        for (field, d) in [
            ("fleet.retry_interval", f.retry_interval),
            ("fleet.command_timeout", f.command_timeout),
        ] {
            if d < Duration::from_millis(10) {
                p.add(field, "must be at least 10ms");
            }
        }
        if f.generation_grace < Duration::from_secs(1) {
            p.add("fleet.generation_grace", "must be at least 1s");
        }
        if !(4096..=512 << 20).contains(&f.chunk_bytes) {
            p.add("fleet.chunk_bytes", "must be between 4096 and 536870912");
        }
        if f.stream_max_entries < 100 {
            p.add("fleet.stream_max_entries", "must be at least 100");
        }
        if self.fleet.is_some() && self.database.is_none() {
            p.add(
                "fleet",
                "needs [database]: the builder scans and syncs the filters from it",
            );
        }
    }
}

/// The rules of one filter; its size is checked where it is computed, in `compile`.
pub(super) fn check_filter(name: &str, f: &FilterConfig, p: &mut Problems) {
    let at = |field: &str| format!("filters.{name}.{field}");
    if !is_identifier(name) {
        p.add(
            format!("filters.{name}"),
            "filter names use letters, digits, '_' and '-' only",
        );
    }
    if f.source_query.trim().is_empty() {
        p.add(at("source_query"), "must not be empty");
    }
    if let Normalize::String { max_len, .. } = f.normalize
        && (max_len == 0 || max_len > 4096)
    {
        p.add(at("normalize.max_len"), "must be between 1 and 4096");
    }
    if !(f.capacity_warn_ratio > 0.0 && f.capacity_warn_ratio <= 1.0) {
        p.add(at("capacity_warn_ratio"), "must be in (0, 1]");
    }
    if f.rebuild_interval
        .is_some_and(|d| d < Duration::from_secs(1))
    {
        p.add(at("rebuild_interval"), "must be at least 1s");
    }
    if let Some(sync) = &f.sync {
        check_sync(sync, &at, p);
    }
    if f.backend != Backend::Redis && !f.redis.local_copy {
        p.add(
            at("redis.local_copy"),
            "false needs backend = \"redis\": without the copy in Redis nothing would gate",
        );
    }
    if f.backend == Backend::Redis {
        let timeout = f.redis.check_timeout;
        if timeout < Duration::from_millis(1) || timeout > Duration::from_secs(1) {
            p.add(at("redis.check_timeout"), "must be between 1ms and 1s");
        }
        let shard = f.redis.shard_bytes;
        if !(64..=super::filters::MAX_SHARD_BYTES).contains(&shard) || !shard.is_multiple_of(64) {
            p.add(
                at("redis.shard_bytes"),
                "must be a multiple of 64 between 64 and 536870912",
            );
        }
    }
    if f.load_retry_initial.is_zero() {
        p.add(at("load_retry_initial"), "must be greater than 0");
    } else if f.load_retry_max < f.load_retry_initial {
        p.add(at("load_retry_max"), "must be at least load_retry_initial");
    }
}

/// `a`, `a and b`, `a, b and c`.
fn and_list(items: &[String]) -> String {
    match items {
        [] => String::new(),
        [one] => one.clone(),
        [rest @ .., last] => format!("{} and {last}", rest.join(", ")),
    }
}

fn is_identifier(s: &str) -> bool {
    !s.is_empty()
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

#[cfg(test)]
mod tests;

/// The rules of a filter's `[sync]`: a poll query for the polling watermarks, none for
/// binlog mode, and each mode's own settings in range.
fn check_sync(sync: &SyncConfig, at: &dyn Fn(&str) -> String, p: &mut Problems) {
    if sync.watermark == WatermarkKind::Binlog {
        for (field, set) in [
            ("sync.query", sync.query.is_some()),
            ("sync.start_query", sync.start_query.is_some()),
        ] {
            if set {
                p.add(
                    at(field),
                    "binlog mode reads the binary log, not a query: leave it out",
                );
            }
        }
        let b = &sync.binlog;
        if b.server_id == Some(0) {
            p.add(at("sync.binlog.server_id"), "must be greater than 0");
        }
        if b.heartbeat < Duration::from_millis(100) || b.heartbeat > Duration::from_secs(60) {
            p.add(at("sync.binlog.heartbeat"), "must be between 100ms and 60s");
        }
        if !(b.effective_rate_rebuild > 1.0 && b.effective_rate_rebuild <= 100.0) {
            p.add(
                at("sync.binlog.effective_rate_rebuild"),
                "must be greater than 1 and at most 100 (a multiple of false_positive_rate)",
            );
        }
        return;
    }
    match &sync.query {
        None => p.add(
            at("sync.query"),
            "required: the poll query (or watermark = \"binlog\" to read the binary log)",
        ),
        Some(query) => {
            let marks = query.matches('?').count();
            if marks != 1 {
                p.add(
                    at("sync.query"),
                    format!("needs exactly one `?` placeholder for the watermark, found {marks}"),
                );
            }
        }
    }
    if sync.interval.is_zero() {
        p.add(at("sync.interval"), "must be greater than 0");
    }
    if sync.gap_timeout.is_zero() {
        p.add(at("sync.gap_timeout"), "must be greater than 0");
    }
    if sync.watermark == WatermarkKind::Integer && sync.start_query.is_none() {
        p.add(
            at("sync.start_query"),
            "integer watermarks need a start query, e.g. SELECT MAX(id) FROM products",
        );
    }
}

/// The concurrency bound and the breaker of origin `section`.
fn check_limits(p: &mut Problems, section: &str, max_in_flight: Option<usize>, b: &BreakerConfig) {
    if max_in_flight == Some(0) {
        p.add(format!("{section}.max_in_flight"), "must be greater than 0");
    }
    if !b.enabled {
        return;
    }
    let field = |name: &str| format!("{section}.breaker.{name}");
    if b.consecutive_failures == 0 {
        p.add(field("consecutive_failures"), "must be greater than 0");
    }
    if !(b.failure_ratio > 0.0 && b.failure_ratio <= 1.0) {
        p.add(
            field("failure_ratio"),
            "must be greater than 0 and at most 1",
        );
    }
    if b.min_calls == 0 {
        p.add(field("min_calls"), "must be greater than 0");
    }
    if b.window < Duration::from_millis(10) {
        p.add(field("window"), "must be at least 10ms");
    }
    if b.open_for.is_zero() {
        p.add(field("open_for"), "must be greater than 0");
    }
}

/// The token held in `path`, its trailing line break dropped; the reason it cannot be
/// one otherwise (the path is named, the file's content never is).
fn read_token_file(path: &std::path::Path) -> Result<String, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    let token = text.trim_end_matches(['\n', '\r']);
    if token.is_empty() {
        return Err(format!("{} is empty", path.display()));
    }
    if token.contains(['\n', '\r']) {
        return Err(format!("{} holds more than one line", path.display()));
    }
    Ok(token.to_owned())
}
