//! Test harness: a real bloomgate on 127.0.0.1 port 0 (`TestProxy`), a throwaway MariaDB
//! database and user per test (`TestDb`, counting the SELECTs the proxy runs), a real
//! upstream API that counts its hits and can hold a request until the test lets it go
//! (`StubUpstream`), a throwaway Redis server per test (`TestRedis`, in `redis`), a TCP
//! relay that can play a database that is down (`Relay`), a small HTTP client, raw TCP
//! exchanges (`send_raw`), and a test CA with clients for every protocol (`tls`).
//!
//! Waiting is on events: a request the stub holds, a poll counted in `/metrics`, a
//! statement in MariaDB's process list. A heavy MariaDB test takes its database with
//! `TestDb::create_heavy` and runs alone among its binary's MariaDB tests, so that none of
//! them has its clock or its polls slowed by it.

#![allow(dead_code)]

use std::collections::HashSet;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, LazyLock, Mutex};
use std::time::{Duration, Instant};

use bloomgate::App;
use bloomgate::config::Config;
use bloomgate::db::{Db, PoolSettings};
use bloomgate::pipeline::Proxy;
use bloomgate::server::{self, Handler, ServeOptions};
use bytes::Bytes;
use http::{HeaderMap, Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use sqlx::mysql::MySqlPool;
use sqlx::{AssertSqlSafe, Row};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedRwLockReadGuard, OwnedRwLockWriteGuard, RwLock, oneshot, watch};

pub mod binary;
pub mod config;
pub mod mariadb;
pub mod observe;
pub mod redis;
pub mod tls;
pub mod topology;

#[allow(unused_imports)]
pub use self::redis::{RedisOptions, TestRedis, redis_server};
#[allow(unused_imports)]
pub use config::{SYNC_QUERY, TestConfig, TestRoute};
#[allow(unused_imports)]
pub use mariadb::OwnMariaDb;
#[allow(unused_imports)]
pub use observe::{Scrape, eventually, refused_absent_key, refused_absent_keys};

/// The variable that names the MariaDB server the tests use.
pub const MYSQL_URL_VAR: &str = "BLOOMGATE_TEST_MYSQL_URL";

/// The MariaDB server URL exported by `scripts/test` (through `scripts/mariadb`), without
/// a database.
///
/// The skip rule, the same for every MariaDB test (and for
/// `crates/bloomgate-core/src/db/mysql_tests.rs`): without a non-empty
/// `BLOOMGATE_TEST_MYSQL_URL`, a MariaDB test fails if `CI` is set to anything but the
/// empty string (`.ci/run` exports `CI=1`: there a skipped test would be a lie);
/// otherwise it passes without running, and the binary says so once on stderr, written
/// past libtest's output capture so that it shows without `--nocapture`.
pub fn mysql_url() -> Option<String> {
    static NOTICE: std::sync::Once = std::sync::Once::new();
    match std::env::var(MYSQL_URL_VAR) {
        Ok(url) if !url.is_empty() => Some(url.trim_end_matches('/').to_owned()),
        _ => {
            let ci = std::env::var_os("CI").is_some_and(|v| !v.is_empty());
            assert!(
                !ci,
                "{MYSQL_URL_VAR} is not set but CI is: run the tests through scripts/test"
            );
            NOTICE.call_once(|| {
                use std::io::Write as _;
                // Straight to the process's stderr: libtest captures eprintln!.
                let _ = writeln!(
                    std::io::stderr(),
                    "skipping the MariaDB tests of this binary: {MYSQL_URL_VAR} is not set \
                     (scripts/test sets it; with CI set they fail instead)"
                );
            });
            None
        }
    }
}

fn unique(prefix: &str) -> String {
    format!("{prefix}_{:016x}", rand::random::<u64>())
}

/// Whose turn it is among this binary's MariaDB tests, which libtest runs in parallel:
/// a heavy test (tens of thousands of requests, large builds, writers under churn) holds
/// it alone, so that it never runs beside a test that counts polls, waits on a TTL or
/// bounds a latency on this 2-core machine; the others share it.
static TURNS: LazyLock<Arc<RwLock<()>>> = LazyLock::new(|| Arc::new(RwLock::new(())));

/// A test's hold on [`TURNS`], released when its [`TestDb`] is dropped.
enum Turn {
    Shared(OwnedRwLockReadGuard<()>),
    Alone(OwnedRwLockWriteGuard<()>),
}

/// A database and a user of its own, so `selects()` counts only this test's proxy. Both
/// are dropped when this is, whether the test passed or failed.
pub struct TestDb {
    /// Database name.
    pub name: String,
    /// The proxy's URL (as the test's own user).
    pub url: String,
    user: String,
    /// The server URL, without a database.
    server: String,
    /// Pool as the privileged test user, for set-up and inspection.
    pub admin: MySqlPool,
    _turn: Turn,
}

impl TestDb {
    /// Creates the database, its user, the schema, and `products` demo rows
    /// (keys `demo_sku(0..products)`). The test shares the machine with the other
    /// MariaDB tests of its binary, but never with a heavy one.
    pub async fn create(server: &str, products: u64) -> TestDb {
        let turn = Turn::Shared(Arc::clone(&TURNS).read_owned().await);
        Self::create_in_turn(server, products, turn).await
    }

