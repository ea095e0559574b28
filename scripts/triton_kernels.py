"""Inductor's Triton kernels for one quantized Linear's compiled graphs, generated without a GPU.

    python scripts/triton_kernels.py --out docs/benchmarks --name triton-kernels-<commit>

On CUDA a Linear layer's GEMMs run as two compiled graphs a step (``qgemm._gemms``: forward, and
dgrad with wgrad), and transformer_lm's emulated step on an H200 was paced by the host launching
their Triton kernels (docs/benchmarks/README.md, the sixth GPU run). How many kernels a graph
launches is decided by inductor's code generation, which needs no GPU: dynamo traces each graph as
``compiled_calls.call_graph`` does (every dim but unit dims dynamic) on fake CUDA tensors, and
inductor writes its code for an sm90 device (H100/H200). Nothing runs and nothing is timed: the
figures are kernels a layer and step, each kernel's name, and the kernels that load through an
address dividing an element's index (``divmod_loads``; the H200 profile of 2026-11-28 had NVFP4's
such reductions at 118-155 us a call, against 16-21 us for its others).

Checked against the H200 profiles of 2026-11-28 (Triton launches a step, at the commit before
the fix these figures led to): MXFP8 launched 374 and 425 (bf16 products), this script's 15 and 17
a layer times its 25 quantized layers being 375 and 425; NVFP4 launched 609 and 651, 21 layers (its
recipe keeps the last ones high) times 29 and 31, one a layer fewer than the 30 and 32 counted here.

Written by hand because no tool does this: the few calls that would reach the CUDA driver (device
properties, the current device and stream, the Triton backend's target, a device guard in two
Tensor methods) are replaced for the process. Written against torch 2.11 (the GPU machines');
each cell runs in a process of its own.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import subprocess
import sys
from collections import namedtuple
from pathlib import Path
from typing import Any

import torch

FORMATS = ("mxfp8", "nvfp4")
COMPUTE = ("fp32", "bf16")
# transformer_lm's MLP input layer at the GPU check's batch: 32 x 256 tokens, 384 -> 1536
SHAPE = (32, 256, 384, 1536)


def _fake_cuda() -> None:
    """Make this process generate code for an sm90 device that is not there (before inductor's modules
    are imported: its CUDA device interface binds torch.cuda's functions when it is)."""
    props = namedtuple("props", "name major minor total_memory multi_processor_count warp_size "
                       "max_threads_per_multi_processor regs_per_multiprocessor shared_memory_per_block_optin "
                       "shared_memory_per_multiprocessor L2_cache_size gcnArchName uuid is_integrated "
                       "is_multi_gpu_board clock_rate")  # fmt: skip
    h200 = props("NVIDIA H200", 9, 0, 140 * 2**30, 132, 32, 2048, 65536, 232448, 233472, 50 * 2**20, "", "fake", 0, 0,
                 1980000)
    cuda = torch.cuda
    cuda.is_available = lambda: True  # type: ignore[assignment]
    cuda.device_count = lambda: 1  # type: ignore[assignment]
    cuda.current_device = lambda: 0  # type: ignore[assignment]
    cuda.get_device_properties = lambda *a, **k: h200  # type: ignore[assignment]
    cuda.get_device_capability = lambda *a, **k: (9, 0)  # type: ignore[assignment]
    cuda.get_device_name = lambda *a, **k: h200.name  # type: ignore[assignment]
    cuda.is_bf16_supported = lambda *a, **k: True  # type: ignore[assignment]
    cuda.set_device = lambda *a, **k: None  # type: ignore[assignment]
    cuda._exchange_device = lambda idx: 0  # type: ignore[attr-defined]
    cuda._maybe_exchange_device = lambda idx: 0  # type: ignore[attr-defined]
    cuda._lazy_init = lambda: None  # type: ignore[attr-defined]
    cuda.get_rng_state = lambda *a, **k: torch.zeros(16, dtype=torch.uint8)  # type: ignore[assignment]
    cuda.set_rng_state = lambda *a, **k: None  # type: ignore[assignment]
    cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]
    torch.accelerator.is_available = lambda: False  # type: ignore[assignment]  # dynamo's stream state
    import torch._inductor.fx_passes.joint_graph as joint_graph
    import torch._subclasses.fake_tensor as fake_tensor
    import torch.utils._triton as triton_utils
    from torch._subclasses.fake_impls import register_op_impl
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend

    fake_tensor.init_gpu_context = lambda *a, **k: None
    joint_graph.lazy_init = lambda *a, **k: None  # its attention patterns are traced on real tensors
    triton_utils.triton_backend = lambda: CUDABackend(GPUTarget("cuda", 90, 32))
    triton_utils.triton_hash_with_backend = lambda: "sm90-without-a-gpu"

    @register_op_impl(torch.ops.aten.bitwise_not.default)
    def _bitwise_not(mode: Any, func: Any, x: torch.Tensor) -> torch.Tensor:  # its fake kernel ran the real one
        with mode:
            return torch.empty_like(x)

    # Two Tensor methods take a CUDA device guard in C++ before dispatch (a driver call): as aten ops
    torch.Tensor.__invert__ = lambda self: torch.bitwise_not(self)  # type: ignore[method-assign]
    aten = torch.ops.aten

    def getitem(self: torch.Tensor, idx: Any) -> torch.Tensor:
        idx = idx if isinstance(idx, tuple) else (idx,)
        if len(idx) == 1 and isinstance(idx[0], torch.Tensor):
            return aten.index.Tensor(self, [idx[0]])
        out, d = self, 0
        for i in idx:
            if i is None:
                out, d = out.unsqueeze(d), d + 1
            elif isinstance(i, int):
                out = aten.select.int(out, d, i)
            elif isinstance(i, slice):
                out, d = aten.slice.Tensor(out, d, i.start, i.stop, i.step or 1), d + 1
            else:
                raise NotImplementedError(f"index {idx}")
        return out

    torch.Tensor.__getitem__ = getitem  # type: ignore[method-assign, assignment]
    tensor = torch.tensor

    def on_device(data: Any, *args: Any, device: Any = None, **kwargs: Any) -> torch.Tensor:
        t = tensor(data, *args, **kwargs)  # a constant's value never reaches the generated code
        return t if device is None or str(device) == "cpu" else torch.empty(t.shape, dtype=t.dtype, device=device)

    torch.tensor = on_device  # type: ignore[assignment]


