//! Receiving one VM: build what the stream describes, fill its memory, load its state, and
//! resume it only when everything arrived intact and the source said `Go`. On any failure
//! the VM is never resumed and the source is told why.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::handover::Handover;
use super::install::{Installer, Installing};
use super::lanes;
use super::machine::{DestinationState, Incoming};
use super::postcopy::{self, Postcopy};
use super::prefault::{self, FaultIn, Plan, Prefaulter};
use crate::cpu::{CpuMeter, Work, Worker};
use crate::error::{Error, Result};
use crate::scan::memory_checksum;
use crate::status::{CheckpointStats, Laps, Phase, RoundStats, Status, StatusBoard, ms, now_ns};
use crate::vm::{Migratable, VmDescriptor};
use crate::wire::bitmap::Bitmap;
use crate::wire::pages::PageReceiver;
use crate::wire::transport::{Listener, Stream};
use crate::wire::{self, Frame, Message, StreamMode};

/// The destination measures the guest's work rate over this window after resuming, then
/// reports what the guest saw to the source.
const AFTER_WINDOW: Duration = Duration::from_secs(1);

/// How long a failing destination keeps reading so that its `Abort` reaches the source.
const LAST_WORD_WAIT: Duration = Duration::from_secs(1);

/// Who asked to stop when a signal did.
const STOP_SIGNAL: &str = "a stop signal (SIGTERM or SIGINT)";

