//! The pooled keep-alive HTTP client to the upstream API, shared by pass-through and by
//! `upstream` origins. It sends requests and enforces the response-head timeout; it does
//! not decide what to forward (see `passthrough` and `origin`).
//!
//! Two paths: a GET without a body (every origin fetch, and the plain GETs the data
//! plane read itself) goes over bloomgate's own HTTP/1.1 connections (`conn`, `wire`),
//! driven by the request's task; anything else goes through hyper's client.

mod conn;
mod wire;

use std::error::Error as StdError;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use futures_util::future;
use http::header::{CONTENT_LENGTH, TRANSFER_ENCODING};
use http::uri::{Authority, PathAndQuery, Scheme};
use http::{Method, Request, Response, Uri};
use http_body::{Body, Frame, SizeHint};
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
    /// Connecting or exchanging failed on the own path, or its answer broke HTTP/1.1.
    #[error("upstream request failed")]
    Exchange(#[source] conn::ExchangeError),
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
///
/// The own path keeps its idle connections the same way, per thread, with the same
/// limits; hyper's client keeps only those of the requests it carries.
pub struct Upstream {
    /// Indexed by [`serving::thread`]; the last is for every other thread.
    clients: Box<[Client<HttpConnector, UpstreamBody>]>,
    /// The own path's idle connections, indexed the same way.
    pools: Arc<conn::Pools>,
    scheme: Scheme,
    authority: Authority,
    /// The Host a request that has none is sent with (the port only if not 80).
    host: String,
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
        let authority = upstream.authority.clone();
        let host = match authority.port_u16() {
            Some(port) if port != 80 => format!("{}:{port}", authority.host()),
            _ => authority.host().to_owned(),
        };
        Upstream {
            clients,
            pools: conn::Pools::new(
                serving_threads + 1,
                config.pool_max_idle,
                config.pool_idle_timeout,
            ),
            scheme: Scheme::HTTP,
            authority,
            host,
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

    /// The index of the pools of the thread the caller runs on.
    fn home(&self) -> usize {
        let shared = self.clients.len() - 1;
        serving::thread().map_or(shared, |i| i.min(shared))
    }

    /// Sends a request and waits (bounded) for the response head.
    ///
    /// A plain function: a request for the own path is written out before the future
    /// is made, so the future holds its bytes rather than the request.
    pub fn send(
        &self,
        req: Request<UpstreamBody>,
    ) -> impl Future<Output = Result<Response<AnswerBody>, UpstreamError>> + Send + '_ {
        let own = req.method() == Method::GET
            && matches!(req.body(), Either::Left(_))
            && !req.headers().contains_key(CONTENT_LENGTH)
            && !req.headers().contains_key(TRANSFER_ENCODING);
        if own {
            let target = req.uri().path_and_query().map_or("/", |pq| pq.as_str());
            let mut head = Vec::with_capacity(128 + 64 * req.headers().len());
            wire::write_request(&mut head, req.method(), target, req.headers(), &self.host);
            drop(req);
            future::Either::Left(self.send_own(head))
        } else {
            future::Either::Right(self.send_hyper(req))
        }
    }

    async fn send_hyper(
        &self,
        req: Request<UpstreamBody>,
    ) -> Result<Response<AnswerBody>, UpstreamError> {
        let client = &self.clients[self.home()];
        match tokio::time::timeout(self.timeout, client.request(req)).await {
            Err(_) => Err(UpstreamError::Timeout(self.timeout)),
            Ok(Ok(resp)) => Ok(resp.map(AnswerBody::Hyper)),
            Ok(Err(e)) if caused_by::<LengthLimitError>(&e) => Err(UpstreamError::BodyTooLarge),
            Ok(Err(e)) if caused_by::<ClientBodyError>(&e) => Err(UpstreamError::ClientBody(e)),
            Ok(Err(e)) => Err(UpstreamError::Request(e)),
        }
    }

    /// A GET without a body over the own path, its head (written as hyper's client
    /// writes it: origin-form target, Host added when missing) already in `head`; the
    /// answer is read as hyper's client reads it.
    async fn send_own(&self, head: Vec<u8>) -> Result<Response<AnswerBody>, UpstreamError> {
        let exchange = conn::exchange(&self.pools, self.home(), &self.authority, &head);
        let (answer, body) = match tokio::time::timeout(self.timeout, exchange).await {
            Err(_) => return Err(UpstreamError::Timeout(self.timeout)),
            Ok(answer) => answer.map_err(UpstreamError::Exchange)?,
        };
        let mut resp = Response::new(AnswerBody::Own(body));
        *resp.status_mut() = answer.status;
        *resp.version_mut() = answer.version;
        *resp.headers_mut() = answer.headers;
        if let Some(reason) = answer.reason
            && let Ok(reason) = hyper::ext::ReasonPhrase::try_from(reason)
        {
            resp.extensions_mut().insert(reason);
        }
        Ok(resp)
    }
}

/// The body of an upstream answer, from whichever path carried it.
#[derive(Debug)]
pub enum AnswerBody {
    /// Read by hyper's client.
    Hyper(Incoming),
    /// Read on the own path.
    Own(conn::AnswerBody),
}

impl Body for AnswerBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        match self.get_mut() {
            AnswerBody::Hyper(body) => Pin::new(body).poll_frame(cx).map_err(Into::into),
            AnswerBody::Own(body) => Pin::new(body).poll_frame(cx).map_err(Into::into),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            AnswerBody::Hyper(body) => body.is_end_stream(),
            AnswerBody::Own(body) => body.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            AnswerBody::Hyper(body) => body.size_hint(),
            AnswerBody::Own(body) => body.size_hint(),
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

#[cfg(test)]
mod tests;
