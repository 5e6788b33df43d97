//! Reading a generation's layout back from its `current` record in Redis. The record is
//! input (Redis may hold anything a client wrote), so every field is checked against what
//! a filter written here can have, and each refusal says which field and why.

use std::collections::HashMap;

use super::{BLOCK_BYTES, HeldError, Layout, MAX_SHARD_BYTES};
use bloomgate_core::filter::{BLOCK_BITS, MAX_BITS, MAX_OPTIMAL_HASHES};

/// What is wrong with a `current` record.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BadRecord {
    /// A field is absent, or not an unsigned number.
    #[error("field {0} missing or not a number")]
    Field(&'static str),
    /// A bit count no filter has.
    #[error("bits {0} is not a multiple of 512 in 512..={MAX_BITS}")]
    Bits(u64),
    /// A hash count outside what filters are built with.
    #[error("hashes {0} is not in 1..={MAX_OPTIMAL_HASHES}")]
    Hashes(u64),
    /// A shard size outside what Redis can hold.
    #[error("shard_blocks {0} is out of range")]
    ShardBlocks(u64),
    /// A seed wider than the 32 bits filters use.
    #[error("seed {0} does not fit 32 bits")]
    Seed(u64),
    /// A shard count that the bits and the shard size do not give.
    #[error("shards {shards} does not match {bits} bits in shards of {shard_blocks} blocks")]
    Shards {
        /// The count recorded.
        shards: u64,
        /// The bits recorded.
        bits: u64,
        /// The shard size recorded, in blocks.
        shard_blocks: u64,
    },
}

impl Layout {
    /// Reads a layout from the fields of a `current` record, refusing any that no
    /// filter written here can have.
    pub(super) fn from_fields(fields: &HashMap<String, String>) -> Result<Layout, HeldError> {
        let field = |name: &'static str| -> Result<u64, BadRecord> {
            fields
                .get(name)
                .and_then(|v| v.parse().ok())
                .ok_or(BadRecord::Field(name))
        };
        let bits = field("bits")?;
        let hashes = field("hashes")?;
        let shard_blocks = field("shard_blocks")?;
        let seed = field("seed")?;
        if bits == 0 || bits > MAX_BITS || !bits.is_multiple_of(BLOCK_BITS) {
            return Err(BadRecord::Bits(bits).into());
        }
        if hashes == 0 || hashes > u64::from(MAX_OPTIMAL_HASHES) {
            return Err(BadRecord::Hashes(hashes).into());
        }
        if shard_blocks == 0 || shard_blocks > MAX_SHARD_BYTES / BLOCK_BYTES {
            return Err(BadRecord::ShardBlocks(shard_blocks).into());
        }
        let seed = u32::try_from(seed).map_err(|_| BadRecord::Seed(seed))?;
        let layout = Layout {
            generation: field("gen")?,
            seed,
            bits,
            // Checked above to be at most 64.
            hashes: hashes as u32,
            shard_blocks,
            items: field("items")?,
        };
        let shards = field("shards")?;
        if shards != layout.shards() {
            return Err(BadRecord::Shards {
                shards,
                bits,
                shard_blocks,
            }
            .into());
        }
        Ok(layout)
    }
}
