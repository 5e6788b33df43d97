//! How values leave the database: a row as a JSON object, a first column as a key string.
//!
//! MySQL types are fixed per column, so they are read from the column's type info.
//! SQLite is dynamically typed, so each value is rendered by the type it is stored as,
//! with the column's declared type consulted only for BOOLEAN and DATETIME/TIMESTAMP.
//! The rules are listed on [`super::Db::lookup`].

use std::fmt::Write as _;

use serde_json::{Map, Number, Value};
use sqlx::error::BoxDynError;
use sqlx::mysql::types::MySqlTime;
use sqlx::mysql::{MySql, MySqlRow, MySqlValueRef};
use sqlx::sqlite::{Sqlite, SqliteRow, SqliteValueRef};
use sqlx::types::Decimal;
use sqlx::types::chrono::{DateTime, FixedOffset, NaiveDate, NaiveDateTime, Utc};
use sqlx::{Column, Decode, Row, Type, TypeInfo, ValueRef};

/// `2026-12-02T09:10:11.5Z`: fractional digits only when there are any.
const UTC_FORMAT: &str = "%Y-%m-%dT%H:%M:%S%.fZ";
/// The same without a zone, for MySQL DATETIME, which has none.
const NAIVE_FORMAT: &str = "%Y-%m-%dT%H:%M:%S%.f";

/// One MySQL row as a JSON object keyed by column name.
pub(super) fn mysql_row(row: &MySqlRow) -> Result<Map<String, Value>, sqlx::Error> {
    let mut object = Map::with_capacity(row.columns().len());
    for (i, column) in row.columns().iter().enumerate() {
        let value = mysql_value(row.try_get_raw(i)?).map_err(|e| decode_error(column.name(), e))?;
        object.insert(column.name().to_owned(), value);
    }
    Ok(object)
}

/// One SQLite row as a JSON object keyed by column name.
pub(super) fn sqlite_row(row: &SqliteRow) -> Result<Map<String, Value>, sqlx::Error> {
    let mut object = Map::with_capacity(row.columns().len());
    for (i, column) in row.columns().iter().enumerate() {
        let declared = column.type_info().name();
        let value = sqlite_value(row, i, declared).map_err(|e| decode_error(column.name(), e))?;
        object.insert(column.name().to_owned(), value);
    }
    Ok(object)
}

fn decode_error(column: &str, source: BoxDynError) -> sqlx::Error {
    sqlx::Error::ColumnDecode {
        index: format!("{column:?}"),
        source,
    }
}

fn mysql_value(value: MySqlValueRef<'_>) -> Result<Value, BoxDynError> {
    if value.is_null() {
        return Ok(Value::Null);
    }
    let ty = value.type_info().into_owned();
    Ok(match ty.name() {
        // TINYINT(1): MySQL's BOOLEAN.
        "BOOLEAN" => Value::Bool(<i64 as Decode<MySql>>::decode(value)? != 0),
        "TINYINT" | "SMALLINT" | "MEDIUMINT" | "INT" | "BIGINT" => {
            Value::from(<i64 as Decode<MySql>>::decode(value)?)
        }
        name if name.ends_with(" UNSIGNED") || name == "YEAR" || name == "BIT" => {
            Value::from(<u64 as Decode<MySql>>::decode(value)?)
        }
        // Through f32's shortest form, so FLOAT 1.1 is 1.1 and not 1.100000023841858.
        "FLOAT" => float(
            <f32 as Decode<MySql>>::decode(value)?
                .to_string()
                .parse::<f64>()?,
        ),
        "DOUBLE" => float(<f64 as Decode<MySql>>::decode(value)?),
        // Sent as text on the wire; rendered from that text, so nothing is lost.
        "DECIMAL" => decimal(<&str as Decode<MySql>>::decode(value)?),
        // Zero dates ("0000-00-00") and other dates chrono cannot hold become null.
        "DATE" => <NaiveDate as Decode<MySql>>::decode(value).map_or(Value::Null, |d| {
            Value::String(d.format("%Y-%m-%d").to_string())
        }),
        "DATETIME" => <NaiveDateTime as Decode<MySql>>::decode(value).map_or(Value::Null, |t| {
            Value::String(t.format(NAIVE_FORMAT).to_string())
        }),
        "TIMESTAMP" => <NaiveDateTime as Decode<MySql>>::decode(value).map_or(Value::Null, |t| {
            Value::String(t.and_utc().format(UTC_FORMAT).to_string())
        }),
        "TIME" => Value::String(time_of(<MySqlTime as Decode<MySql>>::decode(value)?)),
        "JSON" => {
            let text = <&str as Decode<MySql>>::decode(value)?;
            serde_json::from_str(text).unwrap_or_else(|_| Value::String(text.to_owned()))
        }
        "NULL" => Value::Null,
        // What is left is text of some kind (CHAR, VARCHAR, TEXT, ENUM, SET) or bytes
        // (BINARY, VARBINARY, BLOB, GEOMETRY); the collation tells them apart.
        _ if <&str as Type<MySql>>::compatible(&ty) => {
            Value::String(<&str as Decode<MySql>>::decode(value)?.to_owned())
        }
        _ => Value::String(
            String::from_utf8_lossy(<&[u8] as Decode<MySql>>::decode(value)?).into_owned(),
        ),
    })
}

