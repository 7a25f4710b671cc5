//! TCP connections from a chosen local address: a test plays a peer elsewhere on the network
//! (127.0.0.2 while the real peer is 127.0.0.1) to check that ferry tells them apart.

use std::net::{Ipv4Addr, SocketAddrV4, TcpStream};
use std::os::fd::{FromRawFd, OwnedFd};

fn sockaddr(at: SocketAddrV4) -> libc::sockaddr_in {
    libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: at.port().to_be(),
        sin_addr: libc::in_addr {
            s_addr: u32::from_ne_bytes(at.ip().octets()),
        },
        sin_zero: [0; 8],
    }
}

/// A TCP connection to `to`, made from `from` (any free port).
pub fn connect_from(from: Ipv4Addr, to: SocketAddrV4) -> std::io::Result<TcpStream> {
    let len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
    let check = |r: libc::c_int| match r {
        0 => Ok(()),
        _ => Err(std::io::Error::last_os_error()),
    };
    // SAFETY: a plain socket call; the descriptor is owned at once.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `fd` is a fresh descriptor nothing else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    use std::os::fd::AsRawFd;
    let (local, remote) = (sockaddr(SocketAddrV4::new(from, 0)), sockaddr(to));
    // SAFETY: bind and connect read addresses of the length given, which outlive the calls.
    unsafe {
        check(libc::bind(
            fd.as_raw_fd(),
            (&local as *const libc::sockaddr_in).cast(),
            len,
        ))?;
        check(libc::connect(
            fd.as_raw_fd(),
            (&remote as *const libc::sockaddr_in).cast(),
            len,
        ))?;
    }
    Ok(TcpStream::from(fd))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_peer_sees_the_address_it_came_from() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let std::net::SocketAddr::V4(at) = listener.local_addr().unwrap() else {
            panic!("an IPv4 listener")
        };
        let _conn = connect_from(Ipv4Addr::new(127, 0, 0, 2), at).unwrap();
        let (_, from) = listener.accept().unwrap();
        assert_eq!(from.ip(), Ipv4Addr::new(127, 0, 0, 2));
    }
}
