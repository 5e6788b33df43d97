//! One accepted connection, from its TLS handshake or protocol detection to its end:
//! what every connection of a listener shares ([`Listener`]: the handler, the HTTP/1.1
//! and HTTP/2 builders with their head limits and timeouts), the hand-off to HTTP/1.1 or
//! HTTP/2 (ALPN on TLS, the preface in cleartext), an HTTP/1.1 connection's start in
//! the server's own loop (`direct`) and its hand-off to hyper, the service that answers
//! at once what needs no waiting and puts a [`ConnectionInfo`] in each request that
//! waits, and the watch that closes the connection gracefully on shutdown or when it
//! sits idle. Accepting and the bound on open connections are the parent's.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::pin::pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::Poll;
use std::time::Duration;

use bytes::BytesMut;
use futures_util::future;
use http::{Request, Response};
use http_body_util::Either;
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulConnection;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;
use tokio::sync::{OwnedSemaphorePermit, watch};

use super::direct::{self, Handoff, Limits};
use super::long_target::{ServedBody, refuse_long_target};
use super::metrics::HandshakeFailure;
use super::signal::Signal;
use super::sniff::{self, Prefixed, Spoken};
use super::tls::{self, Tls};
use super::{ConnectionInfo, ConnectionMetrics, Handler, Protocol, ServeOptions, Transport};
use bloomgate_core::report::Chain;

/// What every connection of a listener shares.
pub(super) struct Listener<H> {
    /// Shared by every listener of the plane (the pipeline and its state are one).
    handler: Arc<H>,
    /// The listener's limits and timeouts (the accept loop reads the grace period).
    pub(super) options: ServeOptions,
    /// TLS and connection metrics (the accept loop counts accepted and refused ones).
    pub(super) transport: Transport,
    http1: hyper::server::conn::http1::Builder,
    http2: hyper::server::conn::http2::Builder<TokioExecutor>,
    /// The listener's name in logs ("data", "admin").
    pub(super) name: &'static str,
}

// By hand: a derived `Clone` would ask `H: Clone`, where only the `Arc` is cloned.
impl<H> Clone for Listener<H> {
    fn clone(&self) -> Self {
        Listener {
            handler: Arc::clone(&self.handler),
            options: self.options,
            transport: self.transport.clone(),
            http1: self.http1.clone(),
            http2: self.http2.clone(),
            name: self.name,
        }
    }
}

impl<H: Handler> Listener<H> {
    pub(super) fn new(
        handler: Arc<H>,
        options: ServeOptions,
        transport: Transport,
        name: &'static str,
    ) -> Listener<H> {
        Listener {
            handler,
            options,
            http1: http1_builder(&options),
            http2: http2_builder(&options),
            transport,
            name,
        }
    }

    fn handshake_failed(&self, why: HandshakeFailure) {
        if let Some(m) = &self.transport.metrics {
            m.handshake_failed(why);
        }
    }

    fn served(&self, info: ConnectionInfo) {
        if let Some(m) = &self.transport.metrics {
            m.served(info.protocol.as_str(), info.tls);
        }
    }
}

/// One connection, from TLS handshake or protocol detection to its end; it holds `slot`
/// throughout.
pub(super) async fn run<H: Handler>(
    shared: Arc<Listener<H>>,
    stream: TcpStream,
    peer: SocketAddr,
    slot: (OwnedSemaphorePermit, OwnedSemaphorePermit),
    mut shutdown: watch::Receiver<bool>,
) {
    let _slot = slot;
    let _open = shared
        .transport
        .metrics
        .as_ref()
        .map(ConnectionMetrics::open);
    let options = shared.options;
    let name = shared.name;
    // The TLS and HTTP/2 paths are boxed: this future is the connection's task, kept for
    // as long as the connection is open, and inlined they made a cleartext HTTP/1.1
    // connection's task 10 KB (docs/BENCHMARKS.md).
    if let Some(tls) = &shared.transport.tls {
        let served = Box::pin(serve_tls(&shared, tls, stream, peer, shutdown));
        served.await;
        return;
    }
    if !options.http2 {
        serve_http1(&shared, stream, peer, false, shutdown).await;
        return;
    }
    let sniffed = tokio::select! {
        done = tokio::time::timeout(options.header_read_timeout, sniff::sniff(stream)) => done,
        _ = shutdown.wait_for(|stop| *stop) => return,
    };
    match sniffed {
        Ok(Ok((Spoken::Http2, io))) => {
            let served = Box::pin(serve_http2(
                &shared,
                TokioIo::new(io),
                peer,
                Protocol::H2c,
                false,
                shutdown,
            ));
            served.await;
        }
        Ok(Ok((Spoken::Http1, io))) => {
            serve_http1(&shared, io, peer, false, shutdown).await;
        }
        Ok(Err(e)) => {
            tracing::debug!(listener = name, %peer, error = %Chain(&e), "connection closed before a request");
        }
        Err(_) => {
            tracing::debug!(listener = name, %peer, "no request within the header read timeout");
        }
    }
}

