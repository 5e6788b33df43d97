//! The false-positive budget: how many requests for absent keys each client may push
//! through to the origin (the gate's false positives) within a window. A client past its
//! budget is told to come back later (429) for anything that would need an origin call;
//! its cache hits and intercepted keys are answered as usual. Counts live in a fixed-size
//! count-min sketch, so memory does not grow with the number of clients. It does not know
//! who the client is (see `client`) nor what to answer (see `proxy`).

use std::hash::BuildHasher;
use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Rows of the sketch: a client is over budget only if every row says so, so a client
/// must collide with heavy hitters in all of them to be refused wrongly.
const DEPTH: usize = 4;

/// Per-client false-positive counts in the current window, and the limit.
pub struct Budget {
    limit: u32,
    window: Duration,
    width: usize,
    /// `DEPTH × width` cells, each `(window number << 32) | count`: a cell from an older
    /// window reads as zero, so nothing has to be cleared when a window ends.
    cells: Box<[AtomicU64]>,
    /// Keyed randomly at start, so a client cannot choose addresses that collide.
    hasher: std::collections::hash_map::RandomState,
}

/// Whether a client may still cause origin calls for unknown keys.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Allowance {
    /// Under budget.
    Allowed,
    /// Over budget; the window ends in this many seconds (at least 1).
    Exhausted {
        /// Seconds until the window ends, for `Retry-After`.
        retry_after_secs: u64,
    },
}

impl Budget {
    /// A budget of `limit` false positives per client per `window`, counted in `width`
    /// cells per row (rounded up to a power of two).
    pub fn new(limit: u32, window: Duration, width: usize) -> Budget {
        let width = width.max(64).next_power_of_two();
        let cells = (0..DEPTH * width).map(|_| AtomicU64::new(0)).collect();
        Budget {
            limit,
            window: window.max(Duration::from_secs(1)),
            width,
            cells,
            hasher: std::collections::hash_map::RandomState::new(),
        }
    }

    /// The configured limit per window.
    pub fn limit(&self) -> u32 {
        self.limit
    }

    /// Memory held by the counters, in bytes.
    pub fn bytes(&self) -> usize {
        self.cells.len() * std::mem::size_of::<AtomicU64>()
    }

    /// Whether `client` may still make an origin call for a key that may be absent.
    pub fn check(&self, client: IpAddr) -> Allowance {
        self.check_at(client, now())
    }

    /// Counts one false positive (an absent key that reached the origin) for `client`.
    pub fn record(&self, client: IpAddr) {
        self.record_at(client, now());
    }

    /// [`Budget::check`] at a given time since the epoch (for tests).
    pub fn check_at(&self, client: IpAddr, now: Duration) -> Allowance {
        let (window, left) = self.window_of(now);
        let count = self
            .cells_of(client)
            .map(|i| read(self.cells[i].load(Ordering::Relaxed), window))
            .min()
            .unwrap_or(0);
        if count < self.limit {
            Allowance::Allowed
        } else {
            Allowance::Exhausted {
                retry_after_secs: left.as_secs().max(1),
            }
        }
    }

    /// [`Budget::record`] at a given time since the epoch (for tests).
    pub fn record_at(&self, client: IpAddr, now: Duration) {
        let (window, _) = self.window_of(now);
        for i in self.cells_of(client) {
            let cell = &self.cells[i];
            // A failed exchange means another request counted at the same moment: retry
            // with what it wrote.
            let _ = cell.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |old| {
                let count = read(old, window).saturating_add(1);
                Some(u64::from(window) << 32 | u64::from(count))
            });
        }
    }

    /// The window number for `now` and the time left in it.
    fn window_of(&self, now: Duration) -> (u32, Duration) {
        let w = self.window.as_millis().max(1);
        let n = now.as_millis() / w;
        let left_ms = w - now.as_millis() % w;
        // Window numbers wrap at 2^32; a cell 2^32 windows old reads as current, which at
        // one-second windows takes 136 years.
        (
            n as u32,
            Duration::from_millis(u64::try_from(left_ms).unwrap_or(u64::MAX)),
        )
    }

    fn cells_of(&self, client: IpAddr) -> impl Iterator<Item = usize> + '_ {
        let h = self
            .hasher
            .hash_one(bloomgate_core::pattern::cidrs::canonical_ip(client));
        let (h1, h2) = (h as u32 as usize, (h >> 32) as usize | 1);
        let mask = self.width - 1;
        (0..DEPTH).map(move |row| row * self.width + (h1.wrapping_add(row.wrapping_mul(h2)) & mask))
    }
}

