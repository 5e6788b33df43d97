//! The own path held to hyper's client: the same answers, written raw by an upstream in
//! the test, must come out as the same status, headers, reason, body and trailers (or be
//! refused by both), and the upstream must receive the same request bytes. What the
//! connections do between requests is in `pool`.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderValue, Request};
use http_body_util::{BodyExt, Either, Empty};
use proptest::prelude::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Notify;

use super::*;
use bloomgate_core::config::{BreakerConfig, CompiledUpstream, UpstreamConfig};

/// How the test upstream answers one request.
#[derive(Clone, Debug)]
struct Script {
    /// The answer's bytes, exactly.
    bytes: Vec<u8>,
    /// Where it is cut into separate writes.
    cuts: Vec<usize>,
    /// Whether the connection is closed after the answer.
    close: bool,
    /// When set, what follows the first cut waits for a permit.
    gate: Option<Arc<tokio::sync::Semaphore>>,
}

impl Script {
    /// `bytes` cut at `cuts`, then the connection closed.
    fn closing(bytes: &[u8], cuts: Vec<usize>) -> Script {
        Script {
            bytes: bytes.to_vec(),
            cuts,
            close: true,
            gate: None,
        }
    }

    fn keep(bytes: &[u8]) -> Script {
        Script {
            bytes: bytes.to_vec(),
            cuts: Vec::new(),
            close: false,
            gate: None,
        }
    }
}

/// An upstream that answers each request with the next script (the last one repeats),
/// and records every request head and every connection's end.
struct Raw {
    addr: std::net::SocketAddr,
    heads: Arc<Mutex<Vec<Vec<u8>>>>,
    opened: Arc<AtomicUsize>,
    ended: Arc<AtomicUsize>,
    ending: Arc<Notify>,
}

impl Raw {
    async fn start(scripts: Vec<Script>) -> Raw {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("address");
        let heads = Arc::new(Mutex::new(Vec::new()));
        let opened = Arc::new(AtomicUsize::new(0));
        let ended = Arc::new(AtomicUsize::new(0));
        let ending = Arc::new(Notify::new());
        let next = Arc::new(AtomicUsize::new(0));
        let (h, o, e, n) = (heads.clone(), opened.clone(), ended.clone(), ending.clone());
        tokio::spawn(async move {
            while let Ok((socket, _)) = listener.accept().await {
                o.fetch_add(1, Ordering::SeqCst);
                let (h, e, n, next, scripts) = (
                    h.clone(),
                    e.clone(),
                    n.clone(),
                    next.clone(),
                    scripts.clone(),
                );
                tokio::spawn(async move {
                    serve_raw(socket, &scripts, &next, &h).await;
                    e.fetch_add(1, Ordering::SeqCst);
                    n.notify_waiters();
                });
            }
        });
        Raw {
            addr,
            heads,
            opened,
            ended,
            ending,
        }
    }

    /// Waits until `n` connections have ended (bounded, so a failure cannot hang).
    async fn until_ended(&self, n: usize) -> bool {
        let wait = async {
            loop {
                let notified = self.ending.notified();
                if self.ended.load(Ordering::SeqCst) >= n {
                    return;
                }
                notified.await;
            }
        };
        tokio::time::timeout(Duration::from_secs(10), wait)
            .await
            .is_ok()
    }
}

async fn serve_raw(
    mut socket: TcpStream,
    scripts: &[Script],
    next: &AtomicUsize,
    heads: &Mutex<Vec<Vec<u8>>>,
) {
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
        heads
            .lock()
            .expect("heads")
            .push(read.drain(..end).collect());
        let i = next.fetch_add(1, Ordering::SeqCst).min(scripts.len() - 1);
        let script = &scripts[i];
        let mut from = 0;
        for (i, &cut) in script.cuts.iter().chain([&script.bytes.len()]).enumerate() {
            if i == 1
                && let Some(gate) = &script.gate
            {
                match gate.acquire().await {
                    Ok(permit) => permit.forget(),
                    Err(_) => return,
                }
            }
            let cut = cut.clamp(from, script.bytes.len());
            if socket.write_all(&script.bytes[from..cut]).await.is_err() {
                return;
            }
            let _ = socket.flush().await;
            tokio::task::yield_now().await;
            from = cut;
        }
        if script.close {
            return;
        }
    }
}

