//! The pooled keep-alive HTTP client to the upstream API, shared by pass-through and by
//! `upstream` origins. It sends requests and enforces the response-head timeout; it does
//! not decide what to forward (see `passthrough` and `origin`).

use std::error::Error as StdError;
use std::time::Duration;

use bytes::Bytes;
use http::header::HOST;
use http::uri::{Authority, PathAndQuery};
use http::{HeaderValue, Request, Response, Uri};
use http_body_util::combinators::MapErr;
use http_body_util::{BodyExt, Either, Empty, LengthLimitError, Limited};
use hyper::body::Incoming;

use super::pool::{ExchangeError, Pool, PooledBody};
use crate::config::CompiledUpstream;
use crate::serving;

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
#[error("reading the client's request body failed: {0}")]
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
    #[error("forwarding the request body failed: {0}")]
    ClientBody(#[source] ExchangeError),
    /// Connecting or exchanging failed.
    #[error("upstream request failed: {0}")]
    Request(#[source] ExchangeError),
    /// The configured URL and request path do not form a URI.
    #[error("cannot build the upstream URI: {0}")]
    Uri(#[from] http::Error),
}

/// The upstream API client: a keep-alive connection pool per serving thread, and one
/// for every other thread (background refreshes on the shared runtime, the audit).
///
/// A pooled connection is polled by the task that holds it (see [`pool`](super::pool)),
/// so a passed-through request on a serving thread reads and writes its upstream
/// connection on the thread that accepted it, as its client connection is. The cost: up
/// to `pool_max_idle` idle connections per thread.
pub struct Upstream {
    /// Slots indexed by [`serving::thread`]; the last is for every other thread.
    pool: Pool,
    authority: Authority,
    host: HeaderValue,
    timeout: Duration,
}

impl Upstream {
    /// Builds the connection pools (no connection is opened yet) for the
    /// `http://host:port` that config compilation read: one for each of
    /// `serving_threads` and one for the rest.
    pub fn new(upstream: &CompiledUpstream, serving_threads: usize) -> Upstream {
        let config = &upstream.settings;
        let authority = upstream.authority.clone();
        // An authority is always a valid header value; the fallback is never used.
        let host = HeaderValue::from_str(authority.as_str())
            .unwrap_or_else(|_| HeaderValue::from_static("localhost"));
        Upstream {
            pool: Pool::new(
                authority.clone(),
                serving_threads + 1,
                config.pool_max_idle,
                config.pool_idle_timeout,
            ),
            authority,
            host,
            timeout: config.timeout,
        }
    }

    /// The request target sent upstream for a request's URI: its path and query, in
    /// origin form. A URI already in origin form (every HTTP/1.1 request but those in
    /// absolute form) is kept as it is.
    pub fn target_for(uri: Uri) -> Result<Uri, UpstreamError> {
        if uri.scheme().is_none() && uri.authority().is_none() && uri.path().starts_with('/') {
            return Ok(uri);
        }
        let pq = uri.path_and_query().map_or("/", PathAndQuery::as_str);
        Ok(Uri::builder().path_and_query(pq).build()?)
    }

    /// The request target (origin form) for a path and query built here.
    pub fn uri_for_target(&self, target: &str) -> Result<Uri, UpstreamError> {
        Ok(Uri::builder().path_and_query(target).build()?)
    }

    /// The upstream's `host:port`, for the Host header of origin fetches.
    pub fn authority(&self) -> &Authority {
        &self.authority
    }

    /// The configured response-head timeout.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Sends a request (its URI in origin form; without a Host header it gets the
    /// upstream's) and waits (bounded) for the response head.
    pub async fn send(
        &self,
        mut req: Request<UpstreamBody>,
    ) -> Result<Response<PooledBody>, UpstreamError> {
        if !req.headers().contains_key(HOST) {
            req.headers_mut().insert(HOST, self.host.clone());
        }
        let slot = serving::thread().unwrap_or(usize::MAX);
        match tokio::time::timeout(self.timeout, self.pool.send(slot, req)).await {
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
