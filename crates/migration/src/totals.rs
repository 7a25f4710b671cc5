//! What the migrations a status board saw end add up to: figures that only grow, for
//! metrics that count (a Prometheus counter must never go down, although each migration's
//! own progress starts again from zero). Each run counts once, when it first ends.

use crate::buckets::{Buckets, DOWNTIME_BUCKETS_S, FAULT_LATENCY_BUCKETS_S};
use crate::status::{Phase, Role, Status};

/// Figures summed over every migration that ended.
#[derive(Clone, Debug, PartialEq)]
pub struct Totals {
    /// Migrations that ended, by role and outcome (completed, failed, cancelled).
    pub ended: Vec<((Role, Phase), u64)>,
    pub pages_full: u64,
    pub pages_zero: u64,
    pub pages_skipped: u64,
    /// Of `pages_skipped`, those the guest gave back (its balloon's).
    pub pages_skipped_free: u64,
    pub pages_skipped_zero: u64,
    pub bytes_on_wire: u64,
    pub rounds: u64,
    /// Each completed migration's downtime on this host's clock.
    pub downtime: Buckets,
    /// Post-copy faults that waited for the network (destination).
    pub fault_latency: Buckets,
    /// The last run counted (see `Status::run`).
    last_run: u64,
}

impl Default for Totals {
    fn default() -> Self {
        Self {
            ended: Vec::new(),
            pages_full: 0,
            pages_zero: 0,
            pages_skipped: 0,
            pages_skipped_free: 0,
            pages_skipped_zero: 0,
            bytes_on_wire: 0,
            rounds: 0,
            downtime: Buckets::new(&DOWNTIME_BUCKETS_S),
            fault_latency: Buckets::new(&FAULT_LATENCY_BUCKETS_S),
            last_run: 0,
        }
    }
}

/// Whether a migration in `phase` is over for good.
pub fn has_ended(phase: Phase) -> bool {
    matches!(phase, Phase::Completed | Phase::Failed | Phase::Cancelled)
}

impl Totals {
    /// Counts `s` if its run just ended and was not counted yet.
    pub fn count(&mut self, s: &Status) {
        if !has_ended(s.phase) || s.run == self.last_run {
            return;
        }
        self.last_run = s.run;
        let key = (s.role, s.phase);
        match self.ended.iter_mut().find(|(k, _)| *k == key) {
            Some((_, n)) => *n += 1,
            None => self.ended.push((key, 1)),
        }
        let p = &s.progress;
        self.pages_full += p.pages.full;
        self.pages_zero += p.pages.zero;
        self.pages_skipped += p.pages.skipped_unpopulated;
        self.pages_skipped_free += p.pages.skipped_free;
        self.pages_skipped_zero += p.pages.skipped_zero;
        self.bytes_on_wire += p.bytes_on_wire;
        self.rounds += p.rounds.len() as u64;
        let downtime = match s.role {
            Role::Source => s.report.downtime,
            Role::Destination => s.report.destination_downtime,
        };
        if let (Phase::Completed, Some(d)) = (s.phase, downtime) {
            self.downtime.observe(d.as_secs_f64());
        }
        self.fault_latency.add(&s.fault_latency.0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::status::Transfer;

    fn ended(run: u64, phase: Phase, pages: u64, downtime_ms: f64) -> Status {
        let mut s = Status::new(Role::Source, Some(Transfer::Precopy), "peer".into());
        s.run = run;
        s.phase = phase;
        s.progress.pages.full = pages;
        s.progress.bytes_on_wire = pages * 4096;
        s.report.downtime = Some(std::time::Duration::from_secs_f64(downtime_ms / 1e3));
        s
    }

    #[test]
    fn each_run_counts_once_when_it_ends() {
        let mut t = Totals::default();
        let mut running = ended(1, Phase::Active, 10, 3.0);
        t.count(&running);
        assert_eq!(t.pages_full, 0, "a running migration is not counted");
        running.phase = Phase::Completed;
        t.count(&running);
        t.count(&running);
        assert_eq!((t.pages_full, t.bytes_on_wire), (10, 40960));
        t.count(&ended(2, Phase::Failed, 5, 1.0));
        assert_eq!(t.pages_full, 15);
        assert_eq!(
            t.ended,
            vec![
                ((Role::Source, Phase::Completed), 1),
                ((Role::Source, Phase::Failed), 1)
            ]
        );
        // Only a completed migration had a downtime.
        assert_eq!(t.downtime.count, 1);
        assert_eq!(t.downtime.per_bucket()[2], (0.002, 0));
        assert_eq!(t.downtime.per_bucket()[3], (0.005, 1));
    }
}
