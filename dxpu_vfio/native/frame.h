/* Framing of link messages (vfio-user's 16-byte header), apart from any I/O.
 *
 * Pure C, no Python: the extension module and the libFuzzer harness include the same
 * code, so what is fuzzed is what runs. The parser never trusts a length: a size below
 * the header or above the stream's maximum is an error before any payload is read.
 */
#ifndef DXPU_FRAME_H
#define DXPU_FRAME_H

#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define FRAME_HEADER_SIZE 16
#define FRAME_TYPE_REPLY 0x1
#define FRAME_NO_REPLY 0x10
#define FRAME_ERROR 0x20

typedef struct {
    uint16_t msg_id;
    uint16_t command;
    uint32_t size; /* whole message, header included */
    uint32_t flags;
    uint32_t error;
} frame_header;

enum frame_status {
    FRAME_NEED_MORE = 0, /* not a whole message yet: read more */
    FRAME_OK = 1,        /* a whole message of hdr->size bytes starts at the buffer */
    FRAME_TOO_SMALL = -1,
    FRAME_TOO_LARGE = -2,
};

static inline uint32_t frame_le32(const unsigned char *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static inline uint16_t frame_le16(const unsigned char *p)
{
    return (uint16_t)(p[0] | p[1] << 8);
}

static inline void frame_put32(unsigned char *p, uint32_t v)
{
    p[0] = (unsigned char)v;
    p[1] = (unsigned char)(v >> 8);
    p[2] = (unsigned char)(v >> 16);
    p[3] = (unsigned char)(v >> 24);
}

/* Decode the header at buf (avail bytes there). FRAME_OK only when the whole message is
 * in the buffer; the header is filled in as soon as 16 bytes are, so a caller can size its
 * buffer for the rest. */
static inline int frame_parse(const unsigned char *buf, size_t avail, uint32_t max_size, frame_header *hdr)
{
    if (avail < FRAME_HEADER_SIZE)
        return FRAME_NEED_MORE;
    hdr->msg_id = frame_le16(buf);
    hdr->command = frame_le16(buf + 2);
    hdr->size = frame_le32(buf + 4);
    hdr->flags = frame_le32(buf + 8);
    hdr->error = frame_le32(buf + 12);
    if (hdr->size < FRAME_HEADER_SIZE)
        return FRAME_TOO_SMALL;
    if (hdr->size > max_size)
        return FRAME_TOO_LARGE;
    return avail >= hdr->size ? FRAME_OK : FRAME_NEED_MORE;
}

static inline void frame_encode(unsigned char *out, uint16_t msg_id, uint16_t command, uint32_t size,
                                uint32_t flags, uint32_t error)
{
    out[0] = (unsigned char)msg_id;
    out[1] = (unsigned char)(msg_id >> 8);
    out[2] = (unsigned char)command;
    out[3] = (unsigned char)(command >> 8);
    frame_put32(out + 4, size);
    frame_put32(out + 8, flags);
    frame_put32(out + 12, error);
}


/* The receive buffer: bytes read but not yet consumed are [start, end). Reads go into the
 * free room after end; a message is consumed whole. Pure bookkeeping (the caller reads), so
 * the fuzzer can drive it with any chunking of any bytes. */
typedef struct {
    unsigned char *data;
    size_t cap, start, end;
} rxbuf;

/* Make room for a message of `need` bytes from start: move the unconsumed bytes to the
 * front, grow (realloc) only when the message is larger than the buffer. -1: no memory. */
static inline int rx_reserve(rxbuf *rx, size_t need, size_t slack)
{
    if (rx->start && (rx->start + need > rx->cap || rx->end == rx->cap)) {
        memmove(rx->data, rx->data + rx->start, rx->end - rx->start);
        rx->end -= rx->start;
        rx->start = 0;
    }
    if (need > rx->cap) {
        unsigned char *grown = (unsigned char *)realloc(rx->data, need + slack);
        if (!grown)
            return -1;
        rx->data = grown;
        rx->cap = need + slack;
    }
    return 0;
}

/* The next whole message, or why not. On FRAME_OK *msg points at its first byte (header
 * included) and the caller must call rx_consume(rx, hdr->size) when done with it. */
static inline int rx_next(rxbuf *rx, uint32_t max_size, frame_header *hdr, const unsigned char **msg)
{
    int st = frame_parse(rx->data + rx->start, rx->end - rx->start, max_size, hdr);
    if (st == FRAME_OK)
        *msg = rx->data + rx->start;
    return st;
}

/* rx_next for the message after the first `skip` bytes (a whole message the caller holds). */
static inline int rx_next_after(rxbuf *rx, size_t skip, uint32_t max_size, frame_header *hdr,
                                const unsigned char **msg)
{
    int st = frame_parse(rx->data + rx->start + skip, rx->end - rx->start - skip, max_size, hdr);
    if (st == FRAME_OK)
        *msg = rx->data + rx->start + skip;
    return st;
}

static inline void rx_consume(rxbuf *rx, size_t size)
{
    rx->start += size;
    if (rx->start == rx->end)
        rx->start = rx->end = 0;
}

/* How many bytes from start the next read must bring in all: a header, or the message. */
static inline size_t rx_wanted(const rxbuf *rx, const frame_header *hdr, int status)
{
    return (status == FRAME_NEED_MORE && rx->end - rx->start >= FRAME_HEADER_SIZE) ? hdr->size : FRAME_HEADER_SIZE;
}

#endif
