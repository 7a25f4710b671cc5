//! The Unix-socket HTTP server: a small HTTP/1.1 reader of its own, because the API is tiny
//! (method, path, Content-Length, a JSON body) and the general-purpose server it replaced read
//! whatever a client announced — a `Content-Length` of 100 GB aborted the process, and the VM
//! with it. Here every limit is checked before anything is read or allocated: the header is at
//! most 16 KiB, a body at most 1 MiB (a larger one is answered 413 unread), each connection
//! has 10 s in all (not per read) to send its request and carries one request. Each
//! connection is served on a thread of its own (threads are kept for the next connection,
//! never ended), so a long operation (a migration's setup, a snapshot) never blocks a status
//! query, but at most 64 at once: idle or trickling clients cannot pile up threads or hold a
//! place for longer than 10 s, and past the cap a connection gets 503 at once.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::fd::OwnedFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::Value;
use sockets::deadline::Within;

use crate::error::ApiError;
use crate::request::ApiRequest;
use crate::types::ErrorBody;

/// What the VMM does with a request. `Ok(Value::Null)` answers 204 No Content.
pub trait Handler: Send + Sync + 'static {
    fn handle(&self, request: ApiRequest) -> Result<Value, ApiError>;
}

/// A set of endpoints served on a socket, with its own way of saying what went wrong:
/// ferry's own API (a `Handler` behind `ApiRequest`), or Cloud Hypervisor's profile
/// (`crate::ch`). The server's limits hold for every service alike.
pub trait Service: Send + Sync + 'static {
    /// Answers one request; `Ok(Value::Null)` answers 204 No Content.
    fn call(&self, method: &str, path: &str, body: &[u8]) -> Result<Value, ApiError>;
    /// Answers a request that came with files (`SCM_RIGHTS`); only a service with endpoints
    /// that take files answers one.
    fn call_with_files(
        &self,
        method: &str,
        path: &str,
        body: &[u8],
        files: Vec<OwnedFd>,
    ) -> Result<Value, ApiError> {
        no_files(path, &files)?;
        self.call(method, path, body)
    }
    /// The body of an error answer.
    fn error_body(&self, e: &ApiError) -> String;
    /// Whether the status line carries a reason phrase (`HTTP/1.1 200 OK`). Cloud
    /// Hypervisor's client reads all the status line after the version as the code, so its
    /// profile answers as CH's server does, with none (`HTTP/1.1 200 `).
    fn reason_phrase(&self) -> bool {
        true
    }
}

/// Refuses `files` passed with a request for `path`, which takes none.
pub fn no_files(path: &str, files: &[OwnedFd]) -> Result<(), ApiError> {
    match files.len() {
        0 => Ok(()),
        n => Err(ApiError::bad_request(format!(
            "{path} takes no files ({n} passed with the request)"
        ))),
    }
}

/// ferry's own API: routed by `ApiRequest`, errors as `{"error": "..."}`.
struct Native(Arc<dyn Handler>);

impl Service for Native {
    fn call(&self, method: &str, path: &str, body: &[u8]) -> Result<Value, ApiError> {
        ApiRequest::parse(method, path, body).and_then(|r| self.0.handle(r))
    }
    fn error_body(&self, e: &ApiError) -> String {
        serde_json::to_string(&ErrorBody {
            error: e.message.clone(),
        })
        .unwrap_or_default()
    }
}

pub struct ApiServer {
    /// The socket this server made (removed when it stops); none for one it was handed.
    path: Option<PathBuf>,
}

const MAX_BODY: usize = 1 << 20;
/// Files a request may pass (a NIC's taps).
const MAX_PASSED_FILES: usize = 8;
const MAX_HEADER: usize = 16 << 10;
/// How long a client has to send its whole request, and to take the answer.
const CLIENT_TIMEOUT: Duration = Duration::from_secs(10);
/// Connections served at once; past this a new one is answered 503.
const MAX_CONNECTIONS: usize = 64;

impl ApiServer {
    /// Fails if another process serves `path` or a file that is not a socket is there; removes
    /// a stale socket left behind by a process that died.
    pub fn ensure_available(path: &Path) -> std::io::Result<()> {
        sockets::unix::remove_stale_socket(path).map_err(|e| {
            std::io::Error::new(e.kind(), format!("API socket {}: {e}", path.display()))
        })
    }

    /// Binds the socket (mode 0600 from the start) and serves requests on background threads.
    pub fn start(path: &Path, handler: Arc<dyn Handler>) -> std::io::Result<Self> {
        Self::start_service(path, Arc::new(Native(handler)))
    }

