//! Storage migration (`--copy-storage`): the disk moves with its VM to a host whose disk is
//! its own, in the migration's stream, while the guest writes it. The guest's `blk` workload
//! stamps sectors and reads each one back; the rest of the disk (data written before the VM
//! booted, holes, blocks of zeros) must arrive byte for byte over a target that held other
//! bytes; and a move that fails leaves the VM running on its own disk, every write kept.

mod common;

use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use api::{MigrationPhase, MigrationStatus};
use common::relay::{Action, Point};
use common::*;

const T: Duration = Duration::from_secs(60);
const MIB: u64 = 1 << 20;
const DISK_BYTES: u64 = 32 * MIB;
/// The guest stamps the first MiB (2048 sectors); the rest is the disk's own data.
const SECTORS: u64 = 2048;
const WORKLOAD_BYTES: u64 = SECTORS * 512;

/// Deterministic bytes that are not zeros: byte `i` of the disk.
fn pattern(at: u64, len: usize) -> Vec<u8> {
    (0..len as u64)
        .map(|i| {
            let x = (at + i).wrapping_mul(0x9E37_79B9_7F4A_7C15);
            (x >> 56) as u8 | 1
        })
        .collect()
}

/// A sparse disk: 8 MiB of data from 4 MiB, an odd run of 64 KiB + 512 bytes at 20 MiB, an
/// allocated block of zeros at 24 MiB, holes elsewhere (the guest's first MiB reads zeros).
fn source_disk(dir: &Path) -> PathBuf {
    let path = dir.join("source.img");
    let f = std::fs::File::create(&path).unwrap();
    f.set_len(DISK_BYTES).unwrap();
    f.write_all_at(&pattern(4 * MIB, 8 * MIB as usize), 4 * MIB)
        .unwrap();
    f.write_all_at(&pattern(20 * MIB, 64 * 1024 + 512), 20 * MIB)
        .unwrap();
    f.write_all_at(&vec![0; 64 * 1024], 24 * MIB).unwrap();
    path
}

/// A disk whose 8 MiB of data from 4 MiB is text, as a file system's often is.
fn text_disk(dir: &Path) -> PathBuf {
    let path = dir.join("text.img");
    let f = std::fs::File::create(&path).unwrap();
    f.set_len(DISK_BYTES).unwrap();
    let line = b"The quick brown fox jumps over the lazy dog, line after line; ";
    let text: Vec<u8> = (0..8 * MIB as usize)
        .map(|i| line[i % line.len()] ^ (i / 4096) as u8 & 7)
        .collect();
    f.write_all_at(&text, 4 * MIB).unwrap();
    path
}

/// The destination's own disk, as large, every byte 0xEE: what arrives must replace it all.
fn target_disk(dir: &Path) -> PathBuf {
    let path = dir.join("target.img");
    std::fs::write(&path, vec![0xEE; DISK_BYTES as usize]).unwrap();
    path
}

fn disk_arg(path: &Path) -> String {
    format!("path={}", path.display())
}

/// How the guest picks the sectors it stamps.
#[derive(Clone, Copy)]
enum Order {
    /// In turn: each round of `SECTORS` steps reads every sector back.
    InTurn,
    /// At random (`blk_random`).
    Random,
}

/// A writer guest stamping the disk's first MiB, once it has been round it (in turn).
fn boot_on(disk: &Path) -> Ferry {
    boot_writing(disk, Order::InTurn)
}

fn boot_writing(disk: &Path, order: Order) -> Ferry {
    let words = match order {
        Order::InTurn => "blk",
        Order::Random => "blk_random",
    };
    let cmdline = format!("write ws=16M seq verify {words} blk_sectors={SECTORS} blk_rate=4000");
    Ferry::disk_writer(&cmdline, &disk_arg(disk), SECTORS)
}

/// Every sector read back once more on `vm` (from where it stands now), none wrong, and its
/// memory intact.
fn assert_disk_verified(vm: &Ferry, what: &str) {
    assert_reads_right(vm, SECTORS, what);
}

/// `reads` more sectors read back on `vm`, none wrong, and its memory intact.
fn assert_reads_right(vm: &Ferry, reads: u64, what: &str) {
    let from = vm.info().blk_reads;
    let info = vm.wait_info("sectors read back again", T, |i| i.blk_reads > from + reads);
    assert_eq!(
        info.blk_errors, 0,
        "{what}: sectors read back wrong: {:?}",
        info.blk_error_sectors
    );
    assert_eq!(info.verify_errors, 0, "{what}: memory verify errors");
}

