//! The VM state that is not guest memory and that KVM keeps: each vCPU's complete register
//! state, the in-kernel irqchip and PIT, kvmclock. Plain serialisable structs, apart from the
//! live KVM objects they are taken from (Firecracker's `Persist` split); each KVM object is a
//! `Persist` component (`Vcpu`, `Irqchip`, `Pit`, `Clock`) as ferry's own devices are.

use kvm_bindings::{
    CpuId, KVM_IRQCHIP_IOAPIC, KVM_IRQCHIP_PIC_MASTER, KVM_IRQCHIP_PIC_SLAVE,
    KVM_MAX_CPUID_ENTRIES, Msrs, kvm_clock_data, kvm_cpuid_entry2, kvm_debugregs, kvm_irqchip,
    kvm_lapic_state, kvm_mp_state, kvm_msr_entry, kvm_pit_state2, kvm_regs, kvm_sregs,
    kvm_vcpu_events, kvm_xcrs, kvm_xsave,
};
use kvm_ioctls::{Kvm, VcpuFd, VmFd};
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result, kvm};
use crate::persist::Persist;

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
    /// The CPU model the guest sees; a destination must offer every feature in it.
    pub cpuid: Vec<kvm_cpuid_entry2>,
    /// The guest's TSC frequency (kHz), set on the destination where KVM can scale the TSC.
    pub tsc_khz: Option<u32>,
}

/// IA32_TSC_DEADLINE: KVM keeps a write only while the LAPIC timer is in TSC-deadline mode,
/// so it is restored after the LAPIC.
const MSR_TSC_DEADLINE: u32 = 0x6e0;

/// The CPUID leaves that carry feature flags: (leaf, sub-leaf or None for any).
const FEATURE_LEAVES: [u32; 7] = [0x1, 0x6, 0x7, 0xd, 0x8000_0001, 0x8000_0007, 0x8000_0008];

/// Leaf 1 ECX: CR4.OSXSAVE mirrored. Leaf 7 ECX: CR4.PKE mirrored.
const OSXSAVE: u32 = 1 << 27;
const OSPKE: u32 = 1 << 4;

/// Refuses a CPU model this host cannot provide, naming the first feature it lacks.
pub fn check_cpuid(wanted: &[kvm_cpuid_entry2], supported: &CpuId) -> Result<()> {
    for w in wanted
        .iter()
        .filter(|e| FEATURE_LEAVES.contains(&e.function))
    {
        let here = supported
            .as_slice()
            .iter()
            .find(|s| s.function == w.function && s.index == w.index);
        let regs =
            |e: Option<&kvm_cpuid_entry2>| e.map_or([0; 4], |e| [e.eax, e.ebx, e.ecx, e.edx]);
        let (mut want, have) = (regs(Some(w)), regs(here));
        // Bits the guest's own CR4 sets, which no supported CPUID lists.
        match (w.function, w.index) {
            (0x1, _) => want[2] &= !OSXSAVE,
            (0x7, 0) => want[2] &= !OSPKE,
            _ => {}
        }
        // Leaf 1 EBX holds the APIC ID and counts, and leaf 0xd's EAX/EBX sizes: not flags.
        let checked: &[usize] = match w.function {
            0x1 => &[2, 3],
            0xd => &[],
            _ => &[0, 1, 2, 3],
        };
        for &r in checked {
            let missing = want[r] & !have[r];
            if missing != 0 {
                return Err(Error::State(format!(
                    "this host cannot provide the guest's CPU model: CPUID leaf {:#x}.{} {} \
                     bits {missing:#x} are not supported here",
                    w.function,
                    w.index,
                    ["EAX", "EBX", "ECX", "EDX"][r]
                )));
            }
        }
    }
    Ok(())
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct IrqchipState {
    pub pic_master: kvm_irqchip,
    pub pic_slave: kvm_irqchip,
    pub ioapic: kvm_irqchip,
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
        cpuid: vcpu
            .get_cpuid2(KVM_MAX_CPUID_ENTRIES)
            .map_err(kvm("KVM_GET_CPUID2"))?
            .as_slice()
            .to_vec(),
        tsc_khz: vcpu.get_tsc_khz().ok(),
    })
}

