//! COM1 on vm-superio's 16550, with output to a file or stdout and an irqfd for IRQ 4.

use std::io::Write;
use std::ops::RangeInclusive;

use serde::{Deserialize, Serialize};
use vm_superio::serial::{NoEvents, SerialState};
use vm_superio::{Serial, Trigger};
use vmm_sys_util::eventfd::EventFd;

pub const PORTS: RangeInclusive<u16> = 0x3f8..=0x3ff;
pub const IRQ: u32 = 4;

pub struct IrqTrigger(pub EventFd);

impl Trigger for IrqTrigger {
    type E = std::io::Error;
    fn trigger(&self) -> std::io::Result<()> {
        self.0.write(1)
    }
}

pub type Output = Box<dyn Write + Send>;

pub struct SerialDevice {
    uart: Serial<IrqTrigger, NoEvents, Output>,
    irq: EventFd,
}

/// vm-superio's `SerialState`, in a form that crosses the wire.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SerialDeviceState {
    pub registers: [u8; 9],
    pub in_buffer: Vec<u8>,
}

impl SerialDevice {
    pub fn new(irq: EventFd, output: Output) -> std::io::Result<Self> {
        Ok(Self {
            uart: Serial::new(IrqTrigger(irq.try_clone()?), output),
            irq,
        })
    }

    pub fn port_out(&mut self, port: u16, data: &[u8]) {
        if let Some(&byte) = data.first() {
            // A lost console byte is not worth stopping a vCPU for.
            let _ = self.uart.write((port - PORTS.start()) as u8, byte);
            if (port - PORTS.start()) == 0 && byte == b'\n' {
                let _ = self.uart.writer_mut().flush();
            }
        }
    }

    pub fn port_in(&mut self, port: u16, data: &mut [u8]) {
        if let Some(first) = data.first_mut() {
            *first = self.uart.read((port - PORTS.start()) as u8);
        }
    }
}

impl crate::persist::Persist for SerialDevice {
    const NAME: &'static str = "serial";
    const VERSION: u32 = 1;
    type State = SerialDeviceState;

    fn save(&self) -> Result<SerialDeviceState, String> {
        let s = self.uart.state();
        Ok(SerialDeviceState {
            registers: [
                s.baud_divisor_low,
                s.baud_divisor_high,
                s.interrupt_enable,
                s.interrupt_identification,
                s.line_control,
                s.line_status,
                s.modem_control,
                s.modem_status,
                s.scratch,
            ],
            in_buffer: s.in_buffer,
        })
    }

    /// Takes over migrated register state; output keeps going where it went.
    fn load(&mut self, state: SerialDeviceState) -> Result<(), String> {
        let [bl, bh, ie, ii, lc, ls, mc, ms, sc] = state.registers;
        let s = SerialState {
            baud_divisor_low: bl,
            baud_divisor_high: bh,
            interrupt_enable: ie,
            interrupt_identification: ii,
            line_control: lc,
            line_status: ls,
            modem_control: mc,
            modem_status: ms,
            scratch: sc,
            in_buffer: state.in_buffer,
        };
        let irq = self
            .irq
            .try_clone()
            .map_err(|e| format!("serial irq: {e}"))?;
        let output = std::mem::replace(self.uart.writer_mut(), Box::new(std::io::sink()));
        self.uart = Serial::from_state(&s, IrqTrigger(irq), NoEvents, output)
            .map_err(|e| format!("serial state: {e:?}"))?;
        Ok(())
    }
}
