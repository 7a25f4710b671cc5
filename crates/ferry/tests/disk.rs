//! A disk that survives the move: the guest's `blk` workload stamps sectors with their number
//! and a generation and checks each one reads back what it last wrote, while the VM moves
//! between processes that open the same file (shared storage, as two hosts would). No write
//! may be lost or land twice, and only one process may ever write the disk.

mod common;

use std::path::{Path, PathBuf};
use std::time::Duration;

use api::MigrationPhase;
use common::relay::{Action, Point};
use common::*;

const T: Duration = Duration::from_secs(60);
/// The guest cycles over this many sectors: every one is read back each cycle.
const SECTORS: u64 = 256;

fn disk(dir: &Path) -> PathBuf {
    let path = dir.join("disk.img");
    std::fs::File::create(&path)
        .and_then(|f| f.set_len(4 << 20))
        .expect("disk file");
    path
}

fn disk_arg(path: &Path) -> String {
    format!("path={}", path.display())
}

/// A writer guest with the disk workload beside it, once it has been round its sectors.
fn boot_with_disk(path: &Path) -> Ferry {
    let cmdline = format!("write ws=16M seq verify blk blk_sectors={SECTORS}");
    Ferry::disk_writer(&cmdline, &disk_arg(path), SECTORS)
}

/// A disk in a fresh directory and a VM writing it (None where KVM is missing).
fn vm_with_disk() -> Option<(tempfile::TempDir, PathBuf, Ferry)> {
    if !kvm_available() {
        return None;
    }
    let dir = tempfile::tempdir().unwrap();
    let path = disk(dir.path());
    let vm = boot_with_disk(&path);
    Some((dir, path, vm))
}

/// Every sector read back at least once more on `vm` since `from` writes, and none wrong.
fn assert_disk_verified(vm: &Ferry, from: u64, what: &str) {
    let info = vm.wait_info("every sector read back again", T, |i| {
        i.blk_reads > from + SECTORS
    });
    assert_eq!(
        info.blk_errors, 0,
        "{what}: sectors read back wrong: {:?}",
        info.blk_error_sectors
    );
    assert_eq!(info.verify_errors, 0, "{what}: memory verify errors");
    let dev = &info.devices[0];
    assert_eq!(dev.kind, "virtio-blk");
    assert_eq!(dev.needs_reset, None, "{what}");
    // The driver's notifications reach the device through KVM's ioeventfd, not by exits.
    let notifies = |how: &str| dev.counters.get(how).copied().unwrap_or(0);
    assert!(
        notifies("notifies_by_eventfd") > 0,
        "{what}: {:?}",
        dev.counters
    );
    assert_eq!(
        notifies("notifies_by_exit"),
        0,
        "{what}: {:?}",
        dev.counters
    );
}

#[test]
fn disk_writes_survive_precopy_then_postcopy() {
    let Some((_dir, path, mut src)) = vm_with_disk() else {
        return;
    };

    // Pre-copy to a second process that opens the same file.
    let port = free_port();
    let url = format!("tcp:127.0.0.1:{port}");
    let mut mid = Ferry::start(&["--incoming", &url, "--disk", &disk_arg(&path)]);
    let (report, ok, errors) = migrate(&src, &url, &["--checksum"]);
    assert!(ok, "{errors}");
    assert_eq!(report.phase, MigrationPhase::Completed);
    assert!(src.wait_exit(T).success(), "the source let go");
    let arrived = mid.info().blk_writes;
    assert_disk_verified(&mid, arrived, "after pre-copy");

    // And on by post-copy to a third.
    let port = free_port();
    let url = format!("tcp:127.0.0.1:{port}");
    let last = Ferry::start(&["--incoming", &url, "--disk", &disk_arg(&path)]);
    let (report, ok, errors) = migrate(&mid, &url, &["--mode", "postcopy"]);
    assert!(ok, "{errors}");
    assert_eq!(report.phase, MigrationPhase::Completed);
    assert!(mid.wait_exit(T).success(), "the second host let go");
    let arrived = last.info().blk_writes;
    assert_disk_verified(&last, arrived, "after post-copy");
}

