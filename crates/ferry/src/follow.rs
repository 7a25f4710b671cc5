//! Following a migration from the terminal: live progress until it ends, the report, and an
//! exit status that says what to do next (`Outcome`). `ferry migrate`, `ferry migration` and
//! `ferry cancel` share it.

use std::io::{IsTerminal, Write};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use anyhow::{Context, Result};
use api::{ApiClient, MigrationPhase, MigrationStatus};
use indicatif::{ProgressBar, ProgressStyle};

use crate::report;

/// How often a followed migration's status is read.
const POLL: Duration = Duration::from_millis(50);
/// Reads at most this many times before giving up on a VMM that stopped answering.
const MAX_POLLS: u32 = 200_000;
/// How long `--watch` waits, once the migration completed, for the guest's own figures.
const GUEST_FIGURES_POLLS: u32 = 100;

/// Where a migration left the VM, as the exit status of the command that followed it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// It completed (the VM runs on the destination), or it runs still, or none ran.
    Fine = 0,
    /// It failed or was cancelled: the VM runs on the source as it did before.
    SafeOnSource = 3,
    /// The VM may run on the destination, or runs there with part of its memory still on
    /// the source: an operator must act (`next_steps` says how).
    NeedsOperator = 4,
}

impl Outcome {
    pub fn of(status: &MigrationStatus) -> Self {
        match status.phase {
            MigrationPhase::Failed | MigrationPhase::Cancelled => Outcome::SafeOnSource,
            MigrationPhase::Unconfirmed | MigrationPhase::PostcopyPaused => Outcome::NeedsOperator,
            _ => Outcome::Fine,
        }
    }

    pub fn code(self) -> i32 {
        self as i32
    }
}

/// What to run next when a migration needs an operator; `socket` is this side's API.
pub fn next_steps(status: &MigrationStatus, socket: &Path) -> Option<String> {
    let me = socket.display();
    let destination = status.role == "destination";
    let text = match status.phase {
        MigrationPhase::Unconfirmed => format!(
            "The source sent Go and never heard back: the VM may run on the destination, so \
             it stays paused here.\n  \
             if the destination runs it:            ferry shutdown --api-socket {me}\n  \
             if the destination cannot run it (its host is down or fenced):\n    \
             ferry migrate-reclaim --api-socket {me}\n"
        ),
        MigrationPhase::PostcopyPaused if destination => format!(
            "The VM runs here with part of its memory still on the source: keep both \
             processes.\n  \
             to carry on, here:       ferry migrate-resume --api-socket {me} --listen URL\n  \
             then on the source:      ferry migrate-resume --api-socket SOURCE --to URL\n"
        ),
        MigrationPhase::PostcopyPaused => format!(
            "The VM runs on the destination with part of its memory still here: keep this \
             process.\n  \
             to carry on, on the destination:  ferry migrate-resume --api-socket DEST --listen URL\n  \
             then here:                        ferry migrate-resume --api-socket {me} --to URL\n  \
             if the destination died (and cannot run it again):\n    \
             ferry migrate-rollback --api-socket {me}\n"
        ),
        _ => return None,
    };
    Some(text)
}

/// Prints the final report (or its JSON) and what to run next; the exit status.
pub fn finish(status: &MigrationStatus, json: bool, socket: &Path) -> Result<i32> {
    let text = if json {
        serde_json::to_string_pretty(status)? + "\n"
    } else {
        report::render(status)
    };
    match std::io::stdout().lock().write_all(text.as_bytes()) {
        // A reader that stops early (`| head`) is no failure of the migration's.
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => {}
        r => r?,
    }
    if let Some(steps) = next_steps(status, socket) {
        eprint!("{steps}");
    }
    Ok(Outcome::of(status).code())
}

/// Set by SIGINT while a migration is followed.
static INTERRUPTED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_interrupt(_: libc::c_int, _: *mut libc::siginfo_t, _: *mut libc::c_void) {
    INTERRUPTED.store(true, Ordering::Release);
}

/// What Ctrl-C does while a migration is followed.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum OnInterrupt {
    /// Cancel the migration (the VM stays on the source) and follow it to its end.
    Cancel,
    /// Stop following; the migration goes on.
    Leave,
}

