/*
 * dxpu-mmio - read, write and time accesses to a PCI device's BARs and
 * config space from inside the test guest.
 *
 * Why: dxpu-vfio tests need to check that guest MMIO and config accesses of
 * each width reach the virtual device, to enable decode/bus mastering
 * without setpci, and to measure BAR access latency and write throughput
 * as seen by the guest. The guest's busybox has nothing that does this.
 */
#include "dxpu_guest.h"

static void dx_usage(void)
{
	fputs("usage: dxpu-mmio BDF BAR read OFFSET [WIDTH]\n"
	      "       dxpu-mmio BDF BAR write OFFSET VALUE [WIDTH]\n"
	      "       dxpu-mmio BDF BAR time-read OFFSET COUNT\n"
	      "       dxpu-mmio BDF BAR time-write OFFSET COUNT [VALUE]\n"
	      "       dxpu-mmio BDF enable\n"
	      "       dxpu-mmio BDF cfg-read OFFSET [WIDTH]\n"
	      "       dxpu-mmio BDF cfg-write OFFSET VALUE [WIDTH]\n"
	      "BDF like 0000:01:00.0, BAR 0-5, WIDTH in bytes: 1|2|4|8 for BARs,\n"
	      "1|2|4 for config space (default 4). Timed accesses are 32-bit.\n"
	      "Numbers are decimal or 0x hex. Needs root.\n", stderr);
	exit(2);
}

static unsigned width_arg(const char *s, unsigned max)
{
	dx_u64 w = dx_arg_u64(s, "WIDTH");

	if (w > max || (w != 1 && w != 2 && w != 4 && w != 8)) {
		fprintf(stderr, "dxpu-mmio: WIDTH must be 1, 2, 4%s\n",
			max == 8 ? " or 8" : " (config space)");
		dx_usage();
	}
	return w;
}

/* Reject bad VALUEs and misaligned offsets before touching the device. */
static void check_args(dx_u64 off, unsigned width, dx_u64 v)
{
	if (off % width)
		dx_exit(2, "OFFSET 0x%llx is not %u-byte aligned", off, width);
	if (width < 8 && v >> (8 * width))
		dx_exit(2, "VALUE 0x%llx does not fit in %u byte(s)", v, width);
}

static void check_range(dx_u64 off, unsigned width, dx_u64 size, const char *path)
{
	if (off > size || width > size - off)
		dx_exit(2, "OFFSET 0x%llx + %u bytes is beyond %s (size 0x%llx)", off, width, path, size);
}

static dx_u64 mmio_read(volatile void *p, unsigned width)
{
	switch (width) {
	case 1: return *(volatile uint8_t *)p;
	case 2: return *(volatile uint16_t *)p;
	case 4: return *(volatile uint32_t *)p;
	default: return *(volatile uint64_t *)p;
	}
}

static void mmio_write(volatile void *p, unsigned width, dx_u64 v)
{
	switch (width) {
	case 1: *(volatile uint8_t *)p = v; break;
	case 2: *(volatile uint16_t *)p = v; break;
	case 4: *(volatile uint32_t *)p = v; break;
	default: *(volatile uint64_t *)p = v; break;
	}
}

static int cmp_u64(const void *a, const void *b)
{
	dx_u64 x = *(const dx_u64 *)a, y = *(const dx_u64 *)b;

	return x < y ? -1 : x > y;
}

/* COUNT individually timed 32-bit reads; prints latency statistics. */
static void time_read(volatile uint32_t *p, dx_u64 count)
{
	dx_u64 *ns = calloc(count, sizeof(*ns)), total = 0, i;

	if (!ns)
		dx_fail("cannot allocate %llu samples", count);
	for (i = 0; i < count; i++) {
		dx_u64 t0 = dx_now_ns();
		(void)*p;
		ns[i] = dx_now_ns() - t0;
		total += ns[i];
	}
	qsort(ns, count, sizeof(*ns), cmp_u64);
	/* nearest-rank percentiles */
	printf("count=%llu total_ns=%llu mean_ns=%llu min_ns=%llu median_ns=%llu "
	       "p99_ns=%llu max_ns=%llu\n", count, total, total / count, ns[0],
	       ns[(count + 1) / 2 - 1], ns[(count * 99 + 99) / 100 - 1], ns[count - 1]);
	free(ns);
}

