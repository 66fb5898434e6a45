#!/usr/bin/env bash
# libvfio-user's sample servers, built beside the project for the peer-software tests
# (tests/test_libvfio_user.py): an external vfio-user server that is not ours. No Debian
# suite packages libvfio-user, so this builds it from a source checkout:
#   $LIBVFIO_USER_SRC, else $DXPU_CACHE/src/libvfio-user (DXPU_CACHE: ~/.cache/dxpu-vfio)
# (git clone https://github.com/nutanix/libvfio-user into it). The build goes to
# $DXPU_CACHE/libvfio-user: the library, its samples/ (gpio-pci-idio-16, null) and lvu-dma,
# our test peer on their library (tests/peers/lvu_dma.c). samples/server is not built: its
# 12 KiB BAR1 fails libvfio-user's own power-of-two check at this version.
# Needs: meson ninja-build gcc pkg-config libjson-c-dev libcmocka-dev (scripts/setup.sh
# installs them). Re-running rebuilds only what changed. Exit 2: no source.
set -euo pipefail
cache=${DXPU_CACHE:-$HOME/.cache/dxpu-vfio}
src=${LIBVFIO_USER_SRC:-$cache/src/libvfio-user}
build=$cache/libvfio-user
if [ ! -f "$src/meson.build" ] || [ ! -f "$src/samples/server.c" ]; then
    echo "libvfio-user source not found in $src" >&2
    echo "  get it: git clone https://github.com/nutanix/libvfio-user $src  (or set LIBVFIO_USER_SRC)" >&2
    exit 2
fi
for tool in meson ninja pkg-config; do
    command -v "$tool" >/dev/null || { echo "$tool is missing: run scripts/setup.sh" >&2; exit 1; }
done
if [ ! -f "$build/build.ninja" ]; then
    meson setup "$build" "$src" -Dbuildtype=release >"$cache/libvfio-user-setup.log" 2>&1 \
        || { tail -20 "$cache/libvfio-user-setup.log" >&2; exit 1; }
fi
ninja -C "$build" samples/gpio-pci-idio-16 samples/null >/dev/null  # and the library they link
# our test peer on their library (tests/peers/lvu_dma.c: a DMA engine, by messages or direct)
peer=tests/peers/lvu_dma.c
cd "$(dirname "$0")/.."
if [ ! -x "$build/lvu-dma" ] || [ "$peer" -nt "$build/lvu-dma" ] || [ "$build/lib/libvfio-user.so" -nt "$build/lvu-dma" ]; then
    gcc -O2 -Wall -Werror -I"$src/include" "$peer" -o "$build/lvu-dma" \
        -L"$build/lib" -lvfio-user -Wl,-rpath,"$build/lib"
fi
echo "libvfio-user: $build/lvu-dma, samples in $build/samples"
