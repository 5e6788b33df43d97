//! Reading state back: one `/metrics` scrape read as a whole (so several series come from
//! the same instant), waiting on a condition with a deadline, the `/admin/filters`
//! entry of the `products` filter, auto-increment ids for the demo table, and absent
//! keys that the gate of a running proxy refuses.

use std::future::Future;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use bloomgate::db::demo_absent_sku;
use bytes::Bytes;
use http::Method;
use serde_json::Value;

use super::binary::Bloomgate;
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

/// A running bloomgate whose data plane a test asks: the in-process [`TestProxy`] or the
/// binary, [`Bloomgate`].
pub trait DataPlane {
    /// The data plane's address.
    fn data_plane(&self) -> SocketAddr;
}

impl DataPlane for TestProxy {
    fn data_plane(&self) -> SocketAddr {
        self.data
    }
}

impl DataPlane for Bloomgate {
    fn data_plane(&self) -> SocketAddr {
        self.data
    }
}

/// Absent keys let through in a row at which [`refused_absent_keys`] gives up: at a
/// false-positive rate of 1%, twelve false positives in a row come once in 10^24 runs,
/// so only a gate that refuses (almost) nothing fails there.
pub const REFUSAL_TRIES: u64 = 12;

/// The first absent key from `demo_absent_sku(from)` on that the gate of `proxy`
/// refuses (404, `intercepted`) when asked for `prefix` followed by the key, e.g.
/// `"/api/products/"` or `"/api/product/info?sku_id="`. See [`refused_absent_keys`].
pub async fn refused_absent_key(proxy: &impl DataPlane, prefix: &str, from: u64) -> u64 {
    refused_absent_keys(proxy, prefix, from, 1).await[0]
}

/// `n` absent keys that the gate of `proxy` refuses (404, `intercepted`), asking for
/// `prefix` followed by `demo_absent_sku(from)`, `demo_absent_sku(from + 1)`, … in turn
/// and skipping the ones it lets through; fails the test if [`REFUSAL_TRIES`] keys in a
/// row are not refused.
///
/// Every build of a filter draws a random secret seed, so which absent keys are its
/// false positives changes from run to run: a test that needs a key the gate refuses
/// (to see it refused, then inserted, admitted or synced) takes it from here instead of
/// fixing one, which would be let through in about `false_positive_rate` of its runs.
/// Each key asked is one request: the false positives on the way reach the origin (a
/// lookup, a negative entry), and the refused ones count as refusals.
pub async fn refused_absent_keys(
    proxy: &impl DataPlane,
    prefix: &str,
    from: u64,
    n: usize,
) -> Vec<u64> {
    let client = HttpClient::new();
    let data = proxy.data_plane();
    let mut refused = Vec::with_capacity(n);
    let mut passed = Vec::new();
    let mut i = from;
    while refused.len() < n {
        let key = demo_absent_sku(i);
        i += 1;
        let path = format!("{prefix}{key}");
        let r = client
            .send(
                Method::GET,
                &format!("http://{data}{path}"),
                &[],
                Bytes::new(),
            )
            .await;
        if r.status.as_u16() == 404 && r.stage() == "intercepted" {
            refused.push(key);
            passed.clear();
            continue;
        }
        passed.push(format!("{path}: {} {}", r.status.as_u16(), r.stage()));
        assert!(
            (passed.len() as u64) < REFUSAL_TRIES,
            "{REFUSAL_TRIES} absent keys in a row not refused by the gate: {passed:?}"
        );
    }
    refused
}
