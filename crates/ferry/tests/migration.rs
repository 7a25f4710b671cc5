//! Live, warm and cold migration between real ferry processes on this machine.

mod common;

use std::time::Duration;

use api::{MigrationPhase, MigrationStatus};
use common::relay::{Action, Point};
use common::*;

const T: Duration = Duration::from_secs(60);

fn unix_url(f: &Ferry, name: &str) -> String {
    format!("unix:{}", f.scratch(name).display())
}

/// Waits for `pred` on the destination's vm.info, for a VM that was migrated there.
fn passes_after(dst: &Ferry, extra: u64) -> api::VmInfo {
    let start = dst.info().passes;
    dst.wait_info("more passes on the destination", T, |i| {
        i.passes >= start + extra
    })
}

/// A 256 GiB guest (memory is lazy: it costs what it touched) moves into a destination
/// prepared for it, skipping every page it never touched, and beats on there.
#[test]
fn a_256_gib_idle_guest_moves() {
    if !kvm_available() {
        return;
    }
    let mut src = Ferry::boot(VmSpec {
        memory: "256G",
        ..Default::default()
    });
    let before = src.wait_info("heartbeats", T, |i| i.heartbeat_seq > 10);
    let url = unix_url(&src, "big.sock");
    let dst = Ferry::start(&["--incoming", &url, "--memory", "256G"]);
    let (report, ok, said) = migrate(&src, &url, &[]);
    assert!(ok, "{said}\n{report:?}");
    assert!(
        report.pages_skipped_unpopulated > 60 << 20,
        "{} pages skipped",
        report.pages_skipped_unpopulated
    );
    assert!(src.wait_exit(T).success());
    let after = dst.wait_info("heartbeats on the destination", T, |i| {
        i.heartbeat_seq > before.heartbeat_seq + 10
    });
    assert_eq!(after.state, "running");
}

/// Pages process `f` touched for the first time so far (its minor page faults), leaving out
/// its vCPU threads (their faults are the guest's own touches): what its bookkeeping cost in
/// fresh memory. A process's count includes the threads that ended.
fn minor_faults(f: &Ferry) -> u64 {
    let pid = f.child.as_ref().expect("a child").id();
    let minflt = |stat: &str| -> u64 {
        // Fields after the command's closing parenthesis; minflt is the 10th field in all.
        let after = &stat[stat.rfind(')').expect("a command name") + 2..];
        after
            .split(' ')
            .nth(7)
            .and_then(|v| v.parse().ok())
            .expect("minflt")
    };
    let read = |path: String| std::fs::read_to_string(path).unwrap_or_default();
    let all = minflt(&read(format!("/proc/{pid}/stat")));
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).expect("its threads");
    let vcpus: u64 = tasks
        .flatten()
        .map(|t| t.path())
        .filter(|t| {
            read(format!("{}/comm", t.display()))
                .trim()
                .starts_with("vcpu")
        })
        .map(|t| {
            let stat = read(format!("{}/stat", t.display()));
            if stat.is_empty() { 0 } else { minflt(&stat) }
        })
        .sum();
    all - vcpus
}

/// What an idle guest's move costs must not grow with memory it never used: on each side,
/// a 64 GiB guest's migration touches no more fresh pages than a 1 GiB one's, give or take
/// 1 MiB. (Counted, not timed: on this machine each first touch costs microseconds.)
#[test]
fn an_idle_guest_of_64_gib_costs_the_memory_one_of_1_gib_does() {
    if !kvm_available() {
        return;
    }
    const SLACK_PAGES: u64 = 256;
    let cost = |memory: &str| {
        let src = Ferry::boot(VmSpec {
            memory,
            ..Default::default()
        });
        src.wait_info("heartbeats", T, |i| i.heartbeat_seq > 10);
        let url = unix_url(&src, "floor.sock");
        let dst = Ferry::start(&["--incoming", &url, "--memory", memory]);
        let (src_before, dst_before) = (minor_faults(&src), minor_faults(&dst));
        let body = serde_json::json!({"destination": url});
        src.api()
            .put("vm.send-migration", Some(&body))
            .expect("the migration starts");
        let report = src.wait_migration_end();
        assert_eq!(report.phase, MigrationPhase::Completed, "{report:?}");
        // The source stays until its final status is read (this read ends it).
        let costs = (
            minor_faults(&src) - src_before,
            minor_faults(&dst) - dst_before,
        );
        let _ = src.migration_status();
        costs
    };
    let small = cost("1G");
    let big = cost("64G");
    assert!(
        big.0 <= small.0 + SLACK_PAGES && big.1 <= small.1 + SLACK_PAGES,
        "fresh pages touched (source, destination): 1 GiB {small:?}, 64 GiB {big:?}"
    );
}

