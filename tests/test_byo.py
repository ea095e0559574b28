"""Bring your own model and data: the torchvision, timm, Hugging Face and custom routes, offline, in
FP32 and in an emulated format; the checked precision plan; init_from; and one line per mistake."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from conftest import TINY, run_cli, run_job
from omegaconf import OmegaConf

from mptrain import checkpoint
from mptrain.cli import compose
from mptrain.config import validate
from mptrain.errors import MptrainError
from mptrain.models import create_model
from mptrain.models.vision import canonical_size, image_size_for

TESTS = Path(__file__).parent
STEPS = ["trainer.max_steps=2", "trainer.log_every=1"]
TINY_LLAMA = ["model=hf_causal_lm", "model.model_type=llama", "data.vocab_size=96", "data.bptt=16",
              "data.batch_size=4", "data.train_tokens=2000", "data.val_tokens=400",
              "model.config={hidden_size:32,intermediate_size:64,num_hidden_layers:2,num_attention_heads:4,"
              "num_key_value_heads:2,max_position_embeddings:64}"]
TINY_GPT2 = ["model=hf_causal_lm", "model.model_type=gpt2", "data.vocab_size=96", "data.bptt=16",
             "data.batch_size=4", "data.train_tokens=2000", "data.val_tokens=400",
             "model.config={n_embd:32,n_layer:2,n_head:4,n_positions:64}"]
CUSTOM_CNN = ["model=custom", "model._target_=byo_models.small_cnn", "data=custom",
              "data._target_=byo_models.images", "data.num_classes=4", "data.batch_size=8"]
CUSTOM_LM = ["model=custom", "model.task=language_model", "model._target_=byo_models.TinyLM",
             "model.kwargs={dim:16}", "data=custom", "data._target_=byo_models.sequences", "data.vocab_size=40",
             "data.bptt=8", "data.batch_size=8", "optim=adamw"]


def plan_rows(summary: dict) -> dict[str, dict]:
    return {row["name"]: row for row in summary["precision_plan"]["layers"]}


def fails(*overrides: str) -> str:
    """The one line a job's mistake gets (composed, validated and run as the CLI does)."""
    with pytest.raises(MptrainError) as err:
        run_job(Path("/nonexistent-never-written"), *overrides)
    message = str(err.value)
    assert "\n" not in message
    return message


# --------------------------------------------------------------------------------------------
# the routes: 2 steps in FP32 and in an emulated format


@pytest.mark.parametrize(("arch", "extra"), [("resnet18", ["model.width_divisor=8"]),
                                             ("mobilenet_v3_small", ["model.width_divisor=8"])])
@pytest.mark.parametrize("precision", ["fp32", "mx"])
def test_torchvision_route_trains(tmp_path, arch, extra, precision):
    s = run_job(tmp_path, "model=torchvision", f"model.arch={arch}", *extra, *TINY, *STEPS,
                f"precision={precision}")
    assert s["status"] == "completed" and s["steps"] == 2 and s["model"] == arch
    rows = plan_rows(s)
    if precision == "mx" and arch == "mobilenet_v3_small":
        # Depthwise convs are in the plan, kept high with the reason; the pointwise ones convert.
        depthwise = [r for r in rows.values() if "depthwise conv" in r["reason"]]
        assert depthwise and all(r["format"] == "fp32" and not r["low_precision"] for r in depthwise)
        assert rows["features.1.block.1.fc1"]["format"] == "mxfp8"  # its squeeze-excite's pointwise conv


def test_image_sizes_come_from_the_architecture():
    vit = compose(["model=torchvision", "model.arch=vit_b_16"]).model
    assert canonical_size(vit) == 224 and image_size_for(vit, "cpu") == 224  # ViT takes its own size only
    resnet = compose(["model=torchvision", "model.arch=resnet18"]).model
    assert image_size_for(resnet, "cuda") == 224 and image_size_for(resnet, "cpu") == 32  # the smallest it takes
    assert canonical_size(compose(["model=torchvision", "model.arch=efficientnet_b3"]).model) == 300
    assert canonical_size(compose(["model=timm", "model.arch=vit_small_patch16_384"]).model) == 384


