//! A loopback TCP relay that reads ferry's framing as it forwards, for the fault matrix: at a
//! named point of the conversation (a message, the n-th page frame of a round, a share of the
//! post-copy pages) it holds that frame and injects a fault before it goes on. The fault lands
//! at the same point of the protocol every run, whatever the timing.
#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use migration::wire::Message;
use migration::wire::frame::{FRAME_HEADER_LEN, KIND_CONTROL, STREAM_HEADER_LEN};

/// Where in a migration the fault lands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Point {
    /// The source's `Hello`.
    Setup,
    /// The 4th page frame of round 0.
    Round0,
    /// The page frame of round 0 that brings its pages sent to this percentage of those
    /// `Populated` named.
    Round0Share(u8),
    /// The first page frame of round 2 (a writer's pre-copy keeps going for several rounds).
    RoundK,
    /// The first disk blocks (`DiskData`) of a move that copies its disks.
    Disk,
    /// The n-th `DiskData` (from 1): some of the disk has crossed.
    DiskFrame(u32),
    /// The first frame after the pre-pause catch-up (`Sync` or `Stale`), or, with no rounds
    /// before it (post-copy), `PostcopyPending`: the source has paused, or is about to.
    Pause,
    /// The first vCPU state.
    State,
    /// `Go`: the source has given the VM up.
    Go,
    /// The post-copy page frame that brings the pages sent after `Go` to this percentage of
    /// those pending.
    Postcopy(u8),
    /// The destination's last word: `Resumed` (pre-copy, warm) or `PostcopyComplete`.
    Completion,
}

impl Point {
    pub fn name(self) -> String {
        match self {
            Point::Setup => "setup".into(),
            Point::Round0 => "round 0".into(),
            Point::Round0Share(p) => format!("round 0 at {p}%"),
            Point::RoundK => "round k".into(),
            Point::Disk => "disk".into(),
            Point::DiskFrame(n) => format!("disk frame {n}"),
            Point::Pause => "pause".into(),
            Point::State => "state".into(),
            Point::Go => "go".into(),
            Point::Postcopy(p) => format!("post-copy {p}%"),
            Point::Completion => "completion".into(),
        }
    }
}

/// What the relay does at the point.
#[derive(Clone, Copy, Debug)]
pub enum Action {
    /// Closes both directions; the frame is not forwarded.
    Cut,
    /// As `Cut`, but a connection made later is carried (a blip: the link comes back).
    Blip,
    /// Forwards nothing in either direction for this long, then carries on.
    Stall(Duration),
    /// Flips one byte of the frame's payload.
    Corrupt,
    /// Tells the test (which kills a process or cancels), waits for its go-ahead, forwards.
    Hold,
}

/// What the relay has seen so far, shared by both directions.
#[derive(Default)]
struct Conversation {
    /// Rounds completed (`RoundEnd` seen) and page frames in the current one.
    round: u32,
    frames_in_round: u32,
    caught_up: bool,
    went: bool,
    postcopy: bool,
    pending: u64,
    pushed: u64,
    fired: bool,
    /// Round 0's pages (`Populated`) and those its frames carried so far.
    round0_pages: u64,
    round0_sent: u64,
    disk_frames: u32,
}

impl Conversation {
    /// Takes in one frame of an extra connection: post-copy's pushes travel there, and count
    /// toward its points; the rest of the conversation is the main connection's.
    fn on_lane(&mut self, point: Point, to_destination: bool, frame: &[u8]) -> bool {
        let hit = to_destination
            && self.went
            && frame[0] != KIND_CONTROL
            && self.pushed_to(point, page_count(frame));
        self.fire_once(hit)
    }

    /// Counts `count` more pages sent after `Go`; whether they reach the point.
    fn pushed_to(&mut self, point: Point, count: u32) -> bool {
        let before = self.pushed * 100;
        self.pushed += u64::from(count);
        match point {
            Point::Postcopy(p) => {
                let goal = u64::from(p) * self.pending.max(1);
                before < goal && self.pushed * 100 >= goal
            }
            _ => false,
        }
    }