#[test]
fn idle_guest_moves_over_tcp_and_heartbeats_continue() {
    if !kvm_available() {
        return;
    }
    let mut src = Ferry::boot(VmSpec::default());
    let before = src.wait_info("heartbeats", T, |i| i.heartbeat_seq > 50);
    let port = free_port();
    let url = format!("tcp:127.0.0.1:{port}");
    let dst = Ferry::incoming(&url);
    assert_eq!(dst.info().state, "incoming");

    let (report, ok, stderr) = migrate(&src, &url, &[]);
    assert!(ok, "migrate failed: {stderr}");
    assert_eq!(report.phase, MigrationPhase::Completed);
    assert!(report.pages_skipped_unpopulated > 200_000, "{report:?}");
    assert!(
        src.wait_exit(T).success(),
        "the source exits 0 after migrating"
    );

    let after = dst.wait_info("heartbeats on the destination", T, |i| i.heartbeats > 10);
    assert!(after.heartbeat_seq > before.heartbeat_seq);
    assert_eq!(after.state, "running");
    assert!(after.migration_observed_downtime_ms.is_some());
    // The destination's own view, once the guest's figures are in.
    let socket = dst.socket.to_str().unwrap();
    let out = ferry_output(&["migration", "--api-socket", socket, "--watch", "--json"]);
    assert_eq!(out.status.code(), Some(0));
    let seen: MigrationStatus = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(seen.role, "destination");
    assert_eq!(seen.phase, MigrationPhase::Completed);
    assert!(!seen.guest_report_pending);
    assert!(seen.guest_observed_downtime_ms.is_some(), "{seen:?}");
}

#[test]
fn write_workload_precopy_keeps_every_page() {
    if !kvm_available() {
        return;
    }
    let mut src = Ferry::writer("write ws=256M seq verify");
    let dst = Ferry::incoming(&unix_url(&src, "mig.sock"));
    let (report, ok, stderr) = migrate(
        &src,
        &unix_url(&src, "mig.sock"),
        &["--checksum", "--max-downtime-ms", "5"],
    );
    assert!(ok, "migrate failed: {stderr}\n{report:?}");
    assert!(
        report.rounds.len() >= 2,
        "several rounds: {:?}",
        report.rounds
    );
    assert!(report.pages_resent > 0, "dirty pages were sent again");
    let info = assert_every_page_arrived(&mut src, &dst, &report, 2);
    assert_eq!(info.per_vcpu[0].guest_errors, 0);
}

/// A guest that first touches memory while pre-copy runs: pages populated after the first
/// scan are caught by the dirty log (which starts all set where KVM offers it, and reads a
/// page as dirty once it holds data), so memory is equal at the switch and the guest verifies.
#[test]
fn memory_first_touched_during_precopy_arrives() {
    if !kvm_available() {
        return;
    }
    let mut src = Ferry::boot(VmSpec {
        cmdline: "write ws=768M seq verify rate=20000",
        ..Default::default()
    });
    src.wait_info("the guest to start writing", T, |i| i.pages_touched >= 1000);
    let url = unix_url(&src, "mig.sock");
    let dst = Ferry::incoming(&url);
    let (report, ok, said) = migrate(&src, &url, &["--checksum"]);
    assert!(ok, "{said}\n{report:?}");
    assert!(report.pages_skipped_unpopulated > 0, "{report:?}");
    assert_every_page_arrived(&mut src, &dst, &report, 1);
}

