"""mptrain-bench on CPU: the JSON contract on a tiny grid, and the bare loop being like for like.

Speed targets are measured by the harness, never asserted here: timings on a shared CI machine
are noise. What is asserted is that every figure is there and that the engine and the bare loop
train the same numbers.
"""

from __future__ import annotations

import gc
import json
import math
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

import pytest
import torch

from mptrain.bench import harness, main

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--device", "cpu", "--width-divisor", "8", "--image-size", "32", "--batch-sizes", "4", "--threads", "1",
        "--no-process-warmup", "--overrides", "data.num_classes=10", "optim.lr=0.01"]

CELL_FIELDS = {
    "model", "precision", "precision_resolved", "batch_size", "variant", "unit", "units_per_step",
    "throughput", "step_time_s", "step_time_mean_s", "step_time_windows_s", "spread", "peak_memory_bytes",
    "timing_stat",
    "bare_throughput", "bare_step_time_s", "bare_step_time_windows_s", "bare_spread", "bare_peak_memory_bytes",
    "overhead", "overhead_paired", "overhead_min", "step_time_min_s",
    "speedup_vs_fp32", "bare_speedup_vs_fp32", "speedup_vs_tf32", "speedup_vs_bf16", "memory_vs_fp32",
    "bare_memory_vs_fp32", "mfu", "bare_mfu", "last_loss", "bare_last_loss",
    "flops_per_step", "peak_tflops", "compute_dtype", "losses", "bare_losses", "loss_max_rel_diff", "compile_s",
    "cudagraph_skips",
    "host_syncs_per_step", "optimizer", "loss_scale", "image_size", "overrides",
}
META_FIELDS = {"device", "device_name", "versions", "date", "command", "torch_threads", "method"}


def bench(tmp_path: Path, *args: str) -> dict:
    assert main([*args, "--out", str(tmp_path), "--name", "result"]) == 0
    assert (tmp_path / "result.md").is_file()
    return json.loads((tmp_path / "result.json").read_text())


def _private_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A temp dir of this test's own: other xdist workers' runs make mptrain-bench-* dirs in /tmp."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    monkeypatch.setenv("TMPDIR", str(tmp))
    return tmp


