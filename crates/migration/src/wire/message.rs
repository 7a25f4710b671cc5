//! Control messages and their encoding. Every message has an explicit numeric tag, and every
//! field is written by hand in a fixed order (little-endian), so the bytes on the wire change
//! only when this file does — and then the golden-bytes tests below fail and the stream
//! version must move (see docs/protocol.md, "Changelog").

use crate::bitmap::Bitmap;
use crate::error::{Error, Result};
use crate::host::HostId;
use crate::memory::RamRange;
use crate::vm::{DeviceDescriptor, VmDescriptor};
use crate::wire::codec::Codec;

/// What kind of stream a source opens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StreamMode {
    /// Live pre-copy: the source runs until switch-over (post-copy and hybrid start so too).
    Precopy,
    /// Warm: paused first, everything sent, resumed on the destination.
    Warm,
    /// Cold: a snapshot file; no peer answers.
    Snapshot,
    /// Live update on one host: memory and device files are passed (`Files`), no page sent.
    Local,
}

impl StreamMode {
    fn tag(self) -> u8 {
        match self {
            StreamMode::Precopy => 1,
            StreamMode::Warm => 2,
            StreamMode::Snapshot => 3,
            StreamMode::Local => 4,
        }
    }

    fn from_tag(t: u8) -> Result<Self> {
        Ok(match t {
            1 => StreamMode::Precopy,
            2 => StreamMode::Warm,
            3 => StreamMode::Snapshot,
            4 => StreamMode::Local,
            other => return Err(Error::Protocol(format!("unknown stream mode {other}"))),
        })
    }
}

/// What the destination saw during post-copy.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PostcopyReport {
    /// Faults that had to wait for a page from the source.
    pub network_faults: u64,
    /// Faults resolved here with a zero page (the page held nothing on the source).
    pub zero_faults: u64,
    /// Pages that arrived before the guest touched them (pushed, never faulted).
    pub pages_before_access: u64,
    /// Pages that arrived when they were already here: must stay 0.
    pub duplicates: u64,
    pub fault_latency_p50_ms: Option<f64>,
    pub fault_latency_p99_ms: Option<f64>,
    pub fault_latency_max_ms: Option<f64>,
    /// Guest resume to the last page in place (the destination's clock).
    pub resume_ms: f64,
    /// `memory_checksum` of guest memory as it was at the switch (what arrived), when asked.
    pub memory_checksum: Option<u64>,
    /// Per 10 ms since the switch: [network faults, pages pushed in, pages requested in].
    pub timeline_10ms: Vec<[u32; 3]>,
}

/// The end of a payload, from `at` on: a `DiskData`'s blocks, kept in the buffer they were
/// read into.
#[derive(Clone, Debug)]
pub struct Tail {
    buf: Vec<u8>,
    at: usize,
}

impl std::ops::Deref for Tail {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.buf[self.at..]
    }
}

impl From<Vec<u8>> for Tail {
    fn from(buf: Vec<u8>) -> Self {
        Self { buf, at: 0 }
    }
}

impl PartialEq for Tail {
    fn eq(&self, other: &Self) -> bool {
        **self == **other
    }
}

