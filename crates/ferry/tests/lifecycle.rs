//! A VM is never lost by its own lifecycle: a stop request (the API's shutdown, SIGTERM) sent
//! to a destination while a VM arrives ends the arrival and the source runs the VM on; a
//! source in the middle of its switch refuses (API) or defers (signal) a stop, and refuses a
//! cancel once `Go` left. A relay holds the conversation at the point under test, so each
//! request lands at the same point of the protocol every run.

mod common;

use std::time::Duration;

use api::MigrationPhase;
use common::relay::{Action, Point, Relay};
use common::*;

const T: Duration = Duration::from_secs(60);

/// How a test asks a process to stop.
#[derive(Clone, Copy, Debug)]
enum Stop {
    Api,
    Signal,
}

impl Stop {
    /// Asks `f` to stop; the API's answer (the signal has none). Returns once `f` took the
    /// request in: a signal is delivered whenever the kernel gets to it, so this waits for
    /// `f` to say it arrived.
    fn send(self, f: &Ferry) -> Result<(), String> {
        match self {
            Stop::Api => f
                .api()
                .put("vm.shutdown", None)
                .map(|_| ())
                .map_err(|e| e.to_string()),
            Stop::Signal => {
                let pid = f.child.as_ref().expect("a child").id() as i32;
                // SAFETY: a plain kill(2) of our own child.
                assert_eq!(unsafe { libc::kill(pid, libc::SIGTERM) }, 0);
                wait_for("the signal to arrive", T, || {
                    f.stderr_text().contains("received SIGTERM").then_some(())
                });
                Ok(())
            }
        }
    }
}

/// Starts a migration through the API and returns at once.
fn send_migration(src: &Ferry, to: &str, mode: &str) {
    // Without a window to carry a broken pre-copy on: a relay holding a frame holds back the
    // source's close too, so a stopped source could not tell a destination waiting for a
    // resume that none comes, and it would wait its window out (tests/resume.rs carries on).
    let body = serde_json::json!({"destination": to, "mode": mode, "resume_window_s": 0});
    src.api()
        .put("vm.send-migration", Some(&body))
        .expect("the migration starts");
}

/// A writer whose memory the guest verifies, and a destination behind a relay holding `at`.
fn held_at(at: Point, mode: &str) -> (Ferry, Ferry, Relay) {
    let src = Ferry::writer("write ws=8M seq verify rate=2000");
    let (dst, relay) = destination_behind(at, Action::Hold);
    send_migration(&src, &relay.url, mode);
    assert!(relay.wait_reached(T), "the migration never reached {at:?}");
    (src, dst, relay)
}

/// The guest runs on at `f`, a few passes on, with every page it wrote intact.
fn runs_on_intact(f: &Ferry, what: &str) {
    let before = f.info();
    let info = f.wait_info(what, T, |i| {
        i.state == "running" && i.passes >= before.passes + 2
    });
    assert_eq!(
        info.verify_errors, 0,
        "{what}: pages lost: {:?}",
        info.verify_error_pages
    );
}

/// A destination asked to stop while the VM arrives ends the arrival, whatever the point:
/// the source hears why and runs the VM on; the destination exits without running it.
#[test]
fn a_destination_stopped_while_a_vm_arrives_gives_it_back() {
    if !kvm_available() {
        return;
    }
    for (at, mode) in [
        (Point::Round0, "precopy"),
        (Point::State, "precopy"),
        (Point::Go, "precopy"),
        (Point::Go, "postcopy"),
    ] {
        for stop in [Stop::Api, Stop::Signal] {
            let case = format!("{stop:?} at {at:?} ({mode})");
            let (src, mut dst, relay) = held_at(at, mode);
            stop.send(&dst)
                .unwrap_or_else(|e| panic!("{case}: the stop was refused: {e}"));
            relay.release();
            let status = src.wait_migration_end();
            assert_eq!(status.phase, MigrationPhase::Failed, "{case}: {status:?}");
            let why = status.error.unwrap_or_default();
            assert!(why.contains("asked to stop"), "{case}: {why}");
            let exit = dst.wait_exit(T);
            assert!(exit.success(), "{case}: the destination exited {exit:?}");
            let said = dst.stderr_text();
            assert!(said.contains("the arrival ended"), "{case}: {said}");
            runs_on_intact(&src, &format!("{case}: the guest on the source"));
        }
    }
}

