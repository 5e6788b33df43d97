//! Serving HTTP on listeners that are handed in: the accept loop and the bound on open
//! connections, one listener per serving thread (`SO_REUSEPORT`, [`serve_per_core`]) or
//! one on a shared runtime ([`serve`]), TLS termination (`tls`, `cert`), the protocol of
//! each connection (HTTP/1.1; HTTP/2 by ALPN on TLS or by its preface in cleartext,
//! `sniff`), the limits on a request head (read timeout, size, target length),
//! half-closed connections, idle connections, and graceful shutdown (stop accepting, let
//! in-flight requests finish within a grace period; HTTP/2 clients get a GOAWAY). Each
//! request reaches the handler the same whatever the protocol and thread, with a
//! [`ConnectionInfo`] in its extensions. It knows nothing about what the handler does.

pub mod metrics;
mod per_core;
mod sniff;
pub mod tls;

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::header::{CONNECTION, CONTENT_TYPE};
use http::{HeaderValue, Request, Response, StatusCode, Version};
use http_body::Body;
use http_body_util::{Either, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulConnection;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, watch};

pub use metrics::ConnectionMetrics;
pub use per_core::{ServingRuntimes, bind_reuseport, serve_per_core};
pub use tls::Tls;

use metrics::HandshakeFailure;
use sniff::Spoken;

/// Something that answers requests.
pub trait Handler: Send + Sync + 'static {
    /// The response body type.
    type Body: Body<Data = bytes::Bytes, Error: Into<Box<dyn std::error::Error + Send + Sync>>>
        + Send
        + 'static;
    /// Answers one request from `peer`.
    fn call(
        &self,
        req: Request<Incoming>,
        peer: SocketAddr,
    ) -> impl Future<Output = Response<Self::Body>> + Send;
}

/// Settings of one listener.
#[derive(Debug, Clone, Copy)]
pub struct ServeOptions {
    /// Time a client has to send a request head, and to finish a TLS handshake; an
    /// HTTP/1.1 connection idle this long between requests is closed, an HTTP/2
    /// connection with no request this long is sent a GOAWAY, and one whose client does
    /// not answer a ping within this long is closed.
    pub header_read_timeout: Duration,
    /// Time in-flight requests get after shutdown begins.
    pub grace: Duration,
    /// Largest request head (request line, headers, blank line) read; a larger one is
    /// answered 431 by hyper and the connection closed. At least 8192. On HTTP/2 it is
    /// the advertised `SETTINGS_MAX_HEADER_LIST_SIZE` (which counts 32 bytes more per
    /// header field).
    pub max_header_bytes: usize,
    /// Longest request target (path and query) handed to the handler; a longer one is
    /// answered 414 here (and an HTTP/1.1 connection closed).
    pub max_uri_bytes: usize,
    /// Serve HTTP/2: h2 by ALPN on TLS, h2c by its preface in cleartext.
    pub http2: bool,
    /// Most connections open at once; past it a new one is accepted and closed at once.
    pub max_connections: usize,
    /// Most concurrent streams per HTTP/2 connection, advertised in SETTINGS.
    pub http2_max_concurrent_streams: u32,
}

impl Default for ServeOptions {
    /// The data plane's defaults (see `ServerConfig`).
    fn default() -> Self {
        ServeOptions {
            header_read_timeout: Duration::from_secs(10),
            grace: Duration::from_secs(10),
            max_header_bytes: 16 * 1024,
            max_uri_bytes: 8 * 1024,
            http2: true,
            max_connections: 10_000,
            http2_max_concurrent_streams: 128,
        }
    }
}

/// What a listener adds to plain TCP: TLS termination, and the metrics its connections
/// are counted in. The default is neither.
#[derive(Clone, Default)]
pub struct Transport {
    /// Terminate TLS on every connection.
    pub tls: Option<Arc<Tls>>,
    /// Count connections here.
    pub metrics: Option<ConnectionMetrics>,
    /// Where [`serve_per_core`] records its threads' runtimes.
    pub runtimes: ServingRuntimes,
}

