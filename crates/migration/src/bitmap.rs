//! A page bitmap in the layout KVM's dirty log uses: bit `pfn % 64` of word `pfn / 64`.

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Bitmap {
    words: Vec<u64>,
    pages: u64,
}

impl Bitmap {
    pub fn new(pages: u64) -> Self {
        Self {
            words: vec![0; pages.div_ceil(64) as usize],
            pages,
        }
    }

    /// Wraps a KVM dirty-log bitmap of `pages` pages.
    pub fn from_words(words: Vec<u64>, pages: u64) -> Self {
        let mut b = Self { words, pages };
        b.words.resize(pages.div_ceil(64) as usize, 0);
        b
    }

    pub fn pages(&self) -> u64 {
        self.pages
    }

    pub fn set(&mut self, pfn: u64) {
        if pfn < self.pages {
            self.words[(pfn / 64) as usize] |= 1 << (pfn % 64);
        }
    }

    pub fn unset(&mut self, pfn: u64) {
        if pfn < self.pages {
            self.words[(pfn / 64) as usize] &= !(1 << (pfn % 64));
        }
    }

    pub fn words(&self) -> &[u64] {
        &self.words
    }

    pub fn words_mut(&mut self) -> &mut [u64] {
        &mut self.words
    }

    pub fn get(&self, pfn: u64) -> bool {
        pfn < self.pages && self.words[(pfn / 64) as usize] & (1 << (pfn % 64)) != 0
    }

    /// Sets every bit of `other` here too.
    pub fn merge(&mut self, other: &Bitmap) {
        for (a, b) in self.words.iter_mut().zip(&other.words) {
            *a |= *b;
        }
    }

    /// Sets the bits of `other` here, shifted up by `offset` pages (a memory slot's log into
    /// the guest's page numbering).
    pub fn merge_at(&mut self, offset: u64, other: &Bitmap) {
        self.merge_words_at(offset, &other.words);
    }

    /// `merge_at` for a bitmap given as its words (a slot's dirty log read into a reused
    /// buffer); bits past this bitmap's end are ignored.
    pub fn merge_words_at(&mut self, offset: u64, words: &[u64]) {
        if offset.is_multiple_of(64) {
            let first = ((offset / 64) as usize).min(self.words.len());
            for (a, b) in self.words[first..].iter_mut().zip(words) {
                *a |= *b;
            }
            let tail = self.pages % 64;
            if let (Some(last), true) = (self.words.last_mut(), tail != 0) {
                *last &= (1u64 << tail) - 1;
            }
        } else {
            for (i, &w) in words.iter().enumerate() {
                let mut w = w;
                while w != 0 {
                    let bit = u64::from(w.trailing_zeros());
                    w &= w - 1;
                    self.set(offset + i as u64 * 64 + bit);
                }
            }
        }
    }

    /// Clears every bit of `other` here.
    pub fn subtract(&mut self, other: &Bitmap) {
        for (a, b) in self.words.iter_mut().zip(&other.words) {
            *a &= !*b;
        }
    }

    pub fn count(&self) -> u64 {
        self.words.iter().map(|w| u64::from(w.count_ones())).sum()
    }

    pub fn clear(&mut self) {
        self.words.fill(0);
    }

    /// Set pages in ascending order.
    pub fn iter(&self) -> impl Iterator<Item = u64> + '_ {
        self.words.iter().enumerate().flat_map(|(i, &w)| {
            let mut w = w;
            std::iter::from_fn(move || {
                if w == 0 {
                    return None;
                }
                let bit = w.trailing_zeros();
                w &= w - 1;
                Some(i as u64 * 64 + u64::from(bit))
            })
        })
    }
}

/// A page bitmap several threads set and read at once (post-copy's "page is here").
pub struct AtomicBitmap {
    words: Vec<std::sync::atomic::AtomicU64>,
    pages: u64,
}

impl AtomicBitmap {
    pub fn new(pages: u64) -> Self {
        Self {
            words: (0..pages.div_ceil(64))
                .map(|_| std::sync::atomic::AtomicU64::new(0))
                .collect(),
            pages,
        }
    }

    /// Sets the bit; returns whether it was already set.
    pub fn set(&self, pfn: u64) -> bool {
        if pfn >= self.pages {
            return true;
        }
        let bit = 1 << (pfn % 64);
        self.words[(pfn / 64) as usize].fetch_or(bit, std::sync::atomic::Ordering::AcqRel) & bit
            != 0
    }

    pub fn get(&self, pfn: u64) -> bool {
        pfn < self.pages
            && self.words[(pfn / 64) as usize].load(std::sync::atomic::Ordering::Acquire)
                & (1 << (pfn % 64))
                != 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_slot_log_lands_at_its_offset_aligned_or_not() {
        let mut slot = Bitmap::new(100);
        for pfn in [0, 63, 64, 99] {
            slot.set(pfn);
        }
        for offset in [0, 64, 3, 70] {
            let mut all = Bitmap::new(160);
            all.merge_words_at(offset, slot.words());
            let got: Vec<u64> = all.iter().collect();
            let want: Vec<u64> = [0, 63, 64, 99]
                .iter()
                .map(|p| p + offset)
                .filter(|&p| p < 160)
                .collect();
            assert_eq!(got, want, "offset {offset}");
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
        b.clear();
        assert_eq!(b.count(), 0);
    }
}
