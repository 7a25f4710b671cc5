//! JSON bodies of the API. Every field a person reads has its unit in its name.

use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct VcpuProgress {
    pub cpu: usize,
    pub heartbeat_seq: u64,
    pub pages: u64,
    pub passes: u64,
    pub guest_errors: u64,
    pub share_base: u64,
    pub share_pages: u64,
}

/// A virtio device as `vm.info` shows it.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct DeviceInfo {
    pub slot: usize,
    /// Guest-physical address of its virtio-mmio registers.
    pub address: u64,
    /// "virtio-blk" or "virtio-net".
    pub kind: String,
    /// What it is attached to: a disk's file, a NIC's tap and MAC.
    pub attached_to: String,
    /// The backing file, for a disk.
    pub path: Option<String>,
    /// Requests served by kind, and I/O errors.
    pub counters: std::collections::BTreeMap<String, u64>,
    /// Why it stopped serving (the driver programmed it wrongly; it waits for a reset).
    pub needs_reset: Option<String>,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct VmInfo {
    /// running, paused, migrating, migrated, shutting-down, finished, failed
    pub state: String,
    pub memory_bytes: u64,
    pub vcpus: usize,
    /// Heartbeats this process received.
    pub heartbeats: u64,
    pub last_heartbeat_age_ms: Option<f64>,
    /// vCPU 0's heartbeat sequence number (continues across migrations).
    pub heartbeat_seq: u64,
    pub pages_touched: u64,
    pub passes: u64,
    pub verify_errors: u64,
    pub verify_error_pages: Vec<u64>,
    /// Guest-physical address of working-set page 0 (as the guest reported it).
    pub working_set_base: u64,
    pub max_heartbeat_gap_ms: f64,
    /// Heartbeat gap across the migration that built this VM (destination only).
    pub migration_observed_downtime_ms: Option<f64>,
    pub per_vcpu: Vec<VcpuProgress>,
    /// The guest's disk workload (`blk`): sectors written, read back, and found wrong (or
    /// whose request failed); the first wrong sectors.
    pub blk_writes: u64,
    pub blk_reads: u64,
    pub blk_errors: u64,
    pub blk_error_sectors: Vec<u64>,
    /// The guest's forwarding workload (`net=fwd`): frames received, sent back, and dropped
    /// (no transmit buffer free) or malformed.
    pub net_rx: u64,
    pub net_tx: u64,
    pub net_errors: u64,
    /// virtio devices.
    pub devices: Vec<DeviceInfo>,
    /// The balloon (`ferry run --balloon`), when the VM has one.
    #[serde(default)]
    pub balloon: Option<BalloonStatus>,
    /// Why the VM failed, when `state` is failed.
    pub error: Option<String>,
}

/// The balloon as `vm.info` shows it: its target (`vm.balloon`), what the guest says it holds,
/// what it did since the VM booted, and the guest's last memory statistics (absent until the
/// guest gives them).
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct BalloonStatus {
    pub target_pages: u64,
    /// As the guest's driver says.
    pub actual_pages: u64,
    pub deflate_on_oom: bool,
    pub free_page_reporting: bool,
    /// Whether the device offers free page hinting (a migration asks for hints).
    #[serde(default)]
    pub free_page_hint: bool,
    pub pages_inflated: u64,
    pub pages_deflated: u64,
    /// Pages the guest reported free (free page reporting), and given back.
    pub pages_reported: u64,
    /// Pages the guest hinted free when a migration asked (free page hinting), and given back.
    #[serde(default)]
    pub pages_hinted: u64,
    /// What was given back to the host that held data.
    pub freed_bytes: u64,
    /// Page numbers, ranges and buffers refused: outside RAM or malformed.
    pub refused: u64,
    pub stats_updates: u64,
    pub guest_free_bytes: Option<u64>,
    pub guest_total_bytes: Option<u64>,
    pub guest_available_bytes: Option<u64>,
    pub guest_swap_in_bytes: Option<u64>,
    pub guest_swap_out_bytes: Option<u64>,
    pub guest_major_faults: Option<u64>,
    pub guest_minor_faults: Option<u64>,
}

