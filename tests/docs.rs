//! The docs say what the code does: each check reads a page and compares it with the
//! code's own lists, both ways — the configuration reference with the defaults serde
//! fills in, the metrics table with a registry every family is registered on, the admin
//! API with the router's endpoints and its error codes, the restart-only lists with the
//! one the reload code decides by — and every relative link and anchor resolves. A
//! failure names the file and line, what the page says and what the code says.

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::time::Duration;

use bloomgate::admin::{Endpoint, ErrorCode};
use bloomgate::audit::metrics::AuditMetrics;
use bloomgate::config::Config;
use bloomgate::db::{Db, PoolSettings};
use bloomgate::filter::BloomParams;
use bloomgate::fleet::metrics::FleetMetrics;
use bloomgate::reload::RESTART_ONLY;
use bloomgate::reload::metrics::ReloadMetrics;
use bloomgate::reload::restart::is_restart_only;
use bloomgate::server::metrics::ConnectionMetrics;
use bloomgate::stages::Metrics;
use figment::Figment;
use figment::providers::{Format, Toml};
use prometheus::Registry;
use serde_json::Value;
use support::{TestConfig, TestProxy, TestRoute};

fn repo(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(path)
}

/// A page of the docs, by its path from the repository root.
struct Page {
    path: String,
    text: String,
}

impl Page {
    fn read(path: &str) -> Page {
        let text = std::fs::read_to_string(repo(path))
            .unwrap_or_else(|e| panic!("cannot read {path}: {e}"));
        Page {
            path: path.to_owned(),
            text,
        }
    }

    /// The lines outside fenced code blocks, numbered from 1.
    fn prose(&self) -> Vec<(usize, &str)> {
        let mut fenced = false;
        let mut out = Vec::new();
        for (i, line) in self.text.lines().enumerate() {
            if line.trim_start().starts_with("```") {
                fenced = !fenced;
                continue;
            }
            if !fenced {
                out.push((i + 1, line));
            }
        }
        out
    }

    /// The number of the first line that starts with `start`.
    fn line_of(&self, start: &str) -> Option<usize> {
        self.text
            .lines()
            .position(|l| l.starts_with(start))
            .map(|i| i + 1)
    }

    /// `path:line`.
    fn at(&self, line: usize) -> String {
        format!("{}:{line}", self.path)
    }
}

/// Fails with every problem found, one per line.
fn report(what: &str, problems: Vec<String>) {
    assert!(
        problems.is_empty(),
        "{what}: {} problem(s)\n{}",
        problems.len(),
        problems.join("\n")
    );
}

/// The spans between backticks on one line.
fn code_spans(line: &str) -> Vec<(usize, &str)> {
    let mut spans = Vec::new();
    let mut rest = line;
    let mut offset = 0;
    while let Some(open) = rest.find('`') {
        let after = &rest[open + 1..];
        let Some(close) = after.find('`') else { break };
        spans.push((offset + open, &after[..close]));
        let used = open + 1 + close + 1;
        offset += used;
        rest = &rest[used..];
    }
    spans
}

// ---------------------------------------------------------------------------------------
// The admin API

/// `**`METHOD /path`**` entries of docs/admin-api.md.
fn documented_endpoints(page: &Page) -> Vec<(usize, String)> {
    page.prose()
        .into_iter()
        .filter_map(|(n, line)| {
            let rest = line.strip_prefix("**`")?;
            let (endpoint, _) = rest.split_once("`**")?;
            Some((n, endpoint.to_owned()))
        })
        .collect()
}

#[test]
fn the_admin_endpoints_are_the_routers() {
    let page = Page::read("docs/admin-api.md");
    let served: BTreeMap<String, Endpoint> = Endpoint::ALL
        .into_iter()
        .map(|e| (format!("{} {}", e.method(), e.path()), e))
        .collect();
    let documented = documented_endpoints(&page);
    let mut problems = Vec::new();
    for (line, endpoint) in &documented {
        if !served.contains_key(endpoint) {
            problems.push(format!(
                "{}: `{endpoint}` is documented, the admin router serves no such endpoint (it serves {:?})",
                page.at(*line),
                served.keys().collect::<Vec<_>>()
            ));
        }
    }
    for (endpoint, variant) in &served {
        if !documented.iter().any(|(_, d)| d == endpoint) {
            problems.push(format!(
                "{}: the admin router serves `{endpoint}` (Endpoint::{variant:?}), the page has no **`{endpoint}`** entry",
                page.path
            ));
        }
    }
    report("docs/admin-api.md against admin::Endpoint", problems);
}

