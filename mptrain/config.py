"""Typed config schemas, registered in Hydra's ConfigStore, and the value checks run before any work.

Each config group in ``configs/`` has a schema here. Groups whose choices take different keys
(``model``, ``precision``, ``loss_scale``, ``optim``) have one dataclass per choice, stored under
``schema/<group>/<choice>`` and pulled in by the YAML file's defaults list, so an override that
does not belong to the chosen policy (``loss_scale=dynamic loss_scale.scale=8``) is rejected
instead of silently ignored.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from mptrain.errors import MptrainError, check

# --------------------------------------------------------------------------------------------
# model


@dataclass
class ClassifierModelConfig:
    """An image classifier from a zoo, random init: ``model=torchvision`` (and the presets over it:
    resnet50, vgg16, ...) or ``model=timm``, with ``model.arch=NAME``. Null sizes are the
    architecture's own (see mptrain.models.vision)."""

    name: str = MISSING
    task: str = "classification"
    route: str = "torchvision"  # torchvision | timm
    arch: str = MISSING  # the zoo's model name (torchvision.models.list_models(), timm.list_models())
    # Constructor arguments, as timm's --model-kwargs. Typed Any with a null default: Hydra's override
    # (model.kwargs={a:1}) replaces a null, but merges into a dict, whose struct flag refuses new keys.
    kwargs: Any = None
    num_classes: int | None = None  # None: taken from the dataset
    image_size: int | None = None  # used on CUDA when data.image_size is null (null: the canonical size)
    cpu_image_size: int | None = None  # used on CPU when data.image_size is null (null: a small size it accepts)
    min_image_size: int | None = None  # smallest input the architecture accepts (null: not checked up front)
    width_divisor: int = 1  # divide every channel count (tiny models for tests and CPU smoke runs)
    aux_logits: bool | None = None  # GoogLeNet / Inception v3 auxiliary classifiers (null: the arch's default)
    aux_weight: float = 0.0  # weight of each auxiliary loss in the training loss
    dropout: float | None = None  # null: the architecture's default
    init_from: str | None = None  # a local state dict or mptrain checkpoint to start from
    init_strict: bool = True  # init_from: every key and shape must match


@dataclass
class CustomModelConfig:
    """``model=custom``: the user's callable (``model._target_``) returns the nn.Module; see
    mptrain.models.custom for the contract."""

    name: str = "custom"
    task: str = "classification"  # classification | language_model
    route: str = "custom"
    _target_: str = MISSING  # package.module.callable
    kwargs: Any = None  # keyword arguments of _target_ (Any and null: see ClassifierModelConfig.kwargs)
    num_classes: int | None = None  # None: taken from the dataset
    image_size: int = 224  # used on CUDA when data.image_size is null
    cpu_image_size: int = 32  # used on CPU when data.image_size is null
    aux_weight: float = 0.0  # weight of each auxiliary loss (a classifier returning a tuple)
    init_from: str | None = None
    init_strict: bool = True


@dataclass
class HFCausalLMConfig:
    """``model=hf_causal_lm``: any causal LM that transformers knows, built from a config, offline
    (``AutoConfig.for_model(model_type, **config)``, ``AutoModelForCausalLM.from_config``)."""

    name: str = "${.model_type}"
    task: str = "language_model"
    route: str = "hf_causal_lm"
    model_type: str = MISSING  # llama, gpt2, qwen2, mistral, ... (transformers' CONFIG_MAPPING)
    config: Any = None  # the config's fields (see ClassifierModelConfig.kwargs); vocab_size: null takes the data's
    attn_implementation: str = "sdpa"  # eager | sdpa (flash_attention_2 where installed)
    init_from: str | None = None
    init_strict: bool = True


@dataclass
class LanguageModelConfig:
    """A word-level LSTM language model (``model.task=language_model``); the vocabulary comes from
    the data. ``proj_size`` > 0 gives LSTMP layers (Sak et al. 2014), as in bigLSTM."""

    name: str = MISSING
    task: str = "language_model"
    arch: str = "lstm"  # which language-model schema this is (the checks differ): lstm | transformer
    emb_size: int = 200  # word embedding width
    hidden_size: int = 200  # LSTM cells per layer
    num_layers: int = 2
    proj_size: int = 0  # 0: none; else each layer's output is projected to this size (< hidden_size)
    dropout: float = 0.2  # on the embeddings, between layers and before the softmax
    tie_weights: bool = True  # softmax weight = embedding; needs emb_size == (proj_size or hidden_size)
    init_range: float = 0.1  # embedding (and softmax) weights ~ U(-init_range, init_range)
    init_from: str | None = None  # a local state dict or mptrain checkpoint to start from
    init_strict: bool = True


@dataclass
class TransformerLMConfig:
    """A GPT-style decoder-only transformer language model (``model.task=language_model``): pre-LayerNorm
    blocks, causal attention, 4x GELU MLP, learned positions. The vocabulary comes from the data; each
    row of a batch (``data.bptt`` tokens, which the configs set to ``block_size``) is one context."""

    name: str = MISSING
    task: str = "language_model"
    arch: str = "transformer"
    d_model: int = 384  # residual stream width (embeddings too)
    num_layers: int = 6  # transformer blocks
    num_heads: int = 6  # attention heads; must divide d_model
    block_size: int = 256  # context length: the longest sequence the position embeddings cover
    dropout: float = 0.1  # on embeddings, attention weights, and each block's two residual branches
    tie_weights: bool = True  # lm_head weight = token embedding
    init_std: float = 0.02  # weights ~ N(0, init_std); residual projections / sqrt(2 * num_layers)
    init_from: str | None = None  # a local state dict or mptrain checkpoint to start from
    init_strict: bool = True


