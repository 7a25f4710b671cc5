//! Routing: method + path + body to a typed request, or an error that says what was wrong.

use serde::de::DeserializeOwned;

use crate::error::ApiError;
use crate::types::{
    BalloonRequest, CorruptPageRequest, DirtyLoggingRequest, MigrateResumeRequest,
    MigrationRequest, SnapshotRequest, TakeBackRequest,
};

pub const PREFIX: &str = "/api/v1/";

#[derive(Clone, Debug, PartialEq)]
pub enum ApiRequest {
    VmInfo,
    Pause,
    Resume,
    Shutdown,
    CorruptPage(CorruptPageRequest),
    DirtyLogging(DirtyLoggingRequest),
    SendMigration(MigrationRequest),
    MigrationStatus,
    CancelMigration,
    StartPostcopy,
    /// Take the VM back after an unconfirmed switch (the operator knows the destination is down).
    MigrateReclaim(TakeBackRequest),
    /// Run the VM on the source from the newest post-copy checkpoint after the destination
    /// died mid post-copy (the operator knows it did).
    MigrateRollback(TakeBackRequest),
    MigrateResume(MigrateResumeRequest),
    Snapshot(SnapshotRequest),
    /// Set the balloon's target.
    Balloon(BalloonRequest),
}

impl ApiRequest {
    pub fn parse(method: &str, path: &str, body: &[u8]) -> Result<Self, ApiError> {
        let Some(endpoint) = path.strip_prefix(PREFIX) else {
            return Err(ApiError::not_found(path));
        };
        let (want, request) = match endpoint {
            "vm.info" => ("GET", ApiRequest::VmInfo),
            "vm.pause" => ("PUT", ApiRequest::Pause),
            "vm.resume" => ("PUT", ApiRequest::Resume),
            "vm.shutdown" => ("PUT", ApiRequest::Shutdown),
            "vm.debug-corrupt-page" => ("PUT", ApiRequest::CorruptPage(json(endpoint, body)?)),
            "vm.debug-dirty-logging" => ("PUT", ApiRequest::DirtyLogging(json(endpoint, body)?)),
            "vm.send-migration" => ("PUT", ApiRequest::SendMigration(json(endpoint, body)?)),
            "vm.migration" => ("GET", ApiRequest::MigrationStatus),
            "vm.cancel-migration" => ("PUT", ApiRequest::CancelMigration),
            "vm.migrate-start-postcopy" => ("PUT", ApiRequest::StartPostcopy),
            "vm.migrate-reclaim" => ("PUT", ApiRequest::MigrateReclaim(optional(endpoint, body)?)),
            "vm.migrate-rollback" => (
                "PUT",
                ApiRequest::MigrateRollback(optional(endpoint, body)?),
            ),
            "vm.migrate-resume" => ("PUT", ApiRequest::MigrateResume(json(endpoint, body)?)),
            "vm.snapshot" => ("PUT", ApiRequest::Snapshot(json(endpoint, body)?)),
            "vm.balloon" => ("PUT", ApiRequest::Balloon(json(endpoint, body)?)),
            _ => return Err(ApiError::not_found(path)),
        };
        if method != want {
            return Err(ApiError::new(
                405,
                format!("{endpoint} takes {want}, not {method}"),
            ));
        }
        Ok(request)
    }
}

/// A body that may be left out (then every field takes its default).
fn optional<T: DeserializeOwned + Default>(endpoint: &str, body: &[u8]) -> Result<T, ApiError> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok(T::default());
    }
    json(endpoint, body)
}

pub(crate) fn json<T: DeserializeOwned>(endpoint: &str, body: &[u8]) -> Result<T, ApiError> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Err(ApiError::bad_request(format!(
            "{endpoint} needs a JSON body"
        )));
    }
    serde_json::from_slice(body)
        .map_err(|e| ApiError::bad_request(format!("{endpoint}: malformed JSON body: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routes_known_endpoints() {
        assert_eq!(
            ApiRequest::parse("GET", "/api/v1/vm.info", b"").unwrap(),
            ApiRequest::VmInfo
        );
        assert_eq!(
            ApiRequest::parse("PUT", "/api/v1/vm.debug-corrupt-page", br#"{"page":3}"#).unwrap(),
            ApiRequest::CorruptPage(CorruptPageRequest { page: 3 })
        );
    }

    #[test]
    fn explains_what_is_wrong() {
        let e = ApiRequest::parse("GET", "/api/v1/vm.nope", b"").unwrap_err();
        assert_eq!(e.status, 404);
        let e = ApiRequest::parse("GET", "/api/v1/vm.pause", b"").unwrap_err();
        assert_eq!(e.status, 405);
        assert!(e.message.contains("takes PUT"));
        let e = ApiRequest::parse("PUT", "/api/v1/vm.debug-corrupt-page", b"{page").unwrap_err();
        assert_eq!(e.status, 400);
        assert!(e.message.contains("malformed JSON"));
        let e =
            ApiRequest::parse("PUT", "/api/v1/vm.debug-corrupt-page", br#"{"pg":1}"#).unwrap_err();
        assert!(e.message.contains("unknown field"));
    }
}
