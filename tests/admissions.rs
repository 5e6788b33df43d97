//! No false negatives in any phase of a filter's life: keys admitted (admin API,
//! write-through) before, during and after a full build are in the filter the moment it
//! is swapped in, whatever its source lists; and a "not found" that an origin lookup read
//! just before a key was admitted does not become a negative entry. Every interleaving is
//! driven by events (a build held at each phase by its hook, an upstream answer held by
//! the test), never by sleeps.

mod support;

use std::sync::Arc;
use std::time::Duration;

use bloomgate::db::{demo_absent_sku, demo_sku};
use bloomgate::gate::{BuildHook, BuildPhase, Filter, Verdict};
use bloomgate::key::{KeyBytes, OwnedKey};
use bytes::Bytes;
use http::Method;
use support::{StubUpstream, TestConfig, TestDb, TestProxy, TestRoute, mysql_url};
use tokio::sync::{mpsc, oneshot};

const TOKEN: &str = "test-admin-token";

fn config(db_url: &str, extra_filter: &str) -> String {
    TestConfig::new(db_url)
        .admin_token(TOKEN)
        .cache("negative_ttl = \"10m\"")
        .expected_items(5000)
        .false_positive_rate(0.001)
        .filter(extra_filter)
        .route(
            TestRoute::sql("products", "/api/products/{id}")
                .lookup("SELECT sku_id, name, price FROM products WHERE sku_id = ?"),
        )
        .toml()
}

/// A build step reported by the hook, held until `go` is used (or dropped).
struct Held {
    phase: BuildPhase,
    go: oneshot::Sender<()>,
}

/// Installs a hook that stops every build of `filter` at each phase until the test lets
/// it go on.
fn hold_builds(filter: &Filter) -> mpsc::UnboundedReceiver<Held> {
    let (tx, rx) = mpsc::unbounded_channel();
    let hook: BuildHook = Arc::new(move |phase| {
        let tx = tx.clone();
        Box::pin(async move {
            let (go, wait) = oneshot::channel();
            if tx.send(Held { phase, go }).is_ok() {
                let _ = wait.await;
            }
        })
    });
    filter.set_build_hook(Some(hook));
    rx
}

async fn next_phase(rx: &mut mpsc::UnboundedReceiver<Held>) -> Held {
    tokio::time::timeout(Duration::from_secs(60), rx.recv())
        .await
        .expect("the build reached its next phase")
        .expect("hook alive")
}

fn verdict(filter: &Filter, key: u64) -> Verdict {
    let owned = OwnedKey::Int(key);
    let mut bytes = KeyBytes::new();
    filter.check(bytes.of(&owned.as_norm()))
}

/// Admits `keys` through the admin API; returns how many went into a loaded filter.
async fn admit(proxy: &TestProxy, keys: &[u64]) -> u64 {
    let body = serde_json::to_string(keys).expect("json");
    let r = proxy
        .admin_post("/admin/filters/products/keys", Some(TOKEN), &body)
        .await;
    assert_eq!(r.status.as_u16(), 200, "{}", r.text());
    r.json()["added"].as_u64().expect("added")
}

/// Keys no product has, `n` of them from `from` on.
fn absent(from: u64, n: u64) -> Vec<u64> {
    (from..from + n).map(demo_absent_sku).collect()
}

