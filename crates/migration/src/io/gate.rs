//! The way into a migration's listener. Each connection opens (TLS handshake, stream header,
//! first message) on a thread of its own, against one deadline for the whole opening, so a
//! stranger who connects and says nothing, or trickles bytes, holds one slot for at most
//! `OPENING_WAIT` and never the accept loop. Slots are bounded in all and per peer address;
//! a connection past either bound takes the place of the oldest one still opening (from that
//! address, or at all), which is cut: strangers who hold their slots cannot keep a source
//! out, as its connection opens in a round trip. No number of strangers ends the wait: only
//! the caller's `stop` does.

use crate::sync::Locked;
use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::IpAddr;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use sockets::deadline::Within;

use crate::error::{Error, Result};
use crate::io::tls::Tls;
use crate::io::transport::{Accepted, IO_TIMEOUT, Listener, OPENING_WAIT, Stream};
use crate::wire::frame::{self, FRAME_HEADER_LEN};
use crate::wire::{self, Message};

/// Connections opening at once, in all.
pub const SLOTS: usize = 64;
/// Connections opening at once from one peer address (a Unix socket's peers, all of this host
/// and all its owner's, are not counted apart).
pub const PER_PEER: usize = 4;
/// The largest first message a connection may open with (a `Hello` is a few hundred bytes):
/// a stranger's announced length must not make each slot allocate the 64 MiB a control frame
/// may have.
const OPENING_FRAME_MAX: u32 = 1 << 20;

/// A connection that opened: its stream and the message it opened with. It holds its slot
/// until it is admitted or refused.
pub struct Opened {
    pub stream: Stream,
    /// The stream's version, from its header.
    pub version: u32,
    pub first: Message,
    slot: Slot,
}

impl Opened {
    /// Takes the connection; its slot is free again.
    pub fn admit(self) -> (Stream, Message) {
        drop(self.slot);
        (self.stream, self.first)
    }

    /// Tells the peer why it is turned away and closes, on a thread of its own (the telling
    /// may wait on the peer), holding the slot until then.
    pub fn refuse(self, why: String) {
        let _ = std::thread::Builder::new()
            .name("gate-refuse".into())
            .spawn(move || {
                tell_and_close(self.stream, &why);
                drop(self.slot);
            });
    }
}

/// Waits for connections on `listener` and opens them off the caller's thread.
pub struct Gate<'a> {
    listener: &'a Listener,
    doors: Arc<Doors>,
    opened: Receiver<Opened>,
    send: Sender<Opened>,
    /// Rung by an opening thread once it has sent what opened; polled beside the listener.
    bell: UnixStream,
    ring: Arc<UnixStream>,
    refused: AtomicU64,
}

impl<'a> Gate<'a> {
    /// A gate where each connection has `OPENING_WAIT` to open.
    pub fn new(listener: &'a Listener) -> Result<Self> {
        Self::opening_within(listener, OPENING_WAIT)
    }

    /// A gate where each connection has `wait` to open. A silent one still gives its slot to
    /// a newcomer when the slots are full (the oldest unopened is cut).
    pub fn opening_within(listener: &'a Listener, wait: Duration) -> Result<Self> {
        let (bell, ring) = UnixStream::pair().map_err(|e| Error::transport("gate", e))?;
        bell.set_nonblocking(true)?;
        ring.set_nonblocking(true)?;
        let (send, opened) = channel();
        Ok(Self {
            listener,
            doors: Arc::new(Doors {
                slots: Mutex::default(),
                opening_wait: wait,
            }),
            opened,
            send,
            bell,
            ring: Arc::new(ring),
            refused: AtomicU64::new(0),
        })
    }

    /// The next connection that opened, in the order they finished opening; `None` once
    /// `stop` says so (looked at every 100 ms).
    pub fn next(&self, stop: &dyn Fn() -> bool) -> Result<Option<Opened>> {
        loop {
            if let Ok(opened) = self.opened.try_recv() {
                return Ok(Some(opened));
            }
            if stop() {
                return Ok(None);
            }
            let mut fds =
                [self.listener.as_raw_fd(), self.bell.as_raw_fd()].map(|fd| libc::pollfd {
                    fd,
                    events: libc::POLLIN,
                    revents: 0,
                });
            // SAFETY: two valid pollfds for the duration of the call.
            unsafe { libc::poll(fds.as_mut_ptr(), 2, 100) };
            if fds[1].revents != 0 {
                while (&self.bell).read(&mut [0u8; 64]).is_ok_and(|n| n > 0) {}
            }
            if fds[0].revents != 0 {
                self.admit();
            }
        }
    }

