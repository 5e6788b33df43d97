//! The filter's lifecycle as docs/lifecycle.md tells it, against a real MariaDB: a
//! snapshot whose parameters or watermark do not fit the config is rejected and the
//! filter built from the source; a warm start catches up through its first sync poll;
//! `rebuild_interval` rebuilds on its own; the capacity warning is logged once per
//! crossing and a filter past its capacity is rebuilt twice as large (the real binary,
//! read through its JSON log); integer-id sync starts from `start_query` less
//! `overlap_ids` and never reads below it.

mod support;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bloomgate::db::{demo_absent_sku, demo_sku};
use bloomgate::gate::{BuildHook, BuildPhase, Filter};
use serde_json::Value;
use support::binary::{Bloomgate, message};
use support::observe::filter_status;
use support::{HttpClient, TestConfig, TestDb, TestProxy, TestRoute, eventually, mysql_url};
use tokio::sync::mpsc;

const TOKEN: &str = "test-admin-token";
const SYNC_QUERY: &str =
    "query = \"SELECT sku_id, updated_at FROM products WHERE updated_at >= ?\"";

fn series(name: &str) -> String {
    format!("{name}{{filter=\"products\"}}")
}

fn with_result(name: &str, result: &str) -> String {
    format!("{name}{{filter=\"products\",result=\"{result}\"}}")
}

