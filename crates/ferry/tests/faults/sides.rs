//! How each side holds the VM once a fault has played out, as its API says. A live process
//! whose API does not say is *unknown*, never "nothing": the matrix cannot call a VM safe on
//! a host it could not ask.

use std::time::{Duration, Instant};

use api::MigrationPhase;

use crate::common::Ferry;

/// How long a live process has to answer (or to finish exiting) before its hold is unknown.
pub const ANSWER_WAIT: Duration = Duration::from_secs(10);

const POLL: Duration = Duration::from_millis(20);

/// The sectors a guest with a disk stamps and reads back, over and over.
pub const DISK_SECTORS: u64 = 1024;

/// How a ferry process holds the VM.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Holds {
    /// Exited, or alive with no VM (incoming, migrated away, failed).
    Nothing,
    Runs,
    /// Paused after `Go` (unconfirmed, or post-copy whose destination is gone).
    Paused(MigrationPhase),
    /// A destination in post-copy whose source is gone: it waits for pages forever.
    Stranded,
    /// Alive, and its API did not say within `ANSWER_WAIT` (no answer, or still between
    /// states).
    Unknown,
}

/// Polls `f` every 20 ms until it holds or `limit` has passed; whether it held.
pub fn poll_until(limit: Duration, mut f: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + limit;
    loop {
        if f() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(POLL);
    }
}

pub fn holds(f: &mut Ferry) -> Holds {
    holds_within(f, ANSWER_WAIT)
}

/// What `f` holds, asked until `limit`: a process on its way out is given that long to exit.
pub fn holds_within(f: &mut Ferry, limit: Duration) -> Holds {
    let mut seen = Holds::Unknown;
    poll_until(limit, || {
        seen = if f.is_running() {
            reading(f).unwrap_or(Holds::Unknown)
        } else {
            Holds::Nothing
        };
        seen != Holds::Unknown
    });
    seen
}

/// What a live process's API says it holds; `None` while it does not answer or is between
/// states (migrating, shutting down).
fn reading(f: &Ferry) -> Option<Holds> {
    let info = f.api().get("vm.info").ok()?;
    let status = f.api().get("vm.migration").ok()?;
    let phase: MigrationPhase = serde_json::from_value(status["phase"].clone()).ok()?;
    let destination = status["role"].as_str()? == "destination";
    Some(match info["state"].as_str()? {
        // The destination runs the VM with part of its memory still on the source.
        "postcopy-paused" if destination => Holds::Stranded,
        "postcopy-paused" | "unconfirmed" => Holds::Paused(phase),
        "running" | "paused" => Holds::Runs,
        "incoming" | "migrated" | "failed" => Holds::Nothing,
        _ => return None,
    })
}

/// A side's state and migration phase as its API gives them, for a log.
pub fn describe(f: &mut Ferry) -> String {
    if !f.is_running() {
        return "exited".into();
    }
    let (Ok(info), Ok(status)) = (f.api().get("vm.info"), f.api().get("vm.migration")) else {
        return "alive, no answer".into();
    };
    format!(
        "{} ({}), migration {}",
        info["state"], status["role"], status["phase"]
    )
}

/// Whether a side is still between states (a migration running, a source about to exit).
fn settling(f: &mut Ferry) -> bool {
    if !f.is_running() {
        return false;
    }
    // A process may exit between two questions (a source that let go): then it has settled.
    // One that does not answer has nothing more to say here; `holds` calls it unknown.
    let (Ok(status), Ok(info)) = (f.api().get("vm.migration"), f.api().get("vm.info")) else {
        return false;
    };
    let phase: MigrationPhase = serde_json::from_value(status["phase"].clone()).unwrap_or_default();
    let state = info["state"].as_str().unwrap_or_default();
    matches!(state, "migrating" | "migrated") || phase.is_running()
}

/// Waits up to 60 s for both sides to settle; whether they did.
pub fn settle(src: &mut Ferry, dst: &mut Ferry) -> bool {
    poll_until(Duration::from_secs(60), || !settling(src) && !settling(dst))
}

/// The running copy's verify errors after one more pass of its working set; `None` when no
/// pass ended within 60 s.
pub fn one_more_pass(f: &Ferry) -> Option<u64> {
    let info = f.api().get("vm.info").ok()?;
    let (start, reads) = (info["passes"].as_u64()?, info["blk_reads"].as_u64());
    // A guest that drives a disk reads every sector back once more too.
    let disk = reads.filter(|_| info["blk_writes"].as_u64().unwrap_or(0) > 0);
    let mut errors = None;
    poll_until(Duration::from_secs(60), || {
        let Ok(info) = f.api().get("vm.info") else {
            return false;
        };
        let read = |key: &str| info[key].as_u64().unwrap_or(0);
        if read("passes") <= start || disk.is_some_and(|r| read("blk_reads") <= r + DISK_SECTORS) {
            return false;
        }
        errors = Some(read("verify_errors") + read("blk_errors"));
        true
    });
    errors
}

pub fn kill(f: &mut Ferry) {
    if let Some(child) = f.child.as_mut() {
        let _ = child.kill(); // SIGKILL
        let _ = child.wait();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_live_process_that_does_not_answer_is_unknown() {
        let mut sleep = std::process::Command::new("sleep");
        sleep.arg("30");
        let mut silent = Ferry::stand_in(sleep);
        assert_eq!(
            holds_within(&mut silent, Duration::from_millis(200)),
            Holds::Unknown
        );
        kill(&mut silent);
        assert_eq!(
            holds_within(&mut silent, Duration::from_millis(200)),
            Holds::Nothing
        );
    }
}
