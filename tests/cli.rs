//! The real `bloomgate` binary: config errors name the field and exit 2, `check-config`
//! validates without starting, and SIGTERM drains in-flight requests before exiting 0.

mod support;

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use support::{ChildGuard, StubUpstream};
use tempfile::TempDir;

const BIN: &str = env!("CARGO_BIN_EXE_bloomgate");

const VALID: &str = r#"
[server]
listen = "127.0.0.1:0"
[admin]
listen = "127.0.0.1:0"
[database]
url = "sqlite://data/never-opened.db"
[filters.products]
source_query = "SELECT sku_id FROM products"
expected_items = 1000
[[routes]]
path = "/api/products/{id}"
key = { segment = "id" }
filter = "products"
origin = { kind = "sql", query = "SELECT * FROM products WHERE sku_id = ?" }
"#;

/// A config file in a temporary directory that is removed when this is dropped.
struct TempConfig {
    _dir: TempDir,
    path: PathBuf,
}

impl TempConfig {
    fn to_str(&self) -> Option<&str> {
        self.path.to_str()
    }
}

fn write_config(name: &str, text: &str) -> TempConfig {
    let dir = TempDir::new().expect("temp dir");
    let path = dir.path().join(name);
    std::fs::write(&path, text).expect("write config");
    TempConfig { _dir: dir, path }
}

fn run(args: &[&str], env: &[(&str, &str)]) -> (i32, String) {
    let out = support::output_within(
        Command::new(BIN).args(args).envs(env.iter().copied()),
        Duration::from_secs(60),
    );
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.code().unwrap_or(-1), text)
}

#[test]
fn check_config_accepts_the_shipped_examples() {
    for file in ["config.toml", "config.compose.toml"] {
        let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(file);
        let (code, out) = run(
            &[
                "check-config",
                "--config",
                path.to_str().unwrap_or_default(),
            ],
            &[],
        );
        assert_eq!(code, 0, "{file}: {out}");
        assert!(out.contains("ok"), "{out}");
    }
}

#[test]
fn bad_configs_are_refused_with_the_field_named_and_exit_2() {
    let cases = [
        (
            "unknown field",
            VALID.replace("[server]", "[server]\nlisten_addr = \"x\""),
            "listen_addr",
        ),
        (
            "bad duration",
            format!("{VALID}\n[cache]\nnegative_ttl = \"thirty seconds\"\n"),
            "cache.negative_ttl",
        ),
        (
            "missing lookup query",
            VALID.replace(
                r#"origin = { kind = "sql", query = "SELECT * FROM products WHERE sku_id = ?" }"#,
                r#"origin = { kind = "sql" }"#,
            ),
            "query",
        ),
        (
            "lookup query without placeholder",
            VALID.replace("sku_id = ?", "sku_id = 1"),
            "routes[0].origin.query",
        ),
    ];
    for (what, text, field) in cases {
        let path = write_config("bad.toml", &text);
        let p = path.to_str().unwrap_or_default();
        for cmd in ["check-config", "serve"] {
            let (code, out) = run(&[cmd, "--config", p], &[]);
            assert_eq!(code, 2, "{what} via {cmd}: exit {code}: {out}");
            assert!(
                out.contains(field),
                "{what} via {cmd}: `{field}` not named in: {out}"
            );
        }
    }
}

#[test]
fn check_config_prints_every_problem_of_a_file_at_once() {
    let text = r#"
[server]
listen = "127.0.0.1:0"
max_body_bytes = 0
[admin]
listen = "127.0.0.1:0"
token = "short"
[upstream]
url = "http://127.0.0.1:3000"
[database]
url = "sqlite://data/never-opened.db"
[filters.products]
source_query = "SELECT sku_id FROM products"
expected_items = 1000
false_positive_rate = 1.5
[[routes]]
path = "/api/products/{sku}"
key = { segment = "id" }
filter = "products"
origin = { kind = "sql", query = "SELECT * FROM products WHERE sku_id = ?" }
[[write_through]]
path = "/api/products"
methods = ["POST", "NOT A METHOD"]
filter = "products"
key = { header = "location" }
"#;
    let path = write_config("several.toml", text);
    let p = path.to_str().unwrap_or_default();
    let fields = [
        "server.max_body_bytes",
        "admin.token",
        "filters.products.false_positive_rate",
        "routes[0].path",
        "write_through[0].methods",
    ];
    for cmd in ["check-config", "serve"] {
        let (code, out) = run(&[cmd, "--config", p], &[]);
        assert_eq!(code, 2, "{cmd}: {out}");
        let lines: Vec<&str> = out.lines().collect();
        assert!(
            lines[0].ends_with("invalid config (5 problems):"),
            "{cmd}: {out}"
        );
        assert_eq!(lines.len(), 1 + fields.len(), "{cmd}: {out}");
        for (line, field) in lines[1..].iter().zip(fields) {
            assert!(
                line.trim_start().starts_with(&format!("{field}: ")),
                "{cmd}: `{field}` not on its own line in: {out}"
            );
        }
    }
}

