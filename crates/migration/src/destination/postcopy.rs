//! Post-copy on the destination: guest memory is registered with userfaultfd (missing pages)
//! before the vCPUs resume. A fault on a page the source never populated is resolved here with
//! a zero page; any other missing page is requested from the source on the connection's
//! return direction, which bulk pushes (going the other way) cannot delay. Pages that arrive —
//! requested or pushed — are installed with `UFFDIO_COPY`, which also wakes whoever waits for
//! them. A VMM thread touching a missing page (device emulation) faults the same way and
//! waits: nothing is overwritten or lost.

use crate::sync::Locked;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering, fence};
use std::sync::{Arc, Mutex};
use std::thread::Scope;
use std::time::{Duration, Instant};

use userfaultfd::{Event, Uffd, UffdBuilder};

use super::checkpoints::Checkpointer;
use super::installers::{self, Installers};
use crate::PAGE_SIZE;
use crate::bitmap::{AtomicBitmap, Bitmap};
use crate::board::StatusBoard;
use crate::buckets::FaultLatency;
use crate::cpu::{CpuMeter, Work, Worker};
use crate::error::{Error, Result};
use crate::io::transport::{IO_TIMEOUT, PeerIdentity, Stream};
use crate::memory::GuestRam;
use crate::scan::{memory_checksum_of, page_digest, populated_pages};
use crate::vm::Migratable;
use crate::wire::frame::FRAME_HEADER_LEN;
use crate::wire::page_frame::{FrameBuffers, read_frame_into};
use crate::wire::{self, Frame, Message, PostcopyReport};

/// Whether this host can serve post-copy (userfaultfd with kernel-mode faults, as KVM needs).
pub fn supported() -> bool {
    new_uffd().is_ok()
}

fn new_uffd() -> Result<Uffd> {
    UffdBuilder::new()
        .close_on_exec(true)
        // Polled, then read: a fault woken meanwhile (its page installed) leaves nothing to
        // read, and a blocking read would then hold the handler past its `stop`.
        .non_blocking(true)
        .user_mode_only(false)
        .create()
        .map_err(|e| Error::vm_caused("userfaultfd (post-copy needs root)", e))
}

/// Calls `on_fault` with the page of each missing-page fault `uffd` reports, until `stop` (seen
/// within 50 ms).
pub(super) fn each_fault(
    uffd: &Uffd,
    stop: &AtomicBool,
    mut on_fault: impl FnMut(*mut libc::c_void),
) {
    let mut poll = libc::pollfd {
        fd: std::os::fd::AsRawFd::as_raw_fd(uffd),
        events: libc::POLLIN,
        revents: 0,
    };
    while !stop.load(Ordering::Acquire) {
        // SAFETY: one valid pollfd; a bounded wait so that `stop` is seen.
        if unsafe { libc::poll(&mut poll, 1, 50) } <= 0 {
            continue;
        }
        if let Ok(Some(Event::Pagefault { addr, .. })) = uffd.read_event() {
            on_fault((addr as usize & !(PAGE_SIZE - 1)) as *mut libc::c_void);
        }
    }
}

/// A page asked for this long ago and still not here: the link has likely gone silent.
const STALLED_FAULT: Duration = Duration::from_secs(1);

/// The destination's side of post-copy, armed before the guest resumes.
pub struct Postcopy {
    ram: GuestRam,
    /// Where page requests go; `None` while the connection is down (requests wait).
    requests: Arc<Mutex<Option<Stream>>>,
    stop: Arc<AtomicBool>,
    progress: Mutex<Installed>,
    /// The source asked for a checksum of memory: each page is added as it lands.
    summing: bool,
    resumed: Instant,
    uffd: Arc<Uffd>,
    pending: Arc<Bitmap>,
    present: Arc<AtomicBitmap>,
    /// Pending pages a reader has taken to install: each is installed by one reader only
    /// (over several connections a page may come twice, and the guest may have written the
    /// first copy by the time the second comes).
    claimed: AtomicBitmap,
    /// Pending pages a fault asked the source for.
    asked: Arc<AtomicBitmap>,
    faults: Arc<Mutex<FaultLog>>,
    timeline: Mutex<Timeline>,
    checkpointer: Mutex<Option<Checkpointer>>,
    /// The VM, told while its memory is registered (`Migratable::hold_page_discards`).
    vm: Arc<dyn Migratable>,
    /// Who serves the pages (learnt from the first connection attached): a connection that
    /// carries post-copy on must come from it.
    peer: Mutex<Option<PeerIdentity>>,
}

