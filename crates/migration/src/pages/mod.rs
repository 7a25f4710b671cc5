//! The page pipeline: the sender batches pages into frames written with one vectored write
//! straight from guest memory; the receiver reads page data straight into guest memory.

mod packers;

use std::io::{IoSlice, IoSliceMut, Read, Write};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use crate::PAGE_SIZE;
use crate::bitmap::Bitmap;
use crate::cpu::CpuMeter;
use crate::error::{Error, Result};
use crate::io::transport::Stream;
use crate::memory::GuestRam;
use crate::ratelimit::RateLimiter;
use crate::wire::codec::{
    BatchCost, Chooser, Codec, CodecMeasures, Compression, Contexts, SAMPLE_SHARE,
};
use crate::wire::delta::{self, DeltaCache};
use crate::wire::frame::{self as protocol, FRAME_HEADER_LEN, PAGE_DATA_UNCHECKED, PageEncoding};
use crate::wire::lanes::lane_of;
use crate::wire::page_frame::{
    DIGEST_LEN, PREFIX_LEN, build_head, descriptors, matches_digest, read_descriptors, read_packed,
};
use crate::zero::is_zero_page;
use packers::{FrameBufs, Packed, Packers, pack};

/// A send queue holding this much is busy: the link, not the sender, sets the pace.
const BUSY_QUEUE: u64 = 256 * 1024;
/// What a sender has put on the wire so far.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SendCounters {
    pub full: u64,
    pub zero: u64,
    pub bytes: u64,
    /// Frames by the codec their page data went with (none, lz4, zstd).
    pub frames_by_codec: [u64; 3],
    /// `auto`: samples of a frame's pages each codec was measured on (nothing sent).
    pub samples_by_codec: [u64; 3],
    /// Page data of compressed frames, before and after compression.
    pub packed_in: u64,
    pub packed_out: u64,
    /// Pages sent as deltas of their last copy, and the bytes that saved.
    pub delta_pages: u64,
    pub delta_saved: u64,
}

impl std::ops::Add for SendCounters {
    type Output = Self;
    fn add(self, o: Self) -> Self {
        let sum = |a: [u64; 3], b: [u64; 3]| std::array::from_fn(|i| a[i] + b[i]);
        Self {
            full: self.full + o.full,
            zero: self.zero + o.zero,
            bytes: self.bytes + o.bytes,
            frames_by_codec: sum(self.frames_by_codec, o.frames_by_codec),
            samples_by_codec: sum(self.samples_by_codec, o.samples_by_codec),
            packed_in: self.packed_in + o.packed_in,
            packed_out: self.packed_out + o.packed_out,
            delta_pages: self.delta_pages + o.delta_pages,
            delta_saved: self.delta_saved + o.delta_saved,
        }
    }
}

