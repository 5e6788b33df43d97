//! The replica connection: registers with the server as a replica, asks for its binary
//! log from a position (by GTID on MariaDB when the position has one, else by file and
//! offset), and turns its events into committed transactions of the source table's
//! inserts, updates and deletes. Events of other tables are skipped before their rows
//! are decoded. The client is `mysql_async`'s binlog stream; this module only reads it.

use std::time::Duration;

use futures_util::StreamExt;
use mysql_async::binlog::events::{EventData, RowsEventData};
use mysql_async::prelude::Queryable;
use mysql_async::{BinlogStream, BinlogStreamRequest, Conn, OptsBuilder, SslOpts};

use super::decode::{self, KeyValueError};
use super::{Flavor, KeyColumn};
use crate::watermark::{BinlogMark, Gtid};

/// How long a connection, and each statement before the stream, may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// MariaDB's `ER_MASTER_FATAL_ERROR_READING_BINLOG`, which MySQL shares: the position
/// asked for is not in the server's logs (purged, or another server's).
const POSITION_GONE: u16 = 1236;

/// MariaDB event types the client library does not know.
const MARIADB_GTID_EVENT: u8 = 162;

/// One row's change to the source table, by key as a scan renders it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RowChange {
    /// A row was inserted.
    Insert(String),
    /// A row was deleted.
    Delete(String),
    /// A row was updated; the keys differ when the key column changed.
    Update {
        /// The key before.
        before: String,
        /// The key after.
        after: String,
    },
}

/// What the stream says next.
#[derive(Debug, Clone, PartialEq)]
pub enum LogEvent {
    /// A committed transaction, with its changes to the source table (none when it
    /// changed only other tables), and the position after it.
    Committed {
        /// The changes, in log order.
        changes: Vec<RowChange>,
        /// Rows whose key could not be read (not UTF-8, another type).
        unreadable: u64,
        /// Where the log goes on after it.
        at: BinlogMark,
        /// When the server wrote it (Unix seconds, the server's clock).
        written: u32,
    },
    /// A statement changed the table without row events (`TRUNCATE`, `ALTER`, …), or
    /// the table's rows changed shape: the filter must be built again.
    TableChanged {
        /// The statement, or what changed.
        what: String,
        /// Where the log goes on after it.
        at: BinlogMark,
    },
    /// The server has nothing newer (a heartbeat).
    CaughtUp {
        /// The position the server is at.
        at: BinlogMark,
    },
}