/// Every frame that is not a page frame. The comment on each names who sends it.
#[derive(Clone, Debug, PartialEq)]
pub enum Message {
    /// Source → destination, first: what to build.
    Hello {
        vm: VmDescriptor,
        mode: StreamMode,
        source: String,
        /// Connections this migration's pages travel on (this one and `connections - 1`
        /// that open with `Join`).
        connections: u32,
        /// Names this migration to its extra connections (random; 0 when there are none).
        session: u64,
    },
    /// Destination → source: the VM is built, send pages; whether it can take post-copy, and
    /// (in streams of version `HOST_SINCE` on) which host it runs on, where it knows.
    Ready {
        postcopy: bool,
        host: Option<HostId>,
    },
    /// Source → destination: round `round` is complete.
    RoundEnd { round: u32, pages: u64 },
    /// Source → destination: one vCPU's state (versioned by the VMM).
    VcpuState { index: u32, state: Vec<u8> },
    /// Source → destination: the rest of the VM's state (versioned by the VMM).
    DeviceState { state: Vec<u8> },
    /// Source → destination: nothing more before the switch.
    StateEnd {
        pages_sent: u64,
        memory_checksum: Option<u64>,
    },
    /// Destination → source: everything loaded; waiting for `Go`.
    Loaded { memory_checksum: Option<u64> },
    /// Source → destination: the source gives the VM up; resume it.
    Go,
    /// Destination → source: the VM runs here now (or stays paused, if it was paused on the
    /// source); `state_to_resume_ns` is the destination's own downtime share, on its clock.
    Resumed { state_to_resume_ns: u64 },
    /// Destination → source, after the guest's first heartbeats on the destination.
    GuestReport {
        observed_downtime_ns: Option<u64>,
        pages_per_s_after: Option<f64>,
    },
    /// Either side: the migration failed, with why.
    Abort { reason: String },
    /// Source → destination, before the state: the switch is to post-copy, and these pages
    /// (a bitmap over guest page numbers) come after the guest resumes; all others are final.
    PostcopyPending { map: Bitmap },
    /// Destination → source during post-copy: the guest needs this page now.
    PageRequest { gfn: u64 },
    /// Source → destination: every pending page has been sent.
    PostcopyDone { pages_sent: u64 },
    /// Destination → source: every page is in place; the source may let go.
    PostcopyComplete(PostcopyReport),
    /// Source → destination, first on a new connection: carry on an interrupted post-copy.
    ResumePostcopy,
    /// Destination → source: the pages already here (a bitmap); send the rest.
    ResumeFrom { map: Bitmap },
    /// Source → destination, first on an extra connection: it carries the pages of lane
    /// `lane` of migration `session`.
    Join { session: u64, lane: u32 },
    /// Source → destination, last on an extra connection: it carried `pages` pages.
    LaneEnd { pages: u64 },
    /// Source → destination, while the guest still runs, before a switch to post-copy after
    /// rounds: these pages (a bitmap) were dirtied since they were sent; make them missing.
    Stale { map: Bitmap },
    /// Destination → source: the stale pages are gone; the source may pause.
    StaleDropped,
    /// Source → destination, while the guest still runs, before a pre-copy pause: answer
    /// once every page sent so far is in place (`lane_pages`: pages sent on each extra
    /// connection), so that no backlog is left to apply while the guest is paused.
    Sync { lane_pages: Vec<u64> },
    /// Destination → source: everything before `Sync` is in place.
    Synced,
    /// Source → destination, with `PostcopyPending`: while post-copy runs, send a consistent
    /// checkpoint of the VM back every `every_ms` milliseconds (see `Checkpoint`).
    Checkpoints { every_ms: u32 },
    /// Destination → source during post-copy, after the page frames it names: the VM as it
    /// was at one instant: these `pages` (every page dirtied here since the last checkpoint
    /// the source confirmed) and the vCPU and device state. The source applies it whole or
    /// not at all.
    Checkpoint {
        seq: u64,
        pages: u64,
        vcpus: Vec<Vec<u8>>,
        devices: Vec<u8>,
    },
    /// Source → destination: checkpoint `seq` is applied; its pages need not come again.
    CheckpointTaken { seq: u64 },
    /// Source → destination, before round 0's pages: the pages that round sends (a bitmap
    /// over guest page numbers). The destination faults them in on threads of its own while
    /// they travel, so that its receiver writes into memory that is already there.
    Populated { map: Bitmap },
    /// Source → destination, right after `Hello` on a live update (`StreamMode::Local`): the
    /// files that follow as one byte with `SCM_RIGHTS` are `memory` guest RAM files (one per
    /// RAM range, in order), then one file for each device slot marked true in `devices`
    /// (a disk's image, a NIC's tap).
    Files { memory: u32, devices: Vec<bool> },
    /// Source → destination, first on a new connection: carry on pre-copy `session`, whose
    /// connection broke while the VM still ran on the source.
    ResumePrecopy { session: u64 },
    /// Destination → source: what it holds of pre-copy after a break: `pages` (every page it
    /// received) and, per guest page, how many copies of it arrived (wrapping at 2^16), as
    /// runs of (count, pages). A page whose count is not the source's is sent again.
    CopiesHeld { pages: u64, runs: Vec<(u16, u32)> },
    /// Source → destination, before round 0 of a pre-copy it can carry on: should the
    /// connection break before the switch, it tries for `seconds` to carry it on over a new
    /// one, so the destination waits as long with what it holds.
    ResumeWindow { seconds: u32 },
    /// Source → destination, after `PostcopyPending` of a migration over several connections:
    /// post-copy pushes its pages on the extra connections, each of which ends again with
    /// `LaneEnd` (the pages pushed on it after the switch); the main connection carries only
    /// the answers to page requests, which then never wait behind a push.
    PushOnLanes,
    /// Source → destination, on a connection that carries post-copy's pushes, before them:
    /// every `every` pages taken off this connection, say so with `Taken`. The source keeps
    /// what the destination has not taken yet within a window, so that a reply never waits
    /// behind more than that, however well the pages compress.
    Receipts { every: u32 },
    /// Destination → source, on a connection that asked for `Receipts`: `pages` pages have
    /// been taken off it since (a running count).
    Taken { pages: u64 },
    /// Source → destination, right after `Hello` (after `Files` on a live update), in streams
    /// of version `CONFIG_SINCE` on: the VM's config as its VMM keeps it, opaque to the
    /// engine (the Cloud Hypervisor profile's `VmConfig` JSON), or none (`ferry run`'s VMs:
    /// their destination is given their devices). The destination keeps it for the VM's
    /// console, a reboot and `vm.info`, and opens nothing it names unless its operator allowed
    /// it.
    Config { config: Option<String> },
    /// Source → destination, right after `Config`, in streams of version `STORAGE_SINCE` on:
    /// the slots of the disks whose blocks this stream carries (`copy_storage`), none where
    /// the disks are shared storage. The destination writes them to its own disk at each
    /// slot, which it locks before its `Ready`.
    Storage { disks: Vec<u32> },
    /// Source → destination, among the rounds and in the pause before the state: `data` (a
    /// multiple of 512 bytes) belongs at `offset` of the disk in slot `disk`.
    DiskData { disk: u32, offset: u64, data: Tail },
    /// Source → destination: `len` bytes at `offset` of the disk in slot `disk` read as
    /// zeros (a hole or zero blocks); the destination discards them.
    DiskZero { disk: u32, offset: u64, len: u64 },
    /// Destination → source, right after `CopiesHeld` where the stream carries disks (version
    /// 17 on; before it such a pre-copy was not carried on): per disk `Storage` named, in its
    /// order, the copies of each 64 KiB block that landed, as runs (count, blocks) as
    /// `CopiesHeld`'s.
    BlocksHeld { disks: Vec<Vec<(u16, u32)>> },
    /// Source → destination, as `DiskData` (version 17 on): `data`, packed by `codec` (lz4 or
    /// zstd), unpacks to `len` bytes (a multiple of 512, at most a run of 16 blocks) that
    /// belong at `offset` of the disk in slot `disk`.
    DiskPacked {
        disk: u32,
        offset: u64,
        codec: Codec,
        len: u32,
        data: Tail,
    },
}

/// The catalogue: every message's tag on the wire, written once. `tag`, `name` and the
/// dispatch of `decode` come from it. Never reuse or renumber a tag.
macro_rules! catalogue {
    ($($tag:literal => $variant:ident,)*) => {
        /// A message's kind: its variant, numbered by its tag.
        #[derive(Clone, Copy, Debug, PartialEq, Eq)]
        #[repr(u16)]
        enum Kind {
            $($variant = $tag,)*
        }

        impl Kind {
            fn of_tag(tag: u16) -> Result<Self> {
                match tag {
                    $($tag => Ok(Kind::$variant),)*
                    other => Err(Error::Protocol(format!("unknown message tag {other}"))),
                }
            }

            fn name(self) -> &'static str {
                match self {
                    $(Kind::$variant => stringify!($variant),)*
                }
            }
        }

        impl Message {
            fn kind(&self) -> Kind {
                match self {
                    $(Message::$variant { .. } => Kind::$variant,)*
                }
            }
        }
    };
}

