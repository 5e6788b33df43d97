//! The pipeline of a guarded route: one request's key → gate (the route's filter) →
//! cache → origin → response, each stage able to answer and stop, and what each request
//! is counted as. Routing has matched the route already (`route`); which requests take
//! this path, and the access log, are the handler's (`pipeline`).
//!
//! Past the gate a request is a [`Guarded`]: the facts its stages read more than once
//! (its key, whether it carries credentials, what the gate's verdict makes it count as,
//! the client's address) are worked out there once, and each stage is a method of it.

use std::net::IpAddr;
use std::sync::Arc;
use std::time::Instant;

use http::header::HeaderName;
use http::{HeaderMap, HeaderValue, Response, Uri};

use super::response::{not_found, replay, replay_stale};
use super::route::GuardedRoute;
use super::{Pipeline, ProxyBody, X_BLOOMGATE, error_response};
use crate::audit::Sample;
use crate::cache::{CacheKey, Loaded, Lookup, Negative};
use crate::gate::Verdict;
use crate::origin::http_cache;
use crate::origin::{CachedResponse, OriginError, Variant};
use crate::pipeline::budget::{Allowance, Budget};
use crate::pipeline::error::ProxyError;
use crate::pipeline::outcome::Outcome;
use bloomgate_core::config::{KeySource, RouteMode};
use bloomgate_core::key::{KeyBytes, KeyError, NormKey, normalize};
use bloomgate_core::report::Chain;

/// Most false-negative keys remembered per route for log de-duplication.
const FALSE_NEGATIVE_LOG_LIMIT: usize = 1024;

/// The parts of a guarded request the pipeline reads.
pub struct GuardedRequest<'r> {
    /// The request target (its query is read; its path was matched already).
    pub uri: &'r Uri,
    /// The request headers (conditions, credentials, forwarded headers).
    pub headers: &'r HeaderMap,
    /// The socket peer.
    pub peer: IpAddr,
    /// The client's address, when the handler has worked it out already (for the access
    /// log or the outcome header), so that the pipeline does not work it out again.
    pub client: Option<IpAddr>,
}

impl Pipeline {
    /// Answers a request on `route` whose key segment (empty for query keys) is
    /// `segment`, counts it, and tells the client which stage answered when `show`.
    pub(super) async fn guarded(
        &self,
        route: &GuardedRoute,
        segment: &str,
        req: &GuardedRequest<'_>,
        show: bool,
    ) -> (Response<ProxyBody>, Outcome) {
        let started = Instant::now();
        let decided = self.decide(route, segment, req).await;
        finish(route, started, decided, show)
    }

    /// [`Pipeline::guarded`] for a request that needs no waiting: one the gate refuses
    /// (or whose key is malformed), or one a cache entry answers (a fresh hit, a
    /// negative entry) when the cache's lookup is ready at once; answered with what
    /// `guarded` would answer. `None` for every other request, which goes through
    /// `guarded` (and is looked up again there).
    pub(super) fn guarded_now(
        &self,
        route: &GuardedRoute,
        segment: &str,
        req: &GuardedRequest<'_>,
        started: Instant,
        show: impl FnOnce() -> bool,
    ) -> Option<(Response<ProxyBody>, Outcome)> {
        let decided = match key_of(route, segment, req) {
            Ok((key, forwarded)) => {
                let verdict = match route.mode {
                    RouteMode::Off => Verdict::MaybePresent,
                    RouteMode::Enforce | RouteMode::Shadow => {
                        route.filter.verdict_now(KeyBytes::new().of(&key))?
                    }
                };
                match self.refusal(route, verdict, &key) {
                    Some(refused) => Ok(refused),
                    None => {
                        let (request, cache_key) =
                            self.past_gate(route, req, key, forwarded, verdict);
                        let found = self.cache.lookup_now(&cache_key)?;
                        Ok(request.cached_answer(found).ok()?)
                    }
                }
            }
            Err(e) => Err(e),
        };
        Some(finish(route, started, decided, show()))
    }

