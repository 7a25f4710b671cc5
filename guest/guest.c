/*
 * ferry's workload guest: touches one 8-byte word per 4 KiB page of a working set, forever,
 * and reports progress through heartbeats. It polls; it needs no interrupts or timers.
 * Command line words (PVH start_info cmdline):
 *   idle | write | read | churn  workload (default idle); churn: a working set that grows
 *                                and shrinks, page by page from an allocator (see "the churn
 *                                workload" below)
 *   ws=SIZE                      working set, e.g. 64M, 1G (default 64M); with churn its
 *                                largest size (it shrinks to a quarter of it)
 *   peak=SIZE                    churn: the first cycle grows to SIZE instead (memory the
 *                                guest touched once and then freed)
 *   balloon                      drive the virtio-balloon: follow the host's target, report
 *                                freed pages, hint free pages when the host asks, give
 *                                memory statistics (see "the balloon")
 *   balloon_flood                a hostile balloon driver (implies balloon): vCPU 0 keeps
 *                                one inflate request in flight, a chain of 16 buffers each
 *                                naming 65536 scattered pages (a million in all), and posts
 *                                the next as soon as one comes back; nothing else of the
 *                                balloon is driven
 *   hint_any                     pages that come back from a free page hint may hold any
 *                                content (the spec's rule; QEMU leaves them as last sent)
 *                                instead of zero or their last stamp
 *   dsb                          dynamic self-ballooning (implies balloon): every dsb_ms
 *                                inflate with dsb_pct % of free memory, deflate at once when
 *                                the allocator runs short (with churn: from the end of its
 *                                first cycle on)
 *   dsb_ms=N                     the balloon's period in ms (default 5000)
 *   dsb_pct=N                    the share of free memory DSB inflates with (default 95)
 *   seq | random | zipf          page order (default seq); zipf: after the first pass (in
 *                                order), pages hot and cold by Zipf's law (see "zipf")
 *   reads=N                      write: N % of the steady state's touches only read
 *   user                         run the workload in user mode (ring 3): on a host whose KVM
 *                                emulates guest kernels (PVM), user mode runs natively, so
 *                                memory is written at the CPU's speed, not the emulator's
 *                                (no blk, net or balloon: their drivers stay in the kernel)
 *   verify                       stamp every page, check every stamp
 *   fill=word|random|mixed|fresh|real
 *                                page content (default word), see "page content" below;
 *                                real: pages of real processes' memory (guest-app.elf only)
 *   rate=N                       at most N pages/s in total
 *   vcpus=N                      vCPUs sharing the work (started here with INIT/SIPI; at
 *                                most as many as the ACPI MADT lists)
 *   passes=N                     stop after N passes (0 = forever)
 *   hb_us=N                      heartbeat period in microseconds (default 1000)
 *   serial_ms=N                  serial progress line period (default 1000)
 *   tick_ms=N                    also an empty serial line every N ms (default 0: none): a
 *                                clock any VMM's console shows the outside world at 1 ms
 *                                resolution for one or two port writes a tick
 *   blk                          also drive a virtio-blk disk from vCPU 0 (see "the blk
 *                                workload" below)
 *   blk_sectors=N                512-byte sectors it cycles over (default 2048, at most the
 *                                disk's capacity)
 *   blk_rate=N                   at most N blk steps/s (default 2000, 0 = unlimited)
 *   blk_random                   each blk step picks its sector at random (default: in turn)
 *   net=fwd                      also forward every frame a virtio-net device receives back
 *                                out, MACs swapped, from vCPU 0 (see "the net workload" below)
 *   virtio_mmio.device=SIZE@BASE:IRQ[:ID]
 *                                a virtio-mmio device's registers at BASE, as Linux reads them
 *                                (ferry and QEMU's microvm machine write these words); the
 *                                blk and net workloads look for their device only there
 */
#include "abi.h"

typedef unsigned long long u64;
typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;

#define PAGE_SIZE 4096ull
#define MAX_CPUS 16
#define NO_LIMIT 0

struct hvm_start_info {
    u32 magic, version, flags, nr_modules;
    u64 modlist_paddr, cmdline_paddr, rsdp_paddr, memmap_paddr;
    u32 memmap_entries, reserved;
};
struct hvm_memmap_entry {
    u64 addr, size;
    u32 type, reserved;
};

enum mode { MODE_IDLE, MODE_WRITE, MODE_READ, MODE_CHURN };
enum fill { FILL_WORD, FILL_RANDOM, FILL_MIXED, FILL_FRESH, FILL_REAL };

struct config {
    enum mode mode;
    u64 ws_bytes;
    int random;
    int verify;
    u64 rate;
    u64 vcpus;
    u64 passes;
    u64 hb_us;
    u64 serial_ms;
    enum fill fill;
    int blk;
    int blk_random;
    u64 blk_sectors;
    u64 blk_rate;
    int net;          /* net=fwd */
    u64 mmio[8];      /* virtio-mmio register windows, from virtio_mmio.device= words */
    u64 mmio_count;
    u64 tick_ms;      /* empty serial lines every tick_ms (0: none) */
    u64 peak_bytes;   /* churn: the first cycle's largest working set (0: ws) */
    int balloon;      /* drive the virtio-balloon */
    int dsb;          /* dynamic self-ballooning */
    int flood;        /* balloon_flood */
    int hint_any;     /* a page back from a hint may hold anything */
    u64 dsb_ms;
    u64 dsb_pct;
    int zipf;         /* page order: Zipf-skewed after the first pass */
    u64 reads;        /* write: % of steady-state touches that only read */
    int user;         /* the workload runs in ring 3 */
};

extern char __image_end[];
extern char ap_trampoline[], ap_trampoline_end[];
extern u64 boot_pml4[], boot_pdpt[], boot_pd[];

#define MAPPED_GIB 128                  /* boot_pd's size in boot.S */
#define TRAMPOLINE_ADDR 0x9000ull       /* where APs start (SIPI vector 0x09) */
#define LAPIC 0xfee00000ull
#define MAX_SEGMENTS 8
#define E820_RAM 1

/* RAM the workload may use: the memory map's RAM above the image, in address order. */
struct segment {
    u64 base, pages;
};
static struct segment segments[MAX_SEGMENTS];
static u64 nsegments;
static volatile u32 aps_up;             /* APs that reached secondary_main */
static u64 ram_bytes;                   /* RAM in the memory map, all of it */

static struct config cfg;
static struct hb_block blocks[MAX_CPUS] __attribute__((aligned(64)));
_Static_assert(sizeof(struct hb_block) == 128, "abi.h gives the block's size");
static u32 *expected_gen;       /* verify: generation each page should carry */
static u32 *expected_blk_gen;   /* blk: generation each disk sector should carry (0: zeros) */
static u64 ws_base;             /* guest-physical address of page 0 of the working set */
static u64 ws_pages;
static u64 tsc_khz;
static volatile u64 go;         /* set by vCPU 0 once the layout is ready */
static u64 *random_pool, *text_pool; /* fill=random|mixed: content copied into pages */

#define ZIPF_REGIONS 1024ull    /* see "zipf" */
#define POOL_SLICES 1024ull     /* pages within 4 MiB draw on distinct 4 KiB of a pool */
#define POOL_BYTES (POOL_SLICES * PAGE_SIZE + PAGE_SIZE)

/*
 * fill=real draws on pages of real processes' memory (guest/sample.py takes them at build
 * time), built into guest-app.elf only: the plain image stays small, so an idle guest's
 * migration carries no sample it does not use.
 */
#ifdef MEMORY_SAMPLE
__asm__(".section .rodata.sample, \"a\"\n"
        ".balign 4096\n"
        "memory_sample:\n"
        ".incbin \"" MEMORY_SAMPLE "\"\n"
        "memory_sample_end:\n"
        ".previous\n");
extern const u8 memory_sample[], memory_sample_end[];
static u64 sample_pages(void) { return (u64)(memory_sample_end - memory_sample) / PAGE_SIZE; }
#else
static const u8 *const memory_sample = 0;
static u64 sample_pages(void) { return 0; }
#endif

/* ---- port I/O and time ---- */

static inline void outb(u16 port, u8 v) { __asm__ volatile("outb %0, %1" ::"a"(v), "Nd"(port)); }
static inline void outl(u16 port, u32 v) { __asm__ volatile("outl %0, %1" ::"a"(v), "Nd"(port)); }
static inline u8 inb(u16 port)
{
    u8 v;
    __asm__ volatile("inb %1, %0" : "=a"(v) : "Nd"(port));
    return v;
}
static inline u64 rdtsc(void)
{
    u32 lo, hi;
    __asm__ volatile("rdtsc" : "=a"(lo), "=d"(hi));
    return ((u64)hi << 32) | lo;
}
static void cpuid(u32 leaf, u32 *a, u32 *b, u32 *c, u32 *d)
{
    __asm__ volatile("cpuid" : "=a"(*a), "=b"(*b), "=c"(*c), "=d"(*d) : "a"(leaf), "c"(0));
}
static inline void cpu_relax(void) { __asm__ volatile("pause" ::: "memory"); }

/* ---- serial output ---- */

static void put_char(char c)
{
    for (int i = 0; i < 100000 && !(inb(PORT_SERIAL + 5) & 0x20); i++)
        cpu_relax();
    outb(PORT_SERIAL, (u8)c);
}
static void put_str(const char *s)
{
    while (*s)
        put_char(*s++);
}
/* The low `digits` hex digits of v, leading zeros included. */
static void put_hex_digits(u64 v, int digits)
{
    while (digits--)
        put_char("0123456789abcdef"[(v >> 4 * digits) & 15]);
}
static void put_hex(u64 v)
{
    put_str("0x");
    put_hex_digits(v, 16);
}
static void put_u64(u64 v)
{
    char buf[21];
    int i = 20;
    buf[i] = 0;
    do {
        buf[--i] = (char)('0' + v % 10);
        v /= 10;
    } while (v);
    put_str(buf + i);
}

/* A configuration error: say it on the serial line and to the VMM, then stop. */
static void fatal(const char *what, const char *word)
{
    const char *parts[] = {"ferry-guest: error: ", what, word, "\n"};
    for (unsigned p = 0; p < 4; p++)
        for (const char *s = parts[p]; *s; s++) {
            put_char(*s);
            outb(PORT_FATAL_MSG, (u8)*s);
        }
    outl(PORT_DONE, 1);
    for (;;)
        __asm__ volatile("hlt");
}

/* ---- command line ---- */

static int word_is(const char *w, u64 len, const char *lit)
{
    u64 i = 0;
    for (; i < len && lit[i]; i++)
        if (w[i] != lit[i])
            return 0;
    return i == len && lit[i] == 0;
}

/* Parses "N", "NK", "NM", "NG" after "key=". Returns 0 on a malformed number. */
static int parse_number(const char *s, u64 len, u64 *out, int allow_suffix)
{
    u64 v = 0, i = 0;
    if (len == 0)
        return 0;
    for (; i < len && s[i] >= '0' && s[i] <= '9'; i++)
        v = v * 10 + (u64)(s[i] - '0');
    if (i == 0)
        return 0;
    if (i < len) {
        if (!allow_suffix || i + 1 != len)
            return 0;
        switch (s[i]) {
        case 'K': case 'k': v <<= 10; break;
        case 'M': case 'm': v <<= 20; break;
        case 'G': case 'g': v <<= 30; break;
        default: return 0;
        }
    }
    *out = v;
    return 1;
}

/* Parses a decimal or 0x-prefixed hex number filling all of s[0..len). 0 when malformed. */
static int parse_uint(const char *s, u64 len, u64 *out)
{
    u64 v = 0, i = 0, base = 10;
    if (len > 2 && s[0] == '0' && (s[1] == 'x' || s[1] == 'X')) {
        base = 16;
        i = 2;
    }
    if (i == len)
        return 0;
    for (; i < len; i++) {
        char c = s[i];
        u64 d = c >= '0' && c <= '9' ? (u64)(c - '0')
              : base == 16 && c >= 'a' && c <= 'f' ? (u64)(c - 'a' + 10)
              : base == 16 && c >= 'A' && c <= 'F' ? (u64)(c - 'A' + 10) : 99;
        if (d >= base || v > (~0ull - d) / base)
            return 0;
        v = v * base + d;
    }
    *out = v;
    return 1;
}

/* The end of s[0..len) or the first `c` in it. */
static u64 span_to(const char *s, u64 len, char c)
{
    u64 i = 0;
    while (i < len && s[i] != c)
        i++;
    return i;
}

/*
 * "SIZE@BASE:IRQ[:ID]" (Linux's virtio_mmio.device= syntax; SIZE may end in K or M): keeps
 * BASE. The window must hold the registers up to the config space (0x100) and lie in the
 * 4 GiB the boot page tables map.
 */
static void parse_virtio_mmio(const char *s, u64 len, const char *word)
{
    u64 at = span_to(s, len, '@');
    u64 colon = at < len ? at + 1 + span_to(s + at + 1, len - at - 1, ':') : len;
    u64 size = 0, base = 0, irq = 0, scale = 1, size_len = at;
    if (size_len > 0 && (s[size_len - 1] == 'K' || s[size_len - 1] == 'k'))
        scale = 1ull << 10, size_len--;
    else if (size_len > 0 && (s[size_len - 1] == 'M' || s[size_len - 1] == 'm'))
        scale = 1ull << 20, size_len--;
    if (at == len || colon == len || !parse_uint(s, size_len, &size) ||
        !parse_uint(s + at + 1, colon - at - 1, &base) ||
        !parse_uint(s + colon + 1, span_to(s + colon + 1, len - colon - 1, ':'), &irq))
        fatal("malformed word (want virtio_mmio.device=SIZE@BASE:IRQ) ", word);
    if (size > (4ull << 30) / scale || size * scale < 0x200 || base > (4ull << 30) ||
        base + size * scale > (4ull << 30))
        fatal("virtio-mmio window too small or above 4 GiB in ", word);
    if (cfg.mmio_count == sizeof(cfg.mmio) / sizeof(cfg.mmio[0]))
        fatal("too many virtio_mmio.device= words (at most 8): ", word);
    cfg.mmio[cfg.mmio_count++] = base;
}

