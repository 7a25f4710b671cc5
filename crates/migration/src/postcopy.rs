//! Post-copy: the guest resumes on the destination before its memory has arrived.
//!
//! Destination: guest memory is registered with userfaultfd (missing pages) before the vCPUs
//! resume. A fault on a page the source never populated is resolved here with a zero page; any
//! other missing page is requested from the source on the connection's return direction, which
//! bulk pushes (going the other way) cannot delay. Pages that arrive — requested or pushed — are
//! installed with `UFFDIO_COPY`, which also wakes whoever waits for them. A VMM thread touching a
//! missing page (device emulation) faults the same way and waits: nothing is overwritten or lost.
//!
//! Source: serves requests first and pushes everything else in the planner's order (see
//! `prepaging`); each page leaves at most once.

use std::collections::HashMap;
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use userfaultfd::{Event, Uffd, UffdBuilder};

use crate::PAGE_SIZE;
use crate::bitmap::{AtomicBitmap, Bitmap};
use crate::error::{Error, Result};
use crate::memory::GuestRam;
use crate::pages::{
    FrameBuffers, PageSender, memory_checksum_of, page_digest, populated_pages, read_page_frame,
};
use crate::precopy::{DEFAULT_BATCH_PAGES, MigrationParams, Signals, unexpected};
use crate::prepaging::{Planner, Strategy};
use crate::protocol::{self, Control, Frame, PostcopyReport};
use crate::ratelimit::RateLimiter;
use crate::stats::{MigrationPhase, SharedStatus, lock};
use crate::transport::Endpoint;
use crate::transport::Stream;
use crate::vm::Migratable;

/// Pages pushed between two looks at the request queue.
const PUSH_BATCH: usize = 16;
/// How long the source waits for the destination's final word once everything is sent.
const COMPLETE_WAIT: Duration = Duration::from_secs(60);

/// Whether this host can serve post-copy (userfaultfd with kernel-mode faults, as KVM needs).
pub fn supported() -> bool {
    new_uffd().is_ok()
}

fn new_uffd() -> Result<Uffd> {
    UffdBuilder::new()
        .close_on_exec(true)
        .non_blocking(false)
        .user_mode_only(false)
        .create()
        .map_err(|e| Error::Vm(format!("userfaultfd: {e} (post-copy needs root)")))
}

// ------------------------------------------------------------------------------------------
// Source

/// What the source's reader thread hears from the destination during post-copy.
pub enum FromDestination {
    Request(u64),
    Complete(PostcopyReport),
    Report(Control),
    Failed(Error),
}

/// Reads the destination's messages on their own thread, so requests are seen while the
/// sender is busy pushing.
pub fn spawn_reader(mut stream: Stream) -> Receiver<FromDestination> {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::Builder::new()
        .name("postcopy-requests".into())
        .spawn(move || {
            loop {
                let msg = match protocol::read_control(&mut stream) {
                    Ok(Control::PageRequest { pfn }) => FromDestination::Request(pfn),
                    Ok(Control::PostcopyComplete(r)) => FromDestination::Complete(r),
                    Ok(other) => FromDestination::Report(other),
                    Err(e) => {
                        let _ = tx.send(FromDestination::Failed(e));
                        return;
                    }
                };
                if tx.send(msg).is_err() {
                    return;
                }
            }
        })
        .expect("spawn post-copy reader");
    rx
}

/// Counters of the source's post-copy phase.
#[derive(Clone, Copy, Debug, Default)]
pub struct SourceCounters {
    pub pushed: u64,
    pub requested: u64,
}

/// Where the source's pages go: the stream, and what it needs to send pages on it.
pub struct Outbound<'a> {
    pub stream: &'a mut Stream,
    pub ram: &'a GuestRam,
    pub limiter: &'a mut RateLimiter,
    pub sender: &'a mut PageSender,
}

impl Outbound<'_> {
    fn push(&mut self, pfn: u64) -> Result<()> {
        self.sender.push(self.stream, self.ram, pfn, self.limiter)
    }

    fn flush(&mut self) -> Result<()> {
        self.sender.flush(self.stream, self.ram, self.limiter)
    }
}

