//! The VMM as Cloud Hypervisor's API sees it: empty until `vm.create` (or an arriving VM),
//! then one VM at a time, each run by a ferry `Controller` (the same lifecycle rules, the same
//! migration engine). Errors answer as CH does: 404 when there is no VM, 500 for a call in the
//! wrong state, 400 for bad input.

use migration::sync::Locked;
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, Weak};
use std::time::{Duration, Instant};

use api::ch::{ChRequest, ConsoleMode, Net, VmSpec, VmmPingResponse};
use api::{ApiError, ApiRequest, Handler, Service};
use migration::StatusBoard;
use migration::io::tls::Tls;
use serde_json::{Value, json};
use sockets::passed::PassedFd;
use vmm::VmState;
use vmm::devices::GuestEvent;
use vmm::devices::virtio::mmio::DriverChange;
use vmm::devices::virtio::tap::Tap;

use super::allow::Allowed;
use super::console::Port;
use super::events::Events;
use super::machine;
use crate::controller::Controller;
use crate::lifecycle::Phase;
use crate::metrics::Scraped;
use crate::migrations::Security;

pub enum Slot {
    Empty,
    /// Created, or shut down (CH keeps the config: `vm.boot` boots it again).
    Created(VmSpec),
    /// A VM on its way here (`vm.receive-migration`, `vm.restore`).
    Arriving(Arc<Controller>),
    Live(Arc<Controller>, VmSpec),
}

pub struct ChVmm {
    me: Weak<ChVmm>,
    pub slot: Mutex<Slot>,
    /// Bumped whenever the VM changes, so that a watcher of the old one stops.
    generation: AtomicU64,
    pub events: Events,
    exit: (Mutex<Option<i32>>, Condvar),
    /// TCP migrations without `tls_dir` allowed (`--plain-tcp`).
    pub plain_tcp: bool,
    /// Where an arriving VM's serial port goes (`--serial`), whatever the VM's config says.
    pub arrival_serial: Option<ConsoleMode>,
    /// The VM's config came from a migration peer: its payload is opened (to boot again) only
    /// beneath the allowed directories.
    pub peer_config: AtomicBool,
    /// The disks and taps a VM arriving from a peer may open here.
    pub allowed: Allowed,
    /// When the current migration began, on this host's clock.
    pub migration_began: Mutex<Option<Instant>>,
    /// The booted VM's serial port, kept across a reboot (its pty keeps its path).
    port: Mutex<Option<Port>>,
    /// The migrations' board of the latest VM here, kept once it has gone for `--metrics`.
    last_board: Mutex<Option<StatusBoard>>,
    /// What says an outgoing migration's progress: the source's end waits for it to have
    /// said the migration's end.
    pub progress: Mutex<Option<std::thread::JoinHandle<()>>>,
}

/// No VM here: CH answers 500 (its `VmNotCreated` is an error like any other).
pub fn not_created() -> ApiError {
    ApiError::internal("VM is not created")
}

/// A call in the wrong state: CH answers 500.
pub fn wrong_state(message: impl Into<String>) -> ApiError {
    ApiError::internal(message)
}

/// A controller's refusal in CH's terms: CH answers 400 for bad input, 404 for no VM and
/// 500 for the rest (ferry's 409 for a wrong state, 502 for a failed peer).
pub fn as_ch(e: ApiError) -> ApiError {
    match e.status {
        400 | 404 | 500 => e,
        _ => wrong_state(e.message),
    }
}

impl ChVmm {
    pub fn new(
        events: Events,
        plain_tcp: bool,
        arrival_serial: Option<ConsoleMode>,
        allowed: Allowed,
    ) -> Arc<Self> {
        Arc::new_cyclic(|me| Self {
            me: me.clone(),
            slot: Mutex::new(Slot::Empty),
            generation: AtomicU64::new(0),
            events,
            exit: (Mutex::new(None), Condvar::new()),
            plain_tcp,
            arrival_serial,
            peer_config: AtomicBool::new(false),
            allowed,
            migration_began: Mutex::new(None),
            last_board: Mutex::new(None),
            progress: Mutex::new(None),
            port: Mutex::new(None),
        })
    }

    pub fn me(&self) -> Arc<Self> {
        self.me.upgrade().expect("the VMM lives in an Arc")
    }

