"""The results page's tables (docs/benchmarks.md, between its markers), written from the JSON
of the runs it cites: the headline, QEMU's sweep, ferry's flag check, the floor, the balloon and
live update in place, and the pre-copy across a broken link."""
import json
import os
import shutil

from . import plot
from .qemu import VARIANTS
from .report import balloon_table, breakdown_tables, lanes_table, resume_table, update_table
from .util import REPO

DOCS = os.path.join(REPO, "docs")
RAW = os.path.join(DOCS, "benchmarks")
PAGE = os.path.join(DOCS, "benchmarks.md")
BEGIN, END = "<!-- tables: written by bench/run.py -->", "<!-- end of tables -->"
# The profiles beside the headline get a page of their own, written whole.
PROFILES_NAME = "profiles.md"
PROFILES_HEAD = ("# Benchmarks: the other profiles\n\nWritten by `bench/run.py` from the raw files "
                 "beside this page; the method, the machine and what the runs show are on "
                 "[docs/benchmarks.md](../benchmarks.md).")
# Raw data each profile leaves for the page, under docs/benchmarks/.
RAW_FILES = {"headline": "headline.json", "sweep": "qemu-sweep.json", "flags": "ferry-flags.json",
             "floor": "idle-floor.json", "balloon": "balloon.json", "update": "live-update.json",
             "resume": "resume.json", "postcopy-lanes": "postcopy-lanes.json", "app": "app.json"}
# The headline's chart, beside its raw data.
CHART = "headline.svg"
# The floor's goal: an idle guest's total (ms) by its memory, and its downtime on both clocks.
FLOOR_GOAL_MS = {"8G": 10, "64G": 25, "256G": 60}
FLOOR_DOWNTIME_MS = 1.0
# The goal, ferry / QEMU at its best: guest downtime, total time, bytes on the link.
GOAL = {"serial_downtime_ms": 0.5, "total_ms": 0.7, "wire_bytes": 1.0}


def med(entry, metric):
    s = (entry or {}).get("summary", {}).get(metric)
    return s["median"] if s else None


def keeps_limit(entry, limit_ms, downtime="serial_downtime_ms"):
    d = med(entry, downtime)
    return d is not None and d <= limit_ms


def downtime_metric(results):
    """The guest downtime a run measured: the stall at the switch read out of the guest's
    memory (bench/fb/stall.py) where the run has it, else the gap in its console's lines."""
    stalled = any(med(e, "guest_stall_ms") is not None for e in results["scenarios"])
    return "guest_stall_ms" if stalled else "serial_downtime_ms"


def pick(entries, limit_ms):
    """The best of `entries` (one peer each, same scenario and link): the shortest total among
    those whose guest downtime kept `limit_ms`; if none did, the shortest guest downtime."""
    ran = [e for e in entries if med(e, "total_ms") is not None and med(e, "serial_downtime_ms") is not None]
    kept = [e for e in ran if keeps_limit(e, limit_ms)]
    if kept:
        return min(kept, key=lambda e: med(e, "total_ms"))
    return min(ran, key=lambda e: med(e, "serial_downtime_ms"), default=None)


def best_per_metric(entries, limit_ms, downtime="serial_downtime_ms"):
    """Of `entries` (one cell's QEMU variants), the best for each goal metric on its own: the
    shortest total among those whose guest downtime (`downtime`) kept `limit_ms` (among all if
    none did), the shortest guest downtime, the fewest bytes on the link."""
    ran = [e for e in entries if med(e, "total_ms") is not None]
    kept = [e for e in ran if keeps_limit(e, limit_ms, downtime)] or ran
    best = {"total_ms": min(kept, key=lambda e: med(e, "total_ms"), default=None)}
    for m in (downtime, "wire_bytes"):
        best[m] = min((e for e in ran if med(e, m) is not None), key=lambda e: med(e, m), default=None)
    return best