fn read(path: &Path, from: u64) -> Vec<u8> {
    let all = std::fs::read(path).unwrap();
    all[from as usize..].to_vec()
}

/// The target past the guest's sectors equals the source byte for byte.
fn assert_rest_equal(source: &Path, target: &Path) {
    let (want, got) = (read(source, WORKLOAD_BYTES), read(target, WORKLOAD_BYTES));
    let first_wrong = want.iter().zip(&got).position(|(a, b)| a != b);
    assert_eq!(
        first_wrong.map(|i| i as u64 + WORKLOAD_BYTES),
        None,
        "the target differs from the source"
    );
}

/// A guest writing its disk in `order` moves with it (`ferry migrate --copy-storage` and
/// `args`) to a destination whose disk is `target`; the destination, and the source's report.
fn move_with_disk(
    source: &Path,
    target: &Path,
    order: Order,
    args: &[&str],
) -> (Ferry, MigrationStatus) {
    let mut src = boot_writing(source, order);
    let url = format!("tcp:127.0.0.1:{}", free_port());
    let dst = Ferry::start(&["--incoming", &url, "--disk", &disk_arg(target)]);
    let (report, ok, errors) = migrate(&src, &url, &[&["--copy-storage"], args].concat());
    assert!(ok, "{errors}");
    assert_eq!(report.phase, MigrationPhase::Completed);
    assert!(src.wait_exit(T).success(), "the source let go");
    (dst, report)
}

#[test]
fn a_disk_moves_with_its_vm_to_a_host_with_a_disk_of_its_own() {
    if !kvm_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (source, target) = (source_disk(dir.path()), target_disk(dir.path()));
    let (dst, report) = move_with_disk(&source, &target, Order::InTurn, &["--checksum"]);
    let storage = report.storage.expect("the report counts the disk");
    assert_eq!((storage.disks, storage.disk_bytes), (1, DISK_BYTES));
    assert!(
        storage.data_bytes >= 8 * MIB + 64 * 1024,
        "the disk's data went: {storage:?}"
    );
    assert!(
        storage.zero_bytes >= 16 * MIB,
        "holes went as zero ranges: {storage:?}"
    );
    assert!(
        report.bytes_on_wire > storage.data_bytes,
        "the disk's bytes are counted on the wire: {} against {storage:?}",
        report.bytes_on_wire
    );
    // The guest reads back every sector it wrote, on the destination's own disk...
    assert_disk_verified(&dst, "after the move");
    // ...and everything past them is the source's, byte for byte, the 0xEE gone.
    assert_rest_equal(&source, &target);
}

/// Writes at random sectors move as well: blocks dirtied anywhere, in any order, between
/// rounds. The guest reads four rounds' worth of random sectors back on the destination.
#[test]
fn random_writes_move_with_the_disk() {
    if !kvm_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (source, target) = (source_disk(dir.path()), target_disk(dir.path()));
    let (dst, _) = move_with_disk(&source, &target, Order::Random, &["--connections", "2"]);
    assert_reads_right(&dst, 4 * SECTORS, "after the move");
    assert_rest_equal(&source, &target);
}

/// Blocks that compress go packed with the codec asked for (`--compression zstd`), and unpack
/// to the very bytes: the rest of the target equals the source.
#[test]
fn a_disk_that_compresses_goes_packed() {
    if !kvm_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (source, target) = (text_disk(dir.path()), target_disk(dir.path()));
    let args = ["--compression", "zstd"];
    let (dst, report) = move_with_disk(&source, &target, Order::InTurn, &args);
    let storage = report.storage.expect("the report counts the disk");
    assert!(
        storage.data_bytes >= 8 * MIB && storage.data_wire_bytes * 4 < storage.data_bytes,
        "the text went packed: {storage:?}"
    );
    assert_disk_verified(&dst, "after the packed move");
    assert_rest_equal(&source, &target);
}