fn upstream_at(addr: std::net::SocketAddr, max_idle: usize, idle: Duration) -> Upstream {
    Upstream::new(
        &CompiledUpstream {
            settings: UpstreamConfig {
                url: format!("http://{addr}"),
                timeout: Duration::from_secs(5),
                pool_idle_timeout: idle,
                pool_max_idle: max_idle,
                max_in_flight: None,
                max_queued: None,
                queue_timeout: Duration::from_millis(100),
                breaker: BreakerConfig::default(),
            },
            authority: addr.to_string().parse().expect("an authority"),
        },
        0,
    )
}

fn get(upstream: &Upstream, target: &str) -> Request<UpstreamBody> {
    let mut req = Request::builder()
        .uri(upstream.uri_for_target(target).expect("uri"))
        .body(Either::Left(Empty::new()))
        .expect("request");
    let headers = req.headers_mut();
    headers.insert("x-forwarded-for", HeaderValue::from_static("192.0.2.1"));
    headers.append("accept", HeaderValue::from_static("application/json"));
    headers.append("accept", HeaderValue::from_static("*/*"));
    headers.insert("via", HeaderValue::from_static("1.1 bloomgate"));
    req
}

/// What a client made of an answer, in a form both paths can be compared in.
#[derive(Debug, PartialEq)]
enum Seen {
    Answer {
        status: u16,
        version: http::Version,
        headers: Vec<(String, Vec<u8>)>,
        reason: Option<Vec<u8>>,
        /// The body's bytes, or `None` when reading it failed.
        body: Option<Vec<u8>>,
        trailers: Option<Vec<(String, Vec<u8>)>>,
    },
    Refused,
}

fn fields(map: &http::HeaderMap) -> Vec<(String, Vec<u8>)> {
    map.iter()
        .map(|(n, v)| (n.as_str().to_owned(), v.as_bytes().to_vec()))
        .collect()
}

async fn seen(answer: Result<http::Response<AnswerBody>, UpstreamError>) -> Seen {
    let Ok(resp) = answer else {
        return Seen::Refused;
    };
    let (parts, body) = resp.into_parts();
    let reason = parts
        .extensions
        .get::<hyper::ext::ReasonPhrase>()
        .map(|r| r.as_bytes().to_vec());
    let (body, trailers) = match body.collect().await {
        Ok(all) => {
            let trailers = all.trailers().map(fields);
            (Some(all.to_bytes().to_vec()), trailers)
        }
        Err(_) => (None, None),
    };
    Seen::Answer {
        status: parts.status.as_u16(),
        version: parts.version,
        headers: fields(&parts.headers),
        reason,
        body,
        trailers,
    }
}

/// The same answer through both paths: what each saw, and the request heads the
/// upstream received from each.
async fn both(script: Script) -> ((Seen, Vec<Vec<u8>>), (Seen, Vec<Vec<u8>>)) {
    let mut out = Vec::new();
    for own in [true, false] {
        let raw = Raw::start(vec![script.clone()]).await;
        let upstream = upstream_at(raw.addr, 8, Duration::from_secs(30));
        let req = get(&upstream, "/items/7?full=1");
        let answer = if own {
            upstream.send(req).await
        } else {
            let client = &upstream.clients[upstream.home()];
            client
                .request(req)
                .await
                .map(|r| r.map(AnswerBody::Hyper))
                .map_err(UpstreamError::Request)
        };
        let seen = tokio::time::timeout(Duration::from_secs(10), seen(answer))
            .await
            .expect("the answer ends");
        // Each path has an upstream of its own: its address is the one difference.
        let addr = raw.addr.to_string();
        let heads = raw
            .heads
            .lock()
            .expect("heads")
            .iter()
            .map(|h| {
                String::from_utf8_lossy(h)
                    .replace(&addr, "UPSTREAM")
                    .into_bytes()
            })
            .collect();
        out.push((seen, heads));
    }
    let hyper = out.pop().expect("two");
    let own = out.pop().expect("two");
    (own, hyper)
}

/// hyper passes a Content-Length on beside a Transfer-Encoding; the own path drops it
/// (RFC 9112 §6.3), and is otherwise held to the same answer.
fn as_own_reads_it(mut seen: Seen) -> Seen {
    if let Seen::Answer { headers, .. } = &mut seen
        && headers.iter().any(|(n, _)| n == "transfer-encoding")
    {
        headers.retain(|(n, _)| n != "content-length");
    }
    seen
}

