//! Tests of snapshot files: round trips, every rejection with its exact error, the
//! atomic write, and an ignored timing run at ten million keys.

use super::*;
use indicatif::HumanBytes;
use std::time::Instant;
use tempfile::TempDir;

const SEED: u32 = 0x5eed_b100;

/// A new directory under the system temp dir, removed with its contents on drop.
fn temp_dir() -> TempDir {
    tempfile::tempdir().expect("create the test directory")
}

/// The names in `dir`, sorted.
fn names(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = fs::read_dir(dir)
        .expect("list the directory")
        .map(|e| {
            e.expect("a directory entry")
                .file_name()
                .to_string_lossy()
                .into_owned()
        })
        .collect();
    names.sort();
    names
}

fn key(i: u64) -> Vec<u8> {
    format!("/users/{i}").into_bytes()
}

/// A filter sized for `n` keys at 1% holding keys `0..inserted`.
fn filled(n: u64, inserted: u64) -> BloomFilter {
    let filter = BloomFilter::new(BloomParams::optimal(n, 0.01).expect("valid params"), SEED);
    for i in 0..inserted {
        filter.insert(&key(i));
    }
    filter
}

/// The bytes of a valid snapshot of a small filter with an integer watermark.
fn valid_bytes(dir: &TempDir) -> Vec<u8> {
    let path = dir.path().join("valid.snap");
    write(&path, &filled(1_000, 500), Some(Watermark::Int(77))).expect("write");
    fs::read(&path).expect("read back")
}

/// Recomputes the trailing checksum after a deliberate edit, so that the check under test
/// is the one that fires.
fn reseal(bytes: &mut [u8]) {
    let at = bytes.len() - CHECKSUM_LEN;
    let crc = crc32fast::hash(&bytes[..at]);
    bytes[at..].copy_from_slice(&crc.to_le_bytes());
}

#[test]
fn round_trip_keeps_keys_stats_seed_and_watermark() {
    let dir = temp_dir();
    let filter = filled(10_000, 8_000);
    for watermark in [
        None,
        Some(Watermark::Int(-5)),
        Some(Watermark::Int(i64::MAX)),
        Some(Watermark::TimeMicros(1_767_225_600_123_456)),
    ] {
        let path = dir.path().join("users.snap");
        let before = SystemTime::now() - Duration::from_secs(1);
        let info = write(&path, &filter, watermark).expect("write");
        assert_eq!(info.bytes, fs::metadata(&path).expect("stat").len());
        assert_eq!(
            info.bytes,
            (HEADER_LEN + filter.word_count() * 8 + CHECKSUM_LEN) as u64
        );

        let snap = read(&path).expect("read");
        assert_eq!(snap.watermark, watermark);
        assert!(snap.created_at >= before && snap.created_at <= SystemTime::now());
        let loaded = snap.filter;
        assert_eq!(loaded.params(), filter.params());
        assert_eq!(loaded.seed(), SEED);
        assert_eq!(loaded.stats(), filter.stats());
        assert!(loaded.iter_words().eq(filter.iter_words()));
        assert!((0..8_000).all(|i| loaded.contains(&key(i))));
        // The reloaded filter keeps working: a new key lands under the same seed.
        assert!(loaded.insert(b"/users/new"));
        assert!(loaded.contains(b"/users/new"));
    }
}

#[test]
fn round_trip_of_empty_and_odd_sized_filters() {
    let dir = temp_dir();
    for bits in [1, 511, 512, 513, 1_000] {
        let params = BloomParams {
            expected_items: 10,
            false_positive_rate: 0.05,
            bits,
            hashes: 3,
        };
        let filter = BloomFilter::new(params, 7);
        let path = dir.path().join("odd.snap");
        write(&path, &filter, None).expect("write empty");
        assert_eq!(read(&path).expect("read empty").filter.stats().items, 0);
        filter.insert(b"a");
        filter.insert(b"b");
        write(&path, &filter, None).expect("write");
        let loaded = read(&path).expect("read").filter;
        assert_eq!(loaded.params(), filter.params(), "bits = {bits}");
        assert_eq!(loaded.params().bits, bits.next_multiple_of(512));
        assert_eq!(loaded.stats(), filter.stats(), "bits = {bits}");
        assert!(loaded.contains(b"a") && loaded.contains(b"b"));
    }
}

