//! The access log against the real binary and a real MariaDB: one JSON line per request
//! with what an operator greps for, a file reopened on a real SIGUSR1 after a rotation
//! moved it, and sampling.

mod support;

use std::path::Path;
use std::time::{Duration, Instant};

use bloomgate::db::{demo_absent_sku, demo_sku};
use bytes::Bytes;
use http::Method;
use serde_json::Value;
use support::binary::{Bloomgate, message};
use support::{HttpClient, TestConfig, TestDb, TestProxy, TestRoute, eventually, mysql_url};

/// The lines of `path` once there are at least `n` (waits up to 10 s).
async fn lines(path: &Path, n: usize) -> Vec<String> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let text = std::fs::read_to_string(path).unwrap_or_default();
        let lines: Vec<String> = text.lines().map(str::to_owned).collect();
        if lines.len() >= n {
            return lines;
        }
        assert!(
            Instant::now() < deadline,
            "{} lines in {} after 10 s, not {n}",
            lines.len(),
            path.display()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A proxy config with one SQL route and `[access_log]` holding `lines` and a `path`
/// in `dir`; returns it and that path.
fn logged_config(db: &TestDb, dir: &Path, lines: &str) -> (String, std::path::PathBuf) {
    let log = dir.join("access.log");
    let config = TestConfig::new(&db.url)
        .expected_items(100)
        .route(TestRoute::sql("products", "/api/products/{id}"))
        .toml()
        + &format!("\n[access_log]\n{lines}path = \"{}\"\n", log.display());
    (config, log)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_request_is_one_json_line_and_sigusr1_reopens_the_file() {
    let Some(server) = mysql_url() else { return };
    let db = TestDb::create(&server, 100).await;
    let dir = tempfile::tempdir().expect("temp dir");
    let (config, log) = logged_config(&db, dir.path(), "");
    let mut bin = Bloomgate::serve(&config, &[]).await;
    bin.wait_for_log("the filter load", Duration::from_secs(60), |l| {
        message(l) == "filter loaded"
    })
    .await;
    let client = HttpClient::new();
    let data = bin.data;
    let get = |path: String| {
        let url = format!("http://{data}{path}");
        let client = &client;
        async move {
            client
                .send(Method::GET, &url, &[], Bytes::new())
                .await
                .status
                .as_u16()
        }
    };
    // What the client measured for each request of `seen` below, in milliseconds: the
    // logged duration (request head in to response head out) lies within it.
    let mut took = Vec::new();
    let since = |t: Instant| t.elapsed().as_secs_f64() * 1000.0;
    let present = format!("/api/products/{}", demo_sku(1));
    for _ in 0..2 {
        let t = Instant::now();
        assert_eq!(get(present.clone()).await, 200);
        took.push(since(t));
    }
    // An absent key the gate refuses: one of its false positives would be answered
    // `miss` (and logged so), so the test asks until the answer says `intercepted`;
    // each false positive asked on the way is one more line, checked below.
    let mut false_positives = Vec::new();
    let absent = loop {
        let path = format!(
            "/api/products/{}?x=1",
            demo_absent_sku(1 + false_positives.len() as u64)
        );
        let t = Instant::now();
        let reply = client
            .send(
                Method::GET,
                &format!("http://{data}{path}"),
                &[],
                Bytes::new(),
            )
            .await;
        let t = since(t);
        assert_eq!(reply.status.as_u16(), 404, "{path}");
        if reply.stage() == "intercepted" {
            took.push(t);
            break path;
        }
        assert_eq!(reply.stage(), "miss", "{path}");
        false_positives.push(path);
        assert!(
            false_positives.len() < 20,
            "20 absent keys in a row let through"
        );
    };
    let t = Instant::now();
    assert_eq!(get("/elsewhere".into()).await, 404);
    took.push(since(t));

    let all: Vec<Value> = lines(&log, 4 + false_positives.len())
        .await
        .iter()
        .map(|l| serde_json::from_str(l).expect("a JSON line"))
        .collect();
    for (line, path) in all[2..].iter().zip(&false_positives) {
        assert_eq!(line["path"], path.as_str(), "{line}");
        assert_eq!(line["outcome"], "miss", "{line}");
        assert_eq!(line["status"], 404, "{line}");
    }
    let seen: Vec<Value> = all[..2]
        .iter()
        .chain(&all[2 + false_positives.len()..])
        .cloned()
        .collect();
    let fields = |v: &Value| {
        (
            v["method"].as_str().unwrap_or("").to_owned(),
            v["path"].as_str().unwrap_or("").to_owned(),
            v["status"].as_u64().unwrap_or(0),
            v["outcome"].as_str().unwrap_or("").to_owned(),
            v["route"].as_str().unwrap_or("").to_owned(),
        )
    };
    let expected = [
        (present.as_str(), 200, "miss", "products"),
        (present.as_str(), 200, "hit", "products"),
        (absent.as_str(), 404, "intercepted", "products"),
        ("/elsewhere", 404, "bypass", "-"),
    ];
    assert_eq!((seen.len(), took.len()), (4, 4));
    for ((line, (path, status, outcome, route)), took) in seen.iter().zip(expected).zip(took) {
        assert_eq!(
            fields(line),
            (
                "GET".into(),
                path.into(),
                status,
                outcome.into(),
                route.into()
            ),
            "{line}"
        );
        assert_eq!(line["client"], "127.0.0.1", "{line}");
        assert!(
            line["duration_ms"]
                .as_f64()
                .is_some_and(|d| d > 0.0 && d <= took),
            "{line}: the client measured {took:.3} ms"
        );
        assert!(
            line["time"].as_str().is_some_and(|t| t.ends_with('Z')),
            "{line}"
        );
    }
    // The found answer's size is known before it is sent.
    assert!(
        seen[1]["bytes"].as_u64().is_some_and(|b| b > 0),
        "{}",
        seen[1]
    );

    // A rotation moves the file away; SIGUSR1 makes bloomgate open a new one.
    let rotated = dir.path().join("access.log.1");
    std::fs::rename(&log, &rotated).expect("rotate");
    bin.signal("USR1");
    bin.wait_for_log("the reopen", Duration::from_secs(10), |l| {
        message(l) == "access log reopened"
    })
    .await;
    assert_eq!(get(present.clone()).await, 200);
    let fresh = lines(&log, 1).await;
    assert_eq!(fresh.len(), 1, "{fresh:?}");
    assert!(fresh[0].contains("\"outcome\":\"hit\""), "{}", fresh[0]);
    assert_eq!(lines(&rotated, 4).await.len(), 4);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn text_lines_and_sampling() {
    let Some(server) = mysql_url() else { return };
    let db = TestDb::create(&server, 100).await;
    let dir = tempfile::tempdir().expect("temp dir");
    let (config, log) = logged_config(&db, dir.path(), "format = \"text\"\nsample = 0.5\n");
    let proxy = TestProxy::spawn_ready(&config).await;
    const ASKED: usize = 400;
    for i in 0..ASKED {
        proxy
            .get(&format!("/api/products/{}", demo_absent_sku(i as u64)))
            .await;
    }
    // Each request is logged with probability 1/2: 200 expected, and 140..260 holds
    // but for a chance below one in a billion. Every line queued is written.
    let count = |r: &'static str| {
        let p = &proxy;
        async move {
            p.metric(&format!(
                "bloomgate_access_log_lines_total{{result=\"{r}\"}}"
            ))
            .await
        }
    };
    let queued = count("queued").await;
    eventually(
        "every queued line written",
        Duration::from_secs(10),
        || async { count("written").await == queued },
    )
    .await;
    let logged = lines(&log, 0).await.len();
    assert_eq!(logged as f64, queued);
    assert_eq!(count("dropped").await, 0.0);
    assert!((140..=260).contains(&logged), "{logged} of {ASKED} logged");
    // Every line is one refusal; the gate's false positives (about 1% of absent keys)
    // are answered 404 `miss` and logged as such.
    let text = std::fs::read_to_string(&log).expect("log");
    let mut intercepted = 0;
    for line in text.lines() {
        let parts: Vec<&str> = line.split(' ').collect();
        assert_eq!(parts.len(), 9, "{line}");
        assert_eq!(
            (parts[1], parts[2], parts[4], parts[6]),
            ("127.0.0.1", "\"GET", "404", "products"),
            "{line}"
        );
        assert!(
            parts[3].starts_with("/api/products/") && parts[3].ends_with('"'),
            "{line}"
        );
        match parts[5] {
            "intercepted" => intercepted += 1,
            "miss" => {}
            other => panic!("outcome {other}: {line}"),
        }
    }
    assert!(
        intercepted * 10 >= logged * 9,
        "{intercepted} of {logged} intercepted"
    );
}
