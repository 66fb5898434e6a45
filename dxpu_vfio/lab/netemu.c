/* The lab's packet-level network emulator in C: the same as netemu.py (read its
 * docstring), for speed. Python's interpreter costs ~10 us a packet, which at zero
 * impairment doubled the link's round trip and held bulk transfers to a third; this loop
 * costs the two system calls. What neither loop can shed is the hop itself: a packet
 * through user space wakes this process and switches to it and back (on the lab's 2-core
 * VM ~18 us a crossing, profiled in docs/benchmarks.md), so with --up-if/--down-if a
 * direction that asks for nothing does not come here at all (the kernel fast path below).
 *
 *   netemu --tun emu --up-dst 198.18.1.2 --down-dst 198.18.1.1 --config F --report F
 *          [--up-if toh --down-if tob] [--seed N]
 *
 * Config (re-read on SIGHUP): lines "up|down key=value ...", keys as in Impairment.
 * SIGUSR1 writes the report (JSON), SIGUSR2 zeroes the counters, SIGTERM sends what is
 * held and exits. Built by dxpu_vfio/lab/netemu_build.py with the host's gcc. */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <linux/if.h>
#include <linux/bpf.h>
#include <linux/if_tun.h>
#include <math.h>
#include <poll.h>
#include <signal.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define VNET_HDR 10
#define DST (VNET_HDR + 16)
#define BUF (VNET_HDR + 262144)
#define SAMPLES 200000

typedef struct {
    double delay_us, jitter_us, loss, ge_p, ge_r, ge_loss_bad, ge_loss_good, reorder, duplicate, rate_bps;
    int uniform;
} imp_t;

typedef struct {
    const char *name;
    imp_t imp;
    int bad;
    uint64_t last_due;
    uint64_t packets, bytes, sent, sent_bytes, lost_random, lost_burst, duplicated, reordered;
    uint64_t reads, stamped, wait_ns; /* packets read (to match the kernel's count), timed from its stamp, stamp-to-read total */
    uint64_t handback_ns, handbacks; /* the writes' total time, and how many */
    uint64_t dark_since, blackout_ns; /* the current run of lost packets began (0: none), the longest run's span */
    double handback_avg; /* ns, moving average: the hand-back's cost, counted inside the asked delay */
    uint32_t *held; /* ns, ring */
    size_t nheld, pos;
} dir_t;

typedef struct {
    uint64_t due, seq, arrived;
    dir_t *d;
    size_t len;
    unsigned char *data;
} pkt_t;

static dir_t dirs[2] = {{.name = "up"}, {.name = "down"}};
static pkt_t *heap;
static size_t nheap, capheap;
static uint64_t seqno, other_dropped, rng_state = 0x9E3779B97F4A7C15ull;
static int tun_fd, tso = -1;
static long early_ns = 20000;
static long spin_ns; /* after a packet, poll without sleeping this long (--spin-us; off: on the 2-core
                      * VM the spinner holds one core, the two ends then wake each other across
                      * cores, ~26 us a wake-up there: 50 us of spinning took the round trip from
                      * 2.1x to 4.6x the direct veth's) */
static volatile sig_atomic_t want_reload, want_report, want_reset, stopping;
static const char *config_path, *report_path;

/* The kernel fast path (--up-if/--down-if): a tc program on each link veth's ingress
 * (tcx, detached when this process ends) counts a direction's packets and lets the kernel
 * forward them while that direction asks for nothing; else it redirects them into the TUN,
 * to this loop. So at zero impairment a packet costs the link no wake-up of this process
 * (two context switches, the floor of any hop through user space). */
typedef struct {
    uint64_t packets, bytes; /* counted in the kernel (atomic adds), this side only reads */
    uint32_t to_user, tun_ifindex;
    uint64_t last_ns, redirected; /* the newest packet sent to the TUN: its arrival (CLOCK_MONOTONIC), then the count */
} fast_t;
static volatile fast_t *fast; /* the array map's two entries, mmapped; NULL: routes send all to the TUN */
static uint64_t fast_base[2][2]; /* packets, bytes at the last reset */

extern unsigned int if_nametoindex(const char *name); /* <net/if.h> clashes with <linux/if.h> */
#define NE_TCX_INGRESS 46 /* enum bpf_attach_type, kernel 6.6+ (headers may be older) */
#define INSN(c, d, s, o, i) ((struct bpf_insn){.code = (c), .dst_reg = (d), .src_reg = (s), .off = (o), .imm = (i)})

