//! `bloomgate init` against real databases: the config it writes for MariaDB and SQLite
//! tables of each shape passes `check-config` and, run by `serve` as written, answers 200
//! for a present key and 404 `intercepted` for an absent one; each refusal exits 2 with
//! its reason, a database that cannot be reached exits 1, and nothing is ever written to
//! the database.

mod support;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use bloomgate::db::demo_sku;
use bytes::Bytes;
use http::Method;
use sqlx::{AssertSqlSafe, Row};
use support::binary::{BIN, Bloomgate};
use support::{HttpClient, StubUpstream, TestDb, eventually, mysql_url, refused_absent_key};
use tempfile::TempDir;

/// What a run of the binary left behind.
struct Run {
    code: i32,
    stdout: String,
    stderr: String,
}

/// Runs `bloomgate ARGS` with `env` over an environment without `BLOOMGATE__…`.
fn bloomgate(args: &[&str], env: &[(&str, &str)]) -> Run {
    let mut cmd = Command::new(BIN);
    cmd.args(args).env_remove("RUST_LOG");
    for (name, _) in std::env::vars_os() {
        if name.to_string_lossy().starts_with("BLOOMGATE__") {
            cmd.env_remove(name);
        }
    }
    let out = cmd
        .envs(env.iter().copied())
        .output()
        .expect("run bloomgate");
    Run {
        code: out.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

/// `bloomgate init` with these flags: its config on success, else the failed run.
fn init(flags: &[&str]) -> Result<String, Run> {
    let mut args = vec!["init"];
    args.extend_from_slice(flags);
    let run = bloomgate(&args, &[]);
    if run.code == 0 {
        Ok(run.stdout)
    } else {
        Err(run)
    }
}

/// `init` that must succeed.
fn init_ok(flags: &[&str]) -> String {
    init(flags).unwrap_or_else(|r| panic!("init {flags:?} exit {}: {}", r.code, r.stderr))
}

/// `init` that must be refused with exit `code` and `message` in its error.
fn init_refused(flags: &[&str], code: i32, message: &str) {
    match init(flags) {
        Ok(out) => panic!("init {flags:?} succeeded:\n{out}"),
        Err(r) => {
            assert_eq!(r.code, code, "init {flags:?}: {}", r.stderr);
            assert!(
                r.stderr.contains(message),
                "init {flags:?}: `{message}` not in: {}",
                r.stderr
            );
            assert!(
                r.stdout.is_empty(),
                "a refusal printed a config: {}",
                r.stdout
            );
        }
    }
}

/// Writes `text` into `dir` and runs `check-config` on it with `env`.
fn check_config(dir: &Path, text: &str, env: &[(&str, &str)]) {
    let path = dir.join("generated.toml");
    std::fs::write(&path, text).expect("write the config");
    let run = bloomgate(
        &[
            "check-config",
            "--config",
            path.to_str().unwrap_or_default(),
        ],
        env,
    );
    assert_eq!(
        run.code, 0,
        "check-config: {}{}\n{text}",
        run.stdout, run.stderr
    );
}

/// The settings of a config, comments and blank lines left out.
fn settings(text: &str) -> Vec<&str> {
    text.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .collect()
}

/// Runs `serve` on `text` unchanged, with both listeners on port 0, the audit off and
/// `env`, and waits until its filter is ready.
async fn serve(text: &str, env: &[(&str, &str)]) -> Bloomgate {
    let mut all = vec![
        ("BLOOMGATE__SERVER__LISTEN", "127.0.0.1:0"),
        ("BLOOMGATE__ADMIN__LISTEN", "127.0.0.1:0"),
        // The audit could admit a refused key it samples; here only sync may.
        ("BLOOMGATE__AUDIT__ENABLED", "false"),
    ];
    all.extend_from_slice(env);
    let proxy = Bloomgate::serve(text, &all).await;
    let client = HttpClient::new();
    let url = format!("http://{}/readyz", proxy.admin);
    eventually("the filter is ready", Duration::from_secs(60), || {
        let (client, url) = (client.clone(), url.clone());
        async move { get(&client, &url).await.0 == 200 }
    })
    .await;
    proxy
}

/// Status and `x-bloomgate` of a GET.
async fn get(client: &HttpClient, url: &str) -> (u16, String) {
    let reply = client.send(Method::GET, url, &[], Bytes::new()).await;
    (reply.status.as_u16(), reply.stage().to_owned())
}

/// Asserts that `present` is answered 200 and `absent` 404 by the gate itself.
async fn assert_gated(proxy: &Bloomgate, present: &str, absent: &str) {
    let client = HttpClient::new();
    let base = format!("http://{}", proxy.data);
    let (status, stage) = get(&client, &format!("{base}{present}")).await;
    assert_eq!(status, 200, "{present}: {stage}");
    let (status, stage) = get(&client, &format!("{base}{absent}")).await;
    assert_eq!((status, stage.as_str()), (404, "intercepted"), "{absent}");
}

/// Runs `sql` as the privileged test user.
async fn exec(db: &TestDb, sql: &str) {
    sqlx::query(AssertSqlSafe(sql.to_owned()))
        .execute(&db.admin)
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"));
}

#[tokio::test]
async fn mariadb_integer_key_with_an_updated_at_index() {
    let Some(server) = mysql_url() else { return };
    let db = TestDb::create(&server, 200).await;
    // The URL holds the test user's password.
    let text = init_ok(&[
        "--database-url",
        &db.url,
        "--table",
        "products",
        "--key",
        "sku_id",
    ]);
    assert!(
        !text.contains(":pw@"),
        "the password is in the file:\n{text}"
    );
    assert!(text.contains("BLOOMGATE__DATABASE__URL"), "{text}");
    let lines = settings(&text);
    assert!(lines.len() <= 20, "{} settings:\n{text}", lines.len());
    for wanted in [
        "expected_items = 1000",
        "normalize = { kind = \"integer\" }",
        "watermark = \"timestamp\"",
        "query = \"SELECT `sku_id`, `updated_at` FROM `products` WHERE `updated_at` >= ?\"",
        "path = \"/api/products/{key}\"",
        "mode = \"enforce\"",
    ] {
        assert!(lines.contains(&wanted), "`{wanted}` not in:\n{text}");
    }
    // The same from the variable `serve` reads, keeping the password off the command line.
    let from_env = bloomgate(
        &["init", "--table", "products", "--key", "sku_id"],
        &[("BLOOMGATE__DATABASE__URL", &db.url)],
    );
    assert_eq!(
        (from_env.code, from_env.stdout.as_str()),
        (0, text.as_str()),
        "{}",
        from_env.stderr
    );
    init_refused(
        &["--table", "products", "--key", "sku_id"],
        2,
        "no database: pass --database-url",
    );
    let dir = TempDir::new().expect("temp dir");
    // Without the variable the file's URL has no password: MariaDB refuses it, but the
    // file itself is valid; with it, serve logs in.
    check_config(dir.path(), &text, &[]);
    check_config(dir.path(), &text, &[("BLOOMGATE__DATABASE__URL", &db.url)]);
    let proxy = serve(&text, &[("BLOOMGATE__DATABASE__URL", &db.url)]).await;
    let absent = refused_absent_key(&proxy, "/api/products/", 7).await;
    assert_gated(
        &proxy,
        &format!("/api/products/{}", demo_sku(7)),
        &format!("/api/products/{absent}"),
    )
    .await;
    // The sync section it wrote follows the table: a row inserted now is let through.
    db.insert_product(absent).await;
    assert_synced(&proxy, &format!("/api/products/{absent}")).await;
}

/// Waits until sync has let `path`'s new key through and the origin answers 200.
async fn assert_synced(proxy: &Bloomgate, path: &str) {
    let client = HttpClient::new();
    let url = format!("http://{}{path}", proxy.data);
    eventually("the new key is synced", Duration::from_secs(30), || {
        let (client, url) = (client.clone(), url.clone());
        async move { get(&client, &url).await.0 == 200 }
    })
    .await;
}

#[tokio::test]
async fn mariadb_string_key_keeps_its_length_and_case_insensitive_collation() {
    let Some(server) = mysql_url() else { return };
    let db = TestDb::create(&server, 0).await;
    exec(
        &db,
        "CREATE TABLE articles (slug VARCHAR(32) CHARACTER SET ascii COLLATE ascii_general_ci \
         NOT NULL, title VARCHAR(100) NOT NULL, UNIQUE KEY (slug))",
    )
    .await;
    exec(
        &db,
        "INSERT INTO articles VALUES ('Hello-World', 'Hi'), ('rust-2024', 'Rust')",
    )
    .await;
    let text = init_ok(&[
        "--database-url",
        &db.url,
        "--table",
        "articles",
        "--key",
        "slug",
        "--route",
        "/api/article?slug={key}",
    ]);
    let lines = settings(&text);
    for wanted in [
        "normalize = { kind = \"string\", lowercase = true, max_len = 32 }",
        "path = \"/api/article\"",
        "key = { query = \"slug\" }",
        "origin = { kind = \"sql\", query = \"SELECT * FROM `articles` WHERE `slug` = ?\" }",
    ] {
        assert!(lines.contains(&wanted), "`{wanted}` not in:\n{text}");
    }
    assert!(text.contains("# No incremental sync"), "{text}");
    assert!(lines.contains(&"rebuild_interval = \"10m\""), "{text}");
    let dir = TempDir::new().expect("temp dir");
    check_config(dir.path(), &text, &[("BLOOMGATE__DATABASE__URL", &db.url)]);
    let proxy = serve(&text, &[("BLOOMGATE__DATABASE__URL", &db.url)]).await;
    // Stored as Hello-World, asked for in another case: the same row for MariaDB.
    assert_gated(
        &proxy,
        "/api/article?slug=HELLO-world",
        "/api/article?slug=goodbye",
    )
    .await;
    // A utf8mb4 column of 32 characters holds up to 128 bytes.
    exec(&db, "CREATE TABLE tags (name VARCHAR(32) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin PRIMARY KEY)").await;
    let text = init_ok(&[
        "--database-url",
        &db.url,
        "--table",
        "tags",
        "--key",
        "name",
    ]);
    assert!(
        settings(&text)
            .contains(&"normalize = { kind = \"string\", lowercase = false, max_len = 128 }"),
        "{text}"
    );
}

#[tokio::test]
async fn mariadb_auto_increment_key_without_timestamp_syncs_by_integer_watermark() {
    let Some(server) = mysql_url() else { return };
    let db = TestDb::create(&server, 0).await;
    exec(&db, "CREATE TABLE orders (id BIGINT UNSIGNED NOT NULL AUTO_INCREMENT PRIMARY KEY, total INT NOT NULL, created_at DATETIME NOT NULL DEFAULT NOW())").await;
    exec(&db, "INSERT INTO orders (total) VALUES (1), (2), (3)").await;
    let text = init_ok(&[
        "--database-url",
        &db.url,
        "--table",
        "orders",
        "--key",
        "id",
    ]);
    let lines = settings(&text);
    for wanted in [
        "watermark = \"integer\"",
        "query = \"SELECT `id`, `id` FROM `orders` WHERE `id` >= ?\"",
        "start_query = \"SELECT MAX(`id`) FROM `orders`\"",
    ] {
        assert!(lines.contains(&wanted), "`{wanted}` not in:\n{text}");
    }
    // The three rows were created just now: a year at that rate is 37 more.
    assert!(text.contains("(3 by `created_at`: 37 a year)"), "{text}");
    let dir = TempDir::new().expect("temp dir");
    check_config(dir.path(), &text, &[("BLOOMGATE__DATABASE__URL", &db.url)]);
    let proxy = serve(&text, &[("BLOOMGATE__DATABASE__URL", &db.url)]).await;
    assert_gated(&proxy, "/api/orders/2", "/api/orders/4").await;
    exec(&db, "INSERT INTO orders (total) VALUES (4)").await;
    assert_synced(&proxy, "/api/orders/4").await;
}

#[tokio::test]
async fn mariadb_refusals_name_their_reason_and_exit_2() {
    let Some(server) = mysql_url() else { return };
    let db = TestDb::create(&server, 0).await;
    exec(
        &db,
        "CREATE TABLE loose (code INT NOT NULL, name VARCHAR(20))",
    )
    .await;
    exec(&db, "CREATE TABLE dupes (code INT NOT NULL, KEY (code))").await;
    exec(
        &db,
        "CREATE TABLE pairs (a INT NOT NULL, code INT NOT NULL, UNIQUE KEY (a, code), KEY (code))",
    )
    .await;
    let url = db.url.as_str();
    let flags = |table: &'static str| ["--database-url", url, "--table", table, "--key", "code"];
    init_refused(&flags("loose"), 2, "`code` of `loose` is not indexed");
    init_refused(&flags("dupes"), 2, "`code` of `dupes` is not unique");
    init_refused(&flags("pairs"), 2, "`code` of `pairs` is not unique");
    init_refused(&flags("missing"), 2, "table `missing` does not exist");
    exec(
        &db,
        "CREATE TABLE prices (code DECIMAL(10,2) NOT NULL PRIMARY KEY)",
    )
    .await;
    init_refused(
        &flags("prices"),
        2,
        "column `code` is of type decimal(10,2)",
    );
    // The server's URL, without a database to find the table in.
    init_refused(
        &[
            "--database-url",
            &server,
            "--table",
            "loose",
            "--key",
            "code",
        ],
        2,
        "the database URL names no database",
    );
    init_refused(
        &["--database-url", url, "--table", "loose", "--key", "nope"],
        2,
        "table `loose` has no column `nope`",
    );
    init_refused(
        &[
            "--database-url",
            url,
            "--table",
            "loose",
            "--key",
            "code",
            "--route",
            "/x",
        ],
        2,
        "--route \"/x\"",
    );

    // A user who may insert into the table but not read it.
    let user = format!("{}_w", db.user());
    exec(&db, &format!("CREATE USER '{user}'@'%' IDENTIFIED BY 'pw'")).await;
    exec(
        &db,
        &format!("GRANT INSERT ON {}.products TO '{user}'@'%'", db.name),
    )
    .await;
    let (_, host) = db.url.split_once('@').expect("user@host in the URL");
    let writer = format!("mysql://{user}:pw@{host}");
    init_refused(
        &[
            "--database-url",
            &writer,
            "--table",
            "products",
            "--key",
            "sku_id",
        ],
        2,
        "no SELECT privilege on table `products`",
    );
    // And one who may not use the database at all.
    let nobody = format!("{}_n", db.user());
    exec(
        &db,
        &format!("CREATE USER '{nobody}'@'%' IDENTIFIED BY 'pw'"),
    )
    .await;
    let stranger = format!("mysql://{nobody}:pw@{host}");
    init_refused(
        &[
            "--database-url",
            &stranger,
            "--table",
            "products",
            "--key",
            "sku_id",
        ],
        2,
        "no SELECT privilege on table `products`",
    );
    for u in [user, nobody] {
        exec(&db, &format!("DROP USER '{u}'@'%'")).await;
    }
}

#[tokio::test]
async fn mariadb_init_needs_only_select_and_writes_nothing() {
    let Some(server) = mysql_url() else { return };
    let db = TestDb::create(&server, 500).await;
    let user = format!("{}_r", db.user());
    exec(&db, &format!("CREATE USER '{user}'@'%' IDENTIFIED BY 'pw'")).await;
    exec(
        &db,
        &format!("GRANT SELECT ON {}.* TO '{user}'@'%'", db.name),
    )
    .await;
    let (_, host) = db.url.split_once('@').expect("user@host in the URL");
    let reader = format!("mysql://{user}:pw@{host}");
    let state = || async {
        let checksum = sqlx::query("CHECKSUM TABLE products")
            .fetch_one(&db.admin)
            .await
            .expect("checksum")
            .try_get::<Option<i64>, _>(1)
            .expect("checksum value");
        let tables: i64 = sqlx::query_scalar(
            "SELECT COUNT(*) FROM information_schema.TABLES WHERE TABLE_SCHEMA = ?",
        )
        .bind(&db.name)
        .fetch_one(&db.admin)
        .await
        .expect("count tables");
        let rows: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM products")
            .fetch_one(&db.admin)
            .await
            .expect("count rows");
        (checksum, tables, rows)
    };
    let before = state().await;
    let text = init_ok(&[
        "--database-url",
        &reader,
        "--table",
        "products",
        "--key",
        "sku_id",
    ]);
    assert!(text.contains("expected_items = 1000"), "{text}");
    assert_eq!(state().await, before, "init changed the database");
    exec(&db, &format!("DROP USER '{user}'@'%'")).await;
}

#[test]
fn a_database_that_cannot_be_reached_exits_1() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port();
    // The listener is gone: nothing answers on that port.
    let url = format!("mysql://app:pw@127.0.0.1:{port}/shop");
    init_refused(
        &[
            "--database-url",
            &url,
            "--table",
            "products",
            "--key",
            "sku_id",
        ],
        1,
        "cannot connect to the database",
    );
}

/// An SQLite database file in a temporary directory, made with the `sqlite3` statements
/// given.
fn sqlite_db(dir: &TempDir, sql: &str) -> (PathBuf, String) {
    let path = dir.path().join("shop.db");
    let url = format!("sqlite://{}", path.display());
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        use sqlx::Connection as _;
        let mut conn = sqlx::SqliteConnection::connect(&format!("{url}?mode=rwc"))
            .await
            .expect("create the SQLite file");
        sqlx::raw_sql(AssertSqlSafe(sql.to_owned()))
            .execute(&mut conn)
            .await
            .expect("fill the SQLite file");
        conn.close().await.expect("close");
    });
    (path, url)
}