/// What kind of stream the caller is prepared to take.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Expect {
    /// A live migration from a source that answers (pre-copy, warm, post-copy, hybrid).
    Live,
    /// A snapshot file.
    Snapshot,
}

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
    fn check_stop(&self) -> Result<()> {
        if (self.stop)() {
            let _ = self.handover.stop(STOP_SIGNAL);
        }
        self.handover.check()
    }

    pub fn receive<V: Migratable + 'static>(
        &mut self,
        mut stream: Stream,
        hello: Result<Message>,
        build: impl FnOnce(&VmDescriptor) -> Result<Arc<V>>,
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
                        reason: format!("destination: {e}"),
                    },
                );
            }
            stream.close_after_last_word(LAST_WORD_WAIT);
            self.status.report.cpu = self.cpu.uses();
            self.status.phase = Phase::Failed;
            self.status.error = Some(e.to_string());
            self.publish();
        }
        result
    }

    fn conversation<V: Migratable + 'static>(
        &mut self,
        stream: &mut Stream,
        hello: Message,
        build: impl FnOnce(&VmDescriptor) -> Result<Arc<V>>,
        on_resumed: impl FnOnce(&Arc<V>),
        started: Instant,
    ) -> Result<Arrived<V>> {
        // The stream header and the first message were read by whoever accepted the stream.
        let mut laps = Laps::starting(started);
        let mut state = DestinationState::AwaitHello;
        stream.set_timeouts(Some(crate::wire::transport::IO_TIMEOUT))?;
        state = state.next(Incoming::Message(&hello), false)?;
        let Message::Hello {
            vm: descriptor,
            mode,
            source,
            connections,
            session,
        } = hello
        else {
            return Err(Error::Protocol(format!(
                "stream starts with {} instead of Hello",
                hello.name()
            )));
        };
        let live = mode != StreamMode::Snapshot;
        match (self.expect, live) {
            (Expect::Live, false) => {
                return Err(Error::Protocol(
                    "a snapshot stream on a migration listener (use ferry run --restore)".into(),
                ));
            }
            (Expect::Snapshot, true) => {
                return Err(Error::Protocol("this file is not a ferry snapshot".into()));
            }
            _ => {}
        }
        tracing::info!("incoming {mode:?} migration from {source}: {descriptor:?}");
        let vm = build(&descriptor)?;
        let ram = vm.ram();
        ram.forbid_huge_pages();
        if ram.ranges() != descriptor.ranges {
            return Err(Error::vm(format!(
                "built RAM at {:x?} for a VM whose RAM lies at {:x?}",
                ram.ranges(),
                descriptor.ranges
            )));
        }
        // The stream's vCPU count sizes what is kept for their state: only a count the VMM
        // could build is trusted.
        if vm.descriptor().vcpus != descriptor.vcpus {
            return Err(Error::vm(format!(
                "built {} vCPUs for a VM of {}",
                vm.descriptor().vcpus,
                descriptor.vcpus
            )));
        }
        self.status.mode = format!("{mode:?}").to_lowercase();
        self.status.memory_pages = ram.pages();
        self.status.connections = connections.max(1);
        self.status.phase = Phase::Active;
        self.status.report.setup_ms = ms(started.elapsed());
        self.publish();
        if live {
            wire::write_message(
                stream,
                &Message::Ready {
                    postcopy: postcopy::supported(),
                },
            )?;
        }
        laps.lap("build", &mut self.status.report);

        let mut pages = PageReceiver::new(&ram).for_lane(0, connections.max(1));
        let listener = self.listener.take();
        // Declared before the lanes: dropped after them, so that its zero filler outlives
        // every receiver that might still fault.
        let mut installing: Option<Installing> = None;
        let mut lanes = match (connections, &listener) {
            // A snapshot's lanes are in its file, as many as its stream names.
            (n, _) if !live => {
                lanes::open_in_file(stream, session, n.max(1), &ram, &pages, &self.cpu)?
            }
            (0 | 1, _) => None,
            (n, Some(l)) => Some(lanes::accept(
                l, session, n, &ram, &pages, stream, &self.cpu,
            )?),
            (n, None) => {
                return Err(Error::Protocol(format!(
                    "a stream over {n} connections where only one can arrive"
                )));
            }
        };
        drop(listener); // one migration at a time: later connections are refused
        if connections > 1 {
            laps.lap("extra connections", &mut self.status.report);
        }
        let mut vcpus: Vec<Option<Vec<u8>>> = vec![None; descriptor.vcpus as usize];
        let mut devices = None;
        let mut pending: Option<Bitmap> = None;
        let mut checkpoint_every: Option<u32> = None;
        self.board.checkpoints(|c| *c = None);
        let mut round_started = Instant::now();
        let mut prefault: Option<Prefaulter> = None;
        let source_checksum = loop {
            self.check_stop()?;
            let frame = match wire::read_frame(stream) {
                Ok(f) => f,
                // A lane that failed closed this stream: its failure is the reason.
                Err(e) => return Err(lanes.as_ref().and_then(|l| l.failure()).unwrap_or(e)),
            };
            let msg = match frame {
                Frame::Pages { header, len } => {
                    state = state.next(Incoming::Pages, false)?;
                    pages.receive(stream, &ram, &header, len)?;
                    continue;
                }
                Frame::Message(m) => m,
            };
            state = state.next(Incoming::Message(&msg), pending.is_some())?;
            // Round 0 is over (or the switch came): nothing may be faulted in or installed
            // once pages can be dropped or handed to post-copy's userfaultfd.
            if !matches!(msg, Message::Populated { .. } | Message::Sync { .. }) {
                if let Some(mut p) = prefault.take() {
                    tracing::debug!("faulted in {} pages ahead of their data", p.finish());
                }
                if let Some((installed, touched)) = installing.as_ref().and_then(Installing::finish)
                {
                    tracing::debug!("installed {installed} pages; {touched} touched first");
                }
            }
            match msg {
                Message::Populated { pages: n, words } => {
                    let map = page_map(&ram, n, words)?;
                    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
                    let plan = prefault::plan(self.fault_in, connections, cores);
                    installing = (plan == Plan::Install)
                        .then(|| {
                            Installer::start(ram.clone())
                                .inspect_err(|e| tracing::warn!("{e}: faulting in ahead instead"))
                                .ok()
                        })
                        .flatten();
                    match &installing {
                        Some(i) => pages.install_with(i.placer())?,
                        None => {
                            pages.present_ahead(map.clone())?;
                            let threads = prefault::threads_for(connections, cores);
                            prefault = Prefaulter::start(ram.clone(), map, threads, &self.cpu)
                                .inspect_err(|e| tracing::warn!("no prefault threads: {e}"))
                                .ok();
                        }
                    }
                    laps.lap("populated map", &mut self.status.report);
                }
                Message::RoundEnd { round, pages: n } => {
                    laps.lap(format!("round {round}"), &mut self.status.report);
                    let p = &mut self.status.progress;
                    p.round = round;
                    p.pages.full = pages.pages;
                    p.rounds.push(RoundStats {
                        round,
                        pages: n,
                        duration_ms: ms(round_started.elapsed()),
                        ..Default::default()
                    });
                    self.publish();
                    round_started = Instant::now();
                }
                Message::VcpuState { index, state } => {
                    let slot = vcpus.get_mut(index as usize).ok_or_else(|| {
                        Error::Protocol(format!(
                            "state for vCPU {index} of a {}-vCPU VM",
                            descriptor.vcpus
                        ))
                    })?;
                    if slot.replace(state).is_some() {
                        return Err(Error::Protocol(format!("vCPU {index}'s state came twice")));
                    }
                }
                Message::DeviceState { state } => {
                    if devices.replace(state).is_some() {
                        return Err(Error::Protocol("the device state came twice".into()));
                    }
                }
                Message::Sync { lane_pages } => {
                    // This connection's pages are in place (read in order); the lanes' too,
                    // once their counts reach what the source sent.
                    match &lanes {
                        Some(l) => l.wait_for(&lane_pages)?,
                        None if lane_pages.is_empty() => {}
                        None => {
                            return Err(Error::Protocol(
                                "Sync names extra connections this migration does not have".into(),
                            ));
                        }
                    }
                    wire::write_message(stream, &Message::Synced)?;
                }
                // A file cannot serve pages on demand: a snapshot that asks for it is refused.
                Message::PostcopyPending { .. }
                | Message::Stale { .. }
                | Message::Checkpoints { .. }
                    if !live =>
                {
                    return Err(Error::Protocol(format!(
                        "a snapshot stream carries {}, which only a live migration may",
                        msg.name()
                    )));
                }
                Message::Stale { pages: n, words } => {
                    // Every copy must have landed before it is dropped.
                    if let Some(lanes) = lanes.take() {
                        lanes.finish(&mut pages)?;
                    }
                    let stale = page_map(&ram, n, words)?;
                    postcopy::drop_stale_copies(&ram, &stale, &pages.present())?;
                    pages.forget(&stale);
                    wire::write_message(stream, &Message::StaleDropped)?;
                }
                Message::PostcopyPending { pages: n, words } => {
                    pending = Some(page_map(&ram, n, words)?);
                }
                Message::Checkpoints { every_ms } => {
                    if !crate::params::CHECKPOINT_MS.contains(&every_ms) {
                        return Err(Error::Protocol(format!(
                            "checkpoints every {every_ms} ms asked for (this ferry takes {:?})",
                            crate::params::CHECKPOINT_MS
                        )));
                    }
                    checkpoint_every = Some(every_ms);
                }
                Message::StateEnd {
                    pages_sent,
                    memory_checksum,
                } => {
                    if let Some(lanes) = lanes.take() {
                        lanes.finish(&mut pages)?;
                    }
                    if pages_sent != pages.pages {
                        return Err(Error::Protocol(format!(
                            "the source sent {pages_sent} pages but {} arrived",
                            pages.pages
                        )));
                    }
                    // A page read while the guest ran that did not match its CRC, and that no
                    // later copy replaced, was corrupted on the way (post-copy fetches the
                    // pending ones anew).
                    let mut corrupt = pages.suspect().clone();
                    if let Some(p) = &pending {
                        corrupt.subtract(p);
                    }
                    if let Some(first) = corrupt.iter().next() {
                        return Err(Error::Protocol(format!(
                            "{} pages arrived corrupt (the first: {first:#x}): their data does \
                             not match the CRC they were sent with",
                            corrupt.count()
                        )));
                    }
                    laps.lap("last pages, state", &mut self.status.report);
                    break memory_checksum;
                }
                _ => unreachable!("the state machine admits no other message here"),
            }
        };
        let state_received = Instant::now();
        let vcpus: Vec<Vec<u8>> = vcpus
            .into_iter()
            .enumerate()
            .map(|(i, s)| s.ok_or_else(|| Error::Protocol(format!("no state for vCPU {i}"))))
            .collect::<Result<_>>()?;
        let devices = devices.ok_or_else(|| Error::Protocol("no device state".into()))?;
        vm.load_state(&vcpus, &devices)?;
        laps.lap("load state", &mut self.status.report);
        let postcopy = match pending {
            Some(p) => Some(Postcopy::arm(
                ram.clone(),
                p,
                &pages.present(),
                source_checksum.is_some(),
            )?),
            None => None,
        };
        // In post-copy the pages are not all here yet: the checksum is taken as they arrive.
        let checksum = match (source_checksum, &postcopy) {
            (Some(_), None) => Some(memory_checksum(&ram)?),
            _ => None,
        };
        self.status.progress.pages.full = pages.pages;
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
        // Whatever can fail is done before `Go` can come: once the VM runs here, no error may
        // make this host give it up (the source no longer runs it either).
        let reply = if live {
            Some(stream.try_clone()?)
        } else {
            None
        };
        // Its requests wait until `Resumed` has gone (`attach` below): the source hears none
        // before it.
        let postcopy = match postcopy {
            Some(p) => {
                let p = Arc::new(p);
                p.spawn_fault_handler()?;
                Some(p)
            }
            None => None,
        };
        if live {
            self.check_stop()?;
            wire::write_message(
                stream,
                &Message::Loaded {
                    memory_checksum: checksum,
                },
            )?;
            laps.lap("checks", &mut self.status.report);
            let go = wire::read_message(stream)?;
            state = state.next(Incoming::Message(&go), postcopy.is_some())?;
            laps.lap("loaded, go", &mut self.status.report);
        }
        // From here the VM is this host's: a stop request that comes later is refused.
        self.handover.commit((self.stop)().then_some(STOP_SIGNAL))?;
        // Checkpoints hold every page written here from the switch on; without dirty logging
        // the VM runs on without them.
        if postcopy.is_some()
            && checkpoint_every.is_some()
            && let Err(e) = vm.start_dirty_log()
        {
            tracing::warn!("post-copy goes on without checkpoints: {e}");
            checkpoint_every = None;
        }
        // A VM its user had paused on the source arrives paused.
        if descriptor.running {
            vm.resume()?;
        }
        let resumed_at_ns = now_ns();
        self.status.report.resumed_at_unix_ns = Some(resumed_at_ns);
        laps.lap("resume", &mut self.status.report);
        let state_to_resume = state_received.elapsed();
        self.status.report.destination_downtime_ms = Some(ms(state_to_resume));
        if live {
            // The VM is here now; a failure to tell the source changes nothing for it.
            let _ = wire::write_message(
                stream,
                &Message::Resumed {
                    state_to_resume_ns: state_to_resume.as_nanos() as u64,
                },
            );
        }
        on_resumed(&vm);
        let Some(dest) = postcopy else {
            self.complete(started);
            if let Some(r) = reply {
                spawn_guest_report(vm.clone(), resumed_at_ns, Reply::Stream(r));
            }
            return Ok(Arrived::Complete(vm));
        };
        debug_assert_eq!(state, DestinationState::Postcopy);
        if let Some(r) = reply {
            dest.attach(r);
        }
        self.status.postcopy = true;
        self.status.phase = Phase::Postcopy;
        self.publish();
        if let Some(every_ms) = checkpoint_every {
            self.board.checkpoints(|c| {
                *c = Some(CheckpointStats {
                    every_ms,
                    ..Default::default()
                })
            });
            let any: Arc<dyn Migratable> = vm.clone();
            // The VM runs here already: without checkpoints it runs on, as without them.
            if let Err(e) = dest.start_checkpoints(
                any,
                Duration::from_millis(u64::from(every_ms)),
                self.board.clone(),
            ) {
                tracing::warn!("post-copy goes on without checkpoints: {e}");
                self.board.checkpoints(|c| *c = None);
            }
        }
        spawn_guest_report(vm.clone(), resumed_at_ns, Reply::Postcopy(dest.clone()));
        match dest.receive_pages(stream) {
            Ok(report) => {
                self.status.report.memory_checksum_destination = report.memory_checksum;
                self.status.report.postcopy_report = Some(report);
                self.complete(started);
                Ok(Arrived::Complete(vm))
            }
            // The VM lives here now, with part of its memory still on the source. It runs
            // on; the fault handler stays armed, so a vCPU that touches a missing page waits
            // for it instead of seeing zeros. Never exit: this is the newest state.
            Err(e) => {
                dest.detach();
                Ok(Arrived::Interrupted(vm, dest, e))
            }
        }
    }

    fn complete(&mut self, started: Instant) {
        self.status.report.completed_at_unix_ns = Some(now_ns());
        self.status.phase = Phase::Completed;
        self.status.report.total_ms = ms(started.elapsed());
        self.status.report.cpu = self.cpu.uses();
        self.publish();
    }
}

