//! Strangers on a destination's migration port while a migration runs: idle connections that
//! never say a word, and tricklers that send what looks like the opening of a migration one
//! byte at a time. None of them may make the migration fail.

use std::io::Write;
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use migration::wire::frame::{KIND_CONTROL, frame_header, write_stream_header};

/// Connections that stay open and silent.
pub const IDLE: usize = 100;
/// Connections that trickle bytes.
pub const TRICKLERS: usize = 3;
/// A trickler's pace, and the most bytes it sends (two minutes' worth).
const TRICKLE_EVERY: Duration = Duration::from_millis(200);
const TRICKLE_MAX: usize = 600;

pub struct Strangers {
    stop: Arc<AtomicBool>,
    _idle: Vec<TcpStream>,
    tricklers: Vec<JoinHandle<()>>,
}

impl Strangers {
    /// Connects the strangers to `port` on the loopback; they stay until dropped.
    pub fn start(port: u16) -> Strangers {
        let at = SocketAddr::from(([127, 0, 0, 1], port));
        let stop = Arc::new(AtomicBool::new(false));
        let tricklers = (0..TRICKLERS)
            .filter_map(|_| connect(at))
            .map(|s| {
                let stop = stop.clone();
                std::thread::spawn(move || trickle(s, &stop))
            })
            .collect();
        Strangers {
            stop,
            _idle: (0..IDLE).filter_map(|_| connect(at)).collect(),
            tricklers,
        }
    }
}

impl Drop for Strangers {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        for t in self.tricklers.drain(..) {
            let _ = t.join();
        }
    }
}

/// A connection, or none if the listener's queue is full (a stranger turned away is fine).
fn connect(at: SocketAddr) -> Option<TcpStream> {
    TcpStream::connect_timeout(&at, Duration::from_secs(1)).ok()
}

/// The opening of a migration (the stream header, then a control frame's header announcing
/// 1000 bytes), then zeros: one byte every `TRICKLE_EVERY` until stopped, refused, or done.
fn trickle(mut s: TcpStream, stop: &AtomicBool) {
    let mut opening = Vec::new();
    write_stream_header(&mut opening).expect("a stream header");
    opening.extend(frame_header(KIND_CONTROL, 0, 1000));
    let bytes = opening.into_iter().chain(std::iter::repeat(0));
    for byte in bytes.take(TRICKLE_MAX) {
        if stop.load(Ordering::Acquire) || s.write_all(&[byte]).is_err() {
            return;
        }
        std::thread::sleep(TRICKLE_EVERY);
    }
}
