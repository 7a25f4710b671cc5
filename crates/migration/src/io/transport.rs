//! Where a migration goes: `tcp:HOST:PORT`, `unix:PATH`, or a file (snapshots).

use std::io::{Read, Write};
use std::net::{IpAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::str::FromStr;
use std::time::{Duration, Instant};

use sockets::deadline::Timed;
use sockets::unix::{bind_private, remove_stale_socket};
use vmm_sys_util::sock_ctrl_msg::ScmSocket;

use crate::error::{Error, Result};
use crate::io::lanefile::SnapshotFile;
use crate::io::tls::Tls;

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Endpoint {
    Tcp(String),
    Unix(PathBuf),
}

impl FromStr for Endpoint {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        let bad = |why: &str| {
            Error::Param(format!(
                "'{s}' is not a migration address: {why} (use tcp:HOST:PORT or unix:PATH)"
            ))
        };
        if let Some(rest) = s.strip_prefix("tcp:") {
            let (host, port) = rest.rsplit_once(':').ok_or_else(|| bad("no port"))?;
            if host.is_empty() {
                return Err(bad("no host"));
            }
            port.parse::<u16>().map_err(|_| bad("bad port"))?;
            Ok(Endpoint::Tcp(rest.to_string()))
        } else if let Some(path) = s.strip_prefix("unix:") {
            if path.is_empty() {
                return Err(bad("no path"));
            }
            Ok(Endpoint::Unix(PathBuf::from(path)))
        } else {
            Err(bad("unknown scheme"))
        }
    }
}

impl std::fmt::Display for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Endpoint::Tcp(a) => write!(f, "tcp:{a}"),
            Endpoint::Unix(p) => write!(f, "unix:{}", p.display()),
        }
    }
}

/// What TCP says of the time it spent on a connection (`Stream::sending_times`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SendingTimes {
    /// Time it had data to send, all told.
    pub with_data: Duration,
    /// Of that, time the receiver's window held it back.
    pub receiver_held: Duration,
}

/// A byte stream to or from a peer (or a snapshot file).
pub enum Stream {
    Tcp(TcpStream),
    Unix(UnixStream),
    /// TLS: plaintext on the local socket, ciphertext on the TCP socket (see `tls`), and the
    /// certificate the peer presented.
    Tls(UnixStream, std::sync::Arc<TcpStream>, std::sync::Arc<[u8]>),
    /// A snapshot file, or one lane of one written by several writers.
    File(SnapshotFile),
}

// Offsets in struct tcp_info (include/uapi/linux/tcp.h): not all of it is in `libc`.
const TCPI_MIN_RTT_US: usize = 148;
const TCPI_DELIVERY_RATE: usize = 160;
const TCPI_BUSY_TIME_US: usize = 168;
const TCPI_RWND_LIMITED_US: usize = 176;
const TCPI_SNDBUF_LIMITED_US: usize = 184;

/// The byte `send_files` passes its files with.
const FILES_BYTE: u8 = 0xfd;

pub const IO_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a new connection has, in all, to open: its TLS handshake, and on a migration's
/// listener (see `gate`) its stream header and first message too.
pub const OPENING_WAIT: Duration = Duration::from_secs(10);
/// A send queue this short empties in well under a millisecond on the links we target.
const DRAINED_BYTES: usize = 64 * 1024;
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// A TCP connection silent this long is probed (keepalive), every `KEEPALIVE_INTERVAL`, and
/// given up after `KEEPALIVE_PROBES` unanswered probes: a dead peer is noticed even by a side
/// that only waits to read.
const KEEPALIVE_IDLE: Duration = Duration::from_secs(10);
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(5);
const KEEPALIVE_PROBES: u32 = 3;
/// Data sent and not acknowledged this long ends the connection (`TCP_USER_TIMEOUT`): a peer
/// that died with our data in flight is noticed as soon as a blocked write would be.
const UNACKED_LIMIT: Duration = IO_TIMEOUT;
/// A round trip at least this long makes a long path, whose send buffer `fit_send_buffer`
/// sizes (below it TCP's own tuning keeps the link busy) and whose `Go` goes with the state.
pub const LONG_PATH: Duration = Duration::from_millis(2);
/// The rate a long path's send buffer is sized for (bytes/s). TCP's own tuning stops at the
/// host's `net.ipv4.tcp_wmem` limit, which caps one connection at that limit per round trip.
const LONG_PATH_RATE: f64 = 250e6;
const MAX_SEND_BUFFER: f64 = (64 << 20) as f64;

