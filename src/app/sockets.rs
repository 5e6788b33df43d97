//! The data and admin planes' sockets, bound when the app is built: the data plane on
//! one listener (shared runtime) or on one `SO_REUSEPORT` listener per serving thread.

use std::net::SocketAddr;

use tokio::net::TcpListener;

use super::AppError;
use crate::server;
use bloomgate_core::config::{ServerConfig, Threading};

/// The data plane's sockets, bound when the app is built.
pub(super) enum DataSockets {
    /// One listener, served on the shared runtime (`server.threading = "shared"`).
    Shared(TcpListener),
    /// One listener per serving thread (`server.threading = "per_core"`).
    PerCore(Vec<std::net::TcpListener>),
}

impl DataSockets {
    pub(super) async fn bind(server: &ServerConfig) -> Result<DataSockets, AppError> {
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

    pub(super) fn threads(&self) -> usize {
        match self {
            DataSockets::Shared(_) => 0,
            DataSockets::PerCore(ls) => ls.len(),
        }
    }

    pub(super) fn local_addr(&self) -> std::io::Result<SocketAddr> {
        match self {
            DataSockets::Shared(l) => l.local_addr(),
            DataSockets::PerCore(ls) => ls
                .first()
                .ok_or_else(|| std::io::Error::other("no listener"))?
                .local_addr(),
        }
    }
}

/// A listener on `addr`.
pub(super) async fn bind(addr: SocketAddr) -> Result<TcpListener, AppError> {
    TcpListener::bind(addr)
        .await
        .map_err(|source| AppError::Bind { addr, source })
}