    /// The pipeline for one guarded request: the stage that answered, the outcome to
    /// count, and the response. The gate answers here; the stages past it are
    /// [`Guarded`]'s.
    async fn decide(
        &self,
        route: &GuardedRoute,
        segment: &str,
        req: &GuardedRequest<'_>,
    ) -> Result<Answer, ProxyError> {
        let (key, forwarded) = key_of(route, segment, req)?;
        let mut bytes = KeyBytes::new();
        let verdict = match route.mode {
            RouteMode::Off => Verdict::MaybePresent,
            RouteMode::Enforce | RouteMode::Shadow => route.filter.verdict(bytes.of(&key)).await,
        };
        if let Some(refused) = self.refusal(route, verdict, &key) {
            return Ok(refused);
        }
        let (request, cache_key) = self.past_gate(route, req, key, forwarded, verdict);
        request.look_up(cache_key).await
    }

    /// A request the gate let through with `verdict`, and the key its answer is cached
    /// under.
    fn past_gate<'a>(
        &'a self,
        route: &'a GuardedRoute,
        req: &'a GuardedRequest<'a>,
        key: NormKey<'a>,
        forwarded: Option<String>,
        verdict: Verdict,
    ) -> (Guarded<'a>, CacheKey) {
        let cache_key = CacheKey {
            route: route.id,
            key: key.to_owned_key(),
            variant: variant(forwarded, route.origin.forward_headers(), req.headers),
        };
        let request = Guarded {
            pipeline: self,
            route,
            req,
            credentials: http_cache::has_credentials(req.headers),
            counting: Counting {
                failing_open: verdict == Verdict::Unavailable,
                shadow_absent: verdict == Verdict::Absent && route.mode == RouteMode::Shadow,
            },
            client: req.client,
            key,
        };
        (request, cache_key)
    }

    /// The gate's answer when `verdict` refuses `key` on `route`: certainly absent, and
    /// not a shadow route's.
    fn refusal(&self, route: &GuardedRoute, verdict: Verdict, key: &NormKey<'_>) -> Option<Answer> {
        if verdict != Verdict::Absent || route.mode == RouteMode::Shadow {
            return None;
        }
        if let Some(audit) = &self.audit {
            audit.offer(|| Sample::refused(&route.label, &route.origin, &route.filter, key));
        }
        // Short-circuit: the key is certainly absent; no cache, no origin.
        Some(Answer::by(Outcome::Intercepted, not_found()))
    }
}

/// The key of a request on `route` (from its key `segment` or its query), normalised,
/// and what else of the query the route forwards.
fn key_of<'r>(
    route: &GuardedRoute,
    segment: &'r str,
    req: &GuardedRequest<'r>,
) -> Result<(NormKey<'r>, Option<String>), ProxyError> {
    let query = route.query.read(req.uri.query())?;
    let raw = match route.pattern.key_source() {
        KeySource::Segment(_) => route.pattern.segment_key(segment)?,
        // The name comes from the config, never from the request.
        KeySource::Query(name) => query.key.ok_or_else(|| KeyError::Missing(name.clone()))?,
    };
    Ok((normalize(&route.normalize, raw)?, query.forwarded))
}

/// Counts what the pipeline did with a request that started at `started` on `route`,
/// and makes its response (telling the client which stage answered when `show`).
fn finish(
    route: &GuardedRoute,
    started: Instant,
    decided: Result<Answer, ProxyError>,
    show: bool,
) -> (Response<ProxyBody>, Outcome) {
    let Answer {
        served,
        counted,
        mut response,
    } = decided.unwrap_or_else(|e| {
        e.log(&route.label);
        Answer::by(Outcome::Error, error_response(e))
    });
    route.metrics.observe(counted, started.elapsed());
    if show {
        response
            .headers_mut()
            .insert(X_BLOOMGATE, HeaderValue::from_static(served.header_value()));
    }
    (response, served)
}

