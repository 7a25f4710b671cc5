//! Where the guest's serial port writes in the Cloud Hypervisor profile: nowhere, this
//! process's standard output, a file, a pseudo-terminal (`Pty`: libvirt's `<console
//! type='pty'>`, opened with `virsh console`) or a Unix socket ferry listens on (`Socket`).
//! ferry's serial port is output only: what a client types is not read. A port that nobody
//! reads never stalls the guest: what does not fit is dropped.

use std::fs::File;
use std::io::Write;
use std::os::fd::FromRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Mutex};

use api::ApiError;
use api::ch::ConsoleMode;
use migration::sync::Locked;

use crate::run;

/// An open serial port: a writer the VM can be given again (a reboot keeps the pty), and
/// the pty's path.
pub struct Port {
    out: Arc<Mutex<Box<dyn Write + Send>>>,
    pub pty: Option<String>,
}

impl Port {
    /// Opens each place in `modes` the guest's output goes (none: it is dropped).
    pub fn open(modes: &[&ConsoleMode]) -> Result<Self, ApiError> {
        let mut outs = Vec::new();
        let mut pty = None;
        for mode in modes {
            let (out, path) = open_one(mode)?;
            outs.push(out);
            pty = pty.or(path);
        }
        let out: Box<dyn Write + Send> = match outs.len() {
            1 => outs.remove(0),
            _ => Box::new(Tee(outs)),
        };
        Ok(Self {
            out: Arc::new(Mutex::new(out)),
            pty,
        })
    }

    /// A writer for the VM's serial port.
    pub fn writer(&self) -> Box<dyn Write + Send> {
        Box::new(Shared(self.out.clone()))
    }
}

/// Where `mode` sends the guest's output, and a pty's path.
fn open_one(mode: &ConsoleMode) -> Result<(Box<dyn Write + Send>, Option<String>), ApiError> {
    let failed = |what: &str, e: std::io::Error| {
        ApiError::internal(format!("the VM's serial port: {what}: {e}"))
    };
    Ok(match mode {
        ConsoleMode::Off => (Box::new(std::io::sink()), None),
        ConsoleMode::Tty => (open_file("stdout")?, None),
        ConsoleMode::File(f) => (open_file(f)?, None),
        ConsoleMode::Pty(_) => {
            let (master, slave, path) = open_pty().map_err(|e| failed("a pty", e))?;
            (
                Box::new(Dropping::Pty {
                    master,
                    _slave: slave,
                }),
                Some(path),
            )
        }
        ConsoleMode::Socket(path) => {
            let clients = listen(path).map_err(|e| failed(path, e))?;
            (Box::new(Dropping::Clients(clients)), None)
        }
    })
}

/// The same bytes to each.
struct Tee(Vec<Box<dyn Write + Send>>);

impl Write for Tee {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        // One place that fails does not keep the output from the others.
        for out in &mut self.0 {
            let _ = out.write_all(buf);
        }
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.0.iter_mut().try_for_each(|o| o.flush())
    }
}

fn open_file(target: &str) -> Result<Box<dyn Write + Send>, ApiError> {
    run::open_serial(target).map_err(|e| ApiError::internal(format!("{e:#}")))
}

struct Shared(Arc<Mutex<Box<dyn Write + Send>>>);

impl Write for Shared {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.locked().write(buf)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.0.locked().flush()
    }
}

/// A port whose readers may be absent or slow: what they cannot take now is dropped.
enum Dropping {
    /// The pty's master; its slave is held open here too, so that the master never sees a
    /// hang-up when a client closes it.
    Pty { master: File, _slave: File },
    /// The clients connected to the socket.
    Clients(Arc<Mutex<Vec<UnixStream>>>),
}

