//! The long-lived parts of a running bloomgate (metrics, response cache, database pool,
//! origin guards, upstream client, filters, admission path, fleet, TLS, access log) and
//! the assembly of a data-plane [`Pipeline`] over them from a compiled config. A start
//! assembles the first pipeline; a reload (see `reload`) assembles the next one over the
//! same parts, replacing only the parts whose settings changed. Nothing here answers a
//! request or reads a file.

mod metrics;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;

use prometheus::Registry;

use crate::audit::Sampler;
use crate::cache::ResponseCache;
use crate::fleet::Fleet;
use crate::gate::Filter;
use crate::gate::admit::Admit;
use crate::origin::client::Upstream;
use crate::origin::guard::OriginGuard;
use crate::origin::{Origin, ResponseMeta, SqlOrigin, UpstreamOrigin};
use crate::pipeline::budget::Budget;
use crate::pipeline::write_through::WriteThrough;
use crate::pipeline::{EdgePolicy, GuardedRoute, Pipeline};
use crate::server::Tls;
use bloomgate_core::access_log::AccessLog;
use bloomgate_core::config::{
    AccessLogConfig, Compiled, CompiledFilter, CompiledOrigin, CompiledUpstream, Config,
    RouteConfig, WatermarkKind,
};
use bloomgate_core::db::Db;

pub use metrics::Metrics;

/// Why a pipeline could not be assembled.
#[derive(Debug, thiserror::Error)]
pub enum AssembleError {
    /// A route's origin needs a section the compiled config lacks.
    #[error("route {route}: its origin needs [{section}]")]
    MissingSection {
        /// The route's label.
        route: String,
        /// The missing section.
        section: &'static str,
    },
    /// A route or rule names a filter that has not been set up.
    #[error("filter {0} is not set up")]
    MissingFilter(String),
    /// The access log file could not be opened.
    #[error(transparent)]
    AccessLog(#[from] bloomgate_core::access_log::AccessLogError),
}

/// The upstream's client and guard, with the settings the client was made from.
pub struct UpstreamPart {
    /// `[upstream]` as compiled.
    pub settings: CompiledUpstream,
    /// The connection pool.
    pub client: Arc<Upstream>,
    /// Its breaker and concurrency bound.
    pub guard: Arc<OriginGuard>,
}

/// Everything a pipeline is assembled over.
pub struct Stages {
    /// Where metrics are registered.
    pub registry: Registry,
    /// Metric handles.
    pub metrics: Metrics,
    /// The response cache (outlives every pipeline).
    pub cache: Arc<ResponseCache>,
    /// The database pool, with `[database]`.
    pub db: Option<Db>,
    /// The database's breaker and bound, with `[database]`.
    pub database_guard: Option<Arc<OriginGuard>>,
    /// The upstream, with `[upstream]`.
    pub upstream: Option<UpstreamPart>,
    /// Filters by name.
    pub filters: BTreeMap<String, Arc<Filter>>,
    /// Stable ids of route names.
    pub route_ids: RouteIds,
    /// The admission path.
    pub admit: Arc<Admit>,
    /// Fleet mode, when configured.
    pub fleet: Option<Arc<Fleet>>,
    /// TLS of the data plane.
    pub tls: Option<Arc<Tls>>,
    /// The per-client false-positive budget, when configured.
    pub budget: Option<Arc<Budget>>,
    /// The access log and the settings it was opened with.
    pub access_log: Option<(AccessLogConfig, Arc<AccessLog>)>,
    /// The audit's sampler of refused keys, when the audit is on.
    pub audit: Option<Arc<Sampler>>,
}

impl Stages {
    /// Makes, keeps or reconfigures the database guard and the upstream client and guard
    /// for `compiled`: a guard keeps its breaker state; the client is made again only
    /// when `[upstream]` changed. Returns what changed, for the reload's report.
    pub fn set_origins(
        &mut self,
        config: &Config,
        upstream: Option<&CompiledUpstream>,
    ) -> Vec<String> {
        let mut changes = Vec::new();
        // Each serving thread gets a connection pool of its own (see `Upstream`).
        let serving_threads = config.server.serving_threads();
        match (&self.database_guard, &config.database) {
            (Some(guard), Some(d)) => guard.reconfigure(&d.limits()),
            (None, Some(d)) => {
                self.database_guard = Some(Arc::new(OriginGuard::new(
                    "database",
                    &d.limits(),
                    self.metrics.origins.handles("database"),
                )));
            }
            (_, None) => self.database_guard = None,
        }
        let settings_of = |u: &CompiledUpstream| serde_json::to_value(&u.settings).ok();
        self.upstream = match (self.upstream.take(), upstream) {
            (Some(part), Some(u)) if settings_of(&part.settings) == settings_of(u) => Some(part),
            (Some(part), Some(u)) => {
                part.guard.reconfigure(&u.settings.limits());
                changes.push("upstream: new connection pool".to_owned());
                Some(UpstreamPart {
                    settings: u.clone(),
                    client: Arc::new(Upstream::new(u, serving_threads)),
                    guard: part.guard,
                })
            }
            (None, Some(u)) => Some(UpstreamPart {
                settings: u.clone(),
                client: Arc::new(Upstream::new(u, serving_threads)),
                guard: Arc::new(OriginGuard::new(
                    "upstream",
                    &u.settings.limits(),
                    self.metrics.origins.handles("upstream"),
                )),
            }),
            (_, None) => None,
        };
        changes
    }