catalogue! {
    1 => Hello,
    2 => Ready,
    3 => RoundEnd,
    4 => VcpuState,
    5 => DeviceState,
    6 => StateEnd,
    7 => Loaded,
    8 => Go,
    9 => Resumed,
    10 => GuestReport,
    11 => Abort,
    12 => PostcopyPending,
    13 => PageRequest,
    14 => PostcopyDone,
    15 => PostcopyComplete,
    16 => ResumePostcopy,
    17 => ResumeFrom,
    18 => Join,
    19 => LaneEnd,
    20 => Stale,
    21 => StaleDropped,
    22 => Sync,
    23 => Synced,
    24 => Checkpoints,
    25 => Checkpoint,
    26 => CheckpointTaken,
    27 => Populated,
    28 => Files,
    29 => ResumePrecopy,
    30 => CopiesHeld,
    31 => ResumeWindow,
    32 => PushOnLanes,
    33 => Receipts,
    34 => Taken,
    35 => Config,
    36 => Storage,
    37 => DiskData,
    38 => DiskZero,
    39 => BlocksHeld,
    40 => DiskPacked,
}

impl Message {
    /// The message's tag on the wire (see `catalogue!`).
    pub fn tag(&self) -> u16 {
        self.kind() as u16
    }

    /// A short name for errors ("expected Loaded, got Go").
    pub fn name(&self) -> &'static str {
        self.kind().name()
    }

    /// Tag (u16) followed by the fields.
    pub fn encode(&self) -> Vec<u8> {
        let mut e = Encoder(Vec::with_capacity(64));
        e.u16(self.tag());
        match self {
            Message::Hello {
                vm,
                mode,
                source,
                connections,
                session,
            } => {
                e.vm(vm);
                e.u8(mode.tag());
                e.str(source);
                e.u32(*connections);
                e.u64(*session);
            }
            Message::Ready { postcopy, host } => {
                e.bool(*postcopy);
                // Absent, not a flag: builds before `HOST_SINCE` read a bool and nothing else.
                if let Some(host) = host {
                    e.0.extend_from_slice(host);
                }
            }
            Message::RoundEnd { round, pages } => {
                e.u32(*round);
                e.u64(*pages);
            }
            Message::VcpuState { index, state } => {
                e.u32(*index);
                e.bytes(state);
            }
            Message::DeviceState { state } => e.bytes(state),
            Message::StateEnd {
                pages_sent,
                memory_checksum,
            } => {
                e.u64(*pages_sent);
                e.opt_u64(*memory_checksum);
            }
            Message::Loaded { memory_checksum } => e.opt_u64(*memory_checksum),
            Message::Go
            | Message::ResumePostcopy
            | Message::StaleDropped
            | Message::Synced
            | Message::PushOnLanes => {}
            Message::Resumed { state_to_resume_ns } => e.u64(*state_to_resume_ns),
            Message::GuestReport {
                observed_downtime_ns,
                pages_per_s_after,
            } => {
                e.opt_u64(*observed_downtime_ns);
                e.opt_f64(*pages_per_s_after);
            }
            Message::Abort { reason } => e.str(reason),
            Message::PostcopyPending { map }
            | Message::Stale { map }
            | Message::Populated { map } => {
                e.u64(map.pages());
                e.bitmap(map);
            }
            Message::PageRequest { gfn } => e.u64(*gfn),
            Message::PostcopyDone { pages_sent } => e.u64(*pages_sent),
            Message::PostcopyComplete(r) => e.report(r),
            Message::ResumeFrom { map } => e.bitmap(map),
            Message::Sync { lane_pages } => e.words(lane_pages),
            Message::Files { memory, devices } => {
                e.u32(*memory);
                e.u32(devices.len() as u32);
                devices.iter().for_each(|&d| e.bool(d));
            }
            Message::ResumePrecopy { session } => e.u64(*session),
            Message::ResumeWindow { seconds } => e.u32(*seconds),
            Message::CopiesHeld { pages, runs } => {
                e.u64(*pages);
                e.runs(runs);
            }
            Message::BlocksHeld { disks } => {
                e.u32(disks.len() as u32);
                disks.iter().for_each(|runs| e.runs(runs));
            }
            Message::DiskPacked {
                disk,
                offset,
                codec,
                len,
                data,
            } => {
                e.u32(*disk);
                e.u64(*offset);
                e.u8(codec.index() as u8);
                e.u32(*len);
                e.bytes(data);
            }
            Message::Join { session, lane } => {
                e.u64(*session);
                e.u32(*lane);
            }
            Message::LaneEnd { pages } | Message::Taken { pages } => e.u64(*pages),
            Message::Receipts { every } => e.u32(*every),
            Message::Checkpoints { every_ms } => e.u32(*every_ms),
            Message::Checkpoint {
                seq,
                pages,
                vcpus,
                devices,
            } => {
                e.u64(*seq);
                e.u64(*pages);
                e.u32(vcpus.len() as u32);
                vcpus.iter().for_each(|v| e.bytes(v));
                e.bytes(devices);
            }
            Message::CheckpointTaken { seq } => e.u64(*seq),
            Message::Config { config } => e.opt_str(config.as_deref()),
            Message::Storage { disks } => {
                e.u32(disks.len() as u32);
                disks.iter().for_each(|&d| e.u32(d));
            }
            Message::DiskData { disk, offset, data } => {
                e.u32(*disk);
                e.u64(*offset);
                e.bytes(data);
            }
            Message::DiskZero { disk, offset, len } => {
                e.u32(*disk);
                e.u64(*offset);
                e.u64(*len);
            }
        }
        e.0
    }

    /// `decode` of a payload this message may keep: a `DiskData` or `DiskPacked` keeps its
    /// blocks where they were read (up to 1 MiB a frame), not in a copy of them.
    pub fn decode_owned(payload: Vec<u8>) -> Result<Self> {
        let Some(head) = disk_run_head(&payload) else {
            return Self::decode(&payload); // another kind, or says what is wrong with it
        };
        let (disk, offset) = (head.disk, head.offset);
        let data = Tail {
            buf: payload,
            at: head.at,
        };
        Ok(match head.packing {
            Some((codec, len)) => Message::DiskPacked {
                disk,
                offset,
                codec,
                len,
                data,
            },
            None => Message::DiskData { disk, offset, data },
        })
    }

    /// `DiskData`'s encoding up to its data, which follows it (`len` bytes): what
    /// `frame::write_disk_run` sends in front of a disk's blocks.
    pub fn disk_data_head(disk: u32, offset: u64, len: usize) -> Vec<u8> {
        let mut e = Encoder(Vec::with_capacity(18));
        e.u16(Kind::DiskData as u16);
        e.u32(disk);
        e.u64(offset);
        e.u32(len as u32);
        e.0
    }

    /// `DiskPacked`'s encoding up to its `packed` bytes of data, which follow it.
    pub fn disk_packed_head(
        disk: u32,
        offset: u64,
        codec: Codec,
        len: u32,
        packed: usize,
    ) -> Vec<u8> {
        let mut e = Encoder(Vec::with_capacity(23));
        e.u16(Kind::DiskPacked as u16);
        e.u32(disk);
        e.u64(offset);
        e.u8(codec.index() as u8);
        e.u32(len);
        e.u32(packed as u32);
        e.0
    }

    pub fn decode(payload: &[u8]) -> Result<Self> {
        let mut d = Decoder { buf: payload };
        let msg = match Kind::of_tag(d.u16()?)? {
            Kind::Hello => Message::Hello {
                vm: d.vm()?,
                mode: StreamMode::from_tag(d.u8()?)?,
                source: d.string()?,
                connections: d.u32()?,
                session: d.u64()?,
            },
            Kind::Ready => Message::Ready {
                postcopy: d.bool()?,
                host: match d.buf.len() {
                    0 => None,
                    _ => Some(d.take(16)?.try_into().expect("16 bytes")),
                },
            },
            Kind::RoundEnd => Message::RoundEnd {
                round: d.u32()?,
                pages: d.u64()?,
            },
            Kind::VcpuState => Message::VcpuState {
                index: d.u32()?,
                state: d.bytes()?,
            },
            Kind::DeviceState => Message::DeviceState { state: d.bytes()? },
            Kind::StateEnd => Message::StateEnd {
                pages_sent: d.u64()?,
                memory_checksum: d.opt_u64()?,
            },
            Kind::Loaded => Message::Loaded {
                memory_checksum: d.opt_u64()?,
            },
            Kind::Go => Message::Go,
            Kind::Resumed => Message::Resumed {
                state_to_resume_ns: d.u64()?,
            },
            Kind::GuestReport => Message::GuestReport {
                observed_downtime_ns: d.opt_u64()?,
                pages_per_s_after: d.opt_f64()?,
            },
            Kind::Abort => Message::Abort {
                reason: d.string()?,
            },
            Kind::PostcopyPending => Message::PostcopyPending { map: d.page_map()? },
            Kind::PageRequest => Message::PageRequest { gfn: d.u64()? },
            Kind::PostcopyDone => Message::PostcopyDone {
                pages_sent: d.u64()?,
            },
            Kind::PostcopyComplete => Message::PostcopyComplete(d.report()?),
            Kind::ResumePostcopy => Message::ResumePostcopy,
            Kind::ResumeFrom => Message::ResumeFrom {
                map: d.bitmap(None)?,
            },
            Kind::Join => Message::Join {
                session: d.u64()?,
                lane: d.u32()?,
            },
            Kind::LaneEnd => Message::LaneEnd { pages: d.u64()? },
            Kind::Stale => Message::Stale { map: d.page_map()? },
            Kind::StaleDropped => Message::StaleDropped,
            Kind::Sync => Message::Sync {
                lane_pages: d.words()?,
            },
            Kind::Synced => Message::Synced,
            Kind::Checkpoints => Message::Checkpoints { every_ms: d.u32()? },
            Kind::Checkpoint => {
                let (seq, pages) = (d.u64()?, d.u64()?);
                let n = d.count(4)?;
                let vcpus = (0..n).map(|_| d.bytes()).collect::<Result<_>>()?;
                Message::Checkpoint {
                    seq,
                    pages,
                    vcpus,
                    devices: d.bytes()?,
                }
            }
            Kind::CheckpointTaken => Message::CheckpointTaken { seq: d.u64()? },
            Kind::Populated => Message::Populated { map: d.page_map()? },
            Kind::ResumePrecopy => Message::ResumePrecopy { session: d.u64()? },
            Kind::ResumeWindow => Message::ResumeWindow { seconds: d.u32()? },
            Kind::PushOnLanes => Message::PushOnLanes,
            Kind::Receipts => Message::Receipts { every: d.u32()? },
            Kind::Taken => Message::Taken { pages: d.u64()? },
            Kind::Config => Message::Config {
                config: d.opt_string()?,
            },
            Kind::Storage => Message::Storage {
                disks: (0..d.count(4)?).map(|_| d.u32()).collect::<Result<_>>()?,
            },
            Kind::DiskData => Message::DiskData {
                disk: d.u32()?,
                offset: d.u64()?,
                data: d.bytes()?.into(),
            },
            Kind::DiskZero => Message::DiskZero {
                disk: d.u32()?,
                offset: d.u64()?,
                len: d.u64()?,
            },
            Kind::CopiesHeld => Message::CopiesHeld {
                pages: d.u64()?,
                runs: d.runs()?,
            },
            Kind::DiskPacked => Message::DiskPacked {
                disk: d.u32()?,
                offset: d.u64()?,
                codec: packing_codec(d.u8()?)?,
                len: d.u32()?,
                data: d.bytes()?.into(),
            },
            Kind::BlocksHeld => Message::BlocksHeld {
                disks: (0..d.count(4)?).map(|_| d.runs()).collect::<Result<_>>()?,
            },
            Kind::Files => Message::Files {
                memory: d.u32()?,
                devices: (0..d.count(1)?).map(|_| d.bool()).collect::<Result<_>>()?,
            },
        };
        if !d.buf.is_empty() {
            return Err(Error::Protocol(format!(
                "{} bytes left over after a {} message",
                d.buf.len(),
                msg.name()
            )));
        }
        Ok(msg)
    }
}