@dataclass
class DCGANConfig:
    """Radford et al. 2015's DCGAN (``model.task=gan``): sizes are config, images are square."""

    name: str = MISSING
    task: str = "gan"
    image_size: int = 64  # canonical size, used on CUDA when data.image_size is null (a power of 2)
    cpu_image_size: int = 32  # used on CPU when data.image_size is null
    nz: int = 100  # latent vector size
    ngf: int = 64  # generator width (channels of its last hidden layer)
    ndf: int = 64  # discriminator width (channels of its first layer)
    sample_every: int = 500  # steps between fixed-noise sample grids in TensorBoard
    num_samples: int = 64  # fixed-noise samples in the grid (and in samples.png)


# --------------------------------------------------------------------------------------------
# data


@dataclass
class DataConfig:
    name: str = MISSING
    root: str | None = None  # image_folder, cifar10: the dataset directory
    batch_size: int = 32  # per device and per micro-step (see trainer.grad_accum)
    val_batch_size: int | None = None  # null: same as batch_size
    num_workers: int = 2
    image_size: int | None = None  # null: the model's size for the device
    num_classes: int | None = None  # synthetic: how many classes; real data: read from the data
    train_samples: int = 1600  # synthetic: samples in one epoch
    val_samples: int = 256  # synthetic: validation samples
    pattern_scale: float = 1.0  # synthetic: the class pattern's amplitude against unit noise (less: harder)
    task_seed: int | None = None  # synthetic: seeds the class patterns and val images (null: trainer.seed)
    val_fraction: float = 0.2  # digits: held-out fraction
    augment: bool = True  # random crop / flip on real training images
    # image_folder: cpu (torchvision.io decode + v2 ops on uint8 in workers, normalised on the device),
    # gpu (workers read bytes; nvjpeg decode and augmentation on CUDA), pil (the legacy float host path)
    decode: str = "cpu"
    pin_memory: bool = True
    prefetch_factor: int = 4
    max_val_batches: int | None = None  # null: the whole validation set
    # Language models (data=synthetic_text | text_corpus | python_docs):
    bptt: int = 35  # truncated BPTT length: tokens per row of a batch
    vocab_size: int | None = None  # synthetic_text: its size; corpora: keep the most frequent (null: all)
    train_tokens: int = 50_000  # synthetic_text: tokens in the training stream
    val_tokens: int = 10_000  # synthetic_text: tokens in the validation stream
    text_pattern: str = "phrases"  # synthetic_text: phrases (learnable) | uniform (i.i.d., nothing to learn)


@dataclass
class CustomDataConfig(DataConfig):
    """``data=custom``: the user's callable returns (train, val) map-style datasets (see
    mptrain.data.custom); batch sizes, workers and classes stay mptrain's keys."""

    name: str = "custom"
    _target_: str = MISSING  # package.module.callable
    kwargs: Any = None  # keyword arguments of _target_ (Any and null: see ClassifierModelConfig.kwargs)


# --------------------------------------------------------------------------------------------
# precision


@dataclass
class PrecisionConfig:
    """fp32 | tf32 | amp_fp16 | amp_bf16 | mixed | fp16_master."""

    name: str = MISSING


@dataclass
class BF16PureConfig(PrecisionConfig):
    stochastic_rounding: bool = True  # round the optimizer update into bf16 stochastically


@dataclass
class FP8PrecisionConfig(PrecisionConfig):
    backend: str = "emulated"  # emulated | torchao
    recipe: str = "tensorwise"  # torchao: tensorwise | rowwise | rowwise_with_gw_hp
    format: str = "e5m2"  # emulated: e5m2 (the paper's 1-5-2 everywhere) | hybrid (E4M3 fwd, E5M2 bwd)
    # emulated: loss (Mellempudi et al.: no per-tensor scales) | tensor (current scaling) | rowwise (a
    # power-of-two scale per row along each GEMM's reduction dim, as torchao's rowwise recipe)
    scaling: str = "loss"
    master_weights: str = "fp16"  # emulated: fp16 (Mellempudi et al.) | fp32
    stochastic_rounding: bool = True  # emulated: stochastic rounding of gradients and master weights
    emulated_compute: str = "fp32"  # emulated: dtype the quantized values are multiplied in
    # Layer-name patterns (fnmatch; a module's name covers the layers inside it), checked: each must
    # name a layer. keep_high: these stay high; only: only these are converted (keep_high wins).
    keep_high: list[str] = field(default_factory=list)
    only: list[str] = field(default_factory=list)


