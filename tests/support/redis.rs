//! A throwaway Redis per test (`TestRedis`): a real `redis-server` on 127.0.0.1 at a free
//! port, in a temporary directory of its own, that the test can kill, restart empty,
//! start again on the data it kept, or freeze. Each test owns its server, so killing one
//! disturbs no other test. Nothing here is shared between tests, and nothing is tuned
//! beyond the defaults below and what a test asks for.
//!
//! The defaults: no snapshots (`--save ""`), no append-only file, and
//! `--maxmemory-policy noeviction`, the policy bloomgate's fleet mode needs (an evicted
//! snapshot chunk or stream entry would be a silent hole).

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use percent_encoding::{NON_ALPHANUMERIC, utf8_percent_encode};
use redis::aio::MultiplexedConnection;
use redis::{AsyncConnectionConfig, RedisResult};
use tempfile::TempDir;

use super::ChildGuard;

/// The variable that names the `redis-server` binary the tests use.
pub const REDIS_SERVER_VAR: &str = "BLOOMGATE_TEST_REDIS_SERVER";

/// How long a started server has to answer PING.
const STARTUP_LIMIT: Duration = Duration::from_secs(30);

/// How many ports a start tries when another process takes the one it picked.
const PORT_ATTEMPTS: usize = 10;

/// The `redis-server` binary: the path `scripts/test` exports in
/// `BLOOMGATE_TEST_REDIS_SERVER`, else `redis-server` on `PATH`.
///
/// The skip rule is the MariaDB tests' ([`super::mysql_url`]): when neither is found, a
/// Redis test fails if `CI` is set to anything but the empty string; otherwise it passes
/// without running, and the binary says so once on stderr, past libtest's capture.
pub fn redis_server() -> Option<PathBuf> {
    static NOTICE: std::sync::Once = std::sync::Once::new();
    if let Some(path) = std::env::var_os(REDIS_SERVER_VAR).filter(|v| !v.is_empty()) {
        let path = PathBuf::from(path);
        assert!(
            path.is_file(),
            "{REDIS_SERVER_VAR} names {}, which is not a file",
            path.display()
        );
        return Some(path);
    }
    let on_path = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .unwrap_or_default()
        .into_iter()
        .map(|dir| dir.join("redis-server"))
        .find(|p| p.is_file());
    if on_path.is_some() {
        return on_path;
    }
    let ci = std::env::var_os("CI").is_some_and(|v| !v.is_empty());
    assert!(
        !ci,
        "redis-server not found ({REDIS_SERVER_VAR} unset, none on PATH) but CI is set: \
         run the tests through scripts/test"
    );
    NOTICE.call_once(|| {
        use std::io::Write as _;
        // Straight to the process's stderr: libtest captures eprintln!.
        let _ = writeln!(
            std::io::stderr(),
            "skipping the Redis tests of this binary: no redis-server \
             ({REDIS_SERVER_VAR} unset, none on PATH; scripts/test installs it; with CI set \
             they fail instead)"
        );
    });
    None
}

/// How a [`TestRedis`] is started, beyond the defaults.
#[derive(Debug, Clone, Default)]
pub struct RedisOptions {
    /// `requirepass`: the default user's password.
    password: Option<String>,
    /// An ACL user with every permission; the default user is then switched off.
    user: Option<(String, String)>,
    /// An append-only file, written before every reply (`appendfsync always`), so what
    /// was acknowledged survives SIGKILL.
    appendonly: bool,
    /// Further `redis-server` arguments, after all of the above.
    args: Vec<String>,
}

impl RedisOptions {
    /// The defaults: no password, no persistence, `noeviction`.
    pub fn new() -> RedisOptions {
        RedisOptions::default()
    }

    /// Requires `password` of the default user; [`TestRedis::url`] carries it.
    pub fn password(mut self, password: &str) -> RedisOptions {
        self.password = Some(password.to_owned());
        self
    }

    /// Adds the ACL user `name` with `password` and every permission, and switches the
    /// default user off; [`TestRedis::url`] names this user.
    pub fn acl_user(mut self, name: &str, password: &str) -> RedisOptions {
        self.user = Some((name.to_owned(), password.to_owned()));
        self
    }

    /// Keeps an append-only file, synced before each reply, in the server's directory:
    /// [`TestRedis::start_again_with`] then finds the data that was written.
    pub fn appendonly(mut self) -> RedisOptions {
        self.appendonly = true;
        self
    }

