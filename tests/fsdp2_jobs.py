"""Several mptrain jobs in one launch, so that the suite pays torchrun's start-up once, not per job:

    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/fsdp2_jobs.py JOBS.json

JOBS.json is a list of ``[run_dir, [override, ...]]``. Each job is composed, validated and trained as
the ``mptrain`` command does (``mptrain.cli``'s compose and validate, then ``run.train``), in one
process group (the first job sets it up; it is torn down after the last). With ``MPTRAIN_TEST_OVERFLOW=step,step,...``
the overflow hook below is installed (it logs to ``MPTRAIN_TEST_SKIPS``).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def install_overflow_hook(steps: set[int], log: Path, setattr_: Callable[[Any, str, Any], None] = setattr) -> None:
    """On the given optimizer steps, put an Inf into one gradient element of rank 1's own shard (of
    the whole gradient in a single process) just before the scaler's unscale_, and log per rank and
    step: the scaler's found_inf, its scale after update, and whether every local parameter came
    out of the step untouched."""
    from mptrain.numerics import loss_scaling as ls

    unscale, update = ls._GradScalerBase.unscale_, ls._GradScalerBase.update
    rank = int(os.environ.get("RANK", "0"))
    inject_here = rank == 1 or int(os.environ.get("WORLD_SIZE", "1")) == 1
    calls = [0]
    before: list[tuple[torch.Tensor, torch.Tensor]] = []

    def unscale_(self: Any, optimizer: torch.optim.Optimizer) -> None:
        calls[0] += 1
        params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        before[:] = [(p, _local(p).detach().clone()) for p in params]
        if calls[0] in steps and inject_here:
            grad = next(_local(p.grad) for p in params if _local(p.grad).numel())
            grad.view(-1)[0] = float("inf")
        unscale(self, optimizer)

    def update_(self: Any) -> None:
        update(self)
        untouched = all(torch.equal(_local(p).detach(), b) for p, b in before)
        with open(log, "a") as f:
            f.write(f"{rank} {calls[0]} {float(self.found_inf)} {float(self.scale_value)} {int(untouched)}\n")

    setattr_(ls._GradScalerBase, "unscale_", unscale_)
    setattr_(ls._GradScalerBase, "update", update_)


def glue_worker(rank: int, init_file: str, out: str) -> None:
    """tests/test_fsdp2.py's two-rank checks of the glue, in one mp.spawn (here: a light module to import)."""
    import torch.distributed as dist
    from omegaconf import OmegaConf
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from mptrain import distributed
    from mptrain.distributed import DistEnv
    from mptrain.numerics.loss_scaling import DynamicScaler
    from mptrain.numerics.precision import Precision
    from mptrain.parallel import Fsdp2

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    distributed._ENV = DistEnv(rank, rank, 2, launched=True)
    cpu = torch.device("cpu")
    results: dict[str, Any] = {}

    # 1. found_inf is all-reduced by the scaler itself, whatever the gradients are (plain tensors here).
    p = nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=0.1)
    scaler = DynamicScaler(cpu, init_scale=8.0)
    scaler.reduce_found_inf = True
    scaler.scale(p.sum()).backward()
    if rank == 1:
        p.grad[0] = float("inf")
    scaler.unscale_(opt)
    scaler.step(opt)
    scaler.update()
    results["found_inf"], results["scale"] = float(scaler.found_inf), float(scaler.scale_value)
    results["p"] = p.detach().tolist()

    # 2. trainer.grad_clip as the engine calls it, on DTensor gradient shards: the global norm. Both
    # ranks see the same 8 rows, so the reduced gradient is the one-process gradient of those rows.
    def mlp() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))

    sharded, alone = mlp(), mlp()
    mesh = init_device_mesh("cpu", (2,))
    fully_shard(sharded[0], mesh=mesh)
    fully_shard(sharded, mesh=mesh)
    x = torch.randn(8, 8, generator=torch.Generator().manual_seed(2))
    norms = []
    for m in (sharded, alone):
        m(x).pow(2).sum().backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(list(m.parameters()), 0.01, foreach=True)))
    full = [p.grad.full_tensor() for p in sharded.parameters()]
    results["clip_norms"] = norms
    results["clip_equal"] = all(torch.allclose(a, p.grad, rtol=1e-6, atol=1e-9)
                                for a, p in zip(full, alone.parameters(), strict=True))
    results["clip_total"] = float(torch.linalg.vector_norm(torch.stack([g.norm() for g in full])))

    # 3. torchao float8 (emulated) with its FSDP2 float8 all-gather, through mptrain's glue, against
    # FSDP2 gathering the FP32 weights (float8 casts after the gather), on the same rows.
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    def net(fp8_gather: bool) -> nn.Module:
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))
        config = Float8LinearConfig(emulate=True, enable_fsdp_float8_all_gather=fp8_gather)
        return convert_to_float8_training(m, config=config)

    precision = Precision("fp8", "fp8", cpu, fp8="torchao", options={"recipe": "tensorwise"})
    cfg = OmegaConf.create({"replicate": 1, "shard_modules": ["0", "2"], "reshard_after_forward": True})
    sharding = Fsdp2(cfg, cpu, distributed.env(), precision)
    models = {"float8_gather": sharding.shard("model", net(True)), "fp32_gather": net(False)}
    for name in ("0", "2"):
        fully_shard(models["fp32_gather"].get_submodule(name), mesh=sharding.mesh)
    fully_shard(models["fp32_gather"], mesh=sharding.mesh)
    opts = {k: torch.optim.SGD(m.parameters(), lr=0.5) for k, m in models.items()}
    torch.manual_seed(1)
    curves: dict[str, list[float]] = {k: [] for k in models}
    for _ in range(5):
        x = torch.randn(16, 32)[rank * 8:(rank + 1) * 8]
        for key, m in models.items():
            loss = m(x).pow(2).mean()
            loss.backward()
            opts[key].step()
            opts[key].zero_grad()
            if key == "float8_gather":
                sharding.after_step(m)  # torchao's precompute_float8_dynamic_scale_for_fsdp
            curves[key].append(float(distributed.all_reduce(loss.detach().clone(), "mean")))
    results["float8"] = curves
    results["float8_weight"] = type(models["float8_gather"][0].weight.to_local()).__name__
    Path(out, f"rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


def main() -> None:
    from mptrain.cli import compose
    from mptrain.config import register_configs, validate
    from mptrain.run import train

    register_configs()
    if os.environ.get("MPTRAIN_TEST_OVERFLOW"):
        steps = {int(s) for s in os.environ["MPTRAIN_TEST_OVERFLOW"].split(",")}
        install_overflow_hook(steps, Path(os.environ["MPTRAIN_TEST_SKIPS"]))
    # One process group for every job: torch re-creates the default group under the same store keys, so
    # a rank that starts the next job first can read the other's stale address and wait forever.
    destroy = torch.distributed.destroy_process_group
    torch.distributed.destroy_process_group = lambda *a, **k: None
    for run_dir, overrides in json.loads(Path(sys.argv[1]).read_text()):
        cfg = compose(overrides)
        validate(cfg)
        train(cfg, Path(run_dir))
        torch.distributed.barrier()
    destroy()


if __name__ == "__main__":
    main()
