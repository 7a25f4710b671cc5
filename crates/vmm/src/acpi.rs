//! The ACPI tables that describe the machine's processors: RSDP → XSDT → MADT (one local
//! APIC per vCPU, the IOAPIC). A guest finds the RSDP through `hvm_start_info.rsdp_paddr`,
//! the zero page's `acpi_rsdp_addr`, or by scanning the BIOS area where it lies, and starts
//! the application processors the MADT lists with INIT/SIPI, as on any PC.

use acpi_tables::Aml;
use acpi_tables::madt::{
    EnabledStatus, IoApic, LocalInterruptController, MADT, ProcessorLocalApic,
};
use acpi_tables::rsdp::Rsdp;
use acpi_tables::xsdt::XSDT;
use vm_memory::{Bytes, GuestAddress};

use crate::error::{Error, Result};
use crate::layout::{IOAPIC_ADDR, LAPIC_ADDR, RSDP_ADDR};
use crate::memory::GuestMemory;

const OEM_ID: [u8; 6] = *b"FERRY ";
const OEM_TABLE_ID: [u8; 8] = *b"FERRYVM ";
/// The XSDT and MADT follow the RSDP in the BIOS area.
const XSDT_ADDR: u64 = RSDP_ADDR + 0x40;
const MADT_ADDR: u64 = RSDP_ADDR + 0x100;

/// Writes the tables for `vcpus` processors (APIC IDs 0..vcpus); returns the RSDP's address.
pub fn write_tables(memory: &GuestMemory, vcpus: usize) -> Result<u64> {
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
    let mut xsdt = XSDT::new(OEM_ID, OEM_TABLE_ID, 1);
    xsdt.add_entry(MADT_ADDR);
    let rsdp = Rsdp::new(OEM_ID, XSDT_ADDR);
    for (table, addr) in [
        (&rsdp as &dyn Aml, RSDP_ADDR),
        (&xsdt, XSDT_ADDR),
        (&madt, MADT_ADDR),
    ] {
        let mut bytes = Vec::new();
        table.to_aml_bytes(&mut bytes);
        memory
            .write_slice(&bytes, GuestAddress(addr))
            .map_err(|e| Error::Memory(format!("writing ACPI tables: {e}")))?;
    }
    Ok(RSDP_ADDR)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::{MemoryBackend, create_guest_memory};

    fn checksum_ok(bytes: &[u8]) -> bool {
        bytes.iter().fold(0u8, |a, b| a.wrapping_add(*b)) == 0
    }

    #[test]
    fn the_madt_lists_every_vcpu_and_its_checksums_hold() {
        let mem = create_guest_memory(64 << 20, MemoryBackend::Anonymous).unwrap();
        assert_eq!(write_tables(&mem, 4).unwrap(), RSDP_ADDR);
        let mut rsdp = [0u8; 36];
        mem.read_slice(&mut rsdp, GuestAddress(RSDP_ADDR)).unwrap();
        assert_eq!(&rsdp[..8], b"RSD PTR ");
        assert!(checksum_ok(&rsdp[..20]) && checksum_ok(&rsdp));
        let xsdt_addr = u64::from_le_bytes(rsdp[24..32].try_into().unwrap());
        let mut xsdt = [0u8; 44];
        mem.read_slice(&mut xsdt, GuestAddress(xsdt_addr)).unwrap();
        assert_eq!(&xsdt[..4], b"XSDT");
        let madt_addr = u64::from_le_bytes(xsdt[36..44].try_into().unwrap());
        let mut head = [0u8; 8];
        mem.read_slice(&mut head, GuestAddress(madt_addr)).unwrap();
        assert_eq!(&head[..4], b"APIC");
        let len = u32::from_le_bytes(head[4..8].try_into().unwrap()) as usize;
        let mut madt = vec![0u8; len];
        mem.read_slice(&mut madt, GuestAddress(madt_addr)).unwrap();
        assert!(checksum_ok(&madt));
        // Entries after the 44-byte header: type 0 (local APIC, 8 bytes) × 4, type 1 (IOAPIC).
        let (mut at, mut lapics) = (44, Vec::new());
        while at < len {
            let (kind, size) = (madt[at], madt[at + 1] as usize);
            if kind == 0 {
                lapics.push(madt[at + 3]);
            }
            at += size;
        }
        assert_eq!(lapics, vec![0, 1, 2, 3]);
    }
}
