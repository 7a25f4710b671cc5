//! Observations sorted into fixed buckets, as a metrics histogram shows them: a migration's
//! post-copy fault latencies (`FaultLatency`, part of its status) and, summed over the
//! migrations that ended, their downtimes (`totals`).

/// Upper bounds (seconds) of the downtime histogram's buckets.
pub const DOWNTIME_BUCKETS_S: [f64; 12] = [
    0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 5.0,
];

/// Upper bounds (seconds) of the post-copy fault latency histogram's buckets.
pub const FAULT_LATENCY_BUCKETS_S: [f64; 12] = [
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0,
];

/// Observations sorted into fixed buckets (each counts the values at most its bound; values
/// above the last bound count only in `count` and `sum`).
#[derive(Clone, Debug, PartialEq)]
pub struct Buckets {
    pub bounds: &'static [f64],
    pub counts: Vec<u64>,
    pub sum: f64,
    pub count: u64,
}

impl Buckets {
    pub fn new(bounds: &'static [f64]) -> Self {
        Self {
            bounds,
            counts: vec![0; bounds.len()],
            sum: 0.0,
            count: 0,
        }
    }

    pub fn observe(&mut self, v: f64) {
        if let Some(i) = self.bounds.iter().position(|&b| v <= b) {
            self.counts[i] += 1;
        }
        self.sum += v;
        self.count += 1;
    }

    /// Adds `other`'s observations (same bounds).
    pub fn add(&mut self, other: &Buckets) {
        debug_assert_eq!(self.bounds, other.bounds);
        for (c, o) in self.counts.iter_mut().zip(&other.counts) {
            *c += o;
        }
        self.sum += other.sum;
        self.count += other.count;
    }

    /// (bound, observations in that bucket alone), ending with the `+Inf` bucket of those
    /// above every bound: what an exposition encoder sums into its cumulative buckets.
    pub fn per_bucket(&self) -> Vec<(f64, u64)> {
        let above = self.count - self.counts.iter().sum::<u64>();
        self.bounds
            .iter()
            .copied()
            .zip(self.counts.iter().copied())
            .chain([(f64::INFINITY, above)])
            .collect()
    }
}

/// How long post-copy's network faults waited, in `FAULT_LATENCY_BUCKETS_S`.
#[derive(Clone, Debug, PartialEq)]
pub struct FaultLatency(pub Buckets);

impl Default for FaultLatency {
    fn default() -> Self {
        Self(Buckets::new(&FAULT_LATENCY_BUCKETS_S))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_keep_values_above_the_last_bound_in_count_and_sum() {
        let mut b = Buckets::new(&FAULT_LATENCY_BUCKETS_S);
        b.observe(0.0001);
        b.observe(7.0);
        assert_eq!(b.count, 2);
        let buckets = b.per_bucket();
        assert_eq!(buckets[0], (0.0001, 1));
        assert_eq!(buckets[buckets.len() - 2], (1.0, 0));
        assert_eq!(buckets.last(), Some(&(f64::INFINITY, 1)));
        assert!((b.sum - 7.0001).abs() < 1e-9);
    }
}
