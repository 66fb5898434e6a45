/* dxpu_vfio.native._fastlink: message framing and TLS in C (docs/link-protocol.md, "Native stream").
 *
 * Why it exists: on these machines every Python layer between a link message and the
 * socket (ssl.SSLSocket, the stream's locks and polls, the buffer bookkeeping, the header
 * dataclass) costs microseconds, and a register read crosses them four times. Here one call
 * sends a whole framed message and one call returns the next whole message, with the GIL
 * released while they wait. What a message means stays in Python.
 *
 * Invariants (the same as dxpu_vfio/link/stream.py, which is the reference and fallback):
 *  - OpenSSL allows one call into an SSL object at a time: every SSL_* call on the stream is
 *    made holding `io`, and a thread that must wait for the socket waits in poll() without it,
 *    so a reader waiting for bytes never blocks a writer and the other way round;
 *  - whole messages are sent holding `send_order`, so messages of different threads never
 *    interleave; one thread receives at a time (`reader`);
 *  - a length from the peer is checked (frame.h) before anything is allocated for it;
 *  - every wait is bounded by the caller's timeout (None: for ever), sends included.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <fcntl.h>
#include <openssl/err.h>
#include <openssl/ssl.h>
#include <openssl/x509.h>
#include <poll.h>
#include <sched.h>
#include <pthread.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "frame.h"

#define RX_INITIAL (256 * 1024)
#define TX_STAGE (64 * 1024)
#define READ_AHEAD_BYTES (64 * 1024)

static PyObject *ClosedError;   /* the peer closed the stream, or it failed */
static PyObject *BadFrameError; /* the peer sent bytes that are not a message: the stream is lost */
static PyObject *TlsError;      /* the TLS handshake failed */

/* --- time and waiting ------------------------------------------------------------- */

static int64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static int64_t deadline_after(double timeout)
{
    return timeout < 0 ? -1 : now_ns() + (int64_t)(timeout * 1e9);
}

/* Busy-poll `fds` for up to spin_ns before a caller sleeps in poll(): a reply that comes
 * within the spin costs no wake-up (two context switches and the scheduler's latency), at
 * the price of the CPU spun. Each empty poll yields the CPU: the thread that will send the
 * reply (the box's reader, on a machine it shares) may have been woken onto this one, and a
 * spinner that kept it would delay what it waits for (without the yield, 2 of 7 A/B pairs of
 * remote reads were slower with the spin than without). 1: something is ready now. */
static int spin_fds(struct pollfd *fds, nfds_t n, int64_t spin_ns, int64_t deadline)
{
    if (spin_ns <= 0)
        return 0;
    int64_t until = now_ns() + spin_ns;
    if (deadline >= 0 && deadline < until)
        until = deadline;
    do {
        if (poll(fds, n, 0) > 0)
            return 1;
        sched_yield();
    } while (now_ns() < until);
    return 0;
}

/* 1: one of `fds` is ready (see their revents), 0: deadline passed, -1: poll failed (errno). */
static int wait_fds(struct pollfd *fds, nfds_t n, int64_t deadline)
{
    for (;;) {
        int ms = -1;
        if (deadline >= 0) {
            int64_t left = deadline - now_ns();
            if (left <= 0)
                return 0;
            ms = (int)((left + 999999) / 1000000);
        }
        int r = poll(fds, n, ms);
        if (r > 0)
            return 1;
        if (r < 0 && errno != EINTR)
            return -1;
        if (r == 0 && deadline >= 0 && now_ns() >= deadline)
            return 0;
    }
}

/* 1: ready, 0: deadline passed, -1: poll failed (errno). */
static int wait_fd(int fd, short events, int64_t deadline)
{
    struct pollfd p = {.fd = fd, .events = events};
    return wait_fds(&p, 1, deadline);
}

/* 1: ready, 0: deadline passed, -1: poll failed (errno). Spins spin_ns first (see spin_fds). */
static int wait_fd_spin(int fd, short events, int64_t deadline, int64_t spin_ns)
{
    struct pollfd p = {.fd = fd, .events = events};
    return spin_fds(&p, 1, spin_ns, deadline) ? 1 : wait_fd(fd, events, deadline);
}

/* --- TlsContext --------------------------------------------------------------------- */

typedef struct {
    PyObject_HEAD SSL_CTX *ctx;
    int server;
} TlsContext;

static void set_ssl_error(PyObject *type, const char *what)
{
    unsigned long e = ERR_get_error();
    char buf[256] = "no detail";
    if (e)
        ERR_error_string_n(e, buf, sizeof buf);
    ERR_clear_error();
    PyErr_Format(type, "%s: %s", what, buf);
}

static int TlsContext_init(TlsContext *self, PyObject *args, PyObject *kwds)
{
    static char *kw[] = {"ca", "cert", "key", "server", NULL};
    const char *ca, *cert, *key;
    int server;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "sssp", kw, &ca, &cert, &key, &server))
        return -1;
    SSL_CTX *ctx = SSL_CTX_new(server ? TLS_server_method() : TLS_client_method());
    if (!ctx) {
        set_ssl_error(PyExc_OSError, "SSL_CTX_new");
        return -1;
    }
    /* mutual TLS 1.3 with the pool's CA as the trust root; names are not checked (boxes move
     * between addresses), exactly like transport.server_context/client_context */
    SSL_CTX_set_min_proto_version(ctx, TLS1_3_VERSION);
    SSL_CTX_set_mode(ctx, SSL_MODE_ENABLE_PARTIAL_WRITE | SSL_MODE_ACCEPT_MOVING_WRITE_BUFFER);
    /* Read ahead: one read(2) takes whatever records are there (up to the buffer), instead of
     * a 5-byte record header, then its body, then an EAGAIN: three system calls per message.
     * Bytes read ahead are invisible to poll(2), so every wait on the fd first asks
     * tls_has_pending (SSL_has_pending: processed or not, unless they are only part of a record),
     * never SSL_pending (processed only). */
    SSL_CTX_set_read_ahead(ctx, 1);
    SSL_CTX_set_default_read_buffer_len(ctx, READ_AHEAD_BYTES);
    if (server)
        SSL_CTX_set_num_tickets(ctx, 0); /* links are not resumed: no tickets to read or write */
    if (SSL_CTX_use_certificate_chain_file(ctx, cert) != 1 ||
        SSL_CTX_use_PrivateKey_file(ctx, key, SSL_FILETYPE_PEM) != 1 || SSL_CTX_check_private_key(ctx) != 1 ||
        SSL_CTX_load_verify_locations(ctx, ca, NULL) != 1) {
        SSL_CTX_free(ctx);
        set_ssl_error(PyExc_ValueError, "loading the certificate, key or CA");
        return -1;
    }
    SSL_CTX_set_verify(ctx, SSL_VERIFY_PEER | SSL_VERIFY_FAIL_IF_NO_PEER_CERT, NULL);
    if (self->ctx)
        SSL_CTX_free(self->ctx);
    self->ctx = ctx;
    self->server = server;
    return 0;
}

static void TlsContext_dealloc(TlsContext *self)
{
    if (self->ctx)
        SSL_CTX_free(self->ctx);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyTypeObject TlsContextType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "dxpu_vfio.native._fastlink.TlsContext",
    .tp_basicsize = sizeof(TlsContext),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "TlsContext(ca, cert, key, server): mutual TLS 1.3 settings for link streams.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)TlsContext_init,
    .tp_dealloc = (destructor)TlsContext_dealloc,
};

/* --- Stream ------------------------------------------------------------------------- */

typedef struct {
    unsigned long long count, ns;
} served_t;

#define MAX_FDS 16 /* per message, as vfio-user's max_msg_fds */
#define FDQ_LEN 8

/* Descriptors that came with a read, and where in the receive buffer that read began: they
 * belong to the message that starts there (the kernel never merges bytes carrying different
 * descriptors into one read, and senders pass a message's descriptors with its first byte). */
