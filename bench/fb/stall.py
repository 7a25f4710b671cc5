"""The guest's stalls, read out of its memory on both sides of a move: an instrument that works
the same for every VMM on the same guest image, below a millisecond.

A real-time process of this host (`ProgressWatch`, SCHED_FIFO 10) reads a progress counter the
guest keeps in its own memory, on the source and on the destination, every ~0.2 ms, until the
destination's counter has run on for half a second past the source's last value. From the
readings (`stalls`): the stall at the switch (from the last reading before the source's
counter took its final value to the first reading where the destination's passed it), its
part after the destination's VMM said the VM runs, the longest time a counter stood still
anywhere in the move, and the longest gap between two readings (the resolution).

Two guests keep such a counter: the Linux row's writer (bench/fb/linux.py reads it through the
VMMs' memfds) and the workload guest, whose per-vCPU heartbeat blocks (guest/abi.h) count the
pages each vCPU touched: `workload_sample` reads their sum through /proc/PID/mem, so the
VMM's memory needs no particular backing."""
import json
import os
import select
import struct
import subprocess
import sys
import time

from .util import BenchError, guest_image, parse_mib

SAMPLE_S = 0.0002
AFTER_SWITCH_S = 0.5
# The workload guest's heartbeat blocks (guest/abi.h): one of 128 bytes per vCPU, the pages
# touched at byte 8 and the magic at byte 52.
HB_MAGIC = 0x46455259
HB_SIZE, HB_PAGES_AT, HB_MAGIC_AT = 128, 8, 52
# RAM below the 32-bit PCI hole, as ferry and QEMU lay a guest's memory out.
LOW_RAM = 3 << 30


def sample_counters(read_src, read_dst, timeout):
    """Both sides' counters, read every `SAMPLE_S` until the destination's has run
    `AFTER_SWITCH_S` past the source's (or `timeout` s): a list of (host time, source's value,
    destination's value or None before its memory is there). `read_src` and `read_dst` give a
    counter or None. Says "ready" on stdout once it reads the source, before which the move
    must not be asked for (starting Python at real-time priority takes a core for tens of
    ms)."""
    if read_src() is None:
        raise BenchError("the source's counter cannot be read")
    print("ready", flush=True)
    samples, go = [], None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        now = time.time()
        s, d = read_src(), read_dst()
        samples.append((now, s, d))
        # Until the switch the destination holds an older copy of the counter, never more.
        go = go or (time.monotonic() if d is not None and s is not None and d > s else None)
        if go and time.monotonic() - go >= AFTER_SWITCH_S:
            break
        time.sleep(SAMPLE_S)
    return samples


class ProgressWatch:
    """`module.sample(*args)` in a process of its own at real-time priority (SCHED_FIFO 10),
    started and ready before the move."""
    READY_S = 30

    def __init__(self, module, args, timeout=120):
        code = ("import json,sys;sys.path.insert(0,sys.argv[1]);import importlib;"
                "m=importlib.import_module('fb.'+sys.argv[2]);"
                "print(json.dumps(m.sample(*map(int, sys.argv[3:]))))")
        bench = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        self.proc = subprocess.Popen(
            ["chrt", "-f", "10", sys.executable, "-c", code, bench, module,
             *(str(a) for a in args)], stdout=subprocess.PIPE, text=True)
        self.timeout = timeout
        ready = select.select([self.proc.stdout], [], [], self.READY_S)[0]
        if not ready or self.proc.stdout.readline().strip() != "ready":
            self.proc.kill()
            raise BenchError(f"the progress sampler was not ready within {self.READY_S} s")

    def wait_resumed(self, resumed_at):
        """The figures once the destination ran on (`resumed_at`: its VMM's word that the VM
        runs, host time), as `stalls` gives them."""
        out, _ = self.proc.communicate(timeout=self.timeout + 30)
        samples = json.loads(out)
        final = samples[-1][1]
        if not any(d is not None and d > final for _, _, d in samples):
            raise BenchError("the guest did not run on at the destination")
        return stalls(samples, resumed_at)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def stalls(samples, resumed_at):
    """From the samples: the stall at the switch (from the last source sample before its
    counter's final value to the first destination sample past it, the midpoints of the
    sampling windows) and its part after the destination's VMM said the VM runs, the longest
    time either counter stood still while its side ran, and the longest gap between two
    samples and when that gap began."""
    final = samples[-1][1]
    k = next(i for i, s in enumerate(samples) if s[1] == final)
    j = next(i for i, s in enumerate(samples) if s[2] is not None and s[2] > final)
    mid = lambda i: (samples[max(i - 1, 0)][0] + samples[i][0]) / 2  # noqa: E731
    switch = mid(j) - mid(k)
    longest = switch
    for side, run in ((1, samples[:k + 1]), (2, samples[j:])):
        moved = [s[0] for a, s in zip(run, run[1:]) if s[side] != a[side]]
        longest = max([longest] + [b - a for a, b in zip(moved, moved[1:])])
    gap, i = max((b[0] - a[0], i) for i, (a, b) in enumerate(zip(samples, samples[1:])))
    side = 1 if i < k else 2
    across = (samples[i + 1][side] or 0) - (samples[i][side] or 0)
    return {"guest_stall_ms": switch * 1e3, "stall_after_resume_ms": (mid(j) - resumed_at) * 1e3,
            "longest_stall_ms": longest * 1e3, "sample_gap_ms": gap * 1e3,
            # When the instrument's longest gap began, from the source's last move (< 0: before),
            # and how far the guest's counter went on across it (the guest ran if it did).
            "sample_gap_at_ms": (samples[i][0] - mid(k)) * 1e3, "sample_gap_moved": across}


