"""Drives ferry: boot a source, start a destination, migrate through the CLI, collect the
report, and the boot and dirty-logging measurements."""
import http.client
import json
import os
import socket
import subprocess
import time

from . import balloon, stall
from .cutter import Cutter
from .serial import SerialClock, observed_downtime_ms
from .links import ADDR_DST
from .util import FERRY, GUEST, BenchError, CpuMeter, cpu_row, free_port, guest_image, wait_until


class _UnixHTTP(http.client.HTTPConnection):
    def __init__(self, path, timeout):
        super().__init__("ferry", timeout=timeout)
        self.path = path

    def connect(self):
        self.sock = socket.socket(socket.AF_UNIX)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self.path)


def api(socket_path, method, endpoint, body=None, timeout=30):
    """One HTTP request to a ferry API socket (the standard library only: the scale profile's
    hosts have no curl). An error's JSON body is returned like any other."""
    conn = _UnixHTTP(socket_path, timeout)
    try:
        data = json.dumps(body) if body is not None else None
        headers = {"Content-Type": "application/json"} if data is not None else {}
        conn.request(method, f"/api/v1/{endpoint}", body=data, headers=headers)
        text = conn.getresponse().read().decode()
    except (OSError, http.client.HTTPException) as e:
        raise BenchError(f"{endpoint}: {e!r}") from e
    finally:
        conn.close()
    try:
        return json.loads(text) if text.strip() else None
    except json.JSONDecodeError as e:
        raise BenchError(f"{endpoint}: not JSON ({e}): {text[:200]!r}") from e


def settled_migration(dst):
    """The destination's migration status once it holds the guest's own figures (downtime as
    the guest saw it, its work rate after): it measures them a moment after the VM resumed,
    so a migration completes before they are in."""
    def settled():
        status = api(dst, "GET", "vm.migration") or {}
        return None if status.get("guest_report_pending") else status
    return wait_until("the guest's figures on the destination", 15, settled, interval=0.05)


def all_passed(info):
    """Passes every vCPU has finished (each wrote its whole share of the working set)."""
    return min((v["passes"] for v in info["per_vcpu"]), default=0)


# ferry as it comes (`ferry`) and with one knob turned away from its default: the bench's
# check that the defaults are ferry's best (a variant that beats `ferry` is a defect in the
# defaults). `ferry-best` is the set of flags that used to beat them.
VARIANTS = {
    "ferry": [],
    "ferry-plain": ["--compression", "none"],
    "ferry-lz4": ["--compression", "lz4"],
    "ferry-zstd": ["--compression", "zstd"],
    "ferry-nodelta": ["--delta-cache-mb", "0"],
    "ferry-early": ["--auto-converge=early"],
    "ferry-2conn": ["--connections", "2"],
    "ferry-autopostcopy": ["--auto-postcopy"],
    "ferry-hybrid": ["--mode", "hybrid"],
    "ferry-best": ["--compression", "auto", "--delta-cache-mb", "256", "--auto-converge"],
}


def shape_args(scenario):
    """The destination's `--memory`/`--vcpus`: the VM built before it arrives, as QEMU's
    destination is (-m, -smp). An older ferry (a scale kit's `before` build) refuses them
    with --incoming and builds on arrival."""
    if "With --incoming" not in subprocess.run([FERRY, "run", "--help"], capture_output=True,
                                               text=True).stdout:
        return []
    return ["--memory", scenario["memory"], "--vcpus", str(scenario["vcpus"])]


