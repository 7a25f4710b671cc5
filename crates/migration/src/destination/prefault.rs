//! Faulting guest memory in ahead of the pages. A fresh destination's memory is not there
//! yet: the receiver's first write to each page takes a page fault and the kernel clears the
//! page, which costs a receiver bound by one core a large share of its time. The source says which pages round 0 will send (`Populated`), and these threads
//! fault them in, 2 MiB at a time in page order (each thread takes the next 2 MiB), while
//! they travel.
//!
//! Faulting in never changes a page's content (MADV_POPULATE_WRITE on a present page does
//! nothing), so racing the receiver is harmless. It must end before any page is dropped or
//! guest memory is handed to userfaultfd: a page faulted in after its drop would read as
//! zeros instead of asking the source; `Prefaulter::finish` (also on drop) stops it there.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::JoinHandle;

use crate::PAGE_SIZE;
use crate::bitmap::Bitmap;
use crate::cpu::{CpuMeter, Work, Worker};
use crate::memory::GuestRam;

/// Pages a thread takes at a time (2 MiB, one call or a few): small enough that a stop is
/// heard within ~1 ms.
const CHUNK_PAGES: u64 = 512;
const CHUNK_WORDS: usize = (CHUNK_PAGES / 64) as usize;
const _: () = assert!(
    CHUNK_PAGES.is_multiple_of(64),
    "a chunk is whole bitmap words"
);

/// How many threads fault in for `connections` receivers on a host of `host_cores`: two per
/// receiver (on a 2-core host one thread faulted in 4.3 GB/s and two 8.5, where a plain
/// stream moves 5.5 GB/s into a reused buffer: one could not keep ahead of a receiver), on
/// the cores the receivers leave, and at least one.
pub fn threads_for(connections: u32, host_cores: usize) -> usize {
    let receivers = connections.max(1) as usize;
    (2 * receivers)
        .min(host_cores.saturating_sub(receivers))
        .max(1)
}

/// How round 0's pages meet a destination's fresh memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Plan {
    /// Faulted in ahead of their data on this many threads, beside the receivers.
    Ahead(usize),
    /// Installed by the receivers themselves without clearing first (`install`).
    Install,
}

/// What the caller asks for: `Auto` chooses by the host's cores (`plan`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum FaultIn {
    #[default]
    Auto,
    Ahead,
    Install,
}

/// Faulting in ahead where the host has two cores per receiver to spare: it runs beside the
/// receivers. Where it has not, installing, which clears no page but runs on the receivers'
/// own threads: with several receivers, what a host short of cores needs; one receiver alone
/// installing was slower on 2 cores, as every fault (the host's own included) then waits on
/// its one thread.
pub fn plan(asked: FaultIn, connections: u32, host_cores: usize) -> Plan {
    let threads = threads_for(connections, host_cores);
    match asked {
        FaultIn::Ahead => Plan::Ahead(threads),
        FaultIn::Install => Plan::Install,
        FaultIn::Auto if connections > 1 && threads < 2 * connections as usize => Plan::Install,
        FaultIn::Auto => Plan::Ahead(threads),
    }
}

pub struct Prefaulter {
    shared: Arc<Shared>,
    threads: Vec<JoinHandle<()>>,
}

/// What the threads share: the pages, the next chunk to take, a stop, and the pages done.
struct Shared {
    ram: GuestRam,
    pages: Bitmap,
    next_chunk: AtomicU64,
    stop: AtomicBool,
    done: AtomicU64,
}

impl Prefaulter {
    /// Starts faulting in `pages` on `threads` threads, which count their CPU in `cpu`.
    pub fn start(
        ram: GuestRam,
        pages: Bitmap,
        threads: usize,
        cpu: &CpuMeter,
    ) -> std::io::Result<Self> {
        let shared = Arc::new(Shared {
            ram,
            pages,
            next_chunk: AtomicU64::new(0),
            stop: AtomicBool::new(false),
            done: AtomicU64::new(0),
        });
        let mut me = Self {
            shared: shared.clone(),
            threads: Vec::new(),
        };
        for i in 0..threads.max(1) {
            let (shared, cpu) = (shared.clone(), cpu.clone());
            // On a failed start the threads already running are stopped by `Drop`.
            let t = std::thread::Builder::new()
                .name(format!("prefault-{i}"))
                .spawn(move || {
                    let _tracked = cpu.track(Work::Prefault, Worker::Own);
                    shared.fault_in();
                })?;
            me.threads.push(t);
        }
        Ok(me)
    }

    /// Stops and waits for the threads; returns the pages they faulted in.
    pub fn finish(&mut self) -> u64 {
        self.shared.stop.store(true, Ordering::Release);
        self.wait()
    }

    /// Waits for the threads to fault in all they were given (or to stop).
    fn wait(&mut self) -> u64 {
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
        self.shared.done.load(Ordering::Acquire)
    }
}

impl Drop for Prefaulter {
    fn drop(&mut self) {
        self.finish();
    }
}

impl Shared {
    /// Takes chunks in page order until none is left, or a stop.
    fn fault_in(&self) {
        let words = self.pages.word_count();
        loop {
            let chunk = self.next_chunk.fetch_add(1, Ordering::Relaxed) as usize;
            let first_word = chunk.saturating_mul(CHUNK_WORDS);
            if first_word >= words || !self.chunk(first_word) {
                return;
            }
        }
    }

