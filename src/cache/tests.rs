//! The cache's loading rules: one origin call per absent key, whatever the timing of the
//! requests; negative entries fenced off by an admission; errors not cached; one
//! background refresh per key.

use std::sync::atomic::{AtomicU64, Ordering};

use super::*;
use crate::origin::{Fetched, OriginError};

fn cache() -> ResponseCache {
    ResponseCache::new(&CacheConfig::default(), false)
}

fn key(n: u64) -> CacheKey {
    CacheKey {
        route: 0,
        key: OwnedKey::Int(n),
        variant: None,
    }
}

/// Negative entries that nothing fences.
fn kept(ttl: Duration) -> Negative<'static> {
    Negative {
        ttl,
        still_absent: &|| true,
    }
}

/// An origin that knows no key, counting its calls; each call takes `delay`.
async fn absent(calls: &AtomicU64, delay: Duration) -> Result<Fetched, OriginError> {
    calls.fetch_add(1, Ordering::SeqCst);
    tokio::time::sleep(delay).await;
    Ok(Fetched::NotFound)
}

#[tokio::test]
async fn a_load_after_a_finished_not_found_does_not_call_the_origin() {
    // The caller's own lookup missed, but by the time it loads, another load has
    // stored the negative entry: no second origin call.
    let cache = cache();
    let calls = AtomicU64::new(0);
    let ttl = Duration::from_secs(30);
    let first = cache
        .load(key(7), kept(ttl), absent(&calls, Duration::ZERO))
        .await;
    assert!(matches!(first, Loaded::NotFound { leader: true }));
    let second = cache
        .load(key(7), kept(ttl), absent(&calls, Duration::ZERO))
        .await;
    assert!(matches!(second, Loaded::NotFound { leader: false }));
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    assert!(matches!(cache.lookup(&key(7)).await, Lookup::NegativeHit));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn waves_of_requests_for_one_absent_key_make_one_origin_call() {
    // Requests keep arriving while the first load runs and right after it ends;
    // whatever their timing, the negative entry exists before any of them is
    // released, so every later request is a negative hit.
    let cache = cache();
    let calls = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for i in 0..200u64 {
        let (cache, calls) = (cache.clone(), Arc::clone(&calls));
        tasks.push(tokio::spawn(async move {
            tokio::time::sleep(Duration::from_micros(i * 50)).await;
            match cache.lookup(&key(9)).await {
                Lookup::NegativeHit => false,
                Lookup::Hit(_) | Lookup::Stale(_) => {
                    panic!("a positive entry for an absent key")
                }
                Lookup::Miss => {
                    let loaded = cache
                        .load(key(9), kept(Duration::from_secs(30)), async {
                            absent(&calls, Duration::from_millis(3)).await
                        })
                        .await;
                    matches!(loaded, Loaded::NotFound { leader: true })
                }
            }
        }));
    }
    let mut leaders = 0;
    for t in tasks {
        leaders += u64::from(t.await.expect("task"));
    }
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    assert_eq!(leaders, 1);
}

#[tokio::test]
async fn a_negative_entry_fenced_off_during_its_lookup_is_not_kept() {
    // The key is admitted while the origin is answering "not found": that answer may
    // predate the key's row, so neither load keeps it.
    let cache = cache();
    for private in [false, true] {
        let admitted = AtomicBool::new(false);
        let still_absent = || !admitted.load(Ordering::SeqCst);
        let negative = Negative {
            ttl: Duration::from_secs(30),
            still_absent: &still_absent,
        };
        let fetch = async {
            admitted.store(true, Ordering::SeqCst);
            Ok(Fetched::NotFound)
        };
        let loaded = if private {
            cache.load_private(key(5), negative, fetch).await
        } else {
            cache.load(key(5), negative, fetch).await
        };
        assert!(matches!(loaded, Loaded::NotFound { leader: true }));
        assert!(matches!(cache.lookup(&key(5)).await, Lookup::Miss));
    }
    // Unfenced, the same answer is kept.
    let loaded = cache
        .load(key(5), kept(Duration::from_secs(30)), async {
            Ok(Fetched::NotFound)
        })
        .await;
    assert!(matches!(loaded, Loaded::NotFound { leader: true }));
    assert!(matches!(cache.lookup(&key(5)).await, Lookup::NegativeHit));
}

#[tokio::test]
async fn errors_are_not_cached() {
    let cache = cache();
    let calls = AtomicU64::new(0);
    for _ in 0..2 {
        let loaded = cache
            .load(key(3), kept(Duration::from_secs(30)), async {
                calls.fetch_add(1, Ordering::SeqCst);
                Err(OriginError::Timeout(Duration::from_millis(1)))
            })
            .await;
        assert!(matches!(loaded, Loaded::Failed { leader: true, .. }));
    }
    assert_eq!(calls.load(Ordering::SeqCst), 2);
    assert!(matches!(cache.lookup(&key(3)).await, Lookup::Miss));
}

#[test]
fn a_key_has_one_background_refresh_at_a_time() {
    let cache = cache();
    let first = cache.claim_refresh(&key(4));
    assert!(first.is_some());
    assert!(cache.claim_refresh(&key(4)).is_none());
    assert!(cache.claim_refresh(&key(5)).is_some());
    drop(first);
    assert!(cache.claim_refresh(&key(4)).is_some());
}

/// A found answer that lives `ttl` and may be served stale for a minute past it.
fn found(ttl: Duration) -> Result<Fetched, OriginError> {
    let meta = crate::origin::ResponseMeta {
        ttl: Some(ttl),
        stale: bloomgate_core::config::StaleWindows {
            while_revalidate: Duration::from_secs(60),
            if_error: Duration::from_secs(60),
        },
        ..Default::default()
    };
    Ok(Fetched::Found(CachedResponse {
        body: bytes::Bytes::from_static(b"{}"),
        stored_at: crate::origin::Stamp::now(),
        meta: Arc::new(meta),
        status: http::StatusCode::OK,
        with_credentials: false,
    }))
}

/// What kind of answer a lookup is.
fn kind(found: &Lookup) -> &'static str {
    match found {
        Lookup::Hit(_) => "hit",
        Lookup::Stale(_) => "stale",
        Lookup::NegativeHit => "negative",
        Lookup::Miss => "miss",
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_lookup_made_at_once_answers_as_the_awaited_one_or_not_at_all() {
    // Keys 0..100 found (fresh), 100..200 found but past their TTL, 200..300 not found,
    // the rest never asked. Meanwhile other tasks load thousands of keys, so moka's
    // maintenance runs during the lookups: a lookup made at once may decline, but never
    // answers otherwise than the awaited lookup of the same key.
    let cache = cache();
    for n in 0..300u64 {
        let fetched = match n {
            0..100 => found(Duration::from_secs(600)),
            100..200 => found(Duration::ZERO),
            _ => Ok(Fetched::NotFound),
        };
        let loaded = cache
            .load(key(n), kept(Duration::from_secs(600)), async { fetched })
            .await;
        assert!(!matches!(loaded, Loaded::Failed { .. }), "{n}");
    }
    let expected = |n: u64| match n {
        0..100 => "hit",
        100..200 => "stale",
        200..300 => "negative",
        _ => "miss",
    };
    let churn: Vec<_> = (0..3u64)
        .map(|t| {
            let cache = cache.clone();
            tokio::spawn(async move {
                for n in 0..3_000u64 {
                    let k = key(1_000_000 + t * 10_000 + n);
                    let _ = cache
                        .load(k, kept(Duration::from_secs(600)), async {
                            Ok(Fetched::NotFound)
                        })
                        .await;
                }
            })
        })
        .collect();
    let mut answered = 0;
    for round in 0..20u64 {
        for n in 0..400u64 {
            let k = key(n);
            if let Some(now) = cache.lookup_now(&k) {
                assert_eq!(kind(&now), expected(n), "key {n}, round {round}");
                answered += 1;
            }
            assert_eq!(kind(&cache.lookup(&k).await), expected(n), "key {n}");
        }
    }
    for t in churn {
        t.await.expect("churn task");
    }
    // Declining is the exception: most lookups are answered at once.
    assert!(answered > 4_000, "answered at once: {answered} of 8000");
}
