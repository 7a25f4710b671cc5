//! The engine against a fake VM: plain memory, a scripted writer standing in for the guest,
//! and an exact dirty log as the oracle. Fast, no KVM.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use migration::bitmap::Bitmap;
use migration::destination::{FaultIn, Source};
use migration::wire::{Message, StreamMode};
use migration::{
    AutoConverge, Compression, Endpoint, GuestRam, GuestReport, Incoming, Migratable,
    MigrationParams, Mode, Outgoing, Phase, RamRange, Status, StatusBoard, VmDescriptor,
};

/// Guest RAM: pages [0, LOW) and [HIGH, HIGH + LOW), with a hole between them (the shape of
/// a real machine's RAM below and above its MMIO hole).
const LOW: u64 = 2048;
const HIGH: u64 = 3072;
/// RAM pages in all.
const PAGES: u64 = 2 * LOW;
/// One past the last page number.
const GFN_END: u64 = HIGH + LOW;

struct Mapping(*mut u8, usize);
// SAFETY: a private anonymous mapping owned by this value; threads share it as guest RAM.
unsafe impl Send for Mapping {}
// SAFETY: as for `Send`.
unsafe impl Sync for Mapping {}
impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: the mapping this value owns, unmapped once.
        unsafe { libc::munmap(self.0 as *mut _, self.1) };
    }
}

fn map(len: usize) -> Mapping {
    // SAFETY: a fresh anonymous mapping; nothing else is touched.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
            0,
        )
    };
    assert_ne!(p, libc::MAP_FAILED);
    Mapping(p as *mut u8, len)
}

/// vCPU states and device state, as loaded.
type LoadedState = (Vec<Vec<u8>>, Vec<u8>);

/// A VM whose "guest" is a thread writing pages in a scripted order.
struct FakeVm {
    low: Mapping,
    high: Mapping,
    dirty: Mutex<Bitmap>,
    logging: AtomicBool,
    paused: AtomicBool,
    /// Guest writes under way (`try_write`): a pause waits for them, as KVM parks vCPUs.
    writing: AtomicU64,
    writes: AtomicU64,
    state: Mutex<Option<LoadedState>>,
    /// Auto-converge: percent of the time the guest sleeps, and the most it was ever asked.
    throttle: AtomicU64,
    throttle_max: AtomicU64,
    /// Every `save_vcpus` (the source's switch, each checkpoint on a destination): how many
    /// so far, and the pages in memory at the last one (the oracle for checkpoints).
    saved: Mutex<(u64, Vec<Option<Vec<u8>>>)>,
    /// Its devices were let go for the switch (and not taken back by a resume).
    released: AtomicBool,
    /// Every `hold_page_discards`, in order.
    holds: Mutex<Vec<bool>>,
    /// What `given_back` answers.
    given: Mutex<Option<Bitmap>>,
    /// Free page hinting: the pages the guest hints at a session's start (none: it has no
    /// driver), and every start, end and state save in order.
    hinted: Mutex<Vec<u64>>,
    hint_events: Mutex<Vec<&'static str>>,
    /// Pages the guest writes as the source first harvests the dirty log (after round 0).
    written_at_harvest: Mutex<Vec<u64>>,
    /// Pages the guest writes right after the dirty log starts (before round 0 sends them).
    written_at_log_on: Mutex<Vec<u64>>,
}

impl FakeVm {
    fn new() -> Arc<Self> {
        Arc::new(Self {
            low: map(LOW as usize * 4096),
            high: map(LOW as usize * 4096),
            dirty: Mutex::new(Bitmap::new(GFN_END)),
            logging: AtomicBool::new(false),
            paused: AtomicBool::new(true),
            writing: AtomicU64::new(0),
            writes: AtomicU64::new(0),
            state: Mutex::new(None),
            throttle: AtomicU64::new(0),
            throttle_max: AtomicU64::new(0),
            saved: Mutex::new((0, Vec::new())),
            released: AtomicBool::new(false),
            holds: Mutex::new(Vec::new()),
            given: Mutex::new(None),
            hinted: Mutex::new(Vec::new()),
            hint_events: Mutex::new(Vec::new()),
            written_at_harvest: Mutex::new(Vec::new()),
            written_at_log_on: Mutex::new(Vec::new()),
        })
    }

    /// The guest's write: a whole page stamped with (page, generation), logged as dirty.
    fn write_page(&self, pfn: u64, generation: u64) {
        let mut page = [0u8; 4096];
        for (i, chunk) in page.chunks_exact_mut(8).enumerate() {
            chunk.copy_from_slice(&(pfn << 40 | generation << 12 | i as u64).to_le_bytes());
        }
        self.ram().write_page(pfn, &page).unwrap();
        if self.logging.load(Ordering::Acquire) {
            self.dirty.lock().unwrap().set(pfn);
        }
        self.writes.fetch_add(1, Ordering::Relaxed);
    }

    /// Both RAM regions, low then high.
    fn memory(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(PAGES as usize * 4096);
        for m in [&self.low, &self.high] {
            // SAFETY: the whole mapping, alive as long as `self`.
            v.extend_from_slice(unsafe { std::slice::from_raw_parts(m.0, m.1) });
        }
        v
    }

    /// Each RAM page, low then high, or `None` where it is not in memory (in post-copy: not
    /// arrived yet; reading it would wait for it).
    fn resident_pages(&self) -> Vec<Option<Vec<u8>>> {
        let mut pages = Vec::with_capacity(PAGES as usize);
        for m in [&self.low, &self.high] {
            let mut resident = vec![0u8; m.1 / 4096];
            // SAFETY: the whole mapping, alive as long as `self`; one byte per page.
            let r = unsafe { libc::mincore(m.0 as *mut _, m.1, resident.as_mut_ptr()) };
            assert_eq!(r, 0, "mincore");
            for (i, &r) in resident.iter().enumerate() {
                // SAFETY: a page of the mapping, read only when resident (never faults).
                pages.push((r & 1 == 1).then(|| unsafe {
                    std::slice::from_raw_parts(m.0.add(i * 4096), 4096).to_vec()
                }));
            }
        }
        pages
    }

    /// The guest's write unless the VM is paused (then false: nothing written). A pause that
    /// begins meanwhile waits for it to land, so that no write slips past a pause.
    fn try_write(&self, pfn: u64, generation: u64) -> bool {
        self.writing.fetch_add(1, Ordering::SeqCst);
        let running = !self.paused.load(Ordering::SeqCst);
        if running {
            self.write_page(pfn, generation);
        }
        self.writing.fetch_sub(1, Ordering::SeqCst);
        running
    }

    /// Runs a writer over RAM pages `[lo, hi)` (a stride walk; page numbers inside the hole
    /// land above it) while the VM is not paused.
    fn start_guest(self: &Arc<Self>, lo: u64, hi: u64, stop: Arc<AtomicBool>) -> JoinHandle<()> {
        self.paused.store(false, Ordering::Release);
        let vm = self.clone();
        std::thread::spawn(move || {
            let mut generation = 1;
            let mut i = 0u64;
            while !stop.load(Ordering::Acquire) {
                let pfn = ram_page(lo + (i * 7919) % (hi - lo));
                if !vm.try_write(pfn, generation) {
                    std::thread::sleep(Duration::from_micros(200));
                    continue;
                }
                i += 1;
                if i.is_multiple_of(hi - lo) {
                    generation += 1;
                }
                if i.is_multiple_of(64) {
                    // Throttled, it sleeps longer: running (100 - p) % of the time.
                    let p = vm.throttle.load(Ordering::Relaxed).min(99);
                    std::thread::sleep(Duration::from_micros(50 * 100 / (100 - p)));
                }
            }
        })
    }
}

/// The config the fake VMM keeps of its VM, which every migration carries (`Config`).
const FAKE_CONFIG: &str = r#"{"profile": "fake"}"#;

impl Migratable for FakeVm {
    fn descriptor(&self) -> VmDescriptor {
        VmDescriptor {
            memory_bytes: PAGES * 4096,
            ranges: self.ram().ranges(),
            vcpus: 2,
            memory_backend: "anonymous".into(),
            running: self.is_running(),
            devices: Vec::new(),
            config: Some(FAKE_CONFIG.into()),
        }
    }
    fn ram(&self) -> GuestRam {
        let low = RamRange {
            gpa: 0,
            len: LOW * 4096,
        };
        let high = RamRange {
            gpa: HIGH * 4096,
            len: LOW * 4096,
        };
        // SAFETY: both mappings live as long as the VM, which outlives every migration.
        unsafe { GuestRam::new(&[(low, self.low.0), (high, self.high.0)]) }.unwrap()
    }
    fn is_running(&self) -> bool {
        !self.paused.load(Ordering::Acquire)
    }
    fn start_dirty_log(&self) -> migration::Result<()> {
        self.dirty.lock().unwrap().clear();
        self.logging.store(true, Ordering::Release);
        for pfn in std::mem::take(&mut *self.written_at_log_on.lock().unwrap()) {
            self.write_page(pfn, 1);
        }
        Ok(())
    }
    fn forget_dirty(&self, first_gfn: u64, words: &[u64]) -> migration::Result<()> {
        let mut dirty = self.dirty.lock().unwrap();
        for (i, &w) in words.iter().enumerate() {
            for bit in (0..64).filter(|b| w & (1 << b) != 0) {
                dirty.unset(first_gfn + 64 * i as u64 + bit);
            }
        }
        Ok(())
    }
    fn take_dirty(&self) -> migration::Result<Bitmap> {
        for pfn in std::mem::take(&mut *self.written_at_harvest.lock().unwrap()) {
            self.write_page(pfn, 1);
        }
        let mut d = self.dirty.lock().unwrap();
        Ok(std::mem::replace(&mut *d, Bitmap::new(GFN_END)))
    }
    fn stop_dirty_log(&self) -> migration::Result<()> {
        self.logging.store(false, Ordering::Release);
        Ok(())
    }
    fn pause(&self) -> migration::Result<()> {
        // Synchronous, as KVM parks vCPUs: a write under way lands first (bounded wait: a
        // write that waits on a post-copy page comes once the page does).
        self.paused.store(true, Ordering::SeqCst);
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while self.writing.load(Ordering::SeqCst) != 0 {
            assert!(
                std::time::Instant::now() < deadline,
                "a guest write never landed"
            );
            std::thread::yield_now();
        }
        Ok(())
    }
    fn resume(&self) -> migration::Result<()> {
        self.paused.store(false, Ordering::Release);
        self.released.store(false, Ordering::Release);
        Ok(())
    }
    fn device_files(&self) -> Vec<Option<std::os::fd::RawFd>> {
        Vec::new() // no devices
    }
    fn log_disk_writes(&self) -> migration::Result<Vec<migration::CopiedDisk>> {
        Ok(Vec::new()) // no disks
    }
    fn end_disk_logs(&self) {}
    fn disk_targets(&self, slots: &[u32]) -> migration::Result<Vec<std::fs::File>> {
        Err(migration::Error::vm(format!(
            "no disks here to take slots {slots:?}"
        )))
    }

