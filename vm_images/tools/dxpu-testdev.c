/*
 * dxpu-testdev - drive the dxpu "test device" (PCI 1b36:10f0) from inside
 * the test guest: registers, DMA copy/fill/checksum, DMA faults, INTx
 * interrupts and the large BAR2.
 *
 * Why: the device model is served by dxpu-vfio over vfio-user, and the
 * end-to-end tests need to see, from the guest, that MMIO reaches it, that
 * its DMA lands in the right guest pages (and nowhere else), that a DMA to
 * an unmapped address fails cleanly, and that its interrupts arrive. The
 * guest has a busybox userland only, so this is one static binary.
 *
 * Each subcommand checks the device's IDs, enables it (Memory Space + Bus
 * Master), prints one line of key=value pairs to stdout and exits 0 if all
 * its checks passed, 1 if one failed, 2 on a usage error. Details and
 * diagnostics go to stderr.
 *
 * BAR0 register map (32-bit little-endian): see the R_* constants below.
 */
#include "dxpu_guest.h"
#include <dirent.h>
#include <poll.h>

#define TD_VENDOR 0x1b36
#define TD_DEVICE 0x10f0
#define TD_ID 0xd0c50001u

enum {
	R_ID = 0x00, R_VERSION = 0x04, R_SCRATCH0 = 0x08, R_SCRATCH1 = 0x0c,
	R_COUNTER = 0x10, R_DOORBELL = 0x14, R_ISR = 0x18, R_IRQ_COUNT = 0x1c,
	R_DMA_SRC_LO = 0x20, R_DMA_SRC_HI = 0x24, R_DMA_DST_LO = 0x28,
	R_DMA_DST_HI = 0x2c, R_DMA_LEN = 0x30, R_DMA_CMD = 0x34,
	R_DMA_STATUS = 0x38, R_DMA_RESULT = 0x3c, R_DMA_COUNT = 0x40,
	R_END = 0x44
};
enum { OP_COPY = 1, OP_FILL = 2, OP_CSUM = 3 };
enum { ST_IDLE = 0, ST_BUSY = 1, ST_DONE = 2, ST_ERROR = 3 };

#define DMA_MAX (1UL << 20)         /* DMA_LEN limit, and the largest SIZE */
#define HUGE_2M (2UL << 20)
#define DMA_TIMEOUT_NS 10000000000ULL
#define DMA_SPIN_NS 20000000ULL /* poll flat out this long, then with 50 us naps */
#define IRQ_TIMEOUT_MS 2000
#define IRQ_GIVE_UP 3               /* consecutive poll timeouts before stopping */
#define FAULT_ADDR 0xdead00000000ULL /* far outside guest RAM */
#define FAULT_LEN 4096
#define FAULT_FILL 0x5a

static volatile uint32_t *regs; /* BAR0 */

static void dx_usage(void)
{
	fputs("usage: dxpu-testdev BDF info\n"
	      "       dxpu-testdev BDF scratch\n"
	      "       dxpu-testdev BDF dma-copy SIZE [--seed N] [--repeat R]\n"
	      "       dxpu-testdev BDF dma-fill SIZE BYTE [--seed N] [--repeat R]\n"
	      "       dxpu-testdev BDF dma-csum SIZE [--seed N] [--repeat R]\n"
	      "       dxpu-testdev BDF dma-fault\n"
	      "       dxpu-testdev BDF irq COUNT\n"
	      "       dxpu-testdev BDF bar2 OFFSET\n"
	      "Drives the dxpu test device (PCI 1b36:10f0); BDF like 0000:01:00.0.\n"
	      "SIZE 1-1048576 bytes; above the page size the DMA buffers are in a\n"
	      "2 MiB huge page (see /proc/sys/vm/nr_hugepages). BYTE 0-0xff. --seed\n"
	      "seeds the source data (default: the time). --repeat runs the command R\n"
	      "times (1-1000) on the same buffers, checking each run, and prints the\n"
	      "fastest as ns= with runs= median_ns= max_ns=. COUNT >= 1; irq needs the\n"
	      "device bound to uio_pci_generic. OFFSET 8-byte aligned inside BAR2.\n"
	      "Prints one key=value line. Exit 0 ok, 1 check failed, 2 usage error.\n"
	      "Numbers are decimal or 0x hex. Needs root.\n", stderr);
	exit(2);
}

