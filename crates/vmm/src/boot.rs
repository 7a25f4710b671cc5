//! Booting a guest the standard ways, through linux-loader:
//!
//! - **PVH** (`--guest`): any ELF with a `XEN_ELFNOTE_PHYS32_ENTRY` note. The boot vCPU enters
//!   that entry in 32-bit protected mode with paging off and `%ebx` = the guest-physical
//!   address of `hvm_start_info` (magic, command line, E820 memory map, ACPI RSDP), as QEMU
//!   and Cloud Hypervisor enter it.
//! - **Linux** (`--kernel`): a bzImage or vmlinux, entered by the 64-bit boot protocol with
//!   `%rsi` = the zero page (`boot_params`: setup header, command line, initrd, E820 map).
//!
//! Either way only the boot vCPU runs at first; the others wait in KVM for INIT/SIPI, which
//! the guest sends through its local APIC once it has read the ACPI MADT (see `acpi`).

use std::fs::File;
use std::path::Path;

use kvm_bindings::{kvm_regs, kvm_segment, kvm_sregs};
use linux_loader::configurator::linux::LinuxBootConfigurator;
use linux_loader::configurator::pvh::PvhBootConfigurator;
use linux_loader::configurator::{BootConfigurator, BootParams};
use linux_loader::loader::bootparam::{boot_e820_entry, boot_params};
use linux_loader::loader::bzimage::BzImage;
use linux_loader::loader::elf::start_info::{hvm_memmap_table_entry, hvm_start_info};
use linux_loader::loader::elf::{Elf, PvhBootCapability};
use linux_loader::loader::{KernelLoader, KernelLoaderResult};
use vm_memory::{Address, Bytes, GuestAddress};

use crate::acpi::Machine;
use crate::error::{Error, Result};
use crate::layout::*;
use crate::memory::GuestMemory;

const XEN_HVM_START_MAGIC: u32 = 0x336e_c578;
/// Linux boot protocol: "HdrS", the boot flag, and "loader unknown to the kernel".
const KERNEL_HDR_MAGIC: u32 = 0x5372_6448;
const KERNEL_BOOT_FLAG_MAGIC: u16 = 0xaa55;
const KERNEL_LOADER_OTHER: u8 = 0xff;
/// bzImage: the 64-bit entry lies this far into the protected-mode kernel.
const BZIMAGE_64BIT_ENTRY_OFFSET: u64 = 0x200;
/// Where an initrd goes: the top of RAM below the hole, page-aligned.
const INITRD_ALIGN: u64 = 4096;

/// How the boot vCPU enters the guest.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Entry {
    /// 32-bit protected mode, paging off, `%ebx` = `hvm_start_info`.
    Pvh { entry: u64 },
    /// 64-bit mode with identity page tables, `%rsi` = the zero page.
    Linux64 { entry: u64 },
}

fn image_err(path: &Path, reason: impl Into<String>) -> Error {
    Error::GuestImage {
        path: path.to_path_buf(),
        reason: reason.into(),
    }
}

fn mem_err(e: vm_memory::GuestMemoryError) -> Error {
    Error::Memory(e.to_string())
}

