//! Post-copy's pushes: which pages are still to leave and who sends each (`Claims`), how much
//! a pushing connection may keep queued ahead of an answer (`PushQueue`), and an extra
//! connection's pushes (`push_on_lane`). Serving them is `postcopy`.

use crate::sync::Locked;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use super::lane::Lane;
use crate::PAGE_SIZE;
use crate::bitmap::{AtomicBitmap, Bitmap};
use crate::error::{Error, Result};
use crate::io::transport::{IO_TIMEOUT, Stream};
use crate::memory::GuestRam;
use crate::prepaging::{Planner, Strategy};
use crate::wire::Message;

/// Pages a lane takes from the planner at once: a frame's worth, so that the planner's lock
/// is taken once a frame, and a fault's new window reaches the lanes within a frame each.
const LANE_BATCH: usize = 128;

/// How many pushed bytes may wait in the socket and on the link at once. A page request's
/// reply leaves behind whatever is queued, so a queue as deep as the kernel allows (megabytes:
/// tens of ms on 1 Gbit/s) is a fault that waits that long. Kept to what keeps the link busy —
/// its bandwidth-delay product, from TCP's own estimates, with a quarter more so that a limit
/// too small for the link grows by a quarter a round trip — plus `PUSH_QUEUE_SLACK` of its
/// rate, within these bounds. It starts at the floor: right after the switch is when the guest
/// faults most. A stream that is not TCP has no link to queue on and no limit but the ceiling.
const PUSH_QUEUE_MIN: usize = 256 << 10;
const PUSH_QUEUE_MAX: usize = 64 << 20;
const PUSH_QUEUE_SLACK: Duration = Duration::from_millis(1);
/// How often the limit is sized again.
const PUSH_QUEUE_EVERY: Duration = Duration::from_millis(10);
/// How long the pusher waits for a request while the queue is full.
pub(super) const QUEUE_FULL_WAIT: Duration = Duration::from_micros(200);

/// How often the destination says how many pages it took off a pushing connection
/// (`Receipts`): a lane's batch.
pub(super) const RECEIPT_EVERY: u32 = LANE_BATCH as u32;
/// The fewest pages a pushing connection may have out that the destination has not taken off
/// it yet. The bytes on the link say nothing of what waits in the destination's socket and
/// install queue: a page that compresses a hundredfold makes a megabyte there a hundred
/// megabytes of pages to install, each ahead of a reply on the same connection and each
/// claimed by a connection that may be the last to finish. So the pages are counted too,
/// against the byte limit's worth of pages or this, whichever is more. Four receipts' worth
/// keeps pages flowing while a receipt is on its way.
const WINDOW_MIN_PAGES: u64 = 4 * RECEIPT_EVERY as u64;

/// Pages pushed between two looks at the requests over one connection: at most a quarter of
/// the push queue's limit, so that a request waits little for its turn, and no fewer than
/// this, so that a frame's fixed costs (its header, the handing over to an installer on the
/// destination) stay small.
const FEWEST_BATCH_PAGES: usize = 16;

/// The push queue's limit for a connection moving `rate` bytes/s with round trips of at least
/// `min_rtt`, and at least `floor`.
fn queue_limit_for(rate: u64, min_rtt: Duration, floor: usize) -> usize {
    let wanted = rate as f64 * (min_rtt.as_secs_f64() * 1.25 + PUSH_QUEUE_SLACK.as_secs_f64());
    (wanted as usize).clamp(floor, PUSH_QUEUE_MAX)
}

/// A pushing connection's queue: bytes not yet on the link (see `PUSH_QUEUE_MIN`) and pages
/// the destination has not taken off it (see `WINDOW_MIN_PAGES`). Keeps the best rate seen,
/// so that the estimate does not shrink while the limit itself holds the link back.
pub(super) struct PushQueue {
    bytes: usize,
    /// The floor: `PUSH_QUEUE_MIN`, shared out among the connections that push (their queues
    /// all lie on one link, ahead of an answer).
    floor: usize,
    best_rate: u64,
    next_look: Instant,
    /// Pages sent on the connection since the receipts were asked for.
    sent: u64,
    /// Of those, the destination's latest count of what it took off the connection.
    taken: u64,
}

impl PushQueue {
    /// The queue of one of `pushers` connections pushing side by side.
    pub(super) fn shared_by(pushers: usize) -> PushQueue {
        let floor = PUSH_QUEUE_MIN / pushers.max(1);
        PushQueue {
            bytes: floor,
            floor,
            best_rate: 0,
            next_look: Instant::now() + PUSH_QUEUE_EVERY,
            sent: 0,
            taken: 0,
        }
    }

