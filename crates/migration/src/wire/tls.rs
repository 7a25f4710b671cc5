//! TLS 1.3 with mutual authentication (rustls) for migration connections.
//!
//! Both hosts hold a certificate signed by a CA they both trust; each checks the other's, so
//! only a holder of such a certificate can send a VM to a destination, and the guest's memory
//! is encrypted on the wire.
//!
//! The engine reads on one thread while it writes on another (post-copy: pages out, requests
//! in), and a rustls connection is one object that needs `&mut` for both. Where the kernel
//! offers TLS (kTLS) the socket itself would do it; this kernel does not (no `tls` ULP), so a
//! pump thread owns the TLS connection and the TCP socket and moves plaintext to and from a
//! local socket pair, whose other end the engine uses like any stream (cloneable, full duplex).

use std::io::{ErrorKind, Read, Write};
use std::net::TcpStream;
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::server::WebPkiClientVerifier;
use rustls::{
    ClientConfig, ClientConnection, Connection, RootCertStore, ServerConfig, ServerConnection,
};

use crate::error::{Error, Result};

/// How long a TLS handshake may take before the peer counts as silent.
const HANDSHAKE_WAIT: Duration = Duration::from_secs(10);
/// Plaintext the pump holds for the engine before it stops reading the network.
const PUMP_BUFFER: usize = 1 << 20;

/// Where this host's credentials are (PEM files).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TlsFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
    pub ca: PathBuf,
}

/// This host's TLS identity and the CA it trusts, ready for both directions.
#[derive(Clone)]
pub struct Tls {
    client: Arc<ClientConfig>,
    server: Arc<ServerConfig>,
}

impl std::fmt::Debug for Tls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Tls")
    }
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn bad(what: &str, path: &Path, e: impl std::fmt::Display) -> Error {
    Error::Param(format!("TLS {what} {}: {e}", path.display()))
}

impl Tls {
    /// Loads the certificate chain, its key and the CA from PEM files.
    pub fn load(files: &TlsFiles) -> Result<Self> {
        let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(&files.cert)
            .and_then(|i| i.collect())
            .map_err(|e| bad("certificate", &files.cert, e))?;
        if certs.is_empty() {
            return Err(bad(
                "certificate",
                &files.cert,
                "no certificate in the file",
            ));
        }
        let key =
            PrivateKeyDer::from_pem_file(&files.key).map_err(|e| bad("key", &files.key, e))?;
        let mut roots = RootCertStore::empty();
        let cas: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(&files.ca)
            .and_then(|i| i.collect())
            .map_err(|e| bad("CA", &files.ca, e))?;
        for ca in cas {
            roots.add(ca).map_err(|e| bad("CA", &files.ca, e))?;
        }
        if roots.is_empty() {
            return Err(bad("CA", &files.ca, "no certificate in the file"));
        }
        let roots = Arc::new(roots);
        let versions = &[&rustls::version::TLS13];
        let client = ClientConfig::builder_with_provider(provider())
            .with_protocol_versions(versions)
            .map_err(|e| Error::Param(format!("TLS: {e}")))?
            .with_root_certificates(roots.clone())
            .with_client_auth_cert(certs.clone(), key.clone_key())
            .map_err(|e| bad("key", &files.key, e))?;
        let verifier = WebPkiClientVerifier::builder_with_provider(roots, provider())
            .build()
            .map_err(|e| bad("CA", &files.ca, e))?;
        let server = ServerConfig::builder_with_provider(provider())
            .with_protocol_versions(versions)
            .map_err(|e| Error::Param(format!("TLS: {e}")))?
            .with_client_cert_verifier(verifier)
            .with_single_cert(certs, key)
            .map_err(|e| bad("key", &files.key, e))?;
        Ok(Self {
            client: Arc::new(client),
            server: Arc::new(server),
        })
    }

    /// Opens TLS as the connecting side; the destination's certificate must name `host`.
    pub fn connect(&self, tcp: TcpStream, host: &str) -> Result<Secured> {
        let name = ServerName::try_from(host.to_string()).map_err(|e| {
            Error::Param(format!(
                "'{host}' cannot be checked against a certificate: {e}"
            ))
        })?;
        let conn = ClientConnection::new(self.client.clone(), name)
            .map_err(|e| Error::Protocol(format!("TLS: {e}")))?;
        secure(tcp, conn.into())
    }

    /// Opens TLS as the listening side; the source must present a certificate of our CA.
    pub fn accept(&self, tcp: TcpStream) -> Result<Secured> {
        let conn = ServerConnection::new(self.server.clone())
            .map_err(|e| Error::Protocol(format!("TLS: {e}")))?;
        secure(tcp, conn.into())
    }
}

/// A TLS connection as the engine uses it: plaintext on `app`, ciphertext on `wire`.
pub struct Secured {
    pub app: UnixStream,
    pub wire: Arc<TcpStream>,
}

