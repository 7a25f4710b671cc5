//! The workload guest's page content (`fill=`): migrations keep every page of a random, a
//! mixed, a fresh and a real writer, and the content really is as compressible as guest.c
//! says.

mod common;

use std::process::Command;
use std::time::Duration;

use common::*;

/// Pre-copy over a unix socket; the destination then runs two more passes without a verify error.
fn precopy_keeps_every_page(cmdline: &str) {
    precopy_keeps_every_page_of(Ferry::writer(cmdline));
}

fn precopy_keeps_every_page_of(mut src: Ferry) {
    let url = format!("unix:{}", src.scratch("mig.sock").display());
    let dst = Ferry::incoming(&url);
    let (report, ok, stderr) = migrate(&src, &url, &["--checksum"]);
    assert!(ok, "migrate failed: {stderr}\n{report:?}");
    assert_every_page_arrived(&mut src, &dst, &report, 2);
}

#[test]
fn random_fill_precopy_keeps_every_page() {
    if !kvm_available() {
        return;
    }
    precopy_keeps_every_page("write ws=32M seq verify fill=random");
}

#[test]
fn fresh_fill_precopy_keeps_every_page() {
    if !kvm_available() {
        return;
    }
    precopy_keeps_every_page("write ws=16M seq verify fill=fresh");
}

#[test]
fn mixed_fill_precopy_keeps_every_page() {
    if !kvm_available() {
        return;
    }
    precopy_keeps_every_page("write ws=32M random verify fill=mixed");
}

/// The application-like writer: real processes' pages, Zipf-skewed writes and reads from two
/// vCPUs in user mode (natively, on a host that emulates guest kernels).
fn real_writer(cmdline: &str) -> Ferry {
    let ferry = Ferry::boot(VmSpec {
        cmdline,
        vcpus: 2,
        image: "guest-app.elf",
        ..Default::default()
    });
    ferry.wait_info("each vCPU's first pass", Duration::from_secs(60), |i| {
        i.per_vcpu.len() == 2 && i.per_vcpu.iter().all(|v| v.passes >= 1)
    });
    ferry
}

#[test]
fn real_fill_in_user_mode_precopy_keeps_every_page() {
    if !kvm_available() {
        return;
    }
    precopy_keeps_every_page_of(real_writer(
        "write ws=64M zipf reads=25 user verify fill=real vcpus=2",
    ));
}

/// A snapshot of a writer's VM after its first pass, compressed page by page (zlib level 1
/// through python3, a 32 KiB window): the snapshot's size over the compressed size.
fn snapshot_ratio(fill: &str) -> f64 {
    let src = match fill {
        "real" => real_writer("write ws=32M seq user fill=real vcpus=2"),
        _ => Ferry::writer(&format!("write ws=32M seq fill={fill}")),
    };
    let (file, _) = src.snapshot("vm.ferry");
    let out = Command::new("python3")
        .arg("-c")
        .arg("import sys, zlib; d = open(sys.argv[1], 'rb').read(); print(len(d) / len(zlib.compress(d, 1)))")
        .arg(&file)
        .output()
        .expect("python3 (scripts/install-deps.sh installs it)");
    assert!(out.status.success(), "{out:?}");
    String::from_utf8_lossy(&out.stdout).trim().parse().unwrap()
}

#[test]
fn fills_compress_as_documented() {
    if !kvm_available() {
        return;
    }
    let word = snapshot_ratio("word");
    let random = snapshot_ratio("random");
    let mixed = snapshot_ratio("mixed");
    let fresh = snapshot_ratio("fresh");
    let real = snapshot_ratio("real");
    eprintln!(
        "zlib -1 ratios of a snapshot: word {word:.1}, random {random:.2}, mixed {mixed:.2}, \
         fresh {fresh:.2}, real {real:.2}"
    );
    assert!(word > 20.0, "word pages are a stamp in zeros: {word}");
    assert!(random < 1.05, "random pages do not compress: {random}");
    assert!(
        (1.4..3.0).contains(&mixed),
        "mixed: text (~2.5x for zlib) and random pages: {mixed}"
    );
    assert!(
        (1.3..2.5).contains(&fresh),
        "fresh: 3/4 text, 1/4 random, no zero page: {fresh}"
    );
    assert!(
        (1.8..4.0).contains(&real),
        "real: a process's pages (zstd -3 ~2.9x, guest/sample.py): {real}"
    );
}
