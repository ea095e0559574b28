"""Precision follows the hardware: what the device computes natively decides what ``mixed`` means,
emulated half types warn with a measured slowdown, and a kernel one dtype lacks (oneDNN's bf16
LSTM below AVX512) is routed around instead of crashing."""

from __future__ import annotations

import logging
import math

import pytest
import torch
from conftest import run_cli, run_job, tiny
from omegaconf import OmegaConf
from test_gan import TINY_GAN
from test_language_model import TINY_LM

from mptrain import hardware
from mptrain.hardware import DeviceCapability, device_capability, lstm_path
from mptrain.models.lstm import LSTMLanguageModel
from mptrain.numerics import precision as precision_mod

CPU = torch.device("cpu")
AVX2 = DeviceCapability("cpu", "AVX2", native_fp16=False, native_bf16=False, detail="AVX2")
SPR = DeviceCapability("cpu", "AVX512", native_fp16=True, native_bf16=True, detail="AVX2+AVX512+AVX512-BF16+AMX")
H100 = DeviceCapability("cuda", "sm90", native_fp16=True, native_bf16=True, detail="NVIDIA H100")


def build(name: str, cap: DeviceCapability, monkeypatch: pytest.MonkeyPatch, **opts):
    monkeypatch.setattr(precision_mod, "device_capability", lambda device: cap)
    return precision_mod.build_precision(OmegaConf.create({"name": name, **opts}), CPU)


@pytest.mark.parametrize("cap,resolved,dtype", [
    (H100, "amp_fp16", torch.float16),  # the paper's recipe on a GPU
    (SPR, "amp_bf16", torch.bfloat16),  # a CPU with bf16 arithmetic
    (AVX2, "fp32", None),  # no native half type: FP32 is the fastest
])
def test_mixed_picks_the_fastest_native_half_type(monkeypatch, cap, resolved, dtype):
    p = build("mixed", cap, monkeypatch)
    assert p.resolved == resolved and p.autocast_dtype == dtype and p.param_dtype == torch.float32
    assert p.capability is cap


def test_mixed_on_a_cpu_without_bf16_says_why_and_how_to_force_it(monkeypatch):
    note = build("mixed", AVX2, monkeypatch).note
    assert "resolved to fp32" in note and "AVX512-BF16 or AMX" in note and "precision=amp_bf16" in note


@pytest.mark.parametrize("name", ["amp_bf16", "amp_fp16", "fp16_master", "bf16_pure", "fp8"])
def test_an_explicit_emulated_mode_runs_but_warns_once_with_a_slowdown(monkeypatch, caplog, name):
    monkeypatch.setattr(precision_mod, "emulation_slowdown", lambda dtype: 17.0)
    with caplog.at_level(logging.WARNING, logger="mptrain.numerics.precision"):
        p = build(name, AVX2, monkeypatch)
    assert p.resolved == name  # it still runs what was asked
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "emulated" in warnings[0] and f"precision={name}" in warnings[0]
    if name != "fp8":
        assert "about 17x slower than fp32" in warnings[0]


@pytest.mark.parametrize("name", ["amp_bf16", "bf16_pure", "mixed", "fp32"])
def test_no_warning_where_the_arithmetic_is_native(monkeypatch, caplog, name):
    with caplog.at_level(logging.WARNING, logger="mptrain.numerics.precision"):
        build(name, SPR, monkeypatch)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_slowdown_probe_measures_this_cpu():
    # A real measurement, so only its sanity is asserted: positive and finite. Where bf16 is
    # emulated it cannot be faster than FP32 by much.
    ratio = hardware.emulation_slowdown(torch.bfloat16)
    assert 0 < ratio < 1e4
    if not device_capability(CPU).native_bf16:
        assert ratio > 0.8


@pytest.mark.parametrize("probe", [
    lambda: hardware.emulation_slowdown.__wrapped__(torch.bfloat16),
    lambda: hardware.lstm_path.__wrapped__("cpu", torch.bfloat16),
], ids=["slowdown", "lstm_path"])
def test_probes_leave_the_runs_rng_stream_alone(probe):
    # The probes run only in half precisions. Had they drawn from the global RNG, a seed would give
    # other initial weights or dropout masks there than in FP32, and no run would pair with its
    # FP32 twin (the study found FP16 and bf16 agreeing to 0.05% while FP32 sat 3% away).
    torch.manual_seed(0)
    before = torch.get_rng_state()
    probe()
    assert torch.equal(torch.get_rng_state(), before)


