//! What the engine needs from a VM.

use crate::bitmap::Bitmap;
use crate::error::{Error, Result};
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
    /// The VM's config as its VMM keeps it, opaque to the engine (the Cloud Hypervisor
    /// profile's `VmConfig` JSON); None where the VMM keeps none. It travels as `Config`,
    /// after `Hello`.
    pub config: Option<String>,
}

/// A virtio device as the source's VMM was given it, and what a destination's device must
/// match to take its place: the disk's capacity and read-only-ness, what a device offers the
/// guest. A destination told nothing of the devices (Cloud Hypervisor's
/// `vm.receive-migration` and `vm.restore`) builds the same: disks at the same paths (shared
/// storage), NICs on taps of the same names.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DeviceDescriptor {
    Disk {
        path: String,
        readonly: bool,
        /// Its capacity, in 512-byte sectors.
        sectors: u64,
    },
    Net {
        tap: String,
        mac: Option<[u8; 6]>,
        /// The virtio features it offers.
        features: u64,
        queues: u16,
    },
    Balloon {
        target_bytes: u64,
        deflate_on_oom: bool,
        free_page_reporting: bool,
        stats_s: u32,
        /// The virtio features it offers.
        features: u64,
    },
}

impl DeviceDescriptor {
    pub(crate) fn kind(&self) -> &'static str {
        match self {
            DeviceDescriptor::Disk { .. } => "disk",
            DeviceDescriptor::Net { .. } => "NIC",
            DeviceDescriptor::Balloon { .. } => "balloon",
        }
    }

    /// The device here, as its description names it.
    fn here(&self) -> String {
        match self {
            DeviceDescriptor::Disk { path, .. } => format!("this destination's {path}"),
            DeviceDescriptor::Net { tap, .. } => format!("this destination's (tap {tap})"),
            DeviceDescriptor::Balloon { .. } => "this destination's".into(),
        }
    }

    /// How `here`, a destination's device, differs from this one, the VM's, in what the guest
    /// sees: None when it can take its place. Paths, taps and a balloon's target and
    /// statistics period are this host's business (shared storage may be mounted elsewhere;
    /// the target moves with the device's state).
    fn difference(&self, here: &DeviceDescriptor) -> Option<String> {
        use DeviceDescriptor::{Balloon, Disk, Net};
        let theirs = here.here();
        let what = match (self, here) {
            (Disk { sectors: a, .. }, Disk { sectors: b, .. }) if a != b => {
                format!("has {a} sectors, {theirs} has {b}")
            }
            (Disk { readonly: a, .. }, Disk { readonly: b, .. }) if a != b => {
                let rw = |ro: &bool| if *ro { "read-only" } else { "read-write" };
                format!("is {}, {theirs} is {}", rw(a), rw(b))
            }
            (Net { queues: a, .. }, Net { queues: b, .. }) if a != b => {
                format!("has {a} queues, {theirs} has {b}")
            }
            (Net { features: a, .. }, Net { features: b, .. })
            | (Balloon { features: a, .. }, Balloon { features: b, .. })
                if a != b =>
            {
                format!(
                    "offers features {a:#x}, {theirs} {b:#x} (lacking {:#x}, adding {:#x})",
                    a & !b,
                    b & !a
                )
            }
            (Disk { .. }, Disk { .. })
            | (Net { .. }, Net { .. })
            | (Balloon { .. }, Balloon { .. }) => {
                return None;
            }
            _ => {
                return Some(format!(
                    "the VM's is a {}, {theirs} a {}",
                    self.kind(),
                    here.kind()
                ));
            }
        };
        Some(format!("the VM's {} {what}", self.kind()))
    }
}

