//! Pages on the wire: the sender batches pages into frames written with one vectored write
//! straight from guest memory; the receiver reads page data straight into guest memory.

use std::io::{IoSlice, IoSliceMut, Read, Write};

use crate::PAGE_SIZE;
use crate::error::{Error, Result};
use crate::memory::GuestRam;
use crate::ratelimit::RateLimiter;
use crate::wire::bitmap::Bitmap;
use crate::wire::frame::{
    self as protocol, FRAME_HEADER_LEN, KIND_PAGES, PAGE_DATA_UNCHECKED, PageEncoding,
};
use crate::wire::zero::is_zero_page;

/// Payload prefix of a page frame: page count u32, reserved u32.
const PREFIX_LEN: usize = 8;
/// Most connections one migration may use.
pub const MAX_CONNECTIONS: u32 = 16;
/// Pages of one 2 MiB chunk travel on the same connection (see `lane_of`).
const LANE_CHUNK_PAGES: u64 = 512;

/// The connection (0..lanes) that carries page `pfn` when a migration uses `lanes` of them:
/// always the same one, so a page's copies arrive in the order they were sent.
pub fn lane_of(pfn: u64, lanes: u32) -> u32 {
    ((pfn / LANE_CHUNK_PAGES) % u64::from(lanes.max(1))) as u32
}

/// What a sender has put on the wire so far.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SendCounters {
    pub full: u64,
    pub zero: u64,
    pub bytes: u64,
}

/// Collects pages into frames and sends each frame with one vectored write.
pub struct PageSender {
    pfns: Vec<(u64, PageEncoding)>,
    head: Vec<u8>,
    batch: usize,
    /// Whether page data is covered by the frame checksum (only when the guest is paused).
    pub checked: bool,
    pub counters: SendCounters,
}

impl PageSender {
    pub fn new(batch: usize) -> Self {
        let batch = batch.clamp(1, protocol::MAX_BATCH_PAGES as usize);
        Self {
            pfns: Vec::with_capacity(batch),
            head: Vec::with_capacity(FRAME_HEADER_LEN + PREFIX_LEN + 8 * batch),
            batch,
            checked: false,
            counters: SendCounters::default(),
        }
    }

    /// Queues page `pfn` (a zero page becomes a marker) and sends a frame when one is full.
    pub fn push(
        &mut self,
        w: &mut impl Write,
        ram: &GuestRam,
        pfn: u64,
        limiter: &mut RateLimiter,
    ) -> Result<()> {
        let enc = if is_zero_page(ram.page(pfn)?) {
            PageEncoding::Zero
        } else {
            PageEncoding::Full
        };
        self.pfns.push((pfn, enc));
        if self.pfns.len() >= self.batch {
            self.flush(w, ram, limiter)?;
        }
        Ok(())
    }

