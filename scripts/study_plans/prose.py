"""docs/results/README.md from its template and results.json: every figure of the prose comes
from the data (issue 18, item 1: the hand-written README had said "within 0.01 ppl on every seed"
where the gap reached 0.041, and "hundreds of seeds" where the table said 61, 64 and 740).

A placeholder is ``{{ kind:arg:arg... | format }}`` (format: a Python format spec, default ``.2f``):

- ``claim:ID:PART:FIELD``: a part of a claim. FIELD: effect, lo, hi, n_seeds, seeds_to_decide,
  seeds_if_equal, p_value, verdict, survives ("survives" or "does not survive" Holm);
  ``claim:ID:verdict`` and ``claim:ID:holm_verdict`` are the claim's verdicts.
- ``count:FIELD:VALUE``: how many claims have FIELD (verdict, holm_verdict) equal to VALUE;
  ``count:all`` is the number of claims.
- ``run:NAME:DOTTED.PATH``: any field of a run's row, e.g.
  ``run:lstm_lm-fp32-tel-s0:telemetry.act_hist_zero_frac``.
- ``cell:MODEL:CELL:STAT``: over the cell's completed runs. STAT: mean, std (of the metric), n;
  dmin, dmax, dmean, absmax, dstd (the paired difference from FP32 per seed, in the claim's unit:
  points, or % of perplexity: its least, largest and mean value, largest absolute value, standard
  deviation); gap (the largest |cell - fp32| per seed in the metric's own unit, e.g. ppl) and
  gap_seed (its seed); wall (a run's mean wall time, seconds); min.FIELD and max.FIELD (a run
  field's least and largest value over the cell, e.g. ``max.skipped_steps``).
- ``diff:RUN_A:RUN_B:DOTTED.PATH``: run A's field minus run B's.
- ``epoch:CELL:K:FIELD``: the 4-epoch LM's paired penalty against FP32 after epoch K. FIELD:
  effect, lo, hi, n_seeds.
- ``meta:DOTTED.PATH``: any other field of results.json, e.g. ``meta:machine.torch``,
  ``meta:totals.run_hours``.
- ``ratio:MODEL:CELL:FIELD``: a CNN parity cell's error-rate ratio to FP32 (``error_ratios`` in
  results.json). FIELD: ratio, lo, hi, verdict, n_seeds, p_value, margin, fp32_error,
  abs_margin_ratio (what the absolute margin allows, as a ratio), survives (Holm over the ratios).
- ``prov:FIELD``: results.json's ``provenance`` (e.g. ``prov:not_at_study_commit``).
- ``table:verdicts``, ``table:epochs``, ``table:error_ratios``, ``table:provenance``,
  ``table:without_uncommitted``: the verdict table; the per-epoch penalties; the error-rate
  ratios; the runs not at the study's commit; the parts that change without the runs from
  uncommitted trees.

A format ending in ``u`` writes minus signs as the prose does (−), e.g. ``+.2fu``.

``python scripts/study.py render papers`` writes README.md from README.template.md and results.json;
tests/test_study.py renders the committed template against the committed results.json and
requires README.md to be exactly that, and finds no decimal figure in the template's prose that
is not a placeholder (a short list of constants of the method excepted).
"""

from __future__ import annotations

import math
import re
import statistics
from typing import Any

PLACEHOLDER = re.compile(r"\{\{\s*([^}|]+?)\s*(?:\|\s*([^}]*?)\s*)?\}\}")


def _runs(results: dict, model: str, cell: str) -> dict[int, dict]:
    return {r["seed"]: r for r in results["runs"] if r["model"] == model and r["cell"] == cell
            and r["part"] != "telemetry" and r.get("status") == "completed"}


def _metric(results: dict, model: str) -> str:
    return results["recipes"][model]["metric"]


def cell_stat(results: dict, model: str, cell: str, stat: str) -> float | int | None:
    metric = _metric(results, model)
    rows = _runs(results, model, cell)
    vals = {s: r["metrics"][metric] for s, r in rows.items()}
    if stat.startswith(("min.", "max.")):  # a run field's least or largest value over the cell
        f = [_dig(r, stat[4:]) for r in rows.values()]
        return (min if stat.startswith("min") else max)(f) if f else None
    if stat == "wall":  # a run's mean wall time, seconds (one thread)
        w = [r["wall_time_s"] for r in rows.values() if r.get("wall_time_s")]
        return statistics.fmean(w) if w else None
    if stat in ("mean", "std", "n"):
        v = list(vals.values())
        return {"mean": statistics.fmean, "std": statistics.stdev, "n": len}[stat](v) if v else None
    ref = {s: r["metrics"][metric] for s, r in _runs(results, model, "fp32").items()}
    seeds = sorted(set(vals) & set(ref))
    if not seeds:
        return None
    if stat in ("gap", "gap_seed"):
        s = max(seeds, key=lambda k: abs(vals[k] - ref[k]))
        return abs(vals[s] - ref[s]) if stat == "gap" else s
    diffs = [vals[s] - ref[s] if metric == "top1" else 100 * (vals[s] / ref[s] - 1) for s in seeds]
    if stat == "dstd":
        return statistics.stdev(diffs) if len(diffs) > 1 else None
    return {"dmin": min, "dmax": max, "dmean": statistics.fmean, "absmax": lambda d: max(map(abs, d))}[stat](diffs)