class FerryPeer:
    def __init__(self, procs, workdir, variant="ferry"):
        assert variant in VARIANTS, variant
        self.procs = procs
        self.work = workdir
        self.name = variant
        self.flags = VARIANTS[variant]

    def tls_args(self, host):
        """`ferry run` arguments for TLS with a certificate for `host`: one `ferry certs` per
        run makes a CA and a certificate for the source and for every destination address."""
        tls = os.path.join(self.work, "tls")
        if not os.path.exists(os.path.join(tls, "ca.pem")):
            names = ["source.local", "127.0.0.1", ADDR_DST]
            subprocess.run([FERRY, "certs", "--out", tls, *[a for n in names for a in ("--name", n)]],
                           check=True, capture_output=True)
        return ["--tls-cert", os.path.join(tls, f"{host}.pem"),
                "--tls-key", os.path.join(tls, f"{host}.key"), "--tls-ca", os.path.join(tls, "ca.pem")]

    def boot(self, memory, vcpus, cmdline, netns=None, serial=None, transport=("--plain-tcp",),
             devices=(), image=GUEST):
        """`devices`: more `ferry run` arguments (a balloon: `--balloon`)."""
        sock = os.path.join(self.work, f"src-{time.time_ns()}.sock")
        serial_path = serial or os.path.join(self.work, "src.serial")
        err = os.path.join(self.work, "src.err")
        p = self.procs.start([FERRY, "run", "--guest", image, "--memory", memory, "--vcpus", str(vcpus),
                              "--cmdline", cmdline, "--api-socket", sock, "--serial", serial_path,
                              *devices, *transport, "--enable-debug-api", "--snapshot-dir", self.work],
                             netns=netns, side="source", stderr=open(err, "ab"))

        def up():
            if p.poll() is not None:
                raise BenchError(f"ferry run exited: {open(err).read().strip()[-300:]}")
            return os.path.exists(sock)

        wait_until("the ferry source API", 30, up)
        self.source_pid = p.pid
        self.source_proc = p
        return sock

    def info(self, sock):
        return api(sock, "GET", "vm.info")

    def ready(self, sock, scenario, clock=None):
        """Steady state: a writer has populated its whole working set once (same rule for QEMU).
        Returns the seconds it took, so a profile's `ready_s` can be sized from real hosts.
        `clock`: the guest's console, whose fatal error ends the wait at once."""
        busy = " idle" not in f" {scenario['cmdline']}"
        began = time.time()
        wait_until("guest progress", scenario.get("ready_s", 120),
                   lambda: (clock and clock.guest_error()) or (
                       all_passed(self.info(sock)) >= 1 if busy else self.info(sock)["heartbeats"] > 100))
        taken = time.time() - began
        if scenario.get("warmup_s"):
            time.sleep(scenario["warmup_s"])
        return taken

    def snapshot_once(self, scenario):
        """One snapshot (`ferry snapshot`, the scenario's `extra` arguments), then the file
        restored: how long each took, and that the restored guest verifies its memory."""
        src = self.boot(scenario["memory"], scenario["vcpus"], scenario["cmdline"], image=guest_image(scenario))
        self.ready(src, scenario)
        path = os.path.join(self.work, f"snap-{time.time_ns()}.ferry")
        out = subprocess.run([FERRY, "snapshot", "--api-socket", src, "--to", path, "--json",
                              *scenario.get("extra", [])], capture_output=True, text=True, timeout=600)
        if out.returncode != 0:
            raise BenchError(f"ferry snapshot failed: {out.stderr.strip()} {out.stdout[-400:]}")
        report = json.loads(out.stdout)
        api(src, "PUT", "vm.shutdown")
        size = os.path.getsize(path)
        dst = os.path.join(self.work, f"restore-{time.time_ns()}.sock")
        started = time.monotonic()
        self.procs.start([FERRY, "run", "--restore", path, "--api-socket", dst, "--serial", "/dev/null"],
                         stderr=open(os.path.join(self.work, "dst.err"), "ab"))
        wait_until("the restored VM", 120,
                   lambda: os.path.exists(dst) and self.info(dst)["state"] == "running", interval=0.002)
        restore_ms = (time.monotonic() - started) * 1e3
        # One whole pass after the restore: every page of the set read back and checked.
        passes = all_passed(self.info(dst))
        wait_until("a pass after the restore", scenario.get("ready_s", 120),
                   lambda: all_passed(self.info(dst)) > passes)
        dinfo = self.info(dst)
        api(dst, "PUT", "vm.shutdown")
        os.unlink(path)
        compression = report.get("compression") or {}
        return {"peer": self.name, "total_ms": report["total_ms"], "bytes": size,
                "gb_per_s": size / report["total_ms"] / 1e6 if report["total_ms"] else None,
                "restore_ms": restore_ms, "connections": report.get("connections"),
                "migration_threads": report.get("migration_threads"), "compression": compression,
                "pages_full": report["pages_full"], "pages_zero": report["pages_zero"],
                "verify_errors_after": dinfo["verify_errors"]}

    def local_once(self, scenario):
        """One live update in place (`ferry migrate --local`): the VM, its memory a memfd
        (`--memory-backend memfd`), handed over a Unix socket to a new `ferry run --incoming
        unix:PATH` given nothing else (memory and device files pass with SCM_RIGHTS, no page
        is copied). Measured as a migration is: the total on the destination's clock, ferry's
        own beside it, the downtime on each side's clock and in the guest's heartbeats, the
        console gap, the bytes of the messages on the socket; then a writer's pass verified on
        the destination, and the old process's exit. Both processes in this namespace: a Unix
        socket needs no link."""
        src_clock, dst_clock = SerialClock(), SerialClock()
        src_serial = os.path.join(self.work, f"s{time.time_ns()}.fifo")
        dst_serial = os.path.join(self.work, f"d{time.time_ns()}.fifo")
        src_clock.follow_fifo(src_serial)
        dst_clock.follow_fifo(dst_serial)
        src = self.boot(scenario["memory"], scenario["vcpus"], scenario["cmdline"], serial=src_serial,
                        image=guest_image(scenario),
                        devices=["--memory-backend", "memfd", *scenario.get("ferry_args", [])])
        src_proc = self.source_proc
        ready_s = self.ready(src, scenario, src_clock)
        path = os.path.join(self.work, f"update-{time.time_ns()}.sock")
        dst = os.path.join(self.work, f"dst-{time.time_ns()}.sock")
        # No --memory, --vcpus or --disk: the VM brings them.
        self.procs.start([FERRY, "run", "--incoming", f"unix:{path}", "--api-socket", dst,
                          "--serial", dst_serial], side="destination",
                         stderr=open(os.path.join(self.work, "dst.err"), "ab"))
        wait_until("the ferry destination API", 30, lambda: os.path.exists(dst) and os.path.exists(path))
        argv = [FERRY, "migrate", "--api-socket", src, "--to", f"unix:{path}", "--local", "--json",
                *scenario.get("extra", [])]
        started = time.time()
        out = subprocess.run(argv, capture_output=True, text=True, timeout=600)
        if out.returncode != 0:
            raise BenchError(f"ferry migrate --local failed: {out.stderr.strip()} {out.stdout[-400:]}")
        report = json.loads(out.stdout)
        try:
            source_exit = src_proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            source_exit = None  # still running: recorded as such
        dst_status = settled_migration(dst)
        dinfo = self.info(dst)
        # A writer that checks its pages: one whole pass on the destination, every page of the
        # set read back and checked in the memory the new process mapped.
        if " verify" in f" {scenario['cmdline']}":
            passes = all_passed(dinfo)
            wait_until("a pass after the update", scenario.get("ready_s", 120),
                       lambda: all_passed(self.info(dst)) > passes)
            dinfo = self.info(dst)
        api(dst, "PUT", "vm.shutdown")
        return {
            "peer": self.name,
            "mode": report.get("mode"),
            # The destination's clock: from the request to the VM needing nothing more from
            # the source; ferry's own figure (its source's clock) beside it.
            "total_ms": (dst_status["completed_at_unix_ns"] / 1e9 - started) * 1e3,
            "total_ms_reported": report["total_ms"],
            "wire_bytes": None,  # no link: the bytes are the messages on the Unix socket
            "downtime_ms": report["downtime_ms"],
            "destination_downtime_ms": report.get("destination_downtime_ms"),
            "guest_downtime_ms": dst_status["guest_observed_downtime_ms"],
            "serial_downtime_ms": observed_downtime_ms(src_clock, dst_clock, started),
            "ready_s": ready_s,
            "bytes": report["bytes_on_wire"],
            "must_move_bytes": None,
            "rounds": len(report["rounds"]),
            "round_table": report["rounds"],
            "pages_full": report["pages_full"],
            "pages_zero": report["pages_zero"],
            "pages_transferred": report["pages_full"] + report["pages_zero"],
            "verify_errors_after": dinfo["verify_errors"],
            "passes_after": all_passed(dinfo),
            "source_exit": source_exit,
            "breakdown_source": report.get("breakdown"),
            "breakdown_destination": dst_status.get("breakdown"),
        }

    def migrate_once(self, scenario, link):
        """One migration; returns a result row."""
        if scenario["mode"] == "snapshot":
            return self.snapshot_once(scenario)
        if scenario["mode"] == "local":
            return self.local_once(scenario)
        src_clock, dst_clock = SerialClock(), SerialClock()
        src_serial = os.path.join(self.work, f"s{time.time_ns()}.fifo")
        dst_serial = os.path.join(self.work, f"d{time.time_ns()}.fifo")
        src_clock.follow_fifo(src_serial)
        dst_clock.follow_fifo(dst_serial)
        # TLS (the default a user gets) or plain TCP (`--plain-tcp`, what the other rows use).
        tls = scenario.get("tls")
        # Devices both sides are given (as a destination is given the source's disks).
        devices = scenario.get("ferry_args", [])
        src = self.boot(scenario["memory"], scenario["vcpus"], scenario["cmdline"], image=guest_image(scenario),
                        netns=link.ns_src, serial=src_serial,
                        transport=self.tls_args("source.local") if tls else ("--plain-tcp",),
                        devices=devices)
        ready_s = self.ready(src, scenario, src_clock)
        # The balloon profile: the guest settled (DSB took its free memory), its work rate.
        settled = balloon.settle(src_clock, scenario)
        if settled:
            settled["balloon_device_before"] = self.info(src).get("balloon")
        port = free_port()
        dst = os.path.join(self.work, f"dst-{time.time_ns()}.sock")
        transport = self.tls_args(link.dst_host) if tls else ["--plain-tcp"]
        # Started with the VM's shape, as QEMU's destination is: building it is not part of
        # the move for either VMM.
        dst_proc = self.procs.start([FERRY, "run", "--incoming", f"tcp:{link.dst_host}:{port}",
                                     *shape_args(scenario), *devices,
                                     "--api-socket", dst, "--serial", dst_serial, *transport],
                                    netns=link.ns_dst, side="destination",
                                    stderr=open(os.path.join(self.work, "dst.err"), "ab"))
        wait_until("the ferry destination API", 30, lambda: os.path.exists(dst))
        flags = self.flags if scenario["mode"] == "precopy" else []
        mode = flags[flags.index("--mode") + 1] if "--mode" in flags else scenario["mode"]
        flags = [f for i, f in enumerate(flags) if "--mode" not in flags[max(0, i - 1):i + 1]]
        to = f"tcp:{link.dst_host}:{port}"
        # The resume profile: through a relay that cuts or stalls the link at a set point.
        relay = scenario.get("relay")
        cutter = Cutter(self.procs, self.work, link, port, relay["fault"], relay["at_percent"],
                        relay["stall_s"]) if relay else None
        if cutter:
            to = cutter.url
        argv = [FERRY, "migrate", "--api-socket", src, "--to", to,
                "--mode", mode, "--max-downtime-ms", str(scenario["max_downtime_ms"]),
                "--timeout-s", str(scenario["timeout_s"]), "--json"]
        if scenario.get("prepaging"):
            argv += ["--prepaging", scenario["prepaging"]]
        argv += scenario.get("extra", []) + flags
        meter = CpuMeter(self.source_pid, dst_proc.pid) if scenario.get("cpu") else None
        watch = stall.scenario_watch(scenario, self.source_pid, dst_proc.pid)
        wire_before = link.wire_bytes()
        started = time.time()
        out = subprocess.run(argv, capture_output=True, text=True, timeout=600)
        wire = link.wire_bytes() - wire_before
        if out.returncode != 0:
            if watch:
                watch.stop()
            seen = cutter.said() if cutter else ""
            raise BenchError(f"ferry migrate failed{seen}: {out.stderr.strip()} {out.stdout[-400:]}")
        # A successful source exits: its CPU is read from its exit.
        cpu = meter.seconds(src_exits=True) if meter else None
        report = json.loads(out.stdout)
        dst_status = settled_migration(dst)
        dinfo = self.info(dst)
        resumed = self.resume_row(scenario, report, cutter, dst, dinfo, started) if cutter else {}
        if resumed:
            dinfo = self.info(dst)
        taken = dst_status.get("checkpoints") or {}
        api(dst, "PUT", "vm.shutdown")
        applied = report.get("checkpoints") or {}
        round0 = report["rounds"][0] if report["rounds"] else {}
        compression = report.get("compression") or {}
        compressed = compression.get("asked", "none") != "none"
        pc = report.get("postcopy_report") or {}
        sent_after = report.get("pages_pushed", 0) + report.get("pages_requested", 0)
        return {
            "peer": self.name,
            # The destination's clock: from the request to the VM needing nothing more from
            # the source; ferry's own figure (its source's clock) beside it.
            "total_ms": (dst_status["completed_at_unix_ns"] / 1e9 - started) * 1e3,
            "total_ms_reported": report["total_ms"],
            "wire_bytes": wire,
            "downtime_ms": report["downtime_ms"],
            "destination_downtime_ms": report.get("destination_downtime_ms"),
            "guest_downtime_ms": dst_status["guest_observed_downtime_ms"],
            "serial_downtime_ms": observed_downtime_ms(src_clock, dst_clock, started),
            "ready_s": ready_s,  # from the source API up until the writer had passed its working set
            "bytes": report["bytes_on_wire"],
            "gb_per_s": report["bytes_on_wire"] / report["total_ms"] / 1e6 if report["total_ms"] else None,
            # The floor's bytes: round 0's pages that hold data (compressed: what it put on the wire).
            "must_move_bytes": round0.get("bytes", 0) if compressed else
            round0.get("pages", 0) * 4096 - round0.get("zero_pages", 0) * 4096,
            "compression": compression,
            "connections": report.get("connections"),
            "tls": bool(tls),
            "rounds": len(report["rounds"]),
            "round_table": report["rounds"],
            "pages_full": report["pages_full"],
            "pages_zero": report["pages_zero"],
            "pages_skipped": report["pages_skipped_unpopulated"],
            # Of those, the pages the guest had given back (its balloon's, or reported free).
            "pages_skipped_free": report.get("pages_skipped_free"),
            "pages_resent": report["pages_resent"],
            "converged": report["converged"],
            "verify_errors_after": dinfo["verify_errors"],
            "rate_before": report["guest_pages_per_s_before"],
            "rate_during": report["guest_pages_per_s_during"],
            "rate_after": dst_status["guest_pages_per_s_after"],
            "postcopy": report.get("postcopy", False),
            "pages_pushed": report.get("pages_pushed"),
            "pages_requested": report.get("pages_requested"),
            "pages_pushed_on_lanes": report.get("pages_pushed_on_lanes"),
            "network_faults": pc.get("network_faults"),
            "zero_faults": pc.get("zero_faults"),
            "network_fault_share": (pc["network_faults"] / sent_after) if pc and sent_after else None,
            "fault_latency_p50_ms": pc.get("fault_latency_p50_ms"),
            "fault_latency_p99_ms": pc.get("fault_latency_p99_ms"),
            "fault_latency_max_ms": pc.get("fault_latency_max_ms"),
            "resume_ms": pc.get("resume_ms"),
            "duplicates": pc.get("duplicates"),
            "timeline_10ms": pc.get("timeline_10ms"),
            "pages_transferred": report["pages_full"] + report["pages_zero"],
            # Post-copy checkpoints: applied on the source; the guest's pauses to take them.
            "checkpoint_count": applied.get("count"),
            "checkpoint_mb_back": applied["bytes"] / 1e6 if applied else None,
            "checkpoint_pages_back": applied.get("pages"),
            "checkpoint_pause_ms_mean": (taken["pause_ms_total"] / taken["count"])
            if taken.get("count") else None,
            "checkpoint_pause_ms_max": taken.get("pause_ms_max"),
            # Each side's CPU by the work its threads did (send, pack, receive, prefault).
            "cpu_by_work_source": report.get("cpu"),
            "cpu_by_work_destination": dst_status.get("cpu"),
            # Where each side's time went, stretch by stretch on its own clock.
            "breakdown_source": report.get("breakdown"),
            "breakdown_destination": dst_status.get("breakdown"),
            **cpu_row(cpu, scenario, meter and meter.guest_until(dst_status["completed_at_unix_ns"] / 1e9)),
            **balloon.row(settled, wire, dst_clock),
            **resumed,
            **stall.figures(watch, dst_status["resumed_at_unix_ns"] / 1e9),
        }

    def resume_row(self, scenario, report, cutter, dst, dinfo, started):
        """The resume profile's fields: what the report says of the break (`resumes`, the pages
        sent again), the relay's count of what crossed it, the checksums, and what a writer that
        checks its pages found wrong in one whole pass on the destination."""
        stats = cutter.stats()
        if " verify" in f" {scenario['cmdline']}":
            passes = all_passed(dinfo)
            wait_until("a pass on the destination", scenario.get("ready_s", 120),
                       lambda: all_passed(self.info(dst)) > passes)
        memory_pages = report["memory_pages"]
        src_sum, dst_sum = report.get("memory_checksum_source"), report.get("memory_checksum_destination")
        return {
            "resumes": report.get("resumes"),
            "pages_sent_again": report.get("pages_sent_again"),
            "memory_pages": memory_pages,
            "memory_bytes": memory_pages * 4096,
            "sent_again_share": (report["pages_sent_again"] / memory_pages
                                 if memory_pages and report.get("pages_sent_again") is not None else None),
            "memory_checksum_source": src_sum,
            "memory_checksum_destination": dst_sum,
            "checksums_equal": src_sum == dst_sum if src_sum is not None else None,
            "note": report.get("note"),
            "phase": report.get("phase"),
            **cutter.row(stats, started),
        }

    def boot_metrics(self, memory):
        """Time from `ferry run` to the first heartbeat, and the heartbeat rate after it."""
        t0 = time.time()
        sock = os.path.join(self.work, f"boot-{time.time_ns()}.sock")
        p = self.procs.start([FERRY, "run", "--guest", GUEST, "--memory", memory, "--cmdline", "idle",
                              "--api-socket", sock, "--serial", "/dev/null"])  # boot time only
        wait_until("the API", 30, lambda: os.path.exists(sock), interval=0.001)
        first = wait_until("a heartbeat", 30, lambda: self.info(sock)["heartbeats"] > 0, interval=0.001)
        t_first = time.time() - t0
        a = self.info(sock)
        time.sleep(1.0)
        b = self.info(sock)
        api(sock, "PUT", "vm.shutdown")
        p.wait(timeout=30)
        return {"memory": memory, "first_heartbeat_ms": t_first * 1e3,
                "heartbeats_per_s": (b["heartbeats"] - a["heartbeats"]) / 1.0, "ok": bool(first)}

    def dirty_logging_cost(self, ws="256M", seconds=2.0):
        """Guest page-touch rate without and with KVM dirty logging (harvested every 100 ms)."""
        sock = self.boot("1G", 1, f"write ws={ws} seq")
        wait_until("progress", 30, lambda: self.info(sock)["passes"] >= 1)

        def rate():
            a = self.info(sock)
            t = time.time()
            time.sleep(seconds)
            b = self.info(sock)
            return (b["pages_touched"] - a["pages_touched"]) / (time.time() - t)

        off = rate()
        api(sock, "PUT", "vm.debug-dirty-logging", {"enabled": True, "harvest_ms": 100})
        on = rate()
        api(sock, "PUT", "vm.debug-dirty-logging", {"enabled": False})
        api(sock, "PUT", "vm.shutdown")
        return {"pages_per_s_without": off, "pages_per_s_with": on, "ratio": on / off if off else None}
