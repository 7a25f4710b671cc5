"""A relay that breaks a pre-copy at a set point of its round 0, for the resume profile
(`bench/run.py --profile resume`): the link cut, or stalled, at the same point of the protocol
every run, whatever the timing.

It listens on a port, and relays each connection to the destination's. The first connection's
frames from the source are read whole (ferry's framing, docs/protocol.md: a 16-byte stream
header, then frames of kind u8 | flags u8 | reserved u16 | length u32 LE | payload | crc32 u32;
a control frame's payload opens with its tag u16 LE, `Populated` being 27 with its page map, a
page frame's with `count u32`). Once `Populated` has named round 0's pages, it counts the pages
its frames carry; the frame that brings them to `at`% of those is the point. There it applies
the fault before that frame goes on:

- `none`: nothing (the baseline: the same relay, the same parsing up to the same point);
- `cut`: resets both sides of the connection (SO_LINGER 0, as a peer that died would), the frame
  dropped;
- `stall`: forwards nothing either way (not even a close) for `stall_s`, then the held frame
  and whatever follows, if the connection still stands.

After the point, and on every later connection (the source dialling again), bytes are relayed
untouched (spliced, no copy through Python). What it saw goes to a JSON file (`--stats`),
rewritten at every event: the point, the fault, each connection opened and closed with the
bytes it forwarded each way and how it ended.

Run as `python3 cutter.py --listen HOST --target HOST:PORT --fault cut --stats FILE`: it prints
`port N` (the port it listens on) and relays until it is terminated. `Cutter` starts one for
the bench."""
import argparse
import errno
import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time

STREAM_HEADER_LEN = 16
FRAME_HEADER_LEN = 8
TRAILER_LEN = 4
KIND_CONTROL, KIND_PAGES = 1, 2
TAG_ROUND_END, TAG_POPULATED = 3, 27
RUN_ZEROS, RUN_ONES, RUN_WORDS = 0, 1, 2
CHUNK = 1 << 20
FAULTS = ("none", "cut", "stall")
F_SETPIPE_SZ = 1031


def page_map_count(payload):
    """(pages, pages set) of a `Populated` payload: tag u16, pages u64, then the bitmap as ferry
    encodes it (words u32, then runs: kind u8, length u32 in words, and for a run of literal
    words, the words u64)."""
    pages, words = struct.unpack_from("<QI", payload, 2)
    at, word, count = 14, 0, 0
    while word < words:
        kind = payload[at]
        (length,) = struct.unpack_from("<I", payload, at + 1)
        at += 5
        if kind == RUN_ONES:
            count += 64 * length
        elif kind == RUN_WORDS:
            count += sum(bin(w).count("1") for w in struct.unpack_from(f"<{length}Q", payload, at))
            at += 8 * length
        elif kind != RUN_ZEROS:
            raise ValueError(f"unknown bitmap run kind {kind}")
        word += length
    return pages, min(count, pages)


def read_exact(sock, view):
    """Fills `view` from `sock`; False if the stream ended first."""
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            return False
        got += n
    return True


