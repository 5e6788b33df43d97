//! `init`'s MySQL/MariaDB side: the table's columns and indexes from
//! `information_schema`, its row count and recent inserts, all read on one connection
//! inside a read-only transaction.

use std::str::FromStr;

use sqlx::mysql::{MySqlConnectOptions, MySqlConnection};
use sqlx::{AssertSqlSafe, ConnectOptions, Connection, Row};

use super::{
    Column, ColumnClass, GROWTH_WINDOW_DAYS, Growth, Index, InitError, Table, created_column,
    key_column, sync_source,
};

/// Error numbers: database access denied (at login), table access denied, column access
/// denied, unknown table, unknown column.
const ER_DBACCESS_DENIED: u16 = 1044;
const ER_TABLEACCESS_DENIED: u16 = 1142;
const ER_COLUMNACCESS_DENIED: u16 = 1143;
const ER_NO_SUCH_TABLE: u16 = 1146;
const ER_BAD_FIELD: u16 = 1054;

/// Reads what `init` needs to know about `table` and its `key` column.
pub async fn read(url: &str, table: &str, key: &str) -> Result<Table, InitError> {
    let url = match url.strip_prefix("mariadb:") {
        Some(rest) => format!("mysql:{rest}"),
        None => url.to_owned(),
    };
    let options = MySqlConnectOptions::from_str(&url)
        .map_err(InitError::UnreadableUrl)?
        .disable_statement_logging();
    let mut conn = tokio::time::timeout(
        super::CONNECT_TIMEOUT,
        MySqlConnection::connect_with(&options),
    )
    .await
    .map_err(|_| InitError::Connect(sqlx::Error::PoolTimedOut))?
    .map_err(|e| match number(&e) {
        // Logged in, but the database itself is out of bounds for this user.
        Some(ER_DBACCESS_DENIED) => InitError::NoSelect {
            table: table.to_owned(),
            source: e,
        },
        _ => InitError::Connect(e),
    })?;
    // Nothing below writes; the transaction makes the server refuse it if it did.
    sqlx::query("START TRANSACTION READ ONLY")
        .execute(&mut conn)
        .await
        .map_err(InitError::Query)?;
    let result = read_in(&mut conn, table, key).await;
    // A read-only transaction has nothing to commit; ending it is only tidy.
    let _ = sqlx::query("ROLLBACK").execute(&mut conn).await;
    let _ = conn.close().await;
    result
}