    fn release_devices(&self, _keep_locks: bool) -> migration::Result<()> {
        assert!(
            self.paused.load(Ordering::Acquire),
            "devices let go of a running VM"
        );
        self.released.store(true, Ordering::Release);
        Ok(())
    }
    fn set_throttle(&self, percent: u8) -> migration::Result<()> {
        self.throttle.store(u64::from(percent), Ordering::Relaxed);
        self.throttle_max
            .fetch_max(u64::from(percent), Ordering::Relaxed);
        Ok(())
    }
    fn save_vcpus(&self) -> migration::Result<Vec<Vec<u8>>> {
        self.hint_events.lock().unwrap().push("save");
        let mut saved = self.saved.lock().unwrap();
        *saved = (saved.0 + 1, self.resident_pages());
        Ok(vec![b"cpu0".to_vec(), b"cpu1".to_vec()])
    }
    fn save_devices(&self) -> migration::Result<Vec<u8>> {
        Ok(b"devices".to_vec())
    }
    fn load_state(&self, vcpus: &[Vec<u8>], devices: &[u8]) -> migration::Result<()> {
        *self.state.lock().unwrap() = Some((vcpus.to_vec(), devices.to_vec()));
        Ok(())
    }
    fn guest_progress_rate(&self, _: u64, _: u64) -> Option<f64> {
        None
    }
    fn guest_report(&self, _: u64, _: u64) -> GuestReport {
        GuestReport::default()
    }
    fn hold_page_discards(&self, hold: bool) {
        self.holds.lock().unwrap().push(hold);
    }
    fn given_back(&self) -> Option<Bitmap> {
        self.given.lock().unwrap().clone()
    }
    /// The guest hands its free pages over at once: given back to the host (discarded), and
    /// logged as written, as a VMM logs a page that held data.
    fn start_free_page_hints(&self) -> bool {
        let hinted = std::mem::take(&mut *self.hinted.lock().unwrap());
        if hinted.is_empty() && self.hint_events.lock().unwrap().is_empty() {
            return false;
        }
        self.hint_events.lock().unwrap().push("start");
        for &pfn in &hinted {
            self.ram().discard(pfn, 1).unwrap();
            if self.logging.load(Ordering::Acquire) {
                self.dirty.lock().unwrap().set(pfn);
            }
        }
        true
    }
    fn free_page_hints_finished(&self) -> bool {
        true
    }
    fn end_free_page_hints(&self) {
        self.hint_events.lock().unwrap().push("end");
    }
}

/// The page number of RAM page `i` (counting RAM only, across the hole).
fn ram_page(i: u64) -> u64 {
    if i < LOW { i } else { HIGH + (i - LOW) }
}

struct Run {
    source_status: Status,
    result: migration::Result<()>,
    dest: Option<Arc<FakeVm>>,
    dest_error: Option<String>,
    dest_status: Status,
}

/// Migrates `src` to a fresh fake destination over a Unix socket. `during` runs on the
/// destination VM the moment it resumes (a guest touching its memory).
fn migrate_with(
    src: &Arc<FakeVm>,
    params: MigrationParams,
    refuse: Option<&'static str>,
    during: fn(Arc<FakeVm>),
) -> Run {
    migrate_to(src, params, refuse, during, FaultIn::Auto)
}

/// `migrate_with` to a destination whose round 0 meets fresh memory as `fault_in` says.
fn migrate_to(
    src: &Arc<FakeVm>,
    params: MigrationParams,
    refuse: Option<&'static str>,
    during: fn(Arc<FakeVm>),
    fault_in: FaultIn,
) -> Run {
    let dir = tempfile::tempdir().unwrap();
    let endpoint: Endpoint = format!("unix:{}", dir.path().join("m.sock").display())
        .parse()
        .unwrap();
    let source = Source::listen(&endpoint, None).unwrap();
    let dest_board = StatusBoard::default();
    let board = dest_board.clone();
    let dest_thread = std::thread::spawn(move || {
        let incoming = Incoming::faulting_in(board, None, fault_in);
        incoming.receive(
            source,
            &|| false,
            |d, _| {
                // Every stream carries the VM's config to whoever builds it.
                assert_eq!(d.config.as_deref(), Some(FAKE_CONFIG));
                match refuse {
                    Some(why) => Err(migration::Error::vm(why)),
                    None => Ok(FakeVm::new()),
                }
            },
            |vm| {
                let vm = vm.clone();
                std::thread::spawn(move || during(vm));
            },
        )
    });
    let (board, error) = send_and_wait(src, endpoint, params);
    let result = error.map_or(Ok(()), |e| Err(migration::Error::Peer(e)));
    let dest = dest_thread.join().unwrap();
    Run {
        source_status: board.read(),
        result,
        dest_error: dest.as_ref().err().map(|e| e.to_string()),
        dest: dest.ok().flatten(),
        dest_status: dest_board.read(),
    }
}

fn migrate(src: &Arc<FakeVm>, params: MigrationParams, refuse: Option<&'static str>) -> Run {
    migrate_with(src, params, refuse, |_| {})
}

/// Over one connection and over several: pages travel on the connection of their 2 MiB
/// chunk, so the guest's last write to a page is what arrives, whatever the interleaving.
#[test]
fn precopy_moves_memory_exactly_while_the_guest_writes() {
    for connections in [1, 2, 4] {
        precopy_over(connections, Compression::None, None, None);
    }
}

/// Round 0's pages meet the destination's fresh memory faulted in ahead by threads of its own,
/// or installed by the receivers with `UFFDIO_COPY` (each the default on some hosts): either
/// way every page, and the last copy of each, arrives, over one connection and over three.
#[test]
fn round_0_lands_the_same_faulted_in_ahead_or_installed() {
    for fault_in in [FaultIn::Ahead, FaultIn::Install] {
        for connections in [1, 3] {
            let params = MigrationParams {
                max_downtime_ms: 1,
                max_rounds: 6,
                connections,
                ..Default::default()
            };
            let (src, run) = migrate_while_writing_to(params, fault_in);
            run.result.expect("migration");
            let dest = run.dest.expect("destination VM");
            assert!(
                src.memory() == dest.memory(),
                "{fault_in:?}, {connections} connections: the source's memory at the switch"
            );
            // Faulting in ahead runs threads of its own; installing runs in the receivers.
            let cpu = &run.dest_status.report.cpu;
            let prefault = cpu.iter().any(|u| u.work == "prefault");
            assert_eq!(
                prefault,
                fault_in == FaultIn::Ahead,
                "{fault_in:?}: {cpu:?}"
            );
        }
    }
}

/// Every codec, and `auto`, over one connection and over two, compressed by each sender
/// or by more threads than connections (shared out unevenly: 3 for one, 5 for two).
#[test]
fn compressed_precopy_moves_memory_exactly_while_the_guest_writes() {
    for compression in ["lz4", "zstd", "auto"] {
        for (connections, threads) in [(1, None), (2, None), (1, Some(3)), (2, Some(5))] {
            let compression = compression.parse().unwrap();
            // `auto` compresses where the link is slower than the codecs: 200 Mbit/s.
            let link = (compression == Compression::Auto).then_some(200);
            let s = precopy_over(connections, compression, threads, link);
            assert_eq!(s.migration_threads, threads.unwrap_or(connections));
            let c = &s.progress.compression;
            assert!(
                c.frames_lz4 + c.frames_zstd > 0 && c.bytes_out < c.bytes_in,
                "{compression:?}: {c:?}"
            );
        }
    }
}

/// A source whose every 4th page holds data (on both sides of the hole; most are never
/// touched) and whose guest writes 512 pages around the hole all along; migrated with `params`.
fn migrate_while_writing(params: MigrationParams) -> (Arc<FakeVm>, Run) {
    migrate_while_writing_to(params, FaultIn::Auto)
}

