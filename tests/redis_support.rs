//! The throwaway Redis of the test harness (`support::redis`), proven against a real
//! `redis-server`: it answers with the configuration the fleet tests rely on, a kill
//! takes it away and a restart brings it back empty on the same address, a restart on
//! its append-only file brings its data back, a frozen server leaves commands
//! unanswered, credentials are required when set, and two servers never see each other.
//!
//! Needs `redis-server` (Debian's `redis-server` package, which `scripts/test` installs);
//! skipped without it, and failing in CI.

mod support;

use std::time::Duration;

use redis::AsyncCommands;
use redis::aio::MultiplexedConnection;
use support::{RedisOptions, TestRedis, redis_server};

async fn config_get(conn: &mut MultiplexedConnection, name: &str) -> String {
    let pair: Vec<String> = redis::cmd("CONFIG")
        .arg("GET")
        .arg(name)
        .query_async(conn)
        .await
        .expect("CONFIG GET");
    assert_eq!(pair.len(), 2, "CONFIG GET {name}: {pair:?}");
    pair[1].clone()
}

async fn ping(conn: &mut MultiplexedConnection) -> redis::RedisResult<String> {
    redis::cmd("PING").query_async(conn).await
}

#[tokio::test]
async fn a_server_answers_with_the_configuration_the_tests_rely_on() {
    let Some(server) = redis_server() else { return };
    let redis = TestRedis::start(&server).await;
    assert_eq!(
        redis.url(),
        format!("redis://127.0.0.1:{}", redis.port()),
        "loopback, no credentials"
    );
    let mut conn = redis.conn().await;
    let () = conn.set("greeting", "hello").await.expect("SET");
    let got: Option<String> = conn.get("greeting").await.expect("GET");
    assert_eq!(got.as_deref(), Some("hello"));

    assert_eq!(
        config_get(&mut conn, "maxmemory-policy").await,
        "noeviction"
    );
    assert_eq!(config_get(&mut conn, "save").await, "");
    assert_eq!(config_get(&mut conn, "appendonly").await, "no");
    assert_eq!(config_get(&mut conn, "bind").await, "127.0.0.1");
    let dir = config_get(&mut conn, "dir").await;
    assert!(
        dir.contains("bloomgate-redis-"),
        "a directory of its own: {dir}"
    );
}

#[tokio::test]
async fn a_killed_server_is_gone_and_a_restarted_one_answers_empty_at_the_same_address() {
    let Some(server) = redis_server() else { return };
    let mut redis = TestRedis::start(&server).await;
    let url = redis.url();
    let first_pid = redis.pid().expect("running");
    let mut conn = redis.conn().await;
    let () = conn.set("k", "v").await.expect("SET");

    redis.kill();
    assert_eq!(redis.pid(), None);
    assert!(
        !support::process_alive(first_pid),
        "the process is killed and reaped"
    );
    let stale: redis::RedisResult<Option<String>> = conn.get("k").await;
    assert!(stale.is_err(), "an open connection fails: {stale:?}");
    let fresh = redis.try_conn().await;
    assert!(fresh.is_err(), "a new connection is refused");

    redis.restart().await;
    assert_eq!(redis.url(), url, "the same address");
    assert_ne!(redis.pid(), Some(first_pid), "a new process");
    let mut conn = redis.conn().await;
    assert_eq!(ping(&mut conn).await.expect("PING"), "PONG");
    let got: Option<String> = conn.get("k").await.expect("GET");
    assert_eq!(got, None, "it starts empty");
    let keys: u64 = redis::cmd("DBSIZE")
        .query_async(&mut conn)
        .await
        .expect("DBSIZE");
    assert_eq!(keys, 0);
}

#[tokio::test]
async fn with_an_append_only_file_a_killed_server_comes_back_with_its_data() {
    let Some(server) = redis_server() else { return };
    let mut redis = TestRedis::start_with(&server, RedisOptions::new().appendonly()).await;
    let mut conn = redis.conn().await;
    let () = conn.set("kept", "yes").await.expect("SET");

    redis.kill();
    redis.start_again_with(&["--maxmemory", "64mb"]).await;
    let mut conn = redis.conn().await;
    let got: Option<String> = conn.get("kept").await.expect("GET");
    assert_eq!(got.as_deref(), Some("yes"), "written before the kill");
    assert_eq!(config_get(&mut conn, "maxmemory").await, "67108864");
    assert_eq!(config_get(&mut conn, "appendonly").await, "yes");

    // A restart empties the directory, append-only file included.
    redis.restart().await;
    let mut conn = redis.conn().await;
    let got: Option<String> = conn.get("kept").await.expect("GET");
    assert_eq!(got, None);
}

#[tokio::test]
async fn a_frozen_server_leaves_commands_unanswered_until_thawed() {
    let Some(server) = redis_server() else { return };
    let redis = TestRedis::start(&server).await;
    let mut conn = redis.conn().await;
    assert_eq!(ping(&mut conn).await.expect("PING"), "PONG");

    redis.freeze();
    let frozen = tokio::time::timeout(Duration::from_millis(300), ping(&mut conn)).await;
    assert!(frozen.is_err(), "no reply while frozen: {frozen:?}");

    redis.thaw();
    let mut conn = redis.conn().await;
    assert_eq!(ping(&mut conn).await.expect("PING after thawing"), "PONG");
}

#[tokio::test]
async fn credentials_are_in_the_url_and_required_by_the_server() {
    let Some(server) = redis_server() else { return };
    for (options, prefix) in [
        (
            RedisOptions::new().password("pa ss/word"),
            "redis://:pa%20ss%2Fword@",
        ),
        (
            RedisOptions::new().acl_user("fleet", "s3cret"),
            "redis://fleet:s3cret@",
        ),
    ] {
        let redis = TestRedis::start_with(&server, options).await;
        assert!(redis.url().starts_with(prefix), "{}", redis.url());
        let mut conn = redis.conn().await;
        assert_eq!(ping(&mut conn).await.expect("PING"), "PONG");

        let anonymous = redis::Client::open(redis.url_without_credentials()).expect("url");
        let refused = match anonymous.get_multiplexed_async_connection().await {
            Ok(mut conn) => ping(&mut conn).await.map(|_| ()),
            Err(e) => Err(e),
        };
        let e = refused.expect_err("no credentials, no answer");
        assert!(
            format!("{e}").contains("NOAUTH") || format!("{e}").contains("uthentication"),
            "{e}"
        );
    }
}

#[tokio::test]
async fn two_servers_are_independent() {
    let Some(server) = redis_server() else { return };
    let mut a = TestRedis::start(&server).await;
    let b = TestRedis::start(&server).await;
    assert_ne!(a.port(), b.port());
    let mut conn_a = a.conn().await;
    let mut conn_b = b.conn().await;
    let () = conn_a.set("k", "a").await.expect("SET a");
    let () = conn_b.set("k", "b").await.expect("SET b");
    let got: Option<String> = conn_a.get("k").await.expect("GET a");
    assert_eq!(got.as_deref(), Some("a"));

    a.kill();
    assert!(a.try_conn().await.is_err(), "a is gone");
    let got: Option<String> = conn_b.get("k").await.expect("b still answers");
    assert_eq!(got.as_deref(), Some("b"));
    assert_eq!(ping(&mut b.conn().await).await.expect("PING b"), "PONG");
}
