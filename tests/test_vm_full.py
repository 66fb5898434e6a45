"""The full image: systemd guest with the generic kernel, commands through qemu-guest-agent.
One booted guest is shared by this module's tests (a TCG boot takes tens of seconds)."""

import pytest

from dxpu_vfio.errors import GuestCommandFailed, GuestCommandTimeout

pytestmark = pytest.mark.vm


def test_generic_kernel_and_agent(full_vm, full_image):
    assert full_vm.run("uname -r").stdout.strip() == full_image.kernel_release


def test_exit_code_and_streams_through_guest_exec(full_vm):
    result = full_vm.run("echo out; echo err >&2; exit 5", check=False)
    assert (result.rc, result.stdout, result.stderr) == (5, "out\n", "err\n")
    with pytest.raises(GuestCommandFailed):
        full_vm.run("false")


def test_guest_userland_has_the_test_tools(full_vm):
    out = full_vm.run("python3 -c 'import pyudev; print(pyudev.__version__)'; "
                      "nvme version; fio --version; for t in lspci dxpu-mmio dxpu-dmabuf; do command -v $t; done").stdout
    assert "nvme version" in out and "fio-" in out
    assert "/usr/local/bin/dxpu-mmio" in out and "/usr/bin/lspci" in out


def test_generic_kernel_has_drm_and_gpio_modules(full_vm):
    out = full_vm.run("modinfo -F filename bochs virtio-gpu gpio-pci-idio-16 uio_pci_generic").stdout
    assert out.count(".ko") == 4, out


def test_lspci_shows_the_hotplug_root_ports(full_vm):
    out = full_vm.run("lspci -n").stdout
    assert out.count("1b36:000c") == 4, out


def test_agent_command_timeout(full_vm):
    with pytest.raises(GuestCommandTimeout):
        full_vm.run("sleep 20", timeout=2)
    assert full_vm.run("echo still-alive").stdout == "still-alive\n"


def test_a_long_command_is_polled_a_few_times_not_every_50_ms(full_vm):
    """Each guest-exec-status poll costs the TCG guest about 20 ms of CPU (the agent
    answers and logs it through journald): at one poll per 50 ms a command's wait took
    40-50 % of a vCPU from the workload it ran. The waits grow to 0.25 s. Counted as the
    channel sent them: the agent's own journal (``journalctl -t qemu-ga``) came back empty
    once in a CI run, and a count of nothing is no count."""
    result = full_vm.run("sleep 3")
    assert result.rc == 0 and 3 <= result.polls <= 25, f"{result.polls} polls of a 3 s command ({result})"


def test_hotplug_reported_by_the_guest_udev_agent(full_vm):
    """On the full image the guest's own udev (pyudev agent) confirms the plug."""
    from dxpu_vfio.lab import hotplug
    att = hotplug.attach(full_vm, "testdev")
    try:
        add = next(e for e in att.guest_events if e["action"] == "add")
        assert (add["bdf"], add["vendor"], add["device"]) == (att.guest_bdf, "0x1b36", "0x10f0")
        lspci = full_vm.run(f"lspci -n -s {att.guest_bdf[5:]}").stdout
        assert "ff00: 1b36:10f0" in lspci
        assert "match=yes" in full_vm.run(f"dxpu-testdev {att.guest_bdf} dma-copy 4096").stdout
    finally:
        hotplug.detach(att)
    assert full_vm.run(f"lspci -n -s {att.guest_bdf[5:]}").stdout == ""