/// Every `NNN `code`` on the page: a status followed by an error code (the status may
/// end the line before).
fn documented_error_codes(page: &Page) -> Vec<(usize, u16, String)> {
    let mut found = Vec::new();
    let mut previous = "";
    for (n, line) in page.prose() {
        for (at, span) in code_spans(line) {
            let joined;
            let (line, at) = if line[..at].trim().is_empty() {
                joined = format!("{previous} {line}");
                let shift = joined.len() - line.len();
                (joined.as_str(), at + shift)
            } else {
                (line, at)
            };
            let before = line[..at].trim_end();
            let digits: String = before
                .chars()
                .rev()
                .take_while(|c| c.is_ascii_digit())
                .collect();
            let looks_like_code =
                !span.is_empty() && span.chars().all(|c| c.is_ascii_lowercase() || c == '_');
            if digits.len() == 3 && looks_like_code && before.len() < line[..at].len() {
                let status: String = digits.chars().rev().collect();
                if let Ok(status) = status.parse() {
                    found.push((n, status, span.to_owned()));
                }
            }
        }
        previous = line;
    }
    found
}

#[test]
fn the_admin_error_codes_are_the_error_enums() {
    let page = Page::read("docs/admin-api.md");
    let answered: BTreeMap<&str, u16> = ErrorCode::ALL
        .into_iter()
        .map(|c| (c.as_str(), c.status().as_u16()))
        .collect();
    let documented = documented_error_codes(&page);
    let mut problems = Vec::new();
    for (line, status, code) in &documented {
        match answered.get(code.as_str()) {
            None => problems.push(format!(
                "{}: {status} `{code}` is documented, the admin plane has no such error code",
                page.at(*line)
            )),
            Some(real) if real != status => problems.push(format!(
                "{}: `{code}` is answered {real}, the page says {status}",
                page.at(*line)
            )),
            Some(_) => {}
        }
    }
    for (code, status) in &answered {
        if !documented.iter().any(|(_, _, d)| d == code) {
            problems.push(format!(
                "{}: the admin plane answers {status} `{code}`, the page never names it (as `{status} `{code}``)",
                page.path
            ));
        }
    }
    report("docs/admin-api.md against admin::ErrorCode", problems);
}

/// The JSON of the first fenced block after the line that starts with `command`.
fn sample_after(page: &Page, command: &str) -> Option<(usize, Value)> {
    let lines: Vec<&str> = page.text.lines().collect();
    let at = lines.iter().position(|l| l.starts_with(command))?;
    let end = lines[at + 1..].iter().position(|l| l.starts_with("```"))? + at + 1;
    let json = serde_json::from_str(&lines[at + 1..end].join("\n")).ok()?;
    Some((at + 1, json))
}

/// The field names of an object, and those of the objects it holds, as dotted paths.
fn field_names(value: &Value, prefix: &str, out: &mut BTreeSet<String>) {
    if let Value::Object(map) = value {
        for (k, v) in map {
            let name = format!("{prefix}{k}");
            field_names(v, &format!("{name}."), out);
            out.insert(name);
        }
    }
}

