//! MurmurHash3, x64 128-bit variant, over a byte slice.
//!
//! The filter hashes every key with this function, so it is written for a slice in
//! memory: 16-byte blocks are read as two little-endian words straight from the slice,
//! with no reader, no buffer and no error path. The output is bit for bit that of the
//! reference algorithm (and of the `murmur3` crate's `murmur3_x64_128`, which the tests
//! compare against), so filters and snapshots built under either agree.

const C1: u64 = 0x87c3_7b91_1142_53d5;
const C2: u64 = 0x4cf5_ad43_2745_937f;

/// The 128-bit hash of `key` under `seed`, as `(h1, h2)`: the low and high halves of
/// the reference function's 128-bit result.
#[inline]
pub fn murmur3_x64_128(key: &[u8], seed: u32) -> (u64, u64) {
    let mut h1 = u64::from(seed);
    let mut h2 = u64::from(seed);

    let mut blocks = key.chunks_exact(16);
    for block in &mut blocks {
        let (lo, hi) = block.split_at(8);
        h1 ^= mix_k1(read_le(lo));
        h1 = h1.rotate_left(27).wrapping_add(h2);
        h1 = h1.wrapping_mul(5).wrapping_add(0x52dc_e729);
        h2 ^= mix_k2(read_le(hi));
        h2 = h2.rotate_left(31).wrapping_add(h1);
        h2 = h2.wrapping_mul(5).wrapping_add(0x3849_5ab5);
    }

    let tail = blocks.remainder();
    if tail.len() > 8 {
        h2 ^= mix_k2(read_le(&tail[8..]));
    }
    if !tail.is_empty() {
        h1 ^= mix_k1(read_le(&tail[..tail.len().min(8)]));
    }

    // The length enters as a 64-bit value; a slice can never be longer than that.
    let len = key.len() as u64;
    h1 ^= len;
    h2 ^= len;
    h1 = h1.wrapping_add(h2);
    h2 = h2.wrapping_add(h1);
    h1 = fmix64(h1);
    h2 = fmix64(h2);
    h1 = h1.wrapping_add(h2);
    h2 = h2.wrapping_add(h1);
    (h1, h2)
}

/// Up to eight bytes as a little-endian word, missing high bytes zero.
#[inline(always)]
fn read_le(bytes: &[u8]) -> u64 {
    let mut word = [0u8; 8];
    let n = bytes.len().min(8);
    word[..n].copy_from_slice(&bytes[..n]);
    u64::from_le_bytes(word)
}

#[inline(always)]
fn mix_k1(k: u64) -> u64 {
    k.wrapping_mul(C1).rotate_left(31).wrapping_mul(C2)
}

#[inline(always)]
fn mix_k2(k: u64) -> u64 {
    k.wrapping_mul(C2).rotate_left(33).wrapping_mul(C1)
}

/// The reference finaliser: avalanches all 64 bits.
#[inline(always)]
fn fmix64(mut k: u64) -> u64 {
    k ^= k >> 33;
    k = k.wrapping_mul(0xff51_afd7_ed55_8ccd);
    k ^= k >> 33;
    k = k.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    k ^ (k >> 33)
}

#[cfg(test)]
mod tests {
    use super::murmur3_x64_128;
    use proptest::prelude::*;

    /// The crate's result split the way the filter uses it.
    fn reference(key: &[u8], seed: u32) -> (u64, u64) {
        let mut reader = key;
        let hash = murmur3::murmur3_x64_128(&mut reader, seed).expect("a slice never fails");
        (hash as u64, (hash >> 64) as u64)
    }

    #[test]
    fn matches_the_reference_at_every_length_around_the_block_size() {
        let bytes: Vec<u8> = (0..=80u8).map(|b| b.wrapping_mul(37) ^ 0xa5).collect();
        for len in 0..bytes.len() {
            for seed in [0, 1, 0x5eed_b100, u32::MAX] {
                let key = &bytes[..len];
                assert_eq!(
                    murmur3_x64_128(key, seed),
                    reference(key, seed),
                    "len {len} seed {seed:#x}"
                );
            }
        }
    }

    #[test]
    fn known_value_of_the_empty_key_under_seed_zero_is_zero() {
        // Every step maps zero to zero when there are no blocks and no length.
        assert_eq!(murmur3_x64_128(b"", 0), (0, 0));
        assert_ne!(murmur3_x64_128(b"", 1), (0, 0));
    }

    proptest! {
        #[test]
        fn matches_the_reference(key in proptest::collection::vec(any::<u8>(), 0..100), seed: u32) {
            prop_assert_eq!(murmur3_x64_128(&key, seed), reference(&key, seed));
        }
    }
}
