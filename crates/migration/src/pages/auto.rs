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

/// A window of drain samples in which the receiver's window held TCP back for more than this
/// share of the time measured the receiver (writing into memory it first touches, or sharing
/// the sender's cores), not the link: the receiver would take packed pages no sooner.
const RECEIVER_BOUND: f64 = 0.5;
/// How long a window of drain samples lasts before it is judged: TCP counts the time the
/// receiver held it back in jiffies (up to 4 ms each), so a window spans several.
const WINDOW: Duration = Duration::from_millis(32);
/// Drain samples held back at most per window (one per frame sent; a window holds far fewer).
const WINDOW_SAMPLES: usize = 64;

/// A handle on a sender's connection, to see how fast its send queue drains.
pub(super) struct QueueProbe {
    stream: Stream,
    /// The last look: when, bytes drained so far, bytes still queued.
    last: Option<(Instant, u64, u64)>,
    /// The window being gathered: when it began, how long TCP had been held back by the
    /// receiver's window by then, and its drain samples, held until the window is judged.
    window: Option<(Instant, Duration)>,
    pending: Vec<f64>,
}

impl QueueProbe {
    pub fn new(stream: Stream) -> Self {
        Self {
            stream,
            last: None,
            window: None,
            pending: Vec::new(),
        }
    }

    /// Hands `learn` the link's drain rates (bytes/s) measured so far, `written` bytes having
    /// gone into the queue: one per look that the queue stayed busy since the one before
    /// (otherwise the link may have idled), given once their window is judged not bound by
    /// the receiver (`RECEIVER_BOUND`; on a stream that is not TCP, every one). True when
    /// this look judged a window the receiver's.
    pub fn look(&mut self, written: u64, learn: impl FnMut(f64)) -> bool {
        if let Some(rate) = self.drain_rate(written)
            && self.pending.len() < WINDOW_SAMPLES
        {
            self.pending.push(rate);
        }
        self.judge_window(learn)
    }

    /// The drain rate since the last look, when the queue stayed busy through it.
    fn drain_rate(&mut self, written: u64) -> Option<f64> {
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

    /// Once the window has lasted `WINDOW`, gives its samples to `learn` unless the receiver
    /// held TCP back for most of it (then true), and starts the next. TCP is asked only then:
    /// this runs once per frame sent.
    fn judge_window(&mut self, learn: impl FnMut(f64)) -> bool {
        let now = Instant::now();
        if let Some((began, _)) = self.window
            && now.duration_since(began) < WINDOW
        {
            return false;
        }
        let Some(held_back) = self.stream.receiver_limited() else {
            self.pending.drain(..).for_each(learn);
            return false;
        };
        let Some((began, held_back_then)) = self.window.replace((now, held_back)) else {
            return false;
        };
        let span = now.duration_since(began).as_secs_f64();
        if held_back.saturating_sub(held_back_then).as_secs_f64() > RECEIVER_BOUND * span {
            self.pending.clear();
            return true;
        }
        self.pending.drain(..).for_each(learn);
        false
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{ErrorKind, Read, Write};
    use std::net::{TcpListener, TcpStream};

    /// A receiver slower than the link (one writing into memory it first touches) drains the
    /// send queue at its own pace: that is not the link's rate, and `auto` must not price
    /// plain frames by it (it compressed for a link plain moved sooner).
    #[test]
    fn a_slow_receiver_is_not_taken_for_the_link() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let tx = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (mut rx, _) = listener.accept().unwrap();
        let reader = std::thread::spawn(move || {
            let mut buf = [0u8; 16 * 1024];
            for _ in 0..300 {
                if matches!(rx.read(&mut buf), Ok(0) | Err(_)) {
                    break;
                }
                std::thread::sleep(Duration::from_millis(1));
            }
        });
        tx.set_nonblocking(true).unwrap();
        let mut probe = QueueProbe::new(Stream::Tcp(tx.try_clone().unwrap()));
        let chunk = vec![7u8; 64 * 1024];
        let (mut written, mut busy_looks, mut rates) = (0u64, 0, Vec::new());
        let mut last_drained = 0;
        for _ in 0..100 {
            loop {
                match (&tx).write(&chunk) {
                    Ok(n) => written += n as u64,
                    Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                    Err(e) => panic!("{e}"),
                }
            }
            std::thread::sleep(Duration::from_millis(2));
            let queued = probe.stream.unsent() as u64;
            let drained = written - queued;
            if queued >= BUSY_QUEUE && drained > last_drained {
                busy_looks += 1;
            }
            last_drained = drained;
            probe.look(written, |rate| rates.push(rate));
        }
        drop(tx);
        drop(probe);
        reader.join().unwrap();
        assert!(
            busy_looks > 10,
            "the queue stayed busy and drained: {busy_looks} looks"
        );
        assert!(
            rates.is_empty(),
            "the receiver's pace taken for the link: {rates:?}"
        );
    }
}
