"""``mptrain-report DIR --verdicts --margin 1%``: the paired verdict for every precision cell of a sweep.

    mptrain -m model=transformer_lm_tiny data=python_docs precision=fp32,amp_bf16,mx trainer.seed=0,1,2,3,4
    mptrain-report runs/multirun/<stamp> --verdicts --margin 1%

A *cell* is one configuration of the sweep without its seed: the job's overrides
(``.hydra/overrides.yaml``) less ``trainer.seed`` and ``precision.seed``. Each cell is compared with
its *baseline*, the FP32 cell whose overrides are the same once the precision and loss-scale keys
are set aside, seed by seed: a run enters only when its pairing digests (``pairing`` in
summary.json: the initial weights and the global RNG state at step 0) equal its FP32 twin's, so the
seed-to-seed spread that both share cancels in the difference. Runs that are not paired, not
finished, or whose twin is missing are named and left out.

Per cell: the mean paired difference with its 95% t-interval, the verdict against the margin
(mptrain/verdicts.py: *holds* when the interval lies inside ±margin, *does not hold* when it lies
wholly outside, else *inconclusive*), the one-sided p of that verdict, Holm over the table, and
the seeds it would take to decide. For an accuracy (in %), the same on the error-rate ratio
(error / FP32's error, a geometric mean over seeds), against ``--error-ratio-margin``.

Bad input (no baseline, one seed, a cell that mixes models or data, the metric missing) is one
line and exit status 2.
"""

from __future__ import annotations

import csv
import json
import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mptrain.errors import MptrainError
from mptrain.verdicts import FAILS, HOLDS, OPEN, Margin, Obs, Pairs, holm, judge, log_error_ratio, pair

SEED_KEYS = ("trainer.seed", "precision.seed")  # a run's seeds: they vary within a cell
PRECISION_KEYS = ("precision", "loss_scale")  # a cell's own keys: its baseline differs only in these
HIGHER_IS_BETTER = ("top1", "top5", "acc", "accuracy")
LOWER_IS_BETTER = ("ppl", "loss", "loss_g", "loss_d", "error", "err")
ACCURACY = ("top1", "top5", "acc", "accuracy")  # in %: the error-rate ratio is defined
COLUMNS = (
    "cell", "baseline", "model", "data", "metric", "claim", "margin", "unit", "n_paired", "seeds", "cell_mean",
    "baseline_mean", "effect", "ci_low", "ci_high", "verdict", "p_value", "holm", "seeds_to_decide",
    "seeds_if_equal", "error_ratio", "error_ratio_low", "error_ratio_high", "error_ratio_margin",
    "error_ratio_verdict", "error_ratio_p_value", "error_ratio_holm", "diverged_seeds", "left_out",
)


@dataclass
class SweepRun:
    """One run of the sweep: its cell (overrides without seeds), seed, metric and pairing."""

    dir: Path
    summary: dict[str, Any]
    overrides: tuple[str, ...]
    seed: int

    @property
    def name(self) -> str:
        return self.dir.name

    @property
    def cell(self) -> tuple[str, ...]:
        return tuple(sorted(o for o in self.overrides if _key(o) not in SEED_KEYS))

    @property
    def context(self) -> tuple[str, ...]:
        return tuple(o for o in self.cell if _key(o).split(".")[0] not in PRECISION_KEYS)


