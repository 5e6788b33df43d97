//! Shared generations: a builder publishes its filter as snapshot bytes (the versioned,
//! checksummed snapshot format) in chunks under a new generation number, then flips the
//! filter's `current` hash to it in one script that also checks the builder's lease, sets
//! the superseded generation to expire after the grace period, and announces the new
//! one on the change stream. Followers read `current`, fetch the chunks, verify them and
//! judge whether the filter is plausible before it is swapped in.
//!
//! Key names are built inside the publishing script from a prefix, so a fleet needs a
//! single Redis server (or a primary with replicas), not Redis Cluster.

use std::collections::HashMap;

use bloomgate_core::redis_conn::RedisConn;
use redis::Script;

use super::keys::Keys;
use super::lease::Lease;
use super::stream::StreamPos;
use crate::gate::{Mismatch, fits_config};
use bloomgate_core::config::FilterConfig;
use bloomgate_core::filter::snapshot::{self, Snapshot, SnapshotError};
use bloomgate_core::key::{KeyBytes, OwnedKey};

/// What `current` says about the generation it names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Current {
    /// The generation number.
    pub generation: u64,
    /// How many chunks hold it.
    pub chunks: u64,
    /// Their total length.
    pub bytes: u64,
    /// The item count its builder recorded.
    pub items: u64,
    /// The change stream position at which its build started: entries after it are
    /// replayed on top of it.
    pub start: StreamPos,
    /// The instance that published it.
    pub by: String,
    /// When it was published, in Unix milliseconds.
    pub at_ms: u64,
}