def cell(fmt_name: str, compute: str, direction: str, combo: bool = False,
         static: bool = False) -> dict[str, list[str]]:
    """One graph's Triton kernels: their names in launch order (``kernels``), those of them that load
    with an address computed by dividing an element's index (``divmod_loads``), and those that divide
    an element's index by a run-time size (``runtime_divisions``). ``combo``: with the recipe's
    ``combo_kernels`` (precision.graph_combo_kernels); ``static``: with its ``static_shapes``
    (precision.graph_static_shapes), no dim dynamic."""
    _fake_cuda()
    import torch._inductor.config as inductor_config
    from torch._inductor import codecache
    from torch._inductor.compile_fx import compile_fx
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from mptrain.numerics import compiled_calls, fused, mx, qgemm
    from mptrain.numerics.qgemm import BlockQuantizer, GemmRecipe, RngStreams

    fused.enabled = lambda x: True  # its probe would compile and run a kernel
    nv = fmt_name == "nvfp4"
    recipe = GemmRecipe(BlockQuantizer(mx.BLOCK_FORMATS[fmt_name], stochastic_grads=nv, rng=RngStreams(0)),
                        torch.bfloat16 if compute == "bf16" else torch.float32,
                        hadamard_signs=GemmRecipe.signs(1) if nv else None, weight_2d=nv,
                        combo_kernels=combo, static_shapes=static)  # convert.py's recipes
    graphs: list[Any] = []

    def keep(gm: Any, example_inputs: Any) -> Any:
        graphs.append(gm)
        return gm.forward

    b, s, k, n = SHAPE
    with FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv()):
        x, w, bias, dy = (torch.empty(*shape, device="cuda") for shape in ((b, s, k), (n, k), (n,), (b, s, n)))
        w_scale = torch.empty((), device="cuda") if nv else None
        recipe.quantizer.fusable(torch.device("cuda"))
        if direction == "fwd":
            body, args = qgemm._linear_fwd, (x, w, bias, recipe)
        else:
            body, args = qgemm._linear_bwd, (dy, x, w, w_scale, recipe.rotation_for(dy), recipe, (True, True),
                                             torch.float32)
        for a in () if static else args:  # as call_graph marks them
            if isinstance(a, torch.Tensor):
                for d, size in enumerate(a.shape):
                    if size != 1:
                        torch._dynamo.maybe_mark_dynamic(a, d)
        torch.compile(body, fullgraph=True, backend=keep)(*args)
    code: list[str] = []

    def generated(key: str, path: str, *args: Any, **kwargs: Any) -> Any:
        code.append(Path(path).read_text())
        raise _Generated

    codecache.PyCodeCache.load_by_key_path = staticmethod(generated)  # type: ignore[method-assign]
    gm = graphs[-1]
    inputs = [node.meta["example_value"] for node in gm.graph.nodes if node.op == "placeholder"]
    # call_graph's options (graph_options), and no constant folding: it runs kernels on the joint graph
    options = {**compiled_calls.graph_options((recipe,)), "joint_graph_constant_folding": False,
               "force_disable_caches": True}
    with inductor_config.patch(options), contextlib.suppress(_Generated):
        compile_fx(gm, inputs)
    calls = code[-1][code[-1].index("def call("):]
    return {"kernels": re.findall(r"(triton_\w+)\.run\(", calls), "divmod_loads": divmod_loads(code[-1]),
            "runtime_divisions": runtime_divisions(code[-1])}


