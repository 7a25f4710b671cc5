//! The page receiver: it reads page frames into guest memory. A plain frame's pages go
//! straight from the socket into place (`in_place`); a compressed, delta or installing frame
//! is read into a buffer, checked, unpacked and then put in place. Every lane of a migration
//! has its own receiver; they share what the main connection learns (pages faulted in ahead,
//! or where pages go while round 0's are installed).

use std::io::Read;
use std::sync::{Arc, OnceLock};

use super::in_place::read_in_place;
use crate::PAGE_SIZE;
use crate::bitmap::Bitmap;
use crate::copies::Copies;
use crate::error::{Error, Result};
use crate::memory::GuestRam;
use crate::wire::codec::Codec;
use crate::wire::delta;
use crate::wire::frame::{self, FRAME_HEADER_LEN, PAGE_DATA_UNCHECKED, PageEncoding};
use crate::wire::lanes::lane_of;
use crate::wire::page_frame::{
    DIGEST_LEN, FrameShape, descriptors, matches_digest, read_descriptors, read_packed,
};

/// Where a receiver puts whole pages while round 0's land, a run of consecutive pages at a
/// time, instead of reading them straight into guest memory (`destination::install`).
pub trait PagePlacer: Send + Sync {
    /// Whether pages go through `place` now.
    fn installing(&self) -> bool;
    /// Puts `data` (whole pages) at page `gfn` onward, all in one RAM region.
    fn place(&self, gfn: u64, data: &[u8]) -> Result<()>;
    /// Pages something else touched first while installing: present, as zeros or data.
    fn touched(&self) -> Vec<u64>;
}

/// What every lane's receiver of one migration shares, set once by the main connection.
#[derive(Default)]
struct Shared {
    /// Pages faulted in ahead of their data (zeros until it comes).
    ahead: OnceLock<Bitmap>,
    /// Where whole pages go while installing.
    placer: OnceLock<Arc<dyn PagePlacer>>,
}

/// Reads page frames into guest memory.
pub struct PageReceiver {
    descs: Vec<u8>,
    /// The frame's pages that carry data (whole or as a delta), in order.
    full: Vec<(u64, PageEncoding)>,
    zeros: Vec<u64>,
    /// Pages this receiver has written: a delta may only follow a whole copy, and a zero
    /// marker for any other page needs no write.
    written: Bitmap,
    /// Pages faulted in ahead, or where pages go instead: shared by every lane of the
    /// migration, set by the main connection when the source names round 0's pages.
    shared: Arc<Shared>,
    /// This frame's zero pages that were faulted in ahead and never written: given back.
    discard: Vec<u64>,
    /// Pages whose last copy came unchecked and did not match its CRC: the guest changed it
    /// on the way (a later copy mends it) or it was corrupted (nothing mends it).
    suspect: Bitmap,
    /// The CRCs an unchecked frame carries for its pages.
    digests: Vec<u8>,
    /// A compressed frame's data, and its pages unpacked.
    packed: Vec<u8>,
    unpacked: Vec<u8>,
    pub pages: u64,
    /// This receiver's connection and how many a migration has: it takes only its share.
    lane: (u32, u32),
    /// Copies of each page that landed intact, for a pre-copy to carry on from after a
    /// broken connection (`copies`).
    copies: Option<Arc<Copies>>,
}

impl PageReceiver {
    pub fn new(ram: &GuestRam) -> Self {
        Self {
            descs: Vec::new(),
            full: Vec::new(),
            zeros: Vec::new(),
            written: Bitmap::new(ram.gfn_end()),
            shared: Arc::default(),
            discard: Vec::new(),
            suspect: Bitmap::new(ram.gfn_end()),
            digests: Vec::new(),
            packed: Vec::new(),
            unpacked: Vec::new(),
            pages: 0,
            lane: (0, 1),
            copies: None,
        }
    }

    /// Counts the copies of each page that land intact (see `copies`).
    pub fn counting_copies(mut self, pages: u64) -> Self {
        self.copies = Some(Arc::new(Copies::new(pages)));
        self
    }

    pub fn counts_copies(&self) -> bool {
        self.copies.is_some()
    }

    /// What landed, for a source carrying on after a broken connection: every page received
    /// and the copies of each (a page whose last copy failed its check counts none).
    pub fn copies_held(&self) -> Option<(u64, Vec<(u16, u32)>)> {
        let copies = self.copies.as_ref()?;
        Some((self.pages, copies.runs(&self.suspect)))
    }

    /// A receiver for connection `lane` of `lanes`: pages of another lane are refused (two
    /// connections never write one page).
    pub fn for_lane(mut self, lane: u32, lanes: u32) -> Self {
        self.lane = (lane, lanes);
        self
    }

