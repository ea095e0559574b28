"""Calling compiled code for a few microseconds of host time: the fused quantizers' kernels
(``_call``, on the bodies of ``fused_kernels``) and a Linear layer's GEMMs in one direction as one
graph (``call_graph``, for ``qgemm`` on CUDA).

A call into ``torch.compile``'d code costs tens of microseconds of host time (dynamo's frame
evaluation and guards, AOTAutograd's runtime wrappers) around kernels of a few. From its second time
on, a call with the same shape, strides, dtype and static options calls the compiled function
directly (``_Direct``), and a block, row-wise or tile call skips its entry point's planning as well
(``_Fast``, which ``fused`` keeps). torch.compile has no such entry of its own, and CUDA graphs,
which would replay the kernels, do not exist on a CPU: hence this module.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import inspect
import logging
import re
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import Tensor

from mptrain.numerics import fused_kernels
from mptrain.numerics.fused_kernels import _BODIES, _params

log = logging.getLogger(__name__)

_kernels: dict[str, tuple[Callable[..., Any], _Inductor]] = {}
_given_up: set[str] = set()  # kernels that run the reference after a compile failure


# Eager's rounding in inductor's Triton code, which otherwise divides with div.full (approximate:
# NVFP4's scales came out an ulp off the reference on an H200), may flush FP32 subnormals to zero
# (MX's smallest scales are subnormal), and lets the compiler contract a multiply and an add into
# one FMA, rounded once where eager rounds twice (emulate_precision_casts turns Triton's
# enable_fp_fusion off). NVFP4's y = mm * tensor scales + bias is such a pair; it differed from
# eager in 403 of 1,480 outputs on an H100 with only the first two options (2026-11-27, not yet
# rerun with the third). The three are torch 2.15's numerics="strict_pointwise", named one by one
# for torch 2.11, which lacks that switch.
_EAGER_NUMERICS = {"eager_numerics.division_rounding": True, "eager_numerics.disable_ftz": True,
                   "emulate_precision_casts": True}


# The block and tile kernels tell the compiler that a length is a multiple of the block
# (torch._check). Torch 2.11's AOTAutograd cache refuses any graph that calls it ("Unsupported
# call_function target _check"), so each new trace of such a kernel (every process start, a fresh
# table) ran AOTAutograd again: 2.6-3.8 s for an MXFP8 block kernel, against 1.0-1.4 s from the
# cache (an AVX2 CPU). torch._check's effect is fixed by its argument, which is in the graph and so
# in the cache key; inductor's option names it cacheable (torch 2.15 caches these graphs without it).
# The other entries name no function: they put vector_bitcasts' and vector_iota's code (below) into
# every kernel's cache key, so that no process loads a kernel cached before them.
_CACHEABLE = {"unsafe_marked_cacheable_functions": {"torch._check": torch.__version__,
                                                     "mptrain.vector_bitcasts": "1", "mptrain.vector_iota": "1"}}


@functools.cache  # once a process
def vector_bitcasts() -> None:
    """Inductor's C++ backend writes a vectorised bitcast (``Tensor.view(dtype)``, which the kernel
    bodies use on every element: exponents, signs, amaxes from the bits) as a per-lane scalar loop:
    the vector stored to a buffer, each lane cast, the result loaded back: torch 2.11 and 2.14 do
    (``CppVecOverrides`` has no ``to_dtype_bitcast`` of its own). What that costs is up to the C++ compiler,
    which inductor runs with ``-march=native``: on the AMD EPYC of docs/benchmarks the quantizers
    met issue 24's targets, and on a Xeon with AMX, compiled for it, they took several times as long
    and missed every one (docs/benchmarks/README.md, "An Intel Xeon with AMX").

    This writes the bitcast between FP32 and int32 as ATen's ``at::vec::cast``, which reinterprets a
    vector's bits in registers: the same bits as ``c10::bit_cast`` lane by lane. Other bitcasts, and a
    torch whose inductor vectorises bitcasts itself, are left as they are. Called before anything
    compiles (``_Inductor``)."""
    try:
        from torch._inductor.codegen.cpp import CppVecOverrides
        from torch._inductor.virtualized import V
    except ImportError:
        return
    per_lane = CppVecOverrides.to_dtype_bitcast
    if not getattr(per_lane, "__qualname__", "").startswith("CppVecOverrides._scalarize"):
        return  # not the per-lane fallback: another inductor's own
    names = {torch.float32: "float", torch.int32: "int32_t"}

    def to_dtype_bitcast(x: Any, dtype: torch.dtype, src_dtype: torch.dtype) -> Any:
        if dtype not in names or src_dtype not in names:
            return per_lane(x, dtype, src_dtype)
        n = V.kernel._get_num_vectors(src_dtype)
        if n == 1:
            return f"at::vec::cast<{names[dtype]}>({x})"
        # VectorizedN (a kernel whose lowest-precision dtype takes several FP32 vectors a step)
        return (f"[&]() {{ at::vec::VectorizedN<{names[dtype]}, {n}> r; for (int i = 0; i < {n}; i++) "
                f"r[i] = at::vec::cast<{names[dtype]}>({x}[i]); return r; }}()")

    CppVecOverrides.to_dtype_bitcast = staticmethod(to_dtype_bitcast)


@functools.cache  # once a process
def vector_iota() -> None:
    """Inductor's C++ backend writes an index vector (``torch.arange`` in a kernel body: the element
    index that stochastic rounding's counter-based stream hashes) as ATen's ``Vectorized::arange(base,
    step)``, which builds the vector from 16 scalars a loop step. On the Xeon with AMX the 1M-element
    index alone took 0.54 ms to write, against 0.47 ms to read and write a 1M-element copy. This writes it
    as a broadcast of the base plus ``arange(0, step)``, a constant the C++ compiler folds: the same
    lanes in two instructions. Index vectors that span several vectors (``VectorizedN``) are left as
    they are. Called before anything compiles (``_Inductor``)."""
    try:
        from torch._inductor.codegen.cpp import CppVecKernel
    except ImportError:
        return
    scalar_lanes = CppVecKernel.arange

    def arange(self: Any, index: Any, stride: Any) -> Any:
        if index.dtype is None or self._get_num_vectors(index.dtype) != 1:
            return scalar_lanes(self, index, stride)
        vec = self._get_vec_type(index.dtype)
        out = self.cse.generate(self.compute, f"({vec}({index}) + {vec}::arange(0, {stride}))")
        out.dtype = index.dtype
        out.is_vec = True
        return out

    CppVecKernel.arange = arange


@functools.cache  # once a process
def remember_isa_checks() -> None:
    """Before its first CPU kernel in a process, inductor picks the vector ISA by building a test
    library for each ISA the CPU claims and loading it in a child ``python -c "import torch; ..."``.
    Before torch 2.14 it spawns those children in every process, the libraries long built: six on
    an AVX-512 CPU, about half of an emulated run's warm start on torch 2.11 (docs/benchmarks/README.md,
    "An emulated run's start on torch 2.11"). Torch 2.14 leaves a marker beside a library that
    loaded and skips the child from then on; this does the same where torch does not. A marker
    is written only after inductor's own check passed, and is named by all that check depends on:
    the compiler, the ISA's flags, torch's version (inductor's own fingerprint) and the test code.
    Called before anything compiles (``_Inductor``, the engine's ``trainer.compile``)."""
    try:
        from torch._inductor import cpu_vec_isa
        from torch._inductor.runtime.cache_dir_utils import cache_dir

        check = cpu_vec_isa.VecISA.check_build
        fingerprint = cpu_vec_isa._get_isa_dry_compile_fingerprint
        if "load_ok" in inspect.getsource(check):  # torch >= 2.14: its own marker
            return
    except (ImportError, AttributeError, OSError, TypeError):  # another inductor: left as it is
        return

    def check_build(self: Any, code: str) -> bool:
        # _arch_flags at call time: the bf16, VNNI and AMX checks add their flags around the call
        key = hashlib.sha256(f"{fingerprint(self._arch_flags)}\n{code}".encode()).hexdigest()[:32]
        marker = Path(cache_dir()) / "mptrain_isa_checks" / f"{key}.ok"
        if marker.is_file():
            return True
        ok = check(self, code)
        if ok:
            with contextlib.suppress(OSError):  # no marker: the next process checks again, as before
                marker.parent.mkdir(parents=True, exist_ok=True)
                marker.touch()
        return ok

    cpu_vec_isa.VecISA.check_build = check_build


def cpu_vector_bits() -> int:
    """The vector width (bits; 0: scalar code) of the ISA inductor picks for CPU code in this process:
    the one ``ATEN_CPU_CAPABILITY`` names, else the widest the CPU has."""
    from torch._inductor import config, cpu_vec_isa

    if config.cpp.simdlen is not None:
        return int(config.cpp.simdlen)
    return cpu_vec_isa.pick_vec_isa().bit_width()


def pin_cpu_vector_isa(patches: dict[str, Any] | None = None) -> None:
    """Put the vector ISA inductor picks into its cache keys: ``cpp.simdlen`` in ``patches`` (a
    backend's options), or in inductor's config (``trainer.compile``) where None.

    Why: the ISA is not in inductor's FX graph cache key, though the code depends on it (a loop over
    16 lanes on AVX-512, 8 on AVX2). A graph compiled under one ISA and loaded under another, in a
    shared cache dir, is built with the other's compiler flags. Compiled on this AVX-512 CPU, then
    loaded with ``ATEN_CPU_CAPABILITY=avx2`` (as the README suggests, to try an AVX2-only CPU's
    path), lanes 8-15 of every 16 came out wrong on torch 2.11 and 2.14.1: the fused quantizers' probe
    caught it and ran the 5-9x slower reference; a ``trainer.compile`` model would have trained on
    wrong values. ``cpp.simdlen`` is in the key. Set to the width inductor would pick anyway, it
    picks the same ISA: the first of the CPU's ISAs of that width, as without it. (Entries cached
    before this have no width in their key: the kernels compile once more, then load as before.)"""
    from torch._inductor import config

    bits = cpu_vector_bits()
    if patches is None:
        config.cpp.simdlen = bits
    else:
        patches.setdefault("cpp.simdlen", bits)


def model_compile_args(mode: str, emulated: bool) -> dict[str, Any]:
    """``nn.Module.compile``'s arguments for ``trainer.compile`` with ``trainer.compile_mode``. An
    emulated model (its quantizers traced into its graph) gets the quantizers' own options too: eager's
    rounding in Triton code (``_EAGER_NUMERICS``) and their cache keys (``_CACHEABLE``), with the
    mode's options spelled out, as torch.compile takes a mode or options but not both; and its CPU
    kernels get the vector patches above."""
    if not emulated:
        return {"mode": None if mode == "default" else mode}
    vector_bitcasts()
    vector_iota()
    return {"options": {**torch._inductor.list_mode_options(mode), **_EAGER_NUMERICS, **_CACHEABLE}}


class _Unfused(Exception):
    """This call cannot run compiled (a torch.Generator, a kernel past dynamo's recompile limit)."""


class _Inductor(torch._TorchCompileInductorWrapper):  # type: ignore[misc, name-defined]
    """Inductor with ``options``, as ``torch.compile(options=...)`` runs it, keeping every graph it
    compiles with its compiled function, and which of them ran last (``_Direct``)."""

    def __init__(self, options: dict[str, Any]) -> None:
        remember_isa_checks()
        vector_bitcasts()
        vector_iota()
        super().__init__(None, {**_CACHEABLE, **options}, None)
        self.graphs: list[tuple[torch.fx.GraphModule, Callable[..., Any]]] = []
        self.ran: int | None = None

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Any, **kwargs: Any) -> Any:
        if any(isinstance(t, Tensor) and t.device.type == "cpu" for t in example_inputs):
            pin_cpu_vector_isa(self.config)  # CPU code only: picking the ISA builds test libraries
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
_PURE = frozenset({"round", "scaled", "axis", "blocks", "tiles", "round_all", "round_all_fwd", "write_all"})


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
    format's constants, the rounding stream's, a group's index: all made by mptrain), and the
    values of the non-tensor arguments. Built from the graph that dynamo ran for that key
    (``_Inductor.ran``), and only where the graph's inputs can be read off the arguments (tensors
    and ints by name, sizes and strides by symbol, a GEMM recipe's rounding stream by its
    ``stream_tensors``: a call replays from the stream's state before dynamo's call and must
    advance it as that call did). It calls inductor's generated code itself where
    AOTAutograd's wrappers around it have nothing to do (``_generated_call``), else the compiled
    function; either is checked once, bit for bit, against the result dynamo's call returned.
    Anything else keeps dynamo's path."""

    def __init__(self, fn: Callable[..., Any], picks: list[tuple[int, int, Any]], slots: list[bool] | None,
                 key: str, consts: list[Tensor]) -> None:
        self.fn, self.picks, self.slots, self.key, self.consts = fn, picks, slots, key, consts
        self.boxed = False  # the calling convention: fn(list) (AOTAutograd's boxed one), or fn(*inputs)
        self.generated = False  # fn is inductor's generated code (_generated_call)

    def raw(self, x: Tensor, args: tuple[Any, ...]) -> Any:
        """The graph's outputs, as the compiled code returns them."""
        full = (x, *args)
        inputs = [full[i] if what == 0 else full[i].size(d) if what == 1 else full[i].stride(d) if what == 2
                  else self.consts[i] if what == 3 else full[i].stream_tensors(x.device)[d]
                  for i, what, d in self.picks]  # fmt: skip
        return self.fn(inputs) if self.boxed else self.fn(*inputs)

    def __call__(self, x: Tensor, args: tuple[Any, ...]) -> Any:
        outs = self.raw(x, args)
        if self.slots is None:
            return outs[0]
        it = iter(outs)
        return tuple([next(it) if tensor else None for tensor in self.slots])

    @classmethod
    def of(cls, gm: torch.fx.GraphModule, fn: Callable[..., Any], body: Callable[..., Any], key: str, x: Tensor,
           args: tuple[Any, ...], out: Any, before: list[Tensor] | None = None) -> _Direct | None:
        """The direct call of graph ``gm`` (compiled: ``fn``), which dynamo just ran for ``body(x, *args)``
        and which returned ``out``; None where how to call it is not certain. ``before``: the rounding
        streams' tensors (``_stream_state``) as they were before that call."""
        state = _stream_state(x, args)
        after = [t.clone() for t in state]
        try:
            return cls._of(gm, fn, body, key, x, args, out, state, before, after)
        finally:  # each check replays the call: the streams end where dynamo's call left them
            for t, a in zip(state, after, strict=True):
                t.copy_(a)

    @classmethod
    def _of(cls, gm: torch.fx.GraphModule, fn: Callable[..., Any], body: Callable[..., Any], key: str, x: Tensor,
            args: tuple[Any, ...], out: Any, state: list[Tensor], before: list[Tensor] | None,
            after: list[Tensor]) -> _Direct | None:
        names = body.__code__.co_varnames[:body.__code__.co_argcount]
        full = (x, *args)
        holders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        tensors: dict[str, int] = {}
        ints: dict[str, int] = {}  # int arguments dynamo made dynamic (after a second value: a recompile)
        consts: dict[str, Tensor] = {}  # a format's constants, read by a traced graph (call_graph)
        streams: dict[str, tuple[int, str]] = {}  # a rounding stream's tensors, read off an argument (a recipe)
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
                elif (found := _stream_input(n.name, ev, names, full)) is not None and before is not None:
                    streams[n.name] = found
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
            if n.name in streams:
                picks.append((streams[n.name][0], 4, streams[n.name][1]))
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

        def replay(call: Callable[[], Any]) -> Any:
            """``call()`` from the streams' state before dynamo's call; it must leave them as that call did
            (the counter advanced in place: a direct call that forgot to would draw the same numbers again)."""
            for t, b in zip(state, before or [], strict=True):
                t.copy_(b)
            got = call()
            if not all(torch.equal(t, a) for t, a in zip(state, after, strict=True)):
                raise _Unfused("the direct call left the rounding streams elsewhere")
            return got

        direct = cls(fn, picks, slots, key, list(consts.values()))
        for direct.boxed in (False, True):
            try:
                got = replay(lambda: direct(x, args))
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
                outs = replay(lambda: fast.raw(x, args))
                again = replay(lambda: fast(x, args))
            except Exception:  # inputs the generated code does not take as the graph's, or a mutation it
                return direct  # leaves to AOTAutograd's wrappers: keep the function
            inputs = {t.untyped_storage().data_ptr() for t in (x, *args, *fast.consts, *state) if isinstance(t, Tensor)}
            if (isinstance(outs, (list, tuple)) and len(outs) == count and same(again)
                    and not any(o.untyped_storage().data_ptr() in inputs for o in outs)):  # fmt: skip
                return fast
        return direct


