//! The binary log as a source of changes (`watermark = "binlog"`): what the server must be
//! set to, the source table's key column as the log carries it, a full scan that knows
//! the log position it is consistent with, and (in `stream`) the replica connection that
//! reads every committed insert, update and delete of the table after that position.
//!
//! Part of the database stage: it reads and decodes, and says what changed; it does not
//! admit keys, drop cache entries or decide on rebuilds (`gate::sync::binlog` does).
//!
//! Files: `stream.rs` is the replica connection and its events, `decode.rs` the pure
//! parts of reading them (a key from a row value, a MariaDB GTID, a statement that
//! changes the table).

pub mod decode;
pub mod stream;

use std::sync::Arc;

use futures_util::TryStreamExt;
use sqlx::mysql::{MySqlPool, MySqlRow};
use sqlx::{AssertSqlSafe, Connection, Executor, Row};

use super::{Db, DbError, render};
use crate::config::SourceTable;
use crate::watermark::{BinlogMark, Gtid, MAX_BINLOG_FILE};

/// Which server family: they differ in GTIDs, status variables and how a scan finds its
/// log position.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flavor {
    /// MariaDB 10.6 or later.
    MariaDb,
    /// MySQL 8.
    MySql,
}

/// How the key column's values are stored, which is how the log carries them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyKind {
    /// A signed integer of this many bytes.
    Signed(u8),
    /// An unsigned integer of this many bytes: the log carries its bits, read signed.
    Unsigned(u8),
    /// Text (or bytes) in a UTF-8 or ASCII character set, or binary.
    Text,
}

/// The source table as the server holds it, and where its key is in a row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyColumn {
    /// The schema, as the server spells it (row events name it so).
    pub schema: String,
    /// The table, likewise.
    pub table: String,
    /// The key column's name.
    pub column: String,
    /// Its position in a row, from 0.
    pub index: usize,
    /// How many columns the table has: a row event with another count was written
    /// before or after an `ALTER TABLE`, and the key's position is read again.
    pub columns: usize,
    /// How its values are stored.
    pub kind: KeyKind,
}

/// What the server says about its binary log, read when binlog mode starts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerLog {
    /// MariaDB or MySQL.
    pub flavor: Flavor,
    /// `VERSION()`.
    pub version: String,
    /// The server's own `server_id`.
    pub server_id: u32,
    /// The log files' name without their number (`binlog` of `binlog.000042`).
    pub base: String,
}

/// Why binlog mode cannot run against this server or table.
#[derive(Debug, thiserror::Error)]
pub enum BinlogError {
    /// A query of the checks or the scan failed.
    #[error("database query failed")]
    Db(#[from] DbError),
    /// The database is SQLite, which has no binary log.
    #[error("binlog mode needs a MySQL or MariaDB database")]
    NotMySql,
    /// The server writes no binary log.
    #[error("the server writes no binary log: start it with log_bin (log-bin) enabled")]
    LogBinOff,
    /// The log holds statements, not rows.
    #[error(
        "binlog_format is {0}: set binlog_format = ROW (SET GLOBAL binlog_format = 'ROW', and in the server's config file)"
    )]
    NotRowFormat(String),
    /// Row events do not carry every column, so a delete or update may not carry the key.
    #[error(
        "binlog_row_image is {0}: set binlog_row_image = FULL (SET GLOBAL binlog_row_image = 'FULL', and in the server's config file)"
    )]
    RowImage(String),
    /// `SHOW MASTER STATUS` (or `SHOW BINARY LOG STATUS`) returned nothing readable.
    #[error(
        "the server reports no binary log position; is log_bin on, and has the user REPLICATION CLIENT (BINLOG MONITOR on MariaDB)?"
    )]
    NoPosition,
    /// The log file's name does not end with a number bloomgate can keep.
    #[error("binary log file name {0} does not end with .NNNNNN")]
    FileName(String),
    /// The source table or its key column does not exist.
    #[error("{table} has no column {column} (or the table does not exist)")]
    NoKeyColumn {
        /// The table as written in `source_query`.
        table: String,
        /// The column.
        column: String,
    },
    /// The key column's type is not one binlog mode reads.
    #[error(
        "key column {column} is {column_type}: binlog mode reads integer keys and text in a UTF-8, ASCII or binary character set"
    )]
    UnsupportedKey {
        /// The column.
        column: String,
        /// Its type (and character set), as the server reports it.
        column_type: String,
    },
}

