//! Snapshot files of a Bloom filter: the on-disk format, the atomic write and the
//! verifying read, so that a restart is warm. It does not decide when to snapshot or
//! whether a snapshot's parameters suit the config; the gate does both.
//!
//! # Format, version 2
//!
//! Integers are little-endian; offsets are in bytes. `H` is the header length, `w` the
//! word count `bits / 64`.
//!
//! | offset  | size  | field               | contents                                          |
//! |---------|-------|---------------------|---------------------------------------------------|
//! | 0       | 8     | magic               | `b"BLOOMGT\0"`                                    |
//! | 8       | 4     | format version      | u32, 2                                            |
//! | 12      | 4     | header length `H`   | u32, 73 as written by version 2                   |
//! | 16      | 8     | bits                | u64, a multiple of 512 in `512..=2^40`            |
//! | 24      | 4     | hashes              | u32, at least 1                                   |
//! | 28      | 8     | expected items      | u64, the capacity the filter was sized for        |
//! | 36      | 8     | false-positive rate | f64 bit pattern (`f64::to_bits`)                  |
//! | 44      | 4     | seed                | u32, the murmur3 seed                             |
//! | 48      | 8     | items               | u64, [`BloomFilter::items`] when written          |
//! | 56      | 1     | watermark tag       | u8: 0 none, else [`Watermark::tag`]               |
//! | 57      | 8     | watermark value     | i64, [`Watermark::value`]; 0 when the tag is 0    |
//! | 65      | 8     | created at          | u64, Unix seconds                                 |
//! | 73      | 21    | binlog position     | only when `H` ≥ 94 and the tag is 3 (a binlog position): the log's server_id u32, a GTID flag u8 (0 none, 1 one), the GTID's domain u32, server u32 and sequence u64 (zeros without one) |
//! | `H`     | `8w`  | words               | u64 each; bit `i` is bit `i % 64` of word `i / 64` |
//! | `H+8w`  | 4     | checksum            | u32, CRC-32 (IEEE) of every byte before it        |
//!
//! Words run in block order: block `b` is words `8b..8b + 8`. Version 1 had the same
//! header over a classic, unblocked bit array; its bits mean nothing under the blocked
//! probes, so version 1 files are refused like any other version and the gate rebuilds.
//!
//! A version 2 reader accepts `H > 73` and skips the header bytes it does not know (the
//! checksum still covers them), so a field can be appended without a new version; any
//! other change to the layout takes a new version, which older readers refuse. The rest
//! of a binlog position (its server and GTID) is such a field: written only with one
//! (`H` = 94), and read by a reader that knows it.
//!
//! The seed is a secret: whoever knows it can compute keys that collide in the filter.
//! Snapshot files are created readable by their owner only (on Unix), and
//! [`SnapshotSummary`] leaves the seed out.
//!
//! # Reading
//!
//! A read checks, in this order, and stops at the first failure: the magic (on as many
//! bytes as there are, so a short text file is foreign rather than truncated), the
//! length of the fixed fields, the version, the header length, bits and hashes, the file
//! length against the one the header implies, the checksum, the watermark tag and the
//! creation time, and last the bit array itself ([`BloomFilter::from_raw`]). Header
//! fields are checked before the checksum because the checksum can only be found once
//! the header says how long the file is.

use std::fs::{self, File};
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use tempfile::NamedTempFile;

use super::{BLOCK_BITS, BloomFilter, BloomParams, FilterError, MAX_BITS, MAX_OPTIMAL_HASHES};
use crate::watermark::{BinlogMark, Gtid, Watermark};

/// The first eight bytes of every snapshot file.
pub const MAGIC: [u8; 8] = *b"BLOOMGT\0";

/// The format version this build writes, and the only one it reads.
pub const FORMAT_VERSION: u32 = 2;

/// The header length of version 2: the fields of the table in the module docs.
const HEADER_LEN: usize = 73;

/// Magic, version and header length: what must be read before anything else.
const PREAMBLE_LEN: usize = 16;

/// The checksum after the words.
const CHECKSUM_LEN: usize = 4;

/// Bytes gathered before a write and a checksum update: large enough that both run at
/// full speed, small enough to stay in cache.
const CHUNK: usize = 64 * 1024;

