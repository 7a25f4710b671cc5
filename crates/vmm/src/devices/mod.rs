//! Port-I/O devices emulated in ferry (PIC, IOAPIC and PIT live in KVM).

pub mod heartbeat;
pub mod serial;

use std::sync::Mutex;

use crate::memory::GuestMemory;
pub use heartbeat::{GuestEvent, HeartbeatDevice, HeartbeatState, Progress};
pub use serial::{SerialDevice, SerialDeviceState};

/// The devices vCPU threads reach on port I/O. Each device has its own lock so that
/// serial output never waits behind a heartbeat and the reverse.
pub struct PortBus {
    pub serial: Mutex<SerialDevice>,
    pub heartbeat: Mutex<HeartbeatDevice>,
}

impl PortBus {
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
