//! The common test config, built in steps: one `products` filter over the demo table, the
//! routes a test needs, and whatever else it sets, so a test states only what differs.
//!
//! It depends on nothing else in `support`, so tests and benches that do not boot a
//! proxy (tests/alloc.rs, benches/pipeline.rs) include this file alone with `#[path]`.
//!
//! ```ignore
//! let toml = TestConfig::new(&db.url)
//!     .admin_token("test-admin-token")
//!     .cache("negative_ttl = \"10m\"")
//!     .route(TestRoute::sql("products", "/api/products/{id}"))
//!     .toml();
//! ```

use std::path::Path;

/// The lookup that SQL routes run unless told otherwise.
pub const LOOKUP: &str = "SELECT sku_id, name, price, updated_at FROM products WHERE sku_id = ?";

/// The timestamp-watermark sync query over the demo table.
pub const SYNC_QUERY: &str = "SELECT sku_id, updated_at FROM products WHERE updated_at >= ?";

/// A bloomgate config under construction. Section setters take whole TOML lines
/// (`"max_connections = 16"`), added in order to that section.
#[derive(Debug, Clone)]
pub struct TestConfig {
    server: Vec<String>,
    admin: Vec<String>,
    upstream: Option<Vec<String>>,
    database: Vec<String>,
    cache: Vec<String>,
    source_query: String,
    expected_items: u64,
    false_positive_rate: f64,
    filter: Vec<String>,
    sync: Option<Vec<String>>,
    routes: Vec<TestRoute>,
    write_through: Vec<Vec<String>>,
    fleet: Vec<String>,
    /// `None`: the audit is off (see [`TestConfig::audit`]).
    audit: Option<Vec<String>>,
}

impl TestConfig {
    /// A config reading the `products` filter from `SELECT sku_id FROM products` in the
    /// database at `db_url` (normalised as integers), sized for 1,000 keys at 1%, with no
    /// routes yet.
    pub fn new(db_url: &str) -> TestConfig {
        TestConfig {
            server: Vec::new(),
            admin: Vec::new(),
            upstream: None,
            database: vec![format!("url = {}", quoted(db_url))],
            cache: Vec::new(),
            source_query: "SELECT sku_id FROM products".to_owned(),
            expected_items: 1000,
            false_positive_rate: 0.01,
            filter: Vec::new(),
            sync: None,
            routes: Vec::new(),
            write_through: Vec::new(),
            fleet: Vec::new(),
            audit: None,
        }
    }

    /// Adds a line to `[server]`.
    pub fn server(mut self, line: impl Into<String>) -> Self {
        self.server.push(line.into());
        self
    }

    /// Adds a line to `[admin]`.
    pub fn admin(mut self, line: impl Into<String>) -> Self {
        self.admin.push(line.into());
        self
    }

    /// Sets `admin.token`.
    pub fn admin_token(mut self, token: &str) -> Self {
        self.admin.push(format!("token = {}", quoted(token)));
        self
    }

    /// Sets `upstream.url`.
    pub fn upstream(mut self, url: &str) -> Self {
        self.upstream
            .get_or_insert_with(Vec::new)
            .insert(0, format!("url = {}", quoted(url)));
        self
    }

    /// Adds a line to `[upstream]` (after its `url`).
    pub fn upstream_field(mut self, line: impl Into<String>) -> Self {
        self.upstream.get_or_insert_with(Vec::new).push(line.into());
        self
    }

    /// Adds a line to `[database]` (after its `url`).
    pub fn database(mut self, line: impl Into<String>) -> Self {
        self.database.push(line.into());
        self
    }

    /// Adds a line to `[cache]`.
    pub fn cache(mut self, line: impl Into<String>) -> Self {
        self.cache.push(line.into());
        self
    }

    /// Replaces the filter's `source_query`.
    pub fn source_query(mut self, sql: &str) -> Self {
        self.source_query = sql.to_owned();
        self
    }

