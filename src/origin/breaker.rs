//! The circuit breaker of one origin, as a state machine to which the caller passes the
//! time. It is closed (calls pass) until `consecutive_failures` calls in a row fail, or at
//! least `min_calls` calls within `window` fail in a share of `failure_ratio` or more.
//! Then it is open for `open_for`: every call is refused at once. After that it lets one
//! call through as a probe (half-open), refusing the others; the probe's success closes
//! it, its failure opens it again. Only failures of availability count (see
//! `OriginError::is_outage`): not a lookup that finds nothing, nor a query that is wrong.

use std::time::{Duration, Instant};

use bloomgate_core::config::BreakerConfig;

/// Buckets of the failure-ratio window: the window slides by a tenth of its length.
const BUCKETS: usize = 10;

/// The breaker's state, as `/admin/origins` and the `state` label say it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BreakerState {
    /// Calls pass.
    Closed,
    /// Calls are refused until the open period ends.
    Open,
    /// One probe call is let through; the others are refused.
    HalfOpen,
}

impl BreakerState {
    /// Every state, in label order.
    pub const ALL: [BreakerState; 3] = [
        BreakerState::Closed,
        BreakerState::Open,
        BreakerState::HalfOpen,
    ];

    /// Label for metrics and the admin API.
    pub fn as_str(self) -> &'static str {
        match self {
            BreakerState::Closed => "closed",
            BreakerState::Open => "open",
            BreakerState::HalfOpen => "half_open",
        }
    }
}

/// How a call that was let through ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Ending {
    /// It answered (found, not found, or an error that says nothing of availability).
    Success,
    /// It failed in a way that says the origin is unavailable.
    Failure,
    /// It was dropped before it ended (its request went away).
    Abandoned,
}

/// What the breaker let through.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Ticket {
    /// A call while closed.
    Normal,
    /// The one call of the half-open state.
    Probe,
}

/// One bucket of the window: its slot number and its counts.
#[derive(Debug, Clone, Copy, Default)]
struct Bucket {
    slot: u64,
    calls: u32,
    failures: u32,
}

/// The breaker's state machine; times are passed in, so it is tested without a clock.
#[derive(Debug)]
pub(super) struct Breaker {
    pub(super) settings: BreakerConfig,
    pub(super) state: BreakerState,
    pub(super) consecutive: u32,
    buckets: [Bucket; BUCKETS],
    /// When the current open period ends.
    pub(super) reopen_at: Option<Instant>,
    probing: bool,
    /// Reference point of the window's slots.
    epoch: Instant,
}

impl Breaker {
    pub(super) fn new(settings: BreakerConfig, now: Instant) -> Breaker {
        Breaker {
            settings,
            state: BreakerState::Closed,
            consecutive: 0,
            buckets: [Bucket::default(); BUCKETS],
            reopen_at: None,
            probing: false,
            epoch: now,
        }
    }

    /// Lets a call through, or says when to try again. Returns the state moved to, if
    /// it moved.
    pub(super) fn admit(
        &mut self,
        now: Instant,
    ) -> (Result<Ticket, Duration>, Option<BreakerState>) {
        match self.state {
            BreakerState::Closed => (Ok(Ticket::Normal), None),
            BreakerState::Open => match self.reopen_at {
                Some(at) if now < at => (Err(at - now), None),
                _ => {
                    self.state = BreakerState::HalfOpen;
                    self.probing = true;
                    (Ok(Ticket::Probe), Some(BreakerState::HalfOpen))
                }
            },
            BreakerState::HalfOpen if self.probing => {
                // The probe is out: its answer is due within the origin's timeout, but
                // a client is told to come back soon rather than after that.
                (Err(Duration::from_secs(1)), None)
            }
            BreakerState::HalfOpen => {
                self.probing = true;
                (Ok(Ticket::Probe), None)
            }
        }
    }