#ifdef BPF_ATOMIC /* headers of 5.12+ (atomic adds, mmapable maps, links); older ones: routes only */
static long sys_bpf(int cmd, union bpf_attr *attr) { return syscall(SYS_bpf, cmd, attr, sizeof *attr); }

/* skb in r1. Entry dir of the map: if to_user, stamp its arrival and bpf_redirect(tun_ifindex)
 * (egress of the TUN); else count it (skb->len less the Ethernet header, as the TUN sees it)
 * and pass. The stamp lets the loop time a delay from the packet's arrival in the link
 * namespace, so the wake-up that brings it to the loop is inside the asked delay. */
static int fast_prog(int map_fd, int dir) {
    struct bpf_insn p[] = {
        INSN(BPF_ALU64 | BPF_MOV | BPF_X, 6, 1, 0, 0),                 /* r6 = skb */
        INSN(BPF_ST | BPF_MEM | BPF_W, 10, 0, -4, dir),                /* key */
        INSN(BPF_ALU64 | BPF_MOV | BPF_X, 2, 10, 0, 0),
        INSN(BPF_ALU64 | BPF_ADD | BPF_K, 2, 0, 0, -4),
        INSN(BPF_LD | BPF_DW | BPF_IMM, 1, BPF_PSEUDO_MAP_FD, 0, map_fd), INSN(0, 0, 0, 0, 0),
        INSN(BPF_JMP | BPF_CALL, 0, 0, 0, BPF_FUNC_map_lookup_elem),
        INSN(BPF_JMP | BPF_JEQ | BPF_K, 0, 0, 7, 0),                   /* no entry: pass */
        INSN(BPF_LDX | BPF_MEM | BPF_W, 1, 0, offsetof(fast_t, to_user), 0),
        INSN(BPF_JMP | BPF_JNE | BPF_K, 1, 0, 7, 0),                   /* to the TUN */
        INSN(BPF_ALU64 | BPF_MOV | BPF_K, 1, 0, 0, 1),
        INSN(BPF_STX | BPF_ATOMIC | BPF_DW, 0, 1, offsetof(fast_t, packets), BPF_ADD),
        INSN(BPF_LDX | BPF_MEM | BPF_W, 1, 6, offsetof(struct __sk_buff, len), 0),
        INSN(BPF_ALU64 | BPF_ADD | BPF_K, 1, 0, 0, -14),
        INSN(BPF_STX | BPF_ATOMIC | BPF_DW, 0, 1, offsetof(fast_t, bytes), BPF_ADD),
        INSN(BPF_ALU64 | BPF_MOV | BPF_K, 0, 0, 0, 0),                 /* TC_ACT_OK */
        INSN(BPF_JMP | BPF_EXIT, 0, 0, 0, 0),
        INSN(BPF_ALU64 | BPF_MOV | BPF_X, 7, 0, 0, 0),                 /* r7 = entry (r0 goes to the call) */
        INSN(BPF_JMP | BPF_CALL, 0, 0, 0, BPF_FUNC_ktime_get_ns),      /* stamp first, count after: a */
        INSN(BPF_STX | BPF_MEM | BPF_DW, 7, 0, offsetof(fast_t, last_ns), 0), /* reader that sees its count */
        INSN(BPF_ALU64 | BPF_MOV | BPF_K, 1, 0, 0, 1),                 /* sees its stamp or a newer one */
        INSN(BPF_STX | BPF_ATOMIC | BPF_DW, 7, 1, offsetof(fast_t, redirected), BPF_ADD),
        INSN(BPF_LDX | BPF_MEM | BPF_W, 1, 7, offsetof(fast_t, tun_ifindex), 0),
        INSN(BPF_ALU64 | BPF_MOV | BPF_K, 2, 0, 0, 0),
        INSN(BPF_JMP | BPF_CALL, 0, 0, 0, BPF_FUNC_redirect),
        INSN(BPF_JMP | BPF_EXIT, 0, 0, 0, 0),
    };
    static char log[8192];
    union bpf_attr a = {0};
    a.prog_type = BPF_PROG_TYPE_SCHED_CLS;
    a.insns = (uint64_t)(uintptr_t)p;
    a.insn_cnt = sizeof p / sizeof *p;
    a.license = (uint64_t)(uintptr_t)"GPL";
    a.log_buf = (uint64_t)(uintptr_t)log;
    a.log_size = sizeof log;
    a.log_level = 1;
    int fd = sys_bpf(BPF_PROG_LOAD, &a);
    if (fd < 0) fprintf(stderr, "fast path: BPF_PROG_LOAD: %s\n%s\n", strerror(errno), log);
    return fd;
}

