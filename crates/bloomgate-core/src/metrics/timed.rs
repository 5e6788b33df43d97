//! A request counter and its latency histogram, kept as one family per serving thread
//! and summed when scraped.
//!
//! A request on a hot path is counted once and timed once, under the same labels. With
//! a shared counter and histogram, every request on every core writes the same few
//! cache lines, which then travel between cores on each write. Here each thread writes
//! its own cell of a series, with one bucket increment and one sum increment, and
//! `/metrics` adds the cells up. The exposition is the one a counter family and a
//! histogram family with the latency buckets would give: the counter is the histogram's
//! count, so the two always agree.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use prometheus::Registry;
use prometheus::core::{Collector, Desc};
use prometheus::proto::{Bucket, Counter, Histogram, LabelPair, Metric, MetricFamily, MetricType};

use super::{LATENCY_BOUNDS_NS, latency_buckets};

/// Cells per series at most: a machine with more serving threads shares them.
const MAX_SHARDS: usize = 64;

/// The latency buckets and the one above the last bound (`+Inf` only).
const SLOTS: usize = LATENCY_BOUNDS_NS.len() + 1;

/// One thread's share of a series: observations per bucket (not cumulative) and their
/// summed nanoseconds. Aligned so that two threads' cells never share a cache line.
#[repr(align(128))]
#[derive(Default)]
struct Cell {
    slots: [AtomicU64; SLOTS],
    sum_ns: AtomicU64,
}

/// One series: its label values and a cell per shard.
struct Series {
    labels: Vec<LabelPair>,
    cells: Box<[Cell]>,
}

impl Series {
    /// (per-slot counts summed over the cells, summed seconds).
    fn read(&self) -> ([u64; SLOTS], f64) {
        let mut slots = [0u64; SLOTS];
        let mut sum_ns = 0u128;
        for cell in &self.cells {
            for (total, slot) in slots.iter_mut().zip(&cell.slots) {
                *total = total.wrapping_add(slot.load(Ordering::Relaxed));
            }
            sum_ns += u128::from(cell.sum_ns.load(Ordering::Relaxed));
        }
        // As f64 seconds, the way a histogram's sum is shown.
        #[allow(clippy::cast_precision_loss)]
        let seconds = sum_ns as f64 / 1e9;
        (slots, seconds)
    }
}

/// The families: a counter named `counter` and a histogram named `histogram`, both with
/// the same labels, observed together through [`Timed`] handles.
#[derive(Clone)]
pub struct TimedVec {
    inner: Arc<Inner>,
}

struct Inner {
    counter: Desc,
    histogram: Desc,
    label_names: Vec<String>,
    shards: usize,
    series: Mutex<HashMap<Vec<String>, Arc<Series>>>,
}

/// One series of a [`TimedVec`], resolved once by its label values.
#[derive(Clone)]
pub struct Timed(Arc<Series>);

impl TimedVec {
    /// Makes the families and registers them on `registry`.
    ///
    /// # Errors
    ///
    /// A name or label the registry refuses, or a name registered already.
    pub fn register(
        registry: &Registry,
        counter: (&str, &str),
        histogram: (&str, &str),
        labels: &[&str],
    ) -> prometheus::Result<TimedVec> {
        let label_names: Vec<String> = labels.iter().map(|l| (*l).to_owned()).collect();
        let desc = |(name, help): (&str, &str)| {
            Desc::new(
                name.to_owned(),
                help.to_owned(),
                label_names.clone(),
                HashMap::new(),
            )
        };
        let shards = std::thread::available_parallelism()
            .map_or(1, usize::from)
            .next_power_of_two()
            .min(MAX_SHARDS);
        let vec = TimedVec {
            inner: Arc::new(Inner {
                counter: desc(counter)?,
                histogram: desc(histogram)?,
                label_names,
                shards,
                series: Mutex::new(HashMap::new()),
            }),
        };
        registry.register(Box::new(vec.clone()))?;
        Ok(vec)
    }

