"""Plan ``formats`` (issue 19, section 5): today's low-precision formats against FP32 on a GPT-style
transformer LM trained on real text (python_docs), on CPU, with paired seeds.

    python scripts/study.py run formats            # 8 cells x 5 seeds, one at a time (about 32 min)
    python scripts/study.py report formats         # results.json, README.md, formats.png (docs/results/formats)
    python scripts/study.py render formats         # README.md again from results.json only

Cells: fp32, bf16 (amp_bf16), FP8 in Mellempudi et al.'s format (E5M2 everywhere, no per-tensor
scales) with enhanced loss scaling, FP8 hybrid (E4M3 forward, E5M2 backward, per-tensor scaling),
mxfp8, mxfp4, and NVFP4 with its recipe (stochastic rounding of gradients, Hadamard on wgrad, 16x16
weight tiles, the last 15% of GEMM layers high) and without it. Each claim is "this cell matches
FP32 within 1% of perplexity", decided by ``mptrain.verdicts`` from the paired (same seed)
differences; one more says that NVFP4 without its recipe's options is worse than with them.

Runs, stamps and caching are the harness's (study_plans/harness.py). Pairing is checked, not
assumed: each run's ``pairing.init_digest`` (the initial weights) and data fingerprint must equal
its seed's FP32 run's, or the run is left out of the paired differences and marked
``paired: false``. Every number of the generated README comes from results.json
(``render_readme``).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import platform
import statistics
from dataclasses import dataclass
from datetime import date
from pathlib import Path
from typing import Any

from mptrain.verdicts import FAILS, HOLDS, OPEN, Margin, combine, judge, pair, t_quantile
from study_plans.harness import DOCS as DOCS_ROOT
from study_plans.harness import FINAL, ROOT, CodeState, Spec, base_record, observations, read_json, steps_of

NAME = "formats"
DOCS = DOCS_ROOT / "formats"

# ------------------------------------------------------------------------------------------ design

# transformer_lm_tiny: 2 pre-LN blocks of d_model 128, 4 heads, 64-token context, tied head, no
# dropout; AdamW lr 1e-3, wd 0.05, cosine, clip 1.0; batch 20 x 64 = 1,280 tokens a step. Measured
# on the 2-core EPYC (Zen 4) shared with other jobs, one thread: a step takes 0.27 s in FP32, 0.2 s
# in bf16, 0.7-0.8 s in FP8, mxfp8 and NVFP4 with its recipe, 1.4-1.6 s in mxfp4 and plain NVFP4
# (which quantize the 3,300-word tied head too), plus about 8 s per process; 6.5 s per step of all
# 8 cells, so 5 seeds x 80 steps was budgeted at about 50 minutes (the full part took 32 minutes
# once the machine's load fell). The full transformer_lm (6 x 384, 256 tokens) costs about 25x as
# much per step: it does not fit at any length that trains.
MODEL = "transformer_lm_tiny"
BASE = ("model=transformer_lm_tiny", "data=python_docs")
STEPS = 80  # 1.1 epochs of python_docs' 93K training tokens (72 steps an epoch)
QUICK_STEPS = 16
EVALS = 4  # validation points along the run (the curves); the last one is the verdicts' metric
MARGIN = 1.0  # the papers' parity margin: 1% of perplexity
UNIT = "% perplexity"
CI_LEVEL = 0.95


@dataclass(frozen=True)
class Cell:
    name: str
    label: str  # what it is, for the README
    overrides: tuple[str, ...]


_NVFP4_RECIPE = ("precision.stochastic_rounding=true", "precision.hadamard=true",
                 "precision.weight_2d_blocks=true", "precision.keep_last=null")
_NVFP4_PLAIN = ("precision.stochastic_rounding=false", "precision.hadamard=false",
                "precision.weight_2d_blocks=false", "precision.keep_last=0")
CELLS: dict[str, Cell] = {c.name: c for c in (
    Cell("fp32", "FP32, TF32 off (the reference)", ("precision=fp32",)),
    Cell("bf16", "bf16 autocast, FP32 weights, no loss scaling", ("precision=amp_bf16", "loss_scale=none")),
    Cell("fp8_e5m2", "FP8 in Mellempudi et al.'s format: E5M2 everywhere, no per-tensor scales, FP16 masters, "
         "stochastic rounding; enhanced loss scaling (its scale never moved here: see Limits)",
         ("precision=fp8", "precision.format=e5m2", "precision.scaling=loss", "loss_scale=enhanced")),
    Cell("fp8_hybrid", "FP8 hybrid: E4M3 forward, E5M2 backward, per-tensor power-of-two scales "
         "(current scaling), FP16 masters, stochastic rounding; no loss scale (it changes nothing here)",
         ("precision=fp8", "precision.format=hybrid", "precision.scaling=tensor", "loss_scale=none")),
    Cell("mxfp8", "OCP MX: E4M3 elements, blocks of 32 with an E8M0 scale", ("precision=mx", "precision.format=mxfp8")),
    Cell("mxfp4", "OCP MX: E2M1 elements, blocks of 32 with an E8M0 scale", ("precision=mx", "precision.format=mxfp4")),
    Cell("nvfp4", "NVFP4 with its recipe: SR on gradients, Hadamard on wgrad, 16x16 weight tiles, last 15% "
         "of GEMM layers high", ("precision=mx", "precision.format=nvfp4", *_NVFP4_RECIPE)),
    Cell("nvfp4_plain", "NVFP4 without the recipe's options: round-to-nearest, no Hadamard, 1D weight blocks, "
         "every GEMM layer in NVFP4", ("precision=mx", "precision.format=nvfp4", *_NVFP4_PLAIN)),
)}
REF = "fp32"


@dataclass(frozen=True)
class Claim:
    id: str
    text: str
    kind: str  # verdicts.Kind
    cell: str
    ref: str = REF


CLAIMS = (
    *(Claim(f"parity/{c}", f"{c} matches fp32 within {MARGIN:g}{UNIT}", "equivalent", c)
      for c in CELLS if c != REF),
    Claim("nvfp4/options", f"nvfp4 without the recipe's options is worse than with them by more than {MARGIN:g}{UNIT}",
          "worse", "nvfp4_plain", "nvfp4"),
)


def enhanced_schedule(steps: int) -> list[str]:
    """Enhanced scaling's floor rises at a third and two thirds of the run: the config's schedule
    (64 from step 1000, 512 from step 5000) would never rise within these runs."""
    a, b = max(steps // 3, 1), max(2 * steps // 3, 2)
    return ["~loss_scale.min_scale_schedule.1000", "~loss_scale.min_scale_schedule.5000",
            f"+loss_scale.min_scale_schedule.{a}=64", f"+loss_scale.min_scale_schedule.{b}=512"]


def spec(cell: str, seed: int, steps: int = 80) -> Spec:
    c = CELLS[cell]
    ov = [*BASE, *c.overrides, f"trainer.seed={seed}", f"trainer.max_steps={steps}",
          f"trainer.eval_every={max(steps // EVALS, 1)}", f"trainer.log_every={max(steps // 24, 1)}",
          "trainer.device=cpu", "trainer.checkpoint_every=null", "trainer.resume=null"]
    if "precision=mx" in c.overrides:
        ov.append(f"precision.seed={seed}")  # SR and Hadamard streams: one per seed, shared by no other cell
    if "loss_scale=enhanced" in c.overrides:
        ov += enhanced_schedule(steps)
    return Spec(f"{cell}/seed{seed}", tuple(ov), seed, cell, MODEL, NAME, cost=COST.get(cell, 3))


# Relative cost per step (measured: see above): the long runs go first.
COST = {"fp32": 1, "bf16": 1, "fp8_e5m2": 3, "fp8_hybrid": 3, "mxfp8": 3, "nvfp4": 3, "mxfp4": 6, "nvfp4_plain": 6}


def specs(quick: bool = False, n_seeds: int | None = None) -> list[Spec]:
    """Seed-major: every cell of seed 0, then seed 1, ... so a stopped part leaves complete pairs."""
    n = n_seeds or (2 if quick else 5)
    steps = QUICK_STEPS if quick else STEPS
    return [spec(c, s, steps) for s in range(n) for c in CELLS]


# ------------------------------------------------------------------------------------------ results


def _finite(x: Any) -> float | None:
    return float(x) if isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x) else None


def _curves(run_dir: Path) -> dict[str, list]:
    try:
        from mptrain.report import read_curves

        c = read_curves(run_dir, ("train/loss", "val/ppl"))
    except Exception:  # tensorboard missing or an unreadable event file: curves are optional
        return {}
    return c


def record(spec: Spec, run_dir: Path, code: CodeState | None = None) -> dict:
    base, summary = base_record(spec, run_dir, code)
    r: dict[str, Any] = {"cell": spec.cell, "seed": spec.seed, "name": spec.name, "command": spec.command,
                         "overrides": list(spec.overrides)}
    if summary is None:
        return {**r, "status": "missing", "paired": False}
    task = summary.get("task") or {}
    data = task.get("data") or {}
    plan = summary.get("precision_plan") or {}
    layers = plan.get("layers") or []
    big = max(layers, key=lambda x: x.get("flops") or 0, default=None)
    curves = _curves(run_dir)
    train_loss = curves.get("train/loss") or []
    val_loss = (summary.get("metrics") or {}).get("loss")
    return {
        **r,
        "status": summary.get("status"),
        "val_ppl": _finite((summary.get("metrics") or {}).get("ppl")),
        "val_loss": _finite(val_loss),
        "final_train_loss": _finite(summary.get("final_loss")),
        "final_train_ppl": _finite(math.exp(summary["final_loss"])) if _finite(summary.get("final_loss")) else None,
        "first_step_loss": _finite(train_loss[0][1]) if train_loss and train_loss[0][0] == 1 else None,
        "steps": summary.get("steps"),
        "skipped_steps": summary.get("skipped_steps"),
        "final_loss_scale": _finite(summary.get("final_loss_scale")),
        "low_precision_flop_fraction": _finite(plan.get("low_precision_flop_fraction")),
        "largest_gemm": None if big is None or not plan.get("total_flops") else {
            "name": big.get("name"), "format": big.get("format"), "low_precision": big.get("low_precision"),
            "flops_share": big.get("flops", 0) / plan["total_flops"]},
        "precision_resolved": summary.get("precision_resolved"),
        "loss_scale": summary.get("loss_scale"),
        "wall_time_s": _finite(summary.get("wall_time_s")),
        "process_wall_s": _finite(base["process_wall_s"]),
        "commit": base["commit"],
        "code_dirty": base["code_dirty"],
        "stale": base["stale"],
        # summary.json's pairing digests (issue 18); runs from before them carried init_digest at the top.
        "init_digest": (summary.get("pairing") or {}).get("init_digest") or summary.get("init_digest"),
        "data_fingerprint": {k: data.get(k) for k in ("name", "vocab_digest", "train_tokens", "val_tokens",
                                                       "bptt", "steps_per_epoch")},
        "parameters": task.get("parameters"),
        "val_curve": [[int(s), _finite(v)] for s, v in curves.get("val/ppl") or []],
        "run_dir": str(run_dir.relative_to(ROOT)) if run_dir.is_relative_to(ROOT) else str(run_dir),
        "paired": None,  # set by mark_pairing
    }


def mark_pairing(recs: list[dict]) -> dict:
    """``paired`` per run: same init digest and data fingerprint as its seed's FP32 run (FP32 runs:
    when the digest is there). Returns the summary the README states."""
    ref = {r["seed"]: r for r in recs if r["cell"] == REF and r.get("status") in FINAL and not r.get("stale")}
    for r in recs:
        f = ref.get(r["seed"])
        r["paired"] = bool(
            r.get("status") in FINAL and not r.get("stale") and f is not None and _digest(r) is not None
            and _digest(r) == _digest(f)
        )
    done = [r for r in recs if r.get("status") in FINAL]
    digests = {r["seed"]: r["init_digest"] for r in ref.values()}
    first: dict[int, list[float]] = {}
    for r in done:
        if r.get("first_step_loss") is not None:
            first.setdefault(r["seed"], []).append(r["first_step_loss"])
    spread = [max(v) - min(v) for v in first.values() if len(v) > 1]
    return {
        "runs": len(done),
        "paired_runs": sum(bool(r["paired"]) for r in done),
        "unpaired": [r["name"] for r in done if not r["paired"]],
        "init_digests": {str(k): v for k, v in sorted(digests.items())},
        "distinct_seed_digests": len(set(digests.values())),
        "data_fingerprints": len({json.dumps(r.get("data_fingerprint"), sort_keys=True) for r in done}),
        "first_step_loss_max_spread_across_cells": max(spread) if spread else None,
        "first_step_loss_seed_range": (
            [min(statistics.fmean(v) for v in first.values()), max(statistics.fmean(v) for v in first.values())]
            if first else None),
    }


def _digest(r: dict) -> tuple | None:
    """What must match a run's FP32 twin: its initial weights and its data."""
    if r.get("init_digest") is None:
        return None
    return r["init_digest"], json.dumps(r.get("data_fingerprint"), sort_keys=True)


