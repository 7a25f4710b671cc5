//! Post-copy checkpoints, the source's half (the destination's is
//! `destination::checkpoints`). While the VM runs on the destination, the destination sends
//! back, at intervals, every page it dirtied since the last checkpoint the source confirmed,
//! then the vCPU and device state of the same instant. The source stages the pages until the
//! checkpoint is whole, then writes them over its own copy of guest memory and keeps the
//! state: its memory plus that state is the VM as it was on the destination at that instant.
//!
//! The source's memory is the VM at the switch, and a page the destination dirtied is one it
//! already has: the pushes of pages still owed never meet a checkpoint's pages. Should the
//! destination die, `Outgoing::reclaim` (`vm.migrate-rollback`) runs the VM here from the last
//! checkpoint applied; the guest loses what it did after it, and nothing else.

use crate::sync::Locked;
use std::sync::Mutex;
use std::time::Instant;

use crate::bitmap::Bitmap;
use crate::board::StatusBoard;
use crate::error::{Error, Result};
use crate::io::transport::Stream;
use crate::memory::{GuestRam, ShadowRam};
use crate::status::CheckpointStats;
use crate::wire::frame::FRAME_HEADER_LEN;
use crate::wire::page_frame::{FrameBuffers, read_page_frame};

/// The newest checkpoint applied: with the source's memory, a whole VM.
#[derive(Clone, Debug)]
pub struct Saved {
    pub seq: u64,
    pub vcpus: Vec<Vec<u8>>,
    pub devices: Vec<u8>,
}

/// A checkpoint's pages as they arrive, applied only once it is whole.
struct Staging {
    /// Which connection's reader may stage now (see `restart`).
    reader: u64,
    shadow: ShadowRam,
    pages: Bitmap,
    count: u64,
    bytes: u64,
    scratch: FrameBuffers,
}

struct Applied {
    latest: Option<Saved>,
    /// Set by a rollback: nothing may change the memory it runs on from then on.
    closed: bool,
}

pub struct Checkpoints {
    ram: GuestRam,
    vcpus: u32,
    staging: Mutex<Staging>,
    applied: Mutex<Applied>,
    board: StatusBoard,
    switched_at: Instant,
}

impl Checkpoints {
    /// Ready to take checkpoints of a VM of `vcpus` vCPUs whose memory is `ram`, every
    /// `every_ms` (what the destination was asked for).
    pub fn new(ram: &GuestRam, vcpus: u32, every_ms: u32, board: &StatusBoard) -> Result<Self> {
        board.checkpoints(|c| {
            *c = Some(CheckpointStats {
                every_ms,
                ..Default::default()
            })
        });
        Ok(Self {
            ram: ram.clone(),
            vcpus,
            staging: Mutex::new(Staging {
                reader: 0,
                shadow: ShadowRam::like(ram)?,
                pages: Bitmap::new(ram.gfn_end()),
                count: 0,
                bytes: 0,
                scratch: FrameBuffers::default(),
            }),
            applied: Mutex::new(Applied {
                latest: None,
                closed: false,
            }),
            board: board.clone(),
            switched_at: Instant::now(),
        })
    }

    /// A new connection: whatever was staged on the last one can never be completed, and its
    /// reader (which may still hear stale frames) may stage nothing more. Returns the new
    /// reader's number.
    pub fn restart(&self) -> u64 {
        let mut s = self.staging.locked();
        s.discard();
        s.reader += 1;
        s.reader
    }

    /// Reads one page frame of a checkpoint into the staging area, for reader `reader`.
    pub fn stage(
        &self,
        reader: u64,
        stream: &mut Stream,
        header: &[u8; FRAME_HEADER_LEN],
        len: u32,
    ) -> Result<()> {
        let mut guard = self.staging.locked();
        let s = &mut *guard;
        s.current(reader)?;
        let pages = read_page_frame(stream, s.shadow.ram(), header, len, &mut s.scratch)?;
        for (gfn, data) in pages {
            match data {
                Some(d) => s.shadow.ram().write_page(gfn, d)?,
                None => s.shadow.ram().zero_page(gfn)?,
            }
            if !s.pages.get(gfn) {
                s.pages.set(gfn);
                s.count += 1;
            }
        }
        s.bytes += (FRAME_HEADER_LEN + len as usize + 4) as u64;
        Ok(())
    }

    /// Checkpoint `seq` is whole: its `pages` staged pages go into guest memory and its state
    /// is kept. A checkpoint that does not add up is refused, and the last one stands.
    pub fn apply(
        &self,
        reader: u64,
        seq: u64,
        pages: u64,
        vcpus: &[Vec<u8>],
        devices: &[u8],
    ) -> Result<()> {
        let mut guard = self.staging.locked();
        let s = &mut *guard;
        s.current(reader)?;
        let mut applied = self.applied.locked();
        let last = applied.latest.as_ref().map_or(0, |l| l.seq);
        let refusal = if applied.closed {
            Some("the VM was rolled back here".to_string())
        } else if seq <= last {
            Some(format!("it follows checkpoint {last}"))
        } else if pages != s.count {
            Some(format!("it names {pages} pages but {} came", s.count))
        } else if vcpus.len() != self.vcpus as usize {
            Some(format!(
                "it holds {} vCPUs for a {}-vCPU VM",
                vcpus.len(),
                self.vcpus
            ))
        } else {
            None
        };
        if let Some(why) = refusal {
            s.discard();
            return Err(Error::Protocol(format!("checkpoint {seq} refused: {why}")));
        }
        for gfn in s.pages.iter() {
            self.ram.write_page(gfn, s.shadow.ram().page(gfn)?)?;
        }
        applied.latest = Some(Saved {
            seq,
            vcpus: vcpus.to_vec(),
            devices: devices.to_vec(),
        });
        let at = self.switched_at.elapsed();
        let state_bytes = vcpus.iter().map(Vec::len).sum::<usize>() + devices.len();
        let (count, bytes) = (s.count, s.bytes + state_bytes as u64);
        self.board.checkpoints(|c| {
            if let Some(c) = c {
                c.count += 1;
                c.last_seq = seq;
                c.last_at = at;
                c.pages += count;
                c.bytes += bytes;
            }
        });
        s.discard();
        Ok(())
    }

    /// A rollback that could not load the state (a disk still held by the destination): the
    /// post-copy may still carry on, checkpoints with it.
    pub fn reopen(&self) {
        self.applied.locked().closed = false;
        self.board.checkpoints(|c| {
            if let Some(c) = c {
                c.rolled_back_to = None;
            }
        });
    }

    /// The newest checkpoint, after which nothing is applied any more (the VM runs here
    /// again from it); `None` if none came, and the VM runs from the switch.
    pub fn close(&self) -> Option<Saved> {
        let mut applied = self.applied.locked();
        applied.closed = true;
        let latest = applied.latest.clone();
        if let Some(l) = &latest {
            self.board.checkpoints(|c| {
                if let Some(c) = c {
                    c.rolled_back_to = Some(l.seq);
                }
            });
        }
        latest
    }
}

impl Staging {
    fn current(&self, reader: u64) -> Result<()> {
        if reader != self.reader {
            return Err(Error::Protocol(
                "a checkpoint from a connection that was replaced".into(),
            ));
        }
        Ok(())
    }

    fn discard(&mut self) {
        self.shadow.release();
        self.pages.clear();
        self.count = 0;
        self.bytes = 0;
    }
}