static uint32_t rd(unsigned off)
{
	return regs[off / 4];
}

static void wr(unsigned off, uint32_t v)
{
	regs[off / 4] = v;
}

/* ---- device setup ---- */

/* Check the IDs (so nothing is written to a wrong device), enable, map BAR0. */
static void open_device(const char *bdf, int is_info)
{
	const uint16_t both = DX_CMD_MEMORY | DX_CMD_MASTER;
	struct dx_bar b;
	struct dx_cfg c;
	uint32_t vd, id;
	uint16_t cmd;

	dx_cfg_open(&c, bdf, O_RDONLY);
	vd = dx_cfg_read(&c, 0, 4);
	close(c.fd);
	if (vd != ((uint32_t)TD_DEVICE << 16 | TD_VENDOR))
		dx_fail("%s is %04x:%04x, not the dxpu test device %04x:%04x",
			bdf, vd & 0xffff, vd >> 16, TD_VENDOR, TD_DEVICE);
	cmd = dx_enable(bdf);
	if ((cmd & both) != both)
		dx_fail("%s: Memory Space/Bus Master bits did not stick (command=0x%04x)", bdf, cmd);
	dx_bar_map(&b, bdf, 0);
	if (b.size < R_END)
		dx_fail("%s: BAR0 is %zu bytes, want at least %d", b.path, b.size, R_END);
	regs = (volatile uint32_t *)b.base;
	id = rd(R_ID);
	if (id != TD_ID && !is_info)
		dx_fail("%s: ID register reads 0x%08x, want 0x%08x", b.path, id, TD_ID);
}

/* ---- test data ---- */

static dx_u64 splitmix64(dx_u64 *s)
{
	dx_u64 z = (*s += 0x9e3779b97f4a7c15ULL);

	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
	z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
	return z ^ (z >> 31);
}

static void fill_random(unsigned char *p, size_t n, dx_u64 seed)
{
	size_t i;

	for (i = 0; i < n; i += 8) {
		dx_u64 v = splitmix64(&seed);

		memcpy(p + i, &v, n - i < 8 ? n - i : 8);
	}
}

/* zlib-compatible CRC-32 (reflected, polynomial 0xEDB88320). */
static uint32_t crc32_buf(const unsigned char *p, size_t n)
{
	static uint32_t table[256];
	uint32_t crc = 0xffffffff;
	size_t i;

	if (!table[1]) {
		for (i = 0; i < 256; i++) {
			uint32_t c = i;
			int k;

			for (k = 0; k < 8; k++)
				c = c & 1 ? 0xedb88320 ^ (c >> 1) : c >> 1;
			table[i] = c;
		}
	}
	for (i = 0; i < n; i++)
		crc = table[(crc ^ p[i]) & 0xff] ^ (crc >> 8);
	return crc ^ 0xffffffff;
}

/* ---- DMA buffers ---- */

struct bufs {
	unsigned char *src, *dst;
	dx_u64 src_phys, dst_phys;
	size_t cap; /* usable bytes of each; bytes past SIZE are an overrun guard */
};

static void *map_locked(size_t len, int flags)
{
	void *p = mmap(NULL, len, PROT_READ | PROT_WRITE,
		       MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE | flags, -1, 0);

	if (p == MAP_FAILED)
		return p;
	if (mlock(p, len))
		dx_fail("mlock %zu bytes: %s (run as root or raise ulimit -l)", len, dx_err());
	return p;
}

/* Physical address of p, after checking [p, p + len) is physically contiguous. */
static dx_u64 contig_phys(const unsigned char *p, size_t len)
{
	size_t ps = sysconf(_SC_PAGESIZE), i;
	dx_u64 phys = dx_virt_to_phys(p);

	for (i = ps - (uintptr_t)p % ps; i < len; i += ps)
		if (dx_virt_to_phys(p + i) != phys + i)
			dx_fail("buffer at %p is not physically contiguous at +0x%zx "
				"(0x%llx, want 0x%llx)", (void *)p, i,
				dx_virt_to_phys(p + i), phys + i);
	return phys;
}

