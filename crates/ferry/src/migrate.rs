//! `ferry migrate` and `ferry snapshot`: start through the API, show live progress, print the
//! report. Ctrl-C cancels the migration (the VM keeps running on the source).

use std::io::IsTerminal;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use anyhow::{Context, Result};
use api::{
    ApiClient, AutoConvergeField, MigrationPhase, MigrationRequest, MigrationStatus,
    SnapshotRequest,
};
use indicatif::{ProgressBar, ProgressStyle};

use crate::cli::{MigrateArgs, SnapshotArgs};
use crate::report;

static INTERRUPTED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_interrupt(_: libc::c_int, _: *mut libc::siginfo_t, _: *mut libc::c_void) {
    INTERRUPTED.store(true, Ordering::Release);
}

const POLL: Duration = Duration::from_millis(100);
/// Polls at most this often before giving up on a source that stopped answering.
const MAX_POLLS: u32 = 100_000;

pub fn migrate(args: &MigrateArgs) -> Result<i32> {
    let client = ApiClient::new(&args.api_socket);
    let request = MigrationRequest {
        destination: args.to.clone(),
        mode: Some(if args.local {
            "local".into()
        } else {
            args.mode.clone()
        }),
        max_downtime_ms: args.max_downtime_ms,
        max_bandwidth_mbps: args.max_bandwidth_mbps,
        max_rounds: args.max_rounds,
        timeout_s: args.timeout_s,
        checksum: Some(args.checksum),
        auto_postcopy: Some(args.auto_postcopy),
        auto_converge: args.auto_converge.clone().map(AutoConvergeField::Named),
        prepaging: args.prepaging.clone(),
        connections: args.connections,
        compression: args.compression.clone(),
        migration_threads: args.migration_threads,
        delta_cache_mb: args.delta_cache_mb,
        checkpoint_ms: args.checkpoint_ms,
        resume_window_s: args.resume_window_s,
        go_with_state: args.go_with_state,
    };
    let _ = vmm_sys_util::signal::register_signal_handler(libc::SIGINT, on_interrupt);
    client
        .put("vm.send-migration", Some(&serde_json::to_value(&request)?))
        .context("the migration did not start")?;

    let bar = progress_bar(args.json);
    let mut cancel_sent = false;
    let mut last = MigrationStatus::default();
    for _ in 0..MAX_POLLS {
        if INTERRUPTED.load(Ordering::Acquire) && !cancel_sent {
            bar.println("cancelling: the VM stays on the source");
            let _ = client.put("vm.cancel-migration", None);
            cancel_sent = true;
        }
        match client.get("vm.migration") {
            // A cut-short answer (the source exiting mid-reply): ask again.
            Ok(v) if v.is_null() => {}
            Ok(v) => last = serde_json::from_value(v).context("vm.migration body")?,
            // The source exits soon after a successful migration; what we have is final.
            Err(_) if last.phase == MigrationPhase::Completed => break,
            Err(e) => return Err(e).context("lost the source's API during the migration"),
        }
        if !last.phase.is_running() {
            break;
        }
        bar.set_message(report::progress_line(&last));
        std::thread::sleep(POLL);
    }
    bar.finish_and_clear();
    finish(&last, args.json)
}

pub fn snapshot(args: &SnapshotArgs) -> Result<i32> {
    let client = ApiClient::new(&args.api_socket);
    let body = SnapshotRequest {
        file: args.to.display().to_string(),
        compression: args.compression.clone(),
        migration_threads: args.migration_threads,
        writers: args.writers,
    };
    let v = client
        .put("vm.snapshot", Some(&serde_json::to_value(&body)?))
        .context("snapshot failed")?;
    let status: MigrationStatus = serde_json::from_value(v)?;
    finish(&status, args.json)
}

fn finish(status: &MigrationStatus, json: bool) -> Result<i32> {
    if json {
        println!("{}", serde_json::to_string_pretty(status)?);
    } else {
        print!("{}", report::render(status));
    }
    Ok(if status.phase == MigrationPhase::Completed {
        0
    } else {
        1
    })
}

fn progress_bar(json: bool) -> ProgressBar {
    if json || !std::io::stderr().is_terminal() {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::new_spinner();
    bar.set_style(
        ProgressStyle::with_template("{spinner} {elapsed_precise} {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_spinner()),
    );
    bar.enable_steady_tick(Duration::from_millis(100));
    bar
}