#[test]
fn the_layout_matches_the_documented_table() {
    let dir = temp_dir();
    let bytes = valid_bytes(&dir);
    let u32_at = |at: usize| u32::from_le_bytes(bytes[at..at + 4].try_into().expect("4 bytes"));
    let u64_at = |at: usize| u64::from_le_bytes(bytes[at..at + 8].try_into().expect("8 bytes"));
    let params = BloomParams::optimal(1_000, 0.01).expect("valid params");
    assert_eq!(&bytes[..8], b"BLOOMGT\0");
    assert_eq!(u32_at(8), 2);
    assert_eq!(u32_at(12), 73);
    assert_eq!(u64_at(16), params.bits);
    assert_eq!(u32_at(24), params.hashes);
    assert_eq!(u64_at(28), 1_000);
    assert_eq!(f64::from_bits(u64_at(36)), 0.01);
    assert_eq!(u32_at(44), SEED);
    assert!(u64_at(48) > 490 && u64_at(48) <= 500);
    assert_eq!(bytes[56], 1);
    assert_eq!(u64_at(57), 77);
    assert!(u64_at(65) > 1_700_000_000);
    let words = (params.bits / 64) as usize;
    assert_eq!(bytes.len(), 73 + 8 * words + 4);
    let at = bytes.len() - 4;
    assert_eq!(u32_at(at), crc32fast::hash(&bytes[..at]));
}

#[test]
fn truncated_files_are_rejected_with_the_size_needed() {
    let dir = temp_dir();
    let bytes = valid_bytes(&dir);
    let full = bytes.len() as u64;
    let min = (HEADER_LEN + CHECKSUM_LEN) as u64;
    let cuts = [
        (0, min),
        (5, min),
        (8, min),
        (15, min),
        (16, min),
        (40, min),
        (HEADER_LEN - 1, min),
        (HEADER_LEN, full),
        (HEADER_LEN + 3, full),
        (HEADER_LEN + 4, full),
        (bytes.len() / 2, full),
        (bytes.len() - CHECKSUM_LEN, full),
        (bytes.len() - 1, full),
    ];
    let path = dir.path().join("cut.snap");
    for (cut, expected) in cuts {
        fs::write(&path, &bytes[..cut]).expect("write the cut file");
        let err = read(&path).expect_err("a truncated file");
        assert!(
            matches!(err, SnapshotError::Truncated { expected: e, actual } if e == expected && actual == cut as u64),
            "cut at {cut}: {err:?}"
        );
        assert!(err.to_string().contains("truncated"), "{err}");
    }
}

#[test]
fn trailing_bytes_are_an_inconsistent_header() {
    let dir = temp_dir();
    let mut bytes = valid_bytes(&dir);
    bytes.extend_from_slice(&[0; 8]);
    let err = decode(&bytes).expect_err("trailing bytes");
    assert!(
        matches!(&err, SnapshotError::BadHeader(HeaderProblem::Length { actual, expected, .. })
            if *actual == bytes.len() as u64 && *expected == *actual - 8),
        "{err:?}"
    );
    // The reason is the error's cause, printed once after it.
    let printed = crate::report::Chain(&err).to_string();
    assert!(
        printed.starts_with("snapshot header is inconsistent: the file is")
            && printed.matches("implies").count() == 1,
        "{printed}"
    );
}

#[test]
fn a_flipped_byte_is_reported_as_corruption() {
    let dir = temp_dir();
    let bytes = valid_bytes(&dir);
    let last = bytes.len() - 1;
    // Words (first, middle, last), header fields the length does not depend on, and the
    // checksum itself.
    for at in [
        HEADER_LEN,
        bytes.len() / 2,
        last - CHECKSUM_LEN,
        24,
        30,
        40,
        44,
        50,
        56,
        57,
        70,
        last,
    ] {
        let mut bad = bytes.clone();
        bad[at] ^= 0x10;
        let err = decode(&bad).expect_err("a flipped byte");
        assert!(
            matches!(err, SnapshotError::ChecksumMismatch { stored, computed } if stored != computed),
            "flip at {at}: {err:?}"
        );
        assert!(err.to_string().contains("corrupted"), "{err}");
    }
}

