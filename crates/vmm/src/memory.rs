//! Guest memory: one mapping per RAM range of the memory map (see `layout`), each mapped
//! lazily so that untouched memory costs nothing (and migration can skip it without reading
//! it).

use std::fmt;
use std::str::FromStr;

use vm_memory::{GuestAddress, GuestMemoryMmap, GuestRegionMmap, MmapRegion};

use crate::error::{Error, Result};
use crate::layout::{MAX_MEMORY, ram_ranges};
use migration::RamRange;

pub type GuestMemory = GuestMemoryMmap<()>;

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MemoryBackend {
    /// Private anonymous memory with MAP_NORESERVE.
    #[default]
    Anonymous,
    /// A memfd mapped shared: the memory outlives the mapping (for local migration later).
    Memfd,
}

impl FromStr for MemoryBackend {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "anonymous" | "anon" => Ok(Self::Anonymous),
            "memfd" => Ok(Self::Memfd),
            other => Err(format!(
                "unknown memory backend '{other}' (use anonymous or memfd)"
            )),
        }
    }
}

/// A memory size given by a person: `512M`, `4G`, `1073741824`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemorySize(pub u64);

impl FromStr for MemorySize {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        let s = s.trim();
        let (digits, shift) = match s.char_indices().last() {
            Some((i, 'K' | 'k')) => (&s[..i], 10),
            Some((i, 'M' | 'm')) => (&s[..i], 20),
            Some((i, 'G' | 'g')) => (&s[..i], 30),
            Some((i, 'T' | 't')) => (&s[..i], 40),
            _ => (s, 0),
        };
        let n: u64 = digits
            .parse()
            .map_err(|_| format!("'{s}' is not a size (examples: 512M, 4G)"))?;
        let bytes = n
            .checked_mul(1 << shift)
            .ok_or_else(|| format!("'{s}' is too large"))?;
        if bytes == 0 {
            return Err("memory size must be larger than 0".into());
        }
        Ok(MemorySize(bytes))
    }
}

impl fmt::Display for MemorySize {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let b = self.0;
        if b.is_multiple_of(1 << 30) {
            write!(f, "{}G", b >> 30)
        } else if b.is_multiple_of(1 << 20) {
            write!(f, "{}M", b >> 20)
        } else {
            write!(f, "{b}")
        }
    }
}

pub const MIN_MEMORY: u64 = 16 << 20;

/// Maps `size` bytes of guest memory. Nothing is touched, so nothing is populated.
pub fn create_guest_memory(size: u64, backend: MemoryBackend) -> Result<GuestMemory> {
    check_size(size)?;
    let regions = ram_ranges(size)
        .into_iter()
        .map(|r| {
            let file = match backend {
                MemoryBackend::Anonymous => None,
                MemoryBackend::Memfd => Some(memfd(r.len)?),
            };
            map_region(r, file)
        })
        .collect::<Result<Vec<_>>>()?;
    GuestMemoryMmap::from_regions(regions).map_err(|e| Error::Memory(e.to_string()))
}

/// Maps `size` bytes of guest memory from `files`, one per RAM range in order, each mapped
/// shared from its start: the memory a live update was passed, with what it holds.
pub fn guest_memory_from_files(size: u64, files: Vec<std::fs::File>) -> Result<GuestMemory> {
    check_size(size)?;
    let ranges = ram_ranges(size);
    if files.len() != ranges.len() {
        return Err(Error::Memory(format!(
            "{} memory files for {} RAM ranges",
            files.len(),
            ranges.len()
        )));
    }
    let regions = ranges
        .into_iter()
        .zip(files)
        .map(|(r, file)| {
            check_passed_memfd(&file, r.len)
                .map_err(|e| Error::Memory(format!("the RAM at {:#x}: {e}", r.gpa)))?;
            map_region(r, Some(file))
        })
        .collect::<Result<Vec<_>>>()?;
    GuestMemoryMmap::from_regions(regions).map_err(|e| Error::Memory(e.to_string()))
}