/// Checks a page map (post-copy's pending pages, stale ones, round 0's) against this VM's
/// RAM: the right length, and no page outside RAM (post-copy could never complete).
fn page_map(ram: &crate::memory::GuestRam, n: u64, words: Vec<u64>) -> Result<Bitmap> {
    if n != ram.gfn_end() || words.len() as u64 != n.div_ceil(64) {
        return Err(Error::Protocol(format!(
            "a page map of {n} pages for a guest whose pages end at {}",
            ram.gfn_end()
        )));
    }
    let map = Bitmap::from_words(words, n);
    if let Some(bad) = map.iter().find(|&gfn| !ram.contains(gfn)) {
        return Err(Error::Protocol(format!(
            "a page map names page {bad:#x}, outside guest RAM"
        )));
    }
    Ok(map)
}

/// Where the destination's last word to the source goes.
enum Reply {
    Stream(Stream),
    /// Post-copy's shared writer, so the report never interleaves with a page request.
    Postcopy(Arc<Postcopy>),
}

/// Lets the guest run a moment, then tells the source what it lived through.
fn spawn_guest_report<V: Migratable + 'static>(vm: Arc<V>, resumed_at_ns: u64, reply: Reply) {
    let spawned = std::thread::Builder::new()
        .name("guest-report".into())
        .spawn(move || {
            std::thread::sleep(AFTER_WINDOW);
            let r = vm.guest_report(resumed_at_ns, AFTER_WINDOW.as_nanos() as u64);
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
        tracing::warn!("no guest report for the source: {e}");
    }
}
