"""The LSTM language model through the one engine: precisions, perplexity on real English,
truncated BPTT with a carried state, exact resume, and the combinations it refuses."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import run_job
from test_engine import scalars

from mptrain import checkpoint
from mptrain.cli import compose
from mptrain.config import validate
from mptrain.errors import MptrainError
from mptrain.models import list_models
from mptrain.models.lstm import LSTMLanguageModel

# A 1 x 32 LSTM on a 50-word phrase stream: a few steps take well under a second.
TINY_LM = ["model=lstm_lm_tiny", "data.vocab_size=50", "data.train_tokens=4000", "data.val_tokens=800",
           "data.batch_size=4", "data.bptt=8", "trainer.log_every=2"]


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny models gain nothing from intra-op threads, and on a shared CPU OpenMP's spin-waits make
    them many times slower: one thread keeps these tests fast and their timing stable."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_the_sizes_are_registered_language_models():
    assert list_models(task="language_model") == ["hf_causal_lm", "lstm_lm", "lstm_lm_large", "lstm_lm_medium",
                                                  "lstm_lm_tiny", "transformer_lm", "transformer_lm_large",
                                                  "transformer_lm_tiny"]


@pytest.mark.parametrize("precision", ["fp32", "amp_bf16", "amp_fp16"])
def test_trains_in_every_basic_precision(tmp_path, precision):
    s = run_job(tmp_path, *TINY_LM, f"precision={precision}", "trainer.max_steps=4")
    assert s["status"] == "completed" and s["steps"] == 4 and math.isfinite(s["final_loss"])
    assert s["primary_metric"] == "ppl" and s["throughput_unit"] == "tokens" and s["throughput"] > 0
    assert s["metrics"]["ppl"] == pytest.approx(math.exp(s["metrics"]["loss"]))
    assert 1 < s["metrics"]["ppl"] < 60  # about the vocabulary size, untrained
    assert s["loss_scale"] == ("dynamic" if precision == "amp_fp16" else "none")
    tags = scalars(tmp_path)
    assert [step for step, _ in tags["train/ppl"]] == [1, 2, 3, 4]  # the task's extra, every step
    assert tags["train/ppl"][-1][1] == pytest.approx(math.exp(tags["train/loss"][-1][1]), rel=1e-5)
    assert "val/ppl" in tags and "val/loss" in tags


def test_default_model_runs_with_no_other_override(tmp_path):
    cfg = compose(["model=lstm_lm"])
    assert cfg.data.name == "synthetic_text" and cfg.data.vocab_size == 10000
    assert cfg.optim.name == "adamw" and cfg.trainer.grad_clip == 0.25
    validate(cfg)
    # The real default sizes (2 x 200, 10K words), just two steps and a short evaluation.
    s = run_job(tmp_path, "model=lstm_lm", "trainer.max_steps=2", "data.max_val_batches=2")
    assert s["status"] == "completed" and s["data"] == "synthetic_text"
    assert s["task"]["vocab_size"] == 10000 and s["task"]["tied_softmax"] is True
    assert 5000 < s["metrics"]["ppl"] < 20000  # untrained: about the vocabulary size


def test_perplexity_falls_on_the_shipped_english_corpus(tmp_path):
    common = ["model=lstm_lm_tiny", "data=python_docs", "data.batch_size=16", "data.bptt=20", "trainer.log_every=10",
              "sched=constant"]
    untrained = run_job(tmp_path / "untrained", *common, "trainer.max_steps=1", "optim.lr=1e-9")
    trained = run_job(tmp_path / "trained", *common, "trainer.max_steps=40", "optim.lr=0.01")
    before, after = untrained["metrics"]["ppl"], trained["metrics"]["ppl"]
    vocab = trained["task"]["vocab_size"]
    assert before == pytest.approx(vocab, rel=0.2)  # a fresh model is about uniform over the words
    assert after < before / 4, f"val ppl {before:.0f} -> {after:.0f}"
    assert (tmp_path / "trained" / "vocab.json").is_file()


def test_resume_continues_the_loss_curve_exactly(tmp_path):
    # Two layers with dropout: the resumed run needs the carried LSTM state *and* the RNG state.
    common = [*TINY_LM, "model.num_layers=2", "model.dropout=0.3", "trainer.max_steps=6", "trainer.log_every=1"]
    full = tmp_path / "full"
    run_job(full, *common, "trainer.checkpoint_every=3", "trainer.keep_checkpoints=5")
    first = checkpoint.list_checkpoints(full)[0]
    state = torch.load(first, weights_only=True)
    h, c = state["task_state"]["hidden"]
    assert h.shape == c.shape == (2, 4, 32)  # [layers, batch, size]: the state carried into step 4
    resumed = tmp_path / "resumed"
    s = run_job(resumed, *common, f"trainer.resume={first}")
    assert s["resumed_from"] == str(first) and s["steps"] == 6
    a, b = dict(scalars(full)["train/loss"]), dict(scalars(resumed)["train/loss"])
    assert sorted(b) == [4, 5, 6]
    for step in (4, 5, 6):
        assert b[step] == a[step], f"step {step}: {b[step]} != {a[step]}"


def test_hidden_state_is_carried_within_an_epoch_and_reset_at_its_start(tmp_path):
    from mptrain.numerics.precision import build_precision
    from mptrain.tasks import build_task

    cfg = compose([*TINY_LM, "data.train_tokens=400"])
    task = build_task(cfg, torch.device("cpu"), build_precision(cfg.precision, torch.device("cpu")), None)
    objective = task.objectives[0]
    batches = task.train_batches(0)
    task.loss(objective, next(batches))
    carried = task.state_dict()["hidden"]
    assert carried is not None and not carried[0].requires_grad  # detached: truncated BPTT
    task.train_batches(1)  # a new epoch starts from a zero state
    assert task.state_dict()["hidden"] is None
    task.load_state_dict({**task.state_dict(), "hidden": carried})
    task.train_batches(1, start=3)  # resuming mid-epoch keeps the loaded state
    assert torch.equal(task.state_dict()["hidden"][0], carried[0])


@pytest.mark.filterwarnings("ignore:LSTM with projections is not supported with oneDNN")
def test_lstmp_and_untied_softmax(tmp_path):
    model = LSTMLanguageModel(100, emb_size=16, hidden_size=32, num_layers=2, proj_size=16, tie_weights=True)
    logits, (h, c) = model(torch.randint(100, (3, 7)))
    assert logits.shape == (3, 7, 100) and h.shape == (2, 3, 16) and c.shape == (2, 3, 32)
    assert model.decoder is None and model.embedding.weight.shape == (100, 16)  # tied: no second matrix
    untied = LSTMLanguageModel(100, emb_size=8, hidden_size=32, num_layers=1, tie_weights=False)
    assert untied.decoder is not None and untied.decoder.weight.shape == (100, 32)
    s = run_job(tmp_path, *TINY_LM, "model.hidden_size=48", "model.proj_size=32", "precision=amp_fp16",
                "trainer.max_steps=2")
    assert s["status"] == "completed" and math.isfinite(s["final_loss"])


def test_cpu_fp16_autocast_runs_the_lstm_in_fp16():
    model = LSTMLanguageModel(20, emb_size=8, hidden_size=8, num_layers=1)
    with torch.autocast("cpu", dtype=torch.float16):
        _, (h, _) = model(torch.randint(20, (2, 3)))
    assert h.dtype == torch.float16  # as cuDNN's LSTM under CUDA autocast


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["precision=fp8"], r"precision=fp8 with model=lstm_lm_tiny: FP8 converts nn.Linear/Conv layers only"),
        (["loss_scale=adaptive", "precision=amp_fp16"], r"loss_scale=adaptive with model=lstm_lm_tiny"),
        (["model.hidden_size=64"], r"model.tie_weights=true needs model.emb_size \(32\) =="),
        (["model.proj_size=32"], r"model.proj_size=32: must be below model.hidden_size=32"),
        (["data=synthetic"], r"data=synthetic: model=lstm_lm_tiny needs text data"),
        (["data.bptt=0"], r"data.bptt=0: must be an integer >= 1"),
        (["data.vocab_size=null"], r"data=synthetic_text needs data.vocab_size"),
    ],
)
def test_unsupported_combinations_fail_with_one_line_before_training(overrides, message):
    with pytest.raises(MptrainError, match=message) as info:
        validate(compose([*TINY_LM, *overrides]))
    assert "\n" not in str(info.value)


def test_resume_with_another_vocabulary_is_refused(tmp_path):
    run_job(tmp_path / "a", *TINY_LM, "trainer.max_steps=2")
    with pytest.raises(MptrainError, match=r"trainer\.resume.*(another vocabulary|does not fit)"):
        run_job(tmp_path / "b", *TINY_LM, "data.vocab_size=60", f"trainer.resume={tmp_path / 'a'}")
