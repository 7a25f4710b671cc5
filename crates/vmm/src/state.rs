//! The VM state that is not guest memory: each vCPU's complete register state, the in-kernel
//! irqchip and PIT, kvmclock, and ferry's own devices. Plain serialisable structs, apart from
//! the live KVM objects they are taken from (Firecracker's `Persist` split).

use kvm_bindings::{
    KVM_IRQCHIP_IOAPIC, KVM_IRQCHIP_PIC_MASTER, KVM_IRQCHIP_PIC_SLAVE, Msrs, kvm_clock_data,
    kvm_debugregs, kvm_irqchip, kvm_lapic_state, kvm_mp_state, kvm_msr_entry, kvm_pit_state2,
    kvm_regs, kvm_sregs, kvm_vcpu_events, kvm_xcrs, kvm_xsave,
};
use kvm_ioctls::{Kvm, VcpuFd, VmFd};
use serde::{Deserialize, Serialize};

use crate::devices::{HeartbeatState, SerialDeviceState};
use crate::error::{Error, Result, kvm};

#[derive(Debug, Serialize, Deserialize)]
pub struct VcpuState {
    pub regs: kvm_regs,
    pub sregs: kvm_sregs,
    /// x87, SSE and AVX state all live in the XSAVE area.
    pub xsave: kvm_xsave,
    pub xcrs: kvm_xcrs,
    pub msrs: Vec<kvm_msr_entry>,
    pub lapic: kvm_lapic_state,
    pub events: kvm_vcpu_events,
    pub mp_state: kvm_mp_state,
    pub debugregs: kvm_debugregs,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct IrqchipState {
    pub pic_master: kvm_irqchip,
    pub pic_slave: kvm_irqchip,
    pub ioapic: kvm_irqchip,
}

/// Everything besides memory and vCPUs.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct DeviceState {
    pub irqchip: IrqchipState,
    pub pit: kvm_pit_state2,
    pub clock: kvm_clock_data,
    pub serial: SerialDeviceState,
    pub heartbeat: HeartbeatState,
}

/// The MSRs KVM lists that this host can both read and write back: probed once per VM,
/// because a list entry that fails would make `KVM_GET_MSRS` stop short silently.
pub fn migratable_msrs(kvm_sys: &Kvm, vcpu: &VcpuFd) -> Result<Vec<u32>> {
    let listed = kvm_sys
        .get_msr_index_list()
        .map_err(kvm("KVM_GET_MSR_INDEX_LIST"))?;
    let mut usable = Vec::new();
    for &index in listed.as_slice() {
        let mut one = Msrs::from_entries(&[kvm_msr_entry {
            index,
            ..Default::default()
        }])
        .map_err(|e| Error::State(format!("MSR list: {e:?}")))?;
        if vcpu.get_msrs(&mut one) != Ok(1) {
            continue;
        }
        if vcpu.set_msrs(&one) == Ok(1) {
            usable.push(index);
        }
    }
    Ok(usable)
}

pub fn save_vcpu(vcpu: &VcpuFd, msr_indices: &[u32]) -> Result<VcpuState> {
    let entries: Vec<kvm_msr_entry> = msr_indices
        .iter()
        .map(|&index| kvm_msr_entry {
            index,
            ..Default::default()
        })
        .collect();
    let mut msrs =
        Msrs::from_entries(&entries).map_err(|e| Error::State(format!("MSR list: {e:?}")))?;
    let read = vcpu.get_msrs(&mut msrs).map_err(kvm("KVM_GET_MSRS"))?;
    if read != entries.len() {
        return Err(Error::State(format!(
            "read {read} of {} MSRs; MSR {:#x} failed",
            entries.len(),
            entries[read].index
        )));
    }
    Ok(VcpuState {
        regs: vcpu.get_regs().map_err(kvm("KVM_GET_REGS"))?,
        sregs: vcpu.get_sregs().map_err(kvm("KVM_GET_SREGS"))?,
        xsave: vcpu.get_xsave().map_err(kvm("KVM_GET_XSAVE"))?,
        xcrs: vcpu.get_xcrs().map_err(kvm("KVM_GET_XCRS"))?,
        msrs: msrs.as_slice().to_vec(),
        lapic: vcpu.get_lapic().map_err(kvm("KVM_GET_LAPIC"))?,
        events: vcpu.get_vcpu_events().map_err(kvm("KVM_GET_VCPU_EVENTS"))?,
        mp_state: vcpu.get_mp_state().map_err(kvm("KVM_GET_MP_STATE"))?,
        debugregs: vcpu.get_debug_regs().map_err(kvm("KVM_GET_DEBUGREGS"))?,
    })
}

