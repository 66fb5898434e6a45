"""The host proxy (DxPU_PROXY, host side): one vfio-user server per attached device,
serving a local device model or forwarding every access over the link to a GPU box."""
