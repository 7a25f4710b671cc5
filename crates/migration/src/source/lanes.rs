//! Extra connections of one migration (`connections > 1`), each a "lane" with its own sender
//! thread per round. Pages are shared out by 2 MiB chunk (`wire::lanes::lane_of`), so a page
//! always travels on the same connection: the newest copy of a page is always the last one to
//! arrive, with no barrier between rounds. The main connection is lane 0 and also carries the
//! conversation; after the switch every lane ends with `LaneEnd`, before the VM state.

use std::io::Write;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use super::session::{DEFAULT_BATCH_PAGES, Session};
use crate::bitmap::Bitmap;
use crate::cpu::{CpuMeter, Work, Worker};
use crate::error::{Error, Result};
use crate::io::transport::Stream;
use crate::memory::GuestRam;
use crate::pages::{PageSender, SendCounters};
use crate::params::MigrationParams;
use crate::ratelimit::RateLimiter;
use crate::status::CompressionCounts;
use crate::wire::codec::Codec;
use crate::wire::lanes::lane_of;
use crate::wire::{self, Message};

/// A lane checks for a stop (cancel, or another lane failed) this often.
const STOP_EVERY_PAGES: u64 = 1024;

pub(crate) struct Lane {
    stream: Stream,
    /// `LaneEnd` sent: nothing more travels here.
    ended: bool,
    pages: PageSender,
    limiter: RateLimiter,
}

/// What every sender of one round shares.
pub(super) struct RoundShare<'r> {
    pub set: &'r Bitmap,
    pub ram: &'r GuestRam,
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
}

impl Lane {
    /// Sends this lane's share of the round's pages.
    fn send_share(&mut self, lane: u32, share: &RoundShare<'_>) -> Result<()> {
        let result = self.send_pages(lane, share);
        if result.is_err() {
            share.stop.store(true, Ordering::Release);
        }
        result
    }

    fn send_pages(&mut self, lane: u32, share: &RoundShare<'_>) -> Result<()> {
        let mut sent = 0u64;
        let mut bytes = self.pages.counters.bytes;
        for gfn in share
            .set
            .iter()
            .filter(|&g| lane_of(g, share.lanes) == lane)
        {
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

impl Session<'_> {
    /// Opens the extra connections and names this migration on each.
    pub(super) fn open_lanes(&mut self, session: u64) -> Result<()> {
        let Some(dial) = &self.dial else {
            return Ok(());
        };
        let measures = self.pages.codec_measures().clone();
        for lane in 1..self.params.connections {
            let mut stream = dial(lane)?;
            wire::write_stream_header(&mut stream)?;
            wire::write_message(&mut stream, &Message::Join { session, lane })?;
            self.cancel_closes(&stream);
            let (pages, limiter) = page_sender(self.params, lane, &stream, &self.cpu);
            self.lanes.push(Lane {
                stream,
                ended: false,
                pages: pages.with_codec_measures(&measures),
                limiter,
            });
        }
        Ok(())
    }

    /// Runs one round's extra lanes on their own threads while `main` sends lane 0 here.
    pub(super) fn with_lanes(
        &mut self,
        set: &Bitmap,
        main: impl FnOnce(&mut Self, &RoundShare<'_>) -> Result<()>,
    ) -> Result<()> {
        let mut lanes = std::mem::take(&mut self.lanes);
        let (ram, cpu) = (self.ram.clone(), self.cpu.clone());
        let (stop, done) = (AtomicBool::new(false), AtomicU64::new(0));
        let lane_bytes = AtomicU64::new(lanes.iter().map(|l| l.pages.counters.bytes).sum());
        let share = RoundShare {
            set,
            ram: &ram,
            lanes: lanes.len() as u32 + 1,
            stop: &stop,
            cancel: &self.controls.cancel,
            done: &done,
            lane_bytes: &lane_bytes,
            cpu: &cpu,
        };
        let result = std::thread::scope(|scope| {
            let threads: Vec<_> = lanes
                .iter_mut()
                .enumerate()
                .map(|(i, lane)| {
                    let share = &share;
                    let id = i as u32 + 1;
                    scope.spawn(move || {
                        let _tracked = share.cpu.track(Work::Send, Worker::Lane(id));
                        lane.send_share(id, share)
                    })
                })
                .collect();
            let mine = main(self, &share);
            if mine.is_err() {
                stop.store(true, Ordering::Release);
            }
            // The first real failure names the round's outcome (not a lane that stopped
            // because of it).
            let mut first = mine.err();
            for t in threads {
                let r = t
                    .join()
                    .unwrap_or_else(|_| Err(Error::State("a sender thread panicked".into())));
                if let Err(e) = r
                    && first.as_ref().is_none_or(|f| matches!(f, Error::State(_)))
                {
                    first = Some(e);
                }
            }
            first.map_or(Ok(()), Err)
        });
        self.lanes = lanes;
        result
    }

    /// Page data from here on is read from a paused guest, so the frame checksum covers it.
    pub(super) fn check_page_data(&mut self) {
        self.pages.checked = true;
        for lane in &mut self.lanes {
            lane.pages.checked = true;
        }
    }

    /// Ends every extra lane (once): nothing more travels on them.
    pub(super) fn end_lanes(&mut self) -> Result<()> {
        for lane in self.lanes.iter_mut().filter(|l| !l.ended) {
            lane.ended = true;
            let c = lane.pages.counters;
            wire::write_message(
                &mut lane.stream,
                &Message::LaneEnd {
                    pages: c.full + c.zero,
                },
            )?;
            // A snapshot's writer gathers small writes: the lane's end must reach the file.
            lane.stream.flush()?;
        }
        Ok(())
    }

    /// Copies what all lanes have put on the wire into the status; returns it.
    pub(super) fn publish_counters(&mut self) -> SendCounters {
        let c = self.sent();
        let p = &mut self.status.progress;
        p.pages.full = c.full;
        p.pages.zero = c.zero;
        p.bytes_on_wire = c.bytes;
        p.compression = CompressionCounts {
            asked: self.params.compression.name().into(),
            frames_plain: c.frames_by_codec[Codec::None as usize],
            frames_lz4: c.frames_by_codec[Codec::Lz4 as usize],
            frames_zstd: c.frames_by_codec[Codec::Zstd as usize],
            samples_lz4: c.samples_by_codec[Codec::Lz4 as usize],
            samples_zstd: c.samples_by_codec[Codec::Zstd as usize],
            bytes_in: c.packed_in,
            bytes_out: c.packed_out,
            delta_pages: c.delta_pages,
            delta_bytes_saved: c.delta_saved,
        };
        c
    }

    /// Pages sent on each extra lane so far.
    pub(super) fn lane_pages(&self) -> Vec<u64> {
        self.lanes
            .iter()
            .map(|l| l.pages.counters.full + l.pages.counters.zero)
            .collect()
    }

    /// What all lanes have put on the wire.
    pub(super) fn sent(&self) -> SendCounters {
        self.lanes
            .iter()
            .fold(self.pages.counters, |acc, lane| acc + lane.pages.counters)
    }
}

/// Connection `lane`'s page sender and its rate limiter, as `params` ask (each connection
/// takes its share of the bandwidth limit, the delta cache and the compressing threads);
/// `auto` times the link by `stream`'s send queue, and its packers count their CPU in `cpu`.
pub(super) fn page_sender(
    params: &MigrationParams,
    lane: u32,
    stream: &Stream,
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
        .with_delta_cache(delta_cache_pages(params))
        .with_queue_probe(stream.try_clone().ok());
    (pages, limiter)
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