async fn assert_same(bytes: &[u8], cuts: Vec<usize>) {
    let script = Script::closing(bytes, cuts);
    let ((own, own_heads), (hyper, hyper_heads)) = both(script).await;
    assert!(
        own_heads == hyper_heads,
        "request heads differ: {own_heads:?} {hyper_heads:?}"
    );
    assert_eq!(
        own,
        as_own_reads_it(hyper),
        "answer read differently: {:?}",
        String::from_utf8_lossy(bytes)
    );
}

#[tokio::test]
async fn answers_of_every_framing_read_as_hyper_reads_them() {
    let cases: &[&[u8]] = &[
        b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\ncontent-type: text/plain\r\n\r\nhello",
        b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n",
        b"HTTP/1.1 204 No Content\r\n\r\n",
        b"HTTP/1.1 304 Not Modified\r\netag: \"a\"\r\ncontent-length: 12\r\n\r\n",
        b"HTTP/1.1 404 Nope\r\ncontent-length: 2\r\n\r\n{}",
        b"HTTP/1.1 599 \r\ncontent-length: 2\r\n\r\nab",
        b"HTTP/1.1 999 Odd\r\ncontent-length: 1\r\n\r\nx",
        b"HTTP/1.0 200 OK\r\ncontent-length: 3\r\n\r\nabc",
        b"HTTP/1.0 200 OK\r\n\r\nuntil the close",
        b"HTTP/1.1 200 OK\r\n\r\nuntil the close",
        b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nlink: </a>\r\n\r\nHTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok",
        b"HTTP/1.1 101 Switching Protocols\r\nupgrade: x\r\n\r\n",
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n6;ext=1\r\n world\r\n0\r\n\r\n",
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nA  \r\n0123456789\r\n0\r\nx-sum: 9\r\nx-more: a b\r\n\r\n",
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: gzip, chunked\r\ncontent-length: 99\r\n\r\n2\r\nab\r\n0\r\n\r\n",
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked, gzip\r\n\r\nraw until close",
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\nhello\r\n0\r\n\r\n",
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhelloXX0\r\n\r\n",
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nfffffffffffffffff\r\n",
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhel",
        b"HTTP/1.0 200 OK\r\ntransfer-encoding: chunked\r\n\r\n0\r\n\r\n",
        b"HTTP/1.1 200 OK\r\ncontent-length: 3, 3\r\ncontent-length: 3\r\n\r\nabc",
        b"HTTP/1.1 200 OK\r\ncontent-length: 3\r\ncontent-length: 4\r\n\r\nabcd",
        b"HTTP/1.1 200 OK\r\ncontent-length: +3\r\n\r\nabc",
        b"HTTP/1.1 200 OK\r\ncontent-length: 99999999999999999999\r\n\r\n",
        b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nshort",
        b"HTTP/1.1 200 OK\r\nconnection: keep-alive, close\r\ncontent-length: 1\r\n\r\nz",
        b"HTTP/1.1 200 OK\r\nset-cookie: a=1\r\nx-a: 1\r\nset-cookie: b=2\r\nX-Upper: V\r\nx-empty:\r\nx-spaced:   v  \r\ncontent-length: 0\r\n\r\n",
        b"HTTP/1.1 200 Caf\xe9\r\nx-obs: caf\xe9\r\ncontent-length: 0\r\n\r\n",
        b"HTTP/1.1 200 OK\ncontent-length: 2\n\nlf",
        b"HTTP/1.1 200 OK\r\nbad header\r\n\r\n",
        b"HTTP/1.1 2000 OK\r\n\r\n",
        b"HTTP/2 200 OK\r\n\r\n",
        b"garbage\r\n\r\n",
        b"",
    ];
    for case in cases {
        assert_same(case, Vec::new()).await;
        // The same bytes a few at a time.
        let cuts = (1..case.len()).step_by(3).collect();
        assert_same(case, cuts).await;
    }
}

#[tokio::test]
async fn a_head_past_the_limit_is_refused_by_both() {
    let mut bytes = b"HTTP/1.1 200 OK\r\n".to_vec();
    while bytes.len() <= wire::MAX_HEAD_BYTES {
        bytes.extend_from_slice(b"x-filler: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa\r\n");
    }
    bytes.extend_from_slice(b"content-length: 0\r\n\r\n");
    let ((own, _), (hyper, _)) = both(Script::closing(&bytes, Vec::new())).await;
    assert_eq!(own, Seen::Refused);
    assert_eq!(hyper, Seen::Refused);
}

