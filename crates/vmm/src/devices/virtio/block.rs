//! virtio-blk on a file or block device (`ferry run --disk path=FILE[,readonly]`): read,
//! write, flush and get-id, served synchronously (see the module above).
//!
//! A disk is shared storage: the same file may be open on two hosts across a migration. An
//! advisory lock (`flock`, as QEMU's image locking) keeps a second writer out: a VM that boots
//! takes it at once; a VM that arrives takes it as it loads the VM's state, after the source,
//! paused for the switch, has flushed and let go of it.

use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use migration::disk_log::BlockLog;
use virtio_bindings::virtio_blk::{
    VIRTIO_BLK_F_FLUSH, VIRTIO_BLK_F_RO, VIRTIO_BLK_ID_BYTES, VIRTIO_BLK_S_IOERR, VIRTIO_BLK_S_OK,
    VIRTIO_BLK_S_UNSUPP, VIRTIO_BLK_T_FLUSH, VIRTIO_BLK_T_GET_ID, VIRTIO_BLK_T_IN,
    VIRTIO_BLK_T_OUT,
};
use virtio_bindings::virtio_config::VIRTIO_F_VERSION_1;
use virtio_bindings::virtio_ids::VIRTIO_ID_BLOCK;
use virtio_queue::Queue;
use virtio_queue::desc::split::Descriptor;
use vm_memory::{Bytes, GuestAddress};

use super::{DriverError, VirtioDevice, WriteLog, outside, read_config_bytes, serve_chains};
use crate::memory::GuestMemory;

pub const SECTOR: u64 = 512;
const QUEUE_SIZE: u16 = 256;
/// Data moves between the file and guest memory in pieces of this size (a descriptor may
/// name gigabytes; the VMM never allocates what a guest asks).
const CHUNK: usize = 64 << 10;

/// `--disk path=FILE[,readonly]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DiskConfig {
    pub path: PathBuf,
    pub readonly: bool,
}

impl std::str::FromStr for DiskConfig {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let mut path = None;
        let mut readonly = false;
        for part in s.split(',') {
            match part.split_once('=') {
                Some(("path", p)) if !p.is_empty() => path = Some(PathBuf::from(p)),
                None if part == "readonly" => readonly = true,
                _ => {
                    return Err(format!(
                        "'{part}' in --disk '{s}' (use path=FILE[,readonly])"
                    ));
                }
            }
        }
        let path = path.ok_or_else(|| format!("--disk '{s}' names no path= (use path=FILE)"))?;
        Ok(Self { path, readonly })
    }
}

pub struct Block {
    file: File,
    path: PathBuf,
    readonly: bool,
    sectors: u64,
    locked: bool,
    /// The lock is shared with the process a live update passed the file to: it is that
    /// process's to let go of, not this one's.
    lock_passed_on: bool,
    /// Where a migration that copies the disk learns what the guest wrote.
    log: Option<Arc<BlockLog>>,
    /// Where data passes between the file and guest memory (kept: one per disk, not per
    /// request).
    buf: Vec<u8>,
    reads: u64,
    writes: u64,
    flushes: u64,
    errors: u64,
}

impl Block {
    /// Opens the disk; `claim` takes its lock now (a VM booting here), otherwise it is taken
    /// as the VM's state is loaded here (`VirtioDevice::claim`).
    pub fn open(config: &DiskConfig, claim: bool) -> Result<Self, String> {
        let path = &config.path;
        let file = OpenOptions::new()
            .read(true)
            .write(!config.readonly)
            .open(path)
            .map_err(|e| format!("cannot open disk {}: {e}", path.display()))?;
        Self::on(config, file, claim)
    }

    /// The disk `config` names on `file`, already open (passed by a live update, whose lock
    /// it shares: `claim` takes it without waiting).
    pub fn on(config: &DiskConfig, file: File, claim: bool) -> Result<Self, String> {
        let path = &config.path;
        let bytes = disk_size(&file).map_err(|e| format!("disk {}: {e}", path.display()))?;
        if bytes < SECTOR {
            return Err(format!(
                "disk {} holds {bytes} bytes, less than one 512-byte sector",
                path.display()
            ));
        }
        let mut block = Self {
            file,
            path: path.clone(),
            readonly: config.readonly,
            sectors: bytes / SECTOR,
            locked: false,
            lock_passed_on: false,
            log: None,
            buf: vec![0u8; CHUNK],
            reads: 0,
            writes: 0,
            flushes: 0,
            errors: 0,
        };
        if claim {
            block.claim().map_err(|e| e.to_string())?;
        }
        Ok(block)
    }

