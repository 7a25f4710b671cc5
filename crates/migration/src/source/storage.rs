//! `copy_storage`: the VM's disks travel in the migration's own stream, on its main
//! connection. Before memory's round 0 goes what each disk holds (holes as zero ranges, found
//! with SEEK_DATA/SEEK_HOLE, and blocks of zeros likewise); after each later round's pages the
//! blocks the guest wrote since they were sent (`disk_log`); in the pause the last of them,
//! before the VM's state. Runs of data go packed where they shrink (`BlockPacker`). Until `Go`
//! the source's disk is the only one the VM writes: a migration that fails before leaves the
//! destination's copy unused.

use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::time::Instant;

use super::guards::DiskCopy;
use super::session::Session;
use crate::bitmap::Bitmap;
use crate::disk_log::{DISK_BLOCK, RUN_BLOCKS};
use crate::error::{Error, Result};
use crate::pages::BlockPacker;
use crate::status::StorageCounts;
use crate::vm::CopiedDisk;
use crate::wire::codec::Codec;
use crate::wire::{self, Message};
use crate::zero::is_zero_page;

/// Blocks in `sets` (one per disk), in 4 KiB pages: what the policy weighs beside pages.
pub(super) fn pending_pages(sets: &[Bitmap]) -> u64 {
    let blocks: u64 = sets.iter().map(Bitmap::count).sum();
    blocks * (DISK_BLOCK / crate::PAGE_SIZE as u64)
}

/// What a send of blocks found: a run of data, or of zeros.
enum Piece {
    Data { offset: u64, len: usize },
    Zero { offset: u64, len: u64 },
}

