//! The OpenMetrics endpoint (`ferry run --metrics`): scraped while a migration runs, after it
//! is cancelled and after one completes, on both hosts; every scrape must pass
//! `promtool check metrics`.

mod common;

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

use common::scrape::{must, scrape};
use common::*;

const T: Duration = Duration::from_secs(60);

#[test]
fn migrations_show_in_metrics_on_both_hosts() {
    if !kvm_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (src_metrics, dst_metrics) = (dir.path().join("src.sock"), dir.path().join("dst.sock"));
    let arg = |p: &Path| format!("unix:{}", p.display());
    let mut src = Ferry::boot_with(
        VmSpec {
            cmdline: "write ws=64M seq verify",
            ..Default::default()
        },
        &["--metrics", &arg(&src_metrics)],
    );
    src.wait_info("a first pass", T, |i| i.passes >= 1);
    let before = scrape(&src_metrics);
    assert_eq!(must(&before, r#"ferry_vm_state{state="running"}"#), 1.0);
    assert_eq!(must(&before, "ferry_vm_vcpus"), 1.0);
    assert_eq!(must(&before, "ferry_vm_memory_bytes"), (1u64 << 30) as f64);
    assert_eq!(must(&before, "ferry_migration_bytes_total"), 0.0);
    // Every outcome is a series from the start, and the build says which ferry answers.
    for outcome in ["completed", "failed", "cancelled"] {
        let series = format!(r#"ferry_migrations_total{{role="source",outcome="{outcome}"}}"#);
        assert_eq!(must(&before, &series), 0.0);
    }
    assert!(before.contains(r#"ferry_build_info{version=""#), "{before}");

    // A slow migration: its counters move between two scrapes.
    let _first = start_slow_migration(&src);
    let during = scrape(&src_metrics);
    assert_eq!(
        must(
            &during,
            r#"ferry_migration_phase{role="source",phase="active"}"#
        ),
        1.0
    );
    assert!(must(&during, "ferry_migration_remaining_bytes") > 0.0);
    let moved = must(&during, "ferry_migration_bytes_total");
    assert!(moved >= (1 << 20) as f64, "{moved}");
    wait_for("the bytes counter to move", T, || {
        (must(&scrape(&src_metrics), "ferry_migration_bytes_total") > moved).then_some(())
    });
    src.put("vm.cancel-migration");
    src.wait_migration_end();
    let cancelled = scrape(&src_metrics);
    assert_eq!(
        must(
            &cancelled,
            r#"ferry_migrations_total{role="source",outcome="cancelled"}"#
        ),
        1.0
    );
    let after_cancel = must(&cancelled, "ferry_migration_bytes_total");
    assert!(after_cancel > moved, "a counter never goes down");

    // A whole migration: both hosts count it; the source's downtime is observed.
    let url = format!("unix:{}", dir.path().join("mig2.sock").display());
    let dst = Ferry::start(&["--incoming", &url, "--metrics", &arg(&dst_metrics)]);
    let (report, ok, errors) = migrate(&src, &url, &[]);
    assert!(ok, "{errors}\n{report:?}");
    // A source with a metrics endpoint stays until its final counters were scraped; the
    // guest's own figures join its report meanwhile.
    assert!(src.is_running(), "the source left before its last scrape");
    let end = wait_for("the guest's figures on the source", T, || {
        let s = src.migration_status();
        (!s.guest_report_pending).then_some(s)
    });
    assert!(end.guest_observed_downtime_ms.is_some(), "{end:?}");
    assert!(end.guest_pages_per_s_after.is_some(), "{end:?}");
    let done = scrape(&src_metrics);
    assert_eq!(
        must(
            &done,
            r#"ferry_migrations_total{role="source",outcome="completed"}"#
        ),
        1.0
    );
    assert!(must(&done, "ferry_migration_bytes_total") > after_cancel);
    assert_eq!(must(&done, "ferry_migration_downtime_seconds_count"), 1.0);
    // Buckets are cumulative and end at +Inf, which holds every observation.
    assert_eq!(
        must(
            &done,
            r#"ferry_migration_downtime_seconds_bucket{le="+Inf"}"#
        ),
        1.0
    );
    assert_eq!(
        must(
            &done,
            r#"ferry_migration_downtime_seconds_bucket{le="5.0"}"#
        ),
        1.0
    );
    assert!(must(&done, r#"ferry_migration_pages_total{kind="full"}"#) >= 16384.0);
    let arrived = scrape(&dst_metrics);
    assert_eq!(
        must(
            &arrived,
            r#"ferry_migrations_total{role="destination",outcome="completed"}"#
        ),
        1.0
    );
    assert_eq!(must(&arrived, r#"ferry_vm_state{state="running"}"#), 1.0);
    assert_eq!(
        must(&arrived, r#"ferry_migration_pages_total{kind="full"}"#),
        dst.migration_status().pages_full as f64,
        "metrics and the API agree"
    );
    assert_eq!(
        must(&arrived, "ferry_migration_downtime_seconds_count"),
        1.0
    );
    assert_eq!(dst.info().verify_errors, 0);
    assert!(src.wait_exit(T).success(), "scraped, the source exits");
}

#[test]
fn the_endpoint_answers_only_get_metrics_and_bad_addresses_are_refused() {
    if !kvm_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("m.sock");
    let arg = format!("unix:{}", socket.display());
    let _vm = Ferry::boot_with(VmSpec::default(), &["--metrics", &arg]);
    let ask = |request: &[u8]| {
        let mut conn = UnixStream::connect(&socket).unwrap();
        conn.write_all(request).unwrap();
        let mut answer = String::new();
        conn.read_to_string(&mut answer).unwrap();
        answer
    };
    assert!(ask(b"GET /other HTTP/1.1\r\n\r\n").starts_with("HTTP/1.1 404"));
    assert!(ask(b"DELETE /metrics HTTP/1.1\r\n\r\n").starts_with("HTTP/1.1 405"));
    assert!(ask(b"\x00\x01\r\n\r\n").starts_with("HTTP/1.1 400"));
    let out = ferry_output(&["run", "--guest", "x", "--metrics", "nowhere"]);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("expected tcp:HOST:PORT"), "{stderr}");
}

/// A VM with a balloon shows its target, what the guest holds in it and what it freed.
#[test]
fn the_balloon_shows_in_metrics() {
    if !kvm_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("metrics.sock");
    let vm = Ferry::boot_with(
        VmSpec {
            cmdline: "idle balloon dsb_ms=200",
            ..Default::default()
        },
        &[
            "--balloon",
            "--metrics",
            &format!("unix:{}", socket.display()),
        ],
    );
    let target = serde_json::json!({"target_mib": 64});
    vm.api().put("vm.balloon", Some(&target)).expect("a target");
    vm.wait_info("the balloon to inflate", T, |i| {
        i.balloon
            .as_ref()
            .is_some_and(|b| b.actual_pages == 64 << 8)
    });
    let body = scrape(&socket);
    assert_eq!(must(&body, "ferry_balloon_target_bytes"), (64 << 20) as f64);
    assert_eq!(must(&body, "ferry_balloon_actual_bytes"), (64 << 20) as f64);
    assert!(must(&body, "ferry_balloon_freed_bytes_total") >= 0.0);
    assert!(must(&body, "ferry_balloon_guest_free_bytes") > 0.0);
}

/// A TCP connection to 127.0.0.1:`port` from 127.0.0.`host`.
fn connect_from(host: u8, port: u16) -> std::net::TcpStream {
    use std::net::{Ipv4Addr, SocketAddrV4};
    let to = SocketAddrV4::new(Ipv4Addr::LOCALHOST, port);
    sockets::tcp::connect_from(Ipv4Addr::new(127, 0, 0, host), to).unwrap()
}

/// With `--metrics-token-file` a scrape without the token, or with another, is answered 401;
/// with it, 200. A client that opens connections and sends nothing holds two places: a scrape
/// from another address still gets in at once. A token file others can read is refused.
#[test]
fn scrapes_need_the_token_and_idle_connections_do_not_starve_them() {
    use std::os::unix::fs::PermissionsExt;
    if !kvm_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let token = dir.path().join("token");
    std::fs::write(&token, "s3cret-token\n").unwrap();
    std::fs::set_permissions(&token, std::fs::Permissions::from_mode(0o600)).unwrap();
    let port = free_port();
    let addr = format!("tcp:127.0.0.1:{port}");
    let _vm = Ferry::boot_with(
        VmSpec::default(),
        &[
            "--metrics",
            &addr,
            "--metrics-token-file",
            token.to_str().unwrap(),
        ],
    );
    let idle: Vec<_> = (0..10).map(|_| connect_from(2, port)).collect();
    let get = |authorization: &str| {
        let mut conn = connect_from(1, port);
        let request = format!("GET /metrics HTTP/1.1\r\nHost: f\r\n{authorization}\r\n");
        conn.write_all(request.as_bytes()).unwrap();
        let mut answer = String::new();
        conn.read_to_string(&mut answer)
            .unwrap_or_else(|e| panic!("{authorization:?}: {e}; read {answer:?}"));
        answer
    };
    let none = get("");
    assert!(none.starts_with("HTTP/1.1 401"), "{none}");
    assert!(none.contains("WWW-Authenticate: Bearer"), "{none}");
    let wrong = get("Authorization: Bearer s3cret-tokem\r\n");
    assert!(wrong.starts_with("HTTP/1.1 401"), "{wrong}");
    let right = get("authorization: Bearer s3cret-token\r\n");
    assert!(right.starts_with("HTTP/1.1 200"), "{right}");
    assert!(right.contains("ferry_"), "{right}");
    drop(idle);

    std::fs::set_permissions(&token, std::fs::Permissions::from_mode(0o644)).unwrap();
    let out = ferry_output(&[
        "run",
        "--guest",
        guest().to_str().unwrap(),
        "--metrics",
        &format!("tcp:127.0.0.1:{}", free_port()),
        "--metrics-token-file",
        token.to_str().unwrap(),
    ]);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("chmod 600"), "{stderr}");
}
