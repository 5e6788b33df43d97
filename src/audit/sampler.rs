//! The audit's only part on the request path: whether a refused key is sampled, within
//! the per-second bound, and handing it to the background check. An unsampled key costs
//! one random draw: no lock, no allocation, no clock read. It never waits, and it does
//! not ask the origin (see `audit::check`).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use prometheus::IntCounter;
use tokio::sync::mpsc;

use super::metrics::{AuditMetrics, DropReason};
use crate::gate::{AdmissionMark, Filter};
use crate::origin::Origin;
use bloomgate_core::key::{NormKey, OwnedKey};

/// A refused key, with everything its check needs, by value: routes may be renumbered
/// or replaced while it waits.
pub struct Sample {
    /// The route's label.
    pub route: Arc<str>,
    /// The origin to ask.
    pub origin: Arc<Origin>,
    /// The filter that refused it.
    pub filter: Arc<Filter>,
    /// The key, canonical.
    pub key: OwnedKey,
    /// When it was refused.
    pub refused_at: Instant,
    /// Its filter's fence stripe at the refusal: an admission of the key between the
    /// refusal and the check moves it.
    pub mark: AdmissionMark,
}

impl Sample {
    /// A sample of `key`, refused now by `filter` on the route `route`.
    pub fn refused(
        route: &Arc<str>,
        origin: &Arc<Origin>,
        filter: &Arc<Filter>,
        key: &NormKey<'_>,
    ) -> Sample {
        Sample {
            route: Arc::clone(route),
            origin: Arc::clone(origin),
            mark: filter.admission_mark(key),
            filter: Arc::clone(filter),
            key: key.to_owned_key(),
            refused_at: Instant::now(),
        }
    }
}

/// Picks refused keys for the audit and queues them.
pub struct Sampler {
    /// A key is sampled when a uniform 64-bit draw is below this: 0 samples nothing,
    /// `u64::MAX` everything.
    threshold: u64,
    bound: PerSecond,
    queue: mpsc::Sender<Sample>,
    rate_limited: IntCounter,
    queue_full: IntCounter,
}

impl Sampler {
    /// Samples `rate` of the offered keys, at most `max_per_second` a second, into `queue`.
    pub fn new(
        rate: f64,
        max_per_second: u32,
        queue: mpsc::Sender<Sample>,
        metrics: &AuditMetrics,
    ) -> Sampler {
        let threshold = if rate >= 1.0 {
            u64::MAX
        } else if rate > 0.0 {
            // 2^64 · rate, below u64::MAX since rate < 1 (the cast saturates).
            ((rate * 18_446_744_073_709_551_616.0) as u64).min(u64::MAX - 1)
        } else {
            0
        };
        Sampler {
            threshold,
            bound: PerSecond::new(max_per_second),
            queue,
            rate_limited: metrics.dropped(DropReason::RateLimited),
            queue_full: metrics.dropped(DropReason::QueueFull),
        }
    }

    /// Offers a refused key: `sample` is called (and allocates) only if it is taken.
    /// Returns whether it was queued.
    pub fn offer(&self, sample: impl FnOnce() -> Sample) -> bool {
        if !self.draw() {
            return false;
        }
        match self.queue.try_send(sample()) {
            Ok(()) => true,
            Err(mpsc::error::TrySendError::Full(_)) => {
                self.queue_full.inc();
                false
            }
            // The check has stopped (shutting down): nothing to count.
            Err(mpsc::error::TrySendError::Closed(_)) => false,
        }
    }

    /// Whether this refusal is sampled: drawn at the rate, then within this second's
    /// allowance (a draw past it is counted as dropped).
    fn draw(&self) -> bool {
        let drawn = match self.threshold {
            0 => false,
            u64::MAX => true,
            t => rand::random::<u64>() < t,
        };
        if drawn && !self.bound.take(self.bound.second()) {
            self.rate_limited.inc();
            return false;
        }
        drawn
    }
}

/// At most `max` takes per second, counted in one atomic word: the second (since
/// `start`) in the high half, the takes within it in the low half.
struct PerSecond {
    max: u64,
    start: Instant,
    window: AtomicU64,
}

impl PerSecond {
    fn new(max: u32) -> PerSecond {
        PerSecond {
            max: u64::from(max),
            start: Instant::now(),
            window: AtomicU64::new(0),
        }
    }

    /// The current second, counted from `start`.
    fn second(&self) -> u64 {
        self.start.elapsed().as_secs() & 0xffff_ffff
    }

    /// Takes one of `second`'s allowance; false when it is used up.
    fn take(&self, second: u64) -> bool {
        let mut current = self.window.load(Ordering::Relaxed);
        loop {
            let (at, taken) = (current >> 32, current & 0xffff_ffff);
            // A thread that read the clock a moment earlier counts in the newer second.
            let next = if at >= second {
                if taken >= self.max {
                    return false;
                }
                current + 1
            } else {
                (second << 32) | 1
            };
            match self.window.compare_exchange_weak(
                current,
                next,
                Ordering::Relaxed,
                Ordering::Relaxed,
            ) {
                Ok(_) => return true,
                Err(actual) => current = actual,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use prometheus::Registry;

    use super::*;

    #[test]
    fn the_per_second_bound_holds_and_renews_each_second() {
        let bound = PerSecond::new(3);
        let taken = |second| (0..10).filter(|_| bound.take(second)).count();
        assert_eq!(taken(0), 3);
        assert_eq!(taken(0), 0, "used up for the rest of the second");
        assert_eq!(taken(1), 3, "a new second, a new allowance");
        // A late reader of second 1 counts against second 2, which is used up.
        assert_eq!(taken(2), 3);
        assert_eq!(taken(1), 0);
    }

    #[test]
    fn the_bound_holds_across_threads() {
        let bound = Arc::new(PerSecond::new(100));
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let bound = Arc::clone(&bound);
                std::thread::spawn(move || (0..1000).filter(|_| bound.take(7)).count())
            })
            .collect();
        let total: usize = threads
            .into_iter()
            .map(|t| t.join().expect("a counting thread"))
            .sum();
        assert_eq!(total, 100);
    }

    fn sampler(rate: f64, max_per_second: u32) -> (Sampler, AuditMetrics, mpsc::Receiver<Sample>) {
        let metrics = AuditMetrics::register(&Registry::new(), ["r"]).expect("metrics");
        let (tx, rx) = mpsc::channel(1_000_000);
        (
            Sampler::new(rate, max_per_second, tx, &metrics),
            metrics,
            rx,
        )
    }

    #[test]
    fn rate_zero_samples_nothing_and_rate_one_everything_within_the_bound() {
        let (none, metrics, _rx) = sampler(0.0, 10_000);
        assert_eq!((0..100_000).filter(|_| none.draw()).count(), 0);
        assert_eq!(metrics.dropped(DropReason::RateLimited).get(), 0);

        let (all, metrics, _rx) = sampler(1.0, 50);
        let taken = (0..1000).filter(|_| all.draw()).count();
        // The whole run fits in one or two seconds of the bound.
        assert!((50..=100).contains(&taken), "{taken}");
        assert_eq!(
            metrics.dropped(DropReason::RateLimited).get() as usize,
            1000 - taken
        );
    }

    #[test]
    fn a_small_rate_samples_about_that_share() {
        let (some, _metrics, _rx) = sampler(0.01, 10_000);
        let taken = (0..100_000).filter(|_| some.draw()).count();
        // 1000 expected; five standard deviations either side.
        assert!((840..=1160).contains(&taken), "{taken}");
    }
}
