"""Plan ``formats`` (scripts/study_plans/formats.py): its cells compose with the real configs, its
README is generated from results data, the harness's cache refuses runs of other code, and its
pairing check catches runs that do not share their seed's initial weights."""

from __future__ import annotations

import copy
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from mptrain.cli import compose
from mptrain.config import validate
from mptrain.verdicts import FAILS, HOLDS, OPEN

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))


@pytest.fixture(scope="module")
def sf():
    from study_plans import formats

    return formats


@pytest.fixture(scope="module")
def harness():
    from study_plans import harness

    return harness


def _git(*args: str) -> str | None:
    r = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)
    return r.stdout.strip() if r.returncode == 0 else None


# ------------------------------------------------------------------------------------------ cells


def test_the_part_is_eight_cells_by_five_paired_seeds(sf) -> None:
    full = sf.specs(quick=False)
    assert len(full) == 40 and len({s.name for s in full}) == 40
    assert list(sf.CELLS) == ["fp32", "bf16", "fp8_e5m2", "fp8_hybrid", "mxfp8", "mxfp4", "nvfp4", "nvfp4_plain"]
    assert {s.seed for s in full} == set(range(5)) and {sf.steps_of(s) for s in full} == {sf.STEPS}
    assert [s.seed for s in full[:8]] == [0] * 8  # seed-major: a stopped part leaves whole seeds
    quick = sf.specs(quick=True)
    assert {s.seed for s in quick} == {0, 1} and {sf.steps_of(s) for s in quick} == {sf.QUICK_STEPS}
    assert len(sf.specs(n_seeds=3)) == 24
    # every claim compares a cell with one that runs on the same seeds
    for c in sf.CLAIMS:
        assert c.cell in sf.CELLS and c.ref in sf.CELLS and c.cell != c.ref


def test_every_cell_composes_and_validates_with_the_real_configs(sf) -> None:
    for name, cell in sf.CELLS.items():
        s = sf.spec(name, 3, sf.STEPS)
        cfg = compose(list(s.overrides))
        validate(cfg)
        assert cfg.model.name == sf.MODEL and cfg.data.name == "python_docs"
        assert cfg.model.dropout == 0.0  # the pairing premise: no dropout mask can differ between cells
        assert cfg.trainer.seed == 3 and cfg.trainer.max_steps == sf.STEPS and cfg.trainer.device == "cpu"
        assert cfg.trainer.resume is None
        want = dict(o.split("=", 1) for o in cell.overrides)
        assert cfg.precision.name == want["precision"]
        assert cfg.loss_scale.name == want.get("loss_scale", "auto")
        for key, value in want.items():
            if key.startswith("precision."):
                got = cfg.precision[key.split(".", 1)[1]]
                assert str(got).lower() == value.replace("null", "none"), (name, key, got)
        if cfg.precision.name == "mx":
            assert cfg.precision.seed == 3  # its SR and Hadamard streams follow the run's seed
        if cfg.loss_scale.name == "enhanced":  # the floor must rise within the run, or enhanced is just dynamic
            floors = {int(k): v for k, v in cfg.loss_scale.min_scale_schedule.items()}
            assert max(floors) < sf.STEPS and sorted(floors.values()) == [1.0, 64.0, 512.0]
    nv, plain = compose(list(sf.spec("nvfp4", 0, 8).overrides)), compose(list(sf.spec("nvfp4_plain", 0, 8).overrides))
    assert nv.precision.format == plain.precision.format == "nvfp4"
    assert (nv.precision.stochastic_rounding, nv.precision.hadamard, nv.precision.weight_2d_blocks) == (True,) * 3
    assert nv.precision.keep_last is None  # the recipe's last 15%
    assert (plain.precision.stochastic_rounding, plain.precision.hadamard, plain.precision.weight_2d_blocks,
            plain.precision.keep_last) == (False, False, False, 0)


# ------------------------------------------------------------------------------------------ synthetic results

