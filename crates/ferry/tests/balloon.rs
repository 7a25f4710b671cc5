//! The balloon end to end: its target through the API and the CLI, and a guest that gives its
//! free memory back on its own (dynamic self-ballooning, free page reporting) while it churns,
//! so that a migration moves its working set and not the memory it once touched.

mod common;

use std::time::Duration;

use api::{BalloonStatus, MigrationPhase, MigrationStatus, VmInfo};
use common::*;

/// Every guest instruction is emulated here and the host is shared: a first churn cycle is
/// slow.
const T: Duration = Duration::from_secs(180);
/// The churning guest: a 16 MiB working set after a first cycle up to 128 MiB.
const CHURN: &str = "churn ws=16M peak=128M verify";
const PEAK_PAGES: u64 = 128 << 8;
/// Its working set after the first cycle, in pages.
const WS_PAGES: u64 = 16 << 8;
const MEMORY: &str = "512M";

fn balloon(info: &VmInfo) -> BalloonStatus {
    info.balloon.clone().expect("vm.info shows the balloon")
}

/// The guest's balloon holds `pages` (as its driver says).
fn wait_actual(f: &Ferry, what: &str, pred: impl Fn(u64) -> bool) -> VmInfo {
    f.wait_info(what, T, |i| {
        i.balloon.as_ref().is_some_and(|b| pred(b.actual_pages))
    })
}

fn put_target(f: &Ferry, body: serde_json::Value) -> Result<(), String> {
    f.api()
        .put("vm.balloon", Some(&body))
        .map(|_| ())
        .map_err(|e| e.to_string())
}

/// An idle guest's driver follows the target the API and the CLI set, inflating and
/// deflating; its statistics show in vm.info; bad targets are refused with the reason.
#[test]
fn the_balloon_follows_its_target() {
    if !kvm_available() {
        return;
    }
    let _alone = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let vm = Ferry::boot_with(
        VmSpec {
            memory: MEMORY,
            cmdline: "idle balloon dsb_ms=200",
            ..Default::default()
        },
        &["--balloon=stats_s=1"],
    );
    put_target(&vm, serde_json::json!({"target_mib": 128})).expect("a target");
    let info = wait_actual(&vm, "the balloon to inflate", |a| a == 128 << 8);
    let b = balloon(&info);
    assert_eq!(b.target_pages, 128 << 8);
    assert!(b.pages_inflated >= 128 << 8, "{b:?}");
    assert!(b.free_page_reporting && b.deflate_on_oom, "{b:?}");
    let info = vm.wait_info("the guest's statistics", T, |i| {
        balloon(i).stats_updates >= 2
    });
    let b = balloon(&info);
    // All RAM the memory map names: 512 MiB but the legacy hole below 1 MiB.
    assert_eq!(b.guest_total_bytes, Some((512 << 20) - 0x6_0000), "{b:?}");
    let free = b.guest_free_bytes.expect("free memory in the statistics");
    assert!(
        free < (512 - 128) << 20,
        "the balloon's pages are not free: {free}"
    );
    let kind = info
        .devices
        .iter()
        .map(|d| d.kind.as_str())
        .collect::<Vec<_>>();
    assert_eq!(kind, ["virtio-balloon"]);

    let out = ferry_output(&["balloon", "--api-socket", vm.socket.to_str().unwrap(), "0"]);
    assert!(out.status.success(), "{out:?}");
    let info = wait_actual(&vm, "the balloon to deflate", |a| a == 0);
    assert!(balloon(&info).pages_deflated >= 128 << 8);

    for (body, why) in [
        (
            serde_json::json!({"target_mib": 4096}),
            "larger than the VM",
        ),
        (serde_json::json!({}), "one of target_mib and target_pages"),
        (
            serde_json::json!({"target_mib": 1, "target_pages": 256}),
            "one of",
        ),
        (serde_json::json!({"target_gib": 1}), "unknown field"),
    ] {
        let e = put_target(&vm, body.clone()).expect_err("refused");
        assert!(e.contains(why) && e.contains("400"), "{body}: {e}");
    }
    let plain = Ferry::boot(VmSpec::default());
    let e = put_target(&plain, serde_json::json!({"target_mib": 1})).expect_err("refused");
    assert!(e.contains("no balloon") && e.contains("409"), "{e}");
    assert!(plain.info().balloon.is_none());
}

/// How the churning guest gives its free memory back.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Giving {
    /// It does not (no balloon).
    Nothing,
    /// Dynamic self-ballooning, with free page reporting.
    Dsb,
    /// Free page hinting alone: a balloon without reporting, and a driver without DSB, so
    /// that what it frees reaches the host only when a migration asks.
    Hints,
}