    /// The same for any service.
    pub fn start_service(path: &Path, service: Arc<dyn Service>) -> std::io::Result<Self> {
        Self::ensure_available(path)?;
        let listener = sockets::unix::bind_private(path)?;
        let mut server = Self::on_listener(listener, service)?;
        server.path = Some(path.to_path_buf());
        Ok(server)
    }

    /// Serves `service` on a socket someone else bound (handed over as a file descriptor,
    /// as libvirt does): it is left in place when the server stops.
    pub fn on_listener(listener: UnixListener, service: Arc<dyn Service>) -> std::io::Result<Self> {
        std::thread::Builder::new()
            .name("api-accept".into())
            .spawn(move || accept(&listener, service))?;
        Ok(Self { path: None })
    }
}

impl Drop for ApiServer {
    fn drop(&mut self) {
        if let Some(path) = &self.path {
            let _ = std::fs::remove_file(path);
        }
    }
}

fn accept(listener: &UnixListener, handler: Arc<dyn Service>) {
    let mut workers = Workers::new(handler.clone());
    for conn in listener.incoming() {
        let Ok(conn) = conn else { continue };
        if let Err(mut conn) = workers.hand(conn) {
            let _ = conn.set_write_timeout(Some(Duration::from_millis(100)));
            let _ = respond(
                &mut conn,
                handler.as_ref(),
                &Err(ApiError::new(503, "the API is busy: try again")),
            );
        }
    }
}

/// The threads that serve connections: made as they are needed, up to `MAX_CONNECTIONS`,
/// and then kept. A thread that ended right after its answer would race a client that lists
/// the process's threads right after it: libvirt moves each into a cgroup after `vm.boot`
/// and `vm.restore`, and gives the VM up when one has gone.
struct Workers {
    handler: Arc<dyn Service>,
    queue: Sender<UnixStream>,
    waiting: Arc<Mutex<Receiver<UnixStream>>>,
    /// Connections handed over and not yet answered.
    busy: Arc<AtomicUsize>,
    threads: usize,
}

impl Workers {
    fn new(handler: Arc<dyn Service>) -> Self {
        let (queue, waiting) = channel();
        Self {
            handler,
            queue,
            waiting: Arc::new(Mutex::new(waiting)),
            busy: Arc::new(AtomicUsize::new(0)),
            threads: 0,
        }
    }

    /// Gives `conn` to an idle thread, or a new one; back when all `MAX_CONNECTIONS` are busy.
    fn hand(&mut self, conn: UnixStream) -> Result<(), UnixStream> {
        let busy = self.busy.load(Ordering::Acquire);
        if busy >= MAX_CONNECTIONS {
            return Err(conn);
        }
        if busy >= self.threads {
            if self.spawn().is_err() {
                return Err(conn);
            }
            self.threads += 1;
        }
        self.busy.fetch_add(1, Ordering::AcqRel);
        self.queue.send(conn).map_err(|e| e.0)
    }

    fn spawn(&self) -> std::io::Result<()> {
        let (waiting, busy, handler) = (
            self.waiting.clone(),
            self.busy.clone(),
            self.handler.clone(),
        );
        std::thread::Builder::new()
            .name("api-request".into())
            .spawn(move || {
                loop {
                    let next = waiting.lock().unwrap_or_else(|e| e.into_inner()).recv();
                    let Ok(conn) = next else { return };
                    serve(conn, handler.as_ref());
                    busy.fetch_sub(1, Ordering::AcqRel);
                }
            })
            .map(drop)
    }
}

fn serve(mut conn: UnixStream, service: &dyn Service) {
    // One deadline for the whole request: a timeout per read would let a client sending a
    // byte now and then hold its connection (one of `MAX_CONNECTIONS`) for good.
    let deadline = Instant::now() + CLIENT_TIMEOUT;
    let outcome = first_read(&conn).and_then(|(first, files)| {
        let rest = Within::new(&mut conn, deadline);
        read_request(&mut std::io::Cursor::new(first).chain(rest), MAX_BODY)
            .and_then(|r| service.call_with_files(&r.method, &r.path, &r.body, files))
    });
    let _ = conn.set_write_timeout(Some(CLIENT_TIMEOUT));
    let _ = respond(&mut conn, service, &outcome);
}

/// The request's first bytes, with the files passed along with them (a client passes them
/// with the request, in one `sendmsg`, as libvirt does).
fn first_read(conn: &UnixStream) -> Result<(Vec<u8>, Vec<OwnedFd>), ApiError> {
    let _ = conn.set_read_timeout(Some(CLIENT_TIMEOUT));
    let mut first = vec![0u8; 4096];
    let (n, files) = sockets::passed::recv_with_files(conn, &mut first, MAX_PASSED_FILES)
        .map_err(|e| ApiError::bad_request(format!("reading the request: {e}")))?;
    first.truncate(n);
    Ok((first, files))
}

