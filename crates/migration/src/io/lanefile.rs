//! Snapshot files, and a snapshot written by several threads at once (`writers > 1`).
//!
//! With one writer a snapshot file is the migration stream, byte for byte. With N writers it
//! holds N streams ("lanes", exactly what N connections of a migration carry), each cut into
//! chunks that lie in the file in the order their writer finished them. A writer takes the
//! next place in the file with one atomic add and writes there (`pwritev`), so writers never
//! wait for one another; a reader of lane k reads the chunk headers in order and skips the
//! other lanes' chunks. One file rather than a file per writer: a snapshot stays one thing to
//! copy, move or delete (QEMU's multifd file migration also writes all channels into one file).
//!
//! Layout: `FERRYLNS`, lanes u32, 0 u32; then chunks, each: lane u32, length u32, that many
//! bytes of the lane's stream (little-endian).

use std::fs::File;
use std::io::{self, IoSlice, Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

pub const LANES_MAGIC: &[u8; 8] = b"FERRYLNS";
const FILE_HEADER_LEN: u64 = 16;
const CHUNK_HEADER_LEN: u64 = 8;
/// Small writes (messages, compressed frames) are gathered into chunks of about this size; a
/// write of a quarter of it or more goes out as a chunk of its own, straight from the
/// caller's buffers (a plain page frame is written from guest memory, not copied first).
const CHUNK_BYTES: usize = 1 << 20;
/// A longer chunk is taken for a corrupt file, not read into memory.
const MAX_CHUNK_BYTES: usize = 64 << 20;
/// Most buffers one `pwritev` takes (Linux's IOV_MAX).
const MAX_IOVECS: usize = 1024;

/// A snapshot file as one stream of a migration: the whole file (one writer), or one lane of
/// a file written by several.
pub enum SnapshotFile {
    Plain(File),
    Writer(LaneWriter),
    Reader(LaneReader),
    /// A second handle on a lane, for what a connection's second handle does (timeouts,
    /// shutdown: nothing, for a file). A lane has one position, so this one cannot read or
    /// write.
    Handle,
}

impl SnapshotFile {
    /// Opens a snapshot for reading: a file written by several writers is read from lane 0 (the
    /// others through `lane`).
    pub fn open(mut file: File) -> io::Result<Self> {
        let mut magic = [0u8; 8];
        let n = file.read_at(&mut magic, 0)?;
        if n == magic.len() && &magic == LANES_MAGIC {
            return LaneReader::open(file).map(SnapshotFile::Reader);
        }
        // Anything else is read as one stream (whose own header says what is wrong with it).
        io::Seek::rewind(&mut file)?;
        Ok(SnapshotFile::Plain(file))
    }

    pub fn try_clone(&self) -> io::Result<Self> {
        Ok(match self {
            SnapshotFile::Plain(f) => SnapshotFile::Plain(f.try_clone()?),
            _ => SnapshotFile::Handle,
        })
    }

    /// Flushes what this handle gathered and makes the whole file durable.
    pub fn sync_all(&mut self) -> io::Result<()> {
        match self {
            SnapshotFile::Plain(f) => f.sync_all(),
            SnapshotFile::Writer(w) => {
                w.flush()?;
                w.shared.file.sync_all()
            }
            SnapshotFile::Reader(_) | SnapshotFile::Handle => Ok(()),
        }
    }

    /// Lane `lane` of the same file, for its own reader or writer; None for a file of one
    /// stream.
    pub fn lane(&self, lane: u32) -> Option<Self> {
        match self {
            SnapshotFile::Writer(w) => Some(SnapshotFile::Writer(w.lane(lane))),
            SnapshotFile::Reader(r) => Some(SnapshotFile::Reader(r.lane(lane))),
            SnapshotFile::Plain(_) | SnapshotFile::Handle => None,
        }
    }

    /// How many lanes the file holds (1: one stream).
    pub fn lanes(&self) -> u32 {
        match self {
            SnapshotFile::Writer(w) => w.shared.lanes,
            SnapshotFile::Reader(r) => r.lanes,
            SnapshotFile::Plain(_) | SnapshotFile::Handle => 1,
        }
    }
}

fn no_io() -> io::Error {
    io::Error::other("a second handle on a snapshot lane cannot read or write")
}

impl Read for SnapshotFile {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            SnapshotFile::Plain(f) => f.read(buf),
            SnapshotFile::Reader(r) => r.read(buf),
            SnapshotFile::Writer(_) | SnapshotFile::Handle => Err(no_io()),
        }
    }
    fn read_vectored(&mut self, bufs: &mut [io::IoSliceMut<'_>]) -> io::Result<usize> {
        match self {
            SnapshotFile::Plain(f) => f.read_vectored(bufs),
            SnapshotFile::Reader(r) => r.read_vectored(bufs),
            SnapshotFile::Writer(_) | SnapshotFile::Handle => Err(no_io()),
        }
    }
}