    /// Sets the filter's `expected_items`.
    pub fn expected_items(mut self, n: u64) -> Self {
        self.expected_items = n;
        self
    }

    /// Sets the filter's `false_positive_rate`.
    pub fn false_positive_rate(mut self, p: f64) -> Self {
        self.false_positive_rate = p;
        self
    }

    /// Adds a line to `[filters.products]`, e.g. `rebuild_interval = "1s"`.
    pub fn filter(mut self, line: impl Into<String>) -> Self {
        self.filter.push(line.into());
        self
    }

    /// Sets the filter's `snapshot_path`.
    pub fn snapshot_path(self, path: &Path) -> Self {
        let line = format!("snapshot_path = {}", quoted(&path.display().to_string()));
        self.filter(line)
    }

    /// Adds a line to `[filters.products.sync]` (the table exists once this is called).
    pub fn sync(mut self, line: impl Into<String>) -> Self {
        self.sync.get_or_insert_with(Vec::new).push(line.into());
        self
    }

    /// Sets the sync `query`, e.g. [`SYNC_QUERY`] (the sync table exists once this is called).
    /// Adds a line to `[fleet]` (the section is written once it has a line).
    pub fn fleet(mut self, line: impl Into<String>) -> Self {
        self.fleet.push(line.into());
        self
    }

    pub fn sync_query(self, sql: &str) -> Self {
        let line = format!("query = {}", quoted(sql));
        self.sync(line)
    }

    /// Appends a guarded route.
    pub fn route(mut self, route: TestRoute) -> Self {
        self.routes.push(route);
        self
    }

    /// Appends a `[[write_through]]` table feeding the `products` filter: a write to
    /// `path` adds the key that `key` names (a TOML inline table such as
    /// `{ json = "sku_id" }`), with further `lines` such as `methods = ["POST"]`.
    pub fn write_through(mut self, path: &str, key: &str, lines: &[&str]) -> Self {
        let mut table = vec![
            format!("path = {}", quoted(path)),
            "filter = \"products\"".to_owned(),
            format!("key = {key}"),
        ];
        table.extend(lines.iter().map(|l| (*l).to_owned()));
        self.write_through.push(table);
        self
    }

    /// Adds a line to `[audit]`. Without one the audit is off: its background lookups
    /// of refused keys (at the shipped default rate, now and then) would add to the
    /// database reads and upstream requests that tests count exactly.
    /// `.audit("enabled = true")` keeps the shipped defaults.
    pub fn audit(mut self, line: impl Into<String>) -> Self {
        self.audit.get_or_insert_with(Vec::new).push(line.into());
        self
    }

    /// The config as TOML.
    pub fn toml(&self) -> String {
        let mut out = String::new();
        let mut section = |header: &str, lines: &[String]| {
            out.push_str(header);
            out.push('\n');
            for l in lines {
                out.push_str(l);
                out.push('\n');
            }
        };
        if !self.server.is_empty() {
            section("[server]", &self.server);
        }
        if !self.admin.is_empty() {
            section("[admin]", &self.admin);
        }
        if let Some(upstream) = &self.upstream {
            section("[upstream]", upstream);
        }
        section("[database]", &self.database);
        if !self.cache.is_empty() {
            section("[cache]", &self.cache);
        }
        let mut filter = vec![
            format!("source_query = {}", quoted(&self.source_query)),
            format!("expected_items = {}", self.expected_items),
            format!("false_positive_rate = {}", self.false_positive_rate),
        ];
        filter.extend(self.filter.iter().cloned());
        section("[filters.products]", &filter);
        if let Some(sync) = &self.sync {
            section("[filters.products.sync]", sync);
        }
        for route in &self.routes {
            section("[[routes]]", &route.lines());
        }
        for table in &self.write_through {
            section("[[write_through]]", table);
        }
        if !self.fleet.is_empty() {
            section("[fleet]", &self.fleet);
        }
        match &self.audit {
            Some(lines) => section("[audit]", lines),
            None => section("[audit]", &["enabled = false".to_owned()]),
        }
        out
    }
}

