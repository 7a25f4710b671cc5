//! Cloud Hypervisor's REST API as its clients speak it, for the tests that drive `ferry ch`.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;

use serde_json::Value;

/// One request: its status and its body (JSON, or null when empty).
pub fn call(socket: &Path, method: &str, endpoint: &str, body: Option<Value>) -> (u16, Value) {
    let Ok(mut s) = UnixStream::connect(socket) else {
        return (0, Value::Null);
    };
    let body = body.map(|b| b.to_string()).unwrap_or_default();
    let request = format!(
        "{method} /api/v1/{endpoint} HTTP/1.1\r\nHost: localhost\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(request.as_bytes()).unwrap();
    let mut answer = String::new();
    s.read_to_string(&mut answer).unwrap();
    let status = answer[9..12].parse().unwrap();
    // CH's client takes all of the status line after the version as the code.
    assert!(
        answer.starts_with(&format!("HTTP/1.1 {status} \r\n")),
        "a status line CH's client cannot read: {answer}"
    );
    let text = answer.split_once("\r\n\r\n").map_or("", |(_, b)| b);
    (status, serde_json::from_str(text).unwrap_or(Value::Null))
}
