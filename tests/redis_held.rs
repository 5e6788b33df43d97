//! The filter held in Redis (`gate::redis_held`), against a real `redis-server`: a
//! generation written in shards answers every key as the local filter it was written
//! from does (no present key refused, the same false positives), concurrent checks share
//! one connection, an admission is seen at once by another client, the scripts come back
//! after `SCRIPT FLUSH`, a Redis that lost the data never answers "absent", a new
//! generation replaces the old one without a gap, and the example Python client
//! (`examples/redis_gate_client.py`, redis-py) gives the same answers.
//!
//! Needs `redis-server` (and, for the client test, python3 with redis-py); `scripts/test`
//! installs both.

mod support;

use std::time::Duration;

use bloomgate::filter::{BloomFilter, BloomParams};
use bloomgate::gate::redis_held::{self, HeldError, HeldKeys, Layout, Scripts, Upload};
use futures_util::StreamExt;
use redis::aio::MultiplexedConnection;
use support::{TestRedis, redis_server};

/// `n` present keys (even numbers, in decimal) in a filter at rate `p`.
fn filter_with(n: u64, p: f64) -> BloomFilter {
    let filter = BloomFilter::new(
        BloomParams::optimal(n, p).expect("params"),
        rand::random::<u32>(),
    );
    for i in 0..n {
        filter.insert((i * 2).to_string().as_bytes());
    }
    filter
}

/// Small shards (97 blocks, not a divisor of the filter's block count): a filter of any
/// size here spans many shards, the last one shorter.
fn upload() -> Upload {
    Upload {
        shard_bytes: 64 * 97,
        upload_ttl: Duration::from_secs(60),
        grace: Duration::from_secs(30),
    }
}

/// Checks `keys` with up to 256 in flight on one multiplexed connection.
async fn check_all(
    conn: &MultiplexedConnection,
    keys: &HeldKeys,
    layout: &Layout,
    scripts: &Scripts,
    wanted: impl Iterator<Item = String>,
) -> Vec<(String, Result<bool, HeldError>)> {
    futures_util::stream::iter(wanted)
        .map(|k| {
            let mut conn = conn.clone();
            async move {
                let answer = scripts.check(&mut conn, keys, layout, k.as_bytes()).await;
                (k, answer)
            }
        })
        .buffer_unordered(256)
        .collect()
        .await
}