#[test]
fn environment_variables_override_the_file() {
    let path = write_config("ok.toml", VALID);
    let p = path.to_str().unwrap_or_default();
    let (code, out) = run(
        &["check-config", "--config", p],
        &[("BLOOMGATE__CACHE__TTL", "soon")],
    );
    assert_eq!(code, 2, "{out}");
    assert!(out.contains("cache.ttl"), "{out}");
    let (code, out) = run(
        &["check-config", "--config", p],
        &[("BLOOMGATE__FILTERS__PRODUCTS__FALSE_POSITIVE_RATE", "2")],
    );
    assert_eq!(code, 2, "{out}");
    assert!(
        out.contains("filters.products.false_positive_rate"),
        "{out}"
    );
    let (code, out) = run(
        &["check-config", "--config", p],
        &[("BLOOMGATE__CACHE__TTL", "90s")],
    );
    assert_eq!(code, 0, "{out}");
}

#[test]
fn an_all_digit_token_from_the_environment_is_text() {
    let path = write_config("ok.toml", VALID);
    let p = path.to_str().unwrap_or_default();
    let (code, out) = run(
        &["check-config", "--config", p],
        &[("BLOOMGATE__ADMIN__TOKEN", "00123456")],
    );
    assert_eq!(code, 0, "{out}");
    // Read as text, so the token rule sees it: too short, not a type error.
    let (code, out) = run(
        &["check-config", "--config", p],
        &[("BLOOMGATE__ADMIN__TOKEN", "1234")],
    );
    assert_eq!(code, 2, "{out}");
    assert!(
        out.contains("admin.token: must be at least 8 characters"),
        "{out}"
    );
    // Number fields still read numbers, and still refuse text.
    let (code, out) = run(
        &["check-config", "--config", p],
        &[("BLOOMGATE__SERVER__MAX_BODY_BYTES", "0")],
    );
    assert_eq!(code, 2, "{out}");
    assert!(
        out.contains("server.max_body_bytes: must be greater than 0"),
        "{out}"
    );
    let (code, out) = run(
        &["check-config", "--config", p],
        &[("BLOOMGATE__SERVER__MAX_BODY_BYTES", "plenty")],
    );
    assert_eq!(code, 2, "{out}");
    assert!(out.contains("server.max_body_bytes"), "{out}");
}

