"""Functions that ``torch.multiprocessing.spawn`` runs as gloo ranks. A spawned rank imports the
module its function lives in; a test module imports conftest, Hydra and the engine, which took each
rank several seconds, so these live here, next to nothing."""

from __future__ import annotations

from pathlib import Path


def agree_worker(rank: int, init_file: str, out: str) -> None:
    """tests/test_distributed.py: each rank's own choice of scale, agreed over both ranks."""
    import torch
    import torch.distributed as dist

    from mptrain.numerics.adaptive_scaling import AdaptiveScaler

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    scaler = AdaptiveScaler(torch.device("cpu"))
    scaler.attach(torch.nn.Sequential(torch.nn.Linear(4, 4)))
    mine = torch.tensor(8.0 if rank == 0 else 2.0)  # each rank's own choice from its own gradients
    Path(out, f"rank{rank}").write_text(str(float(scaler._agree(mine))))
    dist.destroy_process_group()