    /// As [`TestDb::create`], for a heavy test: it waits until no other MariaDB test of
    /// its binary runs, and none starts until it is dropped.
    pub async fn create_heavy(server: &str, products: u64) -> TestDb {
        let turn = Turn::Alone(Arc::clone(&TURNS).write_owned().await);
        Self::create_in_turn(server, products, turn).await
    }

    async fn create_in_turn(server: &str, products: u64, turn: Turn) -> TestDb {
        let admin = MySqlPool::connect(server)
            .await
            .expect("connect to MariaDB");
        let name = unique("bg");
        let user = unique("u");
        for stmt in [
            format!("CREATE DATABASE {name}"),
            format!("CREATE USER '{user}'@'%' IDENTIFIED BY 'pw'"),
            format!("GRANT ALL ON {name}.* TO '{user}'@'%'"),
            "SET GLOBAL userstat = 1".to_owned(),
        ] {
            sqlx::query(AssertSqlSafe(stmt))
                .execute(&admin)
                .await
                .expect("set up test database");
        }
        admin.close().await;
        let (scheme_auth, _) = split_url(server);
        let host = scheme_auth.rsplit('@').next().unwrap_or(scheme_auth);
        let url = format!("mysql://{user}:pw@{host}/{name}");
        let admin = MySqlPool::connect(&format!("{server}/{name}"))
            .await
            .expect("connect to test database");
        let db = Db::connect_lazy(&format!("{server}/{name}"), &pool_settings()).expect("pool");
        db.migrate().await.expect("migrate");
        if products > 0 {
            db.seed_demo_products(products).await.expect("seed");
        }
        db.close().await;
        TestDb {
            name,
            url,
            user,
            server: server.to_owned(),
            admin,
            _turn: turn,
        }
    }

    /// The proxy's user name.
    pub fn user(&self) -> &str {
        &self.user
    }

    /// The database's URL as the privileged test user (whose statements `selects()` does
    /// not count).
    pub fn admin_url(&self) -> String {
        format!("{}/{}", self.server, self.name)
    }

