//! `bloomgate init`: reads one table's metadata and writes a short config that gates it
//! (filter, sync, route and origin). It only reads: MySQL metadata is read inside a
//! read-only transaction and SQLite files are opened read-only. It decides nothing at
//! run time; the config it writes is checked and run like any other.
//!
//! Files: `mysql.rs` and `sqlite.rs` read the metadata of each backend into a [`Table`],
//! `render.rs` turns the resulting [`Plan`] into commented TOML.

mod mysql;
mod render;
mod sqlite;

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use super::args::InitArgs;

/// How long connecting to the database may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(15);

/// Rows inserted over this many recent days, scaled to a year, are the growth estimate.
pub const GROWTH_WINDOW_DAYS: u64 = 30;

/// The smallest filter `init` writes, and the step its size is rounded up to.
pub const ITEMS_STEP: u64 = 1000;

/// Read for the database URL when `--database-url` is not given: the variable `serve`
/// reads too.
pub const URL_VAR: &str = "BLOOMGATE__DATABASE__URL";

/// Why `init` wrote nothing.
#[derive(Debug, thiserror::Error)]
pub enum InitError {
    /// Neither `--database-url` nor the variable gives the database.
    #[error("no database: pass --database-url or set BLOOMGATE__DATABASE__URL")]
    NoUrl,
    /// The database URL has no scheme this build reads, or its driver cannot parse it.
    #[error("unsupported database URL: {0}")]
    BadUrl(String),
    /// A MySQL URL without a database name: there is no schema to look the table up in.
    #[error(
        "the database URL names no database: add it to the path, e.g. mysql://user@host:3306/shop"
    )]
    NoDatabase,
    /// The table is not there.
    #[error("table `{0}` does not exist")]
    NoSuchTable(String),
    /// The key column is not in the table.
    #[error("table `{table}` has no column `{column}`")]
    NoSuchColumn {
        /// The table.
        table: String,
        /// The column asked for.
        column: String,
    },
    /// The user may not read the table.
    #[error("no SELECT privilege on table `{table}` (the gate reads its keys): {source}")]
    NoSelect {
        /// The table.
        table: String,
        /// The database's refusal.
        #[source]
        source: sqlx::Error,
    },
    /// No index starts with the key column: every origin lookup would scan the table.
    #[error(
        "column `{column}` of `{table}` is not indexed: every lookup would scan the whole table, \
         which is worse than no gate; add a unique index on it"
    )]
    NotIndexed {
        /// The table.
        table: String,
        /// The key column.
        column: String,
    },
    /// The key column is indexed but no unique index holds it alone.
    #[error(
        "column `{column}` of `{table}` is not unique (no unique index on it alone): a key must \
         name one row; add a unique index or choose another column"
    )]
    NotUnique {
        /// The table.
        table: String,
        /// The key column.
        column: String,
    },
    /// The key column's type has no normaliser.
    #[error(
        "column `{column}` is of type {declared}: keys must be integers or (var)char/(var)binary strings"
    )]
    UnsupportedKeyType {
        /// The key column.
        column: String,
        /// Its declared type.
        declared: String,
    },
    /// `--route` cannot be read.
    #[error("--route {route:?}: {reason}")]
    BadRoute {
        /// As given.
        route: String,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// The table's name cannot be a path segment, and no `--route` was given.
    #[error(
        "no route can be made from the table name `{0}` (letters, digits, '_' and '-' only): \
         pass --route, e.g. --route '/api/items/{{key}}'"
    )]
    NoDefaultRoute(String),
    /// `--upstream` is not a plain `http://host:port`.
    #[error("--upstream {0:?}: expected http://host:port")]
    BadUpstream(String),
    /// The output file is there and `--force` was not given.
    #[error("{0} exists: pass --force to overwrite it")]
    OutputExists(PathBuf),
    /// The database could not be reached (or refused the login).
    #[error("cannot connect to the database: {0}")]
    Connect(#[source] sqlx::Error),
    /// A metadata query failed for another reason than the refusals above.
    #[error("reading the table's metadata failed: {0}")]
    Query(#[source] sqlx::Error),
    /// The async runtime could not start.
    #[error("cannot start the async runtime: {0}")]
    Runtime(#[source] std::io::Error),
    /// The config could not be written.
    #[error("writing {path}: {source}")]
    Write {
        /// Where.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

impl InitError {
    /// 2 for refusals (the table cannot be gated well, or the command line is wrong),
    /// 1 for failures (the database is unreachable, a file cannot be written).
    pub fn exit_code(&self) -> u8 {
        match self {
            InitError::Connect(_)
            | InitError::Query(_)
            | InitError::Runtime(_)
            | InitError::Write { .. } => 1,
            InitError::NoUrl
            | InitError::BadUrl(_)
            | InitError::NoDatabase
            | InitError::NoSuchTable(_)
            | InitError::NoSuchColumn { .. }
            | InitError::NoSelect { .. }
            | InitError::NotIndexed { .. }
            | InitError::NotUnique { .. }
            | InitError::UnsupportedKeyType { .. }
            | InitError::BadRoute { .. }
            | InitError::NoDefaultRoute(_)
            | InitError::BadUpstream(_)
            | InitError::OutputExists(_) => 2,
        }
    }
}

/// Runs `bloomgate init`; the error, if any, is printed and becomes the exit code.
pub fn main(args: InitArgs) -> ExitCode {
    let result = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(InitError::Runtime)
        .and_then(|rt| rt.block_on(run(&args)));
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("bloomgate init: {}", chain(&e));
            ExitCode::from(e.exit_code())
        }
    }
}

/// The error and its causes, `: `-separated.
fn chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        let next = c.to_string();
        if !text.contains(&next) {
            text.push_str(": ");
            text.push_str(&next);
        }
        cause = c.source();
    }
    text
}

