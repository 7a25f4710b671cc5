//! The heartbeat device: the workload guest's progress, timestamped by the host.
//!
//! Ports and block layout mirror `guest/abi.h`. A vCPU registers a block (`struct hb_block`) in guest
//! memory; each heartbeat `out` makes ferry read the block and note the host time. Gaps between
//! heartbeats are what the guest lost: across a migration, the gap between the last heartbeat
//! on the source and the first on the destination is the guest-observed downtime.

use std::collections::VecDeque;
use std::ops::RangeInclusive;
use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};
use vm_memory::{Bytes, GuestAddress};

use crate::memory::GuestMemory;

pub const PORTS: RangeInclusive<u16> = 0x5a0..=0x5b7;
pub const PORT_REGISTER: u16 = 0x5a0;
pub const PORT_HEARTBEAT: u16 = 0x5a4;
pub const PORT_VERIFY_ERROR: u16 = 0x5a8;
pub const PORT_DONE: u16 = 0x5ac;
pub const PORT_FATAL_MSG: u16 = 0x5b0;
pub const PORT_BLK_ERROR: u16 = 0x5b4;
const HB_MAGIC: u32 = 0x4645_5259;
const BLOCK_SIZE: usize = 128;
/// Verify-error pages kept for display; the count goes on past it.
const ERROR_PAGES_KEPT: usize = 64;
/// Progress samples kept for rate history (one per `SAMPLE_EVERY_NS`).
const HISTORY_LEN: usize = 8192;
const SAMPLE_EVERY_NS: u64 = 20_000_000;

pub fn now_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0)
}

/// One vCPU's progress as its block last said, plus when we heard it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Progress {
    pub seq: u64,
    pub pages: u64,
    pub passes: u64,
    pub errors: u64,
    pub share_base: u64,
    pub share_pages: u64,
    pub ws_base: u64,
    /// Working-set pages from this one on lie at `ws_base_high` (past the MMIO hole).
    pub ws_split_page: u64,
    pub ws_base_high: u64,
    /// The disk workload (`blk`): sectors written and read back, and reads that did not
    /// carry the stamp last written (or requests that failed).
    pub blk_writes: u64,
    pub blk_reads: u64,
    pub blk_errors: u64,
    /// The forwarding workload (`net=fwd`): frames received, sent back, and dropped or
    /// malformed.
    pub net_rx: u64,
    pub net_tx: u64,
    pub net_errors: u64,
    /// Guest-physical address of the block, once registered.
    pub block: Option<u64>,
    /// Host wall-clock time (ns since the epoch) of the last heartbeat.
    pub last_heartbeat_ns: u64,
}

/// What the guest may tell the VMM that ends or changes the VM's life.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum GuestEvent {
    /// Every vCPU finished its workload (`passes=N`); `failed` if any reported failure.
    Finished { failed: bool },
    /// The guest refused its configuration.
    Fatal(String),
    /// The guest's driver activated or reset the virtio device in `slot`.
    Device {
        slot: usize,
        change: super::virtio::mmio::DriverChange,
    },
}

/// The device state that migrates.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct HeartbeatState {
    pub vcpus: Vec<Progress>,
    pub verify_errors: u64,
    pub verify_error_pages: Vec<u64>,
    pub max_gap_ns: u64,
    /// Disk sectors the guest found wrong (the first few).
    pub blk_error_sectors: Vec<u64>,
}

pub struct HeartbeatDevice {
    state: HeartbeatState,
    done: Vec<Option<u32>>,
    fatal: Vec<u8>,
    /// Heartbeats this process has seen.
    count: u64,
    /// Set on restore: the next heartbeat of each vCPU measures the migration gap.
    restored: Vec<bool>,
    observed_downtime_ns: Option<u64>,
    history: VecDeque<(u64, u64)>,
}