/// The protocol of a connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Protocol {
    /// HTTP/1.1 (or 1.0), cleartext or TLS.
    Http1,
    /// HTTP/2 over TLS, chosen by ALPN.
    H2,
    /// HTTP/2 in cleartext with prior knowledge.
    H2c,
}

impl Protocol {
    /// The name used in metric labels and logs.
    pub fn as_str(self) -> &'static str {
        match self {
            Protocol::Http1 => "http1",
            Protocol::H2 => "h2",
            Protocol::H2c => "h2c",
        }
    }
}

/// How a request reached the server; in the extensions of every request the handler
/// gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnectionInfo {
    /// The connection's protocol.
    pub protocol: Protocol,
    /// Whether TLS carried it (bloomgate terminated it).
    pub tls: bool,
}

/// What a connection answers with: a refusal made here, or the handler's response.
type ServedBody<B> = Either<Full<Bytes>, B>;

/// What every connection of a listener shares.
struct Listener<H> {
    /// Shared by every listener of the plane (the pipeline and its state are one).
    handler: Arc<H>,
    options: ServeOptions,
    transport: Transport,
    http1: hyper::server::conn::http1::Builder,
    http2: hyper::server::conn::http2::Builder<TokioExecutor>,
    name: &'static str,
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

/// The bound on a plane's open connections, shared by all of its listeners: one
/// permit a connection, taken at accept (one atomic operation per connection, none per
/// request).
#[derive(Clone)]
pub struct ConnectionSlots {
    semaphore: Arc<Semaphore>,
    limit: usize,
}

impl ConnectionSlots {
    /// Room for `max_connections` (at least 1, at most what a semaphore counts).
    pub fn new(max_connections: usize) -> ConnectionSlots {
        // Draining waits for a listener's slots at once, which a semaphore counts in a u32.
        let limit = max_connections
            .clamp(1, u32::MAX as usize)
            .min(Semaphore::MAX_PERMITS);
        ConnectionSlots {
            semaphore: Arc::new(Semaphore::new(limit)),
            limit,
        }
    }
}

/// Accepts connections until `shutdown` turns true, then drains. Returns the number of
/// connections that were still open when the grace period ran out.
pub async fn serve<H: Handler>(
    listener: TcpListener,
    handler: Arc<H>,
    options: ServeOptions,
    transport: Transport,
    shutdown: watch::Receiver<bool>,
    name: &'static str,
) -> usize {
    let slots = ConnectionSlots::new(options.max_connections);
    let shared = Arc::new(Listener::new(handler, options, transport, name));
    accept_loop(listener, shared, slots, shutdown, "shared").await
}

/// Accepts on `listener` until `shutdown` turns true, then waits (within the grace
/// period) for the connections it accepted. Returns how many were still open then.
/// `thread` names the serving thread in metrics.
async fn accept_loop<H: Handler>(
    listener: TcpListener,
    shared: Arc<Listener<H>>,
    slots: ConnectionSlots,
    mut shutdown: watch::Receiver<bool>,
    thread: &str,
) -> usize {
    let name = shared.name;
    let limit = slots.limit;
    let counted = shared
        .transport
        .metrics
        .as_ref()
        .map(|m| m.accepted_by(thread));
    // This listener's own connections, for draining; the plane's bound is `slots`.
    let mine = Arc::new(Semaphore::new(limit));
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            _ = shutdown.wait_for(|stop| *stop) => break,
        };
        let (stream, peer) = match accepted {
            Ok(pair) => pair,
            Err(e) => {
                // Usually EMFILE or a reset during accept: back off briefly and go on.
                tracing::warn!(listener = name, error = %e, "accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let (Ok(slot), Ok(own)) = (
            Arc::clone(&slots.semaphore).try_acquire_owned(),
            Arc::clone(&mine).try_acquire_owned(),
        ) else {
            // Every slot is taken. Closing at once tells the client (or the load
            // balancer) to go elsewhere now; leaving it in the backlog would make it
            // wait for its own timeout while the kernel queue fills.
            drop(stream);
            if let Some(m) = &shared.transport.metrics {
                m.refused();
            }
            tracing::debug!(listener = name, %peer, max_connections = limit,
                "connection refused: too many open");
            continue;
        };
        if let Some(counted) = &counted {
            counted.inc();
        }
        if let Err(e) = stream.set_nodelay(true) {
            tracing::debug!(listener = name, error = %e, "cannot set TCP_NODELAY");
        }
        tokio::spawn(connection(
            Arc::clone(&shared),
            stream,
            peer,
            (slot, own),
            shutdown.clone(),
        ));
    }
    drop(listener);
    let open = |slots: &Semaphore| limit - slots.available_permits();
    tracing::info!(
        listener = name,
        thread,
        open_connections = open(&mine),
        "stopped accepting; draining"
    );
    let all = u32::try_from(limit).unwrap_or(u32::MAX);
    match tokio::time::timeout(shared.options.grace, mine.acquire_many(all)).await {
        Ok(_) => 0,
        Err(_) => {
            let left = open(&mine);
            tracing::warn!(
                listener = name,
                grace_ms = shared.options.grace.as_millis() as u64,
                open_connections = left,
                "grace period over; closing remaining connections"
            );
            left
        }
    }
}

/// One connection, from TLS handshake or protocol detection to its end; it holds `slot`
/// throughout.
async fn connection<H: Handler>(
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
        serve_http1(&shared, TokioIo::new(stream), peer, false, shutdown).await;
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
            serve_http1(&shared, TokioIo::new(io), peer, false, shutdown).await;
        }
        Ok(Err(e)) => {
            tracing::debug!(listener = name, %peer, error = %e, "connection closed before a request");
        }
        Err(_) => {
            tracing::debug!(listener = name, %peer, "no request within the header read timeout");
        }
    }
}

