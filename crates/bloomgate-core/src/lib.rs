//! bloomgate's bottom layer: what the proxy's stages are built from, knowing nothing of
//! them. The `bloomgate` package re-exports every module here under its own name
//! (`bloomgate::config`, `bloomgate::filter`, ...), and its `src/lib.rs` (# Layout) says
//! what each holds.
//!
//! Being a crate of its own is what keeps it at the bottom: code here cannot name the
//! gate, the cache, the pipeline or anything else above it, because this crate does not
//! depend on the crate they are in.

pub mod access_log;
pub mod cert;
pub mod config;
pub mod db;
pub mod filter;
pub mod key;
pub mod metrics;
pub mod notify;
pub mod pattern;
pub mod redis_conn;
pub mod report;
pub mod serving;
pub mod watermark;
