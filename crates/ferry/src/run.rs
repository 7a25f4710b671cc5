//! `ferry run`: boot a guest, serve the API, and supervise the VM until it ends.

use std::fs::File;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use api::ApiServer;
use vmm::devices::GuestEvent;
use vmm::{Vm, VmConfig, VmEvent};

use crate::cli::RunArgs;
use crate::controller::{Controller, Phase};

static TERMINATE: AtomicBool = AtomicBool::new(false);

pub fn run(args: RunArgs) -> Result<i32> {
    let Some(guest) = args.guest.as_deref() else {
        bail!("--guest PATH is required");
    };
    check_guest_file(guest)?;
    let cmdline = cmdline_with_vcpus(&args.cmdline, args.vcpus)?;
    if let Some(socket) = &args.api_socket {
        ApiServer::ensure_available(socket)?;
    }
    let config = VmConfig {
        memory: args.memory.0,
        vcpus: args.vcpus,
        backend: args.memory_backend,
    };
    let serial = open_serial(&args.serial)?;
    let vm = Vm::boot(config, guest, &cmdline, serial).context("cannot start the VM")?;
    serve(Arc::new(vm), args.api_socket.as_deref())
}

/// Serves the API for `vm` and supervises it until it ends; returns the exit status.
fn serve(vm: Arc<Vm>, socket: Option<&Path>) -> Result<i32> {
    let controller = Arc::new(Controller::new(vm));
    let _server = match socket {
        Some(path) => Some(ApiServer::start(path, controller.clone())?),
        None => None,
    };
    install_termination_handler();
    let code = supervise(&controller);
    controller.vm.shutdown();
    Ok(code)
}

fn supervise(controller: &Controller) -> i32 {
    loop {
        if let Some(event) = controller.vm.next_event(Duration::from_millis(50)) {
            match event {
                VmEvent::Guest(GuestEvent::Finished { failed: false }) => return 0,
                VmEvent::Guest(GuestEvent::Finished { failed: true }) => {
                    eprintln!("ferry: the guest reported that its workload failed");
                    return 1;
                }
                VmEvent::Guest(GuestEvent::Fatal(msg)) => {
                    let msg = msg.trim_start_matches("ferry-guest: error: ");
                    eprintln!("ferry: error: the guest refused its command line: {msg}");
                    controller.set_phase(Phase::Failed(msg.to_string()));
                    return 1;
                }
                VmEvent::VcpuFailed { cpu, reason } => {
                    eprintln!("ferry: error: vCPU {cpu} stopped: {reason}");
                    controller.set_phase(Phase::Failed(reason));
                    return 1;
                }
            }
        }
        if controller.shutdown_requested() || TERMINATE.load(Ordering::Acquire) {
            return 0;
        }
    }
}

fn check_guest_file(path: &Path) -> Result<()> {
    let meta = std::fs::metadata(path).with_context(|| format!("guest file {}", path.display()))?;
    if !meta.is_file() {
        bail!("guest file {} is not a regular file", path.display());
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

fn open_serial(target: &str) -> Result<Box<dyn std::io::Write + Send>> {
    if target == "stdout" {
        return Ok(Box::new(std::io::stdout()));
    }
    let file = File::create(target).with_context(|| format!("serial output {target}"))?;
    Ok(Box::new(file))
}

extern "C" fn on_terminate(_: libc::c_int, _: *mut libc::siginfo_t, _: *mut libc::c_void) {
    TERMINATE.store(true, Ordering::Release);
}

fn install_termination_handler() {
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
