//! Framing (documented in docs/protocol.md): the stream header, frames with their CRC, and
//! page descriptors. What a control frame carries is `message`.
//!
//! Stream: a 16-byte header (`FERRYMIG`, version u32 LE, reserved u32), then frames.
//! Frame: kind u8 | flags u8 | reserved u16 | length u32 | payload | crc32 u32 (LE).
//! The CRC covers the 8 header bytes and the payload, except that a page frame sent from a
//! running guest (flag `PAGE_DATA_UNCHECKED`) covers only its descriptors and the CRC each page
//! carries: the guest may change a page while it is on its way, and such a page is dirty and
//! sent again; a page that matches its CRC on no copy was corrupted.

use std::io::{IoSlice, Read, Write};

use crate::error::{Error, Result};
use crate::wire::codec::Codec;
use crate::wire::message::Message;

pub const MAGIC: &[u8; 8] = b"FERRYMIG";
/// Moves with every change of the bytes on the wire (docs/protocol.md keeps the changelog).
pub const VERSION: u32 = 17;
/// The oldest stream version this ferry still reads: a source writes the oldest version that
/// carries everything its stream will hold, so that builds of different versions can still
/// hand a VM over (live update both ways) while the messages that stream uses keep their bytes.
pub const OLDEST_READ: u32 = 10;
/// The version a live update's stream is written as (`StreamMode::Local` and `Files` came in
/// it; what that stream sends has kept its bytes since).
pub const LOCAL_SINCE: u32 = 10;
/// The first version whose streams carry `Config` after `Hello` (and `Files`).
pub const CONFIG_SINCE: u32 = 14;
/// The first version whose streams carry `Storage` after `Config`, and disk blocks.
pub const STORAGE_SINCE: u32 = 15;
/// The first version whose destinations say in `Ready` which host they run on.
pub const HOST_SINCE: u32 = 16;
pub const STREAM_HEADER_LEN: usize = 16;
pub const FRAME_HEADER_LEN: usize = 8;

pub const KIND_CONTROL: u8 = 1;
pub const KIND_PAGES: u8 = 2;
pub const PAGE_DATA_UNCHECKED: u8 = 1;

/// Control frames are small; a larger length means a corrupt or foreign stream.
pub const MAX_CONTROL_LEN: u32 = 64 << 20;
/// Pages per page frame, at most.
pub const MAX_BATCH_PAGES: u32 = 1024;

/// How a page travels in a page frame (low 8 bits of its descriptor).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum PageEncoding {
    /// 4096 bytes follow in the frame's data.
    Full = 0,
    /// The page is all zeros; no data.
    Zero = 1,
    /// The page changed little since it was last sent on this connection: `len u16` and
    /// that many bytes of delta (see `wire::delta`) follow in the frame's data.
    Delta = 2,
}

impl PageEncoding {
    pub fn from_u8(v: u8) -> Result<Self> {
        match v {
            0 => Ok(Self::Full),
            1 => Ok(Self::Zero),
            2 => Ok(Self::Delta),
            other => Err(Error::Protocol(format!("unknown page encoding {other}"))),
        }
    }
}

/// A page descriptor: page frame number << 8 | encoding.
pub fn descriptor(pfn: u64, enc: PageEncoding) -> u64 {
    (pfn << 8) | enc as u64
}

pub fn split_descriptor(d: u64) -> Result<(u64, PageEncoding)> {
    Ok((d >> 8, PageEncoding::from_u8(d as u8)?))
}

pub fn write_stream_header(w: &mut impl Write) -> Result<()> {
    write_stream_header_as(w, VERSION)
}

/// A stream header naming `version` (at least `OLDEST_READ`): the stream holds nothing newer.
pub fn write_stream_header_as(w: &mut impl Write, version: u32) -> Result<()> {
    let mut h = [0u8; STREAM_HEADER_LEN];
    h[..8].copy_from_slice(MAGIC);
    h[8..12].copy_from_slice(&version.to_le_bytes());
    w.write_all(&h)?;
    Ok(())
}

/// Reads a stream header: the stream's version, one this ferry reads.
pub fn read_stream_header(r: &mut impl Read) -> Result<u32> {
    let mut h = [0u8; STREAM_HEADER_LEN];
    read_exact(r, &mut h, "stream header")?;
    if &h[..8] != MAGIC {
        return Err(Error::Protocol(
            "not a ferry migration stream (bad magic)".into(),
        ));
    }
    let version = u32::from_le_bytes(h[8..12].try_into().unwrap());
    if !(OLDEST_READ..=VERSION).contains(&version) {
        return Err(Error::Protocol(format!(
            "stream version {version} is not supported (this ferry speaks version {VERSION} \
             and reads versions {OLDEST_READ} to {VERSION})"
        )));
    }
    Ok(version)
}

