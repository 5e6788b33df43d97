use super::*;
use bloomgate_core::filter::{BloomParams, MAX_BITS};

/// Seed, blocks and hashes of the test vectors in docs/redis-gate.md.
const VECTOR_SEED: u32 = 0x5eed_0001;
const VECTOR_BLOCKS: u64 = 1000;
const VECTOR_HASHES: u32 = 9;

/// Key, block, in-block positions. Computed independently by the example Python
/// client; a change here is a change of the scheme every other client relies on.
const VECTORS: [(&str, u64, [u16; 9]); 5] = [
    ("42", 733, [400, 12, 296, 1, 61, 397, 409, 468, 469]),
    ("1000001", 307, [261, 383, 215, 48, 348, 374, 250, 73, 457]),
    ("sku-ab12", 682, [305, 378, 92, 216, 430, 433, 133, 75, 129]),
    ("", 870, [485, 444, 325, 428, 420, 510, 214, 442, 377]),
    (
        "a-key-longer-than-sixteen-bytes",
        930,
        [111, 293, 66, 191, 338, 87, 208, 43, 51],
    ),
];

#[test]
fn the_hash_scheme_gives_the_documented_test_vectors() {
    let layout = Layout {
        generation: 1,
        seed: VECTOR_SEED,
        bits: VECTOR_BLOCKS * BLOCK_BITS,
        hashes: VECTOR_HASHES,
        shard_blocks: 256,
        items: 0,
    };
    for (key, block, positions) in VECTORS {
        let spot = layout.spot(key.as_bytes());
        assert_eq!(
            (spot.shard, spot.offset),
            (block / 256, (block % 256) * 64),
            "{key:?}"
        );
        assert_eq!(spot.positions, positions, "{key:?}");
        // The first seven positions are the same with seven hashes: more hashes
        // extend a key's probes, they do not reshuffle them.
        let seven = Layout {
            hashes: 7,
            ..layout.clone()
        }
        .spot(key.as_bytes());
        assert_eq!(seven.positions, positions[..7], "{key:?}");
    }
}

#[test]
fn a_layout_matches_the_local_filter_block_for_block() {
    let params = BloomParams::optimal(10_000, 0.01).expect("params");
    let filter = BloomFilter::new(params, 99);
    let layout = Layout::of(&filter, 3, 64 * 7).expect("layout");
    assert_eq!(layout.shards(), layout.blocks().div_ceil(7));
    for i in 0..2_000u32 {
        let key = i.to_string();
        let spot = layout.spot(key.as_bytes());
        let (block, probes) = locate(key.as_bytes(), 99, layout.blocks(), params.hashes);
        assert_eq!(spot.shard * 7 + spot.offset / 64, block);
        assert_eq!(spot.positions, probes.map(|p| p as u16).collect::<Vec<_>>());
    }
}

#[test]
fn shard_sizes_that_are_not_whole_blocks_or_too_large_are_refused() {
    let filter = BloomFilter::new(BloomParams::optimal(100, 0.01).expect("params"), 1);
    for bad in [0, 1, 63, 65, 100, MAX_SHARD_BYTES + 64] {
        assert!(
            matches!(Layout::of(&filter, 1, bad), Err(HeldError::ShardSize(b)) if b == bad),
            "{bad}"
        );
    }
    for good in [64, 128, DEFAULT_SHARD_BYTES, MAX_SHARD_BYTES] {
        assert!(Layout::of(&filter, 1, good).is_ok(), "{good}");
    }
}

#[test]
fn a_current_record_no_filter_can_have_is_refused() {
    let good: HashMap<String, String> = [
        ("gen", "4"),
        ("seed", "7"),
        ("bits", "5120"),
        ("hashes", "7"),
        ("shard_blocks", "3"),
        ("shards", "4"),
        ("items", "10"),
        ("at", "1"),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v.to_owned()))
    .collect();
    let layout = Layout::from_fields(&good).expect("a good record");
    assert_eq!((layout.blocks(), layout.shards()), (10, 4));
    let spoiled = |field: &str, value: Option<&str>| {
        let mut f = good.clone();
        match value {
            Some(v) => f.insert(field.to_owned(), v.to_owned()),
            None => f.remove(field),
        };
        Layout::from_fields(&f)
    };
    for (field, value) in [
        ("bits", Some("0")),
        ("bits", Some("5121")),
        ("bits", Some("-512")),
        ("bits", Some("1e9")),
        ("bits", Some(" 5120")),
        ("bits", Some(&*(2 * MAX_BITS).to_string())),
        ("hashes", Some("0")),
        ("hashes", Some("65")),
        ("shard_blocks", Some("0")),
        ("shard_blocks", Some("99999999999")),
        ("shards", Some("3")),
        ("shards", Some("5")),
        ("seed", Some("4294967296")),
        ("seed", None),
        ("gen", None),
        ("gen", Some("x")),
        ("items", None),
    ] {
        assert!(
            matches!(spoiled(field, value), Err(HeldError::BadRecord(_))),
            "{field} = {value:?} was accepted"
        );
    }
}