BASE_PPL = [401.17, 388.42, 412.93, 395.51, 407.36]  # the seeds differ by far more than the effects
FACTOR = {"fp32": [1.0] * 5, "bf16": [1.0003, 0.9998, 1.0001, 1.0002, 0.9999],
          "fp8_e5m2": [1.004, 1.006, 1.003, 1.005, 1.004], "fp8_hybrid": [1.002, 1.001, 1.003, 1.0, 1.002],
          "mxfp8": [1.001, 1.003, 0.999, 1.002, 1.0], "mxfp4": [1.061, 1.058, 1.066, 1.059, 1.063],
          "nvfp4": [1.01, 0.995, 1.02, 0.99, 1.012], "nvfp4_plain": [1.041, 1.037, 1.045, 1.04, 1.043]}


def synthetic_records(sf, n_seeds: int = 5) -> list[dict]:
    recs = []
    for s in range(n_seeds):
        for cell in sf.CELLS:
            spec = sf.spec(cell, s, sf.STEPS)
            ppl = BASE_PPL[s] * FACTOR[cell][s]
            recs.append({
                "cell": cell, "seed": s, "name": spec.name, "command": spec.command, "overrides": list(spec.overrides),
                "status": "completed", "val_ppl": ppl, "val_loss": math.log(ppl), "final_train_loss": 5.9,
                "final_train_ppl": math.exp(5.9), "first_step_loss": 8.1 + 0.01 * s + 0.001 * len(cell),
                "steps": sf.STEPS, "skipped_steps": 3 if cell == "fp8_e5m2" else 0, "final_loss_scale": 1.0,
                "low_precision_flop_fraction": {"fp32": 0.0, "bf16": 0.0, "nvfp4": 0.3862}.get(cell, 0.9614),
                "precision_resolved": cell, "loss_scale": "none", "wall_time_s": 50.0,
                "process_wall_s": 61.25 + 10 * list(sf.CELLS).index(cell), "commit": "c0ffee" * 6 + "abcd",
                "code_dirty": False, "init_digest": f"digest{s}", "data_fingerprint": {"vocab_digest": "v"},
                "parameters": 827392, "val_curve": [[20, 2 * ppl], [40, ppl]], "run_dir": f"nowhere/{spec.name}",
                "paired": None,
            })
    return recs


def synthetic_results(sf, recs: list[dict] | None = None) -> dict:
    res = sf.build_results(recs or synthetic_records(sf), sf.STEPS, quick=False, elapsed_s=1234.0)
    res["design"].update(d_model=96, num_layers=3, num_heads=6, block_size=48, dropout=0.0, batch_size=17,
                         bptt=48, tokens_per_step=816, optimizer="adamw", lr=0.0021, weight_decay=0.07,
                         schedule="cosine", warmup_steps=7, grad_clip=0.9, parameters=654321, train_tokens=91234,
                         val_tokens=4321, steps_per_epoch=111, epochs=sf.STEPS / 111)
    res["machine"].update(cpu="Test CPU 9000", cores=7, cpu_capability="AVX512")
    res["figure"] = "formats.png"
    return res


def test_claims_read_paired_differences_per_seed(sf) -> None:
    res = synthetic_results(sf)
    cl = {c["id"]: c for c in res["claims"]}
    assert cl["parity/bf16"]["verdict"] == HOLDS and cl["parity/mxfp8"]["verdict"] == HOLDS
    assert cl["parity/mxfp4"]["verdict"] == FAILS  # 6% worse on every seed
    assert cl["parity/nvfp4"]["verdict"] == OPEN  # mean +0.54%, spread ±1.3%
    assert cl["nvfp4/options"]["verdict"] == HOLDS and cl["nvfp4/options"]["ref"] == "nvfp4"
    assert cl["parity/mxfp4"]["effect"] == pytest.approx(100 * (sum(FACTOR["mxfp4"]) / 5 - 1))
    assert all(c["n_seeds"] == 5 for c in res["claims"])
    assert res["parity_verdict"] == FAILS
    assert res["pairing"]["paired_runs"] == 40 and all(r["paired"] for r in res["runs"])
    assert res["cells"]["fp8_e5m2"]["skipped_steps"] == {str(s): 3 for s in range(5)}


def test_a_run_that_does_not_share_its_seeds_init_is_unpaired_and_left_out(sf) -> None:
    recs = synthetic_records(sf)
    bad = next(r for r in recs if r["cell"] == "mxfp4" and r["seed"] == 2)
    bad["init_digest"] = "something-else"
    res = synthetic_results(sf, recs)
    assert bad["paired"] is False and res["pairing"]["unpaired"] == ["mxfp4/seed2"]
    c = next(c for c in res["claims"] if c["id"] == "parity/mxfp4")
    assert c["n_seeds"] == 4 and c["seeds"] == [0, 1, 3, 4]
    assert "mxfp4/seed2" in sf.render_readme(res)


