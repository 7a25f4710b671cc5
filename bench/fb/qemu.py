"""Drives QEMU (Debian's qemu-system-x86_64, -enable-kvm, default CPU model) on the same guest
and link, over QMP. A variant is what an expert sets before `migrate` (`VARIANTS`):

- `qemu-default`: QEMU as it comes (no migration parameter set: downtime limit 300 ms,
  bandwidth 128 MiB/s: QEMU's defaults);
- `qemu`: the scenario's downtime limit and no bandwidth cap, nothing else; every other
  variant starts from it and adds multifd channels, zstd (level 1), xbzrle, auto-converge,
  dirty-limit, post-copy (with or without postcopy-preempt) from the start or after the first
  pre-copy pass (QEMU's hybrid);
- `qemu-best`: for each scenario and link, the sweep's winner (`bench/qemu-best.json`, written
  by `bench/run.py --profile sweep`; `qemu-mfd2-zstd` where the sweep did not run).

Total time is read on the destination (its QMP events, host timestamps), bytes on the link,
downtime from the guest's serial ticks as for ferry; QEMU's own figures are kept beside them."""
import json
import os
import shutil
import socket
import subprocess
import threading
import time

from . import balloon, stall
from .serial import SerialClock, observed_downtime_ms
from .util import BenchError, CpuMeter, DidNotConverge, cpu_row, free_port, guest_image, parse_mib, wait_until

QEMU = "qemu-system-x86_64"


def available():
    return shutil.which(QEMU) is not None


class Qmp:
    def __init__(self, path, timeout=30, sock=None):
        """`sock`: a connection QEMU made (`Qmp.listen`) instead of one to `path`."""
        deadline = time.time() + timeout
        while sock is None:
            try:
                self.sock = socket.socket(socket.AF_UNIX)
                self.sock.connect(path)
                break
            except OSError:
                if time.time() > deadline:
                    raise BenchError(f"no QMP socket at {path}")
                time.sleep(0.02)
        if sock is not None:
            self.sock = sock
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

    @staticmethod
    def listen(path, timeout=60):
        """Listens on `path` for a QMP chardev with `server=off` (QEMU connects as it creates
        its monitor) and negotiates at once, in a thread, so that events QEMU sends soon after
        (a cpr-transfer destination's RESUME) are not lost; `get()` gives the Qmp."""
        listener = socket.socket(socket.AF_UNIX)
        listener.bind(path)
        listener.listen(1)
        listener.settimeout(timeout)
        got = {}

        def run():
            try:
                conn, _ = listener.accept()
                conn.settimeout(None)
                got["qmp"] = Qmp(path, sock=conn)
            except (OSError, BenchError) as e:
                got["error"] = e
            finally:
                listener.close()

        thread = threading.Thread(target=run, daemon=True)
        thread.start()

        class Pending:
            def get(self, wait=timeout):
                thread.join(wait)
                if "qmp" not in got:
                    raise BenchError(f"QEMU never connected its QMP to {path}: {got.get('error')}")
                return got["qmp"]

        return Pending()


# What each variant sets beyond `qemu` (the scenario's downtime limit, no bandwidth cap).
# `postcopy`: "start" switches as soon as QEMU allows, "after-pass" once the first pre-copy
# pass is over (QEMU's hybrid); multifd zstd at level 1, the cheapest, on this host's cores.
VARIANTS = {
    "qemu-default": None,
    "qemu": {},
    "qemu-mfd1": {"multifd": 1},
    "qemu-mfd2": {"multifd": 2},
    "qemu-mfd4": {"multifd": 4},
    "qemu-mfd8": {"multifd": 8},
    "qemu-mfd2-zstd": {"multifd": 2, "zstd": True},
    "qemu-xbzrle": {"xbzrle": True},
    "qemu-ac": {"auto_converge": True},
    "qemu-mfd2-zstd-ac": {"multifd": 2, "zstd": True, "auto_converge": True},
    "qemu-dirty-limit": {"dirty_limit": True},
    "qemu-postcopy": {"postcopy": "start"},
    "qemu-postcopy-preempt": {"postcopy": "start", "preempt": True},
    "qemu-hybrid-preempt": {"postcopy": "after-pass", "preempt": True},
}
# QEMU's live update on one host (`--profile update`): cpr-transfer mode, guest RAM in a shared
# memfd passed to a new QEMU over a Unix "cpr" channel (QEMU's docs/devel/migration/CPR.rst).
# Not a variant of its pre-copy: it runs the `local` scenarios only.
CPR = "qemu-cpr"
# The machine the bench's other microvm rows use (fb/balloon.py): the guest ELF's PVH entry.
CPR_MACHINE = "microvm,acpi=off"
# The variant `qemu-best` stands for where the sweep has no winner for a scenario and link.
FALLBACK_BEST = "qemu-mfd2-zstd"
BEST_FILE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "qemu-best.json")
# Enough dirty ring for dirty-limit's per-vCPU rate (QEMU's accel option, both sides).
DIRTY_RING = ["-accel", "kvm,dirty-ring-size=4096"]


