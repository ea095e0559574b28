"""The random stream of stochastic rounding, kept apart from the global RNG.

Stochastic rounding (FP8 gradients, FP16/bf16 master write-back) needs one uniform draw per
rounded element. Drawn from the global RNG, those draws shift every later draw of the run, so an
FP8 run's dropout masks drift from its FP32 twin's after the first step and the two are no longer
paired (issue 18). The engine calls :func:`seed_rounding` with ``trainer.seed``; from then on
:func:`rounding_generator` gives stochastic rounding a per-device generator of its own. Outside
a run (library use, unit tests) nothing is seeded and rounding uses the global RNG as before.
"""

from __future__ import annotations

from typing import Any

import torch

# Mixed into the run seed so the rounding stream is not the global stream replayed.
_STREAM = 0x5EED_0F_5E
_seed: int | None = None
_gens: dict[str, torch.Generator] = {}


def seed_rounding(seed: int | None) -> None:
    """Give stochastic rounding its own stream from ``seed`` (None: back to the global RNG)."""
    global _seed
    _seed = seed
    _gens.clear()


def rounding_generator(device: torch.device | str) -> torch.Generator | None:
    """The generator for rounding on ``device``; None (the global RNG) when nothing is seeded."""
    if _seed is None:
        return None
    key = str(torch.device(device))
    g = _gens.get(key)
    if g is None:
        g = torch.Generator(device=device)
        g.manual_seed((_seed * 1_000_003 + _STREAM) % 2**63)
        _gens[key] = g
    return g


def state_dict() -> dict[str, Any]:
    """The streams' states, for exact resume (checkpoint.rng_state)."""
    return {"seed": _seed, "generators": {k: g.get_state() for k, g in _gens.items()}}


def load_state_dict(state: dict[str, Any] | None) -> None:
    if not state:
        return
    seed_rounding(state.get("seed"))
    for key, s in (state.get("generators") or {}).items():
        g = rounding_generator(key)
        if g is not None:
            g.set_state(s)
