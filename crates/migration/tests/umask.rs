//! Migration and resume sockets are the owner's only, whatever the umask: anyone who can
//! connect to a destination's `unix:` socket can send it a VM. A test binary of its own, since
//! the umask is the whole process's.

use std::os::unix::fs::PermissionsExt;

use migration::Endpoint;

#[test]
fn unix_listeners_are_0600_under_umask_000() {
    // SAFETY: umask only swaps the process's file-creation mask; nothing else runs here.
    let before = unsafe { libc::umask(0) };
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.sock");
    let endpoint: Endpoint = format!("unix:{}", path.display()).parse().unwrap();
    let listener = endpoint.listen(None).unwrap();
    let mode = std::fs::metadata(&path).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o600, "only the owner may connect");
    let leftovers: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    assert_eq!(leftovers, ["m.sock"], "nothing left beside the socket");
    drop(listener);
    // SAFETY: as above.
    unsafe { libc::umask(before) };
}
