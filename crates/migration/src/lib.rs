//! ferry's migration engine, by side: `source` (rounds, switch-over, post-copy serving,
//! recovery), `destination` (receive state machine, post-copy faults, recovery), and what
//! both sides use and which uses neither: `wire` (framing, messages, page frames), `pages`
//! (the page pipeline: sender, receiver, compression, deltas) and `io` (transports, TLS, the
//! gate, snapshot files). Beside them the pure parts: `policy`, `prepaging`, `ratelimit`;
//! and what both sides share: guest `memory`, page sets (`bitmap`), the `zero` check, `scan`,
//! `params`, `status` (published on a `board`, summed in `totals`, with `buckets` for
//! histograms), which `host` each end runs on, the `vm` trait.
//!
//! It knows nothing of KVM: it drives a VM through the `Migratable` trait, which the KVM VM
//! implements and tests implement with plain memory.

pub mod bitmap;
pub mod board;
pub mod buckets;
pub mod copies;
pub mod cpu;
pub mod destination;
pub mod disk_log;
pub mod error;
pub mod host;
pub mod io;
pub mod memory;
pub mod pages;
pub mod params;
pub mod policy;
pub mod prepaging;
pub mod ratelimit;
pub mod scan;
pub mod source;
pub mod status;
pub mod sync;
#[cfg(test)]
mod test_data;
pub mod totals;
mod urgent;
pub mod vm;
pub mod wire;
pub mod zero;

pub use board::StatusBoard;
pub use destination::Incoming;
pub use error::{Error, ErrorKind, Result};
pub use io::transport::Endpoint;
pub use memory::{GuestRam, RamRange};
pub use params::{AutoConverge, Compression, MigrationParams, Mode, Strategy};
pub use source::Outgoing;
pub use status::{Phase, Role, Status, Transfer};
pub use vm::{
    CopiedDisk, DeviceDescriptor, GuestReport, HandedFiles, Migratable, VmDescriptor, check_devices,
};

pub const PAGE_SIZE: usize = 4096;
pub const PAGE_SHIFT: u32 = 12;
