"""The GPU runs' records (``docs/benchmarks/h100-*``, ``h200-*``: what ``scripts/gpu_check.sh``
printed on a lent GPU) against the prose that quotes them, in docs/benchmarks/README.md and README.md.
Each figure in the prose is rebuilt here from the run's own files, and each claim behind the words
(met or not, faster or slower, which tests failed or were cut) is asserted on the data."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BENCH_DIR = ROOT / "docs/benchmarks"


def millis(value: str, unit: str) -> float:
    return float(value) / (1e3 if unit == "us" else 1)


def h200_run(prefix: str) -> tuple[dict[str, dict], dict[str, dict], dict[str, dict], dict]:
    """A gpu_check run's three tables (cells by precision: ResNet-50, FP8, the formats) and its main job."""
    bench_dir = ROOT / "docs/benchmarks"

    def cells(name: str) -> dict[str, dict]:
        data = json.loads((bench_dir / f"{prefix}-{name}.json").read_text())
        assert data["meta"]["device_name"] == "NVIDIA H200"
        return {c["precision"]: c for c in data["cells"]}

    main_job = json.loads((bench_dir / f"{prefix}-main-job.json").read_text())
    return cells("resnet50"), cells("transformer-fp8"), cells("transformer-formats"), main_job


def resnet50_target_rows(r50: dict[str, dict]) -> list[str]:
    """A GPU run's table rows for the ResNet-50 targets (issue 25), from its ResNet-50 cells."""
    mixed, x = r50["amp_fp16"], "{:.2f}×".format
    return [
        f"| ResNet-50 mixed (amp_fp16) ≥ 3000 img/s | {mixed['throughput']:,.0f} img/s | yes |",
        f"| mixed ≥ 3× fp32 (TF32 off) | {x(mixed['speedup_vs_fp32'])} | yes |",
        f"| mixed ≥ 2× tf32 | {x(mixed['speedup_vs_tf32'])} | no |",
        f"| peak memory ≤ 0.6× fp32 | {x(mixed['memory_vs_fp32'])} | yes |",
        f"| engine/bare ≤ 1.02 | {mixed['overhead']:.3f}× amp_fp16, {r50['amp_bf16']['overhead']:.3f}× amp_bf16 "
        "| yes |",
    ]


def test_the_h200_figures_in_prose_are_the_runs():
    """docs/benchmarks/README.md and README.md quote the first GPU run: every figure from its files."""
    bench_dir = ROOT / "docs/benchmarks"
    r50, fp8, fmt, main_job = h200_run("h200-2026-11-26")
    mixed = r50["amp_fp16"]
    x = "{:.2f}×".format
    quotes = [
        f"| ResNet-50 mixed (amp_fp16) ≥ 3000 img/s | {mixed['throughput']:,.0f} img/s | yes |",
        f"| mixed ≥ 3× fp32 (TF32 off) | {x(mixed['speedup_vs_fp32'])} "
        f"(fp32: {r50['fp32']['throughput']:,.0f} img/s) | yes |",
        f"| mixed ≥ 2× tf32 | {x(mixed['speedup_vs_tf32'])} (tf32: {r50['tf32']['throughput']:,.0f} img/s) | no |",
        f"| peak memory ≤ 0.6× fp32 | {x(mixed['memory_vs_fp32'])} | yes |",
        f"| engine/bare ≤ 1.02 | {mixed['overhead']:.3f}× amp_fp16, {r50['amp_bf16']['overhead']:.3f}× amp_bf16, "
        f"{r50['fp32']['overhead']:.3f}× fp32 | yes |",
        f"{x(fp8['fp8_torchao']['speedup_vs_bf16'])} tensorwise, {x(fp8['fp8_torchao_rowwise']['speedup_vs_bf16'])} "
        f"rowwise ({100 * fp8['fp8_torchao']['low_precision_flop_fraction']:.1f}% of the FLOPs in float8)",
        f"| {x(1 / fmt['mxfp8']['speedup_vs_bf16'])} and {x(1 / fmt['nvfp4']['speedup_vs_bf16'])} bf16's step | no |",
        f"TF32 is fast ({x(r50['tf32']['speedup_vs_fp32'])} fp32 here), and the FP16 step runs at "
        f"{100 * mixed['mfu']:.1f}% MFU",
        f"{100 * fmt['mxfp8']['mfu']:.1f}% (mxfp8) and {100 * fmt['nvfp4']['mfu']:.1f}% (nvfp4)",
        f"final loss {main_job['final_loss']:.2f}, peak memory {main_job['peak_memory_bytes'] / 2**20:,.0f} MiB",
        f"({main_job['steps']} steps, {main_job['skipped_steps']} skipped at the start as the dynamic scale fell "
        f"from 2^16 to 2^{math.log2(main_job['final_loss_scale']):.0f}",
    ]
    assert main_job["final_loss_scale"] == 2.0**16 / 2 ** main_job["skipped_steps"]  # GradScaler's start, halved
    text = " ".join((bench_dir / "README.md").read_text().split())
    missing = [q for q in quotes if " ".join(q.split()) not in text]
    assert not missing, missing
    # The cells the prose calls diverged, and the ones it does not.
    assert [p for p, c in r50.items() if c["diverged"]] == ["amp_fp16", "fp16_master"]
    assert fmt["mxfp8"]["compute_dtype"] == fmt["nvfp4"]["compute_dtype"] == "fp32"
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert (f"mixed (amp_fp16) {mixed['throughput']:,.0f} img/s, {x(mixed['speedup_vs_fp32'])} fp32 and "
            f"{x(mixed['speedup_vs_tf32'])} tf32") in readme