/// `migrate_while_writing` to a destination whose round 0 meets fresh memory as `fault_in`
/// says.
fn migrate_while_writing_to(params: MigrationParams, fault_in: FaultIn) -> (Arc<FakeVm>, Run) {
    let src = FakeVm::new();
    for i in (0..PAGES).step_by(4) {
        src.write_page(ram_page(i), 0);
    }
    let stop = Arc::new(AtomicBool::new(false));
    let guest = src.start_guest(LOW - 256, LOW + 256, stop.clone());
    let run = migrate_to(&src, params, None, |_| {}, fault_in);
    stop.store(true, Ordering::Release);
    guest.join().unwrap();
    if run.result.is_ok() {
        assert!(
            src.released.load(Ordering::Acquire),
            "the source let go of its devices at the switch, for the destination to take"
        );
    }
    (src, run)
}

fn precopy_over(
    connections: u32,
    compression: Compression,
    threads: Option<u32>,
    max_bandwidth_mbps: Option<u64>,
) -> Status {
    let (src, run) = migrate_while_writing(MigrationParams {
        max_downtime_ms: 1,
        max_rounds: 6,
        connections,
        compression,
        migration_threads: threads,
        max_bandwidth_mbps,
        ..Default::default()
    });
    run.result.expect("migration");
    let dest = run.dest.expect("destination VM");
    assert!(
        src.paused.load(Ordering::Acquire),
        "the source stays paused after handing over"
    );
    assert!(
        src.memory() == dest.memory(),
        "{connections} connections: destination memory equals the source's at the switch"
    );
    assert!(dest.is_running(), "a running VM arrives running");
    let s = run.source_status;
    assert_eq!(s.phase, Phase::Completed);
    assert!(s.progress.pages.skipped_unpopulated >= PAGES - PAGES / 4 - 512);
    assert!(s.progress.rounds.len() >= 2, "{:?}", s.progress.rounds);
    assert!(s.progress.pages.resent > 0);
    assert!(s.report.downtime.is_some() && s.report.destination_downtime.is_some());
    assert_eq!(run.dest_status.phase, Phase::Completed);
    let state = dest.state.lock().unwrap().clone().unwrap();
    assert_eq!(state.0, vec![b"cpu0".to_vec(), b"cpu1".to_vec()]);
    assert_eq!(state.1, b"devices".to_vec());
    // Each side's CPU by work: a sender per connection (its rounds added up), packers only
    // where threads outnumber the connections, a receiver per connection.
    let used = |s: &Status, work: &str| {
        s.report
            .cpu
            .iter()
            .find(|u| u.work == work)
            .map(|u| (u.threads, u.cpu_s, u.busiest))
    };
    let (senders, cpu_s, busiest) = used(&s, "send").expect("senders tracked");
    assert_eq!(senders, connections, "{:?}", s.report.cpu);
    assert!(
        cpu_s > 0.0 && busiest > 0.0 && busiest <= 1.01,
        "{:?}",
        s.report.cpu
    );
    // A connection given one thread compresses on its sender; more, on packers of its own.
    let asked = MigrationParams {
        connections,
        migration_threads: threads,
        ..Default::default()
    };
    let packing: u32 = (0..connections)
        .map(|lane| asked.packers_of(lane) as u32)
        .filter(|&n| n > 1 && compression != Compression::None)
        .sum();
    let packers = used(&s, "pack").map_or(0, |t| t.0);
    assert_eq!(packers, packing, "{:?}", s.report.cpu);
    let receivers = used(&run.dest_status, "receive").map(|t| t.0);
    assert_eq!(
        receivers,
        Some(connections),
        "{:?}",
        run.dest_status.report.cpu
    );
    s
}

/// A guest that rewrites its working set faster than a 40 Mbit/s link moves it (its pages
/// sent plain and whole: compressed or as deltas they would fit the link): auto-converge
/// (early, or when-stalled, the default) throttles it harder round after round, and releases
/// it when the migration ends, whether it completes or fails (here: runs out of time
/// mid-rounds).
#[test]
fn auto_converge_throttles_in_steps_and_releases() {
    for (when, max_rounds, timeout_s) in [
        (AutoConverge::Early, 5, 600),
        (AutoConverge::Early, 30, 3),
        (AutoConverge::WhenStalled, 5, 600),
    ] {
        let (src, run) = migrate_while_writing(MigrationParams {
            max_downtime_ms: 1,
            max_rounds,
            timeout_s,
            max_bandwidth_mbps: Some(40),
            auto_converge: when,
            compression: Compression::None,
            delta_cache_mb: 0,
            ..Default::default()
        });
        let most = src.throttle_max.load(Ordering::Relaxed);
        assert!(most >= 20, "the guest was slowed down: {most}");
        assert_eq!(src.throttle.load(Ordering::Relaxed), 0, "and released");
        if timeout_s < 600 {
            let e = run.result.expect_err("out of time");
            assert!(e.to_string().contains("timed out"), "{e}");
            assert!(!src.paused.load(Ordering::Acquire), "the source runs on");
            continue;
        }
        run.result.expect("migration");
        let s = run.source_status;
        let steps: Vec<u8> = s
            .progress
            .rounds
            .iter()
            .map(|r| r.throttle_percent)
            .collect();
        assert_eq!(steps[0], 0, "round 0 runs free");
        assert!(
            steps.windows(2).all(|w| w[0] <= w[1]),
            "in steps: {steps:?}"
        );
        assert_eq!(u64::from(s.report.throttle_percent_max), most);
        assert!(src.memory() == run.dest.expect("destination").memory());
    }
}

/// With auto-converge off the same guest is never slowed: after rounds without progress the
/// source stops and copies the rest, and says it missed the budget.
#[test]
fn without_auto_converge_a_stalled_precopy_stops_and_copies() {
    let (src, run) = migrate_while_writing(MigrationParams {
        max_downtime_ms: 1,
        max_bandwidth_mbps: Some(40),
        auto_converge: AutoConverge::Off,
        compression: Compression::None,
        delta_cache_mb: 0,
        ..Default::default()
    });
    run.result.expect("migration");
    assert_eq!(src.throttle_max.load(Ordering::Relaxed), 0, "never slowed");
    let s = run.source_status;
    assert_eq!(s.report.converged, Some(false), "{:?}", s.note);
    assert!(
        s.note.as_deref().unwrap_or("").contains("stop-and-copy"),
        "{:?}",
        s.note
    );
    assert!(src.memory() == run.dest.expect("destination").memory());
}

/// Post-copy and hybrid through the engine alone: the destination VM's "guest" reads pages
/// the moment it resumes (faults that must be served by request), the rest is pushed.
#[test]
fn postcopy_and_hybrid_move_every_page_and_serve_faults() {
    for (mode, connections, compression, threads) in [
        (Mode::Postcopy, 1, "none", None),
        (Mode::Hybrid, 1, "none", None),
        (Mode::Postcopy, 3, "none", None),
        (Mode::Hybrid, 3, "none", None),
        (Mode::Postcopy, 1, "lz4", None),
        (Mode::Postcopy, 1, "lz4", Some(2)),
        (Mode::Hybrid, 2, "zstd", None),
        (Mode::Hybrid, 2, "zstd", Some(4)),
        (Mode::Hybrid, 2, "auto", None),
    ] {
        let src = FakeVm::new();
        for i in 0..PAGES {
            src.write_page(ram_page(i), 3);
        }
        for i in (0..PAGES).step_by(7) {
            src.ram().zero_page(ram_page(i)).unwrap();
        }
        // Hybrid post-copies what the guest dirtied after its one round.
        let stop = Arc::new(AtomicBool::new(false));
        let guest = src.start_guest(LOW - 512, LOW + 512, stop.clone());
        let run = migrate_with(
            &src,
            MigrationParams {
                mode,
                connections,
                compression: compression.parse().unwrap(),
                migration_threads: threads,
                ..Default::default()
            },
            None,
            |vm| {
                // Touch pages far apart, on both sides of the hole: each faults.
                let ram = vm.ram();
                for i in (0..PAGES).rev().step_by(97) {
                    let page = ram.page(ram_page(i)).unwrap();
                    std::hint::black_box(page[0]);
                }
            },
        );
        stop.store(true, Ordering::Release);
        guest.join().unwrap();
        run.result.expect("migration");
        let dest = run.dest.expect("destination VM");
        assert!(
            src.memory() == dest.memory(),
            "{mode:?}: every page arrived"
        );
        assert_eq!(
            *dest.holds.lock().unwrap(),
            [true, false],
            "{mode:?}: no page given back while post-copy held memory, and only then"
        );
        assert!(src.holds.lock().unwrap().is_empty(), "{mode:?}");
        let s = run.source_status;
        assert!(s.postcopy, "{mode:?}");
        assert_eq!(s.phase, Phase::Completed);
        let r = s.report.postcopy_report.expect("post-copy report");
        let moved = s.progress.pages.pushed + s.progress.pages.requested;
        if connections == 1 {
            assert_eq!(r.duplicates, 0, "{mode:?}: each page crossed once");
        } else {
            // A fault on a page whose push is on its way is answered too; the destination
            // keeps one copy.
            assert!(
                r.duplicates <= s.progress.pages.requested,
                "{mode:?}: a second copy only for a request: {r:?}"
            );
            assert_eq!(
                s.progress.pages.pushed_on_lanes, s.progress.pages.pushed,
                "{mode:?}: the extra connections pushed"
            );
        }
        match mode {
            Mode::Postcopy => {
                assert_eq!(
                    moved - r.duplicates,
                    PAGES,
                    "{mode:?} over {connections}: every page after the switch, once kept \
                     ({r:?}, {:?})",
                    s.progress.pages
                );
                assert!(
                    r.network_faults > 0,
                    "the guest's reads were served by request"
                );
            }
            _ => assert!(
                moved > 0 && moved - r.duplicates <= 1024,
                "only the dirtied pages: {moved}, {} of them twice",
                r.duplicates
            ),
        }
        assert_eq!(run.dest_status.phase, Phase::Completed);
    }
}

