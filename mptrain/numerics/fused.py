"""Fused quantizers: the reference numerics of ``formats``, ``mx``, ``qgemm`` and ``fp8``, compiled.

Emulating a format is a chain of elementwise ops (abs, amax, exponent, scale, round, clamp, select),
and run eagerly every op is one pass over memory: quantize-dequantize took 74% of an MXFP8 step.
Each function here is the same arithmetic as its reference, written once as plain torch code and
handed to ``torch.compile``, which fuses it into two passes over the operand (vectorised C++ on a
CPU, Triton on a GPU): one to find the scales, one to round (the scales themselves, one per block,
are stored in between: ``_kept``). What compile cannot fuse is done differently, on purpose, and the
tests hold every result bit-identical to the eager reference:

- FP8/FP16/BF16 rounding uses the arithmetic rounding (``formats.round_arith``'s rule, with the
  exponent read from the float's bits), not a cast to the 8-bit dtype: inductor's CPU code converts
  to float8 one element at a time, 10x slower than the arithmetic.
- Stochastic rounding draws from the run's counter-based stream (``rounding_rng``) inside the kernel
  (outside a run, from a stream keyed by the global RNG). A ``torch.Generator`` cannot enter a
  compiled graph: with one, the reference runs.
- The random Hadamard transform of wgrad's operands runs inside the block kernel: the reference
  defines it as a sum in index order of exact terms (``mx.rotate_blocks``), which a compiled kernel
  reproduces bit for bit, where a matmul adds in its BLAS kernel's own order.

Tensors are viewed as (A, n, B) with the blocks along n, without a copy for contiguous tensors and
for transposes (the weight-gradient GEMM's operands), so a quantizer reads its operand where it is.
The element format is a kernel argument (a few constants on the device), not compiled in: the five
MX formats share one block kernel and every FP8/FP6/FP4/FP16 rounding one element kernel, so a run,
or the test suite, compiles a handful of kernels (each once, for every shape: dims are dynamic).

A call into ``torch.compile``'d code costs tens of microseconds of host time (dynamo's frame
evaluation and guards) around kernels of a few: from its second time on, a call with the same
shape, strides, dtype and static options calls the compiled function directly (``_Direct``), and a
plain block or row-wise call skips the entry point's planning as well (``_Fast``).

On CUDA, ``qgemm`` traces these entry points into one compiled graph per direction of a Linear
layer (``call_graph``): one call into compiled code per layer, not one per quantizer.

Where torch.compile cannot run (no C++ compiler, no Triton, an unsupported platform), the first call
on that device logs one line and every call runs the eager reference. ``MPTRAIN_FUSED=0`` in the
environment, or ``with reference():``, does the same on purpose (tests, debugging).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import re
import types
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch
from torch import Tensor

from mptrain.numerics import formats as nf
from mptrain.numerics import mx
from mptrain.numerics.formats import ElementFormat
from mptrain.numerics.rounding_rng import (
    RoundingStream,
    bits16_from_index,
    draw_keys,
    global_stream,
    uniform_from_index,
)

log = logging.getLogger(__name__)

_available: dict[str, bool] = {}  # device type -> torch.compile works there
_why_not: dict[str, str] = {}  # device type -> why the probe failed there
_forced_reference = os.environ.get("MPTRAIN_FUSED", "1").strip().lower() in ("0", "false", "off", "no")
_kernels: dict[str, tuple[Callable[..., Any], _Inductor]] = {}
_given_up: set[str] = set()  # kernels that run the reference after a compile failure
_params: dict[tuple[str, str], tuple[Tensor, Tensor]] = {}
# Inductor's Triton code divides with div.full (approximate: NVFP4's scales came out an ulp off
# the reference on an H200) and may flush FP32 subnormals to zero (MX's smallest scales are
# subnormal): these options ask for eager's rounding of both (Triton options).
_EAGER_NUMERICS = {"eager_numerics.division_rounding": True, "eager_numerics.disable_ftz": True}


# --------------------------------------------------------------------------------------------
# when to run fused


@contextlib.contextmanager
def reference() -> Iterator[None]:
    """Run the eager reference inside the block (the tests' side of every bit-identity check)."""
    global _forced_reference
    before, _forced_reference = _forced_reference, True
    try:
        yield
    finally:
        _forced_reference = before


@contextlib.contextmanager
def forced(on: bool = True) -> Iterator[None]:
    """Run fused (``on``) or the reference inside the block, whatever ``MPTRAIN_FUSED`` says."""
    global _forced_reference
    before, _forced_reference = _forced_reference, not on
    try:
        yield
    finally:
        _forced_reference = before


def enabled(x: Tensor) -> bool:
    """Whether the fused kernels run for ``x``: FP32/FP16/BF16 on a device where compile works.
    float64 runs the reference, which rounds it once in float64."""
    if _forced_reference or x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return False
    kind = x.device.type
    if kind not in _available:
        _available[kind] = _probe(x.device)
    return _available[kind]


def status(device: torch.device | str) -> str:
    """"fused", or "reference (why)", for the log and summary.json."""
    if _forced_reference:
        return "reference (MPTRAIN_FUSED=0)"
    if enabled(torch.zeros(1, device=device)):
        return "fused"
    return f"reference (torch.compile unavailable: {_why_not.get(torch.device(device).type, '?')})"


WRONG = "the compiled rounding differs from the reference"  # the probe's reason for a miscompiled kernel


def _probe(device: torch.device) -> bool:
    try:
        x = torch.linspace(-3, 3, 64, device=device)
        got = _call("round", _opts(True, False), x, *_elem(nf.E4M3, device), True, None, None)
        if not torch.equal(got, nf.round_to_element(x, nf.E4M3)):
            raise RuntimeError(WRONG)
        return True
    except Exception as exc:  # any failure to build a kernel: no compiler, no Triton, ...
        reason = str(exc).strip().splitlines()[0][:160] if str(exc).strip() else type(exc).__name__
        _why_not[device.type] = reason
        log.warning("fused quantizers unavailable on %s (torch.compile: %s): running the eager reference, "
                    "several times slower", device.type, reason)
        return False


def compile_seconds() -> float:
    """Seconds torch.compile has spent in this process (every frame: these kernels and
    ``trainer.compile``), for keeping compile time out of throughput. 0 where torch does not say."""
    try:
        from torch._dynamo.utils import cumulative_time_spent_ns

        return float(cumulative_time_spent_ns.get("entire_frame_compile", 0.0)) / 1e9
    except (ImportError, AttributeError):
        return 0.0


class _Unfused(Exception):
    """This call cannot run compiled (a torch.Generator, a kernel past dynamo's recompile limit)."""


class _Inductor(torch._TorchCompileInductorWrapper):  # type: ignore[misc, name-defined]
    """Inductor with ``options``, as ``torch.compile(options=...)`` runs it, keeping every graph it
    compiles with its compiled function, and which of them ran last (``_Direct``)."""

    def __init__(self, options: dict[str, Any]) -> None:
        super().__init__(None, options, None)
        self.graphs: list[tuple[torch.fx.GraphModule, Callable[..., Any]]] = []
        self.ran: int | None = None

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Any, **kwargs: Any) -> Any:
        fn = super().__call__(gm, example_inputs, **kwargs)
        i = len(self.graphs)
        self.graphs.append((gm, fn))

        @functools.wraps(fn)  # keeps the calling convention's marker (_boxed_call)
        def run(*args: Any) -> Any:
            self.ran = i
            return fn(*args)

        return run


def _kernel(name: str, variant: str) -> tuple[Callable[..., Any], _Inductor]:
    """The compiled kernel ``name`` in one variant (static options, which dims are 1), built once,
    and its backend (which holds the graphs compiled for it).

    Each variant gets a code object of its own: dynamo caches compiled code per code object, so
    variants do not share one recompile budget. Tensor dims are marked dynamic from the first call
    (``_call``): one compiled kernel serves every shape.
    """
    key = f"{name}_{variant}"
    k = _kernels.get(key)
    if k is None:
        body = _BODIES[name]
        code = body.__code__.replace(co_name=f"{body.__name__}_{variant}")
        fn = types.FunctionType(code, body.__globals__, code.co_name, body.__defaults__, body.__closure__)
        backend = _Inductor(_EAGER_NUMERICS)
        k = _kernels[key] = (torch.compile(fn, fullgraph=True, backend=backend), backend)
    return k


class _Entry(NamedTuple):
    kernel: Callable[..., Any]
    key: str  # the variant's name, as _given_up holds it
    dims: list[int]  # x's dims marked dynamic
    backend: _Inductor


# (name, options, x's shape, dtype and device) -> its compiled kernel: a step makes hundreds of calls
# on a few dozen shapes, and naming the variant on every call cost a few microseconds a call.
_entries: dict[tuple[str, str, torch.Size, torch.dtype, torch.device], _Entry] = {}


