//! The order in which post-copy pushes pages (Hines & Gopalan's "bubbling").
//!
//! `Linear` pushes from the lowest page up and ignores faults (push only). `Bubble` grows a
//! window in both directions around a pivot; each page request moves the pivot to the faulted
//! page and restarts the window there, because the guest is likely to touch its neighbours
//! next. Either way each page leaves at most once: `take` claims a page for a request and the
//! planner never yields a claimed page.

use crate::bitmap::Bitmap;

#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Strategy {
    Linear,
    Bubble,
}

pub struct Planner {
    /// Pages still to send.
    todo: Bitmap,
    left: u64,
    strategy: Strategy,
    pivot: u64,
    /// Next distances to try above and below the pivot.
    up: u64,
    down: u64,
    /// Whether the next candidate is taken above the pivot (bubble alternates).
    above_next: bool,
    /// Linear cursor.
    cursor: u64,
}

impl Planner {
    pub fn new(todo: Bitmap, strategy: Strategy) -> Self {
        let left = todo.count();
        Self {
            todo,
            left,
            strategy,
            pivot: 0,
            up: 0,
            down: 1,
            above_next: true,
            cursor: 0,
        }
    }

    pub fn remaining(&self) -> u64 {
        self.left
    }

    /// Claims `pfn` for a page request; false if it was sent already (or never due).
    pub fn take(&mut self, pfn: u64) -> bool {
        if !self.todo.get(pfn) {
            return false;
        }
        self.todo.unset(pfn);
        self.left -= 1;
        true
    }

    /// A fault at `pfn`: the window restarts around it (bubble only).
    pub fn recenter(&mut self, pfn: u64) {
        if self.strategy == Strategy::Bubble {
            self.pivot = pfn;
            self.up = 1;
            self.down = 1;
            self.above_next = true;
        }
    }

    /// The next page to push, claimed.
    pub fn next_page(&mut self) -> Option<u64> {
        if self.left == 0 {
            return None;
        }
        let pfn = match self.strategy {
            Strategy::Linear => self.next_linear()?,
            Strategy::Bubble => self.next_bubble()?,
        };
        self.take(pfn);
        Some(pfn)
    }

    fn next_linear(&mut self) -> Option<u64> {
        while self.cursor < self.todo.pages() {
            let p = self.cursor;
            self.cursor += 1;
            if self.todo.get(p) {
                return Some(p);
            }
        }
        // Requests may have skipped ahead; anything left lies behind the cursor.
        self.todo.iter().next()
    }

    fn next_bubble(&mut self) -> Option<u64> {
        let pages = self.todo.pages();
        loop {
            let above = self.pivot.checked_add(self.up).filter(|&p| p < pages);
            let below = self.pivot.checked_sub(self.down);
            if above.is_none() && below.is_none() {
                // The window covers everything: whatever is left is elsewhere (cannot happen
                // while `left > 0`, but never loop forever).
                return self.todo.iter().next();
            }
            // Alternate one above, one below, widening the window each time.
            let take_above = self.above_next;
            self.above_next = !self.above_next;
            let candidate = if take_above {
                self.up += 1;
                above
            } else {
                self.down += 1;
                below
            };
            if let Some(p) = candidate.filter(|&p| self.todo.get(p)) {
                return Some(p);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn all(pages: u64) -> Bitmap {
        let mut b = Bitmap::new(pages);
        for p in 0..pages {
            b.set(p);
        }
        b
    }

    #[test]
    fn linear_sends_everything_once_in_order() {
        let mut p = Planner::new(all(10), Strategy::Linear);
        assert!(p.take(3));
        assert!(!p.take(3), "a page leaves once");
        let order: Vec<u64> = std::iter::from_fn(|| p.next_page()).collect();
        assert_eq!(order, vec![0, 1, 2, 4, 5, 6, 7, 8, 9]);
        assert_eq!(p.remaining(), 0);
    }

    #[test]
    fn bubble_grows_around_the_last_fault() {
        let mut p = Planner::new(all(100), Strategy::Bubble);
        assert!(p.take(50));
        p.recenter(50);
        let order: Vec<u64> = (0..6).filter_map(|_| p.next_page()).collect();
        assert_eq!(order, vec![51, 49, 52, 48, 53, 47]);
        // A new fault moves the window at once.
        assert!(p.take(10));
        p.recenter(10);
        assert_eq!(p.next_page(), Some(11));
        assert_eq!(p.next_page(), Some(9));
    }

    #[test]
    fn bubble_sends_every_page_exactly_once() {
        let mut todo = Bitmap::new(1000);
        for p in (0..1000).step_by(3) {
            todo.set(p);
        }
        let expected = todo.count();
        let mut p = Planner::new(todo, Strategy::Bubble);
        let mut seen = Bitmap::new(1000);
        let mut sent = 0;
        for fault in [500u64, 999, 0, 333] {
            if p.take(fault) {
                seen.set(fault);
                sent += 1;
            }
            p.recenter(fault);
            for _ in 0..50 {
                if let Some(x) = p.next_page() {
                    assert!(!seen.get(x), "page {x} twice");
                    assert_eq!(x % 3, 0, "page {x} was never due");
                    seen.set(x);
                    sent += 1;
                }
            }
        }
        while let Some(x) = p.next_page() {
            assert!(!seen.get(x), "page {x} twice");
            seen.set(x);
            sent += 1;
        }
        assert_eq!(sent, expected);
    }
}