    /// What asks the destination for its receipts on a connection, before the first push.
    pub(super) fn receipts_asked() -> Message {
        Message::Receipts {
            every: RECEIPT_EVERY,
        }
    }

    /// `pages` more pages went out on the connection.
    pub(super) fn sent(&mut self, pages: u64) {
        self.sent += pages;
    }

    /// The destination's receipt: it took `pages` pages off the connection so far.
    pub(super) fn taken(&mut self, pages: u64) -> Result<()> {
        if pages > self.sent || pages < self.taken {
            return Err(Error::Protocol(format!(
                "the destination says it took {pages} pages off a connection that carried {} \
                 (it had said {})",
                self.sent, self.taken
            )));
        }
        self.taken = pages;
        Ok(())
    }

    /// How many pages to push at once over a connection that also answers (see
    /// `FEWEST_BATCH_PAGES`); a lane's batch at most.
    pub(super) fn batch_pages(&self) -> usize {
        (self.bytes / PAGE_SIZE / 4).clamp(FEWEST_BATCH_PAGES, LANE_BATCH)
    }

    /// Whether pushing more now would deepen the queue a reply waits behind.
    pub(super) fn full(&mut self, stream: &Stream) -> bool {
        self.awaits_receipt() || self.link_full(stream)
    }

    /// Whether the destination holds as many pages it has not taken off the connection as
    /// the window allows: pushing waits for its next receipt.
    pub(super) fn awaits_receipt(&self) -> bool {
        let window = (self.bytes / PAGE_SIZE) as u64;
        self.sent - self.taken >= window.max(WINDOW_MIN_PAGES)
    }

    /// Whether the bytes not yet on the link reach the limit.
    fn link_full(&mut self, stream: &Stream) -> bool {
        let now = Instant::now();
        if now >= self.next_look {
            self.next_look = now + PUSH_QUEUE_EVERY;
            self.bytes = match stream.tcp_path() {
                Some((rate, min_rtt)) => {
                    self.best_rate = self.best_rate.max(rate);
                    queue_limit_for(self.best_rate, min_rtt, self.floor)
                }
                // Not TCP (a Unix socket to this host): no link to queue on.
                None => PUSH_QUEUE_MAX,
            };
        }
        stream.unsent() > self.bytes
    }
}

/// No fault to center the pushes on.
const NO_PIVOT: u64 = u64::MAX;

/// The pages still to leave, shared by the thread that answers and the threads that push:
/// each page is claimed once, by whoever sends it. The planner orders the pushes under a lock
/// the answers never wait for (a pushing thread that holds it may be off its core).
pub(super) struct Claims {
    due: Bitmap,
    claimed: AtomicBitmap,
    planner: Mutex<Planner>,
    /// The last fault's page, for the planner to center on at its next batch.
    pivot: AtomicU64,
    /// Pages no one has claimed yet.
    left: AtomicU64,
}

impl Claims {
    pub(super) fn new(pending: Bitmap, strategy: Strategy) -> Self {
        Self {
            claimed: AtomicBitmap::new(pending.pages()),
            left: AtomicU64::new(pending.count()),
            planner: Mutex::new(Planner::new(pending.clone(), strategy)),
            due: pending,
            pivot: AtomicU64::new(NO_PIVOT),
        }
    }

    /// A page the destination asked for: whether to send it now. It is the answer's if no
    /// push claimed it yet; with `again`, also if one did: over several connections that push
    /// may wait in another connection's queues (the sender's and the receiver's: megabytes),
    /// and the fault should not wait for it. The destination keeps whichever copy comes first.
    /// The pushes move there.
    pub(super) fn claim_request(&self, gfn: u64, again: bool) -> bool {
        self.pivot.store(gfn, Ordering::Relaxed);
        self.due.get(gfn) && (self.claim(gfn) || again)
    }

    /// Whether `gfn` was still unclaimed (it is now).
    fn claim(&self, gfn: u64) -> bool {
        let first = !self.claimed.set(gfn);
        if first {
            self.left.fetch_sub(1, Ordering::Relaxed);
        }
        first
    }

    /// Pages not sent yet.
    pub(super) fn left(&self) -> u64 {
        self.left.load(Ordering::Relaxed)
    }