def _call(name: str, options: str, x: Tensor, *args: Any) -> Any:
    """Run kernel ``name`` on ``x`` and ``args``, in the variant of its static ``options`` and of
    x's unit dims. x is detached: gradients never flow through a quantizer (the layers' autograd
    functions own that), and requires_grad would be one more guard. Inside a graph being compiled
    (``call_graph``), the body is traced into it. A pure kernel's call goes direct (``_Direct``) from
    the second time its signature is seen."""
    x = x.detach()
    if torch.compiler.is_compiling():
        return _BODIES[name](x, *args)
    pure = _direct_calls and name in _PURE
    if pure:
        sig = _signature(name, options, x, args)
        direct = _directs.get(sig)
        if direct is not None:
            return direct(x, args)
    entry = _entries.get((name, options, x.shape, x.dtype, x.device))
    if entry is None:
        # x's dtype and device name the variant too: each has a recompile budget of its own.
        where = x.device.type + ("" if x.device.index is None else str(x.device.index))
        variant = f"{options}_{''.join('1' if s == 1 else 'x' for s in x.shape)}_{str(x.dtype)[6:]}_{where}"
        key = f"{name}_{variant}"
        if key in _given_up:
            raise _Unfused
        dims = [d for d, s in enumerate(x.shape) if s != 1]
        kernel, backend = _kernel(name, variant)
        entry = _entries[(name, options, x.shape, x.dtype, x.device)] = _Entry(kernel, key, dims, backend)
    # On every call, not only a shape's first: after a torch._dynamo.reset() any call may compile.
    torch._dynamo.maybe_mark_dynamic(x, entry.dims)
    try:
        return _through_dynamo(entry.kernel, entry.backend, _directs, sig if pure else None, _BODIES[name], entry.key,
                               x, args)
    except torch._dynamo.exc.FailOnRecompileLimitHit:
        _given_up.add(entry.key)
        for k in [k for k, e in _entries.items() if e.key == entry.key]:
            del _entries[k]
        for k in [k for k, d in _directs.items() if d is not None and d.key == entry.key]:
            del _directs[k]
        log.warning("fused quantizer %s recompiled too often (torch._dynamo.config.recompile_limit); it runs the "
                    "eager reference from here on", entry.key)
        raise _Unfused from None


# --------------------------------------------------------------------------------------------
# calling a compiled kernel without dynamo's frame evaluation

_direct_calls = True  # off (``through_dynamo``): every call through torch.compile's entry


@contextlib.contextmanager
def through_dynamo() -> Iterator[None]:
    """No direct calls inside the block: every compiled call through torch.compile's entry, as before
    them (the benchmarks' side of what they buy; scripts/formats_call_budget.py)."""
    global _direct_calls
    before, _direct_calls = _direct_calls, False
    try:
        yield
    finally:
        _direct_calls = before


def _signature(name: str, options: str, x: Tensor, args: tuple[Any, ...]) -> tuple[Any, ...]:
    """What a direct call is keyed by: everything dynamo's guards check that can vary (``_Direct``)."""
    return (name, options, x.shape, x.stride(), x.dtype, x.device,
            *(a.shape if isinstance(a, Tensor) else a for a in args))  # fmt: skip


# Kernels that only read their arguments: their compiled functions may be called directly. The
# in-place ones (round_, bf16_) keep dynamo's path.
_PURE = frozenset({"round", "scaled", "axis", "blocks", "tiles", "round_all", "write_all"})


def _bits(t: Tensor) -> Tensor:
    return t.reshape(-1).contiguous().view(torch.uint8) if t.is_floating_point() else t


class _Direct:
    """A compiled kernel's code, called with the graph's inputs picked from the kernel's arguments, and
    its outputs put back where the kernel returns them.

    Why: a call through ``torch.compile`` costs ~25 us of host time on a CPU (dynamo's frame
    evaluation and guards, marking dims dynamic, AOTAutograd's runtime wrappers) around a kernel
    that takes ~3 us on a block of 32 rows; an MXFP8 ResNet-50/8 step makes 322 such calls. The
    guards are what this skips, so a direct call is keyed (``_call``) by everything they check that
    can vary between calls: x's shape, strides, dtype and device, the other tensors' shapes (the
    format's constants, the rounding stream's, a group's index: all made by this module), and the
    values of the non-tensor arguments. Built from the graph that dynamo ran for that key
    (``_Inductor.ran``), and only where the graph's inputs can be read off the arguments (tensors
    and ints by name, sizes and strides by symbol). It calls inductor's generated code itself where
    AOTAutograd's wrappers around it have nothing to do (``_generated_call``), else the compiled
    function; either is checked once, bit for bit, against the result dynamo's call returned.
    Anything else keeps dynamo's path."""

    def __init__(self, fn: Callable[..., Any], picks: list[tuple[int, int, int]], slots: list[bool] | None,
                 key: str, consts: list[Tensor]) -> None:
        self.fn, self.picks, self.slots, self.key, self.consts = fn, picks, slots, key, consts
        self.boxed = False  # the calling convention: fn(list) (AOTAutograd's boxed one), or fn(*inputs)
        self.generated = False  # fn is inductor's generated code (_generated_call)

    def raw(self, x: Tensor, args: tuple[Any, ...]) -> Any:
        """The graph's outputs, as the compiled code returns them."""
        full = (x, *args)
        inputs = [full[i] if what == 0 else full[i].size(d) if what == 1 else full[i].stride(d) if what == 2
                  else self.consts[i] for i, what, d in self.picks]  # fmt: skip
        return self.fn(inputs) if self.boxed else self.fn(*inputs)

    def __call__(self, x: Tensor, args: tuple[Any, ...]) -> Any:
        outs = self.raw(x, args)
        if self.slots is None:
            return outs[0]
        it = iter(outs)
        return tuple(next(it) if tensor else None for tensor in self.slots)

    @classmethod
    def of(cls, gm: torch.fx.GraphModule, fn: Callable[..., Any], body: Callable[..., Any], key: str, x: Tensor,
           args: tuple[Any, ...], out: Any) -> _Direct | None:
        """The direct call of graph ``gm`` (compiled: ``fn``), which dynamo just ran for ``body(x, *args)``
        and which returned ``out``; None where how to call it is not certain."""
        names = body.__code__.co_varnames[:body.__code__.co_argcount]
        full = (x, *args)
        holders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        tensors: dict[str, int] = {}
        ints: dict[str, int] = {}  # int arguments dynamo made dynamic (the row-wise kernel's strides)
        consts: dict[str, Tensor] = {}  # a format's constants, read by a traced graph (call_graph)
        for n in holders:
            ev = n.meta.get("example_value")
            arg = n.name[2:-1] if n.name.startswith("l_") and n.name.endswith("_") else None
            i = names.index(arg) if arg in names else -1
            if isinstance(ev, Tensor):
                if i >= 0 and isinstance(full[i], Tensor):
                    tensors[n.name] = i
                elif (c := _constant(n.name)) is not None and (c.shape, c.dtype, c.device) == (
                        ev.shape, ev.dtype, ev.device):  # fmt: skip
                    consts[n.name] = c
                else:
                    return None
            elif i >= 0 and type(full[i]) is int:
                ints[n.name] = i
        picks: list[tuple[int, int, int]] = []
        for n in holders:
            ev = n.meta.get("example_value")
            if n.name in tensors or n.name in ints:
                picks.append(((tensors | ints)[n.name], 0, 0))
                continue
            if n.name in consts:
                picks.append((list(consts).index(n.name), 3, 0))
                continue
            if not isinstance(ev, torch.SymInt):
                return None
            found = [(tensors[m.name], what, d) for m in holders if m.name in tensors
                     for what, dims in ((1, m.meta["example_value"].shape), (2, m.meta["example_value"].stride()))
                     for d, s in enumerate(dims) if str(s) == str(ev)]  # fmt: skip
            if not found:
                return None
            picks.append(found[0])
        outputs = next(n for n in gm.graph.nodes if n.op == "output").args[0]
        count = len(outputs) if isinstance(outputs, (tuple, list)) else 1
        if isinstance(out, Tensor):
            slots, mine = None, [out]
        elif isinstance(out, tuple) and all(o is None or isinstance(o, Tensor) for o in out):
            slots, mine = [isinstance(o, Tensor) for o in out], [o for o in out if isinstance(o, Tensor)]
        else:
            return None
        if len(mine) != count:
            return None

        def same(got: Any) -> bool:
            got = [got] if isinstance(got, Tensor) else [g for g in got if isinstance(g, Tensor)]
            return len(got) == len(mine) and all(
                a.shape == b.shape and a.dtype == b.dtype and a.stride() == b.stride()
                and torch.equal(_bits(a), _bits(b)) for a, b in zip(got, mine, strict=True))  # fmt: skip

        direct = cls(fn, picks, slots, key, list(consts.values()))
        for direct.boxed in (False, True):
            try:
                got = direct(x, args)
                break
            except Exception:  # a wrong calling convention fails to unpack its inputs
                pass
        else:
            return None
        if not same(got):
            return None
        call = _generated_call(gm, fn)
        if call is not None:
            fast = cls(call, picks, slots, key, direct.consts)
            fast.boxed = fast.generated = True
            try:
                outs = fast.raw(x, args)
            except Exception:  # inputs the generated code does not take as the graph's: keep the function
                return direct
            inputs = {t.untyped_storage().data_ptr() for t in (x, *args, *fast.consts) if isinstance(t, Tensor)}
            if (isinstance(outs, (list, tuple)) and len(outs) == count and same(fast(x, args))
                    and not any(o.untyped_storage().data_ptr() in inputs for o in outs)):  # fmt: skip
                return fast
        return direct


