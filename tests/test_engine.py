"""The one engine, through the real Hydra composition: every model and precision, the
summary.json contract, TensorBoard tags, exact resume, divergence handling."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import TINY_MODEL, run_cli, run_job, tiny
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from mptrain import checkpoint
from mptrain.errors import DivergedError, MptrainError
from mptrain.hardware import device_capability

SUMMARY_KEYS = {
    "status", "model", "data", "precision", "precision_resolved", "loss_scale", "device", "world_size",
    "steps", "final_loss", "metrics", "throughput", "peak_memory_bytes", "skipped_steps", "device_capability",
    "final_loss_scale", "wall_time_s", "versions", "compile_time_s", "cudagraph_skips",
}


def scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


@pytest.mark.parametrize("precision", ["fp32", "amp_bf16", "amp_fp16"])
@pytest.mark.parametrize("model", sorted(TINY_MODEL))  # the five presets over the torchvision route
def test_every_model_trains_in_every_basic_precision(tmp_path, model, precision):
    s = run_job(tmp_path, *tiny(model, f"precision={precision}", "trainer.max_steps=2"))
    assert s["status"] == "completed" and s["steps"] == 2
    assert math.isfinite(s["final_loss"])
    assert 0 <= s["metrics"]["top1"] <= 100 and s["metrics"]["top5"] >= s["metrics"]["top1"]
    # amp_fp16 is paired with dynamic scaling by loss_scale=auto; the others need none.
    assert s["loss_scale"] == ("dynamic" if precision == "amp_fp16" else "none")


def test_compile_time_stays_out_of_throughput(tmp_path, monkeypatch):
    """A window's torch.compile time is not training time: were every second of it compiling,
    the rate would be far above the window's samples over its wall time."""
    import time

    from mptrain.numerics import fused

    base = tiny("resnet50", "trainer.max_steps=4", "trainer.log_every=2", "trainer.warmup_windows=0")
    honest = run_job(tmp_path / "honest", *base)
    monkeypatch.setattr(fused, "compile_seconds", time.perf_counter)  # as if the whole run compiled
    compiling = run_job(tmp_path / "compiling", *base)
    assert compiling["throughput"] > 100 * honest["throughput"]
    assert compiling["compile_time_s"] > 0 and honest["compile_time_s"] == 0


def test_summary_contract_and_tensorboard_tags(tmp_path):
    s = run_job(tmp_path, *tiny("resnet50", "precision=amp_fp16", "trainer.max_steps=4"))
    assert s.keys() >= SUMMARY_KEYS
    assert s["precision_resolved"] == "amp_fp16" and s["device"] == "cpu" and s["world_size"] == 1
    assert s["peak_memory_bytes"] is None  # CPU
    assert s["final_loss_scale"] in (2.0**16, 2.0**15, 2.0**14, 2.0**13, 2.0**12)
    assert s["versions"]["torch"] == torch.__version__
    assert s["throughput"] > 0
    tags = scalars(tmp_path)
    for tag in ("train/loss", "train/lr", "train/loss_scale", "train/skipped_steps", "train/throughput",
                "train/step_time", "train/overflow", "val/top1", "val/top5"):
        assert tag in tags, tag
    # Loss and scale are logged for every step, though read back once per logging window.
    assert [step for step, _ in tags["train/loss"]] == [1, 2, 3, 4]
    assert tags["train/loss"][-1][1] == pytest.approx(s["final_loss"])
    assert tags["train/loss_scale"][-1][1] == s["final_loss_scale"]
    assert tags["train/skipped_steps"][-1][1] == s["skipped_steps"]
    # The HParams plugin's own record (what TensorBoard's HParams tab reads) carries the run's choices.
    from tensorboard.plugins.hparams import plugin_data_pb2

    acc = EventAccumulator(str(tmp_path))
    acc.Reload()
    content = acc.PluginTagToContent("hparams")
    records = [plugin_data_pb2.HParamsPluginData.FromString(c) for c in content.values()]
    start = [r.session_start_info for r in records if r.HasField("session_start_info")]
    assert len(start) == 1
    hp = {k: v.ListFields()[0][1] for k, v in start[0].hparams.items()}
    assert hp["model"] == "resnet50" and hp["precision"] == "amp_fp16" and hp["loss_scale"] == "dynamic"
    assert hp["batch_size"] == 4
    experiment = [r.experiment for r in records if r.HasField("experiment")]
    assert {m.name.tag for m in experiment[0].metric_infos} >= {"hparam/val/top1", "hparam/train/final_loss"}


