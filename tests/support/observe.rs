//! Reading state back: one `/metrics` scrape read as a whole (so several series come from
//! the same instant), waiting on a condition with a deadline, the `/admin/filters`
//! entry of the `products` filter, and auto-increment ids for the demo table.

use std::future::Future;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::Method;
use serde_json::Value;

use super::{HttpClient, TestDb, TestProxy};

/// One `/metrics` answer.
pub struct Scrape(String);

impl Scrape {
    /// Reads `/metrics` of the admin plane at `admin`.
    pub async fn of(client: &HttpClient, admin: SocketAddr) -> Scrape {
        let reply = client
            .send(
                Method::GET,
                &format!("http://{admin}/metrics"),
                &[],
                Bytes::new(),
            )
            .await;
        assert_eq!(reply.status.as_u16(), 200, "{}", reply.text());
        Scrape(reply.text())
    }

    /// The value of `series` (its name and labels exactly as exported), if present.
    pub fn get(&self, series: &str) -> Option<f64> {
        self.0.lines().find_map(|l| {
            l.strip_prefix(series)
                .filter(|rest| rest.starts_with(' '))
                .and_then(|v| v.trim().parse().ok())
        })
    }

    /// The value of `series`; fails the test when it is not exported.
    pub fn value(&self, series: &str) -> f64 {
        self.get(series)
            .unwrap_or_else(|| panic!("{series} is not in /metrics:\n{}", self.0))
    }
}

impl TestProxy {
    /// One scrape of `/metrics`.
    pub async fn scrape(&self) -> Scrape {
        Scrape::of(self.client(), self.admin).await
    }

    /// The `/admin/filters` entry of `name`.
    pub async fn filter_status(&self, name: &str) -> Value {
        filter_status(self.client(), self.admin, name).await
    }
}

/// The `/admin/filters` entry of `name` on the admin plane at `admin`.
pub async fn filter_status(client: &HttpClient, admin: SocketAddr, name: &str) -> Value {
    let reply = client
        .send(
            Method::GET,
            &format!("http://{admin}/admin/filters"),
            &[],
            Bytes::new(),
        )
        .await;
    let all = reply.json();
    all["filters"]
        .as_array()
        .and_then(|fs| fs.iter().find(|f| f["name"] == name))
        .cloned()
        .unwrap_or_else(|| panic!("no filter {name} in {all}"))
}

/// Checks `done` every 20 ms until it holds; fails the test with `what` after `limit`.
/// For state that moves on its own clock (a sync poll, a scheduled rebuild, an expiry),
/// where there is no event to wait on.
pub async fn eventually<F, Fut>(what: &str, limit: Duration, mut done: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = Instant::now() + limit;
    while !done().await {
        assert!(Instant::now() < deadline, "{what}: not within {limit:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

impl TestDb {
    /// Gives the demo table an auto-increment `id` column (unique, not the primary key):
    /// existing rows are numbered 1, 2, … and new rows continue from there.
    pub async fn add_auto_increment_ids(&self) {
        sqlx::query("ALTER TABLE products ADD COLUMN id BIGINT NOT NULL AUTO_INCREMENT UNIQUE")
            .execute(&self.admin)
            .await
            .expect("add an auto-increment id");
    }

    /// The product keys of the rows whose `id` lies in `first..=last`.
    pub async fn skus_with_ids(&self, first: u64, last: u64) -> Vec<u64> {
        sqlx::query_scalar::<_, u64>(
            "SELECT CAST(sku_id AS UNSIGNED) FROM products WHERE id BETWEEN ? AND ? ORDER BY id",
        )
        .bind(first)
        .bind(last)
        .fetch_all(&self.admin)
        .await
        .expect("read skus by id")
    }

    /// The largest `id` in the table.
    pub async fn max_id(&self) -> u64 {
        sqlx::query_scalar::<_, u64>("SELECT CAST(MAX(id) AS UNSIGNED) FROM products")
            .fetch_one(&self.admin)
            .await
            .expect("read MAX(id)")
    }
}

/// Reads a value with `read` every 20 ms until `done` holds for it, and returns that
/// value; fails the test after `limit`, naming what was awaited and the last value read.
/// The condition is what the test waits for; `limit` only bounds a hang, so give it room
/// for a loaded machine (tens of seconds).
pub async fn wait_value<T, F, Fut>(
    what: &str,
    limit: Duration,
    mut read: F,
    done: impl Fn(&T) -> bool,
) -> T
where
    T: std::fmt::Debug,
    F: FnMut() -> Fut,
    Fut: Future<Output = T>,
{
    let deadline = Instant::now() + limit;
    loop {
        let value = read().await;
        if done(&value) {
            return value;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: not within {limit:?}; last read {value:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