@dataclass
class MXPrecisionConfig(PrecisionConfig):
    """Emulated OCP MX / NVFP4 GEMMs (mptrain/numerics). A null option takes the format's recipe
    default: NVFP4's (arXiv 2509.25149) for nvfp4, the OCP spec's plain conversion for MX formats."""

    format: str = "mxfp8"  # mxfp8 | mxfp8_e5m2 | mxfp6 | mxfp6_e3m2 | mxfp4 | nvfp4
    stochastic_rounding: bool | None = None  # gradients (null: nvfp4 yes, MX no)
    hadamard: bool | None = None  # random Hadamard transform on both wgrad operands (null: nvfp4 yes)
    weight_2d_blocks: bool | None = None  # square weight tiles, 16x16 for nvfp4 (null: nvfp4 yes)
    keep_high: list[str] = field(default_factory=list)  # layer-name patterns kept high (see FP8PrecisionConfig)
    only: list[str] = field(default_factory=list)  # layer-name patterns: only these are converted
    keep_first: int = 0  # first GEMM layers kept high
    keep_last: int | None = None  # last GEMM layers kept high (null: nvfp4 the last 15%, MX none)
    pad_blocks: bool = True  # zero-pad reduction dims to the block; false: such layers stay high
    emulated_compute: str = "fp32"  # fp32 | bf16: dtype the quantized values are multiplied in
    # null | bf16: a bf16 autocast around the emulated GEMMs, for what they do not compute (the layers
    # kept high, attention, norms), as a real low-precision run does; null: all of that in FP32
    autocast: str | None = None
    seed: int = 0  # stochastic rounding and Hadamard signs (their own generators, not the global RNG)
    # CUDA only: inductor's combo kernels in each Linear layer's compiled graphs, which launch data-
    # independent kernels as one. Experimental in inductor and off until a GPU run measures it
    # (docs/benchmarks/README.md, "Combo kernels").
    graph_combo_kernels: bool = False
    # CUDA only: each Linear layer's graphs compiled for its own shapes, not with dynamic dims. Dynamic,
    # inductor passes sizes as int64 and every kernel divides element indices by them at run time
    # (pytorch#189940); static, by constants. More graphs to compile (one per layer shape), so off until
    # a GPU run measures it (docs/benchmarks/README.md, "Static shapes").
    graph_static_shapes: bool = False


# --------------------------------------------------------------------------------------------
# loss scaling


@dataclass
class LossScaleConfig:
    """none | auto (dynamic for fp16 compute, none otherwise)."""

    name: str = MISSING


@dataclass
class StaticLossScaleConfig(LossScaleConfig):
    scale: float = 128.0
    # steps (from 1) whose gradients count as overflowed: skipped, and the policy reacts (issue 27's
    # positive controls: a floor only shows what it prevents when overflows happen)
    inject_overflow: list[int] = field(default_factory=list)


@dataclass
class DynamicLossScaleConfig(LossScaleConfig):
    # Defaults are torch.amp.GradScaler's, and with them the trajectory equals GradScaler's.
    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    hysteresis: int = 1  # overflows tolerated before backing off (DeepSpeed's delayed shift)
    consecutive_hysteresis: bool = False  # refill the hysteresis budget after each clean step
    min_scale: float | None = None  # floor; see on_min_scale
    on_min_scale: str = "clamp"  # clamp | error (stop the run instead of collapsing silently)
    max_scale: float | None = None  # cap (Apex uses 2**24)
    inject_overflow: list[int] = field(default_factory=list)  # steps (from 1) treated as overflowed; see static


@dataclass
class EnhancedLossScaleConfig(DynamicLossScaleConfig):
    """Mellempudi et al.'s enhanced scaling: dynamic, with a floor that rises on a schedule."""

    # The paper's exact schedule could not be checked; these are config, not constants.
    min_scale_schedule: dict[str, float] = field(default_factory=lambda: {"0": 1.0})


@dataclass
class AdaptiveLossScaleConfig(LossScaleConfig):
    """Zhao et al. 2019: per-layer scales from gradient and weight statistics."""

    # The chain's first scale, at the model's outputs: auto (the largest that fits FP16 for the FP32
    # dL/d output, up to accum_cap) or a number (a fixed loss scale, the authors' setting was 1).
    init_scale: Any = "auto"
    u_min: float = 2.0**-24  # smallest positive value of the half format
    u_max: float = 65504.0  # largest value of the half format
    n_uf: float = 1e-3  # tolerated underflow probability per layer
    layer_cap: float = 16.0  # largest scale one layer may add
    accum_cap: float = 1024.0  # largest cumulative scale
    recompute_every: int = 1  # steps between recomputing the per-layer scales
    power_of_two: bool = True


# --------------------------------------------------------------------------------------------
# optimizer and schedule


@dataclass
class OptimConfig:
    name: str = MISSING
    lr: float = 0.1
    weight_decay: float = 1e-4
    no_decay_bn_bias: bool = True  # keep weight decay off batch-norm and bias parameters
    impl: str = "auto"  # auto | fused | foreach | for_loop (auto: fused on CUDA)


@dataclass
class SGDConfig(OptimConfig):
    lr: float = 0.0125  # 0.1 per 256 images (linear scaling), at the default batch of 32
    momentum: float = 0.9
    nesterov: bool = False


@dataclass
class AdamWConfig(OptimConfig):
    lr: float = 1e-3
    weight_decay: float = 0.05
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8


@dataclass
class SchedConfig:
    name: str = MISSING  # constant | step | cosine
    warmup_steps: int = 0  # linear warm-up from warmup_start_factor * lr
    warmup_start_factor: float = 0.01
    step_size: int = 30  # step: decay every step_size epochs...
    step_unit: str = "epoch"  # ...or steps (epoch | step)
    gamma: float = 0.1  # step: decay factor
    min_lr_ratio: float = 0.0  # cosine: final lr / base lr


# --------------------------------------------------------------------------------------------
# gradient telemetry (mptrain/numerics/telemetry.py)