/// Between `Go` and the destination's answer, the source refuses a shutdown and a cancel
/// through the API, and defers SIGTERM until the switch ends: the VM then runs on the
/// destination, whole, and the source exits.
#[test]
fn a_source_mid_switch_holds_stops_until_the_switch_ends() {
    if !kvm_available() {
        return;
    }
    for (at, mode) in [(Point::Completion, "precopy"), (Point::Go, "postcopy")] {
        let case = format!("at {at:?} ({mode})");
        let (mut src, dst, relay) = held_at(at, mode);
        let refused = src.api().put("vm.shutdown", None).unwrap_err().to_string();
        assert!(refused.contains("HTTP 409"), "{case}: {refused}");
        assert!(refused.contains("handed over"), "{case}: {refused}");
        let refused = src
            .api()
            .put("vm.cancel-migration", None)
            .unwrap_err()
            .to_string();
        assert!(refused.contains("too late"), "{case}: {refused}");
        Stop::Signal.send(&src).unwrap();
        wait_for("the source to defer the stop", T, || {
            src.stderr_text()
                .contains("stopping once the migration ends")
                .then_some(())
        });
        assert!(src.is_running(), "{case}: the source left mid switch");
        relay.release();
        let exit = src.wait_exit(T);
        assert!(exit.success(), "{case}: the source exited {exit:?}");
        runs_on_intact(&dst, &format!("{case}: the guest on the destination"));
    }
}

/// A source asked to stop while its migration is in its rounds cancels the migration first,
/// and stops once it has ended: the VM is never handed over while it is being shut down, and
/// the destination never runs it.
#[test]
fn a_source_stopped_in_its_rounds_cancels_the_migration_first() {
    if !kvm_available() {
        return;
    }
    for stop in [Stop::Api, Stop::Signal] {
        let mut src = Ferry::writer("write ws=64M seq verify");
        let url = format!("unix:{}", src.scratch("mig.sock").display());
        let mut dst = Ferry::incoming(&url);
        // A slow link: the first round (pages plain) takes far longer than the test.
        let body =
            serde_json::json!({"destination": url, "max_bandwidth_mbps": 8, "compression": "none"});
        src.api()
            .put("vm.send-migration", Some(&body))
            .expect("the migration starts");
        src.wait_for_migration_bytes(1 << 20);
        stop.send(&src)
            .unwrap_or_else(|e| panic!("{stop:?}: the stop was refused: {e}"));
        let exit = src.wait_exit(T);
        assert!(exit.success(), "{stop:?}: the source exited {exit:?}");
        let said = dst.stderr_text();
        let exit = dst.wait_exit(T);
        assert!(
            !exit.success(),
            "{stop:?}: the destination ran the VM: {said}"
        );
        assert!(
            dst.stderr_text().contains("cancelled"),
            "{stop:?}: {}",
            dst.stderr_text()
        );
    }
}

/// The same when the source is blocked writing round 0 to a destination that reads nothing
/// (a relay holds it): the cancel cannot be heard between pages, so the source closes the
/// connection under the write instead of waiting out its timeout, and stops.
#[test]
fn a_source_blocked_on_a_destination_that_reads_nothing_still_stops() {
    if !kvm_available() {
        return;
    }
    for stop in [Stop::Api, Stop::Signal] {
        let mut src = Ferry::writer("write ws=64M seq verify");
        let (mut dst, relay) = destination_behind(Point::Round0, Action::Hold);
        send_migration(&src, &relay.url, "precopy");
        assert!(relay.wait_reached(T), "the migration never reached round 0");
        stop.send(&src)
            .unwrap_or_else(|e| panic!("{stop:?}: the stop was refused: {e}"));
        let exit = src.wait_exit(T);
        assert!(exit.success(), "{stop:?}: the source exited {exit:?}");
        relay.release();
        assert!(
            !dst.wait_exit(T).success(),
            "{stop:?}: the destination ran the VM: {}",
            dst.stderr_text()
        );
    }
}
