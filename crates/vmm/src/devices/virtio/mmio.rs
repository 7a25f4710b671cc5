//! The virtio-mmio transport, version 2 (virtio 1.x §4.2.2): one 4 KiB register window per
//! device. Written by hand on `virtio-queue`'s `Queue`: the register file is a page of the
//! spec, and owning it keeps every check of what a driver may program in one place.

use serde::{Deserialize, Serialize};
use virtio_bindings::virtio_config::{
    VIRTIO_CONFIG_S_DRIVER, VIRTIO_CONFIG_S_DRIVER_OK, VIRTIO_CONFIG_S_FEATURES_OK,
    VIRTIO_CONFIG_S_NEEDS_RESET, VIRTIO_F_VERSION_1,
};
use virtio_bindings::virtio_mmio::*;
use virtio_queue::{Queue, QueueState, QueueT};
use vmm_sys_util::eventfd::EventFd;

use super::{VirtioDevice, WriteLog};
use crate::persist::{Fragment, Persist};

/// The register a driver writes a queue's index to, to say it has new buffers.
pub const QUEUE_NOTIFY: u32 = VIRTIO_MMIO_QUEUE_NOTIFY;
use crate::memory::GuestMemory;

const MAGIC: u32 = 0x7472_6976; // "virt"
const VENDOR: u32 = 0x5952_5246; // "FRRY"

/// The registers a driver programmed and the queues' positions: with the device's own
/// fields, everything a migration carries of a virtio device.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TransportState {
    pub device_type: u32,
    pub device_features_sel: u32,
    pub driver_features_sel: u32,
    pub driver_features: u64,
    pub queue_sel: u32,
    pub status: u32,
    pub interrupt_status: u32,
    pub config_generation: u32,
    pub queues: Vec<QueueSnapshot>,
    /// Why the device asked for a reset, if it did.
    pub broken: Option<String>,
}

/// A virtio device's state: the transport's and, as a fragment of its own (named and
/// versioned by the device's type), the device's.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct VirtioState {
    pub transport: TransportState,
    pub device: Fragment,
}

/// `virtio_queue::QueueState`, serialisable.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct QueueSnapshot {
    pub max_size: u16,
    pub size: u16,
    pub ready: bool,
    pub next_avail: u16,
    pub next_used: u16,
    pub event_idx: bool,
    pub desc_table: u64,
    pub avail_ring: u64,
    pub used_ring: u64,
}

/// What a driver's status write did to the device, for the VMM to say (Cloud Hypervisor's
/// `virtio-device` events).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DriverChange {
    /// `DRIVER_OK`: the driver set the device up and it runs.
    Activated,
    /// The driver reset a device that ran.
    Reset,
}

pub struct MmioTransport {
    device: Box<dyn VirtioDevice>,
    queues: Vec<Queue>,
    regs: TransportState,
    irq: EventFd,
}

impl MmioTransport {
    pub fn new(device: Box<dyn VirtioDevice>, irq: EventFd) -> Self {
        let queues = fresh_queues(device.as_ref());
        let regs = TransportState {
            device_type: device.device_type(),
            ..Default::default()
        };
        Self {
            device,
            queues,
            regs,
            irq,
        }
    }

    pub fn device(&self) -> &dyn VirtioDevice {
        self.device.as_ref()
    }

    pub fn device_mut(&mut self) -> &mut dyn VirtioDevice {
        self.device.as_mut()
    }

    /// Why the device stopped serving (it set `DEVICE_NEEDS_RESET`), if it did.
    pub fn broken(&self) -> Option<&str> {
        self.regs.broken.as_deref()
    }

    pub fn read(&self, offset: u64, data: &mut [u8]) {
        if offset >= u64::from(VIRTIO_MMIO_CONFIG) {
            self.device
                .read_config(offset - u64::from(VIRTIO_MMIO_CONFIG), data);
            return;
        }
        // The registers are 32 bits wide; other accesses read as zero.
        if data.len() != 4 {
            data.fill(0);
            return;
        }
        let features = self.device.features();
        let value = match offset as u32 {
            VIRTIO_MMIO_MAGIC_VALUE => MAGIC,
            VIRTIO_MMIO_VERSION => 2,
            VIRTIO_MMIO_DEVICE_ID => self.device.device_type(),
            VIRTIO_MMIO_VENDOR_ID => VENDOR,
            VIRTIO_MMIO_DEVICE_FEATURES => match self.regs.device_features_sel {
                0 => features as u32,
                1 => (features >> 32) as u32,
                _ => 0,
            },
            VIRTIO_MMIO_QUEUE_NUM_MAX => self.selected().map_or(0, |q| u32::from(q.max_size())),
            VIRTIO_MMIO_QUEUE_READY => self.selected().map_or(0, |q| u32::from(q.ready())),
            VIRTIO_MMIO_INTERRUPT_STATUS => self.regs.interrupt_status,
            VIRTIO_MMIO_STATUS => self.regs.status,
            VIRTIO_MMIO_CONFIG_GENERATION => self.regs.config_generation,
            _ => 0,
        };
        data.copy_from_slice(&value.to_le_bytes());
    }

