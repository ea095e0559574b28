"""Issue 24's CPU benchmarks of the emulated formats, as docs/benchmarks/README.md and README.md quote
them: its targets, run after run on both kinds of CPU. Every figure in their prose and tables is read
here from the benchmark's own data file, so a changed figure, or a changed file, turns a test red.
(Moved out of tests/test_fused.py, whose tests compile kernels: these read files only, and run
wherever the suite runs.) The runs of single changes, before and after: tests/test_format_change_runs.py."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from bench_notes import AVX512_RUNS, FORMAT_TARGETS, assert_in_notes, benchmark, keyed_rows

# The formats benchmark the notes quote (docs/benchmarks/README.md, README.md).
FORMATS_BENCH = "docs/benchmarks/cpu-2026-11-27-fused-formats-7.json"


def cell(rows: dict[tuple[str, str], dict[str, Any]], key: tuple[str, str]) -> str:
    """A table cell: the run's step time against FP32's, or "-" where the run has no such row."""
    return f"{rows[key]['vs_fp32_cpu']:.2f}×" if key in rows else "-"


def formats_benchmark_rows(path: str = FORMATS_BENCH) -> list[str]:
    """docs/benchmarks/README.md's table of issue 24's CPU targets, from the benchmark's own file."""
    data = json.loads((Path(__file__).resolve().parents[1] / path).read_text())
    rows = {(r["model"], r["mode"]): r for r in data["rows"]}
    out = []
    for (model, mode), limit in FORMAT_TARGETS.items():
        r = rows[(model, mode)]
        ratio, gap = r["vs_fp32_cpu"], r["gap"]
        vs = "; ".join(f"{v:.2f}× {k.removeprefix('torchao ')}" for k, v in r.get("vs_torchao_cpu", {}).items())
        split = f"{gap['quantizers_ms']:.1f} ({gap['quantizer_calls']} calls) {gap['other_ms']:+.1f}"
        out.append(f"| {model} | {mode} | ≤ {limit}× | {ratio:.2f}× | {'yes' if ratio <= limit else 'no'} | "
                   f"{vs or '-'} | {gap['gap_ms']:.1f} ms = {split} |")
    for (model, mode), r in rows.items():
        if mode.endswith(" (eager reference)"):
            fast = rows[(model, mode.removesuffix(" (eager reference)"))]
            out.append(f"| {model} | {fast['mode']} | {r['vs_fp32_cpu']:.2f}× | {fast['vs_fp32_cpu']:.2f}× |")
    return out


def test_the_formats_benchmark_in_prose_is_its_data() -> None:
    root = Path(__file__).resolve().parents[1]
    text = (root / "docs/benchmarks/README.md").read_text()
    missing = [row for row in formats_benchmark_rows() if row not in text]
    assert not missing, missing
    data = json.loads((root / FORMATS_BENCH).read_text())
    calls = [r["gap"]["quantizer_calls"] for r in data["rows"] if r["model"] == "resnet50/8"]
    calls = [c for c in calls if c]  # fp32 makes none, the eager references are not split
    assert f"make {min(calls)} to {max(calls)} quantizer calls per step" in " ".join(text.split())
    # the machine's state between the sixth run and this one, from both files
    before = json.loads((root / "docs/benchmarks/cpu-2026-11-27-fused-formats-6.json").read_text())
    fp32 = [{r["model"]: r["step_ms_cpu"] for r in d["rows"] if r["mode"] == "fp32"} for d in (data, before)]
    assert (f"FP32 at batch 128: {fp32[0]['mlp 4x1024 b128']:.1f} against {fp32[1]['mlp 4x1024 b128']:.1f} ms a step; "
            f"ResNet-50/8's FP32 step {fp32[0]['resnet50/8']:.1f} against {fp32[1]['resnet50/8']:.1f} ms") in " ".join(
                text.split())
    assert fourth_runs_sentence() in " ".join(text.split())
    assert repeat_sentence() in " ".join(text.split())
    for phrase in resnet_verdict_phrases():
        assert phrase in " ".join(text.split()), phrase
    # the fifth and sixth runs, before the changes the notes name since each
    r5, r6 = ({r["mode"]: r["vs_fp32_cpu"] for r in json.loads((root / f"docs/benchmarks/{name}.json").read_text())[
        "rows"] if r["model"] == "resnet50/8" and r["mode"] != "fp32"}
        for name in ("cpu-2026-11-26-fused-formats-5", "cpu-2026-11-27-fused-formats-6"))  # fmt: skip
    for n, run in (("fifth", r5), ("sixth", r6)):
        fused_modes = [v for m, v in run.items() if "(" not in m]
        assert (f"The {n}, `-{5 if n == 'fifth' else 6}`, came before {'' if n == 'sixth' else 'the '}"
                in " ".join(text.split())), n
        assert (f"modes cost {min(fused_modes):.2f}× to {max(fused_modes):.2f}× FP32, over 2× in row-wise FP8 "
                f"({run['fp8 hybrid rowwise']:.2f}×) and NVFP4 ({run['nvfp4']:.2f}×)") in " ".join(text.split()), n
    eager = "nvfp4 (eager reference)"
    assert f"{r6[eager]:.2f}× FP32 in the sixth run, {r5[eager]:.2f}× in the fifth" in " ".join(text.split())
    q = {r["mode"]: r["gap"]["quantizers_ms"] for r in data["rows"] if r["model"] == "resnet50/8" and r.get("gap")}
    q6 = {r["mode"]: r["gap"]["quantizers_ms"] for r in before["rows"] if r["model"] == "resnet50/8" and r.get("gap")}
    assert (f"NVFP4's quantizers take {q['nvfp4']:.1f} ms of the step here against {q6['nvfp4']:.1f} ms in the sixth "
            f"run, MXFP8's {q['mxfp8']:.1f} ms against {q6['mxfp8']:.1f} ms") in " ".join(text.split())
    assert f"(its quantizers: {q['nvfp4']:.1f} ms of the step here, MXFP8's {q['mxfp8']:.1f} ms)" in " ".join(
        text.split())


AVX2_FORMATS_BENCH = "docs/benchmarks/cpu-2026-11-27-avx2-fused-formats.json"


