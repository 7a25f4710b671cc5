//! ferry's control API: HTTP/JSON over a Unix socket. Request and response types, the server
//! (routing and errors; the VMM supplies a `Handler`), Cloud Hypervisor's profile (`ch`) and a
//! small client for the CLI.

pub mod ch;
pub mod client;
pub mod error;
pub mod request;
pub mod scrape;
pub mod server;
pub mod types;

pub use client::{ApiClient, ClientError};
pub use error::ApiError;
pub use request::ApiRequest;
pub use server::{ApiServer, Handler, Service};
pub use types::*;
