//! What an arriving VM may open on this host. In Cloud Hypervisor's contract the receiver is
//! told nothing of the devices: the sender's `Hello` names the disks' paths and the taps, and
//! its `Config` the payload and where the serial port and console go. A peer must not choose
//! host files, so the receiver opens only files under directories its own operator named
//! (`--allow-disk-dir`, matched after resolving links: disks read-write, the payload when the
//! VM boots again, a serial port's file or socket) and only taps its operator named
//! (`--allow-tap`, `NAME` or a `PREFIX*`); anything else refuses the VM before a page crosses
//! (a payload outside them refuses the reboot instead).

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use api::ch::{ConsoleMode, VmSpec};
use migration::HandedFiles;
use vmm::VmConfig;

#[derive(Clone, Debug, Default)]
pub struct Allowed {
    /// Canonical directories; a disk must resolve to a file beneath one of them.
    disk_dirs: Vec<PathBuf>,
    /// Tap names, or prefixes ending in `*`.
    taps: Vec<String>,
}

impl Allowed {
    /// The operator's lists, each directory resolved now (it must exist).
    pub fn new(disk_dirs: &[PathBuf], taps: &[String]) -> Result<Self> {
        let mut dirs = Vec::with_capacity(disk_dirs.len());
        for d in disk_dirs {
            let dir = d
                .canonicalize()
                .with_context(|| format!("--allow-disk-dir {}", d.display()))?;
            if !dir.is_dir() {
                bail!("--allow-disk-dir {}: not a directory", d.display());
            }
            dirs.push(dir);
        }
        if let Some(bad) = taps.iter().find(|t| t.is_empty() || t.as_str() == "*") {
            bail!("--allow-tap '{bad}': name a tap, or a prefix followed by *");
        }
        Ok(Self {
            disk_dirs: dirs,
            taps: taps.to_vec(),
        })
    }

    /// Checks every device `config` would open by name, and points each disk at the file it
    /// resolved to, so that what is opened is what was checked. Devices a live update hands
    /// over as open files (`handed`) are opened by no name here.
    pub fn admit(
        &self,
        config: &mut VmConfig,
        handed: Option<&HandedFiles>,
    ) -> migration::Result<()> {
        let passed =
            |slot: usize| handed.is_some_and(|h| h.devices.get(slot).is_some_and(Option::is_some));
        for (slot, disk) in config.disks.iter_mut().enumerate() {
            if !passed(slot) {
                disk.path = self.disk(&disk.path).map_err(refused)?;
            }
        }
        let first_net = config.disks.len();
        for (i, net) in config.nets.iter().enumerate() {
            if !passed(first_net + i) && !self.tap_allowed(&net.tap) {
                return Err(refused(format!(
                    "tap '{}' is not one this VMM may attach (--allow-tap)",
                    net.tap
                )));
            }
        }
        Ok(())
    }

    /// Checks the files a VM's config from a peer has this host write or listen on, now: its
    /// serial port's and console's files and sockets.
    pub fn admit_ports(&self, spec: &VmSpec) -> migration::Result<()> {
        for (what, mode) in [("serial", &spec.serial), ("console", &spec.console)] {
            match mode {
                ConsoleMode::File(path) => self.made_file(&format!("{what} file"), path),
                ConsoleMode::Socket(path) => self.made_file(&format!("{what} socket"), path),
                ConsoleMode::Off | ConsoleMode::Tty | ConsoleMode::Pty(_) => Ok(()),
            }
            .map_err(refused)?;
        }
        Ok(())
    }

    /// Checks the payload of a VM whose config came from a peer, before it boots again here.
    pub fn admit_payload(&self, spec: &VmSpec) -> Result<(), String> {
        self.beneath("payload.kernel", Path::new(&spec.kernel))?;
        if let Some(initramfs) = &spec.initramfs {
            self.beneath("payload.initramfs", Path::new(initramfs))?;
        }
        Ok(())
    }

    fn disk(&self, path: &Path) -> Result<PathBuf, String> {
        self.beneath("disk", path)
    }