def test_the_second_h200_run_in_prose_is_its_data():
    """docs/benchmarks/README.md's and README.md's figures of the second GPU run, from its files."""
    bench_dir = ROOT / "docs/benchmarks"
    r50, fp8, fmt, main_job = h200_run("h200-2026-11-26-run2")
    mixed = r50["amp_fp16"]
    x = "{:.2f}×".format

    def slower(p: str) -> str:
        return x(1 / fmt[p]["speedup_vs_bf16"])

    def ms(p: str) -> str:
        return f"{1e3 * fmt[p]['step_time_s']:.1f} ms"

    quotes = [
        *resnet50_target_rows(r50),
        f"| {x(fp8['fp8_torchao']['speedup_vs_bf16'])} tensorwise, {x(fp8['fp8_torchao_rowwise']['speedup_vs_bf16'])} "
        "rowwise | tensorwise |",
        f"| {slower('mxfp8')} and {slower('nvfp4')} (FP32 products); {slower('mxfp8_bf16')} and "
        f"{slower('nvfp4_bf16')} (bf16 products) | no |",
        f"bf16's step took {ms('amp_bf16')} here",
        f"It runs at {100 * fmt['amp_bf16']['mfu']:.1f}% MFU",
        f"mxfp8 took {ms('mxfp8')} and nvfp4 {ms('nvfp4')}",
        f"(mxfp8_bf16 {ms('mxfp8_bf16')}, nvfp4_bf16 {ms('nvfp4_bf16')})",
        f"the FP32 cells spread by {100 * max(fmt['mxfp8']['spread'], fmt['nvfp4']['spread']):.0f}% between",
        f"final loss {main_job['final_loss']:.2f}, peak memory {main_job['peak_memory_bytes'] / 2**20:,.0f} MiB",
        f"{main_job['steps']} steps, {main_job['skipped_steps']} skipped at the start",
    ]
    assert main_job["status"] == "completed"
    assert all(len(fmt[p]["step_time_windows_s"]) == 2 for p in fmt)  # "only two windows"
    assert fmt["mxfp8"]["spread"] > 0.1 and fmt["nvfp4"]["spread"] > 0.1
    # "not faster": the bf16-product cells against the FP32-product ones
    assert fmt["mxfp8_bf16"]["step_time_s"] > fmt["mxfp8"]["step_time_s"]
    assert fmt["nvfp4_bf16"]["step_time_s"] > 0.9 * fmt["nvfp4"]["step_time_s"]
    # the bug the prose owns up to: these cells' MFU was taken against FP32's peak
    assert fmt["mxfp8_bf16"]["compute_dtype"] == fmt["nvfp4_bf16"]["compute_dtype"] == "fp32"
    text = " ".join((bench_dir / "README.md").read_text().split())
    missing = [q for q in quotes if " ".join(q.split()) not in text]
    assert not missing, missing
    # the test logs' counts, as the prose gives them
    log = (bench_dir / "h200-2026-11-26-run2-gpu-check-tests.log").read_text()
    assert "2 failed, 89 passed" in log and "927 passed" in log and "36 cut by the limit" in log
    cuda_log = (bench_dir / "h200-2026-11-26-run2-cuda-tests.log").read_text()
    assert "fused differs from the reference in 403 values" in cuda_log  # of 37 x 40 outputs: test_fused.linear_step
    assert "403 of the NVFP4 Linear's 1,480 outputs" in text
    first = h200_run("h200-2026-11-26")[2]["amp_bf16"]["step_time_s"]
    assert f"against {1e3 * first:.1f} ms in the first run" in text
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert (f"mixed {mixed['throughput']:,.0f} img/s, {x(mixed['speedup_vs_fp32'])} fp32 and "
            f"{x(mixed['speedup_vs_tf32'])} tf32; float8 {x(fp8['fp8_torchao']['speedup_vs_bf16'])} bf16; "
            f"the emulated formats still {slower('mxfp8')} (mxfp8) and {slower('nvfp4')} (nvfp4)") in readme


def test_the_h100_run_in_prose_is_its_data():
    """docs/benchmarks/README.md's and README.md's figures of the H100 run, from its files."""
    bench_dir = ROOT / "docs/benchmarks"

    def cells(name: str) -> dict[str, dict]:
        data = json.loads((bench_dir / f"h100-2026-11-26-{name}.json").read_text())
        assert data["meta"]["device_name"] == "NVIDIA H100 80GB HBM3"
        return {c["precision"]: c for c in data["cells"]}

    fp8, fmt = cells("transformer-fp8"), cells("transformer-formats")
    main_job = json.loads((bench_dir / "h100-2026-11-26-main-job.json").read_text())
    h200 = h200_run("h200-2026-11-26-run2")[2]
    x = "{:.2f}×".format

    def slower(p: str) -> str:
        return x(1 / fmt[p]["speedup_vs_bf16"])

    def ms(cells: dict[str, dict], p: str) -> str:
        return f"{1e3 * cells[p]['step_time_s']:.1f} ms"

    quotes = [
        f"| {x(fp8['fp8_torchao']['speedup_vs_bf16'])} tensorwise, {x(fp8['fp8_torchao_rowwise']['speedup_vs_bf16'])} "
        "rowwise | tensorwise |",
        f"| {slower('mxfp8')} and {slower('nvfp4')} (FP32 products); {slower('mxfp8_bf16')} and "
        f"{slower('nvfp4_bf16')} (bf16 products) | no |",
        f"bf16's step took {ms(fmt, 'amp_bf16')} here ({100 * fmt['amp_bf16']['mfu']:.1f}% MFU) against "
        f"{ms(h200, 'amp_bf16')} in the second H200 run",
        f"mxfp8 {ms(fmt, 'mxfp8')} here ({ms(h200, 'mxfp8').removesuffix(' ms')} there), nvfp4 {ms(fmt, 'nvfp4')} "
        f"({ms(h200, 'nvfp4').removesuffix(' ms')})",
        f"(mxfp8_bf16 {ms(fmt, 'mxfp8_bf16')}, nvfp4_bf16 {ms(fmt, 'nvfp4_bf16')})",
        f"final loss {main_job['final_loss']:.2f}, peak memory {main_job['peak_memory_bytes'] / 2**20:,.0f} MiB",
        f"{main_job['steps']} steps, {main_job['skipped_steps']} skipped at the start",
    ]
    assert main_job["status"] == "completed"
    assert fp8["fp8_torchao"]["speedup_vs_bf16"] >= 1.3 > fp8["fp8_torchao_rowwise"]["speedup_vs_bf16"]  # "met"
    # "about the same on both machines" for the emulated cells, and bf16 "nearly twice as long"
    assert all(abs(fmt[p]["step_time_s"] / h200[p]["step_time_s"] - 1) < 0.1 for p in ("mxfp8", "nvfp4"))
    assert 1.6 < fmt["amp_bf16"]["step_time_s"] / h200["amp_bf16"]["step_time_s"] < 2
    # bf16 products slower than FP32 products, with every graph compiled and none given up
    assert all(fmt[f"{p}_bf16"]["step_time_s"] > fmt[p]["step_time_s"] for p in ("mxfp8", "nvfp4"))
    assert all(fmt[p]["fused_graphs"]["compiled"] > 0 and not fmt[p]["fused_graphs"]["given_up"]
               for p in fmt if p != "amp_bf16")
    text = " ".join((bench_dir / "README.md").read_text().split())
    missing = [q for q in quotes if " ".join(q.split()) not in text]
    assert not missing, missing
    assert not (bench_dir / "h100-2026-11-26-resnet50.json").exists()  # "not measured"
    log = (bench_dir / "h100-2026-11-26-gpu-check-tests.log").read_text()
    assert "2 failed, 94 passed" in log and "960 passed" in log and "8 cut by the limit" in log
    bench_log = (bench_dir / "h100-2026-11-26-gpu-check-bench.log").read_text()
    assert "bench_resnet50 (limit 68s)" in bench_log and "bench_resnet50  124" in bench_log
    cuda_log = (bench_dir / "h100-2026-11-26-cuda-tests.log").read_text()
    for case in ("mxfp8", "nvfp4"):
        assert f"PASSED tests/test_fused.py::test_blocks_on_cuda_in_every_layout[{case}-cuda]" in cuda_log
    assert cuda_log.count("cuDNN conv and cuDNN RNN have different TF32 flags") == 2
    assert "PASSED tests/test_cuda.py::test_torchrun_one_process[fsdp2]" in cuda_log
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert (f"float8 {x(fp8['fp8_torchao']['speedup_vs_bf16'])} bf16; the emulated formats {slower('mxfp8')} "
            f"(mxfp8) and {slower('nvfp4')} (nvfp4) bf16's step time") in readme