impl Write for SnapshotFile {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            SnapshotFile::Plain(f) => f.write(buf),
            SnapshotFile::Writer(w) => w.write(buf),
            SnapshotFile::Reader(_) | SnapshotFile::Handle => Err(no_io()),
        }
    }
    fn write_vectored(&mut self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        match self {
            SnapshotFile::Plain(f) => f.write_vectored(bufs),
            SnapshotFile::Writer(w) => w.write_vectored(bufs),
            SnapshotFile::Reader(_) | SnapshotFile::Handle => Err(no_io()),
        }
    }
    fn flush(&mut self) -> io::Result<()> {
        match self {
            SnapshotFile::Plain(f) => f.flush(),
            SnapshotFile::Writer(w) => w.flush(),
            SnapshotFile::Reader(_) | SnapshotFile::Handle => Ok(()),
        }
    }
}

struct Shared {
    file: File,
    lanes: u32,
    /// Where the next chunk goes.
    end: AtomicU64,
}

/// One lane's writer: gathers small writes into a chunk and writes each chunk at the next free
/// place of the file. `flush` writes out what is gathered (the lane's end must be flushed).
pub struct LaneWriter {
    shared: Arc<Shared>,
    lane: u32,
    gathered: Vec<u8>,
}

impl LaneWriter {
    /// Lays `file` out for `lanes` writers; returns lane 0's.
    pub fn create(file: File, lanes: u32) -> io::Result<Self> {
        let mut header = [0u8; FILE_HEADER_LEN as usize];
        header[..8].copy_from_slice(LANES_MAGIC);
        header[8..12].copy_from_slice(&lanes.to_le_bytes());
        file.write_all_at(&header, 0)?;
        Ok(Self {
            shared: Arc::new(Shared {
                file,
                lanes,
                end: AtomicU64::new(FILE_HEADER_LEN),
            }),
            lane: 0,
            gathered: Vec::new(),
        })
    }

    pub fn lane(&self, lane: u32) -> Self {
        Self {
            shared: self.shared.clone(),
            lane,
            gathered: Vec::new(),
        }
    }

    /// Writes `parts` as one chunk of this lane.
    fn write_chunk(&self, parts: &[IoSlice<'_>]) -> io::Result<()> {
        let len: usize = parts.iter().map(|p| p.len()).sum();
        debug_assert!(len > 0 && len <= MAX_CHUNK_BYTES);
        let mut header = [0u8; CHUNK_HEADER_LEN as usize];
        header[..4].copy_from_slice(&self.lane.to_le_bytes());
        header[4..].copy_from_slice(&(len as u32).to_le_bytes());
        let at = self
            .shared
            .end
            .fetch_add(CHUNK_HEADER_LEN + len as u64, Ordering::Relaxed);
        let mut all = Vec::with_capacity(parts.len() + 1);
        all.push(IoSlice::new(&header));
        all.extend_from_slice(parts);
        write_all_at(&self.shared.file, at, &mut all)
    }

    fn write_gathered(&mut self) -> io::Result<()> {
        if self.gathered.is_empty() {
            return Ok(());
        }
        let result = self.write_chunk(&[IoSlice::new(&self.gathered)]);
        self.gathered.clear();
        result
    }
}

impl Write for LaneWriter {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.write_vectored(&[IoSlice::new(buf)])
    }

    fn write_vectored(&mut self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        let total: usize = bufs.iter().map(|b| b.len()).sum();
        if total == 0 {
            return Ok(0);
        }
        if total > MAX_CHUNK_BYTES {
            // Rare (no frame is this long): the first buffer, cut to a chunk, then the rest.
            let first = bufs.iter().find(|b| !b.is_empty()).expect("total > 0");
            let n = first.len().min(MAX_CHUNK_BYTES);
            self.write_gathered()?;
            self.write_chunk(&[IoSlice::new(&first[..n])])?;
            return Ok(n);
        }
        if total >= CHUNK_BYTES / 4 {
            // The lane's bytes stay in order: what was gathered goes first.
            self.write_gathered()?;
            self.write_chunk(bufs)?;
        } else {
            for b in bufs {
                self.gathered.extend_from_slice(b);
            }
            if self.gathered.len() >= CHUNK_BYTES {
                self.write_gathered()?;
            }
        }
        Ok(total)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.write_gathered()
    }
}

