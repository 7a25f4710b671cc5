//! Page frames (docs/protocol.md, "Frames"): the head a sender writes before a frame's page
//! data (frame header, page count, descriptors), and the reading of one: its descriptors
//! checked against guest RAM, its page CRCs, its data checked against the frame's trailer. The
//! receivers that put the pages in place are `pages`; `read_page_frame` reads a whole frame
//! into buffers, for post-copy and checkpoints, which install pages from a buffer.

use std::io::Read;

use crate::PAGE_SIZE;
use crate::error::{Error, Result};
use crate::memory::GuestRam;
use crate::wire::codec::Codec;
use crate::wire::delta::MAX_DELTA;
use crate::wire::frame::{self, FRAME_HEADER_LEN, KIND_PAGES, PAGE_DATA_UNCHECKED, PageEncoding};

/// Payload prefix of a page frame: page count u32, reserved u32.
pub(crate) const PREFIX_LEN: usize = 8;
/// A page read while the guest runs travels with its CRC-32 (see `PAGE_DATA_UNCHECKED`).
pub(crate) const DIGEST_LEN: usize = 4;

/// Fills `head` with the frame header, prefix and descriptors of `pfns` for `data_len` bytes of
/// page data; returns the frame's length field.
pub(crate) fn build_head(
    head: &mut Vec<u8>,
    pfns: &[(u64, PageEncoding)],
    flags: u8,
    data_len: usize,
) -> usize {
    let len = PREFIX_LEN + 8 * pfns.len() + data_len;
    head.clear();
    head.extend_from_slice(&frame::frame_header(KIND_PAGES, flags, len as u32));
    head.extend_from_slice(&(pfns.len() as u32).to_le_bytes());
    head.extend_from_slice(&[0; 4]);
    for &(pfn, enc) in pfns {
        head.extend_from_slice(&frame::descriptor(pfn, enc).to_le_bytes());
    }
    len
}

/// What a page frame's descriptors and flags say about the data that follows them.
pub(crate) struct FrameShape {
    pub(crate) count: u32,
    pub(crate) full: usize,
    pub(crate) deltas: usize,
    pub(crate) codec: Codec,
    /// Bytes of page data on the wire (compressed or not).
    pub(crate) data_len: usize,
}

impl FrameShape {
    /// The bounds of the page data once unpacked: whole pages, and for each delta its
    /// length and one run (4-byte header, at least one byte) up to `MAX_DELTA`.
    pub(crate) fn unpacked_len(&self) -> std::ops::RangeInclusive<usize> {
        let whole = PAGE_SIZE * self.full;
        whole + 7 * self.deltas..=whole + (2 + MAX_DELTA) * self.deltas
    }
}

/// Reads a page frame's prefix and descriptors into `descs` (checking count, bounds, flags
/// and length against `len`), and an unchecked frame's page CRCs into `digests`, feeding them
/// to `crc`.
pub(crate) fn read_descriptors(
    r: &mut impl Read,
    ram: &GuestRam,
    header: &[u8; FRAME_HEADER_LEN],
    len: u32,
    descs: &mut Vec<u8>,
    digests: &mut Vec<u8>,
    crc: &mut crc32fast::Hasher,
) -> Result<FrameShape> {
    let codec = Codec::from_flags(header[1])?;
    let mut prefix = [0u8; PREFIX_LEN];
    frame::read_exact(r, &mut prefix, "page frame")?;
    let count = u32::from_le_bytes(prefix[..4].try_into().unwrap());
    if count == 0 || count > frame::MAX_BATCH_PAGES {
        return Err(Error::Protocol(format!(
            "page frame with {count} pages (1..={} allowed)",
            frame::MAX_BATCH_PAGES
        )));
    }
    descs.resize(8 * count as usize, 0);
    frame::read_exact(r, descs, "page descriptors")?;
    crc.update(&prefix);
    crc.update(descs);
    let (mut full, mut deltas) = (0, 0);
    let mut previous: Option<u64> = None;
    for chunk in descs.chunks_exact(8) {
        let (pfn, enc) = frame::split_descriptor(u64::from_le_bytes(chunk.try_into().unwrap()))?;
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
        deltas += usize::from(enc == PageEncoding::Delta);
    }
    let mut shape = FrameShape {
        count,
        full,
        deltas,
        codec,
        data_len: 0,
    };
    let unchecked = header[1] & PAGE_DATA_UNCHECKED != 0;
    let digests_len = if unchecked { DIGEST_LEN * full } else { 0 };
    let data_len = (len as usize).checked_sub(PREFIX_LEN + 8 * count as usize + digests_len);
    let unpacked = shape.unpacked_len();
    if (codec != Codec::None || deltas > 0) && unchecked {
        return Err(Error::Protocol(
            "compressed or delta page data must be covered by the frame checksum".into(),
        ));
    }
    shape.data_len = match (codec, data_len) {
        (Codec::None, Some(n)) if unpacked.contains(&n) => n,
        (Codec::None, _) => {
            return Err(Error::Protocol(format!(
                "page frame length {len} does not match its {count} descriptors \
                 ({} to {} bytes of page data)",
                unpacked.start(),
                unpacked.end()
            )));
        }
        // A compressed frame must shrink its pages (or it would have been sent plain).
        (_, Some(n)) if n > 0 && n < *unpacked.end() => n,
        (_, _) => {
            return Err(Error::Protocol(format!(
                "{} page frame of length {len} for {full} full pages and {deltas} deltas",
                codec.name()
            )));
        }
    };
    digests.resize(digests_len, 0);
    frame::read_exact(r, digests, "page digests")?;
    crc.update(digests);
    Ok(shape)
}

