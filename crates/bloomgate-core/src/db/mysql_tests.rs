//! Tests of the database stage against MariaDB/MySQL.
//!
//! They need `BLOOMGATE_TEST_MYSQL_URL` (a server URL without a database; `scripts/test`
//! starts a throwaway MariaDB and sets it). Each test creates its own database
//! `bg_<random>` and drops it at the end. Without the URL they print a notice and pass,
//! except under CI (`CI` set and not empty), where a missing URL fails them: the rule of
//! the integration tests (`tests/support`).

use std::io::Write as _;
use std::net::TcpListener;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use super::*;

const URL_VAR: &str = "BLOOMGATE_TEST_MYSQL_URL";

/// A database of its own on the test server, plus a pool on it. Dropped at the end of
/// the test that made it, passed or failed: [`TestDatabase::drop_database`] on the way
/// out, and its `Drop` after a panic or an early `?`.
struct TestDatabase {
    db: Db,
    server: Db,
    name: String,
    /// The server URL, for a drop made outside the test's runtime.
    base: String,
    dropped: bool,
}

impl TestDatabase {
    /// Creates `bg_<random>` on the server, or returns `None` (after saying so) when no
    /// server was given. Panics under CI instead: there a skipped test is a lie.
    async fn create(settings: PoolSettings) -> Option<TestDatabase> {
        let Some(base) = std::env::var(URL_VAR).ok().filter(|u| !u.is_empty()) else {
            if std::env::var_os("CI").is_some_and(|v| !v.is_empty()) {
                panic!("{URL_VAR} is not set but CI is: run the tests through scripts/test");
            }
            // Straight to stderr: libtest would swallow eprintln! from a passing test.
            let _ = writeln!(
                std::io::stderr(),
                "skipping a MariaDB test: {URL_VAR} is not set (scripts/test sets it)"
            );
            return None;
        };
        let server = Db::connect_lazy(&base, &PoolSettings::default()).expect("a valid test URL");
        let name = format!("bg_{:016x}", rand::random::<u64>());
        exec(&server, &format!("CREATE DATABASE {name}"))
            .await
            .expect("create the test database");
        let (server_part, query) = match base.split_once('?') {
            Some((s, q)) => (s, format!("?{q}")),
            None => (base.as_str(), String::new()),
        };
        let url = format!("{}/{name}{query}", server_part.trim_end_matches('/'));
        let db = Db::connect_lazy(&url, &settings).expect("a valid test database URL");
        Some(TestDatabase {
            db,
            server,
            name,
            base,
            dropped: false,
        })
    }

    async fn drop_database(mut self) {
        self.db.close().await;
        let _ = exec(&self.server, &format!("DROP DATABASE {}", self.name)).await;
        self.server.close().await;
        self.dropped = true;
    }
}

impl Drop for TestDatabase {
    /// A test that failed never reached [`TestDatabase::drop_database`]: drop its database
    /// on a runtime of its own (the test's may be gone, or be the one unwinding).
    fn drop(&mut self) {
        if self.dropped {
            return;
        }
        let base = self.base.clone();
        let name = self.name.clone();
        let _ = std::thread::spawn(move || {
            let Ok(runtime) = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            else {
                return;
            };
            runtime.block_on(async {
                if let Ok(server) = Db::connect_lazy(&base, &PoolSettings::default()) {
                    let _ = exec(&server, &format!("DROP DATABASE IF EXISTS {name}")).await;
                    server.close().await;
                }
            });
        })
        .join();
    }
}

fn pool(db: &Db) -> &MySqlPool {
    match db {
        Db::MySql(pool) => pool,
        Db::Sqlite(_) => panic!("expected a MySQL pool"),
    }
}

/// Runs test-made SQL (database names, DDL), possibly several `;`-separated statements
/// on one connection, with no parameters.
async fn exec(db: &Db, text: &str) -> Result<(), DbError> {
    sqlx::raw_sql(AssertSqlSafe(text.to_owned()))
        .execute(pool(db))
        .await?;
    Ok(())
}

fn sql(text: &str) -> Arc<str> {
    Arc::from(text)
}