static void parse_word(const char *w, u64 len)
{
    static char word[64];
    u64 n = len < sizeof(word) - 1 ? len : sizeof(word) - 1;
    for (u64 i = 0; i < n; i++)
        word[i] = w[i];
    word[n] = 0;

    struct { const char *key; u64 *dst; int suffix; } numbers[] = {
        {"ws=", &cfg.ws_bytes, 1}, {"rate=", &cfg.rate, 0}, {"vcpus=", &cfg.vcpus, 0},
        {"passes=", &cfg.passes, 0}, {"hb_us=", &cfg.hb_us, 0}, {"serial_ms=", &cfg.serial_ms, 0},
        {"tick_ms=", &cfg.tick_ms, 0}, {"peak=", &cfg.peak_bytes, 1},
        {"dsb_ms=", &cfg.dsb_ms, 0}, {"dsb_pct=", &cfg.dsb_pct, 0},
        {"blk_sectors=", &cfg.blk_sectors, 0}, {"blk_rate=", &cfg.blk_rate, 0},
        {"reads=", &cfg.reads, 0},
    };
    for (unsigned k = 0; k < sizeof(numbers) / sizeof(numbers[0]); k++) {
        u64 kl = 0;
        while (numbers[k].key[kl])
            kl++;
        if (len > kl && word_is(w, kl, numbers[k].key)) {
            if (!parse_number(w + kl, len - kl, numbers[k].dst, numbers[k].suffix))
                fatal("bad number in ", word);
            return;
        }
    }
    if (word_is(w, len, "idle")) cfg.mode = MODE_IDLE;
    else if (word_is(w, len, "write")) cfg.mode = MODE_WRITE;
    else if (word_is(w, len, "read")) cfg.mode = MODE_READ;
    else if (word_is(w, len, "churn")) cfg.mode = MODE_CHURN;
    else if (word_is(w, len, "balloon")) cfg.balloon = 1;
    else if (word_is(w, len, "dsb")) cfg.balloon = cfg.dsb = 1;
    else if (word_is(w, len, "balloon_flood")) cfg.balloon = cfg.flood = 1;
    else if (word_is(w, len, "hint_any")) cfg.hint_any = 1;
    else if (word_is(w, len, "seq")) cfg.random = cfg.zipf = 0;
    else if (word_is(w, len, "random")) cfg.random = 1, cfg.zipf = 0;
    else if (word_is(w, len, "zipf")) cfg.random = 0, cfg.zipf = 1;
    else if (word_is(w, len, "user")) cfg.user = 1;
    else if (word_is(w, len, "verify")) cfg.verify = 1;
    else if (word_is(w, len, "fill=word")) cfg.fill = FILL_WORD;
    else if (word_is(w, len, "fill=random")) cfg.fill = FILL_RANDOM;
    else if (word_is(w, len, "fill=mixed")) cfg.fill = FILL_MIXED;
    else if (word_is(w, len, "fill=fresh")) cfg.fill = FILL_FRESH;
    else if (word_is(w, len, "fill=real")) cfg.fill = FILL_REAL;
    else if (word_is(w, len, "blk")) cfg.blk = 1;
    else if (word_is(w, len, "blk_random")) cfg.blk = cfg.blk_random = 1;
    else if (word_is(w, len, "net=fwd")) cfg.net = 1;
    else if (len >= 4 && word_is(w, 4, "net=")) fatal("unknown net= mode ", word);
    else if (len >= 19 && word_is(w, 19, "virtio_mmio.device="))
        parse_virtio_mmio(w + 19, len - 19, word);
    else fatal("unknown workload word ", word);
}

static void parse_cmdline(const char *s)
{
    cfg = (struct config){MODE_IDLE, 64ull << 20, 0, 0, NO_LIMIT, 1, 0, 1000, 1000, FILL_WORD, 0,
                          0, 2048, 2000, 0, {0}, 0, 0, 0, 0, 0, 0, 0, 5000, 95, 0, 0, 0};
    while (s && *s) {
        while (*s == ' ')
            s++;
        const char *start = s;
        while (*s && *s != ' ')
            s++;
        if (s > start)
            parse_word(start, (u64)(s - start));
    }
    if (cfg.vcpus == 0 || cfg.vcpus > MAX_CPUS)
        fatal("vcpus must be 1..16", "");
    if (cfg.hb_us == 0)
        fatal("hb_us must be positive", "");
    if (cfg.mode != MODE_IDLE && cfg.ws_bytes < PAGE_SIZE * cfg.vcpus)
        fatal("working set smaller than one page per vCPU", "");
    if (cfg.dsb_ms == 0 || cfg.dsb_pct == 0 || cfg.dsb_pct > 100)
        fatal("dsb_ms must be positive and dsb_pct 1..100", "");
    if (cfg.mode == MODE_CHURN && cfg.fill != FILL_WORD)
        fatal("churn writes one stamp a page: fill=word only", "");
    if (cfg.zipf && cfg.ws_bytes / PAGE_SIZE / cfg.vcpus < ZIPF_REGIONS)
        fatal("zipf needs at least 4 MiB of working set per vCPU", "");
    if (cfg.reads > 100)
        fatal("reads= is a percentage: 0..100", "");
    if (cfg.user && (cfg.blk || cfg.net || cfg.balloon))
        fatal("user runs no device driver: drop blk, net and balloon words", "");
    if (cfg.fill == FILL_REAL && !sample_pages())
        fatal("fill=real needs the memory sample: boot guest-app.elf", "");
}

/* ---- memory layout ---- */

/* Reads the memory map (printing it) and collects the RAM above the image into `segments`. */
static void read_memory_map(const struct hvm_start_info *si, u64 from)
{
    const struct hvm_memmap_entry *map = (const void *)si->memmap_paddr;
    if (!si->memmap_paddr || !si->memmap_entries)
        fatal("no memory map in start_info", "");
    for (u32 i = 0; i < si->memmap_entries; i++) {
        u64 start = map[i].addr, end = map[i].addr + map[i].size;
        put_str("ferry-guest: e820 ");
        put_hex(start);
        put_str("-");
        put_hex(end - 1);
        put_str(map[i].type == E820_RAM ? " ram\n" : " reserved\n");
        if (map[i].type == E820_RAM)
            ram_bytes += map[i].size;
        if (map[i].type != E820_RAM || end <= from)
            continue;
        if (nsegments == MAX_SEGMENTS)
            fatal("too many RAM ranges in the memory map", "");
        if (start < from)
            start = from;
        segments[nsegments].base = start;
        segments[nsegments].pages = (end - start) / PAGE_SIZE;
        nsegments++;
    }
}

/*
 * Maps guest-physical memory up to `top` (boot.S mapped the first 4 GiB). Only what the
 * workload uses: every page-table write is slow under an instruction emulator, and an idle
 * guest of 64 GiB needs none of it.
 */
static void map_up_to(u64 top)
{
    u64 gib = (top + (1ull << 30) - 1) >> 30;
    if (gib > MAPPED_GIB)
        fatal("RAM reaches beyond what the page tables can map", "");
    /* 1 GiB pages where the CPU offers them (one entry per GiB), 2 MiB pages otherwise. */
    u32 a, b, c, d;
    cpuid(0x80000001u, &a, &b, &c, &d);
    int huge = (d >> 26) & 1;
    for (u64 g = 4; g < gib && !huge; g++)
        for (u64 i = 0; i < 512; i++)
            boot_pd[g * 512 + i] = ((g << 30) + (i << 21)) | 0x83;
    for (u64 g = 4; g < gib; g++)
        boot_pdpt[g] = huge ? (g << 30) | 0x83 : (u64)&boot_pd[g * 512] | 0x3;
    u64 cr3;
    __asm__ volatile("mov %%cr3, %0; mov %0, %%cr3" : "=r"(cr3)::"memory");
}

/* Takes `bytes` from the front of the first segment (2 MiB-aligned). */
static u64 carve(u64 bytes)
{
    const u64 align = 2ull << 20;
    u64 base = segments[0].base;
    u64 len = (bytes + align - 1) & ~(align - 1);
    if (nsegments == 0 || len / PAGE_SIZE > segments[0].pages)
        fatal("guest memory too small for the verify tables and fill pools", "");
    segments[0].base += len;
    segments[0].pages -= len / PAGE_SIZE;
    return base;
}

/* The guest-physical address of working-set page `page`: the segments, one after another. */
static u64 page_addr(u64 page)
{
    for (u64 i = 0; i < nsegments; i++) {
        if (page < segments[i].pages)
            return segments[i].base + page * PAGE_SIZE;
        page -= segments[i].pages;
    }
    return 0;
}

/* RAM pages the segments hold now. */
static u64 ram_room(void)
{
    u64 room = 0;
    for (u64 i = 0; i < nsegments; i++)
        room += segments[i].pages;
    return room;
}

/*
 * ---- the page allocator: the guest's free RAM, page by page ----
 *
 * What churn allocates and the balloon gives away: every RAM page past the static working set
 * (pages numbered as page_addr numbers them, from pa.first). Three bitmaps, carved like the
 * verify table (fresh RAM reads zero, and they migrate with the rest of memory): free pages,
 * free pages not yet reported to the balloon (freed by the workload since), and pages in the
 * balloon. Pages are taken next-fit from a cursor, so a working set that grows takes
 * ascending addresses and one that shrinks frees runs of them: reports and the host's
 * discards then cover long ranges.
 */
#define NO_PAGE (~0ull)

static struct {
    u64 first, pages;      /* page_addr numbers of allocator page 0, and how many */
    u64 *free_map, *unreported, *ballooned;
    u64 *hinted;           /* handed over in a free page hint, held until the host is done */
    u64 *undefined;        /* back from a hint with hint_any: content not checked */
    u64 free, unreported_count, hinted_count, cursor;
} pa;

static inline int bit_get(const u64 *map, u64 i) { return (int)((map[i / 64] >> (i % 64)) & 1); }
static inline void bit_set(u64 *map, u64 i) { map[i / 64] |= 1ull << (i % 64); }
static inline void bit_clear(u64 *map, u64 i) { map[i / 64] &= ~(1ull << (i % 64)); }

/* The first set bit of map[from..n); NO_PAGE if none. */
static u64 next_set(const u64 *map, u64 n, u64 from)
{
    for (u64 wi = from / 64; wi * 64 < n; wi++) {
        u64 w = map[wi];
        if (wi == from / 64)
            w &= ~0ull << (from % 64);
        if (w)
            return wi * 64 + (u64)__builtin_ctzll(w);
    }
    return NO_PAGE;
}

/* The first set bit of map[0..n) at or after `from`, wrapping around; NO_PAGE if none. */
static u64 find_set(const u64 *map, u64 n, u64 from)
{
    u64 a = next_set(map, n, from);
    return a != NO_PAGE ? a : next_set(map, n, 0);
}

/* Where the run of set bits from a (set) ends, at most at `limit`. */
static u64 run_end(const u64 *map, u64 a, u64 limit)
{
    u64 end = a + 1;
    while (end < limit) {
        if (end % 64 == 0 && end + 64 <= limit && map[end / 64] == ~0ull)
            end += 64;
        else if (bit_get(map, end))
            end++;
        else
            break;
    }
    return end;
}

static u64 popcount64(u64 x)
{
    x -= (x >> 1) & 0x5555555555555555ull;
    x = (x & 0x3333333333333333ull) + ((x >> 2) & 0x3333333333333333ull);
    x = (x + (x >> 4)) & 0x0f0f0f0f0f0f0f0full;
    return (x * 0x0101010101010101ull) >> 56;
}

/* Clears map's bits [from, end), a word at a time where it can; how many were set. */
static u64 bits_take(u64 *map, u64 from, u64 end)
{
    u64 n = 0;
    for (u64 i = from; i < end;) {
        if (i % 64 == 0 && i + 64 <= end) {
            n += popcount64(map[i / 64]);
            map[i / 64] = 0;
            i += 64;
        } else {
            n += (u64)bit_get(map, i);
            bit_clear(map, i++);
        }
    }
    return n;
}

static void bits_set(u64 *map, u64 from, u64 end)
{
    for (u64 i = from; i < end;) {
        if (i % 64 == 0 && i + 64 <= end) {
            map[i / 64] = ~0ull;
            i += 64;
        } else {
            bit_set(map, i++);
        }
    }
}

static void bits_clear(u64 *map, u64 from, u64 end)
{
    for (u64 i = from; i < end;) {
        if (i % 64 == 0 && i + 64 <= end) {
            map[i / 64] = 0;
            i += 64;
        } else {
            bit_clear(map, i++);
        }
    }
}

/* Carves the allocator's bitmaps for at most `room` pages. */
static void pa_carve(u64 room)
{
    u64 bytes = (room + 63) / 64 * 8;
    pa.free_map = (u64 *)carve(bytes);
    pa.unreported = (u64 *)carve(bytes);
    pa.ballooned = (u64 *)carve(bytes);
    pa.hinted = (u64 *)carve(bytes);
    pa.undefined = (u64 *)carve(bytes);
}

/* Every page from page_addr number `first` up to `room` is free. */
static void pa_setup(u64 first, u64 room)
{
    pa.first = first;
    pa.pages = room - first;
    for (u64 i = 0; i < pa.pages / 64; i++)
        pa.free_map[i] = ~0ull;
    for (u64 i = pa.pages / 64 * 64; i < pa.pages; i++)
        bit_set(pa.free_map, i);
    pa.free = pa.pages;
}

/* A free page (allocator number), or NO_PAGE. */
static u64 pa_take(void)
{
    if (!pa.free)
        return NO_PAGE;
    u64 a = find_set(pa.free_map, pa.pages, pa.cursor);
    bit_clear(pa.free_map, a);
    if (pa.unreported_count && bit_get(pa.unreported, a)) {
        bit_clear(pa.unreported, a);
        pa.unreported_count--;
    }
    pa.free--;
    pa.cursor = a + 1 == pa.pages ? 0 : a + 1;
    return a;
}

/* Frees page a; `report`: its content is the workload's, worth reporting to the balloon. */
static void pa_put(u64 a, int report)
{
    bit_set(pa.free_map, a);
    pa.free++;
    if (report) {
        bit_set(pa.unreported, a);
        pa.unreported_count++;
    }
}

static inline u64 pa_addr(u64 a) { return page_addr(pa.first + a); }

/* Where the segment holding allocator page a ends, as an allocator page number. */
static u64 pa_segment_end(u64 a)
{
    u64 g = pa.first + a, start = 0;
    for (u64 i = 0; i < nsegments; i++) {
        if (g < start + segments[i].pages)
            return start + segments[i].pages - pa.first;
        start += segments[i].pages;
    }
    return pa.pages;
}

/*
 * ---- the churn workload: state laid out with the memory ----
 *
 * The working set is a stack of allocator pages (grown by allocating, shrunk by freeing the
 * newest), each stamped with its number and a generation the guest keeps per page.
 */
static struct {
    u32 *stack;       /* allocator pages in the working set, oldest first */
    u32 *gen;         /* verify: the generation each allocator page last carried (0: never) */
    u64 count, capacity, touch;
} churn;

static void flood_carve(void);