typedef struct {
    size_t pos;
    int count;
    int fds[MAX_FDS];
} fd_batch;

typedef struct {
    PyObject_HEAD int fd; /* owned; -1 once closed */
    SSL *ssl;             /* NULL: plain TCP */
    pthread_mutex_t io, send_order, reader;
    rxbuf rx;             /* under `reader` */
    unsigned char *tx;    /* staging for small parts, under `send_order` */
    uint32_t max_message;
    double send_timeout;  /* seconds; negative: for ever */
    volatile int shut;    /* shutdown() was called: every wait ends */
    int with_fds;         /* a UNIX socket: descriptors travel with messages (vfio-user to QEMU) */
    fd_batch fdq[FDQ_LEN]; /* descriptors from reads, by buffer position, under `reader` */
    int fdq_len;
    unsigned long long bytes_in, bytes_out, messages_in, messages_out;
    unsigned long long writes; /* write(2)s that sent bytes: what wakes the peer's reader, one each */
    unsigned long long seals;  /* SSL_write calls: each seals at least one TLS record, opened by the peer */
    volatile int64_t last_rx_ns; /* when bytes last came (CLOCK_MONOTONIC): the heartbeat's "heard" */
    int drain_on_send; /* the thread that sends also owns `reader` (the forwarder): see stream_write */
    served_t served[5]; /* serve_requests: REGION_READ, REGION_WRITE, SYNC, HEARTBEAT, DMA_PUSH */
    int64_t spin_ns;    /* adaptive polling: spin this long before sleeping for bytes (0: off) */
    /* The box's reader after it answered a register read (serve.c, under `reader`): spin up to
     * read_spin_ns for the next message while the average gap from such an answer to the next
     * message (read_gap_avg_ns, 1/8 weight) is within it; read_answered_ns: when the last
     * message served was a read, the time its answer left (0: it was not). */
    int64_t read_spin_ns, read_gap_avg_ns, read_answered_ns;
    unsigned long long reads_followed; /* read answers after which the reader was ready to spin
                                          (it spins only if the next message is not there) */
    int rx_starved;     /* under `io`: the last SSL_read wanted the socket, so what is buffered is part of
                           a record at most (tls_has_pending) */
    int corked;         /* posted messages of `corked_by` stay in the stream (Stream_cork), */
    pthread_t corked_by; /* under `send_order` */
    size_t held;        /* bytes at the start of `tx` that held sends left there, not yet given to TLS
                           (under `send_order`): the next send's stage begins after them */
    int serve_held;     /* under `reader`: threads that read the stream themselves (hold_serving): while
                           any does, a serve_requests that waits serves nothing (serve.c) */
} Stream;

#define RX_DRAIN_MAX (64u << 20) /* what a sender buffers from a peer that sends while not reading */

enum { IO_ERRNO = -3, IO_TIMEOUT = -2, IO_ERROR = -1, IO_EOF = 0 };

/* Bytes the TLS layer holds that a read can turn into data without the socket (`io` held).
 * Read ahead leaves them invisible to poll(2). But after an SSL_read that wanted the socket,
 * what is left is only the start of a record: asking SSL_has_pending alone would then spin on
 * reads that cannot finish (the forwarder did, 61 EAGAINs in a row while the box still wrote a
 * 256 KiB DMA write, on the CPU the box needed) instead of sleeping in poll(2). */
static int tls_has_pending(Stream *s)
{
    return s->ssl && s->fd >= 0 && !s->rx_starved && SSL_has_pending(s->ssl);
}

static void close_fds(const int *fds, int count)
{
    for (int i = 0; i < count; i++)
        close(fds[i]);
}

/* recvmsg into buf, queueing the descriptors that came with it at the buffer position of the
 * read's last byte (the caller reads into the room after s->rx.end). Linux glues bytes sent
 * without descriptors in front of a message that carries some into one read, and ends the
 * read with that message's bytes: its descriptors belong to the message holding the last
 * byte, not to the first one in the read. IO_ERRNO: see errno
 * (EAGAIN, EINTR, ...); IO_ERROR (errbuf): too many descriptors, or more messages with them read ahead than FDQ_LEN. */
static ssize_t recv_with_fds(Stream *s, unsigned char *buf, size_t len, char *errbuf, size_t errlen)
{
    union {
        char space[CMSG_SPACE(MAX_FDS * sizeof(int))];
        struct cmsghdr align;
    } control;
    struct iovec iov = {.iov_base = buf, .iov_len = len};
    struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = control.space,
                        .msg_controllen = sizeof control.space};
    ssize_t n = recvmsg(s->fd, &mh, MSG_CMSG_CLOEXEC);
    if (n < 0)
        return IO_ERRNO;
    fd_batch batch = {.pos = s->rx.end + (n > 0 ? (size_t)n - 1 : 0), .count = 0};
    for (struct cmsghdr *c = CMSG_FIRSTHDR(&mh); c; c = CMSG_NXTHDR(&mh, c)) {
        if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS)
            continue;
        int count = (int)((c->cmsg_len - CMSG_LEN(0)) / sizeof(int));
        const int *fds = (const int *)CMSG_DATA(c);
        for (int i = 0; i < count; i++) {
            if (batch.count < MAX_FDS)
                batch.fds[batch.count++] = fds[i];
            else
                close(fds[i]);
        }
    }
    if (mh.msg_flags & MSG_CTRUNC || (batch.count && (n == 0 || s->fdq_len == FDQ_LEN))) {
        close_fds(batch.fds, batch.count);
        if (mh.msg_flags & MSG_CTRUNC)
            snprintf(errbuf, errlen, "more than %d descriptors in one message", MAX_FDS);
        else if (n == 0)
            snprintf(errbuf, errlen, "descriptors without a message");
        else /* a sender waiting for room reads ahead (drain_some): a peer that never reads fills it */
            snprintf(errbuf, errlen, "more than %d messages with descriptors read ahead of the one being "
                     "handled: the peer sends without reading the replies", FDQ_LEN);
        return IO_ERROR;
    }
    if (batch.count)
        s->fdq[s->fdq_len++] = batch;
    s->last_rx_ns = now_ns();
    return n;
}

/* Read at least one byte into buf (GIL released by the caller). >0: bytes, IO_EOF, IO_ERROR
 * (errbuf says why), IO_TIMEOUT. */
static ssize_t stream_read(Stream *s, unsigned char *buf, size_t len, int64_t deadline, char *errbuf, size_t errlen)
{
    for (;;) {
        short events;
        pthread_mutex_lock(&s->io);
        if (s->fd < 0 || s->shut) {
            pthread_mutex_unlock(&s->io);
            return IO_EOF;
        }
        if (s->ssl) {
            size_t n = 0;
            ERR_clear_error();
            int r = SSL_read_ex(s->ssl, buf, len, &n);
            int e = r == 1 ? SSL_ERROR_NONE : SSL_get_error(s->ssl, r);
            s->rx_starved = e == SSL_ERROR_WANT_READ;
            if (r == 1) {
                pthread_mutex_unlock(&s->io);
                s->last_rx_ns = now_ns();
                return (ssize_t)n;
            }
            if (e == SSL_ERROR_WANT_READ) {
                events = POLLIN;
            } else if (e == SSL_ERROR_WANT_WRITE) {
                events = POLLOUT;
            } else {
                unsigned long code = ERR_get_error();
                if (e == SSL_ERROR_ZERO_RETURN || (e == SSL_ERROR_SYSCALL && errno == 0) ||
                    ERR_GET_REASON(code) == SSL_R_UNEXPECTED_EOF_WHILE_READING) {
                    pthread_mutex_unlock(&s->io);
                    return IO_EOF;
                }
                if (code)
                    ERR_error_string_n(code, errbuf, errlen);
                else
                    snprintf(errbuf, errlen, "TLS read failed: %s", strerror(errno));
                ERR_clear_error();
                pthread_mutex_unlock(&s->io);
                return IO_ERROR;
            }
        } else if (s->with_fds) {
            ssize_t n = recv_with_fds(s, buf, len, errbuf, errlen);
            if (n >= 0 || n == IO_ERROR) {
                pthread_mutex_unlock(&s->io);
                return n;
            }
            if (errno == EINTR) {
                pthread_mutex_unlock(&s->io);
                continue;
            }
            if (errno != EAGAIN) {
                snprintf(errbuf, errlen, "recvmsg: %s", strerror(errno));
                pthread_mutex_unlock(&s->io);
                return IO_ERROR;
            }
            events = POLLIN;
        } else {
            ssize_t n = recv(s->fd, buf, len, 0);
            if (n >= 0) {
                pthread_mutex_unlock(&s->io);
                s->last_rx_ns = now_ns();
                return n;
            }
            if (errno == EINTR) {
                pthread_mutex_unlock(&s->io);
                continue;
            }
            if (errno != EAGAIN) {
                snprintf(errbuf, errlen, "recv: %s", strerror(errno));
                pthread_mutex_unlock(&s->io);
                return IO_ERROR;
            }
            events = POLLIN;
        }
        int fd = s->fd;
        pthread_mutex_unlock(&s->io);
        int w = events == POLLIN ? wait_fd_spin(fd, events, deadline, s->spin_ns) : wait_fd(fd, events, deadline);
        if (w == 0)
            return IO_TIMEOUT;
        if (w < 0) {
            snprintf(errbuf, errlen, "poll: %s", strerror(errno));
            return IO_ERROR;
        }
    }
}

