//! The access log: one line per data-plane request (or per sampled request), as a JSON
//! object or a compact text line, written by a task of its own to standard output or to a
//! file that is reopened on SIGUSR1 (after a log rotation moved it). A request never
//! waits on the log: lines go through a bounded queue, and when it is full the line is
//! dropped and counted.

use std::io::Write;
use std::net::IpAddr;
use std::path::PathBuf;
use std::time::Duration;

use prometheus::IntCounter;
use serde::Serialize;
use tokio::sync::mpsc;

use crate::config::{AccessLogConfig, AccessLogFormat};
use crate::report::Chain;

/// Lines waiting for the writer; past this, lines are dropped.
const QUEUE: usize = 65_536;

/// Why the access log could not be opened.
#[derive(Debug, thiserror::Error)]
pub enum AccessLogError {
    /// The file could not be opened for appending.
    #[error("cannot open the access log {path}")]
    Open {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
}

/// One request, as logged.
#[derive(Debug, Serialize)]
pub struct Entry<'a> {
    /// When it ended, RFC 3339 with milliseconds, UTC.
    pub time: String,
    /// The client: the peer, or what a trusted proxy reported.
    pub client: IpAddr,
    /// The request method.
    pub method: &'a str,
    /// The request target (path and query) as received.
    pub path: &'a str,
    /// The status answered.
    pub status: u16,
    /// The stage that answered (`x-bloomgate`'s value, `bypass` for pass-through).
    pub outcome: &'a str,
    /// The guarded route's name, `-` for pass-through.
    pub route: &'a str,
    /// Body bytes answered, when known before it is sent (`None` for a streamed body).
    pub bytes: Option<u64>,
    /// Time from the request head to the response head, in milliseconds.
    pub duration_ms: f64,
}

/// The sending side, held by the data plane.
pub struct AccessLog {
    lines: mpsc::Sender<String>,
    format: AccessLogFormat,
    sample: f64,
    queued: IntCounter,
    dropped: IntCounter,
}

impl AccessLog {
    /// Opens the destination (so that a bad path fails at start) and starts the writer
    /// task. `counters` count the lines queued, written and dropped (the queue was full).
    pub fn start(
        config: &AccessLogConfig,
        counters: [IntCounter; 3],
    ) -> Result<AccessLog, AccessLogError> {
        let [queued, written, dropped] = counters;
        let sink = Sink::open(config.path.as_deref())?;
        let (lines, queue) = mpsc::channel(QUEUE);
        tokio::spawn(write_loop(sink, queue, written));
        Ok(AccessLog {
            lines,
            format: config.format,
            sample: config.sample,
            queued,
            dropped,
        })
    }

    /// Whether this request is logged (`sample` of them, drawn at random).
    pub fn sampled(&self) -> bool {
        self.sample >= 1.0 || rand::random::<f64>() < self.sample
    }

    /// Queues one line; drops it (counted) when the writer is behind.
    pub fn record(&self, entry: &Entry<'_>) {
        let line = match self.format {
            AccessLogFormat::Json => serde_json::to_string(entry).unwrap_or_default(),
            AccessLogFormat::Text => text_line(entry),
        };
        if self.lines.try_send(line).is_ok() {
            self.queued.inc();
        } else {
            self.dropped.inc();
        }
    }
}

/// `time client "method path" status outcome route bytes duration_ms`.
///
/// The request target is the client's to spell: `"`, `\` and bytes outside printable
/// ASCII (the URI parser lets `"` and UTF-8 through) are written as `\xHH`, so that a
/// line always has its nine fields and a crafted path cannot forge another.
fn text_line(e: &Entry<'_>) -> String {
    use std::fmt::Write as _;
    let mut line = String::with_capacity(96 + e.path.len());
    let _ = write!(line, "{} {} \"", e.time, e.client);
    escape_into(&mut line, e.method);
    line.push(' ');
    escape_into(&mut line, e.path);
    let _ = write!(line, "\" {} {} ", e.status, e.outcome);
    escape_into(&mut line, e.route);
    match e.bytes {
        Some(b) => {
            let _ = write!(line, " {b}");
        }
        None => line.push_str(" -"),
    }
    let _ = write!(line, " {:.3}", e.duration_ms);
    line
}

/// Appends `text` with `"`, `\`, space and every byte outside printable ASCII written as
/// `\xHH`.
fn escape_into(line: &mut String, text: &str) {
    use std::fmt::Write as _;
    for &b in text.as_bytes() {
        if b.is_ascii_graphic() && b != b'"' && b != b'\\' {
            line.push(char::from(b));
        } else {
            let _ = write!(line, "\\x{b:02X}");
        }
    }
}

/// The current time for [`Entry::time`].
pub fn now() -> String {
    chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Millis, true)
}

