//! Serving post-copy: the VM runs on the destination; its pages follow. Requests are served
//! first, everything else is pushed in the planner's order (see `prepaging`); each page leaves
//! at most once. A reader thread hears the destination while the session pushes. Over several
//! connections the extra ones ("lanes") push, each on a thread of its own taking the planner's
//! next pages in batches, and the main connection carries only the answers to requests: a
//! fault's page never waits behind a push on its connection.

use crate::sync::Locked;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, TryRecvError};
use std::time::{Duration, Instant};

use super::checkpoints::Checkpoints;
use super::controls::Leftover;
use super::lane::{Lane, join_lanes};
use super::machine::Event;
use super::pushes::{Claims, PushQueue, Pushes, QUEUE_FULL_WAIT, not_reading, push_on_lane};
use super::serving::GuestFigures;
use super::session::Session;
use super::switchover::Follow;
use crate::bitmap::Bitmap;
use crate::cpu::{CpuMeter, Work, Worker};
use crate::error::{Error, Result};
use crate::io::transport::{IO_TIMEOUT, Stream};
use crate::memory::GuestRam;
use crate::pages::PageSender;
use crate::prepaging::Strategy;
use crate::ratelimit::RateLimiter;
use crate::status::RoundStats;
use crate::wire::{self, Frame, Message, PostcopyReport};

/// How often the main connection's thread looks at the lanes while no request comes.
const LANES_LOOK: Duration = Duration::from_millis(2);
/// How often the live status is published while lanes push.
const PROGRESS_EVERY: Duration = Duration::from_millis(20);

/// How long the source waits for the destination's final word once everything is sent.
const COMPLETE_WAIT: Duration = Duration::from_secs(60);

/// Reads the destination's messages on their own thread, so requests are seen while the
/// sender is busy pushing. With `checkpoints`, it also takes in the checkpoints the
/// destination sends back (their page frames, then `Checkpoint`, applied here before the
/// message is passed on). Ends at the first error (which it passes on).
pub(crate) fn spawn_reader(
    mut stream: Stream,
    checkpoints: Option<Arc<Checkpoints>>,
) -> Result<Receiver<Result<Message>>> {
    let (tx, rx) = std::sync::mpsc::channel();
    let reader = checkpoints.as_ref().map_or(0, |c| c.restart());
    std::thread::Builder::new()
        .name("postcopy-requests".into())
        .spawn(move || {
            let _urgent = crate::urgent::urgent();
            loop {
                let msg = read_from_destination(&mut stream, checkpoints.as_deref(), reader);
                let failed = msg.is_err();
                if failed {
                    // The connection is dead: a push blocked on a peer that stopped reading
                    // fails now, not when its write times out.
                    stream.shutdown();
                }
                if tx.send(msg).is_err() || failed {
                    return;
                }
            }
        })
        .map_err(|e| Error::vm_caused("cannot start the post-copy reader", e))?;
    Ok(rx)
}

/// The destination's next message; the page frames of a checkpoint before it are staged.
fn read_from_destination(
    stream: &mut Stream,
    checkpoints: Option<&Checkpoints>,
    reader: u64,
) -> Result<Message> {
    loop {
        match (wire::read_frame(stream)?, checkpoints) {
            (Frame::Pages { header, len }, Some(c)) => c.stage(reader, stream, &header, len)?,
            (Frame::Pages { .. }, None) => {
                return Err(Error::Protocol(
                    "the destination sent pages back, but no checkpoints were asked for".into(),
                ));
            }
            (Frame::Message(m), c) => {
                if let Message::Checkpoint {
                    seq,
                    pages,
                    vcpus,
                    devices,
                } = &m
                {
                    let c = c.ok_or_else(|| {
                        Error::Protocol(
                            "the destination sent a checkpoint, but none were asked for".into(),
                        )
                    })?;
                    c.apply(reader, *seq, *pages, vcpus, devices)?;
                }
                return Ok(m);
            }
        }
    }
}

/// Counters of one post-copy serving.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Served {
    pub pushed: u64,
    pub requested: u64,
    /// Of `pushed`, those pushed on the extra connections.
    pub on_lanes: u64,
}

/// What a post-copy serving sends with: the connection, the memory, the sender and its
/// limiter, the reader's messages (`spawn_reader`), the extra connections that push (none: the
/// pushes share the connection with the answers), and whether checkpoints come back.
pub(crate) struct Outlet<'a> {
    pub stream: &'a mut Stream,
    pub ram: &'a GuestRam,
    pub limiter: &'a mut RateLimiter,
    pub sender: &'a mut PageSender,
    pub events: &'a Receiver<Result<Message>>,
    pub lanes: &'a mut [Lane],
    /// The reader applies checkpoints to guest memory here while the pages are sent.
    pub checkpoints: bool,
    /// Tracks the lanes' pushing threads.
    pub cpu: &'a CpuMeter,
}

