//! bloomgate: a caching reverse proxy that keeps requests for keys that do not exist away
//! from the database. Every request on a guarded route goes through one pipeline:
//! route match and key normalisation → Bloom gate → response cache → origin.
//!
//! # Layout
//!
//! Three layers; a module imports only from its own layer's lower modules and from the
//! layers below it.
//!
//! Bottom (imports nothing above it):
//! - [`key`]: key normalisation (`key::Normalize`, re-exported by the config), shared by
//!   requests and the filter loader.
//! - [`filter`]: the Bloom filter itself (parameters, murmur3 double hashing, atomic bits);
//!   `filter::snapshot` is its versioned, checksummed file format.
//! - [`watermark`]: how far sync has read the source.
//! - [`pattern`]: what the config compiles requests against: canonical request paths
//!   (`path`), route patterns and query rules (`route`), address ranges (`cidrs`).
//! - [`cert`]: the data plane's certificate files, read and checked.
//! - [`config`]: the TOML config, environment overrides, validation, and its compiled
//!   form (patterns, sizes, header names, address ranges).
//! - [`metrics`]: the toolkit every metric family is made with (one call per family,
//!   shared buckets, `unix_now`).
//! - [`db`]: sqlx pools for MySQL/MariaDB and SQLite, lookups as JSON, key streaming;
//!   [`access_log`], [`notify`] (what the process tells systemd), [`serving`].
//!
//! Middle (each stage with its metrics beside it, in its `metrics` module):
//! - [`origin`]: what answers a key the gate let through: SQL lookups and the upstream
//!   API (`origin::client` is the pooled HTTP client, `origin::http_cache` the HTTP
//!   caching rules for upstream answers, `origin::guard` and `origin::breaker` the
//!   limits and circuit breakers).
//! - [`cache`]: positive and negative entries, coalesced loading, invalidation.
//! - [`gate`]: each configured filter (`gate::Filter`): its live membership
//!   (`gate::membership`), verdict, readiness and capacity; `gate::build` (snapshots,
//!   full builds, rebuilds), `gate::sync` (incremental sync, the id gaps it reads again,
//!   and the rows it has read) and `gate::admit`, the one path by which a key becomes
//!   present; `gate::redis_held`, a filter held in Redis.
//! - [`fleet`]: several instances sharing their filters through Redis.
//! - [`audit`]: the gate audits itself: a sample of refused keys asked of their origin
//!   in the background, found keys admitted at once and judged once sync has covered
//!   their refusal.
//!
//! Top:
//! - [`pipeline`]: the request handler (`Proxy`) and its stages: `response` (every
//!   response the proxy makes), `error`, `outcome`, `budget` (the per-client
//!   false-positive budget), `client` and `forwarded` (who the client is and what the
//!   next hop is told), `passthrough` and `write_through`.
//! - [`server`]: the accept loop: its bound on open connections, TLS termination with
//!   certificate reload, HTTP/1.1, h2 (ALPN) and h2c (prior knowledge), head limits,
//!   timeouts and graceful shutdown.
//! - [`stages`]: the long-lived parts and the assembly of a pipeline over them;
//!   `stages::Metrics` registers every metric family.
//! - [`reload`]: applying an edited config; [`admin`]: `/metrics`, `/healthz`, `/readyz`
//!   and the admin API (`admin::Endpoint` lists what it serves and `admin::ErrorCode`
//!   every refusal); [`app`]: wiring of all of the above from a config.
//!
//! The command line (`src/main.rs`, `src/cli/`: its grammar in `args`, the demo,
//! `filter build` and `filter inspect`, `init`, completions and manual pages; see
//! docs/cli.md) is the only code that prints for a person.

pub mod access_log;
pub mod admin;
pub mod app;
pub mod audit;
pub mod cache;
pub mod cert;
pub mod config;
pub mod db;
pub mod filter;
pub mod fleet;
pub mod gate;
pub mod key;
pub mod metrics;
pub mod notify;
pub mod origin;
pub mod pattern;
pub mod pipeline;
pub mod reload;
pub mod server;
pub mod serving;
pub mod stages;
pub mod watermark;

pub use app::{App, AppError, reload_on_sighup, shutdown_signal};
pub use config::Config;
pub use reload::Reloader;
