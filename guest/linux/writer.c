/*
 * /init of ferry's Linux guest: stamps and verifies its memory in user mode, forever, with no
 * system call (on the development host a user-mode `syscall` never reaches the guest kernel,
 * so the program must not make one). It reports through a header page in its own memory,
 * which the host finds by the header's magic (tests read it through ferry's memfd).
 *
 * Parameters come from the kernel command line through init's environment:
 *   ferry_writer_mib=N   pages stamped (MiB, default 16, at most WRITER_MAX_MIB)
 * It also reads back, one page every 2^FILE_PACE_SHIFT cycles of the TSC (~128 ms at 2 GHz),
 * a 16 MiB table built into its own image: each page comes from the root filesystem on
 * virtio-blk the first time it is touched, so the disk is in use for the first ~9 minutes
 * (then the table is read again from the page cache), and each page is checked.
 * The area is a 1 GiB .bss, so the kernel must not refuse it for its size:
 * sysctl.vm.overcommit_memory=1 on the command line (guest/linux/cmdline).
 */
typedef unsigned long u64;

#define PAGE_SIZE 4096UL
#define WRITER_MAX_MIB 1024UL
#define PAGE_WORDS (PAGE_SIZE / sizeof(u64))

/* The header's layout is read by tests/common/linux.rs: keep the two in step. */
struct header {
	u64 magic[2];   /* HEADER_MAGIC ^ 0, HEADER_MAGIC ^ 1: computed, never in the image */
	u64 pages;      /* pages in the stamped area */
	u64 passes;     /* passes completed */
	u64 errors;     /* pages found with a stamp other than the one last written */
	u64 first_bad;  /* 1 + index of the first bad page (0: none) */
	u64 bad_word;   /* what the first bad page held in its first word */
	u64 progress;   /* pages stamped in all, rising while the writer runs */
	u64 file_pages; /* pages of the file table read back and found right */
	u64 file_errors;/* pages of the file table found wrong */
};

#define HEADER_MAGIC 0x6672726c6e786864UL /* "frrlnxhd" */
#define STAMP_TAG 0x73746d70UL
/* The file table (scripts/linux-guest.sh writes it): page k holds FILE_TAG ^ k, then ~k last. */
#define FILE_PAGES 4096UL
#define FILE_TAG (0x66696c65UL << 32)
#define FILE_PACE_SHIFT 28

__asm__(".section .rodata.file, \"a\"\n"
	".balign 4096\n"
	"file_table:\n"
	".incbin \"file.bin\"\n"
	".previous\n");
extern const u64 file_table[FILE_PAGES][PAGE_SIZE / 8];

/* Volatile: every update lands in memory at once, where the host reads it. */
static volatile struct header header __attribute__((aligned(4096)));
static char area[WRITER_MAX_MIB << 20] __attribute__((aligned(4096)));
/* The magic's complement, read through a volatile: the magic itself is never in the image, so
 * only a running writer's header matches. */
static volatile u64 magic_key = ~HEADER_MAGIC;

static u64 parse_mib(char **envp)
{
	static const char key[] = "ferry_writer_mib=";
	for (; *envp; envp++) {
		const char *s = *envp;
		unsigned i = 0;
		while (key[i] && s[i] == key[i])
			i++;
		if (key[i])
			continue;
		u64 v = 0;
		for (s += i; *s >= '0' && *s <= '9'; s++)
			v = v * 10 + (u64)(*s - '0');
		if (v >= 1 && v <= WRITER_MAX_MIB)
			return v;
	}
	return 16;
}

static u64 tag(u64 page)
{
	return (STAMP_TAG << 32) ^ page;
}

static void stamp_pass(u64 pages, u64 pass)
{
	for (u64 i = 0; i < pages; i++) {
		volatile u64 *w = (volatile u64 *)(area + i * PAGE_SIZE);
		if (pass > 1 && (w[0] != tag(i) || w[1] != pass - 1 || w[PAGE_WORDS - 1] != pass - 1)) {
			if (header.errors++ == 0) {
				header.first_bad = i + 1;
				header.bad_word = w[0];
			}
		}
		w[0] = tag(i);
		w[1] = pass;
		w[PAGE_WORDS - 1] = pass;
		header.progress++;
	}
	header.passes = pass;
}

static u64 rdtsc(void)
{
	unsigned lo, hi;
	__asm__ volatile("rdtsc" : "=a"(lo), "=d"(hi));
	return ((u64)hi << 32) | lo;
}

/* Reads back the file table's pages that are due by the TSC since `start`. */
static void read_file_pages(u64 start)
{
	u64 due = (rdtsc() - start) >> FILE_PACE_SHIFT;
	while (header.file_pages + header.file_errors < due) {
		u64 k = (header.file_pages + header.file_errors) % FILE_PAGES;
		const volatile u64 *page = file_table[k];
		if (page[0] == (FILE_TAG ^ k) && page[PAGE_WORDS - 1] == ~k)
			header.file_pages++;
		else
			header.file_errors++;
	}
}

__attribute__((noreturn, used)) void writer_main(u64 *stack)
{
	u64 argc = stack[0];
	char **envp = (char **)(stack + 1 + argc + 1);
	header.pages = parse_mib(envp) << 8;
	header.magic[0] = ~magic_key;
	header.magic[1] = ~magic_key ^ 1;
	u64 start = rdtsc();
	for (u64 pass = 1;; pass++) {
		stamp_pass(header.pages, pass);
		read_file_pages(start);
	}
}

__asm__(".globl _start\n"
	"_start:\n"
	"  mov %rsp, %rdi\n"
	"  and $-16, %rsp\n"
	"  call writer_main\n");
