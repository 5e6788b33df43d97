//! Configuration: the serde model behind `config.toml` (`model`), its environment
//! overrides (`BLOOMGATE__SECTION__FIELD`), loading, the rules serde cannot express
//! (`validate`), and the runtime forms the app wires, computed once (`compile`). It
//! reads, checks and compiles; it does not open sockets or databases.

mod audit;
mod compile;
mod env;
mod filters;
mod fleet;
pub mod model;
mod origins;
mod routes;
mod server;
mod source;
mod validate;

use std::path::Path;

use figment::Figment;
use figment::providers::{Format, Toml};

pub use audit::AuditConfig;
pub use compile::CompiledTls;
pub use compile::{
    Compiled, CompiledFilter, CompiledOrigin, CompiledRoute, CompiledUpstream, CompiledWriteThrough,
};
pub use model::*;
pub use origins::{BreakerConfig, OriginLimits};
pub use source::{BinlogSource, NotAPlainScan, SourceTable};

/// Prefix of the environment variables that override config fields; nested fields are
/// separated by a double underscore: `BLOOMGATE__SERVER__LISTEN=0.0.0.0:8081`. A field
/// that wants text takes the variable's text as written, digits included.
pub const ENV_PREFIX: &str = "BLOOMGATE__";

/// A config that could not be read or does not make sense.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The config file named does not exist.
    #[error("config file {} does not exist", .0.display())]
    Missing(std::path::PathBuf),
    /// The file or an environment variable could not be parsed into the structs
    /// (unknown field, wrong type, bad duration, …): figment's errors, one per problem,
    /// each printed with its key path and where the value came from.
    #[error("{}", describe_figment_error(.0))]
    Parse(Box<figment::Error>),
    /// The values parsed but break rules: every broken rule of the file, in file order,
    /// each naming its field.
    #[error("{}", list_problems(.0))]
    Invalid(Vec<Problem>),
}

/// One broken rule of a config: the field, by its TOML path, and why it is refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    /// TOML path of the offending field, e.g. `routes[0].origin.query`.
    pub field: String,
    /// Why it is refused.
    pub reason: String,
}

impl std::fmt::Display for Problem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.field, self.reason)
    }
}

/// One problem on the same line as the heading; several one per line below it.
fn list_problems(problems: &[Problem]) -> String {
    match problems {
        [one] => format!("invalid config: {one}"),
        many => {
            let mut text = format!("invalid config ({} problems):", many.len());
            for p in many {
                text.push_str("\n  ");
                text.push_str(&p.to_string());
            }
            text
        }
    }
}

impl Config {
    /// Parses a TOML string, without environment overrides, and validates it.
    pub fn from_toml_str(toml: &str) -> Result<Config, ConfigError> {
        Self::extract(Figment::from(Toml::string(toml)), false).map(Compiled::into_config)
    }

    /// Reads a TOML file, applies `BLOOMGATE__…` environment overrides, validates.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        Self::load_compiled(path).map(Compiled::into_config)
    }

    /// As [`Config::load`], keeping what validation compiled, for `bloomgate::App::build`.
    pub fn load_compiled(path: &Path) -> Result<Compiled, ConfigError> {
        if !path.exists() {
            return Err(ConfigError::Missing(path.to_owned()));
        }
        Self::extract(Figment::from(Toml::file_exact(path)), true)
    }

    /// Builds a config from a TOML string and the environment overrides.
    pub fn from_toml_str_with_env(toml: &str) -> Result<Config, ConfigError> {
        Self::extract(Figment::from(Toml::string(toml)), true).map(Compiled::into_config)
    }

    /// Deserialises `base`, with the environment overrides when `with_env`, and compiles.
    fn extract(base: Figment, with_env: bool) -> Result<Compiled, ConfigError> {
        let config = if with_env {
            env::extract(base, std::env::vars_os())
        } else {
            base.extract::<Config>().map_err(Box::new)
        }
        .map_err(ConfigError::Parse)?;
        config.compile()
    }
}