/* Load and attach both programs; 0 and the map mapped, or -1 (nothing left attached). */
static int fast_setup(const char *up_if, const char *down_if, int tun_ifindex) {
    union bpf_attr a = {0};
    a.map_type = BPF_MAP_TYPE_ARRAY;
    a.key_size = 4;
    a.value_size = sizeof(fast_t);
    a.max_entries = 2;
    a.map_flags = BPF_F_MMAPABLE;
    int map_fd = sys_bpf(BPF_MAP_CREATE, &a);
    if (map_fd < 0) { fprintf(stderr, "fast path: BPF_MAP_CREATE: %s\n", strerror(errno)); return -1; }
    void *m = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, map_fd, 0);
    if (m == MAP_FAILED) { perror("fast path: mmap"); close(map_fd); return -1; }
    fast_t *f = m;
    const char *ifs[2] = {up_if, down_if};
    int links[2] = {-1, -1};
    for (int k = 0; k < 2; k++) {
        f[k].to_user = 1;
        f[k].tun_ifindex = (uint32_t)tun_ifindex;
        int ifindex = (int)if_nametoindex(ifs[k]), prog = ifindex ? fast_prog(map_fd, k) : -1;
        if (prog < 0) break;
        union bpf_attr l = {0};
        l.link_create.prog_fd = (uint32_t)prog;
        l.link_create.target_ifindex = (uint32_t)ifindex;
        l.link_create.attach_type = NE_TCX_INGRESS;
        links[k] = sys_bpf(BPF_LINK_CREATE, &l); /* the link holds the program; gone when we exit */
        if (links[k] < 0) fprintf(stderr, "fast path: tcx on %s: %s\n", ifs[k], strerror(errno));
        close(prog);
        if (links[k] < 0) break;
    }
    if (links[0] < 0 || links[1] < 0) {
        for (int k = 0; k < 2; k++) if (links[k] >= 0) close(links[k]);
        munmap(m, 4096);
        close(map_fd);
        return -1;
    }
    fast = f;
    return 0;
}
#else
static int fast_setup(const char *up_if, const char *down_if, int tun_ifindex) {
    (void)up_if, (void)down_if, (void)tun_ifindex;
    fprintf(stderr, "fast path: built with kernel headers older than 5.12\n");
    return -1;
}
#endif

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + ts.tv_nsec;
}

static double rnd(void) { /* xorshift64*, [0, 1) */
    rng_state ^= rng_state >> 12; rng_state ^= rng_state << 25; rng_state ^= rng_state >> 27;
    return ((rng_state * 2685821657736338717ull) >> 11) * (1.0 / 9007199254740992.0);
}

static double gauss(void) {
    double u = rnd(), v = rnd();
    return sqrt(-2.0 * log(u > 0 ? u : 1e-300)) * cos(2 * M_PI * v);
}

static int per_packet(const imp_t *i) { return i->loss > 0 || i->ge_p > 0 || i->reorder > 0 || i->duplicate > 0; }
static int passthrough(const imp_t *i) { return !(i->delay_us > 0 || i->jitter_us > 0 || per_packet(i)); }

static void set_offload(void) {
    int want = !(per_packet(&dirs[0].imp) || per_packet(&dirs[1].imp));
    if (want == tso) return;
    unsigned flags = TUN_F_CSUM | (want ? TUN_F_TSO4 | TUN_F_TSO6 : 0);
    if (ioctl(tun_fd, TUNSETOFFLOAD, flags) < 0) perror("TUNSETOFFLOAD");
    tso = want;
}