def paired_diffs(recs: list[dict], cell: str, ref: str) -> tuple[list[float], list[int], list[int], list[str]]:
    """Per seed where both runs are paired and final: 100 (ppl / ppl_ref - 1). A diverged run (or one
    with no finite perplexity) counts as +inf: no interval, so the claim stays undecided."""
    obs = {c: observations([r for r in recs if r["cell"] == c], lambda r: r.get("val_ppl"), _digest)
           for c in (cell, ref)}
    p = pair(obs[cell], obs[ref], Margin(MARGIN, relative=True).diff)
    return p.diffs, p.seeds, p.diverged, p.names


def decide_claims(recs: list[dict]) -> list[dict]:
    out = []
    for c in CLAIMS:
        diffs, seeds, diverged, names = paired_diffs(recs, c.cell, c.ref)
        finite = all(math.isfinite(d) for d in diffs)
        v = judge(c.text, c.kind, diffs if finite else [], MARGIN, UNIT, names, worse_sign=+1)
        out.append({
            "id": c.id, "claim": c.text, "kind": c.kind, "cell": c.cell, "ref": c.ref,
            "verdict": v.verdict, "effect": _finite(v.effect) if finite else None,
            "ci95": [_finite(v.ci95[0]), _finite(v.ci95[1])] if finite else [None, None],
            "n_seeds": len(seeds), "seeds": seeds, "diverged_seeds": diverged,
            "diffs": [_finite(d) for d in diffs], "margin": MARGIN, "unit": UNIT,
            "seeds_to_decide": v.seeds_to_decide, "runs": names,
        })
    return out


