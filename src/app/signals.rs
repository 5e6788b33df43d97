//! The process's signals: SIGHUP reloads the configuration, SIGINT or SIGTERM shuts it
//! down. The service manager hears of each reload.

use crate::reload::Reloader;
use bloomgate_core::report::Chain;

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
                bloomgate_core::notify::reloading();
                let _ = reloader.reload().await;
                bloomgate_core::notify::ready();
            }
        }
        Err(e) => tracing::error!(error = %Chain(&e), "cannot listen for SIGHUP; reloads are off"),
    }
    #[cfg(not(unix))]
    let _ = reloader;
}

/// Resolves on SIGINT or SIGTERM.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        if let Err(e) = tokio::signal::ctrl_c().await {
            tracing::error!(error = %Chain(&e), "cannot listen for SIGINT");
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
                tracing::error!(error = %Chain(&e), "cannot listen for SIGTERM");
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
