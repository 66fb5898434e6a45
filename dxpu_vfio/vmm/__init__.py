"""VM control: the QMP session, VMs as hot-plug targets (QMP socket or libvirt domain),
root ports, and the hot-plug error family."""