    /// Up to `n` more pages to push, claimed, in the planner's order (none: all have left).
    pub(super) fn next_pushes(&self, batch: &mut Vec<u64>, n: usize) {
        batch.clear();
        let mut planner = self.planner.locked();
        let pivot = self.pivot.swap(NO_PIVOT, Ordering::Relaxed);
        if pivot != NO_PIVOT {
            planner.recenter(pivot);
        }
        while batch.len() < n {
            match planner.next_page() {
                Some(gfn) if self.claim(gfn) => batch.push(gfn),
                Some(_) => {} // answered already
                None => break,
            }
        }
    }
}

/// What the lanes pushing side by side share with the thread that answers.
pub(super) struct Pushes<'p> {
    pub claims: &'p Claims,
    /// Pages the lanes have pushed.
    pub pushed: AtomicU64,
    /// Lanes still pushing.
    pub running: AtomicUsize,
    /// Set when one side failed: the others stop at their next batch.
    pub stop: AtomicBool,
    pub pushers: usize,
}

/// One lane's pushes: the planner's next pages, a batch at a time, kept within the lane's
/// share of the link's queue and its window of pages the destination has not taken yet; then
/// `LaneEnd` with what it pushed.
pub(super) fn push_on_lane(lane: &mut Lane, ram: &GuestRam, pushes: &Pushes<'_>) -> Result<()> {
    let mut queue = PushQueue::shared_by(pushes.pushers);
    lane.write_message(&PushQueue::receipts_asked())?;
    let mut batch = Vec::with_capacity(LANE_BATCH);
    loop {
        if pushes.stop.load(Ordering::Acquire) {
            return Err(Error::State(
                "another connection of this migration failed".into(),
            ));
        }
        pushes.claims.next_pushes(&mut batch, LANE_BATCH);
        if batch.is_empty() {
            return lane.end_pushes(queue.sent);
        }
        lane.send_batch(ram, &batch)?;
        queue.sent(batch.len() as u64);
        pushes
            .pushed
            .fetch_add(batch.len() as u64, Ordering::Relaxed);
        wait_for_room(lane, &mut queue, &pushes.stop)?;
    }
}

/// Waits until the lane may push again: reads the destination's receipts (every one that has
/// come, and more while its window is full), and lets the link's queue drain. Receipts left
/// unread would fill this side's socket, then stop the destination's reader as it writes the
/// next one, and with it the lane.
fn wait_for_room(lane: &mut Lane, queue: &mut PushQueue, stop: &AtomicBool) -> Result<()> {
    let full_since = Instant::now();
    loop {
        if queue.awaits_receipt() || lane.has_receipt() {
            // Blocks at most the lane's read timeout: a destination that stopped reading
            // stops sending receipts.
            queue.taken(lane.read_receipt()?)?;
            continue;
        }
        if !queue.full(lane.stream()) || stop.load(Ordering::Acquire) {
            return Ok(());
        }
        if full_since.elapsed() > IO_TIMEOUT {
            return Err(not_reading());
        }
        std::thread::sleep(QUEUE_FULL_WAIT);
    }
}

