//! The guest-physical memory map ferry builds, and where boot structures go.
//!
//! RAM lies below a 32-bit MMIO hole and above 4 GiB, as Cloud Hypervisor and QEMU's q35 draw
//! it: the hole is the last GiB below 4 GiB ([3 GiB, 4 GiB)), which holds the IOAPIC
//! (0xFEC00000), the local APIC (0xFEE00000) and the windows for memory-mapped devices
//! (virtio-mmio). A guest of up to 3 GiB is one region; a larger one continues at 4 GiB.
//! Why 3 GiB: a round boundary that leaves 1 GiB of 32-bit addresses for devices (Firecracker
//! starts its hole at 3.25 GiB, Cloud Hypervisor at 3 GiB), and no RAM can ever shadow the
//! interrupt controllers.

use migration::RamRange;

/// Start of the 32-bit MMIO hole: RAM below, devices and interrupt controllers inside.
pub const MMIO_HOLE_START: u64 = 3 << 30;
/// End of the hole: RAM continues here.
pub const HIGH_RAM_START: u64 = 4 << 30;
/// Where virtio-mmio devices will be placed (inside the hole, below the IOAPIC).
pub const DEVICE_WINDOW_START: u64 = MMIO_HOLE_START;
pub const IOAPIC_ADDR: u64 = 0xfec0_0000;
pub const LAPIC_ADDR: u64 = 0xfee0_0000;

/// The legacy VGA/ROM area below 1 MiB: reserved in the E820 map, not RAM for the guest.
pub const LOW_RESERVED_START: u64 = 0xa_0000;
pub const LOW_RESERVED_END: u64 = 0x10_0000;

/// PVH `hvm_start_info`, followed by its memory map (up to `MEMMAP_MAX` entries).
pub const START_INFO_ADDR: u64 = 0x6000;
pub const MEMMAP_ADDR: u64 = 0x6040;
pub const MEMMAP_MAX: usize = 16;
/// The command line (PVH or Linux).
pub const CMDLINE_ADDR: u64 = 0x7000;
pub const CMDLINE_MAX: usize = 4096;
/// Linux `boot_params` (the zero page).
pub const ZERO_PAGE_ADDR: u64 = 0x8000;
/// ACPI tables: the RSDP where firmware puts it (the BIOS area, found by scanning too).
pub const RSDP_ADDR: u64 = 0xe_0000;
/// The guest image is linked here; nothing of ferry's may overlap it.
pub const IMAGE_ADDR: u64 = 0x10_0000;

/// The largest guest ferry builds.
pub const MAX_MEMORY: u64 = 512 << 30;

/// Where `memory` bytes of RAM go: below the hole, then above 4 GiB.
pub fn ram_ranges(memory: u64) -> Vec<RamRange> {
    let low = memory.min(MMIO_HOLE_START);
    let mut ranges = vec![RamRange { gpa: 0, len: low }];
    if memory > low {
        ranges.push(RamRange {
            gpa: HIGH_RAM_START,
            len: memory - low,
        });
    }
    ranges
}

/// One E820 entry (PVH memmap entry and Linux `boot_e820_entry` alike).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct E820Entry {
    pub addr: u64,
    pub size: u64,
    pub kind: u32,
}

pub const E820_RAM: u32 = 1;
pub const E820_RESERVED: u32 = 2;

/// The memory map a guest of `memory` bytes is told: RAM below 640 KiB, the legacy area
/// reserved, RAM from 1 MiB to the hole, the interrupt controllers reserved, RAM above 4 GiB.
pub fn e820(memory: u64) -> Vec<E820Entry> {
    let mut map = Vec::new();
    for r in ram_ranges(memory) {
        if r.gpa == 0 {
            map.push(E820Entry {
                addr: 0,
                size: LOW_RESERVED_START,
                kind: E820_RAM,
            });
            map.push(E820Entry {
                addr: LOW_RESERVED_START,
                size: LOW_RESERVED_END - LOW_RESERVED_START,
                kind: E820_RESERVED,
            });
            map.push(E820Entry {
                addr: LOW_RESERVED_END,
                size: r.len - LOW_RESERVED_END,
                kind: E820_RAM,
            });
            map.push(E820Entry {
                addr: IOAPIC_ADDR,
                size: 0x1000,
                kind: E820_RESERVED,
            });
            map.push(E820Entry {
                addr: LAPIC_ADDR,
                size: 0x1000,
                kind: E820_RESERVED,
            });
        } else {
            map.push(E820Entry {
                addr: r.gpa,
                size: r.len,
                kind: E820_RAM,
            });
        }
    }
    map
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ram_never_covers_the_hole() {
        for gib in [1u64, 3, 4, 5, 6, 64] {
            let mem = gib << 30;
            let ranges = ram_ranges(mem);
            assert_eq!(ranges.iter().map(|r| r.len).sum::<u64>(), mem, "{gib} GiB");
            for r in &ranges {
                let end = r.gpa + r.len;
                assert!(end <= MMIO_HOLE_START || r.gpa >= HIGH_RAM_START, "{r:?}");
            }
            let ram: u64 = e820(mem)
                .iter()
                .filter(|e| e.kind == E820_RAM)
                .map(|e| e.size)
                .sum();
            assert_eq!(ram, mem - (LOW_RESERVED_END - LOW_RESERVED_START));
            assert!(e820(mem).iter().all(|e| e.kind != E820_RAM
                || e.addr + e.size <= MMIO_HOLE_START
                || e.addr >= HIGH_RAM_START));
        }
        let mem = (3 << 30) + (1 << 29);
        assert_eq!(
            ram_ranges(mem),
            vec![
                RamRange {
                    gpa: 0,
                    len: 3 << 30
                },
                RamRange {
                    gpa: 4 << 30,
                    len: 1 << 29
                }
            ]
        );
    }
}
