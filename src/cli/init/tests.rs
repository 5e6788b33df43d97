//! `init`'s decisions on metadata given by hand; the metadata readers themselves are
//! tested against real databases in `tests/init.rs`.

use super::*;
use bloomgate::config::{Config, Normalize, WatermarkKind};

fn col(name: &str, class: ColumnClass, auto_increment: bool) -> Column {
    Column {
        name: name.to_owned(),
        declared: "t".to_owned(),
        class,
        auto_increment,
    }
}

fn index(columns: &[&str], unique: bool) -> Index {
    Index {
        columns: columns.iter().map(|c| (*c).to_owned()).collect(),
        unique,
    }
}

fn plan(rows: u64, growth: Option<u64>, sync: SyncSource, kind: KeyKind) -> Plan {
    Plan {
        url: "mysql://app@db:3306/shop".to_owned(),
        password_removed: true,
        table: Table {
            name: "products".to_owned(),
            key: KeyColumn {
                name: "sku_id".to_owned(),
                declared: "bigint(20) unsigned".to_owned(),
                kind,
            },
            rows,
            growth: growth.map(|recent| Growth {
                column: "created_at".to_owned(),
                recent,
            }),
            sync,
        },
        route: Route::parse("/api/product/info?sku_id={key}").expect("route"),
        origin: Origin::Sql,
    }
}

#[test]
fn passwords_are_taken_out_of_urls_and_nothing_else() {
    assert_eq!(
        without_password("mysql://app:s3cr%40t@db:3306/shop?ssl-mode=required"),
        (
            "mysql://app@db:3306/shop?ssl-mode=required".to_owned(),
            true
        )
    );
    assert_eq!(
        without_password("mysql://app@db/shop"),
        ("mysql://app@db/shop".to_owned(), false)
    );
    assert_eq!(
        without_password("sqlite://data/a@b.db"),
        ("sqlite://data/a@b.db".to_owned(), false)
    );
}

#[test]
fn routes_are_read_from_either_form_and_refused_otherwise() {
    assert_eq!(
        Route::parse("/api/products/{key}").expect("segment"),
        Route {
            path: "/api/products/{key}".to_owned(),
            key: RouteKey::Segment("key".to_owned())
        }
    );
    assert_eq!(
        Route::parse("/api/product/info?sku_id={key}").expect("query"),
        Route {
            path: "/api/product/info".to_owned(),
            key: RouteKey::Query("sku_id".to_owned())
        }
    );
    for bad in [
        "api/x/{key}",
        "/api/x",
        "/a/{k}/{j}",
        "/a/x{k}",
        "/a?x={key}&y=1",
        "/a/{k}?x={key}",
    ] {
        let e = Route::parse(bad).expect_err(bad);
        assert_eq!(e.exit_code(), 2, "{bad}: {e}");
    }
    assert_eq!(
        Route::default_for("articles").expect("plain").path,
        "/api/articles/{key}"
    );
    assert!(matches!(
        Route::default_for("order items"),
        Err(InitError::NoDefaultRoute(_))
    ));
}

#[test]
fn expected_items_take_the_largest_estimate_rounded_up() {
    let int = || KeyKind::Integer;
    // 2 x rows wins.
    assert_eq!(
        plan(41_234, Some(300), SyncSource::None, int()).expected_items(),
        83_000
    );
    // A year of inserts wins: 30 days of 10,000 is 121,667 a year.
    assert_eq!(
        plan(5_000, Some(10_000), SyncSource::None, int()).expected_items(),
        127_000
    );
    // The floor.
    assert_eq!(
        plan(0, None, SyncSource::None, int()).expected_items(),
        1_000
    );
}