static void plan_layout(void)
{
    int allocator = cfg.mode == MODE_CHURN || cfg.balloon;
    ws_pages = cfg.mode == MODE_IDLE || cfg.mode == MODE_CHURN ? 0 : cfg.ws_bytes / PAGE_SIZE;
    /* Carved like expected_gen: fresh RAM reads zero, so every sector starts as "never
     * written", and the table migrates with the rest of guest memory. */
    if (cfg.blk)
        expected_blk_gen = (u32 *)carve(cfg.blk_sectors * sizeof(u32));
    if (cfg.verify && ws_pages)
        expected_gen = (u32 *)carve(ws_pages * sizeof(u32));
    if (ws_pages && cfg.fill != FILL_WORD && cfg.fill != FILL_REAL)
        random_pool = (u64 *)carve(POOL_BYTES);
    if (ws_pages && (cfg.fill == FILL_MIXED || cfg.fill == FILL_FRESH))
        text_pool = (u64 *)carve(POOL_BYTES);
    if (allocator)
        pa_carve(ram_room());
    if (cfg.flood)
        flood_carve();
    if (cfg.mode == MODE_CHURN) {
        u64 peak = cfg.peak_bytes > cfg.ws_bytes ? cfg.peak_bytes : cfg.ws_bytes;
        churn.capacity = peak / PAGE_SIZE;
        churn.stack = (u32 *)carve(churn.capacity * sizeof(u32));
        if (cfg.verify)
            churn.gen = (u32 *)carve(ram_room() * sizeof(u32));
    }
    u64 room = ram_room();
    if (ws_pages > room)
        fatal("working set does not fit in guest RAM", "");
    ws_base = segments[0].base;
    if (allocator) {
        pa_setup(ws_pages, room);
        if (churn.capacity > pa.pages)
            fatal("churn: ws= or peak= does not fit in guest RAM", "");
        map_up_to(page_addr(room - 1) + PAGE_SIZE);
    } else if (ws_pages) {
        map_up_to(page_addr(ws_pages - 1) + PAGE_SIZE);
    }
}

/*
 * ---- the TSC's rate ----
 *
 * KVM knows it and says so through kvmclock (its scale from TSC ticks to nanoseconds), which
 * every VMM on KVM offers; without kvmclock, the TSC is timed against PIT channel 2, which
 * needs port 0x61 (QEMU's microvm machine has none).
 */
#define MSR_KVM_SYSTEM_TIME_NEW 0x4b564d01u
#define KVM_FEATURE_CLOCKSOURCE2 (1u << 3)

struct pvclock_time_info {
    u32 version, pad0;
    u64 tsc_timestamp, system_time;
    u32 tsc_to_system_mul;
    signed char tsc_shift;
    u8 flags, pad[2];
};
static struct pvclock_time_info kvmclock __attribute__((aligned(64)));

static inline void wrmsr(u32 msr, u64 v)
{
    __asm__ volatile("wrmsr" ::"c"(msr), "a"((u32)v), "d"((u32)(v >> 32)));
}

/* The TSC rate from kvmclock's scale (ns = ticks · 2^shift · mul / 2^32), 0 without kvmclock. */
static u64 kvmclock_tsc_khz(void)
{
    u32 a, b, c, d;
    cpuid(0x40000000u, &a, &b, &c, &d);
    if (b != 0x4b4d564bu || c != 0x564b4d56u || d != 0x4du || a < 0x40000001u) /* "KVMKVMKVM" */
        return 0;
    cpuid(0x40000001u, &a, &b, &c, &d);
    if (!(a & KVM_FEATURE_CLOCKSOURCE2))
        return 0;
    wrmsr(MSR_KVM_SYSTEM_TIME_NEW, (u64)&kvmclock | 1);
    u32 mul = 0;
    int shift = 0;
    for (u32 tries = 0; tries < 1000000 && !mul; tries++) {
        u32 version = *(volatile u32 *)&kvmclock.version;
        if (version & 1)
            continue; /* KVM is writing it */
        mul = *(volatile u32 *)&kvmclock.tsc_to_system_mul;
        shift = *(volatile signed char *)&kvmclock.tsc_shift;
        if (*(volatile u32 *)&kvmclock.version != version)
            mul = 0;
    }
    wrmsr(MSR_KVM_SYSTEM_TIME_NEW, 0); /* one reading is all this guest needs */
    if (!mul)
        return 0;
    u64 khz = (1000000ull << 32) / mul;
    return shift >= 0 ? khz >> shift : khz << -shift;
}

static u64 calibrate_tsc_khz(void)
{
    const u32 latch = 11932; /* 10 ms at 1.193182 MHz */
    outb(0x61, (u8)((inb(0x61) & ~0x02) | 0x01));
    outb(0x43, 0xb0);
    outb(0x42, latch & 0xff);
    outb(0x42, latch >> 8);
    u64 t0 = rdtsc();
    for (u64 i = 0; i < 10000000ull; i++)
        if (inb(0x61) & 0x20)
            return (rdtsc() - t0) / 10;
    return 0;
}

/* ---- the workload ---- */

struct worker {
    struct hb_block *hb;
    u64 first;        /* first working-set page index of this vCPU's share */
    u64 count;        /* pages in the share */
    u64 rng;
    u64 hb_ticks, serial_ticks, next_hb, next_serial;
    u64 tick_ticks, next_tick;
    u64 start_tsc, rate;
    u64 rate_tsc, rate_pages; /* rate=N counts from here (fill=real: from the first pass's end) */
    int blk;          /* this vCPU drives the disk (vCPU 0 with blk) */
    u64 blk_ticks, next_blk;
    int net;          /* this vCPU forwards frames (vCPU 0 with net=fwd) */
    u64 net_check_ticks, next_net_check;
    int balloon;      /* this vCPU drives the balloon (vCPU 0 with balloon or dsb) */
    u64 dsb_ticks, next_dsb;
    u64 hint_poll_ticks, next_hint_poll;
};

static void balloon_progress(void);

static void serial_progress(void)
{
    u64 pages = 0, passes = 0, errors = 0, all_passed = ~0ull;
    for (u64 c = 0; c < cfg.vcpus; c++) {
        pages += blocks[c].pages;
        passes += blocks[c].passes;
        errors += blocks[c].errors;
        if (blocks[c].passes < all_passed)
            all_passed = blocks[c].passes;
    }
    put_str("ferry-guest: hb=");
    put_u64(blocks[0].seq);
    put_str(" pages=");
    put_u64(pages);
    put_str(" passes=");
    put_u64(passes);
    put_str(" errors=");
    put_u64(errors);
    /* Passes every vCPU has finished (a runner waits for each vCPU's share to be written). */
    put_str(" all_passed=");
    put_u64(all_passed);
    if (cfg.blk) {
        put_str(" blk_writes=");
        put_u64(blocks[0].blk_writes);
        put_str(" blk_reads=");
        put_u64(blocks[0].blk_reads);
        put_str(" blk_errors=");
        put_u64(blocks[0].blk_errors);
    }
    if (cfg.net) {
        put_str(" net_rx=");
        put_u64(blocks[0].net_rx);
        put_str(" net_tx=");
        put_u64(blocks[0].net_tx);
    }
    balloon_progress();
    put_str("\n");
}

static void heartbeat_if_due(struct worker *w)
{
    u64 now = rdtsc();
    if (now < w->next_hb)
        return;
    w->next_hb = now + w->hb_ticks;
    w->hb->seq++;
    outl(PORT_HEARTBEAT, (u32)w->hb->seq);
    if (w->hb->cpu == 0 && now >= w->next_serial) {
        w->next_serial = now + w->serial_ticks;
        serial_progress();
    }
    if (w->hb->cpu == 0 && w->tick_ticks && now >= w->next_tick) {
        w->next_tick = now + w->tick_ticks;
        put_char('\n');
    }
}

/*
 * ---- virtio devices: poll-mode drivers (virtio 1.x, MMIO transport version 2) ----
 *
 * What the blk and net workloads share: finding a device among the virtio-mmio windows the
 * command line names (virtio_mmio.device= words, as Linux finds them), the
 * initialisation sequence (virtio 1.x 3.1.1) up to FEATURES_OK, config space reads, and split
 * virtqueues (2.7) set up, fed and reaped. The drivers poll: every avail ring says
 * NO_INTERRUPT, and a completion is found by reading the used ring's index. All driver state
 * (rings and their indices, the last used index consumed, each workload's own bookkeeping) is
 * guest memory, so a VM migrated mid-step carries on exactly where it was.
 */
#define VIRTIO_MAGIC 0x74726976u         /* "virt" */
#define VIRTIO_MMIO_VERSION 2            /* modern; 1 is the legacy layout */
#define VIRTIO_ID_NET 1
#define VIRTIO_ID_BLOCK 2

/* MMIO registers (all 32-bit; a 64-bit address is low at reg, high at reg + 4). */
#define VIRTIO_MAGIC_VALUE 0x000
#define VIRTIO_VERSION 0x004
#define VIRTIO_DEVICE_ID 0x008
#define VIRTIO_DEVICE_FEATURES 0x010
#define VIRTIO_DEVICE_FEATURES_SEL 0x014
#define VIRTIO_DRIVER_FEATURES 0x020
#define VIRTIO_DRIVER_FEATURES_SEL 0x024
#define VIRTIO_QUEUE_SEL 0x030
#define VIRTIO_QUEUE_NUM_MAX 0x034
#define VIRTIO_QUEUE_NUM 0x038
#define VIRTIO_QUEUE_READY 0x044
#define VIRTIO_QUEUE_NOTIFY 0x050
#define VIRTIO_STATUS 0x070
#define VIRTIO_QUEUE_DESC 0x080
#define VIRTIO_QUEUE_DRIVER 0x090        /* the avail ring */
#define VIRTIO_QUEUE_DEVICE 0x0a0        /* the used ring */
#define VIRTIO_CONFIG_GENERATION 0x0fc
#define VIRTIO_CONFIG 0x100              /* device-specific config space */

#define STATUS_ACKNOWLEDGE 1
#define STATUS_DRIVER 2
#define STATUS_DRIVER_OK 4
#define STATUS_FEATURES_OK 8
#define STATUS_NEEDS_RESET 0x40

#define VIRTIO_F_VERSION_1 32            /* bit 0 of feature word 1 */

#define VIRTQ_DESC_F_NEXT 1
#define VIRTQ_DESC_F_WRITE 2             /* device-writable */
#define VIRTQ_AVAIL_F_NO_INTERRUPT 1

#define VIRTQ_MAX 16                     /* a queue's size: 16, halved until the device takes it */

struct virtq_desc {
    u64 addr;
    u32 len;
    u16 flags, next;
};
struct virtq_avail {
    u16 flags, idx, ring[VIRTQ_MAX], used_event;
};
struct virtq_used_elem {
    u32 id, len;
};
struct virtq_used {
    u16 flags, idx;
    struct virtq_used_elem ring[VIRTQ_MAX];
    u16 avail_event;
};

/* One split virtqueue: each ring in a page of its own (past the 16-, 2- and 4-byte alignment
 * the rings need), then the driver's bookkeeping. */
struct virtq {
    struct virtq_desc desc[VIRTQ_MAX] __attribute__((aligned(4096)));
    struct virtq_avail avail __attribute__((aligned(4096)));
    volatile struct virtq_used used __attribute__((aligned(4096)));
    u32 num;          /* the queue's size, a power of 2 (split-queue indices wrap at 65536) */
    u16 last_used;    /* used.idx as far as the driver has consumed the used ring */
};

struct vdev {
    u64 base;         /* the device's registers: one of cfg.mmio */
    const char *name; /* "virtio-blk", "virtio-net": begins the device's error messages */
};

/* Orders ring and buffer accesses against the device's, and keeps the compiler from caching. */
static inline void mb(void) { __asm__ volatile("mfence" ::: "memory"); }
static inline u32 vdev_read(const struct vdev *d, u64 reg)
{
    return *(volatile u32 *)(d->base + reg);
}
static inline void vdev_write(const struct vdev *d, u64 reg, u32 v)
{
    *(volatile u32 *)(d->base + reg) = v;
}
static void vdev_write64(const struct vdev *d, u64 reg, u64 v)
{
    vdev_write(d, reg, (u32)v);
    vdev_write(d, reg + 4, (u32)(v >> 32));
}

/* Every read of Status goes through here: a device that needs a reset has failed for good. */
static u32 vdev_status(const struct vdev *d)
{
    u32 status = vdev_read(d, VIRTIO_STATUS);
    if (status & STATUS_NEEDS_RESET)
        fatal(d->name, " device set DEVICE_NEEDS_RESET");
    return status;
}
static void vdev_set_status(const struct vdev *d, u32 bit)
{
    vdev_write(d, VIRTIO_STATUS, vdev_status(d) | bit);
}

/*
 * Points d->base at the first window that holds a device of this ID. A legacy (version 1)
 * device is refused by name: this driver speaks the modern layout only.
 */
static int vdev_probe(struct vdev *d, u32 device_id)
{
    for (u64 i = 0; i < cfg.mmio_count; i++) {
        d->base = cfg.mmio[i];
        if (vdev_read(d, VIRTIO_MAGIC_VALUE) != VIRTIO_MAGIC ||
            vdev_read(d, VIRTIO_DEVICE_ID) != device_id)
            continue;
        if (vdev_read(d, VIRTIO_VERSION) != VIRTIO_MMIO_VERSION)
            fatal("a legacy virtio-mmio device (version 1): this driver needs version 2 (QEMU: "
                  "-global virtio-mmio.force-legacy=false)", "");
        return 1;
    }
    return 0;
}

/*
 * Finds the device (the fatal error `missing` if there is none), names it `name` for later
 * error messages, and takes it through reset, ACKNOWLEDGE, DRIVER and feature negotiation to
 * FEATURES_OK (virtio 1.x 3.1.1 steps 1-6). VIRTIO_F_VERSION_1 is required; of the feature
 * bits in `wanted`, those the device offers are accepted, nothing else. Returns the
 * negotiated features.
 */
