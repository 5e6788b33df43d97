//! Entries past their TTL, against a real proxy and a real upstream written in the test:
//! served (`x-bloomgate: stale`, with `Age`) when the upstream fails within
//! `stale_if_error`, served at once while one background request refreshes them within
//! `stale_while_revalidate`, and never served stale where the upstream's `Cache-Control`
//! or the route forbids it (RFC 5861, RFC 9111 §4.2.4).

mod support;

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use bloomgate::db::demo_sku;
use support::{
    Reply, StubUpstream, TestConfig, TestDb, TestProxy, TestRoute, eventually, mysql_url,
};

fn path(sku: u64) -> String {
    format!("/api/products/{sku}")
}

/// The proxy's config, with the cache's `ttl`. An answer that must expire during a test
/// either lives by a `ttl` of 1 s or carries `Cache-Control: max-age=1`; one that must
/// still be fresh when the test reads it back lives by a `ttl` of an hour, so that no
/// pause of a loaded machine between storing and reading it can expire it first.
fn config(db: &TestDb, stub: &StubUpstream, route: TestRoute, ttl: &str) -> String {
    TestConfig::new(&db.url)
        .upstream(&stub.url())
        .expected_items(100)
        .false_positive_rate(0.001)
        .cache(format!("ttl = \"{ttl}\""))
        .route(route)
        .toml()
}

