//! virtio-net on a tap device (`ferry run --net tap=NAME[,mac=MAC]`): one receive and one
//! transmit queue, a MAC in config space, no offloads. Transmit is served on the vCPU thread
//! that notifies; receive by the device's I/O thread when the tap has a frame (and when the
//! driver posts buffers, for a frame that waited for one).
//!
//! After the VM moves, the destination announces its MAC (RARP frames, as QEMU's
//! self-announce does, five times with growing gaps) so that a learning switch sends its
//! traffic to the new port at once.

use std::time::Duration;

use virtio_bindings::virtio_config::VIRTIO_F_VERSION_1;
use virtio_bindings::virtio_ids::VIRTIO_ID_NET;
use virtio_bindings::virtio_net::VIRTIO_NET_F_MAC;
use virtio_queue::desc::split::Descriptor;
use virtio_queue::{Queue, QueueT};
use vm_memory::{Bytes, GuestAddress};

use super::tap::Tap;
use super::{
    DriverError, VirtioDevice, WriteLog, complete, outside, read_config_bytes, serve_chains,
};
use crate::memory::GuestMemory;

const QUEUE_SIZE: u16 = 256;
const RX: usize = 0;
const TX: usize = 1;
/// `virtio_net_hdr_v1`: what precedes every frame in both directions (virtio 1.x).
const HEADER: usize = 12;
/// The largest frame without offloads: a 1500-byte payload and its Ethernet header.
const MAX_FRAME: usize = 1514;
/// When the MAC is announced after a move, in ms after the first (QEMU's defaults: 50 ms,
/// then 100 ms more each time, 5 rounds).
const ANNOUNCE_AT_MS: [u64; 5] = [0, 50, 200, 450, 800];

/// `--net tap=NAME[,mac=MAC]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NetConfig {
    pub tap: String,
    pub mac: Option<[u8; 6]>,
    /// The tap's open file, when a client passed it (Cloud Hypervisor's `vm.add-net`):
    /// used instead of attaching to `tap` by name, which the kernel would refuse as busy.
    pub file: Option<sockets::passed::PassedFd>,
}

impl std::str::FromStr for NetConfig {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let (mut tap, mut mac) = (None, None);
        for part in s.split(',') {
            match part.split_once('=') {
                Some(("tap", t)) if !t.is_empty() => tap = Some(t.to_string()),
                Some(("mac", m)) => mac = Some(parse_mac(m)?),
                _ => return Err(format!("'{part}' in --net '{s}' (use tap=NAME[,mac=MAC])")),
            }
        }
        let tap = tap.ok_or_else(|| format!("--net '{s}' names no tap= (use tap=NAME)"))?;
        Ok(Self {
            tap,
            mac,
            file: None,
        })
    }
}

fn parse_mac(s: &str) -> Result<[u8; 6], String> {
    let bytes: Vec<u8> = s
        .split(':')
        .map(|b| u8::from_str_radix(b, 16))
        .collect::<Result<_, _>>()
        .map_err(|_| format!("'{s}' is not a MAC address (use xx:xx:xx:xx:xx:xx)"))?;
    let mac: [u8; 6] = bytes
        .try_into()
        .map_err(|_| format!("'{s}' is not a MAC address (six bytes)"))?;
    if mac[0] & 1 != 0 {
        return Err(format!("{s} is a multicast address, not a NIC's"));
    }
    Ok(mac)
}

pub fn format_mac(m: &[u8; 6]) -> String {
    m.iter()
        .map(|b| format!("{b:02x}"))
        .collect::<Vec<_>>()
        .join(":")
}

pub struct Net {
    tap: Tap,
    mac: [u8; 6],
    /// A received frame behind its header, as the driver gets it (kept: one per NIC, not per
    /// frame).
    frame: Vec<u8>,
    /// A frame the driver sends, with its header (kept likewise).
    sent: Vec<u8>,
    /// The length of a frame in `frame` that waits for a receive buffer.
    pending: Option<usize>,
    claimed: bool,
    rx_frames: u64,
    tx_frames: u64,
    dropped: u64,
    announced: u64,
}

