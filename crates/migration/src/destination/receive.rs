//! Receiving one VM: build what the stream describes, fill its memory, load its state, and
//! resume it only when everything arrived intact and the source said `Go`. On any failure
//! the VM is never resumed and the source is told why.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::arrival::{Event, Expect, Filled, Filling, Hello, Opening};
use super::handover::Handover;
use super::postcopy::{self, Postcopy};
use super::prefault::FaultIn;
use super::storage::DiskTargets;
use crate::board::StatusBoard;
use crate::cpu::{CpuMeter, Work, Worker};
use crate::error::{Error, Result};
use crate::io::transport::{Listener, Stream};
use crate::scan::memory_checksum;
use crate::status::{CheckpointStats, GuestAfter, Laps, Phase, RoundStats, Status, now_ns};
use crate::vm::{HandedFiles, Migratable, VmDescriptor};
use crate::wire::{self, Message, StreamMode};

/// The destination measures the guest's work rate over this window after resuming, then
/// reports what the guest saw to the source.
const AFTER_WINDOW: Duration = Duration::from_secs(1);

/// How long a failing destination keeps reading so that its `Abort` reaches the source.
const LAST_WORD_WAIT: Duration = Duration::from_secs(1);

/// Who asked to stop when a signal did.
const STOP_SIGNAL: &str = "a stop signal (SIGTERM or SIGINT)";

/// How a receive ended while the VM runs here.
pub(crate) enum Arrived<V> {
    /// Every page is here.
    Complete(Arc<V>),
    /// Post-copy lost its connection after the switch: the VM runs on the pages it has.
    Interrupted(Arc<V>, Arc<Postcopy>, Error),
}

pub(crate) struct Receiver<'a> {
    pub board: &'a StatusBoard,
    pub status: Status,
    pub expect: Expect,
    /// Where the migration arrived: its extra connections join here, then it closes.
    pub listener: Option<Listener>,
    /// The CPU time of this receive's threads (see `crate::cpu`).
    pub cpu: CpuMeter,
    /// How round 0's pages meet fresh memory (see `prefault::plan`).
    pub fault_in: FaultIn,
    /// Where a stop request meets the VM's start.
    pub handover: &'a Handover,
    /// Whether a stop signal came (a signal handler cannot take the handover's lock).
    pub stop: &'a dyn Fn() -> bool,
}

