"""Devices across a move, on ferry and on QEMU: the forwarding VM (the OPNFV scenario) and
the disk writer.

The test bed is two hosts and a switch, each a network namespace of its own:
- the switch: a Linux bridge (the learning switch), the traffic generator's veth on it, and one
  port per host;
- each host: a bridge holding the VM's tap and the host's uplink (a veth to its switch port),
  and the host's address (10.77.0.1, 10.77.0.2), which the migration stream uses — so the VM's
  frames and its migration cross the same switch;
- every veth end shaped to the link speed with tc.

The workload guest forwards frames (`net=fwd`: receive, swap the MACs, send back) on a
virtio-net NIC on host 0's tap and moves to host 1 while the generator (`netgen.py`, in the
switch) sends sequence-numbered frames at a fixed rate. ferry and QEMU (the `microvm` machine,
whose virtio-mmio devices the guest finds on its command line as it does ferry's) run the same
guest on the same bed.

The disk writer (`blk`: stamp sectors, read each back and check it) runs on a disk file both
VMMs of a move open (shared storage), and moves over loopback; the host watches the file
(inotify) and the longest time between two writes reaching it is the I/O completion gap the
move caused. Everything is removed when a run ends, failed or not."""
import ctypes
import json
import os
import struct
import subprocess
import threading
import time

from .ferry import api, settled_migration
from .links import shape, sh
from .qemu import VARIANTS as QEMU_VARIANTS, QemuPeer, passes
from .serial import SerialClock
from .util import FERRY, GUEST, BenchError, free_port, wait_until

NETGEN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "netgen.py")
VM_MAC = "52:54:00:00:00:01"
CMDLINE = "write ws=16M seq net=fwd"
BLK_SECTORS = 2048
BLK_CMDLINE = f"write ws=16M seq blk blk_sectors={BLK_SECTORS}"
MEMORY = "256M"
MIGRATION_PORT = 4444
# Both VMMs: the same downtime limit (ferry's default, and QEMU's), no bandwidth cap.
MAX_DOWNTIME_MS = 300


class SwitchedBed:
    """Two hosts and a switch (see the module's docstring); `speed` is a links.SPEEDS key."""

    def __init__(self, tag, speed="1gbit", hosts=2):
        self.switch = f"fsw-{tag}"
        self.hosts = [f"fh{i}-{tag}" for i in range(hosts)]
        self.created = []
        try:
            for ns in [self.switch] + self.hosts:
                subprocess.run(["ip", "netns", "del", ns], capture_output=True)
                sh("ip", "netns", "add", ns)
                self.created.append(ns)
                sh("ip", "-n", ns, "link", "add", "br0", "type", "bridge")
                sh("ip", "-n", ns, "link", "set", "br0", "up")
            sw = ["ip", "-n", self.switch]
            sh(*sw, "link", "add", "gen", "type", "veth", "peer", "name", "genb")
            sh(*sw, "link", "set", "genb", "master", "br0", "up")
            sh(*sw, "link", "set", "gen", "up")
            for i, host in enumerate(self.hosts):
                h = ["ip", "-n", host]
                sh(*sw, "link", "add", f"p{i}", "type", "veth", "peer", "name", "uplink", "netns", host)
                sh(*sw, "link", "set", f"p{i}", "master", "br0", "up")
                sh(*h, "link", "set", "uplink", "master", "br0", "up")
                sh(*h, "tuntap", "add", "tap0", "mode", "tap")
                sh(*h, "link", "set", "tap0", "master", "br0", "up")
                sh(*h, "addr", "add", f"{self.address(i)}/24", "dev", "br0")
                sh(*h, "link", "set", "lo", "up")
                shape(self.switch, f"p{i}", speed)
                shape(host, "uplink", speed)
        except BaseException:
            self.close()
            raise

    @staticmethod
    def address(host):
        return f"10.77.0.{host + 1}"

    def port_of(self, mac):
        """The switch port the bridge sends `mac` to now (p0, p1), or None."""
        out = subprocess.run(["bridge", "-n", self.switch, "fdb", "show", "br", "br0"],
                             capture_output=True, text=True).stdout
        return next((line.split()[2] for line in out.splitlines() if line.startswith(mac)), None)

    def close(self):
        for ns in self.created:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self.created.clear()