/// A filter restored from a snapshot file, with what the file recorded beside it.
#[derive(Debug)]
pub struct Snapshot {
    /// The filter, with the parameters, seed, item count and bits it was written with.
    pub filter: BloomFilter,
    /// Where incremental sync had got to when the snapshot was written; `None` if the
    /// writer had no sync.
    pub watermark: Option<Watermark>,
    /// When the snapshot was written, to the second.
    pub created_at: SystemTime,
}

/// What a successful [`write()`] produced.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SnapshotInfo {
    /// The size of the file, in bytes.
    pub bytes: u64,
    /// How long the write took, syncs and rename included.
    pub took: Duration,
}

/// Why a snapshot could not be written or was rejected on reading. The messages are
/// meant to be read in a log line by an operator who has not seen this code.
#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    /// The file system refused an operation.
    #[error("cannot {action} snapshot {}", path.display())]
    Io {
        /// What was being done, as a verb phrase: `"read"`, `"write"`, `"sync"`, ...
        action: &'static str,
        /// The snapshot path (not the temporary file's).
        path: PathBuf,
        /// The operating system's error.
        source: io::Error,
    },
    /// The file ends early, as after a crash of a writer that did not write atomically
    /// or a copy that was cut short.
    #[error("snapshot is truncated: {actual} bytes, at least {expected} needed")]
    Truncated {
        /// The full size the header implies, or, when the header itself is cut, the
        /// smallest size the part read so far allows.
        expected: u64,
        /// The size of the file.
        actual: u64,
    },
    /// The file does not start with [`MAGIC`].
    #[error("not a bloomgate snapshot (the file does not start with the snapshot magic)")]
    BadMagic,
    /// The file was written in a format version this build cannot read.
    #[error("unsupported snapshot format version {0}; this build reads version {FORMAT_VERSION}")]
    UnsupportedVersion(u32),
    /// The header contradicts itself or the file length.
    #[error("snapshot header is inconsistent")]
    BadHeader(#[from] HeaderProblem),
    /// The checksum does not match the contents: the file was damaged after writing.
    #[error(
        "snapshot is corrupted: checksum mismatch (stored {stored:#010x}, computed {computed:#010x})"
    )]
    ChecksumMismatch {
        /// The checksum in the file.
        stored: u32,
        /// The checksum of the contents as read.
        computed: u32,
    },
    /// The checksum matched but the bit array does not fit the header's parameters, so
    /// the writer itself was faulty.
    #[error("snapshot does not hold a valid filter")]
    Layout(#[source] FilterError),
}

/// How a snapshot's header contradicts itself or the file: each a value no writer of
/// this format produces.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HeaderProblem {
    /// The header is shorter than this format version's.
    #[error("header length {0} is shorter than the {HEADER_LEN} bytes of version {FORMAT_VERSION}")]
    ShortHeader(u32),
    /// No filter has this many bits.
    #[error("bit count {0} is outside 1..={MAX_BITS}")]
    Bits(u64),
    /// Filters are made of whole blocks.
    #[error("bit count {0} is not a multiple of the {BLOCK_BITS}-bit block")]
    Unaligned(u64),
    /// Sizing never picks this many hashes; a forged count would make every lookup
    /// probe billions of bits.
    #[error("hash count {0} is outside 1..={MAX_OPTIMAL_HASHES}")]
    Hashes(u32),
    /// The file is longer than its header says.
    #[error("the file is {actual} bytes but a header of {bits} bits implies {expected}")]
    Length {
        /// The file's size.
        actual: u64,
        /// The header's bit count.
        bits: u64,
        /// The size those bits imply.
        expected: u64,
    },
    /// A watermark kind this build does not know.
    #[error("unknown watermark kind {0}")]
    WatermarkKind(u8),
    /// A creation time the clock cannot represent.
    #[error("creation time {0} s after the epoch is out of range")]
    CreatedAt(u64),
}