    fn fire_once(&mut self, hit: bool) -> bool {
        let fire = hit && !self.fired;
        self.fired |= fire;
        fire
    }

    /// Takes in one frame; returns whether it is the point.
    fn at(&mut self, point: Point, to_destination: bool, frame: &[u8]) -> bool {
        let payload = &frame[FRAME_HEADER_LEN..frame.len() - 4];
        let message = (frame[0] == KIND_CONTROL)
            .then(|| Message::decode(payload).ok())
            .flatten();
        let hit = match (to_destination, &message) {
            (true, Some(Message::Hello { .. })) => point == Point::Setup,
            (true, Some(Message::RoundEnd { round, .. })) => {
                self.round = round + 1;
                self.frames_in_round = 0;
                false
            }
            (true, Some(Message::Populated { map })) => {
                self.round0_pages = map.count();
                false
            }
            (true, Some(Message::Sync { .. } | Message::Stale { .. })) => {
                self.caught_up = true;
                false
            }
            (true, Some(Message::PostcopyPending { map })) => {
                self.postcopy = true;
                self.pending = map.count();
                point == Point::Pause && !self.caught_up
            }
            (true, Some(Message::VcpuState { index: 0, .. })) => point == Point::State,
            (true, Some(Message::DiskData { .. })) => {
                self.disk_frames += 1;
                point == Point::Disk || point == Point::DiskFrame(self.disk_frames)
            }
            (true, Some(Message::Go)) => {
                self.went = true;
                point == Point::Go
            }
            (true, Some(_)) => false,
            (true, None) => {
                let count = page_count(frame);
                self.frames_in_round += 1;
                if self.went {
                    self.pushed_to(point, count)
                } else if self.caught_up {
                    false
                } else {
                    let before = self.round0_sent * 100;
                    if self.round == 0 {
                        self.round0_sent += u64::from(count);
                    }
                    let share = match point {
                        Point::Round0Share(p) if self.round == 0 => {
                            let goal = u64::from(p) * self.round0_pages.max(1);
                            before < goal && self.round0_sent * 100 >= goal
                        }
                        _ => false,
                    };
                    share
                        || (point == Point::Round0 && self.round == 0 && self.frames_in_round == 4)
                        || (point == Point::RoundK && self.round == 2 && self.frames_in_round == 1)
                }
            }
            (false, Some(Message::Resumed { .. })) => point == Point::Completion && !self.postcopy,
            (false, Some(Message::PostcopyComplete(_))) => point == Point::Completion,
            (false, _) => false,
        };
        // `Pause`: whatever the source sends first once it has caught up.
        let hit = hit
            || (point == Point::Pause
                && to_destination
                && self.caught_up
                && !matches!(message, Some(Message::Sync { .. } | Message::Stale { .. })));
        self.fire_once(hit)
    }
}

/// The pages of a page frame: `count u32` opens its payload.
fn page_count(frame: &[u8]) -> u32 {
    u32::from_le_bytes(frame[FRAME_HEADER_LEN..][..4].try_into().unwrap())
}

struct Shared {
    point: Point,
    action: Action,
    conversation: Mutex<Conversation>,
    /// Told once when the point is reached; the relay then waits on `release` (for `Hold`).
    reached: Mutex<Sender<()>>,
    release: Mutex<Receiver<()>>,
    cut: Mutex<Vec<TcpStream>>,
    /// Set when the relay is dropped: stop waiting for a connection.
    closing: std::sync::atomic::AtomicBool,
    /// Set when the link was cut: a connection made later is cut too.
    was_cut: std::sync::atomic::AtomicBool,
}

