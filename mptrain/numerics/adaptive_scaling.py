"""Adaptive loss scaling (Zhao et al. 2019): per-layer scales computed during backprop.

Reads ``loss_scale.*`` (``AdaptiveLossScaleConfig``): ``init_scale`` (the scale P the gradient at
the model's outputs carries: ``auto``, the default, or a number that multiplies the loss; see
"Starting the chain"), ``u_min``/``u_max`` (the half format's
smallest subnormal and largest value), ``n_uf`` (tolerated underflow probability), ``layer_cap``
(largest scale one layer may add), ``accum_cap`` (largest cumulative scale), ``recompute_every``
(optimizer steps between recomputations; cached scales are reused in between) and
``power_of_two``.

The rule (``layer_scale``, ``join_scale``, ``output_scale``) is in ``mptrain.numerics.adaptive_rule``.

Starting the chain
------------------
The authors' code puts a plain loss-scaling node at the network's output
(``loss_scaling(link(x), init_scale)`` in ``AdaLossScaled``) and their experiments leave it at 1
(``--init-scale 1``). But the gradient at the output (dL/dlogits, already divided by the batch) is
cast to FP16 before the first layer can scale it, and at 1 a classifier's loses values there: in
this repository's ablation adaptive scaling with 1 lost about as many gradient values as no scaling.
So ``init_scale=auto`` keeps the node at the output and lets it choose its value like the other
bounds of the rule: the model's half-precision outputs are handed to the loss in FP32 (exact), and
in backward the FP32 dL/d output gets ``output_scale``: the largest power of two that keeps it
below u_max, at most ``accum_cap``, applied before the cast back to FP16. A number keeps the
authors' fixed node (the loss is multiplied by it).

Design
------
``attach`` traces the module with torch.fx and keeps an instrumented GraphModule that shares the
module's submodules and parameters. The module object itself is returned unchanged (same state_dict keys, same
``.train()``/``.to()``); only its instance ``forward`` is replaced: with grad enabled it runs the
instrumented graph (traced once per combination of train/eval flags and autocast state, because fx
bakes Python branches on them in), under ``no_grad`` the original forward. Leaves of the trace:
Conv/Linear (subclasses too), torch.nn modules, and every module with no Conv/Linear inside, which
changes no scale and so is one P-preserving op however it is written. A model with no Conv/Linear
at all is not traced: its gradients carry init_scale only.

Every gradient that flows along an edge of the graph carries a scale P that is known statically
up to a value in a per-step table of device scalars (``_P``, one entry per scaling site and per
join, entry 0 = the outputs = the chain's first scale). Backward ops are linear in their incoming gradient, so
P passes unchanged through every op except:

- a scaling site (a Conv/Linear call): a pre-hook on the grad_fn of the layer's output computes s
  from gy and W, writes P_site = s * P_out into the table and hands s * gy to the layer's own
  backward, so the input gradient *and* the weight/bias gradients come from s * gy (that is what
  keeps the FP16 products from underflowing). Its parameters' gradients carry P_site.
- a join: a node whose consumers' gradients would arrive with different table entries (ResNet's
  skip + residual branch, Inception's parallel branches, a tuple whose elements take different
  paths) gets a ``Fork`` autograd Function with one output per consumer. Its backward receives
  the consumers' gradients separately, picks the common scale the authors' code picks (the
  largest incoming P for which max|g_i / P_i| * P < u_max, else the smallest P halved until it
  fits), rescales each in FP32 and sums. Nodes whose consumers resolve to the same entry get no
  Fork: a plain sum is already consistent.

Every other parameter (batch norm, embeddings, LSTMs, parameters read with get_attr) carries the
P of the gradient that reached its node. ``unscale_`` groups the optimizer's gradients by table
entry and runs ``torch._amp_foreach_non_finite_check_and_unscale_`` once per group with 1/P, then
steps or skips exactly as torch.amp.GradScaler does. Nothing in scale/unscale_/update reads a
device value on the host; the backward hooks only queue device ops.

Scales are computed on the first backward of a step that reaches a site/join and reused by later
backwards of the same step (gradient accumulation, several forwards): a parameter's gradient must
carry one P however many backwards add to it. With ``recompute_every`` N > 1 they are recomputed
every N optimizer steps, and on the step after a skipped one (a non-fused optimizer's step reads
found_inf on the host anyway; after a fused optimizer's device-side skip, ``update`` reads it: one
host sync per step, only when N > 1).

Limitations: the model must be torch.fx-traceable (otherwise MptrainError: without the graph,
branch joins cannot be made consistent); a parameter shared by places whose gradients carry
different P, an in-place op on a tensor that other consumers read afterwards, and losses that read
parameters outside the attached module are rejected or unsupported. Multi-process DDP is supported
(tests/test_distributed.py): every freshly computed scale is reduced with MIN over the ranks inside
backward, so all ranks carry the same per-layer scales. FP8/FP16 models keep FP32 masters in the
optimizer: register them with ``alias_params(model_params, master_params)`` so their gradients are
unscaled by the right P.
"""

