//! The guest pages a paused vCPU will touch first when it runs again: under its instruction
//! and stack pointers, its descriptor tables, and any register that holds an address the guest
//! maps, with the page tables that map them. Post-copy sends these with the state, so that
//! the first instructions after the switch do not each wait a round trip for a page.
//!
//! Written here: no rust-vmm crate walks a guest's page tables from a saved `kvm_sregs`.

use kvm_bindings::{kvm_regs, kvm_sregs};
use migration::GuestRam;

const CR0_PG: u64 = 1 << 31;
const EFER_LMA: u64 = 1 << 10;
const PRESENT: u64 = 1;
const HUGE: u64 = 1 << 7;
/// Bits 51:12 of a table entry: the next table's (or a 4 KiB page's) address.
const ADDRESS: u64 = 0x000f_ffff_ffff_f000;
/// Most pages one vCPU names (each register contributes at most five).
const MOST_PER_VCPU: usize = 128;

/// Guest page numbers the vCPU with these registers touches first (page tables included),
/// without repeats; addresses the guest does not map are left out.
pub fn of_vcpu(ram: &GuestRam, regs: &kvm_regs, sregs: &kvm_sregs) -> Vec<u64> {
    let stack = regs.rsp;
    let mut addresses = vec![
        regs.rip,
        stack,
        stack.wrapping_sub(4096), // the next pushes
        sregs.gdt.base,
        sregs.idt.base,
        sregs.tr.base,
    ];
    addresses.extend([
        regs.rax, regs.rbx, regs.rcx, regs.rdx, regs.rsi, regs.rdi, regs.rbp, regs.r8, regs.r9,
        regs.r10, regs.r11, regs.r12, regs.r13, regs.r14, regs.r15,
    ]);
    let mut pages = Vec::new();
    for va in addresses {
        for pfn in walk(ram, sregs, va) {
            if !pages.contains(&pfn) && pages.len() < MOST_PER_VCPU {
                pages.push(pfn);
            }
        }
    }
    pages
}

/// The pages the MMU reads to translate `va` (its page tables), then the page `va` lands in;
/// empty when `va` is not mapped, lands outside RAM, or the vCPU uses a paging mode other
/// than none or 4-level long mode (this guest's modes).
fn walk(ram: &GuestRam, sregs: &kvm_sregs, va: u64) -> Vec<u64> {
    if sregs.cr0 & CR0_PG == 0 {
        let pfn = va >> 12;
        return if ram.contains(pfn) {
            vec![pfn]
        } else {
            Vec::new()
        };
    }
    if sregs.efer & EFER_LMA == 0 {
        return Vec::new();
    }
    let mut pages = Vec::with_capacity(5);
    let mut table = sregs.cr3 & ADDRESS;
    for level in (1..=4u32).rev() {
        let shift = 12 + 9 * (level - 1);
        let Some(entry) = read_entry(ram, table, (va >> shift) & 511) else {
            return Vec::new();
        };
        pages.push(table >> 12);
        if entry & PRESENT == 0 {
            return Vec::new();
        }
        if level == 1 || (level <= 3 && entry & HUGE != 0) {
            let offset_mask = (1u64 << shift) - 1;
            let gpa = (entry & ADDRESS & !offset_mask) | (va & offset_mask);
            if !ram.contains(gpa >> 12) {
                return Vec::new();
            }
            pages.push(gpa >> 12);
            return pages;
        }
        table = entry & ADDRESS;
    }
    unreachable!("level 1 returns")
}

/// Entry `index` of the page table at guest-physical `table`; `None` outside RAM.
fn read_entry(ram: &GuestRam, table: u64, index: u64) -> Option<u64> {
    let page = ram.page(table >> 12).ok()?;
    let at = (index * 8) as usize;
    Some(u64::from_le_bytes(page[at..at + 8].try_into().ok()?))
}

#[cfg(test)]
mod tests {
    use super::*;
    use migration::RamRange;

    const PAGES: usize = 64;

    fn ram(buf: &mut [u8]) -> GuestRam {
        let r = RamRange {
            gpa: 0,
            len: buf.len() as u64,
        };
        // SAFETY: `buf` outlives every use of the returned view in these tests.
        unsafe { GuestRam::new(&[(r, buf.as_mut_ptr())]) }.unwrap()
    }

    fn set(buf: &mut [u8], table_pfn: u64, index: u64, entry: u64) {
        let at = (table_pfn * 4096 + index * 8) as usize;
        buf[at..at + 8].copy_from_slice(&entry.to_le_bytes());
    }

    /// Long mode: PML4 at page 1, PDPT at 2, PD at 3, PT at 4. `va_small` maps through the PT
    /// to page 40; `va_huge` through a 2 MiB entry of the PD (whose frame is outside this
    /// 256 KiB RAM, so it is left out); everything else is unmapped.
    #[test]
    fn walks_four_levels_and_names_each_table_and_the_page() {
        let mut buf = vec![0u8; PAGES * 4096];
        let va_small: u64 = 0x0000_0080_4020_3123; // PML4 1, PDPT 1, PD 1, PT 3
        set(&mut buf, 1, 1, (2 << 12) | PRESENT);
        set(&mut buf, 2, 1, (3 << 12) | PRESENT);
        set(&mut buf, 3, 1, (4 << 12) | PRESENT);
        set(&mut buf, 4, 3, (40 << 12) | PRESENT);
        let va_huge: u64 = 0x0000_0080_4040_0000; // PD 2: a 2 MiB page at 4 MiB
        set(&mut buf, 3, 2, (4 << 20) | PRESENT | HUGE);
        let ram = ram(&mut buf);
        let mut sregs = kvm_sregs {
            cr0: CR0_PG,
            cr3: 1 << 12,
            efer: EFER_LMA,
            ..Default::default()
        };
        assert_eq!(walk(&ram, &sregs, va_small), vec![1, 2, 3, 4, 40]);
        assert!(walk(&ram, &sregs, va_huge).is_empty(), "outside RAM");
        assert!(walk(&ram, &sregs, 0x1000).is_empty(), "not mapped");
        // A 2 MiB page inside RAM: the tables above it, then the page.
        set(&mut buf, 3, 2, PRESENT | HUGE);
        assert_eq!(walk(&ram, &sregs, va_huge + 0x5123), vec![1, 2, 3, 5]);

        let regs = kvm_regs {
            rip: va_small,
            rsp: va_huge + 0x5010,
            rax: 0xdead_0000_0000, // not an address the guest maps
            ..Default::default()
        };
        let hot = of_vcpu(&ram, &regs, &sregs);
        assert_eq!(hot, vec![1, 2, 3, 4, 40, 5], "each page once: {hot:?}");

        // Without paging an address is its own guest-physical address.
        sregs.cr0 = 0;
        assert_eq!(walk(&ram, &sregs, 0x7123), vec![7]);
        assert!(walk(&ram, &sregs, (PAGES as u64) << 12).is_empty());
    }
}
