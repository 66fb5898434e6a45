"""What a lab link is asked to do to the packets of one direction, and its spellings.

One :class:`Impairment` per direction (``up``: host -> box, ``down``: box -> host). The
same values drive kernel netem (:func:`netem_args`) where the kernel has sch_netem and the
lab's packet emulator (``dxpu_vfio/lab/netemu.py``) where it has not, so a test reads the
same whatever the machine. Units on the command line: ``50us``/``1.5ms``/``0.2s``,
``0.1%``, ``10gbit``/``500mbit``/``64kbit``.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from dxpu_vfio.errors import DxpuError

DISTRIBUTIONS = ("normal", "uniform")


class ImpairmentError(DxpuError):
    pass


@dataclass
class Impairment:
    """Per direction. Loss is random (``loss``) or bursty (Gilbert-Elliott: ``ge_p`` the
    chance per packet to go from the good state to the bad one, ``ge_r`` back, a packet is
    lost with ``ge_loss_bad`` in the bad state and ``ge_loss_good`` in the good one), both
    may be on. Jitter is drawn per packet from ``distribution`` (normal: sigma = jitter,
    cut at 0; uniform: delay +- jitter); the packets of a direction keep their order
    unless ``reorder`` sends a packet at once, past the ones held. ``rate`` (bit/s) is the
    kernel's TBF where netem is absent. Probabilities are fractions (0.001 = 0.1 %)."""

    delay_us: float = 0.0
    jitter_us: float = 0.0
    distribution: str = "normal"
    loss: float = 0.0
    ge_p: float = 0.0
    ge_r: float = 1.0
    ge_loss_bad: float = 1.0
    ge_loss_good: float = 0.0
    reorder: float = 0.0
    duplicate: float = 0.0
    rate_bps: float = 0.0

    def __post_init__(self) -> None:
        if self.distribution not in DISTRIBUTIONS:
            raise ImpairmentError(f"distribution {self.distribution!r}: one of {', '.join(DISTRIBUTIONS)}")
        for name in ("loss", "ge_p", "ge_r", "ge_loss_bad", "ge_loss_good", "reorder", "duplicate"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ImpairmentError(f"{name} = {getattr(self, name)}: a fraction between 0 and 1")
        for name in ("delay_us", "jitter_us", "rate_bps"):
            if getattr(self, name) < 0:
                raise ImpairmentError(f"{name} = {getattr(self, name)}: must not be negative")

    @property
    def per_packet(self) -> bool:
        """Whether it acts on single packets (loss, reordering, duplication): then the
        emulator must see wire-sized packets, not 64 KiB offloaded ones."""
        return bool(self.loss or self.ge_p or self.reorder or self.duplicate)

    @property
    def needs_emulator(self) -> bool:
        """Anything besides a rate (which TBF does in the kernel)."""
        return bool(self.delay_us or self.jitter_us or self.per_packet)

    @property
    def expected_loss(self) -> float:
        """The long-run loss rate asked for: random loss on top of Gilbert-Elliott's."""
        ge = 0.0
        if self.ge_p:
            bad = self.ge_p / (self.ge_p + self.ge_r)
            ge = bad * self.ge_loss_bad + (1 - bad) * self.ge_loss_good
        return 1 - (1 - self.loss) * (1 - ge)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, raw: dict) -> "Impairment":
        return cls(**{k: v for k, v in raw.items() if k in {f.name for f in dataclasses.fields(cls)}})

    def replace(self, **changes: object) -> "Impairment":
        return dataclasses.replace(self, **changes)


_TIME = {"ns": 1e-3, "us": 1.0, "µs": 1.0, "ms": 1e3, "s": 1e6, "": 1.0}
_RATE = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12, "bps": 8, "kbps": 8e3,
         "mbps": 8e6, "gbps": 8e9, "": 1}


def _split(text: str, what: str) -> tuple[float, str]:
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e-?[0-9]+)?)\s*([a-zA-Zµ%]*)\s*", text)
    if not m:
        raise ImpairmentError(f"cannot read {what} {text!r}")
    return float(m.group(1)), m.group(2).lower()


