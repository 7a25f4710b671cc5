#!/usr/bin/env python3
"""ferry's benchmark runner. `make bench` runs the headline profile (docs/benchmarks.md); see --help.

Every namespace, veth, qdisc and process a scenario creates is removed when it ends, failed
or not."""
import argparse
import datetime
import os
import hashlib
import shutil
import json
import platform
import re
import signal
import subprocess
import sys
import tempfile
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from fb import balloon as balloon_mod, devices, linux, page, qemu, report, storage, util  # noqa: E402
from fb import links as links_mod  # noqa: E402
from fb.ferry import VARIANTS as FERRY_VARIANTS, FerryPeer  # noqa: E402
from fb.links import Link  # noqa: E402
from fb.util import (FERRY, REPO, BenchError, DidNotConverge, Processes,  # noqa: E402
                     fault_in_bytes_per_s, guest_image, summarize)

# A progress line every 10 ms and an empty line every 1 ms: the guest clock both VMMs show.
SERIAL = "serial_ms=10 tick_ms=1"


def scenario(name, memory, cmdline, vcpus=1, mode="precopy", max_downtime_ms=20, warmup_s=0.5,
             timeout_s=120, prepaging=None, extra=(), tls=False, cpu_gib=None, ready_s=120,
             image=None, stall=False):
    """`extra`: more `ferry migrate` arguments (ferry rows only; such scenarios are ferry's).
    `tls`: both ferry processes with certificates (TLS 1.3) instead of `--plain-tcp`.
    `cpu_gib`: measure the host CPU the move costs, per this many GiB of populated memory.
    `ready_s`: how long the guest may take to populate its working set before the move.
    `image`: the guest image beside guest.elf (`guest-app.elf` for fill=real).
    `stall`: also read the guest's stalls out of its memory on both sides (bench/fb/stall.py)."""
    if vcpus > 1:
        cmdline = f"{cmdline} vcpus={vcpus}"
    return {"name": name, "memory": memory, "vcpus": vcpus, "cmdline": f"{cmdline} {SERIAL}",
            "mode": mode, "max_downtime_ms": max_downtime_ms, "warmup_s": warmup_s,
            "timeout_s": timeout_s, "prepaging": prepaging, "extra": list(extra), "tls": tls,
            "cpu": bool(cpu_gib), "cpu_gib": cpu_gib, "ready_s": ready_s, "image": image,
            "stall": stall}


def throughput():
    """Connections and compression on honest pages (`fill=mixed`: zero, text-like and random
    pages, see the workload guest in docs/guide.md)."""
    cmd = "write ws=128M seq fill=mixed"
    rows = [scenario(f"mixed 128M / 1G {c}", "1G", cmd, extra=["--compression", c])
            for c in ("none", "lz4", "zstd", "auto")]
    rows += [scenario("mixed 128M / 1G 2 connections", "1G", cmd, extra=["--connections", "2"]),
             scenario("mixed 128M / 1G 2 connections auto", "1G", cmd,
                      extra=["--connections", "2", "--compression", "auto"]),
             scenario("mixed 128M / 1G zstd 2 threads", "1G", cmd,
                      extra=["--compression", "zstd", "--migration-threads", "2"]),
             scenario("mixed 128M / 1G hybrid zstd", "1G", cmd, mode="hybrid",
                      extra=["--compression", "zstd"]),
             scenario("mixed 128M / 1G delta", "1G", cmd, extra=["--delta-cache-mb", "256"]),
             scenario("mixed 128M / 1G delta lz4", "1G", cmd,
                      extra=["--delta-cache-mb", "256", "--compression", "lz4"])]
    return rows


def tls_cost():
    """What TLS costs: a paused guest's populated memory moved warm (the link and the
    encryption set the pace, no guest competes), and a writer's pre-copy, each with TLS and
    with plain TCP, on 1 and 2 connections."""
    rows = []
    for tls in (False, True):
        label = "TLS" if tls else "plain"
        rows += [scenario(f"warm 768M / 1G {label}", "1G", "write ws=768M seq", mode="warm", tls=tls),
                 scenario(f"warm 768M / 1G 2 connections {label}", "1G", "write ws=768M seq",
                          mode="warm", tls=tls, extra=["--connections", "2"]),
                 scenario(f"write seq 256M / 1G {label}", "1G", "write ws=256M seq", tls=tls)]
    return rows


def table2():
    """Hines & Gopalan's Table 2: a 2 GiB guest writing working sets of 8..512 MiB
    sequentially, post-copy push-only vs pre-paging, beside pre-copy."""
    rows = []
    for ws in (8, 16, 32, 64, 128, 256, 512):
        cmd = f"write ws={ws}M seq"
        rows += [scenario(f"ws {ws}M post-copy push-only", "2G", cmd, mode="postcopy", prepaging="linear"),
                 scenario(f"ws {ws}M post-copy pre-paging", "2G", cmd, mode="postcopy", prepaging="bubble"),
                 scenario(f"ws {ws}M pre-copy", "2G", cmd)]
    return rows


def cpu_cost():
    """Host CPU per GiB moved: a paused guest's 256 MiB of `fill=mixed` pages moved warm (QEMU:
    `stop`, then its pre-copy), so that no guest work is counted; ferry also with zstd, on one
    thread and on two (`--migration-threads`)."""
    cmd = "write ws=256M seq fill=mixed"
    return [scenario("cpu: warm mixed 256M / 1G", "1G", cmd, mode="warm", cpu_gib=0.25),
            scenario("cpu: warm mixed 256M / 1G zstd", "1G", cmd, mode="warm", cpu_gib=0.25,
                     extra=["--compression", "zstd"]),
            scenario("cpu: warm mixed 256M / 1G zstd 2 threads", "1G", cmd, mode="warm",
                     cpu_gib=0.25, extra=["--compression", "zstd", "--migration-threads", "2"]),
            scenario("cpu: warm mixed 256M / 1G zstd 2 connections", "1G", cmd, mode="warm",
                     cpu_gib=0.25, extra=["--compression", "zstd", "--connections", "2"])]