/// Why the stream cannot go on.
#[derive(Debug, thiserror::Error)]
pub enum StreamError {
    /// The replication URL could not be read.
    #[error("replication URL is invalid: {0}")]
    Url(&'static str),
    /// Connecting or asking for the log failed.
    #[error("replica connection failed")]
    Connect(#[source] mysql_async::Error),
    /// Connecting took longer than its bound.
    #[error("replica connection timed out after {0:?}")]
    Timeout(Duration),
    /// The position asked for is not in the server's logs.
    #[error("the server no longer has the binary log position bloomgate resumes from: {0}")]
    PositionGone(String),
    /// The connection broke, or an event could not be read.
    #[error("binary log stream failed")]
    Stream(#[source] mysql_async::Error),
    /// An event could not be decoded.
    #[error("binary log event could not be decoded")]
    Decode(#[source] std::io::Error),
    /// Nothing, not even a heartbeat, arrived for this long.
    #[error("the binary log stream was silent for {0:?}")]
    Silent(Duration),
    /// The server ended the stream.
    #[error("the server ended the binary log stream")]
    Ended,
}

impl StreamError {
    fn of(e: mysql_async::Error, connecting: bool) -> StreamError {
        match e {
            mysql_async::Error::Server(s) if s.code == POSITION_GONE => {
                StreamError::PositionGone(s.message)
            }
            e if connecting => StreamError::Connect(e),
            e => StreamError::Stream(e),
        }
    }
}

/// Where and how to read the log.
#[derive(Debug, Clone)]
pub struct ReplicaSettings {
    /// The replication URL (`mysql://user:pass@host:port/…`, with `ssl-mode` and
    /// `ssl-ca` read as the pool reads them).
    pub url: String,
    /// The replica id to register with.
    pub server_id: u32,
    /// The heartbeat period to ask for.
    pub heartbeat: Duration,
    /// MariaDB or MySQL.
    pub flavor: Flavor,
    /// The log's file base name (`binlog` of `binlog.000042`).
    pub base: String,
}

/// An open binary log stream of the source table's changes.
pub struct LogReader {
    stream: BinlogStream,
    key: KeyColumn,
    /// The table id the server gave the source table in its last table map event.
    table_id: Option<u64>,
    /// The file being read, by number.
    file: u32,
    /// The GTID of the transaction being read, or of the last one (MariaDB).
    gtid: Option<Gtid>,
    /// Set once a transaction of another GTID domain is seen: resuming by one domain's
    /// GTID would then miss or repeat the others', so marks carry none.
    mixed_domains: bool,
    changes: Vec<RowChange>,
    unreadable: u64,
    /// Longest wait for any event: three heartbeats.
    silence: Duration,
    /// The log's file base name.
    base: String,
    /// The `server_id` of the server read from.
    source_server: u32,
    buf: String,
}

impl LogReader {
    /// Connects as a replica and asks for the log from `from`. A position the server no
    /// longer has shows as [`StreamError::PositionGone`], from here or from the first
    /// [`LogReader::next`].
    pub async fn open(
        settings: &ReplicaSettings,
        from: BinlogMark,
        key: KeyColumn,
    ) -> Result<LogReader, StreamError> {
        let opts = opts(&settings.url)?;
        let connect = async {
            let mut conn = Conn::new(opts).await?;
            let source: Option<u32> = conn.query_first("SELECT @@GLOBAL.server_id").await?;
            Ok::<_, mysql_async::Error>((conn, source.unwrap_or(0)))
        };
        let (mut conn, source_server) = tokio::time::timeout(CONNECT_TIMEOUT, connect)
            .await
            .map_err(|_| StreamError::Timeout(CONNECT_TIMEOUT))?
            .map_err(|e| StreamError::of(e, true))?;
        // A file and offset are one server's: on another (a failover without a GTID to go
        // by) they would name some other point of some other log.
        if from.gtid.is_none() && from.server != 0 && from.server != source_server {
            return Err(StreamError::PositionGone(format!(
                "the position is in the log of server {}, and this server is {source_server}",
                from.server
            )));
        }
        let request = async {
            let nanos = settings.heartbeat.as_nanos();
            conn.query_drop(format!("SET @master_heartbeat_period = {nanos}"))
                .await?;
            let by_gtid = match (settings.flavor, from.gtid) {
                (Flavor::MariaDb, Some(g)) => {
                    // Capability 4: the server sends GTID events as they are.
                    conn.query_drop("SET @mariadb_slave_capability = 4").await?;
                    conn.query_drop(format!("SET @slave_connect_state = '{g}'"))
                        .await?;
                    conn.query_drop("SET @slave_gtid_strict_mode = 0").await?;
                    conn.query_drop("SET @slave_gtid_ignore_duplicates = 0")
                        .await?;
                    true
                }
                (Flavor::MariaDb, None) => {
                    conn.query_drop("SET @mariadb_slave_capability = 4").await?;
                    false
                }
                (Flavor::MySql, _) => false,
            };
            let name = from.file_name(&settings.base);
            let request = if by_gtid {
                // The server starts after the GTID and names the file itself.
                BinlogStreamRequest::new(settings.server_id)
            } else {
                BinlogStreamRequest::new(settings.server_id)
                    .with_filename(name.as_bytes())
                    .with_pos(from.offset)
            };
            conn.get_binlog_stream(request).await
        };
        let stream = tokio::time::timeout(CONNECT_TIMEOUT, request)
            .await
            .map_err(|_| StreamError::Timeout(CONNECT_TIMEOUT))?
            .map_err(|e| StreamError::of(e, true))?;
        Ok(LogReader {
            stream,
            key,
            table_id: None,
            file: from.file,
            gtid: from.gtid,
            mixed_domains: false,
            changes: Vec::new(),
            unreadable: 0,
            silence: settings.heartbeat * 3,
            base: settings.base.clone(),
            source_server,
            buf: String::new(),
        })
    }

    /// The position after the last complete transaction.
    fn mark(&self, offset: u64) -> BinlogMark {
        BinlogMark {
            file: self.file,
            offset,
            server: self.source_server,
            gtid: if self.mixed_domains { None } else { self.gtid },
        }
    }

    /// The next committed transaction, change of the table or heartbeat.
    pub async fn next(&mut self) -> Result<LogEvent, StreamError> {
        loop {
            let event = match tokio::time::timeout(self.silence, self.stream.next()).await {
                Err(_) => return Err(StreamError::Silent(self.silence)),
                Ok(None) => return Err(StreamError::Ended),
                Ok(Some(Err(e))) => return Err(StreamError::of(e, false)),
                Ok(Some(Ok(event))) => event,
            };
            let header = event.header();
            let end = u64::from(header.log_pos());
            if header.event_type_raw() == MARIADB_GTID_EVENT {
                if let Some(g) = decode::mariadb_gtid(event.data(), header.server_id()) {
                    if self.gtid.is_some_and(|prev| prev.domain != g.domain) {
                        self.mixed_domains = true;
                    }
                    self.gtid = Some(g);
                }
                continue;
            }
            let Some(data) = event.read_data().map_err(StreamError::Decode)? else {
                continue;
            };
            match data {
                EventData::RotateEvent(r) => {
                    if let Some(index) = decode::rotated_file(r.name_raw(), &self.base) {
                        self.file = index;
                    }
                }
                EventData::HeartbeatEvent => {
                    return Ok(LogEvent::CaughtUp { at: self.mark(end) });
                }
                EventData::TableMapEvent(t)
                    if t.database_name() == self.key.schema.as_str()
                        && t.table_name() == self.key.table.as_str() =>
                {
                    self.table_id = Some(t.table_id());
                    if usize::try_from(t.columns_count()).ok() != Some(self.key.columns) {
                        return Ok(LogEvent::TableChanged {
                            what: format!(
                                "row events carry {} columns, the table had {}",
                                t.columns_count(),
                                self.key.columns
                            ),
                            at: self.mark(end),
                        });
                    }
                }
                EventData::RowsEvent(rows) if Some(rows.table_id()) == self.table_id => {
                    self.read_rows(&rows)?;
                }
                EventData::XidEvent(_) => return Ok(self.commit(end, header.timestamp())),
                EventData::QueryEvent(q) => {
                    let statement = q.query();
                    if statement.eq_ignore_ascii_case("COMMIT") {
                        return Ok(self.commit(end, header.timestamp()));
                    }
                    if decode::changes_table(&statement, &q.schema(), &self.key) {
                        self.changes.clear();
                        return Ok(LogEvent::TableChanged {
                            what: statement.into_owned(),
                            at: self.mark(end),
                        });
                    }
                }
                _ => {}
            }
        }
    }

    /// Ends the transaction being read at `end`.
    fn commit(&mut self, end: u64, written: u32) -> LogEvent {
        LogEvent::Committed {
            changes: std::mem::take(&mut self.changes),
            unreadable: std::mem::take(&mut self.unreadable),
            at: self.mark(end),
            written,
        }
    }

    /// Adds the changes of one rows event of the source table.
    fn read_rows(&mut self, rows: &RowsEventData<'_>) -> Result<(), StreamError> {
        let Some(tme) = self.table_id.and_then(|id| self.stream.get_tme(id)) else {
            return Ok(());
        };
        let (index, kind) = (self.key.index, self.key.kind);
        for row in rows.rows(tme) {
            let (before, after) = row.map_err(StreamError::Decode)?;
            let mut key = |row: &Option<mysql_async::binlog::row::BinlogRow>| {
                let Some(row) = row else {
                    return Ok(None);
                };
                decode::key_text(row.as_ref(index), kind, &mut self.buf)
                    .map(|k| k.map(|k| k.into_owned()))
            };
            let before = key(&before);
            let after = key(&after);
            let change = match (before, after) {
                (Ok(None), Ok(Some(a))) => Some(RowChange::Insert(a)),
                (Ok(Some(b)), Ok(None)) => Some(RowChange::Delete(b)),
                (Ok(Some(b)), Ok(Some(a))) => Some(RowChange::Update {
                    before: b,
                    after: a,
                }),
                // A NULL key is no key, as a scan skips it.
                (Ok(None), Ok(None)) => None,
                (Err(KeyValueError::Missing(_)) | Err(_), _) | (_, Err(_)) => {
                    self.unreadable += 1;
                    None
                }
            };
            self.changes.extend(change);
        }
        Ok(())
    }
}

/// The replica connection's options from a database URL as the pool reads it:
/// `mysql://` (or `mariadb://`) `user:password@host:port/database`, with the `ssl-mode`
/// (`disabled`, `preferred`, `required`, `verify_ca`, `verify_identity`) and `ssl-ca`
/// parameters.
fn opts(url: &str) -> Result<OptsBuilder, StreamError> {
    let parsed = url::Url::parse(url).map_err(|_| StreamError::Url("not a URL"))?;
    if !matches!(parsed.scheme(), "mysql" | "mariadb") {
        return Err(StreamError::Url("the scheme is not mysql:// or mariadb://"));
    }
    let host = parsed
        .host_str()
        .ok_or(StreamError::Url("no host"))?
        .trim_start_matches('[')
        .trim_end_matches(']')
        .to_owned();
    let decode = |s: &str| {
        percent_encoding::percent_decode_str(s)
            .decode_utf8_lossy()
            .into_owned()
    };
    let user = (!parsed.username().is_empty()).then(|| decode(parsed.username()));
    let pass = parsed.password().map(decode);
    let db = parsed.path().trim_start_matches('/');
    let mut builder = OptsBuilder::default()
        .ip_or_hostname(host)
        .tcp_port(parsed.port().unwrap_or(3306))
        .user(user)
        .pass(pass)
        .db_name((!db.is_empty()).then(|| decode(db)))
        .prefer_socket(false);
    let mut mode = String::from("preferred");
    let mut ca = None;
    for (k, v) in parsed.query_pairs() {
        match k.as_ref() {
            "ssl-mode" | "sslmode" => mode = v.to_ascii_lowercase(),
            "ssl-ca" | "sslrootcert" => ca = Some(v.into_owned()),
            _ => {}
        }
    }
    let ssl = match mode.as_str() {
        "disabled" | "preferred" => None,
        "required" => Some(
            SslOpts::default()
                .with_danger_accept_invalid_certs(true)
                .with_danger_skip_domain_validation(true),
        ),
        "verify_ca" | "verify-ca" | "verify_identity" | "verify-identity" => {
            let mut ssl = SslOpts::default();
            if let Some(ca) = ca {
                ssl = ssl.with_root_certs(vec![std::path::PathBuf::from(ca).into()]);
            }
            if mode.starts_with("verify_ca") || mode == "verify-ca" {
                ssl = ssl.with_danger_skip_domain_validation(true);
            }
            Some(ssl)
        }
        _ => return Err(StreamError::Url("unknown ssl-mode")),
    };
    builder = builder.ssl_opts(ssl);
    Ok(builder)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_pools_url_gives_the_replica_its_options() {
        let o = mysql_async::Opts::from(
            opts("mysql://repl:p%40ss@db.example:3307/shop?ssl-mode=disabled").expect("opts"),
        );
        assert_eq!(o.ip_or_hostname(), "db.example");
        assert_eq!(o.tcp_port(), 3307);
        assert_eq!(o.user(), Some("repl"));
        assert_eq!(o.pass(), Some("p@ss"));
        assert_eq!(o.db_name(), Some("shop"));
        assert!(o.ssl_opts().is_none());
        let o = mysql_async::Opts::from(opts("mariadb://u@[::1]?ssl-mode=REQUIRED").expect("opts"));
        assert_eq!(o.ip_or_hostname(), "::1");
        assert_eq!(o.tcp_port(), 3306);
        assert!(o.ssl_opts().is_some());
        for bad in ["sqlite://x", "not a url", "mysql://h/?ssl-mode=sometimes"] {
            assert!(opts(bad).is_err(), "{bad}");
        }
    }
}