static void load_config(void) {
    FILE *f = fopen(config_path, "r");
    if (!f) return;
    char line[1024];
    while (fgets(line, sizeof line, f)) {
        char *save, *tok = strtok_r(line, " \t\n", &save);
        dir_t *d = tok && !strcmp(tok, "up") ? &dirs[0] : tok && !strcmp(tok, "down") ? &dirs[1] : NULL;
        if (!d) continue;
        imp_t i = {.ge_r = 1.0, .ge_loss_bad = 1.0};
        while ((tok = strtok_r(NULL, " \t\n", &save))) {
            char *eq = strchr(tok, '=');
            if (!eq) continue;
            *eq = 0;
            const char *k = tok, *v = eq + 1;
            double x = atof(v);
            if (!strcmp(k, "delay_us")) i.delay_us = x;
            else if (!strcmp(k, "jitter_us")) i.jitter_us = x;
            else if (!strcmp(k, "distribution")) i.uniform = !strcmp(v, "uniform");
            else if (!strcmp(k, "loss")) i.loss = x;
            else if (!strcmp(k, "ge_p")) i.ge_p = x;
            else if (!strcmp(k, "ge_r")) i.ge_r = x;
            else if (!strcmp(k, "ge_loss_bad")) i.ge_loss_bad = x;
            else if (!strcmp(k, "ge_loss_good")) i.ge_loss_good = x;
            else if (!strcmp(k, "reorder")) i.reorder = x;
            else if (!strcmp(k, "duplicate")) i.duplicate = x;
            else if (!strcmp(k, "rate_bps")) i.rate_bps = x;
        }
        d->imp = i;
        if (i.ge_p <= 0) d->bad = 0;
    }
    fclose(f);
    set_offload();
    if (fast)
        for (int k = 0; k < 2; k++) fast[k].to_user = !passthrough(&dirs[k].imp);
}

static int cmp_u32(const void *a, const void *b) {
    uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
    return x < y ? -1 : x > y;
}

static void report_dir(FILE *f, dir_t *d, int k) {
    uint64_t kp = fast ? fast[k].packets - fast_base[k][0] : 0, kb = fast ? fast[k].bytes - fast_base[k][1] : 0;
    size_t n = d->nheld;
    uint32_t *s = malloc((n ? n : 1) * sizeof *s);
    memcpy(s, d->held, n * sizeof *s);
    qsort(s, n, sizeof *s, cmp_u32);
    double mean = 0, var = 0;
    for (size_t k = 0; k < n; k++) mean += s[k];
    mean = n ? mean / n : 0;
    for (size_t k = 0; k < n; k++) var += (s[k] - mean) * (s[k] - mean);
#define PCT(q) (n ? s[(size_t)(n * (q)) < n ? (size_t)(n * (q)) : n - 1] / 1000.0 : 0.0)
    imp_t *i = &d->imp;
    uint64_t lost = d->lost_random + d->lost_burst;
    uint64_t t = now_ns(), dark = d->dark_since && t > d->dark_since ? t - d->dark_since : 0;
    fprintf(f, "\"%s\": {\"asked\": {\"delay_us\": %g, \"jitter_us\": %g, \"distribution\": \"%s\", \"loss\": %g, "
            "\"ge_p\": %g, \"ge_r\": %g, \"ge_loss_bad\": %g, \"ge_loss_good\": %g, \"reorder\": %g, \"duplicate\": %g, "
            "\"rate_bps\": %g}, \"packets\": %lu, \"bytes\": %lu, \"sent\": %lu, \"sent_bytes\": %lu, \"lost\": %lu, "
            "\"lost_random\": %lu, \"lost_burst\": %lu, \"loss_rate\": %g, \"blackout_ms\": %g, \"duplicated\": %lu, \"reordered\": %lu, "
            "\"kernel_packets\": %lu, \"stamped\": %lu, \"arrival_wait_us\": %g, \"handback_us\": %g, \"held_samples\": %zu, \"delay_us\": {\"mean\": %g, \"std\": %g, \"p50\": %g, \"p90\": %g, \"p99\": %g, "
            "\"max\": %g}}",
            d->name, i->delay_us, i->jitter_us, i->uniform ? "uniform" : "normal", i->loss, i->ge_p, i->ge_r,
            i->ge_loss_bad, i->ge_loss_good, i->reorder, i->duplicate, i->rate_bps, d->packets + kp, d->bytes + kb,
            d->sent + kp, d->sent_bytes + kb, lost, d->lost_random, d->lost_burst,
            d->packets + kp ? (double)lost / (d->packets + kp) : 0.0,
            (dark > d->blackout_ns ? dark : d->blackout_ns) / 1e6, d->duplicated, d->reordered, kp, d->stamped, d->stamped ? d->wait_ns / 1000.0 / d->stamped : 0.0,
            d->handbacks ? d->handback_ns / 1000.0 / d->handbacks : 0.0, n, mean / 1000, n ? sqrt(var / n) / 1000 : 0.0, PCT(0.5), PCT(0.9),
            PCT(0.99), n ? s[n - 1] / 1000.0 : 0.0);
    free(s);
}