/// A destination started with --memory/--vcpus builds the VM before it arrives: a VM of
/// another shape is refused with both shapes named (and runs on at the source); one of that
/// shape moves into it with every page.
#[test]
fn a_prepared_destination_takes_its_shape_and_refuses_another() {
    if !kvm_available() {
        return;
    }
    let mut src = Ferry::writer("write ws=64M seq verify");
    let url = unix_url(&src, "wrong.sock");
    let _wrong = Ferry::start(&["--incoming", &url, "--memory", "2G", "--vcpus", "1"]);
    let (report, ok, said) = migrate(&src, &url, &[]);
    assert!(!ok, "{report:?}");
    assert!(
        said.contains("prepared for a VM of 2G and 1 vCPUs") && said.contains("has 1G and 1"),
        "{said}"
    );
    assert_eq!(src.info().state, "running");

    let url = unix_url(&src, "right.sock");
    let dst = Ferry::start(&["--incoming", &url, "--memory", "1G", "--vcpus", "1"]);
    let (report, ok, said) = migrate(&src, &url, &["--checksum"]);
    assert!(ok, "{said}\n{report:?}");
    assert_every_page_arrived(&mut src, &dst, &report, 1);
}

/// Pre-copy of a random writer over TCP with `extra`; checks every page arrived and the
/// guest verified its memory on the destination; returns the report.
fn tcp_precopy_keeps_every_page(extra: &[&str]) -> MigrationStatus {
    let mut src = Ferry::writer("write ws=256M random verify");
    let url = format!("tcp:127.0.0.1:{}", free_port());
    let dst = Ferry::incoming(&url);
    let mut args = vec!["--checksum"];
    args.extend_from_slice(extra);
    let (report, ok, stderr) = migrate(&src, &url, &args);
    assert!(ok, "migrate failed: {stderr}\n{report:?}");
    assert!(
        report.pages_resent > 0,
        "pages dirtied in one round travel again"
    );
    assert_every_page_arrived(&mut src, &dst, &report, 2);
    report
}

#[test]
fn four_connections_over_tcp_keep_every_page() {
    if !kvm_available() {
        return;
    }
    let report = tcp_precopy_keeps_every_page(&["--connections", "4"]);
    assert_eq!(report.connections, 4, "{report:?}");
}

#[test]
fn go_with_the_state_keeps_every_page() {
    if !kvm_available() {
        return;
    }
    let r = tcp_precopy_keeps_every_page(&["--go-with-state"]);
    assert!(r.downtime_ms.is_some(), "{r:?}");
}

#[test]
fn compressed_pages_over_two_connections_keep_every_page() {
    if !kvm_available() {
        return;
    }
    // zstd also on three threads more than the connections (they compress, the two senders
    // write).
    for (codec, threads) in [("lz4", "2"), ("zstd", "5"), ("auto", "2")] {
        let mut args = vec![
            "--connections",
            "2",
            "--compression",
            codec,
            "--migration-threads",
            threads,
        ];
        if codec == "auto" {
            // `auto` compresses where the link is slower than the codecs.
            args.extend(["--max-bandwidth-mbps", "1000"]);
        }
        let r = tcp_precopy_keeps_every_page(&args);
        assert_eq!(r.migration_threads.to_string(), threads);
        let c = &r.compression;
        assert_eq!(c.asked, codec);
        assert!(
            c.frames_lz4 + c.frames_zstd > 0 && c.bytes_out < c.bytes_in,
            "{codec}: {c:?}"
        );
        assert!(
            r.bytes_on_wire < (r.pages_full * 4096),
            "{codec}: fewer bytes than the pages hold"
        );
    }
}