def parse_time_us(text: str) -> float:
    """``50us``, ``1.5ms``, ``0.2s``, ``100`` (µs) -> µs."""
    value, unit = _split(text, "time")
    if unit not in _TIME:
        raise ImpairmentError(f"time {text!r}: use ns, us, ms or s")
    return value * _TIME[unit]


def parse_fraction(text: str) -> float:
    """``0.1%`` -> 0.001; a bare number is a fraction (``0.001``)."""
    value, unit = _split(text, "probability")
    if unit not in ("%", ""):
        raise ImpairmentError(f"probability {text!r}: a percentage (0.1%) or a fraction")
    return value / 100 if unit == "%" else value


def parse_rate_bps(text: str) -> float:
    """``10gbit``, ``500mbit``, ``1gbps`` (bytes) -> bit/s."""
    value, unit = _split(text, "rate")
    if unit not in _RATE:
        raise ImpairmentError(f"rate {text!r}: use bit, kbit, mbit, gbit (or kbps, mbps, gbps for bytes)")
    return value * _RATE[unit]


def parse_gilbert(text: str) -> dict:
    """``P,R[,LOSS_BAD[,LOSS_GOOD]]`` (percentages or fractions) -> Impairment fields."""
    parts = [parse_fraction(p) for p in text.split(",")]
    if not 2 <= len(parts) <= 4:
        raise ImpairmentError(f"Gilbert-Elliott {text!r}: P,R[,LOSS_BAD[,LOSS_GOOD]], e.g. 1%,25%")
    names = ("ge_p", "ge_r", "ge_loss_bad", "ge_loss_good")
    return dict(zip(names, parts))


def config_text(link: dict[str, Impairment]) -> str:
    """The emulators' config file (the C one reads no JSON): ``up key=value ...`` per direction."""
    return "".join(f"{d} " + " ".join(f"{k}={v}" for k, v in imp.to_dict().items()) + "\n"
                   for d, imp in link.items())


def parse_config_text(text: str) -> dict[str, Impairment]:
    out = {}
    for line in text.splitlines():
        direction, *pairs = line.split()
        raw = dict(p.split("=", 1) for p in pairs)
        out[direction] = Impairment.from_dict({k: v if k == "distribution" else float(v) for k, v in raw.items()})
    return out


def netem_args(imp: Impairment) -> list[str]:
    """The ``tc qdisc replace ... netem`` arguments that ask the kernel for ``imp``."""
    args = ["netem", "limit", "100000"]
    if imp.delay_us or imp.jitter_us:
        args += ["delay", f"{imp.delay_us:g}us"]
        if imp.jitter_us:
            args += [f"{imp.jitter_us:g}us", "distribution", imp.distribution]
    if imp.loss:
        args += ["loss", "random", f"{imp.loss * 100:g}%"]
    elif imp.ge_p:
        args += ["loss", "gemodel", f"{imp.ge_p * 100:g}%", f"{imp.ge_r * 100:g}%",
                 f"{imp.ge_loss_bad * 100:g}%", f"{imp.ge_loss_good * 100:g}%"]  # netem: 1-h, 1-k
    if imp.duplicate:
        args += ["duplicate", f"{imp.duplicate * 100:g}%"]
    if imp.reorder:
        args += ["reorder", f"{imp.reorder * 100:g}%"]
    if imp.rate_bps:
        args += ["rate", f"{int(imp.rate_bps)}bit"]
    return args


def tbf_args(rate_bps: float) -> list[str]:
    """TBF for a rate: a bucket of 1 ms at that rate (at least two 64 KiB offloaded
    packets, so it does not split them), up to 20 ms queued."""
    burst = max(int(rate_bps / 8 / 1000), 2 * 65536 + 2048)
    return ["tbf", "rate", f"{int(rate_bps)}bit", "burst", str(burst), "latency", "20ms"]
