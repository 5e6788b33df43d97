//! How long each entry lives in moka: a positive entry as long as its answer's TTL and
//! the stale time after it, a negative entry its own TTL (given when it is stored).

use std::time::{Duration, Instant};

use moka::Expiry;

use super::CacheKey;
use crate::origin::CachedResponse;

pub(super) struct PositiveExpiry;

impl Expiry<CacheKey, CachedResponse> for PositiveExpiry {
    fn expire_after_create(
        &self,
        _: &CacheKey,
        value: &CachedResponse,
        _: Instant,
    ) -> Option<Duration> {
        Some(kept_for(value))
    }

    fn expire_after_update(
        &self,
        _: &CacheKey,
        value: &CachedResponse,
        _: Instant,
        _: Option<Duration>,
    ) -> Option<Duration> {
        // A refreshed entry lives as long as its new answer says, not the old one.
        Some(kept_for(value))
    }
}

/// How long an answer stays in the cache: its TTL, then as long as it may be served
/// stale. Answers without a lifetime are never inserted; zero would expire one at once.
fn kept_for(value: &CachedResponse) -> Duration {
    value
        .meta
        .ttl
        .map_or(Duration::ZERO, |ttl| ttl + value.meta.stale.longest())
}

pub(super) struct NegativeExpiry;

impl Expiry<CacheKey, Duration> for NegativeExpiry {
    fn expire_after_create(&self, _: &CacheKey, ttl: &Duration, _: Instant) -> Option<Duration> {
        Some(*ttl)
    }
}
