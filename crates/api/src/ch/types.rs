//! Bodies of Cloud Hypervisor's calls that ferry takes, and the answers it gives. Fields of
//! CH's schema that ferry lacks are listed and accepted only at CH's default (`check`); any
//! field CH does not have is refused by serde.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::error::ApiError;

/// Refuses `value` for `field` unless it is CH's default for it.
fn only_default(
    field: &str,
    value: &Option<Value>,
    default: Value,
    why: &str,
) -> Result<(), ApiError> {
    match value {
        None | Some(Value::Null) => Ok(()),
        Some(v) if *v == default => Ok(()),
        Some(Value::Array(a)) if a.is_empty() => Ok(()),
        Some(v) => Err(ApiError::bad_request(format!(
            "{field}={v}: ferry does not support it ({why})"
        ))),
    }
}

/// `PUT /api/v1/vm.send-migration`.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct SendMigrationData {
    /// `tcp:HOST:PORT` or `unix:PATH`.
    pub destination_url: String,
    /// A live update on this host (`unix:` only): memory and device files pass to the
    /// receiving ferry, no page is copied (the VM needs `memory.shared`).
    #[serde(default)]
    pub local: Option<bool>,
    #[serde(default)]
    pub preserve_source: Option<Value>,
    /// The downtime the migration aims for (CH's default 300).
    pub downtime_ms: Option<i64>,
    /// The longest the migration may take (CH's default 3600).
    pub timeout_s: Option<i64>,
    #[serde(default)]
    pub timeout_strategy: Option<Value>,
    /// Connections the pages travel on (1..=16 in ferry).
    pub connections: Option<i64>,
    /// `ca-cert.pem`, `client-cert.pem`, `client-key.pem`.
    pub tls_dir: Option<String>,
    /// `Precopy` (default) or `Postcopy`.
    pub memory_mode: Option<String>,
    /// ferry's extension: the VM's disks move with it, in the migration's stream (pre-copy
    /// only). The destination writes them to the disks its config names, which must exist
    /// there, as large, under its `--allow-disk-dir`.
    #[serde(default)]
    pub copy_storage: Option<bool>,
}

/// CH's default `timeout_s` (ferry's own is shorter; the profile keeps CH's).
pub const CH_TIMEOUT_S: i64 = 3600;

impl SendMigrationData {
    pub fn check(&self) -> Result<(), ApiError> {
        only_default(
            "preserve_source",
            &self.preserve_source,
            Value::Bool(false),
            "the source VM ends once the destination runs it",
        )?;
        only_default(
            "timeout_strategy",
            &self.timeout_strategy,
            Value::String("Cancel".into()),
            "a migration past timeout_s is cancelled and the VM runs on here",
        )
    }
}

/// `PUT /api/v1/vm.receive-migration`.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ReceiveMigrationData {
    pub receiver_url: String,
    /// `ca-cert.pem`, `server-cert.pem`, `server-key.pem`.
    pub tls_dir: Option<String>,
    /// `Precopy` or `Postcopy`: the source decides; either is taken.
    pub memory_mode: Option<String>,
    #[serde(default)]
    pub vfio_fds: Option<Value>,
    #[serde(default)]
    pub iommufd_fd: Option<Value>,
    #[serde(default)]
    pub zone_updates: Option<Value>,
}

impl ReceiveMigrationData {
    pub fn check(&self) -> Result<(), ApiError> {
        let none = Value::Null;
        only_default(
            "vfio_fds",
            &self.vfio_fds,
            none.clone(),
            "ferry has no VFIO",
        )?;
        only_default(
            "iommufd_fd",
            &self.iommufd_fd,
            none.clone(),
            "ferry has no VFIO",
        )?;
        only_default(
            "zone_updates",
            &self.zone_updates,
            none,
            "ferry has no memory zones",
        )?;
        memory_mode(self.memory_mode.as_deref()).map(|_| ())
    }
}

/// Whether `memory_mode` asks for post-copy.
pub fn memory_mode(mode: Option<&str>) -> Result<bool, ApiError> {
    match mode {
        None | Some("Precopy") => Ok(false),
        Some("Postcopy") => Ok(true),
        Some(other) => Err(ApiError::bad_request(format!(
            "memory_mode '{other}' (use Precopy or Postcopy)"
        ))),
    }
}

/// `PUT /api/v1/vm.snapshot`.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct VmSnapshotConfig {
    /// `file://DIR`: ferry writes `DIR/ferry.snapshot` there.
    pub destination_url: String,
}