def test_the_fourth_gpu_run_in_prose_is_its_data():
    """docs/benchmarks/README.md's figures of the 2026-11-27 H100 run, from its tables, its profiles
    (torch's totals of the device events, not the harness's lines, which counted kernels twice) and
    its logs."""
    bench_dir = ROOT / "docs/benchmarks"

    def cells(day: str, name: str) -> dict[str, dict]:
        data = json.loads((bench_dir / f"h100-{day}-{name}.json").read_text())
        assert data["meta"]["device_name"] == "NVIDIA H100 80GB HBM3"
        return {c["precision"]: c for c in data["cells"]}

    fmt, fp8 = cells("2026-11-27", "transformer-formats"), cells("2026-11-27", "transformer-fp8")
    fmt0, fp80 = cells("2026-11-26", "transformer-formats"), cells("2026-11-26", "transformer-fp8")
    main_job = json.loads((bench_dir / "h100-2026-11-27-main-job.json").read_text())
    x = "{:.2f}×".format

    def slower(cells: dict[str, dict], p: str) -> str:
        return x(1 / cells[p]["speedup_vs_bf16"])

    def ms(v: float) -> str:
        return f"{v:.1f} ms"

    # each profiled cell (2 steps): torch's device total, aten::mm's and addmm's self device time,
    # the quantized Linear functions' self CPU time, the process's CPU total and its Triton launches
    prof: dict[str, dict[str, float]] = {}
    for part in (bench_dir / "h100-2026-11-27-formats-profiles.txt").read_text().split("##### ")[1:]:
        cell = part.split("\n")[0].removeprefix("profile-transformer-lm-").removesuffix("-b32-base.txt")
        row: dict[str, float] = {}
        engine = part.split("=== bare:")[0]
        device = re.search(r"Self CUDA time total: ([\d.]+)(ms|us)", engine)
        row["kernels"] = millis(*device.groups()) / 2
        row["cpu"] = millis(*re.search(r"Self CPU time total: ([\d.]+)(ms|us)", engine).groups())
        for op in ("aten::mm", "aten::addmm", "QuantLinearFn", "QuantLinearFnBackward"):
            # columns: self CPU %, self CPU, CPU total %, CPU total, CPU time avg, self CUDA
            cols = r"\s+[\d.]+%\s+([\d.]+)(ms|us)\s+[\d.]+%\s+\S+\s+\S+\s+([\d.]+)(ms|us)"
            m = re.search(rf"^\s+{op}{cols}", engine, re.M)
            row[op + " cpu"] = millis(m[1], m[2]) / 2 if m else 0.0
            row[op] = millis(m[3], m[4]) / 2 if m else 0.0
        launches = re.search(r"^\s+(\d+)\s+\S+\s+\S+\s+\S+\s+\S+\s+\S*triton_heuristics\.py:\d+\(run\)", engine, re.M)
        row["triton"] = float(launches[1]) if launches else 0.0
        prof[cell.replace("-", "_")] = row
    assert set(prof) == {"amp_bf16", "mxfp8", "mxfp8_bf16", "nvfp4"}

    quotes = [
        f"| {slower(fmt, 'mxfp8')} and {slower(fmt, 'nvfp4')} (FP32 products); {slower(fmt, 'mxfp8_bf16')} (mxfp8, "
        "bf16 products; the limit cut nvfp4_bf16) | no |",
        f"| {x(fp8['fp8_torchao']['speedup_vs_bf16'])} tensorwise; the limit cut rowwise | tensorwise |",
        f"| amp_bf16 | {ms(1e3 * fmt['amp_bf16']['step_time_s'])} | {ms(prof['amp_bf16']['kernels'])} | "
        f"{ms(prof['amp_bf16']['aten::mm'] + prof['amp_bf16']['aten::addmm'])} (with `aten::addmm`) |",
        *(f"| {p} | {ms(1e3 * fmt[p]['step_time_s'])} | {ms(prof[p]['kernels'])} | {ms(prof[p]['aten::mm'])} |"
          for p in ("mxfp8", "mxfp8_bf16", "nvfp4")),
        f"the kernels of an mxfp8 step take {ms(prof['mxfp8_bf16']['kernels'])}, "
        f"{prof['mxfp8_bf16']['kernels'] / (1e3 * fmt['amp_bf16']['step_time_s']):.2f} of bf16's whole step",
        f"spent {prof['mxfp8']['QuantLinearFn cpu'] + prof['mxfp8']['QuantLinearFnBackward cpu']:.0f} ms of their "
        "own CPU time a step in the profile of either mxfp8 cell",
        f"{prof['mxfp8_bf16']['triton']:.0f} Triton launches in two mxfp8_bf16 steps",
        f"({ms(prof['mxfp8_bf16']['kernels'])} against {ms(prof['mxfp8']['kernels'])})",
        f"({prof['mxfp8_bf16']['cpu']:.0f} and {prof['mxfp8']['cpu']:.0f} ms of CPU in the two profiled steps)",
        f"makes the bf16 cell's step {1e3 * (fmt['mxfp8_bf16']['step_time_s'] - fmt['mxfp8']['step_time_s']):.0f} "
        "ms longer",
        f"bf16's host-paced step took {ms(1e3 * fmt['amp_bf16']['step_time_s'])} here against "
        f"{ms(1e3 * fmt0['amp_bf16']['step_time_s'])} on 2026-11-26's H100",
        f"took {ms(1e3 * fp8['amp_bf16']['step_time_s'])} against {ms(1e3 * fp80['amp_bf16']['step_time_s'])}",
        f"(mxfp8 {slower(fmt0, 'mxfp8')}, nvfp4 {slower(fmt0, 'nvfp4')})",
        f"final loss {main_job['final_loss']:.2f}, {main_job['throughput']:,.0f} img/s, peak memory "
        f"{main_job['peak_memory_bytes'] / 2**20:,.0f} MiB",
        f"{main_job['steps']} steps, {main_job['skipped_steps']} skipped at the start",
    ]
    # the claims behind the words
    assert main_job["status"] == "completed"
    assert "nvfp4_bf16" not in fmt and "fp8_torchao_rowwise" not in fp8  # "the limit cut"
    assert fp8["fp8_torchao"]["speedup_vs_bf16"] >= 1.3  # tensorwise met (1.30)
    assert all(1 / fmt[p]["speedup_vs_bf16"] > 1.3 for p in ("mxfp8", "nvfp4", "mxfp8_bf16"))  # "no"
    assert prof["amp_bf16"]["kernels"] < 0.25 * 1e3 * fmt["amp_bf16"]["step_time_s"]  # "a fifth of it"
    assert 0.4 < prof["mxfp8"]["aten::mm"] / prof["mxfp8"]["kernels"] < 0.6  # "half of the ... kernels' time"
    assert prof["mxfp8_bf16"]["kernels"] < 0.6 * prof["mxfp8"]["kernels"]  # bf16 products "halve" them
    assert fmt["mxfp8_bf16"]["step_time_s"] > fmt["mxfp8"]["step_time_s"]  # and yet the step is slower
    assert abs(fp8["amp_bf16"]["step_time_s"] / fp80["amp_bf16"]["step_time_s"] - 1) < 0.01  # same GPU speed
    assert fmt["amp_bf16"]["step_time_s"] / fmt0["amp_bf16"]["step_time_s"] > 1.5  # a slower host
    # the harness's old lines counted each kernel twice: about twice torch's total for two steps
    old = [float(v) for v in re.findall(r"engine: torch.profiler, sorted by self device time; kernels ([\d.]+) ms",
                                        (bench_dir / "h100-2026-11-27-formats-profiles.txt").read_text())]
    assert all(0.95 < v / (2 * prof[c]["kernels"]) < 1.1 for v, c in zip(old, prof, strict=True))
    text = " ".join((bench_dir / "README.md").read_text().split())
    missing = [q for q in quotes if " ".join(q.split()) not in text]
    assert not missing, missing
    log = (bench_dir / "h100-2026-11-27-gpu-check-tests.log").read_text()
    assert "86 passed" in log and "2 failed, 899 passed" in log
    cuda_log = (bench_dir / "h100-2026-11-27-cuda-tests.log").read_text()
    ran = set(re.findall(r"\] PASSED (tests/\S+)", cuda_log))
    assert len(ran) == 86 and "FAILED" not in cuda_log
    assert not [t for t in ran if not t.startswith(("tests/test_cuda.py", "tests/test_bench.py", "tests/test_fp8.py"))]
    assert not [t for t in ran if t.startswith(("tests/test_fused.py", "tests/test_fsdp2.py"))]
    cpu_log = (bench_dir / "h100-2026-11-27-cpu-suite.log").read_text()
    assert cpu_log.count("Failed: Timeout (>120.0s) from pytest-timeout.") == 2
    assert re.findall(r"^FAILED (\S+)", cpu_log, re.M) == [
        "tests/test_fused.py::test_blocks_to_nearest_in_every_layout[mxfp8_e5m2]",
        "tests/test_fused.py::test_quantized_conv2d_with_the_full_recipe[nvfp4-nchw]"]
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert (f"the emulated formats {slower(fmt, 'mxfp8')} (mxfp8) and {slower(fmt, 'nvfp4')} (nvfp4) bf16's step "
            f"time, with profiles that show the step paced by the host: bf16 products bring an mxfp8 step's kernels "
            f"down to {ms(prof['mxfp8_bf16']['kernels'])} against bf16's {ms(1e3 * fmt['amp_bf16']['step_time_s'])} "
            "step") in readme