@dataclass
class Row:
    """One cell against its baseline."""

    cell: str
    baseline: str
    model: str
    data: str
    metric: str
    claim: str
    margin: Margin
    unit: str
    pairs: Pairs
    verdict: Any  # verdicts.Verdict
    cell_mean: float | None
    baseline_mean: float | None
    ratio: Any = None  # verdicts.Verdict on the log error ratio (accuracies only)
    ratio_pairs: Pairs | None = None
    ratio_margin: float | None = None
    left_out: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        v, r = self.verdict, self.ratio
        ex = (lambda x: math.exp(x) if x is not None and math.isfinite(x) else None) if r else (lambda x: None)
        return {
            "cell": self.cell, "baseline": self.baseline, "model": self.model, "data": self.data,
            "metric": self.metric, "claim": self.claim, "margin": str(self.margin), "unit": self.unit,
            "n_paired": v.n_seeds, "seeds": " ".join(map(str, self.pairs.seeds)), "cell_mean": self.cell_mean,
            "baseline_mean": self.baseline_mean, "effect": _fin(v.effect), "ci_low": _fin(v.ci95[0]),
            "ci_high": _fin(v.ci95[1]), "verdict": v.verdict, "p_value": _fin(v.p_value), "holm": v.holm,
            "seeds_to_decide": v.seeds_to_decide, "seeds_if_equal": v.seeds_if_equal,
            "error_ratio": ex(r.effect) if r else None, "error_ratio_low": ex(r.ci95[0]) if r else None,
            "error_ratio_high": ex(r.ci95[1]) if r else None, "error_ratio_margin": self.ratio_margin if r else None,
            "error_ratio_verdict": r.verdict if r else None, "error_ratio_p_value": _fin(r.p_value) if r else None,
            "error_ratio_holm": r.holm if r else None,
            "diverged_seeds": " ".join(map(str, self.pairs.diverged)), "left_out": "; ".join(self.left_out),
        }


