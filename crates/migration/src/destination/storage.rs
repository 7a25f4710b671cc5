//! `copy_storage` on the destination: the disks `Storage` names take their blocks from the
//! stream, written to this host's disk in the same slot (the file or device its operator
//! gave), which is locked here before `Ready`. They are flushed before the source pauses
//! (`Sync`) and again before the VM's state is loaded; a migration that fails before `Go`
//! leaves them unused (the VM runs on at the source).

use std::cell::RefCell;
use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;

use crate::bitmap::Bitmap;
use crate::copies::Copies;
use crate::disk_log::{DISK_BLOCK, RUN_BLOCKS};
use crate::error::{Error, Result};
use crate::vm::{DeviceDescriptor, Migratable, VmDescriptor};
use crate::wire::codec::Codec;

/// Zeros are written in pieces of this size where a range cannot be discarded.
const ZERO_CHUNK: u64 = 1 << 20;
/// Write-back of what arrived is started every this many bytes: in large batches, so that
/// the disk writes while more arrives and the flush before the pause finds little left.
const WRITE_BACK_EVERY: u64 = 32 << 20;
const SECTOR: u64 = 512;

struct Target {
    slot: u32,
    file: File,
    bytes: u64,
    /// Bytes written since write-back was last started.
    unstarted: std::cell::Cell<u64>,
    /// Copies of each block that landed, where a broken connection may be carried on.
    copies: Option<Copies>,
}

/// This host's disks that the stream fills.
pub(crate) struct DiskTargets {
    targets: Vec<Target>,
    /// Where a packed run is unpacked to.
    unpacked: RefCell<Vec<u8>>,
}

impl DiskTargets {
    /// Checks that each slot of `slots` holds a disk of the VM described and takes this
    /// host's disk there: locked, open for writing.
    pub fn open(vm: &dyn Migratable, slots: &[u32], described: &VmDescriptor) -> Result<Self> {
        let mut sizes = Vec::with_capacity(slots.len());
        for (i, &slot) in slots.iter().enumerate() {
            if slots[..i].contains(&slot) {
                return Err(Error::Protocol(format!(
                    "Storage names disk slot {slot} twice"
                )));
            }
            match described.devices.get(slot as usize) {
                // The VM's devices were checked equal to this host's (`check_devices`), so
                // this is this host's disk's size too.
                Some(DeviceDescriptor::Disk { sectors, .. }) => {
                    sizes.push(sectors.saturating_mul(SECTOR));
                }
                Some(other) => {
                    return Err(Error::Protocol(format!(
                        "Storage names slot {slot}, which holds a {}, not a disk",
                        other.kind()
                    )));
                }
                None => {
                    return Err(Error::Protocol(format!(
                        "Storage names slot {slot} of a VM with {} devices",
                        described.devices.len()
                    )));
                }
            }
        }
        let files = vm.disk_targets(slots)?;
        let targets = slots
            .iter()
            .zip(files)
            .zip(sizes)
            .map(|((&slot, file), bytes)| Target {
                slot,
                file,
                bytes,
                unstarted: std::cell::Cell::new(0),
                copies: None,
            })
            .collect();
        Ok(Self {
            targets,
            unpacked: RefCell::new(Vec::new()),
        })
    }

    /// Counts the copies of each block that land, for a source that carries a broken
    /// connection on (`blocks_held`).
    pub fn counting_copies(mut self) -> Self {
        for t in &mut self.targets {
            t.copies = Some(Copies::new(t.bytes.div_ceil(DISK_BLOCK)));
        }
        self
    }

    /// Per disk, in the order `Storage` named them, the copies of each block that landed
    /// (`None`: not counted).
    pub fn blocks_held(&self) -> Option<Vec<Vec<(u16, u32)>>> {
        self.targets
            .iter()
            .map(|t| {
                let copies = t.copies.as_ref()?;
                Some(copies.runs(&Bitmap::new(t.bytes.div_ceil(DISK_BLOCK))))
            })
            .collect()
    }