#[tokio::test]
async fn the_admin_filters_sample_is_what_the_admin_plane_answers() {
    let page = Page::read("docs/admin-api.md");
    let command = "$ curl -s http://127.0.0.1:9090/admin/filters";
    let Some((line, sample)) = sample_after(&page, command) else {
        panic!("{}: no JSON sample after `{command}`", page.path);
    };
    let Some(documented) = sample["filters"].get(0) else {
        panic!("{}: the sample holds no filter", page.at(line));
    };

    let dir = match tempfile::tempdir() {
        Ok(d) => d,
        Err(e) => panic!("temporary directory: {e}"),
    };
    let url = format!("sqlite://{}", dir.path().join("docs.db").display());
    let db = Db::connect_lazy(&url, &PoolSettings::default()).expect("pool");
    db.migrate().await.expect("migrate");
    db.close().await;
    let proxy = TestProxy::spawn_ready(
        &TestConfig::new(&url)
            .expected_items(1000)
            .route(
                TestRoute::sql("products", "/api/products/{id}")
                    .lookup("SELECT sku_id FROM products WHERE sku_id = ?"),
            )
            .toml(),
    )
    .await;
    let answer = proxy.admin_get("/admin/filters").await.json();
    let Some(served) = answer["filters"].get(0) else {
        panic!("/admin/filters answered no filter: {answer}");
    };

    let (mut said, mut real) = (BTreeSet::new(), BTreeSet::new());
    field_names(documented, "", &mut said);
    field_names(served, "", &mut real);
    let mut problems = Vec::new();
    for field in said.difference(&real) {
        problems.push(format!(
            "{}: the sample has `{field}`, /admin/filters does not answer it",
            page.at(line)
        ));
    }
    for field in real.difference(&said) {
        problems.push(format!(
            "{}: /admin/filters answers `{field}`, the sample lacks it",
            page.at(line)
        ));
    }
    // The sizes are those the filter's sizing gives for the sample's capacity and target.
    let capacity = documented["capacity"].as_u64().unwrap_or(0);
    let target = documented["target_false_positive_rate"]
        .as_f64()
        .unwrap_or(0.0);
    match BloomParams::optimal(capacity, target) {
        Ok(params) => {
            for (field, real) in [
                ("bits", params.bits),
                ("hashes", u64::from(params.hashes)),
                ("bytes", params.bits / 8),
            ] {
                let said = documented[field].as_u64();
                if said != Some(real) {
                    problems.push(format!(
                        "{}: a filter of capacity {capacity} at {target} has {field} = {real}, the sample says {}",
                        page.at(line),
                        documented[field]
                    ));
                }
            }
        }
        Err(e) => problems.push(format!(
            "{}: capacity {capacity} at {target} cannot be sized: {e}",
            page.at(line)
        )),
    }
    report(
        "the /admin/filters sample against the admin plane",
        problems,
    );
}

// ---------------------------------------------------------------------------------------
// Metrics

/// A registry holding every family bloomgate registers, each with at least one series
/// (a family without one is left out of a scrape).
fn full_registry() -> prometheus::Result<Registry> {
    let registry = Registry::new();
    let metrics = Metrics::new(&registry)?;
    metrics.routes.handles("route", "filter", "enforce");
    let filter = metrics
        .filters
        .handles("filter", 0.01, Some(Duration::from_secs(5)));
    filter.redis_write("admission", true);
    metrics.origins.handles("database");
    metrics.set_cache_entries(1, 1);
    metrics.set_cache_bytes((Some(1), Some(1)));
    metrics.set_runtime(1, 1);
    metrics.access_log_lines();
    metrics.write_through("filter");
    metrics.passthrough();
    let connections = ConnectionMetrics::register(&registry, true, true)?;
    connections.accepted_by("0");
    connections.certificate_expires(0);
    bloomgate::pipeline::budget::register(&registry, 10, Duration::from_secs(60))?;
    AuditMetrics::register(&registry, ["route"])?;
    ReloadMetrics::register(&registry)?;
    let fleet = FleetMetrics::register(&registry)?;
    fleet.set_redis_up(true);
    fleet.set_role("filter", "builder");
    fleet.set_generation("filter", 1);
    fleet.set_current("filter", 1, true);
    fleet.set_lag(0, 0.0);
    fleet.lease_change("filter", "acquired");
    fleet.fallback();
    fleet.reset();
    fleet.generation("filter", "ok");
    fleet.entries("read", 1);
    Ok(registry)
}

/// The metric names in the tables of docs/monitoring.md: rows that start with
/// `` | `name{labels}` | `` or `` | `name` | ``.
fn documented_metrics(page: &Page) -> Vec<(usize, String)> {
    page.prose()
        .into_iter()
        .filter_map(|(n, line)| {
            let rest = line.strip_prefix("| `")?;
            let (cell, _) = rest.split_once('`')?;
            let name = cell.split('{').next()?;
            // Metric names are snake case; alert names (CamelCase) share the page.
            let is_name = name.starts_with(|c: char| c.is_ascii_lowercase())
                && name
                    .chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_' || c == '*');
            is_name.then(|| (n, name.to_owned()))
        })
        .collect()
}