static void write_report(void) {
    char tmp[4096];
    snprintf(tmp, sizeof tmp, "%s.tmp", report_path);
    FILE *f = fopen(tmp, "w");
    if (!f) return;
    fprintf(f, "{\"pid\": %d, \"engine\": \"c\", \"fast_path\": %s, \"tso\": %s, \"other_dropped\": %lu, "
            "\"held_now\": %zu, \"wake_early_us\": %g, \"held_from\": \"%s\", ", getpid(), fast ? "true" : "false",
            tso ? "true" : "false", other_dropped, nheap, early_ns / 1000.0, fast ? "ingress" : "read");
    report_dir(f, &dirs[0], 0);
    fputs(", ", f);
    report_dir(f, &dirs[1], 1);
    fputs("}\n", f);
    fclose(f);
    rename(tmp, report_path);
}

static void reset(void) {
    for (int k = 0; k < 2; k++) {
        dir_t *d = &dirs[k];
        d->packets = d->bytes = d->sent = d->sent_bytes = d->lost_random = d->lost_burst = 0;
        d->duplicated = d->reordered = d->stamped = d->wait_ns = d->handback_ns = d->handbacks = 0;
        d->nheld = d->pos = 0;
        d->dark_since = d->blackout_ns = 0;
        if (fast) { fast_base[k][0] = fast[k].packets; fast_base[k][1] = fast[k].bytes; }
    }
    other_dropped = 0;
}

/* The delay is taken when the packet has been handed back: the write runs the TUN, the
 * kernel's forwarding and the receiver's stack in this thread, up to the far end's socket,
 * so its time is part of the packet's way across (and a delayed packet is released that
 * much early: its moving average is counted inside the asked delay, see arrive). */
static void send_pkt(dir_t *d, const unsigned char *data, size_t len, uint64_t arrived) {
    uint64_t start = now_ns();
    if (write(tun_fd, data, len) < 0) return; /* backlog full: lost, as on a wire */
    uint64_t end = now_ns(), held = end - arrived;
    d->handback_ns += end - start;
    d->handbacks++;
    /* follows the short writes (down fast, up slowly): one the scheduler cut into (the woken
     * receiver ran first, SCHED_OTHER) holds the receiver's time, and a mean of those
     * released packets early */
    double took = (double)(end - start);
    d->handback_avg += (took - d->handback_avg) / (took < d->handback_avg ? 4 : 64);
    d->sent++;
    d->sent_bytes += len - VNET_HDR;
    d->held[d->pos] = (uint32_t)held;
    d->pos = (d->pos + 1) % SAMPLES;
    if (d->nheld < SAMPLES) d->nheld++;
}

static int before(const pkt_t *a, const pkt_t *b) { return a->due < b->due || (a->due == b->due && a->seq < b->seq); }

static void heap_push(pkt_t p) {
    if (nheap == capheap) {
        capheap = capheap ? capheap * 2 : 1024;
        heap = realloc(heap, capheap * sizeof *heap);
    }
    size_t k = nheap++;
    while (k && before(&p, &heap[(k - 1) / 2])) { heap[k] = heap[(k - 1) / 2]; k = (k - 1) / 2; }
    heap[k] = p;
}

static pkt_t heap_pop(void) {
    pkt_t top = heap[0], last = heap[--nheap];
    size_t k = 0;
    for (;;) {
        size_t c = 2 * k + 1;
        if (c >= nheap) break;
        if (c + 1 < nheap && before(&heap[c + 1], &heap[c])) c++;
        if (!before(&heap[c], &last)) break;
        heap[k] = heap[c];
        k = c;
    }
    if (nheap) heap[k] = last;
    return top;
}

static void release(uint64_t now) {
    while (nheap && heap[0].due <= now) {
        pkt_t p = heap_pop();
        send_pkt(p.d, p.data, p.len, p.arrived);
        free(p.data);
    }
}

