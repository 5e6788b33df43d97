//! A filter held in Redis: the bits of one generation of a filter as Redis strings, a
//! `current` record that names the generation and carries its layout (seed, size,
//! hashes, sharding), and the two scripts that read and set a key's bits in one round
//! trip each. Any client that can hash a key the way [`bloomgate_core::filter::locate`] does can
//! ask the same filter the same question (see `docs/redis-gate.md`).
//!
//! # Keys, for namespace `NS` and filter `F`
//!
//! | key | type | holds |
//! |---|---|---|
//! | `{NS}:gate:F:current` | hash | `gen`, `seed`, `bits`, `hashes`, `shard_blocks`, `shards`, `items`, `at` |
//! | `{NS}:gate:F:gen_seq` | integer | the last generation number drawn |
//! | `{NS:gate:F:S}:gen:G` | string | shard `S` of generation `G`: blocks `S * shard_blocks ..` of the filter, 64 bytes each |
//!
//! The braces are Redis Cluster hash tags: the record and the counter share the
//! fleet's slot, and each shard index has a slot of its own, so the shards of a large
//! filter, and the checks that read them, spread over the cluster's primaries. Every
//! script touches one key, named in its `KEYS`.
//!
//! A shard is written whole before `current` names its generation, and is never shorter
//! than its blocks: a read that finds a shard empty has found a Redis that lost it, and
//! says so ([`HeldError::Missing`]) rather than answer "absent".
//!
//! # Why the caller hashes
//!
//! Redis's Lua has no 64-bit integers, so murmur3 cannot run in the script. The caller
//! computes the block and the in-block bit positions; the check script reads the block's
//! 64 bytes with one `GETRANGE` and tests the positions; the add script sets them with
//! `SETBIT`. Neither script computes a key name from anything but its `KEYS`.

use std::collections::HashMap;
use std::time::Duration;

use redis::Script;
use redis::aio::ConnectionLike;

pub use bloomgate_core::config::{DEFAULT_SHARD_BYTES, MAX_SHARD_BYTES};
use bloomgate_core::filter::{BLOCK_BITS, BloomFilter, locate};

/// The bytes of one block.
const BLOCK_BYTES: u64 = BLOCK_BITS / 8;

/// Bytes per `SETRANGE` when a generation is written.
const UPLOAD_CHUNK: usize = 1 << 20;

/// Chunks sent per round trip when a generation is written.
const UPLOAD_PIPELINE: usize = 8;

/// Reads the block at byte `ARGV[1]` of shard `KEYS[1]` and tests the bit positions
/// `ARGV[2..]` (each 0..511: bit `p % 8`, least significant first, of byte `p / 8`).
/// 1: every bit set (the key may be present); 0: some bit clear (certainly absent);
/// -1: the shard is not there (Redis lost it: no answer).
pub const CHECK_SCRIPT: &str = r"
local block = redis.call('GETRANGE', KEYS[1], ARGV[1], ARGV[1] + 63)
if #block < 64 then
  return -1
end
for i = 2, #ARGV do
  local p = tonumber(ARGV[i])
  local byte = string.byte(block, math.floor(p / 8) + 1)
  if bit.band(byte, bit.lshift(1, p % 8)) == 0 then
    return 0
  end
end
return 1
";

/// Sets the bit positions `ARGV[2..]` of the block at byte `ARGV[1]` of shard `KEYS[1]`,
/// as [`CHECK_SCRIPT`] reads them (Redis numbers a string's bits from the most
/// significant of each byte, hence `7 - p % 8`). Returns how many were newly set, or -1
/// without writing anything when the shard is not there (a `SETBIT` on a missing key
/// would create a short string that reads as "absent" for every other key).
pub const ADD_SCRIPT: &str = r"
if redis.call('STRLEN', KEYS[1]) < ARGV[1] + 64 then
  return -1
end
local set = 0
for i = 2, #ARGV do
  local p = tonumber(ARGV[i])
  local at = (ARGV[1] + math.floor(p / 8)) * 8 + 7 - p % 8
  if redis.call('SETBIT', KEYS[1], at, 1) == 0 then
    set = set + 1
  end
end
return set
";

/// Records a generation's layout in `KEYS[1]` (the `current` record) in place of the one
/// there, keeping the replaced generation's number and shard count as `prev` and
/// `prev_shards`, and returns the replaced record's generation, shards, `prev` and
/// `prev_shards` (those it has).
const FLIP_SCRIPT: &str = r"
local old = redis.call('HMGET', KEYS[1], 'gen', 'shards', 'prev', 'prev_shards')
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], 'gen', ARGV[1], 'seed', ARGV[2], 'bits', ARGV[3], 'hashes', ARGV[4],
  'shard_blocks', ARGV[5], 'shards', ARGV[6], 'items', ARGV[7], 'at', ARGV[8])
