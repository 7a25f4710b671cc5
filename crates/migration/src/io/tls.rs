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
use std::time::{Duration, Instant};

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::server::WebPkiClientVerifier;
use rustls::{
    ClientConfig, ClientConnection, Connection, RootCertStore, ServerConfig, ServerConnection,
};
use sockets::deadline::Within;

use crate::error::{Error, Result};

/// How long a connecting side's TLS handshake may take in all before the peer counts as
/// silent.
const HANDSHAKE_WAIT: Duration = Duration::from_secs(10);
/// How long the pump goes on sending what is queued for the network once the engine has
/// closed its end: a peer that stopped reading must not keep the pump (and its sockets) alive.
const LINGER: Duration = Duration::from_secs(2);
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
    /// The handshake has `HANDSHAKE_WAIT` in all.
    pub fn connect(&self, tcp: TcpStream, host: &str) -> Result<Secured> {
        let name = ServerName::try_from(host.to_string()).map_err(|e| {
            Error::Param(format!(
                "'{host}' cannot be checked against a certificate: {e}"
            ))
        })?;
        let conn = ClientConnection::new(self.client.clone(), name)
            .map_err(|e| Error::Protocol(format!("TLS: {e}")))?;
        secure(tcp, conn.into(), Instant::now() + HANDSHAKE_WAIT)
    }

    /// Opens TLS as the listening side; the source must present a certificate of our CA
    /// and finish the handshake by `deadline`.
    pub fn accept(&self, tcp: TcpStream, deadline: Instant) -> Result<Secured> {
        let conn = ServerConnection::new(self.server.clone())
            .map_err(|e| Error::Protocol(format!("TLS: {e}")))?;
        secure(tcp, conn.into(), deadline)
    }
}

/// A TLS connection as the engine uses it: plaintext on `app`, ciphertext on `wire`, and the
/// certificate the peer presented (DER), which names who it is.
pub struct Secured {
    pub app: UnixStream,
    pub wire: Arc<TcpStream>,
    pub peer: Arc<[u8]>,
}

fn secure(mut tcp: TcpStream, mut conn: Connection, deadline: Instant) -> Result<Secured> {
    let tls_err = |e: std::io::Error| Error::transport("TLS handshake", e);
    while conn.is_handshaking() {
        conn.complete_io(&mut Within::new(&mut tcp, deadline))
            .map_err(tls_err)?;
    }
    let peer: Arc<[u8]> = conn
        .peer_certificates()
        .and_then(|chain| chain.first())
        .map(|cert| cert.as_ref().into())
        .ok_or_else(|| Error::Protocol("TLS: the peer presented no certificate".into()))?;
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
    Ok(Secured { app, wire, peer })
}

/// Moves plaintext between the engine's socket and the TLS connection, and ciphertext between
/// the TLS connection and the network, until both directions have ended, or the engine has
/// closed its end (then it sends what is queued, for at most `LINGER`, and never waits for
/// the peer: a silent peer must not keep the pump and its sockets alive).
fn pump(conn: Connection, tcp: &TcpStream, app: UnixStream) -> std::io::Result<()> {
    tcp.set_read_timeout(None)?;
    tcp.set_write_timeout(None)?;
    tcp.set_nonblocking(true)?;
    app.set_nonblocking(true)?;
    let mut p = Pump {
        conn,
        net: tcp,
        app,
        inbound: Vec::with_capacity(PUMP_BUFFER),
        peer_done: false,
        app_done: false,
        hung_up: None,
    };
    // Plaintext is taken from the engine only when the ciphertext queue is empty, so the
    // queue stays near one chunk; rustls need not bound it.
    p.conn.set_buffer_limit(None);
    // The handshake may have read the peer's first records with its last flight: they are
    // decrypted now, or they would wait for more bytes from the network that may never come.
    p.peer_done = take_plaintext(&mut p.conn, &mut p.inbound)?;
    let mut chunk = vec![0u8; 64 * 1024];
    loop {
        p.engine_to_tls(&mut chunk)?;
        p.tls_to_network()?;
        p.network_to_engine()?;
        if p.finished() {
            let _ = p.net.shutdown(std::net::Shutdown::Write);
            return Ok(());
        }
        p.wait();
    }
}