def test_tiny_grid_json_has_every_field(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a stray `runs/` would land here
    tmp = _private_tmp(tmp_path, monkeypatch)
    out = tmp_path / "out"
    args = [a for a in TINY if a != "--no-process-warmup"]  # the default path: with the throwaway cell
    result = bench(out, "--models", "resnet50", "--precisions", "fp32,amp_bf16", "--steps", "2",
                   "--window", "1", "--warmup", "2", *args)
    meta = result["meta"]
    assert meta.keys() >= META_FIELDS
    assert meta["device"] == "cpu" and meta["versions"]["torch"] == torch.__version__
    assert meta["command"].startswith("mptrain-bench --models resnet50") and meta["complete"] is True
    cells = {c["precision"]: c for c in result["cells"]}
    assert set(cells) == {"fp32", "amp_bf16"}
    for cell in cells.values():
        assert "error" not in cell, cell.get("error")
        assert cell.keys() >= CELL_FIELDS, CELL_FIELDS - cell.keys()
        assert cell["throughput"] > 0 and cell["bare_throughput"] > 0
        assert cell["step_time_s"] > 0 and len(cell["step_time_windows_s"]) == 2
        assert cell["overhead"] == pytest.approx(cell["step_time_s"] / cell["bare_step_time_s"])
        assert cell["flops_per_step"] > 0
        # CPU: no device memory, no peak to divide by unless --peak-tflops is given.
        assert cell["peak_memory_bytes"] is None and cell["mfu"] is None
        assert cell["units_per_step"] == 4 and cell["unit"] == "samples"
        assert cell["compile_s"] == 0.0  # nothing compiled (trainer.compile off, no fused quantizers)
        assert cell["cudagraph_skips"] == []
    assert cells["fp32"]["speedup_vs_fp32"] == pytest.approx(1.0)
    assert cells["amp_bf16"]["speedup_vs_fp32"] == pytest.approx(
        cells["fp32"]["step_time_s"] / cells["amp_bf16"]["step_time_s"])
    assert cells["amp_bf16"]["compute_dtype"] == "bf16" and cells["fp32"]["compute_dtype"] == "fp32"
    # FP8 and the emulated formats are read against amp_bf16: the same ratio, its own column.
    assert cells["fp32"]["speedup_vs_bf16"] == pytest.approx(
        cells["amp_bf16"]["step_time_s"] / cells["fp32"]["step_time_s"])
    # FLOPs do not depend on the precision: counted once, shared.
    assert cells["fp32"]["flops_per_step"] == cells["amp_bf16"]["flops_per_step"]
    # The plan says what ran below 16 bits: nothing here (bf16 is 16 bits).
    assert cells["amp_bf16"]["low_precision_flop_fraction"] == 0.0 and cells["amp_bf16"]["low_precision_layers"] == []
    # The markdown carries the stamp and the table.
    md = (out / "result.md").read_text()
    assert meta["date"] in md and "engine/bare" in md and torch.__version__ in md and "vs bf16" in md
    # No run directory left behind, neither in the cwd nor in the temp dir.
    assert not (tmp_path / "runs").exists() and not (tmp_path / "outputs").exists()
    assert not list(tmp.glob("mptrain-bench-*"))


@pytest.mark.parametrize(("model", "size", "precision"), [
    ("resnet50", "32", "fp32"),
    ("alexnet", "64", "fp32"),  # dropout: both loops must draw the same masks
    ("resnet50", "32", "fp16_master"),  # the bare loop's FP32 masters + GradScaler
])
def test_bare_loop_matches_the_engine_loss_for_loss(tmp_path, model, size, precision):
    args = [a if a != "32" else size for a in TINY]
    result = bench(tmp_path, "--models", model, "--precisions", precision, "--steps", "1", "--window", "1",
                   "--warmup", "4", *args)
    (cell,) = result["cells"]
    engine, bare = cell["losses"], cell["bare_losses"]
    assert len(engine) == len(bare) == 4
    assert all(math.isfinite(v) for v in engine)
    assert engine == pytest.approx(bare, rel=1e-6)
    # Reseeded before every group of steps, both stay on one trajectory through the timed windows.
    assert cell["last_loss"] == pytest.approx(cell["bare_last_loss"], rel=1e-6) and not cell["diverged"]
    # Four batches with three updates between them: the later losses check the optimizer step too.
    assert len(set(engine)) == 4


def test_mfu_with_a_given_peak_and_fast_paths(tmp_path):
    result = bench(tmp_path, "--models", "resnet50", "--precisions", "fp32", "--steps", "1", "--window", "1",
                   "--warmup", "1", "--peak-tflops", "1.0", "--fast-paths", "channels_last,optim", "--telemetry",
                   *TINY)
    by_variant = {c["variant"]: c for c in result["cells"]}
    assert set(by_variant) >= {"base", "channels_last", "optim_fused", "optim_foreach"}
    base = by_variant["base"]
    assert base["mfu"] == pytest.approx(base["flops_per_step"] / base["step_time_s"] / 1e12)
    assert by_variant["optim_fused"]["optimizer"] == "SGD(fused)"
    assert by_variant["optim_foreach"]["optimizer"] == "SGD(foreach)"
    cl = by_variant["channels_last"]
    assert cl["speedup_vs_base"] == pytest.approx(base["step_time_s"] / cl["step_time_s"])
    assert "trainer.channels_last=true" in cl["overrides"]
    assert "telemetry" in result["meta"]  # measured, or the hook named
    if "telemetry" in by_variant:  # the config has the key: on/off, read from mean step times
        tel = by_variant["telemetry"]
        assert tel["timing_stat"] == "mean" and tel["bare_step_time_s"] is None
        assert tel["speedup_vs_base"] == pytest.approx(base["step_time_mean_s"] / tel["step_time_mean_s"])
        assert "telemetry=gradients" in tel["overrides"] and "telemetry_every_step" in by_variant


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA")])])
def test_profile_writes_both_runners_tables(tmp_path, device):
    """--profile: op tables and a cProfile of the engine and the bare loop per cell; on a GPU also the
    kernels sorted by their device time and their total per step (is a step paced by its host?)."""
    args = [a if a != "cpu" else device for a in TINY]
    result = bench(tmp_path, "--models", "resnet50", "--precisions", "fp32", "--steps", "1", "--window", "1",
                   "--warmup", "1", "--profile", "1", *args)
    cell = result["cells"][0]
    text = (tmp_path / cell["profile"]["file"]).read_text()
    for runner in ("engine", "bare"):
        assert f"=== {runner}: torch.profiler, 1 steps, sorted by self CPU time ===" in text
        assert f"=== {runner}: cProfile, 1 steps" in text
    assert ("sorted by self device time; kernels" in text) == (device == "cuda")
    if device == "cuda":  # the kernels' time a step is torch's own total of the device events (1 step)
        for runner in ("engine", "bare"):
            part = text.split(f"=== {runner}: torch.profiler, sorted by self device time; kernels ")[1]
            busy = float(part.split(" ms a step")[0])
            total = re.search(r"Self CUDA time total: ([\d.]+)(ms|us)", part)
            assert total is not None
            assert busy == pytest.approx(float(total[1]) / (1 if total[2] == "ms" else 1e3), rel=0.01, abs=0.01)


def test_kernel_time_counts_each_kernel_once():
    """A GPU profile's rows hold an op (aten::mm, a CPU event), its kernel (a CUDA event) and a
    record_function range, which has a row on the device's timeline (a user annotation) spanning its
    kernels: the time a step is the kernels' alone, the total torch's own table prints under it."""
    from torch.autograd import DeviceType
    from torch.autograd.profiler_util import EventList, FunctionEvent

    from mptrain.bench.harness import device_ms_per_step

    def event(i: int, name: str, start: int, end: int, device: DeviceType, annotation: bool = False):
        return FunctionEvent(id=i, name=name, thread=0, start_us=start, end_us=end, device_type=device,
                             use_device="cuda", is_user_annotation=annotation, stack=[])

    events = EventList([event(0, "aten::mm", 0, 3000, DeviceType.CPU), event(1, "gemm", 0, 3000, DeviceType.CUDA),
                        event(2, "elementwise", 3000, 4000, DeviceType.CUDA),
                        event(3, "## forward ##", 0, 4000, DeviceType.CUDA, annotation=True)], use_device="cuda")
    events._build_tree()
    table = events.key_averages()
    total = re.search(r"Self CUDA time total: ([\d.]+)ms", table.table(sort_by="self_device_time_total"))
    assert total is not None and float(total[1]) == 4.0  # the two kernels
    assert device_ms_per_step(table, steps=2) == 2.0


@pytest.mark.parametrize("entry", ["torchvision:resnet18", "timm:test_resnet", "custom:torchvision.models.resnet18",
                                   "hf_causal_lm:llama"])
def test_a_cell_per_route_matches_the_bare_loop(tmp_path, entry):
    """The brought models measure like the built-in ones: engine against the bare loop, the same losses."""
    extra = ["model.config={hidden_size:32,intermediate_size:64,num_hidden_layers:2,num_attention_heads:4}",
             "data.vocab_size=100", "data.bptt=16"] if entry.startswith("hf") else []
    result = bench(tmp_path, "--models", entry, "--precisions", "fp32", "--steps", "1", "--window", "1",
                   "--warmup", "2", *TINY, *extra)
    (cell,) = result["cells"]
    assert cell["model"] == entry and cell["overhead"] > 0
    assert cell["losses"] == pytest.approx(cell["bare_losses"], rel=1e-6)


def test_unknown_model_is_skipped_and_bad_input_is_one_line(tmp_path, capsys):
    result = bench(tmp_path, "--models", "resnet50,no_such_model,torchvision:resnet181", "--precisions", "fp32",
                   "--steps", "1", "--window", "1", "--warmup", "1", *TINY)
    assert [s["model"] for s in result["skipped"]] == ["no_such_model", "torchvision:resnet181"]
    assert result["skipped"][1]["reason"].startswith("model.arch=resnet181: not a torchvision classification model")
    assert [c["model"] for c in result["cells"]] == ["resnet50"]
    assert main(["--models", "resnet50", "--precisions", "fp64", *TINY]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("mptrain-bench: error: ") and "fp64" in err[-1]


def test_cells_collect_on_a_frozen_heap_and_a_callers_freeze_is_kept(tmp_path, monkeypatch):
    """The full collections between cells run with the objects alive before the benchmark frozen:
    torch's own, and in a test process every graph compiled before, which each collection used to
    walk again. The heap is thawed after it; a freeze made by the caller is left as it was. Python
    3.12 starts with a few of its own objects frozen, which are not a caller's freeze."""
    start = gc.get_freeze_count()  # 375 on Python 3.12 (the GPU machine's), 0 on 3.11
    freezes: list[int] = []
    release = harness._release
    monkeypatch.setattr(harness, "_release", lambda device: freezes.append(gc.get_freeze_count()) or release(device))
    bench(tmp_path, "--models", "resnet50", "--precisions", "fp32", "--steps", "1", "--window", "1", "--warmup",
          "1", *TINY)
    assert freezes and min(freezes) > start + 1000  # the heap was frozen (torch alone is far more)
    assert gc.get_freeze_count() == 0
    gc.freeze()
    try:
        mine = gc.get_freeze_count()
        with harness.frozen_heap():
            assert gc.get_freeze_count() == mine
        assert gc.get_freeze_count() == mine
    finally:
        gc.unfreeze()


def test_script_wrapper_runs():
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench.py"), "--help"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "mptrain-bench" in proc.stdout


def test_peak_table_picks_the_device_and_dtype(monkeypatch):
    from mptrain.bench import peak_tflops

    cuda = torch.device("cuda")
    for name, dtype, peak in [("NVIDIA H100 80GB HBM3", "bf16", 989.4), ("NVIDIA H100 PCIe", "fp16", 756.0),
                              ("NVIDIA H200", "tf32", 494.7), ("NVIDIA A100-SXM4-80GB", "fp32", 19.5),
                              ("NVIDIA A100-SXM4-80GB", "fp8", None), ("NVIDIA GeForce RTX 3090", "bf16", None)]:
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None, name=name: name)
        assert peak_tflops(cuda, dtype, None) == peak, name
    assert peak_tflops(torch.device("cpu"), "fp32", None) is None
    assert peak_tflops(torch.device("cpu"), "fp32", 2.5) == 2.5


def test_fp8_torchao_alias_is_a_cell_and_off_cuda_a_reason(tmp_path):
    result = bench(tmp_path, "--models", "resnet50", "--precisions", "fp32,fp8_torchao", "--steps", "1",
                   "--window", "1", "--warmup", "1", *TINY)
    cells = {c["precision"]: c for c in result["cells"]}
    assert cells["fp32"].get("error") is None
    assert "precision.backend=torchao" in " ".join(cells["fp8_torchao"]["overrides"])
    assert cells["fp8_torchao"]["error"].endswith("needs a CUDA GPU; use backend=emulated")


def test_format_aliases_are_cells_of_the_mx_mode():
    from mptrain.bench.cli import build_parser, plan

    args = build_parser().parse_args(["--models", "transformer_lm_tiny", "--precisions",
                                      "amp_bf16,mxfp8,nvfp4,nvfp4_bf16,mxfp8_bf16_amp", "--batch-sizes", "2",
                                      "--device", "cpu"])
    cells, skipped, _ = plan(args)
    assert not skipped
    formats = {cell.precision: (cfg.precision.name, *(cfg.precision.get(k) for k in ("format", "emulated_compute",
                                                                                       "autocast")))
               for cell, cfg in cells}
    assert formats == {"amp_bf16": ("amp_bf16", None, None, None), "mxfp8": ("mx", "mxfp8", "fp32", None),
                       "nvfp4": ("mx", "nvfp4", "fp32", None), "nvfp4_bf16": ("mx", "nvfp4", "bf16", None),
                       "mxfp8_bf16_amp": ("mx", "mxfp8", "bf16", "bf16")}


@pytest.mark.parametrize("k", [1, 2])
def test_bare_loop_survives_overflowing_first_steps_with_fused_sgd(k):
    """GradScaler + fused SGD with momentum, the first k steps overflowing: the skipped steps leave
    no optimizer state, and the run ends bit for bit where a run that never overflowed ends. On an
    H200 (torch 2.11) the bare loop without this went NaN after its first skips (docs/benchmarks)."""
    from types import SimpleNamespace

    from omegaconf import OmegaConf

    from mptrain.bench.runners import BareRunner

    cfg = OmegaConf.create({
        "trainer": {"grad_clip": None},
        "optim": {"name": "sgd", "lr": 0.05, "momentum": 0.9, "nesterov": False, "impl": "fused",
                  "weight_decay": 0.0, "no_decay_bn_bias": False},
        "sched": {"name": "constant", "warmup_steps": 0, "warmup_start_factor": 1.0, "step_size": 1,
                  "step_unit": "step", "gamma": 1.0, "min_lr_ratio": 0.0},
    })
    precision = SimpleNamespace(autocast_dtype=torch.float16, param_dtype=torch.float32)
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randn(8, 16, generator=gen) for _ in range(3)]

    def train(skips: int) -> tuple[BareRunner, torch.nn.Module, list]:
        torch.manual_seed(0)
        model = torch.nn.Linear(16, 4)
        calls = []

        def loss_fn(x: torch.Tensor) -> torch.Tensor:
            calls.append(None)
            loss = model(x).float().square().mean()
            return loss * math.inf if len(calls) <= skips else loss

        runner = BareRunner(cfg, torch.device("cpu"), precision, [(model, loss_fn)], total_steps=10, steps_per_epoch=10)
        for i in range(skips):
            runner.step([batches[0]])
            assert (i, runner.objectives[0][2].state) == (i, {}), "a skipped step left optimizer state"
        for x in batches:
            runner.step([x])
        return runner, model, calls

    _, skipped, _ = train(k)
    _, clean, _ = train(0)
    assert all(torch.equal(a, b) for a, b in zip(skipped.parameters(), clean.parameters(), strict=True))
    assert all(torch.isfinite(p).all() for p in skipped.parameters())