def _fin(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None


def _key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


# ------------------------------------------------------------------------------------ reading


def read_sweep(summaries: list[Path]) -> list[SweepRun]:
    """Each summary.json's run with the overrides and seed that Hydra recorded beside it."""
    import yaml

    runs = []
    for path in summaries:
        d = path.parent
        try:
            summary = json.loads(path.read_text())
            overrides = yaml.safe_load((d / ".hydra" / "overrides.yaml").read_text()) or []
            config = yaml.safe_load((d / ".hydra" / "config.yaml").read_text()) or {}
        except FileNotFoundError as exc:
            missing = Path(exc.filename).relative_to(d)
            raise MptrainError(f"{d}: no {missing}: --verdicts reads each run's Hydra record "
                               "(.hydra/overrides.yaml, .hydra/config.yaml) to tell its cell and seed") from None
        except (OSError, ValueError, yaml.YAMLError) as exc:
            raise MptrainError(f"{d}: cannot read its summary or Hydra record ({exc})") from exc
        seed = (config.get("trainer") or {}).get("seed")
        if not isinstance(seed, int):
            raise MptrainError(f"{d}: trainer.seed={seed!r} in .hydra/config.yaml: not an integer")
        runs.append(SweepRun(d, summary, tuple(str(o) for o in overrides), seed))
    return runs


def direction(metric: str, better: str | None) -> int:
    """worse_sign for verdicts: -1 where lower is worse (accuracy), +1 where higher is (perplexity)."""
    if better is not None:
        return -1 if better == "higher" else 1
    if metric in HIGHER_IS_BETTER:
        return -1
    if metric in LOWER_IS_BETTER or metric.startswith("loss"):
        return 1
    raise MptrainError(f"metric {metric!r}: which direction is better is not known; pass --better higher|lower")


def _label(cell: tuple[str, ...], varying: set[str]) -> str:
    shown = [o for o in cell if o in varying]
    return " ".join(shown) or " ".join(cell) or "(no overrides)"


# ------------------------------------------------------------------------------------ the table


def verdict_rows(
    runs: list[SweepRun],
    margin: Margin,
    *,
    metric: str | None = None,
    claim: str = "parity",
    baseline: str = "fp32",
    better: str | None = None,
    ratio_margin: float = 1.1,
) -> list[Row]:
    """Every non-baseline cell against its baseline cell, Holm over the table (and, separately,
    over the error-ratio column)."""
    cells: dict[tuple[str, ...], list[SweepRun]] = {}
    for r in runs:
        cells.setdefault(r.cell, []).append(r)
    varying = {o for c in cells for o in c if not all(o in other for other in cells)}
    label = {c: _label(c, varying) for c in cells}
    names = {r.get("primary_metric") for r in (x.summary for x in runs) if r.get("status") == "completed"}
    metric = metric or (names.pop() if len(names) == 1 else None)
    if metric is None:
        why = "the runs name different primary metrics" if names else "no run completed, so no primary metric"
        raise MptrainError(f"{why}: pass --metric NAME")
    sign = direction(metric, better)
    for c, rs in cells.items():
        _check_cell(label[c], rs, metric)
    base_cells = {c for c, rs in cells.items() if all(r.summary.get("precision") == baseline for r in rs)}
    rows = []
    for c, rs in cells.items():
        if c in base_cells:
            continue
        ref = _baseline(c, rs, cells, base_cells, label, baseline)
        rows.append(_row(label[c], label[ref], rs, cells[ref], metric, margin, claim, sign, ratio_margin))
    if not rows:
        raise MptrainError(f"every cell is a {baseline} baseline: nothing to compare with it")
    rows.sort(key=lambda r: (r.baseline, r.cell))  # each baseline's cells together, in a stable order
    for family in (lambda r: r.verdict, lambda r: r.ratio):
        vs = [family(r) for r in rows if family(r) is not None]
        keep = holm([v.p_value for v in vs])
        for v, k in zip(vs, keep, strict=True):
            v.holm = bool(k and v.verdict in (HOLDS, FAILS))
    return rows


def _check_cell(label: str, rs: list[SweepRun], metric: str) -> None:
    for key in ("model", "data"):
        seen = sorted({str(r.summary.get(key)) for r in rs})
        if len(seen) > 1:
            raise MptrainError(f"cell {label!r} mixes {key}s ({', '.join(seen)}): one {key} per cell; "
                               f"put {key}= in the sweep's overrides or report the sweeps apart")
    seeds: dict[int, SweepRun] = {}
    for r in rs:
        if r.seed in seeds:
            raise MptrainError(f"cell {label!r} has two runs of seed {r.seed} ({seeds[r.seed].dir}, {r.dir}): "
                               "give each seed once")
        seeds[r.seed] = r
    if len(seeds) < 2:
        raise MptrainError(f"cell {label!r} has runs of one seed only (seed {next(iter(seeds))}): a paired interval "
                           "needs at least 2 seeds (e.g. trainer.seed=0,1,2,3,4)")
    for r in rs:
        if r.summary.get("status") == "completed" and not isinstance((r.summary.get("metrics") or {}).get(metric),
                                                                      int | float):
            have = ", ".join(sorted(r.summary.get("metrics") or {})) or "none"
            raise MptrainError(f"{r.dir}: no metric {metric!r} in summary.json (its metrics: {have}); "
                               "pass --metric NAME")


def _baseline(c: tuple[str, ...], rs: list[SweepRun], cells: dict, base_cells: set, label: dict,
              baseline: str) -> tuple[str, ...]:
    ctx = rs[0].context
    found = [b for b in base_cells if cells[b][0].context == ctx]
    if not found:
        raise MptrainError(f"cell {label[c]!r} has no {baseline} baseline: no {baseline} cell with the same "
                           f"overrides apart from precision and loss_scale; add precision={baseline} to the sweep")
    if len(found) > 1:  # prefer the baseline with no loss-scale override of its own
        plain = [b for b in found if not any(_key(o).startswith("loss_scale") for o in b)]
        if len(plain) != 1:
            raise MptrainError(f"cell {label[c]!r} has {len(found)} {baseline} baselines "
                               f"({', '.join(repr(label[b]) for b in found)}): report them apart")
        found = plain
    return found[0]


def _obs(r: SweepRun, metric: str) -> Obs:
    s = r.summary
    status = s.get("status")
    value = (s.get("metrics") or {}).get(metric)
    value = float(value) if isinstance(value, int | float) and math.isfinite(value) else None
    digest = tuple(sorted((s.get("pairing") or {}).items())) or None
    if status == "diverged" or (status == "completed" and value is None):
        return Obs(r.name, r.seed, None, digest)
    left = None if status == "completed" else f"status {status}"
    return Obs(r.name, r.seed, value, digest, left)


def _row(label: str, base: str, rs: list[SweepRun], refs: list[SweepRun], metric: str, margin: Margin,
         claim: str, sign: int, ratio_margin: float) -> Row:
    kind = "equivalent" if claim == "parity" else "worse"
    obs, ref = [_obs(r, metric) for r in rs], [_obs(r, metric) for r in refs]
    pairs = pair(obs, ref, margin.diff)
    unit = margin.unit(metric)
    text = (f"{label} matches {base} within ±{margin} ({unit})" if kind == "equivalent"
            else f"{label} is worse than {base} by more than {margin} ({unit})")
    v = judge(text, kind, pairs.finite, margin.value, unit, pairs.names, sign)
    v.n_seeds = len(pairs.seeds)

    def mean(os: list[Obs], seeds: list[int]) -> float | None:
        vals = [o.value for o in os if o.seed in seeds and o.value is not None]
        return statistics.fmean(vals) if vals else None

    row = Row(label, base, str(rs[0].summary.get("model")), str(rs[0].summary.get("data")), metric, kind,
              margin, unit, pairs, v, mean(obs, pairs.seeds), mean(ref, pairs.seeds), left_out=pairs.unpaired)
    if metric in ACCURACY:
        ratio = pair(obs, ref, log_error_ratio)
        log_m = math.log(ratio_margin)
        rtext = f"{label}'s error rate is within ×{ratio_margin:g} of {base}'s"
        row.ratio = judge(rtext, kind, ratio.finite, log_m, "log error ratio", ratio.names, +1)
        row.ratio.n_seeds = len(ratio.seeds)
        row.ratio_pairs, row.ratio_margin = ratio, ratio_margin
    return row


# ------------------------------------------------------------------------------------ output


def _f(x: float | None, spec: str = "+.3f") -> str:
    return "—" if x is None or not math.isfinite(x) else format(x, spec)


HEADERS = ("cell", "vs", "paired seeds", "Δ mean [95% CI]", "verdict", "p", "Holm", "seeds to decide",
           "error ratio [95% CI]", "ratio verdict", "ratio Holm", "left out")


def display(row: Row) -> list[str]:
    d = row.as_dict()
    ci = f"{_f(d['effect'])} [{_f(d['ci_low'])}, {_f(d['ci_high'])}] {row.unit}"
    if row.pairs.diverged:
        ci = f"diverged on seed {', '.join(map(str, row.pairs.diverged))}"
    need = [f"{d['seeds_to_decide']} at this mean" if d["seeds_to_decide"] else "",
            f"{d['seeds_if_equal']} if Δ = 0" if d["seeds_if_equal"] and d["verdict"] == OPEN else ""]
    ratio = (f"×{_f(d['error_ratio'], '.3g')} [{_f(d['error_ratio_low'], '.3g')}, {_f(d['error_ratio_high'], '.3g')}]"
             if row.ratio else "")
    return [
        row.cell, row.baseline, str(d["n_paired"]), ci, d["verdict"], _f(d["p_value"], ".2g"),
        "yes" if d["holm"] else "no", "; ".join(x for x in need if x) or "", ratio,
        d["error_ratio_verdict"] or "", "" if not row.ratio else ("yes" if d["error_ratio_holm"] else "no"),
        str(len(row.left_out)) if row.left_out else "",
    ]


def header(rows: list[Row]) -> list[str]:
    r = rows[0]
    kind = ("parity: the cell matches its baseline within the margin" if r.claim == "equivalent"
            else "loss: the cell is worse than its baseline by more than the margin")
    out = [f"Claim per row: {kind}. Metric: {r.metric}; margin ±{r.margin} ({r.unit}).",
           "Each row: the mean paired difference (cell − baseline, per seed, in the margin's unit) over the seeds "
           "whose runs are paired by digest, its 95% Student-t interval and the verdict it gives "
           "(holds: inside ±margin; does not hold: wholly outside; else inconclusive); p: the one-sided test of "
           f"that verdict; Holm: survives Holm's correction over the {len(rows)} rows at 2.5% family-wise; "
           "seeds to decide: where the interval would clear the margin at the measured mean and spread, and "
           "(inconclusive parity) the seeds it needs at 80% power if the true difference were 0."]
    if r.ratio is not None:
        out.append(f"Error ratio: the cell's error rate (100 − {r.metric}) over its baseline's, the geometric mean "
                   f"over paired seeds with its 95% interval, against ×{r.ratio_margin:g} (parity: within "
                   f"[1/{r.ratio_margin:g}, {r.ratio_margin:g}]); Holm over that column separately.")
    return out


def to_markdown(rows: list[Row]) -> str:
    lines = ["# Verdicts (mptrain-report --verdicts)", "", *header(rows), "",
             "| " + " | ".join(HEADERS) + " |", "|" + "---|" * len(HEADERS)]
    lines += ["| " + " | ".join(c.replace("|", "\\|") for c in display(r)) + " |" for r in rows]
    left = [(r.cell, x) for r in rows for x in r.left_out]
    if left:
        lines += ["", "Left out (not paired with their baseline twin, or not finished):", ""]
        lines += [f"- {cell}: {x}" for cell, x in left]
    return "\n".join(lines) + "\n"


def write_csv(rows: list[Row], path: Path) -> None:
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        w.writerows({k: "" if (v := r.as_dict()[k]) is None else v for k in COLUMNS} for r in rows)


def print_table(rows: list[Row]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"mptrain-report --verdicts: {len(rows)} cell{'s' * (len(rows) != 1)} against their baseline")
    for h in HEADERS:
        table.add_column(h, justify="left" if h in ("cell", "vs", "verdict", "ratio verdict") else "right")
    colour = {HOLDS: "green", FAILS: "red", OPEN: "yellow"}
    for r in rows:
        table.add_row(*display(r), style=colour.get(r.verdict.verdict))
    console = Console()
    console = console if console.is_terminal else Console(width=220)  # a pipe: one line per cell
    console.print(table)
    for line in header(rows):
        console.print(line, highlight=False)
    for r in rows:
        for x in r.left_out:
            console.print(f"left out of {r.cell}: {x}", highlight=False)


def plot_forest(rows: list[Row], path: Path) -> None:
    """One line per cell: the paired difference with its 95% interval, the margin shaded; for an
    accuracy, a second panel with the error ratio on a log axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels: list[tuple[str, Callable[[Row], Any], float, bool]] = [
        (f"Δ vs baseline ({rows[0].unit})", lambda r: r.verdict, rows[0].margin.value, False)]
    if rows[0].ratio is not None:
        panels.append(("error rate / baseline's (log)", lambda r: r.ratio, math.log(rows[0].ratio_margin or 1.1), True))
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 0.55 * len(rows) + 1.6), squeeze=False)
    colour = {HOLDS: "tab:green", FAILS: "tab:red", OPEN: "tab:orange"}
    for ax, (title, get, m, log) in zip(axes[0], panels, strict=True):
        tf = math.exp if log else (lambda x: x)
        ax.axvspan(tf(-m), tf(m), color="tab:green", alpha=0.15, label="margin")
        ax.axvline(tf(0), color="black", lw=0.8)
        for i, r in enumerate(rows):
            v = get(r)
            if v is None or not math.isfinite(v.effect):
                continue
            lo, hi = v.ci95
            if math.isfinite(lo) and math.isfinite(hi):
                ax.plot([tf(lo), tf(hi)], [i, i], color=colour[v.verdict], lw=2)
            ax.plot([tf(v.effect)], [i], "o", color=colour[v.verdict])
        if log:
            ax.set_xscale("log")
        ax.set_yticks(range(len(rows)), [f"{r.cell} (n={r.verdict.n_seeds})" for r in rows], fontsize=8)
        ax.invert_yaxis()
        ax.set_xlabel(title)
        ax.legend(fontsize=7, loc="lower right")
    fig.suptitle("paired difference from the baseline, 95% CI\n(green holds, red does not hold, orange inconclusive)",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_outputs(rows: list[Row], out: Path, plot: bool = True) -> list[Path]:
    """verdicts.md, verdicts.csv and (unless ``plot`` is false) verdicts.png in ``out``."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        (out / "verdicts.md").write_text(to_markdown(rows))
        write_csv(rows, out / "verdicts.csv")
        written = [out / "verdicts.md", out / "verdicts.csv"]
        if plot:
            plot_forest(rows, out / "verdicts.png")
            written.append(out / "verdicts.png")
    except OSError as exc:
        raise MptrainError(f"--out {out}: cannot write ({exc.strerror or exc})") from exc
    return written
