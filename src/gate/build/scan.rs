//! Reading a filter's source for a full build: the sync position the build starts
//! from, and the scan itself, which in binlog mode runs in a snapshot consistent with
//! the log position it returns.

use std::borrow::Cow;
use std::sync::Arc;

use super::LoadError;
use bloomgate_core::config::{FilterConfig, Normalize, WatermarkKind};
use bloomgate_core::db::Db;
use bloomgate_core::filter::BloomFilter;
use bloomgate_core::key::{KeyBytes, normalize};
use bloomgate_core::watermark::{BinlogMark, Watermark};

/// The watermark a full build covers up to: from the sync start query, or (timestamps
/// without one) this host's clock. `None` without sync, and in binlog mode, where the
/// scan reads its position itself.
pub async fn start_watermark(
    config: &FilterConfig,
    db: &Db,
) -> Result<Option<Watermark>, LoadError> {
    let Some(sync) = &config.sync else {
        return Ok(None);
    };
    let fetched = match &sync.start_query {
        Some(q) => {
            db.fetch_watermark(&Arc::from(q.as_str()), sync.watermark)
                .await?
        }
        None => None,
    };
    Ok(match sync.watermark {
        WatermarkKind::Integer => Some(fetched.unwrap_or(Watermark::Int(i64::MIN))),
        WatermarkKind::Timestamp => {
            Some(fetched.unwrap_or(Watermark::TimeMicros(chrono::Utc::now().timestamp_micros())))
        }
        // The scan itself says where the log goes on (see [`fill`]).
        WatermarkKind::Binlog => None,
    })
}

/// What a scan read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Filled {
    /// Rows read.
    pub rows: u64,
    /// Keys that failed normalisation (not inserted).
    pub skipped: u64,
    /// Binlog mode: the log position the scan is consistent with.
    pub log_position: Option<BinlogMark>,
}

/// Streams `source` into `filter`, normalising each key with `rule`; `progress` is called
/// every 65,536 rows with the rows read so far, and `listed` with each key's canonical
/// bytes. With `log_position` (binlog mode: the replication URL) the scan runs in a
/// snapshot consistent with a binary log position, which it returns.
pub async fn fill(
    db: &Db,
    source: &Arc<str>,
    log_position: Option<&str>,
    rule: &Normalize,
    filter: &BloomFilter,
    mut progress: impl FnMut(u64),
    mut listed: impl FnMut(&[u8]),
) -> Result<Filled, LoadError> {
    let mut bytes = KeyBytes::new();
    let mut skipped = 0u64;
    let mut seen = 0u64;
    let mut each = |raw: &str| {
        match normalize(rule, Cow::Borrowed(raw)) {
            Ok(key) => {
                let b = bytes.of(&key);
                filter.insert(b);
                listed(b);
            }
            Err(_) => skipped += 1,
        }
        seen += 1;
        if seen.is_multiple_of(65_536) {
            progress(seen);
        }
    };
    let (rows, log_position) = if let Some(replica) = log_position {
        let (rows, mark) = db
            .for_each_key_at_log_position(source, replica, &mut each)
            .await?;
        (rows, Some(mark))
    } else {
        (db.for_each_key(source, &mut each).await?, None)
    };
    progress(rows);
    Ok(Filled {
        rows,
        skipped,
        log_position,
    })
}