def avx2_formats_phrases() -> list[str]:
    """What the notes say of the AVX2-only run and its ResNet-50/8 repeat, from both files."""
    root = Path(__file__).resolve().parents[1]
    runs = [json.loads((root / AVX2_FORMATS_BENCH.replace(".json", f"{s}.json")).read_text())
            for s in ("", "-resnet-repeat")]  # fmt: skip
    assert all(r["info"]["cpu_capability"] == "AVX2" and not r["info"]["native_bf16"] for r in runs)
    assert "--rounds 15" in runs[1]["info"]["command"]
    rows = [{(r["model"], r["mode"]): r for r in run["rows"]} for run in runs]
    seventh = {(r["model"], r["mode"]): r for r in json.loads((root / FORMATS_BENCH).read_text())["rows"]}
    resnet = [{m: r["vs_fp32_cpu"] for (model, m), r in run.items() if model == "resnet50/8"} for run in rows]
    modes = [m for (model, m) in FORMAT_TARGETS if model == "resnet50/8"]
    met = [m for m in modes if max(resnet[0][m], resnet[1][m]) <= 2.0]
    assert set(modes) - set(met) == {"nvfp4"}  # the bullet names NVFP4 alone
    mlp = [(model, m) for (model, m) in FORMAT_TARGETS if model != "resnet50/8"]
    mlp_met = [k for k in mlp if rows[0][k]["vs_fp32_cpu"] <= FORMAT_TARGETS[k]]
    assert set(mlp) - set(mlp_met) == {("mlp 4x1024 b1024", "mxfp8")}
    b1024 = [r for (model, _), r in rows[0].items() if model == "mlp 4x1024 b1024" and "torchao" not in r["mode"]]
    spreads = [r["spread_cpu"] for r in b1024]
    vs = [v for r in rows[0].values() for v in r.get("vs_torchao_cpu", {}).values()]

    def span(run: dict[str, float]) -> str:
        ratios = [run[m] for m in met]
        return f"{min(ratios):.2f}× to {max(ratios):.2f}×"

    row = "fp8 hybrid rowwise"
    return [f"ResNet-50/8 meets ≤ 2× in six of its seven modes in both runs** ({span(resnet[0])} here, "
            f"{span(resnet[1])} in the repeat); NVFP4 does not ({resnet[0]['nvfp4']:.2f}×, {resnet[1]['nvfp4']:.2f}×)",
            f"is under it here ({resnet[0][row]:.2f}×, {resnet[1][row]:.2f}×)",
            f"FP32's step is slower here ({rows[0]['resnet50/8', 'fp32']['step_ms_cpu']:.1f} ms, "
            f"{rows[1]['resnet50/8', 'fp32']['step_ms_cpu']:.1f} ms in the repeat, against "
            f"{seventh['resnet50/8', 'fp32']['step_ms_cpu']:.1f} ms in the seventh run above), and so is what "
            f"each mode adds (MXFP8: {rows[0]['resnet50/8', 'mxfp8']['gap']['gap_ms']:.1f} ms against "
            f"{seventh['resnet50/8', 'mxfp8']['gap']['gap_ms']:.1f} ms)",
            f"MXFP8 at batch 1024 does not ({rows[0]['mlp 4x1024 b1024', 'mxfp8']['vs_fp32_cpu']:.2f}× against "
            "≤ 1.25×)",
            f"(max - min) / median was {100 * min(spreads):.0f}% to {100 * max(spreads):.0f}% for the modes at batch "
            f"1024, and MXFP6, whose step runs MXFP8's kernels with other format constants, measured "
            f"{rows[0]['mlp 4x1024 b1024', 'mxfp6']['vs_fp32_cpu']:.2f}×",
            f"({min(vs):.2f}× to {max(vs):.2f}× of torchao's step time)"]


def test_the_avx2_formats_benchmark_in_prose_is_its_data() -> None:
    text = " ".join((Path(__file__).resolve().parents[1] / "docs/benchmarks/README.md").read_text().split())
    for phrase in [*formats_benchmark_rows(AVX2_FORMATS_BENCH), *avx2_formats_phrases()]:
        assert phrase in text, phrase


def test_the_two_later_avx2_runs_in_prose_are_their_data() -> None:
    """docs/benchmarks/README.md's two runs of 2026-11-28 (MLP b1024, ResNet-50/8), against the
    targets and the two runs of 2026-11-27, from all four files."""
    root = Path(__file__).resolve().parents[1]
    text = " ".join((root / "docs/benchmarks/README.md").read_text().split())
    runs = [{(r["model"], r["mode"]): r for r in json.loads((root / f"docs/benchmarks/{n}.json").read_text())["rows"]}
            for n in ("cpu-2026-11-28-avx2-fused-formats", "cpu-2026-11-28-avx2-fused-formats-quiet")]
    before = [{(r["model"], r["mode"]): r for r in json.loads((root / AVX2_FORMATS_BENCH.replace(
        ".json", f"{s}.json")).read_text())["rows"]} for s in ("", "-resnet-repeat")]

    def ratios(model: str, mode: str) -> tuple[float, float]:  # vs FP32, in either run
        return runs[0][model, mode]["vs_fp32_cpu"], runs[1][model, mode]["vs_fp32_cpu"]

    b1024, resnet = "mlp 4x1024 b1024", "resnet50/8"
    mx8, nv, hy = ratios(b1024, "mxfp8"), ratios(resnet, "nvfp4"), ratios(b1024, "fp8 hybrid")
    nv1024 = ratios(b1024, "nvfp4")
    assert max(mx8) <= FORMAT_TARGETS[b1024, "mxfp8"] and max(hy) <= FORMAT_TARGETS[b1024, "fp8 hybrid"]
    assert max(nv1024) <= FORMAT_TARGETS[b1024, "nvfp4"]
    nv_all = [*nv, before[0][resnet, "nvfp4"]["vs_fp32_cpu"], before[1][resnet, "nvfp4"]["vs_fp32_cpu"]]
    over = sum(r > FORMAT_TARGETS[resnet, "nvfp4"] for r in nv_all)
    spread = max(r["spread_cpu"] for run in runs for r in run.values())
    fp32 = [run[resnet, "fp32"]["step_ms_cpu"] for run in [*runs, before[0]]]
    torchao = ratios(b1024, "torchao mxfp8")
    for phrase in [
        f"ResNet-50/8 step took {fp32[0]:.1f} ms and {fp32[1]:.1f} ms ({fp32[2]:.1f} ms then), and spreads reached "
        f"{100 * spread:.0f}%",
        f"MXFP8 at batch 1024: {mx8[0]:.2f}× and {mx8[1]:.2f}×, under ≤ {FORMAT_TARGETS[b1024, 'mxfp8']}×",
        f"({before[0][b1024, 'mxfp8']['vs_fp32_cpu']:.2f}× above, where MXFP6 measured "
        f"{before[0][b1024, 'mxfp6']['vs_fp32_cpu']:.2f}×; here MXFP6 measured "
        f"{runs[1][b1024, 'mxfp6']['vs_fp32_cpu']:.2f}×)",
        f"NVFP4 on ResNet-50/8: {nv[0]:.2f}× and {nv[1]:.2f}×.** With {nv_all[2]:.2f}× and {nv_all[3]:.2f}× above, it "
        f"is over the target in {('one', 'two', 'three', 'four')[over - 1]} of four runs on this CPU: not met",
        f"FP8 hybrid at batch 1024 measured {hy[0]:.2f}× and {hy[1]:.2f}× (≤ {FORMAT_TARGETS[b1024, 'fp8 hybrid']}×), "
        f"NVFP4 {nv1024[0]:.2f}× and {nv1024[1]:.2f}× (≤ {FORMAT_TARGETS[b1024, 'nvfp4']}×), and torchao's MXFP8 "
        f"{torchao[0]:.2f}× and {torchao[1]:.2f}×",
    ]:
        assert phrase in text, phrase


def quoted_runs() -> list[dict[str, float]]:
    """ResNet-50/8's step time against FP32 by mode, in the quoted run and in its repeat."""
    root = Path(__file__).resolve().parents[1]
    return [{r["mode"]: r["vs_fp32_cpu"] for r in json.loads((root / FORMATS_BENCH.replace(".json", f"{s}.json"))
                                                             .read_text())["rows"]
             if r["model"] == "resnet50/8"} for s in ("", "-resnet-repeat")]  # fmt: skip


