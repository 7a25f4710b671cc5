//! What `auto` learns from beside the frames a sender writes: how fast the connection
//! delivers, window by window (`LinkProbe`), and samples of a frame's pages packed with a
//! codec it means to measure again while the frame goes plain (`Sample`).

use std::time::{Duration, Instant};

use super::policy::{Chooser, LinkSample, SAMPLE_SHARE};
use crate::error::Result;
use crate::io::transport::{SendingTimes, Stream};
use crate::memory::GuestRam;
use crate::wire::codec::{Codec, Contexts};

/// A window in which TCP had data to send for less than this share of the time was paced by
/// the sender (packing, finding pages): the link would have taken more.
const WITH_DATA: f64 = 0.9;
/// A window of the link's delivery that the receiver's window held TCP back for more than
/// this share of measured the receiver (writing into memory it first touches, or sharing
/// the sender's cores), not the link: the receiver would take packed pages no sooner.
const RECEIVER_BOUND: f64 = 0.5;
/// How long a window of delivery lasts before it is judged: long beside a shaper's burst
/// (a token bucket lets one through far above the link's rate) and beside TCP's count of the
/// time the receiver held it back, in jiffies of up to 4 ms.
const WINDOW: Duration = Duration::from_millis(32);

/// What a probe asks of a connection: bytes written and not yet taken by the peer, and
/// TCP's account of its time.
pub(super) trait SendQueue {
    fn unsent(&self) -> usize;
    fn sending_times(&self) -> Option<SendingTimes>;
}

impl SendQueue for Stream {
    fn unsent(&self) -> usize {
        Stream::unsent(self)
    }
    fn sending_times(&self) -> Option<SendingTimes> {
        Stream::sending_times(self)
    }
}

/// A handle on a sender's connection, to see how fast it delivers.
pub(super) struct LinkProbe<Q = Stream> {
    stream: Q,
    window: Option<Window>,
}

/// The window being gathered: when it began, bytes delivered by then, and TCP's times then.
struct Window {
    began: Instant,
    delivered: u64,
    times: Option<SendingTimes>,
}

impl<Q: SendQueue> LinkProbe<Q> {
    pub fn new(stream: Q) -> Self {
        Self {
            stream,
            window: None,
        }
    }

    /// A look after a frame, `written` bytes having gone into the connection so far: once
    /// the window has lasted `WINDOW`, what it showed of the link, and the next one begins.
    pub fn look(&mut self, written: u64) -> Option<LinkSample> {
        let now = Instant::now();
        let Some(w) = self.window.as_ref() else {
            self.begin(now, written);
            return None;
        };
        let span = now.duration_since(w.began);
        if span < WINDOW {
            return None;
        }
        // TCP is asked only here: a look comes once per frame sent.
        let delivered = written.saturating_sub(self.stream.unsent() as u64);
        let times = self.stream.sending_times();
        let span_s = span.as_secs_f64();
        let share = |d: Duration| d.as_secs_f64() / span_s;
        let saturated = match (times, w.times) {
            (Some(now), Some(then)) => {
                share(now.with_data.saturating_sub(then.with_data)) >= WITH_DATA
                    && share(now.receiver_held.saturating_sub(then.receiver_held)) <= RECEIVER_BOUND
            }
            _ => false,
        };
        let sample = LinkSample {
            rate: delivered.saturating_sub(w.delivered) as f64 / span_s,
            saturated,
        };
        self.window = Some(Window {
            began: now,
            delivered,
            times,
        });
        Some(sample)
    }

    /// Forgets the window being gathered: the sender stops writing for a while (a round
    /// ended), and a window spanning that pause would measure the pause.
    pub fn restart(&mut self) {
        self.window = None;
    }

    fn begin(&mut self, now: Instant, written: u64) {
        self.window = Some(Window {
            began: now,
            delivered: written.saturating_sub(self.stream.unsent() as u64),
            times: self.stream.sending_times(),
        });
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
    /// send queue at its own pace: that is no measure of the link (only a floor under it), and
    /// `auto` must not price plain frames by it (it compressed for a link plain moved sooner).
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
        let mut probe = LinkProbe::new(Stream::Tcp(tx.try_clone().unwrap()));
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
            if queued >= 256 * 1024 && drained > last_drained {
                busy_looks += 1;
            }
            last_drained = drained;
            rates.extend(probe.look(written));
        }
        drop(tx);
        drop(probe);
        reader.join().unwrap();
        assert!(
            busy_looks > 10,
            "the queue stayed busy and drained: {busy_looks} looks"
        );
        assert!(!rates.is_empty(), "no window judged");
        assert!(
            rates.iter().all(|s| !s.saturated),
            "the receiver's pace taken for the link's: {rates:?}"
        );
    }

    /// A scripted connection: since it was made, TCP had data to send `with_data` of the
    /// time, and the receiver held it back `receiver_held` of it.
    struct Scripted {
        made: Instant,
        with_data: f64,
        receiver_held: f64,
    }

    impl SendQueue for Scripted {
        fn unsent(&self) -> usize {
            0
        }
        fn sending_times(&self) -> Option<SendingTimes> {
            let t = self.made.elapsed();
            Some(SendingTimes {
                with_data: t.mul_f64(self.with_data),
                receiver_held: t.mul_f64(self.receiver_held),
            })
        }
    }

    /// A frame of 1 MiB every 2 ms for two windows: what the second showed.
    fn second_window(with_data: f64, receiver_held: f64) -> LinkSample {
        let mut probe = LinkProbe::new(Scripted {
            made: Instant::now(),
            with_data,
            receiver_held,
        });
        let mut written = 0;
        let mut samples = Vec::new();
        while samples.len() < 2 {
            written += 1 << 20;
            samples.extend(probe.look(written));
            std::thread::sleep(Duration::from_millis(2));
        }
        samples[1]
    }

    /// A window is the link's only where TCP had data to send nearly all of it and the
    /// receiver did not hold it back: one the sender paced (TCP idle between its frames) is a
    /// floor under the link's rate, and so is one the receiver paced.
    #[test]
    fn a_window_is_the_links_only_where_tcp_always_had_data() {
        let sender_paced = second_window(0.3, 0.0);
        assert!(!sender_paced.saturated, "{sender_paced:?}");
        assert!(sender_paced.rate > 0.0);
        let link_paced = second_window(1.0, 0.0);
        assert!(link_paced.saturated, "{link_paced:?}");
        let receiver_paced = second_window(1.0, 0.8);
        assert!(!receiver_paced.saturated, "{receiver_paced:?}");
    }

    /// A window does not span a pause in the sending (a round's end): it starts again.
    #[test]
    fn a_restart_forgets_the_window() {
        let mut probe = LinkProbe::new(Scripted {
            made: Instant::now(),
            with_data: 1.0,
            receiver_held: 0.0,
        });
        assert_eq!(probe.look(1 << 20), None, "the first look begins one");
        std::thread::sleep(WINDOW);
        probe.restart();
        assert_eq!(probe.look(2 << 20), None, "begun again, not judged");
        std::thread::sleep(WINDOW);
        assert!(probe.look(3 << 20).is_some());
    }
}
