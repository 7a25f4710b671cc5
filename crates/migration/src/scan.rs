//! Looking at guest memory without sending it: which pages were ever populated (pagemap, and
//! the backing file for memfd memory), and a checksum both ends can compute.

use std::fs::File;
use std::os::fd::RawFd;
use std::os::unix::fs::FileExt;

use crate::PAGE_SIZE;
use crate::bitmap::Bitmap;
use crate::error::Result;
use crate::memory::{GuestRam, RamRange};
use crate::zero::is_zero_page;

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
    let mut out = Bitmap::new(ram.gfn_end());
    populated_pages_into(ram, &mut out)?;
    Ok(out)
}

/// `populated_pages` into `out`, a bitmap kept from an earlier call (cleared here): one that
/// is asked often reuses memory already faulted in.
pub fn populated_pages_into(ram: &GuestRam, out: &mut Bitmap) -> Result<()> {
    let pagemap = pagemap()?;
    if out.pages() == ram.gfn_end() {
        out.clear();
    } else {
        *out = Bitmap::new(ram.gfn_end());
    }
    for (range, host, file) in ram.backed_regions() {
        mark_populated(pagemap, (range, host, file), 0..range.pages(), out)?;
    }
    Ok(())
}

static PAGEMAP: std::sync::OnceLock<std::io::Result<File>> = std::sync::OnceLock::new();

/// This process's `/proc/self/pagemap`, opened the first time it is asked for and kept: it
/// may not be opened later (a device thread may open no file; a process that gave up root
/// may not open its own /proc files), so the sandbox asks for it when it starts.
pub fn pagemap() -> std::io::Result<&'static File> {
    PAGEMAP
        .get_or_init(|| File::open("/proc/self/pagemap"))
        .as_ref()
        .map_err(|e| std::io::Error::new(e.kind(), format!("/proc/self/pagemap: {e}")))
}

/// A run of pages outside `known` costs a whole scan about this many pages inside it: a
/// memfd's scan walks every page that holds data (a 256 MiB one fully populated took 2 ms),
/// where a run costs a call or two.
const RUN_COST_PAGES: u64 = 64;

/// Adds to `known` (pages found populated before, `populated_pages_into`'s map) the pages
/// populated since, looking only outside it where that costs less than a whole scan: the
/// pages of `known` that hold data are not walked again. A page given back since stays in
/// `known`: callers want every page that may have held data since.
pub fn grow_populated(ram: &GuestRam, known: &mut Bitmap) -> Result<()> {
    if known.pages() != ram.gfn_end() {
        return populated_pages_into(ram, known);
    }
    // Only as many runs as are worth probing are gathered: one more means a whole scan.
    let worth = (known.count() / RUN_COST_PAGES) as usize;
    let runs: Vec<(usize, std::ops::Range<u64>)> = ram
        .backed_regions()
        .enumerate()
        .flat_map(|(i, (range, ..))| unset_runs(known, range).map(move |r| (i, r)))
        .take(worth + 1)
        .collect();
    if runs.len() > worth {
        let mut now = Bitmap::new(ram.gfn_end());
        populated_pages_into(ram, &mut now)?;
        known.merge(&now);
        return Ok(());
    }
    let pagemap = pagemap()?;
    let regions: Vec<_> = ram.backed_regions().collect();
    for (i, run) in runs {
        let (range, ..) = regions[i];
        let pages = run.start - range.first_gfn()..run.end - range.first_gfn();
        mark_populated(pagemap, regions[i], pages, known)?;
    }
    Ok(())
}

/// The runs of pages of `range` not set in `map`, as guest page numbers.
fn unset_runs(map: &Bitmap, range: RamRange) -> impl Iterator<Item = std::ops::Range<u64>> + '_ {
    let (first, end) = (range.first_gfn(), range.end_gfn());
    let mut at = first;
    std::iter::from_fn(move || {
        while at < end && map.get(at) {
            // Whole words at a time where they are full.
            at = if at % 64 == 0 && map.word((at / 64) as usize) == u64::MAX {
                at + 64
            } else {
                at + 1
            };
        }
        let start = at.min(end);
        while at < end && !map.get(at) {
            at = if at % 64 == 0 && map.word((at / 64) as usize) == 0 {
                at + 64
            } else {
                at + 1
            };
        }
        let stop = at.min(end);
        (start < stop).then_some(start..stop)
    })
}

