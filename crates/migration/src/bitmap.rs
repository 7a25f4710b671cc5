//! Page bitmaps in the layout KVM's dirty log uses (bit `pfn % 64` of word `pfn / 64`),
//! kept in chunks of `CHUNK_WORDS` words that exist only once a bit in them is set. A guest of
//! 256 GiB has 64 Mi pages: a dense bitmap of them is 8 MiB that every migration would fault
//! in, clear and walk although an idle guest holds data in a few thousand pages. In chunks,
//! what a bitmap costs follows the pages set, plus one pointer per 16 MiB of guest memory.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};

/// Words in a chunk: 4096 pages, 16 MiB of guest memory.
pub const CHUNK_WORDS: usize = 64;
const CHUNK_PAGES: u64 = CHUNK_WORDS as u64 * 64;

type Chunk = Box<[u64; CHUNK_WORDS]>;

#[derive(Clone, Debug, Default)]
pub struct Bitmap {
    chunks: Vec<Option<Chunk>>,
    pages: u64,
}

impl PartialEq for Bitmap {
    fn eq(&self, other: &Self) -> bool {
        self.pages == other.pages && self.nonzero_words().eq(other.nonzero_words())
    }
}

impl Eq for Bitmap {}

impl Bitmap {
    pub fn new(pages: u64) -> Self {
        Self {
            chunks: vec![None; pages.div_ceil(CHUNK_PAGES) as usize],
            pages,
        }
    }

    /// A bitmap of `pages` pages from its dense words (a KVM dirty log, a test's map); bits
    /// past `pages` are dropped.
    pub fn from_words(words: &[u64], pages: u64) -> Self {
        let mut b = Self::new(pages);
        b.merge_words_at(0, words);
        b
    }

    /// A bitmap of `pages` pages from its non-zero words, as `nonzero_words` gives them.
    /// Refuses a word past the end or out of order (a map from the wire).
    pub fn from_nonzero_words(
        pages: u64,
        words: impl IntoIterator<Item = (u64, u64)>,
    ) -> Result<Self, String> {
        let mut b = Self::new(pages);
        let mut next = 0u64;
        for (index, word) in words {
            if index < next || index >= pages.div_ceil(64) {
                return Err(format!(
                    "word {index} of a page map of {pages} pages (out of order or past its end)"
                ));
            }
            next = index + 1;
            b.or_word(index as usize, word);
        }
        Ok(b)
    }

    pub fn pages(&self) -> u64 {
        self.pages
    }

    fn chunk_mut(&mut self, word: usize) -> &mut [u64; CHUNK_WORDS] {
        self.chunks[word / CHUNK_WORDS].get_or_insert_with(|| Box::new([0; CHUNK_WORDS]))
    }

    /// Word `index` (0 past the end or in a chunk never set).
    pub fn word(&self, index: usize) -> u64 {
        match self.chunks.get(index / CHUNK_WORDS) {
            Some(Some(c)) => c[index % CHUNK_WORDS],
            _ => 0,
        }
    }

    /// Words this bitmap has: `pages` rounded up to 64.
    pub fn word_count(&self) -> usize {
        self.pages.div_ceil(64) as usize
    }

    /// ORs `w` into word `index`; bits past the last page are dropped.
    pub fn or_word(&mut self, index: usize, w: u64) {
        let last = self.word_count();
        let w = match self.pages % 64 {
            tail if index + 1 == last && tail != 0 => w & ((1u64 << tail) - 1),
            _ => w,
        };
        if w != 0 && index < last {
            self.chunk_mut(index)[index % CHUNK_WORDS] |= w;
        }
    }

    pub fn set(&mut self, pfn: u64) {
        if pfn < self.pages {
            self.chunk_mut((pfn / 64) as usize)[((pfn / 64) as usize) % CHUNK_WORDS] |=
                1 << (pfn % 64);
        }
    }

    pub fn unset(&mut self, pfn: u64) {
        if let Some(Some(c)) = self.chunks.get_mut((pfn / CHUNK_PAGES) as usize) {
            c[((pfn / 64) as usize) % CHUNK_WORDS] &= !(1 << (pfn % 64));
        }
    }

    pub fn get(&self, pfn: u64) -> bool {
        pfn < self.pages && self.word((pfn / 64) as usize) & (1 << (pfn % 64)) != 0
    }

    /// The words that have a bit set, with their index, in ascending order.
    pub fn nonzero_words(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.chunks
            .iter()
            .enumerate()
            .filter_map(|(i, c)| c.as_ref().map(|c| (i, c)))
            .flat_map(|(i, c)| {
                c.iter()
                    .enumerate()
                    .filter(|&(_, &w)| w != 0)
                    .map(move |(j, &w)| ((i * CHUNK_WORDS + j) as u64, w))
            })
    }