    /// Records how a call ended; returns the state moved to, if it moved.
    pub(super) fn record(
        &mut self,
        ticket: Ticket,
        ending: Ending,
        now: Instant,
    ) -> Option<BreakerState> {
        match (ticket, ending) {
            (Ticket::Probe, Ending::Success) => {
                self.close();
                Some(BreakerState::Closed)
            }
            (Ticket::Probe, Ending::Failure) => {
                self.open(now);
                Some(BreakerState::Open)
            }
            (Ticket::Probe, Ending::Abandoned) => {
                self.probing = false;
                None
            }
            // A call let through before the breaker opened tells nothing new.
            (Ticket::Normal, _) if self.state != BreakerState::Closed => None,
            (Ticket::Normal, Ending::Abandoned) => None,
            (Ticket::Normal, Ending::Success) => {
                self.consecutive = 0;
                self.bucket(now).calls += 1;
                None
            }
            (Ticket::Normal, Ending::Failure) => {
                self.consecutive += 1;
                let b = self.bucket(now);
                b.calls += 1;
                b.failures += 1;
                let (calls, failures) = self.window_counts(now);
                let ratio_tripped = calls >= self.settings.min_calls
                    && f64::from(failures) >= self.settings.failure_ratio * f64::from(calls);
                if self.consecutive >= self.settings.consecutive_failures || ratio_tripped {
                    self.open(now);
                    Some(BreakerState::Open)
                } else {
                    None
                }
            }
        }
    }

    fn open(&mut self, now: Instant) {
        self.state = BreakerState::Open;
        self.reopen_at = Some(now + self.settings.open_for);
        self.probing = false;
    }

    fn close(&mut self) {
        self.state = BreakerState::Closed;
        self.consecutive = 0;
        self.buckets = [Bucket::default(); BUCKETS];
        self.reopen_at = None;
        self.probing = false;
    }

    fn slot_len(&self) -> Duration {
        (self.settings.window / BUCKETS as u32).max(Duration::from_millis(1))
    }

    fn slot(&self, now: Instant) -> u64 {
        (now.saturating_duration_since(self.epoch).as_nanos() / self.slot_len().as_nanos()) as u64
    }

    /// The bucket of `now`, emptied if it last counted an older slot.
    fn bucket(&mut self, now: Instant) -> &mut Bucket {
        let slot = self.slot(now);
        let b = &mut self.buckets[(slot % BUCKETS as u64) as usize];
        if b.slot != slot {
            *b = Bucket {
                slot,
                ..Bucket::default()
            };
        }
        b
    }