/// Whether a documented name (`process_*` covers a prefix) names `metric`.
fn names(documented: &str, metric: &str) -> bool {
    match documented.strip_suffix('*') {
        Some(prefix) => metric.starts_with(prefix),
        None => documented == metric,
    }
}

#[test]
fn the_metrics_table_is_the_registry() {
    let registry = match full_registry() {
        Ok(r) => r,
        Err(e) => panic!("registering every metric family failed: {e}"),
    };
    let registered: BTreeSet<String> = registry
        .gather()
        .iter()
        .map(|f| f.name().to_owned())
        .collect();
    assert!(
        registered.contains("bloomgate_requests_total")
            && registered.contains("bloomgate_fleet_redis_up"),
        "the registry lacks families it must hold: {registered:?}"
    );
    let page = Page::read("docs/monitoring.md");
    let documented = documented_metrics(&page);
    let mut problems = Vec::new();
    for (line, name) in &documented {
        if !registered.iter().any(|m| names(name, m)) {
            problems.push(format!(
                "{}: `{name}` is documented, no such metric is registered",
                page.at(*line)
            ));
        }
    }
    for metric in &registered {
        if !documented.iter().any(|(_, d)| names(d, metric)) {
            problems.push(format!(
                "{}: `{metric}` is registered, the page has no row for it",
                page.path
            ));
        }
    }
    report("docs/monitoring.md against the metrics registry", problems);
}

// ---------------------------------------------------------------------------------------
// The configuration reference

/// A configuration file holding every optional section, and each shape of the entries
/// that take one of several (key sources, origins, normalisation), with nothing but what
/// each requires.
const EVERY_SECTION: &str = r#"
[server.tls]
cert_file = "cert.pem"
key_file = "key.pem"

[upstream]
url = "http://127.0.0.1:3000"

[database]
url = "sqlite://data/shop.db"

[access_log]

[false_positive_budget]
per_client = 10

[fleet]
redis_url = "redis://127.0.0.1:6379"

[filters.products]
source_query = "SELECT sku_id FROM products"
expected_items = 1000

[filters.products.sync]
query = "SELECT sku_id, updated_at FROM products WHERE updated_at >= ?"

[filters.users]
source_query = "SELECT name FROM users"
expected_items = 1000
normalize = { kind = "string" }

[filters.users.sync]
watermark = "binlog"

[filters.orders]
source_query = "SELECT id FROM orders"
expected_items = 1000

[[routes]]
path = "/api/product/info"
key = { query = "sku_id" }
filter = "products"
origin = { kind = "sql", query = "SELECT * FROM products WHERE sku_id = ?" }

[[routes]]
path = "/api/users/{name}"
key = { segment = "name" }
filter = "users"
origin = { kind = "upstream" }

[[write_through]]
path = "/api/products/{id}"
filter = "products"
key = { segment = "id" }

[[write_through]]
path = "/api/products"
filter = "products"
key = { header = "location" }

[[write_through]]
path = "/api/users"
filter = "users"
key = { json = "name" }
"#;

/// One step of a path into a configuration value.
#[derive(Clone, Debug)]
enum Step {
    Key(String),
    Index(usize),
}

/// A leaf of a configuration value: where it is, its reference key (`filters.<name>.…`,
/// `routes[].…`) and its value.
struct Leaf {
    steps: Vec<Step>,
    key: String,
    value: Value,
}

/// The reference key of a path: filter names become `<name>`, entry indexes `[]`.
fn reference_key(steps: &[Step]) -> String {
    let mut key = String::new();
    for (i, step) in steps.iter().enumerate() {
        match step {
            Step::Index(_) => key.push_str("[]"),
            Step::Key(k) => {
                if !key.is_empty() {
                    key.push('.');
                }
                let is_filter_name = i == 1 && matches!(&steps[0], Step::Key(f) if f == "filters");
                key.push_str(if is_filter_name { "<name>" } else { k });
            }
        }
    }
    key
}

