"""Storage migration (`ferry migrate --copy-storage`) against QEMU's way of doing it: the disk
moves with its VM to a host whose disk is its own, empty and as large (a sparse file), while
the guest stamps the disk's first MiB (`blk`) and writes 16 MiB of memory. The disk's data is
pseudo-random (nothing compresses it), or a file system of this host's files (`files` rows).

- ferry: `ferry migrate --copy-storage`: the blocks travel in the migration's own stream.
- QEMU 10 (microvm), as libvirt's `--copy-storage-all` drives it: the destination exports its
  disk over NBD (`nbd-server-start`, `block-export-add`, writable); the source mirrors onto it
  (`blockdev-add` of the NBD node, `blockdev-mirror sync=full copy-mode=write-blocking`: once
  ready, every guest write reaches both disks); then `migrate` (downtime limit 300 ms, as
  ferry's default); once the destination runs, `block-job-cancel` and `nbd-server-stop`.

Both VMMs run inside a network namespace of their own and move over its loopback (as it is,
or shaped to 1 Gbit/s with tbf, as the other profiles' veth links are), whose received-bytes
counter (`/proc/net/dev`) is the bytes on the link for both: every migration and NBD byte,
TCP/IP headers included. Total: from the request (ferry's `migrate`, QEMU's mirror) to
the destination's word that the VM runs (ferry's `resumed_at_unix_ns`, QEMU's RESUME event),
both on this host's clock. Downtime: each VMM's own. After the move every stamped sector is read
back on the destination and must carry its last stamp, and the target past the stamped MiB must
equal the source byte for byte (`cmp`)."""
import json
import os
import subprocess
import time

from .devices import MIGRATION_PORT, VMS
from .ferry import settled_migration
from .links import shape, sh
from .qemu import VARIANTS as QEMU_VARIANTS
from .serial import SerialClock
from .util import FERRY, BenchError, wait_until

BLK_SECTORS = 2048
CMDLINE = f"write ws=16M seq blk blk_sectors={BLK_SECTORS}"
NBD_PORT = MIGRATION_PORT + 1
# Where the disk's data starts: past the guest's stamped MiB.
DATA_AT = 64 << 20
DISK = {
    "ferry": lambda path: ["--disk", f"path={path}"],
    # A node name of our own, for the NBD export and the mirror.
    "qemu": lambda path: ["-blockdev", f"driver=file,filename={path},node-name=disk0",
                          "-device", "virtio-blk-device,drive=disk0"],
}
# The run the results cite, and the page written from it (docs/benchmarks/).
RAW_FILE, PAGE_FILE = "storage.json", "storage.md"
METRICS = ["total_ms", "downtime_ms", "link_bytes", "blk_errors", "mirror_ms", "guest_downtime_ms", "data_mib"]


# What a row's key holds where its run predates that part of the key.
KEY_DEFAULTS = {"link": "loopback", "content": "random"}
# The files a `files` disk holds: this host's shared data (documentation, locales, icons,
# scripts), as a distribution's root file system holds them.
FILES_FROM = "/usr/share"


def sizes(disk_mib, used_mib, link="loopback", content="random"):
    """A row's key: the disk, its data, the link (`loopback`, or a speed of links.SPEEDS the
    namespace's loopback is shaped to) and what the data is: `random` (`used_mib` of
    pseudo-random bytes, which nothing compresses) or `files` (an ext4 file system of
    `FILES_FROM`'s files; `used_mib` is then what the file system took)."""
    return {"disk_mib": disk_mib, "used_mib": used_mib, "link": link, "content": content}


def same_row(a, b):
    """Whether two rows moved the same disk over the same link."""
    keys = ("disk_mib", "used_mib", "link", "content")
    return all(a.get(k, KEY_DEFAULTS.get(k)) == b.get(k, KEY_DEFAULTS.get(k)) for k in keys)


