use std::path::PathBuf;

/// What failed; the cause lives only in `source()` (see `migration::error::chain`).
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("cannot open /dev/kvm (is KVM available and are you root?)")]
    Kvm(#[source] kvm_ioctls::Error),
    #[error("KVM call {call} failed")]
    KvmCall {
        call: &'static str,
        #[source]
        source: kvm_ioctls::Error,
    },
    #[error("guest memory: {0}")]
    Memory(String),
    #[error("guest image {path}: {reason}")]
    GuestImage { path: PathBuf, reason: String },
    #[error("guest command line: {0}")]
    Cmdline(String),
    #[error("vCPU {cpu}: {reason}")]
    Vcpu { cpu: usize, reason: String },
    #[error("VM state: {0}")]
    State(String),
    /// The VM's configuration cannot be built (a missing disk, a locked one, too many).
    #[error("{0}")]
    Config(String),
    #[error(transparent)]
    Io(#[from] std::io::Error),
}

pub type Result<T> = std::result::Result<T, Error>;

/// Wraps a kvm-ioctls error with the name of the call that failed.
pub(crate) fn kvm(call: &'static str) -> impl FnOnce(kvm_ioctls::Error) -> Error {
    move |source| Error::KvmCall { call, source }
}