def _mean_ci(vals: list[float]) -> tuple[float | None, float | None, float | None]:
    if not vals:
        return None, None, None
    m = statistics.fmean(vals)
    if len(vals) < 2:
        return m, None, None
    h = t_quantile(0.5 + CI_LEVEL / 2, len(vals) - 1) * statistics.stdev(vals) / math.sqrt(len(vals))
    return m, m - h, m + h


def cell_summaries(recs: list[dict]) -> dict[str, dict]:
    out = {}
    for name, cell in CELLS.items():
        rs = [r for r in recs if r["cell"] == name and r.get("status") in FINAL]
        ppl = [r["val_ppl"] for r in rs if r.get("val_ppl") is not None]
        m, lo, hi = _mean_ci(ppl)
        lpf = [r["low_precision_flop_fraction"] for r in rs if r.get("low_precision_flop_fraction") is not None]
        walls = [r["process_wall_s"] for r in rs if r.get("process_wall_s") is not None]
        curves = [r["val_curve"] for r in rs if r.get("val_curve")]
        mean_curve = []
        if curves:
            n = min(len(c) for c in curves)
            for i in range(n):
                vs = [c[i][1] for c in curves if c[i][1] is not None]
                mean_curve.append([curves[0][i][0], statistics.fmean(vs) if vs else None])
        out[name] = {
            "label": cell.label, "overrides": list(cell.overrides), "runs": len(rs),
            "statuses": {s: sum(r["status"] == s for r in rs) for s in sorted({r["status"] for r in rs})},
            "val_ppl_mean": m, "val_ppl_ci95": [lo, hi],
            "val_ppl_std": statistics.stdev(ppl) if len(ppl) > 1 else None,
            "val_ppl_per_seed": {str(r["seed"]): r.get("val_ppl") for r in rs},
            "skipped_steps": {str(r["seed"]): r.get("skipped_steps") for r in rs},
            "low_precision_flop_fraction": statistics.fmean(lpf) if lpf else None,
            "process_wall_s_mean": statistics.fmean(walls) if walls else None,
            "process_wall_s_total": sum(walls) if walls else None,
            "mean_val_curve": mean_curve,
        }
    return out