def make_disks(work, disk_mib, used_mib, content="random"):
    """A sparse source disk and an empty target as large: with `used_mib` of pseudo-random
    data from `DATA_AT` (neither side compresses it), or a file system of files."""
    if content == "files":
        return make_files_disks(work, disk_mib)
    src, dst = os.path.join(work, "source.img"), os.path.join(work, "target.img")
    chunk = os.urandom(1 << 20)
    with open(src, "wb") as f:
        f.truncate(disk_mib << 20)
        f.seek(DATA_AT)
        for i in range(used_mib):
            f.write(chunk[i % 4093:] + chunk[:i % 4093])
    with open(dst, "wb") as f:
        f.truncate(disk_mib << 20)
    return src, dst


def make_files_disks(work, disk_mib):
    """A source disk holding an ext4 file system of `FILES_FROM` (made once per run of the
    profile, copied sparse for each move), and an empty target as large."""
    image = os.path.join(work, f"files-{disk_mib}.img")
    if not os.path.exists(image):
        sh("mke2fs", "-q", "-F", "-t", "ext4", "-d", FILES_FROM, image, f"{disk_mib}M")
        # The sectors the guest stamps start as zeros, as on the other disks: it counts a
        # sector that holds anything but its own stamp as wrong (the file system's first
        # metadata is lost to its stamps either way; its files lie past them).
        with open(image, "r+b") as f:
            f.write(bytes(BLK_SECTORS * 512))
    src, dst = os.path.join(work, "source.img"), os.path.join(work, "target.img")
    sh("cp", "--sparse=always", image, src)
    with open(dst, "wb") as f:
        f.truncate(disk_mib << 20)
    return src, dst


def allocated_mib(path):
    """What a sparse file holds, in MiB."""
    return os.stat(path).st_blocks * 512 / (1 << 20)


class Namespace:
    """A network namespace with its loopback up (shaped to `link`'s speed unless it is
    `loopback`), removed when left."""

    def __init__(self, name, link):
        self.name, self.link = name, link

    def __enter__(self):
        subprocess.run(["ip", "netns", "del", self.name], capture_output=True)
        sh("ip", "netns", "add", self.name)
        sh("ip", "-n", self.name, "link", "set", "lo", "up")
        if self.link != "loopback":
            shape(self.name, "lo", self.link)
        return self

    def __exit__(self, *exc):
        subprocess.run(["ip", "netns", "del", self.name], capture_output=True)

    def lo_bytes(self):
        """Bytes received on the namespace's loopback so far."""
        out = sh("ip", "netns", "exec", self.name, "cat", "/proc/net/dev").stdout
        line = next(x for x in out.splitlines() if x.strip().startswith("lo:"))
        return int(line.split(":", 1)[1].split()[0])


def storage_run(procs, work, vmm, disk_mib, used_mib, link="loopback", content="random"):
    """One move of a VM and its disk on `vmm` (ferry or qemu) over `link`."""
    src, dst = make_disks(work, disk_mib, used_mib, content)
    data_mib = allocated_mib(src)
    try:
        with Namespace(f"fst-{os.getpid() % 100000}", link) as ns:
            vm = VMS[vmm](procs, work, ns.name, CMDLINE, DISK[vmm](src))
            wait_until("the first disk writes", 60, lambda: vm.counter("blk_writes") > BLK_SECTORS)
            before = ns.lo_bytes()
            moved = MOVES[vmm](vm, ns.name, dst)
            link_bytes = ns.lo_bytes() - before
            reads = vm.counter("blk_reads")
            wait_until("every sector read back on the destination", 60,
                       lambda: vm.counter("blk_reads") > reads + BLK_SECTORS)
            same = subprocess.run(["cmp", "-s", "-i", str(BLK_SECTORS * 512), src, dst]).returncode == 0
            if not same:
                raise BenchError("the target differs from the source past the stamped sectors")
            return {"vmm": vmm, "mode": "precopy", **sizes(disk_mib, used_mib, link, content),
                    "data_mib": data_mib, "link_bytes": link_bytes,
                    "blk_errors": vm.counter("blk_errors"), "target_equal": same, **moved}
    finally:
        procs.stop_all()
        for path in (src, dst):
            os.unlink(path)


