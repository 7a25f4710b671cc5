//! The page pipeline end to end: pages pushed through a sender, its frames through a
//! receiver, for every kind of frame; and the exact bytes of each kind.

use super::*;
use crate::PAGE_SIZE;
use crate::bitmap::Bitmap;
use crate::cpu::CpuMeter;
use crate::error::Result;
use crate::memory::{GuestRam, RamRange};
use crate::params::Compression;
use crate::ratelimit::RateLimiter;
use crate::wire::Frame;
use crate::wire::codec::Codec;
use crate::wire::frame::{FRAME_HEADER_LEN, PAGE_DATA_UNCHECKED, PageEncoding, read_frame};
use crate::wire::page_frame::{FrameBuffers, build_head, read_page_frame};
use crate::zero::is_zero_page;

const PAGES: u64 = 64;

fn ram(buf: &mut [u8]) -> GuestRam {
    let r = RamRange {
        gpa: 0,
        len: buf.len() as u64,
    };
    // SAFETY: `buf` outlives every use of the returned view in these tests.
    unsafe { GuestRam::new(&[(r, buf.as_mut_ptr())]) }.unwrap()
}

/// Page `pfn` as text (compresses) or as pseudo-random bytes (does not).
fn fill(ram: &GuestRam, pfn: u64, random: bool) {
    let page = match random {
        true => crate::test_data::noise(pfn.wrapping_mul(0x9e37_79b9_7f4a_7c15), PAGE_SIZE),
        false => (0..PAGE_SIZE)
            .map(|i| b"the guest wrote page "[i % 21])
            .collect(),
    };
    ram.write_page(pfn, &page).unwrap();
}

/// Sends pages 0..PAGES (every 5th left zero) with `compression`; returns the stream.
fn send(src: &GuestRam, compression: Compression, checked: bool) -> (Vec<u8>, SendCounters) {
    let mut sender = PageSender::new(16).with_compression(compression);
    sender.checked = checked;
    let mut limiter = RateLimiter::new(None);
    let mut wire = Vec::new();
    for pfn in 0..PAGES {
        sender.push(&mut wire, src, pfn, &mut limiter).unwrap();
    }
    sender.flush(&mut wire, src, &mut limiter).unwrap();
    (wire, sender.counters)
}

fn receive_all(wire: &[u8], dst: &GuestRam) -> Result<u64> {
    let mut receiver = PageReceiver::new(dst);
    feed(&mut receiver, wire, dst)?;
    Ok(receiver.pages)
}

/// Every page frame of `wire` through `receiver`.
fn feed(receiver: &mut PageReceiver, mut wire: &[u8], dst: &GuestRam) -> Result<()> {
    while !wire.is_empty() {
        let Frame::Pages { header, len } = read_frame(&mut wire)? else {
            panic!("only page frames here")
        };
        receiver.receive(&mut wire, dst, &header, len)?;
    }
    Ok(())
}

/// A page frame of `pfns` with `flags` around `data`, with the right trailer.
fn framed(pfns: &[(u64, PageEncoding)], flags: u8, data: &[u8]) -> Vec<u8> {
    let mut wire = Vec::new();
    build_head(&mut wire, pfns, flags, data.len());
    wire.extend_from_slice(data);
    let crc = crc32fast::hash(&wire);
    wire.extend_from_slice(&crc.to_le_bytes());
    wire
}

fn source(random: impl Fn(u64) -> bool) -> (Vec<u8>, GuestRam) {
    let mut buf = vec![0u8; (PAGES * PAGE_SIZE as u64) as usize];
    let ram = ram(&mut buf);
    for pfn in (0..PAGES).filter(|p| p % 5 != 0) {
        fill(&ram, pfn, random(pfn));
    }
    (buf, ram)
}