async fn run(args: &InitArgs) -> Result<(), InitError> {
    if let Some(path) = &args.output
        && !args.force
        && path.exists()
    {
        return Err(InitError::OutputExists(path.clone()));
    }
    let route = match &args.route {
        Some(r) => Route::parse(r)?,
        None => Route::default_for(&args.table)?,
    };
    let origin = match &args.upstream {
        Some(url) => Origin::Upstream(check_upstream(url)?),
        None => Origin::Sql,
    };
    let database_url = match &args.database_url {
        Some(url) => url.clone(),
        None => std::env::var(URL_VAR).map_err(|_| InitError::NoUrl)?,
    };
    let backend = Backend::of(&database_url)?;
    let table = match backend {
        Backend::MySql => mysql::read(&database_url, &args.table, &args.key).await?,
        Backend::Sqlite => sqlite::read(&database_url, &args.table, &args.key).await?,
    };
    let (url, password_removed) = without_password(&database_url);
    let plan = Plan {
        url,
        password_removed,
        table,
        route,
        origin,
    };
    let text = render::render(&plan);
    match &args.output {
        None => {
            let mut out = std::io::stdout().lock();
            out.write_all(text.as_bytes())
                .and_then(|()| out.flush())
                .map_err(|source| InitError::Write {
                    path: PathBuf::from("(standard output)"),
                    source,
                })
        }
        Some(path) => write_file(path, &text, args.force),
    }
}

/// Writes `text` to `path`; without `force`, only if nothing is there (checked again
/// when the file is created, so a file made meanwhile is not overwritten either).
fn write_file(path: &std::path::Path, text: &str, force: bool) -> Result<(), InitError> {
    let mut options = std::fs::OpenOptions::new();
    options.write(true);
    if force {
        options.create(true).truncate(true);
    } else {
        options.create_new(true);
    }
    let mut file = options.open(path).map_err(|source| {
        if source.kind() == std::io::ErrorKind::AlreadyExists {
            InitError::OutputExists(path.to_owned())
        } else {
            InitError::Write {
                path: path.to_owned(),
                source,
            }
        }
    })?;
    file.write_all(text.as_bytes())
        .and_then(|()| file.sync_all())
        .map_err(|source| InitError::Write {
            path: path.to_owned(),
            source,
        })?;
    eprintln!(
        "wrote {}; check it with: bloomgate check-config --config {}",
        path.display(),
        path.display()
    );
    Ok(())
}

/// Which driver reads the URL.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    /// `mysql://` or `mariadb://`.
    MySql,
    /// `sqlite:`.
    Sqlite,
}