    /// A driver's write; says when it activated the device or reset an active one.
    pub fn write(
        &mut self,
        offset: u64,
        data: &[u8],
        memory: &GuestMemory,
        log: &mut dyn WriteLog,
    ) -> Option<DriverChange> {
        // Configuration space is the device's to take (or ignore); registers are 32 bits wide.
        if offset >= u64::from(VIRTIO_MMIO_CONFIG) {
            self.device
                .write_config(offset - u64::from(VIRTIO_MMIO_CONFIG), data);
            return None;
        }
        let Ok(bytes) = <[u8; 4]>::try_from(data) else {
            return None;
        };
        let v = u32::from_le_bytes(bytes);
        match offset as u32 {
            VIRTIO_MMIO_DEVICE_FEATURES_SEL => self.regs.device_features_sel = v,
            VIRTIO_MMIO_DRIVER_FEATURES_SEL => self.regs.driver_features_sel = v,
            VIRTIO_MMIO_DRIVER_FEATURES => self.set_driver_features(v),
            VIRTIO_MMIO_QUEUE_SEL => self.regs.queue_sel = v,
            VIRTIO_MMIO_QUEUE_NUM => self.set_queue_size(v),
            VIRTIO_MMIO_QUEUE_READY => self.set_queue_ready(v, memory),
            VIRTIO_MMIO_QUEUE_DESC_LOW => {
                self.configure(|q| q.set_desc_table_address(Some(v), None))
            }
            VIRTIO_MMIO_QUEUE_DESC_HIGH => {
                self.configure(|q| q.set_desc_table_address(None, Some(v)))
            }
            VIRTIO_MMIO_QUEUE_AVAIL_LOW => {
                self.configure(|q| q.set_avail_ring_address(Some(v), None))
            }
            VIRTIO_MMIO_QUEUE_AVAIL_HIGH => {
                self.configure(|q| q.set_avail_ring_address(None, Some(v)))
            }
            VIRTIO_MMIO_QUEUE_USED_LOW => {
                self.configure(|q| q.set_used_ring_address(Some(v), None))
            }
            VIRTIO_MMIO_QUEUE_USED_HIGH => {
                self.configure(|q| q.set_used_ring_address(None, Some(v)))
            }
            // Without an ioeventfd the vCPU that notified serves the queue, every turn of it.
            VIRTIO_MMIO_QUEUE_NOTIFY => while self.notify(v as usize, memory, log) {},
            VIRTIO_MMIO_INTERRUPT_ACK => self.regs.interrupt_status &= !v,
            VIRTIO_MMIO_STATUS => return self.set_status(v, memory, log),
            _ => {}
        }
        None
    }

    fn selected(&self) -> Option<&Queue> {
        self.queues.get(self.regs.queue_sel as usize)
    }

    fn running(&self) -> bool {
        self.regs.status & VIRTIO_CONFIG_S_DRIVER_OK != 0
    }

    fn set_driver_features(&mut self, v: u32) {
        let s = self.regs.status;
        if s & VIRTIO_CONFIG_S_DRIVER == 0 || s & VIRTIO_CONFIG_S_FEATURES_OK != 0 {
            return; // only while features are negotiated
        }
        let f = &mut self.regs.driver_features;
        match self.regs.driver_features_sel {
            0 => *f = (*f & !0xffff_ffff) | u64::from(v),
            1 => *f = (*f & 0xffff_ffff) | (u64::from(v) << 32),
            _ => {}
        }
    }

    /// Queue registers may change only while the queue is off and the device not running.
    fn configure(&mut self, f: impl FnOnce(&mut Queue)) {
        let running = self.running();
        if let Some(q) = self.queues.get_mut(self.regs.queue_sel as usize)
            && !q.ready()
            && !running
        {
            f(q);
        }
    }

