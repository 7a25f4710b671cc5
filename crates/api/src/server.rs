//! The Unix-socket HTTP server. Each request runs on its own thread, so a long operation
//! never blocks a status query.

use std::io::Read;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde_json::Value;

use crate::request::ApiRequest;
use crate::types::ErrorBody;

#[derive(Clone, Debug, PartialEq)]
pub struct ApiError {
    pub status: u16,
    pub message: String,
}

impl ApiError {
    pub fn new(status: u16, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
        }
    }
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(400, message)
    }
    pub fn conflict(message: impl Into<String>) -> Self {
        Self::new(409, message)
    }
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(500, message)
    }
    pub(crate) fn not_found(path: &str) -> Self {
        Self::new(404, format!("no such endpoint: {path}"))
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ({})", self.message, self.status)
    }
}

/// What the VMM does with a request. `Ok(Value::Null)` answers 204 No Content.
pub trait Handler: Send + Sync + 'static {
    fn handle(&self, request: ApiRequest) -> Result<Value, ApiError>;
}

pub struct ApiServer {
    path: PathBuf,
}

const MAX_BODY: u64 = 1 << 20;

impl ApiServer {
    /// Fails if another process serves `path`; removes a stale socket file left behind.
    pub fn ensure_available(path: &Path) -> std::io::Result<()> {
        if path.exists() {
            if UnixStream::connect(path).is_ok() {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::AddrInUse,
                    format!("API socket {} is in use by another process", path.display()),
                ));
            }
            std::fs::remove_file(path)?;
        }
        Ok(())
    }

    /// Binds the socket and serves requests on background threads.
    pub fn start(path: &Path, handler: Arc<dyn Handler>) -> std::io::Result<Self> {
        Self::ensure_available(path)?;
        let server = tiny_http::Server::http_unix(path).map_err(|e| {
            std::io::Error::other(format!("cannot listen on {}: {e}", path.display()))
        })?;
        std::thread::Builder::new()
            .name("api".into())
            .spawn(move || {
                for request in server.incoming_requests() {
                    let handler = handler.clone();
                    let _ = std::thread::Builder::new()
                        .name("api-request".into())
                        .spawn(move || serve(request, handler.as_ref()));
                }
            })?;
        Ok(Self {
            path: path.to_path_buf(),
        })
    }
}

impl Drop for ApiServer {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

fn serve(mut request: tiny_http::Request, handler: &dyn Handler) {
    let mut body = Vec::new();
    let read = request
        .as_reader()
        .take(MAX_BODY + 1)
        .read_to_end(&mut body);
    let method = request.method().as_str().to_uppercase();
    let outcome = match read {
        Err(e) => Err(ApiError::bad_request(format!("cannot read body: {e}"))),
        Ok(_) if body.len() as u64 > MAX_BODY => {
            Err(ApiError::new(413, "request body larger than 1 MiB"))
        }
        Ok(_) => ApiRequest::parse(&method, request.url(), &body)
            .and_then(|parsed| handler.handle(parsed)),
    };
    let (status, text) = match outcome {
        Ok(Value::Null) => (204, String::new()),
        Ok(value) => (200, value.to_string()),
        Err(e) => (
            e.status,
            serde_json::to_string(&ErrorBody { error: e.message }).unwrap_or_default(),
        ),
    };
    let header = tiny_http::Header::from_bytes("Content-Type", "application/json")
        .expect("static header is valid");
    let response = tiny_http::Response::from_string(text)
        .with_status_code(status)
        .with_header(header);
    let _ = request.respond(response);
}