/// Loads a vCPU in the order KVM needs: special registers (modes) before MSRs and the LAPIC,
/// events and MP state last.
pub fn restore_vcpu(vcpu: &VcpuFd, state: &VcpuState) -> Result<()> {
    vcpu.set_sregs(&state.sregs).map_err(kvm("KVM_SET_SREGS"))?;
    vcpu.set_regs(&state.regs).map_err(kvm("KVM_SET_REGS"))?;
    vcpu.set_xcrs(&state.xcrs).map_err(kvm("KVM_SET_XCRS"))?;
    // SAFETY: the XSAVE area was produced by KVM_GET_XSAVE of the same size.
    unsafe { vcpu.set_xsave(&state.xsave) }.map_err(kvm("KVM_SET_XSAVE"))?;
    let msrs = Msrs::from_entries(&state.msrs).map_err(|e| Error::State(format!("MSRs: {e:?}")))?;
    let written = vcpu.set_msrs(&msrs).map_err(kvm("KVM_SET_MSRS"))?;
    if written != state.msrs.len() {
        return Err(Error::State(format!(
            "this host refused MSR {:#x} ({written} of {} written)",
            state.msrs[written].index,
            state.msrs.len()
        )));
    }
    vcpu.set_lapic(&state.lapic).map_err(kvm("KVM_SET_LAPIC"))?;
    vcpu.set_debug_regs(&state.debugregs)
        .map_err(kvm("KVM_SET_DEBUGREGS"))?;
    vcpu.set_vcpu_events(&state.events)
        .map_err(kvm("KVM_SET_VCPU_EVENTS"))?;
    vcpu.set_mp_state(state.mp_state)
        .map_err(kvm("KVM_SET_MP_STATE"))
}

fn get_chip(vm: &VmFd, chip_id: u32) -> Result<kvm_irqchip> {
    let mut chip = kvm_irqchip {
        chip_id,
        ..Default::default()
    };
    vm.get_irqchip(&mut chip).map_err(kvm("KVM_GET_IRQCHIP"))?;
    Ok(chip)
}

pub fn save_irqchip(vm: &VmFd) -> Result<IrqchipState> {
    Ok(IrqchipState {
        pic_master: get_chip(vm, KVM_IRQCHIP_PIC_MASTER)?,
        pic_slave: get_chip(vm, KVM_IRQCHIP_PIC_SLAVE)?,
        ioapic: get_chip(vm, KVM_IRQCHIP_IOAPIC)?,
    })
}

pub fn restore_irqchip(vm: &VmFd, state: &IrqchipState) -> Result<()> {
    for chip in [&state.pic_master, &state.pic_slave, &state.ioapic] {
        vm.set_irqchip(chip).map_err(kvm("KVM_SET_IRQCHIP"))?;
    }
    Ok(())
}

/// kvmclock as the source saw it at pause; flags that only describe the reading are cleared
/// because `KVM_SET_CLOCK` refuses them.
pub fn clock_for_restore(mut clock: kvm_clock_data) -> kvm_clock_data {
    clock.flags &= kvm_bindings::KVM_CLOCK_REALTIME;
    clock
}
