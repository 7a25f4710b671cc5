//! `vm_state`: the vCPU and device state a destination loads (`VcpuState`, `DeviceState` in
//! `vmm::state`, as `vmm::migratable::encode` writes them), read as a KVM VM's `load_state`
//! reads them. Decoding runs as it does there; then what loads the state without KVM runs
//! too: the CPU model check, the serial port, the heartbeat device, kvmclock, and each virtio
//! transport onto a disk of this process's own.
//!
//! The input's first byte says which state it is (even: a vCPU's, odd: the devices').

use std::os::fd::AsRawFd;
use std::sync::OnceLock;

use kvm_bindings::{CpuId, kvm_cpuid_entry2};
use vmm::devices::heartbeat::HeartbeatDevice;
use vmm::devices::serial::SerialDevice;
use vmm::devices::virtio::block::{Block, DiskConfig};
use vmm::devices::virtio::mmio::MmioTransport;
use vmm::migratable::decode;
use vmm::state::{DeviceState, VcpuState, check_cpuid, clock_for_restore};
use vmm_sys_util::eventfd::{EFD_NONBLOCK, EventFd};

pub fn vm_state(data: &[u8]) {
    let Some((&which, state)) = data.split_first() else {
        return;
    };
    if which % 2 == 0 {
        if let Ok(vcpu) = said(decode::<VcpuState>(state, "vCPU")) {
            load_vcpu(&vcpu);
        }
    } else if let Ok(devices) = said(decode::<DeviceState>(state, "device")) {
        load_devices(devices);
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
fn load_vcpu(vcpu: &VcpuState) {
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

/// What `Vm::restore` does with the devices' state, but for the in-kernel irqchip and PIT.
fn load_devices(devices: DeviceState) {
    let _ = clock_for_restore(devices.clock);
    let irq = EventFd::new(EFD_NONBLOCK).expect("an eventfd");
    let mut serial = SerialDevice::new(irq, Box::new(std::io::sink())).expect("a serial port");
    if let Err(e) = serial.load(&devices.serial) {
        assert!(!e.is_empty());
    }
    let heartbeat = HeartbeatDevice::restore(devices.heartbeat, true);
    // What `vm.info` reports of it.
    let _ = (heartbeat.total(), heartbeat.observed_downtime_ns());
    for virtio in &devices.virtio {
        let mut transport = disk_transport();
        let loaded = transport
            .load(&virtio.transport)
            .and_then(|()| transport.device_mut().load(&virtio.device));
        if let Err(e) = loaded {
            assert!(!e.is_empty());
        }
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
