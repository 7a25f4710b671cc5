//! Cloud Hypervisor's migration calls on ferry's engine: `vm.send-migration` and
//! `vm.receive-migration` (TLS from `tls_dir`), `vm.snapshot`/`vm.restore` through a
//! `file://DIR`, and ferry's additions, progress in libvirt's job-statistics terms and
//! cancel. The engine, its parameters and its checks are the controller's own.

use migration::sync::Locked;
use std::os::fd::OwnedFd;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use api::ch::{
    CH_TIMEOUT_S, ConsoleMode, JobStats, ReceiveMigrationData, RestoreConfig, SendMigrationData,
    VmSnapshotConfig, VmSpec, file_url, memory_mode,
};
use api::{ApiError, ApiRequest, Handler, MigrationPhase, MigrationRequest, SnapshotRequest};
use migration::Endpoint;
use migration::VmDescriptor;
use migration::destination::Source;
use migration::io::tls::{Tls, TlsFiles};
use serde_json::Value;
use sockets::passed::PassedFd;
use vmm::devices::virtio::tap::Tap;
use vmm::{Vm, VmConfig};

use super::allow::Allowed;
use super::console::Port;
use super::machine;
use super::vmm::{ChVmm, Slot, as_ch, not_created, per_request, wrong_state};
use crate::controller::Controller;
use crate::lifecycle::Phase;
use crate::migrations::{Security, api_error, to_api};

/// The file ferry writes in a snapshot's directory.
const SNAPSHOT_FILE: &str = "ferry.snapshot";
/// The VM's config beside its snapshot, as CH keeps `config.json` in its snapshot directory.
const CONFIG_FILE: &str = "config.json";

/// Writes `spec` as `DIR/config.json` (whole or not at all).
fn write_config(dir: &std::path::Path, spec: &VmSpec) -> Result<(), ApiError> {
    let text = serde_json::to_string_pretty(&spec.to_json()).unwrap_or_default();
    let (path, part) = (dir.join(CONFIG_FILE), dir.join(".config.json.part"));
    std::fs::write(&part, text)
        .and_then(|()| std::fs::rename(&part, &path))
        .map_err(|e| ApiError::internal(format!("{}: {e}", path.display())))
}

/// `DIR/config.json`, where a snapshot has one (ferry's before it did not).
fn read_config(dir: &std::path::Path) -> Result<Option<VmSpec>, ApiError> {
    let path = dir.join(CONFIG_FILE);
    let text = match std::fs::read_to_string(&path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(ApiError::bad_request(format!("{}: {e}", path.display()))),
    };
    let value: Value = serde_json::from_str(&text)
        .map_err(|e| ApiError::bad_request(format!("{}: {e}", path.display())))?;
    VmSpec::from_json(&value)
        .map(Some)
        .map_err(|e| ApiError::bad_request(format!("{}: {}", path.display(), e.message)))
}

/// A tap file a restore passed for one of the VM's NICs.
pub struct RestoredTap {
    name: String,
    file: PassedFd,
}

/// The taps `req.net_fds` names, matched to the files passed with it (one each, in order) and
/// to the VM's NICs by id (the config's, or `_netN`): by slot among the NICs.
fn restored_taps(
    req: &RestoreConfig,
    files: Vec<OwnedFd>,
    config: Option<&VmSpec>,
) -> Result<Vec<(usize, RestoredTap)>, ApiError> {
    let named = req.net_fds.as_deref().unwrap_or_default();
    if named.len() != files.len() {
        return Err(ApiError::bad_request(format!(
            "net_fds names {} tap files; the request passed {}",
            named.len(),
            files.len()
        )));
    }
    named
        .iter()
        .zip(files)
        .map(|(net, fd)| {
            let slot = match config {
                Some(spec) => spec
                    .nets
                    .iter()
                    .enumerate()
                    .position(|(i, n)| n.name(i) == net.id),
                None => net.id.strip_prefix("_net").and_then(|n| n.parse().ok()),
            }
            .ok_or_else(|| {
                ApiError::bad_request(format!("net_fds: the VM has no NIC {}", net.id))
            })?;
            let file = std::fs::File::from(fd);
            let name = Tap::name_of(&file).map_err(|e| {
                ApiError::bad_request(format!(
                    "net_fds {}: the file passed is not a tap: {e}",
                    net.id
                ))
            })?;
            let file = PassedFd::new(file.into());
            Ok((slot, RestoredTap { name, file }))
        })
        .collect()
}