def _mixed_on_this_cpu() -> str:
    """What precision=mixed must resolve to on the CPU running the suite."""
    return "amp_bf16" if device_capability(torch.device("cpu")).native_bf16 else "fp32"


def test_mixed_resolves_on_cpu_and_records_it(tmp_path):
    s = run_job(tmp_path, *tiny("resnet50", "precision=mixed", "trainer.max_steps=2"))
    assert s["precision"] == "mixed" and s["precision_resolved"] == _mixed_on_this_cpu()
    assert "CPU" in s["precision_detail"]["note"]
    cap = s["device_capability"]
    assert cap == device_capability(torch.device("cpu")).describe()
    assert cap["device_type"] == "cpu" and cap["isa"] == torch.backends.cpu.get_cpu_capability()


def test_resume_continues_the_loss_curve_exactly(tmp_path):
    common = [*tiny("alexnet"), "trainer.max_steps=6", "trainer.log_every=1", "optim.lr=0.01"]
    full = tmp_path / "full"
    run_job(full, *common, "trainer.checkpoint_every=3", "trainer.keep_checkpoints=5")
    ckpt = checkpoint.list_checkpoints(full)
    assert [p.name for p in ckpt] == ["step_00000003.pt", "step_00000006.pt"]
    resumed = tmp_path / "resumed"
    s = run_job(resumed, *common, f"trainer.resume={ckpt[0]}")
    assert s["resumed_from"] == str(ckpt[0]) and s["steps"] == 6
    a = dict(scalars(full)["train/loss"])
    b = dict(scalars(resumed)["train/loss"])
    assert sorted(b) == [4, 5, 6]
    for step in (4, 5, 6):
        assert b[step] == a[step], f"step {step}: {b[step]} != {a[step]}"  # bit-exact in FP32 on CPU


def test_resume_auto_picks_the_run_dirs_latest(tmp_path):
    args = [*tiny("resnet50"), "trainer.checkpoint_every=2"]
    run_job(tmp_path, *args, "trainer.max_steps=2")
    s = run_job(tmp_path, *args, "trainer.max_steps=4", "trainer.resume=auto")
    assert s["resumed_from"].endswith("step_00000002.pt") and s["steps"] == 4


def test_checkpoint_is_safe_to_load_and_complete(tmp_path):
    run_job(tmp_path, *tiny("resnet50", "precision=amp_fp16", "trainer.max_steps=2"))
    path = checkpoint.list_checkpoints(tmp_path)[-1]
    state = torch.load(path, weights_only=True)  # no pickled code needed
    assert state["step"] == 2 and state["model_name"] == "resnet50"
    assert {"modules", "optimizers", "schedulers", "scalers", "rng", "config"} <= state.keys()
    assert state["scalers"]["model"]["policy"] == "dynamic"
    assert not list(path.parent.glob("*.tmp"))  # atomic write left no temp file


def test_grad_accum_multiplies_the_global_batch(tmp_path):
    s = run_job(tmp_path, *tiny("resnet50", "trainer.grad_accum=2", "trainer.max_steps=2"))
    assert s["global_batch_size"] == 8 and s["steps"] == 2


def test_divergence_stops_the_run_and_keeps_the_last_good_checkpoint(tmp_path):
    args = [*tiny("alexnet"), "trainer.max_steps=40", "trainer.checkpoint_every=1", "trainer.log_every=1",
            "trainer.max_nonfinite_steps=2", "optim.lr=1e12", "trainer.keep_checkpoints=50"]
    with pytest.raises(DivergedError, match="non-finite for 2 consecutive steps"):
        run_job(tmp_path, *args)
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["status"] == "diverged" and s["steps"] < 40
    ckpts = checkpoint.list_checkpoints(tmp_path)
    assert ckpts, "at least the first step's weights were finite"
    last = torch.load(ckpts[-1], weights_only=True)
    assert all(torch.isfinite(t).all() for t in last["modules"]["model"].values() if t.is_floating_point())