#[test]
fn a_damaged_bit_count_is_caught_before_the_checksum() {
    let dir = temp_dir();
    let bytes = valid_bytes(&dir);
    let bits = BloomParams::optimal(1_000, 0.01)
        .expect("valid params")
        .bits;
    let with_bits = |bits: u64| {
        let mut bad = bytes.clone();
        bad[16..24].copy_from_slice(&bits.to_le_bytes());
        decode(&bad).expect_err("a damaged bit count")
    };
    // A flipped top byte: far past the size limit.
    let err = with_bits(bits ^ 1 << 56);
    assert!(
        matches!(&err, SnapshotError::BadHeader(HeaderProblem::Bits(b)) if *b == bits ^ 1 << 56),
        "{err:?}"
    );
    // More blocks than the file holds: indistinguishable from a cut.
    let err = with_bits(bits + 1024);
    assert!(
        matches!(err, SnapshotError::Truncated { expected, .. } if expected == bytes.len() as u64 + 128),
        "{err:?}"
    );
    // Fewer: the file has bytes the header does not account for.
    let err = with_bits(bits - 1024);
    assert!(
        matches!(&err, SnapshotError::BadHeader(HeaderProblem::Length { .. })),
        "{err:?}"
    );
    // Off the block grid: no blocked filter has that size.
    let err = with_bits(bits + 1);
    assert!(
        matches!(&err, SnapshotError::BadHeader(HeaderProblem::Unaligned(_))),
        "{err:?}"
    );
}

#[test]
fn zero_bits_or_a_hash_count_out_of_range_are_an_inconsistent_header() {
    let dir = temp_dir();
    let bytes = valid_bytes(&dir);
    let mut no_bits = bytes.clone();
    no_bits[16..24].fill(0);
    reseal(&mut no_bits);
    let err = decode(&no_bits).expect_err("0 bits");
    assert!(
        matches!(&err, SnapshotError::BadHeader(HeaderProblem::Bits(0))),
        "{err:?}"
    );
    let mut no_hashes = bytes.clone();
    no_hashes[24..28].fill(0);
    reseal(&mut no_hashes);
    let err = decode(&no_hashes).expect_err("0 hashes");
    assert!(
        matches!(&err, SnapshotError::BadHeader(HeaderProblem::Hashes(0))),
        "{err:?}"
    );
    // A forged count past what sizing ever picks would make each lookup probe billions
    // of bits: refused, even with a valid checksum.
    for forged in [65u32, u32::MAX] {
        let mut many = bytes.clone();
        many[24..28].copy_from_slice(&forged.to_le_bytes());
        reseal(&mut many);
        let err = decode(&many).expect_err("too many hashes");
        assert!(
            matches!(&err, SnapshotError::BadHeader(HeaderProblem::Hashes(h)) if *h == forged),
            "{forged}: {err:?}"
        );
    }
}

#[test]
fn foreign_files_are_not_snapshots() {
    let dir = temp_dir();
    let path = dir.path().join("notes.txt");
    for text in [
        "this is a text file, not a snapshot of anything at all; long enough for a header\n"
            .repeat(3),
        "hi".to_owned(),
        "BLOOMGX\0 nearly".to_owned(),
    ] {
        fs::write(&path, &text).expect("write the text file");
        let err = read(&path).expect_err("a text file");
        assert!(matches!(err, SnapshotError::BadMagic), "{text:?}: {err:?}");
        assert!(
            err.to_string().contains("not a bloomgate snapshot"),
            "{err}"
        );
    }
}

#[test]
fn other_versions_are_refused_by_number() {
    let dir = temp_dir();
    let mut bytes = valid_bytes(&dir);
    for version in [1u32, 3, 0, u32::MAX] {
        bytes[8..12].copy_from_slice(&version.to_le_bytes());
        reseal(&mut bytes);
        let err = decode(&bytes).expect_err("another version");
        assert!(
            matches!(err, SnapshotError::UnsupportedVersion(v) if v == version),
            "{err:?}"
        );
        assert!(
            err.to_string().contains(&format!("version {version}")),
            "{err}"
        );
    }
    // A file of another version cut short is still refused for its version, not its length.
    let err = decode(&bytes[..PREAMBLE_LEN]).expect_err("a short file of another version");
    assert!(
        matches!(err, SnapshotError::UnsupportedVersion(u32::MAX)),
        "{err:?}"
    );
}