/// Why a generation could not be published or was refused.
#[derive(Debug, thiserror::Error)]
pub enum GenerationError {
    /// Redis failed.
    #[error("redis")]
    Redis(#[from] redis::RedisError),
    /// This instance no longer holds the lease: it must not publish.
    #[error("the builder lease was lost before publishing")]
    Fenced,
    /// A chunk expired before the flip (the upload took longer than its expiry).
    #[error("a chunk of the new generation vanished before it was made current")]
    ChunkMissing,
    /// `current` kept changing while the generation was being made current.
    #[error("the current generation changed three times during the publication")]
    Raced,
    /// `current` holds a field that cannot be read.
    #[error("current generation record is malformed: {0}")]
    BadRecord(&'static str),
    /// A chunk is missing or the chunks do not add up to the recorded length.
    #[error("generation {generation} is truncated: {actual} of {expected} bytes")]
    Truncated {
        /// The generation.
        generation: u64,
        /// The recorded length.
        expected: u64,
        /// What was found.
        actual: u64,
    },
    /// The bytes are not a valid snapshot (checksum, header, layout).
    #[error("generation is not a valid snapshot")]
    Snapshot(#[from] SnapshotError),
    /// A valid snapshot that cannot be the fleet's filter.
    #[error("generation is implausible")]
    Implausible(#[from] Implausible),
    /// The task that decodes the fetched bytes did not finish (it panicked, or the
    /// runtime is shutting down).
    #[error("generation is implausible: decoder task failed")]
    Decoder(#[source] tokio::task::JoinError),
}

/// Why a valid snapshot cannot be the fleet's filter (see [`judge`]).
#[derive(Debug, thiserror::Error)]
pub enum Implausible {
    /// Its parameters do not fit this instance's configuration.
    #[error(transparent)]
    Mismatch(#[from] Mismatch),
    /// The snapshot and the `current` record disagree on how many keys it holds.
    #[error("{found} items in the snapshot, {recorded} in the record")]
    Items {
        /// Keys the snapshot says it holds.
        found: u64,
        /// Keys the record says.
        recorded: u64,
    },
    /// Far fewer keys than the filter this instance serves.
    #[error("{found} items, less than half of the {live} this instance holds")]
    Shrunk {
        /// Keys the snapshot holds.
        found: u64,
        /// Keys of the filter this instance serves.
        live: u64,
    },
    /// Fewer bits set than its key count must set.
    #[error("{fill:.4} of its bits set where {items} items set about {expected:.4}")]
    Underfilled {
        /// Share of bits set.
        fill: f64,
        /// Keys it claims to hold.
        items: u64,
        /// Share of bits that many keys set.
        expected: f64,
    },
    /// A key admitted before the generation's build started is not in it.
    #[error("key {key}, admitted at {at}, is missing")]
    Missing {
        /// The key.
        key: OwnedKey,
        /// Where its admission stands in the change stream.
        at: StreamPos,
    },
}

/// Makes a generation current, fenced by the lease. `KEYS`: the lease, the `current`
/// record, the stream, then the new generation's `ARGV[3]` chunks, then the chunks of
/// the generation the caller read as current (`ARGV[10]`, with `ARGV[11]` chunks; `''`
/// for none). Every key is named in `KEYS`, all in the fleet's hash slot. Returns 1 when
/// done, 0 when the lease is not the caller's, -1 when a new chunk is gone, -2 when
/// `current` changed since the caller read it (read it again).
const PUBLISH: &str = r"
if redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return 0
end
local new = tonumber(ARGV[3])
for i = 1, new do
  local chunk = KEYS[3 + i]
  if redis.call('PERSIST', chunk) == 0 and redis.call('EXISTS', chunk) == 0 then
    return -1
  end
end
local old = redis.call('HMGET', KEYS[2], 'gen', 'chunks')
if (old[1] or '') ~= ARGV[10] or (old[1] and old[2] ~= ARGV[11]) then
  return -2
end
redis.call('DEL', KEYS[2])
redis.call('HSET', KEYS[2], 'gen', ARGV[2], 'chunks', ARGV[3], 'bytes', ARGV[4], 'items', ARGV[5],
  'start', ARGV[6], 'by', ARGV[7], 'at', ARGV[8])
if old[1] and old[1] ~= ARGV[2] then
  for i = 3 + new + 1, #KEYS do
    redis.call('PEXPIRE', KEYS[i], ARGV[9])
  end
end
redis.call('XADD', KEYS[3], '*', 'op', 'gen', 'f', ARGV[12], 'g', ARGV[2], 'src', ARGV[7])
return 1
";

/// What publishing needs to know besides the bytes.
pub struct Publication<'a> {
    /// The filter's name.
    pub filter: &'a str,
    /// The lease the publisher holds.
    pub lease: &'a Lease,
    /// The snapshot bytes.
    pub bytes: &'a [u8],
    /// Its item count.
    pub items: u64,
    /// The stream position at which its build started.
    pub start: StreamPos,
    /// The publishing instance.
    pub instance: &'a str,
    /// The highest generation number the publisher has seen: the new one is higher even
    /// when Redis lost its counter (a restart without its data), so a number is never
    /// reused for a different filter.
    pub after: u64,
    /// Bytes per chunk.
    pub chunk_bytes: usize,
    /// How long the superseded generation stays readable.
    pub grace_ms: u64,
    /// How long uploaded chunks live if they are never made current.
    pub upload_ttl_ms: u64,
}

/// Uploads and flips a generation; returns its number.
pub async fn publish(
    conn: &mut RedisConn,
    keys: &Keys,
    p: Publication<'_>,
) -> Result<Current, GenerationError> {
    let seq = keys.generation_seq(p.filter);
    let (generation,): (u64,) = redis::pipe()
        .cmd("SET")
        .arg(&seq)
        .arg(p.after)
        .arg("NX")
        .ignore()
        .cmd("INCR")
        .arg(&seq)
        .query_async(conn)
        .await?;
    let chunk_bytes = p.chunk_bytes.max(1);
    let mut chunks = 0u64;
    // Uploaded a few chunks per round trip, so one large reply never holds the link.
    for group in p
        .bytes
        .chunks(chunk_bytes * 8)
        .map(|g| g.chunks(chunk_bytes))
    {
        let mut pipe = redis::pipe();
        for chunk in group {
            pipe.cmd("SET")
                .arg(keys.chunk(p.filter, generation, chunks))
                .arg(chunk)
                .arg("PX")
                .arg(p.upload_ttl_ms)
                .ignore();
            chunks += 1;
        }
        pipe.query_async::<()>(conn).await?;
    }
    let at_ms = unix_ms();
    let script = Script::new(PUBLISH);
    let mut flipped = -2;
    // `current` is read first so that the chunks it names can be declared to the
    // script; a publication that raced another (it should not: the lease fences them)
    // reads it again.
    for _ in 0..3 {
        let (old_gen, old_chunks): (Option<u64>, Option<u64>) = redis::cmd("HMGET")
            .arg(keys.current(p.filter))
            .arg("gen")
            .arg("chunks")
            .query_async(conn)
            .await?;
        let mut call = script.key(keys.lease(p.filter));
        call.key(keys.current(p.filter)).key(keys.stream());
        for i in 0..chunks {
            call.key(keys.chunk(p.filter, generation, i));
        }
        if let (Some(g), Some(n)) = (old_gen, old_chunks)
            && g != generation
        {
            for i in 0..n {
                call.key(keys.chunk(p.filter, g, i));
            }
        }
        flipped = call
            .arg(&p.lease.value)
            .arg(generation)
            .arg(chunks)
            .arg(p.bytes.len() as u64)
            .arg(p.items)
            .arg(p.start.to_string())
            .arg(p.instance)
            .arg(at_ms)
            .arg(p.grace_ms)
            .arg(old_gen.map(|g| g.to_string()).unwrap_or_default())
            .arg(old_chunks.map(|n| n.to_string()).unwrap_or_default())
            .arg(p.filter)
            .invoke_async(conn)
            .await?;
        if flipped != -2 {
            break;
        }
    }
    match flipped {
        1 => Ok(Current {
            generation,
            chunks,
            bytes: p.bytes.len() as u64,
            items: p.items,
            start: p.start,
            by: p.instance.to_owned(),
            at_ms,
        }),
        0 => Err(GenerationError::Fenced),
        -1 => Err(GenerationError::ChunkMissing),
        _ => Err(GenerationError::Raced),
    }
}

/// Reads `current` of `filter`; `None` when no generation was published.
pub async fn current(
    conn: &mut RedisConn,
    keys: &Keys,
    filter: &str,
) -> Result<Option<Current>, GenerationError> {
    let fields: HashMap<String, String> = redis::cmd("HGETALL")
        .arg(keys.current(filter))
        .query_async(conn)
        .await?;
    if fields.is_empty() {
        return Ok(None);
    }
    let num = |name: &'static str| -> Result<u64, GenerationError> {
        fields
            .get(name)
            .and_then(|v| v.parse().ok())
            .ok_or(GenerationError::BadRecord(name))
    };
    Ok(Some(Current {
        generation: num("gen")?,
        chunks: num("chunks")?,
        bytes: num("bytes")?,
        items: num("items")?,
        start: fields
            .get("start")
            .and_then(|s| s.parse().ok())
            .ok_or(GenerationError::BadRecord("start"))?,
        by: fields.get("by").cloned().unwrap_or_default(),
        at_ms: num("at")?,
    }))
}

/// Fetches the chunks of `current` and verifies them as a snapshot.
pub async fn fetch(
    conn: &mut RedisConn,
    keys: &Keys,
    filter: &str,
    current: &Current,
) -> Result<Snapshot, GenerationError> {
    let truncated = |actual: u64| GenerationError::Truncated {
        generation: current.generation,
        expected: current.bytes,
        actual,
    };
    // Checked before anything is allocated from it: `current` is read from Redis.
    if current.bytes > bloomgate_core::filter::MAX_BITS / 8 + 4096
        || current.chunks > current.bytes.max(1)
    {
        return Err(GenerationError::BadRecord("bytes"));
    }
    let mut bytes = Vec::with_capacity(current.bytes as usize);
    let mut next = 0u64;
    while next < current.chunks {
        let last = (next + 8).min(current.chunks);
        let names: Vec<String> = (next..last)
            .map(|i| keys.chunk(filter, current.generation, i))
            .collect();
        let parts: Vec<Option<Vec<u8>>> = redis::cmd("MGET").arg(&names).query_async(conn).await?;
        for part in parts {
            let Some(part) = part else {
                return Err(truncated(bytes.len() as u64));
            };
            if bytes.len() as u64 + part.len() as u64 > current.bytes {
                return Err(truncated(bytes.len() as u64 + part.len() as u64));
            }
            bytes.extend_from_slice(&part);
        }
        next = last;
    }
    if bytes.len() as u64 != current.bytes {
        return Err(truncated(bytes.len() as u64));
    }
    let snap = tokio::task::spawn_blocking(move || snapshot::decode_bytes(&bytes))
        .await
        .map_err(GenerationError::Decoder)??;
    Ok(snap)
}

/// Judges whether a verified snapshot can be the fleet's filter for `config`: its
/// parameters, its item count against the record and against the filter this instance
/// serves (`live_items`), a fill that matches that count (an all-zero bit array claiming
/// items is refused), and every key in `recent` that was admitted at or before the
/// generation's start (so its builder had it) present in it.
pub fn judge(
    snap: &Snapshot,
    current: &Current,
    config: &FilterConfig,
    live_items: Option<u64>,
    recent: &[(StreamPos, OwnedKey)],
) -> Result<(), GenerationError> {
    let p = snap.filter.params();
    fits_config(p, config).map_err(Implausible::Mismatch)?;
    let stats = snap.filter.stats();
    if stats.items != current.items {
        return Err(Implausible::Items {
            found: stats.items,
            recorded: current.items,
        }
        .into());
    }
    if let Some(live) = live_items
        && stats.items < live / 2
    {
        return Err(Implausible::Shrunk {
            found: stats.items,
            live,
        }
        .into());
    }
    // A Bloom filter holding n keys has about 1 - e^(-kn/m) of its bits set; an
    // honest one is never far below that.
    let expected_fill = 1.0 - (-(f64::from(p.hashes) * stats.items as f64) / p.bits as f64).exp();
    if stats.fill_ratio < expected_fill * 0.5 {
        return Err(Implausible::Underfilled {
            fill: stats.fill_ratio,
            items: stats.items,
            expected: expected_fill,
        }
        .into());
    }
    let mut bytes = KeyBytes::new();
    for (at, key) in recent {
        if *at <= current.start && !snap.filter.contains(bytes.of(&key.as_norm())) {
            return Err(Implausible::Missing {
                key: key.clone(),
                at: *at,
            }
            .into());
        }
    }
    Ok(())
}

/// The time now in Unix milliseconds.
pub fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}
