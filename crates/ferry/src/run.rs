//! `ferry run`: boot a guest (or receive one), serve the API, supervise the VM until it ends.

use std::fs::File;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use api::ApiServer;
use migration::destination::Source;
use migration::io::tls::{Tls, TlsFiles};
use migration::vm::{HandedFiles, VmDescriptor};
use vmm::devices::GuestEvent;
use vmm::memory::MemorySize;
use vmm::{BootImage, Vm, VmConfig, VmEvent};

use crate::cli::RunArgs;
use crate::controller::Controller;
use crate::lifecycle::Lifecycle;
use crate::lifecycle::Phase;
use crate::metrics::{self, MetricsServer};
use crate::migrations::Security;

static TERMINATE: AtomicBool = AtomicBool::new(false);

/// Where an incoming VM comes from.
enum Incoming {
    Listen(migration::Endpoint),
    Snapshot(std::path::PathBuf),
}

/// After migrating away, the source waits this long for someone to read the final report.
const REPORT_LINGER: Duration = Duration::from_secs(10);
/// How long the source stays after the final report was read, so the answer gets out.
const ANSWER_GRACE: Duration = Duration::from_millis(300);
/// With `--metrics`, how long the source waits for a scrape of its final counters.
const FINAL_SCRAPE_WAIT: Duration = Duration::from_secs(30);

pub fn run(args: RunArgs) -> Result<i32> {
    if let Some(socket) = &args.api_socket {
        ApiServer::ensure_available(socket)?;
    }
    install_termination_handler();
    vmm::sandbox::enter_process(args.sandbox == crate::cli::Sandbox::On, args.user)
        .map_err(anyhow::Error::msg)?;
    // A missing disk is said at once, not when a migration arrives.
    for disk in &args.disks {
        use std::os::unix::fs::FileTypeExt;
        let meta = std::fs::metadata(&disk.path)
            .with_context(|| format!("disk {}", disk.path.display()))?;
        if !meta.is_file() && !meta.file_type().is_block_device() {
            bail!(
                "disk {} is neither a file nor a block device",
                disk.path.display()
            );
        }
    }
    if args.sandbox == crate::cli::Sandbox::On {
        crate::confine::enter(&crate::confine::for_run(&args)?)?;
    }
    let security = security(&args)?;
    let incoming = match (&args.incoming, &args.restore) {
        (Some(url), None) => Some(Incoming::Listen(url.parse()?)),
        (None, Some(file)) => Some(Incoming::Snapshot(file.clone())),
        (None, None) => None,
        (Some(_), Some(_)) => bail!("--incoming and --restore exclude each other"),
    };
    match incoming {
        Some(incoming) => run_incoming(&args, &incoming, security),
        None => run_boot(&args, security),
    }
}

/// TLS from the --tls-* files, or plain TCP if asked for (said loudly).
fn security(args: &RunArgs) -> Result<Security> {
    let tls = match (&args.tls_cert, &args.tls_key, &args.tls_ca) {
        (Some(cert), Some(key), Some(ca)) => Some(Tls::load(&TlsFiles {
            cert: cert.clone(),
            key: key.clone(),
            ca: ca.clone(),
        })?),
        _ => None,
    };
    if args.plain_tcp {
        eprintln!(
            "ferry: WARNING: --plain-tcp: TCP migrations of this VM are not encrypted or \
             authenticated; anyone on the path can read the guest's memory"
        );
    }
    Ok(Security {
        tls,
        plain_tcp: args.plain_tcp,
    })
}

fn run_boot(args: &RunArgs, security: Security) -> Result<i32> {
    let (image, cmdline) = match (&args.guest, &args.kernel) {
        (Some(guest), None) => {
            check_file("guest", guest)?;
            let cmdline = cmdline_with_vcpus(&args.cmdline, vcpus(args))?;
            (BootImage::Pvh(guest.clone()), cmdline)
        }
        (None, Some(kernel)) => {
            check_file("kernel", kernel)?;
            if let Some(initrd) = &args.initrd {
                check_file("initrd", initrd)?;
            }
            let image = BootImage::Linux {
                kernel: kernel.clone(),
                initrd: args.initrd.clone(),
            };
            (image, args.cmdline.clone())
        }
        _ => {
            bail!("--guest PATH or --kernel PATH is required (or --incoming URL / --restore FILE)")
        }
    };
    let serial = open_serial(&args.serial)?;
    let vm = boot_vm(config_of(args), &image, &cmdline, serial)?;
    let controller = Controller::with_vm(Arc::new(vm), security);
    configure(&controller, args)?;
    let (_api, metrics) = start_servers(&controller, args)?;
    give_up_root(args);
    Ok(supervise(&controller, metrics.as_ref()))
}

