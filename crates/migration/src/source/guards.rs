//! What a migration changes on the VM it moves — a pause, dirty logging, a throttle — each held
//! as a guard that puts it back when dropped (crosvm's suspend guard is the model). A phase
//! that fails hands nothing on, and a panic unwinds through the guards too. `Session::finish`
//! settles them in order (the destination hears the abort before the paused source takes its
//! disks back) and keeps the pause where the VM may run on the destination already.

use std::time::{Duration, Instant};

use crate::bitmap::Bitmap;
use crate::copies::Copies;
use crate::disk_log::{DISK_BLOCK, RUN_BLOCKS};
use crate::error::{Error, Result};
use crate::pages::BlockPacker;
use crate::status::{StorageCounts, now_ns};
use crate::vm::{CopiedDisk, Migratable};

/// The guest paused for the switch (or, warm and snapshot, for the whole copy).
pub(super) struct Paused<'a> {
    vm: &'a dyn Migratable,
    /// Only a VM that ran before is resumed: an operator's pause outlives the migration.
    was_running: bool,
    armed: bool,
    /// When the pause was asked for: the guest may stop from then on, so the downtime counts
    /// from here, the wait for every vCPU to park included.
    pub at: Instant,
    /// `at` on the clock the guest's progress is kept on.
    pub at_ns: u64,
}

impl<'a> Paused<'a> {
    pub fn new(vm: &'a dyn Migratable, was_running: bool) -> Result<Self> {
        let (at, at_ns) = (Instant::now(), now_ns());
        vm.pause()?;
        Ok(Self {
            vm,
            was_running,
            armed: true,
            at,
            at_ns,
        })
    }

    /// `Go` left: the VM may run on the destination, so dropping this no longer resumes it;
    /// only `undo`, on the destination's word that it did not start, does.
    pub fn go_sent(&mut self) {
        self.armed = false;
    }

    /// The VM may run on the destination: it must never resume here by itself.
    pub fn keep(mut self) {
        self.armed = false;
    }

    /// Runs the VM here again, if it ran before the migration.
    pub fn undo(mut self) -> Result<()> {
        self.armed = false;
        if self.was_running {
            self.vm.resume()?;
        }
        Ok(())
    }
}

impl Drop for Paused<'_> {
    fn drop(&mut self) {
        if self.armed && self.was_running {
            let _ = self.vm.resume();
        }
    }
}

/// Dirty logging, on from before the first scan until the migration ends.
pub(super) struct DirtyLog<'a> {
    vm: &'a dyn Migratable,
    on: bool,
}

impl<'a> DirtyLog<'a> {
    pub fn start(vm: &'a dyn Migratable) -> Result<Self> {
        vm.start_dirty_log()?;
        Ok(Self { vm, on: true })
    }

    /// Leaves logging on: after an unconfirmed switch, a take-back (`Outgoing::reclaim`)
    /// turns it off.
    pub fn keep(mut self) {
        self.on = false;
    }
}

impl Drop for DirtyLog<'_> {
    fn drop(&mut self) {
        if self.on {
            let _ = self.vm.stop_dirty_log();
        }
    }
}

/// Auto-converge's hold on the guest's vCPUs: the share of time they sleep. Whatever the
/// outcome, the guest is not left slowed down.
pub(super) struct Throttle<'a> {
    vm: &'a dyn Migratable,
    percent: u8,
}

impl<'a> Throttle<'a> {
    pub fn new(vm: &'a dyn Migratable) -> Self {
        Self { vm, percent: 0 }
    }

    pub fn percent(&self) -> u8 {
        self.percent
    }

    pub fn set(&mut self, percent: u8) -> Result<()> {
        self.vm.set_throttle(percent)?;
        self.percent = percent;
        Ok(())
    }

    /// Lets the guest run at full speed again.
    pub fn release(&mut self) {
        if self.percent > 0 {
            let _ = self.vm.set_throttle(0);
            self.percent = 0;
        }
    }
}

impl Drop for Throttle<'_> {
    fn drop(&mut self) {
        self.release();
    }
}

/// Free page hinting, from before round 0 until the state is saved: the guest leaves the
/// pages it hinted unused until this ends (then, in the saved state too, it may use them).
pub(super) struct FreePageHints<'a> {
    vm: &'a dyn Migratable,
}

impl<'a> FreePageHints<'a> {
    /// The first session; `None` when the guest has no driver that hints.
    pub fn start(vm: &'a dyn Migratable) -> Option<Self> {
        vm.start_free_page_hints().then_some(Self { vm })
    }

    /// A new session: the pages the guest freed since the last are hinted too.
    pub fn again(&self) {
        self.vm.start_free_page_hints();
    }

