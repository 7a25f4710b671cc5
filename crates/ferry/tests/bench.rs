//! The benchmark runner itself: its outputs, its QEMU driver, and its cleanup.

mod common;

use std::path::Path;
use std::process::Command;

use common::*;

fn runner(args: &[&str]) -> std::process::Output {
    Command::new("/usr/bin/python3")
        .arg(repo_root().join("bench/run.py"))
        .args(args)
        .output()
        .expect("run the benchmark runner")
}

fn non_empty(path: &Path) -> bool {
    std::fs::metadata(path)
        .map(|m| m.len() > 0)
        .unwrap_or(false)
}

#[test]
fn tiny_profile_writes_every_output() {
    if !kvm_available() {
        return;
    }
    guest();
    let out = tempfile::tempdir().unwrap();
    let r = runner(&["--profile", "tiny", "--out", out.path().to_str().unwrap()]);
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    let json: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.path().join("results.json")).unwrap()).unwrap();
    for key in [
        "started",
        "profile",
        "repeats",
        "machine",
        "links",
        "scenarios",
        "ratios",
    ] {
        assert!(json.get(key).is_some(), "results.json lacks {key}");
    }
    for key in ["cpu", "cores", "kernel", "kvm"] {
        assert!(json["machine"].get(key).is_some(), "machine lacks {key}");
    }
    let row = &json["scenarios"][0];
    assert_eq!(row["peer"], "ferry");
    assert!(row["error"].is_null(), "{row}");
    let run = &row["runs"][0];
    for key in [
        "total_ms",
        "downtime_ms",
        "guest_downtime_ms",
        "bytes",
        "rounds",
        "pages_skipped",
    ] {
        assert!(!run[key].is_null(), "run lacks {key}: {run}");
    }
    assert!(row["summary"]["total_ms"]["median"].as_f64().unwrap() > 0.0);
    // Bytes are counted on the link, headers and all: never fewer than the VMM sent.
    assert!(
        run["wire_bytes"].as_f64().unwrap() >= run["bytes"].as_f64().unwrap(),
        "{run}"
    );
    assert!(run["total_ms_reported"].as_f64().unwrap() > 0.0, "{run}");
    for file in [
        "results.md",
        "precopy_rounds.svg",
        "throughput.svg",
        "ferry_vs_qemu.svg",
    ] {
        assert!(non_empty(&out.path().join(file)), "{file} missing or empty");
    }
}

#[test]
fn qemu_driver_measures_a_qemu_migration() {
    if !qemu_available() || !kvm_available() {
        return;
    }
    guest();
    let out = tempfile::tempdir().unwrap();
    let r = runner(&[
        "--profile",
        "tiny",
        "--peers",
        "qemu",
        "--out",
        out.path().to_str().unwrap(),
    ]);
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    let json: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.path().join("results.json")).unwrap()).unwrap();
    let run = &json["scenarios"][0]["runs"][0];
    assert_eq!(run["peer"], "qemu");
    assert!(run["total_ms"].as_f64().unwrap() > 0.0, "{run}");
    assert!(run["bytes"].as_f64().unwrap() > 0.0, "{run}");
    // Timed on the destination's clock (its MIGRATION event), its own figure beside it.
    assert!(run["total_ms_reported"].as_f64().unwrap() > 0.0, "{run}");
    assert!(run["wire_bytes"].as_f64().unwrap() > 0.0, "{run}");
}

