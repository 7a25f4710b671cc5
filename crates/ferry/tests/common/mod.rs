//! Helpers for end-to-end tests that start real ferry processes.
#![allow(dead_code)]

pub mod ch_api;
pub mod linux;
pub mod relay;
pub mod scrape;
pub mod testbed;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::time::{Duration, Instant};

use api::{ApiClient, VmInfo};

pub const FERRY: &str = env!("CARGO_BIN_EXE_ferry");

pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The workload guest, built by `make -C guest` if it is not there yet.
pub fn guest() -> PathBuf {
    guest_image("guest.elf")
}

/// One of the workload guest's images in guest/build (`guest.elf`, or `guest-app.elf`: the
/// same with the memory sample that fill=real copies), built if it is not there yet.
pub fn guest_image(name: &str) -> PathBuf {
    let path = repo_root().join("guest/build").join(name);
    if !path.exists() {
        let ok = Command::new("make")
            .arg("-s")
            .arg("-C")
            .arg(repo_root().join("guest"))
            .status()
            .map(|s| s.success())
            .unwrap_or(false);
        assert!(ok, "building the workload guest failed");
    }
    path
}

/// False (with a loud message) when /dev/kvm is missing outside CI; in CI that is a failure.
pub fn kvm_available() -> bool {
    if Path::new("/dev/kvm").exists() {
        return true;
    }
    assert!(
        std::env::var("CI").is_err(),
        "/dev/kvm is missing in CI: KVM tests cannot run"
    );
    eprintln!("\n*** SKIPPED: /dev/kvm is absent; this test needs KVM ***\n");
    false
}

/// False (with a loud message) when QEMU is missing outside CI; in CI that is a failure.
pub fn qemu_available() -> bool {
    if Command::new("qemu-system-x86_64")
        .arg("--version")
        .output()
        .is_ok()
    {
        return true;
    }
    assert!(std::env::var("CI").is_err(), "QEMU is missing in CI");
    eprintln!("\n*** SKIPPED: qemu-system-x86_64 is absent (make test installs it) ***\n");
    false
}

/// Polls `f` every 20 ms until it returns Some, or panics after `timeout` naming `what`.
pub fn wait_for<T>(what: &str, timeout: Duration, mut f: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A ferry process that is killed when the test lets go of it.
pub struct Ferry {
    pub child: Option<Child>,
    pub socket: PathBuf,
    pub serial: PathBuf,
    _dir: tempfile::TempDir,
}

pub struct VmSpec<'a> {
    pub memory: &'a str,
    pub vcpus: usize,
    pub cmdline: &'a str,
    /// Serve the test hooks (`--enable-debug-api`).
    pub debug_api: bool,
    /// `anonymous` or `memfd`.
    pub memory_backend: &'a str,
    /// The image: `guest.elf`, or `guest-app.elf` for fill=real.
    pub image: &'a str,
}

impl Default for VmSpec<'_> {
    fn default() -> Self {
        Self {
            memory: "1G",
            vcpus: 1,
            cmdline: "idle",
            debug_api: false,
            memory_backend: "anonymous",
            image: "guest.elf",
        }
    }
}

impl Ferry {
    /// `ferry run` with extra arguments; waits until the API answers.
    pub fn start(extra: &[&str]) -> Ferry {
        Ferry::start_in(Command::new(FERRY), extra)
    }

    /// `ferry run` of another build (`binary`), as `start` does.
    pub fn start_as(binary: &Path, extra: &[&str]) -> Ferry {
        Ferry::start_in(Command::new(binary), extra)
    }

    /// The same inside network namespace `ns` (its API socket is a file: reachable from here).
    pub fn start_in_netns(ns: &str, extra: &[&str]) -> Ferry {
        let mut ip = Command::new("ip");
        ip.args(["netns", "exec", ns, FERRY]);
        Ferry::start_in(ip, extra)
    }

    fn start_in(mut command: Command, extra: &[&str]) -> Ferry {
        let dir = tempfile::tempdir().expect("tempdir");
        let socket = dir.path().join("api.sock");
        let serial = dir.path().join("serial.log");
        let stderr = std::fs::File::create(dir.path().join("stderr.log")).expect("stderr log");
        let child = command
            .arg("run")
            .arg("--api-socket")
            .arg(&socket)
            .arg("--serial")
            .arg(&serial)
            .args(extra)
            .arg("--snapshot-dir")
            .arg(dir.path())
            // TCP tests run without TLS unless they bring certificates (tls.rs does).
            .args(if extra.contains(&"--tls-cert") {
                &[][..]
            } else {
                &["--plain-tcp"][..]
            })
            .stdin(Stdio::null())
            .stderr(stderr)
            .spawn()
            .expect("spawn ferry");
        let mut ferry = Ferry {
            child: Some(child),
            socket,
            serial,
            _dir: dir,
        };
        ferry.wait_api();
        ferry
    }

