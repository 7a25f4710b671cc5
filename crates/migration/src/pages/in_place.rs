//! Plain page frames straight between guest memory and the socket, with no copy: the sender
//! writes a frame's pages from guest memory in one vectored write, and the receiver reads them
//! into guest memory in one vectored read. Pages next to each other in a RAM region are one
//! slice.

use std::io::{IoSlice, IoSliceMut, Read, Write};
use std::time::{Duration, Instant};

use super::policy::BatchCost;
use crate::PAGE_SIZE;
use crate::error::{Error, Result};
use crate::memory::GuestRam;
use crate::ratelimit::RateLimiter;
use crate::wire::codec::Codec;
use crate::wire::frame::{self as protocol, FRAME_HEADER_LEN, PAGE_DATA_UNCHECKED, PageEncoding};
use crate::wire::page_frame::{DIGEST_LEN, build_head};

/// The pages of `pfns` that carry their data whole.
pub(super) fn full_pages(pfns: &[(u64, PageEncoding)]) -> impl Iterator<Item = u64> + '_ {
    pfns.iter()
        .filter(|(_, e)| *e == PageEncoding::Full)
        .map(|&(pfn, _)| pfn)
}

/// Writes a frame of `pfns` (`full` of them whole, the others zero markers), their data
/// straight from guest memory, covered by the frame's checksum when `checked`, each with its
/// own CRC otherwise; `head` is the buffer for the frame's head. Returns the frame's bytes
/// and what it cost.
pub(super) fn write_in_place(
    w: &mut impl Write,
    ram: &GuestRam,
    limiter: &mut RateLimiter,
    head: &mut Vec<u8>,
    pfns: &[(u64, PageEncoding)],
    checked: bool,
    full: usize,
) -> Result<(u64, BatchCost)> {
    let flags = if checked { 0 } else { PAGE_DATA_UNCHECKED };
    let digests = if checked { 0 } else { DIGEST_LEN * full };
    let len = build_head(head, pfns, flags, digests + PAGE_SIZE * full);
    if !checked {
        // Each page's CRC as read now: the guest may write it before it leaves, and then
        // it is dirty and goes again; a mismatch that no later copy mends is corruption.
        for pfn in full_pages(pfns) {
            let digest = crc32fast::hash(ram.page(pfn)?);
            head.extend_from_slice(&digest.to_le_bytes());
        }
    }
    let mut crc = crc32fast::Hasher::new();
    crc.update(head);
    let mut slices: Vec<IoSlice<'_>> = Vec::with_capacity(full + 2);
    slices.push(IoSlice::new(head));
    let mut run: Option<(u64, u64)> = None;
    for pfn in full_pages(pfns) {
        if checked {
            crc.update(ram.page(pfn)?);
        }
        run = match run {
            // Adjacent pages of one region are adjacent in the host mapping too.
            Some((start, n)) if start + n == pfn && ram.pages_to_region_end(start) > n => {
                Some((start, n + 1))
            }
            Some((start, n)) => {
                slices.push(IoSlice::new(ram.pages_slice(start, n)?));
                Some((pfn, 1))
            }
            None => Some((pfn, 1)),
        };
    }
    if let Some((start, n)) = run {
        slices.push(IoSlice::new(ram.pages_slice(start, n)?));
    }
    let trailer = crc.finalize().to_le_bytes();
    slices.push(IoSlice::new(&trailer));
    let frame_bytes = (FRAME_HEADER_LEN + len + 4) as u64;
    let started = Instant::now();
    limiter.take(frame_bytes);
    protocol::write_all_vectored(w, &mut slices)?;
    let data = PAGE_SIZE * full;
    Ok((
        frame_bytes,
        BatchCost {
            codec: Codec::None,
            raw_bytes: data,
            packed_bytes: data,
            compress_time: Duration::ZERO,
            write_time: started.elapsed(),
            cycle: None,
        },
    ))
}

/// Reads the data of `full` (whole pages, in ascending order, each named once) straight into
/// guest memory.
pub(super) fn read_in_place(
    r: &mut impl Read,
    ram: &GuestRam,
    full: &[(u64, PageEncoding)],
) -> Result<()> {
    let mut slices: Vec<IoSliceMut<'_>> = Vec::with_capacity(full.len());
    let mut i = 0;
    while i < full.len() {
        let start = full[i].0;
        let room = ram.pages_to_region_end(start);
        let mut n = 1;
        while i + n < full.len() && full[i + n].0 == start + n as u64 && (n as u64) < room {
            n += 1;
        }
        // SAFETY: the destination's vCPUs are parked, and the parser refused frames that
        // name a page twice, so these slices never overlap.
        slices.push(IoSliceMut::new(unsafe {
            ram.pages_slice_mut(start, n as u64)?
        }));
        i += n;
    }
    let mut bufs = slices.as_mut_slice();
    while !bufs.is_empty() {
        match r.read_vectored(bufs) {
            Ok(0) => return Err(Error::Protocol("stream truncated in page data".into())),
            Ok(n) => IoSliceMut::advance_slices(&mut bufs, n),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(Error::transport("reading page data", e)),
        }
    }
    Ok(())
}
