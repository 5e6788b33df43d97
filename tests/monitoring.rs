//! The monitoring that ships with bloomgate, proven against real parts: the Grafana
//! dashboard and the Prometheus rules are evaluated by a real Prometheus scraping a real
//! bloomgate backed by MariaDB, every alert is driven until it fires, `promtool` checks
//! the files and the `/metrics` output, and the compose file and Dockerfile are read
//! against the repository (there is no container engine to run them here).
//!
//! The Prometheus test needs `prometheus` and `promtool` (Debian's `prometheus` package,
//! which `scripts/test` installs) and MariaDB; like the other MariaDB tests it is skipped
//! without `BLOOMGATE_TEST_MYSQL_URL` and fails in CI if anything is missing.

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use bloomgate::db::{demo_absent_sku, demo_sku};
use bytes::Bytes;
use http::Method;
use serde_json::Value;
use support::{HttpClient, TestDb, TestProxy, mysql_url};
use tempfile::TempDir;

const REPO: &str = env!("CARGO_MANIFEST_DIR");
const TOKEN: &str = "monitoring-token";
/// Products in the database; the `products` filter is sized well above it.
const PRODUCTS: u64 = 2_000;
/// Keys in the source of the `tiny` filter, and its capacity.
const TINY: u64 = 50;
/// Keys added to `tiny` through the admin API once its source is gone: the filter is
/// then sixty times over capacity and lets nearly every absent key through.
const TINY_FLOOD: u64 = 3_000;
/// False positives each client may push to the origin per minute.
const BUDGET: u32 = 20;
/// The client that hunts for false positives (see `drive`).
const HUNTER: &str = "198.51.100.7";

fn repo(path: &str) -> PathBuf {
    Path::new(REPO).join(path)
}

fn read(path: &str) -> String {
    std::fs::read_to_string(repo(path)).unwrap_or_else(|e| panic!("read {path}: {e}"))
}

fn dashboard() -> Value {
    serde_json::from_str(&read("deploy/grafana/dashboards/bloomgate.json"))
        .expect("the dashboard is JSON")
}

/// Every panel, rows included, with the panels nested in collapsed rows.
fn all_panels(dash: &Value) -> Vec<&Value> {
    let mut out = Vec::new();
    for p in dash["panels"].as_array().expect("panels") {
        out.push(p);
        if let Some(inner) = p["panels"].as_array() {
            out.extend(inner);
        }
    }
    out
}

/// `(panel title, legend, expr)` of every query in the dashboard.
fn dashboard_queries(dash: &Value) -> Vec<(String, String, String)> {
    all_panels(dash)
        .into_iter()
        .flat_map(|p| {
            let title = p["title"].as_str().unwrap_or_default().to_owned();
            p["targets"].as_array().into_iter().flatten().map(move |t| {
                (
                    title.clone(),
                    t["legendFormat"].as_str().unwrap_or_default().to_owned(),
                    t["expr"].as_str().unwrap_or_default().to_owned(),
                )
            })
        })
        .collect()
}

/// The `$name` and `${name}` references in `text`.
fn variables_in(text: &str) -> BTreeSet<String> {
    let mut found = BTreeSet::new();
    let mut rest = text;
    while let Some(at) = rest.find('$') {
        rest = &rest[at + 1..];
        let braced = rest.starts_with('{');
        let name: String = rest
            .trim_start_matches('{')
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        if !name.is_empty() {
            found.insert(name);
        }
        if braced {
            rest = rest.trim_start_matches('{');
        }
    }
    found
}