fn secure(mut tcp: TcpStream, mut conn: Connection) -> Result<Secured> {
    let tls_err = |e: std::io::Error| Error::transport("TLS handshake", e);
    tcp.set_read_timeout(Some(HANDSHAKE_WAIT))
        .map_err(tls_err)?;
    tcp.set_write_timeout(Some(HANDSHAKE_WAIT))
        .map_err(tls_err)?;
    while conn.is_handshaking() {
        conn.complete_io(&mut tcp).map_err(tls_err)?;
    }
    let (app, pump_end) = UnixStream::pair().map_err(|e| Error::transport("TLS pump", e))?;
    let wire = Arc::new(tcp);
    let pump_wire = wire.clone();
    std::thread::Builder::new()
        .name("tls-pump".into())
        .spawn(move || {
            if let Err(e) = pump(conn, &pump_wire, pump_end) {
                tracing::debug!("TLS connection ended: {e}");
            }
        })
        .map_err(|e| Error::transport("TLS pump", e))?;
    Ok(Secured { app, wire })
}

/// Moves plaintext between the engine's socket and the TLS connection, and ciphertext between
/// the TLS connection and the network, until both directions have ended.
fn pump(mut conn: Connection, tcp: &TcpStream, mut app: UnixStream) -> std::io::Result<()> {
    tcp.set_read_timeout(None)?;
    tcp.set_write_timeout(None)?;
    tcp.set_nonblocking(true)?;
    app.set_nonblocking(true)?;
    // Plaintext is taken from the engine only when the ciphertext queue is empty, so the
    // queue stays near one chunk; rustls need not bound it.
    conn.set_buffer_limit(None);
    let mut net = tcp;
    // Plaintext received from the peer, not yet taken by the engine.
    let mut inbound: Vec<u8> = Vec::with_capacity(PUMP_BUFFER);
    let mut chunk = vec![0u8; 64 * 1024];
    // The handshake may have read the peer's first records with its last flight: they are
    // decrypted now, or they would wait for more bytes from the network that may never come.
    let mut peer_done = take_plaintext(&mut conn, &mut inbound)?;
    let mut app_done = false;
    loop {
        // Engine → TLS (only while the ciphertext queue is short).
        if !app_done && !conn.wants_write() {
            match app.read(&mut chunk) {
                Ok(0) => {
                    app_done = true;
                    conn.send_close_notify();
                }
                Ok(n) => conn.writer().write_all(&chunk[..n])?,
                Err(e) if e.kind() == ErrorKind::WouldBlock => {}
                Err(e) => return Err(e),
            }
        }
        // TLS → network.
        while conn.wants_write() {
            match conn.write_tls(&mut net) {
                Ok(_) => {}
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(e) => return Err(e),
            }
        }
        // Network → TLS → plaintext for the engine (only while the engine keeps up).
        if !peer_done && inbound.len() < PUMP_BUFFER {
            match conn.read_tls(&mut net) {
                Ok(0) => peer_done = true,
                Ok(_) => peer_done = take_plaintext(&mut conn, &mut inbound)?,
                Err(e) if e.kind() == ErrorKind::WouldBlock => {}
                Err(e) => return Err(e),
            }
        }
        if !inbound.is_empty() {
            match app.write(&inbound) {
                Ok(n) => {
                    inbound.drain(..n);
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => {}
                Err(e) => return Err(e),
            }
        }
        if peer_done && inbound.is_empty() {
            let _ = app.shutdown(std::net::Shutdown::Write);
        }
        if peer_done && app_done && !conn.wants_write() && inbound.is_empty() {
            let _ = net.shutdown(std::net::Shutdown::Write);
            return Ok(());
        }
        wait(&conn, net, &app, &inbound, peer_done, app_done);
    }
}

/// Decrypts what the connection has received into `inbound`; whether the peer has closed.
fn take_plaintext(conn: &mut Connection, inbound: &mut Vec<u8>) -> std::io::Result<bool> {
    let state = conn
        .process_new_packets()
        .map_err(|e| std::io::Error::new(ErrorKind::InvalidData, e))?;
    let n = state.plaintext_bytes_to_read();
    let start = inbound.len();
    inbound.resize(start + n, 0);
    conn.reader().read_exact(&mut inbound[start..])?;
    Ok(state.peer_has_closed())
}

/// Sleeps until one of the pump's sockets can move data it wants to move.
fn wait(
    conn: &Connection,
    net: &TcpStream,
    app: &UnixStream,
    inbound: &[u8],
    peer_done: bool,
    app_done: bool,
) {
    let mut net_events = 0;
    if conn.wants_write() {
        net_events |= libc::POLLOUT;
    }
    if !peer_done && inbound.len() < PUMP_BUFFER {
        net_events |= libc::POLLIN;
    }
    let mut app_events = 0;
    if !inbound.is_empty() {
        app_events |= libc::POLLOUT;
    }
    if !app_done && !conn.wants_write() {
        app_events |= libc::POLLIN;
    }
    let mut fds = [
        libc::pollfd {
            fd: net.as_raw_fd(),
            events: net_events,
            revents: 0,
        },
        libc::pollfd {
            fd: app.as_raw_fd(),
            events: app_events,
            revents: 0,
        },
    ];
    // SAFETY: two valid pollfds for the duration of the call; a bounded wait so that a state
    // change this loop did not poll for is still seen.
    unsafe { libc::poll(fds.as_mut_ptr(), 2, 100) };
}
