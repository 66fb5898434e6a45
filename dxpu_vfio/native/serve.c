/* The remote proxy's hot path in C: the box's reader answers register accesses without
 * building Python messages. (Part of fastlink.c's translation unit.)
 *
 * serve_requests(stream, read, write, timeout, push=None, mirrors=None) takes the messages that are there
 * (waiting at most `timeout` for the first) and, in stream order:
 *  - REGION_READ: read(region, offset, count) -> bytes of that length, or an errno (int),
 *    answered with the vfio-user payload (or an error reply);
 *  - REGION_WRITE: write(region, offset, data, posted) -> None or an errno; answered unless
 *    posted;
 *  - DMA_PUSH, posted, given a `push`: push(payload) (the ring entries the doorbell right
 *    behind it announces: served here, the doorbell does not wait for a trip through the
 *    Python reader's loop); push must not raise (it drops what it cannot take: posted);
 *    given `mirrors` too (the device's LinkDmaPort), a push of ring entries alone into a ring
 *    mirrored without pointers is copied into that mirror here, without a call (push_mirrored);
 *  - SYNC: answered at once (everything before it is done: this thread did it);
 *  - HEARTBEAT: noted (the stream's last_heard);
 * and returns the first message it does not serve, as (msg_id, command, flags, error,
 * payload), for the Python endpoint (a DMA completion for a waiting device thread, a batch of
 * writes, a reset...), or None when nothing more is there.
 *
 * Given a `wake_fd`, it waits instead (up to `timeout`), serving what comes, and holds nothing
 * while it sleeps (neither the GIL nor the `reader` lock): the box's reader then spends no
 * Python between two register accesses (its loop took 4.5 µs from poll(2) to here, and as
 * much after, for each). It leaves the first message it does not serve in the buffer, for the
 * Python reader to take in order, and returns True; False when `wake_fd` is readable (not
 * drained: the caller's), None when the timeout passed. While a thread reads the stream for
 * itself (hold_serving: a device thread waiting for its DMA completion, which may leave a
 * request it read for the Python reader to serve first), it serves nothing and returns True:
 * serving here could run a later register access before that earlier one.
 *
 * The callbacks run with the GIL and with the stream's `reader` lock held, so no other thread
 * reads the stream meanwhile (a device thread waiting for its DMA completion waits for them
 * to return). So they must
 * be short and must never wait on this stream themselves; they may take the device's
 * lock, which no device thread holds while it waits for DMA (qemu_device/device.py's
 * rule). Counts and time per command: served(stream).
 */

/* An errno a callback returned, or -1 if it returned something else (then an exception may be set). */
static long errno_result(PyObject *r)
{
    if (!PyLong_Check(r))
        return -1;
    long e = PyLong_AsLong(r);
    return (e > 0 && e < 4096) ? e : EIO;
}

/* A DMA_PUSH straight into its ring's mirror (remoteproxy/ports.py RingMirror), without
 * Python code: the cold interpreter took 40-60 µs per push on a box whose CPU had just run
 * a kernel, on the path from doorbell to the device's first entry. Only the common case:
 * one or two ranges of ring entries, no pointed bytes, into a mirror whose `native` is
 * (start, entry size, entries, data bytearray, valid bytearray); everything else, and
 * whatever RingMirror.push would refuse (which forgets what was pushed), goes to the Python
 * callback, which has the reasons. `port` gives `mirror_lock` (taken, as RingMirror's
 * readers take it), `mirrors` (slot -> mirror) and `pushes` (counted here too).
 * 1: taken, 0: Python's to take, -1: a Python exception. */
