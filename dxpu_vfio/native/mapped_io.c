/* A file to and from guest memory mapped in this process, in C: the host proxy's local DMA
 * table (dxpu_vfio/vfio_user/dma.py, DmaTable._file_io) moves an NVMe Read's or Write's
 * pages with one preadv/pwritev straight between the namespace file and the mapping.
 * (Part of fastlink.c's translation unit.)
 *
 * Why: a 128 KiB transfer is up to 32 scattered guest pages. In Python each page costs a
 * window lookup and a memoryview slice made and released, about 21 us a transfer on these
 * machines against 6 us for the preadv itself (docs/benchmarks.md, NVMe, 2026-12-05 fourth
 * session). Here the pages become an iovec in one pass.
 *
 * mapped_file_io(fd, offset, memory, window, skip, ranges, to_memory, then=()) -> int | None
 *  - memory: the window's mapping (a buffer, writable when to_memory); guest address
 *    `window` is memory[skip], and the window ends where memory does;
 *  - ranges: a list of (guest address, length) tuples, moved in order, back to back from
 *    the file's `offset`;
 *  - to_memory: preadv (file -> guest; past the file's end the pages read as zeroes) or
 *    pwritev (guest -> file; a short write is continued, one that writes nothing is ENOSPC);
 *  - then: (guest address, bytes) written into the window after a preadv (a Read's
 *    completion entry: it must not reach the guest before the data).
 * Returns the bytes the ranges hold, or None, having touched nothing, when any range (or
 * write of `then`) does not lie wholly in the window (the caller then takes its general
 * path, which finds the other windows or refuses the DMA). Everything is checked before any
 * byte moves; an address and a length are never added without checking for overflow.
 * OSError when the file refuses. The GIL is released around the system calls; the caller
 * holds its table's lock, so the mapping is not unmapped meanwhile (and our buffer export
 * would make closing it fail, not fault).
 */
#include <limits.h>
#include <string.h>
#include <sys/uio.h>

#define MAPPED_IO_MAX_RANGES 4096 /* a 2 MiB transfer of 4 KiB pages is 512; more is a bug */

/* preadv/pwritev of iov[0..n) at `offset` until all `want` bytes moved. 0, or -1 with
 * errno set. A read that reaches the file's end zero-fills the rest. */
static int move_all(int fd, struct iovec *iov, int n, off_t offset, size_t want, int to_memory)
{
    size_t done = 0;
    while (done < want) {
        int batch = n < IOV_MAX ? n : IOV_MAX;
        ssize_t got = to_memory ? preadv(fd, iov, batch, offset + (off_t)done)
                                : pwritev(fd, iov, batch, offset + (off_t)done);
        if (got < 0) {
            if (errno == EINTR)
                continue;
            return -1;
        }
        if (got == 0) {
            if (!to_memory) {
                errno = ENOSPC; /* the kernel returns 0 only when it cannot place a byte */
                return -1;
            }
            for (int i = 0; i < n; i++) /* the end of the file: the rest reads as zeroes */
                memset(iov[i].iov_base, 0, iov[i].iov_len);
            return 0;
        }
        done += (size_t)got;
        size_t left = (size_t)got; /* step past what moved; the first iovec may be cut */
        while (n > 0 && left >= iov->iov_len) {
            left -= iov->iov_len;
            iov++;
            n--;
        }
        if (n > 0) {
            iov->iov_base = (char *)iov->iov_base + left;
            iov->iov_len -= left;
        }
    }
    return 0;
}

/* Where guest [address, address + length) lies in the mapping, or NULL when not wholly in
 * the window [window, window + room) (a value that is not a u64 counts as outside). -1 with
 * an exception: the item is not an int. */
static int window_place(PyObject *addr_obj, PyObject *len_obj, unsigned long long window, unsigned long long room,
                        unsigned long long *at, unsigned long long *length)
{
    unsigned long long address = PyLong_AsUnsignedLongLong(addr_obj);
    *length = PyLong_AsUnsignedLongLong(len_obj);
    if (PyErr_Occurred()) {
        if (!PyErr_ExceptionMatches(PyExc_OverflowError))
            return -1; /* not an int: a bug of the caller's */
        PyErr_Clear(); /* negative or past 64 bits: in no window */
        return 0;
    }
    if (address < window || address - window > room || *length > room - (address - window))
        return 0; /* outside the window, or wrapping */
    *at = address - window;
    return 1;
}

