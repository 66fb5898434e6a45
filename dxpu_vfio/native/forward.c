/* The host proxy's hot path in C: QEMU's register accesses to a device in a GPU box, and the
 * box's DMA and MSI/MSI-X interrupts, forwarded between two native streams without Python.
 * (Part of fastlink.c's translation unit: it uses the stream's static functions.)
 *
 * Forwarder(qemu, link, completion_timeout, read_spin_us=0).serve() runs the vfio-user session thread's loop:
 *  - from QEMU: REGION_READ and REGION_WRITE go to the box with the same payload (the link
 *    reuses vfio-user's layouts); posted writes are posted, anything non-posted waits for the
 *    box's completion, which is checked against what was asked before it is answered;
 *  - from the box: HEARTBEAT is noted, IRQ (MSI, MSI-X) is an eventfd write, DMA_WRITE(V) and
 *    DMA_READ(V) a copy into or out of guest memory (and a completion); only inside the DMA
 *    windows QEMU mapped, with their rights (dxpu_vfio/vfio_user/dma.py says how each window
 *    is reached safely: a mapping of a memfd sealed against shrinking, else pread/pwrite);
 *  - everything else returns to Python as (source, message) — QEMU's control messages, its
 *    config-space writes (Python watches Bus Master Enable in them: while it is off the DMA
 *    table hands us no windows), INTx, whatever is unknown — and so does a completion
 *    timeout or a closed stream. A completion that does not answer its request is never
 *    forwarded: the link is given up ("link-closed") and Python answers QEMU (all-ones). DMA outside
 *    the windows is refused here (a DMA_READ gets EFAULT) and counted in dma_refused.
 * Ordering is the stream's: one thread, messages in arrival order, each finished before the
 * next. While a completion is awaited, box messages for Python are kept (in order) and handed
 * over right after it, and later box messages are still served here: the box must not wait
 * for the DMA completions its device needs to answer us. Nothing that goes to Python can be
 * overtaken in a way that matters: an INTx level is merely delivered a little later (the
 * guest's handler reads the device anyway), and every other such message is refused or
 * dropped there (IRQs without an eventfd, unknown commands).
 * Descriptors (memfds, eventfds) are borrowed from Python's tables, which call set_windows /
 * set_irqs on the same thread after every change.
 *
 * Adaptive polling for reads (read_spin_us): while QEMU waits for a read's completion its vCPU
 * is stopped on it, so the CPU this thread would give up is one nothing of the guest's needs.
 * The forwarder spins up to read_spin_us for the completion instead of sleeping (no wake-up
 * of its own when the reply comes), but only while the recent reads' completions came within
 * that time (an average of their waits, 1/8 per read): over a link with delay, or while the
 * box is slow, it sleeps at once and spins again when the reads are quick again. Nothing
 * else spins: posted writes wait for nothing, and a DMA or a doorbell's wait is the device's.
 */

#include <sys/stat.h>
#include <sys/uio.h>

#define CMD_REGION_READ 9
#define CMD_REGION_WRITE 10
#define CMD_DMA_READ 11
#define CMD_DMA_WRITE 12
#define CMD_IRQ 0x101
#define CMD_HEARTBEAT 0x102
#define CMD_SYNC 0x106
#define CMD_DMA_READV 0x10A
#define CMD_DMA_WRITEV 0x10B
#define CMD_RING_WATCH 0x10C
#define CMD_DMA_PUSH 0x10D
#define READV_HEAD 8   /* ranges (u32), reserved (u32) */
#define READV_RANGE 16 /* address (u64), length (u32), reserved (u32) */
#define MAX_READV_RANGES 256
#define REGION_CONFIG 7
/* Posted writes the box may have queued before the forwarder waits for it to catch up (a
 * SYNC): PCIe's posted-write credits. Without them a fast host fills the box's socket with
 * writes and a read behind them waits out its completion timeout. */
#define POSTED_WINDOW 2048
#define POSTED_BYTES_WINDOW (4u << 20)
#define DMA_FLAG_READ 1
#define DMA_FLAG_WRITE 2
#define MAX_DATA (1u << 20)
#define MAX_VECTORS 2048

enum { WINDOW_MEMORY = 0, WINDOW_FD = 1, WINDOW_PYTHON = 2 };

/* Rings the box watches (link/protocol.py, RingWatch; Python takes the RING_WATCH and calls
 * set_ring): a posted 4-byte write of a new tail to the doorbell at (region, offset) is preceded
 * by a DMA_PUSH of the entries from the tail seen last, so the device's fetch of them waits for
 * no round trip. A forwarder that did not see the doorbells before it (a new QEMU session on
 * the same link) starts unsynced: its first push is empty, which makes the box forget. */
#define MAX_RING_SLOTS 64
#define MAX_RING_ENTRIES (1u << 16)
#define MAX_ENTRY_SIZE 4096u
#define MAX_PUSH_BYTES (512u << 10)
#define PUSH_HEAD 8 /* slot (u32), ranges (u32), then DMA_READV's ranges and the bytes */
/* What a watched ring's entries point to (RingWatch.pointer_bytes: an NVMe command's PRP list)
 * travels in the same push: a range of kind RANGE_POINTED per entry with a pointer, empty where
 * it cannot be read; more than MAX_POINTED of them, and the push says POINTED_UNKNOWN instead. */
#define POINTED_PAGE 4096u
#define MAX_POINTED 64
#define RANGE_RING 0u
#define RANGE_POINTED 1u
#define POINTED_UNKNOWN (1u << 31)
typedef struct {
    uint64_t offset, base;
    uint32_t region, entry_size, entries, tail; /* entries 0: no ring in this slot */
    uint32_t pointer_offset, pointer_bytes;     /* pointer_bytes 0: the entries point to nothing pushed */
    int synced; /* tail is the last doorbell's: else the next push is empty (the box forgets) */
    /* RingWatch.shadow: the driver's shadow doorbell (u32 tail) and the device's event index;
     * 0: none. A doorbell then carries the shadow's tail, and a box write of the event index
     * makes us read the shadow again and ring for the device if it moved (shadow_doorbells). */
    uint64_t shadow, event;
} ring_t;

typedef struct {
    uint64_t iova, size, offset; /* offset: of iova in the mapping (MEMORY) or the file (FD) */
    uint32_t flags;
    int kind;
    unsigned char *memory; /* a mapping that cannot shrink (a sealed memfd): memcpy */
    int fd;                /* a file that may: pread/pwrite, its size checked before a write */
} window_t;

typedef struct {
    PyObject_HEAD Stream *qemu;
    Stream *link;
    double completion_timeout;
    int64_t read_spin_ns;     /* the most a read's completion is spun for (0: never) */
    int64_t read_wait_avg_ns; /* recent reads' completion waits, averaged (1/8 per read) */
    window_t *windows; /* sorted by iova, not overlapping (DmaTable's invariant) */
    int n_windows;
    int msi[MAX_VECTORS], msix[MAX_VECTORS]; /* eventfds, -1: none */
    uint16_t next_id;
    int posted_since_sync;
    size_t posted_bytes_since_sync;
    unsigned char *dma_buf; /* a DMA_READ(V) completion read from a pread window: header + data */
    ring_t rings[MAX_RING_SLOTS];
    int n_rings;          /* slots in use: 0 skips the doorbell check */
    int n_shadows;        /* of them with a shadow doorbell: 0 skips the event index check */
    uint64_t shadow_due;  /* slots whose event index the box wrote: read their shadow next */
    unsigned long long pushes, push_bytes, pushes_empty, pointed, shadow_tails, shadow_doorbells;
    unsigned long long reads, writes_posted, writes_nonposted, dma_read_bytes, dma_write_bytes, dma_refused,
        irqs, bad_completions, to_python, read_wait_ns, write_wait_ns, syncs, error_completions, doorbells_merged,
        reads_spun;
} Forwarder;

