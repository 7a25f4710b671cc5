//! What a migration shows while it runs (`Progress`) and when it ends (`Report`). The task
//! that runs a migration owns its `Status` and publishes a copy on a `StatusBoard`, which
//! readers (the API) only read. Every duration but one is measured on one host's clock, and
//! the report says whose; the guest-observed downtime spans both (see its field).

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::buckets::FaultLatency;
use crate::params::Mode;
use crate::wire::{PostcopyReport, StreamMode};

/// The next migration's `Status::run` (0 is the empty status a board starts with).
static NEXT_RUN: AtomicU64 = AtomicU64::new(1);

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Phase {
    #[default]
    None,
    Setup,
    Active,
    Switchover,
    /// The VM runs on the destination; pages still move (both sides say so).
    Postcopy,
    /// The destination runs the VM.
    Completed,
    /// Failed before the destination took over: the source VM runs on (or stays paused if
    /// its user had paused it).
    Failed,
    Cancelled,
    /// `Go` was sent but the destination never confirmed: the VM may run there. The source
    /// stays paused, neither resumed (two copies) nor destroyed (none); an operator decides.
    Unconfirmed,
    /// Post-copy lost its connection after the switch; `vm.migrate-resume` carries on.
    PostcopyPaused,
}

impl Phase {
    pub fn is_running(self) -> bool {
        matches!(
            self,
            Self::Setup | Self::Active | Self::Switchover | Self::Postcopy
        )
    }

    pub fn name(self) -> &'static str {
        match self {
            Phase::None => "none",
            Phase::Setup => "setup",
            Phase::Active => "active",
            Phase::Switchover => "switchover",
            Phase::Postcopy => "postcopy-active",
            Phase::Completed => "completed",
            Phase::Failed => "failed",
            Phase::Cancelled => "cancelled",
            Phase::Unconfirmed => "unconfirmed",
            Phase::PostcopyPaused => "postcopy-paused",
        }
    }
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Role {
    #[default]
    Source,
    Destination,
}

/// Pages by what happened to them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PageCounts {
    /// Sent with their 4 KiB of data.
    pub full: u64,
    /// Sent as a zero marker.
    pub zero: u64,
    /// Never populated on the source: skipped without being read.
    pub skipped_unpopulated: u64,
    /// Of those, the pages the guest had given back (its balloon's, or reported free).
    pub skipped_free: u64,
    /// Populated but all zeros when round 0 began: skipped (a destination's fresh memory
    /// reads as zeros; a later write is in the dirty log).
    pub skipped_zero: u64,
    /// Sent again after an earlier round had sent them.
    pub resent: u64,
    /// Post-copy: pushed by the source / requested by the destination's faults.
    pub pushed: u64,
    pub requested: u64,
    /// Of the pushed pages, those pushed on the extra connections (the main one then carries
    /// only the answers to requests).
    pub pushed_on_lanes: u64,
}

#[derive(Clone, Debug, Default, PartialEq)]
pub struct RoundStats {
    pub round: u32,
    pub pages: u64,
    pub zero_pages: u64,
    pub bytes: u64,
    pub duration: Duration,
    /// Pages the guest dirtied per second while this round was sent.
    pub dirty_pages_per_s: f64,
    /// Auto-converge: the share of time the guest's vCPUs slept during this round.
    pub throttle_percent: u8,
}

/// Live figures.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Progress {
    pub round: u32,
    pub pages_remaining: u64,
    pub dirty_pages_per_s: f64,
    pub throughput_mbps: f64,
    /// What the pages left would take at the link's pace (None: no pace known yet).
    pub expected_downtime: Option<Duration>,
    pub pages: PageCounts,
    pub bytes_on_wire: u64,
    pub rounds: Vec<RoundStats>,
    /// Page frames by the codec their data went with, and what compression saved.
    pub compression: CompressionCounts,
    /// The disks' blocks, when they move with the VM (`copy_storage`).
    pub storage: Option<StorageCounts>,
}

/// What moved of the VM's disks (`copy_storage`), as the source counts it.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StorageCounts {
    pub disks: u32,
    /// Bytes the disks hold, all together.
    pub disk_bytes: u64,
    /// Bytes of data sent.
    pub data_bytes: u64,
    /// What that data took on the wire: less where runs of it went packed.
    pub data_wire_bytes: u64,
    /// Bytes that went as zero ranges: holes and blocks of zeros.
    pub zero_bytes: u64,
    /// Blocks sent again because the guest wrote them after they were sent.
    pub blocks_resent: u64,
    /// Blocks sent with the VM paused, the last ones the guest wrote.
    pub blocks_in_pause: u64,
}

