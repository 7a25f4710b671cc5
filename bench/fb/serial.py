"""Timestamps the guest's serial lines as they arrive, for either VMM: the guest's heartbeat as
seen from outside. The bench's guests print an empty line every millisecond (`tick_ms=1`) and a
progress line every 10 ms, so guest-observed downtime is the longest gap between lines across
the switch, minus the normal gap, at about 1 ms resolution for both VMMs."""
import os
import socket
import statistics
import threading
import time

from .util import BenchError


class SerialClock:
    def __init__(self):
        self.stamps = []  # (host time, line)
        self.notes = []  # (host time, line): the guest's other lines (what it says once)
        self.lock = threading.Lock()

    def _consume(self, stream):
        buf = b""
        while True:
            chunk = stream.read(4096) if hasattr(stream, "read") else stream.recv(4096)
            if not chunk:
                return
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                if not line.strip() or b"hb=" in line:  # a tick or a progress line
                    with self.lock:
                        self.stamps.append((time.time(), line.decode(errors="replace")))
                elif line.startswith(b"ferry-guest:") and len(self.notes) < 1000:
                    with self.lock:
                        self.notes.append((time.time(), line.decode(errors="replace")))

    def follow_fifo(self, path):
        """Reads a FIFO that a ferry process writes its serial console to."""
        os.mkfifo(path)

        def run():
            with open(path, "rb", buffering=0) as f:
                self._consume(f)

        threading.Thread(target=run, daemon=True).start()

    def follow_socket(self, path, timeout=20):
        """Connects to a QEMU chardev socket (server=on) and reads it."""

        def run():
            deadline = time.time() + timeout
            while time.time() < deadline:
                try:
                    s = socket.socket(socket.AF_UNIX)
                    s.connect(path)
                    break
                except OSError:
                    time.sleep(0.02)
            else:
                return
            with s:
                self._consume(s)

        threading.Thread(target=run, daemon=True).start()

    def listen(self, path, timeout=60):
        """Listens on `path` for a QEMU chardev socket with `server=off`, which connects when
        QEMU creates it: no line is lost to a reader that connects late (a cpr-transfer
        destination creates its chardevs only once the old QEMU sent its state)."""
        listener = socket.socket(socket.AF_UNIX)
        listener.bind(path)
        listener.listen(1)
        listener.settimeout(timeout)

        def run():
            try:
                s, _ = listener.accept()
            except OSError:
                return
            finally:
                listener.close()
            with s:
                s.settimeout(None)
                self._consume(s)

        threading.Thread(target=run, daemon=True).start()

    def lines(self):
        with self.lock:
            return list(self.stamps)

    def counter(self, name):
        """A counter (`passes`, `net_rx`, ...) from the latest progress line; 0 before one."""
        return self.counters()[1].get(name, 0)

    def counters(self):
        """(host time, {counter: value}) of the latest progress line; (None, {}) before one."""
        with self.lock:
            at, latest = next(((t, line) for t, line in reversed(self.stamps) if "hb=" in line), (None, ""))
        return at, {k: int(v) for k, _, v in (w.partition("=") for w in latest.split())
                    if v.isdigit()}

    def note(self, prefix):
        """The first of the guest's other lines that starts with `prefix`, or None."""
        with self.lock:
            return next((line for _, line in self.notes if line.startswith(prefix)), None)

    def guest_error(self):
        """Raises BenchError with the guest's fatal error, once it printed one."""
        said = self.note("ferry-guest: error:")
        if said:
            raise BenchError(f"the guest stopped: {said}")


def observed_downtime_ms(source, destination, since):
    """The gap across the switch, minus the normal gap: from the source's last line to the
    destination's first, less the median gap between the source's lines after `since`. This
    is the pause as the guest lived it, whatever either VMM reports; the jitter of a busy
    two-core host while pre-copy runs (gaps of a few ms on the source) is not counted as
    downtime."""
    theirs = sorted(t for t, _ in destination.lines() if t >= since)
    ours = sorted(t for t, _ in source.lines() if t >= since - 1.0)
    if not theirs or len(ours) < 3:
        return None
    last = max((t for t in ours if t <= theirs[0]), default=None)
    if last is None:
        return None
    normal = statistics.median(b - a for a, b in zip(ours, ours[1:]))
    return max(0.0, (theirs[0] - last - normal) * 1e3)
