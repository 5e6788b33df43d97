//! Redis as operators deploy it beyond one server, from real processes on loopback: a
//! Redis Cluster of three primaries and three replicas ([`TestCluster`], built with
//! `redis-cli --cluster create`), and a primary with a replica watched by three
//! Sentinels ([`TestSentinel`]). Each node is a [`TestRedis`] of the test's own, so it
//! can be killed with SIGKILL like any other.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use redis::aio::MultiplexedConnection;
use tempfile::TempDir;

use super::ChildGuard;
use super::redis::{RedisOptions, TestRedis};

/// How long a cluster or a failover has to settle: a bound on a hang, not a latency.
const SETTLE: Duration = Duration::from_secs(60);

/// The `redis-cli` beside `server`, else the one on `PATH`.
fn redis_cli(server: &Path) -> PathBuf {
    let beside = server.with_file_name("redis-cli");
    if beside.is_file() {
        return beside;
    }
    PathBuf::from("redis-cli")
}

/// A free port on 127.0.0.1 at the time of asking.
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("bind 127.0.0.1:0")
        .port()
}

/// A Redis Cluster of three primaries, each with one replica.
pub struct TestCluster {
    server: PathBuf,
    password: Option<String>,
    /// Nodes 0..3 start as primaries, 3..6 as their replicas (`redis-cli` pairs them).
    pub(crate) nodes: Vec<TestRedis>,
}

impl TestCluster {
    /// Six nodes started and joined into one cluster; returns once every slot is served.
    pub async fn start(server: &Path) -> TestCluster {
        TestCluster::start_with(server, None, &[]).await
    }

    /// As [`TestCluster::start`], the default user's password `password` (replicas log
    /// in to their primaries with it) and `extra` arguments given to every node.
    pub async fn start_with(server: &Path, password: Option<&str>, extra: &[&str]) -> TestCluster {
        let mut nodes = Vec::new();
        for _ in 0..6 {
            let bus = free_port().to_string();
            let mut options = RedisOptions::new();
            if let Some(pw) = password {
                options = options.password(pw).args(&["--masterauth", pw]);
            }
            let options = options.args(extra).args(&[
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                "nodes.conf",
                "--cluster-node-timeout",
                "1000",
                "--cluster-port",
                &bus,
                // A replica takes over however long it was cut off: the tests kill
                // primaries at any moment.
                "--cluster-replica-validity-factor",
                "0",
            ]);
            nodes.push(TestRedis::start_with(server, options).await);
        }
        let cluster = TestCluster {
            server: server.to_owned(),
            password: password.map(str::to_owned),
            nodes,
        };
        cluster.create().await;
        cluster
    }

