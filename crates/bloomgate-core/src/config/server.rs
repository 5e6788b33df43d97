//! `[server]` and `[admin]`: the two listeners, their limits and credentials.

use std::net::SocketAddr;
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// Data-plane listener and request limits.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ServerConfig {
    /// Address of the data plane.
    pub listen: SocketAddr,
    /// A client has this long to send the request head; then the connection is closed.
    #[serde(with = "humantime_serde")]
    pub header_read_timeout: Duration,
    /// Request bodies larger than this are refused with 413.
    pub max_body_bytes: u64,
    /// On SIGINT/SIGTERM, in-flight requests get this long to finish.
    #[serde(with = "humantime_serde")]
    pub shutdown_grace: Duration,
    /// Largest request head (request line and headers) accepted; past it: 431.
    pub max_header_bytes: usize,
    /// Longest request target (path and query) accepted; past it: 414.
    pub max_uri_bytes: usize,
    /// Address ranges of proxies in front of bloomgate (load balancers) whose
    /// `X-Forwarded-For`, `X-Forwarded-Proto` and `Forwarded` headers are believed. From
    /// any other peer those headers are replaced, and the peer is the client.
    pub trusted_proxies: Vec<String>,
    /// Who sees the `x-bloomgate` header: `always`, `trusted` (clients in
    /// `outcome_header_clients` only) or `never`. Metrics and logs carry the outcome in
    /// every case.
    pub outcome_header: OutcomeHeaderPolicy,
    /// Client address ranges that see the `x-bloomgate` header under `trusted`.
    pub outcome_header_clients: Vec<String>,
    /// Serve HTTP/2 too: `h2` chosen by ALPN on TLS, and cleartext `h2c` from clients
    /// that start with the HTTP/2 preface (prior knowledge). `Upgrade: h2c` is not
    /// offered. Off: HTTP/1.1 only.
    pub http2: bool,
    /// Most data-plane connections open at once; past it a new connection is accepted
    /// and closed at once (counted in `bloomgate_connections_refused_total`).
    pub max_connections: usize,
    /// Most concurrent requests (streams) on one HTTP/2 connection, advertised to the
    /// client in its SETTINGS.
    pub http2_max_concurrent_streams: u32,
    /// TLS termination on the data plane. Off when absent: plain HTTP.
    pub tls: Option<TlsConfig>,
    /// How data-plane connections are spread over threads: `per_core` (one
    /// single-threaded runtime per serving thread, each accepting on a listener of its
    /// own bound with `SO_REUSEPORT`) or `shared` (one multi-threaded runtime, shared
    /// with background work).
    pub threading: Threading,
    /// Serving threads under `per_core`; 0 is one per CPU core.
    pub workers: usize,
}

impl ServerConfig {
    /// The serving threads `per_core` starts (`workers`, or one per CPU core when it is
    /// 0); 0 under `shared`.
    pub fn serving_threads(&self) -> usize {
        match (self.threading, self.workers) {
            (Threading::Shared, _) => 0,
            (Threading::PerCore, 0) => std::thread::available_parallelism().map_or(1, |n| n.get()),
            (Threading::PerCore, n) => n,
        }
    }
}

/// How the data plane runs its connections (`server.threading`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Threading {
    /// A thread per core, each with its own runtime and listener; a connection stays on
    /// the thread that accepted it. Background work (sync, builds, fleet, admin) runs on
    /// a runtime of its own.
    #[default]
    PerCore,
    /// One work-stealing runtime for connections and background work alike.
    Shared,
}

/// The data plane's certificate and key, read at start and again on SIGHUP.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TlsConfig {
    /// PEM file: the server's certificate first, then any intermediates.
    pub cert_file: std::path::PathBuf,
    /// PEM file: the private key of that certificate (PKCS#8, PKCS#1 or SEC1).
    pub key_file: std::path::PathBuf,
}

/// Who is told, in the `x-bloomgate` response header, which stage answered.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OutcomeHeaderPolicy {
    /// Every client (the demo's choice; handy while rolling out).
    #[default]
    Always,
    /// Only clients whose address is in `server.outcome_header_clients`.
    Trusted,
    /// Nobody.
    Never,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            listen: SocketAddr::from(([0, 0, 0, 0], 8080)),
            header_read_timeout: Duration::from_secs(10),
            max_body_bytes: 1024 * 1024,
            shutdown_grace: Duration::from_secs(10),
            max_header_bytes: 16 * 1024,
            max_uri_bytes: 8 * 1024,
            trusted_proxies: Vec::new(),
            outcome_header: OutcomeHeaderPolicy::Always,
            outcome_header_clients: Vec::new(),
            http2: true,
            max_connections: 10_000,
            http2_max_concurrent_streams: 128,
            tls: None,
            threading: Threading::PerCore,
            workers: 0,
        }
    }
}

/// Admin-plane listener and credentials.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AdminConfig {
    /// Address of the admin plane; keep it on loopback or a private network.
    pub listen: SocketAddr,
    /// Bearer token for mutating admin calls. When unset (and `token_file` too), those
    /// calls are refused.
    pub token: Option<String>,
    /// A file holding the token instead (a container or systemd secret); its trailing
    /// line break is dropped. Compiling reads it into `token` and clears this field, so a
    /// compiled config names its token in one place; a reload reads the file again.
    pub token_file: Option<std::path::PathBuf>,
}

impl Default for AdminConfig {
    fn default() -> Self {
        AdminConfig {
            listen: SocketAddr::from(([127, 0, 0, 1], 9090)),
            token: None,
            token_file: None,
        }
    }
}
