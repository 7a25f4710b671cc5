//! One VM: KVM objects, guest memory, vCPU threads and devices, and what can be done to it.

mod balloon;

use migration::sync::Locked;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Arc, Mutex};

use kvm_bindings::{
    CpuId, KVM_MAX_CPUID_ENTRIES, KVM_MEM_LOG_DIRTY_PAGES, KVM_PIT_SPEAKER_DUMMY, kvm_pit_config,
    kvm_userspace_memory_region,
};
use kvm_ioctls::{Kvm, VcpuFd, VmFd};
use migration::bitmap::{Bitmap, CHUNK_WORDS};
use vm_memory::{Address, Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryRegion};
use vmm_sys_util::eventfd::{EFD_NONBLOCK, EventFd};

use crate::cpuid::{self, CpuModel};
use crate::devices::virtio::VirtioDevice;
use crate::devices::virtio::balloon::{Balloon, BalloonConfig};
use crate::devices::virtio::block::{Block, DiskConfig};
use crate::devices::virtio::mmio::MmioTransport;
use crate::devices::virtio::net::{Net, NetConfig};
use crate::devices::virtio::{self, MAX_SLOTS, WriteLog};
use crate::devices::{DeviceBus, DeviceSlot, HeartbeatDevice, SerialDevice, serial};
use crate::dirty_log::Protect;
use crate::error::{Error, Result, kvm};
use crate::memory::{GuestMemory, MemoryBackend, create_guest_memory, guest_memory_from_files};
use crate::persist::{Component, Fragment, Fragments, Persist};
use crate::state;
use crate::vcpu::{VcpuSet, VmEvent};
use crate::{acpi, boot};

const TSS_ADDRESS: usize = 0xfffb_d000;
/// The most guest memory one KVM memory slot spans: RAM is registered in slots of this size,
/// so that reading the dirty log costs what the slots that hold data span (a slot's log is
/// 512 KiB), not what the guest has. Not less: turning dirty logging on costs a KVM call per
/// slot.
const SLOT_SPAN: u64 = 16 << 30;

/// How `Vm::populated` finds the pages that hold data.
#[derive(Clone, Copy)]
enum Populated {
    Fresh,
    Grown,
}
pub const MAX_VCPUS: usize = 16;
/// How long a VM about to run waits for a disk another process still holds.
const CLAIM_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

/// What to boot.
#[derive(Clone, Debug)]
pub enum BootImage {
    /// An ELF with a PVH entry note (ferry's workload guest, or any PVH kernel).
    Pvh(std::path::PathBuf),
    /// A Linux bzImage or vmlinux, with an optional initrd.
    Linux {
        kernel: std::path::PathBuf,
        initrd: Option<std::path::PathBuf>,
    },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum VmState {
    Running,
    Paused,
}

/// A component of a VM whose state moves with it (the vCPUs aside).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Part {
    Irqchip,
    Pit,
    Clock,
    Serial,
    Heartbeat,
    Virtio(usize),
}

impl Part {
    /// The name its fragment travels under.
    fn name(self) -> String {
        match self {
            Part::Irqchip => state::Irqchip::NAME.into(),
            Part::Pit => state::Pit::NAME.into(),
            Part::Clock => state::Clock::NAME.into(),
            Part::Serial => SerialDevice::NAME.into(),
            Part::Heartbeat => HeartbeatDevice::NAME.into(),
            Part::Virtio(slot) => format!("virtio.{slot}"),
        }
    }

    /// KVM's own, loaded before the vCPUs.
    fn in_kernel(self) -> bool {
        matches!(self, Part::Irqchip | Part::Pit | Part::Clock)
    }
}

#[derive(Clone, Debug)]
pub struct VmConfig {
    pub memory: u64,
    pub vcpus: usize,
    pub backend: MemoryBackend,
    /// virtio-blk disks, in slot order.
    pub disks: Vec<DiskConfig>,
    /// virtio-net NICs, in the slots after the disks.
    pub nets: Vec<NetConfig>,
    /// A virtio-balloon, in the slot after the NICs.
    pub balloon: Option<BalloonConfig>,
    /// What CPUID advertises to a booted VM (an arriving one keeps its source's).
    pub cpu_model: CpuModel,
}

impl VmConfig {
    /// virtio-mmio devices, one slot each.
    pub fn virtio_devices(&self) -> usize {
        self.disks.len() + self.nets.len() + usize::from(self.balloon.is_some())
    }

    /// The machine the ACPI tables describe: the vCPUs and each virtio-mmio slot.
    pub fn machine(&self) -> acpi::Machine {
        let virtio = (0..self.virtio_devices())
            .map(|slot| acpi::MmioDevice {
                base: virtio::slot_base(slot),
                size: virtio::SLOT_SIZE,
                gsi: virtio::slot_gsi(slot),
            })
            .collect();
        acpi::Machine {
            vcpus: self.vcpus,
            virtio,
        }
    }
}

