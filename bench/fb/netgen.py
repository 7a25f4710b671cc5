"""The forwarding benchmark's traffic: run inside the test bed's namespace, it sends
sequence-numbered frames to the VM's MAC at a steady rate on one interface and records every
frame that comes back forwarded, then prints one JSON line: frames sent and received, frames
lost, and the longest time between two forwarded frames (the network-visible outage).

    netgen.py IFACE VM_MAC RATE SECONDS"""
import json
import socket
import struct
import sys
import threading
import time

GEN_MAC = bytes([0x02, 0, 0, 0, 0, 0x98])
ETHERTYPE = 0x88B5


def main():
    iface, vm_mac, rate, seconds = sys.argv[1], bytes.fromhex(sys.argv[2].replace(":", "")), \
        int(sys.argv[3]), float(sys.argv[4])
    s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(0x0003))
    s.bind((iface, 0))
    s.settimeout(0.1)
    arrivals = []
    stop = threading.Event()

    def receive():
        while not stop.is_set():
            try:
                f = s.recv(2048)
            except socket.timeout:
                continue
            if len(f) >= 22 and f[0:6] == GEN_MAC and f[12:14] == struct.pack(">H", ETHERTYPE):
                arrivals.append((struct.unpack(">Q", f[14:22])[0], time.monotonic()))

    rx = threading.Thread(target=receive)
    rx.start()
    head = vm_mac + GEN_MAC + struct.pack(">H", ETHERTYPE)
    pad = bytes(64 - 22)
    began = time.monotonic()
    total = int(rate * seconds)
    for seq in range(total):
        due = began + seq / rate
        now = time.monotonic()
        if due > now:
            time.sleep(due - now)
        s.send(head + struct.pack(">Q", seq) + pad)
    send_s = time.monotonic() - began
    time.sleep(0.3)  # late frames
    stop.set()
    rx.join()
    got = sorted({seq for seq, _ in arrivals})
    times = sorted(t for _, t in arrivals)
    gaps = [b - a for a, b in zip(times, times[1:])]
    print(json.dumps({
        "sent": total, "received": len(got), "lost": total - len(got),
        "offered_per_s": total / send_s,
        "longest_gap_ms": max(gaps) * 1e3 if gaps else None,
        "first_ms": (times[0] - began) * 1e3 if times else None,
    }))


if __name__ == "__main__":
    main()