impl Drop for Postcopy {
    /// A post-copy given up before the guest ran here (or ended) stops its fault handler.
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
    }
}

/// What has been installed so far (it outlives an interrupted connection).
struct Installed {
    pages: u64,
    duplicates: u64,
    checksum: Option<u64>,
}

/// Makes every pending page that is here (`stale`: it arrived in an earlier round and was
/// dirtied since, or was written here) missing again, so that the guest's first touch asks
/// for the source's copy. Most of them are dropped
/// before the pause (`Stale`); the rest inside the downtime, so runs of consecutive pending
/// pages are dropped with one call each (a pending page that is not here is absent already,
/// so a run may include it), which makes the cost grow with the runs, not the pages.
pub(super) fn drop_stale_copies(ram: &GuestRam, pending: &Bitmap, stale: &Bitmap) -> Result<()> {
    let mut run: Option<(u64, u64, bool)> = None; // first page, pages, holds a stale copy
    for pfn in pending.iter() {
        let stale = stale.get(pfn);
        run = match run {
            Some((first, n, any)) if first + n == pfn && ram.pages_to_region_end(first) > n => {
                Some((first, n + 1, any || stale))
            }
            Some((first, n, any)) => {
                if any {
                    ram.discard(first, n)?;
                }
                Some((pfn, 1, stale))
            }
            None => Some((pfn, 1, stale)),
        };
    }
    if let Some((first, n, true)) = run {
        ram.discard(first, n)?;
    }
    Ok(())
}

/// The faults that went to the network, and what they waited. Taken by the fault handler and
/// by a reader only for a page that was asked for: the readers' bulk work never holds it.
#[derive(Default)]
struct FaultLog {
    waiting: HashMap<u64, Instant>,
    latencies_ms: Vec<f64>,
    network: u64,
    zero: u64,
}

/// The receipts a source asked for on a connection that pushes (`Message::Receipts`): a
/// running count of the pages taken off it, told every `every` pages. The source pushes no
/// further ahead of them than its window, so what waits here (in the socket, in the
/// installers' queue) stays short however well the pages compress.
struct Receipts {
    every: u64,
    taken: u64,
    told: u64,
}

impl Receipts {
    fn asked(every: u32) -> Result<Self> {
        if every == 0 {
            return Err(Error::Protocol(
                "the source asked for a receipt every 0 pages".into(),
            ));
        }
        Ok(Self {
            every: every.into(),
            taken: 0,
            told: 0,
        })
    }

    /// `pages` more were taken off the connection: the receipt to send now, if one is due.
    fn took(&mut self, pages: u64) -> Option<Message> {
        self.taken += pages;
        (self.taken - self.told >= self.every).then(|| {
            self.told = self.taken;
            Message::Taken { pages: self.taken }
        })
    }
}

/// Whether page `gfn` with `data` follows the run of pages from `first` (`run`) in a region
/// that ends at `end`: the next page, its data right after the run's in the frame.
fn run_goes_on(first: u64, end: u64, run: &[&[u8]], gfn: u64, data: &[u8]) -> bool {
    let Some(last) = run.last() else {
        return false;
    };
    gfn == first + run.len() as u64 && gfn < end && last.as_ptr_range().end == data.as_ptr()
}

/// Faults and arrivals per 10 ms since the switch, for the faults-vs-pushes plot.
#[derive(Default)]
struct Timeline(Vec<[u32; 3]>);

