//! Guest memory: one mapping per RAM range of the memory map (see `layout`), each mapped
//! lazily so that untouched memory costs nothing (and migration can skip it without reading
//! it).

use std::fmt;
use std::str::FromStr;

use vm_memory::{GuestAddress, GuestMemoryMmap, GuestRegionMmap, MmapRegion};

use crate::error::{Error, Result};
use crate::layout::{MAX_MEMORY, ram_ranges};

pub type GuestMemory = GuestMemoryMmap<()>;

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MemoryBackend {
    /// Private anonymous memory with MAP_NORESERVE.
    #[default]
    Anonymous,
    /// A memfd mapped shared: the memory outlives the mapping (for local migration later).
    Memfd,
}

impl FromStr for MemoryBackend {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "anonymous" | "anon" => Ok(Self::Anonymous),
            "memfd" => Ok(Self::Memfd),
            other => Err(format!(
                "unknown memory backend '{other}' (use anonymous or memfd)"
            )),
        }
    }
}

/// A memory size given by a person: `512M`, `4G`, `1073741824`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemorySize(pub u64);

impl FromStr for MemorySize {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        let s = s.trim();
        let (digits, shift) = match s.char_indices().last() {
            Some((i, 'K' | 'k')) => (&s[..i], 10),
            Some((i, 'M' | 'm')) => (&s[..i], 20),
            Some((i, 'G' | 'g')) => (&s[..i], 30),
            Some((i, 'T' | 't')) => (&s[..i], 40),
            _ => (s, 0),
        };
        let n: u64 = digits
            .parse()
            .map_err(|_| format!("'{s}' is not a size (examples: 512M, 4G)"))?;
        let bytes = n
            .checked_mul(1 << shift)
            .ok_or_else(|| format!("'{s}' is too large"))?;
        if bytes == 0 {
            return Err("memory size must be larger than 0".into());
        }
        Ok(MemorySize(bytes))
    }
}

impl fmt::Display for MemorySize {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let b = self.0;
        if b.is_multiple_of(1 << 30) {
            write!(f, "{}G", b >> 30)
        } else if b.is_multiple_of(1 << 20) {
            write!(f, "{}M", b >> 20)
        } else {
            write!(f, "{b}")
        }
    }
}

pub const MIN_MEMORY: u64 = 16 << 20;

/// Maps `size` bytes of guest memory. Nothing is touched, so nothing is populated.
pub fn create_guest_memory(size: u64, backend: MemoryBackend) -> Result<GuestMemory> {
    if size < MIN_MEMORY {
        return Err(Error::Memory(format!(
            "{} is too small: the guest needs at least {}",
            MemorySize(size),
            MemorySize(MIN_MEMORY)
        )));
    }
    if size > MAX_MEMORY {
        return Err(Error::Memory(format!(
            "{} is larger than ferry can map for a guest (at most {})",
            MemorySize(size),
            MemorySize(MAX_MEMORY)
        )));
    }
    if !size.is_multiple_of(4096) {
        return Err(Error::Memory(
            "memory size must be a multiple of 4 KiB".into(),
        ));
    }
    let regions = ram_ranges(size)
        .into_iter()
        .map(|r| {
            let len = r.len as usize;
            let mapping = match backend {
                MemoryBackend::Anonymous => MmapRegion::new(len),
                MemoryBackend::Memfd => {
                    let file = memfd(r.len)?;
                    MmapRegion::from_file(vm_memory::FileOffset::new(file, 0), len)
                }
            }
            .map_err(|e| Error::Memory(format!("cannot map {}: {e}", MemorySize(r.len))))?;
            GuestRegionMmap::new(mapping, GuestAddress(r.gpa))
                .ok_or_else(|| Error::Memory("region does not fit the guest address space".into()))
        })
        .collect::<Result<Vec<_>>>()?;
    GuestMemoryMmap::from_regions(regions).map_err(|e| Error::Memory(e.to_string()))
}

fn memfd(size: u64) -> Result<std::fs::File> {
    use std::os::fd::FromRawFd;
    // SAFETY: memfd_create takes a NUL-terminated name and returns a new fd or -1.
    let fd = unsafe { libc::memfd_create(c"ferry-guest".as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error().into());
    }
    // SAFETY: fd is a fresh, owned descriptor.
    let file = unsafe { std::fs::File::from_raw_fd(fd) };
    file.set_len(size)?;
    Ok(file)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_sizes_people_write() {
        assert_eq!("4G".parse::<MemorySize>().unwrap().0, 4 << 30);
        assert_eq!("512m".parse::<MemorySize>().unwrap().0, 512 << 20);
        assert_eq!("4096".parse::<MemorySize>().unwrap().0, 4096);
        assert!(
            "0".parse::<MemorySize>()
                .unwrap_err()
                .contains("larger than 0")
        );
        assert!(
            "abc"
                .parse::<MemorySize>()
                .unwrap_err()
                .contains("not a size")
        );
        assert!("99999999999T".parse::<MemorySize>().is_err());
    }

    #[test]
    fn refuses_sizes_out_of_range() {
        assert!(create_guest_memory(1 << 20, MemoryBackend::Anonymous).is_err());
        let err = create_guest_memory(1 << 41, MemoryBackend::Anonymous).unwrap_err();
        assert!(err.to_string().contains("larger than ferry can map"));
    }
}
