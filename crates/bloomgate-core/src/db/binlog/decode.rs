//! The pure parts of reading a binary log: log file names, MariaDB GTIDs, a key from a
//! row value as a scan of the table would render it, and whether a statement changes
//! the source table's rows without row events (`TRUNCATE`, `DROP`, `ALTER`, `RENAME`).

use std::borrow::Cow;

use mysql_async::Value;
use mysql_async::binlog::value::BinlogValue;

use super::{KeyColumn, KeyKind, MAX_FILE};
use crate::watermark::Gtid;

/// `binlog.000042` as (`binlog`, 42); `None` unless the name ends with `.` and digits.
pub fn split_file_name(name: &str) -> Option<(&str, u32)> {
    let (base, digits) = name.rsplit_once('.')?;
    if base.is_empty() || digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let index: u32 = digits.parse().ok()?;
    (index <= MAX_FILE).then_some((base, index))
}

/// The file number a rotate event names, in a log whose files are `base.NNNNNN`. The
/// first rotate event of a stream comes before the server has said whether events end
/// with a checksum, and its name may carry the checksum's 4 bytes: a name that reads
/// as `base.` and at least six digits without them is taken so.
pub fn rotated_file(raw: &[u8], base: &str) -> Option<u32> {
    let read = |bytes: &[u8]| {
        let name = std::str::from_utf8(bytes).ok()?;
        let (b, index) = split_file_name(name)?;
        let digits = name.len() - b.len() - 1;
        (b == base && digits >= 6).then_some(index)
    };
    raw.len()
        .checked_sub(4)
        .and_then(|n| read(&raw[..n]))
        .or_else(|| read(raw))
}

/// The one GTID of a MariaDB GTID position (`0-1-42`); `None` for an empty position or
/// one of several domains.
pub fn single_gtid(position: &str) -> Option<Gtid> {
    let position = position.trim();
    if position.contains(',') {
        return None;
    }
    position.parse().ok()
}

/// The GTID a MariaDB GTID event (type 162) announces: its body starts with the
/// sequence number (8 bytes) and the domain (4 bytes); the server is the event's.
pub fn mariadb_gtid(body: &[u8], server: u32) -> Option<Gtid> {
    let seq = u64::from_le_bytes(body.get(..8)?.try_into().ok()?);
    let domain = u32::from_le_bytes(body.get(8..12)?.try_into().ok()?);
    Some(Gtid {
        domain,
        server,
        seq,
    })
}

/// How a key column of `data_type` (`COLUMN_TYPE` and character set beside it) is
/// stored; `None` for a type binlog mode does not read.
pub fn key_kind(data_type: &str, column_type: &str, charset: Option<&str>) -> Option<KeyKind> {
    let width = match data_type {
        "tinyint" => Some(1),
        "smallint" => Some(2),
        "mediumint" => Some(3),
        "int" | "integer" => Some(4),
        "bigint" => Some(8),
        _ => None,
    };
    if let Some(width) = width {
        return Some(if column_type.contains("unsigned") {
            KeyKind::Unsigned(width)
        } else {
            KeyKind::Signed(width)
        });
    }
    let text = matches!(
        data_type,
        "char" | "varchar" | "tinytext" | "text" | "mediumtext" | "longtext"
    );
    let utf8 = charset.is_some_and(|c| c.starts_with("utf8") || c == "ascii");
    (text && utf8).then_some(KeyKind::Text)
}

/// Why a row's key could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KeyValueError {
    /// The row has fewer columns than the key's position.
    #[error("the row has no column {0}")]
    Missing(usize),
    /// A value of another type than the column's.
    #[error("the key column holds a value of another type")]
    Type,
    /// Text that is not UTF-8.
    #[error("the key is not UTF-8")]
    NotUtf8,
}

/// The key of a row value, rendered as a scan of the table renders it (integers in
/// decimal, text as stored); `None` for NULL. Integers are written into `buf`.
pub fn key_text<'a>(
    value: Option<&'a BinlogValue<'_>>,
    kind: KeyKind,
    buf: &'a mut String,
) -> Result<Option<Cow<'a, str>>, KeyValueError> {
    use std::fmt::Write as _;
    let value = match value {
        Some(BinlogValue::Value(v)) => v,
        Some(_) => return Err(KeyValueError::Type),
        None => return Ok(None),
    };
    buf.clear();
    match (value, kind) {
        (Value::NULL, _) => return Ok(None),
        (Value::Int(v), KeyKind::Signed(_)) => {
            let _ = write!(buf, "{v}");
        }
        (Value::Int(v), KeyKind::Unsigned(bytes)) => {
            // The log carries the stored bits, read as a signed number of the column's
            // width and widened with its sign: keep the width's bits only.
            let bits = u32::from(bytes) * 8;
            let mask = if bits >= 64 {
                u64::MAX
            } else {
                (1u64 << bits) - 1
            };
            let _ = write!(buf, "{}", (*v as u64) & mask);
        }
        (Value::UInt(v), KeyKind::Signed(_) | KeyKind::Unsigned(_)) => {
            let _ = write!(buf, "{v}");
        }
        (Value::Bytes(b), KeyKind::Text) => {
            return std::str::from_utf8(b)
                .map(|s| Some(Cow::Borrowed(s)))
                .map_err(|_| KeyValueError::NotUtf8);
        }
        _ => return Err(KeyValueError::Type),
    }
    Ok(Some(Cow::Borrowed(buf.as_str())))
}