/* COUNT back-to-back 32-bit writes timed as a whole. */
static void time_write(volatile uint32_t *p, dx_u64 count, uint32_t v)
{
	dx_u64 t0 = dx_now_ns(), i, total;

	for (i = 0; i < count; i++)
		*p = v;
	total = dx_now_ns() - t0;
	printf("count=%llu total_ns=%llu mean_ns=%llu writes_per_s=%.0f\n", count,
	       total, total / count, total ? count * 1e9 / total : 0.0);
}

static int config_cmd(const char *bdf, int argc, char **argv)
{
	int is_write = !strcmp(argv[0], "cfg-write");
	int nargs = 1 + is_write; /* OFFSET [VALUE] */
	dx_u64 off, v = 0;
	unsigned width = 4;
	struct dx_cfg c;

	if (argc - 1 != nargs && argc - 1 != nargs + 1)
		dx_usage();
	off = dx_arg_u64(argv[1], "OFFSET");
	if (is_write)
		v = dx_arg_u64(argv[2], "VALUE");
	if (argc - 1 > nargs)
		width = width_arg(argv[argc - 1], 4);
	check_args(off, width, v);
	dx_cfg_open(&c, bdf, is_write ? O_RDWR : O_RDONLY);
	check_range(off, width, c.size, c.path);
	if (is_write)
		dx_cfg_write(&c, off, width, v);
	else
		printf("0x%0*x\n", (int)width * 2, dx_cfg_read(&c, off, width));
	return 0;
}

int main(int argc, char **argv)
{
	enum { READ, WRITE, TIME_READ, TIME_WRITE } op;
	dx_u64 bar, off, v = 0, count = 0;
	unsigned width = 4;
	struct dx_bar b;
	const char *bdf;
	int n;

	if (argc < 3)
		dx_usage();
	bdf = dx_bdf(argv[1]);
	if (!strcmp(argv[2], "enable")) {
		if (argc != 3)
			dx_usage();
		uint16_t cmd = dx_enable(bdf);
		printf("command=0x%04x\n", cmd);
		if ((cmd & (DX_CMD_MEMORY | DX_CMD_MASTER)) != (DX_CMD_MEMORY | DX_CMD_MASTER))
			dx_fail("Memory Space/Bus Master bits did not stick");
		return 0;
	}
	if (!strcmp(argv[2], "cfg-read") || !strcmp(argv[2], "cfg-write"))
		return config_cmd(bdf, argc - 2, argv + 2);

	if (argc < 5)
		dx_usage();
	bar = dx_arg_u64(argv[2], "BAR");
	if (bar > 5)
		dx_exit(2, "BAR must be 0-5");
	n = argc - 4; /* arguments after the operation */
	off = dx_arg_u64(argv[4], "OFFSET");
	if (!strcmp(argv[3], "read") && n <= 2) {
		op = READ;
		if (n == 2)
			width = width_arg(argv[5], 8);
	} else if (!strcmp(argv[3], "write") && (n == 2 || n == 3)) {
		op = WRITE;
		v = dx_arg_u64(argv[5], "VALUE");
		if (n == 3)
			width = width_arg(argv[6], 8);
	} else if (!strcmp(argv[3], "time-read") && n == 2) {
		op = TIME_READ;
	} else if (!strcmp(argv[3], "time-write") && (n == 2 || n == 3)) {
		op = TIME_WRITE;
		if (n == 3)
			v = dx_arg_u64(argv[6], "VALUE");
	} else {
		dx_usage();
	}
	if (op == TIME_READ || op == TIME_WRITE) {
		count = dx_arg_u64(argv[5], "COUNT");
		if (!count)
			dx_exit(2, "COUNT must be > 0");
	}
	check_args(off, width, v);

	dx_bar_map(&b, bdf, bar);
	check_range(off, width, b.size, b.path);
	switch (op) {
	case READ:
		printf("0x%0*llx\n", (int)width * 2, mmio_read(b.base + off, width));
		break;
	case WRITE:
		mmio_write(b.base + off, width, v);
		break;
	case TIME_READ:
		time_read((volatile uint32_t *)(b.base + off), count);
		break;
	case TIME_WRITE:
		time_write((volatile uint32_t *)(b.base + off), count, v);
		break;
	}
	return 0;
}