/// Pages the guest gave back (its balloon's) and never populated since are skipped and
/// counted as free; one it took back and wrote is sent.
#[test]
fn pages_given_back_are_skipped_and_counted() {
    let src = FakeVm::new();
    for pfn in 0..64 {
        src.write_page(pfn, 0);
    }
    let mut given = Bitmap::new(GFN_END);
    for pfn in (32..64).chain(100..200) {
        given.set(pfn); // 32..64 were written since: they hold data
    }
    *src.given.lock().unwrap() = Some(given);
    let p = migrate_warm(&src);
    assert_eq!((p.full, p.skipped_free), (64, 100));
    assert_eq!(p.skipped_unpopulated, PAGES - 64);
}

/// Free page hinting: the pages the guest hints before round 0 are given back, left out by
/// the scan and never sent, not even as zero markers; hinting ends before the state is saved.
#[test]
fn hinted_pages_stay_off_the_wire_and_hinting_ends_before_the_state() {
    let src = FakeVm::new();
    for pfn in 0..64 {
        src.write_page(pfn, 0);
    }
    *src.hinted.lock().unwrap() = (16..64).collect();
    let run = migrate(&src, MigrationParams::default(), None);
    run.result.expect("migration");
    assert!(src.memory() == run.dest.unwrap().memory());
    let p = run.source_status.progress.pages;
    assert_eq!((p.full, p.zero), (16, 0), "only the pages not hinted");
    let events = src.hint_events.lock().unwrap().clone();
    let end = events.iter().position(|&e| e == "end");
    assert_eq!(events[0], "start");
    assert_eq!(
        events.iter().filter(|&&e| e == "end").count(),
        1,
        "{events:?}"
    );
    assert!(end < events.iter().position(|&e| e == "save"), "{events:?}");
}

/// A warm migration of `src` with the default parameters, which must move every page; the
/// source's page counts.
fn migrate_warm(src: &Arc<FakeVm>) -> migration::status::PageCounts {
    let run = migrate(
        src,
        MigrationParams {
            mode: Mode::Warm,
            ..Default::default()
        },
        None,
    );
    run.result.expect("migration");
    assert!(src.memory() == run.dest.unwrap().memory());
    run.source_status.progress.pages
}

#[test]
fn zero_pages_travel_as_markers() {
    let src = FakeVm::new();
    for pfn in 0..64 {
        src.write_page(pfn, 0);
    }
    for pfn in 32..64 {
        src.ram().zero_page(pfn).unwrap(); // populated, but zero
    }
    let p = migrate_warm(&src);
    assert_eq!((p.full, p.zero), (32, 32));
}

/// Pre-copy: pages that hold only zeros as round 0 begins are neither sent (not even as
/// markers) nor faulted in on the destination; one the guest writes after the scan arrives
/// with its data in a later round.
#[test]
fn zero_pages_stay_off_the_wire_and_out_of_the_destination() {
    let src = FakeVm::new();
    for pfn in 0..64 {
        src.write_page(pfn, 0);
    }
    for pfn in 32..64 {
        src.ram().zero_page(pfn).unwrap(); // populated, but zero
    }
    *src.written_at_harvest.lock().unwrap() = vec![40];
    src.paused.store(false, Ordering::Release);
    let run = migrate(&src, MigrationParams::default(), None);
    run.result.expect("migration");
    let dest = run.dest.unwrap();
    let p = run.source_status.progress.pages;
    assert_eq!((p.full, p.zero, p.skipped_zero), (33, 0, 32), "{p:?}");
    let resident = dest.resident_pages();
    let (written, zero): (Vec<u64>, Vec<u64>) = (0..64).partition(|&p| p < 32 || p == 40);
    assert!(written.iter().all(|&p| resident[p as usize].is_some()));
    assert!(
        zero.iter().all(|&p| resident[p as usize].is_none()),
        "a zero page was faulted in on the destination"
    );
    assert!(src.memory() == dest.memory());
}

/// A page the guest writes after the dirty log starts but before round 0 reaches it goes
/// once, with what it wrote: round 0 tells the log to forget each chunk as it sends it.
#[test]
fn a_page_written_before_round_0_reaches_it_goes_once() {
    let src = FakeVm::new();
    for pfn in 0..64 {
        src.write_page(pfn, 0);
    }
    *src.written_at_log_on.lock().unwrap() = vec![10, 20];
    src.paused.store(false, Ordering::Release);
    let run = migrate(&src, MigrationParams::default(), None);
    run.result.expect("migration");
    let p = run.source_status.progress.pages;
    assert_eq!((p.full, p.resent), (64, 0), "{p:?}");
    assert!(src.memory() == run.dest.unwrap().memory());
}

/// Each side's report says where its time went: named stretches that follow each other and
/// add up to the source's total (connect to "resumed"), so no time goes unexplained.
#[test]
fn the_report_accounts_for_every_millisecond() {
    let src = FakeVm::new();
    src.write_page(3, 1);
    src.paused.store(false, Ordering::Release);
    let run = migrate(&src, MigrationParams::default(), None);
    run.result.expect("migration");
    let names =
        |s: &Status| -> Vec<String> { s.report.breakdown.iter().map(|b| b.name.clone()).collect() };
    let source = names(&run.source_status);
    for want in [
        "connect",
        "handshake",
        "dirty log on",
        "populated scan",
        "populated map",
        "round 0",
        "harvest 1",
        "pause",
        "harvest paused",
        "state",
        "loaded",
        "go, resumed",
    ] {
        assert!(
            source.iter().any(|n| n == want),
            "no {want:?} in {source:?}"
        );
    }
    let r = &run.source_status.report;
    let sum: Duration = r.breakdown.iter().map(|b| b.took).sum();
    assert_eq!(sum, r.total, "the stretches add up to the total");
    let destination = names(&run.dest_status);
    for want in ["build", "populated map", "round 0", "load state", "resume"] {
        assert!(
            destination.iter().any(|n| n == want),
            "no {want:?} in {destination:?}"
        );
    }
}

#[test]
fn a_destination_that_refuses_leaves_the_source_running() {
    let src = FakeVm::new();
    src.write_page(3, 1);
    src.paused.store(false, Ordering::Release);
    let run = migrate(
        &src,
        MigrationParams::default(),
        Some("no room for this VM"),
    );
    let err = run.result.unwrap_err().to_string();
    assert!(err.contains("no room for this VM"), "{err}");
    assert!(run.dest_error.unwrap().contains("no room"));
    assert!(!src.paused.load(Ordering::Acquire), "the source runs on");
    assert!(
        !src.logging.load(Ordering::Acquire),
        "dirty logging is off again"
    );
    assert_eq!(run.source_status.phase, Phase::Failed);
}

/// A VM its user paused stays paused when a migration fails, and arrives paused when one
/// succeeds.
#[test]
fn a_paused_vm_stays_paused() {
    let src = FakeVm::new(); // FakeVm starts paused
    src.write_page(5, 1);
    let run = migrate(
        &src,
        MigrationParams {
            mode: Mode::Warm,
            ..Default::default()
        },
        Some("refused"),
    );
    assert!(run.result.is_err());
    assert!(
        src.paused.load(Ordering::Acquire),
        "not resumed by the failure"
    );
    let run = migrate(
        &src,
        MigrationParams {
            mode: Mode::Warm,
            ..Default::default()
        },
        None,
    );
    run.result.expect("migration");
    assert!(!run.dest.unwrap().is_running(), "arrives paused");
}

/// Writes `src` to a new snapshot file at `path`.
fn snapshot_to(src: &FakeVm, path: &std::path::Path) {
    snapshot_with(src, path, &MigrationParams::default());
}

fn snapshot_with(src: &FakeVm, path: &std::path::Path, params: &MigrationParams) -> Status {
    Outgoing::new(StatusBoard::default(), None)
        .snapshot(
            src,
            std::fs::File::create(path).unwrap(),
            "vm.ferry",
            params,
        )
        .expect("snapshot")
}

/// Restores the snapshot at `path` into `into`.
fn restore(path: &std::path::Path, into: Arc<FakeVm>) -> migration::Result<Option<Arc<FakeVm>>> {
    Incoming::new(StatusBoard::default(), None).receive(
        Source::snapshot(path).unwrap(),
        &|| false,
        move |_, _| Ok(into),
        |_| {},
    )
}

/// The snapshot at `path` is refused with an error saying `why`, and nothing is resumed.
fn assert_restore_refused(path: &std::path::Path, why: &str) {
    let fresh = FakeVm::new();
    let probe = fresh.clone();
    let err = restore(path, fresh).err().expect("refused").to_string();
    assert!(err.contains(why), "{err}");
    assert!(probe.paused.load(Ordering::Acquire), "never resumed");
}

