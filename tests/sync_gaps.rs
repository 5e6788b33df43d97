//! Rows that become visible out of order: an insert committed after a later one was
//! already synced, a rolled-back insert, and an insert left open while a full build ran
//! (integer watermarks, gap tracking); and the bound that `overlap` sets for timestamp
//! watermarks. Against a real MariaDB and a real proxy; every wait is on an event (a key
//! served, a poll counted), never on a sleep.

mod support;

use std::time::{Duration, Instant};

use bloomgate::db::demo_absent_sku;
use chrono::{DurationRound, NaiveDateTime, TimeDelta, Utc};
use serde_json::Value;
use sqlx::MySqlExecutor;
use support::{SYNC_QUERY, TestConfig, TestDb, TestProxy, TestRoute, mysql_url};

const FILTER: &str = "filter=\"products\"";
/// After a commit, the row must be served within this many successful polls.
const POLLS: f64 = 5.0;

/// The config these tests share: a filter whose sync polls every 200 ms, to which a test
/// adds the rest of `[filters.products.sync]`.
fn config(db_url: &str) -> TestConfig {
    TestConfig::new(db_url)
        .admin_token("test-admin-token")
        .cache("negative_ttl = \"1m\"")
        .false_positive_rate(0.0001)
        .sync("interval = \"200ms\"")
        .route(TestRoute::sql("products", "/api/products/{id}").origin_timeout("10s"))
}

/// [`config`] with integer-watermark sync reading `feed` (the table, or a view of it).
fn integer_sync(db_url: &str, feed: &str) -> TestConfig {
    config(db_url)
        .sync_query(&format!("SELECT sku_id, id FROM {feed} WHERE id >= ?"))
        .sync("watermark = \"integer\"")
        .sync("start_query = \"SELECT MAX(id) FROM products\"")
}

/// The demo table has no auto-increment column; these tests need one.
async fn with_auto_increment_ids(db: &TestDb) {
    sqlx::query("ALTER TABLE products ADD COLUMN id BIGINT NOT NULL AUTO_INCREMENT UNIQUE")
        .execute(&db.admin)
        .await
        .expect("add an auto-increment id");
}

/// Inserts a product stamped `updated_at` (or now); returns its auto-increment id, if any.
async fn insert<'e>(exec: impl MySqlExecutor<'e>, sku: u64, at: Option<NaiveDateTime>) -> u64 {
    sqlx::query(
        "INSERT INTO products (sku_id, name, price, updated_at) \
         VALUES (?, ?, 1.00, COALESCE(?, CURRENT_TIMESTAMP))",
    )
    .bind(sku)
    .bind(format!("Product {sku}"))
    .bind(at)
    .execute(exec)
    .await
    .expect("insert product")
    .last_insert_id()
}

async fn execute(db: &TestDb, sql: &'static str) {
    sqlx::query(sql)
        .execute(&db.admin)
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"));
}

fn path(sku: u64) -> String {
    format!("/api/products/{sku}")
}

async fn polls(proxy: &TestProxy, result: &str) -> f64 {
    proxy
        .metric(&format!(
            "bloomgate_filter_sync_polls_total{{{FILTER},result=\"{result}\"}}"
        ))
        .await
}

async fn open_gaps(proxy: &TestProxy) -> f64 {
    proxy
        .metric(&format!("bloomgate_filter_sync_open_gaps{{{FILTER}}}"))
        .await
}

async fn filter_status(proxy: &TestProxy) -> Value {
    proxy.admin_get("/admin/filters").await.json()["filters"][0].clone()
}

fn int_field(status: &Value, field: &str) -> i64 {
    status[field]
        .as_str()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("{field} is not an integer: {status}"))
}

