//! The destination side: a VM arriving. `Incoming` is what the VMM holds while (and after) a
//! VM arrives: it runs the receive, and keeps an interrupted post-copy for a resume.
//!
//! Files in the order data flows: `receive` (handshake, pages, state, Go) → `postcopy`
//! (faults and pages after the switch) → `recovery` (carrying on over a new connection).
//! `arrival` is the conversation's rules: each state's frames dispatched by `Filling::on_frame`.

mod arrival;
mod checkpoints;
mod handover;
mod install;
mod installers;
mod lanes;
pub mod postcopy;
mod prefault;
mod receive;
mod resume;
mod storage;

use crate::sync::Locked;
pub use handover::Handover;
pub use prefault::FaultIn;
mod recovery;

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::board::StatusBoard;
use crate::error::{Error, Result};
use crate::io::gate::Gate;
use crate::io::lanefile::SnapshotFile;
use crate::io::tls::Tls;
use crate::io::transport::{Endpoint, Listener, PeerIdentity, Stream};
use crate::status::{Phase, Role, Status};
use crate::vm::{HandedFiles, Migratable, VmDescriptor};
use crate::wire::{self, Message, StreamMode};

/// How long a cancelled resume may take to hand the interrupted post-copy back (one poll).
const RESUME_HANDBACK_WAIT: Duration = Duration::from_secs(2);

/// Waits for the first connection that opens a live migration: the stream header and a
/// `Hello` that is not a snapshot. Connections open off this thread (see `io::gate`); others
/// are told why and closed, and the wait goes on until `stop` says so.
fn first_live_stream(
    listener: &Listener,
    stop: &dyn Fn() -> bool,
) -> Result<Option<(Stream, Result<Opening>)>> {
    let gate = Gate::new(listener)?;
    loop {
        let Some(opened) = gate.next(stop)? else {
            return Ok(None);
        };
        match &opened.first {
            Message::Hello { mode, .. } if *mode != StreamMode::Snapshot => {
                let version = opened.version;
                let (s, first) = opened.admit();
                return Ok(Some((s, Ok(Opening { version, first }))));
            }
            Message::Hello { .. } => opened.refuse(
                "a snapshot stream on a migration listener (use ferry run --restore)".into(),
            ),
            other => {
                let why = format!("a connection opened with {} instead of Hello", other.name());
                opened.refuse(why);
            }
        }
    }
}
use arrival::Opening;
pub use arrival::{Expect, MAX_RESUME_WINDOW};
use receive::{Arrived, Receiver};
pub use resume::WAITING as WAITING_FOR_RESUME;

/// Where an incoming VM comes from, opened before anyone may send it.
pub enum Source {
    Listening(Listener),
    Snapshot(Stream),
}

impl Source {
    /// Binds the migration listener, so that a source can connect from now on; with `tls`,
    /// only a source holding a certificate of our CA gets through.
    pub fn listen(endpoint: &Endpoint, tls: Option<&Tls>) -> Result<Self> {
        Ok(Source::Listening(endpoint.listen(tls)?))
    }

    pub fn snapshot(path: &Path) -> Result<Self> {
        std::fs::File::open(path)
            .and_then(SnapshotFile::open)
            .map(|f| Source::Snapshot(Stream::File(f)))
            .map_err(|e| Error::transport(format!("cannot open snapshot {}", path.display()), e))
    }
}

/// A VM's arrival, and what is left of it when post-copy was cut.
pub struct Incoming {
    board: StatusBoard,
    tls: Option<Tls>,
    /// A post-copy cut after the switch: kept while the VM runs, as dropping it would stop
    /// serving the pages still on the source.
    interrupted: Mutex<Option<Arc<postcopy::Postcopy>>>,
    fault_in: FaultIn,
    /// Whether a stop request or the VM's start comes first.
    handover: Handover,
    /// The resume waiting for its source, by its cancel flag.
    resume_wait: Mutex<Option<Arc<AtomicBool>>>,
}

impl Incoming {
    pub fn new(board: StatusBoard, tls: Option<Tls>) -> Arc<Self> {
        Self::faulting_in(board, tls, FaultIn::Auto)
    }

    /// An arrival whose round 0 meets fresh memory as `fault_in` says, not as the host's
    /// cores suggest.
    pub fn faulting_in(board: StatusBoard, tls: Option<Tls>, fault_in: FaultIn) -> Arc<Self> {
        Arc::new(Self {
            board,
            tls,
            interrupted: Mutex::new(None),
            fault_in,
            handover: Handover::default(),
            resume_wait: Mutex::new(None),
        })
    }

    /// A stop request from `who` (e.g. the API's shutdown) while a VM may be arriving: the
    /// arrival ends and its source runs on, unless the VM was already handed over here.
    pub fn stop_arrival(&self, who: &str) -> Result<()> {
        self.handover.stop(who)
    }