#[tokio::test(flavor = "multi_thread")]
async fn sqlite_text_key_without_sync_is_rebuilt_and_never_written() {
    let dir = TempDir::new().expect("temp dir");
    let (path, url) = tokio::task::block_in_place(|| {
        sqlite_db(
            &dir,
            "CREATE TABLE books (isbn TEXT NOT NULL UNIQUE COLLATE NOCASE, title TEXT);
             INSERT INTO books VALUES ('978-0-13-468599-1', 'K&R'), ('978-1-59327-828-1', 'Rust');",
        )
    });
    let before = std::fs::read(&path).expect("read the file");
    let text = init_ok(&["--database-url", &url, "--table", "books", "--key", "isbn"]);
    assert_eq!(
        std::fs::read(&path).expect("read the file"),
        before,
        "init wrote to the file"
    );
    let lines = settings(&text);
    for wanted in [
        "normalize = { kind = \"string\", lowercase = true, max_len = 255 }",
        "rebuild_interval = \"10m\"",
        "path = \"/api/books/{key}\"",
    ] {
        assert!(lines.contains(&wanted), "`{wanted}` not in:\n{text}");
    }
    assert!(text.contains("# No incremental sync"), "{text}");
    assert!(
        !text.contains("BLOOMGATE__DATABASE__URL"),
        "no password, no note:\n{text}"
    );
    check_config(dir.path(), &text, &[]);
    let proxy = serve(&text, &[]).await;
    assert_gated(
        &proxy,
        "/api/books/978-1-59327-828-1",
        "/api/books/978-0-00-000000-0",
    )
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn sqlite_with_upstream_origin_and_timestamp_sync() {
    let dir = TempDir::new().expect("temp dir");
    let (_, url) = tokio::task::block_in_place(|| {
        sqlite_db(
            &dir,
            "CREATE TABLE products (sku_id INTEGER PRIMARY KEY, name TEXT,
                 updated_at DATETIME NOT NULL DEFAULT CURRENT_TIMESTAMP);
             CREATE INDEX products_updated ON products (updated_at);
             INSERT INTO products (sku_id, name) VALUES (11, 'a'), (12, 'b'), (13, 'c');",
        )
    });
    let upstream = StubUpstream::start([11, 12, 13]).await;
    let text = init_ok(&[
        "--database-url",
        &url,
        "--table",
        "products",
        "--key",
        "sku_id",
        "--upstream",
        &upstream.url(),
    ]);
    let lines = settings(&text);
    let upstream_line = format!("url = \"{}\"", upstream.url());
    for wanted in [
        upstream_line.as_str(),
        "origin = { kind = \"upstream\" }",
        "watermark = \"timestamp\"",
        "normalize = { kind = \"integer\" }",
    ] {
        assert!(lines.contains(&wanted), "`{wanted}` not in:\n{text}");
    }
    check_config(dir.path(), &text, &[]);
    let proxy = serve(&text, &[]).await;
    assert_gated(&proxy, "/api/products/12", "/api/products/14").await;
    upstream.state.keys.lock().expect("lock").insert(14);
    tokio::task::block_in_place(|| {
        sqlite_db(
            &dir,
            "INSERT INTO products (sku_id, name) VALUES (14, 'd');",
        )
    });
    assert_synced(&proxy, "/api/products/14").await;
    assert!(
        upstream.requests().contains(&"/api/products/12".to_owned()),
        "the present key was fetched from the upstream: {:?}",
        upstream.requests()
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn sqlite_refusals_and_the_output_file() {
    let dir = TempDir::new().expect("temp dir");
    let (_, url) = tokio::task::block_in_place(|| {
        sqlite_db(
            &dir,
            "CREATE TABLE items (code TEXT NOT NULL, kind INTEGER);
             CREATE INDEX items_code ON items (code);
             CREATE TABLE \"order items\" (id INTEGER PRIMARY KEY);
             CREATE TABLE notes (id INTEGER PRIMARY KEY, body TEXT);",
        )
    });
    let flags = |table: &'static str, key: &'static str| {
        [
            "--database-url",
            url.as_str(),
            "--table",
            table,
            "--key",
            key,
        ]
    };
    init_refused(
        &flags("items", "code"),
        2,
        "`code` of `items` is not unique",
    );
    init_refused(
        &flags("items", "kind"),
        2,
        "`kind` of `items` is not indexed",
    );
    init_refused(&flags("nope", "id"), 2, "table `nope` does not exist");
    init_refused(
        &flags("order items", "id"),
        2,
        "no route can be made from the table name `order items`",
    );
    // With a route it can be gated; its filter's name is made from the table's.
    let text = init_ok(&[
        "--database-url",
        &url,
        "--table",
        "order items",
        "--key",
        "id",
        "--route",
        "/api/order-items/{id}",
    ]);
    assert!(settings(&text).contains(&"[filters.order_items]"), "{text}");

    let out = dir.path().join("bloomgate.toml");
    let out_str = out.to_str().unwrap_or_default();
    std::fs::write(&out, "kept\n").expect("write");
    let mut with_out = flags("notes", "id").to_vec();
    with_out.extend(["-o", out_str]);
    init_refused(&with_out, 2, "exists: pass --force to overwrite it");
    assert_eq!(std::fs::read_to_string(&out).expect("read"), "kept\n");
    with_out.push("--force");
    init_ok(&with_out);
    let written = std::fs::read_to_string(&out).expect("read");
    assert!(written.contains("watermark = \"integer\""), "{written}");
    let run = bloomgate(&["check-config", "--config", out_str], &[]);
    assert_eq!(run.code, 0, "{}{}", run.stdout, run.stderr);

    // A file that is not there is not created.
    let missing = dir.path().join("missing.db");
    let url = format!("sqlite://{}", missing.display());
    init_refused(
        &["--database-url", &url, "--table", "t", "--key", "id"],
        1,
        "cannot connect",
    );
    assert!(!missing.exists());
}
