//! The VM's balloon, as ferry's API and the migration engine drive it: its target, what it
//! holds, and holding its discards while post-copy owns guest memory.

use migration::sync::Locked;

use virtio_bindings::virtio_ids::VIRTIO_ID_BALLOON;

use super::Vm;
use crate::devices::DeviceSlot;
use crate::devices::virtio::balloon::{self, Balloon, BalloonInfo};
use crate::error::{Error, Result};

impl Vm {
    /// The balloon's slot, if the VM has one.
    fn balloon_slot(&self) -> Option<&DeviceSlot> {
        self.bus.virtio.iter().find(|d| {
            let d = d.lock();
            d.device().device_type() == VIRTIO_ID_BALLOON
        })
    }

    /// Runs `f` on the balloon and its transport, if the VM has one.
    fn with_balloon<R>(&self, f: impl FnOnce(&mut Balloon) -> R) -> Option<R> {
        let slot = self.balloon_slot()?;
        let mut t = slot.lock();
        balloon::of(t.device_mut()).map(f)
    }

    /// Asks the guest's balloon driver to hold `pages` pages (4 KiB); refused without a
    /// balloon (`ferry run --balloon`) or for more pages than the VM has.
    pub fn set_balloon_target(&self, pages: u64) -> Result<()> {
        let ram = self.config.memory / 4096;
        if pages > ram {
            return Err(Error::Config(format!(
                "a balloon of {pages} pages is larger than the VM's memory ({ram} pages)"
            )));
        }
        if self.balloon_slot().is_none() {
            return Err(Error::Config(
                "the VM has no balloon (ferry run --balloon)".into(),
            ));
        }
        self.tell_balloon(|b| {
            b.set_target(pages as u32);
            true
        });
        Ok(())
    }

    /// The balloon's target, what the guest says it holds, what it did, and the guest's last
    /// memory statistics; `None` without a balloon.
    pub fn balloon_info(&self) -> Option<BalloonInfo> {
        self.with_balloon(|b| b.info())
    }

    /// The pages the balloon gave back to the host since the VM came here (inflated or
    /// reported, not deflated since); `None` without a balloon or before the first.
    pub fn balloon_given_back(&self) -> Option<migration::bitmap::Bitmap> {
        self.with_balloon(|b| b.given_back().cloned()).flatten()
    }

    /// Asks the guest's balloon driver for its free pages under a new hinting session (the
    /// driver is told the configuration changed); false without a driver that hints.
    pub fn start_free_page_hints(&self) -> bool {
        self.tell_balloon(Balloon::start_hints)
    }

    /// Whether the driver handed over all it had for the current session (true without one).
    pub fn free_page_hints_finished(&self) -> bool {
        self.with_balloon(|b| b.hints_finished()).unwrap_or(true)
    }

    /// Tells the driver hinting is done: it may use the pages it hinted again.
    pub fn end_free_page_hints(&self) {
        self.tell_balloon(Balloon::end_hints);
    }

    /// Runs `change` on the balloon and, when it says so, tells the driver its configuration
    /// changed; what `change` said (false without a balloon).
    fn tell_balloon(&self, change: impl FnOnce(&mut Balloon) -> bool) -> bool {
        let Some(slot) = self.balloon_slot() else {
            return false;
        };
        let mut t = slot.lock();
        let changed = balloon::of(t.device_mut()).is_some_and(change);
        if changed {
            t.config_changed();
        }
        changed
    }

    /// While post-copy holds guest memory (`hold`), the balloon gives no page back to the
    /// host; when it lets go, the pages inflated meanwhile are given back (and those that held
    /// data logged as written).
    pub fn hold_page_discards(&self, hold: bool) {
        let memory = self.memory.clone();
        let bus = self.bus.clone();
        self.with_balloon(|b| {
            let mut written = bus.vmm_writes.locked();
            b.hold_discards(hold, &memory, &mut *written);
        });
    }
}
