//! The README's quick start, run as a new user would run it: every TOML block passes
//! `check-config`, and each path that starts from a table of one's own (the SQL block, then
//! the shell block with `bloomgate init` and `bloomgate serve`) is run as written against a
//! real MariaDB. The config file that `init` writes must be the one the README shows, and
//! every `curl` the README shows must get the status line, headers and body it shows.
//!
//! What is substituted, and nothing else: the database URL of the
//! `export BLOOMGATE__DATABASE__URL=` line (the test's own database; the file shows it
//! without its password), the data-plane address `127.0.0.1:8080` and the
//! upstream's `127.0.0.1:8000` (free ports), and `cargo build` lines are skipped (the
//! binary under test is already built). Timestamps in JSON bodies are compared by shape.

mod support;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::Full;
use hyper::body::Incoming;
use serde_json::Value;
use sqlx::{AssertSqlSafe, Row};
use support::{TestDb, mysql_url};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::net::TcpListener;
use tokio::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_bloomgate");
const README: &str = include_str!("../README.md");

/// A fenced block of the quick start, with the `###` heading it stands under.
#[derive(Debug, Clone)]
struct Block {
    heading: String,
    lang: String,
    text: String,
}

/// The `## Quick start` section, up to the next `## ` heading.
fn quick_start() -> &'static str {
    let start = README
        .find("\n## Quick start\n")
        .expect("README has a `## Quick start` section");
    let rest = &README[start + 1..];
    let end = rest[3..].find("\n## ").map_or(rest.len(), |i| i + 4);
    &rest[..end]
}

/// Every fenced block of `text`, in order.
fn blocks(text: &str) -> Vec<Block> {
    let mut out = Vec::new();
    let mut heading = String::new();
    let mut open: Option<(String, String)> = None;
    for line in text.lines() {
        if let Some((lang, body)) = open.as_mut() {
            if line.trim_start().starts_with("```") {
                out.push(Block {
                    heading: heading.clone(),
                    lang: std::mem::take(lang),
                    text: std::mem::take(body),
                });
                open = None;
            } else {
                body.push_str(line);
                body.push('\n');
            }
        } else if let Some(fence) = line.trim_start().strip_prefix("```") {
            open = Some((fence.trim().to_owned(), String::new()));
        } else if let Some(h) = line.strip_prefix("### ") {
            heading = h.trim().to_owned();
        }
    }
    assert!(open.is_none(), "an unclosed code fence in the quick start");
    out
}

/// The logical lines of a shell block: continuations joined, comments and blanks dropped.
fn shell_lines(text: &str) -> Vec<String> {
    let mut lines = Vec::new();
    let mut current = String::new();
    for raw in text.lines() {
        let line = raw.trim();
        if current.is_empty() && (line.is_empty() || line.starts_with('#')) {
            continue;
        }
        match line.strip_suffix('\\') {
            Some(head) => {
                current.push_str(head.trim_end());
                current.push(' ');
            }
            None => {
                current.push_str(line);
                lines.push(std::mem::take(&mut current));
            }
        }
    }
    lines
}

/// The line that exports the database URL, which `init` reads and `serve` takes over the
/// file's `database.url` (the file holds no password).
const EXPORT: &str = "export BLOOMGATE__DATABASE__URL=";

/// The value of the [`EXPORT`] line, quotes removed.
fn exported_url(line: &str) -> Option<String> {
    let value = line.strip_prefix(EXPORT)?;
    Some(value.trim_matches(|c| c == '\'' || c == '"').to_owned())
}

/// A URL with its password (if any) left out, as `init` writes it into the file.
fn without_password(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_owned();
    };
    let (authority, tail) = rest.split_at(rest.find(['/', '?']).unwrap_or(rest.len()));
    match authority.rsplit_once('@') {
        Some((userinfo, host)) => {
            let user = userinfo.split_once(':').map_or(userinfo, |(u, _)| u);
            format!("{scheme}://{user}@{host}{tail}")
        }
        None => url.to_owned(),
    }
}

/// A `$ curl …` exchange shown in a console block: the command and what it printed.
#[derive(Debug)]
struct Exchange {
    command: String,
    output: Vec<String>,
}