    /// A new filter for `compiled`, with its metric handles (the same series as a filter
    /// of the same name before it).
    pub fn new_filter(&self, compiled: &CompiledFilter) -> Arc<Filter> {
        let f = compiled;
        tracing::debug!(filter = %f.name, bits = f.params.bits, hashes = f.params.hashes,
            expected_items = f.params.expected_items, "filter sized");
        // In binlog mode the stream's heartbeat is what keeps the last sync fresh.
        let sync_interval = f.settings.sync.as_ref().map(|s| match s.watermark {
            WatermarkKind::Binlog => s.binlog.heartbeat,
            _ => s.interval,
        });
        let handles =
            self.metrics
                .filters
                .handles(&f.name, f.settings.false_positive_rate, sync_interval);
        Arc::new(Filter::new(
            &f.name,
            f.settings.clone(),
            f.binlog.clone(),
            handles,
        ))
    }

    /// Opens the access log `config` asks for, or keeps the open one if its settings are
    /// the same. Nothing is replaced until [`Stages::assemble`].
    pub fn access_log_for(
        &self,
        config: Option<&AccessLogConfig>,
    ) -> Result<Option<(AccessLogConfig, Arc<AccessLog>)>, AssembleError> {
        let Some(wanted) = config else {
            return Ok(None);
        };
        let same =
            |a: &AccessLogConfig| serde_json::to_value(a).ok() == serde_json::to_value(wanted).ok();
        match &self.access_log {
            Some((open, log)) if same(open) => Ok(Some((open.clone(), Arc::clone(log)))),
            _ => {
                let log = AccessLog::start(wanted, self.metrics.access_log_lines())?;
                Ok(Some((wanted.clone(), Arc::new(log))))
            }
        }
    }