def by_cell(results):
    """{(link, scenario): [entries]} in the order they ran."""
    cells = {}
    for e in results["scenarios"]:
        cells.setdefault((e["link"], e["scenario"]), []).append(e)
    return cells


def winners(results, limits):
    """{link: {scenario: variant}}: the sweep's pick for each cell (`limits`: scenario → ms)."""
    out = {}
    for (link, scenario), entries in by_cell(results).items():
        best = pick([e for e in entries if e["peer"].startswith("qemu")], limits[scenario])
        if best:
            out.setdefault(link, {})[scenario] = best["peer"]
    return out


def write_winners(results, limits, path):
    """The sweep's picks into `path`, links it did not run keeping their earlier picks."""
    try:
        with open(path) as f:
            kept = json.load(f).get("winners", {})
    except (OSError, ValueError):
        kept = {}
    with open(path, "w") as f:
        json.dump({"measured": results["started"], "build": results["build"],
                   "rule": "shortest total (destination's clock) among the variants whose guest "
                           "downtime (console ticks) kept the scenario's limit; if none did, the "
                           "shortest guest downtime",
                   "winners": dict(kept, **winners(results, limits))}, f, indent=2)
        f.write("\n")


def keep_raw(profile, outdir, some_peers=False):
    """Copies a profile's results.json to docs/benchmarks/ for the page to cite; a run of some
    of the links replaces those links' rows and keeps the others', each link's provenance kept
    beside them (`runs_by_link`)."""
    os.makedirs(RAW, exist_ok=True)
    with open(os.path.join(outdir, "results.json")) as f:
        new = json.load(f)
    old = load(profile)
    merged = merge(old, new, some_peers) if old else new
    with open(os.path.join(RAW, RAW_FILES[profile]), "w") as f:
        json.dump(merged, f, indent=2)
        f.write("\n")


def merge(old, new, some_peers=False):
    """`new` with `old`'s rows for what `new` did not run (see `keep_raw`): the links it did not
    run, and where it ran only `some_peers` of the profile (`--peers`), the other peers' rows
    of its links. `runs_by_link` names each link's run, or "link (peers)" for such a run."""
    ran = {(e["link"], e["peer"] if some_peers else None) for e in new["scenarios"]}
    runs = dict(old.get("runs_by_link") or {e["link"]: run_of(old) for e in old["scenarios"]})
    kept = [e for e in old["scenarios"] if (e["link"], e["peer"] if some_peers else None) not in ran]
    for link in dict.fromkeys(e["link"] for e in new["scenarios"]):
        if some_peers:
            peers = dict.fromkeys(e["peer"] for e in new["scenarios"] if e["link"] == link)
            runs[f"{link} ({', '.join(peers)})"] = run_of(new)
        else:
            runs = {k: v for k, v in runs.items() if not k.startswith(f"{link} (")}
            runs[link] = run_of(new)
    return dict(new, scenarios=kept + new["scenarios"], runs_by_link=runs)


def run_of(results):
    return {"started": results["started"], "build": results["build"], "repeats": results["repeats"]}


def load(profile):
    try:
        with open(os.path.join(RAW, RAW_FILES[profile])) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def num(v, digits=1):
    return "-" if v is None else f"{v:.{digits}f}"


def spread(entry, metric, scale=1.0, digits=1):
    s = (entry or {}).get("summary", {}).get(metric)
    if not s:
        return "-"
    return f"{s['median'] / scale:.{digits}f} ({s['min'] / scale:.{digits}f}–{s['max'] / scale:.{digits}f})"


def ratio(a, b, metric):
    x, y = med(a, metric), med(b, metric)
    return (x / y) if (x is not None and y) else None


