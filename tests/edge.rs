//! The data plane's edge, over real sockets: request heads and targets over their limits
//! are refused cleanly before any work, clients that half-close still get their answer,
//! a malformed request body is the client's fault (400, not 502), forwarded headers are
//! believed only from trusted proxies, and absolute-form targets decide the Host. Runs
//! against an embedded SQLite database and a real upstream written in the test.

mod support;

use std::net::SocketAddr;

use bloomgate::db::{Db, PoolSettings, demo_absent_sku, demo_sku};
use bytes::Bytes;
use http::{HeaderMap, Method};
use support::{
    Seen, StubUpstream, TestConfig, TestProxy, TestRoute, raw_status, send_raw,
    send_raw_half_closed,
};
use tempfile::TempDir;

const PRODUCTS: u64 = 100;

/// A proxy over a fresh SQLite database of demo products, in front of a stub upstream.
struct Edge {
    proxy: TestProxy,
    stub: StubUpstream,
    /// Holds the database; dropped (and removed) after the proxy has stopped.
    _dir: TempDir,
}

/// Routes: `/api/products/{id}` (SQL origin), `/echo/items/{id}` (upstream origin; the
/// stub records what it saw), `/slow/{ms}` (upstream origin, gate off). Everything else
/// passes through. `server` is added to the `[server]` section.
fn config(db_url: &str, upstream: &str, server: &str) -> String {
    TestConfig::new(db_url)
        .server("header_read_timeout = \"5s\"")
        .server("max_body_bytes = 65536")
        .server(server)
        .upstream(upstream)
        .upstream_field("timeout = \"5s\"")
        .route(
            TestRoute::sql("products", "/api/products/{id}")
                .lookup("SELECT sku_id, name FROM products WHERE sku_id = ?"),
        )
        .route(TestRoute::upstream("items", "/echo/items/{id}"))
        .route(TestRoute::upstream("slow", "/slow/{ms}").mode("off"))
        .toml()
}

impl Edge {
    async fn start(server: &str) -> Edge {
        Self::start_on(server, SocketAddr::from(([127, 0, 0, 1], 0))).await
    }

    async fn start_on(server: &str, listen: SocketAddr) -> Edge {
        let dir = TempDir::new().expect("temp dir");
        let url = format!("sqlite://{}", dir.path().join("edge.db").display());
        let db = Db::connect_lazy(&url, &PoolSettings::default()).expect("pool");
        db.migrate().await.expect("migrate");
        db.seed_demo_products(PRODUCTS).await.expect("seed");
        db.close().await;
        let stub = StubUpstream::start((0..PRODUCTS).map(demo_sku)).await;
        let toml = config(&url, &stub.url(), server);
        let proxy = TestProxy::spawn_on(&toml, listen).await;
        proxy.wait_ready(std::time::Duration::from_secs(60)).await;
        Edge {
            proxy,
            stub,
            _dir: dir,
        }
    }

    /// What the stub saw on `/echo…` since the last call (and forgets it).
    fn take_seen(&self) -> Option<Seen> {
        self.stub.state.seen.lock().expect("lock").take()
    }
}

/// A request whose head (request line, header lines, blank line) is exactly `size`
/// bytes, the padding spread over `lines` filler headers.
fn head_of_size(target: &str, size: usize, lines: usize, close: bool) -> Vec<u8> {
    let mut head = format!("GET {target} HTTP/1.1\r\nHost: edge.test\r\n");
    if close {
        head.push_str("Connection: close\r\n");
    }
    // Each filler line is `x-pad-NNN: <value>\r\n`: 13 bytes plus its value.
    let filler = size - head.len() - 2;
    let per_line = filler / lines;
    assert!(
        per_line > 13,
        "{size} bytes cannot hold {lines} filler lines"
    );
    for i in 0..lines {
        let extra = if i == 0 { filler % lines } else { 0 };
        let value = "v".repeat(per_line - 13 + extra);
        head.push_str(&format!("x-pad-{i:03}: {value}\r\n"));
    }
    head.push_str("\r\n");
    assert_eq!(head.len(), size);
    head.into_bytes()
}