/// Marks in `out` the populated pages among `pages` (indexes into the region) of one region
/// (its range, host mapping and backing file, as `GuestRam::backed_regions` gives it).
fn mark_populated(
    pagemap: &File,
    (range, host, file): (RamRange, *mut u8, Option<RawFd>),
    pages: std::ops::Range<u64>,
    out: &mut Bitmap,
) -> Result<()> {
    let part = RamRange {
        gpa: range.gpa + pages.start * PAGE_SIZE as u64,
        len: (pages.end - pages.start) * PAGE_SIZE as u64,
    };
    let host = host as u64 + pages.start * PAGE_SIZE as u64;
    if let Some(fd) = file {
        return mark_file_data(fd, part, pages.start * PAGE_SIZE as u64, out);
    }
    match scan_present(pagemap, host, part, out) {
        Ok(()) => Ok(()),
        // Kernels before 6.7 lack PAGEMAP_SCAN: read every page's entry instead.
        Err(e) if matches!(e.raw_os_error(), Some(libc::ENOTTY | libc::EINVAL)) => {
            Ok(read_present(pagemap, host, part, out)?)
        }
        Err(e) => Err(e.into()),
    }
}

/// The same as `scan_present`, one pagemap entry (8 bytes) a page.
fn read_present(
    pagemap: &File,
    host: u64,
    range: RamRange,
    out: &mut Bitmap,
) -> std::io::Result<()> {
    let mut entries = vec![0u8; PAGEMAP_CHUNK * 8];
    let first_host_page = host / PAGE_SIZE as u64;
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
    Ok(())
}

/// `struct pm_scan_arg` of linux/fs.h (Linux 6.7+), which the libc crate does not have.
#[repr(C)]
#[derive(Default)]
struct PmScanArg {
    size: u64,
    flags: u64,
    start: u64,
    end: u64,
    walk_end: u64,
    vec: u64,
    vec_len: u64,
    max_pages: u64,
    category_inverted: u64,
    category_mask: u64,
    category_anyof_mask: u64,
    return_mask: u64,
}

/// `struct page_region`: pages `start..end` (addresses) share `categories`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct PageRegion {
    start: u64,
    end: u64,
    categories: u64,
}

const PAGE_IS_PRESENT: u64 = 1 << 3;
const PAGE_IS_SWAPPED: u64 = 1 << 4;
/// `_IOWR('f', 16, struct pm_scan_arg)`.
const PAGEMAP_SCAN: u64 =
    (3 << 30) | ((std::mem::size_of::<PmScanArg>() as u64) << 16) | ((b'f' as u64) << 8) | 16;
/// Regions asked for per call: the kernel merges neighbouring pages into one.
const SCAN_REGIONS: usize = 4096;

/// Marks the pages of `range` (mapped at `host`) that are present or swapped out, asking the
/// kernel for them as runs (`PAGEMAP_SCAN`): the cost follows what is populated, not the size
/// of the range, where reading pagemap costs 8 bytes a page.
fn scan_present(
    pagemap: &File,
    host: u64,
    range: RamRange,
    out: &mut Bitmap,
) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    let end = host + range.len;
    let mut regions = vec![PageRegion::default(); SCAN_REGIONS];
    let mut start = host;
    while start < end {
        let mut arg = PmScanArg {
            size: std::mem::size_of::<PmScanArg>() as u64,
            start,
            end,
            vec: regions.as_mut_ptr() as u64,
            vec_len: regions.len() as u64,
            category_anyof_mask: PAGE_IS_PRESENT | PAGE_IS_SWAPPED,
            return_mask: PAGE_IS_PRESENT | PAGE_IS_SWAPPED,
            ..Default::default()
        };
        // SAFETY: `arg` and the `regions` it points at outlive the call, which writes at most
        // `vec_len` regions and the argument's `walk_end`.
        let found = unsafe { libc::ioctl(pagemap.as_raw_fd(), PAGEMAP_SCAN as _, &mut arg) };
        if found < 0 {
            return Err(std::io::Error::last_os_error());
        }
        for r in &regions[..found as usize] {
            let first = range.first_gfn() + (r.start - host) / PAGE_SIZE as u64;
            for gfn in first..first + (r.end - r.start) / PAGE_SIZE as u64 {
                out.set(gfn);
            }
        }
        if arg.walk_end <= start {
            return Err(std::io::Error::other("PAGEMAP_SCAN made no progress"));
        }
        start = arg.walk_end;
    }
    Ok(())
}

