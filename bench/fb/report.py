"""results.json, a Markdown table and plots from one run."""
import json
import os
import re
import statistics
import sys

from . import linux, storage
from .util import summarize

METRICS = ["total_ms", "total_ms_reported", "wire_bytes", "downtime_ms", "destination_downtime_ms", "guest_downtime_ms", "serial_downtime_ms",
           "guest_stall_ms", "stall_after_resume_ms", "longest_stall_ms", "sample_gap_ms", "bytes", "rounds",
           "network_faults", "network_fault_share", "zero_faults", "resume_ms", "pages_transferred",
           "fault_latency_p50_ms", "fault_latency_p99_ms", "rate_after", "checkpoint_count",
           "checkpoint_mb_back", "checkpoint_pause_ms_mean", "checkpoint_pause_ms_max",
           "cpu_s_source", "cpu_s_destination", "cpu_s_per_gib", "cpu_s_guest_destination", "gb_per_s", "restore_ms",
           "stop_to_resume_ms"]


# The forwarding runs (`--profile devices`).
FORWARDING = ["sent", "offered_per_s", "received", "lost", "longest_gap_ms", "downtime_ms",
              "guest_downtime_ms", "total_ms", "guest_net_errors"]


# The disk-writer runs (`--profile devices`).
BLOCK = ["writes_seen", "longest_write_gap_ms", "blk_errors", "downtime_ms", "total_ms"]


# The balloon profile's (`--profile balloon`), summarized where a row has them.
BALLOON_METRICS = ["ws_bytes", "bytes_per_ws", "guest_pages_per_s", "pages_skipped_free",
                   "pages_requested", "first_pass_ms", "settle_s", "balloon_share",
                   "verify_errors_after"]


# The resume profile's (`--profile resume`), summarized where a row went through the relay.
RESUME_METRICS = ["resumes", "pages_sent_again", "sent_again_share", "pages_resent", "pages_full",
                  "pages_zero", "memory_pages", "relay_bytes", "relay_bytes_to_destination",
                  "extra_share", "relay_connections", "point_ms", "stall_ms",
                  "first_connection_closed_ms_after_point", "verify_errors_after"]
# The resume profile's goal: at most this share of guest memory sent again.
RESUME_GOAL_SHARE = 0.30


def summarize_rows(rows):
    extra = BALLOON_METRICS if any("ws_bytes" in r for r in rows) else []
    extra += RESUME_METRICS if any("relay_fault" in r for r in rows) else []
    return {m: summarize([r.get(m) for r in rows]) for m in METRICS + extra}


def resume_shares(results):
    """Each resume run's `extra_share`: what the relay forwarded beyond the median of the
    same link's and memory's no-fault runs, as a share of guest memory: how much more crossed,
    whatever the report counts. Rows are summarized again."""
    entries = [e for e in results["scenarios"] if e.get("resume")]
    for e in entries:
        base = next((b for b in entries if b["resume"]["fault"] == "none" and b["link"] == e["link"]
                     and b["resume"]["memory"] == e["resume"]["memory"] and b["peer"] == e["peer"]), None)
        s = summarize([r.get("relay_bytes") for r in (base or {}).get("runs", [])])
        for r in e["runs"]:
            r["extra_share"] = ((r["relay_bytes"] - s["median"]) / r["memory_bytes"]
                                if s and r.get("relay_bytes") is not None and r.get("memory_bytes") else None)
        e["summary"] = summarize_rows(e["runs"])
    return entries


# The postcopy-lanes profile's goal: post-copy's total within this many times warm's at the
# same connection count, and its fault latency p99 within this many ms (on 10 Gbit).
LANES_GOAL_RATIO = 1.2
LANES_GOAL_P99_MS = 2.0
LANES_NAME = re.compile(r"(\d+) vCPUs (\d+) conn (warm|post-copy)$")