local replaced = {}
if old[1] and old[2] and old[1] ~= ARGV[1] then
  redis.call('HSET', KEYS[1], 'prev', old[1], 'prev_shards', old[2])
  replaced = {old[1], old[2]}
  if old[3] and old[4] and old[3] ~= ARGV[1] then
    replaced[3] = old[3]
    replaced[4] = old[4]
  end
end
return replaced
";

/// Why a Redis-held filter could not be written or read.
#[derive(Debug, thiserror::Error)]
pub enum HeldError {
    /// Redis failed or could not be reached.
    #[error("redis")]
    Redis(#[from] redis::RedisError),
    /// Redis did not answer within the check timeout.
    #[error("redis did not answer within {0:?}")]
    Timeout(Duration),
    /// A shard the layout names is not in Redis: it lost its data, or the generation
    /// expired. No answer can be given from it.
    #[error("shard {shard} of generation {generation} is not in redis")]
    Missing {
        /// The generation.
        generation: u64,
        /// The shard.
        shard: u64,
    },
    /// A shard written for a new generation was gone when it was to be made current
    /// (it expired during a slow upload, or Redis lost it); `current` was not changed.
    #[error("a shard of generation {generation} vanished before it was made current")]
    Vanished {
        /// The generation that was not made current.
        generation: u64,
    },
    /// The `current` record holds a field that cannot be read, or a layout no filter
    /// can have.
    #[error("the current record is malformed")]
    BadRecord(#[from] BadRecord),
    /// A shard size that is not a whole number of blocks, or larger than Redis allows.
    #[error("shard size {0} is not a multiple of 64 bytes in 64..={MAX_SHARD_BYTES}")]
    ShardSize(u64),
}

/// The key names of one filter held in Redis.
#[derive(Debug, Clone)]
pub struct HeldKeys {
    /// `{NS}:gate:F:`, what the record and the counter start with.
    prefix: String,
    /// `NS:gate:F:`, what the hash tag of a shard starts with.
    shard_tag: String,
}

impl HeldKeys {
    /// The keys of filter `filter` under namespace `namespace`.
    pub fn new(namespace: &str, filter: &str) -> HeldKeys {
        HeldKeys {
            prefix: format!("{{{namespace}}}:gate:{filter}:"),
            shard_tag: format!("{namespace}:gate:{filter}:"),
        }
    }

    /// The current generation's record.
    pub fn current(&self) -> String {
        format!("{}current", self.prefix)
    }

    /// The generation counter.
    pub fn generation_seq(&self) -> String {
        format!("{}gen_seq", self.prefix)
    }

    /// Shard `shard` of generation `generation`.
    pub fn shard(&self, generation: u64, shard: u64) -> String {
        format!("{{{}{shard}}}:gen:{generation}", self.shard_tag)
    }
}

/// One generation's layout: everything a reader needs to find a key's bits.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layout {
    /// The generation number.
    pub generation: u64,
    /// The murmur3 seed of this generation. Whoever holds it can compute which absent
    /// keys the filter lets through.
    pub seed: u32,
    /// Bits in the filter, a multiple of 512.
    pub bits: u64,
    /// Probes per key.
    pub hashes: u32,
    /// Blocks per shard (the last shard may hold fewer).
    pub shard_blocks: u64,
    /// Keys the filter held when the generation was written.
    pub items: u64,
}

/// Where a key's bits are in Redis: one block of one shard, and the positions in it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Spot {
    /// The shard index.
    pub shard: u64,
    /// The block's first byte within the shard.
    pub offset: u64,
    /// The in-block bit positions, `hashes` of them.
    pub positions: Vec<u16>,
}

impl Layout {
    /// The layout of `filter` written as generation `generation` in shards of
    /// `shard_bytes`.
    ///
    /// # Errors
    ///
    /// [`HeldError::ShardSize`] unless `shard_bytes` is a multiple of 64 in
    /// `64..=MAX_SHARD_BYTES`.
    pub fn of(
        filter: &BloomFilter,
        generation: u64,
        shard_bytes: u64,
    ) -> Result<Layout, HeldError> {
        if !(BLOCK_BYTES..=MAX_SHARD_BYTES).contains(&shard_bytes)
            || !shard_bytes.is_multiple_of(BLOCK_BYTES)
        {
            return Err(HeldError::ShardSize(shard_bytes));
        }
        let params = filter.params();
        Ok(Layout {
            generation,
            seed: filter.seed(),
            bits: params.bits,
            hashes: params.hashes,
            shard_blocks: shard_bytes / BLOCK_BYTES,
            items: filter.items(),
        })
    }

    /// Blocks in the filter.
    pub fn blocks(&self) -> u64 {
        self.bits / BLOCK_BITS
    }

