//! The database stage: connection pools for MySQL/MariaDB and SQLite, origin lookups
//! rendered as JSON objects, and streaming key loads for the filter loader.
//!
//! It answers two questions — "which row has this key?" and "which keys exist?" — and
//! sorts failures into "the database is unavailable" (the proxy answers 503 or fails
//! open) and "the query is wrong". It does not cache, does not decide what a missing row
//! means, does not normalise keys and does not build filters; those are the cache, the
//! origin, the route and the loader.
//!
//! SQL comes from the operator's config and is trusted as such; the key is always bound
//! as a parameter, never spliced into the text.
//!
//! Files: `render.rs` turns values into JSON and key strings, `seed.rs` fills the demo
//! `products` table, `binlog/` reads the binary log (binlog mode).

pub mod binlog;
mod changes;
mod render;
mod seed;

#[cfg(test)]
mod mysql_tests;
#[cfg(test)]
mod sqlite_tests;

use std::borrow::Cow;
use std::path::Path;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use futures_util::TryStreamExt;
use serde_json::{Map, Value};
use sqlx::migrate::{Migration, MigrationType, Migrator};
use sqlx::mysql::{MySqlConnectOptions, MySqlPool};
use sqlx::pool::PoolOptions;
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqliteSynchronous};
use sqlx::{AssertSqlSafe, ConnectOptions, Connection, SqlSafeStr};

pub use seed::{demo_absent_sku, demo_sku};

/// How long an SQLite connection waits for another writer's lock before failing.
const SQLITE_BUSY_TIMEOUT: Duration = Duration::from_secs(5);

/// The migrations in `migrations/`, embedded in the binary.
///
/// Listed by hand because `sqlx::migrate!` needs sqlx's `macros` feature, which this
/// crate does not enable; a test checks this list against the directory.
const MIGRATIONS: &[(i64, &str, &str)] = &[(
    20261202000000,
    "products",
    include_str!("../../../migrations/20261202000000_products.sql"),
)];

/// A connection pool to the origin database; the URL scheme chose the backend.
///
/// Cloning is cheap: both pools are reference-counted handles to one shared pool.
#[derive(Debug, Clone)]
pub enum Db {
    /// `mysql://` or `mariadb://`.
    MySql(MySqlPool),
    /// `sqlite:` (a file, or `sqlite::memory:`, which lives only while a connection to
    /// it is open: give it `min_connections: 1` and no idle timeout).
    Sqlite(SqlitePool),
}

/// Pool sizing and timeouts, as read from the config.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolSettings {
    /// Upper bound on open connections.
    pub max_connections: u32,
    /// Connections kept open even when idle (opened in the background, never at start-up).
    pub min_connections: u32,
    /// How long a query waits for a connection, including opening a new one, before
    /// [`DbError::PoolTimeout`]. Keep it short: the request is waiting.
    pub acquire_timeout: Duration,
    /// Idle connections above `min_connections` are closed after this long; `None` keeps them.
    pub idle_timeout: Option<Duration>,
}

/// 10 connections at most, none kept open, a 500 ms acquire timeout, idle connections
/// closed after 10 minutes.
impl Default for PoolSettings {
    fn default() -> Self {
        Self {
            max_connections: 10,
            min_connections: 0,
            acquire_timeout: Duration::from_millis(500),
            idle_timeout: Some(Duration::from_secs(600)),
        }
    }
}

