"""One training job, start to end: build the engine, run it, and leave ``summary.json`` (and the
TensorBoard hparams) whatever happens. ``mptrain.cli`` calls it after composing and checking the
config; tests and the benches call it the same way. The loop itself is ``mptrain.engine``."""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from mptrain import distributed
from mptrain.engine import Engine, Interrupted, versions, write_json
from mptrain.errors import DivergedError
from mptrain.numerics import rounding_rng
from mptrain.numerics.plan import render

log = logging.getLogger("mptrain")


def train(cfg: DictConfig, run_dir: Path) -> dict[str, Any]:
    """Build and run one training job; summary.json is written whatever happens.

    Returns the summary. User errors raise MptrainError after the summary is written.
    """
    run_dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    engine: Engine | None = None
    status, error = "failed", None
    guard = distributed.PreemptionGuard()
    try:
        engine = Engine(cfg, run_dir)
        engine.guard = guard.__enter__()
        if engine.plan is not None and engine.dist.is_main:
            engine.logger.console.print(render(engine.plan, per_layer=cfg.trainer.precision_plan_layers))
        log.info(
            "%s on %s x%d | %s (%s) | loss_scale %s | %d steps, batch %d x %d micro-steps per device",
            cfg.model.name, engine.device, engine.dist.world_size, cfg.precision.name, engine.precision.resolved,
            engine.policy, engine.total_steps, cfg.data.batch_size, cfg.trainer.grad_accum,
        )
        engine.fit()
        status = "completed"
    except Interrupted as exc:
        status, error = "interrupted", str(exc)
        raise
    except DivergedError as exc:
        status, error = "diverged", str(exc)
        raise
    except KeyboardInterrupt:
        status, error = "interrupted", "interrupted by the user"
        if engine is not None:
            engine.save(gather=False)
        raise
    except Exception as exc:
        error = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise
    finally:
        wall = time.perf_counter() - start
        if engine is not None:
            summary = engine.summary(status, wall, error)
            engine.logger.hparams(_hparams(cfg, engine), _final_metrics(summary))
            engine.logger.close()
            engine.task.finish(run_dir)
        else:  # failed while building: still leave a record of what was asked
            summary = {"status": status, "error": error, "model": cfg.model.name, "data": cfg.data.name,
                       "precision": cfg.precision.name, "loss_scale": cfg.loss_scale.name,
                       "wall_time_s": wall, "versions": versions(), "run_dir": str(run_dir)}
        if engine is None or engine.dist.is_main:
            write_json(run_dir / "summary.json", summary)
        if engine is not None and status != "failed":
            engine.logger.summary_table(summary)
            for slot in engine.slots:
                if slot.telemetry is not None:
                    if engine.dist.is_main:
                        engine.logger.console.print(slot.telemetry.table(summary["telemetry"][slot.objective.name]))
                    slot.telemetry.close()
        distributed.shutdown(completed=status == "completed")
        # the rounding stream belongs to this run: an in-process caller's later stochastic_round
        # (without a generator) gets the global RNG again, as before the run
        rounding_rng.seed_rounding(None)
        if status == "interrupted":
            guard.finish()  # under submitit: its handler requeues the job
        else:
            guard.__exit__()
    return summary


def _hparams(cfg: DictConfig, engine: Engine) -> dict[str, Any]:
    return {
        "model": cfg.model.name,
        "data": cfg.data.name,
        "precision": cfg.precision.name,
        "precision_resolved": engine.precision.resolved,
        "loss_scale": engine.policy,
        "batch_size": cfg.data.batch_size,
        "lr": cfg.optim.lr,
        "optim": cfg.optim.name,
        "seed": cfg.trainer.seed,
    }


def _final_metrics(summary: dict[str, Any]) -> dict[str, float]:
    out = {f"val/{k}": v for k, v in summary["metrics"].items()}
    if summary["final_loss"] is not None and math.isfinite(summary["final_loss"]):
        out["train/final_loss"] = summary["final_loss"]
    if summary["throughput"]:
        out["train/throughput_median"] = summary["throughput"]
    return out