/// Loads a PVH ELF and writes `hvm_start_info`, its memory map, the command line and the
/// ACPI tables.
pub fn load_pvh(
    memory: &GuestMemory,
    memory_bytes: u64,
    path: &Path,
    cmdline: &str,
    machine: &Machine,
) -> Result<Entry> {
    let mut file = File::open(path).map_err(|e| image_err(path, e.to_string()))?;
    let loaded = Elf::load(memory, None, &mut file, Some(GuestAddress(IMAGE_ADDR)))
        .map_err(|e| image_err(path, format!("not a loadable ELF: {e}")))?;
    let PvhBootCapability::PvhEntryPresent(entry) = loaded.pvh_boot_cap else {
        return Err(image_err(
            path,
            "no PVH entry note (XEN_ELFNOTE_PHYS32_ENTRY): not a PVH guest (a Linux kernel \
             goes with --kernel)",
        ));
    };
    write_cmdline(memory, cmdline)?;
    let rsdp = crate::acpi::write_tables(memory, machine)?;
    let map: Vec<hvm_memmap_table_entry> = e820(memory_bytes)
        .iter()
        .map(|e| hvm_memmap_table_entry {
            addr: e.addr,
            size: e.size,
            type_: e.kind,
            reserved: 0,
        })
        .collect();
    let info = hvm_start_info {
        magic: XEN_HVM_START_MAGIC,
        version: 1,
        cmdline_paddr: CMDLINE_ADDR,
        memmap_paddr: MEMMAP_ADDR,
        memmap_entries: map.len() as u32,
        rsdp_paddr: rsdp,
        ..Default::default()
    };
    let mut params = BootParams::new(&info, GuestAddress(START_INFO_ADDR));
    params.set_sections(&map, GuestAddress(MEMMAP_ADDR));
    PvhBootConfigurator::write_bootparams::<GuestMemory>(&params, memory)
        .map_err(|e| Error::Memory(format!("writing hvm_start_info: {e}")))?;
    Ok(Entry::Pvh {
        entry: entry.raw_value(),
    })
}

/// Loads a Linux kernel (bzImage or vmlinux ELF) and an optional initrd, and writes the zero
/// page, the command line, the ACPI tables and the page tables of the 64-bit boot protocol.
pub fn load_linux(
    memory: &GuestMemory,
    memory_bytes: u64,
    kernel: &Path,
    initrd: Option<&Path>,
    cmdline: &str,
    machine: &Machine,
) -> Result<Entry> {
    let (loaded, entry) = load_kernel(memory, kernel)?;
    write_cmdline(memory, cmdline)?;
    let rsdp = crate::acpi::write_tables(memory, machine)?;
    let mut params = boot_params::default();
    if let Some(header) = loaded.setup_header {
        params.hdr = header;
    }
    params.hdr.header = KERNEL_HDR_MAGIC;
    params.hdr.boot_flag = KERNEL_BOOT_FLAG_MAGIC;
    params.hdr.type_of_loader = KERNEL_LOADER_OTHER;
    params.hdr.cmd_line_ptr = CMDLINE_ADDR as u32;
    params.hdr.cmdline_size = cmdline.len() as u32 + 1;
    params.acpi_rsdp_addr = rsdp;
    if let Some(path) = initrd {
        let (addr, size) = load_initrd(memory, memory_bytes, path, loaded.kernel_end)?;
        params.hdr.ramdisk_image = addr as u32;
        params.hdr.ramdisk_size = size as u32;
    }
    let map = e820(memory_bytes);
    if map.len() > params.e820_table.len() {
        return Err(Error::Memory(
            "the memory map does not fit the zero page".into(),
        ));
    }
    for (slot, e) in params.e820_table.iter_mut().zip(&map) {
        *slot = boot_e820_entry {
            addr: e.addr,
            size: e.size,
            r#type: e.kind,
        };
    }
    params.e820_entries = map.len() as u8;
    LinuxBootConfigurator::write_bootparams::<GuestMemory>(
        &BootParams::new(&params, GuestAddress(ZERO_PAGE_ADDR)),
        memory,
    )
    .map_err(|e| Error::Memory(format!("writing the zero page: {e}")))?;
    write_gdt(memory)?;
    write_page_tables(memory)?;
    Ok(Entry::Linux64 { entry })
}

/// A bzImage first, then an ELF vmlinux; anything else is refused by name.
fn load_kernel(memory: &GuestMemory, path: &Path) -> Result<(KernelLoaderResult, u64)> {
    let mut file = File::open(path).map_err(|e| image_err(path, e.to_string()))?;
    let bz = BzImage::load(memory, None, &mut file, Some(GuestAddress(IMAGE_ADDR)));
    if let Ok(loaded) = bz {
        let entry = loaded.kernel_load.raw_value() + BZIMAGE_64BIT_ENTRY_OFFSET;
        return Ok((loaded, entry));
    }
    let elf = Elf::load(memory, None, &mut file, Some(GuestAddress(IMAGE_ADDR)));
    match elf {
        Ok(loaded) => {
            let entry = loaded.kernel_load.raw_value();
            Ok((loaded, entry))
        }
        Err(e) => Err(image_err(
            path,
            format!("neither a bzImage nor an ELF kernel ({e})"),
        )),
    }
}

