//! Installing round 0's pages without clearing them first. A fresh destination's page costs
//! the kernel an allocation and a clear before the receiver's copy overwrites it; with guest
//! memory registered with userfaultfd (missing pages), `UFFDIO_COPY` allocates the page and
//! copies the data into it in one step, a run of pages per call: one pass over the page
//! instead of two.
//!
//! Used where the host has no cores to spare for faulting in ahead (`prefault::plan`). While
//! registered, anything else that touches a missing page (nothing should: the vCPUs are
//! parked) is given a zero page at once by a thread here, as it would be unregistered, and a
//! later copy of that page overwrites it. So installing only saves work; it never changes
//! what memory holds. It ends, like faulting in ahead, before pages can be dropped or guest
//! memory handed to post-copy's userfaultfd (`release`).

use crate::sync::Locked;
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::JoinHandle;

use userfaultfd::{Uffd, UffdBuilder};

use super::postcopy::each_fault;

use crate::PAGE_SIZE;
use crate::error::{Error, Result};
use crate::memory::GuestRam;
use crate::pages::PagePlacer;

/// Installing round 0's pages: it ends with `finish` (or on drop); its zero filler runs until
/// this is dropped, which must come after every receiver has ended.
pub struct Installing(Arc<Installer>);

impl Installing {
    /// What the receivers put whole pages through.
    pub fn placer(&self) -> Arc<dyn PagePlacer> {
        self.0.clone()
    }

    /// Ends installing (see `Installer::release`): the pages installed and those something
    /// touched first, the first time.
    pub fn finish(&self) -> Option<(u64, u64)> {
        self.0.release()
    }
}

impl Drop for Installing {
    fn drop(&mut self) {
        self.0.release();
        self.0.stop.store(true, Ordering::Release);
        let filler = self.0.zero_filler.locked().take();
        if let Some(t) = filler {
            let _ = t.join();
        }
    }
}

pub struct Installer {
    ram: GuestRam,
    uffd: Arc<Uffd>,
    /// Registered: copies go through `UFFDIO_COPY`; afterwards, plain copies.
    active: AtomicBool,
    /// Released once: a later call must not unregister memory mapped anew since.
    released: AtomicBool,
    stop: Arc<AtomicBool>,
    zero_filler: Mutex<Option<JoinHandle<()>>>,
    /// Pages installed by `UFFDIO_COPY`, and pages something else touched first.
    installed: AtomicU64,
    touched: Arc<Mutex<Vec<u64>>>,
}

impl Installer {
    /// Registers `ram` for missing-page faults, with a thread that answers any with a zero
    /// page. Fails where userfaultfd is not available (then pages are faulted in ahead).
    pub fn start(ram: GuestRam) -> Result<Installing> {
        let uffd = UffdBuilder::new()
            .close_on_exec(true)
            .non_blocking(true)
            .user_mode_only(false)
            .create()
            .map_err(|e| Error::vm_caused("userfaultfd for installing pages", e))?;
        let uffd = Arc::new(uffd);
        let me = Arc::new(Self {
            ram,
            uffd: uffd.clone(),
            active: AtomicBool::new(false),
            released: AtomicBool::new(false),
            stop: Arc::new(AtomicBool::new(false)),
            zero_filler: Mutex::new(None),
            installed: AtomicU64::new(0),
            touched: Arc::default(),
        });
        // The zero filler runs before anything is registered: no fault ever waits unheard.
        let (stop, touched, ram) = (me.stop.clone(), me.touched.clone(), me.ram.clone());
        let filler = std::thread::Builder::new()
            .name("install-zeros".into())
            .spawn(move || fill_zeros(&uffd, &ram, &stop, &touched))
            .map_err(|e| Error::vm_caused("starting the zero filler", e))?;
        *me.zero_filler.locked() = Some(filler);
        let refused = me
            .ram
            .host_regions()
            .find_map(|(range, host)| me.uffd.register(host.cast(), range.len as usize).err());
        if let Some(e) = refused {
            drop(Installing(me)); // unregisters what was registered, stops the filler
            return Err(Error::vm_caused(
                "registering guest memory to install pages",
                e,
            ));
        }
        me.active.store(true, Ordering::Release);
        Ok(Installing(me))
    }