def forwarding_run(procs, work, vmm, mode, rate, speed="1gbit", seconds=6.0, warmup_s=2.0):
    """One run on `vmm` (ferry or qemu): `mode` is a migration mode, or None to measure
    forwarding without a move."""
    bed = SwitchedBed(f"{os.getpid() % 100000}", speed)
    try:
        nic = NIC[vmm]
        vm = VMS[vmm](procs, work, bed.hosts[0], CMDLINE, nic(VM_MAC))
        gen = procs.start(["python3", NETGEN, "gen", VM_MAC, str(rate), str(seconds)],
                          netns=bed.switch, stdout=subprocess.PIPE, text=True)
        time.sleep(warmup_s)
        moved = vm.migrate(mode, bed.hosts[1], bed.address(1), nic(None)) if mode else {}
        said, _ = gen.communicate(timeout=seconds + 60)
        traffic = json.loads(said.strip().splitlines()[-1])
        port = bed.port_of(VM_MAC)
        if mode and port != "p1":
            raise BenchError(f"after the move the switch sends the VM's frames to {port}, not p1")
        return {"vmm": vmm, "mode": mode or "none", "rate": rate, "speed": speed, **traffic,
                **moved, "port_after": port}
    finally:
        procs.stop_all()
        bed.close()


def block_run(procs, work, vmm, mode, before_s=2.0, after_s=2.0):
    """One disk-writer run on `vmm`: the move (`mode`, over loopback, both VMMs on one disk
    file; None: no move) `before_s` into the watch; the watch goes on `after_s` after it. Then
    every sector is read back once more where the VM runs, and must carry its last stamp."""
    disk = os.path.join(work, f"disk-{time.time_ns()}.img")
    with open(disk, "wb") as f:
        f.truncate(16 << 20)
    try:
        drive = DISK[vmm](disk)
        vm = VMS[vmm](procs, work, None, BLK_CMDLINE, drive)
        wait_until("the first disk writes", 60, lambda: vm.counter("blk_writes") > BLK_SECTORS)
        with WriteWatch(disk) as watch:
            time.sleep(before_s)
            moved = vm.migrate(mode, None, "127.0.0.1", drive) if mode else {}
            time.sleep(after_s)
        reads = vm.counter("blk_reads")
        wait_until("every sector read back on the destination", 60,
                   lambda: vm.counter("blk_reads") > reads + BLK_SECTORS)
        return {"vmm": vmm, "mode": mode or "none", "writes_seen": len(watch.times),
                "longest_write_gap_ms": watch.longest_gap_ms(), "blk_errors": vm.counter("blk_errors"),
                **moved}
    finally:
        procs.stop_all()
        os.unlink(disk)


class WriteWatch:
    """Host times of the writes reaching a file (inotify IN_MODIFY, from whatever process).
    inotify merges identical events that wait unread, so `times` holds the watcher's wake-ups
    with writes, not every write: right for the longest gap, not a write count."""
    IN_MODIFY = 0x2

    def __init__(self, path):
        self.libc = ctypes.CDLL(None, use_errno=True)
        self.fd = self.libc.inotify_init1(os.O_NONBLOCK)
        if self.fd < 0 or self.libc.inotify_add_watch(self.fd, path.encode(), self.IN_MODIFY) < 0:
            raise BenchError(f"inotify on {path}: errno {ctypes.get_errno()}")
        self.times = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        import select
        poller = select.poll()
        poller.register(self.fd, select.POLLIN)
        while not self.stop.is_set():
            if not poller.poll(50):
                continue
            now = time.monotonic()
            data = os.read(self.fd, 65536)
            at = 0
            while at + 16 <= len(data):  # struct inotify_event: wd, mask, cookie, len, name
                name_len = struct.unpack_from("iIII", data, at)[3]
                self.times.append(now)
                at += 16 + name_len

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()
        os.close(self.fd)

    def longest_gap_ms(self):
        gaps = [b - a for a, b in zip(self.times, self.times[1:])]
        return max(gaps) * 1e3 if gaps else None


