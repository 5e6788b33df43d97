//! `[fleet]`: instances that share their filters through Redis.

use std::time::Duration;

use serde::{Deserialize, Serialize};

/// Fleet mode: instances that share their filters through Redis.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FleetConfig {
    /// `redis://[user:password@]host:port[/db]`, or `rediss://` for TLS. The password
    /// is never logged.
    pub redis_url: String,
    /// Prefix of every key this fleet writes; fleets sharing one Redis need distinct ones.
    #[serde(default = "default_fleet_namespace")]
    pub namespace: String,
    /// This instance's name in leases and stream entries; default: the host name and a
    /// random suffix.
    #[serde(default)]
    pub instance_id: Option<String>,
    /// How long a builder's lease lasts without renewal; failover takes this plus one
    /// `retry_interval` at most.
    #[serde(default = "default_lease_ttl", with = "humantime_serde")]
    pub lease_ttl: Duration,
    /// How often a builder renews its lease (well below `lease_ttl`).
    #[serde(default = "default_lease_renew", with = "humantime_serde")]
    pub lease_renew: Duration,
    /// How often a follower tries to take a free lease, checks the current generation
    /// and Redis's epoch, and how often an instance retries Redis after losing it.
    #[serde(default = "default_fleet_retry", with = "humantime_serde")]
    pub retry_interval: Duration,
    /// How long a superseded generation stays readable after a newer one is current.
    #[serde(default = "default_generation_grace", with = "humantime_serde")]
    pub generation_grace: Duration,
    /// Bytes per Redis string of a published snapshot.
    #[serde(default = "default_chunk_bytes")]
    pub chunk_bytes: usize,
    /// Once the change stream holds more entries than this past the current
    /// generation's start, the builder publishes a fresh generation so older ones can go.
    #[serde(default = "default_stream_max_entries")]
    pub stream_max_entries: u64,
    /// Timeout of one Redis command (blocking stream reads excepted).
    #[serde(default = "default_redis_timeout", with = "humantime_serde")]
    pub command_timeout: Duration,
}

fn default_fleet_namespace() -> String {
    "bloomgate".into()
}
fn default_lease_ttl() -> Duration {
    Duration::from_secs(10)
}
fn default_lease_renew() -> Duration {
    Duration::from_secs(3)
}
fn default_fleet_retry() -> Duration {
    Duration::from_secs(1)
}
fn default_generation_grace() -> Duration {
    Duration::from_secs(300)
}
fn default_chunk_bytes() -> usize {
    1 << 20
}
fn default_stream_max_entries() -> u64 {
    100_000
}
fn default_redis_timeout() -> Duration {
    Duration::from_secs(2)
}
