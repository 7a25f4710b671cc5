//! A minimal HTTP/1.1 client over a Unix socket: one request per connection.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::Value;

use crate::request::PREFIX;
use crate::types::ErrorBody;

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("cannot reach the ferry API at {path} (is `ferry run` running there?)")]
    Connect {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("API connection failed")]
    Io(#[from] std::io::Error),
    #[error("malformed API response: {0}")]
    Malformed(String),
    #[error("{message} (HTTP {status})")]
    Api { status: u16, message: String },
}

pub struct ApiClient {
    path: PathBuf,
    timeout: Duration,
}

impl ApiClient {
    pub fn new(path: &Path) -> Self {
        Self {
            path: path.to_path_buf(),
            timeout: Duration::from_secs(30),
        }
    }

    pub fn get(&self, endpoint: &str) -> Result<Value, ClientError> {
        self.call("GET", endpoint, None)
    }

    pub fn put(&self, endpoint: &str, body: Option<&Value>) -> Result<Value, ClientError> {
        self.call("PUT", endpoint, body)
    }

    /// Sends `method` to `/api/v1/<endpoint>`; a non-2xx answer becomes `ClientError::Api`.
    pub fn call(
        &self,
        method: &str,
        endpoint: &str,
        body: Option<&Value>,
    ) -> Result<Value, ClientError> {
        let body = body.map(Value::to_string).unwrap_or_default();
        self.call_raw(method, endpoint, &body)
    }

    /// Like `call`, with the body as given (tests use it to send malformed JSON).
    pub fn call_raw(&self, method: &str, endpoint: &str, body: &str) -> Result<Value, ClientError> {
        let mut stream =
            UnixStream::connect(&self.path).map_err(|source| ClientError::Connect {
                path: self.path.clone(),
                source,
            })?;
        stream.set_read_timeout(Some(self.timeout))?;
        write!(
            stream,
            "{method} {PREFIX}{endpoint} HTTP/1.1\r\nHost: ferry\r\nConnection: close\r\n\
             Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )?;
        let mut raw = Vec::new();
        stream.read_to_end(&mut raw)?;
        parse_response(&raw)
    }
}

fn parse_response(raw: &[u8]) -> Result<Value, ClientError> {
    let text = String::from_utf8_lossy(raw);
    let (head, body) = text
        .split_once("\r\n\r\n")
        .ok_or_else(|| ClientError::Malformed("no header end".into()))?;
    let status: u16 = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| ClientError::Malformed(format!("bad status line in {head:?}")))?;
    let value = if body.trim().is_empty() {
        Value::Null
    } else {
        serde_json::from_str(body).map_err(|e| ClientError::Malformed(e.to_string()))?
    };
    if (200..300).contains(&status) {
        return Ok(value);
    }
    let message = serde_json::from_value::<ErrorBody>(value)
        .map(|e| e.error)
        .unwrap_or_else(|_| "no error message".into());
    Err(ClientError::Api { status, message })
}