def best_variant(scenario, link):
    """The sweep's winner for `scenario` on `link` (`FALLBACK_BEST` when it has none)."""
    try:
        with open(BEST_FILE) as f:
            winners = json.load(f)["winners"]
    except (OSError, ValueError, KeyError):
        return FALLBACK_BEST
    return winners.get(link, {}).get(scenario, FALLBACK_BEST)


class QemuPeer:
    def __init__(self, procs, workdir, variant="qemu"):
        assert variant in VARIANTS or variant in ("qemu-best", CPR), variant
        self.procs = procs
        self.work = workdir
        self.variant = variant
        self.name = variant
        self.pids = {}  # tag given to `start` → the QEMU's pid
        self.popens = {}  # tag given to `start` → the QEMU's process

    def spec(self, scenario, link):
        """What this peer sets for `scenario` on `link` (`qemu-best`: the sweep's winner), and
        the variant that is."""
        name = best_variant(scenario["name"], link.name) if self.variant == "qemu-best" else self.variant
        return name, VARIANTS[name]

    def start(self, tag, scenario, clock, netns, incoming=None, machine=None, extra=(), connect_back=False):
        """A QEMU in `netns` running the scenario's guest (or waiting for it: `incoming`, one
        `-incoming` argument or a list of them), its serial lines followed by `clock`;
        `machine` and `extra` add to the command line. `connect_back`: QEMU connects its
        console and QMP to sockets the bench listens on (see `Qmp.listen`), and a pending Qmp
        is returned (`.get()`)."""
        qmp = os.path.join(self.work, f"{tag}-{time.time_ns()}.qmp")
        ser = os.path.join(self.work, f"{tag}-{time.time_ns()}.ser")
        mem_mib = parse_mib(scenario["memory"])
        if connect_back:
            clock.listen(ser)
            pending = Qmp.listen(qmp)
            console = [f"socket,id=ser0,path={ser},server=off"]
            monitor = ["-chardev", f"socket,id=qmp0,path={qmp},server=off", "-mon", "chardev=qmp0,mode=control"]
        else:
            console = [f"socket,id=ser0,path={ser},server=on,wait=off"]
            monitor = ["-qmp", f"unix:{qmp},server=on,wait=off"]
        argv = [QEMU, *(() if "-accel" in extra else ("-enable-kvm",)), "-nodefaults", "-display", "none", "-m", str(mem_mib),
                "-smp", str(scenario["vcpus"]),
                "-chardev", *console, "-serial", "chardev:ser0",
                "-kernel", guest_image(scenario), "-append", scenario.get("qemu_cmdline") or scenario["cmdline"], *monitor]
        if machine:
            argv += ["-M", machine]
        argv += list(extra)
        for channel in ([incoming] if isinstance(incoming, str) else incoming or []):
            argv += ["-incoming", channel]
        side = "destination" if incoming else "source"
        proc = self.procs.start(argv, netns=netns, side=side,
                                stderr=open(os.path.join(self.work, f"qemu-{tag}.err"), "ab"))
        self.pids[tag] = proc.pid
        self.popens[tag] = proc
        if connect_back:
            return pending
        wait_until("the QEMU serial socket", 30, lambda: os.path.exists(ser))
        clock.follow_socket(ser)
        return Qmp(qmp)

    def configure(self, qmp, scenario, spec):
        """Sets `spec`'s capabilities and parameters on one side (both sides get the same)."""
        postcopy = spec_postcopy(scenario, spec)
        caps = ["postcopy-ram"] if postcopy else []
        if spec is None:
            if caps:
                qmp.cmd("migrate-set-capabilities", capabilities=[{"capability": c, "state": True} for c in caps])
            return  # every parameter as QEMU sets it
        params = {"downtime-limit": scenario["max_downtime_ms"], "max-bandwidth": 100 << 30}
        if spec.get("preempt"):
            caps.append("postcopy-preempt")
        if spec.get("multifd"):
            caps.append("multifd")
            params["multifd-channels"] = spec["multifd"]
        if spec.get("zstd"):
            params.update({"multifd-compression": "zstd", "multifd-zstd-level": 1})
        if spec.get("xbzrle"):
            caps.append("xbzrle")
            # An expert sizes the cache to hold the working set (QEMU's default: 64 MiB).
            params["xbzrle-cache-size"] = 2 * parse_mib(working_set(scenario) or "64M") << 20
        if spec.get("auto_converge"):
            caps.append("auto-converge")
        if spec.get("dirty_limit"):
            caps.append("dirty-limit")
        if caps:
            qmp.cmd("migrate-set-capabilities", capabilities=[{"capability": c, "state": True} for c in caps])
        qmp.cmd("migrate-set-parameters", **params)

    def migrate(self, src, scenario, spec, uri):
        """Moves the VM of QMP `src` to `uri` as `spec` says; query-migrate's answer once it
        completed (DidNotConverge when it did not within the scenario's timeout)."""
        src.cmd("migrate", uri=uri)
        postcopy = spec_postcopy(scenario, spec)
        if postcopy == "after-pass":
            # QEMU's hybrid: the switch once the first pass has been sent (a second sync began).
            wait_until("QEMU's first pre-copy pass", scenario["timeout_s"],
                       lambda: (src.cmd("query-migrate").get("ram", {}).get("dirty-sync-count") or 0) >= 2
                       or src.cmd("query-migrate").get("status") == "completed", interval=0.01)
        if postcopy:
            # As soon as QEMU allows it (a migration already completed needs no switch).
            wait_until("QEMU to accept migrate-start-postcopy", 30,
                       lambda: _try(lambda: src.cmd("migrate-start-postcopy"))
                       or src.cmd("query-migrate").get("status") == "completed", interval=0.01)

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

    def cpr_once(self, scenario):
        """One live update by QEMU's cpr-transfer, measured as ferry's (`FerryPeer.local_once`):
        the new QEMU started with the machine's arguments plus a `main` and a `cpr` incoming
        channel (Unix sockets); the old one told `migrate-set-parameters mode=cpr-transfer`,
        then `migrate` on both. The new QEMU creates its devices, console and monitor only once
        the old one sent its cpr state (the memfd), so both connect back to the bench
        (`connect_back`): its first console line and its RESUME event are not missed.

        Total: the request → the destination's RESUME event (its host timestamp); QEMU's own
        total-time beside it. Bytes: QEMU's count of the main channel (`ram.transferred`:
        device state and headers; guest RAM is not sent); the cpr channel's few bytes and the
        fds are not counted by QEMU."""
        mem_mib = parse_mib(scenario["memory"])
        memory = ["-object", f"memory-backend-memfd,id=ram0,size={mem_mib}M,share=on"]
        # aux-ram-share: the machine's own RAM (ROMs, firmware) in memfds too, as CPR needs.
        machine = f"{CPR_MACHINE},memory-backend=ram0,aux-ram-share=on"
        src_clock, dst_clock = SerialClock(), SerialClock()
        src = self.start("src", scenario, src_clock, None, machine=machine, extra=memory)
        wait_ready(src_clock, scenario)
        stamp = time.time_ns()
        main = {"channel-type": "main", "addr": {"transport": "socket", "type": "unix",
                                                 "path": os.path.join(self.work, f"main-{stamp}.sock")}}
        cpr = {"channel-type": "cpr", "addr": {"transport": "socket", "type": "unix",
                                               "path": os.path.join(self.work, f"cpr-{stamp}.sock")}}
        pending = self.start("dst", scenario, dst_clock, None, incoming=[json.dumps(main), json.dumps(cpr)],
                             machine=machine, extra=memory, connect_back=True)

        def listening():
            if self.popens["dst"].poll() is not None:
                raise BenchError("the cpr-transfer destination exited: "
                                 + open(os.path.join(self.work, "qemu-dst.err")).read().strip()[-300:])
            return os.path.exists(cpr["addr"]["path"])

        wait_until("the cpr channel", 30, listening)
        src.cmd("migrate-set-parameters", mode="cpr-transfer")
        started = time.time()
        src.cmd("migrate", channels=[main, cpr])
        dst = pending.get()

        def done():
            info = src.cmd("query-migrate")
            return info if info.get("status") in ("completed", "failed", "cancelled") else None

        info = wait_until("the cpr-transfer migration", scenario["timeout_s"], done, interval=0.005)
        if info["status"] != "completed":
            raise BenchError(f"QEMU cpr-transfer {info['status']}: {info.get('error-desc', '')}")
        resumed = dst.event_time("RESUME", 30)
        stopped = src.event_time("STOP", 5)
        time.sleep(0.5)
        serial_downtime = observed_downtime_ms(src_clock, dst_clock, started)
        errors_after = None
        if "verify" in scenario["cmdline"].split():
            # One whole pass on the destination, as for ferry.
            passes = dst_clock.counter("all_passed")
            wait_until("a pass after the update", scenario.get("ready_s", 120),
                       lambda: dst_clock.guest_error() or dst_clock.counter("all_passed") > passes)
            errors_after = dst_clock.counter("errors")
        busy = " idle" not in f" {scenario['cmdline']}"
        passes_after = dst_clock.counter("all_passed") if busy else None
        source_exit = None
        for tag, q in (("src", src), ("dst", dst)):
            try:
                q.cmd("quit")
            except BenchError:
                pass
            q.close()
            try:
                code = self.popens[tag].wait(timeout=30)
            except subprocess.TimeoutExpired:
                code = None
            if tag == "src":
                source_exit = code
        ram = info.get("ram", {})
        return {
            "peer": self.name,
            "variant": CPR,
            "mode": "cpr-transfer",
            "total_ms": (resumed - started) * 1e3,
            "total_ms_reported": info.get("total-time"),
            "wire_bytes": None,  # no link: Unix sockets
            "downtime_ms": info.get("downtime"),
            "destination_downtime_ms": None,
            # The source's STOP to the destination's RESUME, each QEMU's event timestamp.
            "stop_to_resume_ms": (resumed - stopped) * 1e3,
            "guest_downtime_ms": None,
            "serial_downtime_ms": serial_downtime,
            **ram_row(ram),
            "pages_transferred": (ram.get("normal") or 0) + (ram.get("duplicate") or 0),
            "verify_errors_after": errors_after,
            "passes_after": passes_after,
            "source_exit": source_exit,
        }

    def migrate_once(self, scenario, link):
        if self.variant == CPR or scenario["mode"] == "local":
            if self.variant != CPR or scenario["mode"] != "local":
                raise BenchError("cpr-transfer (qemu-cpr) runs the local scenarios only")
            return self.cpr_once(scenario)
        if scenario["mode"] not in ("precopy", "postcopy", "warm"):
            raise BenchError(f"the QEMU driver has no {scenario['mode']} mode")
        variant, spec = self.spec(scenario, link)
        postcopy = bool(spec_postcopy(scenario, spec))
        # A scenario's machine and devices (the balloon profile's: microvm and a
        # virtio-balloon), the same on both sides.
        extra = (*(DIRTY_RING if spec and spec.get("dirty_limit") else ()), *scenario.get("qemu_args", ()))
        machine = scenario.get("qemu_machine")
        src_clock, dst_clock = SerialClock(), SerialClock()
        src = self.start("src", scenario, src_clock, link.ns_src, machine=machine, extra=extra)
        wait_ready(src_clock, scenario)
        # The balloon profile: the guest settled (DSB took its free memory), its work rate.
        settled = balloon.settle(src_clock, scenario)
        port = free_port()
        # `defer`: multifd and postcopy-preempt must be set before the destination listens.
        dst = self.start("dst", scenario, dst_clock, link.ns_dst, incoming="defer", machine=machine,
                         extra=extra)
        self.configure(src, scenario, spec)
        self.configure(dst, scenario, spec)
        dst.cmd("migrate-incoming", uri=f"tcp:{link.dst_host}:{port}")
        # The destination says when it ran the VM, and when post-copy's last page came.
        dst.cmd("migrate-set-capabilities", capabilities=[{"capability": "events", "state": True}])
        meter = CpuMeter(self.pids["src"], self.pids["dst"]) if scenario.get("cpu") else None
        watch = stall.scenario_watch(scenario, self.pids["src"], self.pids["dst"])
        wire_before = link.wire_bytes()
        started = time.time()
        if scenario["mode"] == "warm":
            src.cmd("stop")  # QEMU's warm migration: a paused guest, moved by pre-copy
        try:
            info = self.migrate(src, scenario, spec, f"tcp:{link.dst_host}:{port}")
        except BenchError:
            if watch:
                watch.stop()
            raise
        finished = dst.event_time("MIGRATION", 30, lambda d: d.get("status") == "completed")
        stalled = stall.figures(watch, dst.event_time("RESUME", 30)) if watch else {}
        wire = link.wire_bytes() - wire_before
        cpu = meter.seconds(src_exits=False) if meter else None
        time.sleep(0.5)
        # A guest that checks its pages (`verify`) counts what it found wrong on its console.
        errors_after = dst_clock.counter("errors") if "verify" in scenario["cmdline"].split() else None
        ram = info.get("ram", {})
        for q in (src, dst):
            try:
                q.cmd("quit")
            except BenchError:
                pass
            q.close()
        return {
            "peer": self.name,
            "variant": variant,
            # The destination's clock: from the request to the VM needing nothing more from
            # the source; QEMU's own figure (its source's clock) beside it.
            "total_ms": (finished - started) * 1e3,
            "total_ms_reported": info.get("total-time"),
            "wire_bytes": wire,
            "downtime_ms": info.get("downtime"),
            "guest_downtime_ms": None,
            "serial_downtime_ms": observed_downtime_ms(src_clock, dst_clock, started),
            **ram_row(ram),
            "pages_skipped": None,
            "pages_resent": None,
            "converged": None,
            "verify_errors_after": errors_after,
            "rate_before": None,
            "rate_during": None,
            "rate_after": None,
            "postcopy": postcopy,
            "pages_requested": ram.get("postcopy-requests"),
            "resume_ms": None,
            "pages_transferred": (ram.get("normal") or 0) + (ram.get("duplicate") or 0),
            **cpu_row(cpu, scenario),
            **balloon.row(settled, wire, dst_clock),
            **stalled,
        }


