//! The VM as the API sees it: its phase of life, `vm.info`, and request dispatch.

use migration::sync::Locked;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};

use api::{ApiError, ApiRequest, Handler, VcpuProgress, VmInfo};
use serde_json::Value;
use vmm::devices::heartbeat::now_ns;
use vmm::{Vm, VmState};

use crate::lifecycle::{self, Lifecycle, Phase};
use crate::migrations::{Migrations, Security, api_error};
use migration::error::chain;
use migration::source::Resumed;

/// How long a shutdown waits for the migration it cancelled to end.
const CANCEL_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

pub struct Controller {
    me: Weak<Controller>,
    vm: OnceLock<Arc<Vm>>,
    phase: Mutex<Phase>,
    shutdown: AtomicBool,
    /// Whether the test and benchmark hooks are served (`--enable-debug-api`).
    debug_api: AtomicBool,
    /// Where snapshots may be written (`--snapshot-dir`), canonical.
    pub snapshot_dir: OnceLock<std::path::PathBuf>,
    pub migrations: Migrations,
}

impl Controller {
    /// Runs the VM here again after a switch whose destination is gone (reclaim, rollback).
    /// A writable disk is shared storage the destination may have written since the switch:
    /// that needs the operator's `force` — unless the migration copied the disks, and the
    /// destination wrote only its own.
    fn take_back(&self, req: &api::TakeBackRequest) -> Result<Resumed, ApiError> {
        let vm = self
            .vm
            .get()
            .ok_or_else(|| ApiError::conflict("no VM here"))?;
        let copied = self.migrations.board.read().progress.storage.is_some();
        if !req.force
            && !copied
            && let Some(d) = vm.device_info().into_iter().find(|d| d.writable)
        {
            return Err(ApiError::conflict(format!(
                "the VM has a writable disk ({}) that the destination may have written since \
                 the switch: run from the switch, the guest would find writes it does not \
                 remember. Check the destination; {{\"force\": true}} (--force) takes it back \
                 anyway",
                d.describe
            )));
        }
        self.migrations
            .outgoing
            .reclaim(vm.as_ref())
            .map_err(api_error)
    }

    pub fn new(phase: Phase, security: Security) -> Arc<Self> {
        Arc::new_cyclic(|me| Self {
            me: me.clone(),
            vm: OnceLock::new(),
            phase: Mutex::new(phase),
            shutdown: AtomicBool::new(false),
            debug_api: AtomicBool::new(false),
            snapshot_dir: OnceLock::new(),
            migrations: Migrations::new(security),
        })
    }

    pub fn with_vm(vm: Arc<Vm>, security: Security) -> Arc<Self> {
        let c = Self::new(Phase::Live, security);
        c.set_vm(vm);
        c
    }

    /// This controller as an `Arc`, for work that outlives a request.
    pub fn self_ref(&self) -> Arc<Self> {
        self.me.upgrade().expect("a controller lives in an Arc")
    }

    pub fn set_vm(&self, vm: Arc<Vm>) {
        let _ = self.vm.set(vm);
    }

    pub fn vm(&self) -> Result<&Arc<Vm>, ApiError> {
        self.vm
            .get()
            .ok_or_else(|| ApiError::conflict("no VM yet: waiting for an incoming migration"))
    }

    pub fn enable_debug_api(&self) {
        self.debug_api.store(true, Ordering::Release);
    }

    /// The debug hooks: only when enabled, and never while a migration runs (dirty logging
    /// and guest memory belong to it then).
    fn require_debug(&self) -> Result<&Arc<Vm>, ApiError> {
        if !self.debug_api.load(Ordering::Acquire) {
            return Err(ApiError::new(
                403,
                "debug endpoints are off: start ferry run with --enable-debug-api",
            ));
        }
        self.require_idle()
    }

    pub fn shutdown_requested(&self) -> bool {
        self.shutdown.load(Ordering::Acquire)
    }

    pub fn set_phase(&self, phase: Phase) {
        *self.phase.locked() = phase;
    }

    pub fn phase(&self) -> Phase {
        self.phase.locked().clone()
    }