#[tokio::test]
async fn migrations_seeding_and_product_lookup() -> Result<(), DbError> {
    let Some(t) = TestDatabase::create(PoolSettings::default()).await else {
        return Ok(());
    };
    let db = &t.db;
    assert_eq!(db.backend(), "mysql");
    db.ping().await?;
    db.migrate().await?;
    db.migrate().await?;
    assert_eq!(db.seed_demo_products(1_000).await?, 1_000);
    assert_eq!(db.seed_demo_products(1_000).await?, 0);

    let lookup = sql("SELECT sku_id, name, price, updated_at FROM products WHERE sku_id = ?");
    let row = db
        .lookup(&lookup, KeyParam::Int(demo_sku(500)))
        .await?
        .expect("present");
    assert_eq!(row["sku_id"], json!(demo_sku(500)));
    assert_eq!(row["name"], json!(format!("Product {}", demo_sku(500))));
    assert!(row["price"].is_number(), "{row:?}");
    let stamp = row["updated_at"].as_str().unwrap_or_default();
    assert!(stamp.len() == 20 && stamp.ends_with('Z'), "{stamp}");
    assert_eq!(
        db.lookup(&lookup, KeyParam::Int(demo_absent_sku(500)))
            .await?,
        None
    );
    // A text key against the BIGINT column: MySQL converts it.
    let text_key = demo_sku(7).to_string();
    assert!(
        db.lookup(&lookup, KeyParam::Text(&text_key))
            .await?
            .is_some()
    );

    t.drop_database().await;
    Ok(())
}

#[tokio::test]
async fn lookup_renders_each_mysql_type_as_json() -> Result<(), DbError> {
    let Some(t) = TestDatabase::create(PoolSettings::default()).await else {
        return Ok(());
    };
    let db = &t.db;
    exec(
        db,
        "CREATE TABLE typed (
            id BIGINT UNSIGNED NOT NULL PRIMARY KEY,
            i8 TINYINT, u8 TINYINT UNSIGNED, i16 SMALLINT, u16 SMALLINT UNSIGNED,
            i24 MEDIUMINT, u24 MEDIUMINT UNSIGNED, i32 INT, u32 INT UNSIGNED,
            i64 BIGINT, u64 BIGINT UNSIGNED, flag BOOLEAN, f32 FLOAT, f64 DOUBLE,
            price DECIMAL(12,2), whole DECIMAL(12,2), huge DECIMAL(40,20), tiny DECIMAL(30,25),
            code CHAR(3), label VARCHAR(50), body TEXT, exact_label VARCHAR(20) COLLATE utf8mb4_bin,
            kind ENUM('small','large'), tags SET('a','b','c'), doc JSON,
            day DATE, moment DATETIME(6), stamp TIMESTAMP(3) NULL, span TIME, yr YEAR, bits BIT(10),
            raw BLOB, vb VARBINARY(8), missing VARCHAR(5) NULL, zero_day DATE NULL
        )",
    )
    .await?;
    // The empty sql_mode allows the zero date (strict mode refuses it); both statements
    // go to one connection.
    exec(
        db,
        "SET SESSION sql_mode = ''; INSERT INTO typed VALUES (
            18446744073709551615, -128, 255, -32768, 65535, -8388608, 16777215,
            -2147483648, 4294967295, -9223372036854775808, 18446744073709551615, TRUE, 1.1, 0.1,
            19.99, 100.00, '12345678901234567890.12345678901234567890', 0.1000000000000000000000001,
            'abc', 'héllo wörld', 'a longer text', 'Exact', 'large', 'a,c', '{\"k\": [1, 2]}',
            '2026-12-02', '2026-12-02 09:10:11.123456', '2026-12-02 09:10:11.500', '-12:34:56',
            2026, b'1000000001', X'00FF41', X'4142', NULL, '0000-00-00'
        )",
    )
    .await?;

    let mut row = db
        .lookup(
            &sql("SELECT * FROM typed WHERE id = ?"),
            KeyParam::Int(u64::MAX),
        )
        .await?
        .expect("the row keyed u64::MAX");
    // MariaDB's JSON is LONGTEXT, so it arrives as a string; MySQL 8's as nested JSON.
    let doc = row.remove("doc").unwrap_or_default();
    let doc = match doc {
        Value::String(text) => serde_json::from_str(&text).unwrap_or(Value::String(text)),
        nested => nested,
    };
    assert_eq!(doc, json!({"k": [1, 2]}));
    assert_eq!(
        Value::Object(row),
        json!({
            "id": u64::MAX,
            "i8": -128, "u8": 255, "i16": -32768, "u16": 65535,
            "i24": -8388608, "u24": 16777215, "i32": -2147483648_i64, "u32": 4294967295_u64,
            "i64": i64::MIN, "u64": u64::MAX,
            "flag": true, "f32": 1.1, "f64": 0.1,
            "price": 19.99, "whole": 100, "huge": "12345678901234567890.12345678901234567890",
            "tiny": "0.1000000000000000000000001",
            "code": "abc", "label": "héllo wörld", "body": "a longer text", "exact_label": "Exact",
            "kind": "large", "tags": "a,c",
            "day": "2026-12-02", "moment": "2026-12-02T09:10:11.123456",
            "stamp": "2026-12-02T09:10:11.500Z", "span": "-12:34:56", "yr": 2026, "bits": 513,
            "raw": "\u{0}\u{fffd}A", "vb": "AB", "missing": null, "zero_day": null,
        })
    );

    // Expressions have types of their own; a text key binds as text.
    let row = db
        .lookup(
            &sql(
                "SELECT code, 1 + 1 AS two, NULL AS nothing, 2.50 AS lit FROM typed WHERE code = ?",
            ),
            KeyParam::Text("abc"),
        )
        .await?
        .expect("code abc");
    assert_eq!(
        Value::Object(row),
        json!({"code": "abc", "two": 2, "nothing": null, "lit": 2.5})
    );
    t.drop_database().await;
    Ok(())
}

