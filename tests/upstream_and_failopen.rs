//! The upstream origin, pass-through, fail-open at start-up and the header-read timeout,
//! with the filter loaded from a real MariaDB and a real upstream written in the test.

mod support;

use std::time::{Duration, Instant};

use bloomgate::db::{demo_absent_sku, demo_sku};
use bytes::Bytes;
use http::Method;
use support::{
    Relay, StubUpstream, TestConfig, TestDb, TestProxy, TestRoute, concurrently, host_port,
    mysql_url,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// The upstream timeout and the header-read timeout of the test that is about each:
/// short, so the test is quick.
const SHORT_TIMEOUT: &str = "500ms";
const SHORT_HEADER_TIMEOUT: &str = "1s";

/// Both timeouts in every other test: long enough that no upstream call, and no pause
/// of the client between two requests on a kept-alive connection, reaches them on a
/// loaded machine (the stub answers at once; the client's pool would send a request on
/// a connection the proxy is closing). How long calls take is measured by the load
/// benchmarks (docs/BENCHMARKS.md), not here.
const TIMEOUT: &str = "30s";

/// The config with this upstream timeout and header-read timeout.
fn config(db_url: &str, upstream: &str, expected: u64, timeouts: (&str, &str)) -> String {
    let (upstream_timeout, header_read_timeout) = timeouts;
    TestConfig::new(db_url)
        .server(format!("header_read_timeout = \"{header_read_timeout}\""))
        .server("max_body_bytes = 65536")
        .upstream(upstream)
        .upstream_field(format!("timeout = \"{upstream_timeout}\""))
        .expected_items(expected)
        .filter("load_retry_initial = \"100ms\"")
        .filter("load_retry_max = \"500ms\"")
        .route(TestRoute::upstream("info", "/api/product/info").query_key("sku_id"))
        .route(TestRoute::upstream("slow", "/slow/{ms}"))
        .toml()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_origin_caches_found_keys_and_keeps_absent_ones_away() {
    let Some(server) = mysql_url() else { return };
    const N: u64 = 5_000;
    let db = TestDb::create_heavy(&server, N).await;
    let stub = StubUpstream::start((0..N).map(demo_sku)).await;
    let proxy = TestProxy::spawn_ready(&config(&db.url, &stub.url(), N, (TIMEOUT, TIMEOUT))).await;

    let present = demo_sku(3);
    let r = proxy
        .get(&format!("/api/product/info?sku_id={present}"))
        .await;
    assert_eq!(
        (r.status.as_u16(), r.stage()),
        (200, "miss"),
        "{}",
        r.text()
    );
    assert_eq!(r.json()["source"], "upstream");
    assert_eq!(r.headers["content-type"], "application/json");
    let r = proxy
        .get(&format!("/api/product/info?sku_id={present}"))
        .await;
    assert_eq!((r.status.as_u16(), r.stage()), (200, "hit"));
    assert_eq!(stub.hits(), 1);

    // 100 concurrent misses for one key: one upstream request. (Coalesced or served
    // from the entry the first one stored, whichever the timing gives: either way, one.)
    let key = demo_sku(4);
    let client = proxy.client().clone();
    let url = format!("http://{}/api/product/info?sku_id={key}", proxy.data);
    let replies = concurrently((0..100).collect(), 100, move |_: u32| {
        let (client, url) = (client.clone(), url.clone());
        async move { client.send(Method::GET, &url, &[], Bytes::new()).await }
    })
    .await;
    assert!(replies.iter().all(|r| r.status.as_u16() == 200));
    assert_eq!(
        stub.hits(),
        2,
        "100 concurrent misses made one upstream call"
    );

    // Absent keys: only the gate's false positives reach the upstream, each once, and
    // they are about p of them. (The filter holds 5,000 keys in about a hundred blocks,
    // so its realised rate moves with its random seed: the count is checked against the
    // proxy's own tally, and the rate only loosely.)
    const ABSENT: u64 = 10_000;
    let before = stub.hits();
    let series = "bloomgate_requests_total{outcome=\"false_positive\",route=\"info\"}";
    let false_positives_before = proxy.metric(series).await;
    let client = proxy.client().clone();
    let data = proxy.data;
    let replies = concurrently((0..ABSENT).collect(), 64, move |i| {
        let client = client.clone();
        async move {
            let url = format!(
                "http://{data}/api/product/info?sku_id={}",
                demo_absent_sku(i)
            );
            client
                .send(Method::GET, &url, &[], Bytes::new())
                .await
                .status
                .as_u16()
        }
    })
    .await;
    assert!(replies.iter().all(|s| *s == 404));
    let reached = stub.hits() - before;
    eprintln!("upstream origin: {reached} of {ABSENT} absent-key requests reached the upstream");
    let false_positives = proxy.metric(series).await - false_positives_before;
    assert_eq!(
        reached as f64, false_positives,
        "requests that reached the upstream against the gate's false positives"
    );
    assert!(
        reached <= (2.0 * 0.01 * ABSENT as f64) as u64,
        "{reached} reached the upstream"
    );

    // An upstream 5xx is passed on as 502 and not cached.
    stub.state
        .fail_with_500
        .store(true, std::sync::atomic::Ordering::SeqCst);
    let k = demo_sku(5);
    let r = proxy.get(&format!("/api/product/info?sku_id={k}")).await;
    assert_eq!((r.status.as_u16(), r.stage()), (502, "error"));
    stub.state
        .fail_with_500
        .store(false, std::sync::atomic::Ordering::SeqCst);
    let r = proxy.get(&format!("/api/product/info?sku_id={k}")).await;
    assert_eq!((r.status.as_u16(), r.stage()), (200, "miss"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_upstream_answers_504() {
    let Some(server) = mysql_url() else { return };
    let db = TestDb::create(&server, 0).await;
    // The slow route's keys are the delay in ms; make a minute a present key.
    db.insert_product(60_000).await;
    let stub = StubUpstream::start([]).await;
    let proxy =
        TestProxy::spawn_ready(&config(&db.url, &stub.url(), 100, (SHORT_TIMEOUT, TIMEOUT))).await;
    let started = Instant::now();
    let r = proxy.get("/slow/60000").await;
    let took = started.elapsed();
    assert_eq!(r.status.as_u16(), 504, "{}", r.text());
    // Answered at the 500 ms upstream timeout, not when the upstream answers a minute on.
    assert!(took >= Duration::from_millis(500), "{took:?}");
    assert!(took < Duration::from_secs(30), "{took:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fails_open_while_the_database_is_down_and_recovers_without_restart() {
    let Some(server) = mysql_url() else { return };
    const N: u64 = 2_000;
    let db = TestDb::create(&server, N).await;
    let relay = Relay::start(host_port(&server)).await;
    let stub = StubUpstream::start((0..N).map(demo_sku)).await;
    let proxy = TestProxy::spawn(&config(
        &db.url_via(relay.addr),
        &stub.url(),
        N,
        (TIMEOUT, TIMEOUT),
    ))
    .await;

    let r = proxy.admin_get("/readyz").await;
    assert_eq!(r.status.as_u16(), 503, "{}", r.text());
    assert_eq!(r.json()["loading"][0], "products");
    let r = proxy.admin_get("/healthz").await;
    assert_eq!(r.status.as_u16(), 200);

    // Guarded requests go through to the origin instead of being refused.
    let present = demo_sku(9);
    let r = proxy
        .get(&format!("/api/product/info?sku_id={present}"))
        .await;
    assert_eq!(
        (r.status.as_u16(), r.stage()),
        (200, "fail-open"),
        "{}",
        r.text()
    );
    let absent = demo_absent_sku(9);
    let r = proxy
        .get(&format!("/api/product/info?sku_id={absent}"))
        .await;
    assert_eq!((r.status.as_u16(), r.stage()), (404, "fail-open"));
    assert_eq!(stub.hits(), 2);
    assert_eq!(
        proxy
            .metric("bloomgate_requests_total{outcome=\"fail_open\",route=\"info\"}")
            .await,
        2.0
    );
    assert_eq!(
        proxy
            .metric("bloomgate_filter_ready{filter=\"products\"}")
            .await,
        0.0
    );
    // Pass-through keeps working too.
    let r = proxy.get("/echo/x").await;
    assert_eq!(r.stage(), "bypass");

    // Let a few load attempts fail, then bring the database up: the loader retries
    // with backoff and the gate becomes ready without a restart.
    let deadline = Instant::now() + Duration::from_secs(60);
    while proxy
        .metric("bloomgate_filter_loads_total{filter=\"products\",result=\"error\"}")
        .await
        < 2.0
    {
        assert!(Instant::now() < deadline, "load attempts were not retried");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    relay.bring_up();
    proxy.wait_ready(Duration::from_secs(30)).await;
    assert_eq!(
        proxy
            .metric("bloomgate_filter_ready{filter=\"products\"}")
            .await,
        1.0
    );

    let absent = demo_absent_sku(10);
    let r = proxy
        .get(&format!("/api/product/info?sku_id={absent}"))
        .await;
    assert_eq!(r.status.as_u16(), 404);
    assert!(["intercepted", "miss"].contains(&r.stage()));
    let r = proxy
        .get(&format!("/api/product/info?sku_id={}", demo_sku(11)))
        .await;
    assert_eq!((r.status.as_u16(), r.stage()), (200, "miss"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pass_through_forwards_bodies_and_headers_both_ways() {
    let Some(server) = mysql_url() else { return };
    let db = TestDb::create(&server, 10).await;
    let stub = StubUpstream::start([]).await;
    let proxy = TestProxy::spawn_ready(&config(&db.url, &stub.url(), 10, (TIMEOUT, TIMEOUT))).await;

    let body: Vec<u8> = (0..40_000u32).map(|i| (i % 251) as u8).collect();
    let r = proxy
        .client()
        .send(
            Method::POST,
            &format!("http://{}/echo/orders?x=1&y=%20", proxy.data),
            &[
                ("content-type", "application/octet-stream"),
                ("connection", "x-hop"),
                ("x-hop", "must not pass"),
                ("x-custom", "kept"),
                ("x-forwarded-for", "203.0.113.7"),
            ],
            Bytes::from(body.clone()),
        )
        .await;
    assert_eq!(r.status.as_u16(), 200);
    assert_eq!(r.stage(), "bypass");
    assert_eq!(
        r.body.as_ref(),
        body.as_slice(),
        "the streamed answer is the body sent"
    );
    assert_eq!(r.headers["x-upstream"], "stub");
    assert!(
        r.headers.get("x-drop-me").is_none(),
        "Connection-named response header removed"
    );
    assert!(
        r.headers["via"]
            .to_str()
            .unwrap_or("")
            .contains("bloomgate")
    );

    let seen = stub
        .state
        .seen
        .lock()
        .expect("lock")
        .clone()
        .expect("upstream saw the request");
    assert_eq!(seen.method, "POST");
    assert_eq!(seen.path_and_query, "/echo/orders?x=1&y=%20");
    assert_eq!(seen.headers["x-custom"], "kept");
    assert!(
        seen.headers.get("x-hop").is_none(),
        "Connection-named request header removed"
    );
    // No trusted proxies are configured: the client's claim is replaced by its address.
    assert_eq!(seen.headers["x-forwarded-for"], "127.0.0.1");
    assert_eq!(seen.headers["x-forwarded-proto"], "http");
    assert!(
        seen.headers["via"]
            .to_str()
            .unwrap_or("")
            .contains("1.1 bloomgate")
    );

    // Methods other than GET/HEAD on a guarded path pass through too (writes).
    let r = proxy
        .client()
        .send(
            Method::PUT,
            &format!("http://{}/echo", proxy.data),
            &[],
            Bytes::from_static(b"w"),
        )
        .await;
    assert_eq!((r.status.as_u16(), r.stage()), (200, "bypass"));

    // Bodies over the limit are refused with 413.
    let big = Bytes::from(vec![b'x'; 70_000]);
    let r = proxy
        .client()
        .send(
            Method::POST,
            &format!("http://{}/echo", proxy.data),
            &[],
            big,
        )
        .await;
    assert_eq!(r.status.as_u16(), 413, "{}", r.text());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_never_finishes_its_headers_is_disconnected() {
    let Some(server) = mysql_url() else { return };
    let db = TestDb::create(&server, 10).await;
    let stub = StubUpstream::start([]).await;
    let proxy = TestProxy::spawn_ready(&config(
        &db.url,
        &stub.url(),
        10,
        (TIMEOUT, SHORT_HEADER_TIMEOUT),
    ))
    .await;
    // Taken before the connection exists, so the proxy's clock for it cannot have
    // started earlier: a late wake-up of this task can only make the wait look longer.
    let started = Instant::now();
    let mut conn = tokio::net::TcpStream::connect(proxy.data)
        .await
        .expect("connect");
    conn.write_all(b"GET /api/product/info?sku_id=1 HTTP/1.1\r\nHost: x\r\n")
        .await
        .expect("write");
    let mut buf = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(30), conn.read_to_end(&mut buf)).await;
    assert!(
        read.is_ok(),
        "connection still open after 30s with a 1s header timeout"
    );
    assert!(started.elapsed() >= Duration::from_millis(900));
}

/// An upstream that answers `/lure` with its answer and then a second, unasked answer,
/// `/both` with a chunked body beside a Content-Length that does not describe it, and
/// anything else honestly; every connection is kept open.
async fn lying_upstream() -> std::net::SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("address");
    tokio::spawn(async move {
        while let Ok((mut socket, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut read = Vec::new();
                loop {
                    let end = loop {
                        if let Some(i) = read.windows(4).position(|w| w == b"\r\n\r\n") {
                            break i + 4;
                        }
                        let mut piece = [0u8; 4096];
                        match socket.read(&mut piece).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => read.extend_from_slice(&piece[..n]),
                        }
                    };
                    let head: Vec<u8> = read.drain(..end).collect();
                    let answer: &[u8] = if head.starts_with(b"GET /lure ")
                        || head.starts_with(b"POST /lure ")
                    {
                        b"HTTP/1.1 200 OK\r\ncontent-length: 4\r\n\r\nlure\
                          HTTP/1.1 200 OK\r\ncontent-length: 8\r\n\r\nsmuggled"
                    } else if head.starts_with(b"GET /both ") || head.starts_with(b"POST /both ") {
                        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ncontent-length: 2\r\n\r\n\
                          5\r\nhello\r\n0\r\n\r\n"
                    } else {
                        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 15\r\n\r\n{\"honest\":true}"
                    };
                    if socket.write_all(answer).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    addr
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bytes_an_upstream_sends_unasked_reach_no_client() {
    let Some(server) = mysql_url() else { return };
    let db = TestDb::create(&server, 10).await;
    let upstream = lying_upstream().await;
    let proxy = TestProxy::spawn_ready(&config(
        &db.url,
        &format!("http://{upstream}"),
        10,
        (TIMEOUT, TIMEOUT),
    ))
    .await;
    for round in 0..4 {
        let r = proxy.get("/lure").await;
        assert_eq!((r.status.as_u16(), r.text()), (200, "lure".to_owned()));
        // Whatever connection the next requests get, none is the answer nobody asked
        // for: not a passed-through one, not an origin fetch.
        let r = proxy.get("/anything/else").await;
        assert_eq!(r.text(), r#"{"honest":true}"#, "round {round}");
        let r = proxy
            .get(&format!("/api/product/info?sku_id={}", demo_sku(round)))
            .await;
        assert_eq!(
            (r.status.as_u16(), r.text()),
            (200, r#"{"honest":true}"#.to_owned()),
            "round {round}"
        );
    }
    // The same through hyper's client, which carries requests with a body.
    for round in 0..4 {
        let client = proxy.client();
        let post = |path: &str| {
            let url = format!("http://{}{path}", proxy.data);
            async move {
                client
                    .send(Method::POST, &url, &[("content-length", "0")], Bytes::new())
                    .await
            }
        };
        assert_eq!(post("/lure").await.text(), "lure");
        assert_eq!(
            post("/x").await.text(),
            r#"{"honest":true}"#,
            "round {round}"
        );
        let r = proxy.get("/anything/else").await;
        assert_eq!(r.text(), r#"{"honest":true}"#, "round {round}");
    }
    // Framed by its Transfer-Encoding, passed on without the Content-Length beside it.
    let r = proxy.get("/both").await;
    assert_eq!((r.status.as_u16(), r.text()), (200, "hello".to_owned()));
    assert!(
        r.headers
            .get("content-length")
            .is_none_or(|v| v.as_bytes() == b"5"),
        "{:?}",
        r.headers
    );
    // The same answer to a request hyper's client carries (one with a body).
    let r = proxy
        .client()
        .send(
            Method::POST,
            &format!("http://{}/both", proxy.data),
            &[("content-length", "0")],
            Bytes::new(),
        )
        .await;
    assert_eq!((r.status.as_u16(), r.text()), (200, "hello".to_owned()));
    let r = proxy.get("/anything/else").await;
    assert_eq!(r.text(), r#"{"honest":true}"#);
}
