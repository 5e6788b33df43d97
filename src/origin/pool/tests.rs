use std::net::SocketAddr;

use http_body_util::{BodyExt, Either, Empty};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio::sync::{mpsc, watch};

use super::*;

const BODY: &[u8] = b"0123456789abcdef";

/// What the test upstream saw or did: connection `n` opened, closed by the other side,
/// or hung up by the upstream.
#[derive(Debug, PartialEq, Eq)]
enum Seen {
    Opened(usize),
    Closed(usize),
    HungUp(usize),
}

/// A keep-alive HTTP/1.1 upstream written for these tests: it answers every request on
/// a connection with `BODY` (Content-Length framing), reports each connection it
/// accepts and each one the client closes, and closes all of its connections when
/// `hang_up` is sent.
struct TestUpstream {
    addr: SocketAddr,
    seen: mpsc::UnboundedReceiver<Seen>,
    hang_up: watch::Sender<bool>,
}

async fn test_upstream() -> TestUpstream {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("address");
    let (tx, seen) = mpsc::unbounded_channel();
    let (hang_up, hung) = watch::channel(false);
    tokio::spawn(async move {
        for n in 0.. {
            let Ok((mut sock, _)) = listener.accept().await else {
                return;
            };
            let tx = tx.clone();
            let mut hung = hung.clone();
            let _ = tx.send(Seen::Opened(n));
            tokio::spawn(async move {
                let mut buf = Vec::new();
                let mut chunk = [0u8; 1024];
                loop {
                    let read = tokio::select! {
                        r = sock.read(&mut chunk) => r,
                        () = async { drop(hung.wait_for(|h| *h).await) } => {
                            let _ = sock.shutdown().await;
                            let _ = tx.send(Seen::HungUp(n));
                            return;
                        }
                    };
                    match read {
                        Ok(0) | Err(_) => {
                            let _ = tx.send(Seen::Closed(n));
                            return;
                        }
                        Ok(k) => buf.extend_from_slice(&chunk[..k]),
                    }
                    while let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                        buf.drain(..end + 4);
                        let head =
                            format!("HTTP/1.1 200 OK\r\ncontent-length: {}\r\n\r\n", BODY.len());
                        if sock.write_all(head.as_bytes()).await.is_err()
                            || sock.write_all(BODY).await.is_err()
                        {
                            return;
                        }
                    }
                }
            });
        }
    });
    TestUpstream {
        addr,
        seen,
        hang_up,
    }
}

fn pool_for(addr: SocketAddr, slots: usize, max_idle: usize, idle: Duration) -> Pool {
    let authority: Authority = addr.to_string().parse().expect("authority");
    Pool::new(authority, slots, max_idle, idle)
}

fn get() -> Request<UpstreamBody> {
    Request::builder()
        .uri("/p")
        .header(http::header::HOST, "upstream")
        .body(Either::Left(Empty::new()))
        .expect("request")
}

async fn read_all(resp: Response<PooledBody>) -> Bytes {
    resp.into_body().collect().await.expect("body").to_bytes()
}

#[tokio::test]
async fn a_connection_read_to_its_end_serves_the_next_request() {
    let mut up = test_upstream().await;
    let pool = pool_for(up.addr, 1, 8, Duration::from_secs(60));
    for _ in 0..5 {
        let resp = pool.send(0, get()).await.expect("answered");
        assert_eq!(read_all(resp).await, BODY);
        assert_eq!(pool.idle(0), 1);
    }
    assert_eq!(up.seen.try_recv(), Ok(Seen::Opened(0)));
    assert!(
        up.seen.try_recv().is_err(),
        "one connection for five requests"
    );
}

#[tokio::test]
async fn a_body_dropped_once_its_size_is_met_still_returns_the_connection() {
    let mut up = test_upstream().await;
    let pool = pool_for(up.addr, 1, 8, Duration::from_secs(60));
    let mut body = pool.send(0, get()).await.expect("answered").into_body();
    let frame = body.frame().await.expect("a frame").expect("data");
    assert_eq!(frame.into_data().expect("data"), BODY);
    // hyper's server stops here: the size hint is met, it never asks for the end.
    drop(body);
    assert_eq!(pool.idle(0), 1);
    let resp = pool.send(0, get()).await.expect("answered");
    assert_eq!(read_all(resp).await, BODY);
    assert_eq!(up.seen.try_recv(), Ok(Seen::Opened(0)));
    assert!(up.seen.try_recv().is_err(), "the connection was reused");
}