impl Receiver<'_> {
    fn publish(&self) {
        self.board.publish(&self.status);
    }

    /// Ends the arrival if someone asked this host to stop.
    pub(super) fn check_stop(&self) -> Result<()> {
        if (self.stop)() {
            let _ = self.handover.stop(STOP_SIGNAL);
        }
        self.handover.check()
    }

    pub fn receive<V: Migratable + 'static>(
        &mut self,
        mut stream: Stream,
        hello: Result<Opening>,
        build: impl FnOnce(&VmDescriptor, Option<HandedFiles>) -> Result<Arc<V>>,
        on_resumed: impl FnOnce(&Arc<V>),
    ) -> Result<Arrived<V>> {
        let started = Instant::now();
        let tracked = self.cpu.track(Work::Receive, Worker::Lane(0));
        let result =
            hello.and_then(|h| self.conversation(&mut stream, h, build, on_resumed, started));
        drop(tracked);
        if let Err(e) = &result {
            // An `Abort` tells the source the VM never ran here, and it runs it on: never
            // once the VM was handed over (the source then waits for an operator instead).
            if stream.has_peer() && !matches!(e, Error::Peer(_)) && !self.handover.committed() {
                let _ = stream.set_timeouts(Some(Duration::from_millis(200)));
                let _ = wire::write_message(
                    &mut stream,
                    &Message::Abort {
                        reason: format!("destination: {}", e.report()),
                    },
                );
            }
            stream.close_after_last_word(LAST_WORD_WAIT);
            self.status.report.cpu = self.cpu.uses();
            self.status.phase = Phase::Failed;
            self.status.error = Some(e.report());
            self.publish();
        }
        result
    }

    fn conversation<V: Migratable + 'static>(
        &mut self,
        stream: &mut Stream,
        first: Opening,
        build: impl FnOnce(&VmDescriptor, Option<HandedFiles>) -> Result<Arc<V>>,
        on_resumed: impl FnOnce(&Arc<V>),
        started: Instant,
    ) -> Result<Arrived<V>> {
        // The stream header and the first message were read by whoever accepted the stream.
        let mut laps = Laps::starting(started);
        stream.set_timeouts(Some(crate::io::transport::IO_TIMEOUT))?;
        let mut hello = Hello::parse(first, self.expect)?;
        let (vm, disks) = self.build(stream, &mut hello, build, started)?;
        if hello.live() {
            wire::write_message(
                stream,
                &Message::Ready {
                    postcopy: postcopy::supported(),
                    host: hello.reads_host().then(crate::host::this_host).flatten(),
                },
            )?;
        }
        laps.lap("build", &mut self.status.report);
        let mut filling = Filling::open(
            &hello,
            vm.ram(),
            stream,
            self.listener.as_ref(),
            self.fault_in,
            self.cpu.clone(),
        )?;
        if let Some(disks) = disks {
            filling.fill_disks(disks);
        }
        if hello.connections > 1 {
            laps.lap("extra connections", &mut self.status.report);
        }
        let (filled, source_checksum) = self.fill(filling, stream, &hello, &mut laps)?;
        // Nothing more joins or carries on from here: the listener closes.
        self.listener = None;
        let state_received = Instant::now();
        let loaded = self.load(&vm, filled, source_checksum, &mut laps)?;
        let handed = self.hand_over(stream, &vm, &hello, loaded, &mut laps)?;
        let state_to_resume = state_received.elapsed();
        self.status.report.destination_downtime = Some(state_to_resume);
        let resumed_at_ns = now_ns();
        self.status.report.resumed_at_unix_ns = Some(resumed_at_ns);
        if hello.live() {
            // The VM is here now; a failure to tell the source changes nothing for it.
            let _ = wire::write_message(
                stream,
                &Message::Resumed {
                    state_to_resume_ns: state_to_resume.as_nanos() as u64,
                },
            );
        }
        on_resumed(&vm);
        let Handed { postcopy, reply } = handed;
        if let Some(run) = postcopy {
            return Ok(self.serve_postcopy(stream, vm, run, reply, resumed_at_ns, started));
        }
        if let Some(reply) = reply {
            self.board.guest_after(GuestAfter::Pending);
            spawn_guest_report(vm.clone(), resumed_at_ns, Reply::Stream(reply), self.board);
        }
        vm.ram().allow_huge_pages();
        self.complete(started);
        Ok(Arrived::Complete(vm))
    }

    /// Builds the VM `hello` describes and checks it is the one described; takes this host's
    /// disks that the stream fills.
    fn build<V: Migratable>(
        &mut self,
        stream: &mut Stream,
        hello: &mut Hello,
        build: impl FnOnce(&VmDescriptor, Option<HandedFiles>) -> Result<Arc<V>>,
        started: Instant,
    ) -> Result<(Arc<V>, Option<DiskTargets>)> {
        tracing::info!(
            "incoming {:?} migration from {}: {:?}",
            hello.mode,
            hello.source,
            hello.descriptor
        );
        let files = match hello.mode {
            StreamMode::Local => Some(self.take_files(stream, hello)?),
            _ => None,
        };
        if hello.config_follows() {
            hello.descriptor.config = take_config(stream)?;
        }
        if hello.storage_follows() {
            hello.storage = take_storage(stream, hello.live())?;
        }
        let vm = build(&hello.descriptor, files)?;
        let ram = vm.ram();
        ram.forbid_huge_pages();
        hello.check_built(&ram, &vm.descriptor())?;
        let disks = match hello.storage.as_slice() {
            [] => None,
            slots => Some(DiskTargets::open(vm.as_ref(), slots, &hello.descriptor)?),
        };
        self.status.mode = Some(hello.mode.into());
        self.status.memory_pages = ram.pages();
        self.status.connections = hello.connections;
        self.status.phase = Phase::Active;
        self.status.report.setup = started.elapsed();
        self.publish();
        Ok((vm, disks))
    }

    /// A live update's files, which come right after `Hello`: what `Files` announces, then
    /// the files themselves, one for each RAM range and one for each device marked.
    fn take_files(&self, stream: &Stream, hello: &Hello) -> Result<HandedFiles> {
        let mut reader = stream.try_clone()?;
        let (memory, devices) = match wire::read_message(&mut reader)? {
            Message::Files { memory, devices } => (memory as usize, devices),
            Message::Abort { reason } => return Err(Error::Peer(reason)),
            other => {
                return Err(Error::out_of_turn(
                    "destination",
                    other.name(),
                    "AwaitFiles",
                ));
            }
        };
        let d = &hello.descriptor;
        if memory != d.ranges.len() || devices.len() != d.devices.len() {
            return Err(Error::Protocol(format!(
                "the source announces {memory} memory files and {} devices for a VM of {} RAM \
                 ranges and {} devices",
                devices.len(),
                d.ranges.len(),
                d.devices.len()
            )));
        }
        let count = memory + devices.iter().filter(|&&d| d).count();
        let mut fds = stream.receive_files(count)?.into_iter();
        let memory = fds.by_ref().take(memory).collect();
        let devices = devices
            .iter()
            .map(|&passed| if passed { fds.next() } else { None })
            .collect();
        Ok(HandedFiles { memory, devices })
    }

    /// Reads frames until the state is complete, reporting rounds as they end.
    fn fill(
        &mut self,
        mut filling: Filling,
        stream: &mut Stream,
        hello: &Hello,
        laps: &mut Laps,
    ) -> Result<(Filled, Option<u64>)> {
        self.board.forget_side();
        loop {
            self.check_stop()?;
            let event = filling
                .read_frame(stream)
                .and_then(|frame| filling.on_frame(frame, stream));
            let event = match event {
                Err(e) if e.is_break() && filling.may_resume() => {
                    self.await_resume(&filling, stream, hello, e)?;
                    laps.lap("resume", &mut self.status.report);
                    continue;
                }
                other => other?,
            };
            match event {
                Event::Nothing => {}
                Event::Populated => {
                    laps.lap("populated map", &mut self.status.report);
                }
                Event::RoundEnd { round, pages, took } => {
                    laps.lap(format!("round {round}"), &mut self.status.report);
                    let p = &mut self.status.progress;
                    p.round = round;
                    p.pages.full = filling.pages_received();
                    p.rounds.push(RoundStats {
                        round,
                        pages,
                        duration: took,
                        ..Default::default()
                    });
                    self.publish();
                }
                Event::StateEnd { source_checksum } => {
                    laps.lap("last pages, state", &mut self.status.report);
                    return Ok((filling.finish()?, source_checksum));
                }
            }
        }
    }

    /// Loads the state into the VM and checks its memory: everything that can fail is done
    /// here, before `Go` can come. Post-copy's fault handler is armed and running.
    fn load<V: Migratable + 'static>(
        &mut self,
        vm: &Arc<V>,
        filled: Filled,
        source_checksum: Option<u64>,
        laps: &mut Laps,
    ) -> Result<Loaded> {
        let ram = vm.ram();
        vm.load_state(&filled.vcpus, &filled.devices)?;
        laps.lap("load state", &mut self.status.report);
        let present = filled.pages.present();
        let lanes = filled.push_lanes;
        let postcopy = match filled.pending {
            Some(p) => Some(Postcopy::arm(
                vm.clone(),
                p,
                &present,
                source_checksum.is_some(),
            )?),
            None => None,
        };
        // In post-copy the pages are not all here yet: the checksum is taken as they arrive.
        let checksum = match (source_checksum, &postcopy) {
            (Some(_), None) => Some(memory_checksum(&ram)?),
            _ => None,
        };
        self.status.progress.pages.full = filled.pages.pages;
        self.status.report.memory_checksum_source = source_checksum;
        self.status.report.memory_checksum_destination = checksum;
        self.status.phase = Phase::Switchover;
        self.publish();
        if postcopy.is_none() && source_checksum.is_some() && checksum != source_checksum {
            return Err(Error::Protocol(format!(
                "guest memory differs from the source's (checksum {checksum:#x?} here, \
                 {source_checksum:#x?} there)"
            )));
        }
        // Its requests wait until `Resumed` has gone (`attach` in `serve_postcopy`): the
        // source hears none before it.
        let postcopy = match postcopy {
            Some(p) => {
                let dest = Arc::new(p);
                dest.spawn_fault_handler()?;
                Some(PostcopyRun {
                    dest,
                    checkpoint_every: filled.checkpoint_every,
                    lanes,
                })
            }
            None => None,
        };
        Ok(Loaded { postcopy, checksum })
    }

    /// Says `Loaded`, waits for `Go` and runs the VM: from `Go` on it is this host's, and a
    /// stop request that comes later is refused.
    fn hand_over<V: Migratable>(
        &mut self,
        stream: &mut Stream,
        vm: &Arc<V>,
        hello: &Hello,
        mut loaded: Loaded,
        laps: &mut Laps,
    ) -> Result<Handed> {
        // Whatever can fail is done before `Go` can come: once the VM runs here, no error may
        // make this host give it up (the source no longer runs it either).
        let reply = if hello.live() {
            Some(stream.try_clone()?)
        } else {
            None
        };
        if hello.live() {
            self.check_stop()?;
            wire::write_message(
                stream,
                &Message::Loaded {
                    memory_checksum: loaded.checksum,
                },
            )?;
            laps.lap("checks", &mut self.status.report);
            match wire::read_message(stream)? {
                Message::Go => {}
                Message::Abort { reason } => return Err(Error::Peer(reason)),
                m => {
                    return Err(Error::out_of_turn("destination", m.name(), "AwaitGo"));
                }
            }
            laps.lap("loaded, go", &mut self.status.report);
        }
        self.handover.commit((self.stop)().then_some(STOP_SIGNAL))?;
        // Checkpoints hold every page written here from the switch on; without dirty logging
        // the VM runs on without them.
        if let Some(run) = &mut loaded.postcopy
            && run.checkpoint_every.is_some()
            && let Err(e) = vm.start_dirty_log()
        {
            tracing::warn!(
                "post-copy goes on without checkpoints: {}",
                crate::error::chain(&e)
            );
            run.checkpoint_every = None;
        }
        // A VM its user had paused on the source arrives paused.
        if hello.descriptor.running {
            vm.resume()?;
        }
        laps.lap("resume", &mut self.status.report);
        Ok(Handed {
            postcopy: loaded.postcopy,
            reply,
        })
    }

    /// The VM runs here on the pages it has; post-copy brings the rest.
    fn serve_postcopy<V: Migratable + 'static>(
        &mut self,
        stream: &mut Stream,
        vm: Arc<V>,
        run: PostcopyRun,
        reply: Option<Stream>,
        resumed_at_ns: u64,
        started: Instant,
    ) -> Arrived<V> {
        let PostcopyRun {
            dest,
            checkpoint_every,
            lanes,
        } = run;
        if let Some(r) = reply {
            dest.attach(r);
        }
        self.status.postcopy = true;
        self.status.phase = Phase::Postcopy;
        self.publish();
        if let Some(every_ms) = checkpoint_every {
            self.start_checkpoints(&vm, &dest, every_ms);
        }
        self.board.guest_after(GuestAfter::Pending);
        spawn_guest_report(
            vm.clone(),
            resumed_at_ns,
            Reply::Postcopy(dest.clone()),
            self.board,
        );
        let received = dest.receive_pages(stream, lanes, &self.cpu);
        self.status.fault_latency = dest.fault_latency();
        match received {
            Ok(report) => {
                self.status.report.memory_checksum_destination = report.memory_checksum;
                self.status.report.postcopy_report = Some(report);
                vm.ram().allow_huge_pages();
                self.complete(started);
                Arrived::Complete(vm)
            }
            // The VM lives here now, with part of its memory still on the source. It runs
            // on; the fault handler stays armed, so a vCPU that touches a missing page waits
            // for it instead of seeing zeros. Never exit: this is the newest state.
            Err(e) => {
                dest.detach();
                Arrived::Interrupted(vm, dest, e)
            }
        }
    }

    /// The VM runs here already: without checkpoints it runs on, as without them.
    fn start_checkpoints<V: Migratable + 'static>(
        &self,
        vm: &Arc<V>,
        dest: &Postcopy,
        every_ms: u32,
    ) {
        self.board.checkpoints(|c| {
            *c = Some(CheckpointStats {
                every_ms,
                ..Default::default()
            })
        });
        let any: Arc<dyn Migratable> = vm.clone();
        let every = Duration::from_millis(u64::from(every_ms));
        if let Err(e) = dest.start_checkpoints(any, every, self.board.clone()) {
            tracing::warn!(
                "post-copy goes on without checkpoints: {}",
                crate::error::chain(&e)
            );
            self.board.checkpoints(|c| *c = None);
        }
    }

    fn complete(&mut self, started: Instant) {
        self.status.report.completed_at_unix_ns = Some(now_ns());
        self.status.phase = Phase::Completed;
        self.status.report.total = started.elapsed();
        self.status.report.cpu = self.cpu.uses();
        self.publish();
    }
}

