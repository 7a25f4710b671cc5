//! Pre-copy rounds: round 0 sends every page that holds data (after what the disks that move
//! hold); later rounds send what the dirty log says changed, and the blocks written, until
//! the policy (or the user) says switch over.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::guards::{DirtyLog, FreePageHints};
use super::handshake::Agreed;
use super::lane::RoundShare;
use super::session::Session;
use super::storage;
use crate::bitmap::Bitmap;
use crate::error::Result;
use crate::params::{AutoConverge, Mode};
use crate::policy::{self, Decision, FULL_PAGE_WIRE_BYTES, Limits, Measured};
use crate::scan::{populated_pages, zero_pages_of};
use crate::status::RoundStats;
use crate::wire::lanes::lane_of;
use crate::wire::{Message, StreamMode};

/// Rounds without progress before pre-copy gives up iterating (see `policy`).
const MAX_STALLED_ROUNDS: u32 = 3;
/// A round of fewer pages is too short to time the link by.
const RATE_MIN_PAGES: u64 = 1024;
/// Live status is refreshed, and a cancel or the timeout heard, every this many pages inside
/// a round, or sooner on a slow link: every `STATUS_EVERY` (looked at every 64 pages; 4096
/// pages take 13 s at 10 Mbit/s).
const STATUS_EVERY_PAGES: u64 = 4096;
const STATUS_EVERY: Duration = Duration::from_millis(100);
/// How long round 0 waits for the guest to hint its free pages (a driver polls for the
/// request; handing over gigabytes takes it a few requests).
const HINTS_WAIT: Duration = Duration::from_secs(1);

/// The note of a migration the user switched to post-copy.
const ON_REQUEST: &str = "switched to post-copy on request";

/// What the rounds leave for the switch.
pub(super) struct Handover {
    /// The pages not sent since they were last written.
    pub pending: Bitmap,
    /// Whether they follow the switch (post-copy) rather than go inside it.
    pub postcopy: bool,
    /// Per moving disk, the blocks not sent since they were last written (`copy_storage`).
    pub written: Vec<Bitmap>,
}

impl Handover {
    fn postcopy(pending: Bitmap) -> Self {
        Self {
            pending,
            postcopy: true,
            written: Vec::new(),
        }
    }

    /// Nothing left: every page and block went in the rounds.
    fn nothing(pages: u64) -> Self {
        Self {
            pending: Bitmap::new(pages),
            postcopy: false,
            written: Vec::new(),
        }
    }
}

