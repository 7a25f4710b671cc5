//! Faulting guest memory in ahead of the pages. A fresh destination's memory is not there
//! yet: the receiver's first write to each page takes a page fault and the kernel clears the
//! page, which on a receiver bound by one core cost half its time (perf on a warm move of
//! 768 MiB). The source says which pages round 0 will send (`Populated`), and this thread
//! faults them in, in the order they come, while they travel.
//!
//! Faulting in never changes a page's content (MADV_POPULATE_WRITE on a present page does
//! nothing), so racing the receiver is harmless. It must end before any page is dropped or
//! guest memory is handed to userfaultfd: a page faulted in after its drop would read as
//! zeros instead of asking the source; `Prefaulter::finish` (also on drop) stops it there.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::JoinHandle;

use crate::PAGE_SIZE;
use crate::cpu::{CpuMeter, Work};
use crate::memory::GuestRam;
use crate::wire::bitmap::Bitmap;

/// Pages faulted in per call: small enough that a stop is heard within ~1 ms.
const CHUNK_PAGES: u64 = 512;

pub struct Prefaulter {
    stop: Arc<AtomicBool>,
    done: Arc<AtomicU64>,
    thread: Option<JoinHandle<()>>,
}

impl Prefaulter {
    /// Starts faulting in `pages` (in page order); the thread counts its CPU time in `cpu`.
    pub fn start(ram: GuestRam, pages: Bitmap, cpu: &CpuMeter) -> std::io::Result<Self> {
        let stop = Arc::new(AtomicBool::new(false));
        let done = Arc::new(AtomicU64::new(0));
        let (s, d, cpu) = (stop.clone(), done.clone(), cpu.clone());
        let thread = std::thread::Builder::new()
            .name("prefault".into())
            .spawn(move || {
                let _tracked = cpu.track(Work::Prefault);
                fault_in(&ram, &pages, &s, &d)
            })?;
        Ok(Self {
            stop,
            done,
            thread: Some(thread),
        })
    }

    /// Stops and waits for the thread; returns the pages it faulted in.
    pub fn finish(&mut self) -> u64 {
        self.stop.store(true, Ordering::Release);
        self.wait()
    }

    /// Waits for the thread to fault in all it was given (or to stop).
    fn wait(&mut self) -> u64 {
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        self.done.load(Ordering::Acquire)
    }
}

impl Drop for Prefaulter {
    fn drop(&mut self) {
        self.finish();
    }
}

fn fault_in(ram: &GuestRam, pages: &Bitmap, stop: &AtomicBool, done: &AtomicU64) {
    let mut run: Option<(u64, u64)> = None;
    let flush = |first: u64, n: u64| -> bool {
        if stop.load(Ordering::Acquire) {
            return false;
        }
        let Ok(p) = ram.host_ptr(first, n) else {
            return false;
        };
        // SAFETY: `n` pages of our own guest mapping; faulting in changes no content.
        let r = unsafe {
            libc::madvise(
                p as *mut libc::c_void,
                n as usize * PAGE_SIZE,
                libc::MADV_POPULATE_WRITE,
            )
        };
        if r != 0 {
            // Before Linux 5.14 (EINVAL) or out of memory: the receiver faults as before.
            tracing::debug!("prefault stopped: {}", std::io::Error::last_os_error());
            return false;
        }
        done.fetch_add(n, Ordering::Relaxed);
        true
    };
    for pfn in pages.iter() {
        run = match run {
            Some((first, n))
                if first + n == pfn && n < CHUNK_PAGES && ram.pages_to_region_end(first) > n =>
            {
                Some((first, n + 1))
            }
            Some((first, n)) => {
                if !flush(first, n) {
                    return;
                }
                Some((pfn, 1))
            }
            None => Some((pfn, 1)),
        };
    }
    if let Some((first, n)) = run {
        flush(first, n);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::RamRange;

    #[test]
    fn faults_in_the_pages_named_and_changes_none() {
        let len = 4usize << 20;
        // SAFETY: a fresh private mapping, unmapped at the end of the test.
        let host = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        assert_ne!(host, libc::MAP_FAILED);
        let range = RamRange {
            gpa: 0,
            len: len as u64,
        };
        // SAFETY: the mapping outlives `ram` (both end with this test).
        let ram = unsafe { GuestRam::new(&[(range, host.cast())]) }.unwrap();
        // A page the receiver already wrote keeps its content.
        ram.write_page(5, &[0xab; PAGE_SIZE]).unwrap();
        let mut pages = Bitmap::new(ram.gfn_end());
        for pfn in [1, 2, 3, 5, 700, 701] {
            pages.set(pfn);
        }
        let cpu = CpuMeter::default();
        let mut p = Prefaulter::start(ram.clone(), pages.clone(), &cpu).unwrap();
        assert_eq!(p.wait(), 6);
        let used = cpu.uses();
        assert_eq!((used[0].work.as_str(), used[0].threads), ("prefault", 1));
        let present = crate::scan::populated_pages(&ram).unwrap();
        assert_eq!(
            present.iter().collect::<Vec<_>>(),
            vec![1, 2, 3, 5, 700, 701]
        );
        assert!(ram.page(5).unwrap().iter().all(|&b| b == 0xab));
        assert!(ram.page(700).unwrap().iter().all(|&b| b == 0));
        // A stopped prefaulter faults nothing more in.
        let mut stopped = Prefaulter::start(ram.clone(), pages, &cpu).unwrap();
        stopped.finish();
        assert!(stopped.thread.is_none());
        // SAFETY: nothing uses the mapping any more.
        unsafe { libc::munmap(host, len) };
    }
}
