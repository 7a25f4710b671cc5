//! The switch: pause, send what is left (or, for post-copy, which pages will follow) and the
//! VM state, wait for the destination to load it, say `Go`, hear it resumed.

use crate::sync::Locked;
use std::io::Write;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::checkpoints::Checkpoints;
use super::machine::{Event, SourceState};
use super::session::Session;
use crate::bitmap::Bitmap;
use crate::error::Result;
use crate::io::transport::Stream;
use crate::scan::memory_checksum;
use crate::status::{Phase, ms};
use crate::wire::Message;

/// The longest the source waits for its send queue to empty before pausing the guest.
const SWITCH_DRAIN_LIMIT: Duration = Duration::from_secs(2);
/// How long the source waits for the destination's guest report after it resumed.
pub(super) const GUEST_REPORT_WAIT: Duration = Duration::from_secs(4);
/// How long a paused source waits for each answer of the switch (Loaded, Resumed): a silent
/// destination cannot keep the VM frozen for longer.
const SWITCH_ANSWER_WAIT: Duration = Duration::from_secs(30);

impl Session<'_> {
    pub(super) fn switch_over(
        &mut self,
        mut pending: Bitmap,
        postcopy: bool,
        start_ns: u64,
    ) -> Result<()> {
        self.check_continue()?;
        // After live rounds, the destination catches up before the pause (and, for post-copy,
        // drops the copies dirtied since they were sent), so the pause holds only the rest.
        if self.paused_at.is_none()
            && self.stream.has_peer()
            && !self.status.progress.rounds.is_empty()
        {
            if postcopy {
                self.drop_stale_before_pause(&pending)?;
            } else {
                self.sync_before_pause()?;
            }
            self.lap("catch-up");
        }
        self.status.phase = Phase::Switchover;
        self.publish();
        if self.paused_at.is_none() {
            // Let the earlier rounds leave the send queue first: the last pages and the state
            // must not wait behind them while the guest is paused.
            self.stream.drain(SWITCH_DRAIN_LIMIT);
            self.lap("drain");
        }
        self.pause()?;
        // Its disks are flushed and let go now, for the destination to take; a failure from
        // here on takes them back before the VM runs here again (`resume`).
        self.vm.release_devices()?;
        self.step(Event::Paused)?;
        self.lap("pause");
        let (paused_at, paused_at_ns) = self.paused_at.expect("paused above");
        self.status.report.guest_pages_per_s_during =
            self.vm.guest_progress_rate(start_ns, paused_at_ns);
        if self.dirty_logging {
            self.vm.take_dirty_into(&mut pending)?;
            self.lap("harvest paused");
        }
        self.check_page_data(); // the guest is still
        let round = self.status.progress.rounds.len() as u32;
        if postcopy {
            // Post-copy installs whole pages: no delta may follow.
            self.pages.forget_deltas();
            self.status.postcopy = true;
            self.send(&Message::PostcopyPending {
                map: pending.clone(),
            })?;
            if let Some(every_ms) = self.params.checkpoint_ms {
                self.checkpoints = Some(Arc::new(Checkpoints::new(
                    &self.ram,
                    self.vm.descriptor().vcpus,
                    every_ms,
                    self.board,
                )?));
                self.send(&Message::Checkpoints { every_ms })?;
            }
        } else if pending.count() > 0 || round == 0 {
            self.send_round(round, &pending)?;
        }
        self.end_lanes()?;
        self.lap("last pages");
        let checksum = if self.params.checksum {
            Some(memory_checksum(&self.ram)?)
        } else {
            None
        };
        self.status.report.memory_checksum_source = checksum;
        self.send_state(checksum)?;
        self.lap("state");
        if !self.stream.has_peer() {
            self.stream.flush()?;
            if let Stream::File(f) = &mut self.stream {
                f.sync_all()?;
            }
            self.complete(None);
            return Ok(());
        }
        self.stream.set_timeouts(Some(SWITCH_ANSWER_WAIT))?;
        if postcopy {
            // Should the connection drop once Go is sent, these pages are what a resume owes
            // (forgotten if it fails before).
            self.keep_leftover(pending.clone());
        }
        if self.params.goes_with_state(self.round_trip) {
            self.send_go(postcopy)?;
            self.hear_loaded()?;
            self.lap("go, loaded");
        } else {
            self.hear_loaded()?;
            self.lap("loaded");
            self.send_go(postcopy)?;
        }
        let Message::Resumed { state_to_resume_ns } = self.hear()? else {
            unreachable!("the state machine admits only Resumed here")
        };
        // The stretches add up to the total: it ends where the last of them does.
        let resumed_at = self.lap("go, resumed");
        self.status.report.downtime_ms = Some(ms(paused_at.elapsed()));
        self.status.report.destination_downtime_ms = Some(state_to_resume_ns as f64 / 1e6);
        if postcopy {
            self.status.phase = Phase::Postcopy;
            self.publish();
            self.post_copy(pending)?;
            self.lap("post-copy");
        } else {
            self.note_cpu();
            self.await_guest_report();
        }
        self.complete(Some(resumed_at));
        Ok(())
    }

    /// Before a switch to post-copy after rounds: the destination drops the copies the guest
    /// dirtied since they were sent while the guest still runs here, so that the pause only
    /// drops those it dirties from now on (hybrid's downtime no longer grows with them).
    fn drop_stale_before_pause(&mut self, stale: &Bitmap) -> Result<()> {
        self.end_lanes()?; // every copy must have landed before it is dropped
        self.send(&Message::Stale { map: stale.clone() })?;
        self.step(Event::StaleSent)?;
        self.hear()?;
        self.status.report.stale_pages_dropped_before_pause = Some(stale.count());
        Ok(())
    }

    fn hear_loaded(&mut self) -> Result<()> {
        if let Message::Loaded { memory_checksum } = self.hear()? {
            self.status.report.memory_checksum_destination = memory_checksum;
        }
        Ok(())
    }

    /// The last moment a cancel is heard: once `Go` leaves, the VM may run there.
    fn send_go(&mut self, postcopy: bool) -> Result<()> {
        {
            let controls = self.controls;
            let mut go_sent = controls.go_sent.locked();
            self.check_continue()?;
            *go_sent = true;
            // No cancel is taken from here on: nothing may close the connections under `Go`.
            controls.connections.locked().clear();
        }
        self.send(&Message::Go)?;
        self.step(Event::GoSent { postcopy })
    }

    /// Before a pre-copy pause: waits for the destination to apply what it has received (a
    /// backlog of compressed frames can be many times its bytes in pages), so that the pause
    /// holds only the last pages.
    fn sync_before_pause(&mut self) -> Result<()> {
        let lane_pages = self.lane_pages();
        self.send(&Message::Sync { lane_pages })?;
        self.step(Event::SyncSent)?;
        self.hear()?;
        Ok(())
    }

    fn send_state(&mut self, checksum: Option<u64>) -> Result<()> {
        for (index, state) in self.vm.save_vcpus()?.into_iter().enumerate() {
            self.send(&Message::VcpuState {
                index: index as u32,
                state,
            })?;
        }
        let devices = self.vm.save_devices()?;
        self.send(&Message::DeviceState { state: devices })?;
        let c = self.sent();
        self.send(&Message::StateEnd {
            pages_sent: c.full + c.zero,
            memory_checksum: checksum,
        })?;
        self.step(Event::StateSent)
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

    /// The CPU this migration's threads used, taken once, at the first call: when its
    /// transfer ended (not a second later, after the guest's report), or when it failed.
    pub(super) fn note_cpu(&mut self) {
        if self.status.report.cpu.is_empty() {
            self.status.report.cpu = self.cpu.uses();
        }
    }

    pub(super) fn note_guest_report(&mut self, observed_ns: Option<u64>, rate: Option<f64>) {
        self.status.report.guest_observed_downtime_ms = observed_ns.map(|n| n as f64 / 1e6);
        self.status.report.guest_pages_per_s_after = rate;
    }

    /// The destination runs the VM: the final figures. Post-copy ends when the last page is in
    /// place; the others when the guest resumed.
    fn complete(&mut self, resumed_at: Option<Instant>) {
        self.note_cpu();
        self.state = SourceState::Done;
        let end = self.finished.or(resumed_at).unwrap_or_else(Instant::now);
        let total = end.duration_since(self.started);
        let c = self.publish_counters();
        self.status.progress.pages_remaining = 0;
        let r = &mut self.status.report;
        r.total_ms = ms(total);
        r.average_throughput_mbps = c.bytes as f64 * 8.0 / total.as_secs_f64().max(1e-9) / 1e6;
        self.status.phase = Phase::Completed;
    }
}