#[test]
fn a_short_header_length_is_inconsistent() {
    let dir = temp_dir();
    let mut bytes = valid_bytes(&dir);
    bytes[12..16].copy_from_slice(&40u32.to_le_bytes());
    reseal(&mut bytes);
    let err = decode(&bytes).expect_err("header length 40");
    assert!(
        matches!(
            &err,
            SnapshotError::BadHeader(HeaderProblem::ShortHeader(40))
        ),
        "{err:?}"
    );
}

#[test]
fn a_longer_header_is_read_past() {
    let dir = temp_dir();
    let bytes = valid_bytes(&dir);
    let mut longer = bytes[..HEADER_LEN].to_vec();
    longer[12..16].copy_from_slice(&(HEADER_LEN as u32 + 8).to_le_bytes());
    longer.extend_from_slice(b"newfield");
    longer.extend_from_slice(&bytes[HEADER_LEN..]);
    reseal(&mut longer);
    let original = decode(&bytes).expect("the original");
    let extended = decode(&longer).expect("a header with an appended field");
    assert_eq!(extended.watermark, original.watermark);
    assert!(
        extended
            .filter
            .iter_words()
            .eq(original.filter.iter_words())
    );
}

#[test]
fn an_unknown_watermark_kind_is_inconsistent() {
    let dir = temp_dir();
    let mut bytes = valid_bytes(&dir);
    bytes[56] = 9;
    reseal(&mut bytes);
    let err = decode(&bytes).expect_err("watermark tag 9");
    assert!(
        matches!(
            &err,
            SnapshotError::BadHeader(HeaderProblem::WatermarkKind(9))
        ),
        "{err:?}"
    );
}

#[test]
fn a_version_1_file_is_refused_by_number() {
    // Version 1 held a classic bit array under the same header; its bits are meaningless
    // to the blocked probes, so it must never load, checksum or not.
    let dir = temp_dir();
    let mut bytes = valid_bytes(&dir);
    bytes[8..12].copy_from_slice(&1u32.to_le_bytes());
    reseal(&mut bytes);
    let err = decode(&bytes).expect_err("a version 1 file");
    assert!(
        matches!(err, SnapshotError::UnsupportedVersion(1)),
        "{err:?}"
    );
    assert!(err.to_string().contains("reads version 2"), "{err}");
}

#[test]
fn a_missing_file_is_an_io_error() {
    let dir = temp_dir();
    let path = dir.path().join("absent.snap");
    let err = read(&path).expect_err("no file");
    assert!(
        matches!(&err, SnapshotError::Io { source, path: p, .. } if source.kind() == io::ErrorKind::NotFound && *p == path),
        "{err:?}"
    );
    assert!(err.to_string().contains("absent.snap"), "{err}");
    assert!(matches!(inspect(&path), Err(SnapshotError::Io { .. })));
}

#[test]
fn write_replaces_atomically_and_leaves_no_temporary_files() {
    let dir = temp_dir();
    // The directory is created on the first write.
    let path = dir.path().join("nested/deeper/users.snap");
    let first = filled(1_000, 10);
    write(&path, &first, Some(Watermark::Int(1))).expect("first write");
    let second = filled(2_000, 1_500);
    write(&path, &second, Some(Watermark::Int(2))).expect("second write");
    let snap = read(&path).expect("read");
    assert_eq!(snap.watermark, Some(Watermark::Int(2)));
    assert_eq!(snap.filter.params(), second.params());
    assert_eq!(snap.filter.stats(), second.stats());
    assert_eq!(names(&dir.path().join("nested/deeper")), ["users.snap"]);
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = fs::metadata(&path).expect("stat").permissions().mode();
        assert_eq!(mode & 0o777, 0o600, "the seed is a secret");
    }
}

