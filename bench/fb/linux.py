"""The Linux guest (`make linux-guest`: Debian's 6.12 kernel, an ext2 root on virtio-blk, the
syscall-free /init that stamps and verifies 16 MiB natively in user mode) moved by ferry and by
QEMU 10 (the microvm machine): the same kernel, root filesystem and command line on both
(QEMU adds its devices' words to it), ferry's CPU-model words included (this host's KVM shows
the vCPUs the processor's features whatever a VMM's CPU model says, so ferry tells Linux on
its command line what not to use; QEMU's guest needs the same words).

Both VMMs run in a network namespace of their own and move over its loopback, whose
received-bytes counter is the bytes on the link for both; both sides open one root file
(shared storage). Measured the same way for both:

- total: from the request (`ferry migrate`, QMP `migrate`) to the destination's word that the
  VM runs (ferry's `resumed_at_unix_ns`, QEMU's RESUME event), both on this host's clock;
- the guest's stall at the switch: the writer's progress counter, read out of the guest's
  memory (each VMM's memfd) by a real-time process of this host every ~0.2 ms on both sides
  (its longest gap between two readings is reported: the instrument's resolution), from the
  last moment the source's counter moved to the first moment the destination's passed it,
  and the part of it after the destination's VMM said the VM runs (ferry's
  `resumed_at_unix_ns`, QEMU's RESUME event); and the longest time the counter stood still
  anywhere in the move (source before the switch, destination for 0.5 s after);
- each VMM's own downtime figure, beside it.

After the move the writer must go on at the destination with every page it stamped intact
and its table read right from the root filesystem; a run where it does not fails."""
import json
import mmap
import os
import shutil
import struct
import subprocess
import time

from . import stall
from .ferry import settled_migration
from .qemu import QEMU, VARIANTS as QEMU_VARIANTS, QemuPeer, Qmp
from .storage import Namespace
from .util import FERRY, REPO, BenchError, wait_until

GUEST_DIR = os.path.join(REPO, "guest", "build", "linux")
MEMORY_MIB = 256
WRITER_MIB = 16
PORT = 4460
MAX_DOWNTIME_MS = 300  # ferry's default; QEMU is given the same limit
# The writer's header (guest/linux/writer.c): two magic words, then counters.
HEADER_MAGIC = 0x6672726C6E786864
FIELDS = ("pages", "passes", "errors", "first_bad", "bad_word", "progress", "file_pages",
          "file_errors")
PROGRESS_AT = 16 + 8 * FIELDS.index("progress")
WATCH_S = 120
BOOT_S = 600
# The run the results cite, and the page written from it (docs/benchmarks/).
RAW_FILE, PAGE_FILE = "linux.json", "linux.md"
METRICS = ["total_ms", "guest_stall_ms", "stall_after_resume_ms", "longest_stall_ms", "downtime_ms", "link_bytes",
           "boot_s", "sample_gap_ms"]
# QEMU variants the profile runs: as an expert sets it for a move (the downtime limit, no
# bandwidth cap) and with multifd, the sweep's pick for loopback.
PEERS = ["ferry", "qemu", "qemu-mfd2"]


VMLINUX, ROOTFS, CMDLINE = (os.path.join(GUEST_DIR, f) for f in ("vmlinux", "rootfs.ext2", "cmdline"))
# The words ferry added to the command line, as its boot showed them; QEMU's runs, which come
# after ferry's in each round, boot with them.
CPU_WORDS = {}


def cmdline():
    """The command line `make linux-guest` wrote, with the writer's size."""
    if not all(os.path.exists(p) for p in (VMLINUX, ROOTFS, CMDLINE)):
        raise BenchError(f"{GUEST_DIR} is incomplete: run `make linux-guest` first")
    with open(CMDLINE) as f:
        return f"{f.read().strip()} ferry_writer_mib={WRITER_MIB}"