/// Marks the pages of `range` whose backing file `fd` holds data there (`range` begins at
/// offset `from` of the file): `lseek(SEEK_DATA)` counts a shared page as data wherever it is,
/// in RAM or in swap, so each extent of data costs two calls and each hole none.
fn mark_file_data(fd: RawFd, range: RamRange, from: u64, out: &mut Bitmap) -> Result<()> {
    let (from, len) = (from as libc::off_t, range.len as libc::off_t);
    let seek = |from: libc::off_t, whence| {
        // SAFETY: lseek on a file descriptor the VM keeps open; no memory is touched.
        match unsafe { libc::lseek(fd, from, whence) } {
            -1 => Err(std::io::Error::last_os_error()),
            at => Ok(at),
        }
    };
    let end = from + len;
    let mut at = from;
    while at < end {
        let data = match seek(at, libc::SEEK_DATA) {
            Ok(d) => d,
            // No data at or after `at`.
            Err(e) if e.raw_os_error() == Some(libc::ENXIO) => break,
            Err(e) => return Err(e.into()),
        };
        if data >= end {
            break;
        }
        let hole = seek(data, libc::SEEK_HOLE)?.min(end);
        let page = PAGE_SIZE as libc::off_t;
        for p in (data - from) / page..(hole - from + page - 1) / page {
            out.set(range.first_gfn() + p as u64);
        }
        at = hole;
    }
    Ok(())
}

