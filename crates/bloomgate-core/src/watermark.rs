//! The watermark of incremental sync: how far sync has read the source, either as the
//! largest value of the poll query's second column (an auto-increment id or an update
//! timestamp) or as a position in the server's binary log. It is kept in memory and in
//! snapshots; it does not run queries or read the log.

use serde::Serialize;

/// How far sync has read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(tag = "kind", content = "value", rename_all = "snake_case")]
pub enum Watermark {
    /// An integer column, such as an auto-increment id.
    Int(i64),
    /// A timestamp column, as microseconds since the Unix epoch (UTC).
    TimeMicros(i64),
    /// A position in the binary log: everything before it is applied.
    Binlog(BinlogMark),
}

/// A position in a server's binary log: the file (by the number its name ends with, as
/// in `binlog.000042`), the offset of the next event in it, the `server_id` of the server
/// whose log that file is, and on MariaDB the global transaction id of the last
/// transaction before it, from which a replica can resume on any server of the same
/// replication topology. A file and offset mean nothing on another server.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub struct BinlogMark {
    /// The number the file's name ends with.
    pub file: u32,
    /// The offset of the next event in the file.
    pub offset: u64,
    /// The `server_id` of the server whose log it is; 0 when unknown.
    pub server: u32,
    /// The last transaction before the position (MariaDB).
    pub gtid: Option<Gtid>,
}

/// A MariaDB global transaction id, `domain-server-sequence`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub struct Gtid {
    /// The replication domain.
    pub domain: u32,
    /// The server that committed the transaction first.
    pub server: u32,
    /// The transaction's number within the domain.
    pub seq: u64,
}

/// Bits of a packed [`BinlogMark`] that hold the offset: 1 TiB, far past the largest
/// binary log file a server writes.
const OFFSET_BITS: u32 = 40;

/// The largest file number that packs: 2^23 - 1, so the packed value stays positive.
pub const MAX_BINLOG_FILE: u32 = (1 << 23) - 1;

impl BinlogMark {
    /// The file number and offset in one value (the server and GTID are stored beside it).
    pub fn packed(self) -> i64 {
        (i64::from(self.file) << OFFSET_BITS) | (self.offset & ((1 << OFFSET_BITS) - 1)) as i64
    }

    /// Unpacks [`BinlogMark::packed`], without its server and GTID; `None` for a
    /// negative value.
    pub fn unpacked(value: i64) -> Option<BinlogMark> {
        let value = u64::try_from(value).ok()?;
        Some(BinlogMark {
            file: u32::try_from(value >> OFFSET_BITS).ok()?,
            offset: value & ((1 << OFFSET_BITS) - 1),
            server: 0,
            gtid: None,
        })
    }

    /// The name of the file in a log whose files are called `base.NNNNNN`.
    pub fn file_name(self, base: &str) -> String {
        format!("{base}.{:06}", self.file)
    }
}

impl std::fmt::Display for Gtid {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}-{}-{}", self.domain, self.server, self.seq)
    }
}

impl std::str::FromStr for Gtid {
    type Err = ();

    /// Reads `domain-server-sequence`.
    fn from_str(s: &str) -> Result<Gtid, ()> {
        let mut parts = s.trim().splitn(3, '-');
        let mut next = || parts.next().ok_or(());
        let domain = next()?.parse().map_err(|_| ())?;
        let server = next()?.parse().map_err(|_| ())?;
        let seq = next()?.parse().map_err(|_| ())?;
        Ok(Gtid {
            domain,
            server,
            seq,
        })
    }
}

impl Watermark {
    /// A stable one-byte tag, for the snapshot format.
    pub fn tag(self) -> u8 {
        match self {
            Watermark::Int(_) => 1,
            Watermark::TimeMicros(_) => 2,
            Watermark::Binlog(_) => 3,
        }
    }

    /// The raw value, for the snapshot format (a binlog position without its server and
    /// GTID).
    pub fn value(self) -> i64 {
        match self {
            Watermark::Int(v) | Watermark::TimeMicros(v) => v,
            Watermark::Binlog(m) => m.packed(),
        }
    }

    /// Rebuilds a watermark from its tag and value; `None` for an unknown tag or a
    /// value the tag cannot have. A binlog position comes back without its server and
    /// GTID.
    pub fn from_parts(tag: u8, value: i64) -> Option<Watermark> {
        match tag {
            1 => Some(Watermark::Int(value)),
            2 => Some(Watermark::TimeMicros(value)),
            3 => BinlogMark::unpacked(value).map(Watermark::Binlog),
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
            Watermark::Binlog(m) => {
                write!(
                    f,
                    "binlog file {} offset {} of server {}",
                    m.file, m.offset, m.server
                )?;
                match m.gtid {
                    Some(g) => write!(f, " gtid {g}"),
                    None => Ok(()),
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_binlog_position_packs_and_unpacks() {
        for (file, offset) in [(1, 4), (42, 1_976), (MAX_BINLOG_FILE, (1 << 40) - 1)] {
            let m = BinlogMark {
                file,
                offset,
                server: 0,
                gtid: None,
            };
            let w = Watermark::Binlog(m);
            assert!(w.value() >= 0);
            assert_eq!(Watermark::from_parts(w.tag(), w.value()), Some(w));
        }
        assert_eq!(Watermark::from_parts(3, -1), None);
        assert_eq!(
            BinlogMark {
                file: 3,
                offset: 4,
                server: 1,
                gtid: None
            }
            .file_name("binlog"),
            "binlog.000003"
        );
    }

    #[test]
    fn a_gtid_reads_back_as_written() {
        let g: Gtid = "0-1-1234567890123".parse().expect("a gtid");
        assert_eq!(
            g,
            Gtid {
                domain: 0,
                server: 1,
                seq: 1_234_567_890_123
            }
        );
        assert_eq!(g.to_string().parse::<Gtid>(), Ok(g));
        for bad in ["", "0-1", "0-1-x", "a-1-2", "-1-2-3"] {
            assert!(bad.parse::<Gtid>().is_err(), "{bad}");
        }
    }
}