pub struct Relay {
    pub url: String,
    /// Where it relays to (`host:port`).
    target: String,
    reached: Receiver<()>,
    release: Sender<()>,
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

impl Relay {
    /// Relays a migration's connections to `target` (host:port), with `action` at `point`.
    pub fn start(target: &str, point: Point, action: Action) -> Relay {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind relay");
        let url = format!("tcp:{}", listener.local_addr().unwrap());
        let (reached_tx, reached) = channel();
        let (release, release_rx) = channel();
        let shared = Arc::new(Shared {
            point,
            action,
            conversation: Mutex::default(),
            reached: Mutex::new(reached_tx),
            release: Mutex::new(release_rx),
            cut: Mutex::default(),
            closing: Default::default(),
            was_cut: Default::default(),
        });
        let target = target.to_string();
        let target_copy = target.clone();
        let relay_shared = shared.clone();
        let thread = std::thread::spawn(move || {
            let Some(src) = accept_until_closing(&listener, &shared) else {
                return;
            };
            let Some(main) = Pair::connect(src, &target, &shared, Carries::Conversation) else {
                return;
            };
            // A migration's extra connections (`--connections`) come through here too: their
            // frames are forwarded whole, cut and stalled with the main one's; only post-copy's
            // pushes on them count toward a point (the rest is the conversation's).
            let lanes = {
                let shared = shared.clone();
                std::thread::spawn(move || {
                    let mut pairs = Vec::new();
                    while let Some(src) = accept_until_closing(&listener, &shared) {
                        pairs.extend(Pair::connect(src, &target, &shared, Carries::Lane));
                    }
                    pairs.into_iter().for_each(Pair::join);
                })
            };
            main.join();
            let _ = lanes.join();
        });
        Relay {
            url,
            target: target_copy,
            reached,
            release,
            shared: relay_shared,
            thread: Some(thread),
        }
    }

    /// Waits up to `limit` for the point; false if the migration never got there.
    pub fn wait_reached(&self, limit: Duration) -> bool {
        self.reached.recv_timeout(limit).is_ok()
    }

    /// The relayed-to address, as a migration URL: the destination, reached straight.
    pub fn target_url(&self) -> String {
        format!("tcp:{}", self.target)
    }

