//! Every error prints its cause once. An error either carries its cause as its source
//! and says only what failed, or has no source and says everything itself; whatever
//! prints it for a person walks the chain with `report::Chain`. Two checks hold this:
//! real failures of the crate's error types, made cheaply, keep their cause out of their
//! own message and `Chain` shows it; and a reading of `src/` and
//! `crates/bloomgate-core/src/` finds no `#[error(...)]` message that names a field which
//! is also the source.

#[path = "support/sources.rs"]
mod sources;

use std::error::Error;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use bloomgate::app::AppError;
use bloomgate::cert::CertificateFiles;
use bloomgate::config::{Config, ConfigError};
use bloomgate::db::{Db, DbError, PoolSettings};
use bloomgate::filter::snapshot::{self, HeaderProblem, SnapshotError};
use bloomgate::filter::{BloomParams, FilterError};
use bloomgate::fleet::FleetError;
use bloomgate::fleet::generation::{GenerationError, Implausible};
use bloomgate::gate::redis_held::{BadRecord, HeldError};
use bloomgate::gate::{LoadError, Mismatch};
use bloomgate::origin::OriginError;
use bloomgate::origin::client::UpstreamError;
use bloomgate::pipeline::error::ProxyError;
use bloomgate::report::Chain;
use bloomgate::server::tls::TlsSetupError;
use sources::rust_files;

