"""Plan ``controls`` (issue 27, part 3): positive controls, where each component can show its effect.

    python scripts/study.py pilot controls     # one short run per new cell type; writes plans/controls.md
    python scripts/study.py run controls --jobs 2 && python scripts/study.py report controls

Issue 18's (d) tested enhanced scaling's floor and FP8's stochastic rounding on AlexNet/8, where
unscaled FP8 itself showed no loss, and its LM dynamic scaler never left its initial 2^16: no part
could show the effect it named. Here:

- **(d) on the transformer LM** (transformer_lm_tiny on python_docs, where FP8 E5M2 already costs
  +0.74% of perplexity in plan ``formats``): FP8 with enhanced scaling (the floor binds by
  construction, as in plan ``papers``), without stochastic rounding, without any scale, and
  without the floor.
- **Injected overflows** (``loss_scale.inject_overflow``): 12 overflows in a row at steps 40-51,
  in an enhanced run whose floor (2^12) sits below its constant 2^16 scale and in the same rule
  without the floor. Until the storm the two runs are the same; the floor stops the back-off at
  2^12, and without it the scale falls to 2^4. Both skip the same 12 steps. This shows the floor's
  effect only if a small scale costs anything: the unscaled part (d/unscaled) says whether it does.
- **The LSTM LM's dynamic scaler started where it has to move**: at 2^24 (it overflows and backs
  off, skipping steps) and at 1 with a growth interval of 4 steps (it grows from unscaled), against
  FP32 and against its default start (2^16).

Every claim: 8 seeds, margin 1% of perplexity (the papers' parity margin), steps as stated.
"""

from __future__ import annotations

from pathlib import Path

from mptrain.verdicts import Margin
from study_plans.harness import DOCS as DOCS_ROOT
from study_plans.harness import Claim, CodeState, PlanDoc, Spec, claim_rows, generic_report, known_cost, read_json
from study_plans.papers import LM as LSTM_LM
from study_plans.papers import enhanced_schedule, fp8_dyn_schedule

NAME = "controls"
DOCS = DOCS_ROOT / NAME
TITLE = ("Positive controls: FP8's floor and SR on the transformer LM, injected overflows, a dynamic scaler that "
         "must move")
SEEDS = tuple(range(8))
PILOT_STEPS = 8
MARGIN = Margin(1.0, relative=True)
T_STEPS = 80  # transformer_lm_tiny: 1.1 epochs of python_docs, as plan formats
L_STEPS = 41  # lstm_lm: 1 epoch, as plan papers' (b)
STORM = tuple(range(40, 52))  # 12 injected overflows: 2^16 halves to 2^4 without a floor
TLM = ("model=transformer_lm_tiny", "data=python_docs")
FP8 = ("precision=fp8", "precision.format=e5m2", "precision.scaling=loss")
INJECT = f"loss_scale.inject_overflow=[{','.join(map(str, STORM))}]"
# enhanced at its 2^16 start, growing every 1000 steps (so constant here), with a floor of 2^12 from step 0
CONSTANT_ENHANCED = ("loss_scale=enhanced", "~loss_scale.min_scale_schedule.1000",
                     "~loss_scale.min_scale_schedule.5000", "loss_scale.min_scale_schedule.0=4096")

CELLS: dict[str, tuple[str, tuple[str, ...]]] = {  # cell -> (group, overrides)
    "fp32": ("tlm", ("precision=fp32",)),
    "fp8": ("tlm", (*FP8, "loss_scale=enhanced", *enhanced_schedule(T_STEPS))),
    "fp8_nosr": ("tlm", (*FP8, "loss_scale=enhanced", *enhanced_schedule(T_STEPS),
                         "precision.stochastic_rounding=false")),
    "fp8_none": ("tlm", (*FP8, "loss_scale=none")),
    "fp8_dyn": ("tlm", (*FP8, "loss_scale=dynamic", *fp8_dyn_schedule(T_STEPS))),
    "fp8_storm_floor": ("tlm", (*FP8, *CONSTANT_ENHANCED, INJECT)),
    "fp8_storm_nofloor": ("tlm", (*FP8, "loss_scale=dynamic", "loss_scale.growth_interval=1000", INJECT)),
    "lstm_fp32": ("lstm", ("precision=fp32",)),
    "lstm_dyn": ("lstm", ("precision=amp_fp16", "loss_scale=dynamic")),
    "lstm_dyn_2p24": ("lstm", ("precision=amp_fp16", "loss_scale=dynamic", "loss_scale.init_scale=16777216")),
    "lstm_dyn_1": ("lstm", ("precision=amp_fp16", "loss_scale=dynamic", "loss_scale.init_scale=1",
                            "loss_scale.growth_interval=4")),
}
BASE = {"tlm": (TLM, T_STEPS), "lstm": (LSTM_LM, L_STEPS)}


def worse(cid: str, cell: str, ref: str, group: str, what: str) -> Claim:
    return Claim(cid, f"{what} is worse than {ref} by more than {MARGIN} perplexity", "worse", cell, ref, MARGIN,
                 "ppl", group)


