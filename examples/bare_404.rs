//! The floor of bloomgate's stack for a refusal: a bare hyper 1.x server that answers
//! every request with the same small 404, served the way bloomgate's data plane serves
//! (one single-threaded tokio runtime per core, each accepting on its own `SO_REUSEPORT`
//! listener, `TCP_NODELAY`, keep-alive, one buffer per answer, mimalloc), and nothing
//! else: no routing, no filter, no metrics, no timers.
//!
//!   cargo run --release --example bare_404 -- 127.0.0.1:PORT [THREADS]
//!
//! `benches/load/versus` runs it beside nginx `return 404` and bloomgate's intercepted
//! answer, so that what bloomgate's own work costs above hyper and tokio is read off one
//! run: bloomgate against this server, and this server against nginx.

use std::convert::Infallible;
use std::net::SocketAddr;

use bytes::Bytes;
use http::header::{CONTENT_LENGTH, CONTENT_TYPE};
use http::{HeaderValue, Response, StatusCode};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;

#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// A body the size of bloomgate's refusal.
const BODY: &[u8] = br#"{"error":"not_found","message":"no such key"}"#;

fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let addr: SocketAddr = args
        .next()
        .ok_or_else(|| anyhow::anyhow!("usage: bare_404 ADDR [THREADS]"))?
        .parse()?;
    let threads: usize = match args.next() {
        Some(n) => n.parse()?,
        None => std::thread::available_parallelism().map_or(1, usize::from),
    };
    let listeners = bind(addr, threads)?;
    let handles: Vec<_> = listeners
        .into_iter()
        .map(|listener| std::thread::spawn(move || serve(listener)))
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

fn serve(listener: std::net::TcpListener) -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async move {
        let listener = tokio::net::TcpListener::from_std(listener)?;
        loop {
            let (stream, _) = listener.accept().await?;
            stream.set_nodelay(true)?;
            tokio::spawn(async move {
                let service = service_fn(|_req: http::Request<Incoming>| async {
                    let mut resp = Response::new(Full::new(Bytes::from_static(BODY)));
                    *resp.status_mut() = StatusCode::NOT_FOUND;
                    let headers = resp.headers_mut();
                    headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
                    headers.insert(CONTENT_LENGTH, HeaderValue::from(BODY.len()));
                    Ok::<_, Infallible>(resp)
                });
                let _ = http1::Builder::new()
                    .writev(false)
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    })
}