#[test]
fn compressed_frames_arrive_exactly_and_incompressible_ones_go_plain() {
    // Pages 0..32 text, 32..64 random: with batches of 16, two frames of each.
    let (src_buf, src) = source(|pfn| pfn >= 32);
    for compression in [
        Compression::None,
        Compression::Fixed(Codec::Lz4),
        Compression::Fixed(Codec::Zstd),
        Compression::Auto,
    ] {
        for checked in [false, true] {
            let (wire, c) = send(&src, compression, checked);
            let mut dst_buf = vec![0u8; src_buf.len()];
            let dst = ram(&mut dst_buf);
            assert_eq!(receive_all(&wire, &dst).unwrap(), PAGES);
            assert!(dst_buf == src_buf, "{compression:?}: pages equal");
            assert_eq!(c.frames_by_codec.iter().sum::<u64>(), 4);
            if let Compression::Fixed(codec) = compression {
                assert_eq!(c.frames_by_codec[codec as usize], 2, "{c:?}");
                assert_eq!(c.frames_by_codec[0], 2, "random pages went plain: {c:?}");
                assert!(c.packed_out * 4 < c.packed_in, "{c:?}");
            }
        }
    }
}

/// Pages that do not shrink over a link faster than any codec: after one whole frame
/// each, `auto` tries the codecs on samples, and every frame goes plain.
#[test]
fn auto_tries_codecs_on_samples_while_plain_wins() {
    let (src_buf, src) = source(|_| true);
    let mut sender = PageSender::new(1).with_compression(Compression::Auto);
    let mut limiter = RateLimiter::new(None);
    let mut wire = Vec::new();
    for pfn in 0..PAGES {
        sender.push(&mut wire, &src, pfn, &mut limiter).unwrap();
    }
    sender.flush(&mut wire, &src, &mut limiter).unwrap();
    let mut dst_buf = vec![0u8; src_buf.len()];
    let dst = ram(&mut dst_buf);
    assert_eq!(receive_all(&wire, &dst).unwrap(), PAGES);
    assert!(dst_buf == src_buf);
    let c = sender.counters;
    assert_eq!(c.frames_by_codec[0], PAGES, "{c:?}");
    assert!(
        c.samples_by_codec[1] > 0 && c.samples_by_codec[2] > 0,
        "{c:?}"
    );
    assert_eq!(c.samples_by_codec[0], 0, "plain needs no sample");
}

/// Two passes over every page with the guest writing in between, pushed without a flush
/// between them, so that the first pass's frames are still being packed when the second's
/// are gathered; returns the stream.
fn two_passes(sender: &mut PageSender, src_buf: &mut [u8], src: &GuestRam) -> Vec<u8> {
    let mut limiter = RateLimiter::new(None);
    let mut wire = Vec::new();
    for pass in 0..2 {
        if pass == 1 {
            for pfn in (0..PAGES).filter(|p| p % 3 == 1) {
                let at = (pfn * PAGE_SIZE as u64) as usize + 16;
                src_buf[at..at + 8].copy_from_slice(&7u64.to_le_bytes());
            }
        }
        for pfn in 0..PAGES {
            sender.push(&mut wire, src, pfn, &mut limiter).unwrap();
        }
    }
    sender.flush(&mut wire, src, &mut limiter).unwrap();
    wire
}

#[test]
fn packer_threads_send_the_same_frames_in_the_same_order() {
    for compression in [
        Compression::Fixed(Codec::Lz4),
        Compression::Fixed(Codec::Zstd),
        Compression::Auto,
    ] {
        for delta in [0, PAGES as usize] {
            let mut results = Vec::new();
            for threads in [1, 3] {
                let (mut src_buf, src) = source(|pfn| pfn >= 32);
                let mut sender = PageSender::new(4)
                    .with_compression(compression)
                    .with_delta_cache(delta)
                    .with_packers(threads, &CpuMeter::default());
                assert_eq!(sender.has_packers(), threads > 1);
                let wire = two_passes(&mut sender, &mut src_buf, &src);
                let mut dst_buf = vec![0u8; src_buf.len()];
                let dst = ram(&mut dst_buf);
                assert_eq!(receive_all(&wire, &dst).unwrap(), 2 * PAGES);
                assert!(
                    dst_buf == src_buf,
                    "{compression:?}, {threads} threads: the last copy of each page won"
                );
                let c = sender.counters;
                assert_eq!(c.full + c.zero, 2 * PAGES, "{c:?}");
                assert_eq!(c.frames_by_codec.iter().sum::<u64>(), 2 * PAGES / 4);
                results.push((wire, c));
            }
            if compression != Compression::Auto {
                // Codecs are deterministic: side by side, the stream is byte for byte the
                // one a single thread writes.
                assert!(results[0] == results[1], "{compression:?}, delta {delta}");
            }
        }
    }
}