#[test]
fn resent_pages_go_as_deltas_and_every_page_arrives() {
    if !kvm_available() {
        return;
    }
    // Plain pages asked for: `auto` would send them in place on this fast link, without
    // deltas.
    for extra in [
        &["--delta-cache-mb", "512", "--compression", "none"][..],
        &[
            "--delta-cache-mb",
            "512",
            "--connections",
            "2",
            "--compression",
            "lz4",
        ],
    ] {
        let r = tcp_precopy_keeps_every_page(extra);
        let c = &r.compression;
        // The guest rewrites one word of a page: a re-sent page is a few bytes of delta.
        assert!(c.delta_pages > 0, "{extra:?}: {c:?}");
        assert!(
            c.delta_bytes_saved > c.delta_pages * 4000,
            "{extra:?}: {c:?}"
        );
    }
}

/// Early (the flag alone), and when-stalled (the default): a writer the link cannot keep up
/// with is slowed until pre-copy converges.
#[test]
fn auto_converge_slows_the_guest_until_precopy_converges() {
    if !kvm_available() {
        return;
    }
    for when in [&["--auto-converge"][..], &[]] {
        let mut src = Ferry::writer("write ws=16M seq verify");
        let url = unix_url(&src, "mig.sock");
        let dst = Ferry::incoming(&url);
        // 200 Mbit/s cannot keep up with a guest rewriting 16 MiB several times a second
        // (its pages plain and whole).
        let mut args = vec![
            "--compression",
            "none",
            "--delta-cache-mb",
            "0",
            "--checksum",
            "--max-bandwidth-mbps",
            "200",
            "--max-downtime-ms",
            "50",
        ];
        args.extend_from_slice(when);
        let (report, ok, stderr) = migrate(&src, &url, &args);
        assert!(ok, "{when:?}: migrate failed: {stderr}\n{report:?}");
        assert_eq!(report.converged, Some(true), "{when:?}: {report:?}");
        assert!(report.throttle_percent_max >= 20, "{when:?}: {report:?}");
        // The throttle held the guest's vCPU asleep: counted where it sleeps, so that a busy
        // host (which slows the guest either way) cannot blur it as rates measured before
        // and during the move could.
        let held = report.vcpus_throttled_ms.unwrap_or(0.0);
        assert!(
            held > 0.0,
            "{when:?}: the throttle never held the vCPU: {report:?}"
        );
        assert_every_page_arrived(&mut src, &dst, &report, 2);
    }
}

#[test]
fn both_vcpus_progress_after_migration() {
    if !kvm_available() {
        return;
    }
    let src = Ferry::boot(VmSpec {
        vcpus: 2,
        cmdline: "write ws=64M random verify",
        ..Default::default()
    });
    src.wait_info("progress", T, |i| i.pages_touched > 10_000);
    let url = unix_url(&src, "mig.sock");
    let dst = Ferry::incoming(&url);
    let (_, ok, stderr) = migrate(&src, &url, &[]);
    assert!(ok, "{stderr}");
    let start = dst.info();
    let info = dst.wait_info("both vCPUs progressing", T, |i| {
        i.per_vcpu
            .iter()
            .zip(&start.per_vcpu)
            .all(|(now, then)| now.pages > then.pages + 5_000)
    });
    assert_eq!(info.verify_errors, 0);
}

#[test]
fn warm_migration_keeps_every_page() {
    if !kvm_available() {
        return;
    }
    let src = Ferry::writer("write ws=64M seq verify");
    let url = unix_url(&src, "mig.sock");
    let dst = Ferry::incoming(&url);
    let (report, ok, stderr) = migrate(&src, &url, &["--mode", "warm", "--checksum"]);
    assert!(ok, "{stderr}");
    assert_eq!(report.mode, "warm");
    assert_eq!(report.rounds.len(), 1, "warm sends memory once");
    assert_eq!(
        report.memory_checksum_source,
        report.memory_checksum_destination
    );
    let info = passes_after(&dst, 2);
    assert_eq!(info.verify_errors, 0);
}

