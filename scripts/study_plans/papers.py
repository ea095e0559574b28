"""Plan ``papers`` (issues 12 and 18): the papers' loss-scaling and parity claims on CPU proxies.

    python scripts/study.py run papers --jobs 2      # every run (about 5 hours of one core)
    python scripts/study.py report papers            # results.json, tables.md, README.md, the PNGs
    python scripts/study.py render papers            # results.json's claims, tables.md and README.md again

A *recipe* is one model's training setup (its key names the runs); a *cell* is one precision and
loss-scaling configuration; a part is a list of (recipe, cell, seed). Every claim compares a cell
with FP32 (or with another cell) on the same seed, only where the runs' pairing digests match; its
verdict is the 95% t-interval of those paired differences (mptrain/verdicts.py), Holm-corrected
over every part of the study. docs/results/README.md is README.template.md rendered from
results.json (``prose.py``).
"""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
from dataclasses import dataclass
from datetime import date
from pathlib import Path
from typing import Any

from mptrain.verdicts import HOLDS, Margin, Obs, Verdict, combine, holm, holm_parts, judge, log_error_ratio, pair
from study_plans.harness import DOCS as DOCS_ROOT
from study_plans.harness import (
    CodeState,
    Spec,
    base_record,
    judge_cells,
    mark_pairing,
    observations,
    provenance,
    read_json,
)

NAME = "papers"
DOCS = DOCS_ROOT
# The last version of the old harness's manual stamp: the committed results.json's runs carry it.
# The harness now stamps each run with its commit instead (study_plans/harness.py).
CODE_VERSION = 2

SEEDS = (0, 1, 2, 3, 4)
# (d)'s stochastic-rounding part has the same 5 seeds: 10 (30 more FP8 minutes of one core) did not
# fit the session's budget; its verdict gives the seeds it would need (seeds_to_decide, seeds_if_equal).
SR_SEEDS = SEEDS


@dataclass(frozen=True)
class Recipe:
    """One model's training recipe: FP32 must be reproducible across seeds before any precision is
    compared on it (issue 12, item 1)."""

    name: str
    overrides: tuple[str, ...]
    steps: int
    metric: str  # "top1" (higher is better, points) or "ppl" (lower is better, % relative)
    margin: float  # the papers' parity margin: 0.5 points of top-1, 1% of perplexity
    cells: tuple[str, ...]  # precision cells of the parity part (or of the recipe's own part)
    evals: int = 1  # evaluations, evenly spaced; the last one is the metric the claims use

    @property
    def worse_sign(self) -> int:
        return -1 if self.metric == "top1" else 1

    @property
    def unit(self) -> str:
        return "points top-1" if self.metric == "top1" else "% perplexity"


PARITY = ("fp32", "amp_fp16", "fp16_master", "amp_bf16")

# The CNN proxy (issue 18, item 8): digits' 359 validation images (one image = 0.28 points) and an
# FP32 at 98% could not resolve a 0.5-point margin. Synthetic 10-class images: each class a fixed
# low-frequency pattern, weak against unit pixel noise (FP32: 99.65 +- 0.19 over 5 seeds, not the
# "well below 100%" asked for: weaker patterns left seeds at chance too long); a fixed task_seed
# keeps the patterns and the 10,000 validation images the same for every run seed (seeds vary the
# training draws, init and dropout only), and every training batch is fresh, so no run memorises.
# SGD with momentum, as the paper trained its CNNs.
PROXY = (
    "data=synthetic", "data.num_classes=10", "data.pattern_scale=0.1", "data.task_seed=1234",
    "data.val_samples=10000", "data.val_batch_size=500", "data.num_workers=0",
    "optim=sgd", "sched.warmup_steps=100", "trainer.grad_clip=1.0",
)  # fmt: skip
LM = (
    "model=lstm_lm", "data=python_docs", "model.emb_size=100", "model.hidden_size=100",
    "data.batch_size=64", "model.init_range=0.02",
)  # fmt: skip
RECIPES = {
    # AlexNet/8 without batch norm on the proxy: it sits near chance for 400-800 steps (finding the
    # weak pattern), then learns, and 2,000 steps end on the plateau. Pilots, FP32 (issue 18):
    # lr 0.05 and 0.1 stalled or diverged; lr 0.03 unclipped learned and then died back to chance
    # (ln 10) on one seed in five; lr 0.02 clipped left two seeds of five still climbing at step
    # 2,000 (94%, against 99% for the others); pattern 0.15 is solved (99.98%). lr 0.03 with 100
    # warm-up steps and the gradient norm clipped at 1 (after unscaling) ends on the plateau.
    "alexnet": Recipe(
        "alexnet", ("model=alexnet", "model.width_divisor=8", "data.image_size=64", *PROXY, "optim.lr=0.03"),
        2000, "top1", 0.5, (*PARITY, "fp8"),
    ),
    # ResNet-50/8 at 32 px (its smallest input) on the same proxy: parity only (issue 18). At
    # AlexNet's lr 0.03 for 1,000 steps it never left chance (FP32 10.96 +- 0.90 over seeds 0-2, loss
    # ln 10); lr 0.1 for 2,000 steps learns: FP32 84.43 +- 3.25 over seeds 0-4 (87.33, 84.20, 84.37,
    # 79.22, 87.03; AVX512-BF16 EPYC, 2026-11-24). Well below 100%, as asked, but the seeds still
    # spread by points: the paired differences, not this spread, decide parity. No fp16_master here:
    # emulated FP16 costs ResNet-50 about 9 min a run on 2 cores, and AlexNet already tests FP16
    # weights; the study has to fit its CPU budget (issue 18).
    "resnet50": Recipe(
        "resnet50", ("model=resnet50", "model.width_divisor=8", "data.image_size=32", *PROXY, "optim.lr=0.1"),
        2000, "top1", 0.5, ("fp32", "amp_fp16", "amp_bf16"),
    ),
    # The LSTM LM (Zaremba-style, tied softmax) on python_docs with a batch of 64 x 35 = 2,240
    # positions: the loss is their mean, so dL/dlogits is (p - y) / 2240. GPT-style small embedding
    # init (init_range 0.02) keeps dL/dh = W^T dL/dlogits small too. One epoch (41 steps).
    # fp8 is left out (the LSTM has no FP8 path).
    "lstm_lm": Recipe("lstm_lm", LM, 41, "ppl", 1.0, ("fp32", "amp_fp16", "amp_bf16")),
    # The same LM for 4 epochs, evaluated after each (issue 18, item 4): does (b)'s penalty
    # persist, grow or fade? Claim (e) is decided on these runs (its own), (b) on the 1-epoch ones.
    "lstm_lm_4ep": Recipe(
        "lstm_lm_4ep", LM, 164, "ppl", 1.0, ("fp32", "fp16_none", "amp_fp16", "fp16_master"), evals=4,
    ),
}