/// A WAN-like link (`1gbit+20ms`): a TCP connection's handshake takes at least the round
/// trip the delay line adds (a packet never leaves it early), and bytes arrive intact.
fn delay_line_adds_its_round_trip() {
    if !Path::new("/dev/net/tun").exists() {
        eprintln!("SKIPPED: the delay line needs /dev/net/tun, which this host lacks");
        return;
    }
    let program = r#"
import socket, subprocess, sys
sys.path.insert(0, sys.argv[1])
from fb.links import Link, ADDR_DST
with Link("1gbit+20ms", sys.argv[2]) as link:
    sink = ("import socket;s=socket.socket();s.bind((%r,0));s.listen(1);"
            "print(s.getsockname()[1],flush=True);c,_=s.accept();n=0\n"
            "while True:\n b=c.recv(65536)\n if not b: break\n n+=len(b)\n"
            "c.sendall(str(n).encode())") % ADDR_DST
    srv = subprocess.Popen(["ip", "netns", "exec", link.ns_dst, sys.executable, "-c", sink],
                           stdout=subprocess.PIPE, text=True)
    port = int(srv.stdout.readline())
    client = ("import socket,time;t=time.monotonic();c=socket.create_connection((%r,%d));"
              "rtt=time.monotonic()-t;c.sendall(b'x'*(1<<20));c.shutdown(socket.SHUT_WR);"
              "print(rtt,c.recv(64).decode())") % (ADDR_DST, port)
    out = subprocess.run(["ip", "netns", "exec", link.ns_src, sys.executable, "-c", client],
                         capture_output=True, text=True, timeout=60)
    srv.wait(timeout=30)
    print(out.stdout.strip(), out.stderr.strip())
"#;
    let tag = format!("dl{}", std::process::id() % 100_000);
    let out = Command::new("/usr/bin/python3")
        .args(["-c", program])
        .arg(repo_root().join("bench"))
        .arg(&tag)
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{said} {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut words = said.split_whitespace();
    let rtt: f64 = words.next().and_then(|w| w.parse().ok()).expect(&said);
    assert!(
        rtt >= 0.040,
        "a handshake across 20 ms each way took {rtt} s"
    );
    assert_eq!(words.next(), Some("1048576"), "{said}");
}

/// The bench's links and a failing scenario leave no namespace, device or process behind.
#[test]
fn a_failed_scenario_leaves_nothing_behind() {
    if !kvm_available() {
        return;
    }
    guest();
    // Here, not in a test of its own: its namespaces would be found by the check below.
    delay_line_adds_its_round_trip();
    let out = tempfile::tempdir().unwrap();
    let prefix = format!("ferry-bench-failtest-{}-", std::process::id());
    for link in ["1gbit", "1gbit+5ms"] {
        let r = runner(&[
            "--profile",
            "tiny",
            "--links",
            link,
            "--fail-scenario",
            "--work-prefix",
            &prefix,
            "--out",
            out.path().to_str().unwrap(),
        ]);
        assert!(
            !r.status.success(),
            "{link}: the failing scenario is reported as a failure"
        );
    }
    let netns = Command::new("ip").args(["netns", "list"]).output().unwrap();
    let netns = String::from_utf8_lossy(&netns.stdout);
    assert!(
        !netns
            .lines()
            .any(|l| l.starts_with("fbs-") || l.starts_with("fbd-")),
        "namespaces left behind:\n{netns}"
    );
    let links = Command::new("ip").args(["-o", "link"]).output().unwrap();
    assert!(
        !String::from_utf8_lossy(&links.stdout).contains("fbva"),
        "veth left behind"
    );
    let ps = Command::new("ps").args(["-eo", "args"]).output().unwrap();
    let ps = String::from_utf8_lossy(&ps.stdout);
    assert!(
        !ps.lines()
            .any(|l| l.contains(&prefix) || l.contains("delayline.py")),
        "processes left behind:\n{ps}"
    );
}

/// The scale profile runs where there is neither a build nor QEMU, curl or `ip`: only the
/// binary, the guest image and python3 (here shrunk to fit this host).
#[test]
fn scale_profile_runs_from_a_kit_alone() {
    if !kvm_available() {
        return;
    }
    guest();
    let kit = tempfile::tempdir().unwrap();
    let bin = tempfile::tempdir().unwrap();
    std::fs::copy(FERRY, kit.path().join("ferry")).unwrap();
    std::fs::copy(guest(), kit.path().join("guest.elf")).unwrap();
    std::fs::write(kit.path().join("COMMIT"), "0123abcd clean\n").unwrap();
    std::os::unix::fs::symlink("/usr/bin/python3", bin.path().join("python3")).unwrap();
    let out = tempfile::tempdir().unwrap();
    let r = Command::new("/usr/bin/python3")
        .arg(repo_root().join("bench/run.py"))
        .args([
            "--profile",
            "scale",
            "--scale-memory",
            "1G",
            "--scale-ws",
            "64M",
            "--scale-vcpus",
            "2",
            "--only",
            "warm 64M / 1G 2 conn",
            "--out",
            out.path().to_str().unwrap(),
        ])
        .env_clear()
        .env("PATH", bin.path())
        .env("FERRY_BIN", kit.path().join("ferry"))
        .env("FERRY_GUEST", kit.path().join("guest.elf"))
        .output()
        .expect("run the benchmark runner");
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    let json: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.path().join("results.json")).unwrap()).unwrap();
    assert_eq!(json["build"]["commit"], "0123abcd");
    let rows = json["scenarios"].as_array().unwrap();
    assert_eq!(rows.len(), 1, "{rows:?}");
    assert!(rows[0]["error"].is_null(), "{}", rows[0]);
    let run = &rows[0]["runs"][0];
    assert_eq!(run["connections"], 2, "{run}");
    // Counted in pages: compressed, the writer's stamped pages take a few bytes each.
    assert!(
        run["pages_full"].as_f64().unwrap() * 4096.0 > 64e6,
        "the working set moved: {run}"
    );
    // Each side's CPU by work: a sender and a receiver per connection.
    let threads = |side: &str, work: &str| {
        run[side]
            .as_array()
            .and_then(|a| a.iter().find(|u| u["work"] == work))
            .map(|u| u["threads"].as_u64().unwrap())
    };
    assert_eq!(threads("cpu_by_work_source", "send"), Some(2), "{run}");
    assert_eq!(
        threads("cpu_by_work_destination", "receive"),
        Some(2),
        "{run}"
    );
    // The ceilings beside the rows: plain streams into one process, and faulting in.
    for n in ["1", "8", "16"] {
        for kind in ["reused", "fresh"] {
            let v = &json["links_parallel"]["loopback"][n][kind];
            assert!(v.as_f64().is_some_and(|b| b > 0.0), "{n} {kind}: {v}");
        }
    }
    let faults = json["fault_in"].as_object().unwrap();
    assert_eq!(faults.len(), 5, "{faults:?}");
    assert!(faults.values().all(|v| v.as_f64().is_some_and(|b| b > 0.0)));
}