impl BinlogError {
    /// True when the server could not be reached: nothing was said about its settings.
    pub fn is_unavailable(&self) -> bool {
        matches!(self, BinlogError::Db(e) if e.is_unavailable())
    }
}

impl Db {
    /// The MySQL pool, or [`BinlogError::NotMySql`].
    fn mysql(&self) -> Result<&MySqlPool, BinlogError> {
        match self {
            Db::MySql(pool) => Ok(pool),
            Db::Sqlite(_) => Err(BinlogError::NotMySql),
        }
    }

    /// Checks that the server writes a binary log that binlog mode can follow for
    /// `table` (`log_bin`, `binlog_format = ROW`, a row image that carries the key), and
    /// reads where the key is in a row. Each refusal names the setting to change.
    pub async fn binlog_check(
        &self,
        table: &SourceTable,
    ) -> Result<(ServerLog, KeyColumn), BinlogError> {
        let pool = self.mysql()?;
        let key = key_column(pool, table).await?;
        let row = sqlx::query(
            "SELECT @@GLOBAL.log_bin, @@GLOBAL.binlog_format, @@GLOBAL.binlog_row_image, VERSION()",
        )
        .fetch_one(pool)
        .await
        .map_err(DbError::from)?;
        let log_bin = int(&row, 0)?;
        let format: String = text(&row, 1)?;
        let image: String = text(&row, 2)?;
        if log_bin == 0 {
            return Err(BinlogError::LogBinOff);
        }
        if !format.eq_ignore_ascii_case("ROW") {
            return Err(BinlogError::NotRowFormat(format));
        }
        // MINIMAL and NOBLOB leave columns out of row events (the key too, unless it is
        // the primary key), and which columns a row holds is then per event: only FULL
        // puts the key at the same place in every row.
        if !image.eq_ignore_ascii_case("FULL") {
            return Err(BinlogError::RowImage(image));
        }
        Ok((server_log(pool).await?, key))
    }

    /// Streams the source query like [`Db::for_each_key`], inside a transaction whose
    /// snapshot is consistent with the returned binary log position, so that the log
    /// read from there holds exactly the changes the scan did not see.
    ///
    /// On MariaDB the position is the snapshot's own (`binlog_snapshot_file` and
    /// `_position`), with its GTID. MySQL has no such status: the position is read just
    /// before the snapshot is taken, so the log read from there may repeat a few changes
    /// the scan saw, which applying again leaves as they are.
    ///
    /// `replica_url` is the replication user's: on MySQL the position comes from
    /// `SHOW BINARY LOG STATUS`, which needs that user's `REPLICATION CLIENT`.
    pub async fn for_each_key_at_log_position(
        &self,
        query: &Arc<str>,
        replica_url: &str,
        mut f: impl FnMut(&str),
    ) -> Result<(u64, BinlogMark), BinlogError> {
        let pool = self.mysql()?;
        let flavor = flavor(pool).await?;
        let before = match flavor {
            Flavor::MySql => {
                let mut replica = sqlx::MySqlConnection::connect(replica_url)
                    .await
                    .map_err(DbError::from)?;
                let mark = log_end(&mut replica).await;
                let _ = replica.close().await;
                Some(mark?)
            }
            Flavor::MariaDb => None,
        };
        let mut conn = pool.acquire().await.map_err(DbError::from)?;
        conn.execute("START TRANSACTION WITH CONSISTENT SNAPSHOT")
            .await
            .map_err(DbError::from)?;
        let mark = match before {
            Some(mark) => mark,
            None => mariadb_snapshot_position(&mut conn).await?,
        };
        let mut buf = String::with_capacity(24);
        let mut passed = 0u64;
        {
            let sql = AssertSqlSafe(Arc::clone(query));
            let mut rows = sqlx::query(sql).fetch(&mut *conn);
            let mut kind = None;
            while let Some(row) = rows.try_next().await.map_err(DbError::from)? {
                let kind = *kind.get_or_insert_with(|| render::MySqlKeyKind::of(&row));
                if let Some(key) = render::mysql_key(&row, kind, &mut buf).map_err(DbError::from)? {
                    f(key);
                    passed += 1;
                }
            }
        }
        conn.execute("COMMIT").await.map_err(DbError::from)?;
        Ok((passed, mark))
    }
}

