"""The VM runner: QEMU discovery, guest images, booting guests, running commands in them,
and libvirt domains defined for dxpu."""