#[test]
fn resent_pages_go_as_deltas_and_arrive_exactly() {
    let (mut src_buf, src) = source(|pfn| pfn >= 32);
    for compression in [Compression::None, Compression::Fixed(Codec::Lz4)] {
        let mut sender = PageSender::new(16)
            .with_compression(compression)
            .with_delta_cache(PAGES as usize);
        let mut limiter = RateLimiter::new(None);
        let mut dst_buf = vec![0u8; src_buf.len()];
        let dst = ram(&mut dst_buf);
        let mut receiver = PageReceiver::new(&dst);
        let mut round = |sender: &mut PageSender, src: &GuestRam| {
            let mut wire = Vec::new();
            for pfn in 0..PAGES {
                sender.push(&mut wire, src, pfn, &mut limiter).unwrap();
            }
            sender.flush(&mut wire, src, &mut limiter).unwrap();
            feed(&mut receiver, &wire, &dst).unwrap();
        };
        round(&mut sender, &src);
        assert_eq!(
            sender.counters.delta_pages, 0,
            "nothing cached before round 0"
        );
        // The guest stamps a word in every page (and zeroes one), then it all goes again.
        for pfn in 0..PAGES {
            let at = (pfn * PAGE_SIZE as u64) as usize + 8 * (pfn as usize % 512);
            src_buf[at..at + 8].copy_from_slice(&(pfn + 1000).to_le_bytes());
        }
        let z = 7 * PAGE_SIZE;
        src_buf[z..z + PAGE_SIZE].fill(0);
        round(&mut sender, &src);
        assert!(
            dst_buf == src_buf,
            "{compression:?}: pages equal after the deltas"
        );
        let c = sender.counters;
        // Every page that held data both times, but the random ones whose whole page
        // changed little too: all of them, except the one zeroed.
        assert!(c.delta_pages >= 40, "{c:?}");
        assert!(c.delta_saved > 40 * 4000, "{c:?}");
    }
}

/// Every page through `sender` once, and into `receiver`.
fn pass_through(
    sender: &mut PageSender,
    src: &GuestRam,
    limiter: &mut RateLimiter,
    receiver: &mut PageReceiver,
    dst: &GuestRam,
) {
    let mut wire = Vec::new();
    for pfn in 0..PAGES {
        sender.push(&mut wire, src, pfn, limiter).unwrap();
    }
    sender.flush(&mut wire, src, limiter).unwrap();
    feed(receiver, &wire, dst).unwrap();
}

