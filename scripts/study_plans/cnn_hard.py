"""Plan ``cnn_hard`` (issue 27, part 3): CNN parity where FP32 is not at the ceiling.

    python scripts/study.py run cnn_hard --stage search   # stage 1: the recipe (FP32 only)
    python scripts/study.py run cnn_hard --stage check    # the chosen recipe's FP32 on 5 seeds
    python scripts/study.py run cnn_hard --jobs 2         # stage 2, once RECIPE is set from stage 1
    python scripts/study.py report cnn_hard

Plan ``papers``' AlexNet/8 proxy ends FP32 at 99.65%, where a 0.5-point margin lets a cell make
2.4 times FP32's errors and still "match" it. This plan wants FP32 near 85-95% and states two
margins for every parity claim: 0.5 points of top-1, and the error-rate ratio within x1.1.

**Stage 1, the recipe (FP32 only).** The synthetic proxy's best possible accuracy falls below 100%
only when its patterns are weak (the notes give each candidate's, computed on its own validation
images), and the pilots below show that AlexNet/8 with plan papers' SGD recipe (lr 0.03, 2,000
steps) then never leaves chance. Stage 1 runs
the candidates of RECIPE_SEARCH (AdamW, which moves on weak gradients, and longer runs) on seed 0,
then the first that ends in 85-95% on 5 seeds with a seed std of at most 1 point becomes RECIPE.
**Stage 2, the claims**, on 8 seeds, with the cells of plan papers' AlexNet parity.
"""

from __future__ import annotations

import functools
from pathlib import Path

from mptrain.verdicts import Margin
from study_plans.harness import DOCS as DOCS_ROOT
from study_plans.harness import Claim, CodeState, PlanDoc, Spec, claim_rows, generic_report, known_cost, read_json
from study_plans.papers import CELLS as PAPER_CELLS
from study_plans.papers import enhanced_schedule

NAME = "cnn_hard"
DOCS = DOCS_ROOT / NAME
TITLE = "CNN parity below the ceiling: AlexNet/8 on a harder proxy, on points and on the error-rate ratio"
SEEDS = tuple(range(8))
PILOT_STEPS = 0  # no cost pilot: see pilot_specs
MARGIN = Margin(0.5)  # points of top-1, as plan papers
ERROR_RATIO = 1.1  # and the error rate within x1.1 of FP32's (the default of mptrain-report --verdicts)
PROXY = ("model=alexnet", "model.width_divisor=8", "data.image_size=64", "data=synthetic", "data.task_seed=1234",
         "data.val_samples=10000", "data.val_batch_size=500", "data.num_workers=0", "sched.warmup_steps=100",
         "trainer.grad_clip=1.0")
# Stage 1 candidates, (name, overrides, steps); Bayes accuracy of a nearest-pattern classifier in brackets.
RECIPE_SEARCH = (
    ("k10_p045_adamw", ("data.num_classes=10", "data.pattern_scale=0.045", "optim=adamw", "optim.lr=0.001"), 4000),
    ("k30_p05_adamw", ("data.num_classes=30", "data.pattern_scale=0.05", "optim=adamw", "optim.lr=0.001"), 4000),
    ("k10_p045_sgd_b128", ("data.num_classes=10", "data.pattern_scale=0.045", "optim=sgd", "optim.lr=0.03",
                           "data.batch_size=128"), 4000),
)
# The pilots already run (SGD lr 0.03, 2,000 steps, seed 0): every one ended at chance.
TRIED = (
    ("k100_p1_sgd", ("data.num_classes=100", "data.pattern_scale=0.1", "optim=sgd", "optim.lr=0.03"), 2000),
    ("k100_p055_sgd", ("data.num_classes=100", "data.pattern_scale=0.055", "optim=sgd", "optim.lr=0.03"), 2000),
    ("k10_p045_sgd", ("data.num_classes=10", "data.pattern_scale=0.045", "optim=sgd", "optim.lr=0.03"), 2000),
)
# Stage 1's outcome (cnn_hard.search.json, in the plan's notes): both AdamW candidates ended seed 0 at
# chance; SGD at batch 128 ended it in range, so it is the recipe, once its 5 seeds pass (stage check).
RECIPE = RECIPE_SEARCH[2]
CHECK_SEEDS = tuple(range(5))
CELLS = ("fp32", "amp_fp16", "fp16_master", "amp_bf16", "fp8", "fp16_none")
SEARCH_FILE = DOCS_ROOT / "plans" / f"{NAME}.search.json"


def spec(cell: str, seed: int, recipe: tuple = RECIPE) -> Spec:
    name, ov, steps = recipe
    extra = enhanced_schedule(steps) if "loss_scale=enhanced" in PAPER_CELLS[cell] else []
    overrides = (*PROXY, *ov, *PAPER_CELLS[cell], *extra, f"trainer.seed={seed}", f"trainer.max_steps={steps}",
                 f"trainer.eval_every={steps // 4}", f"trainer.log_every={steps // 40}", "trainer.device=cpu",
                 "trainer.checkpoint_every=null", "trainer.resume=null")
    return Spec(f"{name}-{cell}-s{seed}", overrides, seed, cell, name, NAME, cost=1.0 if cell in ("fp32", "amp_bf16")
                else 6.0)