    /// Assembles the pipeline of `compiled` over these parts (the filters it names must
    /// be set up, and the origins set with [`Stages::set_origins`]), points the admission
    /// path at its routes, and drops the cached answers of routes that are gone or now
    /// answer differently. Returns the config it was compiled from.
    pub async fn assemble(
        &mut self,
        compiled: Compiled,
        access_log: Option<(AccessLogConfig, Arc<AccessLog>)>,
    ) -> Result<(Pipeline, Config), AssembleError> {
        let Compiled {
            config,
            filters: compiled_filters,
            routes: compiled_routes,
            write_through: compiled_write_through,
            trusted_proxies,
            outcome_header_clients,
            ..
        } = compiled;
        let filter_at = |i: usize| -> Result<Arc<Filter>, AssembleError> {
            let name = &compiled_filters[i].name;
            self.filters
                .get(name)
                .cloned()
                .ok_or_else(|| AssembleError::MissingFilter(name.clone()))
        };
        let has_variants = compiled_routes.iter().any(|r| r.has_variants());
        let mut routes = Vec::with_capacity(compiled_routes.len());
        let mut ids = Vec::with_capacity(compiled_routes.len());
        for (r, written) in compiled_routes.into_iter().zip(&config.routes) {
            let filter = filter_at(r.filter)?;
            let origin = match (r.origin, &self.db, &self.database_guard, &self.upstream) {
                (CompiledOrigin::Sql { query, timeout }, Some(db), Some(guard), _) => {
                    Origin::Sql(SqlOrigin {
                        db: db.clone(),
                        query,
                        timeout,
                        answer: ResponseMeta::json_rows(r.ttl, r.stale),
                        guard: Arc::clone(guard),
                    })
                }
                (
                    CompiledOrigin::Upstream {
                        not_found,
                        forward_headers,
                        headers,
                    },
                    _,
                    _,
                    Some(upstream),
                ) => Origin::Upstream(UpstreamOrigin {
                    upstream: Arc::clone(&upstream.client),
                    pattern: r.pattern.clone(),
                    not_found,
                    ttl: r.ttl,
                    stale: r.stale,
                    forward_headers,
                    headers,
                    guard: Arc::clone(&upstream.guard),
                }),
                // `Config::compile` refuses both; a `Compiled` changed afterwards may not.
                (CompiledOrigin::Sql { .. }, ..) => {
                    return Err(AssembleError::MissingSection {
                        route: r.label.to_string(),
                        section: "database",
                    });
                }
                (CompiledOrigin::Upstream { .. }, ..) => {
                    return Err(AssembleError::MissingSection {
                        route: r.label.to_string(),
                        section: "upstream",
                    });
                }
            };
            let id = self.route_ids.assign(&r.label, answer_shape(written));
            ids.push((Arc::from(filter.name()), id));
            routes.push(GuardedRoute {
                id,
                metrics: self
                    .metrics
                    .routes
                    .handles(&r.label, filter.name(), r.mode.as_str()),
                label: r.label,
                pattern: r.pattern,
                normalize: r.normalize,
                filter,
                origin: Arc::new(origin),
                negative_ttl: r.negative_ttl,
                mode: r.mode,
                query: r.query,
                logged_false_negatives: std::sync::Mutex::new(HashSet::new()),
            });
        }
        let mut write_through = Vec::with_capacity(compiled_write_through.len());
        for rule in compiled_write_through {
            let filter = filter_at(rule.filter)?;
            let added = self.metrics.write_through(filter.name());
            write_through.push(WriteThrough::from_compiled(
                rule,
                filter,
                Arc::clone(&self.admit),
                added,
            ));
        }
        self.cache.set_has_variants(has_variants);
        self.admit.set_routes(ids);
        for retired in self.route_ids.retire_unused() {
            self.cache.invalidate_route(retired).await;
        }
        self.access_log = access_log;
        let edge = EdgePolicy {
            trusted_proxies,
            outcome_header: config.server.outcome_header,
            outcome_header_clients,
            budget: self.budget.clone(),
            access_log: self.access_log.as_ref().map(|(_, log)| Arc::clone(log)),
        };
        let pipeline = Pipeline::new(
            routes,
            Arc::clone(&self.cache),
            self.upstream.as_ref().map(|u| Arc::clone(&u.client)),
            config.server.max_body_bytes,
            self.metrics.passthrough(),
            write_through,
            edge,
        )
        .with_audit(self.audit.clone());
        Ok((pipeline, config))
    }
}

/// What makes a route's answers what they are, apart from how long they are kept: two
/// configurations of a route with the same shape may share cached entries.
fn answer_shape(route: &RouteConfig) -> String {
    let mut value = serde_json::to_value(route).unwrap_or_default();
    if let Some(fields) = value.as_object_mut() {
        for kept in [
            "ttl",
            "negative_ttl",
            "stale_if_error",
            "stale_while_revalidate",
            "mode",
        ] {
            fields.remove(kept);
        }
    }
    value.to_string()
}

/// Stable ids of route names, for cache keys: a route keeps its id across reloads, in
/// whatever position it is written, for as long as its answers are shaped the same; a
/// route whose origin, key or forwarded parts change gets a new id, so that nothing
/// cached for its old form is served for its new one. Ids are never reused.
#[derive(Debug, Default)]
pub struct RouteIds {
    by_name: HashMap<Arc<str>, Assigned>,
    next: u32,
    /// Ids left behind by shape changes since the last `retire_unused`.
    retired: Vec<u32>,
}

#[derive(Debug)]
struct Assigned {
    id: u32,
    shape: String,
    /// Named by the assembly in progress.
    used: bool,
}

impl RouteIds {
    /// The id of route `name` with answers of `shape`.
    pub fn assign(&mut self, name: &Arc<str>, shape: String) -> u32 {
        if let Some(a) = self.by_name.get_mut(name)
            && a.shape == shape
        {
            a.used = true;
            return a.id;
        }
        let id = self.next;
        self.next = self.next.wrapping_add(1);
        // A changed shape leaves its old id behind, unused, for `retire_unused`.
        let old = self.by_name.insert(
            Arc::clone(name),
            Assigned {
                id,
                shape,
                used: true,
            },
        );
        if let Some(old) = old {
            self.retired.push(old.id);
        }
        id
    }