/// One RAM range's mapping: anonymous, or `file` shared from its start.
fn map_region(r: RamRange, file: Option<std::fs::File>) -> Result<GuestRegionMmap<()>> {
    let len = r.len as usize;
    let mapping = match file {
        None => MmapRegion::new(len),
        Some(file) => MmapRegion::from_file(vm_memory::FileOffset::new(file, 0), len),
    }
    .map_err(|e| Error::Memory(format!("cannot map {}: {e}", MemorySize(r.len))))?;
    advise_huge_pages(&mapping);
    GuestRegionMmap::new(mapping, GuestAddress(r.gpa))
        .ok_or_else(|| Error::Memory("region does not fit the guest address space".into()))
}

/// Asks the host to back guest memory with transparent huge pages, as QEMU does: memory
/// is then faulted in 2 MiB at a time, so a guest touching its memory, and above all a
/// destination filling fresh memory with arriving pages, takes one host fault where it took
/// 512. Dirty logging still tracks 4 KiB pages. Advice only: a host without THP (or a memfd
/// where shmem THP is off) maps small pages as before.
fn advise_huge_pages(mapping: &MmapRegion) {
    // SAFETY: advice on a mapping this process made and owns; it changes no content.
    let r = unsafe { libc::madvise(mapping.as_ptr().cast(), mapping.size(), libc::MADV_HUGEPAGE) };
    if r != 0 {
        tracing::debug!(
            "no huge pages for guest memory: {}",
            std::io::Error::last_os_error()
        );
    }
}

/// Takes the huge-page advice back (before anything is touched), so that a test sees one
/// page populated where it wrote one: scans are exact on small pages and a superset on huge
/// ones (a huge page holds the zeros around what was written).
#[cfg(test)]
pub(crate) fn use_small_pages(memory: &GuestMemory) {
    use vm_memory::{GuestMemoryBackend, GuestMemoryRegion};
    for region in memory.iter() {
        let host = region.as_ptr();
        // SAFETY: advice on a mapping `memory` owns; it changes no content.
        let r = unsafe { libc::madvise(host.cast(), region.len() as usize, libc::MADV_NOHUGEPAGE) };
        assert_eq!(r, 0, "{}", std::io::Error::last_os_error());
    }
}

fn check_size(size: u64) -> Result<()> {
    if size < MIN_MEMORY {
        return Err(Error::Memory(format!(
            "{} is too small: the guest needs at least {}",
            MemorySize(size),
            MemorySize(MIN_MEMORY)
        )));
    }
    if size > MAX_MEMORY {
        return Err(Error::Memory(format!(
            "{} is larger than ferry can map for a guest (at most {})",
            MemorySize(size),
            MemorySize(MAX_MEMORY)
        )));
    }
    if !size.is_multiple_of(4096) {
        return Err(Error::Memory(
            "memory size must be a multiple of 4 KiB".into(),
        ));
    }
    Ok(())
}

/// Pages asked about per `mincore` call in `discard` (the answer is a byte a page).
const RESIDENCY_CHUNK: usize = 4096;