/// One guarded request the gate let through, on its way through the cache and the
/// origin: what every stage past the gate reads, worked out once.
struct Guarded<'a> {
    pipeline: &'a Pipeline,
    route: &'a GuardedRoute,
    req: &'a GuardedRequest<'a>,
    /// The key, normalised.
    key: NormKey<'a>,
    /// Whether the request carries credentials (they keep it from shared answers).
    credentials: bool,
    /// What the gate's verdict makes the request count as.
    counting: Counting,
    /// The client's address, once a stage has needed it (see [`Guarded::client`]).
    client: Option<IpAddr>,
}

impl<'a> Guarded<'a> {
    /// The cache stage: an entry answers, a stale one (or none) sends the request on to
    /// the origin.
    async fn look_up(self, cache_key: CacheKey) -> Result<Answer, ProxyError> {
        let found = self.pipeline.cache.lookup(&cache_key).await;
        // Boxed: the origin call and the coalesced load are most of this future's state,
        // and every request's future is moved whole at least once, so the paths that
        // never reach the origin should not carry that state.
        match self.cached_answer(found) {
            Ok(answer) => Ok(answer),
            Err(stale) => Box::pin(self.through_origin(cache_key, stale)).await,
        }
    }

    /// The answer the cache makes on its own (a fresh entry this request may have, a
    /// negative entry); otherwise the stale entry the origin stage may fall back on.
    fn cached_answer(&self, found: Lookup) -> Result<Answer, Option<CachedResponse>> {
        let shareable = |cached: &CachedResponse| !self.credentials || cached.with_credentials;
        match found {
            Lookup::Hit(cached) if shareable(&cached) => {
                let resp = replay(cached, self.req.headers);
                Ok(self.count(Outcome::CacheHit, true, resp))
            }
            Lookup::NegativeHit => Ok(self.count(Outcome::NegativeHit, false, not_found())),
            Lookup::Stale(cached) if shareable(&cached) => Err(Some(cached)),
            Lookup::Hit(_) | Lookup::Stale(_) | Lookup::Miss => Err(None),
        }
    }

    /// The part of the pipeline past a cache miss: the false-positive budget, then the
    /// origin through the coalesced (or, with credentials, private) load. A stale entry
    /// answers instead while its windows allow.
    async fn through_origin(
        mut self,
        cache_key: CacheKey,
        stale: Option<CachedResponse>,
    ) -> Result<Answer, ProxyError> {
        let now = Instant::now();
        let past = stale.as_ref().and_then(|s| s.staleness(now));
        if let (Some(entry), Some(past)) = (&stale, past)
            && past < entry.meta.stale.while_revalidate
        {
            // Within stale-while-revalidate: answer now, refresh behind.
            self.revalidate_in_background(cache_key);
            return Ok(self.serve_stale(entry, now));
        }
        // Past this point the request needs the origin, unless another request's load
        // answers it. A client that has used up its false-positive budget waits.
        if let Some(throttled) = self.over_budget() {
            return Ok(throttled);
        }
        let loaded = self.load(&cache_key, stale.is_some()).await;
        if let (Loaded::Failed { error, .. }, Some(entry), Some(past)) = (&loaded, &stale, past)
            && past < entry.meta.stale.if_error
        {
            // Within stale-if-error: the copy beats an error.
            tracing::debug!(route = %self.route.label, key = %cache_key.key, error = %Chain(error),
                "origin failed; serving the stale entry");
            return Ok(self.serve_stale(entry, now));
        }
        self.loaded(loaded, &cache_key)
    }

    /// The 429 for a client that has used up its false-positive budget, if it has.
    fn over_budget(&mut self) -> Option<Answer> {
        let (budget, ip) = self.budget()?;
        let Allowance::Exhausted { retry_after_secs } = budget.check(ip) else {
            return None;
        };
        tracing::debug!(route = %self.route.label, client = %ip, "false-positive budget exhausted");
        let resp = error_response(ProxyError::BudgetExhausted { retry_after_secs });
        Some(Answer::by(Outcome::Throttled, resp))
    }