/// The leaves of a configuration value: empty tables and lists are leaves, and so are
/// lists of values; the entries of `filters`, `routes` and `write_through` are walked.
fn leaves(value: &Value, steps: &mut Vec<Step>, out: &mut Vec<Leaf>) {
    let walked = |steps: &Vec<Step>| {
        steps.len() == 1
            && matches!(&steps[0], Step::Key(k) if k == "routes" || k == "write_through")
    };
    match value {
        Value::Object(map) if !map.is_empty() => {
            for (k, v) in map {
                steps.push(Step::Key(k.clone()));
                leaves(v, steps, out);
                steps.pop();
            }
        }
        Value::Array(items) if walked(steps) => {
            for (i, v) in items.iter().enumerate() {
                steps.push(Step::Index(i));
                leaves(v, steps, out);
                steps.pop();
            }
        }
        _ => out.push(Leaf {
            steps: steps.clone(),
            key: reference_key(steps),
            value: value.clone(),
        }),
    }
}

fn leaves_of(value: &Value) -> Vec<Leaf> {
    let mut out = Vec::new();
    leaves(value, &mut Vec::new(), &mut out);
    out
}

/// A TOML text as JSON, through the same provider the config loader uses.
fn toml_value(text: &str) -> Result<Value, String> {
    Figment::from(Toml::string(text))
        .extract::<Value>()
        .map_err(|e| e.to_string())
}

/// What the code says of one configuration key.
enum CodeDefault {
    /// serde fills it in with this value when the file leaves it out.
    Value(Value),
    /// The file must give it.
    Required,
}

impl std::fmt::Display for CodeDefault {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CodeDefault::Value(Value::Null) => write!(f, "unset"),
            CodeDefault::Value(v) => write!(f, "{v}"),
            CodeDefault::Required => write!(f, "required"),
        }
    }
}

/// Every configuration key with its default: the defaults of an empty file, and those of
/// every section and entry shape as they come out of [`EVERY_SECTION`]. A key that the
/// text gives everywhere it appears is required only if a file without it is refused;
/// the check is made here.
fn code_defaults() -> Result<BTreeMap<String, CodeDefault>, String> {
    let parse = |v: Value| serde_json::from_value::<Config>(v).map_err(|e| e.to_string());
    let empty = parse(toml_value("")?)?;
    let written_value = toml_value(EVERY_SECTION)?;
    let every = parse(written_value.clone())?;
    let mut defaults: BTreeMap<String, Vec<Value>> = BTreeMap::new();
    let entries = ["filters", "routes", "write_through"];
    for leaf in leaves_of(&serde_json::to_value(&empty).map_err(|e| e.to_string())?) {
        if !entries.contains(&leaf.key.as_str()) {
            defaults.entry(leaf.key).or_default().push(leaf.value);
        }
    }
    let mut required: BTreeMap<String, Vec<Step>> = BTreeMap::new();
    let written_leaves = leaves_of(&written_value);
    for leaf in leaves_of(&serde_json::to_value(&every).map_err(|e| e.to_string())?) {
        // Was this very leaf (this filter's, this entry's) in the text?
        let given = written_leaves
            .iter()
            .any(|w| format!("{:?}", w.steps) == format!("{:?}", leaf.steps));
        if given {
            required.entry(leaf.key).or_insert(leaf.steps);
        } else {
            defaults.entry(leaf.key).or_default().push(leaf.value);
        }
    }
    let mut out = BTreeMap::new();
    for (key, values) in &defaults {
        let first = &values[0];
        if let Some(other) = values.iter().find(|v| !same_value(v, first)) {
            return Err(format!(
                "{key} defaults to {first} in one entry and {other} in another"
            ));
        }
        out.insert(key.clone(), CodeDefault::Value(first.clone()));
    }
    for (key, steps) in required {
        if out.contains_key(&key) {
            continue;
        }
        let mut without = written_value.clone();
        remove(&mut without, &steps);
        if parse(without).is_ok() {
            return Err(format!(
                "{key} is given in every entry of the test's file, yet a file without it is accepted: give it a default in the reference's test file"
            ));
        }
        out.insert(key, CodeDefault::Required);
    }
    Ok(out)
}

