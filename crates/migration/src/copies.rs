//! How many copies of each guest page (or disk block, `copy_storage`) crossed a pre-copy's
//! connection, counted by the source as it queues them and by the destination as they land:
//! after a broken connection the two counts say which pages the destination holds as last
//! sent. A page always travels on the same connection, in order, so the destination's count
//! reaches the source's exactly when the last copy arrived; any other count (a copy lost in
//! flight, a frame cut half-way) means the page goes again. Counts wrap at 2^16: a page would
//! need that many copies lost at once to be taken for current, more than there are rounds
//! (`params::MAX_ROUNDS`).

use std::sync::atomic::{AtomicU16, Ordering};

use crate::bitmap::Bitmap;
use crate::error::{Error, Result};

pub struct Copies(Box<[AtomicU16]>);

/// Counts of copies as runs: (count, how many pages or blocks in a row hold it).
pub type CountRuns = Vec<(u16, u32)>;

impl Copies {
    /// Counts for pages `0..pages`, all zero. The memory is the allocator's zeroed memory, taken
    /// from the host only where a count is written: a VM's untouched memory costs none.
    pub fn new(pages: u64) -> Self {
        let zeroed: Box<[u16]> = vec![0u16; pages as usize].into_boxed_slice();
        // SAFETY: `AtomicU16` has the size, alignment and bit validity of `u16`.
        Self(unsafe { Box::from_raw(Box::into_raw(zeroed) as *mut [AtomicU16]) })
    }

    /// One more copy of page `gfn` (ignored outside the counted pages).
    pub fn add(&self, gfn: u64) {
        if let Some(c) = self.0.get(gfn as usize) {
            c.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Each page of `set` gets one more copy.
    pub fn add_all(&self, set: &Bitmap) {
        set.iter().for_each(|gfn| self.add(gfn));
    }

    /// Each page of `range` gets one more copy.
    pub fn add_range(&self, range: std::ops::Range<u64>) {
        range.for_each(|gfn| self.add(gfn));
    }

    fn get(&self, gfn: usize) -> u16 {
        self.0[gfn].load(Ordering::Relaxed)
    }

    /// The counts as runs of equal counts; a page of `unusable` (its copy failed its check)
    /// holds none: its count becomes 0, as the source will take it to be.
    pub fn runs(&self, unusable: &Bitmap) -> Vec<(u16, u32)> {
        let mut runs: Vec<(u16, u32)> = Vec::new();
        for gfn in 0..self.0.len() {
            if unusable.get(gfn as u64) {
                self.0[gfn].store(0, Ordering::Relaxed);
            }
            let count = self.get(gfn);
            match runs.last_mut() {
                Some((c, n)) if *c == count && *n < u32::MAX => *n += 1,
                _ => runs.push((count, 1)),
            }
        }
        runs
    }

    /// The pages whose count the peer's `runs` give otherwise: those it does not hold as last
    /// sent. The peer's counts are taken as ours from here on, so that a page sent again is
    /// current once its new copy lands. Runs that do not cover exactly these pages (`what`
    /// names them in the error) are refused, and change nothing.
    pub fn reconcile(&self, runs: &[(u16, u32)], what: &str) -> Result<Bitmap> {
        let pages = self.0.len() as u64;
        let covered: u64 = runs.iter().map(|&(_, n)| u64::from(n)).sum();
        if covered != pages {
            return Err(Error::Protocol(format!(
                "the destination counts copies of {covered} {what}, this side {pages}"
            )));
        }
        let mut differ = Bitmap::new(pages);
        let mut gfn = 0usize;
        for &(count, n) in runs {
            for g in gfn..gfn + n as usize {
                if self.get(g) != count {
                    differ.set(g as u64);
                    self.0[g].store(count, Ordering::Relaxed);
                }
            }
            gfn += n as usize;
        }
        Ok(differ)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pages_whose_last_copy_did_not_land_differ() {
        let (source, destination) = (Copies::new(8), Copies::new(8));
        // Round 0 queues pages 0..6; pages 0..4 land, then the connection breaks.
        let round0 = Bitmap::from_words(&[0b11_1111], 8);
        source.add_all(&round0);
        (0..4).for_each(|g| destination.add(g));
        // Page 1 was rewritten and queued again in a round whose copy was lost.
        source.add(1);
        let mut suspect = Bitmap::new(8);
        suspect.set(3); // landed, but failed its check
        let again = source
            .reconcile(&destination.runs(&suspect), "pages")
            .unwrap();
        assert_eq!(again.iter().collect::<Vec<_>>(), vec![1, 3, 4, 5]);
        // Sent again and landed, they are current: a second break sends nothing twice.
        again.iter().for_each(|g| {
            source.add(g);
            destination.add(g);
        });
        let none = source.reconcile(&destination.runs(&Bitmap::new(8)), "pages");
        assert_eq!(none.unwrap().count(), 0);
        // Counts that do not cover the VM's pages are refused, naming what they count.
        let e = source.reconcile(&[(0, 7)], "blocks").unwrap_err();
        assert!(e.to_string().contains("7 blocks, this side 8"), "{e}");
    }

    #[test]
    fn runs_are_few_for_memory_sent_in_order() {
        let c = Copies::new(1 << 20);
        (0..800_000).for_each(|g| c.add(g));
        assert_eq!(
            c.runs(&Bitmap::new(1 << 20)),
            vec![(1, 800_000), (0, 248_576)]
        );
    }
}