def test_mfu_of_an_emulated_cell_is_against_its_products_dtype():
    """An emulated cell's MFU is taken against the peak of the dtype its products run in
    (``precision.emulated_compute``): the H200's nvfp4_bf16 cell was once taken against FP32's."""
    from omegaconf import OmegaConf

    from mptrain.bench.harness import compute_dtype
    from mptrain.config import FP8PrecisionConfig, MXPrecisionConfig
    from mptrain.numerics.precision import build_precision

    def dtype(cfg) -> str:
        return compute_dtype(build_precision(OmegaConf.structured(cfg), torch.device("cpu")))

    assert dtype(MXPrecisionConfig(name="mx", format="nvfp4")) == "fp32"
    assert dtype(MXPrecisionConfig(name="mx", format="nvfp4", emulated_compute="bf16")) == "bf16"
    assert dtype(FP8PrecisionConfig(name="fp8", emulated_compute="bf16")) == "bf16"


def test_the_graph_replay_gave_nothing_up():
    """The prose says a CPU replay of the H200's formats cells gave no graph up, at the run's commit
    and after: both replays' own lines."""
    text = (ROOT / "docs/benchmarks/cpu-2026-11-26-graph-replay.txt").read_text()
    assert text.count("given up: none") == 2 and "fused GEMM graph" not in text
    cells = [line.split()[0] for line in text.splitlines() if line.startswith(("amp_bf16", "mxfp8", "nvfp4"))]
    assert cells == ["amp_bf16", "mxfp8", "mxfp8_bf16", "nvfp4", "nvfp4_bf16"] * 2


