//! The audit's ledger: keys the gate refused that the audit is asking about or has found
//! at their origin, each waiting for its decision, and whether another admission (sync,
//! write-through, the admin API, the fleet's stream) has brought it in meanwhile. It is
//! the [`AdmissionWatcher`] that `Admit` tells of every admission; while it holds
//! nothing, that costs an admission one atomic load. It decides nothing itself (see
//! `audit::check`).

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use prometheus::IntCounter;

use crate::gate::Filter;
use crate::gate::admit::AdmissionWatcher;
use bloomgate_core::key::OwnedKey;

/// Most keys waiting at once; past it, the oldest is let go (counted).
pub const MAX_WAITING: usize = 10_000;

/// A key in the ledger.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Ticket(u64);

/// One key waiting for its decision.
pub struct Watch {
    /// The route that refused it.
    pub route: Arc<str>,
    /// The filter that refused it.
    pub filter: Arc<Filter>,
    /// The key.
    pub key: OwnedKey,
    /// When the origin said it has the key; `None` while it is being asked.
    pub found_at: Option<Instant>,
    /// Another admission brought it in after its refusal.
    pub brought_in: bool,
}

/// Keys waiting for their decision, in the order they came.
pub struct Ledger {
    /// How many keys wait: read without the lock, so that admissions pay nothing more
    /// while none does.
    waiting: AtomicUsize,
    inner: Mutex<Inner>,
    cap: usize,
    /// Keys let go because the ledger was full.
    dropped: IntCounter,
}

#[derive(Default)]
struct Inner {
    next: u64,
    /// Oldest first.
    order: BTreeMap<Ticket, Watch>,
    /// The tickets of each key (one per filter that refused it).
    by_key: HashMap<OwnedKey, Vec<Ticket>>,
}

impl Inner {
    fn remove(&mut self, ticket: Ticket) -> Option<Watch> {
        let watch = self.order.remove(&ticket)?;
        if let Some(tickets) = self.by_key.get_mut(&watch.key) {
            tickets.retain(|t| *t != ticket);
            if tickets.is_empty() {
                self.by_key.remove(&watch.key);
            }
        }
        Some(watch)
    }
}

impl Ledger {
    /// A ledger of at most `cap` keys; `dropped` counts the ones let go past it.
    pub fn new(cap: usize, dropped: IntCounter) -> Ledger {
        Ledger {
            waiting: AtomicUsize::new(0),
            inner: Mutex::new(Inner::default()),
            cap: cap.max(1),
            dropped,
        }
    }

    /// Starts watching `key` of `filter`, refused on `route`; `None` if it is watched
    /// already (refused again before its first refusal was judged).
    pub fn watch(&self, route: &Arc<str>, filter: &Arc<Filter>, key: &OwnedKey) -> Option<Ticket> {
        let mut inner = self.lock();
        let watched = inner.by_key.get(key).is_some_and(|tickets| {
            tickets.iter().any(|t| {
                inner
                    .order
                    .get(t)
                    .is_some_and(|w| Arc::ptr_eq(&w.filter, filter))
            })
        });
        if watched {
            return None;
        }
        while inner.order.len() >= self.cap {
            let Some((&oldest, _)) = inner.order.first_key_value() else {
                break;
            };
            if let Some(gone) = inner.remove(oldest) {
                tracing::warn!(route = %gone.route, filter = gone.filter.name(), key = %gone.key,
                    cap = self.cap, "audit ledger full; the oldest key waiting for its decision is let go");
                self.dropped.inc();
            }
        }
        let ticket = Ticket(inner.next);
        inner.next += 1;
        inner.order.insert(
            ticket,
            Watch {
                route: Arc::clone(route),
                filter: Arc::clone(filter),
                key: key.clone(),
                found_at: None,
                brought_in: false,
            },
        );
        inner.by_key.entry(key.clone()).or_default().push(ticket);
        self.waiting.store(inner.order.len(), Ordering::SeqCst);
        Some(ticket)
    }

    /// Marks the key as brought in by another admission.
    pub fn bring_in(&self, ticket: Ticket) {
        if let Some(w) = self.lock().order.get_mut(&ticket) {
            w.brought_in = true;
        }
    }

    /// The origin has the key, as of `at`: it waits for its decision from now on.
    pub fn found(&self, ticket: Ticket, at: Instant) {
        if let Some(w) = self.lock().order.get_mut(&ticket) {
            w.found_at = Some(at);
        }
    }

    /// Stops watching the key (the origin does not have it, or could not say).
    pub fn forget(&self, ticket: Ticket) {
        let mut inner = self.lock();
        inner.remove(ticket);
        self.waiting.store(inner.order.len(), Ordering::SeqCst);
    }

    /// Takes out every found key for which `ready` says the decision is due.
    pub fn take_ready(&self, ready: impl Fn(&Watch) -> bool) -> Vec<Watch> {
        if self.waiting.load(Ordering::SeqCst) == 0 {
            return Vec::new();
        }
        let mut inner = self.lock();
        let due: Vec<Ticket> = inner
            .order
            .iter()
            .filter(|(_, w)| w.found_at.is_some() && ready(w))
            .map(|(t, _)| *t)
            .collect();
        let taken = due.into_iter().filter_map(|t| inner.remove(t)).collect();
        self.waiting.store(inner.order.len(), Ordering::SeqCst);
        taken
    }

    /// How many keys wait.
    pub fn len(&self) -> usize {
        self.waiting.load(Ordering::SeqCst)
    }

    /// Whether no key waits.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl AdmissionWatcher for Ledger {
    fn admitted(&self, filter: &str, keys: &[OwnedKey]) {
        // The common case: nothing waits, and the admission (a sync poll of thousands of
        // rows, say) goes on at once.
        if self.waiting.load(Ordering::SeqCst) == 0 {
            return;
        }
        let mut inner = self.lock();
        let Inner { order, by_key, .. } = &mut *inner;
        for key in keys {
            for ticket in by_key.get(key).into_iter().flatten() {
                if let Some(w) = order.get_mut(ticket)
                    && w.filter.name() == filter
                {
                    w.brought_in = true;
                }
            }
        }
    }
}
