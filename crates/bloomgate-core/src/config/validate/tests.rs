use std::time::Duration;

use proptest::prelude::*;

use super::super::*;

/// A valid config that touches every section, with two filters and three routes so that
/// mistakes in different places do not meet.
const BASE: &str = r#"
[server]
listen = "127.0.0.1:0"
trusted_proxies = ["10.0.0.0/8"]
outcome_header = "trusted"
outcome_header_clients = ["127.0.0.0/8"]

[admin]
listen = "127.0.0.1:0"
token = "a-long-enough-token"

[upstream]
url = "http://127.0.0.1:3000"

[database]
url = "mysql://u:p@127.0.0.1:3306/shop"
max_connections = 8
min_connections = 2

[filters.products]
source_query = "SELECT sku_id FROM products"
expected_items = 1000
sync = { query = "SELECT sku_id, updated_at FROM products WHERE updated_at >= ?" }

[filters.skus]
source_query = "SELECT code FROM skus"
expected_items = 500
false_positive_rate = 0.001
normalize = { kind = "string", lowercase = true, max_len = 64 }

[[routes]]
name = "product"
path = "/api/products/{id}"
key = { segment = "id" }
filter = "products"
origin = { kind = "sql", query = "SELECT * FROM products WHERE sku_id = ?" }

[[routes]]
name = "sku"
path = "/api/sku"
key = { query = "code" }
filter = "skus"
origin = { kind = "upstream" }
forward_query = ["lang"]
forward_headers = ["accept-language"]
upstream_headers = { "x-api-key" = "secret" }

[[routes]]
name = "product-upstream"
path = "/v2/products/{id}"
key = { segment = "id" }
filter = "products"
origin = { kind = "upstream" }

[[write_through]]
path = "/api/products"
filter = "products"
key = { json = "data.sku_id" }

[false_positive_budget]
per_client = 10
"#;

fn base() -> Config {
    Config::from_toml_str(BASE).expect("the base config is valid")
}

/// The problems `validate` reports for `config`, empty when it is valid.
fn problems(config: &Config) -> Vec<Problem> {
    match config.validate() {
        Ok(()) => Vec::new(),
        Err(ConfigError::Invalid(p)) => p,
        Err(e) => panic!("not a validation error: {e}"),
    }
}

fn fields(problems: &[Problem]) -> Vec<&str> {
    problems.iter().map(|p| p.field.as_str()).collect()
}

