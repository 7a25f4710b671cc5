//! Post-copy that survives the destination's death: with `--checkpoint-ms` the destination
//! sends the VM's newest state back while post-copy runs, and after it dies the source runs
//! the VM on from the last checkpoint (`ferry migrate-rollback`) — later than the switch, and
//! with every page the guest wrote up to that checkpoint.

mod common;

use std::time::Duration;

use api::MigrationPhase;
use common::relay::{Action, Point};
use common::*;

/// How long a step may take before the test calls it stuck. Each wait returns as soon as its
/// step is done; the bound matters only when something is broken. Under load (other builds on
/// the same two cores) the migration once took over 60 s to reach post-copy's half way.
const T: Duration = Duration::from_secs(300);

/// Starts a migration through the API and returns at once (the CLI would wait for its end).
fn send_migration(src: &Ferry, to: &str, body: serde_json::Value) {
    let mut body = body;
    body["destination"] = to.into();
    src.api()
        .put("vm.send-migration", Some(&body))
        .expect("the migration starts");
}

fn checkpoint_seq(f: &Ferry) -> u64 {
    f.migration_status().checkpoints.map_or(0, |c| c.last_seq)
}

#[test]
fn rollback_runs_the_vm_from_the_last_checkpoint_after_the_destination_died() {
    takes_the_vm_back_from_the_last_checkpoint("migrate-rollback");
}

/// `migrate-reclaim` after a broken post-copy with checkpoints does the same, and says so
/// (it used to say "from the switch").
#[test]
fn reclaim_after_a_broken_postcopy_says_which_checkpoint_it_ran_from() {
    takes_the_vm_back_from_the_last_checkpoint("migrate-reclaim");
}

/// The destination dies in post-copy; `command` runs the VM on from the last checkpoint.
fn takes_the_vm_back_from_the_last_checkpoint(command: &str) {
    if !kvm_available() {
        return;
    }
    // A slow writer: after a hybrid switch it runs on for about a second through pages it
    // already has before it needs one still owed, which the relay holds back: post-copy
    // cannot end before the destination is killed, whatever the timing.
    let src = Ferry::writer("write ws=16M seq verify rate=2000");
    let (mut dst, relay) = destination_behind(Point::Postcopy(50), Action::Hold);
    send_migration(
        &src,
        &relay.url,
        serde_json::json!({"mode": "hybrid", "checkpoint_ms": 20}),
    );
    assert!(relay.wait_reached(T), "post-copy never got half way");
    let at_switch = src.info().heartbeat_seq;

    // The guest makes progress on the destination; a checkpoint taken after that is applied.
    let progressed = dst
        .wait_info("progress after the switch", T, |i| {
            i.heartbeat_seq > at_switch + 5
        })
        .heartbeat_seq;
    let sent_before = checkpoint_seq(&dst);
    let applied = wait_for("a checkpoint taken after that progress", T, || {
        let seq = checkpoint_seq(&src);
        (seq >= sent_before + 2).then_some(seq)
    });

    // The destination's host dies; the source learns that post-copy broke.
    dst.child
        .as_mut()
        .unwrap()
        .kill()
        .expect("kill -9 the destination");
    let _ = dst.wait_exit(T);
    drop(relay);
    wait_for("the source to see post-copy break", T, || {
        (src.migration_status().phase == MigrationPhase::PostcopyPaused).then_some(())
    });
    assert_eq!(
        src.info().state,
        "postcopy-paused",
        "nothing runs before the operator says so"
    );

    let out = ferry_output(&[command, "--api-socket", src.socket.to_str().unwrap()]);
    let said = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(out.status.success(), "{out:?}");
    let from: u64 = said
        .trim()
        .rsplit(' ')
        .next()
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no checkpoint named in {said:?}"));
    assert!(
        from >= applied,
        "rolled back to {from}, but {applied} was applied"
    );
    let status = src.migration_status();
    assert_eq!(status.phase, MigrationPhase::Failed);
    assert_eq!(
        status.checkpoints.as_ref().unwrap().rolled_back_to,
        Some(from)
    );

    // The guest runs on from the checkpoint: past the switch, and its memory whole.
    let resumed = src.wait_info("the guest to beat again on the source", T, |i| {
        i.state == "running" && i.heartbeat_seq > progressed
    });
    let info = src.wait_info("two passes after the rollback", T, |i| {
        i.passes >= resumed.passes + 2
    });
    assert_eq!(
        info.verify_errors, 0,
        "pages the guest wrote on the destination were lost: {:?}",
        info.verify_error_pages
    );
}