def snapshots():
    """Snapshots written by one writer and by two (`--writers`), plain and with zstd, each
    restored and its guest left to verify a whole pass of its memory."""
    word, mixed = "write ws=768M seq verify", "write ws=256M seq fill=mixed verify"
    rows = [scenario(f"snapshot 768M / 1G {w} writer{'s' if w > 1 else ''}", "1G", word,
                     mode="snapshot", extra=["--writers", str(w)]) for w in (1, 2)]
    rows += [scenario(f"snapshot mixed 256M / 1G zstd {label}", "1G", mixed, mode="snapshot",
                      extra=["--compression", "zstd", *args])
             for label, args in (("1 writer", []), ("1 writer 2 threads", ["--migration-threads", "2"]),
                                 ("2 writers", ["--writers", "2"]))]
    return rows


def checkpoints():
    """What post-copy checkpoints cost (`--checkpoint-ms`): the same writer post-copied and
    hybrid-migrated without them and with one every 10, 50 and 200 ms."""
    rows = []
    for mode in ("postcopy", "hybrid"):
        for ms in (None, 10, 50, 200):
            label = f"checkpoints every {ms} ms" if ms else "no checkpoints"
            rows.append(scenario(f"write seq 256M / 1G {mode} {label}", "1G", "write ws=256M seq",
                                 mode=mode, extra=["--checkpoint-ms", str(ms)] if ms else []))
    return rows


def size_bytes(s):
    """A size as the scale options write it: 64G, 512M."""
    return int(s[:-1]) << {"G": 30, "M": 20}[s[-1].upper()]


def scale(memory="64G", ws="16G", vcpus=8, codec_ws="512M"):
    """Many cores (bench/README-scale in docs/benchmarks.md): a large guest moved over loopback
    on 1..16 connections. The connection rows move `ws` written by `vcpus` vCPUs
    (`fill=word`: every page holds data, and with no compression its content does not change
    the bytes); the codec rows use `fill=mixed` on a smaller `codec_ws`, since laying honest
    content down in an instruction emulator is slow: ~10 MB/s per vCPU on a 2-core host, under
    3.2 MB/s per vCPU with 8 vCPUs on a 16-core one (2 GiB was not laid down in 85 s there).
    Warm rows (the guest paused: only the transfer counts), live pre-copy rows (the writers
    keep writing), and a switch to post-copy and to hybrid at 8 connections."""
    # Populating: ~40 k pages/s per vCPU at worst; honest content: 2 MB/s per vCPU at worst.
    word_s = 60 + size_bytes(ws) // 4096 // (40000 * vcpus)
    mixed_s = 60 + size_bytes(codec_ws) // (2 << 20) // vcpus
    common = dict(vcpus=vcpus, timeout_s=300, warmup_s=0)
    word, mixed = f"write ws={ws} seq", f"write ws={codec_ws} seq fill=mixed"
    rows = [scenario(f"scale warm {ws} / {memory} {n} conn", memory, word, mode="warm",
                     ready_s=word_s, extra=["--connections", str(n)], **common)
            for n in (1, 2, 4, 8, 16)]
    rows += [scenario(f"scale warm mixed {codec_ws} / {memory} {n} conn {c}", memory, mixed,
                      mode="warm", ready_s=mixed_s,
                      extra=["--connections", str(n), "--compression", c], **common)
             for n in (1, 8) for c in ("none", "lz4", "zstd", "auto")]
    # The codecs on more threads than connections (`--migration-threads`).
    rows += [scenario(f"scale warm mixed {codec_ws} / {memory} {n} conn {c} {t} threads", memory,
                      mixed, mode="warm", ready_s=mixed_s,
                      extra=["--connections", str(n), "--compression", c,
                             "--migration-threads", str(t)], **common)
             for n, t in ((1, 8), (8, 16)) for c in ("zstd", "auto")]
    rows += [scenario(f"scale pre-copy {ws} / {memory} {n} conn", memory, word, ready_s=word_s,
                      extra=["--connections", str(n)], **common) for n in (1, 8)]
    # The pause of a switch to post-copy while the writers write: hybrid's must stay within 2×
    # pure post-copy's, however large the set its round left dirty.
    rows += [scenario(f"scale {mode} {ws} / {memory} 8 conn", memory, word, mode=mode,
                      ready_s=word_s, extra=["--connections", "8"], **common)
             for mode in ("postcopy", "hybrid")]
    return rows


def update():
    """Live update in place (`ferry migrate --local`, docs/guide.md): the VM handed to a new
    VMM process on the same host, its memory (a memfd) passed by file descriptor, no page
    copied; an idle guest and a writer that verifies its pages, at sizes where a copy would
    take seconds (a memfd is populated only where the guest touched it: 64 GiB fits a 23 GiB
    host). QEMU's answer: cpr-transfer (`qemu-cpr`, fb/qemu.py), its RAM a shared memfd,
    microvm. No link: Unix sockets in one namespace."""
    rows = []
    for m in ("1G", "16G", "64G"):
        rows += [scenario(f"idle {m}", m, "idle", mode="local", timeout_s=60),
                 scenario(f"write seq 64M / {m} verify", m, "write ws=64M seq verify", mode="local",
                          timeout_s=60)]
    return rows


RESUME_MEMORY = "4G"
RESUME_STALL_S = 30


