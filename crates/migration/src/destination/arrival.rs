//! The destination's conversation from `Hello` to `StateEnd`: check what the stream says it
//! carries, fill the VM's memory and collect its state. `Filling::on_frame` is the dispatch:
//! each (stage, frame) pair the protocol allows has an arm; any other is refused with both
//! named, so a frame out of order, a duplicate or an `Abort` ends the arrival the same way in
//! every stage.

use std::time::{Duration, Instant};

use super::install::{Installer, Installing};
use super::lanes::{self, LaneReceivers};
use super::postcopy;
use super::prefault::{self, FaultIn, Plan, Prefaulter};
use super::storage::DiskTargets;
use crate::bitmap::Bitmap;
use crate::cpu::CpuMeter;
use crate::error::{Error, Result};
use crate::io::transport::{Listener, PeerIdentity, Stream};
use crate::memory::GuestRam;
use crate::pages::PageReceiver;
use crate::vm::VmDescriptor;
use crate::wire::{self, Frame, Message, StreamMode};

/// What kind of stream the caller is prepared to take.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Expect {
    /// A live migration from a source that answers (pre-copy, warm, post-copy, hybrid).
    Live,
    /// A snapshot file.
    Snapshot,
}

/// A stream's first words: its version (from its header) and its first message.
pub(super) struct Opening {
    pub version: u32,
    pub first: Message,
}

/// What a `Hello` promises, checked against what this destination was asked to take.
pub(super) struct Hello {
    /// The stream's version: what else it carries (`Config` from `CONFIG_SINCE`).
    pub version: u32,
    pub descriptor: VmDescriptor,
    pub mode: StreamMode,
    pub source: String,
    pub connections: u32,
    pub session: u64,
    /// The disks whose blocks the stream carries (`Storage`, read after `Config`).
    pub storage: Vec<u32>,
}

impl Hello {
    /// The stream's first message, which must be a `Hello` of the kind `expect` names.
    pub fn parse(opening: Opening, expect: Expect) -> Result<Self> {
        let Opening { version, first } = opening;
        let Message::Hello {
            vm: descriptor,
            mode,
            source,
            connections,
            session,
        } = first
        else {
            return Err(match first {
                Message::Abort { reason } => Error::Peer(reason),
                other => Error::out_of_turn("destination", other.name(), "AwaitHello"),
            });
        };
        let hello = Hello {
            version,
            descriptor,
            mode,
            source,
            connections: connections.max(1),
            session,
            storage: Vec::new(),
        };
        match (expect, hello.live()) {
            (Expect::Live, false) => Err(Error::Protocol(
                "a snapshot stream on a migration listener (use ferry run --restore)".into(),
            )),
            (Expect::Snapshot, true) => {
                Err(Error::Protocol("this file is not a ferry snapshot".into()))
            }
            _ => Ok(hello),
        }
    }

    /// A pre-copy over one connection, which the source may carry on over a new one should
    /// it break before the switch (`ResumePrecopy`).
    pub fn resumable(&self) -> bool {
        self.mode == StreamMode::Precopy && self.connections == 1 && self.session != 0
    }

    /// A live migration (a source that answers), not a snapshot file.
    pub fn live(&self) -> bool {
        self.mode != StreamMode::Snapshot
    }

    /// Whether the VM's `Config` follows (after `Files` on a live update).
    pub fn config_follows(&self) -> bool {
        self.version >= wire::frame::CONFIG_SINCE
    }

    /// Whether `Storage` follows `Config`.
    pub fn storage_follows(&self) -> bool {
        self.version >= wire::frame::STORAGE_SINCE
    }

    /// Whether the source reads which host this is in `Ready`.
    pub fn reads_host(&self) -> bool {
        self.version >= wire::frame::HOST_SINCE
    }

