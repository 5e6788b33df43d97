//! The direct loop against hyper: the same handler served twice on 127.0.0.1, once with
//! the loop in front (`Answers<true>`) and once by hyper alone (`Answers<false>`, whose
//! `answer_now` hyper's service still asks), must send the same bytes for any sequence
//! of requests, however the client splits them; and the loop keeps the listener's
//! timeout and shutdown.

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body::{Body, Frame, SizeHint};
use http_body_util::{Either, Full};
use hyper::body::Incoming;
use proptest::prelude::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{oneshot, watch};

use crate::server::{Handler, ServeOptions, Transport, serve};

/// Answers at once every `/now…` target (as the data plane answers refusals and hits),
/// with bodies that the loop writes itself or leaves to hyper; everything else waits
/// for `call`. `DIRECT` says whether the loop is in front.
struct Answers<const DIRECT: bool> {
    /// `answer_now` calls made with a head the loop read (`Request<()>`).
    direct: AtomicUsize,
    /// The rest of the body of the next `/later/gated` answer, when the test sends it.
    gate: Mutex<Option<oneshot::Receiver<Bytes>>>,
}

impl<const DIRECT: bool> Answers<DIRECT> {
    fn new() -> Answers<DIRECT> {
        Answers {
            direct: AtomicUsize::new(0),
            gate: Mutex::new(None),
        }
    }

    fn gate(&self) -> Option<oneshot::Receiver<Bytes>> {
        self.gate.lock().expect("lock").take()
    }
}

type TestBody = Either<Full<Bytes>, Odd>;

impl<const DIRECT: bool> Handler for Answers<DIRECT> {
    type Body = TestBody;
    const ANSWERS_AT_ONCE: bool = DIRECT;

    async fn call(&self, req: Request<Incoming>, _peer: SocketAddr) -> Response<TestBody> {
        waited(&req, self.gate()).await
    }

    fn call_head(
        &self,
        req: Request<()>,
        _peer: SocketAddr,
    ) -> Option<impl Future<Output = Response<TestBody>> + Send + '_> {
        let gate = self.gate();
        Some(async move { waited(&req, gate).await })
    }

    fn answer_now<B>(&self, req: &Request<B>, _peer: SocketAddr) -> Option<Response<TestBody>> {
        if std::any::type_name::<B>() == "()" {
            self.direct.fetch_add(1, Ordering::Relaxed);
        }
        let path = req.uri().path();
        let rest = path.strip_prefix("/now")?;
        let echo = |resp: &mut Response<TestBody>| {
            if let Some(v) = req.headers().get("x-echo") {
                resp.headers_mut().insert("x-echoed", v.clone());
            }
        };
        let full = |status: StatusCode, body: &str| {
            let mut resp = Response::new(Either::Left(Full::new(Bytes::from(body.to_owned()))));
            *resp.status_mut() = status;
            resp.headers_mut()
                .insert("content-type", http::HeaderValue::from_static("text/plain"));
            resp
        };
        let mut resp = match rest {
            "/empty" => full(StatusCode::OK, ""),
            "/no-content" => full(StatusCode::NO_CONTENT, ""),
            "/teapot" => full(StatusCode::IM_A_TEAPOT, "short and stout"),
            "/large" => full(StatusCode::OK, &"large, ".repeat(15_000)),
            "/odd-status" => full(StatusCode::from_u16(599).ok()?, "no reason"),
            "/close" => {
                let mut resp = full(StatusCode::OK, "and goodbye");
                resp.headers_mut()
                    .insert("connection", http::HeaderValue::from_static("close"));
                resp
            }
            "/pending" => Response::new(Either::Right(Odd::pending("came later"))),
            "/unknown-length" => {
                Response::new(Either::Right(Odd::unknown_length("of no stated length")))
            }
            "/in-pieces" => Response::new(Either::Right(Odd::pieces(&["first, ", "second"]))),
            _ => {
                let mut resp = full(StatusCode::NOT_FOUND, &format!("refused {}", req.uri()));
                resp.headers_mut()
                    .append("x-many", http::HeaderValue::from_static("one"));
                resp.headers_mut()
                    .append("x-many", http::HeaderValue::from_static("two"));
                resp
            }
        };
        echo(&mut resp);
        Some(resp)
    }
}