def test_the_fifth_gpu_run_in_prose_is_its_data():
    """docs/benchmarks/README.md's and README.md's figures of the second H100 run of 2026-11-27
    (``-run2``), from its tables, its profiles (torch's device totals) and its logs."""
    bench_dir = ROOT / "docs/benchmarks"
    run = "h100-2026-11-27-run2"

    def cells(name: str) -> dict[str, dict]:
        data = json.loads((bench_dir / f"{run}-{name}.json").read_text())
        assert data["meta"]["device_name"] == "NVIDIA H100 80GB HBM3"
        return {c["precision"]: c for c in data["cells"]}

    r50, fp8, fmt = cells("resnet50"), cells("transformer-fp8"), cells("transformer-formats")
    main_job = json.loads((bench_dir / f"{run}-main-job.json").read_text())
    x = "{:.2f}×".format

    def slower(p: str) -> str:
        return x(1 / fmt[p]["speedup_vs_bf16"])

    prof = formats_profiles(run)
    kernels, mm = ({p: row[key] for p, row in prof.items()} for key in ("kernels", "mm"))
    assert set(kernels) == set(fmt)
    rest = {p: kernels[p] - mm[p] for p in kernels}
    mixed, h200 = r50["amp_fp16"], [h200_run(p)[0]["amp_fp16"]["throughput"] for p in ("h200-2026-11-26",
                                                                                       "h200-2026-11-26-run2")]
    windows = [1e3 * w for w in fmt["amp_bf16"]["step_time_windows_s"]]
    quotes = [
        *resnet50_target_rows(r50),
        f"| {slower('mxfp8')} and {slower('nvfp4')} (FP32 products); {slower('mxfp8_bf16')} and "
        f"{slower('nvfp4_bf16')} (bf16 products) | no |",
        f"gave {h200[0]:,.0f} and {h200[1]:,.0f} img/s for the same cell",
        f"Its two windows took {windows[0]:.1f} and {windows[1]:.1f} ms (a {100 * fmt['amp_bf16']['spread']:.0f}% "
        f"spread), so its {1e3 * fmt['amp_bf16']['step_time_s']:.1f} ms median",
        *(f"| {p} | {1e3 * fmt[p]['step_time_s']:.1f} ms | {kernels[p]:.1f} ms |" for p in fmt),
        f"({kernels['nvfp4']:.1f} to {kernels['nvfp4_bf16']:.1f} ms)",
        f"drop from {mm['nvfp4']:.1f} to {mm['nvfp4_bf16']:.1f} ms, against mxfp8's {mm['mxfp8']:.1f} to "
        f"{mm['mxfp8_bf16']:.1f} ms",
        f"take {rest['nvfp4']:.0f} to {rest['nvfp4_bf16']:.0f} ms a step, against mxfp8's {rest['mxfp8']:.0f} to "
        f"{rest['mxfp8_bf16']:.0f} ms",
        f"final loss {main_job['final_loss']:.2f}, {main_job['throughput']:,.0f} img/s, peak memory "
        f"{main_job['peak_memory_bytes'] / 2**20:,.0f} MiB",
        f"{main_job['steps']} steps, {main_job['skipped_steps']} skipped at the start",
    ]
    # the claims behind the words
    assert main_job["status"] == "completed"
    assert mixed["throughput"] >= 3000 and mixed["speedup_vs_fp32"] >= 3 > 2 > mixed["speedup_vs_tf32"]
    assert mixed["memory_vs_fp32"] <= 0.6 and all(abs(c["overhead"] - 1) < 0.01 for c in r50.values())
    assert all(mixed["throughput"] < t for t in h200)  # "the slower card"
    assert all(1 / fmt[p]["speedup_vs_bf16"] > 1.3 for p in fmt if p != "amp_bf16")  # "no"
    assert list(fp8) == ["amp_bf16"]  # "the limit cut the FP8 cells after bf16's"
    assert kernels["mxfp8_bf16"] < 1e3 * fmt["amp_bf16"]["step_time_s"]  # "under bf16's whole step"
    assert 3.5 < mm["nvfp4_bf16"] / mm["mxfp8_bf16"] < 4.5  # "four times"
    text = " ".join((bench_dir / "README.md").read_text().split())
    missing = [q for q in quotes if " ".join(q.split()) not in text]
    assert not missing, missing
    log = (bench_dir / f"{run}-gpu-check-tests.log").read_text()
    assert "3 failed, 64 passed" in log and "964 passed, 2 skipped" in log and "63 cut by the limit" in log
    matrix = re.findall(r"(?:NOT RUN|CUT MID-TEST) tests/test_cuda.py::test_every_precision_and_policy_trains", log)
    assert len(matrix) == 31
    cuda_log = (bench_dir / f"{run}-cuda-tests.log").read_text()
    assert re.findall(r"^FAILED (\S+)", cuda_log, re.M) == [
        "tests/test_bench.py::test_profile_writes_both_runners_tables[cuda]",
        "tests/test_fused.py::test_blocks_on_cuda_in_every_layout[nvfp4-cuda]",
        "tests/test_fused.py::test_quantized_gemms_on_cuda_match_the_reference[nvfp4-cuda]"]
    assert "fused differs from the reference in 403 values" in cuda_log and "assert 2.03 == 1.445" in cuda_log
    assert "Failed: Timeout (>120.0s)" in cuda_log
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert (f"mixed (amp_fp16) {mixed['throughput']:,.0f} img/s, {x(mixed['speedup_vs_fp32'])} fp32 and "
            f"{x(mixed['speedup_vs_tf32'])} tf32, at {x(mixed['memory_vs_fp32'])} fp32's peak memory; the emulated "
            f"formats {slower('mxfp8')} (mxfp8) and {slower('nvfp4')} (nvfp4) bf16's step time, against a bf16 cell "
            f"whose windows spread {100 * fmt['amp_bf16']['spread']:.0f}%") in readme



