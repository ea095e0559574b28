"""The study's plan: recipes, precision cells and the runs of each part.

``scripts/study.py`` runs these and reports them; split out of it (issue 18) so that each part's
definition reads on its own. A *recipe* is one model's training setup (its key names the runs);
a *cell* is one precision and loss-scaling configuration; a part is a list of (recipe, cell, seed).
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Bump whenever a change alters a run's numbers or its pairing with FP32. study.py re-runs every
# cached run stamped with another version (or none), unless told --keep-stale, and then reports
# such runs as unpaired. History: runs without a stamp predate issue 18 (some predate the RNG fix
# 05d5624, and FP8's stochastic rounding drew from the global RNG); 2: rounding has its own stream,
# runs record pairing digests; the CNN recipes moved from digits to the synthetic proxy.
CODE_VERSION = 2

SEEDS = (0, 1, 2, 3, 4)
# (d)'s stochastic-rounding part has the same 5 seeds: 10 (30 more FP8 minutes of one core) did not
# fit the session's budget; its verdict gives the seeds it would need (seeds_to_decide, seeds_if_equal).
SR_SEEDS = SEEDS


@dataclass(frozen=True)
class Recipe:
    """One model's training recipe: FP32 must be reproducible across seeds before any precision is
    compared on it (issue 12, item 1)."""

    name: str
    overrides: tuple[str, ...]
    steps: int
    metric: str  # "top1" (higher is better, points) or "ppl" (lower is better, % relative)
    margin: float  # the papers' parity margin: 0.5 points of top-1, 1% of perplexity
    cells: tuple[str, ...]  # precision cells of the parity part (or of the recipe's own part)
    evals: int = 1  # evaluations, evenly spaced; the last one is the metric the claims use

    @property
    def worse_sign(self) -> int:
        return -1 if self.metric == "top1" else 1

    @property
    def unit(self) -> str:
        return "points top-1" if self.metric == "top1" else "% perplexity"


PARITY = ("fp32", "amp_fp16", "fp16_master", "amp_bf16")

# The CNN proxy (issue 18, item 8): digits' 359 validation images (one image = 0.28 points) and an
# FP32 at 98% could not resolve a 0.5-point margin. Synthetic 10-class images: each class a fixed
# low-frequency pattern, weak against unit pixel noise (FP32: 99.65 +- 0.19 over 5 seeds, not the
# "well below 100%" asked for: weaker patterns left seeds at chance too long); a fixed task_seed
# keeps the patterns and the 10,000 validation images the same for every run seed (seeds vary the
# training draws, init and dropout only), and every training batch is fresh, so no run memorises.
# SGD with momentum, as the paper trained its CNNs.
PROXY = (
    "data=synthetic", "data.num_classes=10", "data.pattern_scale=0.1", "data.task_seed=1234",
    "data.val_samples=10000", "data.val_batch_size=500", "data.num_workers=0",
    "optim=sgd", "sched.warmup_steps=100", "trainer.grad_clip=1.0",
)  # fmt: skip
LM = (
    "model=lstm_lm", "data=python_docs", "model.emb_size=100", "model.hidden_size=100",
    "data.batch_size=64", "model.init_range=0.02",
)  # fmt: skip
RECIPES = {
    # AlexNet/8 without batch norm on the proxy: it sits near chance for 400-800 steps (finding the
    # weak pattern), then learns, and 2,000 steps end on the plateau. Pilots, FP32 (issue 18):
    # lr 0.05 and 0.1 stalled or diverged; lr 0.03 unclipped learned and then died back to chance
    # (ln 10) on one seed in five; lr 0.02 clipped left two seeds of five still climbing at step
    # 2,000 (94%, against 99% for the others); pattern 0.15 is solved (99.98%). lr 0.03 with 100
    # warm-up steps and the gradient norm clipped at 1 (after unscaling) ends on the plateau.
    "alexnet": Recipe(
        "alexnet", ("model=alexnet", "model.width_divisor=8", "data.image_size=64", *PROXY, "optim.lr=0.03"),
        2000, "top1", 0.5, (*PARITY, "fp8"),
    ),
    # ResNet-50/8 at 32 px (its smallest input) on the same proxy: parity only (issue 18). At
    # AlexNet's lr 0.03 for 1,000 steps it never left chance (FP32 10.96 +- 0.90 over seeds 0-2, loss
    # ln 10); lr 0.1 for 2,000 steps learns: FP32 84.43 +- 3.25 over seeds 0-4 (87.33, 84.20, 84.37,
    # 79.22, 87.03; AVX512-BF16 EPYC, 2026-11-24). Well below 100%, as asked, but the seeds still
    # spread by points: the paired differences, not this spread, decide parity. No fp16_master here:
    # emulated FP16 costs ResNet-50 about 9 min a run on 2 cores, and AlexNet already tests FP16
    # weights; the study has to fit its CPU budget (issue 18).
    "resnet50": Recipe(
        "resnet50", ("model=resnet50", "model.width_divisor=8", "data.image_size=32", *PROXY, "optim.lr=0.1"),
        2000, "top1", 0.5, ("fp32", "amp_fp16", "amp_bf16"),
    ),
    # The LSTM LM (Zaremba-style, tied softmax) on python_docs with a batch of 64 x 35 = 2,240
    # positions: the loss is their mean, so dL/dlogits is (p - y) / 2240. GPT-style small embedding
    # init (init_range 0.02) keeps dL/dh = W^T dL/dlogits small too. One epoch (41 steps).
    # fp8 is left out (the LSTM has no FP8 path).
    "lstm_lm": Recipe("lstm_lm", LM, 41, "ppl", 1.0, ("fp32", "amp_fp16", "amp_bf16")),
    # The same LM for 4 epochs, evaluated after each (issue 18, item 4): does (b)'s penalty
    # persist, grow or fade? Claim (e) is decided on these runs (its own), (b) on the 1-epoch ones.
    "lstm_lm_4ep": Recipe(
        "lstm_lm_4ep", LM, 164, "ppl", 1.0, ("fp32", "fp16_none", "amp_fp16", "fp16_master"), evals=4,
    ),
}

# A cell is one precision and loss-scaling configuration. The parity cells pair each half format
# with its natural scaler: dynamic for FP16, none for bf16 (FP32's exponent range), enhanced for FP8.
CELLS: dict[str, tuple[str, ...]] = {
    "fp32": ("precision=fp32",),
    "amp_fp16": ("precision=amp_fp16", "loss_scale=dynamic"),
    "fp16_master": ("precision=fp16_master", "loss_scale=dynamic"),
    "amp_bf16": ("precision=amp_bf16", "loss_scale=none"),
    "fp8": ("precision=fp8", "loss_scale=enhanced"),  # E5M2, no per-tensor scales, SR (Mellempudi et al.)
    "fp16_none": ("precision=amp_fp16", "loss_scale=none"),
    "fp16_adaptive": ("precision=amp_fp16", "loss_scale=adaptive"),  # Zhao et al., per layer
    "fp8_none": ("precision=fp8", "loss_scale=none"),
    "fp8_nosr": ("precision=fp8", "loss_scale=enhanced", "precision.stochastic_rounding=false"),
    # enhanced's own dynamic rule without its floor: where the two differ, the floor bound
    "fp8_dyn": ("precision=fp8", "loss_scale=dynamic"),
}
# Claim (c) needs scales that fail (issue 18, item 3): 1 (no scaling, with overflow checks) and
# 2^24, which overflows FP16 (max 65504) whenever a gradient exceeds 2^-8, i.e. persistently; in
# between the paper's 8 (SSD) and 128 (bigLSTM) and 32768, dynamic's neighbourhood.
STATIC_GRID = (1, 8, 128, 32768, 2**24)
for _s in STATIC_GRID:
    CELLS[f"fp16_static_{_s}"] = ("precision=amp_fp16", "loss_scale=static", f"loss_scale.scale={_s}")
SCALING_MODEL = "lstm_lm"  # claims (b) and (c) on the LM
EPOCHS_MODEL = "lstm_lm_4ep"  # claim (e) and (b) past one epoch
CNN_MODEL = "alexnet"  # claims (b) and (c) on a CNN: mptrain's adaptive scaling runs here
FP8_MODEL = "alexnet"  # claim (d)
SCALING_CELLS = ("fp16_none", *(f"fp16_static_{s}" for s in STATIC_GRID), "amp_fp16")
# The CNN runs (b) and adaptive, not a second static grid: emulated FP16 costs AlexNet about 4 min a
# run on 2 cores, and the grid's point, that a static scale needs a search, is the LM's claim (c).
CNN_SCALING_CELLS = ("fp16_none", "fp16_adaptive")
# Why the LM has no adaptive cell: said in claim (c) and in the README.
ADAPTIVE_LSTM_REFUSED = (
    "not run: mptrain's adaptive scaling computes per-layer scales over a torch.fx graph of Conv/Linear "
    "layers, and an nn.LSTM carrying its state across batches is neither, so mptrain refuses it "
    "(config.py). Zhao et al. do cover RNNs: this is mptrain's limit, not the paper's; measured on "
    f"{CNN_MODEL} instead"
)


@dataclass
class Spec:
    part: str
    model: str  # the recipe's key
    cell: str
    seed: int
    overrides: list[str] = field(default_factory=list)
    tag: str = ""  # "tel" for the telemetry runs

    @property
    def name(self) -> str:
        return f"{self.model}-{self.cell}{'-' + self.tag if self.tag else ''}-s{self.seed}"

    @property
    def command(self) -> str:
        return "python -m mptrain " + " ".join(self.overrides)


def enhanced_schedule(steps: int) -> list[str]:
    """Enhanced scaling under which its floor binds (issue 18, item 5).

    The old schedule (floor 1 -> 64 -> 512 from a 2^16 start) never bound: dynamic backed off to
    2^14 and stayed there, so "enhanced" was dynamic. Here the scale starts at 1 and grows x2 every
    tenth of the run on its own (2^3 by a third), and the floor rises to 2^8 at a third and 2^12 at
    two thirds, above where the growth alone would be (2^11): it binds at both rises by
    construction, and again at any overflow that would back off below it. ``fp8_dyn`` runs the same
    start and growth without the floor, so the floor's effect is measured, not assumed.
    """
    a, b = steps // 3, 2 * steps // 3
    return [
        "loss_scale.init_scale=1", f"loss_scale.growth_interval={max(steps // 10, 1)}",
        "~loss_scale.min_scale_schedule.1000", "~loss_scale.min_scale_schedule.5000",
        f"+loss_scale.min_scale_schedule.{a}=256", f"+loss_scale.min_scale_schedule.{b}=4096",
    ]


def fp8_dyn_schedule(steps: int) -> list[str]:
    """``fp8_dyn``: enhanced's start and growth, no floor."""
    return ["loss_scale.init_scale=1", f"loss_scale.growth_interval={max(steps // 10, 1)}"]