fn remove(value: &mut Value, steps: &[Step]) {
    let Some((last, parents)) = steps.split_last() else {
        return;
    };
    let mut at = value;
    for step in parents {
        let next = match step {
            Step::Key(k) => at.get_mut(k.as_str()),
            Step::Index(i) => at.get_mut(*i),
        };
        match next {
            Some(v) => at = v,
            None => return,
        }
    }
    match (last, at) {
        (Step::Key(k), Value::Object(map)) => {
            map.remove(k);
        }
        (Step::Index(i), Value::Array(items)) if *i < items.len() => {
            items.remove(*i);
        }
        _ => {}
    }
}

/// Equal values, numbers and durations compared by value (`1` and `1.0` are one number).
fn same_value(a: &Value, b: &Value) -> bool {
    match (a, b) {
        (Value::Number(x), Value::Number(y)) => x.as_f64() == y.as_f64(),
        // Durations: `"90s"` and `"1m 30s"` are one duration.
        (Value::String(x), Value::String(y)) => {
            x == y
                || matches!(
                    (humantime::parse_duration(x), humantime::parse_duration(y)),
                    (Ok(a), Ok(b)) if a == b
                )
        }
        (Value::Array(x), Value::Array(y)) => {
            x.len() == y.len() && x.iter().zip(y).all(|(a, b)| same_value(a, b))
        }
        (Value::Object(x), Value::Object(y)) => {
            x.len() == y.len()
                && x.iter()
                    .all(|(k, v)| y.get(k).is_some_and(|w| same_value(v, w)))
        }
        _ => a == b,
    }
}

/// One row of the reference table.
struct Row {
    line: usize,
    key: String,
    default: String,
    applies: String,
}

/// The rows of the table under `## Reference`.
fn reference_rows(page: &Page) -> Result<(usize, Vec<Row>), String> {
    let heading = page
        .line_of("## Reference")
        .ok_or_else(|| format!("{} has no `## Reference` section", page.path))?;
    let mut rows = Vec::new();
    for (n, line) in page.prose() {
        if n <= heading {
            continue;
        }
        if line.starts_with("## ") {
            break;
        }
        let Some(inner) = line.trim().strip_prefix('|') else {
            continue;
        };
        let cells: Vec<&str> = inner.split('|').map(str::trim).collect();
        if cells.len() < 4 || cells[0].starts_with("---") || cells[0] == "key" {
            continue;
        }
        let key = cells[0].trim_matches('`').to_owned();
        let default = cells[1].to_owned();
        rows.push(Row {
            line: n,
            key,
            default,
            applies: cells[2].to_owned(),
        });
    }
    Ok((heading, rows))
}

/// What a default cell says: `required`, `unset`, or a TOML value in backticks.
fn doc_default(cell: &str) -> Result<CodeDefault, String> {
    match cell {
        "required" => Ok(CodeDefault::Required),
        "unset" => Ok(CodeDefault::Value(Value::Null)),
        _ => {
            let literal = cell
                .strip_prefix('`')
                .and_then(|c| c.strip_suffix('`'))
                .ok_or_else(|| {
                    format!("the default {cell:?} is not `required`, `unset` or a TOML value in backticks")
                })?;
            let parsed = toml_value(&format!("v = {literal}"))?;
            parsed
                .get("v")
                .cloned()
                .map(CodeDefault::Value)
                .ok_or_else(|| format!("{literal} is not a TOML value"))
        }
    }
}

fn same_default(a: &CodeDefault, b: &CodeDefault) -> bool {
    match (a, b) {
        (CodeDefault::Required, CodeDefault::Required) => true,
        (CodeDefault::Value(x), CodeDefault::Value(y)) => same_value(x, y),
        _ => false,
    }
}

