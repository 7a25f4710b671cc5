//! A switched network a test creates and removes: two hosts and a switch, each a network
//! namespace of its own. The switch holds a Linux bridge (the learning switch), one port per
//! host (`p0`, `p1`: veths to the hosts' uplinks) and a veth whose far end (`gen`) carries a
//! traffic generator and receiver (raw frames on an AF_PACKET socket, sent from a thread that
//! entered the namespace). Each host holds a bridge with its uplink and a tap for its VM
//! (`tap0`), as a hypervisor host's network setup would.
#![allow(dead_code)]

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// The generator's MAC, and the EtherType its frames carry (IEEE local experimental).
pub const GEN_MAC: [u8; 6] = [0x02, 0, 0, 0, 0, 0x99];
const ETHERTYPE: u16 = 0x88b5;
/// Every host's tap for its VM.
pub const TAP: &str = "tap0";

pub struct Testbed {
    /// The switch's namespace.
    pub switch: String,
    /// Each host's namespace; host `i` hangs off the switch's port `p{i}`.
    pub hosts: Vec<String>,
}

fn ip(args: &[&str]) {
    let out = Command::new("ip").args(args).output().expect("ip");
    assert!(
        out.status.success(),
        "ip {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `ip -n NS ARGS...`
fn ip_in(ns: &str, args: &[&str]) {
    ip(&[&["-n", ns][..], args].concat());
}

impl Testbed {
    pub fn new(name: &str, hosts: usize) -> Testbed {
        let tag = format!("{name}-{}", std::process::id());
        let bed = Testbed {
            switch: format!("fsw-{tag}"),
            hosts: (0..hosts).map(|i| format!("fh{i}-{tag}")).collect(),
        };
        // Made one by one: a failed step drops the bed, which removes what was made.
        for ns in std::iter::once(&bed.switch).chain(&bed.hosts) {
            let _ = Command::new("ip").args(["netns", "delete", ns]).output();
            ip(&["netns", "add", ns]);
            ip_in(ns, &["link", "add", "br0", "type", "bridge"]);
            ip_in(ns, &["link", "set", "br0", "up"]);
        }
        let sw = bed.switch.as_str();
        ip_in(
            sw,
            &["link", "add", "gen", "type", "veth", "peer", "name", "genb"],
        );
        ip_in(sw, &["link", "set", "genb", "master", "br0", "up"]);
        ip_in(sw, &["link", "set", "gen", "up"]);
        for (i, host) in bed.hosts.iter().enumerate() {
            let port = format!("p{i}");
            ip_in(
                sw,
                &[
                    "link", "add", &port, "type", "veth", "peer", "name", "uplink", "netns", host,
                ],
            );
            ip_in(sw, &["link", "set", &port, "master", "br0", "up"]);
            ip_in(host, &["link", "set", "uplink", "master", "br0", "up"]);
            ip_in(host, &["tuntap", "add", TAP, "mode", "tap"]);
            ip_in(host, &["link", "set", TAP, "master", "br0", "up"]);
        }
        bed
    }

    /// Gives the generator's end of the switch the address `cidr` (`10.0.0.1/24`), so that
    /// `knock` can reach a guest's IP stack.
    pub fn address_switch(&self, cidr: &str) {
        ip_in(&self.switch, &["addr", "add", cidr, "dev", "gen"]);
    }

    /// Gives host `i`'s bridge the address `cidr`: the hosts reach each other through the
    /// switch, as two machines on one LAN do.
    pub fn address_host(&self, i: usize, cidr: &str) {
        ip_in(&self.hosts[i], &["addr", "add", cidr, "dev", "br0"]);
    }

    /// Whether the guest at `ip` answers: a UDP datagram to a port nobody listens on comes
    /// back as ICMP port-unreachable from its kernel (a connected socket's `recv` fails with
    /// ConnectionRefused). Up to `tries` tries, a second each: the first may wait for ARP,
    /// and Linux rate-limits its ICMP errors.
    pub fn knock(&self, ip: &str, tries: u32) -> bool {
        let (ns, ip) = (self.switch.clone(), ip.to_string());
        std::thread::spawn(move || {
            enter_netns(&ns);
            let sock = std::net::UdpSocket::bind("0.0.0.0:0").expect("a UDP socket");
            sock.connect((ip.as_str(), 9)).expect("connect");
            sock.set_read_timeout(Some(Duration::from_secs(1))).unwrap();
            (0..tries).any(|_| {
                let _ = sock.send(b"knock");
                let mut buf = [0u8; 16];
                matches!(sock.recv(&mut buf), Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused)
            })
        })
        .join()
        .expect("the knocking thread")
    }

    /// Which switch port (`p0`, `p1`) the switch sends `mac` to now.
    pub fn port_of(&self, mac: &str) -> Option<String> {
        let out = Command::new("bridge")
            .args(["-n", &self.switch, "fdb", "show", "br", "br0"])
            .output()
            .ok()?;
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .find(|l| l.starts_with(mac))
            .and_then(|l| l.split_whitespace().nth(2).map(str::to_string))
    }
}

impl Drop for Testbed {
    fn drop(&mut self) {
        // Every interface in them goes with them.
        for ns in std::iter::once(&self.switch).chain(&self.hosts) {
            let _ = Command::new("ip").args(["netns", "delete", ns]).output();
        }
    }
}

/// What the receiver saw: each sequence number's arrival time.
#[derive(Default)]
pub struct Received {
    pub arrivals: Vec<(u64, Instant)>,
}

pub struct Generator {
    stop_tx: Arc<AtomicBool>,
    stop_rx: Arc<AtomicBool>,
    sent: Arc<Mutex<Vec<(u64, Instant)>>>,
    received: Arc<Mutex<Received>>,
    threads: Vec<JoinHandle<()>>,
}

impl Generator {
    /// Sends sequence-numbered frames to `vm_mac` from the switch's `gen` interface, `per_s` a
    /// second (at most `max` frames), and records every frame that comes back.
    pub fn start(bed: &Testbed, vm_mac: [u8; 6], per_s: u64, max: u64) -> Generator {
        let (stop_tx, stop_rx) = (
            Arc::new(AtomicBool::new(false)),
            Arc::new(AtomicBool::new(false)),
        );
        let sent = Arc::new(Mutex::new(Vec::new()));
        let received = Arc::new(Mutex::new(Received::default()));
        let sock = Arc::new(packet_socket(&bed.switch, "gen"));
        let rx = {
            let (sock, stop, received) = (sock.clone(), stop_rx.clone(), received.clone());
            std::thread::spawn(move || {
                let mut buf = [0u8; 2048];
                while !stop.load(Ordering::Acquire) {
                    // SAFETY: a buffer of its length; the socket has a receive timeout.
                    let n = unsafe {
                        libc::recv(sock.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0)
                    };
                    if n < 22 || buf[0..6] != GEN_MAC || buf[12..14] != ETHERTYPE.to_be_bytes() {
                        continue;
                    }
                    let seq = u64::from_be_bytes(buf[14..22].try_into().unwrap());
                    received
                        .lock()
                        .unwrap()
                        .arrivals
                        .push((seq, Instant::now()));
                }
            })
        };
        let tx = {
            let (sock, stop, sent) = (sock, stop_tx.clone(), sent.clone());
            std::thread::spawn(move || {
                let began = Instant::now();
                for seq in 0..max {
                    if stop.load(Ordering::Acquire) {
                        break;
                    }
                    let due = began + Duration::from_micros(seq * 1_000_000 / per_s);
                    if let Some(wait) = due.checked_duration_since(Instant::now()) {
                        std::thread::sleep(wait);
                    }
                    let mut frame = Vec::with_capacity(64);
                    frame.extend_from_slice(&vm_mac);
                    frame.extend_from_slice(&GEN_MAC);
                    frame.extend_from_slice(&ETHERTYPE.to_be_bytes());
                    frame.extend_from_slice(&seq.to_be_bytes());
                    frame.resize(64, 0);
                    // SAFETY: a frame of its length on a bound packet socket.
                    unsafe { libc::send(sock.as_raw_fd(), frame.as_ptr().cast(), frame.len(), 0) };
                    sent.lock().unwrap().push((seq, Instant::now()));
                }
            })
        };
        Generator {
            stop_tx,
            stop_rx,
            sent,
            received,
            threads: vec![tx, rx],
        }
    }

    pub fn sent(&self) -> u64 {
        self.sent.lock().unwrap().len() as u64
    }

    pub fn received(&self) -> u64 {
        self.received.lock().unwrap().arrivals.len() as u64
    }

    /// Frames sent after `t` that came back.
    pub fn received_sent_after(&self, t: Instant) -> u64 {
        let sent = self.sent.lock().unwrap();
        let first = sent.iter().find(|(_, at)| *at > t).map(|(s, _)| *s);
        let received = self.received.lock().unwrap();
        first.map_or(0, |f| {
            received.arrivals.iter().filter(|(s, _)| *s >= f).count() as u64
        })
    }

    /// Stops sending, lets late frames arrive, and returns (sent, received, the longest run of
    /// consecutive sequence numbers that never came back).
    pub fn finish(mut self, linger: Duration) -> (u64, u64, u64) {
        self.stop_tx.store(true, Ordering::Release);
        let mut threads: Vec<_> = self.threads.drain(..).collect();
        let rx = threads.pop();
        for tx in threads {
            let _ = tx.join();
        }
        let sent_n = self.sent();
        std::thread::sleep(linger);
        self.stop_rx.store(true, Ordering::Release);
        if let Some(rx) = rx {
            let _ = rx.join();
        }
        let received = self.received.lock().unwrap();
        let mut got: Vec<u64> = received.arrivals.iter().map(|(s, _)| *s).collect();
        got.sort_unstable();
        got.dedup();
        let (mut longest, mut prev) = (0, None::<u64>);
        for &s in &got {
            let gap = match prev {
                Some(p) => s - p - 1,
                None => s,
            };
            longest = longest.max(gap);
            prev = Some(s);
        }
        (sent_n, got.len() as u64, longest)
    }
}

/// Moves the calling thread (only it) into network namespace `ns`.
fn enter_netns(ns: &str) {
    let f = std::fs::File::open(format!("/var/run/netns/{ns}")).expect("the namespace");
    // SAFETY: setns on a namespace fd we opened, for this thread only.
    let entered = unsafe { libc::setns(f.as_raw_fd(), libc::CLONE_NEWNET) };
    assert_eq!(entered, 0, "setns");
}

/// A raw packet socket bound to `ifname` inside namespace `ns` (entered by a short-lived
/// thread: only that thread changes namespace; the socket stays in it).
fn packet_socket(ns: &str, ifname: &str) -> OwnedFd {
    let (ns, ifname) = (ns.to_string(), ifname.to_string());
    std::thread::spawn(move || {
        enter_netns(&ns);
        let proto = (libc::ETH_P_ALL as u16).to_be();
        // SAFETY: plain socket(2); the fd is owned below.
        let fd = unsafe { libc::socket(libc::AF_PACKET, libc::SOCK_RAW, i32::from(proto)) };
        assert!(
            fd >= 0,
            "AF_PACKET socket: {}",
            std::io::Error::last_os_error()
        );
        // SAFETY: a fresh fd nobody else owns.
        let sock = unsafe { OwnedFd::from_raw_fd(fd) };
        let name = std::ffi::CString::new(ifname).unwrap();
        // SAFETY: a NUL-terminated name.
        let index = unsafe { libc::if_nametoindex(name.as_ptr()) };
        assert!(index > 0, "no interface {}", name.to_string_lossy());
        // SAFETY: sockaddr_ll is plain data; zero is a valid start.
        let mut addr: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
        addr.sll_family = libc::AF_PACKET as u16;
        addr.sll_protocol = proto;
        addr.sll_ifindex = index as i32;
        // SAFETY: bind with a sockaddr_ll of its size.
        let r = unsafe {
            libc::bind(
                sock.as_raw_fd(),
                (&addr as *const libc::sockaddr_ll).cast(),
                std::mem::size_of::<libc::sockaddr_ll>() as u32,
            )
        };
        assert_eq!(r, 0, "bind: {}", std::io::Error::last_os_error());
        let timeout = libc::timeval {
            tv_sec: 0,
            tv_usec: 100_000,
        };
        // SAFETY: a timeval option of its size.
        unsafe {
            libc::setsockopt(
                sock.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_RCVTIMEO,
                (&timeout as *const libc::timeval).cast(),
                std::mem::size_of::<libc::timeval>() as u32,
            )
        };
        sock
    })
    .join()
    .expect("the socket thread")
}

impl Drop for Generator {
    fn drop(&mut self) {
        self.stop_tx.store(true, Ordering::Release);
        self.stop_rx.store(true, Ordering::Release);
    }
}