    /// The series with these label values (one per label name, in their order), made the
    /// first time it is asked for; the same series every later time, so that its counts
    /// survive whoever asks again (a reload).
    ///
    /// # Panics
    ///
    /// When the number of values is not the number of labels: a programming error, as
    /// with prometheus's own vectors.
    pub fn with_label_values(&self, values: &[&str]) -> Timed {
        let inner = &self.inner;
        assert_eq!(
            values.len(),
            inner.label_names.len(),
            "label values for {}",
            inner.counter.fq_name
        );
        let key: Vec<String> = values.iter().map(|v| (*v).to_owned()).collect();
        let mut series = inner.series.lock().unwrap_or_else(PoisonError::into_inner);
        let made = series.entry(key).or_insert_with(|| {
            let mut labels: Vec<LabelPair> = inner
                .label_names
                .iter()
                .zip(values)
                .map(|(name, value)| {
                    let mut pair = LabelPair::default();
                    pair.set_name(name.clone());
                    pair.set_value((*value).to_owned());
                    pair
                })
                .collect();
            // The order prometheus's own vectors show them in.
            labels.sort();
            Arc::new(Series {
                labels,
                cells: (0..inner.shards).map(|_| Cell::default()).collect(),
            })
        });
        Timed(Arc::clone(made))
    }
}

impl Timed {
    /// Counts one request that took `elapsed`.
    pub fn observe(&self, elapsed: Duration) {
        let cells = &self.0.cells;
        // The length is a power of two.
        let cell = &cells[shard() & (cells.len() - 1)];
        let ns = u64::try_from(elapsed.as_nanos()).unwrap_or(u64::MAX);
        let slot = LATENCY_BOUNDS_NS
            .iter()
            .position(|bound| ns <= *bound)
            .unwrap_or(SLOTS - 1);
        cell.slots[slot].fetch_add(1, Ordering::Relaxed);
        cell.sum_ns.fetch_add(ns, Ordering::Relaxed);
    }

    /// Requests counted so far (summed over the threads).
    pub fn count(&self) -> u64 {
        self.0.read().0.iter().sum()
    }
}

/// The calling thread's shard: threads are numbered as they first observe.
fn shard() -> usize {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    thread_local! {
        static SHARD: usize = NEXT.fetch_add(1, Ordering::Relaxed);
    }
    SHARD.with(|s| *s)
}

impl Collector for TimedVec {
    fn desc(&self) -> Vec<&Desc> {
        vec![&self.inner.counter, &self.inner.histogram]
    }

    fn collect(&self) -> Vec<MetricFamily> {
        let inner = &self.inner;
        let bounds = latency_buckets();
        let series = inner.series.lock().unwrap_or_else(PoisonError::into_inner);
        let mut counters = Vec::with_capacity(series.len());
        let mut histograms = Vec::with_capacity(series.len());
        for s in series.values() {
            let (slots, sum) = s.read();
            let total: u64 = slots.iter().sum();
            let mut counter = Counter::default();
            #[allow(clippy::cast_precision_loss)]
            counter.set_value(total as f64);
            let mut m = Metric::from_label(s.labels.clone());
            m.set_counter(counter);
            counters.push(m);

            let mut cumulative = 0u64;
            let buckets = bounds
                .iter()
                .zip(slots)
                .map(|(bound, n)| {
                    cumulative += n;
                    let mut b = Bucket::default();
                    b.set_upper_bound(*bound);
                    b.set_cumulative_count(cumulative);
                    b
                })
                .collect();
            let mut h = Histogram::default();
            h.set_sample_count(total);
            h.set_sample_sum(sum);
            h.set_bucket(buckets);
            let mut m = Metric::from_label(s.labels.clone());
            m.set_histogram(h);
            histograms.push(m);
        }
        let family = |desc: &Desc, kind, metrics| {
            let mut f = MetricFamily::default();
            f.set_name(desc.fq_name.clone());
            f.set_help(desc.help.clone());
            f.set_field_type(kind);
            f.set_metric(metrics);
            f
        };
        vec![
            family(&inner.counter, MetricType::COUNTER, counters),
            family(&inner.histogram, MetricType::HISTOGRAM, histograms),
        ]
    }
}

#[cfg(test)]
mod tests {
    use prometheus::{HistogramOpts, HistogramVec, IntCounterVec, Opts, TextEncoder};

