//! Tests of the database stage against SQLite files in a temporary directory, plus the
//! parts that need no database at all (URL parsing, error classes, migrations list).

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use serde_json::{Value, json};
use tempfile::TempDir;

use super::*;

/// A new directory under the system temp dir, removed with its contents on drop.
fn temp_dir() -> TempDir {
    tempfile::tempdir().expect("create a temporary directory")
}

/// A fresh SQLite database in `dir`, in a subdirectory that does not exist yet.
fn sqlite_in(dir: &TempDir) -> Db {
    let url = format!("sqlite:{}/nested/dir/bloomgate.db", dir.path().display());
    Db::connect_lazy(&url, &PoolSettings::default()).expect("a valid SQLite URL")
}

fn pool(db: &Db) -> &SqlitePool {
    match db {
        Db::Sqlite(pool) => pool,
        Db::MySql(_) => panic!("expected an SQLite pool"),
    }
}

fn sql(text: &str) -> Arc<str> {
    Arc::from(text)
}

#[tokio::test]
async fn connect_lazy_creates_the_directory_and_the_file_on_first_use() -> Result<(), DbError> {
    let dir = temp_dir();
    let db = sqlite_in(&dir);
    assert_eq!(db.backend(), "sqlite");
    db.ping().await?;
    assert!(dir.path().join("nested/dir/bloomgate.db").is_file());
    db.close().await;
    Ok(())
}

#[tokio::test]
async fn migrations_apply_once_and_are_idempotent() -> Result<(), DbError> {
    let dir = temp_dir();
    let db = sqlite_in(&dir);
    db.migrate().await?;
    db.migrate().await?;
    let applied: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM _sqlx_migrations")
        .fetch_one(pool(&db))
        .await?;
    assert_eq!(applied, MIGRATIONS.len() as i64);
    let rows: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM products")
        .fetch_one(pool(&db))
        .await?;
    assert_eq!(rows, 0);
    Ok(())
}

#[test]
fn every_file_in_migrations_is_embedded_verbatim() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../migrations");
    let mut on_disk: Vec<(i64, String, String)> = std::fs::read_dir(&dir)
        .expect("read migrations/")
        .map(|entry| {
            let path = entry.expect("a directory entry").path();
            let file = path
                .file_name()
                .and_then(|n| n.to_str())
                .unwrap_or_default()
                .to_owned();
            let stem = file
                .strip_suffix(".sql")
                .expect("only .sql files in migrations/");
            let (version, description) = stem.split_once('_').expect("VERSION_DESCRIPTION.sql");
            let version = version.parse().expect("a numeric version");
            let sql = std::fs::read_to_string(&path).expect("read a migration");
            (version, description.replace('_', " "), sql)
        })
        .collect();
    on_disk.sort();
    let embedded: Vec<(i64, String, String)> = MIGRATIONS
        .iter()
        .map(|&(v, d, s)| (v, d.to_owned(), s.to_owned()))
        .collect();
    assert_eq!(
        embedded, on_disk,
        "MIGRATIONS in db.rs must list migrations/ in order"
    );
}

#[tokio::test]
async fn lookup_renders_each_sqlite_type_as_json() -> Result<(), DbError> {
    let dir = temp_dir();
    let db = sqlite_in(&dir);
    let p = pool(&db);
    sqlx::query(
        "CREATE TABLE typed (
            id INTEGER PRIMARY KEY, small INT, big BIGINT, ratio REAL, label TEXT,
            price DECIMAL(12,2), whole DECIMAL(12,2), flag BOOLEAN, stamp TIMESTAMP,
            epoch DATETIME, odd DATETIME, day DATE, raw BLOB, missing TEXT
        )",
    )
    .execute(p)
    .await?;
    sqlx::query(
        "INSERT INTO typed VALUES (
            7, -3, 9223372036854775807, 0.25, 'héllo', '19.99', '100.00', 1,
            '2026-12-02 09:10:11', 1764666611, 'not a date', '2026-12-02', X'00FF41', NULL
        )",
    )
    .execute(p)
    .await?;

    let row = db
        .lookup(&sql("SELECT * FROM typed WHERE id = ?"), KeyParam::Int(7))
        .await?
        .expect("row 7 exists");
    assert_eq!(
        Value::Object(row),
        json!({
            "id": 7,
            "small": -3,
            "big": 9223372036854775807_i64,
            "ratio": 0.25,
            "label": "héllo",
            "price": 19.99,
            "whole": 100,
            "flag": true,
            "stamp": "2026-12-02T09:10:11Z",
            "epoch": "2025-12-02T09:10:11Z",
            "odd": "not a date",
            "day": "2026-12-02",
            "raw": "\u{0}\u{fffd}A",
            "missing": null,
        })
    );
    Ok(())
}