/// Gives `len` bytes of guest RAM from `gpa` (page-aligned, inside one region) back to the
/// host: they take no memory and read as zeros, as pages never touched do, so a migration
/// skips them. A memfd's pages are punched out of the file (unmapping them would leave their
/// content there). `held` hears each run of pages (address, bytes) that held data just before
/// (`held_pages`: in RAM or in swap; a page only read since it was given back maps the host's
/// zero page, and counts too): their content has changed, to zeros.
pub fn discard(
    memory: &GuestMemory,
    gpa: u64,
    len: u64,
    held: &mut dyn FnMut(u64, u64),
) -> std::io::Result<()> {
    use vm_memory::{GuestMemoryBackend, GuestMemoryRegion, MemoryRegionAddress};
    let outside = || std::io::Error::other(format!("{len} bytes at {gpa:#x} are not guest RAM"));
    let region = memory.find_region(GuestAddress(gpa)).ok_or_else(outside)?;
    let offset = gpa - region.start_addr().0;
    if !gpa.is_multiple_of(PAGE) || !len.is_multiple_of(PAGE) || offset + len > region.len() {
        return Err(outside());
    }
    let host = region
        .get_host_address(MemoryRegionAddress(offset))
        .map_err(|e| std::io::Error::other(e.to_string()))?;
    let backing = match region.file_offset() {
        Some(f) => Backing::File(f.file(), f.start() + offset),
        None => Backing::Anonymous(host),
    };
    report_held(&backing, gpa, len, held)?;
    let advice = match backing {
        Backing::File(..) => libc::MADV_REMOVE,
        Backing::Anonymous(_) => libc::MADV_DONTNEED,
    };
    // SAFETY: `len` bytes of our own guest mapping (checked above); the guest gave them up.
    if unsafe { libc::madvise(host.cast(), len as usize, advice) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

const PAGE: u64 = 4096;

/// What holds a range of guest RAM.
enum Backing<'a> {
    /// A memfd, from this offset.
    File(&'a std::fs::File, u64),
    /// Anonymous memory mapped here.
    Anonymous(*mut u8),
}

/// Tells `held` the runs of the `len` bytes (guest address `gpa`) that hold data.
fn report_held(
    backing: &Backing,
    gpa: u64,
    len: u64,
    held: &mut dyn FnMut(u64, u64),
) -> std::io::Result<()> {
    let pages = len / PAGE;
    // Sized to the range: a balloon gives scattered pages back one run (often one page) at a
    // time, and a chunk's worth per call would be allocated for each.
    let mut flags = vec![false; (pages as usize).min(RESIDENCY_CHUNK)];
    let mut run: Option<(u64, u64)> = None; // first page, pages
    let mut done = 0u64;
    while done < pages {
        let n = (pages - done).min(RESIDENCY_CHUNK as u64) as usize;
        held_pages(backing, done * PAGE, &mut flags[..n])?;
        for (i, &data) in flags[..n].iter().enumerate() {
            let page = done + i as u64;
            run = match (run, data) {
                (Some((first, k)), true) if first + k == page => Some((first, k + 1)),
                (Some((first, k)), data) => {
                    held(gpa + first * PAGE, k * PAGE);
                    data.then_some((page, 1))
                }
                (None, data) => data.then_some((page, 1)),
            };
        }
        done += n as u64;
    }
    if let Some((first, k)) = run {
        held(gpa + first * PAGE, k * PAGE);
    }
    Ok(())
}

/// Sets `out[i]` for each page from `at` bytes into `backing` that holds data. A memfd's data
/// is what `SEEK_DATA` finds (pages in RAM and in swap alike); anonymous memory's is what
/// `mincore` says is in RAM, and what the page table says was swapped out (`/proc/self/pagemap`
/// bit 62): a swapped page given back must count as changed too, or a migration would leave
/// the destination its old content.
fn held_pages(backing: &Backing, at: u64, out: &mut [bool]) -> std::io::Result<()> {
    match *backing {
        Backing::File(file, offset) => file_data(file, offset + at, out),
        Backing::Anonymous(host) => {
            // SAFETY: the caller checked that the pages lie in our own mapping.
            let host = unsafe { host.add(at as usize) };
            resident(host, out)?;
            if out.iter().any(|&r| !r) {
                let swapped = swapped(host, out.len())?;
                out.iter_mut().zip(swapped).for_each(|(o, s)| *o |= s);
            }
            Ok(())
        }
    }
}

/// `mincore` for `out.len()` pages mapped at `host`.
fn resident(host: *mut u8, out: &mut [bool]) -> std::io::Result<()> {
    let mut vec = vec![0u8; out.len()];
    // SAFETY: pages of our own mapping from `host`; `vec` holds a byte for each.
    let rc = unsafe { libc::mincore(host.cast(), out.len() * PAGE as usize, vec.as_mut_ptr()) };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    out.iter_mut().zip(vec).for_each(|(o, b)| *o = b & 1 != 0);
    Ok(())
}

/// Whether each of `pages` pages mapped at `host` is swapped out (pagemap bit 62; the flags
/// are readable without privileges, only frame numbers are hidden).
fn swapped(host: *mut u8, pages: usize) -> std::io::Result<Vec<bool>> {
    Ok(pagemap(host, pages)?
        .into_iter()
        .map(|e| e & PAGEMAP_SWAPPED != 0)
        .collect())
}

const PAGEMAP_SWAPPED: u64 = 1 << 62;

/// The pagemap entries of `pages` pages mapped at `host`.
fn pagemap(host: *mut u8, pages: usize) -> std::io::Result<Vec<u64>> {
    use std::os::unix::fs::FileExt;
    let file = migration::scan::pagemap()?;
    let mut bytes = vec![0u8; pages * 8];
    file.read_exact_at(&mut bytes, host as u64 / PAGE * 8)?;
    Ok(bytes
        .chunks_exact(8)
        .map(|e| u64::from_le_bytes(e.try_into().unwrap()))
        .collect())
}

/// Which of `out.len()` pages of `file` from byte `at` hold data (`SEEK_DATA`/`SEEK_HOLE`).
fn file_data(file: &std::fs::File, at: u64, out: &mut [bool]) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    let end = at + out.len() as u64 * PAGE;
    out.fill(false);
    let seek = |from: u64, whence: libc::c_int| -> std::io::Result<Option<u64>> {
        // SAFETY: lseek on a descriptor we hold; it moves only its offset, which nothing
        // else here uses (guest memory is mapped, never read through the file).
        let r = unsafe { libc::lseek(file.as_raw_fd(), from as libc::off_t, whence) };
        match r {
            r if r >= 0 => Ok(Some(r as u64)),
            _ => match std::io::Error::last_os_error() {
                e if e.raw_os_error() == Some(libc::ENXIO) => Ok(None), // no data past `from`
                e => Err(e),
            },
        }
    };
    let mut from = at;
    while from < end {
        let Some(data) = seek(from, libc::SEEK_DATA)?.filter(|&d| d < end) else {
            break;
        };
        let hole = seek(data, libc::SEEK_HOLE)?.unwrap_or(end).min(end);
        let first = ((data - at) / PAGE) as usize;
        let last = (hole - at).div_ceil(PAGE) as usize;
        out[first..last].fill(true);
        from = hole;
    }
    Ok(())
}

/// The seals ferry puts on guest memory's memfds: its size is fixed for good, so that no one
/// who holds the file (a live update's peer) can shrink it under a mapping.
const SEALS: libc::c_int = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;

fn memfd(size: u64) -> Result<std::fs::File> {
    use std::os::fd::{AsRawFd, FromRawFd};
    let flags = libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING;
    // SAFETY: memfd_create takes a NUL-terminated name and returns a new fd or -1.
    let fd = unsafe { libc::memfd_create(c"ferry-guest".as_ptr(), flags) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error().into());
    }
    // SAFETY: fd is a fresh, owned descriptor.
    let file = unsafe { std::fs::File::from_raw_fd(fd) };
    file.set_len(size)?;
    // SAFETY: F_ADD_SEALS on a descriptor this function owns.
    if unsafe { libc::fcntl(file.as_raw_fd(), libc::F_ADD_SEALS, SEALS) } < 0 {
        return Err(std::io::Error::last_os_error().into());
    }
    Ok(file)
}