async fn read_in(conn: &mut MySqlConnection, table: &str, key: &str) -> Result<Table, InitError> {
    let schema: Option<String> = sqlx::query_scalar("SELECT DATABASE()")
        .fetch_one(&mut *conn)
        .await
        .map_err(InitError::Query)?;
    let schema = schema.ok_or(InitError::NoDatabase)?;
    let quoted = quote(table);
    // The probe tells a missing table from a forbidden one, which information_schema
    // (showing only what the user may see) cannot.
    probe(conn, table, &format!("SELECT 1 FROM {quoted} LIMIT 0")).await?;
    probe(
        conn,
        table,
        &format!("SELECT {} FROM {quoted} LIMIT 0", quote(key)),
    )
    .await
    .map_err(|e| match e {
        InitError::NoSuchTable(_) => InitError::NoSuchColumn {
            table: table.to_owned(),
            column: key.to_owned(),
        },
        other => other,
    })?;
    let name: String = sqlx::query_scalar(
        "SELECT TABLE_NAME FROM information_schema.TABLES WHERE TABLE_SCHEMA = ? AND TABLE_NAME = ?",
    )
    .bind(&schema)
    .bind(table)
    .fetch_optional(&mut *conn)
    .await
    .map_err(InitError::Query)?
    .ok_or_else(|| InitError::NoSuchTable(table.to_owned()))?;
    let columns = columns(conn, &schema, &name).await?;
    let indexes = indexes(conn, &schema, &name).await?;
    let key = key_column(&name, &columns, &indexes, key)?;
    let sync = sync_source(&columns, &indexes, &key);
    let quoted = quote(&name);
    let rows: i64 = sqlx::query_scalar(AssertSqlSafe(format!("SELECT COUNT(*) FROM {quoted}")))
        .fetch_one(&mut *conn)
        .await
        .map_err(|e| refusal(e, &name))?;
    let growth = match created_column(&columns) {
        Some(c) => {
            let sql = format!(
                "SELECT COUNT(*) FROM {quoted} WHERE {} >= NOW() - INTERVAL {GROWTH_WINDOW_DAYS} DAY",
                quote(&c.name)
            );
            let recent: i64 = sqlx::query_scalar(AssertSqlSafe(sql))
                .fetch_one(&mut *conn)
                .await
                .map_err(|e| refusal(e, &name))?;
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

/// Runs `sql`, sorting a refusal into [`InitError::NoSelect`] or
/// [`InitError::NoSuchTable`].
async fn probe(conn: &mut MySqlConnection, table: &str, sql: &str) -> Result<(), InitError> {
    sqlx::query(AssertSqlSafe(sql.to_owned()))
        .fetch_optional(&mut *conn)
        .await
        .map(|_| ())
        .map_err(|e| refusal(e, table))
}

/// A query error as `init` reports it.
fn refusal(e: sqlx::Error, table: &str) -> InitError {
    match number(&e) {
        Some(ER_TABLEACCESS_DENIED | ER_COLUMNACCESS_DENIED) => InitError::NoSelect {
            table: table.to_owned(),
            source: e,
        },
        Some(ER_NO_SUCH_TABLE | ER_BAD_FIELD) => InitError::NoSuchTable(table.to_owned()),
        _ => InitError::Query(e),
    }
}

async fn columns(
    conn: &mut MySqlConnection,
    schema: &str,
    table: &str,
) -> Result<Vec<Column>, InitError> {
    let rows = sqlx::query(
        "SELECT COLUMN_NAME, DATA_TYPE, COLUMN_TYPE, CAST(CHARACTER_OCTET_LENGTH AS SIGNED), \
         COLLATION_NAME, EXTRA FROM information_schema.COLUMNS \
         WHERE TABLE_SCHEMA = ? AND TABLE_NAME = ? ORDER BY ORDINAL_POSITION",
    )
    .bind(schema)
    .bind(table)
    .fetch_all(&mut *conn)
    .await
    .map_err(InitError::Query)?;
    rows.iter()
        .map(|row| {
            let name: String = row.try_get(0)?;
            let data_type: String = row.try_get(1)?;
            let declared: String = row.try_get(2)?;
            let octets: Option<i64> = row.try_get(3)?;
            let collation: Option<String> = row.try_get(4)?;
            let extra: String = row.try_get(5)?;
            let class = match data_type.to_ascii_lowercase().as_str() {
                "tinyint" | "smallint" | "mediumint" | "int" | "integer" | "bigint" => {
                    ColumnClass::Integer
                }
                "char" | "varchar" | "binary" | "varbinary" => ColumnClass::String {
                    max_bytes: octets.and_then(|o| u64::try_from(o).ok()),
                    case_insensitive: collation
                        .as_deref()
                        .is_some_and(|c| c.to_ascii_lowercase().contains("_ci")),
                    collation,
                },
                "timestamp" | "datetime" => ColumnClass::Timestamp,
                _ => ColumnClass::Other,
            };
            Ok(Column {
                name,
                declared,
                class,
                auto_increment: extra.to_ascii_lowercase().contains("auto_increment"),
            })
        })
        .collect::<Result<_, sqlx::Error>>()
        .map_err(InitError::Query)
}

async fn indexes(
    conn: &mut MySqlConnection,
    schema: &str,
    table: &str,
) -> Result<Vec<Index>, InitError> {
    let rows = sqlx::query(
        "SELECT INDEX_NAME, CAST(NON_UNIQUE AS SIGNED), COLUMN_NAME, SUB_PART IS NOT NULL \
         FROM information_schema.STATISTICS \
         WHERE TABLE_SCHEMA = ? AND TABLE_NAME = ? ORDER BY INDEX_NAME, SEQ_IN_INDEX",
    )
    .bind(schema)
    .bind(table)
    .fetch_all(&mut *conn)
    .await
    .map_err(InitError::Query)?;
    let mut out: Vec<(String, Index)> = Vec::new();
    for row in &rows {
        let read = || -> Result<(String, i64, Option<String>, bool), sqlx::Error> {
            Ok((
                row.try_get(0)?,
                row.try_get(1)?,
                row.try_get(2)?,
                row.try_get::<i64, _>(3)? != 0,
            ))
        };
        let (index, non_unique, column, prefix) = read().map_err(InitError::Query)?;
        // A prefix of the column (or an expression) is not the column: such a part is
        // recorded under a name no column has.
        let column = match (column, prefix) {
            (Some(c), false) => c,
            _ => String::from("\u{0}"),
        };
        match out.last_mut() {
            Some((name, i)) if *name == index => i.columns.push(column),
            _ => out.push((
                index,
                Index {
                    columns: vec![column],
                    unique: non_unique == 0,
                },
            )),
        }
    }
    Ok(out.into_iter().map(|(_, i)| i).collect())
}

/// MySQL's error number, when the server refused.
fn number(e: &sqlx::Error) -> Option<u16> {
    e.as_database_error()
        .and_then(|d| d.try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>())
        .map(|d| d.number())
}

/// `name` as a MySQL identifier in backquotes.
pub fn quote(name: &str) -> String {
    format!("`{}`", name.replace('`', "``"))
}
