//! Unix socket files: bound so that only this user can connect (whatever the umask), and
//! cleared when a process that died left one behind.

use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

/// Removes `path` if it is a socket nobody answers on (left by a process that died); refuses
/// anything else that is there, and never deletes a file that is not a socket.
pub fn remove_stale_socket(path: &Path) -> std::io::Result<()> {
    match std::fs::symlink_metadata(path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e),
        Ok(m) if !m.file_type().is_socket() => Err(std::io::Error::new(
            std::io::ErrorKind::AlreadyExists,
            "the path exists and is not a socket (left untouched)",
        )),
        Ok(_) if UnixStream::connect(path).is_ok() => Err(std::io::Error::new(
            std::io::ErrorKind::AddrInUse,
            "is in use by another process",
        )),
        Ok(_) => std::fs::remove_file(path),
    }
}

/// Binds `path` with mode 0600 so that no one else can connect even for a moment: the socket
/// is made in a private directory beside it (0700), set to 0600, then moved into place. A
/// umask cannot widen it, as `bind` alone would let it.
pub fn bind_private(path: &Path) -> std::io::Result<UnixListener> {
    // Each bind gets its own directory: several may run at once in one process.
    static BINDS: AtomicU64 = AtomicU64::new(0);
    let parent = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let n = BINDS.fetch_add(1, Ordering::Relaxed);
    let private = parent.join(format!(".ferry-sock-{}-{n}", std::process::id()));
    std::fs::create_dir(&private)?;
    let result = (|| {
        std::fs::set_permissions(&private, std::fs::Permissions::from_mode(0o700))?;
        let temp = private.join("s.sock");
        let listener = UnixListener::bind(&temp)?;
        std::fs::set_permissions(&temp, std::fs::Permissions::from_mode(0o600))?;
        std::fs::rename(&temp, path)?;
        Ok(listener)
    })();
    let _ = std::fs::remove_dir_all(&private);
    result.map_err(|e: std::io::Error| {
        std::io::Error::new(
            e.kind(),
            format!("cannot listen on {}: {e}", path.display()),
        )
    })
}