/// Collects pages into frames and sends each frame with one vectored write.
pub struct PageSender {
    pfns: Vec<(u64, PageEncoding)>,
    head: Vec<u8>,
    batch: usize,
    /// Whether page data is covered by the frame checksum (only when the guest is paused).
    pub checked: bool,
    pub counters: SendCounters,
    compression: Compression,
    chooser: Chooser,
    contexts: Contexts,
    /// A compressed frame's pages, copied out of guest memory, and what they compressed to.
    /// Buffers of frames already written, for the next ones.
    spare: Vec<FrameBufs>,
    /// Threads that compress frames while this one gathers and writes (`None`: this thread
    /// compresses).
    packers: Option<Packers>,
    /// The copies sent last, for delta encoding (`None`: off).
    delta: Option<DeltaCache>,
    scratch: Vec<u8>,
    /// `auto`'s sample of a frame's pages, and what a codec made of it.
    sample: (Vec<u8>, Vec<u8>),
    /// For `auto`: a handle on the connection, to see how fast its send queue drains, and
    /// the last look (when, bytes drained so far, bytes still queued).
    queue: Option<Stream>,
    last_look: Option<(Instant, u64, u64)>,
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
            compression: Compression::None,
            chooser: Chooser::default(),
            contexts: Contexts::default(),
            spare: Vec::new(),
            packers: None,
            delta: None,
            scratch: Vec::new(),
            sample: Default::default(),
            queue: None,
            last_look: None,
        }
    }

    /// Lets `auto` (set before) time the link by how fast `stream`'s send queue drains.
    pub fn with_queue_probe(mut self, stream: Option<Stream>) -> Self {
        if self.compression == Compression::Auto {
            self.queue = stream;
        }
        self
    }

    /// Feeds `auto` the link's drain rate over the interval since the last look, when the
    /// send queue stayed busy through it (otherwise the link may have idled: no sample).
    fn look_at_queue(&mut self) {
        let Some(q) = &self.queue else { return };
        let queued = q.unsent() as u64;
        let now = Instant::now();
        let drained = self.counters.bytes.saturating_sub(queued);
        if let Some((then, drained_then, queued_then)) = self.last_look
            && queued_then >= BUSY_QUEUE
            && queued >= BUSY_QUEUE
        {
            let secs = now.duration_since(then).as_secs_f64();
            if secs > 0.0 && drained > drained_then {
                self.chooser
                    .learn_link((drained - drained_then) as f64 / secs);
            }
        }
        self.last_look = Some((now, drained, queued));
    }

    /// Sends re-sent pages as deltas of their last copy, keeping the last `pages` copies
    /// (0: off).
    pub fn with_delta_cache(mut self, pages: usize) -> Self {
        self.delta = (pages > 0).then(|| DeltaCache::new(pages));
        self
    }

    /// Forgets every copy: from here on the destination may no longer hold them (post-copy
    /// drops the stale ones, and installs pages whole).
    pub fn forget_deltas(&mut self) {
        self.delta = None;
    }

    /// Compresses page data as `compression` says (frames of full pages only).
    pub fn with_compression(mut self, compression: Compression) -> Self {
        self.compression = compression;
        self
    }

    /// Lets `auto` learn the codecs with the migration's other connections (`measures`: those
    /// of the first connection's sender, `codec_measures`).
    pub fn with_codec_measures(mut self, measures: &CodecMeasures) -> Self {
        self.chooser = std::mem::take(&mut self.chooser).sharing(measures);
        self
    }

    /// What `auto` has measured of the codecs, for senders of the same migration to share.
    pub fn codec_measures(&self) -> &CodecMeasures {
        self.chooser.measures()
    }

    /// Compresses on `threads` threads of their own (when there is compression and more than
    /// one), while this one gathers pages and writes frames; they count their CPU in `cpu`.
    pub fn with_packers(mut self, threads: usize, cpu: &CpuMeter) -> Self {
        if threads > 1 && self.compression != Compression::None {
            self.packers = Some(Packers::new(threads, build_head, cpu));
        }
        self
    }

    /// Lets `auto` weigh each codec's speed per core by the `cores` that compress this
    /// sender's frames (see `MigrationParams::compress_cores_of`).
    pub fn with_compress_cores(mut self, cores: f64) -> Self {
        self.chooser = std::mem::take(&mut self.chooser).on_cores(cores);
        self
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
            self.send_batch(w, ram, limiter, false)?;
        }
        Ok(())
    }

    /// Sends what is queued and waits for every frame still being compressed: after this,
    /// every page pushed is on the wire, in the order pushed.
    pub fn flush(
        &mut self,
        w: &mut impl Write,
        ram: &GuestRam,
        limiter: &mut RateLimiter,
    ) -> Result<()> {
        self.send_batch(w, ram, limiter, true)?;
        self.drain(w, limiter)
    }

    /// Sends the queued pages as one frame, or hands them to a packer (then the frame leaves
    /// later, but before any frame gathered after it); `last`: no frame follows before a flush.
    fn send_batch(
        &mut self,
        w: &mut impl Write,
        ram: &GuestRam,
        limiter: &mut RateLimiter,
        last: bool,
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
        let codec = match self.compression {
            Compression::None => Codec::None,
            Compression::Fixed(c) => c,
            // A lone frame (a post-copy reply) is not held up by a sample.
            Compression::Auto => {
                let pick = self.chooser.pick(full > 0 && !last);
                if let Some(tried) = pick.sample {
                    self.measure_on_sample(ram, tried)?;
                }
                pick.send
            }
        };
        if let Some(cache) = self.delta.as_mut() {
            // The destination zeroes these: no copy of them is there any more.
            for &(pfn, _) in self.pfns.iter().filter(|(_, e)| *e == PageEncoding::Zero) {
                cache.forget(pfn);
            }
        }
        let buffered = codec != Codec::None || self.delta.is_some();
        if !(buffered && full > 0) {
            // Frames gathered before this one leave first.
            self.drain(w, limiter)?;
            let (frame_bytes, cost) = self.send_in_place(w, ram, limiter, full)?;
            let zero = self.pfns.len() - full;
            self.account(full, zero, frame_bytes, cost, Codec::None);
            self.pfns.clear();
            return Ok(());
        }
        let gathering = Instant::now();
        let bufs = self.gather(ram)?;
        let Some(packers) = &self.packers else {
            let mut frame = pack(bufs, codec, &mut self.contexts, build_head)?;
            // Without packers, this thread's cost of a frame includes copying the pages out.
            frame.compress_time = gathering.elapsed();
            return self.write_packed(w, limiter, frame);
        };
        if last && packers.idle() {
            // A lone frame (a post-copy reply): a hand-off would only add a wait.
            let frame = pack(bufs, codec, &mut self.contexts, build_head)?;
            return self.write_packed(w, limiter, frame);
        }
        while self.packers.as_ref().is_some_and(Packers::full) {
            self.write_next(w, limiter)?;
        }
        self.packers
            .as_mut()
            .expect("checked above")
            .submit(bufs, codec)
    }

    /// Writes every frame the packers hold, oldest first.
    fn drain(&mut self, w: &mut impl Write, limiter: &mut RateLimiter) -> Result<()> {
        while self.write_next(w, limiter)? {}
        Ok(())
    }

    /// Writes the oldest frame the packers hold, once packed; false when they hold none.
    fn write_next(&mut self, w: &mut impl Write, limiter: &mut RateLimiter) -> Result<bool> {
        let Some(frame) = self.packers.as_mut().and_then(Packers::next) else {
            return Ok(false);
        };
        self.write_packed(w, limiter, frame?)?;
        Ok(true)
    }

    /// Counts a frame that went on the wire, and lets `auto` learn from it.
    /// `full` pages with data (whole or as deltas) and `zero` markers.
    fn account(
        &mut self,
        full: usize,
        zero: usize,
        frame_bytes: u64,
        cost: BatchCost,
        used: Codec,
    ) {
        self.counters.full += full as u64;
        self.counters.zero += zero as u64;
        self.counters.bytes += frame_bytes;
        self.counters.frames_by_codec[used as usize] += 1;
        if used != Codec::None {
            self.counters.packed_in += cost.raw_bytes as u64;
            self.counters.packed_out += cost.packed_bytes as u64;
        }
        if self.compression == Compression::Auto {
            self.chooser.learn(cost);
            self.look_at_queue();
        }
    }

    /// Packs one page in `SAMPLE_SHARE` of the queued pages with `codec` and tells `auto`
    /// how it did; the copy out of guest memory counts, as it does for a packed frame.
    fn measure_on_sample(&mut self, ram: &GuestRam, codec: Codec) -> Result<()> {
        self.contexts.prepare(codec)?;
        let started = Instant::now();
        let (mut raw, mut packed) = std::mem::take(&mut self.sample);
        raw.clear();
        packed.clear();
        for pfn in self.full_pages().step_by(SAMPLE_SHARE) {
            raw.extend_from_slice(ram.page(pfn)?);
        }
        codec.compress(&raw, &mut packed, &mut self.contexts)?;
        self.chooser
            .learn_sample(codec, raw.len(), packed.len(), started.elapsed());
        self.counters.samples_by_codec[codec as usize] += 1;
        self.sample = (raw, packed);
        Ok(())
    }

    fn full_pages(&self) -> impl Iterator<Item = u64> + '_ {
        self.pfns
            .iter()
            .filter(|(_, e)| *e == PageEncoding::Full)
            .map(|&(pfn, _)| pfn)
    }

    /// The frame's pages go to the socket straight from guest memory.
    fn send_in_place(
        &mut self,
        w: &mut impl Write,
        ram: &GuestRam,
        limiter: &mut RateLimiter,
        full: usize,
    ) -> Result<(u64, BatchCost)> {
        let flags = if self.checked { 0 } else { PAGE_DATA_UNCHECKED };
        let digests = if self.checked { 0 } else { DIGEST_LEN * full };
        let len = build_head(
            &mut self.head,
            &self.pfns,
            flags,
            digests + PAGE_SIZE * full,
        );
        if !self.checked {
            // Each page's CRC as read now: the guest may write it before it leaves, and then
            // it is dirty and goes again; a mismatch that no later copy mends is corruption.
            for pfn in self.pfns.iter().filter(|(_, e)| *e == PageEncoding::Full) {
                let digest = crc32fast::hash(ram.page(pfn.0)?);
                self.head.extend_from_slice(&digest.to_le_bytes());
            }
        }
        let mut crc = crc32fast::Hasher::new();
        crc.update(&self.head);
        let mut slices: Vec<IoSlice<'_>> = Vec::with_capacity(full + 2);
        slices.push(IoSlice::new(&self.head));
        let mut run: Option<(u64, u64)> = None;
        for pfn in self.full_pages() {
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
            },
        ))
    }

    /// Copies the queued pages out of guest memory once (a consistent copy, so the checksum
    /// always covers the data); a page the delta cache holds goes as its delta when that is
    /// short. The pages move into the returned buffers (the queue is left empty).
    fn gather(&mut self, ram: &GuestRam) -> Result<FrameBufs> {
        let mut bufs = self.spare.pop().unwrap_or_default();
        std::mem::swap(&mut bufs.pfns, &mut self.pfns);
        self.pfns.clear();
        let raw = &mut bufs.raw;
        raw.clear();
        for (pfn, enc) in bufs.pfns.iter_mut() {
            if *enc == PageEncoding::Zero {
                continue;
            }
            let at = raw.len();
            raw.extend_from_slice(ram.page(*pfn)?);
            let Some(cache) = self.delta.as_mut() else {
                continue;
            };
            let page = &raw[at..at + PAGE_SIZE];
            let mut delta = std::mem::take(&mut self.scratch);
            delta.clear();
            let encoded = cache
                .get(*pfn)
                .and_then(|old| delta::encode(old, page, &mut delta));
            cache.put(*pfn, page);
            if let Some(n) = encoded {
                raw.truncate(at);
                raw.extend_from_slice(&(n as u16).to_le_bytes());
                raw.extend_from_slice(&delta);
                *enc = PageEncoding::Delta;
                self.counters.delta_pages += 1;
                self.counters.delta_saved += (PAGE_SIZE - 2 - n) as u64;
            }
            self.scratch = delta;
        }
        Ok(bufs)
    }

    /// Writes a packed frame; its buffers are kept for a later frame.
    fn write_packed(
        &mut self,
        w: &mut impl Write,
        limiter: &mut RateLimiter,
        frame: Packed,
    ) -> Result<()> {
        let data = frame.data();
        let frame_bytes = (frame.bufs.head.len() + data.len() + 4) as u64;
        let mut slices = [
            IoSlice::new(&frame.bufs.head),
            IoSlice::new(data),
            IoSlice::new(&frame.trailer),
        ];
        let writing = Instant::now();
        limiter.take(frame_bytes);
        protocol::write_all_vectored(w, &mut slices)?;
        // What was tried is what is learned: a codec that did not shrink the data shows a
        // ratio of 1.
        let cost = BatchCost {
            codec: frame.tried,
            raw_bytes: frame.bufs.raw.len(),
            packed_bytes: data.len(),
            compress_time: frame.compress_time,
            write_time: writing.elapsed(),
        };
        let pfns = &frame.bufs.pfns;
        let zero = pfns
            .iter()
            .filter(|(_, e)| *e == PageEncoding::Zero)
            .count();
        self.account(pfns.len() - zero, zero, frame_bytes, cost, frame.used);
        self.spare.push(frame.bufs);
        Ok(())
    }
}

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
        }
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
        let placer = self.shared.placer.get().filter(|p| p.installing());
        let unchecked = header[1] & PAGE_DATA_UNCHECKED != 0;
        if shape.codec == Codec::None && shape.deltas == 0 && placer.is_none() {
            self.read_full_pages(r, ram)?;
            if header[1] & PAGE_DATA_UNCHECKED == 0 {
                for &(pfn, _) in &self.full {
                    crc.update(ram.page(pfn)?);
                }
            }
            protocol::check_trailer(r, crc.finalize(), "page frame")?;
            if header[1] & PAGE_DATA_UNCHECKED != 0 {
                for (&(pfn, _), sent) in self.full.iter().zip(self.digests.chunks_exact(DIGEST_LEN))
                {
                    if matches_digest(ram.page(pfn)?, sent) {
                        self.suspect.unset(pfn);
                    } else {
                        self.suspect.set(pfn);
                    }
                }
            }
        } else {
            // Checked before it is unpacked or placed: a decompressor never sees a corrupt
            // frame. An unchecked frame's data is checked page by page, against its digests.
            read_packed(r, &shape, &mut self.packed, crc, !unchecked)?;
            if unchecked {
                for (&(pfn, _), (page, sent)) in self.full.iter().zip(
                    self.packed
                        .chunks_exact(PAGE_SIZE)
                        .zip(self.digests.chunks_exact(DIGEST_LEN)),
                ) {
                    if matches_digest(page, sent) {
                        self.suspect.unset(pfn);
                    } else {
                        self.suspect.set(pfn);
                    }
                }
            }
            let data: &[u8] = if shape.codec == Codec::None {
                &self.packed
            } else {
                let bounds = shape.unpacked_len();
                self.unpacked.resize(*bounds.end(), 0);
                let n =
                    shape
                        .codec
                        .decompress(&self.packed, &mut self.unpacked, *bounds.start())?;
                &self.unpacked[..n]
            };
            place_pages(ram, &self.full, &self.written, data, placer.map(|p| &**p))?;
        }
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
        ram.discard_pages(&self.discard)?;
        for &(pfn, _) in &self.full {
            self.written.set(pfn);
            if !unchecked {
                self.suspect.unset(pfn);
            }
        }
        self.pages += u64::from(shape.count);
        Ok(())
    }

    fn read_full_pages(&mut self, r: &mut impl Read, ram: &GuestRam) -> Result<()> {
        let mut slices: Vec<IoSliceMut<'_>> = Vec::with_capacity(self.full.len());
        let mut i = 0;
        while i < self.full.len() {
            let start = self.full[i].0;
            let room = ram.pages_to_region_end(start);
            let mut n = 1;
            while i + n < self.full.len()
                && self.full[i + n].0 == start + n as u64
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::RamRange;
    use crate::wire::Frame;
    use crate::wire::frame::read_frame;
    use crate::wire::page_frame::{FrameBuffers, read_page_frame};

    const PAGES: u64 = 64;

    fn ram(buf: &mut [u8]) -> GuestRam {
        let r = RamRange {
            gpa: 0,
            len: buf.len() as u64,
        };
        // SAFETY: `buf` outlives every use of the returned view in these tests.
        unsafe { GuestRam::new(&[(r, buf.as_mut_ptr())]) }.unwrap()
    }

    /// Page `pfn` as text (compresses) or as pseudo-random bytes (does not).
    fn fill(ram: &GuestRam, pfn: u64, random: bool) {
        let mut page = vec![0u8; PAGE_SIZE];
        let mut x = pfn.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        for (i, b) in page.iter_mut().enumerate() {
            *b = if random {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            } else {
                b"the guest wrote page "[i % 21]
            };
        }
        ram.write_page(pfn, &page).unwrap();
    }

    /// Sends pages 0..PAGES (every 5th left zero) with `compression`; returns the stream.
    fn send(src: &GuestRam, compression: Compression, checked: bool) -> (Vec<u8>, SendCounters) {
        let mut sender = PageSender::new(16).with_compression(compression);
        sender.checked = checked;
        let mut limiter = RateLimiter::new(None);
        let mut wire = Vec::new();
        for pfn in 0..PAGES {
            sender.push(&mut wire, src, pfn, &mut limiter).unwrap();
        }
        sender.flush(&mut wire, src, &mut limiter).unwrap();
        (wire, sender.counters)
    }

    fn receive_all(wire: &[u8], dst: &GuestRam) -> Result<u64> {
        let mut receiver = PageReceiver::new(dst);
        feed(&mut receiver, wire, dst)?;
        Ok(receiver.pages)
    }

    /// Every page frame of `wire` through `receiver`.
    fn feed(receiver: &mut PageReceiver, mut wire: &[u8], dst: &GuestRam) -> Result<()> {
        while !wire.is_empty() {
            let Frame::Pages { header, len } = read_frame(&mut wire)? else {
                panic!("only page frames here")
            };
            receiver.receive(&mut wire, dst, &header, len)?;
        }
        Ok(())
    }

    /// A page frame of `pfns` with `flags` around `data`, with the right trailer.
    fn framed(pfns: &[(u64, PageEncoding)], flags: u8, data: &[u8]) -> Vec<u8> {
        let mut wire = Vec::new();
        build_head(&mut wire, pfns, flags, data.len());
        wire.extend_from_slice(data);
        let crc = crc32fast::hash(&wire);
        wire.extend_from_slice(&crc.to_le_bytes());
        wire
    }

    fn source(random: impl Fn(u64) -> bool) -> (Vec<u8>, GuestRam) {
        let mut buf = vec![0u8; (PAGES * PAGE_SIZE as u64) as usize];
        let ram = ram(&mut buf);
        for pfn in (0..PAGES).filter(|p| p % 5 != 0) {
            fill(&ram, pfn, random(pfn));
        }
        (buf, ram)
    }

    #[test]
    fn compressed_frames_arrive_exactly_and_incompressible_ones_go_plain() {
        // Pages 0..32 text, 32..64 random: with batches of 16, two frames of each.
        let (src_buf, src) = source(|pfn| pfn >= 32);
        for compression in [
            Compression::None,
            Compression::Fixed(Codec::Lz4),
            Compression::Fixed(Codec::Zstd),
            Compression::Auto,
        ] {
            for checked in [false, true] {
                let (wire, c) = send(&src, compression, checked);
                let mut dst_buf = vec![0u8; src_buf.len()];
                let dst = ram(&mut dst_buf);
                assert_eq!(receive_all(&wire, &dst).unwrap(), PAGES);
                assert!(dst_buf == src_buf, "{compression:?}: pages equal");
                assert_eq!(c.frames_by_codec.iter().sum::<u64>(), 4);
                if let Compression::Fixed(codec) = compression {
                    assert_eq!(c.frames_by_codec[codec as usize], 2, "{c:?}");
                    assert_eq!(c.frames_by_codec[0], 2, "random pages went plain: {c:?}");
                    assert!(c.packed_out * 4 < c.packed_in, "{c:?}");
                }
            }
        }
    }

    /// Pages that do not shrink over a link faster than any codec: after one whole frame
    /// each, `auto` tries the codecs on samples, and every frame goes plain.
    #[test]
    fn auto_tries_codecs_on_samples_while_plain_wins() {
        let (src_buf, src) = source(|_| true);
        let mut sender = PageSender::new(1).with_compression(Compression::Auto);
        let mut limiter = RateLimiter::new(None);
        let mut wire = Vec::new();
        for pfn in 0..PAGES {
            sender.push(&mut wire, &src, pfn, &mut limiter).unwrap();
        }
        sender.flush(&mut wire, &src, &mut limiter).unwrap();
        let mut dst_buf = vec![0u8; src_buf.len()];
        let dst = ram(&mut dst_buf);
        assert_eq!(receive_all(&wire, &dst).unwrap(), PAGES);
        assert!(dst_buf == src_buf);
        let c = sender.counters;
        assert_eq!(c.frames_by_codec[0], PAGES, "{c:?}");
        assert!(
            c.samples_by_codec[1] > 0 && c.samples_by_codec[2] > 0,
            "{c:?}"
        );
        assert_eq!(c.samples_by_codec[0], 0, "plain needs no sample");
    }

    /// Two passes over every page with the guest writing in between, pushed without a flush
    /// between them, so that the first pass's frames are still being packed when the second's
    /// are gathered; returns the stream.
    fn two_passes(sender: &mut PageSender, src_buf: &mut [u8], src: &GuestRam) -> Vec<u8> {
        let mut limiter = RateLimiter::new(None);
        let mut wire = Vec::new();
        for pass in 0..2 {
            if pass == 1 {
                for pfn in (0..PAGES).filter(|p| p % 3 == 1) {
                    let at = (pfn * PAGE_SIZE as u64) as usize + 16;
                    src_buf[at..at + 8].copy_from_slice(&7u64.to_le_bytes());
                }
            }
            for pfn in 0..PAGES {
                sender.push(&mut wire, src, pfn, &mut limiter).unwrap();
            }
        }
        sender.flush(&mut wire, src, &mut limiter).unwrap();
        wire
    }

    #[test]
    fn packer_threads_send_the_same_frames_in_the_same_order() {
        for compression in [
            Compression::Fixed(Codec::Lz4),
            Compression::Fixed(Codec::Zstd),
            Compression::Auto,
        ] {
            for delta in [0, PAGES as usize] {
                let mut results = Vec::new();
                for threads in [1, 3] {
                    let (mut src_buf, src) = source(|pfn| pfn >= 32);
                    let mut sender = PageSender::new(4)
                        .with_compression(compression)
                        .with_delta_cache(delta)
                        .with_packers(threads, &CpuMeter::default());
                    assert_eq!(sender.packers.is_some(), threads > 1);
                    let wire = two_passes(&mut sender, &mut src_buf, &src);
                    let mut dst_buf = vec![0u8; src_buf.len()];
                    let dst = ram(&mut dst_buf);
                    assert_eq!(receive_all(&wire, &dst).unwrap(), 2 * PAGES);
                    assert!(
                        dst_buf == src_buf,
                        "{compression:?}, {threads} threads: the last copy of each page won"
                    );
                    let c = sender.counters;
                    assert_eq!(c.full + c.zero, 2 * PAGES, "{c:?}");
                    assert_eq!(c.frames_by_codec.iter().sum::<u64>(), 2 * PAGES / 4);
                    results.push((wire, c));
                }
                if compression != Compression::Auto {
                    // Codecs are deterministic: side by side, the stream is byte for byte the
                    // one a single thread writes.
                    assert!(results[0] == results[1], "{compression:?}, delta {delta}");
                }
            }
        }
    }

    #[test]
    fn resent_pages_go_as_deltas_and_arrive_exactly() {
        let (mut src_buf, src) = source(|pfn| pfn >= 32);
        for compression in [Compression::None, Compression::Fixed(Codec::Lz4)] {
            let mut sender = PageSender::new(16)
                .with_compression(compression)
                .with_delta_cache(PAGES as usize);
            let mut limiter = RateLimiter::new(None);
            let mut dst_buf = vec![0u8; src_buf.len()];
            let dst = ram(&mut dst_buf);
            let mut receiver = PageReceiver::new(&dst);
            let mut round = |sender: &mut PageSender, src: &GuestRam| {
                let mut wire = Vec::new();
                for pfn in 0..PAGES {
                    sender.push(&mut wire, src, pfn, &mut limiter).unwrap();
                }
                sender.flush(&mut wire, src, &mut limiter).unwrap();
                feed(&mut receiver, &wire, &dst).unwrap();
            };
            round(&mut sender, &src);
            assert_eq!(
                sender.counters.delta_pages, 0,
                "nothing cached before round 0"
            );
            // The guest stamps a word in every page (and zeroes one), then it all goes again.
            for pfn in 0..PAGES {
                let at = (pfn * PAGE_SIZE as u64) as usize + 8 * (pfn as usize % 512);
                src_buf[at..at + 8].copy_from_slice(&(pfn + 1000).to_le_bytes());
            }
            let z = 7 * PAGE_SIZE;
            src_buf[z..z + PAGE_SIZE].fill(0);
            round(&mut sender, &src);
            assert!(
                dst_buf == src_buf,
                "{compression:?}: pages equal after the deltas"
            );
            let c = sender.counters;
            // Every page that held data both times, but the random ones whose whole page
            // changed little too: all of them, except the one zeroed.
            assert!(c.delta_pages >= 40, "{c:?}");
            assert!(c.delta_saved > 40 * 4000, "{c:?}");
        }
    }

    /// A frame read while the guest ran is not covered by the frame checksum (the guest may
    /// change a page on its way), but each page carries its CRC: a page whose data was
    /// corrupted is suspect until a later copy replaces it, and post-copy refuses it outright.
    #[test]
    fn a_corrupted_page_of_an_unchecked_frame_is_caught_by_its_own_crc() {
        let (src_buf, src) = source(|_| false);
        let (mut wire, _) = send(&src, Compression::None, false);
        // The last byte of the first frame's page data (pages 1..4 are full, 0 is zero).
        let len = u32::from_le_bytes(wire[4..8].try_into().unwrap()) as usize;
        wire[FRAME_HEADER_LEN + len - 1] ^= 0x40;
        let mut dst_buf = vec![0u8; src_buf.len()];
        let dst = ram(&mut dst_buf);
        let mut receiver = PageReceiver::new(&dst);
        feed(&mut receiver, &wire, &dst).unwrap();
        let suspect: Vec<u64> = receiver.suspect().iter().collect();
        assert_eq!(suspect.len(), 1, "{suspect:?}");
        assert!(dst.page(suspect[0]).unwrap() != src.page(suspect[0]).unwrap());

        // A later copy (the guest wrote the page; here: sent again) clears it.
        let mut sender = PageSender::new(16);
        let mut limiter = RateLimiter::new(None);
        let mut again = Vec::new();
        sender
            .push(&mut again, &src, suspect[0], &mut limiter)
            .unwrap();
        sender.flush(&mut again, &src, &mut limiter).unwrap();
        feed(&mut receiver, &again, &dst).unwrap();
        assert_eq!(receiver.suspect().count(), 0);
        assert!(dst_buf == src_buf);

        // Post-copy installs pages as final: it refuses the corrupt one.
        let mut r = wire.as_slice();
        let Frame::Pages { header, len } = read_frame(&mut r).unwrap() else {
            panic!("a page frame")
        };
        let mut scratch = FrameBuffers::default();
        let e = read_page_frame(&mut r, &src, &header, len, &mut scratch).unwrap_err();
        assert!(e.to_string().contains("arrived corrupt"), "{e}");
    }

    #[test]
    fn a_delta_for_a_page_never_sent_whole_is_refused() {
        let (src_buf, _src) = source(|_| false);
        let mut dst_buf = vec![0u8; src_buf.len()];
        let dst = ram(&mut dst_buf);
        let wire = framed(&[(3, PageEncoding::Delta)], 0, &[5, 0, 0, 0, 1, 0, 0xff]);
        let e = receive_all(&wire, &dst).unwrap_err();
        assert!(e.to_string().contains("never sent whole"), "{e}");
    }

    /// Pages faulted in ahead hold zeros, not a copy: a delta on one is refused, a zero page
    /// among them is given back (the destination holds no more than the source), and all
    /// count as present (post-copy must drop them before the guest reads one).
    #[test]
    fn pages_faulted_in_ahead_are_present_but_not_sent() {
        let (_src_buf, src) = source(|_| false);
        let shadow = crate::memory::ShadowRam::like(&src).unwrap();
        let dst = shadow.ram();
        let mut ahead = Bitmap::new(dst.gfn_end());
        for pfn in 0..PAGES {
            ahead.set(pfn);
            dst.zero_page(pfn).unwrap(); // faults it in, as the prefaulter does
        }
        let lane = |r: &PageReceiver| PageReceiver::new(dst).sharing_ahead_with(r);
        let mut receiver = PageReceiver::new(dst);
        receiver.present_ahead(ahead.clone()).unwrap();
        let e = receiver.present_ahead(ahead.clone()).unwrap_err();
        assert!(e.to_string().contains("twice"), "{e}");

        let delta = framed(&[(3, PageEncoding::Delta)], 0, &[5, 0, 0, 0, 1, 0, 0xff]);
        let e = feed(&mut lane(&receiver), &delta, dst).unwrap_err();
        assert!(e.to_string().contains("never sent whole"), "{e}");

        // Another lane of the migration receives: it learned which pages came ahead.
        let mut other = lane(&receiver);
        let (wire, _) = send(&src, Compression::None, true);
        feed(&mut other, &wire, dst).unwrap();
        // (Before the pages are read: a read maps the kernel's zero page in.)
        let populated = crate::scan::populated_pages(dst).unwrap();
        let data: Vec<u64> = (0..PAGES).filter(|p| p % 5 != 0).collect();
        assert_eq!(populated.iter().collect::<Vec<_>>(), data);
        for pfn in 0..PAGES {
            assert_eq!(dst.page(pfn).unwrap(), src.page(pfn).unwrap(), "page {pfn}");
        }
        assert_eq!(other.written().iter().collect::<Vec<_>>(), data);
        assert_eq!(other.present().count(), PAGES);
    }

    #[test]
    fn a_flipped_byte_in_compressed_data_is_refused_before_it_is_unpacked() {
        let (src_buf, src) = source(|_| false);
        let (mut wire, _) = send(&src, Compression::Fixed(Codec::Zstd), false);
        // The last byte of the first frame's compressed data (just before its trailer).
        let len = u32::from_le_bytes(wire[4..8].try_into().unwrap()) as usize;
        wire[FRAME_HEADER_LEN + len - 1] ^= 0x40;
        let mut dst_buf = vec![0u8; src_buf.len()];
        let e = receive_all(&wire, &ram(&mut dst_buf)).unwrap_err();
        assert!(e.to_string().contains("checksum"), "{e}");
    }

    #[test]
    fn hostile_compressed_frames_are_refused_with_a_reason() {
        let (src_buf, src) = source(|_| false);
        let mut dst_buf = vec![0u8; src_buf.len()];
        let dst = ram(&mut dst_buf);
        let frame = |flags: u8, data: &[u8]| {
            framed(
                &[(1, PageEncoding::Full), (2, PageEncoding::Full)],
                flags,
                data,
            )
        };
        let lz4 = Codec::Lz4.flag_bits();
        let cases: [(Vec<u8>, &str); 4] = [
            // Well-formed lz4 that unpacks to one page where the descriptors promise two.
            (
                frame(lz4, &lz4_flex::block::compress(&[7u8; PAGE_SIZE])),
                "promise",
            ),
            (frame(lz4, &[0xff; 100]), "lz4 page data"),
            (
                frame(lz4 | PAGE_DATA_UNCHECKED, &[1; 100]),
                "covered by the frame checksum",
            ),
            (frame(3 << 1, &[1; 100]), "unknown codec"),
        ];
        for (wire, why) in cases {
            let e = receive_all(&wire, &dst).unwrap_err();
            assert!(e.to_string().contains(why), "{why}: {e}");
        }
        // "Compressed" data as long as the pages themselves is refused too.
        let e = receive_all(&frame(lz4, &vec![1; 2 * PAGE_SIZE]), &dst).unwrap_err();
        assert!(e.to_string().contains("lz4 page frame of length"), "{e}");
        let _ = src;
    }

    /// One flush of `pfns` by `sender`: the frame it writes.
    fn one_frame(src: &GuestRam, sender: &mut PageSender, pfns: &[u64]) -> Vec<u8> {
        let mut limiter = RateLimiter::new(None);
        let mut wire = Vec::new();
        for &pfn in pfns {
            sender.push(&mut wire, src, pfn, &mut limiter).unwrap();
        }
        sender.flush(&mut wire, src, &mut limiter).unwrap();
        wire
    }

    /// The bytes `golden` names: hex, with `page:N` standing for the 4096 bytes of page N.
    fn expand(golden: &str, ram: &GuestRam) -> Vec<u8> {
        let hex = |t: &str| -> Vec<u8> {
            (0..t.len())
                .step_by(2)
                .map(|i| u8::from_str_radix(&t[i..i + 2], 16).unwrap())
                .collect()
        };
        golden
            .split_whitespace()
            .flat_map(|t| match t.strip_prefix("page:") {
                Some(n) => ram.page(n.parse().unwrap()).unwrap().to_vec(),
                None => hex(t),
            })
            .collect()
    }

    /// A page frame of each kind as the sender writes it, with its exact bytes, read back by
    /// both readers (post-copy's refuses deltas). If this fails, the wire changed: bump
    /// `frame::VERSION` and write the change in docs/protocol.md before updating it. (The
    /// lz4 and zstd data pin those libraries' output too: a new version of one may pack a
    /// page otherwise, and must still read these bytes.)
    #[test]
    fn every_page_frame_kind_has_fixed_bytes() {
        let mut src_buf = vec![0u8; 4 * PAGE_SIZE];
        let src = ram(&mut src_buf);
        for pfn in 1..4 {
            fill(&src, pfn, false);
        }
        let plain = |checked| {
            let mut s = PageSender::new(16);
            s.checked = checked;
            s
        };
        let packed = |codec| PageSender::new(16).with_compression(Compression::Fixed(codec));
        // Page 3 goes whole, then, with one word changed, as a delta of that copy.
        let mut deltas = PageSender::new(16).with_delta_cache(4);
        let first = one_frame(&src, &mut deltas, &[3]);
        let mut page = src.page(3).unwrap().to_vec();
        page[16..24].copy_from_slice(&7u64.to_le_bytes());
        src.write_page(3, &page).unwrap();
        let cases: [(&str, &[u64], &mut PageSender, &str); 6] = [
            (
                "zero",
                &[0],
                &mut plain(false),
                "02010000 10000000 01000000 00000000 0100000000000000 d1d68d63",
            ),
            (
                "full, unchecked, beside a zero page",
                &[0, 1],
                &mut plain(false),
                "02010000 1c100000 02000000 00000000 0100000000000000 0001000000000000 \
                 14fcac0e page:1 d34d2c14",
            ),
            (
                "full, checksummed",
                &[1],
                &mut plain(true),
                "02000000 10100000 01000000 00000000 0001000000000000 page:1 98489ac8",
            ),
            (
                "lz4",
                &[1, 2],
                &mut packed(Codec::Lz4),
                "02020000 5e000000 02000000 00000000 0001000000000000 0002000000000000 \
                 ff067468652067756573742077726f74652070616765201500ffffffffffffffffffffff\
                 ffffffffe70feb0fffffffffffffffffffffffffffffffe70bea1f60706167652074 cc532f08",
            ),
            (
                "zstd",
                &[1, 2],
                &mut packed(Codec::Zstd),
                "02040000 45000000 02000000 00000000 0001000000000000 0002000000000000 \
                 28b52ffd60001f1d0100a87468652067756573742077726f74652070616765200300e003\
                 f4bb1ffa20fad19f4c d769c222",
            ),
            (
                "delta",
                &[3],
                &mut deltas,
                "02000000 1e000000 01000000 00000000 0203000000000000 0c00 1000 0800 \
                 7761676520746865 538114a9",
            ),
        ];
        for (kind, pfns, sender, golden) in cases {
            let frame = one_frame(&src, sender, pfns);
            assert!(
                frame == expand(golden, &src),
                "{kind}: the bytes of the frame"
            );
            let mut dst_buf = vec![0u8; src_buf.len()];
            let dst = ram(&mut dst_buf);
            let mut receiver = PageReceiver::new(&dst);
            if kind == "delta" {
                feed(&mut receiver, &first, &dst).unwrap();
            }
            feed(&mut receiver, &frame, &dst).unwrap();
            assert_eq!(receiver.suspect().count(), 0, "{kind}");
            for &pfn in pfns {
                assert_eq!(dst.page(pfn).unwrap(), src.page(pfn).unwrap(), "{kind}");
            }
            let mut r = frame.as_slice();
            let Frame::Pages { header, len } = read_frame(&mut r).unwrap() else {
                panic!("{kind}: a page frame")
            };
            let mut scratch = FrameBuffers::default();
            match read_page_frame(&mut r, &src, &header, len, &mut scratch) {
                Ok(pages) => {
                    for (pfn, data) in pages {
                        let want = src.page(pfn).unwrap();
                        assert!(data.map_or(is_zero_page(want), |d| d == want), "{kind}");
                    }
                }
                Err(e) => assert!(kind == "delta", "{kind}: {e}"),
            }
        }
    }
}
