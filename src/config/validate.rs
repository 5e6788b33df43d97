//! The rules of a config that serde cannot express: every field's bounds and the
//! references between sections. Errors name the field.

use std::time::Duration;

use super::{
    Config, ConfigError, KeySource, Normalize, OriginConfig, OutcomeHeaderPolicy, RouteConfig,
    WatermarkKind,
};

impl Config {
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
            crate::pipeline::client::Cidrs::parse(list)
                .map_err(|e| ConfigError::invalid(field, e.to_string()))?;
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
            crate::pipeline::route::PathPattern::parse(
                &r.path,
                &r.key,
                crate::pipeline::route::MatchOptions::of(r),
            )
            .map_err(|e| ConfigError::invalid(at("path"), e.to_string()))?;
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
            crate::pipeline::route::PathPattern::parse_write(&w.path, &w.key)
                .map_err(|e| ConfigError::invalid(at("path"), e.to_string()))?;
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