    /// Another process in a ferry's place whose API never answers (its socket is never
    /// made): for tests of the tests, which must not take silence for an answer.
    pub fn stand_in(mut command: Command) -> Ferry {
        let dir = tempfile::tempdir().expect("tempdir");
        let child = command
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .spawn()
            .expect("spawn a stand-in");
        Ferry {
            child: Some(child),
            socket: dir.path().join("api.sock"),
            serial: dir.path().join("serial.log"),
            _dir: dir,
        }
    }

    /// A destination waiting for one migration at `url`.
    pub fn incoming(url: &str) -> Ferry {
        Ferry::start(&["--incoming", url])
    }

    /// A 256 MiB guest running `cmdline` (a disk workload) on the disk `--disk disk` names,
    /// once it has written `sectors` sectors.
    pub fn disk_writer(cmdline: &str, disk: &str, sectors: u64) -> Ferry {
        let guest = guest();
        let vm = Ferry::start(&[
            "--guest",
            guest.to_str().unwrap(),
            "--memory",
            "256M",
            "--cmdline",
            cmdline,
            "--disk",
            disk,
        ]);
        vm.wait_info("a first round of the disk", Duration::from_secs(60), |i| {
            i.blk_writes >= sectors
        });
        vm
    }

    /// A one-vCPU, 1 GiB guest running `cmdline` that has finished its first pass.
    pub fn writer(cmdline: &str) -> Ferry {
        let ferry = Ferry::boot(VmSpec {
            cmdline,
            ..Default::default()
        });
        ferry.wait_info("a first pass", Duration::from_secs(60), |i| i.passes >= 1);
        ferry
    }

    pub fn boot(spec: VmSpec) -> Ferry {
        Ferry::boot_with(spec, &[])
    }

    /// `boot` with more `ferry run` arguments (TLS credentials, say).
    pub fn boot_with(spec: VmSpec, extra: &[&str]) -> Ferry {
        let guest = guest_image(spec.image);
        let vcpus = spec.vcpus.to_string();
        let mut args = vec![
            "--guest",
            guest.to_str().unwrap(),
            "--memory",
            spec.memory,
            "--vcpus",
            &vcpus,
            "--cmdline",
            spec.cmdline,
            "--memory-backend",
            spec.memory_backend,
        ];
        if spec.debug_api {
            args.push("--enable-debug-api");
        }
        args.extend_from_slice(extra);
        Ferry::start(&args)
    }

    fn wait_api(&mut self) {
        let socket = self.socket.clone();
        let child = self.child.as_mut().unwrap();
        wait_for("the ferry API socket", Duration::from_secs(20), || {
            if let Ok(Some(status)) = child.try_wait() {
                panic!("ferry exited early: {status}");
            }
            ApiClient::new(&socket).get("vm.info").ok()
        });
    }

    pub fn api(&self) -> ApiClient {
        ApiClient::new(&self.socket)
    }

    pub fn info(&self) -> VmInfo {
        let v = self.api().get("vm.info").expect("vm.info");
        serde_json::from_value(v).expect("vm.info body")
    }

    pub fn put(&self, endpoint: &str) {
        self.api().put(endpoint, None).expect(endpoint);
    }

    /// Waits until `pred` holds for vm.info; returns that info.
    pub fn wait_info(
        &self,
        what: &str,
        timeout: Duration,
        pred: impl Fn(&VmInfo) -> bool,
    ) -> VmInfo {
        wait_for(what, timeout, || {
            let info = self.info();
            pred(&info).then_some(info)
        })
    }

    /// How many threads (but the API's kept request threads) and open file descriptors the
    /// process has now.
    pub fn threads_and_fds(&self) -> (usize, usize) {
        let pid = self.child.as_ref().expect("a running ferry").id();
        let fds = std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(usize::MAX, |d| d.count());
        // The API keeps a thread for each connection it served at once (at most 64), for the
        // next: as many as the clients' busiest moment, not a leak.
        let threads = std::fs::read_dir(format!("/proc/{pid}/task")).map_or(usize::MAX, |d| {
            d.flatten()
                .filter(|t| {
                    std::fs::read_to_string(t.path().join("comm"))
                        .is_ok_and(|name| name.trim() != "api-request")
                })
                .count()
        });
        (threads, fds)
    }

