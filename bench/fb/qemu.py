"""Drives QEMU (Debian's qemu-system-x86_64, -enable-kvm, default CPU model) on the same guest
and link, over QMP, configured three ways:

- `qemu-default`: QEMU as it comes (no migration parameter set: downtime limit 300 ms,
  bandwidth 128 MiB/s: QEMU's defaults);
- `qemu`: ferry's limits (the scenario's downtime limit, no bandwidth cap), nothing else;
- `qemu-best`: ferry's limits and what QEMU offers for speed: pre-copy with multifd
  (one channel per core) compressing with zstd, xbzrle (delta encoding) and auto-converge;
  post-copy with postcopy-preempt (page requests on a channel of their own).

Numbers come from query-migrate; guest-observed downtime from the same serial timestamps used
for ferry."""
import json
import os
import shutil
import socket
import time

from .serial import SerialClock, observed_downtime_ms
from .util import GUEST, BenchError, CpuMeter, DidNotConverge, cpu_row, free_port, wait_until

QEMU = "qemu-system-x86_64"


def available():
    return shutil.which(QEMU) is not None


class Qmp:
    def __init__(self, path, timeout=30):
        deadline = time.time() + timeout
        while True:
            try:
                self.sock = socket.socket(socket.AF_UNIX)
                self.sock.connect(path)
                break
            except OSError:
                if time.time() > deadline:
                    raise BenchError(f"no QMP socket at {path}")
                time.sleep(0.02)
        self.file = self.sock.makefile("rwb")
        self.events = []  # (event, its data, host time in s) as QEMU sent them
        self._read()  # greeting
        self.cmd("qmp_capabilities")

    def _read(self):
        while True:
            line = self.file.readline()
            if not line:
                raise BenchError("QMP connection closed")
            msg = json.loads(line)
            if "event" not in msg:
                return msg
            ts = msg.get("timestamp", {})
            self.events.append((msg["event"], msg.get("data", {}),
                                ts.get("seconds", 0) + ts.get("microseconds", 0) / 1e6))

    def event_time(self, name, timeout, match=lambda data: True):
        """When QEMU says `name` happened (its own timestamp, this host's clock), waiting up to
        `timeout` s for it."""
        deadline = time.time() + timeout
        while True:
            for event, data, at in self.events:
                if event == name and match(data):
                    return at
            if time.time() > deadline:
                raise BenchError(f"QEMU never sent {name}")
            self.cmd("query-status")  # reads the events queued before its answer
            time.sleep(0.01)

    def cmd(self, name, **args):
        self.file.write(json.dumps({"execute": name, "arguments": args}).encode() + b"\n")
        self.file.flush()
        reply = self._read()
        if "error" in reply:
            raise BenchError(f"QMP {name}: {reply['error'].get('desc')}")
        return reply.get("return")

    def close(self):
        try:
            self.sock.close()
        except OSError:
            pass


VARIANTS = ("qemu-default", "qemu", "qemu-best")


