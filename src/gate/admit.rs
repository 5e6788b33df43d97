//! Admission: the one path by which a key becomes present between builds. Sync,
//! write-through and the admin API all call [`Admit::admit`]; nothing else adds keys to a
//! live filter or drops a key's cache entries because it now exists. In fleet mode each
//! local admission and invalidation is also handed to the fleet's outbox, which appends
//! it to the change stream; what other instances appended comes back through
//! [`Admit::apply`], which applies it here and sends nothing on. An
//! [`AdmissionWatcher`] (the audit's ledger) is told of every admission but its own.

use std::sync::Arc;

use arc_swap::ArcSwap;
use tokio::sync::mpsc;

use super::Filter;
use crate::cache::ResponseCache;
use bloomgate_core::key::OwnedKey;

/// What an admission drops from the response cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Forget {
    /// The key's negative entries: it exists now (sync, write-through).
    Absence,
    /// Every entry of the key, positive ones too (the admin API: the operator says the
    /// key's data is new).
    Everything,
}

/// Most keys one entry carries; an admission of more is split.
pub const MAX_KEYS_PER_ENTRY: usize = 1000;

/// A change, as written to the stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Change {
    /// Keys became present in `filter`; drop their cache entries as `forget` says.
    Admit {
        /// The filter's name.
        filter: Arc<str>,
        /// The keys, canonical.
        keys: Vec<OwnedKey>,
        /// Which cache entries to drop.
        forget: Forget,
    },
    /// Drop every cache entry of these keys on the routes `filter` guards.
    Invalidate {
        /// The filter's name.
        filter: Arc<str>,
        /// The keys, canonical.
        keys: Vec<OwnedKey>,
    },
}

/// Told of the keys each admission brings in, local or from the fleet's stream, except
/// the ones it made itself through [`Admit::admit_unwatched`]. Called on every
/// admission: an implementation that watches nothing must return at once.
pub trait AdmissionWatcher: Send + Sync {
    /// `keys` are present in the filter `filter` now.
    fn admitted(&self, filter: &str, keys: &[OwnedKey]);
}

/// Admits keys into filters and keeps the response cache consistent with them.
pub struct Admit {
    cache: Arc<ResponseCache>,
    /// `(filter name, route id)` for every guarded route of the configuration in force.
    routes: ArcSwap<Vec<(Arc<str>, u32)>>,
    /// In fleet mode, where local changes go to be appended to the change stream.
    outbox: Option<mpsc::Sender<Change>>,
    /// Called with the number of changes the outbox had no room for.
    on_dropped: Option<Box<dyn Fn(u64) + Send + Sync>>,
    /// Told of every admission but its own.
    watcher: Option<Arc<dyn AdmissionWatcher>>,
}

impl Admit {
    /// `routes` names the filter of each guarded route, by route id.
    pub fn new(cache: Arc<ResponseCache>, routes: Vec<(Arc<str>, u32)>) -> Admit {
        Admit {
            cache,
            routes: ArcSwap::from_pointee(routes),
            outbox: None,
            on_dropped: None,
            watcher: None,
        }
    }

    /// Tells `watcher` of every admission from now on, but those it makes itself.
    pub fn with_watcher(mut self, watcher: Arc<dyn AdmissionWatcher>) -> Admit {
        self.watcher = Some(watcher);
        self
    }

    /// Hands every local change to `outbox` from now on (fleet mode); `on_dropped` is
    /// told how many changes found it full.
    pub fn with_outbox(
        mut self,
        outbox: mpsc::Sender<Change>,
        on_dropped: impl Fn(u64) + Send + Sync + 'static,
    ) -> Admit {
        self.outbox = Some(outbox);
        self.on_dropped = Some(Box::new(on_dropped));
        self
    }

    /// Sends a local change on to the fleet, in entries of bounded size. Never waits:
    /// a full outbox drops the change, counted (the other instances then learn of the
    /// key from the builder's sync, or not until their next generation).
    fn send(&self, change: impl Fn(Vec<OwnedKey>) -> Change, keys: &[OwnedKey]) {
        let Some(outbox) = &self.outbox else { return };
        for part in keys.chunks(MAX_KEYS_PER_ENTRY) {
            if outbox.try_send(change(part.to_vec())).is_err() {
                tracing::warn!(
                    keys = part.len(),
                    "fleet outbox is full; a change was not sent to the other instances"
                );
                if let Some(dropped) = &self.on_dropped {
                    dropped(1);
                }
            }
        }
    }

