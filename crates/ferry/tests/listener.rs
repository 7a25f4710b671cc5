//! A TLS source that fails migration after migration leaves nothing behind.

mod common;

use std::net::TcpListener;
use std::time::{Duration, Instant};

use common::*;
use migration::wire::tls::{Tls, TlsFiles};

const T: Duration = Duration::from_secs(60);

/// Certificates for `source.local` and `127.0.0.1` in a new directory, and a VM booted with
/// the first.
fn tls_source(spec: VmSpec) -> (tempfile::TempDir, Ferry) {
    let scratch = tempfile::tempdir().unwrap();
    certs(scratch.path(), &["source.local", "127.0.0.1"]);
    let tls = tls_args(scratch.path(), "source.local");
    let src = Ferry::boot_with(spec, &tls.iter().map(String::as_str).collect::<Vec<_>>());
    (scratch, src)
}

/// This host's side of a TLS connection that a peer will or will not speak on.
fn tls_peer(dir: &std::path::Path) -> Tls {
    Tls::load(&TlsFiles {
        cert: dir.join("127.0.0.1.pem"),
        key: dir.join("127.0.0.1.key"),
        ca: dir.join("ca.pem"),
    })
    .unwrap()
}

/// 50 failed TLS migrations from one VM: to a peer that finishes the handshake and then says
/// nothing (cancelled), and to one that closes after it. The source's threads and file
/// descriptors come back to what they were.
#[test]
fn failed_migrations_leave_no_threads_or_fds_behind() {
    if !kvm_available() {
        return;
    }
    let (scratch, src) = tls_source(VmSpec::default());
    let peer = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("tcp:{}", peer.local_addr().unwrap());
    let tls = tls_peer(scratch.path());
    // Silent peers' connections stay open to the end: a source must not wait for them.
    let mut silent = Vec::new();
    let mut fail = |quiet: bool| {
        let socket = src.socket.to_str().unwrap().to_string();
        let to = url.clone();
        let migrating = std::thread::spawn(move || {
            ferry_output(&["migrate", "--api-socket", &socket, "--to", &to])
        });
        let (tcp, _) = peer.accept().unwrap();
        let secured = tls
            .accept(tcp, Instant::now() + T)
            .expect("the source's TLS");
        if quiet {
            silent.push(secured);
            src.put("vm.cancel-migration");
        } else {
            drop(secured);
        }
        assert!(!migrating.join().unwrap().status.success());
        src.wait_migration_end();
    };
    // Once each first: what a first migration sets up for good is no leak.
    fail(true);
    fail(false);
    let before = src.threads_and_fds();
    for i in 0..50 {
        fail(i % 2 == 0);
    }
    // Threads that end on their own (a TLS pump sending its last word) get a bounded while.
    let deadline = Instant::now() + Duration::from_secs(20);
    let back = |now: (usize, usize)| now.0 <= before.0 && now.1 <= before.1;
    let mut after = src.threads_and_fds();
    while !back(after) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
        after = src.threads_and_fds();
    }
    eprintln!("threads, fds before: {before:?}; after 50 failed migrations: {after:?}");
    assert!(
        back(after),
        "threads, fds before {before:?}, after {after:?}"
    );
    assert_eq!(src.info().state, "running", "the VM runs on here");
}
