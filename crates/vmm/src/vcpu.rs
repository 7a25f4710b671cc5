//! vCPU threads and the control that parks and releases them.
//!
//! A vCPU thread owns its `VcpuFd` (behind a mutex) while running. To pause, the controller
//! sets the wish, then kicks each thread with a signal whose handler sets `immediate_exit`, so
//! a kick can never be lost between the wish check and `KVM_RUN`. A parking vCPU first re-enters
//! KVM once with `immediate_exit` set, which completes a pending port I/O: its register state is
//! then final and safe to save. Parked threads release the fd lock, so the controller can read
//! and write vCPU state.

use migration::sync::Locked;
use std::cell::Cell;
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};
use std::sync::mpsc::Sender;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kvm_bindings::kvm_run;
use kvm_ioctls::{VcpuExit, VcpuFd};
use vmm_sys_util::signal::{Killable, SIGRTMIN, register_signal_handler};

use crate::devices::{DeviceBus, GuestEvent};
use crate::error::{Error, Result};
use crate::memory::GuestMemory;

/// Something the VM tells its owner without being asked; its vCPU threads send it (a guest's
/// device event comes from a vCPU's exit).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum VmEvent {
    Guest(GuestEvent),
    VcpuFailed { cpu: usize, reason: String },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Wish {
    Run,
    Pause,
    Stop,
}

struct ControlState {
    wish: Wish,
    parked: usize,
    alive: usize,
    /// Threads that began to run, under their names.
    started: usize,
}

/// What every vCPU thread looks at between two `KVM_RUN`s.
pub struct RunControl {
    state: Mutex<ControlState>,
    changed: Condvar,
    /// Percent of every `THROTTLE_PERIOD` a vCPU sleeps (auto-converge); 0: not throttled.
    throttle: AtomicU8,
    /// Time the vCPUs slept for the throttle, summed over vCPUs, since it was last taken.
    throttled_ns: AtomicU64,
}

const PARK_TIMEOUT: Duration = Duration::from_secs(10);
/// A throttled vCPU runs `(100 - p)` % of each period and sleeps `p` % (QEMU's cpu-throttle
/// uses the same 10 ms slice).
const THROTTLE_PERIOD: Duration = Duration::from_millis(10);

impl RunControl {
    fn new(start_paused: bool, vcpus: usize) -> Self {
        Self {
            state: Mutex::new(ControlState {
                wish: if start_paused { Wish::Pause } else { Wish::Run },
                parked: 0,
                alive: vcpus,
                started: 0,
            }),
            changed: Condvar::new(),
            throttle: AtomicU8::new(0),
            throttled_ns: AtomicU64::new(0),
        }
    }

    /// Between two exits: once a throttled vCPU has run its share of the period, it sleeps the
    /// rest (woken early by a pause or stop, so throttling never lengthens a pause).
    fn throttle(&self, period_start: &mut Instant) {
        let percent = u32::from(self.throttle.load(Ordering::Relaxed));
        if percent == 0 {
            *period_start = Instant::now();
            return;
        }
        if period_start.elapsed() < THROTTLE_PERIOD * (100 - percent) / 100 {
            return;
        }
        let s = self.lock();
        let slept = Instant::now();
        let _ = self
            .changed
            .wait_timeout_while(s, THROTTLE_PERIOD * percent / 100, |s| s.wish == Wish::Run);
        let slept = slept.elapsed().as_nanos() as u64;
        self.throttled_ns.fetch_add(slept, Ordering::Relaxed);
        *period_start = Instant::now();
    }

