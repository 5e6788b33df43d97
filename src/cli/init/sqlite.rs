//! `init`'s SQLite side: the table's columns and indexes from `pragma_table_info`,
//! `pragma_index_list` and `pragma_index_xinfo`, its row count and recent inserts, read
//! on a connection opened read-only (a missing file is not created).

use std::str::FromStr;

use sqlx::sqlite::{SqliteConnectOptions, SqliteConnection};
use sqlx::{AssertSqlSafe, ConnectOptions, Connection, Row};

use super::mysql::quote;
use super::{
    Column, ColumnClass, DEFAULT_STRING_BYTES, GROWTH_WINDOW_DAYS, Growth, Index, InitError, Table,
    created_column, key_column, sync_source,
};

/// Reads what `init` needs to know about `table` and its `key` column.
pub async fn read(url: &str, table: &str, key: &str) -> Result<Table, InitError> {
    let options = SqliteConnectOptions::from_str(url)
        .map_err(InitError::UnreadableUrl)?
        .read_only(true)
        .create_if_missing(false)
        .disable_statement_logging();
    let mut conn = SqliteConnection::connect_with(&options)
        .await
        .map_err(InitError::Connect)?;
    let result = read_in(&mut conn, table, key).await;
    let _ = conn.close().await;
    result
}

async fn read_in(conn: &mut SqliteConnection, table: &str, key: &str) -> Result<Table, InitError> {
    let name: String = sqlx::query_scalar(
        "SELECT name FROM sqlite_master WHERE type = 'table' AND name = ? COLLATE NOCASE",
    )
    .bind(table)
    .fetch_optional(&mut *conn)
    .await
    .map_err(query_error)?
    .ok_or_else(|| InitError::NoSuchTable(table.to_owned()))?;
    let (mut columns, mut indexes) = (columns(conn, &name).await?, indexes(conn, &name).await?);
    // An INTEGER PRIMARY KEY is the rowid: unique, indexed by the table itself, and
    // given on insert as one more than the largest.
    let pk: Vec<&Column> = columns.iter().filter(|c| c.auto_increment).collect();
    if let [rowid] = pk.as_slice() {
        indexes.push(Index {
            columns: vec![rowid.name.clone()],
            unique: true,
        });
    } else {
        columns.iter_mut().for_each(|c| c.auto_increment = false);
    }
    // The collation that counts for lookups is the key's unique index's.
    let key_collation = unique_collation(conn, &name, key).await?;
    for c in columns
        .iter_mut()
        .filter(|c| c.name.eq_ignore_ascii_case(key))
    {
        if let ColumnClass::String {
            collation,
            case_insensitive,
            ..
        } = &mut c.class
        {
            *case_insensitive = key_collation
                .as_deref()
                .is_some_and(|k| k.eq_ignore_ascii_case("NOCASE"));
            *collation = key_collation.clone();
        }
    }
    let longest = longest_key(conn, &name, &columns, key).await?;
    for c in columns
        .iter_mut()
        .filter(|c| c.name.eq_ignore_ascii_case(key))
    {
        if let ColumnClass::String { max_bytes, .. } = &mut c.class {
            // SQLite does not enforce a declared length: the longest key present counts.
            let declared = max_bytes.unwrap_or(DEFAULT_STRING_BYTES as u64);
            *max_bytes = Some(declared.max(longest));
        }
    }
    let key = key_column(&name, &columns, &indexes, key)?;
    let sync = sync_source(&columns, &indexes, &key);
    let quoted = quote(&name);
    let rows: i64 = sqlx::query_scalar(AssertSqlSafe(format!("SELECT COUNT(*) FROM {quoted}")))
        .fetch_one(&mut *conn)
        .await
        .map_err(query_error)?;
    let growth = match created_column(&columns) {
        Some(c) => {
            let sql = format!(
                "SELECT COUNT(*) FROM {quoted} WHERE {} >= datetime('now', '-{GROWTH_WINDOW_DAYS} days')",
                quote(&c.name)
            );
            let recent: i64 = sqlx::query_scalar(AssertSqlSafe(sql))
                .fetch_one(&mut *conn)
                .await
                .map_err(query_error)?;
            Some(Growth {
                column: c.name.clone(),
                recent: u64::try_from(recent).unwrap_or(0),
            })
        }
        None => None,
    };
    Ok(Table {
        name,
        key,
        rows: u64::try_from(rows).unwrap_or(0),
        growth,
        sync,
    })
}

/// A file that is not a database, or is locked, shows up here.
fn query_error(e: sqlx::Error) -> InitError {
    InitError::Query(e)
}

