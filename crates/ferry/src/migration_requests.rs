//! The native API's requests that move the VM away or carry a move on: `vm.send-migration`,
//! `vm.migrate-resume` and `vm.snapshot`. Each is checked against the VM and its security, then
//! handed to the engine (`migrations` turns requests into the engine's parameters).

use std::fs::OpenOptions;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use api::{ApiError, MigrateResumeRequest, MigrationRequest, SnapshotRequest};
use migration::{Endpoint, Migratable};
use serde_json::Value;

use crate::controller::Controller;
use crate::lifecycle::Phase;
use crate::migrations::{api_error, params_from_request, snapshot_params};

/// How long a destination's `vm.migrate-resume {"listen"}` waits for its source by default.
const RESUME_LISTEN_WAIT: Duration = Duration::from_secs(300);

impl Controller {
    /// Where a snapshot named `file` may go: a plain name inside `--snapshot-dir`, or a path
    /// whose directory is that one.
    fn snapshot_path(&self, file: &str) -> Result<std::path::PathBuf, ApiError> {
        let dir = self.snapshot_dir.get().ok_or_else(|| {
            ApiError::conflict("snapshots are off: start ferry run with --snapshot-dir DIR")
        })?;
        let path = Path::new(file);
        let name = path
            .file_name()
            .filter(|n| *n != ".." && *n != ".")
            .ok_or_else(|| ApiError::bad_request(format!("'{file}' names no file")))?;
        let parent = match path.parent() {
            Some(p) if !p.as_os_str().is_empty() => p
                .canonicalize()
                .map_err(|e| ApiError::bad_request(format!("{}: {e}", p.display())))?,
            _ => dir.clone(),
        };
        if &parent != dir {
            return Err(ApiError::bad_request(format!(
                "snapshots go in {} (--snapshot-dir), not {}",
                dir.display(),
                parent.display()
            )));
        }
        Ok(dir.join(name))
    }

    /// When a background migration ends well, the VM lives elsewhere now.
    fn on_moved(&self) -> migration::source::OnDone {
        let this = self.self_ref();
        Box::new(move |result| {
            if result.is_ok() {
                this.set_phase(Phase::Migrated);
            }
        })
    }

    pub fn send_migration(&self, req: &MigrationRequest) -> Result<Value, ApiError> {
        let (endpoint, params) = params_from_request(req)?;
        let m = &self.migrations;
        m.security.check(&endpoint).map_err(ApiError::bad_request)?;
        if crate::dirty_bench::active() {
            return Err(ApiError::conflict(
                "the dirty-logging benchmark hook is on and would clear the migration's dirty \
                 log: turn it off first (vm.debug-dirty-logging {\"enabled\": false})",
            ));
        }
        let live = self.require_live()?;
        // A disk is shared storage, not checkpointed: a guest rolled back to a checkpoint
        // would find on its disk what it wrote after it.
        if params.checkpoint_ms.is_some()
            && let Some(d) = live.device_info().iter().find(|d| d.writable)
        {
            return Err(ApiError::bad_request(format!(
                "checkpoint_ms with a writable disk ({}): a rollback would leave the disk ahead of the guest; give the disk readonly or migrate without checkpoints",
                d.path
                    .as_ref()
                    .map_or_else(|| format!("slot {}", d.slot), |p| p.display().to_string())
            )));
        }
        let vm: Arc<dyn Migratable> = live.clone();
        m.final_status_read.store(false, Ordering::Release);
        m.outgoing
            .send(vm, endpoint, params, self.on_moved())
            .map_err(api_error)?;
        Ok(m.status_json())
    }

    /// `vm.migrate-resume`: carries on a post-copy whose connection broke, on either side; on
    /// a source whose pre-copy is dialling again after a break, dials `destination` now.
    pub fn migrate_resume(&self, req: &MigrateResumeRequest) -> Result<Value, ApiError> {
        let m = &self.migrations;
        match (&req.listen, &req.destination) {
            (Some(listen), None) => {
                let endpoint: Endpoint = listen.parse().map_err(api_error)?;
                m.security.check(&endpoint).map_err(ApiError::bad_request)?;
                let wait = match req.timeout_s {
                    None => RESUME_LISTEN_WAIT,
                    Some(s @ 1..=86400) => Duration::from_secs(s),
                    Some(s) => {
                        return Err(ApiError::bad_request(format!(
                            "timeout_s {s} is out of range (1..=86400)"
                        )));
                    }
                };
                m.incoming.resume(&endpoint, wait).map_err(api_error)?;
            }
            (None, Some(_)) if req.timeout_s.is_some() => {
                return Err(ApiError::bad_request(
                    "timeout_s is for listen (the destination's wait for its source)",
                ));
            }
            (None, Some(destination)) => {
                let endpoint: Endpoint = destination.parse().map_err(api_error)?;
                m.security.check(&endpoint).map_err(ApiError::bad_request)?;
                // A pre-copy dialling again after its link broke tries this address now.
                if m.outgoing.redirect(endpoint.clone()) {
                    return Ok(Value::Null);
                }
                if m.outgoing.running() {
                    return Err(ApiError::conflict(
                        "the running migration's connection has not broken: nothing to resume",
                    ));
                }
                let vm: Arc<dyn Migratable> = self.vm()?.clone();
                m.final_status_read.store(false, Ordering::Release);
                m.outgoing
                    .resume_postcopy(vm, endpoint, self.on_moved())
                    .map_err(api_error)?;
            }
            _ => {
                return Err(ApiError::bad_request(
                    "vm.migrate-resume needs exactly one of listen (destination) or destination (source)",
                ));
            }
        }
        Ok(Value::Null)
    }

    /// `vm.snapshot`: writes the VM into `--snapshot-dir`.
    pub fn snapshot(&self, req: &SnapshotRequest) -> Result<Value, ApiError> {
        let path = self.snapshot_path(&req.file)?;
        self.snapshot_into(&path, req)
    }

    /// Writes the VM to `path`, a new file (never an existing one) readable by its owner
    /// only; on failure removes only the file it created.
    pub fn snapshot_into(&self, path: &Path, req: &SnapshotRequest) -> Result<Value, ApiError> {
        let vm = self.require_live()?.clone();
        let params = snapshot_params(req)?;
        let file = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(path)
            .map_err(|e| {
                let status = if e.kind() == std::io::ErrorKind::AlreadyExists {
                    409
                } else {
                    400
                };
                ApiError::new(status, format!("cannot create {}: {e}", path.display()))
            })?;
        let result = self
            .migrations
            .outgoing
            .snapshot(vm.as_ref(), file, &req.file, &params);
        match result {
            Ok(_) => Ok(self.migrations.status_json()),
            Err(e) => {
                let _ = std::fs::remove_file(path);
                Err(api_error(e))
            }
        }
    }
}