/// With `--user`, becomes that user now that the VM runs and everything that needs root is
/// open (docs/security.md). A VM that runs is never ended for it: a failure is said loudly.
fn give_up_root(args: &RunArgs) {
    if let Some(to) = args.user
        && let Err(e) = vmm::privileges::drop_to(to)
    {
        eprintln!("ferry: WARNING: --user: {e}; the VM runs on as root");
    }
}

/// Boots `image` with `config`. A PVH image (ferry's workload guest) finds each virtio-mmio
/// device by a word its command line gains; Linux finds them in the ACPI DSDT, so its command
/// line is left as given. A PVH image's `vcpus=N` word is the caller's.
pub fn boot_vm(
    config: VmConfig,
    image: &BootImage,
    cmdline: &str,
    serial: Box<dyn std::io::Write + Send>,
) -> Result<Vm> {
    let mut cmdline = cmdline.to_string();
    if matches!(image, BootImage::Pvh(_)) {
        for slot in 0..config.virtio_devices() {
            cmdline.push_str(&vmm::devices::virtio::cmdline_word(slot));
        }
    }
    Vm::boot(config, image, &cmdline, serial).context("cannot start the VM")
}

fn run_incoming(args: &RunArgs, incoming: &Incoming, security: Security) -> Result<i32> {
    // Listen before the API answers, so that "API up" means "ready for the migration".
    let source = match incoming {
        Incoming::Listen(endpoint) => {
            security.check(endpoint).map_err(anyhow::Error::msg)?;
            Source::listen(endpoint, security.tls.as_ref())?
        }
        Incoming::Snapshot(path) => Source::snapshot(path)?,
    };
    // The VM asked for with --memory is built before the API answers too: "API up" means
    // the build is not part of the move.
    let arrival = Arrival::new(args)?;
    let controller = Controller::new(Phase::Incoming, security);
    configure(&controller, args)?;
    let (_api, metrics) = start_servers(&controller, args)?;
    let received = controller.migrations.incoming.receive(
        source,
        &|| TERMINATE.load(Ordering::Acquire),
        |descriptor, files| arrival.build(descriptor, files),
        // The VM runs from here on (in post-copy, while its pages still arrive).
        |vm| {
            controller.set_vm(vm.clone());
            controller.set_phase(Phase::Live);
        },
    );
    match received {
        Ok(Some(_)) => {}
        Ok(None) => {
            eprintln!("ferry: stopped while waiting for an incoming migration");
            return Ok(0);
        }
        Err(e @ migration::Error::Stopped(_)) => {
            let after = match incoming {
                Incoming::Listen(_) => "the arrival ended and the source was told to run it on",
                Incoming::Snapshot(_) => "the restore ended; the snapshot file is unchanged",
            };
            eprintln!("ferry: {e}; {after}");
            return Ok(0);
        }
        Err(e) => {
            eprintln!("ferry: error: incoming migration failed: {}", e.report());
            return Ok(1);
        }
    }
    if let Some(e) = controller.migrations.board.read().error {
        eprintln!("ferry: warning: {e}");
    }
    // A signal that came after the VM was handed over was meant for an arrival that is no
    // more: the VM runs here now, and only a signal sent knowing that stops it.
    if TERMINATE.swap(false, Ordering::AcqRel) {
        eprintln!(
            "ferry: a stop signal came as the VM was handed over here: it runs here now; \
             signal again to stop it"
        );
    }
    give_up_root(args);
    Ok(supervise(&controller, metrics.as_ref()))
}

/// Guest memory and vCPUs unless given.
const DEFAULT_MEMORY: u64 = 1 << 30;

fn vcpus(args: &RunArgs) -> usize {
    args.vcpus.unwrap_or(1)
}

/// The VM `ferry run` was asked for.
fn config_of(args: &RunArgs) -> VmConfig {
    VmConfig {
        memory: args.memory.map_or(DEFAULT_MEMORY, |m| m.0),
        vcpus: vcpus(args),
        backend: args.memory_backend,
        disks: args.disks.clone(),
        nets: args.nets.clone(),
        balloon: args.balloon.clone(),
        cpu_model: args.cpu_model.unwrap_or_default(),
    }
}

/// How an arriving VM is built: ahead, when --memory or --vcpus said what to expect (as
/// QEMU's destination is: building it, KVM's memory slots above all, is then not part of the
/// move); otherwise once the source says what it is.
enum Arrival<'a> {
    Prepared(Arc<Vm>),
    OnHello {
        args: &'a RunArgs,
        serial: Box<dyn std::io::Write + Send>,
    },
}

impl<'a> Arrival<'a> {
    fn new(args: &'a RunArgs) -> Result<Self> {
        let serial = open_serial(&args.serial)?;
        if args.memory.is_none() && args.vcpus.is_none() {
            return Ok(Arrival::OnHello { args, serial });
        }
        let vm = Vm::for_restore(config_of(args), serial).context("cannot build the VM")?;
        Ok(Arrival::Prepared(Arc::new(vm)))
    }

