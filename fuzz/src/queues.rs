//! `virtio_queues`: a guest that programs a virtio device any way it likes. The input drives
//! a virtio-mmio transport of a balloon or a disk over 16 MiB of guest memory as a driver
//! would, but with any values: register writes (features, status, queue addresses and
//! sizes, notifications) and writes of any bytes into guest memory (descriptor tables,
//! rings, page-number arrays, requests). The device must never panic and must serve a
//! notification a bounded turn at a time (a balloon moves at most a turn's worth of pages in
//! each); a device it refuses is marked broken, not the VMM's.

use std::os::fd::AsRawFd;
use std::sync::OnceLock;

use migration::bitmap::Bitmap;
use vm_memory::{Bytes, GuestAddress};
use vmm::devices::virtio::balloon::{Balloon, BalloonConfig};
use vmm::devices::virtio::block::{Block, DiskConfig};
use vmm::devices::virtio::mmio::MmioTransport;
use vmm::memory::{MIN_MEMORY, MemoryBackend, create_guest_memory};
use vmm_sys_util::eventfd::{EFD_NONBLOCK, EventFd};

/// Steps taken from one input, at most.
const MAX_STEPS: usize = 256;
/// Turns served for one notification here, at most (a request of millions of scattered pages
/// takes up to a million; the device's I/O thread would serve them all, a turn at a time).
const MAX_TURNS: usize = 256;
/// Pages a balloon may give back or take in one turn, at most: a turn's budget (4096 units,
/// a page at least one) and the run it was gathering when the budget ran out.
const MAX_PAGES_PER_TURN: u64 = 2 * 4096;
/// virtio-mmio's `QueueNotify` register.
const QUEUE_NOTIFY: u64 = 0x50;

/// A writable eight-sector disk of this process's own.
fn disk() -> DiskConfig {
    static DISK: OnceLock<std::fs::File> = OnceLock::new();
    let disk = DISK.get_or_init(|| crate::memfd_with(&[0u8; 4096]));
    DiskConfig {
        path: format!("/proc/self/fd/{}", disk.as_raw_fd()).into(),
        readonly: false,
    }
}

fn transport(kind: u8) -> MmioTransport {
    let irq = EventFd::new(EFD_NONBLOCK).expect("an eventfd");
    let device: Box<dyn vmm::devices::virtio::VirtioDevice> = match kind % 2 {
        0 => Box::new(Balloon::new(&BalloonConfig::default()).expect("a balloon")),
        _ => Box::new(Block::open(&disk(), true).expect("a disk")),
    };
    MmioTransport::new(device, irq)
}

pub fn virtio_queues(data: &[u8]) {
    let Some((&kind, mut rest)) = data.split_first() else {
        return;
    };
    let memory = create_guest_memory(MIN_MEMORY, MemoryBackend::Anonymous).expect("memory");
    let mut t = transport(kind);
    let mut log = Bitmap::new(MIN_MEMORY / 4096);
    for _ in 0..MAX_STEPS {
        let Some((&op, tail)) = rest.split_first() else {
            return;
        };
        rest = tail;
        match op % 3 {
            // A register write: offset (u16, within the window), value (u32).
            0 | 1 => {
                let Some((step, tail)) = rest.split_at_checked(6) else {
                    return;
                };
                rest = tail;
                let offset = u64::from(u16::from_le_bytes([step[0], step[1]]) & 0x1fc);
                if offset == QUEUE_NOTIFY {
                    let queue = u32::from_le_bytes(step[2..6].try_into().unwrap()) as usize;
                    serve(&mut t, queue, &memory, &mut log);
                } else {
                    t.write(offset, &step[2..6], &memory, &mut log);
                }
            }
            // Bytes into guest memory: address (u32), length (u8), the bytes.
            _ => {
                let Some((head, tail)) = rest.split_at_checked(5) else {
                    return;
                };
                let len = usize::from(head[4]).min(tail.len());
                let at = u64::from(u32::from_le_bytes(head[..4].try_into().unwrap()));
                let _ = memory.write_slice(&tail[..len], GuestAddress(at % MIN_MEMORY));
                rest = &tail[len..];
            }
        }
        // What vm.info reads, after each step.
        let _ = (t.device().counters(), t.device().describe(), t.broken());
    }
}

/// Serves `queue` as the device's I/O thread does, a turn at a time, each bounded.
fn serve(t: &mut MmioTransport, queue: usize, memory: &vmm::memory::GuestMemory, log: &mut Bitmap) {
    let mut before = pages_moved(t);
    for _ in 0..MAX_TURNS {
        let more = t.notify(queue, memory, log);
        let after = pages_moved(t);
        assert!(
            after.saturating_sub(before) <= MAX_PAGES_PER_TURN,
            "a turn moved {} pages",
            after - before
        );
        before = after;
        if !more {
            return;
        }
    }
}

/// The pages a balloon has given back or taken back so far (0 for a disk).
fn pages_moved(t: &MmioTransport) -> u64 {
    t.device()
        .counters()
        .iter()
        .filter(|(name, _)| name.starts_with("pages_"))
        .map(|(_, n)| n)
        .sum()
}