@dataclass
class TelemetryConfig:
    """``telemetry.*``: what the gradient telemetry captures, and how often."""

    name: str = "off"  # off | gradients
    every: int = 50  # capture on steps divisible by this (K)
    activations: bool = True  # hooks on the gradients at hooked layers' outputs
    weights: bool = True  # the hooked layers' parameter gradients
    shadow: bool = False  # recompute the captured batch in FP32 and count what the run lost
    histogram: bool = True  # write log2|g| histograms to TensorBoard (the report uses them anyway)
    max_layers: int | None = 16  # layers hooked, evenly spaced, first and last always; null: all
    formats: list[str] = field(default_factory=lambda: ["auto"])  # auto | fp16 | bf16 | e5m2 | e4m3
    max_underflow: float = 0.01  # at risk above this underflow/lost fraction; also the report's p
    margin_bits: float = 1.0  # at risk below this headroom; the suggested scale keeps it
    # Block formats measured on the hooked layers' activations, weights and gradients (flushed and
    # saturated fractions, SNR, block-scale exponents), in any precision; precision=mx adds its own.
    compare_formats: list[str] = field(default_factory=list)  # mxfp8 | mxfp8_e5m2 | mxfp6 | ... | nvfp4


TELEMETRY_FORMATS = ("auto", "fp16", "bf16", "e5m2", "e4m3")


def check_telemetry(cfg: Any) -> None:
    """Value checks for ``telemetry.*``. Raises MptrainError."""
    check(cfg.name in ("off", "gradients"), f"telemetry.name={cfg.name!r}: must be one of off, gradients")
    check(cfg.every >= 1, f"telemetry.every={cfg.every}: must be an integer >= 1")
    check(
        cfg.max_layers is None or cfg.max_layers >= 2,
        f"telemetry.max_layers={cfg.max_layers}: must be >= 2 (first and last layer) or null",
    )
    check(len(cfg.formats) > 0, "telemetry.formats: name at least one format (auto, fp16, bf16, e5m2, e4m3)")
    for f in cfg.formats:
        check(f in TELEMETRY_FORMATS, f"telemetry.formats: {f!r} must be one of {', '.join(TELEMETRY_FORMATS)}")
    check(0 <= cfg.max_underflow < 1, f"telemetry.max_underflow={cfg.max_underflow}: must be in [0, 1)")
    check(cfg.margin_bits >= 0, f"telemetry.margin_bits={cfg.margin_bits}: must be >= 0")
    for f in cfg.compare_formats:
        check(f in MX_FORMATS, f"telemetry.compare_formats: {f!r} must be one of {', '.join(MX_FORMATS)}")
    check(
        cfg.name != "off" or not cfg.compare_formats,
        "telemetry.compare_formats needs telemetry=gradients (it measures on the telemetry's sampled steps)",
    )


# --------------------------------------------------------------------------------------------
# parallelism (mptrain/parallel.py)


@dataclass
class ParallelConfig:
    """``parallel=ddp`` (the default): under torchrun or SLURM every rank holds the whole model,
    its gradients and its optimizer state (DistributedDataParallel)."""

    name: str = MISSING  # ddp | fsdp2


@dataclass
class FSDP2Config(ParallelConfig):
    """``parallel=fsdp2``: parameters, gradients and optimizer state sharded over the ranks
    (torch.distributed.fsdp.fully_shard), checkpoints written by every rank (DCP)."""

    reshard_after_forward: bool = True  # free the gathered weights after each unit's forward (ZeRO-3)
    # Modules that become their own FSDP unit, then the root: [auto] is the model's default (an HF model's
    # decoder layers, every transformer block, ResNet bottleneck, Inception block, the LSTM, else a zoo
    # model's top-level stages); else module-name patterns (fnmatch per dotted segment: blocks.* is each
    # block), each of which must match a module
    shard_modules: list[str] = field(default_factory=lambda: ["auto"])
    replicate: int = 1  # the mesh: (replicate, shard) with shard = world size / replicate; > 1 is HSDP


PARALLELS = ("ddp", "fsdp2")


# --------------------------------------------------------------------------------------------
# trainer and the whole config


@dataclass
class TrainerConfig:
    max_steps: int | None = None  # null: epochs * steps per epoch
    epochs: int = 1
    log_every: int = 10
    eval_every: int | None = None  # steps between evaluations; null: at the end of each epoch
    checkpoint_every: int | None = None  # steps between checkpoints; null: at the end only
    keep_checkpoints: int = 2
    seed: int = 0
    device: str = "auto"  # auto | cpu | cuda
    resume: str | None = "auto"  # null | auto (this run dir's latest, if any) | PATH (a file or run dir)
    grad_clip: float | None = None  # max global norm, applied to unscaled gradients
    grad_accum: int = 1  # micro-batches per optimizer step
    channels_last: bool = False
    compile: bool = False
    compile_mode: str = "default"  # default | reduce-overhead | max-autotune
    cudnn_benchmark: bool = True
    precision_plan: bool = True  # one forward pass before training: each GEMM layer's format, reason and FLOPs
    precision_plan_layers: bool = False  # print one row per layer (default: layers alike share a row)
    deterministic: bool = False  # deterministic kernels only (cuDNN, cuBLAS, scatter): for exact reruns
    max_nonfinite_steps: int = 50  # consecutive non-finite losses before the run is stopped
    warmup_windows: int = 1  # logging windows left out of the throughput median
    gc_every: int = 50  # steps between Python GC passes (generation 1) with automatic GC off; 0: automatic
    keep_host_memory: bool = True  # glibc keeps freed memory for the next step (memory.keep_freed_host_memory)


@dataclass
class Config:
    model: Any = MISSING
    data: DataConfig = MISSING
    precision: Any = MISSING
    loss_scale: Any = MISSING
    optim: Any = MISSING
    sched: SchedConfig = MISSING
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    telemetry: TelemetryConfig = MISSING
    parallel: Any = MISSING
    run_name: str = "${model.name}-${precision.name}"