/// Body of `PUT /api/v1/vm.balloon`: the balloon's target, in MiB or in 4 KiB pages (one of
/// them).
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct BalloonRequest {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target_mib: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target_pages: Option<u64>,
}

impl BalloonRequest {
    /// The target in pages; refused unless exactly one unit is given.
    pub fn pages(&self) -> Result<u64, String> {
        match (self.target_mib, self.target_pages) {
            (Some(mib), None) => mib
                .checked_mul(256)
                .ok_or_else(|| format!("target_mib {mib} is too large")),
            (None, Some(pages)) => Ok(pages),
            _ => Err("vm.balloon takes one of target_mib and target_pages".into()),
        }
    }
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct ErrorBody {
    pub error: String,
}

/// Test hook: flip a byte in a working-set page, to prove the guest's verify can fail.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct CorruptPageRequest {
    /// Working-set page index.
    pub page: u64,
}

/// Benchmark hook: KVM dirty logging on or off outside a migration, harvested every
/// `harvest_ms` as a pre-copy would, to measure what dirty tracking costs the guest.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct DirtyLoggingRequest {
    pub enabled: bool,
    pub harvest_ms: Option<u64>,
}

/// Body of `PUT /api/v1/vm.send-migration`. Limits are signed so that a negative number gets
/// an error naming the field rather than a type error.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct MigrationRequest {
    /// tcp:HOST:PORT or unix:PATH
    pub destination: String,
    /// precopy (default), warm, postcopy, hybrid, or local (a live update: the VM handed to
    /// a ferry on this host over `unix:PATH`, its memory and devices' files passed, no page
    /// copied)
    pub mode: Option<String>,
    pub max_downtime_ms: Option<i64>,
    pub max_bandwidth_mbps: Option<i64>,
    pub max_rounds: Option<i64>,
    pub timeout_s: Option<i64>,
    /// Both VMMs checksum guest memory at the switch (adds downtime; for tests).
    pub checksum: Option<bool>,
    /// precopy only: switch to post-copy instead of stop-and-copy when it will not converge.
    pub auto_postcopy: Option<bool>,
    /// precopy: when to slow the guest's vCPUs in steps: "off", "when-stalled" (default:
    /// once pre-copy cannot converge on its own) or "early" (from half the link's rate);
    /// `true` means "early", `false` "off".
    pub auto_converge: Option<AutoConvergeField>,
    /// Post-copy push order: bubble (default; pre-paging around faults) or linear (push only).
    pub prepaging: Option<String>,
    /// Connections the pages travel on, each with its own sender thread (1..=16, default 1).
    pub connections: Option<i64>,
    /// none (default), lz4, zstd or auto.
    pub compression: Option<String>,
    /// Threads that compress, shared out among the connections (default: one per
    /// connection; more needs compression).
    pub migration_threads: Option<i64>,
    /// Delta encoding of re-sent pages: MiB of last-sent copies kept (0: off; default 256 in
    /// precopy and hybrid, 0 in warm and postcopy).
    pub delta_cache_mb: Option<i64>,
    /// Send Go right behind the state: the destination starts once the state is loaded (a
    /// round trip less of downtime); a connection lost before it answers leaves the source
    /// `unconfirmed` instead of running on. Default: on a path whose round trip is 2 ms or
    /// more, off on a shorter one.
    pub go_with_state: Option<bool>,
    /// Post-copy checkpoints every this many ms (5..=60000; off when absent): the source can
    /// then carry on from the newest one should the destination die (`vm.migrate-rollback`).
    pub checkpoint_ms: Option<i64>,
    /// Pre-copy: for how long (s) a broken connection is carried on over a new one while the
    /// VM runs on here (0: the migration fails at once; default 60). Left out of a request
    /// when not given, so that this client still drives a ferry from before it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resume_window_s: Option<i64>,
    /// The VM's disks move with it, in the migration's stream, for hosts that share no
    /// storage (modes precopy and warm; default false). The destination writes each to its
    /// own disk in the same slot. Left out of a request when not given.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub copy_storage: Option<bool>,
}

/// `auto_converge` as a request gives it: a policy's name, or a switch (`true`: "early",
/// `false`: "off"), the form it had before it took names.
#[derive(Clone, Debug, PartialEq)]
pub enum AutoConvergeField {
    Switch(bool),
    Named(String),
}

