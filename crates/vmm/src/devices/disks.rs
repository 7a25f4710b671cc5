//! The VM's disks as a migration that copies them sees them (`copy_storage`): on the source,
//! each disk's writes logged and a file to read it through; on the destination, this host's
//! disk in each slot locked and opened for what arrives.

use std::fs::{File, OpenOptions};
use std::os::fd::BorrowedFd;
use std::sync::Arc;

use migration::disk_log::BlockLog;
use migration::{CopiedDisk, DeviceDescriptor};

use super::DeviceBus;
use crate::devices::virtio::block::SECTOR;

impl DeviceBus {
    /// Every disk, its writes logged from now on.
    pub fn log_disk_writes(&self) -> Result<Vec<CopiedDisk>, String> {
        let mut disks = Vec::new();
        for (slot, d) in self.virtio.iter().enumerate() {
            let mut d = d.lock();
            let DeviceDescriptor::Disk { sectors, .. } = d.device().descriptor() else {
                continue;
            };
            let Some(fd) = d.device().file() else {
                continue;
            };
            // SAFETY: the disk's descriptor stays open while its device lives (we hold its
            // lock); this makes a descriptor of our own on the same file.
            let file = unsafe { BorrowedFd::borrow_raw(fd) }
                .try_clone_to_owned()
                .map_err(|e| format!("disk {slot}: a descriptor to read it through: {e}"))?;
            let bytes = sectors * SECTOR;
            let log = Arc::new(BlockLog::new(bytes));
            d.device_mut().log_writes(Some(log.clone()));
            disks.push(CopiedDisk {
                slot: slot as u32,
                file: File::from(file),
                bytes,
                log,
            });
        }
        Ok(disks)
    }

    /// No disk logs its writes any more.
    pub fn end_disk_logs(&self) {
        for d in &self.virtio {
            d.lock().device_mut().log_writes(None);
        }
    }

    /// This host's disk in each slot of `slots`: locked for this VM, open for writing.
    pub fn disk_targets(&self, slots: &[u32]) -> Result<Vec<File>, String> {
        slots.iter().map(|&slot| self.disk_target(slot)).collect()
    }

    fn disk_target(&self, slot: u32) -> Result<File, String> {
        let d = self
            .virtio
            .get(slot as usize)
            .ok_or_else(|| format!("no device in slot {slot} here to take a disk"))?;
        let mut d = d.lock();
        let path = match (d.device().descriptor(), d.device().backing()) {
            (DeviceDescriptor::Disk { .. }, Some(path)) => path.to_path_buf(),
            _ => return Err(format!("slot {slot} holds no disk here")),
        };
        d.device_mut().claim().map_err(|e| e.to_string())?;
        OpenOptions::new()
            .write(true)
            .open(&path)
            .map_err(|e| format!("cannot open disk {} for what arrives: {e}", path.display()))
    }
}
