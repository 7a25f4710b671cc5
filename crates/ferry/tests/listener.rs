//! A TLS destination's listener against strangers on the network, and a source that fails
//! migration after migration: the real source still gets in, and nothing is left behind.

mod common;

use std::io::Write;
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::os::fd::FromRawFd;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use api::MigrationPhase;
use common::*;
use migration::io::tls::{Tls, TlsFiles};

const T: Duration = Duration::from_secs(60);

/// Connects to `to` from local address `from` (any of 127/8 is this host), as a stranger on
/// another host would.
fn connect_from(from: Ipv4Addr, to: SocketAddr) -> std::io::Result<TcpStream> {
    let SocketAddr::V4(to) = to else {
        panic!("an IPv4 destination")
    };
    let addr = |ip: Ipv4Addr, port: u16| libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: port.to_be(),
        sin_addr: libc::in_addr {
            s_addr: u32::from(ip).to_be(),
        },
        sin_zero: [0; 8],
    };
    let len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
    // SAFETY: a new socket, owned by the TcpStream made of it at once.
    let s = unsafe {
        let fd = libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0);
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        TcpStream::from_raw_fd(fd)
    };
    // A listener that stops accepting must fail a connect in a second, not hang the test.
    s.set_write_timeout(Some(Duration::from_secs(1)))?;
    let (local, remote) = (addr(from, 0), addr(*to.ip(), to.port()));
    let fd = std::os::fd::AsRawFd::as_raw_fd(&s);
    // SAFETY: addresses of the size given, on the socket `s` owns.
    let bound = unsafe { libc::bind(fd, (&local as *const libc::sockaddr_in).cast(), len) };
    if bound != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: as above.
    let connected = unsafe { libc::connect(fd, (&remote as *const libc::sockaddr_in).cast(), len) };
    if connected != 0 {
        return Err(std::io::Error::last_os_error());
    }
    s.set_write_timeout(None)?;
    Ok(s)
}

/// Strangers at `to` from `hosts` addresses: `n` connections that close at once, sit idle or
/// send garbage, in turn (for 30 s at most). The idle and garbage ones are returned, still
/// open.
fn strays(to: SocketAddr, hosts: u8, n: usize) -> Vec<TcpStream> {
    let mut held = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(30);
    for i in (0..n).take_while(|_| Instant::now() < deadline) {
        let from = Ipv4Addr::new(127, 0, 2, 1 + (i % usize::from(hosts)) as u8);
        // One the destination closed before we got to it is a stranger turned away: fine.
        let Ok(mut s) = connect_from(from, to) else {
            continue;
        };
        match i % 3 {
            0 => drop(s),
            1 => held.push(s),
            _ => {
                let _ = s.write_all(b"GET / HTTP/1.1\r\nHost: ferry\r\n\r\n");
                held.push(s);
            }
        }
    }
    held
}

/// Tricklers at `to`, each from an address of its own, sending the start of a TLS record one
/// byte a second until `stop` (for two minutes at most).
fn tricklers(to: SocketAddr, n: u8, stop: &Arc<AtomicBool>) -> Vec<std::thread::JoinHandle<()>> {
    (0..n)
        .map(|i| {
            let mut s = connect_from(Ipv4Addr::new(127, 0, 3, 1 + i), to).expect("a trickler");
            let stop = stop.clone();
            std::thread::spawn(move || {
                let record = [0x16u8, 0x03, 0x01, 0x02, 0x00, 0x01, 0x00, 0x01, 0xfc];
                for b in record.iter().cycle().take(120) {
                    if stop.load(Ordering::Relaxed) || s.write_all(&[*b]).is_err() {
                        return;
                    }
                    std::thread::sleep(Duration::from_secs(1));
                }
            })
        })
        .collect()
}

/// Certificates for `source.local` and `127.0.0.1` in a new directory, and a VM booted with
/// the first.
fn tls_source(spec: VmSpec) -> (tempfile::TempDir, Ferry) {
    let scratch = tempfile::tempdir().unwrap();
    certs(scratch.path(), &["source.local", "127.0.0.1"]);
    let tls = tls_args(scratch.path(), "source.local");
    let src = Ferry::boot_with(spec, &tls.iter().map(String::as_str).collect::<Vec<_>>());
    (scratch, src)
}

/// 1000 strangers (closing at once, idle, sending garbage) and 10 tricklers are at the
/// destination's door; the real source gets in, and its guest's memory arrives whole.
#[test]
fn the_real_source_gets_in_past_strangers_and_tricklers() {
    if !kvm_available() {
        return;
    }
    let (scratch, src) = tls_source(VmSpec {
        memory: "512M",
        cmdline: "write ws=64M seq verify",
        ..Default::default()
    });
    let port = free_port();
    let url = format!("tcp:127.0.0.1:{port}");
    let mut dst_argv: Vec<String> = vec!["--incoming".into(), url.clone()];
    dst_argv.extend(tls_args(scratch.path(), "127.0.0.1"));
    let mut dst = Ferry::start(&dst_argv.iter().map(String::as_str).collect::<Vec<_>>());
    src.wait_info("a first pass", T, |i| i.passes >= 1);

    let to: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let trickling = tricklers(to, 10, &stop);
    let held = strays(to, 8, 1000);
    assert!(dst.is_running(), "the destination waits on");

    let asked = Instant::now();
    let (report, ok, errors) = migrate(&src, &url, &[]);
    eprintln!(
        "migrated in {:?} past 1000 strangers ({} of them held open) and 10 tricklers",
        asked.elapsed(),
        held.len()
    );
    stop.store(true, Ordering::Relaxed);
    assert!(ok, "{errors}");
    assert_eq!(report.phase, MigrationPhase::Completed);
    let start = dst.info();
    let info = dst.wait_info("passes on the destination", T, |i| i.passes > start.passes);
    assert_eq!(info.verify_errors, 0);
    assert!(dst.stderr_text().contains("refused an incoming connection"));
    drop(held);
    for t in trickling {
        t.join().unwrap();
    }
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