/// What `load` leaves for the switch.
struct Loaded {
    postcopy: Option<PostcopyRun>,
    /// This side's checksum of memory, when the source asked for one (pre-copy only).
    checksum: Option<u64>,
}

/// A post-copy switch: its armed fault handler, and whether it keeps checkpoints.
struct PostcopyRun {
    dest: Arc<Postcopy>,
    checkpoint_every: Option<u32>,
    /// The extra connections the source pushes on (none: it pushes on the main one).
    lanes: Vec<Stream>,
}

/// What `hand_over` leaves once the VM runs here.
struct Handed {
    postcopy: Option<PostcopyRun>,
    /// The source's connection, for the last words (live migrations only).
    reply: Option<Stream>,
}

/// Where the destination's last word to the source goes.
enum Reply {
    Stream(Stream),
    /// Post-copy's shared writer, so the report never interleaves with a page request.
    Postcopy(Arc<Postcopy>),
}

/// Lets the guest run a moment, then tells the source (and this side's readers) what it
/// lived through.
fn spawn_guest_report<V: Migratable + 'static>(
    vm: Arc<V>,
    resumed_at_ns: u64,
    reply: Reply,
    board: &StatusBoard,
) {
    let shared = board.clone();
    let spawned = std::thread::Builder::new()
        .name("guest-report".into())
        .spawn(move || {
            std::thread::sleep(AFTER_WINDOW);
            let r = vm.guest_report(resumed_at_ns, AFTER_WINDOW.as_nanos() as u64);
            shared.guest_after(GuestAfter::Seen {
                observed_downtime: r.observed_downtime_ns.map(Duration::from_nanos),
                pages_per_s_after: r.pages_per_s_after,
            });
            let msg = Message::GuestReport {
                observed_downtime_ns: r.observed_downtime_ns,
                pages_per_s_after: r.pages_per_s_after,
            };
            match reply {
                Reply::Stream(mut s) => {
                    let _ = wire::write_message(&mut s, &msg);
                    s.shutdown();
                }
                Reply::Postcopy(dest) => {
                    let _ = dest.reply(&msg);
                }
            }
        });
    if let Err(e) = spawned {
        board.guest_after(GuestAfter::Unknown);
        tracing::warn!(
            "no guest report for the source: {}",
            crate::error::chain(&e)
        );
    }
}

/// The VM's config, which follows `Hello` (and `Files`) from `CONFIG_SINCE` on.
/// The disks whose blocks the stream carries; a snapshot carries none.
fn take_storage(stream: &mut Stream, live: bool) -> Result<Vec<u32>> {
    match wire::read_message(stream)? {
        Message::Storage { disks } if disks.is_empty() || live => Ok(disks),
        Message::Storage { .. } => Err(Error::Protocol(
            "a snapshot stream names disks whose blocks it carries, which only a live \
             migration may"
                .into(),
        )),
        Message::Abort { reason } => Err(Error::Peer(reason)),
        other => Err(Error::out_of_turn(
            "destination",
            other.name(),
            "AwaitStorage",
        )),
    }
}

fn take_config(stream: &mut Stream) -> Result<Option<String>> {
    match wire::read_message(stream)? {
        Message::Config { config } => Ok(config),
        Message::Abort { reason } => Err(Error::Peer(reason)),
        other => Err(Error::out_of_turn(
            "destination",
            other.name(),
            "AwaitConfig",
        )),
    }
}
