//! A real Linux kernel under ferry (`make linux-guest`: Debian's 6.12, guest/linux/config):
//! it boots on ferry's machine as described (ACPI FADT/MADT/DSDT, the CPU model) with no
//! workaround on its command line, its own drivers run ferry's devices with interrupts (root
//! filesystem on virtio-blk, the virtio balloon), and its syscall-free /init stamps and
//! verifies memory natively in user mode while the VM moves.
//!
//! Ring 0 runs in KVM's instruction emulator on the development host: a boot takes minutes,
//! so the limits here are wide; they bound a hang, they measure nothing.

mod common;

use std::time::{Duration, Instant};

use common::linux::{
    GUEST_IP, HZ, SWITCH_CIDR, assert_said, boot_linux, boot_seconds, jiffies_of, kernel_symbol,
    linux_devices, linux_guest, remove_root,
};
use common::testbed::Testbed;
use common::{Ferry, kvm_available, migrate, wait_for};

/// A boot's bound: the kernel reaches /init in ~2 minutes on the 2-core development host.
const BOOT: Duration = Duration::from_secs(600);
/// Anything after the boot (a pass, a balloon step) takes seconds.
const STEP: Duration = Duration::from_secs(120);

/// Linux boots from the command line `make linux-guest` wrote (no CPU-feature workaround
/// there: ferry's CPU model and ACPI tables are what it needs), mounts its root filesystem
/// from virtio-blk, configures its NIC and answers on the network, runs /init, whose native
/// writer verifies every page it stamped, and its balloon driver follows the target ferry
/// sets, reports free pages and its memory statistics.
#[test]
fn linux_boots_on_ferrys_machine_and_drives_its_devices() {
    if !kvm_available() {
        return;
    }
    let Some(guest) = linux_guest() else { return };
    for workaround in ["clearcpuid", "noxsave", "virtio_mmio.device", "acpi=off"] {
        assert!(!guest.cmdline.contains(workaround), "{}", guest.cmdline);
    }
    let bed = Testbed::new("lnx", 1);
    bed.address_switch(SWITCH_CIDR);
    let (vm, root) = boot_linux(&guest, &bed.hosts[0], &[]);
    let first = vm.wait_writer("/init's first passes", 0, 3, BOOT);
    assert_eq!(first.pages, 16 << 8);
    let serial = vm.serial_text();
    assert!(!serial.contains("Unable to enable ACPI"), "{serial}");
    assert_said(&serial, "VFS: Mounted root (ext2 filesystem)");
    assert!(boot_seconds(&serial).is_some(), "{serial}");
    let disk = vm
        .info()
        .devices
        .into_iter()
        .find(|d| d.kind == "virtio-blk");
    let reads = disk.and_then(|d| d.counters.get("reads").copied());
    assert!(
        reads.unwrap_or(0) > 0,
        "the kernel read its root from virtio-blk"
    );

    // The balloon driver inflates to ferry's target and deflates back; the writer's pages,
    // which it holds, are never taken.
    let target = |mib: u64| {
        vm.api()
            .put(
                "vm.balloon",
                Some(&serde_json::json!({ "target_mib": mib })),
            )
            .expect("a balloon target");
    };
    let actual = |pages: u64| {
        vm.wait_info("the balloon's driver", STEP, |i| {
            i.balloon.as_ref().is_some_and(|b| b.actual_pages == pages)
        })
    };
    target(32);
    let info = actual(32 << 8);
    let b = info.balloon.unwrap();
    assert!(b.pages_inflated >= 32 << 8, "{b:?}");
    assert!(b.pages_reported > 0, "free page reporting: {b:?}");
    let stats = vm.wait_info("the driver's statistics", STEP, |i| {
        i.balloon.as_ref().is_some_and(|b| b.stats_updates >= 2)
    });
    let free = stats.balloon.unwrap().guest_free_bytes;
    assert!(free.is_some_and(|f| f > 0 && f < 256 << 20), "{free:?}");
    target(0);
    actual(0);
    let after = vm.wait_writer("passes after the balloon", first.passes, 3, STEP);
    assert_eq!((after.errors, after.first_bad), (0, 0), "{after:?}");
    drop(vm);
    remove_root(&root);
}

/// How long the boot took, from the kernel's own clock (printed, not asserted: the
/// benchmarks measure).
#[test]
fn boot_seconds_reads_the_kernels_clock() {
    let serial = "[    0.000000] Linux version 6.12\n[  104.250000] Run /init as init process\n";
    assert_eq!(boot_seconds(serial), Some(104.25));
    assert_eq!(boot_seconds("no such line"), None);
}

