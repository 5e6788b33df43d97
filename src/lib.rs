//! bloomgate: a caching reverse proxy that keeps requests for keys that do not exist away
//! from the database. Every request on a guarded route goes through one pipeline:
//! route match and key normalisation → Bloom gate → response cache → origin.
//!
//! # Layout
//!
//! Three layers; a module imports only from its own layer's lower modules and from the
//! layers below it.
//!
//! Bottom (imports nothing above it): the workspace crate `bloomgate-core`
//! (`crates/bloomgate-core/`), re-exported here module by module under the same names.
//! The library's own modules import it as `bloomgate_core::…`, so every import says
//! which layer it reaches; the command line and the tests use the re-exports.
//! - [`key`]: key normalisation (`key::Normalize`, re-exported by the config), shared by
//!   requests and the filter loader.
//! - [`filter`]: the Bloom filter itself (parameters, murmur3 double hashing, atomic bits);
//!   `filter::snapshot` is its versioned, checksummed file format.
//! - [`watermark`]: how far sync has read the source.
//! - [`pattern`]: what the config compiles requests against: canonical request paths
//!   (`path`), route patterns and query rules (`route`), address ranges (`cidrs`).
//! - [`cert`]: the data plane's certificate files, read and checked.
//! - [`config`]: the TOML config (`config::model`, one file per section: server and
//!   admin, filters, routes, fleet, audit, origins), environment overrides, validation,
//!   and its compiled form (patterns, sizes, header names, address ranges).
//! - [`metrics`]: the toolkit every metric family is made with (one call per family,
//!   shared buckets, `unix_now`).
//! - [`db`]: sqlx pools for MySQL/MariaDB and SQLite, lookups as JSON, key streaming;
//!   [`access_log`], [`notify`] (what the process tells systemd), [`serving`].
//! - [`report`]: an error printed for a person or a log, with every cause below it.
//! - [`redis_conn`]: the connection to the fleet's Redis, whichever kind the config
//!   names (one server, Cluster, Sentinel), as one handle.
//!
//! Middle (each stage with its metrics beside it, in its `metrics` module):
//! - [`origin`]: what answers a key the gate let through: SQL lookups and the upstream
//!   API (`origin::client` is the pooled HTTP client, `origin::http_cache` the HTTP
//!   caching rules for upstream answers, `origin::guard` and `origin::breaker` the
//!   limits and circuit breakers).
//! - [`cache`]: positive and negative entries (`cache::expiry` their lifetimes,
//!   `cache::weight` their bounds), coalesced loading (`cache::load`), background refresh
//!   of stale entries (`cache::refresh`), invalidation (`cache::invalidate`).
//! - [`gate`]: each configured filter (`gate::Filter`): its live membership
//!   (`gate::membership`), verdict (`gate::verdict`, one call whether the filter is held
//!   in memory or in Redis) and capacity; `gate::status` (load status and readiness),
//!   `gate::fence` (a key admitted into the filter, and the fences of origin lookups),
//!   `gate::position` (where sync stands: watermark, gaps, last poll); `gate::build`
//!   (snapshots, full builds, rebuilds), `gate::sync` (incremental sync, the id gaps it
//!   reads again, and the rows it has read) and `gate::admit`, the one path by which a
//!   key becomes present; `gate::redis_held`, a filter held in Redis.
//! - [`fleet`]: several instances sharing their filters through Redis; `fleet::run`
//!   starts its loops, one file each under `fleet/run/`: watcher, supervisor, follower,
//!   builder, publisher.
//! - [`audit`]: the gate audits itself: a sample of refused keys asked of their origin
//!   in the background, found keys admitted at once and judged once sync has covered
//!   their refusal.
//!
//! Top:
//! - [`pipeline`]: the request handler (`Proxy`: dispatch) and its stages: `route`
//!   (which guarded route a request is for), `guarded` (gate, cache and origin for one
//!   guarded request, its facts computed once), `response` (every response the proxy
//!   makes), `error`, `outcome`, `budget` (the per-client false-positive budget), `client`
//!   and `forwarded` (who the client is and what the next hop is told), `passthrough`
//!   and `write_through`.
//! - [`server`]: the accept loop, its bound on open connections and draining;
//!   `server::connection` serves one accepted connection (TLS termination with
//!   certificate reload in `server::tls`, HTTP/1.1, h2 by ALPN and h2c by its preface in
//!   `server::sniff`, head limits, timeouts, idle and graceful shutdown);
//!   `server::long_target` is the 414 the server makes itself, knowing nothing of the
//!   handler; `server::per_core` is serving with one thread per core.
//! - [`stages`]: the long-lived parts and the assembly of a pipeline over them;
//!   `stages::Metrics` registers every metric family.
//! - [`reload`]: applying an edited config; [`admin`]: `/metrics`, `/healthz`, `/readyz`
//!   and the admin API (`admin::Endpoint` lists what it serves and `admin::ErrorCode`
//!   every refusal); [`app`]: wiring of all of the above from a config
//!   (`app::assemble` builds the stages, `app::sockets` binds the listeners, `app::run`
//!   serves and shuts down, `app::signals` handles SIGHUP, SIGINT and SIGTERM).
//!
//! The command line (`src/main.rs`, `src/cli/`: its grammar in `args`, the demo,
//! `filter build` and `filter inspect`, `init`, completions and manual pages; see
//! docs/cli.md; `inspect` words a snapshot's summary, `init/` reads a table's metadata per
//! database kind, decides in `decide` and `plan` and writes in `render`) is the only code
//! that prints for a person.
//!
//! The compiler holds the bottom layer: `bloomgate-core` does not depend on this crate,
//! so nothing in it can name a module above it. The middle and the top are this one
//! crate, and `tests/layout.rs` holds the rule between them: it places every module in
//! its layer, fails on any import that runs from a lower layer to a higher one, and
//! checks that the core crate declares exactly the bottom layer and this crate
//! re-exports all of it.

pub use bloomgate_core::{
    access_log, cert, config, db, filter, key, metrics, notify, pattern, redis_conn, report,
    serving, watermark,
};

pub mod admin;
pub mod app;
pub mod audit;
pub mod cache;
pub mod fleet;
pub mod gate;
pub mod origin;
pub mod pipeline;
pub mod reload;
pub mod server;
pub mod stages;

pub use app::{App, AppError, reload_on_sighup, shutdown_signal};
pub use config::Config;
pub use reload::Reloader;