/// The source's post-copy phase.
pub struct SourcePhase<'a, 'o> {
    pub out: Outbound<'o>,
    pub events: &'a Receiver<FromDestination>,
    planner: Planner,
    counters: SourceCounters,
    /// Other messages that arrived meanwhile (the guest report).
    pub other: Vec<Control>,
}

impl<'a, 'o> SourcePhase<'a, 'o> {
    pub fn new(
        out: Outbound<'o>,
        events: &'a Receiver<FromDestination>,
        pending: Bitmap,
        strategy: Strategy,
    ) -> Self {
        Self {
            out,
            events,
            planner: Planner::new(pending, strategy),
            counters: SourceCounters::default(),
            other: Vec::new(),
        }
    }

    /// Sends every pending page, requests first, then waits for the destination's report.
    /// `progress` sees the counters and the pages left after each batch.
    pub fn run(
        &mut self,
        mut progress: impl FnMut(SourceCounters, u64),
    ) -> Result<(SourceCounters, PostcopyReport)> {
        while self.planner.remaining() > 0 {
            while let Ok(event) = self.events.try_recv() {
                if let Some(r) = self.handle(event)? {
                    return Err(Error::Protocol(format!(
                        "the destination reported completion with pages missing ({r:?})"
                    )));
                }
            }
            for _ in 0..PUSH_BATCH {
                let Some(pfn) = self.planner.next_page() else {
                    break;
                };
                self.out.push(pfn)?;
                self.counters.pushed += 1;
            }
            self.out.flush()?;
            progress(self.counters, self.planner.remaining());
        }
        protocol::write_control(
            self.out.stream,
            &Control::PostcopyDone {
                pages_sent: self.counters.pushed + self.counters.requested,
            },
        )?;
        let deadline = Instant::now() + COMPLETE_WAIT;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.events.recv_timeout(left) {
                Ok(event) => {
                    if let Some(r) = self.handle(event)? {
                        return Ok((self.counters, r));
                    }
                }
                Err(RecvTimeoutError::Timeout) => {
                    return Err(Error::Transport(
                        "the destination never confirmed that every page arrived".into(),
                    ));
                }
                Err(RecvTimeoutError::Disconnected) => {
                    return Err(Error::Transport("the destination went away".into()));
                }
            }
        }
    }

    /// A request is served at once (the window moves there); completion ends the phase.
    fn handle(&mut self, event: FromDestination) -> Result<Option<PostcopyReport>> {
        match event {
            FromDestination::Request(pfn) => {
                self.planner.recenter(pfn);
                if self.planner.take(pfn) {
                    self.out.push(pfn)?;
                    self.out.flush()?;
                    self.counters.requested += 1;
                }
                Ok(None)
            }
            FromDestination::Complete(r) => Ok(Some(r)),
            FromDestination::Report(other) => {
                self.other.push(other);
                Ok(None)
            }
            FromDestination::Failed(e) => Err(e),
        }
    }
}

// ------------------------------------------------------------------------------------------
// Destination

/// The destination's side of post-copy, armed before the guest resumes.
pub struct Destination {
    ram: GuestRam,
    /// Where page requests go; `None` while the connection is down (requests wait).
    requests: Arc<Mutex<Option<Stream>>>,
    stop: Arc<std::sync::atomic::AtomicBool>,
    progress: Mutex<Installed>,
    resumed: Instant,
    uffd: Arc<Uffd>,
    pending: Arc<Bitmap>,
    present: Arc<AtomicBitmap>,
    faults: Arc<Mutex<FaultLog>>,
}

/// What has been installed so far (it outlives an interrupted connection).
struct Installed {
    pages: u64,
    duplicates: u64,
    checksum: Option<u64>,
}

#[derive(Default)]
struct FaultLog {
    waiting: HashMap<u64, Instant>,
    latencies_ms: Vec<f64>,
    network: u64,
    zero: u64,
    timeline: Timeline,
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

