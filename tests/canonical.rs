//! The edge, tried as an attacker would: one canonical origin request per key (a
//! repeated or re-spelled key parameter can neither poison the cache nor reach the
//! upstream behind the gate's back), every spelling of a guarded path gated or refused,
//! HTTP caching rules for upstream answers, the outcome-header policy and the per-client
//! false-positive budget. Real bloomgate, real MariaDB for the filter's keys, and a real
//! upstream written in the test that reads the *last* of repeated parameters, as many
//! frameworks do.

mod support;

use std::collections::HashSet;
use std::net::SocketAddr;
use std::time::Duration;

use bloomgate::db::{demo_absent_sku, demo_sku};
use bloomgate::key::KeyError;
use proptest::prelude::*;
use proptest::strategy::ValueTree;
use proptest::test_runner::TestRunner;
use support::{StubUpstream, TestConfig, TestDb, TestProxy, TestRoute, mysql_url};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Products in the database (and so in the filter).
const PRODUCTS: u64 = 2_000;
/// Of those, the upstream has the first `SERVED`: `demo_sku(SERVED..PRODUCTS)` pass the
/// gate and are then not found, a false positive on demand.
const SERVED: u64 = 1_000;

fn config(db_url: &str, upstream: &str, extra_server: &str, extra: &str) -> String {
    TestConfig::new(db_url)
        .server("header_read_timeout = \"2s\"")
        .server(extra_server)
        .upstream(upstream)
        .upstream_field("timeout = \"2s\"")
        .expected_items(PRODUCTS)
        .filter("load_retry_initial = \"100ms\"")
        .filter("load_retry_max = \"500ms\"")
        .route(
            TestRoute::upstream("info", "/api/product/info")
                .query_key("sku_id")
                .field("forward_query = [\"lang\"]")
                .field("forward_headers = [\"accept-language\"]")
                .field("upstream_headers = { \"x-api-key\" = \"k-123\" }"),
        )
        .route(TestRoute::upstream("products", "/api/products/{id}").field(extra))
        .toml()
}

/// Fields drop in order: the proxy stops before its database is dropped.
struct Rig {
    proxy: TestProxy,
    stub: StubUpstream,
    _db: TestDb,
}

async fn rig(extra_server: &str, extra: &str) -> Option<Rig> {
    let server = mysql_url()?;
    let db = TestDb::create(&server, PRODUCTS).await;
    let stub = StubUpstream::start((0..SERVED).map(demo_sku)).await;
    let proxy = TestProxy::spawn_ready(&config(&db.url, &stub.url(), extra_server, extra)).await;
    Some(Rig {
        proxy,
        stub,
        _db: db,
    })
}

/// Absent keys the gate refuses (checked through the proxy itself, canonically).
async fn intercepted_keys(rig: &Rig, n: usize) -> Vec<u64> {
    let mut keys = Vec::new();
    for i in 0..PRODUCTS {
        let k = demo_absent_sku(i);
        if rig.proxy.get(&format!("/api/products/{k}")).await.stage() == "intercepted" {
            keys.push(k);
            if keys.len() == n {
                break;
            }
        }
    }
    assert_eq!(keys.len(), n, "not enough intercepted keys");
    keys
}

