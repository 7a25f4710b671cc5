//! Reads and writes held to one deadline for a whole exchange (a TLS handshake, a stream's
//! opening). A socket's own timeout is per read: a peer sending a byte just before each one
//! runs out would hold the reader for good.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

/// A socket whose reads and writes can be given a timeout.
pub trait Timed {
    fn set_io_timeout(&self, t: Duration) -> std::io::Result<()>;
}

impl Timed for TcpStream {
    fn set_io_timeout(&self, t: Duration) -> std::io::Result<()> {
        self.set_read_timeout(Some(t))?;
        self.set_write_timeout(Some(t))
    }
}

impl Timed for UnixStream {
    fn set_io_timeout(&self, t: Duration) -> std::io::Result<()> {
        self.set_read_timeout(Some(t))?;
        self.set_write_timeout(Some(t))
    }
}

impl<T: Timed + ?Sized> Timed for Box<T> {
    fn set_io_timeout(&self, t: Duration) -> std::io::Result<()> {
        (**self).set_io_timeout(t)
    }
}

/// `io`, each read and write of which may wait only until `deadline`.
pub struct Within<'a, S> {
    io: &'a mut S,
    deadline: Instant,
}

impl<'a, S: Timed> Within<'a, S> {
    pub fn new(io: &'a mut S, deadline: Instant) -> Self {
        Self { io, deadline }
    }

    /// Sets the socket's timeout to what is left, or fails once nothing is.
    fn arm(&self) -> std::io::Result<()> {
        let left = self.deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "past the deadline for the whole exchange",
            ));
        }
        self.io.set_io_timeout(left)
    }
}

impl<S: Read + Timed> Read for Within<'_, S> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        self.arm()?;
        self.io.read(buf)
    }
}

impl<S: Write + Timed> Write for Within<'_, S> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.arm()?;
        self.io.write(buf)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.io.flush()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A peer sending a byte every 100 ms, well inside the socket's per-read timeout, is
    /// still cut off at the deadline of the whole read.
    #[test]
    fn a_trickle_ends_at_the_deadline() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let trickler = std::thread::spawn(move || {
            let mut s = TcpStream::connect(addr).unwrap();
            for _ in 0..30 {
                if s.write_all(b"x").is_err() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        });
        let (mut s, _) = listener.accept().unwrap();
        let start = Instant::now();
        let mut buf = [0u8; 64];
        let e = Within::new(&mut s, start + Duration::from_millis(500))
            .read_exact(&mut buf)
            .unwrap_err();
        let took = start.elapsed();
        assert!(
            matches!(
                e.kind(),
                std::io::ErrorKind::TimedOut | std::io::ErrorKind::WouldBlock
            ),
            "{e}"
        );
        assert!(took < Duration::from_secs(2), "took {took:?}");
        drop(s);
        trickler.join().unwrap();
    }
}