static int push_mirrored(PyObject *port, const unsigned char *pl, size_t len)
{
    if (len < PUSH_HEAD)
        return 0;
    uint32_t slot = frame_le32(pl), count = frame_le32(pl + 4);
    if (count < 1 || count > 2 || len < PUSH_HEAD + (size_t)count * READV_RANGE) /* POINTED_UNKNOWN: > 2 */
        return 0;
    uint64_t addr[2], length[2], total = 0;
    for (uint32_t i = 0; i < count; i++) {
        const unsigned char *r = pl + PUSH_HEAD + i * READV_RANGE;
        addr[i] = le64(r);
        length[i] = frame_le32(r + 8);
        if (frame_le32(r + 12) != RANGE_RING || !length[i] || addr[i] + length[i] < addr[i])
            return 0;
        total += length[i];
    }
    const unsigned char *data = pl + PUSH_HEAD + count * READV_RANGE;
    if (total > MAX_PUSH_BYTES || (size_t)(pl + len - data) != total)
        return 0;
    PyObject *lock = PyObject_GetAttrString(port, "mirror_lock");
    if (!lock)
        return -1;
    PyObject *got = PyObject_CallMethod(lock, "acquire", NULL);
    if (!got) {
        Py_DECREF(lock);
        return -1;
    }
    Py_DECREF(got);
    int rc = 0;
    PyObject *mirrors = PyObject_GetAttrString(port, "mirrors");
    PyObject *key = mirrors ? PyLong_FromUnsignedLong(slot) : NULL;
    PyObject *mirror = key && PyDict_Check(mirrors) ? PyDict_GetItemWithError(mirrors, key) : NULL; /* borrowed */
    PyObject *native = mirror ? PyObject_GetAttrString(mirror, "native") : NULL;
    unsigned long long start, size, entries;
    PyObject *buf, *valid;
    if (PyErr_Occurred()) {
        rc = -1;
    } else if (native && native != Py_None &&
               PyArg_ParseTuple(native, "KKKO!O!", &start, &size, &entries, &PyByteArray_Type, &buf,
                                &PyByteArray_Type, &valid) &&
               size && (unsigned long long)PyByteArray_GET_SIZE(buf) == size * entries &&
               (unsigned long long)PyByteArray_GET_SIZE(valid) == entries) {
        uint64_t end = start + size * entries;
        int whole = 1;
        for (uint32_t i = 0; i < count; i++)
            whole &= addr[i] >= start && addr[i] + length[i] <= end && !((addr[i] - start) % size) && !(length[i] % size);
        if (whole) {
            for (uint32_t i = 0; i < count; i++) {
                memcpy(PyByteArray_AS_STRING(buf) + (addr[i] - start), data, length[i]);
                memset(PyByteArray_AS_STRING(valid) + (addr[i] - start) / size, 1, length[i] / size);
                data += length[i];
            }
            PyObject *n = PyObject_GetAttrString(port, "pushes");
            long pushes = n ? PyLong_AsLong(n) : -1;
            Py_XDECREF(n);
            n = pushes >= 0 ? PyLong_FromLong(pushes + 1) : NULL;
            rc = n && !PyObject_SetAttrString(port, "pushes", n) ? 1 : -1;
            Py_XDECREF(n);
        }
    } else if (PyErr_Occurred()) {
        rc = -1;
    }
    Py_XDECREF(native);
    Py_XDECREF(key);
    Py_XDECREF(mirrors);
    PyObject *type, *value, *tb; /* the release runs whatever happened */
    PyErr_Fetch(&type, &value, &tb);
    got = PyObject_CallMethod(lock, "release", NULL);
    Py_DECREF(lock);
    if (type) {
        Py_XDECREF(got);
        PyErr_Restore(type, value, tb);
        return -1;
    }
    if (!got)
        return -1;
    Py_DECREF(got);
    return rc;
}

/* Serve one REGION_READ/REGION_WRITE/SYNC/HEARTBEAT at the front of the buffer (copied out
 * first: the callback gets its own bytes, which may outlive the buffer).
 * 0: served, 1: not one of ours, -1: the stream failed (err), -2: a Python exception. */