/// Every key is let through by the filter and not answered `intercepted` over HTTP.
async fn all_present(proxy: &TestProxy, filter: &Filter, what: &str, keys: &[u64]) {
    let lost: Vec<u64> = keys
        .iter()
        .copied()
        .filter(|k| verdict(filter, *k) != Verdict::MaybePresent)
        .collect();
    assert!(
        lost.is_empty(),
        "{what}: {} of {} admitted keys are refused by the new filter, e.g. {:?}",
        lost.len(),
        keys.len(),
        &lost[..lost.len().min(5)]
    );
    for k in keys.iter().take(20) {
        let r = proxy.get(&format!("/api/products/{k}")).await;
        assert_ne!(r.stage(), "intercepted", "{what}: key {k}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_admitted_in_every_phase_of_a_rebuild_are_in_the_filter_it_swaps_in() {
    let Some(server) = mysql_url() else { return };
    let db = TestDb::create(&server, 2_000).await;
    let proxy = TestProxy::spawn_ready(&config(&db.url, "")).await;
    let filter = proxy.proxy.filter("products").expect("filter");
    let mut phases = hold_builds(&filter);

    // Admitted before the rebuild begins; the source does not list them either.
    let before = absent(10_000, 200);
    assert_eq!(admit(&proxy, &before).await, 200);

    let r = proxy
        .admin_post("/admin/filters/products/rebuild", Some(TOKEN), "")
        .await;
    assert_eq!(r.status.as_u16(), 202, "{}", r.text());

    let mut admitted = before.clone();
    let mut from = 20_000;
    for expected in [
        BuildPhase::Sizing,
        BuildPhase::Scanning,
        BuildPhase::Swapping,
    ] {
        let held = next_phase(&mut phases).await;
        assert_eq!(held.phase, expected);
        // While the build is held here, keys are admitted: the old filter serves them at
        // once, and the new one must have them when it is swapped in.
        let keys = absent(from, 200);
        from += 1_000;
        assert_eq!(admit(&proxy, &keys).await, 200);
        for k in &keys {
            assert_eq!(verdict(&filter, *k), Verdict::MaybePresent, "{expected:?}");
        }
        admitted.extend(keys);
        let _ = held.go.send(());
    }
    // The moment the new filter serves, before anything else can add a key again.
    let held = next_phase(&mut phases).await;
    assert_eq!(held.phase, BuildPhase::Swapped);
    all_present(&proxy, &filter, "at the swap", &admitted).await;
    let present: Vec<u64> = (0..2_000).step_by(7).map(demo_sku).collect();
    all_present(&proxy, &filter, "source keys", &present).await;
    let _ = held.go.send(());

    // The source lists none of them, so they are carried into the next build too.
    assert_eq!(
        proxy
            .metric("bloomgate_filter_unconfirmed_keys{filter=\"products\"}")
            .await,
        admitted.len() as f64
    );
    filter.set_build_hook(None);
    let r = proxy
        .admin_post("/admin/filters/products/rebuild", Some(TOKEN), "")
        .await;
    assert_eq!(r.status.as_u16(), 202);
    let finished = |f: &serde_json::Value| {
        f["filters"][0]["last_load"]["loading"] == false
            && f["filters"][0]["last_load"]["reason"] == "requested"
    };
    wait_for_build(&proxy, 2, finished).await;
    all_present(&proxy, &filter, "after a second rebuild", &admitted).await;

    // Once the source lists a key, a build confirms it and stops carrying it.
    db.insert_products(&before).await;
    let r = proxy
        .admin_post("/admin/filters/products/rebuild", Some(TOKEN), "")
        .await;
    assert_eq!(r.status.as_u16(), 202);
    wait_for_build(&proxy, 3, finished).await;
    all_present(&proxy, &filter, "after the source caught up", &admitted).await;
    assert_eq!(
        proxy
            .metric("bloomgate_filter_unconfirmed_keys{filter=\"products\"}")
            .await,
        (admitted.len() - before.len()) as f64
    );
}

/// Waits until `/admin/filters` shows `builds` successful loads and `done` holds.
async fn wait_for_build(proxy: &TestProxy, builds: u64, done: impl Fn(&serde_json::Value) -> bool) {
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        let loads = proxy
            .metric("bloomgate_filter_loads_total{filter=\"products\",result=\"ok\"}")
            .await;
        let f = proxy.admin_get("/admin/filters").await.json();
        if loads >= builds as f64 && done(&f) {
            return;
        }
        assert!(std::time::Instant::now() < deadline, "build {builds}: {f}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_admitted_before_the_first_filter_loads_are_in_it() {
    let Some(server) = mysql_url() else { return };
    let db = TestDb::create(&server, 500).await;
    // The source does not exist yet: the first build fails and is retried.
    let retry = "source_query = \"SELECT sku_id FROM later\"\nload_retry_initial = \"200ms\"\nload_retry_max = \"200ms\"";
    let toml = config(&db.url, "").replace("source_query = \"SELECT sku_id FROM products\"", retry);
    let proxy = TestProxy::spawn(&toml).await;
    let early = absent(30_000, 100);
    let r = proxy
        .admin_post(
            "/admin/filters/products/keys",
            Some(TOKEN),
            &serde_json::to_string(&early).expect("json"),
        )
        .await;
    assert_eq!(r.json()["not_loaded_yet"], 100, "{}", r.text());
    sqlx::query("CREATE TABLE later AS SELECT sku_id FROM products")
        .execute(&db.admin)
        .await
        .expect("create the source");
    proxy.wait_ready(Duration::from_secs(60)).await;
    let filter = proxy.proxy.filter("products").expect("filter");
    all_present(&proxy, &filter, "first load", &early).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_not_found_read_before_an_admission_leaves_no_negative_entry() {
    let Some(server) = mysql_url() else { return };
    let db = TestDb::create(&server, 100).await;
    let stub = StubUpstream::start((0..100).map(demo_sku)).await;
    let toml = TestConfig::new(&db.url)
        .upstream(&stub.url())
        .cache("negative_ttl = \"10m\"")
        .expected_items(100)
        .false_positive_rate(0.5)
        .route(TestRoute::upstream("products", "/api/products/{id}"))
        .write_through("/api/products/json", "{ json = \"sku_id\" }", &[])
        .toml();
    let proxy = TestProxy::spawn_ready(&toml).await;
    let filter = proxy.proxy.filter("products").expect("filter");
    // A key the filter lets through (one of its false positives) that the upstream lacks.
    let key = (0..10_000)
        .map(demo_absent_sku)
        .find(|k| verdict(&filter, *k) == Verdict::MaybePresent)
        .expect("a false positive at p = 0.5");

    // The upstream decides "not found" and is held there.
    let (decided, release) = stub.hold_next_not_found();
    let lookup = {
        let client = proxy.client().clone();
        let url = format!("http://{}/api/products/{key}", proxy.data);
        tokio::spawn(async move { client.send(Method::GET, &url, &[], Bytes::new()).await })
    };
    assert_eq!(decided.await.expect("the lookup reached the upstream"), key);
    // Meanwhile the product is created through the proxy: write-through admits it (and
    // drops the key's negative entries, of which there is none yet).
    let r = proxy
        .client()
        .send(
            Method::POST,
            &format!("http://{}/api/products/json", proxy.data),
            &[],
            Bytes::from(format!("{{\"sku_id\":{key}}}")),
        )
        .await;
    assert_eq!(r.status.as_u16(), 201);
    // Now the held "not found" arrives.
    let _ = release.send(());
    let first = lookup.await.expect("lookup task");
    // The held lookup read before the product existed: its own answer is a 404.
    assert_eq!(first.status.as_u16(), 404);
    // But that answer is not kept: the next request asks again and finds the product.
    let r = proxy.get(&format!("/api/products/{key}")).await;
    assert_eq!(
        (r.status.as_u16(), r.stage()),
        (200, "miss"),
        "a negative entry stored after the admission hides the product"
    );

    // Without an admission in between, the same "not found" is kept as usual.
    let other = (0..10_000)
        .map(demo_absent_sku)
        .filter(|k| *k != key)
        .find(|k| verdict(&filter, *k) == Verdict::MaybePresent)
        .expect("another false positive");
    assert_eq!(
        proxy.get(&format!("/api/products/{other}")).await.stage(),
        "miss"
    );
    assert_eq!(
        proxy.get(&format!("/api/products/{other}")).await.stage(),
        "negative-hit"
    );
}