/// A `DiskData` or `DiskPacked` up to its data.
struct DiskRunHead {
    disk: u32,
    offset: u64,
    /// `DiskPacked`'s codec and unpacked length.
    packing: Option<(Codec, u32)>,
    /// Where its data starts in the payload.
    at: usize,
}

/// The head of a well-formed `DiskData` or `DiskPacked` (`None` for anything else).
fn disk_run_head(payload: &[u8]) -> Option<DiskRunHead> {
    let mut d = Decoder { buf: payload };
    let kind = Kind::of_tag(d.u16().ok()?).ok()?;
    let (disk, offset) = (d.u32().ok()?, d.u64().ok()?);
    let packing = match kind {
        Kind::DiskData => None,
        Kind::DiskPacked => Some((packing_codec(d.u8().ok()?).ok()?, d.u32().ok()?)),
        _ => return None,
    };
    let len = d.count(1).ok()?;
    (d.buf.len() == len).then_some(DiskRunHead {
        disk,
        offset,
        packing,
        at: payload.len() - len,
    })
}

/// The codec a `DiskPacked` names: lz4 or zstd (a run that was not packed is `DiskData`).
fn packing_codec(v: u8) -> Result<Codec> {
    match Codec::ALL.get(usize::from(v)) {
        Some(&c) if c != Codec::None => Ok(c),
        _ => Err(Error::Protocol(format!(
            "DiskPacked names codec {v} (1: lz4, 2: zstd)"
        ))),
    }
}