/// The header lines of a raw answer, lower-cased.
fn raw_headers(answer: &str) -> String {
    answer
        .split("\r\n\r\n")
        .next()
        .unwrap_or("")
        .to_ascii_lowercase()
}

fn values(headers: &HeaderMap, name: &str) -> Vec<String> {
    headers
        .get_all(name)
        .iter()
        .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_heads_over_the_limit_are_refused_with_431_and_never_forwarded() {
    // Defaults: server.max_header_bytes = 16 KiB.
    let edge = Edge::start("").await;
    const LIMIT: usize = 16 * 1024;
    // Pass-through and a guarded route with an upstream origin (a fresh key each time,
    // so the answer at the limit is an origin fetch, not a cache hit), each with one
    // huge header or many small ones (fewer than hyper's cap of 100 header lines).
    let cases = [
        ("/echo/pass".to_owned(), 1),
        ("/echo/pass".to_owned(), 90),
        (format!("/echo/items/{}", demo_sku(0)), 1),
        (format!("/echo/items/{}", demo_sku(1)), 90),
    ];
    for (target, lines) in &cases {
        let case = format!("{target} with {lines} filler header(s)");
        let answer = send_raw(edge.proxy.data, &head_of_size(target, LIMIT, *lines, true)).await;
        assert_eq!(raw_status(&answer), 200, "{case} at the limit: {answer}");
        assert!(
            edge.take_seen().is_some(),
            "{case} at the limit was not forwarded"
        );

        for size in [LIMIT + 1, 17 * 1024, 64 * 1024] {
            // Without `Connection: close`: the server must close by itself.
            let answer =
                send_raw(edge.proxy.data, &head_of_size(target, size, *lines, false)).await;
            assert!(
                answer.starts_with("HTTP/1.1 431 Request Header Fields Too Large\r\n"),
                "{case}, {size} bytes: {answer}"
            );
            assert!(
                raw_headers(&answer).contains("connection: close"),
                "{answer}"
            );
            assert!(
                edge.take_seen().is_none(),
                "{case}, {size} bytes was forwarded"
            );
        }
    }
    // The guarded SQL route is refused the same way.
    let target = format!("/api/products/{}", demo_sku(2));
    let answer = send_raw(edge.proxy.data, &head_of_size(&target, LIMIT, 1, true)).await;
    assert_eq!(raw_status(&answer), 200, "{answer}");
    let answer = send_raw(edge.proxy.data, &head_of_size(&target, LIMIT + 1, 1, false)).await;
    assert_eq!(raw_status(&answer), 431, "{answer}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_smaller_head_limit_is_honoured_to_the_byte() {
    let edge = Edge::start("max_header_bytes = 9000\nmax_uri_bytes = 4000").await;
    for (size, status) in [(9000, 200), (9001, 431)] {
        let answer = send_raw(edge.proxy.data, &head_of_size("/echo/small", size, 3, true)).await;
        assert_eq!(raw_status(&answer), status, "{size} bytes: {answer}");
    }
}

/// A raw GET for `target`, optionally asking the server to close afterwards.
fn get(target: &str, close: bool) -> Vec<u8> {
    let connection = if close { "Connection: close\r\n" } else { "" };
    format!("GET {target} HTTP/1.1\r\nHost: edge.test\r\n{connection}\r\n").into_bytes()
}

/// `prefix` padded with `fill` to exactly `len` bytes.
fn padded(prefix: &str, fill: char, len: usize) -> String {
    let mut s = prefix.to_owned();
    s.extend(std::iter::repeat_n(fill, len - prefix.len()));
    s
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_targets_over_the_limit_are_refused_with_414_before_routing() {
    // Defaults: server.max_uri_bytes = 8 KiB, server.max_header_bytes = 16 KiB.
    let edge = Edge::start("").await;
    const LIMIT: usize = 8 * 1024;
    let present = demo_sku(3);
    let shapes = [
        ("long path, pass-through", "/echo/".to_owned(), 'p'),
        ("long query, pass-through", "/echo/q?pad=".to_owned(), 'q'),
        (
            "long query, guarded",
            format!("/echo/items/{present}?pad="),
            'q',
        ),
        ("long path, guarded", "/api/products/".to_owned(), '1'),
    ];
    for (case, prefix, fill) in &shapes {
        let answer = send_raw(edge.proxy.data, &get(&padded(prefix, *fill, LIMIT), true)).await;
        assert_ne!(raw_status(&answer), 414, "{case} at the limit: {answer}");
        assert_ne!(raw_status(&answer), 0, "{case} at the limit: no answer");
        let _ = edge.take_seen();

        let answer = send_raw(
            edge.proxy.data,
            &get(&padded(prefix, *fill, LIMIT + 1), false),
        )
        .await;
        assert!(
            answer.starts_with("HTTP/1.1 414 URI Too Long\r\n"),
            "{case}: {answer}"
        );
        assert!(
            answer.contains(r#""error":"uri_too_long""#),
            "{case}: {answer}"
        );
        assert!(
            raw_headers(&answer).contains("connection: close"),
            "{answer}"
        );
        assert!(edge.take_seen().is_none(), "{case} was forwarded upstream");
    }
    // A pass-through target at the limit reaches the upstream intact.
    let target = padded("/echo/", 'p', LIMIT);
    let answer = send_raw(edge.proxy.data, &get(&target, true)).await;
    assert_eq!(raw_status(&answer), 200, "{answer}");
    let seen = edge.take_seen().expect("forwarded");
    assert_eq!(seen.path_and_query, target);

    // A target so long that the head is over its own limit: hyper answers 431 before
    // the target can be looked at, and closes.
    let answer = send_raw(edge.proxy.data, &get(&padded("/echo/", 'p', 20_000), false)).await;
    assert!(
        answer.starts_with("HTTP/1.1 431 Request Header Fields Too Large\r\n"),
        "{answer}"
    );
    assert!(edge.take_seen().is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_a_large_head_limit_both_414s_are_clean() {
    let edge = Edge::start("max_header_bytes = 131072\nmax_uri_bytes = 32768").await;
    let answer = send_raw(edge.proxy.data, &get(&padded("/echo/", 'p', 32_768), true)).await;
    assert_eq!(raw_status(&answer), 200, "{answer}");
    assert!(edge.take_seen().is_some());
    // Ours, with a body saying why.
    let answer = send_raw(edge.proxy.data, &get(&padded("/echo/", 'p', 32_769), false)).await;
    assert!(answer.starts_with("HTTP/1.1 414 "), "{answer}");
    assert!(answer.contains("uri_too_long"), "{answer}");
    // hyper's own, past the 65534 bytes it accepts at all: no body, connection closed.
    let answer = send_raw(edge.proxy.data, &get(&padded("/echo/", 'p', 70_000), false)).await;
    assert!(
        answer.starts_with("HTTP/1.1 414 URI Too Long\r\n"),
        "{answer}"
    );
    assert!(
        raw_headers(&answer).contains("connection: close"),
        "{answer}"
    );
    assert!(edge.take_seen().is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_half_closes_still_gets_its_answer() {
    let edge = Edge::start("").await;
    // Pass-through to an upstream that takes 300 ms.
    let answer = send_raw_half_closed(
        edge.proxy.data,
        b"POST /slow/300 HTTP/1.1\r\nHost: edge.test\r\nContent-Length: 0\r\n\r\n",
    )
    .await;
    assert_eq!(raw_status(&answer), 200, "pass-through: {answer}");
    assert!(
        raw_headers(&answer).contains("x-bloomgate: bypass"),
        "{answer}"
    );
    assert!(answer.ends_with(r#"{"slept_ms":300}"#), "{answer}");

    // A guarded request whose answer needs an upstream origin fetch.
    let answer = send_raw_half_closed(
        edge.proxy.data,
        b"GET /slow/301 HTTP/1.1\r\nHost: edge.test\r\n\r\n",
    )
    .await;
    assert_eq!(raw_status(&answer), 200, "origin fetch: {answer}");
    assert!(
        raw_headers(&answer).contains("x-bloomgate: miss"),
        "{answer}"
    );
    assert!(answer.ends_with(r#"{"slept_ms":301}"#), "{answer}");

    // A request with a body, then the FIN.
    let answer = send_raw_half_closed(
        edge.proxy.data,
        b"PUT /echo/half HTTP/1.1\r\nHost: edge.test\r\nContent-Length: 5\r\n\r\nhello",
    )
    .await;
    assert_eq!(raw_status(&answer), 200, "{answer}");
    assert!(answer.contains("hello"), "{answer}");
}

/// A chunked POST to `/echo/chunks` with `body` as the raw chunked body.
fn chunked(body: &[u8]) -> Vec<u8> {
    let mut req =
        b"POST /echo/chunks HTTP/1.1\r\nHost: edge.test\r\nTransfer-Encoding: chunked\r\n\r\n"
            .to_vec();
    req.extend_from_slice(body);
    req
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_request_bodies_are_the_clients_fault() {
    let edge = Edge::start("").await;
    let malformed: [(&str, &[u8]); 4] = [
        ("a chunk size that is not hex", b"zz\r\nhello\r\n0\r\n\r\n"),
        (
            "chunk data longer than its size",
            b"5\r\nhelloXX\r\n0\r\n\r\n",
        ),
        (
            "a chunk size that overflows",
            b"fffffffffffffffffffff\r\nx\r\n0\r\n\r\n",
        ),
        ("a valid chunk, then garbage", b"5\r\nhello\r\n-1\r\n\r\n"),
    ];
    for (case, body) in malformed {
        let answer = send_raw(edge.proxy.data, &chunked(body)).await;
        assert_eq!(raw_status(&answer), 400, "{case}: {answer}");
        assert!(
            answer.contains(r#""error":"bad_request_body""#),
            "{case}: {answer}"
        );
        assert!(
            raw_headers(&answer).contains("x-bloomgate: bypass"),
            "{answer}"
        );
    }
    // Bodies cut short by the client's FIN (chunked, and with a Content-Length).
    let answer = send_raw_half_closed(edge.proxy.data, &chunked(b"5\r\nhel")).await;
    assert_eq!(raw_status(&answer), 400, "cut-short chunk: {answer}");
    let answer = send_raw_half_closed(
        edge.proxy.data,
        b"POST /echo/cut HTTP/1.1\r\nHost: edge.test\r\nContent-Length: 10\r\n\r\nhello",
    )
    .await;
    assert_eq!(raw_status(&answer), 400, "cut-short body: {answer}");

    // A well-formed chunked body is forwarded.
    let answer = send_raw(
        edge.proxy.data,
        &chunked(b"5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n"),
    )
    .await;
    assert_eq!(raw_status(&answer), 200, "{answer}");
    assert!(answer.contains("hello world"), "{answer}");
    // One over max_body_bytes is still 413, declared or not.
    let mut big = Vec::new();
    for _ in 0..70 {
        big.extend_from_slice(b"400\r\n");
        big.extend_from_slice(&[b'x'; 0x400]);
        big.extend_from_slice(b"\r\n");
    }
    big.extend_from_slice(b"0\r\n\r\n");
    let answer = send_raw(edge.proxy.data, &chunked(&big)).await;
    assert_eq!(raw_status(&answer), 413, "{answer}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_that_is_down_is_still_a_bad_gateway() {
    // A port nothing listens on any more.
    let closed = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind")
        .local_addr()
        .expect("addr");
    let dir = TempDir::new().expect("temp dir");
    let url = format!("sqlite://{}", dir.path().join("edge.db").display());
    let db = Db::connect_lazy(&url, &PoolSettings::default()).expect("pool");
    db.migrate().await.expect("migrate");
    db.close().await;
    let proxy = TestProxy::spawn(&config(&url, &format!("http://{closed}"), "")).await;
    let answer = send_raw(
        proxy.data,
        b"POST /echo/x HTTP/1.1\r\nHost: edge.test\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
    )
    .await;
    assert_eq!(raw_status(&answer), 502, "{answer}");
    let r = proxy.get("/echo/y").await;
    assert_eq!(r.status.as_u16(), 502, "{}", r.text());
    drop(proxy);
    drop(dir);
}

/// Forwarded claims a client (or a proxy in front) might send, spelled several ways.
const CLAIMS: [(&str, &str); 6] = [
    ("x-forwarded-for", "198.51.100.1"),
    ("x-forwarded-for", "198.51.100.2, not-an-address"),
    ("x-forwarded-for", "2001:db8::5"),
    ("x-forwarded-proto", "https"),
    ("x-forwarded-host", "evil.example"),
    (
        "forwarded",
        "for=198.51.100.1;proto=https;host=evil.example",
    ),
];

/// Sends `CLAIMS` on a pass-through request and on a guarded request that goes to the
/// upstream origin; returns what the upstream saw for each.
async fn claims_as_seen(edge: &Edge, key: u64) -> [Seen; 2] {
    let client = edge.proxy.client();
    let base = format!("http://{}", edge.proxy.data);
    let r = client
        .send(
            Method::POST,
            &format!("{base}/echo/fwd"),
            &CLAIMS,
            Bytes::new(),
        )
        .await;
    assert_eq!(r.status.as_u16(), 200, "{}", r.text());
    let passed = edge.take_seen().expect("pass-through reached the upstream");
    let r = client
        .send(
            Method::GET,
            &format!("{base}/echo/items/{key}"),
            &CLAIMS,
            Bytes::new(),
        )
        .await;
    assert_eq!(
        (r.status.as_u16(), r.stage()),
        (200, "miss"),
        "{}",
        r.text()
    );
    let fetched = edge.take_seen().expect("origin fetch reached the upstream");
    assert_eq!(fetched.method, "GET");
    [passed, fetched]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forwarded_headers_from_an_untrusted_peer_are_replaced() {
    let edge = Edge::start(r#"trusted_proxies = ["10.0.0.0/8"]"#).await;
    let [passed, fetched] = claims_as_seen(&edge, demo_sku(10)).await;
    let h = &passed.headers;
    assert_eq!(values(h, "x-forwarded-for"), ["127.0.0.1"]);
    assert_eq!(values(h, "x-forwarded-proto"), ["http"]);
    assert!(h.get("x-forwarded-host").is_none(), "{h:?}");
    assert!(h.get("forwarded").is_none(), "{h:?}");
    assert_no_client_in_origin_fetch(&fetched);
    // No trusted proxies configured at all: the same.
    let edge = Edge::start("").await;
    let [passed, fetched] = claims_as_seen(&edge, demo_sku(11)).await;
    assert_eq!(values(&passed.headers, "x-forwarded-for"), ["127.0.0.1"]);
    assert!(passed.headers.get("forwarded").is_none());
    assert_no_client_in_origin_fetch(&fetched);
}

/// An origin fetch is the canonical request for a key, shared by every client through
/// the cache: no client's forwarded headers, trusted or not, are in it.
fn assert_no_client_in_origin_fetch(seen: &Seen) {
    for name in [
        "x-forwarded-for",
        "x-forwarded-proto",
        "x-forwarded-host",
        "forwarded",
    ] {
        assert!(
            seen.headers.get(name).is_none(),
            "{name}: {:?}",
            seen.headers
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forwarded_headers_from_a_trusted_peer_are_kept_and_extended() {
    let edge = Edge::start(r#"trusted_proxies = ["127.0.0.1/32"]"#).await;
    let [passed, fetched] = claims_as_seen(&edge, demo_sku(12)).await;
    let h = &passed.headers;
    assert_eq!(
        values(h, "x-forwarded-for"),
        ["198.51.100.1, 198.51.100.2, not-an-address, 2001:db8::5, 127.0.0.1"]
    );
    assert_eq!(values(h, "x-forwarded-proto"), ["https"]);
    assert_eq!(values(h, "x-forwarded-host"), ["evil.example"]);
    assert_eq!(
        values(h, "forwarded"),
        ["for=198.51.100.1;proto=https;host=evil.example"]
    );
    assert_no_client_in_origin_fetch(&fetched);
    // A trusted peer that sends no claims: itself, over plain HTTP.
    let r = edge.proxy.get("/echo/plain").await;
    assert_eq!(r.status.as_u16(), 200);
    let seen = edge.take_seen().expect("forwarded");
    assert_eq!(values(&seen.headers, "x-forwarded-for"), ["127.0.0.1"]);
    assert_eq!(values(&seen.headers, "x-forwarded-proto"), ["http"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ipv6_and_ipv4_mapped_peers() {
    // A dual-stack listener: IPv4 clients arrive as ::ffff:127.0.0.1.
    let any = SocketAddr::from(([0u16; 8], 0));
    for (trusted, via_v4, via_v6) in [
        (r#"["10.0.0.0/8"]"#, "127.0.0.1", "::1"),
        (r#"["127.0.0.1/32"]"#, "198.51.100.1, 127.0.0.1", "::1"),
        (r#"["::1/128"]"#, "127.0.0.1", "198.51.100.1, ::1"),
    ] {
        let edge = Edge::start_on(&format!("trusted_proxies = {trusted}"), any).await;
        let port = edge.proxy.data.port();
        for (host, expected) in [("127.0.0.1", via_v4), ("[::1]", via_v6)] {
            let r = edge
                .proxy
                .client()
                .send(
                    Method::POST,
                    &format!("http://{host}:{port}/echo/v6"),
                    &[("x-forwarded-for", "198.51.100.1")],
                    Bytes::new(),
                )
                .await;
            assert_eq!(r.status.as_u16(), 200);
            let seen = edge.take_seen().expect("forwarded");
            assert_eq!(
                values(&seen.headers, "x-forwarded-for"),
                [expected],
                "trusted {trusted}, client {host}"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_absolute_form_target_decides_the_host_and_the_route() {
    let edge = Edge::start("").await;
    for (target, host, path) in [
        (
            "http://other.example/echo/abs",
            "other.example",
            "/echo/abs",
        ),
        (
            "http://other.example:8443/echo/abs?x=1",
            "other.example:8443",
            "/echo/abs?x=1",
        ),
    ] {
        let req =
            format!("GET {target} HTTP/1.1\r\nHost: good.example\r\nConnection: close\r\n\r\n");
        let answer = send_raw(edge.proxy.data, req.as_bytes()).await;
        assert_eq!(raw_status(&answer), 200, "{answer}");
        let seen = edge.take_seen().expect("forwarded");
        assert_eq!(values(&seen.headers, "host"), [host], "{target}");
        assert_eq!(seen.path_and_query, path);
    }
    // Guarded routes match the target's path, whatever its authority.
    for (key, status) in [(demo_sku(20), 200), (demo_absent_sku(20), 404)] {
        let req = format!(
            "GET http://other.example/api/products/{key} HTTP/1.1\r\nHost: good.example\r\nConnection: close\r\n\r\n"
        );
        let answer = send_raw(edge.proxy.data, req.as_bytes()).await;
        assert_eq!(raw_status(&answer), status, "{answer}");
        let headers = raw_headers(&answer);
        assert!(
            headers.contains("x-bloomgate:") && !headers.contains("x-bloomgate: bypass"),
            "{answer}"
        );
    }
}
