//! Files a client passes over a Unix socket with its bytes (`SCM_RIGHTS`): Cloud
//! Hypervisor's `vm.add-net` takes a tap's open file this way, which is how libvirt gives a
//! VMM the NICs it made. Written by hand over `recvmsg`: this crate depends on `libc` alone.

use std::io::IoSlice;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::sync::Arc;

/// A passed file, shared by whatever holds the config it belongs to; two are equal when they
/// are the same file.
#[derive(Clone, Debug)]
pub struct PassedFd(Arc<OwnedFd>);

impl PassedFd {
    pub fn new(fd: OwnedFd) -> Self {
        Self(Arc::new(fd))
    }

    /// A new descriptor of the same file, for whoever uses it.
    pub fn try_clone_file(&self) -> std::io::Result<std::fs::File> {
        Ok(std::fs::File::from(self.0.try_clone()?))
    }
}

impl PartialEq for PassedFd {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

impl Eq for PassedFd {}

/// Reads what `conn` has now into `buf` (one `recvmsg`, within the socket's read timeout),
/// and the files passed with those bytes, at most `max`: a client that passes more has all
/// of them closed and is refused.
pub fn recv_with_files(
    conn: &UnixStream,
    buf: &mut [u8],
    max: usize,
) -> std::io::Result<(usize, Vec<OwnedFd>)> {
    let room = max * std::mem::size_of::<libc::c_int>();
    // SAFETY: CMSG_SPACE computes a size from a length.
    let space = unsafe { libc::CMSG_SPACE(room as u32) } as usize;
    let mut control = vec![0u64; space.div_ceil(8)];
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    // SAFETY: a zeroed msghdr is valid; its pointers are set to buffers alive for the call.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = space;
    // SAFETY: `msg` points at `iov` (into `buf`) and `control`, both alive for the call.
    let n = unsafe { libc::recvmsg(conn.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
    if n < 0 {
        return Err(std::io::Error::last_os_error());
    }
    let files = take_files(&msg);
    if msg.msg_flags & libc::MSG_CTRUNC != 0 {
        return Err(std::io::Error::other(format!(
            "more than {max} files passed with one request"
        )));
    }
    Ok((n as usize, files))
}

/// Sends `bytes` with `fds` in one `sendmsg`, as libvirt sends a request with its taps.
pub fn send_with_files(conn: &UnixStream, bytes: &[u8], fds: &[RawFd]) -> std::io::Result<()> {
    let room = std::mem::size_of_val(fds);
    // SAFETY: as in `recv_with_files`: sizes from lengths, buffers alive for the call; the
    // control buffer has room for one header and `fds`.
    let sent = unsafe {
        let space = libc::CMSG_SPACE(room as u32) as usize;
        let mut control = vec![0u64; space.div_ceil(8)];
        let iov = IoSlice::new(bytes);
        let mut msg: libc::msghdr = std::mem::zeroed();
        msg.msg_iov = (&iov as *const IoSlice).cast_mut().cast();
        msg.msg_iovlen = 1;
        msg.msg_control = control.as_mut_ptr().cast();
        msg.msg_controllen = space;
        let cmsg = libc::CMSG_FIRSTHDR(&msg);
        (*cmsg).cmsg_level = libc::SOL_SOCKET;
        (*cmsg).cmsg_type = libc::SCM_RIGHTS;
        (*cmsg).cmsg_len = libc::CMSG_LEN(room as u32) as usize;
        std::ptr::copy_nonoverlapping(fds.as_ptr(), libc::CMSG_DATA(cmsg).cast(), fds.len());
        libc::sendmsg(conn.as_raw_fd(), &msg, 0)
    };
    match sent {
        n if n < 0 => Err(std::io::Error::last_os_error()),
        n if n as usize != bytes.len() => Err(std::io::Error::other("a short send")),
        _ => Ok(()),
    }
}

/// The descriptors in `msg`'s `SCM_RIGHTS` messages, owned.
fn take_files(msg: &libc::msghdr) -> Vec<OwnedFd> {
    let mut files = Vec::new();
    // SAFETY: the CMSG_* walk stays inside the control buffer `recvmsg` filled, and each
    // SCM_RIGHTS message holds descriptors the kernel just gave this process.
    unsafe {
        let mut cmsg = libc::CMSG_FIRSTHDR(msg);
        while !cmsg.is_null() {
            if (*cmsg).cmsg_level == libc::SOL_SOCKET && (*cmsg).cmsg_type == libc::SCM_RIGHTS {
                let data = libc::CMSG_DATA(cmsg).cast::<libc::c_int>();
                let bytes = (*cmsg).cmsg_len as usize - libc::CMSG_LEN(0) as usize;
                for i in 0..bytes / std::mem::size_of::<libc::c_int>() {
                    files.push(OwnedFd::from_raw_fd(data.add(i).read_unaligned()));
                }
            }
            cmsg = libc::CMSG_NXTHDR(msg, cmsg);
        }
    }
    files
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn files_come_with_the_bytes_they_were_sent_with() {
        let (a, b) = UnixStream::pair().unwrap();
        let file = std::fs::File::open("/dev/null").unwrap();
        send_with_files(&a, b"PUT", &[file.as_raw_fd(), file.as_raw_fd()]).unwrap();
        let mut buf = [0u8; 16];
        let (n, files) = recv_with_files(&b, &mut buf, 4).unwrap();
        assert_eq!((&buf[..n], files.len()), (&b"PUT"[..], 2));
        let passed = PassedFd::new(files.into_iter().next().unwrap());
        assert_eq!(passed.clone(), passed);
        assert!(passed.try_clone_file().unwrap().metadata().is_ok());
        // More than allowed: refused, and none kept.
        send_with_files(&a, b"x", &[file.as_raw_fd(); 3]).unwrap();
        let e = recv_with_files(&b, &mut buf, 2).unwrap_err();
        assert!(e.to_string().contains("more than 2 files"), "{e}");
        // No file at all: the bytes alone.
        std::io::Write::write_all(&mut &a, b"GET").unwrap();
        let (n, files) = recv_with_files(&b, &mut buf, 2).unwrap();
        assert_eq!((n, files.len()), (3, 0));
    }
}