impl Backend {
    fn of(url: &str) -> Result<Backend, InitError> {
        match url
            .split_once(':')
            .map(|(s, _)| s.to_ascii_lowercase())
            .as_deref()
        {
            Some("mysql" | "mariadb") => Ok(Backend::MySql),
            Some("sqlite") => Ok(Backend::Sqlite),
            _ => Err(InitError::BadUrl(
                "expected mysql://, mariadb:// or sqlite://".to_owned(),
            )),
        }
    }
}

/// `url` without the password of its user info, and whether there was one.
pub fn without_password(url: &str) -> (String, bool) {
    let Some((scheme, rest)) = url.split_once("://") else {
        return (url.to_owned(), false);
    };
    let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(authority_end);
    let Some((userinfo, host)) = authority.rsplit_once('@') else {
        return (url.to_owned(), false);
    };
    match userinfo.split_once(':') {
        Some((user, _password)) => (format!("{scheme}://{user}@{host}{tail}"), true),
        None => (url.to_owned(), false),
    }
}

/// What the metadata says about the table, as far as the config needs it.
#[derive(Debug, Clone)]
pub struct Table {
    /// The table's name as the database spells it.
    pub name: String,
    /// The key column.
    pub key: KeyColumn,
    /// Rows counted.
    pub rows: u64,
    /// Inserts seen over the last [`GROWTH_WINDOW_DAYS`], from a created-at column.
    pub growth: Option<Growth>,
    /// What incremental sync can follow.
    pub sync: SyncSource,
}

/// The key column and how its values are normalised.
#[derive(Debug, Clone)]
pub struct KeyColumn {
    /// Its name as the database spells it.
    pub name: String,
    /// Its declared type, for the comment.
    pub declared: String,
    /// Integer or string.
    pub kind: KeyKind,
}

/// The normaliser a key column calls for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeyKind {
    /// An integer type.
    Integer,
    /// A character or binary string type.
    String {
        /// Longest value in bytes.
        max_len: usize,
        /// Compared ignoring case (a `_ci` or NOCASE collation): keys are lowercased.
        lowercase: bool,
        /// The collation, for the comment.
        collation: Option<String>,
    },
}

/// Rows created recently, from a created-at column.
#[derive(Debug, Clone)]
pub struct Growth {
    /// The column.
    pub column: String,
    /// Rows it dates within the last [`GROWTH_WINDOW_DAYS`].
    pub recent: u64,
}

impl Growth {
    /// Rows a year of inserts at the recent rate adds.
    pub fn per_year(&self) -> u64 {
        self.recent.saturating_mul(365).div_ceil(GROWTH_WINDOW_DAYS)
    }
}

/// What incremental sync follows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SyncSource {
    /// An indexed TIMESTAMP/DATETIME column set on every write.
    Timestamp {
        /// The column.
        column: String,
        /// Its declared type.
        declared: String,
    },
    /// The key itself, an auto-increment integer.
    AutoIncrement,
    /// Nothing: full rebuilds only.
    None,
}

/// Everything the config is rendered from.
#[derive(Debug, Clone)]
pub struct Plan {
    /// The database URL, without its password.
    pub url: String,
    /// The URL given had a password, which the file does not hold.
    pub password_removed: bool,
    /// The table.
    pub table: Table,
    /// The guarded route.
    pub route: Route,
    /// Where found keys are fetched.
    pub origin: Origin,
}

impl Plan {
    /// The filter's (and route's) name: the table's, with anything but letters, digits,
    /// `_` and `-` replaced by `_`.
    pub fn filter_name(&self) -> String {
        self.table
            .name
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || c == '-' {
                    c
                } else {
                    '_'
                }
            })
            .collect()
    }

    /// `expected_items`: the larger of twice the rows, and the rows plus a year of
    /// inserts at the recent rate; at least [`ITEMS_STEP`], rounded up to a multiple of it.
    pub fn expected_items(&self) -> u64 {
        let rows = self.table.rows;
        let grown = rows.saturating_add(self.table.growth.as_ref().map_or(0, Growth::per_year));
        let n = rows.saturating_mul(2).max(grown).max(ITEMS_STEP);
        n.div_ceil(ITEMS_STEP).saturating_mul(ITEMS_STEP)
    }
}

