"""Sweeps: the SLURM / submitit launcher configs and the experiment configs, composed as Hydra does."""

from __future__ import annotations

import importlib.util
import itertools
import json
import os
from pathlib import Path
from typing import Any

import pytest
from conftest import TINY, run_cli
from hydra import compose, initialize_config_module
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.utils import instantiate
from omegaconf import DictConfig

from mptrain.config import LOSS_SCALES, PRECISIONS, register_configs, validate

register_configs()
submitit = pytest.importorskip("submitit")
pytest.importorskip("hydra_plugins.hydra_submitit_launcher")

TINY_RESNET = ["model.width_divisor=8", "data.image_size=32", *TINY, "trainer.max_steps=2"]
HAVE_ADAPTIVE = importlib.util.find_spec("mptrain.numerics.adaptive_scaling") is not None


def hydra_compose(*overrides: str) -> DictConfig:
    with initialize_config_module("mptrain.configs", version_base="1.3"):
        return compose("config", overrides=list(overrides), return_hydra_config=True)


def sweep_params(cfg: DictConfig) -> dict[str, list[str]]:
    """hydra.sweeper.params as {key: [choice, ...]}, parsed by Hydra's own override parser."""
    parser = OverridesParser.create()
    out = {}
    for key, value in cfg.hydra.sweeper.params.items():
        (override,) = parser.parse_overrides([f"{key}={value}"])
        out[key] = list(override.sweep_string_iterator()) if override.is_sweep_override() else [str(value)]
    return out


# ------------------------------------------------------------------------------------ SLURM


class Submitted(Exception):
    """Raised in place of sbatch: the executor, fully configured, is what we want to look at."""


def launch_without_a_cluster(monkeypatch, tmp_path: Path, cfg: DictConfig, jobs: list[list[str]]) -> Any:
    """Run the real SlurmLauncher.launch up to the point of calling sbatch; return the executor."""
    import submitit.slurm.slurm as slurm

    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    (fake_bin / "srun").write_text("#!/bin/sh\nexit 0\n")  # submitit only checks that srun exists
    (fake_bin / "srun").chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake_bin}{os.pathsep}{os.environ['PATH']}")
    seen: dict[str, Any] = {}

    def capture(self: Any, submissions: list[Any]) -> None:
        seen["executor"], seen["jobs"] = self, len(submissions)
        raise Submitted

    monkeypatch.setattr(slurm.SlurmExecutor, "_internal_process_submissions", capture)
    launcher = instantiate(cfg.hydra.launcher)
    launcher.setup(hydra_context=None, task_function=lambda c: None, config=cfg)
    with pytest.raises(Submitted):
        launcher.launch(jobs, initial_job_idx=0)
    assert seen["jobs"] == len(jobs)
    return seen["executor"]


def test_slurm_launcher_defaults_compose():
    cfg = hydra_compose("hydra/launcher=slurm", "hydra.sweep.dir=/tmp/sweep")
    ln = cfg.hydra.launcher
    assert ln._target_ == "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher"
    assert (ln.nodes, ln.gpus_per_node, ln.tasks_per_node) == (1, 1, 1)  # one DDP rank per GPU
    assert ln.timeout_min == 240 and ln.signal_delay_s == 120 and ln.max_num_timeout == 3
    assert ln.partition is None and ln.constraint is None and list(ln.setup) == []
    assert ln.submitit_folder == "/tmp/sweep/.submitit/%j"


def test_slurm_submitit_parameters_are_what_the_config_says(monkeypatch, tmp_path):
    sweep = tmp_path / "sweep"
    cfg = hydra_compose(
        "hydra/launcher=slurm",
        f"hydra.sweep.dir={sweep}",
        "hydra.launcher.partition=gpu",
        "hydra.launcher.nodes=2",
        "hydra.launcher.gpus_per_node=8",
        "hydra.launcher.cpus_per_task=10",
        "hydra.launcher.mem_gb=480",
        "hydra.launcher.timeout_min=720",
        "hydra.launcher.constraint=h100",
        "hydra.launcher.signal_delay_s=300",
        "hydra.launcher.max_num_timeout=5",
        "hydra.launcher.setup=['module load cuda/12.4','export NCCL_DEBUG=WARN']",
        "+experiment=paper_table1",
    )
    launcher = instantiate(cfg.hydra.launcher)
    assert type(launcher).__name__ == "SlurmLauncher"
    assert launcher.params["tasks_per_node"] == 8  # follows gpus_per_node

    executor = launch_without_a_cluster(monkeypatch, tmp_path, cfg, [["precision=fp32"], ["precision=mixed"]])
    assert executor.max_num_timeout == 5
    p = executor.parameters
    assert (p["partition"], p["nodes"], p["gpus_per_node"], p["ntasks_per_node"]) == ("gpu", 2, 8, 8)
    assert (p["cpus_per_task"], p["mem"], p["time"], p["constraint"]) == (10, "480GB", 720, "h100")
    assert p["job_name"] == "paper_table1"

    sbatch = executor._make_submission_file_text("python -m submitit.core._submit X", "uid")
    for line in ("--partition=gpu", "--nodes=2", "--gpus-per-node=8", "--ntasks-per-node=8", "--cpus-per-task=10",
                 "--mem=480GB", "--time=720", "--constraint=h100", "--job-name=paper_table1",
                 f"--signal={submitit.JobEnvironment.USR_SIG}@300"):
        assert f"#SBATCH {line}\n" in sbatch
    assert "module load cuda/12.4\nexport NCCL_DEBUG=WARN\n" in sbatch
    assert f"--output {sweep}/.submitit/%j/" in sbatch