static int serve_one(Stream *s, PyObject *read_cb, PyObject *write_cb, PyObject *push_cb, PyObject *mirrors, char *err,
                     size_t errlen)
{
    frame_header hdr;
    const unsigned char *msg;
    if (rx_next(&s->rx, s->max_message, &hdr, &msg) != FRAME_OK)
        return 1;
    s->read_answered_ns = 0; /* set again below if this is a read that gets its answer */
    const unsigned char *pl = msg + FRAME_HEADER_SIZE;
    size_t len = hdr.size - FRAME_HEADER_SIZE;
    int is_request = !(hdr.flags & FRAME_TYPE_REPLY);
    if (is_request && hdr.command == CMD_DMA_PUSH && (hdr.flags & FRAME_NO_REPLY) && push_cb != Py_None) {
        int64_t started = now_ns();
        int taken = mirrors != Py_None ? push_mirrored(mirrors, pl, len) : 0;
        if (taken) {
            rx_consume(&s->rx, hdr.size);
            s->messages_in++;
            s->served[4].count++;
            s->served[4].ns += (unsigned long long)(now_ns() - started);
            return taken < 0 ? -2 : 0;
        }
        PyObject *data = PyBytes_FromStringAndSize((const char *)pl, (Py_ssize_t)len); /* the callback's own copy */
        if (!data)
            return -2;
        rx_consume(&s->rx, hdr.size);
        s->messages_in++;
        PyObject *r = PyObject_CallOneArg(push_cb, data);
        Py_DECREF(data);
        s->served[4].count++;
        s->served[4].ns += (unsigned long long)(now_ns() - started);
        if (!r)
            return -2;
        Py_DECREF(r);
        return 0;
    }
    if (is_request && hdr.command == CMD_HEARTBEAT) {
        rx_consume(&s->rx, hdr.size);
        s->messages_in++;
        s->served[3].count++;
        return 0;
    }
    if (is_request && hdr.command == CMD_SYNC && !(hdr.flags & FRAME_NO_REPLY)) {
        rx_consume(&s->rx, hdr.size);
        s->messages_in++;
        s->served[2].count++;
        return send_frame(s, hdr.msg_id, hdr.command, FRAME_TYPE_REPLY, 0, NULL, 0, NULL, 0, err, errlen);
    }
    int is_read = hdr.command == CMD_REGION_READ, is_write = hdr.command == CMD_REGION_WRITE;
    if (!is_request || len < 16 || !(is_read || is_write))
        return 1;
    uint64_t offset = le64(pl);
    uint32_t region = frame_le32(pl + 8), count = frame_le32(pl + 12);
    int posted = (hdr.flags & FRAME_NO_REPLY) != 0;
    if (count > MAX_DATA || (is_write && len != 16u + count) || (is_read && posted))
        return 1; /* Python refuses it with its reasons */
    unsigned char access[16];
    memcpy(access, pl, 16);
    frame_header req = hdr;
    PyObject *data = is_write ? PyBytes_FromStringAndSize((const char *)pl + 16, count) : NULL;
    if (is_write && !data)
        return -2;
    rx_consume(&s->rx, hdr.size); /* taken: the callback may not see the buffer */
    s->messages_in++;
    int64_t started = now_ns();
    PyObject *r = is_read ? PyObject_CallFunction(read_cb, "IKI", region, (unsigned long long)offset, count)
                          : PyObject_CallFunction(write_cb, "IKOO", region, (unsigned long long)offset, data,
                                                  posted ? Py_True : Py_False);
    Py_XDECREF(data);
    served_t *stat = &s->served[is_read ? 0 : 1];
    stat->count++;
    stat->ns += (unsigned long long)(now_ns() - started);
    if (!r)
        return -2;
    int rc = 0;
    if (posted) {
        /* nothing to answer; an error of a posted write was the callback's to count */
    } else if (is_read && PyBytes_Check(r) && PyBytes_GET_SIZE(r) == (Py_ssize_t)count) {
        rc = send_frame(s, req.msg_id, req.command, FRAME_TYPE_REPLY, 0, access, 16, PyBytes_AS_STRING(r), count, err,
                        errlen);
        if (rc == 0)
            s->read_answered_ns = now_ns(); /* the guest's vCPU is free again: its next access may follow at once */
    } else if (is_write && r == Py_None) {
        rc = send_frame(s, req.msg_id, req.command, FRAME_TYPE_REPLY, 0, access, 16, NULL, 0, err, errlen);
    } else {
        long e = errno_result(r);
        rc = send_frame(s, req.msg_id, req.command, FRAME_TYPE_REPLY | FRAME_ERROR, (uint32_t)(e > 0 ? e : EIO), NULL,
                        0, NULL, 0, err, errlen);
    }
    Py_DECREF(r);
    return rc;
}

