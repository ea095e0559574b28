"""DCGAN through the one engine: two objectives with their own optimizers and loss scalers,
D/G metrics, the fixed-noise sample grid (TensorBoard and PNG), exact resume, refused combinations."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import run_job
from PIL import Image
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from test_engine import scalars

from mptrain import checkpoint
from mptrain.cli import compose
from mptrain.config import validate
from mptrain.errors import MptrainError
from mptrain.models.dcgan import DCGAN

# 16 px, 8-wide networks, 16 fixed-noise samples: a step takes milliseconds.
TINY_GAN = ["model=dcgan", "model.nz=16", "model.ngf=8", "model.ndf=8", "model.num_samples=16", "data.image_size=16",
            "data.batch_size=8", "data.train_samples=32", "data.val_samples=16", "data.num_classes=10",
            "trainer.log_every=2"]


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny models gain nothing from intra-op threads, and on a shared CPU OpenMP's spin-waits make
    them many times slower: one thread keeps these tests fast and their timing stable."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def images(run_dir) -> dict[str, list[int]]:
    acc = EventAccumulator(str(run_dir), size_guidance={"images": 0})
    acc.Reload()
    return {tag: [e.step for e in acc.Images(tag)] for tag in acc.Tags()["images"]}


@pytest.mark.parametrize("precision", ["fp32", "amp_bf16", "amp_fp16"])
def test_trains_in_every_basic_precision(tmp_path, precision):
    s = run_job(tmp_path, *TINY_GAN, f"precision={precision}", "trainer.max_steps=4")
    assert s["status"] == "completed" and s["steps"] == 4 and math.isfinite(s["final_loss"])
    assert s["throughput_unit"] == "images" and s["throughput"] > 0 and s["primary_metric"] == "loss_g"
    assert set(s["metrics"]) == {"loss_d", "loss_g", "d_x", "d_g_z"}
    assert 0 < s["metrics"]["d_x"] < 1 and 0 < s["metrics"]["d_g_z"] < 1
    policy = "dynamic" if precision == "amp_fp16" else "none"
    assert set(s["loss_scale_state"]) == {"discriminator", "generator"}  # one scaler per network
    assert {v["policy"] for v in s["loss_scale_state"].values()} == {policy}
    tags = scalars(tmp_path)
    for tag in ("train/loss_discriminator", "train/loss_generator", "train/d_x_discriminator",
                "train/d_g_z_discriminator", "train/d_g_z_generator", "train/loss_scale_discriminator",
                "train/loss_scale_generator", "train/lr_generator", "train/throughput", "val/loss_d", "val/d_x"):
        assert tag in tags, tag
    assert [step for step, _ in tags["train/loss_generator"]] == [1, 2, 3, 4]


def test_default_model_runs_with_no_other_override(tmp_path):
    cfg = compose(["model=dcgan"])
    assert cfg.optim.name == "adamw" and cfg.optim.lr == 2e-4 and list(cfg.optim.betas) == [0.5, 0.999]
    assert cfg.optim.weight_decay == 0 and cfg.sched.name == "constant" and cfg.data.name == "synthetic"
    validate(cfg)
    s = run_job(tmp_path, "model=dcgan", "trainer.max_steps=1", "data.max_val_batches=1")
    assert s["status"] == "completed" and s["task"]["image_size"] == 32  # CPU size; 64 px on CUDA
    assert s["task"]["parameters"]["generator"] == 1_068_928  # Radford et al.'s layout at 32 px
    state = torch.load(checkpoint.list_checkpoints(tmp_path)[-1], weights_only=True)
    groups = state["optimizers"]["generator"]["param_groups"]
    assert groups[0]["lr"] == 2e-4 and tuple(groups[0]["betas"]) == (0.5, 0.999)


def test_canonical_layout_at_64_px():
    gan = DCGAN(64)
    z = torch.randn(2, 100, 1, 1)
    assert gan.generator(z).shape == (2, 3, 64, 64) and gan.discriminator(gan.generator(z)).shape == (2,)
    # The paper's (and PyTorch's example) 64 px DCGAN: 3.58M generator and 2.77M discriminator weights.
    assert sum(p.numel() for p in gan.generator.parameters()) == 3_576_704
    assert sum(p.numel() for p in gan.discriminator.parameters()) == 2_765_568


def test_sample_grid_png_tensorboard_and_both_scalers_in_the_checkpoint(tmp_path):
    s = run_job(tmp_path, *TINY_GAN, "precision=amp_fp16", "trainer.max_steps=6", "model.sample_every=4")
    assert s["status"] == "completed"
    # Every 4 steps on logging steps (2, 4, 6): at 2 (the first), 6 (>= 4 later, and the last).
    assert images(tmp_path) == {"samples/fixed_noise": [2, 6]}
    png = Image.open(tmp_path / "samples.png")
    assert png.size == (4 * 16 + 5 * 2, 4 * 16 + 5 * 2)  # a 4 x 4 grid of 16 px samples, 2 px padding
    state = torch.load(checkpoint.list_checkpoints(tmp_path)[-1], weights_only=True)
    assert set(state["scalers"]) == {"discriminator", "generator"}
    assert all(sc["policy"] == "dynamic" and sc["scale"] > 0 for sc in state["scalers"].values())
    assert set(state["optimizers"]) == set(state["modules"]) == {"discriminator", "generator"}
    assert state["task_state"]["fixed_noise"].shape == (16, 16, 1, 1)


def test_resume_continues_both_loss_curves_exactly(tmp_path):
    common = [*TINY_GAN, "trainer.max_steps=6", "trainer.log_every=1", "data.train_samples=64"]
    full = tmp_path / "full"
    run_job(full, *common, "trainer.checkpoint_every=3", "trainer.keep_checkpoints=5")
    first = checkpoint.list_checkpoints(full)[0]
    resumed = tmp_path / "resumed"
    s = run_job(resumed, *common, f"trainer.resume={first}")
    assert s["resumed_from"] == str(first) and s["steps"] == 6
    for tag in ("train/loss_discriminator", "train/loss_generator", "train/d_x_discriminator"):
        a, b = dict(scalars(full)[tag]), dict(scalars(resumed)[tag])
        assert sorted(b) == [4, 5, 6]
        for step in (4, 5, 6):
            assert b[step] == a[step], f"{tag} step {step}: {b[step]} != {a[step]}"
    a, b = (torch.load(checkpoint.list_checkpoints(d)[-1], weights_only=True)["modules"] for d in (full, resumed))
    assert all(torch.equal(a[net][k], b[net][k]) for net in a for k in a[net])  # weights and BN statistics


def test_gradient_accumulation_and_real_digits(tmp_path):
    s = run_job(tmp_path / "accum", *TINY_GAN, "trainer.grad_accum=2", "trainer.max_steps=2")
    assert s["status"] == "completed" and s["global_batch_size"] == 16
    s = run_job(tmp_path / "digits", *TINY_GAN, "data=digits", "data.image_size=8", "trainer.max_steps=2")
    assert s["status"] == "completed" and s["data"] == "digits" and s["task"]["image_size"] == 8


def test_real_images_are_mapped_to_the_generators_range():
    from mptrain.data import build_image_data
    from mptrain.tasks.gan import to_tanh_range

    cfg = compose([*TINY_GAN, "data=digits"]).data
    data = build_image_data(cfg, image_size=8, device=torch.device("cpu"), seed=0)
    scale, shift = to_tanh_range(data)
    x = torch.cat([b[0] for b in data.train_batches(0)]) * scale + shift
    assert x.min() >= -1 - 1e-5 and x.max() <= 1 + 1e-5 and x.min() < -0.99 and x.max() > 0.99


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["loss_scale=adaptive", "precision=amp_fp16"], r"loss_scale=adaptive with model=dcgan"),
        (["data=python_docs"], r"data=python_docs: model=dcgan needs images"),
        (["data.image_size=48"], r"data.image_size=48: model=dcgan needs a power of two"),
        (["model.nz=0"], r"model.nz=0: must be an integer >= 1"),
    ],
)
def test_unsupported_combinations_fail_with_one_line_before_training(overrides, message):
    with pytest.raises(MptrainError, match=message) as info:
        validate(compose([*TINY_GAN, *overrides]))
    assert "\n" not in str(info.value)


def test_fp8_converts_both_networks_and_rounds_both_to_fp16(tmp_path):
    """Every network of the task gets the FP8 recipe: both are listed, and after training both the
    generator's and the discriminator's weights lie on the FP16 grid (FP16 master weights)."""
    s = run_job(tmp_path, *TINY_GAN, "precision=fp8", "trainer.max_steps=2")
    assert s["status"] == "completed"
    nets = s["precision_detail"]["fp8_layers"]["networks"]
    assert len(nets) == 2 and all(nets.values()), nets
    state = torch.load(checkpoint.list_checkpoints(tmp_path)[-1], weights_only=True)
    assert len(state["modules"]) == 2
    for name, module_state in state["modules"].items():
        for key, t in module_state.items():
            if t.is_floating_point() and "running" not in key:
                assert torch.equal(t.half().float(), t.float()), (name, key)
