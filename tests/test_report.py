"""mptrain-report: a real local multirun read back, and the comparison arithmetic on known summaries."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Any

import pytest
from conftest import run_cli, tiny

from mptrain import report

pytest.importorskip("matplotlib")


def read_csv(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def test_multirun_then_report(tmp_path, capsys):
    sweep = tmp_path / "sweep"
    r = run_cli("-m", *tiny("resnet50"), "trainer.max_steps=2", "precision=fp32,amp_bf16", f"hydra.sweep.dir={sweep}")
    assert r.returncode == 0, r.stderr[-2000:]

    # Each job got its own run dir, with its own summary and TensorBoard events.
    summaries = {p.parent.name: json.loads(p.read_text()) for p in sweep.glob("*/summary.json")}
    assert set(summaries) == {"0-resnet50-fp32", "1-resnet50-amp_bf16"}
    for name, s in summaries.items():
        assert s["status"] == "completed" and s["steps"] == 2
        assert Path(s["run_dir"]).name == name
        assert list((sweep / name).glob("events.out.tfevents.*"))
    fp32, bf16 = summaries["0-resnet50-fp32"], summaries["1-resnet50-amp_bf16"]

    assert report.main([str(sweep)]) == 0  # --out defaults to the first dir
    printed = capsys.readouterr().out
    assert "mptrain-report: 2 runs" in printed and "amp_bf16" in printed
    for name in ("report.md", "report.csv", "report.png"):
        assert (sweep / name).stat().st_size > 0

    rows = {row["precision"]: row for row in read_csv(sweep / "report.csv")}
    assert list(rows) == ["fp32", "amp_bf16"]  # the baseline first
    row = rows["amp_bf16"]
    assert row["model"] == "resnet50" and row["data"] == "synthetic" and row["precision_resolved"] == "amp_bf16"
    assert row["loss_scale"] == bf16["loss_scale"] and row["status"] == "completed"
    assert row["metric"] == "top1"
    assert float(row["value"]) == pytest.approx(bf16["metrics"]["top1"])
    assert float(row["diff_vs_fp32"]) == pytest.approx(bf16["metrics"]["top1"] - fp32["metrics"]["top1"])
    assert float(row["throughput"]) == pytest.approx(bf16["throughput"])
    assert float(row["speedup"]) == pytest.approx(bf16["throughput"] / fp32["throughput"])
    assert int(row["skipped_steps"]) == bf16["skipped_steps"]
    assert row["memory_ratio"] == ""  # CPU: no peak memory
    assert Path(row["baseline"]).name == "0-resnet50-fp32"
    assert float(rows["fp32"]["speedup"]) == pytest.approx(1.0)
    assert float(rows["fp32"]["diff_vs_fp32"]) == 0.0

    md = (sweep / "report.md").read_text().splitlines()
    assert md[0].startswith("| model | data | precision | loss scale | metric | Δ vs fp32 | throughput | speedup")
    bf16_line = next(line for line in md if "amp_bf16" in line)
    assert f"| {bf16['throughput'] / fp32['throughput']:.2f}× |" in bf16_line

    # --out elsewhere; the loss curves come from the TensorBoard events.
    out = tmp_path / "out"
    assert report.main([str(sweep / "0-resnet50-fp32"), str(sweep / "1-resnet50-amp_bf16"), "--out", str(out)]) == 0
    assert read_csv(out / "report.csv") == read_csv(sweep / "report.csv")
    curves = report.read_curves(sweep / "1-resnet50-amp_bf16")
    assert [s for s, _ in curves["train/loss"]] == [1, 2]
    assert curves["train/loss"][-1][1] == pytest.approx(bf16["final_loss"], rel=1e-6)
    assert curves["train/loss_scale"][-1][1] == bf16["final_loss_scale"]


# ------------------------------------------------------------------------------------ arithmetic


def fake_run(root: Path, name: str, *, model: str, precision: str, top1: float, throughput: float,
             memory: int | None, resolved: str | None = None, **extra: Any) -> Path:
    from torch.utils.tensorboard import SummaryWriter

    d = root / name
    d.mkdir(parents=True)
    summary = {
        "status": "completed", "model": model, "data": "synthetic", "precision": precision,
        "precision_resolved": resolved or precision, "loss_scale": "dynamic" if precision != "fp32" else "none",
        "device": "cuda:0", "world_size": 1, "steps": 3, "final_loss": 1.5,
        "metrics": {"top1": top1, "top5": 90.0, "loss": 1.2}, "primary_metric": "top1",
        "throughput": throughput, "throughput_unit": "samples", "peak_memory_bytes": memory,
        "skipped_steps": 1, "final_loss_scale": 32768.0, "wall_time_s": 1.0, "run_dir": str(d), **extra,
    }
    (d / "summary.json").write_text(json.dumps(summary))
    w = SummaryWriter(log_dir=str(d))
    for step, (loss, scale) in enumerate([(2.0, 65536.0), (1.8, 32768.0), (1.5, 32768.0)], start=1):
        w.add_scalar("train/loss", loss, step)
        w.add_scalar("train/loss_scale", scale, step)
    w.close()
    return d


def test_comparison_against_the_fp32_run_of_the_same_model(tmp_path):
    sweep = tmp_path / "sweep"
    fake_run(sweep, "0", model="resnet50", precision="fp32", top1=75.92, throughput=100.0, memory=8_000)
    fake_run(sweep, "1", model="resnet50", precision="mixed", top1=76.04, throughput=250.0, memory=5_000,
             resolved="amp_fp16")
    fake_run(sweep, "2", model="vgg16", precision="fp32", top1=71.0, throughput=50.0, memory=10_000)
    fake_run(sweep, "3", model="vgg16", precision="mixed", top1=70.5, throughput=80.0, memory=6_000,
             resolved="amp_fp16")
    fake_run(sweep, "4", model="alexnet", precision="mixed", top1=56.9, throughput=900.0, memory=1_000)

    rows = report.build_rows(report.load_runs(report.find_summaries([sweep])))
    by = {(r["model"], r["precision"]): r for r in rows}
    r = by["resnet50", "mixed"]
    assert r["diff_vs_fp32"] == pytest.approx(76.04 - 75.92)
    assert r["speedup"] == pytest.approx(2.5)
    assert r["memory_ratio"] == pytest.approx(5_000 / 8_000)
    v = by["vgg16", "mixed"]  # its own model's baseline, not resnet50's
    assert v["diff_vs_fp32"] == pytest.approx(-0.5)
    assert v["speedup"] == pytest.approx(1.6)
    assert v["memory_ratio"] == pytest.approx(0.6)
    a = by["alexnet", "mixed"]  # no fp32 run: nothing to compare with
    assert a["diff_vs_fp32"] is None and a["speedup"] is None and a["memory_ratio"] is None

    cells = dict(zip(report.HEADERS, report.display(r), strict=True))
    assert cells["precision"] == "mixed → amp_fp16"
    assert cells["metric"] == "top1 76.04"
    assert cells["Δ vs fp32"] == "+0.12"
    assert cells["speedup"] == "2.50×" and cells["memory"] == "0.62×"
    assert report.display(a)[5:9] == ["-", "900.0 samples/s", "-", "-"]

    assert report.main([str(sweep)]) == 0
    assert (sweep / "report.png").stat().st_size > 0
    csv_rows = read_csv(sweep / "report.csv")
    assert [(c["model"], c["precision"]) for c in csv_rows] == [
        ("resnet50", "fp32"), ("resnet50", "mixed"), ("vgg16", "fp32"), ("vgg16", "mixed"), ("alexnet", "mixed")
    ]
    assert math.isclose(float(csv_rows[1]["speedup"]), 2.5)


def test_a_failed_run_without_metrics_still_gets_a_row(tmp_path):
    d = tmp_path / "run"
    d.mkdir()
    (d / "summary.json").write_text(json.dumps({"status": "failed", "error": "boom", "model": "vgg16",
                                                "data": "synthetic", "precision": "fp16_master",
                                                "loss_scale": "dynamic", "wall_time_s": 0.1}))
    rows = report.build_rows(report.load_runs(report.find_summaries([d])))
    assert rows[0]["status"] == "failed" and rows[0]["value"] is None and rows[0]["error"] == "boom"
    assert report.main([str(d)]) == 0
    assert "| failed |" in (d / "report.md").read_text()


@pytest.mark.parametrize("case", ["missing", "empty", "file", "unreadable"])
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, case):
    target = tmp_path / case
    expected = {
        "missing": f"{target}: no such directory",
        "empty": f"no summary.json found under {target}",
        "file": f"{target}: not a directory",
        "unreadable": "none of the summary.json files found could be read",
    }[case]
    if case == "empty":
        target.mkdir()
    elif case == "file":
        target.write_text("x")
    elif case == "unreadable":
        (target / "run").mkdir(parents=True)
        (target / "run" / "summary.json").write_text("{not json")
    assert report.main([str(target)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"mptrain-report: error: {expected}")
    assert not any("Traceback" in line for line in err)
