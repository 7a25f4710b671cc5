//! A VM of plain memory and nothing else, for the harnesses: it holds RAM in the shape a
//! stream asks for (within limits a real destination would also set), an in-memory file for
//! each disk the stream names (which a migration that copies its disks fills), and remembers
//! whether it was ever resumed.

use std::sync::atomic::{AtomicBool, Ordering};

use migration::bitmap::Bitmap;
use migration::{
    DeviceDescriptor, Error, GuestRam, GuestReport, Migratable, PAGE_SIZE, RamRange, Result,
    VmDescriptor,
};

/// The most RAM a harness VM holds, and the highest address it may end at (a real VMM refuses
/// a VM that does not fit its host; this keeps each run small and fast).
const MAX_RAM: u64 = 32 << 20;
const MAX_GPA_END: u64 = 64 << 30;
/// As ferry's VMM (`vmm::vm::MAX_VCPUS`).
const MAX_VCPUS: u32 = 16;
/// The largest disk a harness VM holds (a real host holds what its operator gave it).
const MAX_DISK: u64 = 8 << 20;
const SECTOR: u64 = 512;

/// One region of fresh anonymous memory, mapped as a VMM maps guest RAM: no page is there
/// before something writes it (post-copy's userfaultfd fills missing pages only).
struct Block {
    ptr: *mut u8,
    len: usize,
}

impl Block {
    fn map(len: usize) -> Result<Self> {
        // SAFETY: a new private anonymous mapping; nothing else refers to it.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(Error::vm_caused(
                "mapping guest RAM",
                std::io::Error::last_os_error(),
            ));
        }
        Ok(Self {
            ptr: ptr.cast(),
            len,
        })
    }
}

