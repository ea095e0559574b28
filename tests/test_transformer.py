"""The GPT-style transformer LM: its architecture (causality, tying, size, FLOPs) and its runs through
the real CLI configs in every precision mode and loss-scaling policy, and the combinations it refuses."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import run_job
from test_engine import scalars

from mptrain.cli import compose
from mptrain.config import validate
from mptrain.errors import MptrainError
from mptrain.models import create_model, list_models
from mptrain.models.transformer import (
    TransformerLanguageModel,
    _LayerNorm,
    analytic_params,
    analytic_train_flops,
)
from mptrain.numerics.precision import build_precision
from mptrain.optim import param_groups

VOCAB = 50
# 2 blocks x 128 on a 50-word phrase stream, 4 rows of 16 tokens: a step takes milliseconds.
TINY_TF = ["model=transformer_lm_tiny", f"data.vocab_size={VOCAB}", "data.train_tokens=4000", "data.val_tokens=800",
           "data.batch_size=4", "data.bptt=16", "data.max_val_batches=4", "trainer.log_every=2"]


@pytest.fixture(autouse=True)
def _one_thread():
    """As in test_language_model: tiny models gain nothing from threads on a shared CPU."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny_model(**kw) -> TransformerLanguageModel:
    torch.manual_seed(0)
    args = {"vocab_size": VOCAB, "d_model": 32, "num_layers": 2, "num_heads": 4, "block_size": 16, **kw}
    return TransformerLanguageModel(**args)


# --------------------------------------------------------------------------------------------
# the architecture


def test_both_sizes_are_registered_with_the_configured_shapes():
    assert {"transformer_lm", "transformer_lm_tiny"} <= set(list_models(task="language_model"))
    big, small = compose(["model=transformer_lm"]), compose(["model=transformer_lm_tiny"])
    m = big.model
    assert (m.num_layers, m.d_model, m.num_heads, m.block_size) == (6, 384, 6, 256)
    assert small.model.num_layers == 2 and small.model.d_model == 128 and small.model.num_heads in (2, 4)
    for cfg in (big, small):
        validate(cfg)
        assert cfg.data.name == "synthetic_text" and cfg.optim.name == "adamw"
        assert cfg.data.bptt == cfg.model.block_size  # a batch row is one full context
    # block_size drives the row length unless data.bptt is set itself.
    assert compose(["model=transformer_lm_tiny", "model.block_size=32"]).data.bptt == 32


def test_attention_is_causal():
    model = tiny_model().eval()
    tokens = torch.randint(VOCAB, (2, 16))
    changed = tokens.clone()
    changed[:, 10] = (tokens[:, 10] + 1) % VOCAB  # a different token at position 10
    with torch.no_grad():
        a, b = model(tokens), model(changed)
    assert a.shape == (2, 16, VOCAB)
    assert torch.equal(a[:, :10], b[:, :10])  # nothing before the change can see it
    assert not torch.allclose(a[:, 10:], b[:, 10:])  # the position itself and later ones do


def test_head_weight_is_the_token_embedding_and_counted_once():
    model = tiny_model()
    assert isinstance(model.lm_head, torch.nn.Linear)  # FP8 conversion swaps exactly this type
    assert model.lm_head.weight is model.embed.wte.weight
    assert sum(p is model.lm_head.weight for p in model.parameters()) == 1
    # The one weight learns from both of its uses: the head's product and the embedding lookup.
    tokens = torch.tensor([[3, 4, 5]])
    model(tokens).logsumexp(-1).sum().backward()
    grad = model.embed.wte.weight.grad
    with torch.no_grad():
        h = model.ln_f(model.blocks[1](model.blocks[0](model.embed(tokens))))
    w = model.lm_head.weight.detach().clone().requires_grad_()
    F.linear(h, w).logsumexp(-1).sum().backward()
    head_only = w.grad
    assert not torch.allclose(grad[3:6], head_only[3:6])  # rows of the input tokens get both
    torch.testing.assert_close(grad[10:], head_only[10:])  # rows of other tokens get the head's only
    # Optimizer groups list it once (torch refuses a parameter in two groups), without decay
    # (an embedding), however the modules are ordered.
    groups = param_groups(model, 0.1, True)
    ids = [id(p) for g in groups for p in g["params"]]
    assert len(ids) == len(set(ids)) == len(list(model.parameters()))
    no_decay = next(g for g in groups if g["weight_decay"] == 0.0)
    assert any(p is model.lm_head.weight for p in no_decay["params"])
    torch.optim.AdamW(groups)

    untied = tiny_model(tie_weights=False)
    assert untied.lm_head.weight is not untied.embed.wte.weight