type Mistake = (&'static str, fn(&mut Config));

/// One mistake each, in a field no other entry touches or reads, with the field it must
/// be reported at. Any subset of them can be made at once.
const MISTAKES: &[Mistake] = &[
    ("server.max_body_bytes", |c| c.server.max_body_bytes = 0),
    // Below hyper's floor, and now below max_uri_bytes too: still one problem.
    ("server.max_header_bytes", |c| {
        c.server.max_header_bytes = 4096
    }),
    ("server.trusted_proxies", |c| {
        c.server.trusted_proxies = vec!["10.0.0.0/33".into()]
    }),
    ("server.outcome_header_clients", |c| {
        c.server.outcome_header_clients.clear()
    }),
    ("server.header_read_timeout", |c| {
        c.server.header_read_timeout = Duration::ZERO
    }),
    ("admin.token", |c| c.admin.token = Some("short".into())),
    ("upstream.url", |c| {
        if let Some(u) = &mut c.upstream {
            u.url = "https://example.test".into();
        }
    }),
    ("upstream.timeout", |c| {
        if let Some(u) = &mut c.upstream {
            u.timeout = Duration::ZERO;
        }
    }),
    ("database.url", |c| {
        if let Some(d) = &mut c.database {
            d.url = "postgres://db".into();
        }
    }),
    // min_connections (2) now exceeds it, but that follows from this one mistake.
    ("database.max_connections", |c| {
        if let Some(d) = &mut c.database {
            d.max_connections = 0;
        }
    }),
    ("database.acquire_timeout", |c| {
        if let Some(d) = &mut c.database {
            d.acquire_timeout = Duration::ZERO;
        }
    }),
    ("database.max_in_flight", |c| {
        if let Some(d) = &mut c.database {
            d.max_in_flight = Some(0);
        }
    }),
    ("database.breaker.failure_ratio", |c| {
        if let Some(d) = &mut c.database {
            d.breaker.failure_ratio = 0.0;
        }
    }),
    ("database.breaker.open_for", |c| {
        if let Some(d) = &mut c.database {
            d.breaker.open_for = Duration::ZERO;
        }
    }),
    ("upstream.breaker.consecutive_failures", |c| {
        if let Some(u) = &mut c.upstream {
            u.breaker.consecutive_failures = 0;
        }
    }),
    ("upstream.breaker.window", |c| {
        if let Some(u) = &mut c.upstream {
            u.breaker.window = Duration::from_millis(1);
        }
    }),
    ("upstream.breaker.min_calls", |c| {
        if let Some(u) = &mut c.upstream {
            u.breaker.min_calls = 0;
        }
    }),
    ("upstream.max_in_flight", |c| {
        if let Some(u) = &mut c.upstream {
            u.max_in_flight = Some(0);
        }
    }),
    ("cache.max_entries", |c| c.cache.max_entries = Some(0)),
    ("cache.max_bytes", |c| c.cache.max_bytes = Some(1000)),
    ("cache.negative_max_bytes", |c| {
        c.cache.negative_max_bytes = Some(65_535)
    }),
    ("server.workers", |c| c.server.workers = 1025),
    ("cache.ttl", |c| c.cache.ttl = Duration::ZERO),
    ("cache.negative_ttl", |c| {
        c.cache.negative_ttl = Duration::ZERO
    }),
    ("filters.products.expected_items", |c| {
        filter(c, "products").expected_items = 0
    }),
    ("filters.skus.false_positive_rate", |c| {
        filter(c, "skus").false_positive_rate = 1.5
    }),
    ("filters.products.capacity_warn_ratio", |c| {
        filter(c, "products").capacity_warn_ratio = 0.0
    }),
    ("filters.skus.source_query", |c| {
        filter(c, "skus").source_query = " ".into()
    }),
    ("filters.products.sync.query", |c| {
        if let Some(s) = &mut filter(c, "products").sync {
            s.query = Some("SELECT sku_id, updated_at FROM products".into());
        }
    }),
    ("filters.products.load_retry_initial", |c| {
        filter(c, "products").load_retry_initial = Duration::ZERO
    }),
    ("filters.skus.backend", |c| {
        filter(c, "skus").backend = Backend::Redis
    }),
    ("routes[0].path", |c| {
        c.routes[0].path = "api/products/{id}".into()
    }),
    ("routes[0].origin.query", |c| {
        c.routes[0].origin = OriginConfig::Sql {
            query: "SELECT * FROM products WHERE sku_id = 1".into(),
            timeout: Duration::from_secs(2),
        }
    }),
    ("routes[0].ttl", |c| c.routes[0].ttl = Some(Duration::ZERO)),
    ("routes[1].filter", |c| c.routes[1].filter = "nope".into()),
    ("routes[1].forward_headers", |c| {
        c.routes[1].forward_headers = vec!["Host".into()]
    }),
    ("routes[1].forward_query", |c| {
        c.routes[1].forward_query = vec!["lang".into(), "LANG".into()]
    }),
    ("routes[2].name", |c| {
        c.routes[2].name = Some("product".into())
    }),
    ("routes[2].origin.not_found_statuses", |c| {
        c.routes[2].origin = OriginConfig::Upstream {
            not_found_statuses: vec![404, 999],
        }
    }),
    ("write_through[0].methods", |c| {
        c.write_through[0].methods = vec!["POST".into(), "NOT A METHOD".into()]
    }),
    ("write_through[0].statuses", |c| {
        c.write_through[0].statuses = vec![42]
    }),
    ("write_through[0].filter", |c| {
        c.write_through[0].filter = "nope".into()
    }),
    ("write_through[0].path", |c| {
        c.write_through[0].path = "api/products".into()
    }),
    ("false_positive_budget.slots", |c| {
        if let Some(b) = &mut c.false_positive_budget {
            b.slots = 1;
        }
    }),
    ("false_positive_budget.per_client", |c| {
        if let Some(b) = &mut c.false_positive_budget {
            b.per_client = 0;
        }
    }),
    ("audit.rate", |c| c.audit.rate = 1.5),
    ("audit.max_per_second", |c| c.audit.max_per_second = 0),
    ("audit.queue", |c| c.audit.queue = 0),
];

/// Mistakes that remove what other fields refer to: each alone is still one problem,
/// however many fields depend on it.
const MISSING: &[Mistake] = &[
    ("database", |c| c.database = None),
    ("upstream", |c| c.upstream = None),
];

fn filter<'c>(c: &'c mut Config, name: &str) -> &'c mut FilterConfig {
    c.filters
        .get_mut(name)
        .expect("the base config has this filter")
}