    /// Checks that the VM built for this stream (`built` describes it) has its RAM and vCPUs
    /// where the stream says, and devices that can take the place of the VM's: before `Ready`,
    /// so that a destination that cannot take the VM refuses it before any page crosses.
    pub fn check_built(&self, ram: &GuestRam, built: &VmDescriptor) -> Result<()> {
        let vcpus = built.vcpus;
        if ram.ranges() != self.descriptor.ranges {
            return Err(Error::vm(format!(
                "built RAM at {:x?} for a VM whose RAM lies at {:x?}",
                ram.ranges(),
                self.descriptor.ranges
            )));
        }
        // The stream's vCPU count sizes what is kept for their state: only a count the VMM
        // could build is trusted.
        if vcpus != self.descriptor.vcpus {
            return Err(Error::vm(format!(
                "built {vcpus} vCPUs for a VM of {}",
                self.descriptor.vcpus
            )));
        }
        crate::vm::check_devices(&self.descriptor.devices, &built.devices)
    }
}

/// Where the conversation stands while memory fills.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Stage {
    /// Pages, round ends and syncs; then the switch (`PostcopyPending` or the first state).
    Memory,
    /// The stale copies are dropped: no more pages before the switch to post-copy.
    StaleDropped,
    /// vCPU and device state (and, for post-copy, checkpoints), up to `StateEnd`.
    State,
}

/// What a frame meant to whoever reports the arrival's progress.
pub(super) enum Event {
    Nothing,
    /// Round 0's map of populated pages came: faulting in (or installing) began.
    Populated,
    /// A round ended after `took`.
    RoundEnd {
        round: u32,
        pages: u64,
        took: Duration,
    },
    /// The state is complete: the source's checksum of memory, if it took one.
    StateEnd {
        source_checksum: Option<u64>,
    },
}

/// Everything `Filling` collected for the switch.
pub(super) struct Filled {
    pub pages: PageReceiver,
    pub vcpus: Vec<Vec<u8>>,
    pub devices: Vec<u8>,
    /// The pages post-copy still has to bring (post-copy only).
    pub pending: Option<Bitmap>,
    pub checkpoint_every: Option<u32>,
    /// The extra connections post-copy's pushes come on (`PushOnLanes`; else none).
    pub push_lanes: Vec<Stream>,
}

/// The memory and state of one arriving VM, while they fill.
pub(super) struct Filling {
    stage: Stage,
    ram: GuestRam,
    live: bool,
    connections: u32,
    fault_in: FaultIn,
    cpu: CpuMeter,
    pages: PageReceiver,
    lanes: Option<LaneReceivers>,
    /// The extra connections once their rounds ended, open for post-copy's pushes.
    lanes_ended: Vec<Stream>,
    /// The source said post-copy pushes on them (`PushOnLanes`).
    push_on_lanes: bool,
    // After the lanes: dropped after them, so that its zero filler outlives every receiver
    // that might still fault.
    installing: Option<Installing>,
    prefault: Option<Prefaulter>,
    vcpus: Vec<Option<Vec<u8>>>,
    devices: Option<Vec<u8>>,
    pending: Option<Bitmap>,
    checkpoint_every: Option<u32>,
    round_started: Instant,
    /// How long the source tries to carry a broken connection on (it said: `ResumeWindow`,
    /// at most `MAX_RESUME_WINDOW`).
    resume_window: Option<Duration>,
    /// This host's disks that disk blocks fill (`copy_storage`).
    disks: Option<DiskTargets>,
    /// Who sent the VM: a connection that carries the migration on must come from it.
    peer: PeerIdentity,
}

/// The longest a destination keeps a broken pre-copy's VM waiting for its source, whatever
/// window the source asks for: a source that never comes must not hold the host's memory.
pub const MAX_RESUME_WINDOW: Duration = Duration::from_secs(600);

