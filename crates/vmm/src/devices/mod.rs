//! Devices emulated in ferry: on port I/O the serial port and the heartbeat device, on MMIO
//! virtio devices (PIC, IOAPIC and PIT live in KVM).

pub mod heartbeat;
pub mod serial;
pub mod virtio;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use migration::wire::bitmap::Bitmap;

use crate::layout::DEVICE_WINDOW_START;
use crate::memory::GuestMemory;
pub use heartbeat::{GuestEvent, HeartbeatDevice, HeartbeatState, Progress};
pub use serial::{SerialDevice, SerialDeviceState};
use virtio::mmio::MmioTransport;
use virtio::{SLOT_SIZE, WriteLog};

/// The longest a pause waits for a device to finish what it is doing.
const QUIESCE_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

/// The devices vCPU threads reach, on port I/O and MMIO. Each device has its own lock so that
/// serial output never waits behind a heartbeat, a disk request or the reverse.
pub struct DeviceBus {
    pub serial: Mutex<SerialDevice>,
    pub heartbeat: Mutex<HeartbeatDevice>,
    /// virtio-mmio devices, slot by slot from `DEVICE_WINDOW_START`.
    pub virtio: Vec<Mutex<MmioTransport>>,
    /// Pages the VMM itself wrote (device emulation): dirty for migration like guest writes.
    pub vmm_writes: Mutex<Bitmap>,
    /// Set while the VM is paused: devices' I/O threads deliver nothing into guest memory.
    quiesced: AtomicBool,
    /// Set when the VM stops for good: the I/O threads end.
    stopped: AtomicBool,
}

/// What one device call wrote into guest memory, collected before it joins `vmm_writes`.
#[derive(Default)]
struct Written(Vec<(u64, usize)>);

impl WriteLog for Written {
    fn wrote(&mut self, gpa: u64, len: usize) {
        self.0.push((gpa, len));
    }
}

impl WriteLog for Bitmap {
    fn wrote(&mut self, gpa: u64, len: usize) {
        let end = (gpa + len as u64).div_ceil(4096).min(self.pages());
        for pfn in gpa / 4096..end {
            self.set(pfn);
        }
    }
}

impl DeviceBus {
    pub fn new(
        serial: SerialDevice,
        heartbeat: HeartbeatDevice,
        virtio: Vec<MmioTransport>,
        gfn_end: u64,
    ) -> Self {
        Self {
            serial: Mutex::new(serial),
            heartbeat: Mutex::new(heartbeat),
            virtio: virtio.into_iter().map(Mutex::new).collect(),
            vmm_writes: Mutex::new(Bitmap::new(gfn_end)),
            quiesced: AtomicBool::new(false),
            stopped: AtomicBool::new(false),
        }
    }

