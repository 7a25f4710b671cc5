"""The forwarding VM across a move (the OPNFV scenario, on ferry): a network namespace holds a
Linux bridge, two taps on it and a veth whose far end carries the traffic generator
(`netgen.py`); the workload guest forwards frames (`net=fwd`: receive, swap the MACs, send
back) on a virtio-net NIC on the first tap, and moves to a ferry on the second while the
generator sends at a fixed rate. Everything is removed when a run ends, failed or not."""
import json
import os
import subprocess
import time

from .ferry import api
from .util import FERRY, GUEST, BenchError, wait_until

NETGEN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "netgen.py")
VM_MAC = "52:54:00:00:00:01"


def sh(*argv):
    out = subprocess.run(argv, capture_output=True, text=True)
    if out.returncode != 0:
        raise BenchError(f"{' '.join(argv)}: {out.stderr.strip()}")


class ForwardingBed:
    def __init__(self, tag):
        self.ns = f"ferry-fwd-{tag}"
        subprocess.run(["ip", "netns", "del", self.ns], capture_output=True)
        sh("ip", "netns", "add", self.ns)
        n = ["ip", "-n", self.ns]
        sh(*n, "link", "add", "br0", "type", "bridge")
        sh(*n, "link", "set", "br0", "up")
        for tap in ("tap0", "tap1"):
            sh(*n, "tuntap", "add", tap, "mode", "tap")
            sh(*n, "link", "set", tap, "master", "br0", "up")
        sh(*n, "link", "add", "gen", "type", "veth", "peer", "name", "genb")
        sh(*n, "link", "set", "genb", "master", "br0", "up")
        sh(*n, "link", "set", "gen", "up")

    def close(self):
        subprocess.run(["ip", "netns", "del", self.ns], capture_output=True)


def forwarding_run(procs, work, mode, rate, seconds=6.0, warmup_s=2.0):
    """One run: `mode` is a migration mode, or None to measure forwarding without a move."""
    bed = ForwardingBed(f"{os.getpid() % 100000}")
    try:
        src = os.path.join(work, f"fsrc-{time.time_ns()}.sock")
        procs.start([FERRY, "run", "--guest", GUEST, "--memory", "256M",
                     "--cmdline", "write ws=16M seq net=fwd", "--net", f"tap=tap0,mac={VM_MAC}",
                     "--api-socket", src, "--serial", "/dev/null", "--plain-tcp"],
                    netns=bed.ns, stderr=open(os.path.join(work, "fsrc.err"), "ab"))
        wait_until("the forwarder's API", 30, lambda: os.path.exists(src))
        wait_until("the forwarder's first pass", 60, lambda: api(src, "GET", "vm.info")["passes"] >= 1)
        dst = os.path.join(work, f"fdst-{time.time_ns()}.sock")
        url = f"unix:{os.path.join(work, f'fmig-{time.time_ns()}.sock')}"
        if mode:
            procs.start([FERRY, "run", "--incoming", url, "--net", "tap=tap1",
                         "--api-socket", dst, "--serial", "/dev/null", "--plain-tcp"],
                        netns=bed.ns, stderr=open(os.path.join(work, "fdst.err"), "ab"))
            wait_until("the destination's API", 30, lambda: os.path.exists(dst))
        gen = procs.start(["python3", NETGEN, "gen", VM_MAC, str(rate), str(seconds)],
                          netns=bed.ns, stdout=subprocess.PIPE, text=True)
        time.sleep(warmup_s)
        report = {}
        if mode:
            out = subprocess.run([FERRY, "migrate", "--api-socket", src, "--to", url,
                                  "--mode", mode, "--json"], capture_output=True, text=True,
                                 timeout=120)
            if out.returncode != 0:
                raise BenchError(f"ferry migrate failed: {out.stderr.strip()}")
            report = json.loads(out.stdout)
        said, _ = gen.communicate(timeout=seconds + 60)
        traffic = json.loads(said.strip().splitlines()[-1])
        guest = api(dst if mode else src, "GET", "vm.info")
        return {"mode": mode or "none", "rate": rate, **traffic,
                "downtime_ms": report.get("downtime_ms"),
                "guest_downtime_ms": report.get("guest_observed_downtime_ms"),
                "total_ms": report.get("total_ms"),
                "guest_net_errors": guest.get("net_errors"),
                "verify_errors": guest.get("verify_errors")}
    finally:
        procs.stop_all()
        bed.close()
