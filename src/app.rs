//! Wiring: builds every stage from a compiled config ([`Compiled`]: patterns, sizes,
//! header names and address ranges are decided there, once), binds the data and admin
//! listeners (port 0 works, and the bound addresses are exposed), and runs until a
//! shutdown future resolves. It contains no request logic and checks no config value.

use std::collections::BTreeMap;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;

use hyper::body::Incoming;
use prometheus::Registry;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinSet;

use crate::access_log::AccessLog;
use crate::admin::Admin;
use crate::audit::{Audit, Auditor};
use crate::cache::ResponseCache;
use crate::config::{Compiled, CompiledOrigin, Config, ConfigError};
use crate::db::{Db, PoolSettings};
use crate::fleet::Fleet;
use crate::gate::Filter;
use crate::gate::admit::Admit;
use crate::metrics::{FleetMetrics, Metrics};
use crate::origin::client::Upstream;
use crate::origin::guard::OriginGuard;
use crate::origin::{Origin, SqlOrigin, UpstreamOrigin};
use crate::pipeline::budget::Budget;
use crate::pipeline::write_through::WriteThrough;
use crate::pipeline::{EdgePolicy, GuardedRoute, Proxy, ProxyBody};
use crate::server::tls::TlsSetupError;
use crate::server::{self, ConnectionMetrics, Handler, ServeOptions, Tls, Transport};

/// Local changes waiting for the fleet's appender; past this, a change is dropped
/// (counted) rather than making a request wait.
const OUTBOX_CHANNEL: usize = 65_536;

/// Most admin-plane connections open at once: scrapers and operators, kept apart from
/// the data plane's bound so that a flood there does not lock them out.
const ADMIN_MAX_CONNECTIONS: usize = 1024;

