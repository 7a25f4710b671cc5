//! A pre-copy that survives a broken link: the connection breaks while the VM still runs on
//! the source, the source dials again and carries on, sending only the pages whose last copy
//! did not land and what the guest dirtied meanwhile. The VM runs on the source throughout
//! and on the destination only after `Go`; its memory must arrive equal.

mod common;

use std::time::{Duration, Instant};

use api::MigrationPhase;
use common::relay::{Action, Point};
use common::*;

const T: Duration = Duration::from_secs(60);

#[test]
fn a_precopy_cut_at_80_percent_of_round_0_carries_on_and_sends_little_again() {
    if !kvm_available() {
        return;
    }
    let mut src = Ferry::writer("write ws=256M seq verify");
    let (dst, relay) = destination_behind(Point::Round0Share(80), Action::Blip);
    let (report, ok, errors) = migrate(&src, &relay.url, &["--checksum"]);
    assert!(ok, "{errors}");
    assert_eq!(report.phase, MigrationPhase::Completed);
    assert_eq!(report.resumes, 1, "{report:?}");
    // Round 0 sends what the guest touched (its 256 MiB and what booting wrote); of what had
    // crossed, only what was in flight at the cut goes a second time.
    let touched = report.memory_pages - report.pages_skipped_unpopulated;
    eprintln!(
        "resume: {} of {touched} pages sent a second time; {} resent in all",
        report.pages_sent_again, report.pages_resent
    );
    assert!(
        report.pages_sent_again * 10 <= touched * 3,
        "{} of {touched} pages sent again",
        report.pages_sent_again
    );
    assert!(report.memory_checksum_source.is_some());
    assert_eq!(
        report.memory_checksum_source, report.memory_checksum_destination,
        "memory arrived equal"
    );
    assert!(src.wait_exit(T).success(), "the source let go");
    let arrived = dst.migration_status();
    assert_eq!(
        arrived.resumes, 1,
        "the destination counts the resume: {arrived:?}"
    );
    let passes = dst.info().passes;
    let info = dst.wait_info("a pass on the destination", T, |i| i.passes > passes);
    assert_eq!(info.verify_errors, 0);
}

#[test]
fn a_link_that_stays_down_ends_the_migration_when_its_window_closes() {
    if !kvm_available() {
        return;
    }
    let src = Ferry::writer("write ws=64M seq verify");
    let (mut dst, relay) = destination_behind(Point::Round0, Action::Cut);
    let began = Instant::now();
    let (report, ok, errors) = migrate(&src, &relay.url, &["--resume-window-s", "2"]);
    assert!(!ok);
    assert_eq!(report.phase, MigrationPhase::Failed, "{report:?}");
    assert!(errors.contains("within 2 s"), "{errors}");
    assert!(began.elapsed() < T);
    // The destination waited as long as the source tried (and a little more), then gave up.
    assert!(!dst.wait_exit(T).success());
    assert!(
        dst.stderr_text().contains("did not carry on"),
        "{}",
        dst.stderr_text()
    );
    drop(relay);
    let info = src.info();
    assert_eq!(info.state, "running");
    src.wait_info("passes on the source", T, |i| i.passes > info.passes);
    assert_eq!(src.info().verify_errors, 0);
}

#[test]
fn an_operator_points_a_reconnecting_precopy_at_another_address() {
    if !kvm_available() {
        return;
    }
    let mut src = Ferry::writer("write ws=64M seq verify");
    // The relay's link stays down; the destination is still reachable straight.
    let (dst, relay) = destination_behind(Point::Round0, Action::Cut);
    let direct = relay.target_url();
    let migrating = {
        let (socket, url) = (src.socket.clone(), relay.url.clone());
        std::thread::spawn(move || {
            let socket = socket.to_str().unwrap().to_string();
            ferry_output(&["migrate", "--api-socket", &socket, "--to", &url, "--json"])
        })
    };
    wait_for("the source to dial again", T, || {
        let note = src.migration_status().note.unwrap_or_default();
        note.contains("reconnecting").then_some(())
    });
    let out = ferry_output(&[
        "migrate-resume",
        "--api-socket",
        src.socket.to_str().unwrap(),
        "--to",
        &direct,
    ]);
    assert!(out.status.success(), "{out:?}");
    let out = migrating.join().unwrap();
    let report: api::MigrationStatus = serde_json::from_slice(&out.stdout).unwrap_or_default();
    assert!(out.status.success(), "{out:?}");
    assert_eq!(report.resumes, 1);
    assert!(src.wait_exit(T).success());
    let passes = dst.info().passes;
    let info = dst.wait_info("a pass on the destination", T, |i| i.passes > passes);
    assert_eq!(info.verify_errors, 0);
}