impl Session<'_> {
    /// With `copy_storage`, the disks' writes are logged from here on.
    pub(super) fn start_disk_copy(&mut self) -> Result<()> {
        if self.params.copy_storage {
            let copy = DiskCopy::start(self.vm)?;
            self.status.progress.storage = Some(copy.counts());
            self.held.disks = Some(copy);
        }
        Ok(())
    }

    /// The blocks the guest wrote since the last take (and those a broken connection lost),
    /// per moving disk (none without).
    pub(super) fn take_disk_writes(&mut self) -> Vec<Bitmap> {
        self.held
            .disks
            .as_mut()
            .map_or_else(Vec::new, DiskCopy::take_written)
    }

    /// Round 0 of the disks: everything they hold.
    pub(super) fn send_whole_disks(&mut self) -> Result<()> {
        let Some(copy) = &self.held.disks else {
            return Ok(());
        };
        let found: Vec<_> = copy
            .disks
            .iter()
            .map(|disk| extents(disk).map(|(data, holes)| (disk.slot, data, holes)))
            .collect::<Result<_>>()?;
        // Counted before anything goes: what a broken connection leaves unsent goes again.
        for (index, (_, data, holes)) in found.iter().enumerate() {
            holes
                .iter()
                .for_each(|&(offset, len)| copy.queued(index, blocks_of(offset, len)));
            copy.queued_set(index, data);
        }
        let mut sets = Vec::with_capacity(found.len());
        for (slot, data, holes) in found {
            for (offset, len) in holes {
                self.send_disk(Message::DiskZero {
                    disk: slot,
                    offset,
                    len,
                })?;
                self.count_disk(|c| c.zero_bytes += len);
            }
            sets.push(data);
        }
        self.send_queued_blocks(&sets, false)?;
        self.lap("disks");
        Ok(())
    }

    /// Sends the blocks of `sets` (one per disk); `last`: the switch's last ones, which no
    /// cancel interrupts (as the last pages).
    pub(super) fn send_disk_blocks(&mut self, sets: &[Bitmap], last: bool) -> Result<()> {
        if let Some(copy) = &self.held.disks {
            (0..sets.len()).for_each(|i| copy.queued_set(i, &sets[i]));
        }
        self.send_queued_blocks(sets, last)
    }

    /// `send_disk_blocks` of blocks already counted as queued.
    fn send_queued_blocks(&mut self, sets: &[Bitmap], last: bool) -> Result<()> {
        let Some(mut copy) = self.held.disks.take() else {
            return Ok(());
        };
        match &mut copy.packer {
            // Pages went since the last runs: neither a link window nor a run's cost spans them.
            Some(packer) => packer.paused(),
            None => {
                let same_host = self.pages.goes_to_this_host();
                let packer =
                    BlockPacker::new(self.params.compression, Some(&self.stream), same_host);
                copy.packer = Some(packer);
            }
        }
        let sent = sets
            .iter()
            .enumerate()
            .try_for_each(|(i, set)| self.send_disk_set(&mut copy, i, set, last));
        self.held.disks = Some(copy);
        sent
    }

    fn send_disk_set(
        &mut self,
        copy: &mut DiskCopy<'_>,
        index: usize,
        set: &Bitmap,
        last: bool,
    ) -> Result<()> {
        let slot = copy.disks[index].slot;
        // Warm sends everything with the guest paused; pre-copy only the last blocks.
        let paused = self.is_paused();
        let mut blocks = set.iter().peekable();
        while let Some(first) = blocks.next() {
            if !last {
                self.check_continue()?;
            }
            let mut end = first + 1;
            while end - first < RUN_BLOCKS && blocks.next_if_eq(&end).is_some() {
                end += 1;
            }
            let again = (first..end).filter(|&b| copy.sent[index].get(b)).count() as u64;
            (first..end).for_each(|b| copy.sent[index].set(b));
            self.count_disk(|c| {
                c.blocks_resent += again;
                if paused {
                    c.blocks_in_pause += end - first;
                }
            });
            let DiskCopy {
                disks, buf, packer, ..
            } = copy;
            let packer = packer.as_mut().expect("made before the first run");
            for piece in read_run(&disks[index], buf, first, end)? {
                let sent = match piece {
                    Piece::Data { offset, len } => {
                        let start = (offset - first * DISK_BLOCK) as usize;
                        let data = &buf[start..start + len];
                        let sent = self.send_data((slot, offset), data, packer)?;
                        self.count_disk(|c| {
                            c.data_bytes += len as u64;
                            c.data_wire_bytes += sent;
                        });
                        sent
                    }
                    Piece::Zero { offset, len } => {
                        self.count_disk(|c| c.zero_bytes += len);
                        let zero = Message::DiskZero {
                            disk: slot,
                            offset,
                            len,
                        };
                        wire::frame::write_message_counted(&mut self.stream, &zero)?
                    }
                };
                self.count_disk_bytes(sent);
            }
        }
        Ok(())
    }

    /// A run of data at `offset` of the disk in `slot`, packed where it shrinks; its bytes
    /// on the wire.
    fn send_data(
        &mut self,
        (slot, offset): (u32, u64),
        data: &[u8],
        packer: &mut BlockPacker,
    ) -> Result<u64> {
        let packed = packer.pack(data)?;
        let (codec, took) = (packed.codec, packed.took);
        let writing = Instant::now();
        let sent = match codec {
            Codec::None => wire::frame::write_disk_data(&mut self.stream, slot, offset, data)?,
            _ => {
                let len = data.len() as u32;
                let at = (slot, offset);
                wire::frame::write_disk_packed(&mut self.stream, at, codec, len, packed.data)?
            }
        };
        packer.sent(codec, data.len(), sent, took, writing.elapsed());
        Ok(sent)
    }

    /// One disk message, paced and counted like pages.
    fn send_disk(&mut self, msg: Message) -> Result<()> {
        let bytes = wire::frame::write_message_counted(&mut self.stream, &msg)?;
        self.count_disk_bytes(bytes);
        Ok(())
    }

    /// A disk frame of `bytes` went: paced and counted like pages.
    fn count_disk_bytes(&mut self, bytes: u64) {
        self.limiter.take(bytes);
        self.message_bytes += bytes;
    }

    fn count_disk(&mut self, add: impl FnOnce(&mut StorageCounts)) {
        if let Some(c) = &mut self.status.progress.storage {
            add(c);
        }
    }
}

