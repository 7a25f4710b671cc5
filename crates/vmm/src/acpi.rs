//! The ACPI tables that describe the machine: RSDP → XSDT → FADT, MADT; FADT → DSDT.
//!
//! - The **MADT** lists one local APIC per vCPU and the IOAPIC. A guest starts the
//!   application processors it lists with INIT/SIPI, as on any PC.
//! - The **FADT** says the platform is hardware-reduced (no PM timer, no SCI, no legacy PIC
//!   or CMOS, no VGA): without a FADT Linux reports "Unable to enable ACPI", never routes the
//!   IOAPIC's pins above 15, and the virtio-mmio devices' interrupts are never mapped.
//! - The **DSDT** describes each virtio-mmio device (`LNRO0005`, Linux's virtio_mmio driver
//!   binds it) with its register window and its edge-triggered IOAPIC pin, and COM1.
//!
//! A guest finds the RSDP through `hvm_start_info.rsdp_paddr`, the zero page's
//! `acpi_rsdp_addr`, or by scanning the BIOS area where it lies.

use acpi_tables::Aml;
use acpi_tables::aml::{
    Device, EISAName, IO, Interrupt, Memory32Fixed, Name, ResourceTemplate, Scope,
};
use acpi_tables::fadt::{FADTBuilder, Flags};
use acpi_tables::madt::{
    EnabledStatus, IoApic, LocalInterruptController, MADT, ProcessorLocalApic,
};
use acpi_tables::rsdp::Rsdp;
use acpi_tables::sdt::Sdt;
use acpi_tables::xsdt::XSDT;
use vm_memory::{Bytes, GuestAddress};

use crate::error::{Error, Result};
use crate::layout::{IOAPIC_ADDR, LAPIC_ADDR, RSDP_ADDR};
use crate::memory::GuestMemory;

const OEM_ID: [u8; 6] = *b"FERRY ";
const OEM_TABLE_ID: [u8; 8] = *b"FERRYVM ";
/// The other tables follow the RSDP in the BIOS area (reserved in the E820 map), each in room
/// enough for its largest form (MADT: 16 vCPUs; DSDT: 8 devices and COM1).
const XSDT_ADDR: u64 = RSDP_ADDR + 0x40;
const MADT_ADDR: u64 = RSDP_ADDR + 0x100;
const FADT_ADDR: u64 = RSDP_ADDR + 0x1000;
const DSDT_ADDR: u64 = RSDP_ADDR + 0x2000;
const DSDT_MAX: usize = 0x2000;
/// IA-PC boot architecture flags: no VGA, no MSI, no CMOS RTC.
const IAPC_NO_VGA: u16 = 1 << 2;
const IAPC_NO_MSI: u16 = 1 << 3;
const IAPC_NO_CMOS_RTC: u16 = 1 << 5;
/// COM1, as `devices::serial` emulates it.
const COM1_PORT: u16 = 0x3f8;
const COM1_IRQ: u32 = crate::devices::serial::IRQ;

/// One virtio-mmio device: its register window and its IOAPIC pin.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MmioDevice {
    pub base: u64,
    pub size: u64,
    pub gsi: u32,
}

/// What the tables describe.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Machine {
    pub vcpus: usize,
    pub virtio: Vec<MmioDevice>,
}