struct Encoder(Vec<u8>);

impl Encoder {
    fn u8(&mut self, v: u8) {
        self.0.push(v);
    }
    fn bool(&mut self, v: bool) {
        self.u8(u8::from(v));
    }
    fn u16(&mut self, v: u16) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn u32(&mut self, v: u32) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn u64(&mut self, v: u64) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn f64(&mut self, v: f64) {
        self.u64(v.to_bits());
    }
    fn opt_u64(&mut self, v: Option<u64>) {
        self.bool(v.is_some());
        if let Some(v) = v {
            self.u64(v);
        }
    }
    fn opt_f64(&mut self, v: Option<f64>) {
        self.opt_u64(v.map(f64::to_bits));
    }
    fn runs(&mut self, runs: &[(u16, u32)]) {
        self.u32(runs.len() as u32);
        for &(count, len) in runs {
            self.u16(count);
            self.u32(len);
        }
    }
    fn bytes(&mut self, v: &[u8]) {
        self.u32(v.len() as u32);
        self.0.extend_from_slice(v);
    }
    fn str(&mut self, v: &str) {
        self.bytes(v.as_bytes());
    }
    fn opt_str(&mut self, v: Option<&str>) {
        self.bool(v.is_some());
        if let Some(v) = v {
            self.str(v);
        }
    }
    fn words(&mut self, v: &[u64]) {
        self.u32(v.len() as u32);
        v.iter().for_each(|&w| self.u64(w));
    }
    fn vm(&mut self, vm: &VmDescriptor) {
        self.u64(vm.memory_bytes);
        self.u32(vm.ranges.len() as u32);
        for r in &vm.ranges {
            self.u64(r.gpa);
            self.u64(r.len);
        }
        self.u32(vm.vcpus);
        self.str(&vm.memory_backend);
        self.bool(vm.running);
        self.u32(vm.devices.len() as u32);
        vm.devices.iter().for_each(|d| self.device(d));
    }
    fn device(&mut self, d: &DeviceDescriptor) {
        match d {
            DeviceDescriptor::Disk {
                path,
                readonly,
                sectors,
            } => {
                self.u8(DEVICE_DISK);
                self.str(path);
                self.bool(*readonly);
                self.u64(*sectors);
            }
            DeviceDescriptor::Net {
                tap,
                mac,
                features,
                queues,
            } => {
                self.u8(DEVICE_NET);
                self.str(tap);
                self.bool(mac.is_some());
                if let Some(mac) = mac {
                    self.0.extend_from_slice(mac);
                }
                self.u64(*features);
                self.u16(*queues);
            }
            DeviceDescriptor::Balloon {
                target_bytes,
                deflate_on_oom,
                free_page_reporting,
                stats_s,
                features,
            } => {
                self.u8(DEVICE_BALLOON);
                self.u64(*target_bytes);
                self.bool(*deflate_on_oom);
                self.bool(*free_page_reporting);
                self.u32(*stats_s);
                self.u64(*features);
            }
        }
    }
    fn report(&mut self, r: &PostcopyReport) {
        self.u64(r.network_faults);
        self.u64(r.zero_faults);
        self.u64(r.pages_before_access);
        self.u64(r.duplicates);
        self.opt_f64(r.fault_latency_p50_ms);
        self.opt_f64(r.fault_latency_p99_ms);
        self.opt_f64(r.fault_latency_max_ms);
        self.f64(r.resume_ms);
        self.opt_u64(r.memory_checksum);
        self.u32(r.timeline_10ms.len() as u32);
        for b in &r.timeline_10ms {
            b.iter().for_each(|&v| self.u32(v));
        }
    }
    /// A page bitmap as runs: guest memory is populated, dirtied and sent in long stretches,
    /// so a 64 GiB guest's 2 MiB bitmap takes a few hundred bytes, and a switch's pause (which
    /// carries one) costs no more round trips for a larger guest. The word count, then runs
    /// until it is reached: `RUN_ZEROS len`, `RUN_ONES len`, or `RUN_WORDS len` and `len`
    /// words as they are.
    fn bitmap(&mut self, map: &Bitmap) {
        let n = map.word_count();
        self.u32(n as u32);
        let mut literal_from = 0;
        let mut i = 0;
        while i < n {
            let w = map.word(i);
            let len = if w == 0 || w == u64::MAX {
                (i..n).take_while(|&j| map.word(j) == w).count()
            } else {
                0
            };
            // A run of one word between literal ones saves nothing: it stays literal.
            if len < 2 && !(len == 1 && (i == literal_from || i + 1 == n)) {
                i += 1;
                continue;
            }
            self.literal_words(map, literal_from..i);
            self.0.push(if w == 0 { RUN_ZEROS } else { RUN_ONES });
            self.u32(len as u32);
            i += len;
            literal_from = i;
        }
        self.literal_words(map, literal_from..n);
    }
    fn literal_words(&mut self, map: &Bitmap, words: std::ops::Range<usize>) {
        if !words.is_empty() {
            self.0.push(RUN_WORDS);
            self.u32(words.len() as u32);
            words.for_each(|i| self.u64(map.word(i)));
        }
    }
}

/// The kinds of device a VM descriptor names.
const DEVICE_DISK: u8 = 1;
const DEVICE_NET: u8 = 2;
const DEVICE_BALLOON: u8 = 3;

const RUN_ZEROS: u8 = 0;
const RUN_ONES: u8 = 1;
const RUN_WORDS: u8 = 2;
/// Most words a bitmap may have: 2^28 pages (1 TiB of guest addresses), above the VMM's
/// largest guest (512 GiB and the hole below 4 GiB); more is a corrupt or hostile message,
/// not a bitmap to allocate (at most 32 MiB).
const MAX_BITMAP_WORDS: usize = 1 << 22;

