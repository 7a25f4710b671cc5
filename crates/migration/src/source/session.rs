//! One outgoing migration from start to end: its phases in order — `handshake` → `rounds` →
//! `switchover` → `serving` — each handing the next its result, and the outcome. The session
//! holds the connection, the page senders and the status it publishes snapshots of.
//!
//! Until the destination confirms it runs the VM, any failure — the peer dies, the link drops,
//! a bad answer, a timeout, a cancel, a panic — leaves the source as it was: dirty logging
//! off, the guest not slowed, the vCPUs running again if they ran before (`guards`).

use crate::sync::Locked;
use std::sync::Mutex;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::controls::{Controls, Leftover};
use super::guards::{Held, Paused};
use super::lane::{self, Lane};
use super::machine::{Event, SourceState};
use crate::bitmap::Bitmap;
use crate::board::StatusBoard;
use crate::cpu::{CpuMeter, Work, Worker};
use crate::error::{Error, Result};
use crate::io::transport::Stream;
use crate::memory::GuestRam;
use crate::pages::PageSender;
use crate::params::{MigrationParams, Mode};
use crate::ratelimit::RateLimiter;
use crate::status::{Laps, Phase, Status, now_ns};
use crate::vm::Migratable;
use crate::wire::{self, Frame, Message, StreamMode};

/// Window for the guest's progress rate before the migration.
const RATE_WINDOW_NS: u64 = 2_000_000_000;

/// Opens lane N's stream: one more connection to the destination, or the lane of a snapshot
/// file written by several writers.
pub(crate) type Dial<'a> = Box<dyn Fn(u32) -> Result<Stream> + 'a>;

pub(crate) struct Session<'a> {
    pub vm: &'a dyn Migratable,
    pub ram: GuestRam,
    pub stream: Stream,
    /// Lane 0's pages, on the main connection.
    pub pages: PageSender,
    /// Lanes 1.. (`connections > 1`), opened after `Ready`.
    pub lanes: Vec<Lane>,
    pub dial: Option<Dial<'a>>,
    pub limiter: RateLimiter,
    pub params: &'a MigrationParams,
    pub controls: &'a Controls,
    pub leftover: &'a Mutex<Option<Leftover>>,
    pub board: &'a StatusBoard,
    pub status: Status,
    pub state: SourceState,
    pub started: Instant,
    pub sent_once: Bitmap,
    /// Time spent sending pages, for the bandwidth estimate.
    pub send_time: Duration,
    /// A live update's messages, the only bytes on its socket (other modes count pages).
    pub message_bytes: u64,
    /// Names this migration to its extra connections and to a resume (random; 0 for a file
    /// written by one writer).
    pub session_id: u64,
    /// Copies of each page queued, for a pre-copy that can carry on after a broken connection
    /// (`resume`); `None` where it cannot.
    pub copies: Option<crate::copies::Copies>,
    /// Pages counted as sent that never landed (lost with a broken connection).
    pub pages_lost: u64,
    /// What this migration changed on the VM, put back on every way out (see `guards`).
    pub held: Held<'a>,
    /// Whether the VM ran when the migration began (a failure leaves it as it was).
    was_running: bool,
    /// The CPU time of this migration's threads (see `crate::cpu`).
    pub cpu: CpuMeter,
    /// Where the time goes, stretch by stretch (`Report::breakdown`).
    laps: Laps,
}

impl Drop for Session<'_> {
    fn drop(&mut self) {
        // The clones a cancel would shut down end with the session, and their fds with them.
        self.controls.connections.locked().clear();
    }
}

impl<'a> Session<'a> {
    /// Lets a cancelled migration's `stream` be shut down, until `Go` (see
    /// `Controls::connections`).
    pub(super) fn cancel_closes(&self, stream: &Stream) {
        if let Ok(clone) = stream.try_clone() {
            self.controls.connections.locked().push(clone);
        }
    }

