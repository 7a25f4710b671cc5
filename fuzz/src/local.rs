//! `local_destination`: a live update's destination taking the files its source passes with
//! `SCM_RIGHTS`. The input's first byte says how many files pass (0 to 7), the next bytes the
//! kind of each (`FileKind`), and the rest is what the source sends (stream header, frames);
//! the files pass right after the first `Files` frame, as ferry's source passes them. A memory
//! file the destination accepts must be what ferry makes: a memfd of its range's size whose
//! size is sealed; a refused update never resumes its VM.

use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use migration::destination::Source;
use migration::io::transport::Stream;
use migration::wire::frame::{FRAME_HEADER_LEN, KIND_CONTROL, STREAM_HEADER_LEN};
use migration::wire::{self, Message};
use migration::{Endpoint, HandedFiles, Incoming, StatusBoard, VmDescriptor};

use crate::live::{ignore_sigpipe, socket_path};
use crate::{Built, PlainVm, repair_frames};

/// The most files an input passes.
const MAX_FILES: u8 = 7;
const PAGE: u64 = migration::PAGE_SIZE as u64;

/// What one passed file is.
#[derive(Clone, Copy)]
enum FileKind {
    /// A memfd of the size asked for, sealed as ferry seals it.
    Sealed,
    /// The same, sealed shut only (a memfd as an earlier ferry made it).
    SealedShut,
    /// The same, with no seal.
    Unsealed,
    /// Sealed, but half the size asked for.
    Short,
    /// `/dev/null`.
    Null,
    /// A pipe's end.
    Pipe,
    /// A Unix socket.
    Socket,
}

impl FileKind {
    fn from_byte(b: u8) -> Self {
        use FileKind::*;
        [Sealed, SealedShut, Unsealed, Short, Null, Pipe, Socket][usize::from(b) % 7]
    }

    /// The file, `len` bytes where it has a size.
    fn make(self, len: u64) -> OwnedFd {
        let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;
        match self {
            FileKind::Sealed => memfd(len, seals),
            FileKind::SealedShut => memfd(len, libc::F_SEAL_SEAL),
            FileKind::Unsealed => memfd(len, 0),
            FileKind::Short => memfd(len / 2, seals),
            FileKind::Null => std::fs::File::open("/dev/null").unwrap().into(),
            FileKind::Pipe => {
                let mut fds = [0; 2];
                // SAFETY: `fds` has room for the two descriptors pipe() writes.
                assert_eq!(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) }, 0);
                // SAFETY: both are fresh descriptors this function owns.
                drop(unsafe { OwnedFd::from_raw_fd(fds[1]) });
                // SAFETY: as above.
                unsafe { OwnedFd::from_raw_fd(fds[0]) }
            }
            FileKind::Socket => UnixStream::pair().unwrap().0.into(),
        }
    }
}

fn memfd(len: u64, seals: libc::c_int) -> OwnedFd {
    let flags = libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING;
    // SAFETY: a plain syscall with a NUL-terminated name; the fd is checked before use.
    let fd = unsafe { libc::memfd_create(c"fuzz-guest".as_ptr(), flags) };
    assert!(fd >= 0, "memfd_create: {}", std::io::Error::last_os_error());
    // SAFETY: a fresh fd that nothing else owns.
    let file = unsafe { std::fs::File::from_raw_fd(fd) };
    file.set_len(len).unwrap();
    // SAFETY: F_ADD_SEALS on a descriptor this function owns.
    assert!(seals == 0 || unsafe { libc::fcntl(fd, libc::F_ADD_SEALS, seals) } == 0);
    file.into()
}

pub fn local_destination(data: &[u8]) {
    let _ = receive_update(data);
}

/// `local_destination`; how the destination's receive ended, in words.
fn receive_update(data: &[u8]) -> Result<(), String> {
    ignore_sigpipe();
    let Some((&count, rest)) = data.split_first() else {
        return Ok(());
    };
    let count = usize::from(count % (MAX_FILES + 1)).min(rest.len());
    let (kinds, stream) = rest.split_at(count);
    let mut stream = stream.to_vec();
    repair_frames(&mut stream, STREAM_HEADER_LEN);
    let sizes = range_sizes(&stream);
    let files: Vec<OwnedFd> = kinds
        .iter()
        .enumerate()
        .map(|(i, &k)| FileKind::from_byte(k).make(sizes.get(i).copied().unwrap_or(16 * PAGE)))
        .collect();
    let path = socket_path();
    let listener = Endpoint::Unix(path.clone())
        .listen(None)
        .expect("a listener in this process's own directory");
    let socket = UnixStream::connect(&path).expect("a connection to the listener");
    let hung_up = Arc::new(AtomicBool::new(false));
    let closer = socket
        .try_clone()
        .expect("a second handle on the source's end");
    let peer = feed(socket, stream, files, hung_up.clone());
    let built = Built::default();
    let builder = built.builder();
    let result = Incoming::new(StatusBoard::default(), None).receive(
        Source::Listening(listener),
        &|| hung_up.load(Ordering::Acquire),
        move |d: &VmDescriptor, handed: Option<HandedFiles>| {
            check_handed(d, handed.as_ref())?;
            builder(d, handed)
        },
        |_| {},
    );
    // A VM that arrived keeps its stream for the guest's report; the source needs no more.
    let _ = closer.shutdown(std::net::Shutdown::Both);
    peer.join().expect("the source's thread");
    built.check(&result, "live update");
    result.map(|_| ()).map_err(|e| e.to_string())
}