def test_a_size_the_architecture_rejects_is_one_line():
    message = fails("model=torchvision", "model.arch=vit_b_16", "model.cpu_image_size=64", *TINY, *STEPS)
    assert message.startswith("model.cpu_image_size=64: vit_b_16 rejects 64 px inputs (")
    assert message.endswith("it accepts 224")


@pytest.mark.parametrize(("arch", "precision"), [("test_resnet", "fp32"), ("test_resnet", "mx"),
                                                 ("test_convnext", "fp32"), ("test_convnext", "fp8")])
def test_timm_route_trains(tmp_path, arch, precision):
    s = run_job(tmp_path, "model=timm", f"model.arch={arch}", *TINY, *STEPS, f"precision={precision}")
    assert s["status"] == "completed" and s["steps"] == 2
    if precision != "fp32":
        assert s["precision_plan"]["low_precision_flop_fraction"] > 0.3


def test_hf_llama_trains_and_nvfp4_keeps_its_head_high(tmp_path):
    fp32 = run_job(tmp_path / "fp32", *TINY_LLAMA, *STEPS)
    s = run_job(tmp_path / "nvfp4", *TINY_LLAMA, *STEPS, "precision=mx", "precision.format=nvfp4")
    for run in (fp32, s):
        assert run["status"] == "completed" and run["steps"] == 2 and run["metrics"]["ppl"] > 1
    rows = plan_rows(s)
    assert rows["lm_head"]["format"] == "fp32" and "last layer" in rows["lm_head"]["reason"]
    assert rows["model.layers.0.self_attn.q_proj"]["format"] == "nvfp4"
    assert rows["model.embed_tokens"]["kind"] == "embedding"  # shown, with why it is not converted
    # The same first batch from the same weights: the losses differ by the format alone.
    assert fp32["pairing"] == s["pairing"]


def test_hf_gpt2_trains_with_its_tied_head_in_the_plan(tmp_path):
    s = run_job(tmp_path / "fp32", *TINY_GPT2, *STEPS)
    assert s["status"] == "completed" and s["task"]["tied_softmax"] is True
    s = run_job(tmp_path / "mx", *TINY_GPT2, *STEPS, "precision=mx")
    rows = plan_rows(s)
    assert "weight tied to transformer.wte" in rows["lm_head"]["reason"]
    conv1d = [r for r in rows.values() if r["kind"] == "conv1d"]  # transformers' Conv1D: shown, not dropped
    assert conv1d and all("no converter knows" in r["reason"] for r in conv1d)


def test_hf_vocab_comes_from_the_data_and_cannot_be_smaller():
    model = create_model(compose(TINY_LLAMA).model, 96)
    assert model.config.vocab_size == 96 and model.lm_head.out_features == 96
    with pytest.raises(MptrainError, match=r"model.config.vocab_size=50: smaller than the data's vocabulary \(96"):
        create_model(compose([*TINY_GPT2[:-1], "model.config={vocab_size:50,n_embd:32,n_layer:1,n_head:4}"]).model,
                     96)


@pytest.mark.parametrize("precision", ["fp32", "mx"])
def test_custom_model_and_data_train(tmp_path, precision):
    s = run_job(tmp_path, *CUSTOM_CNN, *STEPS, f"precision={precision}")
    assert s["status"] == "completed" and s["steps"] == 2
    assert s["task"]["num_classes"] == 4 and s["task"]["data"]["image_size"] == 16
    assert s["data_wait_s"] is not None  # the built-in loader's telemetry


def test_custom_language_model_on_custom_sequences(tmp_path):
    s = run_job(tmp_path, *CUSTOM_LM, "trainer.max_steps=8", "optim.lr=0.02", "precision=mx")
    assert s["status"] == "completed" and s["task"]["tied_softmax"] is True
    # Runs of one token are learnable: the loss falls well below uniform's log(40) = 3.7.
    assert s["metrics"]["loss"] < 3.0