fn sqlite_value(row: &SqliteRow, i: usize, declared: &str) -> Result<Value, BoxDynError> {
    let value = row.try_get_raw(i)?;
    // Looked at once, before any decoding: SQLite may convert a value in place when it
    // is read as another type.
    let stored = stored_type(&value);
    Ok(match (stored, declared) {
        ("NULL", _) => Value::Null,
        ("INTEGER", "BOOLEAN") => Value::Bool(<i64 as Decode<Sqlite>>::decode(value)? != 0),
        ("INTEGER" | "TEXT", "DATETIME") => {
            match <DateTime<FixedOffset> as Decode<Sqlite>>::decode(value) {
                Ok(t) => Value::String(t.with_timezone(&Utc).format(UTC_FORMAT).to_string()),
                // Not a date after all: render what is stored.
                Err(_) => sqlite_plain(row.try_get_raw(i)?, stored)?,
            }
        }
        _ => sqlite_plain(value, stored)?,
    })
}

/// The storage class of an SQLite value: NULL, INTEGER, REAL, TEXT or BLOB.
fn stored_type(value: &SqliteValueRef<'_>) -> &'static str {
    // For NULL, `type_info()` falls back to the declared type; ask first.
    if value.is_null() {
        return "NULL";
    }
    match value.type_info().name() {
        "INTEGER" => "INTEGER",
        "REAL" => "REAL",
        "TEXT" => "TEXT",
        "BLOB" => "BLOB",
        _ => "NULL",
    }
}

/// An SQLite value by its stored type alone.
fn sqlite_plain(value: SqliteValueRef<'_>, stored: &str) -> Result<Value, BoxDynError> {
    Ok(match stored {
        "INTEGER" => Value::from(<i64 as Decode<Sqlite>>::decode(value)?),
        "REAL" => float(<f64 as Decode<Sqlite>>::decode(value)?),
        "TEXT" => Value::String(<&str as Decode<Sqlite>>::decode(value)?.to_owned()),
        "BLOB" => Value::String(
            String::from_utf8_lossy(<&[u8] as Decode<Sqlite>>::decode(value)?).into_owned(),
        ),
        _ => Value::Null,
    })
}

/// Non-finite floats (possible in SQLite) have no JSON form and become null.
fn float(f: f64) -> Value {
    Number::from_f64(f).map_or(Value::Null, Value::Number)
}

/// A DECIMAL as a JSON number when that loses nothing: an integer when it is whole
/// (100.00 → 100), else the shortest f64 if it reads back as exactly the same decimal
/// (19.99). Otherwise the exact decimal text as a string ("0.1000000000000000000000001").
fn decimal(text: &str) -> Value {
    let Ok(exact) = Decimal::from_str_exact(text) else {
        return Value::String(text.to_owned());
    };
    if exact.fract().is_zero() {
        let whole = exact.trunc().to_string();
        if let Ok(n) = whole.parse::<i64>() {
            return Value::from(n);
        }
        if let Ok(n) = whole.parse::<u64>() {
            return Value::from(n);
        }
    }
    if let Ok(f) = text.parse::<f64>()
        && let Some(number) = Number::from_f64(f)
        && Decimal::from_str_exact(&f.to_string()).is_ok_and(|back| back == exact)
    {
        return Value::Number(number);
    }
    Value::String(text.to_owned())
}

/// MySQL TIME is a duration (up to ±838:59:59), not a time of day: `[-]HH:MM:SS[.ffffff]`.
fn time_of(t: MySqlTime) -> String {
    // Not `t.is_negative()`: in sqlx 0.9.0 it returns the opposite.
    let sign = if t.sign().is_negative() { "-" } else { "" };
    let mut out = format!(
        "{sign}{:02}:{:02}:{:02}",
        t.hours(),
        t.minutes(),
        t.seconds()
    );
    if t.microseconds() != 0 {
        let _ = write!(out, ".{:06}", t.microseconds());
    }
    out
}

/// How a MySQL key column is read; the same for every row of a result, so chosen once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum MySqlKeyKind {
    /// Signed integer types.
    Signed,
    /// Unsigned integer types, YEAR and BIT.
    Unsigned,
    /// Text of any kind, and DECIMAL (sent as text): used as sent.
    Text,
    /// Anything else: rendered as in a lookup, then taken as a string.
    Other,
}

