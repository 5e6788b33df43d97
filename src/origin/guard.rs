//! What stands between the pipeline and one origin (the database, or the upstream), shared
//! by every route that uses it: the circuit breaker (see `breaker`) and a bound on the
//! calls in flight with a short queue behind it, so that the origin never sees more
//! concurrent lookups than configured, whatever the client concurrency. None of this is
//! on the hot path: intercepted keys and cache hits never get here.

use std::future::Future;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use tokio::sync::{Semaphore, SemaphorePermit};

use super::OriginError;
use super::breaker::{Breaker, BreakerState, Ending, Ticket};
use crate::origin::metrics::OriginMetrics;
use bloomgate_core::config::OriginLimits;

/// Why a call was not made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// The breaker is open (or half-open with its probe out); try again in this long.
    Open(Duration),
    /// The queue for a free slot is full.
    QueueFull,
    /// No slot came free within `queue_timeout`.
    QueueTimeout,
}

impl Refusal {
    /// Label for metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            Refusal::Open(_) => "circuit_open",
            Refusal::QueueFull => "queue_full",
            Refusal::QueueTimeout => "queue_timeout",
        }
    }
}

/// The breaker and the concurrency bound of one origin. Its settings change in place
/// on a reload ([`OriginGuard::reconfigure`]); the breaker keeps its state.
pub struct OriginGuard {
    name: &'static str,
    /// `None` with the breaker disabled.
    breaker: Mutex<Option<Breaker>>,
    slots: Arc<Semaphore>,
    max_in_flight: AtomicUsize,
    queued: AtomicUsize,
    max_queued: AtomicUsize,
    queue_timeout_us: AtomicU64,
    metrics: OriginMetrics,
}

impl OriginGuard {
    /// The guard of origin `name` (`database`, `upstream`).
    pub fn new(name: &'static str, limits: &OriginLimits, metrics: OriginMetrics) -> OriginGuard {
        metrics.set_state(BreakerState::Closed);
        OriginGuard {
            name,
            breaker: Mutex::new(
                limits
                    .breaker
                    .enabled
                    .then(|| Breaker::new(limits.breaker.clone(), Instant::now())),
            ),
            slots: Arc::new(Semaphore::new(limits.max_in_flight)),
            max_in_flight: AtomicUsize::new(limits.max_in_flight),
            queued: AtomicUsize::new(0),
            max_queued: AtomicUsize::new(limits.max_queued),
            queue_timeout_us: AtomicU64::new(micros(limits.queue_timeout)),
            metrics,
        }
    }

    /// Applies reloaded limits. Calls in flight finish; a lower `max_in_flight` holds back
    /// the slots they free until the new bound is met. The breaker keeps its state and
    /// counts under the new thresholds; disabling it closes it, enabling it starts closed.
    pub fn reconfigure(&self, limits: &OriginLimits) {
        let new = limits.max_in_flight;
        let old = self.max_in_flight.swap(new, Ordering::AcqRel);
        if new > old {
            self.slots.add_permits(new - old);
        } else if new < old {
            let excess = old - new;
            let gone = self.slots.forget_permits(excess);
            if let Ok(rest) = u32::try_from(excess - gone)
                && rest > 0
            {
                // Taken as calls in flight return them.
                let slots = Arc::clone(&self.slots);
                tokio::spawn(async move {
                    if let Ok(held) = slots.acquire_many_owned(rest).await {
                        held.forget();
                    }
                });
            }
        }
        self.max_queued.store(limits.max_queued, Ordering::Release);
        self.queue_timeout_us
            .store(micros(limits.queue_timeout), Ordering::Release);
        let mut breaker = lock(&self.breaker);
        match (breaker.as_mut(), limits.breaker.enabled) {
            (Some(b), true) => b.settings = limits.breaker.clone(),
            (None, true) => *breaker = Some(Breaker::new(limits.breaker.clone(), Instant::now())),
            (Some(_), false) => {
                *breaker = None;
                self.metrics.set_state(BreakerState::Closed);
            }
            (None, false) => {}
        }
    }

