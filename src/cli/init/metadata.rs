//! A table's columns and indexes, as both backends (`mysql`, `sqlite`) describe them to
//! the decisions in `decide`.

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