/// `auto` with a delta cache: frames it sends plain go in place and the cache forgets their
/// pages, so a later delta is never taken against a copy the destination no longer holds.
/// Rounds alternate between a slow link (codecs, deltas) and an unlimited one (plain).
#[test]
fn auto_plain_frames_leave_no_stale_copy_for_a_delta() {
    let (mut src_buf, src) = source(|pfn| pfn >= 48);
    let mut sender = PageSender::new(16)
        .with_compression(Compression::Auto)
        .with_delta_cache(PAGES as usize);
    let mut dst_buf = vec![0u8; src_buf.len()];
    let dst = ram(&mut dst_buf);
    let mut receiver = PageReceiver::new(&dst);
    for round in 0..6u64 {
        let mut limiter = RateLimiter::new((round % 2 == 0).then_some(20));
        pass_through(&mut sender, &src, &mut limiter, &mut receiver, &dst);
        assert!(dst_buf == src_buf, "round {round}: pages equal");
        for pfn in 0..PAGES {
            let at = (pfn * PAGE_SIZE as u64) as usize + 8 * ((pfn + round) as usize % 512);
            src_buf[at..at + 8].copy_from_slice(&(pfn + 1000 * round).to_le_bytes());
        }
    }
    let c = sender.counters;
    assert!(c.frames_by_codec[0] > 0, "{c:?}");
    assert!(c.frames_by_codec[1] + c.frames_by_codec[2] > 0, "{c:?}");
}

/// Pages that do not shrink go plain under `auto`; on a slow link they still go through the
/// delta cache, so that a page the guest changed a little since goes as its delta (in the
/// pause, every byte saved is downtime saved). By the third pass the link's estimate has long
/// come down from the limiter's first burst, and the pages were cached on the second.
#[test]
fn auto_plain_frames_keep_the_delta_cache_on_a_slow_link() {
    let (mut src_buf, src) = source(|_| true);
    let mut sender = PageSender::new(1)
        .with_compression(Compression::Auto)
        .with_delta_cache(PAGES as usize);
    let mut dst_buf = vec![0u8; src_buf.len()];
    let dst = ram(&mut dst_buf);
    let mut receiver = PageReceiver::new(&dst);
    let mut limiter = RateLimiter::new(Some(40));
    let mut before_last = 0;
    for pass in 1..=3u64 {
        // A stamp in every page, new each pass (the pages `source` left zero get data too).
        for pfn in 0..PAGES {
            let at = (pfn * PAGE_SIZE as u64) as usize + 64;
            src_buf[at..at + 8].copy_from_slice(&(pfn + 1000 * pass).to_le_bytes());
        }
        before_last = sender.counters.delta_pages;
        pass_through(&mut sender, &src, &mut limiter, &mut receiver, &dst);
        assert!(dst_buf == src_buf, "pass {pass}: pages equal");
    }
    let c = sender.counters;
    // Plain frames in place would leave cached only the few pages a codec packed.
    let deltas = c.delta_pages - before_last;
    assert!(
        deltas >= PAGES / 2,
        "{deltas} of the last pass as deltas: {c:?}"
    );
}

/// A frame read while the guest ran is not covered by the frame checksum (the guest may
/// change a page on its way), but each page carries its CRC: a page whose data was
/// corrupted is suspect until a later copy replaces it, and post-copy refuses it outright.
#[test]
fn a_corrupted_page_of_an_unchecked_frame_is_caught_by_its_own_crc() {
    let (src_buf, src) = source(|_| false);
    let (mut wire, _) = send(&src, Compression::None, false);
    // The last byte of the first frame's page data (pages 1..4 are full, 0 is zero).
    let len = u32::from_le_bytes(wire[4..8].try_into().unwrap()) as usize;
    wire[FRAME_HEADER_LEN + len - 1] ^= 0x40;
    let mut dst_buf = vec![0u8; src_buf.len()];
    let dst = ram(&mut dst_buf);
    let mut receiver = PageReceiver::new(&dst);
    feed(&mut receiver, &wire, &dst).unwrap();
    let suspect: Vec<u64> = receiver.suspect().iter().collect();
    assert_eq!(suspect.len(), 1, "{suspect:?}");
    assert!(dst.page(suspect[0]).unwrap() != src.page(suspect[0]).unwrap());

    // A later copy (the guest wrote the page; here: sent again) clears it.
    let mut sender = PageSender::new(16);
    let mut limiter = RateLimiter::new(None);
    let mut again = Vec::new();
    sender
        .push(&mut again, &src, suspect[0], &mut limiter)
        .unwrap();
    sender.flush(&mut again, &src, &mut limiter).unwrap();
    feed(&mut receiver, &again, &dst).unwrap();
    assert_eq!(receiver.suspect().count(), 0);
    assert!(dst_buf == src_buf);

    // Post-copy installs pages as final: it refuses the corrupt one.
    let mut r = wire.as_slice();
    let Frame::Pages { header, len } = read_frame(&mut r).unwrap() else {
        panic!("a page frame")
    };
    let mut scratch = FrameBuffers::default();
    let e = read_page_frame(&mut r, &src, &header, len, &mut scratch).unwrap_err();
    assert!(e.to_string().contains("arrived corrupt"), "{e}");
}