static PyObject *mapped_file_io(PyObject *self, PyObject *args)
{
    int fd, to_memory;
    long long offset;
    unsigned long long window, skip;
    PyObject *memory, *ranges, *then = NULL;
    if (!PyArg_ParseTuple(args, "iLOKKO!p|O!", &fd, &offset, &memory, &window, &skip, &PyList_Type, &ranges,
                          &to_memory, &PyList_Type, &then))
        return NULL;
    if (offset < 0)
        return PyErr_Format(PyExc_ValueError, "file offset %lld is negative", offset);
    Py_ssize_t n = PyList_GET_SIZE(ranges), n_then = then ? PyList_GET_SIZE(then) : 0;
    if (n > MAPPED_IO_MAX_RANGES || n_then > MAPPED_IO_MAX_RANGES)
        return PyErr_Format(PyExc_ValueError, "%zd ranges and %zd writes after (at most %d each)", n, n_then,
                            MAPPED_IO_MAX_RANGES);
    if (n_then && !to_memory)
        return PyErr_Format(PyExc_ValueError, "writes after a transfer are for one into guest memory");
    Py_buffer buf;
    if (PyObject_GetBuffer(memory, &buf, to_memory ? PyBUF_WRITABLE : PyBUF_SIMPLE) < 0)
        return NULL;
    struct iovec stack_iov[64];
    struct iovec *iov = n <= 64 ? stack_iov : PyMem_Malloc((size_t)n * sizeof *iov);
    struct after { unsigned long long at; PyObject *data; } stack_after[4]; /* `then`, checked, held */
    struct after *after = n_then <= 4 ? stack_after : PyMem_Malloc((size_t)n_then * sizeof *after);
    Py_ssize_t held = 0; /* entries of `after` holding a reference */
    PyObject *result = NULL;
    if (!iov || !after) {
        PyErr_NoMemory();
        goto out;
    }
    unsigned long long size = (unsigned long long)buf.len;
    if (skip > size) {
        PyErr_Format(PyExc_ValueError, "skip %llu is past the mapping's %llu bytes", skip, size);
        goto out;
    }
    unsigned long long room = size - skip, at, length; /* the window: [window, window + room) */
    char *base = (char *)buf.buf + skip;
    size_t want = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PyList_GET_ITEM(ranges, i);
        if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 2) {
            PyErr_SetString(PyExc_TypeError, "each range is an (address, length) tuple");
            goto out;
        }
        int placed = window_place(PyTuple_GET_ITEM(item, 0), PyTuple_GET_ITEM(item, 1), window, room, &at, &length);
        if (placed < 0)
            goto out;
        if (!placed) {
            result = Py_None; /* the caller's general path */
            Py_INCREF(result);
            goto out;
        }
        if (length > (size_t)SSIZE_MAX - want) {
            PyErr_SetString(PyExc_ValueError, "the ranges add up past SSIZE_MAX");
            goto out;
        }
        iov[i].iov_base = base + at;
        iov[i].iov_len = (size_t)length;
        want += (size_t)length;
    }
    for (Py_ssize_t i = 0; i < n_then; i++) { /* checked now, written after the transfer */
        PyObject *item = PyList_GET_ITEM(then, i);
        if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 2) {
            PyErr_SetString(PyExc_TypeError, "each write after is an (address, data) tuple");
            goto out;
        }
        if (!PyBytes_Check(PyTuple_GET_ITEM(item, 1))) {
            result = Py_None; /* another buffer type: the general path writes it */
            Py_INCREF(result);
            goto out;
        }
        PyObject *len_obj = PyLong_FromSsize_t(PyBytes_GET_SIZE(PyTuple_GET_ITEM(item, 1)));
        if (!len_obj)
            goto out;
        int placed = window_place(PyTuple_GET_ITEM(item, 0), len_obj, window, room, &at, &length);
        Py_DECREF(len_obj);
        if (placed < 0)
            goto out;
        if (!placed) {
            result = Py_None;
            Py_INCREF(result);
            goto out;
        }
        after[held].at = at; /* kept: another thread may change the list while the GIL is released */
        after[held].data = Py_NewRef(PyTuple_GET_ITEM(item, 1));
        held++;
    }
    if ((unsigned long long)offset > (unsigned long long)LLONG_MAX - want) {
        PyErr_SetString(PyExc_ValueError, "the transfer ends past the largest file offset");
        goto out;
    }
    int r, err = 0;
    Py_BEGIN_ALLOW_THREADS
    r = move_all(fd, iov, (int)n, (off_t)offset, want, to_memory);
    err = errno;
    Py_END_ALLOW_THREADS
    if (r < 0) {
        errno = err;
        PyErr_SetFromErrno(PyExc_OSError);
        goto out;
    }
    for (Py_ssize_t i = 0; i < held; i++) /* where they were checked to fit */
        memcpy(base + after[i].at, PyBytes_AS_STRING(after[i].data), (size_t)PyBytes_GET_SIZE(after[i].data));
    result = PyLong_FromSize_t(want);
out:
    for (Py_ssize_t i = 0; i < held; i++)
        Py_DECREF(after[i].data);
    if (after && after != stack_after)
        PyMem_Free(after);
    if (iov && iov != stack_iov)
        PyMem_Free(iov);
    PyBuffer_Release(&buf);
    return result;
}
