//! The data plane's request handler. A request on a guarded route reads as the pipeline:
//! key → gate (the route's filter) → cache → origin → response, each stage able to answer
//! and stop. Every other request is passed through to the upstream. Serving sockets is
//! `server`'s job.

pub mod budget;
pub mod client;
pub mod error;
pub mod forwarded;
pub mod metrics;
pub mod outcome;
pub mod passthrough;
pub mod response;
pub mod write_through;

use std::future::Future;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use futures_util::FutureExt;
use futures_util::future::Either;
use http::header::HeaderName;
use http::{HeaderMap, HeaderValue, Method, Request, Response, Uri};
use hyper::body::Incoming;

use crate::access_log::{self, AccessLog};
use crate::audit::{Sample, Sampler};
use crate::cache::{CacheKey, Loaded, Lookup, Negative, ResponseCache};
use crate::config::{KeySource, Normalize, OutcomeHeaderPolicy, RouteMode};
use crate::gate::{Filter, Verdict};
use crate::key::NormKey;
use crate::key::{KeyBytes, KeyError, normalize};
use crate::origin::client::Upstream;
use crate::origin::http_cache;
use crate::origin::{CachedResponse, Origin, OriginError, Variant};
use crate::pattern::cidrs::Cidrs;
use crate::pattern::path;
use crate::pattern::route::{PathPattern, QueryRules};
use crate::pipeline::budget::{Allowance, Budget};
use crate::pipeline::client::client_ip;
use crate::pipeline::error::ProxyError;
use crate::pipeline::metrics::{PassthroughMetrics, RouteMetrics};
use crate::pipeline::outcome::Outcome;
pub use error::error_response;
pub use response::{ProxyBody, X_BLOOMGATE};
use response::{not_found, replay, replay_stale};
use write_through::WriteThrough;

/// One guarded route, compiled.
pub struct GuardedRoute {
    /// Stable id of the route's name, part of cache keys (see `reload::RouteIds`).
    pub id: u32,
    /// Name used in labels and logs.
    pub label: Arc<str>,
    /// Path pattern and key source.
    pub pattern: PathPattern,
    /// Key normalisation (the filter's).
    pub normalize: Normalize,
    /// The filter that guards this route.
    pub filter: Arc<Filter>,
    /// Where found keys come from (shared with background refreshes).
    pub origin: Arc<Origin>,
    /// Lifetime of negative entries for this route.
    pub negative_ttl: Duration,
    /// Pre-resolved metric handles.
    pub metrics: RouteMetrics,
    /// Enforce or shadow.
    pub mode: RouteMode,
    /// Which query parameters are read, forwarded or refused.
    pub query: QueryRules,
    /// Keys already logged as false negatives (bounded), so each is logged once.
    pub logged_false_negatives: std::sync::Mutex<std::collections::HashSet<crate::key::OwnedKey>>,
}

/// Where a request goes.
enum Routing<'r, 'p> {
    /// Through the pipeline of this route, matched on this canonical path, whose key
    /// segment (empty for query keys) is at this range.
    Guarded(
        &'r GuardedRoute,
        std::borrow::Cow<'p, str>,
        std::ops::Range<usize>,
    ),
    /// Refused with 400: a spelling of this route's resource that cannot be gated.
    Refused(&'r GuardedRoute, ProxyError),
    /// Not guarded: passed through as sent.
    Pass,
}

/// Most false-negative keys remembered per route for log de-duplication.
const FALSE_NEGATIVE_LOG_LIMIT: usize = 1024;

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

