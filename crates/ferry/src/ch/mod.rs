//! `ferry ch …` (or ferry run as `cloud-hypervisor`): Cloud Hypervisor's control contract —
//! its command line, its REST API on `--api-socket` and its `--event-monitor` stream — over
//! ferry's VMM and migration engine, so that what drives CH (libvirt's `ch` driver, Virtink,
//! Kata) can drive ferry. The VMM starts empty unless `--kernel` names a VM to boot.
//! ferry's own API stays what `ferry run` serves (docs/orchestrators.md says why apart).

mod allow;
mod cli;
mod confine;
mod console;
mod events;
mod machine;
mod migrate;
mod vmm;

use std::fs::File;
use std::os::fd::FromRawFd;
use std::os::unix::net::UnixListener;

use anyhow::{Context, Result, bail};
use api::ApiServer;

use cli::Target;

/// The version line libvirt's `ch` driver reads (`cloud-hypervisor --version`).
fn version() -> String {
    format!(
        "cloud-hypervisor v54.0.0 (ferry {})",
        env!("CARGO_PKG_VERSION")
    )
}

/// Whether this process was started as Cloud Hypervisor (a link named `cloud-hypervisor`).
pub fn invoked_as_ch() -> bool {
    std::env::args_os()
        .next()
        .and_then(|a| {
            std::path::Path::new(&a)
                .file_name()
                .map(|n| n == "cloud-hypervisor")
        })
        .unwrap_or(false)
}

/// An inherited descriptor, checked to be open first.
fn inherited(fd: i32, what: &str) -> Result<i32> {
    // SAFETY: F_GETFD only asks whether `fd` is open.
    if fd < 0 || unsafe { libc::fcntl(fd, libc::F_GETFD) } < 0 {
        bail!("{what} fd={fd} is not an open file descriptor");
    }
    Ok(fd)
}

fn event_file(target: Option<&Target>) -> Result<Option<File>> {
    Ok(match target {
        None => None,
        Some(Target::Path(p)) => {
            Some(File::create(p).with_context(|| format!("--event-monitor {}", p.display()))?)
        }
        Some(Target::Fd(fd)) => {
            let fd = inherited(*fd, "--event-monitor")?;
            // SAFETY: the descriptor was handed to this process to own, and is open.
            Some(unsafe { File::from_raw_fd(fd) })
        }
    })
}

fn serve(target: &Target, service: std::sync::Arc<vmm::ChVmm>) -> Result<ApiServer> {
    Ok(match target {
        Target::Path(p) => ApiServer::start_service(p, service)?,
        Target::Fd(fd) => {
            // SAFETY: the listening socket was handed to this process to own, and is open.
            let listener = unsafe { UnixListener::from_raw_fd(inherited(*fd, "--api-socket")?) };
            ApiServer::on_listener(listener, service)?
        }
    })
}

pub fn main(argv: &[String]) -> Result<i32> {
    let args = cli::parse(argv)?;
    if args.version {
        println!("{}", version());
        return Ok(0);
    }
    if args.api_socket.is_none() && args.spec.is_none() {
        bail!("give --api-socket path=PATH|fd=N, or --kernel to boot a VM");
    }
    crate::run::install_termination_handler();
    ::vmm::sandbox::enter_process(args.sandbox, None).map_err(anyhow::Error::msg)?;
    if args.landlock {
        crate::confine::enter(&confine::rules(&args)?)?;
    }
    let events = events::Events::new(
        event_file(args.event_monitor.as_ref())?
            .map(|f| Box::new(f) as Box<dyn std::io::Write + Send>),
    );
    events.emit("vmm", "starting", &[]);
    let allowed = allow::Allowed::new(&args.allow_disk_dirs, &args.allow_taps)?;
    let vmm = vmm::ChVmm::new(events, args.plain_tcp, args.arrival_serial, allowed);
    let metrics = args
        .metrics
        .as_ref()
        .map(|a| {
            let access = crate::metrics::access(args.metrics_token_file.as_deref())?;
            crate::metrics::start(a, vmm.clone(), access)
        })
        .transpose()?;
    let server = args
        .api_socket
        .as_ref()
        .map(|t| serve(t, vmm.clone()))
        .transpose()?;
    if let Some(spec) = args.spec {
        vmm.handle(api::ch::ChRequest::Create(Box::new(spec)))
            .and_then(|_| vmm.boot())
            .map_err(|e| anyhow::anyhow!(e.message))?;
    }
    let code = vmm.wait_exit(&crate::run::terminate_requested);
    // Let the answer to vmm.shutdown leave before the socket goes.
    std::thread::sleep(std::time::Duration::from_millis(100));
    drop(server);
    drop(metrics);
    vmm.end_all();
    vmm.events.emit("vmm", "shutdown", &[]);
    Ok(code)
}
