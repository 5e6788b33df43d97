//! `init`'s output: the [`Plan`] as a short TOML config with a comment on every decision
//! taken from the metadata. Only fields of the config model are written; everything else
//! keeps its default.

use std::fmt::Write;

use super::mysql::quote;
use super::{GROWTH_WINDOW_DAYS, ITEMS_STEP, KeyKind, Origin, Plan, RouteKey, SyncSource};

/// Full rebuilds when sync follows the table: how deleted keys leave the filter.
const REBUILD_WITH_SYNC: &str = "24h";
/// Full rebuilds when nothing can be synced: also how new keys arrive.
const REBUILD_WITHOUT_SYNC: &str = "10m";

/// The config text.
pub fn render(plan: &Plan) -> String {
    let mut out = String::new();
    let t = &plan.table;
    let filter = plan.filter_name();
    let table = quote(&t.name);
    let key = quote(&t.key.name);
    line(
        &mut out,
        &format!(
            "# bloomgate in front of table `{}` (key `{}`), written by `bloomgate init`.",
            t.name, t.key.name
        ),
    );
    line(
        &mut out,
        "# Check: bloomgate check-config --config FILE    Run: bloomgate serve --config FILE",
    );
    line(
        &mut out,
        "# Every field can be overridden by BLOOMGATE__SECTION__FIELD (docs/configuration.md).",
    );
    line(&mut out, "");
    line(&mut out, "[database]");
    if plan.password_removed {
        line(
            &mut out,
            "# The password is not kept here: set BLOOMGATE__DATABASE__URL to the full URL,",
        );
        line(&mut out, "# which takes precedence over this line.");
    }
    line(&mut out, &format!("url = {}", toml_str(&plan.url)));
    if let Origin::Upstream(url) = &plan.origin {
        line(&mut out, "");
        line(&mut out, "[upstream]");
        line(
            &mut out,
            "# The API behind the gate: found keys, and every path not guarded below.",
        );
        line(&mut out, &format!("url = {}", toml_str(url)));
    }
    line(&mut out, "");
    line(&mut out, &format!("[filters.{filter}]"));
    line(
        &mut out,
        &format!(
            "source_query = {}",
            toml_str(&format!("SELECT {key} FROM {table}"))
        ),
    );
    let rows = match t.rows {
        1 => "1 row".to_owned(),
        n => format!("{n} rows"),
    };
    match &t.growth {
        Some(g) => {
            line(
                &mut out,
                &format!(
                    "# {rows} now. Sized for the largest of 2 x rows, {ITEMS_STEP}, and the rows plus a"
                ),
            );
            line(
                &mut out,
                &format!(
                    "# year of inserts at the last {GROWTH_WINDOW_DAYS} days' rate ({} by `{}`: {} a year),",
                    g.recent,
                    g.column,
                    g.per_year()
                ),
            );
            line(
                &mut out,
                &format!(
                    "# rounded up to a multiple of {ITEMS_STEP}. Past it the filter is rebuilt twice as large."
                ),
            );
        }
        None => {
            line(
                &mut out,
                &format!(
                    "# {rows} now. Sized for the larger of 2 x rows and {ITEMS_STEP} (no created_at-like"
                ),
            );
            line(
                &mut out,
                &format!(
                    "# column dates the inserts), rounded up to a multiple of {ITEMS_STEP}. Past it the"
                ),
            );
            line(&mut out, "# filter is rebuilt twice as large.");
        }
    }
    line(
        &mut out,
        &format!("expected_items = {}", plan.expected_items()),
    );
    match &t.key.kind {
        KeyKind::Integer => {
            line(
                &mut out,
                &format!(
                    "# `{}` is {}: keys are canonical decimal integers.",
                    t.key.name, t.key.declared
                ),
            );
            line(&mut out, "normalize = { kind = \"integer\" }");
        }
        KeyKind::String {
            max_len,
            lowercase,
            collation,
        } => {
            let compared = match (collation, lowercase) {
                (Some(c), true) => format!(", compared ignoring case ({c}): keys are lowercased"),
                (Some(c), false) => format!(", compared exactly ({c})"),
                (None, _) => String::new(),
            };
            line(
                &mut out,
                &format!("# `{}` is {}{compared}.", t.key.name, t.key.declared),
            );
            line(
                &mut out,
                &format!("# Keys longer than {max_len} bytes are refused with 400."),
            );
            line(
                &mut out,
                &format!(
                    "normalize = {{ kind = \"string\", lowercase = {lowercase}, max_len = {max_len} }}"
                ),
            );
        }
    }
    let rebuild = match &t.sync {
        SyncSource::None => {
            line(
                &mut out,
                "# No incremental sync: the table has no indexed updated_at-like TIMESTAMP/DATETIME",
            );
            line(
                &mut out,
                "# column and its key is not auto-increment. New keys reach the gate at the next full",
            );
            line(
                &mut out,
                &format!(
                    "# rebuild (every {REBUILD_WITHOUT_SYNC}) or at once through POST /admin/filters/{filter}/keys;"
                ),
            );
            line(&mut out, "# until then they are answered 404.");
            REBUILD_WITHOUT_SYNC
        }
        _ => {
            line(
                &mut out,
                "# Full rebuilds, while the current filter serves: how deleted keys leave it.",
            );
            REBUILD_WITH_SYNC
        }
    };
    line(&mut out, &format!("rebuild_interval = \"{rebuild}\""));
    match &t.sync {
        SyncSource::Timestamp { column, declared } => {
            line(&mut out, "");
            line(
                &mut out,
                &format!(
                    "# New keys are let through within a few seconds: `{column}` ({declared}) is indexed."
                ),
            );
            line(&mut out, &format!("[filters.{filter}.sync]"));
            let col = quote(column);
            line(
                &mut out,
                &format!(
                    "query = {}",
                    toml_str(&format!(
                        "SELECT {key}, {col} FROM {table} WHERE {col} >= ?"
                    ))
                ),
            );
            line(&mut out, "watermark = \"timestamp\"");
        }
        SyncSource::AutoIncrement => {
            line(&mut out, "");
            line(
                &mut out,
                &format!(
                    "# New keys are let through within a few seconds: `{}` is auto-increment. Ids",
                    t.key.name
                ),
            );
            line(
                &mut out,
                "# skipped by transactions still open are read again until they appear (gap_timeout).",
            );
            line(&mut out, &format!("[filters.{filter}.sync]"));
            line(
                &mut out,
                &format!(
                    "query = {}",
                    toml_str(&format!(
                        "SELECT {key}, {key} FROM {table} WHERE {key} >= ?"
                    ))
                ),
            );
            line(&mut out, "watermark = \"integer\"");
            line(
                &mut out,
                &format!(
                    "start_query = {}",
                    toml_str(&format!("SELECT MAX({key}) FROM {table}"))
                ),
            );
        }
        SyncSource::None => {}
    }
    line(&mut out, "");
    line(&mut out, "[[routes]]");
    line(&mut out, &format!("name = {}", toml_str(&filter)));
    line(&mut out, &format!("path = {}", toml_str(&plan.route.path)));
    match &plan.route.key {
        RouteKey::Segment(s) => line(&mut out, &format!("key = {{ segment = {} }}", toml_str(s))),
        RouteKey::Query(q) => line(&mut out, &format!("key = {{ query = {} }}", toml_str(q))),
    }
    line(&mut out, &format!("filter = {}", toml_str(&filter)));
    line(
        &mut out,
        "# Keys the gate calls absent get 404 at once (x-bloomgate: intercepted); \"shadow\"",
    );
    line(&mut out, "# only counts them, to try the gate out first.");
    line(&mut out, "mode = \"enforce\"");
    match &plan.origin {
        Origin::Sql => {
            line(
                &mut out,
                "# Keys the gate lets through are looked up here (the key is bound, never spliced in).",
            );
            let sql = format!("SELECT * FROM {table} WHERE {key} = ?");
            line(
                &mut out,
                &format!("origin = {{ kind = \"sql\", query = {} }}", toml_str(&sql)),
            );
        }
        Origin::Upstream(_) => {
            line(
                &mut out,
                "# Keys the gate lets through are fetched from [upstream], one canonical GET per key;",
            );
            line(&mut out, "# 404 and 410 answers mean absent.");
            line(&mut out, "origin = { kind = \"upstream\" }");
        }
    }
    out
}

fn line(out: &mut String, text: &str) {
    // Writing to a String cannot fail.
    let _ = writeln!(out, "{text}");
}

/// `s` as a TOML basic string.
fn toml_str(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\t' => out.push_str("\\t"),
            c if c.is_control() => {
                let _ = write!(out, "\\u{:04X}", u32::from(c));
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
}
