//! What each fuzz target does with its input. It lives here, not in the targets, so that
//! `cargo test` (on stable, without a fuzzer) replays the committed corpus through exactly the
//! code the fuzzer runs.
//!
//! - `stream`: a migration stream as the destination's readers see it: the stream header,
//!   then frames; control frames are decoded, page frames are read by both page readers
//!   (pre-copy's `PageReceiver` into guest memory, post-copy's `read_page_frame` into a buffer)
//!   and the two must agree (but for what post-copy alone refuses: deltas, and pages that do
//!   not match their CRC, which pre-copy keeps as suspect).
//! - `snapshot`: a whole restore (`Incoming::receive` of a snapshot file) into a VM of plain
//!   memory: a refused file must never resume the VM.
//! - `api`: one HTTP request on the API socket, up to the typed request a handler gets.
//! - `live_destination`: a live migration's conversation on the destination, from what the
//!   source sends on its connections (`live`): a refused stream must never resume the VM.
//! - `resume`: a pre-copy carried on over a new connection after its first one broke, from
//!   what the new connection sends after its `ResumePrecopy` (`live`).
//! - `local_destination`: a live update's destination taking the files its source passes
//!   (`local`): only a memfd of the right size with ferry's seals is taken as guest memory.
//! - `source`: a migration's source hearing a hostile destination's answers (`source`): it
//!   never panics, an error says what went wrong, and without `Go` the VM runs here again.
//! - `vm_state`: the vCPU and device state a KVM destination loads (`state`).
//! - `ch_request`: one HTTP request on the Cloud Hypervisor profile's socket, up to the typed
//!   request its VMM gets.
//! - `scrape`: one HTTP request on the metrics endpoint, up to the scrape it asks for.
//! - `virtio_queues`: a guest that programs a balloon or a disk any way it likes (`queues`).
//!
//! Every frame of a stream carries a CRC, so a mutated input would almost always stop at the
//! first checksum. The stream and snapshot targets therefore rewrite each frame's trailer to
//! the right CRC before parsing (`with_valid_checksums`); the fuzzer then reaches what lies
//! behind the checksum, which is what a hostile peer (who can compute a CRC) reaches too; so do
//! the `live_destination` and `source` targets, on each connection's frames.

mod live;
mod local;
mod plain_vm;
mod queues;
mod source;
mod state;

use std::io::{Seek, Write};
use std::os::fd::FromRawFd;
use std::sync::{Arc, Mutex};

use migration::destination::Source;
use migration::io::lanefile::{LANES_MAGIC, SnapshotFile};
use migration::io::transport::Stream;
use migration::pages::PageReceiver;
use migration::wire::frame::{KIND_PAGES, PAGE_DATA_UNCHECKED, STREAM_HEADER_LEN};
use migration::wire::page_frame::{FrameBuffers, read_page_frame};
use migration::wire::{self, Frame, Message};
use migration::{HandedFiles, Incoming, Migratable, PAGE_SIZE, StatusBoard, VmDescriptor};

pub use live::{LANE_MARK, RESUME_MARK, live_destination, resume};
pub use local::{local_destination, local_seed};
pub use plain_vm::{PlainVm, seed_disk};
pub use queues::virtio_queues;
pub use source::{params_from, source};
pub use state::vm_state;

/// Frames read from one input, at most (a corpus entry of many tiny frames stays fast).
const MAX_FRAMES: usize = 4096;

/// `data` with every frame's CRC trailer set to what the reader computes (see
/// `repair_frames`): a stream, its frames after the stream header. A snapshot of several
/// writers holds its frames in chunks: it is left as it is.
pub fn with_valid_checksums(data: &[u8]) -> Vec<u8> {
    let mut out = data.to_vec();
    if !out.starts_with(LANES_MAGIC) {
        repair_frames(&mut out, STREAM_HEADER_LEN);
    }
    out
}

/// Sets the CRC trailer of every frame that starts at `at` or after it, one after the other, to
/// what the reader computes: over the 8 header bytes and the payload, or, for a page frame
/// flagged `PAGE_DATA_UNCHECKED`, over the header, the count, the descriptors and the page CRCs
/// that follow them. Bytes past the last whole frame are kept as they are.
pub fn repair_frames(out: &mut [u8], mut at: usize) {
    while let Some(header) = out.get(at..at + 8) {
        let len = u32::from_le_bytes(header[4..8].try_into().unwrap()) as usize;
        let end = at + 8 + len;
        if end + 4 > out.len() {
            break;
        }
        let mut covered = end;
        if header[0] == KIND_PAGES && header[1] & PAGE_DATA_UNCHECKED != 0 && len >= 8 {
            let count = u32::from_le_bytes(out[at + 8..at + 12].try_into().unwrap()) as usize;
            let descs = out[at + 16..end].chunks_exact(8).take(count);
            // Full pages (encoding 0) carry a CRC each.
            let full = descs.filter(|d| d[0] == 0).count();
            covered = end.min(at + 16 + 8 * count + 4 * full);
        }
        let crc = crc32fast::hash(&out[at..covered]);
        out[end..end + 4].copy_from_slice(&crc.to_le_bytes());
        at = end + 4;
    }
}

