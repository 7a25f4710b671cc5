//! Dirty logging without a migration, for measuring its cost to the guest (`make bench`).

use migration::sync::Locked;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use migration::Migratable;
use vmm::Vm;

static HARVESTER: Mutex<Option<Arc<AtomicBool>>> = Mutex::new(None);

/// Whether the hook's harvester runs now.
pub fn active() -> bool {
    HARVESTER.locked().is_some()
}

/// Turns logging on (with a thread harvesting the log every `harvest_ms`) or off.
pub fn set(vm: &Arc<Vm>, enabled: bool, harvest_ms: u64) -> Result<(), String> {
    let mut slot = HARVESTER.locked();
    if let Some(stop) = slot.take() {
        stop.store(true, Ordering::Release);
    }
    if !enabled {
        return vm.stop_dirty_log().map_err(|e| e.report());
    }
    vm.start_dirty_log().map_err(|e| e.report())?;
    let stop = Arc::new(AtomicBool::new(false));
    *slot = Some(stop.clone());
    let vm = vm.clone();
    std::thread::spawn(move || {
        while !stop.load(Ordering::Acquire) {
            std::thread::sleep(Duration::from_millis(harvest_ms.max(1)));
            if vm.take_dirty().is_err() {
                break;
            }
        }
    });
    Ok(())
}