/// Where a found key is fetched.
#[derive(Debug, Clone)]
pub enum Origin {
    /// The table itself, by its key.
    Sql,
    /// An HTTP API: its base URL.
    Upstream(String),
}

fn check_upstream(url: &str) -> Result<String, InitError> {
    let url = url.trim_end_matches('/');
    match url.strip_prefix("http://") {
        Some(host) if !host.is_empty() && !host.contains(['/', '?', '#', '"', '\\', ' ']) => {
            Ok(url.to_owned())
        }
        _ => Err(InitError::BadUpstream(url.to_owned())),
    }
}

/// The guarded route: its path pattern and where the key is in it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Route {
    /// `/api/products/{key}` or `/api/product/info`.
    pub path: String,
    /// Where the key is.
    pub key: RouteKey,
}

/// Where a request carries the key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RouteKey {
    /// The `{name}` segment of the path.
    Segment(String),
    /// The query parameter of this name.
    Query(String),
}

impl Route {
    /// `/api/items/{key}` (a path segment) or `/api/item?id={key}` (a query parameter).
    pub fn parse(route: &str) -> Result<Route, InitError> {
        let bad = |reason| InitError::BadRoute {
            route: route.to_owned(),
            reason,
        };
        if !route.starts_with('/') {
            return Err(bad("must start with /"));
        }
        if route.contains(['"', '\\', ' ', '#']) {
            return Err(bad("must not contain quotes, backslashes, spaces or #"));
        }
        if let Some((path, query)) = route.split_once('?') {
            let param = query
                .strip_suffix("={key}")
                .filter(|p| !p.is_empty() && !p.contains(['&', '=', '{', '}']))
                .ok_or_else(|| bad("the query must be exactly NAME={key}"))?;
            if path.contains(['{', '}']) {
                return Err(bad(
                    "the key is either in the path or in the query, not both",
                ));
            }
            return Ok(Route {
                path: path.to_owned(),
                key: RouteKey::Query(param.to_owned()),
            });
        }
        let params: Vec<&str> = route
            .split('/')
            .filter(|s| s.contains(['{', '}']))
            .collect();
        match params.as_slice() {
            [seg] => {
                let name = seg
                    .strip_prefix('{')
                    .and_then(|s| s.strip_suffix('}'))
                    .filter(|n| !n.is_empty() && !n.contains(['{', '}']))
                    .ok_or_else(|| bad("a {param} must be a whole path segment"))?;
                Ok(Route {
                    path: route.to_owned(),
                    key: RouteKey::Segment(name.to_owned()),
                })
            }
            [] => Err(bad(
                "needs {key} in a path segment or as NAME={key} in the query",
            )),
            _ => Err(bad("has more than one {param} segment")),
        }
    }

    /// `/api/<table>/{key}`, when the table's name can be a path segment as it is.
    pub fn default_for(table: &str) -> Result<Route, InitError> {
        let plain = !table.is_empty()
            && table
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
        if !plain {
            return Err(InitError::NoDefaultRoute(table.to_owned()));
        }
        Ok(Route {
            path: format!("/api/{table}/{{key}}"),
            key: RouteKey::Segment("key".to_owned()),
        })
    }
}

/// A column as both backends describe it.
#[derive(Debug, Clone)]
pub struct Column {
    /// Its name.
    pub name: String,
    /// Its declared type, as the database spells it (`bigint(20) unsigned`, `VARCHAR(32)`).
    pub declared: String,
    /// What the type is, for `init`'s purposes.
    pub class: ColumnClass,
    /// Given by the database on insert (MySQL AUTO_INCREMENT, SQLite INTEGER PRIMARY KEY).
    pub auto_increment: bool,
}

/// What a column's type is, for `init`'s purposes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ColumnClass {
    /// An integer type.
    Integer,
    /// A character or binary string.
    String {
        /// Longest value in bytes, when the type bounds it.
        max_bytes: Option<u64>,
        /// Its collation, when it has one.
        collation: Option<String>,
        /// The collation ignores case.
        case_insensitive: bool,
    },
    /// A date and time (TIMESTAMP, DATETIME).
    Timestamp,
    /// Anything else.
    Other,
}

/// An index: its columns in order, and whether it is unique. Partial indexes are left
/// out by the backends (they do not cover every row).
#[derive(Debug, Clone)]
pub struct Index {
    /// Column names, in index order.
    pub columns: Vec<String>,
    /// A unique index.
    pub unique: bool,
}