/// Why a database call failed, sorted by what the caller should do about it.
#[derive(Debug, thiserror::Error)]
pub enum DbError {
    /// The URL names no backend this build supports, or cannot be parsed.
    /// The message never repeats the URL itself, which may hold a password.
    #[error("unsupported database URL: {0}")]
    UnsupportedUrl(String),
    /// The URL has a supported scheme but its driver cannot read it (a bad port, an
    /// unknown option). sqlx's message names the part, not the password.
    #[error("unsupported database URL: invalid {backend} URL")]
    InvalidUrl {
        /// `"MySQL"` or `"SQLite"`.
        backend: &'static str,
        /// The driver's parse error.
        #[source]
        source: sqlx::Error,
    },
    /// No connection became free (or could be opened) within the acquire timeout.
    /// sqlx retries refused connections until then, so a database that is down
    /// usually shows up here rather than as [`DbError::Unavailable`].
    #[error("timed out waiting for a database connection")]
    PoolTimeout,
    /// The database could not be reached: I/O, TLS, a closed pool, a crashed worker.
    #[error("database unavailable")]
    Unavailable(#[source] sqlx::Error),
    /// The database answered, but the query failed or its result could not be decoded.
    #[error("database query failed")]
    Query(#[source] sqlx::Error),
    /// Applying the embedded migrations failed.
    #[error("database migration failed")]
    Migrate(#[source] sqlx::migrate::MigrateError),
}

impl DbError {
    /// True when the database could not be reached or had no free connection: the
    /// answer is "try again later" (503, or fail open), not "this request is wrong".
    pub fn is_unavailable(&self) -> bool {
        matches!(self, DbError::PoolTimeout | DbError::Unavailable(_))
    }
}

impl From<sqlx::Error> for DbError {
    fn from(err: sqlx::Error) -> Self {
        match err {
            sqlx::Error::PoolTimedOut => DbError::PoolTimeout,
            sqlx::Error::Io(_)
            | sqlx::Error::Tls(_)
            | sqlx::Error::PoolClosed
            | sqlx::Error::WorkerCrashed => DbError::Unavailable(err),
            other => DbError::Query(other),
        }
    }
}

/// The normalised key, bound as the lookup query's only parameter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyParam<'a> {
    /// A numeric key. MySQL binds it as `BIGINT UNSIGNED`; SQLite as `INTEGER` when it
    /// fits in an i64, else as text (such a key can match no SQLite integer).
    Int(u64),
    /// A text key, bound as-is.
    Text(&'a str),
}

impl Db {
    /// Builds the pool for `url` without touching the network (sqlx's `connect_lazy_with`),
    /// so bloomgate can start while the database is down; connections open on first use.
    ///
    /// `mysql://` and `mariadb://` choose MySQL; `sqlite:` chooses SQLite, with the file
    /// created if missing (its parent directory too), WAL journal, `synchronous=NORMAL`
    /// and a 5 s busy timeout.
    pub fn connect_lazy(url: &str, settings: &PoolSettings) -> Result<Db, DbError> {
        match url_scheme(url).as_deref() {
            Some("mysql" | "mariadb") => {
                // sqlx's own statement logs are off: a full filter load is one long
                // statement by design, and lookup latency is in the origin histogram.
                let options = MySqlConnectOptions::from_str(url)
                    .map_err(|source| DbError::InvalidUrl {
                        backend: "MySQL",
                        source,
                    })?
                    .disable_statement_logging();
                Ok(Db::MySql(pool_options(settings).connect_lazy_with(options)))
            }
            Some("sqlite") => {
                let options = SqliteConnectOptions::from_str(url)
                    .map_err(|source| DbError::InvalidUrl {
                        backend: "SQLite",
                        source,
                    })?
                    .disable_statement_logging()
                    .create_if_missing(true)
                    .journal_mode(SqliteJournalMode::Wal)
                    .synchronous(SqliteSynchronous::Normal)
                    .busy_timeout(SQLITE_BUSY_TIMEOUT);
                create_parent_dir(options.get_filename())?;
                Ok(Db::Sqlite(
                    pool_options(settings).connect_lazy_with(options),
                ))
            }
            Some(other) => Err(DbError::UnsupportedUrl(format!(
                "scheme {other:?} (expected mysql://, mariadb:// or sqlite:)"
            ))),
            None => Err(DbError::UnsupportedUrl(
                "no scheme (expected mysql://, mariadb:// or sqlite:)".to_owned(),
            )),
        }
    }

    /// The backend's name for logs and metrics: `"mysql"` or `"sqlite"`.
    pub fn backend(&self) -> &'static str {
        match self {
            Db::MySql(_) => "mysql",
            Db::Sqlite(_) => "sqlite",
        }
    }

    /// Takes a connection from the pool (opening one if needed) and pings the server.
    pub async fn ping(&self) -> Result<(), DbError> {
        match self {
            Db::MySql(pool) => pool.acquire().await?.ping().await?,
            Db::Sqlite(pool) => pool.acquire().await?.ping().await?,
        }
        Ok(())
    }

    /// Runs the lookup query with `key` bound as its only parameter and returns the
    /// first row as a JSON object (column names become fields), or `None` if there is
    /// no row.
    ///
    /// Values: integers of every width and sign → numbers; FLOAT/DOUBLE/REAL → numbers;
    /// DECIMAL → a number when the shortest f64 form reads back as the same decimal,
    /// else the exact decimal as a string; text, CHAR, ENUM, SET → strings; BOOLEAN /
    /// TINYINT(1) → true/false; DATETIME → `YYYY-MM-DDTHH:MM:SS[.ffffff]` (no zone: the
    /// column has none); TIMESTAMP → RFC 3339 in UTC with `Z` (sqlx sets the session time
    /// zone to UTC); DATE → `YYYY-MM-DD`; TIME → `[-]HH:MM:SS[.ffffff]`; a MySQL JSON
    /// column → nested JSON; BLOB/BINARY → the bytes as lossy UTF-8 (not base64); NULL and
    /// MySQL zero dates → null. SQLite is dynamically typed: each value is rendered by
    /// the type it is stored as, with the column's declared type deciding BOOLEAN and
    /// DATETIME/TIMESTAMP (text or unix seconds → RFC 3339, naive text taken as UTC).
    /// A DECIMAL column in SQLite stores INTEGER or REAL, so `20.00` comes back as `20`.
    pub async fn lookup(
        &self,
        query: &Arc<str>,
        key: KeyParam<'_>,
    ) -> Result<Option<Map<String, Value>>, DbError> {
        let sql = AssertSqlSafe(Arc::clone(query));
        match self {
            Db::MySql(pool) => {
                let q = sqlx::query(sql);
                let q = match key {
                    KeyParam::Int(n) => q.bind(n),
                    KeyParam::Text(s) => q.bind(s),
                };
                let row = q.fetch_optional(pool).await?;
                Ok(row.as_ref().map(render::mysql_row).transpose()?)
            }
            Db::Sqlite(pool) => {
                let q = sqlx::query(sql);
                let q = match key {
                    KeyParam::Int(n) => match i64::try_from(n) {
                        Ok(n) => q.bind(n),
                        Err(_) => q.bind(n.to_string()),
                    },
                    KeyParam::Text(s) => q.bind(s),
                };
                let row = q.fetch_optional(pool).await?;
                Ok(row.as_ref().map(render::sqlite_row).transpose()?)
            }
        }
    }

    /// Streams the source query's rows (never buffering the result set: it may be tens
    /// of millions of rows) and calls `f` with the first column of each row as a key:
    /// integers in canonical decimal, text as stored. Rows whose first column is NULL are
    /// skipped and counted in a warning. Returns how many keys were passed to `f`.
    pub async fn for_each_key(
        &self,
        query: &Arc<str>,
        mut f: impl FnMut(&str),
    ) -> Result<u64, DbError> {
        let sql = AssertSqlSafe(Arc::clone(query));
        // Reused for every integer key, so the loop does not allocate per row.
        let mut buf = String::with_capacity(24);
        let mut passed = 0u64;
        let mut nulls = 0u64;
        match self {
            Db::MySql(pool) => {
                let mut rows = sqlx::query(sql).fetch(pool);
                let mut kind = None;
                while let Some(row) = rows.try_next().await? {
                    let kind = *kind.get_or_insert_with(|| render::MySqlKeyKind::of(&row));
                    match render::mysql_key(&row, kind, &mut buf)? {
                        Some(key) => {
                            f(key);
                            passed += 1;
                        }
                        None => nulls += 1,
                    }
                }
            }
            Db::Sqlite(pool) => {
                let mut rows = sqlx::query(sql).fetch(pool);
                while let Some(row) = rows.try_next().await? {
                    match render::sqlite_key(&row, &mut buf)? {
                        Some(key) => {
                            f(key);
                            passed += 1;
                        }
                        None => nulls += 1,
                    }
                }
            }
        }
        if nulls > 0 {
            tracing::warn!(
                backend = self.backend(),
                skipped = nulls,
                "source query returned rows whose first column is NULL; skipped them"
            );
        }
        Ok(passed)
    }

    /// Counts the rows the source query returns (`SELECT COUNT(*) FROM (<query>) AS src`),
    /// for progress display before a load. A trailing `;` in the query is ignored.
    pub async fn count_rows(&self, query: &str) -> Result<u64, DbError> {
        let inner = query.trim().trim_end_matches(';').trim_end();
        let sql = AssertSqlSafe(format!("SELECT COUNT(*) FROM ({inner}) AS src"));
        let count: i64 = match self {
            Db::MySql(pool) => sqlx::query_scalar(sql).fetch_one(pool).await?,
            Db::Sqlite(pool) => sqlx::query_scalar(sql).fetch_one(pool).await?,
        };
        // COUNT(*) is never negative.
        Ok(u64::try_from(count).unwrap_or_default())
    }

    /// Applies the migrations embedded from `migrations/` that the database has not seen
    /// yet (tracked in sqlx's `_sqlx_migrations` table). Running it again is a no-op.
    pub async fn migrate(&self) -> Result<(), DbError> {
        let migrator = migrator();
        let result = match self {
            Db::MySql(pool) => migrator.run(pool).await,
            Db::Sqlite(pool) => migrator.run(pool).await,
        };
        result.map_err(|err| match err {
            // Not reaching the database is not a migration problem.
            sqlx::migrate::MigrateError::Execute(e) => match DbError::from(e) {
                unavailable if unavailable.is_unavailable() => unavailable,
                DbError::Query(e) => DbError::Migrate(sqlx::migrate::MigrateError::Execute(e)),
                other => other,
            },
            other => DbError::Migrate(other),
        })
    }

    /// Fills the demo `products` table when it is empty: `count` rows with keys
    /// [`demo_sku`]`(0..count)`, names `Product <sku>`, deterministic prices and
    /// `updated_at` now, inserted in multi-row statements inside transactions.
    /// Returns the number of rows inserted, 0 if the table already had rows.
    pub async fn seed_demo_products(&self, count: u64) -> Result<u64, DbError> {
        let inserted = match self {
            Db::MySql(pool) => seed::seed_products(pool, count).await?,
            Db::Sqlite(pool) => seed::seed_products(pool, count).await?,
        };
        Ok(inserted)
    }

    /// Closes the pool: waits for connections in use to come back, then closes them all.
    pub async fn close(&self) {
        match self {
            Db::MySql(pool) => pool.close().await,
            Db::Sqlite(pool) => pool.close().await,
        }
    }
}

/// The embedded migrations as a sqlx [`Migrator`].
fn migrator() -> Migrator {
    Migrator::with_migrations(
        MIGRATIONS
            .iter()
            .map(|&(version, description, sql)| {
                Migration::new(
                    version,
                    Cow::Borrowed(description),
                    MigrationType::Simple,
                    sql.into_sql_str(),
                    false,
                )
            })
            .collect(),
    )
}

fn pool_options<DB: sqlx::Database>(settings: &PoolSettings) -> PoolOptions<DB> {
    PoolOptions::new()
        .max_connections(settings.max_connections)
        .min_connections(settings.min_connections)
        .acquire_timeout(settings.acquire_timeout)
        .idle_timeout(settings.idle_timeout)
}

/// The URL's scheme, lower-cased, if it has a well-formed one. Only the scheme is ever
/// put in an error message: the rest may carry a password.
fn url_scheme(url: &str) -> Option<String> {
    let (scheme, _) = url.split_once(':')?;
    let mut chars = scheme.chars();
    let well_formed = chars.next().is_some_and(|c| c.is_ascii_alphabetic())
        && chars.all(|c| c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.'));
    well_formed.then(|| scheme.to_ascii_lowercase())
}

/// SQLite creates the database file but not the directory it goes in.
fn create_parent_dir(file: &Path) -> Result<(), DbError> {
    match file.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => {
            std::fs::create_dir_all(dir).map_err(|e| DbError::Unavailable(sqlx::Error::Io(e)))
        }
        _ => Ok(()),
    }
}