/// The config a VM brought from its source (`Config`), made to say what was built here: its
/// disks on the files admitted, its NICs on the taps attached. Refused, naming why, when it
/// is not one this VMM reads, names other devices than the VM's, or has this host write or
/// listen on a file outside the allowed directories.
fn carried_spec(
    descriptor: &VmDescriptor,
    built: &VmConfig,
    allowed: &Allowed,
) -> migration::Result<Option<VmSpec>> {
    let Some(text) = &descriptor.config else {
        return Ok(None);
    };
    let bad = |why: String| migration::Error::Protocol(format!("the VM's config: {why}"));
    let value: Value = serde_json::from_str(text).map_err(|e| bad(e.to_string()))?;
    let mut spec = VmSpec::from_json(&value).map_err(|e| bad(e.message))?;
    if (spec.disks.len(), spec.nets.len()) != (built.disks.len(), built.nets.len()) {
        return Err(bad(format!(
            "it names {} disks and {} NICs, the VM has {} and {}",
            spec.disks.len(),
            spec.nets.len(),
            built.disks.len(),
            built.nets.len()
        )));
    }
    for (disk, here) in spec.disks.iter_mut().zip(&built.disks) {
        disk.path = here.path.display().to_string();
    }
    for (nic, here) in spec.nets.iter_mut().zip(&built.nets) {
        nic.tap = here.tap.clone();
        nic.file = here.file.clone();
    }
    allowed.admit_ports(&spec)?;
    Ok(Some(spec))
}

/// A restored VM's config must describe the VM the snapshot held.
fn check_restored(spec: VmSpec, vm: &Vm) -> Result<VmSpec, ApiError> {
    let c = vm.config();
    if (spec.memory_bytes, spec.vcpus) != (c.memory, c.vcpus) {
        return Err(ApiError::bad_request(format!(
            "{CONFIG_FILE} describes {} bytes and {} vCPUs, the snapshot {} and {}",
            spec.memory_bytes, spec.vcpus, c.memory, c.vcpus
        )));
    }
    Ok(spec)
}
const PAGE: u64 = 4096;

/// TLS from CH's `tls_dir`: `ca-cert.pem` and this side's `{client,server}-{cert,key}.pem`.
fn tls(dir: &str, side: &str) -> Result<Tls, ApiError> {
    let dir = Path::new(dir);
    Tls::load(&TlsFiles {
        cert: dir.join(format!("{side}-cert.pem")),
        key: dir.join(format!("{side}-key.pem")),
        ca: dir.join("ca-cert.pem"),
    })
    .map_err(|e| ApiError::bad_request(format!("tls_dir {}: {e}", dir.display())))
}

impl ChVmm {
    /// The TLS a migration to or from `endpoint` uses: `tls_dir` only with TCP, and TCP only
    /// with `tls_dir`, or in clear as CH does unless ferry was started with `--require-tls`.
    fn migration_tls(
        &self,
        endpoint: &Endpoint,
        tls_dir: Option<&str>,
        side: &str,
    ) -> Result<Option<Tls>, ApiError> {
        let tcp = matches!(endpoint, Endpoint::Tcp(_));
        match tls_dir {
            Some(_) if !tcp => Err(ApiError::bad_request(format!(
                "tls_dir is for tcp: URLs, not {endpoint}"
            ))),
            Some(dir) => tls(dir, side).map(Some),
            None if tcp && !self.plain_tcp => Err(ApiError::bad_request(format!(
                "{endpoint}: this VMM was started with --require-tls: give tls_dir"
            ))),
            None => Ok(None),
        }
    }