/// The answer to a request that waits: after a yield, a body of its own kind.
async fn waited<B>(req: &Request<B>, gate: Option<oneshot::Receiver<Bytes>>) -> Response<TestBody> {
    tokio::task::yield_now().await;
    let said = format!("waited for {} {}", req.method(), req.uri());
    let body = match req.uri().path() {
        "/later/pending" => Either::Right(Odd::pending("came later")),
        "/later/unknown-length" => Either::Right(Odd::unknown_length("of no stated length")),
        "/later/trickled" => Either::Right(Odd::trickled(&["one, ", "two, ", "three"])),
        "/later/large-pieces" => Either::Right(Odd::trickled(&[
            &LARGE_PIECE,
            "small, ",
            &LARGE_PIECE,
            &LARGE_PIECE,
        ])),
        "/later/gated" => Either::Right(Odd {
            gate: gate.map(|g| (g, GATED.len() as u64)),
            ..Odd::pieces(&["before the gate; "])
        }),
        _ => Either::Left(Full::new(Bytes::from(said))),
    };
    let mut resp = Response::new(body);
    if req.uri().path() == "/later/dated" {
        resp.headers_mut().insert(
            "date",
            http::HeaderValue::from_static("Sun, 06 Nov 1994 08:49:37 GMT"),
        );
    }
    if req.uri().path() == "/later/stated-length" {
        let len = resp.body().size_hint().exact().unwrap_or(0);
        resp.headers_mut()
            .insert("content-length", http::HeaderValue::from(len));
    }
    resp
}

/// A body that is not a ready `Full`: pending on its first poll, of unknown length, or
/// in several frames.
struct Odd {
    frames: Vec<Bytes>,
    pending_once: bool,
    sized: bool,
    /// Pending before every frame, not only the first.
    trickles: bool,
    /// A last frame of the given length that comes when the test sends it.
    gate: Option<(oneshot::Receiver<Bytes>, u64)>,
}

/// A piece of body larger than the loop copies (`FLUSH_AT`), 32 KiB.
static LARGE_PIECE: std::sync::LazyLock<String> =
    std::sync::LazyLock::new(|| "0123456789abcdef".repeat(2048));

/// What the test sends through an answer's gate.
const GATED: &str = "after the gate";

