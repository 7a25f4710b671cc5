"""The balloon profile's guest (issue #28, docs/balloon.md): a churning working set after a
large first peak, with no balloon, with dynamic self-ballooning (DSB) and with a balloon that
only reports free pages (and hints them, where the VMM and the guest do). Here: what each
variant asks of the guest and of each VMM, and what a run measures on the guest's console
before the move (both VMMs alike): that the guest settled, its work rate, its working set."""
import time

from .util import GUEST, BenchError, wait_until

PAGE = 4096

# QEMU's balloon, as an expert sets it for a move: free page hinting (which needs an I/O
# thread) and free page reporting; deflate-on-oom, which ferry's balloon offers by default (a
# DSB guest deflates below the target when it runs short). QEMU runs its microvm machine here
# (virtio-mmio, as ferry's devices: the guest finds both on its command line).
QEMU_BALLOON = ["-object", "iothread,id=balloon-io",
                "-device", "virtio-balloon-device,iothread=balloon-io,free-page-hint=on,"
                           "free-page-reporting=on,deflate-on-oom=on"]
QEMU_MACHINE = "microvm,acpi=off"
QEMU_GLOBAL = ["-global", "virtio-mmio.force-legacy=false"]

# Per variant: the guest's words on ferry and on QEMU, and each VMM's device arguments (both
# sides of a move). `off` has no balloon device at all. `hint` is the balloon driver without
# DSB: free page reporting, and free page hinting where the VMM asks for hints (a ferry
# without hinting leaves it at reporting). QEMU leaves a hinted page as it last sent it, so its
# guest accepts any content in a page hinted free (`hint_any`); ferry gives such pages back
# (they read zero), so its guest still checks them.
VARIANTS = {
    "off": {"ferry_words": "", "qemu_words": "", "ferry_args": [], "qemu_args": []},
    "dsb": {"ferry_words": "dsb dsb_ms=1000", "qemu_words": "dsb dsb_ms=1000 hint_any",
            "ferry_args": ["--balloon"], "qemu_args": QEMU_BALLOON},
    "hint": {"ferry_words": "balloon", "qemu_words": "balloon hint_any",
             "ferry_args": ["--balloon"], "qemu_args": QEMU_BALLOON},
}

# DSB has settled once the balloon holds this share of the memory the guest does not use
# (balloon ÷ (balloon + free)); it inflates with 95 % of it every dsb_ms.
DSB_SHARE = 0.8


def guest_knows(word):
    """Whether the guest image parses `word` (an older image stops on a word it lacks)."""
    try:
        with open(GUEST, "rb") as f:
            return word.encode() in f.read()
    except OSError:
        return False


def words(text, known):
    """`text`'s words, less those the guest image does not know (`known`: word → bool)."""
    return " ".join(w for w in text.split() if known.get(w, True))


def sizes(memory):
    """(ws, peak) in MiB for a guest of `memory` MiB: a 512 MiB working set (an eighth of a
    smaller guest), and a first peak of nearly all the memory (3800 MiB of 4 GiB)."""
    return min(512, memory // 8), memory * 3800 // 4096


def settle(clock, scenario):
    """Once the guest's first churn pass is over (the peer waited for it): with DSB, waits
    until the balloon holds most free memory; then counts the guest's work over a fixed
    window. Returns what the console said at the move (None for scenarios without
    `balloon`)."""
    b = scenario.get("balloon")
    if not b:
        return None
    began = time.time()
    wait_until("the churn's first pass on the console", 30,
               lambda: clock.guest_error() or clock.counter("passes") >= 1)
    if b["variant"] == "dsb":
        wait_until("DSB to take most free memory", b["settle_s"],
                   lambda: clock.guest_error() or (share(clock.counters()[1]) or 0) >= DSB_SHARE)
    settled_s = time.time() - began
    t0, c0 = clock.counters()
    time.sleep(b["window_s"])
    clock.guest_error()
    t1, c1 = clock.counters()
    if t0 is None or t1 is None or t1 <= t0:
        raise BenchError("no guest progress line across the rate window")
    estimate = ws_estimate(c1.get("pages", 0), c1.get("passes", 0), b)
    ws, how = c1.get("ws_pages"), "serial"
    if ws is None:
        ws, how = estimate, "estimated from pages="
    first = clock.note("ferry-guest: churn first pass ms=")
    return {
        "variant": b["variant"],
        "first_pass_ms": int(first.rsplit("=", 1)[1]) if first else None,
        "settle_s": settled_s,
        # Pages the guest took, freed and rewrote per second over the window before the move.
        "guest_pages_per_s": (c1.get("pages", 0) - c0.get("pages", 0)) / (t1 - t0),
        "ws_pages": ws,
        "ws_from": how,
        "ws_pages_estimate": estimate,  # beside the console's figure, where it has one
        "balloon_pages": c1.get("balloon_pages"),
        "free_pages": c1.get("free_pages"),
        "reported_pages": c1.get("reported"),
        "hinted_pages": c1.get("hinted"),
        "balloon_share": share(c1),
        "errors_before": c1.get("errors"),
    }


def share(counters):
    """The balloon's share of the memory the guest does not use, or None without a balloon."""
    held, free = counters.get("balloon_pages"), counters.get("free_pages")
    if held is None or free is None or held + free == 0:
        return None
    return held / (held + free)


def ws_estimate(pages, passes, b):
    """churn's working set (pages) from its `pages=` counter, for a guest that does not print
    `ws_pages=` (it does only with a balloon). Each take or free of a page counts 1, and every
    16th rewrites 4 pages of the set: ops ≈ pages ÷ 1.25 (to within a few pages). The first
    cycle grows from 0 to the peak and shrinks to a quarter of ws; every later one grows to ws
    and shrinks back."""
    peak, high = b["peak_pages"], b["ws_pages"]
    low = max(1, high // 4)
    ops = round(pages / 1.25)
    first = peak + (peak - low)
    if passes < 1 or ops < first:
        return None
    x = (ops - first) % (2 * (high - low))
    return low + x if x <= high - low else high - (x - (high - low))


def row(settled, wire_bytes, destination=None):
    """The result fields of a run's `settle`, bytes on the link per byte of working set, and
    what the guest's console said on the destination after the move (`destination`: its
    SerialClock): the balloon's counters go on there, as guest memory does."""
    if not settled:
        return {}
    ws = settled["ws_pages"] * PAGE if settled["ws_pages"] else None
    after = destination.counters()[1] if destination else {}
    return {**settled, "ws_bytes": ws, "bytes_per_ws": wire_bytes / ws if ws and wire_bytes else None,
            **{f"{k}_after": after.get(c) for k, c in (("balloon_pages", "balloon_pages"),
                                                       ("reported_pages", "reported"),
                                                       ("hinted_pages", "hinted"))}}
