//! Bad input gets a clear error naming the problem, and never a panic.

mod common;

use std::time::Duration;

use common::*;

fn run_fails(args: &[&str], expect: &str) {
    let out = ferry_output(args);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{args:?} should fail");
    assert!(
        stderr.contains(expect),
        "{args:?}: expected {expect:?} in stderr, got:\n{stderr}"
    );
    assert!(!stderr.contains("panicked"), "{args:?} panicked:\n{stderr}");
}

#[test]
fn missing_guest_file() {
    run_fails(
        &["run", "--guest", "/nonexistent/guest.elf"],
        "guest file /nonexistent/guest.elf",
    );
}

#[test]
fn guest_that_is_not_an_elf() {
    if !kvm_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("notes.txt");
    std::fs::write(&path, "just some text, not a kernel\n").unwrap();
    run_fails(
        &[
            "run",
            "--guest",
            path.to_str().unwrap(),
            "--serial",
            "/dev/null",
        ],
        "not a loadable ELF",
    );
}

#[test]
fn an_elf_without_a_pvh_note_or_a_kernel_that_is_no_kernel() {
    if !kvm_available() {
        return;
    }
    // The workload guest with its PVH note removed.
    let dir = tempfile::tempdir().unwrap();
    let bare = dir.path().join("bare.elf");
    let strip = std::process::Command::new("objcopy")
        .args(["--remove-section", ".note"])
        .arg(guest())
        .arg(&bare)
        .status()
        .expect("objcopy (binutils) runs");
    assert!(strip.success());
    run_fails(
        &[
            "run",
            "--guest",
            bare.to_str().unwrap(),
            "--serial",
            "/dev/null",
        ],
        "no PVH entry note (XEN_ELFNOTE_PHYS32_ENTRY)",
    );
    let path = dir.path().join("bzImage");
    std::fs::write(&path, vec![0x4du8; 16384]).unwrap();
    run_fails(
        &[
            "run",
            "--kernel",
            path.to_str().unwrap(),
            "--serial",
            "/dev/null",
        ],
        "neither a bzImage nor an ELF kernel",
    );
    run_fails(
        &["run", "--kernel", "/nonexistent/vmlinuz"],
        "kernel file /nonexistent/vmlinuz",
    );
    run_fails(
        &["run", "--kernel", "/bin/sh", "--guest", "/bin/sh"],
        "cannot be used with",
    );
}

#[test]
fn bad_memory_sizes() {
    let guest = guest();
    let g = guest.to_str().unwrap();
    run_fails(&["run", "--guest", g, "--memory", "0"], "larger than 0");
    run_fails(&["run", "--guest", g, "--memory", "abc"], "not a size");
    if kvm_available() {
        run_fails(
            &[
                "run",
                "--guest",
                g,
                "--memory",
                "100T",
                "--serial",
                "/dev/null",
            ],
            "larger than ferry can map",
        );
    }
}

#[test]
fn unknown_workload_word() {
    if !kvm_available() {
        return;
    }
    let guest = guest();
    run_fails(
        &[
            "run",
            "--guest",
            guest.to_str().unwrap(),
            "--cmdline",
            "write bogus",
            "--serial",
            "/dev/null",
        ],
        "unknown workload word bogus",
    );
}

/// The guest reads its virtio-mmio devices from the command line, as Linux does: a malformed
/// word, or a workload whose device is in none of the named windows, stops it with the reason.
#[test]
fn bad_virtio_mmio_words() {
    if !kvm_available() {
        return;
    }
    let guest = guest();
    for (cmdline, expect) in [
        (
            "idle virtio_mmio.device=4K@0xc0000000",
            "malformed word (want virtio_mmio.device=SIZE@BASE:IRQ) virtio_mmio.device=4K@0xc0000000",
        ),
        (
            "idle virtio_mmio.device=4K@zz:16",
            "malformed word (want virtio_mmio.device=SIZE@BASE:IRQ)",
        ),
        (
            "idle virtio_mmio.device=16@0xc0000000:16",
            "virtio-mmio window too small or above 4 GiB",
        ),
        (
            "write blk",
            "blk: no virtio-blk device in the virtio_mmio.device= windows",
        ),
    ] {
        run_fails(
            &[
                "run",
                "--guest",
                guest.to_str().unwrap(),
                "--cmdline",
                cmdline,
                "--serial",
                "/dev/null",
            ],
            expect,
        );
    }
}