fn describe_figment_error(e: &figment::Error) -> String {
    // figment keeps one error per problem; report them all, each with its key path.
    e.clone()
        .into_iter()
        .map(|one| {
            let path = one.path.join(".");
            let source = one
                .metadata
                .as_ref()
                .map(|m| m.name.to_string())
                .unwrap_or_default();
            if path.is_empty() {
                format!("invalid config: {} ({source})", one.kind)
            } else {
                format!("invalid config: `{path}`: {} ({source})", one.kind)
            }
        })
        .collect::<Vec<_>>()
        .join("; ")
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    const GOOD: &str = r#"
        [server]
        listen = "127.0.0.1:0"
        [upstream]
        url = "http://127.0.0.1:3000"
        [database]
        url = "sqlite://data/x.db"
        [filters.products]
        source_query = "SELECT sku_id FROM products"
        expected_items = 1000
        [[routes]]
        path = "/api/products/{id}"
        key = { segment = "id" }
        filter = "products"
        origin = { kind = "sql", query = "SELECT * FROM products WHERE sku_id = ?" }
    "#;

    fn err(toml: &str) -> String {
        match Config::from_toml_str(toml) {
            Ok(_) => panic!("config was accepted:\n{toml}"),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn good_config_gets_defaults() {
        let c = Config::from_toml_str(GOOD).expect("valid");
        assert_eq!(c.cache.negative_ttl, Duration::from_secs(300));
        assert_eq!(c.filters["products"].false_positive_rate, 0.01);
        assert_eq!(c.route_normalize(&c.routes[0]), Normalize::Integer);
        assert_eq!(c.routes[0].label(), "/api/products/{id}");
        assert_eq!(c.admin.listen.port(), 9090);
    }

    #[test]
    fn unknown_field_is_named() {
        let e = err(&GOOD.replace("[server]", "[server]\nlisten_port = 3"));
        assert!(e.contains("listen_port"), "{e}");
    }

    #[test]
    fn bad_duration_is_named() {
        let e = err(&format!("{GOOD}\n[cache]\nttl = \"five minutes\"\n"));
        assert!(e.contains("cache.ttl"), "{e}");
    }

    #[test]
    fn missing_lookup_query_is_named() {
        let e = err(&GOOD.replace(
            r#"origin = { kind = "sql", query = "SELECT * FROM products WHERE sku_id = ?" }"#,
            r#"origin = { kind = "sql" }"#,
        ));
        assert!(e.contains("routes.0.origin") && e.contains("query"), "{e}");
    }

    #[test]
    fn lookup_query_needs_one_placeholder() {
        let e = err(&GOOD.replace("sku_id = ?", "sku_id = 1"));
        assert!(e.contains("routes[0].origin.query"), "{e}");
    }

    #[test]
    fn unknown_filter_and_bad_rate_are_named() {
        let e = err(&GOOD.replace("filter = \"products\"", "filter = \"nope\""));
        assert!(e.contains("routes[0].filter"), "{e}");
        let e = err(&GOOD.replace(
            "expected_items = 1000",
            "expected_items = 1000\nfalse_positive_rate = 1.5",
        ));
        assert!(e.contains("filters.products.false_positive_rate"), "{e}");
    }

    #[test]
    fn rates_near_one_are_refused_before_sizing() {
        // Sizing a filter for a rate near 1 used to take minutes at this size.
        let e = err(&GOOD.replace(
            "expected_items = 1000",
            "expected_items = 10000000000\nfalse_positive_rate = 0.99999999",
        ));
        assert!(e.contains("filters.products.false_positive_rate"), "{e}");
        assert!(e.contains("above 0.5"), "{e}");
    }

    #[test]
    fn path_must_name_the_segment() {
        let e = err(&GOOD.replace("{ segment = \"id\" }", "{ segment = \"sku\" }"));
        assert!(e.contains("routes[0].path"), "{e}");
    }

    #[test]
    fn head_and_target_limits_are_bounded() {
        let with = |fields: &str| GOOD.replace("[server]", &format!("[server]\n{fields}"));
        let e = err(&with("max_header_bytes = 4096"));
        assert!(e.contains("server.max_header_bytes"), "{e}");
        let e = err(&with("max_uri_bytes = 20000"));
        assert!(e.contains("server.max_uri_bytes"), "{e}");
        // Beyond what hyper itself lets through, even with a large head limit.
        let e = err(&with("max_header_bytes = 131072\nmax_uri_bytes = 65535"));
        assert!(e.contains("server.max_uri_bytes"), "{e}");
        let c = Config::from_toml_str(&with("max_header_bytes = 131072\nmax_uri_bytes = 65534"))
            .expect("valid");
        assert_eq!(c.server.max_uri_bytes, 65534);
        let e = err(&with("trusted_proxies = [\"10.0.0.0/33\"]"));
        assert!(e.contains("server.trusted_proxies"), "{e}");
    }

    #[test]
    fn upstream_url_is_checked() {
        let e = err(&GOOD.replace("http://127.0.0.1:3000", "https://example.test"));
        assert!(e.contains("upstream.url"), "{e}");
    }

    #[test]
    fn sync_defaults_and_gap_timeout() {
        let sync = "\n[filters.products.sync]\nquery = \"SELECT sku_id, id FROM products WHERE id >= ?\"\nwatermark = \"integer\"\nstart_query = \"SELECT MAX(id) FROM products\"\n";
        let c = Config::from_toml_str(&format!("{GOOD}{sync}")).expect("valid");
        let s = c.filters["products"].sync.as_ref().expect("sync");
        assert_eq!(s.overlap_ids, 1000);
        assert_eq!(s.gap_timeout, Duration::from_secs(120));
        let c =
            Config::from_toml_str(&format!("{GOOD}{sync}gap_timeout = \"1s\"\n")).expect("valid");
        let s = c.filters["products"].sync.as_ref().expect("sync");
        assert_eq!(s.gap_timeout, Duration::from_secs(1));
        let e = err(&format!("{GOOD}{sync}gap_timeout = \"0s\"\n"));
        assert!(e.contains("filters.products.sync.gap_timeout"), "{e}");
    }

    #[test]
    fn string_normaliser_parses() {
        let toml = GOOD.replace(
            "expected_items = 1000",
            "expected_items = 1000\nnormalize = { kind = \"string\", lowercase = true, max_len = 32 }",
        );
        let c = Config::from_toml_str(&toml).expect("valid");
        assert_eq!(
            c.filters["products"].normalize,
            Normalize::String {
                lowercase: true,
                max_len: 32
            }
        );
    }
}