class FerryVm:
    """A ferry running the workload guest in `netns`, with `devices` (ferry run arguments)."""

    def __init__(self, procs, work, netns, cmdline, devices):
        self.procs, self.work = procs, work
        self.api = os.path.join(work, f"vsrc-{time.time_ns()}.sock")
        procs.start([FERRY, "run", "--guest", GUEST, "--memory", MEMORY, "--cmdline", cmdline,
                     *devices, "--api-socket", self.api, "--serial", "/dev/null", "--plain-tcp"],
                    netns=netns, stderr=open(os.path.join(work, "vsrc.err"), "ab"))
        wait_until("the VM's API", 30, lambda: os.path.exists(self.api))
        wait_until("the guest's first pass", 60, lambda: self.counter("passes") >= 1)

    def counter(self, name):
        return api(self.api, "GET", "vm.info")[name]

    def migrate(self, mode, netns, host, devices):
        """Moves the VM to a ferry in `netns` listening on `host` with `devices`."""
        dst = os.path.join(self.work, f"vdst-{time.time_ns()}.sock")
        url = f"tcp:{host}:{free_port() if netns is None else MIGRATION_PORT}"
        self.procs.start([FERRY, "run", "--incoming", url, *devices, "--api-socket", dst,
                          "--serial", "/dev/null", "--plain-tcp"],
                         netns=netns, stderr=open(os.path.join(self.work, "vdst.err"), "ab"))
        wait_until("the destination's API", 30, lambda: os.path.exists(dst))
        out = subprocess.run([FERRY, "migrate", "--api-socket", self.api, "--to", url, "--mode", mode,
                              "--max-downtime-ms", str(MAX_DOWNTIME_MS), "--json"],
                             capture_output=True, text=True, timeout=120)
        if out.returncode != 0:
            raise BenchError(f"ferry migrate failed: {out.stderr.strip()}")
        report = json.loads(out.stdout)
        self.api = dst
        return {"downtime_ms": report.get("downtime_ms"),
                "guest_downtime_ms": settled_migration(dst).get("guest_observed_downtime_ms"),
                "total_ms": report.get("total_ms"),
                "guest_net_errors": self.counter("net_errors"),
                "verify_errors": self.counter("verify_errors")}


class QemuVm:
    """QEMU's microvm machine without ACPI (so that it names its virtio-mmio devices on the
    command line), modern virtio-mmio, running the workload guest with `devices` (QEMU
    arguments); NICs announce themselves as QEMU does by default (5 RARPs, 50 ms then 100 ms
    apart)."""
    MACHINE = "microvm,acpi=off"

    def __init__(self, procs, work, netns, cmdline, devices):
        self.peer = QemuPeer(procs, work, "qemu")
        self.scenario = {"memory": MEMORY, "vcpus": 1, "cmdline": cmdline,
                         "max_downtime_ms": MAX_DOWNTIME_MS, "timeout_s": 60}
        self.clock = SerialClock()
        self.qmp = self.peer.start("vsrc", self.scenario, self.clock, netns, machine=self.MACHINE,
                                   extra=["-global", "virtio-mmio.force-legacy=false", *devices])
        wait_until("the guest's first pass", 60, lambda: passes(self.clock) >= 1)

    def counter(self, name):
        """A counter from the guest's latest serial progress line (0 before there is one)."""
        return self.clock.counter(name)

    def migrate(self, mode, netns, host, devices):
        scenario = dict(self.scenario, mode=mode)
        url = f"tcp:{host}:{free_port() if netns is None else MIGRATION_PORT}"
        clock = SerialClock()
        dst = self.peer.start("vdst", scenario, clock, netns, incoming=url, machine=self.MACHINE,
                              extra=["-global", "virtio-mmio.force-legacy=false", *devices])
        spec = QEMU_VARIANTS[self.peer.variant]
        self.peer.configure(self.qmp, scenario, spec)
        self.peer.configure(dst, scenario, spec)
        info = self.peer.migrate(self.qmp, scenario, spec, url)
        self.qmp, self.clock = dst, clock
        return {"downtime_ms": info.get("downtime"), "guest_downtime_ms": None,
                "total_ms": info.get("total-time"), "guest_net_errors": None, "verify_errors": None}


VMS = {"ferry": FerryVm, "qemu": QemuVm}
# A NIC on the host's tap0 (with the VM's MAC, or None: the one the VM brings).
NIC = {
    "ferry": lambda mac: ["--net", f"tap=tap0,mac={mac}" if mac else "tap=tap0"],
    "qemu": lambda mac: ["-netdev", "tap,id=n0,ifname=tap0,script=no,downscript=no",
                         "-device", f"virtio-net-device,netdev=n0,mac={mac or VM_MAC}"],
}
DISK = {
    "ferry": lambda path: ["--disk", f"path={path}"],
    "qemu": lambda path: ["-drive", f"file={path},format=raw,if=none,id=d0",
                          "-device", "virtio-blk-device,drive=d0"],
}
