//! The floor of bloomgate's stack on each hot path: a bare hyper 1.x server served the
//! way bloomgate's data plane serves (one single-threaded tokio runtime per core, each
//! accepting on its own `SO_REUSEPORT` listener, `TCP_NODELAY`, keep-alive, one buffer
//! per answer, mimalloc), doing one fixed thing and nothing else: no routing, no filter,
//! no cache, no metrics, no timers.
//!
//!   cargo run --release --example bare -- 404 127.0.0.1:PORT [THREADS]
//!   cargo run --release --example bare -- 200 127.0.0.1:PORT [THREADS]
//!   cargo run --release --example bare -- proxy 127.0.0.1:PORT http://UPSTREAM [THREADS]
//!
//! `404` answers every request with a refusal-sized 404 (the floor of an intercepted
//! answer); `200` with a product-sized JSON body (the floor of a cache hit: an answer
//! held in memory, sent as it is); `proxy` forwards every request to the upstream through
//! a hyper-util client per serving thread, set up as bloomgate's upstream client is (the
//! floor of a pass-through). `benches/load/versus` runs each beside nginx and bloomgate,
//! so that what bloomgate's own work costs above hyper and tokio is read off one run.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use http::header::{CONTENT_LENGTH, CONTENT_TYPE};
use http::uri::{Authority, Scheme};
use http::{HeaderValue, Request, Response, StatusCode, Uri};
use http_body_util::{Either, Full};
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};

#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// A body the size of bloomgate's refusal.
const REFUSAL: &[u8] = br#"{"error":"not_found","message":"no such key"}"#;

/// A body the size of a demo product's (the answer bloomgate caches for it).
const PRODUCT: &[u8] =
    br#"{"sku_id":5,"name":"Product 5","price":"10.49","updated_at":"2026-12-04T00:00:00Z"}"#;

const USAGE: &str =
    "usage: bare 404|200 ADDR [THREADS] | bare proxy ADDR http://UPSTREAM [THREADS]";

/// What every connection of one run does with a request.
#[derive(Clone)]
enum Mode {
    /// A fixed answer: status and body.
    Fixed(StatusCode, &'static [u8]),
    /// Forwards to the upstream at this authority.
    Proxy(Authority),
}

fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let mut next = |what: &str| {
        args.next()
            .ok_or_else(|| anyhow::anyhow!("{what} missing; {USAGE}"))
    };
    let mode = next("the mode")?;
    let addr: SocketAddr = next("the address")?.parse()?;
    let mode = match mode.as_str() {
        "404" => Mode::Fixed(StatusCode::NOT_FOUND, REFUSAL),
        "200" => Mode::Fixed(StatusCode::OK, PRODUCT),
        "proxy" => {
            let upstream: Uri = next("the upstream URL")?.parse()?;
            anyhow::ensure!(
                upstream.scheme() == Some(&Scheme::HTTP),
                "the upstream must be http://"
            );
            let authority = upstream
                .authority()
                .cloned()
                .ok_or_else(|| anyhow::anyhow!("the upstream URL names no host"))?;
            Mode::Proxy(authority)
        }
        other => anyhow::bail!("unknown mode {other}; {USAGE}"),
    };
    let threads: usize = match next("") {
        Ok(n) => n.parse()?,
        Err(_) => std::thread::available_parallelism().map_or(1, usize::from),
    };
    let listeners = bind(addr, threads)?;
    let handles: Vec<_> = listeners
        .into_iter()
        .map(|listener| {
            let mode = mode.clone();
            std::thread::spawn(move || serve(listener, mode))
        })
        .collect();
    for handle in handles {
        handle
            .join()
            .map_err(|_| anyhow::anyhow!("a serving thread panicked"))??;
    }
    Ok(())
}

/// `threads` listeners on `addr` sharing it with `SO_REUSEPORT` (port 0: the first picks).
fn bind(addr: SocketAddr, threads: usize) -> anyhow::Result<Vec<std::net::TcpListener>> {
    let mut bound = Vec::new();
    let mut at = addr;
    for _ in 0..threads.max(1) {
        let domain = socket2::Domain::for_address(at);
        let socket = socket2::Socket::new(domain, socket2::Type::STREAM, None)?;
        socket.set_reuse_address(true)?;
        socket.set_reuse_port(true)?;
        socket.set_nonblocking(true)?;
        socket.bind(&at.into())?;
        socket.listen(1024)?;
        let listener: std::net::TcpListener = socket.into();
        if bound.is_empty() {
            at = listener.local_addr()?;
        }
        bound.push(listener);
    }
    println!("listening on {at}");
    Ok(bound)
}

type Body = Either<Full<Bytes>, Incoming>;

/// The thread's upstream client, as bloomgate's upstream client is built.
fn client() -> Client<HttpConnector, Incoming> {
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    connector.set_keepalive(Some(Duration::from_secs(60)));
    Client::builder(TokioExecutor::new())
        .pool_idle_timeout(Duration::from_secs(90))
        .pool_max_idle_per_host(256)
        .pool_timer(TokioTimer::new())
        .timer(TokioTimer::new())
        .build(connector)
}

/// A fixed answer.
fn fixed(status: StatusCode, body: &'static [u8]) -> Response<Body> {
    let mut resp = Response::new(Either::Left(Full::new(Bytes::from_static(body))));
    *resp.status_mut() = status;
    let headers = resp.headers_mut();
    headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    headers.insert(CONTENT_LENGTH, HeaderValue::from(body.len()));
    resp
}

/// `req` forwarded to the upstream at `authority`, and its answer.
async fn forward(
    client: Client<HttpConnector, Incoming>,
    authority: Authority,
    req: Request<Incoming>,
) -> Result<Response<Body>, Infallible> {
    let (mut parts, body) = req.into_parts();
    let mut uri = std::mem::take(&mut parts.uri).into_parts();
    uri.scheme = Some(Scheme::HTTP);
    uri.authority = Some(authority);
    parts.uri = Uri::from_parts(uri).unwrap_or_default();
    match client.request(Request::from_parts(parts, body)).await {
        Ok(resp) => Ok(resp.map(Either::Right)),
        Err(_) => Ok(fixed(StatusCode::BAD_GATEWAY, b"")),
    }
}

fn serve(listener: std::net::TcpListener, mode: Mode) -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async move {
        // Built on the thread that serves with it: its connections are driven here.
        let client = client();
        let listener = tokio::net::TcpListener::from_std(listener)?;
        loop {
            let (stream, _) = listener.accept().await?;
            stream.set_nodelay(true)?;
            let io = TokioIo::new(stream);
            let http = http1::Builder::new().writev(false).clone();
            match mode.clone() {
                Mode::Fixed(status, body) => tokio::spawn(async move {
                    let service = service_fn(move |_req: Request<Incoming>| async move {
                        Ok::<_, Infallible>(fixed(status, body))
                    });
                    let _ = http.serve_connection(io, service).await;
                }),
                Mode::Proxy(authority) => {
                    let client = client.clone();
                    tokio::spawn(async move {
                        let service =
                            service_fn(move |req| forward(client.clone(), authority.clone(), req));
                        let _ = http.serve_connection(io, service).await;
                    })
                }
            };
        }
    })
}