    /// Serves one request; returns the bytes written into the driver's buffers.
    fn serve(
        &mut self,
        descs: &[Descriptor],
        memory: &GuestMemory,
        log: &mut dyn WriteLog,
    ) -> Result<u32, DriverError> {
        let (Some(header), Some(status)) = (descs.first(), descs.last()) else {
            return Err(DriverError("an empty request".into()));
        };
        if descs.len() < 2 || header.is_write_only() || header.len() < 16 {
            return Err(DriverError(
                "a request without a 16-byte readable header and a status byte".into(),
            ));
        }
        if !status.is_write_only() || status.len() < 1 {
            return Err(DriverError(
                "a request whose last buffer is not a writable status byte".into(),
            ));
        }
        let mut head = [0u8; 16];
        memory
            .read_slice(&mut head, header.addr())
            .map_err(|_| outside(header.addr().0, header.len() as usize))?;
        let kind = u32::from_le_bytes(head[0..4].try_into().unwrap());
        let sector = u64::from_le_bytes(head[8..16].try_into().unwrap());
        let data = &descs[1..descs.len() - 1];
        let (code, written) = match kind {
            VIRTIO_BLK_T_IN => self.read(sector, data, memory, log)?,
            VIRTIO_BLK_T_OUT => self.write(sector, data, memory)?,
            VIRTIO_BLK_T_FLUSH => (self.flush_status(), 0),
            VIRTIO_BLK_T_GET_ID => self.id(data, memory, log)?,
            _ => (VIRTIO_BLK_S_UNSUPP, 0),
        };
        if code == VIRTIO_BLK_S_IOERR {
            self.errors += 1;
        }
        memory
            .write_slice(&[code as u8], status.addr())
            .map_err(|_| outside(status.addr().0, 1))?;
        log.wrote(status.addr().0, 1);
        Ok(written + 1)
    }

    /// Where a transfer of `len` bytes from `sector` lies in the file, if inside the disk (and
    /// small enough for the used ring's 32-bit length).
    fn span(&self, sector: u64, len: u64) -> Option<u64> {
        if len >= u64::from(u32::MAX) {
            return None;
        }
        let start = sector.checked_mul(SECTOR)?;
        (start.checked_add(len)? <= self.sectors * SECTOR).then_some(start)
    }

    fn read(
        &mut self,
        sector: u64,
        data: &[Descriptor],
        memory: &GuestMemory,
        log: &mut dyn WriteLog,
    ) -> Result<(u32, u32), DriverError> {
        if data.iter().any(|d| !d.is_write_only()) {
            return Err(DriverError(
                "a read into a buffer the device may not write".into(),
            ));
        }
        let total: u64 = data.iter().map(|d| u64::from(d.len())).sum();
        let Some(offset) = self.span(sector, total) else {
            return Ok((VIRTIO_BLK_S_IOERR, 0));
        };
        let (file, path, buf) = (&self.file, &self.path, &mut self.buf);
        let done = pieces(data, offset, |gpa, offset, n| {
            if let Err(e) = file.read_exact_at(&mut buf[..n], offset) {
                tracing::warn!("disk {}: read at {offset}: {e}", path.display());
                return Ok(false);
            }
            memory
                .write_slice(&buf[..n], GuestAddress(gpa))
                .map_err(|_| outside(gpa, n))?;
            log.wrote(gpa, n);
            Ok(true)
        })?;
        if !done {
            return Ok((VIRTIO_BLK_S_IOERR, 0));
        }
        self.reads += 1;
        Ok((VIRTIO_BLK_S_OK, total as u32))
    }

    fn write(
        &mut self,
        sector: u64,
        data: &[Descriptor],
        memory: &GuestMemory,
    ) -> Result<(u32, u32), DriverError> {
        if data.iter().any(|d| d.is_write_only()) {
            return Err(DriverError(
                "a write from a buffer the device may only write".into(),
            ));
        }
        if self.readonly {
            return Ok((VIRTIO_BLK_S_IOERR, 0));
        }
        let total: u64 = data.iter().map(|d| u64::from(d.len())).sum();
        let Some(offset) = self.span(sector, total) else {
            return Ok((VIRTIO_BLK_S_IOERR, 0));
        };
        let (file, path, buf) = (&self.file, &self.path, &mut self.buf);
        let done = pieces(data, offset, |gpa, offset, n| {
            memory
                .read_slice(&mut buf[..n], GuestAddress(gpa))
                .map_err(|_| outside(gpa, n))?;
            if let Err(e) = file.write_all_at(&buf[..n], offset) {
                tracing::warn!("disk {}: write at {offset}: {e}", path.display());
                return Ok(false);
            }
            Ok(true)
        })?;
        // After the write, failed or not (part of it may have landed): see `disk_log`.
        if let Some(log) = &self.log {
            log.mark(offset, total);
        }
        if !done {
            return Ok((VIRTIO_BLK_S_IOERR, 0));
        }
        self.writes += 1;
        Ok((VIRTIO_BLK_S_OK, 0))
    }

