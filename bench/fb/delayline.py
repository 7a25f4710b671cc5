"""A delay line between two tun devices: every IP packet that enters one leaves the other
`delay_ms` later, in order. It stands in for netem (which this machine's kernel lacks) to make
a WAN-like link: TCP on both ends sees the added round trip, as it would on a long path.

Run as `python3 delayline.py TUN_A TUN_B DELAY_MS`: it creates both devices (gone when it
exits), prints `ready`, and forwards until it is terminated. The caller moves the devices into
their namespaces and shapes them with tc. A queue that holds `MAX_QUEUED` packets drops the
next one, as a router's full buffer does."""
import collections
import fcntl
import os
import select
import signal
import struct
import sys
import time

TUNSETIFF = 0x400454CA
IFF_TUN = 0x0001
IFF_NO_PI = 0x1000
# Far above a 1 Gbit/s link's packets in flight at 50 ms (about 7 000 at a 9000-byte MTU).
MAX_QUEUED = 100_000
# Packets read from one device before the other gets its turn.
READ_BURST = 64


def open_tun(name):
    fd = os.open("/dev/net/tun", os.O_RDWR)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TUN | IFF_NO_PI))
    os.set_blocking(fd, False)
    return fd


def forward(a, b, delay):
    """Moves packets between fds `a` and `b`, each `delay` seconds late; never returns."""
    waiting = {a: collections.deque(), b: collections.deque()}  # per fd: (due, packet) to write
    other = {a: b, b: a}
    while True:
        now = time.monotonic()
        timeout = None
        for fd, queue in waiting.items():
            while queue and queue[0][0] <= now:
                try:
                    os.write(fd, queue.popleft()[1])
                except (BlockingIOError, OSError):
                    pass  # the device refused it: a lost packet, which TCP resends
            if queue:
                wait = queue[0][0] - now
                timeout = wait if timeout is None else min(timeout, wait)
        ready, _, _ = select.select([a, b], [], [], timeout)
        now = time.monotonic()
        for fd in ready:
            queue = waiting[other[fd]]
            for _ in range(READ_BURST):
                try:
                    packet = os.read(fd, 65536)
                except BlockingIOError:
                    break
                if len(queue) < MAX_QUEUED:
                    queue.append((now + delay, packet))


def main():
    name_a, name_b, delay_ms = sys.argv[1], sys.argv[2], float(sys.argv[3])
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    a, b = open_tun(name_a), open_tun(name_b)
    print("ready", flush=True)
    forward(a, b, delay_ms / 1000)


if __name__ == "__main__":
    main()
