#!/usr/bin/env python
"""The papers' claims, decided with confidence intervals over paired seeds, on CPU (issues 12, 18).

    python scripts/study.py all              # every part, then the report (see docs/results for the time)
    python scripts/study.py all --quick      # 2 seeds, a tenth of the steps; report in runs/study/quick
    python scripts/study.py parity|scaling|epochs|fp8|telemetry   # one part's runs (then `report`)
    python scripts/study.py report           # results.json, tables.md, README.md and the PNGs

The plan (recipes, cells, the runs of each part) is scripts/study_parts.py; running, stamps and
pairing are scripts/study_runs.py. Every run is ``python -m mptrain <overrides>
hydra.run.dir=<runs>/<name>`` with one thread; a completed run is cached only while its stamp
(CODE_VERSION, command) matches: a stale one is re-run, or kept with --keep-stale and reported as
unpaired. Runs go under the git-ignored ``runs/study``; the full report writes docs/results/.

Every claim compares a cell with FP32 (or with another cell) **on the same seed**: same initial
weights, batch order and dropout masks, so the difference cancels the seed-to-seed spread that both
share. Only runs whose pairing digests match their FP32 twin's enter a claim. The verdict comes
from the 95% t-interval of those paired differences (mptrain/verdicts.py), Holm-corrected over
every part of the study.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import platform
import statistics
import sys
import time
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from study_parts import (  # noqa: E402
    ADAPTIVE_LSTM_REFUSED,
    CNN_MODEL,
    CODE_VERSION,
    EPOCHS_MODEL,
    FP8_MODEL,
    PARTS,
    RECIPES,
    SCALING_MODEL,
    STATIC_GRID,
    Spec,
    all_specs,
    model_cells,
    model_seeds,
)
from study_runs import mark_pairing, read_json, record, run_specs  # noqa: E402

from mptrain.verdicts import HOLDS, Verdict, combine, holm, judge  # noqa: E402

# A plotted effect beyond this many margins is drawn as an arrow with its value, not to scale.
OFFSCALE = 50

DOCS = ROOT / "docs" / "results"


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

    def paired(
        self, model: str, cell: str, ref: str = "fp32", epoch: int | None = None
    ) -> tuple[list[float], list[str]]:
        """Per seed where both runs are paired: cell - ref in points of top-1, or
        100 (ppl / ppl_ref - 1) in % of perplexity. ``epoch``: the value after that evaluation (1-based)
        instead of the final one."""
        a, b = self._at(model, cell, epoch), self._at(model, ref, epoch)
        diffs, names = [], []
        for s in sorted(set(a) & set(b)):
            d = a[s] - b[s] if RECIPES[model].metric == "top1" else 100 * (a[s] / b[s] - 1)
            diffs.append(d)
            names += [f"{model}-{cell}-s{s}", f"{model}-{ref}-s{s}"]
        return diffs, names

    def _at(self, model: str, cell: str, epoch: int | None) -> dict[int, float]:
        if epoch is None:
            return self.values(model, cell, paired_only=True)
        out = {}
        for s in model_seeds(model):
            r = self.by.get((model, cell, s))
            curve = (r or {}).get("val_curve") or []
            if r and r.get("paired") and len(curve) >= epoch and math.isfinite(curve[epoch - 1][1]):
                out[s] = float(curve[epoch - 1][1])
        return out

    def unpaired(self, model: str, cell: str) -> list[int]:
        """Seeds whose run completed but is not paired with its FP32 twin (left out of the claims)."""
        return [s for s in model_seeds(model)
                if (r := self.by.get((model, cell, s))) and r.get("status") == "completed" and not r.get("paired")]

    def judge(
        self, claim: str, kind: str, model: str, cell: str, ref: str = "fp32", epoch: int | None = None
    ) -> Verdict:
        r = RECIPES[model]
        diffs, names = self.paired(model, cell, ref, epoch)
        return judge(claim, kind, diffs, r.margin, r.unit, names, r.worse_sign)  # type: ignore[arg-type]

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
    # (d) FP8 as Mellempudi et al.: E5M2 unscaled degrades, enhanced scaling recovers, its floor and SR matter
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
    mark_holm(out)
    return out


def mark_holm(cl: list[dict]) -> None:
    """Holm over every distinct hypothesis of the study (a part that two claims share counts once),
    at 2.5% family-wise, the one-sided level each 95% interval already uses: a decided part
    survives when its p-value passes."""
    keys: dict[tuple, float] = {}
    for c in cl:
        for p in c["parts"]:
            keys.setdefault((p["kind"], p["margin"], tuple(p["runs"])), p["p_value"])
    order = list(keys)
    keep = dict(zip(order, holm([keys[k] for k in order]), strict=True))
    for c in cl:
        for p in c["parts"]:
            decided = p["verdict"] not in ("inconclusive", "not measured")
            p["holm"] = bool(decided and keep[(p["kind"], p["margin"], tuple(p["runs"]))])
        c["holm_verdict"] = combine([p["verdict"] if p["holm"] else "inconclusive" for p in c["parts"]])


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
        diffs, _ = t.paired(model, c)
        recs = [t.by.get((model, c, s)) or {} for s in seeds]
        pair = " ".join("—" if not x else ("yes" if x.get("paired") else "**no**") for x in recs)
        binds = " ".join(str(x.get("floor_binds")) for x in recs if x.get("floor_binds") is not None)
        lines.append(
            f"| {c} | {ms(list(vals.values()))} | {' '.join(fmt(vals.get(s), '.2f') for s in seeds)} | {pair} | "
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
    lines = ["| run | format | act grads lost (mean over layers) | worst layer | weight grads lost (mean) | "
             "act grads below the format's smallest subnormal: mean over layers | the same, all values pooled | "
             "exact zeros (pooled) | val metric |",
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


# ------------------------------------------------------------------------------------------ figures


def off_scale(ax, x: float, text: str, top: bool) -> None:
    """An arrow at the plot's top (or bottom) edge for a value too far out to draw to scale."""
    edge = (1.0, 0.8) if top else (0.0, 0.2)
    ax.annotate(text, xy=(x, edge[0]), xycoords=("data", "axes fraction"), xytext=(x, edge[1]),
                textcoords=("data", "axes fraction"), ha="right", fontsize=7, color="tab:red",
                arrowprops={"arrowstyle": "->", "color": "tab:red"})