#[test]
fn the_key_must_be_unique_alone_and_indexed() {
    let cols = [
        col("id", ColumnClass::Integer, true),
        col("sku", ColumnClass::Integer, false),
    ];
    let e = key_column("t", &cols, &[index(&["id"], true)], "sku").expect_err("unindexed");
    assert!(matches!(e, InitError::NotIndexed { .. }), "{e}");
    let e = key_column("t", &cols, &[index(&["sku"], false)], "sku").expect_err("not unique");
    assert!(matches!(e, InitError::NotUnique { .. }), "{e}");
    let e = key_column("t", &cols, &[index(&["sku", "id"], true)], "sku").expect_err("composite");
    assert!(matches!(e, InitError::NotUnique { .. }), "{e}");
    let e = key_column("t", &cols, &[], "nope").expect_err("missing");
    assert!(matches!(e, InitError::NoSuchColumn { .. }), "{e}");
    assert!(key_column("t", &cols, &[index(&["SKU"], true)], "sku").is_ok());
}

#[test]
fn sync_prefers_an_indexed_timestamp_then_auto_increment() {
    let cols = [
        col("id", ColumnClass::Integer, true),
        col("updated_at", ColumnClass::Timestamp, false),
    ];
    let key = key_column("t", &cols, &[index(&["id"], true)], "id").expect("key");
    // Not indexed: auto-increment it is.
    assert_eq!(
        sync_source(&cols, &[index(&["id"], true)], &key),
        SyncSource::AutoIncrement
    );
    let indexed = [index(&["id"], true), index(&["updated_at", "id"], false)];
    assert!(matches!(
        sync_source(&cols, &indexed, &key),
        SyncSource::Timestamp { .. }
    ));
    let plain = [col("id", ColumnClass::Integer, false)];
    assert_eq!(
        sync_source(&plain, &[index(&["id"], true)], &key),
        SyncSource::None
    );
}

#[test]
fn every_rendered_plan_is_a_valid_config_with_what_was_decided() {
    let string = KeyKind::String {
        max_len: 32,
        lowercase: true,
        collation: Some("ascii_general_ci".to_owned()),
    };
    let timestamp = SyncSource::Timestamp {
        column: "updated_at".to_owned(),
        declared: "datetime".to_owned(),
    };
    for (sync, kind, origin) in [
        (timestamp, KeyKind::Integer, Origin::Sql),
        (
            SyncSource::AutoIncrement,
            KeyKind::Integer,
            Origin::Upstream("http://api:8000".into()),
        ),
        (SyncSource::None, string.clone(), Origin::Sql),
    ] {
        let mut p = plan(10, Some(1), sync.clone(), kind.clone());
        p.origin = origin;
        let text = render::render(&p);
        let config = Config::from_toml_str(&text).unwrap_or_else(|e| panic!("{e}\n{text}"));
        config.validate().unwrap_or_else(|e| panic!("{e}\n{text}"));
        let filter = &config.filters["products"];
        assert_eq!(filter.expected_items, 1000);
        let wanted = match &kind {
            KeyKind::Integer => Normalize::Integer,
            KeyKind::String { .. } => Normalize::String {
                lowercase: true,
                max_len: 32,
            },
        };
        assert_eq!(filter.normalize, wanted, "{text}");
        match sync {
            SyncSource::Timestamp { .. } => {
                assert_eq!(
                    filter.sync.as_ref().map(|s| s.watermark),
                    Some(WatermarkKind::Timestamp)
                );
            }
            SyncSource::AutoIncrement => {
                assert_eq!(
                    filter.sync.as_ref().map(|s| s.watermark),
                    Some(WatermarkKind::Integer)
                );
            }
            SyncSource::None => {
                assert!(filter.sync.is_none());
                assert!(text.contains("# No incremental sync"), "{text}");
            }
        }
        assert!(!text.contains("BLOOMGATE__ADMIN__TOKEN") && config.admin.token.is_none());
        assert!(text.contains("set BLOOMGATE__DATABASE__URL"), "{text}");
        let settings = text
            .lines()
            .filter(|l| !l.trim().is_empty() && !l.starts_with('#'))
            .count();
        assert!(settings <= 20, "{settings} lines:\n{text}");
    }
}