/// A virtio device as status displays show it.
#[derive(Clone, Debug)]
pub struct DeviceInfo {
    pub slot: usize,
    pub address: u64,
    /// `VIRTIO_ID_*`.
    pub kind: u32,
    /// What it is attached to.
    pub describe: String,
    pub counters: Vec<(&'static str, u64)>,
    /// The backing file, for a disk.
    pub path: Option<std::path::PathBuf>,
    /// Whether the guest can change what lies behind it.
    pub writable: bool,
    /// Why it stopped serving (it asked the driver for a reset), if it did.
    pub broken: Option<String>,
}

/// A snapshot of what the VM is doing, for status displays.
#[derive(Clone, Debug)]
pub struct VmInfo {
    pub state: VmState,
    pub memory: u64,
    pub vcpus: usize,
    pub heartbeats: u64,
    pub progress: Vec<crate::devices::Progress>,
    pub total: crate::devices::Progress,
    pub verify_errors: u64,
    pub verify_error_pages: Vec<u64>,
    pub blk_error_sectors: Vec<u64>,
    pub max_heartbeat_gap_ns: u64,
    pub observed_downtime_ns: Option<u64>,
}

pub struct Vm {
    fd: VmFd,
    memory: GuestMemory,
    vcpus: VcpuSet,
    bus: Arc<DeviceBus>,
    msrs: Vec<u32>,
    /// The CPU model this host's KVM gives a guest (read back from a vCPU: KVM completes what
    /// was set); a migrated model is checked against it.
    supported_cpuid: CpuId,
    /// Who protects pages again once their dirty bit was read (see `dirty_log`).
    dirty_protect: Protect,
    config: VmConfig,
    /// Whether the vCPUs run: read without waiting (status queries must never queue behind a
    /// pause that waits for a device or a vCPU).
    running: AtomicBool,
    /// Serialises pause and resume.
    transition: Mutex<()>,
    events: Mutex<Receiver<VmEvent>>,
    /// One buffer per KVM memory slot for reading its dirty log (reused: see `dirty_log`).
    dirty_buffers: Mutex<Vec<Vec<u64>>>,
    /// The pages that held data at the last harvest (kept: a fresh bitmap of every page
    /// costs a fault per 4 KiB of it, inside the pause).
    populated: Mutex<Bitmap>,
    /// The VM's config as the VMM's profile keeps it (the Cloud Hypervisor profile's
    /// `VmConfig` JSON), which a migration carries to the destination (`Config`).
    profile_config: Mutex<Option<String>>,
}

/// KVM objects made, vCPUs not yet started.
struct Parts {
    fd: VmFd,
    memory: GuestMemory,
    vcpu_fds: Vec<VcpuFd>,
    bus: Arc<DeviceBus>,
    msrs: Vec<u32>,
    supported_cpuid: CpuId,
    /// What the CPU model hides that KVM showed the vCPUs all the same.
    not_honoured: Vec<cpuid::Feature>,
    dirty_protect: Protect,
}

impl Vm {
    /// Boots `image` with its command line; the boot vCPU runs when this returns, and the
    /// others wait for the guest to start them (INIT/SIPI).
    pub fn boot(
        config: VmConfig,
        image: &BootImage,
        cmdline: &str,
        serial: serial::Output,
    ) -> Result<Self> {
        let parts = Parts::create(&config, serial, true, None)?;
        let machine = config.machine();
        // Where KVM did not hide what the model hides, Linux is told not to use it.
        let linux_cmdline = format!("{cmdline}{}", cpuid::linux_words(&parts.not_honoured));
        let entry = match image {
            BootImage::Pvh(path) => {
                boot::load_pvh(&parts.memory, config.memory, path, cmdline, &machine)?
            }
            BootImage::Linux { kernel, initrd } => boot::load_linux(
                &parts.memory,
                config.memory,
                kernel,
                initrd.as_deref(),
                &linux_cmdline,
                &machine,
            )?,
        };
        let bsp = &parts.vcpu_fds[0];
        let sregs = bsp.get_sregs().map_err(kvm("KVM_GET_SREGS"))?;
        bsp.set_sregs(&boot::entry_sregs(entry, sregs))
            .map_err(kvm("KVM_SET_SREGS"))?;
        bsp.set_regs(&boot::entry_regs(entry))
            .map_err(kvm("KVM_SET_REGS"))?;
        for vcpu in &parts.vcpu_fds {
            set_fpu_defaults(vcpu)?;
        }
        Self::start(config, parts, false)
    }

    /// The boot structures ferry wrote for a guest, read back (tests and tools).
    pub fn read_boot_bytes(&self, gpa: u64, len: usize) -> Result<Vec<u8>> {
        let mut v = vec![0u8; len];
        self.read_guest(gpa, &mut v)?;
        Ok(v)
    }

    /// An empty VM, vCPUs parked, waiting for memory and state (a migration or a snapshot).
    pub fn for_restore(config: VmConfig, serial: serial::Output) -> Result<Self> {
        let parts = Parts::create(&config, serial, false, None)?;
        Self::start(config, parts, true)
    }

    /// An arriving VM: empty (`for_restore`), or on the files a live update passed
    /// (`for_handover`).
    pub fn arriving(
        config: VmConfig,
        serial: serial::Output,
        files: Option<migration::HandedFiles>,
    ) -> Result<Self> {
        match files {
            Some(files) => Self::for_handover(config, serial, files),
            None => Self::for_restore(config, serial),
        }
    }

    /// A VM a live update hands over, vCPUs parked, waiting for its state: its memory and its
    /// devices' files are the ones `files` passed (memory as it is, with every page).
    pub fn for_handover(
        config: VmConfig,
        serial: serial::Output,
        files: migration::HandedFiles,
    ) -> Result<Self> {
        let parts = Parts::create(&config, serial, false, Some(files))?;
        Self::start(config, parts, true)
    }

    fn start(config: VmConfig, parts: Parts, paused: bool) -> Result<Self> {
        let (tx, rx): (Sender<VmEvent>, _) = channel();
        if paused {
            parts.bus.quiesce().map_err(Error::State)?; // nothing runs yet: immediate
        }
        let vcpus = VcpuSet::start(parts.vcpu_fds, &parts.memory, &parts.bus, &tx, paused)?;
        parts.bus.spawn_io_threads(&parts.memory)?;
        let buffers = dirty_buffers(&kvm_slots(&parts.memory));
        Ok(Self {
            fd: parts.fd,
            memory: parts.memory,
            vcpus,
            bus: parts.bus,
            msrs: parts.msrs,
            supported_cpuid: parts.supported_cpuid,
            dirty_protect: parts.dirty_protect,
            config,
            running: AtomicBool::new(!paused),
            transition: Mutex::new(()),
            events: Mutex::new(rx),
            dirty_buffers: Mutex::new(buffers),
            populated: Mutex::new(Bitmap::new(0)),
            profile_config: Mutex::new(None),
        })
    }

    pub fn memory(&self) -> &GuestMemory {
        &self.memory
    }
    pub fn config(&self) -> &VmConfig {
        &self.config
    }

    /// What a migration of this VM carries as its config (`Config`): the profile's, kept
    /// up to date by the profile before it sends the VM.
    pub fn keep_profile_config(&self, config: Option<String>) {
        *self.profile_config.locked() = config;
    }

    pub fn profile_config(&self) -> Option<String> {
        self.profile_config.locked().clone()
    }
    pub fn state(&self) -> VmState {
        if self.running.load(Ordering::Acquire) {
            VmState::Running
        } else {
            VmState::Paused
        }
    }

    /// Auto-converge: every vCPU sleeps `percent` % of its time (0 releases).
    pub fn set_throttle(&self, percent: u8) -> Result<()> {
        self.vcpus.set_throttle(percent)
    }

    /// The time the vCPUs slept for the throttle since the last call, summed over vCPUs.
    pub fn take_throttled(&self) -> std::time::Duration {
        self.vcpus.take_throttled()
    }

    /// Parks every vCPU with complete state. Pausing a paused VM is a no-op.
    pub fn pause(&self) -> Result<()> {
        let _transition = self.transition.locked();
        if self.running.load(Ordering::Acquire) {
            self.bus.quiesce().map_err(Error::State)?;
            if let Err(e) = self.vcpus.pause() {
                self.bus.unquiesce();
                return Err(e);
            }
            self.running.store(false, Ordering::Release);
        }
        Ok(())
    }

