//! Admission: the one path by which a key becomes present between builds. Sync,
//! write-through and the admin API all call [`Admit::admit`]; nothing else adds keys to a
//! live filter or drops a key's cache entries because it now exists. An admission sent
//! across a fleet of instances belongs here too.

use std::sync::Arc;

use super::Filter;
use crate::cache::ResponseCache;
use crate::key::OwnedKey;

/// What an admission drops from the response cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Forget {
    /// The key's negative entries: it exists now (sync, write-through).
    Absence,
    /// Every entry of the key, positive ones too (the admin API: the operator says the
    /// key's data is new).
    Everything,
}

/// Admits keys into filters and keeps the response cache consistent with them.
pub struct Admit {
    cache: Arc<ResponseCache>,
    /// `(filter name, route id)` for every guarded route.
    routes: Vec<(Arc<str>, u16)>,
}

impl Admit {
    /// `routes` names the filter of each guarded route, by route id.
    pub fn new(cache: Arc<ResponseCache>, routes: Vec<(Arc<str>, u16)>) -> Admit {
        Admit { cache, routes }
    }

    /// The route ids guarded by the filter `name` (every route when `None`).
    fn routes_of<'a>(&'a self, name: Option<&'a str>) -> impl Iterator<Item = u16> + 'a {
        self.routes
            .iter()
            .filter(move |(route_filter, _)| name.is_none_or(|n| &**route_filter == n))
            .map(|(_, id)| *id)
    }

    /// Admits `keys` into `filter`. For each key, in this order: the filter (the live one,
    /// and the next one at its swap, see [`Filter::add_key`]), the key's fence stripe, then
    /// its cache entries on every route the filter guards, so that no negative entry
    /// outlives the admission (see [`Filter::fence`]). Returns how many keys went into a
    /// loaded filter; the others are added when the first load is.
    pub async fn admit(&self, filter: &Filter, keys: &[OwnedKey], forget: Forget) -> usize {
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
    pub async fn invalidate(&self, name: Option<&str>, key: &OwnedKey) {
        for route in self.routes_of(name) {
            self.cache.invalidate(route, key).await;
        }
    }
}
