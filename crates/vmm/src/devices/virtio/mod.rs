//! virtio devices on the virtio-mmio transport (virtio 1.x, modern only). The transport
//! (`mmio`) owns the registers and the queues (rust-vmm's `virtio-queue`); a device
//! (`block`) only says what it offers and serves the requests of a notified queue.
//!
//! A driver's `QueueNotify` signals the queue's ioeventfd in KVM, and the device's I/O thread
//! serves the queue (`DeviceBus::serve_events`); where KVM takes no ioeventfd, the vCPU thread
//! that wrote it does. Either way a request is served whole under the device's lock, and a
//! pause takes that lock before the vCPUs park: no request is half done when the VM stops, so
//! a device's state at a pause is its registers, its queues' indices and its own few fields —
//! nothing in flight to carry or re-issue.

pub mod balloon;
pub mod block;
pub mod mmio;
pub mod net;
pub mod tap;
#[cfg(test)]
pub(crate) mod test_driver;

use virtio_queue::Queue;
use virtio_queue::desc::split::Descriptor;

use crate::memory::GuestMemory;

/// Where virtio-mmio devices sit: 4 KiB slots from the start of the 32-bit MMIO hole.
pub const SLOT_SIZE: u64 = 0x1000;
pub const MAX_SLOTS: usize = 8;
/// IOAPIC pins for the slots' interrupts (16 and up: the legacy ISA pins stay free).
pub const FIRST_GSI: u32 = 16;

/// The register window of the device in `slot`.
pub fn slot_base(slot: usize) -> u64 {
    crate::layout::DEVICE_WINDOW_START + slot as u64 * SLOT_SIZE
}

/// The IOAPIC pin of the device in `slot`.
pub fn slot_gsi(slot: usize) -> u32 {
    FIRST_GSI + slot as u32
}

/// How ferry's workload guest learns of the device in `slot`: Linux's virtio-mmio
/// command-line word (Linux itself is told by the ACPI DSDT).
pub fn cmdline_word(slot: usize) -> String {
    format!(
        " virtio_mmio.device=4K@{:#x}:{}",
        slot_base(slot),
        slot_gsi(slot)
    )
}

/// Serves at most a queue's worth of the chains the driver made available (a driver that
/// keeps adding cannot keep the device, and a pause waiting for it, here for ever; it notifies
/// again for the rest): `serve` gets each chain's buffers and returns the bytes it wrote into
/// them. True when the used ring changed.
pub(super) fn serve_chains(
    queue: &mut Queue,
    memory: &GuestMemory,
    log: &mut dyn WriteLog,
    mut serve: impl FnMut(&[Descriptor], &mut dyn WriteLog) -> Result<u32, DriverError>,
) -> Result<bool, DriverError> {
    each_chain(queue, memory, |queue, head, descs| {
        let written = serve(descs, log)?;
        complete(queue, memory, head, written, log)?;
        Ok(true)
    })
}

/// Takes at most a queue's worth of the chains the driver made available, each to `take`
/// with its head and buffers (to give back now or later). True when any `take` said the used
/// ring changed.
pub(super) fn each_chain(
    queue: &mut Queue,
    memory: &GuestMemory,
    mut take: impl FnMut(&mut Queue, u16, &[Descriptor]) -> Result<bool, DriverError>,
) -> Result<bool, DriverError> {
    use virtio_queue::QueueT;
    let mut used = false;
    for _ in 0..queue.size() {
        let Some(chain) = queue.pop_descriptor_chain(memory) else {
            break;
        };
        let head = chain.head_index();
        let descs: Vec<Descriptor> = chain.collect();
        used |= take(queue, head, &descs)?;
    }
    Ok(used)
}

/// Copies a device's configuration space (`config`, little-endian) from `offset` into
/// `data`; bytes past it read as zero.
pub(super) fn read_config_bytes(config: &[u8], offset: u64, data: &mut [u8]) {
    for (i, b) in data.iter_mut().enumerate() {
        *b = config.get(offset as usize + i).copied().unwrap_or(0);
    }
}

/// Gives a served chain back to the driver; the used ring's change is the device's write.
pub(super) fn complete(
    queue: &mut Queue,
    memory: &GuestMemory,
    head: u16,
    len: u32,
    log: &mut dyn WriteLog,
) -> Result<(), DriverError> {
    use virtio_queue::QueueT;
    queue
        .add_used(memory, head, len)
        .map_err(|e| DriverError(format!("cannot fill the used ring: {e}")))?;
    // flags, idx, the ring and the avail event.
    log.wrote(queue.used_ring(), 6 + 8 * usize::from(queue.size()));
    Ok(())
}