    /// Runs the vCPUs, after taking the disks back if a migration let go of them (refused,
    /// and the VM stays paused, while another process holds one).
    pub fn resume(&self) -> Result<()> {
        self.claim_devices()?;
        let _transition = self.transition.locked();
        self.vcpus.resume();
        self.bus.unquiesce();
        self.running.store(true, Ordering::Release);
        Ok(())
    }

    /// Waits for the next event from the guest or a vCPU, up to `timeout`.
    pub fn next_event(&self, timeout: std::time::Duration) -> Option<VmEvent> {
        let rx = self.events.locked();
        rx.recv_timeout(timeout).ok()
    }

    pub fn heartbeat(&self) -> std::sync::MutexGuard<'_, HeartbeatDevice> {
        self.bus.heartbeat.locked()
    }

    pub fn info(&self) -> VmInfo {
        let hb = self.heartbeat();
        VmInfo {
            state: self.state(),
            memory: self.config.memory,
            vcpus: self.config.vcpus,
            heartbeats: hb.count(),
            progress: hb.vcpus().to_vec(),
            total: hb.total(),
            verify_errors: hb.verify_errors(),
            verify_error_pages: hb.verify_error_pages().to_vec(),
            blk_error_sectors: hb.blk_error_sectors().to_vec(),
            max_heartbeat_gap_ns: hb.max_gap_ns(),
            observed_downtime_ns: hb.observed_downtime_ns(),
        }
    }

    /// Each RAM range of the memory map with its host mapping, in guest-physical order (KVM's
    /// memory slots cut the larger ones further: `kvm_slots`).
    pub fn ram_regions(&self) -> Vec<(migration::RamRange, *mut u8)> {
        regions_of(&self.memory)
    }

    /// The file each RAM region maps from its start (`None` for anonymous memory, and for a
    /// region that maps a file from elsewhere: the engine's file scan assumes offset 0), in
    /// `ram_regions` order.
    pub fn ram_files(&self) -> Vec<Option<std::os::fd::RawFd>> {
        use std::os::fd::AsRawFd;
        self.memory
            .iter()
            .map(|r| {
                r.file_offset()
                    .filter(|f| f.start() == 0)
                    .map(|f| f.file().as_raw_fd())
            })
            .collect()
    }

    /// Writes guest memory as a device would, recording the pages as dirty.
    pub fn write_guest(&self, gpa: u64, data: &[u8]) -> Result<()> {
        self.memory
            .write_slice(data, GuestAddress(gpa))
            .map_err(|e| Error::Memory(e.to_string()))?;
        let mut dirty = self.bus.vmm_writes.locked();
        dirty.wrote(gpa, data.len());
        Ok(())
    }

    pub fn read_guest(&self, gpa: u64, data: &mut [u8]) -> Result<()> {
        self.memory
            .read_slice(data, GuestAddress(gpa))
            .map_err(|e| Error::Memory(e.to_string()))
    }

    /// Adds the pages the VMM wrote since the last call to `into` (if given), and forgets them.
    pub fn drain_vmm_writes(&self, into: Option<&mut Bitmap>) {
        let mut written = self.bus.vmm_writes.locked();
        if let Some(into) = into {
            into.merge(&written);
        }
        written.clear();
    }

    /// Turns KVM dirty logging on or off for all guest memory.
    pub fn set_dirty_logging(&self, on: bool) -> Result<()> {
        let slots = kvm_slots(&self.memory);
        for (slot, &(range, host)) in slots.iter().enumerate() {
            let flags = if on { KVM_MEM_LOG_DIRTY_PAGES } else { 0 };
            // SAFETY: the region is our own live mapping of exactly this size.
            unsafe {
                self.fd
                    .set_user_memory_region(slot_region(slot, range, host, flags))
            }
            .map_err(kvm("KVM_SET_USER_MEMORY_REGION"))?;
        }
        if on && self.dirty_protect == Protect::ManualInitiallySet {
            // Every bit starts set and nothing is protected: protect what holds data now (what
            // the first round sends), chunk by chunk; the bits of pages never touched stay set
            // (`take_dirty_log`).
            let populated = self.populated(Populated::Fresh)?;
            for (slot, &(range, _)) in slots.iter().enumerate() {
                each_chunk_in(&populated, range, |first_page, words| {
                    crate::dirty_log::clear(&self.fd, slot as u32, first_page, words)
                })
                .map_err(|e| Error::State(format!("KVM_CLEAR_DIRTY_LOG: {e}")))?;
            }
        }
        Ok(())
    }

    /// Returns and resets the pages the guest dirtied since the last call: one bit per guest
    /// page number, every slot's log in its place.
    ///
    /// A log that started all set (`Protect::ManualInitiallySet`) keeps the bits of pages
    /// never touched: they are read as dirty only once they hold data (populated now), so a
    /// round sends what the guest wrote, never what it never touched. A page the guest first
    /// touches after the scan keeps its bit, and the next call finds it.
    pub fn take_dirty_log(&self) -> Result<Bitmap> {
        let end = self.ram_regions().last().map_or(0, |(r, _)| r.end_gfn());
        let mut dirty = Bitmap::new(end);
        self.take_dirty_log_into(&mut dirty)?;
        Ok(dirty)
    }

    /// `take_dirty_log`, added to `dirty` (a bitmap of every guest page).
    pub fn take_dirty_log_into(&self, dirty: &mut Bitmap) -> Result<()> {
        let (read, slots) = self.harvest_into(dirty, true)?;
        tracing::trace!("dirty log: read {read} of {slots} slots");
        Ok(())
    }

    /// Clears the log's bits of the pages set in `words` (64 a word, from `first_gfn`, a
    /// multiple of 64) and protects those pages again: their writes so far are forgotten
    /// (`Migratable::forget_dirty`). Without manual protection reading the log does that.
    pub fn forget_dirty_log(&self, first_gfn: u64, words: &[u64]) -> Result<()> {
        if self.dirty_protect == Protect::OnRead {
            return Ok(());
        }
        let end = first_gfn + 64 * words.len() as u64;
        for (slot, &(range, _)) in kvm_slots(&self.memory).iter().enumerate() {
            let (from, to) = (first_gfn.max(range.first_gfn()), end.min(range.end_gfn()));
            if from >= to {
                continue;
            }
            // Slots begin on a multiple of 64 pages, so `from` keeps a word's alignment.
            let span =
                &words[((from - first_gfn) / 64) as usize..(to - first_gfn).div_ceil(64) as usize];
            if span.iter().any(|&w| w != 0) {
                crate::dirty_log::clear(&self.fd, slot as u32, from - range.first_gfn(), span)
                    .map_err(|e| Error::State(format!("KVM_CLEAR_DIRTY_LOG: {e}")))?;
            }
        }
        Ok(())
    }