#[test]
fn snapshot_file_restores_the_same_memory() {
    let src = FakeVm::new();
    for pfn in (0..PAGES).step_by(3) {
        src.write_page(ram_page(pfn), 9);
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("vm.ferry");
    snapshot_to(&src, &path);
    let restored = restore(&path, FakeVm::new())
        .expect("restore")
        .expect("a VM");
    assert!(src.memory() == restored.memory());

    // Compressed by three threads while one writes the file: the same memory comes back.
    let packed = dir.path().join("packed.ferry");
    let params = MigrationParams {
        compression: "zstd".parse().unwrap(),
        migration_threads: Some(3),
        ..Default::default()
    };
    let status = snapshot_with(&src, &packed, &params);
    assert_eq!(status.migration_threads, 3);
    assert!(status.progress.compression.frames_zstd > 0, "{status:?}");
    let restored = restore(&packed, FakeVm::new())
        .expect("restore")
        .expect("a VM");
    assert!(src.memory() == restored.memory());

    // A truncated snapshot is refused, and nothing is resumed.
    let bytes = std::fs::read(&path).unwrap();
    std::fs::write(&path, &bytes[..bytes.len() / 2]).unwrap();
    assert_restore_refused(&path, "truncated");
}

#[test]
fn a_snapshot_written_by_several_writers_restores_the_same_memory() {
    let src = FakeVm::new();
    for pfn in (0..PAGES).step_by(3) {
        src.write_page(ram_page(pfn), 5);
    }
    let dir = tempfile::tempdir().unwrap();
    for (writers, codec, threads) in [(3, "none", None), (2, "zstd", Some(4))] {
        let path = dir.path().join(format!("{writers}.ferry"));
        let params = MigrationParams {
            connections: writers,
            compression: codec.parse().unwrap(),
            migration_threads: threads,
            ..Default::default()
        };
        let status = snapshot_with(&src, &path, &params);
        assert_eq!(status.connections, writers);
        let bytes = std::fs::read(&path).unwrap();
        assert_eq!(&bytes[..8], b"FERRYLNS", "laid out for {writers} writers");
        let restored = restore(&path, FakeVm::new())
            .expect("restore")
            .expect("a VM");
        assert!(
            src.memory() == restored.memory(),
            "{writers} writers, {codec}"
        );

        // Cut short (the last chunks of some writers missing): refused, nothing resumed.
        std::fs::write(&path, &bytes[..bytes.len() * 2 / 3]).unwrap();
        let fresh = FakeVm::new();
        let probe = fresh.clone();
        assert!(restore(&path, fresh).is_err(), "a cut file is refused");
        assert!(probe.paused.load(Ordering::Acquire), "never resumed");
    }

    // A file of two writers whose stream says it had one: refused, not read as one stream.
    let forged = dir.path().join("forged.ferry");
    let mut w =
        migration::io::lanefile::LaneWriter::create(std::fs::File::create(&forged).unwrap(), 2)
            .unwrap();
    migration::wire::write_stream_header(&mut w).unwrap();
    let hello = Message::Hello {
        vm: src.descriptor(),
        mode: StreamMode::Snapshot,
        source: "test".into(),
        connections: 1,
        session: 0,
    };
    open_with(&mut w, &hello);
    std::io::Write::flush(&mut w).unwrap();
    assert_restore_refused(&forged, "written by 1 writers but the file holds 2");
}

/// A scripted destination on a fresh Unix socket: it accepts one connection, reads the stream
/// header and plays `script`. Returns where it listens.
fn scripted_destination(
    script: impl FnOnce(&mut migration::io::transport::Stream) + Send + 'static,
) -> (tempfile::TempDir, Endpoint, JoinHandle<()>) {
    let dir = tempfile::tempdir().unwrap();
    let endpoint: Endpoint = format!("unix:{}", dir.path().join("m.sock").display())
        .parse()
        .unwrap();
    let listener = endpoint.listen(None).unwrap();
    let played = std::thread::spawn(move || {
        let mut s = listener.accept().unwrap();
        s.set_timeouts(Some(Duration::from_secs(20))).unwrap();
        migration::wire::read_stream_header(&mut s).unwrap();
        script(&mut s);
    });
    (dir, endpoint, played)
}

/// A fake destination: it takes the handshake, reads up to `StateEnd` (an untouched VM sends
/// no pages) and then does `then`. Returns where it listens.
fn fake_destination(
    then: impl FnOnce(&mut migration::io::transport::Stream) + Send + 'static,
) -> (tempfile::TempDir, Endpoint, JoinHandle<()>) {
    use migration::wire::{self, Frame, Message};
    scripted_destination(move |s| {
        wire::read_message(s).unwrap(); // Hello
        wire::write_message(
            s,
            &Message::Ready {
                postcopy: false,
                host: None,
            },
        )
        .unwrap();
        loop {
            match wire::read_frame(s).unwrap() {
                Frame::Message(Message::StateEnd { .. }) => break,
                Frame::Message(_) => {}
                Frame::Pages { .. } => panic!("an untouched VM has no pages"),
            }
        }
        then(s);
    })
}

/// With Go right behind the state, pre-copy and post-copy move every page as before.
#[test]
fn go_with_the_state_moves_every_page() {
    for mode in [Mode::Precopy, Mode::Postcopy] {
        let (src, run) = migrate_while_writing(MigrationParams {
            mode,
            go_with_state: Some(true),
            max_downtime_ms: 1,
            max_rounds: 6,
            ..Default::default()
        });
        run.result.expect("migration");
        let dest = run.dest.expect("destination VM");
        assert!(src.memory() == dest.memory(), "{mode:?}: every page");
        assert_eq!(run.source_status.phase, Phase::Completed);
    }
}

/// `go_with_state`: Go comes right behind the state, before the destination answers (the fake
/// destination reads it before it writes a word). A destination that then says why it cannot
/// load never starts: the source runs on. One that vanishes without a word may have started:
/// the source stays paused, unconfirmed.
#[test]
fn go_with_the_state_settles_by_what_the_destination_said() {
    use migration::wire::{self, Message};
    for says_why in [true, false] {
        let src = FakeVm::new();
        src.paused.store(false, Ordering::Release);
        let (_dir, endpoint, fake) = fake_destination(move |s| {
            assert_eq!(wire::read_message(s).unwrap(), Message::Go);
            if says_why {
                let reason = "cannot load this state".to_string();
                wire::write_message(s, &Message::Abort { reason }).unwrap();
            }
        });
        let params = MigrationParams {
            mode: Mode::Warm,
            go_with_state: Some(true),
            ..Default::default()
        };
        let (board, error) = send_and_wait(&src, endpoint, params);
        assert!(error.is_some(), "the migration failed");
        fake.join().unwrap();
        if says_why {
            assert_eq!(board.phase(), Phase::Failed);
            assert!(!src.paused.load(Ordering::Acquire), "the source runs on");
        } else {
            assert_eq!(board.phase(), Phase::Unconfirmed);
            assert!(src.paused.load(Ordering::Acquire), "neither resumed here");
        }
    }
}

/// A destination that takes `Go` and vanishes before saying it resumed: the source cannot know
/// whether the VM runs there. It stays paused and refuses anything that could start a second
/// copy (another migration, a snapshot).
#[test]
fn after_go_without_an_answer_the_vm_never_runs_twice() {
    use migration::wire::{self, Message};
    let src = FakeVm::new();
    src.paused.store(false, Ordering::Release);
    let (dir, endpoint, fake) = fake_destination(|s| {
        wire::write_message(
            s,
            &Message::Loaded {
                memory_checksum: None,
            },
        )
        .unwrap();
        assert_eq!(wire::read_message(s).unwrap(), Message::Go);
        // ...and gone, without Resumed.
    });
    let board = StatusBoard::default();
    let outgoing = Outgoing::new(board.clone(), None);
    let (tx, rx) = std::sync::mpsc::channel();
    outgoing
        .send(
            src.clone(),
            endpoint.clone(),
            MigrationParams {
                mode: Mode::Warm,
                ..Default::default()
            },
            Box::new(move |r| tx.send(r.is_ok()).unwrap()),
        )
        .unwrap();
    assert!(!rx.recv_timeout(Duration::from_secs(60)).unwrap());
    fake.join().unwrap();
    assert_eq!(board.phase(), Phase::Unconfirmed);
    assert!(src.paused.load(Ordering::Acquire), "neither resumed here");
    let again = outgoing.send(
        src.clone(),
        endpoint,
        MigrationParams::default(),
        Box::new(|_| {}),
    );
    let e = again.unwrap_err();
    assert!(e.to_string().contains("unconfirmed"), "{e}");
    let file = std::fs::File::create(dir.path().join("s")).unwrap();
    assert!(
        outgoing
            .snapshot(src.as_ref(), file, "s", &MigrationParams::default())
            .is_err()
    );
    assert_eq!(
        board.phase(),
        Phase::Unconfirmed,
        "the refusals changed nothing"
    );
}

/// Snapshot page data is covered by the frame checksum: a flipped byte inside a page is
/// refused on restore, and nothing is resumed.
#[test]
fn a_flipped_byte_in_snapshot_page_data_is_refused() {
    let src = FakeVm::new();
    src.write_page(10, 7);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("vm.ferry");
    // Plain pages, so that the test finds the page's bytes in the file.
    let plain = MigrationParams {
        compression: Compression::None,
        ..MigrationParams::default()
    };
    snapshot_with(&src, &path, &plain);
    let mut bytes = std::fs::read(&path).unwrap();
    // Word 5 of page 10 as `write_page` stamped it.
    let word = (10u64 << 40 | 7 << 12 | 5).to_le_bytes();
    let at = bytes
        .windows(8)
        .position(|w| w == word)
        .expect("the page is in the file");
    bytes[at] ^= 1;
    std::fs::write(&path, &bytes).unwrap();
    assert_restore_refused(&path, "checksum mismatch");
}

/// Connections that do not open a live migration — garbage, a peer that connects and says
/// nothing, a snapshot replayed over the network — are turned away, and the real source still
/// gets through.
#[test]
fn a_listener_turns_away_strangers_and_snapshots() {
    use std::io::Write;
    let src = FakeVm::new();
    src.write_page(1, 1);
    let (dir, sock, dest) = listening_destination();
    let snapshot = dir.path().join("vm.ferry");
    snapshot_to(&src, &snapshot);
    let mut garbage = std::os::unix::net::UnixStream::connect(&sock).unwrap();
    garbage.write_all(b"GET / HTTP/1.1\r\n\r\n").unwrap();
    drop(std::os::unix::net::UnixStream::connect(&sock).unwrap()); // says nothing, leaves
    let mut replay = std::os::unix::net::UnixStream::connect(&sock).unwrap();
    replay
        .write_all(&std::fs::read(&snapshot).unwrap())
        .unwrap();
    let mut answer = Vec::new();
    use std::io::Read;
    let _ = replay.read_to_end(&mut answer);
    assert!(
        String::from_utf8_lossy(&answer).contains("snapshot stream on a migration listener"),
        "the replayed snapshot is told why"
    );
    let board = StatusBoard::default();
    let (tx, rx) = std::sync::mpsc::channel();
    let endpoint: Endpoint = format!("unix:{}", sock.display()).parse().unwrap();
    Outgoing::new(board, None)
        .send(
            src.clone(),
            endpoint,
            MigrationParams {
                mode: Mode::Warm,
                ..Default::default()
            },
            Box::new(move |r| tx.send(r.is_ok()).unwrap()),
        )
        .unwrap();
    assert!(rx.recv_timeout(Duration::from_secs(60)).unwrap());
    let vm = dest
        .join()
        .unwrap()
        .unwrap()
        .expect("the real migration arrived");
    assert!(vm.memory() == src.memory());
}

/// A CA and a certificate it signed for `name` (a host name or an IP address), as PEM files
/// in `dir`.
fn credentials(
    dir: &std::path::Path,
    ca: &rcgen::CertifiedKey,
    name: &str,
) -> migration::io::tls::TlsFiles {
    let key = rcgen::KeyPair::generate().unwrap();
    let params = rcgen::CertificateParams::new(vec![name.to_string()]).unwrap();
    let cert = params.signed_by(&key, &ca.cert, &ca.key_pair).unwrap();
    let files = migration::io::tls::TlsFiles {
        cert: dir.join(format!("{name}.pem")),
        key: dir.join(format!("{name}.key")),
        ca: dir.join(format!("{name}-ca.pem")),
    };
    std::fs::write(&files.cert, cert.pem()).unwrap();
    std::fs::write(&files.key, key.serialize_pem()).unwrap();
    std::fs::write(&files.ca, ca.cert.pem()).unwrap();
    files
}

fn new_ca() -> rcgen::CertifiedKey {
    let key = rcgen::KeyPair::generate().unwrap();
    let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    let cert = params.self_signed(&key).unwrap();
    rcgen::CertifiedKey {
        cert,
        key_pair: key,
    }
}

/// Over TCP with TLS: a source holding a certificate of the destination's CA migrates (the
/// memory arrives exactly); a source with a certificate of another CA, and a source without
/// TLS, are turned away, and the destination keeps waiting for the real one.
#[test]
fn tls_admits_only_a_source_of_the_same_ca() {
    use migration::io::tls::Tls;
    let dir = tempfile::tempdir().unwrap();
    let ca = new_ca();
    let dest_tls = Tls::load(&credentials(dir.path(), &ca, "127.0.0.1")).unwrap();
    let src_tls = Tls::load(&credentials(dir.path(), &ca, "source.example")).unwrap();
    // A stranger who trusts our CA (so it accepts the destination) but whose own certificate
    // another CA signed: only the destination's check can stop it.
    let mut stranger_files = credentials(dir.path(), &new_ca(), "localhost");
    stranger_files.ca = credentials(dir.path(), &ca, "127.0.0.1").ca;
    let stranger = Tls::load(&stranger_files).unwrap();

    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let endpoint: Endpoint = format!("tcp:127.0.0.1:{port}").parse().unwrap();
    let source = Source::listen(&endpoint, Some(&dest_tls)).unwrap();
    let dest = std::thread::spawn(move || {
        Incoming::new(StatusBoard::default(), Some(dest_tls)).receive(
            source,
            &|| false,
            |_, _| Ok(FakeVm::new()),
            |_| {},
        )
    });
    let src = FakeVm::new();
    for i in (0..PAGES).step_by(5) {
        src.write_page(ram_page(i), 4);
    }
    let attempt = |tls: Option<Tls>| {
        let (tx, rx) = std::sync::mpsc::channel();
        let started = Outgoing::new(StatusBoard::default(), tls).send(
            src.clone(),
            endpoint.clone(),
            MigrationParams {
                mode: Mode::Warm,
                connections: 3, // every extra connection is TLS too
                ..Default::default()
            },
            Box::new(move |r| {
                let _ = tx.send(r.as_ref().map(|_| ()).map_err(|e| e.to_string()));
            }),
        );
        match started {
            Err(e) => Err(e.to_string()),
            Ok(()) => rx.recv_timeout(Duration::from_secs(60)).unwrap(),
        }
    };
    assert!(
        attempt(Some(stranger)).is_err(),
        "a certificate of another CA"
    );
    assert!(attempt(None).is_err(), "no TLS at all");
    attempt(Some(src_tls)).expect("the real source");
    let vm = dest.join().unwrap().unwrap().expect("arrived");
    assert!(vm.memory() == src.memory());
}

/// Starts a destination on a fresh Unix socket; returns its address and the receive's thread.
fn listening_destination() -> (
    tempfile::TempDir,
    std::path::PathBuf,
    JoinHandle<migration::Result<Option<Arc<FakeVm>>>>,
) {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("m.sock");
    let endpoint: Endpoint = format!("unix:{}", sock.display()).parse().unwrap();
    let source = Source::listen(&endpoint, None).unwrap();
    let dest = std::thread::spawn(move || {
        Incoming::new(StatusBoard::default(), None).receive(
            source,
            &|| false,
            |_, _| Ok(FakeVm::new()),
            |_| {},
        )
    });
    (dir, sock, dest)
}

/// `first`, and after a `Hello` the VM's config and its shared disks (none move), as a
/// stream of this version carries them.
fn open_with(s: &mut impl std::io::Write, first: &Message) {
    migration::wire::write_message(s, first).unwrap();
    if let Message::Hello { vm, .. } = first {
        let config = vm.config.clone();
        migration::wire::write_message(s, &Message::Config { config }).unwrap();
        let disks = Vec::new();
        migration::wire::write_message(s, &Message::Storage { disks }).unwrap();
    }
}

fn open_stream(sock: &std::path::Path, first: &Message) -> std::os::unix::net::UnixStream {
    let mut s = std::os::unix::net::UnixStream::connect(sock).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    migration::wire::write_stream_header(&mut s).unwrap();
    open_with(&mut s, first);
    s
}

/// A state sent twice is refused, naming it, not silently overwritten by the second copy.
#[test]
fn a_state_sent_twice_is_refused() {
    let twice = [
        Message::VcpuState {
            index: 0,
            state: vec![1],
        },
        Message::DeviceState { state: vec![2] },
    ];
    for (i, repeated) in twice.iter().enumerate() {
        let (_dir, sock, dest) = listening_destination();
        let hello = Message::Hello {
            vm: FakeVm::new().descriptor(),
            mode: StreamMode::Precopy,
            source: "a test".into(),
            connections: 1,
            session: 0,
        };
        let mut s = open_stream(&sock, &hello);
        assert!(matches!(
            migration::wire::read_message(&mut s).unwrap(),
            Message::Ready { .. }
        ));
        for m in [&twice[i], repeated] {
            migration::wire::write_message(&mut s, m).unwrap();
        }
        match dest.join().unwrap() {
            Err(e) => assert!(e.to_string().contains("came twice"), "{e}"),
            Ok(_) => panic!("a repeated {} was taken", repeated.name()),
        }
    }
}

#[test]
fn only_the_migrations_own_connections_may_join_it() {
    let (_dir, sock, dest) = listening_destination();
    let vm = FakeVm::new();
    let mut main = open_stream(
        &sock,
        &Message::Hello {
            vm: vm.descriptor(),
            mode: StreamMode::Precopy,
            source: "a test".into(),
            connections: 2,
            session: 7,
        },
    );
    assert!(matches!(
        migration::wire::read_message(&mut main).unwrap(),
        Message::Ready { .. }
    ));
    for (join, why) in [
        (
            Message::Join {
                session: 8,
                lane: 1,
            },
            "not a connection of the migration running here",
        ),
        (
            Message::Join {
                session: 7,
                lane: 5,
            },
            "has 2 connections",
        ),
        (Message::Go, "opened with Go"),
    ] {
        let mut stranger = open_stream(&sock, &join);
        match migration::wire::read_message(&mut stranger) {
            Err(migration::Error::Peer(reason)) => assert!(reason.contains(why), "{reason}"),
            other => panic!("a stranger must be told why, got {other:?}"),
        }
    }
    // The real second connection joins; then the source gives up and the destination with it.
    let _lane = open_stream(
        &sock,
        &Message::Join {
            session: 7,
            lane: 1,
        },
    );
    migration::wire::write_message(
        &mut main,
        &Message::Abort {
            reason: "the test is over".into(),
        },
    )
    .unwrap();
    let e = dest.join().unwrap().err().expect("no VM arrives");
    assert!(e.to_string().contains("the test is over"), "{e}");
}

/// Post-copy checkpoints: the source's memory, with every checkpoint applied, is the
/// destination's memory at the instant of the last one, page for page, while the guest wrote
/// there throughout; and the source applied exactly what the destination took.
#[test]
fn checkpoints_bring_the_destinations_memory_back_to_the_source_exactly() {
    for mode in [Mode::Postcopy, Mode::Hybrid] {
        let src = FakeVm::new();
        for i in 0..PAGES {
            src.write_page(ram_page(i), 1);
        }
        // Hybrid post-copies what the guest dirtied after its one round.
        let stop = Arc::new(AtomicBool::new(false));
        let guest = src.start_guest(0, PAGES, stop.clone());
        let run = migrate_with(
            &src,
            MigrationParams {
                mode,
                // Slow enough that post-copy lasts about a second: many checkpoints.
                max_bandwidth_mbps: Some(100),
                checkpoint_ms: Some(20),
                ..Default::default()
            },
            None,
            |vm| {
                // The guest writes across both regions (faulting pages in as it goes) for
                // longer than post-copy lasts.
                vm.paused.store(false, Ordering::Release);
                for i in 0..25_000u64 {
                    while !vm.try_write(ram_page((i * 7919) % PAGES), 2 + i / PAGES) {
                        std::thread::sleep(Duration::from_micros(200));
                    }
                    if i.is_multiple_of(64) {
                        std::thread::sleep(Duration::from_millis(3));
                    }
                }
            },
        );
        stop.store(true, Ordering::Release);
        guest.join().unwrap();
        run.result.expect("migration");
        let dest = run.dest.expect("destination VM");
        let taken = dest.saved.lock().unwrap().0;
        let back = run.source_status.checkpoints.expect("checkpoint figures");
        let sent = run.dest_status.checkpoints.expect("checkpoint figures");
        assert!(back.count >= 3, "{mode:?}: only {} checkpoints", back.count);
        assert_eq!(
            back.last_seq, taken,
            "{mode:?}: every checkpoint taken was applied"
        );
        assert_eq!((sent.count, sent.last_seq), (back.count, back.last_seq));
        assert!(back.pages > 0 && back.rolled_back_to.is_none());
        // Where a page had not arrived yet, the source's copy from the switch stands.
        let at_switch = src.saved.lock().unwrap().1.clone();
        let at_last = dest.saved.lock().unwrap().1.clone();
        let now = src.resident_pages();
        for (i, page) in now.iter().enumerate() {
            let want = at_last[i].as_ref().or(at_switch[i].as_ref());
            assert!(
                page.as_ref() == want,
                "{mode:?}: RAM page {i} differs from the destination's at checkpoint {taken}"
            );
        }
    }
}

#[test]
fn a_connection_that_dies_mid_round_fails_the_migration_and_the_source_runs_on() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("m.sock");
    let listener = std::os::unix::net::UnixListener::bind(&sock).unwrap();
    // A destination that takes the main connection, lets the second join, then drops it.
    let fake = std::thread::spawn(move || {
        let (mut main, _) = listener.accept().unwrap();
        migration::wire::read_stream_header(&mut main).unwrap();
        let Message::Hello { connections, .. } = migration::wire::read_message(&mut main).unwrap()
        else {
            panic!("Hello first")
        };
        assert_eq!(connections, 2);
        migration::wire::write_message(
            &mut main,
            &Message::Ready {
                postcopy: false,
                host: None,
            },
        )
        .unwrap();
        let (mut lane, _) = listener.accept().unwrap();
        migration::wire::read_stream_header(&mut lane).unwrap();
        let joined = migration::wire::read_message(&mut lane).unwrap();
        assert!(matches!(joined, Message::Join { lane: 1, .. }));
        drop(lane);
        // The source tells the main connection why it gave up.
        loop {
            match migration::wire::read_frame(&mut main) {
                Ok(migration::wire::Frame::Message(Message::Abort { reason })) => return reason,
                Ok(migration::wire::Frame::Pages { len, .. }) => {
                    // Skip the page data and its CRC trailer.
                    let body = u64::from(len) + 4;
                    std::io::copy(
                        &mut std::io::Read::take(&mut main, body),
                        &mut std::io::sink(),
                    )
                    .unwrap();
                }
                Ok(_) => continue,
                Err(e) => return format!("no Abort: {e}"),
            }
        }
    });
    let src = FakeVm::new();
    for i in 0..PAGES {
        src.write_page(ram_page(i), 1);
    }
    src.paused.store(false, Ordering::Release);
    let board = StatusBoard::default();
    let (tx, rx) = std::sync::mpsc::channel();
    let started = Outgoing::new(board.clone(), None).send(
        src.clone(),
        format!("unix:{}", sock.display()).parse().unwrap(),
        MigrationParams {
            connections: 2,
            ..Default::default()
        },
        Box::new(move |r| {
            let _ = tx.send(r.as_ref().map(|_| ()).map_err(|e| e.to_string()));
        }),
    );
    let result = match started {
        Err(e) => Err(e.to_string()),
        Ok(()) => rx.recv_timeout(Duration::from_secs(60)).unwrap(),
    };
    let e = result.expect_err("the migration fails");
    let told = fake.join().unwrap();
    assert!(!told.starts_with("no Abort"), "{told}");
    assert!(
        !src.paused.load(Ordering::Acquire),
        "the source runs on: {e}"
    );
    assert!(!src.logging.load(Ordering::Acquire), "dirty logging is off");
    assert_eq!(board.read().phase, Phase::Failed);
}

