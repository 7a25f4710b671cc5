//! Where ferry puts boot structures in guest-physical memory (all below the 1 MiB image).

/// Global descriptor table: null, null, 64-bit code (0x10), data (0x18).
pub const GDT_ADDR: u64 = 0x500;
pub const PML4_ADDR: u64 = 0x1000;
pub const PDPT_ADDR: u64 = 0x2000;
/// PVH `hvm_start_info`, followed by the memory map.
pub const START_INFO_ADDR: u64 = 0x3000;
pub const MEMMAP_ADDR: u64 = 0x3100;
pub const CMDLINE_ADDR: u64 = 0x4000;
pub const CMDLINE_MAX: usize = 4096;
/// One page directory (1 GiB of 2 MiB pages) per GiB, up to `MAX_MEMORY`.
pub const PD_ADDR: u64 = 0x10000;
/// The guest image is linked here; nothing of ferry's may overlap it.
pub const IMAGE_ADDR: u64 = 0x100000;

pub const CODE_SELECTOR: u16 = 0x10;
pub const DATA_SELECTOR: u16 = 0x18;

/// The boot page tables map this much; larger guests could not address their memory.
pub const MAX_MEMORY: u64 = 64 << 30;