    /// A file ferry makes (or truncates): the directory it goes in must resolve beneath an
    /// allowed directory, and so must the file, if a link is already there.
    fn made_file(&self, what: &str, path: &str) -> Result<(), String> {
        let path = Path::new(path);
        if path.symlink_metadata().is_ok() {
            return self.beneath(what, path).map(drop);
        }
        let dir = path
            .parent()
            .filter(|d| !d.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        self.beneath(&format!("the directory of {what} {}:", path.display()), dir)
            .map(drop)
    }

    /// The file `path` (`what`, in an error) resolves to, when it lies beneath an allowed
    /// directory.
    fn beneath(&self, what: &str, path: &Path) -> Result<PathBuf, String> {
        let real = path
            .canonicalize()
            .map_err(|e| format!("{what} {}: {e}", path.display()))?;
        if !self.disk_dirs.iter().any(|d| real.starts_with(d)) {
            let through = if real == path {
                String::new()
            } else {
                format!(" (it resolves to {})", real.display())
            };
            return Err(format!(
                "{what} {}{through} is outside the directories this VMM may open \
                 (--allow-disk-dir: {})",
                path.display(),
                self.dirs_named()
            ));
        }
        Ok(real)
    }

    fn dirs_named(&self) -> String {
        if self.disk_dirs.is_empty() {
            return "none given".into();
        }
        let dirs: Vec<String> = self
            .disk_dirs
            .iter()
            .map(|d| d.display().to_string())
            .collect();
        dirs.join(", ")
    }

    fn tap_allowed(&self, tap: &str) -> bool {
        self.taps.iter().any(|t| match t.strip_suffix('*') {
            Some(prefix) => tap.starts_with(prefix),
            None => tap == t,
        })
    }
}

fn refused(why: String) -> migration::Error {
    migration::Error::Setup(format!("the VM's devices are refused here: {why}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use vmm::{DiskConfig, MemoryBackend, NetConfig};

    fn vm(disk: &Path, tap: &str) -> VmConfig {
        VmConfig {
            memory: 1 << 20,
            vcpus: 1,
            backend: MemoryBackend::Anonymous,
            disks: vec![DiskConfig {
                path: disk.into(),
                readonly: false,
            }],
            nets: vec![NetConfig {
                tap: tap.into(),
                mac: None,
                file: None,
            }],
            balloon: None,
            cpu_model: vmm::cpuid::CpuModel::Host,
        }
    }

    #[test]
    fn disks_resolve_beneath_an_allowed_directory_and_taps_match_names() {
        let dir = tempfile::tempdir().unwrap();
        let allowed_dir = dir.path().join("allowed");
        std::fs::create_dir(&allowed_dir).unwrap();
        let inside = allowed_dir.join("a.img");
        let outside = dir.path().join("secret.img");
        std::fs::write(&inside, b"x").unwrap();
        std::fs::write(&outside, b"x").unwrap();
        let link = allowed_dir.join("link.img");
        std::os::unix::fs::symlink(&outside, &link).unwrap();
        let dotdot = allowed_dir.join("../secret.img");
        let allowed = Allowed::new(
            std::slice::from_ref(&allowed_dir),
            &["vm-*".into(), "tap0".into()],
        )
        .unwrap();

        let mut ok = vm(&inside, "vm-17");
        allowed.admit(&mut ok, None).unwrap();
        assert_eq!(ok.disks[0].path, inside.canonicalize().unwrap());
        allowed.admit(&mut vm(&inside, "tap0"), None).unwrap();

        for (disk, words) in [
            (&outside, "secret.img is outside"),
            (&link, "resolves to"),
            (&dotdot, "resolves to"),
        ] {
            let e = allowed.admit(&mut vm(disk, "tap0"), None).unwrap_err();
            assert!(e.to_string().contains(words), "{disk:?}: {e}");
        }
        let e = allowed.admit(&mut vm(&inside, "tap01"), None).unwrap_err();
        assert!(e.to_string().contains("tap 'tap01'"), "{e}");
        let none = Allowed::default();
        let e = none.admit(&mut vm(&inside, "tap0"), None).unwrap_err();
        assert!(e.to_string().contains("none given"), "{e}");
    }

    #[test]
    fn a_handed_device_is_opened_by_no_name() {
        let handed = HandedFiles {
            memory: Vec::new(),
            devices: vec![Some(tempfile::tempfile().unwrap().into()), None],
        };
        let mut config = vm(Path::new("/etc/shadow"), "tap0");
        let e = Allowed::default()
            .admit(&mut config, Some(&handed))
            .unwrap_err();
        assert!(e.to_string().contains("tap 'tap0'"), "{e}");
        let taps = Allowed::new(&[], &["tap0".into()]).unwrap();
        taps.admit(&mut config, Some(&handed)).unwrap();
        assert_eq!(config.disks[0].path, Path::new("/etc/shadow"));
    }

    #[test]
    fn a_peer_config_opens_files_only_beneath_an_allowed_directory() {
        let dir = tempfile::tempdir().unwrap();
        let allowed_dir = dir.path().join("allowed");
        std::fs::create_dir(&allowed_dir).unwrap();
        let kernel = allowed_dir.join("vmlinux");
        std::fs::write(&kernel, b"x").unwrap();
        let allowed = Allowed::new(std::slice::from_ref(&allowed_dir), &[]).unwrap();
        let body = |kernel: &Path, serial: serde_json::Value| {
            serde_json::json!({
                "payload": {"kernel": kernel},
                "serial": serial,
                "console": {"mode": "Pty"},
            })
        };
        let spec = |kernel: &Path, serial| VmSpec::from_json(&body(kernel, serial)).unwrap();

        let log = allowed_dir.join("serial.log");
        let inside = spec(&kernel, serde_json::json!({"mode": "File", "file": log}));
        allowed.admit_ports(&inside).unwrap();
        allowed.admit_payload(&inside).unwrap();
        let socket = allowed_dir.join("s.sock");
        let sock = spec(
            &kernel,
            serde_json::json!({"mode": "Socket", "socket": socket}),
        );
        allowed.admit_ports(&sock).unwrap();

        let shadow = dir.path().join("shadow");
        std::fs::write(&shadow, b"secret").unwrap();
        let link = allowed_dir.join("link.log");
        std::os::unix::fs::symlink(&shadow, &link).unwrap();
        for (serial, words) in [
            (
                serde_json::json!({"mode": "File", "file": shadow}),
                "serial file",
            ),
            (
                serde_json::json!({"mode": "File", "file": link}),
                "resolves to",
            ),
            (
                serde_json::json!({"mode": "Socket", "socket": dir.path().join("x.sock")}),
                "serial socket",
            ),
        ] {
            let e = allowed.admit_ports(&spec(&kernel, serial)).unwrap_err();
            assert!(e.to_string().contains(words), "{words}: {e}");
        }
        let e = allowed
            .admit_payload(&spec(&shadow, serde_json::json!({"mode": "Null"})))
            .unwrap_err();
        assert!(e.contains("payload.kernel") && e.contains("outside"), "{e}");
    }

    #[test]
    fn the_operator_lists_are_checked_at_start() {
        assert!(Allowed::new(&["/nonexistent-ferry-dir".into()], &[]).is_err());
        assert!(Allowed::new(&[], &["*".into()]).is_err());
        assert!(Allowed::new(&[], &[String::new()]).is_err());
    }
}