/// Reads a frame's page data into `packed` and checks the frame's trailer, over the data too
/// where the trailer `covers` it.
pub(crate) fn read_packed(
    r: &mut impl Read,
    shape: &FrameShape,
    packed: &mut Vec<u8>,
    mut crc: crc32fast::Hasher,
    covers: bool,
) -> Result<()> {
    packed.resize(shape.data_len, 0);
    frame::read_exact(r, packed, "page data")?;
    if covers {
        crc.update(packed);
    }
    frame::check_trailer(r, crc.finalize(), "page frame")
}

/// The (page, encoding) pairs of descriptors already checked by `read_descriptors`.
pub(crate) fn descriptors(descs: &[u8]) -> impl Iterator<Item = (u64, PageEncoding)> + '_ {
    descs.chunks_exact(8).map(|c| {
        let d = u64::from_le_bytes(c.try_into().unwrap());
        (
            d >> 8,
            PageEncoding::from_u8(d as u8).unwrap_or(PageEncoding::Zero),
        )
    })
}

/// Whether `page` is the page whose CRC-32 the source `sent` beside it.
pub(crate) fn matches_digest(page: &[u8], sent: &[u8]) -> bool {
    crc32fast::hash(page).to_le_bytes() == sent
}

/// Buffers `read_page_frame` reuses from frame to frame.
#[derive(Default)]
pub struct FrameBuffers {
    descs: Vec<u8>,
    digests: Vec<u8>,
    data: Vec<u8>,
    packed: Vec<u8>,
}

/// Each page of a frame with its data (`None`: a zero page), borrowed from the read buffer.
pub type FramePages<'s> = Vec<(u64, Option<&'s [u8]>)>;

impl FrameBuffers {
    /// The pages of the frame last read into these buffers (`read_frame_into`).
    pub fn pages(&self) -> impl Iterator<Item = (u64, Option<&[u8]>)> + '_ {
        let mut data = self.data.chunks_exact(PAGE_SIZE);
        descriptors(&self.descs).map(move |(pfn, enc)| match enc {
            PageEncoding::Zero => (pfn, None),
            _ => (pfn, data.next()),
        })
    }

    /// That frame's pages, without their data.
    pub fn gfns(&self) -> impl Iterator<Item = u64> + '_ {
        descriptors(&self.descs).map(|(pfn, _)| pfn)
    }

    /// How many pages that frame holds.
    pub fn page_count(&self) -> u64 {
        (self.descs.len() / 8) as u64
    }
}

/// Reads a whole page frame into `scratch` (post-copy installs pages with `UFFDIO_COPY`, which
/// copies from a buffer) and returns each page with its data, `None` for a zero page.
pub fn read_page_frame<'s>(
    r: &mut impl Read,
    ram: &GuestRam,
    header: &[u8; FRAME_HEADER_LEN],
    len: u32,
    scratch: &'s mut FrameBuffers,
) -> Result<FramePages<'s>> {
    read_frame_into(r, ram, header, len, scratch)?;
    Ok(scratch.pages().collect())
}

/// Reads a whole page frame into `scratch`, checked (descriptors, checksum, each page's CRC),
/// for `FrameBuffers::pages` to give out, here or on another thread.
pub fn read_frame_into(
    r: &mut impl Read,
    ram: &GuestRam,
    header: &[u8; FRAME_HEADER_LEN],
    len: u32,
    scratch: &mut FrameBuffers,
) -> Result<()> {
    let mut crc = crc32fast::Hasher::new();
    crc.update(header);
    let FrameBuffers {
        descs,
        digests,
        data,
        packed,
    } = scratch;
    let shape = read_descriptors(r, ram, header, len, descs, digests, &mut crc)?;
    if shape.deltas > 0 {
        // Post-copy installs whole pages into memory that has no copy to apply a delta to.
        return Err(Error::Protocol(
            "a page delta after the switch to post-copy".into(),
        ));
    }
    if shape.codec == Codec::None {
        read_packed(r, &shape, data, crc, header[1] & PAGE_DATA_UNCHECKED == 0)?;
        // Installed pages are final: one that does not match its CRC is refused outright.
        for (page, sent) in data
            .chunks_exact(PAGE_SIZE)
            .zip(digests.chunks_exact(DIGEST_LEN))
        {
            if !matches_digest(page, sent) {
                return Err(Error::Protocol(
                    "a page arrived corrupt (its data does not match its CRC)".into(),
                ));
            }
        }
    } else {
        read_packed(r, &shape, packed, crc, true)?;
        data.resize(PAGE_SIZE * shape.full, 0);
        shape
            .codec
            .decompress(packed, data, PAGE_SIZE * shape.full)?;
    }
    Ok(())
}