def test_custom_data_resumes_exactly(tmp_path):
    base = [*CUSTOM_CNN, "trainer.log_every=1", "trainer.checkpoint_every=2", "sched=constant"]
    whole = run_job(tmp_path / "whole", *base, "trainer.max_steps=4")
    run_job(tmp_path / "half", *base, "trainer.max_steps=2")
    resumed = run_job(tmp_path / "resumed", *base, "trainer.max_steps=4", f"trainer.resume={tmp_path / 'half'}")
    assert resumed["resumed_from"].endswith("step_00000002.pt")
    assert resumed["final_loss"] == whole["final_loss"]


# --------------------------------------------------------------------------------------------
# init_from


def test_init_from_loads_a_state_dict_and_an_mptrain_checkpoint(tmp_path):
    cfg = compose(["model=torchvision", "model.arch=resnet18", "model.width_divisor=8"]).model
    torch.manual_seed(1)
    source = create_model(cfg, 10)
    torch.save({f"module.{k}": v for k, v in source.state_dict().items()}, tmp_path / "w.pt")  # as DDP saves
    torch.manual_seed(2)
    loaded = create_model(OmegaConf.merge(cfg, {"init_from": str(tmp_path / "w.pt")}), 10)
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), source.state_dict().values(),
                                                  strict=True))
    # An mptrain checkpoint: its model's weights.
    run_job(tmp_path / "run", *CUSTOM_CNN, *STEPS)
    ckpt = checkpoint.list_checkpoints(tmp_path / "run")[-1]
    weights = torch.load(ckpt, weights_only=True)["modules"]["model"]
    custom = compose([*CUSTOM_CNN, f"model.init_from={ckpt}"]).model
    model = create_model(custom, 4)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in weights.items())


def test_init_from_mismatch_is_one_line_and_init_strict_false_loads_what_fits(tmp_path):
    cfg = compose(["model=torchvision", "model.arch=resnet18", "model.width_divisor=8"]).model
    state = create_model(cfg, 10).state_dict()
    state["extra.weight"] = torch.zeros(1)
    del state["fc.bias"]
    torch.save(state, tmp_path / "w.pt")
    bad = OmegaConf.merge(cfg, {"init_from": str(tmp_path / "w.pt")})
    with pytest.raises(MptrainError) as err:
        create_model(bad, 7)  # 7 classes: fc's weight has another shape
    assert str(err.value).startswith(f"model.init_from={tmp_path / 'w.pt'}: does not fit ResNet; shapes differ "
                                     "(file vs model): fc.weight (10, 64) vs (7, 64); missing: fc.bias; unexpected: "
                                     "extra.weight")
    model = create_model(OmegaConf.merge(bad, {"init_strict": False}), 7)
    assert torch.equal(model.conv1.weight, state["conv1.weight"])
    assert fails("model=resnet50", "model.init_from=/no/such/weights.pt", *TINY) == \
        "model.init_from=/no/such/weights.pt: no such file or directory"


# --------------------------------------------------------------------------------------------
# the checked plan


@pytest.mark.parametrize("precision", ["mx", "fp8"])
def test_a_pattern_that_matches_nothing_is_one_line(precision):
    message = fails("model=resnet50", "model.width_divisor=8", *TINY, f"precision={precision}",
                    "precision.keep_high=[fcc]")
    assert message == "precision.keep_high: 'fcc' matches no layer of the model; closest layer names: fc"
    assert "precision.only: 'layer9.*' matches no layer" in fails(
        "model=resnet50", "model.width_divisor=8", *TINY, f"precision={precision}", "precision.only=[layer9.*]")


@pytest.mark.parametrize("precision", ["mx", "fp8"])
def test_only_converts_the_named_layers_and_keep_high_wins(tmp_path, precision):
    s = run_job(tmp_path, "model=resnet50", "model.width_divisor=8", *TINY, *STEPS, f"precision={precision}",
                "precision.only=[layer4]", "precision.keep_high=[layer4.2]")
    low = {name for name, row in plan_rows(s).items() if row["low_precision"]}
    assert low and all(n.startswith("layer4.") and not n.startswith("layer4.2.") for n in low)
    rows = plan_rows(s)
    assert "not named by precision.only" in rows["fc"]["reason"]
    assert "keep_high pattern 'layer4.2'" in rows["layer4.2.conv1"]["reason"]


# --------------------------------------------------------------------------------------------
# one line per mistake


