/*
 * ferry's workload guest: touches one 8-byte word per 4 KiB page of a working set, forever,
 * and reports progress through heartbeats. It polls; it needs no interrupts or timers.
 * Command line words (PVH start_info cmdline):
 *   idle | write | read          workload (default idle)
 *   ws=SIZE                      working set, e.g. 64M, 1G (default 64M)
 *   seq | random                 page order (default seq)
 *   verify                       stamp every page, check every stamp
 *   rate=N                       at most N pages/s in total
 *   vcpus=N                      vCPUs sharing the work (the VMM starts them)
 *   passes=N                     stop after N passes (0 = forever)
 *   hb_us=N                      heartbeat period in microseconds (default 1000)
 *   serial_ms=N                  serial progress line period (default 1000)
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

enum mode { MODE_IDLE, MODE_WRITE, MODE_READ };

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
};

extern char __image_end[];

static struct config cfg;
static struct hb_block blocks[MAX_CPUS] __attribute__((aligned(64)));
static u32 *expected_gen;       /* verify: generation each page should carry */
static u64 ws_base;             /* guest-physical address of page 0 of the working set */
static u64 ws_pages;
static u64 tsc_khz;
static volatile u64 go;         /* set by vCPU 0 once the layout is ready */

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
    else if (word_is(w, len, "seq")) cfg.random = 0;
    else if (word_is(w, len, "random")) cfg.random = 1;
    else if (word_is(w, len, "verify")) cfg.verify = 1;
    else fatal("unknown workload word ", word);
}

static void parse_cmdline(const char *s)
{
    cfg = (struct config){MODE_IDLE, 64ull << 20, 0, 0, NO_LIMIT, 1, 0, 1000, 1000};
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
}

/* ---- memory layout ---- */

/* The RAM region that holds the image; the workload lives in it above the image. */
static u64 ram_end_after_image(const struct hvm_start_info *si)
{
    const struct hvm_memmap_entry *map = (const void *)si->memmap_paddr;
    u64 image_end = (u64)__image_end;
    for (u32 i = 0; si->memmap_paddr && i < si->memmap_entries; i++)
        if (map[i].type == 1 && map[i].addr <= image_end && image_end < map[i].addr + map[i].size)
            return map[i].addr + map[i].size;
    fatal("no RAM region after the guest image in the memory map", "");
    return 0;
}

static void plan_layout(u64 ram_end)
{
    const u64 align = 2ull << 20;
    u64 cursor = ((u64)__image_end + align - 1) & ~(align - 1);
    ws_pages = cfg.mode == MODE_IDLE ? 0 : cfg.ws_bytes / PAGE_SIZE;
    if (cfg.verify) {
        expected_gen = (u32 *)cursor;
        cursor += (ws_pages * sizeof(u32) + align - 1) & ~(align - 1);
    }
    ws_base = cursor;
    if (ws_base + ws_pages * PAGE_SIZE > ram_end)
        fatal("working set does not fit in guest memory", "");
}

/* ---- TSC calibration against PIT channel 2 (works in ferry and QEMU) ---- */

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
    u64 start_tsc, rate;
};

static void serial_progress(void)
{
    u64 pages = 0, passes = 0, errors = 0;
    for (u64 c = 0; c < cfg.vcpus; c++) {
        pages += blocks[c].pages;
        passes += blocks[c].passes;
        errors += blocks[c].errors;
    }
    put_str("ferry-guest: hb=");
    put_u64(blocks[0].seq);
    put_str(" pages=");
    put_u64(pages);
    put_str(" passes=");
    put_u64(passes);
    put_str(" errors=");
    put_u64(errors);
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
}

/* Keeps the vCPU under its share of rate=N, heart still beating. */
static void throttle(struct worker *w)
{
    if (!w->rate)
        return;
    for (;;) {
        u64 elapsed = rdtsc() - w->start_tsc;
        u64 allowed = elapsed / tsc_khz * w->rate / 1000;
        if (w->hb->pages < allowed)
            return;
        heartbeat_if_due(w);
        cpu_relax();
    }
}

static inline u64 stamp(u64 page, u32 gen) { return (page << 32) | gen; }
static inline volatile u64 *page_word(u64 page)
{
    return (volatile u64 *)(ws_base + page * PAGE_SIZE);
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
    if (cfg.verify) {
        u32 gen = expected_gen[page];
        if (gen && *word != stamp(page, gen))
            report_mismatch(w, page);
        if (write) {
            *word = stamp(page, gen + 1);
            expected_gen[page] = gen + 1;
        }
    } else if (write) {
        *word = stamp(page, (u32)w->hb->passes + 1);
    } else {
        (void)*word;
    }
    w->hb->pages++;
}

static u64 next_page(struct worker *w, u64 i)
{
    if (!cfg.random)
        return w->first + i;
    w->rng ^= w->rng << 13;
    w->rng ^= w->rng >> 7;
    w->rng ^= w->rng << 17;
    return w->first + w->rng % w->count;
}

static void run_pass(struct worker *w, int write)
{
    for (u64 i = 0; i < w->count; i++) {
        touch(w, next_page(w, i), write);
        if ((i & 15) == 15) {
            heartbeat_if_due(w);
            throttle(w);
        }
    }
    w->hb->passes++;
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
    w.start_tsc = rdtsc();
    w.rate = cfg.rate / cfg.vcpus;

    w.hb->cpu = (u32)cpu;
    w.hb->share_base = ws_base + w.first * PAGE_SIZE;
    w.hb->share_pages = w.count;
    w.hb->ws_base = ws_base;
    w.hb->magic = HB_MAGIC;
    outl(PORT_REGISTER, (u32)(u64)w.hb);

    if (cfg.mode == MODE_READ)
        run_pass(&w, 1); /* read needs stamped pages to check */
    for (u64 pass = 0; cfg.passes == 0 || pass < cfg.passes; pass++) {
        if (cfg.mode == MODE_IDLE) {
            for (u64 spin = 0; spin < 1000000; spin++) {
                heartbeat_if_due(&w);
                cpu_relax();
            }
            w.hb->passes++;
        } else {
            run_pass(&w, cfg.mode == MODE_WRITE);
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
    return cfg.mode == MODE_IDLE ? "idle" : cfg.mode == MODE_WRITE ? "write" : "read";
}

void guest_main(const struct hvm_start_info *si)
{
    put_str("ferry-guest: booted\n");
    parse_cmdline(si->cmdline_paddr ? (const char *)si->cmdline_paddr : "");
    plan_layout(ram_end_after_image(si));
    tsc_khz = calibrate_tsc_khz();
    if (!tsc_khz) {
        put_str("ferry-guest: PIT calibration failed, assuming a 2 GHz TSC\n");
        tsc_khz = 2000000;
    }
    put_str("ferry-guest: mode=");
    put_str(mode_name());
    put_str(" ws_pages=");
    put_u64(ws_pages);
    put_str(" order=");
    put_str(cfg.random ? "random" : "seq");
    put_str(cfg.verify ? " verify" : "");
    put_str(" vcpus=");
    put_u64(cfg.vcpus);
    put_str(" tsc_khz=");
    put_u64(tsc_khz);
    put_str("\n");
    __atomic_store_n(&go, 1, __ATOMIC_RELEASE);
    run_worker(0);
}

void secondary_main(u64 cpu)
{
    while (!__atomic_load_n(&go, __ATOMIC_ACQUIRE))
        cpu_relax();
    if (cpu < cfg.vcpus)
        run_worker(cpu);
}