# A cell is one precision and loss-scaling configuration. The parity cells pair each half format
# with its natural scaler: dynamic for FP16, none for bf16 (FP32's exponent range), enhanced for FP8.
CELLS: dict[str, tuple[str, ...]] = {
    "fp32": ("precision=fp32",),
    "amp_fp16": ("precision=amp_fp16", "loss_scale=dynamic"),
    "fp16_master": ("precision=fp16_master", "loss_scale=dynamic"),
    "amp_bf16": ("precision=amp_bf16", "loss_scale=none"),
    "fp8": ("precision=fp8", "loss_scale=enhanced"),  # E5M2, no per-tensor scales, SR (Mellempudi et al.)
    "fp16_none": ("precision=amp_fp16", "loss_scale=none"),
    "fp16_adaptive": ("precision=amp_fp16", "loss_scale=adaptive"),  # Zhao et al., per layer
    "fp8_none": ("precision=fp8", "loss_scale=none"),
    "fp8_nosr": ("precision=fp8", "loss_scale=enhanced", "precision.stochastic_rounding=false"),
    # enhanced's own dynamic rule without its floor: where the two differ, the floor bound
    "fp8_dyn": ("precision=fp8", "loss_scale=dynamic"),
}
# Claim (c) needs scales that fail (issue 18, item 3): 1 (no scaling, with overflow checks) and
# 2^24, which overflows FP16 (max 65504) whenever a gradient exceeds 2^-8, i.e. persistently; in
# between the paper's 8 (SSD) and 128 (bigLSTM) and 32768, dynamic's neighbourhood.
STATIC_GRID = (1, 8, 128, 32768, 2**24)
for _s in STATIC_GRID:
    CELLS[f"fp16_static_{_s}"] = ("precision=amp_fp16", "loss_scale=static", f"loss_scale.scale={_s}")
SCALING_MODEL = "lstm_lm"  # claims (b) and (c) on the LM
EPOCHS_MODEL = "lstm_lm_4ep"  # claim (e) and (b) past one epoch
CNN_MODEL = "alexnet"  # claims (b) and (c) on a CNN: mptrain's adaptive scaling runs here
FP8_MODEL = "alexnet"  # claim (d)
SCALING_CELLS = ("fp16_none", *(f"fp16_static_{s}" for s in STATIC_GRID), "amp_fp16")
# The CNN runs (b) and adaptive, not a second static grid: emulated FP16 costs AlexNet about 4 min a
# run on 2 cores, and the grid's point, that a static scale needs a search, is the LM's claim (c).
CNN_SCALING_CELLS = ("fp16_none", "fp16_adaptive")
# Why the LM has no adaptive cell: said in claim (c) and in the README.
ADAPTIVE_LSTM_REFUSED = (
    "not run: mptrain's adaptive scaling computes per-layer scales over a torch.fx graph of Conv/Linear "
    "layers, and an nn.LSTM carrying its state across batches is neither, so mptrain refuses it "
    "(config.py). Zhao et al. do cover RNNs: this is mptrain's limit, not the paper's; measured on "
    f"{CNN_MODEL} instead"
)


