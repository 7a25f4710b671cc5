//! `source`: a migration's source hearing a hostile destination. The input's first byte picks
//! the migration's parameters (`params_from`); the rest is what the destination answers on
//! the connection: frames (control messages, and the page frames of post-copy checkpoints),
//! sent at once, then the end of the stream. A fake destination on a `unix:` socket sends
//! them and keeps everything the source sends, which tells whether `Go` went.

use std::io::{Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, mpsc};
use std::time::Duration;

use migration::wire::{self, Frame, Message};
use migration::{Endpoint, Migratable, MigrationParams, Mode, Outgoing, StatusBoard};

use crate::PlainVm;
use crate::live::{ignore_sigpipe, socket_path};

/// How often the fake destination looks whether the source is done, once nothing comes.
const POLL: Duration = Duration::from_millis(20);

pub fn source(data: &[u8]) {
    ignore_sigpipe();
    let Some((&knobs, answers)) = data.split_first() else {
        return;
    };
    let mut answers = answers.to_vec();
    crate::repair_frames(&mut answers, 0);
    let path = socket_path();
    let listener = UnixListener::bind(&path).expect("a socket in this process's directory");
    let done = Arc::new(AtomicBool::new(false));
    let seen = done.clone();
    let destination = std::thread::spawn(move || fake_destination(&listener, &answers, &seen));
    let vm = Arc::new(PlainVm::small());
    vm.resume().unwrap();
    let outcome = migrate(vm.clone(), &path, params_from(knobs));
    done.store(true, Ordering::Release);
    // Wakes the fake destination if the source never connected.
    drop(UnixStream::connect(&path));
    let sent = destination.join().expect("the fake destination");
    let _ = std::fs::remove_file(&path);
    let Some(outcome) = outcome else {
        return; // parameters the source refuses before it starts
    };
    check(outcome, go_went(&sent), &vm);
}

/// The parameters a knob byte picks: bits 0-1 the mode, 2 checkpoints (post-copy only), 3 `Go`
/// right behind the state, 4 the memory checksum, 5 auto post-copy.
pub fn params_from(knobs: u8) -> MigrationParams {
    let bit = |n: u8| knobs & (1 << n) != 0;
    let mode = [Mode::Precopy, Mode::Warm, Mode::Postcopy, Mode::Hybrid][usize::from(knobs & 3)];
    let postcopy = matches!(mode, Mode::Postcopy | Mode::Hybrid);
    MigrationParams {
        mode,
        checkpoint_ms: (bit(2) && postcopy).then_some(20),
        go_with_state: Some(bit(3)),
        checksum: bit(4),
        auto_postcopy: bit(5),
        timeout_s: 30,
        ..MigrationParams::default()
    }
}

/// Migrates `vm` to `path`; how it ended (`None`: refused before it began).
fn migrate(vm: Arc<PlainVm>, path: &Path, params: MigrationParams) -> Option<Result<(), String>> {
    let (tx, rx) = mpsc::channel();
    let outgoing = Outgoing::new(StatusBoard::default(), None);
    let on_done = Box::new(move |r: &migration::Result<()>| {
        let _ = tx.send(r.as_ref().map(|_| ()).map_err(ToString::to_string));
    });
    let started = outgoing.send(vm, Endpoint::Unix(path.to_path_buf()), params, on_done);
    // Once it started, it ends (a refusal at the start ends it too).
    let outcome = rx.recv().ok();
    assert!(
        outcome.is_some() || started.is_err(),
        "a migration that started never ended"
    );
    outcome
}

/// What must hold: only `Go` lets the VM go; an error says what went wrong; without `Go`, the
/// VM runs here again.
fn check(outcome: Result<(), String>, go: bool, vm: &PlainVm) {
    match outcome {
        Ok(()) => assert!(go, "a migration succeeded without Go"),
        Err(e) => {
            assert!(!e.trim().is_empty(), "an error that says nothing");
            if !go {
                assert!(vm.is_running(), "the VM stays paused after: {e}");
            }
        }
    }
}

/// Accepts the source, sends it `answers`, and keeps what it sends until it hangs up (or is
/// done: a post-copy cut short keeps its end open for a resume).
fn fake_destination(listener: &UnixListener, answers: &[u8], done: &AtomicBool) -> Vec<u8> {
    let Ok((mut socket, _)) = listener.accept() else {
        return Vec::new();
    };
    let mut writer = socket.try_clone().expect("a second handle on a socket");
    let answers = answers.to_vec();
    let answering = std::thread::spawn(move || {
        let _ = writer.set_write_timeout(Some(Duration::from_secs(5)));
        let _ = writer.write_all(&answers);
        let _ = writer.shutdown(std::net::Shutdown::Write);
    });
    let _ = socket.set_read_timeout(Some(POLL));
    let mut sent = Vec::new();
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        match socket.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => sent.extend_from_slice(&buf[..n]),
            Err(e) if is_timeout(&e) && !done.load(Ordering::Acquire) => {}
            Err(_) => break,
        }
    }
    let _ = socket.shutdown(std::net::Shutdown::Both);
    answering.join().expect("the answering thread");
    sent
}

fn is_timeout(e: &std::io::Error) -> bool {
    matches!(
        e.kind(),
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
    )
}

/// Whether the source's stream holds a `Go`.
fn go_went(sent: &[u8]) -> bool {
    let mut r = sent;
    if wire::read_stream_header(&mut r).is_err() {
        return false;
    }
    loop {
        match wire::read_frame(&mut r) {
            Ok(Frame::Message(Message::Go)) => return true,
            Ok(Frame::Message(_)) => {}
            // A page frame's payload and trailer.
            Ok(Frame::Pages { len, .. }) => match r.get(len as usize + 4..) {
                Some(rest) => r = rest,
                None => return false,
            },
            Err(_) => return false,
        }
    }
}