    /// Answers one request.
    pub async fn handle(&self, req: Request<Incoming>, peer: SocketAddr) -> Response<ProxyBody> {
        let pipeline = self.current.load();
        pipeline.handle(req, peer).await
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

/// The parts of a guarded request the pipeline reads.
pub struct GuardedRequest<'r> {
    /// The request target (its query is read; its path was matched already).
    pub uri: &'r Uri,
    /// The request headers (conditions, credentials, forwarded headers).
    pub headers: &'r HeaderMap,
    /// The socket peer.
    pub peer: IpAddr,
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
        req: Request<Incoming>,
        peer: SocketAddr,
    ) -> impl Future<Output = Response<ProxyBody>> + Send + '_ {
        match &self.edge.access_log {
            // Boxed, as the pass-through in `serve`: a future is as large as its largest
            // branch, and most requests are not logged.
            Some(log) if log.sampled() => {
                Either::Left(Box::pin(self.handle_logged(log, req, peer)))
            }
            _ => Either::Right(self.serve(req, peer).map(|(resp, _, _)| resp)),
        }
    }

    /// [`Pipeline::handle`], with a line in the access log.
    async fn handle_logged(
        &self,
        log: &AccessLog,
        req: Request<Incoming>,
        peer: SocketAddr,
    ) -> Response<ProxyBody> {
        let started = Instant::now();
        let method = req.method().clone();
        let target = req
            .uri()
            .path_and_query()
            .map_or_else(|| req.uri().path().to_owned(), |p| p.as_str().to_owned());
        let client = self.client(peer.ip(), req.headers());
        let (resp, outcome, route) = self.serve(req, peer).await;
        log.record(&access_log::Entry {
            time: access_log::now(),
            client,
            method: method.as_str(),
            path: &target,
            status: resp.status().as_u16(),
            outcome,
            route: route.unwrap_or("-"),
            bytes: http_body::Body::size_hint(resp.body()).exact(),
            duration_ms: access_log::millis(started.elapsed()),
        });
        resp
    }

    /// Answers one request; says which stage answered and on which guarded route.
    async fn serve(
        &self,
        req: Request<Incoming>,
        peer: SocketAddr,
    ) -> (Response<ProxyBody>, &'static str, Option<&str>) {
        let show = self.shows_outcome(peer.ip(), req.headers());
        if matches!(*req.method(), Method::GET | Method::HEAD) {
            let view = GuardedRequest {
                uri: req.uri(),
                headers: req.headers(),
                peer: peer.ip(),
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
        req: Request<Incoming>,
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
        let view = GuardedRequest {
            uri,
            headers: &headers,
            peer: IpAddr::from([127, 0, 0, 1]),
        };
        let show = self.shows_outcome(view.peer, &headers);
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

    /// Whether this client is told which stage answered.
    fn shows_outcome(&self, peer: IpAddr, headers: &HeaderMap) -> bool {
        match self.edge.outcome_header {
            OutcomeHeaderPolicy::Always => true,
            OutcomeHeaderPolicy::Never => false,
            OutcomeHeaderPolicy::Trusted => self
                .edge
                .outcome_header_clients
                .contains(self.client(peer, headers)),
        }
    }

    /// Which guarded route, if any, a request path names in any of its spellings.
    fn route<'p>(&self, raw: &'p str) -> Routing<'_, 'p> {
        if self.routes.is_empty() {
            return Routing::Pass;
        }
        match path::canonical(raw) {
            Ok(canonical) => {
                let matched = self.routes.iter().find_map(|r| {
                    let segment = r.pattern.matches(&canonical)?;
                    Some((r, segment_range(&canonical, segment)))
                });
                if let Some((route, key)) = matched {
                    return Routing::Guarded(route, canonical, key);
                }
                // Matches nothing as written. A path without escapes, '\' or ';' reads
                // the same to every upstream, so it is not guarded.
                if !raw.contains(['%', '\\', ';']) {
                    return Routing::Pass;
                }
                self.lenient_route(raw, ProxyError::NonCanonicalPath)
            }
            Err(e) => self.lenient_route(raw, ProxyError::BadPath(e)),
        }
    }

    /// Refuses a path that a lenient upstream would read as a guarded resource; passes
    /// anything else through as the client sent it.
    fn lenient_route<'p>(&self, raw: &'p str, error: ProxyError) -> Routing<'_, 'p> {
        let lenient = path::lenient(raw);
        match self
            .routes
            .iter()
            .find(|r| r.pattern.lenient_matches(&lenient))
        {
            Some(route) => Routing::Refused(route, error),
            None => Routing::Pass,
        }
    }

    /// The 400 for a guarded path spelled in a way that cannot be gated safely.
    fn refused(&self, route: &GuardedRoute, e: ProxyError, show: bool) -> Response<ProxyBody> {
        e.log(&route.label);
        route.metrics.observe(Outcome::Error, Duration::ZERO);
        let mut resp = error_response(e);
        if show {
            resp.headers_mut().insert(
                X_BLOOMGATE,
                HeaderValue::from_static(Outcome::Error.header_value()),
            );
        }
        resp
    }

    async fn guarded(
        &self,
        route: &GuardedRoute,
        segment: &str,
        req: &GuardedRequest<'_>,
        show: bool,
    ) -> (Response<ProxyBody>, Outcome) {
        let started = Instant::now();
        let Answer {
            served,
            counted,
            mut response,
        } = match self.decide(route, segment, req).await {
            Ok(answer) => answer,
            Err(e) => {
                e.log(&route.label);
                Answer::by(Outcome::Error, error_response(e))
            }
        };
        route.metrics.observe(counted, started.elapsed());
        if show {
            response
                .headers_mut()
                .insert(X_BLOOMGATE, HeaderValue::from_static(served.header_value()));
        }
        (response, served)
    }

    /// The pipeline for one guarded request: the stage that answered, the outcome to
    /// count, and the response.
    async fn decide(
        &self,
        route: &GuardedRoute,
        segment: &str,
        req: &GuardedRequest<'_>,
    ) -> Result<Answer, ProxyError> {
        let query = route.query.read(req.uri.query())?;
        let raw = match route.pattern.key_source() {
            KeySource::Segment(_) => route.pattern.segment_key(segment)?,
            // The name comes from the config, never from the request.
            KeySource::Query(name) => query.key.ok_or_else(|| KeyError::Missing(name.clone()))?,
        };
        let key = normalize(&route.normalize, raw)?;

        let mut bytes = KeyBytes::new();
        let verdict = match route.mode {
            RouteMode::Off => Verdict::MaybePresent,
            RouteMode::Enforce | RouteMode::Shadow => route.filter.verdict(bytes.of(&key)).await,
        };
        let shadow_absent = verdict == Verdict::Absent && route.mode == RouteMode::Shadow;
        if verdict == Verdict::Absent && !shadow_absent {
            if let Some(audit) = &self.audit {
                audit.offer(|| Sample::refused(&route.label, &route.origin, &route.filter, &key));
            }
            // Short-circuit: the key is certainly absent; no cache, no origin.
            return Ok(Answer::by(Outcome::Intercepted, not_found()));
        }
        let counting = Counting {
            failing_open: verdict == Verdict::Unavailable,
            shadow_absent,
        };
        let cache_key = CacheKey {
            route: route.id,
            key: key.to_owned_key(),
            variant: variant(query.forwarded, route.origin.forward_headers(), req.headers),
        };
        let credentials = http_cache::has_credentials(req.headers);
        match self.cache.lookup(&cache_key).await {
            Lookup::Hit(cached) if !credentials || cached.with_credentials => {
                let resp = replay(cached, req.headers);
                return Ok(self.count(route, &key, counting, Outcome::CacheHit, true, resp));
            }
            Lookup::NegativeHit => {
                let resp = not_found();
                return Ok(self.count(route, &key, counting, Outcome::NegativeHit, false, resp));
            }
            Lookup::Stale(cached) if !credentials || cached.with_credentials => {
                return Box::pin(self.through_origin(
                    route,
                    &key,
                    req,
                    cache_key,
                    credentials,
                    counting,
                    Some(cached),
                ))
                .await;
            }
            Lookup::Hit(_) | Lookup::Stale(_) | Lookup::Miss => {}
        }
        // Boxed: the origin call and the coalesced load are most of this future's state,
        // and every request's future is moved whole at least once, so the paths that
        // never reach the origin should not carry that state.
        Box::pin(self.through_origin(route, &key, req, cache_key, credentials, counting, None))
            .await
    }

    /// Refreshes a stale entry in a task of its own, unless a refresh of it runs already;
    /// the request that asked has been answered with the stale entry.
    fn revalidate_in_background(&self, route: &GuardedRoute, cache_key: CacheKey) {
        // Requests for a hot stale key arrive by the thousand: one task refreshes it.
        let Some(claim) = self.cache.claim_refresh(&cache_key) else {
            return;
        };
        let origin = Arc::clone(&route.origin);
        let filter = Arc::clone(&route.filter);
        let cache = self.cache.clone();
        let negative_ttl = route.negative_ttl;
        let label = Arc::clone(&route.label);
        tokio::spawn(async move {
            let _claim = claim;
            let key = cache_key.key.as_norm();
            let fence = filter.fence(&key);
            let negative = Negative {
                ttl: negative_ttl,
                still_absent: &|| fence.holds(),
            };
            let fetch = origin.fetch(&cache_key.key, cache_key.variant.as_deref());
            if let Loaded::Failed { error, .. } = cache
                .refresh(cache_key.clone(), negative, fetch, true)
                .await
            {
                tracing::debug!(route = %label, key = %cache_key.key, error = %error,
                    "background refresh of a stale entry failed; it is served until its windows end");
            }
        });
    }

    /// What to count for a request: fail-open and shadow verdicts override the stage
    /// that answered.
    fn count(
        &self,
        route: &GuardedRoute,
        key: &NormKey<'_>,
        counting: Counting,
        served: Outcome,
        found: bool,
        response: Response<ProxyBody>,
    ) -> Answer {
        if counting.failing_open {
            return Answer::by(Outcome::FailOpen, response);
        }
        if counting.shadow_absent {
            if found {
                self.false_negative(route, key);
            }
            return Answer {
                served,
                counted: Outcome::WouldIntercept,
                response,
            };
        }
        Answer::by(served, response)
    }

    /// The part of the pipeline past a cache miss: the false-positive budget, then the
    /// origin through the coalesced (or, with credentials, private) load.
    #[allow(clippy::too_many_arguments)]
    async fn through_origin(
        &self,
        route: &GuardedRoute,
        key: &NormKey<'_>,
        req: &GuardedRequest<'_>,
        cache_key: CacheKey,
        credentials: bool,
        counting: Counting,
        stale: Option<CachedResponse>,
    ) -> Result<Answer, ProxyError> {
        let answer = |served: Outcome, found: bool, resp: Response<ProxyBody>| {
            self.count(route, key, counting, served, found, resp)
        };
        let Counting {
            failing_open,
            shadow_absent,
        } = counting;
        // Past this point the request needs the origin, unless another request's load
        // answers it. A client that has used up its false-positive budget waits.
        let client = self
            .edge
            .budget
            .as_ref()
            .map(|b| (b, self.client(req.peer, req.headers)));
        let now = Instant::now();
        let past = stale.as_ref().and_then(|s| s.staleness(now));
        if let (Some(entry), Some(past)) = (&stale, past)
            && past < entry.meta.stale.while_revalidate
        {
            // Within stale-while-revalidate: answer now, refresh behind.
            self.revalidate_in_background(route, cache_key);
            let resp = replay_stale(entry.clone(), req.headers, now);
            return Ok(answer(Outcome::Stale, true, resp));
        }
        if let Some((budget, ip)) = client
            && let Allowance::Exhausted { retry_after_secs } = budget.check(ip)
        {
            tracing::debug!(route = %route.label, client = %ip, "false-positive budget exhausted");
            let resp = error_response(ProxyError::BudgetExhausted { retry_after_secs });
            return Ok(Answer::by(Outcome::Throttled, resp));
        }

        let fetch = async {
            let t = Instant::now();
            let fetched = route
                .origin
                .fetch(&cache_key.key, cache_key.variant.as_deref())
                .await;
            // A call the origin's guard refused never reached the origin: it is counted
            // in the origin's own metrics, not as an origin call of the route.
            match &fetched {
                Err(OriginError::Refused { .. }) => {}
                Err(_) => {
                    route.metrics.observe_origin(t.elapsed());
                    route.metrics.origin_error();
                }
                Ok(_) => route.metrics.observe_origin(t.elapsed()),
            }
            fetched
        };
        // Taken before the origin is asked: an admission of this key from here on means a
        // "not found" may predate the key's row, and must not be kept.
        let fence = route.filter.fence(key);
        let negative = Negative {
            ttl: route.negative_ttl,
            still_absent: &|| fence.holds(),
        };
        let loaded = if stale.is_some() {
            self.cache
                .refresh(cache_key.clone(), negative, fetch, false)
                .await
        } else if credentials {
            self.cache
                .load_private(cache_key.clone(), negative, fetch)
                .await
        } else {
            self.cache.load(cache_key.clone(), negative, fetch).await
        };
        if let (Loaded::Failed { error, .. }, Some(entry), Some(past)) = (&loaded, &stale, past)
            && past < entry.meta.stale.if_error
        {
            // Within stale-if-error: the copy beats an error.
            tracing::debug!(route = %route.label, key = %cache_key.key, error = %error,
                "origin failed; serving the stale entry");
            let resp = replay_stale(entry.clone(), req.headers, now);
            return Ok(answer(Outcome::Stale, true, resp));
        }
        match loaded {
            Loaded::Found { response, leader } => {
                let outcome = if leader {
                    Outcome::OriginFound
                } else {
                    Outcome::CacheHit
                };
                Ok(answer(outcome, true, replay(response, req.headers)))
            }
            Loaded::NotFound { leader } => {
                if leader && !failing_open && !shadow_absent {
                    tracing::debug!(route = %route.label, key = %cache_key.key, "false positive: negative entry stored");
                }
                let outcome = if leader {
                    if let Some((budget, ip)) = client {
                        budget.record(ip);
                    }
                    Outcome::FalsePositive
                } else {
                    Outcome::NegativeHit
                };
                Ok(answer(outcome, false, not_found()))
            }
            Loaded::Failed { error, .. } => Err(ProxyError::from(error)),
        }
    }

    /// Counts a false negative (shadow mode) and logs each key once.
    fn false_negative(&self, route: &GuardedRoute, key: &NormKey<'_>) {
        route.metrics.false_negative();
        let owned = key.to_owned_key();
        let mut seen = route
            .logged_false_negatives
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        if seen.len() < FALSE_NEGATIVE_LOG_LIMIT && seen.insert(owned.clone()) {
            tracing::error!(route = %route.label, filter = route.filter.name(), key = %owned,
                "false negative: the filter called this key absent but the origin has it");
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

/// What the pipeline did with one guarded request.
struct Answer {
    /// The stage that answered, told in the `x-bloomgate` header.
    served: Outcome,
    /// The outcome counted in the route's metrics: `served`, unless fail-open or a
    /// shadow verdict overrides it.
    counted: Outcome,
    /// The response to send.
    response: Response<ProxyBody>,
}

impl Answer {
    /// An answer counted as the stage that served it.
    fn by(outcome: Outcome, response: Response<ProxyBody>) -> Answer {
        Answer {
            served: outcome,
            counted: outcome,
            response,
        }
    }
}

/// How the filter's verdict changes what a request is counted as.
#[derive(Debug, Clone, Copy)]
struct Counting {
    /// No filter was loaded: the request went on without the filter.
    failing_open: bool,
    /// A shadow route's filter called the key absent.
    shadow_absent: bool,
}

/// Where `segment`, a slice of `path` (or an empty one from elsewhere), lies in it.
fn segment_range(path: &str, segment: &str) -> std::ops::Range<usize> {
    if segment.is_empty() {
        return 0..0;
    }
    let start = segment.as_ptr() as usize - path.as_ptr() as usize;
    start..start + segment.len()
}

/// What a route forwards besides the key, as part of the cache key; `None` (and no
/// allocation) when the request carries none of it.
fn variant(
    query: Option<String>,
    forward_headers: &[HeaderName],
    headers: &HeaderMap,
) -> Option<Arc<Variant>> {
    let sent = forward_headers.iter().any(|h| headers.contains_key(h));
    if query.is_none() && !sent {
        return None;
    }
    let headers = forward_headers
        .iter()
        .flat_map(|name| {
            headers
                .get_all(name)
                .iter()
                .map(move |v| (name.clone(), v.clone()))
        })
        .collect();
    Some(Arc::new(Variant { query, headers }))
}