impl Giving {
    fn words(self) -> &'static str {
        match self {
            Giving::Nothing => "",
            Giving::Dsb => " dsb dsb_ms=1000",
            Giving::Hints => " balloon",
        }
    }

    /// The balloon, on the source and the destination.
    fn device(self) -> &'static [&'static str] {
        match self {
            Giving::Nothing => &[],
            Giving::Dsb => &["--balloon"],
            Giving::Hints => &["--balloon=free_page_reporting=off"],
        }
    }
}

/// The churning guest, once its first cycle is done (and, with DSB, its balloon took most of
/// its memory; with hints alone, it gave nothing back).
fn churner(giving: Giving) -> Ferry {
    let cmdline = format!("{CHURN}{}", giving.words());
    let vm = Ferry::boot_with(
        VmSpec {
            memory: MEMORY,
            cmdline: &cmdline,
            ..Default::default()
        },
        giving.device(),
    );
    vm.wait_info("the first churn cycle", T, |i| i.passes >= 1);
    match giving {
        // 512 MiB is 131072 pages: DSB inflates with 95 % of what is free.
        Giving::Dsb => {
            wait_actual(&vm, "the balloon to take the free memory", |a| {
                a >= 96 << 10
            });
        }
        Giving::Hints => {
            let b = balloon(&vm.info());
            assert_eq!((b.freed_bytes, b.pages_hinted), (0, 0), "{b:?}");
            assert!(b.free_page_hint && !b.free_page_reporting, "{b:?}");
        }
        Giving::Nothing => {}
    }
    vm
}

/// Pages round 0 sent.
fn round0(r: &MigrationStatus) -> u64 {
    r.rounds.first().map_or(0, |r| r.pages)
}

/// Pages a migration sent, with data or as zero pages.
fn sent(r: &MigrationStatus) -> u64 {
    r.pages_full + r.pages_zero
}

/// Migrates the churning guest with `args` to a destination given the same devices; checks
/// memory was equal at the switch and the guest verified it there; returns the report.
/// The DSB tests bound pages by what a churning guest frees while rounds run: with another
/// test's guest on the same cores the rounds stretch and the bounds do not hold, so this
/// file's tests run one at a time.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn migrate_churner(giving: Giving, args: &[&str]) -> MigrationStatus {
    let mut src = churner(giving);
    let url = format!("unix:{}", src.scratch("mig.sock").display());
    let dst = Ferry::start(&[&["--incoming", &url][..], giving.device()].concat());
    let (report, ok, said) = migrate(&src, &url, &[&["--checksum"], args].concat());
    assert!(ok, "{args:?}: {said}\n{report:?}");
    assert_eq!(report.phase, MigrationPhase::Completed);
    let info = assert_every_page_arrived(&mut src, &dst, &report, 2);
    assert_eq!(info.verify_errors, 0);
    if giving == Giving::Dsb {
        // The balloon goes on there: what the guest frees is given back on the destination
        // too (after post-copy, once the engine let go of its memory).
        let freed = balloon(&dst.info()).freed_bytes;
        dst.wait_info("the destination to give pages back", T, |i| {
            balloon(i).freed_bytes > freed
        });
    }
    report
}

/// The paper's point: without DSB, pre-copy sends every page the guest once touched; with
/// it, about the working set. The figures come from the two reports. With DSB the link is
/// slowed so that rounds last seconds: the guest frees, reports and inflates pages while they
/// run, and memory is still equal at the switch and verified on the destination.
#[test]
fn dsb_keeps_free_memory_off_the_wire_in_precopy() {
    if !kvm_available() {
        return;
    }
    let _alone = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    // Pages plain and whole on both runs: the bytes compare what was sent, not how it packed.
    let plain = ["--compression", "none", "--delta-cache-mb", "0"];
    let with = migrate_churner(
        Giving::Dsb,
        &[&["--max-bandwidth-mbps", "40"][..], &plain].concat(),
    );
    let without = migrate_churner(Giving::Nothing, &plain);
    eprintln!(
        "pre-copy of a 512 MiB guest that touched {PEAK_PAGES} pages and churns 4096: with DSB \
         {} pages in round 0, {} full and {} zero in all, {} bytes on the wire, {} skipped as \
         given back; without: {} in round 0, {} full, {} bytes",
        round0(&with),
        with.pages_full,
        with.pages_zero,
        with.bytes_on_wire,
        with.pages_skipped_free,
        round0(&without),
        without.pages_full,
        without.bytes_on_wire
    );
    // Round 0 sends every page that holds data: without DSB all the guest once touched.
    assert!(round0(&without) >= PEAK_PAGES, "{without:?}");
    // With DSB round 0 sends the working set and the guest's own pages (its image, page
    // tables, the balloon's buffers), not what it freed: under twice the working set.
    assert!(round0(&with) < 2 * WS_PAGES, "{with:?}");
    let bytes0 = |r: &MigrationStatus| r.rounds.first().map_or(0, |r| r.bytes);
    assert!(bytes0(&with) * 4 < bytes0(&without), "{with:?}");
    // Each later round resends what the guest dirtied or gave back meanwhile (the latter as
    // zero pages): about its working set, never the memory it freed. How many rounds there
    // are depends on how fast the guest runs beside the other tests, so each is held to it.
    for r in with.rounds.iter().skip(1) {
        assert!(
            r.pages - r.zero_pages < PEAK_PAGES / 4,
            "round {}: {with:?}",
            r.round
        );
    }
    assert!(with.pages_skipped_free >= PEAK_PAGES / 2, "{with:?}");
    assert_eq!(without.pages_skipped_free, 0);
}

