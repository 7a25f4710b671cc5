//! Cloud Hypervisor's endpoints: method + path + body to a typed call, with CH's answers to
//! a bad one (404 for an endpoint it does not have, 400 for a wrong method or body).

use serde_json::Value;

use super::config::{self, Net, VmSpec};
use super::types::{ReceiveMigrationData, RestoreConfig, SendMigrationData, VmSnapshotConfig};
use crate::error::ApiError;
use crate::request::{PREFIX, json};

#[derive(Clone, Debug, PartialEq)]
pub enum ChRequest {
    VmmPing,
    VmmShutdown,
    Create(Box<VmSpec>),
    /// `vm.add-net` before `vm.boot`; `bool`: the body names the tap (else its file comes
    /// with the request).
    AddNet(Box<Net>, bool),
    Boot,
    Info,
    Counters,
    Pause,
    Resume,
    Shutdown,
    Reboot,
    PowerButton,
    Delete,
    Snapshot(VmSnapshotConfig),
    Restore(RestoreConfig),
    SendMigration(SendMigrationData),
    ReceiveMigration(ReceiveMigrationData),
    /// ferry's additions: progress in libvirt's terms, and cancel.
    MigrationProgress,
    CancelMigration,
}

/// CH endpoints ferry does not serve: answered 400 with why, not 404 as an unknown one is.
const UNSUPPORTED: &[(&str, &str)] = &[
    ("vm.resize", "ferry has no CPU or memory hotplug"),
    ("vm.resize-zone", "ferry has no memory zones"),
    ("vm.resize-disk", "ferry does not resize disks"),
    ("vm.add-device", "ferry has no VFIO"),
    ("vm.add-user-device", "ferry has no vfio-user"),
    (
        "vm.add-disk",
        "ferry has no hotplug; give disks in vm.create",
    ),
    ("vm.add-fs", "ferry has no virtio-fs"),
    ("vm.add-pmem", "ferry has no virtio-pmem"),
    ("vm.add-vsock", "ferry has no vsock"),
    ("vm.add-vdpa", "ferry has no vDPA"),
    ("vm.add-generic-vhost-user", "ferry has no vhost-user"),
    ("vm.remove-device", "ferry has no hotplug"),
    ("vm.coredump", "ferry does not write core dumps"),
    ("vm.nmi", "ferry does not inject NMIs"),
];