/// Checks that a memory file a live update passed is what ferry makes: a memfd of exactly
/// `len` bytes whose size is sealed (or, from a ferry before the seals, sealed shut as
/// memfds are by default).
pub fn check_passed_memfd(file: &std::fs::File, len: u64) -> std::result::Result<(), String> {
    use std::os::fd::AsRawFd;
    // SAFETY: F_GET_SEALS only reads the file's seals; it fails on anything but a memfd.
    let seals = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_GET_SEALS) };
    if seals < 0 {
        return Err(format!(
            "the passed file is not a memfd: {}",
            std::io::Error::last_os_error()
        ));
    }
    if seals != SEALS && seals != libc::F_SEAL_SEAL {
        return Err(format!(
            "the passed memfd carries seals {seals:#x}, not ferry's {SEALS:#x}"
        ));
    }
    let bytes = file
        .metadata()
        .map_err(|e| format!("the passed file: {e}"))?
        .len();
    if bytes != len {
        return Err(format!(
            "the passed memfd holds {}, not {}",
            MemorySize(bytes),
            MemorySize(len)
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::FromRawFd;

    #[test]
    fn parses_sizes_people_write() {
        assert_eq!("4G".parse::<MemorySize>().unwrap().0, 4 << 30);
        assert_eq!("512m".parse::<MemorySize>().unwrap().0, 512 << 20);
        assert_eq!("4096".parse::<MemorySize>().unwrap().0, 4096);
        assert!(
            "0".parse::<MemorySize>()
                .unwrap_err()
                .contains("larger than 0")
        );
        assert!(
            "abc"
                .parse::<MemorySize>()
                .unwrap_err()
                .contains("not a size")
        );
        assert!("99999999999T".parse::<MemorySize>().is_err());
    }

    /// A discarded page reads as zeros and takes no memory; the pages that held data are
    /// named (a page never touched is not), for both backends; a range outside RAM is refused.
    #[test]
    fn discarded_pages_read_zero_and_those_that_held_data_are_named() {
        use vm_memory::Bytes;
        for backend in [MemoryBackend::Anonymous, MemoryBackend::Memfd] {
            let m = create_guest_memory(MIN_MEMORY, backend).unwrap();
            use_small_pages(&m);
            for page in [3u64, 4, 9] {
                m.write_obj(0xabu64, GuestAddress(page * 4096)).unwrap();
            }
            let mut held = Vec::new();
            discard(&m, 2 * 4096, 10 * 4096, &mut |gpa, len| {
                held.push((gpa, len))
            })
            .unwrap();
            assert_eq!(
                held,
                vec![(3 * 4096, 2 * 4096), (9 * 4096, 4096)],
                "{backend:?}"
            );
            let mut again = Vec::new();
            discard(&m, 2 * 4096, 10 * 4096, &mut |g, l| again.push((g, l))).unwrap();
            assert!(
                again.is_empty(),
                "nothing held data the second time: {again:?}"
            );
            assert_eq!(m.read_obj::<u64>(GuestAddress(3 * 4096)).unwrap(), 0);
            assert!(discard(&m, MIN_MEMORY, 4096, &mut |_, _| {}).is_err());
            assert!(discard(&m, MIN_MEMORY - 4096, 8192, &mut |_, _| {}).is_err());
            assert!(discard(&m, 100, 4096, &mut |_, _| {}).is_err());
        }
    }

    /// A live update maps only a memfd of the range's size whose size is sealed: a plain file,
    /// a memfd its sender could still shrink (a SIGBUS in the VMM later) or one of another
    /// size is refused, naming why.
    #[test]
    fn a_passed_memory_file_must_be_a_sealed_memfd_of_the_range_size() {
        let len = MIN_MEMORY;
        check_passed_memfd(&memfd(len).unwrap(), len).unwrap();
        let plain = tempfile::tempfile().unwrap();
        plain.set_len(len).unwrap();
        let e = check_passed_memfd(&plain, len).unwrap_err();
        assert!(e.contains("not a memfd"), "{e}");
        // SAFETY: a fresh memfd that allows seals and carries none.
        let open = unsafe {
            std::fs::File::from_raw_fd(libc::memfd_create(
                c"open".as_ptr(),
                libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING,
            ))
        };
        open.set_len(len).unwrap();
        let e = check_passed_memfd(&open, len).unwrap_err();
        assert!(e.contains("seals 0x0"), "{e}");
        let e = check_passed_memfd(&memfd(len).unwrap(), 2 * len).unwrap_err();
        assert!(e.contains("holds"), "{e}");
        let sealed = memfd(len).unwrap();
        assert!(sealed.set_len(len / 2).is_err(), "the size is sealed");
    }

    /// What `discard` counts as holding data: a memfd's pages by `SEEK_DATA` (in RAM or in
    /// swap), anonymous pages by `mincore` and the page table's swap bit, read at the right
    /// entries of `/proc/self/pagemap` (its present bit agrees with `mincore`).
    #[test]
    fn held_pages_are_found_in_files_and_page_tables() {
        use vm_memory::{Bytes, GuestMemoryBackend, GuestMemoryRegion, MemoryRegionAddress};
        for backend in [MemoryBackend::Anonymous, MemoryBackend::Memfd] {
            let m = create_guest_memory(MIN_MEMORY, backend).unwrap();
            use_small_pages(&m);
            for page in [1u64, 2, 7] {
                m.write_obj(1u64, GuestAddress(page * 4096)).unwrap();
            }
            let region = m.find_region(GuestAddress(0)).unwrap();
            let host = region.get_host_address(MemoryRegionAddress(0)).unwrap();
            let backing = match region.file_offset() {
                Some(f) => Backing::File(f.file(), f.start()),
                None => Backing::Anonymous(host),
            };
            let mut out = [false; 9];
            held_pages(&backing, 0, &mut out).unwrap();
            let held: Vec<usize> = (0..9).filter(|&i| out[i]).collect();
            assert_eq!(held, [1, 2, 7], "{backend:?}");
            let present: Vec<usize> = pagemap(host, 9)
                .unwrap()
                .iter()
                .enumerate()
                .filter(|(_, e)| *e & (1 << 63) != 0)
                .map(|(i, _)| i)
                .collect();
            assert_eq!(present, [1, 2, 7], "{backend:?}: pagemap's present bit");
            assert_eq!(swapped(host, 9).unwrap(), [false; 9], "no swap here");
        }
    }

    /// Guest memory is advised for transparent huge pages, and a scan of memory backed by
    /// them names at least every page written (the zeros sharing their huge page too).
    #[test]
    fn guest_memory_asks_for_huge_pages_and_scans_still_see_every_write() {
        use vm_memory::{Bytes, GuestMemoryBackend, GuestMemoryRegion, MemoryRegionAddress};
        let m = create_guest_memory(MIN_MEMORY, MemoryBackend::Anonymous).unwrap();
        let region = m.find_region(GuestAddress(0)).unwrap();
        let host = region.get_host_address(MemoryRegionAddress(0)).unwrap() as usize;
        let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
        let flags = smaps
            .split("\n")
            .skip_while(|l| !l.starts_with(&format!("{host:x}-")))
            .find_map(|l| l.strip_prefix("VmFlags:"))
            .expect("the mapping in smaps");
        assert!(flags.split_whitespace().any(|f| f == "hg"), "{flags}");
        for page in [1u64, 2, 7, 1000] {
            m.write_obj(1u64, GuestAddress(page * 4096)).unwrap();
        }
        let mut out = [false; 1024];
        held_pages(&Backing::Anonymous(host as *mut u8), 0, &mut out).unwrap();
        assert!([1, 2, 7, 1000].iter().all(|&p| out[p]));
    }

    #[test]
    fn refuses_sizes_out_of_range() {
        assert!(create_guest_memory(1 << 20, MemoryBackend::Anonymous).is_err());
        let err = create_guest_memory(1 << 41, MemoryBackend::Anonymous).unwrap_err();
        assert!(err.to_string().contains("larger than ferry can map"));
    }
}
