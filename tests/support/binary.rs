//! The real `bloomgate` binary as a child process: `serve` on a config written to a
//! temporary directory, JSON log lines read from its standard output as they come (the
//! test waits on a line, never on a clock), signals, and the exit status. The child is
//! killed by its own handle, and the directory removed, when this is dropped.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use serde_json::Value;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};
use tokio::sync::mpsc;

/// The binary under test.
pub const BIN: &str = env!("CARGO_BIN_EXE_bloomgate");

/// A running `bloomgate serve`.
pub struct Bloomgate {
    child: Child,
    /// Data-plane address, from the "bloomgate listening" log line.
    pub data: SocketAddr,
    /// Admin-plane address, from the same line.
    pub admin: SocketAddr,
    lines: mpsc::UnboundedReceiver<Value>,
    seen: Vec<Value>,
    dir: PathBuf,
}

impl Bloomgate {
    /// Writes `config` to a temporary file and runs `bloomgate serve --config FILE
    /// --log-format json` with `env` added to a clean environment (no inherited
    /// `BLOOMGATE__…` or `RUST_LOG`); returns once it has logged its addresses.
    pub async fn serve(config: &str, env: &[(&str, &str)]) -> Bloomgate {
        let dir =
            std::env::temp_dir().join(format!("bloomgate-bin-{:016x}", rand::random::<u64>()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let path = dir.join("config.toml");
        std::fs::write(&path, config).expect("write config");
        let mut cmd = Command::new(BIN);
        cmd.arg("serve")
            .arg("--config")
            .arg(&path)
            .args(["--log-format", "json"])
            .env_remove("RUST_LOG")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true);
        for (name, _) in std::env::vars_os() {
            if name.to_string_lossy().starts_with("BLOOMGATE__") {
                cmd.env_remove(name);
            }
        }
        cmd.envs(env.iter().copied());
        // A plane whose address neither the config nor the caller gives would bind the
        // defaults (0.0.0.0:8080, 127.0.0.1:9090) and collide with whatever holds them.
        for (section, var) in [
            ("server", "BLOOMGATE__SERVER__LISTEN"),
            ("admin", "BLOOMGATE__ADMIN__LISTEN"),
        ] {
            if !sets_listen(config, section) && !env.iter().any(|(name, _)| *name == var) {
                cmd.env(var, "127.0.0.1:0");
            }
        }
        let mut child = cmd.spawn().expect("start bloomgate");
        let stdout = child.stdout.take().expect("stdout");
        let (tx, lines) = mpsc::unbounded_channel();
        tokio::spawn(async move {
            let mut reader = BufReader::new(stdout).lines();
            while let Ok(Some(line)) = reader.next_line().await {
                let value = serde_json::from_str(&line)
                    .unwrap_or_else(|_| serde_json::json!({ "raw": line }));
                if tx.send(value).is_err() {
                    break;
                }
            }
        });
        let mut running = Bloomgate {
            child,
            data: SocketAddr::from(([127, 0, 0, 1], 0)),
            admin: SocketAddr::from(([127, 0, 0, 1], 0)),
            lines,
            seen: Vec::new(),
            dir,
        };
        let listening = running
            .wait_for_log("the listening line", Duration::from_secs(30), |l| {
                message(l) == "bloomgate listening"
            })
            .await;
        let addr = |field: &str| -> SocketAddr {
            listening["fields"][field]
                .as_str()
                .and_then(|a| a.parse().ok())
                .unwrap_or_else(|| panic!("no {field} address in {listening}"))
        };
        running.data = addr("data");
        running.admin = addr("admin");
        running
    }

    /// Waits until a log line matches `matches` (lines already read count too); returns it.
    pub async fn wait_for_log(
        &mut self,
        what: &str,
        limit: Duration,
        matches: impl Fn(&Value) -> bool,
    ) -> Value {
        self.wait_for_logs(what, 1, limit, &matches).await.remove(0)
    }

    /// Waits until `n` log lines match `matches`; returns every matching line so far.
    pub async fn wait_for_logs(
        &mut self,
        what: &str,
        n: usize,
        limit: Duration,
        matches: impl Fn(&Value) -> bool,
    ) -> Vec<Value> {
        let deadline = tokio::time::Instant::now() + limit;
        loop {
            let found: Vec<Value> = self.seen.iter().filter(|l| matches(l)).cloned().collect();
            if found.len() >= n {
                return found;
            }
            match tokio::time::timeout_at(deadline, self.lines.recv()).await {
                Ok(Some(line)) => self.seen.push(line),
                Ok(None) => panic!(
                    "{what}: bloomgate closed its output after {} lines; last: {:?}",
                    self.seen.len(),
                    self.seen.last()
                ),
                Err(_) => panic!(
                    "{what}: {} of {n} lines within {limit:?}; lines so far: {:#?}",
                    found.len(),
                    self.seen
                ),
            }
        }
    }

    /// Replaces the config file it was started with (written whole, then renamed over
    /// the old one, as a deploy tool would), for a reload to read.
    pub fn rewrite_config(&self, config: &str) {
        let next = self.dir.join("config.toml.next");
        std::fs::write(&next, config).expect("write the new config");
        std::fs::rename(&next, self.dir.join("config.toml")).expect("replace the config");
    }

    /// Log lines read so far that match `matches`.
    pub fn logged(&self, matches: impl Fn(&Value) -> bool) -> Vec<Value> {
        self.seen.iter().filter(|l| matches(l)).cloned().collect()
    }

    /// Sends a signal by name (`"INT"`, `"TERM"`) to the child's process id.
    pub fn signal(&self, name: &str) {
        let pid = self.child.id().expect("bloomgate is still running");
        let status = std::process::Command::new("kill")
            .arg(format!("-{name}"))
            .arg(pid.to_string())
            .status()
            .expect("run kill");
        assert!(status.success(), "kill -{name} {pid} failed");
    }

    /// Waits for the child to exit; its exit code (`None`: killed by a signal).
    pub async fn wait_exit(&mut self, limit: Duration) -> Option<i32> {
        tokio::time::timeout(limit, self.child.wait())
            .await
            .unwrap_or_else(|_| panic!("bloomgate still running after {limit:?}"))
            .expect("wait for bloomgate")
            .code()
    }
}

impl Drop for Bloomgate {
    fn drop(&mut self) {
        let _ = self.child.start_kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The `message` of a JSON log line ("" when it has none).
pub fn message(line: &Value) -> &str {
    line["fields"]["message"].as_str().unwrap_or("")
}

/// Whether the `[section]` table of a TOML config sets `listen`.
fn sets_listen(config: &str, section: &str) -> bool {
    let header = format!("[{section}]");
    let mut inside = false;
    for line in config.lines().map(str::trim) {
        if line.starts_with('[') {
            inside = line == header;
        } else if inside
            && line
                .strip_prefix("listen")
                .is_some_and(|rest| rest.trim_start().starts_with('='))
        {
            return true;
        }
    }
    false
}