/// Writes every byte of `parts` at `at`.
fn write_all_at(file: &File, mut at: u64, mut parts: &mut [IoSlice<'_>]) -> io::Result<()> {
    while !parts.is_empty() {
        let count = parts.len().min(MAX_IOVECS);
        // SAFETY: IoSlice has iovec's layout (std guarantees it on Unix); the kernel only
        // reads `count` of them, each valid for its length.
        let n = unsafe {
            libc::pwritev(
                file.as_raw_fd(),
                parts.as_ptr().cast(),
                count as libc::c_int,
                at as libc::off_t,
            )
        };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if n == 0 {
            return Err(io::ErrorKind::WriteZero.into());
        }
        at += n as u64;
        IoSlice::advance_slices(&mut parts, n as usize);
    }
    Ok(())
}

/// One lane's reader: the lane's chunks, in file order, as one stream.
pub struct LaneReader {
    file: Arc<File>,
    lanes: u32,
    lane: u32,
    /// The next chunk header to look at.
    next: u64,
    /// Where the current chunk's unread bytes are, and how many.
    at: u64,
    left: u64,
}

impl LaneReader {
    /// `file` starts with `LANES_MAGIC`; returns lane 0's reader.
    fn open(file: File) -> io::Result<Self> {
        let mut header = [0u8; FILE_HEADER_LEN as usize];
        file.read_exact_at(&mut header, 0).map_err(|_| {
            corrupt("the snapshot file ends inside its header (written by several writers)")
        })?;
        let lanes = u32::from_le_bytes(header[8..12].try_into().unwrap());
        if header[12..] != [0; 4] {
            return Err(corrupt(
                "the snapshot file's header has bytes 12..16 set (a later format?)",
            ));
        }
        let most = crate::wire::lanes::MAX_CONNECTIONS;
        if !(2..=most).contains(&lanes) {
            return Err(corrupt(format!(
                "the snapshot file says it has {lanes} writers (2..={most} can write one)"
            )));
        }
        Ok(Self {
            file: Arc::new(file),
            lanes,
            lane: 0,
            next: FILE_HEADER_LEN,
            at: 0,
            left: 0,
        })
    }

    pub fn lane(&self, lane: u32) -> Self {
        Self {
            file: self.file.clone(),
            lanes: self.lanes,
            lane,
            next: FILE_HEADER_LEN,
            at: 0,
            left: 0,
        }
    }

    /// Moves to this lane's next chunk; false at the end of the file.
    fn next_chunk(&mut self) -> io::Result<bool> {
        loop {
            let mut header = [0u8; CHUNK_HEADER_LEN as usize];
            let mut got = 0;
            while got < header.len() {
                match self
                    .file
                    .read_at(&mut header[got..], self.next + got as u64)?
                {
                    0 if got == 0 => return Ok(false),
                    0 => {
                        return Err(corrupt(format!(
                            "the snapshot file ends inside a chunk header at offset {}",
                            self.next
                        )));
                    }
                    n => got += n,
                }
            }
            let lane = u32::from_le_bytes(header[..4].try_into().unwrap());
            let len = u32::from_le_bytes(header[4..].try_into().unwrap());
            if lane >= self.lanes || len == 0 || len as usize > MAX_CHUNK_BYTES {
                return Err(corrupt(format!(
                    "the chunk at offset {} of the snapshot file names writer {lane} of {} and \
                     {len} bytes (1..={MAX_CHUNK_BYTES})",
                    self.next, self.lanes
                )));
            }
            let data = self.next + CHUNK_HEADER_LEN;
            self.next = data + u64::from(len);
            if lane == self.lane {
                (self.at, self.left) = (data, u64::from(len));
                return Ok(true);
            }
        }
    }
}

fn corrupt(why: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, why.into())
}