/// Refuses the devices a destination built (`here`) where they cannot take the place of the
/// VM's (`vm`, in slot order): another count, or a device that differs in what the guest
/// sees, naming the slot, the device and the difference.
pub fn check_devices(vm: &[DeviceDescriptor], here: &[DeviceDescriptor]) -> Result<()> {
    if vm.len() != here.len() {
        let listed = |d: &[DeviceDescriptor]| match d.len() {
            0 => "no virtio device".to_string(),
            n => {
                let kinds: Vec<&str> = d.iter().map(DeviceDescriptor::kind).collect();
                let s = if n == 1 { "" } else { "s" };
                format!("{n} virtio device{s} ({})", kinds.join(", "))
            }
        };
        return Err(Error::vm(format!(
            "the VM has {}, this destination {}: give it the VM's (--disk, --net, --balloon)",
            listed(vm),
            listed(here)
        )));
    }
    for (slot, (theirs, ours)) in vm.iter().zip(here).enumerate() {
        if let Some(why) = theirs.difference(ours) {
            return Err(Error::vm(format!("virtio slot {slot}: {why}")));
        }
    }
    Ok(())
}

/// The files a live update passed: guest RAM (one file per RAM range of the descriptor, in
/// order, each mapped shared from offset 0) and each virtio device's (in slot order).
#[derive(Debug)]
pub struct HandedFiles {
    pub memory: Vec<std::os::fd::OwnedFd>,
    pub devices: Vec<Option<std::os::fd::OwnedFd>>,
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
    /// The switch's last `take_dirty`, the VM paused, added to `into` (a set as long): a VMM
    /// that can saves making a whole bitmap, and protecting the pages again, in the pause. The
    /// pages it reports may be reported again by a later call (after a failed switch).
    fn take_last_dirty(&self, into: &mut Bitmap) -> Result<()> {
        into.merge(&self.take_dirty()?);
        Ok(())
    }
    /// The pages set in `words` (64 a word, from `first_gfn`, a multiple of 64) are about to
    /// be read for sending, the log on and the guest running: the writes to them so far need
    /// not be reported (the send carries them), only those from now on. A VMM that cannot
    /// leaves them in its log: they are sent again.
    fn forget_dirty(&self, _first_gfn: u64, _words: &[u64]) -> Result<()> {
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
    /// take them again. `keep_locks`: a process on this host takes the devices' files over
    /// (a live update): their locks, which the passed files share, stay held throughout.
    fn release_devices(&self, keep_locks: bool) -> Result<()>;
    /// Each virtio device's file a live update passes on, in slot order (a disk's image, a
    /// NIC's tap; `None` for a device without one), valid while the VM lives.
    fn device_files(&self) -> Vec<Option<std::os::fd::RawFd>>;
    /// Auto-converge: every vCPU sleeps `percent` % of its time (0 releases; at most 99).
    fn set_throttle(&self, percent: u8) -> Result<()>;
    /// The time the vCPUs slept for `set_throttle` since the last call, summed over vCPUs
    /// (a VM that cannot tell says none).
    fn take_throttled(&self) -> std::time::Duration {
        std::time::Duration::ZERO
    }
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
    /// Free page hinting (a virtio-balloon's): asks the guest for its free pages under a new
    /// session. The pages it hands over are given back to the host like reported ones (and
    /// logged as written if they held data), and it leaves them unused until
    /// `end_free_page_hints`. False when no driver hints.
    fn start_free_page_hints(&self) -> bool;
    /// Whether the guest handed over all it had for the current session (true without one).
    fn free_page_hints_finished(&self) -> bool;
    /// Hinting is over: the guest may use the pages it hinted again.
    fn end_free_page_hints(&self);
    /// On a source whose disks move with it (`copy_storage`): every virtio disk, each on a
    /// file open for reading, with its writes from now on marked in its log until
    /// `end_disk_logs`.
    fn log_disk_writes(&self) -> Result<Vec<CopiedDisk>>;
    /// The disks' writes are no longer logged.
    fn end_disk_logs(&self);
    /// On a destination whose disks arrive in the stream: the disks of these slots, each
    /// locked here now (refused while another process holds one) and open for writing.
    fn disk_targets(&self, slots: &[u32]) -> Result<Vec<std::fs::File>>;
}

/// A disk whose blocks travel with its VM.
pub struct CopiedDisk {
    /// Its virtio slot.
    pub slot: u32,
    /// Open on the disk's file, for reading.
    pub file: std::fs::File,
    pub bytes: u64,
    /// Where the VMM marks the guest's writes.
    pub log: std::sync::Arc<crate::disk_log::BlockLog>,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn disk(path: &str, readonly: bool, sectors: u64) -> DeviceDescriptor {
        DeviceDescriptor::Disk {
            path: path.into(),
            readonly,
            sectors,
        }
    }