#[test]
fn a_delta_for_a_page_never_sent_whole_is_refused() {
    let (src_buf, _src) = source(|_| false);
    let mut dst_buf = vec![0u8; src_buf.len()];
    let dst = ram(&mut dst_buf);
    let wire = framed(&[(3, PageEncoding::Delta)], 0, &[5, 0, 0, 0, 1, 0, 0xff]);
    let e = receive_all(&wire, &dst).unwrap_err();
    assert!(e.to_string().contains("never sent whole"), "{e}");
}

/// Pages faulted in ahead hold zeros, not a copy: a delta on one is refused, a zero page
/// among them is given back (the destination holds no more than the source), and all
/// count as present (post-copy must drop them before the guest reads one).
#[test]
fn pages_faulted_in_ahead_are_present_but_not_sent() {
    let (_src_buf, src) = source(|_| false);
    let shadow = crate::memory::ShadowRam::like(&src).unwrap();
    let dst = shadow.ram();
    let mut ahead = Bitmap::new(dst.gfn_end());
    for pfn in 0..PAGES {
        ahead.set(pfn);
        dst.zero_page(pfn).unwrap(); // faults it in, as the prefaulter does
    }
    let lane = |r: &PageReceiver| PageReceiver::new(dst).sharing_ahead_with(r);
    let mut receiver = PageReceiver::new(dst);
    receiver.present_ahead(ahead.clone()).unwrap();
    let e = receiver.present_ahead(ahead.clone()).unwrap_err();
    assert!(e.to_string().contains("twice"), "{e}");

    let delta = framed(&[(3, PageEncoding::Delta)], 0, &[5, 0, 0, 0, 1, 0, 0xff]);
    let e = feed(&mut lane(&receiver), &delta, dst).unwrap_err();
    assert!(e.to_string().contains("never sent whole"), "{e}");

    // Another lane of the migration receives: it learned which pages came ahead.
    let mut other = lane(&receiver);
    let (wire, _) = send(&src, Compression::None, true);
    feed(&mut other, &wire, dst).unwrap();
    // (Before the pages are read: a read maps the kernel's zero page in.)
    let populated = crate::scan::populated_pages(dst).unwrap();
    let data: Vec<u64> = (0..PAGES).filter(|p| p % 5 != 0).collect();
    assert_eq!(populated.iter().collect::<Vec<_>>(), data);
    for pfn in 0..PAGES {
        assert_eq!(dst.page(pfn).unwrap(), src.page(pfn).unwrap(), "page {pfn}");
    }
    assert_eq!(other.written().iter().collect::<Vec<_>>(), data);
    assert_eq!(other.present().count(), PAGES);
}

#[test]
fn a_flipped_byte_in_compressed_data_is_refused_before_it_is_unpacked() {
    let (src_buf, src) = source(|_| false);
    let (mut wire, _) = send(&src, Compression::Fixed(Codec::Zstd), false);
    // The last byte of the first frame's compressed data (just before its trailer).
    let len = u32::from_le_bytes(wire[4..8].try_into().unwrap()) as usize;
    wire[FRAME_HEADER_LEN + len - 1] ^= 0x40;
    let mut dst_buf = vec![0u8; src_buf.len()];
    let e = receive_all(&wire, &ram(&mut dst_buf)).unwrap_err();
    assert!(e.to_string().contains("checksum"), "{e}");
}