impl AutoConvergeField {
    /// The policy's name ("off", "when-stalled", "early"; any other string as given).
    pub fn name(&self) -> &str {
        match self {
            AutoConvergeField::Switch(true) => "early",
            AutoConvergeField::Switch(false) => "off",
            AutoConvergeField::Named(s) => s,
        }
    }
}

impl Serialize for AutoConvergeField {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.name())
    }
}

impl<'de> Deserialize<'de> for AutoConvergeField {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Either;
        impl serde::de::Visitor<'_> for Either {
            type Value = AutoConvergeField;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("\"off\", \"when-stalled\", \"early\", or a bool")
            }
            fn visit_bool<E>(self, v: bool) -> Result<Self::Value, E> {
                Ok(AutoConvergeField::Switch(v))
            }
            fn visit_str<E>(self, v: &str) -> Result<Self::Value, E> {
                Ok(AutoConvergeField::Named(v.to_owned()))
            }
        }
        d.deserialize_any(Either)
    }
}

/// Body of `vm.migrate-reclaim` and `vm.migrate-rollback` (optional).
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct TakeBackRequest {
    /// Take the VM back although it has a writable disk the destination may have written
    /// since the switch (the guest then finds on it writes it does not remember).
    #[serde(default)]
    pub force: bool,
}

/// Body of `PUT /api/v1/vm.migrate-resume`: on the destination `listen` (where to wait for the
/// source), on the source `destination` (where to reconnect).
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct MigrateResumeRequest {
    pub listen: Option<String>,
    pub destination: Option<String>,
    /// `listen`: how long to wait for the source (default 300 s); a later `listen` or
    /// `vm.cancel-migration` ends the wait sooner.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_s: Option<u64>,
}

/// Body of `PUT /api/v1/vm.snapshot`.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct SnapshotRequest {
    pub file: String,
    /// none (default), lz4, zstd or auto.
    #[serde(default)]
    pub compression: Option<String>,
    /// Threads that compress (default: one per writer; more needs compression).
    #[serde(default)]
    pub migration_threads: Option<i64>,
    /// Threads that write the file at once, each its own lane of it (default 1).
    #[serde(default)]
    pub writers: Option<i64>,
}

/// Where a migration is, as `GET /api/v1/vm.migration` names it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum MigrationPhase {
    #[default]
    None,
    Setup,
    Active,
    Switchover,
    /// The VM runs on the destination while pages still move.
    PostcopyActive,
    /// The destination runs the VM.
    Completed,
    /// Failed before the destination took over: the VM stays here, as it was.
    Failed,
    Cancelled,
    /// `Go` was sent but never confirmed: the VM may run there; this copy stays paused.
    Unconfirmed,
    /// Post-copy lost its connection after the switch; `vm.migrate-resume` carries on.
    PostcopyPaused,
}

impl MigrationPhase {
    /// The phase as the API's JSON names it.
    pub fn name(self) -> &'static str {
        match self {
            Self::None => "none",
            Self::Setup => "setup",
            Self::Active => "active",
            Self::Switchover => "switchover",
            Self::PostcopyActive => "postcopy-active",
            Self::Completed => "completed",
            Self::Failed => "failed",
            Self::Cancelled => "cancelled",
            Self::Unconfirmed => "unconfirmed",
            Self::PostcopyPaused => "postcopy-paused",
        }
    }

    pub fn is_running(self) -> bool {
        matches!(
            self,
            Self::Setup | Self::Active | Self::Switchover | Self::PostcopyActive
        )
    }
}

/// Page frames by the codec their data went with, and what compression saved.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct CompressionStats {
    /// What was asked for: none, lz4, zstd or auto.
    pub asked: String,
    pub frames_plain: u64,
    pub frames_lz4: u64,
    pub frames_zstd: u64,
    /// `auto`: samples of a frame's pages each codec was measured on (none sent).
    #[serde(default)]
    pub samples_lz4: u64,
    #[serde(default)]
    pub samples_zstd: u64,
    /// Page data of the compressed frames, before and after compression.
    pub bytes_in: u64,
    pub bytes_out: u64,
    /// Pages re-sent as deltas of their last copy (`delta_cache_mb`), and the bytes saved.
    pub delta_pages: u64,
    pub delta_bytes_saved: u64,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct RoundStats {
    pub round: u32,
    pub pages: u64,
    pub zero_pages: u64,
    pub bytes: u64,
    pub duration_ms: f64,
    /// Pages the guest dirtied per second while this round was sent.
    pub dirty_pages_per_s: f64,
    /// Auto-converge: the share of time the guest's vCPUs slept during this round.
    pub throttle_percent: u8,
}