impl MySqlKeyKind {
    /// The kind of the row's first column.
    pub(super) fn of(row: &MySqlRow) -> Self {
        let Some(column) = row.columns().first() else {
            return MySqlKeyKind::Other;
        };
        let ty = column.type_info();
        match ty.name() {
            "TINYINT" | "SMALLINT" | "MEDIUMINT" | "INT" | "BIGINT" => MySqlKeyKind::Signed,
            name if name.ends_with(" UNSIGNED") || name == "YEAR" || name == "BIT" => {
                MySqlKeyKind::Unsigned
            }
            "DECIMAL" => MySqlKeyKind::Text,
            "JSON" => MySqlKeyKind::Other,
            _ if <&str as Type<MySql>>::compatible(ty) => MySqlKeyKind::Text,
            _ => MySqlKeyKind::Other,
        }
    }
}

/// The first column of a MySQL row as a key, or `None` if it is NULL. Integers are
/// written into `buf`; text is borrowed from the row.
pub(super) fn mysql_key<'a>(
    row: &'a MySqlRow,
    kind: MySqlKeyKind,
    buf: &'a mut String,
) -> Result<Option<&'a str>, sqlx::Error> {
    let value = row.try_get_raw(0)?;
    if value.is_null() {
        return Ok(None);
    }
    let key = match kind {
        MySqlKeyKind::Signed => <i64 as Decode<MySql>>::decode(value).map(|n| write_key(buf, n)),
        MySqlKeyKind::Unsigned => <u64 as Decode<MySql>>::decode(value).map(|n| write_key(buf, n)),
        MySqlKeyKind::Text => <&str as Decode<MySql>>::decode(value),
        MySqlKeyKind::Other => mysql_value(value).map(|v| write_value_key(buf, v)),
    };
    key.map(Some).map_err(|e| decode_error(key_column(row), e))
}

/// The first column of an SQLite row as a key, or `None` if it is NULL. Integers (and
/// whole REALs, which a NUMERIC column may hold) are written into `buf`.
pub(super) fn sqlite_key<'a>(
    row: &'a SqliteRow,
    buf: &'a mut String,
) -> Result<Option<&'a str>, sqlx::Error> {
    let value = row.try_get_raw(0)?;
    let key = match stored_type(&value) {
        "NULL" => return Ok(None),
        "INTEGER" => <i64 as Decode<Sqlite>>::decode(value).map(|n| write_key(buf, n)),
        "TEXT" => <&str as Decode<Sqlite>>::decode(value),
        "REAL" => <f64 as Decode<Sqlite>>::decode(value).map(|f| {
            if f.fract() == 0.0 && f.abs() < 9.0e15 {
                // Exactly representable; prints without a fraction.
                write_key(buf, f as i64)
            } else {
                write_key(buf, f)
            }
        }),
        _ => <&[u8] as Decode<Sqlite>>::decode(value)
            .map(|b| write_value_key(buf, Value::String(String::from_utf8_lossy(b).into_owned()))),
    };
    key.map(Some).map_err(|e| decode_error(key_column(row), e))
}

fn key_column<R: Row>(row: &R) -> &str {
    row.columns().first().map_or("0", |c| c.name())
}

fn write_key(buf: &mut String, n: impl std::fmt::Display) -> &str {
    buf.clear();
    // Writing to a String cannot fail.
    let _ = write!(buf, "{n}");
    buf
}

fn write_value_key(buf: &mut String, value: Value) -> &str {
    buf.clear();
    match value {
        Value::String(s) => buf.push_str(&s),
        other => {
            let _ = write!(buf, "{other}");
        }
    }
    buf
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    use sqlx::mysql::types::MySqlTimeSign;

    #[test]
    fn decimals_are_numbers_only_when_nothing_is_lost() {
        assert_eq!(decimal("19.99"), json!(19.99));
        assert_eq!(decimal("100.00"), json!(100));
        assert_eq!(decimal("-0.00"), json!(0));
        assert_eq!(decimal("-12.50"), json!(-12.5));
        assert_eq!(decimal("18446744073709551615"), json!(u64::MAX));
        assert_eq!(
            decimal("0.1000000000000000000000001"),
            json!("0.1000000000000000000000001")
        );
        assert_eq!(decimal("9007199254740993.5"), json!("9007199254740993.5"));
        let wide = "12345678901234567890.12345678901234567890";
        assert_eq!(decimal(wide), json!(wide));
    }

    #[test]
    fn mysql_times_keep_their_sign_and_hours_beyond_a_day() -> Result<(), BoxDynError> {
        let t = MySqlTime::new(MySqlTimeSign::Negative, 838, 59, 59, 0)?;
        assert_eq!(time_of(t), "-838:59:59");
        let t = MySqlTime::new(MySqlTimeSign::Positive, 9, 5, 0, 120)?;
        assert_eq!(time_of(t), "09:05:00.000120");
        Ok(())
    }
}