static PyTypeObject ForwarderType;

/* --- one message from a stream, without Python ------------------------------------- */

/* Frame and send one message whose payload is `n` pieces (at most MAX_READV_RANGES + 1), written from
 * where they are: the stream stages the small ones, and a large one (a DMA read's 256 KiB of guest
 * memory) goes to TLS without a copy. The GIL is released for the write; guest memory read then stays
 * mapped, because windows are removed only on the session thread, which is the one running here. With
 * `hold` the TLS records stay in the stream's buffer and leave with the next send that does not hold
 * (a ring push and its doorbell: one write(2), one wake-up of the box's reader, not two). */
static int send_pieces_held(Stream *s, uint16_t id, uint16_t cmd, uint32_t flags, uint32_t error,
                            const struct iovec *iov, int n, int hold, char *err, size_t errlen)
{
    Py_buffer views[MAX_READV_RANGES + 1];
    parts_t p = {.count = 0, .total = 0};
    p.views = views; /* not Python buffers: never released */
    for (int i = 0; i < n; i++) {
        if (!iov[i].iov_len)
            continue;
        views[p.count].buf = iov[i].iov_base;
        views[p.count++].len = (Py_ssize_t)iov[i].iov_len;
        p.total += iov[i].iov_len;
    }
    unsigned char head[FRAME_HEADER_SIZE];
    frame_encode(head, id, cmd, (uint32_t)(FRAME_HEADER_SIZE + p.total), flags, error);
    int r;
    int64_t deadline = deadline_after(s->send_timeout);
    lock_released(&s->send_order);
    Py_BEGIN_ALLOW_THREADS
    r = write_parts_held(s, head, sizeof head, &p, deadline, err, errlen, hold);
    Py_END_ALLOW_THREADS
    pthread_mutex_unlock(&s->send_order);
    if (r == IO_TIMEOUT)
        snprintf(err, errlen, "send timed out: the peer does not read");
    if (!r) {
        s->bytes_out += FRAME_HEADER_SIZE + p.total;
        s->messages_out++;
    }
    return r ? -1 : 0;
}

static int send_pieces(Stream *s, uint16_t id, uint16_t cmd, uint32_t flags, uint32_t error, const struct iovec *iov,
                       int n, char *err, size_t errlen)
{
    return send_pieces_held(s, id, cmd, flags, error, iov, n, 0, err, errlen);
}

static int send_frame(Stream *s, uint16_t id, uint16_t cmd, uint32_t flags, uint32_t error, const void *a,
                      size_t alen, const void *b, size_t blen, char *err, size_t errlen)
{
    struct iovec iov[2] = {{(void *)a, alen}, {(void *)b, blen}};
    return send_pieces(s, id, cmd, flags, error, iov, 2, err, errlen);
}

static inline uint64_t le64(const unsigned char *p)
{
    return (uint64_t)frame_le32(p) | (uint64_t)frame_le32(p + 4) << 32;
}

/* The window holding [addr, addr+len) whole, with `need` rights, or NULL. */
static const window_t *find_window(const Forwarder *f, uint64_t addr, uint64_t len, uint32_t need)
{
    int lo = 0, hi = f->n_windows - 1;
    while (lo <= hi) {
        int mid = (lo + hi) / 2;
        const window_t *w = &f->windows[mid];
        if (addr < w->iova)
            hi = mid - 1;
        else if (addr - w->iova >= w->size)
            lo = mid + 1;
        else
            return (len <= w->size - (addr - w->iova) && (w->flags & need) == need) ? w : NULL;
    }
    return NULL;
}

/* --- the box's messages ----------------------------------------------------------------- */

enum { HANDLED = 0, TO_PYTHON = 1, BROKEN = -1 };

/* The windows of a DMA_READV/DMA_WRITEV's `count` ranges (their layout: link/protocol.py),
 * each NULL where the range is outside the windows or their `need` rights (*refused set),
 * and their *total. Nonzero (leave it to Python, which says why) for an empty or wrapping
 * range, more than MAX_DATA in all, or a window Python serves. */
static int scatter_windows(const Forwarder *f, const unsigned char *pl, uint32_t count, uint32_t need,
                           const window_t **ws, uint64_t *total, int *refused)
{
    for (uint32_t i = 0; i < count; i++) {
        const unsigned char *r = pl + READV_HEAD + (size_t)i * READV_RANGE;
        uint64_t addr = le64(r), n = frame_le32(r + 8);
        if (n == 0 || addr + n < addr)
            return 1;
        *total += n;
        if (*total > MAX_DATA)
            return 1;
        ws[i] = find_window(f, addr, n, need);
        if (ws[i] && ws[i]->kind == WINDOW_PYTHON)
            return 1;
        *refused |= ws[i] == NULL;
    }
    return 0;
}

/* A DMA_READV (link/protocol.py, unpack_readv): a scatter list answered with its bytes back
 * to back in one completion. Checked whole before anything is read (the same checks as
 * Python's, whose error replies serve what is malformed); one range outside the windows or
 * their rights refuses the request (EFAULT), as a DMA_READ of it would. */
static int dma_readv(Forwarder *f, const frame_header *hdr, const unsigned char *pl, size_t len, char *err,
                     size_t errlen)
{
    if ((hdr->flags & FRAME_NO_REPLY) || len < READV_HEAD)
        return TO_PYTHON;
    uint32_t count = frame_le32(pl);
    if (count == 0 || count > MAX_READV_RANGES || len != READV_HEAD + (size_t)count * READV_RANGE)
        return TO_PYTHON;
    const window_t *ws[MAX_READV_RANGES];
    uint64_t total = 0;
    int refused = 0;
    if (scatter_windows(f, pl, count, DMA_FLAG_READ, ws, &total, &refused))
        return TO_PYTHON;
    struct iovec iov[MAX_READV_RANGES];
    int copied = 0; /* a window reached by pread: the ranges go through dma_buf */
    for (uint32_t i = 0; i < count && !refused; i++)
        copied |= ws[i]->kind != WINDOW_MEMORY;
    size_t at = 0;
    for (uint32_t i = 0; i < count && !refused; i++) {
        const unsigned char *r = pl + READV_HEAD + (size_t)i * READV_RANGE;
        uint64_t addr = le64(r), n = frame_le32(r + 8);
        const window_t *w = ws[i];
        ssize_t got = (ssize_t)n;
        if (!copied) {
            iov[i] = (struct iovec){w->memory + w->offset + (addr - w->iova), n};
        } else if (w->kind == WINDOW_MEMORY) {
            memcpy(f->dma_buf + at, w->memory + w->offset + (addr - w->iova), n);
        } else {
            Py_BEGIN_ALLOW_THREADS
            got = pread(w->fd, f->dma_buf + at, n, (off_t)(w->offset + (addr - w->iova)));
            Py_END_ALLOW_THREADS
        }
        refused |= got != (ssize_t)n; /* the file shrank */
        at += n;
    }
    if (refused) {
        f->dma_refused++;
        return send_frame(f->link, hdr->msg_id, CMD_DMA_READV, FRAME_TYPE_REPLY | FRAME_ERROR, EFAULT, NULL, 0,
                          NULL, 0, err, errlen) ? BROKEN : HANDLED;
    }
    f->dma_read_bytes += total;
    if (!copied) /* straight from guest memory into TLS: no gather copy */
        return send_pieces(f->link, hdr->msg_id, CMD_DMA_READV, FRAME_TYPE_REPLY, 0, iov, (int)count, err,
                           errlen) ? BROKEN : HANDLED;
    return send_frame(f->link, hdr->msg_id, CMD_DMA_READV, FRAME_TYPE_REPLY, 0, f->dma_buf, total, NULL, 0,
                      err, errlen) ? BROKEN : HANDLED;
}

