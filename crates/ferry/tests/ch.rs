//! Cloud Hypervisor's control contract end to end, through the profile only: two `ferry ch`
//! VMMs, driven by CH's REST calls, a live migration between them, and the event stream.

mod common;

use std::io::Read;
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use common::ch_api::call;
use common::linux::{
    GUEST_IP, SWITCH_CIDR, Writer, linux_guest, remove_root, root_copy, test_cmdline,
    wait_writer_header,
};
use common::scrape::{must, scrape, value};
use common::testbed::{self, Testbed};
use common::{FERRY, certs, free_port, guest, kvm_available, wait_for};
use serde_json::{Value, json};

/// A `ferry ch` VMM, killed when dropped.
struct Vmm {
    child: Child,
    socket: PathBuf,
    events: PathBuf,
    metrics: PathBuf,
}

impl Vmm {
    /// A VMM that lets arriving VMs open disks in `dir` only.
    fn start(dir: &Path, name: &str) -> Vmm {
        Self::start_allowing(dir, name, dir)
    }

    fn start_allowing(dir: &Path, name: &str, disks: &Path) -> Vmm {
        Self::spawn(Command::new(FERRY), dir, name, disks)
    }

    /// A VMM confined by Landlock to its flags' files, `dir` and `more` (read only).
    fn start_landlocked(dir: &Path, name: &str, more: &Path) -> Vmm {
        let mut command = Command::new(FERRY);
        command.args(["ch", "--landlock", "--landlock-rules"]);
        command.arg(format!("path={},access=r", more.display()));
        Self::spawn_ch(command, dir, name, dir)
    }