/// Loads a vCPU in the order KVM needs: the CPU model first (before the vCPU ever ran), then
/// special registers (modes) before MSRs and the LAPIC, the TSC deadline after the LAPIC, events
/// and MP state last.
pub fn restore_vcpu(vcpu: &VcpuFd, state: &VcpuState, supported: &CpuId) -> Result<()> {
    check_cpuid(&state.cpuid, supported)?;
    let cpuid =
        CpuId::from_entries(&state.cpuid).map_err(|e| Error::State(format!("CPUID: {e:?}")))?;
    vcpu.set_cpuid2(&cpuid).map_err(kvm("KVM_SET_CPUID2"))?;
    if let Some(khz) = state.tsc_khz
        && vcpu.get_tsc_khz().ok() != Some(khz)
        && let Err(e) = vcpu.set_tsc_khz(khz)
    {
        tracing::warn!("the guest's TSC ran at {khz} kHz; this host cannot scale to it: {e}");
    }
    vcpu.set_sregs(&state.sregs).map_err(kvm("KVM_SET_SREGS"))?;
    vcpu.set_regs(&state.regs).map_err(kvm("KVM_SET_REGS"))?;
    vcpu.set_xcrs(&state.xcrs).map_err(kvm("KVM_SET_XCRS"))?;
    // SAFETY: the XSAVE area was produced by KVM_GET_XSAVE of the same size.
    unsafe { vcpu.set_xsave(&state.xsave) }.map_err(kvm("KVM_SET_XSAVE"))?;
    let (deadline, others): (Vec<kvm_msr_entry>, Vec<kvm_msr_entry>) =
        state.msrs.iter().partition(|m| m.index == MSR_TSC_DEADLINE);
    set_msrs(vcpu, &others)?;
    vcpu.set_lapic(&state.lapic).map_err(kvm("KVM_SET_LAPIC"))?;
    set_msrs(vcpu, &deadline)?;
    vcpu.set_debug_regs(&state.debugregs)
        .map_err(kvm("KVM_SET_DEBUGREGS"))?;
    vcpu.set_vcpu_events(&state.events)
        .map_err(kvm("KVM_SET_VCPU_EVENTS"))?;
    vcpu.set_mp_state(state.mp_state)
        .map_err(kvm("KVM_SET_MP_STATE"))
}

fn set_msrs(vcpu: &VcpuFd, entries: &[kvm_msr_entry]) -> Result<()> {
    let msrs = Msrs::from_entries(entries).map_err(|e| Error::State(format!("MSRs: {e:?}")))?;
    let written = vcpu.set_msrs(&msrs).map_err(kvm("KVM_SET_MSRS"))?;
    if written != entries.len() {
        return Err(Error::State(format!(
            "this host refused MSR {:#x} ({written} of {} written)",
            entries[written].index,
            entries.len()
        )));
    }
    Ok(())
}

fn get_chip(vm: &VmFd, chip_id: u32) -> Result<kvm_irqchip> {
    let mut chip = kvm_irqchip {
        chip_id,
        ..Default::default()
    };
    vm.get_irqchip(&mut chip).map_err(kvm("KVM_GET_IRQCHIP"))?;
    Ok(chip)
}

fn save_irqchip(vm: &VmFd) -> Result<IrqchipState> {
    Ok(IrqchipState {
        pic_master: get_chip(vm, KVM_IRQCHIP_PIC_MASTER)?,
        pic_slave: get_chip(vm, KVM_IRQCHIP_PIC_SLAVE)?,
        ioapic: get_chip(vm, KVM_IRQCHIP_IOAPIC)?,
    })
}

fn restore_irqchip(vm: &VmFd, state: &IrqchipState) -> Result<()> {
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

/// A component's error, in words with its causes (`Persist` speaks them).
fn said<T>(result: Result<T>) -> std::result::Result<T, String> {
    result.map_err(|e| migration::error::chain(&e))
}

/// A vCPU of a VM, with what saving and loading it needs: the MSRs this host can move, and the
/// CPU model it can offer.
pub struct Vcpu<'a> {
    pub fd: &'a VcpuFd,
    pub msrs: &'a [u32],
    pub supported: &'a CpuId,
}

impl Persist for Vcpu<'_> {
    const NAME: &'static str = "vcpu";
    const VERSION: u32 = 1;
    type State = VcpuState;

    fn save(&self) -> std::result::Result<VcpuState, String> {
        said(save_vcpu(self.fd, self.msrs))
    }

    fn load(&mut self, state: VcpuState) -> std::result::Result<(), String> {
        said(restore_vcpu(self.fd, &state, self.supported))
    }
}

/// The in-kernel PICs and IOAPIC of a VM.
pub struct Irqchip<'a>(pub &'a VmFd);

impl Persist for Irqchip<'_> {
    const NAME: &'static str = "irqchip";
    const VERSION: u32 = 1;
    type State = IrqchipState;

    fn save(&self) -> std::result::Result<IrqchipState, String> {
        said(save_irqchip(self.0))
    }

    fn load(&mut self, state: IrqchipState) -> std::result::Result<(), String> {
        said(restore_irqchip(self.0, &state))
    }
}

/// The in-kernel PIT of a VM.
pub struct Pit<'a>(pub &'a VmFd);

impl Persist for Pit<'_> {
    const NAME: &'static str = "pit";
    const VERSION: u32 = 1;
    type State = kvm_pit_state2;

    fn save(&self) -> std::result::Result<kvm_pit_state2, String> {
        said(self.0.get_pit2().map_err(kvm("KVM_GET_PIT2")))
    }

    fn load(&mut self, state: kvm_pit_state2) -> std::result::Result<(), String> {
        said(self.0.set_pit2(&state).map_err(kvm("KVM_SET_PIT2")))
    }
}

/// kvmclock of a VM.
pub struct Clock<'a>(pub &'a VmFd);

impl Persist for Clock<'_> {
    const NAME: &'static str = "clock";
    const VERSION: u32 = 1;
    type State = kvm_clock_data;

    fn save(&self) -> std::result::Result<kvm_clock_data, String> {
        said(self.0.get_clock().map_err(kvm("KVM_GET_CLOCK")))
    }

    fn load(&mut self, state: kvm_clock_data) -> std::result::Result<(), String> {
        said(
            self.0
                .set_clock(&clock_for_restore(state))
                .map_err(kvm("KVM_SET_CLOCK")),
        )
    }
}