from __future__ import annotations

import operator
import types
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch import Tensor, nn
from torch.utils import _pytree as pytree

from mptrain.errors import MptrainError
from mptrain.numerics.adaptive_rule import _amax, backward_fan_in, join_scale, layer_scale, output_scale
from mptrain.numerics.loss_scaling import LossScaler, _check_policy
from mptrain.optim import discard_skipped_state, fresh_params

_SITE_TYPES = (nn.modules.conv._ConvNd, nn.Linear)
_OUTPUT = "<output>"


# --------------------------------------------------------------------------------------------
# graph pieces


@dataclass
class _Site:
    name: str  # module qualified name
    module: nn.Module
    entry: int  # table entry of the gradient below the layer (and of its parameter gradients)
    out_entry: int  # table entry of the gradient arriving at the layer's output
    fan_in: int


@dataclass
class _Fork:
    name: str
    entry: int
    copy_entries: list[int]  # table entry of the gradient each consumer sends back
    clone: list[bool]  # consumer mutates its input in place (and is the last reader): give a copy


@dataclass
class _Variant:
    """One instrumented graph (fx bakes ``self.training`` branches in: one per mode)."""

    gm: fx.GraphModule | None  # None: no Conv/Linear anywhere, the plain forward (P = init_scale)
    param_entry: dict[int, int] = field(default_factory=dict)
    # id(Conv/Linear module) -> (entry of the gradient at its output, entry of its parameter grads)
    site_entries: dict[int, tuple[int, int]] = field(default_factory=dict)


def _has_site(module: nn.Module) -> bool:
    return any(isinstance(m, _SITE_TYPES) for m in module.modules())


class _Tracer(fx.Tracer):
    """Leaves: Conv/Linear (also subclasses outside torch.nn: they are the scaling sites), torch.nn
    modules, and any module without a Conv/Linear inside. Such a module changes no scale, so it is
    one P-preserving op whatever it does inside, and fx need not be able to trace it."""

    def __init__(self, root: nn.Module) -> None:
        super().__init__()
        self.with_sites = {id(m) for m in root.modules() if _has_site(m)}

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return (
            isinstance(m, _SITE_TYPES)
            or id(m) not in self.with_sites
            or super().is_leaf_module(m, module_qualified_name)
        )


class _SiteTap(nn.Module):
    """After a Conv/Linear call: hooks the output's grad_fn so that gy is scaled before the layer's
    own backward. A grad_fn pre-hook, not a custom Function: in-place ops on the output stay legal."""

    def __init__(self, scaler: AdaptiveScaler, site: _Site) -> None:
        super().__init__()
        self.scaler = scaler
        self.site = site

    def forward(self, out: Any) -> Any:
        if isinstance(out, Tensor) and out.grad_fn is not None:
            site, scaler = self.site, self.scaler
            out.grad_fn.register_prehook(lambda grads: scaler._site_backward(site, grads))
        return out


class _ForkFn(torch.autograd.Function):
    """k copies of m tensors; backward rescales the k gradients of each tensor to one P and sums."""

    @staticmethod
    def forward(ctx: Any, scaler: AdaptiveScaler, fork: _Fork, *tensors: Tensor) -> tuple[Tensor, ...]:
        ctx.scaler, ctx.fork, ctx.m = scaler, fork, len(tensors)
        ctx.dtypes = [t.dtype for t in tensors]
        ctx.set_materialize_grads(False)  # a consumer that sent no gradient costs nothing
        return tuple(t.clone() if c else t.view_as(t) for c in fork.clone for t in tensors)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor | None) -> tuple[Tensor | None, ...]:
        return (None, None, *ctx.scaler._fork_backward(ctx.fork, ctx.m, ctx.dtypes, grads))


