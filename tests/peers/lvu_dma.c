/*
 * A libvfio-user server for the peer tests (tests/test_libvfio_user.py): a DMA copy
 * engine behind BAR0, on libvfio-user's own DMA controller (its 8 TiB window limit, its
 * descriptor-less windows reached by DMA_READ/DMA_WRITE messages). Built against the
 * libvfio-user checkout by scripts/build_libvfio_user.sh; it is not part of the package.
 *
 *   lvu-dma [-d] SOCKET
 *
 * -d: copy directly in fd-mapped guest memory (vfu_sgl_get), like a server that needs
 * it; it exits when the memory has no descriptor. Without -d: vfu_sgl_read/vfu_sgl_write.
 *
 * BAR0 (4 KiB): 0x00 magic "LVU1" (ro), 0x08 source u64, 0x10 destination u64,
 * 0x18 length u32 (at most 1 MiB), 0x1c status u32 (1 busy, 2 done, 3 error), 0x20 go
 * (any write: copy after the write is answered, then raise INTx). Each window it is given
 * is printed ("window <iova> <length> fd|nofd"), and so is each copy.
 */
#include <err.h>
#include <errno.h>
#include <poll.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "libvfio-user.h"

#define MAGIC 0x3155564cu /* "LVU1" */
#define MAX_COPY (1u << 20)

static uint8_t regs[0x40];
static bool go, direct;

static uint64_t reg64(size_t off) { uint64_t v; memcpy(&v, regs + off, 8); return v; }
static uint32_t reg32(size_t off) { uint32_t v; memcpy(&v, regs + off, 4); return v; }
static void set32(size_t off, uint32_t v) { memcpy(regs + off, &v, 4); }

static ssize_t bar0(vfu_ctx_t *ctx, char *buf, size_t count, loff_t off, bool is_write)
{
    (void)ctx;
    if (off < 0 || (size_t)off + count > 0x1000) {
        errno = EINVAL;
        return -1;
    }
    if ((size_t)off >= sizeof(regs)) {
        if (!is_write)
            memset(buf, 0, count);
        return count;
    }
    size_t n = (size_t)off + count > sizeof(regs) ? sizeof(regs) - off : count;
    if (is_write) {
        if (off < 4)
            return count; /* the magic is read-only */
        memcpy(regs + off, buf, n);
        if ((size_t)off <= 0x20 && (size_t)off + count > 0x20) {
            go = true;
            set32(0x1c, 1);
        }
    } else {
        memset(buf, 0, count);
        memcpy(buf, regs + off, n);
    }
    return count;
}

static void dma_register(vfu_ctx_t *ctx, vfu_dma_info_t *info)
{
    (void)ctx;
    printf("window %#llx %#zx %s\n", (unsigned long long)(uintptr_t)info->iova.iov_base, info->iova.iov_len,
           info->vaddr ? "fd" : "nofd");
    fflush(stdout);
}

static void dma_unregister(vfu_ctx_t *ctx, vfu_dma_info_t *info)
{
    (void)ctx;
    printf("unmapped %#llx %#zx\n", (unsigned long long)(uintptr_t)info->iova.iov_base, info->iova.iov_len);
    fflush(stdout);
}

/* One transfer of len bytes between guest memory at addr and buf. */
static int transfer(vfu_ctx_t *ctx, uint64_t addr, uint32_t len, char *buf, bool to_guest)
{
    dma_sg_t *sg = alloca(dma_sg_size());
    if (vfu_addr_to_sgl(ctx, (vfu_dma_addr_t)(uintptr_t)addr, len, sg, 1, to_guest ? PROT_WRITE : PROT_READ) < 0)
        return -1;
    if (!direct)
        return to_guest ? vfu_sgl_write(ctx, sg, 1, buf, 0) : vfu_sgl_read(ctx, sg, 1, buf, 0);
    struct iovec iov;
    if (vfu_sgl_get(ctx, sg, &iov, 1, 0) < 0)
        err(EXIT_FAILURE, "vfu_sgl_get failed: guest memory at %#llx is not fd-mapped", (unsigned long long)addr);
    if (to_guest)
        memcpy(iov.iov_base, buf, len);
    else
        memcpy(buf, iov.iov_base, len);
    vfu_sgl_put(ctx, sg, &iov, 1);
    return 0;
}