pub(super) fn not_reading() -> Error {
    Error::Protocol(format!(
        "the destination has not read a page for {IO_TIMEOUT:?}"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_push_queue_holds_a_round_trip_and_a_millisecond_of_the_link() {
        let ms = Duration::from_millis;
        // 1 Gbit/s, 100 µs: 140 KB would do, the floor holds.
        assert_eq!(
            queue_limit_for(
                125_000_000,
                ms(0) + Duration::from_micros(100),
                PUSH_QUEUE_MIN
            ),
            PUSH_QUEUE_MIN
        );
        // Four connections pushing side by side share the floor (10 MB/s: 10 KB would do).
        let quarter = PushQueue::shared_by(4).floor;
        assert_eq!(
            queue_limit_for(10_000_000, ms(0), quarter),
            PUSH_QUEUE_MIN / 4
        );
        // 1 Gbit/s across 50 ms: the bandwidth-delay product and a quarter, and 1 ms more.
        let wan = queue_limit_for(125_000_000, ms(50), PUSH_QUEUE_MIN) as i64;
        assert!((wan - 7_937_500).abs() <= 1, "{wan}");
        // 10 Gbit/s across 100 ms would want 157 MB: the ceiling.
        assert_eq!(
            queue_limit_for(1_250_000_000, ms(100), PUSH_QUEUE_MIN),
            PUSH_QUEUE_MAX
        );
        // Nothing measured yet.
        assert_eq!(queue_limit_for(0, ms(0), PUSH_QUEUE_MIN), PUSH_QUEUE_MIN);
    }

    #[test]
    fn one_connection_pushes_a_quarter_of_its_queue_at_once() {
        let mut q = PushQueue::shared_by(1);
        assert_eq!(q.batch_pages(), FEWEST_BATCH_PAGES, "256 KiB: 16 pages");
        q.bytes = 1 << 20;
        assert_eq!(q.batch_pages(), 64);
        q.bytes = PUSH_QUEUE_MAX;
        assert_eq!(q.batch_pages(), LANE_BATCH);
    }

    #[test]
    fn pushing_waits_for_a_receipt_once_the_window_of_pages_is_out() {
        let mut q = PushQueue::shared_by(1);
        q.sent(WINDOW_MIN_PAGES - 1);
        assert!(!q.awaits_receipt());
        q.sent(1);
        assert!(q.awaits_receipt(), "a window's worth out, none taken");
        q.taken(RECEIPT_EVERY as u64).unwrap();
        assert!(!q.awaits_receipt());
        // A limit in bytes worth more pages widens the window.
        q.bytes = 4 * WINDOW_MIN_PAGES as usize * PAGE_SIZE;
        q.sent(2 * WINDOW_MIN_PAGES);
        assert!(!q.awaits_receipt());
    }

    #[test]
    fn a_receipt_for_pages_never_sent_or_going_back_is_refused() {
        let mut q = PushQueue::shared_by(2);
        q.sent(256);
        let e = q.taken(257).unwrap_err().to_string();
        assert!(
            e.contains("took 257 pages") && e.contains("carried 256"),
            "{e}"
        );
        q.taken(200).unwrap();
        let e = q.taken(100).unwrap_err().to_string();
        assert!(e.contains("had said 200"), "{e}");
    }

    /// A lane reads every receipt that came, even while its window has room: left unread they
    /// would fill its socket, stop the destination's reader as it writes the next one, and
    /// with it the lane, until the I/O timeout.
    #[test]
    fn a_lane_reads_every_receipt_that_came() {
        use crate::memory::RamRange;
        use crate::pages::PageSender;
        use crate::ratelimit::RateLimiter;
        use crate::wire::page_frame::{FrameBuffers, read_frame_into};
        use crate::wire::{self, Frame, read_frame};
        use std::os::fd::AsRawFd;
        use std::os::unix::net::UnixStream;

        const PAGES: u64 = 8192;
        let mut mem = vec![0x5au8; PAGES as usize * PAGE_SIZE];
        let range = RamRange {
            gpa: 0,
            len: mem.len() as u64,
        };
        // SAFETY: `mem` outlives `ram`, and both sides only read it.
        let ram = unsafe { GuestRam::new(&[(range, mem.as_mut_ptr())]) }.unwrap();
        let (ours, theirs) = UnixStream::pair().unwrap();
        // The destination's side holds few unread receipts: its small send buffer fills.
        crate::io::transport::set_int(theirs.as_raw_fd(), libc::SOL_SOCKET, libc::SO_SNDBUF, 4096)
            .unwrap();
        let ours = Stream::Unix(ours);
        ours.set_timeouts(Some(Duration::from_secs(5))).unwrap();
        let mut theirs = Stream::Unix(theirs);
        let reader_ram = ram.clone();
        let destination = std::thread::spawn(move || {
            let mut frame = FrameBuffers::default();
            let mut taken = 0;
            loop {
                match read_frame(&mut theirs).unwrap() {
                    Frame::Pages { header, len } => {
                        read_frame_into(&mut theirs, &reader_ram, &header, len, &mut frame)
                            .unwrap();
                        taken += frame.page_count();
                        wire::write_message(&mut theirs, &Message::Taken { pages: taken }).unwrap();
                    }
                    Frame::Message(Message::Receipts { .. }) => {}
                    Frame::Message(Message::LaneEnd { pages }) => return (pages, taken),
                    Frame::Message(m) => panic!("unexpected {}", m.name()),
                }
            }
        });
        let mut lane = Lane::new(ours, PageSender::new(128), RateLimiter::new(None));
        let mut all = Bitmap::new(PAGES);
        (0..PAGES).for_each(|p| all.set(p));
        let claims = Claims::new(all, Strategy::Linear);
        let pushes = Pushes {
            claims: &claims,
            pushed: AtomicU64::new(0),
            running: AtomicUsize::new(1),
            stop: AtomicBool::new(false),
            pushers: 1,
        };
        push_on_lane(&mut lane, &ram, &pushes).unwrap();
        assert_eq!(destination.join().unwrap(), (PAGES, PAGES));
    }
}