/// Sends `stream` on `socket`, passing `files` right after its first `Files` frame, then
/// reads what comes back until the destination hangs up (`hung_up`).
fn feed(
    socket: UnixStream,
    stream: Vec<u8>,
    files: Vec<OwnedFd>,
    hung_up: Arc<AtomicBool>,
) -> std::thread::JoinHandle<()> {
    let wait = Some(std::time::Duration::from_secs(5));
    socket.set_read_timeout(wait).unwrap();
    socket.set_write_timeout(wait).unwrap();
    let mut reader = socket.try_clone().unwrap();
    let writer = std::thread::spawn(move || {
        let at = end_of_files(&stream).unwrap_or(stream.len());
        let mut out = Stream::Unix(socket);
        let raw: Vec<RawFd> = files.iter().map(AsRawFd::as_raw_fd).collect();
        let sent = out.write_all(&stream[..at]).is_ok()
            && (at == stream.len() || raw.is_empty() || out.send_files(&raw).is_ok())
            && out.write_all(&stream[at..]).is_ok();
        let _ = sent;
        // Half-closed: the reader below keeps its side, so it sees the end only when the
        // destination hangs up (a whole shutdown would end it at once and stop the receive
        // before the destination had read anything).
        if let Stream::Unix(s) = &out {
            let _ = s.shutdown(std::net::Shutdown::Write);
        }
    });
    std::thread::spawn(move || {
        let mut sink = [0u8; 16 * 1024];
        while matches!(reader.read(&mut sink), Ok(n) if n > 0) {}
        hung_up.store(true, Ordering::Release);
        writer.join().expect("the writer");
    })
}

/// What the destination was handed, checked against what ferry's VMM accepts: a memory file
/// it takes is a memfd of its range's size with ferry's seals.
fn check_handed(d: &VmDescriptor, handed: Option<&HandedFiles>) -> migration::Result<()> {
    let Some(handed) = handed else {
        return Ok(());
    };
    assert_eq!(
        handed.memory.len(),
        d.ranges.len(),
        "a memory file per range"
    );
    for (fd, range) in handed.memory.iter().zip(&d.ranges) {
        let file = std::fs::File::from(fd.try_clone().unwrap());
        vmm::memory::check_passed_memfd(&file, range.len).map_err(migration::Error::vm)?;
        // SAFETY: F_GET_SEALS only reads the seals of a descriptor this process holds.
        let seals = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) };
        assert!(
            seals & libc::F_SEAL_SEAL != 0,
            "an accepted memfd is sealed"
        );
        assert_eq!(file.metadata().unwrap().len(), range.len);
    }
    Ok(())
}

/// Where the first `Files` frame of `stream` ends.
fn end_of_files(stream: &[u8]) -> Option<usize> {
    let mut at = STREAM_HEADER_LEN;
    while let Some(header) = stream.get(at..at + FRAME_HEADER_LEN) {
        let len = u32::from_le_bytes(header[4..8].try_into().unwrap()) as usize;
        let end = at.checked_add(FRAME_HEADER_LEN + len + 4)?;
        let frame = stream.get(at..end)?;
        if header[0] == KIND_CONTROL
            && matches!(
                wire::read_message(&mut &frame[..]),
                Ok(Message::Files { .. })
            )
        {
            return Some(end);
        }
        at = end;
    }
    None
}

/// The sizes of the RAM ranges the stream's `Hello` names (none if it names none).
fn range_sizes(stream: &[u8]) -> Vec<u64> {
    let mut r = stream;
    if wire::read_stream_header(&mut r).is_err() {
        return Vec::new();
    }
    match wire::read_message(&mut r) {
        Ok(Message::Hello { vm, .. }) => vm.ranges.iter().map(|r| r.len).collect(),
        _ => Vec::new(),
    }
}

/// A seed: `kinds` passed after a `Files` for `PlainVm::small`, then `tail`.
pub fn local_seed(kinds: &[u8], tail: &[u8]) -> Vec<u8> {
    use migration::Migratable;
    let vm = PlainVm::small().descriptor();
    let mut out = vec![kinds.len() as u8];
    out.extend_from_slice(kinds);
    wire::frame::write_stream_header_as(&mut out, wire::frame::LOCAL_SINCE).unwrap();
    let files = Message::Files {
        memory: vm.ranges.len() as u32,
        devices: vec![false; vm.devices.len()],
    };
    let hello = Message::Hello {
        vm,
        mode: wire::StreamMode::Local,
        source: "ferry fuzz".into(),
        connections: 1,
        session: 0,
    };
    wire::write_message(&mut out, &hello).unwrap();
    wire::write_message(&mut out, &files).unwrap();
    out.extend_from_slice(tail);
    out
}

#[cfg(test)]
mod tests {
    /// The harness reaches the check: ferry's own files get past it, others are refused by it.
    #[test]
    fn the_files_ferry_passes_are_taken_and_others_refused() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("corpus/local_destination");
        let outcome = |seed: &str| super::receive_update(&std::fs::read(dir.join(seed)).unwrap());
        for taken in ["sealed.ferry", "sealed-shut.ferry"] {
            assert_eq!(outcome(taken), Ok(()), "{taken}");
        }
        let unsealed = outcome("unsealed.ferry").unwrap_err();
        assert!(unsealed.contains("seals 0x0"), "{unsealed}");
        let short = outcome("short-pipe-socket.ferry").unwrap_err();
        assert!(
            short.contains("source passed 3 files where it announced 2"),
            "{short}"
        );
    }
}