    /// A receiver that learns which pages were faulted in ahead, or where pages go, from
    /// `main` (another lane of the same migration).
    pub fn sharing_ahead_with(mut self, main: &PageReceiver) -> Self {
        self.shared = main.shared.clone();
        self
    }

    /// Takes in what another lane's receiver wrote.
    pub fn absorb(&mut self, other: &PageReceiver) {
        self.written.merge(&other.written);
        self.suspect.merge(&other.suspect);
        self.pages += other.pages;
    }

    /// Forgets pages whose copies were dropped from guest memory.
    pub fn forget(&mut self, dropped: &Bitmap) {
        self.written.subtract(dropped);
        self.suspect.subtract(dropped);
    }

    /// Pages whose last copy arrived unchecked and did not match the CRC it came with. Any
    /// left when the source has sent everything arrived corrupt.
    pub fn suspect(&self) -> &Bitmap {
        &self.suspect
    }

    /// Pages faulted in ahead of their data (zeros until it comes). A zero marker for one
    /// that no data reached gives it back, so the destination holds no more than the source.
    /// Once per migration: the source names them before its first round.
    pub fn present_ahead(&mut self, pages: Bitmap) -> Result<()> {
        self.shared
            .ahead
            .set(pages)
            .map_err(|_| Error::Protocol("the source named its populated pages twice".into()))
    }

    /// Whole pages go through `placer` while it is installing (every lane's). Once per
    /// migration, instead of `present_ahead`.
    pub fn install_with(&mut self, placer: Arc<dyn PagePlacer>) -> Result<()> {
        self.shared
            .placer
            .set(placer)
            .map_err(|_| Error::Protocol("the source named its populated pages twice".into()))
    }

    /// Pages this receiver has written into guest memory.
    pub fn written(&self) -> &Bitmap {
        &self.written
    }

    /// Pages that may be present in guest memory: written, or faulted in ahead. Post-copy
    /// must drop a pending one, or the guest would read it instead of asking the source.
    pub fn present(&self) -> Bitmap {
        let mut present = self.written.clone();
        if let Some(ahead) = self.shared.ahead.get() {
            present.merge(ahead);
        }
        for gfn in self
            .shared
            .placer
            .get()
            .map(|p| p.touched())
            .unwrap_or_default()
        {
            present.set(gfn);
        }
        present
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
        let shape = read_descriptors(
            r,
            ram,
            header,
            len,
            &mut self.descs,
            &mut self.digests,
            &mut crc,
        )?;
        self.sort_pages()?;
        let shared = Arc::clone(&self.shared);
        let placer = shared.placer.get().filter(|p| p.installing());
        let unchecked = header[1] & PAGE_DATA_UNCHECKED != 0;
        if shape.codec == Codec::None && shape.deltas == 0 && placer.is_none() {
            self.receive_in_place(r, ram, crc, unchecked)?;
        } else {
            self.receive_buffered(r, ram, &shape, crc, unchecked, placer.map(|p| &**p))?;
        }
        self.apply_zeros(ram)?;
        for &(pfn, _) in &self.full {
            self.written.set(pfn);
            if !unchecked {
                self.suspect.unset(pfn);
            }
        }
        if let Some(copies) = &self.copies {
            self.full
                .iter()
                .map(|&(pfn, _)| pfn)
                .for_each(|p| copies.add(p));
            self.zeros.iter().for_each(|&p| copies.add(p));
        }
        self.pages += u64::from(shape.count);
        Ok(())
    }