    /// Adds raw `redis-server` arguments, such as `["--maxmemory", "2mb"]`.
    pub fn args(mut self, args: &[&str]) -> RedisOptions {
        self.args.extend(args.iter().map(|a| (*a).to_owned()));
        self
    }
}

/// Why a launch did not give a running server the caller can retry.
enum Launch {
    /// Another process holds the port.
    PortTaken,
}

/// A `redis-server` of one test's own, killed and its directory removed when dropped.
pub struct TestRedis {
    bin: PathBuf,
    options: RedisOptions,
    port: u16,
    /// Holds `data/` (the server's `--dir`) and `redis.log` (its output, across restarts).
    root: TempDir,
    /// `None` while the server is killed.
    child: Option<ChildGuard>,
}

impl TestRedis {
    /// Starts `server` (from [`redis_server`]) with the defaults; returns once it answers.
    pub async fn start(server: &Path) -> TestRedis {
        TestRedis::start_with(server, RedisOptions::new()).await
    }

    /// Starts `server` with `options`; returns once it answers PING.
    pub async fn start_with(server: &Path, options: RedisOptions) -> TestRedis {
        let root = tempfile::Builder::new()
            .prefix("bloomgate-redis-")
            .tempdir()
            .expect("temporary directory for redis-server");
        std::fs::create_dir(root.path().join("data")).expect("redis data directory");
        let mut redis = TestRedis {
            bin: server.to_owned(),
            options,
            port: 0,
            root,
            child: None,
        };
        for _ in 0..PORT_ATTEMPTS {
            redis.port = free_port();
            match redis.launch(&[]).await {
                Ok(()) => return redis,
                Err(Launch::PortTaken) => continue,
            }
        }
        panic!("redis-server found every port it was given taken ({PORT_ATTEMPTS} tries)");
    }

    /// `redis://[user:password@]127.0.0.1:PORT`, with the credentials the options set.
    pub fn url(&self) -> String {
        let enc = |s: &str| utf8_percent_encode(s, NON_ALPHANUMERIC).to_string();
        let auth = match (&self.options.user, &self.options.password) {
            (Some((name, password)), _) => format!("{}:{}@", enc(name), enc(password)),
            (None, Some(password)) => format!(":{}@", enc(password)),
            (None, None) => String::new(),
        };
        format!("redis://{auth}127.0.0.1:{}", self.port)
    }

    /// The server's address without credentials, for testing that they are required.
    pub fn url_without_credentials(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// The port it listens on, the same across restarts.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The server's process id, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(|c| c.id())
    }

    /// A new connection (5 s to connect, 10 s per reply); fails the test if there is none.
    pub async fn conn(&self) -> MultiplexedConnection {
        self.try_conn()
            .await
            .unwrap_or_else(|e| panic!("connect to the test Redis at {}: {e}", self.port))
    }

    /// A new connection, or the error a client would get.
    pub async fn try_conn(&self) -> RedisResult<MultiplexedConnection> {
        connect(&self.url(), Duration::from_secs(5), Duration::from_secs(10)).await
    }

    /// SIGKILL, then reaps it; the port is free until [`TestRedis::restart`] or
    /// [`TestRedis::start_again_with`]. Does nothing if it is already killed.
    pub fn kill(&mut self) {
        // ChildGuard's drop kills and reaps.
        drop(self.child.take());
    }

    /// Kills the server if it runs, empties its directory and starts it again on the
    /// same port with the same options: an empty Redis at the same address.
    pub async fn restart(&mut self) {
        self.kill();
        let data = self.data_dir();
        std::fs::remove_dir_all(&data).expect("empty the redis data directory");
        std::fs::create_dir(&data).expect("redis data directory");
        self.relaunch(&[]).await;
    }

    /// Kills the server if it runs and starts it again on the same port and directory,
    /// with the same options and `extra` arguments after them: with
    /// [`RedisOptions::appendonly`], it comes back with the data that was written.
    pub async fn start_again_with(&mut self, extra: &[&str]) {
        self.kill();
        self.relaunch(extra).await;
    }

    /// Stops the server with SIGSTOP: connections stay open and commands go unanswered
    /// until [`TestRedis::thaw`].
    pub fn freeze(&self) {
        self.signal("STOP");
    }

    /// Resumes a frozen server with SIGCONT.
    pub fn thaw(&self) {
        self.signal("CONT");
    }