/* Room for `need` bytes from rx.start (moving the descriptors' positions with the bytes). */
static int rx_make_room(Stream *s, size_t need)
{
    size_t start_before = s->rx.start;
    if (rx_reserve(&s->rx, need, RX_INITIAL) < 0)
        return -1;
    for (int i = 0; i < s->fdq_len; i++)
        s->fdq[i].pos -= start_before - s->rx.start;
    return 0;
}

/* A sender waiting for room that owns the receive side reads what the peer sent meanwhile
 * into the receive buffer: two ends that both send without reading would otherwise wait on
 * each other for ever (the box sends DMA writes while we send it DMA read completions). */
static int drain_some(Stream *s, char *errbuf, size_t errlen)
{
    size_t unread = s->rx.end - s->rx.start;
    if (unread + 65536 > RX_DRAIN_MAX) {
        snprintf(errbuf, errlen, "peer sent %zu bytes without reading ours", unread);
        return IO_ERROR;
    }
    if (s->rx.cap - s->rx.end < 16384 && rx_make_room(s, unread + 65536) < 0) {
        snprintf(errbuf, errlen, "out of memory");
        return IO_ERROR;
    }
    ssize_t n = stream_read(s, s->rx.data + s->rx.end, s->rx.cap - s->rx.end, now_ns(), errbuf, errlen);
    if (n > 0) {
        s->rx.end += (size_t)n;
        s->bytes_in += (unsigned long long)n;
        return 0;
    }
    if (n == IO_TIMEOUT)
        return 0;
    if (n == IO_EOF)
        snprintf(errbuf, errlen, "peer closed the connection");
    return IO_ERROR;
}

/* A pass-sized send (a copy's 256 KiB DMA completion or write, an accelerator's input pushed
 * with its doorbell) leaves in slices of about SEND_SLICE: the peer opens the first records
 * while this end still seals the rest, instead of waiting for the whole buffer. Smaller sends
 * stay one write (a posted write's or a read's round trip gains nothing from a slice), and
 * larger ones (1 MiB bulk messages) fill the buffer BIO as before: more writes per byte there
 * cost more than the overlap gives (docs/benchmarks.md, Accelerator, eleventh session). */
#define SEND_SLICE (32u << 10)
#define SLICED_SEND_MIN (128u << 10)
#define SLICED_SEND_MAX (512u << 10)

/* Where the slice that begins at pos ends: SEND_SLICE on, unless less than that would be left
 * after it (then at len: no small last write). */
static size_t slice_after(size_t pos, size_t len)
{
    return len - pos >= 2 * (size_t)SEND_SLICE ? pos + SEND_SLICE : len;
}

/* Write all of buf (GIL released, send_order held by the caller); with `flush`, TLS records
 * still in the buffer BIO leave too (set_tls_bios): the end of a send. A pass-sized buf leaves
 * slice by slice (SEND_SLICE), whatever `flush` says. 0, IO_ERROR, IO_TIMEOUT. */
static int stream_write(Stream *s, const unsigned char *buf, size_t len, int flush, int64_t deadline, char *errbuf,
                        size_t errlen)
{
    size_t pos = 0;
    int flushed = s->ssl == NULL || !flush;
    /* the end of the bytes SSL_write takes before the buffer BIO is flushed: len but for a slice */
    size_t slice_end = s->ssl && len >= SLICED_SEND_MIN && len <= SLICED_SEND_MAX ? slice_after(0, len) : len;
    while (pos < len || !flushed) {
        short events;
        pthread_mutex_lock(&s->io);
        if (s->fd < 0 || s->shut) {
            pthread_mutex_unlock(&s->io);
            snprintf(errbuf, errlen, "stream shut down");
            return IO_ERROR;
        }
        if (s->ssl && pos == slice_end) { /* the records (of a slice) are written: out of the buffer BIO in one write */
            BIO *wbio = SSL_get_wbio(s->ssl);
            errno = 0;
            if (BIO_flush(wbio) > 0) {
                if (pos == len)
                    flushed = 1;
                else
                    slice_end = slice_after(pos, len);
                pthread_mutex_unlock(&s->io);
                continue;
            }
            if (!BIO_should_retry(wbio)) {
                snprintf(errbuf, errlen, "TLS write failed: %s", errno ? strerror(errno) : "peer closed");
                pthread_mutex_unlock(&s->io);
                return IO_ERROR;
            }
            events = POLLOUT;
        } else if (s->ssl) {
            size_t n = 0;
            ERR_clear_error();
            int r = SSL_write_ex(s->ssl, buf + pos, slice_end - pos, &n);
            if (r == 1) {
                pos += n;
                s->seals++;
                pthread_mutex_unlock(&s->io);
                continue;
            }
            int e = SSL_get_error(s->ssl, r);
            if (e == SSL_ERROR_WANT_WRITE) {
                events = POLLOUT;
            } else if (e == SSL_ERROR_WANT_READ) {
                events = POLLIN;
            } else {
                unsigned long code = ERR_get_error();
                if (code)
                    ERR_error_string_n(code, errbuf, errlen);
                else
                    snprintf(errbuf, errlen, "TLS write failed: %s", errno ? strerror(errno) : "peer closed");
                ERR_clear_error();
                pthread_mutex_unlock(&s->io);
                return IO_ERROR;
            }
        } else {
            ssize_t n = send(s->fd, buf + pos, len - pos, MSG_NOSIGNAL);
            if (n >= 0) {
                pos += (size_t)n;
                s->writes += n > 0;
                pthread_mutex_unlock(&s->io);
                continue;
            }
            if (errno == EINTR) {
                pthread_mutex_unlock(&s->io);
                continue;
            }
            if (errno != EAGAIN) {
                snprintf(errbuf, errlen, "send: %s", strerror(errno));
                pthread_mutex_unlock(&s->io);
                return IO_ERROR;
            }
            events = POLLOUT;
        }
        int fd = s->fd;
        pthread_mutex_unlock(&s->io);
        int w = wait_fd(fd, s->drain_on_send ? events | POLLIN : events, deadline);
        if (w == 0)
            return IO_TIMEOUT;
        if (w < 0) {
            snprintf(errbuf, errlen, "poll: %s", strerror(errno));
            return IO_ERROR;
        }
        if (s->drain_on_send && drain_some(s, errbuf, errlen))
            return IO_ERROR;
    }
    return 0;
}