def test_short_run_ending_non_finite_is_diverged_not_completed(tmp_path):
    # 6 steps, far fewer than max_nonfinite_steps=50: before issue 17 this said "completed" with a
    # NaN final loss. The CLI says so in one line, with its own exit status (3: not bad input).
    args = [*tiny("alexnet"), "trainer.max_steps=6", "trainer.log_every=3", "optim.lr=1e12"]
    r = run_cli(*args, f"hydra.run.dir={tmp_path}")
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["status"] == "diverged" and s["steps"] == 6 and not math.isfinite(s["final_loss"])
    assert "final loss is nan" in s["error"]
    assert r.returncode == 3 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("mptrain: diverged: the final loss is nan")


def test_deterministic_switches_torchs_flags_for_the_run_and_off_again(tmp_path):
    run_job(tmp_path / "a", *tiny("alexnet", "trainer.max_steps=1", "trainer.deterministic=true"))
    assert torch.are_deterministic_algorithms_enabled() and torch.backends.cudnn.deterministic
    run_job(tmp_path / "b", *tiny("alexnet", "trainer.max_steps=1"))  # a process-wide flag: every run sets it
    assert not torch.are_deterministic_algorithms_enabled() and not torch.backends.cudnn.deterministic


def test_automatic_gc_is_off_while_training_and_the_loop_collects(tmp_path, monkeypatch):
    """trainer.gc_every: no automatic collection can stall a step (a full one walks every object the
    process holds); the loop collects generation 1 at every gc_every-th step boundary instead, and
    Python's automatic collector is back after the run. gc_every=0 leaves it on throughout."""
    import gc

    from mptrain import engine

    seen: list[bool] = []  # gc.isenabled() at each step
    events: list[tuple[int, int]] = []  # (generation, steps run so far) of each collection
    real = engine.Engine._train_step

    def step(self, micro):
        seen.append(gc.isenabled())
        return real(self, micro)

    def record(phase, info):
        if phase == "start":
            events.append((info["generation"], len(seen)))

    monkeypatch.setattr(engine.Engine, "_train_step", step)
    gc.callbacks.append(record)
    try:
        run_job(tmp_path / "a", *tiny("alexnet", "trainer.max_steps=5", "trainer.gc_every=2"))
        assert seen == [False] * 5 and gc.isenabled()
        assert [e for e in events if 0 < e[1] < 5] == [(1, 2), (1, 4)]
        seen.clear()
        run_job(tmp_path / "b", *tiny("alexnet", "trainer.max_steps=2", "trainer.gc_every=0"))
        assert seen == [True] * 2
    finally:
        gc.callbacks.remove(record)


def test_freed_host_memory_is_kept_unless_the_config_says_not(tmp_path):
    """trainer.keep_host_memory (memory.keep_freed_host_memory, tests/test_host_memory.py): on by
    default, and summary.json says what the run had."""
    from mptrain.memory import keep_freed_host_memory

    s = run_job(tmp_path / "a", *tiny("alexnet", "trainer.max_steps=1"))
    assert s["host_memory"] == keep_freed_host_memory()  # "kept" on glibc (tests/test_host_memory.py)
    s = run_job(tmp_path / "b", *tiny("alexnet", "trainer.max_steps=1", "trainer.keep_host_memory=false"))
    assert s["host_memory"] == "glibc defaults (trainer.keep_host_memory=false)"


def test_checkpoint_of_another_model_is_refused(tmp_path):
    run_job(tmp_path / "a", *tiny("alexnet", "trainer.max_steps=1"))
    ckpt = checkpoint.list_checkpoints(tmp_path / "a")[-1]
    with pytest.raises(MptrainError, match="belongs to model=alexnet"):
        run_job(tmp_path / "b", *tiny("resnet50", f"trainer.resume={ckpt}"))


