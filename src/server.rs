//! Serving HTTP/1.1 on a listener that is handed in: the accept loop, the enforced
//! header-read timeout, and graceful shutdown (stop accepting, let in-flight requests
//! finish within a grace period). It knows nothing about what the handler does.

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use http::{Request, Response};
use http_body::Body;
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use tokio::net::TcpListener;
use tokio::sync::watch;

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
}

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
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(options.header_read_timeout)
        .keep_alive(true);
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
        let service = service_fn(move |req| {
            let handler = Arc::clone(&handler);
            async move { Ok::<_, Infallible>(handler.call(req, peer).await) }
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
