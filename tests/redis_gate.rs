//! `backend = "redis"` against real parts: bloomgate instances in a fleet, one throwaway
//! Redis and one MariaDB database per test. The builder writes its filter into Redis as
//! a Redis-held generation; every instance asks that copy about keys its own copy
//! refuses; admissions reach it at once; other clients read the same filter; Redis
//! killed leaves the local copies answering, and Redis back (empty) gets a new
//! generation that the instances check again.
//!
//! A check Redis does not answer within `check_timeout` leaves the local verdict (or
//! fails open without a copy) and is counted as `answer="none"`: where a test needs
//! Redis's own answer, it asks again after such a request (see [`answered`]), so a
//! loaded machine makes it slower, never wrong. Deadlines only bound a hang
//! ([`SETTLE`]); how long a check takes is measured by `benches/load/backends`
//! (docs/BENCHMARKS.md, The gate's backends).

mod support;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bloomgate::db::{demo_absent_sku, demo_sku};
use bloomgate::gate::redis_held::{self, HeldKeys, Layout, Scripts};
use bytes::Bytes;
use http::Method;
use redis::aio::MultiplexedConnection;
use support::binary::Bloomgate;
use support::observe::wait_value;
use support::{
    HttpClient, RedisOptions, Reply, TestConfig, TestDb, TestProxy, TestRedis, TestRoute,
    concurrently, eventually, mysql_url, redis_server, series_value,
};

const TOKEN: &str = "test-admin-token";

/// The longest wait for a state the fleet reaches on its own (a generation written, an
/// outage noticed, an admission in Redis): a bound on a hang, not a latency claim.
const SETTLE: Duration = Duration::from_secs(60);

/// The series of checks that Redis did not answer.
const UNANSWERED: &str = "bloomgate_filter_redis_checks_total{answer=\"none\",filter=\"products\"}";

/// Instance `id` of a fleet in namespace `ns` whose filter is held in Redis too, in
/// shards of 4 KiB (so a filter of any size here spans several).
fn config(db: &TestDb, redis: &TestRedis, ns: &str, id: &str, expected: u64) -> TestConfig {
    config_at(db, &redis.url(), ns, id, expected)
}

/// As [`config`], with the Redis URL given.
fn config_at(db: &TestDb, redis_url: &str, ns: &str, id: &str, expected: u64) -> TestConfig {
    held_config(db, redis_url, ns, id, expected, "")
}

/// As [`config`], for a filter held in Redis alone (`local_copy = false`): only the
/// builder holds a copy.
fn alone(db: &TestDb, redis: &TestRedis, ns: &str, id: &str, expected: u64) -> TestConfig {
    held_config(db, &redis.url(), ns, id, expected, ", local_copy = false")
}

fn held_config(
    db: &TestDb,
    redis_url: &str,
    ns: &str,
    id: &str,
    expected: u64,
    held: &str,
) -> TestConfig {
    TestConfig::new(&db.url)
        .admin_token(TOKEN)
        .expected_items(expected)
        .false_positive_rate(0.01)
        .filter("backend = \"redis\"")
        .filter(format!(
            "redis = {{ check_timeout = \"200ms\", shard_bytes = 4096{held} }}"
        ))
        .cache("ttl = \"10m\"")
        .cache("negative_ttl = \"10m\"")
        .route(TestRoute::sql("products", "/api/products/{id}"))
        .fleet(format!("redis_url = \"{redis_url}\""))
        .fleet(format!("namespace = \"{ns}\""))
        .fleet(format!("instance_id = \"{id}\""))
        .fleet("lease_ttl = \"2s\"")
        .fleet("lease_renew = \"500ms\"")
        .fleet("retry_interval = \"100ms\"")
}