    /// The disk in `slot` and the range checked to lie inside it, sector aligned.
    fn target(&self, slot: u32, offset: u64, len: u64) -> Result<&Target> {
        let t = self
            .targets
            .iter()
            .find(|t| t.slot == slot)
            .ok_or_else(|| {
                Error::Protocol(format!(
                    "disk blocks for slot {slot}, which Storage did not name"
                ))
            })?;
        let inside = offset.checked_add(len).is_some_and(|end| end <= t.bytes);
        if !inside || !offset.is_multiple_of(SECTOR) || !len.is_multiple_of(SECTOR) {
            return Err(Error::Protocol(format!(
                "disk blocks at bytes {offset}..+{len} of slot {slot}, a disk of {} bytes in \
                 {SECTOR}-byte sectors",
                t.bytes
            )));
        }
        Ok(t)
    }

    pub fn write(&self, slot: u32, offset: u64, data: &[u8]) -> Result<()> {
        let t = self.target(slot, offset, data.len() as u64)?;
        t.file
            .write_all_at(data, offset)
            .map_err(|e| Error::vm_caused(format!("writing disk {slot} at byte {offset}"), e))?;
        t.landed(offset, data.len() as u64);
        let unstarted = t.unstarted.get() + data.len() as u64;
        t.unstarted.set(unstarted % WRITE_BACK_EVERY);
        if unstarted >= WRITE_BACK_EVERY {
            // A hint, in the background: `sync` reports any failure.
            // SAFETY: sync_file_range on a descriptor this value owns (0, 0: the whole
            // file); it only starts write-back.
            unsafe { libc::sync_file_range(t.file.as_raw_fd(), 0, 0, libc::SYNC_FILE_RANGE_WRITE) };
        }
        Ok(())
    }

    /// A run packed by `codec` into `packed`, `len` bytes once unpacked, written at `offset`.
    pub fn write_packed(
        &self,
        (slot, offset): (u32, u64),
        codec: Codec,
        len: u32,
        packed: &[u8],
    ) -> Result<()> {
        let len = len as usize;
        if len as u64 > RUN_BLOCKS * DISK_BLOCK {
            return Err(Error::Protocol(format!(
                "a packed run of {len} bytes for disk {slot}, more than the {} a run may hold",
                RUN_BLOCKS * DISK_BLOCK
            )));
        }
        let mut unpacked = self.unpacked.borrow_mut();
        unpacked.resize(len, 0);
        // Into exactly `len` bytes, at least `len` of them: nothing else is taken.
        codec.decompress(packed, &mut unpacked, len)?;
        self.write(slot, offset, &unpacked)
    }

    /// `len` bytes at `offset` read as zeros: discarded, or written as zeros where the disk
    /// cannot discard.
    pub fn zero(&self, slot: u32, offset: u64, len: u64) -> Result<()> {
        let t = self.target(slot, offset, len)?;
        if len == 0 || punch(&t.file, offset, len).is_ok() {
            t.landed(offset, len);
            return Ok(());
        }
        let zeros = vec![0u8; ZERO_CHUNK.min(len) as usize];
        let mut at = offset;
        while at < offset + len {
            let n = ZERO_CHUNK.min(offset + len - at) as usize;
            t.file
                .write_all_at(&zeros[..n], at)
                .map_err(|e| Error::vm_caused(format!("zeroing disk {slot} at byte {at}"), e))?;
            at += n as u64;
        }
        t.landed(offset, len);
        Ok(())
    }

    /// Makes what arrived durable, before the VM may run on it.
    pub fn sync(&self) -> Result<()> {
        for t in &self.targets {
            t.file
                .sync_data()
                .map_err(|e| Error::vm_caused(format!("flushing disk {}", t.slot), e))?;
        }
        Ok(())
    }
}

impl Target {
    /// `len` bytes at `offset` are on the disk: one more copy of each block they touch (the
    /// source sends whole blocks, so a block lands in one piece).
    fn landed(&self, offset: u64, len: u64) {
        if let Some(copies) = &self.copies {
            copies.add_range(offset / DISK_BLOCK..(offset + len).div_ceil(DISK_BLOCK));
        }
    }
}

/// Deallocates a range so that it reads as zeros, the file's size kept.
fn punch(file: &File, offset: u64, len: u64) -> std::io::Result<()> {
    let mode = libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE;
    // SAFETY: fallocate on a descriptor this value owns.
    let r = unsafe {
        libc::fallocate(
            file.as_raw_fd(),
            mode,
            offset as libc::off_t,
            len as libc::off_t,
        )
    };
    if r != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}