impl Timeline {
    const NETWORK_FAULT: usize = 0;
    const PUSHED: usize = 1;
    const REQUESTED: usize = 2;
    /// Ten minutes; later events count in the last bucket.
    const MAX_BUCKETS: usize = 60_000;

    /// Counts `n` of `what` at `at`, `resumed` being the switch.
    fn add(&mut self, resumed: Instant, at: Instant, what: usize, n: usize) {
        let since = at.saturating_duration_since(resumed);
        let bucket = ((since.as_millis() / 10) as usize).min(Self::MAX_BUCKETS - 1);
        if self.0.len() <= bucket {
            self.0.resize(bucket + 1, [0; 3]);
        }
        self.0[bucket][what] += n as u32;
    }
}

/// What the fault handler works with.
struct FaultPath {
    uffd: Arc<Uffd>,
    ram: GuestRam,
    pending: Arc<Bitmap>,
    present: Arc<AtomicBitmap>,
    asked: Arc<AtomicBitmap>,
    faults: Arc<Mutex<FaultLog>>,
    requests: Arc<Mutex<Option<Stream>>>,
}

impl FaultPath {
    /// A missing page touched: here already (woken), never populated (a zero page), or
    /// asked for, once.
    fn on_fault(&self, page: *mut libc::c_void) {
        let Some(pfn) = self.ram.gfn_of_host(page as u64) else {
            return;
        };
        if self.present.get(pfn) {
            let _ = self.uffd.wake(page, PAGE_SIZE);
        } else if !self.pending.get(pfn) {
            // SAFETY: a page of the registered range.
            let _ = unsafe { self.uffd.zeropage(page, PAGE_SIZE, true) };
            if !self.present.set(pfn) {
                self.faults.locked().zero += 1;
            }
        } else if !self.asked.set(pfn) {
            self.ask(pfn, page);
        } else if self.present.get(pfn) {
            let _ = self.uffd.wake(page, PAGE_SIZE);
        }
    }

    /// The first fault on a pending page: asks the source for it, unless it was put in
    /// place meanwhile. Its reader marks it present, then looks whether it was asked for;
    /// this side marks it asked, then looks whether it is present (both with a full fence
    /// between): one of the two sees the other, so a page never waits unasked for, and a
    /// page that came is never left waiting.
    fn ask(&self, pfn: u64, page: *mut libc::c_void) {
        let mut log = self.faults.locked();
        log.waiting.insert(pfn, Instant::now());
        fence(Ordering::SeqCst);
        if self.present.get(pfn) {
            log.waiting.remove(&pfn);
            drop(log);
            let _ = self.uffd.wake(page, PAGE_SIZE);
            return;
        }
        log.network += 1;
        drop(log);
        let mut slot = self.requests.locked();
        if let Some(s) = slot.as_mut() {
            let _ = wire::write_message(s, &Message::PageRequest { gfn: pfn });
        }
    }
}

impl Postcopy {
    /// The guest memory it fills.
    pub(super) fn ram(&self) -> &GuestRam {
        &self.ram
    }

