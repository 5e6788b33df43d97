//! `bloomgate init`: reads one table's metadata and writes a short config that gates it
//! (filter, sync, route and origin). It only reads: MySQL metadata is read inside a
//! read-only transaction and SQLite files are opened read-only. It decides nothing at
//! run time; the config it writes is checked and run like any other.
//!
//! Files: `mysql.rs` and `sqlite.rs` read the metadata of each backend (`metadata.rs`),
//! `decide.rs` takes the key column, its normaliser and the sync source from it into a
//! [`Table`], `plan.rs` sizes the filter and holds the resulting [`Plan`] with the route
//! (`route.rs`) and origin, `render.rs` turns that plan into commented TOML; `error.rs`
//! lists why nothing was written. This file is the command itself.

mod decide;
mod error;
mod metadata;
mod mysql;
mod plan;
mod render;
mod route;
mod sqlite;

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use bloomgate::report::Chain;

use super::args::InitArgs;

pub use decide::{
    DEFAULT_STRING_BYTES, KeyColumn, KeyKind, SyncSource, created_column, key_column, sync_source,
};
pub use error::InitError;
pub use metadata::{Column, ColumnClass, Index};
pub use plan::{GROWTH_WINDOW_DAYS, Growth, ITEMS_STEP, Origin, Plan, Table};
pub use route::{Route, RouteKey};

use plan::check_upstream;

/// How long connecting to the database may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(15);

/// Read for the database URL when `--database-url` is not given: the variable `serve`
/// reads too.
pub const URL_VAR: &str = "BLOOMGATE__DATABASE__URL";

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
            eprintln!("bloomgate init: {}", Chain(&e));
            ExitCode::from(e.exit_code())
        }
    }
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

#[cfg(test)]
mod tests;
