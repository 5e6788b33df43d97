//! Building from the compiled form: what compiling decided is wired as it is, and a
//! config that does not compile, or has lost a section a route needs, is refused.

use http::HeaderName;

use super::*;
use crate::origin::Origin;

const CONFIG: &str = r#"
    [server]
    listen = "127.0.0.1:0"
    [admin]
    listen = "127.0.0.1:0"
    [upstream]
    url = "http://127.0.0.1:3000"
    [database]
    url = "sqlite://data/never-opened.db"
    [filters.products]
    source_query = "SELECT sku_id FROM products"
    expected_items = 1000
    [[routes]]
    path = "/api/products/{id}"
    key = { segment = "id" }
    filter = "products"
    origin = { kind = "sql", query = "SELECT * FROM products WHERE sku_id = ?" }
    [[routes]]
    path = "/api/product/info"
    key = { query = "sku" }
    filter = "products"
    origin = { kind = "upstream" }
    forward_headers = ["Accept-Language"]
    [[write_through]]
    path = "/api/products"
    filter = "products"
    key = { header = "location" }
"#;

/// `App::build` wires what compiling decided and reads none of those values from the
/// config again: spoiling them after compiling changes nothing.
#[tokio::test]
async fn build_wires_the_compiled_form_without_parsing_again() {
    let config = Config::from_toml_str(CONFIG).expect("valid");
    let mut compiled = config.compile().expect("compiles");
    let spoiled = &mut compiled.config;
    spoiled.routes[0].path = "no pattern".into();
    spoiled.routes[1].forward_headers = vec!["not a header".into()];
    spoiled.routes[1].filter = "gone".into();
    spoiled.server.trusted_proxies = vec!["not a range".into()];
    spoiled.write_through[0].methods = vec!["NOT A METHOD".into()];
    if let Some(u) = &mut spoiled.upstream {
        u.url = "https://elsewhere.test/path".into();
    }
    assert!(
        spoiled.validate().is_err(),
        "a second check would refuse it"
    );

    let app = App::build(compiled, Registry::new())
        .await
        .expect("builds from the compiled form");
    let pipeline = app.proxy().current();
    let routes = pipeline.routes();
    assert_eq!(routes.len(), 2);
    assert_eq!(routes[0].pattern.matches("/api/products/7"), Some("7"));
    assert_eq!(&*routes[0].label, "/api/products/{id}");
    assert_eq!(routes[1].filter.name(), "products");
    let Origin::Upstream(origin) = &*routes[1].origin else {
        panic!("route 1 has an upstream origin");
    };
    assert_eq!(
        origin.forward_headers,
        [HeaderName::from_static("accept-language")]
    );
    let target = origin.upstream.uri_for_target("/x").expect("a URI");
    assert_eq!(target.to_string(), "http://127.0.0.1:3000/x");
}

#[tokio::test]
async fn bind_refuses_a_config_that_does_not_compile() {
    let mut config = Config::from_toml_str(CONFIG).expect("valid");
    config.routes[0].path = "no pattern".into();
    match App::bind(config).await {
        Err(AppError::Config(ConfigError::Invalid(problems))) => {
            assert_eq!(problems.len(), 1, "{problems:?}");
            assert_eq!(problems[0].field, "routes[0].path");
        }
        Err(e) => panic!("another error: {e}"),
        Ok(_) => panic!("bound a config with a broken route"),
    }
}

/// A compiled config changed after compiling so that a route's origin has nothing to
/// ask is refused by name, not a panic.
#[tokio::test]
async fn build_refuses_an_origin_whose_section_is_gone() {
    let mut compiled = Config::from_toml_str(CONFIG)
        .expect("valid")
        .compile()
        .expect("compiles");
    compiled.config.database = None;
    match App::build(compiled, Registry::new()).await {
        Err(AppError::Assemble(AssembleError::MissingSection { route, section })) => {
            assert_eq!(
                (route.as_str(), section),
                ("/api/products/{id}", "database")
            );
        }
        Err(e) => panic!("another error: {e}"),
        Ok(_) => panic!("built a sql route without a database"),
    }
}
