//! Environment overrides: `BLOOMGATE__SECTION__FIELD=value` over the file, nested fields
//! separated by a double underscore. A value is read as TOML would read it (a number, a
//! boolean, an array, a table, else text), except where its field wants text: there the
//! variable's text is kept exactly as written, so `BLOOMGATE__ADMIN__TOKEN=00123456` is
//! the token `00123456`, not the number 123456. Numeric fields still read numbers. It
//! reads variables; it does not validate.

use std::ffi::OsString;

use figment::error::{Actual, Kind};
use figment::providers::Env;
use figment::value::{Dict, Map, Value};
use figment::{Figment, Metadata, Profile, Provider};

use super::{Config, ENV_PREFIX};

/// `base` with the overrides in `vars` (variable names and values, as
/// `std::env::vars_os` gives them) merged over it, deserialised.
pub(super) fn extract(
    base: Figment,
    vars: impl IntoIterator<Item = (OsString, OsString)>,
) -> Result<Config, Box<figment::Error>> {
    let mut overrides = Overrides::from_vars(vars);
    // Each round keeps one more variable as text, so this ends within one round per
    // variable.
    loop {
        match base.clone().merge(&overrides).extract::<Config>() {
            Ok(config) => return Ok(config),
            Err(e) => match overrides.text_wanted(&e) {
                Some(i) => overrides.vars[i].as_text = true,
                None => return Err(Box::new(e)),
            },
        }
    }
}

/// One `BLOOMGATE__…` variable.
#[derive(Debug, Clone)]
struct Var {
    /// The field's dotted path, lower case: `admin.token`.
    key: String,
    /// The value as written.
    raw: String,
    /// Keep `raw` as text: its field wants text, and read as TOML it is not.
    as_text: bool,
}

/// The overrides, as a figment provider.
#[derive(Debug, Clone)]
struct Overrides {
    vars: Vec<Var>,
}

impl Overrides {
    /// The variables named `BLOOMGATE__…` (in any case) among `vars`.
    fn from_vars(vars: impl IntoIterator<Item = (OsString, OsString)>) -> Overrides {
        let vars = vars
            .into_iter()
            .filter_map(|(name, value)| {
                let name = name.to_string_lossy();
                let name = name.trim();
                let head = name.get(..ENV_PREFIX.len())?;
                let rest = name.get(ENV_PREFIX.len()..)?;
                if !head.eq_ignore_ascii_case(ENV_PREFIX) {
                    return None;
                }
                let key = rest.replace("__", ".").to_ascii_lowercase();
                if key.split('.').any(str::is_empty) {
                    return None;
                }
                Some(Var {
                    key,
                    raw: value.to_string_lossy().into_owned(),
                    as_text: false,
                })
            })
            .collect();
        Overrides { vars }
    }

    /// The variable that `e` says was read as something other than the text its field
    /// wants, unless it is already kept as text.
    fn text_wanted(&self, e: &figment::Error) -> Option<usize> {
        let Kind::InvalidType(actual, expected) = &e.kind else {
            return None;
        };
        if matches!(actual, Actual::Str(_)) || !expected.contains("string") {
            return None;
        }
        let key = e.path.join(".");
        self.vars
            .iter()
            .position(|v| !v.as_text && v.key.eq_ignore_ascii_case(&key))
    }
}

impl Provider for Overrides {
    fn metadata(&self) -> Metadata {
        // Names the variables in errors as figment's own provider does.
        Env::prefixed(ENV_PREFIX).split("__").metadata()
    }

    fn data(&self) -> Result<Map<Profile, Dict>, figment::Error> {
        let mut dict = Dict::new();
        for var in &self.vars {
            let value = if var.as_text {
                Value::from(var.raw.clone())
            } else {
                var.raw
                    .parse::<Value>()
                    .unwrap_or_else(|never| match never {})
            };
            let path: Vec<&str> = var.key.split('.').collect();
            insert(&mut dict, &path, value);
        }
        Ok(Profile::Default.collect(dict))
    }
}