impl Write for Dropping {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        match self {
            Dropping::Pty { master, .. } => {
                let _ = master.write(buf);
            }
            Dropping::Clients(clients) => {
                // A client that hung up or cannot keep up is let go.
                clients.locked().retain_mut(|c| c.write_all(buf).is_ok());
            }
        }
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// A new pseudo-terminal in raw mode (no echo, no line editing: the guest's bytes as they
/// are), its master non-blocking: its master, its slave and the slave's path.
fn open_pty() -> std::io::Result<(File, File, String)> {
    let err = std::io::Error::last_os_error;
    // SAFETY: posix_openpt returns a new descriptor or -1.
    let fd = unsafe { libc::posix_openpt(libc::O_RDWR | libc::O_NOCTTY | libc::O_CLOEXEC) };
    if fd < 0 {
        return Err(err());
    }
    // SAFETY: a fresh descriptor this function owns.
    let master = unsafe { File::from_raw_fd(fd) };
    let mut name = [0 as libc::c_char; 64];
    // SAFETY: calls on the master just opened; ptsname_r writes at most `name.len()` bytes.
    unsafe {
        if libc::grantpt(fd) != 0
            || libc::unlockpt(fd) != 0
            || libc::ptsname_r(fd, name.as_mut_ptr(), name.len()) != 0
        {
            return Err(err());
        }
        let mut t: libc::termios = std::mem::zeroed();
        if libc::tcgetattr(fd, &mut t) != 0 {
            return Err(err());
        }
        libc::cfmakeraw(&mut t);
        if libc::tcsetattr(fd, libc::TCSANOW, &t) != 0
            || libc::fcntl(fd, libc::F_SETFL, libc::O_NONBLOCK) != 0
        {
            return Err(err());
        }
    }
    // SAFETY: ptsname_r wrote a NUL-terminated path into `name`.
    let path = unsafe { std::ffi::CStr::from_ptr(name.as_ptr()) }
        .to_string_lossy()
        .into_owned();
    let slave = File::options()
        .read(true)
        .write(true)
        .custom_flags(libc::O_NOCTTY)
        .open(&path)?;
    Ok((master, slave, path))
}

/// Listens on `path` (0600, as CH's socket console); the clients connected so far.
fn listen(path: &str) -> std::io::Result<Arc<Mutex<Vec<UnixStream>>>> {
    let path = std::path::Path::new(path);
    sockets::unix::remove_stale_socket(path)?;
    let listener = sockets::unix::bind_private(path)?;
    let clients = Arc::new(Mutex::new(Vec::new()));
    let kept = clients.clone();
    std::thread::Builder::new()
        .name("serial-socket".into())
        .spawn(move || {
            for conn in listener.incoming().flatten() {
                if conn.set_nonblocking(true).is_ok() {
                    kept.locked().push(conn);
                }
            }
        })?;
    Ok(clients)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;

    #[test]
    fn a_pty_carries_the_guest_bytes_and_never_blocks() {
        let port = Port::open(&[&ConsoleMode::Pty(None)]).unwrap();
        let path = port.pty.clone().unwrap();
        assert!(path.starts_with("/dev/pts/"), "{path}");
        let mut reader = File::options()
            .read(true)
            .custom_flags(libc::O_NOCTTY)
            .open(&path)
            .unwrap();
        let mut out = port.writer();
        out.write_all(b"ok\r\n").unwrap();
        let mut got = [0u8; 4];
        reader.read_exact(&mut got).unwrap();
        assert_eq!(&got, b"ok\r\n", "raw: nothing added or echoed");
        // Nobody reads: 1 MiB goes without blocking, the rest dropped.
        drop(reader);
        for _ in 0..256 {
            out.write_all(&[b'x'; 4096]).unwrap();
        }
    }

    #[test]
    fn a_socket_port_writes_to_its_clients() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("serial.sock");
        let port = Port::open(&[&ConsoleMode::Socket(path.display().to_string())]).unwrap();
        let mut client = UnixStream::connect(&path).unwrap();
        let mut out = port.writer();
        // The client is taken on by the listener's thread: write until it gets a byte.
        client
            .set_read_timeout(Some(std::time::Duration::from_millis(20)))
            .unwrap();
        let mut got = [0u8; 1];
        let mut tries = 0;
        while client.read_exact(&mut got).is_err() {
            tries += 1;
            assert!(tries < 500, "the socket's client never got a byte");
            out.write_all(b"s").unwrap();
        }
        assert_eq!(&got, b"s");
    }
}