    /// The switch's last harvest, into `dirty`, the VM paused: the pages it reports are not
    /// protected again, which on a host with a shadow MMU walks every mapping of each page
    /// inside the downtime. Their bits stay set in KVM's log (manual protection), so a
    /// harvest after a failed switch resumes the guest reports them again.
    pub fn take_last_dirty_log_into(&self, dirty: &mut Bitmap) -> Result<()> {
        self.require_paused("take the last dirty log")?;
        self.harvest_into(dirty, false).map(drop)
    }

    /// `take_dirty_log_into`, protecting the pages read again where `protect`; returns how many
    /// slots' logs it read, and of how many.
    fn harvest_into(&self, dirty: &mut Bitmap, protect: bool) -> Result<(usize, usize)> {
        let slots = kvm_slots(&self.memory);
        let populated = match self.dirty_protect {
            Protect::ManualInitiallySet => Some(self.populated(Populated::Grown)?),
            _ => None,
        };
        let mut buffers = self.dirty_buffers.locked();
        if buffers.len() != slots.len() {
            *buffers = dirty_buffers(&slots);
        }
        let protect = protect && self.dirty_protect != Protect::OnRead;
        let mut read = 0;
        for (slot, (&(range, _), bitmap)) in slots.iter().zip(buffers.iter_mut()).enumerate() {
            let first_word = (range.first_gfn() / 64) as usize;
            if let Some(populated) = populated.as_ref()
                && !populated.any_chunk_in(first_word, bitmap.len())
            {
                continue; // never touched: its bits stay set in KVM's log, unread
            }
            crate::dirty_log::get(&self.fd, slot as u32, bitmap)
                .map_err(|e| Error::State(format!("KVM_GET_DIRTY_LOG: {e}")))?;
            read += 1;
            // Stretch by stretch, so that what this costs follows the memory that holds data:
            // a slot's log is 512 KiB, nearly all of it the set bits of pages never touched
            // where the slot holds a little data.
            for (i, span) in bitmap.chunks_mut(CHUNK_WORDS).enumerate() {
                let span_word = first_word + i * CHUNK_WORDS;
                let first_page = (i * CHUNK_WORDS * 64) as u64;
                if let Some(populated) = populated.as_ref() {
                    if !populated.any_chunk_in(span_word, span.len()) {
                        continue; // never touched: its bits stay set in KVM's log
                    }
                    populated.mask(span_word, span);
                }
                if span.iter().all(|&w| w == 0) {
                    continue;
                }
                if protect {
                    crate::dirty_log::clear(&self.fd, slot as u32, first_page, span)
                        .map_err(|e| Error::State(format!("KVM_CLEAR_DIRTY_LOG: {e}")))?;
                }
                dirty.merge_words_at(range.first_gfn() + first_page, span);
            }
        }
        Ok((read, slots.len()))
    }