def formats_profiles(run: str) -> dict[str, dict[str, float]]:
    """A gpu_check run's formats profiles (two steps each), per cell and per step: torch's device total
    (``kernels``), ``aten::mm``'s and the memory-efficient attention's self device time, the FP32 GEMM
    kernels' (cuBLAS's f32 and CUTLASS's SIMT ones, among the listed rows), inductor's Triton launches,
    the first (longest) Triton kernel's mean time and calls; over both steps, the graph calls, the calls that went
    through dynamo's ``compile_wrapper`` and the Python function calls (cProfile)."""
    op = r"\s+[\d.]+%\s+\S+\s+[\d.]+%\s+\S+\s+\S+\s+([\d.]+)(ms|us)"  # self CPU %, ..., self CUDA
    cells: dict[str, dict[str, float]] = {}
    for part in (BENCH_DIR / f"{run}-formats-profiles.txt").read_text().split("##### ")[1:]:
        name = part.split("\n")[0].removeprefix("profile-transformer-lm-").removesuffix("-b32-base.txt")
        engine = part.split("=== bare:")[0]
        row = {"kernels": millis(*re.search(r"Self CUDA time total: ([\d.]+)(ms|us)", engine).groups()) / 2}
        for key, pattern in (("mm", "aten::mm"), ("attention forward", "aten::_efficient_attention_forward"),
                             ("attention backward", "aten::_efficient_attention_backward")):
            m = re.search(rf"^\s+{pattern}{op}", engine, re.M)
            row[key] = millis(m[1], m[2]) / 2 if m else 0.0
        by_device = engine.split("sorted by self device time")[1].split("=== engine: cProfile")[0]
        row["fp32 gemm"] = 0.0
        for line in by_device.splitlines():
            m = re.match(rf"^(.{{55}}){op}\s+[\d.]+%\s+\S+\s+(\S+)\s+(\d+)\s*$", line)
            if not m:
                continue
            kernel = m[1].strip()
            if "f32f32" in kernel or "sgemm" in kernel:
                row["fp32 gemm"] += millis(m[2], m[3]) / 2
            if kernel.startswith("triton") and "top us" not in row:  # the rows are sorted by device time
                row["top us"] = millis(*re.match(r"([\d.]+)(ms|us)", m[4]).groups()) * 1e3
                row["top calls"] = int(m[5]) / 2
        cprofile = engine.split("=== engine: cProfile")[1]

        def count(pattern: str, text: str = cprofile) -> float:
            m = re.search(rf"^\s+(\d+)(?:/\d+)?\s+\S+\s+\S+\s+\S+\s+\S+\s+\S*{pattern}", text, re.M)
            return float(m[1]) if m else 0.0

        row["launches"] = count(r"triton_heuristics\.py:\d+\(run\)") / 2
        row["graph calls"] = count(r"compiled_calls\.py:\d+\(call_graph\)")
        row["through dynamo"] = count(r"eval_frame\.py:\d+\(compile_wrapper\)")
        row["function calls"] = float(re.search(r"(\d+) function calls", cprofile)[1])
        cells[name.replace("-", "_")] = row
    return cells