    fn lock(&self) -> MutexGuard<'_, ControlState> {
        self.state.locked()
    }

    fn wants_park(&self) -> bool {
        self.lock().wish != Wish::Run
    }

    /// Parks the calling vCPU thread while paused; tells whether to stop.
    fn park_until_released(&self) -> bool {
        let mut s = self.lock();
        s.parked += 1;
        self.changed.notify_all();
        while s.wish == Wish::Pause {
            s = self.changed.wait(s).unwrap_or_else(|e| e.into_inner());
        }
        s.parked -= 1;
        self.changed.notify_all();
        s.wish == Wish::Stop
    }

    fn thread_started(&self) {
        self.lock().started += 1;
        self.changed.notify_all();
    }

    /// Waits until every vCPU thread runs under its name (`vcpu{N}`): an orchestrator pins
    /// the threads it finds by name as soon as the boot is answered.
    fn wait_all_started(&self, timeout: Duration) -> Result<()> {
        self.wait_until(
            timeout,
            |s| s.started >= s.alive,
            |s| format!("only {} of {} vCPU threads started", s.started, s.alive),
        )
    }

    /// Waits until `done` holds of the state, or fails after `timeout` saying `short_of`.
    fn wait_until(
        &self,
        timeout: Duration,
        done: impl Fn(&ControlState) -> bool,
        short_of: impl Fn(&ControlState) -> String,
    ) -> Result<()> {
        let deadline = Instant::now() + timeout;
        let mut s = self.lock();
        while !done(&s) {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(Error::Vcpu {
                    cpu: 0,
                    reason: short_of(&s),
                });
            }
            s = self
                .changed
                .wait_timeout(s, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        Ok(())
    }

    fn thread_exited(&self) {
        let mut s = self.lock();
        s.alive -= 1;
        self.changed.notify_all();
    }

    fn set_wish(&self, wish: Wish) {
        self.lock().wish = wish;
        self.changed.notify_all();
    }

    /// Asks every vCPU to park and waits for them (`kick` makes them leave `KVM_RUN`); on a
    /// timeout, releases those that parked.
    fn pause(&self, kick: impl Fn(), timeout: Duration) -> Result<()> {
        self.set_wish(Wish::Pause);
        kick();
        self.wait_all_parked(timeout).inspect_err(|_| {
            let mut s = self.lock();
            if s.wish == Wish::Pause {
                s.wish = Wish::Run;
                self.changed.notify_all();
            }
        })
    }

    /// Waits until every live vCPU thread is parked.
    fn wait_all_parked(&self, timeout: Duration) -> Result<()> {
        self.wait_until(
            timeout,
            |s| s.parked >= s.alive,
            |s| format!("only {} of {} vCPUs parked in time", s.parked, s.alive),
        )
    }
}

thread_local! {
    static THIS_KVM_RUN: Cell<*mut kvm_run> = const { Cell::new(std::ptr::null_mut()) };
}

extern "C" fn kick_handler(_: libc::c_int, _: *mut libc::siginfo_t, _: *mut libc::c_void) {
    THIS_KVM_RUN.with(|run| {
        let run = run.get();
        if !run.is_null() {
            // SAFETY: the pointer is this thread's own mapped kvm_run, set while its fd is held.
            unsafe { (*run).immediate_exit = 1 };
        }
    });
}

fn kick_signal() -> libc::c_int {
    SIGRTMIN()
}

/// Installs the kick handler once per process.
pub fn install_kick_handler() -> Result<()> {
    static ONCE: std::sync::OnceLock<std::result::Result<(), String>> = std::sync::OnceLock::new();
    ONCE.get_or_init(|| {
        register_signal_handler(kick_signal(), kick_handler).map_err(|e| e.to_string())
    })
    .clone()
    .map_err(|e| Error::Vcpu {
        cpu: 0,
        reason: format!("cannot install the vCPU kick handler: {e}"),
    })
}

/// The running vCPU threads of one VM.
pub struct VcpuSet {
    pub fds: Vec<Arc<Mutex<VcpuFd>>>,
    control: Arc<RunControl>,
    threads: Mutex<Vec<JoinHandle<()>>>,
    /// While throttled: kicks every vCPU out of `KVM_RUN` once a period, so that a guest that
    /// does not exit by itself is throttled too.
    kicker: Mutex<Option<JoinHandle<()>>>,
}

struct VcpuContext {
    cpu: usize,
    fd: Arc<Mutex<VcpuFd>>,
    memory: GuestMemory,
    bus: Arc<DeviceBus>,
    control: Arc<RunControl>,
    events: Sender<VmEvent>,
}