#[test]
fn api_socket_already_in_use() {
    if !kvm_available() {
        return;
    }
    let ferry = Ferry::boot(VmSpec::default());
    let guest = guest();
    run_fails(
        &[
            "run",
            "--guest",
            guest.to_str().unwrap(),
            "--api-socket",
            ferry.socket.to_str().unwrap(),
        ],
        "is in use by another process",
    );
    assert_eq!(ferry.info().state, "running", "the first VM is untouched");
}

#[test]
fn malformed_api_requests() {
    if !kvm_available() {
        return;
    }
    let ferry = Ferry::boot(VmSpec::default());
    let api = ferry.api();
    let err = api
        .call_raw("PUT", "vm.debug-corrupt-page", "{page")
        .unwrap_err();
    assert!(err.to_string().contains("malformed JSON"), "{err}");
    assert!(err.to_string().contains("400"), "{err}");
    let err = api.call_raw("GET", "vm.pause", "").unwrap_err();
    assert!(err.to_string().contains("takes PUT"), "{err}");
    let err = api.call_raw("GET", "vm.nothing", "").unwrap_err();
    assert!(err.to_string().contains("no such endpoint"), "{err}");
    // The test hooks are off unless asked for.
    for (endpoint, body) in [
        ("vm.debug-corrupt-page", r#"{"page": 1}"#),
        ("vm.debug-dirty-logging", r#"{"enabled": true}"#),
    ] {
        let err = api.call_raw("PUT", endpoint, body).unwrap_err();
        assert!(err.to_string().contains("--enable-debug-api"), "{err}");
        assert!(err.to_string().contains("403"), "{err}");
    }
    assert_eq!(ferry.info().state, "running");
}

/// A body announced far larger than it is (the request that once aborted the process) is
/// refused unread, and the VM runs on.
#[test]
fn a_huge_content_length_is_refused_and_the_vm_runs_on() {
    if !kvm_available() {
        return;
    }
    use std::io::{Read, Write};
    let ferry = Ferry::boot(VmSpec::default());
    let before = ferry.wait_info("heartbeats", std::time::Duration::from_secs(20), |i| {
        i.heartbeat_seq > 0
    });
    let mut c = std::os::unix::net::UnixStream::connect(&ferry.socket).unwrap();
    c.write_all(b"PUT /api/v1/vm.send-migration HTTP/1.1\r\nContent-Length: 99999999999\r\n\r\n")
        .unwrap();
    let mut answer = String::new();
    let _ = c.read_to_string(&mut answer);
    assert!(answer.starts_with("HTTP/1.1 413"), "{answer}");
    ferry.wait_info(
        "heartbeats after it",
        std::time::Duration::from_secs(20),
        |i| i.heartbeat_seq > before.heartbeat_seq + 10,
    );
    let mode = std::os::unix::fs::PermissionsExt::mode(
        &std::fs::metadata(&ferry.socket).unwrap().permissions(),
    );
    assert_eq!(mode & 0o777, 0o600);
}

#[test]
fn status_without_a_vm() {
    run_fails(
        &["status", "--api-socket", "/nonexistent/ferry.sock"],
        "cannot reach the ferry API",
    );
}

#[test]
fn wrong_flag() {
    run_fails(&["run", "--memroy", "1G"], "--memroy");
}

/// `ferry certs` names each host's files after it: a name that is no host name or address (one
/// that would lead out of `--out`, hide a file, or come twice) is refused before anything is
/// written.
#[test]
fn certs_refuses_names_that_are_no_host_names_and_writes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("certs");
    let out_s = out.to_str().unwrap();
    for name in ["../outside", "", ".hidden", "a b"] {
        run_fails(
            &[
                "certs", "--out", out_s, "--name", "ok.local", "--name", name,
            ],
            "is not a host name",
        );
    }
    run_fails(
        &[
            "certs", "--out", out_s, "--name", "a.local", "--name", "a.local",
        ],
        "given twice",
    );
    assert!(!out.exists(), "nothing written");
    assert!(!dir.path().join("outside.pem").exists());
}

/// A destination that accepts and never answers: cancelling during the handshake ends the
/// migration at once (not after the 30 s a silent peer is given), and the VM runs on here.
#[test]
fn a_migration_to_a_silent_peer_is_cancelled_in_its_handshake() {
    if !kvm_available() {
        return;
    }
    let (ferry, listener, to) = a_vm_and_a_stranger("silent.sock");
    let silent = std::thread::spawn(move || listener.accept().map(|(s, _)| s));
    let socket = ferry.socket.to_str().unwrap().to_string();
    let migrating = std::thread::spawn(move || {
        ferry_output(&["migrate", "--api-socket", &socket, "--to", &to, "--json"])
    });
    let _held = silent.join().unwrap().expect("the source connects");
    wait_for("the migration's handshake", Duration::from_secs(30), || {
        (ferry.migration_status().phase == api::MigrationPhase::Setup).then_some(())
    });
    let asked = std::time::Instant::now();
    ferry.put("vm.cancel-migration");
    let out = migrating.join().unwrap();
    assert!(
        asked.elapsed() < Duration::from_secs(20),
        "cancelled at once, not when the silent peer timed out (30 s)"
    );
    assert!(!out.status.success());
    let end = ferry.wait_migration_end();
    assert_eq!(end.phase, api::MigrationPhase::Cancelled, "{end:?}");
    assert_eq!(ferry.info().state, "running", "the VM runs on here");
}

/// Flags a VM that arrives (or a guest that is no Linux kernel) would silently ignore are
/// refused: the user meant something by them.
#[test]
fn flags_a_run_would_ignore_are_refused() {
    for (args, why) in [
        (
            &[
                "run",
                "--restore",
                "/nonexistent/vm.ferry",
                "--memory",
                "4G",
            ][..],
            "cannot be used with '--memory",
        ),
        (
            &["run", "--restore", "/nonexistent/vm.ferry", "--vcpus", "4"][..],
            "cannot be used with '--vcpus",
        ),
        (
            &[
                "run",
                "--guest",
                "/nonexistent/g.elf",
                "--initrd",
                "/nonexistent/i",
            ][..],
            "cannot be used with '--initrd",
        ),
    ] {
        run_fails(args, why);
    }
}

/// A destination address where something else answers (here, an HTTP server's reply): the
/// migration fails saying it is no ferry there, and the VM runs on.
#[test]
fn a_migration_to_something_that_is_not_ferry_says_so() {
    if !kvm_available() {
        return;
    }
    let (ferry, listener, to) = a_vm_and_a_stranger("http.sock");
    let server = std::thread::spawn(move || {
        use std::io::Write;
        let (mut s, _) = listener.accept().unwrap();
        s.write_all(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n\r\n")
            .unwrap();
        s
    });
    let out = ferry_output(&[
        "migrate",
        "--api-socket",
        ferry.socket.to_str().unwrap(),
        "--to",
        &to,
    ]);
    let _held = server.join().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains("is a ferry --incoming listening there?"),
        "{stderr}"
    );
    assert_eq!(ferry.info().state, "running", "the VM runs on here");
}

/// A migration that cannot finish in `--timeout-s` on its link (10 Mbit/s here) stops soon
/// after it, inside a round, not at the round's end; the VM runs on here.
#[test]
fn a_migration_past_its_timeout_stops_within_its_round() {
    if !kvm_available() {
        return;
    }
    let src = Ferry::writer("write ws=64M seq");
    let dst = Ferry::incoming(&format!("unix:{}", src.scratch("m.sock").display()));
    let asked = std::time::Instant::now();
    let out = ferry_output(&[
        "migrate",
        "--api-socket",
        src.socket.to_str().unwrap(),
        "--to",
        &format!("unix:{}", src.scratch("m.sock").display()),
        "--max-bandwidth-mbps",
        "10",
        "--timeout-s",
        "2",
        // Plain pages: packed, this guest's pages (one word each) would cross in a moment.
        "--compression",
        "none",
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "{stderr}{}",
        String::from_utf8_lossy(&out.stdout)
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stderr.contains("timed out after 2 s") || stdout.contains("timed out after 2 s"),
        "{stderr}{stdout}"
    );
    // 64 MiB at 10 Mbit/s is a 50 s round; its first 4096 pages alone take 13 s.
    assert!(
        asked.elapsed() < Duration::from_secs(10),
        "stopped at {:?}",
        asked.elapsed()
    );
    assert_eq!(src.info().state, "running", "the VM runs on here");
    drop(dst);
}

/// A running VM, and a Unix socket that is no ferry's where it could migrate to (`to`).
fn a_vm_and_a_stranger(name: &str) -> (Ferry, std::os::unix::net::UnixListener, String) {
    let ferry = Ferry::boot(VmSpec::default());
    let sock = ferry.scratch(name);
    let listener = std::os::unix::net::UnixListener::bind(&sock).unwrap();
    (ferry, listener, format!("unix:{}", sock.display()))
}