static int lost(dir_t *d) {
    imp_t *i = &d->imp;
    if (i->ge_p > 0) {
        d->bad = d->bad ? rnd() >= i->ge_r : rnd() < i->ge_p;
        if (rnd() < (d->bad ? i->ge_loss_bad : i->ge_loss_good)) { d->lost_burst++; return 1; }
    }
    if (i->loss > 0 && rnd() < i->loss) { d->lost_random++; return 1; }
    return 0;
}

static uint64_t hold_ns(dir_t *d) {
    imp_t *i = &d->imp;
    double us = i->delay_us;
    if (i->jitter_us > 0) us = i->uniform ? us + (2 * rnd() - 1) * i->jitter_us : us + gauss() * i->jitter_us;
    return us > 0 ? (uint64_t)(us * 1000) : 0;
}

/* When the packet arrived in the link namespace: the tc program's stamp where it is this
 * packet's (the kernel's count of packets sent to the TUN is the count read so far: the
 * stamp is this one's or, if another was stamped meanwhile, a newer one, never an older),
 * else the read. Resynced at each drained read (a packet the TUN queue dropped, or one
 * not classed, would otherwise throw the counts apart for good). */
static uint64_t arrival(dir_t *d, int k, uint64_t read) {
    if (!fast) return read;
    d->reads++;
    uint64_t count = fast[k].redirected, stamp = fast[k].last_ns;
    if (count != d->reads || stamp > read || read - stamp > 10000000) return read;
    d->stamped++;
    d->wait_ns += read - stamp;
    return stamp;
}

static void resync(void) {
    if (fast)
        for (int k = 0; k < 2; k++) dirs[k].reads = fast[k].redirected;
}

static void arrive(unsigned char *buf, size_t n, uint64_t read, in_addr_t up_dst, in_addr_t down_dst) {
    if (n < DST + 4) { other_dropped++; return; }
    in_addr_t dst;
    memcpy(&dst, buf + DST, 4);
    int k = dst == up_dst ? 0 : dst == down_dst ? 1 : -1;
    if (k < 0) { other_dropped++; return; }
    dir_t *d = &dirs[k];
    uint64_t arrived = arrival(d, k, read);
    d->packets++;
    d->bytes += n - VNET_HDR;
    int pass = passthrough(&d->imp);
    if (!pass && lost(d)) {
        if (!d->dark_since) d->dark_since = arrived;
        return;
    }
    if (d->dark_since) { /* a packet goes through: the run of losses (the dark) is over */
        if (arrived > d->dark_since && arrived - d->dark_since > d->blackout_ns) d->blackout_ns = arrived - d->dark_since;
        d->dark_since = 0;
    }
    if (pass) { send_pkt(d, buf, n, arrived); return; }
    int copies = d->imp.duplicate > 0 && rnd() < d->imp.duplicate ? 2 : 1;
    d->duplicated += copies - 1;
    for (int c = 0; c < copies; c++) {
        if (d->imp.reorder > 0 && rnd() < d->imp.reorder) { d->reordered++; send_pkt(d, buf, n, arrived); continue; }
        uint64_t hold = hold_ns(d), early = (uint64_t)d->handback_avg;
        uint64_t due = arrived + (hold > early ? hold - early : 0);
        if (due < d->last_due) due = d->last_due; /* order is kept */
        d->last_due = due;
        if (due <= read) { send_pkt(d, buf, n, arrived); continue; } /* due already (or no delay) */
        pkt_t p = {.due = due, .seq = ++seqno, .arrived = arrived, .d = d, .len = n, .data = malloc(n)};
        memcpy(p.data, buf, n);
        heap_push(p);
    }
}

static void on_signal(int sig) {
    if (sig == SIGHUP) want_reload = 1;
    else if (sig == SIGUSR1) want_report = 1;
    else if (sig == SIGUSR2) want_reset = 1;
    else stopping = 1;
}