def parity(cid: str, cell: str, ref: str, group: str, what: str) -> Claim:
    return Claim(cid, f"{what} matches {ref} within {MARGIN} perplexity", "equivalent", cell, ref, MARGIN, "ppl",
                 group)


CLAIMS = [
    worse("d/unscaled", "fp8_none", "fp32", "tlm", "FP8 E5M2 without loss scaling"),
    parity("d/parity", "fp8", "fp32", "tlm", "FP8 E5M2 with enhanced scaling and SR"),
    worse("d/floor", "fp8_dyn", "fp8", "tlm", "FP8 with enhanced's rule but no floor"),
    worse("d/sr", "fp8_nosr", "fp8", "tlm", "FP8 without stochastic rounding"),
    worse("d/storm", "fp8_storm_nofloor", "fp8_storm_floor", "tlm",
          "FP8 through 12 injected overflows without a floor (scale 2^16 to 2^4)"),
    parity("c/from_2p24", "lstm_dyn_2p24", "lstm_fp32", "lstm", "amp_fp16, dynamic scaling started at 2^24,"),
    parity("c/from_1", "lstm_dyn_1", "lstm_fp32", "lstm", "amp_fp16, dynamic scaling started at 1 (growth every 4),"),
    parity("c/start_2p24", "lstm_dyn_2p24", "lstm_dyn", "lstm", "dynamic scaling started at 2^24"),
    parity("c/start_1", "lstm_dyn_1", "lstm_dyn", "lstm", "dynamic scaling started at 1"),
]


def spec(cell: str, seed: int, steps: int | None = None) -> Spec:
    group, ov = CELLS[cell]
    base, full = BASE[group]
    n = steps or full
    overrides = (*base, *ov, f"trainer.seed={seed}", f"trainer.max_steps={n}", f"trainer.eval_every={n}",
                 f"trainer.log_every={max(n // 20, 1)}", "trainer.device=cpu", "trainer.checkpoint_every=null",
                 "trainer.resume=null")
    return Spec(f"{cell}-s{seed}", overrides, seed, cell, group, NAME, cost=3.0 if "fp8" in cell else 4.0)


def specs(quick: bool = False) -> list[Spec]:
    seeds = SEEDS[:2] if quick else SEEDS
    return [spec(c, s, (BASE[CELLS[c][0]][1] // 4) if quick else None) for s in seeds for c in CELLS]


# The pilots run one cell of each new kind of GEMM or scaler work; the others cost as much as one
# of them, or as cells that earlier studies ran in full (known_costs).
PILOTS = ("fp8_nosr", "fp8_storm_nofloor", "lstm_dyn_2p24")
COST_AS = {"fp8_storm_floor": "fp8_storm_nofloor", "fp8_none": "fp8_storm_nofloor", "fp8_dyn": "fp8_storm_nofloor",
           "fp8": "fp8_storm_nofloor", "lstm_dyn_1": "lstm_dyn_2p24"}


def pilot_specs() -> list[Spec]:
    return [spec(c, 0) for c in PILOTS]


def known_costs() -> dict:
    out = {}
    f = known_cost(DOCS_ROOT / "formats" / "results.json", lambda r: [x for x in r["runs"] if x["cell"] == "fp32"],
                   80, "plan formats' 5 fp32 runs (80 steps): wall / steps")
    p = known_cost(DOCS_ROOT / "results.json",
                   lambda r: [x for x in r["runs"] if x["model"] == "lstm_lm" and x["cell"] == "fp32"
                              and x["part"] != "telemetry"], 41, "plan papers' 5 lstm_lm fp32 runs: wall / steps")
    d = known_cost(DOCS_ROOT / "results.json",
                   lambda r: [x for x in r["runs"] if x["model"] == "lstm_lm" and x["cell"] == "amp_fp16"
                              and x["part"] != "telemetry"], 41, "plan papers' 5 lstm_lm amp_fp16 runs: wall / steps")
    for cell, c in (("fp32", f), ("lstm_fp32", p), ("lstm_dyn", d)):
        if c:
            out[cell] = c
    return out


def plan_doc() -> PlanDoc:
    sp = specs()
    notes = [
        "d/storm shows the floor's effect only where a small scale costs something: read it with d/unscaled. If "
        "unscaled E5M2 costs less than the margin here, neither can the collapsed scale, and d/storm's 'does not "
        "hold' then says that, not that floors are useless.",
        "The storm skips steps 40-51 in both of its cells (injected overflows skip the step, as a real Inf does), so "
        "d/storm compares like with like; neither storm cell is compared with FP32.",
        "c/from_2p24: each overflow skips a step while the scale backs off from 2^24, so the run loses those "
        "steps of its 41; the report states each run's skipped steps and final scale (results.json runs[]), which "
        "show that the scaler moved.",
        "Margins: 1% of perplexity, as the papers' parity claims; every claim on 8 seeds (0-7).",
    ]
    return PlanDoc(NAME, TITLE, (__doc__ or "").split("\n\n", 2)[2].strip(), claim_rows(CLAIMS, sp), sp,
                   notes=notes, known=known_costs(), cost_as=COST_AS)


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
