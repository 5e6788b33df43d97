//! `[filters.NAME]`: one Bloom filter, where its keys come from, where its verdicts
//! are held, and how it is kept in sync with its source.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::Normalize;

/// One Bloom filter and where its keys come from.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FilterConfig {
    /// Query whose first column lists every key that exists, e.g. `SELECT sku_id FROM products`.
    pub source_query: String,
    /// Number of keys the filter is sized for.
    pub expected_items: u64,
    /// Target false-positive rate at `expected_items`, in (0, 1).
    #[serde(default = "default_fpp")]
    pub false_positive_rate: f64,
    /// How keys are normalised, for the loader and every route gated by this filter.
    #[serde(default)]
    pub normalize: Normalize,
    /// First wait before retrying a failed load; doubles up to `load_retry_max`.
    #[serde(default = "default_retry_initial", with = "humantime_serde")]
    pub load_retry_initial: Duration,
    /// Longest wait between load attempts.
    #[serde(default = "default_retry_max", with = "humantime_serde")]
    pub load_retry_max: Duration,
    /// Incremental sync of new keys between full builds. Without it keys only arrive
    /// through rebuilds, write-through and the admin API.
    #[serde(default)]
    pub sync: Option<SyncConfig>,
    /// Period of full rebuilds from `source_query` (how deleted keys leave the filter).
    /// Without it, rebuilds happen on demand and when capacity runs out.
    #[serde(default, with = "humantime_serde")]
    pub rebuild_interval: Option<Duration>,
    /// Share of capacity at which a warning is logged (once per crossing).
    #[serde(default = "default_capacity_warn")]
    pub capacity_warn_ratio: f64,
    /// The filter is saved here after each build and loaded from here at start-up.
    #[serde(default)]
    pub snapshot_path: Option<std::path::PathBuf>,
    /// Where requests are gated: this instance's copy only (`"local"`), or also a copy
    /// held in the fleet's Redis that every instance and other services ask
    /// (`"redis"`; needs `[fleet]`).
    #[serde(default)]
    pub backend: Backend,
    /// The Redis-held copy, with `backend = "redis"`.
    #[serde(default)]
    pub redis: HeldConfig,
}

/// Where a filter's verdicts come from.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Backend {
    /// The filter in this instance's memory.
    #[default]
    Local,
    /// A copy in the fleet's Redis, asked for every key the local copy refuses.
    Redis,
}

/// Settings of a filter held in Redis (`backend = "redis"`).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HeldConfig {
    /// Longest wait for Redis's answer to one check; past it, the local copy answers.
    #[serde(default = "default_held_timeout", with = "humantime_serde")]
    pub check_timeout: Duration,
    /// Bytes per Redis string holding the filter's bits (a multiple of 64, at most
    /// 512 MiB, Redis's largest string).
    #[serde(default = "default_shard_bytes")]
    pub shard_bytes: u64,
    /// Whether every instance keeps its own copy of the filter in memory as well
    /// (`true`, the default: refusals are answered locally, Redis is asked only about
    /// keys the local copy refuses). With `false` only the builder holds one (it builds
    /// and writes it); the other instances ask Redis about every key and fail open
    /// while it cannot answer.
    #[serde(default = "default_local_copy")]
    pub local_copy: bool,
}

impl Default for HeldConfig {
    fn default() -> Self {
        HeldConfig {
            check_timeout: default_held_timeout(),
            shard_bytes: default_shard_bytes(),
            local_copy: true,
        }
    }
}

fn default_held_timeout() -> Duration {
    Duration::from_millis(5)
}

fn default_local_copy() -> bool {
    true
}

/// The most a Redis string holds by default (`proto-max-bulk-len`, 512 MB): the largest
/// shard of a filter held in Redis.
pub const MAX_SHARD_BYTES: u64 = 512 * 1024 * 1024;

/// Shard size unless configured: half the most a Redis string may hold.
pub const DEFAULT_SHARD_BYTES: u64 = MAX_SHARD_BYTES / 2;

fn default_shard_bytes() -> u64 {
    DEFAULT_SHARD_BYTES
}