    /// The chunks that exist, as (index of their first word, words), in ascending order.
    pub fn chunks(&self) -> impl Iterator<Item = (usize, &[u64; CHUNK_WORDS])> + '_ {
        self.chunks
            .iter()
            .enumerate()
            .filter_map(|(i, c)| c.as_deref().map(|c| (i * CHUNK_WORDS, c)))
    }

    /// Whether any of the `len` words from word `first` on lies in a chunk that exists (a bit
    /// in it was set since the bitmap was made or cleared).
    pub fn any_chunk_in(&self, first: usize, len: usize) -> bool {
        if len == 0 {
            return false;
        }
        let last = ((first + len - 1) / CHUNK_WORDS).min(self.chunks.len().saturating_sub(1));
        let chunks = self
            .chunks
            .get(first / CHUNK_WORDS..=last)
            .unwrap_or_default();
        chunks.iter().any(Option::is_some)
    }

    /// ANDs `words` (dense, word `first` of this bitmap first) with this bitmap's words.
    pub fn mask(&self, first: usize, words: &mut [u64]) {
        for (i, w) in words.iter_mut().enumerate() {
            if *w != 0 {
                *w &= self.word(first + i);
            }
        }
    }

    /// Sets every bit of `other` here too.
    pub fn merge(&mut self, other: &Bitmap) {
        for (i, w) in other.nonzero_words() {
            self.or_word(i as usize, w);
        }
    }

    /// Sets the bits of `other` here, shifted up by `offset` pages (a memory slot's log into
    /// the guest's page numbering).
    pub fn merge_at(&mut self, offset: u64, other: &Bitmap) {
        for (i, w) in other.nonzero_words() {
            self.merge_word_at(offset + i * 64, w);
        }
    }

    /// `merge_at` for a bitmap given as its dense words (a slot's dirty log read into a
    /// reused buffer); bits past this bitmap's end are ignored.
    pub fn merge_words_at(&mut self, offset: u64, words: &[u64]) {
        for (i, &w) in words.iter().enumerate() {
            if w != 0 {
                self.merge_word_at(offset + i as u64 * 64, w);
            }
        }
    }

    /// ORs the 64 pages of `w` in, from page `first` on.
    fn merge_word_at(&mut self, first: u64, w: u64) {
        if first.is_multiple_of(64) {
            self.or_word((first / 64) as usize, w);
            return;
        }
        let mut w = w;
        while w != 0 {
            let bit = u64::from(w.trailing_zeros());
            w &= w - 1;
            self.set(first + bit);
        }
    }

    /// Clears every bit of `other` here.
    pub fn subtract(&mut self, other: &Bitmap) {
        for (i, c) in self.chunks.iter_mut().enumerate() {
            if let (Some(c), Some(Some(o))) = (c.as_mut(), other.chunks.get(i)) {
                for (a, b) in c.iter_mut().zip(o.iter()) {
                    *a &= !*b;
                }
            }
        }
    }

    pub fn count(&self) -> u64 {
        self.nonzero_words()
            .map(|(_, w)| u64::from(w.count_ones()))
            .sum()
    }

    pub fn clear(&mut self) {
        self.chunks.iter_mut().for_each(|c| *c = None);
    }

    /// Set pages in ascending order.
    pub fn iter(&self) -> impl Iterator<Item = u64> + '_ {
        self.nonzero_words().flat_map(|(i, w)| {
            let mut w = w;
            std::iter::from_fn(move || {
                if w == 0 {
                    return None;
                }
                let bit = w.trailing_zeros();
                w &= w - 1;
                Some(i * 64 + u64::from(bit))
            })
        })
    }
}

/// A page bitmap several threads set and read at once (post-copy's "page is here"), in
/// chunks made when a bit in them is first set.
pub struct AtomicBitmap {
    chunks: Vec<OnceLock<Box<[AtomicU64; CHUNK_WORDS]>>>,
    pages: u64,
}

impl AtomicBitmap {
    pub fn new(pages: u64) -> Self {
        Self {
            chunks: (0..pages.div_ceil(CHUNK_PAGES))
                .map(|_| OnceLock::new())
                .collect(),
            pages,
        }
    }

    /// Sets the bit; returns whether it was already set.
    pub fn set(&self, pfn: u64) -> bool {
        if pfn >= self.pages {
            return true;
        }
        let chunk = self.chunks[(pfn / CHUNK_PAGES) as usize]
            .get_or_init(|| Box::new(std::array::from_fn(|_| AtomicU64::new(0))));
        let bit = 1 << (pfn % 64);
        chunk[((pfn / 64) as usize) % CHUNK_WORDS].fetch_or(bit, Ordering::AcqRel) & bit != 0
    }