#[test]
fn the_dashboard_is_well_formed() {
    let dash = dashboard();
    assert!(dash["schemaVersion"].as_u64().is_some_and(|v| v >= 36));
    assert_eq!(dash["uid"], "bloomgate");

    let vars: BTreeMap<&str, &Value> = dash["templating"]["list"]
        .as_array()
        .expect("templating variables")
        .iter()
        .map(|v| (v["name"].as_str().expect("variable name"), v))
        .collect();
    for needed in ["datasource", "instance", "route"] {
        assert!(vars.contains_key(needed), "no `{needed}` variable");
    }
    assert_eq!(vars["datasource"]["type"], "datasource");
    assert_eq!(vars["datasource"]["query"], "prometheus");
    for (name, var) in &vars {
        if var["type"] == "query" {
            assert_eq!(var["datasource"]["uid"], "${datasource}", "variable {name}");
            // A variable's own query may only use variables defined before it.
            for used in variables_in(var["definition"].as_str().unwrap_or_default()) {
                assert!(
                    vars.contains_key(used.as_str()),
                    "{name} uses undefined ${used}"
                );
            }
        }
    }

    let panels = all_panels(&dash);
    let mut ids = BTreeSet::new();
    let mut rows = 0;
    for p in &panels {
        let id = p["id"].as_u64().expect("numeric panel id");
        assert!(ids.insert(id), "panel id {id} is used twice");
        let title = p["title"].as_str().unwrap_or_default();
        assert!(!title.is_empty(), "panel {id} has no title");
        let pos = &p["gridPos"];
        let (x, w) = (pos["x"].as_u64(), pos["w"].as_u64());
        assert!(
            x.zip(w).is_some_and(|(x, w)| w > 0 && x + w <= 24),
            "panel {title} lies outside the 24-column grid: {pos}"
        );
        if p["type"] == "row" {
            rows += 1;
            continue;
        }
        assert_eq!(p["datasource"]["uid"], "${datasource}", "panel {title}");
        assert!(
            p["description"].as_str().is_some_and(|d| d.len() > 40),
            "panel {title} does not say what healthy looks like"
        );
        let targets = p["targets"].as_array().expect("targets");
        assert!(!targets.is_empty(), "panel {title} has no query");
        for t in targets {
            assert_eq!(t["datasource"]["uid"], "${datasource}", "panel {title}");
            let expr = t["expr"].as_str().expect("expr");
            for used in variables_in(expr) {
                assert!(
                    vars.contains_key(used.as_str()) || used.starts_with("__"),
                    "panel {title} uses undefined ${used}"
                );
            }
        }
    }
    assert!(rows >= 6, "expected rows for each area, found {rows}");

    // Every area the dashboard must cover has a panel that queries its metric.
    let exprs: Vec<String> = dashboard_queries(&dash)
        .into_iter()
        .map(|(_, _, e)| e)
        .collect();
    for metric in [
        "bloomgate_requests_total",
        "bloomgate_request_duration_seconds_bucket",
        "bloomgate_origin_duration_seconds_count",
        "bloomgate_origin_duration_seconds_bucket",
        "bloomgate_origin_errors_total",
        "bloomgate_cache_entries",
        "bloomgate_filter_items",
        "bloomgate_filter_capacity",
        "bloomgate_filter_fill_ratio",
        "bloomgate_filter_ready",
        "bloomgate_filter_estimated_fpp",
        "bloomgate_filter_target_fpp",
        "bloomgate_filter_last_build_timestamp_seconds",
        "bloomgate_filter_sync_lag_seconds",
        "outcome=\"fail_open\"",
        "outcome=\"throttled\"",
        "bloomgate_fleet_redis_up",
        "bloomgate_fleet_role",
        "bloomgate_fleet_builder_present",
        "bloomgate_fleet_generation{",
        "bloomgate_fleet_current_generation",
        "bloomgate_fleet_stream_lag_entries",
        "bloomgate_fleet_stream_lag_seconds",
        "bloomgate_fleet_lease_changes_total",
        "bloomgate_fleet_fallbacks_total",
        "bloomgate_fleet_redis_resets_total",
        "bloomgate_fleet_generations_total",
        "bloomgate_fleet_stream_entries_total",
        "bloomgate_origin_breaker_state",
        "bloomgate_origin_refused_total",
        "bloomgate_origin_in_flight",
        "bloomgate_connections_open",
        "bloomgate_connections_refused_total",
        "bloomgate_runtime",
        "bloomgate_audit_checks_total",
        "bloomgate_audit_false_negatives_total",
    ] {
        assert!(
            exprs.iter().any(|e| e.contains(metric)),
            "no panel queries {metric}"
        );
    }

    // The fleet panels sit in a row of their own, collapsed: without [fleet] they have
    // no data, and every panel that queries a fleet metric is in it.
    let fleet_row = dash["panels"]
        .as_array()
        .expect("panels")
        .iter()
        .find(|p| p["type"] == "row" && p["title"] == "Fleet")
        .expect("a Fleet row");
    assert_eq!(fleet_row["collapsed"], true);
    let in_row: BTreeSet<&str> = fleet_row["panels"]
        .as_array()
        .expect("the Fleet row's panels")
        .iter()
        .filter_map(|p| p["title"].as_str())
        .collect();
    for (title, _, expr) in dashboard_queries(&dash) {
        assert_eq!(
            expr.contains(FLEET_METRICS),
            in_row.contains(title.as_str()),
            "panel {title}: fleet metrics belong in the Fleet row, and only they"
        );
    }
}

/// What every fleet metric's name starts with; they exist only with a `[fleet]` section.
const FLEET_METRICS: &str = "bloomgate_fleet_";

/// The rules group of the fleet alerts.
const FLEET_GROUP: &str = "bloomgate-fleet";
const ORIGINS_GROUP: &str = "bloomgate-origins";
const CONFIG_GROUP: &str = "bloomgate-config";
/// The rules group of the audit's alert.
const AUDIT_GROUP: &str = "bloomgate-audit";
/// The rules group of binlog mode's alert.
const BINLOG_GROUP: &str = "bloomgate-binlog";

/// What every TLS metric's name starts with; they exist only with `[server.tls]`.
const TLS_METRICS: &str = "bloomgate_tls_";

/// The rules group of the TLS alerts.
const TLS_GROUP: &str = "bloomgate-tls";

/// The metric family names bloomgate declares: every `"bloomgate_..."` string literal in
/// src/ and crates/bloomgate-core/src/ (metric names are the only such literals).
fn declared_metric_names() -> BTreeSet<String> {
    fn walk(dir: &Path, out: &mut BTreeSet<String>) {
        for entry in std::fs::read_dir(dir).expect("read src/") {
            let path = entry.expect("dir entry").path();
            if path.is_dir() {
                walk(&path, out);
            } else if path.extension().is_some_and(|e| e == "rs") {
                let text = std::fs::read_to_string(&path).expect("read source");
                for (at, _) in text.match_indices("\"bloomgate_") {
                    let name: String = text[at + 1..]
                        .chars()
                        .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                        .collect();
                    let closed = text[at + 1 + name.len()..].starts_with('"');
                    // `bloomgate__...` is an environment variable name, not a metric.
                    if closed && !name.contains("__") {
                        out.insert(name);
                    }
                }
            }
        }
    }
    let mut names = BTreeSet::new();
    walk(&repo("src"), &mut names);
    walk(&repo("crates/bloomgate-core/src"), &mut names);
    names
}

#[test]
fn every_metric_family_is_documented() {
    let names = declared_metric_names();
    // The scan finds the families of every area, fleet mode's included.
    for expected in [
        "bloomgate_requests_total",
        "bloomgate_filter_items",
        "bloomgate_fleet_redis_up",
        "bloomgate_fleet_stream_entries_total",
    ] {
        assert!(names.contains(expected), "{expected} not found in src/");
    }
    let docs = read("docs/monitoring.md");
    let undocumented: Vec<&String> = names
        .iter()
        .filter(|n| !docs.contains(&format!("| `{n}{{")) && !docs.contains(&format!("| `{n}` |")))
        .collect();
    assert!(
        undocumented.is_empty(),
        "metrics missing from the table in docs/monitoring.md: {undocumented:?}"
    );
}

