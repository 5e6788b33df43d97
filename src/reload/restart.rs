//! The settings a reload cannot apply: what the listeners, the database pool, the cache's
//! bounds, logging and fleet mode were started with. A reload that changes one of them is
//! refused whole, naming each, so that the file on disk never says something the process
//! does not do.

use serde::Serialize;

use crate::config::Config;

/// The restart-only settings that differ between `old` and `new`, as field paths.
pub fn changed(old: &Config, new: &Config) -> Vec<String> {
    let mut fields = Vec::new();
    let mut check = |field: &str, a: serde_json::Value, b: serde_json::Value| {
        if a != b {
            fields.push(field.to_owned());
        }
    };
    macro_rules! same {
        ($($path:ident).+) => {
            check(stringify!($($path).+), value(&old.$($path).+), value(&new.$($path).+))
        };
    }
    same!(server.listen);
    same!(server.header_read_timeout);
    same!(server.shutdown_grace);
    same!(server.max_header_bytes);
    same!(server.max_uri_bytes);
    same!(server.max_connections);
    same!(server.http2);
    same!(server.http2_max_concurrent_streams);
    same!(server.threading);
    same!(server.workers);
    check(
        "server.tls",
        value(&old.server.tls.is_some()),
        value(&new.server.tls.is_some()),
    );
    same!(admin.listen);
    let pool = |c: &Config| {
        c.database.as_ref().map(|d| {
            value(&(
                &d.url,
                d.max_connections,
                d.min_connections,
                d.acquire_timeout,
            ))
        })
    };
    check(
        "database (url and pool)",
        value(&pool(old)),
        value(&pool(new)),
    );
    same!(cache.max_entries);
    same!(cache.negative_max_entries);
    same!(cache.max_bytes);
    same!(cache.negative_max_bytes);
    same!(log);
    same!(fleet);
    same!(false_positive_budget);
    same!(audit);
    // A filter held in Redis is attached to its filter when fleet mode starts.
    for (name, f) in &new.filters {
        if let Some(o) = old.filters.get(name) {
            check(
                &format!("filters.{name}.backend"),
                value(&o.backend),
                value(&f.backend),
            );
            check(
                &format!("filters.{name}.redis"),
                value(&o.redis),
                value(&f.redis),
            );
        }
    }
    fields
}

fn value(v: &impl Serialize) -> serde_json::Value {
    serde_json::to_value(v).unwrap_or(serde_json::Value::Null)
}

#[cfg(test)]
mod tests {
    use super::*;

    const BASE: &str = r#"
        [server]
        listen = "127.0.0.1:8080"
        [admin]
        listen = "127.0.0.1:9090"
        [database]
        url = "mysql://u:p@127.0.0.1/db"
        [filters.products]
        source_query = "SELECT sku FROM products"
        expected_items = 1000
        [[routes]]
        path = "/p/{id}"
        key = { segment = "id" }
        filter = "products"
        origin = { kind = "sql", query = "SELECT * FROM products WHERE sku = ?" }
    "#;

    fn with(edit: &str) -> Config {
        let toml = BASE.replace("[admin]", &format!("{edit}\n[admin]"));
        Config::from_toml_str(&toml).expect("valid")
    }

    #[test]
    fn routes_limits_and_ttls_reload_but_listeners_and_pools_do_not() {
        let base = Config::from_toml_str(BASE).expect("valid");
        let mut reloadable = base.clone();
        reloadable.routes[0].ttl = Some(std::time::Duration::from_secs(5));
        reloadable.server.max_body_bytes = 1;
        reloadable.cache.ttl = std::time::Duration::from_secs(1);
        if let Some(d) = &mut reloadable.database {
            d.max_in_flight = Some(3);
            d.breaker.consecutive_failures = 2;
        }
        reloadable.admin.token = Some("new".into());
        assert!(changed(&base, &reloadable).is_empty());

        let mut moved = with("max_connections = 7");
        moved.admin.listen = "127.0.0.1:9191".parse().expect("addr");
        if let Some(d) = &mut moved.database {
            d.max_connections = 99;
        }
        moved.cache.max_entries = Some(5);
        assert_eq!(
            changed(&base, &moved),
            [
                "server.max_connections",
                "admin.listen",
                "database (url and pool)",
                "cache.max_entries"
            ]
        );
    }

    #[test]
    fn a_filter_held_in_redis_changes_only_with_a_restart() {
        let base = Config::from_toml_str(BASE).expect("valid");
        let mut held = base.clone();
        if let Some(f) = held.filters.get_mut("products") {
            f.backend = crate::config::Backend::Redis;
        }
        assert_eq!(changed(&base, &held), ["filters.products.backend"]);
        let mut slower = held.clone();
        if let Some(f) = slower.filters.get_mut("products") {
            f.redis.check_timeout = std::time::Duration::from_millis(50);
        }
        assert_eq!(changed(&held, &slower), ["filters.products.redis"]);
    }
}
