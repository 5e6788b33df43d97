//! The watermark of incremental sync: how far the sync query has read the source, as the
//! largest value of its second column (an auto-increment id or an update timestamp). It is
//! kept in memory and in snapshots; it does not run queries.

use serde::Serialize;

/// The largest watermark value applied so far.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(tag = "kind", content = "value", rename_all = "snake_case")]
pub enum Watermark {
    /// An integer column, such as an auto-increment id.
    Int(i64),
    /// A timestamp column, as microseconds since the Unix epoch (UTC).
    TimeMicros(i64),
}

impl Watermark {
    /// A stable one-byte tag, for the snapshot format.
    pub fn tag(self) -> u8 {
        match self {
            Watermark::Int(_) => 1,
            Watermark::TimeMicros(_) => 2,
        }
    }

    /// The raw value, for the snapshot format.
    pub fn value(self) -> i64 {
        match self {
            Watermark::Int(v) | Watermark::TimeMicros(v) => v,
        }
    }

    /// Rebuilds a watermark from its tag and value; `None` for an unknown tag.
    pub fn from_parts(tag: u8, value: i64) -> Option<Watermark> {
        match tag {
            1 => Some(Watermark::Int(value)),
            2 => Some(Watermark::TimeMicros(value)),
            _ => None,
        }
    }
}

impl std::fmt::Display for Watermark {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Watermark::Int(v) => write!(f, "{v}"),
            Watermark::TimeMicros(us) => {
                match chrono::DateTime::<chrono::Utc>::from_timestamp_micros(*us) {
                    Some(t) => write!(
                        f,
                        "{}",
                        t.to_rfc3339_opts(chrono::SecondsFormat::Micros, true)
                    ),
                    None => write!(f, "{us}us"),
                }
            }
        }
    }
}