    /// Waits until the proxy's user has no connection left (polled, for at most 30 s).
    pub async fn wait_disconnected(&self) {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let row = sqlx::query(
                "SELECT CAST(COUNT(*) AS UNSIGNED) FROM information_schema.PROCESSLIST \
                 WHERE USER = ?",
            )
            .bind(&self.user)
            .fetch_one(&self.admin)
            .await
            .expect("read the process list");
            let open = row.get::<u64, _>(0);
            if open == 0 {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "the proxy's user still has {open} connections after 30 s"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// SELECT statements run so far by the proxy's user (MariaDB's USER_STATISTICS),
    /// once every statement it has sent has finished.
    pub async fn selects(&self) -> u64 {
        self.user_statistic("SELECT_COMMANDS").await
    }

    /// Rows read so far by the proxy's user, once every statement it has sent has
    /// finished.
    pub async fn rows_read(&self) -> u64 {
        self.user_statistic("ROWS_READ").await
    }

    /// Connections of the proxy's user that are running a statement. MariaDB sends a
    /// statement's result first, then adds it to the user's statistics, then marks the
    /// connection idle (`Sleep`): a count read right after the client has its rows may
    /// miss the statement, one read once this is 0 cannot.
    async fn busy_connections(&self) -> u64 {
        let row = sqlx::query(
            "SELECT CAST(COUNT(*) AS UNSIGNED) FROM information_schema.PROCESSLIST \
             WHERE USER = ? AND COMMAND <> 'Sleep'",
        )
        .bind(&self.user)
        .fetch_one(&self.admin)
        .await
        .expect("read the process list");
        row.get::<u64, _>(0)
    }

    /// Waits until no connection of the proxy's user runs a statement (MariaDB is
    /// another process: it is polled, for at most 30 s).
    pub async fn wait_idle(&self) {
        let deadline = Instant::now() + Duration::from_secs(30);
        while self.busy_connections().await > 0 {
            assert!(
                Instant::now() < deadline,
                "the proxy's user still runs a statement after 30 s"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// Waits until `n` connections of the proxy's user are running a statement that
    /// contains `fragment` (polled, for at most 30 s). With the rows it reads locked by
    /// the test, such a statement is waiting for the lock: InnoDB does not list every
    /// autocommit locking read among its transactions, but the process list shows it.
    pub async fn wait_running(&self, fragment: &str, n: u64) {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let row = sqlx::query(
                "SELECT CAST(COUNT(*) AS UNSIGNED) FROM information_schema.PROCESSLIST \
                 WHERE USER = ? AND COMMAND <> 'Sleep' AND INSTR(INFO, ?) > 0",
            )
            .bind(&self.user)
            .bind(fragment)
            .fetch_one(&self.admin)
            .await
            .expect("read the process list");
            let running = row.get::<u64, _>(0);
            if running >= n {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "{running} of the proxy's connections run `{fragment}` after 30 s, not {n}"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    async fn user_statistic(&self, column: &'static str) -> u64 {
        self.wait_idle().await;
        let sql = format!(
            "SELECT CAST(COALESCE(SUM({column}), 0) AS UNSIGNED) FROM information_schema.USER_STATISTICS WHERE USER = ?"
        );
        let row = sqlx::query(AssertSqlSafe(sql))
            .bind(&self.user)
            .fetch_one(&self.admin)
            .await
            .expect("read user statistics");
        row.get::<u64, _>(0)
    }

    /// Deletes a product behind the proxy's back.
    pub async fn delete_product(&self, sku: u64) {
        sqlx::query("DELETE FROM products WHERE sku_id = ?")
            .bind(sku)
            .execute(&self.admin)
            .await
            .expect("delete product");
    }

    /// Inserts many products in one statement.
    pub async fn insert_products(&self, skus: &[u64]) {
        for chunk in skus.chunks(1000) {
            let mut q = sqlx::QueryBuilder::<sqlx::MySql>::new(
                "INSERT INTO products (sku_id, name, price) ",
            );
            q.push_values(chunk, |mut b, sku| {
                b.push_bind(*sku)
                    .push_bind(format!("Product {sku}"))
                    .push_bind(1.0f64);
            });
            q.build()
                .execute(&self.admin)
                .await
                .expect("insert products");
        }
    }

    /// Inserts a product behind the proxy's back.
    pub async fn insert_product(&self, sku: u64) {
        sqlx::query("INSERT INTO products (sku_id, name, price) VALUES (?, ?, 1.00)")
            .bind(sku)
            .bind(format!("Product {sku}"))
            .execute(&self.admin)
            .await
            .expect("insert product");
    }

    /// The URL with the host replaced by `addr` (to go through a [`Relay`]).
    pub fn url_via(&self, addr: SocketAddr) -> String {
        format!("mysql://{}:pw@{addr}/{}", self.user, self.name)
    }
}

impl Drop for TestDb {
    /// Drops the database and the user, synchronously and best effort: on a thread with
    /// a runtime of its own (the test's runtime cannot be blocked on, and may be shutting
    /// down), through a connection of its own (the test's pools belong to that runtime).
    fn drop(&mut self) {
        let (server, name, user) = (self.server.clone(), self.name.clone(), self.user.clone());
        let dropped = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .map_err(|e| e.to_string())?;
            runtime.block_on(async {
                tokio::time::timeout(
                    Duration::from_secs(60),
                    drop_database(&server, &name, &user),
                )
                .await
                .map_err(|_| "no answer within 60 s".to_owned())?
                .map_err(|e| e.to_string())
            })
        })
        .join();
        let failed = match dropped {
            Ok(Ok(())) => return,
            Ok(Err(e)) => e,
            Err(_) => "the dropping thread panicked".to_owned(),
        };
        use std::io::Write as _;
        let _ = writeln!(
            std::io::stderr(),
            "could not drop test database {} and user {}: {failed}",
            self.name,
            self.user
        );
    }
}

/// Ends every session on database `name` or of `user` (the proxy's pool, the test's
/// admin pool, a transaction left open: any of them could hold a lock that DROP DATABASE
/// waits for), then drops both.
async fn drop_database(server: &str, name: &str, user: &str) -> Result<(), sqlx::Error> {
    use sqlx::Connection as _;
    let mut conn = sqlx::mysql::MySqlConnection::connect(server).await?;
    sqlx::query("SET SESSION lock_wait_timeout = 30")
        .execute(&mut conn)
        .await?;
    let sessions = sqlx::query(
        "SELECT CAST(ID AS UNSIGNED) FROM information_schema.PROCESSLIST \
         WHERE (DB = ? OR USER = ?) AND ID <> CONNECTION_ID()",
    )
    .bind(name)
    .bind(user)
    .fetch_all(&mut conn)
    .await?;
    for session in sessions {
        let id: u64 = session.try_get(0)?;
        // It may have ended meanwhile.
        let _ = sqlx::query(AssertSqlSafe(format!("KILL CONNECTION {id}")))
            .execute(&mut conn)
            .await;
    }
    for stmt in [
        format!("DROP DATABASE IF EXISTS {name}"),
        format!("DROP USER IF EXISTS '{user}'@'%'"),
    ] {
        sqlx::query(AssertSqlSafe(stmt)).execute(&mut conn).await?;
    }
    conn.close().await
}

fn split_url(url: &str) -> (&str, &str) {
    let rest = url.strip_prefix("mysql://").unwrap_or(url);
    match rest.split_once('/') {
        Some((a, b)) => (a, b),
        None => (rest, ""),
    }
}

fn pool_settings() -> PoolSettings {
    PoolSettings {
        max_connections: 4,
        min_connections: 0,
        acquire_timeout: Duration::from_secs(10),
        idle_timeout: None,
    }
}

/// A child process that is killed and reaped when this is dropped, so that a test that
/// fails (panics) leaves nothing running.
pub struct ChildGuard(std::process::Child);

impl ChildGuard {
    /// Starts `command`.
    pub fn spawn(command: &mut std::process::Command) -> ChildGuard {
        ChildGuard(
            command
                .spawn()
                .unwrap_or_else(|e| panic!("start {command:?}: {e}")),
        )
    }
}

impl std::ops::Deref for ChildGuard {
    type Target = std::process::Child;

    fn deref(&self) -> &std::process::Child {
        &self.0
    }
}

impl std::ops::DerefMut for ChildGuard {
    fn deref_mut(&mut self) -> &mut std::process::Child {
        &mut self.0
    }
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        if let Ok(None) = self.0.try_wait() {
            let _ = self.0.kill();
        }
        let _ = self.0.wait();
    }
}

/// Whether process `pid` exists and has not exited (a zombie has exited). Linux only.
pub fn process_alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // The state follows the command name, which is in parentheses.
        Ok(stat) => stat
            .rsplit_once(") ")
            .is_some_and(|(_, rest)| !rest.starts_with('Z') && !rest.starts_with('X')),
        Err(_) => false,
    }
}

/// A running bloomgate, stopped when dropped.
pub struct TestProxy {
    /// Data-plane address.
    pub data: SocketAddr,
    /// Admin-plane address.
    pub admin: SocketAddr,
    /// The proxy serving the data plane, for tests that reach its gates directly.
    pub proxy: Arc<Proxy>,
    stop: Option<oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<()>>,
    client: HttpClient,
}

impl TestProxy {
    /// Starts bloomgate with `toml` (listen addresses replaced by 127.0.0.1:0).
    pub async fn spawn(toml: &str) -> TestProxy {
        Self::spawn_on(toml, SocketAddr::from(([127, 0, 0, 1], 0))).await
    }

    /// Starts bloomgate with its data plane on `data` (e.g. `[::]:0` for a dual-stack
    /// listener) and its admin plane on 127.0.0.1:0.
    pub async fn spawn_on(toml: &str, data: SocketAddr) -> TestProxy {
        let mut config = Config::from_toml_str(toml).expect("valid test config");
        config.server.listen = data;
        config.admin.listen = SocketAddr::from(([127, 0, 0, 1], 0));
        let app = App::bind(config).await.expect("bind");
        let (data, admin) = (app.data_addr(), app.admin_addr());
        let proxy = app.proxy();
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(app.run(async {
            let _ = stopped.await;
        }));
        TestProxy {
            data,
            admin,
            proxy,
            stop: Some(stop),
            task: Some(task),
            client: HttpClient::new(),
        }
    }

    /// Starts bloomgate and waits until `/readyz` says every filter is loaded.
    pub async fn spawn_ready(toml: &str) -> TestProxy {
        let proxy = Self::spawn(toml).await;
        proxy.wait_ready(Duration::from_secs(60)).await;
        proxy
    }

    /// Polls `/readyz` until 200, failing the test after `limit`.
    pub async fn wait_ready(&self, limit: Duration) {
        let deadline = Instant::now() + limit;
        loop {
            let r = self.admin_get("/readyz").await;
            if r.status == StatusCode::OK {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "not ready after {limit:?}: {}",
                r.text()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// GET on the data plane.
    pub async fn get(&self, path_and_query: &str) -> Reply {
        self.client
            .send(
                Method::GET,
                &format!("http://{}{path_and_query}", self.data),
                &[],
                Bytes::new(),
            )
            .await
    }

    /// GET on the admin plane.
    pub async fn admin_get(&self, path: &str) -> Reply {
        self.client
            .send(
                Method::GET,
                &format!("http://{}{path}", self.admin),
                &[],
                Bytes::new(),
            )
            .await
    }

    /// POST on the admin plane with an optional bearer token.
    pub async fn admin_post(&self, path: &str, token: Option<&str>, body: &str) -> Reply {
        let auth = token.map(|t| format!("Bearer {t}"));
        let headers: Vec<(&str, &str)> =
            auth.iter().map(|a| ("authorization", a.as_str())).collect();
        self.client
            .send(
                Method::POST,
                &format!("http://{}{path}", self.admin),
                &headers,
                Bytes::from(body.to_owned()),
            )
            .await
    }

    /// Admits `key` to `filter` through the admin API with `token`; the admission must
    /// be accepted.
    pub async fn admit(&self, filter: &str, token: &str, key: &str) {
        let r = self
            .admin_post(&format!("/admin/filters/{filter}/keys"), Some(token), key)
            .await;
        assert_eq!(r.status.as_u16(), 200, "{}", r.text());
    }

    /// The value of one series in `/metrics`, spelled as exported (labels in name order),
    /// e.g. `bloomgate_requests_total{outcome="intercepted",route="r"}`. Fails the test if
    /// the series is absent, naming the series of its family that are there: a renamed
    /// metric or a misspelled label must not read as 0.
    pub async fn metric(&self, series: &str) -> f64 {
        let text = self.admin_get("/metrics").await.text();
        series_value(&text, series).unwrap_or_else(|| {
            panic!(
                "no series {series} in /metrics; series of its family there: {:?}",
                family_series(&text, series)
            )
        })
    }

    /// The value of one series in `/metrics`, or `None` if it is absent. Only for checks
    /// whose claim is the absence itself; everywhere else use [`TestProxy::metric`].
    pub async fn metric_or_absent(&self, series: &str) -> Option<f64> {
        series_value(&self.admin_get("/metrics").await.text(), series)
    }

    /// The value of a counter series in `/metrics`, 0 while it has not been counted yet
    /// (a labelled series appears at its first count). Its family must be one that
    /// bloomgate exports (documented in docs/monitoring.md, which tests/docs.rs holds
    /// equal to the registry), so a renamed or misspelled metric fails instead of
    /// reading 0.
    pub async fn counter_or_zero(&self, series: &str) -> f64 {
        assert_exported_family(series);
        self.metric_or_absent(series).await.unwrap_or(0.0)
    }

    /// GET on the data plane with request headers.
    pub async fn get_with(&self, path_and_query: &str, headers: &[(&str, &str)]) -> Reply {
        self.client
            .send(
                Method::GET,
                &format!("http://{}{path_and_query}", self.data),
                headers,
                Bytes::new(),
            )
            .await
    }

    /// The shared client.
    pub fn client(&self) -> &HttpClient {
        &self.client
    }
}

/// Fails unless the family of `series` (its name before any `{`) is one bloomgate
/// exports: a row of docs/monitoring.md's metric tables.
pub fn assert_exported_family(series: &str) {
    const MONITORING: &str = include_str!("../../docs/monitoring.md");
    let family = series.split('{').next().unwrap_or(series);
    let documented = MONITORING.lines().any(|line| {
        line.strip_prefix("| `")
            .and_then(|rest| rest.split(['`', '{']).next())
            .is_some_and(|name| name == family)
    });
    assert!(
        documented,
        "{family} is not a metric bloomgate exports (no row in docs/monitoring.md)"
    );
}

/// The value of `series` (name and labels exactly as exported) in Prometheus text, or
/// `None` if no sample has that name and those labels. A present sample whose value does
/// not parse fails the test.
pub fn series_value(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
        .map(|rest| {
            let value = rest.split(' ').next().unwrap_or_default();
            value
                .parse()
                .unwrap_or_else(|e| panic!("{series} has the value {value:?}: {e}"))
        })
}

/// Every sample in `text` of the family `series` belongs to (its name without labels).
pub fn family_series(text: &str, series: &str) -> Vec<String> {
    let family = series.split('{').next().unwrap_or(series);
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter(|l| {
            l.strip_prefix(family)
                .is_some_and(|rest| rest.starts_with('{') || rest.starts_with(' '))
        })
        .map(str::to_owned)
        .collect()
}

impl Drop for TestProxy {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}

/// A response read whole.
#[derive(Debug)]
pub struct Reply {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Bytes,
}

impl Reply {
    /// The `x-bloomgate` header ("" when absent).
    pub fn stage(&self) -> &str {
        self.headers
            .get("x-bloomgate")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
    }

    /// The body as text.
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    /// The body as JSON.
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.text()))
    }
}

/// A keep-alive HTTP/1.1 client.
#[derive(Clone)]
pub struct HttpClient {
    inner: Client<HttpConnector, Full<Bytes>>,
}

impl HttpClient {
    /// A client with a pool big enough for the concurrent tests. Its idle connections are
    /// dropped well before the proxy closes them (`header_read_timeout`, 10 s by default,
    /// also bounds an idle keep-alive connection): a connection reused at the moment the
    /// server closes it fails the request with `IncompleteMessage`.
    pub fn new() -> HttpClient {
        HttpClient {
            inner: Client::builder(TokioExecutor::new())
                .pool_max_idle_per_host(256)
                .pool_idle_timeout(Duration::from_secs(4))
                .pool_timer(hyper_util::rt::TokioTimer::new())
                .build_http(),
        }
    }

    /// Sends a request and reads the whole response.
    pub async fn send(
        &self,
        method: Method,
        url: &str,
        headers: &[(&str, &str)],
        body: Bytes,
    ) -> Reply {
        let mut req = Request::builder().method(method).uri(url);
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        let req = req.body(Full::new(body)).expect("request");
        let resp = tokio::time::timeout(Duration::from_secs(30), self.inner.request(req))
            .await
            .unwrap_or_else(|_| panic!("no answer from {url} in 30s"))
            .unwrap_or_else(|e| panic!("request to {url} failed: {e:?}"));
        let (parts, body) = resp.into_parts();
        let body = body.collect().await.expect("read body").to_bytes();
        Reply {
            status: parts.status,
            headers: parts.headers,
            body,
        }
    }
}

/// What the stub upstream last saw on `/echo`.
#[derive(Debug, Clone, Default)]
pub struct Seen {
    pub method: String,
    pub path_and_query: String,
    pub headers: HeaderMap,
}

/// A real upstream API, written for the tests. Routes:
/// - `GET /api/products/{id}` and `GET /api/product/info?sku_id=…`: 200 JSON if the key
///   is in `keys`, else 404; each counted in `product_hits` and recorded in
///   `product_requests`. Like many frameworks, it reads the *last* `sku_id` of a query.
///   Found answers carry the headers in `answer_headers`, and echo `lang` and the
///   `accept-language` header.
/// - `GET /slow/{ms}`: answers after `ms` milliseconds.
/// - `GET|POST /held…`: answers 200 once the test lets it (see [`StubUpstream::hold_next`]),
///   at once if nothing is held.
/// - `GET /gathered…`: answers 200 once the test lets all of them go (see
///   [`StubUpstream::gather`]), at once if nothing gathers them.
/// - `POST|PUT /echo…`: streams the request body back in chunks; records what it saw.
pub struct StubUpstream {
    pub addr: SocketAddr,
    pub state: Arc<StubState>,
    stop: watch::Sender<bool>,
}

/// Shared state of the stub.
#[derive(Default)]
pub struct StubState {
    pub keys: Mutex<HashSet<u64>>,
    pub product_hits: AtomicU64,
    /// Every product request as received: path and query, and headers.
    pub product_requests: Mutex<Vec<(String, HeaderMap)>>,
    /// Headers added to found answers, e.g. `("cache-control", "no-store")`.
    pub answer_headers: Mutex<Vec<(String, String)>>,
    pub seen: Mutex<Option<Seen>>,
    pub fail_with_500: AtomicBool,
    /// See [`StubUpstream::hold_next_not_found`].
    pub hold: Mutex<Option<(oneshot::Sender<u64>, oneshot::Receiver<()>)>>,
    /// See [`StubUpstream::hold_next`].
    pub held: Mutex<Option<(oneshot::Sender<()>, oneshot::Receiver<()>)>>,
    /// See [`StubUpstream::gather`].
    pub gathering: Mutex<Option<Gathering>>,
}

/// Requests to `/gathered…` held together (see [`StubUpstream::gather`]).
#[derive(Clone)]
pub struct Gathering {
    arrived: Arc<watch::Sender<usize>>,
    release: watch::Receiver<bool>,
}

impl StubUpstream {
    /// Starts the stub on 127.0.0.1:0 with the given product keys.
    pub async fn start(keys: impl IntoIterator<Item = u64>) -> StubUpstream {
        let state = Arc::new(StubState::default());
        state.keys.lock().expect("lock").extend(keys);
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind stub");
        let addr = listener.local_addr().expect("addr");
        let (stop, stopped) = watch::channel(false);
        // Generous limits: the stub must take whatever bloomgate forwards.
        let options = ServeOptions {
            header_read_timeout: Duration::from_secs(10),
            grace: Duration::from_secs(1),
            max_header_bytes: 256 * 1024,
            max_uri_bytes: 256 * 1024,
            ..ServeOptions::default()
        };
        tokio::spawn(server::serve(
            listener,
            Arc::new(StubHandler(Arc::clone(&state))),
            options,
            server::Transport::default(),
            stopped,
            "stub",
        ));
        StubUpstream { addr, state, stop }
    }

    /// Product requests served so far.
    pub fn hits(&self) -> u64 {
        self.state.product_hits.load(Ordering::SeqCst)
    }

    /// Product requests received so far: path and query of each.
    pub fn requests(&self) -> Vec<String> {
        self.state
            .product_requests
            .lock()
            .expect("lock")
            .iter()
            .map(|(pq, _)| pq.clone())
            .collect()
    }

    /// Headers of the last product request.
    pub fn last_request_headers(&self) -> HeaderMap {
        self.state
            .product_requests
            .lock()
            .expect("lock")
            .last()
            .map(|(_, h)| h.clone())
            .unwrap_or_default()
    }

    /// Makes found answers carry these headers (replacing earlier ones).
    pub fn answer_with(&self, headers: &[(&str, &str)]) {
        *self.state.answer_headers.lock().expect("lock") = headers
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
    }

    /// Holds the next product answer that is "not found", after the stub has decided it:
    /// the first receiver gets the key once the answer is decided, and the answer leaves
    /// when the returned sender is used (or dropped).
    pub fn hold_next_not_found(&self) -> (oneshot::Receiver<u64>, oneshot::Sender<()>) {
        let (decided, on_decided) = oneshot::channel();
        let (release, on_release) = oneshot::channel();
        *self.state.hold.lock().expect("lock") = Some((decided, on_release));
        (on_decided, release)
    }

    /// Holds the next request to `/held…`: the first receiver fires once the stub has the
    /// request, and the answer leaves when the returned sender is used (or dropped).
    pub fn hold_next(&self) -> (oneshot::Receiver<()>, oneshot::Sender<()>) {
        let (arrived, on_arrival) = oneshot::channel();
        let (release, on_release) = oneshot::channel();
        *self.state.held.lock().expect("lock") = Some((arrived, on_release));
        (on_arrival, release)
    }

    /// Holds every request to `/gathered…` from now on: the receiver counts the requests
    /// that have arrived, and all of them are answered once `true` is sent (or the
    /// sender is dropped).
    pub fn gather(&self) -> (watch::Receiver<usize>, watch::Sender<bool>) {
        let (arrived, counted) = watch::channel(0);
        let (release, released) = watch::channel(false);
        *self.state.gathering.lock().expect("lock") = Some(Gathering {
            arrived: Arc::new(arrived),
            release: released,
        });
        (counted, release)
    }

    /// `http://addr`
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }
}

impl Drop for StubUpstream {
    fn drop(&mut self) {
        let _ = self.stop.send(true);
    }
}

struct StubHandler(Arc<StubState>);

type StubBody = http_body_util::Either<Full<Bytes>, StreamBody<tokio_stream_like::Chunks>>;

impl Handler for StubHandler {
    type Body = StubBody;