impl Net {
    /// Attaches to the tap; `claimed`: the VM boots here (a VM that arrives announces its MAC
    /// when it takes the NIC over).
    pub fn open(config: &NetConfig, claimed: bool) -> Result<Self, String> {
        let tap = match &config.file {
            Some(passed) => {
                let file = passed
                    .try_clone_file()
                    .map_err(|e| format!("the file passed for tap '{}': {e}", config.tap))?;
                Tap::from_file(file, &config.tap)?
            }
            None => Tap::open(&config.tap)?,
        };
        Ok(Self::on(tap, config, claimed))
    }

    /// The NIC `config` asks for, on a tap already attached (passed by a live update).
    pub fn on_file(config: &NetConfig, file: std::fs::File, claimed: bool) -> Result<Self, String> {
        Ok(Self::on(
            Tap::from_file(file, &config.tap)?,
            config,
            claimed,
        ))
    }

    /// The NIC `config` asks for, on `tap`.
    fn on(tap: Tap, config: &NetConfig, claimed: bool) -> Self {
        // A locally administered address from the tap's name when none is given.
        let mac = config.mac.unwrap_or_else(|| {
            let h = config
                .tap
                .bytes()
                .fold(0u32, |h, b| h.wrapping_mul(31).wrapping_add(u32::from(b)));
            let b = h.to_be_bytes();
            [0x52, 0x54, b[0], b[1], b[2], b[3]]
        });
        Self {
            tap,
            mac,
            frame: {
                // The header every received frame gets: one buffer, no offloads.
                let mut f = vec![0u8; HEADER + MAX_FRAME + 4];
                f[10] = 1; // num_buffers
                f
            },
            sent: Vec::with_capacity(HEADER + MAX_FRAME),
            pending: None,
            claimed,
            rx_frames: 0,
            tx_frames: 0,
            dropped: 0,
            announced: 0,
        }
    }

    /// A NIC on a tap of its own, made for it (None, said loudly, where this process may not
    /// make one): for device tests.
    #[cfg(test)]
    pub fn transient(mac: [u8; 6]) -> Option<Self> {
        static MADE: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = MADE.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let name = format!("fy{}n{n}", std::process::id());
        let config = NetConfig {
            tap: name.clone(),
            mac: Some(mac),
            file: None,
        };
        match Tap::transient(&name) {
            Ok(tap) => Some(Self::on(tap, &config, true)),
            Err(e) => {
                eprintln!("*** cannot make tap {name}: {e}; skipped ***");
                None
            }
        }
    }

    /// Frames read from the tap, one at a time, into receive buffers while there are both.
    fn deliver(
        &mut self,
        queue: &mut Queue,
        memory: &GuestMemory,
        log: &mut dyn WriteLog,
    ) -> Result<bool, DriverError> {
        let mut used = false;
        // At most a queue's worth at a time: a flood on the tap cannot hold the device (and a
        // pause waiting for it) for ever; the I/O thread comes back for the rest.
        for _ in 0..queue.size() {
            let len = match self.pending.take() {
                Some(n) => n,
                None => {
                    match self.tap.recv(&mut self.frame[HEADER..]) {
                        Ok(Some(n)) if n <= MAX_FRAME => n,
                        Ok(Some(_)) => {
                            self.dropped += 1; // larger than a buffer could ever hold
                            continue;
                        }
                        Ok(None) => break,
                        Err(e) => {
                            tracing::warn!("tap {}: {e}", self.tap.name());
                            break;
                        }
                    }
                }
            };
            let Some(chain) = queue.pop_descriptor_chain(memory) else {
                self.pending = Some(len); // the driver has no buffer yet
                break;
            };
            let head = chain.head_index();
            let descs: Vec<Descriptor> = chain.collect();
            let written = write_frame(&descs, &self.frame[..HEADER + len], memory, log)?;
            complete(queue, memory, head, written, log)?;
            self.rx_frames += 1;
            used = true;
        }
        Ok(used)
    }