/* serve_one's failure as a Python exception: -1 the stream failed (err), -2 a callback raised. */
static PyObject *serve_failed(int r, const char *err)
{
    if (r == -1)
        PyErr_SetString(ClosedError, err);
    return NULL;
}

/* Sleep until the stream or `wake_fd` is readable, holding nothing (GIL released).
 * 1: the stream, 2: wake_fd, 0: the deadline passed, -1: the stream is shut, -2: poll failed. */
static int wait_stream_or(Stream *s, int wake_fd, int64_t deadline, int64_t spin_ns)
{
    pthread_mutex_lock(&s->io);
    int fd = s->shut ? -1 : s->fd;
    pthread_mutex_unlock(&s->io);
    if (fd < 0)
        return -1;
    struct pollfd p[2] = {{.fd = fd, .events = POLLIN}, {.fd = wake_fd, .events = POLLIN}};
    int r;
    Py_BEGIN_ALLOW_THREADS
    r = spin_fds(p, 2, spin_ns, deadline) ? 1 : wait_fds(p, 2, deadline);
    Py_END_ALLOW_THREADS
    if (r <= 0)
        return r < 0 ? -2 : 0;
    return p[1].revents ? 2 : 1; /* a wake-up first: the caller may have to stand aside */
}

/* How long the box's reader spins before it sleeps for the next message (`reader` held;
 * takes the mark of a read answered). Right after it answered a register read it spins up to
 * read_spin_ns: the guest's vCPU was stopped on that read, and a driver that reads in a loop
 * sends its next access within tens of µs, which a sleep would pay a wake-up for. It stops
 * spinning while the gaps after read answers average over the spin (a guest that reads now
 * and then, a slow link), and never spins longer than spin_ns after anything else: a
 * device's DMA and doorbells do not wait for a spinning reader's CPU. Counts the answers it
 * was ready to spin after (reads_followed: it does not spin where the next message is there
 * already); the gap is noted whether the next message needed a wait or was there already
 * (note_read_gap). */
static int64_t spin_after_serving(Stream *s, int64_t *answered)
{
    *answered = s->read_answered_ns;
    s->read_answered_ns = 0; /* one wait per answer */
    if (*answered && s->read_spin_ns > s->spin_ns && s->read_gap_avg_ns <= s->read_spin_ns) {
        s->reads_followed++;
        return s->read_spin_ns;
    }
    return s->spin_ns;
}

/* The gap from a read's answer to the next message (`reader` held), into the average. */
static void note_read_gap(Stream *s, int64_t answered)
{
    if (answered)
        s->read_gap_avg_ns += (now_ns() - answered - s->read_gap_avg_ns) / 8;
}

/* serve_requests with a wake_fd (see the top): serve what comes until a message for Python,
 * a wake-up or the deadline. */
static PyObject *serve_waiting(Stream *s, PyObject *read_cb, PyObject *write_cb, PyObject *push_cb, PyObject *mirrors,
                               int wake_fd, int64_t deadline)
{
    char err[256] = "";
    for (;;) {
        lock_released(&s->reader);
        if (s->serve_held) {
            pthread_mutex_unlock(&s->reader);
            Py_RETURN_TRUE;
        }
        int r = serve_one(s, read_cb, write_cb, push_cb, mirrors, err, sizeof err);
        if (r == 1) {
            frame_header hdr;
            const unsigned char *msg;
            if (rx_next(&s->rx, s->max_message, &hdr, &msg) != FRAME_NEED_MORE) {
                pthread_mutex_unlock(&s->reader); /* Python's (a bad frame too: its receive reports it) */
                Py_RETURN_TRUE;
            }
            int64_t answered;
            int64_t spin = spin_after_serving(s, &answered);
            int got = next_message(s, deadline_after(0), &hdr, &msg, err, sizeof err); /* what is there now */
            if (got == 1)
                note_read_gap(s, answered); /* it came before a wait: a gap all the same */
            pthread_mutex_unlock(&s->reader);
            if (got < 0) {
                raise_next_error(got, err);
                return NULL;
            }
            if (got == 1)
                continue;
            int w = wait_stream_or(s, wake_fd, deadline, spin);
            if (w >= 0 && answered) {
                lock_released(&s->reader);
                note_read_gap(s, answered);
                pthread_mutex_unlock(&s->reader);
            }
            if (w == 0)
                Py_RETURN_NONE;
            if (w == 2)
                Py_RETURN_FALSE;
            if (w == -1) {
                PyErr_SetString(ClosedError, "stream shut down");
                return NULL;
            }
            if (w == -2)
                return PyErr_SetFromErrno(PyExc_OSError);
            continue;
        }
        pthread_mutex_unlock(&s->reader);
        if (r < 0)
            return serve_failed(r, err);
    }
}

