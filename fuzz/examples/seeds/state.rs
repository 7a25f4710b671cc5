//! Seeds of the `vm_state` target: a vCPU's state and the devices', as a KVM VM encodes them
//! (`vmm::migratable::encode` of a `Fragment`, of `Fragments`), each behind the byte that says
//! which it is.

use kvm_bindings::{kvm_cpuid_entry2, kvm_msr_entry};
use vmm::devices::heartbeat::{HeartbeatDevice, HeartbeatState};
use vmm::devices::serial::SerialDevice;
use vmm::devices::virtio::block::Block;
use vmm::devices::virtio::mmio::{MmioTransport, QueueSnapshot, TransportState, VirtioState};
use vmm::migratable::encode;
use vmm::persist::{Fragment, Fragments, Persist, fragment};
use vmm::state::{Clock, Irqchip, IrqchipState, Pit, Vcpu, VcpuState};

pub fn seeds(write: &dyn Fn(&str, &str, &[u8])) {
    let with = |which: u8, state: Vec<u8>| [vec![which], state].concat();
    write("vm_state", "vcpu.bin", &with(0, encode(&vcpu()).unwrap()));
    write(
        "vm_state",
        "devices.bin",
        &with(1, encode(&devices(0)).unwrap()),
    );
    write(
        "vm_state",
        "devices-disk.bin",
        &with(1, encode(&devices(1)).unwrap()),
    );
}

fn vcpu() -> Fragment {
    let state = VcpuState {
        regs: Default::default(),
        sregs: Default::default(),
        xsave: Default::default(),
        xcrs: Default::default(),
        msrs: vec![kvm_msr_entry {
            index: 0x6e0,
            data: 1 << 40,
            ..Default::default()
        }],
        lapic: Default::default(),
        events: Default::default(),
        mp_state: Default::default(),
        debugregs: Default::default(),
        cpuid: [0x1, 0x7, 0xd, 0x8000_0001]
            .into_iter()
            .map(|function| kvm_cpuid_entry2 {
                function,
                ecx: 0x1111_0000,
                edx: 0x0000_1111,
                ..Default::default()
            })
            .collect(),
        tsc_khz: Some(2_000_000),
    };
    fragment::<Vcpu>(Vcpu::NAME, &state).unwrap()
}

/// The devices of a VM with `disks` disks.
fn devices(disks: usize) -> Fragments {
    let irqchip = IrqchipState {
        pic_master: Default::default(),
        pic_slave: Default::default(),
        ioapic: Default::default(),
    };
    let heartbeat = HeartbeatState {
        vcpus: vec![Default::default(); 2],
        verify_error_pages: vec![3],
        ..Default::default()
    };
    let fixed = [
        fragment::<Irqchip>(Irqchip::NAME, &irqchip),
        fragment::<Pit>(Pit::NAME, &Default::default()),
        fragment::<Clock>(Clock::NAME, &Default::default()),
        fragment::<SerialDevice>(SerialDevice::NAME, &Default::default()),
        fragment::<HeartbeatDevice>(HeartbeatDevice::NAME, &heartbeat),
    ];
    let virtio =
        (0..disks).map(|slot| fragment::<MmioTransport>(&format!("virtio.{slot}"), &disk()));
    Fragments(
        fixed
            .into_iter()
            .chain(virtio)
            .map(Result::unwrap)
            .collect(),
    )
}

/// A disk's state, its queue running.
fn disk() -> VirtioState {
    let queue = QueueSnapshot {
        max_size: 256,
        size: 256,
        ready: true,
        next_avail: 7,
        next_used: 7,
        event_idx: true,
        desc_table: 0x10_0000,
        avail_ring: 0x10_1000,
        used_ring: 0x10_2000,
    };
    VirtioState {
        transport: TransportState {
            device_type: 2,
            status: 15,
            queues: vec![queue],
            ..Default::default()
        },
        device: fragment::<Block>(Block::NAME, &()).unwrap(),
    }
}