def test_the_sixth_gpu_run_in_prose_is_its_data():
    """docs/benchmarks/README.md's and README.md's figures of the H200 run of 2026-11-28, from its
    tables, its profiles, its logs, and the fifth run's profiles for what changed since."""
    run = "h200-2026-11-28"
    r50, fp8, fmt, main_job = h200_run(run)
    prof, before = formats_profiles(run), formats_profiles("h100-2026-11-27-run2")
    assert set(prof) == set(fmt) == set(before)
    x = "{:.2f}×".format

    def slower(p: str) -> str:
        return x(1 / fmt[p]["speedup_vs_bf16"])

    def ms(v: float) -> str:
        return f"{v:.1f} ms"

    def step(p: str, cells: dict[str, dict] = fmt) -> float:
        return 1e3 * cells[p]["step_time_s"]

    fifth = {c["precision"]: c for c in json.loads((BENCH_DIR / "h100-2026-11-27-run2-transformer-formats.json")
                                                   .read_text())["cells"]}
    mixed, earlier = r50["amp_fp16"], [h200_run(p)[0]["amp_fp16"]["throughput"]
                                       for p in ("h200-2026-11-26", "h200-2026-11-26-run2")]
    nv, mx = prof["nvfp4_bf16"], prof["mxfp8_bf16"]
    emulated = [p for p in fmt if p != "amp_bf16"]
    attention = [prof[p]["attention forward"] + prof[p]["attention backward"] for p in emulated]
    high = 1 - fmt["nvfp4_bf16"]["low_precision_flop_fraction"]
    tests_log = (BENCH_DIR / f"{run}-gpu-check-tests.log").read_text()
    cuda_log = (BENCH_DIR / f"{run}-cuda-tests.log").read_text()
    cpu_log = (BENCH_DIR / f"{run}-cpu-suite.log").read_text()
    finished = set(re.findall(r"^\[gw\d+\] \[\s*\d+%\] (?:PASSED|FAILED|SKIPPED|ERROR) (\S+)", cuda_log, re.M))
    items = int(re.search(r"^3 workers \[(\d+) items\]", cuda_log, re.M)[1])
    matrix_done = [t for t in finished if "test_every_precision_and_policy_trains" in t]

    def duration(phase: str, test: str) -> str:
        seconds = re.search(rf"^([\d.]+)s {phase}\s+{re.escape(test)}$", cuda_log, re.M)[1]
        return f"{float(seconds):.0f}"

    blocks = "tests/test_fused.py::test_blocks_on_cuda_in_every_layout[nvfp4-cuda]"
    repeat = "tests/test_fused.py::test_repeated_calls_skip_dynamo_and_match_the_reference[cuda]"
    frozen = int(re.search(r"assert (\d+) == 0", cpu_log)[1])
    quotes = [
        *resnet50_target_rows(r50),
        f"| {slower('mxfp8')} and {slower('nvfp4')} (FP32 products); {slower('mxfp8_bf16')} and "
        f"{slower('nvfp4_bf16')} (bf16 products) | no |",
        f"| {x(fp8['fp8_torchao']['speedup_vs_bf16'])} tensorwise; the limit cut rowwise | tensorwise |",
        f"{mixed['throughput']:,.0f} img/s for amp_fp16, against {earlier[0]:,.0f} and {earlier[1]:,.0f} in the "
        "two runs",
        f"spread {100 * fmt['amp_bf16']['spread']:.0f}%)",
        *(f"| {p} | {ms(step(p))} | {ms(prof[p]['kernels'])} | {ms(prof[p]['mm'])} | {prof[p]['launches']:.0f} |"
          for p in fmt),
        f"The target is {ms(1.3 * step('amp_bf16'))} a step",
        f"Its kernels take {ms(mx['kernels'])}, under the target, and its step {ms(step('mxfp8_bf16'))}",
        f"launching {mx['launches']:.0f} Triton kernels a step",
        f"They take {ms(nv['kernels'])} a step with bf16 products",
        f"{ms(nv['fp32 gemm'])} of it are FP32 GEMMs",
        f"the last 15% of GEMM layers, {100 * high:.0f}% of the FLOPs",
        f"NVFP4's `aten::mm` takes {ms(nv['mm'])} against MXFP8's {ms(mx['mm'])} because of these layers",
        f"takes {nv['top us']:.0f} µs a call, {nv['top calls']:.0f} calls a step "
        f"({ms(nv['top us'] * nv['top calls'] / 1e3)} a step)",
        f"the memory-efficient kernels take {ms(min(attention))} to {ms(max(attention))} a step"
        if f"{min(attention):.1f}" != f"{max(attention):.1f}" else f"the memory-efficient kernels take "
        f"{ms(min(attention))} a step",
        f"{before['nvfp4']['through dynamo']:.0f} of the {before['nvfp4']['graph calls']:.0f} graph calls in two steps",
        f"fell from {before['nvfp4']['function calls']:,.0f} to {prof['nvfp4']['function calls']:,.0f}",
        f"({ms(step('nvfp4', fifth))} on the H100, {ms(step('nvfp4'))} here)",
        f"took {ms(before['nvfp4_bf16']['kernels'])} a step on the fifth run's H100 and {ms(nv['kernels'])} on "
        "this H200",
        f"{main_job['steps']} steps, {main_job['skipped_steps']} skipped at the start, final loss "
        f"{main_job['final_loss']:.2f}, {main_job['throughput']:,.0f} img/s, peak memory "
        f"{main_job['peak_memory_bytes'] / 2**20:,.0f} MiB",
        f"{len(finished)} passed, none failed",
        f"took {duration('setup', blocks)} s of setup",
        f"and {duration('call', blocks)} s of test",
        f"({items - len(finished)} CUDA tests):** {48 - len(matrix_done)} of the precision × policy matrix, and "
        f"{items - len(finished) - (48 - len(matrix_done))} others",
        f"worker gw1 spent {duration('setup', repeat)} s of setup and {duration('call', repeat)} s of test on "
        f"`{repeat.split('::')[1]}`",
        "1 failed, 928 passed, 3 skipped",
        f"Python 3.12 starts with {frozen} of its own objects frozen",
    ]
    # the claims behind the words
    assert main_job["status"] == "completed"
    assert mixed["throughput"] >= 3000 and mixed["speedup_vs_fp32"] >= 3 > 2 > mixed["speedup_vs_tf32"]
    assert mixed["memory_vs_fp32"] <= 0.6 and all(abs(c["overhead"] - 1) < 0.01 for c in r50.values())
    assert all(abs(mixed["throughput"] / t - 1) < 0.005 for t in earlier)  # "measures the same"
    assert fmt["amp_bf16"]["spread"] < 0.1  # "steady this time"
    assert all(1 / fmt[p]["speedup_vs_bf16"] > 1.3 for p in emulated)  # "no"
    assert fp8["fp8_torchao"]["speedup_vs_bf16"] >= 1.3 and "fp8_torchao_rowwise" not in fp8
    target = 1.3 * step("amp_bf16")
    assert mx["kernels"] < target < step("mxfp8_bf16")  # MXFP8, bf16 products: paced by the host
    assert nv["kernels"] > target and prof["nvfp4"]["kernels"] > target  # NVFP4: by its kernels too
    assert mx["fp32 gemm"] == 0 < nv["fp32 gemm"] and nv["fp32 gemm"] < nv["mm"]  # the kept layers' GEMMs
    assert 0.35 < high < 0.45 and 3.5 < nv["mm"] / mx["mm"] < 4.5  # "four times" (the fifth run's question)
    assert prof["amp_bf16"]["attention forward"] == 0 and min(attention) > 0  # bf16 runs flash attention
    assert before["nvfp4"]["through dynamo"] > 0 == prof["nvfp4"]["through dynamo"]  # the direct SR calls
    assert before["nvfp4"]["graph calls"] == prof["nvfp4"]["graph calls"]
    assert abs(step("nvfp4") / step("nvfp4", fifth) - 1) < 0.05  # "did not get shorter"
    text = " ".join((BENCH_DIR / "README.md").read_text().split())
    missing = [q for q in quotes if " ".join(q.split()) not in text]
    assert not missing, missing
    assert "FAILED" not in cuda_log and "KeyboardInterrupt" in cuda_log  # none failed; the limit stopped it
    assert {"tests/test_bench.py::test_profile_writes_both_runners_tables[cuda]", blocks} <= finished
    assert not [t for t in finished if "test_quantized_gemms_on_cuda_match_the_reference" in t]  # not run
    assert re.findall(r"^FAILED (\S+)", cpu_log, re.M) == [
        "tests/test_bench.py::test_cells_collect_on_a_frozen_heap_and_a_callers_freeze_is_kept"]
    assert "1 failed, 928 passed, 3 skipped" in tests_log and f"{len(finished)} passed" in tests_log
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert (f"ResNet-50 mixed at {mixed['throughput']:,.0f} img/s again; "
            f"the emulated formats {slower('mxfp8_bf16')} (mxfp8) and {slower('nvfp4_bf16')} (nvfp4) bf16's step "
            f"time with bf16 products: MXFP8's kernels take {ms(mx['kernels'])} of its {ms(step('mxfp8_bf16'))} step "
            f"(paced by the host), NVFP4's {ms(nv['kernels'])}") in readme