/// A verified snapshot's header and statistics, as `bloomgate filter inspect PATH`
/// prints them. The seed is left out on purpose (see the module docs).
#[derive(Debug, Clone, PartialEq)]
pub struct SnapshotSummary {
    /// The file described.
    pub path: PathBuf,
    /// The size of the file, in bytes.
    pub file_bytes: u64,
    /// The format version of the file.
    pub version: u32,
    /// The filter's size: capacity, target rate, bits and hashes.
    pub params: BloomParams,
    /// The filter's item count when written.
    pub items: u64,
    /// The share of bits set, in `[0, 1]`.
    pub fill_ratio: f64,
    /// The false-positive rate implied by the fill: `fill_ratio ^ hashes`.
    pub estimated_fpp: f64,
    /// Where incremental sync had got to.
    pub watermark: Option<Watermark>,
    /// When the snapshot was written.
    pub created_at: SystemTime,
    /// How long ago that was; `None` if the creation time is ahead of this host's clock.
    pub age: Option<Duration>,
}

/// Writes `filter` and `watermark` to `path` atomically: into a new temporary file in the
/// same directory, synced, then renamed over `path`, then the directory synced. Readers
/// see either the old file or the new one, never a mix; after a crash at any point `path`
/// holds one of the two. The directory is created if missing, and the temporary file is
/// removed on any error (a crash may leave one behind, named `.NAME.XXXXXX.tmp`).
///
/// The filter may be inserted into meanwhile (see [`BloomFilter::iter_words`]): every
/// key the watermark covers must have been inserted before the call, and every key
/// inserted after it must be re-applied by whoever resumes from the watermark.
///
/// Runs blocking file I/O; call it from a blocking thread in async code.
///
/// # Errors
///
/// [`SnapshotError::Io`] naming the step that failed. If only the final directory sync
/// fails, the new file is in place but might not survive a power cut.
pub fn write(
    path: &Path,
    filter: &BloomFilter,
    watermark: Option<Watermark>,
) -> Result<SnapshotInfo, SnapshotError> {
    let started = Instant::now();
    let (temp, bytes) = write_temp(path, filter, watermark)?;
    // `persist` only renames; the contents were synced by `write_temp`. On failure the
    // temporary file comes back in the error and is removed when it drops.
    temp.persist(path)
        .map_err(|e| io_error("move the temporary file onto", path)(e.error))?;
    sync_dir(parent_dir(path)).map_err(io_error("sync the directory of", path))?;
    Ok(SnapshotInfo {
        bytes,
        took: started.elapsed(),
    })
}

/// The first half of [`write()`]: the complete snapshot, synced, in a temporary file
/// beside `path` that is removed if it is dropped. Returns it and its size.
fn write_temp(
    path: &Path,
    filter: &BloomFilter,
    watermark: Option<Watermark>,
) -> Result<(NamedTempFile, u64), SnapshotError> {
    let name = path.file_name().ok_or_else(|| {
        io_error("create a temporary file for", path)(io::Error::new(
            io::ErrorKind::InvalidInput,
            "the path has no file name",
        ))
    })?;
    let dir = parent_dir(path);
    fs::create_dir_all(dir).map_err(io_error("create the directory of", path))?;
    let mut prefix = std::ffi::OsString::from(".");
    prefix.push(name);
    prefix.push(".");
    // Created readable and writable by its owner only (tempfile's default on Unix): the
    // seed is a secret.
    let mut temp = tempfile::Builder::new()
        .prefix(&prefix)
        .suffix(".tmp")
        .tempfile_in(dir)
        .map_err(io_error("create a temporary file for", path))?;
    let header = Header::of(filter, watermark, SystemTime::now());
    let bytes =
        write_contents(temp.as_file_mut(), &header, filter).map_err(io_error("write", path))?;
    temp.as_file().sync_all().map_err(io_error("sync", path))?;
    Ok((temp, bytes))
}

/// Maps an I/O error of the step `action` on the snapshot at `path`.
fn io_error<'p>(
    action: &'static str,
    path: &'p Path,
) -> impl FnOnce(io::Error) -> SnapshotError + 'p {
    move |source| SnapshotError::Io {
        action,
        path: path.to_owned(),
        source,
    }
}

/// The directory a snapshot at `path` lives in (`.` for a bare file name).
fn parent_dir(path: &Path) -> &Path {
    match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir,
        _ => Path::new("."),
    }
}

