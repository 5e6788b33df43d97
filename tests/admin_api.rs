//! The admin plane as docs/admin-api.md tells it: `POST /admin/cache/invalidate` drops
//! the cached entries of a key on every guarded route, so the next request goes to the
//! origin again; and every refusal has its status and JSON error code (401, 403, 404,
//! 405, 413). A real proxy, a real upstream that counts its hits, a real MariaDB.

mod support;

use bloomgate::db::demo_sku;
use bytes::Bytes;
use http::Method;
use support::{StubUpstream, TestConfig, TestDb, TestProxy, TestRoute, mysql_url};

const TOKEN: &str = "test-admin-token";
/// Largest key list the admin plane reads.
const MAX_ADMIN_BODY: usize = 64 * 1024 * 1024;

/// Sends `method path` to the admin plane with an optional `Authorization` value.
async fn admin(
    proxy: &TestProxy,
    method: Method,
    path: &str,
    authorization: Option<&str>,
    body: Bytes,
) -> support::Reply {
    let headers: Vec<(&str, &str)> = authorization
        .iter()
        .map(|a| ("authorization", *a))
        .collect();
    proxy
        .client()
        .send(
            method,
            &format!("http://{}{path}", proxy.admin),
            &headers,
            body,
        )
        .await
}

/// Asserts a JSON error answer: status, `error` code and a message.
fn assert_error(r: &support::Reply, status: u16, code: &str, what: &str) {
    assert_eq!(r.status.as_u16(), status, "{what}: {}", r.text());
    assert_eq!(
        r.headers.get("content-type").and_then(|v| v.to_str().ok()),
        Some("application/json"),
        "{what}"
    );
    let body = r.json();
    assert_eq!(body["error"], code, "{what}: {body}");
    assert!(body["message"].is_string(), "{what}: {body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalidating_a_key_sends_its_next_request_to_the_origin_on_every_route() {
    let Some(server) = mysql_url() else { return };
    let db = TestDb::create(&server, 200).await;
    // The upstream has the first 100 products; the other 100 pass the gate and are not
    // found there, so they get negative entries.
    let stub = StubUpstream::start((0..100).map(demo_sku)).await;
    let proxy = TestProxy::spawn_ready(
        &TestConfig::new(&db.url)
            .admin_token(TOKEN)
            .upstream(&stub.url())
            .expected_items(200)
            .cache("ttl = \"1h\"")
            .cache("negative_ttl = \"1h\"")
            .route(TestRoute::upstream("by_path", "/api/products/{id}"))
            .route(TestRoute::upstream("by_query", "/api/product/info").query_key("sku_id"))
            .toml(),
    )
    .await;
    let (found, absent) = (demo_sku(3), demo_sku(150));
    let paths = |k: u64| {
        [
            format!("/api/products/{k}"),
            format!("/api/product/info?sku_id={k}"),
        ]
    };
    let expect = |k: u64, status: u16, stage: &'static str| {
        let proxy = &proxy;
        async move {
            for path in paths(k) {
                let r = proxy.get(&path).await;
                assert_eq!((r.status.as_u16(), r.stage()), (status, stage), "{path}");
            }
        }
    };
    expect(found, 200, "miss").await;
    expect(found, 200, "hit").await;
    expect(absent, 404, "miss").await;
    expect(absent, 404, "negative-hit").await;
    assert_eq!(stub.hits(), 4);

    // Positive entries: one call drops them on both routes. The key is normalised with
    // the filter's rule, so `0003`-style spellings name the same key.
    let r = proxy
        .admin_post(
            "/admin/cache/invalidate",
            Some(TOKEN),
            &format!("[\"00{found}\"]"),
        )
        .await;
    assert_eq!(r.status.as_u16(), 200, "{}", r.text());
    assert_eq!(r.json()["invalidated"], 1);
    expect(found, 200, "miss").await;
    assert_eq!(stub.hits(), 6, "both routes asked the upstream again");
    expect(found, 200, "hit").await;
    // The absent key's negative entries were not touched.
    expect(absent, 404, "negative-hit").await;
    assert_eq!(stub.hits(), 6);

    // Negative entries, with one key per line.
    let r = proxy
        .admin_post(
            "/admin/cache/invalidate",
            Some(TOKEN),
            &format!("{absent}\n"),
        )
        .await;
    assert_eq!(r.json()["invalidated"], 1);
    expect(absent, 404, "miss").await;
    assert_eq!(stub.hits(), 8);
    expect(absent, 404, "negative-hit").await;

    // A key that the filter's rule refuses names nothing.
    let r = proxy
        .admin_post("/admin/cache/invalidate", Some(TOKEN), "[\"abc\"]")
        .await;
    assert_eq!(r.json()["invalidated"], 0);
    expect(found, 200, "hit").await;
    assert_eq!(stub.hits(), 8);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_refusals_have_their_documented_status_and_code() {
    let Some(server) = mysql_url() else { return };
    let db = TestDb::create(&server, 100).await;
    let config = TestConfig::new(&db.url)
        .expected_items(100)
        .route(TestRoute::sql("products", "/api/products/{id}"));
    let proxy = TestProxy::spawn_ready(&config.clone().admin_token(TOKEN).toml()).await;
    let bearer = format!("Bearer {TOKEN}");
    let mutating = [
        "/admin/filters/products/rebuild",
        "/admin/filters/products/keys",
        "/admin/cache/invalidate",
    ];

    // 401: no Authorization, a wrong token, another scheme.
    for path in mutating {
        for auth in [
            None,
            Some("Bearer wrong-token"),
            Some("Basic dGVzdC1hZG1pbi10b2tlbg=="),
        ] {
            let r = admin(&proxy, Method::POST, path, auth, Bytes::from("[1]")).await;
            let what = format!("POST {path} with {auth:?}");
            assert_error(&r, 401, "unauthorized", &what);
            assert_eq!(
                r.headers
                    .get("www-authenticate")
                    .and_then(|v| v.to_str().ok()),
                Some("Bearer"),
                "{what}"
            );
        }
    }

    // 404: an unknown path, and an unknown filter name.
    for (method, path) in [
        (Method::GET, "/nope"),
        (Method::GET, "/admin"),
        (Method::GET, "/admin/nope"),
        (Method::POST, "/admin/nope"),
        (Method::GET, "/admin/filters/products"),
        (Method::GET, "/metrics/extra"),
    ] {
        let r = admin(&proxy, method.clone(), path, Some(&bearer), Bytes::new()).await;
        assert_error(&r, 404, "not_found", &format!("{method} {path}"));
    }
    let r = admin(
        &proxy,
        Method::POST,
        "/admin/filters/products/frobnicate",
        Some(&bearer),
        Bytes::new(),
    )
    .await;
    assert_error(&r, 404, "not_found", "an unknown action");
    for path in ["/admin/filters/nope/rebuild", "/admin/filters/nope/keys"] {
        let r = admin(
            &proxy,
            Method::POST,
            path,
            Some(&bearer),
            Bytes::from("[1]"),
        )
        .await;
        assert_error(&r, 404, "no_such_filter", path);
    }

    // 405: a known path with another method.
    for (method, path) in [
        (Method::POST, "/metrics"),
        (Method::DELETE, "/healthz"),
        (Method::PUT, "/readyz"),
        (Method::POST, "/admin/filters"),
        (Method::GET, "/admin/filters/products/rebuild"),
        (Method::PUT, "/admin/filters/products/keys"),
        (Method::GET, "/admin/cache/invalidate"),
        (Method::DELETE, "/admin/cache/invalidate"),
    ] {
        let r = admin(&proxy, method.clone(), path, Some(&bearer), Bytes::new()).await;
        assert_error(&r, 405, "method_not_allowed", &format!("{method} {path}"));
    }

    // 413: a key list over 64 MiB.
    for path in ["/admin/filters/products/keys", "/admin/cache/invalidate"] {
        let body = Bytes::from(vec![b'7'; MAX_ADMIN_BODY + 1]);
        let r = admin(&proxy, Method::POST, path, Some(&bearer), body).await;
        assert_error(&r, 413, "body_too_large", path);
    }
    // Nothing refused was applied: the filter was built once and holds no extra keys.
    let status = proxy.filter_status("products").await;
    assert_eq!(status["unconfirmed_keys"], 0, "{status}");
    assert_eq!(
        proxy
            .scrape()
            .await
            .value("bloomgate_filter_loads_total{filter=\"products\",result=\"ok\"}"),
        1.0
    );
    drop(proxy);

    // 403: no token configured, whatever is presented.
    let proxy = TestProxy::spawn_ready(&config.toml()).await;
    for path in mutating {
        for auth in [None, Some(bearer.as_str())] {
            let r = admin(&proxy, Method::POST, path, auth, Bytes::from("[1]")).await;
            assert_error(
                &r,
                403,
                "admin_disabled",
                &format!("POST {path} with {auth:?}"),
            );
        }
    }
    // The read-only endpoints need no token.
    for path in ["/metrics", "/healthz", "/readyz", "/admin/filters"] {
        let r = admin(&proxy, Method::GET, path, None, Bytes::new()).await;
        assert_eq!(r.status.as_u16(), 200, "{path}");
    }
}
