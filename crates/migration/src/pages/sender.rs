//! The page sender: it batches pages into frames and writes each with one vectored write.
//! A plain frame goes straight from guest memory (`in_place`); a compressed or delta frame is
//! copied out first (`gather`), packed on this thread or on packer threads (`packers`), and
//! leaves in the order it was gathered. `auto` picks each frame's codec (`Chooser`) from what
//! the frames, samples and the link's delivery show (`auto`).

use std::io::{IoSlice, Write};
use std::time::{Duration, Instant};

use super::auto::{LinkProbe, Sample};
use super::deltas::DeltaCache;
use super::in_place::{full_pages, write_in_place};
use super::packers::{FrameBufs, Packed, Packers, pack};
use super::policy::{BatchCost, Chooser, CodecMeasures};
use crate::PAGE_SIZE;
use crate::cpu::CpuMeter;
use crate::error::Result;
use crate::io::transport::Stream;
use crate::memory::GuestRam;
use crate::params::Compression;
use crate::ratelimit::RateLimiter;
use crate::wire::codec::{Codec, Contexts};
use crate::wire::frame::{self as protocol, FRAME_HEADER_LEN, PageEncoding};
use crate::wire::page_frame::PREFIX_LEN;
use crate::zero::is_zero_page;

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
    /// Buffers of frames already written, for the next ones.
    spare: Vec<FrameBufs>,
    /// Threads that compress frames while this one gathers and writes (`None`: this thread
    /// compresses).
    packers: Option<Packers>,
    /// The copies sent last, for delta encoding (`None`: off).
    delta: Option<DeltaCache>,
    /// `auto`'s sample of a frame's pages.
    sample: Sample,
    /// For `auto`: how fast the connection delivers.
    link: Option<LinkProbe>,
    /// When the last frame of this run of frames was written, and with which codec (`None`
    /// after a flush).
    last_written: Option<(Instant, Codec)>,
    /// Time spent measuring samples since that write: not the batch's own cost.
    sampling: Duration,
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
            sample: Sample::default(),
            link: None,
            last_written: None,
            sampling: Duration::ZERO,
        }
    }

    /// Lets `auto` (set before) time the link by how fast `stream` delivers, where it crosses
    /// a network: a file's writes and a Unix socket's peer say nothing of a link.
    pub fn with_link_probe(mut self, stream: Option<Stream>) -> Self {
        let stream = stream.filter(Stream::crosses_a_network);
        if self.compression == Compression::Auto {
            self.link = stream.map(LinkProbe::new);
        }
        self
    }

    /// Tells `auto` the receiver runs on this host over a link no limit holds: it sends plain
    /// (`Chooser::for_a_peer_on_this_host`).
    pub fn to_a_peer_on_this_host(&mut self) {
        self.chooser = std::mem::take(&mut self.chooser).for_a_peer_on_this_host();
    }

    /// Whether `auto` was told the receiver runs on this host.
    pub fn goes_to_this_host(&self) -> bool {
        self.chooser.is_for_a_peer_on_this_host()
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
            self.packers = Some(Packers::new(threads, cpu));
        }
        self
    }

    /// Whether `auto` measures the link in windows of delivery.
    #[cfg(test)]
    pub(super) fn measures_the_link(&self) -> bool {
        self.link.is_some()
    }

    /// Whether frames are compressed on packer threads.
    #[cfg(test)]
    pub(super) fn has_packers(&self) -> bool {
        self.packers.is_some()
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
        self.drain(w, limiter)?;
        // What comes next waits for more than this sender's own work.
        self.last_written = None;
        if let Some(link) = self.link.as_mut() {
            link.restart();
        }
        Ok(())
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
        let full = full_pages(&self.pfns).count();
        let codec = self.choose_codec(ram, full > 0 && !last)?;
        if let Some(cache) = self.delta.as_mut() {
            // The destination zeroes these: no copy of them is there any more.
            for &(pfn, _) in self.pfns.iter().filter(|(_, e)| *e == PageEncoding::Zero) {
                cache.forget(pfn);
            }
        }
        // Where `auto` finds plain soonest on a fast link, copying the pages out for the
        // delta cache would cost more than the deltas save: they go in place, and the cache
        // forgets them (the destination no longer holds its copies).
        let auto_plain = codec == Codec::None
            && self.compression == Compression::Auto
            && self.chooser.plain_goes_in_place();
        let buffered = codec != Codec::None || (self.delta.is_some() && !auto_plain);
        if !(buffered && full > 0) {
            if let Some(cache) = self.delta.as_mut() {
                for pfn in full_pages(&self.pfns) {
                    cache.forget(pfn);
                }
            }
            // Frames gathered before this one leave first.
            self.drain(w, limiter)?;
            let (frame_bytes, cost) = write_in_place(
                w,
                ram,
                limiter,
                &mut self.head,
                &self.pfns,
                self.checked,
                full,
            )?;
            let zero = self.pfns.len() - full;
            self.account(full, zero, frame_bytes, cost, Codec::None);
            self.pfns.clear();
            return Ok(());
        }
        self.send_buffered(w, ram, limiter, codec, last)
    }

    /// The codec the queued pages go with; `auto` may first measure another on a sample of
    /// them (only where `may_sample`: a lone frame, a post-copy reply, is not held up by one).
    fn choose_codec(&mut self, ram: &GuestRam, may_sample: bool) -> Result<Codec> {
        Ok(match self.compression {
            Compression::None => Codec::None,
            Compression::Fixed(c) => c,
            Compression::Auto => {
                let pick = self.chooser.pick(may_sample);
                if let Some(tried) = pick.sample {
                    let started = Instant::now();
                    let pages = full_pages(&self.pfns);
                    let (contexts, chooser) = (&mut self.contexts, &mut self.chooser);
                    self.sample.measure(ram, pages, tried, contexts, chooser)?;
                    self.counters.samples_by_codec[tried as usize] += 1;
                    self.sampling += started.elapsed();
                }
                pick.send
            }
        })
    }

    /// Copies the queued pages out and packs them with `codec`: here (then the frame leaves at
    /// once), or on a packer thread (then it leaves later, in the order gathered).
    fn send_buffered(
        &mut self,
        w: &mut impl Write,
        ram: &GuestRam,
        limiter: &mut RateLimiter,
        codec: Codec,
        last: bool,
    ) -> Result<()> {
        let gathering = Instant::now();
        let bufs = self.gather(ram)?;
        let Some(packers) = &self.packers else {
            let mut frame = pack(bufs, codec, &mut self.contexts)?;
            // Without packers, this thread's cost of a frame includes copying the pages out.
            frame.compress_time = gathering.elapsed();
            return self.write_packed(w, limiter, frame);
        };
        if last && packers.idle() {
            // A lone frame (a post-copy reply): a hand-off would only add a wait.
            let frame = pack(bufs, codec, &mut self.contexts)?;
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
        mut cost: BatchCost,
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
            let now = Instant::now();
            let since = self.last_written.replace((now, used));
            let sampling = std::mem::take(&mut self.sampling);
            // With packer threads a frame's cycle is not what its codec cost. Nor is it after
            // a frame of another codec: its write waited for that frame's bytes to leave (a
            // codec tried after plain frames filled the queue was charged for their drain).
            if self.packers.is_none() {
                cost.cycle = since
                    .filter(|&(_, before)| before == used)
                    .map(|(t, _)| (now - t).saturating_sub(sampling));
            }
            self.chooser.learn(cost);
            if let Some(sample) = self.link.as_mut().and_then(|l| l.look(self.counters.bytes)) {
                self.chooser.learn_link(sample);
            }
        }
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
            if let Some(n) = cache.shrink(*pfn, raw, at) {
                *enc = PageEncoding::Delta;
                self.counters.delta_pages += 1;
                self.counters.delta_saved += (PAGE_SIZE - 2 - n) as u64;
            }
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
            cycle: None,
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