    /// Stops input into guest memory; returns once no device is delivering any. The VM is
    /// about to pause: from here on its memory changes only by its vCPUs, which stop next. A
    /// device busy for longer than `QUIESCE_WAIT` (in post-copy, waiting for a page the link
    /// does not bring) makes the pause fail rather than wait for ever.
    pub fn quiesce(&self) -> Result<(), String> {
        self.quiesced.store(true, Ordering::Release);
        for (slot, d) in self.virtio.iter().enumerate() {
            let deadline = std::time::Instant::now() + QUIESCE_WAIT;
            loop {
                match d.try_lock() {
                    Ok(_) | Err(std::sync::TryLockError::Poisoned(_)) => break,
                    Err(std::sync::TryLockError::WouldBlock) => {}
                }
                if std::time::Instant::now() > deadline {
                    self.unquiesce();
                    return Err(format!(
                        "virtio device {slot} stayed busy for {QUIESCE_WAIT:?}; not paused"
                    ));
                }
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
        }
        Ok(())
    }

    pub fn unquiesce(&self) {
        self.quiesced.store(false, Ordering::Release);
    }

    pub fn stop(&self) {
        self.stopped.store(true, Ordering::Release);
    }

    /// Starts an I/O thread for each device whose backend delivers input (a tap).
    pub fn spawn_io_threads(self: &Arc<Self>, memory: &GuestMemory) -> std::io::Result<()> {
        for (slot, d) in self.virtio.iter().enumerate() {
            let Some(fd) = d
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .device()
                .input_fd()
            else {
                continue;
            };
            let (bus, memory) = (self.clone(), memory.clone());
            std::thread::Builder::new()
                .name(format!("virtio-io-{slot}"))
                .spawn(move || bus.serve_input(slot, fd, &memory))?;
        }
        Ok(())
    }

    /// Waits on the backend's fd and delivers what comes, while the VM runs.
    fn serve_input(&self, slot: usize, fd: std::os::fd::RawFd, memory: &GuestMemory) {
        let mut poll = libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        };
        while !self.stopped.load(Ordering::Acquire) {
            // SAFETY: one valid pollfd; a bounded wait so that `stopped` is seen.
            unsafe { libc::poll(&mut poll, 1, 20) };
            let delivered = {
                let mut d = self.virtio[slot].lock().unwrap_or_else(|e| e.into_inner());
                let mut written = Written::default();
                let delivered =
                    !self.quiesced.load(Ordering::Acquire) && d.input(memory, &mut written);
                self.log(written);
                delivered
            };
            if !delivered {
                // The VM is paused, or the driver has no buffer (or is not serving the
                // device): the input waits in the backend's queue; look again shortly instead
                // of spinning on a ready fd.
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
        }
    }

    /// The virtio device whose slot holds `addr`, and the offset in it.
    fn virtio_at(&self, addr: u64) -> Option<(&Mutex<MmioTransport>, u64)> {
        let offset = addr.checked_sub(DEVICE_WINDOW_START)?;
        let slot = (offset / SLOT_SIZE) as usize;
        self.virtio.get(slot).map(|d| (d, offset % SLOT_SIZE))
    }

    pub fn mmio_read(&self, addr: u64, data: &mut [u8]) {
        match self.virtio_at(addr) {
            Some((d, offset)) => d
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .read(offset, data),
            None => data.fill(0xff), // nothing there: reads float high
        }
    }

    pub fn mmio_write(&self, addr: u64, data: &[u8], memory: &GuestMemory) {
        if let Some((d, offset)) = self.virtio_at(addr) {
            let mut written = Written::default();
            d.lock()
                .unwrap_or_else(|e| e.into_inner())
                .write(offset, data, memory, &mut written);
            self.log(written);
        }
    }

    /// Adds what a device wrote to the VMM's writes (a short lock: never held while a device
    /// serves, so a dirty-log harvest never waits behind a disk request).
    fn log(&self, written: Written) {
        if written.0.is_empty() {
            return;
        }
        let mut all = self.vmm_writes.lock().unwrap_or_else(|e| e.into_inner());
        for (gpa, len) in written.0 {
            all.wrote(gpa, len);
        }
    }

    pub fn port_out(
        &self,
        cpu: usize,
        port: u16,
        data: &[u8],
        memory: &GuestMemory,
    ) -> Option<GuestEvent> {
        if serial::PORTS.contains(&port) {
            let mut serial = self.serial.lock().unwrap_or_else(|e| e.into_inner());
            serial.port_out(port, data);
            None
        } else if heartbeat::PORTS.contains(&port) {
            let mut hb = self.heartbeat.lock().unwrap_or_else(|e| e.into_inner());
            hb.port_out(cpu, port, data, memory)
        } else {
            None // nothing there: writes vanish, as on real hardware
        }
    }

    pub fn port_in(&self, port: u16, data: &mut [u8]) {
        if serial::PORTS.contains(&port) {
            let mut serial = self.serial.lock().unwrap_or_else(|e| e.into_inner());
            serial.port_in(port, data);
        } else {
            data.fill(0xff); // an unclaimed port floats high
        }
    }
}