def test_a_diverged_run_leaves_its_claim_undecided(sf) -> None:
    recs = synthetic_records(sf)
    r = next(r for r in recs if r["cell"] == "nvfp4_plain" and r["seed"] == 1)
    r.update(status="diverged", val_ppl=None)
    res = synthetic_results(sf, recs)
    c = next(c for c in res["claims"] if c["id"] == "parity/nvfp4_plain")
    assert c["verdict"] == OPEN and c["diverged_seeds"] == [1] and c["effect"] is None
    assert "diverged on seed(s) 1 of 5" in sf.render_readme(res)


def test_the_readme_is_generated_from_the_results(sf) -> None:
    res = synthetic_results(sf)
    text = sf.render_readme(res)
    cl = {c["id"]: c for c in res["claims"]}
    mx4 = cl["parity/mxfp4"]
    # the claims' effects, intervals and seeds, as the results hold them
    for c in res["claims"]:
        assert f"{c['claim']} | **{c['verdict']}** | {sf.signed(c['effect'])}" in text
        assert sf.ci(c["ci95"]) in text
    assert f"{sf.signed(mx4['effect'])}% perplexity {sf.ci(mx4['ci95'])} over 5 paired seeds" in text
    # per-cell means, per-seed values, FLOP shares and costs
    for name, cell in res["cells"].items():
        assert f"| {name} | {cell['label']} | {cell['val_ppl_mean']:.2f} [" in text
        assert f"{cell['val_ppl_per_seed']['3']:.2f}" in text
        if name not in ("fp32", "bf16"):
            assert f"{name} {cell['process_wall_s_mean']:.0f} s" in text
    for name, shown in (("fp32", "FP32"), ("bf16", "bf16")):
        assert f"{res['cells'][name]['process_wall_s_mean']:.0f} s in {shown}" in text
    assert "nvfp4 38.6%" in text and "mxfp4 96.1%" in text
    assert "(38.6% against 96.1%)" in text  # nvfp4 against nvfp4_plain
    # the design, machine, pairing and cost come from the results, not from the script's constants
    for s in ("3 pre-LayerNorm blocks of d_model 96, 6 heads, 48-token context", "654,321 parameters",
              "91,234 training and 4,321 validation tokens", "batch 17 × 48 = 816 tokens", "111 steps an epoch",
              "lr 0.0021", "weight decay 0.07", "7 warm-up steps", "clipping at 0.9", "Test CPU 9000, 7 cores",
              "40 of 40 finished runs are paired", "commit c0ffeec0ffee"):
        assert s in text, s
    total = sum(r["process_wall_s"] for r in res["runs"])
    assert f"took {sf.mmss(total)} of wall time" in text
    start = math.exp(res["fp32_first_step_loss_mean"])
    assert f"training perplexity of {start:.0f} at step 1" in text
    # change the data, and the prose follows
    res2 = copy.deepcopy(res)
    res2["cells"]["fp32"]["val_ppl_mean"] = 123.456
    res2["claims"][0]["effect"] = 0.4321
    text2 = sf.render_readme(res2)
    assert "123.46" in text2 and "123.46" not in text and "+0.43% perplexity" in text2


def test_the_committed_readme_is_the_rendering_of_the_committed_results(sf) -> None:
    results = sf.DOCS / "results.json"
    if not results.exists():
        pytest.skip("the full part has not been run yet")
    res = json.loads(results.read_text())
    assert (sf.DOCS / "README.md").read_text() == sf.render_readme(res) + "\n"
    assert (sf.DOCS / res["figure"]).exists()
    # the harness's verdicts (mptrain.verdicts.pair and judge) reproduce the committed claims
    again = sf.decide_claims(copy.deepcopy(res["runs"]))
    assert json.loads(json.dumps(again)) == res["claims"]
    # issue 27's corrections, from the data: where FP8's rounding drew from at the runs' commit, and
    # that "enhanced" scaling never moved
    readme = (sf.DOCS / "README.md").read_text()
    assert res["facts"]["fp8_own_rounding_stream"] is False
    assert "FP8's stochastic rounding drew from the global RNG" in readme and "since issue 18" not in readme
    e5m2 = [r for r in res["runs"] if r["cell"] == "fp8_e5m2"]
    assert {r["final_loss_scale"] for r in e5m2} == {65536.0} and {r["skipped_steps"] for r in e5m2} == {0}
    assert "fp8_e5m2's loss scale never moved: every run ended at 65536 with 0 skipped steps" in readme
    assert "FP8 as Mellempudi et al." not in readme


