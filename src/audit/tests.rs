use std::sync::Arc;
use std::time::{Duration, Instant};

use prometheus::{IntCounter, Registry};

use super::check::{FLEET_GRACE, due};
use super::ledger::{Ledger, Watch};
use crate::gate::Filter;
use crate::gate::admit::AdmissionWatcher;
use crate::gate::metrics::FilterFamilies;
use bloomgate_core::config::Config;
use bloomgate_core::key::OwnedKey;

const OVERLAP: Duration = Duration::from_secs(2);
const INTERVAL: Duration = Duration::from_secs(1);

/// A filter named `name` with sync every second, reaching two seconds back.
fn filter(name: &str) -> Arc<Filter> {
    let config = Config::from_toml_str(&format!(
        r#"
        [database]
        url = "sqlite://never-opened.db"
        [filters.{name}]
        source_query = "SELECT sku_id FROM products"
        expected_items = 100
        sync = {{ query = "SELECT sku_id, updated_at FROM products WHERE updated_at >= ?", interval = "1s", overlap = "2s" }}
        "#
    ))
    .expect("a valid config");
    let settings = config.filters[name].clone();
    let families = FilterFamilies::register(&Registry::new()).expect("metrics");
    let metrics = families.handles(name, 0.01, Some(INTERVAL));
    Arc::new(Filter::new(name, settings, None, metrics))
}

fn found(filter: &Arc<Filter>, key: u64, at: Instant) -> Watch {
    Watch {
        route: Arc::from("r"),
        filter: Arc::clone(filter),
        key: OwnedKey::Int(key),
        found_at: Some(at),
        brought_in: false,
    }
}

fn counter() -> IntCounter {
    IntCounter::new("dropped", "for the test").expect("a counter")
}

#[test]
fn a_found_key_is_judged_once_a_poll_started_after_it_plus_the_overlap_succeeded() {
    let products = filter("products");
    let t0 = Instant::now();
    let w = found(&products, 7, t0);
    let much_later = t0 + Duration::from_secs(3600);
    assert!(
        !due(&w, much_later, false),
        "no poll yet: it waits, however long"
    );
    products.record_sync_poll(t0 + OVERLAP - Duration::from_millis(1));
    assert!(
        !due(&w, much_later, false),
        "a poll that started within the overlap may have missed a row committed late"
    );
    products.record_sync_poll(t0 + OVERLAP);
    assert!(due(&w, t0, false));
    // An older poll recorded late does not move it back.
    products.record_sync_poll(t0);
    assert!(products.synced_since(t0 + OVERLAP));
}

#[test]
fn a_fleet_member_that_does_not_sync_judges_after_two_intervals_and_the_grace() {
    let products = filter("products");
    let t0 = Instant::now();
    let w = found(&products, 7, t0);
    let wait = OVERLAP + INTERVAL * 2 + FLEET_GRACE;
    assert!(!due(&w, t0 + wait - Duration::from_millis(1), true));
    assert!(due(&w, t0 + wait, true));
    assert!(
        !due(&w, t0 + wait, false),
        "alone, only its own sync decides"
    );
}

#[test]
fn the_ledger_marks_keys_that_another_admission_of_their_filter_brings_in() {
    let (products, skus) = (filter("products"), filter("skus"));
    let ledger = Ledger::new(100, counter());
    let route: Arc<str> = Arc::from("r");
    // Nothing waits: an admission returns at once.
    ledger.admitted("products", &[OwnedKey::Int(1)]);
    assert!(ledger.is_empty());

    let one = ledger
        .watch(&route, &products, &OwnedKey::Int(1))
        .expect("new");
    let two = ledger
        .watch(&route, &products, &OwnedKey::Int(2))
        .expect("new");
    assert!(
        ledger.watch(&route, &products, &OwnedKey::Int(1)).is_none(),
        "a key already watched is not watched twice"
    );
    let other = ledger
        .watch(&route, &skus, &OwnedKey::Int(1))
        .expect("another filter");
    assert_eq!(ledger.len(), 3);

    // Key 1 of `products` is admitted; key 1 of `skus` is not.
    ledger.admitted("products", &[OwnedKey::Int(1), OwnedKey::Int(99)]);
    let now = Instant::now();
    for t in [one, two, other] {
        ledger.found(t, now);
    }
    let taken = ledger.take_ready(|_| true);
    let mut judged: Vec<(String, u64, bool)> = taken
        .iter()
        .map(|w| {
            let OwnedKey::Int(k) = w.key else {
                panic!("integer keys")
            };
            (w.filter.name().to_owned(), k, w.brought_in)
        })
        .collect();
    judged.sort();
    assert_eq!(
        judged,
        [
            ("products".to_owned(), 1, true),
            ("products".to_owned(), 2, false),
            ("skus".to_owned(), 1, false)
        ]
    );
    assert!(ledger.is_empty());
}

#[test]
fn only_found_keys_are_taken_and_a_full_ledger_lets_the_oldest_go() {
    let products = filter("products");
    let dropped = counter();
    let ledger = Ledger::new(2, dropped.clone());
    let route: Arc<str> = Arc::from("r");
    let asking = ledger
        .watch(&route, &products, &OwnedKey::Int(1))
        .expect("new");
    assert!(ledger.take_ready(|_| true).is_empty(), "still being asked");
    ledger.forget(asking);
    assert!(ledger.is_empty());

    let tickets: Vec<_> = (10..13)
        .map(|k| {
            ledger
                .watch(&route, &products, &OwnedKey::Int(k))
                .expect("new")
        })
        .collect();
    assert_eq!((ledger.len(), dropped.get()), (2, 1));
    for t in &tickets {
        ledger.found(*t, Instant::now());
    }
    let mut left: Vec<OwnedKey> = ledger
        .take_ready(|_| true)
        .into_iter()
        .map(|w| w.key)
        .collect();
    left.sort_by_key(|k| k.to_string());
    assert_eq!(left, [OwnedKey::Int(11), OwnedKey::Int(12)]);
    // The key let go can be watched again.
    assert!(
        ledger
            .watch(&route, &products, &OwnedKey::Int(10))
            .is_some()
    );
}
