//! What a filter's `source_query` reads, when binlog mode needs to know: one column of
//! one table, with nothing that filters the rows. Only such a scan can be followed
//! through the binary log, whose row events name a table and carry every column: a
//! `WHERE`, a join or an expression would make some changed rows count for the filter
//! and others not, and the log cannot tell which.

use std::fmt;

/// The table and key column of a source query that is a plain scan of one table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SourceTable {
    /// The schema (database) the query names; `None` for the connection's own.
    pub schema: Option<String>,
    /// The table.
    pub table: String,
    /// The key column.
    pub column: String,
}

impl fmt::Display for SourceTable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.schema {
            Some(schema) => write!(f, "{schema}.{}", self.table),
            None => write!(f, "{}", self.table),
        }
    }
}

/// Where binlog mode reads a filter's changes: the table its source query scans, and
/// the replication connection (`sync.binlog.url`, or else `database.url`), as compiled.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BinlogSource {
    /// The table and key column.
    pub table: SourceTable,
    /// The replication URL.
    pub url: String,
}

/// Why a source query is not a plain scan of one table.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "binlog mode needs source_query to be `SELECT key_column FROM table` (or \
     schema.table) and nothing more: {0}"
)]
pub struct NotAPlainScan(&'static str);

impl SourceTable {
    /// Reads `SELECT column FROM [schema.]table`, with any case of the keywords, any
    /// white space between the words, names bare or in backticks, and one optional
    /// trailing `;`.
    pub fn parse(query: &str) -> Result<SourceTable, NotAPlainScan> {
        let mut words = Words(query.trim());
        words.keyword("SELECT")?;
        let column = words
            .name()
            .ok_or(NotAPlainScan("no column name after SELECT"))?;
        words
            .keyword("FROM")
            .map_err(|_| NotAPlainScan("one column and then FROM: no list, expression or alias"))?;
        let first = words
            .name()
            .ok_or(NotAPlainScan("no table name after FROM"))?;
        let (schema, table) = if words.eat('.') {
            let table = words
                .name()
                .ok_or(NotAPlainScan("no table name after the schema"))?;
            (Some(first), table)
        } else {
            (None, first)
        };
        words.eat(';');
        if !words.0.trim_start().is_empty() {
            return Err(NotAPlainScan(
                "nothing may follow the table: no WHERE, JOIN, UNION, ORDER BY or LIMIT",
            ));
        }
        Ok(SourceTable {
            schema,
            table,
            column,
        })
    }
}

/// The rest of a query being read.
struct Words<'a>(&'a str);

impl Words<'_> {
    fn skip_space(&mut self) {
        self.0 = self.0.trim_start();
    }

    /// Takes `word` (any case) followed by white space or the end.
    fn keyword(&mut self, word: &'static str) -> Result<(), NotAPlainScan> {
        self.skip_space();
        let head = self.0.get(..word.len()).unwrap_or("");
        let after = self.0[head.len()..].chars().next();
        if head.eq_ignore_ascii_case(word) && after.is_none_or(char::is_whitespace) {
            self.0 = &self.0[word.len()..];
            Ok(())
        } else {
            Err(NotAPlainScan("the query does not read SELECT … FROM …"))
        }
    }

    /// Takes `c`, after white space, if it comes next.
    fn eat(&mut self, c: char) -> bool {
        self.skip_space();
        match self.0.strip_prefix(c) {
            Some(rest) => {
                self.0 = rest;
                true
            }
            None => false,
        }
    }

    /// A name: bare (letters, digits, `_`, `$`, not all digits) or in backticks (where
    /// two backticks stand for one).
    fn name(&mut self) -> Option<String> {
        self.skip_space();
        if let Some(rest) = self.0.strip_prefix('`') {
            let mut name = String::new();
            let mut chars = rest.char_indices();
            while let Some((i, c)) = chars.next() {
                if c != '`' {
                    name.push(c);
                    continue;
                }
                if rest[i + 1..].starts_with('`') {
                    name.push('`');
                    chars.next();
                    continue;
                }
                self.0 = &rest[i + 1..];
                return (!name.is_empty()).then_some(name);
            }
            return None;
        }
        let end = self
            .0
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == '$'))
            .unwrap_or(self.0.len());
        let name = &self.0[..end];
        if name.is_empty() || name.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        self.0 = &self.0[end..];
        Some(name.to_owned())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(schema: Option<&str>, table: &str, column: &str) -> SourceTable {
        SourceTable {
            schema: schema.map(str::to_owned),
            table: table.to_owned(),
            column: column.to_owned(),
        }
    }

    #[test]
    fn plain_scans_are_read_however_they_are_spelled() {
        for (query, expected) in [
            (
                "SELECT sku_id FROM products",
                table(None, "products", "sku_id"),
            ),
            (
                "  select\tsku_id\n from   shop.products ; ",
                table(Some("shop"), "products", "sku_id"),
            ),
            (
                "SELECT `sku id` FROM `my``shop` . `pro-ducts`",
                table(Some("my`shop"), "pro-ducts", "sku id"),
            ),
            ("SeLeCt $k FROM t1;", table(None, "t1", "$k")),
        ] {
            assert_eq!(SourceTable::parse(query), Ok(expected), "{query}");
        }
    }

    #[test]
    fn anything_but_a_plain_scan_is_refused() {
        for query in [
            "",
            "SELECT",
            "SELECT sku_id",
            "SELECT sku_id FROM",
            "SELECT sku_id, name FROM products",
            "SELECT sku_id AS k FROM products",
            "SELECT sku_id + 1 FROM products",
            "SELECT DISTINCT sku_id FROM products",
            "SELECT sku_id FROM products WHERE active = 1",
            "SELECT sku_id FROM products p",
            "SELECT sku_id FROM products JOIN stock USING (sku_id)",
            "SELECT sku_id FROM products; DELETE FROM products",
            "SELECT sku_id FROM products UNION SELECT 1",
            "SELECT sku_id FROM `products",
            "SELECT sku_id FROM ``",
            "SELECT 1 FROM products",
            "SELECTsku_id FROM products",
            "SELECT sku_id FROMproducts",
            "SELECT sku_id FROM a.b.c",
            "WITH x AS (SELECT 1) SELECT sku_id FROM products",
        ] {
            assert!(SourceTable::parse(query).is_err(), "{query:?} was accepted");
        }
    }

    #[test]
    fn a_refusal_says_what_is_wrong() {
        let e = SourceTable::parse("SELECT sku_id FROM products WHERE active").expect_err("where");
        assert!(e.to_string().contains("no WHERE"), "{e}");
    }
}
