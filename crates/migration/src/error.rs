#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{0}")]
    Transport(String),
    #[error("migration stream: {0}")]
    Protocol(String),
    #[error("the peer reported: {0}")]
    Peer(String),
    #[error("VM: {0}")]
    Vm(String),
    #[error("migration cancelled")]
    Cancelled,
    #[error("migration timed out after {0} s")]
    Timeout(u64),
    #[error("bad migration parameter: {0}")]
    Param(String),
    #[error("I/O: {0}")]
    Io(#[from] std::io::Error),
}

pub type Result<T> = std::result::Result<T, Error>;