impl Filling {
    /// Starts filling `ram` for `hello`: the extra connections it names join through
    /// `listener` (or, for a snapshot, are found in its file).
    pub fn open(
        hello: &Hello,
        ram: GuestRam,
        stream: &mut Stream,
        listener: Option<&Listener>,
        fault_in: FaultIn,
        cpu: CpuMeter,
    ) -> Result<Self> {
        let n = hello.connections;
        let peer = stream.peer_identity()?;
        let mut pages = PageReceiver::new(&ram).for_lane(0, n);
        if hello.resumable() {
            pages = pages.counting_copies(ram.gfn_end());
        }
        let lanes = match listener {
            // A snapshot's lanes are in its file, as many as its stream names.
            _ if !hello.live() => {
                lanes::open_in_file(stream, hello.session, n, &ram, &pages, &cpu)?
            }
            _ if n == 1 => None,
            Some(l) => Some(lanes::accept(
                l,
                hello.session,
                n,
                &ram,
                &pages,
                stream,
                &cpu,
            )?),
            None => {
                return Err(Error::Protocol(format!(
                    "a stream over {n} connections where only one can arrive"
                )));
            }
        };
        Ok(Filling {
            stage: Stage::Memory,
            live: hello.live(),
            connections: n,
            fault_in,
            cpu,
            pages,
            lanes,
            lanes_ended: Vec::new(),
            push_on_lanes: false,
            installing: None,
            prefault: None,
            vcpus: vec![None; hello.descriptor.vcpus as usize],
            devices: None,
            pending: None,
            checkpoint_every: None,
            round_started: Instant::now(),
            resume_window: None,
            disks: None,
            peer,
            ram,
        })
    }

    /// This host's disks the stream fills (`copy_storage`).
    pub fn fill_disks(&mut self, targets: DiskTargets) {
        // Blocks are counted as pages are, for a resume.
        self.disks = Some(match self.pages.counts_copies() {
            true => targets.counting_copies(),
            false => targets,
        });
    }

    fn targets(&self) -> Result<&DiskTargets> {
        self.disks
            .as_ref()
            .ok_or_else(|| Error::Protocol("disk blocks in a stream that named no disk".into()))
    }

    /// Who sent the VM.
    pub fn peer(&self) -> &PeerIdentity {
        &self.peer
    }

    /// Pages landed so far.
    pub fn pages_received(&self) -> u64 {
        self.pages.pages
    }

    /// Whether the conversation is where a broken connection can be carried on (page frames
    /// and round ends, before anything of the switch) and the source said it would.
    pub fn may_resume(&self) -> bool {
        self.stage == Stage::Memory && self.resume_window.is_some()
    }

    /// How long to wait for the source to carry on (`None`: it will not).
    pub fn resume_window(&self) -> Option<Duration> {
        self.resume_window
    }

    /// What landed, for `CopiesHeld` (see `PageReceiver::copies_held`).
    pub fn copies_held(&self) -> Option<Message> {
        let (pages, runs) = self.pages.copies_held()?;
        Some(Message::CopiesHeld { pages, runs })
    }

    /// What landed of the disks, for `BlocksHeld` (`None`: no disk moves).
    pub fn blocks_held(&self) -> Option<Message> {
        let disks = self.disks.as_ref()?.blocks_held()?;
        Some(Message::BlocksHeld { disks })
    }

    /// The next frame on the main connection. When a lane failed it closed this stream: its
    /// failure is then the reason.
    pub fn read_frame(&self, stream: &mut Stream) -> Result<Frame> {
        wire::read_frame(stream)
            .map_err(|e| self.lanes.as_ref().and_then(|l| l.failure()).unwrap_or(e))
    }

