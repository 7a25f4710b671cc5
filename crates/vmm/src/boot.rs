//! PVH boot: load the guest ELF, write `hvm_start_info`, the memory map, the command line, a
//! GDT and identity page tables, and give each vCPU its 64-bit entry state.
//!
//! On PVM (see DESIGN section 4) guests must run in the lower half; ferry enters every vCPU
//! directly in long mode at the ELF entry with `%rdi` = vCPU index and `%rsi` = start_info.

use std::fs::File;
use std::path::Path;

use kvm_bindings::{kvm_regs, kvm_segment, kvm_sregs};
use linux_loader::loader::KernelLoader;
use linux_loader::loader::elf::start_info::{hvm_memmap_table_entry, hvm_start_info};
use linux_loader::loader::elf::{Elf, PvhBootCapability};
use vm_memory::{Address, Bytes, GuestAddress, GuestMemoryBackend};

use crate::error::{Error, Result};
use crate::layout::*;
use crate::memory::GuestMemory;

const XEN_HVM_START_MAGIC: u32 = 0x336e_c578;
const E820_RAM: u32 = 1;
const PAGE_PRESENT_RW: u64 = 0x3;
const PAGE_2M: u64 = 0x83;

/// What the loaded image told us.
#[derive(Clone, Copy, Debug)]
pub struct BootInfo {
    /// 64-bit entry (ELF `e_entry`).
    pub entry: u64,
}

/// Loads the ELF and writes every boot structure the guest expects.
pub fn load_guest(memory: &GuestMemory, path: &Path, cmdline: &str) -> Result<BootInfo> {
    let image_err = |reason: String| Error::GuestImage {
        path: path.to_path_buf(),
        reason,
    };
    let mut file = File::open(path).map_err(|e| image_err(e.to_string()))?;
    let loaded = Elf::load(memory, None, &mut file, Some(GuestAddress(IMAGE_ADDR)))
        .map_err(|e| image_err(format!("not a loadable 64-bit ELF: {e}")))?;
    if !matches!(loaded.pvh_boot_cap, PvhBootCapability::PvhEntryPresent(_)) {
        return Err(image_err(
            "no PVH entry note (XEN_ELFNOTE_PHYS32_ENTRY): not a PVH guest".into(),
        ));
    }
    write_cmdline(memory, cmdline)?;
    write_start_info(memory)?;
    write_gdt(memory)?;
    write_page_tables(memory)?;
    Ok(BootInfo {
        entry: loaded.kernel_load.raw_value(),
    })
}

fn write_cmdline(memory: &GuestMemory, cmdline: &str) -> Result<()> {
    if cmdline.len() >= CMDLINE_MAX {
        return Err(Error::Cmdline(format!(
            "{} bytes is longer than the {} the guest accepts",
            cmdline.len(),
            CMDLINE_MAX - 1
        )));
    }
    if cmdline.bytes().any(|b| b == 0) {
        return Err(Error::Cmdline("contains a NUL byte".into()));
    }
    let mut bytes = cmdline.as_bytes().to_vec();
    bytes.push(0);
    memory
        .write_slice(&bytes, GuestAddress(CMDLINE_ADDR))
        .map_err(|e| Error::Memory(e.to_string()))
}

fn write_start_info(memory: &GuestMemory) -> Result<()> {
    let ram = hvm_memmap_table_entry {
        addr: 0,
        size: memory.last_addr().raw_value() + 1,
        type_: E820_RAM,
        reserved: 0,
    };
    let info = hvm_start_info {
        magic: XEN_HVM_START_MAGIC,
        version: 1,
        cmdline_paddr: CMDLINE_ADDR,
        memmap_paddr: MEMMAP_ADDR,
        memmap_entries: 1,
        ..Default::default()
    };
    let mem_err = |e: vm_memory::GuestMemoryError| Error::Memory(e.to_string());
    memory
        .write_obj(ram, GuestAddress(MEMMAP_ADDR))
        .map_err(mem_err)?;
    memory
        .write_obj(info, GuestAddress(START_INFO_ADDR))
        .map_err(mem_err)
}

/// null, null, 64-bit code at 0x10, data at 0x18: the selectors DESIGN section 4 verified.
const GDT: [u64; 4] = [0, 0, 0x00af_9a00_0000_ffff, 0x00cf_9200_0000_ffff];

fn write_gdt(memory: &GuestMemory) -> Result<()> {
    for (i, entry) in GDT.iter().enumerate() {
        memory
            .write_obj(*entry, GuestAddress(GDT_ADDR + 8 * i as u64))
            .map_err(|e| Error::Memory(e.to_string()))?;
    }
    Ok(())
}

/// Identity map of all guest memory with 2 MiB pages.
fn write_page_tables(memory: &GuestMemory) -> Result<()> {
    let gib = (memory.last_addr().raw_value() >> 30) + 1;
    let mem_err = |e: vm_memory::GuestMemoryError| Error::Memory(e.to_string());
    memory
        .write_obj(PDPT_ADDR | PAGE_PRESENT_RW, GuestAddress(PML4_ADDR))
        .map_err(mem_err)?;
    for g in 0..gib {
        let pd = PD_ADDR + g * 4096;
        memory
            .write_obj(pd | PAGE_PRESENT_RW, GuestAddress(PDPT_ADDR + g * 8))
            .map_err(mem_err)?;
        let entries: Vec<u8> = (0..512u64)
            .flat_map(|i| (((g << 30) + (i << 21)) | PAGE_2M).to_le_bytes())
            .collect();
        memory
            .write_slice(&entries, GuestAddress(pd))
            .map_err(mem_err)?;
    }
    Ok(())
}

fn segment(selector: u16, code: bool) -> kvm_segment {
    kvm_segment {
        base: 0,
        limit: 0xffff_ffff,
        selector,
        type_: if code { 0xb } else { 0x3 },
        present: 1,
        dpl: 0,
        db: u8::from(!code),
        s: 1,
        l: u8::from(code),
        g: 1,
        avl: 0,
        unusable: 0,
        padding: 0,
    }
}

/// Long mode, paging on, flat segments (DESIGN section 4 lists the values PVM accepts).
pub fn long_mode_sregs(mut sregs: kvm_sregs) -> kvm_sregs {
    sregs.cs = segment(CODE_SELECTOR, true);
    let data = segment(DATA_SELECTOR, false);
    sregs.ds = data;
    sregs.es = data;
    sregs.fs = data;
    sregs.gs = data;
    sregs.ss = data;
    sregs.gdt.base = GDT_ADDR;
    sregs.gdt.limit = (GDT.len() * 8 - 1) as u16;
    sregs.idt.base = 0;
    sregs.idt.limit = 0;
    sregs.cr3 = PML4_ADDR;
    sregs.cr4 = 0x20;
    sregs.cr0 = 0x8005_0033;
    sregs.efer = 0xd01;
    sregs
}

/// The general registers of vCPU `index` at entry.
pub fn entry_regs(boot: &BootInfo, index: usize) -> kvm_regs {
    kvm_regs {
        rip: boot.entry,
        rdi: index as u64,
        rsi: START_INFO_ADDR,
        rflags: 0x2,
        ..Default::default()
    }
}