    use super::*;

    /// The exposition of a counter family and a histogram family of prometheus's own,
    /// fed the same observations.
    fn reference(observed: &[(&str, &str, Duration)]) -> String {
        let registry = Registry::new();
        let counter = IntCounterVec::new(Opts::new("t_total", "Count."), &["route", "outcome"])
            .expect("counter");
        let histogram = HistogramVec::new(
            HistogramOpts::new("t_seconds", "Time.").buckets(latency_buckets()),
            &["route", "outcome"],
        )
        .expect("histogram");
        registry
            .register(Box::new(counter.clone()))
            .expect("register");
        registry
            .register(Box::new(histogram.clone()))
            .expect("register");
        for (route, outcome, took) in observed {
            counter.with_label_values(&[route, outcome]).inc();
            histogram
                .with_label_values(&[route, outcome])
                .observe(took.as_secs_f64());
        }
        TextEncoder::new()
            .encode_to_string(&registry.gather())
            .expect("encode")
    }

    fn timed(observed: &[(&str, &str, Duration)], threads: usize) -> String {
        let registry = Registry::new();
        let vec = TimedVec::register(
            &registry,
            ("t_total", "Count."),
            ("t_seconds", "Time."),
            &["route", "outcome"],
        )
        .expect("register");
        std::thread::scope(|scope| {
            for chunk in observed.chunks(observed.len().div_ceil(threads).max(1)) {
                let vec = vec.clone();
                scope.spawn(move || {
                    for (route, outcome, took) in chunk {
                        vec.with_label_values(&[route, outcome]).observe(*took);
                    }
                });
            }
        });
        TextEncoder::new()
            .encode_to_string(&registry.gather())
            .expect("encode")
    }

    #[test]
    fn shows_what_a_counter_and_a_histogram_would_show() {
        // On every bound, either side of it, past the last, and zero; over several
        // threads, so that the sums add cells.
        let mut observed = Vec::new();
        for (i, bound) in LATENCY_BOUNDS_NS.iter().enumerate() {
            let route = if i % 2 == 0 { "a" } else { "b" };
            for ns in [bound - 1, *bound, bound + 1] {
                observed.push((route, "hit", Duration::from_nanos(ns)));
            }
        }
        observed.push(("a", "miss", Duration::ZERO));
        observed.push(("a", "miss", Duration::from_secs(60)));
        let (ours, theirs) = (timed(&observed, 4), reference(&observed));
        // Line by line; a sum only to the rounding of prometheus's f64 additions (ours
        // adds whole nanoseconds, exactly).
        assert_eq!(ours.lines().count(), theirs.lines().count());
        for (a, b) in ours.lines().zip(theirs.lines()) {
            let (name_a, value_a) = a.rsplit_once(' ').expect("a sample line");
            let (name_b, value_b) = b.rsplit_once(' ').expect("a sample line");
            if name_a.starts_with("t_seconds_sum") {
                assert_eq!(name_a, name_b);
                let (x, y): (f64, f64) = (value_a.parse().expect("x"), value_b.parse().expect("y"));
                assert!((x - y).abs() <= 1e-9 * y.abs(), "{a} against {b}");
            } else {
                assert_eq!(a, b);
            }
        }
    }

    #[test]
    fn the_same_labels_give_the_same_series() {
        let registry = Registry::new();
        let vec = TimedVec::register(&registry, ("u_total", "C."), ("u_seconds", "T."), &["x"])
            .expect("register");
        vec.with_label_values(&["1"])
            .observe(Duration::from_micros(3));
        let again = vec.with_label_values(&["1"]);
        again.observe(Duration::from_micros(3));
        assert_eq!(again.count(), 2);
        assert_eq!(vec.with_label_values(&["2"]).count(), 0);
    }

    #[test]
    fn a_name_registered_twice_is_refused() {
        let registry = Registry::new();
        TimedVec::register(&registry, ("v_total", "C."), ("v_seconds", "T."), &["x"])
            .expect("first");
        assert!(
            TimedVec::register(&registry, ("v_total", "C."), ("w_seconds", "T."), &["x"]).is_err()
        );
    }
}
