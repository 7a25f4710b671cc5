"""Timestamps the guest's serial progress lines as they arrive, for either VMM: the guest's
heartbeat as seen from outside. Guest-observed downtime is the longest gap between lines
across the switch, minus the normal line period."""
import os
import socket
import statistics
import threading
import time


class SerialClock:
    def __init__(self):
        self.stamps = []  # (host time, line)
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
                if b"hb=" in line:
                    with self.lock:
                        self.stamps.append((time.time(), line.decode(errors="replace")))

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

    def lines(self):
        with self.lock:
            return list(self.stamps)


def observed_downtime_ms(source, destination, since):
    """Largest gap between consecutive lines (source then destination) after `since`, minus
    the median gap: what the guest lost beyond its normal line period."""
    stamps = sorted([t for t, _ in source.lines()] + [t for t, _ in destination.lines()])
    stamps = [t for t in stamps if t >= since - 1.0]
    if len(stamps) < 3:
        return None
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    return max(0.0, (max(gaps) - statistics.median(gaps)) * 1e3)