/*
 * Source and destination for SIZE bytes, each physically contiguous: one
 * page each if SIZE fits in a page, else the two halves of one 2 MiB huge
 * page. The caller fills them, then calls bufs_phys (pages must be present).
 */
static void bufs_alloc(struct bufs *b, dx_u64 size)
{
	size_t ps = sysconf(_SC_PAGESIZE);

	if (size <= ps) {
		b->cap = ps;
		b->src = map_locked(ps, 0);
		b->dst = b->src == MAP_FAILED ? MAP_FAILED : map_locked(ps, 0);
		if (b->dst == MAP_FAILED)
			dx_fail("mmap one page: %s", dx_err());
		return;
	}
	b->cap = DMA_MAX;
	b->src = map_locked(HUGE_2M, MAP_HUGETLB | (21 << MAP_HUGE_SHIFT));
	if (b->src == MAP_FAILED) {
		int e = errno;
		dx_u64 n = 0;
		FILE *f = fopen("/proc/sys/vm/nr_hugepages", "r");

		if (!f || fscanf(f, "%llu", &n) != 1)
			n = 0;
		if (f)
			fclose(f);
		dx_fail("need hugepages: echo %llu > /proc/sys/vm/nr_hugepages "
			"(SIZE %llu needs one free 2 MiB huge page; mmap: %s)", n + 1, size, strerror(e));
	}
	b->dst = b->src + DMA_MAX;
}

static void bufs_phys(struct bufs *b, size_t size)
{
	b->src_phys = contig_phys(b->src, size);
	b->dst_phys = contig_phys(b->dst, size);
}

/* Offset of the first byte of dst[0, cap) that is not want[i] (or byte if want
 * is NULL) below size, or not guard from size on; cap if all are right. */
static size_t first_bad(const unsigned char *dst, const unsigned char *want, int byte,
			size_t size, size_t cap, int guard, int *expect)
{
	size_t i;

	for (i = 0; i < cap; i++) {
		int e = i >= size ? guard : want ? want[i] : byte;

		if (dst[i] != e) {
			*expect = e;
			return i;
		}
	}
	return cap;
}

/* ---- DMA engine ---- */

static void dma_program(dx_u64 src, dx_u64 dst, uint32_t len)
{
	wr(R_DMA_SRC_LO, (uint32_t)src);
	wr(R_DMA_SRC_HI, src >> 32);
	wr(R_DMA_DST_LO, (uint32_t)dst);
	wr(R_DMA_DST_HI, dst >> 32);
	wr(R_DMA_LEN, len);
}

/*
 * Write DMA_CMD and poll DMA_STATUS until done (2) or error (3), for at most
 * 10 s. Returns the last status read (not 2/3 = timed out); *ns is the time
 * from the command write to the status read that saw completion. Polls back
 * to back for the first 20 ms (DMA_SPIN_NS), then every ~50 µs: each poll is a
 * device read, so a long wait costs a remote device one read per nap, not a
 * busy loop of them competing with the DMA itself.
 */
static uint32_t dma_run(uint32_t cmd, dx_u64 *ns)
{
	dx_u64 t0, now;
	uint32_t st = rd(R_DMA_STATUS);

	if (st == ST_BUSY)
		dx_fail("DMA engine busy before the command (DMA_STATUS=1): "
			"an earlier command is still running");
	__sync_synchronize(); /* buffer contents before the command */
	t0 = dx_now_ns();
	wr(R_DMA_CMD, cmd);
	do {
		st = rd(R_DMA_STATUS);
		now = dx_now_ns();
		if (st == ST_DONE || st == ST_ERROR)
			break;
		if (st == 0xffffffff)
			dx_fail("DMA_STATUS reads 0xffffffff: device gone?");
		/* Each status read is a bus round trip (the vCPU waits in QEMU, it
		 * does not spin): a sleep between them would only add its own
		 * length, and a TCG guest's timer slack, to the measured time. */
		if (now - t0 > DMA_SPIN_NS)
			usleep(50);
	} while (now - t0 < DMA_TIMEOUT_NS);
	__sync_synchronize(); /* device writes before our reads */
	*ns = now - t0;
	if (st != ST_DONE && st != ST_ERROR)
		fprintf(stderr, "%s: DMA command 0x%x did not finish within 10 s "
			"(DMA_STATUS=%u)\n", program_invocation_short_name, cmd, st);
	return st;
}