/// Reads and verifies the snapshot at `path` and rebuilds its filter.
///
/// The whole file is read into memory first, so the peak is about twice the size of the
/// bit array. Runs blocking file I/O; call it from a blocking thread in async code.
///
/// # Errors
///
/// [`SnapshotError::Io`] if the file cannot be read (`source.kind()` is `NotFound` when
/// there is no snapshot yet); otherwise the first check that failed, in the order of the
/// module docs.
pub fn read(path: &Path) -> Result<Snapshot, SnapshotError> {
    let bytes = read_file(path)?;
    decode(&bytes)
}

/// The snapshot of `filter` in memory, in the same format as a file: for publishing it
/// elsewhere than on a disk.
pub fn encode(filter: &BloomFilter, watermark: Option<Watermark>) -> Vec<u8> {
    encode_counted(filter, watermark).0
}

/// As [`encode`], with the item count the snapshot records: `filter.items()` as it was
/// when the header was written, which a filter that takes admissions meanwhile no
/// longer says afterwards.
pub fn encode_counted(filter: &BloomFilter, watermark: Option<Watermark>) -> (Vec<u8>, u64) {
    let header = Header::of(filter, watermark, SystemTime::now());
    let mut out = Vec::with_capacity(HEADER_LEN + filter.word_count() * 8 + CHECKSUM_LEN);
    // Writing into a `Vec` cannot fail.
    let _ = write_contents(&mut out, &header, filter);
    (out, header.items)
}

/// Verifies a snapshot held in memory (see [`encode`]) and rebuilds its filter, with the
/// same checks in the same order as [`read`].
///
/// # Errors
///
/// The first check that failed, in the order of the module docs.
pub fn decode_bytes(bytes: &[u8]) -> Result<Snapshot, SnapshotError> {
    decode(bytes)
}

/// Reads and verifies the snapshot at `path` and describes it; see [`SnapshotSummary`].
///
/// # Errors
///
/// As [`read`].
pub fn inspect(path: &Path) -> Result<SnapshotSummary, SnapshotError> {
    let bytes = read_file(path)?;
    let snapshot = decode(&bytes)?;
    let stats = snapshot.filter.stats();
    Ok(SnapshotSummary {
        path: path.to_owned(),
        file_bytes: bytes.len() as u64,
        version: FORMAT_VERSION,
        params: snapshot.filter.params(),
        items: stats.items,
        fill_ratio: stats.fill_ratio,
        estimated_fpp: stats.estimated_fpp,
        watermark: snapshot.watermark,
        created_at: snapshot.created_at,
        age: SystemTime::now().duration_since(snapshot.created_at).ok(),
    })
}

/// The header fields, as in the table of the module docs.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Header {
    /// The header length `H`: where the words start.
    header_len: u32,
    params: BloomParams,
    seed: u32,
    items: u64,
    /// 0 for no watermark, else [`Watermark::tag`]; checked only after the checksum.
    watermark_tag: u8,
    watermark_value: i64,
    /// Unix seconds.
    created_at: u64,
    /// The rest of a binlog watermark (its server and GTID), in the appended field.
    binlog: Option<(u32, Option<Gtid>)>,
}

/// Bytes of the appended binlog field.
const BINLOG_LEN: usize = 21;