def search_specs() -> list[Spec]:
    return [spec("fp32", 0, r) for r in RECIPE_SEARCH]


def check_specs() -> list[Spec]:
    """The chosen recipe's FP32 on 5 seeds (the acceptance check; stage 2's own FP32 runs)."""
    return [spec("fp32", s) for s in CHECK_SEEDS]


def stage_specs(stage: str) -> list[Spec]:
    if stage == "search":
        return search_specs()
    if stage == "check":
        return check_specs()
    raise SystemExit(f"--stage {stage}: plan {NAME} has two stages before its claims: search, check")


def record_stage(stage: str, runs: Path) -> None:
    """A stage's runs (val top-1, steps, wall) into cnn_hard.search.json, which the plan's notes read."""
    import json

    record = read_json(SEARCH_FILE) or {}
    for s in stage_specs(stage):
        summary = read_json(runs / s.name / "summary.json")
        if summary:
            record[s.name] = {"top1": summary["metrics"]["top1"], "steps": summary["steps"],
                              "wall_s": round(summary["wall_time_s"], 1), "status": summary["status"]}
    SEARCH_FILE.parent.mkdir(parents=True, exist_ok=True)
    SEARCH_FILE.write_text(json.dumps(dict(sorted(record.items())), indent=1) + "\n")


def search_lines() -> list[str]:
    """Stage 1 and the check, as they ended (cnn_hard.search.json), judged by the acceptance rule."""
    import statistics

    rec = read_json(SEARCH_FILE) or {}
    lines = []
    for name, ov, steps in RECIPE_SEARCH:
        r = rec.get(spec("fp32", 0, (name, ov, steps)).name)
        if r:
            lines.append(f"Stage 1, `{name}` (seed 0, {r['steps']} steps): val top-1 {r['top1']:.2f}% "
                         f"({r['wall_s']:.0f} s).")
    top1 = [rec[s.name]["top1"] for s in check_specs() if s.name in rec]
    if len(top1) == len(CHECK_SEEDS):
        chance = 100 / int(dict(o.split("=", 1) for o in RECIPE[1])["data.num_classes"])
        mean, std = statistics.fmean(top1), statistics.stdev(top1)
        ok = 85 <= mean <= 95 and std <= 1 and min(top1) > chance
        lines.append(f"Check of `{RECIPE[0]}` on seeds 0-{len(top1) - 1}: val top-1 {mean:.2f}% mean, seed std "
                     f"{std:.2f} points, lowest {min(top1):.2f}%: {'accepted' if ok else 'NOT accepted'} (85-95%, "
                     f"std at most 1 point).")
    return lines


def specs(quick: bool = False) -> list[Spec]:
    seeds = SEEDS[:2] if quick else SEEDS
    return [spec(c, s) for s in seeds for c in CELLS]


CLAIMS = [
    *(Claim(f"a/{c}", f"{c} matches fp32 within {MARGIN} points", "equivalent", c, "fp32", MARGIN, "top1",
            RECIPE[0], ERROR_RATIO) for c in CELLS[1:-1]),
    Claim("b/unscaled", f"amp_fp16 without loss scaling is worse than fp32 by more than {MARGIN} points", "worse",
          "fp16_none", "fp32", MARGIN, "top1", RECIPE[0]),
]


def pilot_specs() -> list[Spec]:
    """None: AlexNet/8's cells cost per step what plan papers measured (known_costs); the recipe
    pilots (TRIED) asked where FP32 ends, and are in cnn_hard.tried.json."""
    return []


def known_costs() -> dict:
    """AlexNet/8's per-step cost does not depend on the proxy's classes or pattern: plan papers'
    2,000-step runs of the same cells measured it, at batch 32. The recipe's batch is 128: its FP32
    cost is the check's own runs, and every other cell's is papers' scaled by the same ratio."""
    out = {}
    for cell in CELLS:
        c = known_cost(DOCS_ROOT / "results.json",
                       lambda r, cell=cell: [x for x in r["runs"] if x["model"] == "alexnet" and x["cell"] == cell
                                             and x["part"] != "telemetry"],
                       2000, f"plan papers' 5 AlexNet/8 {cell} runs (2,000 steps): wall / steps")
        if c:
            out[cell] = c
    rec = read_json(SEARCH_FILE) or {}
    walls = [rec[s.name]["wall_s"] for s in check_specs() if s.name in rec]
    if walls and "fp32" in out:
        steps = RECIPE[2]
        step_s = sum(walls) / len(walls) / steps
        ratio = step_s / out["fp32"]["step_s"]
        own = f"the check's {len(walls)} FP32 runs (beside another job on the 2 cores): wall / steps"
        for cell, c in out.items():
            out[cell] = {**c, "step_s": round(step_s if cell == "fp32" else c["step_s"] * ratio, 4),
                         "source": own if cell == "fp32" else f"{c['source']}, x{ratio:.2f} (this recipe's FP32 "
                         "over papers')"}
    return out