/// Whether the ELF at `path` is a Linux kernel: a `vmlinux` carries notes owned by "Linux"
/// (its build's `.notes`). A Linux kernel with a PVH note boots either way; ferry boots it by
/// the Linux protocol, which tells it the CPU model's leftovers on its command line.
/// linux-loader keeps its ELF structures private, hence the few reads here.
pub fn is_linux_elf(path: &Path) -> bool {
    use std::os::unix::fs::FileExt;
    let Ok(file) = File::open(path) else {
        return false;
    };
    has_linux_note(|at, len| {
        let mut bytes = vec![0u8; len];
        file.read_exact_at(&mut bytes, at).ok().map(|()| bytes)
    })
}

/// The most read of an ELF's program headers or of one note segment to tell a Linux kernel
/// (both are small; a kernel image is tens of MiB, and only these parts are read).
const ELF_READ_MAX: u64 = 64 << 10;

/// `read(offset, len)`: that much of the image, if it is all there.
fn has_linux_note(read: impl Fn(u64, usize) -> Option<Vec<u8>>) -> bool {
    const PT_NOTE: u64 = 4;
    const PHDR_LEN: u64 = 56;
    // ELF64, little-endian: e_phoff at 0x20, e_phentsize at 0x36, e_phnum at 0x38.
    let Some(head) = read(0, 64) else {
        return false;
    };
    if head[..6] != *b"\x7fELF\x02\x01" {
        return false;
    }
    let (Some(phoff), Some(entsize), Some(count)) = (
        le::<8>(&head, 0x20),
        le::<2>(&head, 0x36),
        le::<2>(&head, 0x38),
    ) else {
        return false;
    };
    if entsize < PHDR_LEN || entsize * count > ELF_READ_MAX {
        return false;
    }
    let Some(table) = read(phoff, (entsize * count) as usize) else {
        return false;
    };
    table.chunks_exact(entsize as usize).any(|ph| {
        match (le::<4>(ph, 0), le::<8>(ph, 8), le::<8>(ph, 32)) {
            (Some(PT_NOTE), Some(offset), Some(size)) if size <= ELF_READ_MAX => {
                read(offset, size as usize).is_some_and(|notes| has_owner(&notes, b"Linux"))
            }
            _ => false,
        }
    })
}

/// Whether one of the ELF notes in `notes` is owned by `owner`.
fn has_owner(notes: &[u8], owner: &[u8]) -> bool {
    let mut at = 0usize;
    while let (Some(name_len), Some(desc_len)) = (le::<4>(notes, at), le::<4>(notes, at + 4)) {
        let name_at = at + 12;
        let name = notes.get(name_at..name_at.saturating_add(name_len as usize));
        // The name's length counts its closing NUL.
        if name.is_some_and(|n| n.strip_suffix(b"\0") == Some(owner)) {
            return true;
        }
        let padded = |n: u64| n.div_ceil(4) * 4;
        at = name_at.saturating_add((padded(name_len) + padded(desc_len)) as usize);
    }
    false
}

/// The `N`-byte little-endian number at `at` in `bytes`, if it is all there.
fn le<const N: usize>(bytes: &[u8], at: usize) -> Option<u64> {
    let field = bytes.get(at..at.checked_add(N)?)?;
    Some(field.iter().rev().fold(0, |n, &b| n << 8 | u64::from(b)))
}

/// Places the initrd at the top of RAM below the hole, above the kernel.
fn load_initrd(
    memory: &GuestMemory,
    memory_bytes: u64,
    path: &Path,
    kernel_end: u64,
) -> Result<(u64, u64)> {
    let data = std::fs::read(path).map_err(|e| image_err(path, e.to_string()))?;
    let size = data.len() as u64;
    let top = memory_bytes.min(MMIO_HOLE_START);
    let addr = top.saturating_sub(size) / INITRD_ALIGN * INITRD_ALIGN;
    if size == 0 || addr <= kernel_end {
        return Err(image_err(
            path,
            format!("an initrd of {size} bytes does not fit between the kernel and the hole"),
        ));
    }
    memory
        .write_slice(&data, GuestAddress(addr))
        .map_err(mem_err)?;
    Ok((addr, size))
}

