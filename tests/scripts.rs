//! The scripts the test suite runs under: `scripts/mariadb` passes a signal on to its
//! command and everything that command started, then stops its MariaDB server and
//! removes the server's directory. Runs the real script, which starts a real server.
//!
//! Whatever happens to a test here, nothing the script started outlives it: the script
//! runs in a process group of its own under a [`Script`], which stops it with TERM (the
//! script's own clean-up) and, if that does not end it, kills every process it started.
//! Two tests check that, by process id and process group: one that fails, and one whose
//! command ignores TERM.

mod support;

use std::collections::HashSet;
use std::io::{BufRead, BufReader};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::Receiver;
use std::time::{Duration, Instant};

use support::{mysql_url, process_alive};

/// Polls (these are other processes) until `done` holds, failing after `limit`.
fn wait_until(what: &str, limit: Duration, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + limit;
    while !done() {
        assert!(Instant::now() < deadline, "{what}: not within {limit:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The server's PID and directory, from the line the script logs once it is up.
fn server_of(line: &str) -> Option<(u32, PathBuf)> {
    let rest = line.split_once(" (pid ")?.1;
    let (pid, rest) = rest.split_once(", data in ")?;
    let dir = rest.strip_suffix(')')?;
    Some((pid.parse().ok()?, PathBuf::from(dir)))
}

/// Sends `signal` to each of `pids` (a negative one names a process group).
fn signal(signal: &str, pids: &[i64]) {
    if pids.is_empty() {
        return;
    }
    let mut kill = Command::new("kill");
    kill.arg(format!("-{signal}")).arg("--");
    kill.args(pids.iter().map(i64::to_string));
    // Some may have exited meanwhile: kill then fails for those, and that is fine.
    let _ = kill.stdout(Stdio::null()).stderr(Stdio::null()).status();
}

/// Parent and process group of `pid`, from `/proc` (`None` once it is gone).
fn parent_and_group(pid: u32) -> Option<(u32, u32)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // After the command name (in parentheses): state, parent, process group.
    let mut fields = stat.rsplit_once(") ")?.1.split(' ').skip(1);
    Some((fields.next()?.parse().ok()?, fields.next()?.parse().ok()?))
}

/// Every process: (pid, parent, process group).
fn processes() -> Vec<(u32, u32, u32)> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
        .filter_map(|pid| parent_and_group(pid).map(|(parent, group)| (pid, parent, group)))
        .collect()
}

/// The live processes of process group `group`.
fn group_members(group: u32) -> Vec<u32> {
    processes()
        .into_iter()
        .filter(|&(pid, _, g)| g == group && process_alive(pid))
        .map(|(pid, _, _)| pid)
        .collect()
}

/// SIGKILLs `root`, every process below it and every process in the groups they are
/// in (other than this test's own): what a command left behind whose parent has gone
/// is found by its group. They are stopped first, until no new one appears, so that
/// none can start another between the search and the kill.
fn kill_everything_under(root: u32) {
    let own_group = parent_and_group(std::process::id()).map(|(_, g)| g);
    let mut stopped: HashSet<u32> = HashSet::new();
    loop {
        let all = processes();
        let mut tree: HashSet<u32> = HashSet::from([root]);
        loop {
            let below: Vec<u32> = all
                .iter()
                .filter(|(pid, parent, _)| tree.contains(parent) && !tree.contains(pid))
                .map(|&(pid, _, _)| pid)
                .collect();
            if below.is_empty() {
                break;
            }
            tree.extend(below);
        }
        let groups: HashSet<u32> = all
            .iter()
            .filter(|(pid, _, g)| tree.contains(pid) && Some(*g) != own_group)
            .map(|&(_, _, g)| g)
            .collect();
        let new: Vec<i64> = all
            .iter()
            .filter(|(pid, _, g)| {
                (tree.contains(pid) || groups.contains(g)) && stopped.insert(*pid)
            })
            .map(|&(pid, _, _)| i64::from(pid))
            .collect();
        if new.is_empty() {
            break;
        }
        signal("STOP", &new);
    }
    let all: Vec<i64> = stopped.into_iter().map(i64::from).collect();
    signal("KILL", &all);
}

/// `scripts/mariadb ARGS`, started in a process group of its own, its stderr read line by
/// line. Dropped while the script runs (the test failed, or left it running), it sends
/// the script TERM, which stops the command and the server and removes the server's
/// directory; if the script has not exited within `patience`, it SIGKILLs everything
/// the script started ([`kill_everything_under`]) and removes the server's directory
/// itself.
struct Script {
    child: Child,
    patience: Duration,
    lines: Receiver<String>,
    /// What the script said so far, for failure messages.
    said: Vec<String>,
    /// The server's directory, once the script has named it.
    dir: Option<PathBuf>,
}

impl Script {
    fn start(args: &[&str], patience: Duration) -> Script {
        let mut child = Command::new(Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/mariadb"))
            .args(args)
            .process_group(0)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start scripts/mariadb");
        let stderr = child.stderr.take().expect("stderr");
        let (tx, lines) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Script {
            child,
            patience,
            lines,
            said: Vec::new(),
            dir: None,
        }
    }

    fn id(&self) -> u32 {
        self.child.id()
    }

    /// Waits until the script says its server is up; returns the server's PID and
    /// directory.
    fn server(&mut self) -> (u32, PathBuf) {
        loop {
            let line = match self.lines.recv_timeout(Duration::from_secs(120)) {
                Ok(line) => line,
                Err(e) => panic!(
                    "scripts/mariadb did not start MariaDB within 120 s ({e}); it said:\n{}",
                    self.said.join("\n")
                ),
            };
            if let Some((pid, dir)) = server_of(&line) {
                self.dir = Some(dir.clone());
                return (pid, dir);
            }
            self.said.push(line);
        }
    }

    /// Waits until the script exits, at most `limit`; returns its exit status and all it
    /// said on stderr.
    fn finish(&mut self, limit: Duration) -> (std::process::ExitStatus, String) {
        let mut exit = None;
        wait_until("scripts/mariadb exited", limit, || {
            self.heard(Duration::ZERO);
            exit = self.child.try_wait().expect("wait");
            exit.is_some()
        });
        self.heard(Duration::from_secs(5));
        (exit.expect("an exit status"), self.said.join("\n"))
    }

    /// Takes in what the script has said, waiting up to `wait` for each line, and notes
    /// the server's directory if it is named.
    fn heard(&mut self, wait: Duration) {
        while let Ok(line) = self.lines.recv_timeout(wait) {
            if let Some((_, dir)) = server_of(&line) {
                self.dir = Some(dir);
            }
            self.said.push(line);
        }
    }
}

impl Drop for Script {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            signal("TERM", &[i64::from(self.id())]);
            let deadline = Instant::now() + self.patience;
            while matches!(self.child.try_wait(), Ok(None)) && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(20));
            }
            if let Ok(None) = self.child.try_wait() {
                kill_everything_under(self.id());
            }
        }
        let _ = self.child.wait();
        if let Some(dir) = &self.dir {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

/// A fresh directory for one test's files.
fn test_dir() -> PathBuf {
    let dir =
        std::env::temp_dir().join(format!("bloomgate-scripts-{:016x}", rand::random::<u64>()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    dir
}

/// A command that leaves a grandchild behind, as cargo leaves a test binary and a test
/// leaves Prometheus, and writes its own pid and the grandchild's to `pids`; with
/// `deaf`, both ignore TERM.
fn command_with_a_grandchild(pids: &Path, deaf: bool) -> Vec<String> {
    let trap = if deaf { "trap '' TERM; " } else { "" };
    vec![
        "sh".into(),
        "-c".into(),
        format!(r#"{trap}sleep 600 & echo "$$ $!" > "$1"; wait"#),
        "sh".into(),
        pids.display().to_string(),
    ]
}

/// Waits until the command has written its pid and its grandchild's; returns them, both
/// alive.
fn pids_written(pids: &Path) -> [u32; 2] {
    let mut written = String::new();
    wait_until(
        "the command wrote its pids",
        Duration::from_secs(60),
        || {
            written = std::fs::read_to_string(pids).unwrap_or_default();
            written.ends_with('\n')
        },
    );
    let started: Vec<u32> = written
        .split_whitespace()
        .map(|p| p.parse().expect("a pid"))
        .collect();
    let started: [u32; 2] = started.try_into().unwrap_or_else(|_| panic!("{written}"));
    assert!(started.iter().all(|p| process_alive(*p)), "{written}");
    started
}

/// What one run of the script started: the script, its server and that server's
/// directory, the command and the command's grandchild.
#[derive(Debug)]
struct Started {
    script: u32,
    server: u32,
    dir: PathBuf,
    command: u32,
    grandchild: u32,
}

impl Started {
    /// Checks where each process is: the server in the script's process group, the
    /// grandchild in the command's (the command leads one of its own), so that an empty
    /// group later means each of them is gone, and so is anything else started there.
    fn check_groups(&self) {
        assert!(process_alive(self.server), "mariadbd {}", self.server);
        assert!(self.dir.is_dir(), "{}", self.dir.display());
        assert_eq!(
            parent_and_group(self.server).map(|(_, g)| g),
            Some(self.script)
        );
        assert_eq!(
            parent_and_group(self.command).map(|(_, g)| g),
            Some(self.command)
        );
        assert_eq!(
            parent_and_group(self.grandchild).map(|(_, g)| g),
            Some(self.command)
        );
    }

    /// Waits until none of the processes lives and both process groups are empty, then
    /// checks that the server's directory is gone.
    fn assert_nothing_left(&self) {
        let lingering = || {
            [self.script, self.server, self.command, self.grandchild]
                .into_iter()
                .filter(|p| process_alive(*p))
                .chain(group_members(self.script))
                .chain(group_members(self.command))
                .collect::<Vec<u32>>()
        };
        let mut left = Vec::new();
        wait_until("every process gone", Duration::from_secs(30), || {
            left = lingering();
            left.is_empty()
        });
        assert!(left.is_empty(), "{self:?}: {left:?} still run");
        assert!(!self.dir.exists(), "{} left behind", self.dir.display());
    }
}

/// Starts the script with [`command_with_a_grandchild`] in a thread that then panics,
/// as a failing test would, with its [`Script`] still running; returns what was started.
fn started_by_a_failing_test(deaf: bool, patience: Duration) -> Started {
    let dir = test_dir();
    let pids = dir.join("pids");
    let (tx, rx) = std::sync::mpsc::channel();
    let failed = std::thread::spawn(move || {
        let args = command_with_a_grandchild(&pids, deaf);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let mut script = Script::start(&args, patience);
        let (server, dir) = script.server();
        let [command, grandchild] = pids_written(&pids);
        let started = Started {
            script: script.id(),
            server,
            dir,
            command,
            grandchild,
        };
        started.check_groups();
        tx.send(started).expect("send");
        panic!("a test that fails with scripts/mariadb running");
    })
    .join();
    assert!(failed.is_err(), "the thread was to fail");
    let _ = std::fs::remove_dir_all(&dir);
    rx.recv().expect("the thread started the script")
}

#[test]
fn a_signal_to_scripts_mariadb_stops_its_command_what_that_started_and_the_server() {
    // It starts MariaDB of its own, so it follows the MariaDB tests' skip rule.
    if mysql_url().is_none() {
        return;
    }
    let dir = test_dir();
    let pids = dir.join("pids");
    let args = command_with_a_grandchild(&pids, false);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut script = Script::start(&args, Duration::from_secs(60));
    let (server, data) = script.server();
    let [command, grandchild] = pids_written(&pids);
    let started = Started {
        script: script.id(),
        server,
        dir: data,
        command,
        grandchild,
    };
    started.check_groups();

    signal("TERM", &[i64::from(script.id())]);
    let (exit, said) = script.finish(Duration::from_secs(60));
    // The command was stopped by the signal, and the script says so.
    assert_eq!(exit.code(), Some(143), "{said}");
    started.assert_nothing_left();
    let _ = std::fs::remove_dir_all(&dir);
}

/// A test that fails while the script runs: its [`Script`] sends TERM on the way out, the
/// script stops its command and the server, and nothing of it is left.
#[test]
fn a_test_that_fails_leaves_no_process_of_scripts_mariadb_running() {
    if mysql_url().is_none() {
        return;
    }
    started_by_a_failing_test(false, Duration::from_secs(60)).assert_nothing_left();
}

/// A command that ignores TERM keeps the script waiting for it; the [`Script`] of a test
/// that fails then kills the script, the server, the command and its grandchild after a
/// while, and removes the server's directory.
#[test]
fn a_command_deaf_to_term_is_killed_with_all_the_script_started() {
    if mysql_url().is_none() {
        return;
    }
    let started = started_by_a_failing_test(true, Duration::from_secs(2));
    started.assert_nothing_left();
}

/// `$BLOOMGATE_MARIADB_RESTART` SIGKILLs the server and starts it again on the same port
/// with its data; once the command ends, the script stops that restarted server too and
/// removes its directory.
#[test]
fn the_restart_command_brings_the_server_back_and_the_script_still_cleans_up() {
    if mysql_url().is_none() {
        return;
    }
    let dir = test_dir();
    let out = dir.join("out");
    // Inside: a durable row, the pid, the restart, the new pid and the row again.
    let inner = r#"
        set -e
        port="${BLOOMGATE_TEST_MYSQL_URL##*:}"; rest="${BLOOMGATE_TEST_MYSQL_URL#mysql://bloomgate:}"
        q() { MYSQL_PWD="${rest%@*}" mariadb --no-defaults -h127.0.0.1 -P"$port" -ubloomgate -N -B -e "$1"; }
        q "SET GLOBAL innodb_flush_log_at_trx_commit = 1; CREATE DATABASE r; CREATE TABLE r.t (a INT) ENGINE=InnoDB; INSERT INTO r.t VALUES (7)"
        before="$(cat "$(q 'SELECT @@pid_file')")"
        "$BLOOMGATE_MARIADB_RESTART"
        after="$(cat "$(q 'SELECT @@pid_file')")"
        echo "$before $after $(q 'SELECT a FROM r.t') $(q 'SELECT @@datadir')" > "$1"
    "#;
    let out_arg = out.display().to_string();
    let mut script = Script::start(
        &["bash", "-c", inner, "bash", &out_arg],
        Duration::from_secs(60),
    );
    let (exit, said) = script.finish(Duration::from_secs(240));
    assert!(exit.success(), "{exit}: {said}");
    let written = std::fs::read_to_string(&out).expect("the command's output");
    let fields: Vec<&str> = written.split_whitespace().collect();
    assert_eq!(fields.len(), 4, "{written}");
    let (before, after): (u32, u32) = (
        fields[0].parse().expect("a pid"),
        fields[1].parse().expect("a pid"),
    );
    assert_ne!(before, after, "a new server process");
    assert_eq!(fields[2], "7", "the committed row survived the SIGKILL");
    assert!(!process_alive(before) && !process_alive(after), "{written}");
    assert!(
        !Path::new(fields[3]).exists(),
        "{} was left behind",
        fields[3]
    );
    let _ = std::fs::remove_dir_all(&dir);
}
