//! The VM as the API sees it: maps requests to VM operations and builds `vm.info`.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use api::{ApiError, ApiRequest, Handler, VcpuProgress, VmInfo};
use serde_json::Value;
use vm_memory_bytes::write_guest_byte;
use vmm::devices::heartbeat::now_ns;
use vmm::{Vm, VmState};

/// Where the VM is in its life, beyond running/paused.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Phase {
    Live,
    ShuttingDown,
    Failed(String),
}

pub struct Controller {
    pub vm: Arc<Vm>,
    phase: Mutex<Phase>,
    shutdown: AtomicBool,
}

impl Controller {
    pub fn new(vm: Arc<Vm>) -> Self {
        Self {
            vm,
            phase: Mutex::new(Phase::Live),
            shutdown: AtomicBool::new(false),
        }
    }

    pub fn shutdown_requested(&self) -> bool {
        self.shutdown.load(Ordering::Acquire)
    }

    pub fn set_phase(&self, phase: Phase) {
        *self.phase.lock().unwrap_or_else(|e| e.into_inner()) = phase;
    }

    fn phase(&self) -> Phase {
        self.phase.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    pub fn info(&self) -> VmInfo {
        let i = self.vm.info();
        let (state, error) = match self.phase() {
            Phase::Live => (
                match i.state {
                    VmState::Running => "running",
                    VmState::Paused => "paused",
                },
                None,
            ),
            Phase::ShuttingDown => ("shutting-down", None),
            Phase::Failed(e) => ("failed", Some(e)),
        };
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
            error,
        }
    }

    fn require_live(&self) -> Result<(), ApiError> {
        match self.phase() {
            Phase::Live => Ok(()),
            other => Err(ApiError::conflict(format!(
                "the VM is {}",
                match other {
                    Phase::ShuttingDown => "shutting down".to_string(),
                    Phase::Failed(e) => format!("failed: {e}"),
                    Phase::Live => unreachable!(),
                }
            ))),
        }
    }

    fn corrupt_page(&self, page: u64) -> Result<(), ApiError> {
        let info = self.vm.info();
        let ws_pages: u64 = info.progress.iter().map(|p| p.share_pages).sum();
        if info.total.ws_base == 0 || page >= ws_pages {
            return Err(ApiError::bad_request(format!(
                "page {page} is not in the guest's working set ({ws_pages} pages)"
            )));
        }
        let gpa = info.total.ws_base + page * 4096;
        write_guest_byte(self.vm.memory(), gpa, |b| b ^ 0x5a)
            .map_err(|e| ApiError::internal(format!("cannot write guest memory: {e}")))
    }
}

impl Handler for Controller {
    fn handle(&self, request: ApiRequest) -> Result<Value, ApiError> {
        let internal = |e: vmm::Error| ApiError::internal(e.to_string());
        match request {
            ApiRequest::VmInfo => Ok(serde_json::to_value(self.info()).unwrap_or_default()),
            ApiRequest::Pause => {
                self.require_live()?;
                self.vm.pause().map_err(internal)?;
                Ok(Value::Null)
            }
            ApiRequest::Resume => {
                self.require_live()?;
                self.vm.resume();
                Ok(Value::Null)
            }
            ApiRequest::Shutdown => {
                self.set_phase(Phase::ShuttingDown);
                self.shutdown.store(true, Ordering::Release);
                Ok(Value::Null)
            }
            ApiRequest::CorruptPage(req) => {
                self.require_live()?;
                self.corrupt_page(req.page)?;
                Ok(Value::Null)
            }
        }
    }
}

mod vm_memory_bytes {
    use vm_memory::{Bytes, GuestAddress};

    /// Read-modify-write of one guest byte, as a device emulation would do it.
    pub fn write_guest_byte(
        memory: &vmm::memory::GuestMemory,
        gpa: u64,
        f: impl FnOnce(u8) -> u8,
    ) -> Result<(), vm_memory::GuestMemoryError> {
        let b: u8 = memory.read_obj(GuestAddress(gpa))?;
        memory.write_obj(f(b), GuestAddress(gpa))
    }
}
