//! bloomgate: a caching reverse proxy that keeps requests for keys that do not exist away
//! from the database. Every request on a guarded route goes through one pipeline:
//! route match and key normalisation → Bloom gate → response cache → origin.
//!
//! # Layout
//!
//! - [`config`]: the TOML config, environment overrides, validation, and its compiled
//!   form (patterns, sizes, header names, address ranges) that [`app`] wires.
//! - [`client`]: the client's address (the peer, or what a trusted proxy reports).
//! - [`key`]: key normalisation, shared by requests and the filter loader.
//! - [`filter`]: the Bloom filter itself (parameters, murmur3 double hashing, atomic bits);
//!   `filter::snapshot` is its versioned, checksummed file format.
//! - [`gate`]: the live filter per name, its verdict, readiness, capacity, and (in
//!   `gate::build`) snapshots, full builds and rebuilds.
//! - [`http_cache`]: what HTTP caching rules let the cache do with an upstream answer.
//! - [`budget`]: the per-client budget of false positives that reach the origin.
//! - [`cache`]: positive and negative moka caches with coalesced loading.
//! - [`origin`]: SQL lookups and upstream fetches for keys the gate let through.
//! - [`db`]: sqlx pools for MySQL/MariaDB and SQLite, lookups as JSON, key streaming.
//! - [`proxy`]: the data-plane handler (`proxy::path` normalises request paths,
//!   `proxy::route` matches routes, extracts keys and builds canonical origin targets).
//! - [`passthrough`]: plain reverse proxying for routes that are not guarded.
//! - [`forwarded`]: the `X-Forwarded-*` and `Forwarded` headers the next hop sees.
//! - [`upstream`]: the pooled HTTP client to the upstream API.
//! - [`outcome`]: how a guarded request ended (metric label, log field, header).
//! - [`error`]: request-path errors and their responses.
//! - [`metrics`]: every Prometheus metric, on a registry passed in.
//! - [`admin`]: `/metrics`, `/healthz`, `/readyz` and the admin API.
//! - [`server`]: the HTTP/1.1 accept loop with head limits, timeouts and graceful
//!   shutdown.
//! - [`app`]: wiring of all of the above from a config.
//! - [`sync`]: incremental sync of new keys into the live filters (`sync::gaps` tracks
//!   the ids an integer-watermark poll skipped over, so late commits are read again).
//! - [`watermark`]: how far sync has read the source.
//! - [`tools`]: offline `filter build` and `filter inspect`.
//! - [`demo`]: the embedded SQLite demo.

pub mod admin;
pub mod app;
pub mod cache;
pub mod config;
pub mod db;
pub mod filter;
pub mod gate;
pub mod key;
pub mod metrics;
pub mod origin;
pub mod pipeline;
pub mod server;
pub mod watermark;

pub use app::{App, AppError, shutdown_signal};
pub use config::Config;