def test_the_one_compile_run_in_prose_is_its_data() -> None:
    """The notes' run after one compile per element-kernel variant (ec6915f) against the family
    split's run (a1f2d61), and the clean-clone CI run at ec6915f: from their own records."""
    bench_dir = ROOT / "docs" / "benchmarks"
    counts, wall, old_wall, new, old = plugin_runs("ec6915f", "a1f2d61")
    runs = {c: ci_lanes(bench_dir / f"cpu-2026-11-27-avx2-ci-{c}.log") for c in ("ec6915f", "fa63127")}
    lanes = runs["ec6915f"]
    quotes = [
        *compile_comparison(new, old, "a1f2d61"),
        f"{counts} in {minutes(wall)}, against {minutes(old_wall)} at a1f2d61",
        *(f"{run[0][0]} in {minutes(run[0][1])} on torch 2.11, and {run[1][0]} in {minutes(run[1][1])} on 2.15"
          for run in runs.values()),
        f"the two CI runs' 2.15 lanes differ by {minutes(abs(lanes[1][1] - runs['fa63127'][1][1]))}",
    ]
    over = [(c, i) for c, run in runs.items() for i, (_, s) in enumerate(run) if s > 600]
    assert over == [("ec6915f", 0), ("ec6915f", 1), ("fa63127", 0)], over  # the budget sentence's cases
    assert_in_suite_notes(quotes)
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert (f"a cold 2.15 run compiled {new['graphs']} graphs in {minutes(wall)}, and a clean-clone `.ci/run` took "
            f"{minutes(lanes[0][1])} (2.11) and {minutes(lanes[1][1])} (2.15) of tests") in readme


def test_the_frozen_heap_run_in_prose_is_its_data() -> None:
    """The notes' run after the benchmark harness's heap was frozen (ab9e9ae) against the run at
    ec6915f, and the clean-clone CI run at ab9e9ae: from their own records."""
    bench_dir = ROOT / "docs" / "benchmarks"
    counts, wall, old_wall, new, old = plugin_runs("ab9e9ae", "ec6915f")
    bench, old_bench = new["by_file"]["test_bench.py"], old["by_file"]["test_bench.py"]
    assert bench < old_bench / 2  # "two to three times slower", before
    rest, old_rest = (s["total"] - s["kernel_tests"] - s["by_file"]["test_bench.py"] for s in (new, old))
    assert (new["graphs"], new["codes"], new["both"]) == (old["graphs"], old["codes"], old["both"])
    lanes = ci_lanes(bench_dir / "cpu-2026-11-27-avx2-ci-ab9e9ae.log")
    assert all(s > 600 for _, s in lanes)  # "in either lane"
    assert_in_suite_notes([
        f"{counts} in {minutes(wall)}, against {minutes(old_wall)} at ec6915f",
        f"`tests/test_bench.py` took {bench:,.0f} s of worker time against {old_bench:,.0f} s",
        f"inductor compiled the same {new['graphs']} graphs ({new['codes']} distinct FX codes, {new['both']} on both "
        f"workers) with {new['compiled']:,.0f} s in torch.compile against {old['compiled']:,.0f} s, and the tests "
        f"that neither compile nor benchmark took {rest:,.0f} s against {old_rest:,.0f} s",
        f"exited 0: {lanes[0][0]} in {minutes(lanes[0][1])} on torch 2.11, and {lanes[1][0]} in "
        f"{minutes(lanes[1][1])} on 2.15",
    ])


