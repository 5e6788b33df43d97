//! The gate audits itself, against a real MariaDB and a real proxy: keys hidden from the
//! filter (rows whose `updated_at` lies outside sync's reach, as a write committed
//! outside the overlap window would) are found by the audit, admitted at once, and
//! counted as false negatives once sync has covered their refusal; keys created after
//! their refusal are admitted but not counted; absent keys are checked and left absent.

mod support;

use std::time::{Duration, Instant};

use bloomgate::db::demo_absent_sku;
use bloomgate::gate::Verdict;
use bloomgate::key::{KeyBytes, OwnedKey};
use futures_util::future::join_all;
use support::observe::REFUSAL_TRIES;
use support::{SYNC_QUERY, TestConfig, TestDb, TestProxy, TestRoute, eventually, mysql_url};

const SYNC_INTERVAL_MS: u64 = 300;
const SYNC_OVERLAP_S: u64 = 2;
/// Long enough for any wait below; the waits end on events, not on this.
const LIMIT: Duration = Duration::from_secs(60);

const FOUND: &str = "bloomgate_audit_checks_total{result=\"found\",route=\"products\"}";
const ABSENT: &str = "bloomgate_audit_checks_total{result=\"absent\",route=\"products\"}";
const ERRORS: &str = "bloomgate_audit_checks_total{result=\"error\",route=\"products\"}";
const FALSE_NEGATIVES: &str = "bloomgate_audit_false_negatives_total{route=\"products\"}";
const SYNC_LAG: &str = "bloomgate_audit_sync_lag_total{route=\"products\"}";
const PENDING: &str = "bloomgate_audit_pending";
const CAPACITY_REBUILDS: &str = "bloomgate_filter_capacity_rebuilds_total{filter=\"products\"}";
const SYNC_POLLS: &str = "bloomgate_filter_sync_polls_total{filter=\"products\",result=\"ok\"}";

/// Every refusal sampled, with room for all of this test's. The filter has room for the
/// keys the tests add and heal: past its capacity a rebuild would scan the table, hidden
/// rows included, and take the refusals away from the audit.
fn config(db_url: &str) -> String {
    TestConfig::new(db_url)
        .expected_items(PRODUCTS * 2)
        .database("acquire_timeout = \"10s\"")
        .false_positive_rate(0.0001)
        .sync_query(SYNC_QUERY)
        .sync(format!("interval = \"{SYNC_INTERVAL_MS}ms\""))
        .sync(format!("overlap = \"{SYNC_OVERLAP_S}s\""))
        .route(TestRoute::sql("products", "/api/products/{id}").origin_timeout("20s"))
        .audit("rate = 1.0")
        .audit("max_per_second = 1000")
        .toml()
}

/// Rows that sync never reads: stamped long before any watermark minus the overlap.
async fn insert_hidden(db: &TestDb, skus: &[u64]) {
    for sku in skus {
        sqlx::query(
            "INSERT INTO products (sku_id, name, price, updated_at) \
             VALUES (?, ?, 1.00, '2001-01-01 00:00:00')",
        )
        .bind(sku)
        .bind(format!("Hidden {sku}"))
        .execute(&db.admin)
        .await
        .expect("insert a hidden row");
    }
}

async fn value(proxy: &TestProxy, series: &str) -> f64 {
    proxy.metric(series).await
}

/// Waits until `series` reads `want`.
async fn wait_for(proxy: &TestProxy, series: &str, want: f64) {
    eventually(&format!("{series} = {want}"), LIMIT, || async {
        value(proxy, series).await == want
    })
    .await;
}

/// Waits for `n` more successful sync polls than now.
async fn wait_polls(proxy: &TestProxy, n: f64) {
    let from = value(proxy, SYNC_POLLS).await;
    eventually("sync polls", LIMIT, || async {
        value(proxy, SYNC_POLLS).await >= from + n
    })
    .await;
}

/// Products in the database.
const PRODUCTS: u64 = 1_000;

/// A database of 1,000 products and a proxy over it, ready, past its first sync poll.
async fn start(server: &str) -> (TestDb, TestProxy) {
    let db = TestDb::create(server, PRODUCTS).await;
    let proxy = TestProxy::spawn_ready(&config(&db.url)).await;
    wait_polls(&proxy, 1.0).await;
    (db, proxy)
}

/// `n` absent keys from `demo_absent_sku(from)` on that the proxy's filter refuses,
/// skipping its false positives; fails the test if [`REFUSAL_TRIES`] in a row are let
/// through. The seed is random per build, so which absent keys are false positives
/// changes from run to run. The filter is asked directly: a request would be refused,
/// sampled and checked by the audit, adding to the checks these tests count.
fn refused_keys(proxy: &TestProxy, from: u64, n: usize) -> Vec<u64> {
    let filter = proxy.proxy.filter("products").expect("the products filter");
    let mut bytes = KeyBytes::new();
    let mut refused = Vec::with_capacity(n);
    let (mut i, mut passed) = (from, 0);
    while refused.len() < n {
        let key = demo_absent_sku(i);
        i += 1;
        if filter.check(bytes.of(&OwnedKey::Int(key).as_norm())) == Verdict::Absent {
            refused.push(key);
            passed = 0;
            continue;
        }
        passed += 1;
        assert!(
            passed < REFUSAL_TRIES,
            "{REFUSAL_TRIES} absent keys in a row let through by the filter, the last {key}"
        );
    }
    refused
}

