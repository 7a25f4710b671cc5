//! Devices emulated in ferry: on port I/O the serial port and the heartbeat device, on MMIO
//! virtio devices (PIC, IOAPIC and PIT live in KVM).

pub mod heartbeat;
pub mod serial;
pub mod virtio;

use std::sync::Mutex;

use migration::wire::bitmap::Bitmap;

use crate::layout::DEVICE_WINDOW_START;
use crate::memory::GuestMemory;
pub use heartbeat::{GuestEvent, HeartbeatDevice, HeartbeatState, Progress};
pub use serial::{SerialDevice, SerialDeviceState};
use virtio::mmio::MmioTransport;
use virtio::{SLOT_SIZE, WriteLog};

/// The devices vCPU threads reach, on port I/O and MMIO. Each device has its own lock so that
/// serial output never waits behind a heartbeat, a disk request or the reverse.
pub struct DeviceBus {
    pub serial: Mutex<SerialDevice>,
    pub heartbeat: Mutex<HeartbeatDevice>,
    /// virtio-mmio devices, slot by slot from `DEVICE_WINDOW_START`.
    pub virtio: Vec<Mutex<MmioTransport>>,
    /// Pages the VMM itself wrote (device emulation): dirty for migration like guest writes.
    pub vmm_writes: Mutex<Bitmap>,
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
            let mut device = d.lock().unwrap_or_else(|e| e.into_inner());
            let mut written = self.vmm_writes.lock().unwrap_or_else(|e| e.into_inner());
            device.write(offset, data, memory, &mut *written);
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
