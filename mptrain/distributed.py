"""Data-parallel plumbing: process-group set-up from torchrun or SLURM, and small collectives.

mptrain uses torch.distributed as it is: ``torchrun --nproc_per_node=N -m mptrain ...`` (or a
SLURM job with one task per GPU) gives each process a rank; the engine wraps its modules in
DistributedDataParallel (or shards them, ``parallel=fsdp2``: mptrain.parallel), and only rank 0 logs.
``data.batch_size`` is per device.
"""

from __future__ import annotations

import contextlib
import os
import signal
from dataclasses import dataclass
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistEnv:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    launched: bool = False  # started by torchrun (even as 1 process) or as one of several SLURM tasks

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        """A process group and DDP: under torchrun always, so ``--nproc_per_node=1`` runs the same
        NCCL/gloo path as a multi-GPU job (the way to test it on one GPU)."""
        return self.launched or self.world_size > 1


_ENV = DistEnv()


def env() -> DistEnv:
    """This process's place in the job (rank 0 of 1 when not distributed)."""
    return _ENV


def _from_environment() -> DistEnv:
    """torchrun sets RANK/LOCAL_RANK/WORLD_SIZE; a SLURM job step sets SLURM_PROCID & co."""
    if "WORLD_SIZE" in os.environ and "RANK" in os.environ:
        return DistEnv(int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", 0)), int(os.environ["WORLD_SIZE"]),
                       launched=True)
    if int(os.environ.get("SLURM_NTASKS", "1")) > 1 and "SLURM_PROCID" in os.environ:
        world = int(os.environ["SLURM_NTASKS"])
        rank = int(os.environ["SLURM_PROCID"])
        local = int(os.environ.get("SLURM_LOCALID", 0))
        # torch's env:// rendezvous reads these; the first node of the allocation hosts the store.
        os.environ.setdefault("MASTER_ADDR", _first_slurm_host())
        os.environ.setdefault("MASTER_PORT", str(20000 + int(os.environ.get("SLURM_JOB_ID", "0")) % 20000))
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(local), WORLD_SIZE=str(world))
        return DistEnv(rank, local, world, launched=True)
    return DistEnv()


def _first_slurm_host() -> str:
    nodes = os.environ.get("SLURM_JOB_NODELIST", os.environ.get("SLURM_NODELIST", "localhost"))
    # "gpu[01-04],cpu7" -> "gpu01": scontrol would be exact, but it is not always on compute nodes.
    head = nodes.split(",")[0]
    if "[" in head:
        prefix, rest = head.split("[", 1)
        head = prefix + rest.split("-")[0].split(",")[0].rstrip("]")
    return head


def cuda_index(local_rank: int) -> int:
    """This process's GPU among those it can see.

    One GPU per task is not always "GPU number LOCAL_RANK": under SLURM's ``--gpus-per-task`` or a
    per-task ``CUDA_VISIBLE_DEVICES`` each process sees only its own GPU(s), so the local rank is
    an invalid ordinal there. Round-robin over the visible devices covers both layouts.
    """
    count = torch.cuda.device_count()
    return local_rank % count if count else 0


def init(device_type: str) -> DistEnv:
    """Join the process group if launched by torchrun or as one of several SLURM tasks. NCCL on CUDA,
    gloo on CPU."""
    global _ENV
    found = _from_environment()
    if found.enabled and not dist.is_initialized():
        if device_type == "cuda":
            torch.cuda.set_device(cuda_index(found.local_rank))
        dist.init_process_group(backend="nccl" if device_type == "cuda" else "gloo")
    _ENV = found
    return found


def backend() -> str | None:
    """The process group's backend (nccl | gloo), None when not distributed."""
    return dist.get_backend() if dist.is_initialized() else None


def shutdown(completed: bool = False) -> None:
    """Leave the process group. ``completed``: every rank finished the run, so they can meet once more.

    Why the barrier (gloo's only): gloo's worker threads free a finished collective's tensors while
    holding the group's lock, and need the GIL to do it. DDP's reducer holds the group, and when the
    model is collected it frees the group with the GIL held, waiting for that lock: on a loaded
    2-core CPU a rank that had completed its run never exited (its worker in ~AsyncAllgatherWork,
    waiting for the GIL; its main thread in ~ProcessGroupGloo). The barrier's wait releases the GIL,
    so the workers finish what they hold first. A failed or interrupted rank skips it: its peers may
    never come."""
    global _ENV
    if dist.is_initialized():
        if completed and backend() == "gloo":
            dist.barrier()
        dist.destroy_process_group()
    _ENV = DistEnv()


def all_reduce(t: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """In-place all-reduce (no-op when not distributed); ``op``: sum | max | mean."""
    if _ENV.enabled:
        dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
        if op == "mean":
            t /= _ENV.world_size
    return t


def all_gather_object(obj: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order (``[obj]`` when not distributed). A collective: every
    rank must call it."""
    if not _ENV.enabled:
        return [obj]
    out: list[Any] = [None] * _ENV.world_size
    dist.all_gather_object(out, obj)
    return out


class PreemptionGuard:
    """Turns SIGTERM, SIGUSR1 and SIGUSR2 into a flag the loop checks at a step boundary.

    The loop then checkpoints, writes ``status: interrupted`` and calls ``finish``, which hands the
    signal to whoever had it before: under submitit that handler requeues the job (its
    checkpointing protocol), and the requeued job resumes with ``trainer.resume=auto``.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> PreemptionGuard:
        for sig in self.SIGNALS:
            with contextlib.suppress(ValueError):  # not the main thread: leave signals alone
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.signum = signum

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def finish(self) -> None:
        """Pass the signal on to the handler that was installed before ours (submitit's requeue)."""
        previous = self._previous.get(self.signum) if self.signum is not None else None
        self.__exit__()
        if callable(previous):
            previous(self.signum, None)