    pub fn slot(&self) -> std::sync::MutexGuard<'_, Slot> {
        self.slot.locked()
    }

    /// `controller` runs (or receives) the VM here now: its board is the one scraped.
    pub fn scrape_from(&self, controller: &Controller) {
        *self.last_board.locked() = Some(controller.migrations.board.clone());
    }

    /// The VM's controller, when there is one here or arriving.
    pub fn controller(&self) -> Result<Arc<Controller>, ApiError> {
        match &*self.slot() {
            Slot::Live(c, _) | Slot::Arriving(c) => Ok(c.clone()),
            _ => Err(not_created()),
        }
    }

    /// The VM that runs here, with its controller.
    pub fn live(&self) -> Result<Arc<Controller>, ApiError> {
        match &*self.slot() {
            Slot::Live(c, _) => Ok(c.clone()),
            Slot::Empty => Err(not_created()),
            Slot::Created(_) => Err(wrong_state("VM is not booted")),
            Slot::Arriving(_) => Err(wrong_state("the VM is still arriving")),
        }
    }

    /// Asks the VMM to exit with `code` (`vmm.shutdown`, the guest ended, the VM moved).
    pub fn exit(&self, code: i32) {
        let (lock, cv) = &self.exit;
        lock.locked().get_or_insert(code);
        cv.notify_all();
    }

    /// Waits for `exit`, or `stop()` (a signal): its code.
    pub fn wait_exit(&self, stop: &dyn Fn() -> bool) -> i32 {
        let (lock, cv) = &self.exit;
        let mut code = lock.locked();
        loop {
            if let Some(c) = *code {
                return c;
            }
            if stop() {
                return 0;
            }
            code = cv
                .wait_timeout(code, Duration::from_millis(100))
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// The VM runs here now, under `controller`: watch it until it changes.
    pub fn go_live(&self, controller: Arc<Controller>, spec: VmSpec) {
        let generation = self.generation.fetch_add(1, Ordering::AcqRel) + 1;
        self.scrape_from(&controller);
        *self.slot() = Slot::Live(controller.clone(), spec);
        let this = self.me();
        let _ = std::thread::Builder::new()
            .name("ch-watch".into())
            .spawn(move || this.watch(&controller, generation));
    }

    /// Ends the VM here (shutdown, delete, exit): the slot becomes `then`.
    pub fn end_vm(&self, then: Slot) {
        self.generation.fetch_add(1, Ordering::AcqRel);
        let old = std::mem::replace(&mut *self.slot(), then);
        if let Slot::Live(c, _) = old
            && let Ok(vm) = c.vm()
        {
            vm.shutdown();
        }
    }

    /// Follows the guest's end and a migration that took the VM away, as CH's VMM does: it
    /// exits when the guest ends or once the destination runs the VM.
    fn watch(&self, controller: &Controller, generation: u64) {
        let Ok(vm) = controller.vm().cloned() else {
            return;
        };
        while self.generation.load(Ordering::Acquire) == generation {
            let ended = match vm.next_event(Duration::from_millis(50)) {
                Some(vmm::VmEvent::Guest(GuestEvent::Device { slot, change })) => {
                    self.said_device(slot, change);
                    None
                }
                Some(vmm::VmEvent::Guest(GuestEvent::Finished { failed })) => {
                    Some(i32::from(failed))
                }
                Some(
                    vmm::VmEvent::Guest(GuestEvent::Fatal(_)) | vmm::VmEvent::VcpuFailed { .. },
                ) => Some(1),
                _ => None,
            };
            if let Some(code) = ended {
                // The VMM's end says `shutdown` (as CH's exit path does, `end_all`).
                self.exit(code);
                return;
            }
            if controller.phase() == Phase::Migrated {
                // Let a client read the last figures, then go, as CH's source does, once the
                // migration's watcher has said its end.
                std::thread::sleep(Duration::from_secs(1));
                if let Some(progress) = self.progress.locked().take() {
                    let _ = progress.join();
                }
                self.exit(0);
                return;
            }
        }
    }

    /// CH's `virtio-device` event for the device in virtio `slot` (disks, then NICs), by
    /// its id in the config (`_disk0`, a NIC's own or `_net0`).
    fn said_device(&self, slot: usize, change: DriverChange) {
        let Ok(spec) = self.live_spec() else {
            return;
        };
        let id = match slot.checked_sub(spec.disks.len()) {
            None => format!("_disk{slot}"),
            Some(nic) => match spec.nets.get(nic) {
                Some(net) => net.name(nic),
                None => return,
            },
        };
        let event = match change {
            DriverChange::Activated => "activated",
            DriverChange::Reset => "reset",
        };
        self.events.emit("virtio-device", event, &[("id", id)]);
    }

    fn ping(&self) -> Value {
        let version = env!("CARGO_PKG_VERSION");
        serde_json::to_value(VmmPingResponse {
            // CH's: its git tag, and its crate version (what a client compares).
            build_version: format!("v54.0 (ferry {version})"),
            version: "54.0.0".into(),
            pid: i64::from(std::process::id()),
            features: vec!["kvm".into()],
        })
        .unwrap_or_default()
    }

    /// Whether `spec` can boot here: a VM that arrived from a source that carried no config
    /// has no payload, and a payload a peer named is opened only beneath the allowed
    /// directories.
    fn check_bootable(&self, spec: &VmSpec) -> Result<(), ApiError> {
        if spec.kernel.is_empty() {
            return Err(wrong_state(
                "the VM arrived by migration or restore: it has no payload here to boot",
            ));
        }
        if self.peer_config.load(Ordering::Acquire) {
            self.allowed.admit_payload(spec).map_err(|e| {
                wrong_state(format!("the VM's config came with it from its source: {e}"))
            })?;
        }
        Ok(())
    }

    fn create(&self, spec: VmSpec) -> Result<Value, ApiError> {
        let mut slot = self.slot();
        if !matches!(*slot, Slot::Empty) {
            return Err(wrong_state("VM is already created"));
        }
        self.peer_config.store(false, Ordering::Release);
        *slot = Slot::Created(spec);
        Ok(Value::Null)
    }

    /// `vm.add-net` before `vm.boot`, as libvirt adds each NIC, passing the tap's open file
    /// (or naming an existing tap): the NIC joins the config. ferry has no hotplug.
    fn add_net(&self, mut net: Net, named: bool, files: Vec<OwnedFd>) -> Result<Value, ApiError> {
        let bad = |m: String| ApiError::bad_request(m);
        match <[OwnedFd; 1]>::try_from(files) {
            Ok([fd]) => {
                let file = std::fs::File::from(fd);
                let tap = Tap::name_of(&file).map_err(|e| {
                    bad(format!("the file passed with vm.add-net is not a tap: {e}"))
                })?;
                if named && net.tap != tap {
                    return Err(bad(format!(
                        "vm.add-net names tap {} but passes the file of tap {tap}",
                        net.tap
                    )));
                }
                net.tap = tap;
                net.file = Some(PassedFd::new(file.into()));
            }
            Err(files) if files.is_empty() && !named => {
                return Err(bad(
                    "vm.add-net names no tap and passes no tap's file".into()
                ));
            }
            Err(files) if !files.is_empty() => {
                return Err(bad(format!(
                    "vm.add-net passed {} files: ferry's NIC has one queue pair, on one tap \
                     file",
                    files.len()
                )));
            }
            Err(_) => {}
        }
        let mut slot = self.slot();
        let spec = match &mut *slot {
            Slot::Created(spec) => spec,
            Slot::Empty => return Err(not_created()),
            _ => {
                return Err(bad(
                    "vm.add-net: ferry has no hotplug; add NICs before vm.boot".into(),
                ));
            }
        };
        spec.nets.push(net);
        Ok(json!({"id": format!("_net{}", spec.nets.len() - 1)}))
    }

    pub fn boot(&self) -> Result<Value, ApiError> {
        let spec = match &*self.slot() {
            Slot::Empty => return Err(not_created()),
            Slot::Created(spec) => spec.clone(),
            Slot::Arriving(_) => return Err(wrong_state("the VM is still arriving")),
            Slot::Live(c, _) => return self.boot_live(c),
        };
        self.check_bootable(&spec)?;
        self.events.emit("vm", "booting", &[]);
        self.start_vm(spec)?;
        self.events.emit("vm", "booted", &[]);
        Ok(Value::Null)
    }

    /// Boots `spec`'s payload on the serial port it had (a reboot) or a new one; answers
    /// once its vCPU threads run.
    fn start_vm(&self, mut spec: VmSpec) -> Result<(), ApiError> {
        let kept = self.port.locked().take();
        let port = match kept {
            Some(port) => port,
            None => Port::open(&spec.serial_ports())?,
        };
        let vm = machine::boot(&spec, port.writer())?;
        if let Some(pty) = &port.pty {
            spec.set_pty(pty);
        }
        *self.port.locked() = Some(port);
        let security = per_request(None);
        self.go_live(Controller::with_vm(Arc::new(vm), security), spec);
        Ok(())
    }

    /// `vm.boot` of a booted VM: CH resumes a paused one and refuses a running one.
    fn boot_live(&self, c: &Controller) -> Result<Value, ApiError> {
        match c.vm()?.state() {
            VmState::Running => Err(wrong_state("VM is already booted (running)")),
            _ => self.change(c, ApiRequest::Resume, "resum"),
        }
    }

    /// Pause or resume through the controller's lifecycle rule, refused in CH's way when the
    /// VM is already so (CH's state machine has no Paused → Paused).
    fn change(&self, c: &Controller, request: ApiRequest, verb: &str) -> Result<Value, ApiError> {
        let running = c.vm()?.state() == VmState::Running;
        match (&request, running) {
            (ApiRequest::Pause, false) => return Err(wrong_state("VM is not running")),
            (ApiRequest::Resume, true) => return Err(wrong_state("VM is not paused")),
            _ => {}
        }
        self.events.emit("vm", &format!("{verb}ing"), &[]);
        c.handle(request).map_err(as_ch)?;
        self.events.emit("vm", &format!("{verb}ed"), &[]);
        Ok(Value::Null)
    }

    fn info(&self) -> Result<Value, ApiError> {
        let (state, spec, memory) = match &*self.slot() {
            Slot::Empty | Slot::Arriving(_) => return Err(not_created()),
            Slot::Created(spec) => ("Created", spec.clone(), spec.memory_bytes),
            Slot::Live(c, spec) => {
                let vm = c.vm()?;
                let state = match c.phase() {
                    Phase::Live if vm.state() == VmState::Running => "Running",
                    Phase::Live => "Paused",
                    _ => "Shutdown",
                };
                (state, spec.clone(), vm.config().memory)
            }
        };
        Ok(json!({
            "config": spec.to_json(),
            "state": state,
            "memory_actual_size": memory,
            "device_tree": {},
        }))
    }

    /// CH's counters per device (`_disk0`, `_net0`, …) and ferry's guest workload (`guest`).
    fn counters(&self) -> Result<Value, ApiError> {
        let c = self.live()?;
        let info = c.info();
        let mut out = serde_json::Map::new();
        let (mut disks, mut nets) = (0, 0);
        for d in &info.devices {
            let id = if d.kind == "virtio-blk" {
                disks += 1;
                format!("_disk{}", disks - 1)
            } else {
                nets += 1;
                format!("_net{}", nets - 1)
            };
            out.insert(id, json!(d.counters));
        }
        out.insert(
            "guest".into(),
            json!({
                "heartbeats": info.heartbeats,
                "heartbeat_seq": info.heartbeat_seq,
                "pages_touched": info.pages_touched,
                "passes": info.passes,
                "verify_errors": info.verify_errors,
                "blk_errors": info.blk_errors,
            }),
        );
        Ok(Value::Object(out))
    }

    /// `vm.shutdown`: the VM stops; its config stays (CH's `vm.info` then says Created).
    fn shutdown(&self) -> Result<Value, ApiError> {
        self.stop_vm()?;
        *self.port.locked() = None;
        self.events.emit("vm", "shutdown", &[]);
        Ok(Value::Null)
    }

    /// Stops the live VM, unless a migration holds it; returns its config.
    fn stop_vm(&self) -> Result<VmSpec, ApiError> {
        let c = self.live()?;
        if c.migrations.running() || c.lifecycle().holds_stop() {
            return Err(wrong_state(format!(
                "the VM is {}: cancel the migration first (vm.cancel-migration)",
                c.lifecycle().name()
            )));
        }
        let spec = self.live_spec()?;
        self.end_vm(Slot::Created(spec.clone()));
        Ok(spec)
    }

    /// Keeps the serial port of a VM that arrived (a reboot goes on with it).
    pub fn keep_port(&self, port: Port) {
        *self.port.locked() = Some(port);
    }

    pub fn live_spec(&self) -> Result<VmSpec, ApiError> {
        match &*self.slot() {
            Slot::Live(_, spec) => Ok(spec.clone()),
            _ => Err(wrong_state("VM is not booted")),
        }
    }

    /// `vm.reboot`: the VM stops and boots again from its payload. As CH's, it says only
    /// `rebooting` and `rebooted`: a `shutdown` between them reads as the guest gone (libvirt
    /// turns the domain off).
    fn reboot(&self) -> Result<Value, ApiError> {
        self.check_bootable(&self.live_spec()?)?;
        self.events.emit("vm", "rebooting", &[]);
        let spec = self.stop_vm()?;
        self.start_vm(spec)?;
        self.events.emit("vm", "rebooted", &[]);
        Ok(Value::Null)
    }

    /// The VMM's end, `vmm.shutdown` or `vm.delete`: as CH's, a running VM is shut down and
    /// its config deleted first, and each said (a VM that moved away is not running here).
    pub fn end_all(&self) {
        let (live, created) = match &*self.slot() {
            Slot::Live(c, _) => (c.phase() != Phase::Migrated, true),
            Slot::Created(_) => (false, true),
            _ => (false, false),
        };
        self.end_vm(Slot::Empty);
        *self.port.locked() = None;
        if live {
            self.events.emit("vm", "shutdown", &[]);
        }
        if created {
            self.events.emit("vm", "deleted", &[]);
        }
    }

    fn delete(&self) -> Result<Value, ApiError> {
        match &*self.slot() {
            Slot::Arriving(_) => return Err(wrong_state("the VM is still arriving")),
            Slot::Live(c, _) if c.migrations.running() || c.lifecycle().holds_stop() => {
                return Err(wrong_state("a migration is running: cancel it first"));
            }
            _ => {}
        }
        self.end_all();
        Ok(Value::Null)
    }

    pub fn handle(&self, request: ChRequest) -> Result<Value, ApiError> {
        match request {
            ChRequest::VmmPing => Ok(self.ping()),
            ChRequest::VmmShutdown => {
                self.end_all();
                self.exit(0);
                Ok(Value::Null)
            }
            ChRequest::Create(spec) => self.create(*spec),
            ChRequest::AddNet(net, named) => self.add_net(*net, named, Vec::new()),
            ChRequest::Boot => self.boot(),
            ChRequest::Info => self.info(),
            ChRequest::Counters => self.counters(),
            ChRequest::Pause => self.change(&*self.live()?, ApiRequest::Pause, "paus"),
            ChRequest::Resume => self.change(&*self.live()?, ApiRequest::Resume, "resum"),
            ChRequest::Shutdown => self.shutdown(),
            ChRequest::Reboot => self.reboot(),
            ChRequest::PowerButton => Err(ApiError::bad_request(
                "vm.power-button: ferry has no ACPI power button; use vm.shutdown",
            )),
            ChRequest::Delete => self.delete(),
            ChRequest::Snapshot(r) => self.snapshot(&r),
            ChRequest::Restore(r) => self.restore(&r, Vec::new()),
            ChRequest::SendMigration(r) => self.send_migration(&r),
            ChRequest::ReceiveMigration(r) => self.receive_migration(&r),
            ChRequest::MigrationProgress => self.progress(),
            ChRequest::CancelMigration => self.cancel_migration(),
        }
    }
}

impl Service for ChVmm {
    fn call(&self, method: &str, path: &str, body: &[u8]) -> Result<Value, ApiError> {
        self.handle(ChRequest::parse(method, path, body)?)
    }
    fn call_with_files(
        &self,
        method: &str,
        path: &str,
        body: &[u8],
        files: Vec<OwnedFd>,
    ) -> Result<Value, ApiError> {
        match ChRequest::parse(method, path, body)? {
            ChRequest::AddNet(net, named) => self.add_net(*net, named, files),
            ChRequest::Restore(r) => self.restore(&r, files),
            request => {
                api::server::no_files(path, &files)?;
                self.handle(request)
            }
        }
    }
    fn error_body(&self, e: &ApiError) -> String {
        api::ch::error_body(e)
    }
    fn reason_phrase(&self) -> bool {
        false
    }
}

impl Scraped for ChVmm {
    fn controller(&self) -> Option<Arc<Controller>> {
        self.controller().ok()
    }

    fn board(&self) -> Option<StatusBoard> {
        self.last_board.locked().clone()
    }
}

/// A VM's security in the profile. CH names TLS per request (`tls_dir`), and
/// `migration_tls` holds each request to it, so the controller's own rule (TCP needs the TLS
/// it was started with) must not refuse a VM booted, received or restored without TLS that
/// is then sent on with `tls_dir`.
pub fn per_request(tls: Option<Tls>) -> Security {
    Security {
        tls,
        plain_tcp: true,
    }
}