def memfd_of(pid, size):
    """A read-only open of process `pid`'s guest-memory memfd (the one of `size` bytes)."""
    for fd in os.listdir(f"/proc/{pid}/fd"):
        path = f"/proc/{pid}/fd/{fd}"
        try:
            if os.readlink(path).startswith("/memfd:") and os.stat(path).st_size == size:
                return os.open(path, os.O_RDONLY)
        except OSError:
            continue
    return None


def find_header(fd, size):
    """Where the writer's header lies in guest memory (its page starts with the magic and the
    magic ^ 1), or None before /init runs."""
    magic = struct.pack("<QQ", HEADER_MAGIC, HEADER_MAGIC ^ 1)
    with mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ) as m:
        at = m.find(magic)
        while at >= 0 and at % 4096:
            at = m.find(magic, at + 1)
    return None if at < 0 else at


def header(fd, at):
    words = struct.unpack("<8Q", os.pread(fd, 64, at + 16))
    return dict(zip(FIELDS, words))


class GuestSide:
    """A VMM process running (or waiting for) the guest, and its guest memory."""
    LOOK_EVERY_S = 0.01

    def __init__(self, pid, serial):
        self.pid, self.serial, self.fd, self.next_look = pid, serial, None, 0.0

    def memory(self):
        """The guest memory's file, once the VMM has made it (looked for every 10 ms at most:
        a ferry destination makes it as the move begins)."""
        now = time.monotonic()
        if self.fd is None and now >= self.next_look:
            self.fd, self.next_look = memfd_of(self.pid, MEMORY_MIB << 20), now + self.LOOK_EVERY_S
        return self.fd

    def close(self):
        if self.fd is not None:
            os.close(self.fd)


def boot_seconds(serial):
    """The kernel's clock when it ran /init (its console line), or None."""
    try:
        with open(serial, errors="replace") as f:
            line = next((x for x in f if "Run /init as init process" in x), None)
    except OSError:
        return None
    return float(line.split("]")[0].strip("[ ")) if line else None


def cpu_words(serial):
    """The words ferry appended to the command line (`noxsave clearcpuid=…`), from the line
    where Linux echoes it."""
    with open(serial, errors="replace") as f:
        line = next((x for x in f if "Command line:" in x), "")
    return " ".join(w for w in line.split() if w == "noxsave" or w.startswith("clearcpuid="))


def sample(src_pid, dst_pid, at, timeout):
    """The writer's progress counter on both sides, through each VMM's memfd
    (`stall.ProgressWatch("linux", …)`)."""
    def reader(side):
        def read():
            fd = side.memory()
            return None if fd is None else struct.unpack("<Q", os.pread(fd, 8, at + PROGRESS_AT))[0]
        return read
    return stall.sample_counters(reader(GuestSide(src_pid, None)), reader(GuestSide(dst_pid, None)), timeout)


def wait_writer(side, passes, what, timeout=BOOT_S, at=None):
    """Waits for the writer to have made `passes` passes; returns where its header is and
    what it says. Until `at` is known the header is looked for every 2 s (a scan of the guest's
    memory)."""
    deadline = time.time() + timeout
    while at is None:
        fd = side.memory()
        at = None if fd is None else find_header(fd, MEMORY_MIB << 20)
        if at is None:
            if time.time() > deadline:
                raise BenchError(f"{what}: /init did not run within {timeout} s")
            time.sleep(2)

    def done():
        h = header(side.memory(), at)
        return h if h["passes"] >= passes else None
    return at, wait_until(what, max(deadline - time.time(), 1), done, interval=0.5)