class QemuPeer:
    def __init__(self, procs, workdir, variant="qemu"):
        assert variant in VARIANTS, variant
        self.procs = procs
        self.work = workdir
        self.variant = variant
        self.name = variant
        self.pids = {}  # tag given to `start` → the QEMU's pid

    def start(self, tag, scenario, clock, netns, incoming=None, machine=None, extra=()):
        """A QEMU in `netns` running the scenario's guest (or waiting for it: `incoming`), its
        serial lines followed by `clock`; `machine` and `extra` add to the command line."""
        qmp = os.path.join(self.work, f"{tag}-{time.time_ns()}.qmp")
        ser = os.path.join(self.work, f"{tag}-{time.time_ns()}.ser")
        mem_mib = parse_mib(scenario["memory"])
        argv = [QEMU, "-enable-kvm", "-nodefaults", "-display", "none", "-m", str(mem_mib),
                "-smp", str(scenario["vcpus"]),
                "-chardev", f"socket,id=ser0,path={ser},server=on,wait=off", "-serial", "chardev:ser0",
                "-kernel", GUEST, "-append", scenario["cmdline"],
                "-qmp", f"unix:{qmp},server=on,wait=off"]
        if machine:
            argv += ["-M", machine]
        argv += list(extra)
        if incoming:
            argv += ["-incoming", incoming]
        side = "destination" if incoming else "source"
        self.pids[tag] = self.procs.start(argv, netns=netns, side=side,
                                          stderr=open(os.path.join(self.work, f"qemu-{tag}.err"), "ab")).pid
        wait_until("the QEMU serial socket", 30, lambda: os.path.exists(ser))
        clock.follow_socket(ser)
        return Qmp(qmp)

    def configure(self, qmp, scenario):
        postcopy = scenario["mode"] == "postcopy"
        caps = ["postcopy-ram"] if postcopy else []
        if self.variant == "qemu-default":
            if caps:
                qmp.cmd("migrate-set-capabilities", capabilities=[{"capability": c, "state": True} for c in caps])
            return  # every parameter as QEMU sets it
        params = {"downtime-limit": scenario["max_downtime_ms"], "max-bandwidth": 100 << 30}
        if self.variant == "qemu-best":
            if postcopy:
                caps += ["postcopy-preempt"]
            else:
                caps += ["multifd", "xbzrle", "auto-converge"]
                params.update({"multifd-channels": os.cpu_count() or 2, "multifd-compression": "zstd"})
        if caps:
            qmp.cmd("migrate-set-capabilities", capabilities=[{"capability": c, "state": True} for c in caps])
        qmp.cmd("migrate-set-parameters", **params)

    def migrate(self, src, scenario, uri):
        """Moves the VM of QMP `src` to `uri` in the scenario's mode; query-migrate's answer once
        it completed (DidNotConverge when it did not within the scenario's timeout)."""
        src.cmd("migrate", uri=uri)
        if scenario["mode"] == "postcopy":
            # As soon as QEMU allows it: QEMU switches after its first pass has begun.
            wait_until("QEMU to accept migrate-start-postcopy", 30,
                       lambda: _try(lambda: src.cmd("migrate-start-postcopy")), interval=0.01)

        def done():
            info = src.cmd("query-migrate")
            if info.get("status") in ("completed", "failed", "cancelled"):
                return info
            return None

        try:
            info = wait_until("the QEMU migration", scenario["timeout_s"], done, interval=0.02)
        except BenchError:
            src.cmd("migrate_cancel")
            raise DidNotConverge(f"did not converge in {scenario['timeout_s']} s")
        if info["status"] != "completed":
            raise BenchError(f"QEMU migration {info['status']}: {info.get('error-desc', '')}")
        return info

    def migrate_once(self, scenario, link):
        if scenario["mode"] not in ("precopy", "postcopy", "warm"):
            raise BenchError(f"the QEMU driver has no {scenario['mode']} mode")
        postcopy = scenario["mode"] == "postcopy"
        src_clock, dst_clock = SerialClock(), SerialClock()
        src = self.start("src", scenario, src_clock, link.ns_src)
        # Steady state: a writer has populated its whole working set once (same rule as ferry).
        busy = " idle" not in f" {scenario['cmdline']}"
        wait_until("guest serial progress", scenario.get("ready_s", 120),
                   lambda: src_clock.counter("all_passed") >= 1 if busy else len(src_clock.lines()) > 3)
        if scenario.get("warmup_s"):
            time.sleep(scenario["warmup_s"])
        port = free_port()
        dst = self.start("dst", scenario, dst_clock, link.ns_dst,
                          incoming=f"tcp:{link.dst_host}:{port}")
        self.configure(src, scenario)
        self.configure(dst, scenario)
        # The destination says when it ran the VM, and when post-copy's last page came.
        dst.cmd("migrate-set-capabilities", capabilities=[{"capability": "events", "state": True}])
        meter = CpuMeter(self.pids["src"], self.pids["dst"]) if scenario.get("cpu") else None
        wire_before = link.wire_bytes()
        started = time.time()
        if scenario["mode"] == "warm":
            src.cmd("stop")  # QEMU's warm migration: a paused guest, moved by pre-copy
        info = self.migrate(src, scenario, f"tcp:{link.dst_host}:{port}")
        finished = dst.event_time("MIGRATION", 30, lambda d: d.get("status") == "completed")
        wire = link.wire_bytes() - wire_before
        cpu = meter.seconds(src_exits=False) if meter else None
        time.sleep(0.5)
        ram = info.get("ram", {})
        for q in (src, dst):
            try:
                q.cmd("quit")
            except BenchError:
                pass
            q.close()
        return {
            "peer": self.name,
            # The destination's clock: from the request to the VM needing nothing more from
            # the source; QEMU's own figure (its source's clock) beside it.
            "total_ms": (finished - started) * 1e3,
            "total_ms_reported": info.get("total-time"),
            "wire_bytes": wire,
            "downtime_ms": info.get("downtime"),
            "guest_downtime_ms": None,
            "serial_downtime_ms": observed_downtime_ms(src_clock, dst_clock, started),
            "bytes": ram.get("transferred"),
            "must_move_bytes": None,
            "rounds": ram.get("dirty-sync-count"),
            "round_table": [],
            "pages_full": ram.get("normal"),
            "pages_zero": ram.get("duplicate"),
            "pages_skipped": None,
            "pages_resent": None,
            "converged": None,
            "verify_errors_after": None,
            "rate_before": None,
            "rate_during": None,
            "rate_after": None,
            "postcopy": postcopy,
            "pages_requested": ram.get("postcopy-requests"),
            "resume_ms": None,
            "pages_transferred": (ram.get("normal") or 0) + (ram.get("duplicate") or 0),
            **cpu_row(cpu, scenario),
        }


def _try(f):
    try:
        f()
        return True
    except BenchError:
        return False


def passes(clock):
    """The guest's completed passes, from its latest serial progress line."""
    return clock.counter("passes")


def parse_mib(size):
    unit = size[-1].upper()
    n = int(size[:-1]) if unit in "KMG" else int(size)
    return {"G": n * 1024, "M": n, "K": max(1, n // 1024)}.get(unit, n >> 20)
