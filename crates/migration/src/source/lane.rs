//! One connection's page sender, as the parameters ask (`page_sender`), and an extra
//! connection of a migration, a "lane", with its own: it sends its share of each round
//! (`RoundShare`) on a thread of its own and ends with `LaneEnd`. How a session runs its
//! lanes is `lanes`.

use std::io::Write;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::ScopedJoinHandle;

use crate::bitmap::Bitmap;
use crate::cpu::CpuMeter;
use crate::error::{Error, Result};
use crate::io::transport::Stream;
use crate::memory::GuestRam;
use crate::pages::PageSender;
use crate::params::MigrationParams;
use crate::ratelimit::RateLimiter;
use crate::vm::Migratable;
use crate::wire::lanes::{LANE_CHUNK_PAGES, lane_of};
use crate::wire::{self, Message};

/// Pages per frame, unless a bandwidth limit asks for fewer (`RateLimiter::batch_pages`).
pub(crate) const DEFAULT_BATCH_PAGES: usize = 256;
/// A lane checks for a stop (cancel, or another lane failed) this often.
const STOP_EVERY_PAGES: u64 = 1024;

/// An extra connection of a migration, with its own page sender.
pub(crate) struct Lane {
    stream: Stream,
    /// `LaneEnd` sent: nothing more travels here.
    ended: bool,
    pub(super) pages: PageSender,
    limiter: RateLimiter,
}

/// What every sender of one round shares.
pub(super) struct RoundShare<'r> {
    pub set: &'r Bitmap,
    pub ram: &'r GuestRam,
    /// The VM whose dirty log runs beside this round (the guest running), told of each chunk
    /// as its first page is sent (`entering`).
    pub logged: Option<&'r dyn Migratable>,
    pub lanes: u32,
    /// Set by the user's cancel or by a lane that failed: the others stop early.
    pub stop: &'r AtomicBool,
    pub cancel: &'r AtomicBool,
    /// Pages the extra lanes have sent this round (for the live status).
    pub done: &'r AtomicU64,
    /// Bytes the extra lanes have put on the wire, this round and before: while a round
    /// runs their senders are theirs, not the session's (for the live status).
    pub lane_bytes: &'r AtomicU64,
    /// Where each lane's sender counts its CPU time.
    pub cpu: &'r CpuMeter,
    /// Set when the user switches to post-copy: every sender stops where it is, and the
    /// pages it had not sent follow the switch (`None`: this round is not cut short).
    pub cut: Option<&'r AtomicBool>,
    /// Where each lane (by its number) stopped when cut: the first page of its share it left
    /// unsent (`u64::MAX`: it sent its whole share).
    pub left_from: &'r [AtomicU64],
}

impl RoundShare<'_> {
    /// Called with each page before it is sent, in order: on the first page of a chunk
    /// (`LANE_CHUNK_PAGES`, so one sender's alone), the writes to the chunk's pages of this
    /// round so far are forgotten by the log, as the send reads them after this. Without it
    /// a page the guest wrote after the log began but before round 0 reached it went twice.
    pub(super) fn entering(&self, gfn: u64, chunk: &mut Option<u64>) -> Result<()> {
        let (Some(vm), this) = (self.logged, gfn / LANE_CHUNK_PAGES) else {
            return Ok(());
        };
        if *chunk == Some(this) {
            return Ok(());
        }
        *chunk = Some(this);
        let first = this * LANE_CHUNK_PAGES;
        let words: [u64; (LANE_CHUNK_PAGES / 64) as usize] =
            std::array::from_fn(|i| self.set.word((first / 64) as usize + i));
        vm.forget_dirty(first, &words)
    }

    /// Whether the round is being cut short for post-copy.
    pub(super) fn cut_now(&self) -> bool {
        self.cut.is_some_and(|c| c.load(Ordering::Acquire))
    }

    /// The pages of the round no sender sent (none unless the round was cut short).
    pub(super) fn unsent(&self) -> Option<Bitmap> {
        let from: Vec<u64> = self
            .left_from
            .iter()
            .map(|l| l.load(Ordering::Acquire))
            .collect();
        if from.iter().all(|&f| f == u64::MAX) {
            return None;
        }
        let mut unsent = Bitmap::new(self.set.pages());
        for gfn in self.set.iter() {
            if gfn >= from[lane_of(gfn, self.lanes) as usize] {
                unsent.set(gfn);
            }
        }
        Some(unsent)
    }
}

impl Lane {
    pub(super) fn new(stream: Stream, pages: PageSender, limiter: RateLimiter) -> Self {
        Self {
            stream,
            ended: false,
            pages,
            limiter,
        }
    }

    /// Ends this lane (once): nothing more travels on it.
    pub(super) fn end(&mut self) -> Result<()> {
        if self.ended {
            return Ok(());
        }
        self.ended = true;
        let c = self.pages.counters;
        wire::write_message(
            &mut self.stream,
            &Message::LaneEnd {
                pages: c.full + c.zero,
            },
        )?;
        // A snapshot's writer gathers small writes: the lane's end must reach the file.
        self.stream.flush()?;
        Ok(())
    }

    /// The lane's connection (for how much it has queued).
    pub(super) fn stream(&self) -> &Stream {
        &self.stream
    }

    /// Sends `gfns` whole (a batch of post-copy's pushes).
    pub(super) fn send_batch(&mut self, ram: &GuestRam, gfns: &[u64]) -> Result<()> {
        for &gfn in gfns {
            self.pages
                .push(&mut self.stream, ram, gfn, &mut self.limiter)?;
        }
        self.pages.flush(&mut self.stream, ram, &mut self.limiter)
    }