def enhanced_schedule(steps: int) -> list[str]:
    """Enhanced scaling under which its floor binds (issue 18, item 5).

    The old schedule (floor 1 -> 64 -> 512 from a 2^16 start) never bound: dynamic backed off to
    2^14 and stayed there, so "enhanced" was dynamic. Here the scale starts at 1 and grows x2 every
    tenth of the run on its own (2^3 by a third), and the floor rises to 2^8 at a third and 2^12 at
    two thirds, above where the growth alone would be (2^11): it binds at both rises by
    construction, and again at any overflow that would back off below it. ``fp8_dyn`` runs the same
    start and growth without the floor, so the floor's effect is measured, not assumed.
    """
    a, b = steps // 3, 2 * steps // 3
    return [
        "loss_scale.init_scale=1", f"loss_scale.growth_interval={max(steps // 10, 1)}",
        "~loss_scale.min_scale_schedule.1000", "~loss_scale.min_scale_schedule.5000",
        f"+loss_scale.min_scale_schedule.{a}=256", f"+loss_scale.min_scale_schedule.{b}=4096",
    ]


def fp8_dyn_schedule(steps: int) -> list[str]:
    """``fp8_dyn``: enhanced's start and growth, no floor."""
    return ["loss_scale.init_scale=1", f"loss_scale.growth_interval={max(steps // 10, 1)}"]


