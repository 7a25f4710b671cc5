//! `vm_state`: the vCPU and device state a destination loads (a vCPU's `Fragment`, the
//! devices' `Fragments` in `vmm::persist`, as `vmm::migratable::encode` writes them), read as a
//! KVM VM's `load_state` reads them. Decoding runs as it does there, and the check of which
//! fragments came; then what loads the state without KVM runs too: the CPU model check, the
//! serial port, the heartbeat device, kvmclock, and each virtio transport onto a disk of this
//! process's own.
//!
//! The input's first byte says which state it is (even: a vCPU's, odd: the devices').

use std::os::fd::AsRawFd;
use std::sync::OnceLock;

use kvm_bindings::{CpuId, kvm_clock_data, kvm_cpuid_entry2, kvm_pit_state2};
use vmm::devices::heartbeat::HeartbeatDevice;
use vmm::devices::serial::SerialDevice;
use vmm::devices::virtio::block::{Block, DiskConfig};
use vmm::devices::virtio::mmio::MmioTransport;
use vmm::migratable::decode;
use vmm::persist::{Component, Fragment, Fragments, from_bytes};
use vmm::state::{IrqchipState, VcpuState, check_cpuid, clock_for_restore};
use vmm_sys_util::eventfd::{EFD_NONBLOCK, EventFd};

pub fn vm_state(data: &[u8]) {
    let Some((&which, state)) = data.split_first() else {
        return;
    };
    if which % 2 == 0 {
        if let Ok(vcpu) = said(decode::<Fragment>(state, "vCPU")) {
            load_vcpu(&vcpu);
        }
    } else if let Ok(devices) = said(decode::<Fragments>(state, "device")) {
        load_devices(&devices);
    }
}

/// `result`, once sure an error says what it is.
fn said<T>(result: migration::Result<T>) -> migration::Result<T> {
    if let Err(e) = &result {
        assert!(!e.to_string().is_empty(), "an error that says nothing");
    }
    result
}

/// What a vCPU's restore checks without KVM: its CPU model against a host's.
fn load_vcpu(vcpu: &Fragment) {
    let Ok(vcpu) = from_bytes::<VcpuState>(&vcpu.bytes) else {
        return;
    };
    if let Err(e) = check_cpuid(&vcpu.cpuid, host_cpuid()) {
        assert!(!e.to_string().is_empty());
    }
}

/// A host's CPU model: every feature leaf with half its bits.
fn host_cpuid() -> &'static CpuId {
    static HOST: OnceLock<CpuId> = OnceLock::new();
    HOST.get_or_init(|| {
        let leaves = [0x1, 0x6, 0x7, 0xd, 0x8000_0001, 0x8000_0007, 0x8000_0008];
        let entries: Vec<kvm_cpuid_entry2> = leaves
            .iter()
            .map(|&function| kvm_cpuid_entry2 {
                function,
                eax: 0x5555_5555,
                ebx: 0x5555_5555,
                ecx: 0x5555_5555,
                edx: 0x5555_5555,
                ..Default::default()
            })
            .collect();
        CpuId::from_entries(&entries).expect("a few CPUID leaves")
    })
}

/// What `Vm::restore` does with the devices' state, but for loading the in-kernel irqchip and
/// PIT (their states are decoded).
fn load_devices(devices: &Fragments) {
    let virtio = devices
        .0
        .iter()
        .filter(|f| f.name.starts_with("virtio."))
        .count();
    let names: Vec<String> = ["irqchip", "pit", "clock", "serial", "heartbeat"]
        .map(String::from)
        .into_iter()
        .chain((0..virtio).map(|slot| format!("virtio.{slot}")))
        .collect();
    if let Err(e) = devices.check(&names) {
        assert!(!e.is_empty());
    }
    for f in &devices.0 {
        if let Err(e) = load(f) {
            assert!(!e.is_empty());
        }
    }
}

fn load(f: &Fragment) -> Result<(), String> {
    match f.name.as_str() {
        "irqchip" => from_bytes::<IrqchipState>(&f.bytes).map(|_| ()),
        "pit" => from_bytes::<kvm_pit_state2>(&f.bytes).map(|_| ()),
        "clock" => from_bytes::<kvm_clock_data>(&f.bytes).map(|c| {
            let _ = clock_for_restore(c);
        }),
        "serial" => {
            let irq = EventFd::new(EFD_NONBLOCK).expect("an eventfd");
            let serial = SerialDevice::new(irq, Box::new(std::io::sink()));
            serial.expect("a serial port").load_from(f)
        }
        "heartbeat" => {
            let mut heartbeat = HeartbeatDevice::new(1);
            heartbeat.load_from(f)?;
            // What `vm.info` reports of it.
            let _ = (heartbeat.total(), heartbeat.observed_downtime_ns());
            Ok(())
        }
        _ => disk_transport().load_from(f),
    }
}

/// A virtio-blk transport over a one-sector disk of this process's own.
fn disk_transport() -> MmioTransport {
    static DISK: OnceLock<std::fs::File> = OnceLock::new();
    let disk = DISK.get_or_init(|| {
        let file = crate::memfd_with(&[0u8; 512]);
        file.set_len(512).expect("a one-sector disk");
        file
    });
    let config = DiskConfig {
        path: format!("/proc/self/fd/{}", disk.as_raw_fd()).into(),
        readonly: true,
    };
    let block = Block::open(&config, false).expect("a disk");
    let irq = EventFd::new(EFD_NONBLOCK).expect("an eventfd");
    MmioTransport::new(Box::new(block), irq)
}