    async fn call(&self, req: Request<Incoming>, _peer: SocketAddr) -> Response<StubBody> {
        let path = req.uri().path().to_owned();
        let query = req.uri().query().unwrap_or("").to_owned();
        let full = |status: StatusCode, body: String| {
            let mut r = Response::new(http_body_util::Either::Left(Full::new(Bytes::from(body))));
            *r.status_mut() = status;
            r.headers_mut().insert(
                "content-type",
                http::HeaderValue::from_static("application/json"),
            );
            r
        };
        if path.starts_with("/echo") {
            *self.0.seen.lock().expect("lock") = Some(Seen {
                method: req.method().to_string(),
                path_and_query: req
                    .uri()
                    .path_and_query()
                    .map(|p| p.to_string())
                    .unwrap_or_default(),
                headers: req.headers().clone(),
            });
            let body = req
                .into_body()
                .collect()
                .await
                .map(|b| b.to_bytes())
                .unwrap_or_default();
            let mut r = Response::new(http_body_util::Either::Right(StreamBody::new(
                tokio_stream_like::Chunks::new(body, 1024),
            )));
            r.headers_mut()
                .insert("x-upstream", http::HeaderValue::from_static("stub"));
            r.headers_mut()
                .insert("connection", http::HeaderValue::from_static("x-drop-me"));
            r.headers_mut()
                .insert("x-drop-me", http::HeaderValue::from_static("1"));
            return r;
        }
        if req.method() == http::Method::POST
            && (path == "/api/products" || path == "/api/products/json")
        {
            let body = req
                .into_body()
                .collect()
                .await
                .map(|b| b.to_bytes())
                .unwrap_or_default();
            let sku = serde_json::from_slice::<serde_json::Value>(&body)
                .ok()
                .and_then(|v| v["sku_id"].as_u64());
            let Some(sku) = sku else {
                return full(StatusCode::BAD_REQUEST, "{\"error\":\"sku_id\"}".into());
            };
            self.0.keys.lock().expect("lock").insert(sku);
            let mut r = full(StatusCode::CREATED, format!("{{\"sku_id\":{sku}}}"));
            if let Ok(v) = http::HeaderValue::from_str(&format!("/api/products/{sku}")) {
                r.headers_mut().insert("location", v);
            }
            return r;
        }
        if path.starts_with("/gathered") {
            let gathering = self.0.gathering.lock().expect("lock").clone();
            if let Some(Gathering {
                arrived,
                mut release,
            }) = gathering
            {
                arrived.send_modify(|n| *n += 1);
                // An error means the test dropped its sender: answer.
                let _ = release.wait_for(|go| *go).await;
            }
            return full(StatusCode::OK, "{\"gathered\":true}".into());
        }
        if path.starts_with("/held") {
            let held = self.0.held.lock().expect("lock").take();
            if let Some((arrived, release)) = held {
                let _ = arrived.send(());
                let _ = release.await;
            }
            return full(StatusCode::OK, "{\"held\":true}".into());
        }
        if let Some(ms) = path
            .strip_prefix("/slow/")
            .and_then(|m| m.parse::<u64>().ok())
        {
            tokio::time::sleep(Duration::from_millis(ms)).await;
            return full(StatusCode::OK, format!("{{\"slept_ms\":{ms}}}"));
        }
        let key = if let Some(id) = path.strip_prefix("/api/products/") {
            id.parse::<u64>().ok()
        } else if path == "/api/product/info" {
            form_urlencoded::parse(query.as_bytes())
                .filter(|(k, _)| k == "sku_id")
                .last()
                .and_then(|(_, v)| v.parse::<u64>().ok())
        } else {
            return full(StatusCode::NOT_FOUND, "{\"error\":\"no route\"}".into());
        };
        let lang = form_urlencoded::parse(query.as_bytes())
            .find(|(k, _)| k == "lang")
            .map(|(_, v)| v.into_owned())
            .unwrap_or_default();
        let accept_language = req
            .headers()
            .get("accept-language")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_owned();
        self.0.product_requests.lock().expect("lock").push((
            req.uri()
                .path_and_query()
                .map(|p| p.to_string())
                .unwrap_or_default(),
            req.headers().clone(),
        ));
        self.0.product_hits.fetch_add(1, Ordering::SeqCst);
        if self.0.fail_with_500.load(Ordering::SeqCst) {
            return full(
                StatusCode::INTERNAL_SERVER_ERROR,
                "{\"error\":\"boom\"}".into(),
            );
        }
        match key {
            Some(k) if self.0.keys.lock().expect("lock").contains(&k) => {
                let mut r = full(
                    StatusCode::OK,
                    format!(
                        "{{\"sku_id\":{k},\"source\":\"upstream\",\"lang\":\"{lang}\",\"accept_language\":\"{accept_language}\"}}"
                    ),
                );
                for (name, value) in self.0.answer_headers.lock().expect("lock").iter() {
                    if let (Ok(n), Ok(v)) = (
                        http::HeaderName::from_bytes(name.as_bytes()),
                        http::HeaderValue::from_str(value),
                    ) {
                        r.headers_mut().append(n, v);
                    }
                }
                r
            }
            _ => {
                let held = self.0.hold.lock().expect("lock").take();
                if let Some((decided, release)) = held {
                    let _ = decided.send(key.unwrap_or_default());
                    let _ = release.await;
                }
                full(StatusCode::NOT_FOUND, "{\"error\":\"not found\"}".into())
            }
        }
    }
}

/// A tiny stream of body chunks, so the stub's answer is really streamed.
pub mod tokio_stream_like {
    use std::pin::Pin;
    use std::task::{Context, Poll};

