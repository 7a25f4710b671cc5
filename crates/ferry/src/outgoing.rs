//! Migrations and snapshots started through the API: one at a time, in the background, with
//! a status anyone can read and a cancel anyone can press.

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use api::{ApiError, MigrateResumeRequest, MigrationRequest, SnapshotRequest};
use migration::postcopy::{Destination, resume_destination};
use migration::prepaging::Strategy;
use migration::stats::lock;
use migration::{Endpoint, MigrationParams, MigrationPhase, SharedStatus, Signals};
use serde_json::Value;

use crate::controller::{Controller, Phase};

#[derive(Default)]
pub struct Outgoing {
    pub status: SharedStatus,
    signals: Arc<Signals>,
    /// The parameters of the last migration (a post-copy resume reuses them).
    last_params: Mutex<Option<MigrationParams>>,
    /// Destination side: a post-copy whose connection broke after the switch.
    pub interrupted: Mutex<Option<Arc<Destination>>>,
    busy: Mutex<bool>,
    /// Set once a client has read a final status, so the source may exit.
    pub final_status_read: AtomicBool,
}

/// How long `vm.send-migration` waits to learn whether the destination answered.
const SETUP_WAIT: Duration = Duration::from_secs(15);

impl Outgoing {
    pub fn running(&self) -> bool {
        *self.busy.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Claims the slot for a post-copy resume (its leftover pages stay).
    fn claim_keeping_leftover(&self) -> Result<(), ApiError> {
        let mut busy = self.busy.lock().unwrap_or_else(|e| e.into_inner());
        if *busy {
            return Err(ApiError::conflict("a migration is already running"));
        }
        *busy = true;
        self.final_status_read.store(false, Ordering::Release);
        Ok(())
    }

    /// Claims the single migration slot.
    fn claim(&self) -> Result<(), ApiError> {
        let mut busy = self.busy.lock().unwrap_or_else(|e| e.into_inner());
        if *busy {
            return Err(ApiError::conflict("a migration is already running"));
        }
        *busy = true;
        self.signals.cancel.store(false, Ordering::Release);
        self.signals.start_postcopy.store(false, Ordering::Release);
        self.final_status_read.store(false, Ordering::Release);
        Ok(())
    }

    fn release(&self) {
        *self.busy.lock().unwrap_or_else(|e| e.into_inner()) = false;
    }

    pub fn status_json(&self) -> Value {
        let s = lock(&self.status).clone();
        if !s.phase.is_running() && s.phase != MigrationPhase::None {
            self.final_status_read.store(true, Ordering::Release);
        }
        serde_json::to_value(s).unwrap_or_default()
    }

    pub fn cancel(&self) -> Result<Value, ApiError> {
        if !self.running() {
            return Err(ApiError::conflict("no migration is running"));
        }
        self.signals.cancel.store(true, Ordering::Release);
        Ok(Value::Null)
    }

    /// Like QEMU's migrate-start-postcopy: the running pre-copy hands over by post-copy at
    /// its next round.
    pub fn start_postcopy(&self) -> Result<Value, ApiError> {
        if !self.running() {
            return Err(ApiError::conflict("no migration is running"));
        }
        let s = lock(&self.status).clone();
        if s.destination_supports_postcopy == Some(false) {
            return Err(ApiError::conflict(
                "the destination does not support post-copy (no userfaultfd there)",
            ));
        }
        if s.phase == MigrationPhase::Switchover || s.postcopy {
            return Err(ApiError::conflict(
                "the migration is already switching over",
            ));
        }
        self.signals.start_postcopy.store(true, Ordering::Release);
        Ok(Value::Null)
    }
}

/// Turns the API body into engine parameters, naming any bad field.
pub fn params_from_request(
    req: &MigrationRequest,
) -> Result<(Endpoint, MigrationParams), ApiError> {
    let bad = |e: migration::Error| ApiError::bad_request(e.to_string());
    let endpoint: Endpoint = req.destination.parse().map_err(bad)?;
    let positive = |name: &str, v: Option<i64>| -> Result<Option<u64>, ApiError> {
        match v {
            Some(n) if n <= 0 => Err(ApiError::bad_request(format!(
                "{name} must be positive, not {n}"
            ))),
            other => Ok(other.map(|n| n as u64)),
        }
    };
    let defaults = MigrationParams::default();
    let params = MigrationParams {
        mode: match &req.mode {
            Some(m) => m.parse().map_err(bad)?,
            None => defaults.mode,
        },
        max_downtime_ms: positive("max_downtime_ms", req.max_downtime_ms)?
            .unwrap_or(defaults.max_downtime_ms),
        max_bandwidth_mbps: positive("max_bandwidth_mbps", req.max_bandwidth_mbps)?,
        max_rounds: positive("max_rounds", req.max_rounds)?
            .map(|n| n.min(u64::from(u32::MAX)) as u32)
            .unwrap_or(defaults.max_rounds),
        timeout_s: positive("timeout_s", req.timeout_s)?.unwrap_or(defaults.timeout_s),
        checksum: req.checksum.unwrap_or(false),
        auto_postcopy: req.auto_postcopy.unwrap_or(false),
        prepaging: match req.prepaging.as_deref() {
            None | Some("bubble") => Strategy::Bubble,
            Some("linear") => Strategy::Linear,
            Some(other) => {
                return Err(ApiError::bad_request(format!(
                    "unknown prepaging '{other}' (use bubble or linear)"
                )));
            }
        },
    };
    Ok((endpoint, params))
}

impl Controller {
    pub fn send_migration(&self, req: &MigrationRequest) -> Result<Value, ApiError> {
        let (endpoint, params) = params_from_request(req)?;
        let vm = self.require_live()?.clone();
        self.outgoing.claim()?;
        {
            let mut s = lock(&self.outgoing.status);
            *s = Default::default();
            s.phase = MigrationPhase::Setup;
        }
        *self
            .outgoing
            .last_params
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = Some(params.clone());
        let status = self.outgoing.status.clone();
        let signals = self.outgoing.signals.clone();
        let this = self.self_ref();
        std::thread::Builder::new()
            .name("migration".into())
            .spawn(move || {
                let result =
                    migration::send_migration(vm.as_ref(), &endpoint, &params, &status, &signals);
                match result {
                    Ok(()) => this.set_phase(Phase::Migrated),
                    Err(e) => tracing::warn!("migration failed, the VM runs on here: {e}"),
                }
                this.outgoing.release();
            })
            .map_err(|e| ApiError::internal(format!("cannot start the migration: {e}")))?;
        // Answer once the destination has answered, so a dead address is an error right here.
        let deadline = Instant::now() + SETUP_WAIT;
        loop {
            let s = lock(&self.outgoing.status).clone();
            if s.phase != MigrationPhase::Setup || Instant::now() > deadline {
                if let (MigrationPhase::Failed, Some(e)) = (s.phase, &s.error) {
                    return Err(ApiError::new(502, e.clone()));
                }
                return Ok(serde_json::to_value(s).unwrap_or_default());
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// `vm.migrate-resume`: carries on a post-copy whose connection broke, on either side.
    pub fn migrate_resume(&self, req: &MigrateResumeRequest) -> Result<Value, ApiError> {
        let bad = |e: migration::Error| ApiError::bad_request(e.to_string());
        match (&req.listen, &req.destination) {
            (Some(listen), None) => {
                let endpoint: Endpoint = listen.parse().map_err(bad)?;
                let dest = self
                    .outgoing
                    .interrupted
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .take()
                    .ok_or_else(|| {
                        ApiError::conflict("there is no interrupted post-copy to resume here")
                    })?;
                let listener = endpoint.listen().map_err(|e| {
                    *self
                        .outgoing
                        .interrupted
                        .lock()
                        .unwrap_or_else(|e| e.into_inner()) = Some(dest.clone());
                    ApiError::bad_request(e.to_string())
                })?;
                let this = self.self_ref();
                std::thread::spawn(move || {
                    let result = resume_destination(&dest, listener);
                    let mut s = lock(&this.outgoing.status);
                    match result {
                        Ok(report) => {
                            s.phase = MigrationPhase::Completed;
                            s.error = None;
                            s.memory_checksum_destination = report.memory_checksum;
                            s.postcopy_report = Some(report);
                        }
                        Err(e) => {
                            s.error = Some(format!("resuming post-copy failed: {e}"));
                            drop(s);
                            *this
                                .outgoing
                                .interrupted
                                .lock()
                                .unwrap_or_else(|e| e.into_inner()) = Some(dest);
                        }
                    }
                });
                Ok(Value::Null)
            }
            (None, Some(destination)) => {
                let endpoint: Endpoint = destination.parse().map_err(bad)?;
                if !self.outgoing.signals.can_resume() {
                    return Err(ApiError::conflict(
                        "there is no interrupted post-copy to resume here",
                    ));
                }
                let vm = self.vm()?.clone();
                let params = self
                    .outgoing
                    .last_params
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .clone()
                    .unwrap_or_default();
                self.outgoing.claim_keeping_leftover()?;
                let this = self.self_ref();
                std::thread::spawn(move || {
                    let o = &this.outgoing;
                    let result = migration::resume_postcopy(
                        vm.as_ref(),
                        &endpoint,
                        &params,
                        &o.status,
                        &o.signals,
                    );
                    if result.is_ok() {
                        this.set_phase(Phase::Migrated);
                    }
                    o.release();
                });
                Ok(Value::Null)
            }
            _ => Err(ApiError::bad_request(
                "vm.migrate-resume needs exactly one of listen (destination) or destination (source)",
            )),
        }
    }

    pub fn snapshot(&self, req: &SnapshotRequest) -> Result<Value, ApiError> {
        let vm = self.require_live()?.clone();
        self.outgoing.claim()?;
        let result = migration::precopy::save_snapshot(
            vm.as_ref(),
            Path::new(&req.file),
            &self.outgoing.status,
        );
        self.outgoing.release();
        match result {
            Ok(()) => Ok(self.outgoing.status_json()),
            Err(e) => Err(ApiError::internal(format!("snapshot failed: {e}"))),
        }
    }
}
