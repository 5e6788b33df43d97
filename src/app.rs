//! Wiring: builds every stage from a compiled config ([`Compiled`]: patterns, sizes,
//! header names and address ranges are decided there, once), binds the data and admin
//! listeners (port 0 works, and the bound addresses are exposed), and runs until a
//! shutdown future resolves. It contains no request logic and checks no config value.
//!
//! This file holds the [`App`] and its constructors; `assemble` builds the stages,
//! `sockets` binds the listeners, `run` serves and shuts down, `signals` turns SIGHUP,
//! SIGINT and SIGTERM into reloads and shutdown.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;

use prometheus::Registry;
use tokio::net::TcpListener;

use crate::admin::Admin;
use crate::audit::Auditor;
use crate::gate::admit::Admit;
use crate::pipeline::Proxy;
use crate::reload::Reloader;
use crate::server::tls::TlsSetupError;
use crate::server::{ConnectionMetrics, Tls};
use crate::stages::AssembleError;
use bloomgate_core::config::{Compiled, Config, ConfigError};

mod assemble;
mod run;
mod signals;
mod sockets;

pub use signals::{reload_on_sighup, shutdown_signal};

use sockets::DataSockets;

/// Why the application could not start.
#[derive(Debug, thiserror::Error)]
pub enum AppError {
    /// The config given to [`App::bind`] breaks a rule.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// A listener could not be bound.
    #[error("cannot listen on {addr}")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The database pool could not be configured (bad URL).
    #[error(transparent)]
    Db(#[from] bloomgate_core::db::DbError),
    /// Fleet mode could not be set up (a Redis URL the client refuses).
    #[error("fleet")]
    Fleet(#[from] crate::fleet::FleetError),
    /// Fleet mode needs `[database]`.
    #[error("fleet mode needs [database]")]
    FleetWithoutDatabase,
    /// The pipeline could not be assembled (an origin without its section, an access
    /// log that cannot be opened).
    #[error(transparent)]
    Assemble(#[from] AssembleError),
    /// Metric registration failed (a name clash: a bug).
    #[error("metrics")]
    Metrics(#[from] prometheus::Error),
    /// The TLS server config could not be made from the certificate.
    #[error(transparent)]
    Tls(#[from] TlsSetupError),
    /// A filter in binlog mode cannot follow the server's binary log (a server setting,
    /// the key column); the message names what to change.
    #[error("filter {filter}: binlog mode cannot start")]
    Binlog {
        /// The filter.
        filter: String,
        /// What the server or table lacks.
        #[source]
        source: bloomgate_core::db::binlog::BinlogError,
    },
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
}

#[cfg(test)]
mod tests;
