//! Tells the service manager what the process is doing, by systemd's `sd_notify`
//! protocol: ready once both planes serve, reloading around a SIGHUP, stopping on
//! shutdown. Without `NOTIFY_SOCKET` in the environment (not started by systemd with
//! `Type=notify`) every call does nothing. It does not say whether the filters are
//! loaded: that is `/readyz`.

use sd_notify::NotifyState;

use crate::report::Chain;

/// Both planes accept connections (`READY=1`).
pub fn ready() {
    send("ready", &[NotifyState::Ready]);
}

/// A configuration reload starts (`RELOADING=1`, with the `MONOTONIC_USEC` that
/// systemd 253 and later want beside it); [`ready`] says when it is over.
pub fn reloading() {
    match NotifyState::monotonic_usec_now() {
        Ok(now) => send("reloading", &[NotifyState::Reloading, now]),
        Err(e) => {
            tracing::warn!(error = %Chain(&e), "cannot read the monotonic clock for the reload notice");
            send("reloading", &[NotifyState::Reloading]);
        }
    }
}

/// Shutdown has begun (`STOPPING=1`).
pub fn stopping() {
    send("stopping", &[NotifyState::Stopping]);
}

fn send(what: &str, states: &[NotifyState]) {
    // A notice that cannot be sent changes nothing the process does; systemd times the
    // start or reload out and says so.
    if let Err(e) = sd_notify::notify(states) {
        tracing::warn!(error = %Chain(&e), notice = what, "cannot notify the service manager");
    }
}
