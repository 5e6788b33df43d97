//! `bloomgate demo`: the whole pipeline on the embedded default. An SQLite database under
//! `data/` gets the migrations and demo products, the gate is built from it, and the proxy
//! serves both a path-key and a query-key route with the SQL origin. It prints what to
//! curl. It is a convenience wrapper: everything it does goes through the normal config.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::Context;

use bloomgate::app::{App, shutdown_signal};
use bloomgate::config::Config;
use bloomgate::db::{Db, PoolSettings, demo_absent_sku, demo_sku};

/// Options of the demo command.
#[derive(Debug, Clone)]
pub struct DemoOptions {
    /// Products seeded when the table is empty.
    pub products: u64,
    /// SQLite file.
    pub db_path: PathBuf,
    /// Data-plane address.
    pub listen: SocketAddr,
    /// Admin-plane address.
    pub admin_listen: SocketAddr,
}

/// The demo's config, before environment overrides.
pub fn demo_config_toml(opts: &DemoOptions, expected_items: u64) -> String {
    format!(
        r#"
[server]
listen = "{listen}"

[admin]
listen = "{admin}"
token = "demo-admin-token"

[database]
url = "sqlite://{db}"
max_connections = 8

[cache]
max_entries = 100000
ttl = "5m"
negative_max_entries = 100000
negative_ttl = "30s"

[filters.products]
source_query = "SELECT sku_id FROM products"
expected_items = {expected_items}
false_positive_rate = 0.01
normalize = {{ kind = "integer" }}

[[routes]]
name = "product_by_path"
path = "/api/products/{{id}}"
key = {{ segment = "id" }}
filter = "products"
origin = {{ kind = "sql", query = "SELECT sku_id, name, price, updated_at FROM products WHERE sku_id = ?" }}

[[routes]]
name = "product_info"
path = "/api/product/info"
key = {{ query = "sku_id" }}
filter = "products"
origin = {{ kind = "sql", query = "SELECT sku_id, name, price, updated_at FROM products WHERE sku_id = ?" }}
"#,
        listen = opts.listen,
        admin = opts.admin_listen,
        db = opts.db_path.display(),
    )
}

/// Prepares the database, then runs the proxy until SIGINT/SIGTERM.
pub async fn run(opts: DemoOptions) -> anyhow::Result<()> {
    if let Some(dir) = opts.db_path.parent()
        && !dir.as_os_str().is_empty()
    {
        std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    }
    let url = format!("sqlite://{}", opts.db_path.display());
    let db = Db::connect_lazy(
        &url,
        &PoolSettings {
            max_connections: 4,
            min_connections: 0,
            acquire_timeout: Duration::from_secs(5),
            idle_timeout: None,
        },
    )?;
    db.migrate().await.context("applying migrations")?;
    let started = Instant::now();
    let seeded = db
        .seed_demo_products(opts.products)
        .await
        .context("seeding demo products")?;
    if seeded > 0 {
        println!(
            "seeded {seeded} demo products into {} in {:.2?}",
            opts.db_path.display(),
            started.elapsed()
        );
    } else {
        println!("{} already holds the demo products", opts.db_path.display());
    }
    // Size the gate from what the table holds (it may have been seeded with another count).
    let rows = db
        .count_rows("SELECT sku_id FROM products")
        .await
        .context("counting demo products")?;
    db.close().await;

    let config = Config::from_toml_str_with_env(&demo_config_toml(&opts, rows.max(1000)))?;
    let app = App::bind(config).await?;
    let data = app.data_addr();
    let admin = app.admin_addr();
    let host = |a: SocketAddr| {
        if a.ip().is_unspecified() {
            format!("127.0.0.1:{}", a.port())
        } else {
            a.to_string()
        }
    };
    let (d, a) = (host(data), host(admin));
    let present = demo_sku(42);
    let absent = demo_absent_sku(42);
    println!(
        "\nbloomgate demo: data plane on http://{d}, admin plane on http://{a}\n\
         The gate loads in the background (requests fail open until /readyz says ready). Try:\n\n\
         curl -i http://{d}/api/products/{present}          # present key: miss, then hit\n\
         curl -i 'http://{d}/api/product/info?sku_id={present}'\n\
         curl -i http://{d}/api/products/{absent}          # absent key: intercepted by the gate\n\
         curl -i http://{d}/api/products/12ab              # malformed key: 400\n\
         curl -s http://{a}/readyz\n\
         curl -s http://{a}/admin/filters\n\
         curl -s http://{a}/metrics | grep bloomgate_requests_total\n\
         curl -X POST -H 'Authorization: Bearer demo-admin-token' http://{a}/admin/filters/products/rebuild\n\n\
         Ctrl-C stops it.\n"
    );
    app.run(shutdown_signal()).await;
    Ok(())
}

#[cfg(test)]
mod tests {
    use bloomgate::config::{CompiledOrigin, Normalize};
    use bloomgate::filter::BloomParams;

    use super::*;

    #[test]
    fn the_demo_config_compiles_to_two_sql_routes_on_one_filter() {
        let opts = DemoOptions {
            products: 10,
            db_path: PathBuf::from("data/demo.db"),
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            admin_listen: SocketAddr::from(([127, 0, 0, 1], 0)),
        };
        let config = Config::from_toml_str(&demo_config_toml(&opts, 5_000)).expect("valid");
        let c = config.compile().expect("compiles");
        assert!(c.upstream().is_none());
        assert!(c.write_through().is_empty());
        assert_eq!(c.filters().len(), 1);
        assert_eq!(
            c.filters()[0].params,
            BloomParams::optimal(5_000, 0.01).expect("valid parameters")
        );
        let labels: Vec<&str> = c.routes().iter().map(|r| &*r.label).collect();
        assert_eq!(labels, ["product_by_path", "product_info"]);
        for r in c.routes() {
            assert_eq!(r.filter, 0);
            assert_eq!(r.normalize, Normalize::Integer);
            assert_eq!(r.ttl, Duration::from_secs(300));
            assert_eq!(r.negative_ttl, Duration::from_secs(30));
            assert!(matches!(r.origin, CompiledOrigin::Sql { .. }), "{r:?}");
        }
        assert_eq!(c.routes()[0].pattern.matches("/api/products/9"), Some("9"));
        assert_eq!(c.routes()[1].query.key.as_deref(), Some("sku_id"));
    }
}