    pub fn wait_exit(&mut self, timeout: Duration) -> ExitStatus {
        let child = self.child.as_mut().unwrap();
        wait_for("ferry to exit", timeout, || child.try_wait().ok().flatten())
    }

    pub fn is_running(&mut self) -> bool {
        matches!(self.child.as_mut().map(|c| c.try_wait()), Some(Ok(None)))
    }

    pub fn serial_text(&self) -> String {
        std::fs::read_to_string(&self.serial).unwrap_or_default()
    }

    pub fn stderr_text(&self) -> String {
        std::fs::read_to_string(self._dir.path().join("stderr.log")).unwrap_or_default()
    }

    /// A path for sockets or files that lives as long as this process's scratch directory.
    pub fn scratch(&self, name: &str) -> PathBuf {
        self._dir.path().join(name)
    }

    /// `ferry snapshot --json` of this VM into its scratch folder as `name`, which must
    /// succeed; returns the file and the command's output.
    pub fn snapshot(&self, name: &str) -> (PathBuf, Output) {
        self.snapshot_with(name, &[])
    }

    /// A snapshot with `extra` flags (compression, threads).
    pub fn snapshot_with(&self, name: &str, extra: &[&str]) -> (PathBuf, Output) {
        let file = self.scratch(name);
        let mut args = vec![
            "snapshot",
            "--api-socket",
            self.socket.to_str().unwrap(),
            "--to",
            file.to_str().unwrap(),
            "--json",
        ];
        args.extend_from_slice(extra);
        let out = ferry_output(&args);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        (file, out)
    }

    pub fn migration_status(&self) -> api::MigrationStatus {
        serde_json::from_value(self.api().get("vm.migration").expect("vm.migration"))
            .expect("vm.migration body")
    }

    pub fn wait_for_migration_bytes(&self, bytes: u64) {
        wait_for("migration traffic", Duration::from_secs(60), || {
            (self.migration_status().bytes_on_wire >= bytes).then_some(())
        });
    }

    /// The migration's status once it is no longer running.
    pub fn wait_migration_end(&self) -> api::MigrationStatus {
        wait_for("the migration to end", Duration::from_secs(60), || {
            let s = self.migration_status();
            (!s.phase.is_running()).then_some(s)
        })
    }
}

impl Drop for Ferry {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        // Every test runs with the sandbox on: it must never have refused ferry's own work.
        let refused: Vec<String> = self
            .stderr_text()
            .lines()
            .filter(|l| l.contains("the sandbox refused"))
            .map(String::from)
            .collect();
        if !refused.is_empty() && !std::thread::panicking() {
            panic!(
                "the sandbox refused ferry's own work: {refused:?}\n{}",
                self.stderr_text()
            );
        }
    }
}

/// Starts a migration from `src` slow enough (64 Mbit/s, pages plain: compressed, a writer's
/// stamped pages would fit the link) to be interrupted mid-round, once a first MiB is on its
/// way; returns the destination.
pub fn start_slow_migration(src: &Ferry) -> Ferry {
    let url = format!("unix:{}", src.scratch("mig1.sock").display());
    let dst = Ferry::incoming(&url);
    src.api()
        .put(
            "vm.send-migration",
            Some(&serde_json::json!({"destination": url, "max_bandwidth_mbps": 64, "compression": "none", "delta_cache_mb": 0})),
        )
        .expect("start");
    src.wait_for_migration_bytes(1 << 20);
    dst
}

/// Runs ferry to completion with `args` (for commands that must fail fast).
pub fn ferry_output(args: &[&str]) -> Output {
    ferry_output_within(args, Duration::from_secs(30))
}

