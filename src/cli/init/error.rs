//! Why `init` wrote nothing, and the exit code each reason gives: 2 for a refusal (the
//! table cannot be gated well, or the command line is wrong), 1 for a failure.

use std::path::PathBuf;

/// Why `init` wrote nothing.
#[derive(Debug, thiserror::Error)]
pub enum InitError {
    /// Neither `--database-url` nor the variable gives the database.
    #[error("no database: pass --database-url or set BLOOMGATE__DATABASE__URL")]
    NoUrl,
    /// The database URL has no scheme this build reads.
    #[error("unsupported database URL: {0}")]
    BadUrl(String),
    /// The database URL's driver cannot read it (a bad port, an unknown option); the
    /// driver's error names the part, not the password.
    #[error("unsupported database URL")]
    UnreadableUrl(#[source] sqlx::Error),
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
    #[error("no SELECT privilege on table `{table}` (the gate reads its keys)")]
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
    #[error("cannot connect to the database")]
    Connect(#[source] sqlx::Error),
    /// A metadata query failed for another reason than the refusals above.
    #[error("reading the table's metadata failed")]
    Query(#[source] sqlx::Error),
    /// The async runtime could not start.
    #[error("cannot start the async runtime")]
    Runtime(#[source] std::io::Error),
    /// The config could not be written.
    #[error("writing {path}")]
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
            | InitError::UnreadableUrl(_)
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

#[cfg(test)]
mod tests {
    use std::error::Error;
    use std::str::FromStr;

    use bloomgate::report::Chain;
    use sqlx::mysql::MySqlConnectOptions;

    use super::*;

    /// The message says what failed; the cause is printed once, by the chain.
    fn prints_its_cause_once(e: &InitError) {
        let cause = e.source().expect("a source").to_string();
        assert!(!e.to_string().contains(&cause), "{e}");
        assert!(Chain(e).to_string().contains(&cause), "{}", Chain(e));
    }

    #[test]
    fn causes_are_sources_and_print_once() {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("no-such-dir").join("bloomgate.toml");
        let source = std::fs::write(&path, "").expect_err("no such directory");
        let write = InitError::Write { path, source };
        prints_its_cause_once(&write);
        assert!(Chain(&write).to_string().starts_with("writing "));

        let parse = MySqlConnectOptions::from_str("mysql://u@h:notaport/shop")
            .expect_err("the port is refused");
        let url = InitError::UnreadableUrl(parse);
        prints_its_cause_once(&url);
        assert!(
            Chain(&url)
                .to_string()
                .starts_with("unsupported database URL: "),
            "{}",
            Chain(&url)
        );
        assert_eq!(url.exit_code(), 2);
    }
}
