"""The random stream of stochastic rounding: counter-based, kept apart from the global RNG.

Stochastic rounding (FP8 gradients, FP16/bf16 master write-back, MX/NVFP4 gradients) needs one
uniform draw per rounded element. Drawn from the global RNG, those draws shift every later draw of
the run, so an FP8 run's dropout masks drift from its FP32 twin's after the first step and the two
are no longer paired (issue 18). The engine calls :func:`seed_rounding` with ``trainer.seed``; from
then on :func:`rounding_generator` gives stochastic rounding a stream of its own.

Why a hand-written generator and not a ``torch.Generator``: a fused (``torch.compile``d) quantizer
cannot take a ``torch.Generator`` (it graph-breaks), and inductor's own in-kernel RNG does not
reproduce eager ``torch.rand``. Drawing with ``torch.rand`` first and passing the noise in costs a
full extra pass over memory, and on a CPU torch.rand alone (5 ns an element, Mersenne Twister) costs
more than the rest of the quantization. A *counter-based* stream computes each element's uniform
from (key, draw number, element index) with a few integer ops, the same in eager code and inside a
compiled kernel, where it fuses into the rounding at no memory cost: compiled and eager stochastic
rounding draw the same numbers.

The hash is lowbias32 (C. Wellons, hash-prospector: a 32-bit bijection with low avalanche bias),
applied twice and keyed per draw. Its state is one int32 counter of draws per device, on the device:
no host sync and no host-to-device copy per draw. Checkpoints store the counters (exact resume).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

# Mixed into the run seed so the rounding stream is not the global stream replayed.
_STREAM = 0x5EED_0F_5E
_seed: int | None = None
_streams: dict[str, RoundingStream] = {}

_MUL1 = 0x7FEB352D
_MUL2 = 0x846CA68B - (1 << 32)  # as a signed int32: torch has no uint32 arithmetic


def _lsr(x: Tensor, s: int) -> Tensor:
    """Logical right shift of int32 lanes holding uint32 bits (torch's >> is arithmetic)."""
    return (x >> s) & ((1 << (32 - s)) - 1)


def hash32(x: Tensor) -> Tensor:
    """lowbias32 on int32 lanes; multiplication wraps modulo 2**32 as in the uint32 original."""
    x = x ^ _lsr(x, 16)
    x = x * _MUL1
    x = x ^ _lsr(x, 15)
    x = x * _MUL2
    return x ^ _lsr(x, 16)


def draw_keys(keys: Tensor, counter: Tensor) -> tuple[Tensor, Tensor]:
    """The two per-draw keys (0-dim int32) from the stream's keys and its draw counter."""
    ka = hash32(counter ^ keys[0])
    return ka, hash32(ka ^ keys[1])


def uniform_from_index(index: Tensor, ka: Tensor, kb: Tensor) -> Tensor:
    """A uniform float32 in [0, 1) with 24 random bits (as ``torch.rand``) for each int32 index."""
    h = hash32(hash32(index ^ ka) ^ kb)
    return _lsr(h, 8).float() * 2.0**-24


def bits16_from_index(index: Tensor, ka: Tensor, kb: Tensor) -> Tensor:
    """16 random bits (int32 in [0, 65536)) for each int32 index: bf16 stochastic rounding's noise."""
    return _lsr(hash32(hash32(index ^ ka) ^ kb), 16)


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & (2**64 - 1)
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & (2**64 - 1)
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & (2**64 - 1)
    return x ^ (x >> 31)


def _signed32(v: int) -> int:
    v &= 0xFFFFFFFF
    return v - (1 << 32) if v >= 1 << 31 else v


class RoundingStream:
    """A counter-based uniform stream on one device (see the module docstring).

    ``take(n)`` reserves the next ``n`` draws and returns their first counter (a 0-dim int32 device
    tensor); draw ``i`` of a tensor with element index ``j`` gets ``uniform_from_index(j, *draw_keys(
    keys, first + i))``. Counting happens on the device: nothing is read back.
    """

    def __init__(self, seed: int, device: torch.device | str = "cpu") -> None:
        self.seed = int(seed)
        self.device = torch.device(device)
        mixed = _splitmix64(self.seed & (2**64 - 1))
        self.keys = torch.tensor([_signed32(mixed), _signed32(mixed >> 32)], dtype=torch.int32, device=self.device)
        self.counter = torch.zeros((), dtype=torch.int32, device=self.device)

    def take(self, n: int = 1) -> Tensor:
        first = self.counter.clone()
        self.counter.add_(n)
        return first

    def uniform(self, shape: tuple[int, ...] | torch.Size) -> Tensor:
        """The next draw as a dense float32 tensor (eager: the reference path materialises it)."""
        ka, kb = draw_keys(self.keys, self.take())
        return uniform_from_index(index_grid(shape, self.device), ka, kb)

    def bits16(self, shape: tuple[int, ...] | torch.Size) -> Tensor:
        ka, kb = draw_keys(self.keys, self.take())
        return bits16_from_index(index_grid(shape, self.device), ka, kb)

    def state_dict(self) -> dict[str, Any]:
        return {"seed": self.seed, "draws": int(self.counter)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.counter.fill_(int(state["draws"]))


def global_stream(device: torch.device | str) -> RoundingStream:
    """A one-draw stream keyed by the global RNG: stochastic rounding outside a run (nothing seeded)
    still draws its randomness from the global RNG, as it always did, through the counter hash."""
    stream = RoundingStream.__new__(RoundingStream)
    stream.seed, stream.device = -1, torch.device(device)
    stream.keys = torch.randint(-(2**31), 2**31 - 1, (2,), dtype=torch.int32, device=stream.device)
    stream.counter = torch.zeros((), dtype=torch.int32, device=stream.device)
    return stream


def index_grid(shape: tuple[int, ...] | torch.Size, device: torch.device | str) -> Tensor:
    """Row-major element indices (int32) of a tensor of ``shape``: the counter within one draw."""
    n = 1
    for s in shape:
        n *= int(s)
    if n >= 2**31:
        raise ValueError(f"stochastic rounding of {n} elements at once: the counter stream takes fewer than 2**31")
    return torch.arange(n, dtype=torch.int32, device=device).view(tuple(shape))


def seed_rounding(seed: int | None) -> None:
    """Give stochastic rounding its own stream from ``seed`` (None: back to the global RNG)."""
    global _seed
    _seed = seed
    _streams.clear()


def rounding_generator(device: torch.device | str) -> RoundingStream | None:
    """The run's stream on ``device``; None (the global RNG) when nothing is seeded."""
    if _seed is None:
        return None
    key = str(torch.device(device))
    s = _streams.get(key)
    if s is None:
        s = _streams[key] = RoundingStream((_seed * 1_000_003 + _STREAM) % 2**63, device)
    return s


def state_dict() -> dict[str, Any]:
    """The streams' states, for exact resume (checkpoint.rng_state)."""
    return {"seed": _seed, "streams": {k: s.state_dict() for k, s in _streams.items()}}


def load_state_dict(state: dict[str, Any] | None) -> None:
    if not state:
        return
    seed_rounding(state.get("seed"))
    # Checkpoints before the counter-based stream held torch.Generator states ("generators"): their
    # stream cannot continue here, so the rounding stream restarts from the seed.
    for key, s in (state.get("streams") or {}).items():
        stream = rounding_generator(key)
        if stream is not None:
            stream.load_state_dict(s)
