//! The Linux boot protocol as ferry speaks it, checked against a real distribution kernel
//! (Debian's, unpacked by scripts/install-deps.sh): the kernel loaded where its header says,
//! the zero page's header, command line, initrd and E820 map: what a distribution kernel's
//! boot starts from. (A distribution kernel's ring 0 needs instructions this platform's KVM
//! cannot emulate; ferry's own Linux guest boots for real in crates/ferry/tests/linux.rs.)

use std::path::PathBuf;

use vm_memory::{Bytes, GuestAddress};
use vmm::acpi::Machine;
use vmm::boot::{Entry, load_linux};
use vmm::layout::{self, CMDLINE_ADDR, RSDP_ADDR, ZERO_PAGE_ADDR};
use vmm::memory::{MemoryBackend, create_guest_memory};

fn kernel() -> PathBuf {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../.cache/kernel/vmlinuz");
    assert!(
        p.exists(),
        "{} is missing: scripts/install-deps.sh (run by make test) fetches Debian's kernel",
        p.display()
    );
    p
}

fn u16_at(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes(b[at..at + 2].try_into().unwrap())
}
fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().unwrap())
}
fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().unwrap())
}

#[test]
fn a_debian_bzimage_gets_a_correct_zero_page_and_e820() {
    let memory = 6u64 << 30;
    let mem = create_guest_memory(memory, MemoryBackend::Anonymous).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let initrd = dir.path().join("initrd");
    std::fs::write(&initrd, vec![0xa5u8; 3 << 20]).unwrap();
    let cmdline = "console=ttyS0 panic=-1";
    let two_vcpus = Machine {
        vcpus: 2,
        virtio: Vec::new(),
    };
    let entry = load_linux(&mem, memory, &kernel(), Some(&initrd), cmdline, &two_vcpus).unwrap();
    assert_eq!(entry, Entry::Linux64 { entry: 0x10_0200 });

    let mut zp = vec![0u8; 4096];
    mem.read_slice(&mut zp, GuestAddress(ZERO_PAGE_ADDR))
        .unwrap();
    // struct boot_params offsets (Documentation/arch/x86/zero-page.rst, boot.rst).
    assert_eq!(u32_at(&zp, 0x202), 0x5372_6448, "setup header magic HdrS");
    assert_eq!(u16_at(&zp, 0x1fe), 0xaa55, "boot flag");
    assert!(
        u16_at(&zp, 0x206) >= 0x20c,
        "protocol version of a current kernel"
    );
    assert_eq!(zp[0x210], 0xff, "type_of_loader");
    assert_eq!(u64_at(&zp, 0x070), RSDP_ADDR, "acpi_rsdp_addr");
    assert_eq!(u32_at(&zp, 0x228), CMDLINE_ADDR as u32, "cmd_line_ptr");
    let mut line = vec![0u8; cmdline.len() + 1];
    mem.read_slice(&mut line, GuestAddress(CMDLINE_ADDR))
        .unwrap();
    assert_eq!(&line[..cmdline.len()], cmdline.as_bytes());
    assert_eq!(line[cmdline.len()], 0);

    let (rd_addr, rd_size) = (u32_at(&zp, 0x218) as u64, u32_at(&zp, 0x21c) as u64);
    assert_eq!(rd_size, 3 << 20);
    assert!(
        rd_addr + rd_size <= layout::MMIO_HOLE_START,
        "below the hole"
    );
    let mut probe = [0u8; 16];
    mem.read_slice(&mut probe, GuestAddress(rd_addr)).unwrap();
    assert_eq!(probe, [0xa5; 16], "the initrd is where the zero page says");

    let want = layout::e820(memory);
    assert_eq!(zp[0x1e8] as usize, want.len(), "e820_entries");
    for (i, e) in want.iter().enumerate() {
        let at = 0x2d0 + 20 * i;
        assert_eq!(
            (u64_at(&zp, at), u64_at(&zp, at + 8), u32_at(&zp, at + 16)),
            (e.addr, e.size, e.kind),
            "e820 entry {i}"
        );
    }

    // The protected-mode kernel follows the real-mode setup sectors in the file.
    let file = std::fs::read(kernel()).unwrap();
    let setup_sects = match file[0x1f1] {
        0 => 4,
        n => n as usize,
    };
    let body = &file[(setup_sects + 1) * 512..][..4096];
    let mut loaded = vec![0u8; 4096];
    mem.read_slice(&mut loaded, GuestAddress(0x10_0000))
        .unwrap();
    assert_eq!(loaded, body, "the kernel is loaded at 1 MiB");
}