static PyObject *serve_requests(PyObject *module, PyObject *args)
{
    Stream *s;
    PyObject *read_cb, *write_cb, *timeout_obj, *push_cb = Py_None, *mirrors = Py_None;
    int wake_fd = -1;
    if (!PyArg_ParseTuple(args, "O!OOO|OOi", &StreamType, &s, &read_cb, &write_cb, &timeout_obj, &push_cb, &mirrors,
                          &wake_fd))
        return NULL;
    double timeout = timeout_arg(timeout_obj, -1.0);
    if (timeout == -2.0)
        return NULL;
    int64_t deadline = deadline_after(timeout);
    if (wake_fd >= 0)
        return serve_waiting(s, read_cb, write_cb, push_cb, mirrors, wake_fd, deadline);
    char err[256] = "";
    for (;;) {
        lock_released(&s->reader);
        int r = serve_one(s, read_cb, write_cb, push_cb, mirrors, err, sizeof err);
        if (r == 1) { /* not ours, or nothing whole buffered */
            frame_header hdr;
            const unsigned char *msg;
            int st = rx_next(&s->rx, s->max_message, &hdr, &msg);
            if (st == FRAME_OK) {
                PyObject *out = as_python(s, &hdr, msg);
                if (out) {
                    rx_consume(&s->rx, hdr.size);
                    s->messages_in++;
                }
                pthread_mutex_unlock(&s->reader);
                return out;
            }
            int got = next_message(s, deadline, &hdr, &msg, err, sizeof err);
            pthread_mutex_unlock(&s->reader);
            if (got < 0) {
                raise_next_error(got, err);
                return NULL;
            }
            if (got == 0)
                Py_RETURN_NONE;
            deadline = deadline_after(0); /* after the first message: only what is there */
            continue;
        }
        pthread_mutex_unlock(&s->reader);
        if (r < 0)
            return serve_failed(r, err);
        deadline = deadline_after(0);
    }
}

/* hold_serving(stream, hold): see the top. Taken under `reader`, so a message being served
 * when a reader begins is finished before that reader reads the next. */
static PyObject *hold_serving(PyObject *module, PyObject *args)
{
    Stream *s;
    int hold;
    if (!PyArg_ParseTuple(args, "O!p", &StreamType, &s, &hold))
        return NULL;
    lock_released(&s->reader);
    s->serve_held += hold ? 1 : -1;
    if (s->serve_held < 0)
        s->serve_held = 0;
    pthread_mutex_unlock(&s->reader);
    Py_RETURN_NONE;
}

/* served(stream) -> {command name: {"count", "ns"}}: what serve_requests did on this stream. */
static PyObject *served_counters(PyObject *module, PyObject *arg)
{
    if (!PyObject_TypeCheck(arg, &StreamType)) {
        PyErr_SetString(PyExc_TypeError, "served(stream)");
        return NULL;
    }
    Stream *s = (Stream *)arg;
    return Py_BuildValue("{s{sKsK}s{sKsK}s{sKsK}s{sKsK}s{sKsK}}", "REGION_READ", "count", s->served[0].count, "ns",
                         s->served[0].ns, "REGION_WRITE", "count", s->served[1].count, "ns", s->served[1].ns, "SYNC",
                         "count", s->served[2].count, "ns", s->served[2].ns, "HEARTBEAT", "count", s->served[3].count,
                         "ns", s->served[3].ns, "DMA_PUSH", "count", s->served[4].count, "ns", s->served[4].ns);
}