def _through_dynamo(kernel: Callable[..., Any], backend: _Inductor, directs: dict[Any, _Direct | None], key: Any,
                    body: Callable[..., Any], label: str, x: Tensor, args: tuple[Any, ...]) -> Any:
    """``kernel(x, *args)``, compiled ``body``, through torch.compile's entry; the first time ``key``
    (None: no direct call wanted) is seen, the direct call of the graph that ran is kept in ``directs``
    (None where it has none)."""
    backend.ran = None
    first = key is not None and key not in directs
    before = [t.clone() for t in _stream_state(x, args)] if first else None
    # Grad mode is part of dynamo's guards, and a quantizer is called with it on (a forward) and off
    # (the optimizer's master weights): without this, one more compile of the same kernel.
    with torch.no_grad():
        out = kernel(x, *args)
    if first and backend.ran is not None:
        gm, fn = backend.graphs[backend.ran]
        directs[key] = _Direct.of(gm, fn, body, label, x, args, out, before)
    return out


def _stream_state(x: Tensor, args: tuple[Any, ...]) -> list[Tensor]:
    """The rounding streams' tensors a call's arguments hold (a GEMM recipe's ``stream_tensors``): the
    keys, and the counter a stochastic-rounding graph advances in place."""
    return [t for a in args if hasattr(a, "stream_tensors") for t in a.stream_tensors(x.device).values()]