fn exchanges(text: &str) -> Vec<Exchange> {
    let mut out: Vec<Exchange> = Vec::new();
    for line in text.lines() {
        if let Some(cmd) = line.strip_prefix("$ ") {
            out.push(Exchange {
                command: cmd.to_owned(),
                output: Vec::new(),
            });
        } else if let Some(last) = out.last_mut() {
            last.output.push(line.to_owned());
        }
    }
    for e in &mut out {
        while e.output.last().is_some_and(|l| l.trim().is_empty()) {
            e.output.pop();
        }
    }
    out
}

#[test]
fn the_quick_start_has_the_three_paths() {
    let blocks = blocks(quick_start());
    let has = |needle: &str| blocks.iter().any(|b| b.text.contains(needle));
    assert!(has("cargo run --release -- demo"), "the demo command");
    assert!(has("scripts/test"), "the test command");
    let inits: Vec<_> = blocks
        .iter()
        .filter(|b| b.lang == "sh" && b.text.contains("bloomgate init"))
        .collect();
    assert!(
        inits.iter().any(|b| !b.text.contains("--upstream")),
        "a path in front of one's own database"
    );
    assert!(
        inits.iter().any(|b| b.text.contains("--upstream")),
        "a path in front of one's own upstream API"
    );
    for b in blocks.iter().filter(|b| b.lang == "toml") {
        let lines = b
            .text
            .lines()
            .filter(|l| !l.trim().is_empty() && !l.trim_start().starts_with('#'))
            .count();
        assert!(
            lines <= 20,
            "a config shown in the quick start ({}) has {lines} lines, more than 20",
            b.heading
        );
    }
}

