//! The destination's extra connections of one migration (`connections > 1`): accepted on the
//! migration's listener right after `Ready`, each opened with `Join` naming the migration's
//! session, each read by its own thread straight into guest memory until `LaneEnd`. A stranger
//! (wrong session, a lane taken twice, anything else) is told why and closed.

use crate::sync::Locked;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::cpu::{CpuMeter, Work, Worker};
use crate::error::{Error, Result};
use crate::io::gate::Gate;
use crate::io::transport::{IO_TIMEOUT, Listener, Stream};
use crate::memory::GuestRam;
use crate::pages::PageReceiver;
use crate::wire::lanes::MAX_CONNECTIONS;
use crate::wire::{self, Frame, Message};

/// How long the source has to open all its extra connections once `Ready` is sent: as long as
/// each of them may take to open.
const JOIN_WAIT: Duration = IO_TIMEOUT;

pub(super) struct LaneReceivers {
    /// Each lane's reader, in lane order. Every one is joined before this value is gone: a
    /// reader writes into guest memory, which the caller may unmap once the receive ends.
    threads: Vec<JoinHandle<Option<(PageReceiver, Stream)>>>,
    /// Handles on each lane's connection: closed when the receive ends, so no thread waits on.
    streams: Vec<Stream>,
    /// The first lane failure, kept before the main connection is closed because of it.
    failed: Arc<Mutex<Option<Error>>>,
    /// Pages each extra lane (1..) has put in place so far.
    progress: Vec<Arc<AtomicU64>>,
    /// Set when the receive ends: a lane read from a file (which no shutdown interrupts)
    /// stops at its next frame.
    stop: Arc<AtomicBool>,
    /// Where each reader counts its CPU time.
    cpu: CpuMeter,
}

/// Accepts lanes `1..lanes` of `session` and starts reading each (learning from `pages`, the
/// main connection's receiver, which pages were faulted in ahead). A lane that fails closes
/// `main` too, so the conversation ends at once with the failure.
pub(super) fn accept(
    listener: &Listener,
    session: u64,
    lanes: u32,
    ram: &GuestRam,
    pages: &PageReceiver,
    main: &Stream,
    cpu: &CpuMeter,
) -> Result<LaneReceivers> {
    if lanes > MAX_CONNECTIONS {
        return Err(Error::Protocol(format!(
            "a migration over {lanes} connections (at most {MAX_CONNECTIONS})"
        )));
    }
    let deadline = Instant::now() + JOIN_WAIT;
    let peer = main.peer_identity()?;
    let mut joined = LaneReceivers::new(lanes, cpu);
    let mut taken = vec![false; lanes as usize];
    taken[0] = true; // the main connection
    // A lane may take as long to open as a connection may stay silent anywhere else: a
    // post-copy pauses right after its lanes open, and a link that stalls then holds their
    // `Join` as long as it holds everything else.
    let gate = Gate::opening_within(listener, IO_TIMEOUT)?;
    while joined.threads.len() + 1 < lanes as usize {
        let Some(opened) = gate.next(&|| Instant::now() >= deadline)? else {
            return Err(Error::Protocol(format!(
                "only {} of {lanes} connections joined within {} s",
                joined.threads.len() + 1,
                JOIN_WAIT.as_secs()
            )));
        };
        let stranger = peer.refuses(&opened.stream);
        let why = match opened.first {
            Message::Join { session: s, .. } if s == session && stranger.is_some() => {
                format!(
                    "not a connection of this migration's peer: {}",
                    stranger.unwrap_or_default()
                )
            }
            Message::Join { session: s, lane } if s == session => {
                match taken.get_mut(lane as usize) {
                    Some(t) if !*t => {
                        *t = true;
                        let (stream, _) = opened.admit();
                        joined.start(stream, lane, lanes, ram, pages, main)?;
                        continue;
                    }
                    Some(_) => format!("connection {lane} of this migration has joined already"),
                    None => format!(
                        "this migration has {lanes} connections, not {}",
                        u64::from(lane) + 1
                    ),
                }
            }
            Message::Join { .. } => "not a connection of the migration running here".into(),
            ref other => format!(
                "a migration is running here; a connection opened with {}",
                other.name()
            ),
        };
        opened.refuse(why);
    }
    Ok(joined)
}

