//! Carrying a pre-copy on when its connection breaks while the VM still runs here: the dirty
//! log stays on, the source dials the destination again (for up to `resume_window_s`), says
//! `ResumePrecopy`, and hears from `CopiesHeld` how many copies of each page landed (and from
//! `BlocksHeld` of each disk block, where disks move). The pages and blocks whose count is
//! not ours (their last copy was lost on the way, or never left) go again with the next
//! round, together with what the guest wrote meanwhile: nothing that arrived intact crosses
//! twice. Nothing changes for the VM: it never stopped running here.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::controls::Controls;
use super::lane;
use super::session::Session;
use crate::bitmap::Bitmap;
use crate::copies::CountRuns;
use crate::error::{Error, Result};
use crate::io::transport::Stream;
use crate::sync::Locked;
use crate::wire::{self, Message};

/// The first wait between tries; it doubles up to `LAST_RETRY`.
const FIRST_RETRY: Duration = Duration::from_millis(100);
const LAST_RETRY: Duration = Duration::from_secs(2);
/// How long each step of a farewell may take.
const FAREWELL_WAIT: Duration = Duration::from_secs(1);
/// How often a wait between tries looks for a cancel.
const CANCEL_POLL: Duration = Duration::from_millis(50);

impl Session<'_> {
    /// Sends round `round`; should the connection break, carries the migration on over a new
    /// one. Returns the pages that must go again, or that a round `cuttable` for post-copy
    /// left unsent (`None`: the round went whole).
    pub(super) fn send_round_or_resume(
        &mut self,
        round: u32,
        set: &Bitmap,
        cuttable: bool,
    ) -> Result<Option<Bitmap>> {
        match self.send_round(round, set, cuttable) {
            Ok(unsent) => Ok(unsent),
            Err(e) => self.resume_after(e).map(Some),
        }
    }

    /// Sends the disks' blocks of a live round: `sets` (one per disk), or with `None` all
    /// they hold (round 0). Should the connection break, carries the migration on over a new
    /// one; the pages that must go again (the blocks go with the next ones taken).
    pub(super) fn send_disks_or_resume(
        &mut self,
        sets: Option<&[Bitmap]>,
    ) -> Result<Option<Bitmap>> {
        let sent = match sets {
            Some(sets) => self.send_disk_blocks(sets, false),
            None => self.send_whole_disks(),
        };
        match sent {
            Ok(()) => Ok(None),
            Err(e) => self.resume_after(e).map(Some),
        }
    }

    /// A send failed with `e`: where the link broke under a counted, running pre-copy, it is
    /// carried on over a new connection; the pages that go again.
    fn resume_after(&mut self, e: Error) -> Result<Bitmap> {
        if self.copies.is_none() || !e.is_break() || self.is_paused() {
            return Err(e);
        }
        match self.refused(e) {
            e if e.is_break() => self.resume_precopy(e),
            refusal => Err(refusal),
        }
    }

    /// A break where the destination said why it gave up (an `Abort` waiting unread, sent
    /// before it closed) is its refusal, not a link to carry on over: a peer that refused is
    /// not dialled again for the resume window.
    fn refused(&mut self, e: Error) -> Error {
        if self.stream.has_unread() {
            self.explain(e)
        } else {
            e
        }
    }

    /// Tries to reconnect until the window closes; the pages the destination lacks.
    fn resume_precopy(&mut self, cut: Error) -> Result<Bitmap> {
        let window = Duration::from_secs(self.params.resume_window_s);
        let broke = Instant::now();
        self.status.note = Some(format!(
            "the connection broke ({}); reconnecting for up to {} s, the VM runs on here",
            cut.report(),
            window.as_secs()
        ));
        self.publish();
        let mut wait = FIRST_RETRY;
        let _reconnecting = Reconnecting::new(self.controls);
        let last = loop {
            self.check_continue()?;
            let error = match self.reconnect() {
                Ok((again, blocks)) => {
                    self.carried_on(broke, &again, blocks);
                    return Ok(again);
                }
                Err(e) if e.is_break() => e,
                Err(e) => return Err(e),
            };
            if broke.elapsed() + wait > window {
                break error;
            }
            self.wait_for_retry(wait)?;
            wait = (wait * 2).min(LAST_RETRY);
        };
        Err(Error::transport(
            format!(
                "the connection broke ({}) and no new one carried the migration on within {} s",
                cut.report(),
                window.as_secs()
            ),
            std::io::Error::other(last.report()),
        ))
    }

    /// Waits `wait`, hearing a cancel; an operator's new address ends it at once.
    fn wait_for_retry(&self, wait: Duration) -> Result<()> {
        let until = Instant::now() + wait;
        while Instant::now() < until {
            self.check_continue()?;
            if self.controls.redial.locked().is_some() {
                return Ok(());
            }
            std::thread::sleep(CANCEL_POLL.min(until - Instant::now()));
        }
        Ok(())
    }

    /// One try: a new connection, the destination's counts, and a fresh sender on it. The
    /// pages that go again, and how many disk blocks do.
    fn reconnect(&mut self) -> Result<(Bitmap, u64)> {
        let dial = self
            .dial
            .as_ref()
            .ok_or_else(|| Error::State("this migration cannot dial again".into()))?;
        let redial = self.controls.redial.locked().take();
        let mut stream = match redial {
            Some(redial) => redial()?,
            None => dial(0)?,
        };
        wire::write_stream_header(&mut stream)?;
        let resume = Message::ResumePrecopy {
            session: self.session_id,
        };
        wire::write_message(&mut stream, &resume)?;
        let (received, runs) = match wire::read_message(&mut stream)? {
            Message::CopiesHeld { pages, runs } => (pages, runs),
            Message::Abort { reason } => return Err(Error::Peer(reason)),
            other => return Err(Error::out_of_turn("source", other.name(), "Resuming")),
        };
        // Everything is heard before any count changes: a connection that breaks meanwhile
        // leaves the counts as they were for the next try.
        let held_blocks = self.hear_blocks_held(&mut stream)?;
        let copies = self
            .copies
            .as_ref()
            .expect("only a counted pre-copy resumes");
        let again = copies.reconcile(&runs, "pages")?;
        let blocks = match (held_blocks, self.held.disks.as_mut()) {
            (Some(held), Some(disks)) => disks.reconcile(&held)?,
            _ => 0,
        };
        // What never landed is not counted as sent: the destination checks the total.
        let sent = self.pages.counters.full + self.pages.counters.zero;
        self.pages_lost = sent.saturating_sub(received);
        let same_host = self.pages.goes_to_this_host();
        let (mut pages, limiter) = lane::page_sender(self.params, 0, &stream, same_host, &self.cpu);
        pages.counters = self.pages.counters;
        self.pages = pages;
        self.limiter = limiter;
        self.cancel_closes(&stream);
        self.stream = stream;
        if let Some(disks) = self.held.disks.as_mut() {
            disks.packer = None; // its link windows were the old connection's
        }
        Ok((again, blocks))
    }

    /// Where disks move, the destination's `BlocksHeld` after `CopiesHeld`: per disk, the
    /// copies of each block that landed.
    fn hear_blocks_held(&self, stream: &mut Stream) -> Result<Option<Vec<CountRuns>>> {
        if self.held.disks.is_none() {
            return Ok(None);
        }
        match wire::read_message(stream)? {
            Message::BlocksHeld { disks } => Ok(Some(disks)),
            Message::Abort { reason } => Err(Error::Peer(reason)),
            other => Err(Error::out_of_turn("source", other.name(), "Resuming")),
        }
    }

    /// Tells a destination that waits to carry a broken pre-copy on that it will not be
    /// (`abort`): over a new connection, named by the session, within a second or so; a
    /// destination that cannot be reached waits its window out.
    pub(super) fn say_farewell(&self, abort: &Message) {
        let Some(dial) = self.dial.as_ref() else {
            return;
        };
        let Ok(mut stream) = dial(0) else {
            return;
        };
        let resume = Message::ResumePrecopy {
            session: self.session_id,
        };
        let heard = stream
            .set_timeouts(Some(FAREWELL_WAIT))
            .and_then(|()| wire::write_stream_header(&mut stream))
            .and_then(|()| wire::write_message(&mut stream, &resume))
            .and_then(|()| wire::read_message(&mut stream));
        // Where disks move, their counts follow: read, so that nothing unread resets the
        // connection under the abort.
        let heard_all = |stream: &mut Stream| {
            self.held.disks.is_none()
                || matches!(wire::read_message(stream), Ok(Message::BlocksHeld { .. }))
        };
        if let Ok(Message::CopiesHeld { .. }) = heard
            && heard_all(&mut stream)
            && wire::write_message(&mut stream, abort).is_ok()
        {
            stream.close_after_last_word(FAREWELL_WAIT);
        }
    }

    fn carried_on(&mut self, broke: Instant, again: &Bitmap, blocks: u64) {
        let crossed = again.iter().filter(|&gfn| self.sent_once.get(gfn)).count() as u64;
        let r = &mut self.status.report;
        r.resumes += 1;
        // Those that had crossed before (the rest of the round was never sent).
        r.pages_sent_again += crossed;
        let resumes = r.resumes;
        let blocks = match self.held.disks {
            Some(_) => format!(", and {blocks} disk blocks"),
            None => String::new(),
        };
        self.status.note = Some(format!(
            "the connection broke and a new one carried the migration on after {:.1} s: {} \
             pages go again, {crossed} of them a second time{blocks}",
            broke.elapsed().as_secs_f64(),
            again.count()
        ));
        self.lap(format!("resume {resumes}"));
        self.publish();
    }
}

/// Says a pre-copy is dialling again for as long as it lives (for `Outgoing::redirect`).
struct Reconnecting<'a>(&'a Controls);

impl<'a> Reconnecting<'a> {
    fn new(controls: &'a Controls) -> Self {
        controls.reconnecting.store(true, Ordering::Release);
        Self(controls)
    }
}

impl Drop for Reconnecting<'_> {
    fn drop(&mut self) {
        self.0.reconnecting.store(false, Ordering::Release);
        *self.0.redial.locked() = None;
    }
}