#[derive(Clone, Debug, Default, PartialEq)]
pub struct CompressionCounts {
    /// What was asked for: none, lz4, zstd or auto.
    pub asked: String,
    pub frames_plain: u64,
    pub frames_lz4: u64,
    pub frames_zstd: u64,
    /// `auto`: samples of a frame's pages each codec was measured on (none sent).
    pub samples_lz4: u64,
    pub samples_zstd: u64,
    /// Page data of the compressed frames, before and after.
    pub bytes_in: u64,
    pub bytes_out: u64,
    /// Pages re-sent as deltas of their last copy, and the bytes that saved.
    pub delta_pages: u64,
    pub delta_bytes_saved: u64,
}

/// What is known of the guest after the switch: the destination lets it run a moment, then
/// measures the downtime it saw and its work rate since.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub enum GuestAfter {
    /// Not asked for (yet): no migration has switched, or the figures never came.
    #[default]
    Unknown,
    /// The VM runs on the destination; the figures follow.
    Pending,
    Seen {
        observed_downtime: Option<Duration>,
        pages_per_s_after: Option<f64>,
    },
}

/// What a finished migration measured (also a failed one, as far as it got).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Report {
    pub converged: Option<bool>,
    pub setup: Duration,
    /// Source's clock: pause → the destination's "resumed" heard back.
    pub downtime: Option<Duration>,
    /// Destination's clock: all state received → guest resumed.
    pub destination_downtime: Option<Duration>,
    /// The largest heartbeat gap across the switch, as the guest lived it: the destination's
    /// clock minus the source's stamp carried in the device state: the one figure that
    /// crosses hosts' clocks.
    pub guest_observed_downtime: Option<Duration>,
    pub total: Duration,
    pub average_throughput_mbps: f64,
    // application degradation: guest pages touched per second
    pub guest_pages_per_s_before: Option<f64>,
    pub guest_pages_per_s_during: Option<f64>,
    pub guest_pages_per_s_after: Option<f64>,
    /// Time auto-converge held the guest's vCPUs asleep during the migration, summed over
    /// vCPUs (up to the pause).
    pub vcpus_throttled: Option<Duration>,
    /// The migration completed and the destination has yet to say what the guest saw (the
    /// two figures above): it lets the guest run a moment first.
    pub guest_report_pending: bool,
    pub postcopy_report: Option<PostcopyReport>,
    /// Post-copy after rounds: copies the guest had dirtied, dropped on the destination
    /// before the pause (the rest, dirtied after, are dropped inside it).
    pub stale_pages_dropped_before_pause: Option<u64>,
    /// Auto-converge: the largest throttle it applied (0: never engaged).
    pub throttle_percent_max: u8,
    /// This side's CPU time by the work its threads did (see `crate::cpu`).
    pub cpu: Vec<crate::cpu::WorkCpu>,
    /// Where this side's time went, stretch after stretch on its own clock (see `Laps`).
    pub breakdown: Vec<Stretch>,
    /// Destination: when the VM ran here, and when it needed nothing more from the source
    /// (post-copy's last page; otherwise the same), in ns since the Unix epoch on this host's
    /// clock: what a benchmark reads to time any VMM's move the same way.
    pub resumed_at_unix_ns: Option<u64>,
    pub completed_at_unix_ns: Option<u64>,
    /// Pre-copy: connections that broke and were carried on over a new one, and the pages
    /// sent again because their last copy had not landed (the pages dirtied meanwhile are
    /// counted as resent, as in any round).
    pub resumes: u32,
    pub pages_sent_again: u64,
    // verification aid
    pub memory_checksum_source: Option<u64>,
    pub memory_checksum_destination: Option<u64>,
}