    async fn create(&self) {
        let mut cmd = Command::new(redis_cli(&self.server));
        cmd.arg("--cluster").arg("create");
        for n in &self.nodes {
            cmd.arg(format!("127.0.0.1:{}", n.port()));
        }
        if let Some(pw) = &self.password {
            cmd.env("REDISCLI_AUTH", pw);
        }
        let out = cmd
            .args(["--cluster-replicas", "1", "--cluster-yes"])
            .stdin(Stdio::null())
            .output()
            .expect("run redis-cli --cluster create");
        assert!(
            out.status.success(),
            "redis-cli --cluster create: {}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        self.wait_healthy().await;
    }

    /// `redis+cluster://` naming every node.
    pub fn url(&self) -> String {
        let hosts: Vec<String> = self
            .nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port()))
            .collect();
        format!("redis+cluster://{}", hosts.join(","))
    }

    /// A cluster connection of the test's own.
    pub async fn conn(&self) -> redis::cluster_async::ClusterConnection {
        let urls: Vec<String> = self
            .nodes
            .iter()
            .filter(|n| n.pid().is_some())
            .map(|n| n.url())
            .collect();
        redis::cluster::ClusterClientBuilder::new(urls)
            .connection_timeout(Duration::from_secs(5))
            .response_timeout(Duration::from_secs(10))
            .build()
            .expect("cluster client")
            .get_async_connection()
            .await
            .expect("connect to the test cluster")
    }

    /// The port of node `i`.
    pub fn port(&self, i: usize) -> u16 {
        self.nodes[i].port()
    }

    /// A plain connection to node `i`.
    pub async fn node_conn(&self, i: usize) -> MultiplexedConnection {
        self.nodes[i].conn().await
    }

    /// The node serving the slot of `key` as primary now.
    pub async fn primary_of(&self, key: &str) -> usize {
        match self.serving(key).await {
            Ok(i) => i,
            Err(nodes) => panic!("no primary serves the slot of {key}:\n{nodes}"),
        }
    }

    /// Waits until the slot of `key` is served by a primary other than node `old` (a
    /// replica promoted after `old` was killed) and the cluster is ok again; returns it.
    pub async fn wait_promoted(&self, old: usize, key: &str) -> usize {
        let deadline = Instant::now() + SETTLE;
        loop {
            if let Ok(now) = self.serving(key).await
                && now != old
            {
                self.wait_healthy().await;
                return now;
            }
            assert!(
                Instant::now() < deadline,
                "no replica of node {old} promoted"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// The node serving the slot of `key` as primary, as a live node sees it, or that
    /// node's view of the cluster.
    async fn serving(&self, key: &str) -> Result<usize, String> {
        let live = self.live().next().expect("a live node");
        let mut conn = self.nodes[live].conn().await;
        let slot = keyslot(&mut conn, key).await;
        let nodes: String = redis::cmd("CLUSTER")
            .arg("NODES")
            .query_async(&mut conn)
            .await
            .expect("CLUSTER NODES");
        for line in nodes.lines() {
            let fields: Vec<&str> = line.split_whitespace().collect();
            if fields.len() < 9 || !fields[2].contains("master") || fields[2].contains("fail") {
                continue;
            }
            let serves = fields[8..].iter().any(|range| {
                let (lo, hi) = range.split_once('-').unwrap_or((range, range));
                match (lo.parse::<u16>(), hi.parse::<u16>()) {
                    (Ok(lo), Ok(hi)) => (lo..=hi).contains(&slot),
                    _ => false,
                }
            });
            if serves {
                let port: u16 = fields[1]
                    .split(['@', ','])
                    .next()
                    .and_then(|a| a.rsplit_once(':'))
                    .and_then(|(_, p)| p.parse().ok())
                    .expect("node address");
                return Ok(self
                    .nodes
                    .iter()
                    .position(|n| n.port() == port)
                    .expect("a node of this cluster"));
            }
        }
        Err(nodes)
    }

    /// Moves the slot of `key`, with its keys, from its primary to primary `to`, the
    /// way `redis-cli --cluster reshard` does: the slot marked migrating and importing,
    /// its keys sent `batch` at a time with `pause` between batches (while the slot is
    /// half moved, clients are sent `ASK` for the keys already moved), then the slot
    /// given to `to` on every primary (clients are sent `MOVED` from then on).
    pub async fn move_slot(&self, key: &str, to: usize, batch: usize, pause: Duration) {
        let from = self.primary_of(key).await;
        assert_ne!(from, to, "the slot of {key} is on node {to} already");
        let mut src = self.nodes[from].conn().await;
        let mut dst = self.nodes[to].conn().await;
        let slot = keyslot(&mut src, key).await;
        let id = async |conn: &mut MultiplexedConnection| -> String {
            redis::cmd("CLUSTER")
                .arg("MYID")
                .query_async(conn)
                .await
                .expect("CLUSTER MYID")
        };
        let (src_id, dst_id) = (id(&mut src).await, id(&mut dst).await);
        let setslot = async |conn: &mut MultiplexedConnection, state: &str, node: &str| {
            let _: () = redis::cmd("CLUSTER")
                .arg("SETSLOT")
                .arg(slot)
                .arg(state)
                .arg(node)
                .query_async(conn)
                .await
                .unwrap_or_else(|e| panic!("CLUSTER SETSLOT {slot} {state}: {e}"));
        };
        setslot(&mut dst, "IMPORTING", &src_id).await;
        setslot(&mut src, "MIGRATING", &dst_id).await;
        loop {
            let keys: Vec<String> = redis::cmd("CLUSTER")
                .arg("GETKEYSINSLOT")
                .arg(slot)
                .arg(batch)
                .query_async(&mut src)
                .await
                .expect("CLUSTER GETKEYSINSLOT");
            if keys.is_empty() {
                break;
            }
            let mut migrate = redis::cmd("MIGRATE");
            migrate
                .arg("127.0.0.1")
                .arg(self.nodes[to].port())
                .arg("")
                .arg(0)
                .arg(10_000);
            if let Some(pw) = &self.password {
                migrate.arg("AUTH").arg(pw);
            }
            migrate.arg("KEYS").arg(&keys);
            let _: () = migrate
                .query_async(&mut src)
                .await
                .unwrap_or_else(|e| panic!("MIGRATE {keys:?}: {e}"));
            tokio::time::sleep(pause).await;
        }
        for i in 0..3 {
            if let Ok(mut conn) = self.nodes[i].try_conn().await {
                setslot(&mut conn, "NODE", &dst_id).await;
            }
        }
        setslot(&mut dst, "NODE", &dst_id).await;
        self.wait_healthy().await;
    }

    /// SIGKILL of node `i`.
    pub fn kill(&mut self, i: usize) {
        self.nodes[i].kill();
    }

    /// The indexes of the nodes running.
    fn live(&self) -> impl Iterator<Item = usize> + '_ {
        (0..self.nodes.len()).filter(|&i| self.nodes[i].pid().is_some())
    }

    /// Waits until every live node says the cluster is `ok` (every slot served, by a
    /// promoted replica where a primary was killed).
    pub async fn wait_healthy(&self) {
        let deadline = Instant::now() + SETTLE;
        'wait: loop {
            assert!(Instant::now() < deadline, "the cluster did not become ok");
            for i in self.live() {
                let Ok(mut conn) = self.nodes[i].try_conn().await else {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue 'wait;
                };
                let info: String = redis::cmd("CLUSTER")
                    .arg("INFO")
                    .query_async(&mut conn)
                    .await
                    .unwrap_or_default();
                if !info.contains("cluster_state:ok") {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue 'wait;
                }
            }
            return;
        }
    }

    /// Every node killed and started again empty, and the cluster created anew on the
    /// same ports: a cluster that lost all its data.
    pub async fn restart_empty(&mut self) {
        for n in &mut self.nodes {
            n.kill();
        }
        for n in &mut self.nodes {
            n.restart().await;
        }
        self.create().await;
    }
}

