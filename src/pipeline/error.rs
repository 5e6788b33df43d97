//! Errors on the request path and the one place where they become responses: a status,
//! a stable code, a generic JSON body. 4xx are the client's and are not logged as errors;
//! 5xx are logged once, with the cause, by the caller of [`ProxyError::log`].

use bytes::Bytes;
use http::header::RETRY_AFTER;
use http::{HeaderValue, Response, StatusCode};
use http_body_util::Full;

use crate::cache::LoadMiss;
use crate::key::KeyError;
use crate::origin::OriginError;
use crate::origin::client::UpstreamError;

/// A request that could not be answered normally.
#[derive(Debug, thiserror::Error)]
pub enum ProxyError {
    /// The key is missing or malformed: 400, before any lookup.
    #[error(transparent)]
    BadKey(#[from] KeyError),
    /// A path that cannot be normalised (a malformed escape) under a guarded route: 400.
    #[error(transparent)]
    BadPath(#[from] crate::pipeline::path::PathError),
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
    /// The request target (path and query) is longer than `server.max_uri_bytes`: 414.
    #[error("the request target is {len} bytes long; at most {limit} are accepted")]
    UriTooLong {
        /// Length of the path and query received.
        len: usize,
        /// The configured limit.
        limit: usize,
    },
    /// The origin did not answer in time: 504.
    #[error("origin timed out: {0}")]
    Timeout(String),
    /// The database is down or its pool is exhausted: 503.
    #[error("origin unavailable: {0}")]
    Unavailable(String),
    /// The upstream failed or answered badly: 502.
    #[error("bad gateway: {0}")]
    BadGateway(String),
    /// Anything else (a failing lookup query, an encoding error): 500.
    #[error("internal error: {0}")]
    Internal(String),
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
            ProxyError::UriTooLong { .. } => StatusCode::URI_TOO_LONG,
            ProxyError::Timeout(_) => StatusCode::GATEWAY_TIMEOUT,
            ProxyError::Unavailable(_) => StatusCode::SERVICE_UNAVAILABLE,
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
            ProxyError::UriTooLong { .. } => "uri_too_long",
            ProxyError::Timeout(_) => "origin_timeout",
            ProxyError::Unavailable(_) => "origin_unavailable",
            ProxyError::BadGateway(_) => "bad_gateway",
            ProxyError::Internal(_) => "internal_error",
        }
    }

    /// Logs a server-side failure once, with its cause; client errors are only traced.
    pub fn log(&self, route: &str) {
        if self.status().is_server_error() {
            tracing::error!(route, code = self.as_str(), error = %self, "request failed");
        } else {
            let cause = std::error::Error::source(self).map(ToString::to_string);
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
            | ProxyError::BadRequestBody(_)
            | ProxyError::UriTooLong { .. } => self.to_string(),
            _ => self
                .status()
                .canonical_reason()
                .unwrap_or("error")
                .to_owned(),
        };
        let body = serde_json::json!({ "error": self.as_str(), "message": message });
        let mut resp = super::response::json(self.status(), body.to_string());
        if let ProxyError::BudgetExhausted { retry_after_secs } = self {
            resp.headers_mut()
                .insert(RETRY_AFTER, HeaderValue::from(retry_after_secs));
        }
        resp
    }
}

impl From<UpstreamError> for ProxyError {
    fn from(e: UpstreamError) -> Self {
        match e {
            UpstreamError::BodyTooLarge => ProxyError::BodyTooLarge,
            UpstreamError::ClientBody(_) => ProxyError::BadRequestBody(e),
            UpstreamError::Timeout(_) => ProxyError::Timeout(e.to_string()),
            other => ProxyError::BadGateway(other.to_string()),
        }
    }
}

impl From<&OriginError> for ProxyError {
    fn from(e: &OriginError) -> Self {
        match e {
            OriginError::Timeout(_) => ProxyError::Timeout(e.to_string()),
            OriginError::DbUnavailable(_) => ProxyError::Unavailable(e.to_string()),
            OriginError::Upstream(UpstreamError::Timeout(_)) => ProxyError::Timeout(e.to_string()),
            OriginError::Upstream(_)
            | OriginError::UpstreamStatus(_)
            | OriginError::UpstreamBody(_) => ProxyError::BadGateway(e.to_string()),
            OriginError::Db(_) | OriginError::Encode(_) => ProxyError::Internal(e.to_string()),
        }
    }
}

impl From<&LoadMiss> for ProxyError {
    fn from(e: &LoadMiss) -> Self {
        match e {
            LoadMiss::Origin(o) => o.into(),
            LoadMiss::NotFound | LoadMiss::Unstored(_) => ProxyError::Internal(
                "a not-found or unstored load was reported as a failure".into(),
            ),
        }
    }
}