/// Sends every page of `pending`, requests first, and returns once the destination confirmed
/// it has them all. `heard` sees every message (the guest report); `progress` sees the
/// counters and the pages left now and then.
pub(crate) fn serve(
    outlet: Outlet<'_>,
    pending: Bitmap,
    strategy: Strategy,
    heard: impl FnMut(&Message) -> Result<()>,
    progress: impl FnMut(Served, u64),
) -> Result<(Served, PostcopyReport)> {
    let claims = Claims::new(pending, strategy);
    let Outlet {
        stream,
        ram,
        limiter,
        sender,
        events,
        lanes,
        checkpoints,
        cpu,
    } = outlet;
    let mut s = Serving {
        out: Outlet {
            stream,
            ram,
            limiter,
            sender,
            events,
            lanes: &mut [],
            checkpoints,
            cpu,
        },
        claims: &claims,
        served: Served::default(),
        heard,
        // A page a lane pushed may wait behind megabytes in that lane's queues: it is answered
        // again, unless a checkpoint may rewrite it here while the lane still reads it (its
        // frame would then fail its check). Over one connection the window of pages not yet
        // taken off it (`PushQueue`) is what an answer waits behind.
        answer_pushed: !lanes.is_empty() && !checkpoints,
        main: PushQueue::shared_by(1),
    };
    if lanes.is_empty() {
        s.push_here(progress)?;
    } else {
        s.push_on_lanes(lanes, progress)?;
    }
    let pages_sent = s.served.pushed + s.served.requested;
    wire::write_message(s.out.stream, &Message::PostcopyDone { pages_sent })?;
    let report = s.await_complete()?;
    Ok((s.served, report))
}

/// One post-copy serving under way.
struct Serving<'a, 'p, H> {
    out: Outlet<'a>,
    claims: &'p Claims,
    served: Served,
    heard: H,
    /// A requested page a push claimed is sent again (see `serve`).
    answer_pushed: bool,
    /// The main connection's queue, when the pushes share it with the answers.
    main: PushQueue,
}

impl<H: FnMut(&Message) -> Result<()>> Serving<'_, '_, H> {
    /// Pages not sent yet.
    fn remaining(&self) -> u64 {
        self.claims.left()
    }

    /// One connection: pushes and answers share it, requests first.
    fn push_here(&mut self, mut progress: impl FnMut(Served, u64)) -> Result<()> {
        let _ahead = crate::urgent::ahead();
        wire::write_message(self.out.stream, &PushQueue::receipts_asked())?;
        let mut batch = Vec::new();
        while self.remaining() > 0 {
            self.answer_requests()?;
            self.push_batch(&mut batch)?;
            progress(self.served, self.remaining());
        }
        Ok(())
    }

    /// Several connections: each lane pushes on a thread of its own until the planner has
    /// nothing left, then ends with `LaneEnd`; this thread answers the requests meanwhile.
    fn push_on_lanes(
        &mut self,
        lanes: &mut [Lane],
        mut progress: impl FnMut(Served, u64),
    ) -> Result<()> {
        let pushes = Pushes {
            claims: self.claims,
            pushed: AtomicU64::new(0),
            running: AtomicUsize::new(lanes.len()),
            stop: AtomicBool::new(false),
            pushers: lanes.len(),
        };
        // Handles to close a lane blocked in a write when this side fails.
        let closers: Vec<Stream> = lanes
            .iter()
            .map(|l| l.stream().try_clone())
            .collect::<Result<_>>()?;
        let ram = self.out.ram.clone();
        std::thread::scope(|scope| {
            let threads: Vec<_> = lanes
                .iter_mut()
                .zip(1..)
                .map(|(lane, n)| {
                    let (pushes, ram, cpu) = (&pushes, &ram, self.out.cpu);
                    scope.spawn(move || {
                        let _tracked = cpu.track(Work::Send, Worker::Lane(n));
                        let _ahead = crate::urgent::ahead();
                        let pushed = push_on_lane(lane, ram, pushes);
                        if pushed.is_err() {
                            pushes.stop.store(true, Ordering::Release);
                        }
                        pushes.running.fetch_sub(1, Ordering::AcqRel);
                        pushed
                    })
                })
                .collect();
            let answered = self.answer_while_lanes_push(&pushes, &mut progress);
            if answered.is_err() {
                pushes.stop.store(true, Ordering::Release);
                closers.iter().for_each(Stream::shutdown);
            }
            let joined = join_lanes(answered, threads, "pushing");
            self.served.pushed = pushes.pushed.load(Ordering::Acquire);
            self.served.on_lanes = self.served.pushed;
            joined
        })
    }