/// Whether `statement`, run with `schema` as the default database, changes the rows or
/// the shape of `key`'s table without row events: a `TRUNCATE`, `DROP`, `ALTER` or
/// `RENAME` of it (or `CREATE OR REPLACE` over it). Errs on the side of yes: a rebuild
/// more costs a scan, a change missed costs a false negative.
pub fn changes_table(statement: &str, schema: &str, key: &KeyColumn) -> bool {
    let text = without_comments(statement)
        .to_ascii_lowercase()
        .replace('`', "");
    let words: Vec<&str> = text.split_whitespace().collect();
    let ddl = matches!(
        words.as_slice(),
        ["truncate", ..]
            | ["rename", "table", ..]
            | ["alter", ..]
            | ["drop", "table" | "database" | "schema", ..]
            | ["create", "or", "replace", ..]
    );
    if !ddl {
        return false;
    }
    let table = key.table.to_ascii_lowercase();
    let ours = key.schema.to_ascii_lowercase();
    if matches!(words.as_slice(), ["drop", "database" | "schema", ..]) {
        return names(&text, &ours, None);
    }
    let default_is_ours = schema.eq_ignore_ascii_case(&key.schema);
    names(&text, &table, Some((&ours, default_is_ours)))
}

/// Whether `text` names `name` on its own (not as part of a longer name). With
/// `schema`, a name after `other.` counts only when `other` is the schema, and a bare
/// one only when the schema is the default (`.1`).
fn names(text: &str, name: &str, schema: Option<(&str, bool)>) -> bool {
    let ident = |c: char| c.is_ascii_alphanumeric() || c == '_' || c == '$';
    let mut from = 0;
    while let Some(i) = text[from..].find(name) {
        let at = from + i;
        let end = at + name.len();
        from = at + 1;
        let before = text[..at].chars().next_back();
        let after = text[end..].chars().next();
        if before.is_some_and(ident) || after.is_some_and(ident) {
            continue;
        }
        match (schema, before) {
            (None, _) => return true,
            (Some((ours, _)), Some('.')) => {
                let qualifier = text[..at - 1]
                    .rsplit(|c: char| !ident(c))
                    .next()
                    .unwrap_or("");
                if qualifier == ours {
                    return true;
                }
            }
            (Some((_, default_is_ours)), _) => {
                if default_is_ours {
                    return true;
                }
            }
        }
    }
    false
}