#[test]
fn each_mistake_alone_is_one_problem_at_its_field() {
    assert_eq!(problems(&base()), Vec::new());
    for (field, make) in MISTAKES.iter().chain(MISSING) {
        let mut config = base();
        make(&mut config);
        let found = problems(&config);
        assert_eq!(fields(&found), vec![*field], "{found:?}");
    }
}

#[test]
fn a_missing_section_names_every_field_that_needs_it() {
    let mut config = base();
    config.database = None;
    let found = problems(&config);
    assert_eq!(
        found[0].reason,
        "[database] is missing, but filters.products, filters.skus and routes[0].origin read from it"
    );
    let mut config = base();
    config.upstream = None;
    let found = problems(&config);
    assert_eq!(
        found[0].reason,
        "[upstream] is missing, but routes[1].origin, routes[2].origin and write_through[0] send requests to it"
    );
}

#[test]
fn several_mistakes_in_one_file_are_reported_together() {
    let text = BASE
        .replace(
            "listen = \"127.0.0.1:0\"\ntrusted",
            "listen = \"127.0.0.1:0\"\nmax_body_bytes = 0\ntrusted",
        )
        .replace("a-long-enough-token", "short")
        .replace("false_positive_rate = 0.001", "false_positive_rate = 1.5")
        .replace("path = \"/api/sku\"", "path = \"/api/sku/\"")
        .replace("WHERE sku_id = ?", "WHERE sku_id = 7")
        .replace(
            "path = \"/api/products\"",
            "path = \"/api/products\"\nstatuses = [42]",
        );
    let Err(e) = Config::from_toml_str(&text) else {
        panic!("accepted:\n{text}");
    };
    let ConfigError::Invalid(found) = &e else {
        panic!("not a validation error: {e}");
    };
    let expected = [
        "server.max_body_bytes",
        "admin.token",
        "filters.skus.false_positive_rate",
        "routes[0].origin.query",
        "routes[1].path",
        "write_through[0].statuses",
    ];
    assert_eq!(fields(found), expected, "{e}");
    // One heading, then one line per problem, each naming its field.
    let message = e.to_string();
    let lines: Vec<&str> = message.lines().collect();
    assert_eq!(lines[0], "invalid config (6 problems):", "{message}");
    assert_eq!(lines.len(), 1 + expected.len(), "{message}");
    for (line, field) in lines[1..].iter().zip(expected) {
        assert!(
            line.trim_start().starts_with(&format!("{field}: ")),
            "{line}"
        );
    }
}

#[test]
fn one_problem_is_one_line() {
    let mut config = base();
    config.routes[0].ttl = Some(Duration::ZERO);
    let message = config.validate().expect_err("refused").to_string();
    assert_eq!(
        message,
        "invalid config: routes[0].ttl: must be greater than 0"
    );
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Any set of independent mistakes is reported as exactly those problems: none is
    /// hidden by another, none is reported twice or drags in another field.
    #[test]
    fn any_set_of_mistakes_is_reported_exactly(
        chosen in prop::sample::subsequence((0..MISTAKES.len()).collect::<Vec<_>>(), 0..=MISTAKES.len())
    ) {
        let mut config = base();
        for &i in &chosen {
            (MISTAKES[i].1)(&mut config);
        }
        let found = problems(&config);
        let mut got = fields(&found);
        got.sort_unstable();
        let mut want: Vec<&str> = chosen.iter().map(|&i| MISTAKES[i].0).collect();
        want.sort_unstable();
        prop_assert_eq!(got, want);
    }
}

#[test]
fn connection_bounds_are_checked() {
    let mut c = base();
    c.server.max_connections = 0;
    c.server.http2_max_concurrent_streams = 20_000;
    let fields: Vec<String> = problems(&c).into_iter().map(|p| p.field).collect();
    assert_eq!(
        fields,
        [
            "server.max_connections",
            "server.http2_max_concurrent_streams"
        ]
    );
    c.server.max_connections = 1;
    c.server.http2_max_concurrent_streams = 1;
    assert_eq!(problems(&c), []);
}