    /// Drops stale copies of pending pages (those in `received`) and registers guest memory
    /// of `vm` for missing-page faults. The vCPUs must still be parked.
    pub fn arm(
        vm: Arc<dyn Migratable>,
        pending: Bitmap,
        received: &Bitmap,
        checksum: bool,
    ) -> Result<Self> {
        let ram = vm.ram();
        // A pending page can be here without having arrived: KVM writes guest memory when
        // the state loads (the wall clock a Linux guest's kvmclock MSR names). The source's
        // copy is the guest's; the one here is stale like any copy from an earlier round.
        let mut stale = populated_pages(&ram)?;
        stale.merge(received);
        drop_stale_copies(&ram, &pending, &stale)?;
        let base_checksum = if checksum {
            let mut here = populated_pages(&ram)?;
            for pfn in pending.iter() {
                here.unset(pfn);
            }
            Some(memory_checksum_of(&ram, &here)?)
        } else {
            None
        };
        let uffd = new_uffd()?;
        vm.hold_page_discards(true);
        for (range, host) in ram.host_regions() {
            uffd.register(host as *mut libc::c_void, range.len as usize)
                .map_err(|e| Error::vm_caused("userfaultfd register", e))?;
        }
        Ok(Self {
            ram,
            requests: Arc::new(Mutex::new(None)),
            stop: Arc::new(AtomicBool::new(false)),
            progress: Mutex::new(Installed {
                pages: 0,
                duplicates: 0,
                checksum: base_checksum,
            }),
            summing: checksum,
            resumed: Instant::now(),
            uffd: Arc::new(uffd),
            present: Arc::new(AtomicBitmap::new(pending.pages())),
            claimed: AtomicBitmap::new(pending.pages()),
            asked: Arc::new(AtomicBitmap::new(pending.pages())),
            pending: Arc::new(pending),
            faults: Arc::new(Mutex::new(FaultLog::default())),
            timeline: Mutex::default(),
            checkpointer: Mutex::new(None),
            vm,
            peer: Mutex::new(None),
        })
    }

    /// Why `stream` may not carry this post-copy on; `None` when it may (it comes from the
    /// peer of the first connection).
    pub fn refuses(&self, stream: &Stream) -> Option<String> {
        self.peer
            .locked()
            .as_ref()
            .and_then(|peer| peer.refuses(stream))
    }

    /// Sends the source a checkpoint of `vm` every `every` until post-copy ends (dirty logging
    /// must run since before the guest resumed).
    pub fn start_checkpoints(
        &self,
        vm: Arc<dyn Migratable>,
        every: Duration,
        board: StatusBoard,
    ) -> Result<()> {
        let faults = self.faults.clone();
        let stalled = Box::new(move || {
            let log = faults.locked();
            log.waiting
                .values()
                .any(|asked| asked.elapsed() > STALLED_FAULT)
        });
        let c = Checkpointer::start(vm, self.requests.clone(), every, board, stalled)?;
        *self.checkpointer.locked() = Some(c);
        Ok(())
    }

    /// Connects page requests to `stream` (a clone of the migration connection) and asks
    /// again for every page still awaited (after a reconnection they may have been lost).
    pub fn attach(&self, stream: Stream) {
        {
            let mut peer = self.peer.locked();
            if peer.is_none() {
                *peer = stream.peer_identity().ok();
            }
        }
        let mut slot = self.requests.locked();
        *slot = Some(stream);
        let waiting: Vec<u64> = {
            let log = self.faults.locked();
            log.waiting.keys().copied().collect()
        };
        if let Some(s) = slot.as_mut() {
            for pfn in waiting {
                let _ = wire::write_message(s, &Message::PageRequest { gfn: pfn });
            }
        }
    }

    /// The connection is gone: requests wait for the next `attach`.
    pub fn detach(&self) {
        *self.requests.locked() = None;
    }

    /// The pending pages that are here.
    pub fn present_map(&self) -> Bitmap {
        let mut b = Bitmap::new(self.ram.gfn_end());
        for pfn in self.pending.iter().filter(|&p| self.present.get(p)) {
            b.set(pfn);
        }
        b
    }

    /// Resolves faults until post-copy ends: zero pages here, the rest requested.
    pub fn spawn_fault_handler(&self) -> Result<()> {
        let path = FaultPath {
            uffd: self.uffd.clone(),
            ram: self.ram.clone(),
            pending: self.pending.clone(),
            present: self.present.clone(),
            asked: self.asked.clone(),
            faults: self.faults.clone(),
            requests: self.requests.clone(),
        };
        let stop = self.stop.clone();
        std::thread::Builder::new()
            .name("postcopy-faults".into())
            .spawn(move || {
                let _urgent = crate::urgent::urgent();
                each_fault(&path.uffd, &stop, |page| path.on_fault(page));
            })
            .map(|_| ())
            .map_err(|e| Error::vm_caused("cannot start the post-copy fault handler", e))
    }