static u64 vdev_start(struct vdev *d, const char *name, u32 device_id, u64 wanted,
                      const char *missing)
{
    if (!vdev_probe(d, device_id))
        fatal(missing, "");
    d->name = name;
    vdev_write(d, VIRTIO_STATUS, 0);
    for (u32 i = 0; vdev_status(d); i++) /* the reset is done when Status reads 0 */
        if (i == 1000000)
            fatal(d->name, " device did not reset");
    vdev_set_status(d, STATUS_ACKNOWLEDGE);
    vdev_set_status(d, STATUS_DRIVER);

    u64 offered = 0;
    for (u32 word = 0; word < 2; word++) {
        vdev_write(d, VIRTIO_DEVICE_FEATURES_SEL, word);
        offered |= (u64)vdev_read(d, VIRTIO_DEVICE_FEATURES) << 32 * word;
    }
    if (!((offered >> VIRTIO_F_VERSION_1) & 1))
        fatal(d->name, " device does not offer VIRTIO_F_VERSION_1");
    u64 features = offered & (wanted | 1ull << VIRTIO_F_VERSION_1);
    for (u32 word = 0; word < 2; word++) {
        vdev_write(d, VIRTIO_DRIVER_FEATURES_SEL, word);
        vdev_write(d, VIRTIO_DRIVER_FEATURES, (u32)(features >> 32 * word));
    }
    vdev_set_status(d, STATUS_FEATURES_OK);
    if (!(vdev_status(d) & STATUS_FEATURES_OK))
        fatal(d->name, " device did not accept the features (FEATURES_OK clear)");
    return features;
}

/*
 * Copies len bytes of config space from offset `reg` (VIRTIO_CONFIG + the field's offset) in
 * accesses of `width` bytes (1 or 4). Several reads make the field: a new generation
 * afterwards means the config changed between, and they are done again.
 */
static void vdev_read_config(const struct vdev *d, u64 reg, u8 *out, u32 len, u32 width)
{
    for (u32 tries = 0;; tries++) {
        u32 gen = vdev_read(d, VIRTIO_CONFIG_GENERATION);
        for (u32 i = 0; i < len; i += width) {
            u32 v = width == 4 ? vdev_read(d, reg + i) : *(volatile u8 *)(d->base + reg + i);
            for (u32 b = 0; b < width; b++)
                out[i + b] = (u8)(v >> 8 * b);
        }
        if (vdev_read(d, VIRTIO_CONFIG_GENERATION) == gen)
            return;
        if (tries == 8)
            fatal(d->name, " config generation keeps changing");
    }
}

/*
 * Sets up queue `index` of the device on q (virtio 1.x 4.2.3.2): VIRTQ_MAX entries halved
 * until QueueNumMax allows them, no interrupts wanted, then QueueReady. `label` ("virtio-blk
 * queue 0") names the queue in error messages.
 */
static void virtq_setup(const struct vdev *d, u32 index, struct virtq *q, const char *label)
{
    vdev_write(d, VIRTIO_QUEUE_SEL, index);
    u32 max = vdev_read(d, VIRTIO_QUEUE_NUM_MAX);
    if (max == 0)
        fatal(label, " is not available (QueueNumMax 0)");
    q->num = VIRTQ_MAX;
    while (q->num > max)
        q->num >>= 1;
    vdev_write(d, VIRTIO_QUEUE_NUM, q->num);
    q->avail.flags = VIRTQ_AVAIL_F_NO_INTERRUPT; /* this driver polls */
    vdev_write64(d, VIRTIO_QUEUE_DESC, (u64)q->desc);
    vdev_write64(d, VIRTIO_QUEUE_DRIVER, (u64)&q->avail);
    vdev_write64(d, VIRTIO_QUEUE_DEVICE, (u64)&q->used);
    mb();
    vdev_write(d, VIRTIO_QUEUE_READY, 1);
}

/* Offers the descriptor chain starting at `head` in the avail ring (the device is not told). */
static void virtq_post(struct virtq *q, u16 head)
{
    u16 idx = q->avail.idx;
    q->avail.ring[idx % q->num] = head;
    mb(); /* the chain and its ring entry before the index that offers it */
    q->avail.idx = (u16)(idx + 1);
}

/* Tells the device that queue `index` has new buffers. */
static void vdev_notify(const struct vdev *d, u32 index)
{
    mb(); /* the index before the notification */
    vdev_write(d, VIRTIO_QUEUE_NOTIFY, index);
}

/* Takes the next entry the device put in the used ring into *e: 0 when there is none yet. */
static int virtq_pop(struct virtq *q, struct virtq_used_elem *e)
{
    if (q->used.idx == q->last_used)
        return 0;
    mb(); /* the used entry, and what the device wrote in the buffers, only after the index */
    e->id = q->used.ring[q->last_used % q->num].id;
    e->len = q->used.ring[q->last_used % q->num].len;
    q->last_used++;
    return 1;
}

/*
 * ---- the blk workload: a poll-mode virtio-blk driver ----
 *
 * vCPU 0, beside its memory workload, steps through sectors 0..blk_sectors-1 over and over
 * (with blk_random, step k works on a sector a hash of k picks):
 * read the sector and check every 8-byte word against the stamps it was last written with
 * (zeros if never: a fresh disk file is zeros), then write the next generation's stamps; every
 * 64 writes a FLUSH when the device offers it. One request is in flight at a time, on queue
 * 0, and its completion is polled. The step counter and the expected generations are guest
 * memory too.
 */
#define VIRTIO_BLK_CAPACITY VIRTIO_CONFIG /* device config: u64, in 512-byte sectors */
#define VIRTIO_BLK_F_FLUSH 9             /* in feature word 0 */

#define VIRTIO_BLK_T_IN 0
#define VIRTIO_BLK_T_OUT 1
#define VIRTIO_BLK_T_FLUSH 4
#define VIRTIO_BLK_S_OK 0

#define SECTOR_SIZE 512
#define BLK_TIMEOUT_MS 2000
#define BLK_FLUSH_EVERY 64               /* writes */

static struct virtq blk_q;
/* The request in flight: header (type, reserved, sector), the sector's data, status byte. */
static struct {
    u32 type, reserved;
    u64 sector;
    u64 data[SECTOR_SIZE / 8];
    u8 status;
} blk_req __attribute__((aligned(4096)));

static struct {
    struct vdev dev;
    int flush;        /* VIRTIO_BLK_F_FLUSH negotiated */
    u64 steps;        /* step k works on sector k % blk_sectors */
} blk;

/* Device initialisation; fits blk_sectors to the disk. */
static void blk_init(void)
{
    u64 features = vdev_start(&blk.dev, "virtio-blk", VIRTIO_ID_BLOCK, 1ull << VIRTIO_BLK_F_FLUSH,
                              "blk: no virtio-blk device in the virtio_mmio.device= windows");
    blk.flush = (int)((features >> VIRTIO_BLK_F_FLUSH) & 1);

    u64 capacity = 0;
    vdev_read_config(&blk.dev, VIRTIO_BLK_CAPACITY, (u8 *)&capacity, sizeof(capacity), 4);
    if (capacity == 0)
        fatal("virtio-blk disk has no sectors", "");
    if (cfg.blk_sectors == 0)
        cfg.blk_sectors = 1;
    if (cfg.blk_sectors > capacity)
        cfg.blk_sectors = capacity;

    virtq_setup(&blk.dev, 0, &blk_q, "virtio-blk queue 0");
    if (blk_q.num < 3) /* a request takes 3 descriptors */
        fatal("virtio-blk queue 0", " is too small for a 3-descriptor request");
    vdev_set_status(&blk.dev, STATUS_DRIVER_OK);

    put_str("ferry-guest: virtio-blk at ");
    put_hex(blk.dev.base);
    put_str(" capacity=");
    put_u64(capacity);
    put_str(" queue=");
    put_u64(blk_q.num);
    put_str(blk.flush ? " flush\n" : " no-flush\n");
}

/*
 * One request, polled to completion (the beat goes on meanwhile): descriptor 0 the header,
 * 1 the sector's data (left out of a FLUSH), 2 the status byte. Returns whether the device
 * completed it with VIRTIO_BLK_S_OK.
 */
static int blk_request(struct worker *w, u32 type, u64 sector)
{
    blk_req.type = type;
    blk_req.reserved = 0;
    blk_req.sector = sector;
    blk_req.status = 0xff; /* a device that never writes the status fails the request */
    blk_q.desc[0] = (struct virtq_desc){(u64)&blk_req, 16, VIRTQ_DESC_F_NEXT,
                                        type == VIRTIO_BLK_T_FLUSH ? 2 : 1};
    blk_q.desc[1] = (struct virtq_desc){(u64)blk_req.data, SECTOR_SIZE,
                                        VIRTQ_DESC_F_NEXT | (type == VIRTIO_BLK_T_IN ? VIRTQ_DESC_F_WRITE : 0), 2};
    blk_q.desc[2] = (struct virtq_desc){(u64)&blk_req.status, 1, VIRTQ_DESC_F_WRITE, 0};
    virtq_post(&blk_q, 0);
    vdev_notify(&blk.dev, 0);

    struct virtq_used_elem done;
    u64 deadline = rdtsc() + tsc_khz * BLK_TIMEOUT_MS;
    while (!virtq_pop(&blk_q, &done)) {
        if (rdtsc() > deadline) {
            vdev_status(&blk.dev); /* a device that gave up says so there */
            fatal("virtio-blk request did not complete within 2 s", "");
        }
        heartbeat_if_due(w);
        cpu_relax();
    }
    return done.id == 0 && *(volatile u8 *)&blk_req.status == VIRTIO_BLK_S_OK;
}

static inline u64 blk_stamp(u64 sector, u32 gen, u64 word)
{
    return sector << 32 | (u64)(gen & 0xffffff) << 8 | word;
}

static void report_blk_error(struct worker *w, u64 sector, const char *what)
{
    w->hb->blk_errors++;
    outl(PORT_BLK_ERROR, (u32)sector);
    if (w->hb->blk_errors <= 8) {
        put_str("ferry-guest: blk ");
        put_str(what);
        put_str(": sector ");
        put_u64(sector);
        put_str("\n");
    }
}

/* Whether the sector just read carries generation gen's stamps (all zeros for gen 0). */
static int blk_sector_ok(u64 sector, u32 gen)
{
    for (u64 i = 0; i < SECTOR_SIZE / 8; i++)
        if (blk_req.data[i] != (gen ? blk_stamp(sector, gen, i) : 0))
            return 0;
    return 1;
}

/* Whether this boot has not written sector s yet: in turn, the first round; at random, no
 * write of it has been acknowledged. */
static int blk_first_visit(u64 s)
{
    return cfg.blk_random ? expected_blk_gen[s] == 0 : blk.steps < cfg.blk_sectors;
}

/* On its first visit of this boot, a sector may hold what an earlier boot of this guest
 * left (a reboot keeps the disk): its own stamps of any generation, adopted as they are. */
static int blk_earlier_boot(u64 sector, u32 *gen)
{
    u32 found = (u32)(blk_req.data[0] >> 8) & 0xffffff;
    if (!blk_first_visit(sector) || found == 0 || !blk_sector_ok(sector, found))
        return 0;
    *gen = found;
    return 1;
}

/* Step k's sector: k in turn, or (blk_random) a splitmix64 hash of k. */
static u64 blk_sector_of(u64 k)
{
    if (!cfg.blk_random)
        return k % cfg.blk_sectors;
    u64 z = k + 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return (z ^ (z >> 31)) % cfg.blk_sectors;
}

static void blk_step(struct worker *w)
{
    u64 s = blk_sector_of(blk.steps);
    u32 gen = expected_blk_gen[s];
    if (!blk_request(w, VIRTIO_BLK_T_IN, s))
        report_blk_error(w, s, "read failed");
    else if (!blk_sector_ok(s, gen) && !blk_earlier_boot(s, &gen))
        report_blk_error(w, s, "verify error");
    w->hb->blk_reads++;

    for (u64 i = 0; i < SECTOR_SIZE / 8; i++)
        blk_req.data[i] = blk_stamp(s, gen + 1, i);
    /* A failed write keeps the old expectation: the device said it did not write. */
    if (blk_request(w, VIRTIO_BLK_T_OUT, s))
        expected_blk_gen[s] = gen + 1;
    else
        report_blk_error(w, s, "write failed");
    w->hb->blk_writes++;
    blk.steps++;

    if (blk.flush && blk.steps % BLK_FLUSH_EVERY == 0 && !blk_request(w, VIRTIO_BLK_T_FLUSH, 0))
        report_blk_error(w, s, "flush failed");
}

/* vCPU 0's disk step, at most blk_rate a second. */
static void blk_step_if_due(struct worker *w)
{
    if (!w->blk)
        return;
    u64 now = rdtsc();
    if (now < w->next_blk)
        return;
    w->next_blk = now + w->blk_ticks;
    blk_step(w);
}

/*
 * ---- the net workload (net=fwd): a poll-mode virtio-net driver that forwards like l2fwd ----
 *
 * vCPU 0 sends every frame the device receives back out through it, destination and source
 * MACs swapped. Queue 0 (receiveq): descriptor i is always rx buffer i, device-writable; all
 * are posted at start-up and each is posted again once its frame has been copied out. Queue 1
 * (transmitq): descriptor i is always tx buffer i, device-readable, and the driver's again once
 * the device has returned it in the used ring; with none free the frame is dropped (counted in
 * net_errors), never waited for. With VERSION_1 every buffer starts with a virtio_net_hdr_v1;
 * a transmitted frame's is all zeros (no offloads are negotiated).
 */
#define VIRTIO_NET_F_MAC 5               /* in feature word 0 */
#define VIRTIO_NET_MAC VIRTIO_CONFIG     /* device config: 6 bytes */
#define NET_RXQ 0
#define NET_TXQ 1
#define ETH_ALEN 6
#define ETH_HLEN 14                      /* destination MAC, source MAC, EtherType */
#define ETH_FRAME_MAX 1514               /* without the FCS */
#define NET_STATUS_CHECK_MS 100          /* how often an idle step looks for DEVICE_NEEDS_RESET */

struct virtio_net_hdr_v1 {
    u8 flags, gso_type;
    u16 hdr_len, gso_size, csum_start, csum_offset, num_buffers;
};
/* A buffer as the device sees it: header, then the frame. */
struct net_buf {
    struct virtio_net_hdr_v1 hdr;
    u8 frame[ETH_FRAME_MAX];
};
_Static_assert(sizeof(struct virtio_net_hdr_v1) == 12, "virtio_net_hdr_v1 is 12 bytes");
_Static_assert(sizeof(struct net_buf) == 12 + 1514, "a net buffer is 1526 bytes");

static struct virtq net_rxq, net_txq;
static struct net_buf net_rx_buf[VIRTQ_MAX] __attribute__((aligned(4096)));
static struct net_buf net_tx_buf[VIRTQ_MAX] __attribute__((aligned(4096)));
static struct {
    struct vdev dev;
    u32 tx_free;      /* bit i: tx buffer (and descriptor) i is the driver's, not the device's */
} net;