def test_the_run_flags_run_in_prose_is_its_data() -> None:
    """The notes' run after test_fused's kernels compiled under a run's flags (d38ff21) against the
    run at ab9e9ae, and the clean-clone CI run at 8bb2f2f: from their own records."""
    counts, wall, old_wall, new, old = plugin_runs("d38ff21", "ab9e9ae")
    engine = "test_fused.py::test_runs_through_the_engine_match_the_reference_and_report_compile_time"
    runs = [json.loads((ROOT / "docs" / "benchmarks" / f"cpu-2026-11-27-avx2-suite-compile-{c}.json").read_text())
            for c in ("d38ff21", "ab9e9ae")]
    times = [{t[0]: t[1] for w in r["workers"].values() for t in w["tests"]} for r in runs]
    (nv, hy), (old_nv, old_hy) = ([t[f"tests/{engine}[{m}]"] for m in ("nvfp4", "hybrid")] for t in times)
    assert nv < old_nv / 2 and hy < old_hy / 2
    lanes = ci_lanes(ROOT / "docs" / "benchmarks" / "cpu-2026-11-27-avx2-ci-8bb2f2f.log")
    earlier = [ci_lanes(ROOT / "docs" / "benchmarks" / f"cpu-2026-11-27-avx2-ci-{c}.log")[0][1]
               for c in ("ec6915f", "fa63127", "ab9e9ae")]
    assert lanes[0][1] > max(earlier)  # "took longer than in the three earlier CI logs"
    assert_in_suite_notes([
        f"finished {old_wall - wall:.0f} s sooner than at ab9e9ae",
        f"{counts} in {minutes(wall)}, against {minutes(old_wall)} at ab9e9ae",
        f"took {nv:.0f} s (NVFP4) and {hy:.0f} s (FP8 hybrid) against {old_nv:.0f} s and {old_hy:.0f} s",
        f"Inductor compiled {new['graphs']} graphs with {new['codes']} distinct FX codes, {new['both']} of them on "
        f"both workers ({old['graphs']}, {old['codes']} and {old['both']} at ab9e9ae)",
        f"{new['compiled']:,.0f} s in torch.compile ({old['compiled']:,.0f} s) and {new['backend']:,.0f} s in "
        f"AOTAutograd and inductor ({old['backend']:,.0f} s); all tests together took {new['total']:,.0f} s of "
        f"worker time against {old['total']:,.0f} s",
        f"exited 0: {lanes[0][0]} in {minutes(lanes[0][1])} on torch 2.11, and {lanes[1][0]} in "
        f"{minutes(lanes[1][1])} on 2.15",
    ])


def test_the_fused_tests_on_the_oldest_torch_in_prose_are_their_log() -> None:
    """The notes' two runs of tests/test_fused.py alone on torch 2.11, before and after d38ff21 and
    8bb2f2f: from their log."""
    text = (ROOT / "docs" / "benchmarks" / "cpu-2026-11-27-avx2-test-fused-min-torch.log").read_text()
    runs = dict(re.findall(r"^(\w+): \d+ passed, \d+ skipped, \d+ warnings in ([\d.]+)s \(\S+\)$", text, re.M))
    assert list(runs) == ["e6f5477", "c51a145"]
    before, after = (float(runs[c]) for c in runs)
    assert after < before  # "did not slow that file"
    assert_in_suite_notes([f"took {minutes(before)} at e6f5477 and {minutes(after)} at c51a145"])


def test_the_oldest_torch_runs_in_prose_are_their_data() -> None:
    """The notes' two cold plugin runs on torch 2.11 (2026-11-28), before and after the AOTAutograd
    cache option, the shared module fixtures and the light spawn module: from their own records."""
    bench_dir = ROOT / "docs" / "benchmarks"
    runs, logs = {}, {}
    for commit in ("02e58bf", "12a5b52"):
        data = json.loads((bench_dir / f"cpu-2026-11-28-avx2-suite-compile-min-torch-{commit}.json").read_text())
        name = f"min-torch-2-workers-cold-{commit}"
        assert data["meta"]["torch"] == "2.11.0"
        assert (data["meta"]["counts"], data["meta"]["wall_s"]) == suite_log_result(name, "2026-11-28")
        runs[commit], logs[commit] = data, (bench_dir / f"cpu-2026-11-28-avx2-suite-{name}.log").read_text()
    old, new = (suite_compile_stats(runs[c]) for c in runs)

    def test_time(data: dict, name: str) -> float:
        return next(t[1] for w in data["workers"].values() for t in w["tests"] if t[0] == f"tests/{name}")

    def fsdp2_setups(log: str) -> list[float]:
        return [float(s) for s in re.findall(r"^([\d.]+)s setup +tests/test_fsdp2\.py::", log, re.M)]

    agree = "test_distributed.py::test_adaptive_agreement_takes_the_minimum_over_ranks"
    (n_old, s_old), (n_new, s_new) = ((sum(r["again"].values()), r["again_s"]) for r in (old, new))
    split, whole = fsdp2_setups(logs["02e58bf"]), fsdp2_setups(logs["12a5b52"])
    assert sorted(split, reverse=True)[:3] == pytest.approx([75.74, 43.74, 38.38])  # the launches built twice
    assert sorted(whole, reverse=True)[:2] == pytest.approx([45.92, 30.81]) and len(whole) == len(split) - 1
    d38 = json.loads((bench_dir / "cpu-2026-11-27-avx2-suite-compile-d38ff21.json").read_text())
    linear = "test_fused.py::test_linear_gemms_run_as_graphs_and_a_failing_graph_runs_eagerly"
    graphs = [[g[2] for w in d["workers"].values() for g in w["graphs"] if g[0] == f"tests/{linear}"]
              for d in (runs["12a5b52"], d38)]
    counts, wall = (runs["12a5b52"]["meta"][k] for k in ("counts", "wall_s"))
    old_counts, old_wall = (runs["02e58bf"]["meta"][k] for k in ("counts", "wall_s"))
    assert_in_suite_notes([
        f"compiled {n_old} graphs whose code the same worker had compiled before, and they took {s_old:.1f} s",
        "setups of {:.0f} s, {:.0f} s and {:.0f} s".format(*sorted(split)[-3:]),
        f"That file took {old['by_file']['test_fsdp2.py']:.0f} s of worker time",
        f"{counts} in {minutes(wall)}, against {old_counts} in {minutes(old_wall)} at 02e58bf",
        f"{n_new} in {s_new:.1f} s, against {n_old} in {s_old:.1f} s",
        f"`tests/test_fsdp2.py` took {new['by_file']['test_fsdp2.py']:.0f} s of worker time against "
        f"{old['by_file']['test_fsdp2.py']:.0f} s; the agreement test {test_time(runs['12a5b52'], agree):.1f} s "
        f"against {test_time(runs['02e58bf'], agree):.1f} s",
        f"All tests together took {new['total']:,.0f} s of worker time against {old['total']:,.0f} s; torch.compile "
        f"{new['compiled']:,.0f} s against {old['compiled']:,.0f} s",
        f"{new['compiled']:,.0f} s of the {new['total']:,.0f}",
        f"{graphs[0][0]:.1f} s and {graphs[0][1]:.1f} s in AOTAutograd and inductor on 2.11, against "
        f"{graphs[1][0]:.1f} s and {graphs[1][1]:.1f} s on 2.15",
    ])


