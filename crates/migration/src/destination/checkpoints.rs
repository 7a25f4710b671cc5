//! Post-copy checkpoints, the destination's half (the source's is `source::checkpoints`).
//! While post-copy runs, the VM's newest state lives here only: should this host die, the
//! source holds nothing newer than the switch. So every interval the pages the guest dirtied
//! are copied aside while it runs, then it is paused for a moment: the pages it wrote during
//! that copy are copied again with the vCPU and device state of that instant, and it runs on
//! while the checkpoint goes back to the source, which applies it whole or not at all.
//!
//! A checkpoint carries every page dirtied since the last one the source confirmed
//! (`CheckpointTaken`), not just since the last one sent: one lost with a broken connection is
//! then covered by the next, and the source's memory never misses a page.

use crate::sync::Locked;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::bitmap::Bitmap;
use crate::board::StatusBoard;
use crate::error::Result;
use crate::io::transport::Stream;
use crate::memory::ShadowRam;
use crate::pages::PageSender;
use crate::ratelimit::RateLimiter;
use crate::vm::Migratable;
use crate::wire::{self, Message};

/// Pages per frame: the connection is shared with page requests, which wait at most one
/// frame behind a checkpoint.
const FRAME_PAGES: usize = 64;

/// Where checkpoints go: post-copy's one writer to the source (`None` while disconnected).
pub(super) type Writer = Arc<Mutex<Option<Stream>>>;

/// Takes checkpoints on its own thread until stopped.
pub(super) struct Checkpointer {
    vm: Arc<dyn Migratable>,
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

struct Shared {
    stop: Mutex<bool>,
    wake: Condvar,
    /// The newest checkpoint the source applied.
    confirmed: AtomicU64,
}

/// What one checkpoint holds, copied while the guest was paused.
struct Taken {
    seq: u64,
    pages: Bitmap,
    vcpus: Vec<Vec<u8>>,
    devices: Vec<u8>,
}

impl Checkpointer {
    /// Starts taking a checkpoint of `vm` every `every`. Dirty logging must already run
    /// (since before the guest resumed here): the first checkpoint holds every page written
    /// since the switch.
    /// `stalled` says whether the guest waits for pages that do not come (a link gone silent):
    /// a checkpoint is skipped then, as pausing would wait for those vCPUs too.
    pub fn start(
        vm: Arc<dyn Migratable>,
        writer: Writer,
        every: Duration,
        board: StatusBoard,
        stalled: Box<dyn Fn() -> bool + Send>,
    ) -> Result<Self> {
        let shared = Arc::new(Shared {
            stop: Mutex::new(false),
            wake: Condvar::new(),
            confirmed: AtomicU64::new(0),
        });
        let shadow = ShadowRam::like(&vm.ram())?;
        let mut taker = Taker {
            vm: vm.clone(),
            writer,
            board,
            shadow,
            unconfirmed: Vec::new(),
            seq: 0,
            switched_at: Instant::now(),
        };
        let s = shared.clone();
        let thread = std::thread::Builder::new()
            .name("postcopy-checkpoints".into())
            .spawn(move || {
                while s.wait(every) {
                    if stalled() {
                        continue;
                    }
                    if let Err(e) = taker.once(s.confirmed.load(Ordering::Acquire)) {
                        tracing::warn!(
                            "post-copy checkpoint not taken: {}",
                            crate::error::chain(&e)
                        );
                    }
                }
            })
            .map_err(|e| crate::Error::vm_caused("cannot start the checkpoint thread", e))?;
        Ok(Self {
            vm,
            shared,
            thread: Some(thread),
        })
    }

    /// The source applied checkpoint `seq`.
    pub fn confirmed(&self, seq: u64) {
        self.shared.confirmed.fetch_max(seq, Ordering::AcqRel);
    }

    /// Stops after the checkpoint in progress, if any, and ends dirty logging.
    pub fn stop(mut self) {
        *self.shared.stop.locked() = true;
        self.shared.wake.notify_all();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        let _ = self.vm.stop_dirty_log();
    }
}

impl Shared {
    /// Waits one interval; false once stopped.
    fn wait(&self, every: Duration) -> bool {
        let stop = self.stop.locked();
        let (stop, _) = self
            .wake
            .wait_timeout_while(stop, every, |s| !*s)
            .unwrap_or_else(|e| e.into_inner());
        !*stop
    }
}

struct Taker {
    vm: Arc<dyn Migratable>,
    writer: Writer,
    board: StatusBoard,
    shadow: ShadowRam,
    /// Each checkpoint sent and not yet confirmed, with the pages dirtied in its interval.
    unconfirmed: Vec<(u64, Bitmap)>,
    seq: u64,
    switched_at: Instant,
}

impl Taker {
    fn once(&mut self, confirmed: u64) -> Result<()> {
        self.unconfirmed.retain(|(seq, _)| *seq > confirmed);
        if self.writer.locked().is_none() {
            return Ok(()); // no way to the source now; the pages wait in the dirty log
        }
        let began = Instant::now();
        let taken = self.take()?;
        let pause = began.elapsed();
        let sent = self.send(&taken);
        self.shadow.release();
        let bytes = sent?;
        let at = self.switched_at.elapsed();
        self.board.checkpoints(|c| {
            if let Some(c) = c {
                c.count += 1;
                c.last_seq = taken.seq;
                c.last_at = at;
                c.pages += taken.pages.count();
                c.bytes += bytes;
                c.pause_total += pause;
                c.pause_max = c.pause_max.max(pause);
            }
        });
        Ok(())
    }