/// How a scripted destination breaks off.
#[derive(Clone, Copy, Debug)]
enum Cut {
    /// It says why, then closes the connection.
    Abort,
    /// It closes the connection without a word.
    Close,
    /// It answers out of turn (`Resumed`, before `Go`), then only listens.
    Stray,
    /// It only listens from here on: no answer ever comes.
    Silent,
}

/// A scripted destination: it answers the conversation as a real one would (an untouched VM
/// sends no pages) until the source sends a message named `at`, then tells `reached` and
/// breaks off as `cut` says. Returns where it listens.
fn breaking_destination(
    at: &'static str,
    cut: Cut,
    reached: std::sync::mpsc::Sender<()>,
) -> (tempfile::TempDir, Endpoint, JoinHandle<()>) {
    use migration::wire::{self, Frame};
    scripted_destination(move |s| {
        loop {
            let msg = match wire::read_frame(s).unwrap() {
                Frame::Message(m) => m,
                Frame::Pages { .. } => panic!("an untouched VM has no pages"),
            };
            if msg.name() == at {
                let _ = reached.send(());
                break;
            }
            let answer = match msg {
                Message::Hello { .. } => Message::Ready {
                    postcopy: true,
                    host: None,
                },
                Message::Sync { .. } => Message::Synced,
                Message::Stale { .. } => Message::StaleDropped,
                Message::StateEnd { .. } => Message::Loaded {
                    memory_checksum: None,
                },
                _ => continue,
            };
            wire::write_message(s, &answer).unwrap();
        }
        let stray = Message::Resumed {
            state_to_resume_ns: 0,
        };
        match cut {
            Cut::Abort => {
                let reason = format!("scripted abort at {at}");
                wire::write_message(s, &Message::Abort { reason }).unwrap();
            }
            Cut::Close => {}
            Cut::Stray => wire::write_message(s, &stray).unwrap(),
            Cut::Silent => {}
        }
        if let Cut::Stray | Cut::Silent = cut {
            // Listens until the source lets go (each read waits at most 20 s).
            while wire::read_frame(s).is_ok() {}
        }
    })
}

