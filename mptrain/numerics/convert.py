"""``precision=mx``: convert a model's GEMM layers to emulated MX / NVFP4, and record every decision.

Options (``precision.*``, see configs/precision/mx.yaml): ``format`` (a key of BLOCK_FORMATS),
``stochastic_rounding`` (gradients), ``hadamard`` (random Hadamard transform on wgrad),
``weight_2d_blocks``, ``keep_high`` (fnmatch patterns of layer names left in high precision; a
pattern naming a module covers the layers inside it), ``only`` (patterns: only these layers are
converted; keep_high wins over it), ``keep_first`` / ``keep_last`` (that many GEMM layers at either
end left high), ``pad_blocks`` (zero-pad reduction dims that are not a multiple of the block, or
leave such layers high), ``emulated_compute`` (fp32 | bf16) and ``seed`` (the rounding and
Hadamard streams). A null option takes the format's recipe default: for NVFP4, arXiv 2509.25149's
recipe (stochastic rounding of gradients, RHT on wgrad, 16x16 weight tiles, the last ~15% of GEMM
layers in high precision); for MX formats, the OCP spec's plain conversion (round-to-nearest, 1D
blocks, every layer quantized). The patterns must each name a layer (``MxState.check_patterns``).

Every GEMM-like layer of the model gets a ``LayerDecision`` (name, kind, format or ``high``, reason),
kept on ``MxState.decisions`` in the model's definition order; "first" and "last" are in that
order. Layers left high are untouched: they compute in FP32 (this mode has no autocast).

This module never imports mptrain.numerics.precision: ``convert_model`` takes the options and returns the
state that ``Precision`` keeps.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from mptrain import patterns
from mptrain.errors import MptrainError
from mptrain.numerics import fused
from mptrain.numerics.mx import BLOCK_FORMATS, BlockFormat
from mptrain.numerics.qgemm import BlockQuantizer, GemmRecipe, QuantConv2dFn, QuantLinearFn, RngStreams

log = logging.getLogger(__name__)

COMPUTE = {"fp32": torch.float32, "bf16": torch.bfloat16}
NVFP4_HIGH_FRACTION = 0.15  # arXiv 2509.25149 keeps about 15% of the linear layers, the last ones, in BF16


@dataclass(frozen=True)
class LayerDecision:
    """What a conversion did with one GEMM layer, and why."""

    name: str  # qualified module name ("" is the root); prefixed by the network when a task has several
    kind: str  # linear | conv2d | conv_transpose2d | conv1d | lstm | ...
    format: str  # the format it computes in, or "high"
    reason: str


def gemm_kind(module: nn.Module) -> str | None:
    """The kind of a module whose forward is a GEMM (subclasses included), or None."""
    kinds: list[tuple[type[nn.Module], str]] = [
        (nn.Linear, "linear"), (nn.Conv2d, "conv2d"), (nn.ConvTranspose2d, "conv_transpose2d"),
        (nn.Conv1d, "conv1d"), (nn.Conv3d, "conv3d"), (nn.modules.conv._ConvTransposeNd, "conv_transpose"),
        (nn.Bilinear, "bilinear"), (nn.RNNBase, "rnn"), (nn.MultiheadAttention, "attention"),
    ]  # fmt: skip
    for cls, kind in kinds:
        if isinstance(module, cls):
            return "lstm" if isinstance(module, nn.LSTM) else kind
    return None


def tag(model: nn.Module, decisions: list[LayerDecision]) -> None:
    """Attach each decision to its layer (``precision_decision``), so the precision plan reads what
    the converter did from the layer itself, whatever the task calls its networks."""
    for d in decisions:
        model.get_submodule(d.name).precision_decision = d  # type: ignore[assignment]


def prefixed(network: str, decisions: list[LayerDecision]) -> list[LayerDecision]:
    return [LayerDecision(f"{network}.{d.name}" if d.name else network, d.kind, d.format, d.reason) for d in decisions]


@torch.compiler.disable  # a graph break under a user's torch.compile (see _MxMixin)
def _own_kernels(gemms: Callable[[Tensor], Tensor], input: Tensor) -> Tensor:
    return gemms(input)


class _MxMixin:
    """Shared by the converted layers; ``mx_recipe`` is set by ``convert_model`` (a plain attribute:
    parameter names and state_dict keys stay the original layer's).

    Under a user's torch.compile a converted layer is a graph break by default (``_own_kernels``):
    it runs as it does eagerly, its quantizers compiled kernels of their own. ``in_graph`` (set by
    ``convert_model`` for ``trainer.compile``) traces its autograd function into the model's graph
    instead, which then holds the whole step: one graph (transformer_lm_tiny's MXFP8 step with bf16
    products took 0.8x as long on a CPU, docs/benchmarks), and CUDA graphs with
    compile_mode=reduce-overhead, for a GPU step that its host would pace otherwise. Stochastic
    rounding is traced too: the graph reads the rounding stream's counter and advances it in place,
    drawing what eager draws. What the trace reads but must not make, the stream and the fused
    kernels' probe, is made at conversion on the layers' device: convert on the device the model
    will run on. (Traced, the autograd functions gave zero gradients on torch 2.11, silently, until
    ``qgemm.traced_output``.)"""

    mx_recipe: GemmRecipe
    mx_format: str
    in_graph: bool = False
    _gemms: Callable[[Tensor], Tensor]  # the layer's autograd function on its input

    def forward(self, input: Tensor) -> Tensor:
        # dynamo guards on in_graph: a compiled model traces the GEMMs or breaks its graph here
        return self._gemms(input) if self.in_graph else _own_kernels(self._gemms, input)

    def extra_repr(self) -> str:
        r = self.mx_recipe
        return (
            f"{super().extra_repr()}, format={self.mx_format}, "  # type: ignore[misc]
            f"hadamard={r.hadamard_signs is not None}, weight_2d={r.weight_2d}, "
            f"compute={str(r.compute_dtype).replace('torch.', '')}"
        )


class MxLinear(_MxMixin, nn.Linear):
    """nn.Linear whose three GEMMs run on block-quantized operands (mptrain.numerics.qgemm)."""

    def _gemms(self, input: Tensor) -> Tensor:
        return QuantLinearFn.apply(input, self.weight, self.bias, self.mx_recipe)


class MxConv2d(_MxMixin, nn.Conv2d):
    """nn.Conv2d (groups=1, zero padding) whose three GEMMs run on block-quantized operands."""

    def _gemms(self, input: Tensor) -> Tensor:
        return QuantConv2dFn.apply(
            input, self.weight, self.bias, self.mx_recipe, self.stride, self.padding, self.dilation
        )


def grouped_conv_reason(conv: nn.Conv2d) -> str:
    """Why a grouped or depthwise convolution stays high: each group is a GEMM of its own over
    C_in/groups channels (depthwise: one channel, a kxk filter), too short a reduction for a block
    of 32 or 16; Transformer Engine and torchao's MX training leave them unquantized too."""
    if conv.groups == conv.in_channels:
        return (f"depthwise conv (groups={conv.groups}): a {conv.kernel_size[0]}x{conv.kernel_size[1]} filter per "
                "channel, no GEMM for a block to span")
    return (f"grouped conv (groups={conv.groups}): {conv.groups} GEMMs of {conv.in_channels // conv.groups} "
            "channels each, not one GEMM")


# Exact types: a subclass may have its own forward, which swapping the class would replace.
MX_LAYERS: dict[type[nn.Module], type[nn.Module]] = {nn.Linear: MxLinear, nn.Conv2d: MxConv2d}


@dataclass
class MxOptions:
    """``precision.*`` for mx, with the format's recipe defaults filled in."""

    format: BlockFormat
    stochastic_rounding: bool
    hadamard: bool
    weight_2d_blocks: bool
    keep_high: list[str]
    only: list[str]  # empty: every layer the emulation covers
    keep_first: int
    keep_last: int | None  # None: the recipe's share of the model's GEMM layers
    pad_blocks: bool
    compute: str
    autocast: str | None  # "bf16": the rest of the model under a bf16 autocast; None: FP32
    seed: int
    graph_combo_kernels: bool  # CUDA graphs: inductor's combo kernels (GemmRecipe.combo_kernels)
    graph_static_shapes: bool  # CUDA graphs: compiled per layer shape (GemmRecipe.static_shapes)

    @classmethod
    def parse(cls, options: Mapping[str, Any]) -> MxOptions:
        name = str(options.get("format", "mxfp8"))
        if name not in BLOCK_FORMATS:
            raise MptrainError(f"precision.format={name!r}: must be one of {', '.join(BLOCK_FORMATS)}")
        fmt = BLOCK_FORMATS[name]
        nv = fmt.two_level

        def flag(key: str, default: bool) -> bool:
            v = options.get(key)
            return default if v is None else bool(v)

        compute = str(options.get("emulated_compute", "fp32"))
        if compute not in COMPUTE:
            raise MptrainError(f"precision.emulated_compute={compute!r}: must be one of {', '.join(COMPUTE)}")
        autocast = options.get("autocast")
        if autocast is not None and autocast != "bf16":
            raise MptrainError(f"precision.autocast={autocast!r}: must be null or bf16")
        keep_last, keep_first = options.get("keep_last"), options.get("keep_first", 0) or 0
        for key, v in (("keep_last", keep_last), ("keep_first", keep_first)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
                raise MptrainError(f"precision.{key}={v!r}: must be an integer >= 0 (keep_last: or null)")
        keep_high = patterns.check_patterns("precision.keep_high", options.get("keep_high") or [])
        only = patterns.check_patterns("precision.only", options.get("only") or [])
        return cls(
            format=fmt, stochastic_rounding=flag("stochastic_rounding", nv), hadamard=flag("hadamard", nv),
            weight_2d_blocks=flag("weight_2d_blocks", nv), keep_high=keep_high, only=only, keep_first=int(keep_first),
            keep_last=None if keep_last is None else int(keep_last), pad_blocks=flag("pad_blocks", True),
            compute=compute, autocast=autocast, seed=int(options.get("seed", 0) or 0),
            graph_combo_kernels=flag("graph_combo_kernels", False),
            graph_static_shapes=flag("graph_static_shapes", False),
        )  # fmt: skip

    def last(self, n_gemm: int) -> tuple[int, str]:
        """How many last GEMM layers stay high, and why (for the reason string)."""
        if self.keep_last is not None:
            return self.keep_last, f"keep_last={self.keep_last}"
        if self.format.two_level:
            k = math.ceil(NVFP4_HIGH_FRACTION * n_gemm)
            return k, f"keep_last=null: the NVFP4 recipe's last {NVFP4_HIGH_FRACTION:.0%} of {n_gemm} GEMM layers"
        return 0, "keep_last=null"


@dataclass
class MxState:
    """What ``convert_model`` did, kept on ``Precision.mx_state``: the recipe and every decision.

    One state for every network of a task (a GAN's two): each is added with ``add``.
    """

    format: str
    options: dict[str, Any]
    decisions: list[LayerDecision] = field(default_factory=list)
    networks: dict[str, list[LayerDecision]] = field(default_factory=dict)
    models: list[nn.Module] = field(default_factory=list, repr=False)
    rng: RngStreams = field(default_factory=lambda: RngStreams(0), repr=False)
    # precision.keep_high / precision.only held against every network's layers (check_patterns)
    hits: patterns.PatternHits = field(default_factory=lambda: patterns.PatternHits({}), repr=False)

    def add(self, name: str, model: nn.Module, decisions: list[LayerDecision]) -> None:
        while name in self.networks:
            name += "'"
        self.networks[name] = decisions
        self.models.append(model)
        self.decisions = (
            list(decisions) if len(self.networks) == 1
            else [d for net, ds in self.networks.items() for d in prefixed(net, ds)]
        )  # fmt: skip

    @property
    def converted(self) -> list[str]:
        return [d.name for d in self.decisions if d.format != "high"]

    def describe(self) -> dict[str, Any]:
        return {
            "format": self.format,
            **self.options,
            "converted": self.converted,
            "decisions": [asdict(d) for d in self.decisions],
        }

    def after_step(self) -> None:
        """Nothing per step: masters stay FP32, and every quantization happens inside the GEMMs."""

    def check_patterns(self) -> None:
        """MptrainError for a keep_high or only pattern that named no layer of any network (once
        every network of the task is converted: a GAN's pattern may name a layer of either)."""
        self.hits.check()


def _decide(
    name: str, module: nn.Module, kind: str, index: int, n_gemm: int, opts: MxOptions, last: tuple[int, str],
    hits: patterns.PatternHits,
) -> tuple[str, str]:
    """(format or "high", reason) for one GEMM layer; ``index`` counts GEMM layers from 0. The plan's
    patterns are held against every GEMM layer, whatever else decides it (``hits`` counts them)."""
    fmt = opts.format
    kept = hits.first("precision.keep_high", name)
    listed = hits.first("precision.only", name)
    if type(module) not in MX_LAYERS:
        why = "a subclass with its own forward" if isinstance(module, tuple(MX_LAYERS)) else "no MX emulation for it"
        return "high", f"{kind}: {why}"
    if kept is not None:
        return "high", f"keep_high pattern {kept!r}"
    if opts.only and listed is None:
        return "high", "not named by precision.only"
    if index < opts.keep_first:
        return "high", f"first layer (keep_first={opts.keep_first})"
    k_last, why_last = last
    if index >= n_gemm - k_last:
        return "high", f"last layer ({why_last})"
    if isinstance(module, nn.Conv2d):
        if module.groups != 1:
            return "high", grouped_conv_reason(module)
        if module.padding_mode != "zeros" or isinstance(module.padding, str):
            return "high", f"padding={module.padding!r}, padding_mode={module.padding_mode}: only explicit zero padding"
        dims = {"C_in": module.in_channels, "C_out": module.out_channels}
    else:
        dims = {"in_features": module.in_features, "out_features": module.out_features}  # type: ignore[dict-item]
    odd = {k: v for k, v in dims.items() if v % fmt.block_size}
    if odd and not opts.pad_blocks:
        k, v = next(iter(odd.items()))
        return "high", f"reduction dim {k}={v} not divisible by block {fmt.block_size} (pad_blocks=false)"
    if odd:
        return fmt.name, "padded: " + ", ".join(
            f"{k}={v} -> {fmt.block_size * math.ceil(v / fmt.block_size)}" for k, v in odd.items()
        )
    return fmt.name, "all reduction dims divisible by the block"


def convert_model(
    model: nn.Module, options: Mapping[str, Any], state: MxState | None = None, in_graph: bool = False
) -> tuple[nn.Module, MxState]:
    """Swap the model's nn.Linear / nn.Conv2d layers (exact types) for MX-emulating subclasses in
    place, per ``options`` (``precision.*``); returns the model and the state with every decision.

    Pass the state of the task's previous networks as ``state``: the new network is added to it.
    ``in_graph``: the model will be compiled whole, and its converted layers traced into its graph
    (``_MxMixin``). Compiling a second model of another format whose forward is the same code (another
    instance of the class, in the same process) makes dynamo recompile that code, and a recompile
    for changed float constants makes them symbolic (automatic dynamic), which failed to trace on
    torch 2.11: reset dynamo between them (``torch._dynamo.reset()``, as the engine does per job) or
    compile with ``dynamic=False``.
    """
    opts = MxOptions.parse(options)
    if state is None:
        state = MxState(
            format=opts.format.name,
            options={
                "stochastic_rounding": opts.stochastic_rounding, "hadamard": opts.hadamard,
                "weight_2d_blocks": opts.weight_2d_blocks, "keep_high": opts.keep_high, "only": opts.only,
                "keep_first": opts.keep_first, "keep_last": opts.keep_last, "pad_blocks": opts.pad_blocks,
                "emulated_compute": opts.compute, "graph_combo_kernels": opts.graph_combo_kernels,
                "graph_static_shapes": opts.graph_static_shapes,
            },
            rng=RngStreams(opts.seed),
            hits=patterns.PatternHits({"precision.keep_high": opts.keep_high, "precision.only": opts.only}),
        )  # fmt: skip
    state.hits.see(n for n, _ in model.named_modules())
    recipe = GemmRecipe(
        quantizer=BlockQuantizer(opts.format, stochastic_grads=opts.stochastic_rounding, rng=state.rng),
        compute_dtype=COMPUTE[opts.compute],
        hadamard_signs=GemmRecipe.signs(opts.seed + 1) if opts.hadamard else None,
        weight_2d=opts.weight_2d_blocks,
        combo_kernels=opts.graph_combo_kernels,
        static_shapes=opts.graph_static_shapes,
    )
    gemms = [(n, m, k) for n, m in model.named_modules() if (k := gemm_kind(m)) is not None]
    # A layer inside another GEMM module (MultiheadAttention's out_proj) is decided with its parent.
    gemms = [(n, m, k) for n, m, k in gemms if not any(n.startswith(p + ".") and p != n for p, _, _ in gemms)]
    last = opts.last(len(gemms))
    decisions = []
    devices: set[torch.device] = set()
    for i, (name, module, kind) in enumerate(gemms):
        fmt, reason = _decide(name, module, kind, i, len(gemms), opts, last, state.hits)
        if fmt != "high":
            module.__class__ = MX_LAYERS[type(module)]
            module.mx_recipe, module.mx_format = recipe, fmt  # type: ignore[assignment]
            module.in_graph = in_graph  # type: ignore[assignment]
            if in_graph:
                devices.update(p.device for p in module.parameters(recurse=False))
        decisions.append(LayerDecision(name, kind, fmt, reason))
    for device in devices:  # what a trace of the layers reads but must not make (_MxMixin)
        fused.enabled(torch.empty(0, device=device))  # the probe: it compiles and runs a kernel
        if opts.stochastic_rounding:
            state.rng.for_graph(device)
    if not any(d.format != "high" for d in decisions):
        log.warning(
            "precision=mx: no layer of %s computes in %s (see the decisions)", type(model).__name__, opts.format.name
        )
    tag(model, decisions)
    state.add(type(model).__name__, model, decisions)
    log.info(
        "mx emulated %s: %d of %d GEMM layers of %s quantized; high: %s", opts.format.name,
        sum(d.format != "high" for d in decisions), len(decisions), type(model).__name__,
        "; ".join(f"{d.name or '<root>'} ({d.reason})" for d in decisions if d.format == "high") or "none",
    )  # fmt: skip
    return model, state