impl Odd {
    fn pending(s: &'static str) -> Odd {
        Odd {
            pending_once: true,
            ..Odd::pieces(&[s])
        }
    }
    fn unknown_length(s: &'static str) -> Odd {
        Odd {
            sized: false,
            ..Odd::pieces(&[s])
        }
    }
    fn pieces(p: &[&'static str]) -> Odd {
        Odd {
            frames: p
                .iter()
                .rev()
                .map(|s| Bytes::from_static(s.as_bytes()))
                .collect(),
            pending_once: false,
            sized: true,
            trickles: false,
            gate: None,
        }
    }
    fn trickled(p: &[&'static str]) -> Odd {
        Odd {
            pending_once: true,
            trickles: true,
            ..Odd::pieces(p)
        }
    }
}

impl Body for Odd {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        if self.pending_once {
            self.pending_once = false;
            cx.waker().wake_by_ref();
            return Poll::Pending;
        }
        // `pieces` keeps its frames reversed: the next is last.
        self.pending_once = self.trickles;
        if self.frames.is_empty()
            && let Some((gate, _)) = &mut self.gate
        {
            let sent = std::task::ready!(Pin::new(gate).poll(cx));
            self.gate = None;
            return Poll::Ready(sent.ok().map(|b| Ok(Frame::data(b))));
        }
        Poll::Ready(self.frames.pop().map(|b| Ok(Frame::data(b))))
    }

    fn size_hint(&self) -> SizeHint {
        if self.sized {
            let gated = self.gate.as_ref().map_or(0, |(_, len)| *len);
            SizeHint::with_exact(self.frames.iter().map(|b| b.len() as u64).sum::<u64>() + gated)
        } else {
            SizeHint::default()
        }
    }

    fn is_end_stream(&self) -> bool {
        self.frames.is_empty() && self.gate.is_none()
    }
}

fn options() -> ServeOptions {
    ServeOptions {
        header_read_timeout: Duration::from_secs(5),
        grace: Duration::from_secs(1),
        ..ServeOptions::default()
    }
}

/// A server of `handler` on 127.0.0.1:0, and the sender that shuts it down; the join
/// handle gives the connections left open at the end of the grace period.
async fn start<H: Handler>(
    handler: Arc<H>,
    options: ServeOptions,
) -> (
    SocketAddr,
    watch::Sender<bool>,
    tokio::task::JoinHandle<usize>,
) {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let (stop, stopped) = watch::channel(false);
    let served = tokio::spawn(serve(
        listener,
        handler,
        options,
        Transport::default(),
        stopped,
        "direct-test",
    ));
    (addr, stop, served)
}

/// Sends `pieces` one write each, then reads until the server closes.
async fn exchange(addr: SocketAddr, pieces: &[Vec<u8>]) -> Vec<u8> {
    let conn = TcpStream::connect(addr).await.expect("connect");
    conn.set_nodelay(true).expect("nodelay");
    let (mut rd, mut wr) = conn.into_split();
    let reading = tokio::spawn(async move {
        let mut all = Vec::new();
        let _ = tokio::time::timeout(Duration::from_secs(10), rd.read_to_end(&mut all)).await;
        all
    });
    for piece in pieces {
        if wr.write_all(piece).await.is_err() {
            break;
        }
    }
    reading.await.expect("reader")
}

/// `date` values blanked: the two servers may answer in different seconds.
fn undated(bytes: &[u8]) -> String {
    let text = String::from_utf8_lossy(bytes).into_owned();
    let mut out = String::with_capacity(text.len());
    let mut rest = text.as_str();
    while let Some(at) = rest.find("\r\ndate: ") {
        let value = at + "\r\ndate: ".len();
        out.push_str(&rest[..value]);
        out.push_str("<date>");
        rest = rest.get(value + 29..).unwrap_or("");
    }
    out.push_str(rest);
    out
}

/// Requests that keep the connection open. The loop answers the plain `GET`s to
/// `/now…` itself; everything else is hyper's.
fn open_request() -> impl Strategy<Value = String> {
    let target = prop_oneof![
        Just("/now/refused/1".to_owned()),
        Just("/now/refused/2?x=1&y=%41".to_owned()),
        Just("/now/empty".to_owned()),
        Just("/now/no-content".to_owned()),
        Just("/now/teapot".to_owned()),
        Just("/now/odd-status".to_owned()),
        Just("/now/pending".to_owned()),
        Just("/now/unknown-length".to_owned()),
        Just("/now/in-pieces".to_owned()),
        Just("/later/1".to_owned()),
        Just("/later/pending".to_owned()),
        Just("/later/unknown-length".to_owned()),
        Just("/later/trickled".to_owned()),
        Just("/later/dated".to_owned()),
        Just("/later/stated-length".to_owned()),
        Just("/now/%zz".to_owned()),
        // Bytes past ASCII: httparse and `http` take them, as hyper does.
        Just("/now/caf\u{e9}".to_owned()),
        "/now/[a-z0-9%._~!$&'()*+,;=:@-]{0,20}",
    ];
    let method = prop_oneof![
        6 => Just("GET"),
        1 => Just("HEAD"),
        1 => Just("DELETE"),
    ];
    let extra = prop_oneof![
        Just(String::new()),
        Just("X-Echo: hello\r\n".to_owned()),
        Just("x-echo: two\r\nx-echo: values\r\n".to_owned()),
        Just("Accept: */*\r\nUser-Agent: t\r\n".to_owned()),
        Just("Connection: keep-alive\r\n".to_owned()),
        Just("Content-Length: 3\r\n\r\nabc".to_owned()),
        Just("Transfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n".to_owned()),
        Just("Expect: 100-continue\r\nContent-Length: 0\r\n".to_owned()),
        Just("X-Echo:   padded   \r\n".to_owned()),
    ];
    let newline = prop_oneof![3 => Just("\r\n"), 1 => Just("\n")];
    (method, target, extra, newline).prop_map(|(method, target, extra, nl)| {
        let (headers, body) = match extra.split_once("\r\n\r\n") {
            Some((h, b)) => (format!("{h}\r\n"), b.to_owned()),
            None => (extra, String::new()),
        };
        let headers = headers.replace("\r\n", nl);
        format!("{method} {target} HTTP/1.1{nl}Host: t{nl}{headers}{nl}{body}")
    })
}

/// The request that ends the exchange: the server closes after answering it.
fn last_request() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("GET /now/refused/last HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n".to_owned()),
        Just("GET /later/last HTTP/1.1\r\nConnection: close\r\n\r\n".to_owned()),
        Just("GET /now/refused/last HTTP/1.0\r\n\r\n".to_owned()),
        Just("GET /now/close HTTP/1.1\r\nHost: t\r\n\r\n".to_owned()),
        Just("GET /now/a b HTTP/1.1\r\nHost: t\r\n\r\n".to_owned()),
        Just("GET /now/x HTTP/1.1\r\nBad Header: x\r\n\r\n".to_owned()),
        Just("GET http://t/now/absolute HTTP/1.1\r\nConnection: close\r\n\r\n".to_owned()),
        Just("NOT-HTTP\r\n\r\n".to_owned()),
    ]
}