    /// A VMM on a host of its own as far as files go: in a mount namespace where `own` is
    /// what `path` names (as two hosts each hold a disk at the same path).
    fn start_with_file_at(dir: &Path, name: &str, path: &Path, own: &Path) -> Vmm {
        let mut command = Command::new("unshare");
        command
            .args(["--mount", "--propagation", "private", "sh", "-c"])
            .arg(r#"mount --bind "$1" "$2" && shift 2 && exec "$@""#)
            .args(["sh", own.to_str().unwrap(), path.to_str().unwrap(), FERRY]);
        Self::spawn(command, dir, name, dir)
    }

    /// A VMM in network namespace `ns` (a testbed host) that lets arriving VMs open disks in
    /// `dir` and attach its tap.
    fn start_in_netns(dir: &Path, name: &str, ns: &str) -> Vmm {
        let mut command = Command::new("ip");
        command.args(["netns", "exec", ns, FERRY]);
        Self::spawn(command, dir, name, dir)
    }

    fn spawn(mut command: Command, dir: &Path, name: &str, disks: &Path) -> Vmm {
        command.arg("ch");
        Self::spawn_ch(command, dir, name, disks)
    }

    /// Starts `command`, which already says `ch`, with the flags every test VMM has.
    fn spawn_ch(mut command: Command, dir: &Path, name: &str, disks: &Path) -> Vmm {
        let socket = dir.join(format!("{name}.sock"));
        let events = dir.join(format!("{name}.events"));
        let metrics = dir.join(format!("{name}.metrics"));
        let child = command
            .arg("--api-socket")
            .arg(format!("path={}", socket.display()))
            .arg("--event-monitor")
            .arg(format!("path={}", events.display()))
            .arg("--metrics")
            .arg(format!("unix:{}", metrics.display()))
            .arg("--allow-disk-dir")
            .arg(disks)
            .arg("--allow-tap")
            .arg(testbed::TAP)
            .stdin(Stdio::null())
            .spawn()
            .expect("spawn ferry ch");
        let vmm = Vmm {
            child,
            socket,
            events,
            metrics,
        };
        wait_for("the API", Duration::from_secs(10), || {
            (vmm.call("GET", "vmm.ping", None).0 == 200).then_some(())
        });
        vmm
    }

    fn call(&self, method: &str, endpoint: &str, body: Option<Value>) -> (u16, Value) {
        call(&self.socket, method, endpoint, body)
    }

    fn ok(&self, method: &str, endpoint: &str, body: Option<Value>) -> Value {
        let (status, answer) = self.call(method, endpoint, body);
        assert!(
            status == 200 || status == 204,
            "{endpoint}: {status} {answer}"
        );
        answer
    }

    /// The events so far, each line parsed on its own.
    fn events(&self) -> Vec<(String, String)> {
        std::fs::read_to_string(&self.events)
            .unwrap()
            .lines()
            .map(|line| {
                let e: Value = serde_json::from_str(line).expect("one JSON object per line");
                assert!(e["timestamp"]["secs"].is_u64(), "{line}");
                let s = |k: &str| e[k].as_str().unwrap().to_string();
                (s("source"), s("event"))
            })
            .collect()
    }

    /// The names of the process's threads, as libvirt reads them.
    fn thread_names(&self) -> Vec<String> {
        let tasks = format!("/proc/{}/task", self.child.id());
        std::fs::read_dir(tasks)
            .unwrap()
            .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
            .map(|name| name.trim().to_string())
            .collect()
    }

    fn said(&self, event: &str) -> bool {
        self.events().iter().any(|(_, e)| e == event)
    }
}

impl Drop for Vmm {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn config(cmdline: &str) -> Value {
    json!({
        "payload": {"kernel": guest(), "cmdline": cmdline},
        "cpus": {"boot_vcpus": 1, "max_vcpus": 1},
        "memory": {"size": 512u64 << 20, "thp": true},
        "serial": {"mode": "Null"},
        "console": {"mode": "Off"},
    })
}

fn assert_error(answer: (u16, Value), status: u16, words: &str) {
    assert_eq!(answer.0, status, "{}", answer.1);
    let text = answer.1.to_string();
    assert!(answer.1.is_array() && text.contains(words), "{text}");
}

#[test]
fn lifecycle_and_live_migration_through_the_profile() {
    if !kvm_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let src = Vmm::start(dir.path(), "src");
    assert_error(src.call("GET", "vm.info", None), 500, "not created");
    assert_error(src.call("PUT", "vm.boot", None), 500, "not created");

    // Bad input: what ferry lacks, named; nothing is created.
    let mut bad = config("idle");
    bad["memory"]["hugepages"] = json!(true);
    assert_error(
        src.call("PUT", "vm.create", Some(bad)),
        400,
        "memory.hugepages",
    );
    assert_error(
        src.call("PUT", "vm.resize", Some(json!({}))),
        400,
        "hotplug",
    );
    assert_error(src.call("GET", "vm.nope", None), 404, "no such endpoint");

    // A field a newer CH has is accepted (and logged), as CH accepts it.
    let mut create = config("write ws=64M seq verify");
    create["a_field_of_a_newer_ch"] = json!(1);
    src.ok("PUT", "vm.create", Some(create));
    assert_eq!(src.ok("GET", "vm.info", None)["state"], "Created");
    assert_error(
        src.call("PUT", "vm.create", Some(config("idle"))),
        500,
        "already created",
    );
    src.ok("PUT", "vm.boot", None);
    // Boot answers once the vCPU threads run under their names: libvirt pins them at once.
    let threads = src.thread_names();
    assert!(threads.iter().any(|t| t == "vcpu0"), "{threads:?}");
    assert_error(src.call("PUT", "vm.boot", None), 500, "already booted");
    let info = src.ok("GET", "vm.info", None);
    assert_eq!(info["state"], "Running");
    assert_eq!(info["memory_actual_size"], 512u64 << 20);
    assert_eq!(
        info["config"]["payload"]["cmdline"],
        "write ws=64M seq verify"
    );
    wait_for("a first pass", Duration::from_secs(60), || {
        (src.ok("GET", "vm.counters", None)["guest"]["passes"].as_u64() >= Some(1)).then_some(())
    });
    src.ok("PUT", "vm.pause", None);
    assert_eq!(src.ok("GET", "vm.info", None)["state"], "Paused");
    assert_error(src.call("PUT", "vm.pause", None), 500, "not running");
    src.ok("PUT", "vm.resume", None);
    // A reboot says only what CH says: a shutdown between would read as the guest gone.
    let before = src.events().len();
    src.ok("PUT", "vm.reboot", None);
    let said: Vec<String> = src.events()[before..]
        .iter()
        .map(|(_, e)| e.clone())
        .collect();
    assert_eq!(said, ["rebooting", "rebooted"]);
    assert_eq!(src.ok("GET", "vm.info", None)["state"], "Running");
    wait_for(
        "a first pass after the reboot",
        Duration::from_secs(60),
        || {
            (src.ok("GET", "vm.counters", None)["guest"]["passes"].as_u64() >= Some(1))
                .then_some(())
        },
    );
    assert_error(
        src.call("PUT", "vm.power-button", None),
        400,
        "power button",
    );
    // A live update needs shared memory, which this VM was not given.
    let bad = json!({"destination_url": "unix:/nowhere", "local": true});
    assert_error(
        src.call("PUT", "vm.send-migration", Some(bad)),
        400,
        "memory.shared",
    );

    // A live migration: the destination waits in vm.receive-migration, the source sends.
    let dst = Vmm::start(dir.path(), "dst");
    let empty = scrape(&dst.metrics);
    assert_eq!(value(&empty, r#"ferry_vm_state{state="running"}"#), None);
    let url = format!("unix:{}", dir.path().join("migration.sock").display());
    let receiver = {
        let (socket, url) = (dst.socket.clone(), url.clone());
        std::thread::spawn(move || {
            let body = json!({"receiver_url": url});
            call(&socket, "PUT", "vm.receive-migration", Some(body))
        })
    };
    wait_for("the destination to listen", Duration::from_secs(10), || {
        dst.said("migration-receive-ready").then_some(())
    });
    let send = json!({"destination_url": url, "connections": 2, "downtime_ms": 300});
    src.ok("PUT", "vm.send-migration", Some(send));
    let (status, answer) = receiver.join().unwrap();
    assert_eq!(status, 204, "{answer}");
    let stats = src.ok("GET", "vm.migration-progress", None);
    assert_eq!(stats["role"], "source");
    assert_eq!(stats["memory_total"], 512u64 << 20);
    assert_eq!(stats["memory_page_size"], 4096);
    assert_eq!(dst.ok("GET", "vm.info", None)["state"], "Running");
    let passes = dst.ok("GET", "vm.counters", None)["guest"]["passes"]
        .as_u64()
        .unwrap();
    wait_for(
        "the guest to verify its memory here",
        Duration::from_secs(60),
        || {
            let g = dst.ok("GET", "vm.counters", None)["guest"].clone();
            assert_eq!(
                g["verify_errors"], 0,
                "the guest found its memory wrong: {g}"
            );
            (g["passes"].as_u64().unwrap() >= passes + 2).then_some(())
        },
    );
    let arrived = scrape(&dst.metrics);
    assert_eq!(must(&arrived, r#"ferry_vm_state{state="running"}"#), 1.0);
    let completed = r#"ferry_migrations_total{role="destination",outcome="completed"}"#;
    assert_eq!(must(&arrived, completed), 1.0);
    let full = must(&arrived, r#"ferry_migration_pages_total{kind="full"}"#);
    assert!(full >= 16384.0, "the guest's 64 MiB arrived: {arrived}");
    let dst_stats = dst.ok("GET", "vm.migration-progress", None);
    assert_eq!(
        (dst_stats["job"].as_str(), dst_stats["role"].as_str()),
        (Some("completed"), Some("destination"))
    );

    // The source's VMM exits once the destination runs the VM, as CH's does.
    let mut src = src;
    let status = wait_for("the source to exit", Duration::from_secs(20), || {
        src.child.try_wait().unwrap()
    });
    assert!(status.success());
    let said: Vec<String> = src.events().into_iter().map(|(_, e)| e).collect();
    for e in [
        "starting",
        "booted",
        "paused",
        "resumed",
        "migration-started",
        "migration-finished",
    ] {
        assert!(said.iter().any(|s| s == e), "{e} not in {said:?}");
    }
    assert!(
        src.events()
            .iter()
            .any(|(s, e)| s == "migration" && e == "progress")
    );
    // CH's order at the source: each pre-copy round, the pause at the switch, the end.
    in_order(
        &said,
        &[
            "migration-started",
            "migration-memory-iteration",
            "pausing",
            "paused",
            "migration-finished",
        ],
    );
    let received: Vec<String> = dst.events().into_iter().map(|(_, e)| e).collect();
    in_order(
        &received,
        &[
            "migration-receive-ready",
            "migration-receive-started",
            "restoring",
            "restored",
            "resuming",
            "resumed",
            "migration-receive-finished",
        ],
    );

    // Shutdown keeps the config (CH: Created again); delete forgets it.
    dst.ok("PUT", "vm.shutdown", None);
    assert_eq!(dst.ok("GET", "vm.info", None)["state"], "Created");
    dst.ok("PUT", "vm.delete", None);
    assert_error(dst.call("GET", "vm.info", None), 500, "not created");
    let deleted = scrape(&dst.metrics);
    assert_eq!(
        must(&deleted, completed),
        1.0,
        "the outcome outlives the VM"
    );
    assert_eq!(value(&deleted, r#"ferry_vm_state{state="running"}"#), None);
    dst.ok("PUT", "vmm.shutdown", None);
    for e in [
        "migration-receive-ready",
        "migration-receive-finished",
        "shutdown",
        "deleted",
    ] {
        assert!(dst.said(e), "{e} not in {:?}", dst.events());
    }
}

/// libvirt's `<console type='pty'>` and Virtink's pty console beside a serial: the guest's
/// serial output on a pseudo-terminal whose path `vm.info` names, the same one after a
/// reboot, and in the serial's file too (ferry's console is its serial port).
#[test]
fn a_pty_console_shows_the_guest_across_a_reboot() {
    if !kvm_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let vmm = Vmm::start(dir.path(), "pty");
    let serial = dir.path().join("serial.log");
    let mut both = config("idle serial_ms=100");
    both["serial"] = json!({"mode": "File", "file": serial.display().to_string()});
    both["console"] = json!({"mode": "Pty"});
    vmm.ok("PUT", "vm.create", Some(both));
    vmm.ok("PUT", "vm.boot", None);
    let console = vmm.ok("GET", "vm.info", None)["config"]["console"].clone();
    assert_eq!(console["mode"], "Pty");
    let path = console["file"]
        .as_str()
        .expect("the pty's path")
        .to_string();
    // The boot's memory map, then its progress: read up to there, nothing of it is left.
    wait_for_text(&path, "ferry-guest: hb=");
    let logged = std::fs::read_to_string(&serial).unwrap();
    assert!(
        logged.contains("ferry-guest: e820"),
        "the serial's file too: {logged}"
    );
    vmm.ok("PUT", "vm.reboot", None);
    let again = vmm.ok("GET", "vm.info", None)["config"]["console"]["file"].clone();
    assert_eq!(
        again.as_str(),
        Some(path.as_str()),
        "a reboot keeps the pty"
    );
    wait_for_text(&path, "ferry-guest: e820");
    // vmm.shutdown of a running VM says, as CH's, that the VM shut down and was deleted.
    let before = vmm.events().len();
    vmm.ok("PUT", "vmm.shutdown", None);
    let mut vmm = vmm;
    wait_for("the VMM to exit", Duration::from_secs(20), || {
        vmm.child.try_wait().unwrap()
    });
    let said: Vec<String> = vmm.events()[before..]
        .iter()
        .map(|(s, e)| format!("{s} {e}"))
        .collect();
    assert_eq!(said, ["vm shutdown", "vm deleted", "vmm shutdown"]);
}

/// `events` holds `wanted` in this order (others may come between).
fn in_order(events: &[String], wanted: &[&str]) {
    let mut rest = events.iter();
    for w in wanted {
        assert!(
            rest.any(|e| e == w),
            "{wanted:?} in this order in {events:?}: no {w} where it belongs"
        );
    }
}

/// A snapshot keeps the VM's config beside it (`config.json`, as CH's does): the restored VM
/// writes its serial output where the config says, `vm.info` gives its payload, and it
/// reboots from it. Its NIC comes back on the new tap the restore passes (`net_fds`, as
/// libvirt restores on taps it made anew).
#[test]
fn a_restored_vm_keeps_its_config_and_reboots() {
    if !kvm_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let vmm = Vmm::start(dir.path(), "booted");
    let serial = dir.path().join("serial.log");
    let mut booted = config("idle serial_ms=100");
    booted["serial"] = json!({"mode": "File", "file": serial.display().to_string()});
    vmm.ok("PUT", "vm.create", Some(booted));
    // Its NIC on a tap passed as libvirt passes it, and a new one at the restore.
    let pid = std::process::id() % 100_000;
    let (first, second) = (
        transient_tap(&format!("fyra{pid}")),
        transient_tap(&format!("fyrb{pid}")),
    );
    let add = json!({"mac": "52:54:00:12:34:57"});
    let (status, _) = call_with_files(&vmm.socket, "vm.add-net", &add, &[first.as_raw_fd()]);
    assert_eq!(status, 200);
    vmm.ok("PUT", "vm.boot", None);
    vmm.ok("PUT", "vm.pause", None);
    let snap = dir.path().join("snap");
    std::fs::create_dir_all(&snap).unwrap();
    let to = json!({"destination_url": format!("file://{}", snap.display())});
    vmm.ok("PUT", "vm.snapshot", Some(to));
    assert!(snap.join("config.json").exists());
    drop(vmm);
    std::fs::write(&serial, "").unwrap();
    drop(first);
    let restored = Vmm::start(dir.path(), "restored");
    let source = format!("file://{}", snap.display());
    let none = json!({"source_url": source, "net_fds": [{"id": "_net0", "num_fds": 1}]});
    assert_error(
        call_with_files(&restored.socket, "vm.restore", &none, &[]),
        400,
        "passed 0",
    );
    let from =
        json!({"source_url": source, "resume": true, "net_fds": [{"id": "_net0", "num_fds": 1}]});
    let (status, answer) =
        call_with_files(&restored.socket, "vm.restore", &from, &[second.as_raw_fd()]);
    assert_eq!(status, 204, "{answer}");
    let config = restored.ok("GET", "vm.info", None)["config"].clone();
    assert_eq!(
        config["net"][0]["tap"].as_str(),
        Some(format!("fyrb{pid}").as_str())
    );
    assert_eq!(config["payload"]["kernel"].as_str(), guest().to_str());
    assert_eq!(config["serial"]["file"].as_str(), serial.to_str());
    wait_for(
        "the restored guest on its serial",
        Duration::from_secs(30),
        || {
            let text = std::fs::read_to_string(&serial).unwrap_or_default();
            text.contains("ferry-guest: hb=").then_some(())
        },
    );
    restored.ok("PUT", "vm.reboot", None);
    assert_eq!(restored.ok("GET", "vm.info", None)["state"], "Running");
    wait_for(
        "the rebooted guest on its serial",
        Duration::from_secs(30),
        || {
            let text = std::fs::read_to_string(&serial).unwrap_or_default();
            text.contains("ferry-guest: e820").then_some(())
        },
    );
}

/// Orchestrators exec `cloud-hypervisor`; `make install` links that name to ferry, which
/// then answers as CH: its version line (what libvirt reads) and CH's flags.
#[test]
fn the_cloud_hypervisor_name_answers_as_ch() {
    let dir = tempfile::tempdir().unwrap();
    let link = dir.path().join("cloud-hypervisor");
    std::os::unix::fs::symlink(FERRY, &link).unwrap();
    let out = Command::new(&link).arg("--version").output().unwrap();
    let line = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && line.starts_with("cloud-hypervisor v54.0.0"),
        "{line}"
    );
    let bad = Command::new(&link).arg("--frobnicate").output().unwrap();
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("--frobnicate"));
}

/// libvirt's NICs: it makes the tap and passes its open file with `vm.add-net` before
/// `vm.boot` (`SCM_RIGHTS`). The NIC boots on that file: the tap is transient and attached
/// by the file, so attaching to it by name would be refused as busy.
#[test]
fn a_nic_passed_as_a_tap_file_boots_with_the_vm() {
    if !kvm_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let vmm = Vmm::start(dir.path(), "nic");
    let name = format!("fyln{}", std::process::id() % 100_000);
    let tap = transient_tap(&name);
    let add = json!({"mac": "52:54:00:12:34:56", "num_queues": 2});
    assert_error(
        call_with_files(&vmm.socket, "vm.add-net", &add, &[tap.as_raw_fd()]),
        500,
        "not created",
    );
    vmm.ok("PUT", "vm.create", Some(config("idle")));
    let two = [tap.as_raw_fd(), tap.as_raw_fd()];
    assert_error(
        call_with_files(&vmm.socket, "vm.add-net", &add, &two),
        400,
        "one queue pair",
    );
    let (status, answer) = call_with_files(&vmm.socket, "vm.add-net", &add, &[tap.as_raw_fd()]);
    assert_eq!(
        (status, answer["id"].as_str()),
        (200, Some("_net0")),
        "{answer}"
    );
    let net = vmm.ok("GET", "vm.info", None)["config"]["net"][0].clone();
    assert_eq!(
        (net["tap"].as_str(), net["mac"].as_str()),
        (Some(name.as_str()), Some("52:54:00:12:34:56"))
    );
    vmm.ok("PUT", "vm.boot", None);
    assert!(vmm.ok("GET", "vm.counters", None)["_net0"].is_object());
    assert_error(
        call_with_files(&vmm.socket, "vm.add-net", &add, &[tap.as_raw_fd()]),
        400,
        "no hotplug",
    );
    assert_error(
        call_with_files(&vmm.socket, "vm.pause", &json!({}), &[tap.as_raw_fd()]),
        400,
        "takes no files",
    );
}

/// A tap that lives as long as the file returned (made by attaching to a new name).
fn transient_tap(name: &str) -> std::fs::File {
    #[repr(C)]
    struct IfReq {
        name: [u8; 16],
        flags: libc::c_short,
        _pad: [u8; 22],
    }
    let tun = std::fs::File::options()
        .read(true)
        .write(true)
        .open("/dev/net/tun")
        .expect("/dev/net/tun");
    let mut req = IfReq {
        name: [0; 16],
        flags: 0x0002 | 0x1000, // IFF_TAP | IFF_NO_PI
        _pad: [0; 22],
    };
    req.name[..name.len()].copy_from_slice(name.as_bytes());
    // SAFETY: TUNSETIFF reads and writes an ifreq, which `req` is, alive for the call.
    let set = unsafe { libc::ioctl(tun.as_raw_fd(), 0x4004_54ca, &mut req) };
    assert_eq!(
        set,
        0,
        "TUNSETIFF {name}: {}",
        std::io::Error::last_os_error()
    );
    tun
}

/// `PUT endpoint` with `body`, passing `files` with the request in one `sendmsg`, as
/// libvirt does.
fn call_with_files(
    socket: &Path,
    endpoint: &str,
    body: &Value,
    files: &[std::os::fd::RawFd],
) -> (u16, Value) {
    let s = UnixStream::connect(socket).unwrap();
    let body = body.to_string();
    let request = format!(
        "PUT /api/v1/{endpoint} HTTP/1.1\r\nHost: localhost\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    sockets::passed::send_with_files(&s, request.as_bytes(), files).unwrap();
    let mut answer = String::new();
    (&s).read_to_string(&mut answer).unwrap();
    let status = answer[9..12].parse().unwrap();
    let text = answer.split_once("\r\n\r\n").map_or("", |(_, b)| b);
    (status, serde_json::from_str(text).unwrap_or(Value::Null))
}

/// Reads the terminal at `path` until `text` comes.
fn wait_for_text(path: &str, text: &str) {
    use std::os::unix::fs::OpenOptionsExt;
    let mut tty = std::fs::File::options()
        .read(true)
        .custom_flags(libc::O_NOCTTY | libc::O_NONBLOCK)
        .open(path)
        .unwrap();
    let mut seen = Vec::new();
    wait_for(text, Duration::from_secs(30), || {
        let mut buf = [0u8; 4096];
        while let Ok(n @ 1..) = tty.read(&mut buf) {
            seen.extend_from_slice(&buf[..n]);
        }
        String::from_utf8_lossy(&seen).contains(text).then_some(())
    });
}

/// CH's `tls_dir` (its file names) over ferry's certificates: one directory for both sides.
/// CH's local migration is ferry's live update: an empty VMM takes the VM over with its
/// memory (`memory.shared`) and its disk, no page copied.
#[test]
fn a_live_update_through_the_profile() {
    if !kvm_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let disk = scratch_disk(dir.path());
    let src = Vmm::start(dir.path(), "src");
    let mut vm = config(&format!(
        "write ws=16M seq verify blk blk_sectors={SECTORS}"
    ));
    vm["memory"]["shared"] = json!(true);
    vm["disks"] = json!([{"path": disk}]);
    // A socket the old process still serves while it hands the VM over: the new one cannot
    // listen there, and the VM moves all the same, its serial port going nowhere.
    let serial = dir.path().join("serial.sock");
    vm["serial"] = json!({"mode": "Socket", "socket": serial});
    src.ok("PUT", "vm.create", Some(vm));
    src.ok("PUT", "vm.boot", None);
    verifies(&src, "before the update");
    let dst = Vmm::start(dir.path(), "dst");
    let url = format!("unix:{}", dir.path().join("update.sock").display());
    let receiver = receive(&dst, json!({"receiver_url": url}));
    let postcopy = json!({"destination_url": url, "local": true, "memory_mode": "Postcopy"});
    assert_error(
        src.call("PUT", "vm.send-migration", Some(postcopy)),
        400,
        "copies no memory",
    );
    src.ok(
        "PUT",
        "vm.send-migration",
        Some(json!({"destination_url": url, "local": true})),
    );
    let (status, answer) = receiver.join().unwrap();
    assert_eq!(status, 204, "{answer}");
    let mut src = src;
    let status = wait_for("the source to exit", Duration::from_secs(20), || {
        src.child.try_wait().unwrap()
    });
    assert!(status.success());
    let arrived = scrape(&dst.metrics);
    let full = value(&arrived, r#"ferry_migration_pages_total{kind="full"}"#);
    assert!(matches!(full, None | Some(0.0)), "no page copied: {full:?}");
    verifies(&dst, "after the update");
    let info = dst.ok("GET", "vm.info", None);
    assert_eq!(info["config"]["serial"]["mode"], "Off", "{info}");
}

/// A peer does not choose host files: a receiver opens an arriving VM's disks only beneath
/// the directories its own operator allowed, after resolving links, and refuses the VM before
/// a page crosses, naming the path; the VM runs on at the source.
#[test]
fn a_receiver_opens_only_disks_its_operator_allowed() {
    if !kvm_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (allowed, other, outside) = (
        dir.path().join("allowed"),
        dir.path().join("other"),
        dir.path().join("outside"),
    );
    for d in [&allowed, &other, &outside] {
        std::fs::create_dir(d).unwrap();
    }
    let secret = outside.join("secret.img");
    std::fs::File::create(&secret)
        .and_then(|f| f.set_len(4 << 20))
        .unwrap();
    let link = allowed.join("link.img");
    std::os::unix::fs::symlink(&secret, &link).unwrap();
    let src = Vmm::start_allowing(dir.path(), "src", &outside);
    let mut vm = config(&format!(
        "write ws=16M seq verify blk blk_sectors={SECTORS}"
    ));
    vm["disks"] = json!([{"path": link}]);
    src.ok("PUT", "vm.create", Some(vm));
    src.ok("PUT", "vm.boot", None);
    verifies(&src, "before any move");
    // The guest's driver set the disk up: said as CH says it, with the disk's id.
    let activated = std::fs::read_to_string(&src.events).unwrap();
    assert!(
        activated
            .lines()
            .any(|l| l.contains(r#""source":"virtio-device""#)
                && l.contains(r#""event":"activated""#)
                && l.contains(r#""id":"_disk0""#)),
        "{activated}"
    );

    let refusals = [
        (&allowed, "resolves to"), // through a link out of the allowed directory
        (&other, "is outside the directories"),
    ];
    for (n, (allow, words)) in refusals.into_iter().enumerate() {
        let dst = Vmm::start_allowing(dir.path(), &format!("dst{n}"), allow);
        let url = format!("unix:{}", dir.path().join(format!("m{n}.sock")).display());
        let receiver = receive(&dst, json!({"receiver_url": url}));
        // The sender hears the refusal in the handshake, in the receiver's words.
        let sent = src.call(
            "PUT",
            "vm.send-migration",
            Some(json!({"destination_url": url})),
        );
        assert_error(sent, 500, words);
        let (status, answer) = receiver.join().unwrap();
        let text = answer.to_string();
        assert!(status >= 400 && text.contains(words), "{status} {text}");
        assert!(
            text.contains("link.img"),
            "the refusal names the path: {text}"
        );
        assert_error(dst.call("GET", "vm.info", None), 500, "not created");
        let failed = || {
            src.events()
                .iter()
                .filter(|(_, e)| e == "migration-failed")
                .count()
        };
        wait_for(
            "the source to see the refusal",
            Duration::from_secs(30),
            || (failed() > n).then_some(()),
        );
        assert_eq!(src.ok("GET", "vm.info", None)["state"], "Running");
        verifies(&src, "after a refused move");
    }

    let dst = moved(&src, dir.path(), "dst", &outside);
    verifies(&dst, "after the allowed move");
    let disks = &dst.ok("GET", "vm.info", None)["config"]["disks"];
    assert_eq!(disks[0]["path"], secret.to_str().unwrap(), "{disks}");
}

/// A VM moves with its config (`Config` in ferry's stream), as CH's does: the destination's
/// `vm.info` gives its payload and its console, a pty there too, and it reboots from its
/// payload. The destination opens what the config names only beneath the directories its
/// operator allows, as it does the disks: a serial file outside them refuses the VM before
/// it moves.
#[test]
fn a_migrated_vm_brings_its_config_and_reboots_there() {
    if !kvm_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (payload, logs) = (dir.path().join("payload"), dir.path().join("logs"));
    std::fs::create_dir(&payload).unwrap();
    std::fs::create_dir(&logs).unwrap();
    let kernel = payload.join("guest.elf");
    std::fs::copy(guest(), &kernel).unwrap();
    let serial = logs.join("serial.log");
    let src = Vmm::start(dir.path(), "src");
    let cmdline = "write ws=16M seq verify serial_ms=100";
    let mut vm = config(cmdline);
    vm["payload"]["kernel"] = json!(kernel);
    vm["serial"] = json!({"mode": "File", "file": serial});
    vm["console"] = json!({"mode": "Pty"});
    src.ok("PUT", "vm.create", Some(vm));
    src.ok("PUT", "vm.boot", None);
    verifies(&src, "before any move");

    let refusing = Vmm::start_allowing(dir.path(), "refusing", &payload);
    let url = format!("unix:{}", dir.path().join("m0.sock").display());
    let receiver = receive(&refusing, json!({"receiver_url": url}));
    let sent = src.call(
        "PUT",
        "vm.send-migration",
        Some(json!({"destination_url": url})),
    );
    assert_error(sent, 500, "serial file");
    let (status, answer) = receiver.join().unwrap();
    assert!(
        status >= 400 && answer.to_string().contains("--allow-disk-dir"),
        "{answer}"
    );
    wait_for(
        "the source to see the refusal",
        Duration::from_secs(30),
        || src.said("migration-failed").then_some(()),
    );
    verifies(&src, "after a refused move");

    let dst = moved(&src, dir.path(), "dst", dir.path());
    verifies(&dst, "after the move");
    let config = dst.ok("GET", "vm.info", None)["config"].clone();
    assert_eq!(
        config["payload"]["kernel"],
        kernel.to_str().unwrap(),
        "{config}"
    );
    assert_eq!(config["payload"]["cmdline"], cmdline, "{config}");
    assert_eq!(
        config["serial"]["file"],
        serial.to_str().unwrap(),
        "{config}"
    );
    let pty = config["console"]["file"]
        .as_str()
        .expect("a pty here")
        .to_string();
    dst.ok("PUT", "vm.reboot", None);
    wait_for_text(&pty, "ferry-guest: e820");
    verifies(&dst, "after a reboot where it arrived");
}

/// `vm.send-migration` with `copy_storage` (ferry's extension): the disk moves in the stream
/// to the destination's own disk at the same path (here, a mount namespace holds another file
/// there), the guest reads every sector it wrote back right there (`verifies`), and the rest
/// of it equals the source's; the source's file is left as the source had it.
#[test]
fn a_disk_moves_with_its_vm_through_the_profile() {
    if !kvm_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (disk, target) = (dir.path().join("disk.img"), dir.path().join("target.img"));
    // The guest stamps the first sectors, which must read zero until it has; data after them.
    let workload = (SECTORS * 512) as usize;
    let data: Vec<u8> = (0..4u32 << 20)
        .map(|i| match i as usize {
            i if i < workload => 0,
            i => (i.wrapping_mul(2654435761) >> 24) as u8 | 1,
        })
        .collect();
    std::fs::write(&disk, &data).unwrap();
    std::fs::write(&target, vec![0xEE; data.len()]).unwrap();
    let src = Vmm::start(dir.path(), "src");
    let mut vm = config(&format!(
        "write ws=16M seq verify blk blk_sectors={SECTORS}"
    ));
    vm["disks"] = json!([{"path": disk}]);
    src.ok("PUT", "vm.create", Some(vm));
    src.ok("PUT", "vm.boot", None);
    verifies(&src, "before the move");

    let dst = Vmm::start_with_file_at(dir.path(), "dst", &disk, &target);
    let url = format!("unix:{}", dir.path().join("m.sock").display());
    let receiver = receive(&dst, json!({"receiver_url": url}));
    src.ok(
        "PUT",
        "vm.send-migration",
        Some(json!({"destination_url": url, "copy_storage": true})),
    );
    let (status, answer) = receiver.join().unwrap();
    assert_eq!(status, 204, "{answer}");
    verifies(&dst, "after the move, reading its own disk");
    let disks = &dst.ok("GET", "vm.info", None)["config"]["disks"];
    assert_eq!(disks[0]["path"], disk.to_str().unwrap(), "{disks}");
    let arrived = std::fs::read(&target).unwrap();
    assert!(
        arrived[workload..] == data[workload..],
        "the disk beyond what the guest writes arrived as the source had it"
    );
    let left = std::fs::read(&disk).unwrap();
    assert!(
        left[workload..] == data[workload..],
        "the source's disk is its own"
    );
}

/// `src`'s VM moved to a new VMM `name` in `dir` that allows files beneath `allow`.
fn moved(src: &Vmm, dir: &Path, name: &str, allow: &Path) -> Vmm {
    let dst = Vmm::start_allowing(dir, name, allow);
    let url = format!("unix:{}", dir.join(format!("{name}-in.sock")).display());
    let receiver = receive(&dst, json!({"receiver_url": url}));
    src.ok(
        "PUT",
        "vm.send-migration",
        Some(json!({"destination_url": url})),
    );
    let (status, answer) = receiver.join().unwrap();
    assert_eq!(status, 204, "{answer}");
    dst
}

fn tls_dir(dir: &Path) -> PathBuf {
    let made = dir.join("made");
    certs(&made, &["127.0.0.1", "client"]);
    let tls = dir.join("tls");
    std::fs::create_dir_all(&tls).unwrap();
    for (from, to) in [
        ("ca.pem", "ca-cert.pem"),
        ("127.0.0.1.pem", "server-cert.pem"),
        ("127.0.0.1.key", "server-key.pem"),
        ("client.pem", "client-cert.pem"),
        ("client.key", "client-key.pem"),
    ] {
        std::fs::copy(made.join(from), tls.join(to)).unwrap();
    }
    tls
}

/// Sectors the guest's disk workload cycles over: each is read back every cycle.
const SECTORS: u64 = 256;

/// Waits until the guest of `vmm` has made two more passes, none finding its memory wrong,
/// and, where it has a disk, read every sector back once more, none wrong.
fn verifies(vmm: &Vmm, what: &str) {
    let counters = || vmm.ok("GET", "vm.counters", None);
    let from = wait_for("guest counters", Duration::from_secs(30), || {
        let c = counters();
        c["guest"]["passes"].is_u64().then_some(c)
    });
    let passes = |c: &Value| c["guest"]["passes"].as_u64().unwrap();
    let reads = |c: &Value| c["_disk0"]["reads"].as_u64();
    wait_for(what, Duration::from_secs(60), || {
        let c = counters();
        let g = &c["guest"];
        assert_eq!(g["verify_errors"], 0, "{what}: memory wrong: {g}");
        assert_eq!(
            g["blk_errors"], 0,
            "{what}: disk sectors read back wrong: {g}"
        );
        let disk_read = match (reads(&from), reads(&c)) {
            (Some(before), Some(now)) => now > before + SECTORS,
            (None, None) => true,
            _ => panic!("{what}: the disk came or went: {from} then {c}"),
        };
        (passes(&c) >= passes(&from) + 2 && disk_read).then_some(())
    });
}

/// A receiver waiting in `vm.receive-migration` on its own thread, once it listens.
fn receive(vmm: &Vmm, body: Value) -> std::thread::JoinHandle<(u16, Value)> {
    let socket = vmm.socket.clone();
    let receiver =
        std::thread::spawn(move || call(&socket, "PUT", "vm.receive-migration", Some(body)));
    wait_for("the destination to listen", Duration::from_secs(10), || {
        vmm.said("migration-receive-ready").then_some(())
    });
    receiver
}

#[test]
fn tls_cancel_snapshot_and_restore_through_the_profile() {
    if !kvm_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let tls = tls_dir(dir.path());

    // A receiver cancelled while it waits answers with an error and leaves an empty VMM.
    let waiter = Vmm::start(dir.path(), "waiter");
    let url = format!("unix:{}", dir.path().join("waiter.sock.m").display());
    let waiting = receive(&waiter, json!({"receiver_url": url}));
    waiter.ok("PUT", "vm.cancel-migration", None);
    let (status, answer) = waiting.join().unwrap();
    assert!(
        status >= 400,
        "a cancelled receive answered {status} {answer}"
    );
    assert_error(waiter.call("GET", "vm.info", None), 500, "not created");
    assert_eq!(waiter.call("GET", "vmm.ping", None).0, 200);

    // A VM that arrived without TLS (over plain TCP) goes on over TCP with CH's tls_dir
    // on both sides: TLS is the request's, not the arrival's. Its disk goes with it: each
    // empty VMM builds the devices the source names.
    // Its disk is shared storage: every host opens the same file, as the source named it.
    let first = Vmm::start(dir.path(), "first");
    let disk = scratch_disk(dir.path());
    let mut with_disk = config(&format!(
        "write ws=32M seq verify blk blk_sectors={SECTORS}"
    ));
    with_disk["disks"] = json!([{"path": disk}]);
    first.ok("PUT", "vm.create", Some(with_disk));
    first.ok("PUT", "vm.boot", None);
    verifies(&first, "the first host's guest");
    let src = Vmm::start(dir.path(), "src");
    // The first hop over plain TCP, as CH migrates without tls_dir.
    let url = format!("tcp:127.0.0.1:{}", free_port());
    let receiver = receive(&src, json!({"receiver_url": url}));
    first.ok(
        "PUT",
        "vm.send-migration",
        Some(json!({"destination_url": url})),
    );
    let (status, answer) = receiver.join().unwrap();
    assert_eq!(status, 204, "{answer}");
    verifies(&src, "the guest after a plain TCP hop");
    let dst = Vmm::start(dir.path(), "dst");
    let url = format!("tcp:127.0.0.1:{}", free_port());
    let tls_dir = tls.to_str().unwrap();
    let receiver = receive(&dst, json!({"receiver_url": url, "tls_dir": tls_dir}));
    let send = json!({"destination_url": url, "tls_dir": tls_dir});
    src.ok("PUT", "vm.send-migration", Some(send));
    let (status, answer) = receiver.join().unwrap();
    assert_eq!(status, 204, "{answer}");
    verifies(&dst, "the guest after a TLS move");
    let disks = &dst.ok("GET", "vm.info", None)["config"]["disks"];
    assert_eq!(disks[0]["path"], disk.to_str().unwrap(), "{disks}");

    // A snapshot of the paused VM through file://, restored into an empty VMM.
    let snap = dir.path().join("snap");
    std::fs::create_dir_all(&snap).unwrap();
    let to = json!({"destination_url": format!("file://{}", snap.display())});
    assert_eq!(dst.call("PUT", "vm.snapshot", Some(to.clone())).0, 500);
    dst.ok("PUT", "vm.pause", None);
    dst.ok("PUT", "vm.snapshot", Some(to));
    assert!(dst.said("snapshotted"), "{:?}", dst.events());
    dst.ok("PUT", "vm.delete", None);
    let restored = Vmm::start(dir.path(), "restored");
    let from = json!({"source_url": format!("file://{}", snap.display())});
    restored.ok("PUT", "vm.restore", Some(from));
    assert_eq!(restored.ok("GET", "vm.info", None)["state"], "Paused");
    restored.ok("PUT", "vm.resume", None);
    verifies(&restored, "the restored guest");
    assert!(restored.said("restored"), "{:?}", restored.events());
}

/// A reboot lets go of the old VM's disk before the new boot takes it: boot after boot, the
/// disk's lock is free for the next one, and the guest reads back what it wrote.
#[test]
fn a_vm_with_a_disk_reboots_again_and_again() {
    if !kvm_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let disk = scratch_disk(dir.path());
    let vmm = Vmm::start(dir.path(), "reboots");
    let mut vm = config(&format!("write ws=4M seq verify blk blk_sectors={SECTORS}"));
    vm["disks"] = json!([{"path": disk}]);
    vmm.ok("PUT", "vm.create", Some(vm));
    vmm.ok("PUT", "vm.boot", None);
    for reboot in 0..20 {
        vmm.ok("PUT", "vm.reboot", None);
        assert_eq!(
            vmm.ok("GET", "vm.info", None)["state"],
            "Running",
            "reboot {reboot}"
        );
    }
    verifies(&vmm, "after 20 reboots");
}

/// `ferry ch --landlock` reaches only what its flags name (its sockets, event file, the
/// `--allow-disk-dir` directory and the `--landlock-rules` path): a VM whose disk lies
/// elsewhere is refused, naming the disk, as is a snapshot written elsewhere; a VM whose disk
/// lies in the allowed directory boots, writes and verifies its memory and disk, and is
/// snapshotted there.
#[test]
fn a_landlocked_vmm_opens_only_what_its_flags_name() {
    if !kvm_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let outside = tempfile::tempdir().unwrap();
    let vmm = Vmm::start_landlocked(dir.path(), "landlocked", Path::new(&guest()));
    let vm = |disk: &Path| {
        let mut vm = config(&format!("write ws=4M seq verify blk blk_sectors={SECTORS}"));
        vm["disks"] = json!([{"path": disk}]);
        vm
    };
    let foreign = scratch_disk(outside.path());
    vmm.ok("PUT", "vm.create", Some(vm(&foreign)));
    let refused = vmm.call("PUT", "vm.boot", None);
    assert!(refused.0 >= 400, "a disk outside booted: {}", refused.1);
    let said = refused.1.to_string();
    assert!(
        said.contains(foreign.to_str().unwrap()) && said.contains("ermission denied"),
        "{said}"
    );
    vmm.ok("PUT", "vm.delete", None);

    vmm.ok("PUT", "vm.create", Some(vm(&scratch_disk(dir.path()))));
    vmm.ok("PUT", "vm.boot", None);
    verifies(&vmm, "a landlocked VM");
    vmm.ok("PUT", "vm.pause", None);
    let to = |d: &Path| json!({"destination_url": format!("file://{}", d.display())});
    let refused = vmm.call("PUT", "vm.snapshot", Some(to(outside.path())));
    assert!(
        refused.0 >= 400,
        "a snapshot outside was written: {}",
        refused.1
    );
    assert_eq!(std::fs::read_dir(outside.path()).unwrap().count(), 1);
    let snap = dir.path().join("snap");
    std::fs::create_dir(&snap).unwrap();
    vmm.ok("PUT", "vm.snapshot", Some(to(&snap)));
    vmm.ok("PUT", "vm.resume", None);
    verifies(&vmm, "after its snapshots");
}

/// A real Linux kernel moves between two VMMs driven only through the profile, as an
/// orchestrator drives them: booted by `vm.create` from its payload with its root filesystem
/// on virtio-blk and its NIC on a testbed host's tap, sent to a VMM on the other host. There
/// its native writer goes on with every page it stamped intact, it reads its file from the
/// disk through the new VMM's virtio-blk, and its kernel answers on the NIC.
#[test]
fn a_linux_guest_moves_through_the_profile() {
    if !kvm_available() {
        return;
    }
    let Some(guest) = linux_guest() else { return };
    let bed = Testbed::new("lnxch", 2);
    bed.address_switch(SWITCH_CIDR);
    let root = root_copy(&guest);
    let dir = root.parent().unwrap();
    let serial = dir.join("serial.log");
    let console = || std::fs::read_to_string(&serial).unwrap_or_default();
    let src = Vmm::start_in_netns(dir, "src", &bed.hosts[0]);
    let vm = json!({
        "payload": {"kernel": guest.vmlinux, "cmdline": test_cmdline(&guest)},
        "cpus": {"boot_vcpus": 1, "max_vcpus": 1},
        "memory": {"size": 256u64 << 20, "shared": true},
        "disks": [{"path": root}],
        "net": [{"tap": testbed::TAP}],
        "serial": {"mode": "File", "file": serial},
        "console": {"mode": "Off"},
    });
    src.ok("PUT", "vm.create", Some(vm));
    src.ok("PUT", "vm.boot", None);
    let writer = |vmm: &Vmm, what: &str, pred: &dyn Fn(&Writer) -> bool| {
        wait_writer_header(vmm.child.id(), what, LINUX_LIMIT, pred, console)
    };
    let before = writer(&src, "/init's first passes", &|w| w.passes >= 3);

    let dst = Vmm::start_in_netns(dir, "dst", &bed.hosts[1]);
    let url = format!("unix:{}", dir.join("move.sock").display());
    let receiver = receive(&dst, json!({"receiver_url": url}));
    src.ok(
        "PUT",
        "vm.send-migration",
        Some(json!({"destination_url": url})),
    );
    let (status, answer) = receiver.join().unwrap();
    assert_eq!(status, 204, "{answer}");

    let after = writer(&dst, "the writer where it arrived", &|w| {
        w.passes >= before.passes + 3 && w.file_pages >= before.file_pages + 8
    });
    assert_eq!((after.errors, after.first_bad), (0, 0), "{after:?}");
    assert_eq!(after.file_errors, 0, "{after:?}");
    // A read reaches the new VMM's virtio-blk once the kernel's readahead window is used up.
    wait_for("a read through the new VMM", LINUX_LIMIT, || {
        let reads = dst.ok("GET", "vm.counters", None)["_disk0"]["reads"].as_u64();
        reads.filter(|&r| r > 0)
    });
    let read_on = writer(&dst, "the file read on", &|w| {
        w.file_pages >= after.file_pages + 8
    });
    assert_eq!(read_on.file_errors, 0, "{read_on:?}");
    assert!(bed.knock(GUEST_IP, 10), "the guest answers on its NIC");
    drop(dst);
    drop(src);
    remove_root(&root);
}

/// A Linux boot or step's bound: ring 0 runs in KVM's emulator on the development host, and
/// the kernel reaches /init in about two minutes. It bounds a hang; it measures nothing.
const LINUX_LIMIT: Duration = Duration::from_secs(600);

/// A 4 MiB disk file, all zeros, in `dir`.
fn scratch_disk(dir: &Path) -> PathBuf {
    let disk = dir.join("disk.img");
    std::fs::File::create(&disk)
        .and_then(|f| f.set_len(4 << 20))
        .unwrap();
    disk
}
