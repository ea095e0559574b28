"""Running the study's specs, with stamps, and reading them back with their pairing (issue 18).

Every run dir gets a ``stamp.json``: the study's CODE_VERSION, the git commit (and whether the
tree was dirty), the exact command and the CPU capability it ran on. A cached run is reused only
when its stamp matches the spec's command and the current CODE_VERSION; otherwise it is re-run,
or, with ``--keep-stale``, kept and reported as stale and unpaired. Nothing mixes silently.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from study_parts import CODE_VERSION, RECIPES, Spec

ROOT = Path(__file__).resolve().parents[1]


def git_commit() -> tuple[str | None, bool | None]:
    """(HEAD's commit, whether tracked files differ from it); (None, None) outside a git checkout."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return None, None
    return head.stdout.strip(), bool(dirty.stdout.strip())


def read_json(p: Path) -> dict[str, Any] | None:
    try:
        return json.loads(p.read_text()) if p.exists() else None
    except json.JSONDecodeError:
        return None


def stale_reason(s: Spec, run_dir: Path) -> str | None:
    """Why a completed cached run may not stand for ``s`` (None: it may)."""
    stamp = read_json(run_dir / "stamp.json")
    if stamp is None:
        return "no stamp (ran before issue 18)"
    if stamp.get("code_version") != CODE_VERSION:
        return f"code version {stamp.get('code_version')} != {CODE_VERSION}"
    if stamp.get("command") != s.command:
        return "its command differs from the spec's"
    return None


def run_one(s: Spec, runs: Path, keep_stale: bool = False) -> None:
    run_dir = runs / s.name
    summary = read_json(run_dir / "summary.json")
    if summary and summary.get("status") == "completed":
        why = stale_reason(s, run_dir)
        if why is None:
            return
        if keep_stale:
            print(f"[stale, kept: {why}] {s.name}", flush=True)
            return
        print(f"[stale, re-run: {why}] {s.name}", flush=True)
    if run_dir.exists():
        shutil.rmtree(run_dir)  # old event files would merge into the new curves
    run_dir.mkdir(parents=True)
    import torch

    commit, dirty = git_commit()
    stamp = {"code_version": CODE_VERSION, "git_commit": commit, "git_dirty": dirty, "command": s.command,
             "cpu_capability": torch.backends.cpu.get_cpu_capability(), "started": time.time()}
    (run_dir / "stamp.json").write_text(json.dumps(stamp, indent=1) + "\n")
    cmd = [sys.executable, "-m", "mptrain", *s.overrides, f"hydra.run.dir={run_dir}"]
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    t0 = time.time()
    with open(run_dir / "stdout.log", "w") as log:
        rc = subprocess.call(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    stamp.update(rc=rc, wall_s=time.time() - t0)
    (run_dir / "stamp.json").write_text(json.dumps(stamp, indent=1) + "\n")
    print(f"[rc={rc} {time.time() - t0:6.1f}s] {s.name}", flush=True)


# Relative cost per step, measured on a 2-core AVX512-BF16 CPU (no AVX512-FP16, so FP16 is
# emulated): the long runs go first so that the workers finish together.
COST = {"fp32": 1, "amp_bf16": 1.5, "fp8": 3, "fp8_none": 3, "fp8_nosr": 3, "fp8_dyn": 3}


def run_specs(specs: list[Spec], runs: Path, jobs: int, keep_stale: bool = False) -> None:
    order = sorted(specs, key=lambda s: -COST.get(s.cell, 4) * RECIPES[s.model].steps)
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        list(pool.map(lambda s: run_one(s, runs, keep_stale), order))


# ------------------------------------------------------------------------------------------ reading


def telemetry_digest(summary: dict) -> dict | None:
    t = (summary.get("telemetry") or {}).get("model")
    if not t:
        return None
    acts = [r for r in t["layers"] if r["kind"] == "act_grad"]
    wts = [r for r in t["layers"] if r["kind"] == "weight_grad"]
    h = t["act_grad_histogram"]
    total = h["zero"] + sum(h["counts"]) + h["nonfinite"]
    fmt = "e5m2" if "e5m2" in t.get("formats", []) else t["format"]
    tiny = -16 if fmt == "e5m2" else -24  # the smallest subnormal of the run's format
    below = sum(c for e, c in zip(h["log2_edges"][:-1], h["counts"], strict=False) if e < tiny)

    def mean(rows: list[dict], k: str) -> float | None:
        return statistics.fmean(r.get(k) or 0.0 for r in rows) if rows else None

    worst = max(acts, key=lambda r: r.get("lost_frac") or 0.0, default=None)
    return {
        "format": fmt,
        "measured_in": t.get("measured_in"),
        "steps_sampled": t["steps_sampled"],
        "act_lost_frac_mean": mean(acts, "lost_frac"),
        "act_lost_frac_max": None if worst is None else worst.get("lost_frac"),
        "act_lost_worst_layer": None if worst is None else worst.get("layer"),
        "weight_lost_frac_mean": mean(wts, "lost_frac"),
        # two denominators (issue 18): the unweighted mean over hooked layers of each layer's share
        # of its values (zeros included), and the share of all values of all layers pooled, as the
        # histogram's title gives it (large layers weigh more)
        "act_underflow_frac_mean": mean(acts, "underflow_frac"),
        "act_hist_below_tiny_frac": below / total if total else None,
        "act_hist_zero_frac": h["zero"] / total if total else None,
        "suggested_scale": t.get("suggested_scale"),
        "layers_hooked": len(acts),
    }


def record(s: Spec, run_dir: Path) -> dict:
    """One run's row of results.json (pairing is decided over all rows: see mark_pairing)."""
    r: dict = dict(part=s.part, name=s.name, model=s.model, cell=s.cell, seed=s.seed, command=s.command)
    summary = read_json(run_dir / "summary.json")
    stamp = read_json(run_dir / "stamp.json") or {}
    r.update(code_version=stamp.get("code_version"), git_commit=stamp.get("git_commit"),
             git_dirty=stamp.get("git_dirty"), cpu_capability=stamp.get("cpu_capability"))
    if summary is None:
        return {**r, "status": "missing", "stale": None, "paired": False}
    scaler = next(iter((summary.get("loss_scale_state") or {}).values()), {}) or {}
    r.update(
        status=summary["status"],
        stale=stale_reason(s, run_dir),
        steps=summary.get("steps"),
        precision_resolved=summary.get("precision_resolved"),
        loss_scale=summary.get("loss_scale"),
        metrics=summary.get("metrics") or {},
        final_loss=summary.get("final_loss"),  # one batch's loss at the last step: noisy
        skipped_steps=summary.get("skipped_steps"),
        final_loss_scale=summary.get("final_loss_scale"),
        floor_binds=scaler.get("floor_binds"),
        wall_time_s=summary.get("wall_time_s"),
        pairing_digests=summary.get("pairing"),
        telemetry=telemetry_digest(summary),
    )
    from mptrain.report import read_curves

    # Issue 18, item 6: a loss spike late in training is a precision event the final metric can
    # hide, so every run reports its largest one-batch loss over the second half of its steps.
    losses = read_curves(run_dir, ("train/loss",)).get("train/loss") or []
    late = [v for step, v in losses if step > (summary.get("steps") or 0) / 2]
    r["late_loss_max"] = max(late) if late else None
    metric = RECIPES[s.model].metric
    if RECIPES[s.model].evals > 1 and not s.tag:
        r["val_curve"] = read_curves(run_dir, (f"val/{metric}",)).get(f"val/{metric}")
    return r


def mark_pairing(recs: list[dict]) -> None:
    """Set each row's ``paired``: true only when the run is current (not stale) and its pairing
    digests (initial weights as FP16, the global RNG stream at step 0) equal those of its FP32
    twin of the same recipe and seed, or, without one, of the group's first current run. Runs
    from before issue 18 carry no digests and are never paired."""
    groups: dict[tuple[str, int, str], list[dict]] = {}
    for r in recs:
        groups.setdefault((r["model"], r["seed"], "tel" if r["part"] == "telemetry" else ""), []).append(r)
    for rows in groups.values():
        ok = [r for r in rows if r.get("status") == "completed" and not r.get("stale") and r.get("pairing_digests")]
        ref = next((r for r in ok if r["cell"] == "fp32"), ok[0] if ok else None)
        for r in rows:
            r["paired"] = bool(ref is not None and r in ok and r["pairing_digests"] == ref["pairing_digests"])
