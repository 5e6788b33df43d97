//! The pipeline of a guarded route: one request's key → gate (the route's filter) →
//! cache → origin → response, each stage able to answer and stop, and what each request
//! is counted as. Routing has matched the route already (`route`); which requests take
//! this path, and the access log, are the handler's (`pipeline`).

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
use crate::config::{KeySource, RouteMode};
use crate::gate::Verdict;
use crate::key::{KeyBytes, KeyError, NormKey, normalize};
use crate::origin::http_cache;
use crate::origin::{CachedResponse, OriginError, Variant};
use crate::pipeline::budget::Allowance;
use crate::pipeline::error::ProxyError;
use crate::pipeline::outcome::Outcome;

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
