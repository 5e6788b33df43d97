//! The guarded pipeline in-process, without sockets: route match → key normalisation →
//! filter → (refusal | cache hit) → response, through the same `Proxy` the server uses,
//! on an embedded SQLite database. Run with `cargo bench --bench pipeline`.

#[path = "../tests/support/config.rs"]
#[allow(dead_code)]
mod config;

use std::hint::black_box;

use bloomgate::App;
use bloomgate::config::Config;
use bloomgate::db::{Db, PoolSettings, demo_absent_sku, demo_sku};
use bloomgate::gate::RebuildReason;
use config::{TestConfig, TestRoute};
use criterion::{Criterion, criterion_group, criterion_main};
use futures_util::FutureExt;
use http::Uri;

const PRODUCTS: u64 = 100_000;

fn pipeline(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let dir = tempfile::TempDir::new().expect("temp dir");
    let url = format!("sqlite://{}", dir.path().join("bench.db").display());
    let proxy = rt.block_on(async {
        let db = Db::connect_lazy(&url, &PoolSettings::default()).expect("pool");
        db.migrate().await.expect("migrate");
        db.seed_demo_products(PRODUCTS).await.expect("seed");
        let lookup = "SELECT sku_id, name, price FROM products WHERE sku_id = ?";
        let route = |path| TestRoute::sql("", path).unnamed().lookup(lookup);
        let toml = TestConfig::new(&url)
            // The audit at its shipped default, as it runs in production.
            .audit("enabled = true")
            .server("listen = \"127.0.0.1:0\"")
            .admin("listen = \"127.0.0.1:0\"")
            .expected_items(PRODUCTS)
            .route(route("/api/products/{id}"))
            .route(route("/api/product/info").query_key("sku_id"))
            .toml();
        let app = App::bind(Config::from_toml_str(&toml).expect("config"))
            .await
            .expect("bind");
        let proxy = app.proxy();
        proxy.current().routes()[0]
            .filter
            .build_once(&db, RebuildReason::Startup)
            .await
            .expect("build");
        proxy
    });

    let absent: Vec<Uri> = (0..1_000)
        .map(|i| {
            format!("/api/products/{}", demo_absent_sku(i))
                .parse()
                .expect("uri")
        })
        .collect();
    let present: Vec<Uri> = (0..1_000)
        .map(|i| {
            format!("/api/products/{}", demo_sku(i))
                .parse()
                .expect("uri")
        })
        .collect();
    let present_query: Vec<Uri> = (0..1_000)
        .map(|i| {
            format!("/api/product/info?sku_id={}", demo_sku(i))
                .parse()
                .expect("uri")
        })
        .collect();
    // Warm the cache so the hit benchmarks never reach the database.
    rt.block_on(async {
        for u in present.iter().chain(&present_query) {
            proxy.answer_guarded(u).await;
        }
    });

    // The cache-hit path runs moka futures that expect a runtime context.
    let _context = rt.enter();
    let mut group = c.benchmark_group("pipeline");
    let mut bench = |name: &str, uris: &[Uri]| {
        let mut i = 0usize;
        group.bench_function(name, |b| {
            b.iter(|| {
                i = (i + 1) % uris.len();
                let resp = proxy.answer_guarded(&uris[i]).now_or_never().flatten();
                black_box(resp)
            })
        });
    };
    bench("gate_refusal_path_key", &absent);
    bench("cache_hit_path_key", &present);
    bench("cache_hit_query_key", &present_query);
    group.finish();
}

criterion_group!(benches, pipeline);
criterion_main!(benches);
