"""The precision plan: which format each GEMM layer computes in, why, and its share of the FLOPs.

A layer quantized by mistake, or kept high without the user knowing, is the most common complaint
about low-precision training tools; and a mode can convert almost nothing (torchao's float8 on
ResNet-50 converts the classifier alone, a sliver of the FLOPs). So before training the engine
measures one forward pass of a real batch and prints, per GEMM layer (Linear, Conv, ConvTranspose):
its format, the reason, and its forward FLOPs; ``summary.json`` gets the same as ``precision_plan``.

FLOPs are counted per layer from the shapes the layer sees (2 x multiply-accumulates), and the
denominator is every matmul and convolution of the forward pass as ``FlopCounterMode`` counts them
(``flop_counter``: with SDPA's CPU kernel on every supported torch), so GEMMs outside layers
(attention's QK^T and AV) count as not converted.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import Tensor, nn

from mptrain.numerics.convert import gemm_kind

# The layers whose FLOPs the plan counts (``_forward_flops``); their kind is the converters' own.
GEMM_TYPES: tuple[type[nn.Module], ...] = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose2d, nn.LSTM,
                                           nn.MultiheadAttention)


@dataclass
class LayerPlan:
    name: str
    kind: str  # linear | conv2d | conv_transpose2d ...
    format: str  # e.g. bf16, fp8 e4m3 / e5m2 grads, mxfp4, fp32
    reason: str
    flops: int = 0  # forward FLOPs of one step's batch (training is about 3x)
    low_precision: bool = False  # below 16 bits (FP8/FP6/FP4): what the fraction counts


@dataclass
class PrecisionPlan:
    layers: list[LayerPlan]
    total_flops: int  # every forward matmul/convolution, layers or not

    @property
    def low_precision_flop_fraction(self) -> float:
        low = sum(layer.flops for layer in self.layers if layer.low_precision)
        return low / self.total_flops if self.total_flops else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "layers": [asdict(layer) for layer in self.layers],
            "total_flops": self.total_flops,
            "low_precision_flop_fraction": self.low_precision_flop_fraction,
        }


def _inner(module: nn.Module) -> nn.Module:
    """The network inside DDP's and torch.compile's wrappers."""
    inner = module.module if isinstance(module, nn.parallel.DistributedDataParallel) else module
    return getattr(inner, "_orig_mod", inner)


def gemm_layers(modules: dict[str, nn.Module]) -> list[tuple[str, nn.Module]]:
    """Every GEMM layer of the task's networks, named ``network.layer`` when there are several; a
    layer inside another (MultiheadAttention's out_proj) belongs to it, as the converters decide."""
    out = []
    for net, module in modules.items():
        found = [(name, m) for name, m in _inner(module).named_modules() if isinstance(m, GEMM_TYPES)]
        parents = [name for name, m in found if isinstance(m, nn.MultiheadAttention)]
        for name, m in found:
            if not any(name.startswith(p + ".") for p in parents):
                out.append((f"{net}.{name}" if len(modules) > 1 else name, m))
    return out


def _forward_flops(module: nn.Module, x: Tensor, y: Tensor) -> int:
    """2 x multiply-accumulates of the layer's own GEMM, from the shapes it saw."""
    if isinstance(module, nn.Linear):
        return 2 * module.in_features * module.out_features * (x.numel() // module.in_features)
    if isinstance(module, nn.LSTM):  # per layer and direction: 4 gates over [input, hidden], then the projection
        steps = x.numel() // module.input_size
        hidden, out = module.hidden_size, module.proj_size or module.hidden_size
        dirs = 2 if module.bidirectional else 1
        total = 0
        for layer in range(module.num_layers):
            inputs = module.input_size if layer == 0 else out * dirs
            total += dirs * 2 * steps * (4 * hidden * (inputs + out) + (hidden * out if module.proj_size else 0))
        return total
    if isinstance(module, nn.modules.conv._ConvNd):
        w = module.weight
        if module.transposed:  # each input element meets every (out_channel/groups x kernel) weight
            return 2 * x.numel() * (w.shape[1] * math.prod(w.shape[2:]))
        return 2 * y.numel() * (w.shape[1] * math.prod(w.shape[2:]))
    return 0


def _sdpa_forward_flops(q: list[int], k: list[int], v: list[int], *args: Any, **kwargs: Any) -> int:
    """QK^T and AV of attention over (batch, heads, seq, dim) shapes, as torch counts them (the
    causal mask's skipped half included)."""
    b, h, sq, dq = q
    sk, dv = k[-2], v[-1]
    return 2 * b * h * sq * sk * (dq + dv)


def _sdpa_backward_flops(grad_out: list[int], q: list[int], k: list[int], v: list[int], *args: Any,
                         **kwargs: Any) -> int:
    """The fused backward: QK^T recomputed, dO V^T, P^T dO, dS K and dS^T Q, as torch counts them."""
    b, h, sq, dq = q
    sk, dv = k[-2], v[-1]
    return 2 * b * h * sq * sk * (3 * dq + 2 * dv)


def flop_counter() -> Any:
    """torch's ``FlopCounterMode`` (no display), counting SDPA's CPU flash kernel on every torch.

    torch counts the CUDA attention kernels, but the CPU one only from 2.15 on: 2.11 counts 0 for a
    causal SDPA on CPU, and the plan's denominator and the bench's MFU would leave attention out.
    Where torch's own registry lacks the op, these formulas (torch's, from the shapes) fill it in.
    """
    from torch.utils.flop_counter import FlopCounterMode, flop_registry

    aten = torch.ops.aten
    mapping = {op: f for op, f in (
        (aten._scaled_dot_product_flash_attention_for_cpu, _sdpa_forward_flops),
        (aten._scaled_dot_product_flash_attention_for_cpu_backward, _sdpa_backward_flops),
    ) if op not in flop_registry}
    return FlopCounterMode(display=False, custom_mapping=mapping)


def uncovered_layers(modules: dict[str, nn.Module]) -> list[tuple[str, nn.Module, str, str]]:
    """What a converter leaves high that is not a GEMM layer: (name, module, kind, reason) of every
    embedding, and of every leaf module with a ``weight`` matrix that is no layer type mptrain knows
    (transformers' GPT-2 ``Conv1D``, a user's own matmul layer). Listed in an emulated mode's plan so
    that nothing the emulation skips is dropped silently."""
    out = []
    gemm_ids = {id(m) for _, m in gemm_layers(modules)}
    for net, module in modules.items():
        for name, m in _inner(module).named_modules():
            full = f"{net}.{name}" if len(modules) > 1 else name
            if isinstance(m, nn.Embedding | nn.EmbeddingBag):
                out.append((full, m, "embedding", "a table lookup: no GEMM to quantize"))
            elif id(m) in gemm_ids or gemm_kind(m) is not None or next(m.children(), None) is not None:
                continue
            elif isinstance(getattr(m, "weight", None), nn.Parameter) and m.weight.dim() >= 2:
                kind = type(m).__name__
                out.append((full, m, kind.lower(), f"{kind}: a layer type no converter knows; computes as it is"))
    return out


@torch.no_grad()
def measure(modules: dict[str, nn.Module], forward: Callable[[], Any],
            extra: Sequence[nn.Module] = ()) -> tuple[dict[int, int], int]:
    """Run ``forward`` once with hooks on every GEMM layer: (FLOPs by id(module), total FLOPs).
    ``extra``: modules whose FLOPs are what the counter saw while they ran (layers without a formula).

    Eager (a compiled module runs uncompiled here, so its hooks fire and nothing recompiles), in
    eval mode (no dropout draws), and under the caller's RNG: ``fork_rng`` keeps the run's stream.
    """
    flops: dict[int, int] = {}
    counter = flop_counter()
    entered: dict[int, int] = {}

    def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        out = output[0] if isinstance(output, tuple) else output  # an LSTM returns (out, state)
        if args and isinstance(args[0], Tensor) and isinstance(out, Tensor):
            flops[id(module)] = flops.get(id(module), 0) + _forward_flops(module, args[0], out)

    def enter(module: nn.Module, args: tuple[Any, ...]) -> None:
        entered[id(module)] = int(counter.get_total_flops())

    def leave(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        flops[id(module)] = flops.get(id(module), 0) + int(counter.get_total_flops()) - entered.pop(id(module))

    layers = gemm_layers(modules)
    handles = [m.register_forward_hook(hook) for _, m in layers if not isinstance(m, nn.MultiheadAttention)]
    for m in [*extra, *(m for _, m in layers if isinstance(m, nn.MultiheadAttention))]:
        handles += [m.register_forward_pre_hook(enter), m.register_forward_hook(leave)]
    was_training = {name: m.training for name, m in modules.items()}
    try:
        for m in modules.values():
            m.eval()
        with torch.random.fork_rng(devices=_cuda_devices(modules)), torch.compiler.set_stance("force_eager"), counter:
            forward()
    finally:
        for h in handles:
            h.remove()
        for name, m in modules.items():
            m.train(was_training[name])
    return flops, int(counter.get_total_flops())


def _cuda_devices(modules: dict[str, nn.Module]) -> list[int]:
    return sorted({p.device.index or 0 for m in modules.values() for p in m.parameters() if p.is_cuda})


def layer_format(module: nn.Module, default: tuple[str, str]) -> tuple[str, str, bool]:
    """(format, reason, below 16 bits) of one layer. The FP8 and MX converters tag every GEMM layer
    they considered with its decision (``precision_decision``); any other layer computes in the
    mode's own dtype, ``default``."""
    decision = getattr(module, "precision_decision", None)
    if decision is None:
        return default[0], default[1], False
    if decision.format == "high":
        return default[0], f"kept high: {decision.reason}", False
    return decision.format, decision.reason, True


_SHORT = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
OUTSIDE = "<outside layers>"  # the plan row of the matmuls no layer holds


def build_plan(modules: dict[str, nn.Module], forward: Callable[[], Any], default: tuple[str, str],
               uncovered: bool = False) -> PrecisionPlan:
    """The plan of the task's networks after the precision prepared them. ``default``: (format,
    reason) of a layer the mode computes in its own dtype (e.g. ("bf16", "autocast")).

    ``uncovered`` (the emulated and FP8 modes, which convert some layer types only): the plan also
    lists what they leave high that is not a GEMM layer (``uncovered_layers``), and one row for the
    matmuls that run outside any layer (attention's QK^T and AV), so that nothing is dropped
    silently. A GEMM layer whose weight is an embedding's (a tied LM head) says so."""
    others = uncovered_layers(modules) if uncovered else []
    flops, total = measure(modules, forward, [m for _, m, _, _ in others])
    tied = {id(m.weight): name for name, m, kind, _ in others if kind == "embedding"}
    layers = []
    for name, m in gemm_layers(modules):
        fmt, reason, low = layer_format(m, default)
        if id(getattr(m, "weight", None)) in tied:
            reason += f"; weight tied to {tied[id(m.weight)]}"
        layers.append(LayerPlan(name, gemm_kind(m) or "", fmt, reason, flops.get(id(m), 0), low))
    if uncovered:
        inside = {id(m) for _, m in gemm_layers(modules)}
        for name, m, kind, reason in others:
            # a layer's FLOPs less those of the GEMM layers inside it (counted in their own rows)
            own = flops.get(id(m), 0) - sum(flops.get(id(c), 0) for c in m.modules() if id(c) in inside)
            # a lookup returns its table's values: the weight's dtype, whatever the autocast
            fmt = _SHORT.get(m.weight.dtype, str(m.weight.dtype)) if kind == "embedding" else default[0]
            layers.append(LayerPlan(name, kind, fmt, f"kept high: {reason}", max(own, 0), False))
        outside = total - sum(layer.flops for layer in layers)
        if outside > 0:
            layers.append(LayerPlan(OUTSIDE, "matmul", default[0], "kept high: matmuls outside any layer "
                                    "(attention's QK^T and AV, functional GEMMs): nothing to convert", outside))
    return PrecisionPlan(layers, max(total, sum(layer.flops for layer in layers)))


def plan_rows(plan: PrecisionPlan, per_layer: bool = False) -> list[tuple[str, str, str, int, str]]:
    """(layers, format, why, FLOPs, share) per console row. Layers that share a format and a reason
    share a row ("53 conv2d + 1 linear"); a layer that differs from the rest keeps its own, by name.
    ``per_layer``: one row per layer. summary.json keeps every layer either way."""
    groups: dict[tuple[str, str], list[LayerPlan]] = {}
    for layer in plan.layers:
        groups.setdefault((layer.format, layer.reason), []).append(layer)
    rows = []
    for (fmt, reason), layers in groups.items():
        parts = [[layer] for layer in layers] if per_layer or len(layers) == 1 else [layers]
        for part in parts:
            flops = sum(layer.flops for layer in part)
            if len(part) == 1:
                name = f"{part[0].name or '<root>'} ({part[0].kind})"
            else:
                kinds: dict[str, int] = {}
                for layer in part:
                    kinds[layer.kind] = kinds.get(layer.kind, 0) + 1
                name = " + ".join(f"{n} {kind}" for kind, n in kinds.items())
            share = flops / plan.total_flops if plan.total_flops else 0.0
            rows.append((name, fmt, reason, flops, f"{share:.1%}"))
    return rows


def render(plan: PrecisionPlan, title: str = "precision plan", per_layer: bool = False) -> Any:
    """A rich table: GEMM layers grouped by format and reason (``plan_rows``), then the share of the
    forward FLOPs that runs below 16 bits."""
    from rich.table import Table

    table = Table(title=title, title_justify="left", show_edge=False, pad_edge=False)
    for col, justify in (("layers", "left"), ("format", "left"), ("FLOPs", "right"), ("share", "right"),
                         ("why", "left")):
        table.add_column(col, justify=justify)  # type: ignore[arg-type]
    for name, fmt, reason, flops, share in plan_rows(plan, per_layer):
        table.add_row(name, fmt, _si(flops), share, reason)
    table.caption = (f"{plan.low_precision_flop_fraction:.2%} of the forward FLOPs ({_si(plan.total_flops)}) "
                     "run below 16 bits" + ("" if per_layer else "; trainer.precision_plan_layers=true lists "
                                            "every layer"))
    table.caption_justify = "left"
    return table


def _si(n: float) -> str:
    for unit in ("", "K", "M", "G", "T", "P"):
        if abs(n) < 1000:
            return f"{n:.3g}{unit}"
        n /= 1000
    return f"{n:.3g}E"
