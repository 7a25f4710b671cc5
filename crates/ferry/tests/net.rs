//! A NIC that survives the move: the workload guest forwards frames (`net=fwd`: receive,
//! swap the MACs, send back, like DPDK's l2fwd) on a virtio-net NIC whose tap sits on its
//! host's bridge; a generator in the switch both hosts hang off sends sequence-numbered frames
//! and counts what comes back, while the VM moves to a process on the other host. Forwarding
//! must carry on from the new host, and the switch must learn its port from the VM's
//! announcement.

mod common;

use std::time::{Duration, Instant};

use api::MigrationPhase;
use common::testbed::{Generator, TAP, Testbed};
use common::*;

const T: Duration = Duration::from_secs(60);
const VM_MAC: [u8; 6] = [0x52, 0x54, 0, 0, 0, 0x01];
const VM_MAC_TEXT: &str = "52:54:00:00:00:01";

/// The VM on host 0's tap, its memory `anonymous` or `memfd`.
fn forwarder(bed: &Testbed, memory_backend: &str) -> Ferry {
    let guest = guest();
    let net = format!("tap={TAP},mac={VM_MAC_TEXT}");
    Ferry::start_in_netns(
        &bed.hosts[0],
        &[
            "--guest",
            guest.to_str().unwrap(),
            "--memory",
            "256M",
            "--memory-backend",
            memory_backend,
            "--cmdline",
            "write ws=16M seq verify net=fwd",
            "--net",
            &net,
        ],
    )
}

fn counter(f: &Ferry, name: &str) -> u64 {
    f.info().devices[0].counters.get(name).copied().unwrap_or(0)
}

#[test]
fn forwarding_carries_on_from_the_destinations_port() {
    if !kvm_available() {
        return;
    }
    let bed = Testbed::new("net", 2);
    let src = forwarder(&bed, "anonymous");
    src.wait_info("the guest's first pass", T, |i| i.passes >= 1);
    let generator = Generator::start(&bed, VM_MAC, 1000, 60_000);
    wait_for("frames forwarded by the source", T, || {
        (generator.received() >= 100).then_some(())
    });
    assert_eq!(bed.port_of(VM_MAC_TEXT).as_deref(), Some("p0"));

    // Pre-copy to a process on host 1, post-copy back to one on host 0, hybrid to host 1
    // again. The destinations' NICs are told no MAC: the VM brings its own.
    let mut here = src;
    for (mode, host) in [("precopy", 1), ("postcopy", 0), ("hybrid", 1)] {
        let sock = here.scratch("migrate.sock");
        let url = format!("unix:{}", sock.display());
        let net = format!("tap={TAP}");
        let dst = Ferry::start_in_netns(&bed.hosts[host], &["--incoming", &url, "--net", &net]);
        let (report, ok, errors) = migrate(&here, &url, &["--mode", mode]);
        assert!(ok, "{mode}: {errors}");
        assert_eq!(report.phase, MigrationPhase::Completed);
        assert!(
            here.wait_exit(T).success(),
            "{mode}: the source let go of the VM and its tap"
        );
        let moved = Instant::now();
        // Frames sent after the move come back, forwarded by the destination's guest.
        wait_for("frames forwarded by the destination", T, || {
            (generator.received_sent_after(moved) >= 100).then_some(())
        });
        let port = format!("p{host}");
        assert_eq!(
            bed.port_of(VM_MAC_TEXT).as_deref(),
            Some(port.as_str()),
            "{mode}"
        );
        let info = dst.info();
        let nic = &info.devices[0];
        assert_eq!(nic.kind, "virtio-net");
        assert!(nic.attached_to.contains(VM_MAC_TEXT), "{}", nic.attached_to);
        assert_eq!(
            counter(&dst, "announcements"),
            5,
            "{mode}: the MAC was announced"
        );
        assert!(counter(&dst, "rx_frames") > 0 && counter(&dst, "tx_frames") > 0);
        assert!(
            counter(&dst, "notifies_by_eventfd") > 0,
            "{mode}: ioeventfd"
        );
        assert_eq!(counter(&dst, "notifies_by_exit"), 0, "{mode}");
        assert!(
            info.net_tx > 0,
            "{mode}: the guest forwarded frames: {info:?}"
        );
        assert_eq!(info.verify_errors, 0, "{mode}");
        here = dst;
    }
    let (sent, received, longest_gap) = generator.finish(Duration::from_millis(300));
    eprintln!(
        "net: {sent} frames sent, {received} back, {} lost, longest run lost {longest_gap}",
        sent - received
    );
}

