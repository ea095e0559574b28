"""What the device computes natively, so a precision mode can follow the hardware it is given.

A half type is *native* when the device has arithmetic for it:

- CUDA: FP16 on every GPU mptrain supports (tensor cores since sm70); bf16 from sm80 on
  (``torch.cuda.is_bf16_supported(including_emulation=False)``).
- x86 CPUs: bf16 with AVX512-BF16 or AMX, FP16 with AVX512-FP16 or AMX-FP16. On a CPU with
  AVX2 only (most laptops, older servers and cloud VMs), torch.autocast still runs bf16 and FP16,
  but oneDNN and ATen convert every operand to FP32 and back: 10-25x slower than plain FP32.
- Arm CPUs: bf16 where oneDNN reports it (Armv8.6 BF16 extension, e.g. Graviton3).

The CPU answers come from torch (``torch.cpu._is_*_supported``, which reads CPUID), capped by
``ONEDNN_MAX_CPU_ISA`` the way oneDNN caps itself. So a native-bf16 machine can be made to behave
as an AVX2-only one, for real, with::

    ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 mptrain ...

Some kernels exist for one dtype only: oneDNN has no bf16 or FP16 LSTM below AVX512. Those are
probed once by running the op (``lstm_path``): the probe is what the real call would hit.
"""

from __future__ import annotations

import functools
import os
import platform
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

# oneDNN ISA caps (ONEDNN_MAX_CPU_ISA) that still allow bf16 / FP16 instructions. Unset or ALL
# means no cap.
_ONEDNN_BF16_ISAS = {
    "AVX512_CORE_BF16", "AVX512_CORE_FP16", "AVX10_1_512", "AVX512_CORE_AMX", "AVX10_1_512_AMX",
    "AVX512_CORE_AMX_FP16", "AVX10_1_512_AMX_FP16", "ALL",
}
_ONEDNN_FP16_ISAS = {"AVX512_CORE_FP16", "AVX10_1_512", "AVX512_CORE_AMX_FP16", "AVX10_1_512_AMX_FP16", "ALL"}


@dataclass(frozen=True)
class DeviceCapability:
    """What one device offers; recorded in summary.json as ``device_capability``."""

    device_type: str  # "cuda" | "cpu"
    isa: str  # CUDA: "sm90"; CPU: torch's dispatch level, e.g. "AVX2", "AVX512"
    native_fp16: bool
    native_bf16: bool
    detail: str  # the features behind the answer, for the log

    def native(self, dtype: torch.dtype | None) -> bool:
        """True for FP32 (None) and for a half type the device computes natively."""
        if dtype is None or dtype == torch.float32:
            return True
        return {torch.float16: self.native_fp16, torch.bfloat16: self.native_bf16}.get(dtype, False)

    @property
    def best_half(self) -> torch.dtype | None:
        """The half type ``precision=mixed`` should use here: FP16 on CUDA (the paper's recipe,
        and the fastest tensor-core type on every GPU generation), bf16 on a CPU that has it,
        else None (no native half type: FP32 is fastest)."""
        if self.device_type == "cuda":
            return torch.float16
        return torch.bfloat16 if self.native_bf16 else None

    def describe(self) -> dict[str, Any]:
        return asdict(self)


def _onednn_cap() -> str:
    return os.environ.get("ONEDNN_MAX_CPU_ISA", os.environ.get("DNNL_MAX_CPU_ISA", "ALL")).strip().upper() or "ALL"


def _cpu_capability() -> DeviceCapability:
    isa = torch.backends.cpu.get_cpu_capability()
    cap = _onednn_cap()
    if platform.machine().lower() in ("aarch64", "arm64"):
        # oneDNN's check for the Armv8.6 BF16 extension; no public torch flag for it.
        bf16 = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
        fp16 = False
        detail = f"arm {isa}, bf16 extension {'yes' if bf16 else 'no'}"
    else:
        has_bf16 = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
        has_fp16 = torch.cpu._is_amx_fp16_supported()
        bf16 = has_bf16 and cap in _ONEDNN_BF16_ISAS
        fp16 = has_fp16 and cap in _ONEDNN_FP16_ISAS
        features = [name for name, on in (
            ("AVX2", torch.cpu._is_avx2_supported()), ("AVX512", torch.cpu._is_avx512_supported()),
            ("AVX512-BF16", torch.cpu._is_avx512_bf16_supported()), ("AMX", torch.cpu._is_amx_tile_supported()),
            ("AMX-FP16", has_fp16),
        ) if on]
        detail = "+".join(features) or "no AVX"
        if cap != "ALL":
            detail += f" (capped: ONEDNN_MAX_CPU_ISA={cap})"
    return DeviceCapability("cpu", isa, native_fp16=fp16, native_bf16=bf16, detail=detail)