    /// Installs pages from the stream (and from `lanes`, the extra connections the source
    /// pushes on, each read by a thread of its own) until the source says it sent them all;
    /// then ends post-copy (the memory is ordinary again) and tells the source.
    pub fn receive_pages(
        &self,
        stream: &mut Stream,
        lanes: Vec<Stream>,
        cpu: &CpuMeter,
    ) -> Result<PostcopyReport> {
        let want = self.pending.count();
        self.receive_all(stream, lanes, cpu)?;
        let installed = self.progress.locked().pages;
        if installed != want {
            return Err(Error::Protocol(format!(
                "post-copy ended with {installed} of {want} pages installed"
            )));
        }
        // Every page is here: the source's copy is of no more use.
        let checkpointer = self.checkpointer.locked().take();
        if let Some(c) = checkpointer {
            c.stop();
        }
        self.stop.store(true, Ordering::Release);
        for (range, host) in self.ram.host_regions() {
            let _ = self
                .uffd
                .unregister(host as *mut libc::c_void, range.len as usize);
        }
        self.vm.hold_page_discards(false);
        let report = self.report();
        // Through the shared writer: a request or the guest report never interleaves with it.
        // The connection stays attached for the guest report that may still follow.
        self.reply(&Message::PostcopyComplete(report.clone()))?;
        Ok(report)
    }

    /// Reads the main connection here, each lane on a thread of its own, until `PostcopyDone`
    /// and every lane's `LaneEnd`, and installs what they bring on the installing threads
    /// (which finish the frames already read before this returns, failed or not). A lane or
    /// installer that fails closes the main connection (its failure is the reason); a main
    /// connection that fails closes the lanes.
    fn receive_all(&self, stream: &mut Stream, lanes: Vec<Stream>, cpu: &CpuMeter) -> Result<()> {
        let failed: Mutex<Option<Error>> = Mutex::new(None);
        let main = stream.try_clone()?;
        let mut closers = Vec::with_capacity(lanes.len());
        for lane in &lanes {
            lane.set_timeouts(Some(IO_TIMEOUT))?;
            closers.push(lane.try_clone()?);
        }
        let fail = |e: Error| {
            failed.locked().get_or_insert(e);
            main.shutdown();
        };
        let install = |frame: &FrameBuffers| self.install_arrived(frame.pages()).map(drop);
        // Real-time only for a reader of answers alone: one that reads every push too never
        // sleeps while the source sends, and would hold a core for as long as the peer liked.
        let answers_only = !lanes.is_empty();
        let received = std::thread::scope(|scope| {
            let threads = installers::how_many();
            let installers = Installers::start(scope, threads, cpu, &install, &fail);
            // The readers end before the installers' queue closes.
            std::thread::scope(|readers| {
                for (i, lane) in lanes.into_iter().enumerate() {
                    let n = i as u32 + 1;
                    self.spawn_lane_reader(readers, lane, n, &installers, cpu, &fail);
                }
                // With lanes, only the answers to faults come here.
                let _priority = match answers_only {
                    true => crate::urgent::urgent(),
                    false => crate::urgent::ahead(),
                };
                let received = self.receive_main(stream, &installers);
                if received.is_err() {
                    closers.iter().for_each(Stream::shutdown);
                }
                received
            })
        });
        match failed.into_inner().unwrap_or_else(|p| p.into_inner()) {
            Some(e) => Err(e),
            None => received,
        }
    }