/// MariaDB or MySQL, by `VERSION()`.
async fn flavor(pool: &MySqlPool) -> Result<Flavor, BinlogError> {
    let version: String = sqlx::query_scalar("SELECT VERSION()")
        .fetch_one(pool)
        .await
        .map_err(DbError::from)?;
    Ok(flavor_of(&version))
}

fn flavor_of(version: &str) -> Flavor {
    if version.to_ascii_lowercase().contains("mariadb") {
        Flavor::MariaDb
    } else {
        Flavor::MySql
    }
}

/// An integer column, whatever integer type the server reports it as.
fn int(row: &MySqlRow, i: usize) -> Result<i64, BinlogError> {
    row.try_get::<i64, _>(i)
        .or_else(|_| {
            row.try_get::<u64, _>(i)
                .map(|v| i64::try_from(v).unwrap_or(i64::MAX))
        })
        .or_else(|e| {
            text(row, i)
                .ok()
                .and_then(|t| t.trim().parse().ok())
                .ok_or(e)
        })
        .map_err(|e| BinlogError::Db(DbError::Query(e)))
}

/// A text column that the server may send as bytes (status and variable values are).
fn text(row: &MySqlRow, i: usize) -> Result<String, BinlogError> {
    row.try_get::<String, _>(i)
        .or_else(|_| {
            row.try_get::<Vec<u8>, _>(i)
                .map(|b| String::from_utf8_lossy(&b).into_owned())
        })
        .map_err(|e| BinlogError::Db(DbError::Query(e)))
}

/// The server's version, id and log file base name (`log_bin_basename`, which any user
/// may read).
async fn server_log(pool: &MySqlPool) -> Result<ServerLog, BinlogError> {
    let row = sqlx::query("SELECT VERSION(), @@GLOBAL.server_id, @@GLOBAL.log_bin_basename")
        .fetch_one(pool)
        .await
        .map_err(DbError::from)?;
    let version = text(&row, 0)?;
    let server_id = int(&row, 1)?;
    let path = text(&row, 2)?;
    let base = path.rsplit('/').next().unwrap_or(&path).to_owned();
    if base.is_empty() {
        return Err(BinlogError::LogBinOff);
    }
    Ok(ServerLog {
        flavor: flavor_of(&version),
        version,
        server_id: u32::try_from(server_id).unwrap_or(0),
        base,
    })
}

/// Where the log ends now, as a mark (with its GTID on MariaDB).
async fn log_end(conn: &mut sqlx::MySqlConnection) -> Result<BinlogMark, BinlogError> {
    let (file, offset) = log_status(conn).await?;
    let (_, index) = decode::split_file_name(&file).ok_or(BinlogError::FileName(file.clone()))?;
    Ok(BinlogMark {
        file: index,
        offset,
        server: server_id(conn).await?,
        gtid: None,
    })
}

/// The `server_id` of the server `conn` is on.
async fn server_id(conn: &mut sqlx::MySqlConnection) -> Result<u32, BinlogError> {
    let row = sqlx::query("SELECT @@GLOBAL.server_id")
        .fetch_one(&mut *conn)
        .await
        .map_err(DbError::from)?;
    Ok(u32::try_from(int(&row, 0)?).unwrap_or(0))
}

/// `SHOW MASTER STATUS`, or `SHOW BINARY LOG STATUS` where the first is gone (MySQL
/// 8.4): the current file and offset.
async fn log_status(conn: &mut sqlx::MySqlConnection) -> Result<(String, u64), BinlogError> {
    let mut row = None;
    for statement in ["SHOW MASTER STATUS", "SHOW BINARY LOG STATUS"] {
        if let Ok(r) = sqlx::raw_sql(statement).fetch_optional(&mut *conn).await {
            row = r;
            break;
        }
    }
    let row = row.ok_or(BinlogError::NoPosition)?;
    let file = text(&row, 0)?;
    let offset = u64::try_from(int(&row, 1)?).map_err(|_| BinlogError::NoPosition)?;
    if file.is_empty() {
        return Err(BinlogError::NoPosition);
    }
    Ok((file, offset))
}