/// An answer's parts, to be put together in any of the ways an upstream may write it.
fn answer() -> impl Strategy<Value = Vec<u8>> {
    let interim = prop::sample::select(vec![
        "",
        "HTTP/1.1 100 Continue\r\n\r\n",
        "HTTP/1.1 103 Early Hints\r\nlink: </s.css>\r\n\r\n",
    ]);
    let version = prop::sample::select(vec!["HTTP/1.1", "HTTP/1.0"]);
    let status = prop::sample::select(vec![200u16, 201, 204, 206, 304, 404, 410, 418, 503, 599]);
    let reason = prop::sample::select(vec!["", "canonical", "Fine Words", "x\tthen tab"]);
    let extra = prop::collection::vec(
        prop::sample::select(vec![
            "set-cookie: a=1",
            "set-cookie: b=2",
            "connection: close",
            "connection: keep-alive",
            "content-type: application/json",
            "x-empty:",
            "X-Case: MiXeD",
            "vary: accept",
        ]),
        0..4,
    );
    let framing = 0u8..9;
    let body = prop::collection::vec(any::<u8>(), 0..200);
    let sizes = prop::collection::vec(1usize..40, 0..6);
    (
        interim, version, status, reason, extra, framing, body, sizes,
    )
        .prop_map(
            |(interim, version, status, reason, extra, framing, body, sizes)| {
                let code = http::StatusCode::from_u16(status).expect("a status");
                let reason = match reason {
                    "canonical" => code.canonical_reason().unwrap_or(""),
                    other => other,
                };
                let mut out = format!("{interim}{version} {status} {reason}\r\n").into_bytes();
                for line in extra {
                    out.extend_from_slice(line.as_bytes());
                    out.extend_from_slice(b"\r\n");
                }
                let n = body.len();
                match framing {
                    0 => out.extend_from_slice(format!("content-length: {n}\r\n\r\n").as_bytes()),
                    1 => out
                        .extend_from_slice(format!("content-length: {n}, {n}\r\n\r\n").as_bytes()),
                    2 => out
                        .extend_from_slice(format!("content-length: {}\r\n\r\n", n + 1).as_bytes()),
                    3 => out.extend_from_slice(b"\r\n"),
                    4 => out.extend_from_slice(b"transfer-encoding: gzip\r\n\r\n"),
                    _ => {
                        let te = if framing == 8 {
                            "gzip,chunked"
                        } else {
                            "chunked"
                        };
                        out.extend_from_slice(
                            format!("transfer-encoding: {te}\r\n\r\n").as_bytes(),
                        );
                        let mut rest = &body[..];
                        for (i, size) in sizes.iter().enumerate() {
                            if rest.is_empty() {
                                break;
                            }
                            let take = (*size).min(rest.len());
                            let size_line = match (framing, i % 3) {
                                (6, 0) => format!("{take:X};name=value\r\n"),
                                (6, 1) => format!("{take:x} \t\r\n"),
                                (7, 2) => format!("{take:x}\n"),
                                _ => format!("{take:x}\r\n"),
                            };
                            out.extend_from_slice(size_line.as_bytes());
                            out.extend_from_slice(&rest[..take]);
                            out.extend_from_slice(b"\r\n");
                            rest = &rest[take..];
                        }
                        if !rest.is_empty() {
                            out.extend_from_slice(format!("{:x}\r\n", rest.len()).as_bytes());
                            out.extend_from_slice(rest);
                            out.extend_from_slice(b"\r\n");
                        }
                        out.extend_from_slice(b"0\r\n");
                        if framing == 7 {
                            out.extend_from_slice(b"x-trailer: t\r\n");
                        }
                        out.extend_from_slice(b"\r\n");
                        return out;
                    }
                }
                out.extend_from_slice(&body);
                out
            },
        )
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    /// Whatever an upstream writes, and however it cuts it, the own path reads what
    /// hyper's client reads (or refuses what it refuses).
    #[test]
    fn any_answer_reads_as_hyper_reads_it(
        bytes in answer(),
        cuts in prop::collection::vec(0usize..400, 0..5),
    ) {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        let mut cuts = cuts;
        cuts.sort_unstable();
        runtime.block_on(assert_same(&bytes, cuts));
    }
}

mod pool;
