//! What the own path's connections do between requests: kept when the answer allows,
//! probed before reuse, swept once expired, closed when abandoned or over the limit.

use super::*;

const OK: &[u8] = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok";

async fn body_of(upstream: &Upstream, target: &str) -> Bytes {
    let resp = upstream
        .send(get(upstream, target))
        .await
        .expect("an answer");
    resp.into_body().collect().await.expect("a body").to_bytes()
}

#[tokio::test]
async fn a_connection_read_to_the_end_carries_the_next_request() {
    let chunked = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n";
    let long = b"HTTP/1.1 200 OK\r\ncontent-length: 20000\r\n\r\n";
    let mut long = long.to_vec();
    long.extend(std::iter::repeat_n(b'l', 20000));
    let raw = Raw::start(vec![
        Script::keep(OK),
        Script::keep(chunked),
        Script {
            bytes: long,
            cuts: vec![100, 9000],
            close: false,
            gate: None,
        },
        Script::keep(OK),
    ])
    .await;
    let upstream = upstream_at(raw.addr, 8, Duration::from_secs(30));
    assert_eq!(&body_of(&upstream, "/a").await[..], b"ok");
    assert_eq!(&body_of(&upstream, "/b").await[..], b"ok");
    assert_eq!(body_of(&upstream, "/c").await.len(), 20000);
    assert_eq!(&body_of(&upstream, "/d").await[..], b"ok");
    assert_eq!(
        raw.opened.load(Ordering::SeqCst),
        1,
        "one connection for all"
    );
    assert_eq!(raw.heads.lock().expect("heads").len(), 4);
}

#[tokio::test]
async fn a_connection_is_reused_only_when_its_answer_allows() {
    let raw = Raw::start(vec![
        Script::keep(b"HTTP/1.0 200 OK\r\ncontent-length: 2\r\n\r\nok"),
        Script::keep(b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 2\r\n\r\nok"),
        Script::keep(b"HTTP/1.1 200 OK\r\nconnection: keep-alive\r\nconnection: close\r\ncontent-length: 2\r\n\r\nok"),
        Script::keep(b"HTTP/1.0 200 OK\r\nconnection: keep-alive\r\ncontent-length: 2\r\n\r\nok"),
        Script::keep(OK),
    ])
    .await;
    let upstream = upstream_at(raw.addr, 8, Duration::from_secs(30));
    for (target, opened) in [("/a", 1), ("/b", 2), ("/c", 3), ("/d", 4), ("/e", 4)] {
        assert_eq!(&body_of(&upstream, target).await[..], b"ok");
        assert_eq!(raw.opened.load(Ordering::SeqCst), opened, "after {target}");
    }
}

#[tokio::test]
async fn bytes_after_an_answer_never_reach_the_next_request() {
    // An upstream that answers once and then some: what follows the answer must not be
    // read as the answer to the next request, on this connection or any.
    let mut smuggled = OK.to_vec();
    smuggled.extend_from_slice(b"HTTP/1.1 200 OK\r\ncontent-length: 8\r\n\r\nsmuggled");
    let raw = Raw::start(vec![Script::keep(&smuggled), Script::keep(OK)]).await;
    let upstream = upstream_at(raw.addr, 8, Duration::from_secs(30));
    assert_eq!(&body_of(&upstream, "/first").await[..], b"ok");
    assert_eq!(&body_of(&upstream, "/second").await[..], b"ok");
    assert_eq!(
        raw.opened.load(Ordering::SeqCst),
        2,
        "the first was not reused"
    );
}

#[tokio::test]
async fn an_idle_connection_the_upstream_closed_is_not_used() {
    let raw = Raw::start(vec![Script::closing(OK, Vec::new()), Script::keep(OK)]).await;
    let upstream = upstream_at(raw.addr, 8, Duration::from_secs(30));
    assert_eq!(&body_of(&upstream, "/first").await[..], b"ok");
    assert!(raw.until_ended(1).await, "the upstream closed the first");
    // The closed connection is in the idle list (its answer said nothing of closing);
    // the next request must find out before writing to it.
    assert_eq!(&body_of(&upstream, "/second").await[..], b"ok");
    assert_eq!(raw.opened.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn an_answer_abandoned_halfway_closes_its_connection() {
    let mut long = b"HTTP/1.1 200 OK\r\ncontent-length: 100000\r\n\r\n".to_vec();
    long.extend(std::iter::repeat_n(b'l', 1000));
    let raw = Raw::start(vec![Script::keep(&long), Script::keep(OK)]).await;
    let upstream = upstream_at(raw.addr, 8, Duration::from_secs(30));
    let resp = upstream
        .send(get(&upstream, "/a"))
        .await
        .expect("an answer");
    drop(resp);
    assert!(
        raw.until_ended(1).await,
        "the abandoned connection was closed"
    );
    assert_eq!(&body_of(&upstream, "/b").await[..], b"ok");
    assert_eq!(raw.opened.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn idle_connections_are_closed_once_they_expire() {
    let raw = Raw::start(vec![Script::keep(OK)]).await;
    let upstream = upstream_at(raw.addr, 8, Duration::from_millis(200));
    assert_eq!(&body_of(&upstream, "/a").await[..], b"ok");
    // Nothing else happens: the sweep alone must close it.
    assert!(
        raw.until_ended(1).await,
        "the expired connection was closed"
    );
    assert_eq!(&body_of(&upstream, "/b").await[..], b"ok");
    assert_eq!(raw.opened.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn no_more_idle_connections_are_kept_than_allowed() {
    // Two answers held open at once; with room for one idle connection, the second to
    // end is closed.
    let head = b"HTTP/1.1 200 OK\r\ncontent-length: 4\r\n\r\nab";
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    let raw = Raw::start(vec![Script {
        bytes: [&head[..], b"cd"].concat(),
        cuts: vec![head.len()],
        close: false,
        gate: Some(gate.clone()),
    }])
    .await;
    let upstream = upstream_at(raw.addr, 1, Duration::from_secs(30));
    let first = upstream
        .send(get(&upstream, "/1"))
        .await
        .expect("an answer");
    let second = upstream
        .send(get(&upstream, "/2"))
        .await
        .expect("an answer");
    assert_eq!(raw.opened.load(Ordering::SeqCst), 2, "the first was busy");
    gate.add_permits(2);
    for resp in [first, second] {
        let body = resp.into_body().collect().await.expect("a body").to_bytes();
        assert_eq!(&body[..], b"abcd");
    }
    assert!(
        raw.until_ended(1).await,
        "the one beyond the limit was closed"
    );
    assert_eq!(raw.ended.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn an_upstream_that_never_answers_times_out() {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("address");
    let held = tokio::spawn(async move {
        let (socket, _) = listener.accept().await.expect("accept");
        tokio::time::sleep(Duration::from_secs(60)).await;
        drop(socket);
    });
    let mut upstream = upstream_at(addr, 8, Duration::from_secs(30));
    upstream.timeout = Duration::from_millis(300);
    let failed = upstream.send(get(&upstream, "/slow")).await;
    assert!(
        matches!(failed, Err(UpstreamError::Timeout(_))),
        "{failed:?}"
    );
    held.abort();
}
