/* The remote proxy's hot path in C: the box's reader answers register accesses without
 * building Python messages. (Part of fastlink.c's translation unit.)
 *
 * serve_requests(stream, read, write, timeout, push=None) takes the messages that are there
 * (waiting at most `timeout` for the first) and, in stream order:
 *  - REGION_READ: read(region, offset, count) -> bytes of that length, or an errno (int),
 *    answered with the vfio-user payload (or an error reply);
 *  - REGION_WRITE: write(region, offset, data, posted) -> None or an errno; answered unless
 *    posted;
 *  - DMA_PUSH, posted, given a `push`: push(payload) (the ring entries the doorbell right
 *    behind it announces: served here, the doorbell does not wait for a trip through the
 *    Python reader's loop); push must not raise (it drops what it cannot take: posted);
 *  - SYNC: answered at once (everything before it is done: this thread did it);
 *  - HEARTBEAT: noted (the stream's last_heard);
 * and returns the first message it does not serve, as (msg_id, command, flags, error,
 * payload), for the Python endpoint (a DMA completion for a waiting device thread, a batch of
 * writes, a reset...), or None when nothing more is there. The callbacks run with the GIL
 * and with the stream's `reader` lock held, so no other thread reads the stream meanwhile
 * (a device thread waiting for its DMA completion waits for them to return). So they must
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

/* Serve one REGION_READ/REGION_WRITE/SYNC/HEARTBEAT at the front of the buffer (copied out
 * first: the callback gets its own bytes, which may outlive the buffer).
 * 0: served, 1: not one of ours, -1: the stream failed (err), -2: a Python exception. */
static int serve_one(Stream *s, PyObject *read_cb, PyObject *write_cb, PyObject *push_cb, char *err, size_t errlen)
{
    frame_header hdr;
    const unsigned char *msg;
    if (rx_next(&s->rx, s->max_message, &hdr, &msg) != FRAME_OK)
        return 1;
    const unsigned char *pl = msg + FRAME_HEADER_SIZE;
    size_t len = hdr.size - FRAME_HEADER_SIZE;
    int is_request = !(hdr.flags & FRAME_TYPE_REPLY);
    if (is_request && hdr.command == CMD_DMA_PUSH && (hdr.flags & FRAME_NO_REPLY) && push_cb != Py_None) {
        PyObject *data = PyBytes_FromStringAndSize((const char *)pl, (Py_ssize_t)len); /* the callback's own copy */
        if (!data)
            return -2;
        rx_consume(&s->rx, hdr.size);
        s->messages_in++;
        int64_t started = now_ns();
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

static PyObject *serve_requests(PyObject *module, PyObject *args)
{
    Stream *s;
    PyObject *read_cb, *write_cb, *timeout_obj, *push_cb = Py_None;
    if (!PyArg_ParseTuple(args, "O!OOO|O", &StreamType, &s, &read_cb, &write_cb, &timeout_obj, &push_cb))
        return NULL;
    double timeout = timeout_arg(timeout_obj, -1.0);
    if (timeout == -2.0)
        return NULL;
    int64_t deadline = deadline_after(timeout);
    char err[256] = "";
    for (;;) {
        lock_released(&s->reader);
        int r = serve_one(s, read_cb, write_cb, push_cb, err, sizeof err);
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
        if (r == -1) {
            PyErr_SetString(ClosedError, err);
            return NULL;
        }
        if (r == -2)
            return NULL;
        deadline = deadline_after(0);
    }
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