def resnet_verdict_phrases() -> list[str]:
    """What the notes' ResNet-50/8 bullet says of the quoted run and its repeat, from both files: a
    mode meets 2x where it does in both."""
    runs = quoted_runs()
    modes = [m for (model, m) in FORMAT_TARGETS if model == "resnet50/8"]
    met = [m for m in modes if max(runs[0][m], runs[1][m]) <= 2.0]
    assert set(met) == {"fp8 hybrid", "fp8 hybrid tensor", "mxfp8", "mxfp6", "mxfp4"}  # the modes the bullet names
    mx = [[run[m] for m in ("mxfp8", "mxfp6", "mxfp4")] for run in runs]
    words = {5: "five", 6: "six", 7: "seven"}
    row, nv = "fp8 hybrid rowwise", "nvfp4"
    return [f"meets ≤ 2× in {words.get(len(met), len(met))} of its {words[len(modes)]} modes in both runs",
            f"MXFP8, MXFP6 and MXFP4 ({min(mx[0]):.2f}× to {max(mx[0]):.2f}× here, {min(mx[1]):.2f}× to "
            f"{max(mx[1]):.2f}× in the repeat)",
            f"Row-wise FP8 ({runs[0][row]:.2f}× here, {runs[1][row]:.2f}× in the repeat) and NVFP4 "
            f"({runs[0][nv]:.2f}×, {runs[1][nv]:.2f}×) do not"]
    # and "both over 2x in both runs, by at most 0.06"
    assert min(runs[0][row], runs[1][row], runs[0][nv], runs[1][nv]) > 2.0
    assert max(runs[0][row], runs[1][row], runs[0][nv], runs[1][nv]) <= 2.06 + 1e-9


def repeat_sentence() -> str:
    """The quoted run's ResNet-50/8 cells against their repeat, from both files."""
    root = Path(__file__).resolve().parents[1]
    repeat = json.loads((root / FORMATS_BENCH.replace(".json", "-resnet-repeat.json")).read_text())
    assert "--rounds 15" in repeat["info"]["command"]
    ratios = [{m: v for m, v in run.items() if "(" not in m and m != "fp32"} for run in quoted_runs()]
    apart = max(abs(ratios[0][m] - ratios[1][m]) for m in ratios[0])
    over = sorted(m for m in ratios[0] if max(ratios[0][m], ratios[1][m]) > 2.0)
    return (f"A ResNet-only repeat right after, with 15 rounds instead of 5 (`-7-resnet-repeat`), gave every "
            f"emulated mode within {apart:.2f} of this run's ratio; over 2× in either: {', '.join(over)}")


def fourth_runs_sentence() -> str:
    """What the fourth run's three repeats gave ResNet-50/8, from their files."""
    root = Path(__file__).resolve().parents[1]
    runs = [json.loads((root / f"docs/benchmarks/cpu-2026-11-26-fused-formats-4{s}.json").read_text())
            for s in ("-first", "-glibc-defaults", "")]
    fused_rows = [{(r["model"], r["mode"]): r for r in d["rows"] if "(" not in r["mode"]} for d in runs]

    def span(rows: dict) -> str:
        v = [r["vs_fp32_cpu"] for (m, mode), r in rows.items() if m == "resnet50/8" and mode != "fp32"]
        return f"{min(v):.2f}× to {max(v):.2f}×"

    mx = [rows["resnet50/8", "mxfp8"]["step_ms_cpu"] for rows in fused_rows]
    slower = mx[0] / ((mx[1] + mx[2]) / 2) - 1
    mlp = [[r["vs_fp32_cpu"] for k, r in rows.items() if k[0] == "mlp 4x1024 b128" and "torchao" not in k[1]]
           for rows in fused_rows]
    agree = max(max(col) - min(col) for col in zip(*mlp, strict=True))
    assert agree < 0.05  # what the sentence says of the MLP
    return (f"ResNet-50/8's emulated modes cost {span(fused_rows[0])} FP32 in the first, {span(fused_rows[1])} in "
            f"the second and {span(fused_rows[2])} in the third; the first run's MXFP8 step ({mx[0]:.1f} ms) was "
            f"{slower:.0%} slower than the next two's ({mx[1]:.1f} and {mx[2]:.1f} ms), which neither repeat showed, "
            f"while mptrain's MLP ratios at batch 128 agree across the three within {agree:.2f}")



_PERF_BUCKETS = {  # perf's shared objects, by what runs there
    "libpython": "python", "libtorch_python": "python", "libtorch_cpu": "aten", "libc10": "aten",
    "libstdc++": "aten", ".main.so": "kernels", "[kernel.kallsyms]": "os", "libc.so": "os", "ld-linux": "os",
    "[JIT]": "jit",
}  # fmt: skip


def perf_gap_sentence(path: str = "docs/benchmarks/cpu-2026-11-26-resnet50-8-perf.txt") -> str:
    """The benchmark notes' sentence on what ResNet-50/8's MXFP8 step adds to FP32's, from perf's file:
    each shared object's share of a step, times the step, summed per kind, MXFP8 minus FP32."""
    text = (Path(__file__).resolve().parents[1] / path).read_text()
    ms: dict[str, dict[str, float]] = {}
    step: dict[str, float] = {}
    for section in text.split("\n## ")[1:]:
        mode = section.split("\n", 1)[0].strip()
        step[mode] = float(re.search(r"steps, ([\d.]+) ms a step", section).group(1))  # type: ignore[union-attr]
        ms[mode] = {}
        for pct, dso in re.findall(r"^\s*([\d.]+)%\s+(.+)$", section, re.M):
            kind = next(k for key, k in _PERF_BUCKETS.items() if key in dso)
            ms[mode][kind] = ms[mode].get(kind, 0.0) + float(pct) / 100 * step[mode]
    add = {k: ms["mxfp8"].get(k, 0.0) - ms["fp32"].get(k, 0.0) for k in _PERF_BUCKETS.values()}
    gap = step["mxfp8"] - step["fp32"]
    return (f"of the {gap:.0f} ms an MXFP8 step adds to FP32's {step['fp32']:.1f} ms, {add['python']:.0f} ms are "
            f"Python (the interpreter and its bindings: the layers' autograd functions, the quantizer wrappers, "
            f"torch.compile's wrapper around each call), {add['aten']:.0f} ms ATen and its dispatcher (the extra "
            f"ops, copies and pads), {add['os']:.0f} ms the OS and the allocator, and {add['kernels']:.0f} ms the "
            f"compiled quantizer kernels.")


def call_budget_sentence(path: str = "docs/benchmarks/cpu-2026-11-26-call-budget-3.json") -> str:
    """The benchmark notes' sentence on what 2x FP32 leaves ResNet-50/8's quantizer calls, from its data."""
    d = json.loads((Path(__file__).resolve().parents[1] / path).read_text())
    ms, floor, calls = d["step_ms_cpu"], d["floor"], d["quantizer_calls"]
    mode = d["mode"]
    alone = ms[f"{mode}, quantizers off"]
    # the data's own arithmetic, checked: budget = target x FP32 - the layers alone
    assert abs(d["budget_ms"] - (d["target_vs_fp32"] * ms["fp32"] - alone)) < 0.01
    assert abs(d["quantizers_in_step_ms"] - (ms[mode] - alone)) < 0.01
    within = d["quantizers_in_step_ms"] <= d["budget_ms"]
    return (f"the converted layers alone, with no call into a quantizer, cost {alone / ms['fp32']:.2f}× FP32, so at "
            f"{d['target_vs_fp32']:.0f}× the step's {calls} quantizer calls may take {d['budget_ms']:.1f} ms, "
            f"{1e3 * d['budget_ms'] / calls:.0f} µs a call; in the step they take {d['quantizers_in_step_ms']:.1f} ms, "
            f"{1e3 * d['quantizers_in_step_ms'] / calls:.0f} µs a call, {'within' if within else 'over'} the budget "
            f"(the step {ms[mode] / ms['fp32']:.2f}× FP32). With every call through torch.compile's entry instead "
            f"(`compiled_calls.through_dynamo`, in the same rounds) the step costs "
            f"{ms[f'{mode}, through dynamo']:.1f} ms, {ms[f'{mode}, through dynamo'] / ms['fp32']:.2f}× FP32. One "
            f"block of 32, repeated in a loop, costs {floor['fused_call_us']:.1f} µs a call through "
            "`compiled_calls._call` (a direct call) against "
            f"{floor['compiled_fn_us']:.1f} µs through torch.compile's entry")