    fn flush_status(&mut self) -> u32 {
        self.flushes += 1;
        match self.file.sync_data() {
            Ok(()) => VIRTIO_BLK_S_OK,
            Err(e) => {
                tracing::warn!("disk {}: flush: {e}", self.path.display());
                VIRTIO_BLK_S_IOERR
            }
        }
    }

    fn id(
        &self,
        data: &[Descriptor],
        memory: &GuestMemory,
        log: &mut dyn WriteLog,
    ) -> Result<(u32, u32), DriverError> {
        let Some(d) = data.first().filter(|d| d.is_write_only()) else {
            return Err(DriverError(
                "a get-id request without a writable buffer".into(),
            ));
        };
        let mut id = [0u8; VIRTIO_BLK_ID_BYTES as usize];
        let name = b"ferry-disk";
        id[..name.len()].copy_from_slice(name);
        let n = id.len().min(d.len() as usize);
        memory
            .write_slice(&id[..n], d.addr())
            .map_err(|_| outside(d.addr().0, n))?;
        log.wrote(d.addr().0, n);
        Ok((VIRTIO_BLK_S_OK, n as u32))
    }
}

impl VirtioDevice for Block {
    fn device_type(&self) -> u32 {
        VIRTIO_ID_BLOCK
    }

    fn features(&self) -> u64 {
        let ro = if self.readonly {
            1 << VIRTIO_BLK_F_RO
        } else {
            0
        };
        (1 << VIRTIO_F_VERSION_1) | (1 << VIRTIO_BLK_F_FLUSH) | ro
    }

    fn queue_max_sizes(&self) -> &[u16] {
        &[QUEUE_SIZE]
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        // virtio_blk_config: capacity (u64, in sectors) first; the rest is not offered.
        read_config_bytes(&self.sectors.to_le_bytes(), offset, data);
    }

    fn process(
        &mut self,
        _index: usize,
        queues: &mut [Queue],
        memory: &GuestMemory,
        log: &mut dyn WriteLog,
    ) -> Result<bool, DriverError> {
        serve_chains(&mut queues[0], memory, log, |descs, log| {
            self.serve(descs, memory, log)
        })
    }

    fn release(&mut self, keep_lock: bool) -> std::io::Result<()> {
        self.file.sync_data()?;
        self.lock_passed_on |= keep_lock;
        if self.locked && !self.lock_passed_on {
            lock(&self.file, libc::LOCK_UN)?;
            self.locked = false;
        }
        Ok(())
    }

    fn claim(&mut self) -> std::io::Result<()> {
        // The VM runs here again (a handover that failed): the disk is this process's.
        self.lock_passed_on = false;
        if self.locked {
            return Ok(());
        }
        let mode = if self.readonly {
            libc::LOCK_SH
        } else {
            libc::LOCK_EX
        };
        lock(&self.file, mode | libc::LOCK_NB).map_err(|e| {
            let why = if e.kind() == std::io::ErrorKind::WouldBlock {
                "is in use by another process (it holds the disk's lock): a second writer would \
                 corrupt it"
                    .to_string()
            } else {
                format!("cannot be locked: {e}")
            };
            std::io::Error::new(e.kind(), format!("disk {} {why}", self.path.display()))
        })?;
        self.locked = true;
        Ok(())
    }

    fn file(&self) -> Option<std::os::fd::RawFd> {
        Some(self.file.as_raw_fd())
    }

    fn log_writes(&mut self, log: Option<Arc<BlockLog>>) -> bool {
        self.log = log;
        true
    }

    fn as_any_mut(&mut self) -> &mut dyn std::any::Any {
        self
    }

    fn backing(&self) -> Option<&Path> {
        Some(&self.path)
    }

    fn descriptor(&self) -> migration::DeviceDescriptor {
        migration::DeviceDescriptor::Disk {
            path: self.path.to_string_lossy().into_owned(),
            readonly: self.readonly,
            sectors: self.sectors,
        }
    }

