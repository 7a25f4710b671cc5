//! The engine against a fake VM: plain memory, a scripted writer standing in for the guest,
//! and an exact dirty log as the oracle. Fast, no KVM.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use migration::bitmap::Bitmap;
use migration::precopy::save_snapshot;
use migration::receive::{Incoming, receive_migration};
use migration::stats::lock;
use migration::{
    Endpoint, GuestRam, Migratable, MigrationParams, MigrationPhase, Mode, SharedStatus, Signals,
    VmDescriptor, send_migration,
};

const PAGES: u64 = 4096; // 16 MiB

struct Mapping(*mut u8, usize);
unsafe impl Send for Mapping {}
unsafe impl Sync for Mapping {}
impl Drop for Mapping {
    fn drop(&mut self) {
        unsafe { libc::munmap(self.0 as *mut _, self.1) };
    }
}

fn map(len: usize) -> Mapping {
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
    mem: Mapping,
    dirty: Mutex<Bitmap>,
    logging: AtomicBool,
    paused: AtomicBool,
    writes: AtomicU64,
    state: Mutex<Option<LoadedState>>,
}

impl FakeVm {
    fn new() -> Arc<Self> {
        Arc::new(Self {
            mem: map(PAGES as usize * 4096),
            dirty: Mutex::new(Bitmap::new(PAGES)),
            logging: AtomicBool::new(false),
            paused: AtomicBool::new(true),
            writes: AtomicU64::new(0),
            state: Mutex::new(None),
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

    fn memory(&self) -> &[u8] {
        unsafe { std::slice::from_raw_parts(self.mem.0, self.mem.1) }
    }

    /// Runs a writer over pages `[lo, hi)` (a stride walk) while the VM is not paused.
    fn start_guest(self: &Arc<Self>, lo: u64, hi: u64, stop: Arc<AtomicBool>) -> JoinHandle<()> {
        self.paused.store(false, Ordering::Release);
        let vm = self.clone();
        std::thread::spawn(move || {
            let mut generation = 1;
            let mut i = 0u64;
            while !stop.load(Ordering::Acquire) {
                if vm.paused.load(Ordering::Acquire) {
                    std::thread::sleep(Duration::from_micros(200));
                    continue;
                }
                let pfn = lo + (i * 7919) % (hi - lo);
                vm.write_page(pfn, generation);
                i += 1;
                if i.is_multiple_of(hi - lo) {
                    generation += 1;
                }
                if i.is_multiple_of(64) {
                    std::thread::sleep(Duration::from_micros(50));
                }
            }
        })
    }
}

impl Migratable for FakeVm {
    fn descriptor(&self) -> VmDescriptor {
        VmDescriptor {
            memory_bytes: PAGES * 4096,
            ranges: self.ram().ranges(),
            vcpus: 2,
            memory_backend: "anonymous".into(),
        }
    }
    fn ram(&self) -> GuestRam {
        let range = migration::RamRange {
            gpa: 0,
            len: self.mem.1 as u64,
        };
        unsafe { GuestRam::new(&[(range, self.mem.0)]) }.unwrap()
    }
    fn start_dirty_log(&self) -> migration::Result<()> {
        self.dirty.lock().unwrap().clear();
        self.logging.store(true, Ordering::Release);
        Ok(())
    }
    fn take_dirty(&self) -> migration::Result<Bitmap> {
        let mut d = self.dirty.lock().unwrap();
        Ok(std::mem::replace(&mut *d, Bitmap::new(PAGES)))
    }
    fn stop_dirty_log(&self) -> migration::Result<()> {
        self.logging.store(false, Ordering::Release);
        Ok(())
    }
    fn pause(&self) -> migration::Result<()> {
        // The writer checks the flag before each page; one page may be in flight, so wait a
        // little for it to land (the real VM parks vCPUs synchronously).
        self.paused.store(true, Ordering::Release);
        std::thread::sleep(Duration::from_millis(2));
        Ok(())
    }
    fn resume(&self) -> migration::Result<()> {
        self.paused.store(false, Ordering::Release);
        Ok(())
    }
    fn save_vcpus(&self) -> migration::Result<Vec<Vec<u8>>> {
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
}

struct Run {
    source_status: SharedStatus,
    result: migration::Result<()>,
    dest: Option<Arc<FakeVm>>,
    dest_error: Option<String>,
}

/// Migrates `src` to a fresh fake destination over a Unix socket.
fn migrate(src: &Arc<FakeVm>, params: MigrationParams, refuse: Option<&'static str>) -> Run {
    let dir = tempfile::tempdir().unwrap();
    let endpoint: Endpoint = format!("unix:{}", dir.path().join("m.sock").display())
        .parse()
        .unwrap();
    let pending = Incoming::Listen(endpoint.clone()).prepare().unwrap();
    let dest_thread = std::thread::spawn(move || {
        let stream = pending.accept()?;
        let status = SharedStatus::default();
        receive_migration(
            stream,
            |_| match refuse {
                Some(why) => Err(migration::Error::Vm(why.into())),
                None => Ok(FakeVm::new()),
            },
            |_| {},
            &status,
        )
        .map(|r| r.vm)
    });
    let status = SharedStatus::default();
    let result = send_migration(
        src.as_ref(),
        &endpoint,
        &params,
        &status,
        &Signals::default(),
    );
    let dest = dest_thread.join().unwrap();
    Run {
        source_status: status,
        result,
        dest_error: dest.as_ref().err().map(|e| e.to_string()),
        dest: dest.ok(),
    }
}

#[test]
fn precopy_moves_memory_exactly_while_the_guest_writes() {
    let src = FakeVm::new();
    // Some pages hold data before the migration; most are never touched.
    for pfn in 0..1024 {
        src.write_page(pfn, 0);
    }
    let stop = Arc::new(AtomicBool::new(false));
    let guest = src.start_guest(0, 512, stop.clone());
    let run = migrate(
        &src,
        MigrationParams {
            max_downtime_ms: 1,
            max_rounds: 6,
            ..Default::default()
        },
        None,
    );
    stop.store(true, Ordering::Release);
    guest.join().unwrap();
    run.result.expect("migration");
    let dest = run.dest.expect("destination VM");
    assert!(
        src.paused.load(Ordering::Acquire),
        "the source stays paused after handing over"
    );
    assert!(
        src.memory() == dest.memory(),
        "destination memory equals the source's at the switch"
    );
    let s = lock(&run.source_status).clone();
    assert_eq!(s.phase, MigrationPhase::Completed);
    assert_eq!(s.pages_skipped_unpopulated, PAGES - 1024);
    assert!(s.rounds.len() >= 2, "{:?}", s.rounds);
    assert!(s.pages_resent > 0);
    let state = dest.state.lock().unwrap().clone().unwrap();
    assert_eq!(state.0, vec![b"cpu0".to_vec(), b"cpu1".to_vec()]);
    assert_eq!(state.1, b"devices".to_vec());
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
    let run = migrate(
        &src,
        MigrationParams {
            mode: Mode::Warm,
            ..Default::default()
        },
        None,
    );
    run.result.expect("migration");
    let s = lock(&run.source_status).clone();
    assert_eq!((s.pages_full, s.pages_zero), (32, 32));
    assert!(src.memory() == run.dest.unwrap().memory());
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
    assert_eq!(lock(&run.source_status).phase, MigrationPhase::Failed);
}

#[test]
fn snapshot_file_restores_the_same_memory() {
    let src = FakeVm::new();
    for pfn in (0..PAGES).step_by(3) {
        src.write_page(pfn, 9);
    }
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("vm.ferry");
    let status = SharedStatus::default();
    save_snapshot(src.as_ref(), &file, &status).expect("snapshot");
    let pending = Incoming::Snapshot(file.clone()).prepare().unwrap();
    let restored = receive_migration(
        pending.accept().unwrap(),
        |_| Ok(FakeVm::new()),
        |_| {},
        &status,
    )
    .expect("restore")
    .vm;
    assert!(src.memory() == restored.memory());

    // A truncated snapshot is refused, and nothing is resumed.
    let bytes = std::fs::read(&file).unwrap();
    std::fs::write(&file, &bytes[..bytes.len() / 2]).unwrap();
    let pending = Incoming::Snapshot(file).prepare().unwrap();
    let fresh = FakeVm::new();
    let probe = fresh.clone();
    let err = receive_migration(
        pending.accept().unwrap(),
        move |_| Ok(fresh),
        |_| {},
        &status,
    )
    .err()
    .expect("truncated stream refused")
    .to_string();
    assert!(err.contains("truncated"), "{err}");
    assert!(probe.paused.load(Ordering::Acquire), "never resumed");
}