struct Decoder<'a> {
    buf: &'a [u8],
}

impl<'a> Decoder<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        if self.buf.len() < n {
            return Err(Error::Protocol("control message cut short".into()));
        }
        let (head, rest) = self.buf.split_at(n);
        self.buf = rest;
        Ok(head)
    }
    fn u8(&mut self) -> Result<u8> {
        Ok(self.take(1)?[0])
    }
    fn bool(&mut self) -> Result<bool> {
        match self.u8()? {
            0 => Ok(false),
            1 => Ok(true),
            other => Err(Error::Protocol(format!("{other} is not a boolean"))),
        }
    }
    fn u16(&mut self) -> Result<u16> {
        Ok(u16::from_le_bytes(self.take(2)?.try_into().unwrap()))
    }
    fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().unwrap()))
    }
    fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().unwrap()))
    }
    fn f64(&mut self) -> Result<f64> {
        Ok(f64::from_bits(self.u64()?))
    }
    fn opt_u64(&mut self) -> Result<Option<u64>> {
        Ok(if self.bool()? {
            Some(self.u64()?)
        } else {
            None
        })
    }
    fn opt_f64(&mut self) -> Result<Option<f64>> {
        Ok(self.opt_u64()?.map(f64::from_bits))
    }
    /// A length prefix for items of `item_len` bytes, checked against what is left, so a
    /// hostile count cannot make us allocate more than the frame holds.
    fn count(&mut self, item_len: usize) -> Result<usize> {
        let n = self.u32()? as usize;
        if n.saturating_mul(item_len) > self.buf.len() {
            return Err(Error::Protocol(format!(
                "a list of {n} items does not fit the message"
            )));
        }
        Ok(n)
    }
    /// Runs of copy counts: (count u16, length u32) each.
    fn runs(&mut self) -> Result<Vec<(u16, u32)>> {
        (0..self.count(6)?)
            .map(|_| Ok((self.u16()?, self.u32()?)))
            .collect()
    }
    fn bytes(&mut self) -> Result<Vec<u8>> {
        let n = self.count(1)?;
        Ok(self.take(n)?.to_vec())
    }
    fn string(&mut self) -> Result<String> {
        String::from_utf8(self.bytes()?)
            .map_err(|_| Error::Protocol("a string that is not UTF-8".into()))
    }
    fn opt_string(&mut self) -> Result<Option<String>> {
        Ok(if self.bool()? {
            Some(self.string()?)
        } else {
            None
        })
    }
    fn words(&mut self) -> Result<Vec<u64>> {
        let n = self.count(8)?;
        (0..n).map(|_| self.u64()).collect()
    }
    fn vm(&mut self) -> Result<VmDescriptor> {
        let memory_bytes = self.u64()?;
        let n = self.count(16)?;
        let mut ranges = Vec::with_capacity(n);
        for _ in 0..n {
            ranges.push(RamRange {
                gpa: self.u64()?,
                len: self.u64()?,
            });
        }
        Ok(VmDescriptor {
            memory_bytes,
            ranges,
            vcpus: self.u32()?,
            memory_backend: self.string()?,
            running: self.bool()?,
            devices: {
                // The smallest device on the wire is a disk: a tag, an empty path, a flag and
                // its sectors.
                let n = self.count(14)?;
                (0..n).map(|_| self.device()).collect::<Result<_>>()?
            },
            // Not in `Hello`: `Config` carries it.
            config: None,
        })
    }
    fn device(&mut self) -> Result<DeviceDescriptor> {
        Ok(match self.u8()? {
            DEVICE_DISK => DeviceDescriptor::Disk {
                path: self.string()?,
                readonly: self.bool()?,
                sectors: self.u64()?,
            },
            DEVICE_NET => DeviceDescriptor::Net {
                tap: self.string()?,
                mac: match self.bool()? {
                    true => Some(self.take(6)?.try_into().unwrap()),
                    false => None,
                },
                features: self.u64()?,
                queues: self.u16()?,
            },
            DEVICE_BALLOON => DeviceDescriptor::Balloon {
                target_bytes: self.u64()?,
                deflate_on_oom: self.bool()?,
                free_page_reporting: self.bool()?,
                stats_s: self.u32()?,
                features: self.u64()?,
            },
            other => return Err(Error::Protocol(format!("device kind {other} is unknown"))),
        })
    }
    fn report(&mut self) -> Result<PostcopyReport> {
        let mut r = PostcopyReport {
            network_faults: self.u64()?,
            zero_faults: self.u64()?,
            pages_before_access: self.u64()?,
            duplicates: self.u64()?,
            fault_latency_p50_ms: self.opt_f64()?,
            fault_latency_p99_ms: self.opt_f64()?,
            fault_latency_max_ms: self.opt_f64()?,
            resume_ms: self.f64()?,
            memory_checksum: self.opt_u64()?,
            timeline_10ms: Vec::new(),
        };
        let n = self.count(12)?;
        r.timeline_10ms.reserve(n);
        for _ in 0..n {
            r.timeline_10ms
                .push([self.u32()?, self.u32()?, self.u32()?]);
        }
        Ok(r)
    }
    /// A page map: its page count, then its bitmap of exactly as many words.
    fn page_map(&mut self) -> Result<Bitmap> {
        let pages = self.u64()?;
        self.bitmap(Some(pages))
    }
    /// A bitmap of `pages` pages (by default, 64 a word): zero runs cost nothing here,
    /// as they cost nothing in a `Bitmap`.
    fn bitmap(&mut self, pages: Option<u64>) -> Result<Bitmap> {
        let n = self.u32()? as usize;
        if n > MAX_BITMAP_WORDS {
            return Err(Error::Protocol(format!(
                "a bitmap of {n} words (at most {MAX_BITMAP_WORDS})"
            )));
        }
        let pages = pages.unwrap_or(n as u64 * 64);
        if pages.div_ceil(64) != n as u64 {
            return Err(Error::Protocol(format!(
                "a page map of {pages} pages in {n} words"
            )));
        }
        let mut map = Bitmap::new(pages);
        let mut at = 0;
        while at < n {
            let kind = self.u8()?;
            let len = self.u32()? as usize;
            if len == 0 || len > n - at {
                return Err(Error::Protocol(format!(
                    "a bitmap run of {len} words where {} are left",
                    n - at
                )));
            }
            match kind {
                RUN_ZEROS => {}
                RUN_ONES => (at..at + len).for_each(|i| map.or_word(i, u64::MAX)),
                RUN_WORDS => {
                    if len * 8 > self.buf.len() {
                        return Err(Error::Protocol(format!(
                            "a bitmap run of {len} words does not fit the message"
                        )));
                    }
                    for i in at..at + len {
                        map.or_word(i, self.u64()?);
                    }
                }
                other => {
                    return Err(Error::Protocol(format!("unknown bitmap run kind {other}")));
                }
            }
            at += len;
        }
        Ok(map)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(b: &[u8]) -> String {
        b.iter().map(|x| format!("{x:02x}")).collect()
    }

    /// One example of every message with its exact bytes. If this fails, the wire changed:
    /// bump `frame::VERSION` and write the change in docs/protocol.md before updating it.
    fn golden() -> Vec<(Message, &'static str)> {
        vec![
            (
                Message::Hello {
                    vm: VmDescriptor {
                        memory_bytes: 0x1000,
                        ranges: vec![RamRange {
                            gpa: 0,
                            len: 0x1000,
                        }],
                        vcpus: 2,
                        memory_backend: "memfd".into(),
                        running: true,
                        devices: vec![
                            DeviceDescriptor::Disk {
                                path: "d".into(),
                                readonly: true,
                                sectors: 0x800,
                            },
                            DeviceDescriptor::Net {
                                tap: "t".into(),
                                mac: Some([1, 2, 3, 4, 5, 6]),
                                features: 0x1_0000_0020,
                                queues: 2,
                            },
                            DeviceDescriptor::Balloon {
                                target_bytes: 2,
                                deflate_on_oom: true,
                                free_page_reporting: false,
                                stats_s: 5,
                                features: 0x1_0000_0007,
                            },
                        ],
                        config: None,
                    },
                    mode: StreamMode::Precopy,
                    source: "f".into(),
                    connections: 2,
                    session: 0x55,
                },
                "0100001000000000000001000000000000000000000000100000000000000200000005000000\
                 6d656d6664 01 03000000 01 01000000 64 01 0008000000000000 \
                 02 01000000 74 01 010203040506 2000000001000000 0200 \
                 03 0200000000000000 01 00 05000000 0700000001000000 \
                 01 0100000066 02000000 5500000000000000",
            ),
            (
                Message::Ready {
                    postcopy: true,
                    host: None,
                },
                "020001",
            ),
            (
                Message::Ready {
                    postcopy: false,
                    host: Some([0xab; 16]),
                },
                "020000abababababababababababababababab",
            ),
            (
                Message::RoundEnd { round: 3, pages: 5 },
                "0300030000000500000000000000",
            ),
            (
                Message::VcpuState {
                    index: 1,
                    state: vec![0xab],
                },
                "04000100000001000000ab",
            ),
            (Message::DeviceState { state: vec![] }, "050000000000"),
            (
                Message::StateEnd {
                    pages_sent: 7,
                    memory_checksum: Some(9),
                },
                "06000700000000000000010900000000000000",
            ),
            (
                Message::Loaded {
                    memory_checksum: None,
                },
                "070000",
            ),
            (Message::Go, "0800"),
            (
                Message::Resumed {
                    state_to_resume_ns: 1,
                },
                "09000100000000000000",
            ),
            (
                Message::GuestReport {
                    observed_downtime_ns: Some(2),
                    pages_per_s_after: None,
                },
                "0a0001020000000000000000",
            ),
            (Message::Abort { reason: "x".into() }, "0b000100000078"),
            (
                Message::PostcopyPending {
                    map: Bitmap::from_words(&[1], 64),
                },
                "0c00 4000000000000000 01000000 02 01000000 0100000000000000",
            ),
            (Message::PageRequest { gfn: 0x10 }, "0d001000000000000000"),
            (
                Message::PostcopyDone { pages_sent: 3 },
                "0e000300000000000000",
            ),
            (
                Message::PostcopyComplete(PostcopyReport {
                    network_faults: 1,
                    timeline_10ms: vec![[1, 2, 3]],
                    ..Default::default()
                }),
                "0f00 0100000000000000 000000000000000000000000000000000000000000000000 000000 \
                 0000000000000000 00 01000000 010000000200000003000000",
            ),
            (Message::ResumePostcopy, "1000"),
            (
                Message::ResumeFrom {
                    map: Bitmap::new(0),
                },
                "1100 00000000",
            ),
            (
                Message::Join {
                    session: 0x55,
                    lane: 1,
                },
                "1200 5500000000000000 01000000",
            ),
            (Message::LaneEnd { pages: 4 }, "1300 0400000000000000"),
            (
                Message::Stale {
                    map: Bitmap::from_words(&[1], 64),
                },
                "1400 4000000000000000 01000000 02 01000000 0100000000000000",
            ),
            (Message::StaleDropped, "1500"),
            (
                Message::Sync {
                    lane_pages: vec![3],
                },
                "1600 01000000 0300000000000000",
            ),
            (Message::Synced, "1700"),
            (Message::Checkpoints { every_ms: 50 }, "1800 32000000"),
            (
                Message::Checkpoint {
                    seq: 2,
                    pages: 3,
                    vcpus: vec![vec![0xab]],
                    devices: vec![0xcd],
                },
                "1900 0200000000000000 0300000000000000 01000000 01000000ab 01000000cd",
            ),
            (Message::CheckpointTaken { seq: 2 }, "1a00 0200000000000000"),
            (
                Message::Populated {
                    map: Bitmap::from_words(&[1], 64),
                },
                "1b00 4000000000000000 01000000 02 01000000 0100000000000000",
            ),
            (
                Message::Files {
                    memory: 2,
                    devices: vec![true, false, true],
                },
                "1c00 02000000 03000000 010001",
            ),
            (
                Message::ResumePrecopy { session: 7 },
                "1d00 0700000000000000",
            ),
            (
                Message::CopiesHeld {
                    pages: 5,
                    runs: vec![(1, 3), (0, 2)],
                },
                "1e00 0500000000000000 02000000 0100 03000000 0000 02000000",
            ),
            (Message::ResumeWindow { seconds: 60 }, "1f00 3c000000"),
            (Message::PushOnLanes, "2000"),
            (Message::Receipts { every: 128 }, "2100 80000000"),
            (Message::Taken { pages: 256 }, "2200 0001000000000000"),
            (Message::Config { config: None }, "2300 00"),
            (
                Message::Config {
                    config: Some("{}".into()),
                },
                "2300 01 02000000 7b7d",
            ),
            (
                Message::Storage { disks: vec![0, 2] },
                "2400 02000000 00000000 02000000",
            ),
            (
                Message::DiskData {
                    disk: 1,
                    offset: 512,
                    data: vec![0xab, 0xcd].into(),
                },
                "2500 01000000 0002000000000000 02000000 abcd",
            ),
            (
                Message::DiskZero {
                    disk: 1,
                    offset: 0,
                    len: 65536,
                },
                "2600 01000000 0000000000000000 0000010000000000",
            ),
            (
                Message::BlocksHeld {
                    disks: vec![vec![(1, 2)], vec![]],
                },
                "2700 02000000 01000000 0100 02000000 00000000",
            ),
            (
                Message::DiskPacked {
                    disk: 1,
                    offset: 512,
                    codec: Codec::Zstd,
                    len: 1024,
                    data: vec![0xab, 0xcd].into(),
                },
                "2800 01000000 0002000000000000 02 00040000 02000000 abcd",
            ),
        ]
    }

    #[test]
    fn every_message_has_fixed_bytes() {
        let all = golden();
        assert_eq!(
            all.len(),
            42,
            "a golden example per message (Config and Ready with and without)"
        );
        for (msg, bytes) in all {
            let want: String = bytes.split_whitespace().collect();
            assert_eq!(hex(&msg.encode()), want, "encoding of {}", msg.name());
            assert_eq!(Message::decode(&msg.encode()).unwrap(), msg);
        }
    }

    #[test]
    fn disk_data_head_is_the_message_up_to_its_data() {
        let data = vec![7u8; 1024];
        let mut sent = Message::disk_data_head(2, 4096, data.len());
        sent.extend_from_slice(&data);
        let msg = Message::DiskData {
            disk: 2,
            offset: 4096,
            data: data.clone().into(),
        };
        assert_eq!(sent, msg.encode());
        // Read back without a copy, it is the same message; so is every other kind, and a
        // `DiskData` whose length is wrong is refused as `decode` refuses it.
        assert_eq!(Message::decode_owned(sent.clone()).unwrap(), msg);
        for (other, _) in golden() {
            assert_eq!(Message::decode_owned(other.encode()).unwrap(), other);
        }
        sent.pop();
        let owned = Message::decode_owned(sent.clone()).unwrap_err().to_string();
        assert_eq!(owned, Message::decode(&sent).unwrap_err().to_string());
        // A packed run likewise; one naming no codec it could be packed with is refused.
        let mut sent = Message::disk_packed_head(2, 4096, Codec::Lz4, 8192, data.len());
        sent.extend_from_slice(&data);
        let msg = Message::DiskPacked {
            disk: 2,
            offset: 4096,
            codec: Codec::Lz4,
            len: 8192,
            data: data.into(),
        };
        assert_eq!(sent, msg.encode());
        assert_eq!(Message::decode_owned(sent.clone()).unwrap(), msg);
        sent[14] = 0;
        let e = Message::decode_owned(sent).unwrap_err().to_string();
        assert!(e.contains("DiskPacked names codec 0"), "{e}");
    }

    #[test]
    fn bitmaps_travel_as_runs() {
        // 64 GiB of guest memory: 1 GiB populated at the start, a stretch of mixed words,
        // then nothing: a few runs, not 2 MiB.
        let mut words = vec![u64::MAX; 4096];
        words.extend([5, 0, 7, u64::MAX, 0, 0, 9]);
        words.resize(262_144, 0);
        words.push(u64::MAX);
        let pages = words.len() as u64 * 64;
        let msg = Message::PostcopyPending {
            map: Bitmap::from_words(&words, pages),
        };
        let bytes = msg.encode();
        assert!(bytes.len() < 100, "{} bytes", bytes.len());
        assert_eq!(Message::decode(&bytes).unwrap(), msg);
        for words in [
            vec![],
            vec![0],
            vec![3],
            vec![0, 3, 0],
            vec![u64::MAX, 3, 3],
        ] {
            let map = Bitmap::from_words(&words, words.len() as u64 * 64);
            let msg = Message::ResumeFrom { map };
            assert_eq!(Message::decode(&msg.encode()).unwrap(), msg);
        }
        // A page map whose word count is not its page count's is refused.
        let mut bytes = Message::Populated {
            map: Bitmap::from_words(&[1], 64),
        }
        .encode();
        bytes[2] = 65; // 65 pages need two words, and one came
        let e = Message::decode(&bytes).unwrap_err();
        assert!(e.to_string().contains("65 pages in 1 words"), "{e}");
    }

    #[test]
    fn hostile_payloads_are_refused_with_a_reason() {
        let e = Message::decode(&[0x63, 0]).unwrap_err();
        assert!(e.to_string().contains("unknown message tag 99"), "{e}");
        let e = Message::decode(&[8, 0, 1]).unwrap_err();
        assert!(e.to_string().contains("left over after a Go"), "{e}");
        // A bitmap claiming four billion words in a few bytes.
        let e = Message::decode(&[0x11, 0, 0xff, 0xff, 0xff, 0xff]).unwrap_err();
        assert!(
            e.to_string().contains("a bitmap of 4294967295 words"),
            "{e}"
        );
        // Runs longer than the bitmap, literal words that are not there, an unknown run.
        let e = Message::decode(&[0x11, 0, 2, 0, 0, 0, 0, 3, 0, 0, 0]).unwrap_err();
        assert!(
            e.to_string().contains("run of 3 words where 2 are left"),
            "{e}"
        );
        let e = Message::decode(&[0x11, 0, 2, 0, 0, 0, 2, 2, 0, 0, 0, 1]).unwrap_err();
        assert!(e.to_string().contains("does not fit"), "{e}");
        let e = Message::decode(&[0x11, 0, 1, 0, 0, 0, 7, 1, 0, 0, 0]).unwrap_err();
        assert!(e.to_string().contains("unknown bitmap run kind 7"), "{e}");
        let e = Message::decode(&[2, 0, 7]).unwrap_err();
        assert!(e.to_string().contains("not a boolean"), "{e}");
        let e = Message::decode(&[3, 0, 1]).unwrap_err();
        assert!(e.to_string().contains("cut short"), "{e}");
    }
}
