//! Everything the config is rendered from ([`Plan`]): the table as far as the config
//! needs it, the guarded route, the origin, and the filter's name and size (twice the
//! rows, or the rows and a year of recent inserts, rounded up).

use super::{InitError, KeyColumn, Route, SyncSource};

/// Rows inserted over this many recent days, scaled to a year, are the growth estimate.
pub const GROWTH_WINDOW_DAYS: u64 = 30;

/// The smallest filter `init` writes, and the step its size is rounded up to.
pub const ITEMS_STEP: u64 = 1000;

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

/// `--upstream`, when it is a plain `http://host:port` (a trailing `/` dropped).
pub(super) fn check_upstream(url: &str) -> Result<String, InitError> {
    let url = url.trim_end_matches('/');
    match url.strip_prefix("http://") {
        Some(host) if !host.is_empty() && !host.contains(['/', '?', '#', '"', '\\', ' ']) => {
            Ok(url.to_owned())
        }
        _ => Err(InitError::BadUpstream(url.to_owned())),
    }
}
