//! `ferry run --user`: once its VM runs, the process is that user on every thread, with no
//! capability and no supplementary group, and the VM lives on as it would under root: its
//! guest verifies its memory, it moves out, and a VM that arrives by post-copy runs on too.

mod common;

use std::time::Duration;

use api::MigrationPhase;
use common::*;

const T: Duration = Duration::from_secs(60);

/// `PF_USER_WORKER`: a task the kernel runs in the process's name (KVM's huge page recovery
/// worker), kernel code with the kernel's credentials, not ferry's.
const PF_USER_WORKER: u64 = 0x4000;

fn kernel_worker(task: &std::path::Path) -> bool {
    let stat = std::fs::read_to_string(task.join("stat")).unwrap_or_default();
    let after_name = stat.rsplit_once(')').map_or("", |(_, rest)| rest);
    let flags = after_name
        .split_whitespace()
        .nth(6)
        .and_then(|f| f.parse::<u64>().ok());
    flags.is_some_and(|f| f & PF_USER_WORKER != 0)
}

/// Each of ferry's threads' `Uid:`, `Gid:`, `Groups:` and `CapEff:` lines, tab-separated
/// fields joined by spaces.
fn credentials(pid: u32) -> Vec<String> {
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).unwrap();
    tasks
        .filter_map(|t| Some(t.ok()?.path()))
        .filter(|t| !kernel_worker(t))
        .filter_map(|t| std::fs::read_to_string(t.join("status")).ok())
        .map(|status| {
            let keys = ["Uid:", "Gid:", "Groups:", "CapEff:"];
            let lines = status
                .lines()
                .filter(|l| keys.iter().any(|k| l.starts_with(k)));
            lines
                .map(|l| l.split_whitespace().collect::<Vec<_>>().join(" "))
                .collect::<Vec<_>>()
                .join(" | ")
        })
        .collect()
}

const NOBODY: &str = "Uid: 65534 65534 65534 65534 | Gid: 65534 65534 65534 65534 | Groups: | \
                      CapEff: 0000000000000000";

/// Waits until every thread of `vm` is nobody, and there is more than one thread.
fn wait_nobody(vm: &Ferry, what: &str) {
    let pid = vm.child.as_ref().unwrap().id();
    wait_for(what, T, || {
        let each = credentials(pid);
        (each.len() > 1 && each.iter().all(|c| c == NOBODY)).then_some(())
    });
}

#[test]
fn a_vm_run_as_nobody_holds_no_root_and_still_moves() {
    if !kvm_available() {
        return;
    }
    let spec = VmSpec {
        memory: "256M",
        vcpus: 2,
        cmdline: "write ws=64M seq verify",
        ..Default::default()
    };
    let mut src = Ferry::boot_with(spec, &["--user", "nobody"]);
    wait_nobody(&src, "the booted VM's threads to be nobody");
    src.wait_info("a first pass", T, |i| i.passes >= 2);
    assert_eq!(src.info().verify_errors, 0);

    // The source, nobody now, reaches its peer over TCP (a Unix socket of root's it may not).
    let url = format!("tcp:127.0.0.1:{}", free_port());
    let dst = Ferry::start(&["--incoming", &url, "--user", "nobody:nogroup"]);
    let (report, ok, errors) = migrate(&src, &url, &["--checksum", "--mode", "postcopy"]);
    assert!(ok, "migrate failed: {errors}");
    assert_eq!(report.phase, MigrationPhase::Completed);
    assert!(report.postcopy, "the switch went to post-copy: {report:?}");
    assert_every_page_arrived(&mut src, &dst, &report, 4);
    wait_nobody(&dst, "the arrived VM's threads to be nobody");
    let stderr = dst.stderr_text();
    assert!(!stderr.contains("WARNING: --user"), "{stderr}");
}