/// Every alert in the rules file has its row in the alerts table of docs/monitoring.md,
/// and the table names no alert the rules file lacks.
#[test]
fn every_alert_is_in_the_alerts_table() {
    let doc: serde_yaml::Value =
        serde_yaml::from_str(&read("deploy/prometheus/rules.yml")).expect("rules are YAML");
    let rules: BTreeSet<String> = doc["groups"]
        .as_sequence()
        .into_iter()
        .flatten()
        .flat_map(|g| g["rules"].as_sequence().cloned().unwrap_or_default())
        .filter_map(|r| r["alert"].as_str().map(str::to_owned))
        .collect();
    assert!(rules.len() >= 10, "{rules:?}");
    let docs = read("docs/monitoring.md");
    let section = docs
        .split("## Alerts")
        .nth(1)
        .expect("docs/monitoring.md has an Alerts section");
    let rows: BTreeSet<String> = section
        .lines()
        .filter_map(|l| l.strip_prefix("| `"))
        .filter_map(|l| l.split('`').next())
        .filter(|name| name.starts_with("Bloomgate"))
        .map(str::to_owned)
        .collect();
    let missing: Vec<&String> = rules.difference(&rows).collect();
    let extra: Vec<&String> = rows.difference(&rules).collect();
    assert!(
        missing.is_empty(),
        "alerts without a row in docs/monitoring.md: {missing:?}"
    );
    assert!(
        extra.is_empty(),
        "rows for alerts the rules file lacks: {extra:?}"
    );
}

/// The alert names of the rules group `group`.
fn alerts_of_group(rules: &str, group: &str) -> Vec<String> {
    let doc: serde_yaml::Value = serde_yaml::from_str(rules).expect("rules are YAML");
    doc["groups"]
        .as_sequence()
        .into_iter()
        .flatten()
        .filter(|g| g["name"].as_str() == Some(group))
        .flat_map(|g| g["rules"].as_sequence().cloned().unwrap_or_default())
        .filter_map(|r| r["alert"].as_str().map(str::to_owned))
        .collect()
}

/// The rules file with every annotation but `summary` left out, for promtool's unit
/// tests, which compare annotations whole.
fn rules_with_summaries_only() -> String {
    let mut doc: serde_yaml::Value =
        serde_yaml::from_str(&read("deploy/prometheus/rules.yml")).expect("rules are YAML");
    for group in doc["groups"].as_sequence_mut().expect("groups") {
        for rule in group["rules"].as_sequence_mut().expect("rules") {
            if let Some(notes) = rule
                .get_mut("annotations")
                .and_then(serde_yaml::Value::as_mapping_mut)
            {
                notes.retain(|k, _| k.as_str() == Some("summary"));
            }
        }
    }
    serde_yaml::to_string(&doc).expect("rules back to YAML")
}

/// The fleet alerts cannot be driven by the Prometheus test below (it runs no Redis), so
/// promtool's rule unit tests (tests/rules/fleet.yml) drive each through series that
/// make it fire, and through near misses that must not.
#[test]
fn the_fleet_alerts_fire_on_their_conditions_and_only_then() {
    promtool_rule_tests("tests/rules/fleet.yml", FLEET_GROUP, 4);
}

/// The origin alerts, the same way (tests/rules/origins.yml).
#[test]
fn the_origin_alerts_fire_on_their_conditions_and_only_then() {
    promtool_rule_tests("tests/rules/origins.yml", ORIGINS_GROUP, 1);
}

/// The reload alert needs a refused reload, which the Prometheus test below does not
/// make: promtool's rule unit tests (tests/rules/config.yml) drive it.
#[test]
fn the_reload_alert_fires_on_its_condition_and_only_then() {
    promtool_rule_tests("tests/rules/config.yml", CONFIG_GROUP, 1);
}

/// The audit's alert needs a false negative, which the Prometheus test below does not
/// make (tests/audit.rs makes them against MariaDB): promtool's rule unit tests
/// (tests/rules/audit.yml) drive it.
#[test]
fn the_audit_alert_fires_on_its_condition_and_only_then() {
    promtool_rule_tests("tests/rules/audit.yml", AUDIT_GROUP, 1);
}

/// The binlog alert needs a filter in binlog mode falling behind, which the Prometheus
/// test below does not run: promtool's rule unit tests (tests/rules/binlog.yml) drive
/// it (tests/binlog.rs drives the stream itself).
#[test]
fn the_binlog_alert_fires_on_its_condition_and_only_then() {
    promtool_rule_tests("tests/rules/binlog.yml", BINLOG_GROUP, 1);
}

/// The TLS alert needs a certificate about to expire, which the Prometheus test below
/// does not serve: promtool's rule unit tests (tests/rules/tls.yml) drive it.
#[test]
fn the_tls_alert_fires_on_its_condition_and_only_then() {
    promtool_rule_tests("tests/rules/tls.yml", TLS_GROUP, 1);
}

/// Runs `promtool test rules` on `cases` against the shipped rules, after checking that
/// each of the `count` alerts of `group` is tested both firing and quiet there.
fn promtool_rule_tests(cases_path: &str, group: &str, count: usize) {
    if find_tool("promtool").is_none() {
        let ci = std::env::var_os("CI").is_some_and(|v| !v.is_empty());
        assert!(
            !ci,
            "promtool is missing but CI is set: install Debian's `prometheus` package"
        );
        eprintln!("skipping: promtool not found (install Debian's `prometheus` package)");
        return;
    }
    let cases = read(cases_path);
    let doc: serde_yaml::Value = serde_yaml::from_str(&cases).expect("unit tests are YAML");
    let mut firing = BTreeSet::new();
    let mut quiet = BTreeSet::new();
    for test in doc["tests"].as_sequence().expect("tests") {
        for case in test["alert_rule_test"]
            .as_sequence()
            .expect("alert_rule_test")
        {
            let name = case["alertname"].as_str().expect("alertname").to_owned();
            if case["exp_alerts"]
                .as_sequence()
                .is_some_and(|a| a.is_empty())
            {
                quiet.insert(name);
            } else {
                firing.insert(name);
            }
        }
    }
    let alerts = alerts_of_group(&read("deploy/prometheus/rules.yml"), group);
    assert_eq!(alerts.len(), count, "{alerts:?}");
    for alert in &alerts {
        assert!(firing.contains(alert), "{alert} is never tested firing");
        assert!(quiet.contains(alert), "{alert} is never tested quiet");
    }

    let dir = TempDir::new().expect("temp dir");
    std::fs::write(dir.path().join("rules.yml"), rules_with_summaries_only()).expect("rules");
    let file_name = Path::new(cases_path).file_name().expect("a file name");
    let test_file = dir.path().join(file_name);
    std::fs::write(&test_file, &cases).expect("unit tests");
    promtool(&["test", "rules", test_file.to_str().expect("utf-8 path")]);
}