def test_the_graph_host_bench_in_prose_is_its_data():
    """docs/benchmarks/README.md's figures of the Linear graphs' host work on a CPU
    (scripts/graph_host_bench.py), and the sixth GPU run's launches per graph call beside them."""
    text = " ".join((BENCH_DIR / "README.md").read_text().split())
    rows = {r["format"]: r for r in json.loads((BENCH_DIR / "cpu-2026-11-28-avx2-graph-host.json").read_text())["rows"]}
    mx8, nv4 = rows["mxfp8"], rows["nvfp4"]
    calls = {f: (r["python_calls_per_step"]["named"], r["python_calls_per_step"]["fast"]) for f, r in rows.items()}
    ms = {f: (r["step_ms_cpu"]["named"], r["step_ms_cpu"]["fast"]) for f, r in rows.items()}
    assert (f"MXFP8 {calls['mxfp8'][0]:,.0f} named, {calls['mxfp8'][1]:,.0f} fast; NVFP4 {calls['nvfp4'][0]:,.0f} and "
            f"{calls['nvfp4'][1]:,.0f}") in text
    fewer = [round((calls[f][0] - calls[f][1]) / rows[f]["graph_calls_per_step"]) for f in ("mxfp8", "nvfp4")]
    assert (f"{fewer[0]} and {fewer[1]} fewer per graph call ({mx8['graph_calls_per_step']} and "
            f"{nv4['graph_calls_per_step']} graph calls a step)") in text
    assert (f"MXFP8 {ms['mxfp8'][0]:.2f} ms named, {ms['mxfp8'][1]:.2f} ms fast; NVFP4 {ms['nvfp4'][0]:.2f} ms and "
            f"{ms['nvfp4'][1]:.2f} ms") in text
    spreads = [v for r in rows.values() for v in r["spread_cpu"].values()]
    assert f"The rounds spread {min(spreads):.0%} to {max(spreads):.0%}" in text
    assert all(r["same_losses"] for r in rows.values()) and "Both ways computed the same losses" in text
    per_call = [row["launches"] / (row["graph calls"] / 2) for row in formats_profiles("h200-2026-11-28").values()
                if row["graph calls"]]
    assert f"{min(per_call):.1f} to {max(per_call):.1f} launches per graph call in the sixth run's profiles" in text


def load(name: str) -> Any:
    """docs/benchmarks/NAME.json."""
    return json.loads((BENCH_DIR / f"{name}.json").read_text())


def triton_kernel_phrases() -> dict[str, str]:
    """docs/benchmarks/README.md's section on the Linear graphs' Triton kernels counted without a GPU
    (scripts/triton_kernels.py, before and at the change), what they give against the sixth run's
    launches, and the CPU runs that alternate between the two commits."""
    before, now = load("triton-kernels-7770839")["cells"], load("triton-kernels-71628f2")["cells"]
    rows = []
    for b, n in zip(before, now, strict=True):
        assert (b["format"], b["compute"]) == (n["format"], n["compute"])
        counts = [f"{len(c['fwd'])} + {len(c['bwd'])} = {c['per_step']}" for c in (b, n)]
        rows.append(f"| {b['format']} | {b['compute']} | {counts[0]} | {counts[1]} |")
    sixth = load("h200-2026-11-28-transformer-formats")["cells"]
    cells = {c["precision"]: len(c["low_precision_layers"]) for c in sixth
             if c["precision"] in ("mxfp8", "mxfp8_bf16", "nvfp4", "nvfp4_bf16")}
    launches = {k: v["launches"] for k, v in formats_profiles("h200-2026-11-28").items()}
    per_layer = {("mxfp8" if c["format"] == "mxfp8" else "nvfp4") + ("_bf16" if c["compute"] == "bf16" else ""):
                 c["per_step"] for c in before}  # fmt: skip
    counted = {k: per_layer[k] * cells[k] for k in per_layer}
    off = {k: (counted[k] - launches[k]) / cells[k] for k in counted}
    assert abs(off["mxfp8"]) < 0.1 and off["mxfp8_bf16"] == 0 and off["nvfp4"] == off["nvfp4_bf16"] == 1
    agree = (f"{counted['mxfp8']:.0f} and {counted['mxfp8_bf16']:.0f} Triton launches a step for MXFP8 (FP32 and "
             f"bf16 products), where the profiles counted {launches['mxfp8']:.0f} and {launches['mxfp8_bf16']:.0f}, "
             f"and {counted['nvfp4']:.0f} and {counted['nvfp4_bf16']:.0f} for NVFP4, where they counted "
             f"{launches['nvfp4']:.0f} and {launches['nvfp4_bf16']:.0f}: MXFP8's to one launch, NVFP4's one a "
             "layer too many")
    runs = {f"{m} {w}": [{(r["model"], r["mode"]): r for r in load(f"cpu-2026-11-29-avx512-merge-{m}-{w}-r{i}")["rows"]}
                         for i in (1, 2)] for m in ("resnet", "mlp") for w in ("before", "after")}  # fmt: skip

    def two(runs_: list[dict[Any, Any]], key: tuple[str, str], f: Any) -> str:
        return " and ".join(f(r[key]) for r in runs_)

    ratio = lambda r: f"{r['vs_fp32_cpu']:.2f}×"  # noqa: E731
    quant = lambda r: f"{r['gap']['quantizers_ms']:.1f}"  # noqa: E731
    rn, mlp = ("resnet50/8",), ("mlp 4x1024 b1024",)
    cpu = (f"ResNet-50/8 stayed within its noise: MXFP8 {two(runs['resnet before'], (*rn, 'mxfp8'), ratio)} before, "
           f"{two(runs['resnet after'], (*rn, 'mxfp8'), ratio)} after; NVFP4 "
           f"{two(runs['resnet before'], (*rn, 'nvfp4'), ratio)} before, "
           f"{two(runs['resnet after'], (*rn, 'nvfp4'), ratio)} after. The MLP's MXFP8 "
           f"quantizers took {two(runs['mlp before'], (*mlp, 'mxfp8'), quant)} ms of a batch-1024 step before and "
           f"{two(runs['mlp after'], (*mlp, 'mxfp8'), quant)} ms after; its step against FP32 went from "
           f"{two(runs['mlp before'], (*mlp, 'mxfp8'), ratio)} to {two(runs['mlp after'], (*mlp, 'mxfp8'), ratio)}.")
    return {"TRITON_ROWS": "\n".join(rows), "TRITON_LAYERS": f"{cells['mxfp8']} for MXFP8, {cells['nvfp4']} for NVFP4",
            "TRITON_AGREE": agree, "TRITON_CPU": cpu}


