//! bloomgate: a caching reverse proxy that keeps requests for keys that do not exist away
//! from the database. Every request on a guarded route goes through one pipeline:
//! route match and key normalisation → Bloom gate → response cache → origin.
//!
//! # Layout
//!
//! Data plane:
//! - [`pipeline`]: the request handler (`Proxy`) and its stages: `path` (canonical
//!   request paths), `route` (route match, key extraction, canonical origin targets),
//!   `response` (every response the proxy makes), `error`, `outcome`, `budget` (the
//!   per-client false-positive budget), `client` and `forwarded` (who the client is and
//!   what the next hop is told), `passthrough` and `write_through`.
//! - [`key`]: key normalisation, shared by requests and the filter loader.
//! - [`cache`]: positive and negative entries, coalesced loading, invalidation.
//! - [`origin`]: what answers a key the gate let through: SQL lookups and the upstream
//!   API (`origin::client` is the pooled HTTP client, `origin::http_cache` the HTTP
//!   caching rules for upstream answers).
//! - [`server`]: the accept loop: its bound on open connections, TLS termination with
//!   certificate reload, HTTP/1.1, h2 (ALPN) and h2c (prior knowledge), head limits,
//!   timeouts and graceful shutdown.
//!
//! Control plane:
//! - [`gate`]: each configured filter (`gate::Filter`): its live membership
//!   (`gate::membership`, the in-process Bloom filter today), verdict, readiness and
//!   capacity; `gate::build` (snapshots, full builds, rebuilds), `gate::sync`
//!   (incremental sync, the id gaps it reads again, and the rows it has read, to tell
//!   a changed row from one read again) and `gate::admit`, the one path by
//!   which a key becomes present.
//! - [`audit`]: the gate audits itself: a sample of refused keys asked of their origin
//!   in the background, found keys admitted at once and judged once sync has covered
//!   their refusal.
//! - [`admin`]: `/metrics`, `/healthz`, `/readyz` and the admin API; `admin::Endpoint`
//!   lists what it serves and `admin::ErrorCode` every refusal.
//! - [`metrics`]: the Prometheus families, by concern, on a registry passed in.
//! - [`config`]: the TOML config, environment overrides, validation, and its compiled
//!   form (patterns, sizes, header names, address ranges) that [`app`] wires.
//! - [`app`]: wiring of all of the above from a config.
//! - [`notify`]: what the process tells systemd (ready, reloading, stopping).
//!
//! Storage:
//! - [`filter`]: the Bloom filter itself (parameters, murmur3 double hashing, atomic bits);
//!   `filter::snapshot` is its versioned, checksummed file format.
//! - [`db`]: sqlx pools for MySQL/MariaDB and SQLite, lookups as JSON, key streaming.
//! - [`watermark`]: how far sync has read the source.
//!
//! The command line (`src/main.rs`, `src/cli/`: its grammar in `args`, the demo,
//! `filter build` and `filter inspect`, `init`, completions and manual pages; see
//! docs/cli.md) is the only code that prints for a person.

pub mod access_log;
pub mod admin;
pub mod app;
pub mod audit;
pub mod cache;
pub mod config;
pub mod db;
pub mod filter;
pub mod fleet;
pub mod gate;
pub mod key;
pub mod metrics;
pub mod notify;
pub mod origin;
pub mod pipeline;
pub mod reload;
pub mod server;
pub mod serving;
pub mod stages;
pub mod watermark;

pub use app::{App, AppError, reload_on_sighup, shutdown_signal};
pub use config::Config;
pub use reload::Reloader;