/// Writes the tables for `machine`; returns the RSDP's address.
pub fn write_tables(memory: &GuestMemory, machine: &Machine) -> Result<u64> {
    let madt = madt(machine.vcpus);
    let dsdt = dsdt(&machine.virtio);
    let mut fadt = FADTBuilder::new(OEM_ID, OEM_TABLE_ID, 1)
        .dsdt_64(DSDT_ADDR)
        .flag(Flags::HwReducedAcpi)
        .flag(Flags::PwrButton)
        .flag(Flags::SlpButton);
    fadt.iapc_boot_arch = (IAPC_NO_VGA | IAPC_NO_MSI | IAPC_NO_CMOS_RTC).into();
    let fadt = fadt.finalize();
    let mut xsdt = XSDT::new(OEM_ID, OEM_TABLE_ID, 1);
    xsdt.add_entry(FADT_ADDR);
    xsdt.add_entry(MADT_ADDR);
    let rsdp = Rsdp::new(OEM_ID, XSDT_ADDR);
    let mut dsdt_bytes = Vec::new();
    dsdt.to_aml_bytes(&mut dsdt_bytes);
    if dsdt_bytes.len() > DSDT_MAX {
        return Err(Error::Memory(format!(
            "the DSDT ({} bytes) does not fit its {DSDT_MAX} bytes",
            dsdt_bytes.len()
        )));
    }
    for (table, addr) in [
        (&rsdp as &dyn Aml, RSDP_ADDR),
        (&xsdt, XSDT_ADDR),
        (&madt, MADT_ADDR),
        (&fadt, FADT_ADDR),
        (&dsdt, DSDT_ADDR),
    ] {
        let mut bytes = Vec::new();
        table.to_aml_bytes(&mut bytes);
        memory
            .write_slice(&bytes, GuestAddress(addr))
            .map_err(|e| Error::Memory(format!("writing ACPI tables: {e}")))?;
    }
    Ok(RSDP_ADDR)
}

fn madt(vcpus: usize) -> MADT {
    let mut madt = MADT::new(
        OEM_ID,
        OEM_TABLE_ID,
        1,
        LocalInterruptController::Address(LAPIC_ADDR as u32),
    );
    for cpu in 0..vcpus {
        madt.add_structure(ProcessorLocalApic::new(
            cpu as u8,
            cpu as u8,
            EnabledStatus::Enabled,
        ));
    }
    madt.add_structure(IoApic::new(0, IOAPIC_ADDR as u32, 0));
    madt
}

/// `\_SB` with COM1 and one `LNRO0005` device per virtio-mmio window.
fn dsdt(virtio: &[MmioDevice]) -> Sdt {
    let mut devices = vec![RawAml(com1())];
    devices.extend(
        virtio
            .iter()
            .enumerate()
            .map(|(slot, d)| RawAml(mmio_device(slot, d))),
    );
    let sb = Scope::new(
        "\\_SB_".into(),
        devices.iter().map(|d| d as &dyn Aml).collect(),
    );
    let mut body = Vec::new();
    sb.to_aml_bytes(&mut body);
    let mut table = Sdt::new(*b"DSDT", 36, 6, OEM_ID, OEM_TABLE_ID, 1);
    table.append_slice(&body);
    table
}

/// COM1's AML: its eight ports and its ISA interrupt.
fn com1() -> Vec<u8> {
    let io = IO::new(COM1_PORT, COM1_PORT, 1, 8);
    let irq = Interrupt::new(true, true, false, false, COM1_IRQ);
    let crs = ResourceTemplate::new(vec![&io, &irq]);
    device("COM1", &EISAName::new("PNP0501"), 0, &crs)
}

/// One virtio-mmio device's AML (`Vnnn`): named by its slot, so the name is stable.
fn mmio_device(slot: usize, device: &MmioDevice) -> Vec<u8> {
    let window = Memory32Fixed::new(true, device.base as u32, device.size as u32);
    let irq = Interrupt::new(true, true, false, false, device.gsi);
    let crs = ResourceTemplate::new(vec![&window, &irq]);
    let hid: &'static str = "LNRO0005";
    self::device(&format!("V{slot:03}"), &hid, slot as u32, &crs)
}

/// `Device(name) { _HID, _UID, _CRS }`.
fn device(name: &str, hid: &dyn Aml, uid: u32, crs: &dyn Aml) -> Vec<u8> {
    let names = [
        Name::new("_HID".into(), hid),
        Name::new("_UID".into(), &uid),
        Name::new("_CRS".into(), crs),
    ];
    let mut bytes = Vec::new();
    Device::new(name.into(), names.iter().map(|n| n as &dyn Aml).collect())
        .to_aml_bytes(&mut bytes);
    bytes
}

/// AML already encoded.
struct RawAml(Vec<u8>);

