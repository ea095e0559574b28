"""``mptrain-report DIR...``: compare finished runs in the style of the paper's tables.

    mptrain-report runs/paper_table1/2026-01-01_12-00-00
    mptrain-report runs/a runs/b --out reports/
    mptrain-report runs/multirun/<stamp> --verdicts --margin 1%     # paired verdicts over seeds

Every ``summary.json`` below the given directories is one run. Each run is compared with the FP32
run of the same model and data (final metric difference, speedup, peak-memory ratio), and the
table is printed, then written as ``report.md`` and ``report.csv`` next to ``report.png``, which
overlays the runs' ``train/loss`` and ``train/loss_scale`` curves read from their TensorBoard
events. With ``--verdicts``, each precision cell of a multi-seed sweep is judged against its FP32
baseline instead, from seeds paired by digest (mptrain/sweep.py): verdicts.md, verdicts.csv and
verdicts.png. Bad input gets one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mptrain.errors import MptrainError

PROG = "mptrain-report"
BASELINE = "fp32"
# Display order inside one (model, data) group: the baseline first, then as `mptrain --help` lists.
PRECISION_ORDER = ("fp32", "tf32", "amp_fp16", "amp_bf16", "mixed", "fp16_master", "bf16_pure", "fp8")
LOSS_SCALE_ORDER = ("none", "auto", "static", "dynamic", "enhanced", "adaptive")
CURVES = ("train/loss", "train/loss_scale")
# CSV columns: raw values, so that the file can be re-analysed without parsing formatted cells.
COLUMNS = (
    "model", "data", "precision", "precision_resolved", "loss_scale", "metric", "value", "diff_vs_fp32",
    "throughput", "throughput_unit", "speedup", "peak_memory_bytes", "memory_ratio", "skipped_steps",
    "final_loss_scale", "steps", "final_loss", "world_size", "status", "error", "baseline", "run_dir",
)
HEADERS = (
    "model", "data", "precision", "loss scale", "metric", "Δ vs fp32", "throughput", "speedup",
    "memory", "skipped", "final scale", "status",
)


@dataclass
class Run:
    """One run directory and its summary.json."""

    dir: Path
    summary: dict[str, Any]
    curves: dict[str, list[tuple[int, float]]] = field(default_factory=dict)

    def get(self, key: str, default: Any = None) -> Any:
        value = self.summary.get(key)
        return default if value is None else value

    @property
    def metric(self) -> tuple[str | None, float | None]:
        name = self.summary.get("primary_metric")
        value = (self.summary.get("metrics") or {}).get(name) if name else None
        return name, _num(value)


# ------------------------------------------------------------------------------------ reading


def find_summaries(dirs: list[Path]) -> list[Path]:
    """Every summary.json at or below each dir (a run dir or a sweep dir), without duplicates."""
    found: dict[Path, None] = {}
    for d in dirs:
        if not d.exists():
            raise MptrainError(f"{d}: no such directory")
        if not d.is_dir():
            raise MptrainError(f"{d}: not a directory (give run or sweep directories)")
        try:
            paths = sorted(d.rglob("summary.json"))
        except OSError as exc:
            raise MptrainError(f"{d}: cannot read ({exc.strerror or exc})") from exc
        for p in paths:
            found.setdefault(p.resolve(), None)
    if not found:
        raise MptrainError(f"no summary.json found under {', '.join(str(d) for d in dirs)}")
    return list(found)


def load_runs(paths: list[Path], *, curves: bool = True) -> list[Run]:
    """Read the summaries (skipping, with a warning, any that cannot be parsed) and their curves."""
    runs = []
    for p in paths:
        try:
            summary = json.loads(p.read_text())
        except (OSError, ValueError) as exc:
            print(f"{PROG}: warning: skipping {p}: {exc}", file=sys.stderr)
            continue
        if not isinstance(summary, dict):
            print(f"{PROG}: warning: skipping {p}: not a summary object", file=sys.stderr)
            continue
        run = Run(p.parent, summary)
        if curves:
            run.curves = read_curves(run.dir)
        runs.append(run)
    if not runs:
        raise MptrainError("none of the summary.json files found could be read")
    return runs


def read_curves(run_dir: Path, tags: tuple[str, ...] = CURVES) -> dict[str, list[tuple[int, float]]]:
    """The (step, value) series of ``tags`` from a run dir's TensorBoard event files.

    EventAccumulator reads all event files of the dir in order (a resumed run adds one) and drops
    points that a restart rewrote, so a resumed run gives one continuous curve.
    """
    from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator

    if not any(run_dir.glob("events.out.tfevents.*")):
        return {}
    acc = EventAccumulator(str(run_dir), size_guidance={SCALARS: 0})  # 0: keep every point
    acc.Reload()
    available = set(acc.Tags().get(SCALARS, []))
    return {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in tags if t in available}


# ------------------------------------------------------------------------------------ table


def _num(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b and math.isfinite(b) else None


def _order(runs: list[Run]) -> list[Run]:
    groups: dict[tuple[str, str], int] = {}
    for r in runs:
        groups.setdefault((r.get("model", "?"), r.get("data", "?")), len(groups))

    def rank(value: str, order: tuple[str, ...]) -> int:
        return order.index(value) if value in order else len(order)

    return sorted(runs, key=lambda r: (
        groups[(r.get("model", "?"), r.get("data", "?"))],
        rank(r.get("precision", ""), PRECISION_ORDER),
        rank(r.get("loss_scale", ""), LOSS_SCALE_ORDER),
        str(r.dir),
    ))


def baseline_for(run: Run, runs: list[Run]) -> Run | None:
    """The FP32 run of the same model and data: a completed one first, then one of the same sweep."""
    candidates = [
        r for r in runs
        if r.get("precision") == BASELINE and (r.get("model"), r.get("data")) == (run.get("model"), run.get("data"))
    ]
    if not candidates:
        return None
    return min(candidates, key=lambda r: (r.get("status") != "completed", r.dir.parent != run.dir.parent))


def build_rows(runs: list[Run]) -> list[dict[str, Any]]:
    """One dict of raw values (COLUMNS) per run, in display order."""
    rows = []
    for run in _order(runs):
        base = baseline_for(run, runs)
        name, value = run.metric
        base_name, base_value = base.metric if base is not None else (None, None)
        throughput = _num(run.summary.get("throughput"))
        memory = _num(run.summary.get("peak_memory_bytes"))
        rows.append({
            "model": run.get("model", "?"),
            "data": run.get("data", "?"),
            "precision": run.get("precision", "?"),
            "precision_resolved": run.get("precision_resolved", run.get("precision", "?")),
            "loss_scale": run.get("loss_scale", "?"),
            "metric": name,
            "value": value,
            "diff_vs_fp32": value - base_value if value is not None and base_value is not None
            and name == base_name else None,
            "throughput": throughput,
            "throughput_unit": run.get("throughput_unit", "samples"),
            "speedup": _ratio(throughput, _num(base.summary.get("throughput")) if base else None),
            "peak_memory_bytes": memory,
            "memory_ratio": _ratio(memory, _num(base.summary.get("peak_memory_bytes")) if base else None),
            "skipped_steps": run.summary.get("skipped_steps"),
            "final_loss_scale": _num(run.summary.get("final_loss_scale")),
            "steps": run.summary.get("steps"),
            "final_loss": _num(run.summary.get("final_loss")),
            "world_size": run.summary.get("world_size"),
            "status": run.get("status", "?"),
            "error": run.summary.get("error"),
            "baseline": str(base.dir) if base is not None else None,
            "run_dir": str(run.dir),
        })
    return rows


def _fmt(value: float | None, spec: str = ".2f", suffix: str = "") -> str:
    if value is None:
        return "-"
    return f"{value:{spec}}{suffix}" if math.isfinite(value) else str(value)


def display(row: dict[str, Any]) -> list[str]:
    """The formatted cells of one row, in HEADERS order."""
    precision = row["precision"]
    if row["precision_resolved"] != precision:
        precision = f"{precision} → {row['precision_resolved']}"
    metric = f"{row['metric']} {_fmt(row['value'])}" if row["metric"] else "-"
    throughput = _fmt(row["throughput"], ",.1f", f" {row['throughput_unit']}/s")
    return [
        row["model"], row["data"], precision, row["loss_scale"], metric,
        _fmt(row["diff_vs_fp32"], "+.2f"), throughput, _fmt(row["speedup"], ".2f", "×"),
        _fmt(row["memory_ratio"], ".2f", "×"), "-" if row["skipped_steps"] is None else str(row["skipped_steps"]),
        _fmt(row["final_loss_scale"], "g"), row["status"],
    ]


def to_markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["| " + " | ".join(HEADERS) + " |", "|" + "|".join("---" for _ in HEADERS) + "|"]
    lines += ["| " + " | ".join(c.replace("|", "\\|") for c in display(r)) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def write_csv(rows: list[dict[str, Any]], path: Path) -> None:
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows({k: "" if r[k] is None else r[k] for k in COLUMNS} for r in rows)


def print_table(rows: list[dict[str, Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"mptrain-report: {len(rows)} run{'s' * (len(rows) != 1)} (Δ, speedup, memory: vs fp32)")
    for h in HEADERS:
        table.add_column(h, justify="right" if h in ("Δ vs fp32", "throughput", "speedup", "memory", "skipped",
                                                    "final scale") else "left")
    for r in rows:
        table.add_row(*display(r), style=None if r["status"] == "completed" else "red")
    console = Console()
    # A pipe or a file gets a wide console: the table stays one line per run instead of wrapping.
    (console if console.is_terminal else Console(width=200)).print(table)


# ------------------------------------------------------------------------------------ curves


def _label(run: Run) -> str:
    return f"{run.get('model', '?')} {run.get('precision', '?')} {run.get('loss_scale', '?')}"


def plot_curves(runs: list[Run], path: Path) -> bool:
    """Overlay every run's loss (top) and loss scale (bottom, log y). False if nothing to draw."""
    drawn = [r for r in _order(runs) if r.curves]
    if not drawn:
        return False
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on clusters or in CI
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    labels = [_label(r) for r in drawn]
    dupes = {x for x in labels if labels.count(x) > 1}
    fig, (ax_loss, ax_scale) = plt.subplots(2, 1, sharex=True, figsize=(9, 7))
    for run, label in zip(drawn, labels, strict=True):
        label = f"{label} ({run.dir.name})" if label in dupes else label
        for ax, tag in ((ax_loss, "train/loss"), (ax_scale, "train/loss_scale")):
            points = [(s, v) for s, v in run.curves.get(tag, []) if math.isfinite(v) and (tag == CURVES[0] or v > 0)]
            if points:
                steps, values = zip(*points, strict=True)
                ax.plot(steps, values, label=label, marker="." if len(points) < 20 else None)
    ax_loss.set_ylabel("train/loss")
    ax_loss.set_title("training loss")
    ax_loss.legend(fontsize="small")
    ax_scale.set_yscale("log", base=2)
    ax_scale.set_ylabel("train/loss_scale")
    ax_scale.set_xlabel("step")
    ax_scale.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax_scale.set_title("loss scale")
    for ax in (ax_loss, ax_scale):
        ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