def run_steps(model: str, quick: bool) -> int:
    r = RECIPES[model]
    return max(r.steps // 10, 12 * r.evals) if quick else r.steps


# Relative cost per step, measured on a 2-core AVX512-BF16 CPU (no AVX512-FP16, so FP16 is
# emulated): the long runs go first so that the workers finish together.
COST = {"fp32": 1, "amp_bf16": 1.5, "fp8": 3, "fp8_none": 3, "fp8_nosr": 3, "fp8_dyn": 3}


def spec(part: str, model: str, cell: str, seed: int, quick: bool, extra: tuple[str, ...] = (), tag: str = "") -> Spec:
    r = RECIPES[model]
    steps = run_steps(model, quick)
    ov = [*r.overrides, *CELLS[cell], f"trainer.seed={seed}", f"trainer.max_steps={steps}",
          f"trainer.eval_every={steps // r.evals}", f"trainer.log_every={max(steps // 30, 2)}", "trainer.device=cpu",
          "trainer.checkpoint_every=null", "trainer.resume=null", *extra]
    if "loss_scale=enhanced" in CELLS[cell]:
        ov += enhanced_schedule(steps)
    if cell == "fp8_dyn":
        ov += fp8_dyn_schedule(steps)
    name = f"{model}-{cell}{'-' + tag if tag else ''}-s{seed}"
    return Spec(name, tuple(ov), seed, cell, model, part, tag, COST.get(cell, 4))


def seeds(quick: bool, full: tuple[int, ...] = SEEDS) -> tuple[int, ...]:
    return full[:2] if quick else full


def parity_specs(quick: bool) -> list[Spec]:
    return [spec("parity", m, c, s, quick) for m in ("alexnet", "resnet50", "lstm_lm")
            for c in RECIPES[m].cells for s in seeds(quick)]


def scaling_specs(quick: bool) -> list[Spec]:
    """(b) and (c): the LM's grid, and the CNN's grid with adaptive (the CNN's fp32 and dynamic
    runs are parity's)."""
    out = [spec("scaling", SCALING_MODEL, c, s, quick) for c in ("fp32", *SCALING_CELLS) for s in seeds(quick)]
    return out + [spec("scaling", CNN_MODEL, c, s, quick) for c in ("fp32", "amp_fp16", *CNN_SCALING_CELLS)
                  for s in seeds(quick)]


def epochs_specs(quick: bool) -> list[Spec]:
    return [spec("epochs", EPOCHS_MODEL, c, s, quick) for c in RECIPES[EPOCHS_MODEL].cells for s in seeds(quick)]


def fp8_specs(quick: bool) -> list[Spec]:
    out = [spec("fp8", FP8_MODEL, c, s, quick) for c in ("fp32", "fp8", "fp8_none", "fp8_dyn") for s in seeds(quick)]
    return out + [spec("fp8", FP8_MODEL, c, s, quick) for c in ("fp8", "fp8_nosr") for s in seeds(quick, SR_SEEDS)]


TELEMETRY = ("telemetry=gradients", "telemetry.shadow=true", "telemetry.max_layers=null")
# (recipe, cell): the histograms of FP32, FP16 unscaled, FP16 scaled, and FP8
TELEMETRY_RUNS = (
    (SCALING_MODEL, "fp32"), (SCALING_MODEL, "fp16_none"), (SCALING_MODEL, "fp16_static_128"),
    (CNN_MODEL, "fp32"), (CNN_MODEL, "fp16_none"), (FP8_MODEL, "fp8"),
    (FP8_MODEL, "fp8_none"), ("resnet50", "fp32"),
)


def telemetry_specs(quick: bool) -> list[Spec]:
    return [
        spec("telemetry", m, c, 0, quick, (*TELEMETRY, f"telemetry.every={max(run_steps(m, quick) // 10, 1)}"), "tel")
        for m, c in TELEMETRY_RUNS
    ]


PARTS = {"parity": parity_specs, "scaling": scaling_specs, "epochs": epochs_specs, "fp8": fp8_specs,
         "telemetry": telemetry_specs}


def specs(quick: bool = False) -> list[Spec]:
    """The plan's runs (the harness's entry point)."""
    return all_specs(quick)


def all_specs(quick: bool) -> list[Spec]:
    """Every run once (the same recipe, cell and seed is one run, whichever parts use it)."""
    seen: dict[str, Spec] = {}
    for f in PARTS.values():
        for s in f(quick):
            seen.setdefault(s.name, s)
    return list(seen.values())


def model_cells(model: str) -> list[str]:
    """Every cell that the study runs on ``model``, parity cells first."""
    out = list(RECIPES[model].cells)
    for s in all_specs(quick=False):
        if s.group == model and not s.tag and s.cell not in out:
            out.append(s.cell)
    return out


def model_seeds(model: str) -> list[int]:
    return sorted({s.seed for s in all_specs(quick=False) if s.group == model and not s.tag})


# ------------------------------------------------------------------------------------------ records


def _digest(r: dict) -> tuple | None:
    d = r.get("pairing_digests")
    return tuple(sorted(d.items())) if d else None


def _group(r: dict) -> tuple[str, str]:
    return r["model"], "tel" if r["part"] == "telemetry" else ""


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


def record(s: Spec, run_dir: Path, code: CodeState | None = None) -> dict:
    """One run's row of results.json (``paired`` is decided over all rows: see mark_pairing)."""
    from mptrain.report import read_curves

    base, summary = base_record(s, run_dir, code)
    r: dict = dict(part=s.part, name=s.name, model=s.group, cell=s.cell, seed=s.seed, command=s.command,
                   git_commit=base["commit"], git_dirty=base["code_dirty"], cpu_capability=base["cpu_capability"])
    if summary is None:
        return {**r, "status": "missing", "stale": None, "paired": False}
    scaler = next(iter((summary.get("loss_scale_state") or {}).values()), {}) or {}
    r.update(
        status=summary["status"], stale=base["stale"], steps=summary.get("steps"),
        precision_resolved=summary.get("precision_resolved"), loss_scale=summary.get("loss_scale"),
        metrics=summary.get("metrics") or {},
        final_loss=summary.get("final_loss"),  # one batch's loss at the last step: noisy
        skipped_steps=summary.get("skipped_steps"), final_loss_scale=summary.get("final_loss_scale"),
        floor_binds=scaler.get("floor_binds"), wall_time_s=summary.get("wall_time_s"),
        pairing_digests=summary.get("pairing"), telemetry=telemetry_digest(summary),
    )
    # Issue 18, item 6: a loss spike late in training is a precision event the final metric can
    # hide, so every run reports its largest one-batch loss over the second half of its steps.
    losses = read_curves(run_dir, ("train/loss",)).get("train/loss") or []
    late = [v for step, v in losses if step > (summary.get("steps") or 0) / 2]
    r["late_loss_max"] = max(late) if late else None
    metric = RECIPES[s.group].metric
    if RECIPES[s.group].evals > 1 and not s.tag:
        r["val_curve"] = read_curves(run_dir, (f"val/{metric}",)).get(f"val/{metric}")
    return r


def mark_paired(recs: list[dict]) -> None:
    """Each row's ``paired``: current, and its digests (initial weights as FP16, the global RNG at
    step 0) equal to its FP32 twin's of the same recipe and seed (telemetry runs: among themselves)."""
    mark_pairing(recs, _digest, _group)


# ------------------------------------------------------------------------------------------ claims


class Table:
    """Completed runs by (recipe, cell, seed), read by the claims and the tables."""

    def __init__(self, recs: list[dict]) -> None:
        self.recs = recs
        self.by = {(r["model"], r["cell"], r["seed"]): r for r in recs if r["part"] != "telemetry"}

    def value(self, model: str, cell: str, seed: int, paired_only: bool = False) -> float | None:
        r = self.by.get((model, cell, seed))
        if r is None or r.get("status") != "completed" or (paired_only and not r.get("paired")):
            return None
        v = r["metrics"].get(RECIPES[model].metric)
        return None if v is None or not math.isfinite(v) else float(v)

    def values(self, model: str, cell: str, paired_only: bool = False) -> dict[int, float]:
        out = {}
        for s in model_seeds(model):
            v = self.value(model, cell, s, paired_only)
            if v is not None:
                out[s] = v
        return out

    def obs(self, model: str, cell: str, epoch: int | None = None) -> list[Obs]:
        """The cell's runs as observations: the final metric, or the value after evaluation
        ``epoch`` (1-based); a run without that evaluation is left out and named."""
        metric = RECIPES[model].metric
        rows = [r for s in model_seeds(model) if (r := self.by.get((model, cell, s)))]
        if epoch is None:
            return observations(rows, lambda r: r["metrics"].get(metric), _digest)

        def at(r: dict) -> float | None:
            curve = r.get("val_curve") or []
            return float(curve[epoch - 1][1]) if len(curve) >= epoch else None

        out = observations(rows, at, _digest)
        for o in out:
            if o.value is None and o.left_out is None:
                o.left_out = f"no finite evaluation after epoch {epoch}"
        return out

    def margin(self, model: str) -> Margin:
        r = RECIPES[model]
        return Margin(r.margin, relative=r.metric == "ppl")  # points of top-1, or % of perplexity

    def judge(
        self, claim: str, kind: str, model: str, cell: str, ref: str = "fp32", epoch: int | None = None
    ) -> Verdict:
        r = RECIPES[model]
        v, _ = judge_cells(claim, kind, self.obs(model, cell, epoch), self.obs(model, ref, epoch), self.margin(model),
                           r.unit, r.worse_sign)
        return v

    def diffs(self, model: str, cell: str, ref: str = "fp32") -> list[float]:
        """The paired differences (cell - ref, per paired seed) in the claim's unit."""
        return pair(self.obs(model, cell), self.obs(model, ref), self.margin(model).diff).finite

    def unpaired(self, model: str, cell: str) -> list[int]:
        """Seeds whose run completed but is not paired with its FP32 twin (left out of the claims)."""
        return [s for s in model_seeds(model)
                if (r := self.by.get((model, cell, s))) and r.get("status") == "completed" and not r.get("paired")]

    def mean(self, model: str, cell: str) -> float | None:
        v = list(self.values(model, cell, paired_only=True).values())
        return statistics.fmean(v) if v else None


def static_by_mean(t: Table, model: str, grid: tuple[int, ...], best: bool) -> str | None:
    """The grid's best (or worst) static scale by its mean (chosen on the same runs it is then
    judged on: the optimistic choice that a practitioner's search would make)."""
    cells = [f"fp16_static_{s}" for s in grid if t.values(model, f"fp16_static_{s}", paired_only=True)]
    if not cells:
        return None
    sign = RECIPES[model].worse_sign
    return (min if best else max)(cells, key=lambda c: sign * (t.mean(model, c) or 0.0))


def not_measured(claim: str) -> Verdict:
    return Verdict(claim, "not measured", math.nan, (math.nan, math.nan), 0, math.nan, "", "equivalent", None, [])


def claim_c(t: Table, m: str, grid: tuple[int, ...], adaptive: Verdict) -> tuple[list[Verdict], str] | None:
    best, worst = static_by_mean(t, m, grid, True), static_by_mean(t, m, grid, False)
    if not (best and worst):
        return None
    return [
        t.judge(f"{m}: the grid's worst static scale ({worst}) is worse than its best ({best})",
                "worse", m, worst, best),
        t.judge(f"{m}: dynamic (defaults) matches the best static scale ({best})", "equivalent", m, "amp_fp16", best),
        adaptive,
    ], f"(c) A static scale needs a search, dynamic and adaptive do not ({m}, grid {list(grid)})"


def claims(t: Table) -> list[dict]:
    out: list[dict] = []

    def add(group: str, parts: list[Verdict], text: str) -> None:
        out.append({"id": group, "claim": text, "verdict": combine([p.verdict for p in parts]),
                    "parts": [p.as_dict() for p in parts]})

    # (a) parity, every model and low-precision cell against FP32
    for m in ("alexnet", "resnet50", "lstm_lm"):
        r = RECIPES[m]
        parts = [t.judge(f"{m}: {c} matches fp32 within {r.margin} {r.unit}", "equivalent", m, c)
                 for c in r.cells if c != "fp32"]
        add(f"a/{m}", parts, f"(a) Parity on {m}: every low precision matches FP32 within {r.margin} {r.unit}")

    m, r = SCALING_MODEL, RECIPES[SCALING_MODEL]
    # (b) unscaled FP16 loses; the paper's static 8 and 128 and dynamic recover FP32 (1 epoch)
    add("b", [
        t.judge(f"{m}: amp_fp16 without loss scaling is worse than fp32 by more than {r.margin} {r.unit}",
                "worse", m, "fp16_none"),
        t.judge(f"{m}: static scale 8 matches fp32", "equivalent", m, "fp16_static_8"),
        t.judge(f"{m}: static scale 128 matches fp32", "equivalent", m, "fp16_static_128"),
        t.judge(f"{m}: dynamic scaling matches fp32", "equivalent", m, "amp_fp16"),
    ], f"(b) Loss scaling is needed ({m}, 1 epoch): FP16 unscaled loses, static 8/128 and dynamic recover FP32")
    cm, cr = CNN_MODEL, RECIPES[CNN_MODEL]
    add("b/cnn", [
        t.judge(f"{cm}: amp_fp16 without loss scaling is worse than fp32 by more than {cr.margin} {cr.unit}",
                "worse", cm, "fp16_none"),
        t.judge(f"{cm}: dynamic scaling matches fp32", "equivalent", cm, "amp_fp16"),
    ], f"(b, CNN) {cm}: FP16 without loss scaling loses accuracy, dynamic scaling recovers it")
    # (c) a static scale needs a search; dynamic and adaptive, at their defaults, match the best one
    c = claim_c(t, m, STATIC_GRID, not_measured(f"{m}: adaptive (defaults) matches the best static scale: "
                                                 f"{ADAPTIVE_LSTM_REFUSED}"))
    if c:
        add("c", *c)
    # adaptive where mptrain can run it: at its defaults (no search) it should do what dynamic does
    add("c/cnn", [
        t.judge(f"{cm}: adaptive (defaults) matches fp32", "equivalent", cm, "fp16_adaptive"),
        t.judge(f"{cm}: adaptive (defaults) matches dynamic (defaults)", "equivalent", cm, "fp16_adaptive", "amp_fp16"),
    ], f"(c, CNN) Adaptive scaling needs no search ({cm}): at its defaults it matches FP32 and dynamic")
    # (d) FP8 in Mellempudi et al.'s format (E5M2, no per-tensor scales, SR) with an enhanced-scaling
    # schedule built here: unscaled degrades, enhanced recovers, its floor and SR matter
    f, fr = FP8_MODEL, RECIPES[FP8_MODEL]
    beyond = f"by more than {fr.margin} {fr.unit}"  # a "worse" part is judged against the margin
    add("d", [
        t.judge(f"{f}: fp8 without loss scaling is worse than fp32 {beyond}", "worse", f, "fp8_none"),
        t.judge(f"{f}: fp8 with enhanced scaling (and SR) matches fp32", "equivalent", f, "fp8"),
        t.judge(f"{f}: fp8 with enhanced's dynamic rule but no floor is worse than with the floor {beyond}",
                "worse", f, "fp8_dyn", "fp8"),
        t.judge(f"{f}: fp8 without stochastic rounding is worse than with it {beyond}", "worse", f, "fp8_nosr", "fp8"),
    ], f"(d) FP8 (E5M2, no per-tensor scaling) on {f}: unscaled degrades, enhanced recovers, its floor and SR matter")
    # (e) on its own runs, 4 epochs: the LM needs a scale, and still does at the end
    e, er = EPOCHS_MODEL, RECIPES[EPOCHS_MODEL]
    add("e", [
        t.judge(f"{e}: amp_fp16 without loss scaling is worse than fp32 by more than {er.margin} {er.unit} "
                "after 4 epochs", "worse", e, "fp16_none"),
        t.judge(f"{e}: dynamic (amp_fp16) matches fp32 after 4 epochs", "equivalent", e, "amp_fp16"),
        t.judge(f"{e}: fp16_master with dynamic scaling matches fp32 after 4 epochs", "equivalent", e, "fp16_master"),
    ], f"(e) The LSTM LM needs a loss scale ({e}: its own runs, 4 epochs, 2,240 positions per loss)")
    holm_parts([p for c in out for p in c["parts"]])
    for c in out:
        c["holm_verdict"] = combine([p["verdict"] if p["holm"] else "inconclusive" for p in c["parts"]])
    return out


# On the CNNs' accuracy near 100%, an absolute margin says little: the error-rate ratio (issue 27)
# judges the same runs again, parity within [1/ERROR_RATIO_MARGIN, ERROR_RATIO_MARGIN] of FP32's
# error (the default of mptrain-report --verdicts), Holm over its own family.
ERROR_RATIO_MARGIN = 1.1


def error_ratios(t: Table) -> list[dict]:
    """Every CNN parity cell's error rate against FP32's: geometric mean ratio over paired seeds."""
    out = []
    for m in ("alexnet", "resnet50"):
        for c in RECIPES[m].cells[1:]:
            pairs = pair(t.obs(m, c), t.obs(m, "fp32"), log_error_ratio)
            v = judge(f"{m}: {c}'s error rate is within x{ERROR_RATIO_MARGIN:g} of fp32's", "equivalent",
                      pairs.finite, math.log(ERROR_RATIO_MARGIN), "log error ratio", pairs.names, +1)
            ex = lambda x: math.exp(x) if math.isfinite(x) else None  # noqa: E731
            out.append({"model": m, "cell": c, "claim": v.claim, "verdict": v.verdict, "ratio": ex(v.effect),
                        "lo": ex(v.ci95[0]), "hi": ex(v.ci95[1]), "n_seeds": v.n_seeds, "p_value": v.p_value,
                        "margin": ERROR_RATIO_MARGIN, "seeds_to_decide": v.seeds_to_decide,
                        "seeds_if_equal": v.seeds_if_equal,
                        "fp32_error": 100 - (t.mean(m, "fp32") or math.nan), "unpaired": pairs.unpaired})
            # what the absolute margin allows, as a ratio: FP32's mean error plus the margin, over it
            out[-1]["abs_margin_ratio"] = (out[-1]["fp32_error"] + RECIPES[m].margin) / out[-1]["fp32_error"]
    keep = holm([r["p_value"] for r in out])
    for r, k in zip(out, keep, strict=True):
        r["holm"] = bool(k and r["verdict"] != "inconclusive")
    return out


# ------------------------------------------------------------------------------------------ tables


def fmt(x: float | None, spec: str = ".2f") -> str:
    return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def ms(vals: list[float]) -> str:
    if not vals:
        return "—"
    if len(vals) == 1:
        return f"{vals[0]:.2f}"
    return f"{statistics.fmean(vals):.2f} ± {statistics.stdev(vals):.2f}"


def cell_table(t: Table, model: str, cells: list[str]) -> list[str]:
    r = RECIPES[model]
    seeds = model_seeds(model)
    lines = [f"| cell | val {r.metric} mean ± std | per seed ({seeds[0]}..{seeds[-1]}) | paired with fp32 "
             f"| paired Δ vs fp32 ({r.unit}) | skipped steps | final scale | floor binds |",
             "|---|---|---|---|---|---|---|---|"]
    for c in cells:
        vals = t.values(model, c)
        if not vals:
            continue
        diffs = t.diffs(model, c)
        recs = [t.by.get((model, c, s)) or {} for s in seeds]
        paired = " ".join("—" if not x else ("yes" if x.get("paired") else "**no**") for x in recs)
        binds = " ".join(str(x.get("floor_binds")) for x in recs if x.get("floor_binds") is not None)
        lines.append(
            f"| {c} | {ms(list(vals.values()))} | {' '.join(fmt(vals.get(s), '.2f') for s in seeds)} | {paired} | "
            f"{ms(diffs) if c != 'fp32' else ''} | {' '.join(str(x.get('skipped_steps', '—')) for x in recs)} | "
            f"{' '.join(fmt(x.get('final_loss_scale'), '.0f') for x in recs)} | {binds} |"
        )
    return lines


def epoch_penalties(t: Table) -> dict[str, list[dict]]:
    """(b)/(e) past one epoch: each cell's paired penalty against FP32 (% perplexity) after every
    epoch, for results.json (the README's prose and table read it from there)."""
    m, r = EPOCHS_MODEL, RECIPES[EPOCHS_MODEL]
    out: dict[str, list[dict]] = {}
    for c in r.cells[1:]:
        out[c] = []
        for k in range(1, r.evals + 1):
            v = t.judge("", "equivalent", m, c, epoch=k)
            out[c].append({"epoch": k, "effect": v.effect, "lo": v.ci95[0], "hi": v.ci95[1], "n_seeds": v.n_seeds})
    return out


def telemetry_table(recs: list[dict]) -> list[str]:
    lines = ["| run | format | act grad values lost (mean over layers) | worst layer | "
             "weight grad values lost (mean) | act grads below the format's smallest subnormal: mean over layers | "
             "the same, all values pooled | exact zeros (pooled) | val metric |",
             "|---|---|---|---|---|---|---|---|---|"]
    pct = lambda v: "—" if v is None else f"{100 * v:.2f}%"  # noqa: E731
    for r in recs:
        d = r.get("telemetry")
        if r["part"] != "telemetry" or not d:
            continue
        metric = RECIPES[r["model"]].metric
        lines.append(
            f"| {r['model']} {r['cell']} | {d['format']} | {pct(d['act_lost_frac_mean'])} | "
            f"{d['act_lost_worst_layer']} {pct(d['act_lost_frac_max'])} | {pct(d['weight_lost_frac_mean'])} | "
            f"{pct(d['act_underflow_frac_mean'])} | {pct(d.get('act_hist_below_tiny_frac'))} | "
            f"{pct(d['act_hist_zero_frac'])} | {fmt(r['metrics'].get(metric))} |"
        )
    return lines


# ------------------------------------------------------------------------------------------ report


def claim_rows(t: Table) -> list[dict]:
    return [dict(id=c["id"], claim=c["claim"], verdict=c["verdict"], holm_verdict=c["holm_verdict"],
                 effect=[p["effect"] for p in c["parts"]], ci95=[p["ci95"] for p in c["parts"]],
                 n_seeds=[p["n_seeds"] for p in c["parts"]], runs=sorted({n for p in c["parts"] for n in p["runs"]}),
                 parts=c["parts"]) for c in claims(t)]


def without_uncommitted(recs: list[dict], cl: list[dict]) -> list[dict]:
    """The parts whose verdict or seeds change when the runs trained from uncommitted trees are
    left out (issue 27: their code is not known), Holm recomputed over the study."""
    kept = [{**r, "paired": r.get("paired") and r.get("git_dirty") is False} for r in recs]
    changed = []
    for a, b in zip(cl, claim_rows(Table(kept)), strict=True):
        for i, (p, q) in enumerate(zip(a["parts"], b["parts"], strict=True)):
            if (p["verdict"], p["n_seeds"], p["holm"]) != (q["verdict"], q["n_seeds"], q["holm"]):
                changed.append({"claim": a["id"], "part": i, "text": p["claim"],
                                "n_seeds": [p["n_seeds"], q["n_seeds"]], "verdict": [p["verdict"], q["verdict"]],
                                "holm": [p["holm"], q["holm"]], "effect": q["effect"], "ci95": q["ci95"]})
    return changed


def derived(recs: list[dict]) -> dict[str, Any]:
    """Everything results.json holds that comes from the runs alone: the claims, the per-epoch
    penalties, the error-rate ratios, totals and provenance."""
    t = Table(recs)
    cl = claim_rows(t)
    return dict(
        claims=cl,
        epochs=epoch_penalties(t),
        error_ratios=error_ratios(t),
        # the study's cost: every completed run's own wall time, one thread each (2 ran at a time)
        totals=dict(runs=sum(r.get("status") == "completed" for r in recs),
                    run_hours=sum(r.get("wall_time_s") or 0.0 for r in recs) / 3600),
        provenance={**provenance(recs, "git_commit", "git_dirty"),
                    "without_uncommitted": without_uncommitted(recs, cl)},
    )


def write_docs(results: dict, out: Path) -> None:
    """tables.md and README.md (from README.template.md) from results.json's content."""
    from study_plans.prose import epochs_table, error_ratio_lines, provenance_lines, render_readme, verdict_lines

    recs = results["runs"]
    t = Table(recs)
    incomplete = [r["name"] for r in recs if r.get("status") != "completed" or r.get("stale")
                  or (r["part"] != "telemetry" and not r.get("paired"))]
    md = ["# Study tables (generated by `python scripts/study.py report papers`; see README.md)", ""]
    md += ["## Verdicts", "", "Claims use paired runs only (digests equal to their FP32 twin's, current code). "
           "p: the one-sided test of the verdict reached; Holm: over every distinct part at 2.5% family-wise. "
           "(b) and (e) rest on different runs: (b) the 1-epoch LM, (e) the 4-epoch LM.", "",
           *verdict_lines(results["claims"], results["recipes"]), ""]
    md += ["## Error-rate ratios of the CNN parity cells", "", *error_ratio_lines(results["error_ratios"]), ""]
    for m in RECIPES:
        md += [f"## {m}", "", f"`{' '.join(RECIPES[m].overrides)}`, {RECIPES[m].steps} steps", "",
               *cell_table(t, m, model_cells(m)), ""]
    md += [f"## {EPOCHS_MODEL}: the paired penalty after each epoch ((b) and (e) past one epoch)", "",
           *epochs_table(results["epochs"]), ""]
    md += ["## Telemetry (seed 0, FP32 shadow pass: lost = nonzero in FP32, zero in the run; shares of all values, "
           "zeros included)", "", *telemetry_table(recs), ""]
    md += ["## Provenance", "", *provenance_lines(results["provenance"]), ""]
    if incomplete:
        md += [f"Runs missing, stale or unpaired (left out of every claim): {', '.join(incomplete)}", ""]
    (out / "tables.md").write_text("\n".join(md) + "\n")
    template = DOCS / "README.template.md"
    if template.exists():
        readme = render_readme(template.read_text(), results, strict=False)
        if "[missing: " in readme:
            print(f"README.template.md names figures these results lack: see [missing: ...] in {out / 'README.md'}")
        (out / "README.md").write_text(readme)


def report(runs: Path, out: Path, quick: bool, code: CodeState) -> dict:
    """results.json, tables.md, the PNGs and README.md from the run dirs."""
    import torch

    from study_plans.papers_figures import figures

    sp = all_specs(quick)
    recs = [record(s, runs / s.name, code) for s in sp]
    mark_paired(recs)
    out.mkdir(parents=True, exist_ok=True)
    caps = sorted({str(r.get("cpu_capability")) for r in recs if r.get("status") == "completed"})
    results = dict(
        date=date.today().isoformat(),
        generated_by="scripts/study.py report papers" + (" --quick" if quick else ""),
        machine=dict(cpu=platform.processor() or platform.machine(), cores=os.cpu_count(),
                     cpu_capability=torch.backends.cpu.get_cpu_capability(), python=platform.python_version(),
                     torch=torch.__version__, omp_num_threads=1, platform=platform.platform(),
                     runs_cpu_capabilities=caps),
        recipes={k: dict(overrides=list(v.overrides), steps=v.steps, metric=v.metric, margin=v.margin,
                         cells=list(v.cells), evals=v.evals) for k, v in RECIPES.items()},
        **derived(recs),
        figures=figures(Table(recs), runs, sp, out),
        runs=recs,
    )
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    write_docs(results, out)
    return results


def render(out: Path = DOCS) -> dict:
    """results.json's derived sections, tables.md and README.md again from results.json's runs
    (no run dirs needed; the PNGs stay as they are)."""
    results = read_json(out / "results.json")
    if results is None:
        raise SystemExit(f"{out / 'results.json'}: not found")
    results.update(derived(results["runs"]))
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    write_docs(results, out)
    return results


def summary_lines(results: dict) -> list[str]:
    from study_plans.prose import verdict_lines

    cl = results["claims"]
    return [*verdict_lines(cl), f"holds: {sum(c['verdict'] == HOLDS for c in cl)} of {len(cl)} claims"]