    /// Reads lane `n` on a `postcopy-lane-n` thread of `scope`; `fail` hears why it stopped.
    fn spawn_lane_reader<'scope, F: Fn(Error) + Sync>(
        &'scope self,
        scope: &'scope Scope<'scope, '_>,
        lane: Stream,
        n: u32,
        installers: &'scope Installers,
        cpu: &'scope CpuMeter,
        fail: &'scope F,
    ) {
        let spawned = std::thread::Builder::new()
            .name(format!("postcopy-lane-{n}"))
            .spawn_scoped(scope, move || {
                let _tracked = cpu.track(Work::Receive, Worker::Lane(n));
                let _ahead = crate::urgent::ahead();
                if let Err(e) = self.receive_lane(lane, n, installers) {
                    fail(e);
                }
            });
        if let Err(e) = spawned {
            fail(Error::vm_caused(
                "cannot start a lane's post-copy reader",
                e,
            ));
        }
    }

    /// The main connection: the answers to page requests (and, with no lanes, the pushes),
    /// up to the source's `PostcopyDone`.
    fn receive_main(&self, stream: &mut Stream, installers: &Installers) -> Result<()> {
        let mut receipts = None;
        loop {
            let m = match wire::read_frame(stream)? {
                Frame::Pages { header, len } => {
                    let pages = self.take_frame(stream, &header, len, installers)?;
                    if let Some(taken) =
                        receipts.as_mut().and_then(|r: &mut Receipts| r.took(pages))
                    {
                        self.reply(&taken)?;
                    }
                    continue;
                }
                Frame::Message(m) => m,
            };
            match m {
                Message::Receipts { every } => receipts = Some(Receipts::asked(every)?),
                Message::CheckpointTaken { seq } => {
                    let c = self.checkpointer.locked();
                    if let Some(c) = c.as_ref() {
                        c.confirmed(seq);
                    }
                }
                Message::PostcopyDone { .. } => return Ok(()),
                Message::Abort { reason } => return Err(Error::Peer(reason)),
                m => {
                    return Err(Error::out_of_turn("destination", m.name(), "Postcopy"));
                }
            }
        }
    }

    /// One lane's pushes, up to its `LaneEnd`.
    fn receive_lane(&self, mut stream: Stream, lane: u32, installers: &Installers) -> Result<()> {
        let mut pages = 0;
        let mut receipts = None;
        loop {
            match wire::read_frame(&mut stream)? {
                Frame::Pages { header, len } => {
                    let n = self.take_frame(&mut stream, &header, len, installers)?;
                    pages += n;
                    if let Some(taken) = receipts.as_mut().and_then(|r: &mut Receipts| r.took(n)) {
                        wire::write_message(&mut stream, &taken)?;
                    }
                }
                Frame::Message(Message::Receipts { every }) => {
                    receipts = Some(Receipts::asked(every)?);
                }
                Frame::Message(Message::LaneEnd { pages: n }) if n == pages => return Ok(()),
                Frame::Message(Message::LaneEnd { pages: n }) => {
                    return Err(Error::Protocol(format!(
                        "connection {lane}: the source pushed {n} pages after the switch but \
                         {pages} arrived"
                    )));
                }
                Frame::Message(Message::Abort { reason }) => return Err(Error::Peer(reason)),
                Frame::Message(other) => {
                    return Err(Error::Protocol(format!(
                        "connection {lane} carries post-copy's pushes only, not {}",
                        other.name()
                    )));
                }
            }
        }
    }

    /// Reads a page frame and installs it here if a vCPU waits for one of its pages (or no
    /// installer runs), else hands it to the installers. Returns how many pages it holds.
    fn take_frame(
        &self,
        stream: &mut Stream,
        header: &[u8; FRAME_HEADER_LEN],
        len: u32,
        installers: &Installers,
    ) -> Result<u64> {
        let mut frame = installers.buffers();
        read_frame_into(stream, &self.ram, header, len, &mut frame)?;
        let pages = frame.page_count();
        let awaited = frame.gfns().any(|gfn| self.asked.get(gfn));
        if awaited || !installers.running() {
            self.install_arrived(frame.pages())?;
        } else {
            installers.hand_over(frame)?;
        }
        Ok(pages)
    }

    /// Writes `msg` to the source on the attached connection (post-copy's one writer).
    pub fn reply(&self, msg: &Message) -> Result<()> {
        let mut slot = self.requests.locked();
        match slot.as_mut() {
            Some(s) => wire::write_message(s, msg),
            None => Err(Error::Protocol("no connection to the source".into())),
        }
    }

    /// How long the network faults so far waited, for metrics.
    pub fn fault_latency(&self) -> FaultLatency {
        let log = self.faults.locked();
        let mut f = FaultLatency::default();
        for ms in &log.latencies_ms {
            f.0.observe(ms / 1e3);
        }
        f
    }

    fn report(&self) -> PostcopyReport {
        let p = self.progress.locked();
        let log = self.faults.locked();
        let mut lat = log.latencies_ms.clone();
        lat.sort_by(f64::total_cmp);
        let pct = |q: f64| (!lat.is_empty()).then(|| lat[((lat.len() - 1) as f64 * q) as usize]);
        PostcopyReport {
            network_faults: log.network,
            zero_faults: log.zero,
            pages_before_access: p.pages.saturating_sub(log.network),
            duplicates: p.duplicates,
            fault_latency_p50_ms: pct(0.5),
            fault_latency_p99_ms: pct(0.99),
            fault_latency_max_ms: lat.last().copied(),
            resume_ms: self.resumed.elapsed().as_secs_f64() * 1e3,
            memory_checksum: p.checksum,
            timeline_10ms: self.timeline.locked().0.clone(),
        }
    }

    /// Installs the pages of one frame that are still missing; a copy of a page already
    /// here (a fault answered, a push that crossed it) counts as a duplicate. Returns how many
    /// pages the frame carried. Several connections' readers install side by side: each page
    /// is claimed once (`claimed`), and the counts are taken once a frame. Pages that follow
    /// one another, in guest memory and in the frame, go in together (`install_run`).
    fn install_arrived<'d>(
        &self,
        pages: impl IntoIterator<Item = (u64, Option<&'d [u8]>)>,
    ) -> Result<u64> {
        let (mut seen, mut duplicates, mut sum) = (0, 0, 0u64);
        let mut landed = Vec::new();
        let mut run: Vec<&'d [u8]> = Vec::new();
        // The run's first page, and the end of its memory region (a run stays within one).
        let (mut run_first, mut run_end) = (0, 0);
        for (gfn, data) in pages {
            seen += 1;
            if !self.pending.get(gfn) || self.claimed.set(gfn) {
                duplicates += 1;
                continue;
            }
            if let (true, Some(d)) = (self.summing, data) {
                sum = sum.wrapping_add(page_digest(gfn, d));
            }
            landed.push(gfn);
            let Some(d) = data else {
                self.install_run(run_first, &mut run)?;
                self.install(gfn, None)?;
                self.present.set(gfn);
                continue;
            };
            if !run_goes_on(run_first, run_end, &run, gfn, d) {
                self.install_run(run_first, &mut run)?;
                run_first = gfn;
                run_end = gfn + self.ram.pages_to_region_end(gfn);
            }
            run.push(d);
        }
        self.install_run(run_first, &mut run)?;
        {
            let mut p = self.progress.locked();
            p.pages += landed.len() as u64;
            p.duplicates += duplicates;
            if let Some(total) = p.checksum.as_mut() {
                *total = total.wrapping_add(sum);
            }
        }
        self.note_landed(&landed);
        Ok(seen)
    }

    /// Installs the pages of `run` (empty afterwards), from page `first` on, whose data lie one
    /// after another in memory: each `UFFDIO_COPY` copies and maps as many as it can (and wakes
    /// whoever waits on one of them), and stops before a page already in place, which then
    /// goes alone through `install` (and its check).
    fn install_run(&self, first: u64, run: &mut Vec<&[u8]>) -> Result<()> {
        let mut done = 0;
        while done < run.len() {
            let gfn = first + done as u64;
            let left = run.len() - done;
            let to = self.ram.host_ptr(gfn, left as u64)? as *mut libc::c_void;
            // SAFETY: `to` spans `left` pages of the registered range (`host_ptr` checked it),
            // and the data from `run[done]` on are `left` pages in one buffer (`run_goes_on`).
            let copied = unsafe {
                self.uffd
                    .copy(run[done].as_ptr().cast(), to, left * PAGE_SIZE, true)
            };
            match copied {
                // (A count the kernel cannot have copied goes the single page's way too.)
                Ok(bytes) | Err(userfaultfd::Error::PartiallyCopied(bytes))
                    if (PAGE_SIZE..=left * PAGE_SIZE).contains(&bytes) =>
                {
                    done += bytes / PAGE_SIZE;
                }
                _ => {
                    self.install(gfn, Some(run[done]))?;
                    done += 1;
                }
            }
        }
        for gfn in first..first + run.len() as u64 {
            self.present.set(gfn);
        }
        run.clear();
        Ok(())
    }

    /// Ends the wait of every fault on a page of `landed` (marked present) and counts them
    /// on the timeline; takes the fault handler's lock only for pages it asked for.
    fn note_landed(&self, landed: &[u64]) {
        fence(Ordering::SeqCst); // see `FaultPath::ask`
        let now = Instant::now();
        let mut waited = Vec::new();
        if landed.iter().any(|&gfn| self.asked.get(gfn)) {
            let mut log = self.faults.locked();
            for &gfn in landed {
                if let Some(t) = log.waiting.remove(&gfn) {
                    log.latencies_ms
                        .push(now.duration_since(t).as_secs_f64() * 1e3);
                    waited.push(t);
                }
            }
        }
        let mut timeline = self.timeline.locked();
        for &t in &waited {
            timeline.add(self.resumed, t, Timeline::NETWORK_FAULT, 1);
        }
        timeline.add(self.resumed, now, Timeline::REQUESTED, waited.len());
        timeline.add(
            self.resumed,
            now,
            Timeline::PUSHED,
            landed.len() - waited.len(),
        );
    }

    /// Puts one page in place (waking whoever faulted on it); `install_arrived` marks it.
    fn install(&self, pfn: u64, data: Option<&[u8]>) -> Result<()> {
        let page = self.ram.host_ptr(pfn, 1)? as *mut libc::c_void;
        // SAFETY: `page` is a page of the registered range; `data` is one page long.
        let done = unsafe {
            match data {
                Some(d) => self
                    .uffd
                    .copy(d.as_ptr() as *const _, page, PAGE_SIZE, true),
                None => self.uffd.zeropage(page, PAGE_SIZE, true),
            }
        };
        match done {
            Ok(_) => {}
            // Already mapped: a pending page is mapped only here, by the one reader that
            // claimed it, so the page must already hold this very content; anything else
            // would be a page the guest sees wrong, and is an error.
            Err(userfaultfd::Error::CopyFailed(e)) | Err(userfaultfd::Error::ZeropageFailed(e))
                if e as i32 == libc::EEXIST =>
            {
                let here = self.ram.page(pfn)?;
                let same = match data {
                    Some(d) => here == d,
                    None => crate::zero::is_zero_page(here),
                };
                if !same {
                    return Err(Error::vm(format!(
                        "page {pfn:#x} was already in place with other content than the source's"
                    )));
                }
            }
            Err(e) => return Err(Error::vm_caused(format!("installing page {pfn:#x}"), e)),
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::Receipts;
    use crate::wire::Message;

    #[test]
    fn a_receipt_goes_every_so_many_pages_with_the_running_count() {
        assert!(Receipts::asked(0).is_err(), "a receipt every 0 pages");
        let mut r = Receipts::asked(128).unwrap();
        assert_eq!(r.took(100), None);
        assert_eq!(r.took(28), Some(Message::Taken { pages: 128 }));
        assert_eq!(r.took(127), None);
        // A large frame crosses the mark once: one receipt with the count so far.
        assert_eq!(r.took(300), Some(Message::Taken { pages: 555 }));
        assert_eq!(r.took(127), None);
        assert_eq!(r.took(1), Some(Message::Taken { pages: 683 }));
    }
}