CI_2026_11_27 = ("ec6915f", "fa63127", "ab9e9ae", "8bb2f2f")  # the clean-clone CI logs of 2026-11-27


def test_the_ci_runs_of_2026_11_28_in_prose_are_their_logs() -> None:
    """The notes' clean-clone CI runs at 0dec5cb (against the range of the four earlier CI logs), a9988ff
    and 2fdbc5e."""
    bench_dir = ROOT / "docs" / "benchmarks"
    (c11, t11), (c15, t15) = ci_lanes(bench_dir / "cpu-2026-11-28-avx2-ci-0dec5cb.log")
    earlier = [ci_lanes(bench_dir / f"cpu-2026-11-27-avx2-ci-{c}.log") for c in CI_2026_11_27]
    old11, old15 = ([lanes[k][1] for lanes in earlier] for k in (0, 1))
    assert min(old11) <= t11 <= max(old11) and min(old15) <= t15 <= max(old15)  # "inside the range"
    assert t11 > 600 and t15 > 600  # "Neither lane is under 10 minutes"
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert f"as at 0dec5cb ({minutes(t11)} and {minutes(t15)})" in readme
    (a11, s11), (a15, s15) = ci_lanes(bench_dir / "cpu-2026-11-28-avx2-ci-a9988ff.log")
    assert s11 > 600 and s15 > 600  # "Still over 10 minutes"
    (b11, u11), (b15, u15) = ci_lanes(bench_dir / "cpu-2026-11-28-avx2-ci-2fdbc5e.log")
    assert b15 == a15 and u15 < 600 < s15  # "under 10 minutes once, with the same tests that took ..."
    assert_in_suite_notes([
        f"exited 0: {c11} in {minutes(t11)} on torch 2.11, and {c15} in {minutes(t15)} on 2.15",
        f"({minutes(min(old11))} to {minutes(max(old11))} on 2.11, {minutes(min(old15))} to {minutes(max(old15))} on "
        "2.15)",
        f"exited 0: {a11} in {minutes(s11)} on torch 2.11, and {a15} in {minutes(s15)} on 2.15. Still over",
        f"exited 0: {b11} in {minutes(u11)} on torch 2.11, and {b15} in {minutes(u15)} on 2.15. The 2.15 lane came "
        f"in under 10 minutes once, with the same tests that took {minutes(s15)} half an hour earlier",
    ])


def test_the_ci_run_at_471bbd9_in_prose_is_its_log() -> None:
    """The suite notes' clean-clone CI run at 471bbd9, against the range of the seven earlier CI logs."""
    bench_dir = ROOT / "docs" / "benchmarks"
    (c11, t11), (c15, t15) = ci_lanes(bench_dir / "cpu-2026-11-28-avx2-ci-471bbd9.log")
    earlier = [ci_lanes(bench_dir / f"cpu-2026-11-27-avx2-ci-{c}.log") for c in CI_2026_11_27]
    earlier += [ci_lanes(bench_dir / f"cpu-2026-11-28-avx2-ci-{c}.log") for c in ("0dec5cb", "a9988ff", "2fdbc5e")]
    old11, old15 = ([lanes[k][1] for lanes in earlier] for k in (0, 1))
    assert min(old11) <= t11 <= max(old11) and t15 > max(old15)  # "inside the range", "slower than all seven"
    assert t11 > 600 and t15 > 600  # "Neither lane is under 10 minutes"
    assert_in_suite_notes([
        f"exited 0: {c11} in {minutes(t11)} on torch 2.11, and {c15} in {minutes(t15)} on 2.15",
        f"the seven earlier CI logs here ({minutes(min(old11))} to {minutes(max(old11))})",
        f"slower than all seven ({minutes(min(old15))} to {minutes(max(old15))})",
    ])


def test_the_ci_run_at_577bcad_in_prose_is_its_log() -> None:
    """The suite notes' clean-clone CI run at 577bcad, against the range of the eight earlier CI logs."""
    bench_dir = ROOT / "docs" / "benchmarks"
    (c11, t11), (c15, t15) = ci_lanes(bench_dir / "cpu-2026-11-28-avx2-ci-577bcad.log")
    earlier = [ci_lanes(bench_dir / f"cpu-2026-11-27-avx2-ci-{c}.log") for c in CI_2026_11_27]
    earlier += [ci_lanes(bench_dir / f"cpu-2026-11-28-avx2-ci-{c}.log")
                for c in ("0dec5cb", "a9988ff", "2fdbc5e", "471bbd9")]
    old11, old15 = ([lanes[k][1] for lanes in earlier] for k in (0, 1))
    assert t11 < min(old11) and t15 < min(old15)  # "faster than all eight"
    assert t11 > 600 > t15  # "the 2.11 lane is still over 10 minutes"
    assert "torch 2.15" in (bench_dir / "cpu-2026-11-28-avx2-ci-577bcad.log").read_text()
    assert_in_suite_notes([
        f"exited 0: {c11} in {minutes(t11)} on torch 2.11, and {c15} in {minutes(t15)} on 2.15",
        f"eight earlier CI logs here (2.11: {minutes(min(old11))} to {minutes(max(old11))}; 2.15: "
        f"{minutes(min(old15))} to {minutes(max(old15))})",
    ])