/* Lock a mutex another thread may hold for long, without holding the GIL meanwhile. */
static void lock_released(pthread_mutex_t *m)
{
    if (pthread_mutex_trylock(m) == 0)
        return;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(m);
    Py_END_ALLOW_THREADS
}

static int handshake(Stream *s, int64_t deadline, char *errbuf, size_t errlen)
{
    for (;;) {
        ERR_clear_error();
        int r = SSL_do_handshake(s->ssl);
        if (r == 1)
            return 0;
        int e = SSL_get_error(s->ssl, r);
        short events;
        if (e == SSL_ERROR_WANT_READ) {
            events = POLLIN;
        } else if (e == SSL_ERROR_WANT_WRITE) {
            events = POLLOUT;
        } else {
            unsigned long code = ERR_get_error();
            if (code)
                ERR_error_string_n(code, errbuf, errlen);
            else
                snprintf(errbuf, errlen, "peer closed during the handshake");
            ERR_clear_error();
            return IO_ERROR;
        }
        int w = wait_fd(s->fd, events, deadline);
        if (w == 0) {
            snprintf(errbuf, errlen, "handshake timed out");
            return IO_TIMEOUT;
        }
        if (w < 0) {
            snprintf(errbuf, errlen, "poll: %s", strerror(errno));
            return IO_ERROR;
        }
    }
}

/* The TLS records of one send leave in one write(2), not one each: SSL writes through a
 * buffer BIO that stream_write flushes when the send is done (its `flush`). On veth every
 * write runs the peer's TCP receive in the sender's system call; a 256 KiB DMA completion
 * was 16 of them. Reads come straight from the socket (SSL's own read-ahead buffers them). */
#define TLS_WRITE_BUFFER (256u * 1024)

/* The socket BIO's callback: counts the write(2)s that sent bytes (Stream.writes). */
static long count_writes(BIO *b, int oper, const char *argp, size_t len, int argi, long argl, int ret,
                         size_t *processed)
{
    (void)argp, (void)len, (void)argi, (void)argl, (void)processed;
    if (oper == (BIO_CB_WRITE | BIO_CB_RETURN) && ret > 0)
        ++*(unsigned long long *)BIO_get_callback_arg(b);
    return ret;
}

static int set_tls_bios(SSL *ssl, int fd, unsigned long long *writes)
{
    BIO *rbio = BIO_new_socket(fd, BIO_NOCLOSE), *sock = BIO_new_socket(fd, BIO_NOCLOSE);
    BIO *buffer = BIO_new(BIO_f_buffer());
    if (!rbio || !sock || !buffer || BIO_set_write_buffer_size(buffer, TLS_WRITE_BUFFER) <= 0) {
        BIO_free(rbio);
        BIO_free(sock);
        BIO_free(buffer);
        return -1;
    }
    BIO_set_callback_ex(sock, count_writes);
    BIO_set_callback_arg(sock, (char *)writes);
    SSL_set_bio(ssl, rbio, BIO_push(buffer, sock)); /* the SSL owns both chains now */
    return 0;
}

static void stream_free_now(Stream *s)
{
    if (s->ssl) {
        SSL_free(s->ssl);
        s->ssl = NULL;
    }
    if (s->fd >= 0) {
        close(s->fd);
        s->fd = -1;
    }
}

static int Stream_init(Stream *self, PyObject *args, PyObject *kwds)
{
    static char *kw[] = {"fd", "tls", "max_message", "handshake_timeout", NULL};
    int fd;
    PyObject *tls = Py_None;
    unsigned int max_message = (1u << 20) + 4096;
    double handshake_timeout = 5.0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "i|OId", kw, &fd, &tls, &max_message, &handshake_timeout))
        return -1;
    if (tls != Py_None && !PyObject_TypeCheck(tls, &TlsContextType)) {
        PyErr_SetString(PyExc_TypeError, "tls must be a TlsContext or None");
        return -1;
    }
    if (max_message < FRAME_HEADER_SIZE) {
        PyErr_SetString(PyExc_ValueError, "max_message below the header size");
        return -1;
    }
    if (self->fd >= 0 || self->rx.data) {
        PyErr_SetString(PyExc_RuntimeError, "Stream already initialised");
        return -1;
    }
    self->fd = fd; /* owned from here on, whatever happens next (closed with the object) */
    int domain = 0;
    socklen_t domain_len = sizeof domain;
    if (getsockopt(fd, SOL_SOCKET, SO_DOMAIN, &domain, &domain_len) < 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    self->with_fds = domain == AF_UNIX;
    if (self->with_fds && tls != Py_None) {
        PyErr_SetString(PyExc_ValueError, "TLS on a UNIX socket");
        return -1;
    }
    int flags = fcntl(fd, F_GETFL);
    if (flags < 0 || fcntl(fd, F_SETFL, flags | O_NONBLOCK) < 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    self->rx.data = (unsigned char *)malloc(RX_INITIAL);
    self->tx = (unsigned char *)malloc(TX_STAGE);
    if (!self->rx.data || !self->tx) {
        PyErr_NoMemory();
        return -1;
    }
    self->rx.cap = RX_INITIAL;
    self->max_message = max_message;
    if (tls != Py_None) {
        TlsContext *ctx = (TlsContext *)tls;
        self->ssl = SSL_new(ctx->ctx);
        if (!self->ssl || set_tls_bios(self->ssl, fd, &self->writes) != 0) {
            set_ssl_error(TlsError, "SSL_new");
            return -1;
        }
        if (ctx->server)
            SSL_set_accept_state(self->ssl);
        else
            SSL_set_connect_state(self->ssl);
        char err[256] = "";
        int r;
        int64_t deadline = deadline_after(handshake_timeout);
        Py_BEGIN_ALLOW_THREADS
        r = handshake(self, deadline, err, sizeof err);
        Py_END_ALLOW_THREADS
        if (r != 0) {
            PyErr_Format(r == IO_TIMEOUT ? PyExc_TimeoutError : TlsError, "TLS handshake: %s", err);
            return -1;
        }
    }
    return 0;
}

static PyObject *Stream_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    Stream *self = (Stream *)type->tp_alloc(type, 0);
    if (!self)
        return NULL;
    self->fd = -1;
    self->send_timeout = -1.0;
    self->last_rx_ns = now_ns();
    pthread_mutex_init(&self->io, NULL);
    pthread_mutex_init(&self->send_order, NULL);
    pthread_mutex_init(&self->reader, NULL);
    return (PyObject *)self;
}