/// A primary and its replica, watched by three Sentinels (quorum 2) under the master
/// name [`TestSentinel::MASTER`].
pub struct TestSentinel {
    /// The two data nodes; which is primary changes with a failover.
    pub nodes: Vec<TestRedis>,
    sentinels: Vec<(u16, ChildGuard)>,
    _dir: TempDir,
}

impl TestSentinel {
    /// The master name the Sentinels monitor.
    pub const MASTER: &'static str = "fleet";

    /// Starts the primary, the replica and three Sentinels; returns once the Sentinels
    /// know the replica and each other.
    pub async fn start(server: &Path) -> TestSentinel {
        let primary = TestRedis::start(server).await;
        let port = primary.port().to_string();
        let replica = TestRedis::start_with(
            server,
            RedisOptions::new().args(&["--replicaof", "127.0.0.1", &port]),
        )
        .await;
        let dir = tempfile::Builder::new()
            .prefix("bloomgate-sentinel-")
            .tempdir()
            .expect("sentinel directory");
        let mut sentinels = Vec::new();
        for i in 0..3 {
            let sport = free_port();
            let conf = dir.path().join(format!("sentinel-{i}.conf"));
            std::fs::write(
                &conf,
                format!(
                    "port {sport}\nbind 127.0.0.1\ndir {}\n\
                     sentinel monitor {m} 127.0.0.1 {port} 2\n\
                     sentinel down-after-milliseconds {m} 1000\n\
                     sentinel failover-timeout {m} 5000\n\
                     sentinel parallel-syncs {m} 1\n",
                    dir.path().display(),
                    m = Self::MASTER,
                ),
            )
            .expect("write sentinel.conf");
            let log = std::fs::File::create(dir.path().join(format!("sentinel-{i}.log")))
                .expect("sentinel log");
            let mut cmd = Command::new(server);
            cmd.arg(&conf)
                .arg("--sentinel")
                .stdin(Stdio::null())
                .stdout(Stdio::from(log.try_clone().expect("log handle")))
                .stderr(Stdio::from(log));
            sentinels.push((sport, ChildGuard::spawn(&mut cmd)));
        }
        let s = TestSentinel {
            nodes: vec![primary, replica],
            sentinels,
            _dir: dir,
        };
        // Ready once every Sentinel sees the replica and the two other Sentinels.
        let deadline = Instant::now() + SETTLE;
        for (sport, _) in &s.sentinels {
            loop {
                assert!(Instant::now() < deadline, "sentinel {sport} did not settle");
                if let Some(info) = sentinel_master(*sport).await
                    && info.get("num-slaves").map(String::as_str) == Some("1")
                    && info.get("num-other-sentinels").map(String::as_str) == Some("2")
                {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
        s
    }

    /// `redis+sentinel://` naming the three Sentinels and the master.
    pub fn url(&self) -> String {
        let hosts: Vec<String> = self
            .sentinels
            .iter()
            .map(|(p, _)| format!("127.0.0.1:{p}"))
            .collect();
        format!("redis+sentinel://{}/{}", hosts.join(","), Self::MASTER)
    }

    /// The index in `nodes` of the node the Sentinels name primary.
    pub async fn primary(&self) -> Option<usize> {
        for (sport, _) in &self.sentinels {
            let Some(info) = sentinel_master(*sport).await else {
                continue;
            };
            let port: u16 = info.get("port")?.parse().ok()?;
            return self.nodes.iter().position(|n| n.port() == port);
        }
        None
    }

    /// Waits until the Sentinels name a primary other than `old` and it answers as one.
    pub async fn wait_promoted(&self, old: usize) -> usize {
        let deadline = Instant::now() + SETTLE;
        loop {
            assert!(Instant::now() < deadline, "no failover from node {old}");
            if let Some(now) = self.primary().await
                && now != old
                && let Ok(mut conn) = self.nodes[now].try_conn().await
            {
                let role: Vec<redis::Value> = redis::cmd("ROLE")
                    .query_async(&mut conn)
                    .await
                    .unwrap_or_default();
                if matches!(role.first(), Some(redis::Value::BulkString(r)) if r == b"master") {
                    return now;
                }
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

/// `SENTINEL MASTER` of the monitored master as a Sentinel answers it.
async fn sentinel_master(port: u16) -> Option<std::collections::HashMap<String, String>> {
    let client = redis::Client::open(format!("redis://127.0.0.1:{port}")).ok()?;
    let config = redis::AsyncConnectionConfig::new()
        .set_connection_timeout(Some(Duration::from_secs(1)))
        .set_response_timeout(Some(Duration::from_secs(2)));
    let mut conn = client
        .get_multiplexed_async_connection_with_config(&config)
        .await
        .ok()?;
    let flat: Vec<String> = redis::cmd("SENTINEL")
        .arg("MASTER")
        .arg(TestSentinel::MASTER)
        .query_async(&mut conn)
        .await
        .ok()?;
    Some(
        flat.chunks_exact(2)
            .map(|kv| (kv[0].clone(), kv[1].clone()))
            .collect(),
    )
}

/// A connection to the Redis `url` names (any of the forms `fleet.redis_url` takes),
/// made the way bloomgate makes its own.
pub fn fleet_conn(url: &str) -> bloomgate::redis_conn::RedisConn {
    let config: bloomgate::config::FleetConfig =
        serde_json::from_value(serde_json::json!({ "redis_url": url })).expect("fleet config");
    bloomgate::redis_conn::RedisConn::open(
        &config,
        bloomgate::redis_conn::Timeouts {
            connect: Duration::from_secs(5),
            response: Duration::from_secs(10),
            retry: Duration::from_millis(200),
        },
    )
    .expect("a connection to the test Redis")
}

/// The Redis a fleet test runs on: one server, or a cluster.
pub enum Backing {
    /// One `redis-server`.
    Single(TestRedis),
    /// A Redis Cluster of three primaries and three replicas.
    Cluster(TestCluster),
}

impl Backing {
    /// One server, or a cluster when `cluster`.
    pub async fn start(server: &Path, cluster: bool) -> Backing {
        if cluster {
            Backing::Cluster(TestCluster::start(server).await)
        } else {
            Backing::Single(TestRedis::start(server).await)
        }
    }

    /// `fleet.redis_url` for it.
    pub fn url(&self) -> String {
        match self {
            Backing::Single(r) => r.url(),
            Backing::Cluster(c) => c.url(),
        }
    }

    /// A connection of the test's own.
    pub fn conn(&self) -> bloomgate::redis_conn::RedisConn {
        fleet_conn(&self.url())
    }

    /// SIGKILL of the server, or of every node.
    pub fn kill(&mut self) {
        match self {
            Backing::Single(r) => r.kill(),
            Backing::Cluster(c) => {
                for n in &mut c.nodes {
                    n.kill();
                }
            }
        }
    }

    /// Back on the same ports with no data (a cluster created anew).
    pub async fn restart_empty(&mut self) {
        match self {
            Backing::Single(r) => r.restart().await,
            Backing::Cluster(c) => c.restart_empty().await,
        }
    }
}

/// The slot of `key`, as the node behind `conn` computes it.
async fn keyslot(conn: &mut MultiplexedConnection, key: &str) -> u16 {
    redis::cmd("CLUSTER")
        .arg("KEYSLOT")
        .arg(key)
        .query_async(conn)
        .await
        .expect("CLUSTER KEYSLOT")
}