    /// Ends installing: later copies are plain ones. Returns the pages installed and those
    /// something touched first; `None` after the first call. The zero filler runs on (until
    /// `Installing` is dropped): a fault that came in just before, as a receiver copied while
    /// installing ended, may still wait with its event unread.
    fn release(&self) -> Option<(u64, u64)> {
        self.active.store(false, Ordering::Release);
        if self.released.swap(true, Ordering::AcqRel) {
            return None;
        }
        for (range, host) in self.ram.host_regions() {
            if let Err(e) = self.uffd.unregister(host.cast(), range.len as usize) {
                tracing::warn!(
                    "guest memory stays registered for installing: {}",
                    crate::error::chain(&e)
                );
            }
            // Woken, a fault still waiting retries on unregistered memory.
            let _ = self.uffd.wake(host.cast(), range.len as usize);
        }
        Some((
            self.installed.load(Ordering::Relaxed),
            self.touched().len() as u64,
        ))
    }
}

impl PagePlacer for Installer {
    fn installing(&self) -> bool {
        self.active.load(Ordering::Acquire)
    }

    fn touched(&self) -> Vec<u64> {
        self.touched.locked().clone()
    }

    fn place(&self, gfn: u64, data: &[u8]) -> Result<()> {
        let pages = (data.len() / PAGE_SIZE) as u64;
        let dst = self.ram.host_ptr(gfn, pages)?;
        if self.installing() {
            // SAFETY: `dst` is `data.len()` bytes of guest memory (checked by `host_ptr`),
            // registered unless installing has just ended (then the copy fails), and `data` a
            // distinct buffer of that length.
            let done = unsafe {
                self.uffd
                    .copy(data.as_ptr().cast(), dst.cast(), data.len(), true)
            };
            if matches!(done, Ok(n) if n == data.len()) {
                self.installed.fetch_add(pages, Ordering::Relaxed);
                return Ok(());
            }
            // A page of the run is there already (touched and zero-filled), or installing has
            // just ended: page by page, installed where missing, copied over where not.
            for (k, page) in data.chunks_exact(PAGE_SIZE).enumerate() {
                // SAFETY: one page of the run above, and its data.
                let p = unsafe { dst.add(k * PAGE_SIZE) };
                // SAFETY: as above.
                let done = unsafe {
                    self.uffd
                        .copy(page.as_ptr().cast(), p.cast(), PAGE_SIZE, true)
                };
                if matches!(done, Ok(PAGE_SIZE)) {
                    self.installed.fetch_add(1, Ordering::Relaxed);
                } else {
                    // SAFETY: as above; a missing page is zero-filled first.
                    unsafe { std::ptr::copy_nonoverlapping(page.as_ptr(), p, PAGE_SIZE) };
                }
            }
            return Ok(());
        }
        // SAFETY: as above; a missing page is zero-filled first while still registered.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), dst, data.len()) };
        Ok(())
    }
}

