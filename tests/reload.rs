//! Configuration reload, against the real binary, a real MariaDB and real signals: a new
//! file applies on SIGHUP and on `POST /admin/reload` while connections opened before it
//! go on serving; a bad file or one that needs a restart changes nothing and is counted;
//! cached answers follow their route by name, whatever its position in the file; and a
//! filter is rebuilt only when its sizing or source changed.

mod support;

use std::time::Duration;

use bloomgate::db::{demo_absent_sku, demo_sku};
use http::Method;
use serde_json::Value;
use support::binary::{Bloomgate, message};
use support::config::{TestConfig, TestRoute};
use support::observe::Scrape;
use support::tls::{Wire, WireClient, WireConn};
use support::{HttpClient, Reply, TestDb, mysql_url, refused_absent_key};

const TOKEN: &str = "reload-token";

/// A config on loopback port 0 with `routes`, admin token `token` and `edit` applied.
fn config(
    db: &TestDb,
    token: &str,
    routes: &[TestRoute],
    edit: impl Fn(TestConfig) -> TestConfig,
) -> String {
    let mut c = TestConfig::new(&db.url)
        .server("listen = \"127.0.0.1:0\"")
        .admin("listen = \"127.0.0.1:0\"")
        .admin_token(token)
        .expected_items(1_000);
    for r in routes {
        c = c.route(r.clone());
    }
    edit(c).toml()
}

async fn get(conn: &mut WireConn, path: &str) -> Reply {
    conn.send(Method::GET, path, &[], "").await.1
}

async fn scrape(bin: &Bloomgate) -> Scrape {
    Scrape::of(&HttpClient::new(), bin.admin).await
}

async fn admin(bin: &Bloomgate, method: Method, path: &str, token: Option<&str>) -> Reply {
    let auth = token.map(|t| format!("Bearer {t}"));
    let headers: Vec<(&str, &str)> = auth.iter().map(|a| ("authorization", a.as_str())).collect();
    HttpClient::new()
        .send(
            method,
            &format!("http://{}{path}", bin.admin),
            &headers,
            bytes::Bytes::new(),
        )
        .await
}

/// Sends SIGHUP and waits for the reload's outcome line (the `n`-th of its kind).
async fn sighup(bin: &mut Bloomgate, outcome: &str, n: usize) -> Value {
    bin.signal("HUP");
    bin.wait_for_logs(outcome, n, Duration::from_secs(30), |l| {
        message(l) == outcome
    })
    .await
    .remove(n - 1)
}

