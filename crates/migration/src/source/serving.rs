//! The last phase: the VM runs on the destination (or lies in its file). Post-copy's pages
//! follow (`postcopy`); the destination reports what the guest saw; the final figures.

use std::sync::mpsc::Receiver;
use std::time::{Duration, Instant};

use super::machine::SourceState;
use super::session::Session;
use super::switchover::Switched;
use crate::error::Result;
use crate::status::{GuestAfter, Phase};
use crate::wire::Message;

/// How long the source waits for the destination's guest report after it resumed.
const GUEST_REPORT_WAIT: Duration = Duration::from_secs(4);

/// Where the guest's figures after the switch come from (see `GuestAfter`).
pub(super) enum GuestFigures {
    /// None come: the VM lies in a file.
    None,
    /// Already heard: its downtime and work rate after.
    Heard(Option<u64>, Option<f64>),
    /// The next message on the connection.
    OnStream,
    /// From post-copy's reader of the destination's messages.
    Coming(Receiver<Result<Message>>),
}

impl Session<'_> {
    /// The VM runs on the destination (or lies in its file): the migration is complete at
    /// once, and the guest's own figures join the report when they come.
    pub(super) fn serve(&mut self, switched: Switched) -> Result<()> {
        let (end, guest) = match switched {
            Switched::ToFile => (Instant::now(), GuestFigures::None),
            Switched::Resumed {
                follow: Some(follow),
                ..
            } => {
                self.status.phase = Phase::Postcopy;
                self.publish();
                let followed = self.post_copy(follow)?;
                self.lap("post-copy");
                followed
            }
            Switched::Resumed { at, follow: None } => (at, GuestFigures::OnStream),
        };
        let expected = !matches!(guest, GuestFigures::None);
        self.complete(end, expected);
        if expected {
            let heard = self.hear_guest_report(guest);
            self.board.guest_after(heard);
        }
        self.state = SourceState::Done;
        Ok(())
    }

    /// What the destination says of the guest once it has run a moment; bounded wait.
    fn hear_guest_report(&mut self, from: GuestFigures) -> GuestAfter {
        let deadline = Instant::now() + GUEST_REPORT_WAIT;
        let heard = match from {
            GuestFigures::None => return GuestAfter::Unknown,
            GuestFigures::Heard(observed, rate) => Some(Message::GuestReport {
                observed_downtime_ns: observed,
                pages_per_s_after: rate,
            }),
            // The conversation waits for it (`AwaitGuestReport`): `hear` steps it on.
            GuestFigures::OnStream => {
                let _ = self.stream.set_timeouts(Some(GUEST_REPORT_WAIT));
                self.hear().ok()
            }
            GuestFigures::Coming(events) => std::iter::from_fn(|| {
                let left = deadline.saturating_duration_since(Instant::now());
                events.recv_timeout(left).ok()?.ok()
            })
            .find(|m| matches!(m, Message::GuestReport { .. })),
        };
        match heard {
            Some(Message::GuestReport {
                observed_downtime_ns,
                pages_per_s_after,
            }) => GuestAfter::Seen {
                observed_downtime: observed_downtime_ns.map(Duration::from_nanos),
                pages_per_s_after,
            },
            _ => GuestAfter::Unknown,
        }
    }

    /// The destination runs the VM: the final figures, up to `end`. Post-copy ends when the
    /// last page is in place; the others when the guest resumed. With `guest_expected`, the
    /// report says the guest's own figures follow.
    fn complete(&mut self, end: Instant, guest_expected: bool) {
        self.tally(end);
        self.status.progress.pages_remaining = 0;
        self.status.phase = Phase::Completed;
        if guest_expected {
            self.board.guest_after(GuestAfter::Pending);
        }
        self.publish();
    }

    /// The figures of the migration up to `end`: its time, the bytes it sent, its CPU.
    pub(super) fn tally(&mut self, end: Instant) {
        self.note_cpu();
        let total = end.duration_since(self.started);
        let c = self.publish_counters();
        let r = &mut self.status.report;
        r.total = total;
        r.average_throughput_mbps = c.bytes as f64 * 8.0 / total.as_secs_f64().max(1e-9) / 1e6;
    }
}