def test_the_call_budget_in_prose_is_its_data() -> None:
    root = Path(__file__).resolve().parents[1]
    text = " ".join((root / "docs/benchmarks/README.md").read_text().split())
    assert call_budget_sentence() in text
    for name in ("call-budget", "call-budget-2"):  # the ones before
        d = json.loads((root / f"docs/benchmarks/cpu-2026-11-26-{name}.json").read_text())
        ms = d["step_ms_cpu"]
        assert f"{ms['mxfp8'] / ms['fp32']:.2f}× with the calls taking {d['quantizers_in_step_ms']:.1f} ms" in text


def test_the_perf_profile_in_prose_is_its_data() -> None:
    text = " ".join((Path(__file__).resolve().parents[1] / "docs/benchmarks/README.md").read_text().split())
    assert perf_gap_sentence() in text


def test_readme_quotes_the_formats_benchmark() -> None:
    root = Path(__file__).resolve().parents[1]
    data = json.loads((root / FORMATS_BENCH).read_text())
    ratio = {(r["model"], r["mode"]): r["vs_fp32_cpu"] for r in data["rows"]}
    mlp, big = "mlp 4x1024 b128", "mlp 4x1024 b1024"
    blocks = ("mxfp8", "mxfp6", "mxfp4", "nvfp4")
    r50 = [v for (model, mode), v in ratio.items() if model == "resnet50/8" and mode in blocks]
    eager = [v for (_, mode), v in ratio.items() if mode.endswith("(eager reference)")]
    quote = (f"{ratio[mlp, 'mxfp8']:.2f}× (mxfp8) and {ratio[mlp, 'nvfp4']:.2f}× (nvfp4) an FP32 step for a "
             f"Linear-heavy MLP at batch 128, {ratio[big, 'mxfp8']:.2f}× and {ratio[big, 'nvfp4']:.2f}× at batch 1024, "
             f"and {min(r50):.2f}× to {max(r50):.2f}× for ResNet-50/8")
    readme = " ".join((root / "README.md").read_text().split())
    assert quote in readme
    assert f"with the eager quantizers the same steps cost {min(eager):.2f}× to {max(eager):.2f}×" in readme


def avx512_phrases() -> list[str]:
    """docs/benchmarks/README.md's section on the AVX512-BF16 runs at 2ea7724: its table (this run, its
    ResNet repeat, the seventh run and its repeat on the same kind of CPU) and its sentences."""
    run, repeat = (keyed_rows(n) for n in AVX512_RUNS)
    seventh, seventh_repeat = (keyed_rows(f"cpu-2026-11-27-fused-formats-7{s}") for s in ("", "-resnet-repeat"))

    out = []
    for key, limit in FORMAT_TARGETS.items():
        now = [rows[key]["vs_fp32_cpu"] for rows in (run, repeat) if key in rows]
        met = "yes" if all(v <= limit for v in now) else "no"
        out.append(f"| {key[0]} | {key[1]} | ≤ {limit}× | {cell(run, key)} | {cell(repeat, key)} | "
                   f"{cell(seventh, key)} | {cell(seventh_repeat, key)} | {met} |")
    vs = [v for r in run.values() for v in r.get("vs_torchao_cpu", {}).values()]
    resnet = [k for k in FORMAT_TARGETS if k[0] == "resnet50/8"]
    under = [k for k in resnet if max(run[k]["vs_fp32_cpu"], repeat[k]["vs_fp32_cpu"]) <= FORMAT_TARGETS[k]]
    margin = min(FORMAT_TARGETS[k] - max(run[k]["vs_fp32_cpu"], repeat[k]["vs_fp32_cpu"]) for k in under
                 if k[1] != "fp8 hybrid rowwise")  # fmt: skip
    row, nv, fp32 = ("resnet50/8", "fp8 hybrid rowwise"), ("resnet50/8", "nvfp4"), ("mlp 4x1024 b128", "fp32")
    words = {5: "five", 6: "six", 7: "seven"}
    assert 0.0 <= FORMAT_TARGETS[row] - max(run[row]["vs_fp32_cpu"], repeat[row]["vs_fp32_cpu"]) < 0.01  # "no margin"
    out += [
        f"every mptrain mode is faster than torchao's emulated equivalent in the same run ({min(vs):.2f}× to "
        f"{max(vs):.2f}× of torchao's step time)",
        f"FP32's MLP cell at batch 128 spread {100 * run[fp32]['spread_cpu']:.0f}% ((max - min) / median of its "
        f"step times), and the MLP's ratios at batch 128 came out higher than the seventh run's (MXFP8 "
        f"{cell(run, ('mlp 4x1024 b128', 'mxfp8'))} against {cell(seventh, ('mlp 4x1024 b128', 'mxfp8'))})",
        f"ResNet-50/8 meets ≤ 2× in {words[len(under)]} of its {words[len(resnet)]} modes in both runs",
        f"the five others by {margin:.2f} or more",
        f"Row-wise FP8 measured {run[row]['vs_fp32_cpu']:.3f}× and {repeat[row]['vs_fp32_cpu']:.3f}×",
        f"NVFP4 measured {cell(run, nv)} and {cell(repeat, nv)}, over 2× in both runs, as in the seventh run and its "
        f"repeat ({cell(seventh, nv)}, {cell(seventh_repeat, nv)})",
        f"FP32's ResNet-50/8 step took {run['resnet50/8', 'fp32']['step_ms_cpu']:.1f} ms here and "
        f"{repeat['resnet50/8', 'fp32']['step_ms_cpu']:.1f} ms in the repeat",
        f"the NVFP4 step's {run[nv]['quantized_layers']} quantized convolutions",  # its one Linear is kept
    ]
    return out


def test_the_avx512_runs_in_prose_are_their_data() -> None:
    assert_in_notes(avx512_phrases())


CAPPED_RUNS = ("ed7ee59", "3936d8a")  # the reference's fallback, then the ISA in inductor's cache key