/// The `services` of docker-compose.yml.
fn compose_services() -> serde_yaml::Mapping {
    let mut compose: serde_yaml::Value =
        serde_yaml::from_str(&read("docker-compose.yml")).expect("compose file is YAML");
    compose.apply_merge().expect("merge keys");
    compose["services"].as_mapping().expect("services").clone()
}

fn strings(v: &serde_yaml::Value) -> Vec<String> {
    v.as_sequence()
        .into_iter()
        .flatten()
        .filter_map(|s| s.as_str().map(str::to_owned))
        .collect()
}

#[test]
fn compose_and_dockerfile_match_the_repository() {
    let services = compose_services();
    let names: BTreeSet<&str> = services.keys().filter_map(|k| k.as_str()).collect();
    assert_eq!(
        names,
        BTreeSet::from([
            "mysql",
            "redis",
            "bloomgate-1",
            "bloomgate-2",
            "lb",
            "prometheus",
            "grafana"
        ])
    );
    let svc = |name: &str| &services[name];

    assert!(
        svc("mysql")["image"]
            .as_str()
            .is_some_and(|i| i.starts_with("mysql:8")),
        "MySQL 8"
    );
    for instance in ["bloomgate-1", "bloomgate-2"] {
        assert_eq!(svc(instance)["build"].as_str(), Some("."));
    }
    assert_eq!(strings(&svc("lb")["ports"]), ["8080:8080"]);
    assert_eq!(
        strings(&svc("bloomgate-1")["ports"]),
        ["127.0.0.1:9090:9090"]
    );
    assert_eq!(
        strings(&svc("bloomgate-2")["ports"]),
        ["127.0.0.1:9092:9090"]
    );
    assert_eq!(
        strings(&svc("prometheus")["ports"]),
        ["127.0.0.1:9091:9090"]
    );
    assert_eq!(strings(&svc("grafana")["ports"]), ["127.0.0.1:3000:3000"]);
    for image in ["mysql", "redis", "lb", "prometheus", "grafana"] {
        let tag = svc(image)["image"].as_str().expect("image");
        assert!(
            tag.contains(':') && !tag.ends_with(":latest"),
            "{image} image pinned: {tag}"
        );
    }

    // Every file or directory mounted from the repository exists, and the files the
    // services need are among the mounts.
    let mut mounted = BTreeMap::new();
    for (name, service) in &services {
        for volume in strings(&service["volumes"]) {
            let Some(rest) = volume.strip_prefix("./") else {
                continue;
            };
            let host = rest.split(':').next().unwrap_or_default();
            let target = rest.split(':').nth(1).unwrap_or_default().to_owned();
            assert!(
                repo(host).exists(),
                "{name:?} mounts ./{host}, which is not in the repository"
            );
            mounted.insert(host.to_owned(), target);
        }
    }
    for migration in std::fs::read_dir(repo("migrations")).expect("migrations/") {
        let file = migration.expect("migration entry").file_name();
        let path = format!("migrations/{}", file.to_string_lossy());
        assert!(
            mounted
                .get(&path)
                .is_some_and(|t| t.starts_with("/docker-entrypoint-initdb.d/")),
            "{path} is not loaded by the mysql service"
        );
    }
    assert_eq!(
        mounted["deploy/prometheus/prometheus.yml"],
        "/etc/prometheus/prometheus.yml"
    );
    assert_eq!(
        mounted["deploy/prometheus/rules.yml"],
        "/etc/prometheus/rules.yml"
    );
    assert_eq!(
        mounted["deploy/grafana/provisioning/datasources"],
        "/etc/grafana/provisioning/datasources"
    );
    assert_eq!(
        mounted["deploy/grafana/provisioning/dashboards"],
        "/etc/grafana/provisioning/dashboards"
    );
    let dashboards_at = &mounted["deploy/grafana/dashboards"];
    let provider = read("deploy/grafana/provisioning/dashboards/bloomgate.yml");
    assert!(
        provider.contains(&format!("path: {dashboards_at}")),
        "the dashboard provider reads {dashboards_at}"
    );

    // The names the services use for each other.
    let prometheus = read("deploy/prometheus/prometheus.yml");
    assert!(prometheus.contains("\"bloomgate-1:9090\", \"bloomgate-2:9090\""));
    assert!(prometheus.contains("- rules.yml"));
    let datasource = read("deploy/grafana/provisioning/datasources/prometheus.yml");
    assert!(datasource.contains("url: http://prometheus:9090"));
    let config = bloomgate::config::Config::from_toml_str(&read("config.compose.toml"))
        .expect("config.compose.toml is a valid config");
    let db_url = config.database.as_ref().map(|d| d.url.clone());
    assert!(
        db_url.is_some_and(|u| u.contains("@mysql:3306/")),
        "bloomgate reaches the mysql service"
    );
    assert_eq!(config.admin.listen.port(), 9090);
    assert_eq!(config.server.listen.port(), 8080);

    // The Dockerfile: multi-stage, unprivileged, health-checked on /readyz.
    let dockerfile = read("Dockerfile");
    let froms = dockerfile
        .lines()
        .filter(|l| l.starts_with("FROM "))
        .count();
    assert!(froms >= 2, "a multi-stage build");
    assert!(dockerfile.contains("-slim"), "a small runtime image");
    assert!(
        dockerfile
            .lines()
            .any(|l| l.starts_with("USER ") && !l.contains("root")),
        "runs as a non-root user"
    );
    assert!(dockerfile.contains("HEALTHCHECK") && dockerfile.contains("/readyz"));
    assert!(dockerfile.contains("EXPOSE 8080 9090"));
    for line in dockerfile.lines().filter(|l| l.starts_with("COPY ")) {
        let source = line.split_whitespace().nth(1).unwrap_or_default();
        if !source.starts_with("--") && source != "." {
            assert!(
                repo(source).exists(),
                "the Dockerfile copies missing {source}"
            );
        }
    }
}