impl Endpoint {
    /// Connects; over TCP with `tls`, the connection is TLS and the destination's certificate
    /// must name the host of this address.
    pub fn connect(&self, tls: Option<&Tls>) -> Result<Stream> {
        let fail = |e: std::io::Error| Error::transport(format!("cannot connect to {self}"), e);
        let stream = match self {
            Endpoint::Tcp(addr) => {
                let mut last = None;
                let addrs = addr.to_socket_addrs().map_err(fail)?;
                let mut connected = None;
                for a in addrs {
                    match TcpStream::connect_timeout(&a, CONNECT_TIMEOUT) {
                        Ok(s) => {
                            connected = Some(s);
                            break;
                        }
                        Err(e) => last = Some(e),
                    }
                }
                let s = connected.ok_or_else(|| {
                    fail(last.unwrap_or_else(|| std::io::Error::other("no address")))
                })?;
                tune_tcp(&s).map_err(fail)?;
                match tls {
                    Some(tls) => {
                        let secured = tls.connect(s, self.host())?;
                        Stream::Tls(secured.app, secured.wire, secured.peer)
                    }
                    None => Stream::Tcp(s),
                }
            }
            Endpoint::Unix(path) => Stream::Unix(UnixStream::connect(path).map_err(fail)?),
        };
        stream.set_timeouts(Some(IO_TIMEOUT))?;
        Ok(stream)
    }

    /// The host part of a TCP address (what the peer's certificate must name).
    pub fn host(&self) -> &str {
        match self {
            Endpoint::Tcp(a) => {
                let host = a.rsplit_once(':').map_or(a.as_str(), |(h, _)| h);
                host.trim_start_matches('[').trim_end_matches(']')
            }
            Endpoint::Unix(_) => "localhost",
        }
    }

    /// Binds a listener; over TCP with `tls`, every connection must open TLS with a
    /// certificate of our CA.
    pub fn listen(&self, tls: Option<&Tls>) -> Result<Listener> {
        let fail = |e: std::io::Error| Error::transport(format!("cannot listen on {self}"), e);
        Ok(match self {
            Endpoint::Tcp(addr) => {
                Listener::Tcp(TcpListener::bind(addr).map_err(fail)?, tls.cloned())
            }
            Endpoint::Unix(path) => {
                remove_stale_socket(path).map_err(fail)?;
                Listener::Unix(bind_private(path).map_err(fail)?, path.clone())
            }
        })
    }
}

pub enum Listener {
    Tcp(TcpListener, Option<Tls>),
    Unix(UnixListener, PathBuf),
}

impl std::os::fd::AsRawFd for Listener {
    fn as_raw_fd(&self) -> std::os::fd::RawFd {
        match self {
            Listener::Tcp(l, _) => l.as_raw_fd(),
            Listener::Unix(l, _) => l.as_raw_fd(),
        }
    }
}

impl Listener {
    /// Waits for a connection, looking at `stop` every 100 ms; `None` once it says stop. A
    /// connection has `OPENING_WAIT` in all for its TLS handshake.
    pub fn accept_until(&self, stop: &dyn Fn() -> bool) -> Result<Option<Stream>> {
        let mut poll = libc::pollfd {
            fd: self.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        while !stop() {
            // SAFETY: one valid pollfd for the duration of the call.
            if unsafe { libc::poll(&mut poll, 1, 100) } > 0 {
                return self.accept().map(Some);
            }
        }
        Ok(None)
    }

    /// Accepts a connection and opens it (TLS, within `OPENING_WAIT` for the whole
    /// handshake).
    pub fn accept(&self) -> Result<Stream> {
        let deadline = Instant::now() + OPENING_WAIT;
        let stream = self.accept_unopened()?.open(self.tls(), deadline)?;
        stream.set_timeouts(Some(IO_TIMEOUT))?;
        Ok(stream)
    }

    /// Accepts a connection, before any TLS handshake.
    pub fn accept_unopened(&self) -> Result<Accepted> {
        Ok(match self {
            Listener::Tcp(l, _) => {
                let (s, _) = l.accept()?;
                tune_tcp(&s)?;
                Accepted::Tcp(s)
            }
            Listener::Unix(l, _) => Accepted::Unix(l.accept()?.0),
        })
    }

    /// What a connection must open TLS with, if anything.
    pub fn tls(&self) -> Option<&Tls> {
        match self {
            Listener::Tcp(_, tls) => tls.as_ref(),
            Listener::Unix(..) => None,
        }
    }
}

/// A connection as accepted, before any TLS handshake.
pub enum Accepted {
    Tcp(TcpStream),
    Unix(UnixStream),
}

impl Accepted {
    /// The peer's address (none for a Unix socket: every peer there is this host).
    pub fn peer(&self) -> Option<IpAddr> {
        match self {
            Accepted::Tcp(s) => s.peer_addr().ok().map(|a| a.ip().to_canonical()),
            Accepted::Unix(_) => None,
        }
    }

