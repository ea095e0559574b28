"""Bad input: one clear line naming the value and what is allowed, exit 2, no traceback."""

from __future__ import annotations

import pytest
from conftest import run_cli

from mptrain.cli import compose
from mptrain.config import validate
from mptrain.errors import MptrainError

BAD = [
    (["model=foo"], "model=foo: unknown choice; model is one of: alexnet, custom, dcgan, googlenet,"),
    (["trainer.foo=1"], "trainer.foo: unknown option; trainer has: max_steps"),
    (["optim.lr=abc"], "optim.lr=abc: must be of type float"),
    (["optim.lr=0"], "optim.lr=0.0: must be a number > 0"),
    (["optim.lr=-1"], "optim.lr=-1.0: must be a number > 0"),
    (["data.batch_size=0"], "data.batch_size=0: must be an integer >= 1"),
    (["trainer.max_steps=0"], "trainer.max_steps=0: must be an integer >= 1"),
    (["loss_scale=static", "loss_scale.scale=0"], "loss_scale.scale=0.0: must be a number > 0"),
    (["loss_scale=static", "loss_scale.scale=-8"], "loss_scale.scale=-8.0: must be a number > 0"),
    (
        ["loss_scale=dynamic", "loss_scale.scale=8"],
        "loss_scale.scale: unknown option; loss_scale has: name, init_scale",
    ),
    (["loss_scale=dynamic", "loss_scale.backoff_factor=2"], "loss_scale.backoff_factor=2.0: must be between 0 and 1"),
    (["trainer.device=tpu"], "trainer.device='tpu': must be one of auto, cpu, cuda"),
    (["data=image_folder"], "data=image_folder needs data.root=PATH"),
    (["data=image_folder", "data.root=/does/not/exist"], "data.root=/does/not/exist: no such directory"),
    (["model=inception_v3", "data.image_size=64"], "data.image_size=64: model=inception_v3 needs at least 299 px"),
    (["precision=fp9"], "precision=fp9: unknown choice; precision is one of:"),
    # Whole-model compile would graph-break at every scaling or quantizing site, silently.
    (["precision=fp8", "trainer.compile=true"],
     "trainer.compile=true with precision=fp8 precision.backend=emulated: whole-model compile graph-breaks at every "
     "quantized layer's autograd function and generator; the quantizers are compiled on their own"),
    (["precision=mx", "precision.autocast=fp16"], "precision.autocast='fp16': must be null or bf16"),
    (["precision=amp_fp16", "loss_scale=adaptive", "trainer.compile=true"],
     "trainer.compile=true with loss_scale=adaptive: its per-layer scales are set by backward hooks"),
]


@pytest.mark.parametrize("overrides", [
    ["precision=fp8", "precision.backend=torchao", "trainer.compile=true"],  # real float8 GEMMs: compile is the point
    ["precision=amp_fp16", "loss_scale=dynamic", "trainer.compile=true"],
    ["precision=mx", "trainer.compile=true"],  # emulated layers traced into the graph (tests/test_mx.py)
    ["precision=mx", "precision.format=nvfp4", "precision.stochastic_rounding=false", "trainer.compile=true"],
    ["precision=mx", "precision.format=nvfp4", "trainer.compile=true"],  # its recipe's stochastic rounding too
    ["precision=mx", "precision.stochastic_rounding=true", "trainer.compile=true"],
])
def test_compile_stays_allowed_where_the_model_compiles_whole(overrides):
    validate(compose(overrides))


@pytest.mark.parametrize("overrides,message", BAD, ids=[" ".join(o) for o, _ in BAD])
def test_bad_config_is_rejected_before_any_work(overrides, message):
    with pytest.raises(MptrainError) as info:
        validate(compose(overrides))
    assert message in str(info.value)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("overrides,message", BAD[:4] + BAD[12:14])
def test_cli_prints_one_line_and_exits_2(tmp_path, overrides, message):
    r = run_cli(*overrides, f"hydra.run.dir={tmp_path}")
    assert r.returncode == 2
    assert r.stderr.strip() == f"mptrain: error: {validate_message(overrides)}"
    assert message in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "summary.json").exists()  # nothing started


def validate_message(overrides):
    try:
        validate(compose(overrides))
    except MptrainError as exc:
        return str(exc)
    raise AssertionError("expected an error")


def test_empty_data_root_is_rejected(tmp_path):
    with pytest.raises(MptrainError, match="the directory is empty"):
        validate(compose(["data=cifar10", f"data.root={tmp_path}"]))


def test_help_lists_groups_and_choices():
    r = run_cli("--help")
    assert r.returncode == 0
    lines = {line.split()[0]: line for line in r.stdout.splitlines() if line.startswith("  ") and line.split()}
    assert all(m in lines["model"] for m in ("alexnet,", "googlenet,", "inception_v3,", "resnet50*", "vgg16"))
    precisions = "amp_bf16, amp_fp16, bf16_pure, fp16_master, fp32*, fp8, mixed, mx, tf32"
    assert lines["precision"].split(None, 1)[1] == precisions
    assert lines["loss_scale"].split(None, 1)[1] == "adaptive, auto*, dynamic, enhanced, none, static"
    assert "trainer: max_steps=None" in r.stdout