/// The position a MariaDB consistent snapshot was taken at.
async fn mariadb_snapshot_position(
    conn: &mut sqlx::MySqlConnection,
) -> Result<BinlogMark, BinlogError> {
    let rows = sqlx::raw_sql("SHOW STATUS LIKE 'binlog_snapshot_%'")
        .fetch_all(&mut *conn)
        .await
        .map_err(DbError::from)?;
    let mut file = None;
    let mut offset = None;
    for row in &rows {
        let name = text(row, 0)?.to_ascii_lowercase();
        let value = text(row, 1)?;
        match name.as_str() {
            "binlog_snapshot_file" => file = Some(value),
            "binlog_snapshot_position" => offset = value.parse::<u64>().ok(),
            _ => {}
        }
    }
    let (Some(file), Some(offset)) = (file.filter(|f| !f.is_empty()), offset) else {
        return Err(BinlogError::NoPosition);
    };
    let (_, index) = decode::split_file_name(&file).ok_or(BinlogError::FileName(file.clone()))?;
    Ok(BinlogMark {
        file: index,
        offset,
        server: server_id(conn).await?,
        gtid: gtid_at(conn, &file, offset).await?,
    })
}

/// MariaDB's GTID at a file and offset (`BINLOG_GTID_POS`), when it names one domain;
/// `None` for an empty log or several domains (resuming then goes by file and offset).
async fn gtid_at(
    conn: &mut sqlx::MySqlConnection,
    file: &str,
    offset: u64,
) -> Result<Option<Gtid>, BinlogError> {
    let position: Option<String> = sqlx::query_scalar("SELECT BINLOG_GTID_POS(?, ?)")
        .bind(file)
        .bind(offset)
        .fetch_one(&mut *conn)
        .await
        .map_err(DbError::from)?;
    Ok(position.and_then(|p| decode::single_gtid(&p)))
}

/// Where `table`'s key column is in a row, and how its values are stored.
async fn key_column(pool: &MySqlPool, table: &SourceTable) -> Result<KeyColumn, BinlogError> {
    let row = sqlx::query(
        "SELECT c.TABLE_SCHEMA, c.TABLE_NAME, c.COLUMN_NAME, c.ORDINAL_POSITION, c.DATA_TYPE, \
                c.COLUMN_TYPE, c.CHARACTER_SET_NAME, \
                (SELECT COUNT(*) FROM information_schema.COLUMNS n \
                  WHERE n.TABLE_SCHEMA = c.TABLE_SCHEMA AND n.TABLE_NAME = c.TABLE_NAME) \
           FROM information_schema.COLUMNS c \
          WHERE c.TABLE_SCHEMA = COALESCE(?, DATABASE()) AND c.TABLE_NAME = ? AND c.COLUMN_NAME = ?",
    )
    .bind(table.schema.as_deref())
    .bind(&table.table)
    .bind(&table.column)
    .fetch_optional(pool)
    .await
    .map_err(DbError::from)?
    .ok_or_else(|| BinlogError::NoKeyColumn {
        table: table.to_string(),
        column: table.column.clone(),
    })?;
    let position = u64::try_from(int(&row, 3)?).unwrap_or(1);
    let data_type = text(&row, 4)?.to_ascii_lowercase();
    let column_type = text(&row, 5)?.to_ascii_lowercase();
    let charset = row
        .try_get::<Option<String>, _>(6)
        .ok()
        .flatten()
        .map(|c| c.to_ascii_lowercase());
    let columns = int(&row, 7)?;
    let column = text(&row, 2)?;
    let kind = decode::key_kind(&data_type, &column_type, charset.as_deref()).ok_or_else(|| {
        BinlogError::UnsupportedKey {
            column: column.clone(),
            column_type: match &charset {
                Some(c) => format!("{column_type} in character set {c}"),
                None => column_type.clone(),
            },
        }
    })?;
    Ok(KeyColumn {
        schema: text(&row, 0)?,
        table: text(&row, 1)?,
        column,
        index: usize::try_from(position.saturating_sub(1)).unwrap_or(usize::MAX),
        columns: usize::try_from(columns).unwrap_or(0),
        kind,
    })
}

/// The largest file number a mark can hold, for a check of names read from the log.
pub const MAX_FILE: u32 = MAX_BINLOG_FILE;
