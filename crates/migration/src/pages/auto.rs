//! What `auto` learns from beside the frames a sender writes: how fast the connection's send
//! queue drains (`QueueProbe`), and samples of a frame's pages packed with a codec it means to
//! measure again while the frame goes plain (`Sample`).

use std::time::{Duration, Instant};

use super::policy::{Chooser, SAMPLE_SHARE};
use crate::error::Result;
use crate::io::transport::Stream;
use crate::memory::GuestRam;
use crate::wire::codec::{Codec, Contexts};

/// A send queue holding this much is busy: the link, not the sender, sets the pace.
const BUSY_QUEUE: u64 = 256 * 1024;
/// A drain sample spans at least this long: a short span can catch a burst (loopback, a
/// shaper's bucket) far above the link's rate.
const MIN_SPAN: Duration = Duration::from_millis(1);

/// A handle on a sender's connection, to see how fast its send queue drains.
pub(super) struct QueueProbe {
    stream: Stream,
    /// The last look: when, bytes drained so far, bytes still queued.
    last: Option<(Instant, u64, u64)>,
}

impl QueueProbe {
    pub fn new(stream: Stream) -> Self {
        Self { stream, last: None }
    }

    /// The link's drain rate (bytes/s) since the last look, `written` bytes having gone into
    /// the queue so far, when the queue stayed busy through it (otherwise the link may have
    /// idled: none).
    pub fn look(&mut self, written: u64) -> Option<f64> {
        let queued = self.stream.unsent() as u64;
        let now = Instant::now();
        let drained = written.saturating_sub(queued);
        let mut rate = None;
        if let Some((then, drained_then, queued_then)) = self.last {
            let span = now.duration_since(then);
            if span < MIN_SPAN && queued >= BUSY_QUEUE {
                // Too short to tell a rate from a burst: the next look measures from `then`.
                return None;
            }
            if queued_then >= BUSY_QUEUE && queued >= BUSY_QUEUE && drained > drained_then {
                rate = Some((drained - drained_then) as f64 / span.as_secs_f64());
            }
        }
        self.last = Some((now, drained, queued));
        rate
    }
}

/// `auto`'s sample of a frame's pages, and what a codec made of it (kept for the next one).
#[derive(Default)]
pub(super) struct Sample {
    raw: Vec<u8>,
    packed: Vec<u8>,
}

impl Sample {
    /// Packs one page in `SAMPLE_SHARE` of `pages` with `codec` and tells `chooser` how it
    /// did; the copy out of guest memory counts, as it does for a packed frame.
    pub fn measure(
        &mut self,
        ram: &GuestRam,
        pages: impl Iterator<Item = u64>,
        codec: Codec,
        contexts: &mut Contexts,
        chooser: &mut Chooser,
    ) -> Result<()> {
        contexts.prepare(codec)?;
        let started = Instant::now();
        self.raw.clear();
        self.packed.clear();
        for pfn in pages.step_by(SAMPLE_SHARE) {
            self.raw.extend_from_slice(ram.page(pfn)?);
        }
        codec.compress(&self.raw, &mut self.packed, contexts)?;
        chooser.learn_sample(codec, self.raw.len(), self.packed.len(), started.elapsed());
        Ok(())
    }
}