#[test]
fn a_crash_before_the_rename_leaves_the_old_snapshot_in_place() {
    let dir = temp_dir();
    let path = dir.path().join("users.snap");
    let old = filled(1_000, 10);
    write(&path, &old, Some(Watermark::Int(1))).expect("first write");
    // The second write gets as far as a complete, synced temporary file, then the
    // process dies: nothing removes the file and nothing renames it.
    let (temp, _) = write_temp(&path, &filled(2_000, 1_500), Some(Watermark::Int(2)))
        .expect("the temporary file");
    let (_, left) = temp.keep().expect("keep it as a crash would");

    let snap = read(&path).expect("the old snapshot still reads");
    assert_eq!(snap.watermark, Some(Watermark::Int(1)));
    assert_eq!(snap.filter.stats(), old.stats());
    // What the crash left is beside the snapshot, under a name no reader opens.
    let stray = left
        .file_name()
        .expect("a file name")
        .to_string_lossy()
        .into_owned();
    assert!(
        stray.starts_with(".users.snap.") && stray.ends_with(".tmp"),
        "{stray}"
    );
    assert_eq!(names(dir.path()), [stray.as_str(), "users.snap"]);
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = fs::metadata(&left).expect("stat").permissions().mode();
        assert_eq!(
            mode & 0o777,
            0o600,
            "the seed is a secret, even in a stray file"
        );
    }
    // The next write replaces the snapshot as usual.
    write(&path, &filled(2_000, 1_500), Some(Watermark::Int(3))).expect("next write");
    assert_eq!(
        read(&path).expect("read").watermark,
        Some(Watermark::Int(3))
    );
}

#[test]
fn a_failed_write_removes_its_temporary_file() {
    let dir = temp_dir();
    // The rename fails: a file cannot replace a non-empty directory.
    let path = dir.path().join("taken");
    fs::create_dir_all(path.join("inside")).expect("create the obstacle");
    let err = write(&path, &filled(100, 10), None).expect_err("rename onto a directory");
    assert!(
        matches!(&err, SnapshotError::Io { action, .. } if action.contains("move")),
        "{err:?}"
    );
    assert_eq!(names(dir.path()), ["taken"]);
    // No file name at all.
    let err = write(Path::new("/"), &filled(100, 10), None).expect_err("the root");
    assert!(matches!(err, SnapshotError::Io { .. }), "{err:?}");
}

#[test]
fn concurrent_writes_to_one_path_leave_one_valid_file() {
    let dir = temp_dir();
    let path = dir.path().join("shared.snap");
    let filter = filled(5_000, 2_000);
    std::thread::scope(|s| {
        for i in 0..4 {
            let (path, filter) = (&path, &filter);
            s.spawn(move || write(path, filter, Some(Watermark::Int(i))).expect("write"));
        }
    });
    let snap = read(&path).expect("read");
    assert_eq!(snap.filter.stats(), filter.stats());
    assert_eq!(names(dir.path()), ["shared.snap"]);
}

#[test]
fn inspect_sums_up_the_snapshot_without_the_seed() {
    let dir = temp_dir();
    let path = dir.path().join("users.snap");
    let filter = filled(10_000, 5_000);
    let at = 1_767_225_600_000_000;
    write(&path, &filter, Some(Watermark::TimeMicros(at))).expect("write");
    let summary = inspect(&path).expect("inspect");
    let stats = filter.stats();
    assert_eq!(summary.path, path);
    assert_eq!(summary.file_bytes, fs::metadata(&path).expect("stat").len());
    assert_eq!(summary.version, FORMAT_VERSION);
    assert_eq!(summary.params, filter.params());
    assert_eq!(summary.items, stats.items);
    assert_eq!(summary.fill_ratio, stats.fill_ratio);
    assert_eq!(summary.estimated_fpp, stats.estimated_fpp);
    assert_eq!(summary.watermark, Some(Watermark::TimeMicros(at)));
    assert!(summary.age.is_some_and(|a| a < Duration::from_secs(60)));

    assert!(!format!("{summary:?}").contains(&SEED.to_string()));
    assert!(!format!("{summary:?}").contains(&format!("{SEED:x}")));

    let empty = dir.path().join("empty.snap");
    write(&empty, &filled(100, 0), None).expect("write");
    let empty = inspect(&empty).expect("inspect");
    assert_eq!(empty.watermark, None);
    assert_eq!(empty.fill_ratio, 0.0);
    assert_eq!(empty.items, 0);
}