/*
 * The outcome of the DMA command just run on b: 0 = right. Printed as
 * key=value pairs when loud; quiet (a --repeat's earlier runs) it only checks.
 */
static int dma_check(int op, struct bufs *b, dx_u64 size, int byte, int pre,
		     uint32_t crc, uint32_t st, int loud)
{
	int expect = 0, fail = 1;
	uint32_t dev_crc;
	size_t bad;

	if (loud)
		printf(" status=%u", st);
	if (st == ST_ERROR) {
		if (loud)
			printf(" result=%u", rd(R_DMA_RESULT));
	} else if (st != ST_DONE) {
		if (loud)
			printf(" timeout=yes");
	} else if (op == OP_CSUM) {
		dev_crc = rd(R_DMA_RESULT);
		fail = dev_crc != crc;
		if (loud)
			printf(" device_crc=0x%08x tool_crc=0x%08x match=%s", dev_crc, crc, fail ? "no" : "yes");
	} else {
		bad = first_bad(b->dst, op == OP_COPY ? b->src : NULL, byte, size, b->cap, pre, &expect);
		fail = bad < b->cap;
		if (loud && fail)
			printf(" match=no first_bad_offset=0x%zx got=0x%02x want=0x%02x",
			       bad, b->dst[bad], expect);
		else if (loud)
			printf(" match=yes");
	}
	return fail;
}

static int cmp_u64(const void *a, const void *b)
{
	dx_u64 x = *(const dx_u64 *)a, y = *(const dx_u64 *)b;

	return x < y ? -1 : x > y;
}

/*
 * Run the command `repeat` times on the same buffers. The destination is reset
 * before each run, so each run is checked on its own, not on what an earlier
 * one left there; the first run that goes wrong ends the repeat and is the one
 * reported (run=N). Otherwise the last run is reported, with the fastest time.
 */
static int cmd_dma(int op, dx_u64 size, int byte, dx_u64 seed, unsigned repeat)
{
	static const char *const names[] = { [OP_COPY] = "copy", [OP_FILL] = "fill", [OP_CSUM] = "csum" };
	int pre = op == OP_FILL ? byte ^ 0xff : 0, fail;
	uint32_t st, crc = 0;
	struct bufs b;
	dx_u64 ns[1000];
	unsigned r;

	bufs_alloc(&b, size);
	fill_random(b.src, b.cap, seed);
	if (op == OP_CSUM)
		crc = crc32_buf(b.src, size);
	bufs_phys(&b, size);
	dma_program(b.src_phys, b.dst_phys, size);
	for (r = 0;; r++) {
		memset(b.dst, pre, b.cap); /* past SIZE this is the overrun guard */
		st = dma_run(op | (op == OP_FILL ? (uint32_t)byte << 8 : 0), &ns[r]);
		if (r + 1 == repeat || dma_check(op, &b, size, byte, pre, crc, st, 0))
			break;
	}
	printf("op=%s bytes=%llu", names[op], size);
	if (op == OP_FILL)
		printf(" byte=0x%02x", byte);
	if (r + 1 < repeat)
		printf(" run=%u", r + 1);
	fail = dma_check(op, &b, size, byte, pre, crc, st, 1);
	if (repeat > 1 && !fail) {
		qsort(ns, repeat, sizeof(ns[0]), cmp_u64);
		printf(" ns=%llu runs=%u median_ns=%llu max_ns=%llu", ns[0], repeat, ns[repeat / 2], ns[repeat - 1]);
	} else {
		printf(" ns=%llu", ns[r]);
	}
	if (op != OP_FILL)
		printf(" seed=%llu", seed);
	putchar('\n');
	return fail;
}

