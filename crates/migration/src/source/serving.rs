//! The last phase: the VM runs on the destination (or lies in its file). Post-copy's pages
//! follow (`postcopy`); the destination reports what the guest saw; the final figures.

use std::time::{Duration, Instant};

use super::machine::SourceState;
use super::session::Session;
use super::switchover::Switched;
use crate::error::Result;
use crate::status::Phase;
use crate::wire::Message;

/// How long the source waits for the destination's guest report after it resumed.
pub(super) const GUEST_REPORT_WAIT: Duration = Duration::from_secs(4);

impl Session<'_> {
    pub(super) fn serve(&mut self, switched: Switched) -> Result<()> {
        let end = match switched {
            Switched::ToFile => Instant::now(),
            Switched::Resumed {
                follow: Some(follow),
                ..
            } => {
                self.status.phase = Phase::Postcopy;
                self.publish();
                let finished = self.post_copy(follow)?;
                self.lap("post-copy");
                finished
            }
            Switched::Resumed { at, follow: None } => {
                self.note_cpu();
                self.await_guest_report();
                at
            }
        };
        self.complete(end);
        Ok(())
    }

    /// The destination reports what the guest saw once it has run a moment; bounded wait.
    fn await_guest_report(&mut self) {
        let _ = self.stream.set_timeouts(Some(GUEST_REPORT_WAIT));
        if let Ok(Message::GuestReport {
            observed_downtime_ns,
            pages_per_s_after,
        }) = self.hear()
        {
            self.note_guest_report(observed_downtime_ns, pages_per_s_after);
        }
    }

    pub(super) fn note_guest_report(&mut self, observed_ns: Option<u64>, rate: Option<f64>) {
        self.status.report.guest_observed_downtime = observed_ns.map(Duration::from_nanos);
        self.status.report.guest_pages_per_s_after = rate;
    }

    /// The destination runs the VM: the final figures, up to `end`. Post-copy ends when the
    /// last page is in place; the others when the guest resumed.
    fn complete(&mut self, end: Instant) {
        self.note_cpu();
        self.state = SourceState::Done;
        let total = end.duration_since(self.started);
        let c = self.publish_counters();
        self.status.progress.pages_remaining = 0;
        let r = &mut self.status.report;
        r.total = total;
        r.average_throughput_mbps = c.bytes as f64 * 8.0 / total.as_secs_f64().max(1e-9) / 1e6;
        self.status.phase = Phase::Completed;
    }
}
