//! Looking at guest memory without sending it: which pages were ever populated (pagemap),
//! and a checksum both ends can compute.

use std::fs::File;
use std::os::unix::fs::FileExt;

use crate::PAGE_SIZE;
use crate::error::Result;
use crate::memory::GuestRam;
use crate::wire::bitmap::Bitmap;
use crate::wire::zero::is_zero_page;

const PM_PRESENT: u64 = 1 << 63;
const PM_SWAPPED: u64 = 1 << 62;
const PAGEMAP_CHUNK: usize = 64 * 1024;

/// Pages of `ram` that hold anything: present in RAM or swapped out. A page never touched is
/// neither, and is skipped without being read (reading it would populate it).
pub fn populated_pages(ram: &GuestRam) -> Result<Bitmap> {
    let pagemap = File::open("/proc/self/pagemap")?;
    let mut out = Bitmap::new(ram.gfn_end());
    let mut entries = vec![0u8; PAGEMAP_CHUNK * 8];
    for (range, host) in ram.host_regions() {
        let first_host_page = host as u64 / PAGE_SIZE as u64;
        let mut done = 0u64;
        while done < range.pages() {
            let n = (range.pages() - done).min(PAGEMAP_CHUNK as u64) as usize;
            let buf = &mut entries[..n * 8];
            pagemap.read_exact_at(buf, (first_host_page + done) * 8)?;
            for (i, e) in buf.chunks_exact(8).enumerate() {
                if u64::from_le_bytes(e.try_into().unwrap()) & (PM_PRESENT | PM_SWAPPED) != 0 {
                    out.set(range.first_gfn() + done + i as u64);
                }
            }
            done += n as u64;
        }
    }
    Ok(out)
}

/// One page's share of `memory_checksum`: CRC32 over (page number, data); 0 for a zero page.
pub fn page_digest(pfn: u64, page: &[u8]) -> u64 {
    if is_zero_page(page) {
        return 0;
    }
    let mut crc = crc32fast::Hasher::new();
    crc.update(&pfn.to_le_bytes());
    crc.update(page);
    u64::from(crc.finalize())
}

/// A checksum of guest memory that both ends can compute: the sum of `page_digest` over every
/// populated page, so never-populated and zero pages count alike, and the order pages arrive
/// in does not matter (post-copy adds them up as they come).
pub fn memory_checksum(ram: &GuestRam) -> Result<u64> {
    memory_checksum_of(ram, &populated_pages(ram)?)
}

/// `memory_checksum` over the pages of `set` only.
pub fn memory_checksum_of(ram: &GuestRam, set: &Bitmap) -> Result<u64> {
    set.iter().try_fold(0u64, |sum, pfn| {
        Ok(sum.wrapping_add(page_digest(pfn, ram.page(pfn)?)))
    })
}