def test_the_plugin_run_at_7845f41_in_prose_is_its_data() -> None:
    """The suite notes' cold torch 2.11 plugin run at 7845f41 against the one at 12a5b52, from both
    records and logs."""
    counts, wall = suite_log_result("min-torch-2-workers-cold-7845f41", date="2026-11-28")
    _, old_wall = suite_log_result("min-torch-2-workers-cold-12a5b52", date="2026-11-28")
    bench_dir = ROOT / "docs" / "benchmarks"
    data, old_data = (json.loads((bench_dir / f"cpu-2026-11-28-avx2-suite-compile-min-torch-{c}.json").read_text())
                      for c in ("7845f41", "12a5b52"))  # fmt: skip
    assert data["meta"]["wall_s"] == wall and data["meta"]["counts"] == counts
    new, old = suite_compile_stats(data), suite_compile_stats(old_data)

    def test_s(d: dict, name: str) -> float:
        return sum(t[1] for w in d["workers"].values() for t in w["tests"] if t[0] == name)

    one = test_s(data, "tests/test_fused.py::test_exactly_one_block_along_the_dim_compiles_no_second_graph")
    rot = "tests/test_fused.py::test_blocks_rotated_inside_their_kernel"
    assert_in_suite_notes([
        f"{counts} in {minutes(wall)}, against {minutes(old_wall)} at 12a5b52",
        f"took {new['total']:,.0f} s of worker time against {old['total']:,.0f} s, torch.compile "
        f"{new['compiled']:.0f} s against {old['compiled']:.0f} s. The new test took {one:.1f} s of it, and the "
        f"rotated-block test {test_s(data, rot) - test_s(old_data, rot):.1f} s more",
    ])


def plugin_runs(commit: str, before: str) -> tuple[str, float, float, dict, dict]:
    """Two cold ``scripts/suite_compile_times.py`` runs (docs/benchmarks), at ``commit`` and at
    ``before``: the first's counts and wall time, the second's wall time, and both runs' sums."""
    bench_dir = ROOT / "docs" / "benchmarks"
    counts, wall = suite_log_result(f"latest-torch-2-workers-cold-{commit}")
    _, old_wall = suite_log_result(f"latest-torch-2-workers-cold-{before}")
    data = json.loads((bench_dir / f"cpu-2026-11-27-avx2-suite-compile-{commit}.json").read_text())
    assert data["meta"]["wall_s"] == wall and data["meta"]["counts"] == counts
    old = json.loads((bench_dir / f"cpu-2026-11-27-avx2-suite-compile-{before}.json").read_text())
    return counts, wall, old_wall, suite_compile_stats(data), suite_compile_stats(old)


def ci_lanes(log: Path) -> list[tuple[str, float]]:
    """A clean-clone ``.ci/run`` log's two test runs (torch 2.11, then the latest): counts, seconds;
    it must have passed."""
    text = log.read_text()
    lanes = re.findall(r"^(\d+ passed, \d+ skipped)(?:, \d+ warnings)? in ([\d.]+)s \(\S+\)$", text, re.M)
    assert len(lanes) == 2 and text.count(": exit 0,") == 2 and re.search(r"^total: \d+ passed, 0 failed", text, re.M)
    return [(c, float(s)) for c, s in lanes]


def test_the_capped_xeon_suite_run_in_prose_is_its_log() -> None:
    """The suite notes' run on the Xeon capped to AVX2 (2026-11-30): counts and wall time from its log."""
    log = ROOT / "docs" / "benchmarks" / "cpu-2026-11-30-amx-capped-avx2-suite-min-torch-2-workers-cold-3f7466c.log"
    last = log.read_text().strip().splitlines()[-1]
    found = re.fullmatch(r"(\d+) passed, (\d+) skipped(?:, \d+ warnings)? in ([\d.]+)s \(\S+\)", last)
    assert found, last
    wall = minutes(float(found[3]))
    (_, t11), (_, t15) = ci_lanes(ROOT / "docs" / "benchmarks" / "cpu-2026-11-28-avx2-ci-577bcad.log")
    assert_in_suite_notes([
        f"{found[1]} passed, {found[2]} skipped in {wall}, nothing else running but two sub-second runs",
        f"last clean-clone CI run took {minutes(t11)} and {minutes(t15)} (the two lanes, at 577bcad)",
    ])


def assert_in_suite_notes(quotes: list[str]) -> None:
    notes = " ".join((ROOT / "docs" / "benchmarks" / "cpu-2026-11-27-avx2-suite.md").read_text().split())
    missing = [q for q in quotes if " ".join(q.split()) not in notes]
    assert not missing, missing


def compile_comparison(new: dict, old: dict, before: str) -> list[str]:
    """What the suite notes quote of two ``suite_compile_stats``: graphs, compile time, tests' time."""
    return [
        f"Inductor compiled {new['graphs']} graphs with {new['codes']} distinct FX codes, {new['both']} of them on "
        f"both workers ({old['graphs']}, {old['codes']} and {old['both']} at {before})",
        f"{new['compiled']:,.0f} s in torch.compile ({old['compiled']:,.0f} s) and {new['backend']:,.0f} s in "
        f"AOTAutograd and inductor ({old['backend']:,.0f} s)",
        f"took {new['kernel_tests']:,.0f} s of worker time against {old['kernel_tests']:,.0f} s; the other tests "
        f"took {new['total'] - new['kernel_tests']:,.0f} s against {old['total'] - old['kernel_tests']:,.0f} s",
        f"the compile work fell by {old['compiled'] - new['compiled']:,.0f} s "
        f"({100 * (old['compiled'] - new['compiled']) / old['compiled']:.0f}%) of worker time",
    ]


def suite_log_result(name: str, date: str = "2026-11-27") -> tuple[str, float]:
    """A suite log's last line (docs/benchmarks/cpu-DATE-avx2-suite-NAME.log): its counts, seconds."""
    last = (ROOT / "docs" / "benchmarks" / f"cpu-{date}-avx2-suite-{name}.log").read_text().strip().splitlines()[-1]
    found = re.fullmatch(r"(\d+ passed, \d+ skipped)(?:, \d+ warnings)? in ([\d.]+)s \(\S+\)", last)
    assert found, last
    return found[1], float(found[2])


