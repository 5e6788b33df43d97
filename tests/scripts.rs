//! The scripts the test suite runs under: `scripts/mariadb` passes a signal on to its
//! command and everything that command started, then stops its MariaDB server and
//! removes the server's directory. Runs the real script, which starts a real server.

mod support;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use support::{ChildGuard, mysql_url, process_alive};

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

#[test]
fn a_signal_to_scripts_mariadb_stops_its_command_what_that_started_and_the_server() {
    // It starts MariaDB of its own, so it follows the MariaDB tests' skip rule.
    if mysql_url().is_none() {
        return;
    }
    let dir =
        std::env::temp_dir().join(format!("bloomgate-scripts-{:016x}", rand::random::<u64>()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let pids = dir.join("pids");
    // The command leaves a grandchild behind, as cargo leaves a test binary and a test
    // leaves Prometheus.
    let mut script = ChildGuard::spawn(
        Command::new(Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/mariadb"))
            .args(["sh", "-c", r#"sleep 600 & echo "$$ $!" > "$1"; wait"#, "sh"])
            .arg(&pids)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped()),
    );
    let stderr = script.stderr.take().expect("stderr");
    let (tx, lines) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let mut said = Vec::new();
    let (server, data) = loop {
        let line = match lines.recv_timeout(Duration::from_secs(120)) {
            Ok(line) => line,
            Err(e) => panic!(
                "scripts/mariadb did not start MariaDB within 120 s ({e}); it said:\n{}",
                said.join("\n")
            ),
        };
        if let Some(found) = server_of(&line) {
            break found;
        }
        said.push(line);
    };
    assert!(process_alive(server), "mariadbd {server}");
    assert!(data.is_dir(), "{}", data.display());
    let mut written = String::new();
    wait_until(
        "the command wrote its pids",
        Duration::from_secs(60),
        || {
            written = std::fs::read_to_string(&pids).unwrap_or_default();
            written.ends_with('\n')
        },
    );
    let started: Vec<u32> = written
        .split_whitespace()
        .map(|p| p.parse().expect("a pid"))
        .collect();
    assert_eq!(started.len(), 2, "{written}");
    assert!(started.iter().all(|p| process_alive(*p)), "{written}");

    let status = Command::new("kill")
        .args(["-TERM", &script.id().to_string()])
        .status()
        .expect("kill");
    assert!(status.success());
    let mut exit = None;
    wait_until("scripts/mariadb exited", Duration::from_secs(60), || {
        exit = script.try_wait().expect("wait");
        exit.is_some()
    });
    // The command was stopped by the signal, and the script says so.
    assert_eq!(exit.and_then(|s| s.code()), Some(143));
    let lingering = || {
        started
            .iter()
            .copied()
            .chain([server])
            .filter(|p| process_alive(*p))
            .collect::<Vec<u32>>()
    };
    wait_until("every process gone", Duration::from_secs(30), || {
        lingering().is_empty()
    });
    assert!(!data.exists(), "{} left behind", data.display());
    let _ = std::fs::remove_dir_all(&dir);
}

/// `$BLOOMGATE_MARIADB_RESTART` SIGKILLs the server and starts it again on the same port
/// with its data; once the command ends, the script stops that restarted server too and
/// removes its directory.
#[test]
fn the_restart_command_brings_the_server_back_and_the_script_still_cleans_up() {
    if mysql_url().is_none() {
        return;
    }
    let dir =
        std::env::temp_dir().join(format!("bloomgate-scripts-{:016x}", rand::random::<u64>()));
    std::fs::create_dir_all(&dir).expect("temp dir");
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
    let status = Command::new(Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/mariadb"))
        .args(["bash", "-c", inner, "bash"])
        .arg(&out)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .output()
        .expect("run scripts/mariadb");
    assert!(
        status.status.success(),
        "{}: {}",
        status.status,
        String::from_utf8_lossy(&status.stderr)
    );
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