/// The same, for a command that may take up to `limit` (a whole migration on a busy host).
pub fn ferry_output_within(args: &[&str], limit: Duration) -> Output {
    let mut child = Command::new(FERRY)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn ferry");
    // Read both pipes while it runs: a report larger than a pipe's 64 KiB (a post-copy
    // timeline) would otherwise block it forever.
    let drain = |pipe: Option<Box<dyn std::io::Read + Send>>| {
        std::thread::spawn(move || {
            let mut buf = Vec::new();
            if let Some(mut p) = pipe {
                let _ = p.read_to_end(&mut buf);
            }
            buf
        })
    };
    let stdout = drain(child.stdout.take().map(|p| Box::new(p) as _));
    let stderr = drain(child.stderr.take().map(|p| Box::new(p) as _));
    let deadline = Instant::now() + limit;
    let status = loop {
        if let Some(status) = child.try_wait().expect("ferry's status") {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("ferry {args:?} did not exit within {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    Output {
        status,
        stdout: stdout.join().expect("stdout reader"),
        stderr: stderr.join().expect("stderr reader"),
    }
}

pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// `ferry migrate ... --json`: the final report (default when none was printed), whether the
/// command succeeded, and every error message it gave (report error and stderr).
/// After a migration run with `--checksum`: memory was equal at the switch, the source let go
/// and exited 0, and the guest then ran `passes` more passes on the destination without one
/// verify error. Returns the destination's vm.info.
pub fn assert_every_page_arrived(
    src: &mut Ferry,
    dst: &Ferry,
    report: &api::MigrationStatus,
    passes: u64,
) -> VmInfo {
    let (a, b) = (
        report.memory_checksum_source,
        report.memory_checksum_destination,
    );
    assert!(
        a.is_some() && a == b,
        "memory equal at the switch: {a:?} vs {b:?}"
    );
    assert!(
        src.wait_exit(Duration::from_secs(60)).success(),
        "the source lets go and exits 0"
    );
    let start = dst.info().passes;
    let info = dst.wait_info(
        "more passes on the destination",
        Duration::from_secs(60),
        |i| i.passes >= start + passes,
    );
    assert_eq!(
        info.verify_errors, 0,
        "pages lost: {:?}",
        info.verify_error_pages
    );
    // Once every page is here the destination gives its memory back to huge pages, which
    // it forbade while pages arrived (post-copy must hear each 4 KiB page touched).
    let pid = dst.child.as_ref().expect("the destination runs").id();
    let flags = guest_memory_flags(pid);
    assert!(
        flags.split_whitespace().any(|f| f == "hg"),
        "the destination's guest memory may take huge pages again: {flags}"
    );
    info
}

/// The `VmFlags` of process `pid`'s largest mapping (a VMM's guest memory).
pub fn guest_memory_flags(pid: u32) -> String {
    let smaps = std::fs::read_to_string(format!("/proc/{pid}/smaps")).unwrap();
    let mut largest = (0u64, String::new());
    let mut size = 0;
    for line in smaps.lines() {
        if let Some(flags) = line.strip_prefix("VmFlags:") {
            if size > largest.0 {
                largest = (size, flags.trim().to_string());
            }
        } else if let Some((range, _)) = line.split_once(' ')
            && let Some((a, b)) = range.split_once('-')
            && let (Ok(a), Ok(b)) = (u64::from_str_radix(a, 16), u64::from_str_radix(b, 16))
        {
            size = b - a;
        }
    }
    largest.1
}

/// Sectors a disk workload cycles over in the live update tests: each is read back every
/// cycle.
pub const UPDATE_SECTORS: u64 = 256;

/// A VM that can be updated in place (memfd memory), run by `binary`, writing memory and a
/// disk in `dir` (returned), once it has been round its sectors.
pub fn updatable_vm(binary: &Path, dir: &Path) -> (PathBuf, Ferry) {
    let path = dir.join("disk.img");
    std::fs::File::create(&path)
        .and_then(|f| f.set_len(4 << 20))
        .expect("disk file");
    let disk = format!("path={}", path.display());
    let cmdline = format!("write ws=16M seq verify blk blk_sectors={UPDATE_SECTORS}");
    let guest = guest();
    let args = [
        "--guest",
        guest.to_str().unwrap(),
        "--memory",
        "256M",
        "--memory-backend",
        "memfd",
        "--cmdline",
        &cmdline,
        "--disk",
        &disk,
    ];
    let vm = Ferry::start_as(binary, &args);
    vm.wait_info("a first round of the disk", Duration::from_secs(60), |i| {
        i.blk_writes >= UPDATE_SECTORS
    });
    (path, vm)
}

/// The guest of an `updatable_vm` on `vm` goes on: every sector read back once more, memory
/// verified, no error.
pub fn assert_carries_on(vm: &Ferry, what: &str) {
    let from = vm.info();
    let info = vm.wait_info(
        "every sector read back again",
        Duration::from_secs(60),
        |i| i.blk_reads > from.blk_reads + UPDATE_SECTORS && i.passes > from.passes,
    );
    assert_eq!(info.state, "running", "{what}");
    assert_eq!(
        info.blk_errors, 0,
        "{what}: sectors read back wrong: {:?}",
        info.blk_error_sectors
    );
    assert_eq!(info.verify_errors, 0, "{what}: memory verify errors");
}

/// A second VM on the disk at `path` is refused: some process holds its lock.
pub fn assert_second_writer_refused(path: &Path) {
    let guest = guest();
    let disk = format!("path={}", path.display());
    let second = ferry_output(&[
        "run",
        "--guest",
        guest.to_str().unwrap(),
        "--disk",
        &disk,
        "--serial",
        "/dev/null",
    ]);
    let stderr = String::from_utf8_lossy(&second.stderr);
    assert!(!second.status.success(), "a second writer ran");
    assert!(stderr.contains("in use by another process"), "{stderr}");
}

/// How long `migrate` lets a whole migration take: the largest (4 GiB written across the
/// hole) took over 30 s on two cores shared with other work.
const MIGRATE_LIMIT: Duration = Duration::from_secs(180);

pub fn migrate(src: &Ferry, to: &str, extra: &[&str]) -> (api::MigrationStatus, bool, String) {
    let socket = src.socket.to_str().unwrap().to_string();
    let mut args = vec!["migrate", "--api-socket", &socket, "--to", to, "--json"];
    args.extend_from_slice(extra);
    let out = ferry_output_within(&args, MIGRATE_LIMIT);
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    let status: api::MigrationStatus = serde_json::from_str(&stdout).unwrap_or_default();
    let errors = format!(
        "{}\n{}",
        status.error.clone().unwrap_or_default(),
        String::from_utf8_lossy(&out.stderr)
    );
    assert_exit_says(&status, out.status.code(), &errors);
    (status, out.status.success(), errors)
}

/// `ferry migrate`'s exit status says where the VM is (docs/guide.md): 0 on the destination,
/// 3 safe on the source, 4 an operator must act (and the next commands are printed); 1 no
/// migration ran (2 for a command line clap refused).
pub fn assert_exit_says(status: &api::MigrationStatus, code: Option<i32>, stderr: &str) {
    use api::MigrationPhase as P;
    let expected: &[i32] = match status.phase {
        P::Completed => &[0],
        P::Failed | P::Cancelled => &[3],
        P::Unconfirmed | P::PostcopyPaused => &[4],
        _ => &[1, 2],
    };
    assert!(
        code.is_some_and(|c| expected.contains(&c)),
        "{:?} exited {code:?}: {stderr}",
        status.phase
    );
    if expected == [4] {
        assert!(stderr.contains("--api-socket"), "no next step: {stderr}");
    }
}

/// `--tls-cert/--tls-key/--tls-ca` for host `name` from a `ferry certs` directory.
pub fn tls_args(dir: &Path, name: &str) -> Vec<String> {
    let f = |ext: &str| dir.join(format!("{name}.{ext}")).display().to_string();
    vec![
        "--tls-cert".into(),
        f("pem"),
        "--tls-key".into(),
        f("key"),
        "--tls-ca".into(),
        dir.join("ca.pem").display().to_string(),
    ]
}

/// `ferry certs`: a CA in `dir` and a certificate it signed for each of `names`.
pub fn certs(dir: &Path, names: &[&str]) {
    let out = dir.display().to_string();
    let mut args = vec!["certs", "--out", &out];
    for n in names {
        args.extend_from_slice(&["--name", n]);
    }
    let o = ferry_output(&args);
    assert!(o.status.success(), "{o:?}");
}

/// A destination listening on TCP behind a relay that injects `fault`.
pub fn destination_behind(point: relay::Point, action: relay::Action) -> (Ferry, relay::Relay) {
    destination_behind_with(point, action, &[])
}

/// The same, with more `ferry run` arguments for the destination (its disks).
pub fn destination_behind_with(
    point: relay::Point,
    action: relay::Action,
    extra: &[&str],
) -> (Ferry, relay::Relay) {
    let port = free_port();
    let url = format!("tcp:127.0.0.1:{port}");
    let dst = Ferry::start(&[&["--incoming", url.as_str()][..], extra].concat());
    let relay = relay::Relay::start(&format!("127.0.0.1:{port}"), point, action);
    (dst, relay)
}

/// Carries on a post-copy whose connection broke, as an operator would: the destination
/// listens again (API), then the source connects to it (`ferry migrate-resume`, the CLI).
pub fn carry_on_postcopy(src: &Ferry, dst: &Ferry) -> Result<(), String> {
    let url = format!("unix:{}", dst.scratch("resume.sock").display());
    dst.api()
        .put(
            "vm.migrate-resume",
            Some(&serde_json::json!({ "listen": url })),
        )
        .map_err(|e| format!("the destination does not listen again: {e}"))?;
    let out = ferry_output(&[
        "migrate-resume",
        "--api-socket",
        src.socket.to_str().unwrap(),
        "--to",
        &url,
    ]);
    if !out.status.success() {
        return Err(format!("the source does not reconnect: {out:?}"));
    }
    Ok(())
}