#[test]
fn audit_settings_are_checked() {
    let c = base();
    assert!(c.audit.enabled, "the audit is on by default");
    assert_eq!((c.audit.rate, c.audit.max_per_second), (0.001, 10));

    let c = Config::from_toml_str(&format!(
        "{BASE}\n[audit]\nrate = 1\nmax_per_second = 500\nqueue = 4\n"
    ))
    .expect("a valid [audit] table");
    assert_eq!(
        (c.audit.rate, c.audit.max_per_second, c.audit.queue),
        (1.0, 500, 4)
    );
    // A rate of 0 is valid: nothing is sampled.
    let mut c = base();
    c.audit.rate = 0.0;
    assert_eq!(problems(&c), []);

    // Each bad value is refused with its reason, the audit on or off.
    for enabled in [true, false] {
        let mut c = base();
        c.audit.enabled = enabled;
        c.audit.rate = f64::NAN;
        c.audit.max_per_second = 20_000;
        c.audit.queue = 1 << 20;
        let found = problems(&c);
        assert_eq!(
            fields(&found),
            ["audit.rate", "audit.max_per_second", "audit.queue"]
        );
        assert!(found[0].reason.contains("between 0 and 1"), "{found:?}");
    }
    let mut c = base();
    c.audit.rate = -0.1;
    assert_eq!(fields(&problems(&c)), ["audit.rate"]);
    // An unknown field names itself.
    let e =
        Config::from_toml_str(&format!("{BASE}\n[audit]\nrat = 0.5\n")).expect_err("unknown field");
    assert!(e.to_string().contains("rat"), "{e}");
}

#[test]
fn a_filter_held_in_redis_needs_a_fleet_and_sane_settings() {
    let with_fleet = |edit: fn(&mut FilterConfig)| -> Vec<String> {
        let text = format!("{BASE}\n[fleet]\nredis_url = \"redis://127.0.0.1:6379\"\n");
        let mut config = Config::from_toml_str(&text).expect("the base config with a fleet");
        let f = filter(&mut config, "products");
        f.backend = Backend::Redis;
        edit(f);
        problems(&config).into_iter().map(|p| p.field).collect()
    };
    assert_eq!(with_fleet(|_| {}), Vec::<String>::new());
    type Edit = (&'static str, fn(&mut FilterConfig));
    let edits: [Edit; 5] = [
        ("filters.products.redis.check_timeout", |f| {
            f.redis.check_timeout = Duration::ZERO
        }),
        ("filters.products.redis.check_timeout", |f| {
            f.redis.check_timeout = Duration::from_secs(2)
        }),
        ("filters.products.redis.shard_bytes", |f| {
            f.redis.shard_bytes = 0
        }),
        ("filters.products.redis.shard_bytes", |f| {
            f.redis.shard_bytes = 100
        }),
        ("filters.products.redis.shard_bytes", |f| {
            f.redis.shard_bytes = 1 << 30
        }),
    ];
    for (field, edit) in edits {
        assert_eq!(with_fleet(edit), vec![field.to_owned()]);
    }
    // The same settings on a local filter are not looked at.
    let mut config = base();
    filter(&mut config, "products").redis.shard_bytes = 100;
    assert_eq!(problems(&config), Vec::new());
    // Except one: a local filter without a local copy would gate nothing.
    filter(&mut config, "products").redis.local_copy = false;
    let fields: Vec<String> = problems(&config).into_iter().map(|p| p.field).collect();
    assert_eq!(fields, ["filters.products.redis.local_copy"]);
    assert_eq!(
        with_fleet(|f| f.redis.local_copy = false),
        Vec::<String>::new()
    );
}

#[test]
fn the_token_can_come_from_a_file_read_at_each_compile() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("admin-token");
    std::fs::write(&path, "token-from-a-secret\n").expect("write the token");
    let mut c = base();
    c.admin.token = None;
    c.admin.token_file = Some(path.clone());
    let compiled = c.compile().expect("a readable token file");
    // The trailing line break is not part of the token; the compiled config holds the
    // token itself, so compiling it again reads nothing.
    let admin = &compiled.config().admin;
    assert_eq!(admin.token.as_deref(), Some("token-from-a-secret"));
    assert_eq!(admin.token_file, None);
    assert!(compiled.config().compile().is_ok());

    // Each compile reads the file again: a rotated token is the one in force.
    std::fs::write(&path, "a-rotated-token\r\n").expect("rotate the token");
    let again = c.compile().expect("still readable");
    assert_eq!(
        again.config().admin.token.as_deref(),
        Some("a-rotated-token")
    );
}