static void Stream_dealloc(Stream *self)
{
    stream_free_now(self); /* no thread is inside a method: each holds a reference */
    for (int i = 0; i < self->fdq_len; i++)
        close_fds(self->fdq[i].fds, self->fdq[i].count);
    self->fdq_len = 0;
    free(self->rx.data);
    free(self->tx);
    pthread_mutex_destroy(&self->io);
    pthread_mutex_destroy(&self->send_order);
    pthread_mutex_destroy(&self->reader);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static double timeout_arg(PyObject *obj, double none_value)
{
    if (obj == Py_None || obj == NULL)
        return none_value;
    double t = PyFloat_AsDouble(obj);
    if (t == -1.0 && PyErr_Occurred())
        return -2.0;
    return t < 0 ? 0 : t;
}

/* The message at msg with its descriptors as a 6-tuple: those of the first read whose last
 * byte lies in it (recv_with_fds); any other batch inside it (a sender that split one
 * message's descriptors over several sends) is closed. */
static PyObject *message_with_fds(Stream *self, const frame_header *hdr, const unsigned char *msg)
{
    size_t start = (size_t)(msg - self->rx.data), end = start + hdr->size;
    PyObject *fds = PyList_New(0);
    if (!fds)
        return NULL;
    int taken = 0, given = 0;
    while (taken < self->fdq_len && self->fdq[taken].pos < end) {
        fd_batch *b = &self->fdq[taken];
        int mine = b->pos >= start && !given;
        given |= mine;
        for (int i = 0; i < b->count; i++) {
            if (mine) {
                PyObject *fd = PyLong_FromLong(b->fds[i]);
                if (!fd || PyList_Append(fds, fd) < 0) {
                    Py_XDECREF(fd);
                    close_fds(b->fds + i, b->count - i);
                    b->count = 0;
                    break;
                }
                Py_DECREF(fd);
            } else {
                close(b->fds[i]);
            }
        }
        b->count = 0;
        taken++;
    }
    memmove(self->fdq, self->fdq + taken, (size_t)(self->fdq_len - taken) * sizeof(fd_batch));
    self->fdq_len -= taken;
    if (PyErr_Occurred()) {
        Py_DECREF(fds);
        return NULL;
    }
    PyObject *out = Py_BuildValue("(HHIIy#N)", hdr->msg_id, hdr->command, hdr->flags, hdr->error,
                                  (const char *)msg + FRAME_HEADER_SIZE, (Py_ssize_t)(hdr->size - FRAME_HEADER_SIZE),
                                  fds);
    return out;
}

enum { NEXT_CLOSED = -1, NEXT_BAD_FRAME = -2, NEXT_NO_MEMORY = -3 };

/* Wait (GIL released) until stream s has a whole message or the deadline passes. 1: there is
 * one (hdr, msg point into the receive buffer until rx_consume), 0: timeout, NEXT_CLOSED
 * (err says why), NEXT_BAD_FRAME (a size that cannot be a message: the stream is lost, err
 * says why), NEXT_NO_MEMORY. The caller holds s->reader. */
static int next_message(Stream *s, int64_t deadline, frame_header *hdr, const unsigned char **msg, char *err,
                        size_t errlen)
{
    for (;;) {
        int st = rx_next(&s->rx, s->max_message, hdr, msg);
        if (st == FRAME_OK)
            return 1;
        if (st != FRAME_NEED_MORE) {
            snprintf(err, errlen, "message size %u %s", hdr->size,
                     st == FRAME_TOO_SMALL ? "is smaller than its header" : "exceeds the stream's maximum");
            return NEXT_BAD_FRAME;
        }
        if (rx_make_room(s, rx_wanted(&s->rx, hdr, st)) < 0) {
            snprintf(err, errlen, "out of memory");
            return NEXT_NO_MEMORY;
        }
        ssize_t n;
        Py_BEGIN_ALLOW_THREADS
        n = stream_read(s, s->rx.data + s->rx.end, s->rx.cap - s->rx.end, deadline, err, errlen);
        Py_END_ALLOW_THREADS
        if (n > 0) {
            s->rx.end += (size_t)n;
            s->bytes_in += (unsigned long long)n;
            continue;
        }
        if (n == IO_TIMEOUT)
            return 0;
        if (n == IO_EOF)
            snprintf(err, errlen, "peer closed the connection");
        return NEXT_CLOSED;
    }
}

/* A message as Python sees it: (msg_id, command, flags, error, payload[, fds]). */
static PyObject *as_python(Stream *s, const frame_header *hdr, const unsigned char *msg)
{
    if (s->with_fds)
        return message_with_fds(s, hdr, msg);
    return Py_BuildValue("(HHIIy#)", hdr->msg_id, hdr->command, hdr->flags, hdr->error,
                         (const char *)msg + FRAME_HEADER_SIZE, (Py_ssize_t)(hdr->size - FRAME_HEADER_SIZE));
}

/* The exception for a failed next_message. */
static void raise_next_error(int got, const char *err)
{
    if (got == NEXT_NO_MEMORY)
        PyErr_NoMemory();
    else
        PyErr_SetString(got == NEXT_BAD_FRAME ? BadFrameError : ClosedError, err);
}

/* receive(timeout=None) -> (msg_id, command, flags, error, payload: bytes[, fds]) | None */
static PyObject *Stream_receive(Stream *self, PyObject *args, PyObject *kwds)
{
    static char *kw[] = {"timeout", NULL};
    PyObject *timeout_obj = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|O", kw, &timeout_obj))
        return NULL;
    double timeout = timeout_arg(timeout_obj, -1.0);
    if (timeout == -2.0)
        return NULL;
    frame_header hdr;
    const unsigned char *msg;
    char err[256] = "";
    PyObject *result = NULL;
    lock_released(&self->reader);
    int got = next_message(self, deadline_after(timeout), &hdr, &msg, err, sizeof err);
    if (got == 1) {
        result = as_python(self, &hdr, msg);
        if (result) {
            rx_consume(&self->rx, hdr.size);
            self->messages_in++;
        }
    } else if (got == 0) {
        Py_INCREF(Py_None); /* what arrived so far stays buffered */
        result = Py_None;
    } else {
        raise_next_error(got, err);
    }
    pthread_mutex_unlock(&self->reader);
    return result;
}

/* The parts of a message, held for the send: a few in place, more (a DMA_WRITEV's head and
 * its pages) in an array of their own. */
#define PARTS_INLINE 8
#define PARTS_MAX 1024
typedef struct {
    Py_buffer inline_views[PARTS_INLINE];
    Py_buffer *views;
    int count;
    size_t total;
} parts_t;

static void parts_release(parts_t *p)
{
    for (int i = 0; i < p->count; i++)
        PyBuffer_Release(&p->views[i]);
    p->count = 0;
    if (p->views && p->views != p->inline_views)
        PyMem_Free(p->views);
    p->views = p->inline_views;
}

static int parts_get(PyObject *payload, parts_t *p)
{
    p->count = 0;
    p->total = 0;
    p->views = p->inline_views;
    if (PyTuple_Check(payload)) {
        Py_ssize_t n = PyTuple_GET_SIZE(payload);
        if (n > PARTS_MAX) {
            PyErr_Format(PyExc_ValueError, "at most %d payload parts", PARTS_MAX);
            return -1;
        }
        if (n > PARTS_INLINE && !(p->views = PyMem_Calloc((size_t)n, sizeof(Py_buffer)))) {
            p->views = p->inline_views;
            PyErr_NoMemory();
            return -1;
        }
        for (Py_ssize_t i = 0; i < n; i++) {
            if (PyObject_GetBuffer(PyTuple_GET_ITEM(payload, i), &p->views[p->count], PyBUF_SIMPLE) < 0) {
                parts_release(p);
                return -1;
            }
            p->total += (size_t)p->views[p->count++].len;
        }
    } else {
        if (PyObject_GetBuffer(payload, &p->views[0], PyBUF_SIMPLE) < 0)
            return -1;
        p->count = 1;
        p->total = (size_t)p->views[0].len;
    }
    return 0;
}

/* Staged output: small pieces are gathered into one write (one TLS record, one segment),
 * large ones written from where they are, after what was staged before them. A stage begins
 * after what held sends left in `tx` (stage_begin), so those go first, whoever sends next. */
typedef struct {
    Stream *s;
    size_t staged;
    int64_t deadline;
    char *err;
    size_t errlen;
} stage_t;

/* A send's stage (send_order held): it takes over the bytes held sends left in `tx`. */
static stage_t stage_begin(Stream *s, int64_t deadline, char *err, size_t errlen)
{
    stage_t st = {.s = s, .staged = s->held, .deadline = deadline, .err = err, .errlen = errlen};
    s->held = 0;
    return st;
}

static int stage_put(stage_t *st, const unsigned char *data, size_t len)
{
    if (st->staged + len <= TX_STAGE) {
        memcpy(st->s->tx + st->staged, data, len);
        st->staged += len;
        return 0;
    }
    if (st->staged) {
        int r = stream_write(st->s, st->s->tx, st->staged, 0, st->deadline, st->err, st->errlen);
        st->staged = 0;
        if (r)
            return r;
    }
    if (len <= TX_STAGE) {
        memcpy(st->s->tx, data, len);
        st->staged = len;
        return 0;
    }
    return stream_write(st->s, data, len, 0, st->deadline, st->err, st->errlen);
}

static int stage_parts(stage_t *st, const unsigned char *head, size_t head_len, parts_t *p)
{
    int r = head_len ? stage_put(st, head, head_len) : 0;
    for (int i = 0; !r && i < p->count; i++)
        r = stage_put(st, (const unsigned char *)p->views[i].buf, (size_t)p->views[i].len);
    return r;
}

/* The end of a send: what is staged, and every TLS record of the send (and of the posted
 * messages held before it), leave now; unless `hold`: then what is staged stays in `tx` as
 * plaintext (records already made stay in the buffer BIO, which still writes out whenever it
 * fills) for the next send that does not hold. Held plaintext is what makes a corked run of
 * small messages (a command's data, its completion, the next command's...) one TLS record for
 * both ends to seal and open, not one per send. */
static int stage_end(stage_t *st, int hold)
{
    if (hold) {
        st->s->held = st->staged;
        st->staged = 0;
        return 0;
    }
    int r = stream_write(st->s, st->s->tx, st->staged, 1, st->deadline, st->err, st->errlen);
    st->staged = 0;
    return r;
}

/* A send of posted messages only, by the thread that corked the stream: held (send_order held). */
static int holds(Stream *s, int all_posted)
{
    return all_posted && s->corked && s->ssl && pthread_equal(s->corked_by, pthread_self());
}

/* Write a header (or nothing) and parts. GIL released by caller. */
static int write_parts_held(Stream *s, const unsigned char *head, size_t head_len, parts_t *p, int64_t deadline,
                            char *err, size_t errlen, int hold)
{
    stage_t st = stage_begin(s, deadline, err, errlen);
    int r = stage_parts(&st, head, head_len, p);
    return r ? r : stage_end(&st, hold);
}

static int write_parts(Stream *s, const unsigned char *head, size_t head_len, parts_t *p, int64_t deadline, char *err,
                       size_t errlen)
{
    return write_parts_held(s, head, head_len, p, deadline, err, errlen, 0);
}

/* A write's failure as the Python exception (TimeoutError, ClosedError): -1, else 0. */
static int write_failed(int r, const char *err)
{
    if (r == IO_TIMEOUT)
        PyErr_SetString(PyExc_TimeoutError, "link send timed out: the peer does not read");
    else if (r)
        PyErr_SetString(ClosedError, err);
    return r ? -1 : 0;
}

static PyObject *finish_send(Stream *self, int r, const char *err, size_t total)
{
    if (write_failed(r, err))
        return NULL;
    self->bytes_out += total;
    self->messages_out++;
    Py_RETURN_NONE;
}

/* send(data): bytes that are already framed (one or more whole messages). */
static PyObject *Stream_send(Stream *self, PyObject *arg)
{
    parts_t p;
    if (parts_get(arg, &p) < 0)
        return NULL;
    int64_t deadline = deadline_after(self->send_timeout);
    char err[256] = "";
    int r;
    lock_released(&self->send_order);
    Py_BEGIN_ALLOW_THREADS
    r = write_parts(self, NULL, 0, &p, deadline, err, sizeof err);
    Py_END_ALLOW_THREADS
    pthread_mutex_unlock(&self->send_order);
    size_t total = p.total;
    parts_release(&p);
    return finish_send(self, r, err, total);
}

/* send_message(msg_id, command, flags, payload=b"", error=0): frame and send one message;
 * payload is a buffer or a tuple of buffers. */
static PyObject *Stream_send_message(Stream *self, PyObject *args, PyObject *kwds)
{
    static char *kw[] = {"msg_id", "command", "flags", "payload", "error", NULL};
    unsigned int msg_id, command, flags, error = 0;
    PyObject *payload = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "III|OI", kw, &msg_id, &command, &flags, &payload, &error))
        return NULL;
    parts_t p = {.count = 0, .total = 0};
    if (payload && parts_get(payload, &p) < 0)
        return NULL;
    if (p.total + FRAME_HEADER_SIZE > self->max_message) {
        parts_release(&p);
        PyErr_Format(PyExc_ValueError, "message of %zu bytes exceeds the stream's maximum", p.total + FRAME_HEADER_SIZE);
        return NULL;
    }
    unsigned char head[FRAME_HEADER_SIZE];
    frame_encode(head, (uint16_t)msg_id, (uint16_t)command, (uint32_t)(p.total + FRAME_HEADER_SIZE), flags, error);
    int64_t deadline = deadline_after(self->send_timeout);
    char err[256] = "";
    int r;
    lock_released(&self->send_order);
    int hold = holds(self, (flags & FRAME_NO_REPLY) != 0);
    Py_BEGIN_ALLOW_THREADS
    r = write_parts_held(self, head, sizeof head, &p, deadline, err, sizeof err, hold);
    Py_END_ALLOW_THREADS
    pthread_mutex_unlock(&self->send_order);
    size_t total = p.total + FRAME_HEADER_SIZE;
    parts_release(&p);
    return finish_send(self, r, err, total);
}