def _dig(obj: Any, path: str) -> Any:
    for key in path.split("."):
        obj = obj[int(key)] if isinstance(obj, list) else obj[key]
    return obj


def value(results: dict, expr: str) -> Any:
    kind, *args = [a.strip() for a in expr.split(":")]
    if kind == "claim":
        c = next(c for c in results["claims"] if c["id"] == args[0])
        if args[1] in ("verdict", "holm_verdict"):
            return c[args[1]]
        p = c["parts"][int(args[1])]
        field = args[2]
        survives = "survives" if p.get("holm") else "does not survive"
        return {"lo": lambda: p["ci95"][0], "hi": lambda: p["ci95"][1],
                "survives": lambda: survives}.get(field, lambda: p.get(field))()
    if kind == "count":  # count:FIELD:VALUE over the claims, or count:all
        if args == ["all"]:
            return len(results["claims"])
        return sum(c[args[0]] == args[1] for c in results["claims"])
    if kind == "run":
        r = next(r for r in results["runs"] if r["name"] == args[0])
        return _dig(r, args[1])
    if kind == "cell":
        return cell_stat(results, *args)
    if kind == "diff":  # run A's field minus run B's
        a, b = (next(r for r in results["runs"] if r["name"] == n) for n in args[:2])
        return _dig(a, args[2]) - _dig(b, args[2])
    if kind == "meta":  # any other field of results.json, e.g. machine.torch, totals.run_hours
        return _dig(results, args[0])
    if kind == "epoch":  # epoch:CELL:K:FIELD, the 4-epoch LM's paired penalty after epoch K
        row = results["epochs"][args[0]][int(args[1]) - 1]
        return row[args[2]]
    if kind == "ratio":  # ratio:MODEL:CELL:FIELD, a CNN parity cell's error-rate ratio to FP32
        row = next(r for r in results["error_ratios"] if (r["model"], r["cell"]) == (args[0], args[1]))
        if args[2] == "survives":
            return "survives" if row["holm"] else "does not survive"
        return row[args[2]]
    if kind == "prov":
        return _dig(results["provenance"], args[0])
    if kind == "table":
        tables = {"verdicts": lambda: verdict_lines(results["claims"], results.get("recipes")),
                  "epochs": lambda: epochs_table(results["epochs"]),
                  "error_ratios": lambda: error_ratio_lines(results["error_ratios"]),
                  "provenance": lambda: provenance_lines(results["provenance"]),
                  "without_uncommitted": lambda: without_lines(results["provenance"]["without_uncommitted"])}
        return "\n".join(tables[args[0]]())
    raise KeyError(f"unknown placeholder {expr!r}")


