//! Cloud Hypervisor's REST API as its clients speak it, for the tests that drive `ferry ch`.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;

use serde_json::Value;

/// One request: its status and its body (JSON, or null when empty). The answer is read as
/// HTTP/1.1 clients read it, by its `Content-Length`: Cloud Hypervisor keeps the connection
/// open after answering.
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
    let mut answer = BufReader::new(s);
    let mut status_line = String::new();
    answer.read_line(&mut status_line).unwrap();
    let status = status_line
        .get(9..12)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("{endpoint}: not an HTTP answer: {status_line:?}"));
    // CH's client takes all of the status line after the version as the code.
    assert_eq!(
        status_line,
        format!("HTTP/1.1 {status} \r\n"),
        "a status line CH's client cannot read"
    );
    let mut length = 0;
    loop {
        let mut header = String::new();
        answer.read_line(&mut header).unwrap();
        if header.trim_end().is_empty() {
            break;
        }
        if let Some((name, value)) = header.split_once(':')
            && name.eq_ignore_ascii_case("content-length")
        {
            length = value.trim().parse().unwrap();
        }
    }
    let mut text = vec![0; length];
    answer.read_exact(&mut text).unwrap();
    (status, serde_json::from_slice(&text).unwrap_or(Value::Null))
}
