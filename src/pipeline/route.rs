//! Routing: which guarded route, if any, a request path names in any of its spellings.
//! A path that matches a route once made canonical goes through that route's pipeline;
//! one that only a lenient upstream would read as a guarded resource is refused with
//! 400; anything else is passed through as sent. The patterns themselves are compiled in
//! `pattern::route`; this module does not read keys or answer requests past the refusal.

use std::borrow::Cow;
use std::ops::Range;
use std::sync::Arc;
use std::time::Duration;

use http::{HeaderValue, Response};

use super::{Pipeline, ProxyBody, X_BLOOMGATE, error_response};
use crate::gate::Filter;
use crate::origin::Origin;
use crate::pipeline::error::ProxyError;
use crate::pipeline::metrics::RouteMetrics;
use crate::pipeline::outcome::Outcome;
use bloomgate_core::config::{Normalize, RouteMode};
use bloomgate_core::pattern::path;
use bloomgate_core::pattern::route::{PathPattern, QueryRules};

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
    pub logged_false_negatives:
        std::sync::Mutex<std::collections::HashSet<bloomgate_core::key::OwnedKey>>,
}

/// Where a request goes.
pub(super) enum Routing<'r, 'p> {
    /// Through the pipeline of this route, matched on this canonical path, whose key
    /// segment (empty for query keys) is at this range.
    Guarded(&'r GuardedRoute, Cow<'p, str>, Range<usize>),
    /// Refused with 400: a spelling of this route's resource that cannot be gated.
    Refused(&'r GuardedRoute, ProxyError),
    /// Not guarded: passed through as sent.
    Pass,
}

impl Pipeline {
    /// Which guarded route, if any, a request path names in any of its spellings.
    pub(super) fn route<'p>(&self, raw: &'p str) -> Routing<'_, 'p> {
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
    pub(super) fn refused(
        &self,
        route: &GuardedRoute,
        e: ProxyError,
        show: bool,
    ) -> Response<ProxyBody> {
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
}

/// Where `segment`, a slice of `path` (or an empty one from elsewhere), lies in it.
fn segment_range(path: &str, segment: &str) -> Range<usize> {
    if segment.is_empty() {
        return 0..0;
    }
    let start = segment.as_ptr() as usize - path.as_ptr() as usize;
    start..start + segment.len()
}