/// Milliseconds, for [`Entry::duration_ms`].
pub fn millis(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// Where lines go.
enum Sink {
    Stdout,
    File {
        path: PathBuf,
        file: std::io::BufWriter<std::fs::File>,
    },
}

impl Sink {
    fn open(path: Option<&std::path::Path>) -> Result<Sink, AccessLogError> {
        match path {
            None => Ok(Sink::Stdout),
            Some(p) if p.as_os_str() == "-" => Ok(Sink::Stdout),
            Some(p) => Ok(Sink::File {
                path: p.to_owned(),
                file: std::io::BufWriter::new(append(p).map_err(|source| {
                    AccessLogError::Open {
                        path: p.to_owned(),
                        source,
                    }
                })?),
            }),
        }
    }

    fn write(&mut self, line: &str) -> std::io::Result<()> {
        match self {
            Sink::Stdout => {
                let mut out = std::io::stdout().lock();
                out.write_all(line.as_bytes())?;
                out.write_all(b"\n")
            }
            Sink::File { file, .. } => {
                file.write_all(line.as_bytes())?;
                file.write_all(b"\n")
            }
        }
    }

    fn flush(&mut self) -> std::io::Result<()> {
        match self {
            Sink::Stdout => std::io::stdout().flush(),
            Sink::File { file, .. } => file.flush(),
        }
    }

    /// Opens the file again at its path (the old one was moved away by a rotation).
    fn reopen(&mut self) {
        if let Sink::File { path, file } = self {
            let _ = file.flush();
            match append(path) {
                Ok(f) => {
                    *file = std::io::BufWriter::new(f);
                    tracing::info!(path = %path.display(), "access log reopened");
                }
                Err(e) => {
                    tracing::error!(path = %path.display(), error = %Chain(&e),
                        "cannot reopen the access log; writing on to the old file")
                }
            }
        }
    }
}

fn append(path: &std::path::Path) -> std::io::Result<std::fs::File> {
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
}

/// Writes queued lines, flushing whenever the queue runs empty; reopens the file on
/// SIGUSR1.
async fn write_loop(mut sink: Sink, mut queue: mpsc::Receiver<String>, written: IntCounter) {
    let mut usr1 = match tokio::signal::unix::signal(
        tokio::signal::unix::SignalKind::user_defined1(),
    ) {
        Ok(s) => Some(s),
        Err(e) => {
            tracing::warn!(error = %Chain(&e), "cannot listen for SIGUSR1; the access log will not be reopened on it");
            None
        }
    };
    loop {
        let reopen = async {
            match &mut usr1 {
                Some(s) => s.recv().await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            line = queue.recv() => {
                let Some(line) = line else { break };
                let mut batch = 1;
                let mut failed = sink.write(&line).is_err();
                while let Ok(more) = queue.try_recv() {
                    failed |= sink.write(&more).is_err();
                    batch += 1;
                }
                failed |= sink.flush().is_err();
                if failed {
                    tracing::warn!("writing the access log failed; lines were lost");
                } else {
                    written.inc_by(batch);
                }
            }
            _ = reopen => sink.reopen(),
        }
    }
    let _ = sink.flush();
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn entry(method: &str, path: &str, route: &str) -> String {
        text_line(&Entry {
            time: "2026-12-04T00:00:00.000Z".to_owned(),
            client: IpAddr::from([127, 0, 0, 1]),
            method,
            path,
            status: 404,
            outcome: "intercepted",
            route,
            bytes: Some(12),
            duration_ms: 0.25,
        })
    }

    /// The inverse of [`escape_into`].
    fn unescape(field: &str) -> Vec<u8> {
        let b = field.as_bytes();
        let mut out = Vec::new();
        let mut i = 0;
        while i < b.len() {
            if b[i] == b'\\' {
                let hex = std::str::from_utf8(&b[i + 2..i + 4]).expect("hex");
                out.push(u8::from_str_radix(hex, 16).expect("hex"));
                i += 4;
            } else {
                out.push(b[i]);
                i += 1;
            }
        }
        out
    }

    #[test]
    fn a_plain_request_reads_as_written() {
        assert_eq!(
            entry("GET", "/api/products/1?x=1", "products"),
            "2026-12-04T00:00:00.000Z 127.0.0.1 \"GET /api/products/1?x=1\" 404 intercepted products 12 0.250"
        );
    }

    #[test]
    fn a_quote_in_the_target_cannot_forge_fields() {
        let line = entry("GET", "/a\" 200 hit other 1 0.1 \"", "products");
        assert_eq!(line.split(' ').count(), 9, "{line}");
        assert!(line.contains("/a\\x22\\x20200"), "{line}");
    }

    proptest! {
        /// Whatever the target holds, a line has nine space-separated fields, one pair of
        /// quotes, no control character, and the target reads back as it was.
        #[test]
        fn every_target_keeps_the_line_whole(path in any::<String>(), method in "[A-Z]{1,8}") {
            let line = entry(&method, &path, "products");
            let fields: Vec<&str> = line.split(' ').collect();
            prop_assert_eq!(fields.len(), 9, "{}", line);
            prop_assert_eq!(line.matches('"').count(), 2, "{}", line);
            prop_assert!(line.bytes().all(|b| b.is_ascii_graphic() || b == b' '), "{}", line);
            prop_assert_eq!(fields[2], format!("\"{method}"));
            let target = fields[3].strip_suffix('"').expect("closing quote");
            prop_assert_eq!(unescape(target), path.as_bytes().to_vec());
            prop_assert_eq!(fields[5], "intercepted");
        }
    }
}