def capped_phrases() -> list[str]:
    """docs/benchmarks/README.md's section on this EPYC capped to AVX2: its table and its figures,
    beside the AVX2-only EPYC's ResNet-50/8 runs (every file of that machine with the cells)."""
    before, after = ({r["mode"]: r for r in benchmark(f"cpu-2026-11-29-avx512-capped-avx2-resnet-{c}")["rows"]}
                     for c in CAPPED_RUNS)  # fmt: skip
    info = [benchmark(f"cpu-2026-11-29-avx512-capped-avx2-resnet-{c}")["info"] for c in CAPPED_RUNS]
    assert info[0]["quantizers"].startswith("reference") and info[1]["quantizers"] == "fused"
    assert {i["cpu_capability"] for i in info} == {"AVX2"} and all("capped" in i["capability_detail"] for i in info)
    emulated = [m for m in after if m != "fp32"]
    out = [f"| {m} | {before[m]['vs_fp32_cpu']:.2f}× | {after[m]['vs_fp32_cpu']:.2f}× | "
           f"{after[m]['gap']['quantizers_ms']:.1f} ({after[m]['gap']['quantizer_calls']}) | "
           f"{after[m]['compile_s']:.1f} |" for m in emulated]  # fmt: skip
    ref = [before[m]["vs_fp32_cpu"] for m in emulated]
    fused = [after[m]["vs_fp32_cpu"] for m in emulated]
    assert max(fused) <= 2.0  # "every mode is fused and under 2x"
    avx2 = []  # the AVX2-only EPYC's runs of ResNet-50/8's NVFP4 cell
    for path in sorted((Path(__file__).resolve().parents[1] / "docs/benchmarks").glob("cpu-2026-11-2?-avx2-*.json")):
        rows = json.loads(path.read_text()).get("rows")
        if isinstance(rows, list) and rows and isinstance(rows[0], dict) and "mode" in rows[0]:
            cells = {(r["model"], r["mode"]): r for r in rows}
            if ("resnet50/8", "nvfp4") in cells:
                avx2.append((cells["resnet50/8", "fp32"]["step_ms_cpu"], cells["resnet50/8", "nvfp4"]["vs_fp32_cpu"]))
    words = {5: "five", 8: "eight"}
    over = sum(v > 2.0 for _, v in avx2)
    out += [
        f"`quantizers: {info[0]['quantizers']}`",
        f"at {min(ref):.2f}× to {max(ref):.2f}× FP32's step",
        f"every mode is fused and under 2×**: {min(fused):.2f}× to {max(fused):.2f}×, "
        f"NVFP4 {after['nvfp4']['vs_fp32_cpu']:.2f}×",
        f"NVFP4's warm-up spent {after['nvfp4']['compile_s']:.1f} s compiling",
        f"step took {after['fp32']['step_ms_cpu']:.1f} ms here against {min(f for f, _ in avx2):.1f} to "
        f"{max(f for f, _ in avx2):.1f} ms there",
        f"over 2× in {words[over]} of its {words[len(avx2)]} runs",
    ]
    return out


def test_the_capped_avx2_runs_in_prose_are_their_data() -> None:
    assert_in_notes(capped_phrases())


LATEST_RUNS = ("cpu-2026-11-29-avx512-formats-bdfab33", "cpu-2026-11-29-avx512-resnet-bdfab33")


def latest_phrases() -> list[str]:
    """docs/benchmarks/README.md's section on every target again at bdfab33: its table (the run, its
    ResNet repeat, and 2ea7724's two beside them) and its figures."""
    run, repeat = (keyed_rows(n) for n in LATEST_RUNS)
    then, then_repeat = (keyed_rows(n) for n in AVX512_RUNS)

    out = []
    for key, limit in FORMAT_TARGETS.items():
        now = [rows[key]["vs_fp32_cpu"] for rows in (run, repeat) if key in rows]
        met = "yes" if all(v <= limit for v in now) else "no"
        out.append(f"| {key[0]} | {key[1]} | ≤ {limit}× | {cell(run, key)} | {cell(repeat, key)} | "
                   f"{cell(then, key)} | {cell(then_repeat, key)} | {met} |")
    assert all(row.endswith("| yes |") for row in out)  # "every target met in both runs"
    vs = [v for r in run.values() for v in r.get("vs_torchao_cpu", {}).values()]
    resnet = [v for rows in (run, repeat) for (m, mode), r in rows.items() if m == "resnet50/8" and mode != "fp32"
              for v in [r["vs_fp32_cpu"]]]  # fmt: skip
    small = [r["vs_fp32_cpu"] for (m, mode), r in run.items() if m == "resnet50/8 b2" and mode != "fp32"]
    nv, row = ("resnet50/8", "nvfp4"), ("resnet50/8", "fp8 hybrid rowwise")
    out += [
        f"faster than torchao's emulated equivalent in the same run ({min(vs):.2f}× to {max(vs):.2f}× of "
        f"torchao's step time)",
        f"ResNet-50/8's seven modes measured {min(resnet):.2f}× to {max(resnet):.2f}× FP32 over the two runs",
        f"NVFP4 {cell(run, nv)} and {cell(repeat, nv)} (2ea7724: {cell(then, nv)} and {cell(then_repeat, nv)})",
        f"row-wise FP8 {cell(run, row)} and {cell(repeat, row)} (2ea7724: {cell(then, row)} and "
        f"{cell(then_repeat, row)})",
        f"FP32's ResNet-50/8 step took {run['resnet50/8', 'fp32']['step_ms_cpu']:.1f} ms and "
        f"{repeat['resnet50/8', 'fp32']['step_ms_cpu']:.1f} ms",
        f"at batch 2 (`resnet50/8 b2`, not a target cell) the emulated modes cost {min(small):.2f}× to "
        f"{max(small):.2f}× FP32",
    ]
    return out


def test_the_latest_runs_in_prose_are_their_data() -> None:
    assert_in_notes(latest_phrases())
    run, repeat = (keyed_rows(n) for n in LATEST_RUNS)
    resnet = [r["vs_fp32_cpu"] for rows in (run, repeat) for (m, mode), r in rows.items()
              if m == "resnet50/8" and mode != "fp32"]  # fmt: skip
    nv = [rows["resnet50/8", "nvfp4"]["vs_fp32_cpu"] for rows in (run, repeat)]
    assert_in_notes([f"(ResNet-50/8 {min(resnet):.2f}× to {max(resnet):.2f}× FP32, NVFP4 {nv[0]:.2f}× and "
                     f"{nv[1]:.2f}×)"], "README.md")


# The Xeon with AMX: every cell before vector_bitcasts (a14e134), then after it (1df06b2) and its ResNet repeat
AMX_RUNS = ("cpu-2026-11-29-amx-formats-a14e134", "cpu-2026-11-29-amx-formats-1df06b2",
            "cpu-2026-11-29-amx-resnet-1df06b2")