def ferry_move(vm, netns, target):
    dst = os.path.join(vm.work, f"vdst-{time.time_ns()}.sock")
    url = f"tcp:127.0.0.1:{MIGRATION_PORT}"
    vm.procs.start([FERRY, "run", "--incoming", url, *DISK["ferry"](target), "--api-socket", dst,
                    "--serial", "/dev/null", "--plain-tcp"],
                   netns=netns, stderr=open(os.path.join(vm.work, "vdst.err"), "ab"))
    wait_until("the destination's API", 30, lambda: os.path.exists(dst))
    asked = time.time()
    out = subprocess.run([FERRY, "migrate", "--api-socket", vm.api, "--to", url, "--copy-storage", "--json"],
                         capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise BenchError(f"ferry migrate failed: {out.stderr.strip()}")
    report = json.loads(out.stdout)
    status = settled_migration(dst)
    vm.api = dst
    return {"total_ms": (status["resumed_at_unix_ns"] / 1e9 - asked) * 1e3,
            "downtime_ms": report.get("downtime_ms"),
            "guest_downtime_ms": status.get("guest_observed_downtime_ms"),
            "storage": report.get("storage"), "breakdown": report.get("breakdown")}


def qemu_move(vm, netns, target):
    scenario = dict(vm.scenario, mode="precopy", name="storage", timeout_s=600)
    url = f"tcp:127.0.0.1:{MIGRATION_PORT}"
    clock = SerialClock()
    dst = vm.peer.start("vdst", scenario, clock, netns, incoming=url, machine=vm.MACHINE,
                        extra=["-global", "virtio-mmio.force-legacy=false", *DISK["qemu"](target)])
    spec = QEMU_VARIANTS["qemu"]
    vm.peer.configure(vm.qmp, scenario, spec)
    vm.peer.configure(dst, scenario, spec)
    nbd = {"type": "inet", "host": "127.0.0.1", "port": str(NBD_PORT)}
    dst.cmd("nbd-server-start", addr={"type": "inet", "data": {"host": "127.0.0.1", "port": str(NBD_PORT)}})
    dst.cmd("block-export-add", type="nbd", id="exp0", writable=True, **{"node-name": "disk0"})
    asked = time.time()
    src = vm.qmp
    src.cmd("blockdev-add", driver="nbd", server=nbd, export="disk0", **{"node-name": "target0"})
    src.cmd("blockdev-mirror", device="disk0", target="target0", sync="full",
            **{"job-id": "m0", "copy-mode": "write-blocking"})
    wait_until("the mirror to be ready", scenario["timeout_s"],
               lambda: any(j["device"] == "m0" and j.get("ready") for j in src.cmd("query-block-jobs")),
               interval=0.01)
    mirrored = time.time()
    info = vm.peer.migrate(src, scenario, spec, url)
    resumed = dst.event_time("RESUME", 30)
    src.cmd("block-job-cancel", device="m0")
    dst.cmd("nbd-server-stop")
    vm.qmp, vm.clock = dst, clock
    return {"total_ms": (resumed - asked) * 1e3, "mirror_ms": (mirrored - asked) * 1e3,
            "downtime_ms": info.get("downtime"), "guest_downtime_ms": None}


MOVES = {"ferry": ferry_move, "qemu": qemu_move}


def median(row, metric):
    s = row["summary"].get(metric)
    return s["median"] if s else None


def ratios(rows):
    """ferry / QEMU medians per disk size and link, for the rows both moved."""
    out = []
    for r in rows:
        if r["vmm"] != "ferry":
            continue
        q = next((x for x in rows if x["vmm"] == "qemu" and same_row(x, r)), None)
        if not q:
            continue
        pair = sizes(r["disk_mib"], r["used_mib"], *(r.get(k, KEY_DEFAULTS[k]) for k in ("link", "content")))
        for m in ("total_ms", "downtime_ms", "link_bytes"):
            a, b = median(r, m), median(q, m)
            pair[m] = a / b if a is not None and b else None
        out.append(pair)
    return out