# ------------------------------------------------------------------------------------ entry


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Compare mptrain runs: a table in the paper's style (metric and speed vs the fp32 run "
        "of the same model and data) as markdown and CSV, and a PNG of the loss and loss-scale curves.",
    )
    parser.add_argument("dirs", nargs="+", type=Path, metavar="DIR", help="run or sweep directories")
    parser.add_argument("--out", type=Path, default=None,
                        help="where report.md, report.csv and report.png go (default: the first DIR)")
    parser.add_argument("--no-plot", action="store_true", help="skip the TensorBoard curves and the PNG")
    v = parser.add_argument_group("verdicts (--verdicts): each cell against its fp32 baseline, over paired seeds")
    v.add_argument("--verdicts", action="store_true",
                   help="judge every precision cell against its fp32 cell: verdicts.md, verdicts.csv, verdicts.png")
    v.add_argument("--margin", default=None,
                   help="the claim's margin: relative to the baseline with %% (1%%) or absolute in the metric's unit "
                   "(0.5: points of top-1); required with --verdicts")
    v.add_argument("--claim", choices=("parity", "worse"), default="parity",
                   help="parity: the cell matches fp32 within ±margin (default); worse: it is worse by more than it")
    v.add_argument("--metric", default=None, help="the metric to compare (default: the runs' primary metric)")
    v.add_argument("--better", choices=("higher", "lower"), default=None,
                   help="which direction of --metric is better (known for top1, ppl, loss...)")
    v.add_argument("--baseline", default="fp32", help="the baseline cells' precision (default fp32)")
    v.add_argument("--error-ratio-margin", type=float, default=1.1,
                   help="accuracies: the margin on the error-rate ratio to the baseline (default 1.1: parity when "
                   "the error rate is within [1/1.1, 1.1] times the baseline's)")
    return parser.parse_args(argv)