/// The pages of `pages` that hold only zeros now. Each is read, so `pages` should name only
/// populated ones (reading a never-touched page would populate it).
pub fn zero_pages_of(ram: &GuestRam, pages: &Bitmap) -> Result<Bitmap> {
    let mut zeros = Bitmap::new(pages.pages());
    for pfn in pages.iter() {
        if is_zero_page(ram.page(pfn)?) {
            zeros.set(pfn);
        }
    }
    Ok(zeros)
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

    /// Asking the kernel for runs of populated pages finds what reading every page's entry
    /// finds: touched pages, in several runs, and nothing else.
    #[test]
    fn the_scan_and_the_page_by_page_read_agree() {
        const PAGES: u64 = 4096;
        let len = PAGES as usize * PAGE_SIZE;
        let host = crate::memory::test_support::mapping(len);
        let range = RamRange {
            gpa: 1 << 20,
            len: len as u64,
        };
        // SAFETY: the mapping outlives `ram` (both end with this test).
        let ram = unsafe { GuestRam::new(&[(range, host.cast())]) }.unwrap();
        let touched = [0u64, 1, 2, 700, 1500, 1501, 4095];
        for &p in &touched {
            ram.write_page(range.first_gfn() + p, &[1u8; PAGE_SIZE])
                .unwrap();
        }
        let pagemap = File::open("/proc/self/pagemap").unwrap();
        let mut scanned = Bitmap::new(ram.gfn_end());
        match scan_present(&pagemap, host as u64, range, &mut scanned) {
            Ok(()) => {}
            Err(e) if e.raw_os_error() == Some(libc::ENOTTY) => return, // before Linux 6.7
            Err(e) => panic!("PAGEMAP_SCAN: {e}"),
        }
        let want: Vec<u64> = touched.iter().map(|p| range.first_gfn() + p).collect();
        assert_eq!(scanned.iter().collect::<Vec<_>>(), want);
        let mut read = Bitmap::new(ram.gfn_end());
        read_present(&pagemap, host as u64, range, &mut read).unwrap();
        assert_eq!(read, scanned);
        assert_eq!(populated_pages(&ram).unwrap(), scanned);
        // SAFETY: the mapping made above; nothing uses it any more.
        unsafe { libc::munmap(host, len) };
    }

    /// A page of a memfd that this process does not map holds data all the same: the state of
    /// a shared page the kernel swapped out (its page-table entry is gone). Before the file was
    /// asked, such a page was skipped and arrived as zeros.
    #[test]
    fn memfd_pages_outside_the_page_tables_count() {
        const PAGES: u64 = 64;
        let (file, host) = memfd_mapping(PAGES);
        let len = (PAGES as usize) * PAGE_SIZE;
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

    /// A memfd of `pages` pages and a shared mapping of it (the caller unmaps it).
    fn memfd_mapping(pages: u64) -> (File, *mut libc::c_void) {
        // SAFETY: a plain syscall; the fd is checked and then owned by `file`.
        let fd = unsafe { libc::memfd_create(c"scan-test".as_ptr(), libc::MFD_CLOEXEC) };
        assert!(fd >= 0);
        // SAFETY: a fresh fd nothing else owns.
        let file = unsafe { File::from_raw_fd(fd) };
        file.set_len(pages * PAGE_SIZE as u64).unwrap();
        // SAFETY: a new shared mapping of the whole file.
        let host = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                pages as usize * PAGE_SIZE,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        assert_ne!(host, libc::MAP_FAILED);
        (file, host)
    }

    /// Growing a map of populated pages finds what a whole scan finds (on a memfd region and
    /// an anonymous one, pages first touched inside holes, at a hole's edges and through the
    /// file alone), whether it looks only in the holes or scans again; a page given back
    /// since stays in the map.
    #[test]
    fn a_grown_map_finds_what_a_whole_scan_finds() {
        const PAGES: u64 = 4096;
        let len = PAGES as usize * PAGE_SIZE;
        let (file, shared) = memfd_mapping(PAGES);
        let private = crate::memory::test_support::mapping(len);
        let (low, high) = (
            RamRange {
                gpa: 0,
                len: len as u64,
            },
            RamRange {
                gpa: 1 << 32,
                len: len as u64,
            },
        );
        // SAFETY: the mappings and the file outlive `ram` (all end with this test).
        let ram = unsafe { GuestRam::new(&[(low, shared.cast()), (high, private.cast())]) }
            .and_then(|r| unsafe { r.with_files(&[Some(file.as_raw_fd()), None]) })
            .unwrap();
        let (l, h) = (low.first_gfn(), high.first_gfn());
        let write = |gfns: &mut dyn Iterator<Item = u64>| {
            for gfn in gfns {
                ram.write_page(gfn, &[1u8; PAGE_SIZE]).unwrap();
            }
        };
        write(&mut (l..l + 1000).chain(h + 10..h + 500));
        let mut known = populated_pages(&ram).unwrap();
        // Few holes: only they are looked at.
        write(
            &mut [l + 1000, l + 2000, h + 9, h + 4095]
                .into_iter()
                .chain(l + 3000..l + 3010),
        );
        file.write_all_at(&[2u8; PAGE_SIZE], 2500 * PAGE_SIZE as u64)
            .unwrap();
        grow_populated(&ram, &mut known).unwrap();
        assert_eq!(known, populated_pages(&ram).unwrap());
        // Given back: still in the grown map.
        ram.discard(l + 5, 1).unwrap();
        grow_populated(&ram, &mut known).unwrap();
        assert!(known.get(l + 5) && !populated_pages(&ram).unwrap().get(l + 5));
        // Many holes (every other page): scanned again whole, to the same result.
        write(&mut (h + 1000..h + 3000).step_by(2));
        let mut sparse = populated_pages(&ram).unwrap();
        write(&mut (h + 1001..h + 1201).step_by(2));
        grow_populated(&ram, &mut sparse).unwrap();
        assert_eq!(sparse, populated_pages(&ram).unwrap());
        // SAFETY: the mappings made above; nothing uses them any more.
        unsafe {
            libc::munmap(shared, len);
            libc::munmap(private, len);
        }
    }

    /// The holes of a map within a range: runs of unset pages, whole words skipped, the
    /// range's ends honoured where they cut a word.
    #[test]
    fn unset_runs_are_the_holes_within_the_range() {
        let mut map = Bitmap::new(1024);
        for p in (0..130).chain(200..201).chain(256..1000) {
            map.set(p);
        }
        let range = RamRange {
            gpa: 3 * PAGE_SIZE as u64,
            len: 1010 * PAGE_SIZE as u64,
        };
        let runs: Vec<_> = unset_runs(&map, range).collect();
        assert_eq!(runs, vec![130..200, 201..256, 1000..1013]);
    }
}