def _f(x: Any, spec: str = ".2f") -> str:
    return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def verdict_lines(claims: list[dict], recipes: dict | None = None) -> list[str]:
    """The verdict table (README and tables.md): every part of every claim, with its margin, seeds
    and steps beside the verdict, and Holm's survival."""
    f = _f
    lines = ["| claim | part | verdict | effect (mean paired Δ) | 95% CI | margin | seeds | steps "
             "| seeds to decide (at the observed mean) | seeds if true Δ = 0 | p | survives Holm |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in claims:
        for i, p in enumerate(c["parts"]):
            lo, hi = p["ci95"]
            head = f"{c['id']} **{c['verdict']}** (Holm: {c.get('holm_verdict', '—')})" if i == 0 else ""
            steps = ((recipes or {}).get(p["claim"].split(":")[0]) or {}).get("steps")
            sep = "" if p["unit"].startswith("%") else " "
            margin = "—" if p["margin"] is None or math.isnan(p["margin"]) else f"±{p['margin']:g}{sep}{p['unit']}"
            lines.append(
                f"| {head} | {p['claim']} | {p['verdict']} | {f(p['effect'], '+.2f')} {p['unit']} | "
                f"[{f(lo, '+.2f')}, {f(hi, '+.2f')}] | {margin} | {p['n_seeds']} | {steps or '—'} | "
                f"{p.get('seeds_to_decide') or ''} | {p.get('seeds_if_equal') or ''} | {f(p.get('p_value'), '.2g')} | "
                f"{'yes' if p.get('holm') else 'no'} |"
            )
    return lines


def error_ratio_lines(rows: list[dict]) -> list[str]:
    lines = ["| recipe | cell | FP32 error, % | error ratio to FP32 (geometric mean) | 95% CI | seeds | margin "
             "| verdict | p | survives Holm |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['cell']} | {_f(r['fp32_error'])} | ×{_f(r['ratio'])} | "
                     f"[{_f(r['lo'])}, {_f(r['hi'])}] | {r['n_seeds']} | ×{r['margin']:g} | {r['verdict']} | "
                     f"{_f(r['p_value'], '.2g')} | {'yes' if r['holm'] else 'no'} |")
    return lines


def provenance_lines(prov: dict) -> list[str]:
    if not prov.get("other"):
        return [f"All {prov.get('runs')} runs were trained at commit {str(prov.get('study_commit'))[:12]}."]
    lines = [f"{prov['at_study_commit']} of {prov['runs']} runs were trained at the study's commit "
             f"{str(prov['study_commit'])[:12]}; the runs below were not (re-run them at one commit before "
             "relying on them):", "",
             "| commit | uncommitted changes | code (mptrain/, configs/) as the study commit's | runs |",
             "|---|---|---|---|"]
    for o in prov["other"]:
        same = {True: "yes", False: "no", None: "unknown (uncommitted tree)"}[o["code_same_as_study"]]
        dirty = "yes" if o["dirty"] else "no"
        lines.append(f"| {str(o['commit'])[:12]} | {dirty} | {same} | {', '.join(o['runs'])} |")
    return lines




def without_lines(rows: list[dict]) -> list[str]:
    """The parts whose verdict, seeds or Holm survival change without the uncommitted-tree runs."""

    def f(x: Any, spec: str = "+.2f") -> str:
        return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)

    lines = ["| part | seeds: all runs → without them | verdict | survives Holm | effect [95% CI] without them |",
             "|---|---|---|---|---|"]
    yn = {True: "yes", False: "no"}
    for r in rows:
        lo, hi = r["ci95"]
        lines.append(f"| {r['claim']}: {r['text']} | {r['n_seeds'][0]} → {r['n_seeds'][1]} | "
                     f"{r['verdict'][0]} → {r['verdict'][1]} | {yn[r['holm'][0]]} → {yn[r['holm'][1]]} | "
                     f"{f(r['effect'])} [{f(lo)}, {f(hi)}] |")
    return lines


def epochs_table(epochs: dict[str, list[dict]]) -> list[str]:
    """Each cell's paired penalty against FP32 after every epoch (from results.json's ``epochs``)."""

    def f(x: Any) -> str:
        return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, "+.2f")

    n = max((len(rows) for rows in epochs.values()), default=0)
    lines = ["| cell | " + " | ".join(f"epoch {k}: Δ % ppl [95% CI] (seeds)" for k in range(1, n + 1)) + " |",
             "|---|" + "---|" * n]
    for cell, rows in epochs.items():
        lines.append(f"| {cell} | " + " | ".join(
            f"{f(r['effect'])} [{f(r['lo'])}, {f(r['hi'])}] ({r['n_seeds']})" for r in rows) + " |")
    return lines


def render_readme(template: str, results: dict, strict: bool = True) -> str:
    """The template with every placeholder filled. ``strict=False`` (the report, whose template may
    still name runs of an older plan) writes ``[missing: ...]`` for a placeholder the data lack."""

    def sub(m: re.Match[str]) -> str:
        try:
            v = value(results, m.group(1))
        except (KeyError, IndexError, StopIteration, TypeError, ValueError):
            if strict:
                raise
            return f"[missing: {m.group(1)}]"
        spec = m.group(2)
        if v is None or (isinstance(v, float) and math.isnan(v)):
            return "—"
        if isinstance(v, str):
            return v
        spec = spec or ("d" if isinstance(v, int) else ".2f")
        if spec.endswith("u"):  # typographic minus, as the prose writes it
            return format(v, spec[:-1]).replace("-", "−")
        return format(v, spec)  # ".2%" turns a fraction into a percentage

    return PLACEHOLDER.sub(sub, template)


# Figures of the prose that are constants of the method, not results: allowed as literals.
DECIMAL = re.compile(r"(?<![\w.^-])[-+−]?\d+\.\d+%?|(?<![\w.^-])\d+%")


def literal_figures(template: str) -> list[str]:
    """Decimal figures and percentages written by hand in the template's prose: outside
    placeholders, code spans and blocks, links and image lines."""
    text = PLACEHOLDER.sub(" ", template)
    text = re.sub(r"```.*?```", " ", text, flags=re.S)
    text = re.sub(r"`[^`]*`", " ", text)
    text = re.sub(r"\]\([^)]*\)", " ", text)
    return DECIMAL.findall(text)