/// Reads and parses one request from a client (the whole of what a client can make the API
/// do before a handler runs; fuzzed by `fuzz/fuzz_targets/api.rs`).
pub fn parse_request(conn: &mut impl Read) -> Result<ApiRequest, ApiError> {
    let r = read_request(conn, MAX_BODY)?;
    ApiRequest::parse(&r.method, &r.path, &r.body)
}

/// Reads and parses one request of Cloud Hypervisor's contract (`ferry ch`; fuzzed by
/// `fuzz/fuzz_targets/ch_request.rs`).
pub fn parse_ch_request(conn: &mut impl Read) -> Result<crate::ch::ChRequest, ApiError> {
    let r = read_request(conn, MAX_BODY)?;
    crate::ch::ChRequest::parse(&r.method, &r.path, &r.body)
}

/// One HTTP request as read: its method (upper case), path, header lines and body.
#[derive(Debug, Default)]
pub struct HttpRequest {
    pub method: String,
    pub path: String,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl HttpRequest {
    /// The values of every header named `name` (any case), trimmed.
    pub fn header<'a>(&'a self, name: &'a str) -> impl Iterator<Item = &'a str> + 'a {
        self.headers
            .iter()
            .filter(move |(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

/// Reads one request within the limits above, a body of at most `max_body` bytes.
pub fn read_request(conn: &mut impl Read, max_body: usize) -> Result<HttpRequest, ApiError> {
    let mut reader = BufReader::new(conn.take(MAX_HEADER as u64));
    let mut line = String::new();
    let read_err = |e: std::io::Error| ApiError::bad_request(format!("reading the request: {e}"));
    reader.read_line(&mut line).map_err(read_err)?;
    let mut words = line.split_whitespace();
    let (Some(method), Some(path), Some(version)) = (words.next(), words.next(), words.next())
    else {
        return Err(ApiError::bad_request("not an HTTP request line"));
    };
    if !version.starts_with("HTTP/1.") {
        return Err(ApiError::bad_request(format!(
            "unsupported protocol {version}"
        )));
    }
    let mut request = HttpRequest {
        method: method.to_ascii_uppercase(),
        path: path.to_string(),
        ..HttpRequest::default()
    };
    loop {
        let mut header = String::new();
        if reader.read_line(&mut header).map_err(read_err)? == 0 {
            return Err(ApiError::bad_request(
                "the request header was cut short (16 KiB at most)",
            ));
        }
        let header = header.trim_end();
        if header.is_empty() {
            break;
        }
        let Some((name, value)) = header.split_once(':') else {
            return Err(ApiError::bad_request(format!(
                "malformed header line '{header}'"
            )));
        };
        request
            .headers
            .push((name.trim().into(), value.trim().into()));
    }
    let length = body_length(&request, max_body)?;
    let mut body = vec![0u8; length];
    let buffered = reader.buffer().len().min(length);
    body[..buffered].copy_from_slice(&reader.buffer()[..buffered]);
    reader.consume(buffered);
    reader
        .into_inner()
        .into_inner()
        .read_exact(&mut body[buffered..])
        .map_err(|e| ApiError::bad_request(format!("the body was cut short: {e}")))?;
    request.body = body;
    Ok(request)
}

/// The body's length as the header announces it, refused before a byte of it is read when
/// it is larger than `max_body` or comes in chunks.
fn body_length(request: &HttpRequest, max_body: usize) -> Result<usize, ApiError> {
    if request.header("transfer-encoding").next().is_some() {
        return Err(ApiError::new(411, "send the body with a Content-Length"));
    }
    let Some(value) = request.header("content-length").last() else {
        return Ok(0);
    };
    let n: u64 = value
        .parse()
        .map_err(|_| ApiError::bad_request(format!("bad Content-Length '{value}'")))?;
    if n > max_body as u64 {
        return Err(ApiError::new(
            413,
            format!(
                "a body of {n} bytes is larger than the {} allowed here",
                Bytes(max_body)
            ),
        ));
    }
    Ok(n as usize)
}

/// A byte count as people write it.
struct Bytes(usize);

impl std::fmt::Display for Bytes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0 {
            n if n >= 1 << 20 && n % (1 << 20) == 0 => write!(f, "{} MiB", n >> 20),
            n => write!(f, "{n} bytes"),
        }
    }
}

fn respond(
    conn: &mut UnixStream,
    service: &dyn Service,
    outcome: &Result<Value, ApiError>,
) -> std::io::Result<()> {
    let (status, text) = match outcome {
        Ok(Value::Null) => (204, String::new()),
        Ok(value) => (200, value.to_string()),
        Err(e) => (e.status, service.error_body(e)),
    };
    let reason = match status {
        _ if !service.reason_phrase() => "",
        200 => "OK",
        204 => "No Content",
        400 => "Bad Request",
        403 => "Forbidden",
        404 => "Not Found",
        405 => "Method Not Allowed",
        409 => "Conflict",
        411 => "Length Required",
        413 => "Payload Too Large",
        500 => "Internal Server Error",
        502 => "Bad Gateway",
        503 => "Service Unavailable",
        _ => "Error",
    };
    let head = format!(
        "HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\
         Connection: close\r\n\r\n",
        text.len()
    );
    conn.write_all(head.as_bytes())?;
    conn.write_all(text.as_bytes())?;
    conn.flush()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::os::unix::fs::PermissionsExt;

    struct Echo;
    impl Handler for Echo {
        fn handle(&self, request: ApiRequest) -> Result<Value, ApiError> {
            Ok(serde_json::json!({ "request": format!("{request:?}") }))
        }
    }

    fn ask(path: &Path, raw: &[u8]) -> String {
        let mut c = UnixStream::connect(path).unwrap();
        c.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        c.write_all(raw).unwrap();
        let mut out = String::new();
        let _ = c.read_to_string(&mut out);
        out
    }

    #[test]
    fn limits_hold_and_the_server_lives_on() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("api.sock");
        let _server = ApiServer::start(&path, Arc::new(Echo)).unwrap();
        let mode = std::fs::metadata(&path).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600, "only the owner may connect");

        // A body announced as 100 GB is refused unread, and nothing is allocated for it.
        let huge = ask(
            &path,
            b"PUT /api/v1/vm.pause HTTP/1.1\r\nContent-Length: 99999999999\r\n\r\n",
        );
        assert!(huge.starts_with("HTTP/1.1 413"), "{huge}");
        let chunked = ask(
            &path,
            b"PUT /api/v1/vm.pause HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n",
        );
        assert!(chunked.starts_with("HTTP/1.1 411"), "{chunked}");
        let junk = ask(&path, b"\x16\x03\x01 hello\r\n\r\n");
        assert!(junk.starts_with("HTTP/1.1 400"), "{junk}");

        // Idle clients hold a connection each, and a status query is still answered.
        let idle: Vec<UnixStream> = (0..20)
            .map(|_| UnixStream::connect(&path).unwrap())
            .collect();
        let ok = ask(&path, b"GET /api/v1/vm.info HTTP/1.1\r\nHost: x\r\n\r\n");
        assert!(
            ok.starts_with("HTTP/1.1 200") && ok.contains("VmInfo"),
            "{ok}"
        );
        drop(idle);

        // A body that fits is read whole.
        let body = br#"{"file": "/tmp/x"}"#;
        let req = format!(
            "PUT /api/v1/vm.snapshot HTTP/1.1\r\nContent-Length: {}\r\n\r\n",
            body.len()
        );
        let mut raw = req.into_bytes();
        raw.extend_from_slice(body);
        let ok = ask(&path, &raw);
        assert!(ok.contains("Snapshot"), "{ok}");
    }

