use std::net::IpAddr;
use std::time::Duration;

use http::{HeaderName, Method, StatusCode};

use super::super::*;
use crate::filter::BloomParams;

/// The example config shipped at the repository root.
const EXAMPLE: &str = include_str!("../../../../../config.toml");

fn ip(s: &str) -> IpAddr {
    s.parse().expect("an address")
}

#[test]
fn the_example_config_compiles_to_what_it_says() {
    let config = Config::from_toml_str(EXAMPLE).expect("the example config is valid");
    let c = config.compile().expect("compiles");

    assert_eq!(c.filters().len(), 1);
    let products = &c.filters()[0];
    assert_eq!(products.name, "products");
    assert_eq!(
        products.params,
        BloomParams::optimal(1_000_000, 0.01).expect("valid parameters")
    );

    assert!(c.trusted_proxies().is_empty());
    assert!(c.outcome_header_clients().contains(ip("127.0.0.1")));
    assert!(c.outcome_header_clients().contains(ip("10.1.2.3")));
    assert!(!c.outcome_header_clients().contains(ip("192.168.0.1")));
    let upstream = c.upstream().expect("[upstream]");
    assert_eq!(upstream.authority.as_str(), "127.0.0.1:3000");

    assert_eq!(c.routes().len(), 2);
    let by_path = &c.routes()[0];
    assert_eq!((by_path.id, &*by_path.label), (0, "product_by_path"));
    assert_eq!(by_path.pattern.matches("/api/products/42"), Some("42"));
    assert_eq!(by_path.filter, 0);
    assert_eq!(by_path.normalize, Normalize::Integer);
    assert_eq!(by_path.ttl, Duration::from_secs(600));
    assert_eq!(by_path.negative_ttl, Duration::from_secs(30));
    assert_eq!(by_path.query.key, None);
    assert!(!by_path.has_variants());
    let CompiledOrigin::Sql { query, timeout } = &by_path.origin else {
        panic!("sql origin: {:?}", by_path.origin);
    };
    assert!(query.ends_with("WHERE sku_id = ?"), "{query}");
    assert_eq!(*timeout, Duration::from_secs(2));

    let info = &c.routes()[1];
    assert_eq!((info.id, &*info.label), (1, "product_info"));
    assert_eq!(info.pattern.matches("/api/product/info"), Some(""));
    assert_eq!(info.query.key.as_deref(), Some("sku_id"));
    assert_eq!(info.query.forward, ["lang"]);
    assert!(!info.query.reject_undeclared);
    // The route sets no TTLs: the cache's apply.
    assert_eq!(info.ttl, Duration::from_secs(300));
    assert_eq!(info.negative_ttl, Duration::from_secs(300));
    assert!(info.has_variants());
    let CompiledOrigin::Upstream {
        not_found,
        forward_headers,
        headers,
    } = &info.origin
    else {
        panic!("upstream origin: {:?}", info.origin);
    };
    assert_eq!(not_found, &[StatusCode::NOT_FOUND, StatusCode::GONE]);
    assert_eq!(
        forward_headers,
        &[HeaderName::from_static("accept-language")]
    );
    assert_eq!(headers.len(), 1);
    assert_eq!(headers[0].0, "x-api-key");
    assert_eq!(headers[0].1, "change-me-upstream-key");

    assert_eq!(c.write_through().len(), 1);
    let w = &c.write_through()[0];
    assert_eq!(w.methods, [Method::POST, Method::PUT]);
    assert_eq!(w.statuses, [StatusCode::OK, StatusCode::CREATED]);
    assert_eq!(w.filter, 0);
    assert!(w.pattern.matches("/api/products").is_some());
}

#[test]
fn every_filter_is_sized_by_its_own_settings_and_found_by_position() {
    let mut config = Config::from_toml_str(EXAMPLE).expect("valid");
    let mut skus = config.filters["products"].clone();
    skus.expected_items = 12_345;
    skus.false_positive_rate = 0.001;
    config.filters.insert("a-skus".into(), skus);
    config.routes[1].filter = "a-skus".into();
    let c = config.compile().expect("compiles");
    let names: Vec<&str> = c.filters().iter().map(|f| f.name.as_str()).collect();
    assert_eq!(names, ["a-skus", "products"]);
    for f in c.filters() {
        let want = BloomParams::optimal(f.settings.expected_items, f.settings.false_positive_rate)
            .expect("valid parameters");
        assert_eq!(f.params, want, "{}", f.name);
    }
    assert_eq!(c.filters()[c.routes()[0].filter].name, "products");
    assert_eq!(c.filters()[c.routes()[1].filter].name, "a-skus");
    assert_eq!(c.filters()[c.write_through()[0].filter].name, "products");
}

#[test]
fn write_methods_are_compiled_in_upper_case() {
    let mut config = Config::from_toml_str(EXAMPLE).expect("valid");
    config.write_through[0].methods = vec!["post".into(), "Patch".into()];
    let c = config.compile().expect("compiles");
    assert_eq!(c.write_through()[0].methods, [Method::POST, Method::PATCH]);
}

#[test]
fn more_routes_than_ids_are_refused_once() {
    let mut config = Config::from_toml_str(EXAMPLE).expect("valid");
    let route = config.routes[0].clone();
    config.routes = (0..=usize::from(u16::MAX))
        .map(|i| RouteConfig {
            name: Some(format!("r{i}")),
            ..route.clone()
        })
        .collect();
    assert!(config.compile().is_ok(), "65536 routes fit the ids");
    config.routes.push(RouteConfig {
        name: Some("one-more".into()),
        ..route
    });
    let Err(ConfigError::Invalid(problems)) = config.compile() else {
        panic!("65537 routes accepted");
    };
    assert_eq!(problems.len(), 1, "{problems:?}");
    assert_eq!(problems[0].field, "routes");
}
