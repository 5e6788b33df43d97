//! Binlog mode against a real MariaDB writing a ROW-format binary log (scripts/mariadb
//! starts it so): every committed insert, update and delete of the source table reaches
//! the filter and the cache through the log, with no poll query. The waits are on what
//! the test checks (a key let through, a fresh answer, a counter), each bounded by a
//! generous deadline that only catches a hang.

mod support;

use std::time::Duration;

use bloomgate::db::demo_sku;
use sqlx::AssertSqlSafe;
use support::observe::{eventually, filter_status};
use support::{TestConfig, TestDb, TestProxy, TestRoute, mysql_url};

const TOKEN: &str = "binlog-test-token-0123456789";

/// A generous bound on waits that only catches a hang.
const SETTLE: Duration = Duration::from_secs(60);

/// A key no demo row has: demo keys are small, and these are far above them.
fn new_key(i: u64) -> u64 {
    9_000_000_000 + i
}

/// Gives the test's user what a replica needs, as docs/freshness.md asks of the
/// replication user.
async fn grant_replication(db: &TestDb) {
    sqlx::query(AssertSqlSafe(format!(
        "GRANT REPLICATION SLAVE, REPLICATION CLIENT ON *.* TO '{}'@'%'",
        db.user()
    )))
    .execute(&db.admin)
    .await
    .expect("grant replication");
}

/// The products filter in binlog mode over `db`, caching found and missing keys for ten
/// minutes (so only the log can refresh them).
fn config(db: &TestDb) -> TestConfig {
    TestConfig::new(&db.url)
        .admin_token(TOKEN)
        .sync("watermark = \"binlog\"")
        .sync("binlog = { heartbeat = \"200ms\" }")
        .cache("ttl = \"10m\"")
        .cache("negative_ttl = \"10m\"")
        .route(TestRoute::sql("products", "/api/products/{id}"))
}

async fn exec(db: &TestDb, sql: &str) {
    sqlx::query(AssertSqlSafe(sql.to_owned()))
        .execute(&db.admin)
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"));
}

/// Waits until `proxy` answers `key` with `status`, returning the stage.
async fn wait_status(proxy: &TestProxy, key: u64, status: u16) -> String {
    let path = format!("/api/products/{key}");
    let deadline = std::time::Instant::now() + SETTLE;
    loop {
        let r = proxy.get(&path).await;
        if r.status.as_u16() == status {
            return r.stage().to_owned();
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{path}: still {} {} after {SETTLE:?}",
            r.status,
            r.stage()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

async fn binlog_changes(proxy: &TestProxy, change: &str) -> f64 {
    proxy
        .counter_or_zero(&format!(
            "bloomgate_filter_binlog_changes_total{{change=\"{change}\",filter=\"products\"}}"
        ))
        .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inserts_updates_and_deletes_reach_the_gate_and_the_cache_through_the_log() {
    let Some(server) = mysql_url() else { return };
    let db = TestDb::create(&server, 100).await;
    grant_replication(&db).await;
    let proxy = TestProxy::spawn_ready(&config(&db).toml()).await;
    eventually("the stream reads the log", SETTLE, || async {
        proxy
            .metric_or_absent("bloomgate_filter_binlog_lag_seconds{filter=\"products\"}")
            .await
            .is_some_and(|lag| lag == 0.0)
    })
    .await;
    let status = filter_status(proxy.client(), proxy.admin, "products").await;
    let mark = status["sync_watermark"].as_str().unwrap_or_default();
    assert!(mark.starts_with("binlog file "), "{status}");

    // An insert: refused before, served after, with no poll in between.
    let added = new_key(1);
    assert_eq!(wait_status(&proxy, added, 404).await, "intercepted");
    db.insert_product(added).await;
    assert_eq!(wait_status(&proxy, added, 200).await, "miss");
    assert!(binlog_changes(&proxy, "insert").await >= 1.0);

    // An update of a cached row: the next answer is the new one, not the cached one.
    let sku = demo_sku(7);
    let path = format!("/api/products/{sku}");
    assert_eq!(proxy.get(&path).await.stage(), "miss");
    assert_eq!(proxy.get(&path).await.stage(), "hit");
    exec(
        &db,
        &format!("UPDATE products SET name = 'renamed' WHERE sku_id = {sku}"),
    )
    .await;
    eventually("the updated row is served fresh", SETTLE, || async {
        proxy.get(&path).await.json()["name"] == "renamed"
    })
    .await;

    // A delete: its cache entry goes, the next answer is 404, and it is counted.
    let gone = demo_sku(9);
    let gone_path = format!("/api/products/{gone}");
    assert_eq!(proxy.get(&gone_path).await.status.as_u16(), 200);
    assert_eq!(proxy.get(&gone_path).await.stage(), "hit");
    db.delete_product(gone).await;
    let stage = wait_status(&proxy, gone, 404).await;
    // Its bits are still set: the gate lets it through, and the origin says no.
    assert_eq!(stage, "miss", "a deleted key's bits stay set");
    let deleted = proxy
        .metric("bloomgate_filter_deleted_keys{filter=\"products\"}")
        .await;
    assert_eq!(deleted, 1.0);
    let effective = proxy
        .metric("bloomgate_filter_effective_fpp{filter=\"products\"}")
        .await;
    let items = proxy
        .metric("bloomgate_filter_items{filter=\"products\"}")
        .await;
    assert!(
        effective >= deleted / items,
        "effective rate {effective} below the deleted share {deleted}/{items}"
    );
    // No query polled the table: only the build's scan read it.
    assert_eq!(
        proxy
            .counter_or_zero("bloomgate_filter_sync_polls_total{filter=\"products\",result=\"ok\"}")
            .await,
        0.0
    );
}