def _stream_input(placeholder: str, example: Tensor, names: tuple[str, ...], full: tuple[Any, ...]
                  ) -> tuple[int, str] | None:
    """(argument index, name) of the rounding-stream tensor a graph input of this name holds: dynamo
    names an attribute it reads by its path, ``l_<argument>_..._<name>``, the name one of the
    argument's ``stream_tensors``; None for any other input, or where the tensors do not match."""
    for i, arg in enumerate(names):
        if not placeholder.startswith(f"l_{arg}_") or not hasattr(full[i], "stream_tensors"):
            continue
        for name, t in full[i].stream_tensors(full[0].device).items():
            if placeholder.endswith(f"_{name}") and (t.shape, t.dtype, t.device) == (
                    example.shape, example.dtype, example.device):  # fmt: skip
                return i, name
    return None


def _generated_call(gm: torch.fx.GraphModule, fn: Callable[..., Any]) -> Callable[..., Any] | None:
    """Inductor's generated ``call`` for graph ``gm``, found inside AOTAutograd's wrappers of ``fn``
    (through their closures: no API hands it out), or None where the wrappers may have work to do:
    parameters or buffers of ``gm`` (inputs they prepend), or not exactly one compiled graph.

    Why: for a graph that returns fresh tensors and mutates no input, as the quantizers' are, or only
    a rounding stream's counter, which inductor's code advances itself (the caller checks the outputs
    and the counter), the wrappers' work is bookkeeping, and they cost ~4 us a call (a
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
    inputs); a ResNet-50/8 step makes 224 to 322 such calls. Only where the direct call is
    inductor's generated code; on x viewed in place, or, wrapped by ``fused``, on the copy or the
    padded operand the kernel reads. The rest keeps the full path, which builds these."""

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