/// Asks for `sku` until it is no longer a fresh hit (its lifetime of about a second
/// ended); returns that reply.
async fn first_after_expiry(proxy: &TestProxy, sku: u64) -> Reply {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let r = proxy.get(&path(sku)).await;
        if r.stage() != "hit" {
            return r;
        }
        assert!(
            Instant::now() < deadline,
            "the entry of {sku} never expired"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_upstream_is_covered_by_stale_entries_only_where_the_rules_allow() {
    let Some(server) = mysql_url() else { return };
    let db = TestDb::create(&server, 100).await;
    let stub = StubUpstream::start((0..100).map(demo_sku)).await;
    let proxy = TestProxy::spawn_ready(&config(
        &db,
        &stub,
        TestRoute::upstream("products", "/api/products/{id}"),
        "1h",
    ))
    .await;
    // Each product cached with its own Cache-Control (each lives a second); whether it
    // may be served stale.
    let cases: [(&str, bool); 7] = [
        ("max-age=1", true),
        ("max-age=1, stale-if-error=0", false),
        ("max-age=1, must-revalidate", false),
        ("max-age=1, proxy-revalidate", false),
        ("s-maxage=1", false),
        ("max-age=1, must-revalidate, stale-if-error=3600", true),
        ("no-store", false),
    ];
    let mut bodies = Vec::new();
    for (i, (cc, _)) in cases.iter().enumerate() {
        stub.answer_with(&[("cache-control", cc)]);
        let r = proxy.get(&path(demo_sku(i as u64))).await;
        assert_eq!((r.status.as_u16(), r.stage()), (200, "miss"), "{cc}");
        bodies.push(r.body.clone());
    }
    stub.answer_with(&[]);
    stub.state.fail_with_500.store(true, Ordering::SeqCst);

    for (i, (cc, stale)) in cases.iter().enumerate() {
        let sku = demo_sku(i as u64);
        let r = first_after_expiry(&proxy, sku).await;
        if *stale {
            assert_eq!(
                (r.status.as_u16(), r.stage()),
                (200, "stale"),
                "{cc}: {}",
                r.text()
            );
            assert_eq!(r.body, bodies[i], "{cc}");
            let age: u64 = r.headers["age"]
                .to_str()
                .ok()
                .and_then(|a| a.parse().ok())
                .unwrap_or(0);
            assert!(age >= 1, "{cc}: Age {age}");
        } else {
            // 502 from the upstream's 500, or 503 once its breaker opened: an error,
            // never the old answer.
            assert!(
                matches!(r.status.as_u16(), 502 | 503) && r.stage() == "error",
                "{cc}: {} {}",
                r.status,
                r.text()
            );
        }
    }
    let served = proxy
        .metric("bloomgate_requests_total{outcome=\"stale\",route=\"products\"}")
        .await;
    assert!(served >= 2.0, "{served} stale answers counted");

    // The upstream is back: the next request refreshes the entry (no Cache-Control now:
    // it lives by the hour-long ttl), then it is a hit.
    stub.state.fail_with_500.store(false, Ordering::SeqCst);
    eventually("a fresh answer", Duration::from_secs(30), || async {
        let r = proxy.get(&path(demo_sku(0))).await;
        r.status.as_u16() == 200 && r.stage() == "miss"
    })
    .await;
    let r = proxy.get(&path(demo_sku(0))).await;
    assert_eq!((r.stage(), r.headers.get("age")), ("hit", None));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_route_can_turn_stale_if_error_off() {
    let Some(server) = mysql_url() else { return };
    let db = TestDb::create(&server, 100).await;
    let stub = StubUpstream::start((0..100).map(demo_sku)).await;
    let route =
        TestRoute::upstream("products", "/api/products/{id}").field("stale_if_error = \"0s\"");
    let proxy = TestProxy::spawn_ready(&config(&db, &stub, route, "1s")).await;
    let r = proxy.get(&path(demo_sku(1))).await;
    assert_eq!((r.status.as_u16(), r.stage()), (200, "miss"));
    stub.state.fail_with_500.store(true, Ordering::SeqCst);
    let r = first_after_expiry(&proxy, demo_sku(1)).await;
    assert_eq!(
        (r.status.as_u16(), r.stage()),
        (502, "error"),
        "{}",
        r.text()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn within_stale_while_revalidate_the_old_answer_goes_at_once_and_one_refresh_runs() {
    let Some(server) = mysql_url() else { return };
    let db = TestDb::create(&server, 100).await;
    let stub = StubUpstream::start((0..100).map(demo_sku)).await;
    let route = TestRoute::upstream("products", "/api/products/{id}")
        .field("stale_while_revalidate = \"1h\"");
    let proxy = TestProxy::spawn_ready(&config(&db, &stub, route, "1h")).await;
    let sku = demo_sku(2);
    // The first answer lives a second; the refreshed one, without Cache-Control, an hour:
    // it cannot expire before the test reads it back and set off a second refresh.
    stub.answer_with(&[("cache-control", "max-age=1")]);
    let r = proxy.get(&path(sku)).await;
    assert_eq!((r.status.as_u16(), r.stage()), (200, "miss"));
    stub.answer_with(&[]);
    let before = stub.hits();
    // The first request after expiry: the old answer, and a refresh behind it. The
    // upstream holds nothing, so the refresh may finish at any time: what follows is
    // either more stale answers (refresh still out) or a hit (refresh done).
    let r = first_after_expiry(&proxy, sku).await;
    assert_eq!(
        (r.status.as_u16(), r.stage()),
        (200, "stale"),
        "{}",
        r.text()
    );
    assert!(r.headers.contains_key("age"));
    eventually("the refreshed entry", Duration::from_secs(30), || async {
        proxy.get(&path(sku)).await.stage() == "hit"
    })
    .await;
    // One refresh, whatever number of stale answers went out meanwhile.
    assert_eq!(stub.hits() - before, 1);

    // An answer that must be revalidated is never served stale, not even here.
    let other = demo_sku(3);
    stub.answer_with(&[("cache-control", "max-age=1, must-revalidate")]);
    let r = proxy.get(&path(other)).await;
    assert_eq!(r.stage(), "miss");
    let r = first_after_expiry(&proxy, other).await;
    assert_eq!(
        (r.status.as_u16(), r.stage()),
        (200, "miss"),
        "{}",
        r.text()
    );
}
