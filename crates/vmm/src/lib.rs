//! A VM on KVM: guest memory and its memory map, vCPUs, PVH and Linux boot, ACPI, devices, and the VM state that migration moves.
//!
//! The crate knows KVM and nothing about migration streams; `migration` drives it through the
//! traits the VM implements.

pub mod acpi;
pub mod boot;
pub mod cpuid;
pub mod devices;
pub mod dirty_log;
pub mod error;
pub mod landlock;
pub mod layout;
pub mod memory;
pub mod migratable;
pub mod persist;
pub mod privileges;
pub mod sandbox;
pub mod state;
pub mod vcpu;
pub mod vm;

pub use devices::virtio::block::DiskConfig;
pub use devices::virtio::net::NetConfig;
pub use error::{Error, Result};
pub use memory::{MemoryBackend, MemorySize};
pub use vcpu::VmEvent;
pub use vm::{BootImage, Vm, VmConfig, VmInfo, VmState};