    pub fn send_migration(&self, req: &SendMigrationData) -> Result<Value, ApiError> {
        let c = self.live()?;
        if c.migrations.running() {
            return Err(wrong_state("There is already an ongoing migration"));
        }
        let endpoint: Endpoint = req.destination_url.parse().map_err(api_error)?;
        let tls = self.migration_tls(&endpoint, req.tls_dir.as_deref(), "client")?;
        let postcopy = memory_mode(req.memory_mode.as_deref())?;
        let mode = match (req.local.unwrap_or(false), postcopy) {
            (true, true) => {
                return Err(ApiError::bad_request(
                    "local with memory_mode Postcopy: a local live update copies no memory",
                ));
            }
            (true, false) => Some("local".into()),
            (false, true) => Some("postcopy".into()),
            (false, false) => None,
        };
        let request = MigrationRequest {
            destination: req.destination_url.clone(),
            mode,
            max_downtime_ms: Some(req.downtime_ms.unwrap_or(300)),
            timeout_s: Some(req.timeout_s.unwrap_or(CH_TIMEOUT_S)),
            connections: req.connections,
            copy_storage: req.copy_storage,
            ..Default::default()
        };
        c.migrations.outgoing.set_tls(tls);
        self.carry_config(&c)?;
        *self.began() = Some(Instant::now());
        self.events.emit("vm", "migration-started", &[]);
        if let Err(e) = c.send_migration(&request) {
            self.events
                .emit("vm", "migration-failed", &[("error", e.message.clone())]);
            return Err(as_ch(e));
        }
        // It ends with the migration.
        *self.progress.locked() = self.watch_migration(c, Arc::new(AtomicBool::new(false)));
        Ok(Value::Null)
    }

    /// The VM's config as it is now, for its migration to carry (`Config`).
    fn carry_config(&self, c: &Controller) -> Result<(), ApiError> {
        let spec = self.live_spec()?;
        c.vm()?
            .keep_profile_config(Some(spec.to_json().to_string()));
        Ok(())
    }