static int cmd_fault(void)
{
	unsigned char *dst = map_locked(sysconf(_SC_PAGESIZE), 0);
	int expect, untouched;
	uint32_t st, result;
	dx_u64 dst_phys, ns;

	if (dst == MAP_FAILED)
		dx_fail("mmap one page: %s", dx_err());
	memset(dst, FAULT_FILL, FAULT_LEN);
	dst_phys = contig_phys(dst, FAULT_LEN);
	dma_program(FAULT_ADDR, dst_phys, FAULT_LEN);
	st = dma_run(OP_COPY, &ns);
	result = rd(R_DMA_RESULT);
	untouched = first_bad(dst, NULL, FAULT_FILL, FAULT_LEN, FAULT_LEN, 0, &expect) == FAULT_LEN;
	printf("status=%u result=%u dst_untouched=%s%s\n", st, result, untouched ? "yes" : "no",
	       st == ST_DONE || st == ST_ERROR ? "" : " timeout=yes");
	return !(st == ST_ERROR && result == 3 && untouched);
}

/* ---- registers ---- */

static int cmd_info(const char *bdf)
{
	dx_u64 size[3];
	char path[96], line[160];
	uint32_t id = rd(R_ID), ver = rd(R_VERSION);
	int i, fd = dx_sysfs_open(path, sizeof(path), bdf, "resource", O_RDONLY);
	FILE *f = fdopen(fd, "r");

	if (!f)
		dx_fail("fdopen %s: %s", path, dx_err());
	/* one "0xSTART 0xEND 0xFLAGS" line per resource; all 0 if unused */
	for (i = 0; i < 3; i++) {
		dx_u64 start, end, flags;

		if (!fgets(line, sizeof(line), f) ||
		    sscanf(line, "%llx %llx %llx", &start, &end, &flags) != 3)
			dx_fail("%s: cannot parse line %d", path, i + 1);
		size[i] = start || end ? end - start + 1 : 0;
	}
	fclose(f);
	printf("id=0x%08x version=0x%08x bar0_size=%llu bar2_size=%llu\n", id, ver, size[0], size[2]);
	if (id != TD_ID)
		dx_fail("ID register reads 0x%08x, want 0x%08x", id, TD_ID);
	return 0;
}

static int cmd_scratch(void)
{
	static const uint32_t pat[] = { 0, 0xffffffff, 0xa5a5a5a5, 0x12345678 };
	const char *reg = NULL;
	uint32_t wrote = 0, got = 0, c0, c1;
	unsigned i;

	/* SCRATCH1 gets the complement, so the two cannot alias unnoticed */
	for (i = 0; i < sizeof(pat) / sizeof(pat[0]) && !reg; i++) {
		wr(R_SCRATCH0, pat[i]);
		wr(R_SCRATCH1, ~pat[i]);
		if ((got = rd(R_SCRATCH0)) != (wrote = pat[i]))
			reg = "SCRATCH0";
		else if ((got = rd(R_SCRATCH1)) != (wrote = ~pat[i]))
			reg = "SCRATCH1";
	}
	c0 = rd(R_COUNTER);
	c1 = rd(R_COUNTER);
	if (reg)
		printf("scratch=fail reg=%s wrote=0x%08x read=0x%08x", reg, wrote, got);
	else
		printf("scratch=ok");
	printf(" counter_step=%u\n", c1 - c0);
	return reg || c1 - c0 != 1;
}

static int cmd_bar2(const char *bdf, dx_u64 off)
{
	dx_u64 size = dx_bar_size(bdf, 2), win, old, val, got, t;
	volatile uint64_t *p;
	struct dx_bar b;

	if (off % 8 || size < 8 || off > size - 8)
		dx_exit(2, "OFFSET 0x%llx is not 8-byte aligned inside BAR2 (size 0x%llx)", off, size);
	win = off & ~(dx_u64)(HUGE_2M - 1);
	dx_bar_map_window(&b, bdf, 2, win, size - win < HUGE_2M ? size - win : HUGE_2M);
	p = (volatile uint64_t *)(b.base + (off - win));
	old = *p;
	t = off ^ dx_now_ns();
	val = splitmix64(&t); /* new on every run, so stale data cannot pass */
	if (val == old)
		val = ~val;
	*p = val;
	got = *p;
	if (got != val) {
		printf("bar2=fail offset=0x%llx wrote=0x%016llx read=0x%016llx\n", off, val, got);
		return 1;
	}
	printf("bar2=ok offset=0x%llx value=0x%016llx\n", off, val);
	return 0;
}

/* ---- interrupts (INTx through uio_pci_generic) ---- */