    /// Copies what changed while the guest runs, then pauses it just long enough to copy
    /// what it wrote meanwhile and the state of that instant (pre-copy's idea, in small).
    fn take(&mut self) -> Result<Taken> {
        let ran = self.vm.is_running();
        let mut pages = self.harvest()?;
        self.copy(&pages)?;
        if ran && let Err(e) = self.vm.pause() {
            self.vm.resume()?;
            return Err(e);
        }
        let paused = self.copy_paused();
        if ran {
            self.vm.resume()?;
        }
        let (written, vcpus, devices) = paused?;
        pages.merge(&written);
        self.seq += 1;
        Ok(Taken {
            seq: self.seq,
            pages,
            vcpus,
            devices,
        })
    }

    /// Adds the pages dirtied since the last harvest to the next checkpoint's share (kept if
    /// this checkpoint fails, so the next one carries them); returns every page not yet
    /// confirmed. A page written after this call is in the next harvest.
    fn harvest(&mut self) -> Result<Bitmap> {
        let dirty = self.vm.take_dirty()?;
        let next = self.seq + 1;
        match self.unconfirmed.last_mut() {
            Some((seq, share)) if *seq == next => share.merge(&dirty),
            _ => self.unconfirmed.push((next, dirty)),
        }
        let mut pages = Bitmap::new(self.vm.ram().gfn_end());
        for (_, share) in &self.unconfirmed {
            pages.merge(share);
        }
        Ok(pages)
    }

    /// The guest is paused: the pages it wrote since the harvest (their live copies may be
    /// torn) copied again, then the state.
    #[allow(clippy::type_complexity)]
    fn copy_paused(&mut self) -> Result<(Bitmap, Vec<Vec<u8>>, Vec<u8>)> {
        let dirty = self.vm.take_dirty()?;
        let next = self.seq + 1;
        if let Some((_, share)) = self.unconfirmed.iter_mut().find(|(seq, _)| *seq == next) {
            share.merge(&dirty);
        }
        self.copy(&dirty)?;
        Ok((dirty, self.vm.save_vcpus()?, self.vm.save_devices()?))
    }

    fn copy(&self, pages: &Bitmap) -> Result<()> {
        let ram = self.vm.ram();
        for gfn in pages.iter() {
            self.shadow.ram().write_page(gfn, ram.page(gfn)?)?;
        }
        Ok(())
    }

    /// Sends the pages a frame at a time (a page request waits at most one frame), then the
    /// state; returns the bytes sent.
    fn send(&self, t: &Taken) -> Result<u64> {
        let mut sender = PageSender::new(FRAME_PAGES);
        sender.checked = true; // copies taken while the guest was paused: they hold still
        let mut limiter = RateLimiter::new(None);
        let ram = self.shadow.ram();
        let mut gfns = t.pages.iter().peekable();
        while gfns.peek().is_some() {
            let mut slot = self.writer.locked();
            let s = slot.as_mut().ok_or_else(disconnected)?;
            for gfn in gfns.by_ref().take(FRAME_PAGES) {
                sender.push(s, ram, gfn, &mut limiter)?;
            }
            sender.flush(s, ram, &mut limiter)?;
        }
        let msg = Message::Checkpoint {
            seq: t.seq,
            pages: t.pages.count(),
            vcpus: t.vcpus.clone(),
            devices: t.devices.clone(),
        };
        let mut slot = self.writer.locked();
        wire::write_message(slot.as_mut().ok_or_else(disconnected)?, &msg)?;
        let state = t.vcpus.iter().map(Vec::len).sum::<usize>() + t.devices.len();
        Ok(sender.counters.bytes + state as u64)
    }
}

fn disconnected() -> crate::Error {
    crate::Error::Protocol("the connection to the source broke".into())
}

impl Drop for Checkpointer {
    fn drop(&mut self) {
        *self.shared.stop.locked() = true;
        self.shared.wake.notify_all();
    }
}