/* Device initialisation: both queues, every rx buffer posted. */
static void net_init(void)
{
    u64 features = vdev_start(&net.dev, "virtio-net", VIRTIO_ID_NET, 1ull << VIRTIO_NET_F_MAC,
                              "net=fwd: no virtio-net device in the virtio_mmio.device= windows");
    int has_mac = (int)((features >> VIRTIO_NET_F_MAC) & 1);
    u8 mac[ETH_ALEN];
    if (has_mac)
        vdev_read_config(&net.dev, VIRTIO_NET_MAC, mac, ETH_ALEN, 1);

    virtq_setup(&net.dev, NET_RXQ, &net_rxq, "virtio-net queue 0 (receiveq)");
    virtq_setup(&net.dev, NET_TXQ, &net_txq, "virtio-net queue 1 (transmitq)");
    for (u32 i = 0; i < net_rxq.num; i++) {
        net_rxq.desc[i] = (struct virtq_desc){(u64)&net_rx_buf[i], (u32)sizeof(struct net_buf),
                                              VIRTQ_DESC_F_WRITE, 0};
        net_rxq.avail.ring[i] = (u16)i;
    }
    mb(); /* the descriptors and ring entries before the index that offers them */
    net_rxq.avail.idx = (u16)net_rxq.num;
    net.tx_free = (1u << net_txq.num) - 1;
    vdev_set_status(&net.dev, STATUS_DRIVER_OK);
    vdev_notify(&net.dev, NET_RXQ); /* not before DRIVER_OK (virtio 1.x 3.1.1) */

    put_str("ferry-guest: virtio-net at ");
    put_hex(net.dev.base);
    if (has_mac) {
        put_str(" mac=");
        for (u32 i = 0; i < ETH_ALEN; i++) {
            if (i)
                put_char(':');
            put_hex_digits(mac[i], 2);
        }
    }
    put_str(" queue=");
    put_u64(net_rxq.num);
    if (net_txq.num != net_rxq.num) {
        put_str(" tx_queue=");
        put_u64(net_txq.num);
    }
    put_str("\n");
}

static void copy_bytes(void *dst, const void *src, u64 n)
{
    __asm__ volatile("rep movsb" : "+D"(dst), "+S"(src), "+c"(n)::"memory");
}

/* Takes back the tx buffers the device has finished with. */
static void net_reap_tx(void)
{
    struct virtq_used_elem e;
    while (virtq_pop(&net_txq, &e)) {
        if (e.id >= net_txq.num || ((net.tx_free >> e.id) & 1))
            fatal("virtio-net", " returned a transmit descriptor it did not hold");
        net.tx_free |= 1u << e.id;
    }
}

/* Sends the frame (len bytes) back, MACs swapped, from a free tx buffer: 0 if none is free. */
static int net_forward(const u8 *frame, u32 len)
{
    if (!net.tx_free)
        net_reap_tx();
    if (!net.tx_free)
        return 0;
    u32 i = (u32)__builtin_ctz(net.tx_free);
    net.tx_free &= ~(1u << i);
    struct net_buf *b = &net_tx_buf[i];
    b->hdr = (struct virtio_net_hdr_v1){0};
    copy_bytes(b->frame, frame, len);
    for (u32 k = 0; k < ETH_ALEN; k++) {
        b->frame[k] = frame[ETH_ALEN + k];
        b->frame[ETH_ALEN + k] = frame[k];
    }
    net_txq.desc[i] = (struct virtq_desc){(u64)b, (u32)sizeof(b->hdr) + len, 0, 0};
    virtq_post(&net_txq, (u16)i);
    vdev_notify(&net.dev, NET_TXQ);
    return 1;
}

/* Forwards what arrived since the last step (at most a queue's worth), then re-posts it. */
static void net_forward_arrivals(struct worker *w)
{
    net_reap_tx();
    struct virtq_used_elem e;
    u32 reposted = 0;
    for (; reposted < net_rxq.num && virtq_pop(&net_rxq, &e); reposted++) {
        if (e.id >= net_rxq.num)
            fatal("virtio-net", " used a receive descriptor it was not given");
        w->hb->net_rx++;
        if (e.len < sizeof(struct virtio_net_hdr_v1) + ETH_HLEN || e.len > sizeof(struct net_buf))
            w->hb->net_errors++; /* no Ethernet header, or longer than the buffer */
        else if (net_forward(net_rx_buf[e.id].frame, e.len - (u32)sizeof(struct virtio_net_hdr_v1)))
            w->hb->net_tx++;
        else
            w->hb->net_errors++; /* no tx buffer free: dropped */
        virtq_post(&net_rxq, (u16)e.id);
    }
    if (reposted)
        vdev_notify(&net.dev, NET_RXQ);
}

/*
 * vCPU 0's network step. Without new frames it only reads the rx used index (and the TSC):
 * Status, an MMIO exit, is read for DEVICE_NEEDS_RESET every NET_STATUS_CHECK_MS at most.
 */
static void net_step(struct worker *w)
{
    if (!w->net)
        return;
    if (net_rxq.used.idx != net_rxq.last_used)
        net_forward_arrivals(w);
    u64 now = rdtsc();
    if (now >= w->next_net_check) {
        w->next_net_check = now + w->net_check_ticks;
        vdev_status(&net.dev);
    }
}

/*
 * ---- the balloon: a poll-mode virtio-balloon driver, and dynamic self-ballooning ----
 *
 * vCPU 0 drives it beside its workload, over the page allocator. Every dsb_ms it reads the
 * host's target (num_pages) and inflates to it with free pages, or deflates down to it; with
 * dsb (Hines & Gopalan's dynamic self-ballooning) it also inflates with dsb_pct % of the free
 * pages, and takes pages back only when the allocator runs short: at once, a request's worth
 * at a time (VIRTIO_BALLOON_F_DEFLATE_ON_OOM lets it go below the host's target then). The
 * pages the workload freed are reported (free page reporting) once 2 MiB of them wait, and at
 * every tick: the host discards them, and they stay free here, reused without a word. The
 * statistics buffer (free and total memory; no swap) is refilled whenever the host gives it
 * back. Every request is waited for (polled): a page in the balloon is the host's until its
 * deflate is answered (MUST_TELL_HOST), and a page being reported is not reused until its
 * report is. Whatever the host did to a page, it comes back zero or as it was, never older:
 * churn checks. All driver state is guest memory, so a VM migrated mid-request carries on.
 *
 * Free page hinting (VIRTIO_BALLOON_F_FREE_PAGE_HINT): every 2 ms the driver reads the
 * host's command id. A new one starts a session: it says the id, hands every free page over
 * (runs, a queue's worth a request) and says STOP; the pages are held, out of the allocator,
 * until the host shows DONE, or taken back a request's worth at a time when the allocator
 * runs short (then written, so the host's dirty log sees them). A hinted page comes back zero
 * or as it was (ferry gives it back to the host); with hint_any its content is not checked.
 */
#define VIRTIO_ID_BALLOON 5
#define VIRTIO_BALLOON_F_MUST_TELL_HOST 0  /* in feature word 0 */
#define VIRTIO_BALLOON_F_STATS_VQ 1
#define VIRTIO_BALLOON_F_DEFLATE_ON_OOM 2
#define VIRTIO_BALLOON_F_FREE_PAGE_HINT 3
#define VIRTIO_BALLOON_F_REPORTING 5
#define BALLOON_NUM_PAGES VIRTIO_CONFIG    /* device config: le32 target, then le32 actual, */
#define BALLOON_ACTUAL (VIRTIO_CONFIG + 4)
#define BALLOON_HINT_CMD (VIRTIO_CONFIG + 8) /* then le32 free_page_hint_cmd_id */
#define HINT_STOP 0                        /* command ids with a meaning of their own */
#define HINT_DONE 1
#define BALLOON_HINT_POLL_MS 2
#define BALLOON_PFNS 8192                  /* page numbers per inflate or deflate request (32 MiB) */
#define BALLOON_REPORT_BATCH 8192          /* freed pages that make a report (32 MiB) */
#define BALLOON_MAX_RUN (1ull << 18)       /* pages in one reported range (1 GiB) */
#define BALLOON_TIMEOUT_MS 2000

struct balloon_stat {
    u16 tag;
    u64 val;
} __attribute__((packed));
_Static_assert(sizeof(struct balloon_stat) == 10, "virtio_balloon_stat is 10 bytes");
enum { STAT_SWAP_IN = 0, STAT_MEMFREE = 4, STAT_MEMTOT = 5, STAT_AVAIL = 6, BALLOON_STATS = 4 };

static struct virtq bal_inflateq, bal_deflateq, bal_statsq, bal_hintq, bal_reportq;
static u32 bal_cmd __attribute__((aligned(64))); /* the command id the driver says */
static u32 bal_pfns[BALLOON_PFNS] __attribute__((aligned(4096)));
/* The pages of bal_pfns as the allocator's bitmaps name them: a word and its bits. */
static struct {
    u64 word, bits;
} bal_words[BALLOON_PFNS];
static u32 bal_nwords;
static struct balloon_stat bal_stats[BALLOON_STATS] __attribute__((aligned(64)));
static struct {
    struct vdev dev;
    int stats, reporting, oom, hinting; /* negotiated */
    u32 stats_index, hint_index, report_index; /* their queues */
    u32 hint_id;                        /* the last session's command id */
    u32 config_gen, cmd_id;             /* the config generation last seen, its command id */
    u64 count;                          /* pages in the balloon */
    u64 cursor;                         /* where a deflate looks first */
    u64 inflated, deflated, reported, hinted; /* pages, for the serial line */
    int flooding;                       /* balloon_flood: a request is in flight */
    u64 floods;                         /* balloon_flood: requests the device answered */
} bal;

static void balloon_progress(void)
{
    if (!cfg.balloon)
        return;
    put_str(" balloon_pages=");
    put_u64(bal.count);
    put_str(" free_pages=");
    put_u64(pa.free);
    put_str(" reported=");
    put_u64(bal.reported);
    put_str(" hinted=");
    put_u64(bal.hinted);
    if (cfg.mode == MODE_CHURN) {
        put_str(" ws_pages=");
        put_u64(churn.count);
    }
    if (cfg.flood) {
        put_str(" floods=");
        put_u64(bal.floods);
    }
}

static void balloon_fill_stats(void)
{
    static const u16 tags[BALLOON_STATS] = {STAT_SWAP_IN, STAT_MEMFREE, STAT_MEMTOT, STAT_AVAIL};
    u64 values[BALLOON_STATS] = {0, pa.free * PAGE_SIZE, ram_bytes, pa.free * PAGE_SIZE};
    for (u32 i = 0; i < BALLOON_STATS; i++) {
        bal_stats[i].tag = tags[i];
        bal_stats[i].val = values[i];
    }
    bal_statsq.desc[0] = (struct virtq_desc){(u64)bal_stats, (u32)sizeof(bal_stats), 0, 0};
    virtq_post(&bal_statsq, 0);
    vdev_notify(&bal.dev, bal.stats_index);
}

/* Device initialisation: the queues the features give (statistics and reporting take the
 * next index each when negotiated), the statistics buffer posted. */
static void balloon_init(void)
{
    u64 wanted = 1ull << VIRTIO_BALLOON_F_MUST_TELL_HOST | 1ull << VIRTIO_BALLOON_F_STATS_VQ |
                 1ull << VIRTIO_BALLOON_F_DEFLATE_ON_OOM | 1ull << VIRTIO_BALLOON_F_REPORTING |
                 1ull << VIRTIO_BALLOON_F_FREE_PAGE_HINT;
    u64 f = vdev_start(&bal.dev, "virtio-balloon", VIRTIO_ID_BALLOON, wanted,
                       "balloon: no virtio-balloon device in the virtio_mmio.device= windows");
    bal.stats = (int)((f >> VIRTIO_BALLOON_F_STATS_VQ) & 1);
    bal.reporting = (int)((f >> VIRTIO_BALLOON_F_REPORTING) & 1);
    bal.oom = (int)((f >> VIRTIO_BALLOON_F_DEFLATE_ON_OOM) & 1);
    bal.hinting = (int)((f >> VIRTIO_BALLOON_F_FREE_PAGE_HINT) & 1);
    virtq_setup(&bal.dev, 0, &bal_inflateq, "virtio-balloon queue 0 (inflateq)");
    virtq_setup(&bal.dev, 1, &bal_deflateq, "virtio-balloon queue 1 (deflateq)");
    u32 next = 2;
    if (bal.stats)
        virtq_setup(&bal.dev, bal.stats_index = next++, &bal_statsq, "virtio-balloon statsq");
    if (bal.hinting)
        virtq_setup(&bal.dev, bal.hint_index = next++, &bal_hintq, "virtio-balloon free_page_vq");
    if (bal.reporting)
        virtq_setup(&bal.dev, bal.report_index = next, &bal_reportq, "virtio-balloon reporting_vq");
    vdev_set_status(&bal.dev, STATUS_DRIVER_OK);
    if (bal.stats)
        balloon_fill_stats();
    put_str("ferry-guest: virtio-balloon at ");
    put_hex(bal.dev.base);
    put_str(bal.stats ? " stats" : "");
    put_str(bal.reporting ? " reporting" : "");
    put_str(bal.hinting ? " hinting" : "");
    put_str(bal.oom ? " deflate-on-oom" : "");
    put_str(cfg.dsb ? " dsb\n" : "\n");
}

/* Waits for the device to answer the request on q, the beat going on. */
static void balloon_wait(struct worker *w, struct virtq *q, const char *what)
{
    struct virtq_used_elem done;
    u64 deadline = rdtsc() + tsc_khz * BALLOON_TIMEOUT_MS;
    while (!virtq_pop(q, &done)) {
        if (rdtsc() > deadline) {
            vdev_status(&bal.dev); /* a device that gave up says so there */
            fatal("virtio-balloon: no answer within 2 s to ", what);
        }
        heartbeat_if_due(w);
        cpu_relax();
    }
}

/* Sends bal_pfns[0..n) on queue `index` and waits for the answer. */
static void balloon_send(struct worker *w, struct virtq *q, u32 index, u32 n, const char *what)
{
    q->desc[0] = (struct virtq_desc){(u64)bal_pfns, n * (u32)sizeof(u32), 0, 0};
    virtq_post(q, 0);
    vdev_notify(&bal.dev, index);
    balloon_wait(w, q, what);
}

/*
 * Clears up to n (at most BALLOON_PFNS) set bits of `map`, a word at a time from *cursor's
 * word on (wrapping), setting them in `mark` if given; their page frame numbers go to
 * bal_pfns, their words and bits to bal_words. Returns how many. A few instructions a page:
 * a balloon moves hundreds of thousands of them, and every instruction is emulated here.
 */
