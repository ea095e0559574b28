"""scripts/study.py: its runs compose with the real configs, and its claims read paired runs right."""

from __future__ import annotations

import importlib.util
import random
import sys
from pathlib import Path

import pytest

from mptrain.cli import compose
from mptrain.config import validate
from mptrain.verdicts import FAILS, HOLDS, OPEN

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def study():
    spec = importlib.util.spec_from_file_location("study", ROOT / "scripts" / "study.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["study"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_every_kind_of_study_run_composes_and_validates(study) -> None:
    specs = study.all_specs(quick=False)
    assert len({s.name for s in specs}) == len(specs)  # a cell and seed is one run, whichever parts use it
    kinds = {(s.model, s.cell, s.tag): s for s in specs}
    for (model, cell, _), s in kinds.items():
        cfg = compose([o for o in s.overrides if not o.startswith("hydra.")])
        validate(cfg)
        assert cfg.model.name == model
        assert cfg.trainer.seed == s.seed and cfg.trainer.device == "cpu"
        want = dict(o.split("=", 1) for o in study.CELLS[cell] if not o.startswith("precision."))
        assert cfg.precision.name == want["precision"]
        assert cfg.loss_scale.name == want.get("loss_scale", "auto")
        if cfg.loss_scale.name == "enhanced":  # the floor must rise within the run, or enhanced is just dynamic
            floors = {int(k): v for k, v in cfg.loss_scale.min_scale_schedule.items()}
            assert max(floors) < cfg.trainer.max_steps and sorted(floors.values()) == [1.0, 64.0, 512.0]
    # every claim has at least 5 seeds of each cell it compares
    for s in study.parity_specs(False) + study.scaling_specs(False) + study.fp8_specs(False):
        assert sum(x.model == s.model and x.cell == s.cell for x in specs if x.tag == "") >= 5


def test_quick_is_a_smaller_copy_of_the_same_runs(study) -> None:
    full = {(s.model, s.cell, s.tag) for s in study.all_specs(False)}
    quick = study.all_specs(True)
    assert {(s.model, s.cell, s.tag) for s in quick} == full
    assert {s.seed for s in quick} == {0, 1}


def records(study, values: dict[tuple[str, str], list[float]]) -> list[dict]:
    out = []
    for (model, cell), per_seed in values.items():
        metric = study.RECIPES[model].metric
        for seed, v in enumerate(per_seed):
            out.append(dict(part="parity", name=f"{model}-{cell}-s{seed}", model=model, cell=cell, seed=seed,
                            status="completed", metrics={metric: v}))
    return out


def test_claims_read_paired_differences_per_seed(study) -> None:
    rng = random.Random(0)
    base = [300.0, 320.0, 280.0, 310.0, 295.0]  # the seeds differ by far more than the effects
    lm = {
        ("lstm_lm", "fp32"): base,
        ("lstm_lm", "fp16_none"): [b * 1.05 for b in base],  # 5% worse on every seed
        ("lstm_lm", "fp16_static_8"): [b * (1 + rng.uniform(-0.001, 0.001)) for b in base],
        ("lstm_lm", "fp16_static_128"): [b * (1 + rng.uniform(-0.001, 0.001)) for b in base],
        ("lstm_lm", "fp16_static_32768"): [b * 1.2 for b in base],  # overflows: 20% worse
        ("lstm_lm", "amp_fp16"): [b * (1 + rng.uniform(-0.001, 0.001)) for b in base],
    }
    t = study.Table(records(study, lm))
    claims = {c["id"]: c for c in study.claims(t)}
    b = claims["b"]
    assert [p["verdict"] for p in b["parts"]] == [HOLDS, HOLDS, HOLDS, HOLDS] and b["verdict"] == HOLDS
    assert b["parts"][0]["effect"] == pytest.approx(5.0)  # % of perplexity, paired
    c = claims["c"]
    assert "fp16_static_32768" in c["parts"][0]["claim"] and c["parts"][0]["verdict"] == HOLDS
    assert c["verdict"] == OPEN  # adaptive is not measured on the LSTM: the claim can't hold whole
    # nothing measured: no verdict, no seeds
    assert claims["d"]["verdict"] == OPEN and claims["d"]["parts"][0]["n_seeds"] == 0


def test_a_loss_within_the_margin_is_decided_against_the_claim(study) -> None:
    acc = {("alexnet", "fp32"): [97.0, 98.0, 96.5, 97.5, 98.2], ("alexnet", "fp8_none"): [96.9, 98.1, 96.5, 97.4, 98.2]}
    claims = {c["id"]: c for c in study.claims(study.Table(records(study, acc)))}
    unscaled = claims["d"]["parts"][0]
    assert unscaled["verdict"] == FAILS and unscaled["n_seeds"] == 5
    assert claims["d"]["verdict"] == FAILS