/// The bytes of `requests` cut at the given points.
fn cut(requests: &[String], cuts: &[usize]) -> Vec<Vec<u8>> {
    let all: Vec<u8> = requests.concat().into_bytes();
    let mut points: Vec<usize> = cuts.iter().map(|c| c % (all.len() + 1)).collect();
    points.sort_unstable();
    points.dedup();
    let mut pieces = Vec::new();
    let mut from = 0;
    for p in points.into_iter().chain([all.len()]) {
        if p > from {
            pieces.push(all[from..p].to_vec());
            from = p;
        }
    }
    pieces
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]

    /// Whatever the requests and however they arrive, the loop in front sends what
    /// hyper alone sends.
    #[test]
    fn the_loop_answers_byte_for_byte_as_hyper_does(
        open in proptest::collection::vec(open_request(), 0..6),
        last in last_request(),
        cuts in proptest::collection::vec(any::<usize>(), 0..8),
    ) {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
        let (direct, alone, looped) = rt.block_on(async {
            let looped = Arc::new(Answers::<true>::new());
            let (a, _stop_a, _) = start(Arc::clone(&looped), options()).await;
            let (b, _stop_b, _) = start(Arc::new(Answers::<false>::new()), options()).await;
            let mut requests = open.clone();
            requests.push(last.clone());
            let pieces = cut(&requests, &cuts);
            let direct = exchange(a, &pieces).await;
            let alone = exchange(b, &pieces).await;
            (direct, alone, looped.direct.load(Ordering::Relaxed))
        });
        prop_assert!(!alone.is_empty(), "hyper answered nothing");
        prop_assert_eq!(undated(&direct), undated(&alone));
        // The first request, when it is a plain GET the handler answers, was read by
        // the loop: the loop is in front, not beside.
        let first = open.first().unwrap_or(&last);
        let plain = first.starts_with("GET /now/")
            && first.contains("HTTP/1.1")
            && !first.contains("Content-Length")
            && !first.contains("Transfer-Encoding")
            && !first.contains("Connection")
            && !first.contains("Expect")
            && !first.contains("/now/a b")
            && !first.contains("Bad Header");
        if plain {
            prop_assert!(looped >= 1, "the loop read no head of {:?}", first);
        }
    }
}

/// Every kind of answer, each to a plain `GET` the loop reads (answered at once or after
/// a wait, with bodies ready, late, trickled, of unknown length, with a length or a date
/// of their own), is written as hyper writes it, and the loop read each head.
#[tokio::test]
async fn every_kind_of_answer_is_written_as_hyper_writes_it() {
    let targets = [
        "/now/refused/1",
        "/now/empty",
        "/now/no-content",
        "/now/teapot",
        "/now/large",
        "/now/odd-status",
        "/now/close",
        "/now/pending",
        "/now/unknown-length",
        "/now/in-pieces",
        "/later/1",
        "/later/pending",
        "/later/unknown-length",
        "/later/trickled",
        "/later/large-pieces",
        "/later/dated",
        "/later/stated-length",
    ];
    for target in targets {
        let looped = Arc::new(Answers::<true>::new());
        let (a, _stop_a, _) = start(Arc::clone(&looped), options()).await;
        let (b, _stop_b, _) = start(Arc::new(Answers::<false>::new()), options()).await;
        let sent = format!(
            "GET {target} HTTP/1.1\r\nHost: t\r\n\r\nGET {target} HTTP/1.1\r\nHost: t\r\n\r\n\
             GET /now/refused/end HTTP/1.1\r\nConnection: close\r\n\r\n"
        );
        let direct = exchange(a, &[sent.clone().into_bytes()]).await;
        let alone = exchange(b, &[sent.into_bytes()]).await;
        assert!(!alone.is_empty(), "{target}: hyper answered nothing");
        assert_eq!(undated(&direct), undated(&alone), "{target}");
        assert!(
            looped.direct.load(Ordering::Relaxed) >= 1,
            "{target}: not read by the loop"
        );
    }
}