impl Drop for Block {
    fn drop(&mut self) {
        // SAFETY: mapped with this length in `Block::map`, unmapped once.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

pub struct PlainVm {
    ram: GuestRam,
    vcpus: u32,
    /// The devices it was built with (as an empty VMM builds those a `Hello` names).
    devices: Vec<DeviceDescriptor>,
    /// Per device slot, a disk's file (in memory).
    disks: Vec<Option<std::fs::File>>,
    _blocks: Vec<Block>,
    running: AtomicBool,
    resumed: AtomicBool,
}

// SAFETY: the blocks are owned by the VM and only reached through `GuestRam`, which is
// Send + Sync under the engine's access rules.
unsafe impl Send for PlainVm {}
// SAFETY: as for `Send`.
unsafe impl Sync for PlainVm {}

impl PlainVm {
    /// RAM at pages [0, 16) and [24, 40): two regions with a hole between them.
    pub fn small() -> Self {
        let page = PAGE_SIZE as u64;
        Self::with_ranges(
            &[
                RamRange {
                    gpa: 0,
                    len: 16 * page,
                },
                RamRange {
                    gpa: 24 * page,
                    len: 16 * page,
                },
            ],
            1,
        )
        .expect("a valid shape")
    }

    /// The VM a stream's `Hello` describes, or the reason a destination refuses it.
    pub fn build(d: &VmDescriptor) -> Result<Self> {
        let total = d.ranges.iter().try_fold(0u64, |t, r| t.checked_add(r.len));
        if d.ranges.is_empty() || total.is_none_or(|t| t > MAX_RAM) || total != Some(d.memory_bytes)
        {
            return Err(Error::vm(format!("refusing a VM of {:?}", d.ranges)));
        }
        if d.ranges
            .iter()
            .any(|r| r.gpa.checked_add(r.len).is_none_or(|end| end > MAX_GPA_END))
        {
            return Err(Error::vm("RAM beyond what this host maps"));
        }
        if d.vcpus == 0 || d.vcpus > MAX_VCPUS {
            return Err(Error::vm(format!("{} vCPUs", d.vcpus)));
        }
        let disks = d
            .devices
            .iter()
            .map(|device| match device {
                DeviceDescriptor::Disk { sectors, .. } => {
                    let bytes = sectors.checked_mul(SECTOR).filter(|&b| b <= MAX_DISK);
                    let bytes = bytes.ok_or_else(|| Error::vm("a disk larger than this host's"))?;
                    let file = crate::memfd_with(&[]);
                    file.set_len(bytes)
                        .map_err(|e| Error::vm_caused("a disk", e))?;
                    Ok(Some(file))
                }
                _ => Ok(None),
            })
            .collect::<Result<_>>()?;
        Ok(Self {
            devices: d.devices.clone(),
            disks,
            ..Self::with_ranges(&d.ranges, d.vcpus)?
        })
    }

    /// `small`, with a disk in slot 0 holding `data` (whole sectors).
    pub fn small_with_disk(data: &[u8]) -> Self {
        let bytes = data.len() as u64;
        assert!(bytes.is_multiple_of(SECTOR) && bytes <= MAX_DISK);
        Self {
            devices: vec![DeviceDescriptor::Disk {
                path: "/fuzz/disk.img".into(),
                readonly: false,
                sectors: bytes / SECTOR,
            }],
            disks: vec![Some(crate::memfd_with(data))],
            ..Self::small()
        }
    }

    /// What the disk in `slot` holds.
    pub fn disk(&self, slot: usize) -> Option<Vec<u8>> {
        use std::os::unix::fs::FileExt;
        let file = self.disks.get(slot)?.as_ref()?;
        let mut data = vec![0; file.metadata().ok()?.len() as usize];
        file.read_exact_at(&mut data, 0).ok()?;
        Some(data)
    }

    fn disk_in(&self, slot: u32) -> Result<&std::fs::File> {
        let disk = self.disks.get(slot as usize).and_then(Option::as_ref);
        disk.ok_or_else(|| Error::vm(format!("slot {slot} holds no disk here")))
    }

    fn with_ranges(ranges: &[RamRange], vcpus: u32) -> Result<Self> {
        let mut blocks = Vec::new();
        let mut regions = Vec::new();
        for r in ranges {
            let block = Block::map((r.len as usize).max(PAGE_SIZE))?;
            regions.push((*r, block.ptr));
            blocks.push(block);
        }
        // SAFETY: each block is `len` bytes long and lives as long as the VM that holds the
        // `GuestRam`.
        let ram = unsafe { GuestRam::new(&regions) }?;
        Ok(Self {
            ram,
            vcpus,
            devices: Vec::new(),
            disks: Vec::new(),
            _blocks: blocks,
            running: AtomicBool::new(false),
            resumed: AtomicBool::new(false),
        })
    }

    pub fn ever_resumed(&self) -> bool {
        self.resumed.load(Ordering::Acquire)
    }
}

impl Migratable for PlainVm {
    fn descriptor(&self) -> VmDescriptor {
        VmDescriptor {
            memory_bytes: self.ram.len(),
            ranges: self.ram.ranges(),
            vcpus: self.vcpus,
            memory_backend: "anonymous".into(),
            running: self.is_running(),
            devices: self.devices.clone(),
            config: None,
        }
    }
    fn ram(&self) -> GuestRam {
        self.ram.clone()
    }
    fn is_running(&self) -> bool {
        self.running.load(Ordering::Acquire)
    }
    fn start_dirty_log(&self) -> Result<()> {
        Ok(())
    }
    /// Nothing writes a harness VM's memory while it runs: nothing is ever dirty.
    fn take_dirty(&self) -> Result<Bitmap> {
        Ok(Bitmap::new(self.ram.gfn_end()))
    }
    fn stop_dirty_log(&self) -> Result<()> {
        Ok(())
    }
    fn pause(&self) -> Result<()> {
        self.running.store(false, Ordering::Release);
        Ok(())
    }
    fn resume(&self) -> Result<()> {
        self.running.store(true, Ordering::Release);
        self.resumed.store(true, Ordering::Release);
        Ok(())
    }
    fn set_throttle(&self, _percent: u8) -> Result<()> {
        Ok(())
    }
    fn save_vcpus(&self) -> Result<Vec<Vec<u8>>> {
        Ok((0..self.vcpus)
            .map(|i| format!("vcpu{i}").into_bytes())
            .collect())
    }
    fn save_devices(&self) -> Result<Vec<u8>> {
        Ok(b"devices".to_vec())
    }
    fn load_state(&self, _vcpus: &[Vec<u8>], _devices: &[u8]) -> Result<()> {
        Ok(())
    }
    fn release_devices(&self, _keep_locks: bool) -> Result<()> {
        Ok(()) // no devices
    }
    fn device_files(&self) -> Vec<Option<std::os::fd::RawFd>> {
        Vec::new()
    }
    fn guest_progress_rate(&self, _: u64, _: u64) -> Option<f64> {
        None
    }
    fn guest_report(&self, _: u64, _: u64) -> GuestReport {
        GuestReport::default()
    }
    fn hold_page_discards(&self, _: bool) {}
    fn given_back(&self) -> Option<Bitmap> {
        None
    }
    /// No balloon: no driver to hint.
    fn start_free_page_hints(&self) -> bool {
        false
    }
    fn free_page_hints_finished(&self) -> bool {
        true
    }
    fn end_free_page_hints(&self) {}
    /// Nothing writes a harness VM's disks while it runs: no block is ever marked.
    fn log_disk_writes(&self) -> migration::Result<Vec<migration::CopiedDisk>> {
        let disks = self.disks.iter().enumerate();
        let disks = disks.filter_map(|(slot, file)| Some((slot as u32, file.as_ref()?)));
        disks
            .map(|(slot, file)| {
                let bytes = file
                    .metadata()
                    .map_err(|e| Error::vm_caused("a disk", e))?
                    .len();
                Ok(migration::CopiedDisk {
                    slot,
                    file: file
                        .try_clone()
                        .map_err(|e| Error::vm_caused("a disk", e))?,
                    bytes,
                    log: std::sync::Arc::new(migration::disk_log::BlockLog::new(bytes)),
                })
            })
            .collect()
    }
    fn end_disk_logs(&self) {}
    fn disk_targets(&self, slots: &[u32]) -> migration::Result<Vec<std::fs::File>> {
        slots
            .iter()
            .map(|&slot| {
                let file = self.disk_in(slot)?;
                file.try_clone().map_err(|e| Error::vm_caused("a disk", e))
            })
            .collect()
    }
}

/// The disk of the copy-storage seed (1 MiB): 64 KiB of data, 64 KiB of zeros, 192 KiB of
/// data, then zeros.
pub fn seed_disk() -> Vec<u8> {
    let mut disk = vec![0u8; 1 << 20];
    for (i, b) in disk.iter_mut().enumerate() {
        if i < 64 << 10 || (128 << 10..320 << 10).contains(&i) {
            *b = (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15).to_le_bytes()[7] | 1;
        }
    }
    disk
}