/// Why the application could not start.
#[derive(Debug, thiserror::Error)]
pub enum AppError {
    /// The config given to [`App::bind`] breaks a rule.
    #[error(transparent)]
    Config(#[from] ConfigError),
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
    /// Fleet mode could not be set up (a Redis URL the client refuses).
    #[error("fleet: {0}")]
    Fleet(#[from] crate::fleet::FleetError),
    /// A route's origin needs a section the compiled config lacks.
    #[error("route {route}: its origin needs [{section}]")]
    MissingSection {
        /// The route's label.
        route: String,
        /// The missing section.
        section: &'static str,
    },
    /// Metric registration failed (a name clash: a bug).
    #[error("metrics: {0}")]
    Metrics(#[from] prometheus::Error),
    /// The access log file could not be opened.
    #[error(transparent)]
    AccessLog(#[from] crate::access_log::AccessLogError),
    /// The TLS server config could not be made from the certificate.
    #[error(transparent)]
    Tls(#[from] TlsSetupError),
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
    fleet: Option<Arc<Fleet>>,
    /// TLS of the data plane, whose certificate [`Reloader::reload`] swaps.
    tls: Option<Arc<Tls>>,
    connections: ConnectionMetrics,
    /// The background audit of refused keys, started by [`App::run`].
    auditor: Option<Auditor>,
}

/// What can be reloaded in a running bloomgate without dropping connections: today the
/// TLS certificate. Cheap to clone; outlives the [`App`] it came from.
#[derive(Clone)]
pub struct Reloader {
    tls: Option<Arc<Tls>>,
}

impl Reloader {
    /// Reloads everything reloadable (what SIGHUP asks for). Each part logs and counts
    /// its own result; a part that fails keeps what it had.
    pub fn reload(&self) {
        tracing::info!("reloading");
        self.reload_tls();
    }

    /// Reads the TLS certificate and key again; new handshakes get them, established
    /// connections keep theirs. On failure the current certificate stays. Without TLS,
    /// nothing happens.
    pub fn reload_tls(&self) {
        if let Some(tls) = &self.tls {
            // The error is logged and counted by `reload`.
            let _ = tls.reload();
        }
    }
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
    /// Compiles `config`, builds every stage and binds both listeners. Nothing is served
    /// and no database connection is opened until [`App::run`].
    pub async fn bind(config: Config) -> Result<App, AppError> {
        Self::build(config.compile()?, Registry::new()).await
    }

    /// As [`App::bind`], registering metrics on `registry`.
    pub async fn bind_with_registry(config: Config, registry: Registry) -> Result<App, AppError> {
        Self::build(config.compile()?, registry).await
    }

    /// Builds every stage from a compiled config, registering metrics on `registry`, and
    /// binds both listeners. Nothing is served and no database connection is opened
    /// until [`App::run`].
    pub async fn build(compiled: Compiled, registry: Registry) -> Result<App, AppError> {
        let Compiled {
            config,
            upstream,
            filters: compiled_filters,
            routes: compiled_routes,
            write_through: compiled_write_through,
            trusted_proxies,
            outcome_header_clients,
            tls,
        } = compiled;
        let metrics = Metrics::new(&registry)?;
        let connections =
            ConnectionMetrics::register(&registry, tls.is_some(), config.server.http2)?;
        let tls = match tls {
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
        let database_guard = config.database.as_ref().map(|d| {
            Arc::new(OriginGuard::new(
                "database",
                &d.limits(),
                metrics.origins.handles("database"),
            ))
        });
        let upstream_guard = upstream.as_ref().map(|u| {
            Arc::new(OriginGuard::new(
                "upstream",
                &u.settings.limits(),
                metrics.origins.handles("upstream"),
            ))
        });
        let upstream = upstream.map(|u| Arc::new(Upstream::new(&u)));
        // In the order of `Compiled::filters`, which routes and rules refer to by position.
        let filters: Vec<Arc<Filter>> = compiled_filters
            .into_iter()
            .map(|f| {
                tracing::debug!(filter = %f.name, bits = f.params.bits, hashes = f.params.hashes,
                    expected_items = f.params.expected_items, "filter sized");
                let sync_interval = f.settings.sync.as_ref().map(|s| s.interval);
                let handles =
                    metrics
                        .filters
                        .handles(&f.name, f.settings.false_positive_rate, sync_interval);
                Arc::new(Filter::new(&f.name, f.settings, handles))
            })
            .collect();

        let has_variants = compiled_routes.iter().any(|r| r.has_variants());
        let mut routes = Vec::with_capacity(compiled_routes.len());
        for r in compiled_routes {
            let filter = Arc::clone(&filters[r.filter]);
            let origin = match (
                r.origin,
                db.as_ref().zip(database_guard.as_ref()),
                upstream.as_ref().zip(upstream_guard.as_ref()),
            ) {
                (CompiledOrigin::Sql { query, timeout }, Some((db, guard)), _) => {
                    Origin::Sql(SqlOrigin {
                        db: db.clone(),
                        query,
                        timeout,
                        ttl: r.ttl,
                        stale: r.stale,
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
                    Some((upstream, guard)),
                ) => Origin::Upstream(UpstreamOrigin {
                    upstream: Arc::clone(upstream),
                    pattern: r.pattern.clone(),
                    not_found,
                    ttl: r.ttl,
                    stale: r.stale,
                    forward_headers,
                    headers,
                    guard: Arc::clone(guard),
                }),
                // `Config::compile` refuses both; a `Compiled` changed afterwards may not.
                (CompiledOrigin::Sql { .. }, None, _) => {
                    return Err(AppError::MissingSection {
                        route: r.label.to_string(),
                        section: "database",
                    });
                }
                (CompiledOrigin::Upstream { .. }, _, None) => {
                    return Err(AppError::MissingSection {
                        route: r.label.to_string(),
                        section: "upstream",
                    });
                }
            };
            routes.push(GuardedRoute {
                id: r.id,
                metrics: metrics
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
                logged_false_negatives: std::sync::Mutex::new(std::collections::HashSet::new()),
            });
        }
        let cache = Arc::new(ResponseCache::new(&config.cache, has_variants));
        let mut admit = Admit::new(
            Arc::clone(&cache),
            routes
                .iter()
                .map(|r| (Arc::from(r.filter.name()), r.id))
                .collect(),
        );
        let labels = routes.iter().map(|r| &*r.label);
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
        let admit = Arc::new(admit);
        let fleet = match (fleet_parts, &db) {
            (Some((settings, rx, fleet_metrics)), Some(db)) => Some(Arc::new(Fleet::new(
                settings,
                &filters,
                Arc::clone(&admit),
                db.clone(),
                rx,
                fleet_metrics,
            )?)),
            (Some(_), None) => {
                return Err(AppError::MissingSection {
                    route: "fleet".into(),
                    section: "database",
                });
            }
            (None, _) => None,
        };
        let write_through = compiled_write_through
            .into_iter()
            .map(|rule| {
                let filter = Arc::clone(&filters[rule.filter]);
                let added = metrics.write_through(filter.name());
                WriteThrough::from_compiled(rule, filter, Arc::clone(&admit), added)
            })
            .collect();
        let budget = match &config.false_positive_budget {
            Some(b) => {
                crate::pipeline::budget::register(&registry, b.per_client, b.window)?;
                Some(Budget::new(b.per_client, b.window, b.slots))
            }
            None => None,
        };
        let access_log = match &config.access_log {
            Some(a) => Some(AccessLog::start(a, metrics.access_log_lines())?),
            None => None,
        };
        let edge = EdgePolicy {
            trusted_proxies,
            outcome_header: config.server.outcome_header,
            outcome_header_clients,
            budget,
            access_log,
        };

        let proxy = Proxy::new(
            routes,
            cache,
            upstream,
            config.server.max_body_bytes,
            metrics.passthrough(),
            write_through,
            edge,
        );
        let proxy = Arc::new(proxy.with_audit(sampler));
        let by_name: BTreeMap<String, Arc<Filter>> = filters
            .iter()
            .map(|f| (f.name().to_owned(), Arc::clone(f)))
            .collect();
        let admin_handler = Arc::new(Admin {
            filters: by_name,
            proxy: Arc::clone(&proxy),
            admit: Arc::clone(&admit),
            registry,
            metrics,
            token: config.admin.token.clone(),
            fleet: fleet.clone(),
            origins: database_guard.into_iter().chain(upstream_guard).collect(),
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
            filters,
            db,
            fleet,
            tls,
            connections,
            auditor,
        })
    }

    /// A handle that reloads the certificate (and whatever else becomes reloadable)
    /// while this app runs.
    pub fn reloader(&self) -> Reloader {
        Reloader {
            tls: self.tls.clone(),
        }
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
    pub async fn run(mut self, shutdown: impl Future<Output = ()>) {
        let (stop_tx, stop_rx) = watch::channel(false);
        let server = &self.config.server;
        let options = ServeOptions {
            header_read_timeout: server.header_read_timeout,
            grace: server.shutdown_grace,
            max_header_bytes: server.max_header_bytes,
            max_uri_bytes: server.max_uri_bytes,
            http2: server.http2,
            max_connections: server.max_connections,
            http2_max_concurrent_streams: server.http2_max_concurrent_streams,
        };
        // The admin plane speaks HTTP/1.1 in cleartext, as it always has.
        let admin_options = ServeOptions {
            http2: false,
            max_connections: ADMIN_MAX_CONNECTIONS,
            ..options
        };
        // Join sets abort their tasks when dropped, with this future.
        let mut loaders = JoinSet::new();
        if let Some(fleet) = &self.fleet {
            // The fleet decides, per filter, whether this instance builds and syncs.
            loaders.spawn(Arc::clone(fleet).run());
        } else if let Some(db) = &self.db {
            for filter in &self.filters {
                loaders.spawn(Arc::clone(filter).run_loader(db.clone()));
                loaders.spawn(crate::gate::sync::run(
                    Arc::clone(filter),
                    Arc::clone(&self.admit),
                    db.clone(),
                ));
            }
        }
        if let Some(auditor) = self.auditor.take() {
            loaders.spawn(auditor.run(Arc::clone(&self.admit)));
        }
        tracing::info!(data = %self.data_addr(), admin = %self.admin_addr(),
            tls = self.tls.is_some(), http2 = options.http2,
            routes = self.proxy.routes().len(), filters = self.filters.len(), "bloomgate listening");
        let mut servers = JoinSet::new();
        servers.spawn(server::serve(
            self.data,
            Arc::new(DataPlane(Arc::clone(&self.proxy))),
            options,
            Transport {
                tls: self.tls.clone(),
                metrics: Some(self.connections.clone()),
            },
            stop_rx.clone(),
            "data",
        ));
        servers.spawn(server::serve(
            self.admin,
            self.admin_handler,
            admin_options,
            Transport::default(),
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
        if let Some(fleet) = &self.fleet {
            // Another instance takes over at once instead of after the lease expires.
            fleet.release_leases().await;
        }
        loaders.shutdown().await;
        if let Some(db) = self.db {
            db.close().await;
        }
        tracing::info!("stopped");
    }
}

async fn bind(addr: SocketAddr) -> Result<TcpListener, AppError> {
    TcpListener::bind(addr)
        .await
        .map_err(|source| AppError::Bind { addr, source })
}

/// Reloads on every SIGHUP until the process ends: the one place SIGHUP is handled, so
/// that whatever becomes reloadable is added to [`Reloader::reload`].
pub async fn reload_on_sighup(reloader: Reloader) {
    #[cfg(unix)]
    match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()) {
        Ok(mut hangups) => {
            while hangups.recv().await.is_some() {
                reloader.reload();
            }
        }
        Err(e) => tracing::error!(error = %e, "cannot listen for SIGHUP; reloads are off"),
    }
    #[cfg(not(unix))]
    let _ = reloader;
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

#[cfg(test)]
mod tests {
    use http::HeaderName;

    use super::*;

    const CONFIG: &str = r#"
        [server]
        listen = "127.0.0.1:0"
        [admin]
        listen = "127.0.0.1:0"
        [upstream]
        url = "http://127.0.0.1:3000"
        [database]
        url = "sqlite://data/never-opened.db"
        [filters.products]
        source_query = "SELECT sku_id FROM products"
        expected_items = 1000
        [[routes]]
        path = "/api/products/{id}"
        key = { segment = "id" }
        filter = "products"
        origin = { kind = "sql", query = "SELECT * FROM products WHERE sku_id = ?" }
        [[routes]]
        path = "/api/product/info"
        key = { query = "sku" }
        filter = "products"
        origin = { kind = "upstream" }
        forward_headers = ["Accept-Language"]
        [[write_through]]
        path = "/api/products"
        filter = "products"
        key = { header = "location" }
    "#;

    /// `App::build` wires what compiling decided and reads none of those values from the
    /// config again: spoiling them after compiling changes nothing.
    #[tokio::test]
    async fn build_wires_the_compiled_form_without_parsing_again() {
        let config = Config::from_toml_str(CONFIG).expect("valid");
        let mut compiled = config.compile().expect("compiles");
        let spoiled = &mut compiled.config;
        spoiled.routes[0].path = "no pattern".into();
        spoiled.routes[1].forward_headers = vec!["not a header".into()];
        spoiled.routes[1].filter = "gone".into();
        spoiled.server.trusted_proxies = vec!["not a range".into()];
        spoiled.write_through[0].methods = vec!["NOT A METHOD".into()];
        if let Some(u) = &mut spoiled.upstream {
            u.url = "https://elsewhere.test/path".into();
        }
        assert!(
            spoiled.validate().is_err(),
            "a second check would refuse it"
        );

        let app = App::build(compiled, Registry::new())
            .await
            .expect("builds from the compiled form");
        let proxy = app.proxy();
        let routes = proxy.routes();
        assert_eq!(routes.len(), 2);
        assert_eq!(routes[0].pattern.matches("/api/products/7"), Some("7"));
        assert_eq!(&*routes[0].label, "/api/products/{id}");
        assert_eq!(routes[1].filter.name(), "products");
        let Origin::Upstream(origin) = &*routes[1].origin else {
            panic!("route 1 has an upstream origin");
        };
        assert_eq!(
            origin.forward_headers,
            [HeaderName::from_static("accept-language")]
        );
        let target = origin.upstream.uri_for_target("/x").expect("a URI");
        assert_eq!(target.to_string(), "http://127.0.0.1:3000/x");
    }

    #[tokio::test]
    async fn bind_refuses_a_config_that_does_not_compile() {
        let mut config = Config::from_toml_str(CONFIG).expect("valid");
        config.routes[0].path = "no pattern".into();
        match App::bind(config).await {
            Err(AppError::Config(ConfigError::Invalid(problems))) => {
                assert_eq!(problems.len(), 1, "{problems:?}");
                assert_eq!(problems[0].field, "routes[0].path");
            }
            Err(e) => panic!("another error: {e}"),
            Ok(_) => panic!("bound a config with a broken route"),
        }
    }

    /// A compiled config changed after compiling so that a route's origin has nothing to
    /// ask is refused by name, not a panic.
    #[tokio::test]
    async fn build_refuses_an_origin_whose_section_is_gone() {
        let mut compiled = Config::from_toml_str(CONFIG)
            .expect("valid")
            .compile()
            .expect("compiles");
        compiled.config.database = None;
        match App::build(compiled, Registry::new()).await {
            Err(AppError::MissingSection { route, section }) => {
                assert_eq!(
                    (route.as_str(), section),
                    ("/api/products/{id}", "database")
                );
            }
            Err(e) => panic!("another error: {e}"),
            Ok(_) => panic!("built a sql route without a database"),
        }
    }
}