/// Incremental sync: a query polled on an interval that returns keys changed since a
/// watermark, or the server's binary log read as a replica (`watermark = "binlog"`).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SyncConfig {
    /// Polling only (required there, refused with `binlog`): two columns, the key and the
    /// watermark, with one `?` bound to the watermark, e.g.
    /// `SELECT sku_id, updated_at FROM products WHERE updated_at >= ?`.
    #[serde(default)]
    pub query: Option<String>,
    /// What the watermark is: a timestamp or integer column that polls read, or the
    /// position in the server's binary log.
    #[serde(default)]
    pub watermark: WatermarkKind,
    /// Returns the watermark to start from just before a full build (one row, one column),
    /// e.g. `SELECT MAX(id) FROM products`. Required for integer watermarks; timestamp
    /// watermarks default to bloomgate's clock at the start of the build.
    #[serde(default)]
    pub start_query: Option<String>,
    /// How often the query runs.
    #[serde(default = "default_sync_interval", with = "humantime_serde")]
    pub interval: Duration,
    /// Each poll reaches back this far before the watermark (timestamp watermarks), so
    /// rows committed late or stamped by a skewed clock are not missed.
    #[serde(default = "default_sync_overlap", with = "humantime_serde")]
    pub overlap: Duration,
    /// Integer watermarks: how many ids below a full build's start mark the first poll
    /// after that build reads again; ids missing there are tracked as gaps.
    #[serde(default = "default_sync_overlap_ids")]
    pub overlap_ids: u64,
    /// Integer watermarks: how long an id that a poll skipped over (its transaction had
    /// not committed) is read again before it is given up. Keep it above the longest
    /// write transaction.
    #[serde(default = "default_sync_gap_timeout", with = "humantime_serde")]
    pub gap_timeout: Duration,
    /// `watermark = "binlog"`: how the binary log is read.
    #[serde(default)]
    pub binlog: BinlogConfig,
}

/// Reading the source table's changes from the server's binary log, as a replica does
/// (`watermark = "binlog"`, MySQL 8 and MariaDB 10.6 or later).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BinlogConfig {
    /// The replica id bloomgate registers with; unique among the server's replicas.
    /// Unset: derived from the filter's name, in 1,000,000,000..2,000,000,000, a range
    /// replicas numbered by hand rarely reach.
    #[serde(default)]
    pub server_id: Option<u32>,
    /// The replication connection, for a user with `REPLICATION SLAVE` and
    /// `REPLICATION CLIENT` (and SELECT on the table). Unset: `database.url`.
    #[serde(default)]
    pub url: Option<String>,
    /// How often the server sends a heartbeat while it has no event to send; a stream
    /// silent for three heartbeats is taken for lost and reconnected.
    #[serde(default = "default_binlog_heartbeat", with = "humantime_serde")]
    pub heartbeat: Duration,
    /// Rebuild when the effective false-positive rate (the deleted keys' bits are still
    /// set) reaches this multiple of `false_positive_rate`.
    #[serde(default = "default_effective_rate_rebuild")]
    pub effective_rate_rebuild: f64,
}

impl Default for BinlogConfig {
    fn default() -> Self {
        BinlogConfig {
            server_id: None,
            url: None,
            heartbeat: default_binlog_heartbeat(),
            effective_rate_rebuild: default_effective_rate_rebuild(),
        }
    }
}

fn default_binlog_heartbeat() -> Duration {
    Duration::from_secs(1)
}

fn default_effective_rate_rebuild() -> f64 {
    1.5
}

/// The type of the sync watermark column.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum WatermarkKind {
    /// A TIMESTAMP/DATETIME column, compared in UTC.
    #[default]
    Timestamp,
    /// An integer column such as an auto-increment id.
    Integer,
    /// No column: the position in the server's binary log, which every committed insert,
    /// update and delete of the source table is read from.
    Binlog,
}

fn default_capacity_warn() -> f64 {
    0.85
}
fn default_sync_interval() -> Duration {
    Duration::from_secs(5)
}
fn default_sync_overlap() -> Duration {
    Duration::from_secs(10)
}
fn default_sync_overlap_ids() -> u64 {
    1000
}
fn default_sync_gap_timeout() -> Duration {
    Duration::from_secs(120)
}

fn default_fpp() -> f64 {
    0.01
}
fn default_retry_initial() -> Duration {
    Duration::from_millis(500)
}
fn default_retry_max() -> Duration {
    Duration::from_secs(30)
}