pub fn stream(data: &[u8]) {
    let bytes = with_valid_checksums(data);
    let vm = PlainVm::small();
    let ram = vm.ram();
    let mut r = &bytes[..];
    if wire::read_stream_header(&mut r).is_err() {
        return;
    }
    let mut receiver = PageReceiver::new(&ram);
    let mut scratch = FrameBuffers::default();
    for _ in 0..MAX_FRAMES {
        match wire::read_frame(&mut r) {
            Ok(Frame::Message(m)) => {
                // What decodes re-encodes to itself (no field lost or invented on the way).
                let once = m.encode();
                let again = Message::decode(&once).expect("a decoded message decodes again");
                assert_eq!(again.encode(), once, "{m:?} re-encodes differently");
            }
            Ok(Frame::Pages { header, len }) => {
                // Post-copy's reader takes the same bytes (a slice reader is a cheap copy).
                let mut copy = r;
                let postcopy =
                    read_page_frame(&mut copy, &ram, &header, len, &mut scratch).map(|pages| {
                        pages
                            .into_iter()
                            .map(|(pfn, data)| (pfn, data.map(<[u8]>::to_vec)))
                            .collect::<Vec<_>>()
                    });
                // `r` now starts at the frame's payload.
                let frame_pages = full_pages_named(r, &ram);
                let precopy = receiver.receive(&mut r, &ram, &header, len);
                match (precopy, postcopy) {
                    (Ok(()), Ok(pages)) => {
                        for (pfn, data) in pages {
                            let want = data.unwrap_or_else(|| vec![0; PAGE_SIZE]);
                            assert!(
                                ram.page(pfn).unwrap() == want,
                                "page {pfn:#x}: the two readers disagree"
                            );
                            // Every page matched its CRC (post-copy checked them): none suspect.
                            assert!(!receiver.suspect().get(pfn), "page {pfn:#x} suspect");
                        }
                    }
                    // Post-copy refuses deltas, which pre-copy applies, and a page that does not
                    // match its CRC, which pre-copy keeps as suspect (a later copy may mend it):
                    // then one of this frame's pages is suspect.
                    (Ok(()), Err(e)) => {
                        let why = e.to_string();
                        let flagged = frame_pages.iter().any(|&p| receiver.suspect().get(p));
                        assert!(
                            why.contains("delta") || (why.contains("corrupt") && flagged),
                            "only post-copy refused: {e}"
                        )
                    }
                    (Err(e), Ok(_)) => assert!(
                        e.to_string().contains("delta"),
                        "only pre-copy refused a frame without deltas: {e}"
                    ),
                    (Err(_), Err(_)) => return,
                }
            }
            Err(_) => return,
        }
    }
}

pub fn snapshot(data: &[u8]) {
    let bytes = with_valid_checksums(data);
    // A file written by several writers whose header is refused is refused before any VM.
    let Ok(file) = SnapshotFile::open(memfd_with(&bytes)) else {
        return;
    };
    let built = Built::default();
    let result = Incoming::new(StatusBoard::default(), None).receive(
        Source::Snapshot(Stream::File(file)),
        &|| false,
        built.builder(),
        |_| {},
    );
    assert!(
        !matches!(result, Ok(None)),
        "a snapshot restore ended without a VM and without an error"
    );
    built.check(&result, "snapshot");
}

/// The VM a receive built (if it got that far), kept to look at once the receive ended.
#[derive(Default)]
struct Built(Arc<Mutex<Option<Arc<PlainVm>>>>);

impl Built {
    /// What `Incoming::receive` calls to build the VM a stream describes.
    fn builder(
        &self,
    ) -> impl FnOnce(&VmDescriptor, Option<HandedFiles>) -> migration::Result<Arc<PlainVm>> + use<>
    {
        let keep = self.0.clone();
        move |descriptor, _| {
            let vm = Arc::new(PlainVm::build(descriptor)?);
            *keep.lock().unwrap() = Some(vm.clone());
            Ok(vm)
        }
    }

