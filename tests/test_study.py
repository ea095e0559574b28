"""The study harness and its ``papers`` plan: runs compose with the real configs, claims read paired
runs right, stale runs never mix in silently, and the results README is its template rendered
from the data (which the harness's verdicts reproduce)."""

from __future__ import annotations

import json
import math
import random
import sys
from pathlib import Path

import pytest

from mptrain.cli import compose
from mptrain.config import validate
from mptrain.verdicts import FAILS, HOLDS, OPEN

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs" / "results"
sys.path.insert(0, str(ROOT / "scripts"))


@pytest.fixture(scope="module")
def study():
    from study_plans import papers

    return papers


@pytest.fixture(scope="module")
def parts(study):
    return study


@pytest.fixture(scope="module")
def runs_mod():
    from study_plans import harness

    return harness


def test_every_kind_of_study_run_composes_and_validates(parts) -> None:
    specs = parts.all_specs(quick=False)
    assert len({s.name for s in specs}) == len(specs)  # a cell and seed is one run, whichever parts use it
    kinds = {(s.group, s.cell, s.tag): s for s in specs}
    for (model, cell, _), s in kinds.items():
        cfg = compose([o for o in s.overrides if not o.startswith("hydra.")])
        validate(cfg)
        assert cfg.model.name == parts.RECIPES[model].overrides[0].removeprefix("model=")
        assert cfg.trainer.seed == s.seed and cfg.trainer.device == "cpu"
        want = dict(o.split("=", 1) for o in parts.CELLS[cell] if not o.startswith("precision."))
        assert cfg.precision.name == want["precision"]
        assert cfg.loss_scale.name == want.get("loss_scale", "auto")
        if cfg.loss_scale.name == "enhanced":  # the floor must rise above where the scale grows alone
            floors = {int(k): v for k, v in cfg.loss_scale.min_scale_schedule.items()}
            steps = cfg.trainer.max_steps
            assert max(floors) < steps and sorted(floors.values()) == [1.0, 256.0, 4096.0]
            alone = {k: cfg.loss_scale.init_scale * 2 ** (k // cfg.loss_scale.growth_interval) for k in floors}
            assert all(floors[k] > alone[k] for k in floors if k > 0)  # so it binds at each rise
        if cfg.data.name == "synthetic":  # the CNN proxy: one task for every seed, 10k val images
            assert cfg.data.task_seed == 1234 and cfg.data.val_samples == 10000 and cfg.optim.name == "sgd"
    # every claim has at least 5 seeds of each cell it compares
    for s in specs:
        if not s.tag:
            assert sum(x.group == s.group and x.cell == s.cell for x in specs if x.tag == "") >= 5
    assert {s.seed for s in specs if s.cell == "fp8_nosr"} == set(parts.SR_SEEDS) >= set(range(5))
    # (c)'s grids hold a scale that fails both ways
    assert {1, 2**24} <= set(parts.STATIC_GRID)
    assert parts.RECIPES["lstm_lm_4ep"].evals == 4
    four = [s for s in specs if s.group == "lstm_lm_4ep"]
    assert {s.cell for s in four} == {"fp32", "fp16_none", "amp_fp16", "fp16_master"}
    assert all("trainer.eval_every=41" in s.overrides for s in four)


def test_quick_is_a_smaller_copy_of_the_same_runs(parts) -> None:
    full = {(s.group, s.cell, s.tag) for s in parts.all_specs(False)}
    quick = parts.all_specs(True)
    assert {(s.group, s.cell, s.tag) for s in quick} == full
    assert {s.seed for s in quick} == {0, 1}
    # the 4-epoch recipe still evaluates 4 times in a smoke run
    four = next(s for s in quick if s.group == "lstm_lm_4ep")
    steps = int(next(o for o in four.overrides if o.startswith("trainer.max_steps=")).split("=")[1])
    assert f"trainer.eval_every={steps // 4}" in four.overrides


def records(study, values: dict[tuple[str, str], list[float]], paired: bool = True) -> list[dict]:
    out = []
    for (model, cell), per_seed in values.items():
        metric = study.RECIPES[model].metric
        for seed, v in enumerate(per_seed):
            out.append(dict(part="parity", name=f"{model}-{cell}-s{seed}", model=model, cell=cell, seed=seed,
                            status="completed", metrics={metric: v}, paired=paired,
                            pairing_digests={"init_digest": f"w{seed}", "rng_digest": f"r{seed}"}))
    return out


def test_claims_read_paired_differences_per_seed(study) -> None:
    rng = random.Random(0)
    base = [300.0, 320.0, 280.0, 310.0, 295.0]  # the seeds differ by far more than the effects
    near = lambda: [b * (1 + rng.uniform(-0.001, 0.001)) for b in base]  # noqa: E731
    lm = {
        ("lstm_lm", "fp32"): base,
        ("lstm_lm", "fp16_none"): [b * 1.05 for b in base],  # 5% worse on every seed
        ("lstm_lm", "fp16_static_1"): [b * 1.05 for b in base],
        ("lstm_lm", "fp16_static_8"): near(),
        ("lstm_lm", "fp16_static_128"): near(),
        ("lstm_lm", "fp16_static_32768"): near(),
        ("lstm_lm", "fp16_static_16777216"): [b * 1.2 for b in base],  # overflows: 20% worse
        ("lstm_lm", "amp_fp16"): near(),
    }
    t = study.Table(records(study, lm))
    claims = {c["id"]: c for c in study.claims(t)}
    b = claims["b"]
    assert [p["verdict"] for p in b["parts"]] == [HOLDS, HOLDS, HOLDS, HOLDS] and b["verdict"] == HOLDS
    assert b["parts"][0]["effect"] == pytest.approx(5.0)  # % of perplexity, paired
    c = claims["c"]
    assert "fp16_static_16777216" in c["parts"][0]["claim"] and c["parts"][0]["verdict"] == HOLDS
    assert c["verdict"] == OPEN  # adaptive is not measured on the LSTM: the claim can't hold whole
    assert "Zhao et al. do cover RNNs" in c["parts"][2]["claim"]
    # nothing measured: no verdict, no seeds
    assert claims["d"]["verdict"] == OPEN and claims["d"]["parts"][0]["n_seeds"] == 0
    # Holm over the study: a clear 5% loss on 5 seeds survives it
    assert b["parts"][0]["holm"] is True and b["holm_verdict"] == HOLDS


def test_unpaired_runs_are_left_out_of_every_claim(study) -> None:
    acc = {("alexnet", "fp32"): [97.0, 98.0, 96.5, 97.5, 98.2], ("alexnet", "fp8_none"): [96.9, 98.1, 96.5, 97.4, 98.2]}
    recs = records(study, acc)
    claims = {c["id"]: c for c in study.claims(study.Table(recs))}
    unscaled = claims["d"]["parts"][0]
    assert unscaled["verdict"] == FAILS and unscaled["n_seeds"] == 5
    for r in recs:
        if r["cell"] == "fp8_none" and r["seed"] in (1, 3):
            r["paired"] = False
    t = study.Table(recs)
    assert study.claims(t)[0] is not None
    assert {c["id"]: c for c in study.claims(t)}["d"]["parts"][0]["n_seeds"] == 3
    assert t.unpaired("alexnet", "fp8_none") == [1, 3]


def test_pairing_is_decided_from_stamps_and_digests(study) -> None:
    d = {"init_digest": "a", "rng_digest": "b"}
    rows = [
        dict(part="parity", model="m", seed=0, cell="fp32", status="completed", stale=None, pairing_digests=d),
        dict(part="parity", model="m", seed=0, cell="amp_fp16", status="completed", stale=None, pairing_digests=d),
        dict(part="parity", model="m", seed=0, cell="fp8", status="completed", stale=None,
             pairing_digests={**d, "rng_digest": "c"}),  # its setup drew from the global RNG
        dict(part="parity", model="m", seed=0, cell="amp_bf16", status="completed", stale="no stamp.json",
             pairing_digests=d),  # a run the harness did not stamp
        dict(part="parity", model="m", seed=1, cell="fp8", status="completed", stale=None, pairing_digests=d),
    ]
    study.mark_paired(rows)
    assert [r["paired"] for r in rows] == [True, True, False, False, True]


def test_a_stale_cached_run_stops_the_plan_or_is_rerun_or_kept(runs_mod, parts, tmp_path) -> None:
    s = parts.spec("parity", "lstm_lm", "fp32", 0, quick=True)
    run_dir = tmp_path / s.name
    run_dir.mkdir()
    (run_dir / "summary.json").write_text(json.dumps({"status": "completed", "metrics": {"ppl": 500.0}}))
    code = runs_mod.CodeState("a" * 40, False)
    calls = []

    def trainer(spec, d, c):
        calls.append(spec.name)
        d.mkdir(parents=True, exist_ok=True)
        (d / "stamp.json").write_text(json.dumps({"commit": c.commit, "code_dirty": c.dirty, "command": spec.command}))
        (d / "summary.json").write_text(json.dumps({"status": "completed", "metrics": {"ppl": 500.0}}))

    assert runs_mod.stale_reason(s, run_dir, code) == "no stamp.json"
    with pytest.raises(runs_mod.StaleRunError, match="1 cached run"):  # refused before anything trains
        runs_mod.run_specs([s], tmp_path, code=code, trainer=trainer)
    runs_mod.run_specs([s], tmp_path, code=code, trainer=trainer, keep_stale=True)
    assert not calls and parts.record(s, run_dir, code)["stale"] == "no stamp.json"
    runs_mod.run_specs([s], tmp_path, code=code, trainer=trainer, rerun_stale=True)  # trained again, stamped
    assert calls == [s.name] and runs_mod.stale_reason(s, run_dir, code) is None
    runs_mod.run_specs([s], tmp_path, code=code, trainer=trainer)  # current and completed: cached
    assert calls == [s.name]
    # the stamp of an uncommitted tree, or of a commit whose code differs, is never current
    (run_dir / "stamp.json").write_text(json.dumps({"commit": "a" * 40, "code_dirty": True, "command": s.command}))
    assert "uncommitted tree" in runs_mod.stale_reason(s, run_dir, code)
    assert runs_mod.stale_reason(s, run_dir, runs_mod.CodeState("a" * 40, True)) is not None


def test_the_harness_reproduces_the_committed_verdicts(study) -> None:
    """The paired verdicts of results.json, recomputed from its runs through mptrain.verdicts' pair
    and judge (the engine of mptrain-report --verdicts), equal the committed ones exactly."""
    results = json.loads((DOCS / "results.json").read_text())
    again = json.loads(json.dumps(study.derived(results["runs"]), default=str))

    def same(a, b) -> bool:
        if isinstance(a, float) and isinstance(b, float):
            return a == b or (math.isnan(a) and math.isnan(b))
        if isinstance(a, list) and isinstance(b, list):
            return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
        if isinstance(a, dict) and isinstance(b, dict):
            return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
        return a == b

    for key in ("claims", "epochs", "totals", "error_ratios", "provenance"):
        assert same(again[key], results[key]), key


def test_provenance_names_the_runs_not_at_the_study_commit(study) -> None:
    results = json.loads((DOCS / "results.json").read_text())
    prov = results["provenance"]
    runs = {r["name"]: r for r in results["runs"]}
    other = [n for o in prov["other"] for n in o["runs"]]
    assert prov["at_study_commit"] + len(other) == prov["runs"] == len(runs)
    assert all(runs[n]["git_commit"] != prov["study_commit"] or runs[n]["git_dirty"] for n in other)
    assert prov["from_uncommitted_trees"] == sum(bool(runs[n]["git_dirty"]) for n in other)
    # leaving the uncommitted-tree runs out changes exactly the parts that used them
    dirty = {n for n in other if runs[n]["git_dirty"]}
    parts = {(c["id"], i): p for c in results["claims"] for i, p in enumerate(c["parts"])}
    changed = {(w["claim"], w["part"]) for w in prov["without_uncommitted"]}
    for key, p in parts.items():
        if dirty & set(p["runs"]):
            assert key in changed, key


def test_per_epoch_penalties_read_the_validation_curve(study) -> None:
    recs = []
    for cell, pen in (("fp32", 0.0), ("fp16_none", 2.0)):
        for seed in range(5):
            base = 500.0 + 10 * seed
            curve = [(41 * k, base / k * (1 + pen / 100 / k)) for k in range(1, 5)]  # the penalty fades as 1/epoch
            recs.append(dict(part="epochs", name=f"lstm_lm_4ep-{cell}-s{seed}", model="lstm_lm_4ep", cell=cell,
                             seed=seed, status="completed", metrics={"ppl": curve[-1][1]}, paired=True,
                             val_curve=curve, pairing_digests={"init_digest": f"w{seed}"}))
    t = study.Table(recs)
    assert [t.judge("", "worse", "lstm_lm_4ep", "fp16_none", epoch=k).effect for k in (1, 2, 4)] == pytest.approx(
        [2.0, 1.0, 0.5])
    # results.json carries them, and the README's prose and table read them from there
    from study_plans import prose

    results = {"epochs": study.epoch_penalties(t)}
    assert prose.value(results, "epoch:fp16_none:2:effect") == pytest.approx(1.0)
    assert prose.value(results, "epoch:fp16_none:4:n_seeds") == 5
    table = prose.value(results, "table:epochs").splitlines()
    assert "epoch 4" in table[0] and table[2].startswith("| fp16_none | +2.00 [")


def test_the_results_readme_is_its_template_rendered_from_results_json(study) -> None:
    from study_plans import prose
    template = (DOCS / "README.template.md").read_text()
    results = json.loads((DOCS / "results.json").read_text())
    assert (DOCS / "README.md").read_text() == prose.render_readme(template, results)
    # the statements the review caught now come from the data: the LM's largest per-seed gap,
    # seeds counts from the verdicts, and both denominators of the underflow share, named
    readme = (DOCS / "README.md").read_text()
    gap = prose.value(results, "cell:lstm_lm:amp_fp16:gap")
    assert f"within {gap:.3f} ppl of FP32 on every seed" in readme and "hundreds" not in readme
    tel = next(r for r in results["runs"] if r["name"] == "alexnet-fp32-tel-s0")["telemetry"]
    assert f"{tel['act_underflow_frac_mean']:.2%} as the **mean over layers**" in readme
    assert f"{tel['act_hist_below_tiny_frac']:.2%} **pooled over all values**" in readme
    # the prose's verdicts are the claims' own, each with its Holm verdict where the prose names one,
    # and no placeholder is left unfilled
    cl = {c["id"]: c for c in results["claims"]}
    assert f"**(b) on a CNN: {cl['b/cnn']['verdict']} (Holm: {cl['b/cnn']['holm_verdict']}).**" in readme
    d = cl["d"]
    assert f"with an enhanced-scaling schedule built here: {d['verdict']} (Holm:\n{d['holm_verdict']})" in readme
    assert f"**(e) The LM past one epoch: {cl['e']['verdict']}.**" in readme
    assert "[missing:" not in readme and "{{" not in readme
    # issue 27's corrections. The headline counts the claims, with and without Holm:
    n_open = sum(c["holm_verdict"] == OPEN for c in cl.values())
    assert f"inconclusive {n_open}." in readme and "claims, decided" not in readme
    # (d) does not hold only through its floor and SR parts, which both fail, while the others are open
    assert [p["verdict"] for p in cl["d"]["parts"]] == [OPEN, OPEN, FAILS, FAILS]
    assert "only from its floor part (does not hold) and its SR part\n(does not hold)" in readme
    # no untested direction, no borrowed recipe, no "removes" where the data show a cut
    for said in ("SR costs a little", "FP8 is\nMellempudi et al.'s recipe", "enhanced scaling removes",
                 "shows where the loss comes from", "dynamic scaling needs no choice.", "computes as nonzero"):
        assert said not in readme, said
    fp8_none = next(r for r in results["runs"] if r["name"] == "alexnet-fp8_none-tel-s0")["telemetry"]
    fp8 = next(r for r in results["runs"] if r["name"] == "alexnet-fp8-tel-s0")["telemetry"]
    assert f"cuts, not removes: from\n{fp8_none['act_lost_frac_mean']:.1%}" in readme
    assert f"to {fp8['act_lost_frac_mean']:.1%} with enhanced scaling" in readme
    # the dynamic scaler never moved on the LM: its final scales and skipped steps say so
    dyn = [r for r in results["runs"] if r["cell"] == "amp_fp16" and r["model"].startswith("lstm_lm")]
    assert len(dyn) == 10 and {r["final_loss_scale"] for r in dyn} == {65536.0}
    assert {r["skipped_steps"] for r in dyn} == {0}
    assert "That dynamic scaling *needs no choice* is not shown, though: it\nnever moved." in readme
    # the digests hash the initial weights and the RNG state at step 0, not the batch order
    assert "Batch order and later dropout masks are not hashed" in readme
    # provenance: every run not at the study's commit is named in the README
    for o in results["provenance"]["other"]:
        for name in o["runs"]:
            assert name in readme
    runs = {r["name"]: r for r in results["runs"]}
    study_commit = results["provenance"]["study_commit"]
    assert all(runs[f"alexnet-{c}-s{s}"]["git_commit"] != study_commit for c in ("amp_fp16", "fp16_master")
               for s in range(5))  # "All of amp_fp16's runs and fp16_master's come from older commits"
    # the error-rate ratio of the study's own AlexNet fp8 runs: the issue's 2.02x [1.28, 3.18]
    r8 = next(r for r in results["error_ratios"] if (r["model"], r["cell"]) == ("alexnet", "fp8"))
    assert f"{r8['ratio']:.2f} [{r8['lo']:.2f}, {r8['hi']:.2f}]" == "2.02 [1.28, 3.18]"
    assert "2.02× FP32's errors [1.28, 3.18]" in readme
    # every verdict of the table states its margin, seeds and steps
    table = [line for line in readme.splitlines() if line.startswith("| a/alexnet")]
    assert table and "| ±0.5 points top-1 | 5 | 2000 |" in table[0]
    # no figure of the prose is written by hand, except constants of the method: the margins, the
    # CI level, the power of seeds-if-equal, Holm's level, and the init range
    body = template[template.index("## Verdicts"):]
    body = "\n".join(line for line in body.splitlines() if not line.startswith("|"))
    allowed = {"0.5", "1%", "95%", "80%", "2.5%", "100%", "0.02", "85-95%"}
    assert set(prose.literal_figures(body)) <= allowed


def test_prose_reads_run_times_and_results_fields() -> None:
    from study_plans import prose

    runs = [dict(model="m", cell=c, seed=s, part="parity", status="completed", metrics={"top1": 90.0 + s},
                 wall_time_s=w * (s + 1)) for c, w in (("fp32", 10.0), ("amp_fp16", 40.0)) for s in (0, 1)]
    results = {"runs": runs, "recipes": {"m": {"metric": "top1"}}, "totals": {"run_hours": 2.5}}
    assert prose.value(results, "cell:m:amp_fp16:wall") == pytest.approx(60.0)  # (40 + 80) / 2
    assert prose.render_readme("{{cell:m:fp32:wall|.0f}} s; {{meta:totals.run_hours|.1f}} h", results) == "15 s; 2.5 h"
    # a run field's extremes over a cell, and the mean paired difference
    assert prose.value(results, "cell:m:amp_fp16:max.wall_time_s") == pytest.approx(80.0)
    assert prose.value(results, "cell:m:fp32:min.metrics.top1") == pytest.approx(90.0)
    assert prose.value(results, "cell:m:amp_fp16:dmean") == pytest.approx(0.0)


def test_a_run_records_its_largest_late_loss_not_an_early_one(runs_mod, parts, tmp_path) -> None:
    """Issue 18, item 6: a spike in the second half of training is reported even when the final
    metric hides it; one in the first half (still learning) is not what the field is for."""
    from torch.utils.tensorboard import SummaryWriter

    s = parts.spec("parity", "lstm_lm", "fp32", 0, quick=True)
    run_dir = tmp_path / s.name
    run_dir.mkdir()
    (run_dir / "summary.json").write_text(json.dumps({"status": "completed", "steps": 10, "metrics": {"ppl": 5.0}}))
    with SummaryWriter(str(run_dir)) as w:
        for step in range(1, 11):
            w.add_scalar("train/loss", {3: 9.0, 8: 4.0}.get(step, 1.0), step)
    assert parts.record(s, run_dir)["late_loss_max"] == pytest.approx(4.0)


def test_the_issue18_notes_name_the_machine_results_json_records(study) -> None:
    """The notes had said the study ran on an AVX2-only EPYC; results.json records AVX512 for every run."""
    results = json.loads((DOCS / "results.json").read_text())
    caps = {r["cpu_capability"] for r in results["runs"]}
    assert caps == set(results["machine"]["runs_cpu_capabilities"]) == {"AVX512"}
    notes = (DOCS / "issue18_notes.md").read_text()
    assert "results.json records AVX512 for every one of its\nruns" in notes
    assert "The study in\nREADME.md ran on an **AVX2-only** EPYC" not in notes