    pub fn flush(
        &mut self,
        w: &mut impl Write,
        ram: &GuestRam,
        limiter: &mut RateLimiter,
    ) -> Result<()> {
        if self.pfns.is_empty() {
            return Ok(());
        }
        // The wire wants each frame's pages in ascending order (a page named twice is refused).
        self.pfns.sort_unstable_by_key(|&(pfn, _)| pfn);
        self.pfns.dedup_by_key(|&mut (pfn, _)| pfn);
        let full = self
            .pfns
            .iter()
            .filter(|(_, e)| *e == PageEncoding::Full)
            .count();
        let len = PREFIX_LEN + 8 * self.pfns.len() + PAGE_SIZE * full;
        let flags = if self.checked { 0 } else { PAGE_DATA_UNCHECKED };
        self.head.clear();
        self.head
            .extend_from_slice(&protocol::frame_header(KIND_PAGES, flags, len as u32));
        self.head
            .extend_from_slice(&(self.pfns.len() as u32).to_le_bytes());
        self.head.extend_from_slice(&[0; 4]);
        for &(pfn, enc) in &self.pfns {
            self.head
                .extend_from_slice(&protocol::descriptor(pfn, enc).to_le_bytes());
        }

        let mut crc = crc32fast::Hasher::new();
        crc.update(&self.head);
        let mut slices: Vec<IoSlice<'_>> = Vec::with_capacity(full + 2);
        slices.push(IoSlice::new(&self.head));
        // Adjacent pages are adjacent in the host mapping too: one slice per run.
        let mut run: Option<(u64, u64)> = None;
        for &(pfn, _) in self.pfns.iter().filter(|(_, e)| *e == PageEncoding::Full) {
            if self.checked {
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
        limiter.take(frame_bytes);
        protocol::write_all_vectored(w, &mut slices)?;
        self.counters.full += full as u64;
        self.counters.zero += (self.pfns.len() - full) as u64;
        self.counters.bytes += frame_bytes;
        self.pfns.clear();
        Ok(())
    }
}

/// Reads page frames into guest memory.
pub struct PageReceiver {
    descs: Vec<u8>,
    full: Vec<u64>,
    zeros: Vec<u64>,
    /// Pages this receiver has written: a zero marker for any other page needs no write.
    written: Bitmap,
    pub pages: u64,
    /// This receiver's connection and how many a migration has: it takes only its share.
    lane: (u32, u32),
}

impl PageReceiver {
    pub fn new(ram: &GuestRam) -> Self {
        Self {
            descs: Vec::new(),
            full: Vec::new(),
            zeros: Vec::new(),
            written: Bitmap::new(ram.gfn_end()),
            pages: 0,
            lane: (0, 1),
        }
    }

    /// A receiver for connection `lane` of `lanes`: pages of another lane are refused (two
    /// connections never write one page).
    pub fn for_lane(mut self, lane: u32, lanes: u32) -> Self {
        self.lane = (lane, lanes);
        self
    }

    /// Takes in what another lane's receiver wrote.
    pub fn absorb(&mut self, other: &PageReceiver) {
        self.written.merge(&other.written);
        self.pages += other.pages;
    }

    /// Forgets pages whose copies were dropped from guest memory.
    pub fn forget(&mut self, dropped: &Bitmap) {
        self.written.subtract(dropped);
    }

    /// Pages this receiver has written into guest memory.
    pub fn written(&self) -> &Bitmap {
        &self.written
    }

    /// Reads the body of a page frame whose header was `header`.
    pub fn receive(
        &mut self,
        r: &mut impl Read,
        ram: &GuestRam,
        header: &[u8; FRAME_HEADER_LEN],
        len: u32,
    ) -> Result<()> {
        let mut crc = crc32fast::Hasher::new();
        crc.update(header);
        let count = read_descriptors(r, ram, len, &mut self.descs, &mut crc)?;
        self.full.clear();
        self.zeros.clear();
        for (pfn, enc) in descriptors(&self.descs) {
            let (lane, lanes) = self.lane;
            if lane_of(pfn, lanes) != lane {
                return Err(Error::Protocol(format!(
                    "page {pfn:#x} arrived on connection {lane}, but belongs to connection {}",
                    lane_of(pfn, lanes)
                )));
            }
            match enc {
                PageEncoding::Full => self.full.push(pfn),
                PageEncoding::Zero => self.zeros.push(pfn),
            }
        }
        self.read_full_pages(r, ram)?;
        for &pfn in &self.zeros {
            if self.written.get(pfn) {
                ram.zero_page(pfn)?;
            }
        }
        if header[1] & PAGE_DATA_UNCHECKED == 0 {
            for &pfn in &self.full {
                crc.update(ram.page(pfn)?);
            }
        }
        protocol::check_trailer(r, crc.finalize(), "page frame")?;
        for &pfn in &self.full {
            self.written.set(pfn);
        }
        self.pages += u64::from(count);
        Ok(())
    }

    fn read_full_pages(&mut self, r: &mut impl Read, ram: &GuestRam) -> Result<()> {
        let mut slices: Vec<IoSliceMut<'_>> = Vec::with_capacity(self.full.len());
        let mut i = 0;
        while i < self.full.len() {
            let start = self.full[i];
            let room = ram.pages_to_region_end(start);
            let mut n = 1;
            while i + n < self.full.len()
                && self.full[i + n] == start + n as u64
                && (n as u64) < room
            {
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
}

/// Reads a page frame's prefix and descriptors into `descs` (checking count, bounds and
/// length against `len`), feeding them to `crc`; returns the page count.
fn read_descriptors(
    r: &mut impl Read,
    ram: &GuestRam,
    len: u32,
    descs: &mut Vec<u8>,
    crc: &mut crc32fast::Hasher,
) -> Result<u32> {
    let mut prefix = [0u8; PREFIX_LEN];
    protocol::read_exact(r, &mut prefix, "page frame")?;
    let count = u32::from_le_bytes(prefix[..4].try_into().unwrap());
    if count == 0 || count > protocol::MAX_BATCH_PAGES {
        return Err(Error::Protocol(format!(
            "page frame with {count} pages (1..={} allowed)",
            protocol::MAX_BATCH_PAGES
        )));
    }
    descs.resize(8 * count as usize, 0);
    protocol::read_exact(r, descs, "page descriptors")?;
    crc.update(&prefix);
    crc.update(descs);
    let mut full = 0;
    let mut previous: Option<u64> = None;
    for chunk in descs.chunks_exact(8) {
        let (pfn, enc) = protocol::split_descriptor(u64::from_le_bytes(chunk.try_into().unwrap()))?;
        if !ram.contains(pfn) {
            return Err(Error::Protocol(format!(
                "page {pfn:#x} lies outside guest RAM"
            )));
        }
        // Ascending order makes a page named twice (two writers of one page) impossible.
        if previous.is_some_and(|p| pfn <= p) {
            return Err(Error::Protocol(format!(
                "page frame names page {pfn:#x} out of order or twice"
            )));
        }
        previous = Some(pfn);
        full += usize::from(enc == PageEncoding::Full);
    }
    let expected = PREFIX_LEN + 8 * count as usize + PAGE_SIZE * full;
    if expected != len as usize {
        return Err(Error::Protocol(format!(
            "page frame length {len} does not match its {count} descriptors ({expected})"
        )));
    }
    Ok(count)
}

/// The (page, encoding) pairs of descriptors already checked by `read_descriptors`.
fn descriptors(descs: &[u8]) -> impl Iterator<Item = (u64, PageEncoding)> + '_ {
    descs.chunks_exact(8).map(|c| {
        let d = u64::from_le_bytes(c.try_into().unwrap());
        (
            d >> 8,
            PageEncoding::from_u8(d as u8).unwrap_or(PageEncoding::Zero),
        )
    })
}

/// Buffers `read_page_frame` reuses from frame to frame.
#[derive(Default)]
pub struct FrameBuffers {
    descs: Vec<u8>,
    data: Vec<u8>,
}

/// Each page of a frame with its data (`None`: a zero page), borrowed from the read buffer.
pub type FramePages<'s> = Vec<(u64, Option<&'s [u8]>)>;

/// Reads a whole page frame into `scratch` (post-copy installs pages with `UFFDIO_COPY`, which
/// copies from a buffer) and returns each page with its data, `None` for a zero page.
pub fn read_page_frame<'s>(
    r: &mut impl Read,
    ram: &GuestRam,
    header: &[u8; FRAME_HEADER_LEN],
    len: u32,
    scratch: &'s mut FrameBuffers,
) -> Result<FramePages<'s>> {
    let mut crc = crc32fast::Hasher::new();
    crc.update(header);
    let FrameBuffers { descs, data } = scratch;
    read_descriptors(r, ram, len, descs, &mut crc)?;
    let data_len = len as usize - PREFIX_LEN - descs.len();
    data.resize(data_len, 0);
    protocol::read_exact(r, data, "page data")?;
    if header[1] & PAGE_DATA_UNCHECKED == 0 {
        crc.update(data);
    }
    protocol::check_trailer(r, crc.finalize(), "page frame")?;
    let mut data = data.chunks_exact(PAGE_SIZE);
    Ok(descriptors(descs)
        .map(|(pfn, enc)| match enc {
            PageEncoding::Full => (pfn, data.next()),
            PageEncoding::Zero => (pfn, None),
        })
        .collect())
}