#[tokio::test]
async fn lookup_misses_return_none_and_keys_bind_by_kind() -> Result<(), DbError> {
    let dir = temp_dir();
    let db = sqlite_in(&dir);
    let p = pool(&db);
    sqlx::query("CREATE TABLE t (id BIGINT PRIMARY KEY, code TEXT)")
        .execute(p)
        .await?;
    sqlx::query("INSERT INTO t VALUES (1, 'a1'), (9223372036854775807, 'max')")
        .execute(p)
        .await?;

    let by_id = sql("SELECT code FROM t WHERE id = ?");
    let by_code = sql("SELECT id FROM t WHERE code = ?");
    assert_eq!(db.lookup(&by_id, KeyParam::Int(2)).await?, None);
    let max = db.lookup(&by_id, KeyParam::Int(i64::MAX as u64)).await?;
    assert_eq!(max.and_then(|r| r.get("code").cloned()), Some(json!("max")));
    // Beyond i64: bound as text, matches nothing, fails nothing.
    assert_eq!(db.lookup(&by_id, KeyParam::Int(u64::MAX)).await?, None);
    let a1 = db.lookup(&by_code, KeyParam::Text("a1")).await?;
    assert_eq!(a1.and_then(|r| r.get("id").cloned()), Some(json!(1)));
    Ok(())
}

#[tokio::test]
async fn for_each_key_streams_canonical_keys_and_skips_nulls() -> Result<(), DbError> {
    let dir = temp_dir();
    let db = sqlite_in(&dir);
    let p = pool(&db);
    sqlx::query("CREATE TABLE k (v NUMERIC)").execute(p).await?;
    sqlx::query("INSERT INTO k VALUES (1), ('0042'), (NULL), ('abc'), (-7), (2.5), (3.0), (NULL)")
        .execute(p)
        .await?;

    let mut keys = Vec::new();
    let passed = db
        .for_each_key(&sql("SELECT v FROM k ORDER BY rowid"), |k| {
            keys.push(k.to_owned())
        })
        .await?;
    // NUMERIC affinity stores '0042' as the integer 42 and 3.0 as the integer 3.
    assert_eq!(keys, ["1", "42", "abc", "-7", "2.5", "3"]);
    assert_eq!(passed, 6);
    Ok(())
}

#[tokio::test]
async fn seeding_fills_an_empty_table_once_with_the_demo_keys() -> Result<(), DbError> {
    let dir = temp_dir();
    let db = sqlite_in(&dir);
    db.migrate().await?;
    assert_eq!(db.seed_demo_products(10_000).await?, 10_000);
    assert_eq!(db.seed_demo_products(10_000).await?, 0, "already seeded");

    let source = sql("SELECT sku_id FROM products ORDER BY sku_id");
    assert_eq!(db.count_rows(&source).await?, 10_000);
    let mut keys = Vec::with_capacity(10_000);
    let passed = db
        .for_each_key(&source, |k| keys.push(k.to_owned()))
        .await?;
    assert_eq!(passed, 10_000);
    let expected: Vec<String> = (0..10_000).map(|i| demo_sku(i).to_string()).collect();
    assert_eq!(keys, expected);

    let lookup = sql("SELECT sku_id, name, price, updated_at FROM products WHERE sku_id = ?");
    for i in [0, 1, 4_999, 9_999] {
        let row = db
            .lookup(&lookup, KeyParam::Int(demo_sku(i)))
            .await?
            .expect("a present demo key");
        assert_eq!(row["sku_id"], json!(demo_sku(i)));
        assert_eq!(row["name"], json!(format!("Product {}", demo_sku(i))));
        assert!(row["price"].is_number(), "{row:?}");
        let stamp = row["updated_at"].as_str().unwrap_or_default();
        assert!(stamp.len() == 20 && stamp.ends_with('Z'), "{stamp}");
        assert_eq!(
            db.lookup(&lookup, KeyParam::Int(demo_absent_sku(i)))
                .await?,
            None
        );
    }
    assert_eq!(
        db.lookup(&lookup, KeyParam::Int(demo_sku(10_000))).await?,
        None
    );
    Ok(())
}

