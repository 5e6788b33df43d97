//! The pooled keep-alive HTTP client to the upstream API, shared by pass-through and by
//! `upstream` origins. It sends requests and enforces the response-head timeout; it does
//! not decide what to forward (see `passthrough` and `origin`).

use std::error::Error as StdError;
use std::time::Duration;

use bytes::Bytes;
use http::uri::{Authority, PathAndQuery, Scheme};
use http::{Request, Response, Uri};
use http_body_util::combinators::MapErr;
use http_body_util::{BodyExt, Either, Empty, LengthLimitError, Limited};
use hyper::body::Incoming;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioTimer};

use bloomgate_core::config::CompiledUpstream;
use bloomgate_core::serving;

/// Request bodies sent upstream: empty (origin fetches) or the client's body, bounded,
/// its read errors marked as the client's (see [`client_body`]).
pub type UpstreamBody = Either<Empty<Bytes>, ClientBody>;

/// The client's request body on its way upstream.
pub type ClientBody = MapErr<Limited<Incoming>, fn(BoxError) -> ClientBodyError>;

type BoxError = Box<dyn StdError + Send + Sync>;

/// Reading the client's request body failed while it was being forwarded: a malformed
/// chunk, a body cut short, or more bytes than the limit. The mark tells these apart
/// from failures of the upstream connection, which carry no such error in their chain.
#[derive(Debug, thiserror::Error)]
#[error("reading the client's request body failed")]
pub struct ClientBodyError(#[source] BoxError);

/// The client's body, bounded to `limit` bytes, ready to be sent upstream.
pub fn client_body(body: Incoming, limit: usize) -> UpstreamBody {
    let mark: fn(BoxError) -> ClientBodyError = ClientBodyError;
    Either::Right(Limited::new(body, limit).map_err(mark))
}

/// Why an upstream exchange failed.
#[derive(Debug, thiserror::Error)]
pub enum UpstreamError {
    /// No response head within the configured timeout.
    #[error("upstream did not answer within {0:?}")]
    Timeout(Duration),
    /// The client's body exceeded `server.max_body_bytes` while being forwarded.
    #[error("request body exceeds the configured limit")]
    BodyTooLarge,
    /// The client's body could not be read while being forwarded (malformed or cut short).
    #[error("forwarding the request body failed")]
    ClientBody(#[source] hyper_util::client::legacy::Error),
    /// Connecting or exchanging failed.
    #[error("upstream request failed")]
    Request(#[source] hyper_util::client::legacy::Error),
    /// The configured URL and request path do not form a URI.
    #[error("cannot build the upstream URI")]
    Uri(#[from] http::Error),
}

/// The upstream API client: a keep-alive connection pool per serving thread, and one
/// for every other thread (background refreshes on the shared runtime, the audit).
///
/// A pooled connection is driven by a task on the runtime that opened it. Shared by
/// every `per_core` serving thread, a request on one thread would often write and read
/// through a connection driven by another, a cross-thread hand-off each way; with a pool
/// per thread, a passed-through request stays on the thread that accepted it, as its
/// client connection does. The cost: up to `pool_max_idle` idle connections per thread.
pub struct Upstream {
    /// Indexed by [`serving::thread`]; the last is for every other thread.
    clients: Box<[Client<HttpConnector, UpstreamBody>]>,
    scheme: Scheme,
    authority: Authority,
    timeout: Duration,
}

impl Upstream {
    /// Builds the clients and their connection pools (no connection is opened yet) for
    /// the `http://host:port` that config compilation read: one for each of
    /// `serving_threads` and one for the rest.
    pub fn new(upstream: &CompiledUpstream, serving_threads: usize) -> Upstream {
        let config = &upstream.settings;
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        connector.set_connect_timeout(Some(config.timeout));
        connector.set_keepalive(Some(Duration::from_secs(60)));
        let clients = (0..=serving_threads)
            .map(|_| {
                Client::builder(TokioExecutor::new())
                    .pool_idle_timeout(config.pool_idle_timeout)
                    .pool_max_idle_per_host(config.pool_max_idle)
                    .pool_timer(TokioTimer::new())
                    .timer(TokioTimer::new())
                    .build(connector.clone())
            })
            .collect();
        Upstream {
            clients,
            scheme: Scheme::HTTP,
            authority: upstream.authority.clone(),
            timeout: config.timeout,
        }
    }

    /// The upstream URI for a request's path and query, which it takes as they were
    /// read (no copy, no second parse).
    pub fn uri_for(&self, path_and_query: Option<PathAndQuery>) -> Result<Uri, UpstreamError> {
        let mut parts = http::uri::Parts::default();
        parts.scheme = Some(self.scheme.clone());
        parts.authority = Some(self.authority.clone());
        parts.path_and_query =
            Some(path_and_query.unwrap_or_else(|| PathAndQuery::from_static("/")));
        Uri::from_parts(parts).map_err(|e| UpstreamError::Uri(e.into()))
    }

    /// The upstream URI for a request target built here (a path and query).
    pub fn uri_for_target(&self, target: &str) -> Result<Uri, UpstreamError> {
        Ok(Uri::builder()
            .scheme(self.scheme.clone())
            .authority(self.authority.clone())
            .path_and_query(target)
            .build()?)
    }

    /// The upstream's `host:port`, for the Host header of origin fetches.
    pub fn authority(&self) -> &Authority {
        &self.authority
    }

    /// The configured response-head timeout.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// The pool of the thread the caller runs on.
    fn client(&self) -> &Client<HttpConnector, UpstreamBody> {
        let shared = self.clients.len() - 1;
        let i = serving::thread().map_or(shared, |i| i.min(shared));
        &self.clients[i]
    }

    /// Sends a request and waits (bounded) for the response head.
    pub async fn send(
        &self,
        req: Request<UpstreamBody>,
    ) -> Result<Response<Incoming>, UpstreamError> {
        match tokio::time::timeout(self.timeout, self.client().request(req)).await {
            Err(_) => Err(UpstreamError::Timeout(self.timeout)),
            Ok(Ok(resp)) => Ok(resp),
            Ok(Err(e)) if caused_by::<LengthLimitError>(&e) => Err(UpstreamError::BodyTooLarge),
            Ok(Err(e)) if caused_by::<ClientBodyError>(&e) => Err(UpstreamError::ClientBody(e)),
            Ok(Err(e)) => Err(UpstreamError::Request(e)),
        }
    }
}

/// Whether an error of type `T` is anywhere in the chain of `e`.
fn caused_by<T: StdError + 'static>(e: &(dyn StdError + 'static)) -> bool {
    let mut cur: Option<&(dyn StdError + 'static)> = Some(e);
    while let Some(err) = cur {
        if err.is::<T>() {
            return true;
        }
        cur = err.source();
    }
    false
}