async fn wait_for(what: &str, limit: Duration, mut check: impl AsyncFnMut() -> bool) {
    let deadline = Instant::now() + limit;
    while !check().await {
        assert!(Instant::now() < deadline, "{what}: not within {limit:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Waits for `at_least` more successful polls than now.
async fn wait_for_polls(proxy: &TestProxy, at_least: f64) {
    let from = polls(proxy, "ok").await;
    wait_for("sync polls", Duration::from_secs(30), async || {
        polls(proxy, "ok").await >= from + at_least
    })
    .await;
}

/// Whether `sku` is answered 200 before `POLLS` more successful polls have finished.
async fn served_within_polls(proxy: &TestProxy, sku: u64) -> bool {
    let from = polls(proxy, "ok").await;
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let done = polls(proxy, "ok").await;
        if proxy.get(&path(sku)).await.status.as_u16() == 200 {
            return true;
        }
        if done >= from + POLLS {
            return false;
        }
        assert!(Instant::now() < deadline, "sync polls stalled");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn served(proxy: &TestProxy, sku: u64) -> bool {
    proxy.get(&path(sku)).await.status.as_u16() == 200
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_insert_committed_after_a_later_synced_one_is_served() {
    let Some(server) = mysql_url() else { return };
    let db = TestDb::create(&server, 100).await;
    with_auto_increment_ids(&db).await;
    let toml = integer_sync(&db.url, "products")
        .sync("overlap_ids = 0")
        .sync("gap_timeout = \"10m\"")
        .toml();
    let proxy = TestProxy::spawn_ready(&toml).await;
    let (a, b) = (demo_absent_sku(1), demo_absent_sku(2));

    // A takes its id first and commits last.
    let mut tx = db.admin.begin().await.expect("begin");
    let id_a = insert(&mut *tx, a, None).await;
    let id_b = insert(&db.admin, b, None).await;
    assert!(id_b > id_a, "ids {id_a} then {id_b}");
    wait_for("B served", Duration::from_secs(20), async || {
        served(&proxy, b).await
    })
    .await;
    // A poll read B, so the watermark is past A's id, and A's id is an open gap that
    // the next polls start from (the poll admits B before it records its gaps).
    wait_for("A's id an open gap", Duration::from_secs(10), async || {
        filter_status(&proxy).await["sync_open_gaps"].as_u64() >= Some(1)
    })
    .await;
    let status = filter_status(&proxy).await;
    assert!(
        int_field(&status, "sync_watermark") >= id_b as i64,
        "{status}"
    );
    assert!(
        int_field(&status, "sync_resume_from") <= id_a as i64,
        "{status}"
    );
    assert!(status["sync_open_gaps"].as_u64() >= Some(1), "{status}");
    assert!(open_gaps(&proxy).await >= 1.0);
    assert_eq!(proxy.get(&path(a)).await.stage(), "intercepted");

    tx.commit().await.expect("commit A");
    assert!(
        served_within_polls(&proxy, a).await,
        "A was still refused {POLLS} polls after its commit"
    );
    wait_for("the gap closed", Duration::from_secs(10), async || {
        open_gaps(&proxy).await == 0.0
    })
    .await;
    let status = filter_status(&proxy).await;
    assert_eq!(
        int_field(&status, "sync_resume_from"),
        int_field(&status, "sync_watermark"),
        "{status}"
    );
    assert_eq!(
        proxy
            .metric(&format!(
                "bloomgate_filter_sync_gaps_expired_total{{{FILTER}}}"
            ))
            .await,
        0.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rolled_back_insert_leaves_a_gap_that_expires() {
    let Some(server) = mysql_url() else { return };
    let db = TestDb::create(&server, 100).await;
    with_auto_increment_ids(&db).await;
    let toml = integer_sync(&db.url, "products")
        .sync("overlap_ids = 0")
        .sync("gap_timeout = \"1s\"")
        .toml();
    let proxy = TestProxy::spawn_ready(&toml).await;
    let (a, b) = (demo_absent_sku(1), demo_absent_sku(2));

    let mut tx = db.admin.begin().await.expect("begin");
    let id_a = insert(&mut *tx, a, None).await;
    let id_b = insert(&db.admin, b, None).await;
    assert!(id_b > id_a, "ids {id_a} then {id_b}");
    tx.rollback().await.expect("roll back A");
    wait_for("B served", Duration::from_secs(20), async || {
        served(&proxy, b).await
    })
    .await;

    // A's id never appears: the gap is read again until gap_timeout, then given up.
    let expired = format!("bloomgate_filter_sync_gaps_expired_total{{{FILTER}}}");
    wait_for("the gap expired", Duration::from_secs(30), async || {
        proxy.metric(&expired).await >= 1.0
    })
    .await;
    wait_for("no open gap left", Duration::from_secs(10), async || {
        open_gaps(&proxy).await == 0.0
    })
    .await;
    let status = filter_status(&proxy).await;
    assert_eq!(status["sync_open_gaps"], 0, "{status}");
    assert_eq!(
        int_field(&status, "sync_resume_from"),
        int_field(&status, "sync_watermark"),
        "{status}"
    );
    assert_eq!(proxy.get(&path(a)).await.stage(), "intercepted");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_insert_left_open_during_a_rebuild_is_served_after_it_commits() {
    let Some(server) = mysql_url() else { return };
    let db = TestDb::create(&server, 100).await;
    with_auto_increment_ids(&db).await;
    // Sync reads a view, so the test can stop it (drop the view) while the rebuild runs:
    // then only the build's own reach-back can catch the open insert.
    execute(
        &db,
        "CREATE VIEW sync_feed AS SELECT sku_id, id FROM products",
    )
    .await;
    let toml = integer_sync(&db.url, "sync_feed")
        .sync("gap_timeout = \"10m\"")
        .toml();
    let proxy = TestProxy::spawn_ready(&toml).await;
    wait_for_polls(&proxy, 1.0).await;

    execute(&db, "DROP VIEW sync_feed").await;
    let failed = polls(&proxy, "error").await;
    wait_for("sync stopped", Duration::from_secs(20), async || {
        polls(&proxy, "error").await > failed
    })
    .await;

    let (a, b) = (demo_absent_sku(1), demo_absent_sku(2));
    let mut tx = db.admin.begin().await.expect("begin");
    let id_a = insert(&mut *tx, a, None).await;
    let id_b = insert(&db.admin, b, None).await;
    assert!(id_b > id_a, "ids {id_a} then {id_b}");

    let r = proxy
        .admin_post(
            "/admin/filters/products/rebuild",
            Some("test-admin-token"),
            "",
        )
        .await;
    assert_eq!(r.status.as_u16(), 202);
    wait_for(
        "the rebuild finished",
        Duration::from_secs(30),
        async || {
            let s = filter_status(&proxy).await;
            s["last_load"]["reason"] == "requested"
                && s["last_load"]["result"] == "ok"
                && s["last_load"]["loading"] == false
        },
    )
    .await;
    // The build read B and started sync at B's id; A's id is in its reach-back.
    let status = filter_status(&proxy).await;
    assert_eq!(
        int_field(&status, "sync_watermark"),
        id_b as i64,
        "{status}"
    );
    assert!(
        int_field(&status, "sync_resume_from") <= id_a as i64,
        "{status}"
    );
    assert!(served(&proxy, b).await);
    assert_eq!(proxy.get(&path(a)).await.stage(), "intercepted");

    execute(
        &db,
        "CREATE VIEW sync_feed AS SELECT sku_id, id FROM products",
    )
    .await;
    wait_for_polls(&proxy, 1.0).await;
    assert_eq!(proxy.get(&path(a)).await.stage(), "intercepted");

    tx.commit().await.expect("commit A");
    assert!(
        served_within_polls(&proxy, a).await,
        "A was still refused {POLLS} polls after its commit"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_from_a_snapshot_reads_the_open_gaps_again() {
    let Some(server) = mysql_url() else { return };
    let db = TestDb::create(&server, 100).await;
    with_auto_increment_ids(&db).await;
    let dir = tempfile::TempDir::new().expect("temp dir");
    let snapshot = dir.path().join("products.snap");
    let toml = integer_sync(&db.url, "products")
        .snapshot_path(&snapshot)
        .sync("overlap_ids = 0")
        .sync("gap_timeout = \"10m\"")
        .toml();
    let writes = format!("bloomgate_filter_snapshot_writes_total{{{FILTER},result=\"ok\"}}");
    let (a, b) = (demo_absent_sku(1), demo_absent_sku(2));
    let mut tx = db.admin.begin().await.expect("begin");
    let id_a = insert(&mut *tx, a, None).await;
    {
        let first = TestProxy::spawn_ready(&toml).await;
        let id_b = insert(&db.admin, b, None).await;
        assert!(id_b > id_a, "ids {id_a} then {id_b}");
        wait_for("A's id an open gap", Duration::from_secs(20), async || {
            filter_status(&first).await["sync_open_gaps"].as_u64() >= Some(1)
        })
        .await;
        assert!(served(&first, b).await);
        // A's id is an open gap when the rebuild writes its snapshot.
        let r = first
            .admin_post(
                "/admin/filters/products/rebuild",
                Some("test-admin-token"),
                "",
            )
            .await;
        assert_eq!(r.status.as_u16(), 202);
        wait_for(
            "the rebuild's snapshot",
            Duration::from_secs(30),
            async || first.metric(&writes).await >= 2.0,
        )
        .await;
    }

    let warm = TestProxy::spawn_ready(&toml).await;
    let status = filter_status(&warm).await;
    assert_eq!(status["last_load"]["origin"], "snapshot", "{status}");
    // Whether or not the first poll has run yet, sync starts at or below A's id.
    assert!(
        int_field(&status, "sync_resume_from") <= id_a as i64,
        "{status}"
    );
    assert!(served(&warm, b).await);
    wait_for_polls(&warm, 1.0).await;
    assert_eq!(warm.get(&path(a)).await.stage(), "intercepted");
    assert!(open_gaps(&warm).await >= 1.0);

    tx.commit().await.expect("commit A");
    assert!(
        served_within_polls(&warm, a).await,
        "A was still refused {POLLS} polls after its commit"
    );
}

/// Timestamp watermarks: A is stamped `delay` before B but commits after a poll has read
/// B. Returns whether A is served within a few polls of its commit.
async fn late_commit_is_served(delay: Duration, overlap: Duration) -> Option<bool> {
    let server = mysql_url()?;
    let db = TestDb::create(&server, 100).await;
    let toml = config(&db.url)
        .sync_query(SYNC_QUERY)
        .sync("watermark = \"timestamp\"")
        .sync(format!("overlap = \"{}s\"", overlap.as_secs()))
        .toml();
    let proxy = TestProxy::spawn_ready(&toml).await;
    // Whole seconds (the column has no fraction), ahead of the build's start mark.
    let b_at = Utc::now()
        .duration_trunc(TimeDelta::seconds(1))
        .expect("truncate")
        .naive_utc()
        + TimeDelta::seconds(1);
    let a_at = b_at - TimeDelta::from_std(delay).expect("delay");
    let (a, b) = (demo_absent_sku(1), demo_absent_sku(2));

    let mut tx = db.admin.begin().await.expect("begin");
    insert(&mut *tx, a, Some(a_at)).await;
    insert(&db.admin, b, Some(b_at)).await;
    wait_for("B served", Duration::from_secs(20), async || {
        served(&proxy, b).await
    })
    .await;
    assert_eq!(proxy.get(&path(a)).await.stage(), "intercepted");
    tx.commit().await.expect("commit A");
    let ok = served_within_polls(&proxy, a).await;
    if !ok {
        assert_eq!(proxy.get(&path(a)).await.stage(), "intercepted");
    }
    Some(ok)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn timestamps_catch_a_commit_that_comes_within_the_overlap() {
    let overlap = Duration::from_secs(2);
    if let Some(ok) = late_commit_is_served(overlap, overlap).await {
        assert!(
            ok,
            "a row stamped `overlap` before the newest synced row was missed"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn timestamps_miss_a_commit_that_comes_beyond_the_overlap() {
    let overlap = Duration::from_secs(2);
    if let Some(ok) = late_commit_is_served(overlap + Duration::from_secs(1), overlap).await {
        assert!(!ok, "a row stamped beyond the overlap was served");
    }
}