/// A body that stops part way is not held back: what came before the stop reaches the
/// client while the rest waits, and the rest follows when it comes.
#[tokio::test]
async fn a_body_that_stops_part_way_is_written_up_to_the_stop() {
    let looped = Arc::new(Answers::<true>::new());
    let (addr, _stop, _) = start(Arc::clone(&looped), options()).await;
    let (release, gate) = oneshot::channel();
    *looped.gate.lock().expect("lock") = Some(gate);
    let mut conn = TcpStream::connect(addr).await.expect("connect");
    conn.write_all(b"GET /later/gated HTTP/1.1\r\nHost: t\r\n\r\n")
        .await
        .expect("write");
    let mut seen = Vec::new();
    let mut buf = [0u8; 1024];
    while !String::from_utf8_lossy(&seen).ends_with("before the gate; ") {
        let n = tokio::time::timeout(Duration::from_secs(5), conn.read(&mut buf))
            .await
            .expect("the part before the gate was held back")
            .expect("read");
        assert!(n > 0, "closed early");
        seen.extend_from_slice(&buf[..n]);
    }
    let text = String::from_utf8_lossy(&seen).into_owned();
    assert!(text.starts_with("HTTP/1.1 200 OK\r\n"), "{text}");
    assert!(text.contains("content-length: 31\r\n"), "{text}");
    release
        .send(Bytes::from_static(GATED.as_bytes()))
        .expect("release");
    while !String::from_utf8_lossy(&seen).ends_with(GATED) {
        let n = tokio::time::timeout(Duration::from_secs(5), conn.read(&mut buf))
            .await
            .expect("the rest")
            .expect("read");
        assert!(n > 0, "closed early");
        seen.extend_from_slice(&buf[..n]);
    }
    assert!(looped.direct.load(Ordering::Relaxed) >= 1);
}

/// Plain refusals, pipelined in one write and sent a byte at a time: the loop answers
/// every one itself, in order.
#[tokio::test]
async fn pipelined_and_trickled_heads_are_all_answered_by_the_loop() {
    let looped = Arc::new(Answers::<true>::new());
    let (addr, _stop, _) = start(Arc::clone(&looped), options()).await;
    let mut requests: Vec<String> = (0..20)
        .map(|i| format!("GET /now/refused/{i} HTTP/1.1\r\nHost: t\r\n\r\n"))
        .collect();
    requests.push("GET /now/refused/last HTTP/1.1\r\nConnection: close\r\n\r\n".into());
    let together = exchange(addr, &[requests.concat().into_bytes()]).await;
    let text = String::from_utf8_lossy(&together);
    assert_eq!(
        text.matches("HTTP/1.1 404 Not Found\r\n").count(),
        21,
        "{text}"
    );
    // Each body is followed by the next answer's status line.
    let order: Vec<Option<usize>> = (0..20)
        .map(|i| text.find(&format!("refused /now/refused/{i}HTTP/1.1 ")))
        .collect();
    assert!(
        order.iter().all(Option::is_some),
        "answers missing: {order:?}\n{text}"
    );
    assert!(
        order.windows(2).all(|w| w[0] < w[1]),
        "answers out of order: {order:?}"
    );
    assert!(text.ends_with("refused /now/refused/last"), "{text}");
    assert_eq!(looped.direct.load(Ordering::Relaxed), 20);

    let bytes = b"GET /now/refused/slow HTTP/1.1\r\nHost: t\r\n\r\nGET /now/refused/end HTTP/1.1\r\nConnection: close\r\n\r\n";
    let one_by_one: Vec<Vec<u8>> = bytes.iter().map(|b| vec![*b]).collect();
    let trickled = exchange(addr, &one_by_one).await;
    let text = String::from_utf8_lossy(&trickled);
    assert!(text.starts_with("HTTP/1.1 404 Not Found\r\n"), "{text}");
    assert!(text.contains("refused /now/refused/slow"), "{text}");
    assert!(text.contains("refused /now/refused/end"), "{text}");
    assert_eq!(looped.direct.load(Ordering::Relaxed), 21);
}

