//! One outgoing migration from start to end: the handshake, then `rounds`, `switchover` and
//! (after the switch) `postcopy`. The session owns its status and publishes snapshots of it.
//!
//! Until the destination confirms it runs the VM, any failure — the peer dies, the link drops,
//! a bad answer, a timeout, a cancel — leaves the source as it was: dirty logging off, the
//! vCPUs running again if they ran before.

use crate::sync::Locked;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::checkpoints::Checkpoints;
use super::controls::{Controls, Leftover};
use super::lane::{self, Lane};
use super::machine::{Event, SourceState};
use crate::bitmap::Bitmap;
use crate::board::StatusBoard;
use crate::cpu::{CpuMeter, Work, Worker};
use crate::error::{Error, Result};
use crate::io::transport::Stream;
use crate::memory::GuestRam;
use crate::pages::PageSender;
use crate::params::MigrationParams;
use crate::ratelimit::RateLimiter;
use crate::status::{Laps, Phase, Status, ms, now_ns};
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
    /// The destination said it can take post-copy.
    pub peer_postcopy: bool,
    /// The connection's shortest round trip, where TCP says it.
    pub round_trip: Option<Duration>,
    /// Time spent sending pages, for the bandwidth estimate.
    pub send_time: Duration,
    /// Whether the VM ran when the migration began (a failure leaves it as it was).
    was_running: bool,
    /// Whether this session paused the VM (and so must resume it on failure).
    pub paused_at: Option<(Instant, u64)>,
    pub dirty_logging: bool,
    /// Auto-converge: the share of time the guest's vCPUs sleep now.
    pub throttle: u8,
    /// When the last page was in place (post-copy ends after the guest resumed).
    pub finished: Option<Instant>,
    /// Post-copy checkpoints coming back from the destination, when asked for.
    pub checkpoints: Option<Arc<Checkpoints>>,
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
        let (pages, limiter) = lane::page_sender(params, 0, &stream, &cpu);
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
            peer_postcopy: false,
            round_trip: None,
            send_time: Duration::ZERO,
            was_running: vm.is_running(),
            paused_at: None,
            dirty_logging: false,
            throttle: 0,
            finished: None,
            checkpoints: None,
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
        wire::write_message(&mut self.stream, msg)
    }

    /// The whole migration; `Ok` means the destination runs the VM.
    pub fn run(&mut self, mode: StreamMode) -> Result<()> {
        let _tracked = self.cpu.track(Work::Send, Worker::Lane(0));
        self.lap("connect");
        let start_ns = now_ns();
        self.status.report.guest_pages_per_s_before = self
            .vm
            .guest_progress_rate(start_ns.saturating_sub(RATE_WINDOW_NS), start_ns);
        self.status.memory_pages = self.ram.pages();
        wire::write_stream_header(&mut self.stream)?;
        // A file takes lanes only when laid out for them.
        let connections = if self.stream.has_peer() || self.dial.is_some() {
            self.params.connections.max(1)
        } else {
            1
        };
        self.status.connections = connections;
        self.status.migration_threads = (0..connections)
            .map(|lane| self.params.packers_of(lane) as u32)
            .sum();
        let session = if connections > 1 {
            lane::session_id()?
        } else {
            0
        };
        self.send(&Message::Hello {
            vm: self.vm.descriptor(),
            mode,
            source: format!("ferry {}", env!("CARGO_PKG_VERSION")),
            connections,
            session,
        })?;
        if self.stream.has_peer() {
            // A cancel now closes the connection (see `Controls::handshake`); one that came
            // before is seen here.
            *self.controls.handshake.locked() = self.stream.try_clone().ok();
            let ready = self
                .check_continue()
                .and_then(|()| self.hear())
                .map_err(|e| match e {
                    // Whatever answered is no ferry destination (an HTTP server, another service).
                    Error::Protocol(why) => Error::Protocol(format!(
                        "the destination's first answer is not ferry's ({why}): is a ferry \
                     --incoming listening there?"
                    )),
                    e => e,
                });
            *self.controls.handshake.locked() = None;
            self.cancel_closes(&self.stream);
            if let Message::Ready { postcopy } = ready? {
                self.peer_postcopy = postcopy;
                self.status.destination_supports_postcopy = Some(postcopy);
            }
            if self.params.mode.wants_postcopy() && !self.peer_postcopy {
                return Err(Error::Param(
                    "the destination cannot take post-copy (no userfaultfd there)".into(),
                ));
            }
            self.lap("handshake");
            if let Some((_, rtt)) = self.stream.tcp_path() {
                self.stream.fit_send_buffer(rtt);
                self.round_trip = Some(rtt);
            }
            if connections > 1 {
                self.open_lanes(session)?;
                self.lap("extra connections");
            }
        } else {
            if connections > 1 {
                self.open_lanes(session)?;
            }
            self.step(Event::StartRounds)?;
        }
        self.status.report.setup_ms = ms(self.started.elapsed());
        self.status.phase = Phase::Active;
        self.publish();
        self.transfer(mode, start_ns)
    }

    pub fn pause(&mut self) -> Result<()> {
        if self.paused_at.is_none() {
            self.vm.pause()?;
            self.paused_at = Some((Instant::now(), now_ns()));
        }
        Ok(())
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
        // A migration that failed says where its CPU went too.
        self.note_cpu();
        if self.throttle > 0 {
            // Whatever the outcome, the guest is not left slowed down.
            let _ = self.vm.set_throttle(0);
            self.throttle = 0;
        }
        let error = match result {
            Ok(()) => {
                if self.dirty_logging {
                    let _ = self.vm.stop_dirty_log();
                }
                self.publish();
                return Ok(());
            }
            Err(e) => self.explain(e),
        };
        let went = match self.state {
            SourceState::Postcopy | SourceState::AwaitGuestReport | SourceState::Done => true,
            // Go was sent: the destination starts unless it said why it would not (its
            // `Abort` comes only before the VM ran there: a stop request, a failed load).
            SourceState::AwaitResumed { .. } | SourceState::AwaitLoadedGoSent { .. } => {
                !matches!(error, Error::Peer(_))
            }
            _ => false,
        };
        if !went {
            // Nothing ran on the destination: there is nothing a resume could carry on.
            *self.leftover.locked() = None;
        }
        if went {
            // The VM may run on the destination now: neither resume here nor give it up.
            self.status.phase = if self.leftover_pending() {
                Phase::PostcopyPaused
            } else {
                Phase::Unconfirmed
            };
            self.status.error = Some(error.to_string());
            self.publish();
            return Err(error);
        }
        if self.dirty_logging {
            let _ = self.vm.stop_dirty_log();
        }
        // The destination hears why first: it lets go of the disks it may have taken while
        // loading the state, which the source takes back to run (it never resumes without
        // `Go`, so the order cannot make two copies).
        if self.stream.has_peer() {
            let _ = self.stream.set_timeouts(Some(Duration::from_millis(200)));
            let _ = self.send(&Message::Abort {
                reason: error.to_string(),
            });
            self.stream
                .close_after_last_word(Duration::from_millis(300));
        }
        let mut error = error;
        if self.paused_at.is_some()
            && self.was_running
            && let Err(e) = self.vm.resume()
        {
            error = Error::vm_caused(format!("{error}; and resuming the source failed"), e);
        }
        self.status.phase = if matches!(error, Error::Cancelled) {
            Phase::Cancelled
        } else {
            Phase::Failed
        };
        self.status.error = Some(error.to_string());
        self.publish();
        Err(error)
    }

    fn leftover_pending(&self) -> bool {
        self.leftover.locked().is_some()
    }

    /// A send that failed because the peer gave up: fetch the peer's reason if it sent one.
    fn explain(&mut self, e: Error) -> Error {
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
