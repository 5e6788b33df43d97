//! The response cache as docs/configuration.md tells it: a route's `ttl` and
//! `negative_ttl` override the cache's for that route alone, and `max_entries` and
//! `negative_max_entries` bound the two kinds of entries separately, so a flood of absent
//! keys cannot push found keys out. A real proxy in front of a real upstream that counts
//! its hits, with the filter read from a real MariaDB.

mod support;

use std::sync::Arc;
use std::time::{Duration, Instant};

use bloomgate::db::demo_sku;
use support::{
    StubUpstream, TestConfig, TestDb, TestProxy, TestRoute, concurrently, eventually, mysql_url,
};

/// Products in the database, and so in the filter.
const PRODUCTS: u64 = 2_000;
/// The upstream has the first `SERVED`; the others pass the gate and are then not found
/// (a false positive on demand).
const SERVED: u64 = 1_000;

struct Rig {
    _db: TestDb,
    stub: StubUpstream,
    proxy: TestProxy,
}

async fn rig(config: impl FnOnce(TestConfig) -> TestConfig) -> Option<Rig> {
    let server = mysql_url()?;
    let db = TestDb::create(&server, PRODUCTS).await;
    let stub = StubUpstream::start((0..SERVED).map(demo_sku)).await;
    let base = TestConfig::new(&db.url)
        .upstream(&stub.url())
        .expected_items(PRODUCTS);
    let proxy = TestProxy::spawn_ready(&config(base).toml()).await;
    Some(Rig {
        _db: db,
        stub,
        proxy,
    })
}

/// How many requests for `path_and_query` reached the upstream.
fn upstream_hits(stub: &StubUpstream, path_and_query: &str) -> usize {
    stub.requests()
        .iter()
        .filter(|r| r.as_str() == path_and_query)
        .count()
}

/// The short route's TTL.
const SHORT: Duration = Duration::from_secs(2);

/// The paths of `key` on the short route (`ttl` and `negative_ttl` of 2 s) and on the
/// long one (the cache's 1 h).
fn short(key: u64) -> String {
    format!("/api/products/{key}")
}

fn long(key: u64) -> String {
    format!("/api/product/info?sku_id={key}")
}