#[test]
fn forwarding_carries_on_across_a_live_update() {
    if !kvm_available() {
        return;
    }
    let bed = Testbed::new("netlu", 1);
    let mut old = forwarder(&bed, "memfd");
    old.wait_info("the guest's first pass", T, |i| i.passes >= 1);
    let generator = Generator::start(&bed, VM_MAC, 1000, 60_000);
    wait_for("frames forwarded by the old process", T, || {
        (generator.received() >= 100).then_some(())
    });
    // The new process is given no NIC: the tap's open file passes to it.
    let sock = old.scratch("update.sock");
    let url = format!("unix:{}", sock.display());
    let new = Ferry::start_in_netns(&bed.hosts[0], &["--incoming", &url]);
    let (report, ok, errors) = migrate(&old, &url, &["--local"]);
    assert!(ok, "{errors}");
    assert_eq!(report.phase, MigrationPhase::Completed);
    assert!(old.wait_exit(T).success(), "the old process let go");
    let moved = Instant::now();
    wait_for("frames forwarded by the new process", T, || {
        (generator.received_sent_after(moved) >= 100).then_some(())
    });
    let info = new.info();
    assert!(info.devices[0].attached_to.contains(TAP), "{info:?}");
    assert!(counter(&new, "rx_frames") > 0 && counter(&new, "tx_frames") > 0);
    assert_eq!(info.verify_errors, 0);
    let (sent, received, longest_gap) = generator.finish(Duration::from_millis(300));
    eprintln!(
        "net, live update: {sent} frames sent, {received} back, longest run lost {longest_gap}"
    );
    // The tap never closed: frames that came while the VM was paused waited in its queue.
    assert!(longest_gap <= 5, "{longest_gap} frames in a row lost");
}

#[test]
fn missing_taps_and_bad_nic_options_are_refused() {
    if !kvm_available() {
        return;
    }
    let guest = guest();
    let guest = guest.to_str().unwrap();
    for (arg, expect) in [
        ("tap=nosuchtap9", "there is no tap device 'nosuchtap9'"),
        ("tap=t0,mac=01:00:5e:00:00:01", "multicast"),
        ("mac=52:54:00:00:00:01", "names no tap="),
        ("tap=t0,mtu=9000", "use tap=NAME"),
    ] {
        let out = ferry_output(&[
            "run",
            "--guest",
            guest,
            "--net",
            arg,
            "--serial",
            "/dev/null",
        ]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "--net {arg}");
        assert!(stderr.contains(expect), "--net {arg}: {stderr}");
    }
}

/// A destination in a network namespace of its own, reached over veth at another address,
/// runs on this host all the same: it says so in its `Ready`, and `auto` sends every page
/// plain, straight from guest memory (a codec's work would load the cores both ends share;
/// the old rule compared addresses and tried each codec here).
#[test]
fn a_destination_on_this_host_behind_a_veth_gets_plain_pages() {
    if !kvm_available() {
        return;
    }
    let bed = Testbed::new("host", 2);
    bed.address_host(0, "10.77.0.1/24");
    bed.address_host(1, "10.77.0.2/24");
    let guest = guest();
    let mut src = Ferry::start_in_netns(
        &bed.hosts[0],
        &[
            "--guest",
            guest.to_str().unwrap(),
            "--memory",
            "256M",
            "--cmdline",
            "write ws=64M random verify",
        ],
    );
    src.wait_info("the guest's first pass", T, |i| i.passes >= 1);
    let url = format!("tcp:10.77.0.2:{}", free_port());
    let dst = Ferry::start_in_netns(&bed.hosts[1], &["--incoming", &url]);
    let (report, ok, errors) = migrate(&src, &url, &["--checksum"]);
    assert!(ok, "{errors}");
    let c = &report.compression;
    assert_eq!(c.asked, "auto");
    assert!(c.frames_plain > 0, "{c:?}");
    assert_eq!(
        (c.frames_lz4, c.frames_zstd, c.samples_lz4, c.samples_zstd),
        (0, 0, 0, 0),
        "no codec tried or sent: {c:?}"
    );
    assert_every_page_arrived(&mut src, &dst, &report, 2);
}