    /// Faults in the pages of the chunk from `first_word`, in runs; false to stop.
    fn chunk(&self, first_word: usize) -> bool {
        let last_word = (first_word + CHUNK_WORDS).min(self.pages.word_count());
        let mut run: Option<(u64, u64)> = None;
        for (w, mut bits) in (first_word..last_word)
            .map(|i| self.pages.word(i))
            .enumerate()
        {
            while bits != 0 {
                let pfn = (first_word + w) as u64 * 64 + u64::from(bits.trailing_zeros());
                bits &= bits - 1;
                run = match run {
                    Some((first, n))
                        if first + n == pfn && self.ram.pages_to_region_end(first) > n =>
                    {
                        Some((first, n + 1))
                    }
                    Some((first, n)) => {
                        if !self.flush(first, n) {
                            return false;
                        }
                        Some((pfn, 1))
                    }
                    None => Some((pfn, 1)),
                };
            }
        }
        run.is_none_or(|(first, n)| self.flush(first, n))
    }

    /// Faults in `n` pages from `first` (one region); false to stop.
    fn flush(&self, first: u64, n: u64) -> bool {
        if self.stop.load(Ordering::Acquire) {
            return false;
        }
        // Never outside RAM (the map was checked against it); were it, all would stop.
        let Ok(p) = self.ram.host_ptr(first, n) else {
            self.stop.store(true, Ordering::Release);
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
            // Before Linux 5.14 (EINVAL) or out of memory: the receivers fault as before.
            tracing::debug!("prefault stopped: {}", std::io::Error::last_os_error());
            self.stop.store(true, Ordering::Release);
            return false;
        }
        self.done.fetch_add(n, Ordering::Relaxed);
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::RamRange;
    use crate::memory::test_support::mapping;

    #[test]
    fn faults_in_the_pages_named_and_changes_none() {
        // Two regions of two mappings, the second right after the first in guest memory
        // (pages 0..1024, 1024..2048), so a run of pages must stop at the join; pages on both
        // sides of it and of 2 MiB chunk boundaries.
        let len = 4usize << 20;
        let named = [
            1, 2, 3, 5, 511, 512, 513, 700, 1022, 1023, 1024, 1025, 1535, 1536, 2047,
        ];
        for threads in [1, 3] {
            let (low, high) = (mapping(len), mapping(len));
            let ranges = [
                (
                    RamRange {
                        gpa: 0,
                        len: len as u64,
                    },
                    low.cast(),
                ),
                (
                    RamRange {
                        gpa: len as u64,
                        len: len as u64,
                    },
                    high.cast(),
                ),
            ];
            // SAFETY: the mappings outlive `ram` (both end with this loop's turn).
            let ram = unsafe { GuestRam::new(&ranges) }.unwrap();
            // As on a destination: 4 KiB pages only, so faulting in one brings in no other.
            ram.forbid_huge_pages();
            // A page the receiver already wrote keeps its content.
            ram.write_page(5, &[0xab; PAGE_SIZE]).unwrap();
            let mut pages = Bitmap::new(ram.gfn_end());
            for pfn in named {
                pages.set(pfn);
            }
            let cpu = CpuMeter::default();
            let mut p = Prefaulter::start(ram.clone(), pages.clone(), threads, &cpu).unwrap();
            assert_eq!(p.wait(), named.len() as u64, "{threads} threads");
            let used = cpu.uses();
            assert_eq!(used[0].work, "prefault");
            assert_eq!(used[0].threads, threads as u32);
            let present = crate::scan::populated_pages(&ram).unwrap();
            assert_eq!(
                present.iter().collect::<Vec<_>>(),
                named,
                "{threads} threads"
            );
            assert!(ram.page(5).unwrap().iter().all(|&b| b == 0xab));
            assert!(ram.page(700).unwrap().iter().all(|&b| b == 0));
            // SAFETY: nothing uses the mappings any more.
            unsafe {
                libc::munmap(low, len);
                libc::munmap(high, len);
            }
        }
    }

    #[test]
    fn two_threads_per_receiver_on_the_cores_the_receivers_leave() {
        assert_eq!(threads_for(1, 16), 2);
        assert_eq!(threads_for(4, 16), 8);
        assert_eq!(threads_for(8, 16), 8);
        assert_eq!(threads_for(16, 16), 1);
        assert_eq!(threads_for(1, 2), 1);
        assert_eq!(threads_for(0, 1), 1);
    }

    #[test]
    fn installs_where_the_cores_for_faulting_in_ahead_are_missing() {
        assert_eq!(plan(FaultIn::Auto, 1, 16), Plan::Ahead(2));
        assert_eq!(plan(FaultIn::Auto, 4, 16), Plan::Ahead(8));
        assert_eq!(plan(FaultIn::Auto, 8, 16), Plan::Install);
        assert_eq!(plan(FaultIn::Auto, 1, 2), Plan::Ahead(1));
        assert_eq!(plan(FaultIn::Auto, 2, 2), Plan::Install);
        assert_eq!(plan(FaultIn::Auto, 5, 16), Plan::Ahead(10));
        assert_eq!(plan(FaultIn::Auto, 6, 16), Plan::Install);
        assert_eq!(plan(FaultIn::Ahead, 1, 2), Plan::Ahead(1));
        assert_eq!(plan(FaultIn::Install, 1, 16), Plan::Install);
    }
}