/* send_messages(messages): frame and send a batch of (msg_id, command, flags, payload)
 * messages in order, staged into as few writes as they fit (a scatter list of posted DMA
 * writes is a few TLS records, not one per page). At most 64 messages per call. */
#define SEND_BATCH_MAX 64
static PyObject *Stream_send_messages(Stream *self, PyObject *arg)
{
    PyObject *seq = PySequence_Fast(arg, "send_messages takes a sequence of (msg_id, command, flags, payload)");
    if (!seq)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    if (n == 0) {
        Py_DECREF(seq);
        Py_RETURN_NONE;
    }
    if (n > SEND_BATCH_MAX) {
        Py_DECREF(seq);
        return PyErr_Format(PyExc_ValueError, "at most %d messages per send_messages call", SEND_BATCH_MAX);
    }
    parts_t *parts = (parts_t *)PyMem_Calloc((size_t)n, sizeof(parts_t));
    unsigned char(*heads)[FRAME_HEADER_SIZE] = PyMem_Calloc((size_t)n, FRAME_HEADER_SIZE);
    Py_ssize_t got = 0;
    size_t total = 0;
    int all_posted = 1;
    PyObject *result = NULL;
    if (!parts || !heads) {
        PyErr_NoMemory();
        goto done;
    }
    for (; got < n; got++) {
        unsigned int msg_id, command, flags;
        PyObject *payload;
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(seq, got), "IIIO", &msg_id, &command, &flags, &payload))
            goto done;
        if (parts_get(payload, &parts[got]) < 0)
            goto done;
        if (parts[got].total + FRAME_HEADER_SIZE > self->max_message) {
            PyErr_Format(PyExc_ValueError, "message of %zu bytes exceeds the stream's maximum",
                         parts[got].total + FRAME_HEADER_SIZE);
            parts_release(&parts[got]);
            goto done;
        }
        frame_encode(heads[got], (uint16_t)msg_id, (uint16_t)command,
                     (uint32_t)(parts[got].total + FRAME_HEADER_SIZE), flags, 0);
        all_posted &= (flags & FRAME_NO_REPLY) != 0;
        total += parts[got].total + FRAME_HEADER_SIZE;
    }
    char err[256] = "";
    int r = 0;
    lock_released(&self->send_order);
    stage_t st = stage_begin(self, deadline_after(self->send_timeout), err, sizeof err);
    int hold = holds(self, all_posted);
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; !r && i < n; i++)
        r = stage_parts(&st, heads[i], FRAME_HEADER_SIZE, &parts[i]);
    if (!r)
        r = stage_end(&st, hold);
    Py_END_ALLOW_THREADS
    pthread_mutex_unlock(&self->send_order);
    result = finish_send(self, r, err, total);
    if (result)
        self->messages_out += (unsigned long long)(n - 1); /* finish_send counted one */
done:
    for (Py_ssize_t i = 0; i < got; i++)
        parts_release(&parts[i]);
    PyMem_Free(parts);
    PyMem_Free(heads);
    Py_DECREF(seq);
    return result;
}