#[tokio::test]
async fn for_each_key_streams_a_hundred_thousand_keys() -> Result<(), DbError> {
    let Some(t) = TestDatabase::create(PoolSettings::default()).await else {
        return Ok(());
    };
    let db = &t.db;
    db.migrate().await?;
    assert_eq!(db.seed_demo_products(100_000).await?, 100_000);
    let source = sql("SELECT sku_id FROM products ORDER BY sku_id");
    assert_eq!(db.count_rows(&source).await?, 100_000);

    let mut expected = (0..100_000u64).map(demo_sku);
    let mut mismatches = 0u64;
    let passed = db
        .for_each_key(&source, |key| {
            let want = expected.next().map(|n| n.to_string());
            if want.as_deref() != Some(key) {
                mismatches += 1;
            }
        })
        .await?;
    assert_eq!(passed, 100_000);
    assert_eq!(mismatches, 0);
    assert_eq!(expected.next(), None);
    t.drop_database().await;
    Ok(())
}

#[tokio::test]
async fn for_each_key_renders_text_unsigned_and_null_keys() -> Result<(), DbError> {
    let Some(t) = TestDatabase::create(PoolSettings::default()).await else {
        return Ok(());
    };
    let db = &t.db;
    exec(
        db,
        "CREATE TABLE k (n BIGINT UNSIGNED NULL, s VARCHAR(20) NULL, d DECIMAL(20,0) NULL)",
    )
    .await?;
    exec(
        db,
        "INSERT INTO k VALUES (18446744073709551615, 'SKU-1', 12), (NULL, NULL, NULL), (0, 'sku-2', 3)",
    )
    .await?;
    let mut keys = Vec::new();
    for column in ["n", "s", "d"] {
        let source = sql(&format!("SELECT {column} FROM k ORDER BY s IS NULL, s"));
        let passed = db
            .for_each_key(&source, |k| keys.push(k.to_owned()))
            .await?;
        assert_eq!(passed, 2, "{column}");
    }
    assert_eq!(
        keys,
        ["18446744073709551615", "0", "SKU-1", "sku-2", "12", "3"]
    );
    t.drop_database().await;
    Ok(())
}

