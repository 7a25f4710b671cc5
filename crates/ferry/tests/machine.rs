//! The machine ferry builds is a standard one: its memory map at every size, the standard PVH
//! entry for an image that is not ferry's guest, application processors started by the guest
//! with INIT/SIPI, and a working set that crosses the MMIO hole kept intact through every kind
//! of migration.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use api::MigrationPhase;
use common::*;

const T: Duration = Duration::from_secs(60);

fn serial_when(ferry: &Ferry, what: &str, done: &str) -> String {
    wait_for(what, T, || {
        let text = ferry.serial_text();
        text.contains(done).then_some(text)
    })
}

/// The e820 lines the workload guest prints for a map.
fn e820_lines(map: &[vmm::layout::E820Entry]) -> Vec<String> {
    map.iter()
        .map(|e| {
            format!(
                "ferry-guest: e820 {:#018x}-{:#018x} {}",
                e.addr,
                e.addr + e.size - 1,
                if e.kind == vmm::layout::E820_RAM {
                    "ram"
                } else {
                    "reserved"
                }
            )
        })
        .collect()
}

#[test]
fn the_guest_is_told_the_memory_map_at_every_size() {
    if !kvm_available() {
        return;
    }
    for (memory, bytes) in [
        ("512M", 512u64 << 20),
        ("3G", 3 << 30),
        ("3584M", 3584 << 20),
        ("4G", 4 << 30),
        ("5G", 5 << 30),
        ("6G", 6 << 30),
        ("64G", 64 << 30),
    ] {
        let vm = Ferry::boot(VmSpec {
            memory,
            ..Default::default()
        });
        let text = serial_when(&vm, "the guest's memory map", "mode=idle");
        let printed: Vec<&str> = text.lines().filter(|l| l.contains(" e820 ")).collect();
        assert_eq!(printed, e820_lines(&vmm::layout::e820(bytes)), "{memory}");
        for line in &printed {
            // No RAM inside the MMIO hole, whatever the size.
            if line.ends_with("ram") {
                let range = line.split_whitespace().nth(2).unwrap();
                let (start, end) = range.split_once('-').unwrap();
                let hex = |h: &str| u64::from_str_radix(h.trim_start_matches("0x"), 16).unwrap();
                assert!(
                    hex(end) < 3 << 30 || hex(start) >= 4 << 30,
                    "{memory}: {line}"
                );
            }
        }
        assert_eq!(vm.info().memory_bytes, bytes);
    }
}

/// Builds the minimal PVH image of `pvh-minimal/` (written from the PVH ABI alone).
fn minimal_pvh_image(dir: &Path) -> PathBuf {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/pvh-minimal/minimal.S");
    let out = dir.join("minimal.elf");
    let status = Command::new("cc")
        .args(["-nostdlib", "-static", "-no-pie", "-Wl,-Ttext=0x200000"])
        .args(["-Wl,--build-id=none", "-Wl,-e,entry", "-o"])
        .arg(&out)
        .arg(&src)
        .status()
        .expect("cc runs");
    assert!(status.success());
    out
}

/// QEMU with `-serial file:`; the caller kills it.
fn qemu(args: &[&str], serial: &Path) -> Child {
    Command::new("qemu-system-x86_64")
        .args(["-enable-kvm", "-display", "none", "-monitor", "none"])
        .arg("-serial")
        .arg(format!("file:{}", serial.display()))
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn qemu")
}

fn file_when(path: &Path, what: &str, done: &str) -> String {
    wait_for(what, T, || {
        let text = std::fs::read_to_string(path).unwrap_or_default();
        text.contains(done).then_some(text)
    })
}

#[test]
fn a_pvh_image_that_is_not_ferrys_boots_in_ferry_and_in_qemu() {
    if !kvm_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let image = minimal_pvh_image(dir.path());
    let image_arg = image.to_str().unwrap();
    let vm = Ferry::start(&["--guest", image_arg, "--memory", "5G"]);
    let text = serial_when(&vm, "the minimal image's output", "pvh-minimal: done");
    assert!(text.contains("pvh-minimal: magic=0x336ec578"), "{text}");
    let entries: Vec<String> = vmm::layout::e820(5 << 30)
        .iter()
        .map(|e| {
            format!(
                "pvh-minimal: memmap addr={:#018x} size={:#018x} type={:#010x}",
                e.addr, e.size, e.kind
            )
        })
        .collect();
    let printed: Vec<&str> = text.lines().filter(|l| l.contains("memmap")).collect();
    assert_eq!(printed, entries, "ferry hands over its E820 map");
    if !qemu_available() {
        return;
    }
    let serial = dir.path().join("qemu.log");
    let mut q = qemu(&["-m", "5G", "-kernel", image_arg], &serial);
    let text = file_when(&serial, "the image under QEMU", "pvh-minimal: done");
    let _ = q.kill();
    let _ = q.wait();
    // The same ABI: the same magic; the map is QEMU's own (it reserves other ranges).
    assert!(text.contains("pvh-minimal: magic=0x336ec578"), "{text}");
    assert!(text.contains("memmap addr=0x0000000100000000"), "{text}");
}