#[test]
fn the_configuration_reference_is_the_config_model() {
    let code = match code_defaults() {
        Ok(c) => c,
        Err(e) => panic!("reading the config model's defaults: {e}"),
    };
    let page = Page::read("docs/configuration.md");
    let (heading, rows) = match reference_rows(&page) {
        Ok(r) => r,
        Err(e) => panic!("{e}"),
    };
    let mut problems = Vec::new();
    let mut seen = BTreeSet::new();
    for row in &rows {
        let at = page.at(row.line);
        if !seen.insert(row.key.clone()) {
            problems.push(format!("{at}: {} has a second row", row.key));
        }
        let Some(real) = code.get(&row.key) else {
            problems.push(format!(
                "{at}: {} is in the reference, the config has no such field",
                row.key
            ));
            continue;
        };
        match doc_default(&row.default) {
            Err(e) => problems.push(format!("{at}: {}: {e}", row.key)),
            Ok(said) if !same_default(&said, real) => {
                let code_says = match real {
                    CodeDefault::Required => "is required".to_owned(),
                    CodeDefault::Value(_) => format!("defaults to {real}"),
                };
                problems.push(format!(
                    "{at}: {} {code_says}, the reference says {said}",
                    row.key
                ))
            }
            Ok(_) => {}
        }
        let applies = if is_restart_only(&row.key) {
            "restart"
        } else {
            "reload"
        };
        if row.applies != applies {
            problems.push(format!(
                "{at}: {} applies on {applies} (reload::RESTART_ONLY), the reference says {:?}",
                row.key, row.applies
            ));
        }
    }
    for (key, real) in &code {
        if !seen.contains(key) {
            problems.push(format!(
                "{}: {key} (default {real}) is a config field, the reference has no row for it",
                page.at(heading)
            ));
        }
    }
    report(
        "docs/configuration.md#reference against the config model",
        problems,
    );
}

// ---------------------------------------------------------------------------------------
// Restart-only settings

/// The backticked keys of the paragraph that starts with `start`, with its line.
fn keys_after(page: &Page, start: &str) -> Option<(usize, BTreeSet<String>)> {
    let prose = page.prose();
    let first = prose.iter().position(|(_, l)| l.starts_with(start))?;
    let mut keys = BTreeSet::new();
    for (_, line) in prose[first..]
        .iter()
        .take_while(|(_, l)| !l.trim().is_empty())
    {
        for (_, span) in code_spans(line) {
            keys.insert(span.to_owned());
        }
    }
    Some((prose[first].0, keys))
}

/// The keys listed in config.toml's header after `# Restart-only:`, up to its first
/// line that is not a comment with content.
fn config_toml_restart_list() -> Option<(usize, BTreeSet<String>)> {
    let text = std::fs::read_to_string(repo("config.toml")).ok()?;
    let lines: Vec<&str> = text.lines().collect();
    let first = lines
        .iter()
        .position(|l| l.starts_with("# Restart-only:"))?;
    let mut keys = BTreeSet::new();
    for (i, line) in lines[first..].iter().enumerate() {
        let body = line.strip_prefix('#').map(str::trim);
        let body = match (i, body) {
            (0, Some(b)) => b.trim_start_matches("Restart-only:"),
            (_, Some(b)) if !b.is_empty() => b,
            _ => break,
        };
        keys.extend(
            body.split([',', ' '])
                .map(|k| k.trim_end_matches('.'))
                .filter(|k| !k.is_empty())
                .map(str::to_owned),
        );
    }
    Some((first + 1, keys))
}

#[test]
fn the_restart_only_lists_are_the_reload_codes() {
    let code: BTreeSet<String> = RESTART_ONLY.iter().map(|k| (*k).to_owned()).collect();
    let compare = |place: String, listed: &BTreeSet<String>| -> Vec<String> {
        let mut found = Vec::new();
        for k in listed.difference(&code) {
            found.push(format!(
                "{place}: lists {k} as restart-only, reload::RESTART_ONLY does not"
            ));
        }
        for k in code.difference(listed) {
            found.push(format!(
                "{place}: reload::RESTART_ONLY has {k}, the list does not"
            ));
        }
        found
    };
    let mut problems = Vec::new();
    let page = Page::read("docs/configuration.md");
    match keys_after(&page, "These settings are fixed at start") {
        Some((line, keys)) => problems.extend(compare(page.at(line), &keys)),
        None => problems.push(format!(
            "{}: no paragraph starts with \"These settings are fixed at start\"",
            page.path
        )),
    }
    match config_toml_restart_list() {
        Some((line, keys)) => problems.extend(compare(format!("config.toml:{line}"), &keys)),
        None => problems.push("config.toml: no `# Restart-only:` list".to_owned()),
    }
    report(
        "the restart-only lists against reload::RESTART_ONLY",
        problems,
    );
}