async fn connected_clients(conn: &mut MultiplexedConnection) -> u64 {
    let info: String = redis::cmd("INFO")
        .arg("clients")
        .query_async(conn)
        .await
        .expect("INFO clients");
    info.lines()
        .find_map(|l| l.strip_prefix("connected_clients:"))
        .and_then(|v| v.trim().parse().ok())
        .expect("connected_clients in INFO")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_present_key_is_found_and_every_answer_is_the_local_filters() {
    let Some(server) = redis_server() else { return };
    let redis = TestRedis::start(&server).await;
    let n = 100_000;
    let p = 0.01;
    let filter = filter_with(n, p);
    let keys = HeldKeys::new("bg-test", "products");
    let mut admin = redis.conn().await;
    let layout = redis_held::publish(&mut admin, &keys, &filter, upload())
        .await
        .expect("publish");
    assert!(layout.shards() > 10, "{layout:?}");
    assert_eq!(
        redis_held::current(&mut admin, &keys)
            .await
            .expect("current"),
        Some(layout.clone())
    );

    let checker = redis.conn().await;
    let scripts = Scripts::new();
    let present = check_all(
        &checker,
        &keys,
        &layout,
        &scripts,
        (0..n).map(|i| (i * 2).to_string()),
    )
    .await;
    let refused: Vec<&String> = present
        .iter()
        .filter(|(_, a)| !matches!(a, Ok(true)))
        .map(|(k, _)| k)
        .collect();
    assert!(
        refused.is_empty(),
        "present keys not found: {:?}",
        &refused[..refused.len().min(10)]
    );
    assert_eq!(present.len() as u64, n);

    let absent = check_all(
        &checker,
        &keys,
        &layout,
        &scripts,
        (0..n).map(|i| (i * 2 + 1).to_string()),
    )
    .await;
    let mut passed = 0u64;
    for (k, answer) in &absent {
        let answer = answer.as_ref().unwrap_or_else(|e| panic!("{k}: {e}"));
        assert_eq!(
            *answer,
            filter.contains(k.as_bytes()),
            "{k}: Redis and the local filter differ"
        );
        passed += u64::from(*answer);
    }
    let rate = passed as f64 / n as f64;
    assert!(
        rate <= 1.2 * p,
        "false-positive rate {rate} above 1.2 * {p}"
    );
    assert!(
        rate > 0.0,
        "no false positive in {n} absent keys: the checks read nothing"
    );
    // The 200,000 checks went over the checker's one connection (and the admin's).
    assert_eq!(connected_clients(&mut admin).await, 2);
}

#[tokio::test]
async fn an_admission_is_seen_at_once_by_another_client_and_never_creates_a_shard() {
    let Some(server) = redis_server() else { return };
    let redis = TestRedis::start(&server).await;
    let filter = filter_with(2_000, 0.01);
    let keys = HeldKeys::new("bg-test", "users");
    let mut a = redis.conn().await;
    let mut b = redis.conn().await;
    let layout = redis_held::publish(&mut a, &keys, &filter, upload())
        .await
        .expect("publish");
    let scripts = Scripts::new();
    // Absent keys the filter refuses, admitted on one connection, checked on the other.
    // Each admission goes into the local filter too, so that a later key whose bits the
    // earlier admissions happen to cover is not taken for a refused one.
    let mut refused = Vec::new();
    for i in 0u64.. {
        if refused.len() == 200 {
            break;
        }
        let k = format!("{}", 1_000_001 + 2 * i);
        if !filter.contains(k.as_bytes()) {
            filter.insert(k.as_bytes());
            refused.push(k);
        }
    }
    for k in &refused {
        assert!(
            !scripts
                .check(&mut b, &keys, &layout, k.as_bytes())
                .await
                .expect("check")
        );
        let set = scripts
            .add(&mut a, &keys, &layout, k.as_bytes())
            .await
            .expect("add");
        assert!(set >= 1, "{k}: an admission of a refused key set no bit");
        assert!(
            scripts
                .check(&mut b, &keys, &layout, k.as_bytes())
                .await
                .expect("check"),
            "{k} admitted on one connection and refused on another"
        );
        assert_eq!(
            scripts
                .add(&mut a, &keys, &layout, k.as_bytes())
                .await
                .expect("again"),
            0
        );
    }

    // A layout whose shards are not in Redis (another generation): nothing is written.
    let ghost = Layout {
        generation: layout.generation + 7,
        ..layout.clone()
    };
    let k = refused[0].as_bytes();
    assert!(matches!(
        scripts.add(&mut a, &keys, &ghost, k).await,
        Err(HeldError::Missing { generation, .. }) if generation == ghost.generation
    ));
    let spot = ghost.spot(k);
    let exists: u64 = redis::cmd("EXISTS")
        .arg(keys.shard(ghost.generation, spot.shard))
        .query_async(&mut a)
        .await
        .expect("EXISTS");
    assert_eq!(exists, 0, "an admission into a missing shard created it");
}

#[tokio::test]
async fn checks_go_on_after_the_scripts_are_flushed() {
    let Some(server) = redis_server() else { return };
    let redis = TestRedis::start(&server).await;
    let filter = filter_with(1_000, 0.01);
    let keys = HeldKeys::new("bg-test", "flush");
    let mut conn = redis.conn().await;
    let layout = redis_held::publish(&mut conn, &keys, &filter, upload())
        .await
        .expect("publish");
    let scripts = Scripts::new();
    for round in 0..3 {
        assert!(
            scripts
                .check(&mut conn, &keys, &layout, b"10")
                .await
                .expect("check"),
            "round {round}"
        );
        let _: () = redis::cmd("SCRIPT")
            .arg("FLUSH")
            .query_async(&mut conn)
            .await
            .expect("SCRIPT FLUSH");
        assert!(
            scripts
                .check(&mut conn, &keys, &layout, b"12")
                .await
                .expect("after flush")
        );
        scripts
            .add(&mut conn, &keys, &layout, b"13")
            .await
            .expect("add after flush");
    }
}

#[tokio::test]
async fn a_redis_that_lost_its_data_never_answers_absent() {
    let Some(server) = redis_server() else { return };
    let mut redis = TestRedis::start(&server).await;
    let filter = filter_with(5_000, 0.01);
    let keys = HeldKeys::new("bg-test", "lost");
    let mut conn = redis.conn().await;
    let layout = redis_held::publish(&mut conn, &keys, &filter, upload())
        .await
        .expect("publish");
    let scripts = Scripts::new();
    assert!(
        scripts
            .check(&mut conn, &keys, &layout, b"4")
            .await
            .expect("check")
    );

    redis.kill();
    let err = scripts.check(&mut conn, &keys, &layout, b"4").await;
    assert!(matches!(err, Err(HeldError::Redis(_))), "{err:?}");

    redis.restart().await;
    let mut conn = redis.conn().await;
    assert_eq!(
        redis_held::current(&mut conn, &keys)
            .await
            .expect("current"),
        None
    );
    for i in 0..200u64 {
        let k = (i * 2).to_string();
        let answer = scripts.check(&mut conn, &keys, &layout, k.as_bytes()).await;
        assert!(
            matches!(answer, Err(HeldError::Missing { .. })),
            "{k}: {answer:?}"
        );
    }
    // A shard cut short (a partial write, or a SETRANGE from another client) reads as
    // missing for the blocks it lacks, not as clear bits.
    let spot = layout.spot(b"4");
    let _: () = redis::cmd("SET")
        .arg(keys.shard(layout.generation, spot.shard))
        .arg(vec![0xffu8; spot.offset as usize])
        .query_async(&mut conn)
        .await
        .expect("SET");
    let answer = scripts.check(&mut conn, &keys, &layout, b"4").await;
    assert!(
        matches!(answer, Err(HeldError::Missing { .. })),
        "{answer:?}"
    );
}

#[tokio::test]
async fn a_new_generation_replaces_the_old_one_which_stays_readable_for_the_grace() {
    let Some(server) = redis_server() else { return };
    let redis = TestRedis::start(&server).await;
    let keys = HeldKeys::new("bg-test", "gens");
    let mut conn = redis.conn().await;
    let first = filter_with(3_000, 0.01);
    let old = redis_held::publish(&mut conn, &keys, &first, upload())
        .await
        .expect("first");
    let second = filter_with(6_000, 0.001);
    let new = redis_held::publish(&mut conn, &keys, &second, upload())
        .await
        .expect("second");
    assert!(new.generation > old.generation);
    assert_ne!(new.seed, old.seed);
    assert_eq!(
        redis_held::current(&mut conn, &keys)
            .await
            .expect("current"),
        Some(new.clone())
    );
    for s in 0..old.shards() {
        let ttl: i64 = redis::cmd("PTTL")
            .arg(keys.shard(old.generation, s))
            .query_async(&mut conn)
            .await
            .expect("PTTL");
        assert!(ttl > 0 && ttl <= 30_000, "old shard {s}: PTTL {ttl}");
    }
    for s in 0..new.shards() {
        let ttl: i64 = redis::cmd("PTTL")
            .arg(keys.shard(new.generation, s))
            .query_async(&mut conn)
            .await
            .expect("PTTL");
        assert_eq!(ttl, -1, "current shard {s} expires");
    }
    // An upload whose shards expire before the flip leaves `current` as it was: one
    // block per shard, so the first shard is written hundreds of round trips (each
    // several microseconds at least) before the flip, and expires 1 ms after it is written.
    let slow = Upload {
        shard_bytes: 64,
        upload_ttl: Duration::from_millis(1),
        ..upload()
    };
    let third = filter_with(40_000, 0.01);
    assert!(third.params().bits / 512 > 700);
    let failed = redis_held::publish(&mut conn, &keys, &third, slow).await;
    assert!(
        matches!(failed, Err(HeldError::Vanished { generation }) if generation > new.generation),
        "{failed:?}"
    );
    assert_eq!(
        redis_held::current(&mut conn, &keys)
            .await
            .expect("current"),
        Some(new.clone())
    );

    let scripts = Scripts::new();
    for i in 0..3_000u64 {
        let k = (i * 2).to_string();
        assert!(
            scripts
                .check(&mut conn, &keys, &old, k.as_bytes())
                .await
                .expect("old")
        );
        assert!(
            scripts
                .check(&mut conn, &keys, &new, k.as_bytes())
                .await
                .expect("new")
        );
    }
}

/// The Python interpreter `scripts/test` exports in `BLOOMGATE_TEST_PYTHON` (one that
/// can import redis-py), else `python3` if it can; `None` otherwise (a failure under CI,
/// as for redis-server).
fn python_with_redis() -> Option<String> {
    let python = std::env::var("BLOOMGATE_TEST_PYTHON")
        .ok()
        .filter(|p| !p.is_empty())
        .unwrap_or_else(|| "python3".to_owned());
    let ok = std::process::Command::new(&python)
        .args(["-c", "import redis"])
        .output()
        .is_ok_and(|o| o.status.success());
    if ok {
        return Some(python);
    }
    let ci = std::env::var_os("CI").is_some_and(|v| !v.is_empty());
    assert!(
        !ci,
        "{python} cannot import redis-py but CI is set: run the tests through scripts/test"
    );
    eprintln!(
        "skipping the example client test: {python} cannot import redis-py (scripts/test installs it)"
    );
    None
}

#[tokio::test]
async fn the_example_python_client_gives_the_same_answers() {
    let Some(server) = redis_server() else { return };
    let Some(python) = python_with_redis() else {
        return;
    };
    let redis = TestRedis::start(&server).await;
    let filter = filter_with(20_000, 0.01);
    let keys = HeldKeys::new("bg-py", "products");
    let mut conn = redis.conn().await;
    let layout = redis_held::publish(&mut conn, &keys, &filter, upload())
        .await
        .expect("publish");
    let scripts = Scripts::new();
    // An admitted key the filter itself did not hold, so the client reads the live bits.
    let admitted = (0..)
        .map(|i: u64| format!("late-{i}"))
        .find(|k| !filter.contains(k.as_bytes()))
        .expect("a refused key");
    scripts
        .add(&mut conn, &keys, &layout, admitted.as_bytes())
        .await
        .expect("add");
    // Present and absent keys, text keys of every length around murmur3's 16-byte
    // blocks, and the empty key.
    let mut asked: Vec<String> = (0..1_000u64).map(|i| (i * 2).to_string()).collect();
    asked.extend((0..1_000u64).map(|i| (i * 2 + 1).to_string()));
    asked.extend((0..40).map(|len| "x".repeat(len)));
    asked.push(admitted.clone());
    let mut expected = Vec::new();
    for k in &asked {
        let answer = scripts
            .check(&mut conn, &keys, &layout, k.as_bytes())
            .await
            .expect("check");
        expected.push(format!("{k} {}", if answer { "maybe" } else { "absent" }));
    }
    assert!(expected.last().is_some_and(|l| l.ends_with("maybe")));
    let client = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/redis_gate_client.py");
    let out = std::process::Command::new(&python)
        .arg(client)
        .arg(redis.url())
        .arg("bg-py")
        .arg("products")
        .args(&asked)
        .output()
        .expect("run the example client");
    assert!(
        out.status.success(),
        "client failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let got = String::from_utf8(out.stdout).expect("utf-8");
    // The empty key prints as " maybe" or " absent": compare line by line as written.
    let got: Vec<&str> = got.lines().collect();
    assert_eq!(got.len(), expected.len());
    for (g, e) in got.iter().zip(&expected) {
        assert_eq!(g, e, "the Python client and bloomgate differ");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_admission_at_any_step_of_a_publication_is_in_the_new_generation() {
    use bloomgate::config::HeldConfig;
    use bloomgate::gate::held::{HeldGate, PublishHook, PublishPhase};
    use std::sync::Arc;

    let Some(server) = redis_server() else { return };
    let redis = TestRedis::start(&server).await;
    let manager = redis::Client::open(redis.url().as_str())
        .expect("url")
        .get_connection_manager()
        .await
        .expect("connection manager");
    let registry = prometheus::Registry::new();
    let metrics = bloomgate::gate::metrics::FilterFamilies::register(&registry)
        .expect("families")
        .handles("steps", 0.01, None);
    let config = HeldConfig {
        shard_bytes: 64 * 97,
        ..HeldConfig::default()
    };
    let gate = Arc::new(HeldGate::new(
        "steps",
        "bg-test",
        bloomgate::redis_conn::RedisConn::Single(manager),
        config,
        metrics,
    ));
    let keys = HeldKeys::new("bg-test", "steps");
    let mut conn = redis.conn().await;
    let scripts = Scripts::new();
    gate.publish(&filter_with(5_000, 0.01), Duration::from_secs(30))
        .await
        .expect("first generation");

    // What the new generation holds without the admissions, to pick keys it refuses.
    let next = filter_with(5_000, 0.01);
    let shadow = BloomFilter::new(next.params(), next.seed());
    for i in 0..5_000u64 {
        shadow.insert((i * 2).to_string().as_bytes());
    }
    let mut candidates = (0u64..).map(|i| format!("step-{i}"));
    for phase in [
        PublishPhase::Reading,
        PublishPhase::Written,
        PublishPhase::Replayed,
        PublishPhase::Flipped,
    ] {
        let key = candidates
            .by_ref()
            .find(|k| !shadow.contains(k.as_bytes()))
            .expect("a refused key");
        shadow.insert(key.as_bytes());
        let hook: PublishHook = {
            let gate = Arc::clone(&gate);
            let key = key.clone();
            Arc::new(move |at| {
                if at == phase {
                    gate.admit(key.as_bytes());
                }
                Box::pin(async {})
            })
        };
        gate.set_publish_hook(Some(hook));
        let layout = gate
            .publish(&next, Duration::from_secs(30))
            .await
            .expect("publish");
        gate.set_publish_hook(None);
        assert_eq!(gate.layout().as_deref(), Some(&layout), "{phase:?}");
        let deadline = std::time::Instant::now() + Duration::from_secs(2);
        while !scripts
            .check(&mut conn, &keys, &layout, key.as_bytes())
            .await
            .expect("check")
        {
            assert!(
                std::time::Instant::now() < deadline,
                "{key}, admitted at {phase:?}, is not in generation {}",
                layout.generation
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
}