def _through_dynamo(kernel: Callable[..., Any], backend: _Inductor, directs: dict[Any, _Direct | None], key: Any,
                    body: Callable[..., Any], label: str, x: Tensor, args: tuple[Any, ...]) -> Any:
    """``kernel(x, *args)``, compiled ``body``, through torch.compile's entry; the first time ``key``
    (None: no direct call wanted) is seen, the direct call of the graph that ran is kept in ``directs``
    (None where it has none)."""
    backend.ran = None
    out = kernel(x, *args)
    if key is not None and key not in directs and backend.ran is not None:
        gm, fn = backend.graphs[backend.ran]
        directs[key] = _Direct.of(gm, fn, body, label, x, args, out)
    return out


def _generated_call(gm: torch.fx.GraphModule, fn: Callable[..., Any]) -> Callable[..., Any] | None:
    """Inductor's generated ``call`` for graph ``gm``, found inside AOTAutograd's wrappers of ``fn``
    (through their closures: no API hands it out), or None where the wrappers may have work to do:
    parameters or buffers of ``gm`` (inputs they prepend), or not exactly one compiled graph.

    Why: for a graph that mutates no input and returns fresh tensors, as the quantizers' are (the
    caller checks the outputs), the wrappers' work is bookkeeping, and they cost ~4 us a call (a
    dynamo-disabled frame, grad-mode and output metadata handling): 4 ms of an MXFP8 ResNet-50/8
    step on a CPU."""
    try:
        from torch._inductor.output_code import CompiledFxGraph
    except ImportError:
        return None
    if any(True for _ in gm.parameters()) or any(True for _ in gm.buffers()):
        return None
    found: dict[int, Any] = {}
    seen: set[int] = set()
    todo: list[tuple[Any, int]] = [(fn, 0)]
    while todo and len(seen) < 2000:
        obj, depth = todo.pop()
        if id(obj) in seen or depth > 12:
            continue
        seen.add(id(obj))
        if isinstance(obj, CompiledFxGraph):
            found[id(obj)] = obj
            continue
        for cell in getattr(obj, "__closure__", None) or ():
            with contextlib.suppress(ValueError):  # an empty cell
                todo.append((cell.cell_contents, depth + 1))
        if getattr(obj, "__wrapped__", None) is not None:
            todo.append((obj.__wrapped__, depth + 1))
        if not isinstance(obj, (type, types.ModuleType, torch.fx.GraphModule)) and hasattr(obj, "__dict__"):
            todo += [(v, depth + 1) for v in vars(obj).values() if callable(v) or isinstance(v, CompiledFxGraph)]
    if len(found) != 1:
        return None
    return getattr(next(iter(found.values())), "current_callable", None)


class _Fast:
    """A quantizer entry point's whole call, from the second time its signature is seen (the entry
    point, its static arguments, x's shape, strides, dtype and device): x's (A, n, B) view, the
    generated code with every other input already in place, and the view of its output in x's
    layout, each worked out once.

    Why: around a kernel of a few microseconds, the entry points spent ~10 us more a call deciding
    again what the signature decides (the plan, the views, the constants, the direct call's
    inputs); a ResNet-50/8 step makes 224 to 322 such calls. Only for the plain path (x viewed in
    place, no padding, no copy) and only where the direct call is inductor's generated code; the
    rest keeps the full path, which builds these."""

    __slots__ = ("back", "fill", "fn", "owner", "rest", "template", "three")

    def __init__(self, direct: _Direct, full: tuple[Any, ...], per_call: tuple[int, ...], x3: Tensor,
                 local: Tensor, outputs: int, owner: object) -> None:
        self.fn = direct.fn
        template: list[Any] = []
        fill: list[tuple[int, int]] = []
        for slot, (i, what, d) in enumerate(direct.picks):
            if what == 3:
                template.append(direct.consts[i])
            elif i in per_call and what == 0:
                template.append(None)
                fill.append((slot, per_call.index(i)))
            elif what == 0:
                template.append(full[i])  # a format's constants, or an int: the signature pins them
            elif what == 1 or i == 0:  # every tensor's sizes, and x's strides, are in the signature
                template.append(full[i].size(d) if what == 1 else full[i].stride(d))
            else:
                raise ValueError("a stride the signature does not pin")
        self.template, self.fill = template, fill
        self.three = (tuple(x3.shape), x3.stride())
        self.back = (tuple(local.shape), local.stride())
        # the caller's outputs after the first: the generated code's output index, or None (the
        # kernel returns None there, as MX's tensor scale)
        tensor = direct.slots or [True]
        self.rest = tuple(sum(tensor[:k]) if tensor[k] else None for k in range(1, outputs))
        self.owner = owner  # the key holds its id(): kept alive, no other object can take that id

    def __call__(self, x: Tensor, per_call: tuple[Any, ...]) -> tuple[Tensor | None, ...]:
        inputs = self.template.copy()
        values = (x.as_strided(*self.three), *per_call)
        for slot, i in self.fill:
            inputs[slot] = values[i]
        outs = self.fn(inputs)
        return outs[0].as_strided(*self.back), *(None if j is None else outs[j] for j in self.rest)


# (entry point, static arguments, x's shape, strides, dtype, device) -> its _Fast
_fast: dict[tuple[Any, ...], _Fast] = {}


def _fast_key(name: str, fmt: object, dim: int, stochastic: bool, x: Tensor,
              rot: Tensor | None = None) -> tuple[Any, ...]:
    """A call's ``_fast`` key: the entry point, its static arguments, x's layout, dtype and device."""
    return (name, id(fmt), dim, stochastic, None if rot is None else rot.shape, x.shape, x.stride(), x.dtype, x.device)


def _fast_for(key: tuple[Any, ...]) -> _Fast | None:
    if not _direct_calls or _forced_reference or torch.compiler.is_compiling():
        return None
    return _fast.get(key)


def _stream_args(generator: Any, stochastic: bool) -> tuple[Tensor | None, Tensor | None]:
    """A stream's (keys, counter) as a kernel call's signature sees them, taking no draw."""
    return (generator.keys, generator.counter) if stochastic else (None, None)


def _keep_fast(key: tuple[Any, ...], name: str, options: str, x3: Tensor, args: tuple[Any, ...],
               per_call: tuple[int, ...], local: Tensor, outputs: int, owner: object) -> None:
    """After a plain call through ``_call`` with ``args``: its ``_Fast``, where its direct call is
    inductor's code. ``per_call``: the positions in (x3, *args) of what changes between calls (x's
    view, the stream's keys and counter, a rotation); ``local``: the output in x's layout."""
    if key in _fast or not _direct_calls:
        return
    direct = _directs.get(_signature(name, options, x3, args))
    if direct is None or not direct.generated:
        return
    with contextlib.suppress(ValueError):
        _fast[key] = _Fast(direct, (x3, *args), per_call, x3, local, outputs, owner)


def _constant(placeholder: str) -> Tensor | None:
    """The format constant (``_elem``) a graph input of this name holds: dynamo names a global's item by
    its path, ``..._params_<format>_<device>_<0 or 1>_``; None for any other name, or two matches."""
    found = [t for (fmt, dev), pair in _params.items() for i, t in enumerate(pair)
             if placeholder.endswith("_params_" + re.sub(r"\W", "_", f"{fmt}_{dev}_{i}") + "_")]  # fmt: skip
    return found[0] if len(found) == 1 else None


# (name, options, x's shape, strides, dtype and device, the other tensors' shapes, the non-tensor
# arguments) -> direct call, or None where it has none
_directs: dict[tuple[Any, ...], _Direct | None] = {}


_graphs: dict[str, tuple[Callable[..., Any], _Inductor]] = {}
_graph_directs: dict[tuple[Any, ...], _Direct | None] = {}


def blocks_fusable(fmt: mx.BlockFormat) -> bool:
    """Whether the block kernels know ``fmt`` (MX blocks of 32, NVFP4 blocks of 16, elements that fit)."""
    return fmt.block_size == (16 if fmt.two_level else 32) and _fits(fmt.element)


def element_fusable(fmt: ElementFormat) -> bool:
    """Whether the element kernels know ``fmt``."""
    return _fits(fmt)


def prepare(fmt: ElementFormat, device: torch.device) -> None:
    """Make ``fmt``'s constants on ``device`` before a graph is traced that reads them (a graph must
    not create the cached tensors it reads)."""
    _elem(fmt, device)