    fn set_queue_size(&mut self, v: u32) {
        let index = self.regs.queue_sel;
        let Some(max) = self.selected().map(|q| q.max_size()) else {
            return;
        };
        if v == 0 || v > u32::from(max) || !v.is_power_of_two() {
            self.needs_reset(format!(
                "queue {index}: size {v} is not a power of two from 1 to {max}"
            ));
            return;
        }
        self.configure(|q| q.set_size(v as u16));
    }

    fn set_queue_ready(&mut self, v: u32, memory: &GuestMemory) {
        let index = self.regs.queue_sel;
        let running = self.running();
        let Some(q) = self.queues.get_mut(index as usize) else {
            return;
        };
        if running {
            return;
        }
        q.set_ready(v == 1);
        if v == 1 && !q.is_valid(memory) {
            q.set_ready(false);
            self.needs_reset(format!(
                "queue {index}: its rings are misaligned or lie outside guest RAM"
            ));
        }
    }

    fn set_status(
        &mut self,
        v: u32,
        memory: &GuestMemory,
        log: &mut dyn WriteLog,
    ) -> Option<DriverChange> {
        if v == 0 {
            let was_active = self.running();
            self.reset();
            return was_active.then_some(DriverChange::Reset);
        }
        let new = v & !self.regs.status;
        let mut status = v | (self.regs.status & VIRTIO_CONFIG_S_NEEDS_RESET);
        if new & VIRTIO_CONFIG_S_FEATURES_OK != 0 {
            let offered = self.device.features();
            let asked = self.regs.driver_features;
            // Refused by leaving the bit clear, as the spec says; the driver reads it back.
            if asked & !offered != 0 || asked & (1 << VIRTIO_F_VERSION_1) == 0 {
                status &= !VIRTIO_CONFIG_S_FEATURES_OK;
            } else {
                self.device.set_driver_features(asked);
            }
        }
        if new & VIRTIO_CONFIG_S_DRIVER_OK != 0 && status & VIRTIO_CONFIG_S_FEATURES_OK == 0 {
            status &= !VIRTIO_CONFIG_S_DRIVER_OK;
        }
        self.regs.status = status;
        if new & VIRTIO_CONFIG_S_DRIVER_OK != 0
            && let Some(i) = self
                .queues
                .iter()
                .position(|q| q.ready() && !q.is_valid(memory))
        {
            self.needs_reset(format!("queue {i}: its rings lie outside guest RAM"));
        }
        if new & status & VIRTIO_CONFIG_S_DRIVER_OK != 0 {
            self.serve_early_notifications(memory, log);
            return Some(DriverChange::Activated);
        }
        None
    }

    /// Serves each ready queue once as the device starts: a driver may have made buffers
    /// available and notified before DRIVER_OK, when a notification is not heard (Linux's
    /// balloon primes its statistics queue so; QEMU serves it at DRIVER_OK too).
    fn serve_early_notifications(&mut self, memory: &GuestMemory, log: &mut dyn WriteLog) {
        for index in 0..self.queues.len() {
            while self.notify(index, memory, log) {}
        }
    }

    fn reset(&mut self) {
        self.device.reset();
        self.queues = fresh_queues(self.device.as_ref());
        self.regs = TransportState {
            device_type: self.device.device_type(),
            config_generation: self.regs.config_generation,
            ..Default::default()
        };
    }

    /// The driver notified queue `index` (through `QueueNotify`, or its ioeventfd): serves it
    /// for one turn. True when work is left for another (`VirtioDevice::unfinished`).
    pub fn notify(&mut self, index: usize, memory: &GuestMemory, log: &mut dyn WriteLog) -> bool {
        if !self.running() || self.regs.broken.is_some() {
            return false;
        }
        if !self.queues.get(index).is_some_and(|q| q.ready()) {
            return false;
        }
        let served = self.device.process(index, &mut self.queues, memory, log);
        self.settle(served, &format!("queue {index}"));
        self.device.unfinished(index) && self.regs.broken.is_none()
    }

    /// The backend has input (the device's I/O thread saw its fd ready); true when some was
    /// delivered.
    pub fn input(&mut self, memory: &GuestMemory, log: &mut dyn WriteLog) -> bool {
        if !self.running() || self.regs.broken.is_some() {
            return false;
        }
        let served = self.device.input(&mut self.queues, memory, log);
        let delivered = matches!(served, Ok(true));
        self.settle(served, "input");
        delivered
    }