const APPLIED: &str = "configuration reloaded";
const REFUSED: &str = "configuration reload refused; the configuration in force keeps serving";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_applies_a_new_file_on_open_connections_and_a_bad_file_changes_nothing() {
    let Some(server) = mysql_url() else { return };
    let db = TestDb::create(&server, 200).await;
    let products = TestRoute::sql("products", "/api/products/{id}").field("ttl = \"10m\"");
    let first = config(&db, TOKEN, std::slice::from_ref(&products), |c| {
        c.database("max_in_flight = 4")
    });
    let mut bin = Bloomgate::serve(&first, &[]).await;
    bin.wait_for_log("the filter load", Duration::from_secs(60), |l| {
        message(l) == "filter loaded"
    })
    .await;
    let mut conn = WireClient::new(Wire::Http1, bin.data, None).connect().await;
    let kept = format!("/api/products/{}", demo_sku(1));
    assert_eq!(get(&mut conn, &kept).await.stage(), "miss");
    assert_eq!(get(&mut conn, &kept).await.stage(), "hit");
    let items = format!("/api/items/{}", demo_sku(2));

    // A second route, a 1 ms TTL on the first, a lower bound on the database, a new token.
    let second = config(
        &db,
        "rotated-token",
        &[
            TestRoute::sql("products", "/api/products/{id}").field("ttl = \"1ms\""),
            TestRoute::sql("items", "/api/items/{id}"),
        ],
        |c| c.database("max_in_flight = 2"),
    );
    bin.rewrite_config(&second);
    let applied = sighup(&mut bin, APPLIED, 1).await;
    assert!(
        applied["fields"]["changes"]
            .as_str()
            .is_some_and(|c| c.contains("2 routes")),
        "{applied}"
    );

    // The connection from before the reload serves the new file's routes.
    let r = get(&mut conn, &items).await;
    assert_eq!(
        (r.status.as_u16(), r.stage()),
        (200, "miss"),
        "{}",
        r.text()
    );
    assert_eq!(get(&mut conn, &items).await.stage(), "hit");
    // The route kept its name, so its entry stored under the old file is still served.
    assert_eq!(get(&mut conn, &kept).await.stage(), "hit");
    // The new TTL: an entry stored now is gone 1 ms later.
    let fresh = format!("/api/products/{}", demo_sku(3));
    assert_eq!(get(&mut conn, &fresh).await.stage(), "miss");
    tokio::time::sleep(Duration::from_millis(20)).await;
    assert_eq!(get(&mut conn, &fresh).await.stage(), "miss");
    let origins = admin(&bin, Method::GET, "/admin/origins", None)
        .await
        .json();
    assert_eq!(origins["origins"][0]["max_in_flight"], 2, "{origins}");
    let s = scrape(&bin).await;
    assert_eq!(
        s.value("bloomgate_config_reloads_total{result=\"ok\"}"),
        1.0
    );
    assert_eq!(s.value("bloomgate_config_last_reload_successful"), 1.0);
    // Nothing about the filter changed: no second build.
    assert_eq!(
        s.value("bloomgate_filter_loads_total{filter=\"products\",result=\"ok\"}"),
        1.0
    );

    // The token rotated with the file.
    let old = admin(&bin, Method::POST, "/admin/reload", Some(TOKEN)).await;
    assert_eq!(old.status.as_u16(), 401, "{}", old.text());

    // A file that breaks a rule: refused, counted, and the configuration in force serves.
    bin.rewrite_config(&second.replace("/api/items/{id}", "no pattern"));
    let refused = sighup(&mut bin, REFUSED, 1).await;
    let why = refused["fields"]["error"].as_str().unwrap_or_default();
    assert!(why.contains("routes[1].path"), "{refused}");
    assert_eq!(get(&mut conn, &items).await.stage(), "hit");
    let s = scrape(&bin).await;
    assert_eq!(
        s.value("bloomgate_config_reloads_total{result=\"invalid\"}"),
        1.0
    );
    assert_eq!(s.value("bloomgate_config_last_reload_successful"), 0.0);

    // Nor can a file that changes what only a restart applies; the admin call says which.
    bin.rewrite_config(&second.replace(
        "listen = \"127.0.0.1:0\"\n[admin]",
        "listen = \"127.0.0.1:0\"\nmax_connections = 3\n[admin]",
    ));
    let r = admin(&bin, Method::POST, "/admin/reload", Some("rotated-token")).await;
    assert_eq!(r.status.as_u16(), 409, "{}", r.text());
    assert_eq!(r.json()["error"], "needs_restart");
    assert_eq!(
        r.json()["fields"],
        serde_json::json!(["server.max_connections"])
    );

    // The file fixed: applied again by the admin call.
    bin.rewrite_config(&second);
    let r = admin(&bin, Method::POST, "/admin/reload", Some("rotated-token")).await;
    assert_eq!(r.status.as_u16(), 200, "{}", r.text());
    assert_eq!(r.json()["reloaded"], true);
    let s = scrape(&bin).await;
    assert_eq!(
        s.value("bloomgate_config_reloads_total{result=\"ok\"}"),
        2.0
    );
    assert_eq!(
        s.value("bloomgate_config_reloads_total{result=\"needs_restart\"}"),
        1.0
    );
    assert_eq!(s.value("bloomgate_config_last_reload_successful"), 1.0);
    // The same connection, through every reload.
    assert_eq!(get(&mut conn, &kept).await.status.as_u16(), 200);
    assert!(!conn.closed.is_finished());
}