def test_checkpoint_of_another_width_is_refused(tmp_path):
    run_job(tmp_path / "a", *tiny("resnet50", "trainer.max_steps=1"))
    ckpt = checkpoint.list_checkpoints(tmp_path / "a")[-1]
    with pytest.raises(MptrainError, match="does not fit"):
        run_job(tmp_path / "b", *tiny("resnet50", "model.width_divisor=4", f"trainer.resume={ckpt}"))


def test_corrupt_checkpoint_is_a_one_line_error(tmp_path):
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"not a checkpoint at all")
    r = run_cli(*tiny("resnet50", f"trainer.resume={bad}", f"hydra.run.dir={tmp_path / 'run'}"))
    assert r.returncode == 2
    err = r.stderr.strip().splitlines()
    assert err[-1].startswith("mptrain: error: trainer.resume=") and "not a readable" in err[-1]
    assert "Traceback" not in r.stderr


def test_cli_end_to_end_writes_the_run_directory(tmp_path):
    run = tmp_path / "run"
    r = run_cli(*tiny("resnet50", "precision=mixed", "trainer.max_steps=2"), f"hydra.run.dir={run}")
    assert r.returncode == 0, r.stderr
    assert (run / ".hydra" / "config.yaml").is_file()
    assert f"resolved to {_mixed_on_this_cpu()}" in (run / "train.log").read_text()
    assert json.loads((run / "summary.json").read_text())["status"] == "completed"
    assert "mptrain: completed" in r.stdout  # the rich summary table


def test_gradient_telemetry_through_the_engine(tmp_path):
    s = run_job(tmp_path, *tiny("resnet50", "precision=amp_fp16", "telemetry=gradients", "telemetry.every=2",
                                "telemetry.shadow=true", "trainer.max_steps=4"))
    report = s["telemetry"]["model"]
    assert report["layers"] and "at_risk" in report and report["suggested_scale"]
    tags = scalars(tmp_path)
    act = [t for t in tags if t.startswith("telemetry/") and t.endswith("/act_grad/zero_frac")]
    assert act, sorted(tags)[:20]
    assert [step for step, _ in tags[act[0]]] == [2, 4]  # captured every 2 steps
    assert any(t.endswith("/lost_frac") for t in tags)  # the FP32 shadow pass ran


def test_resume_continues_the_loss_scale_trajectory(tmp_path):
    """The scaler's state is in the checkpoint: a resumed amp_fp16 run follows the same scale curve."""
    common = [*tiny("alexnet", "precision=amp_fp16"), "loss_scale=dynamic", "loss_scale.growth_interval=2",
              "loss_scale.init_scale=1024", "trainer.max_steps=6", "trainer.log_every=1", "optim.lr=0.01"]
    full = tmp_path / "full"
    run_job(full, *common, "trainer.checkpoint_every=3", "trainer.keep_checkpoints=5")
    first = checkpoint.list_checkpoints(full)[0]
    resumed = tmp_path / "resumed"
    run_job(resumed, *common, f"trainer.resume={first}")
    a = dict(scalars(full)["train/loss_scale"])
    b = dict(scalars(resumed)["train/loss_scale"])
    assert len(set(a.values())) > 1  # the scale really moved (grew every 2 clean steps)
    assert [b[s] for s in (4, 5, 6)] == [a[s] for s in (4, 5, 6)]


def _final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    state = torch.load(checkpoint.list_checkpoints(run_dir)[-1], weights_only=True)
    return {k: v for k, v in state["modules"]["model"].items() if v.is_floating_point()}


# AlexNet without dropout has no batch norm and no randomness in the step: the update is a function
# of the batch alone. FP32 and a constant LR, so the comparison is of the arithmetic.
EXACT = [*tiny("alexnet"), "data=digits", "data.augment=false", "model.dropout=0", "precision=fp32",
         "sched=constant", "optim.lr=0.05",
         "optim.weight_decay=0", "data.max_val_batches=1"]