    use bytes::Bytes;
    use futures_util::Stream;
    use hyper::body::Frame;

    /// Yields `body` in pieces of `size` bytes.
    pub struct Chunks {
        body: Bytes,
        size: usize,
    }

    impl Chunks {
        /// Splits `body` into chunks of `size`.
        pub fn new(body: Bytes, size: usize) -> Chunks {
            Chunks { body, size }
        }
    }

    impl Stream for Chunks {
        type Item = Result<Frame<Bytes>, std::convert::Infallible>;

        fn poll_next(mut self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
            if self.body.is_empty() {
                return Poll::Ready(None);
            }
            let n = self.size.min(self.body.len());
            let chunk = self.body.split_to(n);
            Poll::Ready(Some(Ok(Frame::data(chunk))))
        }
    }
}

/// A TCP relay in front of MariaDB that can refuse service ("down") or forward ("up").
pub struct Relay {
    pub addr: SocketAddr,
    up: Arc<AtomicBool>,
}

impl Relay {
    /// Starts a relay to `target` (host:port), initially down.
    pub async fn start(target: String) -> Relay {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind relay");
        let addr = listener.local_addr().expect("addr");
        let up = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&up);
        tokio::spawn(async move {
            while let Ok((mut client, _)) = listener.accept().await {
                if !flag.load(Ordering::SeqCst) {
                    drop(client);
                    continue;
                }
                let target = target.clone();
                tokio::spawn(async move {
                    if let Ok(mut server) = TcpStream::connect(&target).await {
                        let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
                    }
                });
            }
        });
        Relay { addr, up }
    }