    /// A client sending its request a byte every 500 ms (each well inside a timeout per
    /// read) is cut off when its 10 s are up, not served whenever it finishes.
    #[test]
    fn a_trickled_request_has_10_s_in_all() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("api.sock");
        let _server = ApiServer::start(&path, Arc::new(Echo)).unwrap();
        let mut c = UnixStream::connect(&path).unwrap();
        c.set_read_timeout(Some(Duration::from_secs(40))).unwrap();
        let mut writer = c.try_clone().unwrap();
        let start = Instant::now();
        let trickler = std::thread::spawn(move || {
            for b in b"GET /api/v1/vm.info HTTP/1.1\r\nHost: x\r\n\r\n" {
                if writer.write_all(&[*b]).is_err() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(500));
            }
        });
        let mut out = String::new();
        let _ = c.read_to_string(&mut out);
        let took = start.elapsed();
        assert!(out.starts_with("HTTP/1.1 400"), "{out}");
        assert!(took < Duration::from_secs(15), "answered after {took:?}");
        drop(c);
        trickler.join().unwrap();
    }

    #[test]
    fn a_file_at_the_socket_path_is_left_alone() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("api.sock");
        std::fs::write(&path, b"precious").unwrap();
        let e = ApiServer::start(&path, Arc::new(Echo))
            .err()
            .expect("refused");
        assert!(e.to_string().contains("not a socket"), "{e}");
        assert_eq!(std::fs::read(&path).unwrap(), b"precious");
    }
}