    fn add(&mut self, since: Instant, what: usize) {
        let bucket = ((since.elapsed().as_millis() / 10) as usize).min(Self::MAX_BUCKETS - 1);
        if self.0.len() <= bucket {
            self.0.resize(bucket + 1, [0; 3]);
        }
        self.0[bucket][what] += 1;
    }
}

impl Destination {
    /// Drops stale copies of pending pages (those in `received`) and registers guest memory
    /// for missing-page faults. The vCPUs must still be parked.
    pub fn arm(ram: GuestRam, pending: Bitmap, received: &Bitmap, checksum: bool) -> Result<Self> {
        for pfn in pending.iter().filter(|&p| received.get(p)) {
            // A page received in an earlier round and dirtied since is stale: make it missing.
            let p = ram.host_ptr(pfn, 1)? as *mut libc::c_void;
            // SAFETY: a page of our own mapping, while no vCPU runs.
            unsafe {
                libc::madvise(p, PAGE_SIZE, libc::MADV_DONTNEED);
                libc::madvise(p, PAGE_SIZE, libc::MADV_REMOVE);
            }
        }
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
        for (range, host) in ram.host_regions() {
            uffd.register(host as *mut libc::c_void, range.len as usize)
                .map_err(|e| Error::Vm(format!("userfaultfd register: {e}")))?;
        }
        Ok(Self {
            ram,
            requests: Arc::new(Mutex::new(None)),
            stop: Arc::new(std::sync::atomic::AtomicBool::new(false)),
            progress: Mutex::new(Installed {
                pages: 0,
                duplicates: 0,
                checksum: base_checksum,
            }),
            resumed: Instant::now(),
            uffd: Arc::new(uffd),
            present: Arc::new(AtomicBitmap::new(pending.pages())),
            pending: Arc::new(pending),
            faults: Arc::new(Mutex::new(FaultLog::default())),
        })
    }

    /// Connects page requests to `stream` (a clone of the migration connection) and asks
    /// again for every page still awaited (after a reconnection they may have been lost).
    pub fn attach(&self, stream: Stream) {
        let mut slot = self.requests.lock().unwrap_or_else(|e| e.into_inner());
        *slot = Some(stream);
        let waiting: Vec<u64> = {
            let log = self.faults.lock().unwrap_or_else(|e| e.into_inner());
            log.waiting.keys().copied().collect()
        };
        if let Some(s) = slot.as_mut() {
            for pfn in waiting {
                let _ = protocol::write_control(s, &Control::PageRequest { pfn });
            }
        }
    }

    /// The connection is gone: requests wait for the next `attach`.
    pub fn detach(&self) {
        *self.requests.lock().unwrap_or_else(|e| e.into_inner()) = None;
    }

    /// The pages that are here (a bitmap, in `Bitmap` word layout).
    pub fn present_words(&self) -> Vec<u64> {
        let mut b = Bitmap::new(self.ram.gfn_end());
        for pfn in self.pending.iter().filter(|&p| self.present.get(p)) {
            b.set(pfn);
        }
        b.words().to_vec()
    }

