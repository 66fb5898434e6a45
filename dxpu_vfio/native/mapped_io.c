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
 * mapped_file_io(fd, offset, memory, window, skip, ranges, to_memory) -> bool
 *  - memory: the window's mapping (a buffer, writable when to_memory); guest address
 *    `window` is memory[skip], and the window ends where memory does;
 *  - ranges: a list of (guest address, length) tuples, moved in order, back to back from
 *    the file's `offset`;
 *  - to_memory: preadv (file -> guest; past the file's end the pages read as zeroes) or
 *    pwritev (guest -> file; a short write is continued, one that writes nothing is ENOSPC).
 * Returns False, having touched nothing, when any range does not lie wholly in the window
 * (the caller then takes its general path, which finds the other windows or refuses the
 * DMA). Every range is checked before any byte moves; an address and a length are never
 * added without checking for overflow. OSError when the file refuses. The GIL is released
 * around the system calls; the caller holds its table's lock, so the mapping is not unmapped
 * meanwhile (and our buffer export would make closing it fail, not fault).
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

static PyObject *mapped_file_io(PyObject *self, PyObject *args)
{
    int fd, to_memory;
    long long offset;
    unsigned long long window, skip;
    PyObject *memory, *ranges;
    if (!PyArg_ParseTuple(args, "iLOKKO!p", &fd, &offset, &memory, &window, &skip, &PyList_Type, &ranges,
                          &to_memory))
        return NULL;
    if (offset < 0)
        return PyErr_Format(PyExc_ValueError, "file offset %lld is negative", offset);
    Py_ssize_t n = PyList_GET_SIZE(ranges);
    if (n > MAPPED_IO_MAX_RANGES)
        return PyErr_Format(PyExc_ValueError, "%zd ranges (at most %d)", n, MAPPED_IO_MAX_RANGES);
    Py_buffer buf;
    if (PyObject_GetBuffer(memory, &buf, to_memory ? PyBUF_WRITABLE : PyBUF_SIMPLE) < 0)
        return NULL;
    struct iovec stack_iov[64];
    struct iovec *iov = n <= 64 ? stack_iov : PyMem_Malloc((size_t)n * sizeof *iov);
    PyObject *result = NULL;
    if (!iov) {
        PyErr_NoMemory();
        goto out;
    }
    unsigned long long size = (unsigned long long)buf.len;
    if (skip > size) {
        PyErr_Format(PyExc_ValueError, "skip %llu is past the mapping's %llu bytes", skip, size);
        goto out;
    }
    unsigned long long room = size - skip; /* the window: [window, window + room) */
    size_t want = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PyList_GET_ITEM(ranges, i);
        if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 2) {
            PyErr_SetString(PyExc_TypeError, "each range is an (address, length) tuple");
            goto out;
        }
        unsigned long long address = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(item, 0));
        unsigned long long length = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(item, 1));
        if (PyErr_Occurred()) {
            if (!PyErr_ExceptionMatches(PyExc_OverflowError))
                goto out; /* not an int: a bug of the caller's */
            PyErr_Clear(); /* negative or past 64 bits: in no window (the general path refuses it) */
            result = Py_False;
            Py_INCREF(result);
            goto out;
        }
        if (address < window || address - window > room || length > room - (address - window)) {
            result = Py_False; /* outside the window (or wrapping): the caller's general path */
            Py_INCREF(result);
            goto out;
        }
        if (length > (size_t)SSIZE_MAX - want) {
            PyErr_SetString(PyExc_ValueError, "the ranges add up past SSIZE_MAX");
            goto out;
        }
        iov[i].iov_base = (char *)buf.buf + skip + (address - window);
        iov[i].iov_len = (size_t)length;
        want += (size_t)length;
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
    result = Py_True;
    Py_INCREF(result);
out:
    if (iov && iov != stack_iov)
        PyMem_Free(iov);
    PyBuffer_Release(&buf);
    return result;
}