#[test]
fn the_guest_starts_its_vcpus_with_init_sipi_in_ferry_and_qemu() {
    if !kvm_available() {
        return;
    }
    for vcpus in [2usize, 4] {
        let cmdline = format!("write ws=32M verify vcpus={vcpus}");
        let vm = Ferry::boot(VmSpec {
            vcpus,
            cmdline: &cmdline,
            ..Default::default()
        });
        let text = serial_when(&vm, "the workload line", "mode=write");
        assert!(text.contains(&format!("madt cpus={vcpus}")), "{text}");
        let info = vm.wait_info("every vCPU working", T, |i| {
            i.per_vcpu.len() == vcpus && i.per_vcpu.iter().all(|c| c.pages > 0)
        });
        assert_eq!(info.verify_errors, 0);
        if !qemu_available() {
            continue;
        }
        let dir = tempfile::tempdir().unwrap();
        let serial = dir.path().join("qemu.log");
        let smp = vcpus.to_string();
        let guest = guest();
        let mut q = qemu(
            &[
                "-m",
                "1G",
                "-smp",
                &smp,
                "-kernel",
                guest.to_str().unwrap(),
                "-append",
                &cmdline,
            ],
            &serial,
        );
        let text = file_when(&serial, "the guest under QEMU -smp", "passes=");
        let _ = q.kill();
        let _ = q.wait();
        // The guest stops with an error if a processor did not come up after INIT/SIPI.
        assert!(text.contains(&format!("madt cpus={vcpus}")), "{text}");
        assert!(text.contains(&format!("vcpus={vcpus} ")), "{text}");
        assert!(!text.contains("ferry-guest: error"), "{text}");
    }
}

/// A 6 GiB guest whose 4 GiB working set crosses the MMIO hole: every page verified, then
/// moved by pre-copy, post-copy and hybrid in turn, every page verified after each move.
#[test]
fn a_working_set_across_the_hole_survives_every_kind_of_move() {
    if !kvm_available() {
        return;
    }
    let long = Duration::from_secs(300);
    let mut vm = Ferry::boot(VmSpec {
        memory: "6G",
        vcpus: 2,
        cmdline: "write ws=4G seq verify serial_ms=5000",
        ..Default::default()
    });
    let info = vm.info();
    // Both vCPUs' shares have been stamped once: every page of the working set carries a stamp.
    let done = vm.wait_info("a stamped working set", long, |i| {
        i.per_vcpu.iter().all(|c| c.passes >= 1)
    });
    assert_eq!(done.verify_errors, 0, "{info:?}");
    for mode in ["precopy", "postcopy", "hybrid"] {
        let port = free_port();
        let dst = Ferry::incoming(&format!("tcp:127.0.0.1:{port}"));
        let (report, ok, errors) = migrate(
            &vm,
            &format!("tcp:127.0.0.1:{port}"),
            &["--mode", mode, "--max-downtime-ms", "200"],
        );
        assert!(ok, "{mode}: {errors}");
        assert_eq!(report.phase, MigrationPhase::Completed, "{mode}");
        assert!(
            vm.wait_exit(T).success(),
            "{mode}: the source hands over and exits"
        );
        // A full pass on the destination reads (and checks) every page, both sides of the hole.
        let start = dst.info();
        let after = dst.wait_info("a verified pass on the destination", long, |i| {
            i.per_vcpu
                .iter()
                .zip(&start.per_vcpu)
                .all(|(now, then)| now.passes > then.passes)
        });
        assert_eq!(
            after.verify_errors, 0,
            "{mode}: {:?}",
            after.verify_error_pages
        );
        vm = dst;
    }
}
