//! The sender's side of delta encoding (the format is `wire::delta`): the copies of pages it
//! sent last, in a bounded cache, and the swap of a page sent again for its delta against the
//! copy the destination already holds.

use std::collections::HashMap;

use crate::PAGE_SIZE;
use crate::wire::delta;

/// The copies a sender sent last, at most `capacity` pages, the oldest replaced first. It
/// grows as pages are put, so a cache that is on by default costs a guest that sends little
/// only what it sends.
pub struct DeltaCache {
    capacity: usize,
    data: Vec<u8>,
    slot_of: HashMap<u64, usize>,
    /// Each slot's page (`None`: forgotten); slots are made in order up to `capacity`.
    owner: Vec<Option<u64>>,
    /// The slot replaced next once every slot is made.
    next: usize,
    /// A delta being encoded.
    scratch: Vec<u8>,
}

impl DeltaCache {
    pub fn new(capacity_pages: usize) -> Self {
        Self {
            capacity: capacity_pages.max(1),
            data: Vec::new(),
            slot_of: HashMap::new(),
            owner: Vec::new(),
            next: 0,
            scratch: Vec::new(),
        }
    }

    /// The copy of `pfn` sent last, if it is still here.
    pub fn get(&self, pfn: u64) -> Option<&[u8]> {
        self.slot_of
            .get(&pfn)
            .map(|&s| &self.data[s * PAGE_SIZE..(s + 1) * PAGE_SIZE])
    }

    /// Remembers `page` as what was sent for `pfn`.
    pub fn put(&mut self, pfn: u64, page: &[u8]) {
        let slot = match self.slot_of.get(&pfn) {
            Some(&s) => s,
            None if self.owner.len() < self.capacity => {
                // A new slot takes the page as it grows: one copy, no clearing first.
                let s = self.owner.len();
                self.owner.push(Some(pfn));
                self.data.extend_from_slice(page);
                self.slot_of.insert(pfn, s);
                return;
            }
            None => {
                let s = self.next;
                self.next = (self.next + 1) % self.capacity;
                if let Some(old) = self.owner[s].replace(pfn) {
                    self.slot_of.remove(&old);
                }
                self.slot_of.insert(pfn, s);
                s
            }
        };
        self.data[slot * PAGE_SIZE..(slot + 1) * PAGE_SIZE].copy_from_slice(page);
    }

    /// Swaps the page copied for `pfn` at `raw[at..]` (the last page there) for `len u16` and
    /// its delta against the copy sent last, when that copy is here and the delta is short;
    /// returns the delta's length then. Remembers the page as sent either way.
    pub fn shrink(&mut self, pfn: u64, raw: &mut Vec<u8>, at: usize) -> Option<usize> {
        let page = &raw[at..at + PAGE_SIZE];
        let mut delta = std::mem::take(&mut self.scratch);
        delta.clear();
        let encoded = self
            .get(pfn)
            .and_then(|old| delta::encode(old, page, &mut delta));
        self.put(pfn, page);
        if let Some(n) = encoded {
            raw.truncate(at);
            raw.extend_from_slice(&(n as u16).to_le_bytes());
            raw.extend_from_slice(&delta);
        }
        self.scratch = delta;
        encoded
    }

    /// Forgets `pfn` (it was sent as a zero page, or dropped on the destination).
    pub fn forget(&mut self, pfn: u64) {
        if let Some(s) = self.slot_of.remove(&pfn) {
            self.owner[s] = None;
        }
    }

    pub fn clear(&mut self) {
        self.slot_of.clear();
        self.owner.fill(None);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A page of one byte value throughout.
    fn page(value: u8) -> Vec<u8> {
        vec![value; PAGE_SIZE]
    }

    #[test]
    fn the_cache_keeps_the_newest_copies_within_its_size() {
        let mut c = DeltaCache::new(2);
        c.put(1, &page(1));
        c.put(2, &page(2));
        c.put(1, &page(11)); // an update keeps its slot
        assert!(c.get(1).unwrap() == page(11).as_slice());
        c.put(3, &page(3)); // replaces the oldest slot: page 1's
        assert!(c.get(1).is_none() && c.get(2).is_some() && c.get(3).is_some());
        c.forget(2);
        assert!(c.get(2).is_none());
        c.clear();
        assert!(c.get(3).is_none());
    }

    /// A cache that is on by default costs what it holds: a large one given three pages
    /// holds three pages' copies.
    #[test]
    fn a_cache_grows_with_what_it_holds() {
        let mut c = DeltaCache::new(65_536);
        assert_eq!(c.data.capacity(), 0);
        for pfn in 0..3 {
            c.put(pfn, &page(pfn as u8));
        }
        assert_eq!((c.owner.len(), c.data.len()), (3, 3 * PAGE_SIZE));
        assert!(c.data.capacity() < 16 * PAGE_SIZE);
        assert!(c.get(2).unwrap() == page(2).as_slice());
    }

    #[test]
    fn a_page_sent_again_shrinks_to_its_delta() {
        let mut c = DeltaCache::new(2);
        let mut raw = page(1);
        assert_eq!(c.shrink(1, &mut raw, 0), None, "no copy sent before");
        assert!(raw == page(1));
        let mut again = page(7);
        again.extend(page(1));
        again[PAGE_SIZE + 9] = 2;
        let n = c.shrink(1, &mut again, PAGE_SIZE).expect("a short delta");
        assert_eq!(
            again.len(),
            PAGE_SIZE + 2 + n,
            "the page became len and delta"
        );
        assert!(again[..PAGE_SIZE] == page(7), "what came before it stays");
        let mut there = page(1);
        delta::apply(&mut there, &again[PAGE_SIZE + 2..]).unwrap();
        assert_eq!(there[9], 2);
        assert!(
            c.get(1).unwrap() == there.as_slice(),
            "the new copy is remembered"
        );
    }
}