    /// A second handle on the socket (to shut it down from elsewhere).
    pub fn try_clone_socket(&self) -> Result<std::os::fd::OwnedFd> {
        Ok(match self {
            Accepted::Tcp(s) => s.try_clone()?.into(),
            Accepted::Unix(s) => s.try_clone()?.into(),
        })
    }

    /// The stream to read and write: with `tls`, once the handshake finished by `deadline`.
    pub fn open(self, tls: Option<&Tls>, deadline: Instant) -> Result<Stream> {
        Ok(match (self, tls) {
            (Accepted::Tcp(s), Some(tls)) => {
                let secured = tls.accept(s, deadline)?;
                Stream::Tls(secured.app, secured.wire, secured.peer)
            }
            (Accepted::Tcp(s), None) => Stream::Tcp(s),
            (Accepted::Unix(s), _) => Stream::Unix(s),
        })
    }
}

/// A socket's queue in bytes, as the ioctl `request` (`TIOCOUTQ`: to send; `FIONREAD`: to
/// read) tells; 0 where it cannot.
fn socket_queue(fd: RawFd, request: libc::Ioctl) -> usize {
    let mut n: libc::c_int = 0;
    // SAFETY: both requests write one int for a socket we own.
    if unsafe { libc::ioctl(fd, request, &mut n) } < 0 {
        return 0;
    }
    n.max(0) as usize
}

/// Sets what every migration TCP socket needs, on both sides: no delay (control messages go
/// at once), keepalive and a limit on unacknowledged data (a dead peer is noticed).
fn tune_tcp(s: &TcpStream) -> std::io::Result<()> {
    s.set_nodelay(true)?;
    let fd = s.as_raw_fd();
    set_int(fd, libc::SOL_SOCKET, libc::SO_KEEPALIVE, 1)?;
    set_int(
        fd,
        libc::IPPROTO_TCP,
        libc::TCP_KEEPIDLE,
        secs(KEEPALIVE_IDLE),
    )?;
    set_int(
        fd,
        libc::IPPROTO_TCP,
        libc::TCP_KEEPINTVL,
        secs(KEEPALIVE_INTERVAL),
    )?;
    set_int(
        fd,
        libc::IPPROTO_TCP,
        libc::TCP_KEEPCNT,
        KEEPALIVE_PROBES as i32,
    )?;
    set_int(
        fd,
        libc::IPPROTO_TCP,
        libc::TCP_USER_TIMEOUT,
        UNACKED_LIMIT.as_millis() as i32,
    )
}

fn get_int(fd: RawFd, level: i32, name: i32) -> std::io::Result<i32> {
    let mut value: i32 = 0;
    let mut len = std::mem::size_of::<i32>() as libc::socklen_t;
    // SAFETY: an int option of a socket we hold, written into a local of the size given.
    let r = unsafe { libc::getsockopt(fd, level, name, (&mut value as *mut i32).cast(), &mut len) };
    if r == 0 {
        Ok(value)
    } else {
        Err(std::io::Error::last_os_error())
    }
}

fn secs(d: Duration) -> i32 {
    d.as_secs() as i32
}

/// Sets an int socket option.
pub(crate) fn set_int(fd: RawFd, level: i32, name: i32, value: i32) -> std::io::Result<()> {
    // SAFETY: an int option on a socket we hold, read from a local of the size given.
    let r = unsafe {
        libc::setsockopt(
            fd,
            level,
            name,
            (&value as *const i32).cast(),
            std::mem::size_of::<i32>() as libc::socklen_t,
        )
    };
    if r == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// Who is at the other end of a connection. A migration's later connections (its extra
/// lanes, a pre-copy or post-copy carried on) must come from the same: its session id alone
/// would admit anyone who learnt it, and without TLS it crosses in clear.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PeerIdentity {
    /// The certificate it presented under TLS (DER): the CA vouches for it.
    Certificate(std::sync::Arc<[u8]>),
    /// Its address, over plain TCP: all a connection without TLS says of its peer.
    Address(std::net::IpAddr),
    /// The user it runs as, over a Unix socket (the kernel vouches).
    User(u32),
    /// A file has no peer.
    Nobody,
}

impl PeerIdentity {
    /// Why `stream` may not join a migration whose peer this is; `None` when it may. A
    /// connection of another kind (an operator carrying a post-copy on over a Unix socket
    /// after TCP) cannot be compared: it is admitted as its own transport admits (a Unix
    /// listener is private to this user, a TCP one takes TLS where the first did).
    pub fn refuses(&self, stream: &Stream) -> Option<String> {
        match stream.peer_identity() {
            Ok(theirs) if theirs == *self => None,
            Ok(theirs) if std::mem::discriminant(&theirs) != std::mem::discriminant(self) => None,
            Ok(theirs) => Some(format!(
                "it comes from {theirs}, and this migration from {self}"
            )),
            Err(e) => Some(e.report()),
        }
    }
}

impl std::fmt::Display for PeerIdentity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            // A short name to tell two apart in a message (not a security fingerprint).
            PeerIdentity::Certificate(der) => {
                write!(f, "the TLS certificate {:08x}", crc32fast::hash(der))
            }
            PeerIdentity::Address(ip) => write!(f, "{ip}"),
            PeerIdentity::User(uid) => write!(f, "uid {uid}"),
            PeerIdentity::Nobody => f.write_str("a file"),
        }
    }
}