    /// Accepts one connection and starts opening it, if a slot is free for it.
    fn admit(&self) {
        let conn = match self.listener.accept_unopened() {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!("could not accept a connection: {}", crate::error::chain(&e));
                // Out of descriptors, say: the listener stays readable, so do not spin.
                std::thread::sleep(Duration::from_millis(10));
                return;
            }
        };
        let slot = match self.doors.take(&conn) {
            Ok(slot) => slot,
            Err(why) => return self.note_refusal(why),
        };
        let (tls, send, ring) = (
            self.listener.tls().cloned(),
            self.send.clone(),
            self.ring.clone(),
        );
        let spawned = std::thread::Builder::new()
            .name("gate-open".into())
            .spawn(move || open(conn, slot, tls, &send, &ring));
        if let Err(e) = spawned {
            self.note_refusal(format!("no thread to open it on ({e})"));
        }
    }

    /// Logs a connection closed unopened: the first, then one line per hundred (a flood of
    /// strangers must not flood the log).
    fn note_refusal(&self, why: String) {
        let n = self.refused.fetch_add(1, Ordering::Relaxed) + 1;
        if n % 100 == 1 {
            tracing::warn!("refused an incoming connection: {why} ({n} refused so far)");
        }
    }
}

impl Drop for Gate<'_> {
    /// Cuts the connections still opening, so their threads end now.
    fn drop(&mut self) {
        self.doors.shut_all();
    }
}

/// Opens one connection within its deadline and hands it to the gate, or tells it why not.
fn open(conn: Accepted, slot: Slot, tls: Option<Tls>, send: &Sender<Opened>, ring: &UnixStream) {
    let deadline = slot.deadline;
    let mut stream = match conn.open(tls.as_ref(), deadline) {
        Ok(s) => s,
        // A peer that failed the TLS handshake (no certificate of our CA, or silent).
        Err(e) => {
            return tracing::warn!(
                "refused an incoming connection: {}",
                crate::error::chain(&e)
            );
        }
    };
    match read_opening(&mut Within::new(&mut stream, deadline)) {
        Ok((version, first)) => {
            slot.doors.opened(&slot);
            if stream.set_timeouts(Some(IO_TIMEOUT)).is_ok()
                && send
                    .send(Opened {
                        stream,
                        version,
                        first,
                        slot,
                    })
                    .is_ok()
            {
                let _ = (&*ring).write(&[1]);
            }
        }
        Err(e) => tell_and_close(stream, &e.to_string()),
    }
}

/// Reads the stream header and the first message, which must be small: the stream's
/// version and that message.
fn read_opening(r: &mut impl Read) -> Result<(u32, Message)> {
    let version = wire::read_stream_header(r)?;
    let mut header = [0u8; FRAME_HEADER_LEN];
    frame::read_exact(r, &mut header, "frame header")?;
    let len = u32::from_le_bytes(header[4..8].try_into().unwrap());
    if len > OPENING_FRAME_MAX {
        return Err(Error::Protocol(format!(
            "a connection opened with a frame of {len} bytes (at most {OPENING_FRAME_MAX})"
        )));
    }
    Ok((
        version,
        wire::read_message(&mut header.as_slice().chain(r))?,
    ))
}

/// Tells a peer that is turned away why (an `Abort`), and closes once it has had the chance
/// to read it; bounded to half a second whatever the peer does.
fn tell_and_close(mut stream: Stream, why: &str) {
    tracing::warn!("ignored an incoming connection: {why}");
    let _ = stream.set_timeouts(Some(Duration::from_millis(200)));
    let reason = why.to_string();
    let _ = wire::write_message(&mut stream, &Message::Abort { reason });
    stream.close_after_last_word(Duration::from_millis(300));
}

/// The slots: how many connections are opening, from where, and a handle on each to cut it.
struct Doors {
    slots: Mutex<Slots>,
    /// How long each connection has to open.
    opening_wait: Duration,
}

#[derive(Default)]
struct Slots {
    per_peer: HashMap<IpAddr, usize>,
    /// Each connection holding a slot, by slot (ids grow: the smallest is the oldest).
    open: HashMap<u64, Door>,
    next: u64,
}

/// A connection holding a slot.
struct Door {
    /// A second handle on its socket, to cut it.
    socket: OwnedFd,
    peer: Option<IpAddr>,
    /// Opened and waiting to be admitted: never cut to make room (it may be the source).
    opened: bool,
}