/// `name` on PATH or in /usr/bin.
fn find_tool(name: &str) -> Option<PathBuf> {
    let candidates = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .unwrap_or_default();
    candidates
        .into_iter()
        .chain([PathBuf::from("/usr/bin")])
        .map(|dir| dir.join(name))
        .find(|p| p.is_file())
}

/// `name` on PATH or in /usr/bin, which the test needs once MariaDB is available.
fn tool(name: &str) -> PathBuf {
    find_tool(name)
        .unwrap_or_else(|| panic!("{name} not found: install Debian's `prometheus` package"))
}

/// Runs promtool with `args`, feeding it `stdin`: whether it exited 0, and its output.
fn run_promtool(args: &[&str], stdin: &str) -> (bool, String) {
    use std::io::Write as _;
    let mut child = Command::new(tool("promtool"))
        .args(args)
        .current_dir(REPO)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start promtool");
    if let Some(mut pipe) = child.stdin.take() {
        pipe.write_all(stdin.as_bytes()).expect("write to promtool");
    }
    let out = child.wait_with_output().expect("promtool output");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

/// Runs promtool with `args`, failing the test unless it exits 0.
fn promtool(args: &[&str]) {
    let (ok, text) = run_promtool(args, "");
    assert!(ok, "promtool {args:?} failed:\n{text}");
}

/// `promtool check metrics` on `text`: its findings. It exits 1 when it has any, so
/// only a failure without findings fails here.
fn promtool_lint(text: &str) -> String {
    let (ok, findings) = run_promtool(&["check", "metrics"], text);
    assert!(
        ok || !findings.trim().is_empty(),
        "promtool check metrics failed without a finding"
    );
    findings
}

/// A port that was free a moment ago, other than those in `avoid`: Prometheus needs a
/// number, not port 0, and the kernel may hand out a port just released again, so ports
/// the test relies on staying closed are passed in.
fn free_port(avoid: &[u16]) -> u16 {
    loop {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .expect("a free port");
        if !avoid.contains(&port) {
            return port;
        }
    }
}

/// A Prometheus server in a temporary directory, killed when dropped.
struct Prometheus {
    child: Child,
    /// Its config, rules, data and log; removed after the process is killed.
    dir: TempDir,
    url: String,
}

impl Prometheus {
    async fn start(targets: &[SocketAddr], keep_closed: &[u16], rules: &str) -> Prometheus {
        // The unreachable targets must stay unreachable, so Prometheus must not get one
        // of their ports.
        let mut avoid: Vec<u16> = targets.iter().map(SocketAddr::port).collect();
        avoid.extend(keep_closed);
        let dir = TempDir::new().expect("prometheus dir");
        let path = dir.path();
        std::fs::create_dir_all(path.join("data")).expect("prometheus data dir");
        std::fs::write(path.join("rules.yml"), rules).expect("write rules");
        let targets: Vec<String> = targets.iter().map(|t| format!("\"{t}\"")).collect();
        let config = format!(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nrule_files:\n  - rules.yml\n\
             scrape_configs:\n  - job_name: bloomgate\n    static_configs:\n      - targets: [{}]\n",
            targets.join(", ")
        );
        std::fs::write(path.join("prometheus.yml"), &config).expect("write config");
        promtool(&[
            "check",
            "config",
            path.join("prometheus.yml").to_str().expect("utf-8 path"),
        ]);
        let port = free_port(&avoid);
        let log = std::fs::File::create(path.join("prometheus.log")).expect("log file");
        let child = Command::new(tool("prometheus"))
            .arg(format!(
                "--config.file={}",
                path.join("prometheus.yml").display()
            ))
            .arg(format!(
                "--storage.tsdb.path={}",
                path.join("data").display()
            ))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .arg("--log.level=warn")
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("start prometheus");
        let prometheus = Prometheus {
            child,
            dir,
            url: format!("http://127.0.0.1:{port}"),
        };
        let mut prometheus = prometheus;
        let client = HttpClient::new();
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let log = || std::fs::read_to_string(prometheus.dir.path().join("prometheus.log"));
            if let Ok(Some(status)) = prometheus.child.try_wait() {
                panic!(
                    "prometheus exited ({status}): {}",
                    log().unwrap_or_default()
                );
            }
            // The client fails the test on a refused connection, so wait for the port.
            if tokio::net::TcpStream::connect(("127.0.0.1", port))
                .await
                .is_ok()
            {
                let r = client
                    .send(
                        Method::GET,
                        &format!("{}/-/ready", prometheus.url),
                        &[],
                        Bytes::new(),
                    )
                    .await;
                if r.status.is_success() {
                    break;
                }
            }
            assert!(
                Instant::now() < deadline,
                "prometheus not ready in 30 s: {}",
                log().unwrap_or_default()
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        prometheus
    }

    /// `GET /api/v1/{path}` with URL-encoded `params`; the `data` of the answer.
    async fn api(&self, client: &HttpClient, path: &str, params: &[(&str, &str)]) -> Value {
        let query: Vec<String> = params
            .iter()
            .map(|(k, v)| format!("{k}={}", percent_encode(v)))
            .collect();
        let url = format!("{}/api/v1/{path}?{}", self.url, query.join("&"));
        let reply = client.send(Method::GET, &url, &[], Bytes::new()).await;
        let body: Value = serde_json::from_slice(&reply.body)
            .unwrap_or_else(|e| panic!("{url}: not JSON ({e}): {}", reply.text()));
        assert_eq!(body["status"], "success", "{url}: {body}");
        body["data"].clone()
    }

    /// The instant vector of `expr` now.
    async fn query(&self, client: &HttpClient, expr: &str) -> Vec<Value> {
        let data = self.api(client, "query", &[("query", expr)]).await;
        data["result"].as_array().cloned().unwrap_or_default()
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn percent_encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// The rules file with every `for:` hold shortened to `hold`, so that an alert whose
/// condition holds fires within the test. Expressions, labels and annotations are the
/// shipped ones.
fn rules_with_hold(hold: &str) -> String {
    read("deploy/prometheus/rules.yml")
        .lines()
        .map(|line| match line.trim_start().strip_prefix("for: ") {
            Some(_) => {
                let indent = &line[..line.len() - line.trim_start().len()];
                format!("{indent}for: {hold}")
            }
            None => line.to_owned(),
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// Every `expr` in a rules file, with the name of its rule.
fn rule_exprs(rules: &str) -> Vec<(String, String)> {
    let doc: serde_yaml::Value = serde_yaml::from_str(rules).expect("rules are YAML");
    let mut out = Vec::new();
    for group in doc["groups"].as_sequence().expect("groups") {
        for rule in group["rules"].as_sequence().expect("rules") {
            let name = rule["record"]
                .as_str()
                .or(rule["alert"].as_str())
                .expect("a record or alert name");
            let expr = rule["expr"].as_str().expect("expr");
            out.push((name.to_owned(), expr.trim().to_owned()));
        }
    }
    out
}

fn alert_names(rules: &str) -> Vec<String> {
    let doc: serde_yaml::Value = serde_yaml::from_str(rules).expect("rules are YAML");
    doc["groups"]
        .as_sequence()
        .into_iter()
        .flatten()
        .flat_map(|g| g["rules"].as_sequence().cloned().unwrap_or_default())
        .filter_map(|r| r["alert"].as_str().map(str::to_owned))
        .collect()
}

fn config(db: &TestDb, dead_upstream: SocketAddr) -> String {
    let sql = "{ kind = \"sql\", query = \"SELECT sku_id, name, price, updated_at FROM products WHERE sku_id = ?\" }";
    let upstream = "{ kind = \"upstream\" }";
    // (route name and path prefix, filter, mode, origin)
    let routes: String = [
        ("products", "products", "enforce", sql),
        ("tiny", "tiny", "enforce", sql),
        ("broken", "broken", "enforce", sql),
        ("shadow", "products", "shadow", sql),
        ("dead", "products", "enforce", upstream),
    ]
    .iter()
    .map(|(name, filter, mode, origin)| {
        format!(
            "[[routes]]\nname = \"{name}\"\npath = \"/api/{name}/{{id}}\"\nkey = {{ segment = \"id\" }}\n\
             filter = \"{filter}\"\nmode = \"{mode}\"\norigin = {origin}\n\n"
        )
    })
    .collect();
    let products = "SELECT sku_id FROM products";
    let retry = "load_retry_initial = \"1s\"\nload_retry_max = \"5s\"";
    let sync = |table: &str| {
        format!(
            "sync = {{ query = \"SELECT sku_id, updated_at FROM {table} WHERE updated_at >= ?\", interval = \"1s\" }}"
        )
    };
    // (filter name, source query, capacity, further settings)
    let filters: String = [
        ("products", products, 10_000, sync("products")),
        (
            "tiny",
            "SELECT sku_id FROM tiny_src",
            TINY,
            retry.to_owned(),
        ),
        (
            "broken",
            "SELECT sku_id FROM no_such_table",
            100,
            retry.to_owned(),
        ),
        ("stale", products, 10_000, sync("no_such_table")),
    ]
    .iter()
    .map(|(name, source, capacity, extra)| {
        format!(
            "[filters.{name}]\nsource_query = \"{source}\"\nexpected_items = {capacity}\n\
             false_positive_rate = 0.01\nnormalize = {{ kind = \"integer\" }}\n{extra}\n\n"
        )
    })
    .collect();
    format!(
        r#"
[admin]
token = "{TOKEN}"
[database]
url = "{url}"
max_connections = 8
acquire_timeout = "10s"
[upstream]
url = "http://{dead_upstream}"
timeout = "1s"
[cache]
negative_ttl = "2s"
[server]
trusted_proxies = ["127.0.0.1/32"]
[false_positive_budget]
per_client = {BUDGET}
window = "1m"

{filters}
{routes}
"#,
        url = db.url
    )
}

/// Requests of every outcome on every route, until `stop`.
///
/// Each round comes from a client address of its own (reported by the trusted loopback
/// peer in `X-Forwarded-For`), so that no ordinary client reaches the false-positive
/// budget; one hunter, always from the same address, asks `tiny` for a new absent key
/// every round and is throttled once it has used up its budget.
async fn drive(proxy: Arc<TestProxy>, stop: Arc<AtomicBool>) -> BTreeMap<String, u64> {
    let mut seen: BTreeMap<String, u64> = BTreeMap::new();
    let mut round = 0u64;
    while !stop.load(Ordering::Relaxed) {
        let client = std::net::Ipv4Addr::from(0x0a00_0000 | (round as u32 & 0x00ff_ffff));
        let client = client.to_string();
        let present = demo_sku(round % PRODUCTS);
        let absent = demo_absent_sku(round % 20_000);
        let paths = [
            // products: origin_found then cache_hit, intercepted, false positives and
            // their negative hits, and a malformed key (error).
            format!("/api/products/{present}"),
            format!("/api/products/{}", demo_sku(round % 20)),
            format!("/api/products/{absent}"),
            "/api/products/not-a-number".to_owned(),
            // tiny: its saturated filter lets absent keys through.
            format!("/api/tiny/{absent}"),
            format!("/api/tiny/{}", demo_absent_sku(round % 50)),
            // broken: never loaded, so every request fails open.
            format!("/api/broken/{present}"),
            // shadow: the gate's "absent" is only counted.
            format!("/api/shadow/{absent}"),
            // dead: the upstream origin refuses connections.
            format!("/api/dead/{}", demo_sku(round % 7)),
            // not a guarded route: passed through to the (dead) upstream.
            "/elsewhere".to_owned(),
        ];
        let hunt = format!("/api/tiny/{}", demo_absent_sku(1_000_000 + round));
        let requests = paths
            .iter()
            .map(|p| (p.as_str(), client.as_str()))
            .chain([(hunt.as_str(), HUNTER)]);
        for (path, from) in requests {
            let reply = proxy.get_with(path, &[("x-forwarded-for", from)]).await;
            let stage = reply.stage().to_owned();
            *seen
                .entry(format!("{stage} {}", reply.status.as_u16()))
                .or_default() += 1;
        }
        round += 1;
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    seen
}

/// Substitutes the dashboard's template variables with what the running setup has.
fn substitute(expr: &str, instance: &str) -> String {
    expr.replace("$__rate_interval", "20s")
        .replace("$instance", &instance.replace('.', "\\\\."))
        .replace("$route", "products|tiny|broken|shadow|dead")
        .replace("$filter", "products|tiny|broken|stale")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prometheus_evaluates_every_panel_and_rule_and_the_alerts_fire() {
    let Some(server) = mysql_url() else { return };
    promtool(&["check", "config", "deploy/prometheus/prometheus.yml"]);
    promtool(&["check", "rules", "deploy/prometheus/rules.yml"]);

    let db = TestDb::create_heavy(&server, PRODUCTS).await;
    for stmt in [
        "CREATE TABLE tiny_src (sku_id BIGINT UNSIGNED PRIMARY KEY)".to_owned(),
        format!("INSERT INTO tiny_src SELECT sku_id FROM products ORDER BY sku_id LIMIT {TINY}"),
    ] {
        sqlx::query(sqlx::AssertSqlSafe(stmt))
            .execute(&db.admin)
            .await
            .expect("set up tiny_src");
    }
    let dead_upstream: SocketAddr = format!("127.0.0.1:{}", free_port(&[]))
        .parse()
        .expect("address");
    let proxy = Arc::new(TestProxy::spawn(&config(&db, dead_upstream)).await);
    let instance = proxy.admin.to_string();

    // Wait for the filters that can load; `broken` never does.
    let deadline = Instant::now() + Duration::from_secs(60);
    for filter in ["products", "tiny", "stale"] {
        while proxy
            .metric(&format!("bloomgate_filter_ready{{filter=\"{filter}\"}}"))
            .await
            != 1.0
        {
            assert!(Instant::now() < deadline, "filter {filter} did not load");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    // Saturate `tiny`: its source goes away (so the capacity rebuild it triggers fails
    // and the overfull filter keeps serving), then keys flood in through the admin API.
    sqlx::query("DROP TABLE tiny_src")
        .execute(&db.admin)
        .await
        .expect("drop tiny_src");
    let flood: Vec<String> = (0..TINY_FLOOD)
        .map(|i| demo_sku(PRODUCTS + i).to_string())
        .collect();
    let r = proxy
        .admin_post(
            "/admin/filters/tiny/keys",
            Some(TOKEN),
            &format!("[{}]", flood.join(",")),
        )
        .await;
    assert_eq!(r.status.as_u16(), 200, "{}", r.text());

    // `promtool check metrics` on what bloomgate exports, after one request of each kind
    // has created its series.
    let metrics = proxy.admin_get("/metrics").await.text();
    // One finding is expected and kept: `bloomgate_filter_bits` is part of the published
    // metric interface, and it counts the filter's bits (its size m), which promtool's
    // unit lint takes for a data size that should be in bytes. The filter's memory is
    // exported in bytes elsewhere (`/admin/filters`); nothing else may be reported.
    let lint = promtool_lint(&metrics);
    let unexpected: Vec<&str> = lint
        .lines()
        .filter(|l| !l.trim().is_empty())
        .filter(|l| !l.starts_with("bloomgate_filter_bits use base unit \"bytes\""))
        .collect();
    assert!(
        unexpected.is_empty(),
        "promtool check metrics found problems:\n{lint}"
    );

    let unreachable: SocketAddr = format!("127.0.0.1:{}", free_port(&[dead_upstream.port()]))
        .parse()
        .expect("address");
    let prometheus = Prometheus::start(
        &[proxy.admin, unreachable],
        &[dead_upstream.port()],
        &rules_with_hold("2s"),
    )
    .await;
    let client = HttpClient::new();
    let started = Instant::now();

    let stop = Arc::new(AtomicBool::new(false));
    let traffic = tokio::spawn(drive(Arc::clone(&proxy), Arc::clone(&stop)));

    let rules = read("deploy/prometheus/rules.yml");
    let dash = dashboard();
    // Without a [fleet] section there are no fleet series, and without [server.tls] no
    // TLS series: their panels and alerts are left to the promtool rule tests above.
    let mut checks: Vec<(String, String)> = dashboard_queries(&dash)
        .into_iter()
        .filter(|(_, _, expr)| !expr.contains(FLEET_METRICS) && !expr.contains(TLS_METRICS))
        .map(|(title, legend, expr)| (format!("panel {title:?} ({legend})"), expr))
        .collect();
    // The audit's alert has data only once a false negative was counted, the reload
    // alert only once a reload was refused.
    let mut audit_alerts = alerts_of_group(&rules, AUDIT_GROUP);
    audit_alerts.extend(alerts_of_group(&rules, CONFIG_GROUP));
    // Nor has the binlog alert: no filter of this test is in binlog mode.
    audit_alerts.extend(alerts_of_group(&rules, BINLOG_GROUP));
    checks.extend(
        rule_exprs(&rules)
            .into_iter()
            .filter(|(_, expr)| !expr.contains(FLEET_METRICS) && !expr.contains(TLS_METRICS))
            .filter(|(name, _)| !audit_alerts.contains(name))
            .map(|(name, expr)| (format!("rule {name}"), expr)),
    );
    // The breaker alert needs an origin failing for minutes (tests/rules/origins.yml
    // drives it, tests/breaker.rs the breaker itself); the fleet, TLS, audit and reload
    // alerts are driven by their own rule tests (tests/reload.rs refuses real reloads).
    let mut elsewhere = alerts_of_group(&rules, FLEET_GROUP);
    elsewhere.extend(alerts_of_group(&rules, TLS_GROUP));
    elsewhere.extend(alerts_of_group(&rules, ORIGINS_GROUP));
    elsewhere.extend(audit_alerts);
    let alerts: Vec<String> = alert_names(&rules)
        .into_iter()
        .filter(|a| !elsewhere.contains(a))
        .collect();
    assert_eq!(alerts.len(), 8, "{alerts:?}");

    // Poll until every expression has data and every alert fires. The sync-lag alert is
    // the slowest: it needs 30 s without a successful poll.
    let deadline = Instant::now() + Duration::from_secs(150);
    let (empty, not_firing, took) = loop {
        let mut empty = Vec::new();
        for (what, expr) in &checks {
            if prometheus
                .query(&client, &substitute(expr, &instance))
                .await
                .is_empty()
            {
                empty.push(what.clone());
            }
        }
        let data = prometheus.api(&client, "alerts", &[]).await;
        let firing: BTreeSet<String> = data["alerts"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|a| a["state"] == "firing")
            .filter_map(|a| a["labels"]["alertname"].as_str().map(str::to_owned))
            .collect();
        let not_firing: Vec<String> = alerts
            .iter()
            .filter(|a| !firing.contains(*a))
            .cloned()
            .collect();
        if (empty.is_empty() && not_firing.is_empty()) || Instant::now() > deadline {
            break (empty, not_firing, started.elapsed());
        }
        tokio::time::sleep(Duration::from_secs(2)).await;
    };
    let panels_out = std::env::var_os("BLOOMGATE_PANELS_OUT");
    if panels_out.is_some() {
        // For the picture: a stretch of steady traffic after everything fired.
        tokio::time::sleep(Duration::from_secs(40)).await;
    }
    stop.store(true, Ordering::Relaxed);
    let seen = traffic.await.expect("traffic task");
    eprintln!("responses by x-bloomgate stage and status: {seen:?}");
    eprintln!(
        "{} of {} expressions answered and {} of {} alerts fired after {:.1} s",
        checks.len() - empty.len(),
        checks.len(),
        alerts.len() - not_firing.len(),
        alerts.len(),
        took.as_secs_f64()
    );
    assert!(empty.is_empty(), "expressions with no data: {empty:#?}");
    assert!(
        not_firing.is_empty(),
        "alerts that never fired: {not_firing:?}"
    );

    // Each alert fired for the part that was made to fail, and only for it.
    let data = prometheus.api(&client, "alerts", &[]).await;
    let mut firing: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for a in data["alerts"].as_array().into_iter().flatten() {
        if a["state"] != "firing" {
            continue;
        }
        let labels = &a["labels"];
        let subject = ["route", "filter", "instance"]
            .iter()
            .find_map(|l| labels[*l].as_str())
            .unwrap_or_default()
            .to_owned();
        let name = labels["alertname"].as_str().unwrap_or_default().to_owned();
        eprintln!("firing: {name} {subject}: {}", a["annotations"]["summary"]);
        firing.entry(name).or_default().insert(subject);
    }
    let only = |name: &str, subjects: &[&str]| {
        let expected: BTreeSet<String> = subjects.iter().map(|s| (*s).to_owned()).collect();
        assert_eq!(firing.get(name), Some(&expected), "{name}");
    };
    only("BloomgateDown", &[&unreachable.to_string()]);
    only("BloomgateFilterNotReady", &["broken"]);
    only("BloomgateFalsePositiveRateHigh", &["tiny"]);
    only("BloomgateFilterNearCapacity", &["tiny"]);
    only("BloomgateSyncLagging", &["stale"]);
    only("BloomgateFailingOpen", &["broken"]);
    only("BloomgateOriginErrors", &["dead"]);
    only("BloomgateClientsThrottled", &["tiny"]);

    // The recorded rates carry the numbers the alerts compare.
    let value = |v: &Value| -> f64 {
        v["value"][1]
            .as_str()
            .and_then(|s| s.parse().ok())
            .unwrap_or(f64::NAN)
    };
    let by_route = |rows: Vec<Value>| -> BTreeMap<String, f64> {
        rows.iter()
            .map(|r| {
                (
                    r["metric"]["route"].as_str().unwrap_or_default().to_owned(),
                    value(r),
                )
            })
            .collect()
    };
    let observed = by_route(
        prometheus
            .query(&client, "route:bloomgate_observed_fpp:ratio_rate5m")
            .await,
    );
    let intercept = by_route(
        prometheus
            .query(&client, "route:bloomgate_intercept:ratio_rate5m")
            .await,
    );
    eprintln!("observed false-positive rate by route: {observed:?}");
    eprintln!("intercept rate by route: {intercept:?}");
    assert!(observed["tiny"] > 0.5, "{observed:?}");
    assert!(observed["products"] < 0.05, "{observed:?}");
    assert!(intercept["products"] > 0.1, "{intercept:?}");
    assert_eq!(intercept["broken"], 0.0, "{intercept:?}");

    if let Some(out) = panels_out {
        save_panels(
            &prometheus,
            &client,
            &dash,
            &instance,
            started,
            Path::new(&out),
        )
        .await;
    }
}

/// Range queries of every dashboard panel over the run, for scripts/render-dashboard.
async fn save_panels(
    prometheus: &Prometheus,
    client: &HttpClient,
    dash: &Value,
    instance: &str,
    started: Instant,
    out: &Path,
) {
    let end = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock after 1970")
        .as_secs_f64();
    let start = end - started.elapsed().as_secs_f64();
    let (start, end) = (format!("{start:.3}"), format!("{end:.3}"));
    let mut panels = Vec::new();
    for p in all_panels(dash) {
        if p["type"] == "row" {
            continue;
        }
        let mut series = Vec::new();
        for t in p["targets"].as_array().into_iter().flatten() {
            let expr = substitute(t["expr"].as_str().unwrap_or_default(), instance);
            let data = prometheus
                .api(
                    client,
                    "query_range",
                    &[
                        ("query", &expr),
                        ("start", &start),
                        ("end", &end),
                        ("step", "1"),
                    ],
                )
                .await;
            series.push(serde_json::json!({
                "legend": t["legendFormat"],
                "result": data["result"],
            }));
        }
        panels.push(serde_json::json!({
            "title": p["title"],
            "unit": p["fieldConfig"]["defaults"]["unit"],
            "type": p["type"],
            "targets": series,
        }));
    }
    let doc = serde_json::json!({ "start": start, "end": end, "panels": panels });
    std::fs::write(out, serde_json::to_string(&doc).expect("JSON")).expect("write panels");
    eprintln!("panel data written to {}", out.display());
}