impl Header {
    /// The header of a snapshot of `filter` taken at `now`.
    fn of(filter: &BloomFilter, watermark: Option<Watermark>, now: SystemTime) -> Self {
        let binlog = match watermark {
            Some(Watermark::Binlog(m)) => Some((m.server, m.gtid)),
            _ => None,
        };
        Self {
            header_len: (HEADER_LEN + binlog.map_or(0, |_| BINLOG_LEN)) as u32,
            binlog,
            params: filter.params(),
            seed: filter.seed(),
            items: filter.items(),
            watermark_tag: watermark.map_or(0, Watermark::tag),
            watermark_value: watermark.map_or(0, Watermark::value),
            created_at: now.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs()),
        }
    }

    /// The file size this header implies. `bits` must be at most [`MAX_BITS`], so the
    /// sum cannot overflow.
    fn file_len(&self) -> u64 {
        u64::from(self.header_len) + self.params.bits / 8 + CHECKSUM_LEN as u64
    }

    /// The header bytes as written: magic, version and the fields, `header_len` bytes.
    fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(HEADER_LEN);
        out.extend_from_slice(&MAGIC);
        out.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
        out.extend_from_slice(&self.header_len.to_le_bytes());
        out.extend_from_slice(&self.params.bits.to_le_bytes());
        out.extend_from_slice(&self.params.hashes.to_le_bytes());
        out.extend_from_slice(&self.params.expected_items.to_le_bytes());
        out.extend_from_slice(&self.params.false_positive_rate.to_bits().to_le_bytes());
        out.extend_from_slice(&self.seed.to_le_bytes());
        out.extend_from_slice(&self.items.to_le_bytes());
        out.push(self.watermark_tag);
        out.extend_from_slice(&self.watermark_value.to_le_bytes());
        out.extend_from_slice(&self.created_at.to_le_bytes());
        if let Some((server, gtid)) = self.binlog {
            out.extend_from_slice(&server.to_le_bytes());
            out.push(u8::from(gtid.is_some()));
            let g = gtid.unwrap_or(Gtid {
                domain: 0,
                server: 0,
                seq: 0,
            });
            out.extend_from_slice(&g.domain.to_le_bytes());
            out.extend_from_slice(&g.server.to_le_bytes());
            out.extend_from_slice(&g.seq.to_le_bytes());
        }
        debug_assert_eq!(out.len(), self.header_len as usize);
        out
    }

    /// The fields after the preamble; `None` if `fields` is shorter than they are.
    fn decode(header_len: u32, fields: &[u8]) -> Option<Self> {
        let mut r = Fields(fields);
        let bits = r.u64()?;
        let hashes = r.u32()?;
        let expected_items = r.u64()?;
        let false_positive_rate = f64::from_bits(r.u64()?);
        Some(Self {
            header_len,
            params: BloomParams {
                expected_items,
                false_positive_rate,
                bits,
                hashes,
            },
            seed: r.u32()?,
            items: r.u64()?,
            watermark_tag: r.take::<1>()?[0],
            watermark_value: i64::from_le_bytes(r.take()?),
            created_at: r.u64()?,
            binlog: if header_len as usize >= HEADER_LEN + BINLOG_LEN {
                let server = r.u32()?;
                let has_gtid = r.take::<1>()?[0] == 1;
                let gtid = Gtid {
                    domain: r.u32()?,
                    server: r.u32()?,
                    seq: r.u64()?,
                };
                Some((server, has_gtid.then_some(gtid)))
            } else {
                None
            },
        })
    }
}

/// A cursor over little-endian fields.
struct Fields<'a>(&'a [u8]);

impl Fields<'_> {
    fn take<const N: usize>(&mut self) -> Option<[u8; N]> {
        let (head, rest) = self.0.split_first_chunk::<N>()?;
        self.0 = rest;
        Some(*head)
    }

    fn u32(&mut self) -> Option<u32> {
        self.take().map(u32::from_le_bytes)
    }

    fn u64(&mut self) -> Option<u64> {
        self.take().map(u64::from_le_bytes)
    }
}

/// Writes header, words and checksum to `file` in [`CHUNK`]-sized pieces. Returns the
/// number of bytes written.
fn write_contents(file: &mut impl Write, header: &Header, filter: &BloomFilter) -> io::Result<u64> {
    let mut buf = Vec::with_capacity(CHUNK + HEADER_LEN);
    let mut crc = crc32fast::Hasher::new();
    let mut written = 0u64;
    let mut flush = |buf: &mut Vec<u8>| -> io::Result<()> {
        crc.update(buf);
        file.write_all(buf)?;
        written += buf.len() as u64;
        buf.clear();
        Ok(())
    };
    buf.extend_from_slice(&header.encode());
    for word in filter.iter_words() {
        buf.extend_from_slice(&word.to_le_bytes());
        if buf.len() >= CHUNK {
            flush(&mut buf)?;
        }
    }
    flush(&mut buf)?;
    let checksum = crc.finalize().to_le_bytes();
    file.write_all(&checksum)?;
    Ok(written + checksum.len() as u64)
}