def verdicts_main(args: argparse.Namespace) -> list[Path]:
    """``--verdicts``: the paired verdict table of the sweep (mptrain/sweep.py)."""
    from mptrain import sweep
    from mptrain.verdicts import Margin

    if args.margin is None:
        raise MptrainError("--verdicts needs --margin: relative with % (--margin 1%) or absolute (--margin 0.5)")
    if not args.error_ratio_margin > 1:
        raise MptrainError(f"--error-ratio-margin {args.error_ratio_margin}: must be > 1 (e.g. 1.1)")
    margin = Margin.parse(args.margin)
    runs = sweep.read_sweep(find_summaries(args.dirs))
    rows = sweep.verdict_rows(runs, margin, metric=args.metric, claim=args.claim, baseline=args.baseline,
                              better=args.better, ratio_margin=args.error_ratio_margin)
    written = sweep.write_outputs(rows, args.out or args.dirs[0], plot=not args.no_plot)
    sweep.print_table(rows)
    return written


def main(argv: list[str] | None = None) -> int:
    """Console entry point; returns the exit status (0, or 2 on bad input)."""
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        if args.verdicts:
            print("wrote " + ", ".join(str(p) for p in verdicts_main(args)))
            return 0
        if args.margin is not None:
            raise MptrainError("--margin is a --verdicts option: add --verdicts")
        runs = load_runs(find_summaries(args.dirs), curves=not args.no_plot)
        rows = build_rows(runs)
        out = args.out or args.dirs[0]
        try:
            out.mkdir(parents=True, exist_ok=True)
            (out / "report.md").write_text(to_markdown(rows))
            write_csv(rows, out / "report.csv")
        except OSError as exc:
            raise MptrainError(f"--out {out}: cannot write ({exc.strerror or exc})") from exc
        print_table(rows)
        written = [out / "report.md", out / "report.csv"]
        if not args.no_plot:
            try:
                if plot_curves(runs, out / "report.png"):
                    written.append(out / "report.png")
                else:
                    print(f"{PROG}: note: no TensorBoard curves found; no report.png", file=sys.stderr)
            except OSError as exc:
                raise MptrainError(f"--out {out}: cannot write report.png ({exc.strerror or exc})") from exc
            except ImportError:
                print(f"{PROG}: note: matplotlib is not installed (pip install mptrain[report]); no report.png",
                      file=sys.stderr)
    except MptrainError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    print("wrote " + ", ".join(str(p) for p in written))
    return 0


if __name__ == "__main__":
    sys.exit(main())
