//! The switch: pause, send what is left (or, for post-copy, which pages will follow) and the
//! VM state, wait for the destination to load it, say `Go`, hear it resumed.

use crate::sync::Locked;
use std::io::Write;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::checkpoints::Checkpoints;
use super::handshake::Agreed;
use super::machine::Event;
use super::rounds::Handover;
use super::session::Session;
use crate::bitmap::Bitmap;
use crate::error::Result;
use crate::io::transport::Stream;
use crate::params::Mode;
use crate::scan::memory_checksum;
use crate::status::Phase;
use crate::wire::Message;

/// The longest the source waits for its send queue to empty before pausing the guest.
const SWITCH_DRAIN_LIMIT: Duration = Duration::from_secs(2);
/// How long a paused source waits for each answer of the switch (Loaded, Resumed): a silent
/// destination cannot keep the VM frozen for longer.
const SWITCH_ANSWER_WAIT: Duration = Duration::from_secs(30);

/// Pages that follow the switch (post-copy), and the checkpoints coming back, when asked for.
pub(super) struct Follow {
    pub pending: Bitmap,
    pub checkpoints: Option<Arc<Checkpoints>>,
}

/// Where the switch left the VM, for the serving phase.
pub(super) enum Switched {
    /// Written to a file: its new home.
    ToFile,
    /// Running on the destination since `at`; with post-copy, its pages still follow.
    Resumed { at: Instant, follow: Option<Follow> },
}

impl Session<'_> {
    pub(super) fn switch_over(
        &mut self,
        handover: Handover,
        agreed: &Agreed,
        start_ns: u64,
    ) -> Result<Switched> {
        let Handover {
            mut pending,
            postcopy,
            mut written,
        } = handover;
        self.check_continue()?;
        self.catch_up(&pending, postcopy)?;
        self.status.phase = Phase::Switchover;
        self.publish();
        if !self.is_paused() {
            // Let the earlier rounds leave the send queue first: the last pages and the state
            // must not wait behind them while the guest is paused.
            self.stream.drain(SWITCH_DRAIN_LIMIT);
            self.lap("drain");
        }
        let (paused_at, paused_at_ns) = self.pause()?;
        // Its disks are flushed and let go now, for the destination to take; a failure from
        // here on takes them back before the VM runs here again (`resume`).
        let local = self.params.mode == Mode::Local;
        self.vm.release_devices(local)?;
        self.step(Event::Paused)?;
        self.lap("pause");
        self.status.report.guest_pages_per_s_during =
            self.vm.guest_progress_rate(start_ns, paused_at_ns);
        self.status.report.vcpus_throttled = Some(self.vm.take_throttled());
        if self.held.dirty_log.is_some() {
            self.vm.take_last_dirty(&mut pending)?;
            self.lap("harvest paused");
        }
        self.check_page_data(); // the guest is still
        let follow = if postcopy {
            Some(self.announce_postcopy(pending)?)
        } else {
            if !local {
                self.send_last_round(&pending)?;
                self.send_last_blocks(&mut written)?;
            }
            None
        };
        self.end_lanes()?;
        self.lap("last pages");
        self.send_state()?;
        self.lap("state");
        if !self.stream.has_peer() {
            self.stream.flush()?;
            if let Stream::File(f) = &mut self.stream {
                f.sync_all()?;
            }
            return Ok(Switched::ToFile);
        }
        self.hand_over(follow.as_ref(), agreed)?;
        // The stretches add up to the total: it ends where the last of them does.
        let at = self.lap("go, resumed");
        self.status.report.downtime = Some(paused_at.elapsed());
        Ok(Switched::Resumed { at, follow })
    }

    /// The disks' last written blocks: the VM is paused and its disks flushed, so these are
    /// the last writes the guest made here.
    fn send_last_blocks(&mut self, written: &mut Vec<Bitmap>) -> Result<()> {
        if self.held.disks.is_none() {
            return Ok(());
        }
        let last = self.take_disk_writes();
        if written.is_empty() {
            *written = last;
        } else {
            written.iter_mut().zip(&last).for_each(|(w, l)| w.merge(l));
        }
        self.send_disk_blocks(written, true)?;
        self.lap("last blocks");
        Ok(())
    }

    /// After live rounds, the destination catches up before the pause (and, for post-copy,
    /// drops the copies dirtied since they were sent), so the pause holds only the rest.
    fn catch_up(&mut self, pending: &Bitmap, postcopy: bool) -> Result<()> {
        if self.is_paused() || !self.stream.has_peer() || self.status.progress.rounds.is_empty() {
            return Ok(());
        }
        if postcopy {
            self.drop_stale_before_pause(pending)?;
        } else {
            self.sync_before_pause()?;
        }
        self.lap("catch-up");
        Ok(())
    }

    /// Names the pages that will follow the switch, and starts taking checkpoints back when
    /// asked for.
    fn announce_postcopy(&mut self, pending: Bitmap) -> Result<Follow> {
        // Post-copy installs whole pages: no delta may follow.
        self.pages.forget_deltas();
        for lane in &mut self.lanes {
            lane.pages.forget_deltas();
        }
        self.status.postcopy = true;
        self.send(&Message::PostcopyPending {
            map: pending.clone(),
        })?;
        if !self.lanes.is_empty() {
            self.send(&Message::PushOnLanes)?;
        }
        let mut checkpoints = None;
        if let Some(every_ms) = self.params.checkpoint_ms {
            checkpoints = Some(Arc::new(Checkpoints::new(
                &self.ram,
                self.vm.descriptor().vcpus,
                every_ms,
                self.board,
            )?));
            self.send(&Message::Checkpoints { every_ms })?;
        }
        Ok(Follow {
            pending,
            checkpoints,
        })
    }

    /// The pages dirtied since the last round, sent while the guest is paused (warm and
    /// snapshot: every page, as their only round).
    fn send_last_round(&mut self, pending: &Bitmap) -> Result<()> {
        let round = self.status.progress.rounds.len() as u32;
        if pending.count() > 0 || round == 0 {
            self.send_round(round, pending, false)?;
        }
        Ok(())
    }

    /// `Loaded` and `Go` (in the order the path favours), then `Resumed`.
    fn hand_over(&mut self, follow: Option<&Follow>, agreed: &Agreed) -> Result<()> {
        self.stream.set_timeouts(Some(SWITCH_ANSWER_WAIT))?;
        let postcopy = follow.is_some();
        if let Some(f) = follow {
            // Should the connection drop once Go is sent, these pages are what a resume owes
            // (forgotten if it fails before).
            self.keep_leftover(f);
        }
        if self.params.goes_with_state(agreed.round_trip) {
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
        self.status.report.destination_downtime = Some(Duration::from_nanos(state_to_resume_ns));
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
            if let Some(paused) = &mut self.held.paused {
                paused.go_sent();
            }
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

    /// Every vCPU's and the devices' state, and the checksum of memory when asked for.
    fn send_state(&mut self) -> Result<()> {
        let checksum = if self.params.checksum {
            Some(memory_checksum(&self.ram)?)
        } else {
            None
        };
        self.status.report.memory_checksum_source = checksum;
        // The guest may use its hinted pages again, on whichever side runs it next.
        self.held.hints = None;
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
            pages_sent: c.full + c.zero - self.pages_lost,
            memory_checksum: checksum,
        })?;
        self.step(Event::StateSent)
    }
}
