"""``mptrain-bench``'s report: its tables (``tables``), printed by rich (``print_tables``) and
written as markdown (``markdown``), and the cell formatters they share."""

from __future__ import annotations

from typing import Any

# ------------------------------------------------------------------------------------ output


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1e3:,.1f}"


def _x(v: float | None, digits: int = 2) -> str:
    return "-" if v is None else f"{v:.{digits}f}x"


def _num(v: float | None) -> str:
    return "-" if v is None else f"{v:,.0f}" if v >= 100 else f"{v:,.1f}"


def _mib(v: int | None) -> str:
    return "-" if v is None else f"{v / 2**20:,.0f}"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


def _diff(v: float | None) -> str:
    return "-" if v is None else f"{v:.1e}"


def tables(result: dict[str, Any]) -> list[tuple[str, list[str], list[list[str]]]]:
    """The report's tables as (title, header, rows): rendered by rich and as markdown."""
    recs = [r for r in result["cells"] if "error" not in r]
    cuda = result["meta"]["device"] == "cuda"
    bf16 = any(r.get("speedup_vs_bf16") for r in recs if r["precision"] != "amp_bf16")  # FP8 or formats vs bf16
    main_header = ["model", "precision", "batch", "variant", "step ms", "per s", "bare step ms", "bare per s",
                   "engine/bare", "paired", "min", "spread", "vs fp32"] + (["vs tf32"] if cuda else []) + (
        ["vs bf16"] if bf16 else []) + [
        "peak MiB", "bare MiB", "mem vs fp32", "MFU", "bare MFU", "GFLOP/step", "<16-bit FLOPs", "loss diff",
        "compile s"]
    rows = []
    for r in recs:
        spread = max(v for v in (r["spread"], r["bare_spread"]) if v is not None) if r["spread"] is not None else None
        rows.append([r["model"], r["precision"] + ("" if r["precision_resolved"] == r["precision"]
                                                   else f" ({r['precision_resolved']})"),
                     str(r["batch_size"]), r["variant"] + (" (diverged)" if r.get("diverged") else ""),
                     _ms(r["step_time_s"]),
                     _num(r["throughput"]), _ms(r["bare_step_time_s"]), _num(r["bare_throughput"]),
                     _x(r["overhead"], 3), _x(r["overhead_paired"], 3), _x(r.get("overhead_min"), 3), _pct(spread),
                     _x(r["speedup_vs_fp32"])]
                    + ([_x(r["speedup_vs_tf32"])] if cuda else [])
                    + ([_x(r.get("speedup_vs_bf16"))] if bf16 else [])
                    + [_mib(r["peak_memory_bytes"]), _mib(r["bare_peak_memory_bytes"]), _x(r["memory_vs_fp32"]),
                       _pct(r["mfu"]), _pct(r["bare_mfu"]),
                       "-" if not r["flops_per_step"] else f"{r['flops_per_step'] / 1e9:,.1f}",
                       _pct(r.get("low_precision_flop_fraction")), _diff(r["loss_max_rel_diff"]),
                       "-" if r.get("compile_s") is None else f"{r['compile_s']:.1f}"])
    out = [("engine vs bare loop: median of timed windows; per s = samples/s (tokens/s for a language model)",
            main_header, rows)]

    base = [r for r in recs if r["variant"] == "base"]
    batches = sorted({r["batch_size"] for r in base})
    if len(batches) > 1:
        groups: dict[tuple[str, str], dict[int, dict[str, Any]]] = {}
        for r in base:
            groups.setdefault((r["model"], r["precision"]), {})[r["batch_size"]] = r
        brows = []
        for (model, prec), by_batch in groups.items():
            brows.append([model, prec] + [
                "-" if b not in by_batch else
                f"{_num(by_batch[b]['throughput'])} ({_num(by_batch[b]['bare_throughput'])})" for b in batches])
        out.append(("throughput vs batch size: engine (bare), units/s", ["model", "precision"]
                    + [f"b={b}" for b in batches], brows))

    fast = [r for r in recs if r["variant"] != "base"]
    if fast:
        frows = []
        index = {(r["model"], r["precision"], r["batch_size"]): r for r in base}
        for r in fast:
            b = index.get((r["model"], r["precision"], r["batch_size"]))
            key = "step_time_mean_s" if r.get("timing_stat") == "mean" else "step_time_s"
            frows.append([r["model"], r["precision"], str(r["batch_size"]), r["setting"],
                          _ms(b and b[key]), _ms(r[key]), _x(r["speedup_vs_base"]),
                          _ms(b and b[f"bare_{key}"]), _ms(r[f"bare_{key}"]),
                          _x(r["bare_speedup_vs_base"]), _mib(r["peak_memory_bytes"])])
        out.append(("fast paths and telemetry: toggled vs base (speedup > 1: the toggle is faster; "
                    "ms are medians, or means where marked)",
                    ["model", "precision", "batch", "toggle", "base ms", "toggled ms", "speedup",
                     "bare base ms", "bare toggled ms", "bare speedup", "peak MiB"], frows))
    errors = [r for r in result["cells"] if "error" in r]
    if errors or result["skipped"]:
        erows = [[r["model"], r.get("precision", "-"), str(r.get("batch_size", "-")), r.get("variant", "-"),
                  r["error"]] for r in errors]
        erows += [[s["model"], "-", "-", "-", f"skipped: {s['reason']}"] for s in result["skipped"]]
        out.append(("not measured", ["model", "precision", "batch", "variant", "why"], erows))
    return out