/// Lanes `1..lanes` of a snapshot written by several writers (`main` reads lane 0 of the
/// file): each read by its own thread, as a migration's connections are. `lanes` is what the
/// stream says; the file must hold as many. None for a file of one stream.
pub(super) fn open_in_file(
    main: &Stream,
    session: u64,
    lanes: u32,
    ram: &GuestRam,
    pages: &PageReceiver,
    cpu: &CpuMeter,
) -> Result<Option<LaneReceivers>> {
    let Stream::File(file) = main else {
        return Err(Error::Protocol("a snapshot that is not a file".into()));
    };
    let held = file.lanes();
    if held != lanes {
        return Err(Error::Protocol(format!(
            "the snapshot's stream was written by {lanes} writers but the file holds {held}"
        )));
    }
    if lanes == 1 {
        return Ok(None);
    }
    let mut joined = LaneReceivers::new(lanes, cpu);
    for lane in 1..lanes {
        let mut stream = Stream::File(file.lane(lane).expect("a file of several lanes"));
        let join =
            wire::read_stream_header(&mut stream).and_then(|_| wire::read_message(&mut stream))?;
        match join {
            Message::Join {
                session: s,
                lane: l,
            } if s == session && l == lane => {
                joined.start(stream, lane, lanes, ram, pages, main)?;
            }
            other => {
                return Err(Error::Protocol(format!(
                    "writer {lane} of the snapshot file does not open with its Join \
                     (found {})",
                    other.name()
                )));
            }
        }
    }
    Ok(Some(joined))
}

impl LaneReceivers {
    fn new(lanes: u32, cpu: &CpuMeter) -> Self {
        Self {
            threads: Vec::new(),
            streams: Vec::new(),
            failed: Arc::default(),
            progress: (1..lanes).map(|_| Arc::default()).collect(),
            stop: Arc::default(),
            cpu: cpu.clone(),
        }
    }

    fn start(
        &mut self,
        stream: Stream,
        lane: u32,
        lanes: u32,
        ram: &GuestRam,
        main_pages: &PageReceiver,
        main: &Stream,
    ) -> Result<()> {
        // A lane may carry nothing for many rounds (its chunks stay clean): it waits without
        // a timeout; the main connection's end closes it (see `Drop`).
        stream.set_timeouts(None)?;
        self.streams.push(stream.try_clone()?);
        let (ram, main, failed) = (ram.clone(), main.try_clone()?, self.failed.clone());
        let progress = self.progress[lane as usize - 1].clone();
        let (stop, cpu) = (self.stop.clone(), self.cpu.clone());
        let pages = PageReceiver::new(&ram)
            .for_lane(lane, lanes)
            .sharing_ahead_with(main_pages);
        let thread = std::thread::Builder::new()
            .name(format!("lane-{lane}"))
            .spawn(move || {
                let _tracked = cpu.track(Work::Receive, Worker::Lane(lane));
                match receive_lane(stream, &ram, pages, lane, &progress, &stop) {
                    Ok(done) => Some(done),
                    Err(e) => {
                        failed.locked().get_or_insert(e);
                        main.shutdown();
                        None
                    }
                }
            })
            .map_err(|e| Error::vm_caused("cannot start a lane's receiver", e))?;
        self.threads.push(thread);
        Ok(())
    }

    /// Waits (at most `IO_TIMEOUT`) for every lane's `LaneEnd` and adds what each wrote to
    /// `main`. Returns the lanes' connections, in lane order, open for post-copy's pushes.
    pub fn finish(mut self, main: &mut PageReceiver) -> Result<Vec<Stream>> {
        for s in &self.streams {
            s.set_timeouts(Some(IO_TIMEOUT))?;
        }
        // A reader already waiting keeps the timeout it started with (none): the deadline is
        // kept here too, and `Drop` wakes the readers left. It runs from the lanes' last
        // progress (a snapshot's lanes may still have much to read from a slow disk).
        let moved = || -> u64 {
            self.progress
                .iter()
                .map(|p| p.load(Ordering::Acquire))
                .sum()
        };
        let (mut last, mut deadline) = (moved(), Instant::now() + IO_TIMEOUT);
        let mut ended = Vec::with_capacity(self.threads.len());
        // One at a time off the list: on a failure the readers not yet joined stay in it,
        // for `Drop` to stop and join.
        while !self.threads.is_empty() {
            if !self.threads[0].is_finished() {
                if let Some(e) = self.failure() {
                    return Err(e);
                }
                if moved() != last {
                    (last, deadline) = (moved(), Instant::now() + IO_TIMEOUT);
                } else if Instant::now() >= deadline {
                    return Err(Error::Protocol(format!(
                        "a connection put no page in place for {IO_TIMEOUT:?} after the main \
                         one's end"
                    )));
                }
                std::thread::sleep(Duration::from_millis(1));
                continue;
            }
            match self.threads.remove(0).join() {
                Ok(Some((lane, stream))) => {
                    main.absorb(&lane);
                    ended.push(stream);
                }
                Ok(None) => return Err(self.failure().unwrap_or_else(lane_failed)),
                Err(_) => return Err(Error::State("a lane's receiver panicked".into())),
            }
        }
        // Every reader ended at its `LaneEnd`: the connections stay open (`Drop` would shut
        // them down through these handles).
        self.streams.clear();
        Ok(ended)
    }