    fn describe(&self) -> String {
        format!(
            "{}{}, {} sectors",
            self.path.display(),
            if self.readonly { " (read-only)" } else { "" },
            self.sectors
        )
    }

    fn writable(&self) -> bool {
        !self.readonly
    }

    fn counters(&self) -> Vec<(&'static str, u64)> {
        vec![
            ("reads", self.reads),
            ("writes", self.writes),
            ("flushes", self.flushes),
            ("io_errors", self.errors),
        ]
    }
}

/// Nothing of its own: the file is shared storage, and the transport holds the rest.
impl crate::persist::Persist for Block {
    const NAME: &'static str = "virtio-blk";
    const VERSION: u32 = 1;
    type State = ();

    fn save(&self) -> Result<(), String> {
        Ok(())
    }

    fn load(&mut self, (): ()) -> Result<(), String> {
        Ok(())
    }
}

/// Calls `piece(guest address, disk offset, length)` for each run of at most `CHUNK` bytes of
/// the buffers `data`, the disk from `offset` on; stops at the first piece that fails (false).
fn pieces(
    data: &[Descriptor],
    mut offset: u64,
    mut piece: impl FnMut(u64, u64, usize) -> Result<bool, DriverError>,
) -> Result<bool, DriverError> {
    for d in data {
        let mut done = 0u64;
        while done < u64::from(d.len()) {
            let n = (u64::from(d.len()) - done).min(CHUNK as u64) as usize;
            if !piece(d.addr().0 + done, offset, n)? {
                return Ok(false);
            }
            done += n as u64;
            offset += n as u64;
        }
    }
    Ok(true)
}

fn lock(file: &File, op: libc::c_int) -> std::io::Result<()> {
    // SAFETY: flock on a descriptor this value owns.
    if unsafe { libc::flock(file.as_raw_fd(), op) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// A regular file's length, or a block device's size.
fn disk_size(file: &File) -> std::io::Result<u64> {
    use std::io::{Seek, SeekFrom};
    let meta = file.metadata()?;
    if meta.is_file() {
        return Ok(meta.len());
    }
    let mut f = file;
    f.seek(SeekFrom::End(0))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Whether another open of the disk (another process's, as far as `flock` can tell) may
    /// write it.
    fn another_writer_may(path: &Path) -> bool {
        let file = OpenOptions::new().write(true).open(path).unwrap();
        let free = lock(&file, libc::LOCK_EX | libc::LOCK_NB).is_ok();
        if free {
            lock(&file, libc::LOCK_UN).unwrap();
        }
        free
    }

    /// A 1 MiB disk in a directory of its own (removed when the first value drops).
    fn scratch_disk() -> (tempfile::TempDir, PathBuf, DiskConfig) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("disk.img");
        File::create(&path).unwrap().set_len(1 << 20).unwrap();
        let config = DiskConfig {
            path: path.clone(),
            readonly: false,
        };
        (dir, path, config)
    }

    #[test]
    fn a_live_update_keeps_the_lock_the_passed_file_shares() {
        let (_dir, path, config) = scratch_disk();
        let mut old = Block::open(&config, true).unwrap();
        assert!(!another_writer_may(&path), "the running VM holds the disk");
        // The old process lets go for a live update: flushed, the lock kept; the new one
        // takes the same open file over and claims it at once.
        old.release(true).unwrap();
        assert!(!another_writer_may(&path), "the lock lapsed");
        let passed = old.file.try_clone().unwrap();
        let mut new = Block::on(&config, passed, false).unwrap();
        new.claim().unwrap();
        // The old process shuts its VM down: the lock is the new one's to let go of.
        old.release(false).unwrap();
        assert!(
            !another_writer_may(&path),
            "the old VM's shutdown freed the disk"
        );
        drop(old); // the old process ends
        assert!(!another_writer_may(&path), "the new process holds the disk");
        // A move to another host lets go for real.
        new.release(false).unwrap();
        assert!(another_writer_may(&path));
    }

    #[test]
    fn a_vm_that_takes_its_disk_back_lets_go_of_it_at_shutdown() {
        let (_dir, path, config) = scratch_disk();
        let mut disk = Block::open(&config, true).unwrap();
        // A live update that failed: the VM runs on here and the disk is its own again.
        disk.release(true).unwrap();
        disk.claim().unwrap();
        disk.release(false).unwrap();
        assert!(
            another_writer_may(&path),
            "a reboot could not take the disk"
        );
    }
}