/// Caches `found` and `absent` on both routes (each request a miss that reaches the
/// upstream) and reads the four entries back. Every read back must be a hit, except
/// on the short route once `SHORT` has passed since the first request (a loaded
/// machine can take that long): then the entries may be gone, and this returns `None`
/// for the caller to try again with other keys. Otherwise it returns when the first
/// request was sent, which no entry was stored before.
async fn cache_and_read_back(rig: &Rig, found: u64, absent: u64) -> Option<Instant> {
    let (proxy, stub) = (&rig.proxy, &rig.stub);
    let hits_before = stub.hits();
    let cached_at = Instant::now();
    for (path, status) in [
        (short(found), 200),
        (long(found), 200),
        (short(absent), 404),
        (long(absent), 404),
    ] {
        let r = proxy.get(&path).await;
        assert_eq!((r.status.as_u16(), r.stage()), (status, "miss"), "{path}");
    }
    for (path, status, stage, expires) in [
        (short(found), 200, "hit", true),
        (long(found), 200, "hit", false),
        (short(absent), 404, "negative-hit", true),
        (long(absent), 404, "negative-hit", false),
    ] {
        let r = proxy.get(&path).await;
        // Read once the answer is in: the entry was looked up before now.
        let within_ttl = cached_at.elapsed() < SHORT;
        if expires && !within_ttl && r.stage() == "miss" {
            return None;
        }
        assert_eq!((r.status.as_u16(), r.stage()), (status, stage), "{path}");
    }
    assert_eq!(stub.hits() - hits_before, 4);
    Some(cached_at)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_routes_ttls_override_the_cache_defaults_for_that_route_only() {
    let Some(rig) = rig(|c| {
        c.cache("ttl = \"1h\"")
            .cache("negative_ttl = \"1h\"")
            .route(
                TestRoute::upstream("short", "/api/products/{id}")
                    .field("ttl = \"2s\"")
                    .field("negative_ttl = \"2s\""),
            )
            .route(TestRoute::upstream("long", "/api/product/info").query_key("sku_id"))
    })
    .await
    else {
        return;
    };
    let (proxy, stub) = (&rig.proxy, &rig.stub);

    // Cached and read back within the short TTL: on a machine so loaded that the reads
    // back came too late, again with the next keys.
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut attempt = 0;
    let (found, absent, cached_at) = loop {
        let (found, absent) = (demo_sku(1 + attempt), demo_sku(SERVED + 1 + attempt));
        if let Some(at) = cache_and_read_back(&rig, found, absent).await {
            break (found, absent, at);
        }
        attempt += 1;
        assert!(
            Instant::now() < deadline,
            "no read back within the short route's TTL of {SHORT:?} in {attempt} attempts"
        );
    };

    // The short route's entries expire after its own TTL: the next request of each goes
    // to the upstream again (reads do not extend an entry's life).
    for (path, status) in [(short(found), 200), (short(absent), 404)] {
        let p = path.as_str();
        eventually(
            &format!("{p} expired"),
            Duration::from_secs(30),
            || async move {
                let r = proxy.get(p).await;
                assert_eq!(r.status.as_u16(), status, "{p}");
                r.stage() == "miss"
            },
        )
        .await;
        assert!(
            cached_at.elapsed() >= SHORT,
            "{path} expired after {:?}, before its route's ttl",
            cached_at.elapsed()
        );
        assert_eq!(upstream_hits(stub, &path), 2, "{path}");
    }
    // The other route, on the same keys, still answers from the cache under cache.ttl.
    let r = proxy.get(&long(found)).await;
    assert_eq!((r.status.as_u16(), r.stage()), (200, "hit"));
    let r = proxy.get(&long(absent)).await;
    assert_eq!((r.status.as_u16(), r.stage()), (404, "negative-hit"));
    assert_eq!(upstream_hits(stub, &long(found)), 1);
    assert_eq!(upstream_hits(stub, &long(absent)), 1);
}

/// One `kind` of a cache gauge family; each scrape runs the cache's pending
/// maintenance first.
async fn gauge(proxy: &TestProxy, family: &str, kind: &str) -> f64 {
    proxy
        .scrape()
        .await
        .value(&format!("{family}{{kind=\"{kind}\"}}"))
}

/// Asks for every key, 16 at a time; each must answer `status`.
async fn get_all(proxy: &Arc<TestProxy>, keys: Vec<u64>, status: u16) {
    let proxy = Arc::clone(proxy);
    let answers = concurrently(keys, 16, move |k| {
        let proxy = Arc::clone(&proxy);
        async move { proxy.get(&format!("/api/products/{k}")).await.status }
    })
    .await;
    assert!(answers.iter().all(|s| s.as_u16() == status), "{answers:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_entries_bounds_each_kind_of_entry_separately() {
    const MAX: f64 = 100.0;
    const NEGATIVE_MAX: f64 = 50.0;
    let Some(rig) = rig(|c| {
        c.cache("max_entries = 100")
            .cache("negative_max_entries = 50")
            .route(TestRoute::upstream("products", "/api/products/{id}"))
    })
    .await
    else {
        return;
    };
    let proxy = Arc::new(rig.proxy);
    let entries = |kind: &'static str| gauge(&proxy, "bloomgate_cache_entries", kind);
    let get_all = |keys: Vec<u64>, status: u16| get_all(&proxy, keys, status);

    // Ten times the bound of found keys.
    get_all((0..SERVED).map(demo_sku).collect(), 200).await;
    let positive = entries("positive").await;
    assert!(
        positive > 0.0 && positive <= MAX,
        "{positive} positive entries"
    );
    assert_eq!(entries("negative").await, 0.0);

    // Found keys cached now stay cached through a flood of absent keys. (The cache
    // admits by frequency when it is full, at its maintenance: a key asked for again
    // soon gets in. Each scrape runs the maintenance.)
    let kept = demo_sku(0);
    let mut cached = false;
    for _ in 0..10 {
        proxy.get(&format!("/api/products/{kept}")).await;
        entries("positive").await;
        cached = proxy.get(&format!("/api/products/{kept}")).await.stage() == "hit";
        if cached {
            break;
        }
    }
    assert!(cached, "{kept} never cached");
    let before = entries("positive").await;

    // Twenty times the bound of absent keys.
    get_all((SERVED..PRODUCTS).map(demo_sku).collect(), 404).await;
    let negative = entries("negative").await;
    assert!(
        negative > 0.0 && negative <= NEGATIVE_MAX,
        "{negative} negative entries"
    );
    assert_eq!(entries("positive").await, before);
    let r = proxy.get(&format!("/api/products/{kept}")).await;
    assert_eq!((r.status.as_u16(), r.stage()), (200, "hit"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_bytes_bounds_the_estimated_bytes_of_each_kind() {
    use bloomgate::cache::{NEGATIVE_ENTRY_OVERHEAD, POSITIVE_ENTRY_OVERHEAD};
    const MAX_BYTES: f64 = 65_536.0;
    // The negative cache also has an entry bound, lower than its bytes allow.
    const NEGATIVE_MAX: f64 = 60.0;
    let Some(rig) = rig(|c| {
        c.cache("max_bytes = 65536")
            .cache("negative_max_bytes = 65536")
            .cache("negative_max_entries = 60")
            .route(TestRoute::upstream("products", "/api/products/{id}"))
    })
    .await
    else {
        return;
    };
    let proxy = Arc::new(rig.proxy);
    let gauge = |family: &'static str, kind: &'static str| gauge(&proxy, family, kind);
    let get_all = |keys: Vec<u64>, status: u16| get_all(&proxy, keys, status);

    // Found keys worth far more than the bound: every entry weighs at least its
    // overhead, so the count is bounded too.
    get_all((0..SERVED).map(demo_sku).collect(), 200).await;
    let bytes = gauge("bloomgate_cache_bytes", "positive").await;
    let entries = gauge("bloomgate_cache_entries", "positive").await;
    assert!(bytes > 0.0 && bytes <= MAX_BYTES, "{bytes} bytes");
    assert!(
        entries > 0.0 && entries <= MAX_BYTES / POSITIVE_ENTRY_OVERHEAD as f64,
        "{entries} positive entries in {bytes} bytes"
    );

    // Absent keys: the entry bound binds before the byte bound, and the gauge reads
    // no more than the byte bound.
    get_all((SERVED..PRODUCTS).map(demo_sku).collect(), 404).await;
    let negative = gauge("bloomgate_cache_entries", "negative").await;
    let negative_bytes = gauge("bloomgate_cache_bytes", "negative").await;
    assert!(
        negative > 0.0 && negative <= NEGATIVE_MAX,
        "{negative} negative entries"
    );
    assert!(
        negative_bytes >= negative * NEGATIVE_ENTRY_OVERHEAD as f64 && negative_bytes <= MAX_BYTES,
        "{negative_bytes} bytes for {negative} negative entries"
    );
    assert_eq!(gauge("bloomgate_cache_bytes", "positive").await, bytes);
}
