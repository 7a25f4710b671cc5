//! ferry's Linux guest (`make linux-guest`): the kernel, its ext2 root and the header its
//! syscall-free /init (guest/linux/writer.c) keeps in memory, read through ferry's memfd.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use super::{Ferry, repo_root};

/// What `make linux-guest` leaves in guest/build/linux.
pub struct LinuxGuest {
    pub vmlinux: PathBuf,
    pub rootfs: PathBuf,
    pub cmdline: String,
}

/// The built guest; None (with a loud message) outside CI when it was not built, a failure
/// in CI (make test builds it first).
pub fn linux_guest() -> Option<LinuxGuest> {
    let dir = repo_root().join("guest/build/linux");
    let guest = LinuxGuest {
        vmlinux: dir.join("vmlinux"),
        rootfs: dir.join("rootfs.ext2"),
        cmdline: std::fs::read_to_string(dir.join("cmdline"))
            .unwrap_or_default()
            .trim()
            .to_string(),
    };
    if guest.vmlinux.exists() && guest.rootfs.exists() && !guest.cmdline.is_empty() {
        return Some(guest);
    }
    assert!(
        std::env::var("CI").is_err(),
        "guest/build/linux is missing in CI: make test runs make linux-guest first"
    );
    eprintln!("\n*** SKIPPED: no Linux guest; run `make linux-guest` ***\n");
    None
}

/// The writer's header (guest/linux/writer.c's `struct header`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Writer {
    pub pages: u64,
    pub passes: u64,
    pub errors: u64,
    pub first_bad: u64,
    pub bad_word: u64,
    pub progress: u64,
    /// Pages of /init's file table read back from the disk and found right, and wrong.
    pub file_pages: u64,
    pub file_errors: u64,
}

const HEADER_MAGIC: u64 = 0x6672_726c_6e78_6864;
const PAGE: usize = 4096;
const CHUNK: usize = 1 << 20;

/// The guest-memory memfd of ferry process `pid` (`--memory-backend memfd`).
fn guest_memfd(pid: u32) -> Option<File> {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .ok()?
        .flatten()
        .find(|fd| {
            std::fs::read_link(fd.path())
                .is_ok_and(|target| target.to_string_lossy().starts_with("/memfd:ferry-guest"))
        })
        .and_then(|fd| File::open(fd.path()).ok())
}

/// The writer's header in `memory`: the page that starts with the magic and its successor.
fn find_header(memory: &File) -> Option<Writer> {
    let len = memory.metadata().ok()?.len() as usize;
    let mut chunk = vec![0u8; CHUNK];
    let word = |b: &[u8], i: usize| u64::from_le_bytes(b[i * 8..i * 8 + 8].try_into().unwrap());
    for at in (0..len).step_by(CHUNK) {
        let n = memory.read_at(&mut chunk, at as u64).ok()?;
        for page in chunk[..n].chunks_exact(PAGE) {
            if word(page, 0) == HEADER_MAGIC && word(page, 1) == HEADER_MAGIC ^ 1 {
                return Some(Writer {
                    pages: word(page, 2),
                    passes: word(page, 3),
                    errors: word(page, 4),
                    first_bad: word(page, 5),
                    bad_word: word(page, 6),
                    progress: word(page, 7),
                    file_pages: word(page, 8),
                    file_errors: word(page, 9),
                });
            }
        }
    }
    None
}

/// The writer's header in the guest memory of ferry process `pid` (None before /init runs).
pub fn writer_header_of(pid: u32) -> Option<Writer> {
    find_header(&guest_memfd(pid)?)
}

