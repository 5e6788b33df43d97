//! Demo data: fills the `products` table for `bloomgate demo` and the tests.
//!
//! Keys are spread out (one present key in every block of four) so that absent keys
//! sit between present ones, as they do in real catalogues; [`demo_sku`] and
//! [`demo_absent_sku`] let a test or the demo name keys of either kind without a query.

use std::sync::Arc;

use sqlx::{AssertSqlSafe, Database, Decode, Encode, Executor, IntoArguments, Pool, Type};

/// Rows per INSERT statement: 3 parameters each, far below SQLite's 32766 and
/// MySQL's 65535 placeholders per statement.
const ROWS_PER_STATEMENT: u64 = 1_000;
/// Rows per transaction: big enough to make SQLite fast, small enough to keep a
/// MySQL transaction (and SQLite's write lock) short.
const ROWS_PER_TRANSACTION: u64 = 100_000;

/// The key of demo product `i` (0-based): one key in each block `4i+1 ..= 4i+4`,
/// its place in the block chosen by a fixed hash of `i`. Strictly increasing in `i`.
/// Meant for `i < 2^61`.
pub fn demo_sku(i: u64) -> u64 {
    4 * i + 1 + mix(i) % 4
}

/// A key that no demo product has, whatever the count: another slot of block `i`
/// (so it lies between `demo_sku(i - 1)` and `demo_sku(i + 1)`).
pub fn demo_absent_sku(i: u64) -> u64 {
    let present = mix(i) % 4;
    // 1..=3 steps further round the block: never the present slot.
    let step = 1 + (mix(i) >> 32) % 3;
    4 * i + 1 + (present + step) % 4
}

/// A fixed 64-bit mixing function (the splitmix64 finaliser); deterministic across
/// platforms and releases, which is all the demo needs.
fn mix(i: u64) -> u64 {
    let mut z = i.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The demo price of product `i`, as exact decimal text: 1.00 ..= 999.99.
fn demo_price(i: u64) -> String {
    let cents = 100 + mix(i ^ 0x5EED) % 99_900;
    format!("{}.{:02}", cents / 100, cents % 100)
}

/// `INSERT ... VALUES (?, ?, ?), ...` for `rows` rows; `updated_at` takes its default.
fn insert_sql(rows: u64) -> String {
    let mut sql = String::from("INSERT INTO products (sku_id, name, price) VALUES ");
    for r in 0..rows {
        if r > 0 {
            sql.push_str(", ");
        }
        sql.push_str("(?, ?, ?)");
    }
    sql
}

/// Seeds `count` demo products if the table is empty; returns how many were inserted.
/// Generic so MySQL and SQLite share one loop: both take `?` placeholders, and the
/// price is bound as decimal text, which each converts exactly into its DECIMAL.
pub(super) async fn seed_products<DB>(pool: &Pool<DB>, count: u64) -> Result<u64, sqlx::Error>
where
    DB: Database,
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    for<'q> i64: Encode<'q, DB> + Decode<'q, DB> + Type<DB>,
    for<'q> String: Encode<'q, DB> + Type<DB>,
    DB::Arguments: IntoArguments<DB>,
    usize: sqlx::ColumnIndex<DB::Row>,
{
    let existing: Option<i64> = sqlx::query_scalar("SELECT sku_id FROM products LIMIT 1")
        .fetch_optional(pool)
        .await?;
    if existing.is_some() {
        return Ok(0);
    }

    // One text for every full batch, so each connection prepares it once.
    let full_batch: Arc<str> = insert_sql(ROWS_PER_STATEMENT).into();
    let mut next = 0u64;
    while next < count {
        let tx_end = count.min(next + ROWS_PER_TRANSACTION);
        let mut tx = pool.begin().await?;
        while next < tx_end {
            let rows = ROWS_PER_STATEMENT.min(tx_end - next);
            let sql: Arc<str> = if rows == ROWS_PER_STATEMENT {
                Arc::clone(&full_batch)
            } else {
                insert_sql(rows).into()
            };
            let mut insert = sqlx::query(AssertSqlSafe(sql));
            for i in next..next + rows {
                let sku = demo_sku(i);
                insert = insert
                    .bind(i64::try_from(sku).unwrap_or(i64::MAX))
                    .bind(format!("Product {sku}"))
                    .bind(demo_price(i));
            }
            insert.execute(&mut *tx).await?;
            next += rows;
        }
        tx.commit().await?;
    }
    Ok(count)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn present_keys_are_strictly_increasing_and_one_per_block() {
        let mut last = 0;
        for i in 0..100_000 {
            let sku = demo_sku(i);
            assert!(sku > last, "demo_sku({i}) = {sku} not above {last}");
            assert!((4 * i + 1..=4 * i + 4).contains(&sku));
            last = sku;
        }
    }

    #[test]
    fn absent_keys_share_the_block_but_never_the_slot() {
        for i in 0..100_000 {
            let absent = demo_absent_sku(i);
            assert_ne!(absent, demo_sku(i));
            assert!((4 * i + 1..=4 * i + 4).contains(&absent));
        }
    }

    #[test]
    fn prices_are_decimal_text_in_range() {
        for i in 0..10_000 {
            let price = demo_price(i);
            let (whole, cents) = price.split_once('.').expect("a decimal point");
            assert_eq!(cents.len(), 2);
            let whole: u64 = whole.parse().expect("whole part");
            assert!((1..=999).contains(&whole), "{price}");
        }
    }

    #[test]
    fn insert_sql_has_three_placeholders_per_row() {
        assert_eq!(
            insert_sql(2),
            "INSERT INTO products (sku_id, name, price) VALUES (?, ?, ?), (?, ?, ?)"
        );
    }
}
