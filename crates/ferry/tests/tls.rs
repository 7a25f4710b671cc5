//! TLS migrations end to end: certificates from `ferry certs`, a verified guest moved over TCP
//! with both hosts' certificates checked, and the ways in without them refused.

mod common;

use std::time::Duration;

use api::MigrationPhase;
use common::*;

const T: Duration = Duration::from_secs(60);

#[test]
fn a_verified_guest_moves_over_tls_and_strangers_are_turned_away() {
    if !kvm_available() {
        return;
    }
    let scratch = tempfile::tempdir().unwrap();
    let ours = scratch.path().join("ours");
    let theirs = scratch.path().join("theirs");
    certs(&ours, &["source.local", "127.0.0.1"]);
    certs(&theirs, &["intruder.local"]);
    let key_mode = std::os::unix::fs::PermissionsExt::mode(
        &std::fs::metadata(ours.join("127.0.0.1.key"))
            .unwrap()
            .permissions(),
    );
    assert_eq!(key_mode & 0o777, 0o600, "private keys are the owner's only");

    let port = free_port();
    let url = format!("tcp:127.0.0.1:{port}");
    let dst_args = tls_args(&ours, "127.0.0.1");
    let mut dst_argv: Vec<&str> = vec!["--incoming", &url];
    dst_argv.extend(dst_args.iter().map(String::as_str));
    let mut dst = Ferry::start(&dst_argv);

    // A source whose certificate another CA signed is turned away; so is one without TLS.
    let guest = guest();
    let boot = |tls: &[String]| {
        let mut argv: Vec<&str> = vec![
            "--guest",
            guest.to_str().unwrap(),
            "--memory",
            "512M",
            "--cmdline",
            "write ws=64M seq verify",
        ];
        argv.extend(tls.iter().map(String::as_str));
        Ferry::start(&argv)
    };
    let intruder = boot(&tls_args(&theirs, "intruder.local"));
    let (_, ok, _) = migrate(&intruder, &url, &[]);
    assert!(!ok, "another CA's certificate");
    let plain = boot(&[]);
    let (_, ok, _) = migrate(&plain, &url, &[]);
    assert!(!ok, "no TLS");
    assert!(dst.is_running(), "the destination waits on");
    assert!(dst.stderr_text().contains("refused an incoming connection"));

    let src = boot(&tls_args(&ours, "source.local"));
    src.wait_info("a first pass", T, |i| i.passes >= 1);
    let (report, ok, errors) = migrate(&src, &url, &[]);
    assert!(ok, "{errors}");
    assert_eq!(report.phase, MigrationPhase::Completed);
    let start = dst.info();
    let info = dst.wait_info("passes on the destination", T, |i| i.passes > start.passes);
    assert_eq!(info.verify_errors, 0);
}

#[test]
fn tcp_without_tls_must_be_asked_for() {
    let port = free_port();
    let out = ferry_output(&["run", "--incoming", &format!("tcp:127.0.0.1:{port}")]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("needs TLS") && err.contains("--plain-tcp"),
        "{err}"
    );
}