/// Follows the migration on `client` until it ends, with a progress line on a terminal;
/// its last status.
pub fn follow(client: &ApiClient, json: bool, interrupt: OnInterrupt) -> Result<MigrationStatus> {
    let _ = vmm_sys_util::signal::register_signal_handler(libc::SIGINT, on_interrupt);
    let bar = progress_bar(json);
    let mut cancel_sent = false;
    let mut last = MigrationStatus::default();
    for _ in 0..MAX_POLLS {
        if INTERRUPTED.load(Ordering::Acquire) {
            if interrupt == OnInterrupt::Leave {
                break;
            }
            if !cancel_sent {
                bar.println("cancelling: the VM stays on the source");
                let _ = client.put("vm.cancel-migration", None);
                cancel_sent = true;
            }
        }
        match client.get("vm.migration") {
            // A cut-short answer (the source exiting mid-reply): ask again.
            Ok(v) if v.is_null() => {}
            Ok(v) => last = serde_json::from_value(v).context("vm.migration body")?,
            // The source exits soon after a successful migration; what we have is final.
            Err(_) if last.phase == MigrationPhase::Completed => break,
            Err(e) => return Err(e).context("lost the VMM's API during the migration"),
        }
        if !last.phase.is_running() {
            break;
        }
        bar.set_message(report::progress_line(&last));
        std::thread::sleep(POLL);
    }
    bar.finish_and_clear();
    Ok(last)
}

/// Waits while the VM is still to arrive here (`vm.info` says `incoming` and no migration
/// has begun); the migration's status once one has (or as it stands when none will).
pub fn until_arriving(client: &ApiClient) -> Result<MigrationStatus> {
    for _ in 0..MAX_POLLS {
        let status: MigrationStatus =
            serde_json::from_value(client.get("vm.migration")?).context("vm.migration body")?;
        let incoming = client.get("vm.info")?["state"] == "incoming";
        if status.phase != MigrationPhase::None || !incoming {
            return Ok(status);
        }
        std::thread::sleep(POLL);
    }
    anyhow::bail!("no migration arrived")
}

/// Reads the status again until the guest's own figures are in (bounded): the destination
/// measures them a moment after the VM resumed there.
pub fn with_guest_figures(client: &ApiClient, mut status: MigrationStatus) -> MigrationStatus {
    for _ in 0..GUEST_FIGURES_POLLS {
        if !status.guest_report_pending {
            break;
        }
        std::thread::sleep(POLL);
        match client.get("vm.migration").map(serde_json::from_value) {
            Ok(Ok(s)) => status = s,
            // A source that exited took the figures with it; the destination has them.
            _ => break,
        }
    }
    status
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

#[cfg(test)]
mod tests {
    use super::*;

    fn status(phase: MigrationPhase, role: &str) -> MigrationStatus {
        MigrationStatus {
            phase,
            role: role.into(),
            ..Default::default()
        }
    }

    #[test]
    fn each_ending_has_its_exit_status_and_only_stranded_ones_a_next_step() {
        use MigrationPhase::*;
        let socket = Path::new("/run/vm.sock");
        for (phase, code) in [
            (Completed, 0),
            (Active, 0),
            (None, 0),
            (Failed, 3),
            (Cancelled, 3),
            (Unconfirmed, 4),
            (PostcopyPaused, 4),
        ] {
            for role in ["source", "destination"] {
                let s = status(phase, role);
                assert_eq!(Outcome::of(&s).code(), code, "{phase:?}");
                assert_eq!(next_steps(&s, socket).is_some(), code == 4, "{phase:?}");
            }
        }
        let source = next_steps(&status(PostcopyPaused, "source"), socket).unwrap();
        assert!(source.contains("ferry migrate-resume --api-socket /run/vm.sock --to URL"));
        assert!(source.contains("ferry migrate-rollback --api-socket /run/vm.sock"));
        let dest = next_steps(&status(PostcopyPaused, "destination"), socket).unwrap();
        assert!(dest.contains("ferry migrate-resume --api-socket /run/vm.sock --listen URL"));
        assert!(!dest.contains("rollback"));
        let unconfirmed = next_steps(&status(Unconfirmed, "source"), socket).unwrap();
        assert!(unconfirmed.contains("ferry migrate-reclaim --api-socket /run/vm.sock"));
    }
}
