//! The admin plane: `/metrics`, `/healthz`, `/readyz`, `/admin/filters` and the mutating
//! calls (rebuild, add keys, invalidate cache entries, reload the configuration) behind a
//! bearer token. It observes
//! and steers the pipeline; it never answers data-plane traffic. What it serves is
//! [`Endpoint::ALL`], and every refusal is an [`ErrorCode`].

mod endpoint;
mod error_code;

pub use endpoint::Endpoint;
pub use error_code::ErrorCode;

use std::borrow::Cow;
use std::net::SocketAddr;
use std::sync::Arc;

use bytes::Bytes;
use http::header::{AUTHORIZATION, CONTENT_TYPE, WWW_AUTHENTICATE};
use http::{HeaderValue, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use prometheus::{Encoder, Registry, TextEncoder};
use serde_json::{Value, json};
use subtle::ConstantTimeEq;

use crate::gate::Filter;
use crate::gate::admit::{Admit, Forget};
use crate::pipeline::Proxy;
use crate::pipeline::response;
use crate::reload::{ReloadError, Reloader};
use crate::server::Handler;
use crate::stages::Metrics;
use bloomgate_core::config::ConfigError;
use bloomgate_core::key::normalize;
use bloomgate_core::report::Chain;

/// Largest admin request body (key uploads).
const MAX_ADMIN_BODY: usize = 64 * 1024 * 1024;

/// What the admin plane needs to see and steer.
pub struct Admin {
    /// Reloads the configuration; holds the filters, origins and token in force.
    pub reloader: Reloader,
    /// The data-plane handler (for cache invalidation and cache sizes).
    pub proxy: Arc<Proxy>,
    /// The admission path (adds keys, invalidates entries).
    pub admit: Arc<Admit>,
    /// Where metrics are registered.
    pub registry: Registry,
    /// Metric handles, for gauges refreshed at scrape time.
    pub metrics: Metrics,
    /// Fleet mode, when configured.
    pub fleet: Option<Arc<crate::fleet::Fleet>>,
    /// The data plane's serving threads, counted in the runtime metrics.
    pub serving_runtimes: crate::server::ServingRuntimes,
}

impl Handler for Admin {
    type Body = Full<Bytes>;

    async fn call(&self, req: Request<Incoming>, _peer: SocketAddr) -> Response<Full<Bytes>> {
        let path = req.uri().path().to_owned();
        let Some((endpoint, name)) = Endpoint::find(&path) else {
            return error(ErrorCode::NotFound, "unknown admin path");
        };
        if req.method() != endpoint.method() {
            return error(
                ErrorCode::MethodNotAllowed,
                "method not allowed on this path",
            );
        }
        if endpoint.mutates()
            && let Err(refusal) = self.authorize(&req)
        {
            return refusal.into_response();
        }
        match endpoint {
            Endpoint::Metrics => self.metrics_text().await,
            Endpoint::Healthz => text(StatusCode::OK, "ok\n"),
            Endpoint::Readyz => self.readyz(),
            Endpoint::Filters => json_response(StatusCode::OK, &self.filters_json()),
            Endpoint::Origins => {
                let origins: Vec<Value> = self
                    .reloader
                    .origins()
                    .iter()
                    .map(|o| o.status_json())
                    .collect();
                json_response(StatusCode::OK, &json!({ "origins": origins }))
            }
            Endpoint::Fleet => match &self.fleet {
                Some(fleet) => json_response(StatusCode::OK, &fleet.status_json()),
                None => error(
                    ErrorCode::FleetOff,
                    "fleet mode is not configured (no [fleet] section)",
                ),
            },
            Endpoint::Rebuild | Endpoint::AddKeys => {
                let filter = name.and_then(|n| self.reloader.filters().get(n).cloned());
                let Some(filter) = filter else {
                    return error(ErrorCode::NoSuchFilter, "no filter by that name");
                };
                if endpoint == Endpoint::Rebuild {
                    self.rebuild(&filter).await
                } else {
                    self.add_keys(&filter, req).await
                }
            }
            Endpoint::Invalidate => self.invalidate(req).await,
            Endpoint::Reload => self.reload().await,
        }
    }
}

impl Admin {
    async fn metrics_text(&self) -> Response<Full<Bytes>> {
        for filter in self.reloader.filters().values() {
            filter.publish_metrics();
        }
        let cache = self.proxy.cache();
        cache.run_pending_maintenance().await;
        let (positive, negative) = cache.entry_counts();
        self.metrics.set_cache_entries(positive, negative);
        self.metrics.set_cache_bytes(cache.estimated_bytes());
        let runtime = tokio::runtime::Handle::current().metrics();
        let (serving, serving_tasks) = self.serving_runtimes.counts();
        self.metrics.set_runtime(
            runtime.num_alive_tasks() + serving_tasks,
            runtime.num_workers() + serving,
        );
        let mut buf = Vec::with_capacity(16 * 1024);
        if let Err(e) = TextEncoder::new().encode(&self.registry.gather(), &mut buf) {
            tracing::error!(error = %Chain(&e), "cannot encode metrics");
            return error(ErrorCode::InternalError, "cannot encode metrics");
        }
        let mut resp = Response::new(Full::new(Bytes::from(buf)));
        resp.headers_mut().insert(
            CONTENT_TYPE,
            HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
        );
        resp
    }

    fn readyz(&self) -> Response<Full<Bytes>> {
        let filters = self.reloader.filters();
        let waiting: Vec<&str> = filters
            .values()
            .filter(|g| !g.is_ready())
            .map(|g| g.name())
            .collect();
        if waiting.is_empty() {
            json_response(StatusCode::OK, &json!({"ready": true}))
        } else {
            json_response(
                StatusCode::SERVICE_UNAVAILABLE,
                &json!({"ready": false, "loading": waiting}),
            )
        }
    }

    fn filters_json(&self) -> Value {
        let filters: Vec<Value> = self
            .reloader
            .filters()
            .values()
            .map(|g| {
                let cfg = g.config();
                let stats = g.stats();
                json!({
                    "name": g.name(),
                    "ready": g.is_ready(),
                    "target_false_positive_rate": cfg.false_positive_rate,
                    "capacity": stats.map_or(cfg.expected_items, |s| s.capacity),
                    "items": stats.map(|s| s.items),
                    "bits": stats.map(|s| s.bits),
                    "bytes": stats.map(|s| s.bytes),
                    "hashes": stats.map(|s| s.hashes),
                    "fill_ratio": stats.map(|s| s.fill_ratio),
                    "estimated_false_positive_rate": stats.map(|s| s.estimated_fpp),
                    "last_load": g.load_status(),
                    "unconfirmed_keys": g.unconfirmed_keys(),
                    "sync_watermark": g.watermark().map(|w| w.to_string()),
                    "sync_resume_from": crate::gate::sync::next_start(g).map(|w| w.to_string()),
                    "sync_open_gaps": g.sync_open_gaps(),
                    "snapshot_path": cfg.snapshot_path.as_ref().map(|p| p.display().to_string()),
                    "fleet": self.fleet.as_ref().and_then(|f| f.filter_json(g.name())),
                    "backend": cfg.backend,
                    "holds_copy": g.has_local_copy(),
                    "redis": g.held().map(|h| h.status_json()),
                })
            })
            .collect();
        json!({ "filters": filters })
    }

    fn authorize(&self, req: &Request<Incoming>) -> Result<(), Refusal> {
        let Some(token) = self.reloader.token() else {
            return Err(Refusal::new(
                ErrorCode::AdminDisabled,
                "mutating admin calls are disabled: set admin.token",
            ));
        };
        let presented = req
            .headers()
            .get(AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "));
        match presented {
            Some(p) if token_matches(p.trim(), &token) => Ok(()),
            _ => Err(Refusal::new(
                ErrorCode::Unauthorized,
                "a valid bearer token is required",
            )),
        }
    }

    /// Reloads the configuration file: 200 with what changed, or why nothing did.
    async fn reload(&self) -> Response<Full<Bytes>> {
        match self.reloader.reload().await {
            Ok(changes) => json_response(
                StatusCode::OK,
                &json!({"reloaded": true, "changes": changes}),
            ),
            Err(e) => {
                let (code, fields) = match &e {
                    ReloadError::NoFile => (ErrorCode::NoConfigFile, Vec::new()),
                    ReloadError::Invalid(ConfigError::Invalid(problems)) => (
                        ErrorCode::ConfigInvalid,
                        problems.iter().map(|p| p.field.clone()).collect(),
                    ),
                    ReloadError::Invalid(_) => (ErrorCode::ConfigInvalid, Vec::new()),
                    ReloadError::NeedsRestart(fields) => (ErrorCode::NeedsRestart, fields.clone()),
                    ReloadError::Failed(_) => (ErrorCode::ReloadFailed, Vec::new()),
                };
                json_response(
                    code.status(),
                    &json!({"reloaded": false, "error": code.as_str(), "message": Chain(&e).to_string(), "fields": fields}),
                )
            }
        }
    }

    /// Asks for a rebuild: on this instance, or in a fleet on the filter's builder
    /// (`builder` in the reply names it when the request was sent on).
    async fn rebuild(&self, filter: &Filter) -> Response<Full<Bytes>> {
        let sent_to = match &self.fleet {
            Some(fleet) => match fleet.send_rebuild(filter.name()).await {
                Ok(sent_to) => sent_to,
                Err(e) => {
                    tracing::warn!(filter = %filter.name(), error = %Chain(&e),
                        "could not send a rebuild request to the fleet's builder");
                    return error(
                        ErrorCode::FleetUnreachable,
                        &format!(
                            "this instance follows the filter's builder and could not send it the request through Redis ({}); try again, or ask the builder",
                            Chain(&e)
                        ),
                    );
                }
            },
            None => None,
        };
        if sent_to.is_none() {
            filter.request_rebuild(crate::gate::RebuildReason::Requested);
        }
        let mut body = json!({"filter": filter.name(), "rebuild": "requested"});
        if let Some(builder) = sent_to {
            body["builder"] = json!(builder);
        }
        json_response(StatusCode::ACCEPTED, &body)
    }

    async fn add_keys(&self, filter: &Filter, req: Request<Incoming>) -> Response<Full<Bytes>> {
        let raw = match read_keys(req).await {
            Ok(keys) => keys,
            Err(refusal) => return refusal.into_response(),
        };
        let mut keys = Vec::with_capacity(raw.len());
        let mut invalid = Vec::new();
        let rule = filter.normalize_rule().clone();
        for raw_key in &raw {
            match normalize(&rule, Cow::Borrowed(raw_key.as_str())) {
                Ok(key) => keys.push(key.to_owned_key()),
                Err(e) => invalid.push(json!({"key": raw_key, "error": e.code()})),
            }
        }
        // Before the first load there is no filter to add to: the keys are kept and go
        // into the first filter swapped in, whatever its source holds.
        let added = self.admit.admit(filter, &keys, Forget::Everything).await as u64;
        let pending = keys.len() as u64 - added;
        tracing::info!(
            filter = filter.name(),
            added,
            pending,
            invalid = invalid.len(),
            "keys added through the admin API"
        );
        json_response(
            StatusCode::OK,
            &json!({"filter": filter.name(), "added": added, "not_loaded_yet": pending, "invalid": invalid}),
        )
    }

    async fn invalidate(&self, req: Request<Incoming>) -> Response<Full<Bytes>> {
        let raw = match read_keys(req).await {
            Ok(keys) => keys,
            Err(refusal) => return refusal.into_response(),
        };
        let mut dropped = 0u64;
        for raw_key in &raw {
            for filter in self.reloader.filters().values() {
                if let Ok(key) = normalize(filter.normalize_rule(), Cow::Borrowed(raw_key.as_str()))
                {
                    self.admit
                        .invalidate(Some(filter.name()), &key.to_owned_key())
                        .await;
                    dropped += 1;
                }
            }
        }
        json_response(StatusCode::OK, &json!({"invalidated": dropped}))
    }
}

/// Reads keys from a JSON array (`["1","2"]` or `[1,2]`) or one key per line.
async fn read_keys(req: Request<Incoming>) -> Result<Vec<String>, Refusal> {
    let body = Limited::new(req.into_body(), MAX_ADMIN_BODY)
        .collect()
        .await
        .map_err(|_| Refusal::new(ErrorCode::BodyTooLarge, "body too large or unreadable"))?
        .to_bytes();
    let text = std::str::from_utf8(&body)
        .map_err(|_| Refusal::new(ErrorCode::BadBody, "body is not UTF-8"))?;
    if text.trim_start().starts_with('[') {
        let values: Vec<Value> = serde_json::from_str(text)
            .map_err(|e| Refusal::new(ErrorCode::BadJson, format!("invalid JSON array: {e}")))?;
        values
            .into_iter()
            .map(|v| match v {
                Value::String(s) => Ok(s),
                Value::Number(n) => Ok(n.to_string()),
                _ => Err(Refusal::new(
                    ErrorCode::BadKey,
                    "keys must be strings or numbers",
                )),
            })
            .collect()
    } else {
        Ok(text
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty())
            .map(str::to_owned)
            .collect())
    }
}

/// Whether `presented` is the configured `token`, compared in constant time. Only the
/// bytes are secret, not the length: slices of different lengths compare unequal at once,
/// so response timing may tell how long the token is, never which of its bytes a guess
/// got right.
fn token_matches(presented: &str, token: &str) -> bool {
    presented.as_bytes().ct_eq(token.as_bytes()).into()
}

fn text(status: StatusCode, body: &'static str) -> Response<Full<Bytes>> {
    let mut resp = Response::new(Full::new(Bytes::from_static(body.as_bytes())));
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    resp
}

fn json_response(status: StatusCode, value: &Value) -> Response<Full<Bytes>> {
    response::json(status, value.to_string())
}

/// Every admin refusal: the code's status, and `{"error": code, "message": …}`.
fn error(code: ErrorCode, message: &str) -> Response<Full<Bytes>> {
    json_response(
        code.status(),
        &json!({"error": code.as_str(), "message": message}),
    )
}

/// A refused admin call: its code and message.
#[derive(Debug)]
struct Refusal {
    code: ErrorCode,
    message: String,
}

impl Refusal {
    fn new(code: ErrorCode, message: impl Into<String>) -> Refusal {
        Refusal {
            code,
            message: message.into(),
        }
    }

    fn into_response(self) -> Response<Full<Bytes>> {
        let mut resp = error(self.code, &self.message);
        if self.code == ErrorCode::Unauthorized {
            resp.headers_mut()
                .insert(WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        resp
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_exact_token_matches() {
        let token = "s3cret-token";
        assert!(token_matches("s3cret-token", token));
        assert!(!token_matches("s3cret-tokeN", token));
        assert!(!token_matches("s3cret-toke", token));
        assert!(!token_matches("s3cret-token-", token));
        assert!(!token_matches("", token));
    }
}
