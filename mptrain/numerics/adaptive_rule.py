"""Adaptive loss scaling's rule (Zhao et al. 2019): the per-layer scale, the scale at a branch
join and the scale that starts the chain at the outputs. Device ops on FP32 statistics, no host
sync; ``mptrain.numerics.adaptive_scaling`` applies them during backprop.

The rule (``layer_scale``, the ``approx_range`` method of the authors' released code). In the
backward pass of every Conv/Linear layer the incoming gradient gy already carries a cumulative
scale P. From FP32 statistics of gy and of the weight W::

    sigma = sqrt((sg^2 + mg^2) * (sw^2 + mw^2)) * sqrt(0.5 * fan_in)
    s = u_min / (sqrt(2) * erfinv(n_uf) * sigma);  s = max(s, 1)
    s = min(s, (u_max / fan_in) / o_max)          # o_max = max |g_ext * W_ext| over min/max of gy, W
    s = min(s, accum_cap / P, layer_cap);  s = 2 ** floor(log2(s))

``fan_in`` is the authors' ``get_fan_in``: the length of the sum that forms one element of the
input gradient, W.shape[0] for Linear and out_channels * prod(kernel) for Conv (per group for
grouped convolutions, where the authors' code used all output channels).
"""

from __future__ import annotations

import functools
import math

import torch
from torch import Tensor, nn


def backward_fan_in(module: nn.Module) -> int:
    """Terms summed into one element of the input gradient (the authors' ``get_fan_in``)."""
    w = module.weight
    if isinstance(module, nn.Linear):
        return int(w.shape[0])
    if isinstance(module, nn.modules.conv._ConvNd):
        kernel = math.prod(int(k) for k in w.shape[2:])
        # Conv weight is (out, in/groups, *k); transposed conv weight is (in, out/groups, *k).
        per_group_out = int(w.shape[1]) if module.transposed else int(w.shape[0]) // module.groups
        return per_group_out * kernel
    raise TypeError(f"no fan_in rule for {type(module).__name__}")


@functools.lru_cache(maxsize=8)
def _erfinv_term(n_uf: float) -> float:
    """sqrt(2) * erfinv(n_uf), computed once on the host (a CPU tensor: no device sync)."""
    return math.sqrt(2.0) * float(torch.special.erfinv(torch.tensor(n_uf, dtype=torch.float64)))


def layer_scale(
    gy: Tensor,
    weight: Tensor,
    prev_scale: Tensor | float,
    fan_in: int,
    *,
    u_min: float = 2.0**-24,
    u_max: float = 65504.0,
    n_uf: float = 1e-3,
    layer_cap: float = 16.0,
    accum_cap: float = 1024.0,
    power_of_two: bool = True,
) -> Tensor:
    """The per-layer scale s for gradient ``gy`` (carrying ``prev_scale``) entering a layer with
    weight ``weight``. Device ops only; statistics in FP32. A non-finite result (gy already held
    Inf/NaN: the step will be skipped) becomes 1 so that it is never cached."""
    # Two reads of gy in its own dtype and no FP32 copy (there were a copy and three reductions
    # over it): the rule needs only sqrt(E[x^2]) (the authors' sqrt(std^2 + mean^2), population
    # variance) and max|x| (their o_max, the largest |product| of gy's and W's min/max, is
    # max|gy| * max|W|). The norm accumulates in FP32; min and max are exact in any dtype.
    g_rms, g_amax = _rms_and_amax(gy.detach())
    w_rms, w_amax = _rms_and_amax(weight.detach())
    sigma = g_rms * w_rms * math.sqrt(0.5 * fan_in)
    one = torch.ones_like(sigma)
    # sigma == 0 (all-zero gy or W): the authors return 1 before the overflow bound.
    s = torch.where(sigma > 0, u_min / (_erfinv_term(n_uf) * sigma), one).clamp(min=1.0)
    o_max = g_amax * w_amax
    s = torch.minimum(s, (u_max / fan_in) / o_max)  # o_max == 0 gives inf: no bound
    s = torch.minimum(s, accum_cap / torch.as_tensor(prev_scale, dtype=s.dtype, device=s.device))
    s = s.clamp(max=layer_cap)
    s = torch.where(torch.isfinite(s) & (s > 0), s, one)
    if power_of_two:
        s = torch.exp2(torch.floor(torch.log2(s)))
    return s


def _rms_and_amax(x: Tensor) -> tuple[Tensor, Tensor]:
    """sqrt(E[x^2]) and max|x| in FP32, one reduction each over ``x`` in its own dtype."""
    rms = torch.linalg.vector_norm(x, dtype=torch.float32) / math.sqrt(x.numel())
    lo, hi = torch.aminmax(x)  # faster than an inf-norm on CPU, the same on CUDA
    return rms, torch.maximum(-lo.float(), hi.float())


def output_scale(
    amax: Tensor, *, u_max: float = 65504.0, accum_cap: float = 1024.0, power_of_two: bool = True
) -> Tensor:
    """The scale that starts the chain at the model's outputs (``init_scale=auto``).

    ``amax``: the largest |dL/d output| in FP32, before any half-precision cast. As large as the
    format allows without overflow (amax * s <= u_max, the authors' overflow bound for a tensor
    that is not multiplied by a weight) and no larger than ``accum_cap``, the bound every
    cumulative scale obeys. Below 1 only when the output gradient itself would overflow.
    """
    amax = amax.float()
    s = torch.minimum(u_max / amax, torch.full_like(amax, accum_cap))  # amax == 0 gives inf: the cap
    s = torch.where(torch.isfinite(s) & (s > 0), s, torch.ones_like(s))
    if power_of_two:
        s = torch.exp2(torch.floor(torch.log2(s)))
    return s


def join_scale(true_amax: Tensor, scales: Tensor, u_max: float = 65504.0) -> Tensor:
    """The common scale for gradients joining at a fork (the authors' ``rescaling``).

    ``true_amax[i]`` = max|g_i| / P_i, ``scales[i]`` = P_i. The largest P_i with
    max(true_amax) * P_i < u_max; if none fits, the smallest P_i halved until it does.
    """
    m = true_amax.max()
    ok = m * scales < u_max
    best = torch.where(ok, scales, torch.zeros_like(scales)).max()
    smallest = scales.min()
    halvings = (torch.floor(torch.log2(m * smallest / u_max)) + 1).clamp(min=0)
    target = torch.where(ok.any(), best, smallest * torch.exp2(-halvings))
    return torch.where(torch.isfinite(target) & (target > 0), target, scales.max())


def _amax(g: Tensor) -> Tensor:
    if g.numel() == 0:
        return torch.zeros((), device=g.device)
    lo, hi = torch.aminmax(g.detach())
    return torch.maximum(-lo.float(), hi.float())
