//! Serving HTTP/1.1 on a listener that is handed in: the accept loop, the limits on a
//! request head (read timeout, size, target length), half-closed connections, and
//! graceful shutdown (stop accepting, let in-flight requests finish within a grace
//! period). It knows nothing about what the handler does.

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::header::CONNECTION;
use http::{HeaderValue, Request, Response};
use http_body::Body;
use http_body_util::{Either, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use tokio::net::TcpListener;
use tokio::sync::watch;

use crate::pipeline::error::ProxyError;

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
    /// Time a client has to send a request head.
    pub header_read_timeout: Duration,
    /// Time in-flight requests get after shutdown begins.
    pub grace: Duration,
    /// Largest request head (request line, headers, blank line) read; a larger one is
    /// answered 431 by hyper and the connection closed. At least 8192.
    pub max_header_bytes: usize,
    /// Longest request target (path and query) handed to the handler; a longer one is
    /// answered 414 here and the connection closed.
    pub max_uri_bytes: usize,
}

impl Default for ServeOptions {
    /// The data plane's defaults (see `ServerConfig`).
    fn default() -> Self {
        ServeOptions {
            header_read_timeout: Duration::from_secs(10),
            grace: Duration::from_secs(10),
            max_header_bytes: 16 * 1024,
            max_uri_bytes: 8 * 1024,
        }
    }
}

/// What the connection answers with: a refusal made here, or the handler's response.
type ServedBody<B> = Either<Full<Bytes>, B>;

/// Accepts connections until `shutdown` turns true, then drains. Returns the number of
/// connections that were still open when the grace period ran out.
pub async fn serve<H: Handler>(
    listener: TcpListener,
    handler: Arc<H>,
    options: ServeOptions,
    mut shutdown: watch::Receiver<bool>,
    name: &'static str,
) -> usize {
    let graceful = GracefulShutdown::new();
    let builder = http1_builder(&options);
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
        if let Err(e) = stream.set_nodelay(true) {
            tracing::debug!(listener = name, error = %e, "cannot set TCP_NODELAY");
        }
        let handler = Arc::clone(&handler);
        let max_uri_bytes = options.max_uri_bytes;
        let service = service_fn(move |req: Request<Incoming>| {
            let handler = Arc::clone(&handler);
            async move {
                // Short-circuit: an over-long target never reaches routing.
                if let Some(refused) = refuse_long_target(&req, max_uri_bytes, name) {
                    return Ok::<_, Infallible>(refused);
                }
                Ok(handler.call(req, peer).await.map(Either::Right))
            }
        });
        let conn = builder.serve_connection(TokioIo::new(stream), service);
        let conn = graceful.watch(conn);
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                tracing::debug!(listener = name, %peer, error = %e, "connection ended with an error");
            }
        });
    }
    drop(listener);
    let open = graceful.count();
    tracing::info!(
        listener = name,
        open_connections = open,
        "stopped accepting; draining"
    );
    match tokio::time::timeout(options.grace, graceful.shutdown()).await {
        Ok(()) => 0,
        Err(_) => {
            tracing::warn!(
                listener = name,
                grace_ms = options.grace.as_millis() as u64,
                "grace period over; closing remaining connections"
            );
            open
        }
    }
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
        .max_buf_size(head_limit);
    builder
}

/// The 414 for a request whose target (path and query) is longer than `limit`, or
/// `None` when it fits. The connection is closed after the answer.
fn refuse_long_target<B>(
    req: &Request<Incoming>,
    limit: usize,
    listener: &'static str,
) -> Option<Response<ServedBody<B>>> {
    let len = req.uri().path_and_query().map_or(0, |pq| pq.as_str().len());
    if len <= limit {
        return None;
    }
    let error = ProxyError::UriTooLong { len, limit };
    error.log(listener);
    let mut resp = error.into_response().map(Either::Left);
    resp.headers_mut()
        .insert(CONNECTION, HeaderValue::from_static("close"));
    Some(resp)
}