fn write_cmdline(memory: &GuestMemory, cmdline: &str) -> Result<()> {
    if cmdline.len() >= CMDLINE_MAX {
        return Err(Error::Cmdline(format!(
            "{} bytes is longer than the {} the guest accepts",
            cmdline.len(),
            CMDLINE_MAX - 1
        )));
    }
    let mut line = linux_loader::cmdline::Cmdline::new(CMDLINE_MAX)
        .map_err(|e| Error::Cmdline(e.to_string()))?;
    if !cmdline.is_empty() {
        line.insert_str(cmdline)
            .map_err(|e| Error::Cmdline(format!("{e}")))?;
    }
    linux_loader::loader::load_cmdline(memory, GuestAddress(CMDLINE_ADDR), &line)
        .map_err(|e| Error::Cmdline(e.to_string()))
}

// ---- the Linux 64-bit boot protocol's CPU state ----

/// null, null, 64-bit code (0x10), data (0x18).
const GDT: [u64; 4] = [0, 0, 0x00af_9a00_0000_ffff, 0x00cf_9200_0000_ffff];
const GDT_ADDR: u64 = 0x500;
const PML4_ADDR: u64 = 0x1000;
const PDPT_ADDR: u64 = 0x2000;
/// Four page directories: the first 4 GiB in 2 MiB pages (the kernel maps the rest itself).
const PD_ADDR: u64 = 0x10000;
const CODE_SELECTOR: u16 = 0x10;
const DATA_SELECTOR: u16 = 0x18;
const PAGE_PRESENT_RW: u64 = 0x3;
const PAGE_2M: u64 = 0x83;

fn write_gdt(memory: &GuestMemory) -> Result<()> {
    for (i, entry) in GDT.iter().enumerate() {
        memory
            .write_obj(*entry, GuestAddress(GDT_ADDR + 8 * i as u64))
            .map_err(mem_err)?;
    }
    Ok(())
}