impl Slots {
    /// Cuts the oldest connection still opening (from `peer`, if given) and frees its slot;
    /// whether there was one.
    fn evict_oldest(&mut self, peer: Option<IpAddr>) -> bool {
        let oldest = self
            .open
            .iter()
            .filter(|(_, d)| !d.opened && (peer.is_none() || d.peer == peer))
            .map(|(id, _)| *id)
            .min();
        let Some(door) = oldest.and_then(|id| self.open.remove(&id)) else {
            return false;
        };
        // SAFETY: shutdown on a socket the door held open; its opening thread stops waiting.
        unsafe { libc::shutdown(door.socket.as_raw_fd(), libc::SHUT_RDWR) };
        self.forget_peer(door.peer);
        true
    }

    fn forget_peer(&mut self, peer: Option<IpAddr>) {
        if let Some(p) = peer
            && let Some(n) = self.per_peer.get_mut(&p)
        {
            *n -= 1;
            if *n == 0 {
                self.per_peer.remove(&p);
            }
        }
    }
}

/// One connection's place while it opens; given back when dropped.
struct Slot {
    doors: Arc<Doors>,
    id: u64,
    peer: Option<IpAddr>,
    deadline: Instant,
}

impl Doors {
    fn lock(&self) -> std::sync::MutexGuard<'_, Slots> {
        self.slots.locked()
    }

    fn take(self: &Arc<Self>, conn: &Accepted) -> std::result::Result<Slot, String> {
        let peer = conn.peer();
        let mut slots = self.lock();
        let from_peer = peer.map_or(0, |p| slots.per_peer.get(&p).copied().unwrap_or(0));
        if from_peer >= PER_PEER && !slots.evict_oldest(peer) {
            return Err(format!(
                "{PER_PEER} connections from {} have opened and wait to be admitted",
                peer.map_or("this host".into(), |p| p.to_string())
            ));
        }
        if slots.open.len() >= SLOTS && !slots.evict_oldest(None) {
            return Err(format!(
                "all {SLOTS} slots hold connections that opened and wait to be admitted"
            ));
        }
        let socket = conn.try_clone_socket().map_err(|e| e.to_string())?;
        let id = slots.next;
        slots.next += 1;
        slots.open.insert(
            id,
            Door {
                socket,
                peer,
                opened: false,
            },
        );
        if let Some(p) = peer {
            *slots.per_peer.entry(p).or_default() += 1;
        }
        Ok(Slot {
            doors: self.clone(),
            id,
            peer,
            deadline: Instant::now() + self.opening_wait,
        })
    }

    /// Frees a slot (one cut to make room was freed already).
    fn give_back(&self, slot: &Slot) {
        let mut slots = self.lock();
        if slots.open.remove(&slot.id).is_some() {
            slots.forget_peer(slot.peer);
        }
    }

    /// The connection of `slot` has opened: from now on it is not cut to make room.
    fn opened(&self, slot: &Slot) {
        if let Some(door) = self.lock().open.get_mut(&slot.id) {
            door.opened = true;
        }
    }

    fn shut_all(&self) {
        for door in self.lock().open.values() {
            // SAFETY: shutdown on a socket this map holds open; it ends the connection both
            // ways, so the thread opening it stops waiting.
            unsafe { libc::shutdown(door.socket.as_raw_fd(), libc::SHUT_RDWR) };
        }
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.doors.give_back(self);
    }
}

#[cfg(test)]
mod tests {
    use std::net::{TcpListener, TcpStream};

    use super::*;

    /// Strangers from the source's own address, each holding a slot and saying nothing,
    /// cannot keep the source out: each newcomer cuts the oldest still opening, and the
    /// source's connection opens within a round trip.
    #[test]
    fn strangers_from_the_sources_address_cannot_keep_it_out() {
        let tcp = TcpListener::bind("127.0.0.1:0").unwrap();
        let at = tcp.local_addr().unwrap();
        let listener = Listener::Tcp(tcp, None);
        let gate = Gate::new(&listener).unwrap();
        // All connected before the source, so it comes last and nothing cuts it.
        let _strangers: Vec<TcpStream> = (0..4 * PER_PEER)
            .map(|_| TcpStream::connect(at).unwrap())
            .collect();
        let source = std::thread::spawn(move || {
            let mut s = TcpStream::connect(at).unwrap();
            wire::write_stream_header(&mut s).unwrap();
            wire::write_message(&mut s, &Message::Go).unwrap();
            s
        });
        let deadline = Instant::now() + Duration::from_secs(20);
        let opened = gate
            .next(&|| Instant::now() > deadline)
            .unwrap()
            .expect("the source's connection opens");
        assert!(matches!(opened.first, Message::Go), "{:?}", opened.first);
        let held = gate.doors.lock().open.len();
        assert!(held <= PER_PEER, "{held} slots held");
        source.join().unwrap();
    }
}