pub fn frame_header(kind: u8, flags: u8, len: u32) -> [u8; FRAME_HEADER_LEN] {
    let mut h = [0u8; FRAME_HEADER_LEN];
    h[0] = kind;
    h[1] = flags;
    h[4..8].copy_from_slice(&len.to_le_bytes());
    h
}

pub fn write_message(w: &mut impl Write, msg: &Message) -> Result<()> {
    write_message_counted(w, msg).map(|_| ())
}

/// `write_message`; the bytes the frame took on the wire.
pub fn write_message_counted(w: &mut impl Write, msg: &Message) -> Result<u64> {
    write_control(w, &msg.encode(), &[])
}

/// `DiskData` written from `data` where it lies (`Message::disk_data_head` and the data): a
/// disk's blocks are not copied into a message first.
pub fn write_disk_data(w: &mut impl Write, disk: u32, offset: u64, data: &[u8]) -> Result<u64> {
    write_control(w, &Message::disk_data_head(disk, offset, data.len()), data)
}

/// `DiskPacked` written from `packed` where it lies: `len` bytes packed by `codec`.
pub fn write_disk_packed(
    w: &mut impl Write,
    (disk, offset): (u32, u64),
    codec: Codec,
    len: u32,
    packed: &[u8],
) -> Result<u64> {
    let head = Message::disk_packed_head(disk, offset, codec, len, packed.len());
    write_control(w, &head, packed)
}

/// A control frame whose payload is `head` followed by `tail`; the bytes it took.
fn write_control(w: &mut impl Write, head: &[u8], tail: &[u8]) -> Result<u64> {
    let len = head.len() + tail.len();
    let header = frame_header(KIND_CONTROL, 0, len as u32);
    let mut crc = crc32fast::Hasher::new();
    crc.update(&header);
    crc.update(head);
    crc.update(tail);
    let trailer = crc.finalize().to_le_bytes();
    write_all_vectored(
        w,
        &mut [
            IoSlice::new(&header),
            IoSlice::new(head),
            IoSlice::new(tail),
            IoSlice::new(&trailer),
        ],
    )?;
    w.flush()
        .map_err(|e| Error::transport("sending a control frame", e))?;
    Ok((header.len() + len + trailer.len()) as u64)
}

/// A frame as read: either a decoded control message or the start of a page frame, whose
/// body the caller reads straight into guest memory.
pub enum Frame {
    Message(Message),
    Pages {
        header: [u8; FRAME_HEADER_LEN],
        len: u32,
    },
}

pub fn read_frame(r: &mut impl Read) -> Result<Frame> {
    let mut header = [0u8; FRAME_HEADER_LEN];
    read_exact(r, &mut header, "frame header")?;
    let len = u32::from_le_bytes(header[4..8].try_into().unwrap());
    match header[0] {
        KIND_CONTROL => {
            if len > MAX_CONTROL_LEN {
                return Err(Error::Protocol(format!(
                    "control frame of {len} bytes is larger than the {MAX_CONTROL_LEN} allowed"
                )));
            }
            let mut payload = vec![0u8; len as usize];
            read_exact(r, &mut payload, "control frame")?;
            let mut crc = crc32fast::Hasher::new();
            crc.update(&header);
            crc.update(&payload);
            check_trailer(r, crc.finalize(), "control frame")?;
            Ok(Frame::Message(Message::decode_owned(payload)?))
        }
        KIND_PAGES => Ok(Frame::Pages { header, len }),
        other => Err(Error::Protocol(format!("unknown frame kind {other}"))),
    }
}

/// Reads a frame's CRC trailer and compares it with what was computed.
pub fn check_trailer(r: &mut impl Read, computed: u32, what: &str) -> Result<()> {
    let mut t = [0u8; 4];
    read_exact(r, &mut t, what)?;
    let sent = u32::from_le_bytes(t);
    if sent != computed {
        return Err(Error::Protocol(format!(
            "checksum mismatch in {what} (sent {sent:#010x}, computed {computed:#010x})"
        )));
    }
    Ok(())
}

