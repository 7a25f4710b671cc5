//! Post-copy and hybrid migration between real ferry processes: the VM runs on the
//! destination at once, its pages follow, each exactly once, and nothing is lost.

mod common;

use std::time::Duration;

use api::{MigrationPhase, MigrationStatus};
use common::relay::{Action, Point};
use common::*;

const T: Duration = Duration::from_secs(60);

/// Boots `cmdline`, migrates with `extra`, checks every promise of post-copy, and returns
/// the report.
fn postcopy_keeps_every_page(vcpus: usize, cmdline: &str, extra: &[&str]) -> MigrationStatus {
    postcopy_keeps_every_page_of(
        VmSpec {
            vcpus,
            cmdline,
            ..Default::default()
        },
        extra,
    )
}

fn postcopy_keeps_every_page_of(spec: VmSpec, extra: &[&str]) -> MigrationStatus {
    let vcpus = spec.vcpus;
    let mut src = Ferry::boot(spec);
    src.wait_info("a first pass", T, |i| i.passes >= vcpus as u64);
    let url = format!("unix:{}", src.scratch("mig.sock").display());
    let dst = Ferry::incoming(&url);
    let mut args = vec!["--checksum"];
    args.extend_from_slice(extra);
    let (report, ok, errors) = migrate(&src, &url, &args);
    assert!(ok, "migrate {extra:?} failed: {errors}");
    assert_eq!(report.phase, MigrationPhase::Completed);
    assert!(report.postcopy, "the switch went to post-copy: {report:?}");
    let pc = report.postcopy_report.clone().expect("post-copy report");
    if report.pages_pushed_on_lanes == 0 {
        assert_eq!(
            pc.duplicates, 0,
            "each page crosses the wire at most once after the switch"
        );
    } else {
        // A fault on a page whose push is still on its way is answered anyway.
        assert!(
            pc.duplicates <= report.pages_requested,
            "a page crosses twice only when asked for: {pc:?}"
        );
    }
    assert_every_page_arrived(&mut src, &dst, &report, 2 * vcpus as u64);
    let arrived = dst.migration_status();
    let installers = arrived.cpu.iter().find(|w| w.work == "install");
    assert!(
        installers.is_some_and(|w| w.threads >= 2 && w.cpu_s > 0.0),
        "post-copy's installers are on the destination's CPU report: {:?}",
        arrived.cpu
    );
    report
}

#[test]
fn postcopy_sequential_writer() {
    if !kvm_available() {
        return;
    }
    let r = postcopy_keeps_every_page(1, "write ws=256M seq verify", &["--mode", "postcopy"]);
    // Pure post-copy: every page that held data was sent once, by push or by request.
    assert_eq!(
        r.pages_pushed + r.pages_requested,
        r.memory_pages - r.pages_skipped_unpopulated,
        "{r:?}"
    );
    assert_eq!(r.rounds.len(), 1);
    assert_eq!(r.pages_resent, 0);
}

#[test]
fn postcopy_random_writer_on_two_vcpus() {
    if !kvm_available() {
        return;
    }
    let r = postcopy_keeps_every_page(2, "write ws=128M random verify", &["--mode", "postcopy"]);
    assert!(
        r.postcopy_report.unwrap().network_faults > 0,
        "the guest faulted on missing pages"
    );
}

#[test]
fn postcopy_push_only() {
    if !kvm_available() {
        return;
    }
    postcopy_keeps_every_page(
        1,
        "write ws=64M random verify",
        &["--mode", "postcopy", "--prepaging", "linear"],
    );
}

#[test]
fn hybrid_sends_one_round_then_post_copies_the_rest() {
    if !kvm_available() {
        return;
    }
    let r = postcopy_keeps_every_page(1, "write ws=128M random verify", &["--mode", "hybrid"]);
    assert_eq!(
        r.rounds.len(),
        2,
        "one pre-copy round, then post-copy: {:?}",
        r.rounds
    );
    assert!(
        r.stale_pages_dropped_before_pause.unwrap_or(0) > 0,
        "the copies dirtied after the round were dropped before the pause: {r:?}"
    );
}