int main(int argc, char **argv) {
    const char *tun = NULL, *up = NULL, *down = NULL, *up_if = NULL, *down_if = NULL;
    for (int k = 1; k + 1 < argc; k += 2) {
        if (!strcmp(argv[k], "--tun")) tun = argv[k + 1];
        else if (!strcmp(argv[k], "--up-dst")) up = argv[k + 1];
        else if (!strcmp(argv[k], "--down-dst")) down = argv[k + 1];
        else if (!strcmp(argv[k], "--up-if")) up_if = argv[k + 1];
        else if (!strcmp(argv[k], "--down-if")) down_if = argv[k + 1];
        else if (!strcmp(argv[k], "--config")) config_path = argv[k + 1];
        else if (!strcmp(argv[k], "--report")) report_path = argv[k + 1];
        else if (!strcmp(argv[k], "--spin-us")) spin_ns = atol(argv[k + 1]) * 1000;
        else if (!strcmp(argv[k], "--seed")) rng_state ^= strtoull(argv[k + 1], NULL, 10) * 0x2545F4914F6CDD1Dull;
    }
    if (!tun || !up || !down || !config_path || !report_path) {
        fprintf(stderr, "usage: netemu --tun NAME --up-dst IP --down-dst IP --config F --report F "
                "[--up-if VETH --down-if VETH] [--seed N]\n");
        return 2;
    }
    prctl(PR_SET_TIMERSLACK, 1, 0, 0, 0);
    tun_fd = open("/dev/net/tun", O_RDWR | O_NONBLOCK);
    struct ifreq ifr = {0};
    strncpy(ifr.ifr_name, tun, IFNAMSIZ - 1);
    ifr.ifr_flags = IFF_TUN | IFF_NO_PI | IFF_VNET_HDR;
    if (tun_fd < 0 || ioctl(tun_fd, TUNSETIFF, &ifr) < 0) { perror("tun"); return 1; }
    for (int k = 0; k < 2; k++) {
        dirs[k].held = malloc(SAMPLES * sizeof(uint32_t));
        dirs[k].imp = (imp_t){.ge_r = 1.0, .ge_loss_bad = 1.0};
    }
    in_addr_t up_dst = inet_addr(up), down_dst = inet_addr(down);
    if (up_if && down_if && fast_setup(up_if, down_if, (int)if_nametoindex(tun)) < 0)
        fprintf(stderr, "fast path: not attached, the lab routes every packet through the TUN\n");
    load_config();
    set_offload();
    sigset_t block, waitmask;
    sigemptyset(&block);
    int sigs[] = {SIGHUP, SIGUSR1, SIGUSR2, SIGTERM, SIGINT};
    for (size_t k = 0; k < sizeof sigs / sizeof *sigs; k++) {
        signal(sigs[k], on_signal);
        sigaddset(&block, sigs[k]);
    }
    sigprocmask(SIG_BLOCK, &block, &waitmask); /* signals arrive only inside ppoll: no lost wake-up */
    printf("emulator on %s: up to %s, down to %s (c%s)\n", tun, up, down, fast ? ", kernel fast path" : "");
    fflush(stdout);
    static unsigned char buf[BUF];
    struct pollfd pfd = {.fd = tun_fd, .events = POLLIN};
    uint64_t last_packet = 0;
    while (!stopping) {
        uint64_t now = now_ns();
        if (nheap) release(now);
        struct timespec ts, *tsp = NULL;
        int spinning = spin_ns && now - last_packet < (uint64_t)spin_ns;
        if (spinning) {
            ts.tv_sec = ts.tv_nsec = 0;
            tsp = &ts;
        } else if (nheap) {
            long long wait = (long long)(heap[0].due - now) - early_ns;
            if (wait < 0) wait = 0;
            ts.tv_sec = wait / 1000000000;
            ts.tv_nsec = wait % 1000000000;
            tsp = &ts;
        }
        int r = ppoll(&pfd, 1, tsp, &waitmask);
        if (r < 0 && errno == EINTR) {
            if (want_reload) { want_reload = 0; load_config(); write_report(); }
            if (want_reset) { want_reset = 0; reset(); write_report(); }
            if (want_report) { want_report = 0; write_report(); }
            continue;
        }
        if (r > 0) {
            for (int k = 0; k < 64; k++) {
                ssize_t n = read(tun_fd, buf, sizeof buf);
                if (n <= 0) { resync(); break; }
                last_packet = now_ns();
                arrive(buf, (size_t)n, last_packet, up_dst, down_dst);
            }
        } else if (r == 0 && nheap && !spinning) { /* woke for a due packet: learn the overshoot, spin to it */
            uint64_t due = heap[0].due;
            now = now_ns();
            long late = (long)(now - (due - early_ns));
            early_ns = (early_ns * 7 + late + 3000) / 8;
            if (early_ns < 2000) early_ns = 2000;
            if (early_ns > 100000) early_ns = 100000;
            while (now < due) now = now_ns();
        }
    }
    release(UINT64_MAX);
    write_report();
    return 0;
}
