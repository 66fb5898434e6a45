"""The host half of the guest command channels (:mod:`dxpu_vfio.vms.guest_exec`) against a
guest that answers wrong. The guest end is the fuzzer's stand-in for the tiny image's
serial agent and for qemu-guest-agent (:class:`dxpu_vfio.fuzz.guest_channel.FakeGuest`,
on a real UNIX socket): these tests are about what the host does with the bytes, and a
real guest's agent does not send them. Booted guests use both channels in
``test_vm_tiny.py`` and ``test_vm_full.py``."""

from __future__ import annotations

import pytest

from dxpu_vfio.fuzz import guest_channel
from dxpu_vfio.fuzz.guest_channel import FakeGuest, _Plan
from dxpu_vfio.vms import guest_exec
from dxpu_vfio.vms.guest_exec import AgentChannel, GuestProtocolError, SerialChannel


@pytest.fixture
def channels(tmp_path):
    """(plan, {"serial": channel, "agent": channel}) on fake guests; closed at the end."""
    plan = _Plan()
    guests = {name: FakeGuest(tmp_path / f"{name}.sock", name == "agent", plan) for name in ("serial", "agent")}
    opened = {"serial": SerialChannel(guests["serial"].path, alive=lambda: True),
              "agent": AgentChannel(guests["agent"].path, alive=lambda: True)}
    for channel in opened.values():
        channel.open(5)
    yield plan, opened
    for channel in opened.values():
        channel.close()
    for guest in guests.values():
        guest.close()


def right(channel, script="echo hi"):
    result = channel.run(script, 5)
    assert (result.rc, result.stdout) == (0, f"ran {script}\n"), result
    return result


def test_a_serial_exit_code_that_is_not_a_number_is_named_and_the_next_command_runs(channels):
    plan, ch = channels
    refused = 0
    for seed in range(24):
        plan.set("rc", seed)
        try:
            result = ch["serial"].run("echo one", 5)
            assert isinstance(result.rc, int) and result.stdout == "ran echo one\n"  # e.g. -1: a number
        except GuestProtocolError as exc:
            assert "not a number" in exc.message
            refused += 1
        plan.set("", 0)
        right(ch["serial"])
    assert refused >= 12


def test_serial_output_that_is_not_base64_is_refused_not_decoded_into_other_text(channels):
    plan, ch = channels
    plan.set("b64", 0)
    with pytest.raises(GuestProtocolError, match="not base64"):
        ch["serial"].run("echo one", 5)
    plan.set("", 0)
    right(ch["serial"])


def test_serial_output_past_the_limit_is_refused_and_the_channel_goes_on(channels, monkeypatch):
    plan, ch = channels
    monkeypatch.setattr(guest_channel, "MAX_OUTPUT", guest_exec.MAX_OUTPUT)  # the guest floods past the real one
    plan.set("flood", 0)
    with pytest.raises(GuestProtocolError, match=f"more than {guest_exec.MAX_OUTPUT} bytes of output"):
        ch["serial"].run("echo one", 30)
    plan.set("", 0)
    right(ch["serial"], "echo two")


@pytest.mark.parametrize("kind", ["shape", "json", "fields", "bytes"])
def test_an_agent_answer_of_another_shape_is_a_protocol_error_and_the_next_command_runs(channels, kind):
    """A reply that is not JSON, not an object, or has fields of other types is a
    VmError naming what came (never a KeyError or AttributeError out of the runner); the
    agent's sync then skips what is left of it."""
    plan, ch = channels
    for seed in range(12):
        plan.set(kind, seed)
        try:
            ch["agent"].run("echo one", 1)
        except guest_exec.VmError as exc:
            assert exc.message
        plan.set("", 0)
        right(ch["agent"], f"echo {seed}")


def test_a_line_past_the_agents_limit_is_refused_and_the_rest_of_it_skipped(channels, monkeypatch):
    """qemu-guest-agent's longest honest line is a guest-exec-status of 2 x 16 MiB output
    in base64; a longer one is refused when the limit is passed, not read to its end
    into memory, and the command after it gets its own answer."""
    plan, ch = channels
    monkeypatch.setattr(guest_channel, "MAX_LINE", guest_exec.AGENT_MAX_LINE)
    plan.set("long", 0)
    with pytest.raises(GuestProtocolError, match=f"line of .* {guest_exec.AGENT_MAX_LINE}"):
        ch["agent"].run("echo one", 30)
    plan.set("", 0)
    right(ch["agent"], "echo two")


def test_an_agent_that_hangs_up_mid_answer_is_a_dead_guest(channels):
    plan, ch = channels
    plan.set("close", 1)
    with pytest.raises(guest_exec.GuestDied):
        ch["agent"].run("echo one", 5)
