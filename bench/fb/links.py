"""The link between the two VMMs: loopback, or two network namespaces' worth of veth shaped
with tc. Everything created here is removed in `close`, even when the scenario failed."""
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time

from .util import FRESH_MEMORY, BenchError

ADDR_SRC = "169.254.77.1"
ADDR_DST = "169.254.77.2"


def sh(*argv, check=True):
    r = subprocess.run(argv, capture_output=True, text=True)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {r.stderr.strip()}")
    return r


# tbf's rate and burst per link speed.
SPEEDS = {"1gbit": ("1gbit", "256kb"), "10gbit": ("10gbit", "2mb")}


def shape(ns, dev, speed):
    """Shapes what `dev` (in namespace `ns`) sends to `speed`."""
    rate, burst = SPEEDS[speed]
    sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate,
       "burst", burst, "latency", "50ms")


def parse(name):
    """A link's name: loopback, 1gbit or 10gbit, or a WAN-like one such as 1gbit+10ms (that
    speed, each direction 10 ms late). Returns (speed, delay_ms)."""
    speed, _, delay = name.partition("+")
    delay_ms = 0
    if speed != "loopback" and speed not in SPEEDS:
        raise BenchError(f"unknown link {name!r} (loopback, 1gbit, 10gbit, or e.g. 1gbit+10ms)")
    if delay:
        if not (delay.endswith("ms") and delay[:-2].isdigit()):
            raise BenchError(f"link {name!r}: the delay is written like +10ms")
        delay_ms = int(delay[:-2])
    if delay_ms and speed == "loopback":
        raise BenchError("a delay needs a veth link (1gbit or 10gbit), not loopback")
    return speed, delay_ms