#[test]
fn hybrid_on_memfd_memory_drops_stale_copies_from_the_file() {
    if !kvm_available() {
        return;
    }
    // Pages dirtied after hybrid's round must be punched out of the destination's memfd, or
    // the guest would read their stale copies without a fault.
    let r = postcopy_keeps_every_page_of(
        VmSpec {
            cmdline: "write ws=128M random verify",
            memory_backend: "memfd",
            ..Default::default()
        },
        &["--mode", "hybrid"],
    );
    assert!(r.pages_pushed + r.pages_requested > 0, "{r:?}");
}

#[test]
fn hybrid_over_three_compressed_connections() {
    if !kvm_available() {
        return;
    }
    let r = postcopy_keeps_every_page(
        1,
        "write ws=128M random verify",
        &[
            "--mode",
            "hybrid",
            "--connections",
            "3",
            "--compression",
            "zstd",
        ],
    );
    assert_eq!(r.connections, 3, "{r:?}");
    assert!(r.compression.frames_zstd > 0, "{:?}", r.compression);
}

/// Post-copy over several connections: the extra ones push every page that is not asked for,
/// and the main one carries only the answers to the guest's faults.
#[test]
fn postcopy_pushes_on_the_extra_connections() {
    if !kvm_available() {
        return;
    }
    for mode in ["postcopy", "hybrid"] {
        let r = postcopy_keeps_every_page(
            2,
            "write ws=128M random verify",
            &["--mode", mode, "--connections", "4"],
        );
        assert_eq!(r.connections, 4, "{r:?}");
        assert!(r.pages_pushed > 0, "{mode}: {r:?}");
        assert_eq!(
            r.pages_pushed_on_lanes, r.pages_pushed,
            "{mode}: every push went on an extra connection"
        );
        // After pre-copy's round 0 only the pages dirtied meanwhile are pending (about a
        // thousand): three lanes may push them all before the guest touches one, so only
        // post-copy (every page pending) must have faulted.
        if mode == "postcopy" {
            assert!(r.pages_requested > 0, "{mode}: the guest faulted: {r:?}");
        }
        let senders = r.cpu.iter().find(|w| w.work == "send").map(|w| w.threads);
        assert_eq!(senders, Some(4), "a sender per connection: {:?}", r.cpu);
    }
}

#[test]
fn non_converging_precopy_switches_to_postcopy_by_itself() {
    if !kvm_available() {
        return;
    }
    // 100 Mbit/s cannot keep up with a guest rewriting 64 MiB many times a second (its pages
    // plain and whole).
    let r = postcopy_keeps_every_page(
        1,
        "write ws=64M seq verify",
        &[
            "--compression",
            "none",
            "--delta-cache-mb",
            "0",
            "--max-bandwidth-mbps",
            "100",
            "--auto-postcopy",
            "--max-downtime-ms",
            "5",
        ],
    );
    assert_eq!(r.converged, Some(false));
    assert!(
        r.note
            .unwrap_or_default()
            .contains("switching to post-copy")
    );
}

/// Starts a pre-copy of `src` held to 100 Mbit/s, uncompressed, with `extra` request fields;
/// its destination.
fn slow_precopy(src: &Ferry, extra: serde_json::Value) -> Ferry {
    let url = format!("unix:{}", src.scratch("mig.sock").display());
    let dst = Ferry::incoming(&url);
    let mut body =
        serde_json::json!({"destination": url, "max_bandwidth_mbps": 100, "compression": "none"});
    body.as_object_mut()
        .unwrap()
        .extend(extra.as_object().cloned().unwrap_or_default());
    src.api()
        .put("vm.send-migration", Some(&body))
        .expect("start");
    dst
}

/// `ferry start-postcopy`, then the migration's end: it completed by post-copy.
fn switch_to_postcopy(src: &Ferry) -> MigrationStatus {
    src.put("vm.migrate-start-postcopy");
    let status = wait_for("the migration to end", T, || {
        let s = src.migration_status();
        (!s.phase.is_running()).then_some(s)
    });
    assert_eq!(status.phase, MigrationPhase::Completed, "{status:?}");
    assert!(status.postcopy);
    status
}

#[test]
fn start_postcopy_switches_a_running_precopy() {
    if !kvm_available() {
        return;
    }
    let src = Ferry::writer("write ws=64M seq verify");
    let dst = slow_precopy(
        &src,
        serde_json::json!({"max_rounds": 1000, "delta_cache_mb": 0}),
    );
    wait_for("round 1", T, || {
        let s = src.migration_status();
        (s.round >= 1).then_some(())
    });
    switch_to_postcopy(&src);
    let start = dst.info();
    let info = dst.wait_info("passes on the destination", T, |i| {
        i.passes >= start.passes + 2
    });
    assert_eq!(info.verify_errors, 0);
}