#[test]
fn every_toml_block_of_the_quick_start_passes_check_config() {
    let dir = tempfile::tempdir().expect("temp dir");
    let tomls: Vec<_> = blocks(quick_start())
        .into_iter()
        .filter(|b| b.lang == "toml")
        .collect();
    assert!(!tomls.is_empty(), "the quick start shows its configs");
    for (i, block) in tomls.iter().enumerate() {
        let path = dir.path().join(format!("block{i}.toml"));
        std::fs::write(&path, &block.text).expect("write block");
        let out = clean_command(BIN)
            .arg("check-config")
            .arg("--config")
            .arg(&path)
            .as_std_mut()
            .output()
            .expect("run check-config");
        assert!(
            out.status.success(),
            "the TOML block under `{}` fails check-config:\n{}{}\n{}",
            block.heading,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr),
            block.text
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_front_of_your_database_as_written() {
    run_path(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_front_of_your_upstream_api_as_written() {
    run_path(true).await;
}

/// Runs the quick-start path whose `init` has (or lacks) `--upstream`: the SQL blocks on
/// a fresh database, the shell block in a fresh directory, then every `curl` shown under
/// the same heading.
async fn run_path(upstream: bool) {
    let Some(server) = mysql_url() else { return };
    let all = blocks(quick_start());
    let script = all
        .iter()
        .find(|b| {
            b.lang == "sh"
                && b.text.contains("bloomgate init")
                && b.text.contains("--upstream") == upstream
        })
        .expect("the path's shell block");
    let heading = script.heading.clone();
    let under: Vec<&Block> = all.iter().filter(|b| b.heading == heading).collect();

    // The user's own table, as the README creates it.
    let db = TestDb::create(&server, 0).await;
    let sql: Vec<&Block> = all.iter().filter(|b| b.lang == "sql").collect();
    assert!(
        !sql.is_empty(),
        "the quick start creates a table of its own"
    );
    for block in &sql {
        for stmt in block.text.split(";\n").map(str::trim) {
            if stmt.is_empty() {
                continue;
            }
            sqlx::raw_sql(AssertSqlSafe(stmt.to_owned()))
                .execute(&db.admin)
                .await
                .unwrap_or_else(|e| panic!("README SQL `{stmt}`: {e}"));
        }
    }

    // The commands, from the first block up to this one for the exports, then this one.
    let mut placeholder = None;
    let mut lines = Vec::new();
    for block in all.iter().filter(|b| b.lang == "sh") {
        let own = std::ptr::eq(block, script);
        for line in shell_lines(&block.text) {
            if let Some(url) = exported_url(&line) {
                placeholder = Some(url);
                lines.push(format!("{EXPORT}'{}'", db.url));
            } else if own && !line.starts_with("cargo ") {
                lines.push(line);
            }
        }
        if own {
            break;
        }
    }
    let placeholder = placeholder.expect("the quick start exports BLOOMGATE__DATABASE__URL");
    let serve = lines.pop().expect("the block ends with serve");
    assert!(
        serve.contains("bloomgate serve"),
        "the path's shell block ends with `bloomgate serve`: {serve}"
    );

    // A real upstream API of one's own, answering from the same table.
    let api = if upstream {
        Some(OwnApi::start(&db).await)
    } else {
        None
    };
    if let Some(api) = &api {
        for line in &mut lines {
            *line = line.replace("127.0.0.1:8000", &api.addr.to_string());
        }
    }

    let dir = tempfile::tempdir().expect("temp dir");
    let bin_dir = dir.path().join("target/release");
    std::fs::create_dir_all(&bin_dir).expect("bin dir");
    std::os::unix::fs::symlink(BIN, bin_dir.join("bloomgate")).expect("link the binary");

    let before = lines.join("\n");
    let out = clean_command("bash")
        .args(["-euo", "pipefail", "-c", &before])
        .current_dir(dir.path())
        .output()
        .await
        .expect("run the README's commands");
    assert!(
        out.status.success(),
        "the README's commands under `{heading}` failed:\n{before}\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );

    // The file init wrote is the one the README shows.
    let shown = under
        .iter()
        .find(|b| b.lang == "toml")
        .unwrap_or_else(|| panic!("`{heading}` shows the config init writes"));
    let written_name = init_output(&before).unwrap_or_else(|| "bloomgate.toml".to_owned());
    let written = std::fs::read_to_string(dir.path().join(&written_name)).expect("init's file");
    let mut expected = shown
        .text
        .replace(&without_password(&placeholder), &without_password(&db.url));
    if let Some(api) = &api {
        expected = expected.replace("127.0.0.1:8000", &api.addr.to_string());
    }
    assert_eq!(
        written.trim_end(),
        expected.trim_end(),
        "the config init writes differs from the one the README shows under `{heading}`"
    );

    // serve, as written, after the exports, with free ports and JSON logs to find them.
    let exports: Vec<&str> = lines
        .iter()
        .map(String::as_str)
        .filter(|l| l.starts_with("export "))
        .collect();
    let script = format!("{}\nexec {serve}", exports.join("\n"));
    let mut child = clean_command("bash")
        .args(["-euo", "pipefail", "-c", &script])
        .current_dir(dir.path())
        .env("BLOOMGATE__SERVER__LISTEN", "127.0.0.1:0")
        .env("BLOOMGATE__ADMIN__LISTEN", "127.0.0.1:0")
        .env("BLOOMGATE__LOG__FORMAT", "json")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        .spawn()
        .expect("start serve");
    let (data, admin) = listening(&mut child).await;
    wait_ready(admin).await;

    let shown: Vec<Exchange> = under
        .iter()
        .filter(|b| b.lang == "console")
        .flat_map(|b| exchanges(&b.text))
        .filter(|e| e.command.starts_with("curl "))
        .collect();
    assert!(
        shown.len() >= 2,
        "`{heading}` shows at least a found and an intercepted key"
    );
    assert!(
        shown
            .iter()
            .any(|e| e.output.iter().any(|l| l == "x-bloomgate: intercepted")),
        "`{heading}` shows a key the gate refuses"
    );
    for exchange in &shown {
        let command = exchange
            .command
            .replace("127.0.0.1:8080", &data.to_string());
        let out = Command::new("bash")
            .args(["-c", &command])
            .output()
            .await
            .expect("run curl");
        let got = String::from_utf8_lossy(&out.stdout).replace("\r\n", "\n");
        compare_exchange(&exchange.command, &exchange.output, &got);
    }
    let _ = child.kill().await;
}

/// The `-o FILE` of the init line, if any.
fn init_output(script: &str) -> Option<String> {
    let line = script.lines().find(|l| l.contains("bloomgate init"))?;
    let mut words = line.split_whitespace();
    while let Some(w) = words.next() {
        if w == "-o" || w == "--output" {
            return words.next().map(|s| s.trim_matches('\'').to_owned());
        }
    }
    None
}

/// The README's shown output against curl's: the status line, every header shown (by
/// name, value compared), and the body (JSON compared as values, timestamps by shape).
fn compare_exchange(command: &str, shown: &[String], got: &str) {
    let (got_head, got_body) = got.split_once("\n\n").unwrap_or((got, ""));
    let mut got_lines = got_head.lines();
    let got_status = got_lines.next().unwrap_or_default();
    let got_headers: BTreeMap<String, String> = got_lines
        .filter_map(|l| l.split_once(':'))
        .map(|(n, v)| (n.trim().to_ascii_lowercase(), v.trim().to_owned()))
        .collect();
    let blank = shown.iter().position(|l| l.trim().is_empty());
    let (head, body) = match blank {
        Some(i) => (&shown[..i], shown[i + 1..].join("\n")),
        None => (shown, String::new()),
    };
    assert_eq!(
        head.first().map(String::as_str),
        Some(got_status.trim()),
        "status line of `{command}`"
    );
    for line in &head[1..] {
        let (name, value) = line.split_once(':').expect("a shown header line");
        let name = name.trim().to_ascii_lowercase();
        assert_eq!(
            got_headers.get(&name).map(String::as_str),
            Some(value.trim()),
            "header `{name}` of `{command}`; got:\n{got}"
        );
    }
    let body = body.trim();
    if body.is_empty() {
        return;
    }
    let want: Value = serde_json::from_str(body)
        .unwrap_or_else(|e| panic!("the README's body of `{command}` is not JSON: {e}"));
    let have: Value = serde_json::from_str(got_body.trim())
        .unwrap_or_else(|e| panic!("the body of `{command}` is not JSON ({e}): {got_body}"));
    assert!(
        same_json(&want, &have),
        "body of `{command}`:\n README: {want}\n    got: {have}"
    );
}

/// Equal JSON, except that two strings that both read as timestamps are equal.
fn same_json(a: &Value, b: &Value) -> bool {
    match (a, b) {
        (Value::Object(x), Value::Object(y)) => {
            x.len() == y.len()
                && x.iter()
                    .all(|(k, v)| y.get(k).is_some_and(|w| same_json(v, w)))
        }
        (Value::Array(x), Value::Array(y)) => {
            x.len() == y.len() && x.iter().zip(y).all(|(v, w)| same_json(v, w))
        }
        (Value::String(x), Value::String(y)) => x == y || (timestamp(x) && timestamp(y)),
        _ => a == b,
    }
}

fn timestamp(s: &str) -> bool {
    chrono::DateTime::parse_from_rfc3339(s).is_ok()
}

/// A command with no `BLOOMGATE__…` or `RUST_LOG` inherited from the test's environment.
fn clean_command(program: impl AsRef<std::ffi::OsStr>) -> Command {
    let mut cmd = Command::new(program);
    cmd.env_remove("RUST_LOG");
    for (name, _) in std::env::vars_os() {
        if name.to_string_lossy().starts_with("BLOOMGATE__") {
            cmd.env_remove(name);
        }
    }
    cmd
}

/// The addresses from serve's "bloomgate listening" line.
async fn listening(child: &mut tokio::process::Child) -> (SocketAddr, SocketAddr) {
    let stdout = child.stdout.take().expect("stdout");
    let mut lines = BufReader::new(stdout).lines();
    let found = tokio::time::timeout(Duration::from_secs(60), async {
        while let Ok(Some(line)) = lines.next_line().await {
            let Ok(v) = serde_json::from_str::<Value>(&line) else {
                continue;
            };
            if v["fields"]["message"] == "bloomgate listening" {
                let addr = |k: &str| {
                    v["fields"][k]
                        .as_str()
                        .and_then(|s| s.parse::<SocketAddr>().ok())
                };
                if let (Some(d), Some(a)) = (addr("data"), addr("admin")) {
                    // Keep draining so the child never blocks on a full pipe.
                    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
                    return Some((d, a));
                }
            }
        }
        None
    })
    .await;
    found
        .ok()
        .flatten()
        .expect("serve logs its addresses within 60 s")
}

/// Polls `/readyz` until it answers 200 (60 s at most).
async fn wait_ready(admin: SocketAddr) {
    let client = support::HttpClient::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let reply = client
            .send(
                http::Method::GET,
                &format!("http://{admin}/readyz"),
                &[],
                Bytes::new(),
            )
            .await;
        if reply.status == StatusCode::OK {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "not ready within 60 s"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The user's own API in the upstream path: `GET /api/articles/{id}` answers the row's
/// id and title as JSON, 404 for an id the table does not hold.
struct OwnApi {
    addr: SocketAddr,
}

impl OwnApi {
    async fn start(db: &TestDb) -> OwnApi {
        let rows = sqlx::query("SELECT article_id, title FROM articles")
            .fetch_all(&db.admin)
            .await
            .expect("read the README's table");
        let titles: Arc<BTreeMap<u64, String>> = Arc::new(
            rows.iter()
                .map(|r| (r.get::<u64, _>(0), r.get::<String, _>(1)))
                .collect(),
        );
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind api");
        let addr = listener.local_addr().expect("api addr");
        tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    return;
                };
                let titles = Arc::clone(&titles);
                tokio::spawn(async move {
                    let service = hyper::service::service_fn(move |req: Request<Incoming>| {
                        let titles = Arc::clone(&titles);
                        async move { Ok::<_, std::convert::Infallible>(answer(&titles, &req)) }
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                        .await;
                });
            }
        });
        OwnApi { addr }
    }
}

fn answer(titles: &BTreeMap<u64, String>, req: &Request<Incoming>) -> Response<Full<Bytes>> {
    let found = req
        .uri()
        .path()
        .strip_prefix("/api/articles/")
        .and_then(|id| id.parse::<u64>().ok())
        .and_then(|id| titles.get(&id).map(|t| (id, t)));
    let (status, body) = match found {
        Some((id, title)) => (
            StatusCode::OK,
            serde_json::json!({ "id": id, "title": title }).to_string(),
        ),
        None => (
            StatusCode::NOT_FOUND,
            r#"{"error":"no such article"}"#.to_owned(),
        ),
    };
    Response::builder()
        .status(status)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body)))
        .expect("response")
}

#[test]
fn the_extractors_read_what_they_should() {
    let text = "### A\n```sh\n# comment\nexport BLOOMGATE__DATABASE__URL='x://y'\nbin init \\\n  --a b\n```\n\
                ### B\n```console\n$ curl -i u\nHTTP/1.1 200 OK\nx: y\n\n{}\n\n$ curl v\nz\n```\n";
    let b = blocks(text);
    assert_eq!(b.len(), 2);
    assert_eq!((b[0].heading.as_str(), b[0].lang.as_str()), ("A", "sh"));
    let lines = shell_lines(&b[0].text);
    assert_eq!(
        lines,
        ["export BLOOMGATE__DATABASE__URL='x://y'", "bin init --a b"]
    );
    assert_eq!(exported_url(&lines[0]).as_deref(), Some("x://y"));
    let e = exchanges(&b[1].text);
    assert_eq!(e.len(), 2);
    assert_eq!(e[0].output, ["HTTP/1.1 200 OK", "x: y", "", "{}"]);
    assert_eq!(e[1].output, ["z"]);
    assert!(same_json(
        &serde_json::json!({"t": "2026-01-01T00:00:00Z", "n": 1}),
        &serde_json::json!({"n": 1, "t": "2027-02-03T04:05:06.5Z"})
    ));
    assert!(!same_json(
        &serde_json::json!({"t": "x"}),
        &serde_json::json!({"t": "y"})
    ));
    assert_eq!(
        init_output("a\nbloomgate init --x -o out.toml").as_deref(),
        Some("out.toml")
    );
    assert_eq!(
        without_password("mysql://app:secret@127.0.0.1:3306/blog?ssl-mode=required"),
        "mysql://app@127.0.0.1:3306/blog?ssl-mode=required"
    );
    assert_eq!(without_password("mysql://app@h/db"), "mysql://app@h/db");
    assert_eq!(without_password("sqlite://data/x.db"), "sqlite://data/x.db");
}
