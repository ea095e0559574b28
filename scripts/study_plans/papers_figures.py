"""Plan ``papers``: its figures, drawn from the run dirs' TensorBoard curves and the claims' runs."""

from __future__ import annotations

import itertools
import math
import statistics
from pathlib import Path

from study_plans.harness import Spec, read_json
from study_plans.papers import (
    EPOCHS_MODEL,
    FP8_MODEL,
    RECIPES,
    SCALING_MODEL,
    STATIC_GRID,
    Table,
    model_cells,
    model_seeds,
)

# A plotted effect beyond this many margins is drawn as an arrow with its value, not to scale.
OFFSCALE = 50


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
            ax.set_title(f"{s.group} {s.cell} (seed 0, computed in {tm['measured_in']}), of all values pooled "
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