def bayes_accuracy(overrides: tuple[str, ...], batches: int = 2) -> float:
    """The best accuracy any classifier can reach on the recipe's validation images: the nearest
    class pattern (equal priors, isotropic Gaussian noise), on the first ``batches`` x 500 images."""
    data = tuple(sorted(o for o in (*PROXY, *overrides) if o.startswith("data.")))
    return _bayes(data, batches)


@functools.lru_cache
def _bayes(data: tuple[str, ...], batches: int) -> float:
    import torch
    import torch.nn.functional as F

    from mptrain.data.synthetic import SyntheticData

    kv = dict(o.split("=", 1) for o in data)
    size = int(kv["data.image_size"])
    d = SyntheticData(batch_size=32, val_batch_size=500, num_classes=int(kv["data.num_classes"]), train_samples=32,
                      val_samples=500 * batches, max_val_batches=None, image_size=size, device=torch.device("cpu"),
                      seed=0, pattern_scale=float(kv["data.pattern_scale"]), task_seed=int(kv["data.task_seed"]))
    means = F.interpolate(d.prototypes, size=(size, size), mode="bilinear", align_corners=False) * d.pattern_scale
    hits = n = 0
    for x, y in d.val_batches():
        hits += int((torch.cdist(x.flatten(1), means.flatten(1)).argmin(1) == y).sum())
        n += len(y)
    return 100 * hits / n


def tried_lines() -> list[str]:
    """The recipe pilots already made, from their summaries (docs/results/plans/cnn_hard.tried.json)."""
    tried = read_json(DOCS_ROOT / "plans" / f"{NAME}.tried.json") or {}
    lines = []
    for name, ov, steps in TRIED:
        t = tried.get(name)
        if t:
            chance = 100 / int(dict(o.split("=", 1) for o in ov)["data.num_classes"])
            lines.append(f"Pilot `{name}` ({' '.join(ov)}, {steps} steps, seed 0, FP32; best possible accuracy "
                         f"{bayes_accuracy(ov):.1f}%): val top-1 {t['top1']:.2f}% after {t['steps']} steps, chance "
                         f"{chance:.0f}% ({t['wall_s']:.0f} s of one core, machine shared).")
    return lines


def plan_doc() -> PlanDoc:
    sp = specs()
    notes = [
        *tried_lines(),
        "Stage 1 (recipe search, FP32 only, seed 0, then 5 seeds of the first candidate in range): "
        + "; ".join(f"`{n}`: {' '.join(ov)}, {st} steps (best possible accuracy on its validation images "
                    f"{bayes_accuracy(ov):.1f}%)" for n, ov, st in RECIPE_SEARCH)
        + ". Their commands are the first block below; the 5-seed check of the chosen one changes only "
        "`trainer.seed`. The batch-128 candidate costs about 4 times as much per step.",
        "Acceptance for a recipe: FP32 mean val top-1 in 85-95% over 5 seeds, seed std at most 1 point, every "
        "seed past chance at the end (the earlier 'by half the run' is not checked: a summary keeps the last "
        f"evaluation only). RECIPE is `{RECIPE[0]}`, and stage 2's commands and costs below are for it.",
        *search_lines(),
        f"Every parity claim is judged twice: within ±{MARGIN} points of top-1 and within ×{ERROR_RATIO:g} of FP32's "
        "error rate (geometric mean of the paired ratios); 8 seeds each.",
    ]
    return PlanDoc(NAME, TITLE, (__doc__ or "").split("\n\n", 2)[2].strip(), claim_rows(CLAIMS, sp), sp,
                   notes=notes, known=known_costs(),
                   stages=[("Stage 1, the recipe search (`python scripts/study.py run cnn_hard --stage search`): each "
                            "candidate's FP32 run on seed 0", search_specs()),
                           ("The check (`python scripts/study.py run cnn_hard --stage check`): the chosen recipe's "
                            "FP32 on 5 seeds", check_specs())],
                   launch="stage 1 has run and set RECIPE (notes); once the check accepts it, `python scripts/study.py "
                   "run cnn_hard --jobs 2` and `python scripts/study.py report cnn_hard`.")


def report(runs: Path, out: Path, quick: bool, code: CodeState) -> dict:
    return generic_report(NAME, TITLE, specs(quick), CLAIMS, runs, out, code)


def render(out: Path = DOCS) -> dict:
    from study_plans.harness import verdict_markdown

    res = read_json(out / "results.json")
    if res is None:
        raise SystemExit(f"{out / 'results.json'}: not found: plan {NAME} has not been reported yet")
    (out / "README.md").write_text(verdict_markdown(TITLE, res) + "\n")
    return res


def summary_lines(res: dict) -> list[str]:
    return [f"{c['verdict']:>14}  {c['id']}: {c['claim']}" for c in res["claims"]]