/// `e` has a source, does not repeat it, and prints it through [`Chain`].
#[track_caller]
fn prints_its_cause_once(e: &(dyn Error + 'static)) {
    let cause = e
        .source()
        .unwrap_or_else(|| panic!("{e:?} has no source"))
        .to_string();
    let own = e.to_string();
    assert!(
        !own.contains(&cause),
        "the message repeats the source:\n  message: {own}\n  source: {cause}"
    );
    let chain = Chain(e).to_string();
    assert!(
        chain.starts_with(&own) && chain.contains(&cause),
        "the chain lacks the cause:\n  chain: {chain}\n  source: {cause}"
    );
}

fn redis_error() -> redis::RedisError {
    redis::Client::open("not a redis url").expect_err("the URL is refused")
}

#[test]
fn failures_of_the_start_up_path_keep_their_cause_as_their_source() {
    let dir = tempfile::tempdir().expect("temp dir");
    let missing = dir.path().join("missing.pem");
    let cert = CertificateFiles {
        cert_file: missing.clone(),
        key_file: missing,
    }
    .load()
    .expect_err("no such file");
    prints_its_cause_once(&cert);
    assert!(Chain(&cert).to_string().contains("missing.pem"));

    let tls = TlsSetupError::from(tokio_rustls::rustls::Error::General(
        "no usable cipher".into(),
    ));
    prints_its_cause_once(&tls);
    assert_eq!(
        Chain(&tls).to_string(),
        "cannot set up TLS: unexpected error: no usable cipher"
    );

    let Err(db) = Db::connect_lazy("mysql://user@host:notaport/shop", &PoolSettings::default())
    else {
        panic!("the port is refused");
    };
    assert!(matches!(db, DbError::InvalidUrl { .. }), "{db:?}");
    prints_its_cause_once(&db);

    let params = BloomParams::optimal(0, 0.01).expect_err("zero items");
    prints_its_cause_once(&LoadError::from(params));

    let bind = AppError::Bind {
        addr: "127.0.0.1:9".parse().expect("address"),
        source: std::io::Error::from(std::io::ErrorKind::AddrInUse),
    };
    prints_its_cause_once(&bind);

    let registry = prometheus::Registry::new();
    let counter = || prometheus::IntCounter::new("twice", "registered twice").expect("counter");
    registry.register(Box::new(counter())).expect("first");
    let clash = registry
        .register(Box::new(counter()))
        .expect_err("a name clash");
    prints_its_cause_once(&AppError::from(clash));

    let fleet = AppError::from(FleetError::from(redis_error()));
    prints_its_cause_once(&fleet);
    // "fleet: redis: <the client's refusal>", as it read when each level said it all.
    assert!(
        Chain(&fleet).to_string().starts_with("fleet: redis: "),
        "{}",
        Chain(&fleet)
    );
}

#[test]
fn failures_of_the_filter_and_fleet_keep_their_cause_as_their_source() {
    let dir = tempfile::tempdir().expect("temp dir");
    let read = snapshot::read(&dir.path().join("none.snap")).expect_err("no such file");
    assert!(matches!(read, SnapshotError::Io { .. }), "{read:?}");
    prints_its_cause_once(&read);

    let cut = snapshot::decode_bytes(b"short").expect_err("truncated");
    prints_its_cause_once(&GenerationError::from(cut));

    let held = HeldError::from(redis_error());
    prints_its_cause_once(&held);
    assert!(Chain(&held).to_string().starts_with("redis: "));
    prints_its_cause_once(&GenerationError::from(redis_error()));
    prints_its_cause_once(&FleetError::from(redis_error()));

    let too_large = FilterError::TooLarge { bits: u64::MAX };
    let layout = SnapshotError::Layout(too_large);
    prints_its_cause_once(&layout);

    // Causes that used to be flattened into text are typed, and still said once.
    let header = SnapshotError::from(HeaderProblem::Hashes(65));
    prints_its_cause_once(&header);
    assert_eq!(
        Chain(&header).to_string(),
        "snapshot header is inconsistent: hash count 65 is outside 1..=64"
    );
    let record = HeldError::from(BadRecord::Field("bits"));
    prints_its_cause_once(&record);
    assert_eq!(
        Chain(&record).to_string(),
        "the current record is malformed: field bits missing or not a number"
    );
    let mismatch = Mismatch::Capacity {
        built: 10,
        configured: 20,
    };
    let implausible = GenerationError::from(Implausible::from(mismatch.clone()));
    prints_its_cause_once(&implausible);
    assert_eq!(
        Chain(&implausible).to_string(),
        format!("generation is implausible: {mismatch}")
    );
}

#[test]
fn a_config_that_cannot_be_parsed_keeps_figments_errors() {
    let e = Config::from_toml_str("[server]\nlisten = 8080\nno_such_field = 1\n")
        .expect_err("a number for an address and an unknown field");
    let ConfigError::Parse(figment) = &e else {
        panic!("{e:?}")
    };
    // Each of figment's errors is kept, with its key path, and printed once.
    let paths: Vec<String> = figment
        .clone()
        .into_iter()
        .map(|one| one.path.join("."))
        .collect();
    assert!(!paths.is_empty(), "{figment:?}");
    let text = Chain(&e).to_string();
    for path in &paths {
        assert_eq!(
            text.matches(&format!("`{path}`")).count(),
            1,
            "{path}: {text}"
        );
    }
    let missing = Config::load(Path::new("/nonexistent/bloomgate.toml")).expect_err("no file");
    assert!(matches!(&missing, ConfigError::Missing(p) if p.ends_with("bloomgate.toml")));
    assert_eq!(
        missing.to_string(),
        "config file /nonexistent/bloomgate.toml does not exist"
    );
}

#[tokio::test]
async fn failures_of_a_request_keep_their_cause_as_their_source() {
    let db = Db::connect_lazy("sqlite::memory:", &PoolSettings::default()).expect("url");
    let query = db
        .count_rows("SELECT id FROM no_such_table")
        .await
        .expect_err("no such table");
    assert!(matches!(query, DbError::Query(_)), "{query:?}");
    prints_its_cause_once(&query);
    let origin = OriginError::Db(query);
    prints_its_cause_once(&origin);
    let internal = ProxyError::from(Arc::new(origin));
    prints_its_cause_once(&internal);
    // Three levels, each said once.
    assert!(
        Chain(&internal)
            .to_string()
            .starts_with("internal error: lookup query failed: database query failed: "),
        "{}",
        Chain(&internal)
    );

    let json = serde_json::from_str::<u8>("x").expect_err("not a number");
    prints_its_cause_once(&OriginError::from(json));

    let uri = http::Request::builder()
        .uri("http://[bad")
        .body(())
        .expect_err("not a URI");
    let upstream = UpstreamError::from(uri);
    prints_its_cause_once(&upstream);
    prints_its_cause_once(&ProxyError::from(upstream));

    let late = ProxyError::from(Arc::new(OriginError::Timeout(Duration::from_secs(2))));
    prints_its_cause_once(&late);
}

#[test]
fn a_config_problem_still_names_the_cause_of_a_refused_value() {
    let toml = r#"
        [server]
        listen = "127.0.0.1:0"
        [upstream]
        url = "http://[bad"
    "#;
    let e = Config::from_toml_str(toml).expect_err("a bad URL");
    let text = Chain(&e).to_string();
    assert!(
        text.contains("upstream.url: not a URL: "),
        "the URI parser's reason is kept: {text}"
    );
}

/// One `#[error(...)]` message that names a field which is also the error's source.
#[derive(Debug, PartialEq)]
struct Repeat {
    line: usize,
    field: String,
}

/// Every `#[error(...)]` in `code` whose message interpolates a source field: one marked
/// `#[source]` or `#[from]`, or named `source` (thiserror takes that as the source).
fn repeats(code: &str) -> Vec<Repeat> {
    let mut found = Vec::new();
    let mut from = 0;
    while let Some(at) = code[from..].find("#[error(") {
        let start = from + at;
        from = start + "#[error(".len();
        let line_start = code[..start].rfind('\n').map_or(0, |i| i + 1);
        if code[line_start..start].trim_start().starts_with("//") {
            continue;
        }
        let Some(attr_len) = closing(&code[from..], '(', ')') else {
            continue;
        };
        let attr = &code[from..from + attr_len];
        if attr.trim() == "transparent" {
            continue;
        }
        let (message, args) = split_message(attr);
        let line = code[..start].matches('\n').count() + 1;
        for (name, is_source) in fields(&code[from + attr_len + 2..]) {
            if is_source && (placeholder_names(&message, &name) || args_name(&args, &name)) {
                found.push(Repeat { line, field: name });
            }
        }
    }
    found
}

/// Length of `s` up to the bracket that closes one already open, skipping string literals.
fn closing(s: &str, open: char, close: char) -> Option<usize> {
    let mut depth = 0usize;
    let mut in_string = false;
    let mut escaped = false;
    for (i, c) in s.char_indices() {
        if in_string {
            match c {
                _ if escaped => escaped = false,
                '\\' => escaped = true,
                '"' => in_string = false,
                _ => {}
            }
            continue;
        }
        match c {
            '"' => in_string = true,
            c if c == open => depth += 1,
            c if c == close && depth == 0 => return Some(i),
            c if c == close => depth -= 1,
            _ => {}
        }
    }
    None
}

/// The attribute's format string (its escaped braces dropped) and the arguments after it.
fn split_message(attr: &str) -> (String, String) {
    let Some(open) = attr.find('"') else {
        return (String::new(), attr.to_owned());
    };
    let rest = &attr[open + 1..];
    let mut escaped = false;
    let end = rest
        .char_indices()
        .find(|&(_, c)| {
            let quote = c == '"' && !escaped;
            escaped = c == '\\' && !escaped;
            quote
        })
        .map_or(rest.len(), |(i, _)| i);
    let message = rest[..end].replace("{{", "").replace("}}", "");
    (message, rest[end..].to_owned())
}

/// Whether a `{name}` or `{name:…}` placeholder of `message` names the field.
fn placeholder_names(message: &str, name: &str) -> bool {
    message.split('{').skip(1).any(|p| {
        let inside = p.split('}').next().unwrap_or("");
        inside.split(':').next().unwrap_or("").trim() == name
    })
}

/// Whether the arguments after the format string use the field (`.0`, `path`, `.path`).
fn args_name(args: &str, name: &str) -> bool {
    let words = args.split(|c: char| !(c.is_alphanumeric() || c == '_' || c == '.'));
    words.flat_map(|w| w.split('.')).any(|w| w == name)
}

/// The fields of the variant or struct at the start of `decl`, each with whether it is
/// the error's source. Tuple fields are named by their index.
fn fields(decl: &str) -> Vec<(String, bool)> {
    // Comments, and attributes before the name, say nothing of the fields.
    let decl: String = decl
        .lines()
        .map(str::trim_start)
        .filter(|l| !l.starts_with("//"))
        .skip_while(|l| l.is_empty() || l.starts_with("#["))
        .collect::<Vec<_>>()
        .join("\n");
    let body_start = decl.find(['(', '{', ',', ';', '}']);
    let Some(open) = body_start.filter(|&i| matches!(&decl[i..=i], "(" | "{")) else {
        return Vec::new();
    };
    let (o, c) = if &decl[open..=open] == "(" {
        ('(', ')')
    } else {
        ('{', '}')
    };
    let inner = &decl[open + 1..];
    let body = &inner[..closing(inner, o, c).unwrap_or(inner.len())];
    split_top(body)
        .into_iter()
        .enumerate()
        .filter(|(_, f)| !f.trim().is_empty())
        .map(|(i, field)| {
            let code = field.replace('\n', " ");
            let marked = code.contains("#[source]") || code.contains("#[from]");
            let name = if o == '(' {
                i.to_string()
            } else {
                let head = code.split(':').next().unwrap_or("");
                let head = head.rsplit(']').next().unwrap_or(head);
                head.trim().trim_start_matches("pub ").trim().to_owned()
            };
            let is_source = marked || name == "source";
            (name, is_source)
        })
        .collect()
}

/// `body` split at the commas outside brackets.
fn split_top(body: &str) -> Vec<&str> {
    let mut parts = Vec::new();
    let (mut depth, mut start) = (0i32, 0);
    for (i, c) in body.char_indices() {
        match c {
            '(' | '[' | '{' | '<' => depth += 1,
            ')' | ']' | '}' | '>' => depth -= 1,
            ',' if depth == 0 => {
                parts.push(&body[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    parts.push(&body[start..]);
    parts
}

#[test]
fn no_error_message_in_src_repeats_its_source() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = Vec::new();
    rust_files(&root.join("src"), &mut files);
    rust_files(&root.join("crates/bloomgate-core/src"), &mut files);
    files.sort();
    let mut messages = 0;
    let mut found = Vec::new();
    for file in files {
        let code = std::fs::read_to_string(&file).expect("read source");
        messages += code.matches("#[error(").count();
        let shown = file
            .strip_prefix(root)
            .unwrap_or(&file)
            .display()
            .to_string();
        for r in repeats(&code) {
            found.push(format!(
                "{shown}:{}: the message names `{}`, which is the source; print it with report::Chain instead",
                r.line, r.field
            ));
        }
    }
    assert!(
        messages > 100,
        "the scan found only {messages} #[error] attributes: are src/ and crates/bloomgate-core/src/ laid out as expected?"
    );
    assert!(found.is_empty(), "{}", found.join("\n"));
}

#[test]
fn the_checker_finds_a_message_that_repeats_its_source() {
    let sample = r#"
pub enum E {
    /// Said once.
    #[error("redis")]
    Redis(#[from] redis::RedisError),
    #[error("redis: {0}")]
    Twice(#[from] redis::RedisError),
    #[error("cannot read {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot {action} {}", path.display())]
    Fine {
        action: &'static str,
        path: PathBuf,
        #[source]
        cause: std::io::Error,
    },
    #[error("{0} and {}", .1)]
    Second(String, #[source] Box<dyn Error + Send + Sync>),
    #[error("shard {0} is missing (http://x)")]
    Missing(u64),
    #[error(transparent)]
    Other(#[from] Inner),
    #[error("key = {{ segment = \"{0}\" }}")]
    Braces(String),
    // #[error("{0}")] in a comment is not an attribute.
    #[error("no database")]
    NoUrl,
}

#[error("cannot set up TLS: {0:?}")]
pub struct Tls(#[source] rustls::Error);
"#;
    let found = repeats(sample);
    let at = |line: usize, field: &str| Repeat {
        line,
        field: field.to_owned(),
    };
    assert_eq!(
        found,
        [at(6, "0"), at(8, "source"), at(21, "1"), at(34, "0")],
        "{found:?}"
    );
}