/// A request that is waiting on its origin when the reload lands finishes as the file it
/// started under says; the next request on the same connection follows the new file.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_in_flight_during_a_reload_finishes_under_the_file_it_started_with() {
    let Some(server) = mysql_url() else { return };
    let db = TestDb::create(&server, 100).await;
    let stub = support::StubUpstream::start((0..100).map(demo_sku)).await;
    let file = |mode: &str| {
        let mode = mode.to_owned();
        let url = stub.url();
        config(
            &db,
            TOKEN,
            &[TestRoute::upstream("items", "/api/products/{id}").mode(&mode)],
            // Both absent keys below must be refused whatever the filter's random seed,
            // and none can be probed for: every request this test makes is counted. At
            // this rate a false positive among them comes once in 10^13 runs.
            move |c| c.upstream(&url).false_positive_rate(0.000_001),
        )
    };
    let mut bin = Bloomgate::serve(&file("shadow"), &[]).await;
    bin.wait_for_log("the filter load", Duration::from_secs(60), |l| {
        message(l) == "filter loaded"
    })
    .await;
    let mut conn = WireClient::new(Wire::Http1, bin.data, None).connect().await;
    // In shadow mode an absent key still goes to the upstream: hold its answer there.
    let (decided, release) = stub.hold_next_not_found();
    let held = format!("/api/products/{}", demo_absent_sku(3));
    let in_flight = tokio::spawn(async move {
        let r = get(&mut conn, &held).await;
        (conn, r)
    });
    tokio::time::timeout(Duration::from_secs(30), decided)
        .await
        .expect("the upstream has the request within 30 s")
        .expect("the upstream decided");

    bin.rewrite_config(&file("enforce"));
    sighup(&mut bin, APPLIED, 1).await;
    release.send(()).expect("release the answer");
    let (mut conn, r) = in_flight.await.expect("the request task");
    assert_eq!(r.status.as_u16(), 404, "{}", r.text());
    let s = scrape(&bin).await;
    assert_eq!(
        s.value("bloomgate_requests_total{outcome=\"would_intercept\",route=\"items\"}"),
        1.0,
        "counted as the shadow route it started on"
    );
    // The same connection, the new file: refused at the gate.
    let next = format!("/api/products/{}", demo_absent_sku(4));
    assert_eq!(get(&mut conn, &next).await.stage(), "intercepted");
    assert_eq!(stub.hits(), 1, "only the held request reached the upstream");
}

/// Two routes over the same keys with different answers. With entries keyed by position,
/// swapping them in the file would serve each one's answers for the other.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cached_answers_follow_their_route_by_name_wherever_it_is_written() {
    let Some(server) = mysql_url() else { return };
    let db = TestDb::create(&server, 100).await;
    let a = TestRoute::sql("a", "/a/{id}")
        .lookup("SELECT sku_id, 'from a' AS src FROM products WHERE sku_id = ?");
    let b = TestRoute::sql("b", "/b/{id}")
        .lookup("SELECT sku_id, 'from b' AS src FROM products WHERE sku_id = ?");
    let mut bin = Bloomgate::serve(&config(&db, TOKEN, &[a.clone(), b.clone()], |c| c), &[]).await;
    bin.wait_for_log("the filter load", Duration::from_secs(60), |l| {
        message(l) == "filter loaded"
    })
    .await;
    let mut conn = WireClient::new(Wire::Http1, bin.data, None).connect().await;
    let key = demo_sku(5);
    for route in ["a", "b"] {
        let r = get(&mut conn, &format!("/{route}/{key}")).await;
        assert_eq!(r.stage(), "miss");
        assert!(r.text().contains(&format!("from {route}")), "{}", r.text());
    }

    bin.rewrite_config(&config(&db, TOKEN, &[b.clone(), a.clone()], |c| c));
    sighup(&mut bin, APPLIED, 1).await;
    for route in ["a", "b"] {
        let r = get(&mut conn, &format!("/{route}/{key}")).await;
        assert_eq!(r.stage(), "hit", "{route}");
        assert!(
            r.text().contains(&format!("from {route}")),
            "/{route} served {}",
            r.text()
        );
    }

    // Route a now asks another query: nothing cached for its old form is served.
    let a2 = TestRoute::sql("a", "/a/{id}")
        .lookup("SELECT sku_id, 'from a, again' AS src FROM products WHERE sku_id = ?");
    bin.rewrite_config(&config(&db, TOKEN, &[b, a2], |c| c));
    sighup(&mut bin, APPLIED, 2).await;
    let r = get(&mut conn, &format!("/a/{key}")).await;
    assert_eq!(r.stage(), "miss");
    assert!(r.text().contains("from a, again"), "{}", r.text());
    assert_eq!(get(&mut conn, &format!("/b/{key}")).await.stage(), "hit");
}