#[test]
fn snapshot_and_restore_continue_the_workload() {
    if !kvm_available() {
        return;
    }
    let src = Ferry::writer("write ws=32M seq verify");
    // Written by two writers at once (each a lane of the file), compressed on three threads.
    let (file, out) = src.snapshot_with(
        "vm.ferry",
        &[
            "--writers",
            "2",
            "--compression",
            "zstd",
            "--migration-threads",
            "3",
        ],
    );
    let report: api::MigrationStatus = serde_json::from_slice(&out.stdout).expect("report");
    assert_eq!((report.connections, report.migration_threads), (2, 3));
    assert!(
        report.compression.frames_zstd > 0,
        "{:?}",
        report.compression
    );
    let saved = src.info();
    assert_eq!(saved.state, "paused", "a snapshot leaves the source paused");
    let mode =
        std::os::unix::fs::PermissionsExt::mode(&std::fs::metadata(&file).unwrap().permissions());
    assert_eq!(mode & 0o777, 0o600, "guest memory is the owner's only");
    // Never over an existing file, never outside the snapshot directory; writers within
    // bounds.
    for (body, why) in [
        (serde_json::json!({ "file": file }), "File exists"),
        (
            serde_json::json!({ "file": "/etc/vm.ferry" }),
            "snapshots go in",
        ),
        (
            serde_json::json!({ "file": "w.ferry", "writers": 17 }),
            "writers must be 1..=16 threads, not 17",
        ),
    ] {
        let err = src.api().put("vm.snapshot", Some(&body)).unwrap_err();
        assert!(err.to_string().contains(why), "{err}");
    }

    let restored = Ferry::start(&["--restore", file.to_str().unwrap()]);
    let info = passes_after(&restored, 2);
    assert_eq!(info.verify_errors, 0);
    assert!(info.heartbeat_seq > saved.heartbeat_seq);
}

#[test]
fn killed_destination_leaves_the_source_running() {
    if !kvm_available() {
        return;
    }
    let src = Ferry::writer("write ws=128M seq verify");
    let mut dst = start_slow_migration(&src);
    dst.child.as_mut().unwrap().kill().unwrap();
    let status = src.wait_migration_end();
    assert_eq!(status.phase, MigrationPhase::Failed, "{status:?}");
    assert!(status.error.is_some());
    assert_source_keeps_running(&src);
    assert_second_attempt_succeeds(&src);
}

#[test]
fn cut_connection_leaves_the_source_running() {
    if !kvm_available() {
        return;
    }
    let src = Ferry::writer("write ws=64M seq verify");
    let (mut dst, proxy) = destination_behind(Point::Round0, Action::Cut);
    // A link that stays down, with no window to carry the migration on (tests/resume.rs).
    let (report, ok, _) = migrate(&src, &proxy.url, &["--resume-window-s", "0"]);
    assert!(!ok);
    assert_eq!(report.phase, MigrationPhase::Failed, "{report:?}");
    assert!(
        !dst.wait_exit(T).success(),
        "the destination refuses a cut stream"
    );
    assert!(dst.stderr_text().contains("incoming migration failed"));
    drop(proxy);
    assert_source_keeps_running(&src);
    assert_second_attempt_succeeds(&src);
}

#[test]
fn corrupt_frame_is_refused_and_the_source_runs_on() {
    if !kvm_available() {
        return;
    }
    let src = Ferry::writer("write ws=16M seq verify");
    // A byte of the first vCPU's state (a corrupt Hello would only make the destination turn
    // that connection away and wait for another).
    let (mut dst, proxy) = destination_behind(Point::State, Action::Corrupt);
    let (_, ok, error) = migrate(&src, &proxy.url, &[]);
    assert!(!ok);
    assert!(
        error.contains("checksum mismatch"),
        "the reason travels back: {error}"
    );
    assert!(!dst.wait_exit(T).success());
    drop(proxy);
    assert_source_keeps_running(&src);
    assert_second_attempt_succeeds(&src);
}