/// Expects a control frame; anything else, or an `Abort`, is an error.
pub fn read_message(r: &mut impl Read) -> Result<Message> {
    match read_frame(r)? {
        Frame::Message(Message::Abort { reason }) => Err(Error::Peer(reason)),
        Frame::Message(m) => Ok(m),
        Frame::Pages { .. } => Err(Error::Protocol(
            "page frame where a control frame was expected".into(),
        )),
    }
}

/// `read_exact` whose error says what was being read when the stream ended.
pub fn read_exact(r: &mut impl Read, buf: &mut [u8], what: &str) -> Result<()> {
    r.read_exact(buf).map_err(|e| {
        if e.kind() == std::io::ErrorKind::UnexpectedEof {
            Error::truncated(what)
        } else {
            Error::transport(format!("reading {what}"), e)
        }
    })
}

/// Writes every byte of `bufs` (std's `write_all_vectored` is not stable).
pub fn write_all_vectored(w: &mut impl Write, mut bufs: &mut [IoSlice<'_>]) -> Result<()> {
    IoSlice::advance_slices(&mut bufs, 0);
    while !bufs.is_empty() {
        match w.write_vectored(bufs) {
            Ok(0) => {
                return Err(Error::transport(
                    "sending",
                    std::io::ErrorKind::WriteZero.into(),
                ));
            }
            Ok(n) => IoSlice::advance_slices(&mut bufs, n),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(Error::transport("sending", e)),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn roundtrip(msg: Message) -> Message {
        let mut buf = Vec::new();
        write_message(&mut buf, &msg).unwrap();
        read_message(&mut buf.as_slice()).unwrap()
    }

    #[test]
    fn control_frames_roundtrip() {
        let m = Message::RoundEnd {
            round: 3,
            pages: 77,
        };
        assert_eq!(roundtrip(m.clone()), m);
        let m = Message::VcpuState {
            index: 1,
            state: vec![1, 2, 3],
        };
        assert_eq!(roundtrip(m.clone()), m);
    }

    #[test]
    fn golden_stream_header() {
        let mut h = Vec::new();
        write_stream_header(&mut h).unwrap();
        assert_eq!(h, b"FERRYMIG\x11\0\0\0\0\0\0\0");
    }

    #[test]
    fn refuses_bad_streams_with_a_reason() {
        let mut h = Vec::new();
        write_stream_header(&mut h).unwrap();
        assert!(read_stream_header(&mut h.as_slice()).is_ok());
        // The oldest version read, as a live update's stream is written, is taken too.
        let mut oldest = Vec::new();
        write_stream_header_as(&mut oldest, OLDEST_READ).unwrap();
        assert!(read_stream_header(&mut oldest.as_slice()).is_ok());
        let mut other = h.clone();
        other[8] = 9;
        let e = read_stream_header(&mut other.as_slice()).unwrap_err();
        assert!(e.to_string().contains("version 9"), "{e}");
        assert!(
            e.to_string().contains("version 17"),
            "names both versions: {e}"
        );
        let e = read_stream_header(&mut &b"GET / HTTP/1.1\r\n"[..]).unwrap_err();
        assert!(e.to_string().contains("bad magic"), "{e}");

        let mut f = Vec::new();
        write_message(&mut f, &Message::Go).unwrap();
        let mut corrupt = f.clone();
        corrupt[FRAME_HEADER_LEN] ^= 1;
        let e = read_message(&mut corrupt.as_slice()).err().unwrap();
        assert!(e.to_string().contains("checksum mismatch"), "{e}");
        let e = read_message(&mut &f[..f.len() - 2]).err().unwrap();
        assert!(e.to_string().contains("truncated"), "{e}");
        let mut huge = f.clone();
        huge[4..8].copy_from_slice(&u32::MAX.to_le_bytes());
        let e = read_message(&mut huge.as_slice()).err().unwrap();
        assert!(e.to_string().contains("larger than"), "{e}");
        let mut kind = f;
        kind[0] = 77;
        let e = read_message(&mut kind.as_slice()).err().unwrap();
        assert!(e.to_string().contains("unknown frame kind 77"), "{e}");
    }

    #[test]
    fn descriptors_pack_pfn_and_encoding() {
        let d = descriptor(0x12345, PageEncoding::Zero);
        assert_eq!(split_descriptor(d).unwrap(), (0x12345, PageEncoding::Zero));
        assert!(split_descriptor(0x1_07).is_err());
    }
}