    /// Acts on one frame, or refuses it: the conversation's dispatch up to `StateEnd`.
    pub fn on_frame(&mut self, frame: Frame, stream: &mut Stream) -> Result<Event> {
        use Stage::*;
        let msg = match frame {
            Frame::Pages { header, len } if self.stage == Memory => {
                self.pages.receive(stream, &self.ram, &header, len)?;
                return Ok(Event::Nothing);
            }
            Frame::Pages { .. } => {
                return Err(Error::out_of_turn(
                    "destination",
                    "page frame",
                    format!("{:?}", self.stage),
                ));
            }
            Frame::Message(m) => m,
        };
        if !matches!(msg, Message::Populated { .. } | Message::Sync { .. }) {
            self.end_round_0();
        }
        match (self.stage, msg) {
            (_, Message::Abort { reason }) => Err(Error::Peer(reason)),
            (Memory, Message::Populated { map }) => self.on_populated(map),
            (Memory, Message::RoundEnd { round, pages }) => Ok(self.on_round_end(round, pages)),
            (Memory, Message::ResumeWindow { seconds }) if self.pages.counts_copies() => {
                let asked = Duration::from_secs(u64::from(seconds));
                self.resume_window = Some(asked.min(MAX_RESUME_WINDOW));
                Ok(Event::Nothing)
            }
            (Memory, Message::Sync { lane_pages }) => self.on_sync(&lane_pages, stream),
            (Memory, Message::DiskData { disk, offset, data }) => {
                self.targets()?.write(disk, offset, &data)?;
                Ok(Event::Nothing)
            }
            (
                Memory,
                Message::DiskPacked {
                    disk,
                    offset,
                    codec,
                    len,
                    data,
                },
            ) => {
                self.targets()?
                    .write_packed((disk, offset), codec, len, &data)?;
                Ok(Event::Nothing)
            }
            (Memory, Message::DiskZero { disk, offset, len }) => {
                self.targets()?.zero(disk, offset, len)?;
                Ok(Event::Nothing)
            }
            (Memory, Message::Stale { map }) if self.live => self.on_stale(map, stream),
            (Memory | StaleDropped, Message::PostcopyPending { map }) if self.live => {
                self.pending = Some(page_map(&self.ram, map)?);
                self.stage = State;
                Ok(Event::Nothing)
            }
            (State, Message::Checkpoints { every_ms }) if self.pending.is_some() => {
                self.on_checkpoints(every_ms)
            }
            (State, Message::PushOnLanes) if self.pending.is_some() => self.on_push_on_lanes(),
            (Memory | State, Message::VcpuState { index, state }) => {
                self.on_vcpu_state(index, state)
            }
            (Memory | State, Message::DeviceState { state }) => self.on_device_state(state),
            (
                State,
                Message::StateEnd {
                    pages_sent,
                    memory_checksum,
                },
            ) => self.on_state_end(pages_sent, memory_checksum),
            // A file cannot serve pages on demand: a snapshot that asks for it is refused.
            (
                _,
                m @ (Message::PostcopyPending { .. }
                | Message::Stale { .. }
                | Message::Checkpoints { .. }
                | Message::PushOnLanes),
            ) if !self.live => Err(Error::Protocol(format!(
                "a snapshot stream carries {}, which only a live migration may",
                m.name()
            ))),
            (stage, m) => Err(Error::out_of_turn(
                "destination",
                m.name(),
                format!("{stage:?}"),
            )),
        }
    }

    /// Round 0 is over (or the switch came): nothing may be faulted in or installed once
    /// pages can be dropped or handed to post-copy's userfaultfd.
    fn end_round_0(&mut self) {
        if let Some(mut p) = self.prefault.take() {
            tracing::debug!("faulted in {} pages ahead of their data", p.finish());
        }
        if let Some((installed, touched)) = self.installing.as_ref().and_then(Installing::finish) {
            tracing::debug!("installed {installed} pages; {touched} touched first");
        }
    }

    /// Round 0's populated pages: install them as they come, or fault them in ahead.
    fn on_populated(&mut self, map: Bitmap) -> Result<Event> {
        let map = page_map(&self.ram, map)?;
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        if prefault::plan(self.fault_in, self.connections, cores) == Plan::Install {
            self.installing = Installer::start(self.ram.clone())
                .inspect_err(|e| {
                    tracing::warn!("{}: faulting in ahead instead", crate::error::chain(e))
                })
                .ok();
        }
        match &self.installing {
            Some(i) => self.pages.install_with(i.placer())?,
            None => {
                self.pages.present_ahead(map.clone())?;
                let threads = prefault::threads_for(self.connections, cores);
                self.prefault = Prefaulter::start(self.ram.clone(), map, threads, &self.cpu)
                    .inspect_err(|e| {
                        tracing::warn!("no prefault threads: {}", crate::error::chain(e))
                    })
                    .ok();
            }
        }
        Ok(Event::Populated)
    }

    /// The source catches up before it pauses: a break from here on ends the migration (the
    /// source runs the VM on), so there is nothing to wait for.
    fn switch_begins(&mut self) {
        self.resume_window = None;
    }

    fn on_round_end(&mut self, round: u32, pages: u64) -> Event {
        let took = self.round_started.elapsed();
        self.round_started = Instant::now();
        Event::RoundEnd { round, pages, took }
    }

