//! The guest boots in ferry, reports progress, verifies its memory, and obeys the API.

mod common;

use std::time::Duration;

use common::*;

const T: Duration = Duration::from_secs(30);

#[test]
fn idle_guest_heartbeats_advance() {
    if !kvm_available() {
        return;
    }
    let ferry = Ferry::boot(VmSpec::default());
    let first = ferry.wait_info("a heartbeat", T, |i| i.heartbeats > 0);
    let later = ferry.wait_info("more heartbeats", T, |i| {
        i.heartbeat_seq >= first.heartbeat_seq + 100
    });
    assert_eq!(later.state, "running");
    assert!(later.last_heartbeat_age_ms.is_some());
}

#[test]
fn write_workload_progresses_with_zero_verify_errors() {
    if !kvm_available() {
        return;
    }
    let ferry = Ferry::boot(VmSpec {
        cmdline: "write ws=64M seq verify",
        ..Default::default()
    });
    let ws_pages = 64 * 256;
    // Two whole passes: every page written, then read back and rewritten.
    let info = ferry.wait_info("two passes", Duration::from_secs(60), |i| i.passes >= 2);
    assert!(info.pages_touched >= 2 * ws_pages);
    assert_eq!(info.verify_errors, 0);
    assert_eq!(info.per_vcpu[0].guest_errors, 0);
    assert_eq!(info.per_vcpu[0].share_pages, ws_pages);
}

#[test]
fn corrupted_page_is_detected_by_the_guest() {
    if !kvm_available() {
        return;
    }
    let ferry = Ferry::boot(VmSpec {
        cmdline: "write ws=8M seq verify",
        debug_api: true,
        ..Default::default()
    });
    ferry.wait_info("one pass", T, |i| i.passes >= 1);
    ferry
        .api()
        .put(
            "vm.debug-corrupt-page",
            Some(&serde_json::json!({"page": 7})),
        )
        .expect("corrupt");
    let info = ferry.wait_info("the verify error", T, |i| i.verify_errors >= 1);
    assert_eq!(info.verify_error_pages, vec![7]);
    // The guest tells the VMM first and prints second: wait for the line, don't race it.
    wait_for("the verify error on the serial console", T, || {
        ferry
            .serial_text()
            .contains("verify error: page 7")
            .then_some(())
    });
}

#[test]
fn pause_stops_heartbeats_and_resume_restarts_them() {
    if !kvm_available() {
        return;
    }
    let ferry = Ferry::boot(VmSpec::default());
    ferry.wait_info("a heartbeat", T, |i| i.heartbeats > 0);
    ferry.put("vm.pause");
    let paused = ferry.info();
    assert_eq!(paused.state, "paused");
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(ferry.info().heartbeat_seq, paused.heartbeat_seq);
    ferry.put("vm.resume");
    let resumed = ferry.wait_info("heartbeats after resume", T, |i| {
        i.heartbeat_seq > paused.heartbeat_seq + 10
    });
    assert_eq!(resumed.state, "running");
}

#[test]
fn shutdown_ends_the_process_with_status_zero() {
    if !kvm_available() {
        return;
    }
    let mut ferry = Ferry::boot(VmSpec::default());
    ferry.put("vm.shutdown");
    assert!(ferry.wait_exit(T).success());
    assert!(!ferry.socket.exists(), "the API socket is removed on exit");
}

#[test]
fn every_vcpu_progresses() {
    if !kvm_available() {
        return;
    }
    let ferry = Ferry::boot(VmSpec {
        vcpus: 2,
        cmdline: "write ws=32M random verify",
        ..Default::default()
    });
    let info = ferry.wait_info("progress on both vCPUs", T, |i| {
        i.per_vcpu.len() == 2 && i.per_vcpu.iter().all(|c| c.pages > 4096)
    });
    assert_eq!(info.verify_errors, 0);
    assert_ne!(info.per_vcpu[0].share_base, info.per_vcpu[1].share_base);
}

#[test]
fn finished_workload_exits_zero() {
    if !kvm_available() {
        return;
    }
    let mut ferry = Ferry::boot(VmSpec {
        cmdline: "write ws=4M verify passes=3",
        ..Default::default()
    });
    assert!(ferry.wait_exit(Duration::from_secs(60)).success());
    assert!(ferry.serial_text().contains("passes=3 errors=0"));
}