    fn nic(tap: &str, features: u64, queues: u16) -> DeviceDescriptor {
        DeviceDescriptor::Net {
            tap: tap.into(),
            mac: None,
            features,
            queues,
        }
    }

    fn balloon(target_bytes: u64, stats_s: u32, features: u64) -> DeviceDescriptor {
        DeviceDescriptor::Balloon {
            target_bytes,
            deflate_on_oom: true,
            free_page_reporting: false,
            stats_s,
            features,
        }
    }

    fn refusal(vm: &[DeviceDescriptor], here: &[DeviceDescriptor]) -> String {
        check_devices(vm, here).unwrap_err().to_string()
    }

    #[test]
    fn devices_that_differ_only_in_this_hosts_business_are_taken() {
        let vm = [
            disk("/a/d.img", false, 2048),
            nic("t0", 0x1_0000_0020, 2),
            balloon(1 << 20, 1, 0x1_0000_0007),
        ];
        let here = [
            disk("/mnt/elsewhere/d.img", false, 2048),
            nic("tap9", 0x1_0000_0020, 2),
            balloon(0, 5, 0x1_0000_0007),
        ];
        check_devices(&vm, &here).unwrap();
        check_devices(&[], &[]).unwrap();
    }

    #[test]
    fn a_device_that_differs_is_refused_naming_slot_device_and_difference() {
        let vm = [disk("/a/d.img", false, 2_097_152), nic("t0", 0x20, 2)];
        for (here, why) in [
            (
                [disk("/x.img", false, 1_048_576), nic("t0", 0x20, 2)],
                "virtio slot 0: the VM's disk has 2097152 sectors, this destination's /x.img \
                 has 1048576",
            ),
            (
                [disk("/x.img", true, 2_097_152), nic("t0", 0x20, 2)],
                "virtio slot 0: the VM's disk is read-write, this destination's /x.img is \
                 read-only",
            ),
            (
                [disk("/x.img", false, 2_097_152), nic("t1", 0x20, 1)],
                "virtio slot 1: the VM's NIC has 2 queues, this destination's (tap t1) has 1",
            ),
            (
                [disk("/x.img", false, 2_097_152), nic("t1", 0x8, 2)],
                "virtio slot 1: the VM's NIC offers features 0x20, this destination's (tap \
                 t1) 0x8 (lacking 0x20, adding 0x8)",
            ),
            (
                [nic("t1", 0x20, 2), disk("/x.img", false, 2_097_152)],
                "virtio slot 0: the VM's is a disk, this destination's (tap t1) a NIC",
            ),
        ] {
            assert!(refusal(&vm, &here).contains(why), "{}", refusal(&vm, &here));
        }
        let e = refusal(&[balloon(0, 1, 0x7)], &[balloon(0, 1, 0x3)]);
        assert!(
            e.contains(
                "virtio slot 0: the VM's balloon offers features 0x7, this \
                 destination's 0x3 (lacking 0x4, adding 0x0)"
            ),
            "{e}"
        );
        let e = refusal(&vm, &vm[..1]);
        assert!(
            e.contains(
                "the VM has 2 virtio devices (disk, NIC), this destination 1 virtio device \
                 (disk)"
            ),
            "{e}"
        );
        let e = refusal(&[balloon(0, 1, 0x7)], &[]);
        assert!(
            e.contains("the VM has 1 virtio device (balloon), this destination no virtio device"),
            "{e}"
        );
    }
}
