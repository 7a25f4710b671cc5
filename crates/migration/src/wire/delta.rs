//! Delta encoding of re-sent pages (the idea of QEMU's XBZRLE): the sender keeps the copies
//! it sent last in a bounded cache (`pages::deltas`); a page sent again whose bytes changed
//! little goes as the runs of bytes that differ, XOR-ed with the copy the destination already
//! holds.
//!
//! Written here: no maintained crate encodes page deltas for a stream whose receiver applies
//! them in place. The format is ours (docs/protocol.md): a sequence of runs, each
//! `skip u16 | count u16 | count bytes`, where `skip` bytes are unchanged and the next `count`
//! bytes are XOR-ed with the given ones.

use crate::PAGE_SIZE;
use crate::error::{Error, Result};

/// A delta only goes when it is at most this long: past it, sending the page costs about as
/// much and saves the receiver's read-modify-write.
pub const MAX_DELTA: usize = PAGE_SIZE / 2;
/// Runs closer than this are merged: a run header costs 4 bytes.
const MERGE_GAP: usize = 4;

/// Encodes `new` against `old` (both one page) into `out`; `None` when the delta would be
/// longer than `MAX_DELTA` (or empty: an unchanged page still goes, as a one-byte run, so that
/// every page sent is a page received).
pub fn encode(old: &[u8], new: &[u8], out: &mut Vec<u8>) -> Option<usize> {
    let start = out.len();
    let mut at = 0;
    let mut last_end = 0;
    while at < PAGE_SIZE {
        // Words first: most of a re-sent page is unchanged.
        if at.is_multiple_of(8) && at + 8 <= PAGE_SIZE && old[at..at + 8] == new[at..at + 8] {
            at += 8;
            continue;
        }
        if old[at] == new[at] {
            at += 1;
            continue;
        }
        // A run of changed bytes, extended over short unchanged gaps.
        let run_start = at;
        let mut run_end = at + 1;
        let mut probe = run_end;
        while probe < PAGE_SIZE && probe - run_end < MERGE_GAP {
            if old[probe] != new[probe] {
                run_end = probe + 1;
            }
            probe += 1;
        }
        push_run(
            out,
            run_start - last_end,
            &old[run_start..run_end],
            &new[run_start..run_end],
        );
        if out.len() - start > MAX_DELTA {
            out.truncate(start);
            return None;
        }
        last_end = run_end;
        at = run_end;
    }
    if out.len() == start {
        // Unchanged: one byte XOR-ed with 0.
        push_run(out, 0, &old[..1], &new[..1]);
    }
    Some(out.len() - start)
}

fn push_run(out: &mut Vec<u8>, skip: usize, old: &[u8], new: &[u8]) {
    out.extend_from_slice(&(skip as u16).to_le_bytes());
    out.extend_from_slice(&(old.len() as u16).to_le_bytes());
    out.extend(old.iter().zip(new).map(|(a, b)| a ^ b));
}

/// Applies a delta to `page` in place. A delta that runs past the page, has an empty run or
/// ends inside a run header is refused (a corrupt or hostile frame).
pub fn apply(page: &mut [u8], mut delta: &[u8]) -> Result<()> {
    let bad = |why: &str| Error::Protocol(format!("page delta: {why}"));
    if delta.is_empty() {
        return Err(bad("empty"));
    }
    let mut at = 0usize;
    while !delta.is_empty() {
        if delta.len() < 4 {
            return Err(bad("cut inside a run header"));
        }
        let skip = u16::from_le_bytes([delta[0], delta[1]]) as usize;
        let count = u16::from_le_bytes([delta[2], delta[3]]) as usize;
        delta = &delta[4..];
        if count == 0 {
            return Err(bad("a run of no bytes"));
        }
        if count > delta.len() {
            return Err(bad("a run longer than its data"));
        }
        at += skip;
        if at + count > page.len() {
            return Err(bad("a run past the end of the page"));
        }
        for (p, x) in page[at..at + count].iter_mut().zip(&delta[..count]) {
            *p ^= x;
        }
        at += count;
        delta = &delta[count..];
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn page(seed: u64) -> Vec<u8> {
        crate::test_data::noise(seed, PAGE_SIZE)
    }

    #[test]
    fn small_changes_round_trip_and_large_ones_are_refused() {
        let old = page(1);
        let mut new = old.clone();
        new[0..8].copy_from_slice(&7u64.to_le_bytes()); // a stamp word
        new[100] ^= 1;
        new[4095] ^= 0x80;
        let mut d = Vec::new();
        let n = encode(&old, &new, &mut d).expect("small");
        assert!(n < 40, "{n}");
        let mut there = old.clone();
        apply(&mut there, &d).unwrap();
        assert!(there == new);
        // Unchanged pages still make a (tiny) delta.
        let mut d = Vec::new();
        assert_eq!(encode(&old, &old, &mut d), Some(5));
        let mut there = old.clone();
        apply(&mut there, &d).unwrap();
        assert!(there == old);
        // An unrelated page is not worth a delta.
        let mut d = vec![9];
        assert_eq!(encode(&old, &page(2), &mut d), None);
        assert_eq!(d, vec![9], "nothing left behind");
    }

    #[test]
    fn hostile_deltas_are_refused() {
        let mut p = page(3);
        for (delta, why) in [
            (vec![], "empty"),
            (vec![0, 0, 1], "header"),
            (vec![0, 0, 0, 0], "no bytes"),
            (vec![0, 0, 5, 0, 1], "longer than its data"),
            (vec![0xff, 0x0f, 2, 0, 1, 1], "past the end"),
        ] {
            let e = apply(&mut p, &delta).unwrap_err();
            assert!(e.to_string().contains(why), "{why}: {e}");
        }
    }
}
