"""The model registry and the five ImageNet CNN presets over the torchvision route (tiny widths on CPU;
full widths on the meta device). Other routes: tests/test_byo.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torchvision.models as tvm
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, OmegaConf
from torch import nn

import mptrain.models as models
from mptrain.config import ClassifierModelConfig, register_configs
from mptrain.errors import MptrainError
from mptrain.models import create_model, list_models
from mptrain.models.vision import classifier_heads, narrow

CONFIG_DIR = str(Path(__file__).resolve().parents[1] / "configs")
# The presets: the model configs over the torchvision route that name their own arch.
CLASSIFIERS = sorted(p.stem for p in (Path(CONFIG_DIR) / "model").glob("*.yaml")
                     if "/schema/model/classifier" in p.read_text() and "\narch: " in p.read_text())
NUM_CLASSES = 10
BATCH = 2
TINY = {"inception_v3": 16}  # the divisor used per model in the tiny tests; default 8
AUX_MODELS = {"googlenet", "inception_v3"}
# torchvision's builders with the kwargs the registry passes (for the full-width comparison).
TORCHVISION = {
    "alexnet": (tvm.alexnet, {}),
    "vgg16": (tvm.vgg16, {}),
    "resnet50": (tvm.resnet50, {}),
    "googlenet": (tvm.googlenet, {"aux_logits": True, "init_weights": True, "dropout": 0.2}),
    "inception_v3": (tvm.inception_v3, {"aux_logits": True, "init_weights": True}),
}
# Published parameter counts at 1000 classes, as the configs set aux_logits (torchvision's docs
# list googlenet and inception_v3 without their auxiliary heads: 6,624,904 and 23,834,568).
PARAMS_1000 = {
    "alexnet": 61_100_840,
    "vgg16": 138_357_544,
    "resnet50": 25_557_032,
    "googlenet": 13_004_888,
    "inception_v3": 27_161_264,
}


def model_cfg(name: str, *overrides: str) -> DictConfig:
    """The ``model`` group as the app composes it."""
    register_configs()
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose("config", overrides=[f"model={name}", *overrides])
    return cfg.model


def tiny_cfg(name: str, *overrides: str) -> DictConfig:
    return model_cfg(name, f"model.width_divisor={TINY.get(name, 8)}", *overrides)


def n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def full_on_meta(cfg: DictConfig, num_classes: int = NUM_CLASSES) -> nn.Module:
    """The full-width model, for counting and shapes only (the meta device allocates nothing)."""
    cfg = cfg.copy()
    cfg.width_divisor = 1
    with torch.device("meta"):
        return create_model(cfg, num_classes)


def outputs_of(out: torch.Tensor | tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
    return list(out) if isinstance(out, tuple) else [out]


# --------------------------------------------------------------------------------------------
# registry


def test_registry_lists_the_routes_and_the_presets_use_torchvision() -> None:
    assert CLASSIFIERS == ["alexnet", "googlenet", "inception_v3", "resnet50", "vgg16"]
    assert list_models() == sorted(list_models())
    assert list_models(task="classification") == ["timm", "torchvision"]
    for name in CLASSIFIERS:  # each preset composes as the torchvision route with its own arch
        cfg = model_cfg(name)
        assert (cfg.route, cfg.arch, cfg.name) == ("torchvision", name, name)


def test_register_model_tags_tasks_and_refuses_duplicates(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(models, "_REGISTRY", dict(models._REGISTRY))

    @models.register_model("toy_lm", task="language_model")
    def toy(cfg: DictConfig, num_classes: int) -> nn.Module:
        return nn.Linear(4, num_classes)

    assert "toy_lm" in list_models() and "toy_lm" not in list_models(task="classification")
    assert "toy_lm" in list_models(task="language_model")
    assert create_model(OmegaConf.create({"name": "toy_lm"}), 3).out_features == 3
    with pytest.raises(ValueError, match="registered twice"):
        models.register_model("toy_lm", task="language_model")(toy)


def test_unknown_model_name_is_a_user_error() -> None:
    with pytest.raises(MptrainError) as err:
        create_model(OmegaConf.create({"name": "resnet51"}), NUM_CLASSES)
    message = str(err.value)
    assert "model='resnet51': unknown; choose one of" in message
    assert all(name in message for name in ("torchvision", "timm", "custom", "hf_causal_lm"))


# --------------------------------------------------------------------------------------------
# tiny models: train a step on CPU


@pytest.mark.parametrize("name", CLASSIFIERS)
def test_tiny_model_trains_a_step(name: str) -> None:
    torch.manual_seed(0)
    cfg = tiny_cfg(name)
    model = create_model(cfg, NUM_CLASSES)
    size = cfg.cpu_image_size  # 64 px; 299 for inception_v3 (its auxiliary head needs it)
    x = torch.randn(BATCH, 3, size, size)
    y = torch.randint(0, NUM_CLASSES, (BATCH,))

    model.train()
    out = model(x)
    outs = outputs_of(out)
    if name in AUX_MODELS:
        assert cfg.aux_logits  # the configs turn the paper's auxiliary classifiers on
        expected = tvm.GoogLeNetOutputs if name == "googlenet" else tvm.InceptionOutputs
        assert type(out).__name__ == expected.__name__ and len(outs) == len(expected._fields)
    else:
        assert isinstance(out, torch.Tensor)
    assert all(o.shape == (BATCH, NUM_CLASSES) and torch.isfinite(o).all() for o in outs)

    sum(nn.functional.cross_entropy(o, y) for o in outs).backward()
    for pname, p in model.named_parameters():
        assert p.grad is not None, f"{pname}: no gradient"
        assert torch.isfinite(p.grad).all(), f"{pname}: non-finite gradient"
        assert p.grad.abs().sum() > 0, f"{pname}: zero gradient"

    model.eval()
    with torch.no_grad():
        logits = model(x)
    assert isinstance(logits, torch.Tensor) and logits.shape == (BATCH, NUM_CLASSES)


@pytest.mark.parametrize("name", CLASSIFIERS)
def test_tiny_model_is_the_real_architecture_narrowed(name: str) -> None:
    cfg = tiny_cfg(name)
    divisor = cfg.width_divisor
    tiny = create_model(cfg, NUM_CLASSES)
    full = full_on_meta(cfg)

    # Same module tree, layer for layer; only the widths differ.
    tiny_layers, full_layers = dict(tiny.named_modules()), dict(full.named_modules())
    assert [(n, type(m)) for n, m in tiny_layers.items()] == [(n, type(m)) for n, m in full_layers.items()]
    convs = [n for n, m in full_layers.items() if isinstance(m, nn.Conv2d)]
    heads = classifier_heads(full)
    aux = bool(cfg.aux_logits)
    assert len(heads) == (1 + 2 * aux if name == "googlenet" else 1 + aux)
    for n, f in full_layers.items():
        t = tiny_layers[n]
        if isinstance(f, nn.Conv2d):
            assert isinstance(t, nn.Conv2d)
            first = n == convs[0]
            assert t.in_channels == (3 if first else f.in_channels // divisor)
            assert t.out_channels * divisor == f.out_channels
            assert (t.kernel_size, t.stride, t.padding) == (f.kernel_size, f.stride, f.padding)
        elif isinstance(f, nn.Linear):
            assert isinstance(t, nn.Linear)
            assert t.in_features * divisor == f.in_features
            assert t.out_features == (NUM_CLASSES if n in heads else f.out_features // divisor)
        elif isinstance(f, nn.BatchNorm2d):
            assert isinstance(t, nn.BatchNorm2d)
            assert t.num_features * divisor == f.num_features and t.eps == f.eps
    assert tiny_layers[convs[0]].in_channels == 3

    # Nearly every weight shrinks by divisor² (both widths divided); biases, BN, the stem's input
    # and the heads' outputs only by divisor, so the ratio lands a little under divisor².
    ratio = n_params(full) / n_params(tiny)
    assert 0.9 * divisor**2 <= ratio <= divisor**2, ratio


@pytest.mark.parametrize("name", sorted(AUX_MODELS))
def test_without_aux_logits_train_mode_returns_a_tensor(name: str) -> None:
    cfg = tiny_cfg(name, "model.aux_logits=false")
    model = create_model(cfg, NUM_CLASSES).train()
    assert not any(n.startswith(("aux", "AuxLogits")) for n, _ in model.named_parameters())
    out = model(torch.randn(BATCH, 3, cfg.cpu_image_size, cfg.cpu_image_size))
    assert isinstance(out, torch.Tensor) and out.shape == (BATCH, NUM_CLASSES)


@pytest.mark.parametrize("name", CLASSIFIERS)
def test_dropout_comes_from_the_config(name: str) -> None:
    if name == "resnet50":  # no dropout in ResNet: a value set is refused, not ignored
        with pytest.raises(MptrainError, match=r"model\.dropout=0\.3: torchvision's resnet50 takes no dropout"):
            create_model(tiny_cfg(name, "model.dropout=0.3"), NUM_CLASSES)
        return
    model = create_model(tiny_cfg(name, "model.dropout=0.3"), NUM_CLASSES)
    # GoogLeNet's auxiliary heads keep the 0.7 of the original (and torchvision).
    ps = sorted({m.p for n, m in model.named_modules() if isinstance(m, nn.Dropout) and "aux" not in n})
    assert ps == [0.3]


# --------------------------------------------------------------------------------------------
# full width: exactly torchvision


@pytest.mark.parametrize("name", CLASSIFIERS)
def test_full_width_is_exactly_torchvision(name: str) -> None:
    cfg = model_cfg(name)
    assert cfg.width_divisor == 1
    factory, kwargs = TORCHVISION[name]
    with torch.device("meta"):
        ours = create_model(cfg, 1000)
        theirs = factory(weights=None, num_classes=1000, **kwargs)
    assert repr(ours) == repr(theirs)
    assert n_params(ours) == n_params(theirs) == PARAMS_1000[name]


def test_full_width_is_random_init_on_the_default_device() -> None:
    model = create_model(model_cfg("googlenet"), NUM_CLASSES)  # the smallest full model
    weight = model.conv1.conv.weight
    assert weight.device.type == "cpu" and 0 < weight.std() < 0.02  # truncated N(0, 0.01)


# --------------------------------------------------------------------------------------------
# bad settings


@pytest.mark.parametrize(
    ("name", "divisor", "allowed"),
    [
        ("resnet50", 3, "allowed: 1, 2, 4, 8, 16, 32, 64"),
        ("googlenet", 16, "allowed: 1, 2, 4, 8"),
        ("inception_v3", 32, "allowed: 1, 2, 4, 8, 16"),
    ],
)
def test_width_divisor_that_does_not_divide_is_refused(name: str, divisor: int, allowed: str) -> None:
    with pytest.raises(MptrainError, match=rf"model\.width_divisor={divisor}: must divide") as err:
        create_model(model_cfg(name, f"model.width_divisor={divisor}"), NUM_CLASSES)
    assert str(err.value).endswith(allowed)


def test_width_divisor_below_one_is_refused() -> None:
    cfg = OmegaConf.structured(ClassifierModelConfig(name="alexnet", arch="alexnet", width_divisor=0))
    with pytest.raises(MptrainError, match=r"model\.width_divisor=0: must be an integer >= 1"):
        create_model(cfg, NUM_CLASSES)


def test_aux_logits_on_a_model_without_aux_heads_is_refused() -> None:
    cfg = OmegaConf.structured(ClassifierModelConfig(name="vgg16", arch="vgg16", aux_logits=True, width_divisor=8))
    with pytest.raises(MptrainError, match=r"model\.aux_logits=true: vgg16 has no auxiliary"):
        create_model(cfg, NUM_CLASSES)


# --------------------------------------------------------------------------------------------
# narrow() on its own


def test_narrow_keeps_image_channels_and_logits_and_divides_the_rest() -> None:
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1, bias=False),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.Conv2d(16, 16, 3, padding=1, groups=16),  # depthwise: groups follow the width
        nn.AdaptiveAvgPool2d(2),
        nn.Flatten(),
        nn.Linear(16 * 2 * 2, 32),
        nn.ReLU(),
        nn.Linear(32, 5),
    )
    assert classifier_heads(model) == {"8"}
    narrow(model, 4)
    assert (model[0].in_channels, model[0].out_channels, model[0].bias) == (3, 4, None)
    assert model[1].num_features == 4
    assert (model[3].in_channels, model[3].out_channels, model[3].groups) == (4, 4, 4)
    assert (model[6].in_features, model[6].out_features) == (16, 8)
    assert (model[8].in_features, model[8].out_features) == (8, 5)
    assert model(torch.randn(2, 3, 8, 8)).shape == (2, 5)
    assert narrow(model, 1) is model


def test_narrow_refuses_layers_it_cannot_resize() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 2))
    with pytest.raises(ValueError, match="cannot resize 1"):
        narrow(model, 2)