/// The user the process at the other end of a Unix socket ran as when it connected or
/// listened.
fn peer_uid(fd: RawFd) -> std::io::Result<u32> {
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: SO_PEERCRED fills a ucred of the length given, both locals that outlive the call.
    let r = unsafe {
        libc::getsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    if r != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(cred.uid)
}

impl Drop for Listener {
    fn drop(&mut self) {
        if let Listener::Unix(_, path) = self {
            let _ = std::fs::remove_file(path);
        }
    }
}

impl Stream {
    pub fn set_timeouts(&self, t: Option<Duration>) -> Result<()> {
        match self {
            Stream::Tcp(s) => {
                s.set_read_timeout(t)?;
                s.set_write_timeout(t)?;
            }
            Stream::Unix(s) | Stream::Tls(s, ..) => {
                s.set_read_timeout(t)?;
                s.set_write_timeout(t)?;
            }
            Stream::File(_) => {}
        }
        Ok(())
    }

    /// A second handle on the same connection (one thread reads while another writes).
    pub fn try_clone(&self) -> Result<Stream> {
        Ok(match self {
            Stream::Tcp(s) => Stream::Tcp(s.try_clone()?),
            Stream::Unix(s) => Stream::Unix(s.try_clone()?),
            Stream::Tls(s, wire, peer) => Stream::Tls(s.try_clone()?, wire.clone(), peer.clone()),
            Stream::File(f) => Stream::File(f.try_clone()?),
        })
    }

    /// The TCP socket this stream's bytes cross (under TLS, the one carrying ciphertext).
    fn tcp(&self) -> Option<&TcpStream> {
        match self {
            Stream::Tcp(s) => Some(s),
            Stream::Tls(_, wire, _) => Some(wire),
            Stream::Unix(_) | Stream::File(_) => None,
        }
    }

    /// Whether the stream's bytes cross a TCP connection (under TLS, the one carrying them).
    pub fn crosses_a_network(&self) -> bool {
        self.tcp().is_some()
    }

    /// Whether the other end runs on this host by the stream's kind alone: a Unix socket.
    /// (Over TCP, the destination says which host it is: `Ready`.)
    pub fn is_local_socket(&self) -> bool {
        matches!(self, Stream::Unix(_))
    }

    /// Bytes written but not yet sent by the kernel (socket send queue); 0 for files.
    pub fn unsent(&self) -> usize {
        let queued = |fd| socket_queue(fd, libc::TIOCOUTQ);
        match self {
            Stream::Tcp(s) => queued(s.as_raw_fd()),
            Stream::Unix(s) => queued(s.as_raw_fd()),
            // What the pump has not taken yet, and what the network has not.
            Stream::Tls(s, wire, _) => queued(s.as_raw_fd()) + queued(wire.as_raw_fd()),
            Stream::File(_) => 0,
        }
    }

    /// Whether bytes have arrived that were not read yet (a read would not wait for the
    /// first of them); never for files.
    pub fn has_unread(&self) -> bool {
        match self {
            Stream::Tcp(s) => socket_queue(s.as_raw_fd(), libc::FIONREAD) > 0,
            // The TLS pump hands plaintext over on this side of the socket pair.
            Stream::Unix(s) | Stream::Tls(s, ..) => socket_queue(s.as_raw_fd(), libc::FIONREAD) > 0,
            Stream::File(_) => false,
        }
    }

    /// What TCP knows of the path (the kernel's `tcp_info`): its latest delivery rate in bytes
    /// per second and the lowest round-trip time seen. None for a stream that is not TCP, or a
    /// kernel that does not say (before 4.9), or no round trip measured yet.
    pub fn tcp_path(&self) -> Option<(u64, Duration)> {
        let info = self.tcp_info(TCPI_DELIVERY_RATE + 8)?;
        let min_rtt = u32::from_ne_bytes(info[TCPI_MIN_RTT_US..][..4].try_into().ok()?);
        if min_rtt == u32::MAX {
            return None; // no round trip measured yet
        }
        let rate = u64::from_ne_bytes(info[TCPI_DELIVERY_RATE..][..8].try_into().ok()?);
        Some((rate, Duration::from_micros(u64::from(min_rtt))))
    }

    /// How long, all told, TCP has had data to send (sending it, or held back by the
    /// receiver's window or its own send buffer), and how long of that the receiver's window
    /// shut it out: time in which the receiver, not the link, set the pace (the kernel's
    /// chronographs). None for a stream that is not TCP, or a kernel that does not say
    /// (before 4.10).
    pub fn sending_times(&self) -> Option<SendingTimes> {
        let info = self.tcp_info(TCPI_SNDBUF_LIMITED_US + 8)?;
        let us = |at: usize| -> Option<Duration> {
            let v = u64::from_ne_bytes(info[at..][..8].try_into().ok()?);
            Some(Duration::from_micros(v))
        };
        let receiver_held = us(TCPI_RWND_LIMITED_US)?;
        Some(SendingTimes {
            with_data: us(TCPI_BUSY_TIME_US)? + receiver_held + us(TCPI_SNDBUF_LIMITED_US)?,
            receiver_held,
        })
    }

    /// The kernel's `tcp_info` of this stream's TCP connection, when it holds at least `len`
    /// bytes of it.
    fn tcp_info(&self, len: usize) -> Option<[u8; 256]> {
        let fd = self.tcp()?.as_raw_fd();
        let mut info = [0u8; 256];
        let mut got = info.len() as libc::socklen_t;
        // SAFETY: TCP_INFO writes at most `got` bytes into the buffer and says how many.
        let r = unsafe {
            libc::getsockopt(
                fd,
                libc::IPPROTO_TCP,
                libc::TCP_INFO,
                info.as_mut_ptr().cast(),
                &mut got,
            )
        };
        (r == 0 && got as usize >= len).then_some(info)
    }

    /// Lets this one connection keep a long path busy: on a round trip of at least
    /// `LONG_PATH`, a send buffer of `rtt` × `LONG_PATH_RATE` (at most `MAX_SEND_BUFFER`; past
    /// `net.core.wmem_max` only where this process may, as root may). A shorter path, a
    /// buffer TCP has already grown past that, or a stream that is not TCP is left as it is.
    pub fn fit_send_buffer(&self, rtt: Duration) {
        let Some(fd) = self.tcp().map(AsRawFd::as_raw_fd) else {
            return;
        };
        if rtt < LONG_PATH {
            return;
        }
        let want = (rtt.as_secs_f64() * LONG_PATH_RATE).min(MAX_SEND_BUFFER) as i32;
        // The kernel reports twice what was asked (its own bookkeeping included).
        if get_int(fd, libc::SOL_SOCKET, libc::SO_SNDBUF).is_ok_and(|now| now / 2 >= want) {
            return;
        }
        if set_int(fd, libc::SOL_SOCKET, libc::SO_SNDBUFFORCE, want).is_err() {
            // Not privileged: as much as the host allows.
            let _ = set_int(fd, libc::SOL_SOCKET, libc::SO_SNDBUF, want);
        }
        tracing::debug!(
            "a {rtt:?} round trip: send buffer {} KiB",
            get_int(fd, libc::SOL_SOCKET, libc::SO_SNDBUF).unwrap_or(0) / 1024
        );
    }

    /// Waits (up to `limit`) until what was written has left this host's send queue, so that
    /// what is sent next does not queue behind it.
    pub fn drain(&self, limit: Duration) {
        let deadline = std::time::Instant::now() + limit;
        while self.unsent() > DRAINED_BYTES && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_micros(200));
        }
    }

    /// Passes `fds` to the peer process: one byte carrying them (`SCM_RIGHTS`), on a Unix
    /// socket only. The peer takes them with `receive_files`.
    pub fn send_files(&self, fds: &[RawFd]) -> Result<()> {
        let Stream::Unix(s) = self else {
            return Err(Error::Param(
                "files pass only over a Unix socket (unix:PATH)".into(),
            ));
        };
        let sent = s
            .send_with_fds(&[&[FILES_BYTE][..]], fds)
            .map_err(|e| Error::transport("cannot pass files to the peer", e.into()))?;
        if sent != 1 {
            return Err(Error::Protocol("the files' byte did not leave".into()));
        }
        Ok(())
    }

    /// Who the peer is, as far as the connection tells: what a later connection of the same
    /// migration (an extra lane, a resume) must match.
    pub fn peer_identity(&self) -> Result<PeerIdentity> {
        let identity = match self {
            Stream::Tls(_, _, cert) => PeerIdentity::Certificate(cert.clone()),
            Stream::Tcp(s) => PeerIdentity::Address(
                s.peer_addr()
                    .map_err(|e| Error::transport("cannot learn the peer's address", e))?
                    .ip(),
            ),
            Stream::Unix(s) => PeerIdentity::User(
                peer_uid(s.as_raw_fd())
                    .map_err(|e| Error::transport("cannot learn who the peer is", e))?,
            ),
            Stream::File(_) => PeerIdentity::Nobody,
        };
        Ok(identity)
    }

    /// Checks that the peer runs as this process's user or as root, as the kernel vouches
    /// (`SO_PEERCRED`, taken when the peer listened): a socket in a directory others can
    /// write may have been bound by a stranger first. Only a Unix socket says.
    pub fn check_peer_is_own(&self) -> Result<()> {
        if let Stream::Unix(s) = self {
            let peer = peer_uid(s.as_raw_fd())
                .map_err(|e| Error::transport("cannot learn who the peer is", e))?;
            // SAFETY: geteuid cannot fail.
            let me = unsafe { libc::geteuid() };
            if peer != me && peer != 0 {
                return Err(Error::Setup(format!(
                    "the process listening there runs as uid {peer}, not this VMM's uid {me} \
                     or root: no VM's memory or disks go to it (is the socket's directory \
                     private?)"
                )));
            }
        }
        Ok(())
    }

    /// Takes the `count` files the peer passed with `send_files`: exactly that many, or an
    /// error naming what came (the kernel closes any that did not fit).
    pub fn receive_files(&self, count: usize) -> Result<Vec<OwnedFd>> {
        let Stream::Unix(s) = self else {
            return Err(Error::Protocol(
                "a live update's files can only come over a Unix socket".into(),
            ));
        };
        let mut byte = [0u8; 1];
        let mut iov = [libc::iovec {
            iov_base: byte.as_mut_ptr().cast(),
            iov_len: 1,
        }];
        // One slot more than asked for: a peer that passes more is noticed, not truncated.
        let mut raw = vec![-1; count + 1];
        // SAFETY: `iov` points at `byte`, which lives for the call.
        let (read, got) = unsafe { s.recv_with_fds(&mut iov, &mut raw) }
            .map_err(|e| Error::transport("cannot take the files the source passed", e.into()))?;
        // SAFETY: the first `got` entries are descriptors the kernel just gave this process.
        let fds: Vec<OwnedFd> = raw[..got]
            .iter()
            .map(|&fd| unsafe { OwnedFd::from_raw_fd(fd) })
            .collect();
        if read != 1 || byte[0] != FILES_BYTE {
            return Err(Error::Protocol(format!(
                "expected the byte that carries the files, got {read} bytes ({:#x})",
                byte[0]
            )));
        }
        if fds.len() != count {
            return Err(Error::Protocol(format!(
                "the source passed {} files where it announced {count}",
                fds.len()
            )));
        }
        Ok(fds)
    }

    /// Whether anyone answers on this stream (a file does not).
    pub fn has_peer(&self) -> bool {
        !matches!(self, Stream::File(_))
    }

    /// Ends a conversation that failed, so that the last word sent (an `Abort` with the
    /// reason) reaches the peer: closing a socket with unread input would reset the connection
    /// and could discard it. Stops sending, then reads and drops what still comes, for at most
    /// `limit`.
    pub fn close_after_last_word(&mut self, limit: Duration) {
        if !self.has_peer() {
            return;
        }
        let half = match self {
            Stream::Tcp(s) => s.shutdown(std::net::Shutdown::Write),
            Stream::Unix(s) | Stream::Tls(s, ..) => s.shutdown(std::net::Shutdown::Write),
            Stream::File(_) => Ok(()),
        };
        if half.is_err() || self.set_timeouts(Some(Duration::from_millis(50))).is_err() {
            return;
        }
        let deadline = std::time::Instant::now() + limit;
        let mut sink = [0u8; 64 * 1024];
        while std::time::Instant::now() < deadline {
            match self.read(&mut sink) {
                Ok(0) => break,
                Ok(_) => {}
                Err(e)
                    if e.kind() == std::io::ErrorKind::WouldBlock
                        || e.kind() == std::io::ErrorKind::TimedOut => {}
                Err(_) => break,
            }
        }
        self.shutdown();
    }

    /// Closes the sending direction, so the peer sees the end of the stream.
    pub fn shutdown(&self) {
        match self {
            Stream::Tcp(s) => {
                let _ = s.shutdown(std::net::Shutdown::Both);
            }
            Stream::Unix(s) | Stream::Tls(s, ..) => {
                let _ = s.shutdown(std::net::Shutdown::Both);
            }
            Stream::File(_) => {}
        }
    }
}