/* The box wrote [addr, addr+n): a watched ring whose event index lies in it has its shadow
 * read after this message (shadow_doorbells): the device may have gone idle. */
static void note_event_write(Forwarder *f, uint64_t addr, uint64_t n)
{
    if (!f->n_shadows)
        return;
    for (int slot = 0; slot < MAX_RING_SLOTS; slot++) {
        const ring_t *r = &f->rings[slot];
        if (r->entries && r->event && r->event < addr + n && addr < r->event + 4)
            f->shadow_due |= 1ull << slot;
    }
}

/* Write n bytes at addr of a window (checked by the caller): a copy into a mapping, or a
 * pwrite that never grows the client's file. True if all of it was written. */
static int window_write(const window_t *w, uint64_t addr, const unsigned char *data, uint64_t n)
{
    off_t at = (off_t)(w->offset + (addr - w->iova));
    if (w->kind == WINDOW_MEMORY) {
        memcpy(w->memory + at, data, n);
        return 1;
    }
    ssize_t done = -1;
    struct stat st; /* a pwrite past the end would grow the client's file */
    Py_BEGIN_ALLOW_THREADS
    if (fstat(w->fd, &st) == 0 && (uint64_t)st.st_size >= (uint64_t)at + n)
        done = pwrite(w->fd, data, n, at);
    Py_END_ALLOW_THREADS
    return done == (ssize_t)n;
}

/* A DMA_WRITEV (link/protocol.py, unpack_writev): posted, a scatter list and its bytes.
 * Checked whole before anything is written (the same checks as Python's, which drops
 * what is malformed with its reason); one range outside the windows or their rights drops
 * the whole message, counted in dma_refused (posted: the box is not told). */
static int dma_writev(Forwarder *f, const frame_header *hdr, const unsigned char *pl, size_t len)
{
    if (!(hdr->flags & FRAME_NO_REPLY) || len < READV_HEAD)
        return TO_PYTHON;
    uint32_t count = frame_le32(pl);
    size_t head = READV_HEAD + (size_t)count * READV_RANGE;
    if (count == 0 || count > MAX_READV_RANGES || len < head)
        return TO_PYTHON;
    const window_t *ws[MAX_READV_RANGES];
    uint64_t total = 0;
    int refused = 0;
    if (scatter_windows(f, pl, count, DMA_FLAG_WRITE, ws, &total, &refused))
        return TO_PYTHON;
    if (len - head != total)
        return TO_PYTHON;
    if (refused) {
        f->dma_refused++;
        return HANDLED;
    }
    const unsigned char *data = pl + head;
    for (uint32_t i = 0; i < count; i++) {
        const unsigned char *r = pl + READV_HEAD + (size_t)i * READV_RANGE;
        uint64_t addr = le64(r), n = frame_le32(r + 8);
        if (window_write(ws[i], addr, data, n)) {
            f->dma_write_bytes += n;
            note_event_write(f, addr, n);
        } else
            f->dma_refused++; /* the file shrank */
        data += n;
    }
    return HANDLED;
}

/* The slot of the watched ring whose doorbell QEMU's write `pl` (a REGION_WRITE payload)
 * writes, or -1. */
static int watched_slot(const Forwarder *f, const unsigned char *pl)
{
    uint64_t offset = le64(pl);
    uint32_t region = frame_le32(pl + 8);
    for (int slot = 0; slot < MAX_RING_SLOTS; slot++) {
        const ring_t *r = &f->rings[slot];
        if (r->entries && r->region == region && r->offset == offset)
            return slot;
    }
    return -1;
}

/* Is QEMU's posted write `pl` (4 bytes) a watched ring's doorbell, and `next` (the message
 * after it, already buffered) a posted 4-byte write of the same doorbell? Then `pl` need not
 * go: a ring's doorbell carries its tail, the next one's push announces every entry from the
 * tail pushed last (this one's too), and a device takes the entries up to the newest tail
 * either way (RING_WATCH's contract, docs/link-protocol.md). A burst of doorbells is one push
 * and one doorbell on the link, one of each for the box's reader to take. */
static int superseded_doorbell(const Forwarder *f, const unsigned char *pl, const frame_header *next_hdr,
                               const unsigned char *next_msg)
{
    if (next_hdr->command != CMD_REGION_WRITE || !(next_hdr->flags & FRAME_NO_REPLY) ||
        next_hdr->flags & FRAME_TYPE_REPLY || next_hdr->size != FRAME_HEADER_SIZE + 20u)
        return 0;
    const unsigned char *npl = next_msg + FRAME_HEADER_SIZE;
    if (frame_le32(npl + 12) != 4 || memcmp(pl, npl, 12)) /* offset, region */
        return 0;
    int slot = watched_slot(f, pl);
    return slot >= 0 && frame_le32(pl + 16) < f->rings[slot].entries; /* a tail past the ring goes on, to be refused */
}

static void put_range(unsigned char *range, uint64_t addr, uint32_t len, uint32_t kind)
{
    frame_put32(range, (uint32_t)addr);
    frame_put32(range + 4, (uint32_t)(addr >> 32));
    frame_put32(range + 8, len);
    frame_put32(range + 12, kind);
}

/* Guest bytes [addr, addr+len) inside one of QEMU's windows with read rights: a pointer into the
 * mapping, or into dma_buf at *at (a file's window: read there, *at advanced); NULL and *ok 0
 * where they cannot be read. */
static const unsigned char *window_bytes(Forwarder *f, uint64_t addr, uint64_t len, size_t *at, int *ok)
{
    const window_t *w = find_window(f, addr, len, DMA_FLAG_READ);
    if (!w || w->kind == WINDOW_PYTHON || (w->kind == WINDOW_FD && *at + len > MAX_DATA)) {
        *ok = 0;
        return NULL;
    }
    if (w->kind == WINDOW_MEMORY)
        return w->memory + w->offset + (addr - w->iova);
    unsigned char *to = f->dma_buf + *at;
    ssize_t got;
    Py_BEGIN_ALLOW_THREADS
    got = pread(w->fd, to, len, (off_t)(w->offset + (addr - w->iova)));
    Py_END_ALLOW_THREADS
    *ok = got == (ssize_t)len;
    *at += len;
    return to;
}

/* The pointed ranges of a push whose ring ranges are iov[1..ranges]: for each entry's non-null
 * pointer, up to pointer_bytes there, not past its 4 KiB page; an empty range where they cannot
 * be read (the box forgets that address). 0, or POINTED_UNKNOWN (nothing added) when there are
 * more than MAX_POINTED. The entries are read where the push reads them from, so the pointers
 * are the ones the box gets. */