    pub fn info(&self) -> VmInfo {
        let phase = self.phase();
        let Some(vm) = self.vm.get() else {
            return VmInfo {
                state: "incoming".into(),
                ..Default::default()
            };
        };
        let i = vm.info();
        let state = self.lifecycle().word();
        let ms = |ns: u64| ns as f64 / 1e6;
        let last = i.total.last_heartbeat_ns;
        VmInfo {
            state: state.into(),
            memory_bytes: i.memory,
            vcpus: i.vcpus,
            heartbeats: i.heartbeats,
            last_heartbeat_age_ms: (last != 0).then(|| ms(now_ns().saturating_sub(last))),
            heartbeat_seq: i.total.seq,
            pages_touched: i.total.pages,
            passes: i.total.passes,
            verify_errors: i.verify_errors,
            verify_error_pages: i.verify_error_pages,
            working_set_base: i.total.ws_base,
            max_heartbeat_gap_ms: ms(i.max_heartbeat_gap_ns),
            migration_observed_downtime_ms: i.observed_downtime_ns.map(ms),
            per_vcpu: i
                .progress
                .iter()
                .enumerate()
                .map(|(cpu, p)| VcpuProgress {
                    cpu,
                    heartbeat_seq: p.seq,
                    pages: p.pages,
                    passes: p.passes,
                    guest_errors: p.errors,
                    share_base: p.share_base,
                    share_pages: p.share_pages,
                })
                .collect(),
            blk_writes: i.total.blk_writes,
            blk_reads: i.total.blk_reads,
            blk_errors: i.total.blk_errors,
            blk_error_sectors: i.blk_error_sectors,
            net_rx: i.total.net_rx,
            net_tx: i.total.net_tx,
            net_errors: i.total.net_errors,
            balloon: vm.balloon_info().map(crate::balloon::status),
            devices: vm
                .device_info()
                .into_iter()
                .map(|d| api::DeviceInfo {
                    slot: d.slot,
                    address: d.address,
                    kind: match d.kind {
                        1 => "virtio-net".into(),
                        2 => "virtio-blk".into(),
                        5 => "virtio-balloon".into(),
                        other => format!("virtio-{other}"),
                    },
                    attached_to: d.describe,
                    path: d.path.map(|p| p.display().to_string()),
                    counters: d
                        .counters
                        .into_iter()
                        .map(|(k, v)| (k.to_string(), v))
                        .collect(),
                    needs_reset: d.broken,
                })
                .collect(),
            error: match phase {
                Phase::Failed(e) => Some(e),
                _ => None,
            },
        }
    }

    /// Operations that change the VM need it live here (not gone, not going).
    pub fn require_live(&self) -> Result<&Arc<Vm>, ApiError> {
        match self.phase() {
            Phase::Live => self.vm(),
            Phase::Incoming => Err(ApiError::conflict("the VM has not arrived yet")),
            Phase::Migrated => Err(ApiError::conflict("the VM has migrated away")),
            Phase::ShuttingDown => Err(ApiError::conflict("the VM is shutting down")),
            Phase::Failed(e) => Err(ApiError::conflict(format!("the VM failed: {e}"))),
        }
    }

    /// Pause and resume belong to a running migration while it runs (it pauses for the
    /// switch; a resume then would run the guest while its state is being sent).
    fn require_idle(&self) -> Result<&Arc<Vm>, ApiError> {
        let vm = self.require_live()?;
        if self.migrations.running() {
            return Err(ApiError::conflict(
                "a migration is running: cancel it first (vm.cancel-migration)",
            ));
        }
        Ok(vm)
    }

    /// A migration still in its rounds is cancelled, and has ended, before the VM stops:
    /// shutting the VM down under it could let it hand a dying VM over. Refused once `Go` has
    /// left (the VM may run on the destination), or if the VM moved meanwhile.
    fn cancel_outgoing(&self) -> Result<(), ApiError> {
        let outgoing = &self.migrations.outgoing;
        if let Err(e) = outgoing.cancel()
            && outgoing.running()
        {
            return Err(api_error(e));
        }
        let phase = outgoing.wait_ended(CANCEL_WAIT);
        if self.migrations.board.read().moved_away() {
            return Err(ApiError::conflict(
                "the VM moved to the destination as the shutdown came: shut it down there",
            ));
        }
        if phase.is_running() {
            return Err(ApiError::conflict(format!(
                "the migration, cancelled, had not ended {} s later: ask again",
                CANCEL_WAIT.as_secs()
            )));
        }
        Ok(())
    }