    pub fn get(&self, pfn: u64) -> bool {
        if pfn >= self.pages {
            return false;
        }
        self.chunks[(pfn / CHUNK_PAGES) as usize]
            .get()
            .is_some_and(|c| {
                c[((pfn / 64) as usize) % CHUNK_WORDS].load(Ordering::Acquire) & (1 << (pfn % 64))
                    != 0
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dense(b: &Bitmap) -> Vec<u64> {
        (0..b.pages().div_ceil(64) as usize)
            .map(|i| b.word(i))
            .collect()
    }

    #[test]
    fn any_chunk_in_sees_the_chunks_that_hold_bits() {
        let mut b = Bitmap::new(CHUNK_PAGES * 4);
        assert!(!b.any_chunk_in(0, CHUNK_WORDS * 4));
        b.set(CHUNK_PAGES * 2 + 5);
        assert!(b.any_chunk_in(CHUNK_WORDS * 2, CHUNK_WORDS));
        assert!(
            b.any_chunk_in(CHUNK_WORDS + 1, CHUNK_WORDS),
            "straddling into it"
        );
        assert!(!b.any_chunk_in(0, CHUNK_WORDS * 2));
        assert!(
            !b.any_chunk_in(CHUNK_WORDS * 3, CHUNK_WORDS * 8),
            "past the end"
        );
        assert!(!b.any_chunk_in(CHUNK_WORDS * 2, 0));
    }

    #[test]
    fn a_slot_log_lands_at_its_offset_aligned_or_not() {
        let mut slot = Bitmap::new(100);
        for pfn in [0, 63, 64, 99] {
            slot.set(pfn);
        }
        for offset in [0, 64, 3, 70] {
            let mut all = Bitmap::new(160);
            all.merge_words_at(offset, &dense(&slot));
            let got: Vec<u64> = all.iter().collect();
            let want: Vec<u64> = [0, 63, 64, 99]
                .iter()
                .map(|p| p + offset)
                .filter(|&p| p < 160)
                .collect();
            assert_eq!(got, want, "offset {offset}");
            let mut again = Bitmap::new(160);
            again.merge_at(offset, &slot);
            assert_eq!(again, all, "offset {offset}");
        }
    }

    #[test]
    fn set_get_iterate_merge() {
        let mut a = Bitmap::new(130);
        for p in [0, 63, 64, 129, 500] {
            a.set(p);
        }
        assert_eq!(a.iter().collect::<Vec<_>>(), vec![0, 63, 64, 129]);
        assert_eq!(a.count(), 4);
        let mut b = Bitmap::new(130);
        b.set(1);
        b.merge(&a);
        assert_eq!(b.count(), 5);
        assert!(b.get(1) && b.get(129) && !b.get(2));
        b.subtract(&a);
        assert_eq!(b.iter().collect::<Vec<_>>(), vec![1]);
        b.clear();
        assert_eq!(b.count(), 0);
    }

    #[test]
    fn chunks_exist_only_where_a_bit_was_set() {
        // 64 GiB of pages: one chunk per 16 MiB, none made until a bit is set in it.
        let mut b = Bitmap::new(16 << 20);
        assert_eq!(b.chunks().count(), 0);
        b.set(5);
        b.set((16 << 20) - 1);
        assert_eq!(
            b.chunks().map(|(first, _)| first).collect::<Vec<_>>(),
            vec![0, 262_080]
        );
        assert_eq!(b.iter().collect::<Vec<_>>(), vec![5, (16 << 20) - 1]);
        b.unset(5);
        b.unset(1 << 30); // past the end, in no chunk: nothing to do
        assert_eq!(b.count(), 1);
        // Equal bitmaps are equal whatever chunks they made on the way.
        let mut c = Bitmap::new(16 << 20);
        c.set((16 << 20) - 1);
        assert_eq!(b, c);
    }

    #[test]
    fn words_from_the_wire_must_be_in_order_and_inside() {
        let b = Bitmap::from_nonzero_words(130, [(0, 1), (2, u64::MAX)]).unwrap();
        // Bits past the last page are dropped.
        assert_eq!(b.iter().collect::<Vec<_>>(), vec![0, 128, 129]);
        assert!(Bitmap::from_nonzero_words(130, [(3, 1)]).is_err());
        assert!(Bitmap::from_nonzero_words(130, [(1, 1), (0, 1)]).is_err());
    }

    #[test]
    fn masking_keeps_only_what_both_hold() {
        let mut held = Bitmap::new(256);
        held.set(64);
        held.set(200);
        let mut words = [u64::MAX; 3];
        held.mask(1, &mut words);
        assert_eq!(words, [1, 0, 1 << 8]);
    }

    #[test]
    fn an_atomic_bitmap_sets_once() {
        let b = AtomicBitmap::new(10_000);
        assert!(!b.get(9_000));
        assert!(!b.set(9_000));
        assert!(b.set(9_000));
        assert!(b.get(9_000) && !b.get(8_999));
        assert!(b.set(10_000), "past the end counts as set");
    }
}