static u32 pa_gather(struct worker *wk, u64 *map, u64 *cursor, u64 n, u64 *mark)
{
    u64 words = (pa.pages + 63) / 64, first = *cursor / 64 % words;
    u32 k = 0, limit = n < BALLOON_PFNS ? (u32)n : BALLOON_PFNS;
    bal_nwords = 0;
    for (u64 i = 0; i < words && k < limit; i++) {
        if (i % 256 == 255)
            heartbeat_if_due(wk); /* a sparse map is a long walk: the beat goes on */
        u64 wi = (first + i) % words, w = map[wi], a0 = wi * 64;
        if (!w)
            continue;
        u64 all = w;
        if (a0 + 64 <= pa_segment_end(a0)) {
            /* The word's pages lie in one segment (nearly always): one lookup for all. */
            u32 base = (u32)(pa_addr(a0) / PAGE_SIZE);
            if (w == ~0ull && k + 64 <= limit) {
                for (u32 b = 0; b < 64; b++) /* all free: the common case */
                    bal_pfns[k + b] = base + b;
                k += 64;
                w = 0;
            }
            for (; w && k < limit; w &= w - 1)
                bal_pfns[k++] = base + (u32)__builtin_ctzll(w);
        } else {
            for (; w && k < limit; w &= w - 1)
                bal_pfns[k++] = (u32)(pa_addr(a0 + (u64)__builtin_ctzll(w)) / PAGE_SIZE);
        }
        u64 take = all & ~w;
        map[wi] &= ~take;
        if (mark)
            mark[wi] |= take;
        bal_words[bal_nwords].word = wi;
        bal_words[bal_nwords++].bits = take;
        *cursor = a0;
    }
    return k;
}

/* Gives up to n free pages to the balloon. */
static void balloon_inflate(struct worker *w, u64 n)
{
    while (n && pa.free) {
        u32 k = pa_gather(w, pa.free_map, &pa.cursor, n, pa.ballooned);
        if (!k)
            fatal("balloon: the allocator's free count and map disagree", "");
        pa.free -= k;
        for (u32 i = 0; pa.unreported_count && i < bal_nwords; i++) {
            u64 *u = &pa.unreported[bal_words[i].word]; /* given back: no report needed */
            pa.unreported_count -= popcount64(*u & bal_words[i].bits);
            *u &= ~bal_words[i].bits;
        }
        balloon_send(w, &bal_inflateq, 0, k, "an inflate");
        bal.count += k;
        bal.inflated += k;
        n -= k;
    }
    vdev_write(&bal.dev, BALLOON_ACTUAL, (u32)bal.count);
}

/* Takes up to n pages back from the balloon; they are free again once the host has heard. */
static void balloon_deflate(struct worker *w, u64 n)
{
    while (n && bal.count) {
        u32 k = pa_gather(w, pa.ballooned, &bal.cursor, n, 0);
        if (!k)
            fatal("balloon: its page count and map disagree", "");
        balloon_send(w, &bal_deflateq, 1, k, "a deflate");
        for (u32 i = 0; i < bal_nwords; i++)
            pa.free_map[bal_words[i].word] |= bal_words[i].bits;
        pa.free += k;
        bal.count -= k;
        bal.deflated += k;
        n -= k;
    }
    vdev_write(&bal.dev, BALLOON_ACTUAL, (u32)bal.count);
}

/*
 * Fills q's descriptors with runs of the set bits of `map` (each inside one segment, at most
 * BALLOON_MAX_RUN pages) that the device may write, up to a queue's worth: one chain, or with
 * `apart` a buffer each (QEMU takes one hint a buffer). The runs' allocator page numbers go to
 * `runs`. Returns how many.
 */
static u32 balloon_runs(const u64 *map, struct virtq *q, u64 (*runs)[2], int apart)
{
    u32 n = 0;
    for (u64 from = 0, a; n < q->num && (a = next_set(map, pa.pages, from)) != NO_PAGE; n++) {
        u64 limit = pa_segment_end(a);
        if (limit > a + BALLOON_MAX_RUN)
            limit = a + BALLOON_MAX_RUN;
        runs[n][0] = a;
        runs[n][1] = from = run_end(map, a, limit);
        q->desc[n] = (struct virtq_desc){pa_addr(a), (u32)((from - a) * PAGE_SIZE),
                                         VIRTQ_DESC_F_WRITE | VIRTQ_DESC_F_NEXT, (u16)(n + 1)};
    }
    if (n)
        q->desc[n - 1].flags = VIRTQ_DESC_F_WRITE;
    for (u32 i = 0; apart && i < n; i++)
        q->desc[i].flags = VIRTQ_DESC_F_WRITE;
    return n;
}

/* Posts the chain at q's descriptor 0 on queue `index` and waits for the answer. */
static void balloon_post(struct worker *w, struct virtq *q, u32 index, const char *what)
{
    virtq_post(q, 0);
    vdev_notify(&bal.dev, index);
    balloon_wait(w, q, what);
}

static u64 runs_buf[VIRTQ_MAX][2];

/*
 * Reports the pages freed since the last report, a request of up to a queue's worth of
 * ranges at a time; with `all` to the last, otherwise while a batch's worth waits.
 */
static void balloon_report(struct worker *w, int all)
{
    if (!bal.reporting)
        return;
    while (pa.unreported_count && (all || pa.unreported_count >= BALLOON_REPORT_BATCH)) {
        u32 n = balloon_runs(pa.unreported, &bal_reportq, runs_buf, 0);
        if (!n)
            fatal("balloon: the allocator's unreported count and map disagree", "");
        balloon_post(w, &bal_reportq, bal.report_index, "a free page report");
        for (u32 i = 0; i < n; i++) {
            bits_clear(pa.unreported, runs_buf[i][0], runs_buf[i][1]);
            pa.unreported_count -= runs_buf[i][1] - runs_buf[i][0];
            bal.reported += runs_buf[i][1] - runs_buf[i][0];
        }
    }
}

/* Says `id` on the hint queue: the session its hints go under, or STOP. */
static void hint_say(struct worker *w, u32 id)
{
    bal_cmd = id;
    bal_hintq.desc[0] = (struct virtq_desc){(u64)&bal_cmd, 4, 0, 0};
    balloon_post(w, &bal_hintq, bal.hint_index, "a free page hint command");
}

/* The host's hinting command id, read again only when its configuration changed (QEMU shows
 * STOP once a session started, without telling: what it said last still holds). */
static u32 hint_cmd_id(void)
{
    u32 gen = vdev_read(&bal.dev, VIRTIO_CONFIG_GENERATION);
    if (gen != bal.config_gen) {
        bal.config_gen = gen;
        bal.cmd_id = vdev_read(&bal.dev, BALLOON_HINT_CMD);
    }
    return bal.cmd_id;
}

/* A hinting session: every free page is handed over and held, while the host still asks
 * under this session's id. */
static void balloon_hint(struct worker *w, u32 id)
{
    bal.hint_id = id;
    hint_say(w, id);
    while (pa.free && hint_cmd_id() == id) {
        u32 n = balloon_runs(pa.free_map, &bal_hintq, runs_buf, 1);
        if (!n)
            fatal("balloon: the allocator's free count and map disagree", "");
        for (u32 i = 0; i < n; i++)
            virtq_post(&bal_hintq, (u16)i);
        vdev_notify(&bal.dev, bal.hint_index);
        for (u32 i = 0; i < n; i++)
            balloon_wait(w, &bal_hintq, "a free page hint");
        for (u32 i = 0; i < n; i++) {
            u64 a = runs_buf[i][0], end = runs_buf[i][1];
            bits_clear(pa.free_map, a, end);
            bits_set(pa.hinted, a, end);
            pa.unreported_count -= bits_take(pa.unreported, a, end); /* given back */
            pa.free -= end - a;
            pa.hinted_count += end - a;
            bal.hinted += end - a;
        }
    }
    hint_say(w, HINT_STOP);
}

/* The host is done: every hinted page is free again. */
static void hint_release_all(void)
{
    for (u64 i = 0; pa.hinted_count && i < (pa.pages + 63) / 64; i++) {
        u64 h = pa.hinted[i], n = popcount64(h);
        if (!h)
            continue;
        pa.free_map[i] |= h;
        if (cfg.hint_any)
            pa.undefined[i] |= h;
        pa.hinted[i] = 0;
        pa.free += n;
        pa.hinted_count -= n;
    }
}

/* The allocator runs short: a request's worth of hinted pages is free again. */
static void hint_release_some(struct worker *w)
{
    u32 k = pa_gather(w, pa.hinted, &pa.cursor, BALLOON_PFNS, pa.free_map);
    for (u32 i = 0; cfg.hint_any && i < bal_nwords; i++)
        pa.undefined[bal_words[i].word] |= bal_words[i].bits;
    pa.free += k;
    pa.hinted_count -= k;
}

/* What the host's command id says: a new session, or DONE. */
static void balloon_hint_poll(struct worker *w)
{
    u32 id = hint_cmd_id();
    if (id == HINT_DONE && pa.hinted_count)
        hint_release_all();
    else if (id > HINT_DONE && id != bal.hint_id)
        balloon_hint(w, id);
}

/* The period's work: follow the host's target (and with dsb inflate with free memory), then
 * report what is left. */
static void balloon_tick(struct worker *w)
{
    u64 want = vdev_read(&bal.dev, BALLOON_NUM_PAGES);
    /* churn's first cycle is its setup (memory touched once): DSB would give the climb's
     * memory back as fast as it is taken */
    int dsb = cfg.dsb && (cfg.mode != MODE_CHURN || w->hb->passes > 0);
    if (dsb && bal.count + pa.free * cfg.dsb_pct / 100 > want)
        want = bal.count + pa.free * cfg.dsb_pct / 100;
    if (want > bal.count)
        balloon_inflate(w, want - bal.count);
    else if (!cfg.dsb && bal.count > want)
        balloon_deflate(w, bal.count - want);
    balloon_report(w, 1);
}

/*
 * balloon_flood: what a hostile guest may do to its VMM. One inflate request is kept in
 * flight, a chain of every descriptor the queue has, each buffer naming FLOOD_PFNS pages: the
 * odd pages of a carved region, over and over, so that no two make a run. The pages are the
 * flood's own; nothing in the guest uses them.
 */
#define FLOOD_PFNS 65536       /* page numbers in one buffer (256 KiB) */
#define FLOOD_SPREAD 256       /* pairs of pages in the region whose odd pages are named */
static u32 *flood_pfns;

static void flood_carve(void)
{
    flood_pfns = (u32 *)carve(FLOOD_PFNS * sizeof(u32));
    u32 first = (u32)(carve(FLOOD_SPREAD * 2 * PAGE_SIZE) / PAGE_SIZE);
    for (u32 i = 0; i < FLOOD_PFNS; i++)
        flood_pfns[i] = first + 2 * (i % FLOOD_SPREAD) + 1;
}

static void balloon_flood(void)
{
    struct virtq_used_elem done;
    if (bal.flooding && !virtq_pop(&bal_inflateq, &done))
        return;
    bal.floods += (u64)bal.flooding;
    u16 n = (u16)bal_inflateq.num;
    for (u16 i = 0; i < n; i++)
        bal_inflateq.desc[i] = (struct virtq_desc){(u64)flood_pfns, FLOOD_PFNS * sizeof(u32),
                                                   i + 1 < n ? VIRTQ_DESC_F_NEXT : 0,
                                                   (u16)(i + 1)};
    virtq_post(&bal_inflateq, 0);
    vdev_notify(&bal.dev, 0);
    bal.flooding = 1;
}

/* vCPU 0's balloon step: fresh statistics when the host asked, the period's tick when due,
 * and a report when a batch of freed pages waits. Costs two memory reads when idle. */
static void balloon_step(struct worker *w)
{
    if (!w->balloon)
        return;
    if (cfg.flood) {
        balloon_flood();
        return;
    }
    struct virtq_used_elem e;
    if (bal.stats && virtq_pop(&bal_statsq, &e))
        balloon_fill_stats();
    u64 now = rdtsc();
    if (bal.hinting && now >= w->next_hint_poll) {
        w->next_hint_poll = now + w->hint_poll_ticks;
        balloon_hint_poll(w);
    }
    if (now >= w->next_dsb) {
        w->next_dsb = now + w->dsb_ticks;
        balloon_tick(w);
    } else if (pa.unreported_count >= BALLOON_REPORT_BATCH) {
        balloon_report(w, 0);
    }
}

/* A free page for the workload: when none is left, the balloon gives some back at once (below
 * the host's target only with DEFLATE_ON_OOM). */
static u64 pa_take_or_deflate(struct worker *w)
{
    u64 a = pa_take();
    if (a != NO_PAGE || !w->balloon)
        return a;
    if (pa.hinted_count) {
        hint_release_some(w);
        return pa_take();
    }
    u64 target = vdev_read(&bal.dev, BALLOON_NUM_PAGES);
    u64 spare = bal.oom || cfg.dsb ? bal.count : bal.count > target ? bal.count - target : 0;
    balloon_deflate(w, spare < BALLOON_PFNS ? spare : BALLOON_PFNS);
    return pa_take();
}

/* vCPU 0's device work, wherever its heart beats: the disk step when due, the network's, the
 * balloon's. */
static void devices_step(struct worker *w)
{
    blk_step_if_due(w);
    net_step(w);
    balloon_step(w);
}

/* Keeps the vCPU under its share of rate=N, heart still beating (and vCPU 0's devices busy). */
static void throttle(struct worker *w)
{
    if (!w->rate || (cfg.fill == FILL_REAL && w->hb->passes == 0))
        return;
    for (;;) {
        u64 elapsed = rdtsc() - w->rate_tsc;
        u64 allowed = elapsed / tsc_khz * w->rate / 1000;
        if (w->hb->pages - w->rate_pages < allowed)
            return;
        heartbeat_if_due(w);
        devices_step(w);
        cpu_relax();
    }
}

static inline u64 stamp(u64 page, u32 gen) { return (page << 32) | gen; }
static inline volatile u64 *page_word(u64 page)
{
    /* Fast path: most pages lie in the first segment. */
    if (page < segments[0].pages)
        return (volatile u64 *)(segments[0].base + page * PAGE_SIZE);
    return (volatile u64 *)page_addr(page);
}