    /// This connection's pages are in place (read in order); the lanes' too, once their
    /// counts reach what the source sent.
    fn on_sync(&mut self, lane_pages: &[u64], stream: &mut Stream) -> Result<Event> {
        self.switch_begins();
        match &self.lanes {
            Some(l) => l.wait_for(lane_pages)?,
            None if lane_pages.is_empty() => {}
            None => {
                return Err(Error::Protocol(
                    "Sync names extra connections this migration does not have".into(),
                ));
            }
        }
        // The disks' blocks so far made durable while the guest still runs at the source:
        // the flush at `StateEnd` then holds only the last ones, inside the pause.
        if let Some(disks) = &self.disks {
            disks.sync()?;
        }
        wire::write_message(stream, &Message::Synced)?;
        Ok(Event::Nothing)
    }

    /// Drops the copies the source will send again by post-copy. Every copy must have
    /// landed before it is dropped.
    fn on_stale(&mut self, stale: Bitmap, stream: &mut Stream) -> Result<Event> {
        self.switch_begins();
        self.finish_lanes()?;
        let stale = page_map(&self.ram, stale)?;
        postcopy::drop_stale_copies(&self.ram, &stale, &self.pages.present())?;
        self.pages.forget(&stale);
        wire::write_message(stream, &Message::StaleDropped)?;
        self.stage = Stage::StaleDropped;
        Ok(Event::Nothing)
    }

    fn on_checkpoints(&mut self, every_ms: u32) -> Result<Event> {
        if !crate::params::CHECKPOINT_MS.contains(&every_ms) {
            return Err(Error::Protocol(format!(
                "checkpoints every {every_ms} ms asked for (this ferry takes {:?})",
                crate::params::CHECKPOINT_MS
            )));
        }
        self.checkpoint_every = Some(every_ms);
        Ok(Event::Nothing)
    }

    fn on_push_on_lanes(&mut self) -> Result<Event> {
        if self.connections < 2 || self.push_on_lanes {
            return Err(Error::Protocol(format!(
                "PushOnLanes on a migration of {} connection(s){}",
                self.connections,
                if self.push_on_lanes { ", twice" } else { "" }
            )));
        }
        self.push_on_lanes = true;
        Ok(Event::Nothing)
    }

    fn on_vcpu_state(&mut self, index: u32, state: Vec<u8>) -> Result<Event> {
        let count = self.vcpus.len();
        let slot = self.vcpus.get_mut(index as usize).ok_or_else(|| {
            Error::Protocol(format!("state for vCPU {index} of a {count}-vCPU VM"))
        })?;
        if slot.replace(state).is_some() {
            return Err(Error::Protocol(format!("vCPU {index}'s state came twice")));
        }
        self.stage = Stage::State;
        Ok(Event::Nothing)
    }

    fn on_device_state(&mut self, state: Vec<u8>) -> Result<Event> {
        if self.devices.replace(state).is_some() {
            return Err(Error::Protocol("the device state came twice".into()));
        }
        self.stage = Stage::State;
        Ok(Event::Nothing)
    }

    /// Every page the source sent must have arrived, and intact.
    fn on_state_end(&mut self, pages_sent: u64, source_checksum: Option<u64>) -> Result<Event> {
        self.finish_lanes()?;
        if let Some(disks) = &self.disks {
            disks.sync()?;
        }
        if pages_sent != self.pages.pages {
            return Err(Error::Protocol(format!(
                "the source sent {pages_sent} pages but {} arrived",
                self.pages.pages
            )));
        }
        // A page read while the guest ran that did not match its CRC, and that no later copy
        // replaced, was corrupted on the way (post-copy fetches the pending ones anew).
        let mut corrupt = self.pages.suspect().clone();
        if let Some(p) = &self.pending {
            corrupt.subtract(p);
        }
        if let Some(first) = corrupt.iter().next() {
            return Err(Error::Protocol(format!(
                "{} pages arrived corrupt (the first: {first:#x}): their data does not match \
                 the CRC they were sent with",
                corrupt.count()
            )));
        }
        Ok(Event::StateEnd { source_checksum })
    }