class FerryLinux:
    """`ferry run --kernel` on the guest (no other flag than its devices), and `ferry migrate`
    with no flag."""

    def __init__(self, procs, work, ns, root, line):
        self.procs, self.work, self.ns, self.root = procs, work, ns, root
        self.api = os.path.join(work, f"lsrc-{time.time_ns()}.sock")
        serial = os.path.join(work, f"lsrc-{time.time_ns()}.serial")
        p = procs.start([FERRY, "run", "--kernel", VMLINUX, "--cmdline", line, "--memory",
                         f"{MEMORY_MIB}M", "--memory-backend", "memfd", "--disk", f"path={root}",
                         "--api-socket", self.api, "--serial", serial, "--plain-tcp"],
                        netns=ns, stderr=open(os.path.join(work, "lsrc.err"), "ab"))
        self.side = GuestSide(p.pid, serial)

    def destination(self):
        self.dst_api = os.path.join(self.work, f"ldst-{time.time_ns()}.sock")
        p = self.procs.start([FERRY, "run", "--incoming", f"tcp:127.0.0.1:{PORT}", "--disk",
                              f"path={self.root}", "--api-socket", self.dst_api, "--serial",
                              "/dev/null", "--plain-tcp"],
                             netns=self.ns, stderr=open(os.path.join(self.work, "ldst.err"), "ab"))
        wait_until("the destination's API", 30, lambda: os.path.exists(self.dst_api))
        return GuestSide(p.pid, None)

    def move(self):
        """Moves the VM; (total ms, the VMM's downtime ms). Keeps when the destination said
        the VM runs (`resumed_at`, host time)."""
        asked = time.time()
        out = subprocess.run([FERRY, "migrate", "--api-socket", self.api, "--to",
                              f"tcp:127.0.0.1:{PORT}", "--json"],
                             capture_output=True, text=True, timeout=BOOT_S)
        if out.returncode != 0:
            raise BenchError(f"ferry migrate failed: {out.stderr.strip()}")
        report = json.loads(out.stdout)
        status = settled_migration(self.dst_api)
        self.breakdown = {"source": report.get("breakdown"), "destination": status.get("breakdown")}
        self.resumed_at = status["resumed_at_unix_ns"] / 1e9
        return (self.resumed_at - asked) * 1e3, report.get("downtime_ms")


class QemuLinux:
    """QEMU's microvm on the guest, its memory a shared memfd (so that the host reads the
    writer's counter as it does ferry's), `variant` set on both sides before `migrate`.
    Without ACPI (`MACHINE`): QEMU names its virtio-mmio devices on the kernel's command
    line, as in the bench's other microvm rows; with ACPI this kernel printed nothing within
    minutes under QEMU here. QEMU's default CPU model (`qemu64`) plus `xsaveerptr` (`CPU`):
    without it an AMD vendor makes Linux clear x87 state with `fnclex` on every FPU restore,
    which this host's instruction emulator cannot run ("KVM internal error" at /init's start);
    `-cpu host` is refused here (KVM will not set MSR 0x10a)."""
    MACHINE = "microvm,acpi=off"
    CPU = "qemu64,+xsaveerptr"

    def __init__(self, procs, work, ns, root, line, variant):
        self.procs, self.work, self.ns, self.root = procs, work, ns, root
        if "words" not in CPU_WORDS:
            raise BenchError("ferry's run comes first: its boot shows the CPU-model words")
        self.cmdline = f"{line} {CPU_WORDS['words']}".strip()
        self.peer = QemuPeer(procs, work, variant)
        self.spec = QEMU_VARIANTS[variant]
        self.scenario = {"name": "linux", "mode": "precopy", "memory": f"{MEMORY_MIB}M",
                         "cmdline": "", "max_downtime_ms": MAX_DOWNTIME_MS, "timeout_s": 120}
        serial = os.path.join(work, f"qsrc-{time.time_ns()}.serial")
        self.qmp, pid = self._start("qsrc", serial, [])
        self.side = GuestSide(pid, serial)

    def _start(self, tag, serial, incoming):
        qmp = os.path.join(self.work, f"{tag}-{time.time_ns()}.qmp")
        argv = [QEMU, "-enable-kvm", "-cpu", self.CPU, "-nodefaults", "-display", "none", "-m", str(MEMORY_MIB),
                "-smp", "1", "-M", f"{self.MACHINE},memory-backend=ram0",
                "-object", f"memory-backend-memfd,id=ram0,size={MEMORY_MIB}M,share=on",
                "-kernel", VMLINUX, "-append", self.cmdline,
                "-drive", f"file={self.root},format=raw,if=none,id=d0",
                "-device", "virtio-blk-device,drive=d0",
                "-serial", f"file:{serial or '/dev/null'}", "-qmp", f"unix:{qmp},server=on,wait=off",
                *incoming]
        p = self.procs.start(argv, netns=self.ns,
                             stderr=open(os.path.join(self.work, f"qemu-{tag}.err"), "ab"))
        return Qmp(qmp), p.pid

    def destination(self):
        # `defer`: multifd must be set before the destination listens.
        self.dst, pid = self._start("qdst", None, ["-incoming", "defer"])
        return GuestSide(pid, None)

    def move(self):
        for qmp in (self.qmp, self.dst):
            self.peer.configure(qmp, self.scenario, self.spec)
        self.dst.cmd("migrate-incoming", uri=f"tcp:127.0.0.1:{PORT}")
        asked = time.time()
        info = self.peer.migrate(self.qmp, self.scenario, self.spec, f"tcp:127.0.0.1:{PORT}")
        self.resumed_at = self.dst.event_time("RESUME", 30)
        return (self.resumed_at - asked) * 1e3, info.get("downtime")


