//! A plain product API with no cache of its own, used by the load-test harness
//! (`benches/load/run`) as the "no protection" baseline and as the upstream behind nginx.
//!
//! `GET /api/products/{id}` runs one parameterised SELECT against MySQL/MariaDB per
//! request and answers 200 with the row as JSON, or 404. Anything else is 404 too, and a
//! key that is not an unsigned integer is 400.
//!
//! ```sh
//! PRODUCT_API_DATABASE_URL=mysql://user:pw@127.0.0.1:3306/shop \
//! PRODUCT_API_LISTEN=127.0.0.1:3000 \
//!     cargo run --release --example product_api
//! ```
//!
//! Both settings can also be given as arguments: `product_api LISTEN DATABASE_URL`.
//! `PRODUCT_API_POOL` sets the pool size (default 32).

use std::convert::Infallible;
use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode, header};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use sqlx::mysql::{MySqlPool, MySqlPoolOptions};
use tokio::net::TcpListener;

const PREFIX: &str = "/api/products/";

/// Price and timestamp are turned into text by the server, so the example needs no
/// decimal or date types of its own.
const LOOKUP: &str = "SELECT sku_id, name, CAST(price AS CHAR), \
     DATE_FORMAT(updated_at, '%Y-%m-%dT%H:%i:%sZ') FROM products WHERE sku_id = ?";

fn setting(env: &str, arg: Option<String>, default: Option<&str>) -> anyhow::Result<String> {
    if let Some(value) = arg {
        return Ok(value);
    }
    if let Ok(value) = std::env::var(env) {
        return Ok(value);
    }
    default
        .map(str::to_owned)
        .ok_or_else(|| anyhow::anyhow!("{env} is not set (or pass it as an argument)"))
}

fn reply(status: StatusCode, body: impl Into<Bytes>) -> Response<Full<Bytes>> {
    let mut resp = Response::new(Full::new(body.into()));
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("application/json"),
    );
    resp
}

async fn answer(pool: &MySqlPool, req: &Request<Incoming>) -> Response<Full<Bytes>> {
    if req.method() != Method::GET && req.method() != Method::HEAD {
        return reply(
            StatusCode::METHOD_NOT_ALLOWED,
            r#"{"error":"method_not_allowed"}"#,
        );
    }
    let Some(raw) = req.uri().path().strip_prefix(PREFIX) else {
        return reply(StatusCode::NOT_FOUND, r#"{"error":"no_such_route"}"#);
    };
    let Ok(id) = raw.parse::<u64>() else {
        return reply(StatusCode::BAD_REQUEST, r#"{"error":"bad_id"}"#);
    };
    let Ok(id) = i64::try_from(id) else {
        return reply(StatusCode::NOT_FOUND, r#"{"error":"not_found"}"#);
    };
    let row: Result<Option<(i64, String, String, String)>, sqlx::Error> =
        sqlx::query_as(LOOKUP).bind(id).fetch_optional(pool).await;
    match row {
        Ok(Some((sku_id, name, price, updated_at))) => {
            let price: serde_json::Value = price
                .parse::<f64>()
                .map(serde_json::Value::from)
                .unwrap_or(serde_json::Value::String(price));
            let body = serde_json::json!({
                "sku_id": sku_id,
                "name": name,
                "price": price,
                "updated_at": updated_at,
            });
            reply(StatusCode::OK, body.to_string())
        }
        Ok(None) => reply(StatusCode::NOT_FOUND, r#"{"error":"not_found"}"#),
        Err(e) => {
            eprintln!("product_api: lookup of {id} failed: {e}");
            reply(StatusCode::SERVICE_UNAVAILABLE, r#"{"error":"database"}"#)
        }
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let listen: SocketAddr =
        setting("PRODUCT_API_LISTEN", args.next(), Some("127.0.0.1:3000"))?.parse()?;
    let url = setting("PRODUCT_API_DATABASE_URL", args.next(), None)?;
    let pool_size: u32 = setting("PRODUCT_API_POOL", None, Some("32"))?.parse()?;

    let pool = MySqlPoolOptions::new()
        .max_connections(pool_size)
        .acquire_timeout(Duration::from_secs(5))
        .connect(&url)
        .await?;
    let listener = TcpListener::bind(listen).await?;
    eprintln!(
        "product_api: listening on http://{} (pool of {pool_size})",
        listener.local_addr()?
    );

    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new()).keep_alive(true);

    let stop = tokio::signal::ctrl_c();
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::pin!(stop);
    loop {
        let (stream, _peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(pair) => pair,
                Err(e) => {
                    eprintln!("product_api: accept failed: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            _ = &mut stop => break,
            _ = term.recv() => break,
        };
        let _ = stream.set_nodelay(true);
        let pool = pool.clone();
        let service = service_fn(move |req: Request<Incoming>| {
            let pool = pool.clone();
            async move { Ok::<_, Infallible>(answer(&pool, &req).await) }
        });
        let conn = http.serve_connection(TokioIo::new(stream), service);
        tokio::spawn(async move {
            let _ = conn.await;
        });
    }
    eprintln!("product_api: stopping");
    pool.close().await;
    Ok(())
}