/// Migrates `src` to `endpoint` and waits for the end: the source's board, and the error if
/// it failed (from `send` itself or through its callback).
fn send_and_wait(
    src: &Arc<FakeVm>,
    endpoint: Endpoint,
    params: MigrationParams,
) -> (StatusBoard, Option<String>) {
    let board = StatusBoard::default();
    let outgoing = Outgoing::new(board.clone(), None);
    let (tx, rx) = std::sync::mpsc::channel();
    let started = outgoing.send(
        src.clone(),
        endpoint,
        params,
        Box::new(move |r| {
            let _ = tx.send(r.as_ref().err().map(|e| e.to_string()));
        }),
    );
    let error = match started {
        Err(e) => Some(e.to_string()),
        Ok(()) => rx.recv_timeout(Duration::from_secs(60)).unwrap(),
    };
    (board, error)
}

/// A migration to a scripted destination: `Go` waits for `Loaded`, as on this socket.
fn breaking_params(mode: Mode) -> MigrationParams {
    MigrationParams {
        mode,
        go_with_state: Some(false),
        // A destination gone in the rounds is dialled again for this long (a test of its own).
        resume_window_s: 1,
        ..Default::default()
    }
}

/// Every state of the conversation before `Go`: the message after which the destination
/// breaks off, by mode.
const BEFORE_GO: [(Mode, &str); 8] = [
    (Mode::Precopy, "Hello"),
    (Mode::Precopy, "Populated"),
    (Mode::Precopy, "RoundEnd"),
    (Mode::Precopy, "Sync"),
    (Mode::Precopy, "StateEnd"),
    (Mode::Hybrid, "Stale"),
    (Mode::Postcopy, "PostcopyPending"),
    (Mode::Warm, "StateEnd"),
];

/// The source is as it was before the migration: running, dirty logging off, its devices its
/// own, its guest not slowed.
fn assert_as_it_was(src: &FakeVm, case: &str) {
    assert!(!src.paused.load(Ordering::Acquire), "runs on: {case}");
    assert!(!src.logging.load(Ordering::Acquire), "log off: {case}");
    assert!(!src.released.load(Ordering::Acquire), "devices: {case}");
    assert_eq!(src.throttle.load(Ordering::Relaxed), 0, "throttle: {case}");
}