impl crate::persist::Persist for HeartbeatDevice {
    const NAME: &'static str = "heartbeat";
    const VERSION: u32 = 1;
    type State = HeartbeatState;

    fn save(&self) -> Result<HeartbeatState, String> {
        Ok(self.state.clone())
    }

    /// The device as it was on the source, its next heartbeats measuring the gap.
    fn load(&mut self, state: HeartbeatState) -> Result<(), String> {
        *self = Self::restore(state, true);
        Ok(())
    }
}

impl HeartbeatDevice {
    pub fn new(vcpus: usize) -> Self {
        Self::restore(
            HeartbeatState {
                vcpus: vec![Progress::default(); vcpus],
                ..Default::default()
            },
            false,
        )
    }

    /// Rebuilds the device from migrated state; `migrated` arms the downtime measurement.
    pub fn restore(state: HeartbeatState, migrated: bool) -> Self {
        let n = state.vcpus.len();
        Self {
            state,
            done: vec![None; n],
            fatal: Vec::new(),
            count: 0,
            restored: vec![migrated; n],
            observed_downtime_ns: None,
            history: VecDeque::new(),
        }
    }

    pub fn blk_error_sectors(&self) -> &[u64] {
        &self.state.blk_error_sectors
    }

    pub fn port_out(
        &mut self,
        cpu: usize,
        port: u16,
        data: &[u8],
        memory: &GuestMemory,
    ) -> Option<GuestEvent> {
        let value = le_u32(data);
        match port {
            PORT_REGISTER => {
                if let Some(p) = self.state.vcpus.get_mut(cpu) {
                    p.block = Some(u64::from(value));
                }
                self.refresh(cpu, memory);
                None
            }
            PORT_HEARTBEAT => {
                self.heartbeat(cpu, memory);
                None
            }
            PORT_VERIFY_ERROR => {
                self.state.verify_errors += 1;
                if self.state.verify_error_pages.len() < ERROR_PAGES_KEPT {
                    self.state.verify_error_pages.push(u64::from(value));
                }
                tracing::warn!(cpu, page = value, "guest reported a verify error");
                None
            }
            PORT_DONE => {
                if let Some(d) = self.done.get_mut(cpu) {
                    *d = Some(value);
                }
                self.finished()
            }
            PORT_BLK_ERROR => {
                if self.state.blk_error_sectors.len() < ERROR_PAGES_KEPT {
                    self.state.blk_error_sectors.push(u64::from(value));
                }
                tracing::warn!(cpu, sector = value, "guest reported a disk verify error");
                None
            }
            PORT_FATAL_MSG => self.fatal_byte(data.first().copied().unwrap_or(b'\n')),
            _ => None,
        }
    }

    fn heartbeat(&mut self, cpu: usize, memory: &GuestMemory) {
        let now = now_ns();
        self.refresh(cpu, memory);
        let Some(p) = self.state.vcpus.get_mut(cpu) else {
            return;
        };
        if p.last_heartbeat_ns != 0 && now > p.last_heartbeat_ns {
            let gap = now - p.last_heartbeat_ns;
            self.state.max_gap_ns = self.state.max_gap_ns.max(gap);
            if std::mem::take(&mut self.restored[cpu]) {
                let worst = self.observed_downtime_ns.unwrap_or(0).max(gap);
                self.observed_downtime_ns = Some(worst);
            }
        }
        p.last_heartbeat_ns = now;
        self.count += 1;
        if cpu == 0
            && self
                .history
                .back()
                .is_none_or(|&(t, _)| now >= t + SAMPLE_EVERY_NS)
        {
            if self.history.len() == HISTORY_LEN {
                self.history.pop_front();
            }
            let pages = self.total().pages;
            self.history.push_back((now, pages));
        }
    }