async fn columns(conn: &mut SqliteConnection, table: &str) -> Result<Vec<Column>, InitError> {
    let rows = sqlx::query("SELECT name, type, pk FROM pragma_table_info(?) ORDER BY cid")
        .bind(table)
        .fetch_all(&mut *conn)
        .await
        .map_err(query_error)?;
    let pk_columns = rows
        .iter()
        .filter(|r| r.try_get::<i64, _>(2).is_ok_and(|pk| pk > 0))
        .count();
    rows.iter()
        .map(|row| {
            let name: String = row.try_get(0)?;
            let declared: String = row.try_get(1)?;
            let pk: i64 = row.try_get(2)?;
            let upper = declared.to_ascii_uppercase();
            // SQLite's type affinity rules, in their order, with dates picked out.
            let class = if upper.contains("INT") {
                ColumnClass::Integer
            } else if upper.contains("TIMESTAMP") || upper.contains("DATETIME") {
                ColumnClass::Timestamp
            } else if ["CHAR", "CLOB", "TEXT", "BLOB", "BINARY"]
                .iter()
                .any(|t| upper.contains(t))
            {
                ColumnClass::String {
                    max_bytes: declared_length(&upper),
                    collation: None,
                    case_insensitive: false,
                }
            } else {
                ColumnClass::Other
            };
            Ok(Column {
                auto_increment: pk == 1 && pk_columns == 1 && upper == "INTEGER",
                name,
                declared,
                class,
            })
        })
        .collect::<Result<_, sqlx::Error>>()
        .map_err(query_error)
}

/// `n` of `VARCHAR(n)`.
fn declared_length(upper: &str) -> Option<u64> {
    let (_, rest) = upper.split_once('(')?;
    let (n, _) = rest.split_once(')')?;
    n.trim().parse().ok()
}

/// Every index that covers all rows: its key columns in order (an expression as a name
/// no column has) and whether it is unique.
async fn indexes(conn: &mut SqliteConnection, table: &str) -> Result<Vec<Index>, InitError> {
    let list = sqlx::query("SELECT name, \"unique\", partial FROM pragma_index_list(?)")
        .bind(table)
        .fetch_all(&mut *conn)
        .await
        .map_err(query_error)?;
    let mut out = Vec::new();
    for row in &list {
        let read = || -> Result<(String, i64, i64), sqlx::Error> {
            Ok((row.try_get(0)?, row.try_get(1)?, row.try_get(2)?))
        };
        let (name, unique, partial) = read().map_err(query_error)?;
        if partial != 0 {
            continue;
        }
        let columns = index_columns(conn, &name)
            .await?
            .into_iter()
            .map(|(c, _)| c)
            .collect();
        out.push(Index {
            columns,
            unique: unique != 0,
        });
    }
    Ok(out)
}

/// The key columns of index `index`, with their collations.
async fn index_columns(
    conn: &mut SqliteConnection,
    index: &str,
) -> Result<Vec<(String, Option<String>)>, InitError> {
    let rows = sqlx::query(
        "SELECT name, coll FROM pragma_index_xinfo(?) WHERE \"key\" = 1 ORDER BY seqno",
    )
    .bind(index)
    .fetch_all(&mut *conn)
    .await
    .map_err(query_error)?;
    rows.iter()
        .map(|r| {
            let name: Option<String> = r.try_get(0)?;
            Ok((name.unwrap_or_else(|| "\u{0}".to_owned()), r.try_get(1)?))
        })
        .collect::<Result<_, sqlx::Error>>()
        .map_err(query_error)
}

/// The collation of the first unique index on `key` alone, if there is one.
async fn unique_collation(
    conn: &mut SqliteConnection,
    table: &str,
    key: &str,
) -> Result<Option<String>, InitError> {
    let list =
        sqlx::query("SELECT name FROM pragma_index_list(?) WHERE \"unique\" = 1 AND partial = 0")
            .bind(table)
            .fetch_all(&mut *conn)
            .await
            .map_err(query_error)?;
    for row in &list {
        let name: String = row.try_get(0).map_err(query_error)?;
        if let [(column, coll)] = index_columns(conn, &name).await?.as_slice()
            && column.eq_ignore_ascii_case(key)
        {
            return Ok(coll.clone());
        }
    }
    Ok(None)
}

/// The longest value of `key` in bytes (0 when the table is empty or the key column is
/// missing, which `key_column` then reports).
async fn longest_key(
    conn: &mut SqliteConnection,
    table: &str,
    columns: &[Column],
    key: &str,
) -> Result<u64, InitError> {
    let Some(column) = columns.iter().find(|c| c.name.eq_ignore_ascii_case(key)) else {
        return Ok(0);
    };
    if !matches!(column.class, ColumnClass::String { .. }) {
        return Ok(0);
    }
    let sql = format!(
        "SELECT COALESCE(MAX(LENGTH(CAST({} AS BLOB))), 0) FROM {}",
        quote(&column.name),
        quote(table)
    );
    let n: i64 = sqlx::query_scalar(AssertSqlSafe(sql))
        .fetch_one(&mut *conn)
        .await
        .map_err(query_error)?;
    Ok(u64::try_from(n).unwrap_or(0))
}
