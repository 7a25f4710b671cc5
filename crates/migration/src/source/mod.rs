//! The source side: a VM's outgoing migrations, one at a time. `Outgoing` is what the VMM
//! holds; it starts migrations and snapshots on their own thread, answers cancel and
//! start-postcopy, and keeps what an interrupted post-copy still owes for a resume.
//!
//! Files in the order data flows: `session` (the phases in order, the outcome) → `handshake`
//! → `rounds` (pre-copy) → `switchover` (pause, state, Go) → `serving` (after the switch; `postcopy`'s
//! pages follow, `pushes` saying who sends each) → `recovery` (carrying on over a new connection). Each phase hands the next
//! its result; `guards` hold what the migration changed on the VM (pause, dirty logging,
//! throttle) and put it back on every way out. `machine` is the conversation's rules;
//! `lanes` runs a session's extra connections, each a `lane`; `controls` is what `Outgoing`
//! shares with the migration it runs; `checkpoints`, what the destination sends back.

mod checkpoints;
mod controls;
mod guards;
mod handshake;
mod lane;
mod lanes;
pub mod machine;
mod postcopy;
mod pushes;
pub mod recovery;
mod resume;
mod rounds;
mod serving;
mod session;
mod storage;
mod switchover;

use crate::sync::Locked;
use std::fs::File;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::time::{Duration, Instant};

use crate::board::StatusBoard;
use crate::error::{Error, Result};
use crate::io::lanefile::{LaneWriter, SnapshotFile};
use crate::io::tls::Tls;
use crate::io::transport::{Endpoint, Stream};
use crate::params::{MigrationParams, Mode};
use crate::status::{Phase, Role, Status, Transfer};
use crate::vm::Migratable;
use crate::wire::StreamMode;
pub use controls::Controls;
use controls::Leftover;
use session::Session;

/// How long `wait_ended` lets a cancelled migration end by itself.
const CLOSE_AFTER: Duration = Duration::from_secs(1);

/// How long `send` waits to learn whether the destination answered.
const SETUP_WAIT: Duration = Duration::from_secs(15);
/// How long an operator's call waits for a migration whose end is published to let go of
/// the migration slot.
const SETTLE_WAIT: Duration = Duration::from_secs(2);

/// A VM's outgoing migrations.
pub struct Outgoing {
    board: StatusBoard,
    /// This host's TLS identity: every TCP migration is TLS when it is set.
    /// Replaceable between migrations (Cloud Hypervisor's profile names TLS per request).
    tls: Mutex<Option<Tls>>,
    controls: Controls,
    busy: Mutex<bool>,
    /// Told when a migration lets go of the slot (`release`).
    released: Condvar,
    leftover: Mutex<Option<Leftover>>,
    /// Whether the VM ran before the migration that ended unconfirmed (for `reclaim`).
    ran_before_unconfirmed: AtomicBool,
}

/// Where a VM taken back on the source runs from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Resumed {
    /// The moment it paused for the switch.
    Switch,
    /// The post-copy checkpoint of this sequence number.
    Checkpoint(u64),
}

/// Called once when a background migration ends: `Ok` means the VM runs elsewhere now.
pub type OnDone = Box<dyn FnOnce(&Result<()>) + Send>;

/// A live update passes the VM's memory as files to a process on this host.
fn check_local(vm: &dyn Migratable, endpoint: &Endpoint) -> Result<()> {
    if !matches!(endpoint, Endpoint::Unix(_)) {
        return Err(Error::Param(format!(
            "a local live update goes to a ferry on this host over a Unix socket (unix:PATH), \
             not {endpoint}"
        )));
    }
    if vm.ram().files().contains(&None) {
        return Err(Error::Param(ANONYMOUS_MEMORY.into()));
    }
    Ok(())
}

/// Why a VM on anonymous memory cannot be updated in place.
pub(crate) const ANONYMOUS_MEMORY: &str = "guest memory is anonymous: a live update passes \
    memory as a file, so the VM must run with --memory-backend memfd (memory.shared in the \
    Cloud Hypervisor profile)";

impl Outgoing {
    pub fn new(board: StatusBoard, tls: Option<Tls>) -> Arc<Self> {
        Arc::new(Self {
            board,
            tls: Mutex::new(tls),
            controls: Controls::default(),
            busy: Mutex::new(false),
            released: Condvar::new(),
            leftover: Mutex::new(None),
            ran_before_unconfirmed: AtomicBool::new(false),
        })
    }