    /// Receives one VM. `build` makes a paused, empty VM of the given shape; `on_resumed`
    /// gets it the moment it runs (in post-copy, before its memory has all arrived). Returns
    /// the VM once it runs here; a post-copy cut after the switch is not an error (the VM
    /// runs; the status says `postcopy-paused`, and `resume` carries on).
    ///
    /// A listener skips connections that do not open a live ferry migration within
    /// `OPENING_WAIT` (an idle or foreign peer, a snapshot replayed over the network), telling
    /// such a peer why, and keeps waiting; it stops waiting (`Ok(None)`) once `stop` (a stop
    /// signal) or `stop_arrival` says so. Once a VM arrives, either ends the arrival with
    /// `Error::Stopped` up to the moment the VM would run here (see `handover`).
    pub fn receive<V: Migratable + 'static>(
        &self,
        source: Source,
        stop: &dyn Fn() -> bool,
        build: impl FnOnce(&VmDescriptor, Option<HandedFiles>) -> Result<Arc<V>>,
        on_resumed: impl FnOnce(&Arc<V>),
    ) -> Result<Option<Arc<V>>> {
        let (stream, hello, expect, peer, listener) = match source {
            Source::Listening(l) => {
                let stop_waiting = || stop() || self.handover.stopped();
                let Some((s, hello)) = first_live_stream(&l, &stop_waiting)? else {
                    return Ok(None);
                };
                let from = match s.peer_identity() {
                    Ok(PeerIdentity::Address(ip)) => format!("from {ip}"),
                    Ok(PeerIdentity::Certificate(_)) => "over TLS".into(),
                    Ok(PeerIdentity::User(uid)) => format!("from this host (uid {uid})"),
                    _ => "incoming".into(),
                };
                // Kept until the migration's extra connections joined; then closed.
                (s, hello, Expect::Live, from, Some(l))
            }
            Source::Snapshot(mut s) => {
                let hello = wire::read_stream_header(&mut s).and_then(|version| {
                    let first = wire::read_message(&mut s)?;
                    Ok(Opening { version, first })
                });
                (
                    s,
                    hello,
                    Expect::Snapshot,
                    "from a snapshot file".into(),
                    None,
                )
            }
        };
        let mut receiver = Receiver {
            board: &self.board,
            status: Status::new(Role::Destination, None, peer),
            expect,
            listener,
            cpu: Default::default(),
            fault_in: self.fault_in,
            handover: &self.handover,
            stop,
        };
        match receiver.receive(stream, hello, build, on_resumed)? {
            Arrived::Complete(vm) => Ok(Some(vm)),
            Arrived::Interrupted(vm, dest, e) => {
                self.put_back(dest);
                let mut s = receiver.status;
                s.phase = Phase::PostcopyPaused;
                s.error = Some(format!(
                    "post-copy interrupted after the switch: {}; the VM runs on the pages it \
                     has, and vCPUs that touch a page still on the source wait for it \
                     (PUT vm.migrate-resume carries on)",
                    e.report()
                ));
                self.board.publish(&s);
                Ok(Some(vm))
            }
        }
    }

    /// Carries on an interrupted post-copy: waits for the source on `endpoint` in the
    /// background, for at most `wait`, until `cancel_resume`, or until a later `resume`
    /// replaces this one (a wrong address must not leave the guest waiting for good).
    pub fn resume(self: &Arc<Self>, endpoint: &Endpoint, wait: Duration) -> Result<()> {
        self.cancel_resume();
        let dest = self.take_interrupted()?;
        let listener = match endpoint.listen(self.tls.as_ref()) {
            Ok(l) => l,
            Err(e) => {
                self.put_back(dest);
                return Err(e);
            }
        };
        let cancelled = Arc::new(AtomicBool::new(false));
        *self.resume_wait.locked() = Some(cancelled.clone());
        let this = self.clone();
        let deadline = Instant::now() + wait;
        let endpoint = endpoint.to_string();
        let spawned = std::thread::Builder::new()
            .name("postcopy-resume".into())
            .spawn(move || {
                let stop = || {
                    if cancelled.load(Ordering::Acquire) {
                        Some(Error::Cancelled)
                    } else if Instant::now() >= deadline {
                        Some(Error::State(format!(
                            "no source resumed on {endpoint} within {} s",
                            wait.as_secs()
                        )))
                    } else {
                        None
                    }
                };
                let result = recovery::resume(&dest, listener, &stop);
                this.resumed(dest, result);
            });
        spawned
            .map(|_| ())
            .map_err(|e| Error::vm_caused("cannot start the resume", e))
    }

    /// Stops a resume still waiting for its source (its pages stay owed; a later resume
    /// carries on); whether one was waiting.
    pub fn cancel_resume(&self) -> bool {
        let Some(waiting) = self.resume_wait.locked().take() else {
            return false;
        };
        waiting.store(true, Ordering::Release);
        // The waiting thread hands the interrupted post-copy back within one poll.
        let deadline = Instant::now() + RESUME_HANDBACK_WAIT;
        while self.lock_interrupted().is_none() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        true
    }

    fn lock_interrupted(&self) -> std::sync::MutexGuard<'_, Option<Arc<postcopy::Postcopy>>> {
        self.interrupted.locked()
    }

    fn take_interrupted(&self) -> Result<Arc<postcopy::Postcopy>> {
        self.lock_interrupted()
            .take()
            .ok_or_else(|| Error::State("there is no interrupted post-copy to resume here".into()))
    }

    fn put_back(&self, dest: Arc<postcopy::Postcopy>) {
        *self.lock_interrupted() = Some(dest);
    }

    /// How a resume ended: completed, or failed with its pages still owed.
    fn resumed(&self, dest: Arc<postcopy::Postcopy>, result: Result<wire::PostcopyReport>) {
        let mut s = self.board.read();
        match result {
            Ok(report) => {
                dest.ram().allow_huge_pages();
                s.phase = Phase::Completed;
                s.report.completed_at_unix_ns = Some(crate::status::now_ns());
                s.error = None;
                s.report.memory_checksum_destination = report.memory_checksum;
                s.report.postcopy_report = Some(report);
            }
            Err(e) => {
                s.error = Some(format!("resuming post-copy failed: {}", e.report()));
                self.put_back(dest);
            }
        }
        self.board.publish(&s);
    }
}
