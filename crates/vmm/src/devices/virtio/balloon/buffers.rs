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

/// How much of a guest's buffers one turn serves under the device's lock. A buffer may name
/// millions of scattered pages, each a pair of system calls to give back: served whole, it
/// would hold the lock (and every API call, scrape or pause that needs the device) for as
/// long as the guest likes. A turn spends `TURN_UNITS`: a page number read or a page given
/// back costs 1, each run given back (its system calls) `RUN_UNITS` more.
pub struct Turn {
    left: std::cell::Cell<u64>,
}

const TURN_UNITS: u64 = 4 * 1024;
const RUN_UNITS: u64 = 64;
/// The longest run given back at once, in pages: a turn's worth.
const MAX_RUN_PAGES: u64 = TURN_UNITS - RUN_UNITS;

impl Turn {
    pub fn new() -> Self {
        Self {
            left: std::cell::Cell::new(TURN_UNITS),
        }
    }

    fn spend(&self, units: u64) {
        self.left.set(self.left.get().saturating_sub(units));
    }

    /// A run of `len` bytes given back.
    fn gave(&self, len: u64) {
        self.spend(RUN_UNITS + len / PAGE);
    }

    pub fn spent(&self) -> bool {
        self.left.get() == 0
    }
}

/// A buffer served, or served up to a point: `resume_at` is where the next turn goes on (in
/// page numbers for an inflate or deflate, in pages for a report), `None` when it is done.
#[derive(Debug, PartialEq, Eq)]
pub struct Served {
    /// Page numbers or ranges that named no RAM, left out.
    pub refused: u64,
    pub resume_at: Option<u64>,
}

impl Served {
    fn done(refused: u64) -> Self {
        Self {
            refused,
            resume_at: None,
        }
    }
}

/// Consecutive pages, gathered into one run while they stay in one RAM region and the run
/// is shorter than a turn's worth.
#[derive(Default)]
pub(super) struct Runs {
    run: Option<(u64, u64, u64)>, // first address, bytes, end of its region
}

impl Runs {
    pub(super) fn add(&mut self, gpa: u64, region_end: u64, out: &mut dyn FnMut(u64, u64)) {
        match &mut self.run {
            Some((first, len, end))
                if *first + *len == gpa && gpa < *end && *len < MAX_RUN_PAGES * PAGE =>
            {
                *len += PAGE
            }
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
/// numbers (32-bit, 4 KiB pages) in `descs` name, in order, from the `from`th number on, for
/// one `turn`. Numbers that name no page of RAM are left out and counted. Refused whole: a
/// buffer the device may only write, one whose length is not a multiple of 4 bytes, one
/// outside RAM.
pub fn pfn_runs(
    descs: &[Descriptor],
    memory: &GuestMemory,
    from: u64,
    turn: &Turn,
    run: &mut dyn FnMut(u64, u64),
) -> Result<Served, Refused> {
    readable(descs, memory, 4)?;
    let mut out = |gpa: u64, len: u64| {
        turn.gave(len);
        run(gpa, len);
    };
    let total: u64 = descs.iter().map(|d| u64::from(d.len()) / 4).sum();
    let mut bytes = [0u8; PFN_CHUNK * 4];
    let (mut runs, mut refused) = (Runs::default(), 0);
    let mut first = 0u64; // the index of this buffer's first number
    for d in descs {
        let count = u64::from(d.len()) / 4;
        let mut at = from.saturating_sub(first).min(count);
        while at < count {
            let n = (count - at).min(PFN_CHUNK as u64) as usize;
            memory
                .read_slice(&mut bytes[..n * 4], GuestAddress(d.addr().0 + at * 4))
                .map_err(|e| Refused(format!("reading page numbers: {e}")))?;
            for pfn in bytes[..n * 4].chunks_exact(4) {
                let gpa = u64::from(u32::from_le_bytes(pfn.try_into().unwrap())) * PAGE;
                match region_end(memory, gpa) {
                    Some(end) => runs.add(gpa, end, &mut out),
                    None => refused += 1,
                }
                turn.spend(1);
                at += 1;
                if turn.spent() && first + at < total {
                    runs.flush(&mut out);
                    return Ok(Served {
                        refused,
                        resume_at: Some(first + at),
                    });
                }
            }
        }
        first += count;
    }
    runs.flush(&mut out);
    Ok(Served::done(refused))
}

/// Calls `range` with each range (address, bytes) a free page report names: one per buffer,
/// whole pages inside one RAM region, in either direction (Linux hands them over as buffers
/// the device may write), from the `from`th page of the report on, in pieces of at most a
/// turn's worth, for one `turn`. Buffers that name no such range are left out and counted.
pub fn report_ranges(
    descs: &[Descriptor],
    memory: &GuestMemory,
    from: u64,
    turn: &Turn,
    range: &mut dyn FnMut(u64, u64),
) -> Served {
    let total: u64 = descs.iter().map(|d| u64::from(d.len()) / PAGE).sum();
    let (mut refused, mut first) = (0, 0u64); // first: the report's page where a buffer begins
    for d in descs {
        let (gpa, len) = (d.addr().0, u64::from(d.len()));
        let pages = len / PAGE;
        let fits = region_end(memory, gpa).is_some_and(|end| gpa.checked_add(len) <= Some(end));
        if !(fits && len > 0 && gpa.is_multiple_of(PAGE) && len.is_multiple_of(PAGE)) {
            // Counted in the turn that reaches it, not again in a later one.
            refused += u64::from(from <= first);
            first += pages;
            continue;
        }
        let mut at = from.saturating_sub(first).min(pages);
        while at < pages {
            let n = (pages - at).min(MAX_RUN_PAGES);
            turn.gave(n * PAGE);
            range(gpa + at * PAGE, n * PAGE);
            at += n;
            if turn.spent() && first + at < total {
                return Served {
                    refused,
                    resume_at: Some(first + at),
                };
            }
        }
        first += pages;
    }
    Served::done(refused)
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