    fn transmit(
        &mut self,
        queue: &mut Queue,
        memory: &GuestMemory,
        log: &mut dyn WriteLog,
    ) -> Result<bool, DriverError> {
        serve_chains(queue, memory, log, |descs, _| {
            read_frame(descs, memory, &mut self.sent)?;
            match self.tap.send(&self.sent[HEADER..]) {
                Ok(true) => self.tx_frames += 1,
                Ok(false) => self.dropped += 1,
                Err(e) => {
                    self.dropped += 1;
                    tracing::warn!("tap {}: {e}", self.tap.name());
                }
            }
            Ok(0)
        })
    }

    /// A RARP request naming this MAC, from it, to everyone (what QEMU sends).
    fn announcement(&self) -> Vec<u8> {
        let mut f = Vec::with_capacity(60);
        f.extend_from_slice(&[0xff; 6]);
        f.extend_from_slice(&self.mac);
        f.extend_from_slice(&0x8035u16.to_be_bytes()); // RARP
        f.extend_from_slice(&[0, 1, 8, 0, 6, 4, 0, 3]); // Ethernet/IPv4, request reverse
        f.extend_from_slice(&self.mac);
        f.extend_from_slice(&[0; 4]);
        f.extend_from_slice(&self.mac);
        f.extend_from_slice(&[0; 4]);
        f.resize(60, 0);
        f
    }

    /// Announces the MAC now and on a schedule, from a thread (the tap is duplicated for it).
    fn announce(&mut self) {
        let frame = self.announcement();
        let mut tap = match self.tap.try_clone() {
            Ok(t) => t,
            Err(e) => {
                tracing::warn!("no MAC announcement: {e}");
                return;
            }
        };
        self.announced += ANNOUNCE_AT_MS.len() as u64;
        let spawned = std::thread::Builder::new()
            .name("net-announce".into())
            .spawn(move || {
                let mut last = 0;
                for at in ANNOUNCE_AT_MS {
                    std::thread::sleep(Duration::from_millis(at - last));
                    last = at;
                    let _ = tap.send(&frame);
                }
            });
        if let Err(e) = spawned {
            tracing::warn!("no MAC announcement: {e}");
        }
    }
}

/// A frame behind its header (`bytes`) into the driver's writable buffers, in order.
fn write_frame(
    descs: &[Descriptor],
    bytes: &[u8],
    memory: &GuestMemory,
    log: &mut dyn WriteLog,
) -> Result<u32, DriverError> {
    let room: usize = descs.iter().map(|d| d.len() as usize).sum();
    if descs.iter().any(|d| !d.is_write_only()) || room < bytes.len() {
        return Err(DriverError(format!(
            "a receive buffer of {room} bytes the device may not write or too small for a \
             {}-byte frame with its header",
            bytes.len()
        )));
    }
    let mut rest = bytes;
    for d in descs {
        if rest.is_empty() {
            break;
        }
        let (now, later) = rest.split_at(rest.len().min(d.len() as usize));
        memory
            .write_slice(now, d.addr())
            .map_err(|_| outside(d.addr().0, now.len()))?;
        log.wrote(d.addr().0, now.len());
        rest = later;
    }
    Ok(bytes.len() as u32)
}

/// A frame with its header from the driver's readable buffers into `into`.
fn read_frame(
    descs: &[Descriptor],
    memory: &GuestMemory,
    into: &mut Vec<u8>,
) -> Result<(), DriverError> {
    let total: usize = descs.iter().map(|d| d.len() as usize).sum();
    if descs.iter().any(|d| d.is_write_only()) || !(HEADER..=HEADER + MAX_FRAME).contains(&total) {
        return Err(DriverError(format!(
            "a transmit buffer of {total} bytes that is writable only or holds no frame of at \
             most {MAX_FRAME} bytes after its header"
        )));
    }
    into.resize(total, 0);
    let mut at = 0;
    for d in descs {
        let n = d.len() as usize;
        memory
            .read_slice(&mut into[at..at + n], GuestAddress(d.addr().0))
            .map_err(|_| outside(d.addr().0, n))?;
        at += n;
    }
    Ok(())
}

impl VirtioDevice for Net {
    fn device_type(&self) -> u32 {
        VIRTIO_ID_NET
    }