def symbol(image, name):
    """A symbol's address in an ELF image (the workload guest runs where it is linked)."""
    out = subprocess.run(["nm", image], capture_output=True, text=True, check=True).stdout
    for line in out.splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[2] == name:
            return int(parts[0], 16)
    raise BenchError(f"{image} has no symbol {name}")


class WorkloadSide:
    """The workload guest's heartbeat blocks in process `pid`'s memory, read through
    /proc/PID/mem: where guest-physical 0 lies is found by the first block's magic, at the
    start or the end of a mapping that holds the RAM below the hole (a VMM may map the RAM
    above it right before, and the kernel then shows one mapping)."""
    LOOK_EVERY_S = 0.01

    def __init__(self, pid, memory_bytes, blocks, vcpus):
        self.pid, self.low = pid, min(memory_bytes, LOW_RAM)
        self.blocks, self.vcpus = blocks, vcpus
        self.fd, self.base, self.next_look, self.last = None, None, 0.0, None

    def _find_base(self):
        with open(f"/proc/{self.pid}/maps") as maps:
            spans = [tuple(int(x, 16) for x in line.split()[0].split("-"))
                     for line in maps if line.split()[1].startswith("rw")]
        for start, end in spans:
            if end - start < self.low:
                continue
            for base in {start, end - self.low}:
                try:
                    magic = os.pread(self.fd, 4, base + self.blocks + HB_MAGIC_AT)
                except OSError:
                    continue
                if struct.unpack("<I", magic)[0] == HB_MAGIC:
                    return base
        return None

    def pages(self):
        """Pages touched by all vCPUs so far, or None before the blocks are there (looked for
        every 10 ms at most)."""
        if self.base is None:
            now = time.monotonic()
            if now < self.next_look:
                return None
            self.next_look = now + self.LOOK_EVERY_S
            try:
                self.fd = self.fd if self.fd is not None else os.open(f"/proc/{self.pid}/mem", os.O_RDONLY)
                self.base = self._find_base()
            except OSError:
                return None
            if self.base is None:
                return None
        try:
            raw = os.pread(self.fd, HB_SIZE * self.vcpus, self.base + self.blocks)
        except OSError:
            return self.last  # the VMM has exited (a source once its VM moved): no more touches
        self.last = sum(struct.unpack_from("<Q", raw, c * HB_SIZE + HB_PAGES_AT)[0]
                        for c in range(self.vcpus))
        return self.last


def sample(src_pid, dst_pid, memory_bytes, blocks, vcpus, timeout):
    """The workload guest's pages-touched counter on both sides (`ProgressWatch("stall", …)`)."""
    src = WorkloadSide(src_pid, memory_bytes, blocks, vcpus)
    dst = WorkloadSide(dst_pid, memory_bytes, blocks, vcpus)
    return sample_counters(src.pages, dst.pages, timeout)


def workload_watch(image, src_pid, dst_pid, memory_bytes, vcpus, timeout=600):
    """A `ProgressWatch` on the workload guest `image` run by both processes."""
    return ProgressWatch("stall", [src_pid, dst_pid, memory_bytes, symbol(image, "blocks"), vcpus,
                                   timeout], timeout)


def scenario_watch(scenario, src_pid, dst_pid):
    """The instrument on a scenario's move, started (ready) before it is asked for, when the
    scenario asks for it (`"stall": True`); else None."""
    if not scenario.get("stall"):
        return None
    return workload_watch(guest_image(scenario), src_pid, dst_pid,
                          parse_mib(scenario["memory"]) << 20, scenario["vcpus"])


def figures(watch, resumed_at):
    """The instrument's figures for a row ({} without one)."""
    return watch.wait_resumed(resumed_at) if watch else {}