# An element's index in a Triton kernel: the range variables and what inductor derives from them.
_ELEMENT = re.compile(r"\b(xindex|r0_index|rindex|r0_\d+|x\d+)\b")
# A kernel in inductor's module: its name and its Triton source.
_KERNEL = re.compile(r"(triton_\w+) = async_compile\.triton\('\w+', '{3}(.*?)'{3}", re.S)


def divmod_loads(source: str) -> list[str]:
    """The kernels in inductor's ``source`` with a load whose address takes ``//`` or ``%`` of an
    element's index inside the load itself: work for every element (integer division by a runtime
    size), and an address whose contiguity neither inductor nor Triton can see (inductor judged such a
    load uncoalesced). The usual ``x0 = xindex % ks0`` before the loads is not counted: one per element
    at most, shared by every load of the kernel."""
    found = []
    for name, body in _KERNEL.findall(source):
        for start in (m.end() for m in re.finditer(r"tl\.load\(", body)):
            depth, end = 1, start
            while depth and end < len(body):  # the address: the load's first argument
                depth += {"(": 1, ")": -1}.get(body[end], 0)
                if depth == 1 and body[end] == ",":
                    break
                end += 1
            address = body[start:end]
            if any(_ELEMENT.search(_dividend(address, m.start())) for m in re.finditer(r"//|%", address)):
                found.append(name)
                break
    return found


def runtime_divisions(source: str) -> list[str]:
    """The kernels in inductor's ``source`` that divide (``//`` or ``%``) an element's index by a size
    passed in at run time (``ks0``...: dynamic dims, which inductor passes as int64)."""
    found = []
    for name, body in _KERNEL.findall(source):
        code = body[body.index("@triton.jit"):]
        for m in re.finditer(r"//|%", code):
            divisor = re.match(r"\s*(\(?[\w\s*+]*)", code[m.end():]).group(1)
            if _ELEMENT.search(_dividend(code, m.start())) and "ks" in divisor:
                found.append(name)
                break
    return found


def _dividend(expr: str, at: int) -> str:
    """The left operand of the ``//`` or ``%`` at ``expr[at]``: a parenthesised group or a name."""
    end = len(expr[:at].rstrip())
    if not end or expr[end - 1] != ")":
        return re.findall(r"\w*$", expr[:end])[0]
    depth, i = 0, end - 1
    while i >= 0:
        depth += {")": 1, "(": -1}.get(expr[i], 0)
        if depth == 0:
            return expr[i:end]
        i -= 1
    return expr[:end]