def provenance(results, what):
    """Where the rows came from: the run, or each run where links came from several."""
    m = results["machine"]
    machine = f"{b_qemu(results)}, {m['cores']} × {m['cpu']}, {m['kvm']}"
    runs = {}
    for link, run in (results.get("runs_by_link") or {}).items():
        runs.setdefault(json.dumps(run, sort_keys=True), []).append(link)
    if len(runs) <= 1:
        return f"{what}: {built(run_of(results))}; {machine}."
    return (f"{what}: " + "; ".join(f"{', '.join(links)}: {built(json.loads(run))}" for run, links in runs.items())
            + f"; {machine}.")


def built(run):
    b = run["build"]
    return (f"{run['started']}, commit {b['commit'][:10]}{' (tree changed)' if b.get('tree_changed') else ''}, "
            f"ferry sha256 {b['ferry_sha256'][:12]}, {run['repeats']} run(s) per row")


def b_qemu(results):
    return results["build"].get("qemu") or "no QEMU"


def headline_tables(results):
    """Per link: ferry (no flags) against QEMU's winner, medians with spread, and the ratios."""
    lines = [provenance(results, "Headline"), ""]
    cells = by_cell(results)
    for link in dict.fromkeys(e["link"] for e in results["scenarios"]):
        lines += [f"### {link}", "",
                  "| scenario | QEMU variant | total ms ferry | total ms QEMU | guest downtime ms ferry "
                  "| guest downtime ms QEMU | MB on the link ferry | MB on the link QEMU "
                  "| ratio total | ratio downtime | ratio bytes | goal |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for (l, scenario), entries in cells.items():
            if l != link:
                continue
            ferry = next((e for e in entries if e["peer"] == "ferry"), None)
            q = next((e for e in entries if e["peer"] == "qemu-best"), None)
            variant = ",".join(sorted({r.get("variant", "?") for r in (q or {}).get("runs", [])})) or "-"
            r = {m: ratio(ferry, q, m) for m in GOAL}
            met = [m for m in GOAL if r[m] is not None and r[m] <= GOAL[m]]
            verdict = "-" if None in r.values() else ("met" if len(met) == len(GOAL) else "not met: " + ", ".join(
                {"serial_downtime_ms": "downtime", "total_ms": "total", "wire_bytes": "bytes"}[m]
                for m in GOAL if m not in met))
            lines.append(
                f"| {scenario} | {variant} | {spread(ferry, 'total_ms', digits=0)} | {spread(q, 'total_ms', digits=0)} "
                f"| {spread(ferry, 'serial_downtime_ms')} | {spread(q, 'serial_downtime_ms')} "
                f"| {spread(ferry, 'wire_bytes', 1e6)} | {spread(q, 'wire_bytes', 1e6)} "
                f"| {num(r['total_ms'], 2)} | {num(r['serial_downtime_ms'], 2)} | {num(r['wire_bytes'], 2)} | {verdict} |")
            if ferry and ferry.get("error") or q and q.get("error") or ferry and ferry.get("outcome"):
                lines.append(f"| ↳ {scenario}: {(ferry or {}).get('error') or (ferry or {}).get('outcome') or ''} "
                             f"{(q or {}).get('error') or ''} |||||||||||| ")
        lines.append("")
    return lines


def app_tables(results, limits):
    """Per link: ferry (no flags) against the best of QEMU's variants of the same run, metric by
    metric (each metric's winner named), with the ratios and the goal."""
    lines = [provenance(results, "Application's memory"), ""]
    cells = by_cell(results)
    dm = downtime_metric(results)
    goal = {dm: GOAL["serial_downtime_ms"], "total_ms": GOAL["total_ms"], "wire_bytes": GOAL["wire_bytes"]}
    names = {"total_ms": "total", dm: "downtime", "wire_bytes": "bytes"}
    for link in dict.fromkeys(e["link"] for e in results["scenarios"]):
        lines += [f"### {link}", "",
                  "| scenario | total ms ferry | QEMU's shortest | guest downtime ms ferry | QEMU's shortest "
                  "| MB on the link ferry | QEMU's fewest | ratio total | ratio downtime | ratio bytes | goal |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for (l, scenario), entries in cells.items():
            if l != link:
                continue
            ferry = next((e for e in entries if e["peer"] == "ferry"), None)
            best = best_per_metric([e for e in entries if e["peer"].startswith("qemu")],
                                   limits.get(scenario, 20), dm)
            r = {m: ratio(ferry, best[m], m) for m in goal}
            verdict = "-" if None in r.values() else (
                "met" if all(r[m] <= goal[m] for m in goal) else
                "not met: " + ", ".join(names[m] for m in goal if r[m] > goal[m]))

            def theirs(m, scale=1.0, digits=1):
                return f"{spread(best[m], m, scale, digits)} {best[m]['peer']}" if best[m] else "-"
            lines.append(
                f"| {scenario} | {spread(ferry, 'total_ms', digits=0)} | {theirs('total_ms', digits=0)} "
                f"| {spread(ferry, dm)} | {theirs(dm)} "
                f"| {spread(ferry, 'wire_bytes', 1e6, 0)} | {theirs('wire_bytes', 1e6, 0)} "
                f"| {num(r['total_ms'], 2)} | {num(r[dm], 2)} | {num(r['wire_bytes'], 2)} "
                f"| {verdict} |")
        lines.append("")
    return lines


def entry_table(results, columns):
    """A row per entry (link, scenario, peer), then a cell per column: (heading, its text)."""
    lines = ["| link | scenario | peer | " + " | ".join(h for h, _ in columns) + " |",
             "|---" * (3 + len(columns)) + "|"]
    for e in results["scenarios"]:
        lines.append(f"| {e['link']} | {e['scenario']} | {e['peer']} | "
                     + " | ".join(cell(e) for _, cell in columns) + " |")
    return lines + [""]


def stall_table(results):
    """Each peer's stalls, as the guest's memory shows them (medians and ranges, ms)."""
    return entry_table(results, [
        ("stall at the switch", lambda e: spread(e, "guest_stall_ms")),
        ("of it after the VMM said it runs", lambda e: spread(e, "stall_after_resume_ms")),
        ("longest stall in the move", lambda e: spread(e, "longest_stall_ms")),
        ("console gap", lambda e: spread(e, "serial_downtime_ms")),
        ("VMM's own downtime", lambda e: spread(e, "downtime_ms")),
        ("resolution", lambda e: num(med(e, "sample_gap_ms"), 2))])


def self_reported(results):
    """Each VMM's own figures beside the measured ones (medians)."""
    mb = lambda e, m: num(med(e, m) and med(e, m) / 1e6)  # noqa: E731
    return entry_table(results, [
        ("total ms (destination)", lambda e: num(med(e, "total_ms"), 0)),
        ("total ms (VMM's own)", lambda e: num(med(e, "total_ms_reported"), 0)),
        ("guest downtime ms", lambda e: num(med(e, "serial_downtime_ms"))),
        ("downtime ms (VMM's own)", lambda e: num(med(e, "downtime_ms"), 2)),
        ("MB on the link", lambda e: mb(e, "wire_bytes")),
        ("MB (VMM's own)", lambda e: mb(e, "bytes"))])


def runs(results):
    """How a cell's figure was made from its runs."""
    counts = {r["repeats"] for r in (results.get("runs_by_link") or {"": run_of(results)}).values()}
    return "one run" if counts == {1} else "the median of the row's runs"


def cell(entry):
    """One run's total ms / guest downtime ms, or `-` where it did not finish."""
    if med(entry, "total_ms") is None:
        return "-"
    return f"{med(entry, 'total_ms'):.0f} / {num(med(entry, 'serial_downtime_ms'))}"


def sweep_table(results, limits):
    """Every QEMU variant per cell: total ms / guest downtime ms, the winner in bold."""
    cells = by_cell(results)
    order = list(VARIANTS)
    variants = sorted(dict.fromkeys(e["peer"] for e in results["scenarios"]),
                      key=lambda v: order.index(v) if v in order else len(order))
    lines = [provenance(results, "QEMU sweep"), "",
             f"Each cell: total ms / guest downtime ms ({runs(results)}); **bold**: the pick; `-`: failed "
             "or did not finish in the scenario's time.", "",
             "| link | scenario | " + " | ".join(v.removeprefix("qemu-") for v in variants) + " |",
             "|---|---|" + "---|" * len(variants)]
    for (link, scenario), entries in cells.items():
        best = pick(entries, limits[scenario])
        row = []
        for v in variants:
            e = next((x for x in entries if x["peer"] == v), None)
            row.append(f"**{cell(e)}**" if e is best and e is not None else cell(e))
        lines.append(f"| {link} | {scenario} | " + " | ".join(row) + " |")
    return lines + [""]


def flags_table(results, limits):
    """ferry with one knob turned, per cell: a variant that beats the defaults is named."""
    cells = by_cell(results)
    variants = list(dict.fromkeys(e["peer"] for e in results["scenarios"]))
    lines = [provenance(results, "ferry's flag check"), "",
             f"Each cell: total ms / guest downtime ms ({runs(results)}); the last column names a variant "
             "that beat `ferry` (no flags) by more than a tenth of its total within the downtime "
             "limit: a defect in the defaults.", "",
             "| link | scenario | " + " | ".join(v.removeprefix("ferry-") if v != "ferry" else "ferry"
                                                   for v in variants) + " | beats the defaults |",
             "|---|---|" + "---|" * (len(variants) + 1)]
    for (link, scenario), entries in cells.items():
        base = next((e for e in entries if e["peer"] == "ferry"), None)
        row, beaten = [], []
        for v in variants:
            e = next((x for x in entries if x["peer"] == v), None)
            row.append(cell(e))
            if (e and e is not base and med(e, "total_ms") is not None and med(base, "total_ms")
                    and keeps_limit(e, limits[scenario]) and med(e, "total_ms") < 0.9 * med(base, "total_ms")):
                beaten.append(v)
        lines.append(f"| {link} | {scenario} | " + " | ".join(row) + f" | {', '.join(beaten) or 'none'} |")
    return lines + [""]


def floor_table(results):
    """Idle guests by size: total and downtime on each clock, against the floor's goal."""
    lines = [provenance(results, "Floor"), "",
             "| link | memory | total ms (destination's clock, from the CLI's start) | total ms (source's report) "
             "| downtime ms, source's clock | downtime ms, destination's clock | guest-observed ms (heartbeats) "
             "| guest downtime ms (console ticks) | goal |",
             "|---|---|---|---|---|---|---|---|---|"]
    for e in results["scenarios"]:
        size = e["scenario"].split()[-1]
        goal, total = FLOOR_GOAL_MS.get(size), med(e, "total_ms_reported")
        downs = [med(e, "downtime_ms"), med(e, "destination_downtime_ms")]
        if goal is None or total is None or None in downs:
            verdict = "-"
        else:
            misses = ([f"total {total - goal:.1f} ms over"] if total > goal else []) + [
                f"{side} downtime {d:.2f} ms"
                for side, d in zip(("source", "destination"), downs) if d > FLOOR_DOWNTIME_MS]
            verdict = "met" if not misses else "not met: " + ", ".join(misses)
        lines.append(f"| {e['link']} | {size} | {spread(e, 'total_ms')} | {spread(e, 'total_ms_reported')} "
                     f"| {spread(e, 'downtime_ms', digits=2)} | {spread(e, 'destination_downtime_ms', digits=2)} "
                     f"| {spread(e, 'guest_downtime_ms', digits=2)} | {spread(e, 'serial_downtime_ms')} | {verdict} |")
    lines.append("")
    idle = breakdown_tables(results["scenarios"])
    return lines + idle[2:]


def tables(limits):
    """The generated part of the page, from whatever raw files docs/benchmarks/ holds."""
    lines = []
    head = load("headline")
    if head:
        lines += ["## Headline: ferry with no flags against QEMU at its best", "",
                  f"![ferry ÷ QEMU per link and scenario](benchmarks/{CHART})", ""] + headline_tables(head)
        idle = breakdown_tables([e for e in head["scenarios"] if e["peer"] == "ferry"])
        if idle:
            lines += ["### Where ferry's idle move spends its time", ""] + idle[2:]
    app = load("app")
    if app:
        lines += ["## An application's memory: ferry against QEMU's best per metric", ""] + app_tables(app, limits)
    lines += [f"Each VMM's own figures beside the measured ones and the other profiles' tables (floor, "
              f"QEMU's sweep, ferry's flags, live update, resume, post-copy lanes, balloon) are on [{PROFILES_NAME}](benchmarks/{PROFILES_NAME}), "
              "written by the same runner.", ""]
    return lines


def profile_tables(limits):
    """The second page: every profile's tables but the headline's."""
    lines = []
    sweep, flags, floor = load("sweep"), load("flags"), load("floor")
    head, app = load("headline"), load("app")
    if head:
        lines += ["## The headline: each VMM's own figures beside the measured ones", ""] + self_reported(head)
    if app and downtime_metric(app) == "guest_stall_ms":
        lines += ["## An application's memory: each VMM's stalls, read out of the guest's memory", "",
                  provenance(app, "Application's memory"), ""] + stall_table(app)
    if floor:
        lines += ["## The floor: idle guests by size (`bench/run.py --profile floor`)", ""] + floor_table(floor)
    if sweep:
        lines += ["## QEMU's sweep (`bench/run.py --profile sweep`)", ""] + sweep_table(sweep, limits)
    if flags:
        lines += ["## ferry's flag check (`bench/run.py --profile flags`)", ""] + flags_table(flags, limits)
    update = load("update")
    if update:
        lines += ["## Live update in place (`bench/run.py --profile update`)", "",
                  provenance(update, "Live update"), ""] + update_table(
                      update, lambda e, m, scale=1.0, digits=1: spread(e, m, scale, digits))
        idle = breakdown_tables([e for e in update["scenarios"] if e["peer"] == "ferry"])
        if idle:
            lines += ["### Where ferry's idle update spends its time", ""] + idle[2:]
    resumed = load("resume")
    if resumed:
        lines += ["## A pre-copy across a broken link (`bench/run.py --profile resume`)", "",
                  provenance(resumed, "Resume"), ""] + resume_table(
                      resumed, lambda e, m, scale=1.0, digits=1: spread(e, m, scale, digits))
    lanes = load("postcopy-lanes")
    if lanes:
        lines += ["## Post-copy on many connections (`bench/run.py --profile postcopy-lanes`)", "",
                  provenance(lanes, "Post-copy lanes"), ""] + lanes_table(
                      lanes, lambda e, m, scale=1.0, digits=1: spread(e, m, scale, digits))
    bal = load("balloon")
    if bal:
        lines += ["## Free memory and the balloon (`bench/run.py --profile balloon`)", "",
                  provenance(bal, "Balloon"), ""] + balloon_table(bal)
    return lines


def rewrite(limits):
    """Replaces the page's generated tables (between its markers) with fresh ones."""
    with open(PAGE) as f:
        text = f.read()
    if BEGIN not in text or END not in text:
        raise ValueError(f"{PAGE} has no {BEGIN!r} … {END!r} markers")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    headline = load("headline")
    if headline:
        with open(os.path.join(RAW, CHART), "w") as f:
            f.write(plot.svg(plot.rows_of(by_cell(headline), ratio), GOAL))
    with open(PAGE, "w") as f:
        f.write(head + BEGIN + "\n\n" + "\n".join(tables(limits)) + "\n" + END + tail)
    with open(os.path.join(RAW, PROFILES_NAME), "w") as f:
        f.write("\n".join([PROFILES_HEAD, ""] + profile_tables(limits)))