impl<H: Handler> Listener<H> {
    fn new(
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
            tracing::debug!(listener = name, %peer, error = %e, "TLS handshake failed");
            return;
        }
        Err(_) => {
            shared.handshake_failed(HandshakeFailure::Timeout);
            tracing::debug!(listener = name, %peer, "TLS handshake timed out");
            return;
        }
    };
    let h2 = stream.get_ref().1.alpn_protocol() == Some(tls::ALPN_H2);
    let io = TokioIo::new(stream);
    if h2 && options.http2 {
        serve_http2(shared, io, peer, Protocol::H2, true, shutdown).await;
    } else {
        serve_http1(shared, io, peer, true, shutdown).await;
    }
}

async fn serve_http1<H, I>(
    shared: &Arc<Listener<H>>,
    io: I,
    peer: SocketAddr,
    tls: bool,
    shutdown: watch::Receiver<bool>,
) where
    H: Handler,
    I: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
{
    let info = ConnectionInfo {
        protocol: Protocol::Http1,
        tls,
    };
    shared.served(info);
    let service = service(Arc::clone(shared), peer, info, None);
    let conn = shared.http1.serve_connection(io, service);
    // hyper closes an HTTP/1.1 connection idle past header_read_timeout itself.
    drive(conn, shutdown, None, shared.name, peer).await;
}

async fn serve_http2<H, I>(
    shared: &Arc<Listener<H>>,
    io: I,
    peer: SocketAddr,
    protocol: Protocol,
    tls: bool,
    shutdown: watch::Receiver<bool>,
) where
    H: Handler,
    I: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
{
    let info = ConnectionInfo { protocol, tls };
    shared.served(info);
    let (busy, idle) = watch::channel(0usize);
    let service = service(Arc::clone(shared), peer, info, Some(Arc::new(busy)));
    let conn = shared.http2.serve_connection(io, service);
    let idle = Some((idle, shared.options.header_read_timeout));
    drive(conn, shutdown, idle, shared.name, peer).await;
}