# Where qgemm runs a layer's GEMMs as one graph (see ``qgemm._gemms`` for why CUDA only).
_graph_devices: set[str] = {"cuda"}


@contextlib.contextmanager
def graphs(*device_types: str) -> Iterator[None]:
    """Run qgemm's Linear GEMMs as graphs on these device types inside the block (the tests' way to
    check the graphs on a CPU)."""
    global _graph_devices
    before, _graph_devices = _graph_devices, set(device_types)
    try:
        yield
    finally:
        _graph_devices = before


def graph_enabled(x: Tensor) -> bool:
    """Whether qgemm runs the GEMMs of ``x``'s layer as one compiled graph."""
    return x.device.type in _graph_devices and enabled(x)


def call_graph(body: Callable[..., Any], *args: Any) -> Any:
    """``body(*args)`` as one compiled graph, the fused quantizers traced into it: a layer's GEMMs in
    one direction (``qgemm._gemms``). Compiled per variant, as ``_kernel`` does: the static arguments
    (flags, tuples, dtypes, which tensors are absent, a recipe's ``graph_key``) and the tensors' unit
    dims name it, and every other dim is dynamic, so that a model's layers share a few graphs and
    never hit dynamo's recompile limit. After a compile failure of a variant, its calls run ``body``
    eagerly."""
    def sig(a: Any) -> str:
        if isinstance(a, Tensor):
            return "T" + "".join("1" if s == 1 else "x" for s in a.shape) + str(a.dtype)[6:]
        if hasattr(a, "graph_key"):  # a GEMM recipe
            return a.graph_key()
        return "-" if a is None else repr(a).replace(" ", "")
    if torch.compiler.is_compiling():  # a user's torch.compile around the layers: traced into theirs
        return body(*args)
    variant = body.__name__ + "|" + ",".join(sig(a) for a in args)
    if variant in _given_up:
        return body(*args)
    args = tuple(a.detach() if isinstance(a, Tensor) else a for a in args)
    # as _call's direct calls: a graph's inputs are its tensors (their layouts key it) and the variant's
    # static arguments; one that reads tensors held by an object (a rounding stream's) has none
    key = (variant, *((a.shape, a.stride(), a.dtype, a.device) for a in args if isinstance(a, Tensor)))
    direct = _graph_directs.get(key) if _direct_calls else None
    if direct is not None:
        return direct(args[0], args[1:])
    entry = _graphs.get(variant)
    if entry is None:
        code = body.__code__.replace(co_name=f"{body.__name__}_{len(_graphs)}")
        fn = types.FunctionType(code, body.__globals__, code.co_name, body.__defaults__, body.__closure__)
        # no pattern passes: they fused the bias add into the GEMM (addmm), which sums in another order
        backend = _Inductor({**_EAGER_NUMERICS, "pattern_matcher": False})
        entry = _graphs[variant] = (torch.compile(fn, fullgraph=True, backend=backend), backend)
    k, backend = entry
    for a in args:
        if isinstance(a, Tensor):
            for d, s in enumerate(a.shape):
                if s != 1:
                    torch._dynamo.maybe_mark_dynamic(a, d)
    try:
        return _through_dynamo(k, backend, _graph_directs, key if _direct_calls else None, body, variant, args[0],
                               args[1:])
    except Exception as exc:  # past the recompile limit, or a graph dynamo or inductor cannot build
        _given_up.add(variant)
        reason = str(exc).strip().splitlines()[0][:160] if str(exc).strip() else type(exc).__name__
        log.warning("fused GEMM graph %s: %s; its calls run eagerly from here on", variant, reason)
        return body(*args)


def _opts(*flags: Any) -> str:
    """The static options of a call as a variant name: bools t/f, strings as they are, None '-'."""
    return "".join("-" if f is None else ("t" if f else "f") if isinstance(f, bool) else str(f) for f in flags)


def _elem(fmt: ElementFormat, device: torch.device) -> tuple[Tensor, Tensor]:
    """A format's constants as kernel arguments, made once per device (no copy per call):
    float32 [max, 2**mbits, 2**-mbits, overflow threshold, overflow value, max's code is even]
    and int32 ``_ints(fmt)``."""
    key = (fmt.name, str(device))
    found = _params.get(key)
    if found is None:
        threshold = fmt.max_normal + 2.0 ** (fmt.emax - fmt.mbits - 1)
        pf = torch.tensor([fmt.max_normal, 2.0**fmt.mbits, 2.0**-fmt.mbits, threshold,
                           math.inf if fmt.has_inf else math.nan, float(nf.max_code_is_even(fmt))],
                          dtype=torch.float32, device=device)  # fmt: skip
        pi = torch.tensor(_ints(fmt), dtype=torch.int32, device=device)
        found = _params[key] = (pf, pi)
    return found


def _stream(x: Tensor, stochastic: bool, generator: Any, draws: int = 1) -> tuple[Tensor | None, Tensor | None]:
    """(keys, the first of this call's ``draws`` counters) for a kernel; ``_Unfused`` for a
    torch.Generator (its uniforms cannot be drawn inside a compiled kernel: the reference draws them)."""
    if not stochastic:
        return None, None
    if generator is None:
        generator = global_stream(x.device)
    if not isinstance(generator, RoundingStream):
        raise _Unfused
    return generator.keys, generator.take(draws)


def _fits(fmt: ElementFormat) -> bool:
    # the element kernel builds 2**k from the exponent bits, for |k| <= 126: every format but bf16
    return fmt.emin >= -126 and fmt.emax <= 126


# --------------------------------------------------------------------------------------------
# kernel bodies: plain torch, compiled by _kernel


def _exponent(a: Tensor) -> Tensor:
    """floor(log2(a)) for finite a > 0 from the float's exponent bits; -127 for 0 and subnormals
    (callers clamp it far above that). The same value frexp gives, as plain integer ops."""
    return ((a.view(torch.int32) >> 23) & 0xFF) - 127


def _pow2(k: Tensor) -> Tensor:
    """2**k for an integer k in [-126, 127], straight from the exponent bits."""
    return ((k + 127) << 23).view(torch.float32)


def _round(xf: Tensor, pf: Any, pi: Any, u: Tensor | None) -> Tensor:
    """``formats.round_arith`` for FP32 (saturating; to nearest even, or stochastic with uniforms
    ``u``) for a format given by its constants (``_elem``). The exponent comes from the bits, and NaN
    needs no select: it propagates through every step (only its payload may differ)."""
    a = xf.abs().clamp(max=pf[0])
    if u is None:
        # Round to nearest even by one FP32 add and subtract: with c = 2**(e + 23 - mbits), e = a's
        # exponent (at least emin), a + c lies in c's binade, whose spacing is the format's spacing
        # at a, so the add rounds a onto the grid, ties to even, and the subtract is exact. Half the
        # ops of the scale-round-scale path, every step still exact.
        c = ((a.view(torch.int32) & 0x7F800000).clamp(min=pi[2]) + pi[3]).view(torch.float32)
        return _with_sign((a + c) - c, xf)
    e = torch.clamp(_exponent(a), pi[0], pi[1])
    scaled = a * _pow2(-e) * pf[1]
    down = torch.floor(scaled)
    r = down + (u < scaled - down).float()
    return _with_sign(r * pf[2] * _pow2(e), xf)


def _with_sign(m: Tensor, x: Tensor) -> Tensor:
    """copysign(m, x) for m >= 0 (or NaN), as one OR of x's sign bit: torch.copysign compiled to a
    call into Sleef per vector on a CPU, 11% of an MXFP8 block kernel's time. Bit for bit the same."""
    return (m.view(torch.int32) | (x.view(torch.int32) & -(2**31))).view(torch.float32)


def _overflow(xf: Tensor, q: Tensor, pf: Tensor, stochastic: bool) -> Tensor:
    """``saturate=False``: what leaves the format becomes Inf (or NaN); see ``formats.overflows``."""
    a = xf.abs()
    over = a > pf[0] if stochastic else torch.where(pf[5] > 0, a > pf[3], a >= pf[3])
    return torch.where(over, torch.copysign(pf[4].expand_as(xf), xf), q)


def _uniform(n: int, device: torch.device, keys: Tensor, counter: Tensor) -> Tensor:
    ka, kb = draw_keys(keys, counter)
    return uniform_from_index(torch.arange(n, dtype=torch.int32, device=device), ka, kb)


def _k_round(x: Tensor, pf: Tensor, pi: Tensor, saturate: bool, keys: Tensor | None,
             counter: Tensor | None) -> Tensor:
    """``formats.round_to_element`` on a flat tensor (FP32 out)."""
    xf = x.float()
    u = _uniform(xf.shape[0], xf.device, keys, counter) if keys is not None else None
    q = _round(xf, pf, pi, u)
    return q if saturate else _overflow(xf, q, pf, u is not None)