def amx_phrases() -> list[str]:
    """docs/benchmarks/README.md's section on the Xeon with AMX: its table (before, after, the repeat)
    and its figures, against the EPYC's run at bdfab33 where it compares them."""
    before, after, repeat = (keyed_rows(n) for n in AMX_RUNS)
    epyc = keyed_rows(LATEST_RUNS[0])

    def q(rows: dict[tuple[str, str], dict[str, Any]], key: tuple[str, str]) -> str:
        return f"{rows[key]['gap']['quantizers_ms']:.1f} ms"

    out, missed_before, met_after = [], 0, 0
    for key, limit in FORMAT_TARGETS.items():
        now = [rows[key]["vs_fp32_cpu"] for rows in (after, repeat) if key in rows]
        met = all(v <= limit for v in now)
        missed_before += before[key]["vs_fp32_cpu"] > limit
        met_after += met
        out.append(f"| {key[0]} | {key[1]} | ≤ {limit}× | {cell(before, key)} | {cell(after, key)} | "
                   f"{cell(repeat, key)} | {'yes' if met else 'no'} |")
    mx8, mx8_big, hyb = ("mlp 4x1024 b128", "mxfp8"), ("mlp 4x1024 b1024", "mxfp8"), ("mlp 4x1024 b128", "fp8 hybrid")
    nv, row, res = ("resnet50/8", "nvfp4"), ("resnet50/8", "fp8 hybrid rowwise"), ("resnet50/8", "mxfp8")
    f32 = ("mlp 4x1024 b128", "fp32"), ("mlp 4x1024 b1024", "fp32"), ("resnet50/8", "fp32")
    bf = [(m, f"{b} bf16") for m in ("mlp 4x1024 b128", "mlp 4x1024 b1024") for b in ("amp", "mxfp8")]
    out += [
        f"missed {missed_before} of its {len(FORMAT_TARGETS)} targets",
        f"MXFP8's quantizers took {q(before, mx8)} of the MLP's step at batch 128 (the EPYC's: {q(epyc, mx8)}) "
        f"and {q(before, mx8_big)} at batch 1024 (the EPYC's: {q(epyc, mx8_big)})",
        f"{q(after, mx8)} and {q(after, mx8_big)}",
        f"met {met_after} of the {len(FORMAT_TARGETS)} targets in both runs",
        f"FP8 hybrid at batch 128 ({cell(after, hyb)}; its quantizers {q(after, hyb)}, the EPYC's {q(epyc, hyb)})",
        f"row-wise FP8 ({cell(after, row)} and {cell(repeat, row)}) and NVFP4 ({cell(after, nv)} and "
        f"{cell(repeat, nv)}) on ResNet-50/8",
        "FP32's step took " + ", ".join(f"{after[k]['step_ms_cpu']:.1f} ms" for k in f32)
        + " here (MLP at batch 128 and 1024, ResNet-50/8) and "
        + ", ".join(f"{epyc[k]['step_ms_cpu']:.1f} ms" for k in f32) + " on the EPYC",
        f"MXFP8's step on ResNet-50/8 spent {q(after, res)} in its quantizers and "
        f"{after[res]['gap']['other_ms']:.1f} ms in the rest of its gap (the EPYC's: {q(epyc, res)} and "
        f"{epyc[res]['gap']['other_ms']:.1f} ms)",
        "bf16 autocast costs " + " and ".join(cell(after, k) for k in bf[0::2]) + " of FP32's step on the MLP, and "
        "MXFP8 with bf16 products " + " and ".join(cell(after, k) for k in bf[1::2]),
        f"On ResNet-50/8 bf16 autocast measured {cell(after, ('resnet50/8', 'amp bf16'))} and "
        f"{cell(repeat, ('resnet50/8', 'amp bf16'))}, and MXFP8 with bf16 products "
        f"{cell(after, ('resnet50/8', 'mxfp8 bf16'))} and {cell(repeat, ('resnet50/8', 'mxfp8 bf16'))}",
    ]
    return out


def test_the_amx_runs_in_prose_are_their_data() -> None:
    assert_in_notes(amx_phrases())
    before, after, repeat = (keyed_rows(n) for n in AMX_RUNS)
    missed = sum(before[k]["vs_fp32_cpu"] > v for k, v in FORMAT_TARGETS.items())
    met = sum(all(r[k]["vs_fp32_cpu"] <= v for r in (after, repeat) if k in r) for k, v in FORMAT_TARGETS.items())
    n, bf = len(FORMAT_TARGETS), after["mlp 4x1024 b1024", "mxfp8 bf16"]["vs_fp32_cpu"]
    assert_in_notes([f"{missed} of {n} targets missed before `compiled_calls.vector_bitcasts`, {met} of {n} met "
                     "after it. With AMX, MXFP8 with bf16 products (`precision.emulated_compute=bf16`) took "
                     f"{bf:.2f}× FP32's step on the MLP at batch 1024"], "README.md")


# The Xeon with AMX again: every cell after stochastic rounding's kernels were cut down (fc8413e), its
# ResNet repeat, and ResNet-50/8 with the ISA capped to AVX2 before (07ca3d5) and after
AMX_SR_RUNS = ("cpu-2026-11-30-amx-formats-fc8413e", "cpu-2026-11-30-amx-resnet-fc8413e")
AMX_CAPPED_RUNS = ("cpu-2026-11-30-amx-capped-avx2-resnet-07ca3d5", "cpu-2026-11-30-amx-capped-avx2-resnet-fc8413e")
SLOW_HOST_RUN = "cpu-2026-11-30-slow-host-formats-d1bab46"  # the same VM and kernels as AMX_SR_RUNS, later


def amx_sr_phrases() -> list[str]:
    """docs/benchmarks/README.md's section on the Xeon with AMX after fc8413e: its table (1df06b2 and
    its repeat, fc8413e and its repeat) and its figures."""
    before, before_repeat = keyed_rows(AMX_RUNS[1]), keyed_rows(AMX_RUNS[2])
    after, repeat = (keyed_rows(n) for n in AMX_SR_RUNS)
    capped_before, capped_after = (keyed_rows(n) for n in AMX_CAPPED_RUNS)

    out, met_after, missed = [], 0, []
    for key, limit in FORMAT_TARGETS.items():
        met = all(rows[key]["vs_fp32_cpu"] <= limit for rows in (after, repeat) if key in rows)
        met_after += met
        if not met:
            missed.append(key)
        out.append(f"| {key[0]} | {key[1]} | ≤ {limit}× | {cell(before, key)} | {cell(before_repeat, key)} | "
                   f"{cell(after, key)} | {cell(repeat, key)} | {'yes' if met else 'no'} |")
    hyb, hyb_big = ("mlp 4x1024 b128", "fp8 hybrid"), ("mlp 4x1024 b1024", "fp8 hybrid")
    nv, row = ("resnet50/8", "nvfp4"), ("resnet50/8", "fp8 hybrid rowwise")
    f32 = [("mlp 4x1024 b128", "fp32"), ("resnet50/8", "fp32")]
    gap = after[hyb]["gap"]
    out += [
        f"met {met_after} of the {len(FORMAT_TARGETS)} targets in both runs",
        f"FP8 hybrid at batch 128 ({cell(after, hyb)}), row-wise FP8 ({cell(after, row)} and "
        f"{cell(repeat, row)}) and NVFP4 ({cell(after, nv)} and {cell(repeat, nv)}) on ResNet-50/8",
        f"quantizers took {gap['quantizers_ms']:.1f} ms of its {gap['gap_ms']:.1f} ms gap to FP32 "
        f"({before[hyb]['gap']['quantizers_ms']:.1f} ms of {before[hyb]['gap']['gap_ms']:.1f} ms at 1df06b2), "
        f"in {after[hyb]['gap']['quantizer_calls']} calls",
        f"At batch 1024 the same mode measured {cell(before, hyb_big)} at 1df06b2 and {cell(after, hyb_big)} at "
        "fc8413e",
        "took " + " and ".join(f"{before[k]['step_ms_cpu']:.1f} ms" for k in f32) + " at 1df06b2, "
        + " and ".join(f"{after[k]['step_ms_cpu']:.1f} ms" for k in f32) + " at fc8413e",
        f"row-wise FP8 {cell(capped_before, row)} and NVFP4 {cell(capped_before, nv)} at 07ca3d5, and "
        f"{cell(capped_after, row)} and {cell(capped_after, nv)} at fc8413e",
    ]
    return out