    fn finish_lanes(&mut self) -> Result<()> {
        if let Some(lanes) = self.lanes.take() {
            self.lanes_ended = lanes.finish(&mut self.pages)?;
        }
        Ok(())
    }

    /// What was collected, once `StateEnd` came: every vCPU's state and the devices'.
    pub fn finish(self) -> Result<Filled> {
        let Filling {
            pages,
            vcpus,
            devices,
            pending,
            checkpoint_every,
            lanes_ended,
            push_on_lanes,
            ..
        } = self;
        let vcpus = vcpus
            .into_iter()
            .enumerate()
            .map(|(i, s)| s.ok_or_else(|| Error::Protocol(format!("no state for vCPU {i}"))))
            .collect::<Result<_>>()?;
        let devices = devices.ok_or_else(|| Error::Protocol("no device state".into()))?;
        Ok(Filled {
            pages,
            vcpus,
            devices,
            pending,
            checkpoint_every,
            // Unless post-copy pushes on them, the extra connections close here.
            push_lanes: if push_on_lanes {
                lanes_ended
            } else {
                Vec::new()
            },
        })
    }
}

/// Checks a page map (post-copy's pending pages, stale ones, round 0's) against this VM's
/// RAM: the right length, and no page outside RAM (post-copy could never complete).
fn page_map(ram: &GuestRam, map: Bitmap) -> Result<Bitmap> {
    if map.pages() != ram.gfn_end() {
        return Err(Error::Protocol(format!(
            "a page map of {} pages for a guest whose pages end at {}",
            map.pages(),
            ram.gfn_end()
        )));
    }
    if let Some(bad) = map.iter().find(|&gfn| !ram.contains(gfn)) {
        return Err(Error::Protocol(format!(
            "a page map names page {bad:#x}, outside guest RAM"
        )));
    }
    Ok(map)
}

#[cfg(test)]
mod tests {
    use std::os::unix::net::UnixStream;

    use super::*;
    use crate::memory::{RamRange, test_support::mapping};

    const RAM_PAGES: u64 = 16;

    /// One side of the conversation with a scripted source on the other end of a socket
    /// pair: the test hands `Filling` frames and reads what it answers.
    struct Script {
        filling: Filling,
        stream: Stream,
        source: UnixStream,
        _ram: GuestRam,
    }

    fn hello(mode: StreamMode, vcpus: u32) -> Message {
        Message::Hello {
            vm: VmDescriptor {
                memory_bytes: RAM_PAGES * 4096,
                ranges: vec![RamRange {
                    gpa: 0,
                    len: RAM_PAGES * 4096,
                }],
                vcpus,
                memory_backend: "anonymous".into(),
                running: true,
                devices: Vec::new(),
                config: None,
            },
            mode,
            source: "script".into(),
            connections: 1,
            session: 7,
        }
    }

    fn opening(first: Message) -> Opening {
        Opening {
            version: wire::frame::VERSION,
            first,
        }
    }

    fn script() -> Script {
        let len = (RAM_PAGES * 4096) as usize;
        let range = RamRange {
            gpa: 0,
            len: len as u64,
        };
        // SAFETY: a fresh mapping of `len` bytes that only this RAM refers to (leaked).
        let ram = unsafe { GuestRam::new(&[(range, mapping(len) as *mut u8)]) }.unwrap();
        let hello = Hello::parse(opening(hello(StreamMode::Precopy, 2)), Expect::Live).unwrap();
        let (ours, theirs) = UnixStream::pair().unwrap();
        let mut stream = Stream::Unix(ours);
        let filling = Filling::open(
            &hello,
            ram.clone(),
            &mut stream,
            None,
            FaultIn::Ahead,
            CpuMeter::default(),
        )
        .unwrap();
        Script {
            filling,
            stream,
            source: theirs,
            _ram: ram,
        }
    }

    impl Script {
        fn send(&mut self, m: Message) -> Result<Event> {
            self.filling.on_frame(Frame::Message(m), &mut self.stream)
        }

        fn send_all(&mut self, frames: Vec<Message>) {
            for m in frames {
                let name = m.name();
                self.send(m)
                    .unwrap_or_else(|e| panic!("{name} was refused: {e}"));
            }
        }