@pytest.mark.parametrize("name", ["transformer_lm", "transformer_lm_tiny", "transformer_lm_large"])
@pytest.mark.parametrize("tied", [True, False])
def test_parameter_count_matches_the_formula(name, tied):
    cfg = compose([f"model={name}", f"model.tie_weights={tied}"]).model
    with torch.device("meta"):
        model = create_model(cfg, 10_000)
    n = sum(p.numel() for p in model.parameters())
    assert n == analytic_params(10_000, cfg.d_model, cfg.num_layers, cfg.block_size, tied)
    if name == "transformer_lm":  # nanoGPT's baby GPT: 10.65M in the blocks
        assert n - 10_000 * 384 * (1 if tied else 2) - 256 * 384 == 10_646_784 + 2 * 384
    if name == "transformer_lm_large":  # its config says 805M in the blocks
        assert (n - 10_000 * 4096 * (1 if tied else 2) - 2048 * 4096 - 2 * 4096) // 10**6 == 805


def test_flop_counter_counts_attention_and_matches_the_analytic_formula():
    from mptrain.bench import Runner, count_flops

    class Step(Runner):  # one forward + backward, as the bench's runners do it
        def __init__(self, model):
            self.model = model

        def step(self, micro):
            (tokens,) = micro
            F.cross_entropy(self.model(tokens).flatten(0, 1), tokens.flatten()).backward()
            return torch.zeros(())

    rows, t, d, layers = 3, 16, 32, 2
    for dropout in (0.0, 0.1):  # the fused SDPA kernel, and (dropout on CPU) its math decomposition
        counted = count_flops(Step(tiny_model(dropout=dropout)), [torch.randint(VOCAB, (rows, t))])
        reference = analytic_train_flops(VOCAB, d, layers, t, rows)
        attention = 12 * layers * t * d * rows * t
        # A fused kernel's backward recomputes QK^T, and torch's counter counts that one product too.
        recompute = layers * 2 * rows * t * t * d
        assert counted in (reference, reference + recompute), (counted, reference)
        assert counted > reference - attention  # attention is in the count, not just the Linears


def test_sequence_longer_than_the_context_is_refused():
    model = tiny_model()
    with pytest.raises(MptrainError, match=r"a sequence of 17 tokens is longer than model.block_size=16"):
        model(torch.randint(VOCAB, (1, 17)))


def test_layer_norm_stays_fp32_under_fp16_weights():
    model = tiny_model()
    precision = build_precision(compose(["precision=fp16_master"]).precision, torch.device("cpu"))
    precision.prepare_model(model)
    norms = [m for m in model.modules() if isinstance(m, _LayerNorm)]
    assert len(norms) == 5 and all(m.weight.dtype == torch.float32 for m in norms)
    assert model.blocks[0].attn.c_attn.weight.dtype == torch.float16
    x = torch.randn(2, 4, 32, dtype=torch.float16)
    y = norms[0](x)
    assert y.dtype == torch.float16
    torch.testing.assert_close(y, F.layer_norm(x.float(), (32,)).half())
    assert model(torch.randint(VOCAB, (2, 8))).dtype == torch.float16


# --------------------------------------------------------------------------------------------
# through the CLI configs and the one engine


def test_loss_falls_in_a_short_run(tmp_path):
    s = run_job(tmp_path, *TINY_TF, "data.bptt=32", "optim.lr=3e-3", "trainer.max_steps=16", "sched=constant")
    assert s["status"] == "completed" and s["steps"] == 16
    assert s["primary_metric"] == "ppl" and s["throughput_unit"] == "tokens" and s["throughput"] > 0
    assert s["task"]["tied_softmax"] is True
    assert s["task"]["parameters"] == analytic_params(VOCAB, 128, 2, 64, True)
    losses = [v for _, v in scalars(tmp_path)["train/loss"]]
    assert losses[0] == pytest.approx(math.log(VOCAB), rel=0.1)  # untrained: about uniform
    assert losses[-1] < losses[0] - 1.0, losses
    assert s["metrics"]["ppl"] < VOCAB / 3


def test_the_model_is_stateless_and_nothing_is_carried(tmp_path):
    from mptrain.tasks import build_task

    cfg = compose(TINY_TF)
    task = build_task(cfg, torch.device("cpu"), build_precision(cfg.precision, torch.device("cpu")), None)
    assert task.stateful is False
    batches = task.train_batches(0)
    loss, extras = task.loss(task.objectives[0], next(batches))
    assert loss.ndim == 0 and torch.isfinite(loss) and "ppl" in extras
    assert task.state_dict()["hidden"] is None
    assert math.isfinite(task.evaluate(task.precision)["ppl"])