    /// Answers requests until every lane has ended its pushes.
    fn answer_while_lanes_push(
        &mut self,
        pushes: &Pushes<'_>,
        progress: &mut impl FnMut(Served, u64),
    ) -> Result<()> {
        let _urgent = crate::urgent::urgent();
        let mut published = Instant::now();
        while pushes.running.load(Ordering::Acquire) > 0 {
            if pushes.stop.load(Ordering::Acquire) {
                return Err(Error::State("a connection of this migration failed".into()));
            }
            match self.out.events.recv_timeout(LANES_LOOK) {
                Ok(msg) => {
                    if let Some(r) = self.handle(msg?)? {
                        return Err(completed_early(&r));
                    }
                }
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => return Err(gone()),
            }
            if published.elapsed() >= PROGRESS_EVERY {
                published = Instant::now();
                self.served.pushed = pushes.pushed.load(Ordering::Relaxed);
                self.served.on_lanes = self.served.pushed;
                progress(self.served, self.remaining());
            }
        }
        Ok(())
    }

    /// Answers the requests waiting and takes in the receipts. While the push queue is full,
    /// only requests and receipts (each request waits for at most what the queue holds); a
    /// queue that stays full as long as a write may block means the destination stopped
    /// reading.
    fn answer_requests(&mut self) -> Result<()> {
        let mut full_since = None;
        loop {
            if !self.main.full(self.out.stream) {
                full_since = None;
            }
            let msg = if full_since.is_some() || self.main.full(self.out.stream) {
                let since = *full_since.get_or_insert_with(Instant::now);
                if since.elapsed() > IO_TIMEOUT {
                    return Err(not_reading());
                }
                match self.out.events.recv_timeout(QUEUE_FULL_WAIT) {
                    Ok(msg) => msg,
                    Err(RecvTimeoutError::Timeout) => continue,
                    Err(RecvTimeoutError::Disconnected) => return Err(gone()),
                }
            } else {
                match self.out.events.try_recv() {
                    Ok(msg) => msg,
                    Err(TryRecvError::Empty) => return Ok(()),
                    Err(TryRecvError::Disconnected) => return Err(gone()),
                }
            };
            if let Some(r) = self.handle(msg?)? {
                return Err(completed_early(&r));
            }
        }
    }

    /// Pushes the planner's next pages.
    fn push_batch(&mut self, batch: &mut Vec<u64>) -> Result<()> {
        let n = self.main.batch_pages();
        self.claims.next_pushes(batch, n);
        let o = &mut self.out;
        for &gfn in batch.iter() {
            o.sender.push(o.stream, o.ram, gfn, o.limiter)?;
        }
        self.served.pushed += batch.len() as u64;
        self.main.sent(batch.len() as u64);
        o.sender.flush(o.stream, o.ram, o.limiter)
    }

    /// Everything was sent: waits for the destination's word that everything arrived. A
    /// request still on its way asks for a page already sent, on a lane at worst, ahead of
    /// `LaneEnd`: it is not answered again, as the destination reads nothing after
    /// `PostcopyDone` (such an answer was counted as sent, never as received).
    fn await_complete(&mut self) -> Result<PostcopyReport> {
        self.answer_pushed = false;
        let deadline = Instant::now() + COMPLETE_WAIT;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.out.events.recv_timeout(left) {
                Ok(msg) => match self.handle(msg?) {
                    Ok(Some(r)) => return Ok(r),
                    Ok(None) => {}
                    Err(e) => return self.completion_behind(e, deadline),
                },
                Err(RecvTimeoutError::Timeout) => {
                    return Err(Error::Protocol(
                        "the destination never confirmed that every page arrived".into(),
                    ));
                }
                Err(RecvTimeoutError::Disconnected) => return Err(gone()),
            }
        }
    }

    /// A reply (a checkpoint's receipt, a page) could not be written: the destination may
    /// have said it has every page, behind the message answered, and gone (its VM stopped
    /// there, as its user asked). Its word read before `deadline` still counts; nothing more
    /// is written.
    fn completion_behind(&mut self, failed: Error, deadline: Instant) -> Result<PostcopyReport> {
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.out.events.recv_timeout(left) {
                Ok(Ok(Message::PostcopyComplete(r))) => {
                    (self.heard)(&Message::PostcopyComplete(r.clone()))?;
                    return Ok(r);
                }
                Ok(Ok(_)) => {}
                Ok(Err(_)) | Err(_) => return Err(failed),
            }
        }
    }

    /// One message from the destination; its report once it has every page.
    fn handle(&mut self, msg: Message) -> Result<Option<PostcopyReport>> {
        (self.heard)(&msg)?;
        match msg {
            Message::PageRequest { gfn } => self.answer(gfn)?,
            Message::PostcopyComplete(r) => return Ok(Some(r)),
            Message::Taken { pages } => self.main.taken(pages)?,
            // Applied by the reader: the destination may forget its pages.
            Message::Checkpoint { seq, .. } => {
                wire::write_message(self.out.stream, &Message::CheckpointTaken { seq })?;
            }
            _ => {}
        }
        Ok(None)
    }

    /// Sends a requested page at once (unless it left already), and pre-pages around it.
    fn answer(&mut self, gfn: u64) -> Result<()> {
        let o = &mut self.out;
        if !o.ram.contains(gfn) {
            return Err(Error::Protocol(format!(
                "the destination asked for page {gfn:#x}, outside guest RAM"
            )));
        }
        if self.claims.claim_request(gfn, self.answer_pushed) {
            o.sender.push(o.stream, o.ram, gfn, o.limiter)?;
            o.sender.flush(o.stream, o.ram, o.limiter)?;
            self.served.requested += 1;
            self.main.sent(1);
        }
        Ok(())
    }
}