    /// Shards holding the filter.
    pub fn shards(&self) -> u64 {
        self.blocks().div_ceil(self.shard_blocks)
    }

    /// Where `key`'s bits are.
    pub fn spot(&self, key: &[u8]) -> Spot {
        let (block, probes) = locate(key, self.seed, self.blocks(), self.hashes);
        Spot {
            shard: block / self.shard_blocks,
            offset: (block % self.shard_blocks) * BLOCK_BYTES,
            // Positions are below 512.
            positions: probes.map(|p| p as u16).collect(),
        }
    }
}

/// What writing a generation needs besides the filter.
#[derive(Debug, Clone, Copy)]
pub struct Upload {
    /// Bytes per shard (a multiple of 64, at most [`MAX_SHARD_BYTES`]).
    pub shard_bytes: u64,
    /// How long written shards live if their generation is never made current.
    pub upload_ttl: Duration,
    /// How long the superseded generation stays readable once the new one is current.
    pub grace: Duration,
}

/// Writes `filter` into Redis as a new generation, shard by shard in pipelined batches,
/// and makes it current; returns its layout. Readers see the old generation until the
/// flip and the new one after it, never a part-written one.
///
/// # Errors
///
/// [`HeldError::ShardSize`] for a bad shard size, [`HeldError::Redis`] when a command
/// fails, [`HeldError::Vanished`] when a written shard was gone at the flip.
pub async fn publish<C: ConnectionLike + Send>(
    conn: &mut C,
    keys: &HeldKeys,
    filter: &BloomFilter,
    upload: Upload,
) -> Result<Layout, HeldError> {
    let layout = write(conn, keys, filter, upload, 0).await?;
    flip(conn, keys, &layout, upload).await?;
    Ok(layout)
}

/// Writes `filter` as a new generation, numbered above `after` even when Redis lost its
/// counter, without making it current; its shards expire after `upload.upload_ttl`
/// unless [`flip`] keeps them. Set bits of the filter that change while it is read may
/// or may not be in the copy.
///
/// # Errors
///
/// As [`publish`].
pub async fn write<C: ConnectionLike + Send>(
    conn: &mut C,
    keys: &HeldKeys,
    filter: &BloomFilter,
    upload: Upload,
    after: u64,
) -> Result<Layout, HeldError> {
    let (generation,): (u64,) = redis::pipe()
        .cmd("SET")
        .arg(keys.generation_seq())
        .arg(after)
        .arg("NX")
        .ignore()
        .cmd("INCR")
        .arg(keys.generation_seq())
        .query_async(conn)
        .await?;
    let layout = Layout::of(filter, generation, upload.shard_bytes)?;
    let ttl_ms = millis(upload.upload_ttl);
    let shard_len = (layout.shard_blocks * BLOCK_BYTES) as usize;
    let mut words = filter.iter_words();
    let mut chunk = Vec::with_capacity(UPLOAD_CHUNK.min(shard_len));
    for shard in 0..layout.shards() {
        let name = keys.shard(generation, shard);
        let blocks = layout
            .shard_blocks
            .min(layout.blocks() - shard * layout.shard_blocks);
        let len = (blocks * BLOCK_BYTES) as usize;
        let mut pipe = redis::pipe();
        let mut queued = 0;
        let mut at = 0usize;
        while at < len {
            chunk.clear();
            let take = UPLOAD_CHUNK.min(len - at);
            for w in words.by_ref().take(take / 8) {
                chunk.extend_from_slice(&w.to_le_bytes());
            }
            pipe.cmd("SETRANGE")
                .arg(&name)
                .arg(at)
                .arg(&chunk[..])
                .ignore();
            if at == 0 {
                pipe.cmd("PEXPIRE").arg(&name).arg(ttl_ms).ignore();
            }
            at += take;
            queued += 1;
            if queued == UPLOAD_PIPELINE {
                pipe.query_async::<()>(conn).await?;
                pipe = redis::pipe();
                queued = 0;
            }
        }
        if queued > 0 {
            pipe.query_async::<()>(conn).await?;
        }
    }
    Ok(layout)
}