class Link:
    """name: see `parse`. A link with a delay is two tun devices joined by a delay line
    (delayline.py: this kernel has no netem) instead of a veth pair, shaped the same way."""

    def __init__(self, name, tag):
        self.name = name
        self.speed, self.delay_ms = parse(name)
        self.tag = tag
        self.ns_src = self.ns_dst = None
        self.dst_host = "127.0.0.1"
        self.created = []
        self.delayline = None
        self.wire_dev = "lo"  # the device whose counters `wire_bytes` reads, in ns_src

    def __enter__(self):
        if self.speed == "loopback":
            # A namespace of its own, so that its lo carries the migration and nothing else
            # (where `ip` is missing, as on the lent scale hosts, the host's lo is counted).
            if shutil.which("ip"):
                self.ns_src = self.ns_dst = f"fbl-{self.tag}"
                sh("ip", "netns", "add", self.ns_src)
                self.created.append(self.ns_src)
                sh("ip", "-n", self.ns_src, "link", "set", "lo", "up")
            return self
        try:
            self.ns_src, self.ns_dst = f"fbs-{self.tag}", f"fbd-{self.tag}"
            for ns in (self.ns_src, self.ns_dst):
                sh("ip", "netns", "add", ns)
                self.created.append(ns)
            va, vb = f"fbva{self.tag}"[:15], f"fbvb{self.tag}"[:15]
            if self.delay_ms:
                self.join_by_delay_line(va, vb)
            else:
                sh("ip", "link", "add", va, "netns", self.ns_src, "type", "veth", "peer", "name", vb,
                   "netns", self.ns_dst)
            self.wire_dev = va
            for ns, dev, addr in ((self.ns_src, va, ADDR_SRC), (self.ns_dst, vb, ADDR_DST)):
                sh("ip", "-n", ns, "addr", "add", f"{addr}/30", "dev", dev)
                sh("ip", "-n", ns, "link", "set", dev, "up")
                sh("ip", "-n", ns, "link", "set", "lo", "up")
                shape(ns, dev, self.speed)
        except BaseException:
            self.close()  # __exit__ is not called when __enter__ fails
            raise
        self.dst_host = ADDR_DST
        return self

    def join_by_delay_line(self, va, vb):
        """Tun devices `va` (source side) and `vb`, each in its namespace, joined by a delay
        line; a 9000-byte MTU keeps the line's packet rate at 1 Gbit/s within one core's reach."""
        line = os.path.join(os.path.dirname(os.path.abspath(__file__)), "delayline.py")
        self.delayline = subprocess.Popen([sys.executable, line, va, vb, str(self.delay_ms)],
                                          stdout=subprocess.PIPE, text=True)
        if self.delayline.stdout.readline().strip() != "ready":
            raise BenchError("the delay line did not start (does /dev/net/tun exist?)")
        for ns, dev in ((self.ns_src, va), (self.ns_dst, vb)):
            sh("ip", "link", "set", dev, "netns", ns)
            sh("ip", "-n", ns, "link", "set", dev, "mtu", "9000")

    def __exit__(self, *exc):
        self.close()

    def close(self):
        if self.delayline:
            self.delayline.terminate()
            self.delayline.wait(timeout=10)
            self.delayline = None
        for ns in self.created:
            sh("ip", "netns", "del", ns, check=False)
        self.created.clear()

    def wire_bytes(self):
        """Bytes that crossed the link so far, both ways, headers included: counted on the
        link for every VMM alike, never as a VMM reports it (lo sees each byte once, as sent)."""
        if self.ns_src is None:
            with open("/proc/net/dev") as f:
                for line in f:
                    name, _, counters = line.partition(":")
                    if name.strip() == "lo":
                        return int(counters.split()[8])
            raise BenchError("no lo in /proc/net/dev")
        out = sh("ip", "-n", self.ns_src, "-s", "-j", "link", "show", "dev", self.wire_dev).stdout
        stats = json.loads(out)[0]["stats64"]
        both = stats["tx"]["bytes"]
        return both if self.wire_dev == "lo" else both + stats["rx"]["bytes"]

    def goodput_bytes_per_s(self, megabytes=64, fresh=False):
        """TCP goodput source → destination, measured with a plain socket transfer. `fresh`:
        the receiver reads into new memory (each page faulted in and cleared on first touch,
        as a migration's destination does) instead of one reused buffer."""
        sink = (f"m=memoryview(fresh({megabytes}<<20));n=0\n"
                "while True:\n r=c.recv_into(m[n:])\n if not r: break\n n+=r\n") if fresh else (
                "b=bytearray(1<<20);n=0\n"
                "while True:\n r=c.recv_into(b)\n if not r: break\n n+=r\n")
        server = "c,_=s.accept()\n" + sink + "print(n)"
        client = (f"c=socket.create_connection(('{self.dst_host}',port))\n"
                  f"buf=b'x'*(1<<20);t=time.time()\n"
                  f"for _ in range({megabytes}): c.sendall(buf)\n"
                  "c.shutdown(socket.SHUT_WR);c.recv(1);print(time.time()-t)")
        return megabytes * (1 << 20) / self._transfer(server, client)

    def parallel_goodput_bytes_per_s(self, megabytes, streams, fresh):
        """TCP goodput source → destination over `streams` plain connections at once, a
        sending thread each, into one receiving process (one address space, as a
        destination's receivers are): into new memory (`fresh`: every page faulted in and
        cleared on first touch) or into one reused buffer per connection. Each receive waits
        for a whole 4 MiB (MSG_WAITALL), so the kernel, not the interpreter, sets the pace."""
        per = (megabytes << 20) // streams
        server = (
            f"per={per};into_fresh={fresh};got=[0]*{streams};ts=[]\n"
            f"m=memoryview(fresh({streams}*per)) if into_fresh else None\n"
            "def sink(i,c):\n"
            " v=m[i*per:(i+1)*per] if into_fresh else memoryview(bytearray(4<<20));n=0\n"
            " while True:\n"
            "  at=n if into_fresh else 0\n"
            "  r=c.recv_into(v[at:at+(4<<20)],0,socket.MSG_WAITALL)\n"
            "  if not r: break\n"
            "  n+=r\n"
            " got[i]=n;c.close()\n"
            f"for i in range({streams}):\n"
            " c,_=s.accept();ts.append(threading.Thread(target=sink,args=(i,c)));ts[-1].start()\n"
            "for t in ts: t.join()\n"
            "print(sum(got))")
        client = (
            f"per={per};buf=memoryview(b'x'*(4<<20))\n"
            f"cs=[socket.create_connection(('{self.dst_host}',port)) for _ in range({streams})]\n"
            "def send(c):\n"
            " left=per\n"
            " while left:\n"
            "  k=min(left,len(buf));c.sendall(buf[:k]);left-=k\n"
            " c.shutdown(socket.SHUT_WR);c.recv(1)\n"
            "ts=[threading.Thread(target=send,args=(c,)) for c in cs]\n"
            "t=time.time()\n"
            "for x in ts: x.start()\n"
            "for x in ts: x.join()\n"
            "print(time.time()-t)")
        return per * streams / self._transfer(server, client)

    def _transfer(self, server, client):
        """Runs `server` (python, after a socket `s` listens on a free port) in the
        destination's namespace and `client` (python, given `port`) in the source's; returns
        the seconds the client printed."""
        # The server takes any free port and says which: a fixed one would collide with
        # another measurement running at the same time (the test suite runs two at once).
        argv = ["python3", "-c", (
            "import mmap,socket,threading\n" + FRESH_MEMORY +
            "s=socket.socket()\n"
            f"s.bind(('{self.dst_host}',0));s.listen(64);print(s.getsockname()[1],flush=True)\n"
            + server)]
        if self.ns_dst:
            argv = ["ip", "netns", "exec", self.ns_dst] + argv
        srv = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
        done = False
        try:
            said = srv.stdout.readline().strip()
            if not said.isdigit():
                raise BenchError("the goodput measurement's server did not start")
            argv = ["python3", "-c", f"import socket,threading,time\nport={int(said)}\n" + client]
            if self.ns_src:
                argv = ["ip", "netns", "exec", self.ns_src] + argv
            out = subprocess.run(argv, capture_output=True, text=True, timeout=120)
            if out.returncode != 0:
                raise BenchError(f"the goodput measurement's sender failed: {out.stderr.strip()}")
            seconds = float(out.stdout.strip())
            done = True
            return seconds
        finally:
            if not done:
                srv.kill()  # it may wait for connections that never come
            srv.wait(timeout=30)
