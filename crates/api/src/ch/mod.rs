//! Cloud Hypervisor's control contract (its REST API, `vmm/src/api/openapi/
//! cloud-hypervisor.yaml`), as a profile ferry serves beside its own API: the endpoints
//! orchestrators call, the `VmConfig` subset ferry honours, and CH's error answers — a JSON
//! array of messages, outermost first. docs/orchestrators.md says what maps to what.

pub mod config;
pub mod request;
pub mod types;

pub use config::{ConsoleMode, Disk, Net, VmSpec};
pub use request::ChRequest;
pub use types::*;

use crate::error::ApiError;

/// CH's error body: the error chain's messages, outermost first (CH's own first link,
/// then what ferry says went wrong).
pub fn error_body(e: &ApiError) -> String {
    serde_json::to_string(&["Error from API", e.message.as_str()]).unwrap_or_default()
}