    fn features(&self) -> u64 {
        (1 << VIRTIO_F_VERSION_1) | (1 << VIRTIO_NET_F_MAC)
    }

    fn queue_max_sizes(&self) -> &[u16] {
        &[QUEUE_SIZE, QUEUE_SIZE]
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        // virtio_net_config: the MAC first; status and the rest are not offered.
        read_config_bytes(&self.mac, offset, data);
    }

    fn process(
        &mut self,
        index: usize,
        queues: &mut [Queue],
        memory: &GuestMemory,
        log: &mut dyn WriteLog,
    ) -> Result<bool, DriverError> {
        match index {
            // New receive buffers: a frame may be waiting for one.
            RX => self.deliver(&mut queues[RX], memory, log),
            TX => self.transmit(&mut queues[TX], memory, log),
            _ => Ok(false),
        }
    }

    fn input_fd(&self) -> Option<std::os::fd::RawFd> {
        Some(self.tap.fd())
    }

    fn input(
        &mut self,
        queues: &mut [Queue],
        memory: &GuestMemory,
        log: &mut dyn WriteLog,
    ) -> Result<bool, DriverError> {
        if !queues[RX].ready() {
            return Ok(false);
        }
        self.deliver(&mut queues[RX], memory, log)
    }

    fn input_pending(&self) -> bool {
        self.pending.is_some()
    }

    fn file(&self) -> Option<std::os::fd::RawFd> {
        Some(self.tap.fd())
    }

    fn release(&mut self, _keep_lock: bool) -> std::io::Result<()> {
        // A frame read here but not delivered is lost with this host, as on a wire.
        if self.pending.take().is_some() {
            self.dropped += 1;
        }
        self.claimed = false;
        Ok(())
    }

    fn claim(&mut self) -> std::io::Result<()> {
        if !self.claimed {
            self.claimed = true;
            self.announce();
        }
        Ok(())
    }

    fn counters(&self) -> Vec<(&'static str, u64)> {
        vec![
            ("rx_frames", self.rx_frames),
            ("tx_frames", self.tx_frames),
            ("dropped", self.dropped),
            ("announcements", self.announced),
        ]
    }

    fn backing(&self) -> Option<&std::path::Path> {
        None
    }

    fn descriptor(&self) -> migration::DeviceDescriptor {
        migration::DeviceDescriptor::Net {
            tap: self.tap.name().to_string(),
            mac: Some(self.mac),
            features: self.features(),
            queues: self.queue_max_sizes().len() as u16,
        }
    }

    fn describe(&self) -> String {
        format!("tap {}, MAC {}", self.tap.name(), format_mac(&self.mac))
    }

    fn writable(&self) -> bool {
        false // a NIC changes nothing a rollback would have to undo
    }

    fn as_any_mut(&mut self) -> &mut dyn std::any::Any {
        self
    }
}

/// The MAC: the VM keeps it wherever it runs.
impl crate::persist::Persist for Net {
    const NAME: &'static str = "virtio-net";
    const VERSION: u32 = 1;
    type State = [u8; 6];

    fn save(&self) -> Result<[u8; 6], String> {
        Ok(self.mac)
    }

    fn load(&mut self, mac: [u8; 6]) -> Result<(), String> {
        self.mac = mac;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn net_options_parse_and_refuse_with_a_reason() {
        let c: NetConfig = "tap=t0,mac=52:54:00:12:34:56".parse().unwrap();
        assert_eq!(c.tap, "t0");
        assert_eq!(c.mac, Some([0x52, 0x54, 0, 0x12, 0x34, 0x56]));
        for (bad, why) in [
            ("mac=52:54:00:12:34:56", "names no tap="),
            ("tap=t0,mac=52:54:00:12:34", "six bytes"),
            ("tap=t0,mac=zz:54:00:12:34:56", "not a MAC"),
            ("tap=t0,mac=01:00:5e:00:00:01", "multicast"),
            ("tap=t0,speed=10G", "use tap=NAME"),
        ] {
            let e = bad.parse::<NetConfig>().unwrap_err();
            assert!(e.contains(why), "{bad}: {e}");
        }
    }
}
