/* libFuzzer harness for frame.h: the parser and receive buffer the native stream runs.
 *
 * The input is a byte stream as a peer could send it, preceded by 8 bytes that choose
 * how the "socket" splits it into reads and the stream's maximum message size. Checked:
 * no memory error (ASan), no undefined behaviour (UBSan), and the messages taken out of
 * the chunked receive buffer are exactly those a one-pass reference parse of the whole
 * stream finds, ending at the same error (so chunking, moving and growing the buffer
 * never change what is received). Build and run: scripts/fuzz_native.sh.
 */
#include <assert.h>
#include <stdio.h>
#include <stdlib.h>

#include "frame.h"

#define MAX_CAP (1u << 20)

typedef struct {
    size_t offset, size;
} found_t;

/* Reference: walk the whole input once. Returns the number of whole messages, *status the
 * status at the first position that is not a whole message. */
static size_t reference(const unsigned char *data, size_t len, uint32_t max, found_t *out, size_t cap, int *status)
{
    size_t pos = 0, n = 0;
    for (;;) {
        frame_header hdr;
        int st = frame_parse(data + pos, len - pos, max, &hdr);
        if (st != FRAME_OK || n == cap) {
            *status = st;
            return n;
        }
        out[n].offset = pos;
        out[n].size = hdr.size;
        n++;
        pos += hdr.size;
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 8)
        return 0;
    uint32_t max = FRAME_HEADER_SIZE + (frame_le32(data) % (MAX_CAP + 64));
    uint32_t chunk_seed = frame_le32(data + 4);
    const unsigned char *stream = data + 8;
    size_t len = size - 8;

    static found_t expected[65536];
    int ref_status;
    size_t n_expected = reference(stream, len, max, expected, 65536, &ref_status);

    rxbuf rx = {.data = (unsigned char *)malloc(64), .cap = 64};
    assert(rx.data);
    size_t fed = 0, got = 0;
    int status = FRAME_NEED_MORE;
    for (;;) {
        frame_header hdr;
        const unsigned char *msg;
        status = rx_next(&rx, max, &hdr, &msg);
        if (status == FRAME_OK) {
            assert(got < n_expected);
            assert(hdr.size == expected[got].size);
            assert(memcmp(msg, stream + expected[got].offset, hdr.size) == 0);
            rx_consume(&rx, hdr.size);
            got++;
            continue;
        }
        if (status != FRAME_NEED_MORE || fed == len)
            break;
        if (rx_reserve(&rx, rx_wanted(&rx, &hdr, status), 64) < 0)
            abort();
        assert(rx.end < rx.cap || rx_wanted(&rx, &hdr, status) <= rx.end - rx.start);
        /* one "read": up to the free room, split as the seed says */
        size_t room = rx.cap - rx.end;
        chunk_seed = chunk_seed * 1103515245u + 12345u;
        size_t take = 1 + (chunk_seed >> 8) % 4096;
        if (take > room)
            take = room;
        if (take > len - fed)
            take = len - fed;
        if (take == 0)
            abort(); /* no room although a message is incomplete: rx_reserve broke its promise */
        memcpy(rx.data + rx.end, stream + fed, take);
        rx.end += take;
        fed += take;
    }
    assert(got == n_expected);
    if (n_expected < 65536)
        assert(status == ref_status);
    free(rx.data);
    return 0;
}
