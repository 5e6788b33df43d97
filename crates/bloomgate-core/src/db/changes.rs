//! Incremental-sync reads: keys changed since a watermark, and the watermark to start
//! from. Part of the database stage; it does not decide when to poll (see `sync`).

use std::sync::Arc;

use chrono::{DateTime, NaiveDateTime, Utc};
use futures_util::TryStreamExt;
use sqlx::mysql::MySqlRow;
use sqlx::sqlite::SqliteRow;
use sqlx::{AssertSqlSafe, Row};

use super::{Db, DbError, render};
use crate::config::WatermarkKind;
use crate::watermark::Watermark;

impl Db {
    /// Streams the sync query with `since` bound to its one `?` and calls `f` with each
    /// row's key (first column, rendered like [`Db::for_each_key`]) and watermark (second
    /// column; `None` when NULL or undecodable). Returns the number of keys passed.
    pub async fn for_each_change(
        &self,
        query: &Arc<str>,
        kind: WatermarkKind,
        since: Watermark,
        mut f: impl FnMut(&str, Option<Watermark>),
    ) -> Result<u64, DbError> {
        let sql = AssertSqlSafe(Arc::clone(query));
        let mut buf = String::with_capacity(24);
        let mut passed = 0u64;
        match self {
            Db::MySql(pool) => {
                let q = sqlx::query(sql);
                let q = match since {
                    Watermark::Int(v) => q.bind(v),
                    Watermark::TimeMicros(us) => q.bind(naive(us)),
                    // Binlog mode never polls; a position binds as its packed value.
                    Watermark::Binlog(m) => q.bind(m.packed()),
                };
                let mut rows = q.fetch(pool);
                let mut key_kind = None;
                while let Some(row) = rows.try_next().await? {
                    let kk = *key_kind.get_or_insert_with(|| render::MySqlKeyKind::of(&row));
                    let mark = mysql_watermark(&row, 1, kind);
                    if let Some(key) = render::mysql_key(&row, kk, &mut buf)? {
                        f(key, mark);
                        passed += 1;
                    }
                }
            }
            Db::Sqlite(pool) => {
                let q = sqlx::query(sql);
                let q = match since {
                    Watermark::Int(v) => q.bind(v),
                    Watermark::TimeMicros(us) => q.bind(naive(us)),
                    // Binlog mode never polls; a position binds as its packed value.
                    Watermark::Binlog(m) => q.bind(m.packed()),
                };
                let mut rows = q.fetch(pool);
                while let Some(row) = rows.try_next().await? {
                    let mark = sqlite_watermark(&row, 1, kind);
                    if let Some(key) = render::sqlite_key(&row, &mut buf)? {
                        f(key, mark);
                        passed += 1;
                    }
                }
            }
        }
        Ok(passed)
    }

    /// Runs a one-value query (e.g. `SELECT MAX(id) FROM products`) and reads it as a
    /// watermark; `None` when it returns no row or NULL (an empty table).
    pub async fn fetch_watermark(
        &self,
        query: &Arc<str>,
        kind: WatermarkKind,
    ) -> Result<Option<Watermark>, DbError> {
        let sql = AssertSqlSafe(Arc::clone(query));
        Ok(match self {
            Db::MySql(pool) => sqlx::query(sql)
                .fetch_optional(pool)
                .await?
                .and_then(|row| mysql_watermark(&row, 0, kind)),
            Db::Sqlite(pool) => sqlx::query(sql)
                .fetch_optional(pool)
                .await?
                .and_then(|row| sqlite_watermark(&row, 0, kind)),
        })
    }
}

fn naive(us: i64) -> NaiveDateTime {
    DateTime::<Utc>::from_timestamp_micros(us)
        .unwrap_or(DateTime::<Utc>::MIN_UTC)
        .naive_utc()
}

fn mysql_watermark(row: &MySqlRow, i: usize, kind: WatermarkKind) -> Option<Watermark> {
    match kind {
        WatermarkKind::Integer => row
            .try_get::<Option<i64>, _>(i)
            .ok()
            .flatten()
            .or_else(|| {
                row.try_get::<Option<u64>, _>(i)
                    .ok()
                    .flatten()
                    .map(|v| i64::try_from(v).unwrap_or(i64::MAX))
            })
            .map(Watermark::Int),
        WatermarkKind::Timestamp => row
            .try_get::<Option<DateTime<Utc>>, _>(i)
            .ok()
            .flatten()
            .or_else(|| {
                row.try_get::<Option<NaiveDateTime>, _>(i)
                    .ok()
                    .flatten()
                    .map(|n| n.and_utc())
            })
            .map(|t| Watermark::TimeMicros(t.timestamp_micros())),
        // Read from the binary log, never from a column.
        WatermarkKind::Binlog => None,
    }
}

fn sqlite_watermark(row: &SqliteRow, i: usize, kind: WatermarkKind) -> Option<Watermark> {
    match kind {
        WatermarkKind::Integer => row
            .try_get::<Option<i64>, _>(i)
            .ok()
            .flatten()
            .map(Watermark::Int),
        WatermarkKind::Timestamp => row
            .try_get::<Option<NaiveDateTime>, _>(i)
            .ok()
            .flatten()
            .map(|n| n.and_utc())
            .or_else(|| row.try_get::<Option<DateTime<Utc>>, _>(i).ok().flatten())
            .map(|t| Watermark::TimeMicros(t.timestamp_micros())),
        WatermarkKind::Binlog => None,
    }
}