@pytest.mark.parametrize("precision", ["fp32", "amp_bf16", "amp_fp16", "fp16_master", "bf16_pure", "fp8"])
def test_trains_in_every_precision_mode(tmp_path, precision):
    s = run_job(tmp_path, *TINY_TF, f"precision={precision}", "trainer.max_steps=2")
    assert s["status"] == "completed" and s["steps"] == 2 and math.isfinite(s["final_loss"])
    assert math.isfinite(s["metrics"]["ppl"])
    if precision == "fp8":  # every GEMM of the model runs through FP8, the tied head included
        converted = s["precision_detail"]["fp8_layers"]["converted"]
        assert len(converted) == 2 * 4 + 1 and converted[-1] == "lm_head"
        assert s["loss_scale"] == "enhanced"


@pytest.mark.parametrize("policy", ["static", "dynamic", "enhanced", "adaptive"])
def test_every_loss_scaling_policy(tmp_path, policy):
    extra = ["model.tie_weights=false"] if policy == "adaptive" else []
    s = run_job(tmp_path, *TINY_TF, "precision=amp_fp16", f"loss_scale={policy}", *extra, "trainer.max_steps=2")
    assert s["status"] == "completed" and s["loss_scale"] == policy and math.isfinite(s["final_loss"])
    if policy == "adaptive":  # a scale per Linear layer: the fx trace reached every one
        scales = s["loss_scale_state"]["model"]["layer_scales"]
        assert len(scales) == 9 and "lm_head" in scales and "blocks.1.mlp.c_fc" in scales


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["data.bptt=65"], r"data.bptt=65: longer than model.block_size=64, the transformer's context length"),
        (["model.num_heads=3"], r"model.d_model=128: must be divisible by model.num_heads=3"),
        (["model.dropout=1"], r"model.dropout=1.0: must be in \[0, 1\)"),
        (["model.init_std=0"], r"model.init_std=0.0: must be a number > 0"),
        (["loss_scale=adaptive", "precision=amp_fp16"],
         r"loss_scale=adaptive with model=transformer_lm_tiny and model.tie_weights=true: the tied weight"),
        (["data=synthetic"], r"data=synthetic: model=transformer_lm_tiny needs text data"),
    ],
)
def test_bad_settings_fail_with_one_line_before_training(overrides, message):
    with pytest.raises(MptrainError, match=message) as info:
        validate(compose([*TINY_TF, *overrides]))
    assert "\n" not in str(info.value)


def test_fp8_and_adaptive_are_allowed_where_they_work():
    validate(compose([*TINY_TF, "precision=fp8"]))
    validate(compose([*TINY_TF, "precision=amp_fp16", "loss_scale=adaptive", "model.tie_weights=false"]))


def full_and_resumed(tmp_path, *overrides: str):
    """A 4-step run checkpointing at step 2, and a run resumed from that checkpoint: (checkpoint,
    resumed run's summary, full run's losses, resumed run's losses)."""
    from mptrain import checkpoint

    common = [*TINY_TF, *overrides, "trainer.max_steps=4", "trainer.log_every=1"]
    full = tmp_path / "full"
    run_job(full, *common, "trainer.checkpoint_every=2", "trainer.keep_checkpoints=5")
    first = checkpoint.list_checkpoints(full)[0]
    resumed = tmp_path / "resumed"
    s = run_job(resumed, *common, f"trainer.resume={first}")
    return first, s, dict(scalars(full)["train/loss"]), dict(scalars(resumed)["train/loss"])


def test_resume_continues_the_loss_curve_exactly(tmp_path):
    # Dropout on: the resumed run needs the RNG state; the tied weight must come back as one tensor.
    first, s, a, b = full_and_resumed(tmp_path, "model.dropout=0.2")
    assert s["resumed_from"] == str(first) and s["steps"] == 4
    assert sorted(b) == [3, 4] and all(b[step] == a[step] for step in (3, 4)), (a, b)


def test_mx_resume_continues_with_the_same_rounding_draws(tmp_path):
    # Stochastic rounding of MX gradients draws from its own generators (qgemm.RngStreams): a resumed
    # run must continue their streams, not restart them from the seed, or step 4 rounds differently.
    from mptrain import checkpoint

    first, _, a, b = full_and_resumed(
        tmp_path, "precision=mx", "precision.format=mxfp4", "precision.stochastic_rounding=true"
    )
    assert checkpoint.load(first)["precision"]["mx_rng"]  # the streams are in the checkpoint
    assert sorted(b) == [3, 4] and all(b[step] == a[step] for step in (3, 4)), (a, b)