impl Read for LaneReader {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if buf.is_empty() {
            return Ok(0);
        }
        if self.left == 0 && !self.next_chunk()? {
            return Ok(0);
        }
        let want = buf.len().min(self.left as usize);
        // 0 here: the file ends inside the chunk; the stream's reader names what was cut.
        let n = self.file.read_at(&mut buf[..want], self.at)?;
        self.at += n as u64;
        self.left -= n as u64;
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp_file(name: &str) -> (std::path::PathBuf, File) {
        let path =
            std::env::temp_dir().join(format!("ferry-lanefile-{}-{name}", std::process::id()));
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&path)
            .unwrap();
        (path, file)
    }

    fn read_lane(file: &SnapshotFile, lane: u32) -> io::Result<Vec<u8>> {
        let mut r = file.lane(lane).unwrap();
        let mut out = Vec::new();
        r.read_to_end(&mut out)?;
        Ok(out)
    }

    /// Lane `lane`'s bytes: small and large writes, so both gathered and direct chunks occur.
    fn lane_bytes(lane: u32) -> Vec<Vec<u8>> {
        (0..40u32)
            .map(|i| {
                let len = if i % 7 == 3 {
                    300_000 + i as usize
                } else {
                    100 + i as usize * 997
                };
                (0..len)
                    .map(|b| (b as u32 ^ i ^ (lane << 4)) as u8)
                    .collect()
            })
            .collect()
    }

    #[test]
    fn every_lane_reads_back_what_its_writer_wrote_while_all_wrote_at_once() {
        let (path, file) = temp_file("roundtrip");
        let lanes = 4;
        let first = LaneWriter::create(file, lanes).unwrap();
        std::thread::scope(|s| {
            for lane in 0..lanes {
                let mut w = first.lane(lane);
                s.spawn(move || {
                    for (i, part) in lane_bytes(lane).iter().enumerate() {
                        if i % 2 == 0 {
                            w.write_all(part).unwrap();
                        } else {
                            let (a, b) = part.split_at(part.len() / 3);
                            let mut parts = [IoSlice::new(a), IoSlice::new(b)];
                            crate::wire::frame::write_all_vectored(&mut w, &mut parts).unwrap();
                        }
                    }
                    w.flush().unwrap();
                });
            }
        });
        drop(first);
        let reader = SnapshotFile::open(File::open(&path).unwrap()).unwrap();
        assert_eq!(reader.lanes(), lanes);
        for lane in 0..lanes {
            assert_eq!(read_lane(&reader, lane).unwrap(), lane_bytes(lane).concat());
        }
        let _ = std::fs::remove_file(path);
    }

    #[test]
    fn a_file_of_one_stream_is_read_as_it_is() {
        let (path, mut file) = temp_file("plain");
        file.write_all(b"FERRYMIG and the rest").unwrap();
        let mut f = SnapshotFile::open(File::open(&path).unwrap()).unwrap();
        assert!(matches!(f, SnapshotFile::Plain(_)));
        let mut all = String::new();
        f.read_to_string(&mut all).unwrap();
        assert_eq!(all, "FERRYMIG and the rest");
        let _ = std::fs::remove_file(path);
    }

    #[test]
    fn corrupt_and_cut_files_are_refused_with_the_reason() {
        let (path, file) = temp_file("corrupt");
        let mut w = LaneWriter::create(file, 2).unwrap();
        w.write_all(&[7u8; 1000]).unwrap();
        w.flush().unwrap();
        let mut other = w.lane(1);
        other.write_all(&[9u8; 500]).unwrap();
        other.flush().unwrap();
        let f = || SnapshotFile::open(File::open(&path).unwrap());
        assert_eq!(read_lane(&f().unwrap(), 1).unwrap(), vec![9u8; 500]);

        // A chunk naming a writer the file does not have.
        let raw = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
        raw.write_all_at(&5u32.to_le_bytes(), FILE_HEADER_LEN)
            .unwrap();
        let e = read_lane(&f().unwrap(), 1).unwrap_err();
        assert!(e.to_string().contains("names writer 5 of 2"), "{e}");
        raw.write_all_at(&0u32.to_le_bytes(), FILE_HEADER_LEN)
            .unwrap();

        // Cut inside lane 1's chunk: its reader sees the end early (and the stream's reader
        // names what was cut); cut inside a header: named here.
        let full = std::fs::metadata(&path).unwrap().len();
        raw.set_len(full - 100).unwrap();
        assert_eq!(read_lane(&f().unwrap(), 1).unwrap().len(), 400);
        raw.set_len(FILE_HEADER_LEN + CHUNK_HEADER_LEN + 1000 + 3)
            .unwrap();
        let e = read_lane(&f().unwrap(), 1).unwrap_err();
        assert!(e.to_string().contains("ends inside a chunk header"), "{e}");

        // A header that claims one writer.
        raw.write_all_at(&1u32.to_le_bytes(), 8).unwrap();
        let e = f().err().expect("refused");
        assert!(e.to_string().contains("1 writers"), "{e}");
        let _ = std::fs::remove_file(path);
    }
}