    /// The pages of guest memory that hold data, in the map `populated` keeps: found anew
    /// (`Fresh`, as the log is turned on) or grown by what was populated since (`Grown`, as a
    /// harvest reads it: only pages outside the map are looked at, `scan::grow_populated`, so
    /// the pause's harvest does not walk again all the memory that holds data; the pages of
    /// the map had their bits cleared, so a bit set there is a write).
    fn populated(&self, how: Populated) -> Result<std::sync::MutexGuard<'_, Bitmap>> {
        let mut map = self.populated.locked();
        let ram = migration::Migratable::ram(self);
        match how {
            Populated::Fresh => migration::scan::populated_pages_into(&ram, &mut map),
            Populated::Grown => migration::scan::grow_populated(&ram, &mut map),
        }
        .map_err(|e| Error::State(format!("finding populated memory: {e}")))?;
        Ok(map)
    }

    /// Saves every vCPU, a fragment each; the VM must be paused.
    pub fn save_vcpus_state(&self) -> Result<Vec<Fragment>> {
        self.require_paused("save vCPU state")?;
        (0..self.config.vcpus)
            .map(|cpu| {
                self.with_vcpu(cpu, |v| v.save_as(state::Vcpu::NAME))
                    .map_err(|e| Error::State(format!("vCPU {cpu}: {e}")))
            })
            .collect()
    }

    /// Saves every component but the vCPUs, a fragment each; the VM must be paused.
    pub fn save_devices_state(&self) -> Result<Fragments> {
        self.require_paused("save device state")?;
        let saved = self.parts().into_iter().map(|part| {
            self.with_part(part, |c| c.save_as(&part.name()))
                .map_err(Error::State)
        });
        Ok(Fragments(saved.collect::<Result<_>>()?))
    }

    /// Loads state saved by `save_vcpus_state`/`save_devices_state` (of a VM with this shape):
    /// KVM's own components first, then the vCPUs, then the devices.
    pub fn restore(&self, vcpus: &[Fragment], devices: &Fragments) -> Result<()> {
        self.require_paused("restore state")?;
        if vcpus.len() != self.config.vcpus {
            return Err(Error::State(format!(
                "state has {} vCPUs, this VM {}",
                vcpus.len(),
                self.config.vcpus
            )));
        }
        let parts = self.parts();
        let names: Vec<String> = parts.iter().map(|p| p.name()).collect();
        devices.check(&names).map_err(Error::State)?;
        let (in_kernel, ours): (Vec<Part>, Vec<Part>) =
            parts.into_iter().partition(|p| p.in_kernel());
        self.load_parts(&in_kernel, devices)?;
        for (cpu, f) in vcpus.iter().enumerate() {
            self.with_vcpu(cpu, |v| v.load_from(f))
                .map_err(|e| Error::State(format!("vCPU {cpu}: {e}")))?;
        }
        self.load_parts(&ours, devices)?;
        // The state may hold requests the driver announced to a VMM that never served them
        // (its notification was read, then the VM paused): every queue is served once when
        // the VM runs.
        self.bus.notify_all_queues();
        Ok(())
    }

    /// Loads each of `parts` from its fragment (`Fragments::check` found them all).
    fn load_parts(&self, parts: &[Part], devices: &Fragments) -> Result<()> {
        for &part in parts {
            let name = part.name();
            let fragment = devices
                .get(&name)
                .ok_or_else(|| Error::State(format!("the state has no fragment {name}")))?;
            self.with_part(part, |c| c.load_from(fragment))
                .map_err(Error::State)?;
        }
        Ok(())
    }

    /// The components whose state moves with the VM, in the order they are saved.
    fn parts(&self) -> Vec<Part> {
        let fixed = [
            Part::Irqchip,
            Part::Pit,
            Part::Clock,
            Part::Serial,
            Part::Heartbeat,
        ];
        let virtio = (0..self.bus.virtio.len()).map(Part::Virtio);
        fixed.into_iter().chain(virtio).collect()
    }

    /// Calls `f` with `part`, locked where it is shared.
    fn with_part<R>(&self, part: Part, f: impl FnOnce(&mut dyn Component) -> R) -> R {
        match part {
            Part::Irqchip => f(&mut state::Irqchip(&self.fd)),
            Part::Pit => f(&mut state::Pit(&self.fd)),
            Part::Clock => f(&mut state::Clock(&self.fd)),
            Part::Serial => f(&mut *self.bus.serial.locked()),
            Part::Heartbeat => f(&mut *self.heartbeat()),
            Part::Virtio(slot) => f(&mut *self.bus.virtio[slot].lock()),
        }
    }

    /// Calls `f` with vCPU `cpu`, its thread parked.
    fn with_vcpu<R>(&self, cpu: usize, f: impl FnOnce(&mut state::Vcpu<'_>) -> R) -> R {
        let fd = self.vcpus.lock_fd(cpu);
        f(&mut state::Vcpu {
            fd: &fd,
            msrs: &self.msrs,
            supported: &self.supported_cpuid,
        })
    }

    /// Flushes every disk and lets go of it: the VM is about to run on another host (or, with
    /// `keep_locks`, in another process on this one, which shares the disks' locks).
    pub fn release_devices(&self, keep_locks: bool) -> Result<()> {
        for d in &self.bus.virtio {
            d.lock()
                .device_mut()
                .release(keep_locks)
                .map_err(|e| Error::State(format!("releasing a disk: {e}")))?;
        }
        Ok(())
    }

    /// Every disk, its writes logged from now on (`copy_storage`).
    pub fn log_disk_writes(&self) -> Result<Vec<migration::CopiedDisk>> {
        self.bus.log_disk_writes().map_err(Error::State)
    }

    pub fn end_disk_logs(&self) {
        self.bus.end_disk_logs();
    }

    /// This host's disks in `slots`, locked and open for what arrives (`copy_storage`).
    pub fn disk_targets(&self, slots: &[u32]) -> Result<Vec<std::fs::File>> {
        self.bus.disk_targets(slots).map_err(Error::State)
    }

    /// Takes every disk (again) before the VM runs here; refused while another process holds
    /// one. A destination that just gave up lets go of its disks as its process ends, so a
    /// held lock is asked for again for up to `CLAIM_WAIT`.
    pub fn claim_devices(&self) -> Result<()> {
        for d in &self.bus.virtio {
            let deadline = std::time::Instant::now() + CLAIM_WAIT;
            loop {
                let claimed = d.lock().device_mut().claim();
                match claimed {
                    Ok(()) => break,
                    Err(e)
                        if e.kind() == std::io::ErrorKind::WouldBlock
                            && std::time::Instant::now() < deadline =>
                    {
                        std::thread::sleep(std::time::Duration::from_millis(50));
                    }
                    Err(e) => return Err(Error::State(e.to_string())),
                }
            }
        }
        Ok(())
    }

    /// Each virtio device's file a live update passes on, in slot order.
    pub fn device_files(&self) -> Vec<Option<std::os::fd::RawFd>> {
        self.bus
            .virtio
            .iter()
            .map(|d| d.lock().device().file())
            .collect()
    }

    /// Each virtio device as a destination must match it, in slot order.
    pub fn device_descriptors(&self) -> Vec<migration::DeviceDescriptor> {
        let describe = |d: &DeviceSlot| d.lock().device().descriptor();
        self.bus.virtio.iter().map(describe).collect()
    }

    /// Each virtio device's kind, counters and why it stopped serving, if it did.
    pub fn device_info(&self) -> Vec<DeviceInfo> {
        self.bus
            .virtio
            .iter()
            .enumerate()
            .map(|(slot, d)| {
                let d = d.lock();
                let (by_eventfd, by_exit) = self.bus.notifications(slot);
                let mut counters = d.device().counters();
                counters.push(("notifies_by_eventfd", by_eventfd));
                counters.push(("notifies_by_exit", by_exit));
                DeviceInfo {
                    describe: d.device().describe(),
                    slot,
                    address: virtio::slot_base(slot),
                    kind: d.device().device_type(),
                    counters,
                    path: d.device().backing().map(std::path::Path::to_path_buf),
                    writable: d.device().writable(),
                    broken: d.broken().map(str::to_string),
                }
            })
            .collect()
    }

    fn require_paused(&self, what: &str) -> Result<()> {
        if self.state() != VmState::Paused {
            return Err(Error::State(format!("cannot {what}: the VM is running")));
        }
        Ok(())
    }

    /// Stops every vCPU and I/O thread and lets go of the disks, flushed: the VM cannot run
    /// again, and a VM booted next (a reboot) takes the disks at once, though a client may
    /// still hold this one. A disk a thread left behind may still write stays locked.
    pub fn shutdown(&self) {
        self.bus.stop();
        self.vcpus.stop();
        if !self.bus.join_io_threads() {
            return;
        }
        if let Err(e) = self.release_devices(false) {
            tracing::warn!("the VM shut down, but {e}");
        }
    }
}

impl Drop for Vm {
    fn drop(&mut self) {
        self.bus.join_io_threads();
    }
}