/* Find the device's uio node; returns its fd, the name (uioN) in name. */
static int uio_open(const char *bdf, char *name, size_t len)
{
	char path[128];
	struct dirent *e;
	DIR *d;
	int fd;

	snprintf(path, sizeof(path), DX_SYSFS_PCI "/%s/uio", bdf);
	d = opendir(path);
	if (!d)
		dx_fail("open %s: %s (bind %s to uio_pci_generic first)", path, dx_err(), bdf);
	while ((e = readdir(d)) && !(!strncmp(e->d_name, "uio", 3) && e->d_name[3] &&
				     strlen(e->d_name) < 16 && !e->d_name[3 + strspn(e->d_name + 3, "0123456789")]))
		;
	if (!e)
		dx_fail("%s: no uioN entry", path);
	snprintf(name, len, "%.15s", e->d_name);
	closedir(d);
	snprintf(path, sizeof(path), "/dev/%s", name);
	fd = open(path, O_RDWR | O_CLOEXEC);
	if (fd < 0)
		dx_fail("open %s: %s%s", path, dx_err(),
			errno == ENOENT ? " (is devtmpfs mounted on /dev?)" : "");
	return fd;
}

/* Current event count from sysfs (the starting value for uio_count). */
static int32_t uio_sysfs_count(const char *bdf, const char *name)
{
	char path[128];
	long long n = 0;
	FILE *f;

	snprintf(path, sizeof(path), DX_SYSFS_PCI "/%s/uio/%s/event", bdf, name);
	f = fopen(path, "r");
	if (f) {
		if (fscanf(f, "%lld", &n) != 1)
			n = 0;
		fclose(f);
	}
	return n;
}

/* poll() for an event for up to ms; 1 = event, 0 = timeout. */
static int uio_wait(int fd, const char *dev, int ms)
{
	dx_u64 end = dx_now_ns() + ms * 1000000ULL, now;
	struct pollfd pfd = { .fd = fd, .events = POLLIN };

	while ((now = dx_now_ns()) < end) {
		int r = poll(&pfd, 1, (end - now + 999999) / 1000000);

		if (r > 0 && !(pfd.revents & POLLIN))
			dx_fail("poll %s: revents 0x%x (device unbound?)", dev, pfd.revents);
		if (r > 0)
			return 1;
		if (r < 0 && errno != EINTR)
			dx_fail("poll %s: %s", dev, dx_err());
	}
	return 0;
}

static int cmd_irq(const char *bdf, dx_u64 count)
{
	char name[64], dev[80];
	int fd = uio_open(bdf, name, sizeof(name)), misses = 0;
	int32_t one = 1, n = uio_sysfs_count(bdf, name);
	dx_u64 i, received = 0;
	struct dx_cfg c;
	uint32_t isr;

	snprintf(dev, sizeof(dev), "/dev/%s", name);
	dx_cfg_open(&c, bdf, O_RDWR); /* diagnostics, and INTx re-enable below */
	isr = rd(R_ISR);
	if (isr)
		wr(R_ISR, isr); /* start with the line low */
	for (i = 1; i <= count; i++) {
		/* uio re-enables INTx on write; where the driver has no irqcontrol
		 * (ENOSYS) do what it would do: clear Command.INTx-Disable ourselves. */
		if (write(fd, &one, sizeof(one)) != sizeof(one)) {
			if (errno != ENOSYS)
				dx_fail("write %s (re-enable INTx): %s", dev, dx_err());
			dx_cfg_write(&c, 0x04, 2, dx_cfg_read(&c, 0x04, 2) & ~0x400u);
		}
		wr(R_DOORBELL, 0);
		if (uio_wait(fd, dev, IRQ_TIMEOUT_MS)) {
			ssize_t r = read(fd, &n, sizeof(n));

			if (r != sizeof(n))
				dx_fail("read %s: %s", dev, r < 0 ? dx_err() : "short read");
			received++;
			misses = 0;
		} else {
			fprintf(stderr, "%s: interrupt %llu: no event within %d ms (ISR=0x%x "
				"PCI command=0x%04x status=0x%04x)\n", program_invocation_short_name,
				i, IRQ_TIMEOUT_MS, rd(R_ISR), dx_cfg_read(&c, 0x04, 2),
				dx_cfg_read(&c, 0x06, 2));
			misses++;
		}
		wr(R_ISR, 1);
		if (misses == IRQ_GIVE_UP) {
			fprintf(stderr, "%s: giving up after %d timeouts in a row\n",
				program_invocation_short_name, IRQ_GIVE_UP);
			break;
		}
	}
	printf("irqs=%llu received=%llu uio_count=%d device_irq_count=%u\n",
	       count, received, n, rd(R_IRQ_COUNT));
	return received != count;
}