class _OutputScaleFn(torch.autograd.Function):
    """At the model's outputs (``init_scale=auto``): forward hands the outputs on in FP32 (exact),
    so the loss's gradient arrives here in FP32; backward picks the chain's starting scale from it
    and multiplies before the cast back to the outputs' half dtype, which is where dL/d output
    would otherwise underflow. The authors' loss-scaling node at the network's output, with its
    value read off the gradient instead of configured."""

    @staticmethod
    def forward(ctx: Any, scaler: AdaptiveScaler, *tensors: Tensor) -> tuple[Tensor, ...]:
        ctx.scaler = scaler
        ctx.dtypes = [t.dtype for t in tensors]
        ctx.set_materialize_grads(False)
        return tuple(t.float() if t.dtype in (torch.float16, torch.bfloat16) else t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor | None) -> tuple[Tensor | None, ...]:
        return (None, *ctx.scaler._output_backward(ctx.dtypes, grads))


class _ForkModule(nn.Module):
    def __init__(self, scaler: AdaptiveScaler, fork: _Fork) -> None:
        super().__init__()
        self.scaler = scaler
        self.fork = fork

    def forward(self, value: Any) -> tuple[Any, ...]:
        k = len(self.fork.copy_entries)
        leaves, spec = pytree.tree_flatten(value)
        idx = [i for i, t in enumerate(leaves) if isinstance(t, Tensor) and t.requires_grad]
        if not idx:  # ints, masks, inputs without grad: nothing to align
            return (value,) * k
        outs = _ForkFn.apply(self.scaler, self.fork, *(leaves[i] for i in idx))
        copies = []
        for c in range(k):
            new = list(leaves)
            for j, i in enumerate(idx):
                new[i] = outs[c * len(idx) + j]
            copies.append(pytree.tree_unflatten(new, spec))
        return tuple(copies)


def _mutates(user: fx.Node, node: fx.Node, gm: fx.GraphModule) -> bool:
    """Whether ``user`` modifies ``node``'s value in place (as its first argument)."""
    if not user.args or user.args[0] is not node:
        return False
    if user.op == "call_module":
        return bool(getattr(gm.get_submodule(str(user.target)), "inplace", False))
    if user.op == "call_method":
        name = str(user.target)
        return name.endswith("_") and not name.startswith("_")
    if user.op == "call_function":
        if user.kwargs.get("inplace") or user.target is operator.setitem:
            return True
        name = getattr(user.target, "__name__", "")
        return name.endswith("_") and not name.startswith("_")
    return False


class _InstrumentedForward:
    """The attached module's instance ``forward``: the instrumented graph when grad is enabled."""

    def __init__(self, scaler: AdaptiveScaler, module: nn.Module) -> None:
        self._scaler = scaler
        self._module = weakref.ref(module)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module = self._module()
        assert module is not None
        if not torch.is_grad_enabled():
            return type(module).forward(module, *args, **kwargs)
        return self._scaler._run(module, args, kwargs)

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        # A deep copy of the module (an EMA model, say) gets the plain forward, not ours.
        copy = memo.get(id(self._module()))
        return self if copy is None else types.MethodType(type(copy).forward, copy)


# --------------------------------------------------------------------------------------------
# the scaler