def reset(sock):
    """Makes `sock`'s close a reset (RST), as a peer that died would send: a plain close leaves
    the peer's unread bytes to be probed until its I/O timeout."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass


class Relay:
    def __init__(self, listen, target, fault, at_percent, stall_s, stats_path):
        assert fault in FAULTS, fault
        self.listener = socket.create_server((listen, 0), backlog=16)
        self.target = target
        self.fault, self.at, self.stall_s = fault, at_percent, stall_s
        self.stats_path = stats_path
        self.lock = threading.Lock()
        # Held by a stall: the first connection's other direction waits on it before it
        # forwards anything (bytes or a close).
        self.gate = threading.Lock()
        self.connections = []
        self.point = {"reached": False}
        self.applied = None
        self.write_stats()

    def port(self):
        return self.listener.getsockname()[1]

    def write_stats(self):
        with self.lock:
            conns = [dict(c) for c in self.connections]
            stats = {"fault": self.fault, "at_percent": self.at, "stall_s": self.stall_s,
                     "port": self.port(), "point": dict(self.point), "fault_applied": self.applied,
                     "connections": conns, "open": sum(1 for c in conns if c["closed_unix"] is None),
                     "bytes_to_destination": sum(c["to_destination"] for c in conns),
                     "bytes_to_source": sum(c["to_source"] for c in conns)}
            tmp = self.stats_path + ".tmp"
            with open(tmp, "w") as f:
                json.dump(stats, f, indent=1)
            os.replace(tmp, self.stats_path)

    def serve(self):
        while True:
            src, _ = self.listener.accept()
            try:
                dst = socket.create_connection(self.target)
            except OSError as e:
                src.close()
                with self.lock:
                    self.connections.append(self.record(f"could not reach the destination: {e}"))
                self.write_stats()
                continue
            for s in (src, dst):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self.lock:
                rec = self.record(None)
                rec["index"] = len(self.connections)
                self.connections.append(rec)
            self.write_stats()
            first = rec["index"] == 0
            pair = {"src": src, "dst": dst, "rec": rec, "ends": 0, "reset": False}
            up = self.conversation if first else self.plain_up
            threading.Thread(target=up, args=(pair,), daemon=True).start()
            threading.Thread(target=self.down, args=(pair, first), daemon=True).start()

    @staticmethod
    def record(ended):
        now = time.time()
        return {"index": None, "opened_unix": now, "closed_unix": now if ended else None,
                "to_destination": 0, "to_source": 0, "ended": ended}

    def end(self, pair, why):
        """One direction is over: the connection is closed both ways (as the test relay does),
        with a reset where the fault reset it; the first reason given is the connection's."""
        with self.lock:
            rec = pair["rec"]
            if rec["ended"] is None:
                rec["ended"] = why
            pair["ends"] += 1
            last = pair["ends"] == 2
        # SHUT_RD wakes the other direction's pump; SHUT_WR would send a FIN before a reset.
        for s in (pair["src"], pair["dst"]):
            try:
                s.shutdown(socket.SHUT_RD if pair["reset"] else socket.SHUT_RDWR)
            except OSError:
                pass
        if last:
            with self.lock:
                rec["closed_unix"] = time.time()
            for s in (pair["src"], pair["dst"]):
                s.close()
        self.write_stats()

    def splice(self, pair, src, dst, key, gated):
        """Relays `src` to `dst` untouched until either ends; returns why it stopped."""
        rec = pair["rec"]
        if not hasattr(os, "splice"):  # before Python 3.10
            return self.copy(pair, src, dst, key, gated)
        try:
            pr, pw = os.pipe()
        except OSError as e:
            return f"no pipe: {e}"
        try:
            try:
                import fcntl
                fcntl.fcntl(pw, F_SETPIPE_SZ, CHUNK)
            except OSError:
                pass
            while True:
                try:
                    n = os.splice(src.fileno(), pw, CHUNK)
                except OSError as e:
                    if e.errno == errno.EINVAL and not rec[key]:
                        return self.copy(pair, src, dst, key, gated)
                    n, error = 0, e
                else:
                    error = None
                ended = self.read_ended(key, n, error, gated)
                if ended:
                    return ended
                left = n
                while left:
                    try:
                        m = os.splice(pr, dst.fileno(), left)
                    except OSError as e:
                        return f"{self.side(key, False)}: {e.strerror}{self.when()}"
                    left -= m
                rec[key] += n
        finally:
            os.close(pr)
            os.close(pw)

    def copy(self, pair, src, dst, key, gated):
        """As `splice`, through a buffer (where splice is refused)."""
        rec, buf = pair["rec"], bytearray(CHUNK)
        view = memoryview(buf)
        while True:
            try:
                n, error = src.recv_into(buf), None
            except OSError as e:
                n, error = 0, e
            ended = self.read_ended(key, n, error, gated)
            if ended:
                return ended
            try:
                dst.sendall(view[:n])
            except OSError as e:
                return f"{self.side(key, False)}: {e.strerror}{self.when()}"
            rec[key] += n

    def read_ended(self, key, n, error, gated):
        """After a read of `n` bytes (or `error`): why the pump stops, or None to go on. A stall
        holds whatever came, a close too (said as it came)."""
        seen = self.when()
        if gated:
            with self.gate:
                pass
        if error:
            return f"{self.side(key, True)}: {error.strerror}{seen}"
        if n == 0:
            return f"closed by the {self.side(key, True)}{seen}"
        return None

    @staticmethod
    def side(key, reading):
        """The peer a pump reads from (`reading`) or writes to."""
        return "source" if (key == "to_destination") == reading else "destination"

    def when(self):
        """When, for a reason: seconds after the point, where one was reached."""
        at = self.point.get("unix")
        return f" ({time.time() - at:.1f} s after the point)" if at else ""

    def plain_up(self, pair):
        self.end(pair, self.splice(pair, pair["src"], pair["dst"], "to_destination", False))

    def down(self, pair, gated):
        self.end(pair, self.splice(pair, pair["dst"], pair["src"], "to_source", gated))

    def conversation(self, pair):
        """The first connection, source to destination: frames read whole up to the point."""
        src, dst, rec = pair["src"], pair["dst"], pair["rec"]
        buf = bytearray(8 << 20)
        view = memoryview(buf)
        started = time.time()
        try:
            if not read_exact(src, view[:STREAM_HEADER_LEN]):
                return self.end(pair, "closed by the source before its stream header")
            dst.sendall(view[:STREAM_HEADER_LEN])
            rec["to_destination"] += STREAM_HEADER_LEN
            rnd, populated, sent, frames = 0, None, 0, 0
            while True:
                if not read_exact(src, view[:FRAME_HEADER_LEN]):
                    return self.end(pair, "closed by the source")
                kind = buf[0]
                (length,) = struct.unpack_from("<I", buf, 4)
                n = FRAME_HEADER_LEN + length + TRAILER_LEN
                if n > len(buf):
                    buf.extend(bytes(n - len(buf)))
                    view = memoryview(buf)
                if not read_exact(src, view[FRAME_HEADER_LEN:n]):
                    return self.end(pair, "closed by the source mid-frame")
                fire = False
                payload = FRAME_HEADER_LEN
                if kind == KIND_CONTROL:
                    (tag,) = struct.unpack_from("<H", buf, payload)
                    if tag == TAG_POPULATED and populated is None:
                        memory_pages, populated = page_map_count(view[payload:n - TRAILER_LEN])
                        self.point.update(memory_pages=memory_pages, round0_pages=populated)
                    elif tag == TAG_ROUND_END:
                        (r,) = struct.unpack_from("<I", buf, payload + 2)
                        rnd = r + 1
                elif kind == KIND_PAGES and rnd == 0 and populated:
                    (count,) = struct.unpack_from("<I", buf, payload)
                    before, sent, frames = sent, sent + count, frames + 1
                    fire = before * 100 < self.at * populated <= sent * 100
                if fire:
                    now = time.time()
                    self.point.update(reached=True, unix=now, ms_after_connect=(now - started) * 1e3,
                                      pages_sent=sent, frames=frames,
                                      bytes_to_destination=rec["to_destination"])
                    self.write_stats()
                    if self.fault == "cut":
                        self.applied = {"what": "reset both sides; the frame at the point dropped",
                                        "began_unix": now, "ended_unix": now}
                        pair["reset"] = True
                        reset(src)
                        reset(dst)
                        return self.end(pair, "reset by the relay at the point")
                    if self.fault == "stall":
                        with self.gate:
                            self.applied = {"what": f"forwarded nothing for {self.stall_s} s",
                                            "began_unix": now, "ended_unix": None}
                            self.write_stats()
                            time.sleep(self.stall_s)
                            self.applied["ended_unix"] = time.time()
                        self.write_stats()
                try:
                    dst.sendall(view[:n])
                except OSError as e:
                    return self.end(pair, f"destination: {e.strerror}{self.when()}"
                                    + (", sending the frame held by the stall" if fire else ""))
                rec["to_destination"] += n
                if fire or rnd > 0:
                    break  # past the point (or round 0 is over): the rest goes untouched
        except OSError as e:
            return self.end(pair, f"source: {e.strerror}{self.when()}")
        self.end(pair, self.splice(pair, src, dst, "to_destination", False))