#[test]
fn hostile_compressed_frames_are_refused_with_a_reason() {
    let (src_buf, src) = source(|_| false);
    let mut dst_buf = vec![0u8; src_buf.len()];
    let dst = ram(&mut dst_buf);
    let frame = |flags: u8, data: &[u8]| {
        framed(
            &[(1, PageEncoding::Full), (2, PageEncoding::Full)],
            flags,
            data,
        )
    };
    let lz4 = Codec::Lz4.flag_bits();
    let cases: [(Vec<u8>, &str); 4] = [
        // Well-formed lz4 that unpacks to one page where the descriptors promise two.
        (
            frame(lz4, &lz4_flex::block::compress(&[7u8; PAGE_SIZE])),
            "promise",
        ),
        (frame(lz4, &[0xff; 100]), "lz4 page data"),
        (
            frame(lz4 | PAGE_DATA_UNCHECKED, &[1; 100]),
            "covered by the frame checksum",
        ),
        (frame(3 << 1, &[1; 100]), "unknown codec"),
    ];
    for (wire, why) in cases {
        let e = receive_all(&wire, &dst).unwrap_err();
        assert!(e.to_string().contains(why), "{why}: {e}");
    }
    // "Compressed" data as long as the pages themselves is refused too.
    let e = receive_all(&frame(lz4, &vec![1; 2 * PAGE_SIZE]), &dst).unwrap_err();
    assert!(e.to_string().contains("lz4 page frame of length"), "{e}");
    let _ = src;
}

/// One flush of `pfns` by `sender`: the frame it writes.
fn one_frame(src: &GuestRam, sender: &mut PageSender, pfns: &[u64]) -> Vec<u8> {
    let mut limiter = RateLimiter::new(None);
    let mut wire = Vec::new();
    for &pfn in pfns {
        sender.push(&mut wire, src, pfn, &mut limiter).unwrap();
    }
    sender.flush(&mut wire, src, &mut limiter).unwrap();
    wire
}

/// The bytes `golden` names: hex, with `page:N` standing for the 4096 bytes of page N.
fn expand(golden: &str, ram: &GuestRam) -> Vec<u8> {
    let hex = |t: &str| -> Vec<u8> {
        (0..t.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&t[i..i + 2], 16).unwrap())
            .collect()
    };
    golden
        .split_whitespace()
        .flat_map(|t| match t.strip_prefix("page:") {
            Some(n) => ram.page(n.parse().unwrap()).unwrap().to_vec(),
            None => hex(t),
        })
        .collect()
}