impl Parts {
    /// `claim_disks`: take the disks' locks now (a VM booting here; one arriving takes them as
    /// its state is loaded).
    /// `handed`: the memory and device files a live update passed, used instead of new ones.
    fn create(
        config: &VmConfig,
        serial_out: serial::Output,
        claim_disks: bool,
        handed: Option<migration::HandedFiles>,
    ) -> Result<Self> {
        if config.vcpus == 0 || config.vcpus > MAX_VCPUS {
            return Err(Error::Vcpu {
                cpu: 0,
                reason: format!("vCPU count must be 1..={MAX_VCPUS}, not {}", config.vcpus),
            });
        }
        let kvm_sys = Kvm::new().map_err(Error::Kvm)?;
        let fd = kvm_sys.create_vm().map_err(kvm("KVM_CREATE_VM"))?;
        let (memory, mut device_files) = match handed {
            Some(h) => {
                let files = h.memory.into_iter().map(std::fs::File::from).collect();
                let memory = guest_memory_from_files(config.memory, files)?;
                (memory, Some(h.devices.into_iter()))
            }
            None => (create_guest_memory(config.memory, config.backend)?, None),
        };
        for (slot, (range, host)) in kvm_slots(&memory).into_iter().enumerate() {
            // SAFETY: the mapping lives as long as the VM (both are owned by `Vm`).
            unsafe { fd.set_user_memory_region(slot_region(slot, range, host, 0)) }
                .map_err(kvm("KVM_SET_USER_MEMORY_REGION"))?;
        }
        if let Err(e) = fd.set_tss_address(TSS_ADDRESS) {
            tracing::debug!("KVM_SET_TSS_ADDR: {e} (not needed on every KVM)");
        }
        fd.create_irq_chip().map_err(kvm("KVM_CREATE_IRQCHIP"))?;
        fd.create_pit2(kvm_pit_config {
            flags: KVM_PIT_SPEAKER_DUMMY,
            ..Default::default()
        })
        .map_err(kvm("KVM_CREATE_PIT2"))?;

        let irq = EventFd::new(EFD_NONBLOCK)?;
        fd.register_irqfd(&irq, serial::IRQ)
            .map_err(kvm("KVM_IRQFD"))?;
        if config.virtio_devices() > MAX_SLOTS {
            return Err(Error::Config(format!(
                "at most {MAX_SLOTS} devices (disks, NICs and a balloon), not {}",
                config.virtio_devices()
            )));
        }
        // A live update passes a file for each disk and NIC, in slot order.
        let mut passed = || -> Result<Option<std::fs::File>> {
            let Some(files) = device_files.as_mut() else {
                return Ok(None);
            };
            match files.next() {
                Some(Some(fd)) => Ok(Some(fd.into())),
                _ => Err(Error::Config(
                    "a live update passed no file for a disk or NIC".into(),
                )),
            }
        };
        let mut devices: Vec<Box<dyn VirtioDevice>> = Vec::new();
        for disk in &config.disks {
            let block = match passed()? {
                Some(file) => Block::on(disk, file, claim_disks),
                None => Block::open(disk, claim_disks),
            };
            devices.push(Box::new(block.map_err(Error::Config)?));
        }
        for net in &config.nets {
            let nic = match passed()? {
                Some(file) => Net::on_file(net, file, claim_disks),
                None => Net::open(net, claim_disks),
            };
            devices.push(Box::new(nic.map_err(Error::Config)?));
        }
        if let Some(balloon) = &config.balloon {
            devices.push(Box::new(Balloon::new(balloon).map_err(Error::Config)?));
        }
        let mut virtio = Vec::new();
        let mut notifiers = Vec::new();
        for (slot, device) in devices.into_iter().enumerate() {
            let irq = EventFd::new(EFD_NONBLOCK)?;
            fd.register_irqfd(&irq, virtio::slot_gsi(slot))
                .map_err(kvm("KVM_IRQFD"))?;
            notifiers.push(queue_notifiers(&fd, slot, device.queue_max_sizes().len())?);
            virtio.push(MmioTransport::new(device, irq));
        }
        let gfn_end = crate::layout::ram_ranges(config.memory)
            .last()
            .map_or(0, |r| r.end_gfn());
        let bus = Arc::new(DeviceBus::new(
            SerialDevice::new(irq, serial_out)?,
            HeartbeatDevice::new(config.vcpus),
            virtio,
            notifiers,
            gfn_end,
        )?);

        let supported = kvm_sys
            .get_supported_cpuid(KVM_MAX_CPUID_ENTRIES)
            .map_err(kvm("KVM_GET_SUPPORTED_CPUID"))?;
        let model = config.cpu_model.apply(&supported);
        let mut vcpu_fds = Vec::new();
        for i in 0..config.vcpus {
            let vcpu = fd.create_vcpu(i as u64).map_err(kvm("KVM_CREATE_VCPU"))?;
            vcpu.set_cpuid2(&cpuid_for(&model, i as u32))
                .map_err(kvm("KVM_SET_CPUID2"))?;
            vcpu_fds.push(vcpu);
        }
        let msrs = state::migratable_msrs(&kvm_sys, &vcpu_fds[0])?;
        let got = vcpu_fds[0]
            .get_cpuid2(KVM_MAX_CPUID_ENTRIES)
            .map_err(kvm("KVM_GET_CPUID2"))?;
        let not_honoured = config.cpu_model.not_honoured(&got);
        if !not_honoured.is_empty() {
            let names: Vec<&str> = not_honoured.iter().map(|f| f.name).collect();
            tracing::info!(
                "KVM put back CPU features the {} model hides: {}",
                config.cpu_model,
                names.join(" ")
            );
        }
        let dirty_protect = crate::dirty_log::enable_manual_protect(&fd);
        tracing::debug!("KVM dirty log protection: {dirty_protect:?}");
        Ok(Self {
            fd,
            memory,
            vcpu_fds,
            bus,
            msrs,
            supported_cpuid: cpuid::providable(&supported, &got),
            not_honoured,
            dirty_protect,
        })
    }
}

/// KVM's memory slots: each region of `memory` cut into pieces of at most `SLOT_SPAN`, as a
/// RAM range and its host address; the index is the slot's number.
fn kvm_slots(memory: &GuestMemory) -> Vec<(migration::RamRange, *mut u8)> {
    let piece = |(range, host): (migration::RamRange, *mut u8), offset: u64| {
        let len = (range.len - offset).min(SLOT_SPAN);
        let gpa = range.gpa + offset;
        // Within the region's mapping (`offset` < its length).
        let host = if host.is_null() {
            host
        } else {
            host.wrapping_add(offset as usize)
        };
        (migration::RamRange { gpa, len }, host)
    };
    regions_of(memory)
        .into_iter()
        .flat_map(|region| {
            (0..region.0.len)
                .step_by(SLOT_SPAN as usize)
                .map(move |o| piece(region, o))
        })
        .collect()
}

/// Each region of `memory` as a RAM range and its host address.
fn regions_of(memory: &GuestMemory) -> Vec<(migration::RamRange, *mut u8)> {
    memory
        .iter()
        .map(|r| {
            let range = migration::RamRange {
                gpa: r.start_addr().raw_value(),
                len: r.len(),
            };
            let host = r
                .get_host_address(vm_memory::MemoryRegionAddress(0))
                .unwrap_or(std::ptr::null_mut());
            (range, host)
        })
        .collect()
}

fn slot_region(
    slot: usize,
    range: migration::RamRange,
    host: *mut u8,
    flags: u32,
) -> kvm_userspace_memory_region {
    kvm_userspace_memory_region {
        slot: slot as u32,
        flags,
        guest_phys_addr: range.gpa,
        memory_size: range.len,
        userspace_addr: host as u64,
    }
}