def test_bad_input_is_one_line_each():
    assert fails("model=torchvision", "model.arch=resnet181") == (
        "model.arch=resnet181: not a torchvision classification model; close matches: resnet18, resnet101, resnet152, "
        "resnet50, resnet34")
    assert fails("model=timm", "model.arch=convnxt_tiny").startswith(
        "model.arch=convnxt_tiny: not a timm model; close matches: convnext_tiny")
    assert fails("model=hf_causal_lm", "model.model_type=lama").startswith(
        "model.model_type=lama: not a causal LM that transformers knows; close matches: llama")
    assert fails("model=custom", "model._target_=no_such_pkg.build") == (
        "model._target_=no_such_pkg.build: cannot import no_such_pkg (ModuleNotFoundError: No module named "
        "'no_such_pkg')")
    assert fails("model=custom", "model._target_=byo_models.nothing_here") == (
        "model._target_=byo_models.nothing_here: byo_models has no attribute 'nothing_here'")
    assert fails("model=custom", "model._target_=byo_models.not_a_module", *TINY) == (
        "model._target_=byo_models.not_a_module: returned a dict, not a torch.nn.Module")
    assert fails("model=custom", "model._target_=byo_models.small_cnn", "model.kwargs={depth:3}", *TINY).startswith(
        "model.kwargs={'depth': 3, 'num_classes': 10}: byo_models.small_cnn refuses them (")
    assert fails("model=custom", "model._target_=byo_models.too_many_logits", *TINY, *STEPS,
                 "data.image_size=16") == (
        "model=custom: a classifier maps (N, 3, H, W) images to (N, num_classes) logits; for images (4, 3, 16, 16) "
        "it returned (4, 11), expected (4, 10)")
    assert fails("model=lstm_lm_tiny", "data=custom", "data._target_=byo_models.sequences",
                 "data.vocab_size=40").startswith("data=custom with model=lstm_lm_tiny: the LSTM carries its state")
    assert fails("data=custom", "data._target_=byo_models.images") == (
        "data=custom needs data.num_classes (labels are 0..num_classes-1)")
    assert fails(*CUSTOM_CNN, "data.kwargs={bad_label:7}", *STEPS) == (
        "data.num_classes=4: a train label is 7, outside 0..3 (data._target_=byo_models.images)")
    assert fails(*CUSTOM_CNN[:3], "data._target_=byo_models.a_list", "data.num_classes=4") == (
        "data._target_=byo_models.a_list: returned a list; it must return a pair (train, val) of datasets")


def test_a_language_model_with_too_few_logits_is_one_line():
    assert fails("model=custom", "model.task=language_model", "model._target_=byo_models.TinyLM",
                 "model.kwargs={head_size:20}", "data=synthetic_text", "data.vocab_size=50", "data.batch_size=2",
                 "data.bptt=4", *STEPS) == (
        "model=custom: a language model maps (N, T) tokens to (N, T, V) logits; for tokens (2, 4) it returned "
        "(2, 4, 20) torch.float32, expected (2, 4, >= 50)")


@pytest.mark.parametrize(("module", "route", "extra"), [("timm", "model=timm", "timm"),
                                                        ("transformers", "model=hf_causal_lm", "hf")])
def test_a_missing_extra_names_the_pip_command(monkeypatch, module, route, extra):
    monkeypatch.setitem(sys.modules, module, None)  # import raises ImportError, as when not installed
    cfg = compose([route, "model.arch=x" if extra == "timm" else "model.model_type=llama"])
    with pytest.raises(MptrainError) as err:
        validate(cfg)
    assert str(err.value).endswith(f"pip install 'mptrain[{extra}]'")


def test_the_cli_exits_2_with_one_line_and_lists_the_routes(tmp_path):
    r = run_cli("model=torchvision", "model.arch=resnet181", cwd=tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("mptrain: error: model.arch=resnet181: not a torchvision")
    assert not any(tmp_path.iterdir())  # nothing written
    help_text = run_cli("--help").stdout
    assert all(route in help_text for route in ("model=torchvision model.arch=NAME", "model=timm model.arch=NAME",
                                                "model=hf_causal_lm model.model_type=TYPE",
                                                "model=custom model._target_=", "data=custom data._target_="))