impl VcpuSet {
    pub fn start(
        fds: Vec<VcpuFd>,
        memory: &GuestMemory,
        bus: &Arc<DeviceBus>,
        events: &Sender<VmEvent>,
        start_paused: bool,
    ) -> Result<Self> {
        install_kick_handler()?;
        let control = Arc::new(RunControl::new(start_paused, fds.len()));
        let fds: Vec<_> = fds.into_iter().map(|f| Arc::new(Mutex::new(f))).collect();
        let mut threads = Vec::new();
        for (cpu, fd) in fds.iter().enumerate() {
            let ctx = VcpuContext {
                cpu,
                fd: fd.clone(),
                memory: memory.clone(),
                bus: bus.clone(),
                control: control.clone(),
                events: events.clone(),
            };
            let thread = std::thread::Builder::new()
                .name(format!("vcpu{cpu}"))
                .spawn(move || ctx.run())
                .map_err(|e| Error::Vcpu {
                    cpu,
                    reason: format!("cannot start thread: {e}"),
                })?;
            threads.push(thread);
        }
        let set = Self {
            fds,
            control,
            threads: Mutex::new(threads),
            kicker: Mutex::new(None),
        };
        set.control.wait_all_started(PARK_TIMEOUT)?;
        if start_paused {
            set.control.wait_all_parked(PARK_TIMEOUT)?;
        }
        Ok(set)
    }

    fn kick_all(&self) {
        for t in self.threads.locked().iter() {
            let _ = t.kill(kick_signal());
        }
    }

    /// The time the vCPUs slept for the throttle since the last call, summed over vCPUs.
    pub fn take_throttled(&self) -> Duration {
        Duration::from_nanos(self.control.throttled_ns.swap(0, Ordering::Relaxed))
    }

    /// Makes every vCPU sleep `percent` % of its time (0: run freely; at most 99).
    pub fn set_throttle(&self, percent: u8) -> Result<()> {
        let percent = percent.min(99);
        self.control.throttle.store(percent, Ordering::Relaxed);
        let mut kicker = self.kicker.locked();
        if percent == 0 {
            if let Some(k) = kicker.take() {
                let _ = k.join(); // it sees the 0 within a period
            }
            return Ok(());
        }
        if kicker.is_some() {
            return Ok(());
        }
        use std::os::unix::thread::JoinHandleExt;
        let threads: Vec<libc::pthread_t> = self
            .threads
            .locked()
            .iter()
            .map(|t| t.as_pthread_t())
            .collect();
        let control = self.control.clone();
        let thread = std::thread::Builder::new()
            .name("vcpu-throttle".into())
            .spawn(move || {
                while control.throttle.load(Ordering::Relaxed) > 0 {
                    std::thread::sleep(THROTTLE_PERIOD);
                    for &t in &threads {
                        // SAFETY: the vCPU threads outlive the kicker: `stop` clears the
                        // throttle and joins this thread before it joins them.
                        unsafe { libc::pthread_kill(t, kick_signal()) };
                    }
                }
            })
            .map_err(|e| Error::Vcpu {
                cpu: 0,
                reason: format!("cannot start the throttle thread: {e}"),
            })?;
        *kicker = Some(thread);
        Ok(())
    }

    /// Returns once every vCPU is parked with its state complete. If some do not park in
    /// time, those that did run on: a VM half paused would be frozen yet count as running.
    pub fn pause(&self) -> Result<()> {
        self.control.pause(|| self.kick_all(), PARK_TIMEOUT)
    }

    pub fn resume(&self) {
        self.control.set_wish(Wish::Run);
    }

    /// Stops and joins every vCPU thread.
    pub fn stop(&self) {
        let _ = self.set_throttle(0);
        self.control.set_wish(Wish::Stop);
        self.kick_all();
        let threads = std::mem::take(&mut *self.threads.locked());
        for t in threads {
            let _ = t.join();
        }
    }

    /// The fd of a parked vCPU, for state save/restore.
    pub fn lock_fd(&self, cpu: usize) -> MutexGuard<'_, VcpuFd> {
        self.fds[cpu].locked()
    }
}

impl Drop for VcpuSet {
    fn drop(&mut self) {
        self.stop();
    }
}

enum Step {
    Continue,
    Park,
    Exit,
}