@functools.cache
def device_capability(device: torch.device) -> DeviceCapability:
    """The half types ``device`` computes natively. Cached: CPUID and CUDA properties don't change."""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        bf16 = torch.cuda.is_bf16_supported(including_emulation=False)
        return DeviceCapability("cuda", f"sm{major}{minor}", native_fp16=major >= 7, native_bf16=bf16,
                                detail=torch.cuda.get_device_name(device))
    return _cpu_capability()


@functools.cache
def lstm_path(device_type: str, dtype: torch.dtype) -> str:
    """How to run nn.LSTM in ``dtype`` on this device, by the first of these that works here:

    - ``"autocast"``: as autocast does it (cuDNN on CUDA; oneDNN's bf16/FP16 LSTM on AVX512 CPUs);
    - ``"cast"``: the weights and inputs cast to ``dtype`` by hand, autocast off, which takes ATen's
      own LSTM instead of oneDNN's (same numerics: every operand is rounded to ``dtype``);
    - ``"fp32"``: in FP32, as autocast does for ops it has no low-precision kernel for.

    oneDNN has bf16/FP16 LSTM primitives only from AVX512 on; below that the autocast call fails
    with "could not create a primitive descriptor". Running a tiny LSTM forward and backward is the
    only check that matches what the real call will do.
    """
    if device_type != "cpu" or dtype == torch.float32:
        return "autocast"
    # fork_rng: the probe's random init must not move the run's RNG stream, or a seed would give
    # other dropout masks in a half precision than in FP32, and the runs would no longer pair.
    # The answer is cached for the process, so it must not depend on the caller's context: the
    # first caller is often the precision plan, under no_grad (a backward there would fail on
    # every path), or an autocast region (which would turn the "cast" probe into another one).
    with (torch.random.fork_rng(devices=[]), torch.inference_mode(False), torch.enable_grad(),
          torch.autocast("cpu", enabled=False)):
        return _probe_lstm(dtype)


def _probe_lstm(dtype: torch.dtype) -> str:
    lstm = nn.LSTM(4, 4, batch_first=True)
    x = torch.zeros(1, 2, 4, requires_grad=True)
    for path in ("autocast", "cast"):
        try:
            if path == "autocast":
                with torch.autocast("cpu", dtype=dtype):
                    out, _ = lstm(x)
            else:
                out, _ = lstm.to(dtype)(x.to(dtype))
            out.float().sum().backward()
        except RuntimeError:
            continue
        return path
    return "fp32"


@functools.cache
def emulation_slowdown(dtype: torch.dtype) -> float:
    """How many times slower a CPU convolution runs under ``dtype`` autocast than in FP32.

    A probe of about 0.1 s on a ResNet-like 3x3 convolution (best of 5 each), so the warning for an
    emulated half type quotes a figure measured on this machine rather than a guess.
    """
    with torch.random.fork_rng(devices=[]):  # leave the run's RNG stream where the seed put it
        x = torch.randn(4, 64, 14, 14)
        w = torch.randn(64, 64, 3, 3)

    def best(ctx_dtype: torch.dtype | None) -> float:
        times = []
        for _ in range(5):
            with torch.autocast("cpu", dtype=ctx_dtype or torch.bfloat16, enabled=ctx_dtype is not None):
                start = time.perf_counter()
                F.conv2d(x, w, padding=1)
                times.append(time.perf_counter() - start)
        return min(times)

    return best(dtype) / max(best(None), 1e-9)
