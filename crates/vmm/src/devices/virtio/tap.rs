//! A tap device, opened by name. Written by hand: attaching to a tap is one ioctl on
//! `/dev/net/tun`, and none of the rust-vmm crates ferry uses offers it (Cloud Hypervisor's
//! `net_util` is not published on its own).
//!
//! The tap must exist (`ip tuntap add NAME mode tap`): ferry attaches to what the host's
//! network set up, and a typo in its name is an error, not a new interface nobody bridged.

use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::OpenOptionsExt;

const IFF_TAP: libc::c_short = 0x0002;
const IFF_NO_PI: libc::c_short = 0x1000;
const TUNSETIFF: libc::c_ulong = 0x4004_54ca;
const TUNGETIFF: libc::c_ulong = 0x8004_54d2;

#[repr(C)]
struct IfReq {
    name: [u8; libc::IFNAMSIZ],
    flags: libc::c_short,
    _pad: [u8; 22],
}

pub struct Tap {
    file: File,
    name: String,
}

impl Tap {
    pub fn open(name: &str) -> Result<Self, String> {
        if name.is_empty() || name.len() >= libc::IFNAMSIZ || name.contains('/') {
            return Err(format!("'{name}' is not an interface name"));
        }
        let flags =
            std::fs::read_to_string(format!("/sys/class/net/{name}/tun_flags")).map_err(|_| {
                format!("there is no tap device '{name}' (ip tuntap add {name} mode tap)")
            })?;
        let flags = i64::from_str_radix(flags.trim().trim_start_matches("0x"), 16).unwrap_or(0);
        if flags & i64::from(IFF_TAP) == 0 {
            return Err(format!("'{name}' is a tun device, not a tap"));
        }
        Self::attach(name)
    }

    /// Attaches to tap `name`, which the kernel makes (gone again with this handle) if there
    /// is none: for device tests.
    #[cfg(test)]
    pub fn transient(name: &str) -> Result<Self, String> {
        Self::attach(name)
    }

    fn attach(name: &str) -> Result<Self, String> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC)
            .open("/dev/net/tun")
            .map_err(|e| format!("cannot open /dev/net/tun: {e}"))?;
        let mut req = IfReq {
            name: [0; libc::IFNAMSIZ],
            flags: IFF_TAP | IFF_NO_PI,
            _pad: [0; 22],
        };
        req.name[..name.len()].copy_from_slice(name.as_bytes());
        // SAFETY: TUNSETIFF reads and writes an ifreq, which `req` is, alive for the call.
        if unsafe { libc::ioctl(file.as_raw_fd(), TUNSETIFF, &mut req) } != 0 {
            return Err(format!(
                "cannot attach to tap '{name}': {}",
                std::io::Error::last_os_error()
            ));
        }
        Ok(Self {
            file,
            name: name.to_string(),
        })
    }

    /// A tap already attached (passed by a live update or a client): checks that `file` is
    /// attached to tap `name`, as the VM's NIC says it is, and makes it non-blocking (the
    /// device's thread must never wait on it).
    pub fn from_file(file: File, name: &str) -> Result<Self, String> {
        let attached = Self::name_of(&file)
            .map_err(|e| format!("the file passed for tap '{name}' is not a tap: {e}"))?;
        if attached != name {
            return Err(format!(
                "the file passed for tap '{name}' is attached to '{attached}'"
            ));
        }
        // SAFETY: F_GETFL/F_SETFL on a descriptor `file` owns.
        let nonblocking = unsafe {
            let flags = libc::fcntl(file.as_raw_fd(), libc::F_GETFL);
            flags >= 0
                && libc::fcntl(file.as_raw_fd(), libc::F_SETFL, flags | libc::O_NONBLOCK) == 0
        };
        if !nonblocking {
            return Err(format!(
                "tap '{name}': cannot make its file non-blocking: {}",
                std::io::Error::last_os_error()
            ));
        }
        Ok(Self {
            file,
            name: name.to_string(),
        })
    }

    /// The tap an open tap file is attached to.
    pub fn name_of(file: &File) -> std::io::Result<String> {
        let mut req = IfReq {
            name: [0; libc::IFNAMSIZ],
            flags: 0,
            _pad: [0; 22],
        };
        // SAFETY: TUNGETIFF writes an ifreq, which `req` is, alive for the call.
        if unsafe { libc::ioctl(file.as_raw_fd(), TUNGETIFF, &mut req) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        let len = req
            .name
            .iter()
            .position(|&b| b == 0)
            .unwrap_or(req.name.len());
        Ok(String::from_utf8_lossy(&req.name[..len]).into_owned())
    }

    /// Another handle on the same tap (a second attach would be refused as busy).
    pub fn try_clone(&self) -> std::io::Result<Self> {
        Ok(Self {
            file: self.file.try_clone()?,
            name: self.name.clone(),
        })
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn fd(&self) -> RawFd {
        self.file.as_raw_fd()
    }

    /// One frame into `buf`; `Ok(None)` when none is waiting.
    pub fn recv(&mut self, buf: &mut [u8]) -> std::io::Result<Option<usize>> {
        match self.file.read(buf) {
            Ok(n) => Ok(Some(n)),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Sends one frame; false when the tap's queue is full (the frame is dropped, as a
    /// switch would).
    pub fn send(&mut self, frame: &[u8]) -> std::io::Result<bool> {
        match self.file.write(frame) {
            Ok(_) => Ok(true),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => Ok(false),
            Err(e) => Err(e),
        }
    }
}