# a kept path: (x, the per-call arguments) -> the entry point's outputs
Kept = Callable[[Tensor, tuple[Any, ...]], tuple[Tensor | None, ...]]

# (entry point, static arguments, x's shape, strides, dtype, device) -> its _Fast (or a wrapper of one)
_fast: dict[tuple[Any, ...], Kept] = {}


def _fast_key(name: str, fmt: object, dim: int, stochastic: bool, x: Tensor,
              rot: Tensor | None = None) -> tuple[Any, ...]:
    """A call's ``_fast`` key: the entry point, its static arguments, x's layout, dtype and device."""
    return (name, id(fmt), dim, stochastic, None if rot is None else rot.shape, x.shape, x.stride(), x.dtype, x.device)


def _keep_fast(key: tuple[Any, ...], name: str, options: str, x3: Tensor, args: tuple[Any, ...],
               per_call: tuple[int, ...], local: Tensor, outputs: int, owner: object,
               wrap: Callable[[_Fast], Kept] | None = None) -> None:
    """After a plain call through ``_call`` with ``args``: its ``_Fast``, where its direct call is
    inductor's code. ``per_call``: the positions in (x3, *args) of what changes between calls (x's
    view, the stream's keys and counter, a rotation); ``local``: the output in x's layout. ``wrap``:
    what runs around it (kept under ``key`` instead), where the kernel read a copy of x."""
    if key in _fast or not _direct_calls:
        return
    direct = _directs.get(_signature(name, options, x3, args))
    if direct is None or not direct.generated:
        return
    with contextlib.suppress(ValueError):
        fast = _Fast(direct, (x3, *args), per_call, x3, local, outputs, owner)
        _fast[key] = fast if wrap is None else wrap(fast)