static void copy(vfu_ctx_t *ctx)
{
    uint64_t src = reg64(0x08), dst = reg64(0x10);
    uint32_t len = reg32(0x18);
    char *buf = len && len <= MAX_COPY ? malloc(len) : NULL;
    int ok = buf && transfer(ctx, src, len, buf, false) == 0 && transfer(ctx, dst, len, buf, true) == 0;
    free(buf);
    set32(0x1c, ok ? 2 : 3);
    printf("copy %#llx -> %#llx %u: %s\n", (unsigned long long)src, (unsigned long long)dst, len,
           ok ? "done" : strerror(errno));
    fflush(stdout);
    if (vfu_irq_trigger(ctx, 0) < 0)
        warn("vfu_irq_trigger");
}

static void wait_for(vfu_ctx_t *ctx)
{
    struct pollfd p = {.fd = vfu_get_poll_fd(ctx), .events = POLLIN};
    if (poll(&p, 1, -1) < 0 && errno != EINTR)
        err(EXIT_FAILURE, "poll");
}

int main(int argc, char *argv[])
{
    int opt;
    while ((opt = getopt(argc, argv, "d")) != -1) {
        if (opt != 'd')
            errx(EXIT_FAILURE, "usage: %s [-d] SOCKET", argv[0]);
        direct = true;
    }
    if (optind >= argc)
        errx(EXIT_FAILURE, "usage: %s [-d] SOCKET", argv[0]);
    set32(0, MAGIC);

    vfu_ctx_t *ctx = vfu_create_ctx(VFU_TRANS_SOCK, argv[optind], LIBVFIO_USER_FLAG_ATTACH_NB, NULL,
                                    VFU_DEV_TYPE_PCI);
    if (ctx == NULL)
        err(EXIT_FAILURE, "vfu_create_ctx");
    if (vfu_pci_init(ctx, VFU_PCI_TYPE_CONVENTIONAL, PCI_HEADER_TYPE_NORMAL, 0) < 0)
        err(EXIT_FAILURE, "vfu_pci_init");
    vfu_pci_set_id(ctx, 0x1b36, 0x10fe, 0x1af4, 0x1100);
    vfu_pci_set_class(ctx, 0xff, 0x00, 0x00); /* a class: Linux assigns BARs to a hot-plugged device */
    if (vfu_setup_region(ctx, VFU_PCI_DEV_BAR0_REGION_IDX, 0x1000, &bar0, VFU_REGION_FLAG_RW, NULL, 0, -1, 0) < 0)
        err(EXIT_FAILURE, "vfu_setup_region");
    if (vfu_setup_device_dma(ctx, 64, &dma_register, &dma_unregister) < 0)
        err(EXIT_FAILURE, "vfu_setup_device_dma");
    if (vfu_setup_device_nr_irqs(ctx, VFU_DEV_INTX_IRQ, 1) < 0)
        err(EXIT_FAILURE, "vfu_setup_device_nr_irqs");
    if (vfu_realize_ctx(ctx) < 0)
        err(EXIT_FAILURE, "vfu_realize_ctx");
    printf("serving %s\n", argv[optind]);
    fflush(stdout);

    for (;;) { /* one client at a time, for ever */
        while (vfu_attach_ctx(ctx) < 0) {
            if (errno != EAGAIN && errno != EWOULDBLOCK)
                err(EXIT_FAILURE, "vfu_attach_ctx");
            wait_for(ctx);
        }
        for (;;) {
            wait_for(ctx);
            if (vfu_run_ctx(ctx) < 0) {
                if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR || errno == EBUSY)
                    continue;
                if (errno == ENOTCONN)
                    break;
                err(EXIT_FAILURE, "vfu_run_ctx");
            }
            if (go) {
                go = false;
                copy(ctx);
            }
        }
        printf("client left\n");
        fflush(stdout);
    }
}
