"""The ``mptrain`` command: compose the config, check it, build the run, train. Nothing else.

    mptrain model=resnet50 precision=mixed
    mptrain -m model=resnet50,vgg16 precision=fp32,mixed      # a sweep (Hydra multirun)

Bad input gets one line on stderr (``mptrain: error: ...``) and exit status 2, no traceback; a run
that diverges (non-finite loss) gets ``mptrain: diverged: ...`` and exit status 3.
"""

from __future__ import annotations

import logging
import re
import sys
from importlib import resources
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from mptrain.config import register_configs, validate
from mptrain.errors import DivergedError, MptrainError

CONFIG_MODULE = "mptrain.configs"
GROUPS = ("model", "data", "precision", "loss_scale", "optim", "sched", "telemetry", "parallel")
log = logging.getLogger("mptrain")


def fail(message: str) -> None:
    print(f"mptrain: error: {message}", file=sys.stderr)
    sys.exit(2)


# ------------------------------------------------------------------------------------ entry


@hydra.main(version_base="1.3", config_path=f"pkg://{CONFIG_MODULE}", config_name="config")
def _run(cfg: DictConfig) -> float | None:
    from mptrain.engine import Interrupted  # torch: only once the config is known to be good
    from mptrain.run import train

    multirun = HydraConfig.get().mode.name == "MULTIRUN"
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    try:
        validate(cfg)
        summary = train(cfg, run_dir)
    except Interrupted as exc:
        print(
            f"mptrain: {exc}; checkpoint saved. Resume with: hydra.run.dir={run_dir} trainer.resume=auto",
            file=sys.stderr,
        )
        if multirun:
            return None
        sys.exit(128 + exc.signum)
    except DivergedError as exc:
        # Not bad input: the run itself failed. Its own status (3), so scripts can tell the two apart.
        if multirun:
            log.error("mptrain: diverged: %s", exc)
            return None
        print(f"mptrain: diverged: {exc}", file=sys.stderr)
        sys.exit(3)
    except MptrainError as exc:
        if multirun:  # one bad job must not end the sweep; its summary.json says why
            log.error("mptrain: error: %s", exc)
            return None
        fail(str(exc))
        return None
    value = summary.get("metrics", {}).get(summary.get("primary_metric", ""))
    return value if isinstance(value, float) else None


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    register_configs()
    if any(a in ("-h", "--help") for a in args):
        print(help_text())
        return
    if not any(a in ("-m", "--multirun") or a.startswith("--") for a in args):
        try:
            validate(compose(args))
        except MptrainError as exc:
            fail(str(exc))
    sys.argv = [sys.argv[0], *args]
    _run()


# ------------------------------------------------------------------------------------ checks


def compose(overrides: list[str]) -> DictConfig:
    """Compose the config as Hydra will, turning composition errors into one-line MptrainErrors."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_module

    user = [o for o in overrides if not o.lstrip("+~").startswith("hydra")]
    with initialize_config_module(CONFIG_MODULE, version_base="1.3"):
        try:
            return hydra_compose("config", overrides=user)
        except Exception as exc:
            raise MptrainError(_explain(exc, user)) from exc


def _explain(exc: Exception, overrides: list[str]) -> str:
    from hydra import compose as hydra_compose
    from hydra.errors import MissingConfigException, OverrideParseException

    msg = str(exc)
    if isinstance(exc, MissingConfigException) or "Could not find" in msg:
        m = re.search(r"Could not find '([^/']+)/([^']+)'", msg)
        if m:
            group, name = m.groups()
            return f"{group}={name}: unknown choice; {group} is one of: {', '.join(choices(group))}"
        m = re.search(r"Could not load '([^/']+)/([^']+)'", msg)
        if m:
            group, name = m.groups()
            return f"{group}={name}: unknown choice; {group} is one of: {', '.join(choices(group))}"
    if isinstance(exc, OverrideParseException):
        return f"cannot parse the override: {msg.strip().splitlines()[0]}"
    m = re.search(r"Could not (?:override|append to) '([^']+)'", msg)
    if m:
        key = m.group(1)
        parent = key.rpartition(".")[0]
        rest = [o for o in overrides if not o.lstrip("+~").startswith(key + "=")]
        try:
            base = hydra_compose("config", overrides=rest)
            node = OmegaConf.select(base, parent) if parent else base
            keys = ", ".join(str(k) for k in node) if isinstance(node, DictConfig) else ""
        except Exception:
            keys = ""
        where = parent or "the top level"
        return f"{key}: unknown option{f'; {where} has: {keys}' if keys else ''}"
    cause = exc.__cause__
    if cause is not None and hasattr(cause, "full_key"):
        key = cause.full_key
        value = next((o.split("=", 1)[1] for o in overrides if o.split("=", 1)[0].lstrip("+~") == key), None)
        reason = str(cause).strip().splitlines()[0]
        m = re.search(r"could not be converted to (\w+)", reason)
        if m:
            reason = f"must be of type {m.group(1).lower()}"
        return f"{key}={value}: {reason}" if value is not None else f"{key}: {reason}"
    lines = [line.strip() for line in msg.splitlines() if line.strip()]
    return "; ".join(lines[:2]) if lines else type(exc).__name__


# ------------------------------------------------------------------------------------ help


def choices(group: str) -> list[str]:
    folder = resources.files(CONFIG_MODULE).joinpath(group)
    return sorted(p.name[:-5] for p in folder.iterdir() if p.name.endswith(".yaml"))


def help_text() -> str:
    defaults = {}
    text = resources.files(CONFIG_MODULE).joinpath("config.yaml").read_text()
    for group, name in re.findall(r"^\s*-\s*(\w+):\s*\"?(\w+)\"?\s*$", text, flags=re.M):
        defaults[group] = name
    lines = [
        "mptrain: mixed-precision training, one config switch away.",
        "",
        "usage: mptrain [group=choice ...] [key=value ...]",
        "       mptrain model=resnet50 precision=mixed",
        "       mptrain -m model=resnet50,vgg16 precision=fp32,mixed     (a sweep; Hydra multirun)",
        "",
        "config groups (* = default):",
    ]
    for group in GROUPS:
        names = [f"{n}*" if n == defaults.get(group) else n for n in choices(group)]
        lines.append(f"  {group:<11} {', '.join(names)}")
    lines += [
        "",
        "bring your own model (README, \"Bring your own model\"):",
        "  model=torchvision model.arch=NAME [model.kwargs={...}]     any torchvision classifier (weights=None)",
        "  model=timm model.arch=NAME [model.kwargs={...}]            any timm model (pretrained=False; [timm])",
        "  model=hf_causal_lm model.model_type=TYPE model.config={}   a transformers causal LM from a config ([hf])",
        "  model=custom model._target_=pkg.module.callable            your nn.Module (model.task=language_model: LM)",
        "  data=custom data._target_=pkg.module.callable              your (train, val) datasets",
        "  model.init_from=PATH                                       start from a local state dict or checkpoint",
    ]
    cfg = compose([])
    lines += ["", "keys (key=value; the chosen group's keys shown for the defaults):"]
    for section in ("trainer", "data", "optim", "sched", "loss_scale", "model"):
        node = cfg[section]
        items = " ".join(f"{k}={OmegaConf.to_container(node, resolve=False)[k]}" for k in node)
        lines.append(f"  {section}: {items}")
    lines += [
        "",
        "Each run writes runs/<model>-<precision>/<time>/: config, train.log, TensorBoard events,",
        "checkpoints/ and summary.json. `tensorboard --logdir runs` compares them.",
        "Hydra's own flags: mptrain --hydra-help",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
