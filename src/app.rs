//! Wiring: builds every stage from a validated [`Config`], binds the data and admin
//! listeners (port 0 works, and the bound addresses are exposed), and runs until a
//! shutdown future resolves. It contains no request logic.

use std::collections::BTreeMap;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;

use http::header::HeaderName;
use http::{HeaderValue, StatusCode};
use hyper::body::Incoming;
use prometheus::Registry;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinSet;

use crate::admin::Admin;
use crate::cache::ResponseCache;
use crate::config::{Config, KeySource, OriginConfig, UndeclaredQuery};
use crate::db::{Db, PoolSettings};
use crate::gate::Filter;
use crate::gate::admit::Admit;
use crate::metrics::Metrics;
use crate::origin::client::Upstream;
use crate::origin::{Origin, UpstreamOrigin};
use crate::pipeline::budget::Budget;
use crate::pipeline::client::Cidrs;
use crate::pipeline::route::{MatchOptions, PathPattern, QueryRules};
use crate::pipeline::write_through::WriteThrough;
use crate::pipeline::{EdgePolicy, GuardedRoute, Proxy, ProxyBody};
use crate::server::{self, Handler, ServeOptions};

/// Why the application could not start.
#[derive(Debug, thiserror::Error)]
pub enum AppError {
    /// A listener could not be bound.
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The database pool could not be configured (bad URL).
    #[error(transparent)]
    Db(#[from] crate::db::DbError),
    /// The upstream client could not be configured.
    #[error(transparent)]
    Upstream(#[from] crate::origin::client::UpstreamError),
    /// Metric registration failed (a name clash: a bug).
    #[error("metrics: {0}")]
    Metrics(#[from] prometheus::Error),
    /// A route failed to compile (config validation normally prevents this).
    #[error("route {route}: {reason}")]
    Route {
        /// The route label.
        route: String,
        /// Why.
        reason: String,
    },
}

/// A built, bound, not yet running bloomgate.
pub struct App {
    config: Config,
    data: TcpListener,
    admin: TcpListener,
    proxy: Arc<Proxy>,
    admit: Arc<Admit>,
    admin_handler: Arc<Admin>,
    filters: Vec<Arc<Filter>>,
    db: Option<Db>,
}

struct DataPlane(Arc<Proxy>);

impl Handler for DataPlane {
    type Body = ProxyBody;

    async fn call(
        &self,
        req: http::Request<Incoming>,
        peer: SocketAddr,
    ) -> http::Response<ProxyBody> {
        self.0.handle(req, peer).await
    }
}

impl App {
    /// Builds every stage and binds both listeners. Nothing is served and no database
    /// connection is opened until [`App::run`].
    pub async fn bind(config: Config) -> Result<App, AppError> {
        Self::bind_with_registry(config, Registry::new()).await
    }

    /// As [`App::bind`], registering metrics on `registry`.
    pub async fn bind_with_registry(config: Config, registry: Registry) -> Result<App, AppError> {
        let metrics = Metrics::new(&registry)?;
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
        let upstream = match &config.upstream {
            Some(u) => Some(Arc::new(Upstream::new(u)?)),
            None => None,
        };
        let filters: BTreeMap<String, Arc<Filter>> = config
            .filters
            .iter()
            .map(|(name, f)| {
                let sync_interval = f.sync.as_ref().map(|s| s.interval);
                let handles = metrics.filter(name, f.false_positive_rate, sync_interval);
                let filter = Filter::new(name, f.clone(), handles);
                (name.clone(), Arc::new(filter))
            })
            .collect();

        let mut routes = Vec::with_capacity(config.routes.len());
        for (i, r) in config.routes.iter().enumerate() {
            let label = r.label().to_owned();
            let fail = |reason: String| AppError::Route {
                route: label.clone(),
                reason,
            };
            let pattern =
                PathPattern::parse(&r.path, &r.key, MatchOptions::of(r)).map_err(&fail)?;
            let filter = filters
                .get(&r.filter)
                .cloned()
                .ok_or_else(|| fail(format!("no filter `{}`", r.filter)))?;
            let ttl = r.ttl.unwrap_or(config.cache.ttl);
            let origin = match &r.origin {
                OriginConfig::Sql { query, timeout } => Origin::Sql {
                    db: db
                        .clone()
                        .ok_or_else(|| fail("sql origin without [database]".into()))?,
                    query: Arc::from(query.as_str()),
                    timeout: *timeout,
                    ttl,
                },
                OriginConfig::Upstream { not_found_statuses } => Origin::Upstream(UpstreamOrigin {
                    upstream: upstream
                        .clone()
                        .ok_or_else(|| fail("upstream origin without [upstream]".into()))?,
                    pattern: pattern.clone(),
                    not_found: not_found_statuses
                        .iter()
                        .filter_map(|s| StatusCode::from_u16(*s).ok())
                        .collect(),
                    ttl,
                    forward_headers: r
                        .forward_headers
                        .iter()
                        .map(|h| HeaderName::from_bytes(h.to_ascii_lowercase().as_bytes()))
                        .collect::<Result<_, _>>()
                        .map_err(|e| fail(e.to_string()))?,
                    headers: r
                        .upstream_headers
                        .iter()
                        .map(|(k, v)| {
                            let name = HeaderName::from_bytes(k.to_ascii_lowercase().as_bytes())
                                .map_err(|e| fail(e.to_string()))?;
                            let value =
                                HeaderValue::from_str(v).map_err(|e| fail(e.to_string()))?;
                            Ok((name, value))
                        })
                        .collect::<Result<_, AppError>>()?,
                }),
            };
            routes.push(GuardedRoute {
                id: u16::try_from(i).map_err(|_| fail("too many routes".into()))?,
                label: Arc::from(label.as_str()),
                pattern,
                normalize: config.route_normalize(r),
                filter,
                origin,
                negative_ttl: r.negative_ttl.unwrap_or(config.cache.negative_ttl),
                metrics: metrics.route(&label, &r.filter, r.mode.as_str()),
                mode: r.mode,
                query: QueryRules {
                    key: match &r.key {
                        KeySource::Query(name) => Some(name.clone()),
                        KeySource::Segment(_) => None,
                    },
                    forward: r.forward_query.clone(),
                    reject_undeclared: r.undeclared_query == UndeclaredQuery::Reject,
                },
                logged_false_negatives: std::sync::Mutex::new(std::collections::HashSet::new()),
            });
        }
        let has_variants = config
            .routes
            .iter()
            .any(|r| !r.forward_query.is_empty() || !r.forward_headers.is_empty());
        let cache = Arc::new(ResponseCache::new(&config.cache, has_variants));
        let admit = Arc::new(Admit::new(
            Arc::clone(&cache),
            routes
                .iter()
                .map(|r| (Arc::from(r.filter.name()), r.id))
                .collect(),
        ));
        let mut write_through = Vec::with_capacity(config.write_through.len());
        for (i, w) in config.write_through.iter().enumerate() {
            let fail = |reason: String| AppError::Route {
                route: format!("write_through[{i}]"),
                reason,
            };
            let filter = filters
                .get(&w.filter)
                .cloned()
                .ok_or_else(|| fail(format!("no filter `{}`", w.filter)))?;
            let added = metrics.write_through(&w.filter);
            write_through
                .push(WriteThrough::new(w, filter, Arc::clone(&admit), added).map_err(fail)?);
        }

        let proxy = Arc::new(Proxy::new(
            routes,
            cache,
            upstream,
            config.server.max_body_bytes,
            metrics.passthrough(),
            write_through,
            edge_policy(&config, &registry)?,
        ));
        let admin_handler = Arc::new(Admin {
            filters: filters.clone(),
            proxy: Arc::clone(&proxy),
            admit: Arc::clone(&admit),
            registry,
            metrics,
            token: config.admin.token.clone(),
        });
        let data = bind(config.server.listen).await?;
        let admin = bind(config.admin.listen).await?;
        Ok(App {
            config,
            data,
            admin,
            proxy,
            admit,
            admin_handler,
            filters: filters.into_values().collect(),
            db,
        })
    }

    /// The bound data-plane address (useful with port 0).
    pub fn data_addr(&self) -> SocketAddr {
        self.data.local_addr().unwrap_or(self.config.server.listen)
    }

    /// The data-plane handler (for benchmarks and tests that bypass sockets).
    pub fn proxy(&self) -> Arc<Proxy> {
        Arc::clone(&self.proxy)
    }

    /// The bound admin-plane address.
    pub fn admin_addr(&self) -> SocketAddr {
        self.admin.local_addr().unwrap_or(self.config.admin.listen)
    }

    /// Serves both planes and loads the filters in the background until `shutdown`
    /// resolves; then stops accepting and drains in-flight requests within the grace period.
    /// The tasks it starts belong to it: if this future is dropped before it finishes
    /// (aborted), the loaders and sync pollers stop and the listeners close with it.
    pub async fn run(self, shutdown: impl Future<Output = ()>) {
        let (stop_tx, stop_rx) = watch::channel(false);
        let options = ServeOptions {
            header_read_timeout: self.config.server.header_read_timeout,
            grace: self.config.server.shutdown_grace,
            max_header_bytes: self.config.server.max_header_bytes,
            max_uri_bytes: self.config.server.max_uri_bytes,
        };
        // Join sets abort their tasks when dropped, with this future.
        let mut loaders = JoinSet::new();
        if let Some(db) = &self.db {
            for filter in &self.filters {
                loaders.spawn(Arc::clone(filter).run_loader(db.clone()));
                loaders.spawn(crate::gate::sync::run(
                    Arc::clone(filter),
                    Arc::clone(&self.admit),
                    db.clone(),
                ));
            }
        }
        tracing::info!(data = %self.data_addr(), admin = %self.admin_addr(),
            routes = self.proxy.routes().len(), filters = self.filters.len(), "bloomgate listening");
        let mut servers = JoinSet::new();
        servers.spawn(server::serve(
            self.data,
            Arc::new(DataPlane(Arc::clone(&self.proxy))),
            options,
            stop_rx.clone(),
            "data",
        ));
        servers.spawn(server::serve(
            self.admin,
            self.admin_handler,
            options,
            stop_rx,
            "admin",
        ));
        shutdown.await;
        tracing::info!("shutting down");
        // A send error means both servers already stopped; nothing to tell.
        let _ = stop_tx.send(true);
        while let Some(done) = servers.join_next().await {
            if let Err(e) = done {
                tracing::error!(error = %e, "server task failed");
            }
        }
        loaders.shutdown().await;
        if let Some(db) = self.db {
            db.close().await;
        }
        tracing::info!("stopped");
    }
}

/// Compiles what the edge believes and tells about clients (validation already checked
/// every range).
fn edge_policy(config: &Config, registry: &Registry) -> Result<EdgePolicy, AppError> {
    let cidrs = |field: &str, list: &[String]| {
        Cidrs::parse(list).map_err(|reason| AppError::Route {
            route: field.to_owned(),
            reason,
        })
    };
    let budget = match &config.false_positive_budget {
        Some(b) => {
            crate::pipeline::budget::register(registry, b.per_client, b.window)?;
            Some(Budget::new(b.per_client, b.window, b.slots))
        }
        None => None,
    };
    Ok(EdgePolicy {
        trusted_proxies: cidrs("server.trusted_proxies", &config.server.trusted_proxies)?,
        outcome_header: config.server.outcome_header,
        outcome_header_clients: cidrs(
            "server.outcome_header_clients",
            &config.server.outcome_header_clients,
        )?,
        budget,
    })
}

async fn bind(addr: SocketAddr) -> Result<TcpListener, AppError> {
    TcpListener::bind(addr)
        .await
        .map_err(|source| AppError::Bind { addr, source })
}

/// Resolves on SIGINT or SIGTERM.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        if let Err(e) = tokio::signal::ctrl_c().await {
            tracing::error!(error = %e, "cannot listen for SIGINT");
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(e) => {
                tracing::error!(error = %e, "cannot listen for SIGTERM");
                std::future::pending::<()>().await;
            }
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
}
