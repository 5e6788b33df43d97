//! The fleet on the Redis deployments operators run beyond one server, from real
//! processes on loopback: a Redis Cluster of three primaries and three replicas, and a
//! primary with a replica behind three Sentinels. Three bloomgate instances share one
//! filter held in Redis as well as locally; a primary is killed with SIGKILL under
//! reads, and its replica (promoted by the cluster, or by the Sentinels) takes over.
//! Throughout, no present key is refused; after it, one builder publishes generations
//! that every instance loads.

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bloomgate::db::{demo_absent_sku, demo_sku};
use bloomgate::gate::redis_held::{self, HeldKeys, Layout};
use redis::aio::ConnectionLike;
use support::topology::{TestCluster, TestSentinel};
use support::{
    TestConfig, TestDb, TestProxy, TestRoute, eventually, mysql_url, redis_server,
    refused_absent_key,
};

const TOKEN: &str = "test-admin-token";

/// The longest wait for a state the fleet reaches on its own: a bound on a hang.
const SETTLE: Duration = Duration::from_secs(60);

/// Instance `id` of a fleet in namespace `ns` at `redis_url`, its filter held in Redis
/// too in shards of 4 KiB (so that they spread over a cluster's primaries).
fn config(db: &TestDb, redis_url: &str, ns: &str, id: &str, expected: u64) -> TestConfig {
    TestConfig::new(&db.url)
        .admin_token(TOKEN)
        .expected_items(expected)
        .false_positive_rate(0.01)
        .filter("backend = \"redis\"")
        .filter("redis = { check_timeout = \"200ms\", shard_bytes = 4096 }")
        .cache("ttl = \"10m\"")
        .cache("negative_ttl = \"1s\"")
        .route(TestRoute::sql("products", "/api/products/{id}"))
        .fleet(format!("redis_url = \"{redis_url}\""))
        .fleet(format!("namespace = \"{ns}\""))
        .fleet(format!("instance_id = \"{id}\""))
        .fleet("lease_ttl = \"2s\"")
        .fleet("lease_renew = \"500ms\"")
        .fleet("retry_interval = \"100ms\"")
        .fleet("command_timeout = \"500ms\"")
}

/// The `/admin/fleet` entry of the `products` filter.
async fn fleet_filter(proxy: &TestProxy) -> serde_json::Value {
    proxy.admin_get("/admin/fleet").await.json()["filters"][0].clone()
}

