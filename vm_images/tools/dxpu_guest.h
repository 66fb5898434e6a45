/*
 * dxpu_guest.h - helpers shared by the dxpu guest-side test tools.
 *
 * Why: the test guest has a busybox userland only (no lspci/setpci), so the
 * tools reach the virtual PCI device served by dxpu-vfio directly through
 * sysfs (config space, BAR mmap, enable) and find DMA addresses through
 * /proc/self/pagemap. Everything is static inline so each tool stays a
 * single .c file. Include this header before any system header.
 *
 * Conventions: exit 2 = usage error, exit 1 = runtime failure. Messages go
 * to stderr and name the file involved plus strerror(errno). Each tool must
 * define dx_usage(), which prints its usage text and exits 2.
 */
#ifndef DXPU_GUEST_H
#define DXPU_GUEST_H

#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#ifndef DX_SYSFS_PCI /* overridable so the tools can be tested on a fake tree */
#define DX_SYSFS_PCI "/sys/bus/pci/devices"
#endif
#define DX_PCI_COMMAND 0x04
#define DX_CMD_MEMORY 0x0002 /* Memory Space enable */
#define DX_CMD_MASTER 0x0004 /* Bus Master enable */

typedef unsigned long long dx_u64;

static void dx_usage(void) __attribute__((noreturn));

/* Print "prog: message" to stderr and exit with the given code. */
static inline void __attribute__((noreturn, format(printf, 2, 3)))
dx_exit(int code, const char *fmt, ...)
{
	va_list ap;

	fprintf(stderr, "%s: ", program_invocation_short_name);
	va_start(ap, fmt);
	vfprintf(stderr, fmt, ap);
	va_end(ap);
	fputc('\n', stderr);
	exit(code);
}
#define dx_fail(...) dx_exit(1, __VA_ARGS__)
#define dx_err() strerror(errno)

/* Decimal or 0x-prefixed hex; no sign, spaces, octal or trailing junk. */
static inline int dx_parse_u64(const char *s, dx_u64 *out)
{
	const char *digits = "0123456789";
	int base = 10;
	char *end;

	if (s[0] == '0' && (s[1] == 'x' || s[1] == 'X')) {
		digits = "0123456789abcdefABCDEF";
		base = 16;
		s += 2;
	}
	if (!*s || s[strspn(s, digits)])
		return -1;
	errno = 0;
	*out = strtoull(s, &end, base);
	return errno || *end ? -1 : 0;
}

/* Parse a command-line number or complain and show usage (exit 2). */
static inline dx_u64 dx_arg_u64(const char *s, const char *what)
{
	dx_u64 v;

	if (dx_parse_u64(s, &v)) {
		fprintf(stderr, "%s: invalid %s '%s' (want decimal or 0x hex)\n",
			program_invocation_short_name, what, s);
		dx_usage();
	}
	return v;
}

/* Check a BDF is DDDD:BB:DD.F or BB:DD.F (hex); return the long lowercase form. */
static inline const char *dx_bdf(const char *arg)
{
	static char bdf[13];
	const char *tpl = "hhhh:hh:hh.h";
	size_t i, n = strlen(arg), skip = n == 7 ? 5 : 0; /* short: add "0000:" */
	int ok = n + skip == 12;

	memcpy(bdf, "0000:", skip);
	for (i = skip; ok && i < 12; i++) {
		unsigned char c = arg[i - skip];

		ok = tpl[i] == 'h' ? isxdigit(c) : c == tpl[i];
		bdf[i] = tolower(c);
	}
	if (!ok) {
		fprintf(stderr, "%s: invalid BDF '%s' (want e.g. 0000:01:00.0)\n",
			program_invocation_short_name, arg);
		dx_usage();
	}
	bdf[12] = '\0';
	return bdf;
}

/* Open /sys/bus/pci/devices/<bdf>/<file>; the full path is left in path. */
static inline int dx_sysfs_open(char *path, size_t len, const char *bdf,
				const char *file, int flags)
{
	int fd;

	snprintf(path, len, DX_SYSFS_PCI "/%s/%s", bdf, file);
	fd = open(path, flags | O_CLOEXEC);
	if (fd < 0) {
		int e = errno;
		char dir[64];
		struct stat st;

		snprintf(dir, sizeof(dir), DX_SYSFS_PCI "/%s", bdf);
		if (e == ENOENT && stat(dir, &st) < 0)
			dx_fail("open %s: %s (no PCI device %s; see ls " DX_SYSFS_PCI ")",
				path, strerror(e), bdf);
		if (e == ENOENT && !strncmp(file, "resource", 8))
			dx_fail("open %s: %s (BAR not implemented by %s?)", path, strerror(e), bdf);
		dx_fail("open %s: %s", path, strerror(e));
	}
	return fd;
}

/* ---- BARs ---- */

struct dx_bar {
	volatile uint8_t *base;
	size_t size;
	char path[96];
};

/* Open sysfs resource<n> of a device for mapping (uncached); its size in *size. */
static inline int dx_resource_open(struct dx_bar *b, const char *bdf, unsigned n, dx_u64 *size)
{
	char file[16];
	struct stat st;
	int fd;

	snprintf(file, sizeof(file), "resource%u", n);
	fd = dx_sysfs_open(b->path, sizeof(b->path), bdf, file, O_RDWR | O_SYNC);
	if (fstat(fd, &st) < 0)
		dx_fail("fstat %s: %s", b->path, dx_err());
	*size = st.st_size;
	return fd;
}

/* mmap BAR n of a device (uncached, via sysfs resource<n>). */
static inline void dx_bar_map(struct dx_bar *b, const char *bdf, unsigned n)
{
	dx_u64 size;
	void *p;
	int fd = dx_resource_open(b, bdf, n, &size);

	if (size == 0)
		dx_fail("%s: BAR size is 0", b->path);
	p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	if (p == MAP_FAILED)
		dx_fail("mmap %s: %s%s", b->path, dx_err(),
			errno == EINVAL || errno == ENODEV || errno == ENXIO ?
			" (I/O port BAR? only memory BARs can be mapped)" : "");
	close(fd);
	b->base = p;
	b->size = size;
}

/* Size in bytes of BAR n (st_size of sysfs resource<n>), without mapping it. */
static inline dx_u64 dx_bar_size(const char *bdf, unsigned n)
{
	char file[16], path[96];
	struct stat st;
	int fd;

	snprintf(file, sizeof(file), "resource%u", n);
	fd = dx_sysfs_open(path, sizeof(path), bdf, file, O_RDONLY);
	if (fstat(fd, &st) < 0)
		dx_fail("fstat %s: %s", path, dx_err());
	close(fd);
	return st.st_size;
}

/*
 * mmap only [off, off + len) of BAR n, for BARs too large to map whole.
 * off must be page aligned and the window inside the BAR; b->base is the
 * window start and b->size its length.
 */
static inline void dx_bar_map_window(struct dx_bar *b, const char *bdf, unsigned n,
				     dx_u64 off, size_t len)
{
	dx_u64 size;
	void *p;
	int fd = dx_resource_open(b, bdf, n, &size);

	if (!len || off % sysconf(_SC_PAGESIZE) || off > size || len > size - off)
		dx_fail("%s: window 0x%llx+0x%zx is unaligned or outside the BAR (size 0x%llx)",
			b->path, off, len, size);
	p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, off);
	if (p == MAP_FAILED)
		dx_fail("mmap %s at 0x%llx: %s", b->path, off, dx_err());
	close(fd);
	b->base = p;
	b->size = len;
}

/* ---- config space (sysfs config file, little-endian) ---- */

struct dx_cfg {
	int fd;
	size_t size; /* 256 or 4096 (less if not root) */
	char path[96];
};

static inline void dx_cfg_open(struct dx_cfg *c, const char *bdf, int flags)
{
	struct stat st;

	c->fd = dx_sysfs_open(c->path, sizeof(c->path), bdf, "config", flags);
	if (fstat(c->fd, &st) < 0)
		dx_fail("fstat %s: %s", c->path, dx_err());
	c->size = st.st_size;
}

/* width 1, 2 or 4; an aligned access becomes one config cycle in the kernel */
static inline uint32_t dx_cfg_read(struct dx_cfg *c, unsigned off, unsigned width)
{
	uint8_t b[4];
	uint32_t v = 0;
	ssize_t n = pread(c->fd, b, width, off);

	if (n != (ssize_t)width)
		dx_fail("read %s @0x%x: %s", c->path, off, n < 0 ? dx_err() : "short read");
	while (width--)
		v = v << 8 | b[width];
	return v;
}

static inline void dx_cfg_write(struct dx_cfg *c, unsigned off, unsigned width, uint32_t v)
{
	uint8_t b[4];
	ssize_t n;
	unsigned i;

	for (i = 0; i < width; i++)
		b[i] = v >> (8 * i);
	n = pwrite(c->fd, b, width, off);
	if (n != (ssize_t)width)
		dx_fail("write %s @0x%x: %s", c->path, off, n < 0 ? dx_err() : "short write");
}

/* sysfs enable, then Memory Space + Bus Master; returns the new Command. */
static inline uint16_t dx_enable(const char *bdf)
{
	char path[96];
	struct dx_cfg c;
	uint16_t cmd;
	int fd = dx_sysfs_open(path, sizeof(path), bdf, "enable", O_WRONLY);

	if (write(fd, "1", 1) != 1) {
		if (errno != EBUSY)
			dx_fail("write %s: %s", path, dx_err());
		/* EBUSY: a driver is bound and owns enabling; just set the bits */
		fprintf(stderr, "%s: note: %s: driver bound, only setting Command bits\n",
			program_invocation_short_name, path);
	}
	close(fd);
	dx_cfg_open(&c, bdf, O_RDWR);
	cmd = dx_cfg_read(&c, DX_PCI_COMMAND, 2);
	dx_cfg_write(&c, DX_PCI_COMMAND, 2, cmd | DX_CMD_MEMORY | DX_CMD_MASTER);
	cmd = dx_cfg_read(&c, DX_PCI_COMMAND, 2);
	close(c.fd);
	return cmd;
}

/* ---- misc ---- */

/* Physical address of a (resident) virtual address via /proc/self/pagemap. */
static inline dx_u64 dx_virt_to_phys(const volatile void *addr)
{
	static int fd = -1;
	dx_u64 ps = sysconf(_SC_PAGESIZE), va = (uintptr_t)addr, ent, pfn;

	if (fd < 0 && (fd = open("/proc/self/pagemap", O_RDONLY | O_CLOEXEC)) < 0)
		dx_fail("open /proc/self/pagemap: %s", dx_err());
	if (pread(fd, &ent, sizeof(ent), va / ps * sizeof(ent)) != sizeof(ent))
		dx_fail("read /proc/self/pagemap: %s", dx_err());
	if (!(ent >> 63))
		dx_fail("/proc/self/pagemap: page at 0x%llx not present", va);
	pfn = ent & ((1ULL << 55) - 1);
	if (!pfn)
		dx_fail("/proc/self/pagemap: PFN reads as 0 (needs CAP_SYS_ADMIN; run as root)");
	return pfn * ps + va % ps;
}

static inline dx_u64 dx_now_ns(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec * 1000000000ULL + ts.tv_nsec;
}

#endif /* DXPU_GUEST_H */