/// The header read timeout holds in the loop: a connection that sends nothing, one
/// idle after an answer, and one that trickles a head all close once it has passed,
/// and trickling does not extend it.
#[tokio::test]
async fn the_header_read_timeout_closes_idle_and_slow_connections() {
    let timeout = Duration::from_millis(300);
    let opts = ServeOptions {
        header_read_timeout: timeout,
        ..options()
    };
    let (addr, _stop, _) = start(Arc::new(Answers::<true>::new()), opts).await;

    let closed_within = |mut conn: TcpStream, bound: Duration| async move {
        let mut buf = Vec::new();
        tokio::time::timeout(bound, conn.read_to_end(&mut buf))
            .await
            .map(|_| buf)
    };

    let silent = TcpStream::connect(addr).await.expect("connect");
    let started = tokio::time::Instant::now();
    let read = closed_within(silent, Duration::from_secs(5)).await;
    assert_eq!(read.expect("closed").len(), 0);
    assert!(started.elapsed() >= timeout, "closed before the timeout");

    let mut answered = TcpStream::connect(addr).await.expect("connect");
    answered
        .write_all(b"GET /now/refused/1 HTTP/1.1\r\nHost: t\r\n\r\n")
        .await
        .expect("write");
    let read = closed_within(answered, Duration::from_secs(5)).await;
    let text = String::from_utf8(read.expect("closed")).expect("utf-8");
    assert!(text.starts_with("HTTP/1.1 404 Not Found\r\n"), "{text}");

    // 80 bytes at 25 ms a byte take 2 s, far past the timeout: the server closes the
    // connection at the timeout, with no answer, however recently a byte came.
    let slow = TcpStream::connect(addr).await.expect("connect");
    let started = tokio::time::Instant::now();
    let (mut rd, mut wr) = slow.into_split();
    let trickling = tokio::spawn(async move {
        let head = b"GET /now/refused/slowly HTTP/1.1\r\nHost: t\r\nX-Pad: aaaaaaaaaaaaaaaaaaaaaaaa\r\n\r\n";
        for b in head {
            if wr.write_all(&[*b]).await.is_err() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    });
    let mut buf = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), rd.read_to_end(&mut buf))
        .await
        .expect("closed");
    let closed_after = started.elapsed();
    trickling.abort();
    assert!(buf.is_empty(), "{:?}", String::from_utf8_lossy(&buf));
    assert!(closed_after >= timeout, "closed after {closed_after:?}");
    assert!(
        closed_after < Duration::from_millis(1500),
        "closed after {closed_after:?}"
    );
}

/// Shutdown closes a connection the loop holds idle at once, and the server reports no
/// connection left open.
#[tokio::test]
async fn shutdown_closes_an_idle_connection_the_loop_holds() {
    let (addr, stop, served) = start(
        Arc::new(Answers::<true>::new()),
        ServeOptions {
            header_read_timeout: Duration::from_secs(30),
            grace: Duration::from_secs(10),
            ..options()
        },
    )
    .await;
    let mut conn = TcpStream::connect(addr).await.expect("connect");
    conn.write_all(b"GET /now/refused/1 HTTP/1.1\r\nHost: t\r\n\r\n")
        .await
        .expect("write");
    let mut first = [0u8; 17];
    conn.read_exact(&mut first).await.expect("answer");
    assert_eq!(&first, b"HTTP/1.1 404 Not ");
    stop.send(true).expect("stop");
    let mut rest = Vec::new();
    tokio::time::timeout(Duration::from_secs(5), conn.read_to_end(&mut rest))
        .await
        .expect("closed on shutdown")
        .expect("read");
    let left = tokio::time::timeout(Duration::from_secs(5), served)
        .await
        .expect("drained")
        .expect("join");
    assert_eq!(left, 0);
}

#[test]
fn decimal_writes_every_magnitude() {
    for n in [0u64, 7, 10, 99, 100, 12_345, u64::MAX] {
        let mut out = Vec::new();
        super::answer::decimal(n, &mut out);
        assert_eq!(out, n.to_string().into_bytes());
    }
}

#[test]
fn a_blank_line_is_found_wherever_the_bytes_split() {
    for head in [
        &b"GET / HTTP/1.1\r\nHost: t\r\n\r\n"[..],
        b"GET / HTTP/1.1\nHost: t\n\n",
        b"GET / HTTP/1.1\r\nHost: t\r\n\n",
    ] {
        for split in 1..head.len() {
            // Whatever was scanned before (no blank line in it), the whole is found.
            let scanned = split.min(head.len() - 1);
            if super::may_be_complete(&head[..scanned], 0) {
                continue;
            }
            assert!(
                super::may_be_complete(head, scanned),
                "{head:?} split at {split}"
            );
        }
    }
}