fn write_page_tables(memory: &GuestMemory) -> Result<()> {
    memory
        .write_obj(PDPT_ADDR | PAGE_PRESENT_RW, GuestAddress(PML4_ADDR))
        .map_err(mem_err)?;
    for g in 0..4u64 {
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

fn segment(selector: u16, code: bool, long: bool) -> kvm_segment {
    kvm_segment {
        base: 0,
        limit: 0xffff_ffff,
        selector,
        type_: if code { 0xb } else { 0x3 },
        present: 1,
        dpl: 0,
        db: u8::from(!long || !code),
        s: 1,
        l: u8::from(long && code),
        g: 1,
        avl: 0,
        unusable: 0,
        padding: 0,
    }
}

fn flat_segments(sregs: &mut kvm_sregs, code: kvm_segment, data: kvm_segment) {
    sregs.cs = code;
    sregs.ds = data;
    sregs.es = data;
    sregs.fs = data;
    sregs.gs = data;
    sregs.ss = data;
}

/// The boot vCPU's special registers for `entry`.
pub fn entry_sregs(entry: Entry, mut sregs: kvm_sregs) -> kvm_sregs {
    match entry {
        Entry::Pvh { .. } => {
            // Flat 32-bit protected mode, paging off: what the PVH ABI promises.
            flat_segments(
                &mut sregs,
                segment(0x8, true, false),
                segment(0x10, false, false),
            );
            sregs.cr0 = 0x11; // PE | ET
            sregs.cr4 = 0;
            sregs.efer = 0;
        }
        Entry::Linux64 { .. } => {
            flat_segments(
                &mut sregs,
                segment(CODE_SELECTOR, true, true),
                segment(DATA_SELECTOR, false, true),
            );
            sregs.gdt.base = GDT_ADDR;
            sregs.gdt.limit = (GDT.len() * 8 - 1) as u16;
            sregs.idt.base = 0;
            sregs.idt.limit = 0;
            sregs.cr3 = PML4_ADDR;
            sregs.cr4 = 0x20; // PAE
            sregs.cr0 = 0x8005_0033; // PG | AM | WP | NE | ET | MP | PE
            sregs.efer = 0xd01; // SCE | LME | LMA | NXE
        }
    }
    sregs
}

/// The boot vCPU's general registers for `entry`.
pub fn entry_regs(entry: Entry) -> kvm_regs {
    match entry {
        Entry::Pvh { entry } => kvm_regs {
            rip: entry,
            rbx: START_INFO_ADDR,
            rflags: 0x2,
            ..Default::default()
        },
        Entry::Linux64 { entry } => kvm_regs {
            rip: entry,
            rsi: ZERO_PAGE_ADDR,
            rflags: 0x2,
            ..Default::default()
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::{MemoryBackend, create_guest_memory};

    fn one_vcpu() -> Machine {
        Machine {
            vcpus: 1,
            virtio: Vec::new(),
        }
    }

    /// An ELF64 image with one PT_NOTE segment holding a note owned by `owner`.
    fn elf_with_note(owner: &[u8]) -> Vec<u8> {
        let mut image = vec![0u8; 64 + 56];
        image[..6].copy_from_slice(b"\x7fELF\x02\x01");
        image[0x20..0x28].copy_from_slice(&64u64.to_le_bytes());
        image[0x36..0x38].copy_from_slice(&56u16.to_le_bytes());
        image[0x38..0x3a].copy_from_slice(&1u16.to_le_bytes());
        let mut note = Vec::new();
        for word in [owner.len() as u32 + 1, 4, 1] {
            note.extend_from_slice(&word.to_le_bytes());
        }
        note.extend_from_slice(owner);
        note.push(0);
        note.resize(note.len().next_multiple_of(4), 0);
        note.extend_from_slice(&[0; 4]);
        let at = image.len() as u64;
        image[64..68].copy_from_slice(&4u32.to_le_bytes());
        image[72..80].copy_from_slice(&at.to_le_bytes());
        image[96..104].copy_from_slice(&(note.len() as u64).to_le_bytes());
        image.extend_from_slice(&note);
        image
    }

    /// Whether `image`, read as a file would be, is a Linux kernel.
    fn linux(image: &[u8]) -> bool {
        has_linux_note(|at, len| {
            let at = usize::try_from(at).ok()?;
            image.get(at..at.checked_add(len)?).map(<[u8]>::to_vec)
        })
    }

    #[test]
    fn a_linux_kernel_is_told_by_its_notes() {
        assert!(linux(&elf_with_note(b"Linux")));
        assert!(!linux(&elf_with_note(b"Xen")), "a PVH guest's note");
        assert!(!linux(&elf_with_note(b"Linu")));
        let whole = elf_with_note(b"Linux");
        for cut in [0, 10, 64, 100, whole.len() - 5] {
            assert!(!linux(&whole[..cut]), "cut at {cut}");
        }
        let mut wild = whole.clone();
        wild[0x20..0x28].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(!linux(&wild), "a program header table past the end");
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("vmlinux");
        std::fs::write(&file, &whole).unwrap();
        assert!(is_linux_elf(&file), "read from a file");
    }

    #[test]
    fn a_file_that_is_no_kernel_is_refused_by_name() {
        let mem = create_guest_memory(64 << 20, MemoryBackend::Anonymous).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let junk = dir.path().join("junk");
        std::fs::write(&junk, vec![0x5au8; 8192]).unwrap();
        let e = load_linux(&mem, 64 << 20, &junk, None, "", &one_vcpu()).unwrap_err();
        assert!(
            e.to_string()
                .contains("neither a bzImage nor an ELF kernel"),
            "{e}"
        );
        let e = load_pvh(&mem, 64 << 20, &junk, "", &one_vcpu()).unwrap_err();
        assert!(e.to_string().contains("not a loadable ELF"), "{e}");
    }
}
