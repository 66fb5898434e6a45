"""vfio-user: the protocol codec, the server QEMU connects to, and a client."""