    /// Re-reads a vCPU's block from guest memory.
    fn refresh(&mut self, cpu: usize, memory: &GuestMemory) {
        let Some(p) = self.state.vcpus.get_mut(cpu) else {
            return;
        };
        let Some(gpa) = p.block else { return };
        let mut raw = [0u8; BLOCK_SIZE];
        if memory.read_slice(&mut raw, GuestAddress(gpa)).is_err() {
            return;
        }
        let word = |i: usize| u64::from_le_bytes(raw[i * 8..i * 8 + 8].try_into().unwrap());
        if (word(6) >> 32) as u32 != HB_MAGIC {
            return; // not (yet) a block the guest filled in
        }
        p.seq = word(0);
        p.pages = word(1);
        p.passes = word(2);
        p.errors = word(3);
        p.share_base = word(4);
        p.share_pages = word(5);
        p.ws_base = word(7);
        p.ws_split_page = word(8);
        p.ws_base_high = word(9);
        p.blk_writes = word(10);
        p.blk_reads = word(11);
        p.blk_errors = word(12);
        p.net_rx = word(13);
        p.net_tx = word(14);
        p.net_errors = word(15);
    }

    fn finished(&self) -> Option<GuestEvent> {
        if self.done.iter().all(Option::is_some) {
            let failed = self.done.iter().any(|d| *d != Some(0));
            Some(GuestEvent::Finished { failed })
        } else {
            None
        }
    }

    fn fatal_byte(&mut self, byte: u8) -> Option<GuestEvent> {
        if byte != b'\n' {
            if self.fatal.len() < 1024 {
                self.fatal.push(byte);
            }
            return None;
        }
        let msg = String::from_utf8_lossy(&self.fatal).into_owned();
        self.fatal.clear();
        Some(GuestEvent::Fatal(msg))
    }

    /// All vCPUs' counters added up; `seq` is vCPU 0's.
    pub fn total(&self) -> Progress {
        let mut t = Progress::default();
        for p in &self.state.vcpus {
            t.pages += p.pages;
            t.passes += p.passes;
            t.errors += p.errors;
            t.blk_writes += p.blk_writes;
            t.blk_reads += p.blk_reads;
            t.blk_errors += p.blk_errors;
            t.net_rx += p.net_rx;
            t.net_tx += p.net_tx;
            t.net_errors += p.net_errors;
            t.last_heartbeat_ns = t.last_heartbeat_ns.max(p.last_heartbeat_ns);
        }
        if let Some(first) = self.state.vcpus.first() {
            t.seq = first.seq;
            t.ws_base = first.ws_base;
            t.ws_split_page = first.ws_split_page;
            t.ws_base_high = first.ws_base_high;
        }
        t
    }

    pub fn vcpus(&self) -> &[Progress] {
        &self.state.vcpus
    }
    pub fn count(&self) -> u64 {
        self.count
    }
    pub fn verify_errors(&self) -> u64 {
        self.state.verify_errors
    }
    pub fn verify_error_pages(&self) -> &[u64] {
        &self.state.verify_error_pages
    }
    pub fn max_gap_ns(&self) -> u64 {
        self.state.max_gap_ns
    }
    /// The gap the guest saw across the migration that built this VM, once it has resumed.
    pub fn observed_downtime_ns(&self) -> Option<u64> {
        self.observed_downtime_ns
    }
    /// Guest pages touched per second between two host times, from the samples in between.
    pub fn pages_per_second(&self, from_ns: u64, to_ns: u64) -> Option<f64> {
        let mut inside = self
            .history
            .iter()
            .filter(|(t, _)| *t >= from_ns && *t <= to_ns);
        let first = inside.next()?;
        let last = inside.next_back()?;
        let dt = (last.0 - first.0) as f64 / 1e9;
        (dt > 0.0).then(|| (last.1 - first.1) as f64 / dt)
    }
}

fn le_u32(data: &[u8]) -> u32 {
    let mut b = [0u8; 4];
    let n = data.len().min(4);
    b[..n].copy_from_slice(&data[..n]);
    u32::from_le_bytes(b)
}