#[test]
fn a_token_file_that_cannot_give_a_token_is_refused_by_name() {
    let dir = tempfile::tempdir().expect("temp dir");
    let refused = |token: Option<&str>, file: &std::path::Path| {
        let mut c = base();
        c.admin.token = token.map(str::to_owned);
        c.admin.token_file = Some(file.to_path_buf());
        let found = problems(&c);
        assert_eq!(fields(&found), ["admin.token_file"], "{found:?}");
        found[0].reason.clone()
    };
    let good = dir.path().join("good");
    std::fs::write(&good, "a-long-enough-token\n").expect("write");
    let reason = refused(Some("another-long-token"), &good);
    assert!(reason.contains("not both"), "{reason}");

    let missing = dir.path().join("missing");
    let reason = refused(None, &missing);
    assert!(
        reason.contains("cannot read") && reason.contains(&missing.display().to_string()),
        "{reason}"
    );

    let empty = dir.path().join("empty");
    std::fs::write(&empty, "\n").expect("write");
    assert!(refused(None, &empty).contains("is empty"));

    let two_lines = dir.path().join("two-lines");
    std::fs::write(&two_lines, "first-line-token\nsecond-line\n").expect("write");
    assert!(refused(None, &two_lines).contains("more than one line"));

    // The length rule holds for a token from a file, and the message never shows it.
    let short = dir.path().join("short");
    std::fs::write(&short, "shorty\n").expect("write");
    let reason = refused(None, &short);
    assert!(
        reason.contains("at least 8") && !reason.contains("shorty"),
        "{reason}"
    );
}

/// `base()` with the products filter in binlog mode (`with` adds to its sync table).
fn binlog(with: impl FnOnce(&mut SyncConfig)) -> Config {
    let mut c = base();
    let mut sync: SyncConfig =
        serde_json::from_value(serde_json::json!({ "watermark": "binlog" })).expect("a sync table");
    with(&mut sync);
    filter(&mut c, "products").sync = Some(sync);
    c
}

#[test]
fn binlog_mode_needs_a_plain_scan_of_mysql_and_no_poll_query() {
    assert_eq!(fields(&problems(&binlog(|_| {}))), Vec::<&str>::new());
    let compiled = binlog(|_| {}).compile().expect("compiles");
    let source = compiled.filters[0]
        .binlog
        .as_ref()
        .expect("a binlog source");
    assert_eq!(source.table.table, "products");
    assert_eq!(source.table.column, "sku_id");
    assert_eq!(source.url, "mysql://u:p@127.0.0.1:3306/shop");
    for (field, mistake) in [
        (
            "filters.products.sync.query",
            (|s: &mut SyncConfig| {
                s.query = Some("SELECT sku_id, id FROM products WHERE id >= ?".into())
            }) as fn(&mut SyncConfig),
        ),
        ("filters.products.sync.start_query", |s| {
            s.start_query = Some("SELECT MAX(id) FROM products".into())
        }),
        ("filters.products.sync.binlog.server_id", |s| {
            s.binlog.server_id = Some(0)
        }),
        ("filters.products.sync.binlog.heartbeat", |s| {
            s.binlog.heartbeat = Duration::from_millis(10)
        }),
        ("filters.products.sync.binlog.heartbeat", |s| {
            s.binlog.heartbeat = Duration::from_secs(61)
        }),
        ("filters.products.sync.binlog.effective_rate_rebuild", |s| {
            s.binlog.effective_rate_rebuild = 1.0
        }),
        ("filters.products.sync.binlog.effective_rate_rebuild", |s| {
            s.binlog.effective_rate_rebuild = f64::NAN
        }),
        ("filters.products.sync.binlog.url", |s| {
            s.binlog.url = Some("sqlite://data/x.db".into())
        }),
    ] {
        assert_eq!(fields(&problems(&binlog(mistake))), [field], "{field}");
    }
    let mut c = binlog(|_| {});
    filter(&mut c, "products").source_query = "SELECT sku_id FROM products WHERE live".into();
    let p = problems(&c);
    assert_eq!(fields(&p), ["filters.products.source_query"]);
    assert!(p[0].reason.contains("no WHERE"), "{}", p[0].reason);
    let mut c = binlog(|_| {});
    c.database.as_mut().expect("database").url = "sqlite://data/x.db".into();
    assert_eq!(fields(&problems(&c)), ["filters.products.sync.watermark"]);
    // Polling still needs its query.
    let mut c = base();
    if let Some(s) = &mut filter(&mut c, "products").sync {
        s.query = None;
    }
    assert_eq!(fields(&problems(&c)), ["filters.products.sync.query"]);
}
