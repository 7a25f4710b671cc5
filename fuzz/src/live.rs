//! `live_destination`: a destination receiving a live migration, as a source's connections
//! bring it. The input is what the source sends on its main connection (stream header, then
//! frames), then, after each `LANE_MARK`, what it sends on one extra connection after its
//! `Join` (the harness opens the extra connections the `Hello` asks for, each with the right
//! `Join`, so that the fuzzer spends its time on what follows), and, after a `RESUME_MARK`,
//! what it sends on a connection that carries the migration on after the main one ended
//! (after its `ResumePrecopy` naming the `Hello`'s session). Each connection is a `unix:`
//! socket to the destination's listener, fed by a thread of its own while another reads
//! whatever the destination answers until it hangs up.
//!
//! `resume`: the resume conversation alone: the main connection carries a fixed `Hello` and
//! `ResumeWindow` and ends; the input is what the connection that carries it on sends.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Once, OnceLock};
use std::thread::JoinHandle;
use std::time::Duration;

use migration::destination::{Source, WAITING_FOR_RESUME};
use migration::wire::frame::STREAM_HEADER_LEN;
use migration::wire::lanes::MAX_CONNECTIONS;
use migration::wire::{self, Message, StreamMode};
use migration::{Endpoint, Incoming, Migratable, StatusBoard};

use crate::{Built, PlainVm, repair_frames};

/// Separates the main connection's bytes from each extra connection's in an input.
pub const LANE_MARK: &[u8] = b"--lane--";
/// Separates the connections before a break from the one that carries the migration on.
pub const RESUME_MARK: &[u8] = b"--resume--";

/// The session of the `resume` target's fixed `Hello`.
const RESUME_SESSION: u64 = 0x5e55_1011;

/// How long a connection's thread waits on a destination that neither reads nor answers
/// (a safety net: the destination ends every conversation before that).
const PEER_WAIT: Duration = Duration::from_secs(5);

pub fn live_destination(data: &[u8]) {
    receive_live(data);
}

/// `live_destination`; what the destination's status said at the end, and the VM if one
/// arrived.
fn receive_live(data: &[u8]) -> (migration::status::Status, Option<Arc<PlainVm>>) {
    ignore_sigpipe();
    let (before, resumed) = match find(data, RESUME_MARK) {
        Some(at) => (&data[..at], Some(&data[at + RESUME_MARK.len()..])),
        None => (data, None),
    };
    let mut parts = split(before, LANE_MARK);
    let mut main = parts.remove(0).to_vec();
    repair_frames(&mut main, STREAM_HEADER_LEN);
    let path = socket_path();
    let listener = Endpoint::Unix(path.clone())
        .listen(None)
        .expect("a listener in this process's own directory");
    let hello = hello_of(&main);
    let lanes = match hello {
        Some((session, n)) if n >= 2 => (1..n)
            .map(|lane| {
                let part = parts.get(lane as usize - 1).copied().unwrap_or_default();
                joined(Message::Join { session, lane }, part)
            })
            .collect(),
        _ => Vec::new(),
    };
    let resumed = resumed.map(|part| {
        let session = hello.map_or(0, |(session, _)| session);
        joined(Message::ResumePrecopy { session }, part)
    });
    let peers = Arc::new(Peers::default());
    let board = StatusBoard::default();
    // The destination stops once it hung up on every connection, or once it waits for a
    // resume the input does not hold: none at all, or a second one.
    let has_resume = resumed.is_some();
    let (main_ended, all_ended) = peers.open(&path, main, lanes, resumed);
    let waits_in_vain = || {
        let status = board.read();
        let waiting = status
            .note
            .as_deref()
            .is_some_and(|n| n.starts_with(WAITING_FOR_RESUME));
        waiting
            && (!has_resume || (status.report.resumes >= 1 && main_ended.load(Ordering::Acquire)))
    };
    let stop = || all_ended.load(Ordering::Acquire) || waits_in_vain();
    let built = Built::default();
    let incoming = Incoming::new(board.clone(), None);
    let result = incoming.receive(Source::Listening(listener), &stop, built.builder(), |_| {});
    // A post-copy cut short is kept there (for a resume) until it goes.
    drop(incoming);
    peers.close();
    built.check(&result, "live migration");
    (board.read(), result.ok().flatten())
}