        fn answer(&mut self) -> Message {
            wire::read_message(&mut self.source).unwrap()
        }

        fn page_frame(&mut self) -> Result<Event> {
            let frame = Frame::Pages {
                header: [0; wire::frame::FRAME_HEADER_LEN],
                len: 0,
            };
            self.filling.on_frame(frame, &mut self.stream)
        }
    }

    fn vcpu(index: u32) -> Message {
        Message::VcpuState {
            index,
            state: vec![index as u8],
        }
    }

    fn devices() -> Message {
        Message::DeviceState { state: vec![9] }
    }

    fn state_end() -> Message {
        Message::StateEnd {
            pages_sent: 0,
            memory_checksum: Some(5),
        }
    }

    /// A map of the guest's first `pages` pages.
    fn map(pages: u64) -> Bitmap {
        let mut m = Bitmap::new(RAM_PAGES);
        (0..pages).for_each(|p| m.set(p));
        m
    }

    fn refused(s: &mut Script, m: Message) -> String {
        s.send(m).map(|_| ()).unwrap_err().to_string()
    }

    #[test]
    fn a_precopy_stream_fills_and_hands_over_every_state() {
        let mut s = script();
        s.send_all(vec![
            Message::RoundEnd { round: 0, pages: 0 },
            Message::Sync { lane_pages: vec![] },
        ]);
        assert!(matches!(s.answer(), Message::Synced));
        s.send_all(vec![vcpu(1), devices(), vcpu(0)]);
        let end = s.send(state_end()).unwrap();
        assert!(matches!(
            end,
            Event::StateEnd {
                source_checksum: Some(5)
            }
        ));
        let filled = s.filling.finish().unwrap();
        assert_eq!(filled.vcpus, vec![vec![0], vec![1]]);
        assert_eq!(filled.devices, vec![9]);
        assert!(filled.pending.is_none());
    }

    #[test]
    fn a_postcopy_stream_keeps_its_pending_pages_and_checkpoints() {
        let mut s = script();
        s.send_all(vec![Message::Stale { map: map(2) }]);
        assert!(matches!(s.answer(), Message::StaleDropped));
        s.send_all(vec![
            Message::PostcopyPending { map: map(3) },
            Message::Checkpoints { every_ms: 100 },
            vcpu(0),
            vcpu(1),
            devices(),
            state_end(),
        ]);
        let filled = s.filling.finish().unwrap();
        assert_eq!(filled.pending.unwrap().count(), 3);
        assert_eq!(filled.checkpoint_every, Some(100));
    }

    #[test]
    fn after_the_stale_copies_go_only_the_switch_to_postcopy_may_come() {
        let mut s = script();
        s.send_all(vec![Message::Stale { map: map(1) }]);
        let e = s.page_frame().map(|_| ()).unwrap_err().to_string();
        assert!(
            e.contains("page frame while the destination was in StaleDropped"),
            "{e}"
        );
        for m in [
            Message::Sync { lane_pages: vec![] },
            Message::Stale { map: map(1) },
            vcpu(0),
            Message::RoundEnd { round: 1, pages: 0 },
        ] {
            let name = m.name();
            let e = refused(&mut s, m);
            assert!(
                e.contains(&format!(
                    "unexpected {name} while the destination was in StaleDropped"
                )),
                "{e}"
            );
        }
    }

    #[test]
    fn frames_out_of_order_are_refused_with_the_stage_named() {
        let mut s = script();
        let e = refused(&mut s, Message::Go);
        assert!(
            e.contains("unexpected Go while the destination was in Memory"),
            "{e}"
        );
        let e = refused(&mut s, hello(StreamMode::Precopy, 2));
        assert!(e.contains("unexpected Hello"), "{e}");
        let e = refused(&mut s, state_end());
        assert!(
            e.contains("unexpected StateEnd while the destination was in Memory"),
            "{e}"
        );
        // Checkpoints belong to a post-copy switch.
        s.send_all(vec![vcpu(0)]);
        let e = refused(&mut s, Message::Checkpoints { every_ms: 100 });
        assert!(
            e.contains("unexpected Checkpoints while the destination was in State"),
            "{e}"
        );
        // Pages after the state began: the source sends them before.
        let e = s.page_frame().map(|_| ()).unwrap_err().to_string();
        assert!(
            e.contains("page frame while the destination was in State"),
            "{e}"
        );
        for m in [
            Message::RoundEnd { round: 1, pages: 0 },
            Message::Populated { map: map(1) },
        ] {
            let name = m.name();
            let e = refused(&mut s, m);
            assert!(
                e.contains(&format!(
                    "unexpected {name} while the destination was in State"
                )),
                "{e}"
            );
        }
    }