/// One move of the chain: how the VM gets from one ferry to the next.
#[derive(Clone, Copy, Debug)]
enum Move {
    /// `ferry migrate --mode MODE` to a `ferry run --incoming` over a unix socket.
    Live(&'static str),
    /// `ferry migrate --local`: memory and files handed over, nothing copied.
    LiveUpdate,
    /// `ferry snapshot`, then `ferry run --restore` (the source stays paused, then goes).
    SnapshotRestore,
}

/// Moves the VM in `src` (in testbed host `from`) to a new ferry in host `to` as `how`
/// says; returns the new one, running.
fn hop(src: &Ferry, how: Move, root: &std::path::Path, to: &str, n: usize) -> Ferry {
    let url = format!("unix:{}", src.scratch(&format!("hop{n}.sock")).display());
    let devices = linux_devices(root);
    let destination = |first: &[&str]| {
        let mut args = first.to_vec();
        args.extend(devices.iter().map(String::as_str));
        Ferry::start_in_netns(to, &args)
    };
    match how {
        Move::Live(mode) => {
            let dst = destination(&["--incoming", &url]);
            let (status, ok, errors) = migrate(src, &url, &["--mode", mode]);
            assert!(ok, "{how:?}: {errors}");
            assert!(status.pages_full > 0, "{how:?}: {status:?}");
            dst
        }
        Move::LiveUpdate => {
            let dst = destination(&["--incoming", &url]);
            let (_, ok, errors) = migrate(src, &url, &["--local"]);
            assert!(ok, "{how:?}: {errors}");
            dst
        }
        Move::SnapshotRestore => {
            let (file, _) = src.snapshot(&format!("hop{n}.ferry"));
            src.put("vm.shutdown");
            destination(&["--restore", file.to_str().unwrap()])
        }
    }
}

/// The kernel's clock across a move, from `jiffies_64` in guest memory: it goes on from where
/// the source left it, never ahead of the time that passed on this host, and it ticks on at
/// the destination (timer interrupts arrive, the clocksource advances).
struct Ticks {
    at: u64,
    seen: u64,
    when: Instant,
}

impl Ticks {
    fn read(vm: &Ferry, at: u64) -> Ticks {
        let pid = vm.child.as_ref().unwrap().id();
        Ticks {
            at,
            seen: jiffies_of(pid, at),
            when: Instant::now(),
        }
    }

    /// Checks the clock of `vm` (where the VM runs now) against this earlier reading.
    fn go_on_in(&self, vm: &Ferry, how: Move) {
        let now = Ticks::read(vm, self.at);
        let allowed = self.when.elapsed().as_millis() as u64 * HZ / 1000 + 2;
        assert!(
            now.seen >= self.seen && now.seen - self.seen <= allowed,
            "{how:?}: jiffies went from {} to {}, {allowed} allowed by the time that passed",
            self.seen,
            now.seen
        );
        let pid = vm.child.as_ref().unwrap().id();
        wait_for("the kernel's tick to go on", STEP, || {
            (jiffies_of(pid, self.at) >= now.seen + HZ).then_some(())
        });
    }
}

/// The Linux guest moves in every mode, one after another: after each move its writer goes
/// on with every page it stamped intact, it keeps reading its file from the root filesystem
/// on virtio-blk (right, every page), its kernel answers on the NIC (now on the destination
/// host's tap), its clock goes on (`Ticks`), and its balloon driver follows a new target.
#[test]
fn linux_moves_in_every_mode_with_its_writer_disk_and_balloon() {
    if !kvm_available() {
        return;
    }
    let Some(guest) = linux_guest() else { return };
    let bed = Testbed::new("lnxmv", 2);
    bed.address_switch(SWITCH_CIDR);
    let (first, root) = boot_linux(&guest, &bed.hosts[0], &[]);
    let mut host = 0;
    let mut last = first.wait_writer("/init's first passes", 0, 3, BOOT);
    let jiffies = kernel_symbol(&guest.vmlinux, "jiffies_64");
    let mut vm = first;
    let moves = [
        Move::Live("precopy"),
        Move::Live("postcopy"),
        Move::Live("hybrid"),
        Move::Live("warm"),
        Move::LiveUpdate,
        Move::SnapshotRestore,
    ];
    for (n, how) in moves.into_iter().enumerate() {
        // A live update stays on its host; every other move goes to the other one.
        if !matches!(how, Move::LiveUpdate) {
            host = 1 - host;
        }
        let ticks = Ticks::read(&vm, jiffies);
        let next = hop(&vm, how, &root, &bed.hosts[host], n);
        drop(vm);
        vm = next;
        let now = vm.wait_writer(&format!("the writer after {how:?}"), last.passes, 3, STEP);
        assert_eq!((now.errors, now.first_bad), (0, 0), "{how:?}: {now:?}");
        assert_eq!(now.file_errors, 0, "{how:?}: {now:?}");
        ticks.go_on_in(&vm, how);
        // The file goes on coming from the disk through this ferry's virtio-blk (a read
        // reaches it once the kernel's readahead window is used up), every page right.
        wait_for("a read from the disk here", STEP, || {
            let disk = vm
                .info()
                .devices
                .into_iter()
                .find(|d| d.kind == "virtio-blk");
            disk.and_then(|d| d.counters.get("reads").copied())
                .filter(|&reads| reads > 0)
        });
        let read = vm.wait_header("the file read on", STEP, |w| {
            w.file_pages >= now.file_pages + 8
        });
        assert_eq!(read.file_errors, 0, "{how:?}: {read:?}");
        assert!(
            bed.knock(GUEST_IP, 10),
            "{how:?}: the guest answers on its NIC"
        );
        let mib = if n % 2 == 0 { 8 } else { 4 };
        vm.api()
            .put(
                "vm.balloon",
                Some(&serde_json::json!({ "target_mib": mib })),
            )
            .expect("a balloon target");
        vm.wait_info("the balloon's driver", STEP, |i| {
            i.balloon
                .as_ref()
                .is_some_and(|b| b.actual_pages == mib << 8)
        });
        last = now;
    }
    drop(vm);
    remove_root(&root);
}