/// The whole file at `path`.
fn read_file(path: &Path) -> Result<Vec<u8>, SnapshotError> {
    fs::read(path).map_err(|source| SnapshotError::Io {
        action: "read",
        path: path.to_owned(),
        source,
    })
}

/// Verifies a whole snapshot file and rebuilds its filter, checking in the order of the
/// module docs.
fn decode(bytes: &[u8]) -> Result<Snapshot, SnapshotError> {
    let actual = bytes.len() as u64;
    let truncated = |expected: u64| SnapshotError::Truncated { expected, actual };

    let seen = bytes.len().min(MAGIC.len());
    if bytes[..seen] != MAGIC[..seen] {
        return Err(SnapshotError::BadMagic);
    }
    let Some((preamble, rest)) = bytes.split_first_chunk::<PREAMBLE_LEN>() else {
        return Err(truncated((HEADER_LEN + CHECKSUM_LEN) as u64));
    };
    let mut r = Fields(&preamble[MAGIC.len()..]);
    let (Some(version), Some(header_len)) = (r.u32(), r.u32()) else {
        return Err(truncated((HEADER_LEN + CHECKSUM_LEN) as u64));
    };
    if version != FORMAT_VERSION {
        return Err(SnapshotError::UnsupportedVersion(version));
    }
    if (header_len as usize) < HEADER_LEN {
        return Err(HeaderProblem::ShortHeader(header_len).into());
    }
    let min_len = u64::from(header_len) + CHECKSUM_LEN as u64;
    if actual < u64::from(header_len) {
        return Err(truncated(min_len));
    }
    let header = Header::decode(header_len, rest).ok_or_else(|| truncated(min_len))?;
    let params = header.params;
    if !(1..=MAX_BITS).contains(&params.bits) {
        return Err(HeaderProblem::Bits(params.bits).into());
    }
    if !params.bits.is_multiple_of(BLOCK_BITS) {
        return Err(HeaderProblem::Unaligned(params.bits).into());
    }
    if params.hashes == 0 || params.hashes > MAX_OPTIMAL_HASHES {
        return Err(HeaderProblem::Hashes(params.hashes).into());
    }
    let expected = header.file_len();
    if actual < expected {
        return Err(truncated(expected));
    }
    if actual > expected {
        return Err(HeaderProblem::Length {
            actual,
            bits: params.bits,
            expected,
        }
        .into());
    }

    let (body, stored) = bytes
        .split_last_chunk::<CHECKSUM_LEN>()
        .ok_or_else(|| truncated(expected))?;
    let stored = u32::from_le_bytes(*stored);
    let computed = crc32fast::hash(body);
    if stored != computed {
        return Err(SnapshotError::ChecksumMismatch { stored, computed });
    }

    let watermark = match header.watermark_tag {
        0 => None,
        tag => Some(
            match Watermark::from_parts(tag, header.watermark_value)
                .ok_or(HeaderProblem::WatermarkKind(tag))?
            {
                Watermark::Binlog(m) => {
                    let (server, gtid) = header.binlog.unwrap_or((0, None));
                    Watermark::Binlog(BinlogMark { server, gtid, ..m })
                }
                other => other,
            },
        ),
    };
    let created_at = UNIX_EPOCH
        .checked_add(Duration::from_secs(header.created_at))
        .ok_or(HeaderProblem::CreatedAt(header.created_at))?;
    let (words, _) = body[header_len as usize..].as_chunks::<8>();
    let words = words.iter().map(|w| u64::from_le_bytes(*w)).collect();
    let filter = BloomFilter::from_raw(params, header.seed, header.items, words)
        .map_err(SnapshotError::Layout)?;
    Ok(Snapshot {
        filter,
        watermark,
        created_at,
    })
}

/// Makes a rename in `dir` durable. Unix only: elsewhere a directory cannot be opened
/// for syncing, and the rename is as durable as the platform makes it.
fn sync_dir(dir: &Path) -> io::Result<()> {
    #[cfg(unix)]
    File::open(dir)?.sync_all()?;
    #[cfg(not(unix))]
    let _ = dir;
    Ok(())
}

#[cfg(test)]
mod tests;