static uint32_t push_pointed(Forwarder *f, const ring_t *r, unsigned char *head, struct iovec *iov, int *n,
                             uint32_t *ranges, uint64_t *total, size_t *at)
{
    uint64_t pointers[MAX_POINTED];
    int count = 0;
    for (uint32_t i = 0; i < *ranges; i++) {
        const unsigned char *entries = iov[1 + i].iov_base;
        for (size_t e = 0; e + r->entry_size <= iov[1 + i].iov_len; e += r->entry_size) {
            uint64_t p = le64(entries + e + r->pointer_offset);
            if (!p)
                continue;
            if (count == MAX_POINTED)
                return POINTED_UNKNOWN;
            pointers[count++] = p;
        }
    }
    for (int i = 0; i < count; i++) {
        uint64_t room = POINTED_PAGE - pointers[i] % POINTED_PAGE;
        uint64_t len = r->pointer_bytes < room ? r->pointer_bytes : room;
        int ok = pointers[i] + len > pointers[i]; /* not past 2^64 */
        const unsigned char *from = ok ? window_bytes(f, pointers[i], len, at, &ok) : NULL;
        if (!ok)
            len = 0; /* could not be read: the box forgets what it had there */
        put_range(head + PUSH_HEAD + *ranges * READV_RANGE, pointers[i], (uint32_t)len, RANGE_POINTED);
        iov[(*n)++] = (struct iovec){(void *)from, len};
        (*ranges)++;
        *total += len;
        f->pointed += len != 0;
    }
    return 0;
}

/* The tail in a ring's shadow doorbell, read from guest memory inside QEMU's windows; 0 where
 * it cannot be read or is past the ring (then nothing is taken from it). */
static int shadow_tail(Forwarder *f, const ring_t *r, uint32_t *tail)
{
    size_t at = 0;
    int ok = 1;
    const unsigned char *p = window_bytes(f, r->shadow, 4, &at, &ok);
    if (!ok)
        return 0;
    *tail = frame_le32(p);
    return *tail < r->entries;
}

/* Before QEMU's posted write `pl` (a REGION_WRITE payload of 4 bytes) goes to the box: if it
 * is a watched ring's doorbell, the entries it announces (from the tail seen last) go first as
 * a DMA_PUSH, from guest memory, inside QEMU's windows and their read rights; when they cannot
 * (too many, outside the windows, a tail past the ring) the push is empty and the box forgets
 * what it was pushed before, so it never serves entries it might not have fresh. Nothing is
 * sent for a doorbell that announces nothing new. The push is held in the stream's TLS buffer: the caller
 * sends the doorbell next, and both leave in one write. A ring with a shadow doorbell takes
 * its tail from the shadow, written into `pl` (the caller's copy, which it sends): the driver
 * writes the shadow before the register, so it is the newer, and the tails the box gets never
 * go back however QEMU's writes and our own doorbells interleave. 0, or -1 when the link failed. */
static int push_ring(Forwarder *f, unsigned char *pl, char *err, size_t errlen)
{
    int slot = watched_slot(f, pl);
    if (slot < 0)
        return 0;
    ring_t *r = &f->rings[slot];
    uint32_t shadow;
    if (r->shadow && shadow_tail(f, r, &shadow)) {
        frame_put32(pl + 16, shadow);
        f->shadow_tails++;
    }
    uint32_t tail = frame_le32(pl + 16);
    unsigned char head[PUSH_HEAD + (2 + MAX_POINTED) * READV_RANGE];
    struct iovec iov[3 + MAX_POINTED];
    int n = 1;
    uint32_t ranges = 0;
    uint64_t total = 0;
    size_t at = 0; /* of dma_buf: what came from files */
    if (tail < r->entries && !r->synced) {
        r->tail = tail;
        r->synced = 1;
    } else if (tail < r->entries) {
        uint32_t count = (tail + r->entries - r->tail) % r->entries;
        if (count == 0)
            return 0;
        uint32_t first = r->entries - r->tail < count ? r->entries - r->tail : count;
        uint64_t addr[2] = {r->base + (uint64_t)r->tail * r->entry_size, r->base};
        uint64_t size[2] = {(uint64_t)first * r->entry_size, (uint64_t)(count - first) * r->entry_size};
        int ok = size[0] + size[1] <= MAX_PUSH_BYTES;
        for (int i = 0; i < 2 && ok && size[i]; i++) {
            const unsigned char *from = window_bytes(f, addr[i], size[i], &at, &ok);
            unsigned char *range = head + PUSH_HEAD + ranges * READV_RANGE;
            put_range(range, addr[i], (uint32_t)size[i], RANGE_RING);
            iov[n++] = (struct iovec){(void *)from, size[i]};
            ranges++;
            total += size[i];
        }
        if (!ok) {
            n = 1;
            ranges = 0;
            total = 0;
        }
        r->tail = tail;
    }
    uint32_t unknown = ranges && r->pointer_bytes ? push_pointed(f, r, head, iov, &n, &ranges, &total, &at) : 0;
    frame_put32(head, slot);
    frame_put32(head + 4, ranges | unknown);
    iov[0] = (struct iovec){head, PUSH_HEAD + ranges * READV_RANGE};
    /* held: the doorbell, sent next by the caller, takes it along */
    if (send_pieces_held(f->link, (uint16_t)(0x8000 | (f->next_id++ & 0x7FFF)), CMD_DMA_PUSH, FRAME_NO_REPLY,
                         0, iov, n, 1, err, errlen))
        return -1;
    f->pushes++;
    f->push_bytes += total;
    f->pushes_empty += ranges == 0;
    f->posted_since_sync++;
    f->posted_bytes_since_sync += PUSH_HEAD + ranges * READV_RANGE + total;
    return 0;
}

/* After the box wrote the event index of rings with a shadow doorbell (note_event_write): the
 * device published the tail it has seen, and will not look again until a doorbell. The driver
 * writes the shadow, then reads the event index; we have written the event index, now read the
 * shadow: either the driver saw our index and rings, or we see its tail. If the shadow moved
 * past the tail sent last, its entries go to the box with a doorbell of ours, as QEMU's would.
 * Called between messages (a send may drain the link's receive buffer). 0, or -1 when the link
 * failed. */
static int shadow_doorbells(Forwarder *f, char *err, size_t errlen)
{
    uint64_t due = f->shadow_due;
    f->shadow_due = 0;
    for (int slot = 0; due; slot++, due >>= 1) {
        if (!(due & 1))
            continue;
        const ring_t *r = &f->rings[slot];
        uint32_t tail;
        if (!r->entries || !r->shadow || !shadow_tail(f, r, &tail) || (r->synced && tail == r->tail))
            continue;
        unsigned char db[20]; /* a REGION_WRITE payload: offset, region, count, the tail */
        frame_put32(db, (uint32_t)r->offset);
        frame_put32(db + 4, (uint32_t)(r->offset >> 32));
        frame_put32(db + 8, r->region);
        frame_put32(db + 12, 4);
        frame_put32(db + 16, tail);
        if (push_ring(f, db, err, errlen) ||
            send_frame(f->link, (uint16_t)(0x8000 | (f->next_id++ & 0x7FFF)), CMD_REGION_WRITE, FRAME_NO_REPLY, 0,
                       db, sizeof db, NULL, 0, err, errlen))
            return -1;
        f->shadow_doorbells++;
        f->posted_since_sync++;
        f->posted_bytes_since_sync += sizeof db;
    }
    return 0;
}

/* Watch ring `r` in `slot` (entries 0: stop): -1 (nothing changed) unless it is one the host can
 * watch (RingWatch.check's rules: whole entries of a size we push, a pointer inside an entry, a
 * shadow and an event index both or neither, dword aligned). The same ring watched again
 * (the box adds its shadow doorbell; the RING_WATCH we applied coming back through Python)
 * keeps the tail pushed last: going back to an older one would only push entries again. */
