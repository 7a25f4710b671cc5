//! Looking at guest memory without sending it: which pages were ever populated (pagemap, and
//! the backing file for memfd memory), and a checksum both ends can compute.

use std::fs::File;
use std::os::fd::RawFd;
use std::os::unix::fs::FileExt;

use crate::PAGE_SIZE;
use crate::error::Result;
use crate::memory::{GuestRam, RamRange};
use crate::wire::bitmap::Bitmap;
use crate::wire::zero::is_zero_page;

const PM_PRESENT: u64 = 1 << 63;
const PM_SWAPPED: u64 = 1 << 62;
const PAGEMAP_CHUNK: usize = 64 * 1024;

/// Pages of `ram` that hold anything: present in RAM or swapped out. A page never touched is
/// neither, and is skipped without being read (reading it would populate it).
///
/// pagemap sees this process's page tables. That is the whole truth for anonymous memory (a
/// swapped page keeps a swap entry there), but not for a memfd: when the kernel swaps out a
/// shared page it removes the mapping, so the page looks never touched although it holds data
/// (so does a page written through the file). For such regions the file is asked instead.
pub fn populated_pages(ram: &GuestRam) -> Result<Bitmap> {
    let pagemap = File::open("/proc/self/pagemap")?;
    let mut out = Bitmap::new(ram.gfn_end());
    let mut entries = vec![0u8; PAGEMAP_CHUNK * 8];
    for (range, host, file) in ram.backed_regions() {
        if let Some(fd) = file {
            mark_file_data(fd, range, &mut out)?;
            continue;
        }
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

/// Marks the pages of `range` whose backing file `fd` (mapped from offset 0) holds data there:
/// `lseek(SEEK_DATA)` counts a shared page as data wherever it is, in RAM or in swap, so each
/// extent of data costs two calls and each hole none.
fn mark_file_data(fd: RawFd, range: RamRange, out: &mut Bitmap) -> Result<()> {
    let len = range.len as libc::off_t;
    let seek = |from: libc::off_t, whence| {
        // SAFETY: lseek on a file descriptor the VM keeps open; no memory is touched.
        match unsafe { libc::lseek(fd, from, whence) } {
            -1 => Err(std::io::Error::last_os_error()),
            at => Ok(at),
        }
    };
    let mut at = 0;
    while at < len {
        let data = match seek(at, libc::SEEK_DATA) {
            Ok(d) => d,
            // No data at or after `at`.
            Err(e) if e.raw_os_error() == Some(libc::ENXIO) => break,
            Err(e) => return Err(e.into()),
        };
        if data >= len {
            break;
        }
        let hole = seek(data, libc::SEEK_HOLE)?.min(len);
        let page = PAGE_SIZE as libc::off_t;
        for p in data / page..(hole + page - 1) / page {
            out.set(range.first_gfn() + p as u64);
        }
        at = hole;
    }
    Ok(())
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

#[cfg(test)]
mod tests {
    use std::os::fd::{AsRawFd, FromRawFd};
    use std::os::unix::fs::FileExt;

    use super::*;

    /// A page of a memfd that this process does not map holds data all the same: the state of
    /// a shared page the kernel swapped out (its page-table entry is gone). Before the file was
    /// asked, such a page was skipped and arrived as zeros.
    #[test]
    fn memfd_pages_outside_the_page_tables_count() {
        const PAGES: u64 = 64;
        // SAFETY: a plain syscall; the fd is checked and then owned by `file`.
        let fd = unsafe { libc::memfd_create(c"scan-test".as_ptr(), libc::MFD_CLOEXEC) };
        assert!(fd >= 0);
        // SAFETY: a fresh fd nothing else owns.
        let file = unsafe { File::from_raw_fd(fd) };
        file.set_len(PAGES * PAGE_SIZE as u64).unwrap();
        let len = (PAGES as usize) * PAGE_SIZE;
        // SAFETY: a new shared mapping of the whole file, unmapped at the end of the test.
        let host = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        assert_ne!(host, libc::MAP_FAILED);
        let range = RamRange {
            gpa: 0,
            len: len as u64,
        };
        // SAFETY: the mapping and the file outlive `ram` (both end with this test).
        let ram = unsafe { GuestRam::new(&[(range, host.cast())]) }.unwrap();
        // SAFETY: as above.
        let backed = unsafe { ram.clone().with_files(&[Some(file.as_raw_fd())]) }.unwrap();

        // Page 3 written through the mapping, pages 10..12 through the file only.
        ram.write_page(3, &[7u8; PAGE_SIZE]).unwrap();
        file.write_all_at(&[9u8; 2 * PAGE_SIZE], 10 * PAGE_SIZE as u64)
            .unwrap();

        let seen = populated_pages(&backed).unwrap();
        assert_eq!(seen.iter().collect::<Vec<_>>(), vec![3, 10, 11]);
        // pagemap alone (the region without its file) misses the pages it does not map.
        let mapped_only = populated_pages(&ram).unwrap();
        assert_eq!(mapped_only.iter().collect::<Vec<_>>(), vec![3]);
        assert_eq!(
            memory_checksum(&backed).unwrap(),
            memory_checksum_of(&ram, &seen).unwrap()
        );
        // SAFETY: the mapping made above; nothing uses it any more.
        unsafe { libc::munmap(host, len) };
    }
}