def linux_run(procs, work, peer):
    """One move of the Linux guest by `peer` (ferry, or a QEMU variant)."""
    line = cmdline()
    root = os.path.join(work, f"root-{time.time_ns()}.ext2")
    shutil.copy(ROOTFS, root)
    sides = []
    try:
        with Namespace(f"flx-{os.getpid() % 100000}") as ns:
            vm = (FerryLinux(procs, work, ns.name, root, line) if peer == "ferry" else
                  QemuLinux(procs, work, ns.name, root, line, peer))
            sides.append(vm.side)
            at, before = wait_writer(vm.side, 3, "the writer's first passes")
            if peer == "ferry":
                CPU_WORDS["words"] = cpu_words(vm.side.serial)
            dst = vm.destination()
            sides.append(dst)
            sent = ns.lo_bytes()
            watch = stall.ProgressWatch("linux", [vm.side.pid, dst.pid, at, WATCH_S], WATCH_S)
            total_ms, downtime_ms = vm.move()
            figures = watch.wait_resumed(vm.resumed_at)
            link_bytes = ns.lo_bytes() - sent
            _, after = wait_writer(dst, before["passes"] + 3, "the writer at the destination", 120, at)
            if after["errors"] or after["file_errors"]:
                raise BenchError(f"the writer found errors after the move: {after}")
            return {"peer": peer, "total_ms": total_ms, "downtime_ms": downtime_ms,
                    "link_bytes": link_bytes, "boot_s": boot_seconds(vm.side.serial),
                    "writer_errors": after["errors"], "file_errors": after["file_errors"],
                    "cmdline_words": CPU_WORDS["words"],
                    "breakdown": getattr(vm, "breakdown", None), **figures}
    finally:
        procs.stop_all()
        for side in sides:
            side.close()
        os.unlink(root)


# ferry against QEMU: (metric, the goal for ferry / QEMU's best).
GOALS = (("total_ms", 0.7), ("guest_stall_ms", 0.5), ("link_bytes", 1.0))


def against_best(rows):
    """For each goal's metric, ferry's median over the best QEMU variant's median (the lowest
    for that metric alone)."""
    med = lambda row, m: (row["summary"].get(m) or {}).get("median")  # noqa: E731
    ferry = next((r for r in rows if r["vmm"] == "ferry"), None)
    qemus = [r for r in rows if r["vmm"].startswith("qemu") and r["runs"]]
    out = []
    for metric, goal in GOALS:
        measured = [(med(q, metric), q["vmm"]) for q in qemus if med(q, metric) is not None]
        mine = ferry and med(ferry, metric)
        if not measured or mine is None:
            continue
        best, name = min(measured)
        out.append({"metric": metric, "versus": name, "goal": goal,
                    "ratio": mine / best if best else None})
    return out