static int watch_ring(Forwarder *f, unsigned slot, const ring_t *r)
{
    if (slot >= MAX_RING_SLOTS ||
        (r->entries && (r->entry_size == 0 || r->entry_size > MAX_ENTRY_SIZE || r->entries > MAX_RING_ENTRIES ||
                        r->tail >= r->entries || r->base + (uint64_t)r->entries * r->entry_size < r->base)) ||
        (r->pointer_bytes && (r->pointer_bytes > POINTED_PAGE || (uint64_t)r->pointer_offset + 8 > r->entry_size)) ||
        ((r->shadow || r->event) && (!r->entries || !r->shadow || !r->event || r->shadow % 4 || r->event % 4 ||
                                     r->shadow > UINT64_MAX - 4 || r->event > UINT64_MAX - 4)))
        return -1;
    ring_t *old = &f->rings[slot];
    ring_t next = r->entries ? *r : (ring_t){0}; /* withdrawn: nothing else counts */
    if (next.entries && old->synced && old->region == r->region && old->offset == r->offset &&
        old->base == r->base && old->entry_size == r->entry_size && old->entries == r->entries &&
        old->pointer_offset == r->pointer_offset && old->pointer_bytes == r->pointer_bytes) {
        next.tail = old->tail;
        next.synced = 1;
    }
    f->n_rings += (next.entries != 0) - (old->entries != 0);
    f->n_shadows += (next.shadow != 0) - (old->shadow != 0);
    *old = next;
    f->shadow_due &= ~(1ull << slot);
    return 0;
}

/* A RING_WATCH (link/protocol.py, RingWatch): applied here at once, so that no DMA write the box
 * sends after it (its event index) is taken before it, and still handed to Python, which keeps
 * it for the forwarders of later QEMU sessions (and says why a bad one is refused). */
static int ring_watch_message(Forwarder *f, const unsigned char *pl, size_t len)
{
    if (len != 40 && len != 56)
        return TO_PYTHON;
    ring_t r = {.region = frame_le32(pl + 4), .offset = le64(pl + 8), .base = le64(pl + 16),
                .entry_size = frame_le32(pl + 24), .entries = frame_le32(pl + 28), .tail = frame_le32(pl + 32),
                .pointer_offset = frame_le32(pl + 36) & 0xFFFF, .pointer_bytes = frame_le32(pl + 36) >> 16,
                .synced = 1};
    if (len == 56) {
        r.shadow = le64(pl + 40);
        r.event = le64(pl + 48);
    }
    watch_ring(f, frame_le32(pl), &r);
    return TO_PYTHON;
}

/* Handle one message from the box in C if it is one of the hot ones. */
static int box_message(Forwarder *f, const frame_header *hdr, const unsigned char *msg, char *err, size_t errlen)
{
    const unsigned char *pl = msg + FRAME_HEADER_SIZE;
    size_t len = hdr->size - FRAME_HEADER_SIZE;
    if (hdr->flags & FRAME_TYPE_REPLY)
        return TO_PYTHON; /* a completion nobody here waits for: Python's endpoint knows */
    switch (hdr->command) {
    case CMD_HEARTBEAT:
        return HANDLED;
    case CMD_IRQ: {
        if (len < 12)
            return TO_PYTHON; /* Python rejects it with its reason */
        uint32_t kind = frame_le32(pl), vector = frame_le32(pl + 4);
        if ((kind != 1 && kind != 2) || vector >= MAX_VECTORS)
            return TO_PYTHON; /* INTx keeps its automask state in Python */
        int fd = kind == 1 ? f->msi[vector] : f->msix[vector];
        if (fd < 0)
            return TO_PYTHON; /* counted as dropped there */
        uint64_t one = 1;
        if (write(fd, &one, sizeof one) == sizeof one)
            f->irqs++;
        return HANDLED;
    }
    case CMD_DMA_WRITE: {
        if (len < 16 || !(hdr->flags & FRAME_NO_REPLY))
            return TO_PYTHON;
        uint64_t addr = le64(pl), count = le64(pl + 8) & 0xFFFFFFFFu;
        if (count > MAX_DATA || len != 16 + count)
            return TO_PYTHON;
        const window_t *w = find_window(f, addr, count, DMA_FLAG_WRITE);
        if (!w) { /* outside QEMU's windows or their rights: refused and counted */
            f->dma_refused++;
            return HANDLED;
        }
        if (w->kind == WINDOW_PYTHON)
            return TO_PYTHON;
        if (window_write(w, addr, pl + 16, count)) {
            f->dma_write_bytes += count;
            note_event_write(f, addr, count);
        } else
            f->dma_refused++; /* posted: the box is not told, like an unsupported request */
        return HANDLED;
    }
    case CMD_DMA_READ: {
        if (len < 16 || (hdr->flags & FRAME_NO_REPLY))
            return TO_PYTHON;
        uint64_t addr = le64(pl), count = le64(pl + 8) & 0xFFFFFFFFu;
        if (count > MAX_DATA)
            return TO_PYTHON;
        const window_t *w = find_window(f, addr, count, DMA_FLAG_READ);
        if (w && w->kind == WINDOW_PYTHON)
            return TO_PYTHON;
        ssize_t n = -1;
        const unsigned char *data = f->dma_buf + 16;
        if (w && w->kind == WINDOW_MEMORY) { /* sent from guest memory (send_pieces says why that is safe) */
            data = w->memory + w->offset + (addr - w->iova);
            n = (ssize_t)count;
        } else if (w) {
            Py_BEGIN_ALLOW_THREADS
            n = pread(w->fd, f->dma_buf + 16, count, (off_t)(w->offset + (addr - w->iova)));
            Py_END_ALLOW_THREADS
        }
        if (n != (ssize_t)count) { /* outside the windows, or the memfd shrank: EFAULT, counted */
            f->dma_refused++;
            return send_frame(f->link, hdr->msg_id, CMD_DMA_READ, FRAME_TYPE_REPLY | FRAME_ERROR, EFAULT, NULL, 0,
                              NULL, 0, err, errlen) ? BROKEN : HANDLED;
        }
        memcpy(f->dma_buf, pl, 8); /* address, then the count as the Python path packs it */
        frame_put32(f->dma_buf + 8, (uint32_t)count);
        frame_put32(f->dma_buf + 12, 0);
        f->dma_read_bytes += count;
        return send_frame(f->link, hdr->msg_id, CMD_DMA_READ, FRAME_TYPE_REPLY, 0, f->dma_buf, 16, data, count,
                          err, errlen) ? BROKEN : HANDLED;
    }
    case CMD_DMA_READV:
        return dma_readv(f, hdr, pl, len, err, errlen);
    case CMD_DMA_WRITEV:
        return dma_writev(f, hdr, pl, len);
    case CMD_RING_WATCH:
        return hdr->flags & FRAME_NO_REPLY ? ring_watch_message(f, pl, len) : TO_PYTHON;
    default:
        return TO_PYTHON;
    }
}

/* --- QEMU's region accesses ------------------------------------------------------------ */

static PyObject *result(const char *source, PyObject *what)
{
    if (!what)
        return NULL;
    return Py_BuildValue("(sN)", source, what);
}

/* Forward one REGION_READ/REGION_WRITE (non-posted) and answer QEMU; with qhdr NULL, send a
 * SYNC and wait for its completion (any, an error too: an old box answers ENOSYS, after
 * everything before it all the same). Returns NULL to go on, or what serve() must return. */
static PyObject *forward_nonposted_waiting(Forwarder *f, const frame_header *qhdr, const unsigned char *qmsg);

/* forward_nonposted_waiting, spinning for a read's completion while reads come back quickly
 * (see the top of this file); the stream's own spin_us is kept and comes back afterwards. */
