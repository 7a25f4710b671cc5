//! Devices emulated in ferry: on port I/O the serial port and the heartbeat device, on MMIO
//! virtio devices (PIC, IOAPIC and PIT live in KVM).

mod disks;
pub mod heartbeat;
#[cfg(test)]
mod round_trip;
pub mod serial;
pub mod virtio;

use migration::sync::Locked;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use migration::bitmap::Bitmap;
use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vmm_sys_util::eventfd::{EFD_NONBLOCK, EventFd};

use crate::layout::DEVICE_WINDOW_START;
use crate::memory::GuestMemory;
pub use heartbeat::{GuestEvent, HeartbeatDevice, HeartbeatState, Progress};
pub use serial::{SerialDevice, SerialDeviceState};
use virtio::mmio::MmioTransport;

/// A virtio device and its transport, behind a fair lock: a device's I/O thread serves a
/// guest's requests a turn at a time, and a caller waiting between two turns (an API call, a
/// pause) is handed the lock before the next one.
pub type DeviceSlot = parking_lot::FairMutex<MmioTransport>;
use virtio::{SLOT_SIZE, WriteLog};

/// The longest a pause waits for a device to finish what it is doing.
const QUIESCE_WAIT: std::time::Duration = std::time::Duration::from_secs(2);
/// The longest a VM's teardown waits for its I/O threads.
const JOIN_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

/// The devices vCPU threads reach, on port I/O and MMIO. Each device has its own lock so that
/// serial output never waits behind a heartbeat, a disk request or the reverse.
pub struct DeviceBus {
    pub serial: Mutex<SerialDevice>,
    pub heartbeat: Mutex<HeartbeatDevice>,
    /// virtio-mmio devices, slot by slot from `DEVICE_WINDOW_START`.
    pub virtio: Vec<DeviceSlot>,
    /// Per device, one eventfd per queue that KVM signals on the driver's `QueueNotify` (empty
    /// where KVM would not: then the vCPU that writes it serves the queue).
    notifiers: Vec<Vec<EventFd>>,
    /// Per device, wakes its I/O thread when the VM runs again (see `unquiesce`).
    wakers: Vec<EventFd>,
    /// Per device, queue notifications that came by eventfd and by MMIO exit (status).
    notifies: Vec<[AtomicU64; 2]>,
    /// Pages the VMM itself wrote (device emulation): dirty for migration like guest writes.
    pub vmm_writes: Mutex<Bitmap>,
    /// Set while the VM is paused: devices' I/O threads deliver nothing into guest memory.
    quiesced: AtomicBool,
    /// Set when the VM stops for good: the I/O threads end.
    stopped: AtomicBool,
    /// The devices' I/O threads, joined when the VM is dropped.
    io_threads: Mutex<Vec<std::thread::JoinHandle<()>>>,
}

/// What one device call wrote into guest memory, collected before it joins `vmm_writes`.
#[derive(Default)]
struct Written(Vec<(u64, usize)>);

impl WriteLog for Written {
    fn wrote(&mut self, gpa: u64, len: usize) {
        self.0.push((gpa, len));
    }
}

impl WriteLog for Bitmap {
    fn wrote(&mut self, gpa: u64, len: usize) {
        let end = (gpa + len as u64).div_ceil(4096).min(self.pages());
        for pfn in gpa / 4096..end {
            self.set(pfn);
        }
    }
}

/// Event tokens of a device's epoll set besides its queues'.
const WAKER: u64 = u64::MAX;
const INPUT: u64 = u64::MAX - 1;

impl DeviceBus {
    pub fn new(
        serial: SerialDevice,
        heartbeat: HeartbeatDevice,
        virtio: Vec<MmioTransport>,
        notifiers: Vec<Vec<EventFd>>,
        gfn_end: u64,
    ) -> std::io::Result<Self> {
        Ok(Self {
            serial: Mutex::new(serial),
            heartbeat: Mutex::new(heartbeat),
            wakers: (0..virtio.len())
                .map(|_| EventFd::new(EFD_NONBLOCK))
                .collect::<std::io::Result<_>>()?,
            notifies: (0..virtio.len()).map(|_| Default::default()).collect(),
            virtio: virtio.into_iter().map(DeviceSlot::new).collect(),
            notifiers,
            vmm_writes: Mutex::new(Bitmap::new(gfn_end)),
            quiesced: AtomicBool::new(false),
            stopped: AtomicBool::new(false),
            io_threads: Mutex::default(),
        })
    }