/// Migrates a running, untouched `FakeVm` to a destination that breaks off at `at`.
fn migrate_to_breaking(mode: Mode, at: &'static str, cut: Cut) -> (Arc<FakeVm>, Status, String) {
    let src = FakeVm::new();
    src.paused.store(false, Ordering::Release);
    let (_dir, endpoint, script) = breaking_destination(at, cut, std::sync::mpsc::channel().0);
    let (board, error) = send_and_wait(&src, endpoint, breaking_params(mode));
    script.join().unwrap();
    let error = error.unwrap_or_else(|| panic!("{mode:?} cut at {at} ({cut:?}) succeeded"));
    (src, board.read(), error)
}

/// Before `Go`, a destination that aborts, vanishes or answers out of turn in any state of the
/// conversation leaves the source as it was: running, dirty logging off, its devices its own,
/// its guest not slowed. After `Go`, an abort still does (the destination says it did not start); silence
/// leaves the source paused and unconfirmed, as the VM may run there.
#[test]
fn a_destination_breaking_off_in_any_state_leaves_the_source_as_it_was() {
    for (mode, at) in BEFORE_GO {
        for cut in [Cut::Abort, Cut::Close, Cut::Stray] {
            let (src, status, error) = migrate_to_breaking(mode, at, cut);
            let case = format!("{mode:?} cut at {at} ({cut:?}): {error}");
            match cut {
                Cut::Abort => assert!(error.contains(&format!("scripted abort at {at}")), "{case}"),
                Cut::Stray => assert!(
                    error.contains("unexpected Resumed while the source was in"),
                    "{case}"
                ),
                _ => {}
            }
            assert_eq!(status.phase, Phase::Failed, "{case}");
            assert_as_it_was(&src, &case);
        }
    }
    for mode in [Mode::Precopy, Mode::Postcopy] {
        let (src, status, error) = migrate_to_breaking(mode, "Go", Cut::Abort);
        assert!(error.contains("scripted abort at Go"), "{mode:?}: {error}");
        assert_eq!(status.phase, Phase::Failed, "{mode:?}");
        assert!(!src.paused.load(Ordering::Acquire), "{mode:?}: runs on");
        let (src, status, _) = migrate_to_breaking(mode, "Go", Cut::Close);
        let unconfirmed = match mode {
            Mode::Postcopy => Phase::PostcopyPaused,
            _ => Phase::Unconfirmed,
        };
        assert_eq!(status.phase, unconfirmed, "{mode:?}");
        assert!(
            src.paused.load(Ordering::Acquire),
            "{mode:?}: neither resumed here"
        );
    }
}

/// A destination that refuses in the rounds (its `Abort`, then its close) ends the migration
/// with its reason at once: the source's failed write is not taken for a broken link to dial
/// again for the resume window (it was, whenever the write failed before the source read).
#[test]
fn a_destination_that_aborts_in_the_rounds_is_not_dialled_again() {
    for at in ["Populated", "RoundEnd"] {
        let src = FakeVm::new(); // untouched: the scripted destination takes no pages
        src.paused.store(false, Ordering::Release);
        let (_dir, endpoint, script) =
            breaking_destination(at, Cut::Abort, std::sync::mpsc::channel().0);
        let params = MigrationParams {
            go_with_state: Some(false),
            ..Default::default()
        };
        let (board, error) = send_and_wait(&src, endpoint, params);
        script.join().unwrap();
        let error = error.expect("the destination refused");
        assert!(
            error.contains(&format!("scripted abort at {at}")),
            "{error}"
        );
        let status = board.read();
        let note = status.note.unwrap_or_default();
        assert!(!note.contains("reconnecting"), "{at}: {note}");
        assert_as_it_was(&src, at);
    }
}

/// Before `Go`, a destination that falls silent in any state of the conversation holds the
/// source only until the operator cancels: the migration ends cancelled within the wait, and
/// the source is as it was.
#[test]
fn a_silent_destination_is_cancelled_in_any_state_before_go() {
    for (mode, at) in BEFORE_GO {
        let src = FakeVm::new();
        src.paused.store(false, Ordering::Release);
        let (reached, heard) = std::sync::mpsc::channel();
        let (_dir, endpoint, script) = breaking_destination(at, Cut::Silent, reached);
        let board = StatusBoard::default();
        let outgoing = Outgoing::new(board.clone(), None);
        let operator = {
            let outgoing = outgoing.clone();
            std::thread::spawn(move || {
                heard
                    .recv_timeout(Duration::from_secs(30))
                    .expect("the source reached the silent state");
                outgoing.cancel().expect("a cancel before Go is taken");
                outgoing.wait_ended(Duration::from_secs(10))
            })
        };
        let (tx, rx) = std::sync::mpsc::channel();
        let started = outgoing.send(
            src.clone(),
            endpoint,
            breaking_params(mode),
            Box::new(move |r| {
                let _ = tx.send(r.is_ok());
            }),
        );
        let ended = operator.join().unwrap();
        let case = format!("{mode:?} silent after {at}");
        assert_eq!(ended, Phase::Cancelled, "{case}");
        if started.is_ok() {
            assert!(!rx.recv_timeout(Duration::from_secs(10)).unwrap(), "{case}");
        }
        script.join().unwrap();
        assert_as_it_was(&src, &case);
    }
}

/// What `f` gives, once it gives something, asked every 10 ms for at most `limit`.
fn wait_until<T>(limit: Duration, mut f: impl FnMut() -> Option<T>) -> T {
    let deadline = std::time::Instant::now() + limit;
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "nothing within {limit:?}"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// A TCP connection to 127.0.0.1:`port` from 127.0.0.`host`, with `first` sent on it.
fn open_tcp_from(host: u8, port: u16, first: &Message) -> std::net::TcpStream {
    use std::net::{Ipv4Addr, SocketAddrV4};
    let to = SocketAddrV4::new(Ipv4Addr::LOCALHOST, port);
    let mut s = sockets::tcp::connect_from(Ipv4Addr::new(127, 0, 0, host), to).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    migration::wire::write_stream_header(&mut s).unwrap();
    open_with(&mut s, first);
    s
}

/// A destination listening on plain TCP at 127.0.0.1 (its port), ended by `stop`.
fn tcp_destination(
    board: &StatusBoard,
    stop: &Arc<AtomicBool>,
) -> (u16, JoinHandle<migration::Result<Option<Arc<FakeVm>>>>) {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let endpoint: Endpoint = format!("tcp:127.0.0.1:{port}").parse().unwrap();
    let source = Source::listen(&endpoint, None).unwrap();
    let (board, stop) = (board.clone(), stop.clone());
    let dest = std::thread::spawn(move || {
        Incoming::new(board, None).receive(
            source,
            &|| stop.load(Ordering::Acquire),
            |_, _| Ok(FakeVm::new()),
            |_| {},
        )
    });
    (port, dest)
}

fn told(stream: &mut std::net::TcpStream) -> String {
    match migration::wire::read_message(stream) {
        Err(migration::Error::Peer(reason)) => reason,
        other => panic!("a stranger must be told why, got {other:?}"),
    }
}

/// Over plain TCP a migration's session id crosses in clear: a stranger elsewhere who learnt
/// it may still not join the migration (an extra lane) nor carry it on (a resume). Later
/// connections must come from the first's peer. And however long a window the source asks
/// for, the destination waits at most `MAX_RESUME_WINDOW` (plus its last try's 10 s).
#[test]
fn later_connections_must_come_from_the_migrations_peer() {
    let (board, stop) = (StatusBoard::default(), Arc::new(AtomicBool::new(false)));
    let (port, dest) = tcp_destination(&board, &stop);
    let hello = |connections, session| Message::Hello {
        vm: FakeVm::new().descriptor(),
        mode: StreamMode::Precopy,
        source: "a test".into(),
        connections,
        session,
    };
    let mut main = open_tcp_from(1, port, &hello(2, 7));
    assert!(matches!(
        migration::wire::read_message(&mut main).unwrap(),
        Message::Ready { .. }
    ));
    let mut stranger = open_tcp_from(
        2,
        port,
        &Message::Join {
            session: 7,
            lane: 1,
        },
    );
    let why = told(&mut stranger);
    assert!(why.contains("it comes from 127.0.0.2"), "{why}");
    let _lane = open_tcp_from(
        1,
        port,
        &Message::Join {
            session: 7,
            lane: 1,
        },
    );
    drop(main);
    assert!(dest.join().unwrap().is_err());

    let (port, dest) = tcp_destination(&board, &stop);
    let mut main = open_tcp_from(1, port, &hello(1, 9));
    assert!(matches!(
        migration::wire::read_message(&mut main).unwrap(),
        Message::Ready { .. }
    ));
    let window = Message::ResumeWindow { seconds: u32::MAX };
    migration::wire::write_message(&mut main, &window).unwrap();
    drop(main); // the link breaks
    let note = wait_until(Duration::from_secs(20), || {
        board.read().note.filter(|n| n.contains("waiting up to"))
    });
    let cap = migration::destination::MAX_RESUME_WINDOW.as_secs() + 10;
    assert!(note.contains(&format!("up to {cap} s")), "{note}");
    let mut stranger = open_tcp_from(2, port, &Message::ResumePrecopy { session: 9 });
    let why = told(&mut stranger);
    assert!(why.contains("it comes from 127.0.0.2"), "{why}");
    stop.store(true, Ordering::Release);
    assert!(dest.join().unwrap().is_err(), "stopped, no VM arrived");
}