    /// What the server has written to its standard output and error, across restarts.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.log_path()).unwrap_or_default()
    }

    fn data_dir(&self) -> PathBuf {
        self.root.path().join("data")
    }

    fn log_path(&self) -> PathBuf {
        self.root.path().join("redis.log")
    }

    fn signal(&self, signal: &str) {
        let pid = self.pid().expect("the test Redis is running");
        let status = Command::new("kill")
            .arg(format!("-{signal}"))
            .arg(pid.to_string())
            .status()
            .expect("run kill");
        assert!(status.success(), "kill -{signal} {pid}: {status}");
    }

    async fn relaunch(&mut self, extra: &[&str]) {
        if let Err(Launch::PortTaken) = self.launch(extra).await {
            panic!(
                "port {} was taken while the test Redis was down:\n{}",
                self.port,
                self.log()
            );
        }
    }

    /// Starts the process on `self.port` and waits until it answers as itself.
    async fn launch(&mut self, extra: &[&str]) -> Result<(), Launch> {
        let log = File::options()
            .create(true)
            .append(true)
            .open(self.log_path())
            .expect("open the redis log");
        let log_from = log.metadata().map(|m| m.len()).unwrap_or(0);
        let stderr = log.try_clone().expect("clone the redis log handle");
        let mut cmd = Command::new(&self.bin);
        cmd.args(["--bind", "127.0.0.1", "--port"])
            .arg(self.port.to_string())
            .arg("--dir")
            .arg(self.data_dir())
            .args(["--daemonize", "no", "--logfile", ""])
            .args(["--save", ""])
            .args(["--maxmemory-policy", "noeviction"]);
        if self.options.appendonly {
            cmd.args(["--appendonly", "yes", "--appendfsync", "always"]);
        } else {
            cmd.args(["--appendonly", "no"]);
        }
        if let Some(password) = &self.options.password {
            cmd.arg("--requirepass").arg(password);
        }
        if let Some((name, password)) = &self.options.user {
            // Each word after `--user` is one rule of that user.
            cmd.arg("--user")
                .arg(name)
                .args(["on", &format!(">{password}"), "~*", "&*", "+@all"]);
            cmd.args(["--user", "default", "off"]);
        }
        cmd.args(&self.options.args)
            .args(extra)
            .stdin(Stdio::null())
            .stdout(Stdio::from(log))
            .stderr(Stdio::from(stderr));
        let mut child = ChildGuard::spawn(&mut cmd);
        let pid = child.id();
        let deadline = Instant::now() + STARTUP_LIMIT;
        loop {
            if let Ok(Some(status)) = child.try_wait() {
                let output = self.log_since(log_from);
                if output.contains("Address already in use") {
                    return Err(Launch::PortTaken);
                }
                panic!("redis-server exited ({status}) before answering:\n{output}");
            }
            match serving_pid(&self.url()).await {
                Some(p) if p == pid => {
                    self.child = Some(child);
                    return Ok(());
                }
                // Another server answers on the port we picked: ours cannot bind it.
                Some(_) => return Err(Launch::PortTaken),
                None => {}
            }
            assert!(
                Instant::now() < deadline,
                "redis-server did not answer within {STARTUP_LIMIT:?}:\n{}",
                self.log_since(log_from)
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    fn log_since(&self, offset: u64) -> String {
        let log = self.log();
        log.get(offset as usize..).unwrap_or(&log).to_owned()
    }
}

/// A free port on 127.0.0.1 at the time of asking; whoever binds it first gets it.
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("bind 127.0.0.1:0")
        .port()
}

async fn connect(
    url: &str,
    connect_within: Duration,
    reply_within: Duration,
) -> RedisResult<MultiplexedConnection> {
    let config = AsyncConnectionConfig::new()
        .set_connection_timeout(Some(connect_within))
        .set_response_timeout(Some(reply_within));
    redis::Client::open(url)?
        .get_multiplexed_async_connection_with_config(&config)
        .await
}

/// The `process_id` of the server answering at `url`, if one answers (PING first).
async fn serving_pid(url: &str) -> Option<u32> {
    let mut conn = connect(url, Duration::from_secs(1), Duration::from_secs(5))
        .await
        .ok()?;
    redis::cmd("PING")
        .query_async::<String>(&mut conn)
        .await
        .ok()?;
    let info: String = redis::cmd("INFO")
        .arg("server")
        .query_async(&mut conn)
        .await
        .ok()?;
    info.lines()
        .find_map(|l| l.strip_prefix("process_id:"))
        .and_then(|pid| pid.trim().parse().ok())
}
