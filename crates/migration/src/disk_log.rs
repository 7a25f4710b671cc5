//! Which blocks of a disk the guest wrote while a migration copies it (`copy_storage`): the
//! VMM's disk marks each write here once it completed, and the source takes the set each
//! round and sends those blocks again.
//!
//! Why a block is never lost: the source clears a block's bit before it reads the block, and
//! a write marks its blocks after it reached the file. A write that lands before the clear is
//! in what the read sees; one that lands after it marks the block again for the next round.

use std::sync::atomic::{AtomicU64, Ordering};

use crate::bitmap::Bitmap;

/// Disks are logged and sent in blocks of this many bytes.
pub const DISK_BLOCK: u64 = 64 << 10;
/// Contiguous blocks sent in one message, at most (1 MiB).
pub const RUN_BLOCKS: u64 = 16;

pub struct BlockLog {
    words: Vec<AtomicU64>,
    blocks: u64,
}

impl BlockLog {
    /// A log for a disk of `bytes` bytes (its last block may be short).
    pub fn new(bytes: u64) -> Self {
        let blocks = bytes.div_ceil(DISK_BLOCK);
        Self {
            words: (0..blocks.div_ceil(64))
                .map(|_| AtomicU64::new(0))
                .collect(),
            blocks,
        }
    }

    pub fn blocks(&self) -> u64 {
        self.blocks
    }

    /// `len` bytes were written at `offset`: their blocks are sent again.
    pub fn mark(&self, offset: u64, len: u64) {
        if len == 0 {
            return;
        }
        let first = offset / DISK_BLOCK;
        let end = offset
            .saturating_add(len)
            .div_ceil(DISK_BLOCK)
            .min(self.blocks);
        for block in first..end {
            self.words[(block / 64) as usize].fetch_or(1 << (block % 64), Ordering::AcqRel);
        }
    }

    /// The blocks written since the last take; the log starts afresh.
    pub fn take(&self) -> Bitmap {
        let words: Vec<u64> = self
            .words
            .iter()
            .map(|w| w.swap(0, Ordering::AcqRel))
            .collect();
        Bitmap::from_words(&words, self.blocks)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_write_marks_every_block_it_touched_once() {
        let log = BlockLog::new(10 * DISK_BLOCK + 512);
        assert_eq!(log.blocks(), 11);
        log.mark(DISK_BLOCK - 512, 1024); // straddles blocks 0 and 1
        log.mark(10 * DISK_BLOCK, 512); // the short last block
        log.mark(3 * DISK_BLOCK, 0); // nothing written
        let taken: Vec<u64> = log.take().iter().collect();
        assert_eq!(taken, [0, 1, 10]);
        assert_eq!(log.take().count(), 0, "a take starts the log afresh");
    }

    #[test]
    fn a_write_past_the_end_marks_only_blocks_that_exist() {
        let log = BlockLog::new(2 * DISK_BLOCK);
        log.mark(DISK_BLOCK, u64::MAX);
        assert_eq!(log.take().iter().collect::<Vec<_>>(), [1]);
    }
}