    /// The origin's name.
    pub fn name(&self) -> &'static str {
        self.name
    }

    /// Runs `call` if the breaker and the bound allow it, and records how it ended.
    pub async fn call<T>(
        &self,
        call: impl Future<Output = Result<T, OriginError>>,
    ) -> Result<T, OriginError> {
        let ticket = self.admit()?;
        let mut pending = Pending {
            guard: self,
            ticket,
            ending: Ending::Abandoned,
        };
        let _slot = self.slot().await?;
        self.metrics.in_flight(1);
        let _in_flight = InFlight(&self.metrics);
        let result = call.await;
        let failed = result.as_ref().err().is_some_and(OriginError::is_outage);
        pending.ending = if failed {
            Ending::Failure
        } else {
            Ending::Success
        };
        self.metrics.call(failed);
        result
    }

    fn admit(&self) -> Result<Option<Ticket>, OriginError> {
        let Some((admitted, moved)) = lock(&self.breaker)
            .as_mut()
            .map(|b| b.admit(Instant::now()))
        else {
            return Ok(None);
        };
        if let Some(to) = moved {
            self.moved(to);
        }
        match admitted {
            Ok(ticket) => Ok(Some(ticket)),
            Err(retry_after) => {
                self.metrics.refused(Refusal::Open(retry_after).as_str());
                Err(OriginError::Refused {
                    origin: self.name,
                    refusal: Refusal::Open(retry_after),
                })
            }
        }
    }

    /// A free slot, waited for in the bounded queue.
    async fn slot(&self) -> Result<SemaphorePermit<'_>, OriginError> {
        if let Ok(permit) = self.slots.try_acquire() {
            return Ok(permit);
        }
        let refuse = |refusal: Refusal| {
            self.metrics.refused(refusal.as_str());
            OriginError::Refused {
                origin: self.name,
                refusal,
            }
        };
        if self.queued.fetch_add(1, Ordering::AcqRel) >= self.max_queued.load(Ordering::Acquire) {
            self.queued.fetch_sub(1, Ordering::AcqRel);
            return Err(refuse(Refusal::QueueFull));
        }
        self.metrics.queued(1);
        let wait = Duration::from_micros(self.queue_timeout_us.load(Ordering::Acquire));
        let waited = tokio::time::timeout(wait, self.slots.acquire()).await;
        self.queued.fetch_sub(1, Ordering::AcqRel);
        self.metrics.queued(-1);
        match waited {
            Ok(Ok(permit)) => Ok(permit),
            // The semaphore is never closed; a timeout is the only way here.
            _ => Err(refuse(Refusal::QueueTimeout)),
        }
    }

    fn record(&self, ticket: Ticket, ending: Ending) {
        // A ticket of a breaker since disabled (a reload) has nothing to record.
        let moved = lock(&self.breaker)
            .as_mut()
            .and_then(|b| b.record(ticket, ending, Instant::now()));
        if let Some(to) = moved {
            self.moved(to);
        }
    }

    fn moved(&self, to: BreakerState) {
        match to {
            BreakerState::Open => {
                tracing::warn!(
                    origin = self.name,
                    "origin failing: circuit breaker open; requests that need it are answered at once"
                )
            }
            BreakerState::HalfOpen => {
                tracing::info!(
                    origin = self.name,
                    "circuit breaker half-open: probing the origin with one request"
                )
            }
            BreakerState::Closed => {
                tracing::info!(
                    origin = self.name,
                    "origin answered the probe: circuit breaker closed"
                )
            }
        }
        self.metrics.transition(to);
    }

    /// The state for `/admin/origins`.
    pub fn status_json(&self) -> Value {
        let max_in_flight = self.max_in_flight.load(Ordering::Acquire);
        let breaker = lock(&self.breaker);
        let breaker = breaker.as_ref().map(|b| {
            let now = Instant::now();
            let (calls, failures) = b.window_counts(now);
            json!({
                "state": b.state.as_str(),
                "consecutive_failures": b.consecutive,
                "window": { "calls": calls, "failures": failures },
                "retry_in_ms": b.reopen_at
                    .filter(|_| b.state == BreakerState::Open)
                    .map(|at| at.saturating_duration_since(now).as_millis() as u64),
                "settings": {
                    "consecutive_failures": b.settings.consecutive_failures,
                    "failure_ratio": b.settings.failure_ratio,
                    "min_calls": b.settings.min_calls,
                    "window_ms": b.settings.window.as_millis() as u64,
                    "open_for_ms": b.settings.open_for.as_millis() as u64,
                },
            })
        });
        json!({
            "origin": self.name,
            "breaker": breaker,
            "in_flight": max_in_flight.saturating_sub(self.slots.available_permits()),
            "max_in_flight": max_in_flight,
            "queued": self.queued.load(Ordering::Acquire),
            "max_queued": self.max_queued.load(Ordering::Acquire),
            "queue_timeout_ms": self.queue_timeout_us.load(Ordering::Acquire) / 1000,
        })
    }
}

/// A call let through, recorded when it ends (or is dropped).
struct Pending<'g> {
    guard: &'g OriginGuard,
    ticket: Option<Ticket>,
    ending: Ending,
}

impl Drop for Pending<'_> {
    fn drop(&mut self) {
        if let Some(ticket) = self.ticket {
            self.guard.record(ticket, self.ending);
        }
    }
}

/// Counts a call in flight until dropped.
struct InFlight<'m>(&'m OriginMetrics);

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.in_flight(-1);
    }
}

fn lock(m: &Mutex<Option<Breaker>>) -> MutexGuard<'_, Option<Breaker>> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}