def print_tables(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=max(200, Console().width))
    meta = result["meta"]
    console.print(f"[bold]mptrain-bench[/bold] {meta['device_name']} ({meta['device']}) | torch "
                  f"{meta['versions']['torch']} | cuda {meta['versions']['cuda']} | {meta['date']} | "
                  f"threads {meta['torch_threads']} | clock {meta['clock']}")
    for title, header, rows in tables(result):
        table = Table(title=title, title_justify="left")
        for h in header:
            table.add_column(h, justify="left" if h in ("model", "precision", "variant", "toggle", "why") else "right")
        for row in rows:
            table.add_row(*row)
        console.print(table)
    if meta.get("telemetry"):
        console.print(f"telemetry: {meta['telemetry']}")


def _loads(v: list[float] | None) -> str:
    return "-" if not v else " / ".join(f"{x:.2f}" for x in v)


def markdown(result: dict[str, Any]) -> str:
    meta = result["meta"]
    v = meta["versions"]
    lines = [
        f"# mptrain-bench: {meta['device_name']}",
        "",
        *([] if meta.get("complete", True) else ["**Partial: the run stopped before every cell was measured.**", ""]),
        f"- device: {meta['device']} ({meta['device_name']})"
        + (f", capability {meta['cuda_capability']}" if meta.get("cuda_capability") else ""),
        f"- versions: mptrain {v['mptrain']}, torch {v['torch']}, torchvision {v['torchvision']}, "
        f"CUDA {v['cuda']}, cuDNN {v['cudnn']}, Python {v['python']}",
        f"- date: {meta['date']}; torch threads {meta['torch_threads']} of {meta['cpu_count']} CPUs; "
        f"load average (1/5/15 min) at start {_loads(meta.get('load_average_start'))}, "
        f"at end {_loads(meta.get('load_average_end'))}",
        f"- command: `{meta['command']}`" + (f" at commit {meta['commit']}" if meta.get("commit") else ""),
        f"- clock: {meta['clock']}",
        f"- method: {meta['method']}",
    ]
    if meta.get("telemetry"):
        lines.append(f"- telemetry: {meta['telemetry']}")
    if result.get("notes"):
        lines += ["", *result["notes"]]
    for title, header, rows in tables(result):
        lines += ["", f"## {title}", "", "| " + " | ".join(header) + " |",
                  "|" + "|".join("---" for _ in header) + "|"]
        lines += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"