    /// Starts forwarding.
    pub fn bring_up(&self) {
        self.up.store(true, Ordering::SeqCst);
    }
}

/// host:port of a `mysql://user:pw@host:port` server URL.
pub fn host_port(server: &str) -> String {
    let (auth, _) = split_url(server);
    auth.rsplit('@').next().unwrap_or(auth).to_owned()
}

/// Runs `f` over `items` with at most `concurrency` in flight; returns results in order.
pub async fn concurrently<T, R, F, Fut>(items: Vec<T>, concurrency: usize, f: F) -> Vec<R>
where
    T: Send + 'static,
    R: Send + 'static,
    F: Fn(T) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = R> + Send + 'static,
{
    use futures_util::StreamExt;
    let f = Arc::new(f);
    futures_util::stream::iter(items.into_iter().map(|item| {
        let f = Arc::clone(&f);
        async move { f(item).await }
    }))
    .buffered(concurrency)
    .collect()
    .await
}

/// A frame of data, for building request bodies in tests.
pub fn data_frame(b: &'static [u8]) -> Frame<Bytes> {
    Frame::data(Bytes::from_static(b))
}

/// Writes `request` as raw bytes on a new connection and reads until the server closes
/// it; returns what was read (lossy UTF-8). A reset after the answer counts as closed.
/// Fails the test if the connection is still open after 30 s.
pub async fn send_raw(addr: SocketAddr, request: &[u8]) -> String {
    raw_exchange(addr, request, false).await
}

