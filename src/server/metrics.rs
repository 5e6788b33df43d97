//! The data plane's connection metrics: connections by protocol, those open now, those
//! refused past `server.max_connections`, failed TLS handshakes, certificate reloads and
//! the certificate's expiry. Registered on the registry passed in; the admin listener
//! counts nothing here.

use prometheus::{GaugeVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Registry};

use bloomgate_core::metrics::family;

/// The connection families of one data-plane listener.
#[derive(Clone)]
pub struct ConnectionMetrics {
    connections: IntCounterVec,
    accepted: IntCounterVec,
    open: IntGauge,
    refused: IntCounter,
    handshake_failures: IntCounterVec,
    reloads: IntCounterVec,
    expiry: GaugeVec,
}

/// Why a TLS handshake failed, as the `reason` label says it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HandshakeFailure {
    /// Not finished within `server.header_read_timeout`.
    Timeout,
    /// Refused by either side or cut off (no common version or cipher, not TLS at all, a
    /// reset).
    Error,
}

impl HandshakeFailure {
    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            HandshakeFailure::Timeout => "timeout",
            HandshakeFailure::Error => "error",
        }
    }
}

impl ConnectionMetrics {
    /// Registers the families on `registry`. With `tls`, the TLS series start at zero;
    /// without it they never appear (an expiry of 0 would read as long expired).
    pub fn register(registry: &Registry, tls: bool, http2: bool) -> prometheus::Result<Self> {
        let metrics = ConnectionMetrics {
            connections: family(
                registry,
                "bloomgate_connections_total",
                "Data-plane connections served, by protocol (http1, h2 over TLS, h2c in \
                 cleartext) and whether TLS carried them.",
                &["protocol", "tls"],
            )?,
            accepted: family(
                registry,
                "bloomgate_connections_accepted_total",
                "Data-plane connections accepted, by serving thread (its index under \
                 server.threading = \"per_core\"; \"shared\" otherwise): the kernel \
                 spreads connections over the threads' listeners by a hash of their \
                 addresses, not by load.",
                &["thread"],
            )?,
            open: family::<IntGaugeVec>(
                registry,
                "bloomgate_connections_open",
                "Data-plane connections open now, TLS handshakes in progress included \
                 (bounded by server.max_connections).",
                &[],
            )?
            .with_label_values(&[] as &[&str]),
            refused: family::<IntCounterVec>(
                registry,
                "bloomgate_connections_refused_total",
                "Data-plane connections closed at once because server.max_connections were \
                 open.",
                &[],
            )?
            .with_label_values(&[] as &[&str]),
            handshake_failures: family(
                registry,
                "bloomgate_tls_handshake_failures_total",
                "TLS handshakes that failed, by reason (timeout, error).",
                &["reason"],
            )?,
            reloads: family(
                registry,
                "bloomgate_tls_certificate_reloads_total",
                "Certificate reloads (SIGHUP), by result (ok, error: the previous \
                 certificate stays).",
                &["result"],
            )?,
            expiry: family(
                registry,
                "bloomgate_tls_certificate_expiry_timestamp_seconds",
                "Not-after time of the certificate served now, in Unix seconds.",
                &[],
            )?,
        };
        let tls_label = if tls { "true" } else { "false" };
        metrics.connections.with_label_values(&["http1", tls_label]);
        if http2 {
            let h2 = if tls { "h2" } else { "h2c" };
            metrics.connections.with_label_values(&[h2, tls_label]);
        }
        if tls {
            for reason in [HandshakeFailure::Timeout, HandshakeFailure::Error] {
                metrics
                    .handshake_failures
                    .with_label_values(&[reason.as_str()]);
            }
            for result in ["ok", "error"] {
                metrics.reloads.with_label_values(&[result]);
            }
        }
        Ok(metrics)
    }

    /// A connection is being served with `protocol` (`http1`, `h2`, `h2c`).
    pub fn served(&self, protocol: &str, tls: bool) {
        let tls = if tls { "true" } else { "false" };
        self.connections.with_label_values(&[protocol, tls]).inc();
    }

    /// The counter of connections accepted by the serving thread called `thread`.
    pub fn accepted_by(&self, thread: &str) -> IntCounter {
        self.accepted.with_label_values(&[thread])
    }

    /// A connection holds a slot until the guard is dropped.
    pub fn open(&self) -> OpenGuard {
        self.open.inc();
        OpenGuard(self.open.clone())
    }

    /// A connection was closed at once: every slot was taken.
    pub fn refused(&self) {
        self.refused.inc();
    }

    /// A TLS handshake failed.
    pub fn handshake_failed(&self, why: HandshakeFailure) {
        self.handshake_failures
            .with_label_values(&[why.as_str()])
            .inc();
    }

    /// A certificate reload ended: `ok`, or `error` (the previous certificate stays).
    pub fn reloaded(&self, ok: bool) {
        let result = if ok { "ok" } else { "error" };
        self.reloads.with_label_values(&[result]).inc();
    }

    /// The certificate now served expires at `not_after` (Unix seconds).
    pub fn certificate_expires(&self, not_after: i64) {
        // Exact for any date a certificate can hold (below 2^53 seconds).
        self.expiry
            .with_label_values(&[] as &[&str])
            .set(not_after as f64);
    }
}

/// Holds one in `bloomgate_connections_open` while alive.
pub struct OpenGuard(IntGauge);

impl Drop for OpenGuard {
    fn drop(&mut self) {
        self.0.dec();
    }
}