    fn corrupt_page(&self, page: u64) -> Result<(), ApiError> {
        let vm = self.require_debug()?;
        let info = vm.info();
        let ws_pages: u64 = info.progress.iter().map(|p| p.share_pages).sum();
        if info.total.ws_base == 0 || page >= ws_pages {
            return Err(ApiError::bad_request(format!(
                "page {page} is not in the guest's working set ({ws_pages} pages)"
            )));
        }
        let t = &info.total;
        let gpa = if t.ws_base_high != 0 && page >= t.ws_split_page {
            t.ws_base_high + (page - t.ws_split_page) * 4096
        } else {
            t.ws_base + page * 4096
        };
        let mut byte = [0u8];
        let fail = |e: vmm::Error| ApiError::internal(format!("guest memory: {}", chain(&e)));
        vm.read_guest(gpa, &mut byte).map_err(fail)?;
        vm.write_guest(gpa, &[byte[0] ^ 0x5a]).map_err(fail)
    }
}

impl Controller {
    /// Where the VM is now, for the lifecycle rule every call goes through.
    pub fn lifecycle(&self) -> Lifecycle {
        let running = self
            .vm
            .get()
            .is_some_and(|vm| vm.state() == VmState::Running);
        let m = self.migrations.board.read();
        Lifecycle::of(self.phase(), running, &m)
    }
}

impl Handler for Controller {
    fn handle(&self, request: ApiRequest) -> Result<Value, ApiError> {
        let internal = |e: vmm::Error| ApiError::internal(chain(&e));
        let state = self.lifecycle();
        lifecycle::allow(&request, state)?;
        match request {
            ApiRequest::VmInfo => Ok(serde_json::to_value(self.info()).unwrap_or_default()),
            ApiRequest::Pause => {
                self.require_idle()?.pause().map_err(internal)?;
                Ok(Value::Null)
            }
            ApiRequest::Resume => {
                self.require_idle()?.resume().map_err(internal)?;
                Ok(Value::Null)
            }
            ApiRequest::Shutdown => {
                // A VM on its way here: its arrival ends and its source runs it on, unless it
                // was handed over first (then it runs here, and this late request is refused).
                if state == Lifecycle::Incoming {
                    self.migrations
                        .incoming
                        .stop_arrival("vm.shutdown")
                        .map_err(api_error)?;
                }
                if state == Lifecycle::Migrating {
                    self.cancel_outgoing()?;
                }
                self.set_phase(Phase::ShuttingDown);
                self.shutdown.store(true, Ordering::Release);
                Ok(Value::Null)
            }
            ApiRequest::CorruptPage(req) => {
                self.corrupt_page(req.page)?;
                Ok(Value::Null)
            }
            ApiRequest::DirtyLogging(req) => {
                let vm = self.require_debug()?;
                crate::dirty_bench::set(vm, req.enabled, req.harvest_ms.unwrap_or(100))
                    .map_err(ApiError::internal)?;
                Ok(Value::Null)
            }
            ApiRequest::SendMigration(req) => self.send_migration(&req),
            ApiRequest::MigrationStatus => Ok(self.migrations.status_json()),
            // A destination's cancel ends its wait for a resuming source.
            ApiRequest::CancelMigration if state == Lifecycle::PostcopyPausedDestination => {
                if !self.migrations.incoming.cancel_resume() {
                    return Err(ApiError::conflict(
                        "no resume is waiting for its source (vm.migrate-resume {\"listen\"})",
                    ));
                }
                Ok(Value::Null)
            }
            ApiRequest::CancelMigration => {
                self.migrations.outgoing.cancel().map_err(api_error)?;
                Ok(Value::Null)
            }
            ApiRequest::StartPostcopy => {
                self.migrations
                    .outgoing
                    .start_postcopy()
                    .map_err(api_error)?;
                Ok(Value::Null)
            }
            ApiRequest::MigrateReclaim(req) => {
                let from = self.take_back(&req)?;
                tracing::warn!("the operator took the VM back after the switch: {from:?}");
                Ok(resumed_from(from))
            }
            ApiRequest::MigrateRollback(req) => {
                let from = self.take_back(&req)?;
                tracing::warn!("the operator rolled the VM back after post-copy broke: {from:?}");
                Ok(resumed_from(from))
            }
            ApiRequest::MigrateResume(req) => self.migrate_resume(&req),
            ApiRequest::Snapshot(req) => self.snapshot(&req),
            ApiRequest::Balloon(req) => {
                crate::balloon::set_target(self.vm()?, &req)?;
                Ok(Value::Null)
            }
        }
    }
}

/// Where a VM taken back runs from, as `vm.migrate-reclaim` and `vm.migrate-rollback` answer.
fn resumed_from(from: Resumed) -> Value {
    match from {
        Resumed::Checkpoint(seq) => {
            serde_json::json!({"resumed_from": "checkpoint", "checkpoint": seq})
        }
        Resumed::Switch => serde_json::json!({"resumed_from": "switch"}),
    }
}