/*
 * ---- page content ----
 *
 * fill=word leaves every page zero but for its stamp (8 bytes in 4096): any compressor
 * squeezes it to a few bytes. fill=random and fill=mixed give a page real content the first
 * time it is written (its stamp word still 0): one `rep movsq` of 4 KiB from a pool made at
 * boot. Later writes change only the stamp, as with word, so the steady state costs the
 * same. The copy is still ~0.5 ms a page here (KVM emulates each of its 512 moves; a C loop
 * would be ~5x that): the first pass over 256 MiB takes tens of seconds.
 *
 * Pools: 4 MiB + 4 KiB each. Page p copies 4 KiB from offset (p % 1024) * 4096 plus a shift
 * that changes every 1024 pages, so two pages closer than 1023 pages (4 MiB, a compressor's
 * batch or window) never share a byte run, and no two pages of the working set are equal.
 *   random: a 64-bit LCG's state; zstd, lz4 and xz cannot shrink it.
 *   text:   words of 4 characters from a 64-entry table (6 bits of entropy per 4 bytes):
 *           ASCII that zstd -3 shrinks ~3.4x, lz4 ~1.9x.
 *
 * fill=mixed, per page from a hash of its number: 3/8 zero, 4/8 text, 1/8 random. Zero pages
 * are pages the writer never writes (free memory in a real guest is zero and stays so); a
 * pass counts them as touched and verify checks that they still read zero. The zero share
 * follows a real guest's memory in QEMU's zstd migration measurement (5 of 8 GiB in use,
 * pgbench data: zstd ratio 6.7-6.9, Denis Plotnikov, qemu-devel 2019, "migration: add zstd
 * compression"); QEMU's multi-thread compression notes report ~60% less data (ratio ~2.5) in a
 * typical case. This mix lands in between: zstd -3 shrinks a 256 MiB working set 3.3x.
 *
 * fill=fresh rewrites the whole page on every write, not just its stamp: 3/4 text, 1/4
 * random, from a pool offset that moves with the page's generation, so no copy repeats the
 * last one (nothing for a delta encoder to find) and no page is zero; about 2x with zstd,
 * like memory a real guest keeps rewriting. Each write costs a whole copy (see above).
 */
enum kind { KIND_WORD, KIND_ZERO, KIND_TEXT, KIND_RANDOM, KIND_REAL };

/* 64 tokens of 4 bytes; text is made of them. */
static const char text_tokens[] =
    "the and for was not but are his you all one had can her new now "
    "old see two way who did get may use day man out any how its our "
    "timepagedatafileuserfromwiththatthishavetheywillbeenwhenmoresome"
    "whatintoonlythenoveralsobackworkyearwelllikejustof, it. to. on,\n";
_Static_assert(sizeof(text_tokens) == 64 * 4 + 1, "64 tokens of 4 bytes");

/*
 * Pool words come from a 64-bit LCG's raw state: 3 instructions a word (~1 us each under
 * emulation, so every instruction counts), and zstd, lz4 and xz cannot shrink its output
 * (they look for repeated byte runs, and the state never repeats in a pool).
 */
#define LCG_MUL 6364136223846793005ull
#define LCG_ADD 1442695040888963407ull

/* Runs before the workload: seconds, once. */
static void make_pools(void)
{
    if (!random_pool)
        return;
    static u64 pairs[4096]; /* every pair of tokens: a text word is one table load */
    u64 t0 = rdtsc(), n = POOL_BYTES / 8, s = 0x2545f4914f6cdd1dull;
#pragma GCC unroll 8
    for (u64 i = 0; i < n; i++)
        random_pool[i] = s = s * LCG_MUL + LCG_ADD;
    if (text_pool) {
        for (u64 i = 0; i < 4096; i++) {
            u32 a, b;
            __builtin_memcpy(&a, text_tokens + 4 * (i & 63), 4);
            __builtin_memcpy(&b, text_tokens + 4 * (i >> 6), 4);
            pairs[i] = a | (u64)b << 32;
        }
#pragma GCC unroll 8
        for (u64 i = 0; i < n; i++) {
            s = s * LCG_MUL + LCG_ADD;
            text_pool[i] = pairs[s >> 52];
        }
    }
    put_str("ferry-guest: fill pools ready in ");
    put_u64((rdtsc() - t0) / tsc_khz);
    put_str(" ms\n");
}

static inline enum kind page_kind(u64 page)
{
    if (cfg.fill == FILL_WORD)
        return KIND_WORD;
    if (cfg.fill == FILL_RANDOM)
        return KIND_RANDOM;
    if (cfg.fill == FILL_REAL)
        return KIND_REAL;
    if (cfg.fill == FILL_FRESH)
        return (page * 0x9e3779b97f4a7c15ull) >> 62 ? KIND_TEXT : KIND_RANDOM;
    static const u8 mix[8] = {KIND_ZERO, KIND_ZERO, KIND_ZERO, KIND_TEXT,
                              KIND_TEXT, KIND_TEXT, KIND_TEXT, KIND_RANDOM};
    return (enum kind)mix[(page * 0x9e3779b97f4a7c15ull) >> 61];
}

/* fill=real: the sample page `page` copies, spread so that neighbours differ. */
static inline const u8 *sample_page(u64 page)
{
    return memory_sample + ((page * 0x9e3779b97f4a7c15ull) >> 32) % sample_pages() * PAGE_SIZE;
}

/* The page's content before its stamp: once, or (fill=fresh) at every write `gen`. */
static void lay_down(struct worker *w, u64 page, volatile u64 *word, enum kind kind, u64 gen)
{
    const u64 *pool = kind == KIND_TEXT ? text_pool : random_pool;
    u64 shift = ((page / POOL_SLICES) * 8 * 61 + gen * 8 * 127) % PAGE_SIZE;
    const void *src = (const u8 *)pool + (page % POOL_SLICES) * PAGE_SIZE + shift;
    if (kind == KIND_REAL)
        src = sample_page(page);
    void *dst = (void *)word;
    u64 n = PAGE_SIZE / 8;
    __asm__ volatile("rep movsq" : "+D"(dst), "+S"(src), "+c"(n)::"memory");
    if (kind == KIND_REAL)
        word[1] ^= page; /* no two pages of the working set are equal */
    heartbeat_if_due(w); /* a copy takes as long as ~40 stamps: keep the beat steady */
}

/*
 * fill=real after the first write: an application changes part of a page, not all of it.
 * Rewrites one 256-byte chunk of 16 from another sample page, at an offset that moves with
 * the generation: what a delta encoder finds, and content that compresses as the sample does.
 */
#define REAL_CHUNK 256ull
static void rewrite_chunk(u64 page, volatile u64 *word, u64 gen)
{
    u64 at = (page + gen * 7) % (PAGE_SIZE / REAL_CHUNK) * REAL_CHUNK;
    const void *src = sample_page(page + gen) + at;
    void *dst = (u8 *)word + at;
    u64 n = REAL_CHUNK / 8;
    __asm__ volatile("rep movsq" : "+D"(dst), "+S"(src), "+c"(n)::"memory");
}

/* A write's content before its stamp `gen` (the page's first write has gen 1). */
static void write_content(struct worker *w, u64 page, volatile u64 *word, enum kind kind, u64 gen)
{
    if (kind == KIND_WORD)
        return;
    if (*word == 0 || cfg.fill == FILL_FRESH)
        lay_down(w, page, word, kind, cfg.fill == FILL_FRESH ? gen : 0);
    else if (kind == KIND_REAL)
        rewrite_chunk(page, word, gen);
}

static void report_mismatch(struct worker *w, u64 page)
{
    w->hb->errors++;
    outl(PORT_VERIFY_ERROR, (u32)page);
    if (w->hb->errors <= 8) {
        put_str("ferry-guest: verify error: page ");
        put_u64(page);
        put_str("\n");
    }
}

static void touch(struct worker *w, u64 page, int write)
{
    volatile u64 *word = page_word(page);
    enum kind kind = page_kind(page);
    if (kind == KIND_ZERO) {
        if (cfg.verify && *word)
            report_mismatch(w, page);
        w->hb->pages++;
        return;
    }
    if (cfg.verify) {
        u32 gen = expected_gen[page];
        if (gen && *word != stamp(page, gen))
            report_mismatch(w, page);
        if (write) {
            write_content(w, page, word, kind, gen + 1);
            *word = stamp(page, gen + 1);
            expected_gen[page] = gen + 1;
        }
    } else if (write) {
        write_content(w, page, word, kind, w->hb->passes + 1);
        *word = stamp(page, (u32)w->hb->passes + 1);
    } else {
        (void)*word;
    }
    w->hb->pages++;
}

static inline u64 next_random(struct worker *w)
{
    w->rng ^= w->rng << 13;
    w->rng ^= w->rng >> 7;
    w->rng ^= w->rng << 17;
    return w->rng;
}

/*
 * ---- zipf: hot and cold pages ----
 *
 * A vCPU's share is cut into ZIPF_REGIONS regions of equal size; region k (in a scrambled
 * order, so the hottest is not the first) is chosen with weight 1/(k+1), Zipf's law with
 * exponent 1, and the page within it uniformly: the top 10 % of the regions take ~3/4 of
 * the touches, as an application's heap and caches do. Integer weights: the guest has no
 * floating point. The first pass still goes in order, laying every page down once.
 */
#define ZIPF_SCRAMBLE 619ull /* odd: k -> k * 619 mod 1024 is a permutation */
static u64 zipf_cdf[ZIPF_REGIONS];

static void make_zipf(void)
{
    u64 sum = 0;
    for (u64 k = 0; k < ZIPF_REGIONS; k++)
        zipf_cdf[k] = sum += (1ull << 40) / (k + 1);
}

static u64 zipf_page(struct worker *w)
{
    u64 u = next_random(w) % zipf_cdf[ZIPF_REGIONS - 1], lo = 0, hi = ZIPF_REGIONS - 1;
    while (lo < hi) {
        u64 mid = (lo + hi) / 2;
        if (zipf_cdf[mid] > u)
            hi = mid;
        else
            lo = mid + 1;
    }
    u64 region = lo * ZIPF_SCRAMBLE % ZIPF_REGIONS;
    u64 start = region * w->count / ZIPF_REGIONS, end = (region + 1) * w->count / ZIPF_REGIONS;
    return w->first + start + next_random(w) % (end - start);
}

static u64 next_page(struct worker *w, u64 i)
{
    if (cfg.zipf && w->hb->passes)
        return zipf_page(w);
    if (!cfg.random)
        return w->first + i;
    return w->first + next_random(w) % w->count;
}

/* reads=N: whether this touch of a writing pass only reads (never in the first pass). */
static inline int reads_only(struct worker *w)
{
    return cfg.reads && w->hb->passes && next_random(w) % 100 < cfg.reads;
}

static void run_pass(struct worker *w, int write)
{
    for (u64 i = 0; i < w->count; i++) {
        touch(w, next_page(w, i), write && !reads_only(w));
        if ((i & 15) == 15) {
            heartbeat_if_due(w);
            devices_step(w);
            throttle(w);
        }
    }
    w->hb->passes++;
}


/*
 * ---- the churn workload: a working set that grows and shrinks ----
 *
 * vCPU 0 allocates pages from the page allocator and stamps each, up to ws=, then frees the
 * newest back down to a quarter of it, and again: a pass is one such cycle (the first goes up
 * to peak= when it is larger: memory touched once, then freed, as a heap or a page cache
 * does). Every 16 pages it takes or frees, it verifies and rewrites the next 4 of the set
 * (round robin): every instruction is emulated here, and the set moves anyway. A page it takes must read zero (the host discarded it: in the balloon, or
 * reported) or carry the stamp it last had, never an older one; a page it frees must carry
 * its stamp. Other vCPUs only beat.
 */
static inline volatile u64 *churn_word(u64 a)
{
    u64 g = pa.first + a; /* fast path: most pages lie in the first segment */
    return (volatile u64 *)(g < segments[0].pages ? segments[0].base + g * PAGE_SIZE : page_addr(g));
}

/* Page a's next generation, after checking it carries the last one (with `fresh`: or zero;
 * with `fresh` 2 anything: it came back from a hint under hint_any). */
static void churn_stamp(struct worker *w, u64 a, int fresh)
{
    volatile u64 *word = churn_word(a);
    if (!cfg.verify) {
        *word = stamp(a, (u32)w->hb->passes + 1);
        return;
    }
    u32 gen = churn.gen[a];
    u64 v = *word;
    if (fresh != 2 && (gen ? v != stamp(a, gen) && !(fresh && v == 0) : v != 0))
        report_mismatch(w, a);
    *word = stamp(a, gen + 1);
    churn.gen[a] = gen + 1;
}

static void churn_grow_one(struct worker *w)
{
    u64 a = pa_take_or_deflate(w);
    if (a == NO_PAGE)
        fatal("churn: out of memory", bal.count ? " (the balloon holds the rest)" : "");
    int fresh = 1;
    if (bit_get(pa.undefined, a)) {
        bit_clear(pa.undefined, a);
        fresh = 2;
    }
    churn_stamp(w, a, fresh);
    churn.stack[churn.count++] = (u32)a;
    w->hb->pages++;
}

static void churn_shrink_one(struct worker *w)
{
    u64 a = churn.stack[--churn.count];
    if (cfg.verify && *churn_word(a) != stamp(a, churn.gen[a]))
        report_mismatch(w, a);
    pa_put(a, 1);
    w->hb->pages++;
}

static void churn_beat(struct worker *w);

/*
 * The first cycle's climb to its peak, a word of the allocator (64 pages) at a time while
 * whole words are free: memory touched once, as fast as this guest touches it (a page at a
 * time, every instruction emulated, a 4 GiB peak took minutes).
 */
static void churn_grow_words(struct worker *w, u64 top)
{
    for (u64 wi = pa.cursor / 64; (wi + 1) * 64 <= pa.pages && churn.count + 64 <= top; wi++) {
        if (pa.free_map[wi] != ~0ull || pa.unreported[wi] || pa.undefined[wi])
            break;
        pa.free_map[wi] = 0;
        pa.free -= 64;
        for (u64 a = wi * 64; a < wi * 64 + 64; a++) {
            churn_stamp(w, a, 1);
            churn.stack[churn.count++] = (u32)a;
        }
        w->hb->pages += 64;
        pa.cursor = (wi + 1) * 64 % pa.pages;
        churn_beat(w);
    }
}

/* The way down from the peak, a word at a time while the newest 64 pages of the set are one
 * whole word of the allocator (as churn_grow_words laid them). */
static void churn_shrink_words(struct worker *w, u64 low)
{
    while (churn.count >= low + 64) {
        u64 a0 = churn.stack[churn.count - 64];
        if (a0 % 64 || churn.stack[churn.count - 1] != a0 + 63 || pa.free_map[a0 / 64])
            return;
        for (u64 i = 0; i < 64; i++) {
            u64 a = churn.stack[churn.count - 64 + i];
            if (a != a0 + i)
                return;
            if (cfg.verify && *churn_word(a) != stamp(a, churn.gen[a]))
                report_mismatch(w, a);
        }
        churn.count -= 64;
        pa.free_map[a0 / 64] = ~0ull;
        pa.free += 64;
        pa.unreported_count += 64 - popcount64(pa.unreported[a0 / 64]);
        pa.unreported[a0 / 64] = ~0ull;
        w->hb->pages += 64;
        churn_beat(w);
    }
}