    pub fn new(
        vm: &'a dyn Migratable,
        stream: Stream,
        params: &'a MigrationParams,
        controls: &'a Controls,
        leftover: &'a Mutex<Option<Leftover>>,
        board: &'a StatusBoard,
        status: Status,
    ) -> Self {
        let ram = vm.ram();
        let cpu = CpuMeter::default();
        let local = stream.is_local_socket();
        let (pages, limiter) = lane::page_sender(params, 0, &stream, local, &cpu);
        Self {
            vm,
            sent_once: Bitmap::new(ram.gfn_end()),
            ram,
            stream,
            pages,
            lanes: Vec::new(),
            dial: None,
            limiter,
            params,
            controls,
            leftover,
            board,
            status,
            state: SourceState::AwaitReady,
            started: Instant::now(),
            laps: Laps::starting(Instant::now()),
            send_time: Duration::ZERO,
            message_bytes: 0,
            session_id: 0,
            copies: None,
            pages_lost: 0,
            held: Held::new(vm),
            was_running: vm.is_running(),
            cpu,
        }
    }

    pub fn publish(&self) {
        self.board.publish(&self.status);
    }

    /// Counts the migration from `at` (before connecting), not from this session's start.
    pub fn began_at(&mut self, at: Instant) {
        self.started = at;
        self.laps = Laps::starting(at);
    }

    /// Ends the stretch of the migration called `name` (see `Report::breakdown`).
    pub fn lap(&mut self, name: impl Into<String>) -> Instant {
        self.laps.lap(name, &mut self.status.report)
    }

    /// Moves the conversation on; an event the state does not allow is an error.
    pub fn step(&mut self, event: Event<'_>) -> Result<()> {
        self.state = self.state.next(event)?;
        Ok(())
    }

    /// Reads the destination's next message and checks it against the conversation.
    pub fn hear(&mut self) -> Result<Message> {
        let msg = match wire::read_frame(&mut self.stream)? {
            Frame::Message(m) => m,
            Frame::Pages { .. } => {
                return Err(Error::Protocol("the destination sent a page frame".into()));
            }
        };
        self.step(Event::Heard(&msg))?;
        Ok(msg)
    }

    pub fn send(&mut self, msg: &Message) -> Result<()> {
        wire::write_message(&mut self.stream, msg)?;
        if self.params.mode == Mode::Local {
            // No page crosses a live update's socket: its bytes are the messages'.
            let frame = wire::frame::FRAME_HEADER_LEN + msg.encode().len() + 4;
            self.message_bytes += frame as u64;
        }
        Ok(())
    }

    /// The whole migration; `Ok` means the destination runs the VM.
    pub fn run(&mut self, mode: StreamMode) -> Result<()> {
        let _tracked = self.cpu.track(Work::Send, Worker::Lane(0));
        self.lap("connect");
        let start_ns = now_ns();
        // Counted from here: what an earlier migration throttled is not this one's.
        self.vm.take_throttled();
        self.status.report.guest_pages_per_s_before = self
            .vm
            .guest_progress_rate(start_ns.saturating_sub(RATE_WINDOW_NS), start_ns);
        self.status.memory_pages = self.ram.pages();
        let agreed = self.handshake(mode)?;
        self.status.report.setup = self.started.elapsed();
        self.status.phase = Phase::Active;
        self.publish();
        let handover = self.transfer(mode, &agreed)?;
        let switched = self.switch_over(handover, &agreed, start_ns)?;
        self.serve(switched)
    }

    /// Pauses the guest, once; when it paused.
    pub fn pause(&mut self) -> Result<(Instant, u64)> {
        if self.held.paused.is_none() {
            self.held.paused = Some(Paused::new(self.vm, self.was_running)?);
        }
        let paused = self.held.paused.as_ref().expect("paused above");
        Ok((paused.at, paused.at_ns))
    }

    pub fn is_paused(&self) -> bool {
        self.held.paused.is_some()
    }

    pub fn check_continue(&self) -> Result<()> {
        if self.controls.cancel.load(Ordering::Acquire) {
            return Err(Error::Cancelled);
        }
        if self.started.elapsed() > Duration::from_secs(self.params.timeout_s) {
            return Err(Error::Timeout(self.params.timeout_s));
        }
        Ok(())
    }

