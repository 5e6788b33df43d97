//! The settings a reload cannot apply: what the listeners, the database pool, the cache's
//! bounds, logging and fleet mode were started with. A reload that changes one of them is
//! refused whole, naming each, so that the file on disk never says something the process
//! does not do.

use serde_json::Value;

use bloomgate_core::config::Config;

/// Every setting a reload cannot apply, as a dotted path in the configuration file. An
/// entry names its key and everything under it; `<name>` stands for any filter's name.
/// `server.tls` and `database` are judged by presence alone: turning TLS or the database
/// on or off needs a restart, while new certificate files are read again on reload and
/// the database's limits and breaker change in place.
pub const RESTART_ONLY: &[&str] = &[
    "server.listen",
    "server.header_read_timeout",
    "server.shutdown_grace",
    "server.max_header_bytes",
    "server.max_uri_bytes",
    "server.max_connections",
    "server.http2",
    "server.http2_max_concurrent_streams",
    "server.threading",
    "server.workers",
    "server.tls",
    "admin.listen",
    "database",
    "database.url",
    "database.max_connections",
    "database.min_connections",
    "database.acquire_timeout",
    "cache.max_entries",
    "cache.negative_max_entries",
    "cache.max_bytes",
    "cache.negative_max_bytes",
    "log",
    "false_positive_budget",
    "audit",
    "fleet",
    "filters.<name>.backend",
    "filters.<name>.redis",
    "filters.<name>.sync.binlog.url",
];

/// The entries of [`RESTART_ONLY`] compared by presence only.
const PRESENCE_ONLY: &[&str] = &["server.tls", "database"];

/// Whether the setting at `key` (a dotted path, `<name>` for a filter's name) changes
/// only with a restart.
pub fn is_restart_only(key: &str) -> bool {
    RESTART_ONLY.iter().any(|entry| {
        key == *entry
            || (!PRESENCE_ONLY.contains(entry)
                && key
                    .strip_prefix(entry)
                    .is_some_and(|rest| rest.starts_with('.')))
    })
}

/// The restart-only settings that differ between `old` and `new`, as field paths.
pub fn changed(old: &Config, new: &Config) -> Vec<String> {
    let (old_json, new_json) = (value(old), value(new));
    let mut fields = Vec::new();
    for entry in RESTART_ONLY {
        // A filter's settings are compared for the filters both files name; adding or
        // removing a filter is a reload's own business.
        let paths: Vec<String> = match entry.strip_prefix("filters.<name>.") {
            Some(rest) => new
                .filters
                .keys()
                .filter(|name| old.filters.contains_key(*name))
                .map(|name| format!("filters.{name}.{rest}"))
                .collect(),
            None => vec![(*entry).to_owned()],
        };
        for path in paths {
            // A section switched on or off is named once, not with each of its keys.
            let under_reported = fields.iter().any(|f: &String| {
                path.strip_prefix(f.as_str())
                    .is_some_and(|r| r.starts_with('.'))
            });
            if under_reported {
                continue;
            }
            let (a, b) = (at(&old_json, &path), at(&new_json, &path));
            let differs = if PRESENCE_ONLY.contains(entry) {
                a.is_null() != b.is_null()
            } else {
                a != b
            };
            if differs {
                fields.push(path);
            }
        }
    }
    fields
}

/// The value at a dotted path (filter names may hold dots only as the middle part of
/// `filters.NAME.key`), or null where there is none.
fn at<'a>(root: &'a Value, path: &str) -> &'a Value {
    const NULL: &Value = &Value::Null;
    let parts: Vec<&str> = match path.strip_prefix("filters.") {
        Some(rest) => match rest.rsplit_once('.') {
            Some((name, key)) => vec!["filters", name, key],
            None => vec!["filters", rest],
        },
        None => path.split('.').collect(),
    };
    parts
        .iter()
        .try_fold(root, |v, part| v.get(part))
        .unwrap_or(NULL)
}

fn value(config: &Config) -> Value {
    serde_json::to_value(config).unwrap_or(Value::Null)
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
                "database.max_connections",
                "cache.max_entries"
            ]
        );
    }

    #[test]
    fn a_filter_held_in_redis_changes_only_with_a_restart() {
        let base = Config::from_toml_str(BASE).expect("valid");
        let mut held = base.clone();
        if let Some(f) = held.filters.get_mut("products") {
            f.backend = bloomgate_core::config::Backend::Redis;
        }
        assert_eq!(changed(&base, &held), ["filters.products.backend"]);
        let mut slower = held.clone();
        if let Some(f) = slower.filters.get_mut("products") {
            f.redis.check_timeout = std::time::Duration::from_millis(50);
        }
        assert_eq!(changed(&held, &slower), ["filters.products.redis"]);
    }

    #[test]
    fn an_entry_covers_its_keys_but_tls_only_its_presence() {
        assert!(is_restart_only("fleet.lease_ttl"));
        assert!(is_restart_only("filters.<name>.redis.check_timeout"));
        assert!(is_restart_only("server.tls"));
        assert!(!is_restart_only("server.tls.cert_file"));
        assert!(!is_restart_only("server.listen_backlog"));
        assert!(!is_restart_only("cache.ttl"));
        assert!(is_restart_only("database"));
        assert!(!is_restart_only("database.breaker.enabled"));

        let base = Config::from_toml_str(BASE).expect("valid");
        let mut moved = base.clone();
        if let Some(d) = &mut moved.database {
            d.url = "mysql://u:p@127.0.0.2/db".into();
        }
        moved.server.tls = Some(bloomgate_core::config::TlsConfig {
            cert_file: "cert.pem".into(),
            key_file: "key.pem".into(),
        });
        assert_eq!(changed(&base, &moved), ["server.tls", "database.url"]);
        let mut without = base.clone();
        without.database = None;
        assert_eq!(changed(&base, &without), ["database"]);
    }
}