    /// Asks the origin through the cache: a refresh of a stale entry, a private load
    /// for a request with credentials, the coalesced load otherwise.
    async fn load(&self, cache_key: &CacheKey, refresh: bool) -> Loaded {
        let route = self.route;
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
        let fence = route.filter.fence(&self.key);
        let negative = Negative {
            ttl: route.negative_ttl,
            still_absent: &|| fence.holds(),
        };
        let cache = &self.pipeline.cache;
        if refresh {
            cache
                .refresh(cache_key.clone(), negative, fetch, false)
                .await
        } else if self.credentials {
            cache.load_private(cache_key.clone(), negative, fetch).await
        } else {
            cache.load(cache_key.clone(), negative, fetch).await
        }
    }

    /// The answer for what the origin (or another request's load) said.
    fn loaded(mut self, loaded: Loaded, cache_key: &CacheKey) -> Result<Answer, ProxyError> {
        match loaded {
            Loaded::Found { response, leader } => {
                let outcome = if leader {
                    Outcome::OriginFound
                } else {
                    Outcome::CacheHit
                };
                let resp = replay(response, self.req.headers);
                Ok(self.count(outcome, true, resp))
            }
            Loaded::NotFound { leader } => {
                let Counting {
                    failing_open,
                    shadow_absent,
                } = self.counting;
                if leader && !failing_open && !shadow_absent {
                    tracing::debug!(route = %self.route.label, key = %cache_key.key, "false positive: negative entry stored");
                }
                let outcome = if leader {
                    if let Some((budget, ip)) = self.budget() {
                        budget.record(ip);
                    }
                    Outcome::FalsePositive
                } else {
                    Outcome::NegativeHit
                };
                Ok(self.count(outcome, false, not_found()))
            }
            Loaded::Failed { error, .. } => Err(ProxyError::from(error)),
        }
    }

    /// A stale entry as the answer, counted as such.
    fn serve_stale(&self, entry: &CachedResponse, now: Instant) -> Answer {
        let resp = replay_stale(entry.clone(), self.req.headers, now);
        self.count(Outcome::Stale, true, resp)
    }

    /// Refreshes a stale entry in a task of its own, unless a refresh of it runs already;
    /// the request that asked has been answered with the stale entry.
    fn revalidate_in_background(&self, cache_key: CacheKey) {
        let route = self.route;
        // Requests for a hot stale key arrive by the thousand: one task refreshes it.
        let Some(claim) = self.pipeline.cache.claim_refresh(&cache_key) else {
            return;
        };
        let origin = Arc::clone(&route.origin);
        let filter = Arc::clone(&route.filter);
        let cache = self.pipeline.cache.clone();
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
                tracing::debug!(route = %label, key = %cache_key.key, error = %Chain(&error),
                    "background refresh of a stale entry failed; it is served until its windows end");
            }
        });
    }

    /// What to count for a request: fail-open and shadow verdicts override the stage
    /// that answered.
    fn count(&self, served: Outcome, found: bool, response: Response<ProxyBody>) -> Answer {
        if self.counting.failing_open {
            return Answer::by(Outcome::FailOpen, response);
        }
        if self.counting.shadow_absent {
            if found {
                self.false_negative();
            }
            return Answer {
                served,
                counted: Outcome::WouldIntercept,
                response,
            };
        }
        Answer::by(served, response)
    }

    /// Counts a false negative (shadow mode) and logs each key once.
    fn false_negative(&self) {
        let route = self.route;
        route.metrics.false_negative();
        let owned = self.key.to_owned_key();
        let mut seen = route
            .logged_false_negatives
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        if seen.len() < FALSE_NEGATIVE_LOG_LIMIT && seen.insert(owned.clone()) {
            tracing::error!(route = %route.label, filter = route.filter.name(), key = %owned,
                "false negative: the filter called this key absent but the origin has it");
        }
    }

    /// The false-positive budget and the client it is kept for, when one is configured.
    fn budget(&mut self) -> Option<(&'a Budget, IpAddr)> {
        let budget = self.pipeline.edge.budget.as_deref()?;
        Some((budget, self.client()))
    }

    /// The client's address, worked out the first time a stage asks.
    fn client(&mut self) -> IpAddr {
        let (pipeline, req) = (self.pipeline, self.req);
        *self
            .client
            .get_or_insert_with(|| pipeline.client(req.peer, req.headers))
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
