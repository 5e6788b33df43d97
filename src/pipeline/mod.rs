//! The data plane's request handler. A request on a guarded route reads as the pipeline:
//! key → gate (the route's filter) → cache → origin → response, each stage able to answer
//! and stop. Every other request is passed through to the upstream. Serving sockets is
//! `server`'s job.
//!
//! This module dispatches: it keeps the pipeline in force (`Proxy`), sends each request
//! to the route that `route` matches it to (the stages are `guarded`'s) or through to
//! the upstream, and writes the access log.

pub mod budget;
pub mod client;
pub mod error;
pub mod forwarded;
mod guarded;
pub mod metrics;
pub mod outcome;
pub mod passthrough;
pub mod response;
mod route;
pub mod write_through;

use std::future::Future;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Instant;

use arc_swap::ArcSwap;
use futures_util::FutureExt;
use futures_util::future::Either;
use http::{HeaderMap, Method, Request, Response, Uri};
use hyper::body::Incoming;

use crate::audit::Sampler;
use crate::cache::ResponseCache;
use crate::gate::Filter;
use crate::origin::client::Upstream;
use crate::pipeline::budget::Budget;
use crate::pipeline::client::client_ip;
use crate::pipeline::metrics::PassthroughMetrics;
use crate::pipeline::outcome::Outcome;
use bloomgate_core::access_log::{self, AccessLog};
use bloomgate_core::config::OutcomeHeaderPolicy;
use bloomgate_core::pattern::cidrs::Cidrs;
pub use error::error_response;
pub use guarded::GuardedRequest;
pub use response::{ProxyBody, X_BLOOMGATE};
pub use route::GuardedRoute;
use route::Routing;
use write_through::WriteThrough;

/// What the edge believes and tells about clients, compiled from `[server]` and
/// `[false_positive_budget]`.
#[derive(Default)]
pub struct EdgePolicy {
    /// Proxies whose forwarded headers are believed (see `client`).
    pub trusted_proxies: Cidrs,
    /// Who sees the `x-bloomgate` header.
    pub outcome_header: OutcomeHeaderPolicy,
    /// The clients that see it under [`OutcomeHeaderPolicy::Trusted`].
    pub outcome_header_clients: Cidrs,
    /// The per-client false-positive budget, when configured.
    pub budget: Option<Arc<Budget>>,
    /// The access log, when configured.
    pub access_log: Option<Arc<AccessLog>>,
}

/// The data-plane handler: the pipeline of the configuration in force, replaced whole by
/// a reload. A request runs to its end on the pipeline it started on; the next one takes
/// the new pipeline. Loading the current one takes no lock and, for requests that finish
/// without waiting on an origin, no reference count.
pub struct Proxy {
    current: ArcSwap<Pipeline>,
    /// Shared by every pipeline: entries outlive reloads (their keys name routes by
    /// stable ids, see `config::RouteIds`).
    cache: Arc<ResponseCache>,
}

impl Proxy {
    /// Serves `pipeline` until [`Proxy::replace`].
    pub fn new(pipeline: Pipeline) -> Proxy {
        Proxy {
            cache: Arc::clone(&pipeline.cache),
            current: ArcSwap::from_pointee(pipeline),
        }
    }

    /// Serves `next` from now on; returns the pipeline it replaces (requests in flight
    /// finish on it).
    pub fn replace(&self, next: Pipeline) -> Arc<Pipeline> {
        self.current.swap(Arc::new(next))
    }

    /// The pipeline in force.
    pub fn current(&self) -> Arc<Pipeline> {
        self.current.load_full()
    }

    /// Answers one request. Its body is hyper's, or `None` for a request the server
    /// read itself (a `GET`, which has none).
    pub async fn handle(
        &self,
        req: Request<Option<Incoming>>,
        peer: SocketAddr,
    ) -> Response<ProxyBody> {
        let pipeline = self.current.load();
        pipeline.handle(req, peer).await
    }

    /// See [`Pipeline::answer_now`]. The pipeline in force is read without a reference
    /// count, and released before this returns.
    pub fn answer_now<B>(&self, req: &Request<B>, peer: SocketAddr) -> Option<Response<ProxyBody>> {
        self.current.load().answer_now(req, peer)
    }

    /// See [`Pipeline::answer_guarded`].
    pub async fn answer_guarded(&self, uri: &Uri) -> Option<Response<ProxyBody>> {
        let pipeline = self.current.load();
        pipeline.answer_guarded(uri).await
    }

    /// The filter called `name`, if a route of the current pipeline uses it.
    pub fn filter(&self, name: &str) -> Option<Arc<Filter>> {
        self.current.load().filter(name).cloned()
    }

    /// The response cache, for metrics and the admin plane.
    pub fn cache(&self) -> &ResponseCache {
        &self.cache
    }
}

