//! `live_destination`: a destination receiving a live migration, as a source's connections
//! bring it. The input is what the source sends on its main connection (stream header, then
//! frames), then, after each `LANE_MARK`, what it sends on one extra connection after its
//! `Join` (the harness opens the extra connections the `Hello` asks for, each with the right
//! `Join`, so that the fuzzer spends its time on what follows). Each connection is a `unix:`
//! socket to the destination's listener, fed by a thread of its own while another reads
//! whatever the destination answers until it hangs up.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Once, OnceLock};
use std::thread::JoinHandle;
use std::time::Duration;

use migration::destination::Source;
use migration::wire::frame::STREAM_HEADER_LEN;
use migration::wire::lanes::MAX_CONNECTIONS;
use migration::wire::{self, Message, StreamMode};
use migration::{Endpoint, Incoming, StatusBoard};

use crate::{Built, repair_frames};

/// Separates the main connection's bytes from each extra connection's in an input.
pub const LANE_MARK: &[u8] = b"--lane--";

/// How long a connection's thread waits on a destination that neither reads nor answers
/// (a safety net: the destination ends every conversation before that).
const PEER_WAIT: Duration = Duration::from_secs(5);

pub fn live_destination(data: &[u8]) {
    ignore_sigpipe();
    let mut parts = split(data, LANE_MARK);
    let mut main = parts.remove(0).to_vec();
    repair_frames(&mut main, STREAM_HEADER_LEN);
    let path = socket_path();
    let listener = Endpoint::Unix(path.clone())
        .listen(None)
        .expect("a listener in this process's own directory");
    let lanes = match lanes_asked(&main) {
        Some((session, n)) => (1..n)
            .map(|lane| {
                let part = parts.get(lane as usize - 1).copied().unwrap_or_default();
                let mut payload = part.to_vec();
                repair_frames(&mut payload, 0);
                joined(session, lane, &payload)
            })
            .collect(),
        None => Vec::new(),
    };
    let peers = Arc::new(Peers::default());
    // The listener stops waiting once the destination hung up on the main connection.
    let hung_up = peers.open(&path, main, lanes);
    let built = Built::default();
    let incoming = Incoming::new(StatusBoard::default(), None);
    let result = incoming.receive(
        Source::Listening(listener),
        &|| hung_up.load(Ordering::Acquire),
        built.builder(),
        |_| {},
    );
    // A post-copy cut short is kept there (for a resume) until it goes.
    drop(incoming);
    peers.close();
    built.check(&result, "live migration");
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

/// The session and the connections a live stream's `Hello` asks for, when it asks for extra
/// connections the destination would wait for.
fn lanes_asked(main: &[u8]) -> Option<(u64, u32)> {
    let mut r = main;
    wire::read_stream_header(&mut r).ok()?;
    match wire::read_message(&mut r).ok()? {
        Message::Hello {
            mode,
            connections,
            session,
            ..
        } if mode != StreamMode::Snapshot && (2..=MAX_CONNECTIONS).contains(&connections) => {
            Some((session, connections))
        }
        _ => None,
    }
}

/// What an extra connection sends: the stream header, its `Join`, then `payload`.
fn joined(session: u64, lane: u32, payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    wire::write_stream_header(&mut out).unwrap();
    wire::write_message(&mut out, &Message::Join { session, lane }).unwrap();
    out.extend_from_slice(payload);
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
    /// hangs up; the flag returned says it did. Once the destination first answers (it took
    /// this connection as its migration: a source opens its extra connections after `Ready`),
    /// opens one connection for each of `lanes` and sends it. Once hung up, a connection made
    /// and dropped wakes a listener still waiting for a migration (it looks at its stop flag).
    fn open(self: &Arc<Self>, path: &Path, bytes: Vec<u8>, lanes: Vec<Vec<u8>>) -> Arc<AtomicBool> {
        let hung_up = Arc::new(AtomicBool::new(false));
        let Some(socket) = self.connect(path, bytes) else {
            hung_up.store(true, Ordering::Release);
            return hung_up;
        };
        let (flag, path, peers) = (hung_up.clone(), path.to_path_buf(), self.clone());
        let mut lanes = Some(lanes);
        let thread = std::thread::spawn(move || {
            read_all(socket, || {
                for lane in lanes.take().into_iter().flatten() {
                    peers.connect(&path, lane);
                }
            });
            flag.store(true, Ordering::Release);
            drop(UnixStream::connect(&path));
        });
        self.threads.lock().unwrap().push(thread);
        hung_up
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
    #[test]
    fn inputs_split_at_each_mark() {
        let parts = super::split(b"main--lane--one--lane----lane--", super::LANE_MARK);
        assert_eq!(parts, [&b"main"[..], b"one", b"", b""]);
    }
}
