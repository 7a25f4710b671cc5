//! Every device passes the same test (`persist::assert_round_trip`): its state saved, loaded
//! into a fresh twin and saved again encodes the same. KVM's own components pass it on a VM
//! (`vm.rs`'s tests).

use migration::bitmap::Bitmap;
use virtio_bindings::virtio_blk::VIRTIO_BLK_F_FLUSH;
use virtio_bindings::virtio_net::VIRTIO_NET_F_MAC;
use vmm_sys_util::eventfd::{EFD_NONBLOCK, EventFd};

use super::heartbeat::{HeartbeatDevice, HeartbeatState, Progress};
use super::serial::SerialDevice;
use super::virtio::VirtioDevice;
use super::virtio::balloon::{Balloon, BalloonConfig};
use super::virtio::block::{Block, DiskConfig};
use super::virtio::mmio::MmioTransport;
use super::virtio::net::Net;
use super::virtio::test_driver::{driver_ok, set_up};
use crate::memory::{MIN_MEMORY, MemoryBackend, create_guest_memory};
use crate::persist::{Component, assert_round_trip};

fn serial() -> SerialDevice {
    SerialDevice::new(
        EventFd::new(EFD_NONBLOCK).unwrap(),
        Box::new(std::io::sink()),
    )
    .unwrap()
}

#[test]
fn the_serial_port_round_trips() {
    let mut port = serial();
    // 115200 8N1 with the receive interrupt on, and a byte in the scratch register.
    for (reg, v) in [(3, 0x80), (0, 1), (1, 0), (3, 3), (1, 1), (7, 0x5a)] {
        port.port_out(super::serial::PORTS.start() + reg, &[v]);
    }
    assert_round_trip(&port, &mut serial());
}

#[test]
fn the_heartbeat_device_round_trips() {
    let cpu = Progress {
        seq: 9,
        pages: 1000,
        block: Some(0x9000),
        last_heartbeat_ns: 17,
        ..Default::default()
    };
    let state = HeartbeatState {
        vcpus: vec![cpu; 2],
        verify_errors: 1,
        verify_error_pages: vec![7],
        max_gap_ns: 5_000_000,
        blk_error_sectors: vec![3],
    };
    let hb = HeartbeatDevice::restore(state, false);
    assert_round_trip(&hb, &mut HeartbeatDevice::new(2));
}

fn transport(device: Box<dyn VirtioDevice>) -> MmioTransport {
    MmioTransport::new(device, EventFd::new(EFD_NONBLOCK).unwrap())
}

/// `device` on a transport its driver brought up with `features`, a queue of 16 on each.
fn brought_up(device: Box<dyn VirtioDevice>, features: u32) -> MmioTransport {
    let queues = device.queue_max_sizes().len() as u64;
    let memory = create_guest_memory(MIN_MEMORY, MemoryBackend::Anonymous).unwrap();
    let mut t = transport(device);
    let rings: Vec<_> = (0..queues)
        .map(|q| {
            let at = 0x10000 + q * 0x4000;
            (at, at + 0x1000, at + 0x2000)
        })
        .collect();
    let mut log = Bitmap::new(MIN_MEMORY / 4096);
    set_up(&mut t, &memory, &mut log, features, 16, &rings);
    driver_ok(&mut t, &memory, &mut log);
    t
}

/// A disk on `file`, not locked (a source and its twin share it).
fn disk(file: &tempfile::NamedTempFile) -> Box<dyn VirtioDevice> {
    let config = DiskConfig {
        path: file.path().to_path_buf(),
        readonly: false,
    };
    Box::new(Block::open(&config, false).unwrap())
}

fn scratch_disk() -> tempfile::NamedTempFile {
    let file = tempfile::NamedTempFile::new().unwrap();
    file.as_file().set_len(1 << 20).unwrap();
    file
}

/// The virtio-mmio transport and a disk on it.
#[test]
fn a_virtio_disk_round_trips() {
    let file = scratch_disk();
    let t = brought_up(disk(&file), 1 << VIRTIO_BLK_F_FLUSH);
    assert_round_trip(&t, &mut transport(disk(&file)));
}

#[test]
fn a_virtio_nic_round_trips() {
    let (Some(nic), Some(twin)) = (
        Net::transient([0x52, 0x54, 0, 0, 0, 1]),
        Net::transient([0x52, 0x54, 0, 0, 0, 2]),
    ) else {
        return;
    };
    let t = brought_up(Box::new(nic), 1 << VIRTIO_NET_F_MAC);
    assert_round_trip(&t, &mut transport(Box::new(twin)));
}

#[test]
fn a_virtio_balloon_round_trips() {
    let config = BalloonConfig::default();
    let mut balloon = Balloon::new(&config).unwrap();
    balloon.set_target(77);
    // Statistics, deflate on OOM and free page reporting.
    let t = brought_up(Box::new(balloon), 0b10_0111);
    assert_round_trip(&t, &mut transport(Box::new(Balloon::new(&config).unwrap())));
}

/// A virtio device's own state is a fragment of its own: one of another kind or version is
/// refused, naming it.
#[test]
fn a_device_state_of_another_kind_or_version_is_refused() {
    let file = scratch_disk();
    let t = brought_up(disk(&file), 1 << VIRTIO_BLK_F_FLUSH);
    let saved = t.save_as("virtio.0").unwrap();
    let mut state: super::virtio::mmio::VirtioState =
        crate::persist::from_bytes(&saved.bytes).unwrap();
    let reload = |state: &super::virtio::mmio::VirtioState| {
        let f = crate::persist::Fragment {
            bytes: crate::persist::to_bytes(state).unwrap(),
            ..saved.clone()
        };
        transport(disk(&file)).load_from(&f).unwrap_err()
    };
    state.device.version = 9;
    let e = reload(&state);
    assert!(
        e.contains("virtio-blk has state version 9, this ferry reads version 1"),
        "{e}"
    );
    state.device.name = "virtio-net".into();
    let e = reload(&state);
    assert!(
        e.contains("virtio.0: a virtio-net state arrived for a virtio-blk"),
        "{e}"
    );
}
