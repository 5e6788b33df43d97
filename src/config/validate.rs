//! The rules of a config that serde cannot express: every field's bounds and the
//! references between sections. Every broken rule is reported, each naming its field by
//! its TOML path; a rule that depends on another field is skipped while that field is
//! itself refused, so one mistake is one problem.

use std::collections::HashSet;
use std::fmt::Display;
use std::time::Duration;

use super::{
    Config, ConfigError, FilterConfig, KeySource, Normalize, OriginConfig, OutcomeHeaderPolicy,
    Problem, RouteConfig, WatermarkKind, WriteThroughConfig,
};
use crate::filter::BloomParams;
use crate::pipeline::client::Cidrs;
use crate::pipeline::route::{MatchOptions, PathPattern};

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
    /// Checks the rules that serde cannot express. The error lists every broken rule,
    /// each naming its field.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let mut p = Problems::default();
        self.check_server(&mut p);
        if let Some(token) = &self.admin.token
            && token.trim().len() < 8
        {
            p.add(
                "admin.token",
                "must be at least 8 characters (or left unset to disable mutating admin calls)",
            );
        }
        self.check_backends(&mut p);
        self.check_cache(&mut p);
        for (name, f) in &self.filters {
            check_filter(name, f, &mut p);
        }
        let mut labels = HashSet::new();
        for (i, r) in self.routes.iter().enumerate() {
            self.check_route(i, r, &mut labels, &mut p);
        }
        for (i, w) in self.write_through.iter().enumerate() {
            self.check_write_through(i, w, &mut p);
        }
        self.check_budget(&mut p);
        p.into_result()
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

    fn check_server(&self, p: &mut Problems) {
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
        for (field, list) in [
            ("server.trusted_proxies", &s.trusted_proxies),
            ("server.outcome_header_clients", &s.outcome_header_clients),
        ] {
            p.check(field, Cidrs::parse(list));
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
    }

    /// `[upstream]` and `[database]`, and the sections that need them: a missing one is
    /// one problem, naming every field that uses it.
    fn check_backends(&self, p: &mut Problems) {
        if let Some(up) = &self.upstream {
            p.check("upstream.url", check_upstream_url(&up.url));
            if up.timeout.is_zero() {
                p.add("upstream.timeout", "must be greater than 0");
            }
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

    fn check_cache(&self, p: &mut Problems) {
        let c = &self.cache;
        for (field, v) in [
            ("cache.max_entries", c.max_entries),
            ("cache.negative_max_entries", c.negative_max_entries),
        ] {
            if v == 0 {
                p.add(field, "must be greater than 0");
            }
        }
        for (field, ttl) in [("cache.ttl", c.ttl), ("cache.negative_ttl", c.negative_ttl)] {
            if ttl.is_zero() {
                p.add(field, "must be greater than 0");
            }
        }
    }

    fn check_route(
        &self,
        i: usize,
        r: &RouteConfig,
        labels: &mut HashSet<String>,
        p: &mut Problems,
    ) {
        let at = |field: &str| format!("routes[{i}].{field}");
        p.check(
            at("path"),
            PathPattern::parse(&r.path, &r.key, MatchOptions::of(r)),
        );
        check_forwarding(r, &at, p);
        if !labels.insert(r.label().to_owned()) {
            p.add(
                at("name"),
                format!("route name `{}` is used twice", r.label()),
            );
        }
        match self.filters.get(&r.filter) {
            None => p.add(
                at("filter"),
                format!("no filter named `{}` in [filters]", r.filter),
            ),
            Some(filter) => {
                if let Some(n) = &r.normalize
                    && n != &filter.normalize
                {
                    p.add(
                        at("normalize"),
                        format!(
                            "must match filters.{}.normalize, or the loader and the route would disagree on keys",
                            r.filter
                        ),
                    );
                }
            }
        }
        match &r.origin {
            OriginConfig::Sql { query, timeout } => {
                let marks = query.matches('?').count();
                if query.trim().is_empty() {
                    p.add(at("origin.query"), "must not be empty");
                } else if marks != 1 {
                    p.add(
                        at("origin.query"),
                        format!("needs exactly one `?` placeholder for the key, found {marks}"),
                    );
                }
                if timeout.is_zero() {
                    p.add(at("origin.timeout"), "must be greater than 0");
                }
            }
            OriginConfig::Upstream { not_found_statuses } => {
                for bad in not_found_statuses
                    .iter()
                    .filter(|s| !(100..=599).contains(*s))
                {
                    p.add(
                        at("origin.not_found_statuses"),
                        format!("{bad} is not an HTTP status"),
                    );
                }
            }
        }
        for (field, ttl) in [("ttl", r.ttl), ("negative_ttl", r.negative_ttl)] {
            if ttl.is_some_and(|t| t.is_zero()) {
                p.add(at(field), "must be greater than 0");
            }
        }
    }

    fn check_write_through(&self, i: usize, w: &WriteThroughConfig, p: &mut Problems) {
        let at = |field: &str| format!("write_through[{i}].{field}");
        p.check(at("path"), PathPattern::parse_write(&w.path, &w.key));
        if !self.filters.contains_key(&w.filter) {
            p.add(
                at("filter"),
                format!("no filter named `{}` in [filters]", w.filter),
            );
        }
        if w.methods.is_empty() {
            p.add(at("methods"), "must not be empty");
        }
        for bad in w
            .methods
            .iter()
            .filter(|m| http::Method::from_bytes(m.as_bytes()).is_err())
        {
            p.add(at("methods"), format!("`{bad}` is not an HTTP method"));
        }
        for bad in w.statuses.iter().filter(|s| !(100..=599).contains(*s)) {
            p.add(at("statuses"), format!("{bad} is not an HTTP status"));
        }
    }

    fn check_budget(&self, p: &mut Problems) {
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

fn check_filter(name: &str, f: &FilterConfig, p: &mut Problems) {
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
    let items_ok = f.expected_items > 0;
    if !items_ok {
        p.add(at("expected_items"), "must be at least 1");
    }
    // A gate that lets more than half of the absent keys through protects nothing, and
    // sizing a filter for a rate near 1 takes time that grows with the items.
    let rate = f.false_positive_rate;
    let rate_ok = rate > 0.0 && rate <= 0.5;
    if rate > 0.5 {
        p.add(at("false_positive_rate"), format!("{rate} is above 0.5"));
    } else if !rate_ok {
        p.add(
            at("false_positive_rate"),
            format!("must be greater than 0, got {rate}"),
        );
    }
    if items_ok && rate_ok {
        p.check(
            at("false_positive_rate"),
            BloomParams::optimal(f.expected_items, rate),
        );
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
        let marks = sync.query.matches('?').count();
        if marks != 1 {
            p.add(
                at("sync.query"),
                format!("needs exactly one `?` placeholder for the watermark, found {marks}"),
            );
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
    if f.load_retry_initial.is_zero() {
        p.add(at("load_retry_initial"), "must be greater than 0");
    } else if f.load_retry_max < f.load_retry_initial {
        p.add(at("load_retry_max"), "must be at least load_retry_initial");
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

fn check_forwarding(r: &RouteConfig, at: &dyn Fn(&str) -> String, p: &mut Problems) {
    let upstream = matches!(r.origin, OriginConfig::Upstream { .. });
    if !upstream
        && (!r.forward_query.is_empty()
            || !r.forward_headers.is_empty()
            || !r.upstream_headers.is_empty())
    {
        p.add(
            at("forward_query"),
            "forward_query, forward_headers and upstream_headers apply to upstream origins only",
        );
        return;
    }
    let mut seen = HashSet::new();
    for name in &r.forward_query {
        if name.is_empty() || !seen.insert(name.to_ascii_lowercase()) {
            p.add(
                at("forward_query"),
                format!("`{name}` is empty or listed twice (names match in any case)"),
            );
        } else if let KeySource::Query(key) = &r.key
            && key.eq_ignore_ascii_case(name)
        {
            p.add(
                at("forward_query"),
                format!("`{name}` is the key parameter; it is always sent, canonical"),
            );
        }
    }
    let mut seen = HashSet::new();
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
                p.add(at(field), format!("`{name}` is not a header name"));
            } else if NOT_FORWARDABLE.contains(&lower.as_str()) {
                p.add(
                    at(field),
                    format!(
                        "`{name}` is a hop-by-hop or conditional header that bloomgate handles itself"
                    ),
                );
            } else if !seen.insert(lower) {
                p.add(
                    at(field),
                    format!(
                        "`{name}` is listed twice (forward_headers and upstream_headers included)"
                    ),
                );
            }
        }
    }
    for (name, value) in &r.upstream_headers {
        if http::HeaderValue::from_str(value).is_err() {
            p.add(
                at("upstream_headers"),
                format!("the value of `{name}` is not a valid header value"),
            );
        }
    }
}

fn check_upstream_url(url: &str) -> Result<(), String> {
    let uri: http::Uri = url.parse().map_err(|e| format!("not a URL: {e}"))?;
    if uri.scheme_str() != Some("http") {
        return Err("must start with http:// (terminate TLS in front of the upstream)".into());
    }
    if uri.authority().is_none() {
        return Err("needs a host and port".into());
    }
    if uri.path() != "/" && !uri.path().is_empty() {
        return Err("must not carry a path: requests keep their own path".into());
    }
    Ok(())
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