#[tokio::test]
async fn an_exhausted_pool_times_out_within_the_acquire_timeout() -> Result<(), DbError> {
    let settings = PoolSettings {
        max_connections: 1,
        acquire_timeout: Duration::from_millis(300),
        ..PoolSettings::default()
    };
    let Some(t) = TestDatabase::create(settings).await else {
        return Ok(());
    };
    let held = pool(&t.db).acquire().await?;
    let start = Instant::now();
    let err =
        t.db.lookup(&sql("SELECT 1 AS one WHERE 1 = ?"), KeyParam::Int(1))
            .await;
    let waited = start.elapsed();
    assert!(matches!(err, Err(DbError::PoolTimeout)), "{err:?}");
    assert!(err.is_err_and(|e| e.is_unavailable()));
    assert!(
        waited >= Duration::from_millis(250) && waited < Duration::from_secs(2),
        "{waited:?}"
    );
    drop(held);
    let row =
        t.db.lookup(&sql("SELECT 1 AS one WHERE 1 = ?"), KeyParam::Int(1))
            .await?;
    assert_eq!(row.map(Value::Object), Some(json!({"one": 1})));
    t.drop_database().await;
    Ok(())
}

#[tokio::test]
async fn bad_sql_is_a_query_error() -> Result<(), DbError> {
    let Some(t) = TestDatabase::create(PoolSettings::default()).await else {
        return Ok(());
    };
    let err =
        t.db.lookup(
            &sql("SELECT * FROM no_such_table WHERE id = ?"),
            KeyParam::Int(1),
        )
        .await;
    assert!(matches!(err, Err(DbError::Query(_))), "{err:?}");
    t.drop_database().await;
    Ok(())
}

/// Needs no server: a port nobody listens on.
#[tokio::test]
async fn a_closed_port_is_unavailable_within_the_acquire_timeout() {
    let port = {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind an ephemeral port");
        listener.local_addr().expect("its address").port()
    };
    let settings = PoolSettings {
        acquire_timeout: Duration::from_millis(300),
        ..PoolSettings::default()
    };
    let db = Db::connect_lazy(&format!("mysql://u:p@127.0.0.1:{port}/x"), &settings)
        .expect("a valid URL: connect_lazy does not connect");
    let start = Instant::now();
    let err = db.ping().await.expect_err("nothing listens there");
    // sqlx retries refused connections until the acquire timeout, so this is
    // PoolTimeout rather than Unavailable(Io); both mean "unavailable".
    assert!(err.is_unavailable(), "{err:?}");
    assert!(
        start.elapsed() < Duration::from_secs(2),
        "{:?}",
        start.elapsed()
    );
    let err = db
        .lookup(&sql("SELECT ?"), KeyParam::Int(1))
        .await
        .expect_err("still down");
    assert!(err.is_unavailable(), "{err:?}");
}

/// `scripts/mariadb cargo test --release -- --ignored --nocapture timing_for_each_key`
#[tokio::test]
#[ignore = "timing: seeds and streams 1,000,000 rows"]
async fn timing_for_each_key_one_million_mysql() -> Result<(), DbError> {
    let Some(t) = TestDatabase::create(PoolSettings::default()).await else {
        return Ok(());
    };
    let db = &t.db;
    db.migrate().await?;
    let start = Instant::now();
    let inserted = db.seed_demo_products(1_000_000).await?;
    let seeded = start.elapsed();
    let start = Instant::now();
    let mut n = 0u64;
    let mut bytes = 0usize;
    db.for_each_key(&sql("SELECT sku_id FROM products"), |k| {
        n += 1;
        bytes += k.len();
    })
    .await?;
    println!(
        "mysql: seeded {inserted} rows in {:.2} s; for_each_key over {n} rows ({bytes} key bytes) in {:.2} s",
        seeded.as_secs_f64(),
        start.elapsed().as_secs_f64()
    );
    assert_eq!(n, 1_000_000);
    t.drop_database().await;
    Ok(())
}