    /// Waits until the guest handed over all it had, for at most `limit`; whether it did.
    pub fn wait(&self, limit: Duration) -> bool {
        let deadline = Instant::now() + limit;
        while !self.vm.free_page_hints_finished() {
            if Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        true
    }
}

impl Drop for FreePageHints<'_> {
    fn drop(&mut self) {
        self.vm.end_free_page_hints();
    }
}

/// The disks a migration copies, their writes logged until it ends (however it ends).
pub(super) struct DiskCopy<'a> {
    vm: &'a dyn Migratable,
    pub disks: Vec<CopiedDisk>,
    /// Blocks sent at least once, per disk: a block sent again counts as resent.
    pub sent: Vec<Bitmap>,
    /// Where a run of blocks is read to.
    pub buf: Vec<u8>,
    /// How runs are packed on the connection now (made when the first run goes, and again
    /// for a new connection).
    pub packer: Option<BlockPacker>,
    /// Copies of each block queued, per disk, where a broken connection may be carried on.
    copies: Option<Vec<Copies>>,
    /// Per disk, the blocks whose last copy did not land before a connection broke: they go
    /// with the next blocks taken.
    again: Vec<Bitmap>,
}

impl<'a> DiskCopy<'a> {
    /// Logs the disks' writes from now on: a write made while a round reads is still caught.
    pub fn start(vm: &'a dyn Migratable) -> Result<Self> {
        let disks = vm.log_disk_writes()?;
        let none = || disks.iter().map(|d| Bitmap::new(d.log.blocks())).collect();
        Ok(Self {
            vm,
            sent: none(),
            again: none(),
            disks,
            buf: vec![0; (RUN_BLOCKS * DISK_BLOCK) as usize],
            packer: None,
            copies: None,
        })
    }

    /// Counts the copies queued of each block, so that a broken connection can be carried
    /// on (`reconcile`).
    pub fn count_copies(&mut self) {
        let counts = self.disks.iter().map(|d| Copies::new(d.log.blocks()));
        self.copies = Some(counts.collect());
    }

    /// Blocks `range` of disk `index` are queued: one more copy each.
    pub fn queued(&self, index: usize, range: std::ops::Range<u64>) {
        if let Some(copies) = &self.copies {
            copies[index].add_range(range);
        }
    }

    /// The blocks of `set` of disk `index` are queued.
    pub fn queued_set(&self, index: usize, set: &Bitmap) {
        if let Some(copies) = &self.copies {
            copies[index].add_all(set);
        }
    }

    /// After a broken connection: the blocks whose copies the destination counts otherwise
    /// (`BlocksHeld`'s runs, per disk) go again with the next take. How many.
    pub fn reconcile(&mut self, held: &[Vec<(u16, u32)>]) -> Result<u64> {
        let copies = self.copies.as_ref().ok_or_else(|| {
            Error::Protocol("the destination counts disk blocks this side never counted".into())
        })?;
        if held.len() != copies.len() {
            return Err(Error::Protocol(format!(
                "the destination counts the blocks of {} disks, {} move",
                held.len(),
                copies.len()
            )));
        }
        let mut count = 0;
        for ((c, runs), (again, disk)) in copies
            .iter()
            .zip(held)
            .zip(self.again.iter_mut().zip(&self.disks))
        {
            let differ = c.reconcile(runs, &format!("blocks of disk {}", disk.slot))?;
            count += differ.count();
            again.merge(&differ);
        }
        Ok(count)
    }

    /// The slots of the disks that move, for `Storage`.
    pub fn slots(&self) -> Vec<u32> {
        self.disks.iter().map(|d| d.slot).collect()
    }

    /// What the figures start from.
    pub fn counts(&self) -> StorageCounts {
        StorageCounts {
            disks: self.disks.len() as u32,
            disk_bytes: self.disks.iter().map(|d| d.bytes).sum(),
            ..StorageCounts::default()
        }
    }

    /// The blocks written since the last take, and those a broken connection lost, per disk.
    pub fn take_written(&mut self) -> Vec<Bitmap> {
        let written = self.disks.iter().map(|d| d.log.take());
        written
            .zip(&mut self.again)
            .map(|(mut set, again)| {
                set.merge(again);
                *again = Bitmap::new(set.pages());
                set
            })
            .collect()
    }
}

impl Drop for DiskCopy<'_> {
    fn drop(&mut self) {
        self.vm.end_disk_logs();
    }
}

/// Everything a migration holds on its VM.
pub(super) struct Held<'a> {
    pub paused: Option<Paused<'a>>,
    pub dirty_log: Option<DirtyLog<'a>>,
    pub throttle: Throttle<'a>,
    pub hints: Option<FreePageHints<'a>>,
    /// The disks that move with the VM, their writes logged.
    pub disks: Option<DiskCopy<'a>>,
}

impl<'a> Held<'a> {
    pub fn new(vm: &'a dyn Migratable) -> Self {
        Self {
            paused: None,
            dirty_log: None,
            throttle: Throttle::new(vm),
            hints: None,
            disks: None,
        }
    }
}