def figures(t: Table, runs: Path, specs: list[Spec], out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from mptrain.report import read_curves

    written: list[str] = []

    def save(fig: plt.Figure, name: str) -> None:
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        written.append(name)

    def curve(model: str, cell: str, seed: int, tag: str) -> list[tuple[int, float]]:
        rec = t.by.get((model, cell, seed))
        if not rec or rec.get("status") != "completed":
            return []
        return read_curves(runs / rec["name"], (tag,)).get(tag) or []

    # 1. parity: paired difference against FP32 with its 95% CI, the margin shaded; paired runs only
    models = ["alexnet", "resnet50", "lstm_lm"]
    fig, axes = plt.subplots(1, len(models), figsize=(4.6 * len(models), 3.8))
    for ax, m in zip(axes, models, strict=True):
        r = RECIPES[m]
        xs, ys, errs = [], [], []
        for c in [c for c in model_cells(m) if c != "fp32"]:
            v = t.judge("", "equivalent", m, c)
            if v.n_seeds >= 2:
                left = len(t.unpaired(m, c))
                xs.append(f"{c} (n={v.n_seeds}{f', unpaired left out: {left}' if left else ''})")
                ys.append(v.effect)
                errs.append([[v.effect - v.ci95[0]], [v.ci95[1] - v.effect]])
        ax.axhspan(-r.margin, r.margin, color="tab:green", alpha=0.15, label=f"±{r.margin} margin")
        ax.axhline(0, color="black", lw=0.8)
        # A cell that fails by orders of magnitude (the LM's static 2^24) would flatten every other
        # interval to a dot: it is drawn as an arrow at the plot's edge with its value written out.
        far = [abs(y) - e[0 if y > 0 else 1][0] > OFFSCALE * r.margin for y, e in zip(ys, errs, strict=True)]
        for i, (y, e, f) in enumerate(zip(ys, errs, far, strict=True)):
            if not f:
                ax.errorbar([i], [y], yerr=e, fmt="o", color="tab:blue", capsize=4)
        for i, (y, f) in enumerate(zip(ys, far, strict=True)):
            if f:
                off_scale(ax, i, f"{y:+.0f} (off scale)", top=y > 0)
        ax.set_xticks(range(len(xs)), xs, rotation=35, ha="right", fontsize=7)
        ax.set_ylabel(f"Δ vs fp32, {r.unit}" + (" (higher is worse)" if r.metric == "ppl" else ""))
        ax.set_title(f"{m}: paired Δ vs FP32, 95% CI (paired runs only)", fontsize=9)
        ax.legend(fontsize=7)
    save(fig, "parity.png")

    # 2. loss curves, mean over paired seeds at each step (aligned by step, not by list position)
    fig, axes = plt.subplots(1, len(models), figsize=(4.6 * len(models), 3.6))
    for ax, m in zip(axes, models, strict=True):
        for c in [c for c in model_cells(m) if c in (*RECIPES[m].cells, "fp16_none")]:
            by_step: dict[int, list[float]] = {}
            n = 0
            for s in model_seeds(m):
                if not (t.by.get((m, c, s)) or {}).get("paired"):
                    continue
                pts = curve(m, c, s, "train/loss")
                n += bool(pts)
                for step, v in pts:
                    by_step.setdefault(step, []).append(v)
            if by_step:
                steps = sorted(k for k, v in by_step.items() if len(v) == n)
                ax.plot(steps, [statistics.fmean(by_step[k]) for k in steps], label=f"{c} (n={n})", lw=1.0)
        ax.set_yscale("log")
        ax.set_xlabel("step")
        ax.set_ylabel("train loss, one batch per step (mean over seeds)")
        ax.set_title(m, fontsize=9)
        ax.legend(fontsize=7)
    save(fig, "loss_curves.png")

    # 3. activation-gradient histograms, as stored (scale included), from the telemetry runs
    tel = [(s, read_json(runs / s.name / "summary.json")) for s in specs if s.part == "telemetry"]
    tel = [(s, summ) for s, summ in tel if summ and (summ.get("telemetry") or {}).get("model")]
    if tel:
        fig, axes = plt.subplots(len(tel), 1, figsize=(10, 2.3 * len(tel)), sharex=True)
        axes = [axes] if len(tel) == 1 else axes
        for ax, (s, summ) in zip(axes, tel, strict=True):
            tm = summ["telemetry"]["model"]
            h = tm["act_grad_histogram"]
            edges, counts = h["log2_edges"], h["counts"]
            total = h["zero"] + sum(counts) + h["nonfinite"]
            fmt_name = "e5m2" if "e5m2" in tm.get("formats", []) else tm["format"]
            tiny = -16 if fmt_name == "e5m2" else -24  # the smallest subnormal of the run's format
            # nonzero values only: ReLU's exact zeros (most of a CNN's) would flatten the bars; the
            # title gives their share
            nonzero = max(sum(counts), 1)
            ax.bar([e + 0.5 for e in edges[:-1]], [100 * c / nonzero for c in counts], width=0.9,
                   color=["tab:red" if e < tiny else "tab:blue" for e in edges[:-1]])
            ax.axvline(tiny, color="red", ls="--", lw=1, label=f"smallest {fmt_name} subnormal 2^{tiny}")
            ax.set_ylabel("% of nonzero")
            below = sum(c for e, c in zip(edges[:-1], counts, strict=False) if e < tiny)
            ax.set_title(f"{s.model} {s.cell} (seed 0, computed in {tm['measured_in']}), of all values pooled "
                         f"over layers: exact zeros {100 * h['zero'] / total:.2f}%, below 2^{tiny} "
                         f"{100 * below / total:.2f}% ({100 * below / nonzero:.2f}% of nonzero)", fontsize=8)
            ax.legend(fontsize=7, loc="upper right")
        axes[-1].set_xlabel("log2 |activation gradient| as the hooks see it (loss scale included), all hooked layers")
        save(fig, "grad_histograms.png")

    # 4. final metric against the static scale, dynamic, adaptive, unscaled and FP32 marked
    fig, ax = plt.subplots(figsize=(7, 4))
    for m, grid in ((SCALING_MODEL, STATIC_GRID),):
        r = RECIPES[m]
        xs, ys, es = [], [], []
        for sc in grid:
            v = list(t.values(m, f"fp16_static_{sc}", paired_only=True).values())
            if v:
                xs.append(math.log2(sc))
                ys.append(statistics.fmean(v))
                es.append(statistics.stdev(v) if len(v) > 1 else 0)
        # as in parity.png: a scale that fails by orders of magnitude is an arrow with its value
        ref = t.mean(m, "fp32") or 0.0
        far = [abs(y / ref - 1) * 100 > OFFSCALE * r.margin if r.metric == "ppl" else abs(y - ref) > OFFSCALE * r.margin
               for y in ys]
        near = [(x, y, e) for x, y, e, f in zip(xs, ys, es, far, strict=True) if not f]
        if near:
            nx, ny, ne = zip(*near, strict=True)
            ax.errorbar(nx, ny, yerr=ne, fmt="o-", capsize=4, label="static scale (mean ± std)")
        if xs:
            ax.set_xlim(min(xs) - 1, max(xs) + 1)
        for x, y, f in zip(xs, ys, far, strict=True):
            if f:
                off_scale(ax, x, f"2^{x:.0f}: {y:.0f} (off scale)", top=True)
        for cell, style, label in [("fp32", "k-", "fp32"), ("amp_fp16", "g--", "dynamic"),
                                   ("fp16_adaptive", "m-.", "adaptive"), ("fp16_none", "r:", "no scaling")]:
            mu = t.mean(m, cell)
            if mu is not None:
                ax.axhline(mu, color=style[0], ls=style[1:], label=f"{label}: {mu:.2f}")
        ax.set_xlabel("log2 static loss scale")
        ax.set_ylabel(f"val {r.metric} ({'lower' if r.metric == 'ppl' else 'higher'} is better)")
        ax.set_title(f"{m}: final {r.metric} against the static loss scale (paired runs)", fontsize=9)
        ax.legend(fontsize=7)
    save(fig, "static_scale.png")

    # 5. (d): where enhanced's floor binds: its scale and floor per step, against the same rule without floor
    fig, ax = plt.subplots(figsize=(7, 3.6))
    for cell, color in (("fp8", "tab:blue"), ("fp8_dyn", "tab:orange")):
        pts = curve(FP8_MODEL, cell, 0, "train/loss_scale")
        if pts:
            ax.step([p[0] for p in pts], [p[1] for p in pts], where="post", color=color, label=f"{cell} scale (seed 0)")
    floor = curve(FP8_MODEL, "fp8", 0, "loss_scale/floor")
    binds = curve(FP8_MODEL, "fp8", 0, "loss_scale/floor_binds")
    if floor:
        ax.step([p[0] for p in floor], [p[1] for p in floor], where="post", color="tab:red", ls="--", label="fp8 floor")
    rises = [b[0] for a, b in itertools.pairwise(binds) if b[1] > a[1]]
    if rises:
        ax.scatter(rises, [dict(floor).get(x, 1) for x in rises], color="tab:red", zorder=3,
                   label="floor bound (within the logging window ending here)")
    ax.set_yscale("log", base=2)
    ax.set_xlabel("step")
    ax.set_ylabel("loss scale")
    ax.set_title(f"{FP8_MODEL} FP8: enhanced scaling's floor, where it binds", fontsize=9)
    ax.legend(fontsize=7)
    save(fig, "fp8_loss_scale.png")

    # 6. (b)/(e) past one epoch: the paired penalty after each epoch, with its 95% CI
    m, r = EPOCHS_MODEL, RECIPES[EPOCHS_MODEL]
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for j, c in enumerate(r.cells[1:]):
        pts = [(k, t.judge("", "equivalent", m, c, epoch=k)) for k in range(1, r.evals + 1)]
        pts = [(k + 0.08 * (j - 1), v) for k, v in pts if v.n_seeds >= 2]
        if pts:
            ax.errorbar([k for k, _ in pts], [v.effect for _, v in pts], capsize=4, fmt="o-", label=c,
                        yerr=[[v.effect - v.ci95[0] for _, v in pts], [v.ci95[1] - v.effect for _, v in pts]])
    ax.axhspan(-r.margin, r.margin, color="tab:green", alpha=0.15, label=f"±{r.margin}% margin")
    ax.axhline(0, color="black", lw=0.8)
    ax.set_xlabel("epoch")
    ax.set_ylabel("Δ val perplexity vs fp32, % (higher is worse)")
    ax.set_title(f"{m}: paired penalty per epoch, 95% CI", fontsize=9)
    ax.legend(fontsize=7)
    save(fig, "epochs.png")
    return written


def report(runs: Path, quick: bool, partial: bool = False) -> Path:
    """Write tables.md, results.json, the PNGs and (from its template) README.md. The full report
    goes to docs/results only when every run is complete, current and paired where it has a twin;
    otherwise (or with --quick) to <runs>/report, so partial data never replaces the study's."""
    import torch
    from study_prose import epochs_table, render_readme, verdict_lines

    specs = all_specs(quick)
    recs = [record(s, runs / s.name) for s in specs]
    mark_pairing(recs)
    incomplete = [r["name"] for r in recs if r.get("status") != "completed" or r.get("stale")
                  or (r["part"] != "telemetry" and not r.get("paired"))]
    out = runs / "report" if quick or incomplete else DOCS
    if incomplete and not quick:
        print(f"{len(incomplete)} runs missing, stale or unpaired: the report goes to {out}, not {DOCS}"
              + ("" if partial else " (pass --partial to accept that)"), flush=True)
        if not partial:
            raise SystemExit(2)
    out.mkdir(parents=True, exist_ok=True)
    t = Table(recs)
    cl = claims(t)
    md = ["# Study tables (generated by `python scripts/study.py report`; see README.md)", ""]
    md += ["## Verdicts", "", "Claims use paired runs only (digests equal to their FP32 twin's, same code version). "
           "p: the one-sided test of the verdict reached; Holm: over every distinct part at 2.5% family-wise. "
           "(b) and (e) rest on different runs: (b) the 1-epoch LM, (e) the 4-epoch LM.", "",
           *verdict_lines(cl), ""]
    for m in RECIPES:
        md += [f"## {m}", "", f"`{' '.join(RECIPES[m].overrides)}`, {RECIPES[m].steps} steps", "",
               *cell_table(t, m, model_cells(m)), ""]
    epochs = epoch_penalties(t)
    md += [f"## {EPOCHS_MODEL}: the paired penalty after each epoch ((b) and (e) past one epoch)", "",
           *epochs_table(epochs), ""]
    md += ["## Telemetry (seed 0, FP32 shadow pass: lost = nonzero in FP32, zero in the run)", "",
           *telemetry_table(recs), ""]
    if incomplete:
        md += [f"Runs missing, stale or unpaired (left out of every claim): {', '.join(incomplete)}", ""]
    (out / "tables.md").write_text("\n".join(md) + "\n")
    pngs = figures(t, runs, specs, out)
    caps = sorted({str(r.get("cpu_capability")) for r in recs if r.get("status") == "completed"})
    results = dict(
        date=date.today().isoformat(),
        generated_by="scripts/study.py report" + (" --quick" if quick else ""),
        code_version=CODE_VERSION,
        machine=dict(cpu=platform.processor() or platform.machine(), cores=os.cpu_count(),
                     cpu_capability=torch.backends.cpu.get_cpu_capability(), python=platform.python_version(),
                     torch=torch.__version__, omp_num_threads=1, platform=platform.platform(),
                     runs_cpu_capabilities=caps),
        recipes={k: dict(overrides=list(v.overrides), steps=v.steps, metric=v.metric, margin=v.margin,
                         cells=list(v.cells), evals=v.evals) for k, v in RECIPES.items()},
        claims=[dict(id=c["id"], claim=c["claim"], verdict=c["verdict"], holm_verdict=c["holm_verdict"],
                     effect=[p["effect"] for p in c["parts"]], ci95=[p["ci95"] for p in c["parts"]],
                     n_seeds=[p["n_seeds"] for p in c["parts"]],
                     runs=sorted({n for p in c["parts"] for n in p["runs"]}),
                     parts=c["parts"]) for c in cl],
        epochs=epochs,
        # the study's cost: every completed run's own wall time, one thread each (2 ran at a time)
        totals=dict(runs=sum(r.get("status") == "completed" for r in recs),
                    run_hours=sum(r.get("wall_time_s") or 0.0 for r in recs) / 3600),
        figures=pngs,
        runs=recs,
    )
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    template = DOCS / "README.template.md"
    if template.exists():
        readme = render_readme(template.read_text(), results, strict=False)
        if "[missing: " in readme:
            print(f"README.template.md names figures these results lack: see [missing: ...] in {out / 'README.md'}")
        (out / "README.md").write_text(readme)
    print("\n".join(verdict_lines(cl)))
    print(f"holds: {sum(c['verdict'] == HOLDS for c in cl)} of {len(cl)} claims; report in {out}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("part", choices=[*PARTS, "formats", "report", "all"])
    ap.add_argument("--quick", action="store_true", help="2 seeds and a tenth of the steps: a smoke run")
    ap.add_argument("--jobs", type=int, default=2, help="runs at once (each with one thread)")
    ap.add_argument("--runs", type=Path, default=ROOT / "runs" / "study", help="where run dirs go")
    ap.add_argument("--keep-stale", action="store_true",
                    help="keep cached runs of another code version or command (reported unpaired), not re-run them")
    ap.add_argument("--partial", action="store_true",
                    help="report even with runs missing, stale or unpaired (to <runs>/report, never docs/results)")
    args = ap.parse_args(argv)
    runs = args.runs / ("quick" if args.quick else "full")
    t0 = time.time()
    if args.part in ("formats", "all"):
        # Today's formats on the transformer LM (issue 19): its own runner, report and docs/results/formats.
        from study_formats import formats_part

        formats_part(quick=args.quick, rerun_stale=not args.keep_stale)
        if args.part == "formats":
            return 0
    if args.part != "report":
        specs = all_specs(args.quick) if args.part == "all" else PARTS[args.part](args.quick)
        run_specs(specs, runs, args.jobs, args.keep_stale)
        print(f"runs done in {time.time() - t0:.0f}s", flush=True)
    if args.part in ("report", "all"):
        report(runs, args.quick, args.partial or args.quick)
    return 0


if __name__ == "__main__":
    sys.exit(main())