/// What a configuration makes of the data plane: its routes, upstream, write-through
/// rules and edge policy.
pub struct Pipeline {
    routes: Vec<GuardedRoute>,
    cache: Arc<ResponseCache>,
    upstream: Option<Arc<Upstream>>,
    max_body: u64,
    passthrough_metrics: PassthroughMetrics,
    write_through: Vec<WriteThrough>,
    edge: EdgePolicy,
    /// Samples refused keys for the background audit, when it is on (shared by every
    /// pipeline a reload makes).
    audit: Option<Arc<Sampler>>,
}

impl Pipeline {
    /// Assembles the handler from its compiled parts.
    pub fn new(
        routes: Vec<GuardedRoute>,
        cache: Arc<ResponseCache>,
        upstream: Option<Arc<Upstream>>,
        max_body: u64,
        passthrough_metrics: PassthroughMetrics,
        write_through: Vec<WriteThrough>,
        edge: EdgePolicy,
    ) -> Pipeline {
        Pipeline {
            routes,
            cache,
            upstream,
            max_body,
            passthrough_metrics,
            write_through,
            edge,
            audit: None,
        }
    }

    /// Offers the keys this handler refuses to `audit`'s sampler.
    pub fn with_audit(mut self, audit: Option<Arc<Sampler>>) -> Pipeline {
        self.audit = audit;
        self
    }

    /// The guarded routes, for the admin plane.
    pub fn routes(&self) -> &[GuardedRoute] {
        &self.routes
    }