/// Answers every missing-page fault with a zero page until `stop`, noting the page.
fn fill_zeros(uffd: &Uffd, ram: &GuestRam, stop: &AtomicBool, touched: &Mutex<Vec<u64>>) {
    each_fault(uffd, stop, |page| {
        // SAFETY: a page of the registered range (the kernel reported a fault there).
        // Noted before the waiter wakes: whoever it tells next finds the page in `touched`.
        // An error means it was installed meanwhile: the waiter only needs waking.
        if unsafe { uffd.zeropage(page, PAGE_SIZE, false) }.is_ok()
            && let Some(gfn) = ram.gfn_of_host(page as u64)
        {
            touched.locked().push(gfn);
        }
        let _ = uffd.wake(page, PAGE_SIZE);
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::RamRange;

    /// Fresh anonymous memory of `pages` pages (unmapped on drop).
    struct Fresh {
        ptr: *mut u8,
        len: usize,
    }

    impl Fresh {
        fn new(pages: usize) -> Self {
            let len = pages * PAGE_SIZE;
            // SAFETY: a new private anonymous mapping.
            let ptr = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    len,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                    -1,
                    0,
                )
            };
            assert_ne!(ptr, libc::MAP_FAILED);
            Self {
                ptr: ptr.cast(),
                len,
            }
        }

        fn ram(&self) -> GuestRam {
            let r = RamRange {
                gpa: 0,
                len: self.len as u64,
            };
            // SAFETY: the mapping outlives the test's uses of the view.
            unsafe { GuestRam::new(&[(r, self.ptr)]) }.unwrap()
        }

        /// Whether page `gfn` is present (mincore).
        fn present(&self, gfn: usize) -> bool {
            let mut v = 0u8;
            // SAFETY: one page of our mapping, one byte of result.
            let r =
                unsafe { libc::mincore(self.ptr.add(gfn * PAGE_SIZE).cast(), PAGE_SIZE, &mut v) };
            assert_eq!(r, 0);
            v & 1 == 1
        }
    }

    impl Drop for Fresh {
        fn drop(&mut self) {
            // SAFETY: our own mapping.
            unsafe { libc::munmap(self.ptr.cast(), self.len) };
        }
    }

    fn pattern(pages: usize, seed: u8) -> Vec<u8> {
        (0..pages * PAGE_SIZE)
            .map(|i| (i / 7) as u8 ^ seed)
            .collect()
    }

    #[test]
    fn runs_are_installed_and_a_page_touched_first_is_overwritten() {
        let mem = Fresh::new(64);
        let ram = mem.ram();
        let Ok(installing) = Installer::start(ram.clone()) else {
            eprintln!("skipped: no userfaultfd here");
            return;
        };
        let installer = installing.placer();
        assert!(installer.installing());
        let data = pattern(16, 1);
        installer.place(8, &data).unwrap();
        assert!((8..24).all(|g| mem.present(g)));
        assert!(!mem.present(24), "nothing but the run is faulted in");
        // Another thread reads a missing page: it gets zeros at once, not a hang.
        let reader = ram.clone();
        let seen = std::thread::spawn(move || reader.page(40).unwrap().to_vec())
            .join()
            .unwrap();
        assert!(seen.iter().all(|&b| b == 0));
        // Its data then lands over the zero page, with a run around it.
        let data2 = pattern(4, 2);
        installer.place(39, &data2).unwrap();
        assert_eq!(ram.pages_slice(39, 4).unwrap(), &data2[..]);
        assert_eq!(ram.pages_slice(8, 16).unwrap(), &data[..]);
        // A page written twice holds the second copy.
        let data3 = pattern(1, 3);
        installer.place(10, &data3).unwrap();
        assert_eq!(ram.page(10).unwrap(), &data3[..]);
        assert_eq!(installer.touched(), [40]);
        let (installed, zero_filled) = installing.finish().expect("the first finish");
        // The first run whole, then 41 and 42 one by one beside the zero-filled 40 (39 went
        // in with the copy that stopped at 40, which counts no page).
        assert_eq!(installed, 18, "pages installed by UFFDIO_COPY");
        assert_eq!(zero_filled, 1, "the page read first");
        // Released: a plain copy, and a missing page reads as zeros without any filler.
        assert!(!installer.installing());
        installer.place(50, &data3).unwrap();
        assert_eq!(ram.page(50).unwrap(), &data3[..]);
        assert!(ram.page(60).unwrap().iter().all(|&b| b == 0));
        assert_eq!(installing.finish(), None, "released once");
        drop(installing);
        assert!(!installer.installing());
    }
}
