//! Serving HTTP on listeners that are handed in: the accept loop and the bound on open
//! connections, one listener per serving thread (`SO_REUSEPORT`, [`serve_per_core`]) or
//! one on a shared runtime ([`serve`]), TLS termination (`tls`, `cert`), the protocol of
//! each connection (HTTP/1.1; HTTP/2 by ALPN on TLS or by its preface in cleartext,
//! `sniff`), the limits on a request head (read timeout, size, target length),
//! half-closed connections, idle connections, and graceful shutdown (stop accepting, let
//! in-flight requests finish within a grace period; HTTP/2 clients get a GOAWAY). Each
//! request reaches the handler the same whatever the protocol and thread, with a
//! [`ConnectionInfo`] in its extensions. It knows nothing about what the handler does.
//!
//! This file holds the accept loop, the bound on open connections and draining at
//! shutdown; `connection` serves one accepted connection, `direct` reads and answers
//! plain HTTP/1.1 `GET`s before hyper, `long_target` is the 414 the server makes
//! itself, `per_core` the thread-per-core serving, `signal` the closing signal a
//! connection polls only when it fires, `sniff` the cleartext protocol detection, `tls`
//! the TLS acceptor, `metrics` the connection counts.

mod connection;
mod direct;
mod long_target;
pub mod metrics;
mod per_core;
mod signal;
mod sniff;
pub mod tls;

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use http::{Request, Response};
use http_body::Body;
use hyper::body::Incoming;
use tokio::net::TcpListener;
use tokio::sync::{Semaphore, watch};

pub use metrics::ConnectionMetrics;
pub use per_core::{ServingRuntimes, bind_reuseport, serve_per_core};
pub use tls::Tls;

use bloomgate_core::report::Chain;
use connection::Listener;

/// Something that answers requests.
pub trait Handler: Send + Sync + 'static {
    /// The response body type.
    type Body: Body<Data = bytes::Bytes, Error: Into<Box<dyn std::error::Error + Send + Sync>>>
        + Send
        + Unpin
        + 'static;

    /// Whether this handler answers requests the server reads itself
    /// ([`Handler::answer_now`], [`Handler::call_head`]): an HTTP/1.1 connection to one
    /// that does is read by the server's own loop first (see `direct`), which answers
    /// plain `GET`s without hyper's server.
    const ANSWERS_AT_ONCE: bool = false;

    /// Answers one request from `peer`.
    fn call(
        &self,
        req: Request<Incoming>,
        peer: SocketAddr,
    ) -> impl Future<Output = Response<Self::Body>> + Send;

    /// The answer to a request that needs no waiting, if this handler has one; asked
    /// before [`Handler::call`], which answers when this does not. An answer made here
    /// costs the connection no future (see `connection::service`). It reads the
    /// request's method, target and headers, never its body or extensions: the server
    /// may ask it of a head it read itself (`Request<()>`), before hyper has the request.
    fn answer_now<B>(&self, req: &Request<B>, peer: SocketAddr) -> Option<Response<Self::Body>> {
        let _ = (req, peer);
        None
    }

    /// Answers a request the server read itself (a plain `GET`, with no body) that
    /// [`Handler::answer_now`] did not answer, if this handler serves such requests;
    /// `None` hands the request to hyper, which asks [`Handler::call`]. The request
    /// carries a [`ConnectionInfo`] as hyper's do.
    fn call_head(
        &self,
        req: Request<()>,
        peer: SocketAddr,
    ) -> Option<impl Future<Output = Response<Self::Body>> + Send + '_> {
        let _ = (req, peer);
        None::<std::future::Pending<Response<Self::Body>>>
    }
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
                tracing::warn!(listener = name, error = %Chain(&e), "accept failed");
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
            tracing::debug!(listener = name, error = %Chain(&e), "cannot set TCP_NODELAY");
        }
        tokio::spawn(connection::run(
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