def run_steps(model: str, quick: bool) -> int:
    r = RECIPES[model]
    return max(r.steps // 10, 12 * r.evals) if quick else r.steps


def spec(part: str, model: str, cell: str, seed: int, quick: bool, extra: tuple[str, ...] = (), tag: str = "") -> Spec:
    r = RECIPES[model]
    steps = run_steps(model, quick)
    ov = [*r.overrides, *CELLS[cell], f"trainer.seed={seed}", f"trainer.max_steps={steps}",
          f"trainer.eval_every={steps // r.evals}", f"trainer.log_every={max(steps // 30, 2)}", "trainer.device=cpu",
          "trainer.checkpoint_every=null", "trainer.resume=null", *extra]
    if "loss_scale=enhanced" in CELLS[cell]:
        ov += enhanced_schedule(steps)
    if cell == "fp8_dyn":
        ov += fp8_dyn_schedule(steps)
    return Spec(part, model, cell, seed, ov, tag)


def seeds(quick: bool, full: tuple[int, ...] = SEEDS) -> tuple[int, ...]:
    return full[:2] if quick else full


def parity_specs(quick: bool) -> list[Spec]:
    return [spec("parity", m, c, s, quick) for m in ("alexnet", "resnet50", "lstm_lm")
            for c in RECIPES[m].cells for s in seeds(quick)]


def scaling_specs(quick: bool) -> list[Spec]:
    """(b) and (c): the LM's grid, and the CNN's grid with adaptive (the CNN's fp32 and dynamic
    runs are parity's)."""
    out = [spec("scaling", SCALING_MODEL, c, s, quick) for c in ("fp32", *SCALING_CELLS) for s in seeds(quick)]
    return out + [spec("scaling", CNN_MODEL, c, s, quick) for c in ("fp32", "amp_fp16", *CNN_SCALING_CELLS)
                  for s in seeds(quick)]


def epochs_specs(quick: bool) -> list[Spec]:
    return [spec("epochs", EPOCHS_MODEL, c, s, quick) for c in RECIPES[EPOCHS_MODEL].cells for s in seeds(quick)]


def fp8_specs(quick: bool) -> list[Spec]:
    out = [spec("fp8", FP8_MODEL, c, s, quick) for c in ("fp32", "fp8", "fp8_none", "fp8_dyn") for s in seeds(quick)]
    return out + [spec("fp8", FP8_MODEL, c, s, quick) for c in ("fp8", "fp8_nosr") for s in seeds(quick, SR_SEEDS)]


TELEMETRY = ("telemetry=gradients", "telemetry.shadow=true", "telemetry.max_layers=null")
# (recipe, cell): the histograms of FP32, FP16 unscaled, FP16 scaled, and FP8
TELEMETRY_RUNS = (
    (SCALING_MODEL, "fp32"), (SCALING_MODEL, "fp16_none"), (SCALING_MODEL, "fp16_static_128"),
    (CNN_MODEL, "fp32"), (CNN_MODEL, "fp16_none"), (FP8_MODEL, "fp8"),
    (FP8_MODEL, "fp8_none"), ("resnet50", "fp32"),
)


def telemetry_specs(quick: bool) -> list[Spec]:
    return [
        spec("telemetry", m, c, 0, quick, (*TELEMETRY, f"telemetry.every={max(run_steps(m, quick) // 10, 1)}"), "tel")
        for m, c in TELEMETRY_RUNS
    ]


PARTS = {"parity": parity_specs, "scaling": scaling_specs, "epochs": epochs_specs, "fp8": fp8_specs,
         "telemetry": telemetry_specs}


def all_specs(quick: bool) -> list[Spec]:
    """Every run once (the same recipe, cell and seed is one run, whichever parts use it)."""
    seen: dict[str, Spec] = {}
    for f in PARTS.values():
        for s in f(quick):
            seen.setdefault(s.name, s)
    return list(seen.values())


def model_cells(model: str) -> list[str]:
    """Every cell that the study runs on ``model``, parity cells first."""
    out = list(RECIPES[model].cells)
    for s in all_specs(quick=False):
        if s.model == model and not s.tag and s.cell not in out:
            out.append(s.cell)
    return out


def model_seeds(model: str) -> list[int]:
    return sorted({s.seed for s in all_specs(quick=False) if s.model == model and not s.tag})