def _constant(placeholder: str) -> Tensor | None:
    """The format constant (``fused_kernels._elem``) a graph input of this name holds: dynamo names a
    global's item by its path, ``..._params_<format>_<device>_<0 or 1>_``; None for any other name,
    or two matches."""
    found = [t for (fmt, dev), pair in _params.items() for i, t in enumerate(pair)
             if placeholder.endswith("_params_" + re.sub(r"\W", "_", f"{fmt}_{dev}_{i}") + "_")]  # fmt: skip
    return found[0] if len(found) == 1 else None


# (name, options, x's shape, strides, dtype and device, the other tensors' shapes, the non-tensor
# arguments) -> direct call, or None where it has none
_directs: dict[tuple[Any, ...], _Direct | None] = {}


_graphs: dict[str, tuple[Callable[..., Any], _Inductor]] = {}
_graph_directs: dict[tuple[Any, ...], _Direct | None] = {}
# (body, then per argument: a tensor's shape, strides, dtype and device; a recipe's graph_key; any
# other argument's type and value) -> the direct call, kept at a layout's second call (the first
# found by its name and key), found from its third on
_graph_fast: dict[tuple[Any, ...], _Direct] = {}


def _graph_sig(a: Any, static: bool = False) -> str:
    """An argument's part of a graph variant's name (``call_graph``); ``static``: a tensor's whole shape."""
    if isinstance(a, Tensor):
        dims = "x".join(str(s) for s in a.shape) if static else "".join("1" if s == 1 else "x" for s in a.shape)
        return f"T{dims}{str(a.dtype)[6:]}"
    if hasattr(a, "graph_key"):  # a GEMM recipe
        return a.graph_key()
    return "-" if a is None else repr(a).replace(" ", "")