/// The current Redis-held generation once there is one numbered above `after` (at
/// most `limit`).
async fn held_layout(
    conn: &mut MultiplexedConnection,
    keys: &HeldKeys,
    after: u64,
    limit: Duration,
) -> Layout {
    let deadline = std::time::Instant::now() + limit;
    loop {
        if let Ok(Some(l)) = redis_held::current(conn, keys).await
            && l.generation > after
        {
            return l;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no Redis-held generation above {after} within {limit:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Whether `proxy` refuses `absent` with an answer from the copy in Redis (counted).
async fn checks_redis(proxy: &TestProxy, absent: u64) -> bool {
    let before = proxy
        .counter_or_zero(
            "bloomgate_filter_redis_checks_total{answer=\"absent\",filter=\"products\"}",
        )
        .await;
    let r = proxy.get(&format!("/api/products/{absent}")).await;
    let after = proxy
        .counter_or_zero(
            "bloomgate_filter_redis_checks_total{answer=\"absent\",filter=\"products\"}",
        )
        .await;
    r.status.as_u16() == 404 && r.stage() == "intercepted" && after > before
}

/// GETs `path` on the instance with data plane `data` and admin plane `admin` until the
/// answer is not one of a check that Redis left unanswered (slower than
/// `check_timeout` on a loaded machine: counted as `none`, the local copy's verdict
/// stood or the request failed open), and returns it. Only for an instance nothing
/// else sends requests to meanwhile.
async fn answered(client: &HttpClient, data: SocketAddr, admin: SocketAddr, path: &str) -> Reply {
    let deadline = std::time::Instant::now() + SETTLE;
    loop {
        let unanswered = |text: String| {
            series_value(&text, UNANSWERED)
                .unwrap_or_else(|| panic!("no {UNANSWERED} in /metrics (it exists from start-up)"))
        };
        let before = unanswered(bin_get_at(client, admin, "/metrics").await.text());
        let r = bin_get_at(client, data, path).await;
        let after = unanswered(bin_get_at(client, admin, "/metrics").await.text());
        if after == before {
            return r;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{path}: Redis left every check unanswered for {SETTLE:?}; last answer {} {}",
            r.status,
            r.stage()
        );
    }
}

/// [`answered`], on a [`TestProxy`].
async fn answered_by(proxy: &TestProxy, path: &str) -> Reply {
    answered(proxy.client(), proxy.data, proxy.admin, path).await
}

/// GET `path` at `addr`.
async fn bin_get_at(client: &HttpClient, addr: SocketAddr, path: &str) -> Reply {
    client
        .send(
            Method::GET,
            &format!("http://{addr}{path}"),
            &[],
            Bytes::new(),
        )
        .await
}

/// Whether generation `layout` of the copy in Redis may hold `key`, asked as another
/// service would.
async fn in_redis(
    conn: &mut MultiplexedConnection,
    keys: &HeldKeys,
    layout: &Layout,
    key: u64,
) -> bool {
    Scripts::new()
        .check(conn, keys, layout, key.to_string().as_bytes())
        .await
        .expect("check")
}

/// An absent key the instances' filters refuse (their local copies and Redis's hold the
/// same bits), found through the copy in Redis.
async fn refused_key(
    conn: &mut MultiplexedConnection,
    keys: &HeldKeys,
    layout: &Layout,
    from: u64,
) -> u64 {
    for i in from.. {
        let k = demo_absent_sku(i);
        if !in_redis(conn, keys, layout, k).await {
            return k;
        }
    }
    unreachable!("an unbounded range")
}

/// Admits `added` through `proxy`'s admin API and waits until the copy in Redis holds
/// it: the instance writes it there without waiting for anything else.
async fn admit_on(
    proxy: &TestProxy,
    conn: &mut MultiplexedConnection,
    keys: &HeldKeys,
    added: u64,
) {
    let r = proxy
        .admin_post(
            "/admin/filters/products/keys",
            Some(TOKEN),
            &added.to_string(),
        )
        .await;
    assert_eq!(r.status.as_u16(), 200, "{}", r.text());
    wait_in_redis(conn, keys, added).await;
}

/// Waits until the copy in Redis holds `added`, in whichever generation is current when
/// it looks: a slow machine can see a lease move and a new generation written while it
/// waits, and the admission then lands in that one.
async fn wait_in_redis(conn: &mut MultiplexedConnection, keys: &HeldKeys, added: u64) {
    let deadline = std::time::Instant::now() + SETTLE;
    loop {
        if let Ok(Some(layout)) = redis_held::current(conn, keys).await
            && in_redis(conn, keys, &layout, added).await
        {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "admission of {added} not in the current generation in Redis"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fleet_gates_with_the_copy_in_redis_which_holds_every_key() {
    let (Some(server), Some(redis_bin)) = (mysql_url(), redis_server()) else {
        return;
    };
    let rows = 100_000;
    let db = TestDb::create_heavy(&server, rows).await;
    let redis = TestRedis::start(&redis_bin).await;
    let a = TestProxy::spawn(&config(&db, &redis, "held", "a", rows).toml()).await;
    let b = TestProxy::spawn(&config(&db, &redis, "held", "b", rows).toml()).await;
    a.wait_ready(Duration::from_secs(120)).await;
    b.wait_ready(Duration::from_secs(120)).await;
    let keys = HeldKeys::new("held", "products");
    let mut conn = redis.conn().await;
    let layout = held_layout(&mut conn, &keys, 0, SETTLE).await;
    assert!(layout.shards() > 1, "{layout:?}");
    assert!(layout.items > rows * 99 / 100, "{layout:?}");

    // The copy in Redis holds every present key, and refuses absent keys at the
    // configured rate: asked as another service would, over one connection.
    let scripts = Scripts::new();
    let mut passed = 0u64;
    for i in 0..rows {
        let present = demo_sku(i).to_string();
        assert!(
            scripts
                .check(&mut conn, &keys, &layout, present.as_bytes())
                .await
                .expect("check"),
            "present key {present} refused by the copy in Redis"
        );
        let absent = demo_absent_sku(i).to_string();
        passed += u64::from(
            scripts
                .check(&mut conn, &keys, &layout, absent.as_bytes())
                .await
                .expect("check"),
        );
    }
    let rate = passed as f64 / rows as f64;
    assert!(
        rate <= 0.012,
        "false-positive rate of the copy in Redis: {rate}"
    );

    // Both instances check it: a refused key is asked of Redis and counted. (Their own
    // copies hold the bits of this generation: one built it, the other loaded it.)
    let refused = refused_key(&mut conn, &keys, &layout, rows + 1).await;
    for p in [&a, &b] {
        eventually("checks answered by Redis", SETTLE, || {
            checks_redis(p, refused)
        })
        .await;
    }
    // Present keys through the proxy (a sample: each is a database read).
    for p in [&a, &b] {
        for i in (0..rows).step_by(499) {
            let r = p.get(&format!("/api/products/{}", demo_sku(i))).await;
            assert_eq!(
                r.status.as_u16(),
                200,
                "sku {} on {:?}",
                demo_sku(i),
                r.stage()
            );
        }
    }

    // A key another service sets in the copy in Redis is let through by both instances,
    // whose own copies refuse it: the origin answers (404, not in the database).
    let outside = refused_key(&mut conn, &keys, &layout, 2 * rows).await;
    for p in [&a, &b] {
        let r = p.get(&format!("/api/products/{outside}")).await;
        assert_eq!(
            (r.status.as_u16(), r.stage()),
            (404, "intercepted"),
            "{outside}"
        );
    }
    scripts
        .add(&mut conn, &keys, &layout, outside.to_string().as_bytes())
        .await
        .expect("add");
    for p in [&a, &b] {
        let maybe_before = p
            .counter_or_zero(
                "bloomgate_filter_redis_checks_total{answer=\"maybe\",filter=\"products\"}",
            )
            .await;
        let r = answered_by(p, &format!("/api/products/{outside}")).await;
        assert_eq!(r.status.as_u16(), 404);
        assert_ne!(
            r.stage(),
            "intercepted",
            "{outside} was set in Redis and still refused"
        );
        let maybe_after = p
            .metric("bloomgate_filter_redis_checks_total{answer=\"maybe\",filter=\"products\"}")
            .await;
        assert!(maybe_after > maybe_before);
    }

    // An admission on one instance is in the copy in Redis once the call returns (it
    // is written by that instance; the builder writes it too).
    let added = refused_key(&mut conn, &keys, &layout, 3 * rows).await;
    admit_on(&a, &mut conn, &keys, added).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_redis_gone_the_local_copies_answer_and_a_new_generation_follows_its_return() {
    let (Some(server), Some(redis_bin)) = (mysql_url(), redis_server()) else {
        return;
    };
    let rows = 2_000;
    let db = TestDb::create(&server, rows).await;
    let mut redis = TestRedis::start(&redis_bin).await;
    let a = TestProxy::spawn(&config(&db, &redis, "gone", "a", rows).toml()).await;
    let b = TestProxy::spawn(&config(&db, &redis, "gone", "b", rows).toml()).await;
    a.wait_ready(Duration::from_secs(60)).await;
    b.wait_ready(Duration::from_secs(60)).await;
    let keys = HeldKeys::new("gone", "products");
    let mut conn = redis.conn().await;
    let first = held_layout(&mut conn, &keys, 0, SETTLE).await;
    let refused = refused_key(&mut conn, &keys, &first, rows + 1).await;
    for p in [&a, &b] {
        eventually("checks answered by Redis", SETTLE, || {
            checks_redis(p, refused)
        })
        .await;
    }
    let absent = refused_key(&mut conn, &keys, &first, rows + 10).await;

    redis.kill();
    // Refusals and present keys are answered by each instance's own copy, and no
    // request waits for a Redis that is not there once the fleet has noticed: Redis is
    // no longer asked (`checked` is false), so each refusal is the local copy's at once,
    // counted as unanswered, and none has an answer from Redis. (How long a refusal
    // takes is measured by benches/load/backends.)
    let answered_series = [
        "bloomgate_filter_redis_checks_total{answer=\"absent\",filter=\"products\"}",
        "bloomgate_filter_redis_checks_total{answer=\"maybe\",filter=\"products\"}",
    ];
    for p in [&a, &b] {
        eventually("Redis seen down", SETTLE, || async {
            p.admin_get("/admin/fleet").await.json()["redis"]["up"] == false
        })
        .await;
        let s = filter_status(p).await;
        assert_eq!(s["redis"]["checked"], false, "Redis still asked: {s}");
        let before = p.scrape().await;
        for _ in 0..20 {
            let r = p.get(&format!("/api/products/{absent}")).await;
            assert_eq!((r.status.as_u16(), r.stage()), (404, "intercepted"));
        }
        let after = p.scrape().await;
        assert_eq!(
            after.value(UNANSWERED) - before.value(UNANSWERED),
            20.0,
            "each refusal counted once as unanswered"
        );
        for series in answered_series {
            assert_eq!(after.value(series), before.value(series), "{series}");
        }
        let s = filter_status(p).await;
        assert_eq!(s["redis"]["checked"], false, "Redis asked again: {s}");
        let r = p.get(&format!("/api/products/{}", demo_sku(7))).await;
        assert_eq!(r.status.as_u16(), 200);
    }

    // Back, empty: the builder writes a new generation, numbered past the one lost,
    // and both instances check it.
    redis.restart().await;
    let mut conn = redis.conn().await;
    let second = held_layout(&mut conn, &keys, first.generation, SETTLE).await;
    for p in [&a, &b] {
        eventually("checks answered by Redis again", SETTLE, || {
            checks_redis(p, absent)
        })
        .await;
    }
    let scripts = Scripts::new();
    for i in 0..rows {
        let k = demo_sku(i).to_string();
        assert!(
            scripts
                .check(&mut conn, &keys, &second, k.as_bytes())
                .await
                .expect("check"),
            "{k}"
        );
    }
}

/// The arguments of the `ACL SETUSER USER ...` line in the docs file `doc`.
fn documented_acl(doc: &str, user: &str) -> Vec<String> {
    let path = format!("{}/docs/{doc}", env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(&path).expect("read the docs");
    let prefix = format!("ACL SETUSER {user} ");
    let line = text
        .lines()
        .map(str::trim)
        .find(|l| l.starts_with(&prefix))
        .unwrap_or_else(|| panic!("no `{prefix}` line in {doc}"));
    line["ACL SETUSER ".len()..]
        .split_whitespace()
        .map(str::to_owned)
        .collect()
}

async fn set_user(conn: &mut MultiplexedConnection, rule: &[String]) {
    let mut cmd = redis::cmd("ACL");
    cmd.arg("SETUSER").arg(rule);
    let _: () = cmd.query_async(conn).await.expect("ACL SETUSER");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_documented_acl_users_can_keep_and_read_the_copy_in_redis() {
    documented_acl_users(false).await;
}

/// The same over TLS (`rediss://`), the server's certificate signed by a CA of the
/// test's own that the instance trusts through `fleet.tls_ca_file`; the port the
/// instance and the reader use speaks only TLS.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_documented_acl_users_can_keep_and_read_the_copy_in_redis_over_tls() {
    documented_acl_users(true).await;
}

async fn documented_acl_users(tls: bool) {
    let (Some(server), Some(redis_bin)) = (mysql_url(), redis_server()) else {
        return;
    };
    let rows = 1_000;
    let db = TestDb::create(&server, rows).await;
    let ca = support::tls::TestCa::new();
    let dir = tempfile::tempdir().expect("temporary directory");
    let (cert, key) = ca.issue("redis", (2099, 1, 1)).write(dir.path());
    let ca_file = dir.path().join("ca.pem");
    std::fs::write(&ca_file, &ca.pem).expect("write the CA");
    let tls_port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port();
    let options = if tls {
        let path = |p: &std::path::Path| p.display().to_string();
        support::RedisOptions::new().args(&[
            "--tls-port",
            &tls_port.to_string(),
            "--tls-cert-file",
            &path(&cert),
            "--tls-key-file",
            &path(&key),
            "--tls-ca-cert-file",
            &path(&ca_file),
            "--tls-auth-clients",
            "no",
        ])
    } else {
        support::RedisOptions::new()
    };
    let redis = TestRedis::start_with(&redis_bin, options).await;
    let (scheme, port) = if tls {
        ("rediss", tls_port)
    } else {
        ("redis", redis.port())
    };
    let mut admin = redis.conn().await;
    // The rules as the docs give them, for the namespace `acl`.
    let writer: Vec<String> = documented_acl("fleet.md", "bloomgate")
        .into_iter()
        .map(|a| a.replace("{bloomgate", "{acl"))
        .collect();
    assert!(writer.contains(&"~{acl}:*".to_owned()), "{writer:?}");
    assert!(writer.contains(&"~{acl:*".to_owned()), "{writer:?}");
    set_user(&mut admin, &writer).await;
    let reader: Vec<String> = documented_acl("redis-gate.md", "gate-reader")
        .into_iter()
        .map(|a| a.replace("{bloomgate", "{acl"))
        .collect();
    assert!(reader.contains(&"~{acl}:gate:*".to_owned()), "{reader:?}");
    assert!(reader.contains(&"~{acl:gate:*".to_owned()), "{reader:?}");
    set_user(&mut admin, &reader).await;

    let url = format!("{scheme}://bloomgate:change-me@127.0.0.1:{port}");
    let mut cfg = config_at(&db, &url, "acl", "a", rows);
    if tls {
        cfg = cfg.fleet(format!("tls_ca_file = \"{}\"", ca_file.display()));
    }
    let a = TestProxy::spawn(&cfg.toml()).await;
    a.wait_ready(Duration::from_secs(60)).await;
    let keys = HeldKeys::new("acl", "products");
    let layout = held_layout(&mut admin, &keys, 0, SETTLE).await;
    // `a` built this generation: its own copy holds the same bits.
    let refused = refused_key(&mut admin, &keys, &layout, rows + 1).await;
    eventually("checks answered by Redis", SETTLE, || {
        checks_redis(&a, refused)
    })
    .await;
    let added = refused_key(&mut admin, &keys, &layout, 2 * rows).await;
    admit_on(&a, &mut admin, &keys, added).await;
    let scripts = Scripts::new();
    let writes_failed = a
        .metric_or_absent(
            "bloomgate_filter_redis_writes_total{filter=\"products\",kind=\"admission\",result=\"error\"}",
        )
        .await;
    assert_eq!(writes_failed, None, "an admission write was refused");

    // The reader runs the check, and nothing that writes.
    let reader_url = format!("{scheme}://gate-reader:reader-secret@127.0.0.1:{port}");
    let reader_client = if tls {
        redis::Client::build_with_tls(
            reader_url.as_str(),
            redis::TlsCertificates {
                client_tls: None,
                root_cert: Some(ca.pem.clone().into_bytes()),
            },
        )
    } else {
        redis::Client::open(reader_url.as_str())
    };
    let mut as_reader = reader_client
        .expect("reader URL")
        .get_multiplexed_async_connection()
        .await
        .expect("connect as the reader");
    assert!(
        scripts
            .check(
                &mut as_reader,
                &keys,
                &layout,
                demo_sku(3).to_string().as_bytes()
            )
            .await
            .expect("a reader's check")
    );
    let refused = scripts
        .add(&mut as_reader, &keys, &layout, b"written-by-a-reader")
        .await;
    assert!(refused.is_err(), "a reader set bits: {refused:?}");
    let set: redis::RedisResult<()> = redis::cmd("SET")
        .arg(keys.current())
        .arg("x")
        .query_async(&mut as_reader)
        .await;
    assert!(set.is_err(), "a reader overwrote the current record");
}

/// The filter's entry in `proxy`'s `/admin/filters`.
async fn filter_status(proxy: &TestProxy) -> serde_json::Value {
    proxy.admin_get("/admin/filters").await.json()["filters"][0].clone()
}

/// The filter's role on `proxy`, from `/admin/fleet`.
async fn role(proxy: &TestProxy) -> String {
    proxy.admin_get("/admin/fleet").await.json()["filters"][0]["role"]
        .as_str()
        .unwrap_or("")
        .to_owned()
}

/// Asks `proxy` for the product of every key, 32 at a time: (key, status, stage).
async fn ask_all(proxy: &Arc<TestProxy>, keys: Vec<u64>) -> Vec<(u64, u16, String)> {
    let proxy = Arc::clone(proxy);
    concurrently(keys, 32, move |k| {
        let proxy = Arc::clone(&proxy);
        async move {
            let r = proxy.get(&format!("/api/products/{k}")).await;
            (k, r.status.as_u16(), r.stage().to_owned())
        }
    })
    .await
}

/// What an instance without a copy answered for a set of keys, each asked until
/// Redis answered its check.
struct Sweep {
    /// (key, status, stage) of the request whose check Redis answered.
    answered: Vec<(u64, u16, String)>,
    /// Requests that failed open because Redis left their check unanswered (slower
    /// than `check_timeout` on a loaded machine): (key, status).
    failed_open: Vec<(u64, u16)>,
}

/// Asks `proxy` (an instance without a copy, which nothing else asks meanwhile) for
/// every key, then again for the keys whose requests failed open, until every key has
/// a request that Redis answered.
async fn sweep(proxy: &Arc<TestProxy>, keys: Vec<u64>) -> Sweep {
    let deadline = std::time::Instant::now() + SETTLE;
    let mut out = Sweep {
        answered: Vec::new(),
        failed_open: Vec::new(),
    };
    let mut asking = keys;
    while !asking.is_empty() {
        let mut again = Vec::new();
        for (k, status, stage) in ask_all(proxy, asking).await {
            if stage == "fail-open" {
                out.failed_open.push((k, status));
                again.push(k);
            } else {
                out.answered.push((k, status, stage));
            }
        }
        assert!(
            again.is_empty() || std::time::Instant::now() < deadline,
            "{} keys still failed open after {SETTLE:?}, e.g. {:?}",
            again.len(),
            &again[..again.len().min(5)]
        );
        asking = again;
    }
    out
}

/// The checks `proxy` counted so far, by answer: (maybe, absent, none).
async fn checks(proxy: &TestProxy) -> (f64, f64, f64) {
    let s = proxy.scrape().await;
    let answer = |a: &str| {
        s.value(&format!(
            "bloomgate_filter_redis_checks_total{{answer=\"{a}\",filter=\"products\"}}"
        ))
    };
    (answer("maybe"), answer("absent"), answer("none"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_instance_without_a_copy_asks_redis_about_every_key_and_refuses_no_present_one() {
    // Every other key of a filter that spans two shards: 5,000 requests. The
    // false-positive rate of a sample this size is held to twice the target; the
    // exhaustive run below holds it to 1.2 times over 100,000 keys of each kind.
    without_a_copy(5_000, 2, 0.02).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "exhaustive: benches/exhaustive"]
async fn exhaustive_an_instance_without_a_copy_asks_redis_about_each_of_100_000_keys() {
    without_a_copy(100_000, 1, 0.012).await;
}

/// Two instances of a filter held in Redis alone, over `rows` products: `b`, without a
/// copy, is asked for every `step`-th present and absent key and must agree with the
/// copy in Redis, at a false-positive rate of at most `max_rate`; then come admissions
/// on `b`, and Redis killed and brought back.
async fn without_a_copy(rows: u64, step: usize, max_rate: f64) {
    let (Some(server), Some(redis_bin)) = (mysql_url(), redis_server()) else {
        return;
    };
    let db = if rows > 10_000 {
        TestDb::create_heavy(&server, rows).await
    } else {
        TestDb::create(&server, rows).await
    };
    let mut redis = TestRedis::start(&redis_bin).await;
    // `a` starts alone and takes the lease: it builds, so it holds the only copy.
    let a = TestProxy::spawn(&alone(&db, &redis, "alone", "a", rows).toml()).await;
    a.wait_ready(Duration::from_secs(120)).await;
    eventually("a builds", SETTLE, || async { role(&a).await == "builder" }).await;
    let keys = HeldKeys::new("alone", "products");
    let mut conn = redis.conn().await;
    let layout = held_layout(&mut conn, &keys, 0, SETTLE).await;
    assert!(layout.shards() > 1, "{layout:?}");
    let b = Arc::new(TestProxy::spawn(&alone(&db, &redis, "alone", "b", rows).toml()).await);
    // Ready from the generation in Redis, with no copy of its own.
    b.wait_ready(SETTLE).await;
    assert_eq!(role(&b).await, "follower");
    let fb = filter_status(&b).await;
    assert_eq!(fb["holds_copy"], false, "{fb}");
    assert_eq!(fb["bits"], serde_json::Value::Null, "{fb}");
    assert_eq!(fb["redis"]["generation"], layout.generation, "{fb}");
    assert_eq!(fb["redis"]["checked"], true, "{fb}");
    assert_eq!(
        b.metric("bloomgate_filter_bits{filter=\"products\"}").await,
        0.0
    );
    assert_eq!(filter_status(&a).await["holds_copy"], true);

    // Present keys through the proxy: Redis is asked about each one (one check per
    // request; every check it left unanswered, a request that failed open and was
    // asked again), and none is refused.
    let (maybe_before, absent_before, none_before) = checks(&b).await;
    let present: Vec<u64> = (0..rows).step_by(step).map(demo_sku).collect();
    let asked = present.len();
    let swept = sweep(&b, present).await;
    let refused: Vec<_> = swept
        .answered
        .iter()
        .filter(|(_, status, _)| *status != 200)
        .collect();
    assert!(
        refused.is_empty(),
        "{} present keys not served, e.g. {:?}",
        refused.len(),
        &refused[..refused.len().min(5)]
    );
    let not_served: Vec<_> = swept
        .failed_open
        .iter()
        .filter(|(_, s)| *s != 200)
        .collect();
    assert!(
        not_served.is_empty(),
        "failed open, not served: {not_served:?}"
    );
    let (maybe, absent_answers, none) = checks(&b).await;
    assert_eq!(
        maybe - maybe_before,
        asked as f64,
        "one maybe per present key"
    );
    assert_eq!(
        absent_answers, absent_before,
        "a present key refused by Redis"
    );
    assert_eq!(none - none_before, swept.failed_open.len() as f64);

    // Absent keys: exactly the ones the copy in Redis lets through reach the origin,
    // at the configured rate.
    let absent: Vec<u64> = (0..rows).step_by(step).map(demo_absent_sku).collect();
    let asked = absent.len();
    let swept = sweep(&b, absent).await;
    assert!(
        swept.failed_open.iter().all(|(_, s)| *s == 404),
        "{:?}",
        swept.failed_open
    );
    let mut disagree = Vec::new();
    let mut passed = 0u64;
    for (k, status, stage) in &swept.answered {
        assert_eq!(*status, 404, "absent key {k}");
        let through = stage != "intercepted";
        passed += u64::from(through);
        let says = in_redis(&mut conn, &keys, &layout, *k).await;
        if says != through {
            disagree.push((*k, stage.clone(), says));
        }
    }
    assert!(
        disagree.is_empty(),
        "{:?}",
        &disagree[..disagree.len().min(5)]
    );
    let rate = passed as f64 / asked as f64;
    eprintln!(
        "without a copy: {asked} absent keys, {passed} let through by Redis (rate {rate:.4}); \
         {} requests failed open on an unanswered check and were asked again",
        swept.failed_open.len()
    );
    assert!(
        rate <= max_rate,
        "false-positive rate through the proxy: {rate}"
    );

    // An admission on `b` is let through by `b` at once, before anything else happens
    // (its write into Redis may still be on its way), and is in Redis soon after.
    for n in 0..20 {
        let added = refused_key(&mut conn, &keys, &layout, 3 * rows + n * 100).await;
        let r = b
            .admin_post(
                "/admin/filters/products/keys",
                Some(TOKEN),
                &added.to_string(),
            )
            .await;
        assert_eq!(r.status.as_u16(), 200, "{}", r.text());
        let r = b.get(&format!("/api/products/{added}")).await;
        assert_ne!(
            r.stage(),
            "intercepted",
            "{added} admitted on b, refused by b"
        );
        wait_in_redis(&mut conn, &keys, added).await;
        // Once in Redis, every instance lets it through, whatever its own copy says.
        let r = answered_by(&a, &format!("/api/products/{added}")).await;
        assert_ne!(r.stage(), "intercepted", "{added} in Redis, refused by a");
    }

    // Redis killed: `b` has nothing to refuse with and fails open (counted); `a`
    // refuses from its copy.
    let refused_absent = refused_key(&mut conn, &keys, &layout, 5 * rows).await;
    redis.kill();
    eventually("Redis seen down", SETTLE, || async {
        b.admin_get("/admin/fleet").await.json()["redis"]["up"] == false
    })
    .await;
    let fail_open = "bloomgate_requests_total{outcome=\"fail_open\",route=\"products\"}";
    let opened_before = b.counter_or_zero(fail_open).await;
    let r = b.get(&format!("/api/products/{refused_absent}")).await;
    assert_eq!((r.status.as_u16(), r.stage()), (404, "fail-open"));
    assert!(b.metric(fail_open).await > opened_before);
    let r = b.get(&format!("/api/products/{}", demo_sku(11))).await;
    assert_eq!(r.status.as_u16(), 200);
    let r = a.get(&format!("/api/products/{refused_absent}")).await;
    assert_eq!(r.stage(), "intercepted");
    // Still ready: an outage of Redis does not take it out of a load balancer.
    assert_eq!(b.admin_get("/readyz").await.status.as_u16(), 200);
    assert_eq!(filter_status(&b).await["holds_copy"], false);

    // Back, empty: the builder writes a new generation and `b` refuses with it. In
    // between (no generation to trust), `b` stays ready and fails open.
    redis.restart().await;
    eventually("b sees Redis reset", SETTLE, || async {
        b.admin_get("/admin/fleet").await.json()["redis"]["resets_seen"] == 1
    })
    .await;
    assert_eq!(b.admin_get("/readyz").await.status.as_u16(), 200);
    let mut conn = redis.conn().await;
    let second = held_layout(&mut conn, &keys, layout.generation, SETTLE).await;
    // The instance that took the lease after the reset may have built this generation
    // from the source, with a new seed: the key is picked from it again.
    let refused_absent = refused_key(&mut conn, &keys, &second, 5 * rows).await;
    let deadline = std::time::Instant::now() + SETTLE;
    while !checks_redis(&b, refused_absent).await {
        if std::time::Instant::now() >= deadline {
            let answer = b.get(&format!("/api/products/{refused_absent}")).await;
            panic!(
                "b does not refuse {refused_absent} through Redis again within {SETTLE:?}: \
                 answered {} {}; filter {}; fleet {}",
                answer.status,
                answer.stage(),
                filter_status(&b).await,
                b.admin_get("/admin/fleet").await.json()
            );
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_that_may_evict_is_not_asked_until_its_policy_is_noeviction_again() {
    let (Some(server), Some(redis_bin)) = (mysql_url(), redis_server()) else {
        return;
    };
    let rows = 2_000;
    let db = TestDb::create(&server, rows).await;
    let redis = TestRedis::start_with(
        &redis_bin,
        RedisOptions::new().args(&["--maxmemory-policy", "allkeys-lru"]),
    )
    .await;
    // `a` builds (it starts first and takes the lease); `b` holds no copy.
    let a = TestProxy::spawn(&config(&db, &redis, "evict", "a", rows).toml()).await;
    a.wait_ready(Duration::from_secs(60)).await;
    eventually("a builds", SETTLE, || async { role(&a).await == "builder" }).await;
    let keys = HeldKeys::new("evict", "products");
    let mut conn = redis.conn().await;
    let first = held_layout(&mut conn, &keys, 0, SETTLE).await;
    let b = TestProxy::spawn(&alone(&db, &redis, "evict", "b", rows).toml()).await;
    eventually("b knows the generation", SETTLE, || async {
        filter_status(&b).await["redis"]["generation"].is_u64()
    })
    .await;
    let absent = refused_key(&mut conn, &keys, &first, rows + 10).await;

    // The generation is written, but neither instance trusts a Redis that may evict
    // one of its shards: `a` refuses from its own copy, `b` (no copy) fails open.
    let fleet = a.admin_get("/admin/fleet").await.json();
    assert_eq!(fleet["redis"]["maxmemory_policy"], "allkeys-lru", "{fleet}");
    let none = "bloomgate_filter_redis_checks_total{answer=\"none\",filter=\"products\"}";
    let answered = "bloomgate_filter_redis_checks_total{answer=\"absent\",filter=\"products\"}";
    for p in [&a, &b] {
        let s = filter_status(p).await;
        assert_eq!(s["redis"]["checked"], false, "{s}");
        assert_eq!(s["redis"]["noeviction"], false, "{s}");
    }
    let none_before = a.counter_or_zero(none).await;
    let r = a.get(&format!("/api/products/{absent}")).await;
    assert_eq!((r.status.as_u16(), r.stage()), (404, "intercepted"));
    assert!(a.metric(none).await > none_before);
    assert_eq!(a.counter_or_zero(answered).await, 0.0);
    let r = b.get(&format!("/api/products/{absent}")).await;
    assert_eq!((r.status.as_u16(), r.stage()), (404, "fail-open"));

    // The policy set right at run time: both ask Redis again.
    let _: () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("maxmemory-policy")
        .arg("noeviction")
        .query_async(&mut conn)
        .await
        .expect("CONFIG SET");
    for p in [&a, &b] {
        eventually("checks answered by Redis", SETTLE, || {
            checks_redis(p, absent)
        })
        .await;
    }

    // And set wrong again: no longer asked, from each instance's next poll on (each
    // polls on its own clock: wait for both).
    let _: () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("maxmemory-policy")
        .arg("volatile-lru")
        .query_async(&mut conn)
        .await
        .expect("CONFIG SET");
    for p in [&a, &b] {
        wait_value(
            "Redis no longer asked",
            SETTLE,
            || async { filter_status(p).await["redis"].clone() },
            |redis| redis["checked"] == false,
        )
        .await;
    }
    let r = b.get(&format!("/api/products/{absent}")).await;
    assert_eq!((r.status.as_u16(), r.stage()), (404, "fail-open"));
    let r = a.get(&format!("/api/products/{absent}")).await;
    assert_eq!(r.stage(), "intercepted");
}

/// GET `path` on the admin plane (`admin`) or the data plane of `bin`.
async fn bin_get(client: &HttpClient, bin: &Bloomgate, admin: bool, path: &str) -> Reply {
    bin_get_at(client, if admin { bin.admin } else { bin.data }, path).await
}

/// The `products` filter as `bin`'s `/admin/filters` and `/admin/fleet` show it.
async fn bin_state(client: &HttpClient, bin: &Bloomgate) -> (String, serde_json::Value) {
    let fleet = bin_get(client, bin, true, "/admin/fleet").await.json();
    let role = fleet["filters"][0]["role"]
        .as_str()
        .unwrap_or("")
        .to_owned();
    let filter = bin_get(client, bin, true, "/admin/filters").await.json()["filters"][0].clone();
    (role, filter)
}

/// Waits until exactly one of `bins` builds and holds a copy, and the others follow
/// with none; returns the builder's index.
async fn one_copy(client: &HttpClient, bins: &[&Bloomgate], limit: Duration) -> usize {
    let deadline = std::time::Instant::now() + limit;
    loop {
        let mut states = Vec::new();
        for b in bins {
            states.push(bin_state(client, b).await);
        }
        let builders: Vec<usize> = (0..bins.len())
            .filter(|&i| states[i].0 == "builder" && states[i].1["holds_copy"] == true)
            .collect();
        let followers = states
            .iter()
            .filter(|(role, f)| role == "follower" && f["holds_copy"] == false)
            .count();
        if builders.len() == 1 && followers == bins.len() - 1 {
            return builders[0];
        }
        assert!(
            std::time::Instant::now() < deadline,
            "not one builder with the only copy: {:?}",
            states
                .iter()
                .map(|(r, f)| (r, &f["holds_copy"]))
                .collect::<Vec<_>>()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Every instance in `bins` refuses `absent` (with Redis's answer, where it is asked)
/// and serves `present`.
async fn all_gate(client: &HttpClient, bins: &[&Bloomgate], absent: u64, present: u64) {
    for b in bins {
        let r = answered(client, b.data, b.admin, &format!("/api/products/{absent}")).await;
        assert_eq!((r.status.as_u16(), r.stage()), (404, "intercepted"));
        let r = bin_get(client, b, false, &format!("/api/products/{present}")).await;
        assert_eq!(r.status.as_u16(), 200);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_the_builder_holds_a_copy_through_a_killed_builder_and_a_lost_lease() {
    let (Some(server), Some(redis_bin)) = (mysql_url(), redis_server()) else {
        return;
    };
    let rows = 5_000;
    let db = TestDb::create(&server, rows).await;
    let redis = TestRedis::start(&redis_bin).await;
    let toml = |id: &str| {
        held_config(
            &db,
            &redis.url(),
            "takeover",
            id,
            rows,
            ", local_copy = false",
        )
        .server("listen = \"127.0.0.1:0\"")
        .admin("listen = \"127.0.0.1:0\"")
        .toml()
    };
    let client = HttpClient::new();
    let mut a = Bloomgate::serve(&toml("a"), &[]).await;
    one_copy(&client, &[&a], Duration::from_secs(60)).await;
    let keys = HeldKeys::new("takeover", "products");
    let mut conn = redis.conn().await;
    let first = held_layout(&mut conn, &keys, 0, SETTLE).await;
    let b = Bloomgate::serve(&toml("b"), &[]).await;
    let c = Bloomgate::serve(&toml("c"), &[]).await;
    assert_eq!(one_copy(&client, &[&a, &b, &c], SETTLE).await, 0);
    let absent = refused_key(&mut conn, &keys, &first, rows + 10).await;
    all_gate(&client, &[&a, &b, &c], absent, demo_sku(5)).await;
    // A key the source does not hold, admitted on a follower: only the generations to
    // come, the change stream and the copy in Redis know it.
    let admitted = refused_key(&mut conn, &keys, &first, 2 * rows).await;
    let r = client
        .send(
            Method::POST,
            &format!("http://{}/admin/filters/products/keys", b.admin),
            &[("authorization", &format!("Bearer {TOKEN}"))],
            Bytes::from(admitted.to_string()),
        )
        .await;
    assert_eq!(r.status.as_u16(), 200, "{}", r.text());
    wait_in_redis(&mut conn, &keys, admitted).await;

    // SIGKILL the builder: no lease release. One survivor takes the lease once it
    // expires, loads the last generation the fleet published (no scan of the source),
    // and writes a new generation of the copy in Redis; the other still holds none.
    a.signal("KILL");
    assert_eq!(a.wait_exit(SETTLE).await, None);
    all_gate(&client, &[&b, &c], absent, demo_sku(6)).await;
    let survivors = [&b, &c];
    let nb = one_copy(&client, &survivors, SETTLE).await;
    let (_, state) = bin_state(&client, survivors[nb]).await;
    assert_eq!(state["last_load"]["reason"], "published", "{state}");
    let second = held_layout(&mut conn, &keys, first.generation, SETTLE).await;
    all_gate(&client, &survivors, absent, demo_sku(7)).await;
    // The new builder's generation holds the admitted key (from the stream, replayed on
    // the generation it loaded).
    assert!(
        in_redis(&mut conn, &keys, &second, admitted).await,
        "{admitted} admitted before the takeover is not in generation {}",
        second.generation
    );

    // The lease taken over (as after a pause longer than its expiry): the builder
    // stops building and drops its copy. Once the lease expires an instance takes it,
    // loads the copy and writes a new generation.
    let _: () = redis::cmd("SET")
        .arg("{takeover}:filter:products:lease")
        .arg("elsewhere")
        .arg("PX")
        .arg(3000)
        .query_async(&mut conn)
        .await
        .expect("SET lease");
    eventually("the builder drops its copy", SETTLE, || async {
        let states = [bin_state(&client, &b).await, bin_state(&client, &c).await];
        states
            .iter()
            .all(|(role, f)| role == "follower" && f["holds_copy"] == false)
    })
    .await;
    all_gate(&client, &survivors, absent, demo_sku(8)).await;
    one_copy(&client, &survivors, SETTLE).await;
    let third = held_layout(&mut conn, &keys, second.generation, SETTLE).await;
    all_gate(&client, &survivors, absent, demo_sku(9)).await;
    assert!(
        in_redis(&mut conn, &keys, &third, admitted).await,
        "{admitted} is not in generation {}",
        third.generation
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_admission_that_has_not_reached_redis_is_let_through_by_the_instance_that_made_it() {
    let (Some(server), Some(redis_bin)) = (mysql_url(), redis_server()) else {
        return;
    };
    let rows = 1_000;
    let db = TestDb::create(&server, rows).await;
    let redis = TestRedis::start(&redis_bin).await;
    let a = TestProxy::spawn(&config(&db, &redis, "unwritten", "a", rows).toml()).await;
    a.wait_ready(Duration::from_secs(60)).await;
    eventually("a builds", SETTLE, || async { role(&a).await == "builder" }).await;
    let keys = HeldKeys::new("unwritten", "products");
    let mut admin = redis.conn().await;
    let layout = held_layout(&mut admin, &keys, 0, SETTLE).await;
    // `b` runs as a user that may not set bits nor append to the change stream: its
    // admissions reach neither the copy in Redis nor the builder.
    let mut rule: Vec<String> = documented_acl("fleet.md", "bloomgate")
        .into_iter()
        .map(|a| a.replace("{bloomgate", "{unwritten"))
        .collect();
    rule.extend(["-setbit".to_owned(), "-xadd".to_owned()]);
    set_user(&mut admin, &rule).await;
    let url = format!("redis://bloomgate:change-me@127.0.0.1:{}", redis.port());
    let b = TestProxy::spawn(
        &held_config(&db, &url, "unwritten", "b", rows, ", local_copy = false").toml(),
    )
    .await;
    b.wait_ready(SETTLE).await;
    assert_eq!(filter_status(&b).await["holds_copy"], false);

    for n in 0..5 {
        let added = refused_key(&mut admin, &keys, &layout, 2 * rows + n * 100).await;
        let r = b
            .admin_post(
                "/admin/filters/products/keys",
                Some(TOKEN),
                &added.to_string(),
            )
            .await;
        assert_eq!(r.status.as_u16(), 200, "{}", r.text());
        assert_eq!(r.json()["added"], 1, "{}", r.text());
        // Polls come and go (each tries to write it again, and fails): `b` answers
        // for the key itself, while Redis and the builder still refuse it.
        for _ in 0..3 {
            let r = b.get(&format!("/api/products/{added}")).await;
            assert_eq!(r.status.as_u16(), 404);
            assert_ne!(
                r.stage(),
                "intercepted",
                "{added} admitted on b, refused by b"
            );
            tokio::time::sleep(Duration::from_millis(150)).await;
        }
        assert!(
            !in_redis(&mut admin, &keys, &layout, added).await,
            "{added} reached Redis after all"
        );
        let r = a.get(&format!("/api/products/{added}")).await;
        assert_eq!(r.stage(), "intercepted");
    }
    // Each admission's write runs in a task of its own: wait for the fifth to fail.
    wait_value(
        "five failed admission writes",
        SETTLE,
        || b.metric("bloomgate_filter_redis_writes_total{filter=\"products\",kind=\"admission\",result=\"error\"}"),
        |failed| *failed >= 5.0,
    )
    .await;
    assert_eq!(filter_status(&b).await["redis"]["recent_admissions"], 5);
}