    /// Replaces the routes, after a reload.
    pub fn set_routes(&self, routes: Vec<(Arc<str>, u32)>) {
        self.routes.store(Arc::new(routes));
    }

    /// The route ids guarded by the filter `name` (every route when `None`).
    fn routes_of(&self, name: Option<&str>) -> Vec<u32> {
        self.routes
            .load()
            .iter()
            .filter(|(route_filter, _)| name.is_none_or(|n| &**route_filter == n))
            .map(|(_, id)| *id)
            .collect()
    }

    /// Admits `keys` into `filter`. For each key, in this order: the filter (the live one,
    /// and the next one at its swap, see [`Filter::add_key`]), the key's fence stripe, then
    /// its cache entries on every route the filter guards, so that no negative entry
    /// outlives the admission (see [`Filter::fence`]). Returns how many keys went into a
    /// loaded filter; the others are added when the first load is.
    pub async fn admit(&self, filter: &Filter, keys: &[OwnedKey], forget: Forget) -> usize {
        let loaded = self.admit_unwatched(filter, keys, forget).await;
        self.tell_watcher(filter, keys);
        loaded
    }

    /// As [`Admit::admit`] (the fleet hears of it too), without telling the watcher: for
    /// the watcher's own admissions, which are no news to it.
    pub async fn admit_unwatched(
        &self,
        filter: &Filter,
        keys: &[OwnedKey],
        forget: Forget,
    ) -> usize {
        let loaded = self.admit_here(filter, keys, forget).await;
        if !keys.is_empty() {
            let name: Arc<str> = Arc::from(filter.name());
            self.send(
                |keys| Change::Admit {
                    filter: Arc::clone(&name),
                    keys,
                    forget,
                },
                keys,
            );
        }
        loaded
    }

    /// Applies a change read from the change stream to `filter`, sending nothing on.
    /// `ours`: this instance wrote it, applied it already and told the watcher then
    /// (or made it unwatched), so the watcher is not told again.
    pub async fn apply(&self, filter: &Filter, change: &Change, ours: bool) {
        match change {
            Change::Admit { keys, forget, .. } => {
                self.admit_here(filter, keys, *forget).await;
                if !ours {
                    self.tell_watcher(filter, keys);
                }
            }
            Change::Invalidate { keys, .. } => {
                for key in keys {
                    self.invalidate_here(Some(filter.name()), key).await;
                }
            }
        }
    }

    fn tell_watcher(&self, filter: &Filter, keys: &[OwnedKey]) {
        if let Some(watcher) = &self.watcher
            && !keys.is_empty()
        {
            watcher.admitted(filter.name(), keys);
        }
    }

    async fn admit_here(&self, filter: &Filter, keys: &[OwnedKey], forget: Forget) -> usize {
        let mut loaded = 0;
        for key in keys {
            loaded += usize::from(filter.add_key(&key.as_norm()));
        }
        for route in self.routes_of(Some(filter.name())) {
            for key in keys {
                match forget {
                    Forget::Absence => self.cache.invalidate_negative(route, key).await,
                    Forget::Everything => self.cache.invalidate(route, key).await,
                }
            }
        }
        loaded
    }

    /// Drops cached entries (positive and negative) for a key on every route guarded by
    /// the filter `name` (or on every route when `name` is `None`), leaving the filter as it is.
    /// In fleet mode, every instance does the same (when `name` is given).
    pub async fn invalidate(&self, name: Option<&str>, key: &OwnedKey) {
        self.invalidate_here(name, key).await;
        if let Some(name) = name {
            let name: Arc<str> = Arc::from(name);
            self.send(
                |keys| Change::Invalidate {
                    filter: Arc::clone(&name),
                    keys,
                },
                std::slice::from_ref(key),
            );
        }
    }

    /// As [`Admit::invalidate`], for several keys of the filter `name` at once (one
    /// change stream entry per [`MAX_KEYS_PER_ENTRY`] keys).
    pub async fn invalidate_keys(&self, name: &str, keys: &[OwnedKey]) {
        if keys.is_empty() {
            return;
        }
        for key in keys {
            self.invalidate_here(Some(name), key).await;
        }
        let filter: Arc<str> = Arc::from(name);
        self.send(
            |keys| Change::Invalidate {
                filter: Arc::clone(&filter),
                keys,
            },
            keys,
        );
    }

    async fn invalidate_here(&self, name: Option<&str>, key: &OwnedKey) {
        for route in self.routes_of(name) {
            self.cache.invalidate(route, key).await;
        }
    }
}
