//! Fleet failover against real processes: three `bloomgate` binaries, one throwaway
//! Redis and one MariaDB database per test. The builder is killed with SIGKILL while
//! keys are being written and read; Redis is killed with SIGKILL under traffic and
//! brought back empty. Throughout, no instance refuses a key it has already served or
//! admitted; every key seen on one instance reaches the others, and every committed key
//! is served everywhere.
//!
//! Reaching the others and being served everywhere are waited for, not timed: a
//! deadline ([`SETTLE`]) only bounds a hang. How long they take is measured by
//! `tests/fleet.rs` (`measure_cross_instance_admission_latency`) and
//! `tests/coherence.rs` (`measure_update_to_fresh_row_latency_in_a_fleet`), reported in
//! docs/BENCHMARKS.md (Fleet mode); this test prints the longest it saw, and the
//! failover times.

mod support;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bloomgate::db::demo_sku;
use bytes::Bytes;
use http::Method;
use serde_json::Value;
use support::binary::Bloomgate;
use support::topology::Backing;
use support::{
    HttpClient, SYNC_QUERY, TestConfig, TestDb, TestRoute, assert_exported_family, concurrently,
    mysql_url, redis_server, series_value,
};
use tokio::sync::watch;

const TOKEN: &str = "test-admin-token";

/// First key the writers create: above every demo key.
const NEW_KEYS_FROM: u64 = 10_000_000;

/// The longest wait for a state the fleet reaches on its own (a new builder, keys served
/// everywhere, an outage noticed): a bound on a hang on a loaded machine, not a
/// latency claim.
const SETTLE: Duration = Duration::from_secs(60);

/// The config of instance `id`: a synced filter and short fleet timings.
fn config(db: &TestDb, redis_url: &str, ns: &str, id: &str, expected: u64) -> String {
    TestConfig::new(&db.url)
        .server("listen = \"127.0.0.1:0\"")
        .admin("listen = \"127.0.0.1:0\"")
        .admin_token(TOKEN)
        .database("max_connections = 16")
        .expected_items(expected)
        .false_positive_rate(0.001)
        .cache("negative_ttl = \"1s\"")
        .route(TestRoute::sql("products", "/api/products/{id}").origin_timeout("10s"))
        .sync_query(SYNC_QUERY)
        .sync("interval = \"200ms\"")
        .sync("overlap = \"2s\"")
        .fleet(format!("redis_url = \"{redis_url}\""))
        .fleet(format!("namespace = \"{ns}\""))
        .fleet(format!("instance_id = \"{id}\""))
        .fleet("lease_ttl = \"2s\"")
        .fleet("lease_renew = \"500ms\"")
        .fleet("retry_interval = \"100ms\"")
        .toml()
}

/// The addresses of one running instance.
#[derive(Clone, Copy)]
struct Node {
    data: SocketAddr,
    admin: SocketAddr,
}

impl Node {
    fn of(bin: &Bloomgate) -> Node {
        Node {
            data: bin.data,
            admin: bin.admin,
        }
    }

    async fn admin_get(&self, client: &HttpClient, path: &str) -> support::Reply {
        client
            .send(
                Method::GET,
                &format!("http://{}{path}", self.admin),
                &[],
                Bytes::new(),
            )
            .await
    }

    /// The `/admin/fleet` entry of the `products` filter.
    async fn fleet(&self, client: &HttpClient) -> Value {
        self.admin_get(client, "/admin/fleet").await.json()
    }

    /// A label-less counter (0 until it is first counted).
    async fn counter(&self, client: &HttpClient, series: &str) -> f64 {
        assert_exported_family(series);
        let text = self.admin_get(client, "/metrics").await.text();
        series_value(&text, series).unwrap_or(0.0)
    }

    /// Admits `key` through the admin API; true on 200.
    async fn add_key(&self, client: &HttpClient, key: u64) -> bool {
        let auth = format!("Bearer {TOKEN}");
        let r = client
            .send(
                Method::POST,
                &format!("http://{}/admin/filters/products/keys", self.admin),
                &[("authorization", auth.as_str())],
                Bytes::from(key.to_string()),
            )
            .await;
        r.status.as_u16() == 200
    }
}

fn role(fleet: &Value) -> &str {
    fleet["filters"][0]["role"].as_str().unwrap_or("")
}