class AdaptiveScaler(LossScaler):
    """Zhao et al.'s adaptive loss scaling; see the module docstring for the design.

    ``telemetry()`` keys (device tensors, cloned so later steps do not change them):
    ``layer_scale`` (vector, s per Conv/Linear layer, in ``layer_names`` order), ``cum_scale``
    (vector, the P its weight gradient carried), ``layer_scale_min``/``_max``/``_mean`` (scalars).
    """

    policy = "adaptive"

    def __init__(
        self,
        device: torch.device,
        init_scale: float | str = "auto",
        u_min: float = 2.0**-24,
        u_max: float = 65504.0,
        n_uf: float = 1e-3,
        layer_cap: float = 16.0,
        accum_cap: float = 1024.0,
        recompute_every: int = 1,
        power_of_two: bool = True,
    ) -> None:
        if recompute_every < 1:
            raise MptrainError(f"loss_scale.recompute_every={recompute_every}: must be an integer >= 1")
        if not 0.0 < n_uf < 1.0:
            raise MptrainError(f"loss_scale.n_uf={n_uf}: must be in (0, 1)")
        self.device = torch.device(device)
        if isinstance(init_scale, str) and init_scale != "auto":
            raise MptrainError(f"loss_scale.init_scale={init_scale!r}: must be a positive number or auto")
        self.auto_init = init_scale == "auto"
        # auto: the loss is not multiplied; the output node starts the chain (entry 0).
        self.init_scale_value = 1.0 if self.auto_init else float(init_scale)
        self.init_scale: float | str = "auto" if self.auto_init else float(init_scale)
        self.rule = {
            "u_min": float(u_min),
            "u_max": float(u_max),
            "n_uf": float(n_uf),
            "layer_cap": float(layer_cap),
            "accum_cap": float(accum_cap),
            "power_of_two": bool(power_of_two),
        }
        self.recompute_every = int(recompute_every)
        self._scale = torch.full((), self.init_scale_value, device=self.device)
        self._found_inf = torch.zeros((), device=self.device)
        # The table: entry name -> index; _s = the cached factor (per site s, per fork the target P),
        # _P = the cumulative scale of the gradient below that site/fork in the current step.
        self._entries: dict[str, int] = {_OUTPUT: 0}
        self._site_idx = torch.zeros(0, dtype=torch.long, device=self.device)  # for telemetry
        self._s = torch.ones(1, device=self.device)
        self._P = torch.full((1,), self.init_scale_value, device=self.device)
        self._known: set[int] = set()  # entries computed at least once (else s would be stale 1)
        self._fresh: set[int] = set()  # entries written in this step (first backward wins)
        self._step = 0
        self._recompute = True
        self._force_recompute = False
        self._module: nn.Module | None = None
        self._variants: dict[tuple[Any, ...], _Variant] = {}
        self._active: _Variant | None = None
        self._aliases: dict[int, Tensor] = {}
        self._unscaled: dict[int, Tensor] = {}  # id(optimizer) -> its found_inf this step
        self._stepped: set[int] = set()
        self._device_found_inf: list[Tensor] = []  # fused steps' skip flags, read in update()
        self._param_names: dict[int, str] = {}
        self._pending_state: dict[str, Any] | None = None
        self._sync_ranks = False

    # ---------------------------------------------------------------- attach and forward

    def attach(self, module: nn.Module) -> nn.Module:
        if self._module is not None:
            raise MptrainError("loss_scale=adaptive: the scaler is already attached to a module")
        dist = torch.distributed
        # Data parallel: every rank must carry the same per-layer scales, or the all-reduced
        # gradients would mix them. Each freshly computed scale is reduced with MIN over ranks (safe
        # for every rank's gradient: the overflow bound holds everywhere) inside backward.
        self._sync_ranks = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        if "forward" in module.__dict__:
            raise MptrainError(f"loss_scale=adaptive: {type(module).__name__} already has an instance-level forward")
        self._module = module
        self._param_names = {id(p): n for n, p in module.named_parameters()}
        self._variants[self._mode_key(module)] = self._trace(module)
        module.forward = _InstrumentedForward(self, module)  # type: ignore[method-assign]
        if self._pending_state is not None:
            state, self._pending_state = self._pending_state, None
            self.load_state_dict(state)
        return module

    def detach(self) -> None:
        """Give the module back its own forward (e.g. before pickling the whole module)."""
        if self._module is not None:
            del self._module.forward
            self._module = None

    def alias_params(self, model_params: list[Tensor], optimizer_params: list[Tensor]) -> None:
        """Optimizer tensors (FP32 masters) that stand for model parameters: their gradients
        carry the model parameter's P."""
        for p, m in zip(model_params, optimizer_params, strict=True):
            self._aliases[id(m)] = p

    def _mode_key(self, module: nn.Module) -> tuple[Any, ...]:
        # fx bakes Python branches on self.training and on the autocast state into the graph.
        dev = self.device.type
        amp = torch.is_autocast_enabled(dev) and torch.get_autocast_dtype(dev)
        return (amp, *(m.training for m in module.modules()))

    def _run(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        key = self._mode_key(module)
        variant = self._variants.get(key)
        if variant is None:
            variant = self._variants[key] = self._trace(module)
        if self._active is not None and self._active is not variant:
            raise MptrainError(
                "loss_scale=adaptive: the module changed train/eval mode between forwards of one "
                "step; its gradients would carry scales from two different graphs"
            )
        self._active = variant
        out = type(module).forward(module, *args, **kwargs) if variant.gm is None else variant.gm(*args, **kwargs)
        if not self.auto_init:
            return out
        leaves, spec = pytree.tree_flatten(out)
        idx = [i for i, t in enumerate(leaves) if isinstance(t, Tensor) and t.requires_grad and t.is_floating_point()]
        if idx:
            scaled = _OutputScaleFn.apply(self, *(leaves[i] for i in idx))
            for j, i in enumerate(idx):
                leaves[i] = scaled[j]
        return pytree.tree_unflatten(leaves, spec)

    def _entry(self, name: str) -> int:
        if name not in self._entries:
            self._entries[name] = len(self._entries)
            self._s = torch.cat([self._s, torch.ones(1, device=self.device)])
            self._P = torch.cat([self._P, torch.full((1,), self.init_scale_value, device=self.device)])
            if name.startswith("site:"):  # built here, at trace time, not in telemetry(): no H2D copy
                idx = [i for n, i in self._entries.items() if n.startswith("site:")]
                self._site_idx = torch.tensor(idx, dtype=torch.long, device=self.device)
        return self._entries[name]

    def _trace(self, module: nn.Module) -> _Variant:
        name = type(module).__name__
        if not _has_site(module):  # nothing to scale per layer: every gradient carries init_scale
            return _Variant(None, {id(p): 0 for p in module.parameters()})
        tracer = _Tracer(module)
        try:
            graph = tracer.trace(module)
        except Exception as e:
            raise MptrainError(
                f"loss_scale=adaptive: torch.fx cannot trace {name} ({type(e).__name__}: {e}). "
                "Adaptive scaling needs the graph to make gradients consistent where branches join; "
                "use loss_scale=dynamic for this model"
            ) from e
        gm = fx.GraphModule(tracer.root, graph, name)
        nodes = list(graph.nodes)
        order = {n: i for i, n in enumerate(nodes)}
        for n in nodes:  # site entries first, in forward order: the order of telemetry's vectors
            if n.op == "call_module" and isinstance(gm.get_submodule(str(n.target)), _SITE_TYPES):
                self._entry(f"site:{n.target}")

        # Resolve, from the outputs backwards, the table entry of the gradient on every edge:
        # pout[n] = entry of the gradient reaching n's value, pin[n] = entry n sends to its inputs.
        pin: dict[fx.Node, int] = {}
        pout: dict[fx.Node, int] = {}
        joins: list[tuple[fx.Node, list[fx.Node], list[int]]] = []
        sites: dict[fx.Node, _Site] = {}
        for n in reversed(nodes):
            if n.op == "output":
                pin[n] = 0
                continue
            users = list(n.users)
            entries = [pin[u] for u in users]
            if not users:
                pout[n] = 0  # no gradient flows here
            elif len(set(entries)) == 1:
                pout[n] = entries[0]
            else:
                pout[n] = self._entry(f"fork:{n.name}")
                joins.append((n, users, entries))
            pin[n] = pout[n]
            if n.op == "call_module":
                mod = gm.get_submodule(str(n.target))
                if isinstance(mod, _SITE_TYPES):
                    entry = self._entry(f"site:{n.target}")
                    sites[n] = _Site(str(n.target), mod, entry, pout[n], backward_fan_in(mod))
                    pin[n] = entry
        self._check_shared_sites(name, sites)

        variant = _Variant(gm, site_entries={id(site.module): (site.out_entry, site.entry) for site in sites.values()})
        where: dict[int, str] = {}
        for n in nodes:
            if n.op == "call_module":
                for pname, p in gm.get_submodule(str(n.target)).named_parameters():
                    self._assign(variant, where, p, pin[n], f"{n.target}.{pname}")
            elif n.op == "get_attr":
                obj = _fetch_attr(gm, str(n.target))
                if isinstance(obj, Tensor) and obj.requires_grad:
                    if not isinstance(obj, nn.Parameter):
                        # Computed from parameters outside the traced ops (e.g. p.half() over
                        # named_parameters()): fx froze it, and its parameters would get no gradient.
                        raise MptrainError(
                            f"loss_scale=adaptive: torch.fx traced {name} with a value computed from its "
                            f"parameters frozen into the graph ({n.target}); use loss_scale=dynamic"
                        )
                    self._assign(variant, where, obj, pout[n], str(n.target))

        # In-place consumers of a join, judged before the rewrite changes their arguments.
        clones = []
        for n, users, _ in joins:
            last = max(users, key=order.__getitem__)
            clone = [_mutates(u, n, gm) for u in users]
            for u, c in zip(users, clone, strict=True):
                if c and u is not last:
                    raise MptrainError(
                        f"loss_scale=adaptive: in {name}, {u.name} modifies {n.name} in place while "
                        "other consumers read it later; adaptive scaling cannot split its gradient"
                    )
            clones.append(clone)

        # Rewrite: a tap after every site, a Fork after every join.
        value_of: dict[fx.Node, fx.Node] = {}
        for i, (n, site) in enumerate(sites.items()):
            tap_name = f"_adaptive_site_{i}"
            gm.add_submodule(tap_name, _SiteTap(self, site))
            with graph.inserting_after(n):
                tap = graph.call_module(tap_name, (n,))
            n.replace_all_uses_with(tap, delete_user_cb=lambda u, tap=tap: u is not tap)
            value_of[n] = tap
        for i, ((n, users, entries), clone) in enumerate(zip(joins, clones, strict=True)):
            fork_name = f"_adaptive_fork_{i}"
            gm.add_submodule(fork_name, _ForkModule(self, _Fork(n.name, pout[n], entries, clone)))
            src = value_of.get(n, n)
            with graph.inserting_after(src):
                fork = graph.call_module(fork_name, (src,))
            for c, u in reversed(list(enumerate(users))):
                with graph.inserting_after(fork):
                    copy = graph.call_function(operator.getitem, (fork, c))
                u.replace_input_with(src, copy)
        graph.lint()
        gm.recompile()
        return variant

    @staticmethod
    def _check_shared_sites(name: str, sites: dict[fx.Node, _Site]) -> None:
        seen: dict[int, _Site] = {}
        for site in sites.values():
            other = seen.setdefault(site.entry, site)
            if other.out_entry != site.out_entry:
                raise MptrainError(
                    f"loss_scale=adaptive: in {name}, layer {site.name} is called at places whose "
                    "gradients carry different scales; shared layers are not supported"
                )

    def _assign(self, variant: _Variant, where: dict[int, str], p: Tensor, entry: int, at: str) -> None:
        old = variant.param_entry.setdefault(id(p), entry)
        where.setdefault(id(p), at)
        if old != entry:
            pname = self._param_names.get(id(p), at)
            raise MptrainError(
                f"loss_scale=adaptive: parameter {pname} is used at {where[id(p)]} and {at}, whose "
                "gradients carry different scales (weight sharing is not supported)"
            )

    # ---------------------------------------------------------------- backward hooks

    def _site_backward(self, site: _Site, grads: tuple[Tensor | None, ...]) -> tuple[Tensor | None, ...] | None:
        gy = grads[0]
        if gy is None:
            return None
        e = site.entry
        if e not in self._fresh:
            p_out = self._P[site.out_entry]
            if self._recompute or e not in self._known:
                s = layer_scale(gy, site.module.weight, p_out, site.fan_in, **self.rule)
                self._s[e].copy_(self._agree(s))
                self._known.add(e)
            self._P[e].copy_(self._s[e] * p_out)
            self._fresh.add(e)
        s = self._s[e].to(gy.device)
        return (gy * s, *grads[1:])

    def _output_backward(self, dtypes: list[torch.dtype], grads: tuple[Tensor | None, ...]) -> list[Tensor | None]:
        present = [g for g in grads if g is not None]
        if present and 0 not in self._fresh:
            if self._recompute or 0 not in self._known:
                amax = torch.stack([_amax(g).to(self.device) for g in present]).max()
                r = self.rule
                s = output_scale(amax, u_max=r["u_max"], accum_cap=r["accum_cap"], power_of_two=r["power_of_two"])
                self._s[0].copy_(self._agree(s))
                self._known.add(0)
            self._P[0].copy_(self._s[0] * self.init_scale_value)
            self._fresh.add(0)
        s0 = self._s[0]
        # In FP32, then back to the outputs' dtype: the multiply happens before the lossy cast.
        pairs = zip(grads, dtypes, strict=True)
        return [None if g is None else (g.float() * s0.to(g.device)).to(dt) for g, dt in pairs]

    def _agree(self, s: Tensor) -> Tensor:
        """The same scale on every rank (MIN), without a host sync on NCCL."""
        if self._sync_ranks:
            s = s.detach().clone()
            torch.distributed.all_reduce(s, op=torch.distributed.ReduceOp.MIN)
        return s

    def _fork_backward(
        self, fork: _Fork, m: int, dtypes: list[torch.dtype], grads: tuple[Tensor | None, ...]
    ) -> list[Tensor | None]:
        k = len(fork.copy_entries)
        present = [(c, j, g) for c in range(k) for j in range(m) if (g := grads[c * m + j]) is not None]
        out: list[Tensor | None] = [None] * m
        if not present:
            return out
        e = fork.entry
        if e not in self._fresh:
            if self._recompute or e not in self._known:
                scales = torch.stack([self._P[fork.copy_entries[c]] for c, _, _ in present])
                amax = torch.stack([_amax(g).to(self.device) for _, _, g in present])
                self._s[e].copy_(self._agree(join_scale(amax / scales, scales, self.rule["u_max"])))
                self._known.add(e)
            self._P[e].copy_(self._s[e])
            self._fresh.add(e)
        target = self._P[e]
        for c, j, g in present:
            # In FP32: the ratio may be far from 1 and the sum must round once.
            t = g.float() * (target / self._P[fork.copy_entries[c]]).to(g.device)
            acc = out[j]
            out[j] = t if acc is None else acc.add_(t)
        return [None if o is None else o.to(dtypes[j]) for j, o in enumerate(out)]

    # ---------------------------------------------------------------- the five calls

    def scale(self, loss: Tensor) -> Tensor:
        # init_scale=auto: _scale is 1; the output node applies the chain's first scale.
        return loss * self._scale.to(loss.device)

    def _entry_of(self, p: Tensor) -> int:
        if self._active is None:
            return 0  # no instrumented forward this step: gradients carry init_scale only
        model_p = self._aliases.get(id(p), p)
        entry = self._active.param_entry.get(id(model_p))
        if entry is None:
            raise MptrainError(
                f"loss_scale=adaptive: the optimizer holds a parameter of shape {tuple(p.shape)} that "
                "is not used by the attached module's forward, so the scale its gradient carries is "
                "unknown (FP32 master copies must be registered with AdaptiveScaler.alias_params)"
            )
        return entry

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        if id(optimizer) in self._unscaled:
            raise RuntimeError("unscale_() has already been called on this optimizer since the last update().")
        inv = self._P.reciprocal()
        groups: dict[tuple[torch.device, int], list[Tensor]] = {}
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.dtype == torch.float16:
                    # As GradScaler: unscaling in FP16 would flush the rescued values again.
                    raise MptrainError(
                        "loss_scale=adaptive: attempting to unscale FP16 gradients; the optimizer "
                        "needs FP32 master weights"
                    )
                grad = p.grad
                if grad.is_sparse:
                    p.grad = grad = grad.coalesce()
                    grad = grad._values()
                groups.setdefault((grad.device, self._entry_of(p)), []).append(grad)
        found: dict[torch.device, Tensor] = {}
        for (dev, entry), grads in groups.items():
            flag = found.setdefault(dev, torch.zeros(1, device=dev))
            torch._amp_foreach_non_finite_check_and_unscale_(grads, flag, inv[entry].to(dev))
        flag = torch.zeros((), device=self.device)
        for f in found.values():
            flag = flag + f.to(self.device).squeeze(0)
        flag = flag.clamp(max=1.0)
        # New tensors, never in-place: a found_inf handed out for logging keeps its value.
        self._found_inf = flag if not self._unscaled else (self._found_inf + flag).clamp(max=1.0)
        self._unscaled[id(optimizer)] = flag

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        if id(optimizer) in self._stepped:
            raise RuntimeError("step() has already been called since the last update().")
        if id(optimizer) not in self._unscaled:
            self.unscale_(optimizer)
        found_inf = self._unscaled[id(optimizer)]
        self._stepped.add(id(optimizer))
        if getattr(optimizer, "_step_supports_amp_scaling", False):
            # Fused optimizers skip on the device (GradScaler's contract: grads already unscaled).
            optimizer.grad_scale = None  # type: ignore[attr-defined]
            optimizer.found_inf = found_inf  # type: ignore[attr-defined]
            fresh = fresh_params(optimizer)
            try:
                optimizer.step()
            finally:
                del optimizer.grad_scale  # type: ignore[attr-defined]
                del optimizer.found_inf  # type: ignore[attr-defined]
            discard_skipped_state(optimizer, fresh, found_inf)
            # No host read here; update() decides whether the cached scales must be recomputed.
            self._device_found_inf.append(found_inf)
            return
        # The one host sync GradScaler also makes for non-fused optimizers.
        if bool(found_inf.item()):
            self._force_recompute = True  # the cached scales overflowed: recompute next step
        else:
            optimizer.step()

    def update(self) -> None:
        self._step += 1
        scheduled = self._step % self.recompute_every == 0
        if self._device_found_inf and not scheduled and not self._force_recompute:
            # A fused optimizer skipped (or not) on the device. Stale scales that overflowed would
            # overflow again on every step until the next scheduled recompute, so read the flag:
            # one host sync per step, and only with recompute_every > 1 (otherwise every step
            # recomputes anyway).
            self._force_recompute = bool(torch.stack([f.reshape(()) for f in self._device_found_inf]).max().item())
        self._device_found_inf.clear()
        self._recompute = self._force_recompute or scheduled
        self._force_recompute = False
        self._fresh.clear()
        self._unscaled.clear()
        self._stepped.clear()
        self._active = None

    @property
    def scale_value(self) -> Tensor:
        return self._scale

    @property
    def found_inf(self) -> Tensor:
        return self._found_inf

    # ---------------------------------------------------------------- reporting and state

    def layer_grad_scales(self, module: nn.Module) -> tuple[Tensor, Tensor]:
        """Per layer: the scale of the gradient at its output and of its parameter gradients, in
        this step (read after backward, before ``update``). Copies: the table changes next step."""
        v = self._active
        if v is None or v.gm is None:
            return self._scale.clone(), self._scale.clone()
        entries = v.site_entries.get(id(module))
        if entries is None:  # not a scaling site (batch norm, say): its gradients carry its node's P
            p = next(module.parameters(recurse=False), None)
            e = v.param_entry.get(id(p), 0) if p is not None else 0
            entries = (e, e)
        return self._P[entries[0]].clone(), self._P[entries[1]].clone()

    @property
    def layer_names(self) -> list[str]:
        """Conv/Linear layers (module names), in the order of ``telemetry()``'s vectors."""
        return [n.removeprefix("site:") for n in self._entries if n.startswith("site:")]

    def telemetry(self) -> dict[str, Tensor]:
        idx = self._site_idx
        if idx.numel() == 0:
            return {}
        s = self._s.index_select(0, idx)
        cum = self._P.index_select(0, idx)
        out = {
            "layer_scale": s,
            "cum_scale": cum,
            "layer_scale_min": s.min(),
            "layer_scale_max": s.max(),
            "layer_scale_mean": s.mean(),
        }
        # Scalars for a few layers (first, last and two between): curves to follow in TensorBoard.
        names = self.layer_names
        for i in sorted({round(k * (len(names) - 1) / 3) for k in range(4)}):
            out[f"cum_scale/{names[i]}"] = cum[i]
        return out

    def summary(self) -> dict[str, Any]:
        names = self.layer_names
        idx = self._site_idx
        s = self._s.index_select(0, idx).tolist() if names else []
        cum = self._P.index_select(0, idx).tolist() if names else []
        return {
            "policy": self.policy,
            "scale": float(self._P[0]),  # the chain's first scale (at the outputs) in the last step
            "init_scale": self.init_scale,
            "steps": self._step,
            "layer_scales": dict(zip(names, s, strict=True)),
            "cum_scales": dict(zip(names, cum, strict=True)),
            "layer_scale_min": min(s, default=1.0),
            "layer_scale_max": max(s, default=1.0),
            "layer_scale_mean": sum(s) / len(s) if s else 1.0,
        }

    def state_dict(self) -> dict[str, Any]:
        names = list(self._entries)
        return {
            "policy": self.policy,
            "init_scale": self.init_scale,
            "step": self._step,
            "recompute": self._recompute,
            "entries": names,
            "s": self._s.tolist(),
            "P": self._P.tolist(),
            "known": [names[i] for i in sorted(self._known)],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        _check_policy(self.policy, state)
        if self._module is None:  # before attach: the table does not exist yet
            self._pending_state = dict(state)
            return
        saved = {n: i for i, n in enumerate(state["entries"])}
        missing = [n for n in self._entries if n.startswith("site:") and n not in saved]
        if missing:
            raise MptrainError(
                "checkpoint's adaptive loss-scale state is for a different model "
                f"(no scales for layers {', '.join(m.removeprefix('site:') for m in missing[:5])})"
            )
        self._step = int(state["step"])
        self._recompute = bool(state["recompute"])
        known = set(state["known"])
        s, p = list(self._s.tolist()), list(self._P.tolist())
        for name, i in self._entries.items():
            if name in saved:
                s[i], p[i] = state["s"][saved[name]], state["P"][saved[name]]
        self._s = torch.tensor(s, dtype=torch.float32, device=self.device)
        self._P = torch.tensor(p, dtype=torch.float32, device=self.device)
        if not self.auto_init:
            self._P[0] = self.init_scale_value
        self._known = {i for n, i in self._entries.items() if n in known}
        self._fresh.clear()


def _fetch_attr(gm: nn.Module, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj
