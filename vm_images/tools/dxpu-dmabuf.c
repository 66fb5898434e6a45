/*
 * dxpu-dmabuf - a locked, patterned guest buffer with known physical
 * addresses, for device DMA tests.
 *
 * Why: a dxpu-vfio DMA test needs guest memory whose guest-physical
 * addresses it can program into the virtual device, and a way to see what
 * the device wrote there. This tool allocates and mlocks the buffer, fills
 * it, prints the physical address of every page (from /proc/self/pagemap),
 * holds it while the test drives the device, then optionally checks the
 * contents. SIGUSR1/SIGTERM/SIGINT end the hold early; the check still runs.
 *
 * Output (stdout, key=value):
 *   virt=0x... size=N pages=K
 *   contig=yes|no                      (only with --contig)
 *   page=i phys=0x...                  (K lines; stdout is flushed here)
 *   hold_end=timeout|SIGUSR1|SIGTERM|SIGINT   (only with --hold > 0)
 *   phys_stable=yes | phys_stable=no first_moved_page=i (only with --hold > 0)
 *   check=ok | check=fail first_bad_offset=0x.. value=0x..  (only with --check)
 */
#include "dxpu_guest.h"
#include <signal.h>

#define HUGE_2M (2UL << 20)

static void dx_usage(void)
{
	fputs("usage: dxpu-dmabuf SIZE [--fill BYTE | --no-fill] [--hold SECONDS]\n"
	      "                   [--check BYTE] [--contig]\n"
	      "SIZE in bytes (mapping rounded up to whole pages), BYTE 0-0xff,\n"
	      "default fill 0xa5, default hold 0. --contig uses a 2 MiB huge page\n"
	      "if available. Numbers are decimal or 0x hex. Needs root.\n", stderr);
	exit(2);
}

static unsigned char byte_arg(const char *s)
{
	dx_u64 v = dx_arg_u64(s, "BYTE");

	if (v > 0xff)
		dx_exit(2, "BYTE 0x%llx is not 0-0xff", v);
	return v;
}

/* Wait up to secs seconds or until one of sigs arrives; returns its name. */
static const char *hold(const sigset_t *sigs, dx_u64 secs)
{
	dx_u64 end = dx_now_ns() + secs * 1000000000ULL, now;

	while ((now = dx_now_ns()) < end) {
		struct timespec ts = { (end - now) / 1000000000ULL, (end - now) % 1000000000ULL };
		int sig = sigtimedwait(sigs, NULL, &ts);

		if (sig > 0)
			return sig == SIGUSR1 ? "SIGUSR1" : sig == SIGTERM ? "SIGTERM" : "SIGINT";
		if (errno != EAGAIN && errno != EINTR)
			dx_fail("sigtimedwait: %s", dx_err());
	}
	return "timeout";
}

int main(int argc, char **argv)
{
	dx_u64 size, secs = 0, *phys, i;
	int a, fill = 0xa5, check = -1, want_contig = 0, contig = 0;
	size_t ps = sysconf(_SC_PAGESIZE), len, maplen, pages;
	unsigned char *buf = MAP_FAILED;
	const volatile unsigned char *p;
	sigset_t sigs;

	if (argc < 2)
		dx_usage();
	size = dx_arg_u64(argv[1], "SIZE");
	if (!size || size > SIZE_MAX - HUGE_2M)
		dx_exit(2, "SIZE must be > 0 and sane");
	for (a = 2; a < argc; a++) {
		int has_val = a + 1 < argc;

		if (!strcmp(argv[a], "--contig"))
			want_contig = 1;
		else if (!strcmp(argv[a], "--no-fill"))
			fill = -1;
		else if (!strcmp(argv[a], "--fill") && has_val)
			fill = byte_arg(argv[++a]);
		else if (!strcmp(argv[a], "--check") && has_val)
			check = byte_arg(argv[++a]);
		else if (!strcmp(argv[a], "--hold") && has_val)
			secs = dx_arg_u64(argv[++a], "SECONDS");
		else
			dx_usage();
	}
	if (secs > 100ULL * 365 * 86400) /* keep ns arithmetic from overflowing */
		secs = 100ULL * 365 * 86400;

	/* Block the stop signals now: one arriving early stays pending and ends the hold. */
	sigemptyset(&sigs);
	sigaddset(&sigs, SIGUSR1);
	sigaddset(&sigs, SIGTERM);
	sigaddset(&sigs, SIGINT);
	sigprocmask(SIG_BLOCK, &sigs, NULL);

	len = (size + ps - 1) / ps * ps;
	pages = len / ps;
	if (want_contig) {
		maplen = (len + HUGE_2M - 1) & ~(HUGE_2M - 1);
		buf = mmap(NULL, maplen, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS |
			   MAP_POPULATE | MAP_HUGETLB | (21 << MAP_HUGE_SHIFT), -1, 0);
		if (buf == MAP_FAILED)
			fprintf(stderr, "dxpu-dmabuf: no 2 MiB huge page (%s; see "
				"/proc/sys/vm/nr_hugepages), using normal pages\n", dx_err());
	}
	if (buf == MAP_FAILED) {
		maplen = len;
		buf = mmap(NULL, maplen, PROT_READ | PROT_WRITE,
			   MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
		if (buf == MAP_FAILED)
			dx_fail("mmap %zu bytes: %s", maplen, dx_err());
	} else {
		contig = 1; /* huge page mapping; verified below */
	}
	if (mlock(buf, maplen))
		dx_fail("mlock %zu bytes: %s (run as root or raise ulimit -l)", maplen, dx_err());
	if (fill >= 0)
		memset(buf, fill, len);

	phys = malloc(pages * sizeof(*phys));
	if (!phys)
		dx_fail("cannot allocate page table");
	for (i = 0; i < pages; i++) {
		phys[i] = dx_virt_to_phys(buf + i * ps);
		if (i && phys[i] != phys[i - 1] + ps)
			contig = 0;
	}
	printf("virt=0x%llx size=%llu pages=%zu\n", (dx_u64)(uintptr_t)buf, size, pages);
	if (want_contig)
		printf("contig=%s\n", contig ? "yes" : "no");
	for (i = 0; i < pages; i++)
		printf("page=%llu phys=0x%llx\n", i, phys[i]);
	fflush(stdout);

	if (secs) {
		printf("hold_end=%s\n", hold(&sigs, secs));
		/* mlock does not forbid migration (compaction); make a move visible */
		for (i = 0; i < pages && dx_virt_to_phys(buf + i * ps) == phys[i]; i++)
			;
		if (i < pages)
			printf("phys_stable=no first_moved_page=%llu\n", i);
		else
			printf("phys_stable=yes\n");
	}

	if (check >= 0) {
		/* volatile: the device writes this memory behind the compiler's back */
		for (p = buf, i = 0; i < size && p[i] == check; i++)
			;
		if (i < size) {
			printf("check=fail first_bad_offset=0x%llx value=0x%02x\n", i, p[i]);
			return 1;
		}
		printf("check=ok\n");
	}
	return 0;
}
