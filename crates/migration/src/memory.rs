//! Guest RAM as the engine sees it: a few regions of guest-physical memory (RAM below the
//! 32-bit MMIO hole, RAM above 4 GiB), each a host mapping. Pages are named by their
//! guest-physical frame number (`gfn`, the address >> 12); every page bitmap spans
//! `0..gfn_end()`, and bits inside a hole are never set.
//!
//! Every accessor is bounds-checked in release builds: a page outside RAM is an error, never a
//! stray pointer.

use std::os::fd::RawFd;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::{PAGE_SHIFT, PAGE_SIZE};

/// One contiguous piece of guest RAM (page-aligned).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RamRange {
    pub gpa: u64,
    pub len: u64,
}

impl RamRange {
    pub fn first_gfn(&self) -> u64 {
        self.gpa >> PAGE_SHIFT
    }

    pub fn end_gfn(&self) -> u64 {
        (self.gpa + self.len) >> PAGE_SHIFT
    }

    pub fn pages(&self) -> u64 {
        self.len >> PAGE_SHIFT
    }
}

/// Guest-physical addresses end here (52 bits: the most any x86-64 CPU can address).
pub const MAX_GPA: u64 = 1 << 52;

#[derive(Clone, Copy, Debug)]
struct Region {
    range: RamRange,
    host: *mut u8,
    /// The file the region maps (shared, from offset 0), when it maps one: a memfd.
    file: Option<RawFd>,
}

/// Guest memory: its regions and where each is mapped here.
///
/// On a running source the guest writes pages while the engine reads them: reads are plain
/// loads and may see a torn page, which is harmless because such a page is dirty and is sent
/// again. The destination writes pages only while its vCPUs are parked (or, in post-copy,
/// through `UFFDIO_COPY`, which the kernel makes atomic).
///
/// Pages are handed out as byte slices, not volatile views (vm-memory's `VolatileSlice`): the
/// sender's in-place frames checksum and `writev` them straight from guest memory, and the
/// codecs and TLS take `&[u8]`; a volatile view would add a copy per page on the path that
/// exists to avoid it. The bytes are only copied, checksummed or compared, never interpreted.
#[derive(Clone, Debug)]
pub struct GuestRam {
    regions: std::sync::Arc<[Region]>,
}

// SAFETY: the mappings outlive every user (the VM owns them for the process lifetime), and
// concurrent access follows the contract in the type's documentation.
unsafe impl Send for GuestRam {}
// SAFETY: as for `Send`.
unsafe impl Sync for GuestRam {}

impl GuestRam {
    /// # Safety
    /// Each `(range, host)` must be a host mapping of `range.len` bytes that stays valid for
    /// as long as this value (or a clone) is used.
    pub unsafe fn new(regions: &[(RamRange, *mut u8)]) -> Result<Self> {
        let mut end = 0u64;
        for (r, host) in regions {
            let aligned = |v: u64| v.is_multiple_of(PAGE_SIZE as u64);
            if !aligned(r.gpa) || !aligned(r.len) || r.len == 0 || host.is_null() {
                return Err(Error::vm(format!("bad RAM region {r:?}")));
            }
            if r.gpa < end {
                return Err(Error::vm(format!(
                    "RAM regions overlap or are out of order at {:#x}",
                    r.gpa
                )));
            }
            end = r
                .gpa
                .checked_add(r.len)
                .filter(|&e| e <= MAX_GPA)
                .ok_or_else(|| {
                    Error::vm(format!("RAM region {r:?} ends past the address space"))
                })?;
        }
        let regions: Vec<Region> = regions
            .iter()
            .map(|&(range, host)| Region {
                range,
                host,
                file: None,
            })
            .collect();
        Ok(Self {
            regions: regions.into(),
        })
    }

    /// Names the file each region maps shared from offset 0 (`None`: anonymous memory), in
    /// region order. A page of such a file can hold data while this process has no mapping of
    /// it (swapped out, or written through the file): `scan::populated_pages` asks the file.
    ///
    /// # Safety
    /// Each fd must stay open, and be the file the region maps, for as long as this value (or
    /// a clone) is used.
    pub unsafe fn with_files(self, files: &[Option<RawFd>]) -> Result<Self> {
        if files.len() != self.regions.len() {
            return Err(Error::vm(format!(
                "{} backing files for {} RAM regions",
                files.len(),
                self.regions.len()
            )));
        }
        let regions: Vec<Region> = self
            .regions
            .iter()
            .zip(files)
            .map(|(r, &file)| Region { file, ..*r })
            .collect();
        Ok(Self {
            regions: regions.into(),
        })
    }