SCHEMAS: dict[str, dict[str, type]] = {
    "model": {
        "classifier": ClassifierModelConfig,
        "custom": CustomModelConfig,
        "hf_causal_lm": HFCausalLMConfig,
        "language_model": LanguageModelConfig,
        "transformer_lm": TransformerLMConfig,
        "dcgan": DCGANConfig,
    },
    "precision": {
        "base": PrecisionConfig, "bf16_pure": BF16PureConfig, "fp8": FP8PrecisionConfig, "mx": MXPrecisionConfig,
    },
    "loss_scale": {
        "base": LossScaleConfig,
        "static": StaticLossScaleConfig,
        "dynamic": DynamicLossScaleConfig,
        "enhanced": EnhancedLossScaleConfig,
        "adaptive": AdaptiveLossScaleConfig,
    },
    "optim": {"sgd": SGDConfig, "adamw": AdamWConfig},
    "data": {"base": DataConfig, "custom": CustomDataConfig},
    "sched": {"base": SchedConfig},
    "telemetry": {"base": TelemetryConfig},
    "parallel": {"ddp": ParallelConfig, "fsdp2": FSDP2Config},
}


def _run_stamp() -> str:
    """The run directory's time stamp. Every rank of a torchrun or SLURM job must land in the same
    directory, and ranks start at slightly different times: there, use the job's id instead."""
    for var in ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID"):
        value = os.environ.get(var, "none")
        if value != "none":
            return f"{time.strftime('%Y-%m-%d')}_{value[:12]}"
    return time.strftime("%Y-%m-%d_%H-%M-%S")


def register_configs() -> None:
    """Store the schemas so that YAML files can name them in their defaults lists."""
    if not OmegaConf.has_resolver("mptrain_stamp"):
        OmegaConf.register_new_resolver("mptrain_stamp", _run_stamp, use_cache=True)
    cs = ConfigStore.instance()
    cs.store(name="mptrain_schema", node=Config)
    for group, schemas in SCHEMAS.items():
        for name, node in schemas.items():
            cs.store(group=f"schema/{group}", name=name, node=node)


# --------------------------------------------------------------------------------------------
# value checks

PRECISIONS = ("fp32", "tf32", "amp_fp16", "amp_bf16", "mixed", "fp16_master", "bf16_pure", "fp8", "mx")
MX_FORMATS = ("mxfp8", "mxfp8_e5m2", "mxfp6", "mxfp6_e3m2", "mxfp4", "nvfp4")
LOSS_SCALES = ("none", "auto", "static", "dynamic", "enhanced", "adaptive")