def lanes_table(results, cell=None):
    """The postcopy-lanes profile per link, vCPUs and connections: warm's total and
    post-copy's (both on the destination's clock), their ratio against the goal, post-copy's
    network faults, duplicates and fault latency (p50 / p99 / max, the destination's), the
    guest's downtime, and where the cores went: both VMMs' CPU for the move (warm, post-copy)
    and the guest's on the destination meanwhile. `cell(entry, metric, scale, digits)` formats
    a summarized metric (default: median [min–max])."""
    cell = cell or (lambda e, m, scale=1.0, digits=1: fmt(e.get("summary", {}), m, scale, digits))
    cells = {}
    for e in results["scenarios"]:
        m = LANES_NAME.search(e["scenario"])
        if m and e.get("runs"):
            cells.setdefault((e["link"], int(m[1]), int(m[2])), {})[m[3]] = e
    if not cells:
        return []

    def median(e, metric):
        s = (e or {}).get("summary", {}).get(metric)
        return s["median"] if s else None

    def runs_max(e, key):
        vals = [r.get(key) for r in (e or {}).get("runs", []) if r.get(key) is not None]
        return max(vals) if vals else None

    lines = ["| link | vCPUs | connections | warm total ms | post-copy total ms | post-copy ÷ warm "
             "| network faults | duplicates | fault latency p50 / p99 / max ms | guest downtime ms "
             "(post-copy) | move CPU s warm / post-copy | guest CPU s (post-copy) | goal |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for (link, vcpus, conns), by in sorted(cells.items(), key=lambda kv: (kv[0][0] != "loopback", kv[0])):
        warm, post = by.get("warm"), by.get("post-copy")
        w, p = median(warm, "total_ms"), median(post, "total_ms")
        ratio = p / w if p and w else None
        p99 = runs_max(post, "fault_latency_p99_ms")
        misses = []
        if ratio is None or ratio > LANES_GOAL_RATIO:
            misses.append("ratio " + ("-" if ratio is None else f"{ratio:.2f}"))
        if link.startswith("10gbit") and (p99 is None or p99 > LANES_GOAL_P99_MS):
            misses.append("p99 " + ("-" if p99 is None else f"{p99:.2f} ms"))
        latency = " / ".join(cell(post, k, digits=2) if k != "fault_latency_max_ms" else
                             ("-" if runs_max(post, k) is None else f"{runs_max(post, k):.2f}")
                             for k in ("fault_latency_p50_ms", "fault_latency_p99_ms",
                                       "fault_latency_max_ms"))
        dups = [r.get("duplicates") for r in (post or {}).get("runs", [])]
        move_cpu = " / ".join(move_cpu_s(e) for e in (warm, post))
        lines.append(f"| {link} | {vcpus} | {conns} | {cell(warm, 'total_ms')} | {cell(post, 'total_ms')} "
                     f"| {'-' if ratio is None else f'{ratio:.2f}'} | {cell(post, 'network_faults', digits=0)} "
                     f"| {', '.join('-' if d is None else str(d) for d in dups) or '-'} | {latency} "
                     f"| {cell(post, 'guest_downtime_ms')} | {move_cpu} "
                     f"| {cell(post, 'cpu_s_guest_destination')} "
                     f"| {'met' if not misses else 'not met: ' + ', '.join(misses)} |")
    lines += ["", f"Goal: post-copy's total at most {LANES_GOAL_RATIO}× warm's at the same connection "
                  f"count; on 10 Gbit also a fault latency p99 of at most {LANES_GOAL_P99_MS} ms "
                  "(the worst run's). Max: the worst run's. Move CPU: both VMMs' threads but the "
                  "guest's, source and destination, median; guest CPU: the destination's vCPU "
                  "threads from the request to the VM needing nothing more from the source "
                  "(sampled every 50 ms).", ""]
    return lines


def move_cpu_s(entry):
    """The median of a lanes row's CPU for the move on both hosts, guest threads left out."""
    runs = [r["cpu_s_source"] + r["cpu_s_destination"] for r in (entry or {}).get("runs", [])
            if r.get("cpu_s_source") is not None and r.get("cpu_s_destination") is not None]
    return f"{statistics.median(runs):.1f}" if runs else "-"


def resume_table(results, cell=None):
    """The resume profile per link, memory and fault: the total on the destination's clock and
    ferry's own, the downtime, the breaks carried on, the pages sent again (and their share of
    guest memory, against the goal), every page sent after its first copy, what the relay
    forwarded and the share of memory beyond the no-fault runs, the relay's connections and how
    the first one ended, the checksums, and a pass verified on the destination. `cell(entry,
    metric, scale, digits)` formats a summarized metric (default: median [min–max])."""
    rows = [e for e in results["scenarios"] if e.get("resume")]
    if not rows:
        return []
    cell = cell or (lambda e, m, scale=1.0, digits=1: fmt(e.get("summary", {}), m, scale, digits))
    faults = ["none", "cut", "stall"]
    rows = sorted(rows, key=lambda e: (e["link"], e["resume"]["memory"], faults.index(e["resume"]["fault"])
                                       if e["resume"]["fault"] in faults else 9, e["peer"]))

    def runs_say(e, key, show=str):
        vals = [r.get(key) for r in e.get("runs", [])]
        return ", ".join(dict.fromkeys("-" if v is None else show(v) for v in vals)) if vals else "-"

    def verdict(e):
        runs = e.get("runs", [])
        if e["resume"]["fault"] == "none" or not runs:
            return "-"
        misses = []
        if e.get("error"):
            misses.append("a run failed")
        if any((r.get("resumes") or 0) < 1 for r in runs):
            misses.append("no resume in " + ", ".join(f"run {i + 1}" for i, r in enumerate(runs)
                                                       if (r.get("resumes") or 0) < 1))
        worst = max((r["sent_again_share"] for r in runs if r.get("sent_again_share") is not None),
                    default=None)
        if worst is None or worst > RESUME_GOAL_SHARE:
            misses.append("sent again " + ("-" if worst is None else f"{worst * 100:.1f} %"))
        if any(r.get("checksums_equal") is not True for r in runs):
            misses.append("checksums")
        if any(r.get("verify_errors_after") for r in runs):
            misses.append("verify errors")
        return "met" if not misses else "not met: " + ", ".join(misses)

    lines = ["| link | scenario | runs | total ms (destination's clock) | total ms (ferry's own) "
             "| downtime ms | resumes | pages sent again | sent again ÷ memory | pages resent "
             "| pages full | MB through the relay | MB (ferry's bytes_on_wire) | extra ÷ memory "
             "| relay connections | first connection ended | checksums equal | verify errors after a pass "
             "| goal (≤ 30 % sent again, resumed) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for e in rows:
        name = e["scenario"] + (f" (failed: {e['error']})" if e.get("error") else "") + (
            f" ({e['outcome']})" if e.get("outcome") else "")
        errors = [r.get("verify_errors_after") for r in e.get("runs", [])]
        lines.append(
            f"| {e['link']} | {name} | {len(e.get('runs', []))} | {cell(e, 'total_ms', digits=0)} "
            f"| {cell(e, 'total_ms_reported', digits=0)} | {cell(e, 'downtime_ms', digits=2)} "
            f"| {runs_say(e, 'resumes')} | {cell(e, 'pages_sent_again', digits=0)} "
            f"| {cell(e, 'sent_again_share', 0.01)} % | {cell(e, 'pages_resent', digits=0)} "
            f"| {cell(e, 'pages_full', digits=0)} | {cell(e, 'relay_bytes', 1e6, 0)} "
            f"| {cell(e, 'bytes', 1e6, 0)} | {cell(e, 'extra_share', 0.01)} % "
            f"| {runs_say(e, 'relay_connections')} | {runs_say(e, 'first_connection_ended')} "
            f"| {runs_say(e, 'checksums_equal', lambda v: 'yes' if v else 'NO')} "
            f"| {str(sum(errors)) if errors and None not in errors else '-'} | {verdict(e)} |")
    return lines + ["", "One plain TCP connection over loopback through a relay (bench/fb/cutter.py) that "
                        "reads the source's frames: at the point (round 0's pages, as `Populated` named "
                        "them, this share sent) it resets the connection (cut), or forwards nothing either "
                        "way for the stall's length and then carries on if the connection still stands; "
                        "the source's later connections go through untouched. Sent again: pages that had "
                        "crossed and went a second time (`pages_sent_again`), ÷ the guest's pages "
                        "(`memory_pages`); pages resent: every page sent after its first copy, guest "
                        "writes included. MB through the relay: both ways, every connection; extra ÷ "
                        "memory: that beyond the median of the no-fault runs, ÷ guest memory. Total: from the migrate request to the VM needing nothing more from "
                        "the source, on the destination's clock. Verify errors: the writer's pages "
                        "checked in one whole pass on the destination.", ""]


def median(summary, metric):
    s = summary.get(metric)
    return s["median"] if s else None


def ratios(results):
    """ferry / QEMU per scenario and link, for each QEMU variant."""
    out = []
    by_key = {}
    for r in results["scenarios"]:
        by_key.setdefault((r["scenario"], r["link"]), {})[r["peer"]] = r["summary"]
    for (scenario, link), peers in by_key.items():
        # ferry as it comes against each QEMU; ferry at its best against QEMU at its best.
        pairs = [("ferry", p) for p in peers if p.startswith("qemu")]
        pairs += [("ferry-best", "qemu-best")]
        for mine, peer in pairs:
            ferry, other = peers.get(mine), peers.get(peer)
            if not ferry or not other:
                continue
            row = {"scenario": scenario, "link": link, "ferry": mine, "versus": peer}
            for m in ("total_ms", "downtime_ms", "serial_downtime_ms", "wire_bytes"):
                a, b = median(ferry, m), median(other, m)
                row[m] = (a / b) if (a is not None and b) else None
            out.append(row)
    return out


def ratio_text(v):
    """A ratio in a table cell ("-": not measured)."""
    return f"{v:.2f}" if v is not None else "-"


def vmm_cell(row, _summary):
    """A device row's VMM, and why it failed if it did."""
    return row["vmm"] + (f" (failed: {row['error']})" if row.get("error") else "")


def fmt(summary, metric, scale=1.0, digits=1):
    s = summary.get(metric)
    if not s:
        return "-"
    return f"{s['median'] / scale:.{digits}f} [{s['min'] / scale:.{digits}f}–{s['max'] / scale:.{digits}f}]"


def figure(header, metric, digits=1):
    """A table column of one metric's median [min–max] (`fmt`), for `device_table`."""
    return header, lambda _run, summary: fmt(summary, metric, digits=digits)


def breakdown_tables(scenarios):
    """Idle rows: each side's stretches (median ms over the runs), so that no time is unexplained."""
    lines = []
    for r in scenarios:
        if "idle" not in r["scenario"] or not r["runs"] or not r["runs"][0].get("breakdown_source"):
            continue
        for side in ("source", "destination"):
            runs = [x[f"breakdown_{side}"] or [] for x in r["runs"]]
            names = [b["name"] for b in runs[0]]
            cells = []
            for i, name in enumerate(names):
                vals = sorted(run[i]["ms"] for run in runs if len(run) > i and run[i]["name"] == name)
                cells.append(f"{name} {vals[len(vals) // 2]:.2f}")
            lines += [f"Time of `{r['scenario']}` ({r['link']}, {r['peer']}), {side}'s clock, median ms: "
                      + " · ".join(cells), ""]
    if lines:
        lines = ["## Where an idle migration's time goes", ""] + lines
    return lines


def is_update(entry):
    """A live update's row (`--profile update`): ferry's `--local`, QEMU's cpr-transfer."""
    return any("source_exit" in r for r in entry.get("runs", [])) or entry.get("peer") == "qemu-cpr"


def update_table(results, cell=None):
    """Live updates in place by guest memory, guest and VMM: the total on the destination's
    clock and the VMM's own, the downtime on each clock, the console gap, the bytes of the
    messages on the socket, the pages sent (none), what the destination's guest found wrong in
    a pass over its pages, and how the old process ended. `cell(entry, metric, scale,
    digits)` formats a summarized metric (default: median [min–max])."""
    rows = [e for e in results["scenarios"] if is_update(e)]
    if not rows:
        return []
    cell = cell or (lambda e, m, scale=1.0, digits=1: fmt(e.get("summary", {}), m, scale, digits))

    def memory(e):
        sizes = re.findall(r"\b(\d+)([GM])\b", e["scenario"].split("/")[-1])
        n, unit = sizes[-1] if sizes else (0, "G")
        return int(n) << (10 if unit == "G" else 0)

    scenarios = list(dict.fromkeys(e["scenario"] for e in rows))
    rows = sorted(rows, key=lambda e: (e["link"], memory(e), "idle" not in e["scenario"],
                                        scenarios.index(e["scenario"]), e["peer"] != "ferry", e["peer"]))

    def runs_say(e, key, show):
        vals = [r.get(key) for r in e.get("runs", [])]
        return ", ".join(dict.fromkeys(show(v) for v in vals)) if vals else "-"

    lines = ["| scenario | peer | total ms (destination's clock) | total ms (VMM's own) | downtime ms, "
             "source's clock | downtime ms, destination's clock | guest-observed ms (heartbeats) "
             "| guest downtime ms (console ticks) | QEMU: STOP → RESUME ms | KB on the socket | pages sent "
             "| verify errors after a pass | old process exit |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for e in rows:
        peer = e["peer"] + (f" (failed: {e['error']})" if e.get("error") else "") + (
            f" ({e['outcome']})" if e.get("outcome") else "")
        verify = "verify" in e["scenario"].split()
        errors = [r.get("verify_errors_after") for r in e.get("runs", [])]
        lines.append(
            f"| {e['scenario']} | {peer} | {cell(e, 'total_ms')} | {cell(e, 'total_ms_reported')} "
            f"| {cell(e, 'downtime_ms', digits=2)} | {cell(e, 'destination_downtime_ms', digits=2)} "
            f"| {cell(e, 'guest_downtime_ms', digits=2)} | {cell(e, 'serial_downtime_ms')} "
            f"| {cell(e, 'stop_to_resume_ms', digits=2)} | {cell(e, 'bytes', 1e3)} "
            f"| {runs_say(e, 'pages_full', lambda v: '-' if v is None else str(v))} "
            f"| {(str(sum(errors)) if errors and None not in errors else '-') if verify else '-'} "
            f"| {runs_say(e, 'source_exit', lambda v: 'still running' if v is None else str(v))} |")
    return lines + ["", "Total: from the update request to the new process running the VM with nothing "
                        "more to come (ferry: its `completed_at_unix_ns`; QEMU: its RESUME event), on "
                        "the destination's clock. KB on the socket: the messages each VMM counts "
                        "(ferry's `bytes_on_wire`; QEMU's `ram.transferred` on its main channel, "
                        "its cpr channel uncounted); memory and device files pass as descriptors. "
                        "QEMU's own downtime and total are whole milliseconds. Verify errors: a "
                        "writer's pages checked in one whole pass on the destination.", ""]


def balloon_table(results):
    """The balloon profile per link × mode × variant × peer (medians of the runs): total on
    the destination's clock, bytes on the link, the guest's downtime, its working set at the
    move and the bytes per byte of it, the total and the guest's work rate against the same
    mode's `off` row, and what post-copy faulted."""
    rows = [e for e in results["scenarios"] if e.get("balloon")]
    if not rows:
        return []
    order = {"modes": ["precopy", "postcopy", "hybrid"], "variants": ["off", "dsb", "hint"]}

    def mid(entry, metric, scale=1.0):
        s = summarize([r.get(metric) for r in (entry or {}).get("runs", [])])
        return s["median"] / scale if s else None

    def f(v, digits=0):
        return "-" if v is None else f"{v:.{digits}f}"

    def key(e):
        b = e["balloon"]
        links = list(dict.fromkeys(x["link"] for x in rows))
        return (links.index(e["link"]), order["modes"].index(b["mode"]) if b["mode"] in order["modes"] else 9,
                order["variants"].index(b["variant"]) if b["variant"] in order["variants"] else 9,
                e["peer"].startswith("qemu"), e["peer"])

    lines = ["| link | mode | variant | peer | total ms | MB on the link | guest downtime ms "
             "| working set MB | bytes ÷ working set | total ÷ off | guest pages/s | rate ÷ off "
             "| post-copy faults | MB skipped (given back) | verify errors |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for e in sorted(rows, key=key):
        b = e["balloon"]
        off = next((x for x in rows if x["link"] == e["link"] and x["peer"] == e["peer"]
                    and x["balloon"]["mode"] == b["mode"] and x["balloon"]["variant"] == "off"), None)
        total, rate = mid(e, "total_ms"), mid(e, "guest_pages_per_s")
        t_off, r_off = mid(off, "total_ms"), mid(off, "guest_pages_per_s")
        estimated = any(r.get("ws_from", "serial") != "serial" for r in e.get("runs", []))
        ws = mid(e, "ws_bytes", 1e6)
        # ferry: faults that went to the source; QEMU: its postcopy-requests.
        faults = mid(e, "network_faults") if not e["peer"].startswith("qemu") else mid(e, "pages_requested")
        skipped = mid(e, "pages_skipped_free")
        peer = e["peer"] + (f" (failed: {e['error']})" if e.get("error") else "") + (
            f" ({e['outcome']})" if e.get("outcome") else "")
        lines.append(
            f"| {e['link']} | {b['mode']} | {b['variant']} | {peer} | {f(total)} | {f(mid(e, 'wire_bytes', 1e6))} "
            f"| {f(mid(e, 'serial_downtime_ms'), 1)} | {f(ws)}{'~' if estimated and ws is not None else ''} "
            f"| {f(mid(e, 'bytes_per_ws'), 1)} | {f(total / t_off if total and t_off else None, 2)} "
            f"| {f(rate)} | {f(rate / r_off if rate and r_off else None, 2)} "
            f"| {f(faults) if b['mode'] != 'precopy' else '-'} "
            f"| {f(skipped * 4096 / 1e6 if skipped is not None else None)} | {f(mid(e, 'verify_errors_after'))} |")
    return lines + ["", "Working set MB: churn's at the move, from its console (`ws_pages=`; `~`: "
                        "worked out from its `pages=` counter, a guest without a balloon prints no "
                        "`ws_pages=`). Guest pages/s: pages it took, freed and rewrote per second over "
                        "a fixed window before the move. Post-copy faults: ferry's network faults, "
                        "QEMU's postcopy-requests.", ""]


def markdown(results):
    m = results["machine"]
    lines = [f"# ferry benchmark — {results['started']}", "",
             f"Machine: {m['cpu']}, {m['cores']} cores, kernel {m['kernel']}, KVM: {m['kvm']}. "
             f"Profile `{results['profile']}`, {results['repeats']} runs per row; "
             "cells are median [min–max].", ""]
    b = results.get("build")
    if b:
        lines += [f"Build: commit {b['commit']}{' (with uncommitted changes)' if b['tree_changed'] else ''}, "
                  f"ferry sha256 {b['ferry_sha256'][:16]}…, QEMU: {b['qemu'] or 'not installed'}.", ""]
    if results.get("links"):
        fresh = results.get("links_fresh") or {}
        lines += ["| link | TCP goodput (MB/s) | into fresh memory (MB/s) |", "|---|---|---|"]
        lines += [f"| {k} | {v / 1e6:.0f} | {fresh[k] / 1e6:.0f} |" if k in fresh else f"| {k} | {v / 1e6:.0f} | - |"
                  for k, v in results["links"].items()]
        lines.append("")
    for link, by_n in (results.get("links_parallel") or {}).items():
        lines += [f"Plain streams at once on {link}, into one process (MB/s): "
                  + ", ".join(f"{n}: {v['reused'] / 1e6:.0f} (fresh memory {v['fresh'] / 1e6:.0f})"
                              for n, v in by_n.items()), ""]
    if results.get("fault_in"):
        lines += ["Faulting fresh memory in, threads of one process (MB/s): "
                  + ", ".join(f"{n}: {v / 1e6:.0f}" for n, v in results["fault_in"].items()), ""]
    if results.get("boot"):
        lines += ["## Boot", "", "| memory | ferry run → first heartbeat (ms) | heartbeats/s |", "|---|---|---|"]
        lines += [f"| {b['memory']} | {b['first_heartbeat_ms']:.1f} | {b['heartbeats_per_s']:.0f} |"
                  for b in results["boot"]]
        lines.append("")
    if results.get("dirty_logging"):
        d = results["dirty_logging"]
        lines += ["## Cost of dirty logging to the guest", "",
                  f"`write ws=256M seq`: {d['pages_per_s_without']:.0f} pages/s without, "
                  f"{d['pages_per_s_with']:.0f} pages/s with KVM dirty logging harvested every 100 ms "
                  f"(ratio {d['ratio']:.2f}).", ""]
    if any(e.get("balloon") for e in results["scenarios"]):
        lines += ["## The balloon: a churning guest after a large peak", ""] + balloon_table(results)
    snaps = [r for r in results["scenarios"] if r["runs"] and "restore_ms" in r["runs"][0]]
    if snaps:
        lines += ["## Snapshots", "",
                  "Restore: `ferry run --restore` started → the VM runs; then the guest verifies a "
                  "whole pass of its set.", "",
                  "| scenario | snapshot ms | MB in the file | GB/s (file ÷ time) | restore ms | verify errors |",
                  "|---|---|---|---|---|---|"]
        for r in snaps:
            s = r["summary"]
            errors = sum(x["verify_errors_after"] for x in r["runs"])
            lines.append(f"| {r['scenario']} | {fmt(s, 'total_ms')} | {fmt(s, 'bytes', 1e6)} | "
                         f"{fmt(s, 'gb_per_s', digits=2)} | {fmt(s, 'restore_ms')} | {errors} |")
        lines.append("")
    if any(is_update(e) for e in results["scenarios"]):
        lines += ["## Live update in place", ""] + update_table(results)
    if any(e.get("resume") for e in results["scenarios"]):
        lines += ["## A pre-copy across a broken link", ""] + resume_table(results)
    lines += breakdown_tables(results["scenarios"])
    moves = [r for r in results["scenarios"] if r not in snaps and not is_update(r)
             and not r.get("resume")]
    if moves:
        lines += ["## Migrations", "",
                  "Total: from the migrate request to the VM needing nothing more from the source, "
                  "on the destination's clock for both VMMs (each one's own figure beside it); bytes "
                  "counted on the link, headers included (each one's own count beside it).", "",
                  "| link | scenario | peer | total ms | total ms (VMM's own) | guest downtime ms (console ticks, both VMMs) "
                  "| downtime ms (VMM) | guest downtime ms (heartbeat port, ferry) | MB on the link | MB (VMM's own) "
                  "| GB/s (VMM's bytes ÷ its total) | rounds | floor ms |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in moves:
        s = r["summary"]
        floor = f"{r['floor_ms']:.1f}" if r.get("floor_ms") is not None else "-"
        err = f" (failed: {r['error']})" if r.get("error") else ""
        if r.get("outcome"):
            err += f" ({r['outcome']})"
        lines.append(f"| {r['link']} | {r['scenario']} | {r['peer']}{err} | {fmt(s, 'total_ms')} | "
                     f"{fmt(s, 'total_ms_reported')} | "
                     f"{fmt(s, 'serial_downtime_ms')} | {fmt(s, 'downtime_ms', digits=2)} | "
                     f"{fmt(s, 'guest_downtime_ms', digits=2)} | {fmt(s, 'wire_bytes', 1e6)} | "
                     f"{fmt(s, 'bytes', 1e6)} | {fmt(s, 'gb_per_s', digits=2)} | "
                     f"{fmt(s, 'rounds', digits=0)} | {floor} |")
    pc = [r for r in results["scenarios"] if r["runs"] and r["runs"][0].get("postcopy")]
    if pc:
        lines += ["", "## Post-copy", "",
                  "| link | scenario | peer | network faults | share of pages sent | zero-page faults "
                  "| fault latency p50 / p99 ms | resume ms | pages transferred |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in pc:
            s = r["summary"]
            share = median(s, "network_fault_share")
            share = f"{share * 100:.1f} %" if share is not None else "-"
            lines.append(f"| {r['link']} | {r['scenario']} | {r['peer']} | {fmt(s, 'network_faults', digits=0)} | "
                         f"{share} | {fmt(s, 'zero_faults', digits=0)} | {fmt(s, 'fault_latency_p50_ms', digits=2)} / {fmt(s, 'fault_latency_p99_ms', digits=2)} | "
                         f"{fmt(s, 'resume_ms')} | {fmt(s, 'pages_transferred', digits=0)} |")
    cp = [r for r in results["scenarios"] if r["runs"] and "checkpoint" in r["scenario"]]
    if cp:
        lines += ["", "## Post-copy checkpoints", "",
                  "Guest rate: pages the guest touched per second over its first second on the "
                  "destination (post-copy still running), as the destination measured it.", "",
                  "| link | scenario | checkpoints | MB back | guest pause per checkpoint ms (mean / max) "
                  "| guest rate after the switch (pages/s) | total ms |",
                  "|---|---|---|---|---|---|---|"]
        for r in cp:
            s = r["summary"]
            lines.append(f"| {r['link']} | {r['scenario']} | {fmt(s, 'checkpoint_count', digits=0)} | "
                         f"{fmt(s, 'checkpoint_mb_back')} | {fmt(s, 'checkpoint_pause_ms_mean', digits=2)} / "
                         f"{fmt(s, 'checkpoint_pause_ms_max', digits=2)} | {fmt(s, 'rate_after', digits=0)} | "
                         f"{fmt(s, 'total_ms')} |")
    cpu = [r for r in results["scenarios"] if r["summary"].get("cpu_s_per_gib")]
    if cpu:
        lines += ["", "## Host CPU per GiB moved", "",
                  "A paused guest's populated memory moved warm (QEMU: `stop`, then its pre-copy); CPU "
                  "seconds (user + system) of the source and destination VMM processes over the move, "
                  "their guest threads left out.", "",
                  "| link | scenario | VMM | CPU s source | CPU s destination | CPU s per GiB | total ms |",
                  "|---|---|---|---|---|---|---|"]
        for r in cpu:
            s = r["summary"]
            lines.append(f"| {r['link']} | {r['scenario']} | {r['peer']} | {fmt(s, 'cpu_s_source', digits=2)} | "
                         f"{fmt(s, 'cpu_s_destination', digits=2)} | {fmt(s, 'cpu_s_per_gib', digits=2)} | "
                         f"{fmt(s, 'total_ms')} |")
    if results.get("forwarding"):
        lines += ["", "## Forwarding across a move", "",
                  "Two host namespaces and a switch namespace joined by veths shaped to 1 Gbit/s; the "
                  "guest forwards frames (`net=fwd`) on a virtio-net NIC on host 0's tap while a "
                  "generator in the switch sends 64-byte frames at the rate for 6 s; the move to host 1 "
                  "starts after 2 s. ferry and QEMU (microvm) run the same guest, both with a 300 ms "
                  "downtime limit. *Longest gap*: the longest time between two frames coming back (the "
                  "outage the network sees).", "",
                  *device_table(results["forwarding"], [
                      ("frames/s", lambda r, s: str(r["rate"])),
                      ("VMM", lambda r, s: r.get("vmm", "ferry")),
                      ("move", move_cell),
                      figure("offered/s", "offered_per_s", 0),
                      figure("back", "received", 0),
                      figure("lost", "lost", 0),
                      figure("longest gap ms", "longest_gap_ms"),
                      figure("downtime ms (VMM)", "downtime_ms", 2),
                      figure("guest downtime ms", "guest_downtime_ms", 2)])]
        pairs = forwarding_ratios(results["forwarding"])
        if pairs:
            lines += ["", "ferry / QEMU, medians (< 1: ferry better):", "",
                      "| frames/s | move | longest gap | lost | downtime (VMM) |", "|---|---|---|---|---|"]
            f = ratio_text
            for p in pairs:
                lines.append(f"| {p['rate']} | {p['mode']} | {f(p['longest_gap_ms'])} | {f(p['lost'])} | "
                             f"{f(p['downtime_ms'])} |")
    if results.get("block"):
        lines += ["", "## The disk across a move", "",
                  "The guest stamps sectors and reads each back (`blk`, 2048 sectors, 2000 requests/s) "
                  "on a disk file both VMMs of a move open; the move (over loopback) starts 2 s into a "
                  "4 s watch of the file (inotify). *Longest write gap*: the longest time between two "
                  "writes reaching the file. *Wrong sectors*: read back on the destination without "
                  "their last stamp (a lost or repeated write).", "",
                  *device_table(results["block"], [
                      ("VMM", lambda r, s: r["vmm"]),
                      ("move", move_cell),
                      figure("modify events", "writes_seen", 0),
                      figure("longest write gap ms", "longest_write_gap_ms"),
                      figure("wrong sectors", "blk_errors", 0),
                      figure("downtime ms (VMM)", "downtime_ms", 2)])]
    if results.get("storage"):
        lines += storage_lines(results["storage"])
    if results.get("linux"):
        lines += linux_lines(results["linux"])
    if results.get("ratios"):
        lines += ["", "## ferry / QEMU (medians; < 1 means ferry is better)", "",
                  "| link | scenario | ferry | versus | total (destination's clock) | guest downtime (console ticks) "
                  "| downtime (VMM) | bytes on the link |",
                  "|---|---|---|---|---|---|---|---|"]
        f = ratio_text
        for r in results["ratios"]:
            lines.append(f"| {r['link']} | {r['scenario']} | {r['ferry']} | {r['versus']} | {f(r['total_ms'])} | "
                         f"{f(r['serial_downtime_ms'])} | {f(r['downtime_ms'])} | {f(r['wire_bytes'])} |")
    return "\n".join(lines) + "\n"


def storage_lines(rows):
    """The storage profile's table (bench/fb/storage.py says how each figure is taken) and
    ferry / QEMU."""
    lines = ["", "## A VM and its disk to a host with a disk of its own", "",
             "The guest stamps its disk's first MiB (`blk`, 2048 sectors) and writes 16 MiB of memory "
             "while the disk (sparse: its data pseudo-random, or for *files* an ext4 file system "
             f"of this host's `{storage.FILES_FROM}`, what it took in parentheses) moves with it to "
             "an empty target as large: ferry by `--copy-storage`, QEMU by `blockdev-mirror` to the destination's NBD "
             "export, then `migrate`. Both over the loopback of a namespace of their own (*link*: "
             "as it is, or shaped by tbf); *link bytes*: what that loopback received. *Total*: request to the destination running, "
             "this host's clock. *Wrong sectors*: read back on the destination without their last "
             "stamp.", "",
             *device_table(rows, [
                 ("disk MiB (data)", lambda r, s: disk_cell(r)),
                 ("link", lambda r, s: r.get("link", "loopback")),
                 ("VMM", vmm_cell),
                 figure("total ms", "total_ms"),
                 figure("of it mirror ms", "mirror_ms"),
                 figure("downtime ms (VMM)", "downtime_ms", 2),
                 figure("guest downtime ms", "guest_downtime_ms", 2),
                 figure("link bytes", "link_bytes", 0),
                 figure("wrong sectors", "blk_errors", 0)])]
    pairs = storage.ratios(rows)
    if pairs:
        f = ratio_text
        lines += ["", "ferry / QEMU, medians (< 1: ferry better):", "",
                  "| disk MiB (data) | link | total | downtime (VMM) | link bytes |", "|---|---|---|---|---|"]
        lines += [f"| {disk_cell(p, rows)} | {p['link']} | {f(p['total_ms'])} | "
                  f"{f(p['downtime_ms'])} | {f(p['link_bytes'])} |" for p in pairs]
    return lines


def close(ratio, limit):
    """A ratio to two places, or to as many more (up to five) as tell it from the limit."""
    places = next((n for n in range(2, 6) if f"{ratio:.{n}f}" != f"{limit:.{n}f}"), 5)
    return f"{ratio:.{places}f}"


def disk_words(pair, rows):
    """A storage pair's disk in words."""
    cell = disk_cell(pair, rows)
    size, _, data = cell.partition(" (")
    if pair.get("content", "random") == "files":
        return f"{size} MiB holding a file system ({data.removeprefix('files, ').rstrip(')')} MiB)"
    return f"{size} MiB ({data.rstrip(')')} MiB of data)"


def disk_cell(row, rows=None):
    """A storage row's disk: its size and data, `files` with the MiB its file system took
    (the median of `row`'s runs, or of the row of `rows` it pairs with)."""
    if row.get("content", "random") != "files":
        return f"{row['disk_mib']} ({row['used_mib']})"
    if "summary" not in row:
        row = next(r for r in rows if storage.same_row(r, row))
    taken = row["summary"].get("data_mib")
    return f"{row['disk_mib']} (files, {taken['median']:.0f})" if taken else f"{row['disk_mib']} (files)"


def provenance(results, raw):
    """Where a profile's own page comes from: the run, the build, QEMU and the machine."""
    b, m = results["build"], results["machine"]
    return (f"Written by `python3 bench/run.py --profile {results['profile']}` from "
            f"[{raw}]({raw}), beside it.\n\n"
            f"Run `{results['started']}`, {results['repeats']} runs per row, at "
            f"{b['commit'][:7]}{' (tree changed)' if b.get('tree_changed') else ''}: ferry sha256 "
            f"`{b['ferry_sha256'][:16]}…`, {b['qemu']}; {m['cpu']}, {m['cores']} cores, kernel "
            f"{m['kernel']}, KVM {m['kvm']}.")


def storage_page(results):
    """docs/benchmarks/storage.md: the storage profile's run (`results`), its provenance, its
    table and what the medians say against the goal (0.7 of QEMU's total, no more bytes)."""
    lines = ["# A VM and its disk to a host with a disk of its own (`--copy-storage`)", "",
             provenance(results, storage.RAW_FILE) + " ferry runs with `--copy-storage` and no other flag; "
             "QEMU (microvm) exports the destination's disk over NBD, mirrors onto it "
             "(`blockdev-mirror sync=full copy-mode=write-blocking`), migrates once the mirror is "
             "ready (downtime limit 300 ms, ferry's default), then cancels the job and stops the "
             "export, as libvirt's `--copy-storage-all` does (bench/fb/storage.py)."]
    lines += storage_lines(results["storage"])[2:]
    goal = {"total_ms": 0.7, "link_bytes": 1.0}
    said = []
    for p in storage.ratios(results["storage"]):
        size = f"{disk_words(p, results['storage'])}, {p['link']}"
        verdicts = [f"{name} {close(p[m], limit)} of QEMU's ({'meets' if p[m] <= limit else 'misses'} the "
                    f"goal of {limit})" for m, limit, name in
                    (("total_ms", goal["total_ms"], "total"), ("link_bytes", goal["link_bytes"], "bytes"))
                    if p[m] is not None]
        said.append(f"- {size}: " + "; ".join(verdicts) + ".")
    if said:
        lines += ["", "Against the goal, by the medians above:", "", *said]
    runs = [r for row in results["storage"] for r in row["runs"]]
    wrong = sum(r.get("blk_errors") or 0 for r in runs)
    unequal = sum(not r.get("target_equal") for r in runs)
    lines += ["", f"{len(runs)} runs: {wrong} wrong sectors, {unequal} targets unlike their source."]
    return "\n".join(lines) + "\n"


def linux_lines(rows):
    """The Linux profile's table (bench/fb/linux.py says how each figure is taken) and ferry
    against QEMU's best variant for each metric."""
    lines = ["", "## ferry's Linux guest moved", "",
             "Debian's 6.12 kernel with ferry's syscall-free `/init` stamping 16 MiB natively, "
             f"{linux.MEMORY_MIB} MiB, 1 vCPU, root on virtio-blk (one file both sides open), "
             "moved pre-copy over a namespace's loopback; each run boots the kernel. *Total*: "
             "request to the destination running, this host's clock. *Guest stall*: the writer's "
             "progress counter, read from both sides' guest memory by the host, from its last move "
             "on the source to its first on the destination, and the part of it after the destination's "
             "VMM said the VM runs; *longest stall*: the longest time it "
             "stood still over the move; *sampling*: the host's longest gap between two reads "
             "(the instrument's resolution). *Boot*: the kernel's clock at `/init`.", "",
             *device_table(rows, [
                 ("VMM", vmm_cell),
                 ("runs", lambda r, s: str(len(r["runs"]))),
                 figure("total ms", "total_ms"),
                 figure("guest stall ms", "guest_stall_ms", 2),
                 figure("of it after resume ms", "stall_after_resume_ms", 2),
                 figure("longest stall ms", "longest_stall_ms", 2),
                 figure("downtime ms (VMM)", "downtime_ms", 2),
                 figure("link bytes", "link_bytes", 0),
                 figure("boot s", "boot_s"),
                 figure("sampling ms", "sample_gap_ms", 2)])]
    best = linux.against_best(rows)
    if best:
        f = ratio_text
        lines += ["", "ferry / QEMU's best variant for each metric, medians (< 1: ferry better):", "",
                  "| metric | QEMU's best | ferry / it | goal |", "|---|---|---|---|"]
        lines += [f"| {b['metric']} | {b['versus']} | {f(b['ratio'])} | ≤ {b['goal']} |" for b in best]
    return lines


def linux_page(results):
    """docs/benchmarks/linux.md: the Linux profile's run, its provenance, its table and what
    the medians say against the goal."""
    lines = ["# ferry's Linux guest moved by ferry and by QEMU", "",
             provenance(results, linux.RAW_FILE) + " ferry runs with no flag; QEMU (microvm, its "
             "memory a shared memfd) with the downtime limit ferry uses (300 ms) and no bandwidth "
             "cap (`qemu`), and with 2 multifd channels (`qemu-mfd2`) (bench/fb/linux.py)."]
    lines += linux_lines(results["linux"])[2:]
    said = [f"- {b['metric']}: {b['ratio']:.2f} of {b['versus']}'s "
            f"({'meets' if b['ratio'] <= b['goal'] else 'misses'} the goal of {b['goal']})."
            for b in linux.against_best(results["linux"]) if b["ratio"] is not None]
    if said:
        lines += ["", "Against the goal, by the medians above:", "", *said]
    runs = [r for row in results["linux"] for r in row["runs"]]
    wrong = sum((r.get("writer_errors") or 0) + (r.get("file_errors") or 0) for r in runs)
    lines += ["", f"{len(runs)} runs: {wrong} pages found wrong by the writer after its move."]
    return "\n".join(lines) + "\n"


def move_cell(run, _summary):
    return run["mode"] + (f" (failed: {run['error']})" if run.get("error") else "")


def device_table(runs, columns):
    """A Markdown table of device runs: `columns` are (header, cell(run, summary))."""
    lines = ["| " + " | ".join(h for h, _ in columns) + " |", "|" + "---|" * len(columns)]
    for r in runs:
        lines.append("| " + " | ".join(cell(r, r["summary"]) for _, cell in columns) + " |")
    return lines


def forwarding_ratios(rows):
    """ferry / QEMU per rate and move, for the forwarding runs both made."""
    out = []
    for r in rows:
        if r.get("vmm", "ferry") != "ferry":
            continue
        q = next((x for x in rows if x.get("vmm") == "qemu" and x["rate"] == r["rate"]
                  and x["mode"] == r["mode"]), None)
        if not q:
            continue
        ratio = {}
        for m in ("longest_gap_ms", "lost", "downtime_ms"):
            a, b = median(r["summary"], m), median(q["summary"], m)
            ratio[m] = a / b if a is not None and b else None
        out.append({"rate": r["rate"], "mode": r["mode"], **ratio})
    return out


def plots(results, outdir):
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is absent: tables only, no plots", file=sys.stderr)
        return []
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    # Per-round bars for ferry pre-copy: pages and duration.
    precopy = [r for r in results["scenarios"] if r["peer"] == "ferry" and r["runs"]
               and r["runs"][0]["round_table"] and not r["runs"][0].get("postcopy")]
    if precopy:
        fig, axes = plt.subplots(len(precopy), 2, figsize=(10, 2.6 * len(precopy)), squeeze=False)
        for row, r in zip(axes, precopy):
            table = r["runs"][0]["round_table"]
            rounds = [t["round"] for t in table]
            row[0].bar(rounds, [t["pages"] for t in table], color="#3b7dd8")
            row[0].set_title(f"{r['scenario']} / {r['link']}: pages per round", fontsize=9)
            row[1].bar(rounds, [t["duration_ms"] for t in table], color="#d8843b")
            row[1].set_title("round duration (ms)", fontsize=9)
            for ax in row:
                ax.set_xticks(rounds)
                ax.set_xlabel("round", fontsize=8)
        fig.tight_layout()
        path = os.path.join(outdir, "precopy_rounds.svg")
        fig.savefig(path)
        plt.close(fig)
        written.append(path)

        # Throughput over time, from the round table of each first run.
        fig, ax = plt.subplots(figsize=(10, 4))
        for r in precopy:
            t, xs, ys = 0.0, [], []
            for rt in r["runs"][0]["round_table"]:
                mbps = rt["bytes"] * 8 / max(rt["duration_ms"], 1e-3) / 1e3
                xs += [t, t + rt["duration_ms"]]
                ys += [mbps, mbps]
                t += rt["duration_ms"]
            ax.plot(xs, ys, label=f"{r['scenario']} / {r['link']}")
        ax.set_xlabel("time since migration start (ms)")
        ax.set_ylabel("Mbit/s")
        ax.set_title("ferry pre-copy throughput per round")
        ax.legend(fontsize=7)
        fig.tight_layout()
        path = os.path.join(outdir, "throughput.svg")
        fig.savefig(path)
        plt.close(fig)
        written.append(path)

    # Post-copy: faults against pages pushed and requested, over time.
    timed = [r for r in results["scenarios"]
             if r["runs"] and r["runs"][0].get("timeline_10ms")][:8]
    if timed:
        fig, axes = plt.subplots(len(timed), 1, figsize=(10, 2.4 * len(timed)), squeeze=False)
        for (ax,), r in zip(axes, timed):
            tl = r["runs"][0]["timeline_10ms"]
            t = [i * 10 for i in range(len(tl))]
            ax.plot(t, [b[1] for b in tl], label="pages pushed", color="#3b7dd8")
            ax.plot(t, [b[2] for b in tl], label="pages requested", color="#2a9d4b")
            ax.plot(t, [b[0] for b in tl], label="network faults", color="#d83b3b")
            ax.set_title(f"{r['scenario']} / {r['link']}", fontsize=9)
            ax.set_ylabel("per 10 ms")
        axes[-1][0].set_xlabel("ms since the switch")
        axes[0][0].legend(fontsize=7)
        fig.tight_layout()
        path = os.path.join(outdir, "postcopy_timeline.svg")
        fig.savefig(path)
        plt.close(fig)
        written.append(path)

    # ferry vs QEMU bars.
    keys = sorted({(r["scenario"], r["link"]) for r in results["scenarios"]})
    peers = sorted({r["peer"] for r in results["scenarios"]})
    if keys:
        fig, axes = plt.subplots(1, 3, figsize=(14, 4 + 0.2 * len(keys)))
        for ax, (metric, title, scale) in zip(axes, [("total_ms", "total time (ms)", 1),
                                                     ("downtime_ms", "downtime, VMM (ms)", 1),
                                                     ("wire_bytes", "MB on the link", 1e6)]):
            width = 0.8 / max(len(peers), 1)
            for i, peer in enumerate(peers):
                vals = []
                for k in keys:
                    row = next((r for r in results["scenarios"] if (r["scenario"], r["link"]) == k and r["peer"] == peer), None)
                    v = median(row["summary"], metric) if row else None
                    vals.append((v or 0) / scale)
                ax.barh([j + i * width for j in range(len(keys))], vals, height=width, label=peer)
            ax.set_yticks([j + 0.4 - width / 2 for j in range(len(keys))])
            ax.set_yticklabels([f"{s}\n{l}" for s, l in keys], fontsize=7)
            ax.set_title(title, fontsize=9)
            ax.set_xscale("log")
        axes[0].legend(fontsize=8)
        fig.tight_layout()
        path = os.path.join(outdir, "ferry_vs_qemu.svg")
        fig.savefig(path)
        plt.close(fig)
        written.append(path)
    return written


def write_all(results, outdir):
    results["ratios"] = ratios(results)
    resume_shares(results)
    with open(os.path.join(outdir, "results.json"), "w") as f:
        json.dump(results, f, indent=2)
    with open(os.path.join(outdir, "results.md"), "w") as f:
        f.write(markdown(results))
    return plots(results, outdir)