/// A TLS connection: the handshake (bounded by `header_read_timeout`), then HTTP/2 or
/// HTTP/1.1 as ALPN chose.
async fn serve_tls<H: Handler>(
    shared: &Arc<Listener<H>>,
    tls: &Tls,
    stream: TcpStream,
    peer: SocketAddr,
    mut shutdown: watch::Receiver<bool>,
) {
    let (options, name) = (shared.options, shared.name);
    let handshake =
        tokio::time::timeout(options.header_read_timeout, tls.acceptor().accept(stream));
    let handshake = tokio::select! {
        done = handshake => done,
        _ = shutdown.wait_for(|stop| *stop) => return,
    };
    let stream = match handshake {
        Ok(Ok(stream)) => stream,
        Ok(Err(e)) => {
            // Scanners and old clients fail handshakes all day: debug, and counted.
            shared.handshake_failed(HandshakeFailure::Error);
            tracing::debug!(listener = name, %peer, error = %Chain(&e), "TLS handshake failed");
            return;
        }
        Err(_) => {
            shared.handshake_failed(HandshakeFailure::Timeout);
            tracing::debug!(listener = name, %peer, "TLS handshake timed out");
            return;
        }
    };
    let h2 = stream.get_ref().1.alpn_protocol() == Some(tls::ALPN_H2);
    if h2 && options.http2 {
        serve_http2(
            shared,
            TokioIo::new(stream),
            peer,
            Protocol::H2,
            true,
            shutdown,
        )
        .await;
    } else {
        serve_http1(shared, stream, peer, true, shutdown).await;
    }
}

/// An HTTP/1.1 connection: plain `GET`s are read and answered by the server's own loop
/// (see `direct`) until the first request that hyper must read; from that one on,
/// hyper serves it.
async fn serve_http1<H, T>(
    shared: &Arc<Listener<H>>,
    mut io: T,
    peer: SocketAddr,
    tls: bool,
    mut shutdown: watch::Receiver<bool>,
) where
    H: Handler,
    T: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let info = ConnectionInfo {
        protocol: Protocol::Http1,
        tls,
    };
    shared.served(info);
    let closing = pin!(async move {
        let _ = shutdown.wait_for(|stop| *stop).await;
    });
    let mut closing = Signal::new(closing);
    let handoff = if H::ANSWERS_AT_ONCE {
        let limits = Limits {
            head: head_limit(&shared.options),
            target: shared.options.max_uri_bytes,
            header_read: shared.options.header_read_timeout,
        };
        let served = direct::serve(
            &*shared.handler,
            &mut io,
            peer,
            info,
            limits,
            &mut closing,
            shared.name,
        );
        match served.await {
            Some(handoff) => handoff,
            None => return,
        }
    } else {
        Handoff {
            read: BytesMut::new(),
            answered: None,
        }
    };
    let service = service(Arc::clone(shared), peer, info, None, handoff.answered);
    let io = TokioIo::new(Prefixed::new(handoff.read, io));
    let conn = shared.http1.serve_connection(io, service);
    // hyper closes an HTTP/1.1 connection idle past header_read_timeout itself.
    drive(conn, &mut closing, shared.name, peer).await;
}

async fn serve_http2<H, I>(
    shared: &Arc<Listener<H>>,
    io: I,
    peer: SocketAddr,
    protocol: Protocol,
    tls: bool,
    mut shutdown: watch::Receiver<bool>,
) where
    H: Handler,
    I: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
{
    let info = ConnectionInfo { protocol, tls };
    shared.served(info);
    let (busy, idle) = watch::channel(0usize);
    let service = service(Arc::clone(shared), peer, info, Some(Arc::new(busy)), None);
    let conn = shared.http2.serve_connection(io, service);
    let (limit, name) = (shared.options.header_read_timeout, shared.name);
    let closing = pin!(async move {
        tokio::select! {
            _ = shutdown.wait_for(|stop| *stop) => {}
            _ = idle_for(idle, limit) => {
                tracing::debug!(listener = name, %peer, "idle connection: closing");
            }
        }
    });
    drive(conn, &mut Signal::new(closing), name, peer).await;
}

/// Runs `conn` to its end. When `closing` fires (shutdown began, or an HTTP/2
/// connection sat idle), it is asked to finish gracefully: HTTP/1.1 closes after the
/// response in progress, HTTP/2 sends GOAWAY and lets its open streams finish.
async fn drive<C>(conn: C, closing: &mut Signal<'_>, name: &'static str, peer: SocketAddr)
where
    C: GracefulConnection<Error: Into<Box<dyn std::error::Error + Send + Sync>>>,
{
    let mut conn = pin!(conn);
    let first = std::future::poll_fn(|cx| {
        if closing.poll_fired(cx) {
            return Poll::Ready(None);
        }
        conn.as_mut().poll(cx).map(Some)
    })
    .await;
    let ended = match first {
        Some(ended) => ended,
        None => {
            conn.as_mut().graceful_shutdown();
            conn.await
        }
    };
    if let Err(e) = ended {
        let e = e.into();
        tracing::debug!(listener = name, %peer, error = %Chain(&*e), "connection ended with an error");
    }
}