    /// Lets a held frame go on.
    pub fn release(&self) {
        let _ = self.release.send(());
    }
}

impl Drop for Relay {
    /// Never waits on the peers: a connection still open is closed, one never made is no
    /// longer waited for.
    fn drop(&mut self) {
        self.release();
        self.shared
            .closing
            .store(true, std::sync::atomic::Ordering::Release);
        for s in self.shared.cut.lock().unwrap().iter() {
            let _ = s.shutdown(Shutdown::Both);
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// What a relayed connection carries.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Carries {
    /// The migration's conversation: where the point is looked for.
    Conversation,
    /// Only a lane's page frames.
    Lane,
}

/// One relayed connection: a pump each way.
struct Pair(JoinHandle<()>, JoinHandle<()>);

impl Pair {
    fn connect(
        src: TcpStream,
        target: &str,
        shared: &Arc<Shared>,
        carries: Carries,
    ) -> Option<Pair> {
        let dst = TcpStream::connect(target).ok()?;
        shared
            .cut
            .lock()
            .unwrap()
            .extend([src.try_clone().ok()?, dst.try_clone().ok()?]);
        // Checked after the sockets are listed (both flags are set before the list is
        // emptied): a connection that came as the relay closed, or after a cut, is not carried.
        let ordering = std::sync::atomic::Ordering::Acquire;
        if shared.closing.load(ordering) || shared.was_cut.load(ordering) {
            finish(&src, &dst);
            return None;
        }
        let (src2, dst2) = (src.try_clone().ok()?, dst.try_clone().ok()?);
        let (a, b) = (shared.clone(), shared.clone());
        Some(Pair(
            std::thread::spawn(move || pump(src, dst, true, carries, &a)),
            std::thread::spawn(move || pump(dst2, src2, false, carries, &b)),
        ))
    }

    fn join(self) {
        let _ = self.0.join();
        let _ = self.1.join();
    }
}

/// The source's connection, or `None` once the relay is dropped (polled: a blocking accept
/// could wait for ever for a source that never came).
fn accept_until_closing(listener: &TcpListener, shared: &Shared) -> Option<TcpStream> {
    listener.set_nonblocking(true).ok()?;
    while !shared.closing.load(std::sync::atomic::Ordering::Acquire) {
        match listener.accept() {
            Ok((s, _)) => {
                s.set_nonblocking(false).ok()?;
                return Some(s);
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(_) => return None,
        }
    }
    None
}

/// Forwards whole frames from `from` to `to`, injecting the fault at the point.
fn pump(
    mut from: TcpStream,
    mut to: TcpStream,
    to_destination: bool,
    carries: Carries,
    shared: &Shared,
) {
    if to_destination {
        let mut header = [0u8; STREAM_HEADER_LEN];
        if from.read_exact(&mut header).is_err() || to.write_all(&header).is_err() {
            return finish(&from, &to);
        }
    }
    let mut frame = Vec::new();
    loop {
        frame.resize(FRAME_HEADER_LEN, 0);
        if from.read_exact(&mut frame).is_err() {
            break;
        }
        let len = u32::from_le_bytes(frame[4..8].try_into().unwrap()) as usize;
        frame.resize(FRAME_HEADER_LEN + len + 4, 0);
        if from.read_exact(&mut frame[FRAME_HEADER_LEN..]).is_err() {
            break;
        }
        // A lane waits here while a stall holds the conversation.
        let mut conversation = shared.conversation.lock().unwrap();
        let fire = match carries {
            Carries::Conversation => conversation.at(shared.point, to_destination, &frame),
            Carries::Lane => conversation.on_lane(shared.point, to_destination, &frame),
        };
        drop(conversation);
        if fire {
            let _ = shared.reached.lock().unwrap().send(());
            match shared.action {
                Action::Cut | Action::Blip => {
                    // A reset, as a peer that died would send: a plain shutdown leaves the
                    // socket open with its unread bytes, and a source whose window it had
                    // filled would only probe it, blocked until its I/O timeout. With
                    // SO_LINGER 0 the last close of each socket resets it; the clones kept
                    // here go now, the pumps' own when they return.
                    if matches!(shared.action, Action::Cut) {
                        shared
                            .was_cut
                            .store(true, std::sync::atomic::Ordering::Release);
                    }
                    for s in std::mem::take(&mut *shared.cut.lock().unwrap()) {
                        reset_on_close(&s);
                        let _ = s.shutdown(Shutdown::Both);
                    }
                    break;
                }
                Action::Stall(d) => {
                    // Holding the lock stalls the other direction at its next frame too.
                    let _guard = shared.conversation.lock().unwrap();
                    std::thread::sleep(d);
                }
                Action::Corrupt => {
                    let at = FRAME_HEADER_LEN + len / 2;
                    frame[at] ^= 0xff;
                }
                Action::Hold => {
                    let _ = shared
                        .release
                        .lock()
                        .unwrap()
                        .recv_timeout(Duration::from_secs(60));
                }
            }
        }
        if to.write_all(&frame).is_err() {
            break;
        }
    }
    finish(&from, &to);
}

fn reset_on_close(s: &TcpStream) {
    use std::os::fd::AsRawFd;
    let linger = libc::linger {
        l_onoff: 1,
        l_linger: 0,
    };
    // SAFETY: a valid socket and a `linger` of the size given.
    unsafe {
        libc::setsockopt(
            s.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_LINGER,
            (&linger as *const libc::linger).cast(),
            std::mem::size_of::<libc::linger>() as libc::socklen_t,
        );
    }
}

fn finish(from: &TcpStream, to: &TcpStream) {
    let _ = from.shutdown(Shutdown::Both);
    let _ = to.shutdown(Shutdown::Both);
}