    /// The VM `descriptor` describes; with `files`, a live update's: on the memory and the
    /// devices' files it passed (the devices are the VM's own, as the source names them).
    fn build(
        self,
        descriptor: &VmDescriptor,
        files: Option<HandedFiles>,
    ) -> migration::Result<Arc<Vm>> {
        let wanted = VmConfig::from_descriptor(descriptor)?;
        match (self, files) {
            (Arrival::Prepared(_), Some(_)) => Err(migration::Error::vm(
                "this destination built its VM ahead (--memory/--vcpus), but a live update \
                 brings the VM's own memory: start it with --incoming alone",
            )),
            (Arrival::OnHello { serial, .. }, Some(files)) => {
                Vm::for_handover(wanted, serial, files)
                    .map(Arc::new)
                    .map_err(|e| migration::Error::vm_caused("cannot take the VM over", e))
            }
            (Arrival::Prepared(vm), None) => {
                let c = vm.config();
                if (c.memory, c.vcpus) != (wanted.memory, wanted.vcpus) {
                    return Err(migration::Error::vm(format!(
                        "this destination was prepared for a VM of {} and {} vCPUs \
                         (--memory/--vcpus), the source's has {} and {}",
                        MemorySize(c.memory),
                        c.vcpus,
                        MemorySize(wanted.memory),
                        wanted.vcpus
                    )));
                }
                Ok(vm)
            }
            (Arrival::OnHello { args, serial }, None) => {
                let config = VmConfig {
                    disks: args.disks.clone(),
                    nets: args.nets.clone(),
                    balloon: args.balloon.clone(),
                    ..wanted
                };
                Vm::for_restore(config, serial)
                    .map(Arc::new)
                    .map_err(|e| migration::Error::vm_caused("cannot build the VM", e))
            }
        }
    }
}

/// The options every VM's API honours, booted or arrived.
fn configure(controller: &Controller, args: &RunArgs) -> Result<()> {
    if args.enable_debug_api {
        controller.enable_debug_api();
    }
    if let Some(dir) = &args.snapshot_dir {
        let dir = dir
            .canonicalize()
            .with_context(|| format!("--snapshot-dir {}", dir.display()))?;
        if !dir.is_dir() {
            bail!("--snapshot-dir {} is not a directory", dir.display());
        }
        let _ = controller.snapshot_dir.set(dir);
    }
    Ok(())
}

/// The control API and the metrics endpoint, each if asked for; they serve until dropped.
/// The metrics endpoint listens first: once the API answers, a scrape is taken too.
fn start_servers(
    controller: &Arc<Controller>,
    args: &RunArgs,
) -> Result<(Option<ApiServer>, Option<MetricsServer>)> {
    let metrics = match &args.metrics {
        Some(addr) => Some(metrics::start(
            addr,
            controller.clone(),
            metrics::access(args.metrics_token_file.as_deref())?,
        )?),
        None => None,
    };
    let api = match &args.api_socket {
        Some(path) => Some(ApiServer::start(path, controller.clone())?),
        None => None,
    };
    Ok((api, metrics))
}

/// Runs until the VM ends, is shut down, or has migrated away; returns the exit status.
fn supervise(controller: &Controller, metrics: Option<&MetricsServer>) -> i32 {
    let vm = match controller.vm() {
        Ok(vm) => vm.clone(),
        Err(_) => return 1,
    };
    let mut migrated: Option<Leaving> = None;
    let mut said_wait = false;
    let code = loop {
        if let Some(event) = vm.next_event(Duration::from_millis(20))
            && let Some(code) = on_event(controller, event)
        {
            break code;
        }
        if controller.shutdown_requested() {
            break 0;
        }
        // SIGTERM/SIGINT stop the VM, except mid post-copy (its memory is on two hosts) or
        // mid switch (it may run on the destination already): then the stop waits for the
        // migration to end (kill -9 remains for an operator).
        if TERMINATE.load(Ordering::Acquire) {
            let state = controller.lifecycle();
            // A migration in its rounds is cancelled first; the stop follows once it ended
            // (or, past `Go`, waits for the switch like any other).
            if state == Lifecycle::Migrating {
                let _ = controller.migrations.outgoing.cancel();
            } else if !state.holds_stop() {
                break 0;
            }
            if !said_wait {
                eprintln!(
                    "ferry: stopping once the migration ends (the VM is {})",
                    state.name()
                );
                said_wait = true;
            }
        }
        if controller.phase() == Phase::Migrated {
            let leaving = migrated.get_or_insert_with(Leaving::new);
            if leaving.may_go(controller, metrics) {
                break 0;
            }
        }
    };
    vm.shutdown();
    code
}

