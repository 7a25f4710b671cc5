//! KVM's manual dirty-log protection. With it, reading the dirty log no longer re-protects all
//! of guest memory; ferry clears (and so re-protects) exactly the pages it read as dirty, so the
//! cost of each round follows what is sent, not the size of the VM. Where KVM offers it, the
//! log also starts all set: turning logging on then protects nothing, and ferry protects only
//! the pages that hold data (a page never touched has nothing to protect; see `Vm`).
//!
//! Written by hand because kvm-ioctls 0.25 has no wrapper for `KVM_CLEAR_DIRTY_LOG`, and its
//! `get_dirty_log` allocates a new bitmap on every call: at the switch that is a few hundred
//! first-touch page faults inside the guest's downtime, so `get` reads into a reused buffer.

use kvm_bindings::{
    KVM_CAP_MANUAL_DIRTY_LOG_PROTECT2, KVM_DIRTY_LOG_INITIALLY_SET,
    KVM_DIRTY_LOG_MANUAL_PROTECT_ENABLE, kvm_clear_dirty_log, kvm_clear_dirty_log__bindgen_ty_1,
    kvm_dirty_log, kvm_dirty_log__bindgen_ty_1, kvm_enable_cap,
};
use kvm_ioctls::VmFd;
use vmm_sys_util::ioctl::ioctl_with_ref;
use vmm_sys_util::ioctl_iowr_nr;

const KVMIO: u32 = 0xAE;
ioctl_iowr_nr!(KVM_CLEAR_DIRTY_LOG, KVMIO, 0xc0, kvm_clear_dirty_log);
vmm_sys_util::ioctl_iow_nr!(KVM_GET_DIRTY_LOG, KVMIO, 0x42, kvm_dirty_log);

/// Reads `slot`'s dirty log into `bitmap` (one bit per page of the slot, at least that long).
pub fn get(vm: &VmFd, slot: u32, bitmap: &mut [u64]) -> std::io::Result<()> {
    let log = kvm_dirty_log {
        slot,
        padding1: 0,
        __bindgen_anon_1: kvm_dirty_log__bindgen_ty_1 {
            dirty_bitmap: bitmap.as_mut_ptr() as *mut libc::c_void,
        },
    };
    // SAFETY: `log` points at a buffer the caller sized for the slot, alive for the call.
    let ret = unsafe { ioctl_with_ref(vm, KVM_GET_DIRTY_LOG(), &log) };
    if ret < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// How KVM's dirty log is protected.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Protect {
    /// Reading the log clears it and re-protects every page the guest dirtied.
    OnRead,
    /// `clear` re-protects what ferry read.
    Manual,
    /// As `Manual`, and turning logging on sets every bit instead of protecting every page.
    ManualInitiallySet,
}

/// Turns on the best protection the kernel offers.
pub fn enable_manual_protect(vm: &VmFd) -> Protect {
    let offered = vm.check_extension_raw(KVM_CAP_MANUAL_DIRTY_LOG_PROTECT2.into()) as u32;
    let want = offered & (KVM_DIRTY_LOG_MANUAL_PROTECT_ENABLE | KVM_DIRTY_LOG_INITIALLY_SET);
    let enable = |flags: u32| {
        let cap = kvm_enable_cap {
            cap: KVM_CAP_MANUAL_DIRTY_LOG_PROTECT2,
            args: [u64::from(flags), 0, 0, 0],
            ..Default::default()
        };
        vm.enable_cap(&cap).is_ok()
    };
    if want & KVM_DIRTY_LOG_INITIALLY_SET != 0
        && enable(KVM_DIRTY_LOG_MANUAL_PROTECT_ENABLE | KVM_DIRTY_LOG_INITIALLY_SET)
    {
        return Protect::ManualInitiallySet;
    }
    if enable(KVM_DIRTY_LOG_MANUAL_PROTECT_ENABLE) {
        return Protect::Manual;
    }
    Protect::OnRead
}

/// Clears the bits of `bitmap` (the slot's pages from `first_page`, a multiple of 64, up to
/// the bitmap's end or the slot's) in KVM's log and write-protects those pages again, so
/// that a later write marks them dirty anew.
pub fn clear(vm: &VmFd, slot: u32, first_page: u64, bitmap: &[u64]) -> std::io::Result<()> {
    let range = kvm_clear_dirty_log {
        slot,
        num_pages: bitmap.len() as u32 * 64,
        first_page,
        __bindgen_anon_1: kvm_clear_dirty_log__bindgen_ty_1 {
            // KVM only reads it (the binding's field is a mutable pointer).
            dirty_bitmap: bitmap.as_ptr() as *mut libc::c_void,
        },
    };
    // SAFETY: `range` points at `bitmap`, which outlives the call; KVM only reads it.
    let ret = unsafe { ioctl_with_ref(vm, KVM_CLEAR_DIRTY_LOG(), &range) };
    if ret < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}