/// What moved of the VM's disks (`copy_storage`), as the source counted it.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct StorageStats {
    pub disks: u32,
    /// Bytes the disks hold, all together.
    pub disk_bytes: u64,
    /// Bytes of data sent.
    pub data_bytes: u64,
    /// What that data took on the wire, frames included: less where runs of it went packed
    /// (`compression`, lz4 or zstd).
    #[serde(default)]
    pub data_wire_bytes: u64,
    /// Bytes that went as zero ranges (holes and blocks of zeros): a few bytes on the wire.
    pub zero_bytes: u64,
    /// 64 KiB blocks sent again because the guest wrote them after they were sent.
    pub blocks_resent: u64,
    /// Blocks sent with the VM paused: the last ones the guest wrote.
    pub blocks_in_pause: u64,
}

/// Post-copy checkpoints: the VM's newest state sent back from the destination to the source.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct CheckpointStats {
    pub every_ms: u32,
    /// Destination: taken and sent; source: applied.
    pub count: u64,
    pub last_seq: u64,
    /// When the last one was taken (destination) or applied (source), in ms after the switch.
    pub last_at_ms: f64,
    /// Pages and bytes that went back, over all checkpoints.
    pub pages: u64,
    pub bytes: u64,
    /// Destination: how long the guest was paused to take them, in all and at most.
    pub pause_ms_total: f64,
    pub pause_ms_max: f64,
    /// Source: the checkpoint a rollback ran the VM on from.
    pub rolled_back_to: Option<u64>,
}

/// This side's CPU time for one kind of work its threads did: `send` (a connection's
/// sender), `pack` (a compressing thread), `receive` (a connection's receiver), `prefault`
/// (faulting the destination's memory in ahead of the pages), `install` (putting post-copy's
/// pushed pages in place). An extra connection's sender
/// runs on a thread of its own each round: its rounds count as one thread, their CPU and
/// lives added up.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct WorkCpu {
    pub work: String,
    pub threads: u32,
    /// CPU seconds, all its threads together.
    pub cpu_s: f64,
    /// Their lives added up: `cpu_s / wall_s` is how busy they were on average.
    pub wall_s: f64,
    /// The busiest thread's CPU ÷ its life (1: on a core all the time).
    pub busiest: f64,
}

/// One named stretch of a migration, in ms on one host's clock.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Stretch {
    pub name: String,
    pub ms: f64,
}

/// What the destination saw during post-copy.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct PostcopyReport {
    pub network_faults: u64,
    pub zero_faults: u64,
    pub pages_before_access: u64,
    pub duplicates: u64,
    pub fault_latency_p50_ms: Option<f64>,
    pub fault_latency_p99_ms: Option<f64>,
    pub fault_latency_max_ms: Option<f64>,
    pub resume_ms: f64,
    pub memory_checksum: Option<u64>,
    /// Per 10 ms since the switch: [network faults, pages pushed in, pages requested in].
    pub timeline_10ms: Vec<[u32; 3]>,
}