    /// A VM that arrived is the one built; one refused (`what`: the kind of stream) never ran.
    fn check(&self, result: &migration::Result<Option<Arc<PlainVm>>>, what: &str) {
        let vm = self.0.lock().unwrap().take();
        match result {
            Ok(Some(arrived)) => assert!(vm.is_some_and(|vm| Arc::ptr_eq(&vm, arrived))),
            Ok(None) => {}
            Err(e) => {
                assert!(!e.to_string().is_empty(), "an error that says nothing");
                if let Some(vm) = vm {
                    assert!(!vm.ever_resumed(), "a refused {what} resumed its VM: {e}");
                }
            }
        }
    }
}

pub fn api(data: &[u8]) {
    if let Err(e) = api::server::parse_request(&mut &data[..]) {
        assert!((400..600).contains(&e.status), "status {}", e.status);
        assert!(!e.message.is_empty(), "an error that says nothing");
    }
}

pub fn ch_request(data: &[u8]) {
    if let Err(e) = api::server::parse_ch_request(&mut &data[..]) {
        assert!((400..600).contains(&e.status), "status {}", e.status);
        assert!(!e.message.is_empty(), "an error that says nothing");
    }
}

pub fn scrape(data: &[u8]) {
    const TOKEN: &str = "fuzz-token";
    match api::scrape::read_scrape(&mut &data[..]) {
        Ok(s) => assert!(
            !s.carries(TOKEN) || data.windows(TOKEN.len()).any(|w| w == TOKEN.as_bytes()),
            "a scrape carries a token it never sent"
        ),
        Err(e) => {
            assert!((400..600).contains(&e.status), "status {}", e.status);
            assert!(!e.message.is_empty(), "an error that says nothing");
        }
    }
}

/// The pages a page frame's payload names as full (encoding 0), as far as they lie in RAM.
fn full_pages_named(payload: &[u8], ram: &migration::GuestRam) -> Vec<u64> {
    let Some(count) = payload.get(..4) else {
        return Vec::new();
    };
    let count = u32::from_le_bytes(count.try_into().unwrap()) as usize;
    payload
        .get(8..)
        .unwrap_or_default()
        .chunks_exact(8)
        .take(count)
        .map(|d| u64::from_le_bytes(d.try_into().unwrap()))
        .filter(|d| d & 0xff == 0 && ram.contains(d >> 8))
        .map(|d| d >> 8)
        .collect()
}

/// An anonymous in-memory file holding `bytes`, read from its start.
pub(crate) fn memfd_with(bytes: &[u8]) -> std::fs::File {
    // SAFETY: a plain syscall with a NUL-terminated name; the fd is checked before use.
    let fd = unsafe { libc::memfd_create(c"fuzz-snapshot".as_ptr(), libc::MFD_CLOEXEC) };
    assert!(fd >= 0, "memfd_create: {}", std::io::Error::last_os_error());
    // SAFETY: a fresh fd that nothing else owns.
    let mut file = unsafe { std::fs::File::from_raw_fd(fd) };
    file.write_all(bytes).unwrap();
    file.rewind().unwrap();
    file
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    /// Every committed corpus entry of `target` runs through its harness without a finding.
    fn replay(target: &str, run: fn(&[u8])) {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("corpus")
            .join(target);
        let mut n = 0;
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            run(&std::fs::read(&path).unwrap());
            n += 1;
        }
        assert!(n >= 3, "{}: {n} corpus entries", dir.display());
    }

    #[test]
    fn stream_corpus() {
        replay("stream", super::stream);
    }

    #[test]
    fn snapshot_corpus() {
        replay("snapshot", super::snapshot);
    }

    #[test]
    fn api_corpus() {
        replay("api", super::api);
    }

    #[test]
    fn live_destination_corpus() {
        replay("live_destination", super::live_destination);
    }

    #[test]
    fn local_destination_corpus() {
        replay("local_destination", super::local_destination);
    }

    #[test]
    fn resume_corpus() {
        replay("resume", super::resume);
    }

    #[test]
    fn source_corpus() {
        replay("source", super::source);
    }

    #[test]
    fn vm_state_corpus() {
        replay("vm_state", super::vm_state);
    }

    #[test]
    fn ch_request_corpus() {
        replay("ch_request", super::ch_request);
    }

    #[test]
    fn scrape_corpus() {
        replay("scrape", super::scrape);
    }

    #[test]
    fn virtio_queues_corpus() {
        replay("virtio_queues", super::virtio_queues);
    }

    #[test]
    fn checksums_are_repaired() {
        let seed = std::fs::read(
            Path::new(env!("CARGO_MANIFEST_DIR")).join("corpus/snapshot/plain.ferry"),
        )
        .unwrap();
        let mut broken = seed.clone();
        let last = broken.len() - 1;
        broken[last] ^= 0xff;
        assert_eq!(super::with_valid_checksums(&broken), seed);
    }
}
