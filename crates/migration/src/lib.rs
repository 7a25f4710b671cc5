//! ferry's migration engine: wire protocol, transports, pre-copy (live, warm, cold), the
//! receiver, policy and statistics.
//!
//! It knows nothing of KVM: it drives a VM through the `Migratable` trait, which the KVM VM
//! implements and unit tests implement with plain memory.

pub mod bitmap;
pub mod error;
pub mod memory;
pub mod pages;
pub mod policy;
pub mod postcopy;
pub mod precopy;
pub mod prepaging;
pub mod protocol;
pub mod ratelimit;
pub mod receive;
pub mod stats;
pub mod transport;
pub mod vm;
pub mod zero;

pub use error::{Error, Result};
pub use memory::{GuestRam, RamRange};
pub use postcopy::resume_postcopy;
pub use precopy::{MigrationParams, Mode, Signals, send_migration};
pub use receive::{Incoming, receive_migration};
pub use stats::{MigrationPhase, MigrationStatus, RoundStats, SharedStatus};
pub use transport::Endpoint;
pub use vm::{Migratable, VmDescriptor};

pub const PAGE_SIZE: usize = 4096;
pub const PAGE_SHIFT: u32 = 12;