static PyObject *forward_nonposted(Forwarder *f, const frame_header *qhdr, const unsigned char *qmsg)
{
    int64_t own = f->link->spin_ns;
    if (qhdr && qhdr->command == CMD_REGION_READ && f->read_spin_ns > own && f->read_wait_avg_ns <= f->read_spin_ns) {
        f->link->spin_ns = f->read_spin_ns;
        f->reads_spun++;
    }
    PyObject *out = forward_nonposted_waiting(f, qhdr, qmsg);
    f->link->spin_ns = own;
    return out;
}

static PyObject *forward_nonposted_waiting(Forwarder *f, const frame_header *qhdr, const unsigned char *qmsg)
{
    char err[256] = "";
    const unsigned char *qpl = qhdr ? qmsg + FRAME_HEADER_SIZE : NULL;
    size_t qlen = qhdr ? qhdr->size - FRAME_HEADER_SIZE : 0;
    uint32_t count = qhdr ? frame_le32(qpl + 12) : 0;
    int is_read = qhdr && qhdr->command == CMD_REGION_READ;
    /* a doorbell written non-posted announces its entries all the same (a copy: push_ring may
     * put the shadow's tail in it) */
    unsigned char db[20];
    if (qhdr && !is_read && f->n_rings && count == 4 && qlen == sizeof db) {
        memcpy(db, qpl, sizeof db);
        if (push_ring(f, db, err, sizeof err))
            return Py_BuildValue("(ss)", "link-closed", err);
        qpl = db;
    }
    uint16_t id = (uint16_t)(0x8000 | (f->next_id++ & 0x7FFF)); /* Python's own requests count from 1 */
    if (send_frame(f->link, id, qhdr ? qhdr->command : CMD_SYNC, 0, 0, qpl, is_read ? 16 : qlen, NULL, 0, err,
                   sizeof err))
        return Py_BuildValue("(ss)", "link-closed", err);
    f->posted_since_sync = 0; /* a completion means the box did everything before it */
    f->posted_bytes_since_sync = 0;
    int64_t sent = now_ns();
    int64_t deadline = deadline_after(f->completion_timeout);
    PyObject *deferred = NULL; /* box messages for Python meanwhile, in order */
    for (;;) {
        frame_header hdr;
        const unsigned char *msg;
        int got = next_message(f->link, deadline, &hdr, &msg, err, sizeof err);
        if (got <= 0) {
            PyObject *out;
            if (got == 0 && qhdr) {
                out = Py_BuildValue("(sNO)", "timeout", as_python(f->qemu, qhdr, qmsg), deferred ? deferred : Py_None);
                rx_consume(&f->qemu->rx, qhdr->size); /* Python answers it */
            } else if (got == 0) {
                out = Py_BuildValue("(sOO)", "timeout", Py_None, deferred ? deferred : Py_None);
            } else {
                out = Py_BuildValue("(ssO)", "link-closed", err, deferred ? deferred : Py_None);
            }
            Py_XDECREF(deferred);
            return out;
        }
        if ((hdr.flags & FRAME_TYPE_REPLY) && hdr.msg_id == id && !qhdr) { /* SYNC: any completion */
            rx_consume(&f->link->rx, hdr.size);
            f->link->messages_in++;
            f->syncs++;
            return deferred ? Py_BuildValue("(sN)", "link", deferred) : NULL;
        }
        if ((hdr.flags & FRAME_TYPE_REPLY) && hdr.msg_id == id) {
            const unsigned char *pl = msg + FRAME_HEADER_SIZE;
            size_t len = hdr.size - FRAME_HEADER_SIZE;
            uint32_t qflags = FRAME_TYPE_REPLY, qerror = 0;
            const unsigned char *body = pl;
            size_t body_len = len;
            if (hdr.flags & FRAME_ERROR) {
                qflags |= FRAME_ERROR;
                qerror = EINVAL; /* the box refused: as the Python path answers (ValueError) */
                body_len = 0;
                f->error_completions++; /* e.g. a completer abort */
            } else if (len != (is_read ? 16u + count : 16u) || memcmp(pl, qpl, 16) != 0) {
                /* not what was asked: never forwarded to QEMU, and a box that answers another
                 * access cannot be trusted with the next one. QEMU's message stays buffered:
                 * Python marks the link down and answers it (all-ones), as its own path does. */
                f->bad_completions++;
                rx_consume(&f->link->rx, hdr.size);
                f->link->messages_in++;
                PyObject *out = Py_BuildValue("(ssO)", "link-closed", "bad completion: the box answered another access",
                                              deferred ? deferred : Py_None);
                Py_XDECREF(deferred);
                return out;
            }
            int r = send_frame(f->qemu, qhdr->msg_id, qhdr->command, qflags, qerror, body, body_len, NULL, 0, err,
                               sizeof err);
            rx_consume(&f->link->rx, hdr.size);
            rx_consume(&f->qemu->rx, qhdr->size);
            f->link->messages_in++;
            f->qemu->messages_in++;
            if (is_read) {
                int64_t waited = now_ns() - sent;
                f->reads++;
                f->read_wait_ns += (unsigned long long)waited;
                f->read_wait_avg_ns += (waited - f->read_wait_avg_ns) / 8;
            } else {
                f->writes_nonposted++;
                f->write_wait_ns += (unsigned long long)(now_ns() - sent);
            }
            if (r) {
                Py_XDECREF(deferred);
                return Py_BuildValue("(ss)", "qemu-closed", err);
            }
            if (deferred)
                return Py_BuildValue("(sN)", "link", deferred);
            return NULL;
        }
        int h = box_message(f, &hdr, msg, err, sizeof err);
        if (h == BROKEN) {
            Py_XDECREF(deferred);
            return Py_BuildValue("(ss)", "link-closed", err);
        }
        if (h == TO_PYTHON) {
            if (!deferred && !(deferred = PyList_New(0)))
                return Py_BuildValue("(ss)", "error", "out of memory");
            PyObject *m = as_python(f->link, &hdr, msg);
            if (!m || PyList_Append(deferred, m) < 0) {
                Py_XDECREF(m);
                Py_DECREF(deferred);
                return NULL;
            }
            Py_DECREF(m);
            f->to_python++;
        }
        rx_consume(&f->link->rx, hdr.size);
        f->link->messages_in++;
        if (f->shadow_due && shadow_doorbells(f, err, sizeof err)) {
            PyObject *out = Py_BuildValue("(ssO)", "link-closed", err, deferred ? deferred : Py_None);
            Py_XDECREF(deferred);
            return out;
        }
    }
}

/* serve() -> (what, ...): runs until something needs Python:
 *   ("qemu", message)               a message from QEMU for the Python server
 *   ("link", [messages])            box messages for Python's link endpoint, in order
 *   ("timeout", message, [msgs]|None) no completion in time for this QEMU message (not answered)
 *   ("link-closed", reason[, msgs]) / ("qemu-closed", reason)
 */