    fn settle(&mut self, served: Result<bool, super::DriverError>, what: &str) {
        match served {
            Ok(true) => {
                self.regs.interrupt_status |= VIRTIO_MMIO_INT_VRING;
                let _ = self.irq.write(1);
            }
            Ok(false) => {}
            Err(e) => self.needs_reset(format!("{what}: {}", e.0)),
        }
    }

    /// The device changed its configuration space (a balloon's target): the driver sees a new
    /// generation, and a running driver gets a configuration-change interrupt.
    pub fn config_changed(&mut self) {
        self.regs.config_generation = self.regs.config_generation.wrapping_add(1);
        if self.running() {
            self.regs.interrupt_status |= VIRTIO_MMIO_INT_CONFIG;
            let _ = self.irq.write(1);
        }
    }

    /// The driver programmed the device wrongly: it stops serving until reset, says so in its
    /// status, and the VMM logs why (the VM runs on).
    fn needs_reset(&mut self, why: String) {
        tracing::warn!(
            device = self.device.device_type(),
            "virtio device needs a reset: {why}"
        );
        self.regs.status |= VIRTIO_CONFIG_S_NEEDS_RESET;
        self.regs.broken = Some(why);
        self.regs.interrupt_status |= VIRTIO_MMIO_INT_CONFIG;
        let _ = self.irq.write(1);
    }

    pub fn save_transport(&self) -> TransportState {
        let mut s = self.regs.clone();
        s.queues = self
            .queues
            .iter()
            .map(|q| {
                let st = q.state();
                QueueSnapshot {
                    max_size: st.max_size,
                    size: st.size,
                    ready: st.ready,
                    next_avail: st.next_avail,
                    next_used: st.next_used,
                    event_idx: st.event_idx_enabled,
                    desc_table: st.desc_table,
                    avail_ring: st.avail_ring,
                    used_ring: st.used_ring,
                }
            })
            .collect();
        s
    }

    /// Takes the state another host's transport saved; refused when it is not this kind of
    /// device or a queue does not fit this device.
    pub fn load_transport(&mut self, s: &TransportState) -> Result<(), String> {
        if s.device_type != self.device.device_type() {
            return Err(format!(
                "a virtio device of type {} arrived for one of type {}",
                s.device_type,
                self.device.device_type()
            ));
        }
        let missing = s.driver_features & !self.device.features();
        if missing != 0 {
            return Err(format!(
                "its driver uses features {missing:#x} this device does not offer (another \
                 configuration on this side?)"
            ));
        }
        let max = self.device.queue_max_sizes();
        if s.queues.len() != max.len() {
            return Err(format!(
                "{} queues arrived for a device with {}",
                s.queues.len(),
                max.len()
            ));
        }
        let mut queues = Vec::with_capacity(max.len());
        for (i, (q, &m)) in s.queues.iter().zip(max).enumerate() {
            if q.max_size != m {
                return Err(format!("queue {i}: at most {} here, {m} there", q.max_size));
            }
            let state = QueueState {
                max_size: q.max_size,
                next_avail: q.next_avail,
                next_used: q.next_used,
                event_idx_enabled: q.event_idx,
                size: q.size,
                ready: q.ready,
                desc_table: q.desc_table,
                avail_ring: q.avail_ring,
                used_ring: q.used_ring,
            };
            queues.push(Queue::try_from(state).map_err(|e| format!("queue {i}: {e}"))?);
        }
        self.queues = queues;
        self.regs = TransportState {
            queues: Vec::new(),
            ..s.clone()
        };
        let accepted = s.status & VIRTIO_CONFIG_S_FEATURES_OK != 0;
        self.device
            .set_driver_features(if accepted { s.driver_features } else { 0 });
        Ok(())
    }
}

impl Persist for MmioTransport {
    const NAME: &'static str = "virtio-mmio";
    const VERSION: u32 = 1;
    type State = VirtioState;

    fn save(&self) -> Result<VirtioState, String> {
        Ok(VirtioState {
            transport: self.save_transport(),
            device: self.device.save_as(self.device.kind())?,
        })
    }

    /// The transport's state, then the device's: refused when the device's is of another
    /// kind.
    fn load(&mut self, s: VirtioState) -> Result<(), String> {
        self.load_transport(&s.transport)?;
        let kind = self.device.kind();
        if s.device.name != kind {
            return Err(format!("a {} state arrived for a {kind}", s.device.name));
        }
        self.device.load_from(&s.device)
    }
}