def minutes(seconds: float) -> str:
    return f"{int(seconds) // 60} min {int(seconds) % 60} s"


def suite_compile_stats(data: dict) -> dict:
    """A ``scripts/suite_compile_times.py`` run's sums: worker time in tests, in torch.compile (test_fused's
    part), in the fused tests (test_fused, test_syncs); graphs, distinct FX codes, codes on both workers,
    same-worker recompiles by test and their seconds, and AOTAutograd and inductor's time."""
    workers = data["workers"].values()
    tests = [t for w in workers for t in w["tests"]]
    codes = [{g[1] for g in w["graphs"]} for w in workers]
    graphs = [g for w in workers for g in w["graphs"]]
    again = [g for w in workers for i, g in enumerate(w["graphs"]) if g[1] in {h[1] for h in w["graphs"][:i]}]
    return {
        "total": sum(t[1] for t in tests),
        "compiled": sum(t[2] for t in tests if t[2] > 0),  # < 0: a dynamo reset
        "fused": sum(t[2] for t in tests if t[2] > 0 and t[0].startswith("tests/test_fused.py")),
        "kernel_tests": sum(t[1] for t in tests if t[0].startswith(("tests/test_fused.py", "tests/test_syncs.py"))),
        "graphs": len(graphs), "codes": len(set.union(*codes)), "both": len(set.intersection(*codes)),
        "again": Counter(g[0].split("::")[1].split("[")[0] for g in again),
        "again_s": sum(g[2] for g in again),
        "backend": sum(g[2] for g in graphs),
        "by_file": Counter({f: sum(t[1] for t in tests if t[0].startswith(f"tests/{f}")) for f in
                            {t[0].split("/")[1].split("::")[0] for t in tests}}),
    }  # fmt: skip


def test_the_suite_timings_in_prose_are_their_logs() -> None:
    """README's and the notes' suite timings on the AVX2-only CPU, from the runs' own logs; README's
    test command is the one CI runs."""
    bench_dir = ROOT / "docs" / "benchmarks"
    wall = suite_log_result
    said = minutes

    runs = {n: wall(n) for n in ("min-torch-1-process-cold", "min-torch-2-workers-cold", "min-torch-2-workers-warm",
                                 "latest-torch-2-workers-cold")}  # fmt: skip
    assert {result for result, _ in runs.values()} == {"992 passed, 103 skipped"}
    later, later_wall = wall("latest-torch-2-workers-cold-55feba8")
    one, cold, warm, latest = (said(s) for _, s in runs.values())
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert (f"on torch 2.11, {one} in one process with inductor's cache cold, {cold} on two workers cold, {warm} on "
            f"two workers warm; on torch 2.15, {latest} on two workers cold") in readme
    notes = " ".join((bench_dir / "cpu-2026-11-27-avx2-suite.md").read_text().split())
    for text in (one, cold, warm, latest):
        assert f"| {text} | 992 passed, 103 skipped |" in notes
    cut = 1 - runs["min-torch-2-workers-cold"][1] / runs["min-torch-1-process-cold"][1]
    assert f"Two workers took {round(100 * cut)}% off the cold 2.11 run" in notes
    # where the time goes: the compile-time run's own records
    assert f"| {said(later_wall)} | {later} |" in notes
    data = json.loads((bench_dir / "cpu-2026-11-27-avx2-suite-compile.json").read_text())
    assert data["meta"]["wall_s"] == later_wall and data["meta"]["counts"] == later
    st = suite_compile_stats(data)
    total, compiled, again = st["total"], st["compiled"], st["again"]
    quotes = [
        f"The two workers spent {total:,.0f} s in tests, {compiled:,.0f} s of it ({100 * compiled / total:.0f}%) in "
        f"torch.compile, almost all in `tests/test_fused.py` ({st['fused']:,.0f} s). The other "
        f"{total - compiled:,.0f} s alone would take {said((total - compiled) / 2)} on two workers.",
        f"Inductor compiled {st['graphs']} graphs with {st['codes']} distinct FX codes",
        f"{st['both']} codes on both workers, and {sum(again.values())} compiles of a code the "
        f"same worker had compiled before, {again['test_repeated_calls_skip_dynamo_and_match_the_reference']} of "
        f"them in `test_repeated_calls_skip_dynamo_and_match_the_reference` and "
        f"{again['test_runs_through_the_engine_match_the_reference_and_report_compile_time']} in",
        f"AOTAutograd and inductor took {st['backend']:,.0f} s of the compile time",
    ]
    missing = [q for q in quotes if " ".join(q.split()) not in notes]
    assert not missing, missing
    assert total - 1200 > compiled / 2 - 30  # "about half the compile work gone" to reach 2 x 600 s
    command = re.search(r"\n {4}(python -m pytest[^\n]*)\n", (ROOT / "README.md").read_text())
    assert command and command[1] + " --junitxml" in (ROOT / ".ci" / "run").read_text()


def test_the_family_split_run_in_prose_is_its_data() -> None:
    """The notes' run after each family of fused kernels went to one worker (a1f2d61), against the
    run before (55feba8): from the two runs' own records."""
    bench_dir = ROOT / "docs" / "benchmarks"
    counts, wall = suite_log_result("latest-torch-2-workers-cold-a1f2d61")
    data = json.loads((bench_dir / "cpu-2026-11-27-avx2-suite-compile-a1f2d61.json").read_text())
    assert data["meta"]["wall_s"] == wall and data["meta"]["counts"] == counts
    new = suite_compile_stats(data)
    old = suite_compile_stats(json.loads((bench_dir / "cpu-2026-11-27-avx2-suite-compile.json").read_text()))
    quotes = [
        *compile_comparison(new, old, "55feba8"),
        f"{counts} in {minutes(wall)}",
        f"{new['by_file']['test_bench.py'] - old['by_file']['test_bench.py']:,.0f} s more in `tests/test_bench.py`",
    ]
    assert_in_suite_notes(quotes)
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert (f"{new['graphs']} graphs instead of {old['graphs']} in a later cold 2.15 run, whose wall time "
            f"({minutes(wall)})") in readme