/// The results page's rules, on made-up rows: QEMU's pick is the shortest total among the
/// variants that kept the downtime limit (the shortest downtime where none did), a ferry
/// variant that beats the defaults is named, the headline's ratios and verdict follow the
/// medians, and the application rows take QEMU's best for each metric on its own.
#[test]
fn the_page_picks_and_judges_by_its_rules() {
    let program = r#"
import sys
sys.path.insert(0, sys.argv[1])
from fb import page
def entry(peer, total, down, wire=1e6, link="1gbit", scenario="w"):
    s = lambda v: {"median": v, "min": v, "max": v}
    return {"link": link, "scenario": scenario, "peer": peer, "runs": [{"variant": peer}],
            "summary": {"total_ms": s(total), "serial_downtime_ms": s(down), "wire_bytes": s(wire)}}
fast_but_long_pause = entry("qemu-a", 100, 50)
kept = [entry("qemu-b", 300, 10), entry("qemu-c", 200, 19)]
assert page.pick([fast_but_long_pause] + kept, 20)["peer"] == "qemu-c"
assert page.pick([fast_but_long_pause, entry("qemu-d", 900, 30)], 20)["peer"] == "qemu-d"
sweep = {"scenarios": [fast_but_long_pause] + kept + [entry("qemu-e", 50, 5, link="loopback")]}
assert page.winners(sweep, {"w": 20}) == {"1gbit": {"w": "qemu-c"}, "loopback": {"w": "qemu-e"}}
meta = {"started": "t", "repeats": 1, "machine": {"cores": 2, "cpu": "c", "kvm": "k"},
        "build": {"commit": "0123456789ab", "ferry_sha256": "f" * 64, "qemu": "QEMU 10"}}
flags = dict(meta, scenarios=[entry("ferry", 1000, 5), entry("ferry-lz4", 850, 5),
                              entry("ferry-zstd", 950, 5), entry("ferry-2conn", 500, 40)])
row = page.flags_table(flags, {"w": 20})[-2]
assert row.endswith("| ferry-lz4 |"), row
head = dict(meta, scenarios=[entry("ferry", 60, 4, 1e6), entry("qemu-best", 100, 10, 2e6)])
line = next(l for l in page.headline_tables(head) if l.startswith("| w |"))
assert "| 0.60 | 0.40 | 0.50 | met |" in line, line
head["scenarios"][0]["summary"]["total_ms"]["median"] = 80
line = next(l for l in page.headline_tables(head) if l.startswith("| w |"))
assert line.endswith("| not met: total |"), line
# A run of one link replaces that link's rows, keeps the others' and says where each came from.
wan = dict(meta, started="u", build=dict(meta["build"], commit="fedcba987654"),
           scenarios=[entry("qemu-x", 70, 5, link="1gbit+50ms"), entry("qemu-y", 60, 3, link="loopback")])
merged = page.merge(sweep | meta, wan)
assert [(e["link"], e["peer"]) for e in merged["scenarios"]] == [
    ("1gbit", "qemu-a"), ("1gbit", "qemu-b"), ("1gbit", "qemu-c"),
    ("1gbit+50ms", "qemu-x"), ("loopback", "qemu-y")], merged["scenarios"]
said = page.provenance(merged, "Sweep")
assert "1gbit: t, commit 0123456789" in said and "loopback, 1gbit+50ms: u, commit fedcba9876" in said, said
# A run of some variants replaces those variants' rows on its links and keeps the others'.
more = dict(meta, started="v", build=dict(meta["build"], commit="abcdefabcdef"),
            scenarios=[entry("qemu-b", 250, 8), entry("qemu-f", 150, 9)])
again = page.merge(merged, more, some_peers=True)
assert sorted((e["link"], e["peer"]) for e in again["scenarios"]) == [
    ("1gbit", "qemu-a"), ("1gbit", "qemu-b"), ("1gbit", "qemu-c"), ("1gbit", "qemu-f"),
    ("1gbit+50ms", "qemu-x"), ("loopback", "qemu-y")], again["scenarios"]
assert page.winners(again, {"w": 20})["1gbit"] == {"w": "qemu-f"}
said = page.provenance(again, "Sweep")
assert "1gbit: t, commit 0123456789" in said and "1gbit (qemu-b, qemu-f): v, commit abcdefabcd" in said, said
# The application rows: QEMU's best for each metric on its own (the shortest total among the
# variants that kept the limit), each named, and ferry judged against each.
app = dict(meta, scenarios=[entry("ferry", 60, 4, 3e6, scenario="app"), entry("qemu", 200, 8, 4e6, scenario="app"),
                            entry("qemu-mfd2", 100, 30, 4e6, scenario="app"),
                            entry("qemu-zstd", 150, 12, 2e6, scenario="app")])
best = page.best_per_metric(app["scenarios"][1:], 20)
assert {m: e["peer"] for m, e in best.items()} == {
    "total_ms": "qemu-zstd", "serial_downtime_ms": "qemu", "wire_bytes": "qemu-zstd"}, best
line = next(l for l in page.app_tables(app, {"app": 20}) if l.startswith("| app |"))
assert "150 (150–150) qemu-zstd" in line and "8.0 (8.0–8.0) qemu" in line, line
assert line.endswith("| 0.40 | 0.50 | 1.50 | not met: bytes |"), line
# A run that read the guest's stalls out of its memory is judged by the stall at the switch;
# each peer's stalls, the console's gap (here the other way round) beside them, on a table of
# their own.
for e, stall in zip(app["scenarios"], (3, 20, 6, 9)):
    for m, v in (("guest_stall_ms", stall), ("stall_after_resume_ms", 1), ("longest_stall_ms", 30),
                 ("sample_gap_ms", 0.4), ("downtime_ms", 2)):
        e["summary"][m] = {"median": v, "min": v, "max": v}
tables = page.app_tables(app, {"app": 20})
line = next(l for l in tables if l.startswith("| app |"))
assert "6.0 (6.0–6.0) qemu-mfd2" in line and line.endswith("| 0.60 | 0.50 | 1.50 | not met: bytes |"), line
stalls = [l for l in page.stall_table(app) if l.startswith("| 1gbit | app |")]
assert len(stalls) == 4 and stalls[0].startswith("| 1gbit | app | ferry | 3.0 (3.0–3.0) | 1.0"), stalls
# The headline's chart: a bar per metric and row, ferry ÷ QEMU, each goal marked.
svg = page.plot.svg(page.plot.rows_of(page.by_cell(head), page.ratio), page.GOAL)
assert svg.count("<rect") == 3 + 3 and ">0.8<" in svg and ">0.4<" in svg and ">0.5<" in svg, svg
print("ok")
"#;
    bench_python_says_ok(program);
}