fn fresh_queues(device: &dyn VirtioDevice) -> Vec<Queue> {
    device
        .queue_max_sizes()
        .iter()
        .map(|&m| Queue::new(m).expect("a device's queue sizes are powers of two"))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::devices::virtio::block::{Block, DiskConfig};
    use migration::bitmap::Bitmap;
    use virtio_bindings::virtio_blk::VIRTIO_BLK_T_OUT;
    use vm_memory::{Bytes, GuestAddress};

    const DESC: u64 = 0x1000;
    const AVAIL: u64 = 0x2000;
    const USED: u64 = 0x3000;
    const REQ: u64 = 0x4000;

    /// A block device on a scratch file, its transport, 64 KiB of guest memory.
    fn rig() -> (MmioTransport, GuestMemory, Bitmap, tempfile::NamedTempFile) {
        let file = tempfile::NamedTempFile::new().unwrap();
        file.as_file().set_len(1 << 20).unwrap();
        let disk = DiskConfig {
            path: file.path().to_path_buf(),
            readonly: false,
        };
        let block = Block::open(&disk, true).unwrap();
        let irq = EventFd::new(0).unwrap();
        let memory = GuestMemory::from_ranges(&[(GuestAddress(0), 64 << 10)]).unwrap();
        (
            MmioTransport::new(Box::new(block), irq),
            memory,
            Bitmap::new(16),
            file,
        )
    }

    use crate::devices::virtio::test_driver::{read_reg as r, write_reg as w};

    /// The driver's side up to a live queue of `size` entries at `desc`.
    fn bring_up(t: &mut MmioTransport, m: &GuestMemory, log: &mut Bitmap, size: u32, desc: u64) {
        use crate::devices::virtio::test_driver::{driver_ok, set_up};
        set_up(t, m, log, 0, size, &[(desc, AVAIL, USED)]);
        driver_ok(t, m, log);
    }

    fn put_desc(m: &GuestMemory, i: u64, addr: u64, len: u32, flags: u16, next: u16) {
        let d = DESC + 16 * i;
        m.write_obj(addr, GuestAddress(d)).unwrap();
        m.write_obj(len, GuestAddress(d + 8)).unwrap();
        m.write_obj(flags, GuestAddress(d + 12)).unwrap();
        m.write_obj(next, GuestAddress(d + 14)).unwrap();
    }

    fn offer(m: &GuestMemory, head: u16, idx: u16) {
        m.write_obj(head, GuestAddress(AVAIL + 4 + 2 * u64::from(idx - 1) % 16))
            .unwrap();
        m.write_obj(idx, GuestAddress(AVAIL + 2)).unwrap();
    }

    const NEXT: u16 = 1;
    const WRITE: u16 = 2;

    #[test]
    fn the_transport_says_when_the_driver_activates_or_resets_the_device() {
        use crate::devices::virtio::test_driver::set_up;
        let (mut t, m, mut log, _f) = rig();
        let status = |t: &mut MmioTransport, log: &mut Bitmap, v: u32| {
            t.write(u64::from(VIRTIO_MMIO_STATUS), &v.to_le_bytes(), &m, log)
        };
        assert_eq!(status(&mut t, &mut log, 0), None, "a reset before it ran");
        set_up(&mut t, &m, &mut log, 0, 16, &[(DESC, AVAIL, USED)]);
        let ok = 1 | 2 | 8 | 4;
        assert_eq!(status(&mut t, &mut log, ok), Some(DriverChange::Activated));
        assert_eq!(status(&mut t, &mut log, ok), None, "said once");
        assert_eq!(status(&mut t, &mut log, 0), Some(DriverChange::Reset));
        assert_eq!(status(&mut t, &mut log, 0), None);
    }

    #[test]
    fn a_written_sector_reads_back_and_the_device_writes_are_logged() {
        let (mut t, m, mut log, _f) = rig();
        assert_eq!(r(&t, VIRTIO_MMIO_MAGIC_VALUE), MAGIC);
        bring_up(&mut t, &m, &mut log, 16, DESC);
        // OUT sector 3 from REQ+0x100, then IN sector 3 into REQ+0x400.
        m.write_obj(VIRTIO_BLK_T_OUT, GuestAddress(REQ)).unwrap();
        m.write_obj(3u64, GuestAddress(REQ + 8)).unwrap();
        m.write_slice(&[0xab; 512], GuestAddress(REQ + 0x100))
            .unwrap();
        put_desc(&m, 0, REQ, 16, NEXT, 1);
        put_desc(&m, 1, REQ + 0x100, 512, NEXT, 2);
        put_desc(&m, 2, REQ + 0x300, 1, WRITE, 0);
        offer(&m, 0, 1);
        w(&mut t, &m, &mut log, VIRTIO_MMIO_QUEUE_NOTIFY, 0);
        assert_eq!(m.read_obj::<u8>(GuestAddress(REQ + 0x300)).unwrap(), 0);
        m.write_obj(0u32, GuestAddress(REQ + 0x20)).unwrap(); // IN
        m.write_obj(3u64, GuestAddress(REQ + 0x28)).unwrap();
        put_desc(&m, 3, REQ + 0x20, 16, NEXT, 4);
        put_desc(&m, 4, REQ + 0x400, 512, NEXT | WRITE, 5);
        put_desc(&m, 5, REQ + 0x301, 1, WRITE, 0);
        offer(&m, 3, 2);
        w(&mut t, &m, &mut log, VIRTIO_MMIO_QUEUE_NOTIFY, 0);
        let mut back = [0u8; 512];
        m.read_slice(&mut back, GuestAddress(REQ + 0x400)).unwrap();
        assert_eq!(back, [0xab; 512]);
        assert_eq!(m.read_obj::<u16>(GuestAddress(USED + 2)).unwrap(), 2);
        assert!(t.broken().is_none());
        // The read data, the status bytes and the used ring are dirty for migration.
        assert!(log.get(REQ / 4096) && log.get(USED / 4096));
        assert!(
            !log.get(DESC / 4096),
            "the device never writes the descriptor table"
        );
    }

    #[test]
    fn wrong_programming_asks_for_a_reset_and_the_vmm_goes_on() {
        // A queue size that is not a power of two.
        let (mut t, m, mut log, _f) = rig();
        bring_up(&mut t, &m, &mut log, 3, DESC);
        assert_ne!(r(&t, VIRTIO_MMIO_STATUS) & VIRTIO_CONFIG_S_NEEDS_RESET, 0);
        assert!(t.broken().unwrap().contains("size 3"), "{:?}", t.broken());
        // A reset clears it.
        w(&mut t, &m, &mut log, VIRTIO_MMIO_STATUS, 0);
        assert_eq!(r(&t, VIRTIO_MMIO_STATUS), 0);
        assert!(t.broken().is_none());

        // Rings outside guest RAM.
        bring_up(&mut t, &m, &mut log, 16, 0xf000_0000);
        assert!(t.broken().unwrap().contains("outside guest RAM"));

        // A descriptor loop: 0 → 1 → 0, never a status byte.
        let (mut t, m, mut log, _f) = rig();
        bring_up(&mut t, &m, &mut log, 16, DESC);
        m.write_obj(VIRTIO_BLK_T_OUT, GuestAddress(REQ)).unwrap();
        put_desc(&m, 0, REQ, 16, NEXT, 1);
        put_desc(&m, 1, REQ + 0x100, 512, NEXT, 0);
        offer(&m, 0, 1);
        w(&mut t, &m, &mut log, VIRTIO_MMIO_QUEUE_NOTIFY, 0);
        assert_ne!(r(&t, VIRTIO_MMIO_STATUS) & VIRTIO_CONFIG_S_NEEDS_RESET, 0);
        assert!(t.broken().is_some());
        // Broken, it serves nothing more until reset.
        offer(&m, 0, 2);
        w(&mut t, &m, &mut log, VIRTIO_MMIO_QUEUE_NOTIFY, 0);
        assert_eq!(m.read_obj::<u16>(GuestAddress(USED + 2)).unwrap(), 0);
    }

    #[test]
    fn state_moves_to_a_twin_and_is_checked() {
        let (mut t, m, mut log, _f) = rig();
        bring_up(&mut t, &m, &mut log, 16, DESC);
        let saved = t.save_transport();
        let (mut twin, _m, _log, _f2) = rig();
        twin.load_transport(&saved).unwrap();
        assert_eq!(twin.save_transport(), saved);
        assert_eq!(r(&twin, VIRTIO_MMIO_STATUS), r(&t, VIRTIO_MMIO_STATUS));
        let mut wrong = saved.clone();
        wrong.device_type = 1;
        assert!(twin.load_transport(&wrong).unwrap_err().contains("type 1"));
        let mut wrong = saved;
        wrong.queues[0].size = 3;
        assert!(twin.load_transport(&wrong).unwrap_err().contains("queue 0"));
    }
}