/* ---- main ---- */

static dx_u64 size_arg(const char *s)
{
	dx_u64 v = dx_arg_u64(s, "SIZE");

	if (!v || v > DMA_MAX)
		dx_exit(2, "SIZE %llu is not 1-%lu", v, DMA_MAX);
	return v;
}

int main(int argc, char **argv)
{
	static const struct { const char *name; int nargs, seed; } cmds[] = {
		{ "info", 0, 0 }, { "scratch", 0, 0 }, { "dma-copy", 1, 1 },
		{ "dma-fill", 2, 1 }, { "dma-csum", 1, 1 }, { "dma-fault", 0, 0 },
		{ "irq", 1, 0 }, { "bar2", 1, 0 },
	};
	const char *bdf, *cmd, *pos[2] = { NULL, NULL };
	dx_u64 seed = time(NULL), a1 = 0, a2 = 0, repeat = 1;
	int a, npos = 0, has_seed = 0;
	unsigned c;

	if (argc < 3)
		dx_usage();
	bdf = dx_bdf(argv[1]);
	cmd = argv[2];
	for (c = 0; c < sizeof(cmds) / sizeof(cmds[0]) && strcmp(cmd, cmds[c].name); c++)
		;
	if (c == sizeof(cmds) / sizeof(cmds[0]))
		dx_usage();
	for (a = 3; a < argc; a++) {
		if (!strcmp(argv[a], "--seed") && a + 1 < argc && cmds[c].seed && !has_seed) {
			seed = dx_arg_u64(argv[++a], "seed");
			has_seed = 1;
		} else if (!strcmp(argv[a], "--repeat") && a + 1 < argc && cmds[c].seed && repeat == 1) {
			repeat = dx_arg_u64(argv[++a], "repeat");
			if (repeat < 1 || repeat > 1000)
				dx_exit(2, "--repeat %llu is not 1-1000", repeat);
		} else if (argv[a][0] != '-' && npos < cmds[c].nargs) {
			pos[npos++] = argv[a];
		} else {
			dx_usage();
		}
	}
	if (npos != cmds[c].nargs)
		dx_usage();

	/* parse everything before touching the device */
	if (!strncmp(cmd, "dma-", 4) && strcmp(cmd, "dma-fault"))
		a1 = size_arg(pos[0]);
	if (!strcmp(cmd, "dma-fill") && (a2 = dx_arg_u64(pos[1], "BYTE")) > 0xff)
		dx_exit(2, "BYTE 0x%llx is not 0-0xff", a2);
	if (!strcmp(cmd, "irq") && !(a1 = dx_arg_u64(pos[0], "COUNT")))
		dx_exit(2, "COUNT must be >= 1");
	if (!strcmp(cmd, "bar2"))
		a1 = dx_arg_u64(pos[0], "OFFSET");

	open_device(bdf, !strcmp(cmd, "info"));
	if (!strcmp(cmd, "info"))
		return cmd_info(bdf);
	if (!strcmp(cmd, "scratch"))
		return cmd_scratch();
	if (!strcmp(cmd, "dma-copy"))
		return cmd_dma(OP_COPY, a1, 0, seed, (unsigned)repeat);
	if (!strcmp(cmd, "dma-fill"))
		return cmd_dma(OP_FILL, a1, a2, seed, (unsigned)repeat);
	if (!strcmp(cmd, "dma-csum"))
		return cmd_dma(OP_CSUM, a1, 0, seed, (unsigned)repeat);
	if (!strcmp(cmd, "dma-fault"))
		return cmd_fault();
	if (!strcmp(cmd, "irq"))
		return cmd_irq(bdf, a1);
	return cmd_bar2(bdf, a1);
}