/// Waits until exactly one instance is the builder and every other follows the
/// generation it serves; returns the builder's index and that generation.
async fn one_builder(proxies: &[&TestProxy]) -> (usize, u64) {
    let deadline = Instant::now() + SETTLE;
    loop {
        let mut builders = Vec::new();
        let mut generations = Vec::new();
        for (i, p) in proxies.iter().enumerate() {
            let f = fleet_filter(p).await;
            if f["role"] == "builder" {
                builders.push(i);
            }
            generations.push(f["serving"]["generation"].as_u64());
        }
        if let ([b], Some(Some(g))) = (&builders[..], generations.first())
            && generations.iter().all(|x| *x == Some(*g))
        {
            return (*b, *g);
        }
        assert!(
            Instant::now() < deadline,
            "no single builder followed by all: builders {builders:?}, generations {generations:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Asks `proxy` for present keys in a loop until `stop`; counts each refused one.
async fn read_present(
    proxy: Arc<TestProxy>,
    rows: u64,
    stop: Arc<AtomicBool>,
    refused: Arc<AtomicU64>,
    asked: Arc<AtomicU64>,
) {
    let mut i = 0;
    while !stop.load(Ordering::Relaxed) {
        let sku = demo_sku(i % rows);
        let r = proxy.get(&format!("/api/products/{sku}")).await;
        if r.status.as_u16() == 404 && r.stage() == "intercepted" {
            refused.fetch_add(1, Ordering::Relaxed);
            eprintln!("present key {sku} refused");
        }
        asked.fetch_add(1, Ordering::Relaxed);
        i += 7;
    }
}

/// Instances `ids` of a fleet in namespace `ns` at `url`, each ready (a filter loaded)
/// within `limit`.
async fn spawn_fleet(
    db: &TestDb,
    url: &str,
    ns: &str,
    ids: &[&str],
    rows: u64,
    limit: Duration,
) -> Vec<Arc<TestProxy>> {
    let mut proxies = Vec::new();
    for id in ids {
        proxies.push(Arc::new(
            TestProxy::spawn(&config(db, url, ns, id, 2 * rows).toml()).await,
        ));
    }
    for p in &proxies {
        p.wait_ready(limit).await;
    }
    proxies
}

/// [`read_present`] on each of a fleet's instances, until [`Readers::finish`].
struct Readers {
    stop: Arc<AtomicBool>,
    refused: Arc<AtomicU64>,
    asked: Arc<AtomicU64>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Readers {
    fn start(proxies: &[Arc<TestProxy>], rows: u64) -> Readers {
        let stop = Arc::new(AtomicBool::new(false));
        let refused = Arc::new(AtomicU64::new(0));
        let asked = Arc::new(AtomicU64::new(0));
        let tasks = proxies
            .iter()
            .map(|p| {
                tokio::spawn(read_present(
                    Arc::clone(p),
                    rows,
                    Arc::clone(&stop),
                    Arc::clone(&refused),
                    Arc::clone(&asked),
                ))
            })
            .collect();
        Readers {
            stop,
            refused,
            asked,
            tasks,
        }
    }

    /// Stops the readers; returns how many present keys were refused, of how many asked.
    async fn finish(self) -> (u64, u64) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.tasks {
            t.await.expect("reader");
        }
        (
            self.refused.load(Ordering::Relaxed),
            self.asked.load(Ordering::Relaxed),
        )
    }
}

/// Asks the builder `all[builder]` for a rebuild and waits until every instance follows
/// a generation numbered above `after`; returns it.
async fn rebuild_loaded_everywhere(all: &[&TestProxy], builder: usize, after: u64) -> u64 {
    let r = all[builder]
        .admin_post("/admin/filters/products/rebuild", Some(TOKEN), "")
        .await;
    assert_eq!(r.status.as_u16(), 202, "{}", r.text());
    let deadline = Instant::now() + SETTLE;
    loop {
        let (_, g) = one_builder(all).await;
        if g > after {
            return g;
        }
        assert!(Instant::now() < deadline, "no generation after {after}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The checks every topology passes: one scan, admissions everywhere, the copy in
/// Redis answering, a primary killed under reads with no present key refused, one
/// builder after it and a new generation loaded everywhere.
async fn a_fleet_survives_its_primary(
    db: &TestDb,
    url: &str,
    ns: &str,
    rows: u64,
    conn: &mut (impl ConnectionLike + Send),
    kill_primary: impl AsyncFnOnce(),
) {
    let proxies = spawn_fleet(
        db,
        url,
        ns,
        &["a", "b", "c"],
        rows,
        Duration::from_secs(120),
    )
    .await;
    let all: Vec<&TestProxy> = proxies.iter().map(|p| p.as_ref()).collect();
    // One scan: one instance built, the others loaded its generation.
    let loads = "bloomgate_filter_loads_total{filter=\"products\",result=\"ok\"}";
    let mut built = 0.0;
    for p in &all {
        built += p.counter_or_zero(loads).await;
    }
    assert_eq!(built, 1.0, "builds across the fleet");
    let (_, generation) = one_builder(&all).await;
    assert!(generation >= 1);

    // The copy in Redis is there and every instance asks it about refused keys.
    let keys = HeldKeys::new(ns, "products");
    let layout: Layout = eventually_layout(conn, &keys).await;
    assert!(layout.shards() > 1, "{layout:?}");
    for (i, p) in all.iter().enumerate() {
        // A key of its own for each instance, one its gate refuses.
        let absent = refused_absent_key(*p, "/api/products/", rows + 20 * i as u64).await;
        eventually(
            "a refusal answered by the copy in Redis",
            SETTLE,
            || async {
                let counter =
                    "bloomgate_filter_redis_checks_total{answer=\"absent\",filter=\"products\"}";
                let before = p.counter_or_zero(counter).await;
                let r = p.get(&format!("/api/products/{absent}")).await;
                r.status.as_u16() == 404 && p.counter_or_zero(counter).await > before
            },
        )
        .await;
    }

    // An admission on one instance reaches the others.
    let new_key = demo_absent_sku(rows + 11);
    db.insert_product(new_key).await;
    all[0].admit("products", TOKEN, &new_key.to_string()).await;
    for p in &all[1..] {
        eventually("the admitted key served", SETTLE, || async {
            p.get(&format!("/api/products/{new_key}"))
                .await
                .status
                .as_u16()
                == 200
        })
        .await;
    }

    // The primary dies under reads on every instance.
    let readers = Readers::start(&proxies, rows);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let killed = Instant::now();
    kill_primary().await;
    let promoted = killed.elapsed();
    // How long the fleet is without Redis: until an admission on one instance reaches
    // another again (each try a key of its own, admitted once).
    let mut tries = 0u64;
    let shared = loop {
        let key = demo_absent_sku(rows + 1_000 + tries);
        tries += 1;
        let path = format!("/api/products/{key}");
        // A key the other instance lets through already (a false positive) says nothing.
        if all[1].get(&path).await.stage() != "intercepted" {
            continue;
        }
        all[0].admit("products", TOKEN, &key.to_string()).await;
        let sent = Instant::now();
        let mut reached = false;
        while sent.elapsed() < Duration::from_millis(500) {
            if all[1].get(&path).await.stage() != "intercepted" {
                reached = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        if reached {
            break killed.elapsed();
        }
        assert!(
            killed.elapsed() < SETTLE,
            "no admission shared after the kill"
        );
    };
    eprintln!(
        "{ns}: replica promoted {promoted:?} after the kill; admissions shared again {shared:?} after it"
    );
    let (builder, after) = one_builder(&all).await;
    eprintln!(
        "{ns}: one builder ({builder}) serving generation {after} {:?} after the kill",
        killed.elapsed()
    );
    // Generations go on: a rebuild is published by the builder and loaded by all.
    let g = rebuild_loaded_everywhere(&all, builder, after).await;
    eprintln!("{ns}: generation {g} loaded everywhere");
    // The key admitted before the failover is still served everywhere.
    for p in &all {
        let r = p.get(&format!("/api/products/{new_key}")).await;
        assert_eq!(r.status.as_u16(), 200, "{new_key} after the failover");
    }
    let (refused, asked) = readers.finish().await;
    assert!(asked > 100, "only {asked} reads during the failover");
    assert_eq!(
        refused, 0,
        "present keys refused during the failover (of {asked} reads)"
    );
}

async fn eventually_layout(conn: &mut (impl ConnectionLike + Send), keys: &HeldKeys) -> Layout {
    let deadline = Instant::now() + SETTLE;
    loop {
        if let Ok(Some(l)) = redis_held::current(conn, keys).await {
            return l;
        }
        assert!(Instant::now() < deadline, "no Redis-held generation");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fleet_on_a_cluster_survives_the_failover_of_its_primary() {
    let (Some(server), Some(redis_bin)) = (mysql_url(), redis_server()) else {
        return;
    };
    let rows = 5_000;
    let db = TestDb::create(&server, rows).await;
    let mut cluster = TestCluster::start(&redis_bin).await;
    let mut conn = cluster.conn().await;
    let url = cluster.url();
    let ns = "cluster";

    // The fleet's keys share one slot; the shards of the copy in Redis spread over
    // the primaries.
    let fleet_node = cluster.primary_of("{cluster}:epoch").await;
    let keys = HeldKeys::new(ns, "products");
    let mut spread = std::collections::BTreeSet::new();
    for s in 0..32 {
        spread.insert(cluster.primary_of(&keys.shard(1, s)).await);
    }
    assert_eq!(spread.len(), 3, "32 shards on primaries {spread:?}");

    let cluster_ref = &mut cluster;
    a_fleet_survives_its_primary(&db, &url, ns, rows, &mut conn, async move || {
        cluster_ref.kill(fleet_node);
        let now = cluster_ref
            .wait_promoted(fleet_node, "{cluster}:epoch")
            .await;
        eprintln!("cluster: node {now} promoted in place of node {fleet_node}");
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fleet_behind_sentinel_survives_the_failover_of_its_primary() {
    let (Some(server), Some(redis_bin)) = (mysql_url(), redis_server()) else {
        return;
    };
    let rows = 5_000;
    let db = TestDb::create(&server, rows).await;
    let mut sentinel = TestSentinel::start(&redis_bin).await;
    let url = sentinel.url();
    let primary = sentinel.primary().await.expect("a primary");
    let mut conn = sentinel.nodes[primary].conn().await;
    let sentinel_ref = &mut sentinel;
    a_fleet_survives_its_primary(&db, &url, "sentinel", rows, &mut conn, async move || {
        sentinel_ref.nodes[primary].kill();
        let now = sentinel_ref.wait_promoted(primary).await;
        eprintln!("sentinel: node {now} promoted");
    })
    .await;
}

/// The fleet's slot moved to another primary under reads and admissions (the keys
/// moved a few at a time, so the instances meet `ASK` while the slot is half moved, then
/// `MOVED`): no present key refused, every admission made meanwhile reaches the other
/// instance, and a generation published after it is loaded by both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fleet_on_a_cluster_follows_its_slot_to_another_primary() {
    let (Some(server), Some(redis_bin)) = (mysql_url(), redis_server()) else {
        return;
    };
    let rows = 2_000;
    let db = TestDb::create(&server, rows).await;
    let cluster = TestCluster::start(&redis_bin).await;
    let url = cluster.url();
    let ns = "moving";
    let proxies = spawn_fleet(&db, &url, ns, &["a", "b"], rows, Duration::from_secs(60)).await;
    let all: Vec<&TestProxy> = proxies.iter().map(|p| p.as_ref()).collect();
    let (_, before) = one_builder(&all).await;
    let from = cluster.primary_of("{moving}:epoch").await;
    let to = (0..3).find(|&i| i != from).expect("another primary");

    let readers = Readers::start(&proxies, rows);
    // Admissions on `a` all through the move.
    let admitted = {
        let a = Arc::clone(&proxies[0]);
        let stop = Arc::clone(&readers.stop);
        tokio::spawn(async move {
            let mut keys = Vec::new();
            let mut n = 0;
            while !stop.load(Ordering::Relaxed) {
                let key = demo_absent_sku(rows + 100 + n);
                n += 1;
                a.admit("products", TOKEN, &key.to_string()).await;
                keys.push(key);
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            keys
        })
    };
    let moved = Instant::now();
    cluster
        .move_slot("{moving}:epoch", to, 2, Duration::from_millis(150))
        .await;
    assert_eq!(cluster.primary_of("{moving}:epoch").await, to);
    eprintln!(
        "moving: slot moved from node {from} to node {to} in {:?}",
        moved.elapsed()
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    let (refused, asked) = readers.finish().await;
    let keys = admitted.await.expect("admissions");
    assert!(keys.len() > 5, "{} admissions during the move", keys.len());
    for key in &keys {
        eventually(
            "an admission made during the move served on b",
            SETTLE,
            || async { all[1].get(&format!("/api/products/{key}")).await.stage() != "intercepted" },
        )
        .await;
    }
    let (builder, after) = one_builder(&all).await;
    rebuild_loaded_everywhere(&all, builder, after.max(before)).await;
    assert_eq!(
        refused, 0,
        "present keys refused during the move (of {asked} reads)"
    );
}
