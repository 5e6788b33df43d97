//! The gate stays true as the data changes: incremental sync, rebuilds under churn,
//! capacity growth, snapshots and warm restarts, shadow mode and write-through, against
//! a real MariaDB and a real proxy.

mod support;

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bloomgate::db::{demo_absent_sku, demo_sku};
use bytes::Bytes;
use http::Method;
use support::observe::wait_value;
use support::{
    SYNC_QUERY, StubUpstream, TestConfig, TestDb, TestProxy, TestRoute, concurrently, mysql_url,
    refused_absent_keys,
};

const SYNC_INTERVAL_MS: u64 = 300;
const SYNC_OVERLAP_S: u64 = 2;

struct Setup<'a> {
    db_url: &'a str,
    expected: u64,
    fpp: f64,
    sync: bool,
    snapshot: Option<&'a PathBuf>,
    mode: &'a str,
}

fn config(s: &Setup<'_>) -> String {
    let route = |name, path| TestRoute::sql(name, path).origin_timeout("10s");
    let mut c = TestConfig::new(s.db_url)
        .admin_token("test-admin-token")
        .database("max_connections = 32")
        .database("acquire_timeout = \"10s\"")
        .cache("negative_ttl = \"1m\"")
        .expected_items(s.expected)
        .false_positive_rate(s.fpp)
        .route(route("products", "/api/products/{id}").mode(s.mode))
        .route(route("enforced", "/enforced/{id}"));
    if s.sync {
        c = c
            .sync_query(SYNC_QUERY)
            .sync(format!("interval = \"{SYNC_INTERVAL_MS}ms\""))
            .sync(format!("overlap = \"{SYNC_OVERLAP_S}s\""));
    }
    if let Some(path) = s.snapshot {
        c = c.snapshot_path(path);
    }
    c.toml()
}

fn setup(db_url: &str, expected: u64) -> Setup<'_> {
    Setup {
        db_url,
        expected,
        fpp: 0.01,
        sync: true,
        snapshot: None,
        mode: "enforce",
    }
}