def test_cpu_capability_reads_torch_and_honours_the_onednn_cap(monkeypatch):
    monkeypatch.setattr(hardware.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
    assert hardware._cpu_capability().native_bf16
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")  # how to force the AVX2-only path on any CPU
    cap = hardware._cpu_capability()
    assert not cap.native_bf16 and "ONEDNN_MAX_CPU_ISA=AVX2" in cap.detail
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
    assert not hardware._cpu_capability().native_bf16


def test_this_cpus_capability_is_what_torch_reports():
    cap = device_capability(CPU)
    assert cap.device_type == "cpu" and cap.isa == torch.backends.cpu.get_cpu_capability()
    assert cap.native(None) and cap.native(torch.float32)
    if cap.native_bf16:
        assert cap.best_half == torch.bfloat16


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_lstm_probe_matches_what_the_kernels_do_on_this_cpu(dtype):
    lstm = torch.nn.LSTM(8, 8, batch_first=True)
    x = torch.randn(2, 3, 8)
    path = lstm_path("cpu", dtype)
    autocast_works = True
    try:
        with torch.autocast("cpu", dtype=dtype):
            lstm(x)[0].float().sum().backward()
    except RuntimeError:
        autocast_works = False
    assert (path == "autocast") == autocast_works


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_lstm_probe_does_not_depend_on_its_callers_context(dtype):
    # Cached for the process, so its first caller must not matter: the first LSTM forward of a
    # run is the precision plan's, under no_grad, where a probe that inherits the mode fails its
    # backward on every path and caches "fp32" (the LM then logged "LSTM layers run in fp32").
    probe = hardware.lstm_path.__wrapped__
    plain = probe("cpu", dtype)
    with torch.no_grad():
        assert probe("cpu", dtype) == plain
    with torch.inference_mode():
        assert probe("cpu", dtype) == plain
    with torch.autocast("cpu", dtype=dtype):
        assert probe("cpu", dtype) == plain
    assert plain != "fp32"  # ATen's LSTM runs both half types on every CPU: "cast" at worst


@pytest.mark.parametrize("path", ["autocast", "cast", "fp32"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_lm_runs_on_every_lstm_path_with_that_paths_numerics(monkeypatch, path, dtype):
    if path == "autocast" and lstm_path("cpu", dtype) != "autocast":
        pytest.skip(f"this CPU has no oneDNN {dtype} LSTM: the autocast path is the one that crashes here")
    monkeypatch.setattr("mptrain.models.lstm.lstm_path", lambda device_type, dt: path)
    torch.manual_seed(0)
    model = LSTMLanguageModel(vocab_size=20, emb_size=8, hidden_size=8, num_layers=1)
    tokens = torch.randint(0, 20, (2, 5))
    with torch.autocast("cpu", dtype=dtype):
        x = model.embedding(tokens)
        out, (h, _) = model._lstm(x, None)
        logits, _ = model(tokens)
    want = torch.float32 if path == "fp32" else dtype
    assert out.dtype == want and h.dtype == want
    logits.float().mean().backward()
    grads = [p.grad for p in model.lstm.parameters()]
    assert all(g is not None and g.dtype == torch.float32 and g.abs().sum() > 0 for g in grads)


# ---------------------------------------------------------------------------------------------
# No model crashes on this CPU in any low-precision mode: it trains, or (the LM in fp8) it stops
# before training with one line. Tiny sizes, so emulated half precision costs little here.

LOW_PRECISION = ["amp_bf16", "amp_fp16", "fp16_master", "bf16_pure", "fp8"]
FAMILIES = {
    **{m: tiny(m) for m in ("alexnet", "vgg16", "resnet50", "googlenet")},
    "inception_v3": tiny("inception_v3", "data.batch_size=2", "data.train_samples=2", "data.val_samples=2"),
    "lstm_lm_tiny": TINY_LM,
    "dcgan": TINY_GAN,
}


@pytest.mark.parametrize("mode", LOW_PRECISION)
@pytest.mark.parametrize("model", list(FAMILIES))
def test_every_model_family_runs_in_every_low_precision_mode(tmp_path, model, mode):
    args = [*FAMILIES[model], f"precision={mode}", "trainer.max_steps=1", "trainer.log_every=1"]
    if model.startswith("lstm") and mode == "fp8":
        r = run_cli(*args, f"hydra.run.dir={tmp_path}")
        assert r.returncode == 2 and "Traceback" not in r.stderr
        assert r.stderr.strip().startswith("mptrain: error: precision=fp8 with model=lstm_lm_tiny")
        return
    s = run_job(tmp_path, *args)
    assert s["status"] == "completed" and s["steps"] == 1 and math.isfinite(s["final_loss"])