def test_grad_accum_k_at_batch_b_equals_one_step_at_batch_kb(tmp_path):
    run_job(tmp_path / "accum", *EXACT, "data.batch_size=4", "trainer.grad_accum=2", "trainer.max_steps=1")
    run_job(tmp_path / "big", *EXACT, "data.batch_size=8", "trainer.grad_accum=1", "trainer.max_steps=1")
    run_job(tmp_path / "small", *EXACT, "data.batch_size=4", "trainer.grad_accum=1", "trainer.max_steps=1")
    accum, big, small = (_final_weights(tmp_path / n) for n in ("accum", "big", "small"))
    for k in big:
        torch.testing.assert_close(accum[k], big[k], rtol=1e-5, atol=1e-6, msg=k)
    assert any(not torch.allclose(small[k], big[k], rtol=1e-3, atol=1e-5) for k in big)  # the test can tell


def test_clipping_sees_unscaled_gradients(tmp_path):
    # A loss scale of 2^16 is exact in FP32: if clipping saw scaled gradients (norm 2^16 times too
    # large), the clipped update would differ from the unscaled FP32 run's.
    clip = ["trainer.grad_clip=0.01", "trainer.max_steps=1"]
    run_job(tmp_path / "scaled", *EXACT, *clip, "loss_scale=static", "loss_scale.scale=65536")
    run_job(tmp_path / "fp32", *EXACT, *clip, "loss_scale=none")
    run_job(tmp_path / "unclipped", *EXACT, "trainer.max_steps=1", "loss_scale=none")
    scaled, fp32, unclipped = (_final_weights(tmp_path / n) for n in ("scaled", "fp32", "unclipped"))
    for k in fp32:
        torch.testing.assert_close(scaled[k], fp32[k], rtol=1e-6, atol=1e-7, msg=k)
    assert any(not torch.allclose(unclipped[k], fp32[k]) for k in fp32)  # clipping did bite


class _FakeDeviceMemory:
    """torch.cuda's two peak-memory calls over an allocation level the test moves: a CPU stand-in
    for a GPU's allocator (the engine asks nothing else of it)."""

    def __init__(self) -> None:
        self.level = self.peak = 10

    def at(self, level: int) -> None:
        self.level, self.peak = level, max(self.peak, level)

    def reset_peak_memory_stats(self, device: torch.device) -> None:
        self.peak = self.level

    def max_memory_allocated(self, device: torch.device) -> int:
        return self.peak


def test_peak_memory_is_trainings_and_evaluation_is_apart(tmp_path, monkeypatch):
    # A step peaks at 100, evaluation at 1000 (another batch shape: new activations, cuDNN
    # autotuning again), a checkpoint at 5000 (host copies). Only the steps are the working set.
    from mptrain.cli import compose
    from mptrain.config import validate
    from mptrain.engine import Engine
    from mptrain.memory import PeakMemory

    cfg = compose([*tiny("resnet50", "trainer.max_steps=4", "trainer.eval_every=2", "trainer.checkpoint_every=2"),
                   "trainer.device=cpu"])
    validate(cfg)
    engine = Engine(cfg, tmp_path)
    memory = _FakeDeviceMemory()
    engine.peak = PeakMemory(engine.device, stats=memory)

    def phase(level: int, fn):
        def run(*args, **kwargs):
            memory.at(level)
            try:
                return fn(*args, **kwargs)
            finally:
                memory.at(10)
        return run

    monkeypatch.setattr(engine, "_train_step", phase(100, engine._train_step))
    monkeypatch.setattr(engine.task, "evaluate", phase(1000, engine.task.evaluate))
    monkeypatch.setattr(engine, "save", phase(5000, engine.save))
    engine.fit()
    s = engine.summary("completed", 0.0)
    assert s["peak_memory_bytes"] == 100 and s["eval_peak_memory_bytes"] == 1000


