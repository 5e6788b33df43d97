//! The SQL origin: a parameterised `SELECT … WHERE key = ?` through the sqlx pool; the
//! row found becomes a JSON object.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{HeaderValue, StatusCode};

use super::guard::OriginGuard;
use super::{CachedResponse, Fetched, OriginError, Validators};
use crate::config::StaleWindows;
use crate::db::{Db, KeyParam};
use crate::key::OwnedKey;

/// A SQL origin of one route.
pub struct SqlOrigin {
    /// The pool.
    pub db: Db,
    /// The lookup query, with one `?` for the key.
    pub query: Arc<str>,
    /// Limit on the whole lookup, pool wait included.
    pub timeout: Duration,
    /// Positive TTL for what it finds.
    pub ttl: Duration,
    /// How long past the TTL what it finds may be served.
    pub stale: StaleWindows,
    /// The database's breaker and concurrency bound, shared by its routes.
    pub guard: Arc<OriginGuard>,
}

impl SqlOrigin {
    /// Looks `key` up within the timeout.
    pub(super) async fn fetch(&self, key: &OwnedKey) -> Result<Fetched, OriginError> {
        let param = match key {
            OwnedKey::Int(n) => KeyParam::Int(*n),
            OwnedKey::Text(s) => KeyParam::Text(s),
        };
        let row = tokio::time::timeout(self.timeout, self.db.lookup(&self.query, param))
            .await
            .map_err(|_| OriginError::Timeout(self.timeout))?
            .map_err(|e| {
                if e.is_unavailable() {
                    OriginError::DbUnavailable(e)
                } else {
                    OriginError::Db(e)
                }
            })?;
        match row {
            None => Ok(Fetched::NotFound),
            Some(map) => Ok(Fetched::Found(CachedResponse {
                status: StatusCode::OK,
                content_type: Some(HeaderValue::from_static("application/json")),
                body: Bytes::from(serde_json::to_vec(&map)?),
                ttl: Some(self.ttl),
                validators: Validators::default(),
                headers: None,
                with_credentials: false,
                stored_at: Instant::now(),
                stale: self.stale,
            })),
        }
    }
}