    /// Ends an assembly: forgets the routes it did not name and returns every id no
    /// route has any more (their cached entries can go).
    pub fn retire_unused(&mut self) -> Vec<u32> {
        let mut gone = std::mem::take(&mut self.retired);
        self.by_name.retain(|_, a| {
            if !a.used {
                gone.push(a.id);
            }
            std::mem::replace(&mut a.used, false)
        });
        gone
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_route_keeps_its_id_until_its_shape_changes_and_ids_are_not_reused() {
        let mut ids = RouteIds::default();
        let (a, b): (Arc<str>, Arc<str>) = (Arc::from("a"), Arc::from("b"));
        let first_a = ids.assign(&a, "x".into());
        let first_b = ids.assign(&b, "y".into());
        assert_ne!(first_a, first_b);
        assert!(ids.retire_unused().is_empty());
        // Another order, the same shapes: the same ids.
        assert_eq!(ids.assign(&b, "y".into()), first_b);
        assert_eq!(ids.assign(&a, "x".into()), first_a);
        assert!(ids.retire_unused().is_empty());
        // `a` answers differently now; `b` is gone.
        let second_a = ids.assign(&a, "z".into());
        assert!(second_a != first_a && second_a != first_b);
        let mut gone = ids.retire_unused();
        gone.sort_unstable();
        assert_eq!(gone, [first_a, first_b]);
        // `b` comes back: a new id, not its old one.
        let second_b = ids.assign(&b, "y".into());
        assert!(![first_a, first_b, second_a].contains(&second_b));
    }

    #[test]
    fn how_long_answers_are_kept_is_not_part_of_their_shape() {
        let route = |extra: &str| -> RouteConfig {
            let toml = format!(
                "[upstream]\nurl = \"http://127.0.0.1:1\"\n[database]\nurl = \"sqlite://x.db\"\n[filters.f]\n\
                 source_query = \"SELECT k FROM t\"\nexpected_items = 10\n[[routes]]\n\
                 path = \"/p/{{id}}\"\nkey = {{ segment = \"id\" }}\nfilter = \"f\"\n\
                 origin = {{ kind = \"upstream\" }}\n{extra}"
            );
            let config = bloomgate_core::config::Config::from_toml_str(&toml).expect("a config");
            config.routes[0].clone()
        };
        let plain = answer_shape(&route(""));
        assert_eq!(
            plain,
            answer_shape(&route("ttl = \"5s\"\nmode = \"shadow\""))
        );
        assert_ne!(plain, answer_shape(&route("forward_query = [\"lang\"]")));
    }
}
