//! Heap allocations on the hot path, counted by a global allocator: a request the filter
//! refuses allocates nothing beyond building the response itself (a header map), which
//! any HTTP server pays. Runs against an embedded SQLite database, no sockets.

#[path = "support/config.rs"]
#[allow(dead_code)]
mod config;

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::atomic::{AtomicUsize, Ordering};

use bloomgate::App;
use bloomgate::config::Config;
use bloomgate::db::{Db, PoolSettings, demo_absent_sku, demo_sku};
use bloomgate::gate::RebuildReason;
use bytes::Bytes;
use config::{TestConfig, TestRoute};
use futures_util::FutureExt;
use http::header::CONTENT_TYPE;
use http::{HeaderValue, Response, StatusCode, Uri};
use http_body_util::{Either, Full};

struct Counting;

static ALLOCATIONS: AtomicUsize = AtomicUsize::new(0);

thread_local! {
    static COUNTING: Cell<bool> = const { Cell::new(false) };
}

// SAFETY: every call is forwarded unchanged to the system allocator; the only addition
// is a counter increment, which does not allocate.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if COUNTING.with(Cell::get) {
            ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        }
        // SAFETY: same contract as the caller's.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: same contract as the caller's.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if COUNTING.with(Cell::get) {
            ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        }
        // SAFETY: same contract as the caller's.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// Allocations made on this thread while `f` runs.
fn allocations<R>(f: impl FnOnce() -> R) -> (usize, R) {
    let before = ALLOCATIONS.load(Ordering::Relaxed);
    COUNTING.with(|c| c.set(true));
    let r = f();
    COUNTING.with(|c| c.set(false));
    (ALLOCATIONS.load(Ordering::Relaxed) - before, r)
}

#[tokio::test(flavor = "current_thread")]
async fn an_intercepted_request_allocates_only_its_response() {
    let dir = tempfile::TempDir::new().expect("temp dir");
    let url = format!("sqlite://{}", dir.path().join("demo.db").display());
    let db = Db::connect_lazy(&url, &PoolSettings::default()).expect("pool");
    db.migrate().await.expect("migrate");
    db.seed_demo_products(10_000).await.expect("seed");
    let toml = TestConfig::new(&url)
        // The audit at its shipped default, as it runs in production.
        .audit("enabled = true")
        .server("listen = \"127.0.0.1:0\"")
        .admin("listen = \"127.0.0.1:0\"")
        .expected_items(10_000)
        .route(
            TestRoute::sql("", "/api/products/{id}")
                .unnamed()
                .lookup("SELECT sku_id, name FROM products WHERE sku_id = ?"),
        )
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

    // An absent key the filter refuses (skip the rare false positives).
    let uri: Uri = (0..100)
        .map(|i| format!("/api/products/{}", demo_absent_sku(i)))
        .find(|u| {
            let uri: Uri = u.parse().expect("uri");
            proxy
                .answer_guarded(&uri)
                .now_or_never()
                .flatten()
                .is_some_and(|r| r.headers()["x-bloomgate"] == "intercepted")
        })
        .expect("an intercepted key")
        .parse()
        .expect("uri");

    let (refused, resp) = allocations(|| proxy.answer_guarded(&uri).now_or_never().flatten());
    let resp = resp.expect("answered without waiting");
    assert_eq!(resp.status(), StatusCode::NOT_FOUND);
    assert_eq!(resp.headers()["x-bloomgate"], "intercepted");
    drop(resp);

    // What building the same response costs anyone: a body and two headers.
    let (baseline, bare) = allocations(|| {
        let mut r: Response<Either<Full<Bytes>, ()>> =
            Response::new(Either::Left(Full::new(Bytes::from_static(b"{}"))));
        *r.status_mut() = StatusCode::NOT_FOUND;
        r.headers_mut()
            .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
        r.headers_mut().insert(
            http::HeaderName::from_static("x-bloomgate"),
            HeaderValue::from_static("intercepted"),
        );
        r
    });
    drop(bare);

    // A cache hit, for the record.
    let present: Uri = format!("/api/products/{}", demo_sku(7))
        .parse()
        .expect("uri");
    let first = proxy.answer_guarded(&present).await.expect("answered");
    assert_eq!(first.status(), StatusCode::OK);
    let (hit, resp) = allocations(|| proxy.answer_guarded(&present).now_or_never().flatten());
    let hit_stage = resp.map(|r| r.headers()["x-bloomgate"].clone());
    eprintln!(
        "allocations per request: intercepted {refused}, bare response {baseline}, cache hit {hit} ({hit_stage:?})"
    );
    assert!(
        refused <= baseline,
        "the intercepted path allocated {refused} times; building the response alone takes {baseline}"
    );
    db.close().await;
}