def graph_options(args: tuple[Any, ...]) -> dict[str, Any]:
    """Inductor's options for a graph of ``call_graph`` with these arguments (scripts/triton_kernels.py
    generates the same code)."""
    # no pattern passes: they fused the bias add into the GEMM (addmm), which sums in another order
    options = {**_EAGER_NUMERICS, "pattern_matcher": False}
    if any(getattr(a, "combo_kernels", False) for a in args):
        # Triton only (a CPU's C++ kernels are fused their own way). One launch runs several kernels
        # that do not read each other's results: the draw keys, the tensor scales' partial amaxes.
        # Each keeps its own code, and every reduction in these graphs is an amax, whose result no
        # order of its steps changes; the bias gradient's sum is computed outside them.
        options["combo_kernels"] = True
    return options


def call_graph(body: Callable[..., Any], *args: Any) -> Any:
    """``body(*args)`` as one compiled graph, the fused quantizers traced into it: a layer's GEMMs in
    one direction (``qgemm._gemms``). Compiled per variant, as ``_kernel`` does: the static arguments
    (flags, tuples, dtypes, which tensors are absent, a recipe's ``graph_key``) and the tensors' unit
    dims name it, and every other dim is dynamic, so that a model's layers share a few graphs and
    never hit dynamo's recompile limit. A recipe with ``static_shapes`` names its tensors' whole shapes
    instead: a graph per layer shape, with no dim dynamic, whose kernels divide element indices by
    constants. (Dynamic sizes reach inductor's Triton kernels as int64 arguments, and on a GPU an int64
    division by a run-time value is a long instruction sequence: pytorch#189940.) After a compile
    failure of a variant, its calls run ``body`` eagerly."""
    if torch.compiler.is_compiling():  # a user's torch.compile around the layers: traced into theirs
        return body(*args)
    # From a layout's third call on, its direct call is found by the parts of what names its variant
    # and keys it, without building those strings: some 60 Python calls fewer per call
    # (scripts/graph_host_bench.py), on the path whose host work paces transformer_lm's step on a GPU.
    light: tuple[Any, ...] | None = None
    if _direct_calls:
        light = (body, *[(a.shape, a.stride(), a.dtype, a.device) if isinstance(a, Tensor)
                         else a.graph_key() if hasattr(a, "graph_key") else (type(a), a) for a in args])  # fmt: skip
        try:
            found = _graph_fast.get(light)
        except TypeError:  # an argument that cannot be hashed: the named path only
            light = found = None
        if found is not None:
            rest = [a.detach() if isinstance(a, Tensor) else a for a in args[1:]]
            return found(args[0].detach(), tuple(rest))
    static = any(getattr(a, "static_shapes", False) for a in args)
    variant = body.__name__ + "|" + ",".join(_graph_sig(a, static) for a in args)
    if variant in _given_up:
        return body(*args)
    args = tuple(a.detach() if isinstance(a, Tensor) else a for a in args)
    # as _call's direct calls: a graph's inputs are its tensors (their layouts key it) and the variant's
    # static arguments; a rounding stream's tensors, which a graph reads off the recipe, are read off
    # the recipe it is given (``GemmRecipe.stream_tensors``)
    key = (variant, *((a.shape, a.stride(), a.dtype, a.device) for a in args if isinstance(a, Tensor)))
    direct = _graph_directs.get(key) if _direct_calls else None
    if direct is not None:
        if light is not None:
            _graph_fast[light] = direct
        return direct(args[0], args[1:])
    entry = _graphs.get(variant)
    if entry is None:
        code = body.__code__.replace(co_name=f"{body.__name__}_{len(_graphs)}")
        fn = types.FunctionType(code, body.__globals__, code.co_name, body.__defaults__, body.__closure__)
        backend = _Inductor(graph_options(args))
        # static: dynamic=False, so that a recompile (another layout of the same shapes) keeps it static
        entry = _graphs[variant] = (torch.compile(fn, fullgraph=True, backend=backend,
                                                  dynamic=False if static else None), backend)
    k, backend = entry
    for a in () if static else args:
        if isinstance(a, Tensor):
            for d, s in enumerate(a.shape):
                if s != 1:
                    torch._dynamo.maybe_mark_dynamic(a, d)
    try:
        fused_kernels.layer_graph = True
        return _through_dynamo(k, backend, _graph_directs, key if _direct_calls else None, body, variant, args[0],
                               args[1:])
    except Exception as exc:  # past the recompile limit, or a graph dynamo or inductor cannot build
        _given_up.add(variant)
        for layout in [f for f, d in _graph_fast.items() if d.key == variant]:  # eager in every layout
            del _graph_fast[layout]
        reason = str(exc).strip().splitlines()[0][:160] if str(exc).strip() else type(exc).__name__
        log.warning("fused GEMM graph %s: %s; its calls run eagerly from here on", variant, reason)
        return body(*args)
    finally:
        fused_kernels.layer_graph = False