/// A page frame of each kind as the sender writes it, with its exact bytes, read back by
/// both readers (post-copy's refuses deltas). If this fails, the wire changed: bump
/// `frame::VERSION` and write the change in docs/protocol.md before updating it. (The
/// lz4 and zstd data pin those libraries' output too: a new version of one may pack a
/// page otherwise, and must still read these bytes.)
#[test]
fn every_page_frame_kind_has_fixed_bytes() {
    let mut src_buf = vec![0u8; 4 * PAGE_SIZE];
    let src = ram(&mut src_buf);
    for pfn in 1..4 {
        fill(&src, pfn, false);
    }
    let plain = |checked| {
        let mut s = PageSender::new(16);
        s.checked = checked;
        s
    };
    let packed = |codec| PageSender::new(16).with_compression(Compression::Fixed(codec));
    // Page 3 goes whole, then, with one word changed, as a delta of that copy.
    let mut deltas = PageSender::new(16).with_delta_cache(4);
    let first = one_frame(&src, &mut deltas, &[3]);
    let mut page = src.page(3).unwrap().to_vec();
    page[16..24].copy_from_slice(&7u64.to_le_bytes());
    src.write_page(3, &page).unwrap();
    let cases: [(&str, &[u64], &mut PageSender, &str); 6] = [
        (
            "zero",
            &[0],
            &mut plain(false),
            "02010000 10000000 01000000 00000000 0100000000000000 d1d68d63",
        ),
        (
            "full, unchecked, beside a zero page",
            &[0, 1],
            &mut plain(false),
            "02010000 1c100000 02000000 00000000 0100000000000000 0001000000000000 \
             14fcac0e page:1 d34d2c14",
        ),
        (
            "full, checksummed",
            &[1],
            &mut plain(true),
            "02000000 10100000 01000000 00000000 0001000000000000 page:1 98489ac8",
        ),
        (
            "lz4",
            &[1, 2],
            &mut packed(Codec::Lz4),
            "02020000 5e000000 02000000 00000000 0001000000000000 0002000000000000 \
             ff067468652067756573742077726f74652070616765201500ffffffffffffffffffffff\
             ffffffffe70feb0fffffffffffffffffffffffffffffffe70bea1f60706167652074 cc532f08",
        ),
        (
            "zstd",
            &[1, 2],
            &mut packed(Codec::Zstd),
            "02040000 45000000 02000000 00000000 0001000000000000 0002000000000000 \
             28b52ffd60001f1d0100a87468652067756573742077726f74652070616765200300e003\
             f4bb1ffa20fad19f4c d769c222",
        ),
        (
            "delta",
            &[3],
            &mut deltas,
            "02000000 1e000000 01000000 00000000 0203000000000000 0c00 1000 0800 \
             7761676520746865 538114a9",
        ),
    ];
    for (kind, pfns, sender, golden) in cases {
        let frame = one_frame(&src, sender, pfns);
        assert!(
            frame == expand(golden, &src),
            "{kind}: the bytes of the frame"
        );
        let mut dst_buf = vec![0u8; src_buf.len()];
        let dst = ram(&mut dst_buf);
        let mut receiver = PageReceiver::new(&dst);
        if kind == "delta" {
            feed(&mut receiver, &first, &dst).unwrap();
        }
        feed(&mut receiver, &frame, &dst).unwrap();
        assert_eq!(receiver.suspect().count(), 0, "{kind}");
        for &pfn in pfns {
            assert_eq!(dst.page(pfn).unwrap(), src.page(pfn).unwrap(), "{kind}");
        }
        let mut r = frame.as_slice();
        let Frame::Pages { header, len } = read_frame(&mut r).unwrap() else {
            panic!("{kind}: a page frame")
        };
        let mut scratch = FrameBuffers::default();
        match read_page_frame(&mut r, &src, &header, len, &mut scratch) {
            Ok(pages) => {
                for (pfn, data) in pages {
                    let want = src.page(pfn).unwrap();
                    assert!(data.map_or(is_zero_page(want), |d| d == want), "{kind}");
                }
            }
            Err(e) => assert!(kind == "delta", "{kind}: {e}"),
        }
    }
}

/// `auto` measures the link in windows only where the bytes cross TCP: a file's writes and a
/// Unix socket's peer say nothing of a link (a snapshot keeps its write-time estimate; a
/// receiver behind a Unix socket is on this host, and stays plain).
#[test]
fn only_a_tcp_stream_is_measured_in_windows() {
    use crate::io::transport::Stream;
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let tcp = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
    let (unix, _peer) = std::os::unix::net::UnixStream::pair().unwrap();
    let file = crate::io::lanefile::SnapshotFile::Plain(tempfile::tempfile().unwrap());
    for (stream, measured) in [
        (Stream::Tcp(tcp), true),
        (Stream::Unix(unix), false),
        (Stream::File(file), false),
    ] {
        let sender = PageSender::new(4)
            .with_compression(Compression::Auto)
            .with_link_probe(Some(stream));
        assert_eq!(sender.measures_the_link(), measured);
    }
    let plain = PageSender::new(4).with_link_probe(Some(Stream::Tcp(
        std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap(),
    )));
    assert!(!plain.measures_the_link(), "nothing to choose without auto");
}