/// Everything a reader sees of one migration.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Status {
    pub phase: Phase,
    pub role: Role,
    /// None on a destination until the source said.
    pub mode: Option<Transfer>,
    pub peer: String,
    pub memory_pages: u64,
    /// Connections the pages travel on (the main one and the extra ones).
    pub connections: u32,
    /// Threads that compress page data (one per connection unless `migration_threads` asks
    /// for more).
    pub migration_threads: u32,
    /// Which zero-page check this host runs: avx512, avx2 or scalar.
    pub zero_page_check: String,
    /// What the destination said when it answered: can it take post-copy?
    pub destination_supports_postcopy: Option<bool>,
    /// Whether the switch-over handed over by post-copy.
    pub postcopy: bool,
    pub progress: Progress,
    pub report: Report,
    /// Why the policy switched as it did, or what happened worth knowing.
    pub note: Option<String>,
    pub error: Option<String>,
    /// Post-copy checkpoints, when asked for (kept by the board: see `StatusBoard`).
    pub checkpoints: Option<CheckpointStats>,
    /// Which migration of this process this is (each `Status::new` takes the next).
    pub run: u64,
    /// How long post-copy's network faults waited here (destination).
    pub fault_latency: FaultLatency,
}

/// Post-copy checkpoints: the VM as it runs on the destination, sent back to the source at
/// intervals, so that the source can carry on from the last one if the destination dies.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct CheckpointStats {
    pub every_ms: u32,
    /// Destination: taken and sent; source: applied.
    pub count: u64,
    pub last_seq: u64,
    /// When the last one was taken (destination) or applied (source), after the switch.
    pub last_at: Duration,
    /// Pages and bytes that went back, over all checkpoints.
    pub pages: u64,
    pub bytes: u64,
    /// Destination: how long the guest was paused to take them, in all and at most.
    pub pause_total: Duration,
    pub pause_max: Duration,
    /// Source: the checkpoint a rollback ran the VM on from.
    pub rolled_back_to: Option<u64>,
}

/// What kind of move a status describes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Transfer {
    Precopy,
    Postcopy,
    Hybrid,
    Warm,
    Snapshot,
    /// A live update: the VM handed to another process on this host, no page copied.
    Local,
}

impl Transfer {
    pub fn name(self) -> &'static str {
        match self {
            Transfer::Precopy => "precopy",
            Transfer::Postcopy => "postcopy",
            Transfer::Hybrid => "hybrid",
            Transfer::Warm => "warm",
            Transfer::Snapshot => "snapshot",
            Transfer::Local => "local",
        }
    }
}

impl From<Mode> for Transfer {
    fn from(mode: Mode) -> Self {
        match mode {
            Mode::Precopy => Transfer::Precopy,
            Mode::Postcopy => Transfer::Postcopy,
            Mode::Hybrid => Transfer::Hybrid,
            Mode::Warm => Transfer::Warm,
            Mode::Local => Transfer::Local,
        }
    }
}

/// A destination hears only how the stream flows: post-copy and hybrid begin as pre-copy.
impl From<StreamMode> for Transfer {
    fn from(mode: StreamMode) -> Self {
        match mode {
            StreamMode::Precopy => Transfer::Precopy,
            StreamMode::Warm => Transfer::Warm,
            StreamMode::Snapshot => Transfer::Snapshot,
            StreamMode::Local => Transfer::Local,
        }
    }
}

impl Status {
    pub fn new(role: Role, mode: Option<Transfer>, peer: String) -> Self {
        Self {
            phase: Phase::Setup,
            role,
            mode,
            peer,
            zero_page_check: crate::zero::implementation().into(),
            run: NEXT_RUN.fetch_add(1, Ordering::Relaxed),
            ..Default::default()
        }
    }

    /// Whether this side sent the VM away for good: an outgoing migration (not a snapshot,
    /// after which the VM runs on here) that completed. The VM must not run here again.
    pub fn moved_away(&self) -> bool {
        self.role == Role::Source
            && self.phase == Phase::Completed
            && self.mode != Some(Transfer::Snapshot)
    }
}

/// One named stretch of a migration on one host's clock.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Stretch {
    pub name: String,
    pub took: Duration,
}

/// A stopwatch whose laps follow each other without gaps: the stretches it records add up to
/// the time since it started, so no time goes unexplained.
#[derive(Clone, Debug)]
pub(crate) struct Laps {
    last: Instant,
}

impl Laps {
    pub fn starting(at: Instant) -> Self {
        Self { last: at }
    }

    /// Ends the stretch called `name` now, and starts the next; returns when.
    pub fn lap(&mut self, name: impl Into<String>, report: &mut Report) -> Instant {
        let now = Instant::now();
        let stretch = Stretch {
            name: name.into(),
            took: now - self.last,
        };
        tracing::trace!("{}: {:?}", stretch.name, stretch.took);
        report.breakdown.push(stretch);
        self.last = now;
        now
    }
}

pub fn now_ns() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0)
}