def resume(memory=RESUME_MEMORY, stall_s=RESUME_STALL_S, at_percent=80):
    """A pre-copy that survives a broken link (docs/guide.md, `--resume-window-s`): a guest
    that writes and checks 7/8 of its memory (`write ws=3584M seq verify` in 4 GiB: round 0
    carries nearly all of it), moved over one plain TCP connection through a relay
    (fb/cutter.py) that reads the source's frames and, at `at_percent` % of round 0's pages,
    resets the connection (`cut`: the source dials the same address again, and that connection
    is carried) or forwards nothing either way for `stall_s` s (`stall`: the sides' 30 s I/O
    timeouts are meant to break it, and the source to carry on over a new one; `stall_s` and 5 s
    more, as the first ends as the timeouts fire), beside the same
    move through the same relay with no fault. The goal: it finishes after resuming with at
    most 30 % of guest memory sent again (`pages_sent_again`); the relay's byte count against
    the baseline's says how much more crossed in all. `--checksum`; ferry's defaults otherwise."""
    mib = size_bytes(memory) >> 20
    ws = mib * 7 // 8
    # Populating: ~40 k pages/s at worst (see `scale`), then a pass checked on the destination.
    ready_s = max(120, 60 + ws * 256 // 40000)
    # The stall the goal names, and one just past the sides' 30 s I/O timeouts: a 30 s stall
    # ends as they fire, and the move carries on over the same connection.
    faults = [("none", "no fault", 0), ("cut", f"cut at {at_percent} % of round 0", 0)]
    faults += [("stall", f"{s} s stall at {at_percent} % of round 0", s)
               for s in sorted({stall_s, stall_s + 5})]
    rows = []
    for fault, label, stall in faults:
        sc = scenario(f"write seq {ws}M / {memory} {label}", memory, f"write ws={ws}M seq verify",
                      timeout_s=300, ready_s=ready_s, extra=["--checksum"])
        sc.update(relay={"fault": fault, "at_percent": at_percent, "stall_s": stall},
                  qemu=False)
        rows.append(sc)
    return rows


LANES_MEMORY = "5G"
LANES_WS = "4G"


def postcopy_lanes(memory=LANES_MEMORY, ws=LANES_WS):
    """Post-copy on many connections (docs/guide.md): `vcpus` writers fill a `ws` set, then the
    VM moves warm (paused: only the transfer counts) and by post-copy (it runs on the
    destination while its pages follow), each on 1, 2 and 4 connections. The goal: post-copy's
    total within 1.2x warm's at the same connection count, and the destination's fault latency
    p99 at most 2 ms on 10 Gbit while the pages are pushed at full rate."""
    pages = size_bytes(ws) // 4096
    rows = []
    for vcpus in (2, 4):
        # Populating: ~40 k pages/s per vCPU at worst (see `scale`).
        ready_s = 60 + pages // (40000 * vcpus)
        for n in (1, 2, 4):
            for mode in ("warm", "postcopy"):
                sc = scenario(f"write seq {ws} / {memory} {vcpus} vCPUs {n} conn {MODE_LABELS.get(mode, mode)}",
                              memory, f"write ws={ws} seq", vcpus=vcpus, mode=mode, timeout_s=300,
                              warmup_s=0, ready_s=ready_s, extra=["--connections", str(n)],
                              cpu_gib=size_bytes(ws) / 2**30)
                sc["qemu"] = False
                rows.append(sc)
    return rows


def runs_on(peer, sc):
    """Whether `peer` runs scenario `sc`: QEMU has no hybrid mode, and no ferry option
    (`extra`) to compare with; its warm migration is `stop`, then pre-copy. A live update
    (`local`) is ferry's `--local` and QEMU's cpr-transfer (`qemu-cpr`), which runs nothing else."""
    if peer == qemu.CPR or sc["mode"] == "local":
        return sc["mode"] == "local" and (peer == qemu.CPR or peer.startswith("ferry"))
    return not (peer.startswith("qemu") and (
        sc["mode"] not in ("precopy", "postcopy", "warm") or sc["extra"] or sc.get("qemu") is False))


BALLOON_MEMORY = "4G"
MODE_LABELS = {"precopy": "pre-copy", "postcopy": "post-copy", "hybrid": "hybrid"}


def balloon(memory=BALLOON_MEMORY):
    """Issue #28, dynamic self-ballooning (docs/balloon.md): a guest that touched nearly all
    its memory once (`peak=`) and now churns a 128–512 MiB working set (`churn ws=512M`,
    checking every page it takes back: `verify`), moved by each mode with no balloon (`off`),
    with DSB every second (`dsb`), and with a balloon that reports free pages (and hints them
    where VMM and guest can: `hint`). The move starts once the first pass is over and, with
    DSB, once the balloon holds most free memory; the guest's work rate is counted over a
    window before it. QEMU: microvm, the same guest, a virtio-balloon with free page hinting
    and reporting (fb/balloon.py); no hybrid."""
    mib = size_bytes(memory) >> 20
    ws, peak = balloon_mod.sizes(mib)
    # A word the guest image does not know yet stops it: left out, and said (`results`).
    known = {"hint_any": balloon_mod.guest_knows("hint_any")}
    churn = f"churn ws={ws}M peak={peak}M verify"
    # The first pass takes and frees `peak` pages: 51 s for 950 MiB here with no balloon, 97 s
    # with DSB (every second it inflates with the free memory the pass then takes back), on
    # this 2-core host with a build beside it; twice that, and a minute.
    ready_s = 60 + peak * 256 // 1200
    rows = []
    for mode in ("precopy", "postcopy", "hybrid"):
        for variant, v in balloon_mod.VARIANTS.items():
            # Hints are a pre-copy matter (QEMU turns them off where post-copy may come).
            if variant == "hint" and mode != "precopy":
                continue
            sc = scenario(f"churn {ws}M / {memory} {MODE_LABELS[mode]} {variant}", memory,
                          f"{churn} {v['ferry_words']}".strip(), mode=mode, timeout_s=120, ready_s=ready_s)
            sc.update(
                ferry_args=list(v["ferry_args"]),
                qemu_machine=balloon_mod.QEMU_MACHINE,
                qemu_args=[*balloon_mod.QEMU_GLOBAL, *v["qemu_args"]],
                qemu_cmdline=scenario("", memory, f"{churn} {balloon_mod.words(v['qemu_words'], known)}"
                                      .strip())["cmdline"],
                # QEMU's rows: pre-copy, where its free page hinting works (a 4 GiB move
                # takes minutes here; its post-copy has no hinting to compare).
                qemu=mode == "precopy",
                balloon={"variant": variant, "mode": mode, "ws_pages": ws * 256, "peak_pages": peak * 256,
                         "settle_s": 60, "window_s": 3.0,
                         "left_out": [w for w in v["qemu_words"].split() if not known.get(w, True)]})
            rows.append(sc)
    return rows


def headline():
    """The scenarios of the results page: an idle guest, and a writer on honest content
    (fill=mixed: a stamp rewritten in pages of mixed content; fill=fresh: whole pages rewritten
    with new content every pass)."""
    return [scenario("idle 8G", "8G", "idle", timeout_s=60),
            scenario("write seq 128M / 1G fill=mixed", "1G", "write ws=128M seq fill=mixed", timeout_s=60),
            scenario("write seq 128M / 1G fill=fresh", "1G", "write ws=128M seq fill=fresh", timeout_s=60)]


# An application's memory (#54's realistic guest): a 4 GiB guest whose workload writes 80 % of
# its memory with pages of real processes' memory (fill=real), then keeps rewriting parts of
# pages, hot and cold by Zipf's law, a quarter of its touches reads, at a set rate: 8,000 and
# 16,000 pages/s are ~30 % and ~60 % of what a 1 Gbit/s link carries. It runs in user mode
# (natively here; each write to a page the dirty log protects still costs an exit): one vCPU
# at each rate, and two sharing the faster one.
APP_ROWS = ((1, 8000), (1, 16000), (2, 16000))


def application():
    return [scenario(f"app 3.2G / 4G {v} vCPU{'s' if v > 1 else ''} {r // 1000}k pages/s", "4G",
                     f"write ws=3276M zipf reads=25 user fill=real rate={r}", vcpus=v,
                     image="guest-app.elf", timeout_s=180, ready_s=300, stall=True)
            for v, r in APP_ROWS]


HEADLINE_LINKS = ["loopback", "1gbit", "10gbit", "1gbit+50ms"]

PROFILES = {
    # The results page (docs/benchmarks.md): ferry with no flags against QEMU's sweep winner.
    "headline": {
        "links": HEADLINE_LINKS, "peers": ["ferry", "qemu-best"], "repeats": 3, "boot": [],
        "dirty": False, "scenarios": headline(), "page": True,
    },
    # What an expert would try with QEMU, once per variant; its winners go to bench/qemu-best.json.
    "sweep": {
        "links": HEADLINE_LINKS, "peers": [v for v in qemu.VARIANTS if v != "qemu-default"],
        "repeats": 1, "boot": [], "dirty": False, "scenarios": headline(), "pick": True,
    },
    # ferry with one knob turned away from its defaults: none of them should win (the
    # writers: an idle guest sends too little for a knob to matter).
    "flags": {
        "links": HEADLINE_LINKS, "peers": [v for v in FERRY_VARIANTS if v != "ferry-best"], "repeats": 1, "boot": [],
        "dirty": False, "scenarios": [sc for sc in headline() if "write" in sc["name"]],
    },
    # The application's memory: ferry against QEMU as an expert sets it and with multifd.
    "app": {
        "links": ["loopback", "1gbit"], "peers": ["ferry", "qemu", "qemu-mfd2", "qemu-mfd2-zstd"],
        "repeats": 3, "boot": [], "dirty": False, "scenarios": application(),
    },
    # The floor: idle guests of growing size, ferry alone (its goal does not involve QEMU).
    "floor": {
        "links": ["loopback", "1gbit"], "peers": ["ferry"], "repeats": 3, "boot": [], "dirty": False,
        "scenarios": [scenario(f"idle {m}", m, "idle", timeout_s=60) for m in ("8G", "64G", "256G")],
    },
    # Live update in place: ferry's `--local` and QEMU's cpr-transfer, idle and writing, 1–64 GiB.
    "update": {
        "links": ["loopback"], "peers": ["ferry", qemu.CPR], "repeats": 3, "boot": [], "dirty": False,
        "scenarios": update(),
    },
    # A pre-copy cut, or stalled, at 80 % of round 0 and carried on over a new connection,
    # beside the same move with no fault; --resume-memory shrinks the guest.
    "resume": {
        "links": ["loopback"], "peers": ["ferry"], "repeats": 3, "boot": [], "dirty": False,
        "scenarios": resume(),
    },
    # Post-copy pushed over the migration's connections, beside warm at the same count.
    "postcopy-lanes": {
        "links": ["loopback", "10gbit"], "peers": ["ferry"], "repeats": 2, "boot": [], "dirty": False,
        "scenarios": postcopy_lanes(),
    },
    "tiny": {
        "links": ["loopback"], "peers": ["ferry"], "repeats": 1, "boot": [], "dirty": False,
        "scenarios": [scenario("idle 64M", "64M", "idle")],
    },
    "quick": {
        "links": ["loopback", "1gbit"], "peers": ["ferry", "ferry-best", "qemu-default", "qemu-best"], "repeats": 3,
        "boot": ["1G", "16G", "64G"], "dirty": True,
        # A migration that cannot converge is given up after 30 s here (120 s in full).
        "scenarios": [scenario("idle 1G", "1G", "idle", timeout_s=30),
                      scenario("idle 8G", "8G", "idle", timeout_s=30),
                      scenario("write seq 256M / 1G fill=word", "1G", "write ws=256M seq", timeout_s=30),
                      scenario("write seq 256M / 1G post-copy fill=word", "1G", "write ws=256M seq",
                               mode="postcopy", timeout_s=30),
                      # Two vCPUs writing halves of the set, on both VMMs (this host has 2 cores).
                      scenario("write seq 256M / 1G 2 vCPUs fill=word", "1G", "write ws=256M seq", vcpus=2,
                               timeout_s=30),
                      # Honest page content, where compression means something (the rows above
                      # write one word per page: `fill=word`).
                      scenario("write seq 256M / 1G fill=mixed", "1G",
                               "write ws=256M seq fill=mixed", timeout_s=30)],
    },
    "throughput": {
        "links": ["loopback", "1gbit"], "peers": ["ferry"], "repeats": 2, "boot": [], "dirty": False,
        "scenarios": throughput(),
    },
    "tls": {
        "links": ["loopback"], "peers": ["ferry"], "repeats": 3, "boot": [], "dirty": False,
        "scenarios": tls_cost(),
    },
    "checkpoints": {
        "links": ["loopback", "1gbit"], "peers": ["ferry"], "repeats": 3, "boot": [], "dirty": False,
        "scenarios": checkpoints(),
    },
    # Snapshots to a file and back, on one writer and on two (`--writers`).
    "snapshot": {
        "links": ["loopback"], "peers": ["ferry"], "repeats": 3, "boot": [], "dirty": False,
        "scenarios": snapshots(),
    },
    # Host CPU per GiB moved, ferry and QEMU (as it comes, and at its best: multifd + zstd).
    "cpu": {
        "links": ["loopback"], "peers": ["ferry", "qemu-default", "qemu-best"], "repeats": 3, "boot": [],
        "dirty": False, "scenarios": cpu_cost(),
    },
    # The forwarding VM across a move, on ferry and on QEMU (docs/devices.md): frames/s, and
    # the migration modes (None: no move). QEMU has no hybrid mode.
    "devices": {
        "links": [], "peers": ["ferry", "qemu"], "repeats": 3, "boot": [], "dirty": False, "scenarios": [],
        "forwarding": {"rates": (1000, 10000, 100000), "modes": (None, "precopy", "postcopy", "hybrid")},
        "block": (None, "precopy", "postcopy", "hybrid"),
    },
    # A VM and its disk to a host with a disk of its own (`--copy-storage`; QEMU: mirror to NBD
    # and migrate): an 8 GiB disk holding 2 GiB of random data, and a 1 GiB one holding 256 MiB,
    # on loopback; the 8 GiB one on a 1 Gbit/s link too, and an 8 GiB disk holding a file
    # system of this host's /usr/share over both.
    "storage": {
        "links": [], "peers": ["ferry", "qemu"], "repeats": 3, "boot": [], "dirty": False, "scenarios": [],
        "storage": ((8192, 2048, "loopback"), (1024, 256, "loopback"), (8192, 2048, "1gbit"),
                    (8192, 0, "loopback", "files"), (8192, 0, "1gbit", "files")),
    },
    # ferry's Linux guest (`make linux-guest`) moved pre-copy by ferry and by QEMU (microvm),
    # as an expert sets it and with multifd; each run boots the kernel (about 2 minutes here).
    "linux": {
        "links": [], "peers": linux.PEERS, "repeats": 3, "boot": [], "dirty": False, "scenarios": [],
        "linux": True,
    },
    # Many cores and a large guest (runs with only `ferry`, the guest image and python3: see
    # `make scale-kit`); --scale-memory, --scale-ws and --scale-vcpus shrink it to fit a host.
    "scale": {
        "links": ["loopback"], "peers": ["ferry"], "repeats": 1, "boot": [], "dirty": False,
        "scenarios": scale(),
    },
    # WAN-like links: 1 Gbit/s, each direction 10 or 50 ms late (bench/fb/delayline.py).
    "wan": {
        "links": ["1gbit+10ms", "1gbit+50ms"], "peers": ["ferry", "ferry-best", "qemu-default", "qemu-best"],
        "repeats": 2, "boot": [], "dirty": False,
        "scenarios": [scenario("idle 1G", "1G", "idle", timeout_s=60),
                      scenario("write seq 256M / 1G fill=word", "1G", "write ws=256M seq", timeout_s=60),
                      scenario("write seq 256M / 1G post-copy fill=word", "1G", "write ws=256M seq",
                               mode="postcopy", timeout_s=60),
                      # Honest content, where compression means something.
                      scenario("write seq 256M / 1G fill=mixed", "1G",
                               "write ws=256M seq fill=mixed", timeout_s=60),
                      # A larger guest: its switch carries a bitmap of 16 GiB of pages.
                      scenario("idle 16G post-copy", "16G", "idle", mode="postcopy", timeout_s=60),
                      scenario("write seq 256M / 16G post-copy fill=word", "16G", "write ws=256M seq",
                               mode="postcopy", timeout_s=60),
                      # ferry's counterpart of QEMU's post-copy, which begins with a pre-copy pass.
                      scenario("write seq 256M / 16G hybrid fill=word", "16G", "write ws=256M seq",
                               mode="hybrid", timeout_s=60),
                      # Go right behind the state (ferry only): a round trip less.
                      scenario("idle 1G go-with-state", "1G", "idle", timeout_s=60,
                               extra=["--go-with-state"]),
                      scenario("write seq 256M / 1G fill=mixed go-with-state", "1G",
                               "write ws=256M seq fill=mixed", timeout_s=60,
                               extra=["--go-with-state"])],
    },
    # Free memory and the balloon (issue #28): a churning 4 GiB guest after a large peak, with
    # no balloon, with DSB and with free page reporting/hinting, on ferry (pre-copy, post-copy,
    # hybrid) and QEMU (pre-copy, post-copy); --balloon-memory shrinks the guest.
    "balloon": {
        "links": ["loopback", "1gbit"], "peers": ["ferry", "qemu"], "repeats": 1, "boot": [],
        "dirty": False, "scenarios": balloon(),
    },
    "table2": {
        "links": ["loopback", "1gbit"], "peers": ["ferry"], "repeats": 2, "boot": [], "dirty": False,
        "scenarios": table2(),
    },
    "full": {
        "links": ["loopback", "1gbit", "10gbit"], "peers": ["ferry", "ferry-best", "qemu-default", "qemu", "qemu-best"], "repeats": 3,
        "boot": ["1G", "16G", "64G"], "dirty": True,
        # A migration that cannot converge is given up after 60 s.
        "scenarios": [scenario("idle 1G", "1G", "idle", timeout_s=60),
                      scenario("idle 4G", "4G", "idle", timeout_s=60),
                      scenario("idle 8G", "8G", "idle", timeout_s=60),
                      scenario("write seq 64M / 1G fill=word", "1G", "write ws=64M seq", timeout_s=60),
                      scenario("write seq 256M / 1G fill=word", "1G", "write ws=256M seq", timeout_s=60),
                      scenario("write seq 256M / 1G fill=mixed", "1G",
                               "write ws=256M seq fill=mixed", timeout_s=60),
                      scenario("write seq 256M / 2G fill=word", "2G", "write ws=256M seq", timeout_s=60),
                      scenario("write seq 256M / 2G 2 vCPUs fill=word", "2G", "write ws=256M seq", vcpus=2,
                               timeout_s=60),
                      scenario("write random 256M / 2G fill=word", "2G", "write ws=256M random", timeout_s=60),
                      scenario("read 256M / 2G fill=word", "2G", "read ws=256M seq", timeout_s=60),
                      scenario("write seq 256M / 1G warm fill=word", "1G", "write ws=256M seq", mode="warm", timeout_s=60),
                      scenario("write seq 256M / 2G post-copy fill=word", "2G", "write ws=256M seq", mode="postcopy", timeout_s=60),
                      scenario("write seq 256M / 2G hybrid fill=word", "2G", "write ws=256M seq", mode="hybrid", timeout_s=60),
                      scenario("write random 256M / 2G post-copy fill=word", "2G", "write ws=256M random",
                               mode="postcopy", timeout_s=60)],
    },
}


def machine():
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    kvm = "PVM (kvm_pvm)" if os.path.exists("/sys/module/kvm_pvm") else (
        "kvm_intel" if os.path.exists("/sys/module/kvm_intel") else
        "kvm_amd" if os.path.exists("/sys/module/kvm_amd") else "?")
    return {"cpu": cpu, "cores": os.cpu_count(), "kernel": platform.release(), "kvm": kvm,
            "guest_execution": "PVM: guest ring 0 in KVM's instruction emulator, guest user mode "
            "native (the `user` rows' workload runs there; see docs/platform.md)"
            if "PVM" in kvm else "native"}


def build():
    """What was measured: the commit (and whether the tree had changes), the binary's hash,
    QEMU's version."""
    def out(*argv):
        try:
            return subprocess.run(argv, capture_output=True, text=True, cwd=REPO, timeout=30).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return None
    with open(FERRY, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    images = {}
    for image in ("guest.elf", "guest-app.elf"):
        path = guest_image({"image": image})
        if os.path.exists(path):
            with open(path, "rb") as f:
                images[image] = hashlib.sha256(f.read()).hexdigest()
    qemu_version = out(qemu.QEMU, "--version") if qemu.available() else None
    qemu_line = qemu_version.splitlines()[0] if qemu_version else None
    # A kit copied to a host without git (`make scale-kit`) says which commit it was built from.
    kit = os.path.join(os.path.dirname(FERRY), "COMMIT")
    if os.path.exists(kit):
        commit, state = open(kit).read().split()  # "<sha> clean|changed"
        return {"commit": commit, "tree_changed": state == "changed", "ferry_sha256": digest,
                "guest_sha256": images, "qemu": qemu_line, "kit": os.path.dirname(FERRY)}
    return {"commit": out("git", "rev-parse", "HEAD"),
            "tree_changed": bool(out("git", "status", "--porcelain", "--untracked-files=no")),
            "ferry_sha256": digest, "guest_sha256": images,
            "qemu": qemu_line}


def device_run(procs, work, kind, vmm, mode, rate):
    """One run of a device profile's `kind`: `rate` is the forwarding's frames/s, or the
    storage move's (disk MiB, used MiB); a Linux move's `vmm` is a peer (ferry or a QEMU
    variant)."""
    if kind == "forwarding":
        return devices.forwarding_run(procs, work, vmm, mode, rate)
    if kind == "block":
        return devices.block_run(procs, work, vmm, mode)
    if kind == "linux":
        return linux.linux_run(procs, work, vmm)
    return storage.storage_run(procs, work, vmm, *rate)


def save_partial(results, outdir):
    partial = os.path.join(outdir, "results.json.partial")
    with open(partial, "w") as f:
        json.dump(dict(results, partial=True), f, indent=2)
    os.replace(partial, os.path.join(outdir, "results.json"))


def make_peer(name, procs, work):
    if name.startswith("ferry"):
        return FerryPeer(procs, work, variant=name)
    return qemu.QemuPeer(procs, work, variant=name)


def run(args):
    profile = PROFILES[args.profile]
    if args.pin == "split":
        cpus = sorted(os.sched_getaffinity(0))
        half = max(1, len(cpus) // 2)
        util.PINNING.update(source=set(cpus[:half]), destination=set(cpus[half:]) or set(cpus))
    if args.profile == "scale":
        profile = dict(profile, scenarios=scale(args.scale_memory, args.scale_ws, args.scale_vcpus,
                                                args.scale_codec_ws))
    if args.profile == "resume":
        profile = dict(profile, scenarios=resume(args.resume_memory, args.resume_stall_s))
    if args.profile == "balloon":
        profile = dict(profile, scenarios=balloon(args.balloon_memory))
        left_out = sorted({w for sc in profile["scenarios"] for w in sc["balloon"]["left_out"]})
        if left_out and any(p.startswith("qemu") for p in (args.peers.split(",") if args.peers else profile["peers"])):
            print(f"*** the guest image does not know {', '.join(left_out)}: QEMU's balloon rows run "
                  "without it ***", file=sys.stderr)
    if args.only:
        profile = dict(profile, scenarios=[sc for sc in profile["scenarios"]
                                           if re.search(args.only, sc["name"])])
        if not profile["scenarios"]:
            print(f"--only {args.only!r} matches no scenario of the {args.profile} profile",
                  file=sys.stderr)
            return 2
    links = args.links.split(",") if args.links else profile["links"]
    if args.delay_ms:
        links = [f"{name}+{args.delay_ms}ms" for name in links]
    try:
        for name in links:
            links_mod.parse(name)
    except BenchError as e:
        print(e, file=sys.stderr)
        return 2
    peers = args.peers.split(",") if args.peers else profile["peers"]
    repeats = args.repeats or profile["repeats"]
    if any(p.startswith("qemu") for p in peers) and not qemu.available():
        print("*** QEMU is absent: QEMU rows are skipped (make bench installs it) ***", file=sys.stderr)
        peers = [p for p in peers if not p.startswith("qemu")]
    started = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    outdir = args.out or os.path.join(REPO, "bench", "results", started)
    os.makedirs(outdir, exist_ok=True)
    results = {"started": started, "profile": args.profile, "repeats": repeats, "machine": machine(),
               "build": build(), "pin": {k: sorted(v) for k, v in util.PINNING.items()} or None,
               "links": {}, "boot": [], "dirty_logging": None, "scenarios": [], "forwarding": [],
               "block": [], "storage": [], "linux": []}
    if args.profile == "balloon":
        results["balloon"] = {"memory": args.balloon_memory, "guest_words_left_out": sorted(
            {w for sc in profile["scenarios"] for w in sc["balloon"]["left_out"]})}
    tag = str(os.getpid() % 100000)

    with tempfile.TemporaryDirectory(prefix=args.work_prefix) as work:
        procs = Processes()
        try:
            ferry = FerryPeer(procs, work)
            for mem in profile["boot"]:
                results["boot"].append(ferry.boot_metrics(mem))
                procs.stop_all()
            if profile["dirty"]:
                results["dirty_logging"] = ferry.dirty_logging_cost()
                procs.stop_all()
            for link_name in links:
                with Link(link_name, tag) as link:
                    # Loopback too has a floor: the best of three 1 GiB transfers (a 64 MiB one
                    # is over in ~20 ms there, and this machine's loopback swings 2.8–4.5 GB/s).
                    results["links"][link_name] = (
                        max(link.goodput_bytes_per_s(1024) for _ in range(3))
                        if link_name == "loopback" else link.goodput_bytes_per_s())
                    if args.profile == "scale":
                        # What a plain stream reaches when, like a destination, it writes
                        # into memory it has never touched.
                        results.setdefault("links_fresh", {})[link_name] = (max(
                            link.goodput_bytes_per_s(1024, fresh=True) for _ in range(3)))
                    if args.profile == "scale" and not args.skip_ceilings:
                        # What many plain streams into one process reach, and how fast the
                        # host faults memory in: the ceilings the connection rows meet (on a
                        # quarter of the guest's size, at most 2 GiB). A host where they
                        # cannot be measured still runs the rows.
                        mb = min(2048, size_bytes(args.scale_memory) // 4 >> 20)
                        try:
                            results.setdefault("links_parallel", {})[link_name] = {
                                n: {kind: max(link.parallel_goodput_bytes_per_s(
                                    mb, n, kind == "fresh") for _ in range(3))
                                    for kind in ("reused", "fresh")}
                                for n in (1, 8, 16)}
                            if "fault_in" not in results:
                                # Every try, in order: on a VM whose freed memory goes back to
                                # its host (virtio-balloon free page reporting), a first touch
                                # after a while costs the host's fault too, and the next ones
                                # find the memory backed.
                                runs = {n: [fault_in_bytes_per_s(mb, n) for _ in range(3)]
                                        for n in (1, 2, 4, 8, 16)}
                                results["fault_in_runs"] = runs
                                results["fault_in"] = {n: max(v) for n, v in runs.items()}
                        except (BenchError, subprocess.SubprocessError, ValueError) as e:
                            results["ceilings_error"] = str(e)
                            print(f"*** the host's ceilings were not measured: {e} ***",
                                  file=sys.stderr)
                    for sc in profile["scenarios"]:
                        if args.fail_scenario:
                            sc = dict(sc, memory="0")  # a scenario made to fail (cleanup test)
                        names = [p for p in peers if runs_on(p, sc)]
                        kept = {p: ([], None, []) for p in names}  # rows, error, runs that stalled
                        # Runs interleave (ferry, QEMU, ferry, ...): a machine that drifts during
                        # a scenario drifts for every peer alike.
                        for i in range(repeats):
                            for peer_name in names:
                                rows, error, stalled = kept[peer_name]
                                said = "ok"
                                try:
                                    rows.append(make_peer(peer_name, procs, work).migrate_once(sc, link))
                                except DidNotConverge as e:
                                    said = str(e)  # a result, not a failure of the run
                                    stalled.append(said)
                                except (BenchError, Exception) as e:  # noqa: BLE001 - recorded, run goes on
                                    error = str(e).splitlines()[0][:300]
                                    said = "FAILED: " + error
                                    traceback.print_exc(file=sys.stderr)
                                finally:
                                    procs.stop_all()
                                kept[peer_name] = (rows, error, stalled)
                                print(f"  {link_name:8} {sc['name']:28} {peer_name:9} run {i + 1}/{repeats}"
                                      f" {said}", file=sys.stderr)
                        for peer_name in names:
                            rows, error, stalled = kept[peer_name]
                            outcome = f"{stalled[0]} in {len(stalled)} of {repeats} runs" if stalled else None
                            must = [r["must_move_bytes"] for r in rows if r.get("must_move_bytes")]
                            goodput = results["links"].get(link_name)
                            entry = {"scenario": sc["name"], "link": link_name, "peer": peer_name,
                                     "runs": rows, "summary": report.summarize_rows(rows), "error": error,
                                     "outcome": outcome}
                            if sc.get("balloon"):
                                entry["balloon"] = {k: sc["balloon"][k] for k in ("variant", "mode")}
                            if sc.get("relay"):
                                entry["resume"] = dict(sc["relay"], memory=sc["memory"])
                            if must and goodput:
                                entry["floor_ms"] = sorted(must)[len(must) // 2] / goodput * 1e3
                            results["scenarios"].append(entry)
                        # A run stopped part way (a time limit on a borrowed host) keeps what it
                        # measured: the file is complete up to the last scenario.
                        save_partial(results, outdir)
                    # QEMU rows get the same floor as ferry's (same guest, same link).
                    for e in results["scenarios"]:
                        if e["link"] == link_name and "floor_ms" not in e:
                            twin = next((x for x in results["scenarios"] if x["link"] == link_name
                                         and x["scenario"] == e["scenario"] and "floor_ms" in x), None)
                            if twin:
                                e["floor_ms"] = twin["floor_ms"]
            forwarding = profile.get("forwarding")
            vmms = [v for v in ("ferry", "qemu") if v in peers]
            runs = [("forwarding", mode, rate) for rate in (forwarding["rates"] if forwarding else ())
                    for mode in forwarding["modes"]]
            runs += [("block", mode, 0) for mode in profile.get("block", ())]
            runs += [("storage", "precopy", size) for size in profile.get("storage", ())]
            runs += [("linux", "precopy", 0)] if profile.get("linux") else []
            for kind, mode, rate in runs:
                names = peers if kind == "linux" else [
                    v for v in vmms if not (v == "qemu" and mode == "hybrid")]
                kept = {v: ([], None) for v in names}
                # Runs interleave (ferry, QEMU, ferry, ...), as the migration scenarios do.
                for i in range(repeats):
                    for vmm in names:
                        rows, error = kept[vmm]
                        said = "ok"
                        try:
                            rows.append(device_run(procs, work, kind, vmm, mode, rate))
                        except (BenchError, Exception) as e:  # noqa: BLE001 - recorded, run goes on
                            error = str(e).splitlines()[0][:300]
                            said = "FAILED: " + error
                            traceback.print_exc(file=sys.stderr)
                        kept[vmm] = (rows, error)
                        print(f"  {kind} {vmm:5} {mode or 'no move':9} {str(rate or ''):6} run "
                              f"{i + 1}/{repeats} {said}", file=sys.stderr)
                metrics = {"forwarding": report.FORWARDING, "block": report.BLOCK,
                           "storage": storage.METRICS, "linux": linux.METRICS}[kind]
                for vmm in names:
                    rows, error = kept[vmm]
                    what = storage.sizes(*rate) if kind == "storage" else {"rate": rate or None}
                    results[kind].append({
                        "vmm": vmm, "mode": mode or "none", **what, "runs": rows, "error": error,
                        "summary": {m: summarize([r.get(m) for r in rows]) for m in metrics}})
        finally:
            procs.stop_all()
    written = report.write_all(results, outdir)
    print(open(os.path.join(outdir, "results.md")).read())
    # A run of some of the links still measures each of them whole; so does a sweep of some
    # variants (each variant's row stands alone).
    whole = not (args.only or args.repeats or args.delay_ms or args.fail_scenario
                 or args.balloon_memory != BALLOON_MEMORY or args.resume_memory != RESUME_MEMORY
                 or args.resume_stall_s != RESUME_STALL_S) and (
        not args.peers or profile.get("pick"))
    own_page = {"storage": (storage, report.storage_page), "linux": (linux, report.linux_page)}
    if whole and args.profile in own_page:
        # The profile's page is written from its raw data, kept beside it.
        mod, write_page = own_page[args.profile]
        shutil.copy(os.path.join(outdir, "results.json"), os.path.join(page.RAW, mod.RAW_FILE))
        with open(os.path.join(page.RAW, mod.PAGE_FILE), "w") as f:
            f.write(write_page(results))
        print(f"docs/benchmarks/{mod.PAGE_FILE} written from docs/benchmarks/{mod.RAW_FILE}",
              file=sys.stderr)
    if whole and args.profile in page.RAW_FILES:
        # A whole run of a page's profile is what the results page cites.
        limits = {sc["name"]: sc["max_downtime_ms"] for sc in headline() + application() + profile["scenarios"]}
        page.keep_raw(args.profile, outdir, some_peers=bool(args.peers))
        if profile.get("pick"):
            page.write_winners(page.load(args.profile), limits, qemu.BEST_FILE)
        page.rewrite(limits)
        print(f"docs/benchmarks.md's tables rewritten from docs/benchmarks/{page.RAW_FILES[args.profile]}",
              file=sys.stderr)
    print(f"results: {outdir} ({', '.join(os.path.basename(w) for w in written)})", file=sys.stderr)
    failed = any(e.get("error") for e in results["scenarios"] + results["forwarding"] + results["block"]
                 + results["storage"] + results["linux"])
    return 1 if failed else 0


def main():
    # SIGTERM/SIGHUP unwind like Ctrl-C, so every namespace and process is removed.
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda num, _frame: sys.exit(128 + num))
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--profile", choices=sorted(PROFILES), default="headline",
                   help="headline (the default: the results page), sweep, flags, floor, ...")
    p.add_argument("--quick", dest="profile", action="store_const", const="quick",
                   help="the quick profile (about 10 minutes)")
    p.add_argument("--full", dest="profile", action="store_const", const="full",
                   help="every scenario on every link (about 45 minutes here)")
    p.add_argument("--links", help="comma list: loopback,1gbit,10gbit")
    p.add_argument("--peers", help="comma list: ferry,ferry-best,qemu-default,qemu,qemu-best,qemu-cpr")
    p.add_argument("--repeats", type=int)
    p.add_argument("--delay-ms", type=int, default=0,
                   help="make every link WAN-like: this much latency each way (a delay line "
                        "between tun devices; not on loopback)")
    p.add_argument("--pin", choices=("none", "split"), default="none",
                   help="split: the source VMM on the first half of the CPUs, the destination on the rest")
    p.add_argument("--only", metavar="REGEX", help="only the profile's scenarios whose name matches")
    p.add_argument("--scale-memory", default="64G", help="scale profile: guest memory")
    p.add_argument("--scale-ws", default="16G", help="scale profile: working set (fill=word)")
    p.add_argument("--scale-codec-ws", default="512M", help="scale profile: working set of the codec rows (fill=mixed)")
    p.add_argument("--scale-vcpus", type=int, default=8, help="scale profile: vCPUs")
    p.add_argument("--balloon-memory", default=BALLOON_MEMORY,
                   help="balloon profile: guest memory (default 4G: a 512 MiB working set after a "
                        "3800 MiB peak; smaller guests scale both down)")
    p.add_argument("--resume-memory", default=RESUME_MEMORY,
                   help="resume profile: guest memory (default 4G; the writer's set is 7/8 of it)")
    p.add_argument("--resume-stall-s", type=int, default=RESUME_STALL_S,
                   help="resume profile: how long the stall forwards nothing (default 30 s)")
    p.add_argument("--skip-ceilings", action="store_true",
                   help="scale profile: leave out the host's ceilings (plain streams at once, "
                   "faulting memory in), e.g. when an earlier run on this host measured them")
    p.add_argument("--out", help="results directory (default bench/results/<timestamp>)")
    p.add_argument("--fail-scenario", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--work-prefix", default="ferry-bench-", help=argparse.SUPPRESS)
    sys.exit(run(p.parse_args()))


if __name__ == "__main__":
    main()