/// Scrapes until the `products` filter has had `n` successful sync polls; fails after 30 s.
async fn wait_for_polls(bin: &Bloomgate, n: f64) {
    let polls = "bloomgate_filter_sync_polls_total{filter=\"products\",result=\"ok\"}";
    support::assert_exported_family(polls);
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while scrape(bin).await.get(polls).unwrap_or(0.0) < n {
        assert!(
            std::time::Instant::now() < deadline,
            "fewer than {n} sync polls"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Scrapes until the `products` filter has had `n` successful builds; fails after 60 s.
async fn wait_for_loads(bin: &Bloomgate, n: f64) -> Scrape {
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        let s = scrape(bin).await;
        let loads = s.value("bloomgate_filter_loads_total{filter=\"products\",result=\"ok\"}");
        assert!(loads <= n, "{loads} builds, more than {n}");
        if loads == n {
            return s;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{loads} builds, not {n}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_filter_is_rebuilt_only_when_its_sizing_or_source_changes() {
    let Some(server) = mysql_url() else { return };
    let db = TestDb::create(&server, 300).await;
    let route = || TestRoute::sql("products", "/api/products/{id}");
    let base = |ttl: &str, items: u64, source: &str| {
        let source = source.to_owned();
        let ttl = ttl.to_owned();
        config(
            &db,
            TOKEN,
            &[route().field(format!("ttl = \"{ttl}\""))],
            // The absent key below must be refused by each filter built in turn, each
            // with a random seed of its own: at this rate it is a false positive of one
            // of them once in 10^10 runs.
            move |c| {
                c.expected_items(items)
                    .source_query(&source)
                    .false_positive_rate(0.000_001)
            },
        )
    };
    let all = "SELECT sku_id FROM products";
    let mut bin = Bloomgate::serve(&base("10m", 1_000, all), &[]).await;
    bin.wait_for_log("the filter load", Duration::from_secs(60), |l| {
        message(l) == "filter loaded"
    })
    .await;
    let loads =
        |s: &Scrape| s.value("bloomgate_filter_loads_total{filter=\"products\",result=\"ok\"}");
    let reload = |bin: &Bloomgate| {
        let admin = bin.admin;
        async move {
            let r = HttpClient::new()
                .send(
                    Method::POST,
                    &format!("http://{admin}/admin/reload"),
                    &[("authorization", "Bearer reload-token")],
                    bytes::Bytes::new(),
                )
                .await;
            assert_eq!(r.status.as_u16(), 200, "{}", r.text());
            r.json()
        }
    };
    let mut conn = WireClient::new(Wire::Http1, bin.data, None).connect().await;
    let absent = format!("/api/products/{}", demo_absent_sku(1));
    assert_eq!(get(&mut conn, &absent).await.stage(), "intercepted");

    // A TTL: the filter stays as built.
    bin.rewrite_config(&base("5m", 1_000, all));
    let r = reload(&bin).await;
    assert!(!r["changes"].to_string().contains("filter"), "{r}");
    assert_eq!(loads(&scrape(&bin).await), 1.0);

    // Sync switched on: a build records where it starts (the filter in force serves
    // meanwhile), then it polls.
    let synced = |interval: &str| {
        base("5m", 1_000, all).replace(
            "[[routes]]",
            &format!(
                "[filters.products.sync]\nquery = \"{}\"\ninterval = \"{interval}\"\n[[routes]]",
                support::SYNC_QUERY
            ),
        )
    };
    bin.rewrite_config(&synced("100ms"));
    let r = reload(&bin).await;
    assert!(r["changes"].to_string().contains("rebuilding"), "{r}");
    assert_eq!(get(&mut conn, &absent).await.stage(), "intercepted");
    wait_for_loads(&bin, 2.0).await;
    wait_for_polls(&bin, 2.0).await;
    // Another interval: the sync loop starts over with it, and nothing is rebuilt.
    bin.rewrite_config(&synced("50ms"));
    let r = reload(&bin).await;
    assert!(r["changes"].to_string().contains("no rebuild"), "{r}");
    bin.wait_for_log("the sync restart", Duration::from_secs(30), |l| {
        message(l) == "sync settings reloaded"
    })
    .await;
    let so_far = scrape(&bin)
        .await
        .value("bloomgate_filter_sync_polls_total{filter=\"products\",result=\"ok\"}");
    wait_for_polls(&bin, so_far + 2.0).await;
    assert_eq!(loads(&scrape(&bin).await), 2.0);

    // A new size: rebuilt at it, while the filter in force goes on refusing.
    bin.rewrite_config(&synced("50ms").replace("expected_items = 1000", "expected_items = 50000"));
    let r = reload(&bin).await;
    assert!(r["changes"].to_string().contains("rebuilding"), "{r}");
    assert_eq!(get(&mut conn, &absent).await.stage(), "intercepted");
    let s = wait_for_loads(&bin, 3.0).await;
    assert_eq!(
        s.value("bloomgate_filter_capacity{filter=\"products\"}"),
        50_000.0
    );

    // A new source: the first 100 keys only. Built from it; a key it leaves out is
    // refused from then on, one it holds is served.
    let some = format!("{all} WHERE sku_id <= {}", demo_sku(99));
    bin.rewrite_config(&base("5m", 50_000, &some));
    let r = reload(&bin).await;
    assert!(r["changes"].to_string().contains("new source"), "{r}");
    wait_for_loads(&bin, 4.0).await;
    let left_out = format!("/api/products/{}", demo_sku(250));
    assert_eq!(get(&mut conn, &left_out).await.stage(), "intercepted");
    let held = format!("/api/products/{}", demo_sku(50));
    assert_eq!(get(&mut conn, &held).await.status.as_u16(), 200);
}

/// `/admin/fleet`'s entry of the `products` filter on the instance at `admin`.
async fn fleet_member(admin: std::net::SocketAddr) -> Value {
    let r = HttpClient::new()
        .send(
            Method::GET,
            &format!("http://{admin}/admin/fleet"),
            &[],
            bytes::Bytes::new(),
        )
        .await;
    r.json()["filters"][0].clone()
}

async fn post_reload(admin: std::net::SocketAddr) -> Reply {
    HttpClient::new()
        .send(
            Method::POST,
            &format!("http://{admin}/admin/reload"),
            &[("authorization", "Bearer reload-token")],
            bytes::Bytes::new(),
        )
        .await
}

/// Polls `check` on the fleet entry at `admin` every 20 ms for up to 60 s.
async fn wait_member(
    admin: std::net::SocketAddr,
    what: &str,
    check: impl Fn(&Value) -> bool,
) -> Value {
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        let m = fleet_member(admin).await;
        if check(&m) {
            return m;
        }
        assert!(std::time::Instant::now() < deadline, "{what}: {m}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// In a fleet, a new size is the builder's to act on: a follower's reload records it and
/// keeps the generation it serves; the builder's reload rebuilds and publishes at the new
/// size, which the follower then loads. A new source is refused by reload.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_a_fleet_the_builder_acts_on_a_new_size_and_a_new_source_needs_a_restart() {
    let (Some(server), Some(redis_bin)) = (mysql_url(), support::redis_server()) else {
        return;
    };
    let db = TestDb::create(&server, 300).await;
    let redis = support::TestRedis::start(&redis_bin).await;
    let fleet_config = |id: &str, items: u64, source: &str| {
        let (id, source) = (id.to_owned(), source.to_owned());
        let url = redis.url();
        config(
            &db,
            TOKEN,
            &[TestRoute::sql("products", "/api/products/{id}")],
            move |c| {
                c.expected_items(items)
                    .source_query(&source)
                    .sync_query(support::SYNC_QUERY)
                    .sync("interval = \"200ms\"")
                    .fleet(format!("redis_url = \"{url}\""))
                    .fleet("namespace = \"reload\"")
                    .fleet(format!("instance_id = \"{id}\""))
                    .fleet("lease_ttl = \"2s\"")
                    .fleet("lease_renew = \"500ms\"")
                    .fleet("retry_interval = \"100ms\"")
            },
        )
    };
    let all = "SELECT sku_id FROM products";
    let a = Bloomgate::serve(&fleet_config("a", 1_000, all), &[]).await;
    let first = wait_member(a.admin, "a builds the first generation", |m| {
        m["role"] == "builder" && m["serving"]["generation"].is_u64()
    })
    .await;
    let b = Bloomgate::serve(&fleet_config("b", 1_000, all), &[]).await;
    let generation = first["serving"]["generation"].as_u64().unwrap_or_default();
    wait_member(b.admin, "b follows", |m| {
        m["role"] == "follower" && m["serving"]["generation"] == generation
    })
    .await;

    // A new source: refused on either instance, nothing changes.
    b.rewrite_config(&fleet_config(
        "b",
        1_000,
        &format!("{all} WHERE sku_id > 0"),
    ));
    let r = post_reload(b.admin).await;
    assert_eq!(r.status.as_u16(), 409, "{}", r.text());
    assert_eq!(
        r.json()["fields"],
        serde_json::json!(["filters.products (its source, in fleet mode)"])
    );

    // A new size, follower first: recorded, and the generation it serves stays.
    b.rewrite_config(&fleet_config("b", 20_000, all));
    let r = post_reload(b.admin).await;
    assert_eq!(r.status.as_u16(), 200, "{}", r.text());
    let capacity = |admin| async move {
        Scrape::of(&HttpClient::new(), admin)
            .await
            .value("bloomgate_filter_capacity{filter=\"products\"}")
    };
    let at_b = fleet_member(b.admin).await;
    assert_eq!(at_b["serving"]["generation"], generation, "{at_b}");
    assert_eq!(capacity(b.admin).await, 1_000.0);
    let absent = format!(
        "/api/products/{}",
        refused_absent_key(&b, "/api/products/", 7).await
    );
    let mut conn = WireClient::new(Wire::Http1, b.data, None).connect().await;
    assert_eq!(get(&mut conn, &absent).await.stage(), "intercepted");

    // Then the builder: it rebuilds at the new size and publishes; b loads it.
    a.rewrite_config(&fleet_config("a", 20_000, all));
    let r = post_reload(a.admin).await;
    assert_eq!(r.status.as_u16(), 200, "{}", r.text());
    let next = wait_member(b.admin, "b loads the new generation", |m| {
        m["serving"]["generation"].as_u64() > Some(generation)
    })
    .await;
    assert_eq!(capacity(b.admin).await, 20_000.0, "{next}");
    assert_eq!(capacity(a.admin).await, 20_000.0);
    assert_eq!(get(&mut conn, &absent).await.stage(), "intercepted");
    let held = format!("/api/products/{}", demo_sku(42));
    assert_eq!(get(&mut conn, &held).await.status.as_u16(), 200);
}