/// Where a route's answers come from.
#[derive(Debug, Clone)]
enum TestOrigin {
    Sql {
        query: String,
        timeout: Option<String>,
    },
    Upstream,
}

/// A guarded route of the `products` filter. The key is the path's `{param}` segment
/// unless [`TestRoute::query_key`] names a query parameter.
#[derive(Debug, Clone)]
pub struct TestRoute {
    name: Option<String>,
    path: String,
    query_key: Option<String>,
    origin: TestOrigin,
    fields: Vec<String>,
}

impl TestRoute {
    /// A route that looks keys up in the database with [`LOOKUP`].
    pub fn sql(name: &str, path: &str) -> TestRoute {
        TestRoute {
            name: Some(name.to_owned()),
            path: path.to_owned(),
            query_key: None,
            origin: TestOrigin::Sql {
                query: LOOKUP.to_owned(),
                timeout: None,
            },
            fields: Vec::new(),
        }
    }

    /// A route whose origin is `[upstream]`.
    pub fn upstream(name: &str, path: &str) -> TestRoute {
        TestRoute {
            origin: TestOrigin::Upstream,
            ..TestRoute::sql(name, path)
        }
    }

    /// Leaves `name` out, so the route is named by its path (in metric labels too).
    pub fn unnamed(mut self) -> Self {
        self.name = None;
        self
    }

    /// Sets the route's `mode`: `enforce`, `shadow` or `off`.
    pub fn mode(self, mode: &str) -> Self {
        let line = format!("mode = {}", quoted(mode));
        self.field(line)
    }

    /// Takes the key from this query parameter.
    pub fn query_key(mut self, param: &str) -> Self {
        self.query_key = Some(param.to_owned());
        self
    }

    /// The SQL lookup (SQL routes only).
    pub fn lookup(mut self, sql: &str) -> Self {
        if let TestOrigin::Sql { query, .. } = &mut self.origin {
            *query = sql.to_owned();
        }
        self
    }

    /// The SQL origin's `timeout` (SQL routes only).
    pub fn origin_timeout(mut self, timeout: &str) -> Self {
        if let TestOrigin::Sql { timeout: t, .. } = &mut self.origin {
            *t = Some(timeout.to_owned());
        }
        self
    }

    /// Adds a line to the route, e.g. `ttl = "1s"` or `mode = "shadow"`.
    pub fn field(mut self, line: impl Into<String>) -> Self {
        self.fields.push(line.into());
        self
    }

    fn lines(&self) -> Vec<String> {
        let key = match &self.query_key {
            Some(param) => format!("key = {{ query = {} }}", quoted(param)),
            None => {
                let segment = self
                    .path
                    .split_once('{')
                    .and_then(|(_, rest)| rest.split_once('}'))
                    .map_or("id", |(name, _)| name);
                format!("key = {{ segment = {} }}", quoted(segment))
            }
        };
        let origin = match &self.origin {
            TestOrigin::Sql { query, timeout } => match timeout {
                Some(t) => format!(
                    "origin = {{ kind = \"sql\", query = {}, timeout = {} }}",
                    quoted(query),
                    quoted(t)
                ),
                None => format!("origin = {{ kind = \"sql\", query = {} }}", quoted(query)),
            },
            TestOrigin::Upstream => "origin = { kind = \"upstream\" }".to_owned(),
        };
        let mut lines: Vec<String> = self
            .name
            .iter()
            .map(|name| format!("name = {}", quoted(name)))
            .collect();
        lines.extend([
            format!("path = {}", quoted(&self.path)),
            key,
            "filter = \"products\"".to_owned(),
            origin,
        ]);
        lines.extend(self.fields.iter().cloned());
        lines
    }
}

/// A TOML basic string.
fn quoted(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}