#[test]
fn foreign_streams_are_refused() {
    if !kvm_available() {
        return;
    }
    use std::io::Write;
    // A stream of another version, sent to a destination: the sender is told why (naming
    // both versions), and the destination keeps waiting for a real source.
    let port = free_port();
    let mut dst = Ferry::incoming(&format!("tcp:127.0.0.1:{port}"));
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    let mut header = b"FERRYMIG".to_vec();
    header.extend_from_slice(&99u32.to_le_bytes());
    header.extend_from_slice(&[0; 4]);
    s.write_all(&header).unwrap();
    let mut answer = Vec::new();
    let _ = std::io::Read::read_to_end(&mut s, &mut answer);
    let version = migration::wire::frame::VERSION;
    assert!(
        String::from_utf8_lossy(&answer).contains(&format!(
            "stream version 99 is not supported (this ferry speaks version {version}"
        )),
        "{answer:?}"
    );
    assert!(
        dst.is_running(),
        "one foreign peer cannot end the destination"
    );
    let src = Ferry::boot(VmSpec::default());
    let (report, ok, error) = migrate(&src, &format!("tcp:127.0.0.1:{port}"), &[]);
    assert!(ok, "the real source still gets through: {error}");
    assert_eq!(report.phase, MigrationPhase::Completed);
    assert!(dst.is_running());
    drop(src);

    // A source whose "destination" answers something that is not ferry.
    let src = Ferry::boot(VmSpec::default());
    let fake = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("tcp:{}", fake.local_addr().unwrap());
    let server = std::thread::spawn(move || {
        let (mut c, _) = fake.accept().unwrap();
        let _ = c.write_all(b"HTTP/1.1 400 Bad Request\r\n\r\n");
        std::thread::sleep(Duration::from_millis(200));
    });
    let (_, ok, error) = migrate(&src, &url, &[]);
    server.join().unwrap();
    assert!(!ok);
    assert!(error.contains("migration stream"), "{error}");
    assert_source_keeps_running(&src);
}

#[test]
fn cancel_leaves_the_source_running() {
    if !kvm_available() {
        return;
    }
    let src = Ferry::writer("write ws=128M seq verify");
    let socket = src.socket.to_str().unwrap();
    let none = ferry_output(&["migration", "--api-socket", socket]);
    assert_eq!(none.status.code(), Some(0));
    assert!(String::from_utf8_lossy(&none.stdout).contains("no migration has run"));
    let mut dst = start_slow_migration(&src);
    let out = ferry_output(&["cancel", "--api-socket", socket, "--json"]);
    let status: MigrationStatus = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(status.phase, MigrationPhase::Cancelled, "{status:?}");
    assert_exit_says(&status, out.status.code(), "");
    let again = ferry_output(&["migration", "--api-socket", socket]);
    assert_eq!(again.status.code(), Some(3), "the VM is safe on the source");
    assert!(String::from_utf8_lossy(&again.stdout).contains("migration cancelled"));
    assert!(
        !dst.wait_exit(T).success(),
        "the destination never resumes a cancelled VM"
    );
    assert!(
        dst.stderr_text().contains("cancelled"),
        "{}",
        dst.stderr_text()
    );
    assert_source_keeps_running(&src);
    assert_second_attempt_succeeds(&src);
}