    #[test]
    fn state_that_comes_twice_or_never_is_refused() {
        let mut s = script();
        s.send_all(vec![vcpu(0)]);
        let e = refused(&mut s, vcpu(0));
        assert!(e.contains("vCPU 0's state came twice"), "{e}");
        let e = refused(&mut s, vcpu(2));
        assert!(e.contains("state for vCPU 2 of a 2-vCPU VM"), "{e}");
        s.send_all(vec![devices()]);
        let e = refused(&mut s, devices());
        assert!(e.contains("the device state came twice"), "{e}");
        s.send_all(vec![state_end()]);
        let e = s.filling.finish().map(|_| ()).unwrap_err().to_string();
        assert!(e.contains("no state for vCPU 1"), "{e}");
    }

    #[test]
    fn an_abort_ends_the_arrival_in_every_stage() {
        let abort = || Message::Abort {
            reason: "source: cancelled".into(),
        };
        let stages: [Vec<Message>; 4] = [
            vec![],
            vec![Message::RoundEnd { round: 0, pages: 0 }],
            vec![Message::Stale { map: map(1) }],
            vec![vcpu(0), devices()],
        ];
        for before in stages {
            let mut s = script();
            s.send_all(before);
            let e = s.send(abort()).map(|_| ()).unwrap_err();
            assert!(
                matches!(&e, Error::Peer(r) if r == "source: cancelled"),
                "{e}"
            );
        }
    }

    #[test]
    fn a_silent_source_times_out_in_every_stage() {
        let stages: [Vec<Message>; 3] =
            [vec![], vec![Message::Stale { map: map(1) }], vec![vcpu(0)]];
        for before in stages {
            let mut s = script();
            s.send_all(before);
            s.stream
                .set_timeouts(Some(Duration::from_millis(20)))
                .unwrap();
            // The source keeps its end open and says nothing.
            let e = s.filling.read_frame(&mut s.stream).map(|_| ()).unwrap_err();
            assert!(e.report().contains("timed out"), "{}", e.report());
        }
    }

    #[test]
    fn a_snapshot_may_not_ask_for_what_only_a_live_source_can_give() {
        for m in [
            Message::Stale { map: map(1) },
            Message::PostcopyPending { map: map(1) },
        ] {
            let mut s = script();
            // Opening a snapshot reads its lanes from a file; past that, only `live` differs.
            s.filling.live = false;
            let name = m.name();
            let e = refused(&mut s, m);
            assert!(
                e.contains(&format!("a snapshot stream carries {name}")),
                "{e}"
            );
        }
    }

    #[test]
    fn a_stream_must_open_with_the_hello_the_listener_takes() {
        let e = Hello::parse(opening(Message::Go), Expect::Live)
            .map(|_| ())
            .unwrap_err();
        assert!(
            e.to_string()
                .contains("unexpected Go while the destination was in AwaitHello")
        );
        let e = Hello::parse(opening(hello(StreamMode::Snapshot, 1)), Expect::Live)
            .map(|_| ())
            .unwrap_err();
        assert!(
            e.to_string()
                .contains("a snapshot stream on a migration listener")
        );
        let e = Hello::parse(opening(hello(StreamMode::Precopy, 1)), Expect::Snapshot)
            .map(|_| ())
            .unwrap_err();
        assert!(e.to_string().contains("not a ferry snapshot"));
        let e = Hello::parse(
            opening(Message::Abort {
                reason: "no".into(),
            }),
            Expect::Live,
        )
        .map(|_| ())
        .unwrap_err();
        assert!(matches!(e, Error::Peer(_)));
    }
}