struct Pump<'a> {
    conn: Connection,
    net: &'a TcpStream,
    app: UnixStream,
    /// Plaintext received from the peer, not yet taken by the engine.
    inbound: Vec<u8>,
    /// The peer closed its direction.
    peer_done: bool,
    /// The engine closed its sending direction.
    app_done: bool,
    /// When the engine closed its end both ways (dropped it).
    hung_up: Option<Instant>,
}

impl Pump<'_> {
    /// Engine → TLS (only while the ciphertext queue is empty).
    fn engine_to_tls(&mut self, chunk: &mut [u8]) -> std::io::Result<()> {
        if self.app_done || self.conn.wants_write() {
            return Ok(());
        }
        match self.app.read(chunk) {
            Ok(0) => {
                self.app_done = true;
                self.conn.send_close_notify();
            }
            Ok(n) => self.conn.writer().write_all(&chunk[..n])?,
            Err(e) if e.kind() == ErrorKind::WouldBlock => {}
            Err(e) => return Err(e),
        }
        Ok(())
    }

    /// TLS → network.
    fn tls_to_network(&mut self) -> std::io::Result<()> {
        while self.conn.wants_write() {
            match self.conn.write_tls(&mut self.net) {
                Ok(_) => {}
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// Network → TLS → plaintext for the engine (only while the engine keeps up, and not
    /// once it is gone).
    fn network_to_engine(&mut self) -> std::io::Result<()> {
        if self.reads_network() {
            match self.conn.read_tls(&mut self.net) {
                Ok(0) => self.peer_done = true,
                Ok(_) => self.peer_done = take_plaintext(&mut self.conn, &mut self.inbound)?,
                Err(e) if e.kind() == ErrorKind::WouldBlock => {}
                Err(e) => return Err(e),
            }
        }
        if self.hung_up.is_some() {
            self.inbound.clear();
        }
        if !self.inbound.is_empty() {
            match self.app.write(&self.inbound) {
                Ok(n) => {
                    self.inbound.drain(..n);
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => {}
                Err(e) => return Err(e),
            }
        }
        if self.peer_done && self.inbound.is_empty() {
            let _ = self.app.shutdown(std::net::Shutdown::Write);
        }
        Ok(())
    }

    fn reads_network(&self) -> bool {
        !self.peer_done && self.hung_up.is_none() && self.inbound.len() < PUMP_BUFFER
    }

    fn finished(&self) -> bool {
        let flushed = !self.conn.wants_write();
        match self.hung_up {
            Some(at) => (self.app_done && flushed) || at.elapsed() >= LINGER,
            None => self.peer_done && self.app_done && flushed && self.inbound.is_empty(),
        }
    }

    /// Sleeps until one of the sockets can move data the pump wants to move, and notes when
    /// the engine's end is closed both ways.
    fn wait(&mut self) {
        let mut net_events = 0;
        if self.conn.wants_write() {
            net_events |= libc::POLLOUT;
        }
        if self.reads_network() {
            net_events |= libc::POLLIN;
        }
        let mut app_events = 0;
        if !self.inbound.is_empty() {
            app_events |= libc::POLLOUT;
        }
        if !self.app_done && !self.conn.wants_write() {
            app_events |= libc::POLLIN;
        }
        let mut fds = [
            libc::pollfd {
                fd: self.net.as_raw_fd(),
                events: net_events,
                revents: 0,
            },
            libc::pollfd {
                // Once hung up, the engine's end would report it on every poll.
                fd: if self.hung_up.is_some() {
                    -1
                } else {
                    self.app.as_raw_fd()
                },
                events: app_events,
                revents: 0,
            },
        ];
        // SAFETY: two pollfds valid for the duration of the call (a negative fd is ignored);
        // a bounded wait so that a state change this loop did not poll for is still seen.
        unsafe { libc::poll(fds.as_mut_ptr(), 2, 100) };
        if fds[1].revents & libc::POLLHUP != 0 {
            self.hung_up = Some(Instant::now());
        }
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