    /// Resolves faults until post-copy ends: zero pages here, the rest requested.
    pub fn spawn_fault_handler(&self) {
        let resumed = self.resumed;
        let (uffd, ram, pending, present, faults, stop, requests) = (
            self.uffd.clone(),
            self.ram.clone(),
            self.pending.clone(),
            self.present.clone(),
            self.faults.clone(),
            self.stop.clone(),
            self.requests.clone(),
        );
        std::thread::Builder::new()
            .name("postcopy-faults".into())
            .spawn(move || {
                let mut poll = libc::pollfd {
                    fd: std::os::fd::AsRawFd::as_raw_fd(uffd.as_ref()),
                    events: libc::POLLIN,
                    revents: 0,
                };
                while !stop.load(std::sync::atomic::Ordering::Acquire) {
                    // SAFETY: one valid pollfd; bounded wait so `stop` is seen.
                    if unsafe { libc::poll(&mut poll, 1, 50) } <= 0 {
                        continue;
                    }
                    let Ok(Some(Event::Pagefault { addr, .. })) = uffd.read_event() else {
                        continue;
                    };
                    let Some(pfn) = ram.gfn_of_host(addr as u64) else {
                        continue;
                    };
                    let page = (addr as u64 & !(PAGE_SIZE as u64 - 1)) as *mut libc::c_void;
                    if present.get(pfn) {
                        let _ = uffd.wake(page, PAGE_SIZE);
                    } else if !pending.get(pfn) {
                        // SAFETY: a page of the registered range.
                        let _ = unsafe { uffd.zeropage(page, PAGE_SIZE, true) };
                        if !present.set(pfn) {
                            faults.lock().unwrap_or_else(|e| e.into_inner()).zero += 1;
                        }
                    } else {
                        let first = {
                            let mut log = faults.lock().unwrap_or_else(|e| e.into_inner());
                            let first = !log.waiting.contains_key(&pfn);
                            if first {
                                log.waiting.insert(pfn, Instant::now());
                                log.network += 1;
                                log.timeline.add(resumed, Timeline::NETWORK_FAULT);
                            }
                            first
                        };
                        if first {
                            let mut slot = requests.lock().unwrap_or_else(|e| e.into_inner());
                            if let Some(s) = slot.as_mut() {
                                let _ = protocol::write_control(s, &Control::PageRequest { pfn });
                            }
                        }
                    }
                }
            })
            .expect("spawn fault handler");
    }

    /// Installs pages from the stream until the source says it sent them all; then ends
    /// post-copy (the memory is ordinary again) and tells the source.
    pub fn receive_pages(&self, stream: &mut Stream) -> Result<PostcopyReport> {
        let mut scratch = FrameBuffers::default();
        let want = self.pending.count();
        loop {
            match protocol::read_frame(stream)? {
                Frame::Pages { header, len } => {
                    let pages = read_page_frame(stream, &self.ram, &header, len, &mut scratch)?;
                    for (pfn, data) in pages {
                        let mut p = self.progress.lock().unwrap_or_else(|e| e.into_inner());
                        if !self.pending.get(pfn) || self.present.get(pfn) {
                            p.duplicates += 1;
                            continue;
                        }
                        self.install(pfn, data)?;
                        p.pages += 1;
                        if let (Some(sum), Some(d)) = (p.checksum.as_mut(), data) {
                            *sum = sum.wrapping_add(page_digest(pfn, d));
                        }
                    }
                }
                Frame::Control(Control::PostcopyDone { .. }) => {
                    let installed = self
                        .progress
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .pages;
                    if installed != want {
                        return Err(Error::Protocol(format!(
                            "post-copy ended with {installed} of {want} pages installed"
                        )));
                    }
                    break;
                }
                Frame::Control(Control::Abort { reason }) => return Err(Error::Peer(reason)),
                Frame::Control(other) => {
                    return Err(Error::Protocol(format!(
                        "unexpected {other:?} during post-copy"
                    )));
                }
            }
        }
        self.stop.store(true, std::sync::atomic::Ordering::Release);
        self.detach(); // no request may interleave with the last word
        for (range, host) in self.ram.host_regions() {
            let _ = self
                .uffd
                .unregister(host as *mut libc::c_void, range.len as usize);
        }
        let report = self.report();
        protocol::write_control(stream, &Control::PostcopyComplete(report.clone()))?;
        Ok(report)
    }

    fn report(&self) -> PostcopyReport {
        let p = self.progress.lock().unwrap_or_else(|e| e.into_inner());
        let log = self.faults.lock().unwrap_or_else(|e| e.into_inner());
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
            timeline_10ms: log.timeline.0.clone(),
        }
    }

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
            // Already mapped (a racing zero-page resolution cannot happen for pending pages,
            // but the kernel says so when it does): the page is there.
            Err(userfaultfd::Error::CopyFailed(e)) | Err(userfaultfd::Error::ZeropageFailed(e))
                if e as i32 == libc::EEXIST => {}
            Err(e) => return Err(Error::Vm(format!("installing page {pfn:#x}: {e}"))),
        }
        self.present.set(pfn);
        let mut log = self.faults.lock().unwrap_or_else(|e| e.into_inner());
        let how = match log.waiting.remove(&pfn) {
            Some(t) => {
                log.latencies_ms.push(t.elapsed().as_secs_f64() * 1e3);
                Timeline::REQUESTED
            }
            None => Timeline::PUSHED,
        };
        log.timeline.add(self.resumed, how);
        Ok(())
    }
}

