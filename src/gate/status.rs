//! What a filter tells about itself: how its last load or rebuild went (`/admin/filters`
//! reads [`LoadStatus`]), whether it is ready to serve (`/readyz`), and the gauges
//! refreshed at each scrape. It neither loads nor builds (see `gate::build`).

use serde::Serialize;

use super::membership::Membership;
use super::{Filter, lock};
use crate::gate::metrics::FilterMetrics;
use bloomgate_core::filter::FilterStats;

/// The result of the last load or rebuild, for `/admin/filters`.
#[derive(Debug, Clone, Default, Serialize)]
pub struct LoadStatus {
    /// How the last attempt ended.
    pub result: LoadResult,
    /// How the live filter was obtained.
    pub origin: Option<LoadOrigin>,
    /// Why the last build ran.
    pub reason: Option<RebuildReason>,
    /// Unix seconds when the last attempt finished.
    pub finished_at: Option<f64>,
    /// Duration of the last attempt.
    pub duration_ms: Option<u64>,
    /// Source rows read by the last successful build.
    pub rows: Option<u64>,
    /// Rows whose key failed normalisation in the last successful build.
    pub skipped: Option<u64>,
    /// Message of the last failure, if the last attempt failed.
    pub error: Option<String>,
    /// Failed attempts since the last success.
    pub consecutive_failures: u32,
    /// Whether a build is running now.
    pub loading: bool,
}

/// How the last load or rebuild ended; `"ok"`, `"error"` or `"never"` in the admin API.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum LoadResult {
    /// No attempt has finished yet.
    #[default]
    Never,
    /// The filter was loaded.
    Ok,
    /// The attempt failed (see [`LoadStatus::error`]).
    Error,
}

/// Where the live filter came from; `"source"` or `"snapshot"` in the admin API.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum LoadOrigin {
    /// A full build from the source query.
    Source,
    /// The snapshot file, at start-up.
    Snapshot,
    /// A generation published by the fleet's builder.
    Fleet,
}

/// Why a rebuild was asked for; serialised as [`RebuildReason::as_str`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum RebuildReason {
    /// The first build at start-up.
    Startup,
    /// `POST /admin/filters/{name}/rebuild`.
    Requested,
    /// `rebuild_interval` elapsed.
    Scheduled,
    /// Items exceeded capacity.
    Capacity,
    /// The fleet's builder published a generation.
    Published,
    /// A configuration reload changed the filter's sizing.
    Reload,
    /// Binlog mode: the keys deleted from the source raised the effective
    /// false-positive rate to its bound.
    Deletes,
    /// Binlog mode: the log cannot be followed on from the filter's position (purged,
    /// another server's), or a statement changed the table without row events.
    Binlog,
}

impl RebuildReason {
    /// Label for logs and the admin API.
    pub fn as_str(self) -> &'static str {
        match self {
            RebuildReason::Startup => "startup",
            RebuildReason::Requested => "requested",
            RebuildReason::Scheduled => "scheduled",
            RebuildReason::Capacity => "capacity",
            RebuildReason::Published => "published",
            RebuildReason::Reload => "reload",
            RebuildReason::Deletes => "deletes",
            RebuildReason::Binlog => "binlog",
        }
    }
}

impl Filter {
    /// True once a filter is loaded here, or (for a filter held in Redis) once a
    /// generation in Redis was adopted. It stays true whatever happens to Redis after
    /// (requests that cannot be gated fail open, counted, as on any instance): an outage
    /// or a restart of Redis does not take every instance out of its load balancer.
    pub fn is_ready(&self) -> bool {
        self.has_local_copy() || self.held.get().is_some_and(|h| h.adopted_any())
    }

    /// True once this instance holds a copy of its own (built, loaded or restored).
    pub fn has_local_copy(&self) -> bool {
        self.live.load().is_some()
    }

    /// Statistics of the live filter.
    pub fn stats(&self) -> Option<FilterStats> {
        self.live.load().as_deref().map(Membership::stats)
    }

    /// Refreshes the filter gauges (called at scrape time and after changes).
    pub fn publish_metrics(&self) {
        if let Some(s) = self.stats() {
            self.metrics.set_stats(&s);
        }
        self.metrics.set_ready(self.is_ready());
    }

    /// Metric handles of this filter.
    pub fn metrics(&self) -> &FilterMetrics {
        &self.metrics
    }

    /// A copy of the last load's status.
    pub fn load_status(&self) -> LoadStatus {
        lock(&self.status).clone()
    }

    pub(super) fn update_status(&self, f: impl FnOnce(&mut LoadStatus)) {
        f(&mut lock(&self.status));
    }
}

#[cfg(test)]
mod tests {
    use serde_json::{Value, json};

    use super::*;

    #[test]
    fn load_status_keeps_the_admin_api_strings() {
        let never = serde_json::to_value(LoadStatus::default()).expect("serialise");
        assert_eq!(never["result"], "never");
        assert_eq!(never["origin"], Value::Null);
        assert_eq!(never["reason"], Value::Null);

        let loaded = serde_json::to_value(LoadStatus {
            result: LoadResult::Ok,
            origin: Some(LoadOrigin::Snapshot),
            reason: Some(RebuildReason::Startup),
            ..LoadStatus::default()
        })
        .expect("serialise");
        assert_eq!(loaded["result"], "ok");
        assert_eq!(loaded["origin"], "snapshot");
        assert_eq!(loaded["reason"], "startup");
        assert_eq!(
            serde_json::to_value(LoadResult::Error).expect("serialise"),
            "error"
        );
        assert_eq!(
            serde_json::to_value(LoadOrigin::Source).expect("serialise"),
            "source"
        );
        for reason in [
            RebuildReason::Startup,
            RebuildReason::Requested,
            RebuildReason::Scheduled,
            RebuildReason::Capacity,
        ] {
            assert_eq!(
                serde_json::to_value(reason).expect("serialise"),
                json!(reason.as_str())
            );
        }
    }
}