/// Waits until the writer's header in process `pid`'s guest memory satisfies `pred`; on
/// timeout, fails with the header and the end of the guest's console (`console()`).
pub fn wait_writer_header(
    pid: u32,
    what: &str,
    limit: Duration,
    pred: impl Fn(&Writer) -> bool,
    console: impl Fn() -> String,
) -> Writer {
    let deadline = Instant::now() + limit;
    loop {
        let header = writer_header_of(pid);
        if let Some(w) = header.filter(&pred) {
            return w;
        }
        if Instant::now() >= deadline {
            let serial = console();
            let tail: Vec<&str> = serial.lines().rev().take(20).collect();
            let tail: Vec<&str> = tail.into_iter().rev().collect();
            panic!(
                "timed out waiting for {what}; the writer: {header:?}; the console ends:\n{}",
                tail.join("\n")
            );
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// The kernel's tick rate (`CONFIG_HZ_100` in guest/linux/config).
pub const HZ: u64 = 100;
/// Where the kernel's image is mapped (`__START_KERNEL_map`): it runs where it was linked,
/// its physical address its virtual one less this (no KASLR in guest/linux/config).
const KERNEL_MAP: u64 = 0xffff_ffff_8000_0000;

/// The guest-physical address of `symbol` in `vmlinux` (binutils' `nm`).
pub fn kernel_symbol(vmlinux: &Path, symbol: &str) -> u64 {
    let out = std::process::Command::new("nm")
        .arg(vmlinux)
        .output()
        .expect("nm (binutils)");
    let listing = String::from_utf8_lossy(&out.stdout);
    let line = listing
        .lines()
        .find(|l| l.split_whitespace().nth(2) == Some(symbol))
        .unwrap_or_else(|| panic!("{symbol} is not in {}", vmlinux.display()));
    let virt = u64::from_str_radix(line.split_whitespace().next().unwrap(), 16).unwrap();
    virt - KERNEL_MAP
}

/// The kernel's `jiffies_64` (at guest-physical `at`) in ferry process `pid`'s guest memory.
pub fn jiffies_of(pid: u32, at: u64) -> u64 {
    let memory = guest_memfd(pid).expect("the guest's memfd");
    let mut word = [0u8; 8];
    memory.read_exact_at(&mut word, at).expect("read jiffies");
    u64::from_le_bytes(word)
}

impl Ferry {
    /// The Linux guest's writer as it stands in this VM's memory (None before /init runs).
    pub fn writer_header(&self) -> Option<Writer> {
        writer_header_of(self.child.as_ref()?.id())
    }

    /// Waits until the writer has done `passes` passes more than `after`; returns its header.
    pub fn wait_writer(&self, what: &str, after: u64, passes: u64, limit: Duration) -> Writer {
        self.wait_header(what, limit, |w| w.passes >= after + passes)
    }

    /// Waits until the writer's header satisfies `pred`.
    pub fn wait_header(
        &self,
        what: &str,
        limit: Duration,
        pred: impl Fn(&Writer) -> bool,
    ) -> Writer {
        let pid = self.child.as_ref().map_or(0, |c| c.id());
        wait_writer_header(pid, what, limit, pred, || self.serial_text())
    }
}

/// The guest's address on a testbed's network (its kernel configures it, IP autoconfig).
pub const GUEST_IP: &str = "10.213.0.2";
/// The switch's address on that network (`Testbed::address_switch`).
pub const SWITCH_CIDR: &str = "10.213.0.1/24";

/// The devices every Linux VM of these tests has, as `ferry run` arguments: its root
/// filesystem, a NIC on the host's `tap0`, and a balloon.
pub fn linux_devices(root: &Path) -> Vec<String> {
    [
        "--disk".to_string(),
        format!("path={}", root.display()),
        "--net".into(),
        format!("tap={}", super::testbed::TAP),
        "--balloon=stats_s=1".into(),
    ]
    .to_vec()
}

/// A private copy of the guest's root filesystem, in a directory of its own (`remove_root`
/// removes both).
pub fn root_copy(guest: &LinuxGuest) -> PathBuf {
    let dir = tempfile::tempdir().expect("tempdir");
    let root = dir.keep().join("rootfs.ext2");
    std::fs::copy(&guest.rootfs, &root).expect("copy the root filesystem");
    root
}

/// The guest's command line in these tests: the writer over 16 MiB, the NIC at `GUEST_IP`.
pub fn test_cmdline(guest: &LinuxGuest) -> String {
    format!(
        "{} ferry_writer_mib=16 ip={GUEST_IP}::10.213.0.1:255.255.255.0::eth0:off",
        guest.cmdline
    )
}

/// Boots the Linux guest in network namespace `ns` (a testbed host, whose `tap0` its NIC
/// takes): 256 MiB, one vCPU, the writer over 16 MiB, a private copy of the root filesystem
/// (returned), and `extra` arguments.
pub fn boot_linux(guest: &LinuxGuest, ns: &str, extra: &[&str]) -> (Ferry, PathBuf) {
    let root = root_copy(guest);
    let cmdline = test_cmdline(guest);
    let devices = linux_devices(&root);
    let mut args = vec![
        "--kernel",
        guest.vmlinux.to_str().unwrap(),
        "--cmdline",
        &cmdline,
        "--memory",
        "256M",
        "--memory-backend",
        "memfd",
    ];
    args.extend(devices.iter().map(String::as_str));
    args.extend_from_slice(extra);
    (Ferry::start_in_netns(ns, &args), root)
}

/// Linux's boot, from the serial log: seconds from power-on (the kernel's own clock) to
/// the line that says /init runs from the root filesystem.
pub fn boot_seconds(serial: &str) -> Option<f64> {
    let line = serial
        .lines()
        .find(|l| l.contains("Run /init as init process"))?;
    let stamp = line.split(']').next()?.trim_start_matches('[').trim();
    stamp.parse().ok()
}

/// Fails with the serial log when `serial` lacks `needle`.
pub fn assert_said(serial: &str, needle: &str) {
    assert!(
        serial.contains(needle),
        "the guest never said {needle:?}:\n{serial}"
    );
}

/// Keeps the scratch root filesystem out of /tmp's way when the test is done.
pub fn remove_root(root: &Path) {
    if let Some(dir) = root.parent() {
        let _ = std::fs::remove_dir_all(dir);
    }
}