static PyObject *Forwarder_serve(Forwarder *f, PyObject *unused)
{
    lock_released(&f->qemu->reader);
    lock_released(&f->link->reader);
    f->qemu->drain_on_send = f->link->drain_on_send = 1; /* this thread owns both receive sides */
    PyObject *out = NULL;
    char err[256] = "";
    while (!out) {
        frame_header hdr;
        const unsigned char *msg;
        if (f->shadow_due && shadow_doorbells(f, err, sizeof err)) { /* the box's last message asked */
            out = Py_BuildValue("(ss)", "link-closed", err);
            break;
        }
        /* the box first: what it sent before QEMU's next request goes first */
        if (rx_next(&f->link->rx, f->link->max_message, &hdr, &msg) == FRAME_OK) {
            int h = box_message(f, &hdr, msg, err, sizeof err);
            if (h == BROKEN) {
                out = Py_BuildValue("(ss)", "link-closed", err);
                break;
            }
            if (h == TO_PYTHON) {
                PyObject *m = as_python(f->link, &hdr, msg);
                out = m ? Py_BuildValue("(s[N])", "link", m) : NULL;
                if (!out)
                    break; /* the exception goes up; the message stays buffered */
                f->to_python++;
            }
            rx_consume(&f->link->rx, hdr.size);
            f->link->messages_in++;
            continue;
        }
        int st = rx_next(&f->qemu->rx, f->qemu->max_message, &hdr, &msg);
        if (st == FRAME_OK) {
            const unsigned char *pl = msg + FRAME_HEADER_SIZE;
            size_t len = hdr.size - FRAME_HEADER_SIZE;
            int region_access = !(hdr.flags & FRAME_TYPE_REPLY) && len >= 16 &&
                                (hdr.command == CMD_REGION_READ || hdr.command == CMD_REGION_WRITE);
            uint32_t count = region_access ? frame_le32(pl + 12) : 0;
            int well_formed = region_access && count <= MAX_DATA &&
                              (hdr.command == CMD_REGION_READ ? !(hdr.flags & FRAME_NO_REPLY) : len == 16u + count);
            int has_fds = f->qemu->fdq_len && f->qemu->fdq[0].pos == f->qemu->rx.start;
            int config_write = region_access && hdr.command == CMD_REGION_WRITE && frame_le32(pl + 8) == REGION_CONFIG;
            if (!well_formed || has_fds || config_write) { /* Python answers with its reasons (and closes fds) */
                out = result("qemu", as_python(f->qemu, &hdr, msg));
                if (out) {
                    rx_consume(&f->qemu->rx, hdr.size);
                    f->qemu->messages_in++;
                }
                break;
            }
            if (hdr.command == CMD_REGION_WRITE && (hdr.flags & FRAME_NO_REPLY)) {
                int may_be_doorbell = f->n_rings && count == 4;
                frame_header next_hdr;
                const unsigned char *next_msg;
                if (may_be_doorbell &&
                    rx_next_after(&f->qemu->rx, hdr.size, f->qemu->max_message, &next_hdr, &next_msg) == FRAME_OK &&
                    superseded_doorbell(f, pl, &next_hdr, next_msg)) { /* the next one announces it too */
                    rx_consume(&f->qemu->rx, hdr.size);
                    f->qemu->messages_in++;
                    f->writes_posted++;
                    f->doorbells_merged++;
                    continue;
                }
                unsigned char db[20]; /* a doorbell goes as push_ring leaves it (the shadow's tail) */
                if (may_be_doorbell && len == sizeof db) {
                    memcpy(db, pl, sizeof db);
                    pl = db;
                }
                if (may_be_doorbell && push_ring(f, db, err, sizeof err)) {
                    out = Py_BuildValue("(ss)", "link-closed", err);
                    rx_consume(&f->qemu->rx, hdr.size);
                    f->qemu->messages_in++;
                    break;
                }
                if (send_frame(f->link, (uint16_t)(0x8000 | (f->next_id++ & 0x7FFF)), CMD_REGION_WRITE,
                               FRAME_NO_REPLY, 0, pl, len, NULL, 0, err, sizeof err)) {
                    out = Py_BuildValue("(ss)", "link-closed", err); /* QEMU's write is dropped, as by Python */
                }
                rx_consume(&f->qemu->rx, hdr.size);
                f->qemu->messages_in++;
                f->writes_posted++;
                f->posted_bytes_since_sync += len;
                if (!out && (++f->posted_since_sync >= POSTED_WINDOW || f->posted_bytes_since_sync >= POSTED_BYTES_WINDOW)) {
                    out = forward_nonposted(f, NULL, NULL); /* wait for the box to catch up */
                    if (!out && PyErr_Occurred())
                        break;
                }
                continue;
            }
            out = forward_nonposted(f, &hdr, msg);
            if (!out && PyErr_Occurred())
                break;
            continue;
        }
        if (st != FRAME_NEED_MORE) {
            out = Py_BuildValue("(ss)", "qemu-closed", "QEMU sent bytes that are not a message");
            break;
        }
        /* nothing whole buffered: wait for either side (GIL released) */
        struct pollfd fds[2] = {{.fd = f->qemu->fd, .events = POLLIN}, {.fd = f->link->fd, .events = POLLIN}};
        int tls_pending = 0, r = 0;
        pthread_mutex_lock(&f->link->io);
        tls_pending = tls_has_pending(f->link);
        pthread_mutex_unlock(&f->link->io);
        if (!tls_pending) {
            int64_t spin = f->link->spin_ns;
            Py_BEGIN_ALLOW_THREADS
            if (spin_fds(fds, 2, spin, -1))
                r = 1;
            else
                do {
                    r = poll(fds, 2, -1);
                } while (r < 0 && errno == EINTR);
            Py_END_ALLOW_THREADS
            if (r < 0) {
                out = Py_BuildValue("(ss)", "qemu-closed", strerror(errno));
                break;
            }
        }
        if (tls_pending || fds[1].revents) {
            int got = next_message(f->link, deadline_after(0), &hdr, &msg, err, sizeof err);
            if (got < 0) {
                out = Py_BuildValue("(ss)", "link-closed", err);
                break;
            }
        }
        if (fds[0].revents) {
            int got = next_message(f->qemu, deadline_after(0), &hdr, &msg, err, sizeof err);
            if (got < 0) {
                out = Py_BuildValue("(ss)", "qemu-closed", err);
                break;
            }
        }
    }
    f->qemu->drain_on_send = f->link->drain_on_send = 0;
    pthread_mutex_unlock(&f->link->reader);
    pthread_mutex_unlock(&f->qemu->reader);
    return out;
}

/* set_windows([(iova, size, flags, kind, handle, offset), ...]) sorted by iova (DmaTable.
 * native_windows): handles are borrowed; a MEMORY window's pointer is taken from the mmap's
 * buffer and the buffer released at once (an export held would stop Python unmapping it):
 * the table is replaced, on the session thread, after every change and before C runs again. */
static PyObject *Forwarder_set_windows(Forwarder *f, PyObject *arg)
{
    PyObject *seq = PySequence_Fast(arg, "windows must be a sequence");
    if (!seq)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    window_t *w = n ? (window_t *)calloc((size_t)n, sizeof *w) : NULL;
    if (n && !w) {
        Py_DECREF(seq);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        unsigned long long iova, size, offset;
        unsigned int flags;
        int kind;
        PyObject *handle;
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(seq, i), "KKIiOK", &iova, &size, &flags, &kind, &handle,
                              &offset) ||
            (i && iova < w[i - 1].iova + w[i - 1].size) || size == 0 || iova + size < iova ||
            kind < WINDOW_MEMORY || kind > WINDOW_PYTHON) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_ValueError, "windows must be sorted, non-empty, apart and of a known kind");
            free(w);
            Py_DECREF(seq);
            return NULL;
        }
        w[i] = (window_t){.iova = iova, .size = size, .flags = flags, .kind = kind, .offset = offset, .fd = -1};
        if (kind == WINDOW_FD) {
            w[i].fd = (int)PyLong_AsLong(handle);
        } else if (kind == WINDOW_MEMORY) {
            Py_buffer view;
            if (PyObject_GetBuffer(handle, &view, PyBUF_SIMPLE) == 0) {
                if ((uint64_t)view.len < offset + size) {
                    PyErr_SetString(PyExc_ValueError, "a memory window larger than its mapping");
                } else {
                    w[i].memory = (unsigned char *)view.buf;
                }
                PyBuffer_Release(&view);
            }
        }
        if (PyErr_Occurred()) {
            free(w);
            Py_DECREF(seq);
            return NULL;
        }
    }
    Py_DECREF(seq);
    free(f->windows);
    f->windows = w;
    f->n_windows = (int)n;
    Py_RETURN_NONE;
}