    /// Calls and failures within the window ending at `now`.
    pub(super) fn window_counts(&self, now: Instant) -> (u32, u32) {
        let slot = self.slot(now);
        self.buckets
            .iter()
            .filter(|b| b.slot + (BUCKETS as u64) > slot && b.slot <= slot)
            .fold((0, 0), |(c, f), b| (c + b.calls, f + b.failures))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings() -> BreakerConfig {
        BreakerConfig {
            enabled: true,
            consecutive_failures: 3,
            failure_ratio: 0.5,
            min_calls: 10,
            window: Duration::from_secs(10),
            open_for: Duration::from_secs(5),
        }
    }

    fn call(b: &mut Breaker, ending: Ending, now: Instant) -> Option<BreakerState> {
        let (ticket, _) = b.admit(now);
        b.record(ticket.expect("admitted"), ending, now)
    }

    #[test]
    fn consecutive_failures_open_it_and_a_success_between_them_resets_the_count() {
        let t0 = Instant::now();
        let mut b = Breaker::new(settings(), t0);
        assert_eq!(call(&mut b, Ending::Failure, t0), None);
        assert_eq!(call(&mut b, Ending::Failure, t0), None);
        assert_eq!(call(&mut b, Ending::Success, t0), None);
        assert_eq!(call(&mut b, Ending::Failure, t0), None);
        assert_eq!(call(&mut b, Ending::Failure, t0), None);
        assert_eq!(call(&mut b, Ending::Failure, t0), Some(BreakerState::Open));
        // Open: refused with the time left.
        let (admitted, _) = b.admit(t0 + Duration::from_secs(2));
        assert_eq!(admitted, Err(Duration::from_secs(3)));
    }

    #[test]
    fn a_failure_ratio_over_the_window_opens_it_without_consecutive_failures() {
        let t0 = Instant::now();
        let mut b = Breaker::new(settings(), t0);
        // Alternating: never two failures in a row, half of the calls failing.
        for i in 0..9 {
            let ending = if i % 2 == 0 {
                Ending::Failure
            } else {
                Ending::Success
            };
            assert_eq!(call(&mut b, ending, t0), None, "call {i}");
        }
        // Ten calls, five failed: the ratio holds once min_calls is reached.
        assert_eq!(call(&mut b, Ending::Success, t0), None);
        assert_eq!(call(&mut b, Ending::Failure, t0), Some(BreakerState::Open));
    }

    #[test]
    fn failures_older_than_the_window_do_not_count() {
        let t0 = Instant::now();
        let mut b = Breaker::new(settings(), t0);
        for _ in 0..5 {
            call(&mut b, Ending::Failure, t0);
            call(&mut b, Ending::Success, t0);
        }
        // Eleven seconds later the ten calls above are out of the 10 s window.
        let later = t0 + Duration::from_secs(11);
        for _ in 0..4 {
            assert_eq!(call(&mut b, Ending::Success, later), None);
        }
        assert_eq!(call(&mut b, Ending::Failure, later), None);
        assert_eq!(b.window_counts(later), (5, 1));
    }

    #[test]
    fn half_open_lets_one_probe_through_and_its_answer_decides() {
        let t0 = Instant::now();
        let mut b = Breaker::new(settings(), t0);
        for _ in 0..3 {
            call(&mut b, Ending::Failure, t0);
        }
        assert_eq!(b.state, BreakerState::Open);
        let t1 = t0 + Duration::from_secs(5);
        let (probe, moved) = b.admit(t1);
        assert_eq!(
            (probe, moved),
            (Ok(Ticket::Probe), Some(BreakerState::HalfOpen))
        );
        // While the probe is out, everyone else is refused.
        assert!(b.admit(t1).0.is_err());
        // The probe fails: open again for a whole period.
        assert_eq!(
            b.record(Ticket::Probe, Ending::Failure, t1),
            Some(BreakerState::Open)
        );
        assert_eq!(
            b.admit(t1 + Duration::from_secs(1)).0,
            Err(Duration::from_secs(4))
        );
        // The next probe succeeds: closed, counts cleared.
        let t2 = t1 + Duration::from_secs(5);
        assert_eq!(b.admit(t2).0, Ok(Ticket::Probe));
        assert_eq!(
            b.record(Ticket::Probe, Ending::Success, t2),
            Some(BreakerState::Closed)
        );
        assert_eq!((b.consecutive, b.window_counts(t2)), (0, (0, 0)));
        assert_eq!(b.admit(t2).0, Ok(Ticket::Normal));
    }

    #[test]
    fn an_abandoned_probe_frees_the_half_open_slot() {
        let t0 = Instant::now();
        let mut b = Breaker::new(settings(), t0);
        for _ in 0..3 {
            call(&mut b, Ending::Failure, t0);
        }
        let t1 = t0 + Duration::from_secs(5);
        assert_eq!(b.admit(t1).0, Ok(Ticket::Probe));
        assert_eq!(b.record(Ticket::Probe, Ending::Abandoned, t1), None);
        assert_eq!(b.admit(t1).0, Ok(Ticket::Probe));
    }

    #[test]
    fn calls_let_through_before_it_opened_do_not_close_it() {
        let t0 = Instant::now();
        let mut b = Breaker::new(settings(), t0);
        let early: Vec<Ticket> = (0..4).map(|_| b.admit(t0).0.expect("closed")).collect();
        for t in &early[..3] {
            b.record(*t, Ending::Failure, t0);
        }
        assert_eq!(b.state, BreakerState::Open);
        // The fourth, started while closed, succeeds late: still open.
        assert_eq!(b.record(early[3], Ending::Success, t0), None);
        assert_eq!(b.state, BreakerState::Open);
    }
}