    /// The file each region maps (see `with_files`), in region order.
    pub fn files(&self) -> Vec<Option<RawFd>> {
        self.regions.iter().map(|r| r.file).collect()
    }

    pub fn ranges(&self) -> Vec<RamRange> {
        self.regions.iter().map(|r| r.range).collect()
    }

    /// RAM pages (holes not counted).
    pub fn pages(&self) -> u64 {
        self.regions.iter().map(|r| r.range.pages()).sum()
    }

    /// RAM bytes.
    pub fn len(&self) -> u64 {
        self.regions.iter().map(|r| r.range.len).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.regions.is_empty()
    }

    /// One past the highest guest page number: the length of every page bitmap.
    pub fn gfn_end(&self) -> u64 {
        self.regions.last().map_or(0, |r| r.range.end_gfn())
    }

    fn region(&self, gfn: u64) -> Option<&Region> {
        self.regions
            .iter()
            .find(|r| gfn >= r.range.first_gfn() && gfn < r.range.end_gfn())
    }

    pub fn contains(&self, gfn: u64) -> bool {
        self.region(gfn).is_some()
    }

    /// The host address of `pages` pages from `gfn`, all in one region.
    pub fn host_ptr(&self, gfn: u64, pages: u64) -> Result<*mut u8> {
        let r = self.region(gfn).ok_or_else(|| outside(gfn))?;
        if gfn + pages > r.range.end_gfn() {
            return Err(outside(gfn + pages - 1));
        }
        let offset = ((gfn - r.range.first_gfn()) as usize) << PAGE_SHIFT;
        // SAFETY: `offset` lies inside the region's mapping (checked above).
        Ok(unsafe { r.host.add(offset) })
    }

    /// Pages from `gfn` to the end of its region (how far a run of pages may extend).
    pub fn pages_to_region_end(&self, gfn: u64) -> u64 {
        self.region(gfn).map_or(0, |r| r.range.end_gfn() - gfn)
    }

    /// A view of page `gfn` for reading. On a running source it may change under us (see the
    /// type's note); the caller treats it as a possibly torn snapshot.
    pub fn page(&self, gfn: u64) -> Result<&[u8]> {
        let p = self.host_ptr(gfn, 1)?;
        // SAFETY: one page inside a live mapping (checked by `host_ptr`).
        Ok(unsafe { std::slice::from_raw_parts(p, PAGE_SIZE) })
    }

    /// `pages` pages from `gfn` as one byte slice, for vectored sends.
    pub fn pages_slice(&self, gfn: u64, pages: u64) -> Result<&[u8]> {
        let p = self.host_ptr(gfn, pages)?;
        // SAFETY: the run lies inside one live mapping (checked by `host_ptr`).
        Ok(unsafe { std::slice::from_raw_parts(p, pages as usize * PAGE_SIZE) })
    }

    /// Copies `data` (one page) into page `gfn`. Only while the VM's vCPUs are parked.
    pub fn write_page(&self, gfn: u64, data: &[u8]) -> Result<()> {
        if data.len() != PAGE_SIZE {
            return Err(Error::vm(format!("a page write of {} bytes", data.len())));
        }
        let p = self.host_ptr(gfn, 1)?;
        // SAFETY: `p` is one page of a live mapping; `data` is a distinct buffer of one page.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), p, PAGE_SIZE) };
        Ok(())
    }

    /// Fills page `gfn` with zeros. Only while the VM's vCPUs are parked.
    pub fn zero_page(&self, gfn: u64) -> Result<()> {
        let p = self.host_ptr(gfn, 1)?;
        // SAFETY: `p` is one page of a live mapping.
        unsafe { std::ptr::write_bytes(p, 0, PAGE_SIZE) };
        Ok(())
    }