def test_the_amx_runs_after_fc8413e_in_prose_are_their_data() -> None:
    assert_in_notes(amx_sr_phrases())
    # "Every ResNet-50/8 mode measured lower than at 1df06b2": each run against its counterpart
    runs = [(keyed_rows(a), keyed_rows(b)) for a, b in zip(AMX_RUNS[1:], AMX_SR_RUNS, strict=True)]
    for before, after in runs:
        for key in (k for k in FORMAT_TARGETS if k[0] == "resnet50/8"):
            assert after[key]["vs_fp32_cpu"] < before[key]["vs_fp32_cpu"], key
    after, repeat = (keyed_rows(n) for n in AMX_SR_RUNS)
    met = sum(all(r[k]["vs_fp32_cpu"] <= v for r in (after, repeat) if k in r) for k, v in FORMAT_TARGETS.items())
    hyb = after["mlp 4x1024 b128", "fp8 hybrid"]["vs_fp32_cpu"]
    assert_in_notes([f"{met} of {len(FORMAT_TARGETS)} targets met in both runs, as before; FP8 hybrid at batch "
                     f"128 measured {hyb:.2f}×, against ≤ 1.6×"], "README.md")
    # the capped runs are the AVX2 path of this CPU
    assert {benchmark(n)["info"]["cpu_capability"] for n in AMX_CAPPED_RUNS} == {"AVX2"}


def test_the_sr_kernels_side_by_side_in_prose_are_their_data() -> None:
    rows = {r["kind"].split(" (")[1].rstrip(")"): r for r in benchmark("cpu-2026-11-30-amx-sr-kernels")["rows"]}
    grad, small, master = rows["a weight gradient"], rows["an activation gradient"], rows["a master weight"]

    def ms(row: dict[str, Any]) -> str:
        return f"{row['ms_cpu']['before']:.3f} ms"

    assert_in_notes([
        f"1M weight gradient took {ms(grad)} before and {grad['ms_cpu']['after']:.3f} ms after "
        f"({grad['after_vs_before']:.2f}×), of a 128K activation gradient {small['after_vs_before']:.2f}×; the FP16 "
        f"master weight's write-back in place {ms(master)} and {master['ms_cpu']['after']:.3f} ms "
        f"({master['after_vs_before']:.2f}×)",
    ])
    assert all(r["after_vs_before"] < 1 for r in rows.values())


def test_the_slow_host_run_in_prose_is_its_data() -> None:
    """docs/benchmarks/README.md's section on the Xeon two hours later: its table (fc8413e, its repeat,
    the slower host's run) and its figures."""
    after, repeat = (keyed_rows(n) for n in AMX_SR_RUNS)
    slow = keyed_rows(SLOW_HOST_RUN)

    rows, met = [], 0
    for key, limit in FORMAT_TARGETS.items():
        ok = slow[key]["vs_fp32_cpu"] <= limit
        met += ok
        rows.append(f"| {key[0]} | {key[1]} | ≤ {limit}× | {cell(after, key)} | {cell(repeat, key)} | "
                    f"{cell(slow, key)} | {'yes' if ok else 'no'} |")
        # "Every ratio in the table rose"
        assert all(slow[key]["vs_fp32_cpu"] > r[key]["vs_fp32_cpu"] for r in (after, repeat) if key in r), key
    f32 = [("mlp 4x1024 b128", "fp32"), ("resnet50/8", "fp32")]
    nv = slow["resnet50/8", "nvfp4"]["gap"]
    spread = slow["mlp 4x1024 b128", "fp32"]["spread_cpu"]
    assert_in_notes([
        *rows,
        "FP32's steps took " + " and ".join(f"{slow[k]['step_ms_cpu']:.1f} ms" for k in f32)
        + " (MLP at batch 128, ResNet-50/8), against " + " and ".join(f"{after[k]['step_ms_cpu']:.1f} ms" for k in f32)
        + f" at fc8413e. FP32's own step times at batch 128 spread by {100 * spread:.0f}% of their median.",
        f"**{met} of the {len(FORMAT_TARGETS)} targets met in this run**",
        f"the NVFP4 ResNet-50/8 gap was {nv['gap_ms']:.1f} ms here (quantizers {nv['quantizers_ms']:.1f} ms, the "
        f"rest {nv['other_ms']:.1f} ms)",
    ])
    words = {5: "five", 6: "six", 7: "seven", 8: "eight", 9: "nine"}
    assert_in_notes([f"two hours later, its host slower, {words[len(FORMAT_TARGETS) - met]} were not with the same "
                     "kernels"])
    res = [rows[("resnet50/8", "fp32")]["step_ms_cpu"] for rows in (slow, after)]
    assert_in_notes([f"(FP32's ResNet-50/8 step {res[0]:.1f} ms, against {res[1]:.1f} ms): {met} of "
                     f"{len(FORMAT_TARGETS)} targets met"], "README.md")
    # the same VM and library as AMX_SR_RUNS: the CPU and torch it names are theirs
    infos = [benchmark(n)["info"] for n in (*AMX_SR_RUNS, SLOW_HOST_RUN)]
    assert len({(i["device_name"], i["cpu_capability"], i["versions"]["torch"]) for i in infos}) == 1


GEMM_1X1_RUN = "cpu-2026-11-30-amx-formats-9e26266"  # after 1x1 convolutions became GEMMs (180d5de)


def gemm_1x1_run_phrases() -> list[str]:
    """docs/benchmarks/README.md's every-cell run on the Xeon after 180d5de: its table and figures."""
    after, repeat = (keyed_rows(n) for n in AMX_SR_RUNS)
    slow, now = keyed_rows(SLOW_HOST_RUN), keyed_rows(GEMM_1X1_RUN)
    rows, met, missed = [], 0, []
    for key, limit in FORMAT_TARGETS.items():
        ok = now[key]["vs_fp32_cpu"] <= limit
        met += ok
        if not ok:
            missed.append(key)
        rows.append(f"| {key[0]} | {key[1]} | ≤ {limit}× | {cell(after, key)} | {cell(repeat, key)} | "
                    f"{cell(slow, key)} | {cell(now, key)} | {'yes' if ok else 'no'} |")
    names = {"fp8 hybrid": "FP8 hybrid", "fp8 hybrid rowwise": "row-wise FP8", "nvfp4": "NVFP4"}
    models = {"mlp 4x1024 b128": "the MLP at batch 128", "resnet50/8": "ResNet-50/8"}
    f32 = [("mlp 4x1024 b128", "fp32"), ("resnet50/8", "fp32")]
    nv = now["resnet50/8", "nvfp4"]["gap"]
    return [
        *rows,
        "FP32's steps took " + " and ".join(f"{now[k]['step_ms_cpu']:.1f} ms" for k in f32)
        + " (MLP at batch 128, ResNet-50/8), against " + " and ".join(f"{after[k]['step_ms_cpu']:.1f} ms" for k in f32)
        + " at fc8413e and " + " and ".join(f"{slow[k]['step_ms_cpu']:.1f} ms" for k in f32) + " at d1bab46",
        f"**{met} of the {len(FORMAT_TARGETS)} targets met in this run**",
        f"(load average {benchmark(GEMM_1X1_RUN)['info']['load_average_start'][0]} at its start)",
        "missed: " + ", ".join(f"{names[k[1]]} on {models[k[0]]} ({cell(now, k)})" for k in missed),
        f"the NVFP4 ResNet-50/8 gap was {nv['gap_ms']:.1f} ms (quantizers {nv['quantizers_ms']:.1f} ms, the rest "
        f"{nv['other_ms']:.1f} ms)",
    ]