fn completed_early(r: &PostcopyReport) -> Error {
    Error::Protocol(format!(
        "the destination reported completion with pages missing ({r:?})"
    ))
}

fn gone() -> Error {
    Error::Protocol("the destination went away".into())
}

impl Session<'_> {
    /// The VM runs on the destination; its pages follow, requested ones first. When the last
    /// one was in place.
    /// Serves post-copy to its end: when the last page was in place, and the guest's figures
    /// as far as they came (the destination sends them a moment after it resumed).
    pub(super) fn post_copy(&mut self, follow: Follow) -> Result<(Instant, GuestFigures)> {
        let began = Instant::now();
        let Follow {
            pending,
            checkpoints,
        } = follow;
        let checkpointed = checkpoints.is_some();
        let events = spawn_reader(self.stream.try_clone()?, checkpoints)?;
        let before = self.sent();
        let mut state = self.state;
        let mut guest_report = None;
        let board = self.board;
        let board_status = &mut self.status;
        let outlet = Outlet {
            stream: &mut self.stream,
            ram: &self.ram,
            limiter: &mut self.limiter,
            sender: &mut self.pages,
            events: &events,
            lanes: &mut self.lanes,
            checkpoints: checkpointed,
            cpu: &self.cpu,
        };
        let (served, report) = serve(
            outlet,
            pending,
            self.params.prepaging,
            |msg| {
                state = state.next(Event::Heard(msg))?;
                if let Message::GuestReport {
                    observed_downtime_ns,
                    pages_per_s_after,
                } = msg
                {
                    guest_report = Some((*observed_downtime_ns, *pages_per_s_after));
                }
                Ok(())
            },
            |s, left| {
                board_status.progress.pages.pushed = s.pushed;
                board_status.progress.pages.pushed_on_lanes = s.on_lanes;
                board_status.progress.pages.requested = s.requested;
                board_status.progress.pages_remaining = left;
                board.publish(board_status);
            },
        )?;
        self.state = state;
        let finished = Instant::now();
        self.note_cpu();
        *self.leftover.locked() = None;
        let after = self.sent();
        let p = &mut self.status.progress;
        p.pages.pushed = served.pushed;
        p.pages.pushed_on_lanes = served.on_lanes;
        p.pages.requested = served.requested;
        let round = p.rounds.len() as u32;
        p.rounds.push(RoundStats {
            round,
            pages: served.pushed + served.requested,
            zero_pages: after.zero - before.zero,
            bytes: after.bytes - before.bytes,
            duration: began.elapsed(),
            ..Default::default()
        });
        self.status.report.memory_checksum_destination = report.memory_checksum;
        self.status.report.postcopy_report = Some(report);
        let guest = match guest_report {
            Some((observed, rate)) => GuestFigures::Heard(observed, rate),
            None => GuestFigures::Coming(events),
        };
        Ok((finished, guest))
    }

    pub(super) fn keep_leftover(&self, follow: &Follow) {
        *self.leftover.locked() = Some(Leftover {
            pending: follow.pending.clone(),
            params: self.params.clone(),
            checkpoints: follow.checkpoints.clone(),
        });
    }
}