impl Aml for RawAml {
    fn to_aml_bytes(&self, sink: &mut dyn acpi_tables::AmlSink) {
        sink.vec(&self.0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::{MemoryBackend, create_guest_memory};

    fn checksum_ok(bytes: &[u8]) -> bool {
        bytes.iter().fold(0u8, |a, b| a.wrapping_add(*b)) == 0
    }

    fn table(mem: &GuestMemory, addr: u64) -> Vec<u8> {
        let mut head = [0u8; 8];
        mem.read_slice(&mut head, GuestAddress(addr)).unwrap();
        let len = u32::from_le_bytes(head[4..8].try_into().unwrap()) as usize;
        let mut bytes = vec![0u8; len];
        mem.read_slice(&mut bytes, GuestAddress(addr)).unwrap();
        assert!(checksum_ok(&bytes), "{:?}", &bytes[..4]);
        bytes
    }

    fn u32_at(b: &[u8], at: usize) -> u32 {
        u32::from_le_bytes(b[at..at + 4].try_into().unwrap())
    }

    fn u64_at(b: &[u8], at: usize) -> u64 {
        u64::from_le_bytes(b[at..at + 8].try_into().unwrap())
    }

    #[test]
    fn the_tables_describe_every_vcpu_and_device_and_their_checksums_hold() {
        let mem = create_guest_memory(64 << 20, MemoryBackend::Anonymous).unwrap();
        let device = |slot: u32| MmioDevice {
            base: 0xc000_0000 + u64::from(slot) * 0x1000,
            size: 0x1000,
            gsi: 16 + slot,
        };
        let machine = Machine {
            vcpus: 4,
            virtio: vec![device(0), device(1)],
        };
        assert_eq!(write_tables(&mem, &machine).unwrap(), RSDP_ADDR);
        let mut rsdp = [0u8; 36];
        mem.read_slice(&mut rsdp, GuestAddress(RSDP_ADDR)).unwrap();
        assert_eq!(&rsdp[..8], b"RSD PTR ");
        assert!(checksum_ok(&rsdp[..20]) && checksum_ok(&rsdp));
        let xsdt = table(&mem, u64_at(&rsdp, 24));
        assert_eq!(&xsdt[..4], b"XSDT");
        let entries: Vec<u64> = (36..xsdt.len())
            .step_by(8)
            .map(|at| u64_at(&xsdt, at))
            .collect();
        let signatures: Vec<Vec<u8>> = entries
            .iter()
            .map(|&a| table(&mem, a)[..4].to_vec())
            .collect();
        assert_eq!(signatures, [b"FACP".to_vec(), b"APIC".to_vec()]);

        // FADT: hardware-reduced, the DSDT by its 64-bit address (offset 140).
        let fadt = table(&mem, entries[0]);
        assert_ne!(u32_at(&fadt, 112) & (1 << 20), 0, "HW_REDUCED_ACPI");
        let dsdt = table(&mem, u64_at(&fadt, 140));
        assert_eq!(&dsdt[..4], b"DSDT");
        let aml = &dsdt[36..];
        let count = |needle: &[u8]| aml.windows(needle.len()).filter(|w| *w == needle).count();
        assert_eq!(count(b"LNRO0005"), 2, "one virtio-mmio device per slot");
        assert_eq!(count(b"COM1"), 1);
        // Each device's window (Memory32Fixed: 0x86, length 9, read-write, base, size) and
        // interrupt (extended IRQ: 0x89, length 6, consumer + edge, one, the pin).
        for slot in 0..2u32 {
            let d = device(slot);
            let mut window = vec![0x86, 9, 0, 1];
            window.extend_from_slice(&(d.base as u32).to_le_bytes());
            window.extend_from_slice(&(d.size as u32).to_le_bytes());
            assert_eq!(count(&window), 1, "slot {slot}'s window");
            let mut irq = vec![0x89, 6, 0, 0b11, 1];
            irq.extend_from_slice(&d.gsi.to_le_bytes());
            assert_eq!(count(&irq), 1, "slot {slot}'s interrupt");
        }

        // MADT entries after the 44-byte header: type 0 (local APIC, 8 bytes) × 4, type 1.
        let madt = table(&mem, entries[1]);
        let (mut at, mut lapics) = (44, Vec::new());
        while at < madt.len() {
            let (kind, size) = (madt[at], madt[at + 1] as usize);
            if kind == 0 {
                lapics.push(madt[at + 3]);
            }
            at += size;
        }
        assert_eq!(lapics, vec![0, 1, 2, 3]);
    }
}