impl VcpuContext {
    fn run(self) {
        // The thread has its name by now (the standard library sets it first).
        self.control.thread_started();
        // The guest drives this thread: it may ask the kernel only for what a vCPU needs.
        if let Err(e) = crate::sandbox::enter_device_thread() {
            self.fail(e);
            self.control.thread_exited();
            return;
        }
        loop {
            if self.control.wants_park() && self.control.park_until_released() {
                break;
            }
            if let Step::Exit = self.run_until_park() {
                break;
            }
        }
        self.control.thread_exited();
    }

    /// Runs the vCPU until a pause or stop is wished, or the vCPU cannot go on.
    fn run_until_park(&self) -> Step {
        let mut fd = self.fd.locked();
        THIS_KVM_RUN.with(|r| r.set(fd.get_kvm_run() as *mut kvm_run));
        let mut period_start = Instant::now();
        let step = loop {
            if self.control.wants_park() {
                complete_pending_io(&mut fd);
                break Step::Park;
            }
            match self.step(&mut fd) {
                Step::Continue => self.control.throttle(&mut period_start),
                other => break other,
            }
        };
        THIS_KVM_RUN.with(|r| r.set(std::ptr::null_mut()));
        step
    }

    fn step(&self, fd: &mut VcpuFd) -> Step {
        let exit = match fd.run() {
            Ok(exit) => exit,
            Err(e) if e.errno() == libc::EINTR || e.errno() == libc::EAGAIN => {
                fd.set_kvm_immediate_exit(0);
                return Step::Continue;
            }
            Err(e) => return self.fail(format!("KVM_RUN failed: {e}")),
        };
        match exit {
            VcpuExit::IoOut(port, data) => {
                if let Some(event) = self.bus.port_out(self.cpu, port, data, &self.memory) {
                    let _ = self.events.send(VmEvent::Guest(event));
                }
            }
            VcpuExit::IoIn(port, data) => self.bus.port_in(port, data),
            VcpuExit::MmioRead(addr, data) => self.bus.mmio_read(addr, data),
            VcpuExit::MmioWrite(addr, data) => {
                if let Some(event) = self.bus.mmio_write(addr, data, &self.memory) {
                    let _ = self.events.send(VmEvent::Guest(event));
                }
            }
            VcpuExit::Hlt => {
                let _ = self
                    .events
                    .send(VmEvent::Guest(GuestEvent::Finished { failed: false }));
                return Step::Exit;
            }
            VcpuExit::Shutdown => return self.fail("the guest shut down (triple fault)".into()),
            VcpuExit::FailEntry(reason, _) => {
                return self.fail(format!("VM entry failed, hardware reason {reason:#x}"));
            }
            VcpuExit::InternalError => return self.fail("KVM internal error".into()),
            other => tracing::debug!(cpu = self.cpu, "unhandled exit {other:?}"),
        }
        Step::Continue
    }

    fn fail(&self, reason: String) -> Step {
        let _ = self.events.send(VmEvent::VcpuFailed {
            cpu: self.cpu,
            reason,
        });
        Step::Exit
    }
}

/// Re-enters KVM with `immediate_exit` so that a port I/O the vCPU exited for is completed.
fn complete_pending_io(fd: &mut VcpuFd) {
    fd.set_kvm_immediate_exit(1);
    let _ = fd.run();
    fd.set_kvm_immediate_exit(0);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A vCPU that never parks (stuck in the hypervisor) fails the pause, and the one that
    /// did park runs on: the VM is running, not frozen while it says "running".
    #[test]
    fn a_pause_that_times_out_releases_the_vcpus_that_parked() {
        let control = Arc::new(RunControl::new(false, 2));
        control.set_wish(Wish::Pause);
        let parked = control.clone();
        let vcpu = std::thread::spawn(move || parked.park_until_released());
        let deadline = Instant::now() + Duration::from_secs(10);
        while control.lock().parked == 0 && Instant::now() < deadline {
            std::thread::yield_now();
        }
        let e = control.pause(|| {}, Duration::from_millis(50)).unwrap_err();
        assert!(e.to_string().contains("1 of 2 vCPUs parked"), "{e}");
        // Released (not stopped), and nothing keeps it parked.
        assert!(!vcpu.join().unwrap());
        assert!(!control.wants_park());
        assert_eq!(control.lock().parked, 0);
    }
}
