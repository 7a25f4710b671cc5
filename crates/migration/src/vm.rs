//! What the engine needs from a VM, and guest RAM as the engine sees it.

use serde::{Deserialize, Serialize};

use crate::PAGE_SIZE;
use crate::bitmap::Bitmap;
use crate::error::Result;

/// The shape a destination must build before any page arrives.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct VmDescriptor {
    pub memory_bytes: u64,
    pub vcpus: u32,
    /// "anonymous" or "memfd".
    pub memory_backend: String,
}

/// The operations a migration performs on a VM. Every method is required: there is no
/// default that silently migrates nothing.
pub trait Migratable: Send + Sync {
    fn descriptor(&self) -> VmDescriptor;
    fn ram(&self) -> GuestRam;
    /// Starts tracking guest writes; the first `take_dirty` reports writes since this call.
    fn start_dirty_log(&self) -> Result<()>;
    /// Pages written since the last call (by the guest or by the VMM), and resets the set.
    fn take_dirty(&self) -> Result<Bitmap>;
    fn stop_dirty_log(&self) -> Result<()>;
    /// Parks every vCPU with complete state.
    fn pause(&self) -> Result<()>;
    fn resume(&self) -> Result<()>;
    /// Serialised state of each vCPU, in vCPU order; the VM must be paused.
    fn save_vcpus(&self) -> Result<Vec<Vec<u8>>>;
    /// Serialised state of everything besides memory and vCPUs.
    fn save_devices(&self) -> Result<Vec<u8>>;
    /// Loads what `save_vcpus`/`save_devices` produced on the source.
    fn load_state(&self, vcpus: &[Vec<u8>], devices: &[u8]) -> Result<()>;
    /// The guest's own work rate (e.g. pages touched per second) between two host times in
    /// ns since the epoch, when the guest reports progress; for application degradation.
    fn guest_progress_rate(&self, from_ns: u64, to_ns: u64) -> Option<f64>;
}

/// Guest memory as a raw host mapping (one region from guest-physical 0).
///
/// The guest writes it concurrently during live rounds; the engine reads pages with plain
/// loads and accepts torn pages, because every page written during a round is dirty and is sent
/// again later. The destination writes it only while its vCPUs are parked.
#[derive(Clone, Copy, Debug)]
pub struct GuestRam {
    base: *mut u8,
    len: usize,
}

// SAFETY: the mapping outlives every user (the VM owns it for the process lifetime), and
// concurrent access is the documented contract above.
unsafe impl Send for GuestRam {}
unsafe impl Sync for GuestRam {}

impl GuestRam {
    /// # Safety
    /// `base..base+len` must be a mapping that stays valid while this value is used.
    pub unsafe fn new(base: *mut u8, len: usize) -> Self {
        Self { base, len }
    }

    pub fn pages(&self) -> u64 {
        (self.len / PAGE_SIZE) as u64
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn base(&self) -> *mut u8 {
        self.base
    }

    /// The host address of page `pfn`; `pfn` must be below `pages()`.
    pub fn page_ptr(&self, pfn: u64) -> *mut u8 {
        debug_assert!(pfn < self.pages());
        // SAFETY: in bounds by the caller's contract.
        unsafe { self.base.add(pfn as usize * PAGE_SIZE) }
    }

    /// A view of page `pfn` for reading (it may change under us on a running source).
    pub fn page(&self, pfn: u64) -> &[u8] {
        // SAFETY: in bounds; see the type's note on concurrent writers.
        unsafe { std::slice::from_raw_parts(self.page_ptr(pfn), PAGE_SIZE) }
    }

    /// A page to write into; only while the VM's vCPUs are parked.
    #[allow(clippy::mut_from_ref)]
    pub fn page_mut(&self, pfn: u64) -> &mut [u8] {
        // SAFETY: in bounds; nobody else writes while vCPUs are parked.
        unsafe { std::slice::from_raw_parts_mut(self.page_ptr(pfn), PAGE_SIZE) }
    }
}