/* cork(): from now on the posted messages this thread sends stay in the stream (copied into
 * `tx`, sealed into one TLS record when they leave: their buffers may change after the call;
 * one larger than the stage is sealed at once and waits in the TLS write buffer), and leave
 * together with whatever is
 * sent next that does not stay (a request, a reply, another thread's message: stream order is
 * kept for all of them) or at uncork(); a full buffer (256 KiB) still writes out. A device's
 * DMA writes and the interrupt after them are one write(2) then, not one each: on veth every
 * write runs the peer's TCP receive and wakes its reader. No effect on plain TCP. */
static PyObject *Stream_cork(Stream *self, PyObject *unused)
{
    lock_released(&self->send_order);
    self->corked = 1;
    self->corked_by = pthread_self();
    pthread_mutex_unlock(&self->send_order);
    Py_RETURN_NONE;
}

/* uncork(): what the cork held leaves now (ClosedError, TimeoutError as a send's). */
static PyObject *Stream_uncork(Stream *self, PyObject *unused)
{
    char err[256] = "";
    int r = 0;
    lock_released(&self->send_order);
    int was = self->corked;
    self->corked = 0;
    if ((was || self->held) && self->ssl) {
        size_t held = self->held;
        self->held = 0;
        Py_BEGIN_ALLOW_THREADS
        r = stream_write(self, self->tx, held, 1, deadline_after(self->send_timeout), err, sizeof err);
        Py_END_ALLOW_THREADS
    }
    pthread_mutex_unlock(&self->send_order);
    if (write_failed(r, err))
        return NULL;
    Py_RETURN_NONE;
}

/* exchange(msg_id, command, flags, payload, timeout) -> the next message received, or None:
 * send_message() and receive() in one call, for a thread that sends a request and reads its
 * own completion (it must still check that what came is that completion). */
static PyObject *Stream_exchange(Stream *self, PyObject *args)
{
    unsigned int msg_id, command, flags;
    PyObject *payload, *timeout_obj;
    if (!PyArg_ParseTuple(args, "IIIOO", &msg_id, &command, &flags, &payload, &timeout_obj))
        return NULL;
    PyObject *send_args = Py_BuildValue("(IIIO)", msg_id, command, flags, payload);
    if (!send_args)
        return NULL;
    PyObject *sent = Stream_send_message(self, send_args, NULL);
    Py_DECREF(send_args);
    if (!sent)
        return NULL;
    Py_DECREF(sent);
    PyObject *recv_args = PyTuple_Pack(1, timeout_obj);
    if (!recv_args)
        return NULL;
    PyObject *got = Stream_receive(self, recv_args, NULL);
    Py_DECREF(recv_args);
    return got;
}

static PyObject *Stream_has_message(Stream *self, PyObject *unused)
{
    frame_header hdr;
    int st = frame_parse(self->rx.data + self->rx.start, self->rx.end - self->rx.start, self->max_message, &hdr);
    return PyBool_FromLong(st != FRAME_NEED_MORE); /* a bad frame too: the next receive reports it */
}

static PyObject *Stream_pending(Stream *self, PyObject *unused)
{
    int pending = 0;
    pthread_mutex_lock(&self->io);
    pending = tls_has_pending(self);
    pthread_mutex_unlock(&self->io);
    return PyBool_FromLong(pending);
}

static PyObject *Stream_readable(Stream *self, PyObject *args)
{
    PyObject *timeout_obj = Py_None;
    if (!PyArg_ParseTuple(args, "|O", &timeout_obj))
        return NULL;
    double timeout = timeout_arg(timeout_obj, -1.0);
    if (timeout == -2.0)
        return NULL;
    int pending = 0;
    pthread_mutex_lock(&self->io);
    pending = tls_has_pending(self);
    int fd = self->fd;
    pthread_mutex_unlock(&self->io);
    if (pending || self->shut || fd < 0)
        Py_RETURN_TRUE;
    int w;
    int64_t deadline = deadline_after(timeout);
    Py_BEGIN_ALLOW_THREADS
    w = wait_fd(fd, POLLIN, deadline);
    Py_END_ALLOW_THREADS
    return PyBool_FromLong(w != 0);
}

static PyObject *Stream_fileno(Stream *self, PyObject *unused)
{
    return PyLong_FromLong(self->fd);
}

/* shutdown(): both directions; wakes every thread waiting on the stream. */
static PyObject *Stream_shutdown(Stream *self, PyObject *unused)
{
    self->shut = 1;
    if (self->fd >= 0)
        shutdown(self->fd, SHUT_RDWR);
    Py_RETURN_NONE;
}

/* close(): shut down, then free the TLS state and the descriptor once no thread reads or
 * sends (they wake from the shutdown); if one does not let go within a second the
 * descriptor is freed with the object instead (never while a thread may use it). */