    fn began(&self) -> std::sync::MutexGuard<'_, Option<Instant>> {
        self.migration_began.locked()
    }

    pub fn receive_migration(&self, req: &ReceiveMigrationData) -> Result<Value, ApiError> {
        let endpoint: Endpoint = req.receiver_url.parse().map_err(api_error)?;
        let tls = self.migration_tls(&endpoint, req.tls_dir.as_deref(), "server")?;
        let source = Source::listen(&endpoint, tls.as_ref()).map_err(api_error)?;
        self.events.emit("vm", "migration-receive-ready", &[]);
        let outcome = self.arrive(
            source,
            per_request(tls),
            Some(&self.allowed),
            None,
            Vec::new(),
        );
        let event = if outcome.is_ok() {
            "migration-receive-finished"
        } else {
            "migration-receive-failed"
        };
        self.events.emit("vm", event, &[]);
        outcome.map(|_| Value::Null)
    }

    /// Takes a VM from `source` into this empty VMM; it runs here once this returns `Ok`.
    /// `allowed`: what a VM from a peer may open here (None: a snapshot the operator named,
    /// whose restore says its own events).
    /// `config`: the VM's config from the operator (a snapshot's `config.json`): its serial
    /// port goes where that config says, and `vm.info` and a reboot have its payload. A VM from
    /// a peer brings its own (`Config`), admitted by `allowed`.
    /// `taps`: NICs (by slot among the NICs) to build on a tap file passed with a restore.
    fn arrive(
        &self,
        source: Source,
        security: Security,
        allowed: Option<&Allowed>,
        config: Option<VmSpec>,
        taps: Vec<(usize, RestoredTap)>,
    ) -> Result<Arc<Controller>, ApiError> {
        let controller = Controller::new(Phase::Incoming, security);
        {
            let mut slot = self.slot();
            if !matches!(*slot, Slot::Empty) {
                return Err(wrong_state("a VM is already here (vm.delete it first)"));
            }
            *slot = Slot::Arriving(controller.clone());
        }
        self.scrape_from(&controller);
        *self.began() = Some(Instant::now());
        let done = Arc::new(AtomicBool::new(false));
        let watcher = self.watch_migration(controller.clone(), done.clone());
        let mut landed = None;
        let received = controller.migrations.incoming.receive(
            source,
            &crate::run::terminate_requested,
            |descriptor, files| {
                // A source connected (CH says so as it accepts it) and named the VM.
                if allowed.is_some() {
                    self.events.emit("vm", "migration-receive-started", &[]);
                    self.events.emit("vm", "restoring", &[]);
                }
                let mut vm_config = VmConfig::from_descriptor(descriptor)?;
                for (slot, tap) in &taps {
                    let nic = vm_config.nets.get_mut(*slot).ok_or_else(|| {
                        migration::Error::vm(format!("net_fds names NIC {slot}; the VM has fewer"))
                    })?;
                    nic.tap = tap.name.clone();
                    nic.file = Some(tap.file.clone());
                }
                let carried = match allowed {
                    Some(allowed) => {
                        allowed.admit(&mut vm_config, files.as_ref())?;
                        carried_spec(descriptor, &vm_config, allowed)?
                    }
                    None => None,
                };
                let (port, carried) = self.arrival_port(config.as_ref(), carried)?;
                let vm = Vm::arriving(vm_config, port.writer(), files)
                    .map(Arc::new)
                    .map_err(|e| migration::Error::vm_caused("cannot build the VM", e))?;
                landed = Some((port, carried));
                Ok(vm)
            },
            |vm| {
                controller.set_vm(vm.clone());
                controller.set_phase(Phase::Live);
                // A migration's VM runs here now: said as CH's destination says it.
                if allowed.is_some() {
                    for event in ["restored", "resuming", "resumed"] {
                        self.events.emit("vm", event, &[]);
                    }
                }
            },
        );
        done.store(true, Ordering::Release);
        // Gone before the answer: a client may list the threads right after it (libvirt).
        if let Some(watcher) = watcher {
            let _ = watcher.join();
        }
        match (received, landed) {
            (Ok(Some(vm)), Some((port, carried))) => {
                let from_peer = carried.is_some();
                let mut spec = match (config, carried, &self.arrival_serial) {
                    (Some(spec), ..) => check_restored(spec, &vm)?,
                    (None, Some(mut spec), Some(mode)) => {
                        spec.serial = mode.clone();
                        spec.console = ConsoleMode::Off;
                        check_restored(spec, &vm)?
                    }
                    (None, Some(spec), None) => check_restored(spec, &vm)?,
                    (None, None, mode) => {
                        machine::spec_of(&vm, mode.as_ref().unwrap_or(&ConsoleMode::Off))
                    }
                };
                if let Some(pty) = &port.pty {
                    spec.set_pty(pty);
                }
                self.peer_config.store(from_peer, Ordering::Release);
                self.keep_port(port);
                self.go_live(controller.clone(), spec);
                Ok(controller)
            }
            (Ok(_), _) => {
                *self.slot() = Slot::Empty;
                Err(wrong_state("stopped while waiting for the VM"))
            }
            (Err(e), _) => {
                *self.slot() = Slot::Empty;
                Err(ApiError::internal(format!(
                    "the VM could not be received: {}",
                    e.report()
                )))
            }
        }
    }

    /// The serial port of an arriving VM: where the operator's `config` says (a restore),
    /// else where this VMM's `--serial` says, else where the config the VM `carried` says
    /// (when that cannot be opened here, e.g. a socket its old process on this host still
    /// serves during a live update, nowhere, and its config says so), else nowhere.
    fn arrival_port(
        &self,
        config: Option<&VmSpec>,
        carried: Option<VmSpec>,
    ) -> migration::Result<(Port, Option<VmSpec>)> {
        let ports = match (config, &self.arrival_serial, &carried) {
            (Some(spec), ..) => spec.serial_ports(),
            (None, Some(mode), _) => vec![mode],
            (None, None, Some(spec)) => spec.serial_ports(),
            (None, None, None) => Vec::new(),
        };
        let failed = |e: ApiError| migration::Error::Setup(format!("serial port: {}", e.message));
        match (Port::open(&ports), carried) {
            (Ok(port), carried) => Ok((port, carried)),
            (Err(e), Some(mut spec)) if config.is_none() && self.arrival_serial.is_none() => {
                tracing::warn!(
                    "the arriving VM's serial port goes nowhere here: {}",
                    e.message
                );
                spec.serial = ConsoleMode::Off;
                spec.console = ConsoleMode::Off;
                Ok((Port::open(&[]).map_err(failed)?, Some(spec)))
            }
            (Err(e), _) => Err(failed(e)),
        }
    }

    /// `vm.snapshot {"destination_url": "file://DIR"}`: the paused VM to `DIR/ferry.snapshot`.
    pub fn snapshot(&self, req: &VmSnapshotConfig) -> Result<Value, ApiError> {
        let dir = file_url("destination_url", &req.destination_url)?;
        let c = self.live()?;
        if c.vm()?.state() == vmm::VmState::Running {
            return Err(wrong_state(
                "the VM must be paused to be snapshotted (vm.pause)",
            ));
        }
        if !dir.is_dir() {
            return Err(ApiError::bad_request(format!(
                "{} is not a directory",
                dir.display()
            )));
        }
        let path = dir.join(SNAPSHOT_FILE);
        self.carry_config(&c)?;
        self.events.emit("vm", "snapshotting", &[]);
        let file = path.display().to_string();
        c.snapshot_into(
            &path,
            &SnapshotRequest {
                file,
                compression: None,
                migration_threads: None,
                writers: None,
            },
        )
        .map_err(as_ch)?;
        write_config(&dir, &self.live_spec()?)?;
        self.events.emit("vm", "snapshotted", &[]);
        Ok(Value::Null)
    }

    /// `vm.restore {"source_url": "file://DIR"}`: the VM of `DIR/ferry.snapshot`, paused
    /// unless `resume`.
    /// `files`: the NICs' new taps `net_fds` names, in order.
    pub fn restore(&self, req: &RestoreConfig, files: Vec<OwnedFd>) -> Result<Value, ApiError> {
        let dir = file_url("source_url", &req.source_url)?;
        let source = Source::snapshot(&dir.join(SNAPSHOT_FILE))
            .map_err(|e| ApiError::bad_request(e.report()))?;
        let mut config = read_config(&dir)?;
        let taps = restored_taps(req, files, config.as_ref())?;
        if let Some(spec) = &mut config {
            for (slot, tap) in &taps {
                // A reboot goes on with the same tap file.
                spec.nets[*slot].tap = tap.name.clone();
                spec.nets[*slot].file = Some(tap.file.clone());
            }
        }
        self.events.emit("vm", "restoring", &[]);
        let c = self.arrive(source, per_request(None), None, config, taps)?;
        let vm = c.vm()?;
        match (req.resume, vm.state() == vmm::VmState::Running) {
            (false, true) => c.handle(ApiRequest::Pause).map_err(as_ch)?,
            (true, false) => c.handle(ApiRequest::Resume).map_err(as_ch)?,
            _ => Value::Null,
        };
        self.events.emit("vm", "restored", &[]);
        Ok(Value::Null)
    }

    pub fn progress(&self) -> Result<Value, ApiError> {
        let c = self.controller()?;
        let status = to_api(&c.migrations.board.read());
        let began = *self.began();
        Ok(serde_json::to_value(job_stats(&status, began)).unwrap_or_default())
    }

    pub fn cancel_migration(&self) -> Result<Value, ApiError> {
        match &*self.slot() {
            Slot::Arriving(c) => c
                .migrations
                .incoming
                .stop_arrival("vm.cancel-migration")
                .map_err(|e| as_ch(api_error(e)))
                .map(|_| Value::Null),
            Slot::Live(c, _) => c.handle(ApiRequest::CancelMigration).map_err(as_ch),
            _ => Err(not_created()),
        }
    }

    /// Says the migration's progress on the event stream as its phase or round changes, and
    /// its end; stops at its end or when `done` (an arrival that ended).
    fn watch_migration(
        &self,
        c: Arc<Controller>,
        done: Arc<AtomicBool>,
    ) -> Option<std::thread::JoinHandle<()>> {
        let this = self.me();
        std::thread::Builder::new()
            .name("ch-progress".into())
            .spawn(move || {
                let mut last = (MigrationPhase::None, u32::MAX);
                let mut said = Said::default();
                loop {
                    let s = to_api(&c.migrations.board.read());
                    if (s.phase, s.round) != last && s.phase != MigrationPhase::None {
                        last = (s.phase, s.round);
                        this.events
                            .emit("migration", "progress", &progress_properties(&s));
                    }
                    said.catch_up(&this.events, &s);
                    if !s.phase.is_running() && s.phase != MigrationPhase::None
                        || done.load(Ordering::Acquire)
                    {
                        this.said_end(&s);
                        return;
                    }
                    std::thread::sleep(Duration::from_millis(50));
                }
            })
            .ok()
    }

    fn said_end(&self, s: &api::MigrationStatus) {
        if s.role != "source" {
            return;
        }
        let error = s.error.clone().unwrap_or_default();
        match s.phase {
            MigrationPhase::Completed => {
                if s.postcopy {
                    self.events.emit("vm", "postcopy-migration-completed", &[]);
                }
                self.events.emit("vm", "migration-finished", &[])
            }
            _ => self
                .events
                .emit("vm", "migration-failed", &[("error", error)]),
        }
    }
}

