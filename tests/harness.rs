//! The test harness itself (`tests/support`), held to what the other tests rely on: a
//! metric read names exactly one series and fails the test when that series is absent;
//! without a MariaDB server, MariaDB tests skip visibly, or fail under CI; a child
//! process does not outlive the test that started it, even one that fails; a dropped
//! proxy stops its background work; a test's database and user go with its handle.

mod support;

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use bloomgate::db::{Db, PoolSettings};
use support::{
    ChildGuard, MYSQL_URL_VAR, SYNC_QUERY, TestConfig, TestDb, TestProxy, TestRoute, family_series,
    mysql_url, process_alive, series_value,
};

const TEXT: &str = "\
# HELP bloomgate_filter_capacity Keys the live filter was sized for.
# TYPE bloomgate_filter_capacity gauge
bloomgate_filter_capacity{filter=\"products\"} 2000
bloomgate_filter_capacity_rebuilds_total{filter=\"products\"} 3
bloomgate_requests_total{outcome=\"cache_hit\",route=\"products\"} 7
bloomgate_requests_total{outcome=\"cache_hit\",route=\"products_v2\"} 9
bloomgate_build_info{version=\"0.1.0\"} 1
bloomgate_false_positive_budget_per_client 3
";

#[test]
fn a_series_is_read_by_its_exact_name_and_labels() {
    let read = |s: &str| series_value(TEXT, s);
    assert_eq!(
        read("bloomgate_filter_capacity{filter=\"products\"}"),
        Some(2000.0)
    );
    assert_eq!(
        read("bloomgate_filter_capacity_rebuilds_total{filter=\"products\"}"),
        Some(3.0)
    );
    assert_eq!(
        read("bloomgate_requests_total{outcome=\"cache_hit\",route=\"products\"}"),
        Some(7.0)
    );
    assert_eq!(
        read("bloomgate_false_positive_budget_per_client"),
        Some(3.0)
    );
    // A prefix of a longer name, a label value's prefix, labels out of the exported
    // order, and a family without its labels are all absent, not 0.
    for absent in [
        "bloomgate_filter_capacity_rebuilds",
        "bloomgate_requests_total{outcome=\"cache_hit\",route=\"prod",
        "bloomgate_requests_total{route=\"products\",outcome=\"cache_hit\"}",
        "bloomgate_requests_total",
        "bloomgate_false_positive_budget",
        "bloomgate_filter_capacity{filter=\"other\"}",
    ] {
        assert_eq!(read(absent), None, "{absent}");
    }
}

#[test]
fn the_series_of_a_family_are_listed_for_a_missing_one() {
    assert_eq!(
        family_series(TEXT, "bloomgate_requests_total{outcome=\"nope\"}"),
        [
            "bloomgate_requests_total{outcome=\"cache_hit\",route=\"products\"} 7",
            "bloomgate_requests_total{outcome=\"cache_hit\",route=\"products_v2\"} 9",
        ]
    );
    assert_eq!(
        family_series(TEXT, "bloomgate_filter_capacity{filter=\"x\"}"),
        ["bloomgate_filter_capacity{filter=\"products\"} 2000"]
    );
}

/// A proxy over an empty SQLite table with one guarded route, `products`.
async fn sqlite_proxy(dir: &std::path::Path) -> TestProxy {
    let url = format!("sqlite://{}", dir.join("harness.db").display());
    let db = Db::connect_lazy(&url, &PoolSettings::default()).expect("pool");
    db.migrate().await.expect("migrate");
    db.close().await;
    let proxy = TestProxy::spawn(
        &TestConfig::new(&url)
            .expected_items(100)
            .route(products_route())
            .toml(),
    )
    .await;
    proxy.wait_ready(Duration::from_secs(60)).await;
    proxy
}

/// A temporary directory, removed when dropped.
struct TempDir(PathBuf);

impl TempDir {
    fn new() -> TempDir {
        let dir =
            std::env::temp_dir().join(format!("bloomgate-harness-{:016x}", rand::random::<u64>()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        TempDir(dir)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_metric_that_is_there_from_the_start_reads_0_and_an_absent_one_is_none() {
    let dir = TempDir::new();
    let proxy = sqlite_proxy(&dir.0).await;
    assert_eq!(
        proxy
            .metric("bloomgate_requests_total{outcome=\"cache_hit\",route=\"products\"}")
            .await,
        0.0
    );
    assert_eq!(
        proxy
            .metric_or_absent("bloomgate_requests_total{outcome=\"cache_hit\",route=\"nope\"}")
            .await,
        None
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reading_an_absent_metric_fails_the_test_and_names_what_is_there() {
    let dir = TempDir::new();
    let proxy = sqlite_proxy(&dir.0).await;
    let missing = "bloomgate_requests_total{outcome=\"cache_hit\",route=\"nope\"}";
    let failed = tokio::spawn(async move { proxy.metric(missing).await })
        .await
        .expect_err("reading an absent series fails");
    let message = failed
        .into_panic()
        .downcast::<String>()
        .map(|m| *m)
        .unwrap_or_default();
    assert!(
        message.starts_with(&format!("no series {missing} in /metrics")),
        "{message}"
    );
    for outcome in ["cache_hit", "intercepted", "throttled"] {
        let present = format!(
            "bloomgate_requests_total{{outcome=\\\"{outcome}\\\",route=\\\"products\\\"}} 0"
        );
        assert!(
            message.contains(&present),
            "{present} not named in: {message}"
        );
    }
}

/// A MariaDB test reduced to its first step; run by
/// `without_a_server_mariadb_tests_skip_with_one_notice_or_fail_under_ci` in a child
/// process without the server's URL.
#[test]
fn probe_the_skip_rule_a() {
    if let Some(url) = mysql_url() {
        assert!(url.starts_with("mysql://"), "{url}");
    }
}

/// A second one, so that the notice is seen to come once per binary.
#[test]
fn probe_the_skip_rule_b() {
    if let Some(url) = mysql_url() {
        assert!(url.starts_with("mysql://"), "{url}");
    }
}

#[test]
fn without_a_server_mariadb_tests_skip_with_one_notice_or_fail_under_ci() {
    let notice = "skipping the MariaDB tests of this binary";
    let run = |ci: Option<&str>| {
        let mut cmd = Command::new(std::env::current_exe().expect("the test binary"));
        cmd.args(["probe_the_skip_rule", "--test-threads=2"])
            .env_remove(MYSQL_URL_VAR)
            .env_remove("CI");
        if let Some(value) = ci {
            cmd.env("CI", value);
        }
        let out = cmd.output().expect("run the probes");
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    // Locally (an empty CI counts as unset): both pass, and the notice shows once, with
    // libtest capturing the tests' output.
    for ci in [None, Some("")] {
        let (ok, stdout, stderr) = run(ci);
        assert!(ok, "CI={ci:?}: {stdout}{stderr}");
        assert!(stdout.contains("2 passed"), "CI={ci:?}: {stdout}");
        assert_eq!(stderr.matches(notice).count(), 1, "CI={ci:?}: {stderr}");
    }
    // Under CI both fail, naming what is missing.
    let (ok, stdout, stderr) = run(Some("1"));
    assert!(!ok, "{stdout}{stderr}");
    assert!(stdout.contains("2 failed"), "{stdout}");
    assert!(
        stdout.contains("BLOOMGATE_TEST_MYSQL_URL is not set but CI is"),
        "{stdout}"
    );
}

#[test]
fn a_child_process_dies_with_the_test_that_fails() {
    let (tx, rx) = std::sync::mpsc::channel();
    let failed = std::thread::spawn(move || {
        let child = ChildGuard::spawn(Command::new("sleep").arg("600"));
        tx.send(child.id()).expect("send the pid");
        assert!(process_alive(child.id()));
        panic!("a failing test");
    })
    .join();
    assert!(failed.is_err());
    let pid = rx.recv().expect("the child's pid");
    assert!(!process_alive(pid), "sleep {pid} outlived its test");
}

/// A proxy over `db_url` whose filter syncs every 50 ms.
fn syncing(db_url: &str) -> String {
    TestConfig::new(db_url)
        .sync_query(SYNC_QUERY)
        .sync("interval = \"50ms\"")
        .route(products_route())
        .toml()
}

/// The guarded route of both harness configs, answered from the key column alone.
fn products_route() -> TestRoute {
    TestRoute::sql("products", "/api/products/{id}")
        .lookup("SELECT sku_id FROM products WHERE sku_id = ?")
}

const POLLS_OK: &str = "bloomgate_filter_sync_polls_total{filter=\"products\",result=\"ok\"}";

/// Waits until `proxy` has completed `n` more sync polls than it had.
async fn wait_for_polls(proxy: &TestProxy, n: f64) {
    let from = proxy.metric(POLLS_OK).await;
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while proxy.metric(POLLS_OK).await < from + n {
        assert!(std::time::Instant::now() < deadline, "sync polls stalled");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_proxy_stops_its_loader_and_sync_poller() {
    let Some(server) = mysql_url() else { return };
    let db = TestDb::create(&server, 100).await;
    let dropped = TestProxy::spawn_ready(&syncing(&db.url)).await;
    wait_for_polls(&dropped, 2.0).await;
    drop(dropped);
    // Its pool closes once nothing holds it: no poller, no loader, no server task.
    db.wait_disconnected().await;
    let selects = db.selects().await;
    // Another proxy on the same table, as another user, is the clock: while it polls
    // five times, the dropped one (polling at the same interval) runs nothing.
    let witness = TestProxy::spawn_ready(&syncing(&db.admin_url())).await;
    wait_for_polls(&witness, 5.0).await;
    assert_eq!(
        db.selects().await,
        selects,
        "the dropped proxy still queries"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_test_database_and_its_user_are_dropped_with_their_handle() {
    let Some(server) = mysql_url() else { return };
    let db = TestDb::create(&server, 10).await;
    let (name, user) = (db.name.clone(), db.user().to_owned());
    // Neither a proxy still connected as the user nor a transaction left open on the
    // table (its lock would hold DROP DATABASE up) keeps them.
    let proxy = TestProxy::spawn_ready(&syncing(&db.url)).await;
    let mut open = db.admin.begin().await.expect("begin");
    sqlx::query("INSERT INTO products (sku_id, name, price) VALUES (7, 'x', 1.00)")
        .execute(&mut *open)
        .await
        .expect("insert");
    drop(db);

    let check = sqlx::mysql::MySqlPool::connect(&server)
        .await
        .expect("connect");
    let count = async |sql: &'static str, value: &str| -> i64 {
        sqlx::query_scalar(sql)
            .bind(value)
            .fetch_one(&check)
            .await
            .expect("count")
    };
    assert_eq!(
        count(
            "SELECT COUNT(*) FROM information_schema.SCHEMATA WHERE SCHEMA_NAME = ?",
            &name
        )
        .await,
        0,
        "database {name} is still there"
    );
    assert_eq!(
        count("SELECT COUNT(*) FROM mysql.user WHERE User = ?", &user).await,
        0,
        "user {user} is still there"
    );
    drop(open);
    drop(proxy);
}

#[test]
fn a_counter_read_as_zero_must_be_a_metric_bloomgate_exports() {
    support::assert_exported_family("bloomgate_filter_sync_polls_total{filter=\"products\"}");
    support::assert_exported_family("bloomgate_origin_calls_total");
    let misspelled = std::panic::catch_unwind(|| {
        support::assert_exported_family("bloomgate_filter_sync_pols_total{filter=\"products\"}")
    });
    assert!(misspelled.is_err(), "a misspelled family was accepted");
    let prefix_only =
        std::panic::catch_unwind(|| support::assert_exported_family("bloomgate_filter_sync_polls"));
    assert!(prefix_only.is_err(), "a prefix of a family was accepted");
}
