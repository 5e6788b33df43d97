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
use support::{TestConfig, TestDb, TestProxy, TestRoute, mysql_url, refused_absent_key};

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
    let added = refused_absent_key(&proxy, "/api/products/", 1).await;
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lower_id_committed_after_a_higher_one_is_admitted_with_no_gap_logic() {
    let Some(server) = mysql_url() else { return };
    let db = TestDb::create(&server, 100).await;
    db.add_auto_increment_ids().await;
    grant_replication(&db).await;
    let proxy = TestProxy::spawn_ready(&config(&db).toml()).await;
    let (low, high) = (
        refused_absent_key(&proxy, "/api/products/", 10).await,
        new_key(11),
    );
    // `low` takes the lower id and commits last, the order that defeated integer
    // watermarks: a poll that read `high` had moved past `low`'s id.
    let mut early = db.admin.begin().await.expect("begin");
    sqlx::query("INSERT INTO products (sku_id, name, price) VALUES (?, 'low', 1.00)")
        .bind(low)
        .execute(&mut *early)
        .await
        .expect("insert low");
    db.insert_product(high).await;
    assert_eq!(wait_status(&proxy, high, 200).await, "miss");
    let ids = db.skus_with_ids(0, u64::MAX).await;
    assert!(!ids.contains(&low), "low is not visible before its commit");
    assert_eq!(
        proxy.get(&format!("/api/products/{low}")).await.stage(),
        "intercepted"
    );
    early.commit().await.expect("commit low");
    assert_eq!(wait_status(&proxy, low, 200).await, "miss");
    let status = filter_status(proxy.client(), proxy.admin, "products").await;
    assert_eq!(
        status["sync_open_gaps"],
        serde_json::Value::Null,
        "{status}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_update_of_a_cached_row_is_served_fresh_on_every_fleet_instance() {
    let (Some(server), Some(redis_bin)) = (mysql_url(), support::redis::redis_server()) else {
        return;
    };
    let db = TestDb::create(&server, 100).await;
    grant_replication(&db).await;
    let redis = support::redis::TestRedis::start(&redis_bin).await;
    let fleet = |id: &str| {
        config(&db)
            .fleet(format!("redis_url = \"{}\"", redis.url()))
            .fleet("namespace = \"binlog\"")
            .fleet(format!("instance_id = \"{id}\""))
            .fleet("lease_ttl = \"2s\"")
            .fleet("lease_renew = \"500ms\"")
            .fleet("retry_interval = \"100ms\"")
            .toml()
    };
    let a = TestProxy::spawn_ready(&fleet("a")).await;
    let b = TestProxy::spawn_ready(&fleet("b")).await;
    let sku = demo_sku(3);
    let path = format!("/api/products/{sku}");
    for p in [&a, &b] {
        assert_eq!(p.get(&path).await.stage(), "miss");
        assert_eq!(p.get(&path).await.stage(), "hit");
    }
    exec(
        &db,
        &format!("UPDATE products SET name = 'fresh' WHERE sku_id = {sku}"),
    )
    .await;
    for (name, p) in [("a", &a), ("b", &b)] {
        eventually(
            &format!("instance {name} serves the update"),
            SETTLE,
            || async { p.get(&path).await.json()["name"] == "fresh" },
        )
        .await;
    }
    // An insert reaches both instances too: the builder's stream, then the fleet's.
    let added = new_key(20);
    db.insert_product(added).await;
    for p in [&a, &b] {
        assert_eq!(wait_status(p, added, 200).await, "miss");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_effective_rate_reaching_its_bound_rebuilds_the_filter_once() {
    let Some(server) = mysql_url() else { return };
    let db = TestDb::create(&server, 1000).await;
    grant_replication(&db).await;
    let proxy = TestProxy::spawn_ready(&config(&db).toml()).await;
    let gauge = |name: &'static str| {
        let proxy = &proxy;
        async move {
            proxy
                .metric(&format!("{name}{{filter=\"products\"}}"))
                .await
        }
    };
    let rebuilds = || async {
        proxy
            .counter_or_zero(
                "bloomgate_filter_binlog_rebuilds_total{filter=\"products\",reason=\"deletes\"}",
            )
            .await
    };
    // With no key deleted, the effective rate is the one the filter's items imply.
    let rate = gauge("bloomgate_filter_effective_fpp").await;
    let items = gauge("bloomgate_filter_items").await;
    let bound = 1.5 * 0.01;
    // The smallest count of deleted keys at which the effective rate reaches the bound.
    let needed = (((bound - rate) / (1.0 - rate)) * items).ceil() as u64;
    assert!(
        (1..100).contains(&needed),
        "rate {rate}, items {items}: {needed}"
    );
    for i in 0..needed - 1 {
        db.delete_product(demo_sku(i)).await;
        let seen = i as f64 + 1.0;
        eventually("the delete is counted", SETTLE, || async {
            gauge("bloomgate_filter_deleted_keys").await == seen
        })
        .await;
    }
    assert!(gauge("bloomgate_filter_effective_fpp").await < bound);
    assert_eq!(rebuilds().await, 0.0, "no rebuild below the bound");
    // The delete that crosses it.
    db.delete_product(demo_sku(needed - 1)).await;
    eventually("a rebuild for deletes", SETTLE, || async {
        let s = filter_status(proxy.client(), proxy.admin, "products").await;
        s["last_load"]["reason"] == "deletes" && s["last_load"]["result"] == "ok"
    })
    .await;
    assert_eq!(rebuilds().await, 1.0);
    // The new filter starts over: none of its keys is deleted, and the deleted ones are
    // refused again (all but the new filter's own false positives, about 1% of them).
    eventually("the count starts over", SETTLE, || async {
        gauge("bloomgate_filter_deleted_keys").await == 0.0
    })
    .await;
    let mut refused = 0;
    for i in 0..needed {
        let r = proxy.get(&format!("/api/products/{}", demo_sku(i))).await;
        assert_eq!(r.status.as_u16(), 404);
        refused += u64::from(r.stage() == "intercepted");
    }
    assert!(
        refused * 10 >= needed * 7,
        "{refused} of {needed} deleted keys refused"
    );
}

/// The replica connection of `user` on the server, from the process list.
async fn dump_thread(db: &TestDb) -> Option<i64> {
    sqlx::query_scalar::<_, i64>(
        "SELECT ID FROM information_schema.PROCESSLIST WHERE COMMAND LIKE 'Binlog Dump%' AND USER = ?",
    )
    .bind(db.user())
    .fetch_optional(&db.admin)
    .await
    .expect("process list")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_replica_connection_resumes_from_the_last_transaction_without_loss() {
    let Some(server) = mysql_url() else { return };
    let db = TestDb::create(&server, 100).await;
    grant_replication(&db).await;
    let proxy = TestProxy::spawn_ready(&config(&db).toml()).await;
    let reconnects = || async {
        proxy
            .counter_or_zero("bloomgate_filter_binlog_reconnects_total{filter=\"products\"}")
            .await
    };
    let before = reconnects().await;
    let deadline = std::time::Instant::now() + SETTLE;
    let thread = loop {
        if let Some(t) = dump_thread(&db).await {
            break t;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no replica connection"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    exec(&db, &format!("KILL {thread}")).await;
    // Written while the stream is down: the new connection starts from the last
    // transaction applied, so none is lost.
    let keys: Vec<u64> = (30..80).map(new_key).collect();
    db.insert_products(&keys).await;
    eventually("the stream reconnects", SETTLE, || async {
        reconnects().await > before
    })
    .await;
    for &k in &keys {
        assert_eq!(wait_status(&proxy, k, 200).await, "miss", "{k}");
    }
    let again = dump_thread(&db).await;
    assert!(
        again.is_some_and(|t| t != thread),
        "a new replica connection: {again:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_truncate_rebuilds_the_filter_and_new_rows_still_arrive() {
    let Some(server) = mysql_url() else { return };
    let db = TestDb::create(&server, 200).await;
    grant_replication(&db).await;
    let proxy = TestProxy::spawn_ready(&config(&db).toml()).await;
    exec(&db, "TRUNCATE TABLE products").await;
    eventually("a rebuild for the truncate", SETTLE, || async {
        let s = filter_status(proxy.client(), proxy.admin, "products").await;
        s["last_load"]["reason"] == "binlog" && s["last_load"]["rows"] == 0
    })
    .await;
    assert_eq!(
        proxy
            .metric("bloomgate_filter_binlog_rebuilds_total{filter=\"products\",reason=\"table_changed\"}")
            .await,
        1.0
    );
    let added = new_key(90);
    db.insert_product(added).await;
    assert_eq!(wait_status(&proxy, added, 200).await, "miss");
}

/// A MariaDB server of the test's own, writing a binary log in `format`, with a test
/// database of `products` rows whose user may read the log.
async fn own_server(format: &str, products: u64) -> (support::mariadb::OwnMariaDb, TestDb) {
    let format = format!("--binlog-format={format}");
    let own =
        support::mariadb::OwnMariaDb::start_with(&["--log-bin=binlog", "--server-id=1", &format])
            .await;
    let db = TestDb::create(&own.url(), products).await;
    grant_replication(&db).await;
    (own, db)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_position_purged_from_the_log_brings_a_rebuild_and_no_false_negative() {
    if mysql_url().is_none() {
        return;
    }
    let (_own, db) = own_server("ROW", 100).await;
    let dir = tempfile::tempdir().expect("temp dir");
    let snapshot = dir.path().join("products.snap");
    let toml = config(&db).snapshot_path(&snapshot).toml();
    let first = TestProxy::spawn_ready(&toml).await;
    assert!(snapshot.exists(), "the build wrote its snapshot");
    drop(first);
    // The server keeps a log file a replica still reads: wait until the first
    // instance's connection is gone.
    eventually("the first replica connection is gone", SETTLE, || async {
        dump_thread(&db).await.is_none()
    })
    .await;
    // While bloomgate is down: rows it has not seen, and the log it would read them
    // from purged.
    let keys: Vec<u64> = (100..150).map(new_key).collect();
    db.insert_products(&keys).await;
    exec(&db, "FLUSH BINARY LOGS").await;
    let current: String = sqlx::query_scalar("SELECT @@GLOBAL.log_bin_basename")
        .fetch_one(&db.admin)
        .await
        .expect("basename");
    let files: Vec<(String, u64)> = sqlx::query_as("SHOW BINARY LOGS")
        .fetch_all(&db.admin)
        .await
        .expect("binary logs");
    let (last, _) = files.last().expect("a binary log").clone();
    assert!(!current.is_empty());
    // The server purges a file only once its binlog checkpoint has moved past it,
    // which happens in the background after the flush.
    eventually("the older logs are purged", SETTLE, || async {
        exec(&db, &format!("PURGE BINARY LOGS TO '{last}'")).await;
        let left: Vec<(String, u64)> = sqlx::query_as("SHOW BINARY LOGS")
            .fetch_all(&db.admin)
            .await
            .expect("binary logs");
        left.len() == 1
    })
    .await;
    let second = TestProxy::spawn(&toml).await;
    eventually("a rebuild for the purged position", SETTLE, || async {
        let s = filter_status(second.client(), second.admin, "products").await;
        s["last_load"]["reason"] == "binlog" && s["last_load"]["result"] == "ok"
    })
    .await;
    assert_eq!(
        second
            .metric("bloomgate_filter_binlog_rebuilds_total{filter=\"products\",reason=\"position_gone\"}")
            .await,
        1.0
    );
    for &k in keys.iter().chain([demo_sku(1), demo_sku(99)].iter()) {
        let r = second.get(&format!("/api/products/{k}")).await;
        assert_eq!(r.status.as_u16(), 200, "{k}: {}", r.stage());
    }
    // And the stream goes on from the new filter's position.
    let added = new_key(200);
    db.insert_product(added).await;
    assert_eq!(wait_status(&second, added, 200).await, "miss");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_without_row_format_is_refused_at_start_with_the_setting_named() {
    if mysql_url().is_none() {
        return;
    }
    let (_own, db) = own_server("STATEMENT", 10).await;
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("bloomgate.toml");
    let toml = config(&db)
        .server("listen = \"127.0.0.1:0\"")
        .admin("listen = \"127.0.0.1:0\"")
        .toml();
    std::fs::write(&path, toml).expect("write config");
    let out = support::output_within(
        std::process::Command::new(env!("CARGO_BIN_EXE_bloomgate"))
            .arg("serve")
            .arg("--config")
            .arg(&path),
        Duration::from_secs(60),
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("filter products: binlog mode cannot start")
            && stderr.contains("binlog_format is STATEMENT: set binlog_format = ROW"),
        "{stderr}"
    );
}

/// Commits per second of the measurement below, and how long it writes.
const COMMITS_PER_SECOND: u64 = 1000;
const WRITE_SECONDS: u64 = 5;

/// A measurement, not a check: run it in release, on its own,
/// `scripts/test --release --test binlog -- --ignored measure --nocapture`
/// (docs/BENCHMARKS.md, "Binlog mode against polling"). Three instances watch one table:
/// a fleet of two in binlog mode (its builder, which reads the log, and a follower, which
/// hears of each key through the fleet's change stream) and one polling a timestamp
/// watermark every second. The test commits single-row inserts at about 1,000 a second
/// for five seconds and times, for every key and instance, how long after the commit
/// returned the instance's filter held the key (from then on it answers 200: the
/// admission dropped any negative entry). Then it updates cached rows one at a time and
/// times how long until each instance serves the new row, and counts the queries each
/// mode sends the database while nothing is written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a measurement: run it on its own (see above)"]
async fn measure_commit_to_admitted_latency_binlog_against_polling() {
    let (Some(server), Some(redis_bin)) = (mysql_url(), support::redis::redis_server()) else {
        return;
    };
    let db = TestDb::create_heavy(&server, 1000).await;
    // The replica connection as a user of its own: the statements the proxy's user runs
    // (counted below) are then the pool's alone.
    let replica = format!("{}r", db.user());
    for stmt in [
        format!("CREATE USER '{replica}'@'%' IDENTIFIED BY 'pw'"),
        format!("GRANT REPLICATION SLAVE, REPLICATION CLIENT ON *.* TO '{replica}'@'%'"),
        format!("GRANT SELECT ON {}.* TO '{replica}'@'%'", db.name),
    ] {
        exec(&db, &stmt).await;
    }
    let replica_url = db
        .url
        .replacen(&format!("//{}:", db.user()), &format!("//{replica}:"), 1);
    exec(
        &db,
        "ALTER TABLE products MODIFY updated_at TIMESTAMP(6) NOT NULL \
         DEFAULT CURRENT_TIMESTAMP(6) ON UPDATE CURRENT_TIMESTAMP(6)",
    )
    .await;
    let redis = support::redis::TestRedis::start(&redis_bin).await;
    let fleet = |id: &str| {
        TestConfig::new(&db.url)
            .admin_token(TOKEN)
            .sync("watermark = \"binlog\"")
            .sync(format!(
                "binlog = {{ heartbeat = \"200ms\", url = \"{replica_url}\" }}"
            ))
            .cache("ttl = \"10m\"")
            .cache("negative_ttl = \"10m\"")
            .route(TestRoute::sql("products", "/api/products/{id}"))
            .expected_items(100_000)
            .fleet(format!("redis_url = \"{}\"", redis.url()))
            .fleet("namespace = \"measure\"")
            .fleet(format!("instance_id = \"{id}\""))
            .fleet("retry_interval = \"100ms\"")
            .toml()
    };
    let builder = TestProxy::spawn_ready(&fleet("a")).await;
    let follower = TestProxy::spawn_ready(&fleet("b")).await;

    // The database load of binlog mode while nothing is written.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let idle = Duration::from_secs(10);
    let before = db.selects().await;
    tokio::time::sleep(idle).await;
    let binlog_queries = (db.selects().await - before) as f64 / idle.as_secs_f64();

    let polling = TestProxy::spawn_ready(
        &TestConfig::new(&db.url)
            .expected_items(100_000)
            .sync_query(support::SYNC_QUERY)
            .sync("interval = \"1s\"")
            .sync("overlap = \"2s\"")
            .cache("ttl = \"10m\"")
            .cache("negative_ttl = \"10m\"")
            .route(TestRoute::sql("products", "/api/products/{id}"))
            .toml(),
    )
    .await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let before = db.selects().await;
    tokio::time::sleep(idle).await;
    let both_queries = (db.selects().await - before) as f64 / idle.as_secs_f64();
    let polling_queries = both_queries - binlog_queries;

    let names = ["binlog builder", "binlog follower", "polling, interval 1s"];
    let filters: Vec<_> = [&builder, &follower, &polling]
        .iter()
        .map(|p| p.proxy.filter("products").expect("filter"))
        .collect();
    let held = |filter: &bloomgate::gate::Filter, key: u64| {
        let text = key.to_string();
        let norm = bloomgate::key::normalize(filter.normalize_rule(), text.as_str().into())
            .expect("an integer key");
        filter.check(bloomgate::key::KeyBytes::new().of(&norm))
            == bloomgate::gate::Verdict::MaybePresent
    };
    // Keys every filter refuses before their commit (no false positive of any).
    let keys: Vec<u64> = (0..)
        .map(|i| new_key(1000 + i))
        .filter(|&k| filters.iter().all(|f| !held(f, k)))
        .take((COMMITS_PER_SECOND * WRITE_SECONDS) as usize)
        .collect();
    let committed = std::sync::Arc::new(std::sync::Mutex::new(
        Vec::<(u64, std::time::Instant)>::new(),
    ));
    let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let watchers: Vec<_> = filters
        .iter()
        .map(|f| {
            let (f, committed, done) = (f.clone(), committed.clone(), done.clone());
            tokio::spawn(async move {
                let mut lags = Vec::new();
                let mut next = 0;
                let mut pending: Vec<(u64, std::time::Instant)> = Vec::new();
                loop {
                    {
                        let c = committed.lock().expect("committed");
                        pending.extend_from_slice(&c[next..]);
                        next = c.len();
                    }
                    pending.retain(|&(k, at)| {
                        if held(&f, k) {
                            lags.push(at.elapsed());
                            false
                        } else {
                            true
                        }
                    });
                    if done.load(std::sync::atomic::Ordering::Acquire) && pending.is_empty() {
                        let c = committed.lock().expect("committed");
                        if next == c.len() {
                            return lags;
                        }
                    }
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
            })
        })
        .collect();
    let pace = Duration::from_secs(1) / COMMITS_PER_SECOND as u32;
    let started = std::time::Instant::now();
    for (i, &k) in keys.iter().enumerate() {
        let due = started + pace * i as u32;
        tokio::time::sleep_until(due.into()).await;
        db.insert_product(k).await;
        committed
            .lock()
            .expect("committed")
            .push((k, std::time::Instant::now()));
    }
    let wrote = started.elapsed();
    done.store(true, std::sync::atomic::Ordering::Release);
    let mut report = format!(
        "{} inserts in {wrote:.2?} ({:.0} commits/s), 2 cores:",
        keys.len(),
        keys.len() as f64 / wrote.as_secs_f64()
    );
    for (name, w) in names.iter().zip(watchers) {
        let mut lags = tokio::time::timeout(SETTLE, w)
            .await
            .expect("every key admitted")
            .expect("watcher");
        lags.sort();
        let q = |p: f64| lags[((lags.len() as f64 * p) as usize).min(lags.len() - 1)];
        report.push_str(&format!(
            "\n  commit → admitted, {name}: p50 {:.1?}, p99 {:.1?}, max {:.1?}",
            q(0.5),
            q(0.99),
            lags[lags.len() - 1]
        ));
    }
    for p in [&builder, &follower, &polling] {
        for &k in keys.iter().step_by(97) {
            assert_eq!(
                p.get(&format!("/api/products/{k}")).await.status.as_u16(),
                200
            );
        }
    }

    // Updates of cached rows, one at a time: commit → the new row served.
    let proxies = [&builder, &follower, &polling];
    let mut fresh: Vec<Vec<Duration>> = vec![Vec::new(); proxies.len()];
    for i in 0..50u64 {
        let sku = demo_sku(i);
        let path = format!("/api/products/{sku}");
        for p in proxies {
            p.get(&path).await;
            assert_eq!(p.get(&path).await.stage(), "hit");
        }
        tokio::time::sleep(Duration::from_millis(rand::random::<u64>() % 1000)).await;
        let name = format!("updated {i}");
        exec(
            &db,
            &format!("UPDATE products SET name = '{name}' WHERE sku_id = {sku}"),
        )
        .await;
        let at = std::time::Instant::now();
        for (j, p) in proxies.iter().enumerate() {
            while p.get(&path).await.json()["name"] != name.as_str() {
                assert!(at.elapsed() < SETTLE, "{sku} never served fresh");
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            fresh[j].push(at.elapsed());
        }
    }
    for (name, mut lags) in names.iter().zip(fresh) {
        lags.sort();
        report.push_str(&format!(
            "\n  update commit → new row served, {name}: p50 {:.1?}, p99 {:.1?}",
            lags[lags.len() / 2],
            lags[(lags.len() * 99 / 100).min(lags.len() - 1)]
        ));
    }
    report.push_str(&format!(
        "\n  queries per second while idle: binlog mode (both instances) {binlog_queries:.2}, polling {polling_queries:.2}"
    ));
    eprintln!("{report}");
}

/// GET `path` on `addr`: (status, x-bloomgate stage, body).
async fn get_on(
    client: &support::HttpClient,
    addr: std::net::SocketAddr,
    path: &str,
) -> support::Reply {
    client
        .send(
            http::Method::GET,
            &format!("http://{addr}{path}"),
            &[],
            bytes::Bytes::new(),
        )
        .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_builder_follows_the_log_from_the_generation_it_loaded() {
    let (Some(server), Some(redis_bin)) = (mysql_url(), support::redis::redis_server()) else {
        return;
    };
    let db = TestDb::create(&server, 100).await;
    grant_replication(&db).await;
    let redis = support::redis::TestRedis::start(&redis_bin).await;
    let toml = |id: &str| {
        config(&db)
            .fleet(format!("redis_url = \"{}\"", redis.url()))
            .fleet("namespace = \"takeover\"")
            .fleet(format!("instance_id = \"{id}\""))
            .fleet("lease_ttl = \"2s\"")
            .fleet("lease_renew = \"500ms\"")
            .fleet("retry_interval = \"100ms\"")
            .toml()
    };
    let client = support::HttpClient::new();
    let role = |admin: std::net::SocketAddr| {
        let client = &client;
        async move {
            get_on(client, admin, "/admin/fleet").await.json()["filters"][0]["role"]
                .as_str()
                .unwrap_or("")
                .to_owned()
        }
    };
    let a = support::binary::Bloomgate::serve(&toml("a"), &[]).await;
    eventually("a builds", SETTLE, || async {
        role(a.admin).await == "builder"
    })
    .await;
    let mut a = a;
    let b = support::binary::Bloomgate::serve(&toml("b"), &[]).await;
    eventually("b loads a's generation", SETTLE, || async {
        get_on(&client, b.admin, "/readyz").await.status.as_u16() == 200
    })
    .await;
    assert_eq!(role(b.admin).await, "follower");
    let first = new_key(300);
    db.insert_product(first).await;
    for node in [a.data, b.data] {
        eventually("the first key everywhere", SETTLE, || async {
            get_on(&client, node, &format!("/api/products/{first}"))
                .await
                .status
                .as_u16()
                == 200
        })
        .await;
    }
    // The builder dies with no goodbye; a key committed while no one reads the log must
    // still reach the fleet once b takes over from the generation it serves.
    a.signal("KILL");
    assert_eq!(a.wait_exit(SETTLE).await, None);
    let orphan = new_key(301);
    db.insert_product(orphan).await;
    eventually("b takes the lease", SETTLE, || async {
        role(b.admin).await == "builder"
    })
    .await;
    eventually(
        "the key committed while no one read the log",
        SETTLE,
        || async {
            get_on(&client, b.data, &format!("/api/products/{orphan}"))
                .await
                .status
                .as_u16()
                == 200
        },
    )
    .await;
    let status = get_on(&client, b.admin, "/admin/filters").await.json();
    let filter = &status["filters"][0];
    let mark = filter["sync_watermark"].as_str().unwrap_or_default();
    assert!(mark.starts_with("binlog file "), "{status}");
    // b scanned nothing: it serves the generation it loaded, and the key came through
    // its own stream, started from that generation's position.
    assert_eq!(filter["last_load"]["origin"], "fleet", "{status}");
    let metrics = get_on(&client, b.admin, "/metrics").await.text();
    let inserts = support::series_value(
        &metrics,
        "bloomgate_filter_binlog_changes_total{change=\"insert\",filter=\"products\"}",
    )
    .expect("b exports its binlog changes");
    assert!(inserts >= 1.0, "b read no insert from the log");
}

/// A TCP relay to one server at a time: [`Switch::to`] points it at another and cuts
/// every connection it relays, as a database failover behind one address does.
struct Switch {
    addr: std::net::SocketAddr,
    target: std::sync::Arc<std::sync::Mutex<(u16, u64)>>,
}

impl Switch {
    async fn start(port: u16) -> Switch {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind the relay");
        let addr = listener.local_addr().expect("relay address");
        let target = std::sync::Arc::new(std::sync::Mutex::new((port, 0u64)));
        let shared = target.clone();
        tokio::spawn(async move {
            while let Ok((mut client, _)) = listener.accept().await {
                let shared = shared.clone();
                tokio::spawn(async move {
                    let (port, epoch) = *shared.lock().expect("target");
                    let Ok(mut server) = tokio::net::TcpStream::connect(("127.0.0.1", port)).await
                    else {
                        return;
                    };
                    let cut = async {
                        while shared.lock().expect("target").1 == epoch {
                            tokio::time::sleep(Duration::from_millis(10)).await;
                        }
                    };
                    tokio::select! {
                        _ = tokio::io::copy_bidirectional(&mut client, &mut server) => {}
                        () = cut => {}
                    }
                });
            }
        });
        Switch { addr, target }
    }

    /// Relays new connections to `port` and cuts the ones relayed so far.
    fn to(&self, port: u16) {
        let mut t = self.target.lock().expect("target");
        *t = (port, t.1 + 1);
    }
}

async fn query_on(url: &str, sql: &str) {
    let pool = sqlx::MySqlPool::connect(url).await.expect("connect");
    sqlx::raw_sql(AssertSqlSafe(sql.to_owned()))
        .execute(&pool)
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"));
    pool.close().await;
}

async fn scalar_on(url: &str, sql: &str) -> String {
    let pool = sqlx::MySqlPool::connect(url).await.expect("connect");
    let v: String = sqlx::query_scalar(AssertSqlSafe(sql.to_owned()))
        .fetch_one(&pool)
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"));
    pool.close().await;
    v
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failover_to_a_replica_is_followed_by_gtid_without_a_rebuild() {
    if mysql_url().is_none() {
        return;
    }
    let log = [
        "--log-bin=binlog",
        "--binlog-format=ROW",
        "--log-slave-updates",
    ];
    let primary =
        support::mariadb::OwnMariaDb::start_with(&[&log[..], &["--server-id=1"]].concat()).await;
    let replica =
        support::mariadb::OwnMariaDb::start_with(&[&log[..], &["--server-id=2"]].concat()).await;
    // The replica follows the primary from where its log is now (both made their own
    // test user at start), by GTID.
    let from = scalar_on(&primary.url(), "SELECT @@GLOBAL.gtid_binlog_pos").await;
    query_on(
        &replica.url(),
        &format!(
            "SET GLOBAL gtid_slave_pos = '{from}'; \
             CHANGE MASTER TO MASTER_HOST = '127.0.0.1', MASTER_PORT = {}, \
             MASTER_USER = 'bloomgate', MASTER_PASSWORD = 'pw', MASTER_USE_GTID = slave_pos; \
             START SLAVE",
            primary.port()
        ),
    )
    .await;
    let db = TestDb::create(&primary.url(), 100).await;
    grant_replication(&db).await;
    let caught_up = || async {
        let at = scalar_on(&primary.url(), "SELECT @@GLOBAL.gtid_binlog_pos").await;
        let waited = scalar_on(
            &replica.url(),
            &format!("SELECT CAST(MASTER_GTID_WAIT('{at}', 30) AS CHAR)"),
        )
        .await;
        assert_eq!(waited, "0", "the replica did not catch up with {at}");
    };
    caught_up().await;
    // bloomgate reaches the database through one address, as behind a proxy or a DNS
    // name that a failover moves.
    let switch = Switch::start(primary.port()).await;
    let cfg = TestConfig::new(&db.url_via(switch.addr))
        .admin_token(TOKEN)
        .sync("watermark = \"binlog\"")
        .sync("binlog = { heartbeat = \"200ms\" }")
        .cache("ttl = \"10m\"")
        .cache("negative_ttl = \"10m\"")
        .route(TestRoute::sql("products", "/api/products/{id}"));
    let proxy = TestProxy::spawn_ready(&cfg.toml()).await;
    let before = new_key(400);
    db.insert_product(before).await;
    assert_eq!(wait_status(&proxy, before, 200).await, "miss");

    // The failover: the replica has everything, stops following and takes writes; the
    // address now leads to it, and every connection through it is cut.
    caught_up().await;
    query_on(&replica.url(), "STOP SLAVE; RESET SLAVE ALL").await;
    switch.to(replica.port());
    let after = new_key(401);
    let on_replica = db.url.replacen(
        &super_host(&db.url),
        &format!("127.0.0.1:{}", replica.port()),
        1,
    );
    query_on(
        &on_replica,
        &format!("INSERT INTO products (sku_id, name, price) VALUES ({after}, 'after', 1.00)"),
    )
    .await;
    assert_eq!(wait_status(&proxy, after, 200).await, "miss");
    // Followed on by GTID from the replica's log: no rebuild, nothing scanned again.
    assert_eq!(
        proxy
            .counter_or_zero("bloomgate_filter_binlog_rebuilds_total{filter=\"products\",reason=\"position_gone\"}")
            .await,
        0.0
    );
    let status = filter_status(proxy.client(), proxy.admin, "products").await;
    assert_eq!(status["last_load"]["reason"], "startup", "{status}");
    assert!(
        proxy
            .counter_or_zero("bloomgate_filter_binlog_reconnects_total{filter=\"products\"}")
            .await
            >= 1.0
    );
    let mark = status["sync_watermark"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    assert!(
        mark.contains("gtid 0-2-"),
        "the position is the replica's own transaction now: {mark}"
    );
}

/// The `host:port` of a `mysql://user:pw@host:port/db` URL.
fn super_host(url: &str) -> String {
    let after = url.split_once('@').map_or(url, |(_, rest)| rest);
    after.split('/').next().unwrap_or(after).to_owned()
}