/// Warm: the guest pauses first and the whole disk goes in the pause, counted so.
#[test]
fn a_warm_move_takes_the_whole_disk_in_its_pause() {
    if !kvm_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (source, target) = (source_disk(dir.path()), target_disk(dir.path()));
    let (dst, report) = move_with_disk(&source, &target, Order::InTurn, &["--mode", "warm"]);
    let storage = report.storage.expect("the report counts the disk");
    let data_blocks = storage.data_bytes.div_ceil(64 * 1024);
    assert!(
        storage.blocks_in_pause >= data_blocks,
        "every block went with the guest paused: {storage:?}"
    );
    assert_disk_verified(&dst, "after the warm move");
    assert_rest_equal(&source, &target);
}

/// A destination that dies while the disk copies: the source runs on, on its own disk, and
/// no write the guest made is lost; the target is left to its owner.
#[test]
fn a_move_that_fails_while_the_disk_copies_leaves_the_vm_on_its_own_disk() {
    if !kvm_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (source, target) = (source_disk(dir.path()), target_disk(dir.path()));
    let src = boot_on(&source);
    let (mut dst, relay) =
        destination_behind_with(Point::Disk, Action::Hold, &["--disk", &disk_arg(&target)]);
    // It dials the dead destination again for 2 s, then gives up.
    let body = serde_json::json!({
        "destination": relay.url,
        "copy_storage": true,
        "resume_window_s": 2,
    });
    src.api()
        .put("vm.send-migration", Some(&body))
        .expect("the migration starts");
    assert!(relay.wait_reached(T), "no disk block crossed");
    if let Some(child) = dst.child.as_mut() {
        child.kill().unwrap();
        child.wait().unwrap();
    }
    relay.release();
    let status = src.wait_migration_end();
    assert_eq!(status.phase, MigrationPhase::Failed, "{status:?}");
    assert_eq!(src.info().state, "running");
    assert_disk_verified(&src, "on the source after the failed move");
}

/// A link that breaks while the disk crosses, and comes back: the source carries the move on
/// over a new connection, and the blocks whose last copy did not land go again with the next
/// round. None is lost: the guest reads every sector back on the destination, and the rest
/// of the target equals the source (a block left out would still hold 0xEE).
#[test]
fn a_link_broken_while_the_disk_crosses_is_carried_on_and_loses_no_block() {
    if !kvm_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (source, target) = (source_disk(dir.path()), target_disk(dir.path()));
    let mut src = boot_on(&source);
    // Round 0's fifth run of blocks: four have crossed, the rest is cut off with the link.
    let (dst, relay) = destination_behind_with(
        Point::DiskFrame(5),
        Action::Blip,
        &["--disk", &disk_arg(&target)],
    );
    let (report, ok, errors) = migrate(&src, &relay.url, &["--copy-storage", "--checksum"]);
    assert!(ok, "{errors}");
    assert_eq!(report.phase, MigrationPhase::Completed);
    assert!(
        relay.wait_reached(Duration::ZERO),
        "the link broke at the disk"
    );
    assert_eq!(report.resumes, 1, "{report:?}");
    assert_eq!(
        report.memory_checksum_source, report.memory_checksum_destination,
        "memory arrived equal"
    );
    assert!(src.wait_exit(T).success(), "the source let go");
    assert_eq!(
        dst.migration_status().resumes,
        1,
        "the destination carried on"
    );
    assert_disk_verified(&dst, "after the resumed move");
    assert_rest_equal(&source, &target);
}

/// What cannot work is refused before any block crosses, naming why, and the VM runs on:
/// a target that is the source's own disk (it is locked), a post-copy that would switch
/// before the disk arrived.
#[test]
fn a_move_that_cannot_copy_the_disk_is_refused_and_the_vm_runs_on() {
    if !kvm_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let source = source_disk(dir.path());
    let src = boot_on(&source);
    let url = format!("tcp:127.0.0.1:{}", free_port());
    let mut same = Ferry::start(&["--incoming", &url, "--disk", &disk_arg(&source)]);
    // The destination refuses in the handshake: the migration does not even start.
    let (_, ok, errors) = migrate(&src, &url, &["--copy-storage"]);
    assert!(!ok);
    assert!(errors.contains("in use by another process"), "{errors}");
    assert!(same.wait_exit(T).success() || !same.is_running());

    let (_, ok, errors) = migrate(&src, &url, &["--copy-storage", "--mode", "postcopy"]);
    assert!(!ok);
    assert!(errors.contains("copy_storage"), "{errors}");
    assert_eq!(src.info().state, "running");
    assert_disk_verified(&src, "on the source after the refusals");
}