/// One eventfd per queue of the device in `slot`, which KVM signals when the driver writes the
/// queue's index to `QueueNotify`: the write completes in the kernel, without an exit to the
/// VMM, and the device's I/O thread serves the queue. A KVM that refuses leaves that device's
/// notifications to the vCPU thread (an MMIO exit, served there).
fn queue_notifiers(fd: &VmFd, slot: usize, queues: usize) -> Result<Vec<EventFd>> {
    use kvm_ioctls::IoEventAddress;
    let notify = virtio::slot_base(slot) + u64::from(virtio::mmio::QUEUE_NOTIFY);
    let addr = IoEventAddress::Mmio(notify);
    let mut fds: Vec<EventFd> = Vec::new();
    for queue in 0..queues as u32 {
        let evt = EventFd::new(EFD_NONBLOCK)?;
        if let Err(e) = fd.register_ioevent(&evt, &addr, queue) {
            tracing::debug!("KVM_IOEVENTFD for virtio device {slot}: {e}; notified by exits");
            // All or none: a queue whose eventfd were gone would never be served.
            for (registered, evt) in fds.iter().enumerate() {
                let _ = fd.unregister_ioevent(evt, &addr, registered as u32);
            }
            return Ok(Vec::new());
        }
        fds.push(evt);
    }
    Ok(fds)
}

/// The model's CPUID with this vCPU's APIC ID filled in.
fn cpuid_for(supported: &CpuId, apic_id: u32) -> CpuId {
    let mut cpuid = supported.clone();
    for entry in cpuid.as_mut_slice() {
        match entry.function {
            1 => entry.ebx = (entry.ebx & 0x00ff_ffff) | (apic_id << 24),
            0xb | 0x1f => entry.edx = apic_id,
            _ => {}
        }
    }
    cpuid
}

/// x87 control word and MXCSR as after reset; KVM leaves them zero.
fn set_fpu_defaults(vcpu: &VcpuFd) -> Result<()> {
    let fpu = kvm_bindings::kvm_fpu {
        fcw: 0x37f,
        mxcsr: 0x1f80,
        ..Default::default()
    };
    vcpu.set_fpu(&fpu).map_err(kvm("KVM_SET_FPU"))
}

/// Calls `f(first page in the slot, words)` for each chunk of `map` inside `range` that has a
/// bit set (a range's first page is a multiple of 64, as every RAM range starts on a 2 MiB
/// boundary): what KVM is told costs what the map holds, not what the range spans.
fn each_chunk_in(
    map: &Bitmap,
    range: migration::RamRange,
    mut f: impl FnMut(u64, &[u64]) -> std::io::Result<()>,
) -> std::io::Result<()> {
    let first = (range.first_gfn() / 64) as usize;
    let end = first + range.pages().div_ceil(64) as usize;
    for (start, chunk) in map.chunks() {
        let (lo, hi) = (start.max(first), (start + chunk.len()).min(end));
        if lo < hi && chunk[lo - start..hi - start].iter().any(|&w| w != 0) {
            f((lo - first) as u64 * 64, &chunk[lo - start..hi - start])?;
        }
    }
    Ok(())
}