/// Asks for `key` and checks that the gate refuses it.
async fn assert_refused(proxy: &TestProxy, key: u64) {
    let r = proxy.get(&format!("/api/products/{key}")).await;
    assert_eq!(
        (r.status.as_u16(), r.stage()),
        (404, "intercepted"),
        "{key}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hidden_keys_are_found_healed_and_counted_once_sync_has_covered_their_refusal() {
    let Some(server) = mysql_url() else { return };
    let (db, proxy) = start(&server).await;

    let hidden = refused_keys(&proxy, 100, 5);
    insert_hidden(&db, &hidden).await;
    wait_polls(&proxy, 2.0).await;
    let refused_at = Instant::now();
    // Each hidden key twice at once: both are refused, and the second refusal must not
    // count the key again.
    for k in &hidden {
        let path = format!("/api/products/{k}");
        let replies = join_all([proxy.get(&path), proxy.get(&path)]).await;
        let stages: Vec<(u16, String)> = replies
            .iter()
            .map(|r| (r.status.as_u16(), r.stage().to_owned()))
            .collect();
        assert!(
            stages.contains(&(404, "intercepted".to_owned()))
                && stages
                    .iter()
                    .all(|s| s.0 == 404 && s.1 == "intercepted" || s.0 == 200),
            "sync never read {k}, so the filter refuses it: {stages:?}"
        );
    }
    wait_for(&proxy, FOUND, 5.0).await;
    let found_after = refused_at.elapsed();
    // Admitted at once: served now, long before any decision.
    for k in &hidden {
        let r = proxy.get(&format!("/api/products/{k}")).await;
        assert_eq!(r.status.as_u16(), 200, "{k} is served once found");
        assert!(matches!(r.stage(), "miss" | "hit"), "{k}: {}", r.stage());
    }
    let healed_after = refused_at.elapsed();
    wait_for(&proxy, PENDING, 0.0).await;
    let decided_after = refused_at.elapsed();
    assert_eq!(value(&proxy, FALSE_NEGATIVES).await, 5.0);
    assert_eq!(value(&proxy, SYNC_LAG).await, 0.0);
    assert!(
        decided_after >= Duration::from_secs(SYNC_OVERLAP_S),
        "judged after {decided_after:?}, before sync could have covered the refusal"
    );
    // More polls change nothing: each key was counted once.
    wait_polls(&proxy, 3.0).await;
    assert_eq!(value(&proxy, FALSE_NEGATIVES).await, 5.0);
    assert_eq!(
        value(&proxy, CAPACITY_REBUILDS).await,
        0.0,
        "no rebuild scanned the table"
    );
    assert_eq!(value(&proxy, ERRORS).await, 0.0);
    let refusals = value(
        &proxy,
        "bloomgate_requests_total{outcome=\"intercepted\",route=\"products\"}",
    )
    .await;
    eprintln!(
        "{refusals} refusals of 5 hidden keys: all found after {found_after:?}, served after \
         {healed_after:?}, judged after {decided_after:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_created_after_their_refusal_are_healed_but_not_counted() {
    let Some(server) = mysql_url() else { return };
    let (db, proxy) = start(&server).await;
    let fresh = refused_keys(&proxy, 200, 3);

    // The table is locked: the audit's lookups wait behind the lock, so the rows the
    // test inserts meanwhile (stamped now, after the refusals) are there when they run.
    let mut lock = db.admin.acquire().await.expect("a connection");
    sqlx::raw_sql("LOCK TABLES products WRITE")
        .execute(&mut *lock)
        .await
        .expect("lock the table");
    let refused_at = Instant::now();
    for k in &fresh {
        assert_refused(&proxy, *k).await;
    }
    db.wait_running("FROM products WHERE sku_id", 1).await;
    for k in &fresh {
        sqlx::query("INSERT INTO products (sku_id, name, price) VALUES (?, ?, 1.00)")
            .bind(k)
            .bind(format!("New {k}"))
            .execute(&mut *lock)
            .await
            .expect("insert behind the lock");
    }
    sqlx::raw_sql("UNLOCK TABLES")
        .execute(&mut *lock)
        .await
        .expect("unlock the table");
    drop(lock);

    wait_for(&proxy, FOUND, 3.0).await;
    for k in &fresh {
        let r = proxy.get(&format!("/api/products/{k}")).await;
        assert_eq!(r.status.as_u16(), 200, "{k} is served once found");
    }
    // Sync reads the new rows (stamped now) and admits them too: the sync lag.
    wait_for(&proxy, PENDING, 0.0).await;
    let decided_after = refused_at.elapsed();
    assert_eq!(value(&proxy, SYNC_LAG).await, 3.0);
    assert_eq!(value(&proxy, FALSE_NEGATIVES).await, 0.0);
    eprintln!("3 keys created after their refusal: judged the sync lag after {decided_after:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn absent_keys_are_checked_and_stay_absent() {
    let Some(server) = mysql_url() else { return };
    // The first poll admits every row it reads (unconfirmed until the next build).
    let (_db, proxy) = start(&server).await;
    let unconfirmed = proxy.filter_status("products").await["unconfirmed_keys"].clone();
    let absent = refused_keys(&proxy, 300, 20);
    for k in &absent {
        assert_refused(&proxy, *k).await;
    }
    wait_for(&proxy, ABSENT, 20.0).await;
    assert_eq!(value(&proxy, FOUND).await, 0.0);
    assert_eq!(value(&proxy, PENDING).await, 0.0);
    // Nothing was admitted: the gate still refuses every one.
    for k in &absent {
        assert_refused(&proxy, *k).await;
    }
    assert_eq!(
        proxy.filter_status("products").await["unconfirmed_keys"],
        unconfirmed,
        "no key was admitted"
    );
    wait_polls(&proxy, 2.0).await;
    assert_eq!(value(&proxy, FALSE_NEGATIVES).await, 0.0);
    assert_eq!(value(&proxy, SYNC_LAG).await, 0.0);
}
