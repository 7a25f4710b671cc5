//! What a balloon's driver hands over, read and checked: arrays of page frame numbers (the
//! inflate and deflate queues), free page reports (ranges of whole pages) and statistics.
//! Nothing a guest gives is trusted: a buffer of the wrong shape is refused whole, a page or a
//! range outside RAM alone; the rest is served. A guest that lies only hurts itself.

use serde::{Deserialize, Serialize};
use virtio_queue::desc::split::Descriptor;
use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryRegion};

use crate::memory::GuestMemory;

pub const PAGE: u64 = 4096;
/// PFNs read from guest memory at a time (a buffer may name gigabytes of them; the VMM never
/// allocates what a guest asks).
const PFN_CHUNK: usize = 1024;
/// One statistic: a 16-bit tag and a 64-bit value, packed.
const STAT_LEN: usize = 10;
/// The most statistics a buffer is read for (the spec names 16 tags).
const MAX_STATS: usize = 64;

/// Why a buffer was refused whole (it is given back untouched).
#[derive(Debug, PartialEq, Eq)]
pub struct Refused(pub String);

/// Checks that every buffer of `descs` is one the device reads, `unit`-sized pieces, in RAM.
fn readable(descs: &[Descriptor], memory: &GuestMemory, unit: u32) -> Result<(), Refused> {
    for d in descs {
        if d.is_write_only() || !d.len().is_multiple_of(unit) {
            return Err(Refused(format!(
                "a buffer of {} bytes the device may {} (want readable, a multiple of {unit})",
                d.len(),
                if d.is_write_only() {
                    "only write"
                } else {
                    "read"
                },
            )));
        }
        if !memory.check_range(d.addr(), d.len() as usize) {
            return Err(Refused(format!(
                "a buffer at {:#x} ({} bytes) outside guest RAM",
                d.addr().0,
                d.len()
            )));
        }
    }
    Ok(())
}

/// Where the RAM region holding `gpa` ends, if `gpa` is RAM.
pub(super) fn region_end(memory: &GuestMemory, gpa: u64) -> Option<u64> {
    let r = memory.find_region(GuestAddress(gpa))?;
    Some(r.start_addr().0 + r.len())
}

/// Consecutive pages, gathered into one run while they stay in one RAM region.
#[derive(Default)]
pub(super) struct Runs {
    run: Option<(u64, u64, u64)>, // first address, bytes, end of its region
}

impl Runs {
    pub(super) fn add(&mut self, gpa: u64, region_end: u64, out: &mut dyn FnMut(u64, u64)) {
        match &mut self.run {
            Some((first, len, end)) if *first + *len == gpa && gpa < *end => *len += PAGE,
            _ => {
                self.flush(out);
                self.run = Some((gpa, PAGE, region_end));
            }
        }
    }

    pub(super) fn flush(&mut self, out: &mut dyn FnMut(u64, u64)) {
        if let Some((first, len, _)) = self.run.take() {
            out(first, len);
        }
    }
}

/// Calls `run` with each run of consecutive pages (address, bytes) that the page frame
/// numbers (32-bit, 4 KiB pages) in `descs` name, in order; returns how many named no page of
/// RAM, which are left out. Refused whole: a buffer the device may only write, one whose
/// length is not a multiple of 4 bytes, one outside RAM.
pub fn pfn_runs(
    descs: &[Descriptor],
    memory: &GuestMemory,
    run: &mut dyn FnMut(u64, u64),
) -> Result<u64, Refused> {
    readable(descs, memory, 4)?;
    let mut bytes = [0u8; PFN_CHUNK * 4];
    let (mut runs, mut refused) = (Runs::default(), 0);
    for d in descs {
        let mut at = 0u64;
        while at < u64::from(d.len()) {
            let n = (u64::from(d.len()) - at).min(bytes.len() as u64) as usize;
            memory
                .read_slice(&mut bytes[..n], GuestAddress(d.addr().0 + at))
                .map_err(|e| Refused(format!("reading page numbers: {e}")))?;
            for pfn in bytes[..n].chunks_exact(4) {
                let gpa = u64::from(u32::from_le_bytes(pfn.try_into().unwrap())) * PAGE;
                match region_end(memory, gpa) {
                    Some(end) => runs.add(gpa, end, run),
                    None => refused += 1,
                }
            }
            at += n as u64;
        }
    }
    runs.flush(run);
    Ok(refused)
}