class Cutter:
    """A relay (run as its own process, in the destination's namespace) in front of a
    destination listening on `target_port`; `url` is where the source migrates to."""

    def __init__(self, procs, work, link, target_port, fault, at_percent=80, stall_s=30):
        self.stats_path = os.path.join(work, f"cutter-{time.time_ns()}.json")
        self.proc = procs.start(
            [sys.executable, os.path.abspath(__file__), "--listen", link.dst_host,
             "--target", f"{link.dst_host}:{target_port}", "--fault", fault,
             "--at", str(at_percent), "--stall-s", str(stall_s), "--stats", self.stats_path],
            netns=link.ns_dst, stdout=subprocess.PIPE, text=True)
        ready, _, _ = select.select([self.proc.stdout], [], [], 15)
        line = self.proc.stdout.readline().split() if ready else []
        if len(line) != 2 or line[0] != "port":
            raise RuntimeError(f"the relay did not start (said {line!r})")
        self.url = f"tcp:{link.dst_host}:{line[1]}"

    def stats(self, settle_s=10.0):
        """What the relay saw, once its connections are closed (at most `settle_s` later)."""
        deadline = time.time() + settle_s
        while True:
            with open(self.stats_path) as f:
                stats = json.load(f)
            if stats["connections"] and not stats["open"] or time.time() > deadline:
                return stats
            time.sleep(0.05)

    def said(self):
        """What the relay saw, in a line (for a failed run's error)."""
        try:
            stats = self.stats(settle_s=2)
        except (OSError, ValueError):
            return ""
        point = stats["point"]
        return (f" [relay: point {'reached' if point.get('reached') else 'not reached'}, "
                f"{len(stats['connections'])} connection(s): "
                + "; ".join(str(c["ended"]) for c in stats["connections"]) + "]")

    def row(self, stats, started):
        """The result fields the relay gives a run (`started`: the migrate request, unix s)."""
        conns = stats["connections"]
        point = stats["point"]
        applied = stats.get("fault_applied") or {}
        first = conns[0] if conns else {}
        return {
            "relay_fault": stats["fault"],
            "relay_bytes": stats["bytes_to_destination"] + stats["bytes_to_source"],
            "relay_bytes_to_destination": stats["bytes_to_destination"],
            "relay_bytes_to_source": stats["bytes_to_source"],
            "relay_connections": len(conns),
            "relay_still_open": stats["open"],
            "point_reached": point.get("reached", False),
            "point_ms": (point["unix"] - started) * 1e3 if point.get("reached") else None,
            "point_pages": point.get("pages_sent"),
            "round0_pages": point.get("round0_pages"),
            "fault_applied": applied.get("what"),
            "stall_ms": ((applied["ended_unix"] - applied["began_unix"]) * 1e3
                         if applied.get("ended_unix") else None),
            # How the first connection ended, and when, from the point on.
            "first_connection_ended": first.get("ended"),
            "first_connection_closed_ms_after_point": (
                (first["closed_unix"] - point["unix"]) * 1e3
                if first.get("closed_unix") and point.get("reached") else None),
            "relay_connection_log": conns,
        }


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--listen", default="127.0.0.1")
    p.add_argument("--target", required=True, help="HOST:PORT of the destination")
    p.add_argument("--fault", choices=FAULTS, default="cut")
    p.add_argument("--at", type=int, default=80, help="percent of round 0's pages")
    p.add_argument("--stall-s", type=float, default=30.0)
    p.add_argument("--stats", required=True)
    args = p.parse_args()
    host, _, port = args.target.rpartition(":")
    relay = Relay(args.listen, (host, int(port)), args.fault, args.at, args.stall_s, args.stats)
    signal.signal(signal.SIGTERM, lambda *_: (relay.write_stats(), os._exit(0)))
    print(f"port {relay.port()}", flush=True)
    relay.serve()


if __name__ == "__main__":
    main()