def _positive(value: float | None, key: str, *, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    check(
        value is not None and math.isfinite(value) and value > 0,
        f"{key}={value}: must be a number > 0",
    )


def _at_least(value: int | None, low: int, key: str, *, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    check(value is not None and value >= low, f"{key}={value}: must be an integer >= {low}")


def _one_of(value: str, allowed: tuple[str, ...], key: str) -> None:
    check(value in allowed, f"{key}={value!r}: must be one of {', '.join(allowed)}")


def validate(cfg: DictConfig) -> None:
    """Check values that types alone cannot (ranges, choices, paths). Raises MptrainError.

    Reads every group; run before any model, data or device work.
    """
    t = cfg.trainer
    _at_least(t.max_steps, 1, "trainer.max_steps", allow_none=True)
    _at_least(t.epochs, 1, "trainer.epochs")
    _at_least(t.log_every, 1, "trainer.log_every")
    _at_least(t.eval_every, 1, "trainer.eval_every", allow_none=True)
    _at_least(t.checkpoint_every, 1, "trainer.checkpoint_every", allow_none=True)
    _at_least(t.keep_checkpoints, 1, "trainer.keep_checkpoints")
    _at_least(t.grad_accum, 1, "trainer.grad_accum")
    _at_least(t.max_nonfinite_steps, 1, "trainer.max_nonfinite_steps")
    _at_least(t.warmup_windows, 0, "trainer.warmup_windows")
    _at_least(t.gc_every, 0, "trainer.gc_every")
    _positive(t.grad_clip, "trainer.grad_clip", allow_none=True)
    _one_of(t.device, ("auto", "cpu", "cuda"), "trainer.device")
    _one_of(t.compile_mode, ("default", "reduce-overhead", "max-autotune"), "trainer.compile_mode")

    d = cfg.data
    _at_least(d.batch_size, 1, "data.batch_size")
    _at_least(d.val_batch_size, 1, "data.val_batch_size", allow_none=True)
    _at_least(d.num_workers, 0, "data.num_workers")
    _at_least(d.image_size, 8, "data.image_size", allow_none=True)
    _at_least(d.num_classes, 2, "data.num_classes", allow_none=True)
    _at_least(d.train_samples, 1, "data.train_samples")
    _at_least(d.val_samples, 1, "data.val_samples")
    check(d.pattern_scale > 0, f"data.pattern_scale={d.pattern_scale}: must be > 0")
    _at_least(d.max_val_batches, 1, "data.max_val_batches", allow_none=True)
    check(0 < d.val_fraction < 1, f"data.val_fraction={d.val_fraction}: must be between 0 and 1")
    _one_of(d.decode, ("cpu", "gpu", "pil"), "data.decode")
    check(d.decode == "cpu" or d.name == "image_folder",
          f"data.decode={d.decode}: only data=image_folder decodes image files (leave data.decode=cpu)")
    if d.root is not None and d.name in ("image_folder", "cifar10", "text_corpus"):
        root = Path(d.root).expanduser()
        check(root.is_dir(), f"data.root={d.root}: no such directory")
        check(any(root.iterdir()), f"data.root={d.root}: the directory is empty")
    elif d.name in ("image_folder", "cifar10", "text_corpus"):
        raise MptrainError(f"data={d.name} needs data.root=PATH (the dataset directory)")
    if d.name == "custom":
        check(not OmegaConf.is_missing(d, "_target_"),
              "data=custom needs data._target_=package.module.callable (it returns the (train, val) datasets)")
        from mptrain.data.custom import check_custom_data

        check_custom_data(cfg)

    m = cfg.model
    from mptrain.models import check_config  # the model's own checks: an arch, a _target_, an extra

    check_config(m)
    if m.get("task") == "classification":
        _at_least(m.get("width_divisor", 1), 1, "model.width_divisor")
        _at_least(m.num_classes, 2, "model.num_classes", allow_none=True)
        for key in ("image_size", "cpu_image_size"):
            _at_least(m.get(key), 8, f"model.{key}", allow_none=True)
        if m.get("dropout") is not None:
            check(0 <= m.dropout < 1, f"model.dropout={m.dropout}: must be in [0, 1)")
        if d.image_size is not None and m.get("min_image_size") is not None:
            check(
                d.image_size >= m.min_image_size,
                f"data.image_size={d.image_size}: model={m.name} needs at least {m.min_image_size} px",
            )
    if m.get("init_from"):
        check(Path(str(m.init_from)).expanduser().exists(), f"model.init_from={m.init_from}: no such file or directory")

    o = cfg.optim
    _positive(o.lr, "optim.lr")
    check(o.weight_decay >= 0, f"optim.weight_decay={o.weight_decay}: must be >= 0")
    _one_of(o.impl, ("auto", "fused", "foreach", "for_loop"), "optim.impl")
    if o.name == "sgd":
        check(0 <= o.momentum < 1, f"optim.momentum={o.momentum}: must be in [0, 1)")
        check(not o.nesterov or o.momentum > 0, "optim.nesterov=true needs optim.momentum > 0")
    if o.name == "adamw":
        check(
            len(o.betas) == 2 and all(0 <= b < 1 for b in o.betas),
            f"optim.betas={list(o.betas)}: must be two numbers in [0, 1)",
        )
        _positive(o.eps, "optim.eps")

    s = cfg.sched
    _one_of(s.name, ("constant", "step", "cosine"), "sched.name")
    _at_least(s.warmup_steps, 0, "sched.warmup_steps")
    _positive(s.warmup_start_factor, "sched.warmup_start_factor")
    _at_least(s.step_size, 1, "sched.step_size")
    _one_of(s.step_unit, ("epoch", "step"), "sched.step_unit")
    _positive(s.gamma, "sched.gamma")
    check(0 <= s.min_lr_ratio <= 1, f"sched.min_lr_ratio={s.min_lr_ratio}: must be in [0, 1]")

    p = cfg.precision
    _one_of(p.name, PRECISIONS, "precision.name")
    if p.name == "fp8":
        _one_of(p.backend, ("emulated", "torchao"), "precision.backend")
        _one_of(p.recipe, ("tensorwise", "rowwise", "rowwise_with_gw_hp"), "precision.recipe")
        _one_of(p.format, ("e5m2", "hybrid"), "precision.format")
        _one_of(p.scaling, ("loss", "tensor", "rowwise"), "precision.scaling")
        _one_of(p.master_weights, ("fp16", "fp32"), "precision.master_weights")
        _one_of(p.emulated_compute, ("fp32", "bf16"), "precision.emulated_compute")
    if p.name == "mx":
        _one_of(p.format, MX_FORMATS, "precision.format")
        _one_of(p.emulated_compute, ("fp32", "bf16"), "precision.emulated_compute")
        check(p.autocast in (None, "bf16"), f"precision.autocast={p.autocast!r}: must be null or bf16")
        _at_least(p.keep_first, 0, "precision.keep_first")
        _at_least(p.keep_last, 0, "precision.keep_last", allow_none=True)
        _at_least(p.seed, 0, "precision.seed")
    if p.name in ("mx", "fp8"):
        for key in ("keep_high", "only"):
            for pattern in p[key]:
                check(bool(pattern), f"precision.{key}: an empty pattern; give layer names or fnmatch patterns")

    ls = cfg.loss_scale
    _one_of(ls.name, LOSS_SCALES, "loss_scale.name")
    if ls.name == "static":
        _positive(ls.scale, "loss_scale.scale")
    if ls.name in ("dynamic", "enhanced"):
        _positive(ls.init_scale, "loss_scale.init_scale")
        check(ls.growth_factor > 1, f"loss_scale.growth_factor={ls.growth_factor}: must be > 1")
        check(
            0 < ls.backoff_factor < 1,
            f"loss_scale.backoff_factor={ls.backoff_factor}: must be between 0 and 1",
        )
        _at_least(ls.growth_interval, 1, "loss_scale.growth_interval")
        _at_least(ls.hysteresis, 1, "loss_scale.hysteresis")
        _positive(ls.min_scale, "loss_scale.min_scale", allow_none=True)
        _positive(ls.max_scale, "loss_scale.max_scale", allow_none=True)
        _one_of(ls.on_min_scale, ("clamp", "error"), "loss_scale.on_min_scale")
        if ls.min_scale is not None and ls.max_scale is not None:
            check(
                ls.min_scale <= ls.max_scale,
                f"loss_scale.min_scale={ls.min_scale} is above loss_scale.max_scale={ls.max_scale}",
            )
    if ls.name in ("static", "dynamic", "enhanced"):
        for step in ls.inject_overflow:
            check(isinstance(step, int) and not isinstance(step, bool) and step >= 1,
                  f"loss_scale.inject_overflow: {step!r} is not a step number (>= 1, as the logs count steps)")
    if ls.name == "enhanced":
        for step, floor in ls.min_scale_schedule.items():
            check(
                str(step).isdigit(),
                f"loss_scale.min_scale_schedule key {step!r}: must be a step number (>= 0)",
            )
            _positive(floor, f"loss_scale.min_scale_schedule[{step}]")
    check_telemetry(cfg.telemetry)
    if ls.name == "adaptive":
        if ls.init_scale != "auto":
            check(
                isinstance(ls.init_scale, (int, float)) and not isinstance(ls.init_scale, bool) and ls.init_scale > 0,
                f"loss_scale.init_scale={ls.init_scale!r}: must be a positive number or auto",
            )
        _positive(ls.u_min, "loss_scale.u_min")
        _positive(ls.u_max, "loss_scale.u_max")
        check(0 < ls.n_uf < 1, f"loss_scale.n_uf={ls.n_uf}: must be between 0 and 1")
        check(ls.layer_cap >= 1, f"loss_scale.layer_cap={ls.layer_cap}: must be >= 1")
        check(ls.accum_cap >= 1, f"loss_scale.accum_cap={ls.accum_cap}: must be >= 1")
        _at_least(ls.recompute_every, 1, "loss_scale.recompute_every")
    if t.compile:
        _check_compile(cfg)
    _validate_family(cfg)
    _validate_parallel(cfg)


def _validate_parallel(cfg: DictConfig) -> None:
    """``parallel.*``, and what FSDP2 cannot shard (one line each, saying why)."""
    par = cfg.get("parallel")
    if par is None:  # a config composed before the group existed
        return
    _one_of(par.name, PARALLELS, "parallel.name")
    if par.name != "fsdp2":
        return
    _at_least(par.replicate, 1, "parallel.replicate")
    check(len(par.shard_modules) > 0 and all(bool(p) for p in par.shard_modules),
          "parallel.shard_modules: name module patterns (e.g. [blocks.*], each block) or [auto]")
    check(cfg.loss_scale.name != "adaptive",
          "loss_scale=adaptive with parallel=fsdp2: its per-layer scales are computed in backward hooks of an "
          "fx-traced copy of the model from each layer's whole weight and gradient, and FSDP2 holds only shards "
          "outside its own hooks; use dynamic or static, or parallel=ddp")
    check(cfg.telemetry.name == "off",
          "telemetry=gradients with parallel=fsdp2: its per-layer statistics read every weight gradient whole, and "
          "under FSDP2 each rank holds a shard of each; run the telemetry under parallel=ddp (same numerics)")
    check(not cfg.trainer.compile,
          "trainer.compile=true with parallel=fsdp2: not supported yet (compiling around fully_shard's hooks is "
          "untested here); use trainer.compile=false, or parallel=ddp")
    check(cfg.model.get("task", "classification") != "gan",
          f"parallel=fsdp2 with model={cfg.model.name}: the generator's step runs the discriminator's forward and "
          "backward outside the discriminator's own step, which fails under FSDP2 here; use parallel=ddp")


def _check_compile(cfg: DictConfig) -> None:
    """``trainer.compile=true`` only where the whole model compiles into graphs; elsewhere dynamo
    would split it at every scaling or quantizing site and run slower than eager, silently."""
    p, ls = cfg.precision, cfg.loss_scale
    if p.name == "fp8" and p.backend == "emulated":
        raise MptrainError(
            "trainer.compile=true with precision=fp8 precision.backend=emulated: whole-model compile graph-breaks at "
            "every quantized layer's autograd function and generator; the quantizers are compiled on their own "
            "(leave trainer.compile=false)"
        )
    if ls.name == "adaptive":
        raise MptrainError(
            "trainer.compile=true with loss_scale=adaptive: its per-layer scales are set by backward hooks on "
            "an fx-traced graph, where whole-model compile graph-breaks at every Conv/Linear layer and join "
            "(leave trainer.compile=false)"
        )


# --------------------------------------------------------------------------------------------
# model families beyond classification: the combinations each one supports

IMAGE_DATASETS = ("synthetic", "image_folder", "cifar10", "digits")
TEXT_DATASETS = ("synthetic_text", "text_corpus", "python_docs")
TASKS = ("classification", "language_model", "gan")


def _validate_family(cfg: DictConfig) -> None:
    """Checks that depend on ``model.task``: its own keys, and the data, precision and loss-scale
    combinations that make no sense (or are not supported) for it. One line each."""
    m, d = cfg.model, cfg.data
    task = m.get("task", "classification")
    _one_of(task, TASKS, "model.task")
    if task == "classification":
        check(
            d.name not in TEXT_DATASETS,
            f"data={d.name} is text; model={m.name} needs images: {', '.join(IMAGE_DATASETS)}, custom",
        )
    elif task == "language_model":
        _validate_language_model(cfg)
    elif task == "gan":
        _validate_gan(cfg)


def _validate_language_model(cfg: DictConfig) -> None:
    m, d = cfg.model, cfg.data
    check(
        d.name in (*TEXT_DATASETS, "custom"),
        f"data={d.name}: model={m.name} needs text data: {', '.join(TEXT_DATASETS)}, custom",
    )
    _at_least(d.bptt, 1, "data.bptt")
    _at_least(d.vocab_size, 3, "data.vocab_size", allow_none=True)  # <unk>, <eos> and one word
    if d.name == "synthetic_text":
        check(d.vocab_size is not None, "data=synthetic_text needs data.vocab_size (e.g. 10000)")
        _at_least(d.train_tokens, 2, "data.train_tokens")
        _at_least(d.val_tokens, 2, "data.val_tokens")
        _one_of(d.text_pattern, ("phrases", "uniform"), "data.text_pattern")
    if m.get("route") in ("hf_causal_lm", "custom"):  # the model's own config: checked where it is built
        return
    arch = m.get("arch", "lstm")
    _one_of(arch, LM_ARCHS, "model.arch")
    check(0 <= m.dropout < 1, f"model.dropout={m.dropout}: must be in [0, 1)")
    if arch == "transformer":
        _validate_transformer_lm(cfg)
    else:
        _validate_lstm_lm(cfg)


LM_ARCHS = ("lstm", "transformer")


def _validate_lstm_lm(cfg: DictConfig) -> None:
    m = cfg.model
    check(cfg.data.name != "custom",
          f"data=custom with model={m.name}: the LSTM carries its state from batch to batch along one token stream "
          "(truncated BPTT), and a custom dataset's items are independent sequences; use a transformer, "
          "model=hf_causal_lm or model=custom, or data=text_corpus")
    for key in ("emb_size", "hidden_size", "num_layers"):
        _at_least(m[key], 1, f"model.{key}")
    _at_least(m.proj_size, 0, "model.proj_size")
    check(
        m.proj_size < m.hidden_size,
        f"model.proj_size={m.proj_size}: must be below model.hidden_size={m.hidden_size} (0 disables it)",
    )
    _positive(m.init_range, "model.init_range")
    out = m.proj_size or m.hidden_size
    # An explicit choice that cannot hold is an error rather than a silent untie.
    check(
        not m.tie_weights or m.emb_size == out,
        f"model.tie_weights=true needs model.emb_size ({m.emb_size}) == the LSTM output size ({out}, "
        "model.proj_size or model.hidden_size); set them equal or model.tie_weights=false",
    )
    if cfg.precision.name in ("fp8", "mx"):
        raise MptrainError(
            f"precision={cfg.precision.name} with model={m.name}: {cfg.precision.name.upper()} converts "
            "nn.Linear/Conv layers only, so the LSTM's gate matmuls would silently stay in higher precision; "
            "use amp_fp16, amp_bf16 or fp16_master"
        )
    if cfg.loss_scale.name == "adaptive":
        raise MptrainError(
            f"loss_scale=adaptive with model={m.name}: per-layer scales need a torch.fx graph of Conv/Linear "
            "layers, and an nn.LSTM carrying its state across batches is neither; use dynamic or static "
            "(bigLSTM used static 128)"
        )


def _validate_transformer_lm(cfg: DictConfig) -> None:
    """Every GEMM is an nn.Linear and the graph traces, so FP8 and adaptive scaling are allowed,
    except adaptive with a tied head (see below)."""
    m, d = cfg.model, cfg.data
    for key in ("d_model", "num_layers", "num_heads", "block_size"):
        _at_least(m[key], 1, f"model.{key}")
    check(
        m.d_model % m.num_heads == 0,
        f"model.d_model={m.d_model}: must be divisible by model.num_heads={m.num_heads}",
    )
    _positive(m.init_std, "model.init_std")
    # Each batch row is one context: it cannot be longer than the position embeddings.
    check(
        d.bptt <= m.block_size,
        f"data.bptt={d.bptt}: longer than model.block_size={m.block_size}, the transformer's context "
        f"length; use data.bptt <= {m.block_size} or a larger model.block_size",
    )
    if cfg.loss_scale.name == "adaptive" and m.tie_weights:
        raise MptrainError(
            f"loss_scale=adaptive with model={m.name} and model.tie_weights=true: the tied weight gets gradient "
            "from the embedding and from lm_head, which carry different per-layer scales, and one gradient "
            "cannot be unscaled by two; set model.tie_weights=false, or use dynamic or static"
        )


def _validate_gan(cfg: DictConfig) -> None:
    m, d = cfg.model, cfg.data
    check(
        d.name in IMAGE_DATASETS,
        f"data={d.name}: model={m.name} needs images: {', '.join(IMAGE_DATASETS)}",
    )
    for key in ("nz", "ngf", "ndf", "sample_every", "num_samples"):
        _at_least(m[key], 1, f"model.{key}")
    sizes = {"model.image_size": m.image_size, "model.cpu_image_size": m.cpu_image_size}
    if d.image_size is not None:
        sizes["data.image_size"] = d.image_size
    for key, size in sizes.items():
        # The generator doubles a 4x4 map until it reaches the image size.
        check(
            size >= 8 and size & (size - 1) == 0,
            f"{key}={size}: model={m.name} needs a power of two >= 8 (e.g. 32 or 64)",
        )
    if cfg.loss_scale.name == "adaptive":
        raise MptrainError(
            f"loss_scale=adaptive with model={m.name}: the generator's loss backpropagates through the "
            "discriminator, whose per-layer scales belong to the discriminator's own loss; use dynamic or static"
        )
