//! `bloomgate check-config`'s notes beyond "ok": what a source needs for binlog mode,
//! which no offline check can verify (the server's settings and the user's grants), so
//! that an operator reads it before the first start does.

use bloomgate::config::Compiled;

/// One line for each filter in binlog mode: the table and key it follows, and what the
/// server and the replication user need. The URL is shown without its password.
pub fn binlog_notes(compiled: &Compiled) -> Vec<String> {
    compiled
        .filters()
        .iter()
        .filter_map(|f| {
            let source = f.binlog.as_ref()?;
            let table = &source.table;
            let grants_on = match &table.schema {
                Some(_) => table.to_string(),
                None => format!("the database's {}", table.table),
            };
            Some(format!(
                "filters.{name}: binlog mode follows {table} (key column {column}) in the server's \
                 binary log as a replica: the server needs log_bin on, binlog_format = ROW, \
                 binlog_row_image = FULL and a server_id (MySQL 8, or MariaDB 10.6 or later), and \
                 the user of {url} needs REPLICATION SLAVE, REPLICATION CLIENT and SELECT on {grants_on}; \
                 serve checks the server's settings at start and refuses to start without them",
                name = f.name,
                column = table.column,
                url = without_password(&source.url),
            ))
        })
        .collect()
}

/// `url` with its password (if any) replaced by `***`.
fn without_password(url: &str) -> String {
    match url::Url::parse(url) {
        Ok(mut u) if u.password().is_some() => {
            let _ = u.set_password(Some("***"));
            u.to_string()
        }
        Ok(u) => u.to_string(),
        Err(_) => "database.url".to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bloomgate::config::Config;

    #[test]
    fn a_binlog_filter_is_explained_and_the_password_is_not_shown() {
        let config = Config::from_toml_str(
            r#"
            [database]
            url = "mysql://app:secret@db:3306/shop"
            [filters.products]
            source_query = "SELECT sku_id FROM products"
            expected_items = 10
            [filters.products.sync]
            watermark = "binlog"
            binlog = { url = "mysql://repl:hush@db:3306/shop" }
            [filters.users]
            source_query = "SELECT id FROM users"
            expected_items = 10
            "#,
        )
        .expect("a valid config");
        let compiled = config.compile().expect("compiles");
        let notes = binlog_notes(&compiled);
        assert_eq!(notes.len(), 1, "{notes:?}");
        let note = &notes[0];
        assert!(
            note.starts_with("filters.products: binlog mode follows products (key column sku_id)"),
            "{note}"
        );
        assert!(
            note.contains("binlog_format = ROW") && note.contains("REPLICATION SLAVE"),
            "{note}"
        );
        assert!(note.contains("mysql://repl:***@db:3306/shop"), "{note}");
        assert!(!note.contains("hush") && !note.contains("secret"), "{note}");
    }
}