impl ChRequest {
    pub fn parse(method: &str, path: &str, body: &[u8]) -> Result<Self, ApiError> {
        let Some(endpoint) = path.strip_prefix(PREFIX) else {
            return Err(ApiError::new(404, format!("no such endpoint: {path}")));
        };
        if let Some((_, why)) = UNSUPPORTED.iter().find(|(e, _)| *e == endpoint) {
            return Err(ApiError::bad_request(format!("{endpoint}: {why}")));
        }
        let (want, request) = match endpoint {
            "vmm.ping" => ("GET", ChRequest::VmmPing),
            "vmm.shutdown" => ("PUT", ChRequest::VmmShutdown),
            "vm.create" => {
                let config: Value = json(endpoint, body)?;
                (
                    "PUT",
                    ChRequest::Create(Box::new(VmSpec::from_json(&config)?)),
                )
            }
            "vm.add-net" => {
                let (net, named) = config::added_net(&json(endpoint, body)?)?;
                ("PUT", ChRequest::AddNet(Box::new(net), named))
            }
            "vm.boot" => ("PUT", ChRequest::Boot),
            "vm.info" => ("GET", ChRequest::Info),
            "vm.counters" => ("GET", ChRequest::Counters),
            "vm.pause" => ("PUT", ChRequest::Pause),
            "vm.resume" => ("PUT", ChRequest::Resume),
            "vm.shutdown" => ("PUT", ChRequest::Shutdown),
            "vm.reboot" => ("PUT", ChRequest::Reboot),
            "vm.power-button" => ("PUT", ChRequest::PowerButton),
            "vm.delete" => ("PUT", ChRequest::Delete),
            "vm.snapshot" => ("PUT", ChRequest::Snapshot(json(endpoint, body)?)),
            "vm.restore" => {
                let r: RestoreConfig = json(endpoint, body)?;
                r.check()?;
                ("PUT", ChRequest::Restore(r))
            }
            "vm.send-migration" => {
                let s: SendMigrationData = json(endpoint, body)?;
                s.check()?;
                ("PUT", ChRequest::SendMigration(s))
            }
            "vm.receive-migration" => {
                let r: ReceiveMigrationData = json(endpoint, body)?;
                r.check()?;
                ("PUT", ChRequest::ReceiveMigration(r))
            }
            "vm.migration-progress" => ("GET", ChRequest::MigrationProgress),
            "vm.cancel-migration" => ("PUT", ChRequest::CancelMigration),
            _ => return Err(ApiError::new(404, format!("no such endpoint: {path}"))),
        };
        if method != want {
            return Err(ApiError::bad_request(format!(
                "{endpoint} takes {want}, not {method}"
            )));
        }
        Ok(request)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn answers_as_cloud_hypervisor_does() {
        assert_eq!(
            ChRequest::parse("GET", "/api/v1/vmm.ping", b"").unwrap(),
            ChRequest::VmmPing
        );
        assert_eq!(
            ChRequest::parse("GET", "/api/v1/vm.nope", b"")
                .unwrap_err()
                .status,
            404
        );
        assert_eq!(
            ChRequest::parse("GET", "/api/v1/vm.pause", b"")
                .unwrap_err()
                .status,
            400
        );
        let e = ChRequest::parse("PUT", "/api/v1/vm.resize", b"{}").unwrap_err();
        assert!(e.status == 400 && e.message.contains("hotplug"), "{e}");
        let e = ChRequest::parse(
            "PUT",
            "/api/v1/vm.send-migration",
            br#"{"destination_url":"unix:/x","bogus":1}"#,
        )
        .unwrap_err();
        assert!(
            e.status == 400 && e.message.contains("unknown field `bogus`"),
            "{e}"
        );
        let e = ChRequest::parse(
            "PUT",
            "/api/v1/vm.send-migration",
            br#"{"destination_url":"unix:/x","local":"yes"}"#,
        )
        .unwrap_err();
        assert!(
            e.status == 400 && e.message.contains("expected a boolean"),
            "{e}"
        );
    }

    /// The bodies Cloud Hypervisor's own `ch-remote` (v53) sends, byte for byte: every field
    /// it fills in with its default is taken; one that asks for what ferry lacks is named.
    #[test]
    fn takes_what_ch_remote_sends() {
        let bodies: [(&str, &[u8]); 3] = [
            (
                "vm.restore",
                br#"{"source_url":"file:///s","prefault":false,"memory_restore_mode":"Copy","net_fds":null,"vfio_fds":null,"iommufd_fd":null,"resume":true,"zone_updates":[]}"#,
            ),
            (
                "vm.send-migration",
                br#"{"destination_url":"unix:/m","local":false,"preserve_source":false,"downtime_ms":300,"timeout_s":3600,"timeout_strategy":"Cancel","connections":1,"tls_dir":null,"memory_mode":"Precopy"}"#,
            ),
            (
                "vm.receive-migration",
                br#"{"receiver_url":"unix:/m","tls_dir":null,"memory_mode":"Precopy","vfio_fds":null,"iommufd_fd":null,"zone_updates":[]}"#,
            ),
        ];
        for (endpoint, body) in bodies {
            let path = format!("/api/v1/{endpoint}");
            if let Err(e) = ChRequest::parse("PUT", &path, body) {
                panic!("{endpoint}: {e}");
            }
        }
        let e = ChRequest::parse(
            "PUT",
            "/api/v1/vm.restore",
            br#"{"source_url":"file:///s","net_fds":[{"id":"net0","num_fds":2}]}"#,
        )
        .unwrap_err();
        assert!(e.status == 400 && e.message.contains("num_fds=2"), "{e}");
    }
}