/// Calls `range` with each range (address, bytes) a free page report names: one per buffer,
/// whole pages inside one RAM region, in either direction (Linux hands them over as buffers
/// the device may write). Returns how many buffers named no such range, which are left out.
pub fn report_ranges(
    descs: &[Descriptor],
    memory: &GuestMemory,
    range: &mut dyn FnMut(u64, u64),
) -> u64 {
    let mut refused = 0;
    for d in descs {
        let (gpa, len) = (d.addr().0, u64::from(d.len()));
        let fits = region_end(memory, gpa).is_some_and(|end| gpa.checked_add(len) <= Some(end));
        if fits && len > 0 && gpa.is_multiple_of(PAGE) && len.is_multiple_of(PAGE) {
            range(gpa, len);
        } else {
            refused += 1;
        }
    }
    refused
}

/// A free page hinting command id: one buffer the device reads, a le32.
pub fn read_cmd_id(d: &Descriptor, memory: &GuestMemory) -> Result<u32, Refused> {
    readable(std::slice::from_ref(d), memory, 4)?;
    if d.len() != 4 {
        return Err(Refused(format!(
            "a command id of {} bytes (want 4)",
            d.len()
        )));
    }
    let id: u32 = memory
        .read_obj(d.addr())
        .map_err(|e| Refused(format!("reading a command id: {e}")))?;
    Ok(u32::from_le(id))
}

/// The guest's memory statistics (`VIRTIO_BALLOON_F_STATS_VQ`), as it last gave them; a
/// statistic it never gave is `None`. Sizes are in bytes, as the spec has them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct GuestStats {
    pub swap_in_bytes: Option<u64>,
    pub swap_out_bytes: Option<u64>,
    pub major_faults: Option<u64>,
    pub minor_faults: Option<u64>,
    pub free_bytes: Option<u64>,
    pub total_bytes: Option<u64>,
    pub available_bytes: Option<u64>,
    pub caches_bytes: Option<u64>,
}

impl GuestStats {
    /// Takes one statistic; unknown tags are ignored (as the spec says).
    fn take(&mut self, tag: u16, value: u64) {
        let slot = match tag {
            0 => &mut self.swap_in_bytes,
            1 => &mut self.swap_out_bytes,
            2 => &mut self.major_faults,
            3 => &mut self.minor_faults,
            4 => &mut self.free_bytes,
            5 => &mut self.total_bytes,
            6 => &mut self.available_bytes,
            7 => &mut self.caches_bytes,
            _ => return,
        };
        *slot = Some(value);
    }
}

/// Adds the statistics in `descs` (tag and value pairs, 10 bytes each, at most 64 read) to
/// `stats`. Refused whole: a buffer the device may only write, one outside RAM, or a length
/// that is not a multiple of 10 bytes in all.
pub fn read_stats(
    descs: &[Descriptor],
    memory: &GuestMemory,
    stats: &mut GuestStats,
) -> Result<(), Refused> {
    readable(descs, memory, 1)?;
    let total: u64 = descs.iter().map(|d| u64::from(d.len())).sum();
    if !total.is_multiple_of(STAT_LEN as u64) {
        return Err(Refused(format!(
            "statistics of {total} bytes, not a multiple of {STAT_LEN}"
        )));
    }
    let mut buf = [0u8; STAT_LEN * MAX_STATS];
    let mut filled = 0;
    for d in descs {
        let n = (d.len() as usize).min(buf.len() - filled);
        memory
            .read_slice(&mut buf[filled..filled + n], d.addr())
            .map_err(|e| Refused(format!("reading statistics: {e}")))?;
        filled += n;
    }
    for s in buf[..filled].chunks_exact(STAT_LEN) {
        let tag = u16::from_le_bytes([s[0], s[1]]);
        stats.take(tag, u64::from_le_bytes(s[2..].try_into().unwrap()));
    }
    Ok(())
}