/// The blocks `len` bytes at `offset` touch.
fn blocks_of(offset: u64, len: u64) -> std::ops::Range<u64> {
    offset / DISK_BLOCK..(offset + len).div_ceil(DISK_BLOCK)
}

/// Reads blocks `first..end` of `disk` into `buf`; the runs of data and of zero blocks in it.
fn read_run(disk: &CopiedDisk, buf: &mut [u8], first: u64, end: u64) -> Result<Vec<Piece>> {
    let offset = first * DISK_BLOCK;
    let len = (end * DISK_BLOCK).min(disk.bytes) - offset;
    disk.file
        .read_exact_at(&mut buf[..len as usize], offset)
        .map_err(|e| {
            Error::vm_caused(
                format!("reading disk {} at byte {offset} to send it", disk.slot),
                e,
            )
        })?;
    let mut pieces: Vec<Piece> = Vec::new();
    let mut at = 0u64;
    while at < len {
        let n = DISK_BLOCK.min(len - at);
        let zero = buf[at as usize..(at + n) as usize]
            .chunks(crate::PAGE_SIZE)
            .all(|c| match c.len() {
                crate::PAGE_SIZE => is_zero_page(c),
                _ => c.iter().all(|&b| b == 0),
            });
        let here = offset + at;
        match (pieces.last_mut(), zero) {
            (Some(Piece::Zero { len, .. }), true) => *len += n,
            (Some(Piece::Data { len, .. }), false) => *len += n as usize,
            (_, true) => pieces.push(Piece::Zero {
                offset: here,
                len: n,
            }),
            (_, false) => pieces.push(Piece::Data {
                offset: here,
                len: n as usize,
            }),
        }
        at += n;
    }
    Ok(pieces)
}

/// The blocks of `disk` that hold data, and its holes as (offset, length): SEEK_DATA and
/// SEEK_HOLE where the file system tells, otherwise every block is data.
fn extents(disk: &CopiedDisk) -> Result<(Bitmap, Vec<(u64, u64)>)> {
    let blocks = disk.log.blocks();
    let mut data = Bitmap::new(blocks);
    let mut holes = Vec::new();
    let fd = disk.file.as_raw_fd();
    let mut at = 0u64;
    while at < disk.bytes {
        let Some(start) = seek(fd, at, libc::SEEK_DATA)? else {
            holes.push((at, disk.bytes - at)); // no data from here to the end
            break;
        };
        let start = start.min(disk.bytes);
        let end = seek(fd, start, libc::SEEK_HOLE)?
            .unwrap_or(disk.bytes)
            .min(disk.bytes);
        // Holes inside a block are sent with the block's data.
        let (first, last) = (start / DISK_BLOCK, end.div_ceil(DISK_BLOCK));
        let hole_end = (first * DISK_BLOCK).max(at);
        if hole_end > at {
            holes.push((at, hole_end - at));
        }
        (first..last).for_each(|b| data.set(b));
        at = (last * DISK_BLOCK).max(end);
    }
    Ok((data, holes))
}

/// `lseek(fd, from, whence)`: `None` where no data follows (ENXIO); every byte is data where
/// the file system cannot tell (EINVAL, as for a block device: `from` itself).
fn seek(fd: i32, from: u64, whence: libc::c_int) -> Result<Option<u64>> {
    // SAFETY: lseek on a descriptor the disk copy owns; it moves only that file's offset,
    // which no reader here uses (they read at offsets).
    let at = unsafe { libc::lseek(fd, from as libc::off_t, whence) };
    if at >= 0 {
        return Ok(Some(at as u64));
    }
    let e = std::io::Error::last_os_error();
    match e.raw_os_error() {
        Some(libc::ENXIO) => Ok(None),
        Some(libc::EINVAL) if whence == libc::SEEK_DATA => Ok(Some(from)),
        Some(libc::EINVAL) => Ok(None),
        _ => Err(Error::vm_caused("looking for a disk's data", e)),
    }
}