/// What a source's event stream has said of its migration, as CH's says it: each pre-copy
/// round as it completes (`migration-memory-iteration`, its number as `id`), then the pause
/// at the switch (`pausing`, `paused`) and the devices' state taken (`snapshotting`,
/// `snapshotted`). The status is read every 50 ms, so rounds shorter than that are said
/// together, in order.
#[derive(Default)]
struct Said {
    rounds: u32,
    paused: bool,
}

impl Said {
    fn catch_up(&mut self, events: &super::events::Events, s: &api::MigrationStatus) {
        if s.role != "source" {
            return;
        }
        let switched = matches!(
            s.phase,
            MigrationPhase::Switchover
                | MigrationPhase::PostcopyActive
                | MigrationPhase::Completed
                | MigrationPhase::Unconfirmed
                | MigrationPhase::PostcopyPaused
        );
        let completed = if switched {
            s.rounds.len() as u32
        } else {
            s.round
        };
        for id in self.rounds..completed {
            events.emit(
                "vm",
                "migration-memory-iteration",
                &[("id", id.to_string())],
            );
        }
        self.rounds = self.rounds.max(completed);
        if switched && !self.paused {
            self.paused = true;
            events.emit("vm", "pausing", &[]);
            events.emit("vm", "paused", &[]);
            // CH's source takes the devices' state as a snapshot for the last send.
            events.emit("vm", "snapshotting", &[]);
            events.emit("vm", "snapshotted", &[]);
        }
    }
}