def _k_round_(x: Tensor, pf: Tensor, pi: Tensor, keys: Tensor | None, counter: Tensor | None) -> None:
    """In place, saturating: a parameter onto FP16 (FP8's FP16 master weights)."""
    u = _uniform(x.shape[0], x.device, keys, counter) if keys is not None else None
    x.copy_(_round(x.float(), pf, pi, u).to(x.dtype))


def _k_round_all(x: Tensor, which: Tensor | None, starts: Tensor | None, pf: Tensor, pi: Tensor,
                 keys: Tensor | None, first: Tensor | None) -> Tensor:
    """``_k_round_`` on the concatenation of several flat tensors, out of place: element k belongs
    to tensor ``which[k]``, which starts at ``starts[which[k]]`` and draws with counter
    ``first + which[k]``, as each tensor does in its own call."""
    u = None
    if keys is not None:
        ka, kb = draw_keys(keys, first + which)  # type: ignore[operator]
        index = torch.arange(x.shape[0], dtype=torch.int32, device=x.device) - starts[which]  # type: ignore[index]
        u = uniform_from_index(index, ka, kb)
    return _round(x.float(), pf, pi, u).to(x.dtype)


def _k_write_all(m: Tensor, which: Tensor, starts: Tensor, pf: Tensor, pi: Tensor, keys: Tensor, first: Tensor,
                 bf16: bool) -> Tensor:
    """``_k_bf16_``, or ``_k_round`` onto FP16 (stochastic, saturating), on the concatenation of
    several flat FP32 masters (``_k_round_all``'s layout): their bf16 / FP16 values."""
    ka, kb = draw_keys(keys, first + which)
    index = torch.arange(m.shape[0], dtype=torch.int32, device=m.device) - starts[which]
    if bf16:
        rounded = ((m.view(torch.int32) + bits16_from_index(index, ka, kb)) & -65536).view(torch.float32)
        return torch.where(torch.isfinite(m), rounded, m).to(torch.bfloat16)
    return _round(m, pf, pi, uniform_from_index(index, ka, kb)).to(torch.float16)


def _k_bf16_(p: Tensor, m: Tensor, keys: Tensor, counter: Tensor) -> None:
    """``stochastic_round_to_bf16`` of flat FP32 ``m`` into bf16 ``p``: 16 random bits added below
    bf16's mantissa, then truncated."""
    ka, kb = draw_keys(keys, counter)
    noise = bits16_from_index(torch.arange(m.shape[0], dtype=torch.int32, device=m.device), ka, kb)
    rounded = ((m.view(torch.int32) + noise) & -65536).view(torch.float32)
    p.copy_(torch.where(torch.isfinite(m), rounded, m).to(torch.bfloat16))


def _pow2_scale(amax: Tensor, pf: Tensor, pi: Tensor) -> Tensor:
    """2**k, the largest power of two with amax * 2**k <= max (k in [-126, 126]); 1 for a zero or
    non-finite amax: ``fp8.tensor_scale`` and ``qgemm.axiswise_round``'s rule, from the bits."""
    ok = torch.isfinite(amax) & (amax > 0)
    safe = torch.where(ok, amax, 1.0)
    k = (pi[1] - _exponent(safe)).clamp(-126, 126)  # floor(log2 max) - floor(log2 amax): k or k + 1
    k = torch.where(safe * nf.exp2i(k) > pf[0], k - 1, k)
    k = torch.where(safe * nf.exp2i(k + 1) <= pf[0], k + 1, k).clamp(-126, 126)
    return torch.where(ok, nf.exp2i(k), 1.0)


def _k_scaled(x: Tensor, pf: Tensor, pi: Tensor, keys: Tensor | None, counter: Tensor | None) -> Tensor:
    """``fp8.quantize_scaled`` on a flat tensor: a per-tensor power-of-two scale, round, scale back;
    non-finite values pass through. Returns x's dtype."""
    xf = x.float()
    s = _pow2_scale(xf.abs().amax(), pf, pi)
    u = _uniform(xf.shape[0], xf.device, keys, counter) if keys is not None else None
    q = _round(xf * s, pf, pi, u) / s
    return torch.where(torch.isfinite(xf), q, xf).to(x.dtype)


def _k_axis(x3: Tensor, pf: Tensor, pi: Tensor, sa: int, sn: int, sb: int, keys: Tensor | None,
            counter: Tensor | None, last: bool = False) -> tuple[Tensor, ...]:
    """``qgemm.axiswise_round`` along dim 1 of (A, n, B), or, ``last``, along dim 2 of (A, B, n) (a
    copy with n innermost: ``_axiswise``). (sa, sn, sb): the caller's row-major strides along
    (A, n, B), the order its uniforms are drawn in, whichever layout the kernel reads."""
    xf = x3.float()
    s = _pow2_scale(xf.abs().amax(2 if last else 1, keepdim=True), pf, pi)
    u = None
    if keys is not None:
        a, m, k = xf.shape
        dev = xf.device
        idx = (torch.arange(a, dtype=torch.int32, device=dev).view(a, 1, 1) * sa
               + torch.arange(m, dtype=torch.int32, device=dev).view(1, m, 1) * (sb if last else sn)
               + torch.arange(k, dtype=torch.int32, device=dev).view(1, 1, k) * (sn if last else sb))  # fmt: skip
        ka, kb = draw_keys(keys, counter)  # type: ignore[arg-type]
        u = uniform_from_index(idx, ka, kb)
    q = _round(xf * s, pf, pi, u) / s
    return torch.where(torch.isfinite(xf), q, xf), *_kept(s)


_NV = nf.E2M1  # NVFP4's elements (its block scales are E4M3, its tensor scale FP32)


def _block_scales(amax: Tensor, t_amax: Tensor | None, pi: Tensor, kind: str) -> tuple[Tensor, Tensor]:
    """(multiplier onto the element grid, local scale) per block: MX's E8M0 rule (``pi[1]``: the
    element's emax), or NVFP4's E4M3 block scale under the tensor scale."""
    bad = ~torch.isfinite(amax)
    if kind == "nvfp4":
        t_scale, encode = mx.nvfp4_tensor_scales(t_amax, mx.BLOCK_FORMATS["nvfp4"])  # type: ignore[arg-type]
        e4m3, e4m3_i = _static(nf.E4M3)
        s_block = _round((amax / _NV.max_normal / t_scale).clamp(max=nf.E4M3.max_normal), e4m3, e4m3_i, None)
        s_block = torch.where(bad, math.nan, s_block)
        return torch.where(s_block > 0, (encode / s_block).clamp(max=mx.FP32_MAX), 0.0), s_block
    exps = (_exponent(amax) - pi[1]).clamp(-mx.E8M0_BIAS, mx.E8M0_BIAS)
    return nf.exp2i(-exps), torch.where(bad, math.nan, nf.exp2i(exps))


def _static(fmt: ElementFormat) -> tuple[tuple[float, ...], tuple[int, ...]]:
    """A format's constants as Python numbers, folded into the kernel (NVFP4's fixed E4M3 scales)."""
    return (fmt.max_normal, 2.0**fmt.mbits, 2.0**-fmt.mbits), _ints(fmt)


def _ints(fmt: ElementFormat) -> tuple[int, ...]:
    """[emin, emax, emin's FP32 exponent field, (23 - mbits) in the exponent field]: ``_round``'s."""
    return fmt.emin, fmt.emax, (fmt.emin + 127) << 23, (23 - fmt.mbits) << 23


def _kept(*per_block: Tensor) -> tuple[Tensor, ...]:
    """Per-block (or per-row) scales, returned as extra outputs that callers drop: an output is
    stored once, and the rounding loop then loads it. Otherwise inductor inlines the scale's ~25 ops
    (exponent, clamps, 2**k with its subnormal branch, the NaN select) into every element: the MXFP8
    block kernel took 1.45x as long on a CPU. Inside a ``call_graph`` graph they are dead code."""
    return per_block


