//! What a migration reports while it runs and when it ends (`GET /api/v1/vm.migration`).

use std::sync::{Arc, Mutex, MutexGuard};

use serde::{Deserialize, Serialize};

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum MigrationPhase {
    #[default]
    None,
    Setup,
    Active,
    Switchover,
    /// The destination runs the VM.
    Completed,
    /// Failed before the destination took over: the source VM runs on.
    Failed,
    Cancelled,
    /// `Go` was sent but the destination never confirmed: the VM may run there. The source
    /// stays paused, neither resumed (two copies) nor destroyed (none); an operator decides.
    Unconfirmed,
}

impl MigrationPhase {
    pub fn is_running(self) -> bool {
        matches!(self, Self::Setup | Self::Active | Self::Switchover)
    }
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
}

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
    pub expected_downtime_ms: f64,
    pub converged: Option<bool>,
    pub note: Option<String>,
    // totals
    pub memory_pages: u64,
    /// Which zero-page check this host runs: avx512, avx2 or scalar.
    pub zero_page_check: String,
    pub pages_full: u64,
    pub pages_zero: u64,
    pub pages_skipped_unpopulated: u64,
    /// Pages sent again after an earlier round had sent them.
    pub pages_resent: u64,
    pub bytes_on_wire: u64,
    pub rounds: Vec<RoundStats>,
    // times
    pub setup_ms: f64,
    /// Source pause to destination resume, by the VMM's clocks.
    pub downtime_ms: Option<f64>,
    /// The largest heartbeat gap across the switch, as the guest lived it.
    pub guest_observed_downtime_ms: Option<f64>,
    pub total_ms: f64,
    pub average_throughput_mbps: f64,
    // application degradation: guest pages touched per second
    pub guest_pages_per_s_before: Option<f64>,
    pub guest_pages_per_s_during: Option<f64>,
    pub guest_pages_per_s_after: Option<f64>,
    // post-copy
    /// What the destination said when it answered: can it take post-copy?
    pub destination_supports_postcopy: Option<bool>,
    /// Whether the switch-over handed over to post-copy.
    pub postcopy: bool,
    pub pages_pushed: u64,
    pub pages_requested: u64,
    pub postcopy_report: Option<crate::protocol::PostcopyReport>,
    // verification aid
    pub memory_checksum_source: Option<u64>,
    pub memory_checksum_destination: Option<u64>,
    pub error: Option<String>,
}

pub type SharedStatus = Arc<Mutex<MigrationStatus>>;

pub fn lock(status: &SharedStatus) -> MutexGuard<'_, MigrationStatus> {
    status.lock().unwrap_or_else(|e| e.into_inner())
}