#[test]
fn start_postcopy_cuts_the_round_in_flight_short() {
    if !kvm_available() {
        return;
    }
    // 256 MiB of data at 100 Mbit/s: round 0 alone takes over 20 s.
    let src = Ferry::writer("write ws=256M seq verify");
    let dst = slow_precopy(&src, serde_json::json!({}));
    wait_for("round 0 under way", T, || {
        let s = src.migration_status();
        (s.phase == MigrationPhase::Active && s.bytes_on_wire >= 8 << 20).then_some(())
    });
    let asked = src.migration_status();
    assert_eq!(asked.round, 0, "{asked:?}");
    let status = switch_to_postcopy(&src);
    // Round 0 stopped where it was: the pages it left went by post-copy.
    let round0 = &status.rounds[0];
    assert!(
        round0.pages < (256 << 20) / 4096 / 2,
        "round 0 sent {} pages",
        round0.pages
    );
    assert!(status.note.unwrap_or_default().contains("cut short"));
    assert!(status.pages_pushed + status.pages_requested > (128 << 20) / 4096);
    let start = dst.info();
    let info = dst.wait_info("passes on the destination", T, |i| i.passes > start.passes);
    assert_eq!(info.verify_errors, 0);
}

#[test]
fn start_postcopy_without_a_migration_is_refused() {
    if !kvm_available() {
        return;
    }
    let src = Ferry::boot(VmSpec::default());
    let err = src
        .api()
        .put("vm.migrate-start-postcopy", None)
        .unwrap_err();
    assert!(err.to_string().contains("no migration is running"), "{err}");
    let out = ferry_output(&[
        "start-postcopy",
        "--api-socket",
        src.socket.to_str().unwrap(),
    ]);
    assert!(!out.status.success());
    assert_eq!(src.info().state, "running");
}

#[test]
fn cut_during_postcopy_keeps_both_halves_alive() {
    if !kvm_available() {
        return;
    }
    let mut src = Ferry::writer("write ws=64M seq verify");
    let (mut dst, proxy) = destination_behind(Point::Postcopy(10), Action::Cut);
    let (report, ok, _) = migrate(&src, &proxy.url, &["--mode", "postcopy"]);
    assert!(!ok);
    assert_eq!(report.phase, MigrationPhase::PostcopyPaused, "{report:?}");
    // A migration that stopped says how far it got: its time and bytes as well as its pages.
    assert!(
        report.pages_pushed + report.pages_requested > 0,
        "{report:?}"
    );
    assert!(
        report.total_ms > 0.0 && report.bytes_on_wire > 0,
        "{report:?}"
    );
    drop(proxy);

    // The destination holds the newest state: it must live on, and say what happened.
    std::thread::sleep(Duration::from_millis(500));
    assert!(dst.is_running(), "the destination VM is never thrown away");
    let dstatus = dst.migration_status();
    assert!(
        dstatus
            .error
            .unwrap_or_default()
            .contains("post-copy interrupted"),
        "the destination explains itself"
    );
    // The source keeps its copy paused and refuses to make a second running one.
    assert!(src.is_running());
    assert_eq!(src.info().state, "postcopy-paused");
    let err = src.api().put("vm.resume", None).unwrap_err();
    assert!(err.to_string().contains("two copies"), "{err}");

    waits_for_a_resume_end_and_leave_the_pages_owed(&dst);
    // Carry on over a new connection, like QEMU's post-copy recovery.
    carry_on_postcopy(&src, &dst).expect("both sides carry on");
    let done = wait_for("the resumed post-copy to complete", T, || {
        let s = dst.migration_status();
        (s.phase == MigrationPhase::Completed).then_some(s)
    });
    assert_eq!(done.postcopy_report.unwrap().duplicates, 0);
    assert!(
        src.wait_exit(T).success(),
        "the source lets go once every page is there"
    );
    let start = dst.info();
    let info = dst.wait_info("passes after recovery", T, |i| i.passes >= start.passes + 2);
    assert_eq!(
        info.verify_errors, 0,
        "pages lost: {:?}",
        info.verify_error_pages
    );
}