/// The resume conversation: a pre-copy of `PlainVm::small` whose main connection ends after
/// its `Hello` and `ResumeWindow`, carried on by a connection that sends `data`.
pub fn resume(data: &[u8]) {
    receive_resumed(data);
}

fn receive_resumed(data: &[u8]) -> migration::status::Status {
    let mut input = resume_prefix().clone();
    input.extend_from_slice(RESUME_MARK);
    input.extend_from_slice(data);
    receive_live(&input).0
}

/// The `resume` target's main connection: the stream header, `Hello`, `Config`, `Storage`,
/// `ResumeWindow`.
fn resume_prefix() -> &'static Vec<u8> {
    static PREFIX: OnceLock<Vec<u8>> = OnceLock::new();
    PREFIX.get_or_init(|| {
        let mut out = Vec::new();
        wire::write_stream_header(&mut out).unwrap();
        let hello = Message::Hello {
            vm: PlainVm::small().descriptor(),
            mode: StreamMode::Precopy,
            source: "ferry fuzz".into(),
            connections: 1,
            session: RESUME_SESSION,
        };
        wire::write_message(&mut out, &hello).unwrap();
        wire::write_message(&mut out, &Message::Config { config: None }).unwrap();
        let disks = Vec::new();
        wire::write_message(&mut out, &Message::Storage { disks }).unwrap();
        wire::write_message(&mut out, &Message::ResumeWindow { seconds: 1 }).unwrap();
        out
    })
}

fn find(data: &[u8], mark: &[u8]) -> Option<usize> {
    data.windows(mark.len()).position(|w| w == mark)
}

/// `data` cut at each `mark`.
fn split<'a>(data: &'a [u8], mark: &[u8]) -> Vec<&'a [u8]> {
    let mut parts = Vec::new();
    let mut rest = data;
    while let Some(at) = rest.windows(mark.len()).position(|w| w == mark) {
        parts.push(&rest[..at]);
        rest = &rest[at + mark.len()..];
    }
    parts.push(rest);
    parts
}

/// The session and the connections a live stream's `Hello` names.
fn hello_of(main: &[u8]) -> Option<(u64, u32)> {
    let mut r = main;
    wire::read_stream_header(&mut r).ok()?;
    match wire::read_message(&mut r).ok()? {
        Message::Hello {
            mode,
            connections,
            session,
            ..
        } if mode != StreamMode::Snapshot && connections <= MAX_CONNECTIONS => {
            Some((session, connections))
        }
        _ => None,
    }
}

/// What a connection after the main one sends: the stream header, its first message
/// (`first`: a `Join` or a `ResumePrecopy`), then `payload` with its frames' CRCs repaired.
fn joined(first: Message, payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    wire::write_stream_header(&mut out).unwrap();
    wire::write_message(&mut out, &first).unwrap();
    let at = out.len();
    out.extend_from_slice(payload);
    repair_frames(&mut out, at);
    out
}

/// A fresh socket path in this process's own temporary directory (removed at exit by no one:
/// the listener removes each socket as it goes).
pub(crate) fn socket_path() -> PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let dir = DIR.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("ferry-fuzz-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("a temporary directory");
        dir
    });
    dir.join(format!("{}.sock", NEXT.fetch_add(1, Ordering::Relaxed)))
}

/// A peer that hung up makes a write fail instead of killing the process, as in ferry itself
/// (Rust's runtime ignores SIGPIPE; libFuzzer's `main` does not).
pub(crate) fn ignore_sigpipe() {
    static ONCE: Once = Once::new();
    // SAFETY: setting a signal's disposition to "ignore" installs no handler.
    ONCE.call_once(|| unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_IGN);
    });
}

/// The source's connections, each fed by its own threads.
#[derive(Default)]
struct Peers {
    sockets: Mutex<Vec<UnixStream>>,
    threads: Mutex<Vec<JoinHandle<()>>>,
}

