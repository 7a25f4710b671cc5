"""Small helpers shared by the drivers: processes, waiting, statistics."""
import os
import signal
import socket
import statistics
import subprocess
import threading
import time

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
# A host with neither compiler nor build (the scale profile's) names a copied binary and image.
FERRY = os.environ.get("FERRY_BIN") or os.path.join(REPO, "target", "release", "ferry")
GUEST = os.environ.get("FERRY_GUEST") or os.path.join(REPO, "guest", "build", "guest.elf")


def guest_image(scenario):
    """The workload guest image a scenario boots: `GUEST`, or the image it names beside it
    (`guest-app.elf`, whose memory sample fill=real copies)."""
    name = scenario.get("image")
    return os.path.join(os.path.dirname(GUEST), name) if name else GUEST


def parse_mib(size):
    """A size as the guest's command line and the scenarios write it (`4G`, `768M`), in MiB."""
    unit = size[-1].upper()
    n = int(size[:-1]) if unit in "KMG" else int(size)
    return {"G": n * 1024, "M": n, "K": max(1, n // 1024)}.get(unit, n >> 20)


class BenchError(Exception):
    """A scenario could not be measured; the message says why."""


class DidNotConverge(BenchError):
    """A migration that never finished within the scenario's time: an expected outcome for a
    VMM whose pre-copy cannot keep up (reported as a row, not as a failure of the run)."""


def wait_until(what, timeout, predicate, interval=0.02):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise BenchError(f"timed out after {timeout}s waiting for {what}")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# `--pin split`: the source VMM on one set of CPUs, the destination on another (a variance
# study: do the two sides' threads fight over the same cores?). Empty: the scheduler decides.
PINNING = {}


class Processes:
    """Every process a scenario starts, so that all of them are stopped whatever happens."""

    def __init__(self):
        self.procs = []

    def start(self, argv, netns=None, side=None, **kw):
        """`side`: "source" or "destination", for `PINNING`."""
        cpus = PINNING.get(side)
        if cpus:
            # taskset, not preexec_fn: the runner has threads, and a child of a threaded
            # process may run only async-signal-safe code before exec.
            argv = ["taskset", "-c", ",".join(map(str, sorted(cpus)))] + argv
        if netns:
            argv = ["ip", "netns", "exec", netns] + argv
        p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, start_new_session=True, **kw)
        self.procs.append(p)
        return p

    def stop_all(self):
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        self.procs.clear()


TICK = os.sysconf("SC_CLK_TCK")


def _cpu_s(stat):
    """utime + stime of a /proc .../stat line, in seconds."""
    fields = stat[stat.rindex(")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def process_cpu_s(pid, guest_threads=("vcpu", "CPU ")):
    """(CPU seconds of the whole process, threads that ended included; CPU seconds of its
    threads that run the guest: ferry's `vcpuN`, QEMU's `CPU N/KVM`)."""
    with open(f"/proc/{pid}/stat") as f:
        total = _cpu_s(f.read())
    guest = 0.0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:
            continue  # ended meanwhile
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        if name.startswith(guest_threads) and name != "vcpu-throttle":
            guest += _cpu_s(stat)
    return total, guest


def exited_cpu_s(pid, timeout=30):
    """CPU seconds of a child process over its whole life, once it exits by itself."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        done, _, usage = os.wait4(pid, os.WNOHANG)
        if done:
            return usage.ru_utime + usage.ru_stime
        time.sleep(0.01)
    raise BenchError(f"process {pid} did not exit within {timeout} s")


class CpuMeter:
    """Host CPU a migration costs its two VMM processes, their guest threads left out: sampled
    when it starts and when it ends (a source that exits at the end is read from its exit).
    The destination's guest threads are also read every `GUEST_EVERY_S` meanwhile, so what
    they took up to a moment (the end of post-copy) can be told apart from what came after."""

    GUEST_EVERY_S = 0.05

    def __init__(self, src_pid, dst_pid):
        self.pids = (src_pid, dst_pid)
        self.before = [process_cpu_s(p) for p in self.pids]
        self.guest_samples = [(time.time(), self.before[1][1])]
        self.stop = threading.Event()
        self.sampler = threading.Thread(target=self._sample_guest, daemon=True)
        self.sampler.start()

    def _sample_guest(self):
        while not self.stop.wait(self.GUEST_EVERY_S):
            try:
                self.guest_samples.append((time.time(), process_cpu_s(self.pids[1])[1]))
            except OSError:
                return  # the destination ended

    def seconds(self, src_exits):
        """(source, destination): CPU seconds since it began, guest threads left out."""
        self.stop.set()
        self.sampler.join()
        dst_total, dst_guest = process_cpu_s(self.pids[1])
        if src_exits:
            # The source's guest was paused throughout (warm), so its guest threads add nothing.
            src = exited_cpu_s(self.pids[0]) - self.before[0][0]
        else:
            total, guest = process_cpu_s(self.pids[0])
            src = (total - self.before[0][0]) - (guest - self.before[0][1])
        return src, (dst_total - self.before[1][0]) - (dst_guest - self.before[1][1])

    def guest_until(self, unix_s):
        """The destination's guest CPU seconds from the start to the last sample before
        `unix_s` (within `GUEST_EVERY_S` of it)."""
        taken = [cpu for at, cpu in self.guest_samples if at <= unix_s]
        return taken[-1] - self.before[1][1]


def cpu_row(cpu, scenario, guest_until_done=None):
    """The CPU a migration cost (source, destination) as result fields: seconds, and seconds per
    GiB of the scenario's populated memory (`cpu_gib`); beside them, what the guest's threads
    took on the destination until the move was done, where known (post-copy runs the guest
    there while its pages come)."""
    if not cpu:
        return {}
    src, dst = cpu
    return {"cpu_s_source": src, "cpu_s_destination": dst,
            "cpu_s_per_gib": (src + dst) / scenario["cpu_gib"],
            "cpu_s_guest_destination": guest_until_done}


def summarize(values):
    """min / median / max of the measured values (None when nothing was measured)."""
    vals = [v for v in values if v is not None]
    if not vals:
        return None
    return {"min": min(vals), "median": statistics.median(vals), "max": max(vals), "n": len(vals)}


# Python defining `fresh(n)`: n bytes of memory never touched, as a destination's guest memory
# (private, 4 KiB pages; python's default mapping is shared memory).
FRESH_MEMORY = ("def fresh(n):\n"
                " m=mmap.mmap(-1,n,flags=mmap.MAP_PRIVATE);m.madvise(mmap.MADV_NOHUGEPAGE);return m\n")


def fault_in_bytes_per_s(megabytes, threads):
    """How fast this host faults in (allocates and clears) fresh memory of one process: what a
    destination does for every page it receives. `threads` threads in one process fault in
    one mapping 2 MiB at a time (MADV_POPULATE_WRITE, as ferry's prefault threads do), each
    taking the next 2 MiB; bytes per second over the whole mapping."""
    code = (
        "import ctypes,mmap,threading,time\n" + FRESH_MEMORY +
        f"size={megabytes}<<20;chunk=2<<20;threads={threads}\nm=fresh(size)\n"
        "base=ctypes.addressof(ctypes.c_char.from_buffer(m))\n"
        "libc=ctypes.CDLL(None,use_errno=True)\n"
        "libc.madvise.argtypes=[ctypes.c_void_p,ctypes.c_size_t,ctypes.c_int]\n"
        "nxt=[0];lock=threading.Lock();bad=[]\n"
        "def work():\n"
        " while True:\n"
        "  with lock:\n"
        "   at=nxt[0];nxt[0]+=chunk\n"
        "  if at>=size: return\n"
        "  if libc.madvise(base+at,min(chunk,size-at),23)!=0: bad.append(ctypes.get_errno());return\n"
        "ts=[threading.Thread(target=work) for _ in range(threads)]\n"
        "t=time.time()\n"
        "for x in ts: x.start()\n"
        "for x in ts: x.join()\n"
        "print(-1 if bad else time.time()-t)\n")
    out = subprocess.run(["python3", "-c", code], capture_output=True, text=True, timeout=120)
    seconds = float(out.stdout.strip() or -1)
    if seconds <= 0:
        raise BenchError(f"could not fault memory in: {out.stderr.strip() or 'madvise failed'}")
    return (megabytes << 20) / seconds