def test_local_submitit_launcher_composes():
    cfg = hydra_compose("hydra/launcher=local", "hydra.sweep.dir=/tmp/sweep")
    launcher = instantiate(cfg.hydra.launcher)
    assert type(launcher).__name__ == "LocalLauncher"
    assert launcher.params["tasks_per_node"] == 1 and launcher.params["timeout_min"] == 60


def test_local_submitit_multirun(tmp_path):
    """Two jobs through submitit's executor (pickled, run in subprocesses), each in its own run dir."""
    sweep = tmp_path / "sweep"
    r = run_cli("-m", "hydra/launcher=local", *TINY_RESNET, "precision=fp32,amp_bf16", f"hydra.sweep.dir={sweep}")
    assert r.returncode == 0, r.stderr[-2000:]
    summaries = {p.parent.name: json.loads(p.read_text()) for p in sweep.glob("*/summary.json")}
    assert set(summaries) == {"0-resnet50-fp32", "1-resnet50-amp_bf16"}
    assert all(s["status"] == "completed" for s in summaries.values())
    assert list((sweep / ".submitit").iterdir())  # submitit's own job folders


# ------------------------------------------------------------------------------------ experiments

EXPERIMENTS = {
    "paper_table1": {"model": ["alexnet", "vgg16", "googlenet", "inception_v3", "resnet50"],
                     "precision": ["fp32", "mixed"]},
    "loss_scale_ablation": {"loss_scale": ["none", "static", "dynamic", "adaptive"]},
    "precision_sweep": {"precision": list(PRECISIONS)},
    "transformer_lm_precision": {"precision": list(PRECISIONS)},
}
MODEL_OF = {"transformer_lm_precision": "transformer_lm"}  # the one model of the others: resnet50


@pytest.mark.parametrize("name", list(EXPERIMENTS))
def test_experiment_expands_to_its_sweep(name):
    cfg = hydra_compose(f"+experiment={name}")
    params = sweep_params(cfg)
    assert params == EXPERIMENTS[name]
    assert cfg.hydra.job.name == name
    assert f"/{name}/" in cfg.hydra.sweep.dir  # one log root per experiment
    assert set(params.get("precision", [])) <= set(PRECISIONS)
    assert set(params.get("loss_scale", [])) <= set(LOSS_SCALES)

    # Every job of the sweep composes and passes the value checks.
    keys = list(params)
    for values in itertools.product(*params.values()):
        job = hydra_compose(f"+experiment={name}", *(f"{k}={v}" for k, v in zip(keys, values, strict=True)))
        validate(job)
        for k, v in zip(keys, values, strict=True):
            assert job[k].name == v
        if name != "paper_table1":
            assert job.model.name == MODEL_OF.get(name, "resnet50")  # the one model of the experiment
        if name == "loss_scale_ablation":
            assert job.precision.name == "amp_fp16"
            assert job.run_name == f"resnet50-amp_fp16-{values[0]}"


def test_experiment_sweep_can_be_narrowed_from_the_command_line(tmp_path):
    """A real `mptrain -m +experiment=loss_scale_ablation`, tiny and narrowed to two policies."""
    policies = ["static", "adaptive"] if HAVE_ADAPTIVE else ["static", "dynamic"]
    sweep = tmp_path / "sweep"
    r = run_cli("-m", "+experiment=loss_scale_ablation", *TINY_RESNET, f"loss_scale={','.join(policies)}",
                f"hydra.sweep.dir={sweep}")
    assert r.returncode == 0, r.stderr[-2000:]
    summaries = {p.parent.name: json.loads(p.read_text()) for p in sweep.glob("*/summary.json")}
    assert set(summaries) == {f"{i}-resnet50-amp_fp16-{p}" for i, p in enumerate(policies)}
    for i, policy in enumerate(policies):
        s = summaries[f"{i}-resnet50-amp_fp16-{policy}"]
        assert s["status"] == "completed" and s["loss_scale"] == policy and s["precision"] == "amp_fp16"
    assert summaries["0-resnet50-amp_fp16-static"]["final_loss_scale"] == 128.0