// ---------------------------------------------------------------------------------------
// Links

/// The pages whose links are checked.
fn linked_pages() -> Vec<String> {
    let mut pages = vec!["README.md".to_owned()];
    let mut docs: Vec<String> = std::fs::read_dir(repo("docs"))
        .map(|dir| {
            dir.filter_map(Result::ok)
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.ends_with(".md"))
                .map(|n| format!("docs/{n}"))
                .collect()
        })
        .unwrap_or_default();
    docs.sort();
    pages.extend(docs);
    pages
}

/// GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens;
/// a repeated heading gets `-1`, `-2`, ….
fn anchors(page: &Page) -> BTreeSet<String> {
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    let mut out = BTreeSet::new();
    for (_, line) in page.prose() {
        let Some(title) = line.strip_prefix('#') else {
            continue;
        };
        let title = title.trim_start_matches('#');
        if !title.starts_with(' ') {
            continue;
        }
        let slug: String = title
            .trim()
            .to_lowercase()
            .chars()
            .filter(|c| c.is_alphanumeric() || *c == ' ' || *c == '-' || *c == '_')
            .map(|c| if c == ' ' { '-' } else { c })
            .collect();
        let n = seen.entry(slug.clone()).or_insert(0);
        out.insert(if *n == 0 {
            slug.clone()
        } else {
            format!("{slug}-{n}")
        });
        *n += 1;
    }
    out
}

/// The targets of the inline links `[text](target)` on a line, outside code spans.
fn link_targets(line: &str) -> Vec<String> {
    let mut plain = String::with_capacity(line.len());
    let mut in_code = false;
    for c in line.chars() {
        if c == '`' {
            in_code = !in_code;
        } else if !in_code {
            plain.push(c);
        }
    }
    let mut out = Vec::new();
    let mut rest = plain.as_str();
    while let Some(at) = rest.find("](") {
        let after = &rest[at + 2..];
        let Some(end) = after.find(')') else { break };
        let target = after[..end].split_whitespace().next().unwrap_or("");
        out.push(target.to_owned());
        rest = &after[end..];
    }
    out
}

#[test]
fn every_link_and_anchor_resolves() {
    let mut problems = Vec::new();
    let mut pages: BTreeMap<String, Page> = BTreeMap::new();
    for path in linked_pages() {
        pages.insert(path.clone(), Page::read(&path));
    }
    let anchors_of: BTreeMap<String, BTreeSet<String>> = pages
        .iter()
        .map(|(p, page)| (p.clone(), anchors(page)))
        .collect();
    for page in pages.values() {
        let dir = Path::new(&page.path).parent().unwrap_or(Path::new(""));
        for (n, line) in page.prose() {
            for target in link_targets(line) {
                if target.contains("://") || target.starts_with("mailto:") {
                    continue;
                }
                let (file, anchor) = match target.split_once('#') {
                    Some((f, a)) => (f, Some(a)),
                    None => (target.as_str(), None),
                };
                let linked = if file.is_empty() {
                    page.path.clone()
                } else {
                    normalise(&dir.join(file))
                };
                if !repo(&linked).exists() {
                    problems.push(format!(
                        "{}: links to {target}, and {linked} does not exist",
                        page.at(n)
                    ));
                    continue;
                }
                let Some(anchor) = anchor else { continue };
                let known = match anchors_of.get(&linked) {
                    Some(a) => a.clone(),
                    None if linked.ends_with(".md") => anchors(&Page::read(&linked)),
                    None => continue,
                };
                if !known.contains(anchor) {
                    problems.push(format!(
                        "{}: links to {target}, and {linked} has no heading with the anchor #{anchor}",
                        page.at(n)
                    ));
                }
            }
        }
    }
    report("links between the docs", problems);
}

/// `docs/../README.md` as `README.md`.
fn normalise(path: &Path) -> String {
    let mut parts: Vec<String> = Vec::new();
    for part in path.components() {
        match part {
            std::path::Component::ParentDir => {
                parts.pop();
            }
            std::path::Component::CurDir => {}
            other => parts.push(other.as_os_str().to_string_lossy().into_owned()),
        }
    }
    parts.join("/")
}