/// Runs `conn` to its end. When shutdown begins, or (`idle`) no request has been in
/// flight for the given time, it is asked to finish gracefully: HTTP/1.1 closes after
/// the response in progress, HTTP/2 sends GOAWAY and lets its open streams finish.
async fn drive<C>(
    conn: C,
    mut shutdown: watch::Receiver<bool>,
    idle: Option<(watch::Receiver<usize>, Duration)>,
    name: &'static str,
    peer: SocketAddr,
) where
    C: GracefulConnection<Error: std::fmt::Display>,
{
    tokio::pin!(conn);
    let closing = async {
        tokio::select! {
            _ = shutdown.wait_for(|stop| *stop) => {}
            _ = idle_for(idle) => {
                tracing::debug!(listener = name, %peer, "idle connection: closing");
            }
        }
    };
    let ended = tokio::select! {
        ended = conn.as_mut() => ended,
        _ = closing => {
            conn.as_mut().graceful_shutdown();
            conn.await
        }
    };
    if let Err(e) = ended {
        tracing::debug!(listener = name, %peer, error = %e, "connection ended with an error");
    }
}

/// Resolves once no request has been in flight for the given time; never without one.
async fn idle_for(idle: Option<(watch::Receiver<usize>, Duration)>) {
    let Some((mut in_flight, limit)) = idle else {
        return std::future::pending().await;
    };
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
/// `info` in the request's extensions. With `in_flight`, each request is counted there
/// until its response head is ready.
fn service<H: Handler>(
    shared: Arc<Listener<H>>,
    peer: SocketAddr,
    info: ConnectionInfo,
    in_flight: Option<Arc<watch::Sender<usize>>>,
) -> impl hyper::service::Service<
    Request<Incoming>,
    Response = Response<ServedBody<H::Body>>,
    Error = Infallible,
    Future: Send + 'static,
> + Send
+ 'static {
    service_fn(move |mut req: Request<Incoming>| {
        let shared = Arc::clone(&shared);
        let counted = in_flight.as_ref().map(InFlight::start);
        async move {
            let _counted = counted;
            // Short-circuit: an over-long target never reaches routing.
            if let Some(refused) =
                refuse_long_target(&req, shared.options.max_uri_bytes, shared.name)
            {
                return Ok::<_, Infallible>(refused);
            }
            req.extensions_mut().insert(info);
            Ok(shared.handler.call(req, peer).await.map(Either::Right))
        }
    })
}

/// The HTTP/1.1 settings every connection of a listener shares.
fn http1_builder(options: &ServeOptions) -> hyper::server::conn::http1::Builder {
    // hyper's minimum buffer; config validation refuses less, this guards other callers.
    let head_limit = options.max_header_bytes.max(8192);
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

/// A request target (path and query) longer than `server.max_uri_bytes`: answered 414
/// by the server itself, before any handler sees the request.
#[derive(Debug, thiserror::Error)]
#[error("the request target is {len} bytes long; at most {limit} are accepted")]
struct UriTooLong {
    /// Length of the path and query received.
    len: usize,
    /// The configured limit.
    limit: usize,
}

impl UriTooLong {
    /// The error code of its JSON body, as every data-plane refusal carries one.
    const CODE: &'static str = "uri_too_long";
}

/// The 414 for a request whose target (path and query) is longer than `limit`, or
/// `None` when it fits. An HTTP/1.1 connection is closed after the answer; HTTP/2 has no
/// connection header, and only the stream ends.
fn refuse_long_target<B>(
    req: &Request<Incoming>,
    limit: usize,
    listener: &'static str,
) -> Option<Response<ServedBody<B>>> {
    let len = req.uri().path_and_query().map_or(0, |pq| pq.as_str().len());
    if len <= limit {
        return None;
    }
    let error = UriTooLong { len, limit };
    tracing::debug!(route = listener, code = UriTooLong::CODE, error = %error, "request refused");
    let body = serde_json::json!({ "error": UriTooLong::CODE, "message": error.to_string() });
    let mut resp = Response::new(Either::Left(Full::new(Bytes::from(body.to_string()))));
    *resp.status_mut() = StatusCode::URI_TOO_LONG;
    resp.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    if req.version() < Version::HTTP_2 {
        resp.headers_mut()
            .insert(CONNECTION, HeaderValue::from_static("close"));
    }
    Some(resp)
}
