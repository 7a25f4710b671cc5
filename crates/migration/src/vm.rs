//! What the engine needs from a VM.

use crate::bitmap::Bitmap;
use crate::error::Result;
use crate::memory::{GuestRam, RamRange};

/// The shape a destination must build before any page arrives.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VmDescriptor {
    pub memory_bytes: u64,
    /// Where RAM lies in guest-physical memory; the destination builds the same.
    pub ranges: Vec<RamRange>,
    pub vcpus: u32,
    /// "anonymous" or "memfd".
    pub memory_backend: String,
    /// Whether the VM ran on the source: a VM its user paused arrives paused.
    pub running: bool,
    /// Its virtio devices in slot order, as the source was given them.
    pub devices: Vec<DeviceDescriptor>,
}

/// A virtio device as the source's VMM was given it. A destination told nothing of the
/// devices (Cloud Hypervisor's `vm.receive-migration` and `vm.restore`) builds the same:
/// disks at the same paths (shared storage), NICs on taps of the same names.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DeviceDescriptor {
    Disk {
        path: String,
        readonly: bool,
    },
    Net {
        tap: String,
        mac: Option<[u8; 6]>,
    },
    Balloon {
        target_bytes: u64,
        deflate_on_oom: bool,
        free_page_reporting: bool,
        stats_s: u32,
    },
}

/// What the guest lived through across a migration, as the destination's VMM saw it.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct GuestReport {
    /// The largest heartbeat gap across the switch.
    pub observed_downtime_ns: Option<u64>,
    /// The guest's work rate over the first moment after it resumed.
    pub pages_per_s_after: Option<f64>,
}

/// The operations a migration performs on a VM. Every method is required: there is no
/// default that silently migrates nothing.
pub trait Migratable: Send + Sync {
    fn descriptor(&self) -> VmDescriptor;
    fn ram(&self) -> GuestRam;
    /// Whether the vCPUs run now (not paused by the user or by a migration).
    fn is_running(&self) -> bool;
    /// Starts tracking guest writes; the first `take_dirty` reports writes since this call.
    fn start_dirty_log(&self) -> Result<()>;
    /// Pages written since the last call (by the guest or by the VMM), and resets the set:
    /// a bitmap over guest page numbers, `ram().gfn_end()` long.
    fn take_dirty(&self) -> Result<Bitmap>;
    /// `take_dirty`, added to `into` (a set as long): a VMM that can saves making a whole
    /// bitmap where it counts, in the pause.
    fn take_dirty_into(&self, into: &mut Bitmap) -> Result<()> {
        into.merge(&self.take_dirty()?);
        Ok(())
    }
    fn stop_dirty_log(&self) -> Result<()>;
    /// Parks every vCPU with complete state.
    fn pause(&self) -> Result<()>;
    /// Runs the vCPUs; takes the devices' backing stores (disks) first if they were let go,
    /// and refuses while another process holds one.
    fn resume(&self) -> Result<()>;
    /// The VM is paused and about to leave: every device's writes made durable and its
    /// backing store let go, so that the destination can take it. `load_state` and `resume`
    /// take them again.
    fn release_devices(&self) -> Result<()>;
    /// Auto-converge: every vCPU sleeps `percent` % of its time (0 releases; at most 99).
    fn set_throttle(&self, percent: u8) -> Result<()>;
    /// Serialised state of each vCPU, in vCPU order; the VM must be paused.
    fn save_vcpus(&self) -> Result<Vec<Vec<u8>>>;
    /// Serialised state of everything besides memory and vCPUs.
    fn save_devices(&self) -> Result<Vec<u8>>;
    /// Loads what `save_vcpus`/`save_devices` produced on the source, and takes the devices'
    /// backing stores (refused while another process holds one).
    fn load_state(&self, vcpus: &[Vec<u8>], devices: &[u8]) -> Result<()>;
    /// The guest's own work rate (e.g. pages touched per second) between two host times in
    /// ns since the epoch, when the guest reports progress; for application degradation.
    fn guest_progress_rate(&self, from_ns: u64, to_ns: u64) -> Option<f64>;
    /// On a destination, a moment after resuming: what the guest saw of the migration.
    fn guest_report(&self, resumed_at_ns: u64, window_ns: u64) -> GuestReport;
    /// Post-copy registered guest memory for missing-page faults (`true`), or let go of it
    /// (`false`). Meanwhile the VMM must give no guest page back to the host (a balloon's
    /// discard would make a page the engine installed missing again, and its next touch would
    /// wait for an answer that never comes); it may give them back once let go.
    fn hold_page_discards(&self, hold: bool);
    /// The pages the guest gave back to the host (a balloon's inflations and free page
    /// reports), a bitmap as `take_dirty`'s; `None` if it gave none. For the report: those
    /// not populated when a migration looks are counted as skipped because free.
    fn given_back(&self) -> Option<Bitmap>;
}