    /// Writes `msg` on this lane (post-copy's request for receipts).
    pub(super) fn write_message(&mut self, msg: &Message) -> Result<()> {
        wire::write_message(&mut self.stream, msg)
    }

    /// Whether a receipt has come on this lane that was not read yet.
    pub(super) fn has_receipt(&self) -> bool {
        self.stream.has_unread()
    }

    /// The destination's next receipt on this lane: how many pages it took off it so far.
    pub(super) fn read_receipt(&mut self) -> Result<u64> {
        match wire::read_message(&mut self.stream)? {
            Message::Taken { pages } => Ok(pages),
            other => Err(Error::Protocol(format!(
                "a lane carries only receipts of post-copy's pushes back, not {}",
                other.name()
            ))),
        }
    }

    /// Ends post-copy's pushes on this lane, `pages` of them since the switch (the lane
    /// ended its rounds with `end` before the switch).
    pub(super) fn end_pushes(&mut self, pages: u64) -> Result<()> {
        wire::write_message(&mut self.stream, &Message::LaneEnd { pages })
    }

    /// Sends this lane's share of the round's pages.
    pub(super) fn send_share(&mut self, lane: u32, share: &RoundShare<'_>) -> Result<()> {
        let result = self.send_pages(lane, share);
        if result.is_err() {
            share.stop.store(true, Ordering::Release);
        }
        result
    }

    fn send_pages(&mut self, lane: u32, share: &RoundShare<'_>) -> Result<()> {
        let mut sent = 0u64;
        let mut bytes = self.pages.counters.bytes;
        let mut chunk = None;
        for gfn in share
            .set
            .iter()
            .filter(|&g| lane_of(g, share.lanes) == lane)
        {
            if sent.is_multiple_of(STOP_EVERY_PAGES) && share.cut_now() {
                share.left_from[lane as usize].store(gfn, Ordering::Release);
                break;
            }
            share.entering(gfn, &mut chunk)?;
            self.pages
                .push(&mut self.stream, share.ram, gfn, &mut self.limiter)?;
            sent += 1;
            if sent.is_multiple_of(STOP_EVERY_PAGES) {
                share.done.fetch_add(STOP_EVERY_PAGES, Ordering::Relaxed);
                let now = self.pages.counters.bytes;
                share.lane_bytes.fetch_add(now - bytes, Ordering::Relaxed);
                bytes = now;
                if share.cancel.load(Ordering::Acquire) {
                    return Err(Error::Cancelled);
                }
                if share.stop.load(Ordering::Acquire) {
                    return Err(Error::State(
                        "another connection of this migration failed".into(),
                    ));
                }
            }
        }
        share
            .done
            .fetch_add(sent % STOP_EVERY_PAGES, Ordering::Relaxed);
        self.pages
            .flush(&mut self.stream, share.ram, &mut self.limiter)
    }
}

/// Connection `lane`'s page sender and its rate limiter, as `params` ask (each connection
/// takes its share of the bandwidth limit, the delta cache and the compressing threads);
/// `auto` times the link by how fast `stream` delivers (and sends plain to a receiver on this
/// host, `same_host`, where no limit holds the link), and its packers count their CPU in `cpu`.
pub(super) fn page_sender(
    params: &MigrationParams,
    lane: u32,
    stream: &Stream,
    same_host: bool,
    cpu: &CpuMeter,
) -> (PageSender, RateLimiter) {
    let limiter = RateLimiter::new(
        params
            .max_bandwidth_mbps
            .map(|b| (b / u64::from(params.connections.max(1))).max(1)),
    );
    let host_cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let pages = PageSender::new(limiter.batch_pages(DEFAULT_BATCH_PAGES))
        .with_compression(params.compression)
        .with_packers(params.packers_of(lane), cpu)
        .with_compress_cores(params.compress_cores_of(lane, host_cores))
        .with_delta_cache(delta_cache_pages(params));
    let mut pages = pages.with_link_probe(stream.try_clone().ok());
    if same_host {
        to_this_host(params, &mut pages);
    }
    (pages, limiter)
}

/// Tells `pages` its receiver runs on this host, unless a bandwidth limit holds the link: a
/// limited link is priced like any other.
pub(super) fn to_this_host(params: &MigrationParams, pages: &mut PageSender) {
    if params.max_bandwidth_mbps.is_none() {
        pages.to_a_peer_on_this_host();
    }
}

/// Each connection's share of the delta cache, in pages.
fn delta_cache_pages(params: &MigrationParams) -> usize {
    let pages = params.delta_cache_mb * (1 << 20) / crate::PAGE_SIZE as u64;
    (pages / u64::from(params.connections.max(1))) as usize
}

/// A random name for a migration's extra connections to give (unguessable without TLS, so a
/// stranger cannot attach a connection of their own).
pub(super) fn session_id() -> Result<u64> {
    let mut b = [0u8; 8];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut b))
        .map_err(|e| Error::vm_caused("cannot read /dev/urandom", e))?;
    Ok(u64::from_le_bytes(b) | 1)
}

/// Joins the lanes' threads once this thread's own part (`mine`) ended. The first real
/// failure is the outcome, not that of a lane that stopped because of it (`Error::State`).
pub(super) fn join_lanes(
    mine: Result<()>,
    threads: Vec<ScopedJoinHandle<'_, Result<()>>>,
    what: &str,
) -> Result<()> {
    let mut first = mine.err();
    for t in threads {
        let r = t
            .join()
            .unwrap_or_else(|_| Err(Error::State(format!("a {what} thread panicked"))));
        if let Err(e) = r
            && first.as_ref().is_none_or(|f| matches!(f, Error::State(_)))
        {
            first = Some(e);
        }
    }
    first.map_or(Ok(()), Err)
}
