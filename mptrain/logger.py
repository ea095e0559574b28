"""Run logging: TensorBoard scalars and hparams, a rich progress bar, and the final summary table.

The engine hands over values already on the host (it syncs once per logging window), so nothing
here touches the device.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table
from torch.utils.tensorboard import SummaryWriter
from torch.utils.tensorboard.summary import hparams

log = logging.getLogger("mptrain")

# One console for log lines and the progress bar, so the live bar redraws below the lines. When
# output is a file or a pipe, a wide console keeps each log line on one line.
CONSOLE = Console() if Console().is_terminal else Console(width=200)


def console_handler() -> logging.Handler:
    """The console log handler named in configs/hydra/job_logging/rich.yaml."""
    from rich.logging import RichHandler

    return RichHandler(console=CONSOLE, show_path=False, markup=False)


class RunLogger:
    """TensorBoard events go straight into the run directory, so ``tensorboard --logdir runs``
    shows every run (and every sweep job) side by side."""

    def __init__(self, run_dir: Path, total_steps: int, unit: str, start_step: int = 0, enabled: bool = True):
        self.enabled = enabled
        self.unit = unit
        self.writer = SummaryWriter(log_dir=str(run_dir)) if enabled else None
        self.console = CONSOLE
        self.progress: Progress | None = None
        if enabled and self.console.is_terminal:
            self.progress = Progress(
                TextColumn("[bold]step"),
                MofNCompleteColumn(),
                BarColumn(),
                TextColumn("loss {task.fields[loss]}  scale {task.fields[scale]}  {task.fields[rate]}"),
                TimeRemainingColumn(),
                console=self.console,
            )
            self._task = self.progress.add_task("train", total=total_steps, completed=start_step,
                                                loss="-", scale="-", rate="-")
            self.progress.start()

    def scalar(self, tag: str, value: float, step: int) -> None:
        if self.writer is not None:
            self.writer.add_scalar(tag, value, step)

    def histogram(self, tag: str, values: Any, step: int) -> None:
        if self.writer is not None:
            self.writer.add_histogram(tag, values, step)

    def window(self, step: int, line: dict[str, Any]) -> None:
        """One console line (and a progress update) per logging window."""
        if not self.enabled:
            return
        rate = f"{line['throughput']:,.0f} {self.unit}/s" if line.get("throughput") else "-"
        if self.progress is not None:
            self.progress.update(self._task, completed=step, loss=f"{line['loss']:.4f}",
                                 scale=f"{line['scale']:g}", rate=rate)
        extras = "".join(f" {k} {v:.4g}" for k, v in line.get("extra", {}).items())
        if line.get("data_wait") is not None:
            wait_s, frac = line["data_wait"]
            extras += f"  data_wait {wait_s * 1e3:.1f} ms/step ({frac:.0%})"
        log.info(
            "step %d  loss %.4f  lr %.4g  scale %g  skipped %d  %s%s",
            step, line["loss"], line["lr"], line["scale"], line["skipped"], rate, extras,
        )

    def eval(self, step: int, metrics: dict[str, float]) -> None:
        for k, v in metrics.items():
            self.scalar(f"val/{k}", v, step)
        if self.enabled:
            log.info("eval @ step %d: %s", step, "  ".join(f"{k} {v:.4f}" for k, v in metrics.items()))

    def hparams(self, hp: dict[str, Any], metrics: dict[str, float]) -> None:
        """Write the HParams-tab record into this run's own event file (not a sub-run)."""
        if self.writer is None:
            return
        clean = {k: v if isinstance(v, int | float | str | bool) else str(v) for k, v in hp.items()}
        metrics = {f"hparam/{k}": v for k, v in metrics.items() if v is not None}
        exp, ssi, sei = hparams(clean, metrics)
        fw = self.writer._get_file_writer()
        for summary in (exp, ssi, sei):
            fw.add_summary(summary)
        for k, v in metrics.items():
            self.writer.add_scalar(k, v)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None
        if self.writer is not None:
            self.writer.flush()
            self.writer.close()
            self.writer = None

    def summary_table(self, summary: dict[str, Any]) -> None:
        if not self.enabled:
            return
        table = Table(title=f"mptrain: {summary['status']}", show_header=False)
        table.add_column(style="bold")
        table.add_column()
        rows = [
            ("model / data", f"{summary['model']} / {summary['data']}"),
            ("precision", f"{summary['precision']} -> {summary['precision_resolved']}"),
            ("loss scale", f"{summary['loss_scale']} (final {summary['final_loss_scale']})"),
            ("device", f"{summary['device']} x{summary['world_size']}"),
            ("steps", f"{summary['steps']} ({summary['skipped_steps']} skipped)"),
            ("final loss", _fmt(summary["final_loss"])),
            *((f"val {k}", _fmt(v)) for k, v in summary["metrics"].items()),
            ("throughput", f"{_fmt(summary['throughput'])} {summary.get('throughput_unit', 'samples')}/s"),
            ("peak memory", _bytes(summary["peak_memory_bytes"])),
            ("data wait", _wait(summary.get("data_wait_s"), summary.get("data_wait_fraction"))),
            ("wall time", f"{summary['wall_time_s']:.1f} s"),
            ("run dir", str(summary.get("run_dir", ""))),
        ]
        for k, v in rows:
            table.add_row(k, v)
        self.console.print(table)


def _fmt(v: Any) -> str:
    return "-" if v is None else f"{v:,.4f}" if isinstance(v, float) else str(v)


def _wait(seconds: float | None, fraction: float | None) -> str:
    return "-" if seconds is None or fraction is None else f"{seconds * 1e3:,.1f} ms/step ({fraction:.0%} of step time)"


def _bytes(n: int | None) -> str:
    return "- (CPU)" if n is None else f"{n / 2**20:,.0f} MiB"