/* set_irqs(msi_fds: dict[int, int], msix_fds: dict[int, int]): borrowed eventfds by vector. */
static PyObject *Forwarder_set_irqs(Forwarder *f, PyObject *args)
{
    PyObject *msi, *msix;
    if (!PyArg_ParseTuple(args, "O!O!", &PyDict_Type, &msi, &PyDict_Type, &msix))
        return NULL;
    int new_msi[MAX_VECTORS], new_msix[MAX_VECTORS];
    for (int i = 0; i < MAX_VECTORS; i++)
        new_msi[i] = new_msix[i] = -1;
    PyObject *tables[2] = {msi, msix};
    int *targets[2] = {new_msi, new_msix};
    for (int t = 0; t < 2; t++) {
        PyObject *key, *value;
        Py_ssize_t pos = 0;
        while (PyDict_Next(tables[t], &pos, &key, &value)) {
            long vector = PyLong_AsLong(key), fd = PyLong_AsLong(value);
            if (PyErr_Occurred())
                return NULL;
            if (vector < 0 || vector >= MAX_VECTORS || fd < 0) {
                PyErr_Format(PyExc_ValueError, "vector %ld / fd %ld", vector, fd);
                return NULL;
            }
            targets[t][vector] = (int)fd;
        }
    }
    memcpy(f->msi, new_msi, sizeof new_msi);
    memcpy(f->msix, new_msix, sizeof new_msix);
    Py_RETURN_NONE;
}

/* set_ring(slot, region, offset, base, entry_size, entries, tail[, pointer_offset, pointer_bytes[, shadow,
 * event]]): watch_ring from Python (a RingWatch it took, or one kept for a new forwarder). */
static PyObject *Forwarder_set_ring(Forwarder *f, PyObject *args)
{
    unsigned int slot, region, entry_size, entries, pointer_offset = 0, pointer_bytes = 0;
    unsigned long long offset, base, shadow = 0, event = 0;
    long long tail;
    if (!PyArg_ParseTuple(args, "IIKKIIL|IIKK", &slot, &region, &offset, &base, &entry_size, &entries, &tail,
                          &pointer_offset, &pointer_bytes, &shadow, &event))
        return NULL;
    ring_t r = {.region = region, .offset = offset, .base = base, .entry_size = entry_size, .entries = entries,
                .tail = tail < 0 ? 0 : (uint32_t)tail, .synced = tail >= 0, .pointer_offset = pointer_offset,
                .pointer_bytes = pointer_bytes, .shadow = shadow, .event = event};
    if (slot >= MAX_RING_SLOTS || (entries && tail >= (long long)entries) || watch_ring(f, slot, &r))
        return PyErr_Format(PyExc_ValueError, "ring %u: %u entries of %u bytes, tail %lld, pointer %u at %u, "
                            "shadow %#llx, event index %#llx", slot, entries, entry_size, tail, pointer_bytes,
                            pointer_offset, shadow, event);
    Py_RETURN_NONE;
}

static PyObject *Forwarder_counters(Forwarder *f, PyObject *unused)
{
    return Py_BuildValue("{sKsKsKsKsKsKsKsKsKsKsKsKsKsKsKsKsKsKsKsKsK}", "pushes", f->pushes, "push_bytes",
                         f->push_bytes, "pointed", f->pointed, "shadow_tails", f->shadow_tails,
                         "shadow_doorbells", f->shadow_doorbells,
                         "pushes_empty", f->pushes_empty, "reads", f->reads, "writes_posted", f->writes_posted,
                         "writes_nonposted", f->writes_nonposted, "dma_bytes_read", f->dma_read_bytes,
                         "dma_bytes_written", f->dma_write_bytes, "dma_refused", f->dma_refused, "irqs", f->irqs,
                         "bad_completions", f->bad_completions, "to_python", f->to_python, "read_wait_ns",
                         f->read_wait_ns, "write_wait_ns", f->write_wait_ns, "syncs", f->syncs,
                         "error_completions", f->error_completions, "doorbells_merged", f->doorbells_merged,
                         "reads_spun", f->reads_spun);
}

static int Forwarder_init(Forwarder *f, PyObject *args, PyObject *kwds)
{
    static char *kw[] = {"qemu", "link", "completion_timeout", "read_spin_us", NULL};
    Stream *qemu, *link;
    double timeout, read_spin_us = 0.0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O!O!d|d", kw, &StreamType, &qemu, &StreamType, &link, &timeout,
                                     &read_spin_us))
        return -1;
    if (!(read_spin_us >= 0.0 && read_spin_us <= 1e6)) {
        PyErr_SetString(PyExc_ValueError, "read_spin_us must be between 0 and 1e6");
        return -1;
    }
    if (!qemu->with_fds || link->with_fds) {
        PyErr_SetString(PyExc_ValueError, "Forwarder(qemu: a UNIX stream, link: a TCP stream, ...)");
        return -1;
    }
    if (!f->dma_buf && !(f->dma_buf = (unsigned char *)malloc(16 + MAX_DATA))) {
        PyErr_NoMemory();
        return -1;
    }
    Py_INCREF(qemu);
    Py_INCREF(link);
    Py_XSETREF(f->qemu, qemu);
    Py_XSETREF(f->link, link);
    f->completion_timeout = timeout;
    f->read_spin_ns = (int64_t)(read_spin_us * 1000.0);
    f->read_wait_avg_ns = 0; /* the first reads spin: nothing says they will be slow */
    for (int i = 0; i < MAX_VECTORS; i++)
        f->msi[i] = f->msix[i] = -1;
    return 0;
}

static void Forwarder_dealloc(Forwarder *f)
{
    Py_XDECREF(f->qemu);
    Py_XDECREF(f->link);
    free(f->windows);
    free(f->dma_buf);
    Py_TYPE(f)->tp_free((PyObject *)f);
}

static PyMethodDef Forwarder_methods[] = {
    {"serve", (PyCFunction)Forwarder_serve, METH_NOARGS, "Forward until something needs Python (see forward.c)."},
    {"set_windows", (PyCFunction)Forwarder_set_windows, METH_O,
     "set_windows([(iova, size, flags, fd, file_offset)]): QEMU's DMA windows, sorted; fds borrowed."},
    {"set_irqs", (PyCFunction)Forwarder_set_irqs, METH_VARARGS,
     "set_irqs(msi: {vector: eventfd}, msix: {vector: eventfd}): borrowed eventfds."},
    {"set_ring", (PyCFunction)Forwarder_set_ring, METH_VARARGS,
     "set_ring(slot, region, offset, base, entry_size, entries, tail[, pointer_offset, pointer_bytes[, shadow, "
     "event]]): push a ring's entries with its doorbell (and read its shadow doorbell for the box)."},
    {"counters", (PyCFunction)Forwarder_counters, METH_NOARGS, "What was forwarded in C."},
    {NULL},
};

static PyTypeObject ForwarderType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "dxpu_vfio.native._fastlink.Forwarder",
    .tp_basicsize = sizeof(Forwarder),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Forwarder(qemu, link, completion_timeout, read_spin_us=0): the host proxy's hot path (forward.c).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Forwarder_init,
    .tp_dealloc = (destructor)Forwarder_dealloc,
    .tp_methods = Forwarder_methods,
};
