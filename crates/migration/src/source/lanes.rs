//! Extra connections of one migration (`connections > 1`), each a "lane" with its own sender
//! thread per round. Pages are shared out by 2 MiB chunk (`wire::lanes::lane_of`), so a page
//! always travels on the same connection: the newest copy of a page is always the last one to
//! arrive, with no barrier between rounds. The main connection is lane 0 and also carries the
//! conversation; after the switch every lane ends with `LaneEnd`, before the VM state.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use super::lane::{Lane, RoundShare, join_lanes, page_sender};
use super::session::Session;
use crate::bitmap::Bitmap;
use crate::cpu::{Work, Worker};
use crate::error::Result;
use crate::pages::SendCounters;
use crate::status::CompressionCounts;
use crate::wire::codec::Codec;
use crate::wire::{self, Message};

impl Session<'_> {
    /// Opens the extra connections and names this migration on each.
    pub(super) fn open_lanes(&mut self, session: u64) -> Result<()> {
        let Some(dial) = &self.dial else {
            return Ok(());
        };
        let measures = self.pages.codec_measures().clone();
        // The lanes share the first connection's path.
        let rtt = self.stream.tcp_path().map(|(_, rtt)| rtt);
        for lane in 1..self.params.connections {
            let mut stream = dial(lane)?;
            if let Some(rtt) = rtt {
                stream.fit_send_buffer(rtt);
            }
            wire::write_stream_header(&mut stream)?;
            wire::write_message(&mut stream, &Message::Join { session, lane })?;
            self.cancel_closes(&stream);
            let same_host = self.pages.goes_to_this_host();
            let (pages, limiter) = page_sender(self.params, lane, &stream, same_host, &self.cpu);
            let pages = pages.with_codec_measures(&measures);
            self.lanes.push(Lane::new(stream, pages, limiter));
        }
        Ok(())
    }

    /// Runs a round's senders: `main` on this thread, each extra lane on its own. With
    /// `cuttable`, a switch to post-copy stops them all where they are: what they left unsent.
    pub(super) fn with_lanes(
        &mut self,
        set: &Bitmap,
        cuttable: bool,
        main: impl FnOnce(&mut Self, &RoundShare<'_>) -> Result<()>,
    ) -> Result<Option<Bitmap>> {
        let mut lanes = std::mem::take(&mut self.lanes);
        let (ram, cpu) = (self.ram.clone(), self.cpu.clone());
        let (stop, done) = (AtomicBool::new(false), AtomicU64::new(0));
        let lane_bytes = AtomicU64::new(lanes.iter().map(|l| l.pages.counters.bytes).sum());
        let left_from: Vec<AtomicU64> = (0..=lanes.len())
            .map(|_| AtomicU64::new(u64::MAX))
            .collect();
        // Not while paused (the last round): nothing writes, and protecting pages again
        // would cost inside the pause.
        let logged = (self.held.dirty_log.is_some() && !self.is_paused()).then_some(self.vm);
        let share = RoundShare {
            set,
            ram: &ram,
            logged,
            lanes: lanes.len() as u32 + 1,
            stop: &stop,
            cancel: &self.controls.cancel,
            done: &done,
            lane_bytes: &lane_bytes,
            cpu: &cpu,
            cut: cuttable.then_some(&self.controls.start_postcopy),
            left_from: &left_from,
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
            join_lanes(mine, threads, "sender")
        });
        self.lanes = lanes;
        result.map(|()| share.unsent())
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
        for lane in &mut self.lanes {
            lane.end()?;
        }
        Ok(())
    }

    /// Copies what all lanes have put on the wire into the status; returns it.
    pub(super) fn publish_counters(&mut self) -> SendCounters {
        let c = self.sent();
        let p = &mut self.status.progress;
        p.pages.full = c.full;
        p.pages.zero = c.zero;
        p.bytes_on_wire = c.bytes + self.message_bytes;
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