    /// Whether a migration runs, as observers see it: one whose end is published is over,
    /// though its thread may still be tidying up (see `settled`).
    pub fn running(&self) -> bool {
        *self.busy.locked() && self.board.phase().is_running()
    }

    /// The migration slot, once a migration whose end is published has let go of it (at most
    /// `SETTLE_WAIT` later): an operator acting on the published end must not be refused for
    /// the moment its thread takes to finish.
    fn settled(&self) -> std::sync::MutexGuard<'_, bool> {
        let busy = self.busy.locked();
        self.released
            .wait_timeout_while(busy, SETTLE_WAIT, |busy| {
                *busy && !self.board.phase().is_running()
            })
            .unwrap_or_else(PoisonError::into_inner)
            .0
    }

    /// Claims the single migration slot; refused while one runs or where the VM may already
    /// run elsewhere (it must never run twice).
    fn claim(&self) -> Result<()> {
        let mut busy = self.settled();
        if *busy {
            return Err(Error::State("a migration is already running".into()));
        }
        let s = self.board.read();
        match (s.role, s.phase) {
            (_, Phase::Unconfirmed | Phase::PostcopyPaused | Phase::Postcopy) => {
                return Err(Error::State(format!(
                    "the VM's last migration is {}: it may run on {} already",
                    s.phase.name(),
                    s.peer
                )));
            }
            _ if s.moved_away() => {
                return Err(Error::State(format!("the VM has moved to {}", s.peer)));
            }
            _ => {}
        }
        *busy = true;
        self.controls.cancel.store(false, Ordering::Release);
        self.controls.start_postcopy.store(false, Ordering::Release);
        *self.controls.go_sent.locked() = false;
        Ok(())
    }

    fn release(&self) {
        *self.busy.locked() = false;
        self.released.notify_all();
    }

    /// Starts migrating `vm` to `endpoint` in the background, and returns once the
    /// destination answered (a dead address is an error here). `on_done` hears the end.
    /// The TLS the next migration dials with (none: plain, where the caller allowed it).
    pub fn set_tls(&self, tls: Option<Tls>) {
        *self.tls.locked() = tls;
    }

    fn tls(&self) -> Option<Tls> {
        self.tls.locked().clone()
    }

    pub fn send(
        self: &Arc<Self>,
        vm: Arc<dyn Migratable>,
        endpoint: Endpoint,
        params: MigrationParams,
        on_done: OnDone,
    ) -> Result<()> {
        params.validate()?;
        if params.mode == Mode::Local {
            check_local(vm.as_ref(), &endpoint)?;
        }
        self.claim()?;
        let status = Status::new(Role::Source, Some(params.mode.into()), endpoint.to_string());
        self.board.begin(&status);
        let this = self.clone();
        let spawned = std::thread::Builder::new()
            .name("migration".into())
            .spawn(move || {
                let result = this.migrate(vm.as_ref(), &endpoint, &params, status);
                if let Err(e) = &result {
                    tracing::warn!("migration failed: {}", e.report());
                }
                this.release();
                on_done(&result);
            });
        if let Err(e) = spawned {
            self.release();
            return Err(Error::vm_caused("cannot start the migration", e));
        }
        if self.board.wait_while(|p| p == Phase::Setup, SETUP_WAIT) == Phase::Failed {
            let s = self.board.read();
            return Err(Error::Setup(s.error.unwrap_or_default()));
        }
        Ok(())
    }

    fn migrate(
        &self,
        vm: &dyn Migratable,
        endpoint: &Endpoint,
        params: &MigrationParams,
        mut status: Status,
    ) -> Result<()> {
        let began = Instant::now();
        let tls = self.tls();
        let stream = match endpoint.connect(tls.as_ref()) {
            Ok(s) => s,
            Err(e) => {
                status.phase = Phase::Failed;
                status.error = Some(e.report());
                self.board.publish(&status);
                return Err(e);
            }
        };
        let mode = match params.mode {
            Mode::Warm => StreamMode::Warm,
            Mode::Local => StreamMode::Local,
            Mode::Precopy | Mode::Postcopy | Mode::Hybrid => StreamMode::Precopy,
        };
        let mut session = Session::new(
            vm,
            stream,
            params,
            &self.controls,
            &self.leftover,
            &self.board,
            status,
        );
        session.dial = Some(Box::new(move |_| endpoint.connect(tls.as_ref())));
        session.began_at(began);
        let was_running = vm.is_running();
        let result = session.run(mode);
        let result = session.finish(result);
        if matches!(
            self.board.phase(),
            Phase::Unconfirmed | Phase::PostcopyPaused
        ) {
            self.ran_before_unconfirmed
                .store(was_running, Ordering::Release);
        }
        result
    }

    /// After a switch whose outcome this side cannot know (`unconfirmed`: `Go` sent, no answer
    /// heard; or `postcopy-paused`: the post-copy connection broke): runs the VM here again,
    /// from the moment it paused for the switch, running or paused as it was before. ferry
    /// cannot know whether the destination runs it, which is why it waits; the operator can
    /// (its host is down, or fenced) and says so with this call. Whatever the guest did on the
    /// destination since the switch is lost; every page of that moment is still here (the
    /// source frees nothing it sent).
    ///
    /// When the post-copy sent checkpoints back, the VM runs from the newest one applied
    /// instead (a rollback): the guest loses only what it did after it. Returns which.
    pub fn reclaim(&self, vm: &dyn Migratable) -> Result<Resumed> {
        let busy = self.settled();
        let mut s = self.board.read();
        if *busy
            || s.role != Role::Source
            || !matches!(s.phase, Phase::Unconfirmed | Phase::PostcopyPaused)
        {
            return Err(Error::State(format!(
                "there is no switch to take back here (the last migration is {})",
                s.phase.name()
            )));
        }
        let checkpoints = self
            .leftover
            .locked()
            .as_ref()
            .and_then(|l| l.checkpoints.clone());
        // From here on nothing more is applied to the memory the VM runs on.
        let from = match checkpoints.as_ref().and_then(|c| c.close()) {
            Some(saved) => {
                if let Err(e) = vm.load_state(&saved.vcpus, &saved.devices) {
                    checkpoints.iter().for_each(|c| c.reopen());
                    return Err(e);
                }
                Resumed::Checkpoint(saved.seq)
            }
            None => Resumed::Switch,
        };
        let _ = vm.stop_dirty_log();
        // Refused while the destination still holds a disk: then it may still run the VM,
        // and nothing changes here (a post-copy can still carry on).
        if self.ran_before_unconfirmed.load(Ordering::Acquire)
            && let Err(e) = vm.resume()
        {
            checkpoints.iter().for_each(|c| c.reopen());
            return Err(e);
        }
        // A post-copy taken back can no longer be resumed.
        *self.leftover.locked() = None;
        let at = match from {
            Resumed::Switch => "from the switch".to_string(),
            Resumed::Checkpoint(seq) => format!(
                "from post-copy checkpoint {seq}, taken {:.0} ms after the switch",
                s.checkpoints
                    .as_ref()
                    .map_or(0.0, |c| c.last_at.as_secs_f64() * 1e3)
            ),
        };
        s.error = Some(format!(
            "taken back by the operator after a {} switch, {at} ({})",
            s.phase.name(),
            s.error.unwrap_or_default()
        ));
        s.phase = Phase::Failed;
        self.board.publish(&s);
        drop(busy);
        Ok(from)
    }

    /// Writes `vm` to `file` (a snapshot) and leaves the VM paused: its new home is the file.
    /// `name` is how the status names the file; `params` say how to compress (the rest of
    /// them is for migrations).
    pub fn snapshot(
        &self,
        vm: &dyn Migratable,
        file: File,
        name: &str,
        params: &MigrationParams,
    ) -> Result<Status> {
        self.claim()?;
        // Several writers (`connections`) write lanes of one file; one writes the stream.
        let file = match params.connections {
            0 | 1 => Ok(SnapshotFile::Plain(file)),
            n => LaneWriter::create(file, n).map(SnapshotFile::Writer),
        };
        let file = match file {
            Ok(f) => f,
            Err(e) => {
                self.release();
                return Err(Error::transport(format!("cannot write {name}"), e));
            }
        };
        let status = Status::new(Role::Source, Some(Transfer::Snapshot), name.to_string());
        self.board.begin(&status);
        // Opens the other writers' lanes of the same file.
        let opener = match &file {
            SnapshotFile::Writer(first) => Some(first.lane(0)),
            _ => None,
        };
        let mut session = Session::new(
            vm,
            Stream::File(file),
            params,
            &self.controls,
            &self.leftover,
            &self.board,
            status,
        );
        if let Some(opener) = opener {
            session.dial = Some(Box::new(move |lane| {
                Ok(Stream::File(SnapshotFile::Writer(opener.lane(lane))))
            }));
        }
        let result = session.run(StreamMode::Snapshot);
        let result = session.finish(result);
        self.release();
        result.map(|()| self.board.read())
    }

    pub fn cancel(&self) -> Result<()> {
        if !self.running() {
            return Err(Error::State("no migration is running".into()));
        }
        {
            let go_sent = self.controls.go_sent.locked();
            if *go_sent {
                return Err(Error::State(
                    "too late to cancel: Go was sent and the VM may run on the destination \
                     already (the switch ends within seconds)"
                        .into(),
                ));
            }
            self.controls.cancel.store(true, Ordering::Release);
        }
        if let Some(s) = self.controls.handshake.locked().as_ref() {
            s.shutdown();
        }
        Ok(())
    }

    /// Waits up to `limit` for a running migration to end (a cancel is heard within 100 ms
    /// in its rounds, at once in its handshake); its phase then.
    ///
    /// A cancelled migration hears the cancel within 100 ms, unless it is blocked in a write
    /// to a peer that reads nothing: after `CLOSE_AFTER` its connections are shut down (its
    /// destination then learns of it as a lost connection, not as a cancel).
    pub fn wait_ended(&self, limit: Duration) -> Phase {
        let running = |p: Phase| p.is_running();
        let phase = self.board.wait_while(running, limit.min(CLOSE_AFTER));
        if !phase.is_running() || limit <= CLOSE_AFTER {
            return phase;
        }
        if self.controls.cancel.load(Ordering::Acquire) {
            for s in self.controls.connections.locked().iter() {
                s.shutdown();
            }
        }
        self.board.wait_while(running, limit - CLOSE_AFTER)
    }

    /// Like QEMU's migrate-start-postcopy: the running pre-copy hands over by post-copy at
    /// once (the round being sent stops where it is; see `RoundShare::cut`).
    pub fn start_postcopy(&self) -> Result<()> {
        if !self.running() {
            return Err(Error::State("no migration is running".into()));
        }
        let s = self.board.read();
        if s.mode == Some(Transfer::Warm) {
            return Err(Error::State(
                "a warm migration has no live rounds to switch from (the guest is paused)".into(),
            ));
        }
        if s.destination_supports_postcopy == Some(false) {
            return Err(Error::State(
                "the destination does not support post-copy (no userfaultfd there)".into(),
            ));
        }
        if s.phase != Phase::Active || s.postcopy {
            return Err(Error::State(format!(
                "the migration is {}, not in its live rounds",
                s.phase.name()
            )));
        }
        self.controls.start_postcopy.store(true, Ordering::Release);
        Ok(())
    }

    /// Whether a post-copy lost its connection and can be resumed.
    pub fn can_resume(&self) -> bool {
        self.leftover.locked().is_some()
    }

    /// Carries on an interrupted post-copy over a new connection to `endpoint`.
    /// Points a pre-copy whose connection broke, while it dials again, at `endpoint` (the
    /// destination is reachable there now): it tries it at once. False when no pre-copy is
    /// reconnecting.
    pub fn redirect(&self, endpoint: Endpoint) -> bool {
        if !self.controls.reconnecting.load(Ordering::Acquire) {
            return false;
        }
        let tls = self.tls();
        *self.controls.redial.locked() = Some(Box::new(move || endpoint.connect(tls.as_ref())));
        true
    }

    pub fn resume_postcopy(
        self: &Arc<Self>,
        vm: Arc<dyn Migratable>,
        endpoint: Endpoint,
        on_done: OnDone,
    ) -> Result<()> {
        // The slot first, then what is left: `reclaim` takes the slot too, so a post-copy it
        // took back (the VM runs here again) can never be carried on as well.
        let left = {
            let mut busy = self.settled();
            if *busy {
                return Err(Error::State("a migration is already running".into()));
            }
            let left = self.leftover.locked().clone().ok_or_else(|| {
                Error::State("there is no interrupted post-copy to resume here".into())
            })?;
            *busy = true;
            left
        };
        let this = self.clone();
        let spawned = std::thread::Builder::new()
            .name("postcopy-resume".into())
            .spawn(move || {
                let status = this.board.read();
                let tls = this.tls();
                let result = recovery::resume(
                    vm.as_ref(),
                    &endpoint,
                    tls.as_ref(),
                    &left,
                    &this.board,
                    status,
                )
                .map(|_| ());
                match &result {
                    Ok(()) => *this.leftover.locked() = None,
                    Err(e) => {
                        let mut s = this.board.read();
                        s.phase = Phase::PostcopyPaused;
                        s.error = Some(format!("resuming post-copy failed: {}", e.report()));
                        this.board.publish(&s);
                    }
                }
                this.release();
                on_done(&result);
            });
        if let Err(e) = spawned {
            self.release();
            return Err(Error::vm_caused("cannot start the resume", e));
        }
        Ok(())
    }
}