/// `statement` without `/* … */` comments (which MySQL writes around some DDL) and
/// with `-- ` and `#` line comments dropped.
fn without_comments(statement: &str) -> String {
    let mut out = String::with_capacity(statement.len());
    let mut rest = statement;
    while let Some(start) = rest.find("/*") {
        out.push_str(&rest[..start]);
        out.push(' ');
        rest = match rest[start + 2..].find("*/") {
            Some(end) => &rest[start + 2 + end + 2..],
            None => "",
        };
    }
    out.push_str(rest);
    out.lines()
        .map(|l| {
            let l = l.split("-- ").next().unwrap_or("");
            l.split('#').next().unwrap_or("")
        })
        .collect::<Vec<_>>()
        .join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn products() -> KeyColumn {
        KeyColumn {
            schema: "shop".into(),
            table: "products".into(),
            column: "sku_id".into(),
            index: 0,
            columns: 4,
            kind: KeyKind::Unsigned(8),
        }
    }

    #[test]
    fn file_names_split_into_base_and_number() {
        assert_eq!(split_file_name("binlog.000042"), Some(("binlog", 42)));
        assert_eq!(
            split_file_name("my.host-bin.1234567"),
            Some(("my.host-bin", 1_234_567))
        );
        for bad in [
            "",
            "binlog",
            "binlog.",
            ".000001",
            "binlog.00a1",
            "binlog.99999999999",
        ] {
            assert_eq!(split_file_name(bad), None, "{bad}");
        }
        assert_eq!(
            rotated_file(b"binlog.000001F\x9d\xfe\x01", "binlog"),
            Some(1)
        );
        // A checksum of four digits still leaves six digits behind.
        assert_eq!(rotated_file(b"binlog.0000071234", "binlog"), Some(7));
        assert_eq!(rotated_file(b"binlog.000002", "binlog"), Some(2));
        assert_eq!(rotated_file(b"binlog.1000000", "binlog"), Some(1_000_000));
        assert_eq!(rotated_file(b"other.000002", "binlog"), None);
        assert_eq!(rotated_file(b"bin", "binlog"), None);
    }

    #[test]
    fn a_gtid_position_of_one_domain_is_kept() {
        assert_eq!(
            single_gtid(" 0-1-42 "),
            Some(Gtid {
                domain: 0,
                server: 1,
                seq: 42
            })
        );
        assert_eq!(single_gtid(""), None);
        assert_eq!(single_gtid("0-1-42,1-2-7"), None);
        let body = [5, 0, 0, 0, 0, 0, 0, 0, 2, 0, 0, 0, 12, 0, 0, 0, 0, 0, 0];
        assert_eq!(
            mariadb_gtid(&body, 9),
            Some(Gtid {
                domain: 2,
                server: 9,
                seq: 5
            })
        );
        assert_eq!(mariadb_gtid(&body[..11], 9), None);
    }

    #[test]
    fn key_types_are_read_or_refused() {
        assert_eq!(
            key_kind("bigint", "bigint(20) unsigned", None),
            Some(KeyKind::Unsigned(8))
        );
        assert_eq!(key_kind("int", "int(11)", None), Some(KeyKind::Signed(4)));
        assert_eq!(
            key_kind("mediumint", "mediumint(8) unsigned", None),
            Some(KeyKind::Unsigned(3))
        );
        assert_eq!(
            key_kind("varchar", "varchar(64)", Some("utf8mb4")),
            Some(KeyKind::Text)
        );
        assert_eq!(
            key_kind("char", "char(8)", Some("ascii")),
            Some(KeyKind::Text)
        );
        assert_eq!(key_kind("varchar", "varchar(64)", Some("latin1")), None);
        assert_eq!(key_kind("varbinary", "varbinary(16)", None), None);
        assert_eq!(key_kind("decimal", "decimal(10,0)", None), None);
        assert_eq!(key_kind("datetime", "datetime", None), None);
    }

    fn key(value: Value, kind: KeyKind) -> Result<Option<String>, KeyValueError> {
        let v = BinlogValue::Value(value);
        let mut buf = String::new();
        key_text(Some(&v), kind, &mut buf).map(|k| k.map(Cow::into_owned))
    }

    #[test]
    fn unsigned_keys_keep_their_width() {
        assert_eq!(
            key(Value::Int(-1), KeyKind::Unsigned(8)),
            Ok(Some(u64::MAX.to_string()))
        );
        assert_eq!(
            key(Value::Int(-1), KeyKind::Unsigned(4)),
            Ok(Some(u32::MAX.to_string()))
        );
        assert_eq!(
            key(Value::Int(-1), KeyKind::Unsigned(3)),
            Ok(Some("16777215".into()))
        );
        assert_eq!(
            key(Value::Int(-128), KeyKind::Unsigned(1)),
            Ok(Some("128".into()))
        );
        assert_eq!(
            key(Value::Int(-5), KeyKind::Signed(4)),
            Ok(Some("-5".into()))
        );
        assert_eq!(
            key(Value::UInt(7), KeyKind::Unsigned(8)),
            Ok(Some("7".into()))
        );
        assert_eq!(key(Value::NULL, KeyKind::Signed(8)), Ok(None));
        assert_eq!(
            key(Value::Bytes(b"sku-1".to_vec()), KeyKind::Text),
            Ok(Some("sku-1".into()))
        );
        assert_eq!(
            key(Value::Bytes(vec![0xff]), KeyKind::Text),
            Err(KeyValueError::NotUtf8)
        );
        assert_eq!(
            key(Value::Bytes(b"7".to_vec()), KeyKind::Signed(8)),
            Err(KeyValueError::Type)
        );
    }

    #[test]
    fn statements_that_change_the_table_without_rows_are_seen() {
        let k = products();
        for (statement, schema) in [
            ("TRUNCATE products", "shop"),
            ("truncate table `shop`.`products`", "other"),
            (
                "/* ApplicationName=x */ ALTER TABLE products ADD COLUMN x INT",
                "shop",
            ),
            (
                "DROP TABLE IF EXISTS `products` /* generated by server */",
                "shop",
            ),
            (
                "RENAME TABLE products TO old_products, new_products TO products",
                "shop",
            ),
            ("DROP DATABASE shop", "other"),
            ("CREATE OR REPLACE TABLE products (sku_id INT)", "shop"),
        ] {
            assert!(
                changes_table(statement, schema, &k),
                "{statement} in {schema}"
            );
        }
        for (statement, schema) in [
            ("BEGIN", "shop"),
            ("COMMIT", "shop"),
            ("TRUNCATE products", "other"),
            ("TRUNCATE other.products", "shop"),
            ("ALTER TABLE stock ADD COLUMN products INT", "other"),
            ("INSERT INTO products VALUES (1)", "shop"),
            ("DROP TABLE products_archive", "shop"),
            ("DROP DATABASE warehouse", "shop"),
        ] {
            assert!(
                !changes_table(statement, schema, &k),
                "{statement} in {schema}"
            );
        }
    }
}