fn serving_generation(fleet: &Value) -> u64 {
    fleet["filters"][0]["serving"]["generation"]
        .as_u64()
        .unwrap_or(0)
}

/// Polls `/readyz` of `node` until 200.
async fn wait_ready(client: &HttpClient, node: Node, limit: Duration) {
    let deadline = Instant::now() + limit;
    while node.admin_get(client, "/readyz").await.status.as_u16() != 200 {
        assert!(Instant::now() < deadline, "not ready within {limit:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Polls the `/admin/fleet` of `nodes` until exactly one is builder and the rest
/// followers serving the builder's current generation; returns the builder's index
/// (into `nodes`) and that generation.
async fn one_builder(client: &HttpClient, nodes: &[Node], limit: Duration) -> (usize, u64) {
    let deadline = Instant::now() + limit;
    loop {
        let mut states = Vec::new();
        for n in nodes {
            states.push(n.fleet(client).await);
        }
        let builders: Vec<usize> = (0..nodes.len())
            .filter(|&i| role(&states[i]) == "builder")
            .collect();
        if let [b] = builders[..] {
            let g = serving_generation(&states[b]);
            let settled = g > 0
                && states.iter().enumerate().all(|(i, s)| {
                    i == b
                        || (role(s) == "follower"
                            && serving_generation(s) == g
                            && s["filters"][0]["current"]["generation"] == g)
                });
            if settled {
                return (b, g);
            }
        }
        assert!(
            Instant::now() < deadline,
            "no single builder with every follower on its generation within {limit:?}: {states:#?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// One key the writers created.
struct Tracked {
    key: u64,
    /// When its row was committed.
    committed: Instant,
    /// The instance that admitted it through the admin API, and when that call returned.
    admitted_on: Option<(usize, Instant)>,
    /// When each instance first answered 200 for it.
    seen: Vec<Option<Instant>>,
}

/// What the writers created and the readers saw.
struct Book {
    keys: Vec<Tracked>,
    violations: Vec<String>,
    /// Stable (seeded) keys asked, and tracked keys asked, over the run.
    asked: (u64, u64),
    /// The longest an instance still refused a key after another had served it, and
    /// after its commit: measured and printed, not judged.
    worst: (Duration, Duration),
}

type Shared = Arc<Mutex<Book>>;

fn book() -> Shared {
    Arc::new(Mutex::new(Book {
        keys: Vec::new(),
        violations: Vec::new(),
        asked: (0, 0),
        worst: (Duration::ZERO, Duration::ZERO),
    }))
}

impl Book {
    /// Tracked keys committed after `from` that instances `on` have all served, and
    /// how many were committed after `from` in all.
    fn served_since(&self, from: Instant, on: &[usize], db_only: bool) -> (usize, usize) {
        let since: Vec<&Tracked> = self
            .keys
            .iter()
            .filter(|t| t.committed > from && (!db_only || t.admitted_on.is_none()))
            .collect();
        let served = since
            .iter()
            .filter(|t| on.iter().all(|&i| t.seen[i].is_some()))
            .count();
        (served, since.len())
    }

    /// Judges what instance `i` answered for `key` in a batch sent at `sent`: a refusal
    /// of a key it had served, or admitted through its admin API, before the batch was
    /// sent is a violation. A refusal of a key that is not everywhere yet is not; how
    /// long after another instance served it, and after its commit, is recorded.
    fn judge(&mut self, i: usize, key: u64, status: u16, sent: Instant, now: Instant) {
        let Some(t) = self.keys.iter_mut().find(|t| t.key == key) else {
            return;
        };
        if status == 200 {
            t.seen[i].get_or_insert(now);
            return;
        }
        let mut why = Vec::new();
        if t.seen[i].is_some_and(|s| s < sent) {
            why.push("it served the key before".to_owned());
        }
        if let Some((a, at)) = t.admitted_on
            && a == i
            && at < sent
        {
            why.push("its admin API had admitted the key".to_owned());
        }
        let after_seen = t
            .seen
            .iter()
            .flatten()
            .map(|s| sent.saturating_duration_since(*s))
            .max()
            .unwrap_or_default();
        let after_commit = sent.saturating_duration_since(t.committed);
        self.worst.0 = self.worst.0.max(after_seen);
        self.worst.1 = self.worst.1.max(after_commit);
        if !why.is_empty() {
            self.violations.push(format!(
                "instance {i} answered {status} for key {key}: {}",
                why.join("; ")
            ));
        }
    }
}

/// Reads from every live instance in rounds until `stop`: a rotating slice of the seeded
/// keys (each must be 200) and every tracked key (judged by [`Book::judge`]); with
/// `check_ready`, `/readyz` too. Publishes the number of finished rounds on `rounds`.
async fn read_loop(
    nodes: Vec<Node>,
    live: Arc<Vec<AtomicBool>>,
    book: Shared,
    seeded: u64,
    check_ready: bool,
    stop: Arc<AtomicBool>,
    rounds: watch::Sender<u64>,
) {
    let client = HttpClient::new();
    let slice = 400u64;
    let mut offset = 0u64;
    while !stop.load(Ordering::Relaxed) {
        for (i, node) in nodes.iter().enumerate() {
            if !live[i].load(Ordering::Acquire) {
                continue;
            }
            let stable: Vec<u64> = (0..slice)
                .map(|j| demo_sku((offset + j * 37) % seeded))
                .collect();
            let tracked: Vec<u64> = book
                .lock()
                .expect("book")
                .keys
                .iter()
                .map(|t| t.key)
                .collect();
            let n_tracked = tracked.len();
            let mut keys = stable;
            keys.extend(tracked);
            let sent = Instant::now();
            let (c, data) = (client.clone(), node.data);
            let statuses = concurrently(keys, 16, move |k| {
                let c = c.clone();
                async move {
                    let r = c
                        .send(
                            Method::GET,
                            &format!("http://{data}/api/products/{k}"),
                            &[],
                            Bytes::new(),
                        )
                        .await;
                    (k, r.status.as_u16(), r.stage().to_owned())
                }
            })
            .await;
            let now = Instant::now();
            {
                let mut b = book.lock().expect("book");
                b.asked.0 += slice;
                b.asked.1 += n_tracked as u64;
                for (j, (k, status, stage)) in statuses.into_iter().enumerate() {
                    if (j as u64) < slice {
                        if status != 200 {
                            b.violations.push(format!(
                                "instance {i} answered {status} ({stage}) for seeded key {k}"
                            ));
                        }
                    } else {
                        b.judge(i, k, status, sent, now);
                    }
                }
            }
            if check_ready {
                let r = node.admin_get(&client, "/readyz").await;
                if r.status.as_u16() != 200 {
                    book.lock().expect("book").violations.push(format!(
                        "instance {i}: /readyz answered {}: {}",
                        r.status,
                        r.text()
                    ));
                }
            }
        }
        offset += 1;
        rounds.send_modify(|r| *r += 1);
    }
}

/// Inserts new keys into MariaDB until `stop`, 5 every 100 ms; every fourth step one
/// more key is inserted and then admitted through the admin API of one of `targets`
/// (in turn).
async fn write_loop(
    db: Arc<TestDb>,
    nodes: Vec<Node>,
    targets: Vec<usize>,
    book: Shared,
    stop: Arc<AtomicBool>,
) {
    let client = HttpClient::new();
    let n = nodes.len();
    let mut next = NEW_KEYS_FROM;
    let mut step = 0usize;
    while !stop.load(Ordering::Relaxed) {
        let batch: Vec<u64> = (next..next + 5).collect();
        next += 5;
        db.insert_products(&batch).await;
        let committed = Instant::now();
        book.lock()
            .expect("book")
            .keys
            .extend(batch.iter().map(|&key| Tracked {
                key,
                committed,
                admitted_on: None,
                seen: vec![None; n],
            }));
        if step.is_multiple_of(4) && !targets.is_empty() {
            let key = next;
            next += 1;
            db.insert_product(key).await;
            let committed = Instant::now();
            book.lock().expect("book").keys.push(Tracked {
                key,
                committed,
                admitted_on: None,
                seen: vec![None; n],
            });
            let target = targets[(step / 4) % targets.len()];
            let ok = nodes[target].add_key(&client, key).await;
            let mut b = book.lock().expect("book");
            if ok {
                let at = Instant::now();
                if let Some(t) = b.keys.iter_mut().find(|t| t.key == key) {
                    t.admitted_on = Some((target, at));
                }
            } else {
                b.violations
                    .push(format!("instance {target} refused to admit key {key}"));
            }
        }
        step += 1;
        // Pacing of the writes, not a wait for anything.
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Polls the book until `done` holds, for at most `limit`.
async fn until(book: &Shared, what: &str, limit: Duration, done: impl Fn(&Book) -> bool) {
    let deadline = Instant::now() + limit;
    loop {
        {
            let b = book.lock().expect("book");
            if done(&b) {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "{what}: not within {limit:?}; violations so far: {:#?}",
                b.violations
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Every tracked key is served by every instance in `on` (each asked until it is, within
/// `SETTLE` in all), and every seeded key of a sample.
async fn final_pass(client: &HttpClient, nodes: &[Node], on: &[usize], book: &Shared, seeded: u64) {
    let keys: Vec<u64> = book
        .lock()
        .expect("book")
        .keys
        .iter()
        .map(|t| t.key)
        .chain((0..seeded).step_by(97).map(demo_sku))
        .collect();
    let deadline = Instant::now() + SETTLE;
    for &i in on {
        for &k in &keys {
            loop {
                let r = client
                    .send(
                        Method::GET,
                        &format!("http://{}/api/products/{k}", nodes[i].data),
                        &[],
                        Bytes::new(),
                    )
                    .await;
                if r.status.as_u16() == 200 {
                    break;
                }
                assert!(
                    Instant::now() < deadline,
                    "every key served by instance {i}: not within {SETTLE:?}; it still \
                     answers {} for key {k}",
                    r.status
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

/// The instance ids of [`start_fleet`]'s instances, in order.
const IDS: [&str; 3] = ["a", "b", "c"];

async fn start_fleet(db: &TestDb, redis: &Backing, ns: &str, expected: u64) -> Vec<Bloomgate> {
    let mut bins = Vec::new();
    for id in IDS {
        bins.push(Bloomgate::serve(&config(db, &redis.url(), ns, id, expected), &[]).await);
    }
    bins
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_builder_killed_during_churn_is_replaced_and_no_present_key_is_refused() {
    builder_killed_during_churn(false).await;
}

/// The same on a Redis Cluster of three primaries.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_a_cluster_a_builder_killed_during_churn_is_replaced_and_no_present_key_is_refused() {
    builder_killed_during_churn(true).await;
}

async fn builder_killed_during_churn(cluster: bool) {
    let (Some(server), Some(redis_bin)) = (mysql_url(), redis_server()) else {
        return;
    };
    const N: u64 = 20_000;
    let db = Arc::new(TestDb::create_heavy(&server, N).await);
    let redis = Backing::start(&redis_bin, cluster).await;
    let mut bins = start_fleet(&db, &redis, "failover", 2 * N).await;
    let nodes: Vec<Node> = bins.iter().map(Node::of).collect();
    let client = HttpClient::new();
    for n in &nodes {
        wait_ready(&client, *n, Duration::from_secs(120)).await;
    }
    let (b, gen0) = one_builder(&client, &nodes, SETTLE).await;
    let survivors: Vec<usize> = (0..nodes.len()).filter(|&i| i != b).collect();
    eprintln!("builder: instance {b}, generation {gen0}");

    let book = book();
    let stop = Arc::new(AtomicBool::new(false));
    let live: Arc<Vec<AtomicBool>> =
        Arc::new((0..nodes.len()).map(|_| AtomicBool::new(true)).collect());
    let (rounds_tx, mut rounds) = watch::channel(0u64);
    let reader = tokio::spawn(read_loop(
        nodes.clone(),
        Arc::clone(&live),
        Arc::clone(&book),
        N,
        false,
        Arc::clone(&stop),
        rounds_tx,
    ));
    // Admissions through the admin API go to the instances that survive the kill.
    let writer = tokio::spawn(write_loop(
        Arc::clone(&db),
        nodes.clone(),
        survivors.clone(),
        Arc::clone(&book),
        Arc::clone(&stop),
    ));

    // Churn under a healthy fleet first: new rows reach every instance.
    let all: Vec<usize> = (0..nodes.len()).collect();
    let start = Instant::now();
    until(
        &book,
        "keys served everywhere before the kill",
        SETTLE,
        |bk| bk.served_since(start, &all, true).0 >= 100,
    )
    .await;

    // Stop reading from the builder (a read in flight to a killed process fails), then
    // SIGKILL it: no lease release, the lease has to expire.
    live[b].store(false, Ordering::Release);
    let from = *rounds.borrow_and_update();
    rounds
        .wait_for(|r| *r >= from + 2)
        .await
        .expect("the reader runs");
    // The lease as Redis holds it at the kill: no survivor can take it before it
    // expires (a renewal between this read and the kill only makes that later).
    let mut conn = redis.conn();
    let lease_read = Instant::now();
    let (holder, left_ms): (Option<String>, i64) = redis::pipe()
        .get("{failover}:filter:products:lease")
        .pttl("{failover}:filter:products:lease")
        .query_async(&mut conn)
        .await
        .expect("read the lease");
    let holder = holder.unwrap_or_default();
    assert!(
        holder.ends_with(&format!(":{}", IDS[b])) && left_ms > 0,
        "the builder {} does not hold the lease: {holder:?}, {left_ms} ms left",
        IDS[b]
    );
    let expires = lease_read + Duration::from_millis(left_ms as u64);
    let killed = Instant::now();
    bins[b].signal("KILL");
    assert_eq!(bins[b].wait_exit(SETTLE).await, None);

    // A survivor takes the lease once it expires, then publishes a generation.
    let deadline = killed + SETTLE;
    let (nb, to_builder, seen_at) = 'found: loop {
        for &i in &survivors {
            if role(&nodes[i].fleet(&client).await) == "builder" {
                let at = Instant::now();
                break 'found (i, at - killed, at);
            }
        }
        assert!(Instant::now() < deadline, "no survivor became builder");
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    let to_generation = loop {
        let f = nodes[nb].fleet(&client).await;
        if serving_generation(&f) > gen0 {
            break killed.elapsed();
        }
        assert!(
            Instant::now() < deadline,
            "the new builder published nothing: {f}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    eprintln!(
        "failover: builder {b} killed; instance {nb} builder after {to_builder:?}, \
         next generation published after {to_generation:?} (lease_ttl 2s)"
    );
    // Seen after it happened, so never earlier than it: a builder seen before the lease
    // read at the kill expired took a lease that was not free. (Redis counts in whole
    // milliseconds.)
    assert!(
        seen_at + Duration::from_millis(2) >= expires,
        "a new builder {:?} before the dead builder's lease ({left_ms} ms left at the kill) \
         expired",
        expires - seen_at
    );

    // Rows inserted after the kill reach both survivors through the new builder's sync.
    until(
        &book,
        "keys inserted after the kill served by the survivors",
        SETTLE,
        |bk| bk.served_since(killed, &survivors, true).0 >= 150,
    )
    .await;
    stop.store(true, Ordering::Relaxed);
    writer.await.expect("writer");
    reader.await.expect("reader");

    let (nb2, g) = one_builder(
        &client,
        &survivors.iter().map(|&i| nodes[i]).collect::<Vec<_>>(),
        SETTLE,
    )
    .await;
    assert_eq!(survivors[nb2], nb, "the builder changed again");
    assert!(g > gen0);
    final_pass(&client, &nodes, &survivors, &book, N).await;
    let b = book.lock().expect("book");
    let (after, total) = b.served_since(killed, &survivors, true);
    eprintln!(
        "churn: {} seeded and {} tracked reads; {} keys created, {after} of {total} rows \
         inserted after the kill served by both survivors; a key refused at most {:?} \
         after another instance served it, {:?} after its commit",
        b.asked.0,
        b.asked.1,
        b.keys.len(),
        b.worst.0,
        b.worst.1
    );
    assert!(b.violations.is_empty(), "{:#?}", b.violations);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_killed_under_traffic_then_back_empty_refuses_no_present_key() {
    redis_killed_then_back_empty(false).await;
}

/// The same with every node of a Redis Cluster killed, and the cluster created anew.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_killed_under_traffic_then_back_empty_refuses_no_present_key() {
    redis_killed_then_back_empty(true).await;
}

async fn redis_killed_then_back_empty(cluster: bool) {
    let (Some(server), Some(redis_bin)) = (mysql_url(), redis_server()) else {
        return;
    };
    const N: u64 = 5_000;
    let db = Arc::new(TestDb::create(&server, N).await);
    let mut redis = Backing::start(&redis_bin, cluster).await;
    let bins = start_fleet(&db, &redis, "outage", 4 * N).await;
    let nodes: Vec<Node> = bins.iter().map(Node::of).collect();
    let all: Vec<usize> = (0..nodes.len()).collect();
    let client = HttpClient::new();
    for n in &nodes {
        wait_ready(&client, *n, Duration::from_secs(60)).await;
    }
    let (_, gen0) = one_builder(&client, &nodes, SETTLE).await;
    let epoch0 = nodes[0].fleet(&client).await["redis"]["epoch"].clone();
    assert!(epoch0.is_string(), "{epoch0}");

    let book = book();
    let stop = Arc::new(AtomicBool::new(false));
    let live: Arc<Vec<AtomicBool>> =
        Arc::new((0..nodes.len()).map(|_| AtomicBool::new(true)).collect());
    let (rounds_tx, _rounds) = watch::channel(0u64);
    let reader = tokio::spawn(read_loop(
        nodes.clone(),
        live,
        Arc::clone(&book),
        N,
        true,
        Arc::clone(&stop),
        rounds_tx,
    ));
    let writer = tokio::spawn(write_loop(
        Arc::clone(&db),
        nodes.clone(),
        all.clone(),
        Arc::clone(&book),
        Arc::clone(&stop),
    ));
    let start = Instant::now();
    until(
        &book,
        "keys served everywhere before the outage",
        SETTLE,
        |bk| bk.served_since(start, &all, true).0 >= 50,
    )
    .await;

    // Redis dies: every instance goes on alone.
    redis.kill();
    let killed = Instant::now();
    let deadline = killed + SETTLE;
    for (i, n) in nodes.iter().enumerate() {
        loop {
            let f = n.fleet(&client).await;
            if role(&f) == "standalone" && f["redis"]["up"] == false {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "instance {i} not standalone: {f}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let fallbacks = n.counter(&client, "bloomgate_fleet_fallbacks_total").await;
        assert!(fallbacks >= 1.0, "instance {i}: {fallbacks} fallbacks");
    }
    let alone = Instant::now();
    eprintln!(
        "outage: every instance standalone {:?} after the kill",
        alone - killed
    );
    // Rows inserted during the outage reach every instance through its own sync.
    until(
        &book,
        "rows inserted during the outage served everywhere",
        SETTLE,
        |bk| bk.served_since(alone, &all, true).0 >= 100,
    )
    .await;

    // Redis comes back empty on the same port: the reset is seen, one builder
    // publishes a fresh generation (numbered on from the old ones), every instance
    // follows it.
    let restarted_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_millis() as u64;
    redis.restart_empty().await;
    let back = Instant::now();
    for (i, n) in nodes.iter().enumerate() {
        loop {
            let resets = n
                .counter(&client, "bloomgate_fleet_redis_resets_total")
                .await;
            if resets >= 1.0 {
                break;
            }
            assert!(
                back.elapsed() < SETTLE,
                "instance {i} saw no reset: {}",
                n.fleet(&client).await
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    let (nb, g) = one_builder(&client, &nodes, SETTLE).await;
    let rejoined = back.elapsed();
    for n in &nodes {
        let f = n.fleet(&client).await;
        assert_eq!(f["redis"]["up"], true, "{f}");
        assert!(
            f["redis"]["epoch"].is_string() && f["redis"]["epoch"] != epoch0,
            "{f}"
        );
        // The generation served was published into the new Redis, not kept from the old.
        assert!(
            f["filters"][0]["serving"]["generation"].as_u64() > Some(gen0),
            "{f}"
        );
        let at = f["filters"][0]["serving"]["published_at_ms"]
            .as_u64()
            .unwrap_or(0);
        assert!(at >= restarted_ms, "{f}");
    }
    eprintln!(
        "Redis back empty: instance {nb} builder, generation {g} (was {gen0}) served by all \
         after {rejoined:?}"
    );
    // Traffic goes on over the rejoined fleet.
    let rejoin = Instant::now();
    until(
        &book,
        "rows inserted after the rejoin served everywhere",
        SETTLE,
        |bk| bk.served_since(rejoin, &all, true).0 >= 50,
    )
    .await;
    stop.store(true, Ordering::Relaxed);
    writer.await.expect("writer");
    reader.await.expect("reader");
    final_pass(&client, &nodes, &all, &book, N).await;
    let b = book.lock().expect("book");
    eprintln!(
        "outage: {} seeded and {} tracked reads; {} keys created; a key refused at most \
         {:?} after another instance served it, {:?} after its commit",
        b.asked.0,
        b.asked.1,
        b.keys.len(),
        b.worst.0,
        b.worst.1
    );
    assert!(b.violations.is_empty(), "{:#?}", b.violations);
    drop(bins);
}
