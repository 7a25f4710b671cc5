"""Small helpers shared by the drivers: processes, waiting, statistics."""
import os
import signal
import socket
import statistics
import subprocess
import time

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
FERRY = os.path.join(REPO, "target", "release", "ferry")
GUEST = os.path.join(REPO, "guest", "build", "guest.elf")


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


class Processes:
    """Every process a scenario starts, so that all of them are stopped whatever happens."""

    def __init__(self):
        self.procs = []

    def start(self, argv, netns=None, **kw):
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


def summarize(values):
    """min / median / max of the measured values (None when nothing was measured)."""
    vals = [v for v in values if v is not None]
    if not vals:
        return None
    return {"min": min(vals), "median": statistics.median(vals), "max": max(vals), "n": len(vals)}