/// A driver's buffer the device cannot reach.
pub(super) fn outside(gpa: u64, len: usize) -> DriverError {
    DriverError(format!(
        "a buffer at {gpa:#x} ({len} bytes) lies outside guest RAM"
    ))
}

/// Pages a device wrote into guest memory: dirty for migration like the guest's own writes.
pub trait WriteLog {
    fn wrote(&mut self, gpa: u64, len: usize);
}

/// Why a device gave up on its queue: the driver programmed it wrongly. The transport then
/// sets `DEVICE_NEEDS_RESET` and serves nothing more until the driver resets it.
#[derive(Debug)]
pub struct DriverError(pub String);

/// A virtio device. Its own state beyond the transport's (a NIC's MAC) moves with the VM
/// through its `Persist` implementation (`Component` is implemented for every one).
pub trait VirtioDevice: Send + crate::persist::Component {
    /// `VIRTIO_ID_*`.
    fn device_type(&self) -> u32;
    /// Every feature offered, `VIRTIO_F_VERSION_1` included.
    fn features(&self) -> u64;
    /// The largest size of each queue.
    fn queue_max_sizes(&self) -> &[u16];
    /// Reads device configuration space from `offset`.
    fn read_config(&self, offset: u64, data: &mut [u8]);
    /// Serves what the driver made available on queue `index`; true when the used ring
    /// changed (the driver may want an interrupt).
    fn process(
        &mut self,
        index: usize,
        queues: &mut [Queue],
        memory: &GuestMemory,
        log: &mut dyn WriteLog,
    ) -> Result<bool, DriverError>;
    /// Stops using the backing store (the VM is switching to another host); nothing to do
    /// for a device without one. `keep_lock`: another process on this host takes the file
    /// over (a live update), and the lock its passed copy shares stays held.
    fn release(&mut self, _keep_lock: bool) -> std::io::Result<()> {
        Ok(())
    }
    /// The file a live update passes to the next process (a disk's image, a NIC's tap).
    fn file(&self) -> Option<std::os::fd::RawFd> {
        None
    }
    /// Takes the backing store (again) before the VM runs here; refused when another
    /// process holds it.
    fn claim(&mut self) -> std::io::Result<()> {
        Ok(())
    }
    /// A disk marks its writes in `log` from now on (`None`: no longer), for a migration
    /// that copies it; false for a device that writes no disk.
    fn log_writes(&mut self, _log: Option<std::sync::Arc<migration::disk_log::BlockLog>>) -> bool {
        false
    }
    /// What a destination's device must match to take this one's place (and what an empty
    /// VMM builds it from): its configuration and what it offers the guest.
    fn descriptor(&self) -> migration::DeviceDescriptor;
    /// Counters for status displays: (name, value).
    fn counters(&self) -> Vec<(&'static str, u64)>;
    /// The file behind the device, if any.
    fn backing(&self) -> Option<&std::path::Path> {
        None
    }
    /// What it is attached to, for status displays.
    fn describe(&self) -> String;
    /// Whether the guest can change what lies behind the device (a writable disk).
    fn writable(&self) -> bool {
        false
    }
    /// A backend that delivers input on its own (a tap): the fd to wait on, polled by the
    /// device's I/O thread, which then calls `input`. None for a device that only answers.
    fn input_fd(&self) -> Option<std::os::fd::RawFd> {
        None
    }
    /// Delivers what the backend has into the driver's buffers; true when a used ring changed.
    /// `Ok(false)` with input left over means the driver has no buffer yet (it gets the input
    /// when it posts one: `process` delivers too).
    fn input(
        &mut self,
        _queues: &mut [Queue],
        _memory: &GuestMemory,
        _log: &mut dyn WriteLog,
    ) -> Result<bool, DriverError> {
        Ok(false)
    }
    /// Whether input waits for a driver buffer (the I/O thread then naps instead of polling).
    fn input_pending(&self) -> bool {
        false
    }
    /// Whether the last `process` of queue `index` ended its turn with work left: its I/O
    /// thread lets go of the device (so that API calls and pauses get in) and comes back.
    fn unfinished(&mut self, _index: usize) -> bool {
        false
    }
    /// Takes a driver's write into configuration space (read-only unless the device says
    /// otherwise: a balloon's `actual`).
    fn write_config(&mut self, _offset: u64, _data: &[u8]) {}
    /// The features the driver accepted (at `FEATURES_OK`); a device whose queues depend on
    /// them (a balloon's) learns here which it serves.
    fn set_driver_features(&mut self, _features: u64) {}
    /// The driver reset the device: what it handed over (a buffer the device holds) is
    /// forgotten.
    fn reset(&mut self) {}
    /// The device as `Any`, for controls of one kind of device (a balloon's target).
    fn as_any_mut(&mut self) -> &mut dyn std::any::Any;
}