/// A source whose VM moved away stays until its last words are out: the final report read
/// by a client (or `REPORT_LINGER`), and with a metrics endpoint one scrape of the final
/// counters (or `FINAL_SCRAPE_WAIT`).
struct Leaving {
    since: Instant,
    report_read_at: Option<Instant>,
}

impl Leaving {
    fn new() -> Self {
        Self {
            since: Instant::now(),
            report_read_at: None,
        }
    }

    fn may_go(&mut self, controller: &Controller, metrics: Option<&MetricsServer>) -> bool {
        // Once a client has read the final report, give its answer time to leave.
        if controller
            .migrations
            .final_status_read
            .load(Ordering::Acquire)
        {
            self.report_read_at.get_or_insert_with(Instant::now);
        }
        let report_out = self
            .report_read_at
            .is_some_and(|at| at.elapsed() > ANSWER_GRACE)
            || self.since.elapsed() > REPORT_LINGER;
        let scraped = metrics.is_none_or(|m| m.final_scrapes() > 0)
            || self.since.elapsed() > FINAL_SCRAPE_WAIT;
        report_out && scraped
    }
}

fn on_event(controller: &Controller, event: VmEvent) -> Option<i32> {
    match event {
        VmEvent::Guest(GuestEvent::Finished { failed: false }) => Some(0),
        VmEvent::Guest(GuestEvent::Finished { failed: true }) => {
            eprintln!("ferry: the guest reported that its workload failed");
            Some(1)
        }
        VmEvent::Guest(GuestEvent::Fatal(msg)) => {
            let msg = msg.trim_start_matches("ferry-guest: error: ");
            eprintln!("ferry: error: the guest refused its command line: {msg}");
            controller.set_phase(Phase::Failed(msg.to_string()));
            Some(1)
        }
        VmEvent::VcpuFailed { cpu, reason } => {
            eprintln!("ferry: error: vCPU {cpu} stopped: {reason}");
            controller.set_phase(Phase::Failed(reason));
            Some(1)
        }
        VmEvent::Guest(GuestEvent::Device { .. }) => None,
    }
}

pub fn check_file(what: &str, path: &Path) -> Result<()> {
    let meta =
        std::fs::metadata(path).with_context(|| format!("{what} file {}", path.display()))?;
    if !meta.is_file() {
        bail!("{what} file {} is not a regular file", path.display());
    }
    Ok(())
}

/// The guest learns its vCPU count from `vcpus=N`; add it, or refuse a contradiction.
pub fn cmdline_with_vcpus(cmdline: &str, vcpus: usize) -> Result<String> {
    for word in cmdline.split_whitespace() {
        if let Some(n) = word.strip_prefix("vcpus=") {
            if n != vcpus.to_string() {
                bail!("the command line says {word} but --vcpus is {vcpus}");
            }
            return Ok(cmdline.to_string());
        }
    }
    Ok(format!("{} vcpus={vcpus}", cmdline.trim())
        .trim()
        .to_string())
}

pub fn open_serial(target: &str) -> Result<Box<dyn std::io::Write + Send>> {
    if target == "stdout" {
        return Ok(Box::new(std::io::stdout()));
    }
    let file = File::options()
        .create(true)
        .append(true)
        .open(target)
        .with_context(|| format!("serial output {target}"))?;
    Ok(Box::new(file))
}

extern "C" fn on_terminate(sig: libc::c_int, _: *mut libc::siginfo_t, _: *mut libc::c_void) {
    TERMINATE.store(true, Ordering::Release);
    // Said after the flag is set, so whoever reads it knows every check from here on sees
    // the stop; write(2) is async-signal-safe where formatting is not.
    let said: &[u8] = if sig == libc::SIGINT {
        b"ferry: received SIGINT\n"
    } else {
        b"ferry: received SIGTERM\n"
    };
    // SAFETY: a write of a static buffer to stderr.
    let _ = unsafe { libc::write(2, said.as_ptr().cast(), said.len()) };
}

/// Whether SIGTERM or SIGINT came.
pub fn terminate_requested() -> bool {
    TERMINATE.load(Ordering::Acquire)
}

pub fn install_termination_handler() {
    for sig in [libc::SIGINT, libc::SIGTERM] {
        let _ = vmm_sys_util::signal::register_signal_handler(sig, on_terminate);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vcpus_word_is_added_or_checked() {
        assert_eq!(
            cmdline_with_vcpus("write ws=64M", 2).unwrap(),
            "write ws=64M vcpus=2"
        );
        assert_eq!(cmdline_with_vcpus("", 1).unwrap(), "vcpus=1");
        assert_eq!(
            cmdline_with_vcpus("idle vcpus=2", 2).unwrap(),
            "idle vcpus=2"
        );
        assert!(cmdline_with_vcpus("idle vcpus=3", 2).is_err());
    }
}