impl Timed for Stream {
    fn set_io_timeout(&self, t: Duration) -> std::io::Result<()> {
        self.set_timeouts(Some(t)).map_err(std::io::Error::other)
    }
}

impl Read for Stream {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        match self {
            Stream::Tcp(s) => s.read(buf),
            Stream::Unix(s) | Stream::Tls(s, ..) => s.read(buf),
            Stream::File(s) => s.read(buf),
        }
    }
    fn read_vectored(&mut self, bufs: &mut [std::io::IoSliceMut<'_>]) -> std::io::Result<usize> {
        match self {
            Stream::Tcp(s) => s.read_vectored(bufs),
            Stream::Unix(s) | Stream::Tls(s, ..) => s.read_vectored(bufs),
            Stream::File(s) => s.read_vectored(bufs),
        }
    }
}

impl Write for Stream {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        match self {
            Stream::Tcp(s) => s.write(buf),
            Stream::Unix(s) | Stream::Tls(s, ..) => s.write(buf),
            Stream::File(s) => s.write(buf),
        }
    }
    fn write_vectored(&mut self, bufs: &[std::io::IoSlice<'_>]) -> std::io::Result<usize> {
        match self {
            Stream::Tcp(s) => s.write_vectored(bufs),
            Stream::Unix(s) | Stream::Tls(s, ..) => s.write_vectored(bufs),
            Stream::File(s) => s.write_vectored(bufs),
        }
    }
    fn flush(&mut self) -> std::io::Result<()> {
        match self {
            Stream::Tcp(s) => s.flush(),
            Stream::Unix(s) | Stream::Tls(s, ..) => s.flush(),
            Stream::File(s) => s.flush(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_refuses_addresses() {
        assert_eq!(
            "tcp:127.0.0.1:4444".parse::<Endpoint>().unwrap(),
            Endpoint::Tcp("127.0.0.1:4444".into())
        );
        assert_eq!(
            "unix:/tmp/x".parse::<Endpoint>().unwrap(),
            Endpoint::Unix("/tmp/x".into())
        );
        for bad in [
            "127.0.0.1:4444",
            "tcp:host",
            "tcp::1",
            "tcp:h:99999",
            "unix:",
            "udp:x:1",
        ] {
            let e = bad.parse::<Endpoint>().unwrap_err().to_string();
            assert!(e.contains("not a migration address"), "{bad}: {e}");
        }
    }

    /// What came and was not read is seen without reading it, on a socket and over TCP.
    #[test]
    fn tells_bytes_come_but_not_read() {
        let (a, b) = UnixStream::pair().unwrap();
        let (mut a, mut b) = (Stream::Unix(a), Stream::Unix(b));
        assert!(!b.has_unread());
        a.write_all(b"receipt").unwrap();
        assert!(b.has_unread());
        let mut got = [0u8; 7];
        b.read_exact(&mut got).unwrap();
        assert!(!b.has_unread());
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let mut tcp = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let peer = Stream::Tcp(listener.accept().unwrap().0);
        tcp.write_all(b"x").unwrap();
        // Loopback delivers within the write, or soon after (a deferred softirq).
        let deadline = Instant::now() + Duration::from_secs(5);
        while !peer.has_unread() && Instant::now() < deadline {
            std::thread::yield_now();
        }
        assert!(peer.has_unread());
        let file = SnapshotFile::Plain(tempfile::tempfile().unwrap());
        assert!(!Stream::File(file).has_unread());
    }

    fn int_option(fd: RawFd, level: i32, name: i32) -> i32 {
        let mut v: i32 = -1;
        let mut len = std::mem::size_of::<i32>() as libc::socklen_t;
        // SAFETY: an int option read into a local of the size given.
        let r = unsafe { libc::getsockopt(fd, level, name, (&mut v as *mut i32).cast(), &mut len) };
        assert_eq!(r, 0, "{}", std::io::Error::last_os_error());
        v
    }

    /// Both ends of a migration's TCP connection notice a dead peer: keepalive probes, and a
    /// limit on unacknowledged data.
    #[test]
    fn both_ends_of_a_tcp_migration_keep_alive() {
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let endpoint: Endpoint = format!("tcp:127.0.0.1:{port}").parse().unwrap();
        let listener = endpoint.listen(None).unwrap();
        let connected = endpoint.connect(None).unwrap();
        let accepted = listener.accept().unwrap();
        for s in [&connected, &accepted] {
            let Stream::Tcp(s) = s else {
                panic!("a plain TCP stream")
            };
            let fd = s.as_raw_fd();
            assert_eq!(int_option(fd, libc::SOL_SOCKET, libc::SO_KEEPALIVE), 1);
            assert_eq!(int_option(fd, libc::IPPROTO_TCP, libc::TCP_KEEPIDLE), 10);
            assert_eq!(int_option(fd, libc::IPPROTO_TCP, libc::TCP_KEEPCNT), 3);
            assert_eq!(
                int_option(fd, libc::IPPROTO_TCP, libc::TCP_USER_TIMEOUT),
                UNACKED_LIMIT.as_millis() as i32
            );
        }
    }

    /// A long path's connection gets a send buffer for its round trip; a short one keeps
    /// TCP's own.
    #[test]
    fn a_long_path_gets_a_send_buffer_for_its_round_trip() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let tcp = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let fd = tcp.as_raw_fd();
        let s = Stream::Tcp(tcp);
        let sndbuf = || get_int(fd, libc::SOL_SOCKET, libc::SO_SNDBUF).unwrap();
        let before = sndbuf();
        s.fit_send_buffer(Duration::from_micros(50));
        assert_eq!(sndbuf(), before, "a short path keeps TCP's tuning");
        s.fit_send_buffer(Duration::from_millis(100));
        let wmem_max: i32 = std::fs::read_to_string("/proc/sys/net/core/wmem_max")
            .map_or(0, |v| v.trim().parse().unwrap_or(0));
        // Root gets the 25 MB it asked for, twice over in the kernel's count; others the
        // host's limit, or what it was if that is more.
        let floor = if is_root() {
            2 * 25_000_000
        } else {
            before.max(2 * wmem_max.min(25_000_000))
        };
        assert!(sndbuf() >= floor, "{} < {floor}", sndbuf());
    }

    fn is_root() -> bool {
        // SAFETY: geteuid has no preconditions.
        unsafe { libc::geteuid() == 0 }
    }

    #[test]
    fn tcp_says_its_rate_and_round_trip_and_other_streams_do_not() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let reader = std::thread::spawn(move || {
            let (mut c, _) = listener.accept().unwrap();
            std::io::copy(&mut c, &mut std::io::sink()).unwrap()
        });
        let mut s = Stream::Tcp(TcpStream::connect(addr).unwrap());
        let chunk = vec![7u8; 1 << 20];
        for _ in 0..16 {
            s.write_all(&chunk).unwrap();
        }
        let (rate, min_rtt) = s.tcp_path().expect("tcp_info on a TCP stream");
        assert!(rate > 0, "a delivery rate after 16 MiB");
        assert!(min_rtt < Duration::from_secs(1), "{min_rtt:?}");
        drop(s);
        assert_eq!(reader.join().unwrap(), 16 << 20);
        let (a, _b) = UnixStream::pair().unwrap();
        assert_eq!(Stream::Unix(a).tcp_path(), None);
    }
}