def combo_kernel_phrases() -> list[str]:
    """docs/benchmarks/README.md's section on combo kernels: scripts/triton_kernels.py's counts both
    ways, and what they give a step at the sixth run's quantized layers."""
    cells, before = load("triton-kernels-0718d3e")["cells"], load("triton-kernels-71628f2")["cells"]
    assert [(c["fwd"], c["bwd"]) for c in cells] == [(c["fwd"], c["bwd"]) for c in before]  # "equal"
    assert all(c["combo_per_step"] < c["per_step"] for c in cells)
    rows = [f"| {c['format']} | {c['compute']} | {len(c['fwd'])} + {len(c['bwd'])} = {c['per_step']} | "
            f"{len(c['combo_fwd'])} + {len(c['combo_bwd'])} = {c['combo_per_step']} |" for c in cells]
    sixth = load("h200-2026-11-28-transformer-formats")["cells"]
    layers = {c["precision"]: len(c["low_precision_layers"]) for c in sixth}
    bf = {c["format"]: c for c in cells if c["compute"] == "bf16"}
    n = {f: layers[f + "_bf16"] for f in bf}
    step = " and from ".join(f"{bf[f]['per_step'] * n[f]} to {bf[f]['combo_per_step'] * n[f]} for {f.upper()}"
                             for f in ("mxfp8", "nvfp4"))
    return [*rows, f"the Linear graphs' launches a step with bf16 products go from {step}."]


def test_the_combo_kernel_counts_in_prose_are_their_data() -> None:
    text = " ".join((BENCH_DIR / "README.md").read_text().split())
    missing = [p for p in combo_kernel_phrases() if " ".join(p.split()) not in text]
    assert not missing, missing


def test_the_triton_kernel_counts_in_prose_are_their_data() -> None:
    text = " ".join((BENCH_DIR / "README.md").read_text().split())
    missing = [p for p in triton_kernel_phrases().values() if " ".join(p.split()) not in text]
    assert not missing, missing


def profile_kernels(run: str, cell: str) -> tuple[int, list[tuple[str, float, int, float]]]:
    """A gpu_check formats profile's kernel table for ``cell``: its ``--profile`` steps, and each row as
    (truncated name, device ms over the steps, calls, us a call). The profiler prints a Triton kernel
    twice in a row (its launch and the kernel): it counts once."""
    text = (BENCH_DIR / f"{run}-formats-profiles.txt").read_text()
    section = text.split(f"##### profile-transformer-lm-{cell}-b32-base.txt\n")[1].split("#####")[0]
    steps = int(re.search(r"torch\.profiler, (\d+) steps", section).group(1))
    table = section.split("sorted by self device time")[1].split("\n===")[0]
    rows: list[tuple[str, float, int, float]] = []
    for line in table.splitlines():
        cols = re.split(r"\s{2,}", line.strip())
        if len(cols) == 11 and cols[0].startswith("triton_"):
            (total, t_unit), (avg, a_unit) = (re.fullmatch(r"([\d.]+)(ms|us)", c).groups() for c in (cols[6], cols[9]))
            row = (cols[0], millis(total, t_unit), int(cols[10]), millis(avg, a_unit) * 1e3)
            if not rows or rows[-1] != row:
                rows.append(row)
    return steps, rows


def flat_amax_phrases() -> dict[str, str]:
    """docs/benchmarks/README.md's section on NVFP4's flat tensor amaxes: the sixth run's kernel times,
    and scripts/triton_kernels.py's dividing loads before and after."""
    steps, kernels = profile_kernels("h200-2026-11-28", "nvfp4-bf16")
    amax = [r for r in kernels if r[0].startswith("triton_red_fused_abs_") and "amax" in r[0]]
    rotated = sorted((r for r in amax if "permute" in r[0]), key=lambda r: -r[3])
    others = [r for r in amax if "permute" not in r[0]]
    assert len(rotated) == 2 and len(others) == 1 and min(r[3] for r in rotated) > 5 * others[0][3]
    step = {c["precision"]: c for c in load("h200-2026-11-28-transformer-formats")["cells"]}["nvfp4_bf16"]
    before, after = load("triton-kernels-942a667")["cells"], load("triton-kernels-542cdff")["cells"]
    assert [c["per_step"] for c in before] == [c["per_step"] for c in after]  # "as many kernels as before"

    def dividing(c: dict) -> str:
        return f"{len(c['fwd_divmod_loads'])} + {len(c['bwd_divmod_loads'])}"

    nvfp4 = {c["per_step"] for c in after if c["format"] == "nvfp4"}
    assert len(nvfp4) == 1
    return {
        "NVFP4_ROTATED": " and ".join(f"{r[3]:.1f}" for r in rotated) + " us a call",
        "NVFP4_STEP": f"{sum(r[1] for r in rotated) / steps:.1f} ms of each {step['step_time_s'] * 1e3:.1f} ms step",
        "NVFP4_OTHERS": f"{others[0][3]:.1f} us",
        "DIVIDING_ROWS": "\n".join(f"| {b['format']} | {b['compute']} | {dividing(b)} | {dividing(a)} |"
                                   for b, a in zip(before, after, strict=True)),
        "DIVIDING_KERNELS": f"{nvfp4.pop()}",
    }


def test_the_flat_amax_figures_in_prose_are_their_data() -> None:
    text = " ".join((BENCH_DIR / "README.md").read_text().split())
    missing = [p for p in flat_amax_phrases().values() if " ".join(p.split()) not in text]
    assert not missing, missing


def static_shape_phrases() -> dict[str, str]:
    """docs/benchmarks/README.md's section on static shapes: scripts/triton_kernels.py's kernels and
    run-time divisions, with dynamic dims and static."""
    cells = load("triton-kernels-eac313b")["cells"]

    def two(c: dict, key: str, prefix: str = "") -> str:
        return f"{len(c[prefix + 'fwd' + key])} + {len(c[prefix + 'bwd' + key])}"

    assert all(not c["static_fwd_runtime_divisions"] and not c["static_bwd_runtime_divisions"] for c in cells)
    rows = [f"| {c['format']} | {c['compute']} | {two(c, '')} | {two(c, '', 'static_')} | "
            f"{two(c, '_runtime_divisions')} | {two(c, '_runtime_divisions', 'static_')} |" for c in cells]
    return {"STATIC_ROWS": "\n".join(rows)}


def test_the_static_shape_counts_in_prose_are_their_data() -> None:
    text = " ".join((BENCH_DIR / "README.md").read_text().split())
    missing = [p for p in static_shape_phrases().values() if " ".join(p.split()) not in text]
    assert not missing, missing