/// Body of `GET /api/v1/vm.migration`: live progress and, once it ended, the final figures.
/// Durations name the clock they were measured on.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct MigrationStatus {
    pub phase: MigrationPhase,
    /// source or destination
    pub role: String,
    pub mode: String,
    pub peer: String,
    // live progress
    pub round: u32,
    pub pages_remaining: u64,
    pub dirty_pages_per_s: f64,
    pub throughput_mbps: f64,
    /// None until the link's pace is known.
    pub expected_downtime_ms: Option<f64>,
    pub converged: Option<bool>,
    pub note: Option<String>,
    // totals
    pub memory_pages: u64,
    /// Connections the pages travel on (the main one and the extra ones).
    pub connections: u32,
    /// Threads that compressed page data (one per connection unless asked for more).
    #[serde(default)]
    pub migration_threads: u32,
    /// Which zero-page check this host runs: avx512, avx2 or scalar.
    pub zero_page_check: String,
    pub pages_full: u64,
    pub pages_zero: u64,
    pub pages_skipped_unpopulated: u64,
    /// Of those, the pages the guest had given back (its balloon's, or reported free).
    #[serde(default)]
    pub pages_skipped_free: u64,
    /// Pages that held only zeros when round 0 began: never sent (the destination's fresh
    /// memory reads as zeros).
    #[serde(default)]
    pub pages_skipped_zero: u64,
    pub pages_resent: u64,
    /// Pre-copy: broken connections carried on over a new one, and the pages sent again
    /// because their last copy had not landed.
    #[serde(default)]
    pub resumes: u32,
    #[serde(default)]
    pub pages_sent_again: u64,
    pub bytes_on_wire: u64,
    pub compression: CompressionStats,
    pub rounds: Vec<RoundStats>,
    // times
    pub setup_ms: f64,
    /// The source's clock: its pause → the destination's "resumed" heard back.
    pub downtime_ms: Option<f64>,
    /// The destination's clock: all state received → guest resumed.
    pub destination_downtime_ms: Option<f64>,
    /// The largest heartbeat gap across the switch, as the guest lived it: the destination's
    /// clock minus the source's stamp carried in the device state, so it crosses hosts.
    pub guest_observed_downtime_ms: Option<f64>,
    pub total_ms: f64,
    pub average_throughput_mbps: f64,
    // application degradation: guest pages touched per second
    pub guest_pages_per_s_before: Option<f64>,
    pub guest_pages_per_s_during: Option<f64>,
    pub guest_pages_per_s_after: Option<f64>,
    /// Time auto-converge held the guest's vCPUs asleep during the migration, summed over
    /// vCPUs (up to the pause; a source's figure).
    #[serde(default)]
    pub vcpus_throttled_ms: Option<f64>,
    /// The migration completed; the destination has yet to say what the guest saw (it lets
    /// the guest run a moment first): the two guest figures above follow.
    #[serde(default)]
    pub guest_report_pending: bool,
    // post-copy
    pub destination_supports_postcopy: Option<bool>,
    pub postcopy: bool,
    /// Post-copy after rounds: copies the guest had dirtied since they were sent, dropped on
    /// the destination before the pause (those dirtied later are dropped inside it).
    pub stale_pages_dropped_before_pause: Option<u64>,
    /// Auto-converge: the largest share of time the guest's vCPUs were made to sleep.
    pub throttle_percent_max: u8,
    /// This side's CPU time, by the work its threads did (once the migration ended, completed
    /// or failed; a resumed post-copy's own run reports none).
    #[serde(default)]
    pub cpu: Vec<WorkCpu>,
    /// Where this side's time went, stretch after stretch on its own clock (connect,
    /// handshake, dirty log on, each round and harvest, pause, state, Go...): they add up to
    /// the time from the migrate request (source) or the first message (destination).
    #[serde(default)]
    pub breakdown: Vec<Stretch>,
    /// Destination: when the VM ran there, and when it needed nothing more from the source
    /// (post-copy's last page), in ns since the Unix epoch on the destination's clock.
    #[serde(default)]
    pub resumed_at_unix_ns: Option<u64>,
    #[serde(default)]
    pub completed_at_unix_ns: Option<u64>,
    pub pages_pushed: u64,
    pub pages_requested: u64,
    /// Post-copy over several connections: of the pages pushed, those pushed on the extra
    /// ones (the main connection then carries only the answers to page requests).
    #[serde(default)]
    pub pages_pushed_on_lanes: u64,
    pub postcopy_report: Option<PostcopyReport>,
    /// Post-copy checkpoints (`checkpoint_ms`), when asked for.
    pub checkpoints: Option<CheckpointStats>,
    /// The disks' blocks, when they moved with the VM (`copy_storage`).
    #[serde(default)]
    pub storage: Option<StorageStats>,
    // verification aid
    pub memory_checksum_source: Option<u64>,
    pub memory_checksum_destination: Option<u64>,
    pub error: Option<String>,
}