async fn wait_for(what: &str, limit: Duration, mut check: impl AsyncFnMut() -> bool) {
    let deadline = Instant::now() + limit;
    while !check().await {
        assert!(Instant::now() < deadline, "{what}: not within {limit:?}");
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

const POLLS_OK: &str = "bloomgate_filter_sync_polls_total{filter=\"products\",result=\"ok\"}";
const LOADS_OK: &str = "bloomgate_filter_loads_total{filter=\"products\",result=\"ok\"}";
const CAPACITY_REBUILDS: &str = "bloomgate_filter_capacity_rebuilds_total{filter=\"products\"}";

/// Asks for `path` until it is answered 200, and returns after how many completed sync
/// polls and how long. Counted from the caller's `polls` (read after the change was
/// committed), the poll in flight then may have missed the change, but the next one
/// started after the commit: "one interval plus one poll" is two completed polls.
async fn served_after_polls(proxy: &TestProxy, path: &str, polls: f64) -> (f64, Duration) {
    let from = Instant::now();
    let deadline = from + Duration::from_secs(60);
    loop {
        // Read before the request: polls counted here had admitted what they read.
        let done = proxy.metric(POLLS_OK).await - polls;
        if proxy.get(path).await.status.as_u16() == 200 {
            return (done, from.elapsed());
        }
        assert!(done < 2.0, "{path} still refused after {done} polls");
        assert!(Instant::now() < deadline, "sync polls stalled");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inserted_keys_are_served_within_the_sync_interval_plus_overlap() {
    let Some(server) = mysql_url() else { return };
    let db = TestDb::create(&server, 1_000).await;
    let mut s = setup(&db.url, 1_000);
    s.fpp = 0.2; // false positives are easy to find
    let proxy = TestProxy::spawn_ready(&config(&s)).await;

    // A fresh key: answered 200 within one sync interval plus the poll itself.
    let key = demo_absent_sku(1);
    db.insert_product(key).await;
    let polls = proxy.metric(POLLS_OK).await;
    let (after, lag) = served_after_polls(&proxy, &format!("/enforced/{key}"), polls).await;
    eprintln!(
        "insert → 200 took {lag:?} and {after} completed polls (sync interval {SYNC_INTERVAL_MS}ms)"
    );

    // A key that was a false positive (negative entry) and is then created.
    let mut fp = None;
    for i in 100..2_000 {
        let k = demo_absent_sku(i);
        if proxy.get(&format!("/api/products/{k}")).await.stage() == "miss" {
            fp = Some(k);
            break;
        }
    }
    let fp = fp.expect("a false positive at p = 20%");
    assert_eq!(
        proxy.get(&format!("/api/products/{fp}")).await.stage(),
        "negative-hit"
    );
    db.insert_product(fp).await;
    let polls = proxy.metric(POLLS_OK).await;
    let (after, lag) = served_after_polls(&proxy, &format!("/api/products/{fp}"), polls).await;
    eprintln!("negative entry → 200 after insert took {lag:?} and {after} completed polls");
    // A poll counts its keys after admitting them: the key can be served a moment before.
    wait_for("both keys counted", Duration::from_secs(10), async || {
        proxy
            .metric("bloomgate_filter_sync_keys_total{filter=\"products\"}")
            .await
            >= 2.0
    })
    .await;
    assert!(
        proxy
            .metric("bloomgate_filter_sync_lag_seconds{filter=\"products\"}")
            .await
            < 60.0
    );
    assert_eq!(
        proxy
            .metric("bloomgate_filter_sync_interval_seconds{filter=\"products\"}")
            .await,
        SYNC_INTERVAL_MS as f64 / 1000.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_false_negative_under_churn_with_rebuilds_and_a_capacity_rebuild() {
    let Some(server) = mysql_url() else { return };
    const N: u64 = 20_000;
    let db = Arc::new(TestDb::create_heavy(&server, N).await);
    // Capacity just above the starting size, so the inserts below outgrow it.
    let s = setup(&db.url, N + 1_000);
    let proxy = Arc::new(TestProxy::spawn_ready(&config(&s)).await);
    let stop = Arc::new(AtomicBool::new(false));
    // Keys i in [0, N/2) are never deleted; writers delete from [N/2, N).
    let stable: Vec<u64> = (0..N / 2).map(demo_sku).collect();
    // Each created key with the sync polls completed once its insert had committed.
    let created: Arc<std::sync::Mutex<Vec<(u64, f64)>>> = Arc::default();
    let deleted = Arc::new(AtomicU64::new(0));

    let mut writers = Vec::new();
    for w in 0..4u64 {
        let (db, proxy, stop, created, deleted) = (
            Arc::clone(&db),
            Arc::clone(&proxy),
            Arc::clone(&stop),
            Arc::clone(&created),
            Arc::clone(&deleted),
        );
        writers.push(tokio::spawn(async move {
            let mut i = 0u64;
            while !stop.load(Ordering::Relaxed) {
                // New keys above every demo key; 4 writers never collide.
                let batch: Vec<u64> = (0..20).map(|j| 10_000_000 + (i * 20 + j) * 4 + w).collect();
                db.insert_products(&batch).await;
                let polls = proxy.metric(POLLS_OK).await;
                created
                    .lock()
                    .expect("lock")
                    .extend(batch.iter().map(|k| (*k, polls)));
                db.delete_product(demo_sku(N / 2 + (i * 4 + w) % (N / 2)))
                    .await;
                deleted.fetch_add(1, Ordering::Relaxed);
                i += 1;
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }));
    }
    let rebuilder = {
        let (proxy, stop) = (Arc::clone(&proxy), Arc::clone(&stop));
        tokio::spawn(async move {
            // Let the inserts outgrow capacity first, so the automatic rebuild is seen
            // (forced rebuilds size the filter from the row count and would pre-empt it).
            wait_value(
                "the automatic capacity rebuild",
                Duration::from_secs(60),
                || proxy.metric(CAPACITY_REBUILDS),
                |n| *n >= 1.0,
            )
            .await;
            let mut forced = 0u32;
            while !stop.load(Ordering::Relaxed) {
                let r = proxy
                    .admin_post(
                        "/admin/filters/products/rebuild",
                        Some("test-admin-token"),
                        "",
                    )
                    .await;
                assert_eq!(r.status.as_u16(), 202);
                forced += 1;
                // Pacing of the requests, not a wait for anything.
                tokio::time::sleep(Duration::from_millis(700)).await;
            }
            forced
        })
    };

    // Reads go on until what they are to overlap has happened, and one more round after
    // that: the automatic capacity rebuild, forced rebuilds (four builds completed in
    // all), more than 1,000 reads of newly synced keys, three rounds at least. The
    // deadline only bounds a hang.
    let limit = Duration::from_secs(120);
    let deadline = Instant::now() + limit;
    let mut asked = 0u64;
    let mut asked_fresh = 0u64;
    let mut rounds = 0u32;
    let mut refused: Vec<(u64, u16)> = Vec::new();
    loop {
        let (loads, capacity_rebuilds) = (
            proxy.metric(LOADS_OK).await,
            proxy.metric(CAPACITY_REBUILDS).await,
        );
        let last_round =
            rounds >= 3 && asked_fresh > 1_000 && loads >= 4.0 && capacity_rebuilds >= 1.0;
        assert!(
            last_round || Instant::now() < deadline,
            "churn: not within {limit:?}; after {rounds} rounds: {asked_fresh} reads of newly \
             synced keys, {loads} builds completed, {capacity_rebuilds} capacity rebuilds"
        );
        rounds += 1;
        // Keys that two completed polls have had time to admit (see served_after_polls).
        let polls = proxy.metric(POLLS_OK).await;
        let fresh: Vec<u64> = created
            .lock()
            .expect("lock")
            .iter()
            .filter(|(_, at)| polls >= at + 2.0)
            .map(|(k, _)| *k)
            .collect();
        asked_fresh += fresh.len() as u64;
        let mut keys = stable.clone();
        keys.extend(fresh);
        asked += keys.len() as u64;
        let client = proxy.client().clone();
        let data = proxy.data;
        let statuses = concurrently(keys, 32, move |k| {
            let client = client.clone();
            async move {
                let r = client
                    .send(
                        Method::HEAD,
                        &format!("http://{data}/enforced/{k}"),
                        &[],
                        Bytes::new(),
                    )
                    .await;
                (k, r.status.as_u16())
            }
        })
        .await;
        refused.extend(statuses.into_iter().filter(|(_, s)| *s != 200));
        if last_round {
            break;
        }
    }
    stop.store(true, Ordering::Relaxed);
    for w in writers {
        w.await.expect("writer");
    }
    let forced = rebuilder.await.expect("rebuilder");
    let created = created.lock().expect("lock").len();
    let loads = proxy.metric(LOADS_OK).await;
    let capacity_rebuilds = proxy.metric(CAPACITY_REBUILDS).await;
    eprintln!(
        "churn: {rounds} rounds, {asked} reads ({asked_fresh} of newly synced keys), {} refused; {created} keys created and {} deleted by 4 writers; \
         {forced} forced rebuilds requested, {loads} builds completed, {capacity_rebuilds} capacity rebuilds",
        refused.len(),
        deleted.load(Ordering::Relaxed)
    );
    // A 404 for a present key is a false negative; anything else (a 503 when the pool is
    // saturated on an overloaded machine) is not, but must stay rare.
    let not_found: Vec<&(u64, u16)> = refused.iter().filter(|(_, s)| *s == 404).collect();
    assert!(
        not_found.is_empty(),
        "present keys answered 404: {:?}",
        &not_found[..not_found.len().min(10)]
    );
    assert!(
        (refused.len() as u64) * 1000 <= asked,
        "too many failed reads: {:?}",
        &refused[..refused.len().min(10)]
    );
    assert!(loads >= 4.0, "only {loads} builds completed");
    assert!(
        asked_fresh > 1_000,
        "only {asked_fresh} reads of newly synced keys"
    );
    assert!(capacity_rebuilds >= 1.0, "no automatic capacity rebuild");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outgrowing_capacity_rebuilds_larger_and_keeps_the_target_rate() {
    let Some(server) = mysql_url() else { return };
    const CAP: u64 = 2_000;
    let db = TestDb::create_heavy(&server, CAP).await;
    let proxy = TestProxy::spawn_ready(&config(&setup(&db.url, CAP))).await;
    // Three times the capacity in total.
    let more: Vec<u64> = (CAP..3 * CAP).map(demo_sku).collect();
    db.insert_products(&more).await;
    wait_for("capacity rebuild", Duration::from_secs(30), async || {
        proxy
            .metric("bloomgate_filter_capacity_rebuilds_total{filter=\"products\"}")
            .await
            >= 1.0
            && proxy
                .metric("bloomgate_filter_capacity{filter=\"products\"}")
                .await
                >= (3 * CAP) as f64
            && proxy
                .metric("bloomgate_filter_loads_total{filter=\"products\",result=\"ok\"}")
                .await
                >= 2.0
    })
    .await;
    // The rebuild can start while the last batches are still being inserted: rows its
    // scan did not see are admitted by sync, within two polls after it.
    let polls = proxy.metric(POLLS_OK).await;
    wait_for(
        "two sync polls after the rebuild",
        Duration::from_secs(30),
        async || proxy.metric(POLLS_OK).await >= polls + 2.0,
    )
    .await;
    for k in more.iter().step_by(7) {
        let r = proxy.get(&format!("/enforced/{k}")).await;
        assert_eq!(r.status.as_u16(), 200, "key {k}: {}", r.stage());
    }
    const ABSENT: u64 = 20_000;
    let client = proxy.client().clone();
    let data = proxy.data;
    let stages = concurrently((0..ABSENT).collect(), 64, move |i| {
        let client = client.clone();
        async move {
            let r = client
                .send(
                    Method::GET,
                    &format!("http://{data}/enforced/{}", demo_absent_sku(i)),
                    &[],
                    Bytes::new(),
                )
                .await;
            r.stage().to_owned()
        }
    })
    .await;
    let passed = stages.iter().filter(|s| *s == "miss").count() as f64;
    let rate = passed / ABSENT as f64;
    let capacity = proxy
        .metric("bloomgate_filter_capacity{filter=\"products\"}")
        .await;
    eprintln!(
        "after growing to {} keys (capacity now {capacity}): measured false-positive rate {rate:.4} (target 0.01)",
        3 * CAP
    );
    assert!(
        rate <= 0.012,
        "false-positive rate {rate} above 1.2 × target"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restarts_are_warm_from_a_snapshot_and_bad_snapshots_are_rebuilt() {
    let Some(server) = mysql_url() else { return };
    const N: u64 = 50_000;
    let db = TestDb::create_heavy(&server, N).await;
    // Let the seeded rows fall outside the sync overlap, so a warm start has no reason
    // to read them again.
    tokio::time::sleep(Duration::from_secs(SYNC_OVERLAP_S + 1)).await;
    let dir = tempfile::TempDir::new().expect("temp dir");
    let path = dir.path().join("products.snap");
    let mut s = setup(&db.url, N);
    s.snapshot = Some(&path);
    let toml = config(&s);
    {
        let first = TestProxy::spawn_ready(&toml).await;
        wait_for("snapshot written", Duration::from_secs(20), async || {
            first
                .metric("bloomgate_filter_snapshot_writes_total{filter=\"products\",result=\"ok\"}")
                .await
                >= 1.0
        })
        .await;
    }
    assert!(path.exists());
    let good = std::fs::read(&path).expect("read snapshot");

    let read_before = db.rows_read().await;
    let warm = TestProxy::spawn_ready(&toml).await;
    let f = warm.admin_get("/admin/filters").await.json();
    assert_eq!(f["filters"][0]["last_load"]["origin"], "snapshot", "{f}");
    let read = db.rows_read().await - read_before;
    eprintln!("warm restart read {read} rows from MariaDB (the table has {N})");
    assert!(read < N / 10, "warm start read {read} rows");
    for i in (0..N).step_by(97) {
        let r = warm.get(&format!("/enforced/{}", demo_sku(i))).await;
        assert_eq!(r.status.as_u16(), 200);
    }
    let intercepted = {
        let mut n = 0;
        for i in 0..500 {
            if warm
                .get(&format!("/enforced/{}", demo_absent_sku(i)))
                .await
                .stage()
                == "intercepted"
            {
                n += 1;
            }
        }
        n
    };
    assert!(
        intercepted >= 480,
        "{intercepted} of 500 absent keys intercepted after a warm start"
    );
    drop(warm);

    let mut truncated = good.clone();
    truncated.truncate(good.len() / 2);
    let mut flipped = good.clone();
    let mid = flipped.len() / 2;
    flipped[mid] ^= 0x40;
    let mut wrong_version = good.clone();
    wrong_version[8] = wrong_version[8].wrapping_add(1);
    for (what, bytes) in [
        ("truncated", truncated),
        ("flipped byte", flipped),
        ("wrong version", wrong_version),
    ] {
        std::fs::write(&path, &bytes).expect("write bad snapshot");
        let proxy = TestProxy::spawn_ready(&toml).await;
        let f = proxy.admin_get("/admin/filters").await.json();
        assert_eq!(
            f["filters"][0]["last_load"]["origin"], "source",
            "{what}: {f}"
        );
        assert_eq!(
            proxy
                .metric(
                    "bloomgate_filter_snapshot_loads_total{filter=\"products\",result=\"rejected\"}"
                )
                .await,
            1.0,
            "{what}"
        );
        for i in (0..N).step_by(997) {
            assert_eq!(
                proxy
                    .get(&format!("/enforced/{}", demo_sku(i)))
                    .await
                    .status
                    .as_u16(),
                200,
                "{what}"
            );
        }
        // The rebuild writes a fresh snapshot in the background. Let it land before the
        // next case writes its bad file, or it could overwrite that file.
        let deadline = Instant::now() + Duration::from_secs(30);
        while proxy
            .metric("bloomgate_filter_snapshot_writes_total{filter=\"products\",result=\"ok\"}")
            .await
            < 1.0
        {
            assert!(
                Instant::now() < deadline,
                "{what}: no snapshot written after the rebuild"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shadow_mode_serves_and_counts_false_negatives_that_enforce_mode_refuses() {
    let Some(server) = mysql_url() else { return };
    let db = TestDb::create(&server, 1_000).await;
    let mut s = setup(&db.url, 1_000);
    s.sync = false;
    s.fpp = 0.0001;
    s.mode = "shadow";
    let proxy = TestProxy::spawn_ready(&config(&s)).await;
    // Only a filter with sync publishes its interval (the sync-lag alert relies on it).
    assert_eq!(
        proxy
            .metric_or_absent("bloomgate_filter_sync_interval_seconds{filter=\"products\"}")
            .await,
        None
    );
    // Keys inserted behind the proxy's back; with sync off the filter never learns them.
    // Keys it refuses, found through the enforced route (the routes share the filter),
    // so that the shadow route counts only the requests below.
    let hidden = refused_absent_keys(&proxy, "/enforced/", 0, 5).await;
    db.insert_products(&hidden).await;
    for (n, k) in hidden.iter().enumerate() {
        for round in 0..2 {
            let r = proxy.get(&format!("/api/products/{k}")).await;
            assert_eq!(r.status.as_u16(), 200, "shadow mode serves {k}");
            assert_eq!(r.stage(), if round == 0 { "miss" } else { "hit" });
            let fns = proxy
                .metric("bloomgate_false_negatives_total{route=\"products\"}")
                .await;
            assert_eq!(
                fns,
                (n * 2 + round + 1) as f64,
                "one false negative per request"
            );
        }
        let r = proxy.get(&format!("/enforced/{k}")).await;
        assert_eq!(
            (r.status.as_u16(), r.stage()),
            (404, "intercepted"),
            "enforce mode refuses {k}"
        );
    }
    let would = proxy
        .metric("bloomgate_requests_total{outcome=\"would_intercept\",route=\"products\"}")
        .await;
    assert_eq!(would, 10.0);
    // Present keys the filter knows are not false negatives.
    let r = proxy.get(&format!("/api/products/{}", demo_sku(3))).await;
    assert_eq!(r.status.as_u16(), 200);
    assert_eq!(
        proxy
            .metric("bloomgate_false_negatives_total{route=\"products\"}")
            .await,
        10.0
    );
    assert_eq!(
        proxy
            .metric("bloomgate_false_negatives_total{route=\"enforced\"}")
            .await,
        0.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_through_the_proxy_adds_the_key_at_once() {
    let Some(server) = mysql_url() else { return };
    let db = TestDb::create(&server, 100).await;
    let stub = StubUpstream::start((0..100).map(demo_sku)).await;
    let toml = TestConfig::new(&db.url)
        .upstream(&stub.url())
        .false_positive_rate(0.0001)
        .route(TestRoute::upstream("products", "/api/products/{id}"))
        .write_through(
            "/api/products",
            "{ header = \"location\" }",
            &["methods = [\"POST\"]", "statuses = [201]"],
        )
        .write_through("/api/products/json", "{ json = \"sku_id\" }", &[])
        .toml();
    let proxy = TestProxy::spawn_ready(&toml).await;
    let new_key = 987_654_321u64;
    assert_eq!(
        proxy.get(&format!("/api/products/{new_key}")).await.stage(),
        "intercepted"
    );
    let r = proxy
        .client()
        .send(
            Method::POST,
            &format!("http://{}/api/products", proxy.data),
            &[("content-type", "application/json")],
            Bytes::from(format!("{{\"sku_id\":{new_key}}}")),
        )
        .await;
    assert_eq!((r.status.as_u16(), r.stage()), (201, "bypass"));
    let r = proxy.get(&format!("/api/products/{new_key}")).await;
    assert_eq!(
        (r.status.as_u16(), r.stage()),
        (200, "miss"),
        "{}",
        r.text()
    );
    // The JSON rule: the key is a field of the response body.
    let json_key = 987_654_329u64;
    let r = proxy
        .client()
        .send(
            Method::POST,
            &format!("http://{}/api/products/json", proxy.data),
            &[],
            Bytes::from(format!("{{\"sku_id\":{json_key}}}")),
        )
        .await;
    assert_eq!(r.status.as_u16(), 201);
    assert_eq!(
        r.json()["sku_id"],
        json_key,
        "the body is passed on after being read"
    );
    let r = proxy.get(&format!("/api/products/{json_key}")).await;
    assert_eq!(r.status.as_u16(), 200, "{}", r.stage());
    assert_eq!(
        proxy
            .metric("bloomgate_write_through_keys_total{filter=\"products\"}")
            .await,
        2.0
    );
}