/// Names of columns set on every update, in order of preference.
const UPDATED_NAMES: &[&str] = &[
    "updated_at",
    "modified_at",
    "last_modified",
    "last_modified_at",
    "last_updated",
    "updated_on",
    "modified_on",
    "update_time",
    "updated",
    "modified",
    "changed_at",
];

/// Names of columns set once on insert, in order of preference.
const CREATED_NAMES: &[&str] = &[
    "created_at",
    "inserted_at",
    "created_on",
    "create_time",
    "creation_time",
    "date_created",
    "created",
];

/// The column called `name` (MySQL and SQLite compare column names ignoring case).
fn find<'a>(columns: &'a [Column], name: &str) -> Option<&'a Column> {
    columns.iter().find(|c| c.name.eq_ignore_ascii_case(name))
}

/// Whether some index starts with `column` (so a lookup or range on it uses the index).
fn leads_an_index(indexes: &[Index], column: &str) -> bool {
    indexes.iter().any(|i| {
        i.columns
            .first()
            .is_some_and(|c| c.eq_ignore_ascii_case(column))
    })
}

/// The key column, refused unless it is unique on its own and of a type with a
/// normaliser. The backend has already checked that it exists.
pub fn key_column(
    table: &str,
    columns: &[Column],
    indexes: &[Index],
    key: &str,
) -> Result<KeyColumn, InitError> {
    let column = find(columns, key).ok_or_else(|| InitError::NoSuchColumn {
        table: table.to_owned(),
        column: key.to_owned(),
    })?;
    let name = column.name.clone();
    if !leads_an_index(indexes, &name) {
        return Err(InitError::NotIndexed {
            table: table.to_owned(),
            column: name,
        });
    }
    let unique = indexes
        .iter()
        .any(|i| i.unique && i.columns.len() == 1 && i.columns[0].eq_ignore_ascii_case(&name));
    if !unique {
        return Err(InitError::NotUnique {
            table: table.to_owned(),
            column: name,
        });
    }
    let kind = match &column.class {
        ColumnClass::Integer => KeyKind::Integer,
        ColumnClass::String {
            max_bytes,
            collation,
            case_insensitive,
        } => KeyKind::String {
            max_len: max_bytes.map_or(DEFAULT_STRING_BYTES, |b| {
                usize::try_from(b)
                    .unwrap_or(MAX_KEY_BYTES)
                    .clamp(1, MAX_KEY_BYTES)
            }),
            lowercase: *case_insensitive,
            collation: collation.clone(),
        },
        ColumnClass::Timestamp | ColumnClass::Other => {
            return Err(InitError::UnsupportedKeyType {
                column: name,
                declared: column.declared.clone(),
            });
        }
    };
    Ok(KeyColumn {
        name,
        declared: column.declared.clone(),
        kind,
    })
}

/// The longest `max_len` the config accepts.
pub const MAX_KEY_BYTES: usize = 4096;

/// `max_len` of a string key whose type sets no bound.
pub const DEFAULT_STRING_BYTES: usize = 255;

/// What sync can follow: an indexed updated-at column, else an auto-increment key, else
/// nothing.
pub fn sync_source(columns: &[Column], indexes: &[Index], key: &KeyColumn) -> SyncSource {
    let updated = UPDATED_NAMES.iter().find_map(|name| {
        find(columns, name)
            .filter(|c| c.class == ColumnClass::Timestamp && leads_an_index(indexes, &c.name))
    });
    if let Some(c) = updated {
        return SyncSource::Timestamp {
            column: c.name.clone(),
            declared: c.declared.clone(),
        };
    }
    let auto = find(columns, &key.name).is_some_and(|c| c.auto_increment);
    if auto && key.kind == KeyKind::Integer {
        SyncSource::AutoIncrement
    } else {
        SyncSource::None
    }
}

/// The created-at column that dates inserts, if there is one.
pub fn created_column(columns: &[Column]) -> Option<&Column> {
    CREATED_NAMES
        .iter()
        .find_map(|name| find(columns, name).filter(|c| c.class == ColumnClass::Timestamp))
}

#[cfg(test)]
mod tests;
