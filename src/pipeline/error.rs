//! Errors on the request path and the one place where they become responses: a status,
//! a stable code, a generic JSON body. 4xx are the client's and are not logged as errors;
//! 5xx are logged once, with the cause, by the caller of [`ProxyError::log`].

use std::sync::Arc;

use bytes::Bytes;
use http::header::RETRY_AFTER;
use http::{HeaderValue, Response, StatusCode};
use http_body_util::{Either, Full};

use crate::origin::OriginError;
use crate::origin::client::UpstreamError;
use crate::origin::guard::Refusal;
use crate::pipeline::response::ProxyBody;
use bloomgate_core::key::KeyError;
use bloomgate_core::report::Chain;

/// A request that could not be answered normally.
#[derive(Debug, thiserror::Error)]
pub enum ProxyError {
    /// The key is missing or malformed: 400, before any lookup.
    #[error(transparent)]
    BadKey(#[from] KeyError),
    /// A path that cannot be normalised (a malformed escape) under a guarded route: 400.
    #[error(transparent)]
    BadPath(#[from] bloomgate_core::pattern::path::PathError),
    /// A spelling of a guarded path (an escaped `/`, a `\\`, `;` parameters) that an
    /// upstream could read as the guarded resource without the gate judging it: 400.
    #[error("the path is a non-canonical spelling of a guarded route")]
    NonCanonicalPath,
    /// The request body exceeds `server.max_body_bytes`: 413.
    #[error("request body exceeds the configured limit")]
    BodyTooLarge,
    /// The client has caused too many false positives this window: 429 with
    /// `Retry-After`, for requests that would need the origin. Never 404: a present
    /// product must not look absent.
    #[error("too many requests for unknown keys; retry in {retry_after_secs}s")]
    BudgetExhausted {
        /// Seconds until the client's window ends.
        retry_after_secs: u64,
    },
    /// The client's request body could not be read while it was being forwarded (a
    /// malformed chunk, a body cut short): 400. The upstream is not to blame.
    #[error("the request body is malformed or incomplete")]
    BadRequestBody(#[source] UpstreamError),
    /// The origin did not answer in time: 504.
    #[error("origin timed out")]
    Timeout(#[source] Failure),
    /// The database is down or its pool is exhausted: 503.
    #[error("origin unavailable")]
    Unavailable(#[source] Failure),
    /// The origin was not called: its circuit breaker is open (503 with `Retry-After`
    /// until it may be tried again).
    #[error("origin circuit open")]
    CircuitOpen {
        /// Seconds until the breaker lets a call through (at least 1).
        retry_after_secs: u64,
        /// The refusal.
        #[source]
        failure: Failure,
    },
    /// The origin was not called: as many calls as it takes are in flight and the queue
    /// is full or did not move in time (503 with `Retry-After: 1`).
    #[error("origin overloaded")]
    Overloaded(#[source] Failure),
    /// The upstream failed or answered badly: 502.
    #[error("bad gateway")]
    BadGateway(#[source] Failure),
    /// Anything else (a failing lookup query, an encoding error): 500.
    #[error("internal error")]
    Internal(#[source] Failure),
}

/// What failed behind a 5xx: this request's own exchange with the upstream, or an
/// origin load, whose error every request that waited on the load shares. Either keeps
/// its whole chain of causes for the log.
#[derive(Debug, thiserror::Error)]
pub enum Failure {
    /// A pass-through exchange with the upstream.
    #[error(transparent)]
    Upstream(#[from] UpstreamError),
    /// An origin lookup (an SQL query or an upstream fetch).
    #[error(transparent)]
    Origin(#[from] Arc<OriginError>),
}

impl ProxyError {
    /// The HTTP status this error answers with.
    pub fn status(&self) -> StatusCode {
        match self {
            ProxyError::BadKey(_)
            | ProxyError::BadPath(_)
            | ProxyError::NonCanonicalPath
            | ProxyError::BadRequestBody(_) => StatusCode::BAD_REQUEST,
            ProxyError::BodyTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            ProxyError::BudgetExhausted { .. } => StatusCode::TOO_MANY_REQUESTS,
            ProxyError::Timeout(_) => StatusCode::GATEWAY_TIMEOUT,
            ProxyError::Unavailable(_)
            | ProxyError::CircuitOpen { .. }
            | ProxyError::Overloaded(_) => StatusCode::SERVICE_UNAVAILABLE,
            ProxyError::BadGateway(_) => StatusCode::BAD_GATEWAY,
            ProxyError::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// A stable machine-readable code for the JSON body.
    pub fn as_str(&self) -> &'static str {
        match self {
            ProxyError::BadKey(k) => k.code(),
            ProxyError::BadPath(_) => "bad_path",
            ProxyError::NonCanonicalPath => "non_canonical_path",
            ProxyError::BodyTooLarge => "body_too_large",
            ProxyError::BudgetExhausted { .. } => "budget_exhausted",
            ProxyError::BadRequestBody(_) => "bad_request_body",
            ProxyError::Timeout(_) => "origin_timeout",
            ProxyError::Unavailable(_) => "origin_unavailable",
            ProxyError::CircuitOpen { .. } => "origin_circuit_open",
            ProxyError::Overloaded(_) => "origin_overloaded",
            ProxyError::BadGateway(_) => "bad_gateway",
            ProxyError::Internal(_) => "internal_error",
        }
    }

    /// Logs a server-side failure once, with its cause; client errors are only traced.
    pub fn log(&self, route: &str) {
        if self.status().is_server_error() {
            tracing::error!(route, code = self.as_str(), error = %Chain(self), "request failed");
        } else {
            let cause = std::error::Error::source(self).map(|c| Chain(c).to_string());
            tracing::debug!(route, code = self.as_str(), error = %self, cause, "request refused");
        }
    }

    /// The response: the status and `{"error": code, "message": …}`. Messages of 4xx
    /// explain the problem; messages of 5xx stay generic (the cause is in the log).
    pub fn into_response(self) -> Response<Full<Bytes>> {
        let message = match &self {
            ProxyError::BadKey(k) => k.to_string(),
            ProxyError::BodyTooLarge
            | ProxyError::BadPath(_)
            | ProxyError::NonCanonicalPath
            | ProxyError::BudgetExhausted { .. }
            | ProxyError::BadRequestBody(_) => self.to_string(),
            _ => self
                .status()
                .canonical_reason()
                .unwrap_or("error")
                .to_owned(),
        };
        let body = serde_json::json!({ "error": self.as_str(), "message": message });
        let mut resp = super::response::json(self.status(), body.to_string());
        let retry_after = match self {
            ProxyError::BudgetExhausted { retry_after_secs }
            | ProxyError::CircuitOpen {
                retry_after_secs, ..
            } => Some(retry_after_secs),
            ProxyError::Overloaded(_) => Some(1),
            _ => None,
        };
        if let Some(secs) = retry_after {
            resp.headers_mut()
                .insert(RETRY_AFTER, HeaderValue::from(secs));
        }
        resp
    }
}

impl From<UpstreamError> for ProxyError {
    fn from(e: UpstreamError) -> Self {
        match e {
            UpstreamError::BodyTooLarge => ProxyError::BodyTooLarge,
            UpstreamError::ClientBody(_) => ProxyError::BadRequestBody(e),
            UpstreamError::Timeout(_) => ProxyError::Timeout(e.into()),
            other => ProxyError::BadGateway(other.into()),
        }
    }
}

impl From<Arc<OriginError>> for ProxyError {
    fn from(e: Arc<OriginError>) -> Self {
        let wrap = match &*e {
            OriginError::Refused {
                refusal: Refusal::Open(after),
                ..
            } => {
                // Whole seconds, rounded up: a client told 0 would come straight back.
                let retry_after_secs = after.as_millis().div_ceil(1000).max(1) as u64;
                return ProxyError::CircuitOpen {
                    retry_after_secs,
                    failure: Failure::Origin(e),
                };
            }
            OriginError::Refused { .. } => ProxyError::Overloaded,
            OriginError::Timeout(_) | OriginError::Upstream(UpstreamError::Timeout(_)) => {
                ProxyError::Timeout
            }
            OriginError::DbUnavailable(_) => ProxyError::Unavailable,
            OriginError::Upstream(_)
            | OriginError::UpstreamStatus(_)
            | OriginError::UpstreamBody(_)
            | OriginError::UpstreamHost(_) => ProxyError::BadGateway,
            OriginError::Db(_) | OriginError::Encode(_) => ProxyError::Internal,
        };
        wrap(Failure::Origin(e))
    }
}

/// Turns an error into its response (the only place that does).
pub fn error_response(e: ProxyError) -> Response<ProxyBody> {
    e.into_response().map(Either::Left)
}

#[cfg(test)]
mod tests {
    use std::error::Error as StdError;
    use std::time::Duration;

    use http_body_util::{Either, Empty};

    use super::*;
    use crate::origin::client::Upstream;
    use crate::origin::guard::OriginGuard;
    use crate::origin::metrics::OriginFamilies;
    use crate::origin::{Origin, ResponseMeta, SqlOrigin};
    use bloomgate_core::config::{
        BreakerConfig, CompiledUpstream, DatabaseConfig, StaleWindows, UpstreamConfig,
    };
    use bloomgate_core::db::{Db, DbError, PoolSettings};
    use bloomgate_core::key::OwnedKey;

    fn test_guard() -> Arc<OriginGuard> {
        let families =
            OriginFamilies::register(&prometheus::Registry::new()).expect("families register");
        let limits = DatabaseConfig {
            url: "sqlite::memory:".into(),
            max_connections: 1,
            min_connections: 0,
            acquire_timeout: Duration::from_secs(1),
            max_in_flight: None,
            max_queued: None,
            queue_timeout: Duration::from_millis(100),
            breaker: BreakerConfig::default(),
        }
        .limits();
        Arc::new(OriginGuard::new(
            "database",
            &limits,
            families.handles("database"),
        ))
    }

    #[test]
    fn refused_origin_calls_answer_503_with_a_retry_after() {
        let open = ProxyError::from(Arc::new(OriginError::Refused {
            origin: "database",
            refusal: Refusal::Open(Duration::from_millis(2_300)),
        }));
        let resp = open.into_response();
        assert_eq!(resp.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(resp.headers()[RETRY_AFTER], "3");
        for refusal in [Refusal::QueueFull, Refusal::QueueTimeout] {
            let err = ProxyError::from(Arc::new(OriginError::Refused {
                origin: "upstream",
                refusal,
            }));
            assert_eq!(err.as_str(), "origin_overloaded");
            let resp = err.into_response();
            assert_eq!(resp.status(), StatusCode::SERVICE_UNAVAILABLE);
            assert_eq!(resp.headers()[RETRY_AFTER], "1");
        }
        // Less than a second left still asks for one, never for 0.
        let soon = ProxyError::from(Arc::new(OriginError::Refused {
            origin: "database",
            refusal: Refusal::Open(Duration::from_millis(10)),
        }));
        assert_eq!(soon.as_str(), "origin_circuit_open");
        assert_eq!(soon.into_response().headers()[RETRY_AFTER], "1");
    }

    /// The causes below `e`, nearest first.
    fn causes<'e>(e: &'e (dyn StdError + 'static)) -> Vec<&'e (dyn StdError + 'static)> {
        std::iter::successors(e.source(), |&c| c.source()).collect()
    }

    #[tokio::test]
    async fn a_failing_lookup_query_keeps_the_database_error_as_its_cause() {
        let db = Db::connect_lazy("sqlite::memory:", &PoolSettings::default()).expect("url");
        let origin = Origin::Sql(SqlOrigin {
            db,
            query: Arc::from("SELECT * FROM no_such_table WHERE id = ?"),
            timeout: Duration::from_secs(10),
            answer: ResponseMeta::json_rows(Duration::from_secs(60), StaleWindows::default()),
            guard: test_guard(),
        });
        let Err(failed) = origin.fetch(&OwnedKey::Int(1), None).await else {
            panic!("a query on a missing table must fail");
        };
        let err = ProxyError::from(Arc::new(failed));
        assert_eq!(err.status(), StatusCode::INTERNAL_SERVER_ERROR);
        assert_eq!(err.as_str(), "internal_error");
        // The log line reads as it did when the cause was flattened into the message.
        assert!(
            Chain(&err)
                .to_string()
                .starts_with("internal error: lookup query failed: database query failed: "),
            "{err}"
        );

        let chain = causes(&err);
        let db_error = chain
            .iter()
            .find_map(|c| c.downcast_ref::<DbError>())
            .expect("the DbError is in the chain");
        assert!(matches!(db_error, DbError::Query(_)), "{db_error:?}");
        let sqlx_error = chain
            .iter()
            .find_map(|c| c.downcast_ref::<sqlx::Error>())
            .expect("sqlx's error is in the chain");
        assert!(
            matches!(sqlx_error, sqlx::Error::Database(_)),
            "{sqlx_error:?}"
        );
        assert!(
            sqlx_error.to_string().contains("no_such_table"),
            "{sqlx_error}"
        );

        // The response stays generic: the cause is for the log only.
        let body = err.into_response().into_body();
        let bytes = http_body_util::BodyExt::collect(body)
            .await
            .expect("a full body")
            .to_bytes();
        let json: serde_json::Value = serde_json::from_slice(&bytes).expect("JSON");
        assert_eq!(
            json,
            serde_json::json!({"error": "internal_error", "message": "Internal Server Error"})
        );
    }

    #[tokio::test]
    async fn a_refused_upstream_connection_keeps_the_io_error_as_its_root_cause() {
        // A port that was just free: nothing listens on it now.
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().expect("address");
        drop(listener);
        let upstream = Upstream::new(
            &CompiledUpstream {
                settings: UpstreamConfig {
                    url: format!("http://{addr}"),
                    timeout: Duration::from_secs(10),
                    pool_idle_timeout: Duration::from_secs(1),
                    pool_max_idle: 1,
                    max_in_flight: None,
                    max_queued: None,
                    queue_timeout: Duration::from_millis(100),
                    breaker: BreakerConfig::default(),
                },
                authority: addr.to_string().parse().expect("an authority"),
            },
            0,
        );
        let req = http::Request::builder()
            .uri(upstream.uri_for_target("/x").expect("uri"))
            .body(Either::Left(Empty::new()))
            .expect("request");
        let failed = upstream.send(req).await.expect_err("nothing listens");
        let err = ProxyError::from(failed);
        assert_eq!(err.as_str(), "bad_gateway");
        let chain = causes(&err);
        let io = chain
            .iter()
            .find_map(|c| c.downcast_ref::<std::io::Error>())
            .expect("the socket error is in the chain");
        assert_eq!(io.kind(), std::io::ErrorKind::ConnectionRefused);
    }
}