    /// Waits (at most `IO_TIMEOUT`) until every extra lane has put in place as many pages as
    /// the source says it sent on it.
    pub fn wait_for(&self, sent: &[u64]) -> Result<()> {
        if sent.len() != self.progress.len() {
            return Err(Error::Protocol(format!(
                "Sync names {} extra connections; this migration has {}",
                sent.len(),
                self.progress.len()
            )));
        }
        let deadline = Instant::now() + IO_TIMEOUT;
        for (lane, (done, &want)) in self.progress.iter().zip(sent).enumerate() {
            while done.load(Ordering::Acquire) < want {
                if let Some(e) = self.failure() {
                    return Err(e);
                }
                if Instant::now() >= deadline {
                    return Err(Error::Protocol(format!(
                        "connection {} applied only {} of the {want} pages sent on it in time",
                        lane + 1,
                        done.load(Ordering::Acquire)
                    )));
                }
                std::thread::sleep(Duration::from_micros(100));
            }
        }
        Ok(())
    }

    /// Why a lane failed, if one did (the reason the main connection was closed).
    pub fn failure(&self) -> Option<Error> {
        self.failed.locked().take()
    }
}

fn lane_failed() -> Error {
    Error::State("a connection of this migration failed".into())
}

impl Drop for LaneReceivers {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        for s in &self.streams {
            s.shutdown();
        }
        // Bounded: a socket's reader wakes at the shutdown, a file's at its next frame.
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

fn receive_lane(
    mut stream: Stream,
    ram: &GuestRam,
    mut pages: PageReceiver,
    lane: u32,
    progress: &AtomicU64,
    stop: &AtomicBool,
) -> Result<(PageReceiver, Stream)> {
    loop {
        if stop.load(Ordering::Acquire) {
            return Err(Error::State(format!(
                "connection {lane}: the migration ended"
            )));
        }
        match wire::read_frame(&mut stream)? {
            Frame::Pages { header, len } => {
                pages.receive(&mut stream, ram, &header, len)?;
                progress.store(pages.pages, Ordering::Release);
            }
            Frame::Message(Message::LaneEnd { pages: n }) if n == pages.pages => {
                return Ok((pages, stream));
            }
            Frame::Message(Message::LaneEnd { pages: n }) => {
                return Err(Error::Protocol(format!(
                    "connection {lane}: the source sent {n} pages but {} arrived",
                    pages.pages
                )));
            }
            Frame::Message(Message::Abort { reason }) => return Err(Error::Peer(reason)),
            Frame::Message(other) => {
                return Err(Error::Protocol(format!(
                    "connection {lane} carries pages only, not {}",
                    other.name()
                )));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::RamRange;

    /// A receive that ends leaves no lane reader behind: each writes into guest memory, which
    /// its owner unmaps next (a reader left running crashed a cut snapshot's restore).
    #[test]
    fn ending_the_receive_joins_every_lane_reader() {
        let mut buf = vec![0u8; 16 * crate::PAGE_SIZE];
        let range = RamRange {
            gpa: 0,
            len: buf.len() as u64,
        };
        // SAFETY: `buf` outlives the receivers, which are dropped (and joined) below.
        let ram = unsafe { GuestRam::new(&[(range, buf.as_mut_ptr())]) }.unwrap();
        let main_pages = PageReceiver::new(&ram);
        let (main, _main_peer) = std::os::unix::net::UnixStream::pair().unwrap();
        let main = Stream::Unix(main);
        let mut peers = Vec::new();
        let mut joined = LaneReceivers::new(3, &CpuMeter::default());
        for lane in 1..3 {
            // Silent peers: each reader waits in a read that only the shutdown ends.
            let (ours, theirs) = std::os::unix::net::UnixStream::pair().unwrap();
            peers.push(theirs);
            joined
                .start(Stream::Unix(ours), lane, 3, &ram, &main_pages, &main)
                .unwrap();
        }
        // Each reader holds a handle on `stop` until it has returned.
        let stop = Arc::downgrade(&joined.stop);
        drop(joined);
        assert!(
            stop.upgrade().is_none(),
            "a lane reader outlived the receive"
        );
        drop(buf);
    }
}