class _Generated(BaseException):  # not an Exception: inductor would wrap that in its own error
    """Inductor wrote the graph's code: stop before it compiles and loads it (that needs a GPU)."""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=Path("docs/benchmarks"))
    p.add_argument("--name", default="triton-kernels")
    p.add_argument("--cell", nargs=3, metavar=("FORMAT", "COMPUTE", "DIRECTION"), help=argparse.SUPPRESS)
    p.add_argument("--combo", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--static", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.cell:
        print(json.dumps(cell(*args.cell, combo=args.combo, static=args.static)))
        return 0
    # imported here, not in a cell: it imports inductor, which must come after _fake_cuda
    from mptrain.bench.common import cpu_header, cpu_script_stamp, load_averages, write_report

    info = cpu_script_stamp("triton_kernels.py", argv)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    cells = []
    for fmt in FORMATS:
        for compute in COMPUTE:
            row: dict[str, Any] = {"format": fmt, "compute": compute}
            for prefix, combo in (("", []), ("combo_", ["--combo"]), ("static_", ["--static"])):
                for direction in ("fwd", "bwd"):
                    run = subprocess.run([sys.executable, __file__, "--cell", fmt, compute, direction, *combo],
                                         capture_output=True, text=True, check=True)  # fmt: skip
                    found = json.loads(run.stdout.strip().splitlines()[-1])
                    row[prefix + direction] = found["kernels"]
                    row[prefix + direction + "_divmod_loads"] = found["divmod_loads"]
                    row[prefix + direction + "_runtime_divisions"] = found["runtime_divisions"]
                row[prefix + "per_step"] = len(row[prefix + "fwd"]) + len(row[prefix + "bwd"])
            cells.append(row)
            print(f"{fmt} {compute}: {len(row['fwd'])} + {len(row['bwd'])} kernels, "
                  f"{len(row['combo_fwd'])} + {len(row['combo_bwd'])} with combo kernels", flush=True)
    info["load_average_end"] = load_averages()
    result = {**info, "commit": commit, "shape": SHAPE, "target": "sm90, generated without a GPU", "cells": cells}
    md = cpu_header(info, "Triton kernels of a quantized Linear's graphs (inductor, sm90, no GPU)",
                    f"- commit: {commit}; layer: x ({SHAPE[0]}, {SHAPE[1]}, {SHAPE[2]}), Linear({SHAPE[2]}, "
                    f"{SHAPE[3]}), every dim dynamic as call_graph marks it; the recipes of `precision=mx`",
                    "- method: dynamo traces qgemm's forward and backward bodies on fake CUDA tensors; inductor "
                    "writes their code for an sm90 device, counted before anything compiles or runs")
    md += ["| format | products | forward | backward | a layer and step | with combo kernels: forward | backward "
           "| a layer and step | dividing loads: forward | backward |", "|---|---|---|---|---|---|---|---|---|---|"]
    md += [f"| {c['format']} | {c['compute']} | {len(c['fwd'])} | {len(c['bwd'])} | {c['per_step']} "
           f"| {len(c['combo_fwd'])} | {len(c['combo_bwd'])} | {c['combo_per_step']} "
           f"| {len(c['fwd_divmod_loads'])} | {len(c['bwd_divmod_loads'])} |" for c in cells]
    md += ["", "Dividing loads: kernels with a load whose address takes `//` or `%` of an element's index "
           "(without combo kernels).", ""]
    md += ["Static shapes (precision.graph_static_shapes): kernels, and kernels dividing an element's index by a "
           "run-time size, with dynamic dims and static:", "",
           "| format | products | kernels: dynamic | static | run-time divisions: dynamic | static |",
           "|---|---|---|---|---|---|"]
    md += [f"| {c['format']} | {c['compute']} | {len(c['fwd'])} + {len(c['bwd'])} "
           f"| {len(c['static_fwd'])} + {len(c['static_bwd'])} "
           f"| {len(c['fwd_runtime_divisions'])} + {len(c['bwd_runtime_divisions'])} "
           f"| {len(c['static_fwd_runtime_divisions'])} + {len(c['static_bwd_runtime_divisions'])} |" for c in cells]
    md += ["", "Kernels in launch order:", ""]
    for c in cells:
        for direction in ("fwd", "bwd", "combo_fwd", "combo_bwd", "static_fwd", "static_bwd"):
            md.append(f"- {c['format']} {c['compute']} {direction.replace('_', ' ')}: "
                      + ", ".join(f"`{k}`" for k in c[direction]))
    md += ["", "Kernels with dividing loads:", ""]
    md += [f"- {c['format']} {c['compute']} {d}: " + (", ".join(f"`{k}`" for k in c[d + "_divmod_loads"]) or "none")
           for c in cells for d in ("fwd", "bwd")]
    write_report(args.out, args.name, result, "\n".join(md) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