def machine() -> dict:
    import torch

    name = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    flags = ""
    with contextlib.suppress(OSError):
        flags = next((ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags")), "")
    return {"cpu": name, "cores": os.cpu_count(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "avx512_bf16": " avx512_bf16" in flags, "amx_bf16": " amx_bf16" in flags, "threads_per_run": 1,
            "runs_at_once": 1, "torch": torch.__version__, "python": platform.python_version(),
            "platform": platform.platform()}


def design(recs: list[dict], steps: int) -> dict:
    """The model and recipe as run, read from the first completed run's composed config."""
    out: dict[str, Any] = {"model": MODEL, "base_overrides": list(BASE), "steps": steps, "evals": EVALS,
                           "margin": MARGIN, "unit": UNIT, "ci_level": CI_LEVEL, "reference": REF}
    for r in recs:
        cfg_path = ROOT / r.get("run_dir", "") / ".hydra" / "config.yaml"
        if r.get("status") in FINAL and cfg_path.exists():
            from omegaconf import OmegaConf

            cfg = OmegaConf.load(cfg_path)
            m, d, o = cfg.model, cfg.data, cfg.optim
            fp = r.get("data_fingerprint") or {}
            out.update(
                d_model=m.d_model, num_layers=m.num_layers, num_heads=m.num_heads, block_size=m.block_size,
                dropout=m.dropout, tie_weights=m.tie_weights, batch_size=d.batch_size, bptt=d.bptt,
                tokens_per_step=d.batch_size * d.bptt, optimizer=o.name, lr=o.lr, weight_decay=o.weight_decay,
                schedule=cfg.sched.name, warmup_steps=cfg.sched.warmup_steps, grad_clip=cfg.trainer.grad_clip,
                parameters=r.get("parameters"), train_tokens=fp.get("train_tokens"), val_tokens=fp.get("val_tokens"),
                steps_per_epoch=fp.get("steps_per_epoch"),
                epochs=steps / fp["steps_per_epoch"] if fp.get("steps_per_epoch") else None,
            )
            break
    return out


def build_results(recs: list[dict], steps: int, quick: bool, elapsed_s: float | None) -> dict:
    pairing = mark_pairing(recs)
    cl = decide_claims(recs)
    walls = [r["process_wall_s"] for r in recs if r.get("process_wall_s") is not None]
    fp32_first = [r["first_step_loss"] for r in recs if r["cell"] == REF and r.get("first_step_loss") is not None]
    return {
        "generated_by": "scripts/study_formats.py" + (" --quick" if quick else ""),
        "date": date.today().isoformat(),
        "quick": quick,
        "machine": machine(),
        "design": design(recs, steps),
        "seeds": sorted({r["seed"] for r in recs}),
        "cells": cell_summaries(recs),
        "claims": cl,
        "parity_verdict": combine([c["verdict"] for c in cl if c["id"].startswith("parity/")]),
        "pairing": pairing,
        "fp32_first_step_loss_mean": statistics.fmean(fp32_first) if fp32_first else None,
        "wall": {"runs_total_s": sum(walls) if walls else None, "this_invocation_s": elapsed_s,
                 "runs": len(walls)},
        "commits": sorted({r["commit"] for r in recs if r.get("commit")}),
        "runs": recs,
    }


# ------------------------------------------------------------------------------------------ README


def f(x: float | None, spec: str = ".2f") -> str:
    return "—" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, spec)


def signed(x: float | None) -> str:
    return f(x, "+.2f").replace("-", "−")


def ci(pair: list) -> str:
    return f"[{signed(pair[0])}, {signed(pair[1])}]"


def pct(x: float | None) -> str:
    return "—" if x is None else f"{100 * x:.1f}%"


def mmss(s: float | None) -> str:
    if s is None:
        return "—"
    return f"{int(s // 60)} min {round(s % 60):02d} s"


WHY = {
    HOLDS: "the whole interval lies inside the margin",
    FAILS: "the whole interval lies outside the margin",
    OPEN: "the interval crosses the margin",
}
WHY_WORSE = {
    HOLDS: "the whole interval lies beyond the margin on the worse side",
    FAILS: "the whole interval lies on the better side of the margin",
    OPEN: "the interval crosses the margin",
}


def claim_sentence(c: dict, margin: float) -> str:
    why = (WHY if c["kind"] == "equivalent" else WHY_WORSE)[c["verdict"]]
    if c["n_seeds"] == 0:
        return f"- **{c['claim']}: {c['verdict']}** (no paired runs)."
    if c["diverged_seeds"]:
        return (f"- **{c['claim']}: {c['verdict']}**: the run diverged on seed(s) "
                f"{', '.join(map(str, c['diverged_seeds']))} of {c['n_seeds']}, so there is no interval.")
    s = (f"- **{c['claim']}: {c['verdict']}**: {signed(c['effect'])}{c['unit']} "
         f"{ci(c['ci95'])} over {c['n_seeds']} paired seeds; {why} (±{margin:g}{c['unit']})")
    if c["verdict"] == OPEN:
        s += (f"; {c['seeds_to_decide']} seeds would decide it if the mean and spread held"
              if c["seeds_to_decide"] else "; no number of seeds would decide it at the measured mean")
    return s + "."


def fp8_stream_sentence(res: dict) -> str:
    """Where stochastic rounding drew its random numbers at the runs' commit (``facts`` in results.json)."""
    own = (res.get("facts") or {}).get("fp8_own_rounding_stream")
    mx = ("MX/NVFP4's stochastic rounding and Hadamard signs draw from generators of their own, seeded by "
          "`precision.seed`.")
    commits = ", ".join(c[:12] for c in res.get("commits", []))
    if own is False:
        return (f"{mx} FP8's stochastic rounding drew from the global RNG: these runs were made at {commits}, before "
                "FP8 got a rounding stream of its own (`mptrain/numerics/rounding_rng.py`). With no dropout and no "
                "shuffling nothing else draws from the global RNG, so those draws change only FP8's own rounding, "
                "not what its FP32 twin sees.")
    if own is True:
        return f"{mx} FP8's draws from the run's own rounding stream (`mptrain/numerics/rounding_rng.py`)."
    where = commits or "the runs' commit"
    return f"{mx} Where FP8's stochastic rounding drew from at {where} is not recorded."


def scale_lines(res: dict) -> list[str]:
    """For each loss-scaled cell: whether its scale ever moved, from the runs' final scales, skipped
    steps and the floor schedule in their commands (issue 27: "enhanced" never moved here)."""
    out = []
    for name, cell in res["cells"].items():
        rs = [r for r in res["runs"] if r["cell"] == name and r.get("status") in FINAL]
        if not rs or not any(o in ("loss_scale=enhanced", "loss_scale=dynamic") for o in cell["overrides"]):
            continue
        finals = sorted({r.get("final_loss_scale") for r in rs})
        skipped = max(r.get("skipped_steps") or 0 for r in rs)
        floors = sorted({(int(o.split(".")[-1].split("=")[0]), float(o.split("=")[1])) for r in rs
                         for o in r.get("overrides", []) if o.startswith("+loss_scale.min_scale_schedule.")})
        floor_txt = ", then ".join(f"{v:g} from step {k}" for k, v in floors) or "its config's"
        if len(finals) == 1 and skipped == 0 and finals[0] is not None and all(v < finals[0] for _, v in floors):
            out.append(f"- {name}'s loss scale never moved: every run ended at {finals[0]:g} with 0 skipped steps "
                       f"(no overflow, so no back-off), its default starting scale, and its floor ({floor_txt}) "
                       "stayed below it, so the floor never bound. Its \"enhanced\" scaling acted as a constant "
                       "scale: these runs test E5M2 at that scale, not enhanced scaling.")
        else:
            out.append(f"- {name}'s loss scale ended at {', '.join(f'{f:g}' for f in finals)} with at most {skipped} "
                       "skipped steps per run.")
    return out


def render_readme(res: dict) -> str:
    """The README, from results.json alone: every number below is read from ``res``."""
    d, m, p, cells = res["design"], res["machine"], res["pairing"], res["cells"]
    margin, unit = d["margin"], d["unit"]
    lvl = f"{100 * d['ci_level']:g}%"
    n_seeds = len(res["seeds"])
    ref = cells[d["reference"]]
    claims = res["claims"]
    counts = {v: sum(c["verdict"] == v for c in claims if c["id"].startswith("parity/")) for v in (HOLDS, FAILS, OPEN)}
    L: list[str] = []
    quick = " (quick)" if res["quick"] else ""
    L += [f"# Formats: today's low-precision formats against FP32 on a transformer LM{quick}",
          "",
          f"Generated by `{res['generated_by']}` on {res['date']} from `results.json` (every number below is read "
          "from it; re-render with `python scripts/study_formats.py --report`).",
          "",
          f"Machine: {m['cpu']}, {m['cores']} cores, torch CPU capability {m['cpu_capability']}"
          f"{', native bf16 (AVX512-BF16)' if m.get('avx512_bf16') else ''}{', AMX' if m.get('amx_bf16') else ''}; "
          f"one run at a time, {m['threads_per_run']} thread each; torch {m['torch']}, Python {m['python']}. "
          f"Code: commit {', '.join(c[:12] for c in res['commits']) or '—'}"
          f"{' with uncommitted changes' if any(r.get('code_dirty') for r in res['runs']) else ''}.",
          ""]
    L += ["## Verdicts", "",
          f"Each cell against FP32 on the same seed, {lvl} t-interval of the paired differences in val perplexity "
          f"(100 · (ppl / ppl_fp32 − 1)), margin ±{margin:g}{unit} (`mptrain/verdicts.py`). "
          f"Parity holds for {counts[HOLDS]}, does not hold for {counts[FAILS]} and is inconclusive for "
          f"{counts[OPEN]} of the {sum(counts.values())} formats; all together: **{res['parity_verdict']}**.",
          "",
          "| claim | verdict | effect (mean paired Δ) | 95% CI | seeds | seeds to decide |".replace("95%", lvl),
          "|---|---|---|---|---|---|"]
    for c in claims:
        L.append(f"| {c['claim']} | **{c['verdict']}** | {signed(c['effect'])}{c['unit']} | {ci(c['ci95'])} | "
                 f"{c['n_seeds']} | {c['seeds_to_decide'] or ''} |")
    L += ["", *[claim_sentence(c, margin) for c in claims], ""]
    seeds = res["seeds"]
    L += ["## Cells", "",
          f"| cell | what | val ppl, mean [{lvl} CI over seeds] | per seed ({', '.join(map(str, seeds))}) | "
          "paired Δ vs fp32 | skipped steps | share of forward FLOPs below 16 bits | wall per run |",
          "|---|---|---|---|---|---|---|---|"]
    by_cell = {c["cell"]: c for c in claims if c["ref"] == d["reference"]}
    for name, c in cells.items():
        per = " ".join(f(c["val_ppl_per_seed"].get(str(s))) for s in seeds)
        skipped = " ".join(str(c["skipped_steps"].get(str(s), "—")) for s in seeds)
        delta = f"{signed(by_cell[name]['effect'])}{unit}" if name in by_cell else ""
        lpf = c["low_precision_flop_fraction"]
        L.append(f"| {name} | {c['label']} | {f(c['val_ppl_mean'])} [{f(c['val_ppl_ci95'][0])}, "
                 f"{f(c['val_ppl_ci95'][1])}] | {per} | {delta} | {skipped} | "
                 f"{pct(lpf)} | {f(c['process_wall_s_mean'], '.0f')} s |")
    L += ["", "Each cell's exact overrides are in `results.json` (`cells.<name>.overrides`, and every run's "
          "full command under `runs`).", ""]
    # what the design allows
    fp32_std = ref["val_ppl_std"]
    fp32_rel = None if fp32_std is None or not ref["val_ppl_mean"] else 100 * fp32_std / ref["val_ppl_mean"]
    paired_sd = [statistics.stdev(c["diffs"]) for c in claims
                 if c["ref"] == d["reference"] and len(c["diffs"]) > 1 and all(x is not None for x in c["diffs"])]
    start_ppl = None if res["fp32_first_step_loss_mean"] is None else math.exp(res["fp32_first_step_loss_mean"])
    L += ["## Design", "",
          f"- **Model**: `{d['model']}`, a GPT-style decoder: {d.get('num_layers', '—')} pre-LayerNorm blocks of "
          f"d_model {d.get('d_model', '—')}, {d.get('num_heads', '—')} heads, {d.get('block_size', '—')}-token "
          f"context, dropout {d.get('dropout', '—')}, tied head; {f(d.get('parameters'), ',')} parameters.",
          f"- **Data**: python_docs, {f(d.get('train_tokens'), ',')} training and {f(d.get('val_tokens'), ',')} "
          f"validation tokens; batch {d.get('batch_size', '—')} × {d.get('bptt', '—')} = "
          f"{f(d.get('tokens_per_step'), ',')} tokens a step, {d.get('steps_per_epoch', '—')} steps an epoch.",
          f"- **Run**: {d['steps']} steps ({f(d.get('epochs'), '.1f')} epochs), {d.get('optimizer', '—')} lr "
          f"{d.get('lr', '—')}, weight decay {d.get('weight_decay', '—')}, {d.get('schedule', '—')} schedule with "
          f"{d.get('warmup_steps', '—')} warm-up steps, clipping at {d.get('grad_clip', '—')}; validation every "
          f"{d['steps'] // d['evals']} steps, the last one is the metric.",
          f"- **Seeds**: {n_seeds} ({', '.join(map(str, seeds))}), every cell on every seed: "
          f"{sum(c['runs'] for c in cells.values())} runs.",
          f"- **Learning**: FP32 goes from a training perplexity of {f(start_ppl, '.0f')} at step 1 to a validation "
          f"perplexity of {f(ref['val_ppl_mean'])} at step {d['steps']}.",
          f"- **Noise against the margin**: FP32's val perplexity varies by {f(fp32_rel)}% (std over seeds) from "
          f"seed to seed; the paired differences vary by "
          f"{f(min(paired_sd) if paired_sd else None)} to {f(max(paired_sd) if paired_sd else None)}{unit} (std), "
          f"against a ±{margin:g}{unit} margin.",
          ""]
    L += ["## Pairing", "",
          f"{p['paired_runs']} of {p['runs']} finished runs are paired: each has the same initial weights "
          "(`init_digest` in summary.json: a sha256 of the initial weights) and the same data fingerprint "
          "(vocabulary digest, token counts, "
          f"steps per epoch) as its seed's FP32 run. The {len(p['init_digests'])} FP32 runs have "
          f"{p['distinct_seed_digests']} distinct digests"
          f"{', one per seed' if p['distinct_seed_digests'] == len(p['init_digests']) else ' (seeds share one)'}."
          " python_docs is read in the same order on every epoch and seed (no shuffling), and the model has "
          f"dropout {d.get('dropout', '—')}, so the runs of a seed see the same batches in the same order and no "
          "dropout mask can differ. "
          + fp8_stream_sentence(res) + " "
          f"The step-1 training losses of one seed's cells differ by at most "
          f"{f(p['first_step_loss_max_spread_across_cells'], '.4f')} (each format's rounding of the same forward "
          f"pass); the seeds' own step-1 losses span {f((p['first_step_loss_seed_range'] or [None])[0], '.4f')} to "
          f"{f((p['first_step_loss_seed_range'] or [None, None])[1], '.4f')}."
          + (f" Unpaired runs, left out of the differences: {', '.join(p['unpaired'])}." if p["unpaired"] else ""),
          ""]
    fig = res.get("figure")
    if fig:
        L += ["## Figure", "", f"![val perplexity per format]({fig})", "",
              f"`{fig}`: left, each format's paired difference from FP32 with its {lvl} interval, the ±{margin:g}"
              f"{unit} margin shaded; middle, val perplexity per format, mean over seeds with its {lvl} t-interval "
              "(unpaired: this spread is mostly the seeds', which the paired differences cancel); right, the mean "
              "validation curves.", ""]
    w = res["wall"]
    L += ["## Cost", "",
          f"The {w['runs']} runs took {mmss(w['runs_total_s'])} of wall time in all (each process from launch to "
          "exit, one at a time, one thread, on a machine shared with other jobs, so a cell's time moves with the "
          f"load). A run took {f(ref['process_wall_s_mean'], '.0f')} s in FP32"
          + "".join(f" and {f(c['process_wall_s_mean'], '.0f')} s in {n} (the CPU's native bf16)"
                    for n, c in cells.items() if n == "bf16")
          + "; the emulated formats, which quantize in FP32 arithmetic, took "
          + ", ".join(f"{n} {f(c['process_wall_s_mean'], '.0f')} s" for n, c in cells.items()
                      if n not in (d["reference"], "bf16"))
          + ".", ""]
    lp = {n: c["low_precision_flop_fraction"] for n, c in cells.items()}
    firsts = {r["cell"]: r["largest_gemm"] for r in res["runs"] if r.get("largest_gemm")}
    big = firsts.get(d["reference"])
    low = [n for n, g in firsts.items() if big and g["name"] == big["name"] and g.get("low_precision")]
    high = [n for n, g in firsts.items() if big and g["name"] == big["name"] and not g.get("low_precision")]
    L += ["## Limits", "", *scale_lines(res),
          "- Emulation: every low-precision value is exact (`mptrain/numerics`), but it is computed in FP32 on a CPU, "
          "so these runs say nothing about speed, and bf16 here is the CPU's bf16 autocast.",
          f"- What runs low: the share of the forward FLOPs below 16 bits per cell is in the table "
          f"({', '.join(f'{n} {pct(v)}' for n, v in lp.items())}). "
          "Attention's QK^T and AV products are not converted in any cell"
          + (f", and in this small model the largest GEMM layer is `{big['name']}`, the tied vocabulary head "
             f"({pct(big['flops_share'])} of the forward FLOPs): it runs below 16 bits in "
             f"{', '.join(low) or 'no cell'} "
             f"and at 16 bits or more in {', '.join(high) or 'no cell'}." if big else "."),
          f"- nvfp4 and nvfp4_plain differ in four options at once (stochastic rounding, Hadamard, 2D weight "
          f"blocks, last layers high) and so in the share of forward FLOPs in FP4 ({pct(lp.get('nvfp4'))} against "
          f"{pct(lp.get('nvfp4_plain'))}): the options claim is about the recipe as a whole, not about any one "
          "option.",
          f"- Scale: a {d.get('num_layers', '—')}-block, d_model {d.get('d_model', '—')} model for "
          f"{d['steps']} steps, chosen to fit the budget of one CPU core for an hour; the verdicts are about this "
          "configuration, not about long runs of large models, where format errors can accumulate differently.",
          f"- The verdicts cover {n_seeds} seeds; an inconclusive verdict says how many seeds would decide it.",
          f"- Code: every run was made at commit {', '.join(c[:12] for c in res['commits']) or '—'}; the code has "
          "changed since (FP8's rounding stream among it). Plan formats_like re-ran fp32, fp8_hybrid, mxfp8, mxfp4 "
          "and NVFP4 at one later commit, like for like (the tied head quantized, NVFP4's options one at a time) "
          "and on 8 seeds: [../formats_like/README.md](../formats_like/README.md); bf16 and fp8_e5m2 were not "
          "re-run.",
          ""]
    return "\n".join(L)


# ------------------------------------------------------------------------------------------ figure


def plot(res: dict, out: Path, name: str = "formats.png") -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    d, cells = res["design"], res["cells"]
    margin = d["margin"]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.2))
    ax = axes[0]
    cl = [c for c in res["claims"] if c["ref"] == d["reference"]]
    ax.axhspan(-margin, margin, color="tab:green", alpha=0.15, label=f"±{margin:g}% margin")
    ax.axhline(0, color="black", lw=0.8)
    colors = {HOLDS: "tab:green", FAILS: "tab:red", OPEN: "tab:orange"}
    for i, c in enumerate(cl):
        if c["effect"] is None:
            continue
        lo, hi = c["ci95"]
        yerr = None if lo is None else [[c["effect"] - lo], [hi - c["effect"]]]
        ax.errorbar([i], [c["effect"]], yerr=yerr, fmt="o", capsize=4, color=colors[c["verdict"]])
    ax.set_xticks(range(len(cl)), [c["cell"] for c in cl], rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("val perplexity vs fp32, % (paired; higher is worse)")
    ax.set_title(f"paired Δ vs FP32, {100 * d['ci_level']:g}% CI (green holds, orange inconclusive, red fails)",
                 fontsize=8)
    ax.legend(fontsize=7)
    ax = axes[1]
    names = list(cells)
    for i, n in enumerate(names):
        c = cells[n]
        if c["val_ppl_mean"] is None:
            continue
        lo, hi = c["val_ppl_ci95"]
        yerr = None if lo is None else [[c["val_ppl_mean"] - lo], [hi - c["val_ppl_mean"]]]
        ax.errorbar([i], [c["val_ppl_mean"]], yerr=yerr, fmt="s", capsize=4, color="tab:blue")
        for v in c["val_ppl_per_seed"].values():
            if v is not None:
                ax.plot([i + 0.15], [v], ".", color="gray", ms=3)
    ax.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("val perplexity (lower is better)")
    ax.set_title(f"val perplexity per format: mean, {100 * d['ci_level']:g}% CI over seeds, seeds in gray", fontsize=8)
    ax = axes[2]
    for n, c in cells.items():
        pts = [(s, v) for s, v in c["mean_val_curve"] if v is not None]
        if pts:
            ax.plot([s for s, _ in pts], [v for _, v in pts], marker=".", lw=1.1, label=n)
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("val perplexity (mean over seeds)")
    ax.set_title("validation curves", fontsize=8)
    ax.legend(fontsize=7)
    fig.tight_layout()
    out.mkdir(parents=True, exist_ok=True)
    fig.savefig(out / name, dpi=110)
    plt.close(fig)
    return name


def report(runs: Path, out: Path, quick: bool, code: CodeState, n_seeds: int | None = None) -> dict:
    """results.json, README.md and formats.png from the run dirs."""
    todo = specs(quick, n_seeds)
    recs = [record(s, runs / s.name, code) for s in todo]
    res = build_results(recs, steps_of(todo[0]), quick, None)
    res["facts"] = facts(res["commits"])
    out.mkdir(parents=True, exist_ok=True)
    res["figure"] = plot(res, out)
    (out / "results.json").write_text(json.dumps(res, indent=1, default=str) + "\n")
    (out / "README.md").write_text(render_readme(res) + "\n")
    return res


def facts(commits: list[str]) -> dict[str, Any]:
    """What the code at the runs' commits did that the runs themselves do not record: whether FP8's
    stochastic rounding had a stream of its own (None: git cannot tell)."""
    from study_plans.harness import _git

    seen = {_git("cat-file", "-e", f"{c}:mptrain/numerics/rounding_rng.py").returncode == 0 for c in commits
            if _git("cat-file", "-e", c).returncode == 0}
    return {"fp8_own_rounding_stream": seen.pop() if len(seen) == 1 else None}


def render(out: Path = DOCS) -> dict:
    """README.md again from results.json only (the figure stays as it is); the cells' labels are
    the plan's, and ``facts`` is added when git can tell it."""
    res = read_json(out / "results.json")
    if res is None:
        raise SystemExit(f"{out / 'results.json'}: not found")
    for name, c in res["cells"].items():
        if name in CELLS:
            c["label"] = CELLS[name].label
    if (res.get("facts") or {}).get("fp8_own_rounding_stream") is None:
        res["facts"] = facts(res.get("commits") or [])
    (out / "results.json").write_text(json.dumps(res, indent=1, default=str) + "\n")
    (out / "README.md").write_text(render_readme(res) + "\n")
    return res


def summary_lines(res: dict) -> list[str]:
    return [f"{c['verdict']:>14}  {c['claim']}: {signed(c['effect'])}{c['unit']} {ci(c['ci95'])}, n={c['n_seeds']}"
            for c in res["claims"]]