/// As [`send_raw`], but shuts down the write side (TCP FIN) right after the request.
pub async fn send_raw_half_closed(addr: SocketAddr, request: &[u8]) -> String {
    raw_exchange(addr, request, true).await
}

async fn raw_exchange(addr: SocketAddr, request: &[u8], half_close: bool) -> String {
    let mut conn = TcpStream::connect(addr).await.expect("connect");
    // The server may answer and close before it has read everything (that is what
    // limits do); a failed write is then not the test's concern, the answer is.
    let _ = conn.write_all(request).await;
    if half_close {
        conn.shutdown().await.expect("shut down the write side");
    }
    let mut read = Vec::new();
    let mut chunk = [0u8; 8192];
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, conn.read(&mut chunk)).await {
            Err(_) => panic!(
                "connection still open after 30s; read so far: {}",
                String::from_utf8_lossy(&read)
            ),
            Ok(Ok(0)) | Ok(Err(_)) => break,
            Ok(Ok(n)) => read.extend_from_slice(&chunk[..n]),
        }
    }
    String::from_utf8_lossy(&read).into_owned()
}

/// The status code of the first response in a raw answer (0 if there is none).
pub fn raw_status(answer: &str) -> u16 {
    answer
        .strip_prefix("HTTP/1.1 ")
        .and_then(|rest| rest.get(..3))
        .and_then(|code| code.parse().ok())
        .unwrap_or(0)
}

/// Runs `cmd` to its end and returns what it printed, as `Command::output` does, but
/// kills it and fails the test if it has not ended within `limit` (a command that should
/// exit at once must not hang the suite when it wrongly goes on serving).
pub fn output_within(cmd: &mut std::process::Command, limit: Duration) -> std::process::Output {
    use std::io::Read;
    let mut child = cmd
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("start the command");
    let drain = |pipe: Option<Box<dyn Read + Send>>| {
        std::thread::spawn(move || {
            let mut buf = Vec::new();
            if let Some(mut p) = pipe {
                let _ = p.read_to_end(&mut buf);
            }
            buf
        })
    };
    let stdout = drain(
        child
            .stdout
            .take()
            .map(|p| Box::new(p) as Box<dyn Read + Send>),
    );
    let stderr = drain(
        child
            .stderr
            .take()
            .map(|p| Box::new(p) as Box<dyn Read + Send>),
    );
    let deadline = Instant::now() + limit;
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait for the command") {
            break status;
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{cmd:?} did not end within {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    std::process::Output {
        status,
        stdout: stdout.join().unwrap_or_default(),
        stderr: stderr.join().unwrap_or_default(),
    }
}
