//! Running a built bloomgate: the background tasks (the fleet, or the standalone filter
//! loaders and sync pollers; the audit), both planes served, the service manager told
//! when they accept, and the shutdown: stop accepting, drain, release fleet leases, stop
//! the background tasks, close the database pool.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;

use hyper::body::Incoming;
use tokio::sync::watch;
use tokio::task::JoinSet;

use super::App;
use super::sockets::DataSockets;
use crate::pipeline::{Proxy, ProxyBody};
use crate::reload::Reloader;
use crate::server::{self, Handler, ServeOptions, Transport};
use bloomgate_core::report::Chain;

/// Most admin-plane connections open at once: scrapers and operators, kept apart from
/// the data plane's bound so that a flood there does not lock them out.
const ADMIN_MAX_CONNECTIONS: usize = 1024;

/// The data plane's handler: the pipeline behind the proxy.
struct DataPlane(Arc<Proxy>);

impl Handler for DataPlane {
    type Body = ProxyBody;

    // Not `async`: the pipeline's future is returned as it is, with no level around it
    // that would keep another copy of the request (see `Pipeline::handle`).
    fn call(
        &self,
        req: http::Request<Incoming>,
        peer: SocketAddr,
    ) -> impl Future<Output = http::Response<ProxyBody>> + Send {
        self.0.handle(req.map(Some), peer)
    }

    fn call_head(
        &self,
        req: http::Request<()>,
        peer: SocketAddr,
    ) -> Option<impl Future<Output = http::Response<ProxyBody>> + Send + '_> {
        Some(self.0.handle(req.map(|()| None), peer))
    }

    const ANSWERS_AT_ONCE: bool = true;

    fn answer_now<B>(
        &self,
        req: &http::Request<B>,
        peer: SocketAddr,
    ) -> Option<http::Response<ProxyBody>> {
        self.0.answer_now(req, peer)
    }
}

impl App {
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
        bloomgate_core::notify::ready();
        shutdown.await;
        tracing::info!("shutting down");
        bloomgate_core::notify::stopping();
        // A send error means both servers already stopped; nothing to tell.
        let _ = stop_tx.send(true);
        while let Some(done) = servers.join_next().await {
            if let Err(e) = done {
                tracing::error!(error = %Chain(&e), "server task failed");
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
