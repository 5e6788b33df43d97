//! Wiring: builds every stage from a compiled config ([`Compiled`]: patterns, sizes,
//! header names and address ranges are decided there, once), binds the data and admin
//! listeners (port 0 works, and the bound addresses are exposed), and runs until a
//! shutdown future resolves. It contains no request logic and checks no config value.

use std::collections::BTreeMap;
use std::future::Future;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use hyper::body::Incoming;
use prometheus::Registry;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinSet;

use crate::admin::Admin;
use crate::audit::{Audit, Auditor};
use crate::cache::ResponseCache;
use crate::config::{Compiled, Config, ConfigError, Threading};
use crate::db::{Db, PoolSettings};
use crate::fleet::Fleet;
use crate::fleet::metrics::FleetMetrics;
use crate::gate::Filter;
use crate::gate::admit::Admit;
use crate::pipeline::budget::Budget;
use crate::pipeline::{Proxy, ProxyBody};
use crate::reload::Reloader;
use crate::server::tls::TlsSetupError;
use crate::server::{
    self, ConnectionMetrics, Handler, ServeOptions, ServingRuntimes, Tls, Transport,
};
use crate::stages::Metrics;
use crate::stages::{AssembleError, RouteIds, Stages};

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
    /// Fleet mode needs `[database]`.
    #[error("fleet mode needs [database]")]
    FleetWithoutDatabase,
    /// The pipeline could not be assembled (an origin without its section, an access
    /// log that cannot be opened).
    #[error(transparent)]
    Assemble(#[from] AssembleError),
    /// Metric registration failed (a name clash: a bug).
    #[error("metrics: {0}")]
    Metrics(#[from] prometheus::Error),
    /// The TLS server config could not be made from the certificate.
    #[error(transparent)]
    Tls(#[from] TlsSetupError),
}

/// A built, bound, not yet running bloomgate.
pub struct App {
    config: Config,
    data: DataSockets,
    admin: TcpListener,
    proxy: Arc<Proxy>,
    admin_handler: Arc<Admin>,
    reloader: Reloader,
    /// TLS of the data plane.
    tls: Option<Arc<Tls>>,
    connections: ConnectionMetrics,
    /// The background audit of refused keys, started by [`App::run`], and the admission
    /// path it heals through.
    auditor: Option<(Auditor, Arc<Admit>)>,
}

struct DataPlane(Arc<Proxy>);

/// The data plane's sockets, bound when the app is built.
enum DataSockets {
    /// One listener, served on the shared runtime (`server.threading = "shared"`).
    Shared(TcpListener),
    /// One listener per serving thread (`server.threading = "per_core"`).
    PerCore(Vec<std::net::TcpListener>),
}

impl DataSockets {
    async fn bind(server: &crate::config::ServerConfig) -> Result<DataSockets, AppError> {
        let addr = server.listen;
        match server.threading {
            Threading::Shared => Ok(DataSockets::Shared(bind(addr).await?)),
            Threading::PerCore => {
                let listeners = server::bind_reuseport(addr, server.serving_threads())
                    .map_err(|source| AppError::Bind { addr, source })?;
                Ok(DataSockets::PerCore(listeners))
            }
        }
    }

    fn threads(&self) -> usize {
        match self {
            DataSockets::Shared(_) => 0,
            DataSockets::PerCore(ls) => ls.len(),
        }
    }

    fn local_addr(&self) -> std::io::Result<SocketAddr> {
        match self {
            DataSockets::Shared(l) => l.local_addr(),
            DataSockets::PerCore(ls) => ls
                .first()
                .ok_or_else(|| std::io::Error::other("no listener"))?
                .local_addr(),
        }
    }
}

impl Handler for DataPlane {
    type Body = ProxyBody;

    // Not `async`: the pipeline's future is returned as it is, with no level around it
    // that would keep another copy of the request (see `Pipeline::handle`).
    fn call(
        &self,
        req: http::Request<Incoming>,
        peer: SocketAddr,
    ) -> impl Future<Output = http::Response<ProxyBody>> + Send {
        self.0.handle(req, peer)
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

    /// As [`App::build`], for a config compiled from the file at `path`, which reloads
    /// read again.
    pub async fn build_from_file(
        compiled: Compiled,
        path: &Path,
        registry: Registry,
    ) -> Result<App, AppError> {
        Self::assemble(compiled, registry, Some(path.to_path_buf())).await
    }

    /// Builds every stage from a compiled config, registering metrics on `registry`, and
    /// binds both listeners. Nothing is served and no database connection is opened
    /// until [`App::run`]. With no file behind it, the config cannot be reloaded.
    pub async fn build(compiled: Compiled, registry: Registry) -> Result<App, AppError> {
        Self::assemble(compiled, registry, None).await
    }

    async fn assemble(
        mut compiled: Compiled,
        registry: Registry,
        path: Option<PathBuf>,
    ) -> Result<App, AppError> {
        let metrics = Metrics::new(&registry)?;
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
        let reloader = Reloader::new(path, stages, config.clone(), Arc::clone(&proxy));
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

    /// A handle that reloads the configuration while this app runs.
    pub fn reloader(&self) -> Reloader {
        self.reloader.clone()
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
        let (db, fleet) = self.reloader.fixed_parts().await;
        // Join sets abort their tasks when dropped, with this future; so does the guard
        // of the standalone filter tasks.
        let mut loaders = JoinSet::new();
        let filter_tasks = FilterTasksGuard(self.reloader.clone());
        if let Some(fleet) = &fleet {
            // The fleet decides, per filter, whether this instance builds and syncs.
            loaders.spawn(Arc::clone(fleet).run());
        } else {
            self.reloader.start_filter_tasks().await;
        }
        if let Some((auditor, admit)) = self.auditor.take() {
            loaders.spawn(auditor.run(admit));
        }
        tracing::info!(data = %self.data_addr(), admin = %self.admin_addr(),
            tls = self.tls.is_some(), http2 = options.http2,
            routes = self.proxy.current().routes().len(),
            threading = ?self.config.server.threading, serving_threads = self.data.threads(),
            filters = self.reloader.filters().len(), "bloomgate listening");
        let mut servers = JoinSet::new();
        let data_plane = Arc::new(DataPlane(Arc::clone(&self.proxy)));
        let transport = Transport {
            tls: self.tls.clone(),
            metrics: Some(self.connections.clone()),
            runtimes: self.admin_handler.serving_runtimes.clone(),
        };
        match self.data {
            DataSockets::Shared(listener) => servers.spawn(server::serve(
                listener,
                data_plane,
                options,
                transport,
                stop_rx.clone(),
                "data",
            )),
            DataSockets::PerCore(listeners) => servers.spawn(server::serve_per_core(
                listeners,
                data_plane,
                options,
                transport,
                stop_rx.clone(),
                "data",
            )),
        };
        servers.spawn(server::serve(
            self.admin,
            self.admin_handler,
            admin_options,
            Transport::default(),
            stop_rx,
            "admin",
        ));
        // Both listeners were bound in `build`; from here both planes accept.
        crate::notify::ready();
        shutdown.await;
        tracing::info!("shutting down");
        crate::notify::stopping();
        // A send error means both servers already stopped; nothing to tell.
        let _ = stop_tx.send(true);
        while let Some(done) = servers.join_next().await {
            if let Err(e) = done {
                tracing::error!(error = %e, "server task failed");
            }
        }
        if let Some(fleet) = &fleet {
            // Another instance takes over at once instead of after the lease expires.
            fleet.release_leases().await;
        }
        loaders.shutdown().await;
        self.reloader.stop_filter_tasks().await;
        drop(filter_tasks);
        if let Some(db) = db {
            db.close().await;
        }
        tracing::info!("stopped");
    }
}

/// Stops the standalone filter tasks when [`App::run`] ends or is dropped.
struct FilterTasksGuard(Reloader);

impl Drop for FilterTasksGuard {
    fn drop(&mut self) {
        let reloader = self.0.clone();
        // Dropped inside the runtime (the future of `run`); nothing to do without one.
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn(async move { reloader.stop_filter_tasks().await });
        }
    }
}

async fn bind(addr: SocketAddr) -> Result<TcpListener, AppError> {
    TcpListener::bind(addr)
        .await
        .map_err(|source| AppError::Bind { addr, source })
}

/// Reloads the configuration on every SIGHUP until the process ends: the one place
/// SIGHUP is handled. A refused reload is logged and counted by [`Reloader::reload`].
/// The service manager is told when each reload starts and ends.
pub async fn reload_on_sighup(reloader: Reloader) {
    #[cfg(unix)]
    match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()) {
        Ok(mut hangups) => {
            while hangups.recv().await.is_some() {
                // Ready again whether the reload applied or was refused: either way the
                // configuration in force is serving.
                crate::notify::reloading();
                let _ = reloader.reload().await;
                crate::notify::ready();
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
    use crate::origin::Origin;

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
        let pipeline = app.proxy().current();
        let routes = pipeline.routes();
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
            Err(AppError::Assemble(AssembleError::MissingSection { route, section })) => {
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