/// Free page hinting alone: the guest freed most of what it touched but gave nothing back;
/// asked by the migration, it hints its free pages before round 0 looks, so round 0 sends
/// about its working set. It holds them until the switch, takes some back when its working
/// set grows meanwhile (written after their hint: they must arrive), and after the switch
/// reuses them all: memory is equal at the switch and the guest verifies it there.
#[test]
fn free_page_hints_keep_free_memory_off_the_wire_in_precopy() {
    if !kvm_available() {
        return;
    }
    let _alone = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let r = migrate_churner(
        Giving::Hints,
        &["--compression", "none", "--delta-cache-mb", "0"],
    );
    eprintln!(
        "pre-copy with free page hints: {} pages in round 0, {} full and {} zero in all, {} \
         skipped as given back",
        round0(&r),
        r.pages_full,
        r.pages_zero,
        r.pages_skipped_free
    );
    assert!(round0(&r) < PEAK_PAGES / 8, "{r:?}");
    assert!(r.pages_skipped_free >= PEAK_PAGES / 2, "{r:?}");
}

/// Post-copy answers faults on pages the guest gave back with zero pages, never asks for
/// them, and never pushes them; the balloon holds its discards until the memory is whole.
#[test]
fn dsb_keeps_free_memory_off_the_wire_in_postcopy() {
    if !kvm_available() {
        return;
    }
    let _alone = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    for mode in ["postcopy", "hybrid"] {
        let r = migrate_churner(Giving::Dsb, &["--mode", mode]);
        // Every page pushed or requested is sent once, with data or as a zero marker (those
        // of huge pages the guest touched only in part: zeros, but populated).
        let moved = sent(&r);
        eprintln!(
            "{mode} with DSB: {moved} pages sent ({} with data; {} pushed, {} requested), {} \
             skipped as given back",
            r.pages_full, r.pages_pushed, r.pages_requested, r.pages_skipped_free
        );
        assert!(r.postcopy, "{r:?}");
        // Given-back pages pushed even as markers would be most of the peak's.
        assert!(moved < PEAK_PAGES / 2, "{r:?}");
        // Data: the working set and the guest's tables, not the memory it touched once.
        assert!(r.pages_full < 2 * WS_PAGES, "{r:?}");
        assert_eq!(r.postcopy_report.as_ref().map(|p| p.duplicates), Some(0));
    }
}

/// A hostile guest keeps an inflate request of a million scattered pages in flight
/// (`balloon_flood`, each page a run of its own to give back). The device serves it a turn at
/// a time and lets go of its lock between turns: `vm.info` answers while a request is half
/// served (the pages inflated are no whole number of requests; served whole, the counters
/// could only be read between requests), and a migration pauses the VM between two turns and
/// completes, the guest's memory verified on the destination, where the flood goes on.
#[test]
fn a_guest_flooding_its_balloon_stalls_neither_the_api_nor_a_migration() {
    if !kvm_available() {
        return;
    }
    let _alone = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    const REQUEST: u64 = 16 * 65536;
    let mut src = Ferry::boot_with(
        VmSpec {
            memory: MEMORY,
            vcpus: 2,
            cmdline: "write ws=16M seq verify vcpus=2 balloon_flood",
            ..Default::default()
        },
        &["--balloon"],
    );
    src.wait_info("a flood request half served", T, |i| {
        let inflated = balloon(i).pages_inflated;
        inflated > 0 && !inflated.is_multiple_of(REQUEST)
    });
    let url = format!("unix:{}", src.scratch("mig.sock").display());
    let dst = Ferry::start(&["--incoming", &url, "--balloon"]);
    let (report, ok, said) = migrate(&src, &url, &["--checksum"]);
    assert!(ok, "{said}\n{report:?}");
    assert_eq!(report.phase, MigrationPhase::Completed);
    let info = assert_every_page_arrived(&mut src, &dst, &report, 2);
    assert_eq!(info.verify_errors, 0);
    let arrived = balloon(&info).pages_inflated;
    dst.wait_info("the flood to go on at the destination", T, |i| {
        balloon(i).pages_inflated > arrived
    });
}
