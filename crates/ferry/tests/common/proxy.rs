//! A loopback TCP relay that can cut or corrupt the source-to-destination direction, for
//! failure-injection tests.
#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::thread::JoinHandle;

#[derive(Clone, Copy, Debug)]
pub enum Fault {
    /// Close both directions after this many bytes from the source.
    CutAfter(u64),
    /// Flip one byte at this offset of the source's stream.
    FlipAt(u64),
}

pub struct Proxy {
    pub url: String,
    thread: Option<JoinHandle<()>>,
}

impl Proxy {
    /// Relays one connection to `target` (host:port), applying `fault`.
    pub fn start(target: &str, fault: Fault) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind proxy");
        let url = format!("tcp:{}", listener.local_addr().unwrap());
        let target = target.to_string();
        let thread = std::thread::spawn(move || {
            let Ok((src, _)) = listener.accept() else {
                return;
            };
            let Ok(dst) = TcpStream::connect(&target) else {
                return;
            };
            let (src2, dst2) = (src.try_clone().unwrap(), dst.try_clone().unwrap());
            let back = std::thread::spawn(move || relay(dst2, src2, None));
            relay(src, dst, Some(fault));
            let _ = back.join();
        });
        Proxy {
            url,
            thread: Some(thread),
        }
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn relay(mut from: TcpStream, mut to: TcpStream, fault: Option<Fault>) {
    let mut buf = vec![0u8; 64 * 1024];
    let mut offset = 0u64;
    loop {
        let n = match from.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        let chunk = &mut buf[..n];
        match fault {
            Some(Fault::CutAfter(limit)) if offset + n as u64 >= limit => {
                let keep = (limit - offset) as usize;
                let _ = to.write_all(&chunk[..keep]);
                break;
            }
            Some(Fault::FlipAt(at)) if (offset..offset + n as u64).contains(&at) => {
                chunk[(at - offset) as usize] ^= 0xff;
            }
            _ => {}
        }
        if to.write_all(chunk).is_err() {
            break;
        }
        offset += n as u64;
    }
    let _ = from.shutdown(Shutdown::Both);
    let _ = to.shutdown(Shutdown::Both);
}
