//! What `init` decides from the metadata: the key column (it must be unique on its own
//! and of a type with a normaliser) and its normaliser, what incremental sync follows,
//! and which column dates inserts for the growth estimate.

use super::{Column, ColumnClass, Index, InitError};

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