/// Ten million keys at 1%: about 11.4 MiB of words. Run with
/// `cargo test --release --lib timing_snapshot -- --ignored --nocapture`.
#[test]
#[ignore = "timing; run in release"]
fn timing_snapshot_10m() {
    const N: u64 = 10_000_000;
    let dir = temp_dir();
    let path = dir.path().join("ten-million.snap");
    let started = Instant::now();
    let filter = BloomFilter::new(BloomParams::optimal(N, 0.01).expect("valid params"), SEED);
    let mut buf = itoa::Buffer::new();
    for i in 0..N {
        filter.insert(buf.format(i).as_bytes());
    }
    let built = started.elapsed();

    let info = write(&path, &filter, Some(Watermark::Int(N as i64))).expect("write");
    let started = Instant::now();
    let snap = read(&path).expect("read");
    let read_took = started.elapsed();
    let started = Instant::now();
    let summary = inspect(&path).expect("inspect");
    let inspect_took = started.elapsed();

    eprintln!(
        "{N} keys at 1%: {} bytes ({}); build {built:?}, write {:?} (sync and rename \
         included), read and verify {read_took:?}, inspect {inspect_took:?}",
        info.bytes,
        HumanBytes(info.bytes),
        info.took
    );
    assert_eq!(snap.filter.stats(), filter.stats());
    assert!(
        (0..N)
            .step_by(997)
            .all(|i| snap.filter.contains(buf.format(i).as_bytes()))
    );
    assert_eq!(summary.file_bytes, info.bytes);
    assert!(
        read_took < Duration::from_secs(1),
        "read took {read_took:?}"
    );
}

#[test]
fn a_binlog_position_and_its_gtid_come_back_as_written() {
    use crate::watermark::{BinlogMark, Gtid};
    let filter = BloomFilter::new(BloomParams::optimal(100, 0.01).expect("params"), 3);
    filter.insert(b"7");
    for gtid in [
        None,
        Some(Gtid {
            domain: 2,
            server: 1001,
            seq: 1 << 40,
        }),
    ] {
        let mark = Watermark::Binlog(BinlogMark {
            file: 12,
            offset: 9876,
            server: 7,
            gtid,
        });
        let bytes = encode(&filter, Some(mark));
        // The server and the GTID are an appended header field.
        let header_len = u32::from_le_bytes(bytes[12..16].try_into().expect("4 bytes"));
        assert_eq!(header_len as usize, HEADER_LEN + 21);
        let back = decode(&bytes).expect("a valid snapshot");
        assert_eq!(back.watermark, Some(mark));
        assert!(back.filter.contains(b"7"));
        assert!(back.filter.iter_words().eq(filter.iter_words()));
    }
}

/// A filter taking admissions while it is encoded: the count `encode_counted` returns is
/// the one the snapshot's header holds, whenever the admissions land. (Reading
/// `items()` after encoding, as a publisher once did, gave a count the follower's check
/// refused against the bytes.)
#[test]
fn the_count_returned_is_the_count_encoded_while_admissions_go_on() {
    let filter = std::sync::Arc::new(BloomFilter::new(
        BloomParams::optimal(200_000, 0.01).expect("params"),
        SEED,
    ));
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writer = {
        let (filter, stop) = (filter.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut i = 0u64;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) && i < 150_000 {
                filter.insert(i.to_string().as_bytes());
                i += 1;
            }
        })
    };
    let mut moved = 0;
    for _ in 0..40 {
        let (bytes, items) = encode_counted(&filter, None);
        let decoded = decode_bytes(&bytes).expect("a valid snapshot");
        assert_eq!(decoded.filter.items(), items);
        if filter.items() != items {
            moved += 1;
        }
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    writer.join().expect("writer");
    eprintln!("{moved} of 40 encodings saw the count move after the header was written");
}