    /// Settles the outcome: on failure before `Go`, the source is left as it was.
    pub fn finish(mut self, result: Result<()>) -> Result<()> {
        self.held.throttle.release();
        let error = match result {
            Ok(()) => {
                // The VM runs on the destination (or its home is the file now).
                self.held.dirty_log = None;
                if let Some(p) = self.held.paused.take() {
                    p.keep();
                }
                self.publish();
                return Ok(());
            }
            Err(e) => self.explain(e),
        };
        // A migration that failed says how far it got: its time, bytes and CPU.
        self.tally(Instant::now());
        let error = if self.may_run_there(&error) {
            self.leave_unconfirmed(error)
        } else {
            self.run_on_here(error)
        };
        self.status.error = Some(error.report());
        self.publish();
        Err(error)
    }

    /// Whether the VM may run on the destination after the migration failed with `error`.
    fn may_run_there(&self, error: &Error) -> bool {
        match self.state {
            SourceState::Postcopy | SourceState::AwaitGuestReport | SourceState::Done => true,
            // Go was sent: the destination starts unless it said why it would not (its
            // `Abort` comes only before the VM ran there: a stop request, a failed load).
            SourceState::AwaitResumed { .. } | SourceState::AwaitLoadedGoSent { .. } => {
                !matches!(error, Error::Peer(_))
            }
            _ => false,
        }
    }

    /// The VM may run on the destination now: neither resume here nor give it up.
    fn leave_unconfirmed(&mut self, error: Error) -> Error {
        if let Some(p) = self.held.paused.take() {
            p.keep();
        }
        if let Some(l) = self.held.dirty_log.take() {
            l.keep();
        }
        self.status.phase = if self.leftover_pending() {
            Phase::PostcopyPaused
        } else {
            Phase::Unconfirmed
        };
        error
    }

    /// Nothing ran on the destination: the source carries on as it was.
    fn run_on_here(&mut self, error: Error) -> Error {
        // There is nothing a post-copy resume could carry on.
        *self.leftover.locked() = None;
        self.held.dirty_log = None;
        // The destination hears why first: it lets go of the disks it may have taken while
        // loading the state, which the source takes back to run (it never resumes without
        // `Go`, so the order cannot make two copies).
        if self.stream.has_peer() {
            let _ = self.stream.set_timeouts(Some(Duration::from_millis(200)));
            let abort = Message::Abort {
                reason: error.report(),
            };
            let told = self.send(&abort).is_ok() && !error.is_break();
            self.stream
                .close_after_last_word(Duration::from_millis(300));
            // A destination told it may wait for a resume would otherwise wait its window out.
            if !told && self.copies.is_some() {
                self.say_farewell(&abort);
            }
        }
        let mut error = error;
        if let Some(paused) = self.held.paused.take()
            && let Err(e) = paused.undo()
        {
            let failed = format!("{}; and resuming the source failed", error.report());
            error = Error::vm_caused(failed, e);
        }
        self.status.phase = if matches!(error, Error::Cancelled) {
            Phase::Cancelled
        } else {
            Phase::Failed
        };
        error
    }

    /// The CPU this migration's threads used, taken once, at the first call: when its
    /// transfer ended (not a second later, after the guest's report), or when it failed.
    pub(super) fn note_cpu(&mut self) {
        if self.status.report.cpu.is_empty() {
            self.status.report.cpu = self.cpu.uses();
        }
    }

    fn leftover_pending(&self) -> bool {
        self.leftover.locked().is_some()
    }

    /// A send that failed because the peer gave up: fetch the peer's reason if it sent one.
    pub(super) fn explain(&mut self, e: Error) -> Error {
        // A cancel closed the connection under the read or the write.
        if self.controls.cancel.load(Ordering::Acquire)
            && matches!(e, Error::Transport { .. } | Error::Protocol(_))
        {
            return Error::Cancelled;
        }
        if !matches!(e, Error::Transport { .. }) || !self.stream.has_peer() {
            return e;
        }
        let _ = self.stream.set_timeouts(Some(Duration::from_millis(500)));
        for _ in 0..64 {
            match wire::read_frame(&mut self.stream) {
                Ok(Frame::Message(Message::Abort { reason })) => return Error::Peer(reason),
                Ok(Frame::Message(_)) => continue,
                _ => return e,
            }
        }
        e
    }
}