    /// Gives `pages` pages from `gfn` (all in one region) back to the kernel: they read as
    /// zeros, are no longer present (a userfaultfd hears the next touch) and take no memory.
    /// Only while the VM's vCPUs are parked.
    pub fn discard(&self, gfn: u64, pages: u64) -> Result<()> {
        let p = self.host_ptr(gfn, pages)?;
        // A shared mapping (memfd) keeps its pages in the file: they are punched out of it;
        // unmapping them would leave their old content there.
        let advice = match self.region(gfn).and_then(|r| r.file) {
            Some(_) => libc::MADV_REMOVE,
            None => libc::MADV_DONTNEED,
        };
        // SAFETY: pages of our own mapping (checked by `host_ptr`); nothing reads them now.
        let r = unsafe { libc::madvise(p.cast(), pages as usize * PAGE_SIZE, advice) };
        if r != 0 {
            return Err(Error::vm_caused(
                "cannot give guest pages back",
                std::io::Error::last_os_error(),
            ));
        }
        Ok(())
    }

    /// `discard` for each page of `gfns` (in ascending order), a run of neighbours at a time.
    pub fn discard_pages(&self, gfns: &[u64]) -> Result<()> {
        let mut run: Option<(u64, u64)> = None;
        for &gfn in gfns {
            run = match run {
                Some((first, n)) if first + n == gfn && self.pages_to_region_end(first) > n => {
                    Some((first, n + 1))
                }
                Some((first, n)) => {
                    self.discard(first, n)?;
                    Some((gfn, 1))
                }
                None => Some((gfn, 1)),
            };
        }
        match run {
            Some((first, n)) => self.discard(first, n),
            None => Ok(()),
        }
    }

    /// Asks the kernel not to back guest memory with transparent huge pages. A destination
    /// must: one huge page faulted in for one page makes its 511 neighbours present too, so
    /// post-copy would not hear the guest touch them and the guest would read zeros (QEMU
    /// does the same on a post-copy destination). Where THP is off or the kernel refuses,
    /// nothing changes.
    pub fn forbid_huge_pages(&self) {
        self.advise_all(libc::MADV_NOHUGEPAGE, "MADV_NOHUGEPAGE");
    }

    /// Takes `forbid_huge_pages` back once every page is here (as QEMU does when post-copy
    /// ends): the VM runs on here, and the host may back its memory with huge pages again
    /// (new faults take whole ones, khugepaged merges what arrived page by page), as it did
    /// on the source.
    pub fn allow_huge_pages(&self) {
        self.advise_all(libc::MADV_HUGEPAGE, "MADV_HUGEPAGE");
    }

    fn advise_all(&self, advice: libc::c_int, name: &str) {
        for r in self.regions.iter() {
            // SAFETY: advice on our own mapping; it changes no content.
            let rc = unsafe { libc::madvise(r.host.cast(), r.range.len as usize, advice) };
            if rc != 0 {
                tracing::debug!("{name} on guest RAM: {}", std::io::Error::last_os_error());
            }
        }
    }

    /// `pages` pages from `gfn` as a mutable slice, for reading from the wire straight into
    /// place.
    ///
    /// # Safety
    /// No other reference to these pages may be alive while the slice is used: the VM's
    /// vCPUs are parked, and the caller never hands out two slices over one page (page
    /// frames that name a page twice are refused by the parser).
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn pages_slice_mut(&self, gfn: u64, pages: u64) -> Result<&mut [u8]> {
        let p = self.host_ptr(gfn, pages)?;
        // SAFETY: in bounds (checked); exclusivity is the caller's contract above.
        Ok(unsafe { std::slice::from_raw_parts_mut(p, pages as usize * PAGE_SIZE) })
    }

    /// The region holding host address `addr`, as a page number (post-copy faults name host
    /// addresses).
    pub fn gfn_of_host(&self, addr: u64) -> Option<u64> {
        self.regions.iter().find_map(|r| {
            let base = r.host as u64;
            (addr >= base && addr < base + r.range.len)
                .then(|| r.range.first_gfn() + ((addr - base) >> PAGE_SHIFT))
        })
    }

    /// Each region's host mapping and length (for pagemap scans and userfaultfd).
    pub fn host_regions(&self) -> impl Iterator<Item = (RamRange, *mut u8)> + '_ {
        self.regions.iter().map(|r| (r.range, r.host))
    }

    /// Each region with the file it maps, if any (see `with_files`).
    pub fn backed_regions(&self) -> impl Iterator<Item = (RamRange, *mut u8, Option<RawFd>)> + '_ {
        self.regions.iter().map(|r| (r.range, r.host, r.file))
    }
}

