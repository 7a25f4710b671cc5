//! Post-copy's pushed pages, installed on several threads. Installing a page (`UFFDIO_COPY`:
//! the kernel allocates a page, copies into it and maps it) costs many times the CPU of
//! reading it off a connection, most of it the first write to memory the host has not used
//! yet; a connection whose reader also installs is held to one core. Readers hand whole
//! frames here and read on; the frames come back empty, to be read into again.

use std::sync::mpsc::{Receiver, SyncSender, sync_channel};
use std::sync::{Arc, Mutex};
use std::thread::Scope;

use crate::cpu::{CpuMeter, Work, Worker};
use crate::error::{Error, Result};
use crate::sync::Locked;
use crate::wire::page_frame::FrameBuffers;

/// At most this many installing threads, however many cores.
const MOST: usize = 8;

/// Frames queued per installing thread: enough to keep each busy while a reader reads the
/// next, few enough that a fault on a queued page waits little (its frame is near the front).
const QUEUED_EACH: usize = 2;

/// How many threads install: one per core (the vCPUs and the readers take turns with them),
/// at least two, at most `MOST`.
pub(super) fn how_many() -> usize {
    std::thread::available_parallelism().map_or(2, |n| n.get().clamp(2, MOST))
}

/// The installing threads of one post-copy, and the frames going to and coming back from them.
pub(super) struct Installers {
    /// `None`: no thread could start.
    queue: Option<SyncSender<FrameBuffers>>,
    empty: Arc<Mutex<Vec<FrameBuffers>>>,
}

impl Installers {
    /// Starts `threads` threads in `scope` (tracked by `cpu`), each calling `install` on one
    /// frame at a time and `fail` with the first error it meets (it then drops what comes, so
    /// no reader blocks). They end when this is dropped and the queue is empty.
    pub fn start<'scope, 'env, I, F>(
        scope: &'scope Scope<'scope, 'env>,
        threads: usize,
        cpu: &CpuMeter,
        install: &'env I,
        fail: &'env F,
    ) -> Self
    where
        I: Fn(&FrameBuffers) -> Result<()> + Sync,
        F: Fn(Error) + Sync,
    {
        let (queue, frames) = sync_channel(threads * QUEUED_EACH);
        let frames = Arc::new(Mutex::new(frames));
        let empty = Arc::new(Mutex::new(Vec::new()));
        let mut running = 0;
        for i in 0..threads {
            let (frames, empty, cpu) = (frames.clone(), empty.clone(), cpu.clone());
            let spawned = std::thread::Builder::new()
                .name(format!("postcopy-install-{i}"))
                .spawn_scoped(scope, move || {
                    let _tracked = cpu.track(Work::Install, Worker::Own);
                    install_each(&frames, &empty, install, fail);
                });
            match spawned {
                Ok(_) => running += 1,
                Err(e) => tracing::warn!("post-copy installs on fewer threads: {e}"),
            }
        }
        Installers {
            queue: (running > 0).then_some(queue),
            empty,
        }
    }

    /// Whether any thread runs (if none could start, readers install themselves).
    pub fn running(&self) -> bool {
        self.queue.is_some()
    }

    /// Buffers to read the next frame into: one an installer emptied, or new ones.
    pub fn buffers(&self) -> FrameBuffers {
        self.empty.locked().pop().unwrap_or_default()
    }

    /// Queues `frame` for the installers (waiting while the queue is full).
    pub fn hand_over(&self, frame: FrameBuffers) -> Result<()> {
        let queue = self.queue.as_ref().ok_or_else(gone)?;
        queue.send(frame).map_err(|_| gone())
    }
}

fn gone() -> Error {
    Error::vm("post-copy's installing threads have stopped")
}

fn install_each(
    frames: &Mutex<Receiver<FrameBuffers>>,
    empty: &Mutex<Vec<FrameBuffers>>,
    install: &(impl Fn(&FrameBuffers) -> Result<()> + Sync),
    fail: &(impl Fn(Error) + Sync),
) {
    let _ahead = crate::urgent::ahead();
    let mut failed = false;
    loop {
        // The lock is held only while waiting for the next frame, never while installing.
        let next = frames.locked().recv();
        let Ok(frame) = next else { return };
        if !failed && let Err(e) = install(&frame) {
            failed = true;
            fail(e);
        }
        empty.locked().push(frame);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// Hands `frames` empty frames to `threads` installers; returns the install calls and
    /// the failures reported.
    fn run(threads: usize, frames: usize, result: fn() -> Result<()>) -> (usize, usize) {
        let (calls, failures) = (AtomicUsize::new(0), AtomicUsize::new(0));
        let install = |_: &FrameBuffers| {
            calls.fetch_add(1, Ordering::Relaxed);
            result()
        };
        let fail = |_: Error| {
            failures.fetch_add(1, Ordering::Relaxed);
        };
        std::thread::scope(|scope| {
            let cpu = CpuMeter::default();
            let installers = Installers::start(scope, threads, &cpu, &install, &fail);
            assert!(installers.running());
            for _ in 0..frames {
                let frame = installers.buffers();
                installers.hand_over(frame).unwrap();
            }
        });
        (calls.into_inner(), failures.into_inner())
    }

    #[test]
    fn every_frame_handed_over_is_installed_before_the_scope_ends() {
        assert_eq!(run(3, 200, || Ok(())), (200, 0));
    }

    #[test]
    fn a_failing_installer_reports_once_and_never_blocks_the_readers() {
        let (calls, failures) = run(2, 100, || Err(Error::vm("no memory")));
        // Each thread installs until its first failure, then drops what comes.
        assert!((1..=2).contains(&calls), "{calls} install calls");
        assert_eq!(failures, calls);
    }
}