#[test]
fn a_destination_without_the_disk_is_refused_and_the_source_keeps_writing() {
    let Some((_dir, _path, src)) = vm_with_disk() else {
        return;
    };
    let port = free_port();
    let url = format!("tcp:127.0.0.1:{port}");
    let _dst = Ferry::incoming(&url); // no --disk
    let (_, ok, errors) = migrate(&src, &url, &[]);
    assert!(!ok, "a VM must not arrive without its disk");
    assert_eq!(src.wait_migration_end().phase, MigrationPhase::Failed);
    assert!(
        errors.contains("the VM has 1 virtio device (disk), this destination no virtio device"),
        "{errors}"
    );
    // The source took its disk back and goes on writing it.
    assert_eq!(src.info().state, "running");
    let now = src.info().blk_writes;
    assert_disk_verified(&src, now, "after the refused migration");
}

/// A destination whose disk cannot take the VM's (another size; read-only where the VM's is
/// writable) refuses it in the handshake, naming the difference: no page crosses, the
/// destination never runs it, and the source writes on.
#[test]
fn a_destination_with_another_disk_is_refused_before_any_page_crosses() {
    let Some((dir, path, src)) = vm_with_disk() else {
        return;
    };
    let small = dir.path().join("small.img");
    std::fs::File::create(&small)
        .and_then(|f| f.set_len(2 << 20))
        .expect("a smaller disk");
    for (arg, why) in [
        (
            disk_arg(&small),
            format!(
                "virtio slot 0: the VM's disk has 8192 sectors, this destination's {} has 4096",
                small.display()
            ),
        ),
        (
            format!("{},readonly", disk_arg(&path)),
            format!(
                "virtio slot 0: the VM's disk is read-write, this destination's {} is read-only",
                path.display()
            ),
        ),
    ] {
        let url = format!("tcp:127.0.0.1:{}", free_port());
        let mut dst = Ferry::start(&["--incoming", &url, "--disk", &arg]);
        let (_, ok, errors) = migrate(&src, &url, &[]);
        assert!(!ok, "--disk {arg}: the VM arrived");
        assert!(errors.contains(&why), "--disk {arg}: {errors}");
        let report = src.wait_migration_end();
        assert_eq!(report.phase, MigrationPhase::Failed, "--disk {arg}");
        let pages = (report.pages_full, report.pages_zero, report.rounds.len());
        assert_eq!(pages, (0, 0, 0), "--disk {arg}: pages crossed");
        assert!(
            !dst.wait_exit(T).success(),
            "--disk {arg}: the destination ran it"
        );
        assert_eq!(src.info().state, "running", "--disk {arg}");
        let now = src.info().blk_writes;
        assert_disk_verified(&src, now, &format!("after --disk {arg} refused it"));
    }
}

#[test]
fn taking_a_vm_back_onto_a_disk_the_destination_wrote_needs_force() {
    let Some((_dir, path, src)) = vm_with_disk() else {
        return;
    };
    let arg = disk_arg(&path);
    let (mut dst, relay) =
        destination_behind_with(Point::Postcopy(50), Action::Cut, &["--disk", &arg]);
    let (report, ok, _) = migrate(&src, &relay.url, &["--mode", "postcopy"]);
    assert!(!ok);
    assert_eq!(report.phase, MigrationPhase::PostcopyPaused, "{report:?}");
    drop(relay);
    // The destination ran the guest on the disk after the switch, then its host died.
    dst.child.as_mut().unwrap().kill().unwrap();
    let _ = dst.wait_exit(T);
    let err = src.api().put("vm.migrate-reclaim", None).unwrap_err();
    assert!(err.to_string().contains("writable disk"), "{err}");
    assert_eq!(
        src.info().state,
        "postcopy-paused",
        "refused: nothing changed"
    );
    let out = ferry_output(&[
        "migrate-rollback",
        "--api-socket",
        src.socket.to_str().unwrap(),
        "--force",
    ]);
    assert!(out.status.success(), "{out:?}");
    assert_eq!(src.info().state, "running");
}