#[tokio::test]
async fn bad_sql_is_a_query_error_not_unavailability() {
    let dir = temp_dir();
    let db = sqlite_in(&dir);
    let err = db
        .lookup(&sql("SELEKT nothing"), KeyParam::Int(1))
        .await
        .expect_err("invalid SQL");
    assert!(matches!(err, DbError::Query(_)), "{err:?}");
    assert!(!err.is_unavailable());
}

#[test]
fn unsupported_urls_are_refused_without_echoing_secrets() {
    let settings = PoolSettings::default();
    for url in [
        "postgres://user:s3cret@db.example/x",
        "s3cret-host/without-scheme",
        "user:s3cret@host",
    ] {
        let err = Db::connect_lazy(url, &settings).expect_err(url);
        assert!(matches!(err, DbError::UnsupportedUrl(_)), "{err:?}");
        assert!(!err.to_string().contains("s3cret"), "{err}");
    }
    let err = Db::connect_lazy("mysql://u:s3cret@host:notaport/db", &settings).expect_err("port");
    assert!(!err.to_string().contains("s3cret"), "{err}");
}

#[tokio::test]
async fn mysql_and_mariadb_schemes_both_choose_mysql() -> Result<(), DbError> {
    let settings = PoolSettings::default();
    for url in [
        "mysql://u:p@127.0.0.1:1/db",
        "mariadb://u:p@127.0.0.1:1/db",
        "MySQL://h/db",
    ] {
        assert_eq!(
            Db::connect_lazy(url, &settings)?.backend(),
            "mysql",
            "{url}"
        );
    }
    Ok(())
}

#[test]
fn sqlx_errors_are_classified_by_what_the_caller_can_do() {
    let io = || std::io::Error::new(std::io::ErrorKind::ConnectionReset, "reset");
    assert!(matches!(
        DbError::from(sqlx::Error::PoolTimedOut),
        DbError::PoolTimeout
    ));
    assert!(matches!(
        DbError::from(sqlx::Error::Io(io())),
        DbError::Unavailable(_)
    ));
    assert!(matches!(
        DbError::from(sqlx::Error::PoolClosed),
        DbError::Unavailable(_)
    ));
    assert!(matches!(
        DbError::from(sqlx::Error::WorkerCrashed),
        DbError::Unavailable(_)
    ));
    assert!(matches!(
        DbError::from(sqlx::Error::RowNotFound),
        DbError::Query(_)
    ));
    assert!(DbError::PoolTimeout.is_unavailable());
    assert!(!DbError::UnsupportedUrl(String::new()).is_unavailable());
}

#[tokio::test]
async fn a_closed_pool_is_unavailable() {
    let dir = temp_dir();
    let db = sqlite_in(&dir);
    db.close().await;
    let err = db.ping().await.expect_err("pool closed");
    assert!(err.is_unavailable(), "{err:?}");
}

/// `cargo test --release -- --ignored --nocapture seed_one_million` prints the time.
#[tokio::test]
#[ignore = "timing: seeds 1,000,000 rows"]
async fn timing_seed_one_million_sqlite() -> Result<(), DbError> {
    let dir = temp_dir();
    let db = sqlite_in(&dir);
    db.migrate().await?;
    let start = Instant::now();
    let inserted = db.seed_demo_products(1_000_000).await?;
    let seeded = start.elapsed();
    let start = Instant::now();
    let mut n = 0u64;
    db.for_each_key(&sql("SELECT sku_id FROM products"), |_| n += 1)
        .await?;
    println!(
        "sqlite: seeded {inserted} rows in {:.2} s; for_each_key over {n} rows in {:.2} s",
        seeded.as_secs_f64(),
        start.elapsed().as_secs_f64()
    );
    assert_eq!(n, 1_000_000);
    Ok(())
}

/// An in-memory database lives as long as one connection to it: keep one open.
#[tokio::test]
async fn in_memory_sqlite_works_while_a_connection_stays_open() -> Result<(), DbError> {
    let settings = PoolSettings {
        min_connections: 1,
        idle_timeout: None,
        ..PoolSettings::default()
    };
    let db = Db::connect_lazy("sqlite::memory:", &settings)?;
    db.migrate().await?;
    assert_eq!(db.seed_demo_products(10).await?, 10);
    let lookup = sql("SELECT name FROM products WHERE sku_id = ?");
    let row = db.lookup(&lookup, KeyParam::Int(demo_sku(3))).await?;
    assert_eq!(
        row.map(Value::Object),
        Some(json!({"name": format!("Product {}", demo_sku(3))}))
    );
    Ok(())
}