/// Publishes the budget's settings (`bloomgate_false_positive_budget_per_client` and
/// `…_window_seconds`), so dashboards can draw the limit beside the `throttled` outcome.
pub fn register(
    registry: &prometheus::Registry,
    limit: u32,
    window: Duration,
) -> prometheus::Result<()> {
    let per_client = prometheus::Gauge::new(
        "bloomgate_false_positive_budget_per_client",
        "False positives one client may cause per window before its origin-bound requests get 429.",
    )?;
    per_client.set(f64::from(limit));
    let window_seconds = prometheus::Gauge::new(
        "bloomgate_false_positive_budget_window_seconds",
        "Length of a false-positive budget window.",
    )?;
    window_seconds.set(window.as_secs_f64());
    registry.register(Box::new(per_client))?;
    registry.register(Box::new(window_seconds))?;
    Ok(())
}

fn read(cell: u64, window: u32) -> u32 {
    if (cell >> 32) as u32 == window {
        cell as u32
    } else {
        0
    }
}

fn now() -> Duration {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or(Duration::ZERO)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(n: u32) -> IpAddr {
        IpAddr::V4(std::net::Ipv4Addr::from(n))
    }

    #[test]
    fn a_client_is_refused_past_its_budget_until_the_window_ends() {
        let b = Budget::new(3, Duration::from_secs(60), 1024);
        let t = Duration::from_secs(6_000); // the start of a window
        for _ in 0..3 {
            assert_eq!(b.check_at(ip(1), t), Allowance::Allowed);
            b.record_at(ip(1), t);
        }
        assert_eq!(
            b.check_at(ip(1), t + Duration::from_secs(15)),
            Allowance::Exhausted {
                retry_after_secs: 45
            }
        );
        // Others are not affected.
        assert_eq!(b.check_at(ip(2), t), Allowance::Allowed);
        // The next window starts afresh.
        assert_eq!(
            b.check_at(ip(1), t + Duration::from_secs(60)),
            Allowance::Allowed
        );
    }

    #[test]
    fn many_clients_do_not_push_an_innocent_one_over() {
        // 500 hunters at the limit in a sketch of 4 × 4096 cells: a row's cell is taken by
        // a hunter with probability 1 - e^(-500/4096) ≈ 0.115, so an innocent client is
        // refused only if all four of its cells are: about 0.00018, 18 in 100,000, plus
        // about 3 whose two hashes both equal a hunter's. More than 45 happens with a
        // chance near one in a million; three rows instead of four would refuse ~150.
        let b = Budget::new(5, Duration::from_secs(60), 4096);
        let t = Duration::from_secs(6_000);
        for c in 0..500u32 {
            for _ in 0..5 {
                b.record_at(ip(c), t);
            }
        }
        // A count-min sketch never counts low: every hunter is refused.
        let hunters_allowed = (0..500u32)
            .filter(|c| b.check_at(ip(*c), t) == Allowance::Allowed)
            .count();
        assert_eq!(hunters_allowed, 0, "hunters at their limit let through");
        let wrongly = (1_000_000..1_100_000u32)
            .filter(|c| b.check_at(ip(*c), t) != Allowance::Allowed)
            .count();
        assert!(
            wrongly <= 45,
            "{wrongly} of 100,000 innocent clients refused"
        );
        assert_eq!(b.bytes(), 4 * 4096 * 8);
    }

    #[test]
    fn mapped_and_plain_ipv4_are_one_client() {
        let b = Budget::new(1, Duration::from_secs(60), 64);
        let t = Duration::from_secs(6_000);
        b.record_at("::ffff:192.0.2.1".parse().expect("ip"), t);
        assert_ne!(
            b.check_at("192.0.2.1".parse().expect("ip"), t),
            Allowance::Allowed
        );
    }
}
