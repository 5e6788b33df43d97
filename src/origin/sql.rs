//! The SQL origin: a parameterised `SELECT … WHERE key = ?` through the sqlx pool; the
//! row found becomes a JSON object.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::StatusCode;

use super::guard::OriginGuard;
use super::{CachedResponse, Fetched, OriginError, ResponseMeta, Stamp};
use bloomgate_core::db::{Db, KeyParam};
use bloomgate_core::key::OwnedKey;

/// A SQL origin of one route.
pub struct SqlOrigin {
    /// The pool.
    pub db: Db,
    /// The lookup query, with one `?` for the key.
    pub query: Arc<str>,
    /// Limit on the whole lookup, pool wait included.
    pub timeout: Duration,
    /// What every answer it finds carries (its TTL, a JSON content type, the route's
    /// stale windows), shared by all of them: see [`ResponseMeta::json_rows`].
    pub answer: Arc<ResponseMeta>,
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
                // A buffer exactly as long as the text, since it stays as long as the
                // entry: serialising leaves room to spare, and shrinking it in place
                // leaves the rest of its block unused.
                body: Bytes::copy_from_slice(&serde_json::to_vec(&map)?),
                stored_at: Stamp::now(),
                meta: Arc::clone(&self.answer),
                status: StatusCode::OK,
                with_credentials: false,
            })),
        }
    }
}