/// Waits for a JSON log line whose `fields` satisfy `wanted`; returns those fields.
fn wait_for_log(
    lines: &std::sync::mpsc::Receiver<String>,
    what: &str,
    wanted: impl Fn(&serde_json::Value) -> bool,
) -> serde_json::Value {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let line = lines
            .recv_timeout(left)
            .unwrap_or_else(|e| panic!("bloomgate did not log {what} within 30 s: {e}"));
        let v: serde_json::Value = serde_json::from_str(&line).expect("JSON log line");
        if wanted(&v["fields"]) {
            return v["fields"].clone();
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_finishes_in_flight_requests_then_exits_0() {
    let stub = StubUpstream::start([]).await;
    // A grace far longer than the test may take: exiting proves the drain ended because
    // the last request finished, not because the grace ran out.
    let config = format!(
        "[server]\nlisten = \"127.0.0.1:0\"\nshutdown_grace = \"60s\"\n[admin]\nlisten = \"127.0.0.1:0\"\n[upstream]\nurl = \"{}\"\ntimeout = \"60s\"\n",
        stub.url()
    );
    let path = write_config("term.toml", &config);
    let mut child = ChildGuard::spawn(
        Command::new(BIN)
            .args([
                "serve",
                "--config",
                path.to_str().unwrap_or_default(),
                "--log-format",
                "json",
            ])
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit()),
    );
    let stdout = child.stdout.take().expect("stdout");
    let (tx, lines) = std::sync::mpsc::channel::<String>();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let listening = wait_for_log(&lines, "its address", |f| f["data"].is_string());
    let data = listening["data"].as_str().unwrap_or_default().to_owned();

    // A pass-through request that the upstream holds until the test lets it go.
    let (arrived, release) = stub.hold_next();
    let client = support::HttpClient::new();
    let url = format!("http://{data}/held");
    let in_flight = tokio::spawn(async move {
        client
            .send(http::Method::GET, &url, &[], bytes::Bytes::new())
            .await
    });
    tokio::time::timeout(Duration::from_secs(30), arrived)
        .await
        .expect("the request reached the upstream within 30 s")
        .expect("the stub signals the request");

    let pid = child.id().to_string();
    let status = Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .expect("kill");
    assert!(status.success());
    wait_for_log(&lines, "the start of its shutdown", |f| {
        f["message"] == "shutting down"
    });
    // Draining: the request is still held, and so bloomgate still runs.
    assert!(!in_flight.is_finished());
    assert!(child.try_wait().expect("wait").is_none());

    let _ = release.send(());
    let reply = in_flight.await.expect("join");
    assert_eq!(reply.status.as_u16(), 200, "in-flight request finished");
    assert_eq!(reply.stage(), "bypass");
    let deadline = Instant::now() + Duration::from_secs(30);
    let code = loop {
        if let Some(s) = child.try_wait().expect("wait") {
            break s.code();
        }
        assert!(
            Instant::now() < deadline,
            "bloomgate did not exit within 30 s of its last request finishing"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(code, Some(0));
    // New connections are refused once it has stopped.
    assert!(std::net::TcpStream::connect(&data).is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn filter_build_writes_a_snapshot_that_inspect_verifies() {
    let Some(server) = support::mysql_url() else {
        return;
    };
    let db = support::TestDb::create(&server, 5_000).await;
    let dir = TempDir::new().expect("temp dir");
    // A directory that does not exist yet: the build creates it.
    let out = dir.path().join("snapshots").join("products.bloom");
    let config = support::TestConfig::new(&db.url)
        .expected_items(5000)
        .sync_query(support::SYNC_QUERY)
        .toml();
    let path = write_config("build.toml", &config);
    let (code, text) = run(
        &[
            "filter",
            "build",
            "--config",
            path.to_str().unwrap_or_default(),
            "--out",
            out.to_str().unwrap_or_default(),
        ],
        &[],
    );
    assert_eq!(code, 0, "{text}");
    assert!(text.contains("5000 rows"), "{text}");
    let (code, text) = run(
        &["filter", "inspect", out.to_str().unwrap_or_default()],
        &[],
    );
    assert_eq!(code, 0, "{text}");
    assert!(text.contains("sized for      5000 keys"), "{text}");
    assert!(text.contains("watermark      timestamp"), "{text}");
    assert!(!text.contains("seed"), "the seed is a secret: {text}");

    let mut bytes = std::fs::read(&out).expect("read snapshot");
    let last = bytes.len() - 10;
    bytes[last] ^= 1;
    std::fs::write(&out, &bytes).expect("corrupt snapshot");
    let (code, text) = run(
        &["filter", "inspect", out.to_str().unwrap_or_default()],
        &[],
    );
    assert_ne!(code, 0);
    assert!(text.contains("corrupted"), "{text}");
}

#[test]
fn check_config_explains_what_a_binlog_source_needs_and_refuses_one_that_cannot_be_followed() {
    let binlog = VALID
        .replace(
            "url = \"sqlite://data/never-opened.db\"",
            "url = \"mysql://app:app-secret@db.internal:3306/shop\"",
        )
        .replace(
            "expected_items = 1000\n",
            "expected_items = 1000\n[filters.products.sync]\nwatermark = \"binlog\"\n",
        );
    let path = write_config("binlog.toml", &binlog);
    let (code, out) = run(
        &[
            "check-config",
            "--config",
            path.to_str().unwrap_or_default(),
        ],
        &[],
    );
    assert_eq!(code, 0, "{out}");
    for said in [
        "filters.products: binlog mode follows products (key column sku_id)",
        "binlog_format = ROW",
        "binlog_row_image = FULL",
        "REPLICATION SLAVE, REPLICATION CLIENT and SELECT",
        "mysql://app:***@db.internal:3306/shop",
    ] {
        assert!(out.contains(said), "`{said}` not in: {out}");
    }
    assert!(!out.contains("app-secret"), "the password is shown: {out}");
    // A source the log cannot follow, and a database without a binary log.
    for (text, field, reason) in [
        (
            binlog.replace("FROM products\"", "FROM products WHERE live = 1\""),
            "filters.products.source_query",
            "SELECT key_column FROM table",
        ),
        (
            binlog.replace(
                "url = \"mysql://app:app-secret@db.internal:3306/shop\"",
                "url = \"sqlite://data/never-opened.db\"",
            ),
            "filters.products.sync.watermark",
            "needs a MySQL or MariaDB database",
        ),
    ] {
        let path = write_config("bad-binlog.toml", &text);
        let (code, out) = run(
            &[
                "check-config",
                "--config",
                path.to_str().unwrap_or_default(),
            ],
            &[],
        );
        assert_eq!(code, 2, "{out}");
        assert!(
            out.contains(field) && out.contains(reason),
            "{field}: {out}"
        );
    }
}
