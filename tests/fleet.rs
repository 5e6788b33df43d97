//! Fleet mode against real parts: three bloomgate instances, one throwaway Redis and one
//! MariaDB database per test, all on loopback. One instance builds and publishes, the
//! others load what it publishes; admissions and invalidations on any instance reach
//! every other through the change stream; a generation that is corrupt or implausible
//! is refused.

mod support;

use std::time::{Duration, Instant};

use bloomgate::db::{demo_absent_sku, demo_sku};
use bloomgate::redis_conn::RedisConn;
use redis::AsyncCommands;
use support::topology::Backing;
use support::{
    TestConfig, TestDb, TestProxy, TestRedis, TestRoute, eventually, mysql_url, redis_server,
    refused_absent_key,
};

const TOKEN: &str = "test-admin-token";

/// The config of instance `id` of a fleet in namespace `ns`.
fn config(db: &TestDb, redis: &TestRedis, ns: &str, id: &str, expected: u64) -> TestConfig {
    config_at(db, &redis.url(), ns, id, expected)
}

/// As [`config`], on the Redis at `redis_url`.
fn config_at(db: &TestDb, redis_url: &str, ns: &str, id: &str, expected: u64) -> TestConfig {
    TestConfig::new(&db.url)
        .admin_token(TOKEN)
        .expected_items(expected)
        .false_positive_rate(0.001)
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

/// Waits until `proxy` is ready (a filter loaded), for at most `limit`.
async fn ready(proxy: &TestProxy, limit: Duration) {
    proxy.wait_ready(limit).await;
}

/// The `/admin/fleet` state of the `products` filter on `proxy`.
async fn fleet_filter(proxy: &TestProxy) -> serde_json::Value {
    proxy.admin_get("/admin/fleet").await.json()["filters"][0].clone()
}

/// Polls `check` on every proxy until it holds on each, for at most `limit` per proxy.
async fn on_all(
    proxies: &[&TestProxy],
    limit: Duration,
    what: &str,
    check: impl AsyncFn(&TestProxy) -> bool,
) {
    for (i, p) in proxies.iter().enumerate() {
        eventually(&format!("{what} on instance {i}"), limit, || check(p)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fleet_scans_the_table_once_and_every_instance_serves_every_key() {
    let (Some(server), Some(redis_bin)) = (mysql_url(), redis_server()) else {
        return;
    };
    let rows = 200_000;
    let db = TestDb::create_heavy(&server, rows).await;
    let redis = TestRedis::start(&redis_bin).await;
    let base_reads = db.rows_read().await;
    let mut proxies = Vec::new();
    for id in ["a", "b", "c"] {
        proxies.push(TestProxy::spawn(&config(&db, &redis, "start", id, rows).toml()).await);
    }
    for p in &proxies {
        ready(p, Duration::from_secs(120)).await;
    }
    // Exactly one instance built; the others loaded its generation.
    let mut builds = 0.0;
    let mut builders = 0;
    for p in &proxies {
        builds += p
            .metric("bloomgate_filter_loads_total{filter=\"products\",result=\"ok\"}")
            .await;
        let f = fleet_filter(p).await;
        if f["role"] == "builder" {
            builders += 1;
        } else {
            assert_eq!(f["role"], "follower", "{f}");
            assert_eq!(f["serving"]["generation"], 1, "{f}");
        }
    }
    assert_eq!((builds, builders), (1.0, 1));
    db.wait_idle().await;
    let read = db.rows_read().await - base_reads;
    // One build reads the table once to count it and once to scan it; three builds
    // would read it six times.
    assert!(
        read < 3 * rows,
        "{read} rows read for {rows} keys: more than one build"
    );
    eprintln!("fleet start: {read} rows read by the fleet for a {rows}-key table");

    // Every present key is served by every instance (a sample, through HTTP).
    for p in &proxies {
        for i in (0..rows).step_by(997) {
            let r = p.get(&format!("/api/products/{}", demo_sku(i))).await;
            assert_eq!(
                r.status.as_u16(),
                200,
                "sku {} on {:?}",
                demo_sku(i),
                r.stage()
            );
        }
        let r = p
            .get(&format!("/api/products/{}", demo_absent_sku(5)))
            .await;
        assert_eq!(r.status.as_u16(), 404);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admissions_and_invalidations_on_one_instance_reach_the_others() {
    let (Some(server), Some(redis_bin)) = (mysql_url(), redis_server()) else {
        return;
    };
    let db = TestDb::create(&server, 1_000).await;
    let redis = TestRedis::start(&redis_bin).await;
    let a = TestProxy::spawn(&config(&db, &redis, "adm", "a", 2_000).toml()).await;
    let b = TestProxy::spawn(&config(&db, &redis, "adm", "b", 2_000).toml()).await;
    let c = TestProxy::spawn(&config(&db, &redis, "adm", "c", 2_000).toml()).await;
    for p in [&a, &b, &c] {
        ready(p, Duration::from_secs(60)).await;
    }

    // A key created behind the fleet's back is refused everywhere (the instances serve
    // one generation, so a key A refuses is refused by each).
    let new_key = refused_absent_key(&a, "/api/products/", 11).await;
    db.insert_product(new_key).await;
    for p in [&a, &b, &c] {
        assert_eq!(
            p.get(&format!("/api/products/{new_key}"))
                .await
                .status
                .as_u16(),
            404
        );
    }
    let r = a
        .admin_post(
            "/admin/filters/products/keys",
            Some(TOKEN),
            &format!("{new_key}"),
        )
        .await;
    assert_eq!(r.status.as_u16(), 200, "{}", r.text());
    let started = Instant::now();
    on_all(
        &[&b, &c],
        Duration::from_secs(10),
        "admitted key",
        async |p: &TestProxy| {
            p.get(&format!("/api/products/{new_key}"))
                .await
                .status
                .as_u16()
                == 200
        },
    )
    .await;
    eprintln!(
        "admission on A served by B and C after {:?}",
        started.elapsed()
    );

    // A cached product, invalidated on A, is dropped on B too.
    let sku = demo_sku(3);
    assert_eq!(b.get(&format!("/api/products/{sku}")).await.stage(), "miss");
    assert_eq!(b.get(&format!("/api/products/{sku}")).await.stage(), "hit");
    let r = a
        .admin_post("/admin/cache/invalidate", Some(TOKEN), &format!("[{sku}]"))
        .await;
    assert_eq!(r.status.as_u16(), 200, "{}", r.text());
    on_all(
        &[&b],
        Duration::from_secs(10),
        "invalidation",
        async |p: &TestProxy| {
            // A miss refills the entry: the next check sees a hit again, so look for one miss.
            p.get(&format!("/api/products/{sku}")).await.stage() == "miss"
        },
    )
    .await;

    // The stream position moves on every instance, and /admin/filters shows the role.
    for p in [&a, &b, &c] {
        let fleet = p.admin_get("/admin/fleet").await.json();
        assert_ne!(fleet["stream"]["position"], "0-0", "{fleet}");
        let f = p.admin_get("/admin/filters").await.json();
        assert!(
            matches!(
                f["filters"][0]["fleet"]["role"].as_str(),
                Some("builder" | "follower")
            ),
            "{f}"
        );
    }
}

/// A negative entry on C for a key that is then created through A: C answers 200 at once
/// (the admission drops C's negative entry through the stream).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_negative_entry_on_one_instance_goes_when_the_key_is_admitted_on_another() {
    let (Some(server), Some(redis_bin)) = (mysql_url(), redis_server()) else {
        return;
    };
    let db = TestDb::create(&server, 1_000).await;
    let redis = TestRedis::start(&redis_bin).await;
    // Gate off on C's route would change the config; instead, find a false positive.
    // Sized for exactly the table, so the filter runs at its target rate (0.1%): at half
    // load its false positives would be too rare to find one quickly.
    let a = TestProxy::spawn(&config(&db, &redis, "neg", "a", 1_000).toml()).await;
    let c = TestProxy::spawn(&config(&db, &redis, "neg", "c", 1_000).toml()).await;
    for p in [&a, &c] {
        ready(p, Duration::from_secs(60)).await;
    }
    // At 0.1%, some absent key among many is a false positive on C's (shared) filter.
    let mut fp = None;
    for i in 0..200_000 {
        let k = demo_absent_sku(i);
        let r = c.get(&format!("/api/products/{k}")).await;
        if r.stage() == "miss" {
            fp = Some(k);
            break;
        }
    }
    let fp = fp.expect("a false positive among 200,000 absent keys");
    assert_eq!(
        c.get(&format!("/api/products/{fp}")).await.stage(),
        "negative-hit"
    );
    db.insert_product(fp).await;
    let r = a
        .admin_post(
            "/admin/filters/products/keys",
            Some(TOKEN),
            &format!("{fp}"),
        )
        .await;
    assert_eq!(r.status.as_u16(), 200);
    on_all(
        &[&c],
        Duration::from_secs(10),
        "negative entry dropped",
        async |p: &TestProxy| p.get(&format!("/api/products/{fp}")).await.status.as_u16() == 200,
    )
    .await;
}

/// A key admitted on A while Redis does not answer waits in A's outbox and reaches B once
/// Redis answers again: an outage delays an admission, it does not lose it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_admission_made_while_redis_is_frozen_reaches_the_others_when_it_thaws() {
    let (Some(server), Some(redis_bin)) = (mysql_url(), redis_server()) else {
        return;
    };
    let db = TestDb::create(&server, 1_000).await;
    let redis = TestRedis::start(&redis_bin).await;
    let cfg = |id: &str| {
        config(&db, &redis, "outage", id, 2_000)
            .fleet("command_timeout = \"300ms\"")
            .toml()
    };
    let a = TestProxy::spawn(&cfg("a")).await;
    let b = TestProxy::spawn(&cfg("b")).await;
    for p in [&a, &b] {
        ready(p, Duration::from_secs(60)).await;
    }
    let key = refused_absent_key(&b, "/api/products/", 77).await;
    db.insert_product(key).await;
    let path = format!("/api/products/{key}");
    assert_eq!(b.get(&path).await.status.as_u16(), 404);
    let appended = "bloomgate_fleet_stream_entries_total{direction=\"appended\"}";
    let before = a.counter_or_zero(appended).await;

    redis.freeze();
    on_all(
        &[&a, &b],
        Duration::from_secs(30),
        "Redis seen down",
        async |p: &TestProxy| p.admin_get("/admin/fleet").await.json()["redis"]["up"] == false,
    )
    .await;
    let r = a
        .admin_post(
            "/admin/filters/products/keys",
            Some(TOKEN),
            &key.to_string(),
        )
        .await;
    assert_eq!(r.status.as_u16(), 200, "{}", r.text());
    assert_eq!(a.get(&path).await.status.as_u16(), 200);
    // B has no sync of its own here (no sync query): only the stream can bring the key.
    assert_eq!(b.get(&path).await.status.as_u16(), 404);
    assert_eq!(a.counter_or_zero(appended).await, before);

    redis.thaw();
    on_all(
        &[&b],
        Duration::from_secs(30),
        "the key admitted during the outage",
        async |p: &TestProxy| p.get(&path).await.status.as_u16() == 200,
    )
    .await;
    assert!(a.metric(appended).await > before);
}

/// A builder cut off from Redis for less than its lease goes on alone meanwhile; when
/// Redis answers again and still holds its lease unchanged, it takes the lease back at
/// once (same fencing epoch) rather than leaving the filter without a builder until the
/// lease expires.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_builder_cut_off_briefly_takes_its_lease_back_when_redis_returns() {
    let (Some(server), Some(redis_bin)) = (mysql_url(), redis_server()) else {
        return;
    };
    let db = TestDb::create(&server, 1_000).await;
    let redis = TestRedis::start(&redis_bin).await;
    // A lease far longer than the test's wait: only taking it back can make a builder in time.
    let cfg = |id: &str| {
        config(&db, &redis, "lapse", id, 2_000)
            .fleet("command_timeout = \"300ms\"")
            .toml()
            .replace("lease_ttl = \"2s\"", "lease_ttl = \"60s\"")
            .replace("lease_renew = \"500ms\"", "lease_renew = \"1s\"")
    };
    let a = TestProxy::spawn(&cfg("a")).await;
    ready(&a, Duration::from_secs(60)).await;
    let b = TestProxy::spawn(&cfg("b")).await;
    ready(&b, Duration::from_secs(60)).await;
    let before = fleet_filter(&a).await;
    assert_eq!(before["role"], "builder", "{before}");

    redis.freeze();
    on_all(
        &[&a, &b],
        Duration::from_secs(30),
        "standalone",
        async |p: &TestProxy| fleet_filter(p).await["role"] == "standalone",
    )
    .await;
    redis.thaw();
    on_all(
        &[&a],
        Duration::from_secs(20),
        "builder again",
        async |p: &TestProxy| fleet_filter(p).await["role"] == "builder",
    )
    .await;
    let after = fleet_filter(&a).await;
    assert_eq!(after["lease_epoch"], before["lease_epoch"], "{after}");
    on_all(
        &[&b],
        Duration::from_secs(20),
        "following a again",
        async |p: &TestProxy| {
            let f = fleet_filter(p).await;
            f["role"] == "follower" && f["lease_holder"] == "a"
        },
    )
    .await;
    assert_eq!(
        a.metric("bloomgate_fleet_lease_changes_total{change=\"acquired\",filter=\"products\"}")
            .await,
        1.0
    );
}

/// A generation that Redis refuses to take (here the Redis user may not yet write the
/// chunk keys) is tried again while the instance builds, and goes out, to be loaded by
/// a follower, once Redis accepts it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_publication_is_tried_again_until_redis_accepts_it() {
    let (Some(server), Some(redis_bin)) = (mysql_url(), redis_server()) else {
        return;
    };
    let db = TestDb::create(&server, 1_000).await;
    let redis = TestRedis::start(&redis_bin).await;
    let mut admin = redis.conn().await;
    let f = "{retry}:filter:products";
    let _: () = redis::cmd("ACL")
        .arg("SETUSER")
        .arg("fleet")
        .arg("on")
        .arg(">pw")
        .arg("resetkeys")
        .arg("~{retry}:epoch")
        .arg("~{retry}:stream")
        .arg(format!("~{f}:lease"))
        .arg(format!("~{f}:fence"))
        .arg(format!("~{f}:gen_seq"))
        .arg(format!("~{f}:current"))
        .arg("+@all")
        .query_async(&mut admin)
        .await
        .expect("ACL SETUSER");
    let url = format!("redis://fleet:pw@127.0.0.1:{}", redis.port());
    let cfg = |id: &str| {
        config(&db, &redis, "retry", id, 2_000).toml().replace(
            &format!("redis_url = \"{}\"", redis.url()),
            &format!("redis_url = \"{url}\""),
        )
    };
    let a = TestProxy::spawn(&cfg("a")).await;
    ready(&a, Duration::from_secs(60)).await;
    // Three generation numbers drawn: three attempts, none of them current.
    eventually(
        "three publication attempts",
        Duration::from_secs(30),
        || {
            let mut admin = admin.clone();
            async move {
                let drawn: Option<u64> = admin.get(format!("{f}:gen_seq")).await.expect("GET");
                drawn.unwrap_or(0) >= 3
            }
        },
    )
    .await;
    let current: bool = admin.exists(format!("{f}:current")).await.expect("EXISTS");
    assert!(!current);
    assert_eq!(fleet_filter(&a).await["serving"], serde_json::Value::Null);

    let _: () = redis::cmd("ACL")
        .arg("SETUSER")
        .arg("fleet")
        .arg(format!("~{f}:gen:*"))
        .query_async(&mut admin)
        .await
        .expect("ACL SETUSER");
    on_all(
        &[&a],
        Duration::from_secs(30),
        "published",
        async |p: &TestProxy| fleet_filter(p).await["serving"]["generation"].is_u64(),
    )
    .await;
    let generation = fleet_filter(&a).await["serving"]["generation"].clone();
    let b = TestProxy::spawn(&cfg("b")).await;
    ready(&b, Duration::from_secs(60)).await;
    let loaded = fleet_filter(&b).await;
    assert_eq!(
        (&loaded["role"], &loaded["serving"]["generation"]),
        (&serde_json::json!("follower"), &generation),
        "{loaded}"
    );
    assert_eq!(
        b.get(&format!("/api/products/{}", demo_sku(9)))
            .await
            .status
            .as_u16(),
        200
    );
}

/// A rebuild asked for on a follower is sent to the builder, which scans and publishes;
/// the follower loads the result and never scans. While Redis is away, the instance that
/// goes on alone runs the rebuild asked of it itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rebuild_asked_of_a_follower_runs_on_the_builder_and_alone_runs_locally() {
    let (Some(server), Some(redis_bin)) = (mysql_url(), redis_server()) else {
        return;
    };
    let db = TestDb::create(&server, 1_000).await;
    let redis = TestRedis::start(&redis_bin).await;
    let cfg = |id: &str| {
        config(&db, &redis, "rebuild", id, 2_000)
            .fleet("command_timeout = \"300ms\"")
            .toml()
    };
    let a = TestProxy::spawn(&cfg("a")).await;
    ready(&a, Duration::from_secs(60)).await;
    let b = TestProxy::spawn(&cfg("b")).await;
    ready(&b, Duration::from_secs(60)).await;
    let loads = "bloomgate_filter_loads_total{filter=\"products\",result=\"ok\"}";
    let builds = async |p: &TestProxy| p.counter_or_zero(loads).await;
    assert_eq!((builds(&a).await, builds(&b).await), (1.0, 0.0));
    let generation = fleet_filter(&b).await["serving"]["generation"].as_u64();

    let r = b
        .admin_post("/admin/filters/products/rebuild", Some(TOKEN), "")
        .await;
    assert_eq!(r.status.as_u16(), 202, "{}", r.text());
    assert_eq!(r.json()["builder"], "a", "{}", r.text());
    on_all(
        &[&b],
        Duration::from_secs(30),
        "the rebuilt generation",
        async |p: &TestProxy| fleet_filter(p).await["serving"]["generation"].as_u64() > generation,
    )
    .await;
    assert_eq!((builds(&a).await, builds(&b).await), (2.0, 0.0));

    redis.freeze();
    on_all(
        &[&b],
        Duration::from_secs(30),
        "standalone",
        async |p: &TestProxy| fleet_filter(p).await["role"] == "standalone",
    )
    .await;
    let r = b
        .admin_post("/admin/filters/products/rebuild", Some(TOKEN), "")
        .await;
    assert_eq!(r.status.as_u16(), 202, "{}", r.text());
    assert_eq!(r.json()["builder"], serde_json::Value::Null, "{}", r.text());
    on_all(
        &[&b],
        Duration::from_secs(30),
        "a rebuild on the instance alone",
        async |p: &TestProxy| builds(p).await == 1.0,
    )
    .await;
    redis.thaw();
}

/// A follower that cannot send a rebuild request on (its Redis user may not append to the
/// stream) says so with 503 `fleet_unreachable`, rather than accepting a request that
/// nobody will run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rebuild_a_follower_cannot_send_on_is_refused_with_the_reason() {
    let (Some(server), Some(redis_bin)) = (mysql_url(), redis_server()) else {
        return;
    };
    let db = TestDb::create(&server, 1_000).await;
    let redis = TestRedis::start(&redis_bin).await;
    let mut admin = redis.conn().await;
    let _: () = redis::cmd("ACL")
        .arg(&["SETUSER", "reader", "on", ">pw", "~*", "+@all", "-xadd"])
        .query_async(&mut admin)
        .await
        .expect("ACL SETUSER");
    let a = TestProxy::spawn(&config(&db, &redis, "norebuild", "a", 2_000).toml()).await;
    ready(&a, Duration::from_secs(60)).await;
    let b_url = format!("redis://reader:pw@127.0.0.1:{}", redis.port());
    let b = TestProxy::spawn(
        &config(&db, &redis, "norebuild", "b", 2_000)
            .toml()
            .replace(&redis.url(), &b_url),
    )
    .await;
    ready(&b, Duration::from_secs(60)).await;
    assert_eq!(fleet_filter(&b).await["role"], "follower");
    let r = b
        .admin_post("/admin/filters/products/rebuild", Some(TOKEN), "")
        .await;
    assert_eq!(r.status.as_u16(), 503, "{}", r.text());
    assert_eq!(r.json()["error"], "fleet_unreachable", "{}", r.text());
    assert!(
        r.json()["message"]
            .as_str()
            .is_some_and(|m| m.to_lowercase().contains("noperm")),
        "{}",
        r.text()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn followers_refuse_a_corrupt_or_an_all_zero_generation_and_keep_serving() {
    corrupt_generations_refused(false).await;
}

/// The same on a Redis Cluster of three primaries.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_a_cluster_followers_refuse_a_corrupt_or_an_all_zero_generation() {
    corrupt_generations_refused(true).await;
}

async fn corrupt_generations_refused(cluster: bool) {
    let (Some(server), Some(redis_bin)) = (mysql_url(), redis_server()) else {
        return;
    };
    let db = TestDb::create(&server, 1_000).await;
    let redis = Backing::start(&redis_bin, cluster).await;
    let cfg = |id: &str| config_at(&db, &redis.url(), "bad", id, 2_000).toml();
    let a = TestProxy::spawn(&cfg("a")).await;
    ready(&a, Duration::from_secs(60)).await;
    let b = TestProxy::spawn(&cfg("b")).await;
    ready(&b, Duration::from_secs(60)).await;
    let mut conn = redis.conn();
    let current: std::collections::HashMap<String, String> = conn
        .hgetall("{bad}:filter:products:current")
        .await
        .expect("current");
    let generation: u64 = current["gen"].parse().expect("gen");
    let chunks: u64 = current["chunks"].parse().expect("chunks");
    let mut bytes = Vec::new();
    for i in 0..chunks {
        let part: Vec<u8> = conn
            .get(format!("{{bad}}:filter:products:gen:{generation}:{i}"))
            .await
            .expect("chunk");
        bytes.extend(part);
    }

    // 1. A flipped byte in the bit array: the checksum refuses it.
    let mut corrupt = bytes.clone();
    let mid = corrupt.len() / 2;
    corrupt[mid] ^= 0x40;
    let f = planted_and_refused(&b, &mut conn, 900, &corrupt, &current).await;
    assert!(
        f["last_refusal"]
            .as_str()
            .unwrap_or("")
            .contains("checksum"),
        "{f}"
    );

    // 2. A well-formed generation whose bits are all zero (checksum recomputed): the
    //    fill check refuses it.
    let f = planted_and_refused(&b, &mut conn, 901, &all_zero(&bytes), &current).await;
    assert!(
        f["last_refusal"]
            .as_str()
            .unwrap_or("")
            .contains("implausible"),
        "{f}"
    );
    // B still serves the generation it had: every present key passes its gate.
    assert_eq!(f["serving"]["generation"], generation, "{f}");
    for i in (0..1_000).step_by(37) {
        let r = b.get(&format!("/api/products/{}", demo_sku(i))).await;
        assert_eq!(r.status.as_u16(), 200);
    }
}

/// Plants generation `g` (see [`plant`]) in namespace `bad`, waits until `follower`
/// counts one more refused generation, and returns its fleet state then.
async fn planted_and_refused(
    follower: &TestProxy,
    conn: &mut RedisConn,
    g: u64,
    bytes: &[u8],
    like: &std::collections::HashMap<String, String>,
) -> serde_json::Value {
    let refused = async |p: &TestProxy| {
        p.counter_or_zero(
            "bloomgate_fleet_generations_total{filter=\"products\",result=\"refused\"}",
        )
        .await
    };
    let before = refused(follower).await;
    plant(conn, "bad", g, bytes, like).await;
    on_all(
        &[follower],
        Duration::from_secs(10),
        &format!("generation {g} refused"),
        async |p: &TestProxy| refused(p).await > before,
    )
    .await;
    fleet_filter(follower).await
}

/// Writes `bytes` as generation `g` of `ns`'s products filter and points `current` at it,
/// announcing it on the stream as a builder would (but without a lease: the test plays
/// an attacker or a faulty writer with access to Redis).
async fn plant(
    conn: &mut RedisConn,
    ns: &str,
    g: u64,
    bytes: &[u8],
    like: &std::collections::HashMap<String, String>,
) {
    let _: () = conn
        .set(format!("{{{ns}}}:filter:products:gen:{g}:0"), bytes)
        .await
        .expect("chunk");
    let at = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_millis() as u64;
    let fields: Vec<(&str, String)> = vec![
        ("gen", g.to_string()),
        ("chunks", "1".into()),
        ("bytes", bytes.len().to_string()),
        ("items", like["items"].clone()),
        ("start", like["start"].clone()),
        ("by", "intruder".into()),
        ("at", at.to_string()),
    ];
    let _: () = conn
        .hset_multiple(format!("{{{ns}}}:filter:products:current"), &fields)
        .await
        .expect("current");
    let _: String = redis::cmd("XADD")
        .arg(format!("{{{ns}}}:stream"))
        .arg("*")
        .arg(&[
            ("op", "gen"),
            ("f", "products"),
            ("g", &g.to_string()),
            ("src", "intruder"),
        ])
        .query_async(conn)
        .await
        .expect("announce");
}

/// The same snapshot with every bit of its array cleared and the checksum recomputed.
fn all_zero(snapshot: &[u8]) -> Vec<u8> {
    let header_len = u32::from_le_bytes(snapshot[12..16].try_into().expect("4 bytes")) as usize;
    let mut out = snapshot[..snapshot.len() - 4].to_vec();
    for b in &mut out[header_len..] {
        *b = 0;
    }
    let crc = crc32fast::hash(&out);
    out.extend_from_slice(&crc.to_le_bytes());
    out
}

/// Measurements for the documentation, not assertions of speed: the time for a follower
/// to load a large generation from Redis against the builder's full build from MariaDB,
/// in one run. `BLOOMGATE_FLEET_MEASURE_ROWS` sets the table size (default 10,000,000).
/// Run: `scripts/mariadb cargo test --release --test fleet -- --ignored --nocapture measure`
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a measurement: seeds a large table"]
async fn measure_generation_load_against_a_full_build() {
    let (Some(server), Some(redis_bin)) = (mysql_url(), redis_server()) else {
        return;
    };
    let rows: u64 = std::env::var("BLOOMGATE_FLEET_MEASURE_ROWS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10_000_000);
    // The proxies run in this process: their logs show where the time goes.
    let _ = tracing_subscriber::fmt()
        .with_env_filter("bloomgate=info")
        .with_writer(std::io::stderr)
        .try_init();
    let seeding = Instant::now();
    let db = TestDb::create_heavy(&server, rows).await;
    eprintln!("seeded {rows} rows in {:?}", seeding.elapsed());
    let redis = TestRedis::start(&redis_bin).await;
    let cfg = |id: &str| {
        config(&db, &redis, "big", id, rows)
            .database("acquire_timeout = \"60s\"")
            .toml()
            .replace("lease_ttl = \"2s\"", "lease_ttl = \"60s\"")
            .replace("lease_renew = \"500ms\"", "lease_renew = \"10s\"")
    };
    let started = Instant::now();
    let a = TestProxy::spawn(&cfg("a")).await;
    ready(&a, Duration::from_secs(900)).await;
    let built = started.elapsed();
    // Wait until the generation is published before starting the follower.
    on_all(
        &[&a],
        Duration::from_secs(300),
        "published",
        async |p: &TestProxy| {
            fleet_filter(p).await["serving"]["generation"]
                .as_u64()
                .is_some()
        },
    )
    .await;
    let published = started.elapsed();
    let f = fleet_filter(&a).await;
    let started = Instant::now();
    let b = TestProxy::spawn(&cfg("b")).await;
    ready(&b, Duration::from_secs(900)).await;
    let loaded = started.elapsed();
    eprintln!(
        "{rows} keys: builder start to ready (count + scan from MariaDB) {built:?}, to published {published:?} \
         ({} bytes); follower start to ready (load from Redis) {loaded:?}; ratio {:.1}x",
        f["serving"]["bytes"],
        built.as_secs_f64() / loaded.as_secs_f64()
    );
}

/// Cross-instance admission latency: an admin add-keys on A, then B asked until it
/// answers 200. Prints p50, p99 and max over 300 keys.
/// Run: `scripts/mariadb cargo test --release --test fleet -- --ignored --nocapture measure`
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a measurement"]
async fn measure_cross_instance_admission_latency() {
    let (Some(server), Some(redis_bin)) = (mysql_url(), redis_server()) else {
        return;
    };
    let db = TestDb::create(&server, 1_000).await;
    let redis = TestRedis::start(&redis_bin).await;
    let a = TestProxy::spawn(&config(&db, &redis, "lat", "a", 10_000).toml()).await;
    let b = TestProxy::spawn(&config(&db, &redis, "lat", "b", 10_000).toml()).await;
    for p in [&a, &b] {
        ready(p, Duration::from_secs(60)).await;
    }
    let mut took = Vec::new();
    for i in 0..300 {
        let key = demo_absent_sku(100_000 + i);
        db.insert_product(key).await;
        let r = a
            .admin_post(
                "/admin/filters/products/keys",
                Some(TOKEN),
                &key.to_string(),
            )
            .await;
        assert_eq!(r.status.as_u16(), 200);
        let t = Instant::now();
        loop {
            if b.get(&format!("/api/products/{key}")).await.status.as_u16() == 200 {
                break;
            }
            assert!(
                t.elapsed() < Duration::from_secs(10),
                "key {key} never reached B"
            );
        }
        took.push(t.elapsed());
    }
    took.sort();
    let at = |q: f64| took[((took.len() - 1) as f64 * q).round() as usize];
    eprintln!(
        "admission on A to 200 on B over {} keys: p50 {:?}, p99 {:?}, max {:?}",
        took.len(),
        at(0.5),
        at(0.99),
        took[took.len() - 1]
    );
}