#[test]
fn bad_migration_requests_are_refused_clearly() {
    if !kvm_available() {
        return;
    }
    let src = Ferry::writer("write ws=64M seq");
    let socket = src.socket.to_str().unwrap().to_string();
    let fails = |extra: &[&str], expect: &str| {
        let mut args = vec!["migrate", "--api-socket", &socket];
        args.extend_from_slice(extra);
        let out = ferry_output(&args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{extra:?} should fail");
        assert!(
            stderr.contains(expect),
            "{extra:?}: wanted {expect:?} in:\n{stderr}"
        );
    };
    let nobody = format!("tcp:127.0.0.1:{}", free_port());
    fails(&["--to", &nobody], "cannot connect");
    fails(&["--to", "127.0.0.1:4444"], "not a migration address");
    fails(&["--to", "tcp:localhost"], "not a migration address");
    fails(
        &["--to", &nobody, "--max-downtime-ms", "0"],
        "max_downtime_ms must be positive",
    );
    fails(
        &["--to", &nobody, "--max-bandwidth-mbps", "-5"],
        "max_bandwidth_mbps must be positive",
    );
    fails(
        &["--to", &nobody, "--max-rounds", "0"],
        "max_rounds must be positive",
    );
    fails(
        &["--to", &nobody, "--connections", "17"],
        "connections must be 1..=16 (got 17)",
    );
    fails(
        &["--to", &nobody, "--connections", "0"],
        "connections must be positive",
    );
    fails(
        &["--to", &nobody, "--delta-cache-mb", "-1"],
        "delta_cache_mb must be 0..=65536, not -1",
    );
    fails(
        &[
            "--to",
            &nobody,
            "--connections",
            "2",
            "--migration-threads",
            "1",
        ],
        "migration_threads must be 2..=64, at least one per connection (got 1)",
    );
    fails(
        &[
            "--to",
            &nobody,
            "--migration-threads",
            "4",
            "--compression",
            "none",
        ],
        "migration_threads above connections needs compression",
    );
    fails(
        &["--to", &nobody, "--migration-threads", "-3"],
        "migration_threads must be a positive number of threads, not -3",
    );
    fails(
        &["--to", &nobody, "--compression", "brotli"],
        "unknown compression 'brotli' (use none, lz4, zstd or auto)",
    );
    fails(
        &["--to", &nobody, "--mode", "teleport"],
        "unknown mode 'teleport'",
    );
    fails(
        &["--to", &nobody, "--auto-converge=sometimes"],
        "unknown auto_converge 'sometimes' (use off, when-stalled or early)",
    );

    // Two at once: the second is refused while the first runs.
    let url = unix_url(&src, "mig.sock");
    let _dst = Ferry::incoming(&url);
    src.api()
        .put(
            "vm.send-migration",
            Some(&serde_json::json!({"destination": url, "max_bandwidth_mbps": 8, "compression": "none"})),
        )
        .expect("first");
    let err = src
        .api()
        .put(
            "vm.send-migration",
            Some(&serde_json::json!({"destination": url})),
        )
        .unwrap_err();
    assert!(err.to_string().contains("already running"), "{err}");
    let err = src.api().put("vm.resume", None).unwrap_err();
    assert!(err.to_string().contains("a migration is running"), "{err}");
    src.put("vm.cancel-migration");
    src.wait_migration_end();
    assert_source_keeps_running(&src);
}

fn assert_source_keeps_running(src: &Ferry) {
    let info = src.info();
    assert_eq!(info.state, "running", "{info:?}");
    src.wait_info("heartbeats on the source", T, |i| {
        i.heartbeat_seq > info.heartbeat_seq + 50
    });
    assert_eq!(src.info().verify_errors, 0);
}

fn assert_second_attempt_succeeds(src: &Ferry) {
    let url = unix_url(src, "mig2.sock");
    let dst = Ferry::incoming(&url);
    let (report, ok, stderr) = migrate(src, &url, &["--checksum"]);
    assert!(ok, "second attempt: {stderr}\n{report:?}");
    assert_eq!(
        report.memory_checksum_source,
        report.memory_checksum_destination
    );
    let info = passes_after(&dst, 1);
    assert_eq!(info.verify_errors, 0);
}

#[test]
fn a_waiting_destination_stops_on_sigterm() {
    if !kvm_available() {
        return;
    }
    let mut dst = Ferry::incoming(&format!("tcp:127.0.0.1:{}", free_port()));
    let pid = dst.child.as_ref().unwrap().id() as i32;
    // SAFETY: signals a child process this test owns.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGTERM) }, 0);
    assert!(dst.wait_exit(T).success(), "{}", dst.stderr_text());
    assert!(dst.stderr_text().contains("stopped while waiting"));
}

#[test]
fn an_incoming_unix_path_that_is_a_file_is_left_alone() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("precious");
    std::fs::write(&path, b"keep me").unwrap();
    let out = ferry_output(&["run", "--incoming", &format!("unix:{}", path.display())]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("not a socket"), "{err}");
    assert_eq!(std::fs::read(&path).unwrap(), b"keep me");
}
