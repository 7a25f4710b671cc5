//! ferry under a client no one here wrote: libvirt 11.3's Cloud Hypervisor driver (its own
//! virtchd and virsh, built by scripts/libvirt-ch.sh, which `make test` runs first) with
//! ferry as its `cloud-hypervisor`. libvirt starts the VMM, creates and boots the VM through
//! CH's API, passes the NIC's tap by SCM_RIGHTS, reads CH's event stream, lists the VMM's
//! threads into cgroups, and saves and restores through CH's snapshot calls. The guest
//! verifies its memory and its disk throughout; its counters are read on the API socket
//! libvirt made.

mod common;

use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::Duration;

use common::ch_api::call;
use common::{FERRY, guest, kvm_available, repo_root, wait_for};
use serde_json::Value;

/// libvirt's daemons for one test, on the build's own run directory; stopped when dropped,
/// with every domain the test defined.
struct Libvirt {
    prefix: PathBuf,
    bin: tempfile::TempDir,
    daemons: Vec<Child>,
    domains: Vec<String>,
    /// Held while the daemons run: one test at a time uses the build's run directory.
    _lock: std::fs::File,
}

impl Libvirt {
    fn start() -> Libvirt {
        let link = repo_root().join("target/libvirt-ch");
        let prefix = link.canonicalize().unwrap_or_else(|_| {
            panic!(
                "{} is missing: scripts/libvirt-ch.sh builds libvirt's ch driver (make test runs it)",
                link.display()
            )
        });
        let run = prefix.join("var/run");
        std::fs::create_dir_all(&run).unwrap();
        let lock = std::fs::File::create(run.join("ferry-tests.lock")).unwrap();
        // SAFETY: flock on a file this process holds open.
        assert_eq!(unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX) }, 0);
        let bin = tempfile::tempdir().unwrap();
        std::os::unix::fs::symlink(FERRY, bin.path().join("cloud-hypervisor")).unwrap();
        let mut libvirt = Libvirt {
            prefix,
            bin,
            daemons: Vec::new(),
            domains: Vec::new(),
            _lock: lock,
        };
        for daemon in ["virtlogd", "virtchd"] {
            libvirt.end_leftover(daemon);
            let child = libvirt
                .command(&format!("sbin/{daemon}"))
                .arg("--pid-file")
                .arg(libvirt.pid_file(daemon))
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .unwrap_or_else(|e| panic!("{daemon}: {e}"));
            libvirt.daemons.push(child);
        }
        wait_for("virtchd to answer", Duration::from_secs(30), || {
            libvirt.virsh(&["version"]).status.success().then_some(())
        });
        libvirt
    }

    fn pid_file(&self, daemon: &str) -> PathBuf {
        self.prefix.join(format!("var/run/{daemon}-test.pid"))
    }

    /// A daemon an earlier run left behind (killed before it could stop it) holds the sockets.
    fn end_leftover(&self, daemon: &str) {
        let pid = std::fs::read_to_string(self.pid_file(daemon))
            .ok()
            .and_then(|p| p.trim().parse::<i32>().ok());
        if let Some(pid) = pid {
            let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
            if comm.trim() == daemon {
                // SAFETY: a signal to the daemon our pid file names.
                unsafe { libc::kill(pid, libc::SIGKILL) };
                wait_for("a leftover daemon to go", Duration::from_secs(10), || {
                    (!Path::new(&format!("/proc/{pid}")).exists()).then_some(())
                });
            }
        }
    }

    /// A program of the build, with ferry as the only `cloud-hypervisor` on its PATH.
    fn command(&self, program: &str) -> Command {
        let lib = std::fs::read_dir(self.prefix.join("lib"))
            .unwrap()
            .flatten()
            .map(|e| e.path())
            .find(|p| p.join("libvirt.so.0").exists())
            .unwrap_or_else(|| self.prefix.join("lib"));
        let mut c = Command::new(self.prefix.join(program));
        c.env(
            "PATH",
            format!(
                "{}:{}",
                self.bin.path().display(),
                std::env::var("PATH").unwrap_or_default()
            ),
        )
        .env("LD_LIBRARY_PATH", lib)
        .stdin(Stdio::null());
        c
    }

    fn virsh(&self, args: &[&str]) -> Output {
        self.command("bin/virsh")
            .args(["-c", "ch:///system"])
            .args(args)
            .output()
            .unwrap()
    }

    fn virsh_ok(&self, args: &[&str]) -> String {
        let out = self.virsh(args);
        assert!(
            out.status.success(),
            "virsh {}: {}{}",
            args.join(" "),
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    fn define(&mut self, name: &str, xml: &str, dir: &Path) {
        let file = dir.join(format!("{name}.xml"));
        std::fs::write(&file, xml).unwrap();
        self.virsh_ok(&["define", &file.display().to_string()]);
        self.domains.push(name.to_string());
    }

    /// `virsh domstate --reason`, e.g. "running (booted)".
    fn state(&self, name: &str) -> String {
        self.virsh_ok(&["domstate", "--reason", name])
            .trim()
            .to_string()
    }

    fn wait_state(&self, name: &str, want: &str) {
        wait_for(
            &format!("{name} to be {want}"),
            Duration::from_secs(60),
            || (self.state(name) == want).then_some(()),
        );
    }

    /// The guest's own counters, on the API socket libvirt made for the VMM.
    fn guest(&self, name: &str) -> Value {
        let socket = self
            .prefix
            .join(format!("var/run/libvirt/ch/{name}-socket"));
        let (status, counters) = call(&socket, "GET", "vm.counters", None);
        assert_eq!(status, 200, "vm.counters: {counters}");
        counters
    }

    /// Waits until the guest has made `passes` more passes than `after`, checking as it goes
    /// that it found no error in its memory or on its disk.
    fn wait_verified(&self, name: &str, after: u64, passes: u64) -> u64 {
        wait_for(
            &format!("{name}'s guest to verify {passes} passes"),
            Duration::from_secs(120),
            || {
                let c = self.guest(name);
                let g = &c["guest"];
                assert_eq!(g["verify_errors"], 0, "{c}");
                assert_eq!(g["blk_errors"], 0, "{c}");
                let done = g["passes"].as_u64().unwrap();
                (done >= after + passes).then_some(done)
            },
        )
    }

    /// The VMM's pid (libvirt's domain id).
    fn vmm_pid(&self, name: &str) -> i32 {
        self.virsh_ok(&["domid", name]).trim().parse().unwrap()
    }

    fn log(&self, name: &str) -> String {
        std::fs::read_to_string(self.prefix.join(format!("var/log/libvirt/ch/{name}.log")))
            .unwrap_or_default()
    }
}

impl Drop for Libvirt {
    fn drop(&mut self) {
        for name in self.domains.clone() {
            let _ = self.virsh(&["destroy", &name]);
            let _ = self.virsh(&["undefine", "--managed-save", &name]);
        }
        for mut daemon in self.daemons.drain(..).rev() {
            // SAFETY: a signal to a child of ours.
            unsafe { libc::kill(daemon.id() as i32, libc::SIGTERM) };
            let _ = daemon.wait();
        }
    }
}

/// A domain of the workload guest as libvirt's users write one: its kernel and command line,
/// a pty console, and a disk and a NIC when given.
fn domain(name: &str, cmdline: &str, disk: Option<&Path>, tap: Option<&str>) -> String {
    let disk = disk.map_or(String::new(), |d| {
        format!(
            "<disk type='file' device='disk'><source file='{}'/><target dev='vda' bus='virtio'/></disk>",
            d.display()
        )
    });
    let nic = tap.map_or(String::new(), |t| {
        format!("<interface type='ethernet'><target dev='{t}'/><model type='virtio'/></interface>")
    });
    format!(
        "<domain type='kvm'><name>{name}</name><memory unit='MiB'>256</memory><vcpu>1</vcpu>\
         <os><type>hvm</type><kernel>{}</kernel><cmdline>{cmdline}</cmdline></os>\
         <devices>{disk}{nic}<console type='pty'><target type='serial' port='0'/></console>\
         </devices></domain>",
        guest().display()
    )
}

/// Waits until the VMM process `pid` has exited.
fn wait_gone(pid: i32) {
    wait_for("the VMM to exit", Duration::from_secs(30), || {
        (!Path::new(&format!("/proc/{pid}")).exists()).then_some(())
    });
}

#[test]
fn ten_starts_and_shutdowns_keep_the_event_stream() {
    if !kvm_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let mut libvirt = Libvirt::start();
    let name = format!("ferry-starts-{}", std::process::id());
    libvirt.define(
        &name,
        &domain(&name, "write ws=4M seq verify", None, None),
        dir.path(),
    );
    for start in 0..10 {
        libvirt.virsh_ok(&["start", &name]);
        assert_eq!(libvirt.state(&name), "running (booted)", "start {start}");
        let vmm = libvirt.vmm_pid(&name);
        libvirt.wait_verified(&name, 0, 2);
        // libvirt learns that the VM went down only from the event stream.
        libvirt.virsh_ok(&["shutdown", &name]);
        libvirt.wait_state(&name, "shut off (shutdown)");
        wait_gone(vmm);
    }
    let log = libvirt.log(&name);
    assert!(!log.contains("verify error"), "{log}");
}

#[test]
fn a_domains_life_under_libvirt() {
    if !kvm_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let mut libvirt = Libvirt::start();
    let id = std::process::id() % 100_000;
    let (name, tap) = (format!("ferry-life-{id}"), format!("fl{id}"));
    let disk = dir.path().join("disk.img");
    std::fs::File::create(&disk)
        .unwrap()
        .set_len(64 << 20)
        .unwrap();
    let cmdline = "write ws=16M seq verify blk blk_sectors=2048";
    libvirt.define(
        &name,
        &domain(&name, cmdline, Some(&disk), Some(&tap)),
        dir.path(),
    );
    libvirt.virsh_ok(&["start", &name]);
    let passes = libvirt.wait_verified(&name, 0, 2);

    // The NIC: libvirt made the tap and passed it; the VM's NIC is on it.
    assert!(Path::new(&format!("/sys/class/net/{tap}")).exists());
    assert!(libvirt.guest(&name)["_net0"].is_object());
    // The console: a pty libvirt names, carrying the guest's serial output.
    let xml = libvirt.virsh_ok(&["dumpxml", &name]);
    let pty = xml
        .split("<console type='pty' tty='")
        .nth(1)
        .and_then(|s| s.split('\'').next())
        .unwrap_or_else(|| panic!("no pty in {xml}"))
        .to_string();
    assert!(read_until(&pty, "ferry-guest: booted"), "{pty}");

    libvirt.virsh_ok(&["suspend", &name]);
    assert_eq!(libvirt.state(&name), "paused (user)");
    let paused = libvirt.guest(&name)["guest"]["heartbeats"].clone();
    assert_eq!(libvirt.guest(&name)["guest"]["heartbeats"], paused);
    libvirt.virsh_ok(&["resume", &name]);
    assert_eq!(libvirt.state(&name), "running (unpaused)");
    libvirt.wait_verified(&name, passes, 1);

    // A reboot keeps the domain running; the new boot adopts what the last wrote on disk.
    libvirt.virsh_ok(&["reboot", &name]);
    assert_eq!(libvirt.state(&name), "running (booted)");
    libvirt.wait_verified(&name, 0, 2);

    let saved = dir.path().join("saved");
    let vmm = libvirt.vmm_pid(&name);
    let passes_before = libvirt.guest(&name)["guest"]["passes"].as_u64().unwrap();
    libvirt.virsh_ok(&["save", &name, &saved.display().to_string()]);
    assert_eq!(libvirt.state(&name), "shut off (saved)");
    wait_gone(vmm);
    libvirt.virsh_ok(&["restore", &saved.display().to_string()]);
    assert_eq!(libvirt.state(&name), "running (restored)");
    // The guest goes on from where it was saved: its passes were saved with its memory.
    let passes = libvirt.wait_verified(&name, passes_before, 1);

    let vmm = libvirt.vmm_pid(&name);
    libvirt.virsh_ok(&["managedsave", &name]);
    assert!(
        libvirt
            .virsh_ok(&["dominfo", &name])
            .contains("Managed save:   yes")
    );
    wait_gone(vmm);
    libvirt.virsh_ok(&["start", &name]);
    assert_eq!(libvirt.state(&name), "running (restored)");
    libvirt.wait_verified(&name, passes, 1);

    let vmm = libvirt.vmm_pid(&name);
    libvirt.virsh_ok(&["shutdown", &name]);
    libvirt.wait_state(&name, "shut off (shutdown)");
    wait_gone(vmm);
    assert!(!Path::new(&format!("/sys/class/net/{tap}")).exists());
    let log = libvirt.log(&name);
    assert!(
        !log.contains("verify error") && !log.contains("sandbox refused"),
        "{log}"
    );
}

/// Reads the pty at `path` until `text` shows (true), for at most 30 s.
fn read_until(path: &str, text: &str) -> bool {
    let (path, text) = (path.to_string(), text.to_string());
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        use std::io::Read;
        let Ok(mut pty) = std::fs::File::open(&path) else {
            return;
        };
        let mut seen = Vec::new();
        let mut buf = [0u8; 4096];
        while let Ok(n) = pty.read(&mut buf) {
            if n == 0 {
                break;
            }
            seen.extend_from_slice(&buf[..n]);
            if String::from_utf8_lossy(&seen).contains(&text) {
                let _ = tx.send(());
                return;
            }
        }
    });
    rx.recv_timeout(Duration::from_secs(30)).is_ok()
}