fn progress_properties(s: &api::MigrationStatus) -> Vec<(&'static str, String)> {
    let phase = serde_json::to_value(s.phase)
        .ok()
        .and_then(|v| v.as_str().map(String::from));
    vec![
        ("role", s.role.clone()),
        ("phase", phase.unwrap_or_default()),
        ("round", s.round.to_string()),
        ("pages_remaining", s.pages_remaining.to_string()),
        ("dirty_pages_per_s", format!("{:.0}", s.dirty_pages_per_s)),
        ("throughput_mbps", format!("{:.1}", s.throughput_mbps)),
        (
            "expected_downtime_ms",
            s.expected_downtime_ms
                .map_or("unknown".into(), |ms| format!("{ms:.1}")),
        ),
        (
            "postcopy_faults",
            s.postcopy_report
                .as_ref()
                .map_or(0, |p| p.network_faults)
                .to_string(),
        ),
    ]
}

/// The status in libvirt's job-statistics names and units (docs/orchestrators.md).
pub fn job_stats(s: &api::MigrationStatus, began: Option<Instant>) -> JobStats {
    use MigrationPhase as P;
    let job = match s.phase {
        P::None => "none",
        P::Setup | P::Active | P::Switchover | P::PostcopyActive => "unbounded",
        P::Completed => "completed",
        P::Cancelled => "cancelled",
        P::Failed | P::Unconfirmed | P::PostcopyPaused => "failed",
    };
    let elapsed = match (s.phase.is_running(), began) {
        (true, Some(at)) => at.elapsed().as_millis() as u64,
        _ => s.total_ms as u64,
    };
    let phase = serde_json::to_value(s.phase)
        .ok()
        .and_then(|v| v.as_str().map(String::from));
    JobStats {
        job: job.into(),
        phase: phase.unwrap_or_default(),
        role: s.role.clone(),
        time_elapsed: elapsed,
        setup_time: s.setup_ms as u64,
        downtime: s
            .downtime_ms
            .or(s.destination_downtime_ms)
            .map(|d| d as u64),
        memory_total: s.memory_pages * PAGE,
        memory_processed: s.bytes_on_wire,
        memory_remaining: s.pages_remaining * PAGE,
        memory_dirty_rate: s.dirty_pages_per_s as u64,
        memory_iteration: u64::from(s.round),
        memory_page_size: PAGE,
        memory_normal: s.pages_full,
        memory_normal_bytes: s.pages_full * PAGE,
        memory_constant: s.pages_zero,
        memory_bps: (s.throughput_mbps * 1e6 / 8.0) as u64,
        memory_postcopy_requests: s.pages_requested,
        disk_total: 0,
        disk_processed: 0,
        disk_remaining: 0,
        error: s.error.clone(),
    }
}