def _k_blocks(x3: Tensor, pf: Tensor, pi: Tensor, kind: str, short: bool, keys: Tensor | None,
              counter: Tensor | None, rot: Tensor | None = None) -> tuple[Tensor | None, ...]:
    """``quantize_blocks(...).local`` and ``.tensor_scale`` for blocks along dim 1 of (A, N, B), N a
    multiple of the block (the caller pads), or, ``short``, N under one block: one block, its
    zero padding left out (it changes no amax). Uniforms follow the reference's layout,
    x.movedim(dim, -1) padded: element (a, i, b) is draw (a * B + b) * N' + i, N' the padded N.
    ``rot``: every 16 along N rotated first (``mx.rotate_blocks``), in the same pass over memory."""
    bs = 16 if kind == "nvfp4" else 32
    a, n, b = x3.shape
    xf = x3.float()
    if rot is not None:
        k = rot.shape[1]
        xf = mx.rotate_blocks(xf.view(a, n // k, k, b), rot, 2).view(a, n, b)
    blocks = xf.view(a, 1, n, b) if short else xf.view(a, n // bs, bs, b)
    amax = blocks.abs().amax(2, keepdim=True)
    t_amax = t_scale = None
    if kind == "nvfp4":
        t_amax = torch.where(torch.isfinite(blocks), blocks.abs(), 0.0).amax()
        t_scale = mx.nvfp4_tensor_scales(t_amax, mx.BLOCK_FORMATS["nvfp4"])[0]
    mult, local_scale = _block_scales(amax, t_amax, pi, kind)
    u = None
    if keys is not None:
        dev = x3.device
        idx = ((torch.arange(a, dtype=torch.int32, device=dev).view(a, 1, 1) * b
                + torch.arange(b, dtype=torch.int32, device=dev).view(1, 1, b)) * (bs if short else n)
               + torch.arange(n, dtype=torch.int32, device=dev).view(1, n, 1))  # fmt: skip
        ka, kb = draw_keys(keys, counter)  # type: ignore[arg-type]
        u = uniform_from_index(idx.view(blocks.shape), ka, kb)
    q = _round(blocks * mult, pf, pi, u)
    return (q * local_scale).view(a, n, b), t_scale, *(_kept(mult, local_scale) if b != 1 else ())


def _k_tiles(x2: Tensor, pf: Tensor, pi: Tensor, kind: str, keys: Tensor | None,
             counter: Tensor | None) -> tuple[Tensor | None, ...]:
    """``quantize_blocks(..., block_2d=True)`` on (R, C), both multiples of the block (the caller
    pads, and stacks leading dims into R). Uniforms in the reference's layout (row tiles, column
    tiles, bs * bs)."""
    bs = 16 if kind == "nvfp4" else 32
    r, c = x2.shape
    rt, ct = r // bs, c // bs
    tiles = x2.float().view(rt, bs, ct, bs)
    amax = tiles.abs().amax((1, 3), keepdim=True)
    t_amax = t_scale = None
    if kind == "nvfp4":
        t_amax = torch.where(torch.isfinite(tiles), tiles.abs(), 0.0).amax()
        t_scale = mx.nvfp4_tensor_scales(t_amax, mx.BLOCK_FORMATS["nvfp4"])[0]
    mult, local_scale = _block_scales(amax, t_amax, pi, kind)
    u = None
    if keys is not None:
        idx = torch.arange(r * c, dtype=torch.int32, device=x2.device).view(rt, ct, bs, bs).permute(0, 2, 1, 3)
        ka, kb = draw_keys(keys, counter)  # type: ignore[arg-type]
        u = uniform_from_index(idx, ka, kb)
    q = _round(tiles * mult, pf, pi, u)
    return (q * local_scale).view(r, c), t_scale, *_kept(mult, local_scale)


_BODIES: dict[str, Callable[..., Any]] = {
    "round": _k_round, "round_": _k_round_, "round_all": _k_round_all, "write_all": _k_write_all,
    "bf16_": _k_bf16_, "scaled": _k_scaled, "axis": _k_axis, "blocks": _k_blocks, "tiles": _k_tiles,
}  # fmt: skip


# --------------------------------------------------------------------------------------------
# (A, n, B) views


def _by_stride(x: Tensor) -> list[int]:
    """x's dims from the largest stride to the smallest, ties in dim order: sorted() with a key, as
    an insertion sort, which dynamo can trace (``call_graph``)."""
    order: list[int] = []
    for i in range(x.dim()):
        j = len(order)
        while j > 0 and x.stride(order[j - 1]) < x.stride(i):
            j -= 1
        order.insert(j, i)
    return order


def view3(x: Tensor, dim: int) -> tuple[Tensor, Callable[[Tensor], Tensor], tuple[int, int, int] | None] | None:
    """x as an (A, n, B) view of its storage with ``dim`` as n, and a function taking such a tensor
    back to x's logical layout; None when no view keeps the other dims in their logical order (the
    caller then copies x to contiguous first). Third: x's row-major strides along (A, n, B), where
    A's and B's dims are each a run of consecutive logical dims (else None)."""
    # Eager: worked out once per shape, stride and dim (a step makes hundreds of these calls). Traced
    # into a graph (call_graph), where sizes may be symbolic: every time.
    compiling = torch.compiler.is_compiling()
    lay = _layout(x, dim) if compiling else _cached_layout(tuple(x.shape), x.stride(), dim)
    if lay is None:
        return None
    return _to3(x, lay), functools.partial(_from3, lay=lay), lay[4]


def _to3(x: Tensor, lay: _Layout) -> Tensor:
    """x as the (A, n, B) view of its layout ``lay``."""
    order, inverse, _, three, _ = lay
    return (x.permute(order) if inverse is not None else x).reshape(three)


def _from3(t: Tensor, lay: _Layout) -> Tensor:
    """An (A, n, B) tensor back in the logical layout of the tensor ``lay`` came from."""
    _, inverse, shape, _, _ = lay
    t = t.reshape(shape)
    return t.permute(inverse) if inverse is not None else t


_Layout = tuple[list[int], list[int] | None, tuple[int, ...], tuple[int, int, int], tuple[int, int, int] | None]


@functools.lru_cache(maxsize=4096)
def _cached_layout(shape: tuple[int, ...], stride: tuple[int, ...], dim: int) -> _Layout | None:
    return _layout(torch.empty_strided(shape, stride, device="meta"), dim)


def _layout(x: Tensor, dim: int) -> _Layout | None:
    """view3's plan: (the permutation to x's storage order, its inverse or None for the identity,
    the permuted shape, (A, n, B), the strides of the docstring), or None."""
    d = dim % x.dim()
    order = list(range(x.dim())) if x.is_contiguous() else _by_stride(x)
    base = x.permute(order)
    rest = [i for i in order if i != d]
    if not base.is_contiguous() or rest != sorted(rest):
        return None
    bd = order.index(d)
    a_dims, b_dims = order[:bd], order[bd + 1:]
    inverse = [order.index(i) for i in range(x.dim())]
    logical = [math.prod(x.shape[i + 1:]) for i in range(x.dim())]
    runs = all(g == list(range(g[0], g[0] + len(g))) for g in (a_dims, b_dims) if g)
    strides = (logical[a_dims[-1]] if a_dims else 0, logical[d], logical[b_dims[-1]] if b_dims else 0) if runs else None
    shape = tuple(base.shape)
    three = (math.prod(shape[:bd]), shape[bd], math.prod(shape[bd + 1:]))
    return order, (None if order == sorted(order) else inverse), shape, three, strides


# --------------------------------------------------------------------------------------------
# the entry points: fused where enabled, else the reference. Outputs equal bit for bit.


def round_to_element(
    x: Tensor, fmt: ElementFormat, *, stochastic: bool = False,
    generator: torch.Generator | RoundingStream | None = None, saturate: bool = True,
) -> Tensor:
    """``formats.round_to_element``, fused (FP32 out). Stochastic rounding with no generator draws
    from a stream keyed by the global RNG (FP8's rounding outside a run, as ``fp8`` does)."""
    if not saturate and not (fmt.has_inf or fmt.has_nan):
        raise ValueError(f"{fmt.name} has no Inf or NaN to overflow to: use saturate=True")
    if enabled(x) and _fits(fmt) and x.numel():
        with contextlib.suppress(_Unfused):
            keys, counter = _stream(x, stochastic, generator)
            return _call("round", _opts(saturate, stochastic), x.reshape(-1), *_elem(fmt, x.device), saturate, keys,
                         counter).view(x.shape)
    if stochastic and generator is None:
        generator = global_stream(x.device)
    return nf.round_to_element(x, fmt, stochastic=stochastic, generator=generator, saturate=saturate)


def quantize_scaled(x: Tensor, fmt: ElementFormat, *, stochastic: bool = False,
                    generator: torch.Generator | RoundingStream | None = None) -> Tensor:
    """``fp8.quantize_scaled`` (per-tensor power-of-two scale), fused; x's dtype out."""
    if enabled(x) and x.numel():
        with contextlib.suppress(_Unfused):
            keys, counter = _stream(x, stochastic, generator)
            return _call("scaled", _opts(stochastic), x.reshape(-1), *_elem(fmt, x.device), keys, counter).view(x.shape)
    if stochastic and generator is None:
        generator = global_stream(x.device)
    xf = nf.work_dtype(x)
    s = nf.pow2_scale(xf.abs().amax().float(), fmt) if x.numel() else torch.ones((), device=x.device)
    return nf.round_scaled(x, fmt, s, stochastic=stochastic, generator=generator)


def axiswise_round(x: Tensor, fmt: ElementFormat, dim: int, *, stochastic: bool = False,
                   generator: torch.Generator | RoundingStream | None = None) -> Tensor:
    """``qgemm.axiswise_round``, fused (FP32 out, x's layout)."""
    return _axiswise(x, fmt, dim, stochastic, generator)


def _axiswise(x: Tensor, fmt: ElementFormat, dim: int, stochastic: bool, generator: Any) -> Tensor:
    if not stochastic or type(generator) is RoundingStream:
        fast = _fast_for(_fast_key("axis", fmt, dim, stochastic, x))
        if fast is not None:
            return fast(x, _stream(x, stochastic, generator))[0]  # type: ignore[return-value]
    if enabled(x) and x.numel():
        v = view3(x, dim)
        in_place = v is not None and v[2] is not None
        if not in_place:
            v = view3(x.contiguous(), dim)
        x3, back, strides = v  # type: ignore[misc]
        narrow = _narrow_inner(x3)
        if torch.compiler.is_compiling():  # call_graph checked the stream
            return _axis_call(x, x3, back, strides, fmt, stochastic, generator, narrow)  # type: ignore[arg-type]
        try:
            out = _axis_call(x, x3, back, strides, fmt, stochastic, generator, narrow)  # type: ignore[arg-type]
        except _Unfused:
            pass
        else:
            if in_place and not narrow and (not stochastic or type(generator) is RoundingStream):
                args = (*_elem(fmt, x.device), *strides, *_stream_args(generator, stochastic))
                _keep_fast(_fast_key("axis", fmt, dim, stochastic, x), "axis", _opts(stochastic, False), x3, args,
                           (0, 6, 7), out, 1, fmt)  # fmt: skip
            return out
    if stochastic and generator is None:
        generator = global_stream(x.device)
    return nf.axiswise_round(x, fmt, dim, stochastic=stochastic, generator=generator)


def _axis_call(x: Tensor, x3: Tensor, back: Callable[[Tensor], Tensor], strides: tuple[int, int, int],
               fmt: ElementFormat, stochastic: bool, generator: Any, narrow: bool) -> Tensor:
    keys, counter = _stream(x, stochastic, generator)
    if not narrow:
        return back(_call("axis", _opts(stochastic, False), x3, *_elem(fmt, x.device), *strides, keys, counter)[0])
    # A narrow B: a copy with n innermost, whose kernel draws each element by its index in x (the
    # strides), as the reference does. With draws, 2.5x to 6x faster than the (A, n, B) kernel on a
    # 3x3 or 2x2 map (a CPU, one thread).
    y = x3.transpose(1, 2).contiguous()
    out = _call("axis", _opts(stochastic, True), y, *_elem(fmt, x.device), *strides, keys, counter, True)[0]
    return _like(x, back(out.transpose(1, 2)))


def quantize_blocks(
    x: Tensor, fmt: mx.BlockFormat, dim: int = -1, *, stochastic: bool = False,
    generator: torch.Generator | RoundingStream | None = None, block_2d: bool = False,
    rotation: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """``mx.quantize_blocks(...)``'s (local, tensor_scale), fused. Lengths are padded with zeros.
    ``rotation`` (``mx.hadamard_rotation``): x is rotated along ``dim`` first, in FP32, as
    ``mx.rotate(x.float(), dim, rotation)``; its length there must be a multiple of the rotation's."""
    if not block_2d and (stochastic is False or type(generator) is RoundingStream):
        fast = _fast_for(_fast_key("blocks", fmt, dim, stochastic, x, rotation))
        if fast is not None:
            return fast(x, (*_stream(x, stochastic, generator), rotation))  # type: ignore[return-value]
    if rotation is not None and (block_2d or x.shape[dim] % rotation.shape[1]):
        raise ValueError(f"quantize_blocks: a rotation runs along dim in blocks of {rotation.shape[1]}, not on "
                         f"2D tiles nor on a length of {x.shape[dim]}")
    if enabled(x) and x.numel() and (not block_2d or x.dim() >= 2):
        if torch.compiler.is_compiling():  # call_graph checked that the kernels know the format
            return _blocks(x, fmt, dim, stochastic, generator, block_2d, rotation)
        try:
            return _blocks(x, fmt, dim, stochastic, generator, block_2d, rotation)
        except _Unfused:
            pass
    if stochastic and generator is None:
        generator = global_stream(x.device)
    if rotation is not None:
        x = mx.rotate(x.float(), dim, rotation)
    q = mx.quantize_blocks(x, fmt, dim, stochastic=stochastic, generator=generator, block_2d=block_2d)
    return q.local, q.tensor_scale


# Inductor's C++ kernels vectorise along the (A, n, B) view's innermost dim, B. With fewer elements
# there than one AVX-512 vector (a 2x2 or 3x3 feature map of an NCHW activation, a 3x3 filter's taps)
# they ran 8 to 11 times slower per element than on a copy with the blocked dim innermost (B = 1): a
# (32, 256, 2, 2) MXFP8 quantize took 1.2 ms against 0.15 ms with the copy. Measured on CPU only.
_CPU_MIN_INNER = 16


def _narrow_inner(x3: Tensor) -> bool:
    return _narrow(x3.shape[2], x3.device.type == "cpu")


def _narrow(inner: int, cpu: bool) -> bool:
    return cpu and 1 < inner < _CPU_MIN_INNER


def _like(x: Tensor, q: Tensor) -> Tensor:
    """``q`` (FP32) in x's memory layout, as the other paths return it: a convolution fed a
    channels-last result where its weights are not converts layouts on every call."""
    return torch.empty_like(x, dtype=torch.float32).copy_(q)


def _blocks(x: Tensor, fmt: mx.BlockFormat, dim: int, stochastic: bool, generator: Any,
            block_2d: bool, rot: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
    bs = fmt.block_size
    kind = "nvfp4" if fmt.two_level else f"mx{bs}"
    if fmt.block_size != (16 if fmt.two_level else 32) or not _fits(fmt.element):
        raise _Unfused  # a block format the kernels do not know
    pf, pi = _elem(fmt.element, x.device)
    if block_2d:
        *lead, r, c = x.shape
        er, ec = -r % bs, -c % bs
        xp = torch.nn.functional.pad(x, (0, ec, 0, er)) if er or ec else x
        keys, counter = _stream(x, stochastic, generator)
        local, t_scale = _call("tiles", _opts(kind, stochastic), xp.reshape(-1, c + ec), pf, pi, kind, keys,
                               counter)[:2]
        local = local.view(*lead, r + er, c + ec)
        return (local[..., :r, :c] if er or ec else local), t_scale
    cpu = x.device.type == "cpu"
    if torch.compiler.is_compiling():  # sizes may be symbolic: planned every time
        plan = _plan_blocks(x, dim, kind, stochastic, cpu)
    else:
        plan = _cached_plan(x.shape, x.stride(), dim, kind, stochastic, cpu)
    if plan.narrow:
        # Blocks along the last dim instead: the draws keep their order (element (a, i, b) of the
        # (A, n, B) view is draw (a * B + b) * n + i either way), and so does every result.
        y = x.movedim(dim, -1).contiguous()
        fast = _fast_for(_fast_key("blocks", fmt, -1, stochastic, y, rot))
        if fast is not None and (not stochastic or type(generator) is RoundingStream):
            local, t_scale = fast(y, (*_stream(y, stochastic, generator), rot))
        else:
            local, t_scale = _blocks(y, fmt, -1, stochastic, generator, False, rot)
        return _like(x, local.movedim(-1, dim)), t_scale
    x3 = _to3(x.contiguous() if plan.copy else x, plan.layout)
    if plan.pad:
        x3 = torch.nn.functional.pad(x3, (0, 0, 0, plan.pad))
    keys, counter = _stream(x, stochastic, generator)
    # The zeros padded on before the rotation stay zeros (up to sign) and are cut off after it.
    options = plan.options if rot is None else plan.options + "r"
    args = (pf, pi, kind, plan.short, keys, counter, rot)
    local, t_scale = _call("blocks", options, x3, *args)[:2]
    local = _from3(local[:, :-plan.pad] if plan.pad else local, plan.layout)
    if not (plan.copy or plan.pad or torch.compiler.is_compiling()) and (not stochastic or type(generator) is
                                                                         RoundingStream):  # fmt: skip
        _keep_fast(_fast_key("blocks", fmt, dim, stochastic, x, rot), "blocks", options, x3, args, (0, 5, 6, 7), local,
                   2, fmt)
    return local, t_scale


class _BlockPlan(NamedTuple):
    """How ``_blocks`` runs on one operand layout."""

    layout: _Layout  # of x, or of its contiguous copy
    copy: bool  # x has no (A, n, B) view: a contiguous copy first
    narrow: bool  # blocks along the last dim of a copy instead (_CPU_MIN_INNER)
    short: bool  # n under one block: one block, unpadded
    pad: int  # zeros appended to n, up to a multiple of the block
    options: str  # the kernel's static options


@functools.lru_cache(maxsize=4096)
def _cached_plan(shape: torch.Size, stride: tuple[int, ...], dim: int, kind: str, stochastic: bool,
                 cpu: bool) -> _BlockPlan:
    """_plan_blocks, worked out once per operand layout: a step makes hundreds of calls on a few dozen
    layouts, and planning each call took about as long as the call into the kernel."""
    return _plan_blocks(torch.empty_strided(shape, stride, device="meta"), dim, kind, stochastic, cpu)


def _plan_blocks(x: Tensor, dim: int, kind: str, stochastic: bool, cpu: bool) -> _BlockPlan:
    layout = _layout(x, dim)
    copy = layout is None
    if layout is None:
        layout = _layout(x.contiguous(), dim)
        assert layout is not None  # a contiguous tensor always has its (A, n, B) view
    _, n, b = layout[3]
    bs = 16 if kind == "nvfp4" else 32
    # Under one block (3 input channels, a narrow layer's 8): no padding, the kernel takes the dim as
    # one block; else padded, once, so that the kernels never mask.
    short = n < bs
    pad = 0 if short else -n % bs
    return _BlockPlan(layout, copy, _narrow(b, cpu), short, pad, _opts(kind, stochastic, short))


def round_params_(params: list[Tensor], fmt: ElementFormat, *, stochastic: bool = False,
                  generator: RoundingStream | None = None) -> None:
    """Round every tensor in place onto ``fmt``, one draw per tensor in order (FP8's FP16 masters).
    The reference: ``p.copy_(quantize(p, fmt))`` or ``stochastic_round`` for each p.

    Fused, one kernel rounds the small ones, concatenated (in groups of up to 2**24 elements): one
    call per parameter cost ~60 us each, 10 ms of a ResNet-50/8 step (161 parameters, 0.4M elements).
    A tensor of ``_ALONE`` elements or more rounds in place in a call of its own, which costs less
    than copying it in and out (an MLP's 1024x1024 weights). Stochastic rounding outside a run (no
    stream given), or from a torch.Generator, keeps one call per tensor: each draws its own key from
    the global RNG, as the reference does, or runs the reference."""
    same = bool(params) and all(p.is_contiguous() and p.dtype == params[0].dtype and p.device == params[0].device
                                for p in params)  # fmt: skip
    if same and enabled(params[0]) and _fits(fmt) and (not stochastic or isinstance(generator, RoundingStream)):
        keys, first = _stream(params[0], stochastic, generator, len(params))
        small = [p.numel() < _ALONE for p in params]
        for lo, hi in _groups([p.numel() for p in params], _GROUP, small):
            if small[lo]:
                _round_group(params[lo:hi], fmt, keys, _nth(first, lo))
                continue
            for i in range(lo, hi):
                _run("round_", _opts(stochastic), params[i].view(-1), *_elem(fmt, params[i].device), keys,
                     _nth(first, i))
        return
    for p in params:
        if enabled(p) and _fits(fmt) and p.is_contiguous() and p.numel():
            with contextlib.suppress(_Unfused):
                keys, counter = _stream(p, stochastic, generator)
                _call("round_", _opts(stochastic), p.view(-1), *_elem(fmt, p.device), keys, counter)
                continue
        gen = generator if generator is not None or not stochastic else global_stream(p.device)
        p.copy_(nf.round_to_element(p, fmt, stochastic=stochastic, generator=gen))


_GROUP = 2**24  # elements rounded by one call of round_params_'s kernel, at most (but one larger tensor)
_ALONE = 2**15  # elements from which a tensor has a call of its own


def _nth(first: Tensor | None, i: int) -> Tensor | None:
    """Counter ``i`` of a call's draws (None: no draws)."""
    return None if first is None else first + i


def _run(name: str, options: str, x: Tensor, *args: Any) -> Any:
    """``_call``; past dynamo's recompile limit, the same kernel body eagerly (same values, same draws)."""
    try:
        return _call(name, options, x, *args)
    except _Unfused:
        return _BODIES[name](x.detach(), *args)


def _groups(sizes: list[int], limit: int, kinds: list[Any] | None = None) -> Iterator[tuple[int, int]]:
    """Consecutive [lo, hi) ranges of ``sizes`` summing to at most ``limit`` (one larger size alone),
    and of one kind each (``kinds``: one per size)."""
    lo, total = 0, 0
    for i, n in enumerate(sizes):
        if i > lo and (total + n > limit or (kinds is not None and kinds[i] != kinds[lo])):
            yield lo, i
            lo, total = i, 0
        total += n
    if lo < len(sizes):
        yield lo, len(sizes)


@functools.lru_cache(maxsize=64)
def _group_index(sizes: tuple[int, ...], device: torch.device) -> tuple[Tensor, Tensor]:
    """A group's element counts and start offsets on ``device``, made once: a copy from the host
    every step would wait for the GPU."""
    counts = torch.tensor(sizes, dtype=torch.int64, device=device)
    return counts, (torch.cumsum(counts, 0) - counts).to(torch.int32)


def _concat(tensors: list[Tensor], draws: bool) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """The tensors' concatenation, and for stochastic rounding which tensor each element belongs to
    and where each tensor starts (``_k_round_all``)."""
    flat = torch.cat([t.view(-1) for t in tensors])
    if not draws or not flat.numel():
        return flat, None, None
    counts, starts = _group_index(tuple(t.numel() for t in tensors), flat.device)
    # output_size: no read-back of the counts' sum (a host sync on a GPU)
    which = torch.repeat_interleave(torch.arange(len(tensors), dtype=torch.int32, device=flat.device), counts,
                                    output_size=flat.numel())
    torch._dynamo.maybe_mark_dynamic(which, 0)  # one kernel for every group and model, as _call's x
    torch._dynamo.maybe_mark_dynamic(starts, 0)
    return flat, which, starts


def _scatter(dst: list[Tensor], flat: Tensor) -> None:
    """Copy the concatenation ``flat`` back into the tensors it came from (or their like)."""
    torch._foreach_copy_(dst, [t.view(p.shape) for t, p in zip(flat.split([p.numel() for p in dst]), dst, strict=True)])


def _round_group(params: list[Tensor], fmt: ElementFormat, keys: Tensor | None, first: Tensor | None) -> None:
    flat, which, starts = _concat(params, keys is not None)
    if not flat.numel():
        return
    _scatter(params, _run("round_all", _opts(keys is not None), flat, which, starts, *_elem(fmt, flat.device), keys,
                          first))


def _write_group(dst: list[Tensor], src: list[Tensor], keys: Tensor, first: Tensor) -> None:
    flat, which, starts = _concat(src, True)
    if not flat.numel():
        return
    bf16 = dst[0].dtype == torch.bfloat16
    _scatter(dst, _run("write_all", _opts(bf16), flat, which, starts, *_elem(nf.FP16, flat.device), keys, first, bf16))


def _write_one(p: Tensor, m: Tensor, keys: Tensor, counter: Tensor) -> None:
    """One master into its bf16 / FP16 parameter, stochastically, in a call of its own."""
    if p.dtype == torch.bfloat16:
        _run("bf16_", "", p.view(-1), m.view(-1), keys, counter)
    else:
        p.view(-1).copy_(_run("round", _opts(True, True), m.view(-1), *_elem(nf.FP16, m.device), True, keys, counter))


def write_back_(dst: list[Tensor], src: list[Tensor], generator: RoundingStream | None) -> None:
    """Stochastically round FP32 masters ``src`` into FP16/bf16 parameters ``dst``, one draw per
    tensor in order (``MasterWeights.after_step``'s reference loop). Fused, one kernel call rounds a
    run of small parameters of one dtype, and a large one has a call of its own, as in
    ``round_params_``; outside a run (no stream) or with a torch.Generator, one call per tensor."""
    same = bool(src) and all(p.is_contiguous() and m.is_contiguous() and m.dtype == torch.float32
                             and p.dtype in (torch.bfloat16, torch.float16) and m.device == p.device == src[0].device
                             for p, m in zip(dst, src, strict=True))  # fmt: skip
    if same and enabled(src[0]) and isinstance(generator, RoundingStream):
        keys, first = _stream(src[0], True, generator, len(src))
        kinds = [(p.dtype, m.numel() < _ALONE) for p, m in zip(dst, src, strict=True)]
        for lo, hi in _groups([m.numel() for m in src], _GROUP, kinds):
            if kinds[lo][1]:
                _write_group(dst[lo:hi], src[lo:hi], keys, first + lo)  # type: ignore[arg-type, operator]
                continue
            for i in range(lo, hi):
                _write_one(dst[i], src[i], keys, first + i)  # type: ignore[arg-type, operator]
        return
    for p, m in zip(dst, src, strict=True):
        if enabled(m) and p.is_contiguous() and m.is_contiguous() and m.numel():
            with contextlib.suppress(_Unfused):
                keys, counter = _stream(m, True, generator)
                _write_one(p, m, keys, counter)  # type: ignore[arg-type]
                continue
        gen = generator if generator is not None else global_stream(m.device)
        bf16 = p.dtype == torch.bfloat16
        p.copy_(nf.stochastic_round_to_bf16(m, gen) if bf16 else nf.round_to_element(m, nf.FP16, stochastic=True,
                                                                                      generator=gen))