impl Session<'_> {
    /// Sends memory by the mode's rules until it is time to switch; what is left then.
    pub(super) fn transfer(&mut self, mode: StreamMode, agreed: &Agreed) -> Result<Handover> {
        if mode == StreamMode::Local {
            // The destination maps the very memory: nothing to send, nothing to track.
            return Ok(Handover::nothing(self.ram.gfn_end()));
        }
        // Log first, then look: a page the guest first touches while we scan is still caught.
        if mode == StreamMode::Precopy {
            self.count_copies()?;
            self.held.dirty_log = Some(DirtyLog::start(self.vm)?);
            self.lap("dirty log on");
            self.take_free_page_hints()?;
        } else {
            self.pause()?;
            self.check_page_data(); // the guest is still
            self.lap("pause");
        }
        // The disks first: they are most of what moves, and memory the guest dirties while
        // they cross would otherwise cross twice (QEMU's mirror runs before its RAM too).
        let disks_carry = self.send_disks_or_resume(None)?;
        let mut populated = populated_pages(&self.ram)?;
        self.lap("populated scan");
        self.count_skipped(&populated);
        if self.params.mode == Mode::Postcopy {
            // Nothing moves before the switch: every page that holds data follows it.
            return Ok(Handover::postcopy(populated));
        }
        if mode == StreamMode::Precopy {
            self.skip_zero_pages(&mut populated)?;
        }
        // Which pages round 0 sends, so that the destination faults them in meanwhile.
        self.send(&Message::Populated {
            map: populated.clone(),
        })?;
        self.lap("populated map");
        let cuttable = mode == StreamMode::Precopy && agreed.peer_postcopy;
        let carry = joined(
            disks_carry,
            self.send_round_or_resume(0, &populated, cuttable)?,
        );
        match (mode, self.params.mode) {
            (StreamMode::Precopy, Mode::Hybrid) => {
                let mut dirty = self.vm.take_dirty()?;
                if let Some(again) = &carry {
                    dirty.merge(again);
                }
                self.lap("harvest 1");
                Ok(Handover::postcopy(dirty))
            }
            (StreamMode::Precopy, _) => self.iterate(agreed.peer_postcopy, carry),
            _ => Ok(Handover::nothing(self.ram.gfn_end())),
        }
    }

    /// Asks the guest for its free pages and waits (a bounded time) for them: they are given
    /// back to the host, so the scan that follows skips them.
    fn take_free_page_hints(&mut self) -> Result<()> {
        let Some(hints) = FreePageHints::start(self.vm) else {
            return Ok(());
        };
        if !hints.wait(HINTS_WAIT) {
            tracing::debug!(target: "migration", "free page hints unfinished after {HINTS_WAIT:?}");
        }
        self.held.hints = Some(hints);
        // The hinted pages that held data are logged as written (now zeros), but the scan
        // leaves them out and the destination has none: forget the log so far. Round 0 reads
        // every page after this, so no write before it is lost.
        self.vm.take_dirty()?;
        self.lap("free page hints");
        Ok(())
    }

    /// Takes the pages that hold only zeros out of round 0: a destination's fresh memory reads
    /// as zeros, so it neither faults them in nor is sent a marker for each, and it stays as
    /// sparse as the source was (a booted Linux guest's memory is mostly such pages).
    /// The dirty log is on: a page written after it was read here is sent in a later round.
    /// Only before live rounds: post-copy switches at once and a paused guest would wait.
    fn skip_zero_pages(&mut self, populated: &mut Bitmap) -> Result<()> {
        let zeros = zero_pages_of(&self.ram, populated)?;
        populated.subtract(&zeros);
        self.status.progress.pages.skipped_zero = zeros.count();
        self.lap("zero scan");
        Ok(())
    }

    /// Pages skipped because never populated, and of those the ones the guest gave back.
    fn count_skipped(&mut self, populated: &Bitmap) {
        let p = &mut self.status.progress.pages;
        p.skipped_unpopulated = self.ram.pages() - populated.count();
        if let Some(mut given) = self.vm.given_back() {
            given.subtract(populated);
            p.skipped_free = given.count();
        }
    }

    /// Live rounds until the policy (or the user) says switch.
    /// `carry`: pages a resumed round 0 must send again.
    fn iterate(&mut self, peer_postcopy: bool, mut carry: Option<Bitmap>) -> Result<Handover> {
        let limits = Limits {
            max_downtime_ms: self.params.max_downtime_ms as f64,
            max_rounds: self.params.max_rounds,
            max_stalled_rounds: MAX_STALLED_ROUNDS,
        };
        let mut round = 1;
        let (mut previous, mut stalled) = (u64::MAX, 0);
        loop {
            self.check_continue()?;
            let mut dirty = self.vm.take_dirty()?;
            if let Some(again) = carry.take() {
                dirty.merge(&again);
            }
            let written = self.take_disk_writes();
            self.lap(format!("harvest {round}"));
            // Disk blocks weigh as the pages they hold: both must fit the pause.
            let count = dirty.count() + storage::pending_pages(&written);
            stalled = if policy::shrank(previous, count) {
                0
            } else {
                stalled + 1
            };
            previous = count;
            let measured = self.measure(round, count, stalled);
            if self.controls.start_postcopy.load(Ordering::Acquire) && peer_postcopy {
                // A round cut short for it has said so already.
                if !self
                    .status
                    .note
                    .as_deref()
                    .is_some_and(|n| n.starts_with(ON_REQUEST))
                {
                    self.status.note = Some(ON_REQUEST.into());
                }
                return Ok(Handover::postcopy(dirty));
            }
            if self.params.auto_postcopy
                && peer_postcopy
                && policy::cannot_converge(&measured, &limits)
            {
                self.status.report.converged = Some(false);
                self.status.note = Some(format!(
                    "pre-copy cannot converge after round {}: the guest dirties {:.0} pages/s, \
                     more than the link sends; switching to post-copy",
                    round - 1,
                    measured.dirty_pages_per_s
                ));
                return Ok(Handover::postcopy(dirty));
            }
            match policy::decide(&measured, &limits) {
                Decision::Iterate => {
                    // The pages freed since the last session, before this round reads them.
                    if let Some(hints) = &self.held.hints {
                        hints.again();
                    }
                    if policy::throttle_now(self.params.auto_converge, &measured, &limits)
                        && self.throttle_harder(&measured)?
                    {
                        stalled = 0; // a slower guest is a new game
                    }
                    carry = self.send_round_or_resume(round, &dirty, peer_postcopy)?;
                    carry = joined(carry, self.send_disks_or_resume(Some(&written))?);
                }
                Decision::SwitchOver { converged, why } => {
                    let postcopy = !converged && self.params.auto_postcopy;
                    self.status.report.converged = Some(converged);
                    self.status.note = Some(if postcopy {
                        format!("{why}; switching to post-copy instead")
                    } else {
                        why
                    });
                    return Ok(Handover {
                        pending: dirty,
                        postcopy,
                        written,
                    });
                }
            }
            round += 1;
        }
    }

    fn measure(&mut self, rounds_done: u32, pages_remaining: u64, stalled_rounds: u32) -> Measured {
        let p = &mut self.status.progress;
        // How fast pages move, in full-page bytes: with zero markers and compression the wire
        // carries less than that, and the pages still to send are counted as full ones. The
        // last round's rate, when it was large enough to time: its pages were dirtied like
        // those that remain (round 0 is mostly pages written once, or zero).
        let rate = |pages: u64, secs: f64| pages as f64 * FULL_PAGE_WIRE_BYTES / secs.max(1e-6);
        let bandwidth = match p.rounds.last() {
            Some(last) if p.rounds.len() > 1 && last.pages >= RATE_MIN_PAGES => {
                rate(last.pages, last.duration.as_secs_f64())
            }
            _ => rate(
                p.rounds.iter().map(|r| r.pages).sum(),
                self.send_time.as_secs_f64(),
            ),
        };
        // What the guest dirtied while the last round was on its way.
        let dirty_rate = match p.rounds.last_mut() {
            Some(last) => {
                last.dirty_pages_per_s =
                    pages_remaining as f64 / last.duration.as_secs_f64().max(1e-6);
                last.dirty_pages_per_s
            }
            None => 0.0,
        };
        p.dirty_pages_per_s = dirty_rate;
        p.pages_remaining = pages_remaining;
        let expected_ms = policy::expected_downtime_ms(pages_remaining, bandwidth);
        // None: the link has not moved a page yet, so no time is known.
        p.expected_downtime = Duration::try_from_secs_f64(expected_ms / 1e3).ok();
        let m = Measured {
            rounds_done,
            pages_remaining,
            bandwidth_bytes_per_s: bandwidth,
            dirty_pages_per_s: dirty_rate,
            stalled_rounds,
        };
        if policy::outpaced(&m) && self.status.note.is_none() {
            self.status.note =
                Some("the guest dirties memory faster than the link sends it".into());
        }
        self.publish();
        m
    }

    /// Auto-converge's step (`policy::next_throttle`). Whether it slowed the guest further.
    fn throttle_harder(&mut self, measured: &Measured) -> Result<bool> {
        let next = policy::next_throttle(self.held.throttle.percent(), measured);
        if next == self.held.throttle.percent() {
            return Ok(false);
        }
        self.held.throttle.set(next)?;
        let r = &mut self.status.report;
        r.throttle_percent_max = r.throttle_percent_max.max(next);
        let why = match self.params.auto_converge {
            AutoConverge::Early => "the guest dirties at least half of what the link sends",
            _ => "pre-copy was not converging",
        };
        self.status.note = Some(format!(
            "{why}: its vCPUs now sleep {next} % of the time (auto-converge {})",
            self.params.auto_converge.name()
        ));
        Ok(true)
    }

    /// A live pre-copy over one connection counts the copies it queues of each page (and
    /// disk block), so that a broken connection can be carried on (`resume`).
    fn count_copies(&mut self) -> Result<()> {
        let resumable = self.params.resume_window_s > 0
            && self.stream.has_peer()
            && self.params.connections == 1
            && matches!(self.params.mode, Mode::Precopy | Mode::Hybrid);
        if resumable {
            self.copies = Some(crate::copies::Copies::new(self.ram.gfn_end()));
            if let Some(disks) = self.held.disks.as_mut() {
                disks.count_copies();
            }
            let seconds = self.params.resume_window_s.min(u64::from(u32::MAX)) as u32;
            self.send(&Message::ResumeWindow { seconds })?;
        }
        Ok(())
    }

    /// Sends the pages of `set` as round `round` (over every lane).
    /// With `cuttable`, a switch to post-copy asked for meanwhile ends the round where it is:
    /// the pages it left unsent, which follow the switch.
    pub(super) fn send_round(
        &mut self,
        round: u32,
        set: &Bitmap,
        cuttable: bool,
    ) -> Result<Option<Bitmap>> {
        if let Some(copies) = &self.copies {
            copies.add_all(set);
        }
        let began = Instant::now();
        let before = self.sent();
        let unsent = self.with_lanes(set, cuttable, |this, share| {
            this.send_main_share(share, began, before.bytes)
        })?;
        let total = set.count() - unsent.as_ref().map_or(0, Bitmap::count);
        let elapsed = began.elapsed();
        self.send_time += elapsed;
        self.send(&Message::RoundEnd {
            round,
            pages: total,
        })?;
        self.count_sent(began, before.bytes, 0);
        self.lap(format!("round {round}"));
        let after = self.sent();
        let p = &mut self.status.progress;
        p.round = round;
        // Its dirty rate is known once the next dirty set is taken (see `measure`).
        p.rounds.push(RoundStats {
            round,
            pages: total,
            zero_pages: after.zero - before.zero,
            bytes: after.bytes - before.bytes,
            duration: elapsed,
            dirty_pages_per_s: 0.0,
            throttle_percent: self.held.throttle.percent(),
        });
        if unsent.is_some() {
            self.status.note = Some(format!(
                "{ON_REQUEST}: round {round} cut short after {total} pages"
            ));
        }
        self.publish();
        Ok(unsent)
    }

    /// Lane 0's pages of a round, sent on the main connection, with the live status.
    fn send_main_share(
        &mut self,
        share: &RoundShare<'_>,
        began: Instant,
        bytes_before: u64,
    ) -> Result<()> {
        let total = share.set.count();
        let mut last_status = Instant::now();
        let mut chunk = None;
        for (i, gfn) in share.set.iter().enumerate() {
            // A round that starts after the request sends nothing.
            if i == 0 && share.cut_now() {
                share.left_from[0].store(gfn, Ordering::Release);
                break;
            }
            if self.sent_once.get(gfn) {
                self.status.progress.pages.resent += 1;
            } else {
                self.sent_once.set(gfn);
            }
            if lane_of(gfn, share.lanes) == 0 {
                share.entering(gfn, &mut chunk)?;
                self.pages
                    .push(&mut self.stream, &self.ram, gfn, &mut self.limiter)?;
            }
            let n = i as u64 + 1;
            if n.is_multiple_of(STATUS_EVERY_PAGES)
                || (n.is_multiple_of(64) && last_status.elapsed() >= STATUS_EVERY)
            {
                last_status = Instant::now();
                self.check_continue()?;
                if share.cut_now() {
                    share.left_from[0].store(gfn + 1, Ordering::Release);
                    break;
                }
                if share.stop.load(Ordering::Acquire) {
                    break; // a lane failed: its error names the round's outcome
                }
                let c = self.pages.counters;
                let done = c.full + c.zero + share.done.load(Ordering::Relaxed);
                self.status.progress.pages_remaining = total.saturating_sub(done);
                let lanes = share.lane_bytes.load(Ordering::Relaxed);
                self.count_sent(began, bytes_before, lanes);
                self.publish();
            }
        }
        self.pages
            .flush(&mut self.stream, &self.ram, &mut self.limiter)
    }

    /// Copies the page senders' counters into the status, with the throughput since `began`.
    /// `lane_bytes`: what the extra lanes sent, while a round holds their senders.
    pub(super) fn count_sent(&mut self, began: Instant, bytes_before: u64, lane_bytes: u64) {
        let c = self.publish_counters();
        let p = &mut self.status.progress;
        p.bytes_on_wire = c.bytes + lane_bytes + self.message_bytes;
        p.throughput_mbps = p.bytes_on_wire.saturating_sub(bytes_before) as f64 * 8.0
            / began.elapsed().as_secs_f64().max(1e-9)
            / 1e6;
    }
}

/// Pages that go again for either of two reasons.
fn joined(a: Option<Bitmap>, b: Option<Bitmap>) -> Option<Bitmap> {
    match (a, b) {
        (Some(mut a), Some(b)) => {
            a.merge(&b);
            Some(a)
        }
        (a, b) => a.or(b),
    }
}