/// Carries on an interrupted post-copy on the destination: waits for the source on
/// `listener`, tells it which pages are here, and receives the rest.
pub fn resume_destination(
    dest: &Destination,
    listener: crate::transport::Listener,
) -> Result<PostcopyReport> {
    let mut stream = listener.accept()?;
    protocol::read_stream_header(&mut stream)?;
    match protocol::read_control(&mut stream)? {
        Control::ResumePostcopy => {}
        other => {
            return Err(Error::Protocol(format!(
                "expected ResumePostcopy on the new connection, got {other:?}"
            )));
        }
    }
    protocol::write_control(
        &mut stream,
        &Control::ResumeFrom {
            words: dest.present_words(),
        },
    )?;
    dest.attach(stream.try_clone()?);
    let result = dest.receive_pages(&mut stream);
    if result.is_err() {
        dest.detach();
    }
    result
}

// ------------------------------------------------------------------------------------------
// Recovery (source side; the destination's is `resume_destination` above)

/// Carries on a post-copy whose connection dropped after the switch: connects to the
/// destination's new listener, learns which pages it has, and sends the rest.
pub fn resume_postcopy(
    vm: &dyn Migratable,
    endpoint: &Endpoint,
    params: &MigrationParams,
    status: &SharedStatus,
    signals: &Signals,
) -> Result<()> {
    let pending = signals
        .leftover()
        .take()
        .ok_or_else(|| Error::Param("there is no interrupted post-copy to resume".into()))?;
    let result = resume_with(vm, endpoint, params, status, &pending);
    match &result {
        Ok(()) => {}
        Err(e) => {
            *signals.leftover() = Some(pending);
            let mut s = lock(status);
            s.phase = MigrationPhase::Unconfirmed;
            s.error = Some(format!("resuming post-copy failed: {e}"));
        }
    }
    result
}

fn resume_with(
    vm: &dyn Migratable,
    endpoint: &Endpoint,
    params: &MigrationParams,
    status: &SharedStatus,
    pending: &Bitmap,
) -> Result<()> {
    let ram = vm.ram();
    let mut stream = endpoint.connect()?;
    protocol::write_stream_header(&mut stream)?;
    protocol::write_control(&mut stream, &Control::ResumePostcopy)?;
    let here = match protocol::read_control(&mut stream)? {
        Control::ResumeFrom { words } => Bitmap::from_words(words, ram.gfn_end()),
        other => return Err(unexpected("ResumeFrom", &other)),
    };
    let mut todo = pending.clone();
    for pfn in here.iter() {
        todo.unset(pfn);
    }
    {
        let mut s = lock(status);
        s.phase = MigrationPhase::Switchover;
        s.error = None;
        s.pages_remaining = todo.count();
    }
    let events = spawn_reader(stream.try_clone()?);
    let mut limiter = RateLimiter::new(params.max_bandwidth_mbps);
    let mut sender = PageSender::new(limiter.batch_pages(DEFAULT_BATCH_PAGES));
    sender.checked = true;
    let out = Outbound {
        stream: &mut stream,
        ram: &ram,
        limiter: &mut limiter,
        sender: &mut sender,
    };
    let mut phase = SourcePhase::new(out, &events, todo, params.prepaging);
    let (counters, report) = phase.run(|_, left| lock(status).pages_remaining = left)?;
    let mut s = lock(status);
    s.pages_pushed += counters.pushed;
    s.pages_requested += counters.requested;
    s.pages_full += sender.counters.full;
    s.pages_zero += sender.counters.zero;
    s.bytes_on_wire += sender.counters.bytes;
    s.memory_checksum_destination = report.memory_checksum;
    s.postcopy_report = Some(report);
    s.phase = MigrationPhase::Completed;
    s.note = Some("post-copy resumed over a new connection".into());
    Ok(())
}