/// Resolves once no request has been in flight for `limit`.
async fn idle_for(mut in_flight: watch::Receiver<usize>, limit: Duration) {
    loop {
        let busy = *in_flight.borrow_and_update() > 0;
        if busy {
            if in_flight.changed().await.is_err() {
                return std::future::pending().await;
            }
        } else if let Ok(changed) = tokio::time::timeout(limit, in_flight.changed()).await {
            if changed.is_err() {
                return std::future::pending().await;
            }
        } else {
            return;
        }
    }
}

/// One request in flight on an HTTP/2 connection, for as long as this lives.
struct InFlight(Arc<watch::Sender<usize>>);

impl InFlight {
    fn start(count: &Arc<watch::Sender<usize>>) -> InFlight {
        count.send_modify(|n| *n += 1);
        InFlight(Arc::clone(count))
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.send_modify(|n| *n = n.saturating_sub(1));
    }
}

/// The service of one connection: the target-length limit, then the handler, with
/// `info` in the request's extensions. With `in_flight`, each request that waits is
/// counted there until its response head is ready. `first`, when there is one, is the
/// answer to the first request, made before the connection was handed to hyper.
///
/// What the handler answers at once ([`Handler::answer_now`]) is returned as a ready
/// future of a response: hyper moves each request's future into its slot, and the
/// handler's future for a request that waits is thousands of bytes, so it is boxed and
/// the slot holds a pointer.
fn service<H: Handler>(
    shared: Arc<Listener<H>>,
    peer: SocketAddr,
    info: ConnectionInfo,
    in_flight: Option<Arc<watch::Sender<usize>>>,
    first: Option<Response<H::Body>>,
) -> impl hyper::service::Service<
    Request<Incoming>,
    Response = Response<ServedBody<H::Body>>,
    Error = Infallible,
    Future: Send + 'static,
> + Send
+ 'static {
    let first = first.map(|resp| Mutex::new(Some(resp)));
    service_fn(move |mut req: Request<Incoming>| {
        let made = first.as_ref().and_then(|first| {
            let resp = first
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .take()?;
            Some(resp.map(Either::Right))
        });
        if let Some(made) = made {
            return future::Either::Left(std::future::ready(Ok::<_, Infallible>(made)));
        }
        // Short-circuit: an over-long target never reaches routing.
        let now =
            refuse_long_target(&req, shared.options.max_uri_bytes, shared.name).or_else(|| {
                let answered = shared.handler.answer_now(&req, peer)?;
                Some(answered.map(Either::Right))
            });
        if let Some(answered) = now {
            return future::Either::Left(std::future::ready(Ok::<_, Infallible>(answered)));
        }
        let shared = Arc::clone(&shared);
        let counted = in_flight.as_ref().map(InFlight::start);
        req.extensions_mut().insert(info);
        future::Either::Right(Box::pin(async move {
            let _counted = counted;
            Ok(shared.handler.call(req, peer).await.map(Either::Right))
        }))
    })
}

/// The HTTP/1.1 settings every connection of a listener shares.
fn http1_builder(options: &ServeOptions) -> hyper::server::conn::http1::Builder {
    let head_limit = head_limit(options);
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(options.header_read_timeout)
        .keep_alive(true)
        // A client may send its request and shut down its write side (FIN) while it
        // waits: keep the connection until the answer is written.
        .half_close(true)
        // The head is refused with 431 once it is larger than this, counted exactly
        // (request line, header lines, blank line), before anything is handed over...
        .max_header_size(head_limit)
        // ...and no more than this is ever buffered while reading it.
        .max_buf_size(head_limit)
        // One buffer and one write(2) per answer instead of writev(2) over head and
        // body: the answers on the hot paths are a few hundred bytes, and copying them
        // costs less than the vectored call (docs/BENCHMARKS.md: 3-5% more refusals
        // and cache hits per second, same run). A large streamed body is copied through
        // the buffer at most `max_buf_size` bytes at a time.
        .writev(false);
    builder
}

/// The largest HTTP/1.1 request head read: `max_header_bytes`, at least hyper's minimum
/// buffer (config validation refuses less; this guards other callers).
fn head_limit(options: &ServeOptions) -> usize {
    options.max_header_bytes.max(8192)
}

/// The HTTP/2 settings every connection of a listener shares.
fn http2_builder(options: &ServeOptions) -> hyper::server::conn::http2::Builder<TokioExecutor> {
    let mut builder = hyper::server::conn::http2::Builder::new(TokioExecutor::new());
    builder
        .timer(TokioTimer::new())
        .max_concurrent_streams(options.http2_max_concurrent_streams)
        // Advertised in SETTINGS; a larger header block gets 431 from h2.
        .max_header_list_size(u32::try_from(options.max_header_bytes).unwrap_or(u32::MAX))
        // A peer that stops answering pings is gone: close its connection.
        .keep_alive_interval(options.header_read_timeout)
        .keep_alive_timeout(options.header_read_timeout);
    builder
}