    /// Stops input into guest memory; returns once no device is delivering any. The VM is
    /// about to pause: from here on its memory changes only by its vCPUs, which stop next. A
    /// device busy for longer than `QUIESCE_WAIT` (in post-copy, waiting for a page the link
    /// does not bring) makes the pause fail rather than wait for ever.
    pub fn quiesce(&self) -> Result<(), String> {
        self.quiesced.store(true, Ordering::Release);
        for (slot, d) in self.virtio.iter().enumerate() {
            let deadline = std::time::Instant::now() + QUIESCE_WAIT;
            loop {
                if d.try_lock().is_some() {
                    break;
                }
                if std::time::Instant::now() > deadline {
                    self.unquiesce();
                    return Err(format!(
                        "virtio device {slot} stayed busy for {QUIESCE_WAIT:?}; not paused"
                    ));
                }
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
        }
        Ok(())
    }

    /// Lets the devices deliver again; their I/O threads serve what the driver asked for
    /// meanwhile.
    pub fn unquiesce(&self) {
        self.quiesced.store(false, Ordering::Release);
        for waker in &self.wakers {
            let _ = waker.write(1);
        }
    }

    pub fn stop(&self) {
        self.stopped.store(true, Ordering::Release);
    }

    /// Stops the I/O threads and waits for them (each sees `stopped` within 20 ms, or once the
    /// request it is serving is done). A thread still busy after `JOIN_WAIT` is left behind
    /// (in a post-copy whose source died, a request can wait for ever for a page that will
    /// not come); it holds its own references to the bus and guest memory, so nothing it
    /// uses goes away. Not from an I/O thread. True when every thread stopped.
    pub fn join_io_threads(&self) -> bool {
        self.stop();
        let threads = std::mem::take(&mut *self.io_threads.locked());
        let deadline = std::time::Instant::now() + JOIN_WAIT;
        let mut all = true;
        for t in threads {
            while !t.is_finished() && std::time::Instant::now() < deadline {
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
            if t.is_finished() {
                let _ = t.join();
            } else {
                all = false;
                tracing::warn!(
                    "{} is still serving a request after {JOIN_WAIT:?}; left behind",
                    t.thread().name().unwrap_or("an I/O thread")
                );
            }
        }
        all
    }

    /// Starts each device's I/O thread: it serves the queues the driver notifies through their
    /// eventfds, and the input its backend delivers (a tap).
    /// On failure the threads already started are stopped and joined (the VM does not start).
    pub fn spawn_io_threads(self: &Arc<Self>, memory: &GuestMemory) -> std::io::Result<()> {
        let started = self.start_io_threads(memory);
        if started.is_err() {
            self.join_io_threads();
        }
        started
    }

    fn start_io_threads(self: &Arc<Self>, memory: &GuestMemory) -> std::io::Result<()> {
        for slot in 0..self.virtio.len() {
            let input = self.virtio[slot].lock().device().input_fd();
            if input.is_none() && self.notifiers[slot].is_empty() {
                continue; // nothing to wait for: served on the vCPU threads
            }
            // Set up here, so that a device that could never be served fails the VM's start
            // instead of hanging its driver.
            let epoll = self.event_set(slot, input)?;
            let (bus, memory) = (self.clone(), memory.clone());
            let thread = std::thread::Builder::new()
                .name(format!("virtio-io-{slot}"))
                .spawn(move || {
                    // The guest drives this thread: only what a device needs is allowed.
                    let served = crate::sandbox::enter_device_thread()
                        .map_err(std::io::Error::other)
                        .and_then(|()| bus.serve_events(slot, &epoll, input.is_some(), &memory));
                    if let Err(e) = served {
                        tracing::error!("virtio device {slot}: its I/O thread stopped: {e}");
                    }
                })?;
            self.io_threads.locked().push(thread);
        }
        Ok(())
    }

    /// The device's epoll set: each queue's notifier (token: the queue), the wake-up eventfd
    /// (`WAKER`) and the backend's input (`INPUT`).
    fn event_set(&self, slot: usize, input: Option<RawFd>) -> std::io::Result<Epoll> {
        let epoll = Epoll::new()?;
        let watch = |fd: RawFd, token: u64| {
            epoll.ctl(
                ControlOperation::Add,
                fd,
                EpollEvent::new(EventSet::IN, token),
            )
        };
        for (queue, evt) in self.notifiers[slot].iter().enumerate() {
            watch(evt.as_raw_fd(), queue as u64)?;
        }
        watch(self.wakers[slot].as_raw_fd(), WAKER)?;
        if let Some(fd) = input {
            watch(fd, INPUT)?;
        }
        Ok(epoll)
    }

    /// The device's event loop (epoll): queue notifications, backend input, and the wake-up
    /// after a pause. Serves only while the VM runs; a notification that comes while it is
    /// paused is served when it runs again. Every queue is served once at the start (and
    /// after a state is loaded: `notify_all_queues`), as a loaded state may hold requests
    /// announced to a VMM that never served them.
    fn serve_events(
        &self,
        slot: usize,
        epoll: &Epoll,
        has_input: bool,
        memory: &GuestMemory,
    ) -> std::io::Result<()> {
        let notifiers = &self.notifiers[slot];
        let mut notified = vec![true; notifiers.len()];
        let mut input_ready = has_input;
        let mut events = vec![EpollEvent::default(); notifiers.len() + 2];
        let mut unfinished = false;
        while !self.stopped.load(Ordering::Acquire) {
            // A bounded wait, so that `stopped` is seen; none when a turn left work.
            let timeout = if unfinished { 0 } else { 20 };
            let n = match epoll.wait(timeout, &mut events) {
                Ok(n) => n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            };
            for e in &events[..n] {
                match e.data() {
                    WAKER => drop(self.wakers[slot].read()),
                    INPUT => input_ready = true,
                    queue => {
                        // The count of the driver's writes since the last read.
                        let kicks = notifiers[queue as usize].read().unwrap_or(0);
                        notified[queue as usize] = true;
                        self.notifies[slot][0].fetch_add(kicks, Ordering::Relaxed);
                    }
                }
            }
            let (served, waiting) = {
                let mut d = self.virtio[slot].lock();
                // Under the device's lock, so that `quiesce` (which takes it next) finds
                // nothing half done.
                if self.quiesced.load(Ordering::Acquire) {
                    (false, false)
                } else {
                    let mut written = Written::default();
                    unfinished = false;
                    // A queue served for a turn with work left is served again after the device
                    // was let go (the lock is fair: a waiter gets it first).
                    for (queue, flag) in notified.iter_mut().enumerate() {
                        if std::mem::take(flag) && d.notify(queue, memory, &mut written) {
                            *flag = true;
                            unfinished = true;
                        }
                    }
                    // Input that cannot be delivered (no buffer, a driver not yet running, a
                    // device that failed) stays in the backend; look again shortly.
                    let stuck = std::mem::take(&mut input_ready) && !d.input(memory, &mut written)
                        || d.device().input_pending();
                    self.log(written);
                    (true, stuck)
                }
            };
            if !served || waiting {
                // Paused, or input waits in the backend: look again shortly instead of
                // spinning on a ready fd.
                std::thread::sleep(std::time::Duration::from_millis(1));
                input_ready = has_input;
            }
        }
        Ok(())
    }

    /// The virtio device whose slot holds `addr`, and the offset in it.
    fn virtio_at(&self, addr: u64) -> Option<(&DeviceSlot, u64)> {
        let offset = addr.checked_sub(DEVICE_WINDOW_START)?;
        let slot = (offset / SLOT_SIZE) as usize;
        self.virtio.get(slot).map(|d| (d, offset % SLOT_SIZE))
    }

    pub fn mmio_read(&self, addr: u64, data: &mut [u8]) {
        match self.virtio_at(addr) {
            Some((d, offset)) => d.lock().read(offset, data),
            None => data.fill(0xff), // nothing there: reads float high
        }
    }

    /// Makes every queue of every device look notified, so that each is served once when
    /// the VM runs (after its state was loaded).
    pub fn notify_all_queues(&self) {
        for evt in self.notifiers.iter().flatten() {
            let _ = evt.write(1);
        }
    }

    /// Queue notifications device `slot` has had by eventfd, and by MMIO exit.
    pub fn notifications(&self, slot: usize) -> (u64, u64) {
        let [by_eventfd, by_exit] = &self.notifies[slot];
        (
            by_eventfd.load(Ordering::Relaxed),
            by_exit.load(Ordering::Relaxed),
        )
    }

    /// A vCPU's write to a virtio device's window: said back when the driver activated or
    /// reset the device.
    pub fn mmio_write(&self, addr: u64, data: &[u8], memory: &GuestMemory) -> Option<GuestEvent> {
        let (d, offset) = self.virtio_at(addr)?;
        let slot = ((addr - DEVICE_WINDOW_START) / SLOT_SIZE) as usize;
        if offset == u64::from(virtio::mmio::QUEUE_NOTIFY) {
            self.notifies[slot][1].fetch_add(1, Ordering::Relaxed);
        }
        let mut written = Written::default();
        let change = d.lock().write(offset, data, memory, &mut written);
        self.log(written);
        change.map(|change| GuestEvent::Device { slot, change })
    }

    /// Adds what a device wrote to the VMM's writes (a short lock: never held while a device
    /// serves, so a dirty-log harvest never waits behind a disk request).
    fn log(&self, written: Written) {
        if written.0.is_empty() {
            return;
        }
        let mut all = self.vmm_writes.locked();
        for (gpa, len) in written.0 {
            all.wrote(gpa, len);
        }
    }

    pub fn port_out(
        &self,
        cpu: usize,
        port: u16,
        data: &[u8],
        memory: &GuestMemory,
    ) -> Option<GuestEvent> {
        if serial::PORTS.contains(&port) {
            let mut serial = self.serial.locked();
            serial.port_out(port, data);
            None
        } else if heartbeat::PORTS.contains(&port) {
            let mut hb = self.heartbeat.locked();
            hb.port_out(cpu, port, data, memory)
        } else {
            None // nothing there: writes vanish, as on real hardware
        }
    }

    pub fn port_in(&self, port: u16, data: &mut [u8]) {
        if serial::PORTS.contains(&port) {
            let mut serial = self.serial.locked();
            serial.port_in(port, data);
        } else {
            data.fill(0xff); // an unclaimed port floats high
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A VM's teardown never hangs on an I/O thread stuck in a request (a post-copy page that
    /// will not come): the threads that stop are joined, a stuck one is left behind.
    #[test]
    fn teardown_leaves_a_stuck_io_thread_behind() {
        let serial = SerialDevice::new(
            EventFd::new(EFD_NONBLOCK).unwrap(),
            Box::new(std::io::sink()),
        );
        let bus = Arc::new(
            DeviceBus::new(serial.unwrap(), HeartbeatDevice::new(1), vec![], vec![], 16).unwrap(),
        );
        let (unstick, stuck) = std::sync::mpsc::channel::<()>();
        let (b, done) = (bus.clone(), Arc::new(AtomicBool::new(false)));
        let d = done.clone();
        let serving = std::thread::spawn(move || {
            while !b.stopped.load(Ordering::Acquire) {
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
            d.store(true, Ordering::Release);
        });
        let blocked = std::thread::spawn(move || {
            let _ = stuck.recv();
        });
        *bus.io_threads.lock().unwrap() = vec![serving, blocked];
        bus.join_io_threads();
        assert!(
            done.load(Ordering::Acquire),
            "the serving thread was joined"
        );
        assert!(bus.io_threads.lock().unwrap().is_empty());
        unstick.send(()).unwrap();
    }
}