    /// Answers one request.
    ///
    /// A plain function rather than an `async fn`: every async level keeps its own copy
    /// of the request (264 bytes) in its future, and hyper moves each request's future
    /// into place, so the levels above [`Pipeline::serve`] add as little as they can.
    pub fn handle(
        &self,
        req: Request<Option<Incoming>>,
        peer: SocketAddr,
    ) -> impl Future<Output = Response<ProxyBody>> + Send + '_ {
        match &self.edge.access_log {
            // Boxed, as the pass-through in `serve`: a future is as large as its largest
            // branch, and most requests are not logged.
            Some(log) if log.sampled() => {
                Either::Left(Box::pin(self.handle_logged(log, req, peer)))
            }
            _ => Either::Right(self.serve(req, peer, None).map(|(resp, _, _)| resp)),
        }
    }

    /// The answer to a request that needs no waiting, made and counted (and logged) as
    /// [`Pipeline::handle`] would: a key the gate refuses, a malformed key, a spelling
    /// of a guarded path that cannot be gated, a key a cache entry answers. `None` for
    /// any other request, which then goes to `handle`.
    ///
    /// The data plane asks this first, from the request as it was read: an answer made
    /// here costs no future at all, where `handle`'s is moved whole and polled through
    /// every level of the pipeline (docs/BENCHMARKS.md).
    pub fn answer_now<B>(&self, req: &Request<B>, peer: SocketAddr) -> Option<Response<ProxyBody>> {
        if !matches!(*req.method(), Method::GET | Method::HEAD) {
            return None;
        }
        let started = Instant::now();
        let mut client = None;
        let (resp, outcome, route) = match self.route(req.uri().path()) {
            Routing::Guarded(route, path, key) => {
                let view = GuardedRequest {
                    uri: req.uri(),
                    headers: req.headers(),
                    peer: peer.ip(),
                    client: None,
                };
                let show = || self.shows_outcome(peer.ip(), req.headers(), &mut client);
                let (resp, served) = self.guarded_now(route, &path[key], &view, started, show)?;
                (resp, served.header_value(), &route.label)
            }
            Routing::Refused(route, e) => {
                let show = self.shows_outcome(peer.ip(), req.headers(), &mut client);
                let resp = self.refused(route, e, show);
                (resp, Outcome::Error.header_value(), &route.label)
            }
            Routing::Pass => return None,
        };
        if let Some(log) = &self.edge.access_log
            && log.sampled()
        {
            let request = Logged {
                started,
                client: client.unwrap_or_else(|| self.client(peer.ip(), req.headers())),
                method: req.method(),
                target: req
                    .uri()
                    .path_and_query()
                    .map_or(req.uri().path(), |p| p.as_str()),
            };
            request.record(log, &resp, outcome, Some(route));
        }
        Some(resp)
    }

    /// [`Pipeline::handle`], with a line in the access log.
    async fn handle_logged(
        &self,
        log: &AccessLog,
        req: Request<Option<Incoming>>,
        peer: SocketAddr,
    ) -> Response<ProxyBody> {
        let started = Instant::now();
        let method = req.method().clone();
        let target = req
            .uri()
            .path_and_query()
            .map_or_else(|| req.uri().path().to_owned(), |p| p.as_str().to_owned());
        let client = self.client(peer.ip(), req.headers());
        let (resp, outcome, route) = self.serve(req, peer, Some(client)).await;
        let request = Logged {
            started,
            client,
            method: &method,
            target: &target,
        };
        request.record(log, &resp, outcome, route);
        resp
    }

    /// Answers one request; says which stage answered and on which guarded route.
    /// `client` is the client's address if the caller has worked it out already.
    async fn serve(
        &self,
        req: Request<Option<Incoming>>,
        peer: SocketAddr,
        mut client: Option<IpAddr>,
    ) -> (Response<ProxyBody>, &'static str, Option<&str>) {
        let show = self.shows_outcome(peer.ip(), req.headers(), &mut client);
        if matches!(*req.method(), Method::GET | Method::HEAD) {
            let view = GuardedRequest {
                uri: req.uri(),
                headers: req.headers(),
                peer: peer.ip(),
                client,
            };
            match self.route(req.uri().path()) {
                Routing::Guarded(route, path, key) => {
                    let (resp, served) = self.guarded(route, &path[key], &view, show).await;
                    return (resp, served.header_value(), Some(&route.label));
                }
                Routing::Refused(route, e) => {
                    let resp = self.refused(route, e, show);
                    return (resp, Outcome::Error.header_value(), Some(&route.label));
                }
                Routing::Pass => {}
            }
        }
        // Boxed: hyper's client exchange makes this future several times the size of a
        // refusal's or a cache hit's, and every request's future is moved whole.
        let bypass = Box::pin(self.bypass(req, peer, show));
        (bypass.await, "bypass", None)
    }

    /// Passes a request no guarded route answers through to the upstream, then applies a
    /// write-through rule that matches it.
    async fn bypass(
        &self,
        req: Request<Option<Incoming>>,
        peer: SocketAddr,
        show: bool,
    ) -> Response<ProxyBody> {
        let write = write_through::matching(&self.write_through, &req);
        let mut resp = passthrough::forward(
            self.upstream.as_deref(),
            req,
            peer,
            self.max_body,
            &self.passthrough_metrics,
            &self.edge.trusted_proxies,
        )
        .await;
        if !show {
            resp.headers_mut().remove(X_BLOOMGATE);
        }
        match write {
            Some((rule, segment)) => rule.apply(resp, segment).await,
            None => resp,
        }
    }

    /// Answers a GET for `uri` if a guarded route matches it, without a socket (the same
    /// path `handle` takes, as a client on loopback with no headers; used by benchmarks
    /// and allocation tests).
    pub async fn answer_guarded(&self, uri: &Uri) -> Option<Response<ProxyBody>> {
        let headers = HeaderMap::new();
        let peer = IpAddr::from([127, 0, 0, 1]);
        let mut client = None;
        let show = self.shows_outcome(peer, &headers, &mut client);
        let view = GuardedRequest {
            uri,
            headers: &headers,
            peer,
            client,
        };
        match self.route(uri.path()) {
            Routing::Guarded(route, path, key) => {
                Some(self.guarded(route, &path[key], &view, show).await.0)
            }
            Routing::Refused(route, e) => Some(self.refused(route, e, show)),
            Routing::Pass => None,
        }
    }

    /// The client's address: the peer, or what a trusted proxy in front reports.
    fn client(&self, peer: IpAddr, headers: &HeaderMap) -> IpAddr {
        client_ip(peer, headers, &self.edge.trusted_proxies)
    }

    /// Whether this client is told which stage answered. The policy that reads the
    /// client's address works it out into `client`, unless it is there already.
    fn shows_outcome(
        &self,
        peer: IpAddr,
        headers: &HeaderMap,
        client: &mut Option<IpAddr>,
    ) -> bool {
        match self.edge.outcome_header {
            OutcomeHeaderPolicy::Always => true,
            OutcomeHeaderPolicy::Never => false,
            OutcomeHeaderPolicy::Trusted => {
                let client = *client.get_or_insert_with(|| self.client(peer, headers));
                self.edge.outcome_header_clients.contains(client)
            }
        }
    }

    /// The filter called `name`, if a route uses it.
    pub fn filter(&self, name: &str) -> Option<&Arc<Filter>> {
        self.routes
            .iter()
            .map(|r| &r.filter)
            .find(|f| f.name() == name)
    }

    /// The response cache, for metrics and the admin plane.
    pub fn cache(&self) -> &ResponseCache {
        &self.cache
    }
}

/// What the access log says of a request besides its answer.
struct Logged<'r> {
    started: Instant,
    client: IpAddr,
    method: &'r Method,
    /// The request target as sent (path and query).
    target: &'r str,
}

impl Logged<'_> {
    /// Records the request, answered with `resp` by `outcome` on `route`.
    fn record(
        &self,
        log: &AccessLog,
        resp: &Response<ProxyBody>,
        outcome: &str,
        route: Option<&str>,
    ) {
        log.record(&access_log::Entry {
            time: access_log::now(),
            client: self.client,
            method: self.method.as_str(),
            path: self.target,
            status: resp.status().as_u16(),
            outcome,
            route: route.unwrap_or("-"),
            bytes: http_body::Body::size_hint(resp.body()).exact(),
            duration_ms: access_log::millis(self.started.elapsed()),
        });
    }
}
