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
    /// Why the VM failed, when `state` is failed.
    pub error: Option<String>,
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
    /// precopy (default) or warm
    pub mode: Option<String>,
    pub max_downtime_ms: Option<i64>,
    pub max_bandwidth_mbps: Option<i64>,
    pub max_rounds: Option<i64>,
    pub timeout_s: Option<i64>,
    /// Both VMMs checksum guest memory at the switch (adds downtime; for tests).
    pub checksum: Option<bool>,
    /// precopy only: switch to post-copy instead of stop-and-copy when it will not converge.
    pub auto_postcopy: Option<bool>,
    /// Post-copy push order: bubble (default; pre-paging around faults) or linear (push only).
    pub prepaging: Option<String>,
}

/// Body of `PUT /api/v1/vm.migrate-resume`: on the destination `listen` (where to wait for the
/// source), on the source `destination` (where to reconnect).
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct MigrateResumeRequest {
    pub listen: Option<String>,
    pub destination: Option<String>,
}

/// Body of `PUT /api/v1/vm.snapshot`.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct SnapshotRequest {
    pub file: String,
}

pub use migration::{MigrationPhase, MigrationStatus, RoundStats};
