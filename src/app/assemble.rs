//! Building a bloomgate from a compiled config: the metrics, the TLS acceptor, the
//! database pool, the cache, the admission path (with its audit and fleet hooks), the
//! per-client budget, every filter and the pipeline over them, the reloader and the
//! admin handler; then both listeners are bound. Nothing runs yet.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;

use prometheus::Registry;

use super::sockets::{DataSockets, bind};
use super::{App, AppError};
use crate::admin::Admin;
use crate::audit::Audit;
use crate::cache::ResponseCache;
use crate::fleet::Fleet;
use crate::fleet::metrics::FleetMetrics;
use crate::gate::Filter;
use crate::gate::admit::Admit;
use crate::pipeline::Proxy;
use crate::pipeline::budget::Budget;
use crate::reload::Reloader;
use crate::reload::metrics::ReloadMetrics;
use crate::server::{ConnectionMetrics, ServingRuntimes, Tls};
use crate::stages::{Metrics, RouteIds, Stages};
use bloomgate_core::config::Compiled;
use bloomgate_core::db::{Db, PoolSettings};
use bloomgate_core::report::Chain;

/// Local changes waiting for the fleet's appender; past this, a change is dropped
/// (counted) rather than making a request wait.
const OUTBOX_CHANNEL: usize = 65_536;

impl App {
    pub(super) async fn assemble(
        mut compiled: Compiled,
        registry: Registry,
        path: Option<PathBuf>,
    ) -> Result<App, AppError> {
        let metrics = Metrics::new(&registry)?;
        let reload_metrics = ReloadMetrics::register(&registry)?;
        let first_tls = compiled.tls.take();
        let config = compiled.config();
        let connections =
            ConnectionMetrics::register(&registry, first_tls.is_some(), config.server.http2)?;
        let tls = match first_tls {
            Some(t) => Some(Arc::new(Tls::new(
                t.files,
                t.certificate,
                config.server.http2,
                Some(connections.clone()),
            )?)),
            None => None,
        };
        let db = match &config.database {
            Some(d) => Some(Db::connect_lazy(
                &d.url,
                &PoolSettings {
                    max_connections: d.max_connections,
                    min_connections: d.min_connections,
                    acquire_timeout: d.acquire_timeout,
                    idle_timeout: Some(std::time::Duration::from_secs(300)),
                },
            )?),
            None => None,
        };
        if let Some(db) = &db {
            check_binlog_sources(db, &compiled).await?;
        }
        let has_variants = compiled.routes().iter().any(|r| r.has_variants());
        let cache = Arc::new(ResponseCache::new(&config.cache, has_variants));
        let mut admit = Admit::new(Arc::clone(&cache), Vec::new());
        let labels = compiled.routes().iter().map(|r| &*r.label);
        let audit = Audit::new(&config.audit, labels, config.fleet.is_some(), &registry)?;
        if let Some(audit) = &audit {
            admit = admit.with_watcher(audit.ledger.clone());
        }
        let (sampler, auditor) = audit.map(|a| (a.sampler, a.auditor)).unzip();
        let mut fleet_parts = None;
        if let Some(fleet) = &config.fleet {
            let fleet_metrics = FleetMetrics::register(&registry)?;
            let (tx, rx) = tokio::sync::mpsc::channel(OUTBOX_CHANNEL);
            let dropped = fleet_metrics.clone();
            admit = admit.with_outbox(tx, move |n| dropped.entries("dropped", n));
            fleet_parts = Some((fleet.clone(), rx, fleet_metrics));
        }
        let budget = match &config.false_positive_budget {
            Some(b) => {
                crate::pipeline::budget::register(&registry, b.per_client, b.window)?;
                Some(Arc::new(Budget::new(b.per_client, b.window, b.slots)))
            }
            None => None,
        };
        let mut stages = Stages {
            registry,
            metrics,
            cache,
            db,
            database_guard: None,
            upstream: None,
            filters: BTreeMap::new(),
            route_ids: RouteIds::default(),
            admit: Arc::new(admit),
            fleet: None,
            tls: tls.clone(),
            budget,
            access_log: None,
            audit: sampler.map(Arc::new),
        };
        stages.set_origins(compiled.config(), compiled.upstream());
        for f in compiled.filters() {
            let filter = stages.new_filter(f);
            stages.filters.insert(f.name.clone(), filter);
        }
        // In the order of `Compiled::filters`, as the fleet numbers them.
        let ordered: Vec<Arc<Filter>> = compiled
            .filters()
            .iter()
            .filter_map(|f| stages.filters.get(&f.name).cloned())
            .collect();
        stages.fleet = match (fleet_parts, &stages.db) {
            (Some((settings, rx, fleet_metrics)), Some(db)) => Some(Arc::new(Fleet::new(
                settings,
                &ordered,
                Arc::clone(&stages.admit),
                db.clone(),
                rx,
                fleet_metrics,
            )?)),
            (Some(_), None) => return Err(AppError::FleetWithoutDatabase),
            (None, _) => None,
        };
        let access_log = stages.access_log_for(compiled.config().access_log.as_ref())?;
        let (pipeline, config) = stages.assemble(compiled, access_log).await?;
        let proxy = Arc::new(Proxy::new(pipeline));
        let admin_parts = (
            stages.registry.clone(),
            stages.metrics.clone(),
            Arc::clone(&stages.admit),
            stages.fleet.clone(),
        );
        let reloader = Reloader::new(
            path,
            stages,
            config.clone(),
            Arc::clone(&proxy),
            reload_metrics,
        );
        let (registry, metrics, admit, fleet) = admin_parts;
        let audit_admit = Arc::clone(&admit);
        let admin_handler = Arc::new(Admin {
            reloader: reloader.clone(),
            proxy: Arc::clone(&proxy),
            admit,
            registry,
            metrics,
            fleet,
            serving_runtimes: ServingRuntimes::default(),
        });
        let data = DataSockets::bind(&config.server).await?;
        let admin = bind(config.admin.listen).await?;
        Ok(App {
            config,
            data,
            admin,
            proxy,
            admin_handler,
            reloader,
            tls,
            connections,
            auditor: auditor.map(|a| (a, audit_admit)),
        })
    }
}

/// Refuses to start when a filter in binlog mode cannot follow the server's binary log
/// (not in ROW format, no key column, …), naming what to change. A server that cannot
/// be reached now is no reason to stay down: the filters fail open until it answers, and
/// the stream checks again before it reads.
async fn check_binlog_sources(db: &Db, compiled: &Compiled) -> Result<(), AppError> {
    for f in compiled.filters() {
        let Some(source) = &f.binlog else { continue };
        match db.binlog_check(&source.table).await {
            Ok((server, key)) => {
                tracing::info!(filter = %f.name, server = %server.version, table = %source.table,
                    key_column = %key.column, "binlog mode: the server's binary log can be followed");
            }
            Err(e) if e.is_unavailable() => {
                tracing::warn!(filter = %f.name, error = %Chain(&e),
                    "binlog mode: the database cannot be reached to check its binary log settings; they are checked again before the stream starts");
            }
            Err(source) => {
                return Err(AppError::Binlog {
                    filter: f.name.clone(),
                    source,
                });
            }
        }
    }
    Ok(())
}