#[test]
fn a_second_writer_and_bad_disk_options_are_refused() {
    let Some((_dir, path, src)) = vm_with_disk() else {
        return;
    };
    assert_second_writer_refused(&path);
    let guest = guest();
    let guest = guest.to_str().unwrap();

    for (arg, expect) in [
        ("file=/tmp/x.img", "use path=FILE"),
        ("readonly", "names no path="),
        ("path=/nonexistent/disk.img", "/nonexistent/disk.img"),
    ] {
        let out = ferry_output(&[
            "run",
            "--guest",
            guest,
            "--disk",
            arg,
            "--serial",
            "/dev/null",
        ]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "--disk {arg}");
        assert!(stderr.contains(expect), "--disk {arg}: {stderr}");
    }

    // Post-copy checkpoints cannot roll a writable disk back: refused, and said why.
    let err = src
        .api()
        .put(
            "vm.send-migration",
            Some(&serde_json::json!({
                "destination": "tcp:127.0.0.1:1", "mode": "postcopy", "checkpoint_ms": 20
            })),
        )
        .unwrap_err();
    assert!(err.to_string().contains("writable disk"), "{err}");
    assert_eq!(src.info().state, "running");
}

/// A migration cancelled after the source paused and let go of the disk (pre-copy: while its
/// vCPU state is on its way; post-copy: at the switch): the source takes the disk back and
/// writes on with nothing lost, the destination never runs the VM, and a later migration still
/// hands the disk over.
#[test]
fn a_cancelled_migration_gives_the_disk_back_to_the_source() {
    let Some((_dir, path, mut src)) = vm_with_disk() else {
        return;
    };
    let arg = disk_arg(&path);
    for (mode, point) in [("precopy", Point::State), ("postcopy", Point::Pause)] {
        let (mut dst, relay) = destination_behind_with(point, Action::Hold, &["--disk", &arg]);
        let migrating = {
            let (socket, url) = (src.socket.to_str().unwrap().to_string(), relay.url.clone());
            std::thread::spawn(move || {
                ferry_output(&[
                    "migrate",
                    "--api-socket",
                    &socket,
                    "--to",
                    &url,
                    "--mode",
                    mode,
                ])
            })
        };
        assert!(relay.wait_reached(T), "{mode}: reached {}", point.name());
        src.put("vm.cancel-migration");
        relay.release();
        assert!(
            !migrating.join().unwrap().status.success(),
            "{mode}: cancelled"
        );
        let status = src.wait_migration_end();
        assert_eq!(
            status.phase,
            MigrationPhase::Cancelled,
            "{mode}: {status:?}"
        );
        assert!(
            !dst.wait_exit(T).success(),
            "{mode}: the destination never runs a cancelled VM"
        );
        drop(relay);
        assert_eq!(src.info().state, "running", "{mode}");
        assert_second_writer_refused(&path);
        let now = src.info().blk_writes;
        assert_disk_verified(&src, now, &format!("after a cancelled {mode}"));
    }
    let port = free_port();
    let url = format!("tcp:127.0.0.1:{port}");
    let dst = Ferry::start(&["--incoming", &url, "--disk", &arg]);
    let (report, ok, errors) = migrate(&src, &url, &[]);
    assert!(ok, "{errors}");
    assert_eq!(report.phase, MigrationPhase::Completed);
    assert!(src.wait_exit(T).success(), "the source let go");
    let arrived = dst.info().blk_writes;
    assert_disk_verified(&dst, arrived, "after the cancelled migrations");
}