impl Peers {
    /// Connects to `path` and sends `bytes`, reading what comes back until the destination
    /// hangs up; the flags returned say it did, on the main connection and on every one.
    /// Once the destination first answers (it took this connection as its migration: a
    /// source opens its extra connections after `Ready`), opens one connection for each of
    /// `lanes` and sends it, and one that sends `resumed` (it waits, unread, until the
    /// destination looks for a resume). Once all hung up, a connection made and dropped
    /// wakes a listener still waiting for a migration (it looks at its stop flag).
    fn open(
        self: &Arc<Self>,
        path: &Path,
        bytes: Vec<u8>,
        lanes: Vec<Vec<u8>>,
        resumed: Option<Vec<u8>>,
    ) -> (Arc<AtomicBool>, Arc<AtomicBool>) {
        let main_ended = Arc::new(AtomicBool::new(false));
        let all_ended = Arc::new(AtomicBool::new(false));
        let Some(socket) = self.connect(path, bytes) else {
            main_ended.store(true, Ordering::Release);
            all_ended.store(true, Ordering::Release);
            return (main_ended, all_ended);
        };
        let (main, all) = (main_ended.clone(), all_ended.clone());
        let (path, peers) = (path.to_path_buf(), self.clone());
        let mut later = Some((lanes, resumed));
        let thread = std::thread::spawn(move || {
            let mut resume_socket = None;
            read_all(socket, || {
                let Some((lanes, resumed)) = later.take() else {
                    return;
                };
                for lane in lanes {
                    peers.connect(&path, lane);
                }
                resume_socket = resumed.and_then(|r| peers.connect(&path, r));
            });
            main.store(true, Ordering::Release);
            if let Some(s) = resume_socket {
                read_all(s, || {});
            }
            all.store(true, Ordering::Release);
            drop(UnixStream::connect(&path));
        });
        self.threads.lock().unwrap().push(thread);
        (main_ended, all_ended)
    }

    /// A connection to `path` whose own thread sends `bytes`, then ends the sending direction.
    fn connect(&self, path: &Path, bytes: Vec<u8>) -> Option<UnixStream> {
        let socket = UnixStream::connect(path).ok()?;
        let _ = socket.set_write_timeout(Some(PEER_WAIT));
        let _ = socket.set_read_timeout(Some(PEER_WAIT));
        let mut writer = socket.try_clone().expect("a second handle on a socket");
        let thread = std::thread::spawn(move || {
            let _ = writer.write_all(&bytes);
            let _ = writer.shutdown(std::net::Shutdown::Write);
        });
        self.sockets
            .lock()
            .unwrap()
            .push(socket.try_clone().expect("a third handle"));
        self.threads.lock().unwrap().push(thread);
        Some(socket)
    }

    /// Hangs up every connection (a destination that succeeded keeps its own open for a
    /// moment) and waits for their threads.
    fn close(&self) {
        for s in self.sockets.lock().unwrap().iter() {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
        // Joined one at a time: a thread may still add a connection (and its thread).
        loop {
            let Some(t) = self.threads.lock().unwrap().pop() else {
                break;
            };
            t.join().expect("a connection's thread");
        }
    }
}

/// Reads until the other side hangs up, calling `answered` once at its first bytes.
fn read_all(mut socket: UnixStream, mut answered: impl FnMut()) {
    let mut sink = [0u8; 16 * 1024];
    while matches!(socket.read(&mut sink), Ok(n) if n > 0) {
        answered();
    }
}

#[cfg(test)]
mod tests {
    /// The harness reaches what it is for: the seeds' new connection carries the
    /// migration on.
    #[test]
    fn a_resume_seed_is_carried_on() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("corpus/resume");
        for seed in ["precopy.ferry", "precopy-cut-again.ferry"] {
            let status = super::receive_resumed(&std::fs::read(dir.join(seed)).unwrap());
            assert_eq!(status.report.resumes, 1, "{seed}: {:?}", status.note);
        }
    }

    /// The copy-storage seed reaches the destination's disk code: the VM arrives with the
    /// source's disk, byte for byte.
    #[test]
    fn a_disk_seed_fills_the_destinations_disk() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("corpus/live_destination");
        let seed = std::fs::read(dir.join("copy-storage.ferry")).unwrap();
        let (status, arrived) = super::receive_live(&seed);
        let vm = arrived.unwrap_or_else(|| panic!("no VM arrived: {:?}", status.error));
        assert!(
            vm.disk(0) == Some(crate::seed_disk()),
            "the disk arrived whole"
        );
    }

    #[test]
    fn inputs_split_at_each_mark() {
        let parts = super::split(b"main--lane--one--lane----lane--", super::LANE_MARK);
        assert_eq!(parts, [&b"main"[..], b"one", b"", b""]);
    }
}