def spec_postcopy(scenario, spec):
    """When a run switches to post-copy: "start", "after-pass" or None (never)."""
    if spec and spec.get("postcopy"):
        return spec["postcopy"]
    return "start" if scenario["mode"] == "postcopy" else None


def working_set(scenario):
    """The `ws=` of the scenario's guest command line, if any."""
    return next((w[3:] for w in scenario["cmdline"].split() if w.startswith("ws=")), None)


def _try(f):
    try:
        f()
        return True
    except BenchError:
        return False


def passes(clock):
    """The guest's completed passes, from its latest serial progress line."""
    return clock.counter("passes")


def wait_ready(clock, scenario):
    """Steady state, as the guest's console tells it: a writer has populated its whole working
    set once (the same rule as ferry's), an idle guest has said a few lines."""
    busy = " idle" not in f" {scenario['cmdline']}"
    wait_until("guest serial progress", scenario.get("ready_s", 120),
               lambda: clock.guest_error() or (
                   clock.counter("all_passed") >= 1 if busy else len(clock.lines()) > 3))
    if scenario.get("warmup_s"):
        time.sleep(scenario["warmup_s"])


def ram_row(ram):
    """A result row's figures from QEMU's `ram` migration statistics."""
    return {"bytes": ram.get("transferred"), "must_move_bytes": None,
            "rounds": ram.get("dirty-sync-count"), "round_table": [],
            "pages_full": ram.get("normal"), "pages_zero": ram.get("duplicate")}