/// Puts `value` at `path` in `dict`, making the tables on the way (replacing a value
/// that is in the way: the deeper variable wins).
fn insert(dict: &mut Dict, path: &[&str], value: Value) {
    match path {
        [] => {}
        [last] => {
            dict.insert((*last).to_owned(), value);
        }
        [first, rest @ ..] => {
            let entry = dict
                .entry((*first).to_owned())
                .or_insert_with(|| Value::from(Dict::new()));
            if !matches!(entry, Value::Dict(..)) {
                *entry = Value::from(Dict::new());
            }
            if let Value::Dict(_, inner) = entry {
                insert(inner, rest, value);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use figment::providers::{Format, Toml};

    use super::*;

    const FILE: &str = r#"
        [server]
        listen = "127.0.0.1:0"
        [admin]
        token = "from-the-file"
    "#;

    fn load(vars: &[(&str, &str)]) -> Result<Config, Box<figment::Error>> {
        let vars = vars
            .iter()
            .map(|(k, v)| (OsString::from(k), OsString::from(v)));
        extract(Figment::from(Toml::string(FILE)), vars)
    }

    #[test]
    fn text_fields_keep_the_text_of_numbers_and_booleans() {
        for token in [
            "12345678", "00123456", "1234.500", "1e100000", "true", "[1, 2]",
        ] {
            let c = load(&[("BLOOMGATE__ADMIN__TOKEN", token)]).expect(token);
            assert_eq!(c.admin.token.as_deref(), Some(token));
        }
        let c = load(&[
            ("BLOOMGATE__ADMIN__TOKEN", "12345678"),
            ("BLOOMGATE__LOG__LEVEL", "0"),
            ("BLOOMGATE__UPSTREAM__URL", "8080"),
        ])
        .expect("three text fields");
        assert_eq!(c.admin.token.as_deref(), Some("12345678"));
        assert_eq!(c.log.level, "0");
        assert_eq!(c.upstream.map(|u| u.url).as_deref(), Some("8080"));
    }

    #[test]
    fn other_fields_read_numbers_booleans_and_arrays() {
        let c = load(&[
            ("BLOOMGATE__SERVER__MAX_BODY_BYTES", "2048"),
            ("BLOOMGATE__SERVER__TRUSTED_PROXIES", "[\"10.0.0.0/8\"]"),
            ("bloomgate__cache__max_entries", "77"),
        ])
        .expect("valid overrides");
        assert_eq!(c.server.max_body_bytes, 2048);
        assert_eq!(c.server.trusted_proxies, ["10.0.0.0/8"]);
        assert_eq!(c.cache.max_entries, Some(77));
        assert_eq!(c.admin.token.as_deref(), Some("from-the-file"));
        // A number field given text is still refused, naming the field and the variable.
        let e = load(&[("BLOOMGATE__SERVER__MAX_BODY_BYTES", "lots")]).expect_err("text");
        assert_eq!(e.path, ["server", "max_body_bytes"], "{e}");
        let source = e.metadata.as_ref().map(|m| m.name.to_string());
        assert_eq!(
            source.as_deref(),
            Some("`BLOOMGATE__` environment variable(s)"),
            "{e}"
        );
    }

    #[test]
    fn fleet_variables_make_a_fleet_section() {
        const WITH_DB: &str = r#"
            [server]
            listen = "127.0.0.1:0"
            [database]
            url = "mysql://bloomgate:bloomgate@mysql:3306/shop"
        "#;
        let load_db = |vars: &[(&str, &str)]| {
            let vars = vars
                .iter()
                .map(|(k, v)| (OsString::from(k), OsString::from(v)));
            extract(Figment::from(Toml::string(WITH_DB)), vars)
        };
        // The three variables docker-compose.yml gives each instance.
        let c = load_db(&[
            ("BLOOMGATE__FLEET__REDIS_URL", "redis://redis:6379"),
            ("BLOOMGATE__FLEET__NAMESPACE", "shop"),
            ("BLOOMGATE__FLEET__INSTANCE_ID", "bloomgate-1"),
        ])
        .expect("fleet overrides");
        let fleet = c
            .fleet
            .clone()
            .expect("a [fleet] section from the environment");
        assert_eq!(fleet.redis_url, "redis://redis:6379");
        assert_eq!(fleet.namespace, "shop");
        assert_eq!(fleet.instance_id.as_deref(), Some("bloomgate-1"));
        // The fields not given keep their defaults, and the whole passes validation.
        assert_eq!(fleet.lease_ttl, std::time::Duration::from_secs(10));
        assert_eq!(fleet.chunk_bytes, 1 << 20);
        let compiled = c.compile().expect("a valid fleet config");
        let fleet = compiled.into_config().fleet.expect("kept by compile");
        assert_eq!(fleet.instance_id.as_deref(), Some("bloomgate-1"));

        // Text stays text: an all-digit id or namespace, and a URL with a password.
        let c = load_db(&[
            (
                "BLOOMGATE__FLEET__REDIS_URL",
                "redis://:p%40ss@10.0.0.5:6380/2",
            ),
            ("BLOOMGATE__FLEET__NAMESPACE", "2026"),
            ("BLOOMGATE__FLEET__INSTANCE_ID", "0042"),
            ("BLOOMGATE__FLEET__LEASE_TTL", "20s"),
            ("BLOOMGATE__FLEET__CHUNK_BYTES", "65536"),
        ])
        .expect("fleet overrides");
        let fleet = c.fleet.clone().expect("fleet");
        assert_eq!(fleet.redis_url, "redis://:p%40ss@10.0.0.5:6380/2");
        assert_eq!(fleet.namespace, "2026");
        assert_eq!(fleet.instance_id.as_deref(), Some("0042"));
        assert_eq!(fleet.lease_ttl, std::time::Duration::from_secs(20));
        assert_eq!(fleet.chunk_bytes, 65536);
        c.compile().expect("valid");

        // Without the URL there is no fleet to join: refused, naming the field.
        let e = load_db(&[("BLOOMGATE__FLEET__NAMESPACE", "shop")]).expect_err("no url");
        assert_eq!(e.path, ["fleet"], "{e}");
        assert!(
            matches!(&e.kind, Kind::MissingField(f) if f == "redis_url"),
            "{e}"
        );
        // Without any of them, no fleet.
        assert!(load_db(&[]).expect("no overrides").fleet.is_none());
    }

    #[test]
    fn audit_variables_override_the_defaults() {
        let c = load(&[
            ("BLOOMGATE__AUDIT__RATE", "0.25"),
            ("BLOOMGATE__AUDIT__MAX_PER_SECOND", "50"),
        ])
        .expect("valid overrides");
        assert_eq!((c.audit.rate, c.audit.max_per_second), (0.25, 50));
        assert!(c.audit.enabled);
        let c = load(&[("BLOOMGATE__AUDIT__ENABLED", "false")]).expect("valid override");
        assert!(!c.audit.enabled);
        assert_eq!(c.audit.rate, 0.001, "the others keep their defaults");
    }

    #[test]
    fn other_variables_are_ignored() {
        let c = load(&[
            ("BLOOMGATEX__ADMIN__TOKEN", "12345678"),
            ("HOME", "/root"),
            ("BLOOMGATE__", "x"),
        ])
        .expect("nothing applies");
        assert_eq!(c.admin.token.as_deref(), Some("from-the-file"));
    }

    #[test]
    fn tls_variables_make_a_tls_table() {
        let c = load(&[
            ("BLOOMGATE__SERVER__TLS__CERT_FILE", "/run/secrets/cert.pem"),
            ("BLOOMGATE__SERVER__TLS__KEY_FILE", "/run/secrets/key.pem"),
            ("BLOOMGATE__SERVER__HTTP2", "false"),
            ("BLOOMGATE__SERVER__MAX_CONNECTIONS", "500"),
        ])
        .expect("valid overrides");
        let tls = c.server.tls.expect("a tls table");
        assert_eq!(tls.cert_file, std::path::Path::new("/run/secrets/cert.pem"));
        assert_eq!(tls.key_file, std::path::Path::new("/run/secrets/key.pem"));
        assert!(!c.server.http2);
        assert_eq!(c.server.max_connections, 500);
        // Half a table is refused, naming what is missing.
        let e = load(&[("BLOOMGATE__SERVER__TLS__CERT_FILE", "/c.pem")]).expect_err("no key file");
        assert!(e.to_string().contains("key_file"), "{e}");
    }
}