/// Makes a generation written by [`write`] current, and sets the one it replaces to
/// expire after `upload.grace`.
///
/// # Errors
///
/// [`HeldError::Redis`], or [`HeldError::Vanished`] when one of its shards is gone;
/// `current` is then unchanged.
pub async fn flip<C: ConnectionLike + Send>(
    conn: &mut C,
    keys: &HeldKeys,
    layout: &Layout,
    upload: Upload,
) -> Result<(), HeldError> {
    // The shards live in slots of their own, so no one script can see them and the
    // record together. Each shard is kept first (a kept shard no longer expires), and
    // the record names the generation only once all of them are.
    for shard in 0..layout.shards() {
        let name = keys.shard(layout.generation, shard);
        let (kept, exists): (i64, i64) = redis::pipe()
            .cmd("PERSIST")
            .arg(&name)
            .cmd("EXISTS")
            .arg(&name)
            .query_async(conn)
            .await?;
        if kept == 0 && exists == 0 {
            return Err(HeldError::Vanished {
                generation: layout.generation,
            });
        }
    }
    let replaced: Vec<u64> = Script::new(FLIP_SCRIPT)
        .key(keys.current())
        .arg(layout.generation)
        .arg(layout.seed)
        .arg(layout.bits)
        .arg(layout.hashes)
        .arg(layout.shard_blocks)
        .arg(layout.shards())
        .arg(layout.items)
        .arg(unix_ms())
        .invoke_async(conn)
        .await?;
    // The superseded generation stays readable for the grace period: instances that
    // still check it finish with it. The one it superseded in turn is set to expire as
    // well, in case the instance that flipped to it died before it could do so.
    let grace = millis(upload.grace);
    for pair in replaced.chunks_exact(2) {
        let (old, shards) = (pair[0], pair[1]);
        for shard in 0..shards {
            redis::cmd("PEXPIRE")
                .arg(keys.shard(old, shard))
                .arg(grace)
                .query_async::<()>(conn)
                .await?;
        }
    }
    Ok(())
}

/// The layout of the current generation; `None` when none was published (or Redis lost
/// it).
///
/// # Errors
///
/// [`HeldError::Redis`] when the read fails, [`HeldError::BadRecord`] for a record no
/// filter can have.
pub async fn current<C: ConnectionLike + Send>(
    conn: &mut C,
    keys: &HeldKeys,
) -> Result<Option<Layout>, HeldError> {
    let fields: HashMap<String, String> = redis::cmd("HGETALL")
        .arg(keys.current())
        .query_async(conn)
        .await?;
    if fields.is_empty() {
        return Ok(None);
    }
    Layout::from_fields(&fields).map(Some)
}

/// The shard name and script arguments for `key` under `layout`.
fn invocation<'s>(
    keys: &HeldKeys,
    layout: &Layout,
    script: &'s Script,
    key: &[u8],
) -> (redis::ScriptInvocation<'s>, Spot) {
    let spot = layout.spot(key);
    let mut call = script.key(keys.shard(layout.generation, spot.shard));
    call.arg(spot.offset);
    for p in &spot.positions {
        call.arg(*p);
    }
    (call, spot)
}

/// The scripts, hashed once.
pub struct Scripts {
    check: Script,
    add: Script,
}

impl Scripts {
    /// Both scripts; Redis loads them on first use, and again whenever it answers
    /// `NOSCRIPT` (after a restart or a failover).
    pub fn new() -> Scripts {
        Scripts {
            check: Script::new(CHECK_SCRIPT),
            add: Script::new(ADD_SCRIPT),
        }
    }

    /// Whether `key` may be in the generation `layout` describes: one script call, one
    /// round trip (concurrent calls on one multiplexed connection share its pipeline).
    ///
    /// # Errors
    ///
    /// [`HeldError::Redis`] when the call fails, [`HeldError::Missing`] when the key's
    /// shard is not in Redis.
    pub async fn check<C: ConnectionLike + Send>(
        &self,
        conn: &mut C,
        keys: &HeldKeys,
        layout: &Layout,
        key: &[u8],
    ) -> Result<bool, HeldError> {
        let (call, spot) = invocation(keys, layout, &self.check, key);
        match call.invoke_async::<i64>(conn).await? {
            1 => Ok(true),
            0 => Ok(false),
            _ => Err(HeldError::Missing {
                generation: layout.generation,
                shard: spot.shard,
            }),
        }
    }

    /// Sets `key`'s bits in the generation `layout` describes; returns how many were
    /// newly set.
    ///
    /// # Errors
    ///
    /// As [`Scripts::check`]; nothing is written when the shard is missing.
    pub async fn add<C: ConnectionLike + Send>(
        &self,
        conn: &mut C,
        keys: &HeldKeys,
        layout: &Layout,
        key: &[u8],
    ) -> Result<u32, HeldError> {
        let (call, spot) = invocation(keys, layout, &self.add, key);
        let set = call.invoke_async::<i64>(conn).await?;
        u32::try_from(set).map_err(|_| HeldError::Missing {
            generation: layout.generation,
            shard: spot.shard,
        })
    }
}

impl Default for Scripts {
    fn default() -> Self {
        Self::new()
    }
}

/// The time now in Unix milliseconds (0 before 1970).
fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX).max(1)
}

mod record;
pub use record::BadRecord;

#[cfg(test)]
mod tests;