# ------------------------------------------------------------------------------------------ cache


def _stamped_run(tmp_path: Path, spec, **stamp) -> Path:
    run_dir = tmp_path / spec.name
    run_dir.mkdir(parents=True)
    (run_dir / "summary.json").write_text(json.dumps({"status": "completed", "metrics": {"ppl": 400.0}}))
    (run_dir / "stamp.json").write_text(json.dumps({"commit": None, "code_dirty": False, "command": spec.command,
                                                    **stamp}))
    return run_dir


def test_the_cache_reuses_runs_of_this_code_and_refuses_other_commits(sf, harness, tmp_path: Path) -> None:
    head = _git("rev-parse", "HEAD")
    if head is None:
        pytest.skip("not a git checkout")
    code = harness.CodeState(head, dirty=False)
    spec = sf.spec("mxfp4", 1, sf.STEPS)
    ok = _stamped_run(tmp_path / "ok", spec, commit=head)
    assert harness.stale_reason(spec, ok, code) is None
    # a commit that does not exist, a dirty tree at training time, and an older commit whose code differs
    root = _git("rev-list", "--max-parents=0", "HEAD").split()[0]
    for i, stamp in enumerate([{"commit": "f" * 40}, {"commit": head, "code_dirty": True}, {"commit": root}]):
        stale = _stamped_run(tmp_path / f"stale{i}", spec, **stamp)
        assert "not this tree's code" in harness.stale_reason(spec, stale, code)
    # this tree dirty: nothing is current, even a run stamped with HEAD
    assert harness.stale_reason(spec, ok, harness.CodeState(head, dirty=True)) is not None
    # another configuration: its command differs
    assert "command differs" in harness.stale_reason(sf.spec("mxfp4", 1, sf.STEPS + 1), ok, code)


def test_a_stale_run_stops_the_part_before_anything_trains(sf, harness, tmp_path: Path) -> None:
    head = _git("rev-parse", "HEAD")
    if head is None:
        pytest.skip("not a git checkout")
    todo = [sf.spec("fp32", 0, 8), sf.spec("nvfp4", 0, 8)]
    _stamped_run(tmp_path, todo[1], commit="f" * 40)
    trained = []
    code = harness.CodeState(head, False)
    trainer = lambda s, run_dir, c: trained.append(s.name)  # noqa: E731
    with pytest.raises(harness.StaleRunError, match="1 cached run"):
        harness.run_specs(todo, tmp_path, code=code, trainer=trainer)
    assert trained == []
    harness.run_specs(todo, tmp_path, code=code, trainer=trainer, rerun_stale=True)
    assert sorted(trained) == ["fp32/seed0", "nvfp4/seed0"]


# ------------------------------------------------------------------------------------------ pairing


def test_init_digest_is_shared_across_precisions_and_differs_across_seeds(tmp_path: Path) -> None:
    """The engine's pairing digest: the initial weights, rounded to FP16, as every precision starts them."""
    from mptrain.engine import Engine

    def digest(seed: int, *precision: str) -> str:
        cfg = compose(["model=transformer_lm_tiny", "data.vocab_size=200", "data.train_tokens=3000",
                       "data.val_tokens=600", "trainer.device=cpu", "trainer.precision_plan=false",
                       "trainer.resume=null", f"trainer.seed={seed}", *precision])
        validate(cfg)
        return Engine(cfg, tmp_path / f"{seed}-{'-'.join(precision)}").pairing["init_digest"]

    ref = digest(0, "precision=fp32")
    assert digest(0, "precision=mx", "precision.format=nvfp4") == ref
    assert digest(0, "precision=fp8") == ref  # FP16 master weights: the digest hashes FP16 anyway
    assert digest(1, "precision=fp32") != ref