@pytest.mark.parametrize(("compile_mode", "fmt"), [("default", "mxfp8"), ("reduce-overhead", "nvfp4")])
def test_trainer_compile_traces_emulated_mx_layers_into_the_models_graph(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, compile_mode: str, fmt: str
) -> None:
    """trainer.compile with precision=mx: the converted layers are traced into the model's graph
    (``in_graph``; tests/test_mx.py holds that graph to eager's gradients), and the model compiles with
    the quantizers' exact rounding options beside its mode's. Without compile they stay graph breaks.
    NVFP4's stochastic rounding: its stream is made before the trace, a static input of the graph."""
    from torch import nn

    from mptrain.cli import compose
    from mptrain.config import validate
    from mptrain.engine import Engine
    from mptrain.numerics import compiled_calls
    from mptrain.numerics.convert import MxConv2d, MxLinear

    handed: list[dict[str, Any]] = []
    monkeypatch.setattr(nn.Module, "compile", lambda self, **kw: handed.append(kw))
    for compiled in (False, True):
        cfg = compose([*tiny("resnet50", "precision=mx", f"precision.format={fmt}", f"trainer.compile={compiled}",
                             f"trainer.compile_mode={compile_mode}"), "trainer.device=cpu"])
        validate(cfg)
        engine = Engine(cfg, tmp_path / str(compiled))
        layers = [m for net in engine.task.modules.values() for m in net.modules()
                  if isinstance(m, MxConv2d | MxLinear)]
        assert layers and all(m.in_graph == compiled for m in layers)
        streams = engine.precision.mx_state.rng._streams  # type: ignore[union-attr]
        assert (fmt == "nvfp4" and compiled) == (torch.device("cpu") in streams)
        assert all(getattr(s.counter, "_dynamo_static_input_type", None) == "unguarded" for s in streams.values())
    (options,) = [kw["options"] for kw in handed]
    assert options.items() >= compiled_calls._EAGER_NUMERICS.items()
    assert set(options) <= set(torch._inductor.config.get_config_copy())  # what inductor takes
    assert options.get("triton.cudagraphs", False) == (compile_mode == "reduce-overhead")


def test_the_engine_pins_inductors_vector_isa_before_it_compiles_a_model_on_a_cpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """trainer.compile on a CPU: the vector ISA goes into inductor's cache keys first (the reason:
    tests/test_fused.py, test_code_compiled_for_one_vector_isa_is_not_loaded_for_another). The
    compile itself is not run here: what it is handed is."""
    from torch import nn
    from torch._inductor import config as inductor_config

    from mptrain.cli import compose
    from mptrain.config import validate
    from mptrain.engine import Engine
    from mptrain.numerics import compiled_calls

    seen: list[int | None] = []
    monkeypatch.setattr(nn.Module, "compile", lambda self, **kw: seen.append(inductor_config.cpp.simdlen))
    cfg = compose([*tiny("resnet50", "trainer.compile=true"), "trainer.device=cpu"])
    validate(cfg)
    # the option unset, as in a new process, and set back after (monkeypatch.setattr on inductor's
    # config proxy broke the config for the rest of the process on torch 2.11)
    with inductor_config.patch({"cpp.simdlen": None}):
        picked = compiled_calls.cpu_vector_bits()
        Engine(cfg, tmp_path)
    assert seen == [picked]


def test_a_sweeps_compiled_jobs_in_one_process_each_trace_afresh(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Hydra's basic launcher runs a sweep's jobs in one process. With trainer.compile, each job's
    model runs the same forward code as the last job's. Dynamo's state from the last job's compiles
    made the next job's differing constants symbolic (NVFP4's element max after MXFP8's), and its
    trace failed; it also counted every job's compiles against one recompile limit. The engine
    starts each compiled job from a fresh dynamo. (AOTAutograd on eager kernels: the trace is the
    subject, not inductor.)"""
    from mptrain.numerics import compiled_calls

    monkeypatch.setattr(compiled_calls, "model_compile_args", lambda mode, emulated: {"backend": "aot_eager"})
    for fmt in ("mxfp8", "nvfp4"):
        s = run_job(tmp_path / fmt, "model=transformer_lm_tiny", "model.num_layers=1", "model.d_model=32",
                    "model.num_heads=2", "precision=mx", f"precision.format={fmt}", "trainer.compile=true",
                    "data.batch_size=4", "trainer.max_steps=2", "trainer.log_every=1")
        assert s["status"] == "completed" and math.isfinite(s["final_loss"])