/* Verifies and rewrites the next 4 pages of the set; the beat and the devices go on. */
static void churn_beat(struct worker *w)
{
    for (u32 i = 0; i < 4 && churn.count; i++) {
        if (churn.touch >= churn.count)
            churn.touch = 0;
        churn_stamp(w, churn.stack[churn.touch++], 0);
        w->hb->pages++;
    }
    heartbeat_if_due(w);
    devices_step(w);
    throttle(w);
}

static void run_churn(struct worker *w)
{
    u64 high = cfg.ws_bytes / PAGE_SIZE, low = high / 4 ? high / 4 : 1;
    for (u64 pass = 0; cfg.passes == 0 || pass < cfg.passes; pass++) {
        u64 top = pass == 0 && cfg.peak_bytes > cfg.ws_bytes ? cfg.peak_bytes / PAGE_SIZE : high;
        if (pass == 0)
            churn_grow_words(w, top);
        while (churn.count < top)
            if ((churn_grow_one(w), churn.count % 16 == 0))
                churn_beat(w);
        if (pass == 0)
            churn_shrink_words(w, low);
        while (churn.count > low)
            if ((churn_shrink_one(w), churn.count % 16 == 0))
                churn_beat(w);
        w->hb->passes++;
        if (pass == 0) {
            put_str("ferry-guest: churn first pass ms=");
            put_u64((rdtsc() - w->start_tsc) / tsc_khz);
            put_str("\n");
        }
    }
}

static void run_worker(u64 cpu)
{
    struct worker w = {0};
    u64 share = ws_pages / cfg.vcpus;
    w.hb = &blocks[cpu];
    w.first = share * cpu;
    w.count = cpu + 1 == cfg.vcpus ? ws_pages - w.first : share;
    w.rng = 0x9e3779b97f4a7c15ull * (cpu + 1);
    w.hb_ticks = tsc_khz * cfg.hb_us / 1000;
    w.serial_ticks = tsc_khz * cfg.serial_ms;
    w.tick_ticks = tsc_khz * cfg.tick_ms;
    w.start_tsc = w.rate_tsc = rdtsc();
    w.rate = cfg.rate / cfg.vcpus;
    w.blk = cfg.blk && cpu == 0;
    w.blk_ticks = cfg.blk_rate ? tsc_khz * 1000 / cfg.blk_rate : 0;
    w.net = cfg.net && cpu == 0;
    w.net_check_ticks = tsc_khz * NET_STATUS_CHECK_MS;
    w.balloon = cfg.balloon && cpu == 0;
    w.dsb_ticks = tsc_khz * cfg.dsb_ms;
    w.next_dsb = w.start_tsc + w.dsb_ticks;
    w.hint_poll_ticks = tsc_khz * BALLOON_HINT_POLL_MS;
    w.next_hint_poll = w.start_tsc + w.hint_poll_ticks;

    w.hb->cpu = (u32)cpu;
    w.hb->share_base = page_addr(w.first);
    w.hb->ws_split_page = segments[0].pages;
    w.hb->ws_base_high = nsegments > 1 ? segments[1].base : 0;
    w.hb->share_pages = w.count;
    w.hb->ws_base = ws_base;
    w.hb->magic = HB_MAGIC;
    outl(PORT_REGISTER, (u32)(u64)w.hb);

    if (cfg.mode == MODE_READ)
        run_pass(&w, 1); /* read needs stamped pages to check */
    if (cfg.mode == MODE_CHURN && cpu == 0)
        run_churn(&w);
    for (u64 pass = 0; cfg.mode != MODE_CHURN || cpu; pass++) {
        if (cfg.passes && pass >= cfg.passes)
            break;
        if (cfg.mode == MODE_IDLE || cfg.mode == MODE_CHURN) {
            for (u64 spin = 0; spin < 1000000; spin++) {
                heartbeat_if_due(&w);
                devices_step(&w);
                cpu_relax();
            }
            w.hb->passes++;
        } else {
            run_pass(&w, cfg.mode == MODE_WRITE);
            if (pass == 0 && cfg.fill == FILL_REAL) {
                w.rate_tsc = rdtsc();
                w.rate_pages = w.hb->pages;
            }
            if (pass == 0 && cpu == 0) {
                /* With fill=random|mixed the first pass lays the content down: say how long. */
                put_str("ferry-guest: first pass ms=");
                put_u64((rdtsc() - w.start_tsc) / tsc_khz);
                put_str("\n");
            }
        }
    }
    w.hb->seq++;
    outl(PORT_HEARTBEAT, (u32)w.hb->seq);
    if (cpu == 0)
        serial_progress();
    outl(PORT_DONE, 0);
}

static const char *mode_name(void)
{
    return cfg.mode == MODE_IDLE    ? "idle"
           : cfg.mode == MODE_WRITE ? "write"
           : cfg.mode == MODE_READ  ? "read"
                                    : "churn";
}

/* ---- processors: the ACPI MADT, and INIT/SIPI through the local APIC ---- */

static int sum_ok(const u8 *p, u64 len)
{
    u8 sum = 0;
    for (u64 i = 0; i < len; i++)
        sum = (u8)(sum + p[i]);
    return sum == 0;
}

static const u8 *find_rsdp(const struct hvm_start_info *si)
{
    if (si->rsdp_paddr)
        return (const u8 *)si->rsdp_paddr;
    for (u64 a = 0xe0000; a < 0x100000; a += 16) {
        const u8 *p = (const u8 *)a;
        if (p[0] == 'R' && p[1] == 'S' && p[2] == 'D' && p[3] == ' ' && p[4] == 'P' &&
            p[5] == 'T' && p[6] == 'R' && p[7] == ' ' && sum_ok(p, 20))
            return p;
    }
    return 0;
}

static u32 rd32(const u8 *p) { return p[0] | p[1] << 8 | p[2] << 16 | (u32)p[3] << 24; }
static u64 rd64(const u8 *p) { return rd32(p) | (u64)rd32(p + 4) << 32; }

/* Enabled processors the MADT lists (0 when there are no ACPI tables). */
static u64 madt_cpus(const struct hvm_start_info *si)
{
    const u8 *rsdp = find_rsdp(si);
    if (!rsdp)
        return 0;
    int xsdt = rsdp[15] >= 2;
    const u8 *sdt = (const u8 *)(xsdt ? rd64(rsdp + 24) : rd32(rsdp + 16));
    u64 entries = (rd32(sdt + 4) - 36) / (xsdt ? 8 : 4);
    for (u64 i = 0; i < entries; i++) {
        const u8 *t = (const u8 *)(xsdt ? rd64(sdt + 36 + 8 * i) : rd32(sdt + 36 + 4 * i));
        if (t[0] != 'A' || t[1] != 'P' || t[2] != 'I' || t[3] != 'C')
            continue;
        u64 cpus = 0, len = rd32(t + 4);
        for (u64 at = 44; at + 2 <= len && t[at + 1]; at += t[at + 1])
            if (t[at] == 0 && (rd32(t + at + 4) & 1))
                cpus++;
        return cpus;
    }
    return 0;
}

static void lapic_write(u64 reg, u32 v) { *(volatile u32 *)(LAPIC + reg) = v; }
static u32 lapic_read(u64 reg) { return *(volatile u32 *)(LAPIC + reg); }

static void delay_us(u64 us)
{
    u64 end = rdtsc() + tsc_khz * us / 1000;
    while (rdtsc() < end)
        cpu_relax();
}

/* INIT, then two SIPIs, to every other processor (the MultiProcessor Specification's way). */
static void start_aps(void)
{
    u64 n = (u64)(ap_trampoline_end - ap_trampoline);
    for (u64 i = 0; i < n; i++)
        ((volatile u8 *)TRAMPOLINE_ADDR)[i] = ap_trampoline[i];
    lapic_write(0xf0, 0x1ff);                       /* software-enable, spurious vector 0xff */
    lapic_write(0x310, 0);
    lapic_write(0x300, 0x000c4500);                 /* INIT, all excluding self */
    delay_us(10000);
    for (int i = 0; i < 2; i++) {
        lapic_write(0x300, 0x000c4600 | (u32)(TRAMPOLINE_ADDR >> 12)); /* SIPI */
        delay_us(200);
    }
    u64 deadline = rdtsc() + tsc_khz * 5000;        /* 5 s: emulated real mode is slow */
    while (__atomic_load_n(&aps_up, __ATOMIC_ACQUIRE) < cfg.vcpus - 1) {
        if (rdtsc() > deadline)
            fatal("secondary vCPUs did not start after INIT/SIPI", "");
        cpu_relax();
    }
    (void)lapic_read(0x20);
}

/*
 * ---- user mode ----
 *
 * With `user`, every vCPU drops to ring 3 (boot.S's GDT has the selectors) before its
 * worker starts and never comes back: the workload makes no system call. IOPL 3 keeps port
 * I/O (serial, heartbeats) working; every page is mapped for user access.
 */
#define USER_DATA_SELECTOR 0x23 /* GDT entry 4, RPL 3 */
#define USER_CODE_SELECTOR 0x2b /* GDT entry 5, RPL 3 */
#define USER_RFLAGS 0x3002ull   /* IOPL 3, interrupts off, the reserved bit */
#define USER_STACK 16384ull
static u8 user_stacks[MAX_CPUS][USER_STACK] __attribute__((aligned(16)));

/* Sets the user bit in every present entry of the page tables, then flushes the TLB. */
static void allow_user_access(void)
{
    boot_pml4[0] |= 4;
    for (u64 g = 0; g < MAPPED_GIB; g++) {
        if (!(boot_pdpt[g] & 1))
            continue;
        boot_pdpt[g] |= 4;
        for (u64 i = 0; i < 512 && !(boot_pdpt[g] & 0x80); i++)
            if (boot_pd[g * 512 + i] & 1)
                boot_pd[g * 512 + i] |= 4;
    }
    u64 cr3;
    __asm__ volatile("mov %%cr3, %0; mov %0, %%cr3" : "=r"(cr3)::"memory");
}

/* Where a worker that ends in user mode returns to: it cannot halt there. */
static void parked_in_user(void)
{
    for (;;)
        cpu_relax();
}

static void run_worker(u64 cpu);

/* Runs vCPU `cpu`'s worker, in ring 3 with `user`. */
static void start_worker(u64 cpu)
{
    if (!cfg.user) {
        run_worker(cpu);
        return;
    }
    u64 *top = (u64 *)(user_stacks[cpu] + USER_STACK);
    *--top = (u64)parked_in_user; /* run_worker's return address */
    __asm__ volatile("pushq %[ss]\n\t"
                     "pushq %[sp]\n\t"
                     "pushq %[flags]\n\t"
                     "pushq %[cs]\n\t"
                     "pushq %[ip]\n\t"
                     "iretq"
                     :
                     : [ss] "i"(USER_DATA_SELECTOR), [sp] "r"(top), [flags] "i"(USER_RFLAGS),
                       [cs] "i"(USER_CODE_SELECTOR), [ip] "r"(run_worker), "D"(cpu)
                     : "memory");
    __builtin_unreachable();
}

void guest_main(const struct hvm_start_info *si)
{
    put_str("ferry-guest: booted\n");
    parse_cmdline(si->cmdline_paddr ? (const char *)si->cmdline_paddr : "");
    read_memory_map(si, (u64)__image_end);
    if (cfg.blk)
        blk_init(); /* first: the disk's capacity bounds expected_blk_gen */
    if (cfg.net)
        net_init();
    plan_layout();
    tsc_khz = kvmclock_tsc_khz();
    if (!tsc_khz)
        tsc_khz = calibrate_tsc_khz();
    if (!tsc_khz) {
        put_str("ferry-guest: PIT calibration failed, assuming a 2 GHz TSC\n");
        tsc_khz = 2000000;
    }
    make_pools();
    if (cfg.zipf)
        make_zipf();
    if (cfg.user)
        allow_user_access();
    if (cfg.balloon)
        balloon_init();
    u64 cpus = madt_cpus(si);
    put_str("ferry-guest: madt cpus=");
    put_u64(cpus);
    put_str("\n");
    if (cpus && cfg.vcpus > cpus)
        fatal("vcpus= is larger than the processors the MADT lists", "");
    if (cfg.vcpus > 1)
        start_aps();
    put_str("ferry-guest: mode=");
    put_str(mode_name());
    put_str(" ws_pages=");
    put_u64(ws_pages);
    put_str(" order=");
    put_str(cfg.zipf ? "zipf" : cfg.random ? "random" : "seq");
    put_str(cfg.verify ? " verify" : "");
    put_str(cfg.fill == FILL_WORD     ? " fill=word"
            : cfg.fill == FILL_RANDOM ? " fill=random"
            : cfg.fill == FILL_MIXED  ? " fill=mixed"
            : cfg.fill == FILL_FRESH  ? " fill=fresh"
                                      : " fill=real");
    if (cfg.fill == FILL_REAL) {
        put_str(" sample_pages=");
        put_u64(sample_pages());
    }
    if (cfg.reads) {
        put_str(" reads=");
        put_u64(cfg.reads);
    }
    put_str(cfg.user ? " user" : "");
    put_str(" vcpus=");
    put_u64(cfg.vcpus);
    put_str(" tsc_khz=");
    put_u64(tsc_khz);
    if (cfg.blk) {
        put_str(" blk sectors=");
        put_u64(cfg.blk_sectors);
        put_str(" blk_rate=");
        put_u64(cfg.blk_rate);
    }
    if (cfg.net)
        put_str(" net=fwd");
    if (cfg.mode == MODE_CHURN) {
        put_str(" churn_ws_pages=");
        put_u64(cfg.ws_bytes / PAGE_SIZE);
        put_str(" peak_pages=");
        put_u64(cfg.peak_bytes / PAGE_SIZE);
    }
    if (cfg.balloon) {
        put_str(cfg.dsb ? " dsb dsb_ms=" : " balloon period_ms=");
        put_u64(cfg.dsb_ms);
        put_str(" allocator_pages=");
        put_u64(pa.pages);
    }
    put_str("\n");
    __atomic_store_n(&go, 1, __ATOMIC_RELEASE);
    start_worker(0);
}

void secondary_main(u64 cpu)
{
    __atomic_fetch_add(&aps_up, 1, __ATOMIC_ACQ_REL);
    while (!__atomic_load_n(&go, __ATOMIC_ACQUIRE))
        cpu_relax();
    if (cpu < cfg.vcpus)
        start_worker(cpu);
}