    /// Sorts the frame's pages into zero markers and pages with data; a page of another
    /// lane is refused.
    fn sort_pages(&mut self) -> Result<()> {
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
                PageEncoding::Zero => self.zeros.push(pfn),
                _ => self.full.push((pfn, enc)),
            }
        }
        Ok(())
    }

    /// Reads a plain frame's pages straight into guest memory, then checks them: against the
    /// frame's trailer, or (`unchecked`) each against the CRC it came with.
    fn receive_in_place(
        &mut self,
        r: &mut impl Read,
        ram: &GuestRam,
        mut crc: crc32fast::Hasher,
        unchecked: bool,
    ) -> Result<()> {
        read_in_place(r, ram, &self.full)?;
        if !unchecked {
            for &(pfn, _) in &self.full {
                crc.update(ram.page(pfn)?);
            }
        }
        frame::check_trailer(r, crc.finalize(), "page frame")?;
        if unchecked {
            for (&(pfn, _), sent) in self.full.iter().zip(self.digests.chunks_exact(DIGEST_LEN)) {
                judge(&mut self.suspect, pfn, matches_digest(ram.page(pfn)?, sent));
            }
        }
        Ok(())
    }

    /// Reads a compressed, delta or installing frame's data into a buffer, checks it, unpacks
    /// it and puts its pages in place (through `placer`, where one is installing).
    fn receive_buffered(
        &mut self,
        r: &mut impl Read,
        ram: &GuestRam,
        shape: &FrameShape,
        crc: crc32fast::Hasher,
        unchecked: bool,
        placer: Option<&dyn PagePlacer>,
    ) -> Result<()> {
        // Checked before it is unpacked or placed: a decompressor never sees a corrupt
        // frame. An unchecked frame's data is checked page by page, against its digests.
        read_packed(r, shape, &mut self.packed, crc, !unchecked)?;
        if unchecked {
            for (&(pfn, _), (page, sent)) in self.full.iter().zip(
                self.packed
                    .chunks_exact(PAGE_SIZE)
                    .zip(self.digests.chunks_exact(DIGEST_LEN)),
            ) {
                judge(&mut self.suspect, pfn, matches_digest(page, sent));
            }
        }
        let data: &[u8] = if shape.codec == Codec::None {
            &self.packed
        } else {
            let bounds = shape.unpacked_len();
            self.unpacked.resize(*bounds.end(), 0);
            let n = shape
                .codec
                .decompress(&self.packed, &mut self.unpacked, *bounds.start())?;
            &self.unpacked[..n]
        };
        place_pages(ram, &self.full, &self.written, data, placer)
    }

    /// The frame's zero markers: a page this receiver wrote is zeroed; one faulted in ahead
    /// and never written is given back.
    fn apply_zeros(&mut self, ram: &GuestRam) -> Result<()> {
        let ahead = self.shared.ahead.get();
        self.discard.clear();
        for &pfn in &self.zeros {
            if self.written.get(pfn) {
                ram.zero_page(pfn)?;
            } else if ahead.is_some_and(|a| a.get(pfn)) {
                self.discard.push(pfn);
            }
            self.suspect.unset(pfn);
        }
        ram.discard_pages(&self.discard)
    }
}

/// Writes a buffered frame's pages into guest memory: whole pages (through `placer`, a run
/// of neighbours at a time, where one is given), and deltas applied to the copy this
/// connection sent before; every byte of `data` must be used.
fn place_pages(
    ram: &GuestRam,
    pages: &[(u64, PageEncoding)],
    written: &Bitmap,
    data: &[u8],
    placer: Option<&dyn PagePlacer>,
) -> Result<()> {
    let short = || Error::Protocol("page frame: its data ends before its pages".into());
    let mut at = 0;
    let mut i = 0;
    while i < pages.len() {
        let (pfn, enc) = pages[i];
        if enc == PageEncoding::Full {
            // Whole pages that follow each other in memory follow each other in `data` too.
            let room = ram.pages_to_region_end(pfn);
            let mut n = 1;
            while i + n < pages.len()
                && pages[i + n] == (pfn + n as u64, PageEncoding::Full)
                && (n as u64) < room
            {
                n += 1;
            }
            let run = data.get(at..at + n * PAGE_SIZE).ok_or_else(short)?;
            match placer {
                Some(p) => p.place(pfn, run)?,
                None => {
                    for (k, page) in run.chunks_exact(PAGE_SIZE).enumerate() {
                        ram.write_page(pfn + k as u64, page)?;
                    }
                }
            }
            at += n * PAGE_SIZE;
            i += n;
            continue;
        }
        i += 1;
        if !written.get(pfn) {
            return Err(Error::Protocol(format!(
                "a delta for page {pfn:#x}, which this connection never sent whole"
            )));
        }
        let n = data.get(at..at + 2).ok_or_else(short)?;
        let n = u16::from_le_bytes([n[0], n[1]]) as usize;
        let d = data.get(at + 2..at + 2 + n).ok_or_else(short)?;
        // SAFETY: the destination's vCPUs are parked and this frame names the page once.
        delta::apply(unsafe { ram.pages_slice_mut(pfn, 1)? }, d)?;
        at += 2 + n;
    }
    if at != data.len() {
        return Err(Error::Protocol(format!(
            "page frame: {} bytes of data left over after its pages",
            data.len() - at
        )));
    }
    Ok(())
}

/// Marks `pfn` suspect when its data did not match the CRC it came with, and clears it when
/// it did (a later copy mends an earlier one).
fn judge(suspect: &mut Bitmap, pfn: u64, matches: bool) {
    if matches {
        suspect.unset(pfn);
    } else {
        suspect.set(pfn);
    }
}
