//! The engine's errors. Each says what failed; its cause lives only in `source()`, so the
//! chain says each thing once. What leaves the process — the status, an `Abort` to the peer,
//! an API answer, a log line — is `Error::report`: the error and every cause. The API edge
//! chooses an HTTP status from `kind()`.

type Cause = Box<dyn std::error::Error + Send + Sync>;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The connection or file failed (refused, reset, timed out, closed).
    #[error("{context}")]
    Transport {
        context: String,
        #[source]
        source: std::io::Error,
    },
    /// The stream is not what the protocol allows (corrupt, truncated, foreign, out of order).
    #[error("migration stream: {0}")]
    Protocol(String),
    /// A frame the conversation does not allow where it came: which side was in which
    /// state, and what came.
    #[error("migration stream: unexpected {got} while the {side} was in {state}")]
    OutOfTurn {
        side: &'static str,
        got: String,
        state: String,
    },
    /// The peer gave up and said why.
    #[error("the peer reported: {0}")]
    Peer(String),
    /// The migration failed before its first page (connecting, the handshake): why.
    #[error("{0}")]
    Setup(String),
    /// The VM could not do what the migration asked of it.
    #[error("VM: {context}")]
    Vm {
        context: String,
        #[source]
        source: Option<Cause>,
    },
    #[error("migration cancelled")]
    Cancelled,
    /// The destination was asked to stop (by whom) before the VM ran there.
    #[error("the destination was asked to stop ({0}) before the VM ran there")]
    Stopped(String),
    #[error("migration timed out after {0} s")]
    Timeout(u64),
    /// A parameter the user gave is wrong.
    #[error("bad migration parameter: {0}")]
    Param(String),
    /// The request does not fit what the VM or the migration is doing now.
    #[error("{0}")]
    State(String),
}

/// How an error says the stream ended early (the peer closed the connection mid-stream).
const TRUNCATED: &str = "stream truncated";

/// What kind of failure an error is, for the API edge to answer with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ErrorKind {
    /// The user's input is wrong.
    BadInput,
    /// Not allowed in the current state.
    Conflict,
    /// The peer or the link failed.
    Peer,
    /// This side failed.
    Internal,
}

impl Error {
    pub fn transport(context: impl Into<String>, source: std::io::Error) -> Self {
        Error::Transport {
            context: context.into(),
            source: says(source),
        }
    }

    /// `got` (a message's name, or "page frame") came while `side` was in `state`.
    pub fn out_of_turn(
        side: &'static str,
        got: impl Into<String>,
        state: impl Into<String>,
    ) -> Self {
        Error::OutOfTurn {
            side,
            got: got.into(),
            state: state.into(),
        }
    }

    /// The stream ended while `what` was being read: the peer closed the connection.
    pub fn truncated(what: &str) -> Self {
        Error::Protocol(format!("{TRUNCATED} in {what}"))
    }

    /// Whether the connection broke (reset, timed out, closed by the peer mid-stream), as
    /// opposed to an answer or a stream that is wrong: what a resume can carry on from.
    pub fn is_break(&self) -> bool {
        match self {
            Error::Transport { .. } => true,
            Error::Protocol(why) => why.starts_with(TRUNCATED),
            _ => false,
        }
    }

    /// The error and each of its causes: what the status, the peer and the API hear.
    pub fn report(&self) -> String {
        chain(self)
    }

    pub fn vm(context: impl Into<String>) -> Self {
        Error::Vm {
            context: context.into(),
            source: None,
        }
    }

    pub fn vm_caused(context: impl Into<String>, source: impl Into<Cause>) -> Self {
        Error::Vm {
            context: context.into(),
            source: Some(source.into()),
        }
    }

    pub fn kind(&self) -> ErrorKind {
        match self {
            Error::Param(_) => ErrorKind::BadInput,
            Error::State(_) => ErrorKind::Conflict,
            Error::Transport { .. }
            | Error::Protocol(_)
            | Error::OutOfTurn { .. }
            | Error::Peer(_)
            | Error::Setup(_)
            | Error::Timeout(_) => ErrorKind::Peer,
            Error::Vm { .. } | Error::Cancelled | Error::Stopped(_) => ErrorKind::Internal,
        }
    }
}

/// Any error and each of its causes, in order: "what failed: why: why that".
pub fn chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut text = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        text.push_str(": ");
        text.push_str(&c.to_string());
        cause = c.source();
    }
    text
}

/// What an I/O error means here: a socket timeout reads as the OS's "try again".
fn says(e: std::io::Error) -> std::io::Error {
    match e.kind() {
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            "timed out: the peer is silent or the link is down",
        ),
        _ => e,
    }
}

impl From<std::io::Error> for Error {
    fn from(e: std::io::Error) -> Self {
        Error::transport("I/O", e)
    }
}

pub type Result<T> = std::result::Result<T, Error>;

#[cfg(test)]
mod tests {
    use super::*;
    use std::error::Error as _;

    #[test]
    fn causes_are_kept() {
        let e = Error::transport(
            "cannot connect to tcp:h:1",
            std::io::Error::from(std::io::ErrorKind::ConnectionRefused),
        );
        assert!(e.source().is_some());
        assert_eq!(e.kind(), ErrorKind::Peer);
        let e = Error::vm_caused("pause", std::io::Error::other("vCPU 1 stuck"));
        assert_eq!(e.source().unwrap().to_string(), "vCPU 1 stuck");
        assert_eq!(e.to_string(), "VM: pause", "said once, by the cause");
        assert_eq!(
            e.report(),
            "VM: pause: vCPU 1 stuck",
            "the peer and API hear why"
        );
    }

    #[test]
    fn a_socket_timeout_says_so() {
        let e = Error::transport(
            "reading frame header",
            std::io::Error::from(std::io::ErrorKind::WouldBlock),
        );
        assert_eq!(
            e.report(),
            "reading frame header: timed out: the peer is silent or the link is down"
        );
    }
}