#[tokio::test]
async fn a_response_dropped_unread_closes_its_connection() {
    let mut up = test_upstream().await;
    let pool = pool_for(up.addr, 1, 8, Duration::from_secs(60));
    let resp = pool.send(0, get()).await.expect("answered");
    drop(resp);
    assert_eq!(pool.idle(0), 0);
    assert_eq!(up.seen.recv().await, Some(Seen::Opened(0)));
    assert_eq!(up.seen.recv().await, Some(Seen::Closed(0)));
    let resp = pool
        .send(0, get())
        .await
        .expect("answered on a new connection");
    assert_eq!(read_all(resp).await, BODY);
    assert_eq!(up.seen.recv().await, Some(Seen::Opened(1)));
}

#[tokio::test]
async fn a_connection_the_upstream_closed_while_idle_is_not_used() {
    let mut up = test_upstream().await;
    let pool = pool_for(up.addr, 1, 8, Duration::from_secs(60));
    let resp = pool.send(0, get()).await.expect("answered");
    assert_eq!(read_all(resp).await, BODY);
    assert_eq!(pool.idle(0), 1);
    assert_eq!(up.seen.recv().await, Some(Seen::Opened(0)));
    // The upstream hangs up the idle connection (as at its keep-alive timeout).
    up.hang_up.send_replace(true);
    assert_eq!(up.seen.recv().await, Some(Seen::HungUp(0)));
    // Its listener stays: the next request must open a new connection and succeed. Two
    // things see to it: the checkout's poll finds the connection closed, and a request
    // its connection turned out closed before writing is sent on another.
    up.hang_up.send_replace(false);
    for _ in 0..3 {
        let resp = pool.send(0, get()).await.expect("answered");
        assert_eq!(read_all(resp).await, BODY);
    }
    assert_eq!(up.seen.recv().await, Some(Seen::Opened(1)));
    assert!(up.seen.try_recv().is_err());
}

#[tokio::test]
async fn each_slot_keeps_its_own_connections_up_to_max_idle() {
    let mut up = test_upstream().await;
    let pool = pool_for(up.addr, 2, 2, Duration::from_secs(60));
    // Three exchanges open at once on slot 0: three connections, two kept.
    let a = pool.send(0, get()).await.expect("answered");
    let b = pool.send(0, get()).await.expect("answered");
    let c = pool.send(0, get()).await.expect("answered");
    for resp in [a, b, c] {
        assert_eq!(read_all(resp).await, BODY);
    }
    assert_eq!(pool.idle(0), 2);
    assert_eq!(pool.idle(1), 0);
    // Slot 1 does not take slot 0's connections.
    let resp = pool.send(1, get()).await.expect("answered");
    assert_eq!(read_all(resp).await, BODY);
    assert_eq!((pool.idle(0), pool.idle(1)), (2, 1));
    let opened = std::iter::from_fn(|| up.seen.try_recv().ok())
        .filter(|s| matches!(s, Seen::Opened(_)))
        .count();
    assert_eq!(opened, 4);
    // A slot past the last is the last.
    let resp = pool.send(usize::MAX, get()).await.expect("answered");
    assert_eq!(read_all(resp).await, BODY);
    assert_eq!(pool.idle(1), 1);
}

#[tokio::test(start_paused = true)]
async fn connections_idle_past_the_timeout_are_closed() {
    let mut up = test_upstream().await;
    let pool = pool_for(up.addr, 1, 8, Duration::from_secs(30));
    let resp = pool.send(0, get()).await.expect("answered");
    assert_eq!(read_all(resp).await, BODY);
    assert_eq!(up.seen.recv().await, Some(Seen::Opened(0)));
    // Within the timeout the connection is reused.
    tokio::time::advance(Duration::from_secs(20)).await;
    let resp = pool.send(0, get()).await.expect("answered");
    assert_eq!(read_all(resp).await, BODY);
    assert!(up.seen.try_recv().is_err(), "reused");
    // Then nothing uses it: the sweep closes it once the timeout has passed (the clock
    // moves on by itself while the test waits for the upstream to see the close).
    let before = Instant::now();
    assert_eq!(up.seen.recv().await, Some(Seen::Closed(0)));
    assert!(before.elapsed() >= Duration::from_secs(30));
    assert_eq!(pool.idle(0), 0);
}

#[tokio::test]
async fn nothing_listening_is_a_connect_error() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("address");
    drop(listener);
    let pool = pool_for(addr, 1, 8, Duration::from_secs(60));
    match pool.send(0, get()).await {
        Err(ExchangeError::Connect(e)) => {
            assert_eq!(e.kind(), io::ErrorKind::ConnectionRefused);
        }
        other => panic!("expected a connect error, got {other:?}"),
    }
}