/// `PUT /api/v1/vm.restore`.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct RestoreConfig {
    /// `file://DIR`, a directory `vm.snapshot` wrote.
    pub source_url: String,
    #[serde(default)]
    pub prefault: Option<Value>,
    #[serde(default)]
    pub memory_restore_mode: Option<Value>,
    /// NICs whose new taps come with the request (`SCM_RIGHTS`, in this order), as libvirt
    /// restores a VM on taps it made anew.
    #[serde(default)]
    pub net_fds: Option<Vec<RestoredNet>>,
    #[serde(default)]
    pub vfio_fds: Option<Value>,
    #[serde(default)]
    pub iommufd_fd: Option<Value>,
    /// Run the VM once restored (CH's default: it stays paused).
    #[serde(default)]
    pub resume: bool,
    #[serde(default)]
    pub zone_updates: Option<Value>,
}

/// CH's `RestoredNetConfig`: a restored NIC (`id`) and how many of the files passed with the
/// request are its taps.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct RestoredNet {
    pub id: String,
    #[serde(default)]
    pub num_fds: usize,
    /// Filled in by CH's server from the passed files; a client sends it empty.
    #[serde(default)]
    pub fds: Option<Value>,
}

impl RestoredNet {
    fn check(&self) -> Result<(), ApiError> {
        if self.num_fds != 1 {
            return Err(ApiError::bad_request(format!(
                "net_fds {}: num_fds={}: ferry's NIC has one queue pair, on one tap file",
                self.id, self.num_fds
            )));
        }
        only_default(
            "net_fds.fds",
            &self.fds,
            Value::Null,
            "the files come with the request",
        )
    }
}

impl RestoreConfig {
    pub fn check(&self) -> Result<(), ApiError> {
        only_default(
            "prefault",
            &self.prefault,
            Value::Bool(false),
            "memory is filled as the file is read",
        )?;
        only_default(
            "memory_restore_mode",
            &self.memory_restore_mode,
            Value::String("Copy".into()),
            "ferry restores by copying",
        )?;
        for net in self.net_fds.iter().flatten() {
            net.check()?;
        }
        only_default("vfio_fds", &self.vfio_fds, Value::Null, "ferry has no VFIO")?;
        only_default(
            "iommufd_fd",
            &self.iommufd_fd,
            Value::Null,
            "ferry has no VFIO",
        )?;
        only_default(
            "zone_updates",
            &self.zone_updates,
            Value::Null,
            "ferry has no memory zones",
        )
    }
}

/// The directory a `file://DIR` URL names.
pub fn file_url(field: &str, url: &str) -> Result<std::path::PathBuf, ApiError> {
    url.strip_prefix("file://")
        .filter(|p| !p.is_empty())
        .map(std::path::PathBuf::from)
        .ok_or_else(|| ApiError::bad_request(format!("{field} '{url}' must be file://DIR")))
}

/// `GET /api/v1/vmm.ping`.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct VmmPingResponse {
    pub build_version: String,
    pub version: String,
    pub pid: i64,
    pub features: Vec<String>,
}

/// `GET /api/v1/vm.migration-progress` (ferry's addition to the profile): where the
/// migration is, in libvirt's job-statistics names and units (`virDomainGetJobStats`).
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct JobStats {
    /// libvirt's job type: none, unbounded (running), completed, failed, cancelled.
    pub job: String,
    /// ferry's own phase name (setup, active, switchover, postcopy-active, ...).
    pub phase: String,
    /// source or destination.
    pub role: String,
    /// ms since the migration began (on this host's clock).
    pub time_elapsed: u64,
    /// ms from the request to the first page sent.
    pub setup_time: u64,
    /// ms the VM was paused for the switch (the source's clock), once known.
    pub downtime: Option<u64>,
    /// Guest memory, bytes.
    pub memory_total: u64,
    /// Bytes of guest memory sent so far (as they went on the wire, compressed where they were).
    pub memory_processed: u64,
    /// Bytes of guest memory still to send.
    pub memory_remaining: u64,
    /// Pages the guest dirties per second.
    pub memory_dirty_rate: u64,
    /// The pre-copy round now being sent (0 = the first pass over memory).
    pub memory_iteration: u64,
    /// Bytes per page.
    pub memory_page_size: u64,
    /// Pages sent with their data, and pages sent as zero markers.
    pub memory_normal: u64,
    pub memory_normal_bytes: u64,
    pub memory_constant: u64,
    /// Bytes per second on the wire, now.
    pub memory_bps: u64,
    /// Post-copy: pages the destination asked for.
    pub memory_postcopy_requests: u64,
    /// Disks are shared storage: nothing of them moves.
    pub disk_total: u64,
    pub disk_processed: u64,
    pub disk_remaining: u64,
    /// Why it failed, when it did.
    pub error: Option<String>,
}
