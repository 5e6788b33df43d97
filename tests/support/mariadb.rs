//! A MariaDB server of one test's own (`OwnMariaDb`), for tests that kill the database:
//! the shared server of `scripts/mariadb` must stay up for every other test. Its data
//! directory survives a SIGKILL, so a restart on the same port comes back with the data
//! (after InnoDB's crash recovery), as a database host that crashed would.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use sqlx::Connection;
use sqlx::mysql::MySqlConnection;
use tempfile::TempDir;

use super::ChildGuard;

const STARTUP_LIMIT: Duration = Duration::from_secs(60);

/// A `mariadbd` of the test's own; killed and its directory removed when dropped.
pub struct OwnMariaDb {
    server: PathBuf,
    /// Server options beyond the defaults (see [`OwnMariaDb::start_with`]).
    extra: Vec<String>,
    port: u16,
    root: TempDir,
    /// `None` while the server is killed.
    child: Option<ChildGuard>,
}

/// The first of `names` found in `PATH` or the sbin directories.
fn find(names: &[&str]) -> Option<PathBuf> {
    let path = std::env::var("PATH").unwrap_or_default();
    path.split(':')
        .chain(["/usr/sbin", "/usr/local/sbin", "/sbin"])
        .flat_map(|dir| names.iter().map(move |n| Path::new(dir).join(n)))
        .find(|p| p.is_file())
}

impl OwnMariaDb {
    /// Installs a fresh data directory and starts the server on a free loopback port,
    /// with a user `bloomgate`/`pw` that may do everything. Returns once it answers.
    pub async fn start() -> OwnMariaDb {
        Self::start_with(&[]).await
    }

    /// As [`OwnMariaDb::start`], with more server options, e.g.
    /// `--log-bin=binlog --server-id=7`; one that names `--log-bin` replaces the default
    /// `--skip-log-bin`.
    pub async fn start_with(extra: &[&str]) -> OwnMariaDb {
        let server = find(&["mariadbd", "mysqld"]).expect("mariadbd (scripts/test installs it)");
        let install = find(&["mariadb-install-db", "mysql_install_db"])
            .expect("mariadb-install-db (scripts/test installs it)");
        let root = tempfile::Builder::new()
            .prefix("bloomgate-own-mariadb-")
            .tempdir_in("/tmp")
            .expect("temporary directory for mariadbd");
        let mut cmd = Command::new(install);
        cmd.arg("--no-defaults")
            .arg(format!("--datadir={}", root.path().join("data").display()))
            .args(["--auth-root-authentication-method=normal", "--skip-test-db"])
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        if is_root() {
            cmd.arg("--user=root");
        }
        let status = cmd.status().expect("run mariadb-install-db");
        assert!(status.success(), "mariadb-install-db failed: {status}");
        let mut db = OwnMariaDb {
            server,
            extra: extra.iter().map(|s| (*s).to_owned()).collect(),
            port: 0,
            root,
            child: None,
        };
        for _ in 0..8 {
            db.port = std::net::TcpListener::bind("127.0.0.1:0")
                .and_then(|l| l.local_addr())
                .expect("bind 127.0.0.1:0")
                .port();
            if db.launch().await {
                db.create_user().await;
                return db;
            }
        }
        panic!("mariadbd found every port it was given taken");
    }

    /// `mysql://bloomgate:pw@127.0.0.1:PORT` (no database: `TestDb::create` makes one).
    pub fn url(&self) -> String {
        format!("mysql://bloomgate:pw@127.0.0.1:{}", self.port)
    }

    /// The port it listens on (127.0.0.1).
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The server's process id, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(|c| c.id())
    }

    /// SIGKILLs the server and waits until it is gone.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts the server again on the same port and data directory; returns once it
    /// answers.
    pub async fn restart(&mut self) {
        assert!(self.child.is_none(), "restart a server that is killed");
        assert!(
            self.launch().await,
            "port {} was taken meanwhile",
            self.port
        );
    }

    fn socket(&self) -> PathBuf {
        self.root.path().join("mariadb.sock")
    }

    /// Starts the server; false when the port is taken.
    async fn launch(&mut self) -> bool {
        let log = self.root.path().join("error.log");
        let _ = std::fs::remove_file(&log);
        let mut cmd = Command::new(&self.server);
        cmd.arg("--no-defaults")
            .arg(format!(
                "--datadir={}",
                self.root.path().join("data").display()
            ))
            .arg(format!("--socket={}", self.socket().display()))
            .arg(format!(
                "--pid-file={}",
                self.root.path().join("mariadb.pid").display()
            ))
            .arg(format!("--log-error={}", log.display()))
            .arg(format!("--tmpdir={}", self.root.path().display()))
            .arg(format!("--port={}", self.port))
            .args([
                "--bind-address=127.0.0.1",
                "--skip-name-resolve",
                "--innodb-buffer-pool-size=32M",
                "--innodb-log-file-size=8M",
                // Durable commits: the tests kill it and expect the rows back.
                "--innodb-flush-log-at-trx-commit=1",
                "--max-connections=200",
            ])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        if !self.extra.iter().any(|a| a.starts_with("--log-bin")) {
            cmd.arg("--skip-log-bin");
        }
        cmd.args(&self.extra);
        if is_root() {
            cmd.arg("--user=root");
        }
        let mut child = ChildGuard::spawn(&mut cmd);
        let deadline = Instant::now() + STARTUP_LIMIT;
        loop {
            if let Ok(Some(status)) = child.try_wait() {
                let output = std::fs::read_to_string(&log).unwrap_or_default();
                if output.contains("Address already in use") {
                    return false;
                }
                panic!("mariadbd exited ({status}) before answering:\n{output}");
            }
            if self.root_answers().await {
                self.child = Some(child);
                return true;
            }
            assert!(
                Instant::now() < deadline,
                "mariadbd did not answer within {STARTUP_LIMIT:?}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    async fn root_answers(&self) -> bool {
        let url = format!("mysql://root@localhost/?socket={}", self.socket().display());
        match MySqlConnection::connect(&url).await {
            Ok(c) => {
                let _ = c.close().await;
                true
            }
            Err(_) => false,
        }
    }

    async fn create_user(&self) {
        let url = format!("mysql://root@localhost/?socket={}", self.socket().display());
        let mut conn = MySqlConnection::connect(&url)
            .await
            .expect("connect as root over the socket");
        for stmt in [
            "CREATE USER 'bloomgate'@'%' IDENTIFIED BY 'pw'",
            "GRANT ALL ON *.* TO 'bloomgate'@'%' WITH GRANT OPTION",
        ] {
            sqlx::raw_sql(sqlx::AssertSqlSafe(stmt))
                .execute(&mut conn)
                .await
                .expect("create the test user");
        }
        let _ = conn.close().await;
    }
}

fn is_root() -> bool {
    // The effective uid, from /proc (no libc call needed).
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("Uid:"))
                .and_then(|l| l.split_whitespace().nth(2).map(|u| u == "0"))
        })
        .unwrap_or(false)
}