/// The Linux row's figures, on made-up samples and rows: the stall at the switch runs from the
/// source counter's last move to the destination's first move past it (midpoints of the
/// sampling windows), with its part after the destination said it runs; the longest stall counts a stall before the switch, and ferry is judged
/// against QEMU's best variant for each metric separately.
#[test]
fn the_linux_row_reads_both_sides_counters_and_judges_each_metric() {
    let program = r#"
import sys
sys.path.insert(0, sys.argv[1])
from fb import linux, report, stall
ms = lambda i: i / 1000
# The source stands still from 1 ms to 22 ms (a stall while it runs), reaches 4 at 23 ms and
# stops; the destination, a stale copy until then, passes 4 at 26 ms.
samples = [(0.0, 1, None), (ms(1), 2, None)] + [(ms(i), 2, 0) for i in range(2, 22)]
samples += [(ms(22), 3, 0), (ms(23), 4, 0), (ms(24), 4, 0), (ms(25), 4, 3), (ms(26), 4, 5), (ms(27), 4, 6)]
# The destination's VMM said the VM runs at 24.2 ms: 1.3 ms before the guest moved there.
f = stall.stalls(samples, ms(24.2))
assert abs(f["guest_stall_ms"] - 3.0) < 1e-9, f
assert abs(f["stall_after_resume_ms"] - 1.3) < 1e-9, f
assert abs(f["longest_stall_ms"] - 21.0) < 1e-9, f
assert abs(f["sample_gap_ms"] - 1.0) < 1e-9, f
# The instrument's longest gap: where it began, from the source's last move, and how far the
# counter went on across it (here the source's, from 9 to 13 ms, while it stood still).
gappy = samples[:10] + samples[13:]
g = stall.stalls(gappy, ms(24.2))
assert abs(g["sample_gap_ms"] - 4.0) < 1e-9 and abs(g["sample_gap_at_ms"] + 13.5) < 1e-9, g
assert g["sample_gap_moved"] == 0, g
s = lambda v: {"median": v, "min": v, "max": v, "n": 1}
row = lambda vmm, total, stall, wire: {"vmm": vmm, "mode": "precopy", "runs": [{"writer_errors": 0}],
    "error": None, "summary": {"total_ms": s(total), "guest_stall_ms": s(stall), "link_bytes": s(wire)}}
rows = [row("ferry", 70, 1, 100), row("qemu", 120, 4, 90), row("qemu-mfd2", 100, 5, 95)]
best = {b["metric"]: (b["versus"], round(b["ratio"], 2)) for b in linux.against_best(rows)}
assert best == {"total_ms": ("qemu-mfd2", 0.7), "guest_stall_ms": ("qemu", 0.25),
                "link_bytes": ("qemu", 1.11)}, best
meta = {"profile": "linux", "started": "t", "repeats": 1,
        "machine": {"cores": 2, "cpu": "c", "kvm": "k", "kernel": "6"},
        "build": {"commit": "0123456789ab", "ferry_sha256": "f" * 64, "qemu": "QEMU 10"}}
text = report.linux_page(dict(meta, linux=rows))
for said in ("total_ms: 0.70 of qemu-mfd2's (meets the goal of 0.7)",
             "guest_stall_ms: 0.25 of qemu's (meets the goal of 0.5)",
             "link_bytes: 1.11 of qemu's (misses the goal of 1.0)",
             "[linux.json](linux.json)", "at 0123456", "3 runs: 0 pages found wrong"):
    assert said in text, (said, text)
print("ok")
"#;
    bench_python_says_ok(program);
}

