//! `bloomgate filter inspect`'s report: a verified snapshot's header and statistics,
//! laid out for a person to read. The library returns the figures
//! ([`SnapshotSummary`]); the wording is the command line's.

use std::fmt;
use std::time::{Duration, UNIX_EPOCH};

use indicatif::HumanBytes;

use bloomgate::filter::snapshot::SnapshotSummary;
use bloomgate::watermark::Watermark;

/// A summary as the report `filter inspect` prints, through `Display`.
pub struct Report<'a>(pub &'a SnapshotSummary);

impl fmt::Display for Report<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let p = &self.0.params;
        writeln!(f, "snapshot       {}", self.0.path.display())?;
        writeln!(
            f,
            "file           {} bytes ({}), format version {}",
            self.0.file_bytes,
            HumanBytes(self.0.file_bytes),
            self.0.version
        )?;
        writeln!(
            f,
            "sized for      {} keys at a false-positive rate of {}",
            p.expected_items, p.false_positive_rate
        )?;
        writeln!(
            f,
            "bit array      {} bits ({}), {} hashes per key",
            p.bits,
            HumanBytes(p.bits / 8),
            p.hashes
        )?;
        let share = self.0.items as f64 / p.expected_items.max(1) as f64;
        writeln!(
            f,
            "items          {} ({:.1}% of capacity)",
            self.0.items,
            share * 100.0
        )?;
        writeln!(
            f,
            "fill ratio     {:.4} (estimated false-positive rate {})",
            self.0.fill_ratio,
            rate(self.0.estimated_fpp)
        )?;
        match self.0.watermark {
            Some(w @ Watermark::Int(_)) => writeln!(f, "watermark      integer {w}")?,
            Some(w @ Watermark::TimeMicros(_)) => writeln!(f, "watermark      timestamp {w}")?,
            Some(w @ Watermark::Binlog(_)) => writeln!(f, "watermark      {w}")?,
            None => writeln!(f, "watermark      none (written without incremental sync)")?,
        }
        let secs = self
            .0
            .created_at
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let when = i64::try_from(secs)
            .ok()
            .and_then(|s| chrono::DateTime::<chrono::Utc>::from_timestamp(s, 0))
            .map_or_else(
                || format!("{secs} s after the epoch"),
                |t| t.to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
            );
        match self.0.age {
            Some(age) => {
                let age = humantime::format_duration(Duration::from_secs(age.as_secs()));
                write!(f, "created        {when} ({age} ago)")
            }
            None => write!(f, "created        {when} (ahead of this host's clock)"),
        }
    }
}

/// A rate readable at any size: fixed-point down to 0.001, scientific below.
fn rate(x: f64) -> String {
    if x == 0.0 || x >= 1e-3 {
        format!("{x:.4}")
    } else {
        format!("{x:.2e}")
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use bloomgate::filter::snapshot::{inspect, write};
    use bloomgate::filter::{BloomFilter, BloomParams};
    use bloomgate::watermark::Watermark;

    use super::Report;

    const SEED: u32 = 0x5eed_b100;

    /// A snapshot of a filter sized for `n` keys at 1% holding `inserted` keys, written
    /// into `dir` as `name`, and its report.
    fn report_of(
        dir: &std::path::Path,
        name: &str,
        n: u64,
        inserted: u64,
        watermark: Option<Watermark>,
    ) -> (BloomFilter, String, u64) {
        let filter = BloomFilter::new(BloomParams::optimal(n, 0.01).expect("valid params"), SEED);
        for i in 0..inserted {
            filter.insert(format!("/users/{i}").as_bytes());
        }
        let path = dir.join(name);
        write(&path, &filter, watermark).expect("write");
        let summary = inspect(&path).expect("inspect");
        assert!(summary.age.is_some_and(|a| a < Duration::from_secs(60)));
        (filter, Report(&summary).to_string(), summary.file_bytes)
    }

    #[test]
    fn the_report_names_every_figure_and_never_the_seed() {
        let dir = tempfile::tempdir().expect("create the test directory");
        let at = 1_767_225_600_000_000;
        let (filter, report, file_bytes) = report_of(
            dir.path(),
            "users.snap",
            10_000,
            5_000,
            Some(Watermark::TimeMicros(at)),
        );
        eprintln!("{report}");
        // Sizes in binary units with two decimals; this filter is a few KiB.
        let kib = |bytes: u64| format!("{:.2} KiB", bytes as f64 / 1024.0);
        let params = filter.params();
        for expected in [
            "users.snap",
            &format!(
                "file           {file_bytes} bytes ({}), format version 2",
                kib(file_bytes)
            ),
            &format!(
                "{} bits ({}), {} hashes per key",
                params.bits,
                kib(params.bits / 8),
                params.hashes
            ),
            "10000 keys at a false-positive rate of 0.01",
            &format!("items          {}", filter.stats().items),
            "timestamp 2026-01-01T00:00:00.000000Z",
            "ago)",
        ] {
            assert!(
                report.contains(expected),
                "{expected:?} missing from\n{report}"
            );
        }
        assert!(
            !report.contains(&SEED.to_string()),
            "the seed leaked:\n{report}"
        );
        assert!(
            !report.contains(&format!("{SEED:x}")),
            "the seed leaked:\n{report}"
        );

        let (_, report, _) = report_of(dir.path(), "empty.snap", 100, 0, None);
        assert!(report.contains("watermark      none"), "{report}");
        assert!(report.contains("fill ratio     0.0000"), "{report}");
    }
}