def test_the_run_after_1x1_gemms_in_prose_is_its_data() -> None:
    assert_in_notes(gemm_1x1_run_phrases())
    after, repeat = (keyed_rows(n) for n in AMX_SR_RUNS)
    now = keyed_rows(GEMM_1X1_RUN)
    # "The same three as at fc8413e"
    assert ([k for k, v in FORMAT_TARGETS.items() if not all(r[k]["vs_fp32_cpu"] <= v for r in (after, repeat)
                                                              if k in r)]
            == [k for k, v in FORMAT_TARGETS.items() if now[k]["vs_fp32_cpu"] > v])
    # "faster than in any earlier run of the formats benchmark on this Xeon": FP32's steps (uncapped runs)
    runs = [keyed_rows(n) for n in (*AMX_RUNS, *AMX_SR_RUNS, SLOW_HOST_RUN)]
    for key in (("mlp 4x1024 b128", "fp32"), ("resnet50/8", "fp32")):
        earlier = [r[key]["step_ms_cpu"] for r in runs if key in r]
        assert len(earlier) >= 3 and now[key]["step_ms_cpu"] < min(earlier), key
    met = sum(now[k]["vs_fp32_cpu"] <= v for k, v in FORMAT_TARGETS.items())
    assert_in_notes([f"on a faster host: {met} of {len(FORMAT_TARGETS)} targets met, the same three missed as before"],
                    "README.md")
    # "every ResNet-50/8 ratio is above fc8413e's"
    assert all(now[k]["vs_fp32_cpu"] > after[k]["vs_fp32_cpu"] for k in FORMAT_TARGETS if k[0] == "resnet50/8")
    infos = [benchmark(n)["info"] for n in (*AMX_SR_RUNS, SLOW_HOST_RUN, GEMM_1X1_RUN)]
    assert len({(i["device_name"], i["cpu_capability"], i["versions"]["torch"]) for i in infos}) == 1


BATCH_GEMM_RUNS = ("cpu-2026-11-30-amx-formats-294d7ed", "cpu-2026-11-30-amx-resnet-294d7ed")  # after 294d7ed


def batch_gemm_run_phrases() -> list[str]:
    """docs/benchmarks/README.md's two runs after 294d7ed: the table against 9e26266's run, its figures."""
    prev = keyed_rows(GEMM_1X1_RUN)
    runs = [keyed_rows(n) for n in BATCH_GEMM_RUNS]
    rows, met, missed = [], 0, []
    for key, limit in FORMAT_TARGETS.items():
        ok = all(r[key]["vs_fp32_cpu"] <= limit for r in runs if key in r)
        met += ok
        if not ok:
            missed.append(key)
        rows.append(f"| {key[0]} | {key[1]} | ≤ {limit}× | {cell(prev, key)} | {cell(runs[0], key)} | "
                    f"{cell(runs[1], key)} | {'yes' if ok else 'no'} |")
    f32 = ("resnet50/8", "fp32")
    nv, hyb = ("resnet50/8", "nvfp4"), ("mlp 4x1024 b128", "fp8 hybrid")
    assert missed == [hyb, nv]
    return [
        *rows,
        f"**{met} of the {len(FORMAT_TARGETS)} targets met in both runs**",
        f"FP8 hybrid on the MLP at batch 128 ({cell(runs[0], hyb)}) and NVFP4 on ResNet-50/8 ({cell(runs[0], nv)} "
        f"and {cell(runs[1], nv)})",
        "FP32's ResNet-50/8 step took " + " and ".join(f"{r[f32]['step_ms_cpu']:.1f} ms" for r in runs),
        "load average " + " and ".join(f"{benchmark(n)['info']['load_average_start'][0]}" for n in BATCH_GEMM_RUNS)
        + " at their starts",
        "NVFP4's ResNet-50/8 gap was {gap_ms:.1f} ms, quantizers {quantizers_ms:.1f} ms ({quantizer_calls} calls) and "
        "the rest {other_ms:.1f} ms".format(**runs[0][nv]["gap"]),
        "FP8 hybrid's MLP gap at batch 128 was {gap_ms:.1f} ms, quantizers {quantizers_ms:.1f} ms ({quantizer_calls} "
        "calls)".format(**runs[0][hyb]["gap"]),
        # "Where they stand", at the section's head
        f"after one GEMM over the batch on small maps {['none', 'one', 'two', 'three'][len(missed)]} were not, in "
        "both runs",
    ]


def test_the_runs_after_batch_gemms_in_prose_are_their_data() -> None:
    assert_in_notes(batch_gemm_run_phrases())
    # "Row-wise FP8 on ResNet-50/8 met it in both runs here for the first time on this Xeon"
    row = ("resnet50/8", "fp8 hybrid rowwise")
    earlier = [keyed_rows(n) for n in (*AMX_RUNS, *AMX_SR_RUNS, *AMX_CAPPED_RUNS, SLOW_HOST_RUN, GEMM_1X1_RUN)]
    assert all(r[row]["vs_fp32_cpu"] > 2.0 for r in earlier if row in r)
    runs = [keyed_rows(n) for n in BATCH_GEMM_RUNS]
    assert all(r[row]["vs_fp32_cpu"] <= 2.0 for r in runs)
    met = sum(all(r[k]["vs_fp32_cpu"] <= v for r in runs if k in r) for k, v in FORMAT_TARGETS.items())
    assert_in_notes([f"{met} of {len(FORMAT_TARGETS)} targets met in both runs after it"], "README.md")


CAPPED_BATCH_GEMM_RUN = "cpu-2026-11-30-amx-capped-avx2-resnet-5b1094d"


def test_the_capped_runs_after_batch_gemms_in_prose_are_their_data() -> None:
    """docs/benchmarks/README.md's capped runs at 5b1094d: the ResNet-50/8 table against the two
    earlier capped runs, and the side-by-side figures."""
    runs = [keyed_rows(n) for n in (*AMX_CAPPED_RUNS, CAPPED_BATCH_GEMM_RUN)]
    modes = [m for (model, m) in FORMAT_TARGETS if model == "resnet50/8"]
    rows = [f"| {m} | " + " | ".join(cell(r, ("resnet50/8", m)) for r in runs) + " |" for m in modes]
    now = runs[-1]
    missed = [m for m in modes if now["resnet50/8", m]["vs_fp32_cpu"] > 2.0]
    assert missed == ["nvfp4"]  # "every other mode met its target"
    side = {r["mode"]: r for r in benchmark("cpu-2026-11-30-amx-capped-avx2-pointwise-5b1094d")["rows"]}
    per_tensor = ("fp8 hybrid", "fp8 hybrid tensor")
    gains = [r["gemm_vs_conv"] for m, r in side.items() if m not in per_tensor]
    assert max(gains) == side["nvfp4"]["gemm_vs_conv"]  # "NVFP4 the least gain"
    control = sorted(side[m]["gemm_vs_conv"] for m in per_tensor)
    assert {benchmark(n)["info"]["cpu_capability"] for n in (CAPPED_BATCH_GEMM_RUN,
            "cpu-2026-11-30-amx-capped-avx2-pointwise-5b1094d")} == {"AVX2"}
    assert_in_notes([
        *rows,
        f"the qgemm modes took {min(gains):.3f}× to {max(gains):.3f}× as long with the GEMMs as with the convolutions, "
        f"NVFP4 the least gain ({side['nvfp4']['gemm_vs_conv']:.3f}×); the per-tensor control {control[0]:.3f}× and "
        f"{control[1]:.3f}×",
        f"NVFP4 measured {cell(now, ('resnet50/8', 'nvfp4'))} (just over ≤ 2×)",
        "(load average {} and {} at their starts; nothing else running)".format(*(
            benchmark(n)["info"]["load_average_start"][0]
            for n in ("cpu-2026-11-30-amx-capped-avx2-pointwise-5b1094d", CAPPED_BATCH_GEMM_RUN))),
    ])