/// Private memory laid out like a VM's RAM, where copies of its pages wait (a post-copy
/// checkpoint: taken on the destination while the guest is paused, staged on the source until
/// it is whole). Reserved, not allocated: only the pages written take memory, and `release`
/// gives them back.
pub struct ShadowRam {
    ram: GuestRam,
    maps: Vec<(*mut u8, usize)>,
}

// SAFETY: the mappings are owned by this value and freed only when it drops.
unsafe impl Send for ShadowRam {}
// SAFETY: as for `Send`; writers follow `GuestRam`'s contract.
unsafe impl Sync for ShadowRam {}

impl ShadowRam {
    pub fn like(ram: &GuestRam) -> Result<Self> {
        // Holds the mappings made so far, so that an early return unmaps them.
        let mut shadow = Self {
            ram: ram.clone(),
            maps: Vec::new(),
        };
        let mut regions = Vec::new();
        for (range, _) in ram.host_regions() {
            // SAFETY: a fresh anonymous mapping; nothing else refers to it.
            let p = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    range.len as usize,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                    -1,
                    0,
                )
            };
            if p == libc::MAP_FAILED {
                let e = std::io::Error::last_os_error();
                return Err(Error::vm_caused("cannot reserve checkpoint memory", e));
            }
            shadow.maps.push((p as *mut u8, range.len as usize));
            regions.push((range, p as *mut u8));
        }
        // SAFETY: each mapping is `range.len` long and lives as long as `shadow`.
        shadow.ram = unsafe { GuestRam::new(&regions)? };
        Ok(shadow)
    }

    pub fn ram(&self) -> &GuestRam {
        &self.ram
    }

    /// Gives every written page back to the kernel (they read as zeros again).
    pub fn release(&self) {
        for &(p, len) in &self.maps {
            // SAFETY: our own private mapping; no reference into it outlives this call's caller.
            unsafe { libc::madvise(p as *mut libc::c_void, len, libc::MADV_DONTNEED) };
        }
    }
}

impl Drop for ShadowRam {
    fn drop(&mut self) {
        for &(p, len) in &self.maps {
            // SAFETY: mapped in `like`, unmapped once.
            unsafe { libc::munmap(p as *mut libc::c_void, len) };
        }
    }
}

fn outside(gfn: u64) -> Error {
    Error::Protocol(format!("page {gfn:#x} lies outside guest RAM"))
}

#[cfg(test)]
pub(crate) mod test_support {
    /// A fresh private mapping of `len` bytes that nothing else refers to (unmapped by the
    /// caller).
    pub fn mapping(len: usize) -> *mut libc::c_void {
        // SAFETY: a new private anonymous mapping; nothing else refers to it.
        let host = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        assert_ne!(host, libc::MAP_FAILED);
        host
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pages_are_found_by_guest_physical_number_and_holes_refused() {
        let mut low = vec![0u8; 4 * PAGE_SIZE];
        let mut high = vec![0u8; 2 * PAGE_SIZE];
        let ranges = [
            (
                RamRange {
                    gpa: 0,
                    len: 4 * PAGE_SIZE as u64,
                },
                low.as_mut_ptr(),
            ),
            (
                RamRange {
                    gpa: 8 * PAGE_SIZE as u64,
                    len: 2 * PAGE_SIZE as u64,
                },
                high.as_mut_ptr(),
            ),
        ];
        // SAFETY: the vectors outlive `ram`.
        let ram = unsafe { GuestRam::new(&ranges) }.unwrap();
        assert_eq!(ram.pages(), 6);
        assert_eq!(ram.gfn_end(), 10);
        assert!(ram.contains(3) && !ram.contains(4) && ram.contains(9));
        assert!(ram.page(5).is_err());
        assert!(ram.host_ptr(3, 2).is_err(), "a run may not cross a hole");
        ram.write_page(8, &[7u8; PAGE_SIZE]).unwrap();
        assert_eq!(ram.page(8).unwrap()[0], 7);
        assert_eq!(ram.gfn_of_host(high.as_ptr() as u64 + 4096), Some(9));
        assert!(ram.page(10).is_err());
    }

    #[test]
    fn overlapping_regions_are_refused() {
        let mut a = vec![0u8; 2 * PAGE_SIZE];
        let r = RamRange {
            gpa: 0,
            len: 2 * PAGE_SIZE as u64,
        };
        // SAFETY: never dereferenced (refused).
        let e = unsafe { GuestRam::new(&[(r, a.as_mut_ptr()), (r, a.as_mut_ptr())]) };
        assert!(e.is_err());
    }
}