static PyObject *Stream_close(Stream *self, PyObject *unused)
{
    Stream_shutdown(self, NULL);
    int got_reader = 0, got_sender = 0;
    Py_BEGIN_ALLOW_THREADS
    for (int i = 0; i < 1000 && !(got_reader && got_sender); i++) {
        if (!got_reader)
            got_reader = pthread_mutex_trylock(&self->reader) == 0;
        if (!got_sender)
            got_sender = pthread_mutex_trylock(&self->send_order) == 0;
        if (!(got_reader && got_sender))
            usleep(1000);
    }
    if (got_reader && got_sender) {
        pthread_mutex_lock(&self->io);
        stream_free_now(self);
        pthread_mutex_unlock(&self->io);
    }
    if (got_reader)
        pthread_mutex_unlock(&self->reader);
    if (got_sender)
        pthread_mutex_unlock(&self->send_order);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *Stream_stats(Stream *self, PyObject *unused)
{
    return Py_BuildValue("{sKsKsKsKsKsKsnsKsd}", "bytes_in", self->bytes_in, "bytes_out", self->bytes_out,
                         "messages_in", self->messages_in, "messages_out", self->messages_out, "writes", self->writes,
                         "seals", self->seals, "buffered", (Py_ssize_t)(self->rx.end - self->rx.start),
                         "reads_followed", self->reads_followed, "read_gap_avg_us",
                         (double)self->read_gap_avg_ns / 1000.0);
}

static PyObject *Stream_get_send_timeout(Stream *self, void *closure)
{
    if (self->send_timeout < 0)
        Py_RETURN_NONE;
    return PyFloat_FromDouble(self->send_timeout);
}

static int Stream_set_send_timeout(Stream *self, PyObject *value, void *closure)
{
    double t = timeout_arg(value, -1.0);
    if (t == -2.0)
        return -1;
    self->send_timeout = t;
    return 0;
}

static PyObject *Stream_get_last_heard(Stream *self, void *closure)
{
    return PyFloat_FromDouble((double)self->last_rx_ns / 1e9);
}

static PyObject *Stream_get_spin_us(Stream *self, void *closure)
{
    return PyFloat_FromDouble((double)self->spin_ns / 1000.0);
}

/* A spin setting in µs (0 to 1e6, not deleted) into *ns; -1 with an exception naming it. */
static int set_spin(PyObject *value, const char *name, int64_t *ns)
{
    double us = value ? PyFloat_AsDouble(value) : -1.0;
    if (us == -1.0 && PyErr_Occurred())
        return -1;
    if (us < 0 || us > 1e6) {
        PyErr_Format(PyExc_ValueError, "%s must be between 0 and 1e6", name);
        return -1;
    }
    *ns = (int64_t)(us * 1000.0);
    return 0;
}

static int Stream_set_spin_us(Stream *self, PyObject *value, void *closure)
{
    return set_spin(value, "spin_us", &self->spin_ns);
}

static PyObject *Stream_get_read_spin_us(Stream *self, void *closure)
{
    return PyFloat_FromDouble((double)self->read_spin_ns / 1000.0);
}

static int Stream_set_read_spin_us(Stream *self, PyObject *value, void *closure)
{
    return set_spin(value, "read_spin_us", &self->read_spin_ns);
}

static PyObject *Stream_get_tls(Stream *self, void *closure)
{
    return PyBool_FromLong(self->ssl != NULL);
}

/* The certificate the peer presented, DER (None on plain TCP): who is at the other end, for
 * the box's admin commands and the host's pinning of its box (docs/link-protocol.md). */
static PyObject *Stream_peer_certificate(Stream *self, PyObject *unused)
{
    unsigned char *der = NULL;
    int len = -1;
    pthread_mutex_lock(&self->io);
    if (self->ssl && self->fd >= 0) {
        X509 *cert = SSL_get1_peer_certificate(self->ssl);
        if (cert) {
            len = i2d_X509(cert, &der);
            X509_free(cert);
        }
    }
    pthread_mutex_unlock(&self->io);
    if (len < 0)
        Py_RETURN_NONE;
    PyObject *out = PyBytes_FromStringAndSize((const char *)der, len);
    OPENSSL_free(der);
    return out;
}

static PyMethodDef Stream_methods[] = {
    {"receive", (PyCFunction)(void (*)(void))Stream_receive, METH_VARARGS | METH_KEYWORDS,
     "receive(timeout=None) -> (msg_id, command, flags, error, payload) or None when the timeout passed."},
    {"send", (PyCFunction)Stream_send, METH_O, "send(data): framed bytes, whole, in order with other sends."},
    {"send_messages", (PyCFunction)Stream_send_messages, METH_O,
     "send_messages(messages): a batch of (msg_id, command, flags, payload), staged into few writes"},
    {"send_message", (PyCFunction)(void (*)(void))Stream_send_message, METH_VARARGS | METH_KEYWORDS,
     "send_message(msg_id, command, flags, payload=b'', error=0): frame and send one message."},
    {"exchange", (PyCFunction)Stream_exchange, METH_VARARGS,
     "exchange(msg_id, command, flags, payload, timeout): send a message, return the next one received (or None)."},
    {"cork", (PyCFunction)Stream_cork, METH_NOARGS,
     "cork(): this thread's posted messages stay in the TLS buffer until the next send that does not, or uncork()."},
    {"uncork", (PyCFunction)Stream_uncork, METH_NOARGS, "uncork(): what cork() held leaves now."},
    {"has_message", (PyCFunction)Stream_has_message, METH_NOARGS, "A whole message is buffered."},
    {"pending", (PyCFunction)Stream_pending, METH_NOARGS, "TLS holds decrypted bytes nobody read yet."},
    {"readable", (PyCFunction)Stream_readable, METH_VARARGS, "readable(timeout=None): bytes can be read."},
    {"fileno", (PyCFunction)Stream_fileno, METH_NOARGS, "The socket's descriptor (-1 once closed)."},
    {"shutdown", (PyCFunction)Stream_shutdown, METH_NOARGS, "Shut both directions down; wakes waiters."},
    {"close", (PyCFunction)Stream_close, METH_NOARGS, "Shut down and free the descriptor."},
    {"stats", (PyCFunction)Stream_stats, METH_NOARGS, "Byte, message, write(2) and TLS write (seals) counters."},
    {"peer_certificate", (PyCFunction)Stream_peer_certificate, METH_NOARGS,
     "The peer's certificate (DER bytes), None on plain TCP."},
    {NULL},
};

static PyGetSetDef Stream_getset[] = {
    {"send_timeout", (getter)Stream_get_send_timeout, (setter)Stream_set_send_timeout,
     "Seconds a send may wait for the peer to read (None: for ever).", NULL},
    {"tls", (getter)Stream_get_tls, NULL, "The stream is TLS.", NULL},
    {"last_heard", (getter)Stream_get_last_heard, NULL, "time.monotonic() when bytes last arrived.", NULL},
    {"spin_us", (getter)Stream_get_spin_us, (setter)Stream_set_spin_us,
     "Microseconds to busy-poll for bytes before sleeping in poll() (0: off).", NULL},
    {"read_spin_us", (getter)Stream_get_read_spin_us, (setter)Stream_set_read_spin_us,
     "serve_requests: microseconds to busy-poll for the next message after answering a register read, "
     "while such gaps average within it (0: off).", NULL},
    {NULL},
};

static PyTypeObject StreamType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "dxpu_vfio.native._fastlink.Stream",
    .tp_basicsize = sizeof(Stream),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Stream(fd, tls=None, max_message=..., handshake_timeout=5.0): framed link messages over a "
              "connected TCP socket it owns; with a TlsContext, after a bounded handshake.",
    .tp_new = Stream_new,
    .tp_init = (initproc)Stream_init,
    .tp_dealloc = (destructor)Stream_dealloc,
    .tp_methods = Stream_methods,
    .tp_getset = Stream_getset,
};

/* The host proxy's forwarder uses the stream's static functions: one translation unit. */
#include "forward.c"
#include "serve.c"
#include "mapped_io.c"

static PyMethodDef module_methods[] = {
    {"serve_requests", serve_requests, METH_VARARGS,
     "serve_requests(stream, read, write, timeout, push=None, mirrors=None, wake_fd=-1): the box's register "
     "accesses (and posted ring pushes) in C; with a wake_fd, waiting there for them too (serve.c)."},
    {"hold_serving", hold_serving, METH_VARARGS,
     "hold_serving(stream, hold): a thread that reads the stream itself begins (True) or ends (False): "
     "meanwhile a waiting serve_requests leaves every message to the readers (serve.c)."},
    {"served", served_counters, METH_O, "served(stream): what serve_requests did on it."},
    {"mapped_file_io", mapped_file_io, METH_VARARGS,
     "mapped_file_io(fd, offset, memory, window, skip, ranges, to_memory) -> bool: a file to or from "
     "guest pages in one mapping with one preadv/pwritev; False (nothing done) when a range leaves the "
     "window (mapped_io.c)."},
    {NULL},
};

static struct PyModuleDef fastlink_module = {
    PyModuleDef_HEAD_INIT, "_fastlink", "Framing and TLS in C, and the proxies' hot paths (see fastlink.c).", -1,
    module_methods,
};

PyMODINIT_FUNC PyInit__fastlink(void)
{
    if (PyType_Ready(&TlsContextType) < 0 || PyType_Ready(&StreamType) < 0 || PyType_Ready(&ForwarderType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&fastlink_module);
    if (!m)
        return NULL;
    ClosedError = PyErr_NewException("dxpu_vfio.native._fastlink.Closed", PyExc_ConnectionError, NULL);
    BadFrameError = PyErr_NewException("dxpu_vfio.native._fastlink.BadFrame", PyExc_ValueError, NULL);
    TlsError = PyErr_NewException("dxpu_vfio.native._fastlink.TlsError", PyExc_ConnectionError, NULL);
    Py_INCREF(&TlsContextType);
    Py_INCREF(&StreamType);
    Py_INCREF(&ForwarderType);
    if (PyModule_AddObject(m, "TlsContext", (PyObject *)&TlsContextType) < 0 ||
        PyModule_AddObject(m, "Stream", (PyObject *)&StreamType) < 0 ||
        PyModule_AddObject(m, "Forwarder", (PyObject *)&ForwarderType) < 0 ||
        PyModule_AddObject(m, "Closed", ClosedError) < 0 || PyModule_AddObject(m, "BadFrame", BadFrameError) < 0 ||
        PyModule_AddObject(m, "TlsError", TlsError) < 0 ||
        PyModule_AddIntConstant(m, "HEADER_SIZE", FRAME_HEADER_SIZE) < 0 ||
        /* the OpenSSL linked in (setup links Debian testing's, for its AVX-512 AES-GCM) */
        PyModule_AddStringConstant(m, "OPENSSL_VERSION", OpenSSL_version(OPENSSL_VERSION)) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