/// A fresh directory for one snapshot file.
fn snapshot_path() -> PathBuf {
    let dir = std::env::temp_dir().join(format!("bloomgate-life-{:016x}", rand::random::<u64>()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    dir.join("products.bloom")
}

fn snapshot_at(path: &Path) -> String {
    format!("snapshot_path = \"{}\"", path.display())
}

fn remove_snapshot_dir(path: &Path) {
    if let Some(dir) = path.parent() {
        let _ = std::fs::remove_dir_all(dir);
    }
}

/// Waits until `proxy` has written `n` snapshots.
async fn snapshots_written(proxy: &TestProxy, n: f64) {
    eventually("snapshot written", Duration::from_secs(30), || async {
        proxy
            .scrape()
            .await
            .value(&with_result("bloomgate_filter_snapshot_writes_total", "ok"))
            >= n
    })
    .await;
}

/// Runs a proxy on `config` until it has written its snapshot.
async fn write_snapshot(config: &str) {
    let proxy = TestProxy::spawn_ready(config).await;
    snapshots_written(&proxy, 1.0).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_snapshot_that_does_not_fit_the_config_is_rejected_and_the_filter_built_from_the_source()
{
    let Some(server) = mysql_url() else { return };
    const N: u64 = 2_000;
    let db = TestDb::create(&server, N).await;
    let written = snapshot_path();
    let base = TestConfig::new(&db.url)
        .expected_items(N)
        .false_positive_rate(0.01)
        .route(TestRoute::sql("products", "/api/products/{id}"));
    write_snapshot(&base.clone().filter(snapshot_at(&written)).toml()).await;
    let good = std::fs::read(&written).expect("read the snapshot");
    remove_snapshot_dir(&written);

    // (what differs, the config, whether the snapshot fits it)
    let cases = [
        (
            "another false-positive rate",
            base.clone().false_positive_rate(0.02),
            false,
        ),
        (
            "expected_items above the snapshot's capacity",
            base.clone().expected_items(2 * N),
            false,
        ),
        (
            "sync configured, no watermark in the snapshot",
            base.clone().sync(SYNC_QUERY).sync("interval = \"1h\""),
            false,
        ),
        (
            "expected_items below the snapshot's capacity",
            base.clone().expected_items(N / 2),
            true,
        ),
    ];
    for (what, config, fits) in cases {
        let path = snapshot_path();
        std::fs::write(&path, &good).expect("place the snapshot");
        let proxy = TestProxy::spawn_ready(&config.filter(snapshot_at(&path)).toml()).await;
        // Ready means the snapshot was loaded or rejected already.
        let m = proxy.scrape().await;
        let (ok, rejected) = (
            m.value(&with_result("bloomgate_filter_snapshot_loads_total", "ok")),
            m.value(&with_result(
                "bloomgate_filter_snapshot_loads_total",
                "rejected",
            )),
        );
        // Either way a full build follows (after a rejection, or a warm start without
        // sync) and writes a new snapshot; wait for it so it lands in this case's file.
        if rejected > 0.0 || fits {
            snapshots_written(&proxy, 1.0).await;
        }
        let m = proxy.scrape().await;
        if fits {
            assert_eq!((ok, rejected), (1.0, 0.0), "{what}");
            // A warm restart keeps the snapshot's size, through the rebuild that follows it.
            let status = proxy.filter_status("products").await;
            assert_eq!(status["capacity"], N, "{what}: {status}");
        } else {
            assert_eq!((ok, rejected), (0.0, 1.0), "{what}");
            let status = proxy.filter_status("products").await;
            assert_eq!(status["last_load"]["origin"], "source", "{what}: {status}");
            assert_eq!(status["last_load"]["rows"], N, "{what}: {status}");
        }
        assert_eq!(
            m.value(&with_result("bloomgate_filter_loads_total", "ok")),
            1.0,
            "{what}: one full build"
        );
        // The filter that serves gates as it should.
        for i in (0..N).step_by(101) {
            let r = proxy.get(&format!("/api/products/{}", demo_sku(i))).await;
            assert_eq!(r.status.as_u16(), 200, "{what}: {}", r.text());
        }
        let intercepted = {
            let mut n = 0;
            for i in 0..200 {
                let r = proxy
                    .get(&format!("/api/products/{}", demo_absent_sku(i)))
                    .await;
                n += usize::from(r.stage() == "intercepted");
            }
            n
        };
        assert!(intercepted >= 180, "{what}: {intercepted} of 200 refused");
        drop(proxy);
        remove_snapshot_dir(&path);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_warm_start_admits_keys_written_after_the_snapshot_at_its_first_sync_poll() {
    let Some(server) = mysql_url() else { return };
    const N: u64 = 2_000;
    let db = TestDb::create(&server, N).await;
    let path = snapshot_path();
    // An interval far longer than the test: any poll seen is the first one. Room for
    // the late keys, so they cause no capacity rebuild.
    let config = TestConfig::new(&db.url)
        .expected_items(2 * N)
        .false_positive_rate(0.0001)
        .filter(snapshot_at(&path))
        .sync(SYNC_QUERY)
        .sync("interval = \"1h\"")
        .route(TestRoute::sql("products", "/api/products/{id}"))
        .toml();
    write_snapshot(&config).await;

    let late: Vec<u64> = (0..50).map(demo_absent_sku).collect();
    db.insert_products(&late).await;

    let warm = TestProxy::spawn_ready(&config).await;
    eventually("the first sync poll", Duration::from_secs(30), || async {
        warm.scrape()
            .await
            .value(&with_result("bloomgate_filter_sync_polls_total", "ok"))
            >= 1.0
    })
    .await;
    let m = warm.scrape().await;
    assert_eq!(
        m.value(&with_result("bloomgate_filter_snapshot_loads_total", "ok")),
        1.0
    );
    assert_eq!(
        m.value(&with_result("bloomgate_filter_loads_total", "ok")),
        0.0,
        "no full build: the keys can only have come from the poll"
    );
    assert!(
        m.value(&series("bloomgate_filter_sync_keys_total")) >= late.len() as f64,
        "the poll applied the late rows"
    );
    let status = warm.filter_status("products").await;
    assert_eq!(status["last_load"]["origin"], "snapshot", "{status}");
    assert!(status["sync_watermark"].is_string(), "{status}");
    for key in &late {
        let r = warm.get(&format!("/api/products/{key}")).await;
        assert_eq!((r.status.as_u16(), r.stage()), (200, "miss"), "{key}");
    }
    drop(warm);
    remove_snapshot_dir(&path);
}

/// The instant each full build of `filter` begins, from its build hook.
fn watch_builds(filter: &Filter) -> mpsc::UnboundedReceiver<Instant> {
    let (tx, rx) = mpsc::unbounded_channel();
    let hook: BuildHook = Arc::new(move |phase| {
        let tx = tx.clone();
        Box::pin(async move {
            if phase == BuildPhase::Sizing {
                let _ = tx.send(Instant::now());
            }
        })
    });
    filter.set_build_hook(Some(hook));
    rx
}

async fn next_build(builds: &mut mpsc::UnboundedReceiver<Instant>) -> Instant {
    tokio::time::timeout(Duration::from_secs(30), builds.recv())
        .await
        .expect("a scheduled build began")
        .expect("hook alive")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rebuild_interval_rebuilds_on_schedule_and_deleted_keys_leave() {
    let Some(server) = mysql_url() else { return };
    const N: u64 = 500;
    const INTERVAL: Duration = Duration::from_secs(1);
    let db = TestDb::create(&server, N).await;
    let proxy = TestProxy::spawn_ready(
        &TestConfig::new(&db.url)
            .expected_items(N)
            // Rare enough that a deleted key is a false positive of no rebuilt filter:
            // each build draws a random seed, and each of the ten deleted keys is one
            // of its false positives with a chance of about 10^-9.
            .false_positive_rate(0.000_000_001)
            .filter("rebuild_interval = \"1s\"")
            .route(TestRoute::sql("products", "/api/products/{id}"))
            .toml(),
    )
    .await;
    let mut builds = watch_builds(&proxy.proxy.filter("products").expect("filter"));
    let status = proxy.filter_status("products").await;
    assert_eq!(status["last_load"]["reason"], "startup", "{status}");

    let deleted: Vec<u64> = (0..10).map(|i| demo_sku(i * 37)).collect();
    for &key in &deleted {
        db.delete_product(key).await;
    }
    // Forget the builds that began before the deletes were done.
    while builds.try_recv().is_ok() {}
    let first = next_build(&mut builds).await;
    // The next one begins only after the first has finished and recorded its status.
    let second = next_build(&mut builds).await;
    assert!(
        second - first >= INTERVAL,
        "scheduled builds began {:?} apart with a 1s interval",
        second - first
    );
    let status = proxy.filter_status("products").await;
    assert_eq!(status["last_load"]["reason"], "scheduled", "{status}");
    assert_eq!(status["last_load"]["result"], "ok", "{status}");
    assert_eq!(
        status["last_load"]["rows"],
        N - deleted.len() as u64,
        "{status}"
    );
    assert!(
        proxy
            .scrape()
            .await
            .value(&with_result("bloomgate_filter_loads_total", "ok"))
            >= 2.0
    );
    for &key in &deleted {
        let r = proxy.get(&format!("/api/products/{key}")).await;
        assert_eq!(
            (r.status.as_u16(), r.stage()),
            (404, "intercepted"),
            "{key}"
        );
    }
}

const FILLING_UP: &str = "filter is filling up; it is rebuilt larger once items exceed capacity";
const KEYS_ADDED: &str = "keys added through the admin API";

fn is_capacity_warning(line: &Value) -> bool {
    message(line) == FILLING_UP && line["level"] == "WARN" && line["fields"]["filter"] == "products"
}

/// The bloomgate binary with its log, and a client for its admin plane.
struct Logged {
    bin: Bloomgate,
    client: HttpClient,
    posts: usize,
    next_key: u64,
}

impl Logged {
    /// Adds `n` keys that are in no table through the admin API, and waits until the log
    /// line of that call has been read, so every warning it caused has been read too.
    async fn add_keys(&mut self, n: u64) {
        let keys: Vec<String> = (self.next_key..self.next_key + n)
            .map(|i| demo_absent_sku(i).to_string())
            .collect();
        self.next_key += n;
        let auth = format!("Bearer {TOKEN}");
        let r = self
            .client
            .send(
                http::Method::POST,
                &format!("http://{}/admin/filters/products/keys", self.bin.admin),
                &[("authorization", auth.as_str())],
                bytes::Bytes::from(keys.join("\n")),
            )
            .await;
        assert_eq!(r.status.as_u16(), 200, "{}", r.text());
        self.posts += 1;
        self.bin
            .wait_for_logs(
                "the admin call's log line",
                self.posts,
                Duration::from_secs(10),
                |l| message(l) == KEYS_ADDED,
            )
            .await;
    }

    /// (items, capacity) of the live filter.
    async fn fill(&self) -> (u64, u64) {
        let s = filter_status(&self.client, self.bin.admin, "products").await;
        let n = |f: &str| s[f].as_u64().unwrap_or_else(|| panic!("{f} missing: {s}"));
        (n("items"), n("capacity"))
    }

    /// Adds keys `step` at a time until items reach `ratio` of capacity.
    async fn fill_to(&mut self, ratio: f64, step: u64) -> (u64, u64) {
        loop {
            let (items, capacity) = self.fill().await;
            if items as f64 >= ratio * capacity as f64 {
                return (items, capacity);
            }
            self.add_keys(step).await;
        }
    }

    fn warnings(&self) -> Vec<Value> {
        self.bin.logged(is_capacity_warning)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_capacity_warning_is_logged_once_per_crossing_and_a_full_filter_is_rebuilt_larger() {
    let Some(server) = mysql_url() else { return };
    const CAPACITY: u64 = 100;
    let db = TestDb::create(&server, 50).await;
    // capacity_warn_ratio is left at its documented default, 0.85.
    let config = TestConfig::new(&db.url)
        .server("listen = \"127.0.0.1:0\"")
        .admin("listen = \"127.0.0.1:0\"")
        .admin_token(TOKEN)
        .expected_items(CAPACITY)
        .route(TestRoute::sql("products", "/api/products/{id}"))
        .toml();
    let mut bin = Bloomgate::serve(&config, &[]).await;
    bin.wait_for_log("the first load", Duration::from_secs(60), |l| {
        message(l) == "filter loaded"
    })
    .await;
    let mut run = Logged {
        bin,
        client: HttpClient::new(),
        posts: 0,
        next_key: 0,
    };
    let (items, _) = run.fill().await;
    assert!(items <= 50, "{items}");
    assert!(run.warnings().is_empty(), "{:#?}", run.warnings());

    // Crossing 85%: one warning, naming the filter, its items and capacity.
    let (items, capacity) = run.fill_to(0.85, 3).await;
    assert_eq!(capacity, CAPACITY);
    assert!(
        items <= CAPACITY,
        "{items} items: past the capacity already"
    );
    let warnings = run.warnings();
    assert_eq!(warnings.len(), 1, "{warnings:#?}");
    assert_eq!(warnings[0]["fields"]["capacity"], CAPACITY);
    assert!(warnings[0]["fields"]["ratio"].as_f64() >= Some(0.85));

    // Filling on up to the capacity: still above the threshold, so no new warning.
    run.fill_to(0.97, 1).await;
    assert_eq!(run.warnings().len(), 1, "{:#?}", run.warnings());
    let status = filter_status(&run.client, run.bin.admin, "products").await;
    assert_eq!(status["last_load"]["reason"], "startup", "{status}");

    // Past 100%: a rebuild at twice the capacity, shown as reason `capacity`.
    run.add_keys(10).await;
    run.bin
        .wait_for_log("the capacity rebuild", Duration::from_secs(60), |l| {
            message(l) == "filter loaded" && l["fields"]["reason"] == "capacity"
        })
        .await;
    // The line is logged just before the build's status is recorded.
    eventually("the rebuild's status", Duration::from_secs(10), || async {
        let s = filter_status(&run.client, run.bin.admin, "products").await;
        s["last_load"]["loading"] == false
    })
    .await;
    let status = filter_status(&run.client, run.bin.admin, "products").await;
    assert_eq!(status["last_load"]["reason"], "capacity", "{status}");
    assert_eq!(status["last_load"]["result"], "ok", "{status}");
    assert_eq!(status["capacity"], 2 * CAPACITY, "{status}");
    let m = support::Scrape::of(&run.client, run.bin.admin).await;
    assert_eq!(
        m.value(&series("bloomgate_filter_capacity_rebuilds_total")),
        1.0
    );
    assert_eq!(
        m.value(&series("bloomgate_filter_capacity")),
        (2 * CAPACITY) as f64
    );
    // The rebuilt filter is below the threshold again; crossing it again warns again.
    let (items, capacity) = run.fill().await;
    assert!(
        (items as f64) < 0.85 * capacity as f64,
        "{items}/{capacity}"
    );
    assert_eq!(run.warnings().len(), 1);
    run.fill_to(0.85, 5).await;
    let warnings = run.warnings();
    assert_eq!(warnings.len(), 2, "{warnings:#?}");
    assert_eq!(warnings[1]["fields"]["capacity"], 2 * CAPACITY);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn integer_sync_starts_at_start_query_less_overlap_ids_and_admits_new_rows() {
    let Some(server) = mysql_url() else { return };
    let db = TestDb::create(&server, 3_000).await;
    db.add_auto_increment_ids().await;
    let start = db.max_id().await;
    assert_eq!(start, 3_000);
    // The source lists only the first 2,000 rows, so what else the filter holds came
    // from sync alone.
    let proxy = TestProxy::spawn_ready(
        &TestConfig::new(&db.url)
            .source_query("SELECT sku_id FROM products WHERE id <= 2000")
            .expected_items(4_000)
            // The 899 rows below the window must all be refused, whatever the filter's
            // random seed: at this rate (about 2,100 keys in a filter for 4,000) one of
            // them is a false positive once in 10^8 runs.
            .false_positive_rate(0.000_000_001)
            .sync("query = \"SELECT sku_id, id FROM products WHERE id >= ?\"")
            .sync("watermark = \"integer\"")
            .sync("start_query = \"SELECT MAX(id) FROM products\"")
            .sync("overlap_ids = 100")
            .sync("interval = \"200ms\"")
            .route(TestRoute::sql("products", "/api/products/{id}"))
            .toml(),
    )
    .await;
    let polls = || async {
        proxy
            .scrape()
            .await
            .value(&with_result("bloomgate_filter_sync_polls_total", "ok"))
    };
    eventually("two sync polls", Duration::from_secs(30), || async {
        polls().await >= 2.0
    })
    .await;
    let status = proxy.filter_status("products").await;
    assert_eq!(status["sync_watermark"], start.to_string(), "{status}");

    let served = |keys: Vec<u64>| {
        let proxy = &proxy;
        async move {
            let mut out = Vec::new();
            for key in keys {
                let r = proxy.get(&format!("/api/products/{key}")).await;
                out.push((key, r.status.as_u16(), r.stage().to_owned()));
            }
            out
        }
    };
    let check = |what: &str, seen: &[(u64, u16, String)], status: u16, stage: &str| {
        for (key, s, st) in seen {
            assert_eq!((*s, st.as_str()), (status, stage), "{what}: key {key}");
        }
    };
    check(
        "from the source",
        &served(
            db.skus_with_ids(1, 2_000)
                .await
                .into_iter()
                .step_by(10)
                .collect(),
        )
        .await,
        200,
        "miss",
    );
    // Below start_query's value less overlap_ids: never read by sync.
    let below = db.skus_with_ids(2_001, start - 101).await;
    assert_eq!(below.len(), 899);
    check(
        "below the window",
        &served(below.clone()).await,
        404,
        "intercepted",
    );
    // The overlap_ids window under the start mark, read by the first poll.
    let window = db.skus_with_ids(start - 100, start).await;
    assert_eq!(window.len(), 101);
    check("the overlap window", &served(window).await, 200, "miss");

    // New rows are admitted by the next polls.
    let new: Vec<u64> = (0..20).map(|i| demo_absent_sku(10_000 + i)).collect();
    db.insert_products(&new).await;
    let newest = db.max_id().await.to_string();
    eventually("the new rows synced", Duration::from_secs(30), || async {
        proxy.filter_status("products").await["sync_watermark"] == newest.as_str()
    })
    .await;
    check("new rows", &served(new).await, 200, "miss");
    // Polls kept running; the rows below the window are still never read.
    let after = polls().await;
    eventually("two more polls", Duration::from_secs(30), || async {
        polls().await >= after + 2.0
    })
    .await;
    check(
        "below the window, later",
        &served(below).await,
        404,
        "intercepted",
    );
}
