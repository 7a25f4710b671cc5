//! A driver's side of the virtio-mmio transport, for device tests: its registers, and a device
//! brought up to `DRIVER_OK` with its queues.

use migration::bitmap::Bitmap;
use virtio_bindings::virtio_mmio::*;

use super::mmio::MmioTransport;
use crate::memory::GuestMemory;

/// Where one queue's rings lie: descriptor table, available ring, used ring.
pub type Rings = (u64, u64, u64);

pub fn write_reg(t: &mut MmioTransport, m: &GuestMemory, log: &mut Bitmap, reg: u32, v: u32) {
    t.write(u64::from(reg), &v.to_le_bytes(), m, log);
}

pub fn read_reg(t: &MmioTransport, reg: u32) -> u32 {
    let mut b = [0u8; 4];
    t.read(u64::from(reg), &mut b);
    u32::from_le_bytes(b)
}

/// Sets `DRIVER_OK`: the device runs.
pub fn driver_ok(t: &mut MmioTransport, m: &GuestMemory, log: &mut Bitmap) {
    write_reg(t, m, log, VIRTIO_MMIO_STATUS, 1 | 2 | 8 | 4);
}

/// Negotiates `features` (with `VIRTIO_F_VERSION_1`), which the device must accept, and sets
/// up queue i on `rings[i]` with `size` entries; `driver_ok` then starts the device.
pub fn set_up(
    t: &mut MmioTransport,
    m: &GuestMemory,
    log: &mut Bitmap,
    features: u32,
    size: u32,
    rings: &[Rings],
) {
    let mut w = |t: &mut MmioTransport, reg, v| write_reg(t, m, log, reg, v);
    w(t, VIRTIO_MMIO_STATUS, 1 | 2);
    for (sel, word) in [(0, features), (1, 1)] {
        w(t, VIRTIO_MMIO_DRIVER_FEATURES_SEL, sel);
        w(t, VIRTIO_MMIO_DRIVER_FEATURES, word);
    }
    w(t, VIRTIO_MMIO_STATUS, 1 | 2 | 8);
    assert_eq!(read_reg(t, VIRTIO_MMIO_STATUS) & 8, 8, "features accepted");
    for (q, &(desc, avail, used)) in rings.iter().enumerate() {
        w(t, VIRTIO_MMIO_QUEUE_SEL, q as u32);
        w(t, VIRTIO_MMIO_QUEUE_NUM, size);
        w(t, VIRTIO_MMIO_QUEUE_DESC_LOW, desc as u32);
        w(t, VIRTIO_MMIO_QUEUE_AVAIL_LOW, avail as u32);
        w(t, VIRTIO_MMIO_QUEUE_USED_LOW, used as u32);
        w(t, VIRTIO_MMIO_QUEUE_READY, 1);
    }
}