/// The workload guest's stall instrument finds guest memory in a VMM's address space by the
/// first heartbeat block's magic, at the start of the mapping or, when the RAM above the hole
/// was mapped right before the RAM below it, at its end, and sums the vCPUs' counters.
#[test]
fn the_stall_instrument_finds_the_heartbeat_blocks_and_sums_them() {
    let program = r#"
import mmap, os, struct, sys
sys.path.insert(0, sys.argv[1])
from fb import stall
BLOCKS = 0x66c100
def block(cpu, pages):
    b = bytearray(stall.HB_SIZE)
    struct.pack_into("<Q", b, stall.HB_PAGES_AT, pages)
    struct.pack_into("<II", b, 48, cpu, stall.HB_MAGIC)
    return bytes(b)
# A 16 MiB guest whose RAM starts its mapping, and one laid out as [4 MiB above][12 MiB below]
# in a single mapping (the kernel merges the two).
for low_at in (0, 4 << 20):
    ram = mmap.mmap(-1, 16 << 20)
    ram[low_at + BLOCKS:low_at + BLOCKS + 256] = block(0, 1000) + block(1, 234)
    side = stall.WorkloadSide(os.getpid(), (16 << 20) - low_at, BLOCKS, 2)
    assert side.pages() == 1234, low_at
    ram[low_at + BLOCKS + 8:low_at + BLOCKS + 16] = struct.pack("<Q", 1001)
    assert side.pages() == 1235
    ram.close()
# Memory without the blocks (a destination before they arrived) reads as nothing yet.
empty = mmap.mmap(-1, 16 << 20)
assert stall.WorkloadSide(os.getpid(), 16 << 20, BLOCKS, 1).pages() is None
# The guest image's symbol, as the bench looks it up.
assert stall.symbol(os.path.join(sys.argv[1], "..", "guest", "build", "guest.elf"), "blocks") > 0x100000
print("ok")
"#;
    bench_python_says_ok(program);
}

/// Runs `program` with bench/ as its first argument; it must print only "ok".
fn bench_python_says_ok(program: &str) {
    let out = Command::new("/usr/bin/python3")
        .args(["-c", program])
        .arg(repo_root().join("bench"))
        .output()
        .unwrap();
    assert!(
        out.status.success() && String::from_utf8_lossy(&out.stdout).trim() == "ok",
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}