/// One request written by hand, for targets an HTTP client library would refuse or
/// rewrite. Returns the status and the whole response text.
async fn raw_get(addr: SocketAddr, target: &str) -> (u16, String) {
    let mut s = TcpStream::connect(addr).await.expect("connect");
    let req = format!("GET {target} HTTP/1.1\r\nHost: shop\r\nConnection: close\r\n\r\n");
    s.write_all(req.as_bytes()).await.expect("write");
    let mut out = Vec::new();
    tokio::time::timeout(Duration::from_secs(30), s.read_to_end(&mut out))
        .await
        .expect("the proxy answers and closes within 30 s")
        .expect("read");
    let text = String::from_utf8_lossy(&out).into_owned();
    let status = text
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    (status, text)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_repeated_key_parameter_cannot_poison_the_cache() {
    let Some(rig) = rig("", "").await else { return };
    let (a, b) = (demo_sku(1), demo_sku(2));
    let fp = demo_sku(SERVED + 1);
    // Every way of naming the key parameter twice is refused before any lookup.
    for q in [
        format!("sku_id={a}&sku_id={b}"),
        format!("sku_id={a}&sku_id={a}"),
        format!("sku_id={a}&SKU_ID={b}"),
        format!("sku_id={a}&sku%5Fid={b}"),
        format!("sku_id={a}&Sku_Id={fp}"),
        format!("SKU_ID={b}"),
    ] {
        let r = rig.proxy.get(&format!("/api/product/info?{q}")).await;
        assert_eq!(r.status.as_u16(), 400, "{q}: {}", r.text());
        assert_eq!(r.json()["error"], "ambiguous_key", "{q}");
    }
    assert_eq!(
        rig.stub.hits(),
        0,
        "an ambiguous request reached the upstream"
    );

    // The key, spelled any way the normaliser accepts, is what the upstream is asked
    // about, alone and canonical; undeclared parameters are dropped.
    let r = rig
        .proxy
        .get(&format!("/api/product/info?utm=x&sku_id=%2B00{a}&b={b}"))
        .await;
    assert_eq!(
        (r.status.as_u16(), r.stage()),
        (200, "miss"),
        "{}",
        r.text()
    );
    assert_eq!(r.json()["sku_id"], a);
    assert_eq!(
        rig.stub.requests(),
        vec![format!("/api/product/info?sku_id={a}")]
    );
    // The configured header is sent; the client's own headers are not.
    let r = rig
        .proxy
        .get_with(
            &format!("/api/product/info?sku_id={b}"),
            &[("x-tenant", "evil"), ("cookie", "s=1")],
        )
        .await;
    assert_eq!(r.status.as_u16(), 200);
    let seen = rig.stub.last_request_headers();
    assert_eq!(seen["x-api-key"], "k-123");
    assert!(seen.get("x-tenant").is_none() && seen.get("cookie").is_none());
    // The same key by another spelling is the same entry.
    let r = rig
        .proxy
        .get(&format!("/api/product/info?sku_id=0{a}&x=1"))
        .await;
    assert_eq!((r.status.as_u16(), r.stage()), (200, "hit"));
    assert_eq!(r.json()["sku_id"], a);
    assert_eq!(rig.stub.hits(), 2);

    // A path key gets the canonical path, whatever the client wrote around it.
    let r = rig
        .proxy
        .get(&format!("/api/products/00{b}?sku_id={a}&debug=1"))
        .await;
    assert_eq!(r.status.as_u16(), 200);
    assert_eq!(r.json()["sku_id"], b);
    assert_eq!(
        rig.stub.requests().last().map(String::as_str),
        Some(format!("/api/products/{b}").as_str())
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn undeclared_parameters_can_be_refused() {
    let extra = "undeclared_query = \"reject\"";
    let Some(rig) = rig("", extra).await else {
        return;
    };
    let k = demo_sku(3);
    let r = rig.proxy.get(&format!("/api/products/{k}?utm=1")).await;
    assert_eq!(r.status.as_u16(), 400);
    assert_eq!(r.json()["error"], "undeclared_parameter");
    let r = rig.proxy.get(&format!("/api/products/{k}")).await;
    assert_eq!(r.status.as_u16(), 200);
    assert_eq!(rig.stub.hits(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_spelling_of_a_guarded_path_is_gated_or_refused() {
    let Some(rig) = rig("", "").await else { return };
    let keys = intercepted_keys(&rig, 3).await;
    let k = keys[0];
    let hits = rig.stub.hits();
    let digits = k.to_string();
    let escaped: String = digits.bytes().map(|b| format!("%{b:02X}")).collect();
    // Spellings an upstream reads as /api/products/{k}: each is judged by the gate.
    for target in [
        format!("//api/products/{k}"),
        format!("/api//products///{k}"),
        format!("/api/./products/{k}"),
        format!("/api/x/../products/{k}"),
        format!("/../api/products/{k}"),
        format!("/API/Products/{k}"),
        format!("/api/products/{k}/"),
        format!("/api/products/{k}/."),
        format!("/%61pi/products/{k}"),
        format!("/api/products/{escaped}"),
        format!("/api/products/%2e/{k}"),
        format!("/api/products/0{k}"),
        format!("http://shop/api/products/{k}"),
    ] {
        let (status, text) = raw_get(rig.proxy.data, &target).await;
        assert_eq!(status, 404, "{target}: {text}");
        assert!(
            text.contains("x-bloomgate: intercepted"),
            "{target}: {text}"
        );
    }
    // Spellings that cannot be gated safely: refused, never passed through.
    for target in [
        format!("/api%2Fproducts/{k}"),
        format!("/api%2fproducts/{k}"),
        format!("/api%5Cproducts/{k}"),
        format!("/api;v=1/products/{k}"),
        format!("/api/products/{k};jsessionid=1"),
        format!("/api/products/{k}.json"),
        format!("/api/products/{k}%2F"),
        format!("/api/products/{k}%00"),
        format!("/api/products/%zz{k}"),
        format!("/api/products/%2e%2e%2fproducts%2f{k}"),
    ] {
        let (status, text) = raw_get(rig.proxy.data, &target).await;
        assert_eq!(status, 400, "{target}: {text}");
        assert!(text.contains("x-bloomgate: error"), "{target}: {text}");
    }
    assert_eq!(rig.stub.hits(), hits, "a spelling reached the upstream");
    // Paths outside every guarded pattern still pass through as sent.
    let (status, text) = raw_get(rig.proxy.data, &format!("/api/products/{k}/reviews")).await;
    assert_eq!(status, 404, "{text}");
    assert!(text.contains("x-bloomgate: bypass"), "{text}");
    let (_, text) = raw_get(rig.proxy.data, "/static/a%2Fb;c").await;
    assert!(text.contains("x-bloomgate: bypass"), "{text}");
}

/// The head and the body of a raw answer (the proxy's error bodies are sent whole).
fn head_and_body(text: &str) -> (&str, &str) {
    text.split_once("\r\n\r\n").unwrap_or((text, ""))
}

/// Checks that the raw answer `text` to `target` is a refusal as docs/responses.md
/// documents it: 400, `x-bloomgate: error`, a JSON body `{"error": code, "message": …}`
/// with one of `codes` and a message.
fn assert_refused(target: &str, text: &str, codes: &[&str]) {
    let (head, body) = head_and_body(text);
    assert!(head.starts_with("HTTP/1.1 400 "), "{target}: {text}");
    let head = head.to_ascii_lowercase();
    assert!(head.contains("\r\nx-bloomgate: error"), "{target}: {text}");
    assert!(
        head.contains("\r\ncontent-type: application/json"),
        "{target}: {text}"
    );
    let json: serde_json::Value = serde_json::from_str(body)
        .unwrap_or_else(|e| panic!("{target}: the body is not JSON ({e}): {text}"));
    let code = json["error"].as_str().unwrap_or_default();
    assert!(codes.contains(&code), "{target}: code {code:?}: {text}");
    let message = json["message"].as_str().unwrap_or_default();
    assert!(!message.trim().is_empty(), "{target}: {text}");
    assert_eq!(
        json.as_object().map(|o| o.len()),
        Some(2),
        "{target}: {text}"
    );
}

/// `n` random values of `strategy` (each case is an HTTP request to the real proxy, so
/// they are drawn up front and sent one by one; a failing assertion prints the request).
fn cases<S: Strategy>(strategy: &S, n: usize) -> Vec<S::Value> {
    let mut runner = TestRunner::default();
    (0..n)
        .map(|_| strategy.new_tree(&mut runner).expect("a case").current())
        .collect()
}

/// One way of writing a path segment: escapes of unreserved characters, case flips.
fn respell(segment: &str, escape: &[bool], upper: &[bool]) -> String {
    segment
        .bytes()
        .enumerate()
        .map(|(i, b)| {
            if escape.get(i).copied().unwrap_or(false) {
                format!("%{b:02X}")
            } else if upper.get(i).copied().unwrap_or(false) {
                char::from(b.to_ascii_uppercase()).to_string()
            } else {
                char::from(b).to_string()
            }
        })
        .collect()
}

/// Random spellings of guarded paths (escapes, case, doubled slashes, dot segments, a
/// trailing slash) never reach the upstream for an intercepted key: every one is gated
/// (404 intercepted) or refused (400).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_spellings_of_an_intercepted_key_never_reach_the_upstream() {
    let Some(rig) = rig("", "").await else { return };
    let keys = intercepted_keys(&rig, 4).await;
    let hits = rig.stub.hits();
    let strategy = (
        0..keys.len(),
        proptest::collection::vec(any::<bool>(), 12),
        proptest::collection::vec(any::<bool>(), 12),
        proptest::collection::vec(0u8..6, 3),
        any::<bool>(),
    );
    for (ki, escape, upper, seps, trailing) in cases(&strategy, 128) {
        let sep = |n: u8| match n {
            0 => "/",
            1 => "//",
            2 => "/./",
            3 => "/zz/../",
            4 => "/%2E/",
            _ => "/",
        };
        let mut target = format!(
            "{}{}{}{}{}{}",
            sep(seps[0]),
            respell("api", &escape[..3], &upper[..3]),
            sep(seps[1]),
            respell("products", &escape[3..], &upper[3..]),
            sep(seps[2]),
            respell(&keys[ki].to_string(), &escape, &[]),
        );
        if trailing {
            target.push('/');
        }
        let (status, text) = raw_get(rig.proxy.data, &target).await;
        if status == 400 {
            assert_refused(
                &target,
                &text,
                &["non_canonical_path", "key_not_canonical", "bad_path"],
            );
        } else {
            assert_eq!(status, 404, "{target}: {text}");
            assert!(
                text.contains("x-bloomgate: intercepted"),
                "{target}: {text}"
            );
        }
    }
    assert_eq!(rig.stub.hits(), hits);
}

/// Random query strings around present keys: whatever else the query holds, a request
/// is refused (400) or answered with the body of exactly the key it names, so no two
/// keys ever share an entry and the upstream is never asked about another key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_queries_never_mix_two_keys() {
    let Some(rig) = rig("", "").await else { return };
    let strategy = (
        0..40u64,
        0..40u64,
        0..4usize,
        proptest::collection::vec(("[a-zA-Z_]{1,8}", "[a-z0-9]{0,4}"), 0..4),
        0..3usize,
    );
    for (i, j, spelling, noise, second) in cases(&strategy, 200) {
        let (k, other) = (demo_sku(i), demo_sku(j));
        let key = match spelling {
            0 => k.to_string(),
            1 => format!("00{k}"),
            2 => format!("%2B{k}"),
            _ => format!("+{k}+"),
        };
        let mut pairs: Vec<String> = noise
            .iter()
            .filter(|(n, _)| !n.eq_ignore_ascii_case("sku_id") && !n.eq_ignore_ascii_case("lang"))
            .map(|(n, v)| format!("{n}={v}"))
            .collect();
        pairs.insert(pairs.len() / 2, format!("sku_id={key}"));
        let ambiguous = match second {
            1 => {
                pairs.push(format!("sku_id={other}"));
                true
            }
            2 => {
                pairs.insert(0, format!("SKU_id={other}"));
                true
            }
            _ => false,
        };
        let q = pairs.join("&");
        let r = rig.proxy.get(&format!("/api/product/info?{q}")).await;
        if ambiguous {
            // The documented refusal, naming the route's key parameter.
            let refusal = KeyError::Ambiguous("sku_id".into());
            assert_eq!(r.status.as_u16(), 400, "{q}");
            assert_eq!(r.stage(), "error", "{q}");
            assert_eq!(
                r.json(),
                serde_json::json!({"error": refusal.code(), "message": refusal.to_string()}),
                "{q}"
            );
        } else {
            assert_eq!(r.status.as_u16(), 200, "{q}: {}", r.text());
            assert_eq!(r.json()["sku_id"], k, "{q}: another key's answer");
        }
    }
    // Every request the upstream saw named one key, in canonical form, and nothing else.
    let keys: HashSet<String> = (0..40).map(|i| demo_sku(i).to_string()).collect();
    for pq in rig.stub.requests() {
        let k = pq
            .strip_prefix("/api/product/info?sku_id=")
            .unwrap_or_else(|| panic!("not canonical: {pq}"));
        assert!(keys.contains(k), "not canonical: {pq}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forwarded_parameters_vary_the_entry_but_not_absence() {
    let Some(rig) = rig("", "").await else { return };
    let k = demo_sku(5);
    let info = |q: &str| format!("/api/product/info?{q}");
    let r = rig.proxy.get(&info(&format!("lang=fr&sku_id={k}"))).await;
    assert_eq!((r.status.as_u16(), r.stage()), (200, "miss"));
    assert_eq!(r.json()["lang"], "fr");
    assert_eq!(
        rig.stub.requests().last().map(String::as_str),
        Some(format!("/api/product/info?sku_id={k}&lang=fr").as_str())
    );
    let r = rig.proxy.get(&info(&format!("sku_id={k}&lang=de"))).await;
    assert_eq!((r.stage(), r.json()["lang"].as_str()), ("miss", Some("de")));
    let r = rig.proxy.get(&info(&format!("sku_id={k}&lang=fr"))).await;
    assert_eq!((r.stage(), r.json()["lang"].as_str()), ("hit", Some("fr")));
    // A declared header is forwarded and part of the key.
    let r = rig
        .proxy
        .get_with(&info(&format!("sku_id={k}")), &[("accept-language", "it")])
        .await;
    assert_eq!(
        (r.stage(), r.json()["accept_language"].as_str()),
        ("miss", Some("it"))
    );
    let r = rig.proxy.get(&info(&format!("sku_id={k}"))).await;
    assert_eq!(
        (r.stage(), r.json()["accept_language"].as_str()),
        ("miss", Some(""))
    );
    // A repeated declared parameter is as ambiguous as a repeated key.
    let r = rig
        .proxy
        .get(&info(&format!("sku_id={k}&lang=fr&lang=de")))
        .await;
    assert_eq!(r.status.as_u16(), 400);

    // A false positive found absent once is absent for every variant.
    let fp = demo_sku(SERVED + 7);
    let before = rig.stub.hits();
    let r = rig.proxy.get(&info(&format!("sku_id={fp}&lang=fr"))).await;
    assert_eq!((r.status.as_u16(), r.stage()), (404, "miss"));
    for q in [
        format!("sku_id={fp}&lang=de"),
        format!("sku_id={fp}"),
        format!("sku_id={fp}&lang=x{}", 1),
    ] {
        let r = rig.proxy.get(&info(&q)).await;
        assert_eq!((r.status.as_u16(), r.stage()), (404, "negative-hit"), "{q}");
    }
    let r = rig
        .proxy
        .get_with(&info(&format!("sku_id={fp}")), &[("accept-language", "pt")])
        .await;
    assert_eq!(r.stage(), "negative-hit");
    assert_eq!(rig.stub.hits(), before + 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_caching_rules_are_honoured() {
    let Some(rig) = rig("", "").await else { return };
    let p = |k: u64| format!("/api/products/{k}");
    let twice = |k: u64| {
        let proxy = &rig.proxy;
        async move {
            let a = proxy.get(&p(k)).await;
            let b = proxy.get(&p(k)).await;
            assert_eq!((a.status.as_u16(), b.status.as_u16()), (200, 200));
            (a.stage().to_owned(), b.stage().to_owned(), b)
        }
    };
    // Answers a shared cache must not store are fetched every time, and passed on
    // with their Cache-Control.
    for (i, headers) in [
        vec![("cache-control", "no-store")],
        vec![("cache-control", "private, max-age=600")],
        vec![("cache-control", "no-cache")],
        vec![("cache-control", "max-age=0")],
        vec![("vary", "*")],
        vec![("vary", "Accept-Encoding")],
        vec![("cache-control", "public"), ("vary", "cookie")],
    ]
    .into_iter()
    .enumerate()
    {
        rig.stub.answer_with(&headers);
        let k = demo_sku(100 + i as u64);
        let (a, b, last) = twice(k).await;
        assert_eq!((a.as_str(), b.as_str()), ("miss", "miss"), "{headers:?}");
        if headers[0].0 == "cache-control" {
            assert_eq!(last.headers["cache-control"], headers[0].1);
        }
    }
    // Storable answers are stored; validators come back, freshness headers do not.
    rig.stub.answer_with(&[
        ("cache-control", "max-age=600"),
        ("etag", "\"v7\""),
        ("last-modified", "Wed, 02 Dec 2026 10:00:00 GMT"),
        ("content-language", "en"),
    ]);
    let k = demo_sku(120);
    let (a, b, last) = twice(k).await;
    assert_eq!((a.as_str(), b.as_str()), ("miss", "hit"));
    assert_eq!(last.headers["etag"], "\"v7\"");
    assert_eq!(last.headers["content-language"], "en");
    assert!(last.headers.get("cache-control").is_none());
    // Conditional requests are answered 304 from the entry.
    for cond in [
        ("if-none-match", "\"v7\""),
        ("if-none-match", "W/\"v7\", \"v8\""),
        ("if-modified-since", "Wed, 02 Dec 2026 10:00:00 GMT"),
    ] {
        let r = rig.proxy.get_with(&p(k), &[cond]).await;
        assert_eq!((r.status.as_u16(), r.stage()), (304, "hit"), "{cond:?}");
        assert!(r.body.is_empty());
        assert_eq!(r.headers["etag"], "\"v7\"");
    }
    let r = rig
        .proxy
        .get_with(&p(k), &[("if-none-match", "\"v6\"")])
        .await;
    assert_eq!((r.status.as_u16(), r.stage()), (200, "hit"));
    let hits = rig.stub.hits();

    // Credentials: not served from the shared entry, not coalesced, not stored…
    let r = rig
        .proxy
        .get_with(&p(k), &[("authorization", "Bearer a")])
        .await;
    assert_eq!((r.status.as_u16(), r.stage()), (200, "miss"));
    assert!(
        rig.stub
            .last_request_headers()
            .get("authorization")
            .is_none()
    );
    let r = rig
        .proxy
        .get_with(&p(k), &[("authorization", "Bearer a")])
        .await;
    assert_eq!(r.stage(), "miss");
    assert_eq!(rig.stub.hits(), hits + 2);
    // …still gated like any request…
    let absent = intercepted_keys(&rig, 1).await[0];
    let r = rig
        .proxy
        .get_with(&p(absent), &[("authorization", "Bearer a")])
        .await;
    assert_eq!((r.status.as_u16(), r.stage()), (404, "intercepted"));
    // …and shared only when the answer says so.
    rig.stub
        .answer_with(&[("cache-control", "public, max-age=600")]);
    let k2 = demo_sku(121);
    let r = rig
        .proxy
        .get_with(&p(k2), &[("authorization", "Bearer a")])
        .await;
    assert_eq!(r.stage(), "miss");
    let r = rig
        .proxy
        .get_with(&p(k2), &[("authorization", "Bearer b")])
        .await;
    assert_eq!(r.stage(), "hit");
    let r = rig.proxy.get(&p(k2)).await;
    assert_eq!(r.stage(), "hit");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_outcome_header_follows_the_policy() {
    let Some(server) = mysql_url() else { return };
    let db = TestDb::create(&server, PRODUCTS).await;
    let stub = StubUpstream::start((0..SERVED).map(demo_sku)).await;
    let k = demo_sku(9);
    for (policy, shown) in [
        ("outcome_header = \"never\"", false),
        (
            "outcome_header = \"trusted\"\noutcome_header_clients = [\"10.0.0.0/8\"]",
            false,
        ),
        (
            "outcome_header = \"trusted\"\noutcome_header_clients = [\"127.0.0.0/8\"]",
            true,
        ),
        // A header naming a trusted client does not help an untrusted peer.
        (
            "outcome_header = \"trusted\"\noutcome_header_clients = [\"10.0.0.0/8\"]\ntrusted_proxies = [\"192.0.2.0/24\"]",
            false,
        ),
    ] {
        let proxy = TestProxy::spawn_ready(&config(&db.url, &stub.url(), policy, "")).await;
        let spoof = [("x-forwarded-for", "10.1.1.1")];
        for target in [
            format!("/api/products/{k}"),
            format!("/api/products/{}", demo_sku(SERVED + 3)),
            "/api/products/x1".to_owned(),
            "/elsewhere".to_owned(),
        ] {
            let r = proxy.get_with(&target, &spoof).await;
            assert_eq!(
                r.headers.contains_key("x-bloomgate"),
                shown,
                "{policy}: {target}"
            );
        }
        // Metrics carry the outcome whatever clients see.
        let found = proxy
            .metric("bloomgate_requests_total{outcome=\"origin_found\",route=\"products\"}")
            .await
            + proxy
                .metric("bloomgate_requests_total{outcome=\"cache_hit\",route=\"products\"}")
                .await;
        assert_eq!(found, 1.0, "{policy}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_past_its_false_positive_budget_gets_429_and_nothing_else_changes() {
    let extra = "";
    let Some(server) = mysql_url() else { return };
    let db = TestDb::create(&server, PRODUCTS).await;
    let stub = StubUpstream::start((0..SERVED).map(demo_sku)).await;
    let toml = format!(
        "{}\n[false_positive_budget]\nper_client = 3\nwindow = \"1h\"\n",
        config(
            &db.url,
            &stub.url(),
            "trusted_proxies = [\"127.0.0.2/32\"]",
            extra
        )
    );
    let proxy = TestProxy::spawn_ready(&toml).await;
    let p = |k: u64| format!("/api/products/{k}");
    let present = demo_sku(11);
    assert_eq!(proxy.get(&p(present)).await.status.as_u16(), 200);
    let fps: Vec<u64> = (0..8).map(|i| demo_sku(SERVED + 20 + i)).collect();
    for fp in &fps[..3] {
        let r = proxy.get(&p(*fp)).await;
        assert_eq!((r.status.as_u16(), r.stage()), (404, "miss"));
    }
    let hits = stub.hits();
    // The fourth false positive, and any other origin-bound request, waits.
    for k in [fps[3], fps[4], demo_sku(12)] {
        let r = proxy.get(&p(k)).await;
        assert_eq!(r.status.as_u16(), 429, "{}", r.text());
        assert_eq!(r.stage(), "throttled");
        assert_eq!(r.json()["error"], "budget_exhausted");
        let retry: u64 = r.headers["retry-after"]
            .to_str()
            .ok()
            .and_then(|v| v.parse().ok())
            .expect("Retry-After in seconds");
        assert!((1..=3600).contains(&retry), "{retry}");
    }
    assert_eq!(
        stub.hits(),
        hits,
        "a throttled request reached the upstream"
    );
    // Cache hits, negative hits and intercepted keys are answered as usual.
    let r = proxy.get(&p(present)).await;
    assert_eq!((r.status.as_u16(), r.stage()), (200, "hit"));
    let r = proxy.get(&p(fps[0])).await;
    assert_eq!((r.status.as_u16(), r.stage()), (404, "negative-hit"));
    let mut intercepted = 0;
    for i in 0..50 {
        let r = proxy.get(&p(demo_absent_sku(i))).await;
        if r.stage() == "intercepted" {
            intercepted += 1;
        } else {
            assert_eq!(r.status.as_u16(), 429);
        }
    }
    assert!(intercepted >= 40, "{intercepted}");
    // Forging X-Forwarded-For from an untrusted peer does not buy a new budget.
    let r = proxy
        .get_with(&p(fps[5]), &[("x-forwarded-for", "198.51.100.1")])
        .await;
    assert_eq!(r.status.as_u16(), 429);
    let throttled = proxy
        .metric("bloomgate_requests_total{outcome=\"throttled\",route=\"products\"}")
        .await;
    assert!(throttled >= 4.0, "{throttled}");
    assert_eq!(
        proxy
            .metric("bloomgate_false_positive_budget_per_client")
            .await,
        3.0
    );

    // Behind a trusted proxy, each client it reports has its own budget. Connect from
    // 127.0.0.2 (the configured proxy) and name another client.
    let s = tokio::net::TcpSocket::new_v4().expect("socket");
    s.bind("127.0.0.2:0".parse().expect("addr"))
        .expect("bind 127.0.0.2");
    let mut stream = s.connect(proxy.data).await.expect("connect");
    let req = format!(
        "GET {} HTTP/1.1\r\nHost: shop\r\nX-Forwarded-For: 198.51.100.7\r\nConnection: close\r\n\r\n",
        p(fps[6])
    );
    stream.write_all(req.as_bytes()).await.expect("write");
    let mut out = Vec::new();
    stream.read_to_end(&mut out).await.expect("read");
    let text = String::from_utf8_lossy(&out);
    assert!(text.starts_with("HTTP/1.1 404"), "{text}");
    assert!(text.contains("x-bloomgate: miss"), "{text}");
}