/// A destination's wait for its resuming source ends at its deadline, when a later `listen`
/// replaces it and at a cancel; each time the pages stay owed, so a new `listen` is taken.
fn waits_for_a_resume_end_and_leave_the_pages_owed(dst: &Ferry) {
    let listen = |name: &str, timeout_s: Option<u64>| {
        let url = format!("unix:{}", dst.scratch(name).display());
        let body = serde_json::json!({ "listen": url, "timeout_s": timeout_s });
        dst.api()
            .put("vm.migrate-resume", Some(&body))
            .unwrap_or_else(|e| panic!("listen on {name}: {e}"));
    };
    listen("nobody.sock", Some(1));
    wait_for("the wait to end at its deadline", T, || {
        let why = dst.migration_status().error.unwrap_or_default();
        why.contains("within 1 s").then_some(())
    });
    listen("first.sock", None);
    listen("second.sock", None);
    assert!(
        std::os::unix::net::UnixStream::connect(dst.scratch("first.sock")).is_err(),
        "the replaced wait still listens"
    );
    dst.api()
        .put("vm.cancel-migration", None)
        .expect("the wait is cancelled");
    let err = dst.api().put("vm.cancel-migration", None).unwrap_err();
    assert!(err.to_string().contains("no resume is waiting"), "{err}");
    assert!(
        std::os::unix::net::UnixStream::connect(dst.scratch("second.sock")).is_err(),
        "the cancelled wait still listens"
    );
}

#[test]
fn resume_with_nothing_to_resume_is_refused() {
    if !kvm_available() {
        return;
    }
    let vm = Ferry::boot(VmSpec::default());
    for body in [
        serde_json::json!({"listen": "unix:/tmp/nowhere.sock"}),
        serde_json::json!({"destination": "unix:/tmp/nowhere.sock"}),
    ] {
        let err = vm.api().put("vm.migrate-resume", Some(&body)).unwrap_err();
        assert!(
            err.to_string().contains("no interrupted post-copy"),
            "{err}"
        );
    }
    let err = vm
        .api()
        .put("vm.migrate-resume", Some(&serde_json::json!({})))
        .unwrap_err();
    assert!(err.to_string().contains("exactly one"), "{err}");
    assert_eq!(vm.info().state, "running");
}

/// The destination's threads that run real-time (`SCHED_FIFO`), by name.
fn real_time_threads(f: &Ferry) -> Vec<String> {
    let pid = f.child.as_ref().expect("a process of its own").id();
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).expect("its threads");
    let mut names = Vec::new();
    for task in tasks.flatten() {
        let read = |file: &str| std::fs::read_to_string(task.path().join(file));
        let (Ok(stat), Ok(comm)) = (read("stat"), read("comm")) else {
            continue; // the thread ended meanwhile
        };
        // After the name in parentheses, `policy` is field 41 of stat (the 39th after it).
        let after_name = stat.rsplit_once(')').map_or("", |(_, rest)| rest);
        let policy = after_name.split_whitespace().nth(38);
        if policy == Some("1") {
            names.push(comm.trim().to_string());
        }
    }
    names.sort();
    names
}

/// Over one connection the destination's reader of answers reads every push too: it must not
/// run real-time (it would hold a core for as long as the source sends). Only the fault
/// handler does, which sleeps between faults. Checked while post-copy is held half way.
#[test]
fn over_one_connection_only_the_fault_handler_runs_real_time() {
    if !kvm_available() {
        return;
    }
    let src = Ferry::writer("write ws=16M seq verify rate=2000");
    let (dst, relay) = destination_behind(Point::Postcopy(50), Action::Hold);
    src.api()
        .put(
            "vm.send-migration",
            Some(&serde_json::json!({"destination": relay.url, "mode": "postcopy"})),
        )
        .expect("the migration starts");
    assert!(relay.wait_reached(T), "post-copy never got half way");
    let fifo = real_time_threads(&dst);
    relay.release();
    // Without the right to raise priorities nothing runs real-time, and there is nothing to
    // check; with it, the fault handler does.
    assert!(
        fifo.is_empty() || fifo == ["postcopy-faults"],
        "real-time threads: {fifo:?}"
    );
    let done = wait_for("post-copy to complete", T, || {
        let s = dst.migration_status();
        (s.phase == MigrationPhase::Completed).then_some(s)
    });
    assert_eq!(done.postcopy_report.unwrap().duplicates, 0);
}
