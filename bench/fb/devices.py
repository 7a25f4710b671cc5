"""The forwarding VM across a move (the OPNFV scenario), on ferry and on QEMU.

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
guest on the same bed. Everything is removed when a run ends, failed or not."""
import json
import os
import subprocess
import time

from .ferry import api
from .links import shape, sh
from .qemu import QEMU, QemuPeer, passes
from .serial import SerialClock
from .util import FERRY, GUEST, BenchError, wait_until

NETGEN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "netgen.py")
VM_MAC = "52:54:00:00:00:01"
CMDLINE = "write ws=16M seq net=fwd"
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
        start = {"ferry": FerryForwarder, "qemu": QemuForwarder}[vmm](procs, work, bed)
        gen = procs.start(["python3", NETGEN, "gen", VM_MAC, str(rate), str(seconds)],
                          netns=bed.switch, stdout=subprocess.PIPE, text=True)
        time.sleep(warmup_s)
        moved = start.migrate(mode) if mode else {}
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


class FerryForwarder:
    def __init__(self, procs, work, bed):
        self.procs, self.work, self.bed = procs, work, bed
        self.src = os.path.join(work, f"fsrc-{time.time_ns()}.sock")
        procs.start([FERRY, "run", "--guest", GUEST, "--memory", MEMORY, "--cmdline", CMDLINE,
                     "--net", f"tap=tap0,mac={VM_MAC}", "--api-socket", self.src,
                     "--serial", "/dev/null", "--plain-tcp"],
                    netns=bed.hosts[0], stderr=open(os.path.join(work, "fsrc.err"), "ab"))
        wait_until("the forwarder's API", 30, lambda: os.path.exists(self.src))
        wait_until("the forwarder's first pass", 60, lambda: api(self.src, "GET", "vm.info")["passes"] >= 1)

    def migrate(self, mode):
        dst = os.path.join(self.work, f"fdst-{time.time_ns()}.sock")
        url = f"tcp:{self.bed.address(1)}:{MIGRATION_PORT}"
        self.procs.start([FERRY, "run", "--incoming", url, "--net", "tap=tap0",
                          "--api-socket", dst, "--serial", "/dev/null", "--plain-tcp"],
                         netns=self.bed.hosts[1], stderr=open(os.path.join(self.work, "fdst.err"), "ab"))
        wait_until("the destination's API", 30, lambda: os.path.exists(dst))
        out = subprocess.run([FERRY, "migrate", "--api-socket", self.src, "--to", url, "--mode", mode,
                              "--max-downtime-ms", str(MAX_DOWNTIME_MS), "--json"],
                             capture_output=True, text=True, timeout=120)
        if out.returncode != 0:
            raise BenchError(f"ferry migrate failed: {out.stderr.strip()}")
        report = json.loads(out.stdout)
        guest = api(dst, "GET", "vm.info")
        return {"downtime_ms": report.get("downtime_ms"),
                "guest_downtime_ms": report.get("guest_observed_downtime_ms"),
                "total_ms": report.get("total_ms"),
                "guest_net_errors": guest.get("net_errors"),
                "verify_errors": guest.get("verify_errors")}


class QemuForwarder:
    """QEMU's microvm machine without ACPI (so that it names its virtio-mmio devices on the
    command line), modern virtio-mmio, virtio-net on the host's tap; QEMU's self-announce as it
    comes (5 RARPs, 50 ms then 100 ms apart)."""

    def __init__(self, procs, work, bed):
        self.bed = bed
        self.peer = QemuPeer(procs, work, "qemu")
        self.scenario = {"memory": MEMORY, "vcpus": 1, "cmdline": CMDLINE,
                         "max_downtime_ms": MAX_DOWNTIME_MS, "timeout_s": 60}
        clock = SerialClock()
        self.src = self.peer.start("fsrc", self.scenario, clock, bed.hosts[0], machine="microvm,acpi=off",
                                   extra=self.NIC)
        wait_until("the forwarder's first pass", 60, lambda: passes(clock) >= 1)

    NIC = ["-global", "virtio-mmio.force-legacy=false",
           "-netdev", "tap,id=n0,ifname=tap0,script=no,downscript=no",
           "-device", f"virtio-net-device,netdev=n0,mac={VM_MAC}"]

    def migrate(self, mode):
        scenario = dict(self.scenario, mode=mode)
        url = f"tcp:{self.bed.address(1)}:{MIGRATION_PORT}"
        dst = self.peer.start("fdst", scenario, SerialClock(), self.bed.hosts[1], incoming=url,
                              machine="microvm,acpi=off", extra=self.NIC)
        self.peer.configure(self.src, scenario)
        self.peer.configure(dst, scenario)
        info = self.peer.migrate(self.src, scenario, url)
        return {"downtime_ms": info.get("downtime"), "guest_downtime_ms": None,
                "total_ms": info.get("total-time"), "guest_net_errors": None, "verify_errors": None}