/// A buffer per slot for KVM's dirty log (one bit per page), made and faulted in with the
/// VM: a migration then reads the log into memory that is already there.
fn dirty_buffers(slots: &[(migration::RamRange, *mut u8)]) -> Vec<Vec<u64>> {
    slots
        .iter()
        .map(|(range, _)| {
            let mut words = vec![0u64; range.pages().div_ceil(64) as usize];
            // Write one word a page: `vec!` of zeros leaves the pages untouched.
            words.iter_mut().step_by(512).for_each(|w| *w = 0);
            words
        })
        .collect()
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use kvm_bindings::{Msrs, kvm_msr_entry};

    /// Whether this host has KVM; says so loudly when not (the calling test then skips).
    pub(crate) fn kvm_here() -> bool {
        let here = std::path::Path::new("/dev/kvm").exists();
        if !here {
            eprintln!("*** no /dev/kvm: skipped ***");
        }
        here
    }

    /// The smallest VM a test builds: 64 MiB, one vCPU, no devices.
    pub(crate) fn bare_config() -> VmConfig {
        VmConfig {
            memory: 64 << 20,
            vcpus: 1,
            backend: MemoryBackend::Anonymous,
            disks: Vec::new(),
            nets: Vec::new(),
            balloon: None,
            cpu_model: CpuModel::Host,
        }
    }

    const MSR_TSC_DEADLINE: u32 = 0x6e0;
    const LVT_TIMER: usize = 0x320;
    const TSC_DEADLINE_MODE: u32 = 2 << 17;

    fn tsc_deadline(fd: &VcpuFd) -> u64 {
        let mut msrs = Msrs::from_entries(&[kvm_msr_entry {
            index: MSR_TSC_DEADLINE,
            ..Default::default()
        }])
        .unwrap();
        assert_eq!(fd.get_msrs(&mut msrs).unwrap(), 1);
        msrs.as_slice()[0].data
    }

    /// A harvest reads the log of the slots that hold data, stretch by stretch where memory
    /// holds data, and skips the rest: a page first touched after logging began is still
    /// found, in a stretch or a slot that held data or in one that held none, once; a page
    /// never touched, never; a slot that never held data is not read. The switch's last
    /// harvest leaves what it read in the log; a write forgotten before a send is not read.
    #[test]
    fn the_dirty_log_finds_first_touches_in_any_stretch_once() {
        if !kvm_here() {
            return;
        }
        let config = VmConfig {
            memory: 37 << 30, // 3 GiB below the hole, 34 GiB above it: slots of 16, 16, 2
            ..bare_config()
        };
        let vm = Vm::for_restore(config, Box::new(std::io::sink())).unwrap();
        crate::memory::use_small_pages(&vm.memory);
        if vm.dirty_protect != Protect::ManualInitiallySet {
            eprintln!("*** KVM's dirty log cannot start all set here: skipped ***");
            return;
        }
        let regions = vm.ram_regions();
        assert_eq!(regions.len(), 2, "memory around the hole");
        assert_eq!(
            kvm_slots(&vm.memory).len(),
            4,
            "the high region in three slots"
        );
        let high = regions[1].0.first_gfn();
        let touch = |gfn: u64| vm.write_guest(gfn * 4096, &[0xa5]).unwrap();
        touch(256);
        vm.set_dirty_logging(true).unwrap();
        let harvest = || {
            let end = regions[1].0.end_gfn();
            let mut dirty = Bitmap::new(end);
            let read = vm.harvest_into(&mut dirty, true).unwrap();
            (dirty.iter().collect::<Vec<u64>>(), read)
        };
        let nothing = Vec::<u64>::new();
        assert_eq!(
            harvest(),
            (nothing.clone(), (1, 4)),
            "only the low slot holds data"
        );
        // Page 3 shares page 256's stretch; the others lie in stretches and slots that held
        // nothing (the last in the last slot; the slot between them stays untouched).
        let first_touches = [3, 51_200, 51_201, high + 4097, high + (33 << 18) + 5];
        first_touches.into_iter().for_each(touch);
        assert_eq!(harvest(), (first_touches.to_vec(), (3, 4)));
        assert_eq!(
            harvest(),
            (nothing.clone(), (3, 4)),
            "each first touch is read once"
        );
        // The switch's last harvest (paused) protects nothing again: what it read stays in
        // the log, for a harvest after a failed switch.
        touch(7);
        let last = || {
            let mut dirty = Bitmap::new(regions[1].0.end_gfn());
            vm.take_last_dirty_log_into(&mut dirty).unwrap();
            dirty.iter().collect::<Vec<u64>>()
        };
        assert_eq!((last(), last()), (vec![7], vec![7]));
        assert_eq!(harvest(), (vec![7], (3, 4)));
        assert_eq!(harvest(), (nothing, (3, 4)));
        // Writes a send is about to carry are forgotten, in either region; the others not.
        [9, 11, high + 70].into_iter().for_each(touch);
        vm.forget_dirty_log(0, &[1 << 9]).unwrap();
        vm.forget_dirty_log(high + 64, &[1 << 6]).unwrap();
        assert_eq!(harvest(), (vec![11], (3, 4)));
        vm.set_dirty_logging(false).unwrap();
    }

    /// KVM's own components pass the devices' harness (`persist::assert_round_trip`) on a
    /// VM, each first set to what a fresh VM does not hold.
    #[test]
    fn kvms_components_round_trip() {
        if !kvm_here() {
            return;
        }
        let config = bare_config();
        let src = Vm::for_restore(config.clone(), Box::new(std::io::sink())).unwrap();
        let dst = Vm::for_restore(config, Box::new(std::io::sink())).unwrap();
        let mut chip = state::Irqchip(&src.fd).save().unwrap();
        // SAFETY: a union of plain integers; the IOAPIC's redirection entry 3 is masked.
        unsafe { chip.ioapic.chip.ioapic.redirtbl[3].bits = 0x1_0000 | 0x31 };
        chip.pic_master.chip.pic.imr = 0xa5;
        state::Irqchip(&src.fd).load(chip).unwrap();
        let mut pit = state::Pit(&src.fd).save().unwrap();
        pit.channels[2].count = 1193;
        pit.channels[2].mode = 3;
        state::Pit(&src.fd).load(pit).unwrap();
        let mut clock = state::Clock(&src.fd).save().unwrap();
        clock.clock += 1 << 40;
        state::Clock(&src.fd).load(clock).unwrap();
        src.with_part(Part::Irqchip, |from| {
            dst.with_part(Part::Irqchip, |twin| {
                crate::persist::assert_round_trip(from, twin)
            })
        });
        // KVM stamps each PIT channel with the host's time as it is loaded.
        crate::persist::assert_round_trip_but(
            &state::Pit(&src.fd),
            &mut state::Pit(&dst.fd),
            |pit| pit.channels.iter_mut().for_each(|c| c.count_load_time = 0),
        );
        // kvmclock runs on from what was loaded: read back a moment later, it is a moment on.
        let saved = state::Clock(&src.fd).save().unwrap();
        state::Clock(&dst.fd).load(saved).unwrap();
        let loaded = state::Clock(&dst.fd).save().unwrap();
        let ahead = loaded.clock.wrapping_sub(saved.clock);
        assert!(ahead < 1_000_000_000, "kvmclock {ahead} ns on");
    }

    /// What a real guest would miss after a move: an armed TSC-deadline timer (KVM drops the
    /// MSR when it is written before the LAPIC is in deadline mode), the CPU model, the TSC
    /// rate. Each is read back from a VM restored from the saved state.
    #[test]
    fn tsc_deadline_cpu_model_and_tsc_rate_survive_a_restore() {
        if !kvm_here() {
            return;
        }
        let config = bare_config();
        let src = Vm::for_restore(config.clone(), Box::new(std::io::sink())).unwrap();
        let deadline = 1u64 << 50;
        {
            let fd = src.vcpus.lock_fd(0);
            let mut lapic = fd.get_lapic().unwrap();
            let lvt = TSC_DEADLINE_MODE | 0xec;
            for (i, b) in lvt.to_le_bytes().iter().enumerate() {
                lapic.regs[LVT_TIMER + i] = *b as _;
            }
            fd.set_lapic(&lapic).unwrap();
            let msrs = Msrs::from_entries(&[kvm_msr_entry {
                index: MSR_TSC_DEADLINE,
                data: deadline,
                ..Default::default()
            }])
            .unwrap();
            assert_eq!(fd.set_msrs(&msrs).unwrap(), 1);
            assert_eq!(tsc_deadline(&fd), deadline, "armed on the source");
        }
        let vcpus = src.save_vcpus_state().unwrap();
        let devices = src.save_devices_state().unwrap();
        let vcpu0: state::VcpuState = crate::persist::from_bytes(&vcpus[0].bytes).unwrap();
        assert!(vcpu0.msrs.iter().any(|m| m.index == MSR_TSC_DEADLINE));
        let dst = Vm::for_restore(config, Box::new(std::io::sink())).unwrap();
        dst.restore(&vcpus, &devices).unwrap();
        // A state without a component's fragment is refused before anything loads, naming it.
        let mut short = devices.clone();
        short.0.retain(|f| f.name != "serial");
        let e = dst.restore(&vcpus, &short).unwrap_err();
        assert!(e.to_string().contains("no fragment serial"), "{e}");
        let fd = dst.vcpus.lock_fd(0);
        assert_eq!(
            tsc_deadline(&fd),
            deadline,
            "the deadline survives the restore"
        );
        let cpuid = fd.get_cpuid2(KVM_MAX_CPUID_ENTRIES).unwrap();
        assert_eq!(cpuid.as_slice(), &vcpu0.cpuid[..], "the same CPU model");
        assert_eq!(fd.get_tsc_khz().ok(), vcpu0.tsc_khz, "the same TSC rate");

        // A model this host cannot offer is refused, naming what is missing.
        let mut alien = vcpu0.cpuid.clone();
        let leaf1 = alien.iter_mut().find(|e| e.function == 1).unwrap();
        leaf1.edx = u32::MAX; // every leaf-1 EDX bit, reserved ones too: no host offers them
        let e = state::check_cpuid(&alien, &dst.supported_cpuid).unwrap_err();
        assert!(e.to_string().contains("CPUID leaf 0x1"), "{e}");
    }
}
