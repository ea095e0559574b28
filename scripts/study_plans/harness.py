"""The one study harness (issue 27): run a plan's runs once, stamped with the code that trained them;
read them back with their pairing and provenance; judge claims through mptrain.verdicts.

A plan (a module of this package) says which runs, which claims and which margins; this module
does everything plans share:

- **Runs.** Every run is ``python -m mptrain <overrides> hydra.run.dir=<runs>/<name>``, one thread,
  ``--jobs`` at a time. Its ``stamp.json`` records the git commit, whether the code under
  ``CODE_PATHS`` had uncommitted changes, the exact command, the CPU capability, and the process's
  wall time. A finished run is reused only when its command is the spec's and its commit's code is
  this tree's (a docs-only commit in between is fine; an uncommitted tree on either side never
  is). Any other run is *stale*: the harness stops before training anything and names them, unless
  told ``--rerun-stale`` (train them again) or ``--keep-stale`` (keep them, reported stale and left
  out of every claim).
- **Pairing.** A run enters a claim only when its pairing digests equal its FP32 twin's (same
  group and seed): :func:`mark_pairing`.
- **Judging.** :func:`observations` turns records into :class:`mptrain.verdicts.Obs`, and
  :func:`judge_cells` pairs and judges them, as ``mptrain-report --verdicts`` does.
- **Provenance.** :func:`provenance` groups the runs by commit: which are not at the study's
  commit, which came from uncommitted trees, and whether their code equals the study commit's.
- **Pilots and plan files.** :func:`pilot` runs a few steps of one run per new cell type and
  measures its cost; :func:`plan_markdown` writes a plan's commands, claims, margins, seeds, steps
  and measured cost for whoever launches it.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mptrain.verdicts import Margin, Obs, Verdict, judge, pair

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs" / "results"
RUNS = ROOT / "runs" / "study"
CODE_PATHS = ("mptrain", "configs", "pyproject.toml")  # what a run's numbers depend on
FINAL = ("completed", "diverged")  # a diverged run is a result too, not a failure to redo


@dataclass(frozen=True)
class Spec:
    """One run of a plan."""

    name: str  # its dir under the plan's runs dir
    overrides: tuple[str, ...]
    seed: int
    cell: str  # the precision cell
    group: str = ""  # the recipe (model) it belongs to: pairing and claims stay inside a group
    part: str = ""
    tag: str = ""  # e.g. "tel": a run of its own kind (telemetry), paired only with its own kind
    cost: float = 1.0  # relative cost, for ordering: the long runs go first

    @property
    def command(self) -> str:
        return "python -m mptrain " + " ".join(self.overrides)


def steps_of(spec: Spec) -> int:
    return int(next(o for o in spec.overrides if o.startswith("trainer.max_steps=")).split("=")[1])


# ------------------------------------------------------------------------------------------ code stamps


class StaleRunError(RuntimeError):
    """Cached runs trained by other code (or another command) than the spec's."""


def _git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)


@dataclass(frozen=True)
class CodeState:
    commit: str | None
    dirty: bool | None  # uncommitted changes under CODE_PATHS: the commit does not describe the code

    @classmethod
    def current(cls) -> CodeState:
        head = _git("rev-parse", "HEAD")
        if head.returncode != 0:
            return cls(None, None)
        return cls(head.stdout.strip(), _git("status", "--porcelain", "--", *CODE_PATHS).stdout.strip() != "")

    def same_code(self, commit: str | None, dirty: bool | None) -> bool:
        """A run stamped (commit, dirty) was trained by this code: the same commit, or one whose
        CODE_PATHS equal this one's; never an uncommitted tree on either side."""
        if not commit or dirty is not False or self.dirty is not False or not self.commit:
            return False
        return commit == self.commit or same_code(commit, self.commit)


def same_code(a: str, b: str) -> bool | None:
    """Whether two commits have the same CODE_PATHS (None: git cannot tell)."""
    r = _git("diff", "--quiet", a, b, "--", *CODE_PATHS)
    return {0: True, 1: False}.get(r.returncode)


def read_json(p: Path) -> dict[str, Any] | None:
    try:
        return json.loads(p.read_text()) if p.exists() else None
    except json.JSONDecodeError:
        return None


def stale_reason(spec: Spec, run_dir: Path, code: CodeState) -> str | None:
    """Why a finished cached run may not stand for ``spec`` under this code (None: it may)."""
    stamp = read_json(run_dir / "stamp.json")
    if stamp is None:
        return "no stamp.json"
    if stamp.get("command") != spec.command:
        return "its command differs from the spec's"
    if not code.same_code(stamp.get("commit"), stamp.get("code_dirty")):
        dirty = " (uncommitted tree)" if stamp.get("code_dirty") else ""
        return f"trained at {str(stamp.get('commit'))[:12]}{dirty}, not this tree's code"
    return None


def finished(run_dir: Path) -> bool:
    return ((read_json(run_dir / "summary.json") or {}).get("status")) in FINAL


# ------------------------------------------------------------------------------------------ running


def train(spec: Spec, run_dir: Path, code: CodeState, extra: tuple[str, ...] = ()) -> dict[str, Any]:
    """One run in its own process with one thread; returns its stamp (rc and wall time included)."""
    import torch

    if run_dir.exists():
        shutil.rmtree(run_dir)  # old event files would merge into the new curves
    run_dir.mkdir(parents=True)
    stamp = {"commit": code.commit, "code_dirty": code.dirty, "command": spec.command,
             "cpu_capability": torch.backends.cpu.get_cpu_capability(), "started": time.time()}
    (run_dir / "stamp.json").write_text(json.dumps(stamp, indent=1) + "\n")
    cmd = [sys.executable, "-m", "mptrain", *spec.overrides, *extra, f"hydra.run.dir={run_dir}"]
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    t0 = time.time()
    with open(run_dir / "stdout.log", "w") as log:
        rc = subprocess.call(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    stamp.update(rc=rc, wall_s=time.time() - t0)
    (run_dir / "stamp.json").write_text(json.dumps(stamp, indent=1) + "\n")
    print(f"[rc={rc} {stamp['wall_s']:6.1f}s] {spec.name}", flush=True)
    return stamp


def run_specs(specs: list[Spec], runs: Path, jobs: int = 1, rerun_stale: bool = False,
              keep_stale: bool = False, code: CodeState | None = None,
              trainer: Callable[[Spec, Path, CodeState], Any] = train) -> list[Spec]:
    """Train every spec that has no current finished run; returns those trained. Stale runs are
    found for all specs before anything trains, so a refusal costs nothing."""
    code = code or CodeState.current()
    stale = {s.name: why for s in specs if finished(runs / s.name) and (why := stale_reason(s, runs / s.name, code))}
    if stale and not (rerun_stale or keep_stale):
        raise StaleRunError(f"{len(stale)} cached run(s) from other code or commands (pass --rerun-stale to train "
                            "them again, or --keep-stale to report them stale and left out):\n  "
                            + "\n  ".join(f"{n}: {w}" for n, w in stale.items()))
    todo = [s for s in specs if not finished(runs / s.name) or (s.name in stale and rerun_stale)]
    todo.sort(key=lambda s: -s.cost * steps_of(s))
    print(f"{len(specs) - len(todo)} of {len(specs)} runs cached; training {len(todo)}", flush=True)
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        list(pool.map(lambda s: trainer(s, runs / s.name, code), todo))
    return todo


# ------------------------------------------------------------------------------------------ reading


def base_record(spec: Spec, run_dir: Path, code: CodeState | None = None) -> tuple[dict, dict | None]:
    """The fields every plan's run record has, and the run's summary.json (None: no run)."""
    r: dict[str, Any] = dict(name=spec.name, cell=spec.cell, seed=spec.seed, command=spec.command)
    summary = read_json(run_dir / "summary.json")
    stamp = read_json(run_dir / "stamp.json") or {}
    r.update(commit=stamp.get("commit"), code_dirty=stamp.get("code_dirty"),
             cpu_capability=stamp.get("cpu_capability"), process_wall_s=stamp.get("wall_s"))
    if summary is None:
        return {**r, "status": "missing", "stale": None, "paired": False}, None
    r["status"] = summary.get("status")
    r["stale"] = stale_reason(spec, run_dir, code) if code is not None else None
    return r, summary


def mark_pairing(recs: list[dict], digest: Callable[[dict], Any], group: Callable[[dict], Any]) -> None:
    """Each record's ``paired``: it is finished, not stale, has digests, and they equal those of its
    FP32 twin (same group and seed), or, without one, of the group's first such run."""
    groups: dict[tuple, list[dict]] = {}
    for r in recs:
        groups.setdefault((group(r), r["seed"]), []).append(r)
    for rows in groups.values():
        ok = [r for r in rows if r.get("status") in FINAL and not r.get("stale") and digest(r) is not None]
        ref = next((r for r in ok if r["cell"] == "fp32"), ok[0] if ok else None)
        for r in rows:
            r["paired"] = bool(ref is not None and r in ok and digest(r) == digest(ref))


def provenance(recs: list[dict], commit_key: str = "commit", dirty_key: str = "code_dirty") -> dict[str, Any]:
    """The runs by the commit that trained them: the study commit (most runs), and every other one
    with its runs, whether its tree was dirty, and whether its code equals the study commit's."""
    by: dict[tuple, list[str]] = {}
    for r in recs:
        if r.get("status") in FINAL:
            by.setdefault((r.get(commit_key), r.get(dirty_key)), []).append(r["name"])
    if not by:
        return {"study_commit": None, "runs": 0, "at_study_commit": 0, "other": []}
    (main, main_dirty), names = max(by.items(), key=lambda kv: len(kv[1]))
    other = []
    for (c, dirty), names_c in sorted(by.items(), key=lambda kv: (str(kv[0][0]), str(kv[0][1]))):
        if (c, dirty) == (main, main_dirty):
            continue
        same = None if dirty or main_dirty or not c or not main else same_code(c, main)
        other.append({"commit": c, "dirty": dirty, "runs": sorted(names_c), "code_same_as_study": same})
    return {"study_commit": main, "study_commit_dirty": main_dirty, "runs": sum(map(len, by.values())),
            "at_study_commit": len(names), "other": other,
            "not_at_study_commit": sum(len(o["runs"]) for o in other),
            "from_uncommitted_trees": sum(len(o["runs"]) for o in other if o["dirty"])}


# ------------------------------------------------------------------------------------------ judging


def observations(recs: list[dict], value: Callable[[dict], float | None],
                 digest: Callable[[dict], Any]) -> list[Obs]:
    """Finished records as observations: a record that is not ``paired`` (with its FP32 twin) is
    left out and named; a diverged run (no finite value) counts as diverged."""
    out = []
    for r in recs:
        if r.get("status") not in FINAL:
            continue
        v = value(r)
        v = v if v is not None and math.isfinite(v) else None
        why = None
        if not r.get("paired"):
            why = f"stale: {r['stale']}" if r.get("stale") else "not paired with its fp32 twin"
        out.append(Obs(r["name"], r["seed"], v, digest(r), why))
    return out


def judge_cells(text: str, kind: str, cell: list[Obs], ref: list[Obs], margin: Margin, unit: str,
                worse_sign: int) -> tuple[Verdict, Any]:
    """One claim from two cells' observations: paired by seed and digest, then judged."""
    pairs = pair(cell, ref, margin.diff)
    v = judge(text, kind, pairs.finite, margin.value, unit, pairs.names, worse_sign)  # type: ignore[arg-type]
    return v, pairs


# ------------------------------------------------------------------------------------------ pilots and plans


@dataclass
class PlanDoc:
    """What a plan file states: its claims, their margins, seeds and steps, its commands and cost."""

    name: str
    title: str
    why: str
    claims: list[dict]  # id, text, kind, cell, ref, margin, unit, seeds, steps
    specs: list[Spec]
    pilots: dict[str, Any] = field(default_factory=dict)  # cell -> measured cost (pilot json)
    notes: list[str] = field(default_factory=list)
    known: dict[str, Any] = field(default_factory=dict)  # cell -> cost measured by earlier full runs
    cost_as: dict[str, str] = field(default_factory=dict)  # cell -> the piloted cell it costs as much as
    stages: list[tuple[str, list[Spec]]] = field(default_factory=list)  # runs before the claims' runs
    launch: str = ""  # how to launch it, when more than run + report

    def cost(self, cell: str) -> dict[str, Any]:
        c = self.cost_as.get(cell, cell)
        return self.pilots.get(c) or self.known.get(c) or {}


def known_cost(results: Path, rows: Callable[[dict], list[dict]], steps: int, source: str) -> dict[str, Any] | None:
    """A cell's cost from a committed study's runs: the mean of their wall times over their steps
    (start-up and evaluation included, so no separate overhead)."""
    res = read_json(results)
    walls = [w for r in rows(res or {"runs": []}) if (w := r.get("wall_time_s") or r.get("process_wall_s"))]
    if not walls:
        return None
    return {"status": "completed", "step_s": round(statistics.fmean(walls) / steps, 4), "overhead_s": 0.0,
            "runs": len(walls), "source": source}


def pilot(specs: list[Spec], runs: Path, pilot_steps: int | dict[str, int]) -> dict[str, dict[str, Any]]:
    """One short run per cell type: ``pilot_steps`` steps (per cell, ``"*"`` for the rest) with an
    evaluation at the end, one thread, ``nice -n 10``. Returns each cell's seconds per step (from the
    run's median throughput) and the process's overhead (start-up and evaluation: wall time less
    the steps)."""
    import torch

    out = {}
    for s in specs:
        steps = pilot_steps if isinstance(pilot_steps, int) else pilot_steps.get(s.cell, pilot_steps["*"])
        ov = [o for o in s.overrides if not o.startswith(("trainer.max_steps=", "trainer.eval_every=",
                                                         "trainer.log_every="))]
        ov += [f"trainer.max_steps={steps}", f"trainer.eval_every={steps}", f"trainer.log_every={max(steps // 4, 1)}"]
        d = runs / "pilot" / s.name
        if d.exists():
            shutil.rmtree(d)
        d.mkdir(parents=True)
        env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        t0 = time.time()
        with open(d / "stdout.log", "w") as log:
            rc = subprocess.call(["nice", "-n", "10", sys.executable, "-m", "mptrain", *ov, f"hydra.run.dir={d}"],
                                 cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        wall = time.time() - t0
        summ = read_json(d / "summary.json") or {}
        # seconds per step from the median logging window's throughput (samples or tokens per second)
        per_step_units = summ.get("global_batch_size", 0) * (summ.get("task", {}).get("data", {}).get("bptt") or 1
                                                                if summ.get("throughput_unit") == "tokens" else 1)
        step_s = per_step_units / summ["throughput"] if summ.get("throughput") else None
        out[s.cell] = {
            "status": summ.get("status"), "rc": rc, "steps": steps, "process_wall_s": round(wall, 2),
            "step_s": None if step_s is None else round(step_s, 4),
            "overhead_s": None if step_s is None else round(wall - steps * step_s, 2),
            "metric": (summ.get("metrics") or {}).get(summ.get("primary_metric") or ""),
            "final_loss_scale": summ.get("final_loss_scale"), "skipped_steps": summ.get("skipped_steps"),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(), "load_1min": round(os.getloadavg()[0], 2),
            "cores": os.cpu_count(), "date": time.strftime("%Y-%m-%d"), "full_run_command": s.command,
        }
        print(f"pilot {s.cell}: {json.dumps(out[s.cell])}", flush=True)
    return out


def run_cost(spec: Spec, doc: PlanDoc) -> float | None:
    """A full run's estimated seconds from its cell's pilot (or earlier runs): steps x seconds per
    step + the per-run overhead."""
    p = doc.cost(spec.cell)
    if not p or p.get("step_s") is None:
        return None
    return steps_of(spec) * p["step_s"] + max(p.get("overhead_s") or 0.0, 0.0)


def plan_markdown(doc: PlanDoc) -> str:
    """The plan file: every claim with its margin, seeds and steps; every run's command; the cost
    measured by the pilots (generated from the plan's code and its pilot json)."""
    total = [run_cost(s, doc) for s in doc.specs]
    known = [c for c in total if c is not None]
    cells = sorted({s.cell for s in doc.specs}, key=[s.cell for s in doc.specs].index)
    reported = (DOCS / doc.name / "results.json").exists()
    L = [f"# Plan: {doc.title}", "",
         f"Generated by `python scripts/study.py plan {doc.name}` from `scripts/study_plans/{doc.name}.py`"
         + (f" and its pilot runs (`{doc.name}.pilot.json`, which measured cost only: no verdict comes from them)"
            if doc.pilots else "") + "."
         + (f" Run and reported: its verdicts are in [../{doc.name}/README.md](../{doc.name}/README.md)." if reported
            else " Not run yet: " + (doc.launch or f"launch it with `python scripts/study.py run {doc.name} --jobs 2`, "
                                     f"then `python scripts/study.py report {doc.name}`.")),
         "", doc.why, "",
         "## Claims", "",
         "Each claim's verdict comes from the 95% t-interval of the paired (same seed, digests checked) differences "
         "(`mptrain/verdicts.py`); every verdict is stated with the margin, seeds and steps below.", "",
         "| claim | kind | cell | against | margin | seeds | steps |", "|---|---|---|---|---|---|---|"]
    for c in doc.claims:
        L.append(f"| {c['id']}: {c['text']} | {c['kind']} | {c['cell']} | {c['ref']} | ±{c['margin']} "
                 f"({c['unit']}) | {c['seeds']} | {c['steps']} |")
    L += ["", "## Cost", "",
          "Per cell: seconds per step and per-run overhead from one short pilot run of the cell (or of the cell "
          "named in *measured on*, whose GEMMs cost the same), or from the committed runs of an earlier study.", "",
          "| cell | runs | s per step | overhead per run, s | est. s per run | est. core-hours, all runs of the cell "
          "| measured on |", "|---|---|---|---|---|---|---|"]
    for c in cells:
        ss = [s for s in doc.specs if s.cell == c]
        p = doc.cost(c)
        est = run_cost(ss[0], doc)
        hours = None if est is None else sum(run_cost(s, doc) or 0.0 for s in ss) / 3600
        src = p.get("source") or (f"pilot of {doc.cost_as.get(c, c)}: {p.get('steps')} steps, {p.get('status')}"
                                  if p else "not measured")
        L.append(f"| {c} | {len(ss)} | {_f(p.get('step_s'), '.3f')} | {_f(p.get('overhead_s'), '.1f')} | "
                 f"{_f(est, '.0f')} | {_f(hours, '.2f')} | {src} |")
    n_missing = len(total) - len(known)
    L += ["", f"In all: {len(doc.specs)} runs, about {_f(sum(known) / 3600, '.1f')} hours of one core"
          + (f" ({n_missing} runs not estimated: no pilot of their cell)" if n_missing else "")
          + f", or about {_f(sum(known) / 3600 / 2, '.1f')} hours of wall time at `--jobs 2` on two free cores.", ""]
    if doc.pilots:
        p0 = next(iter(doc.pilots.values()))
        loads = [p.get("load_1min") for p in doc.pilots.values() if p.get("load_1min") is not None]
        L += [f"Pilots: {', '.join(sorted({str(p.get('steps')) for p in doc.pilots.values()}))} steps each, one "
              f"thread, `nice -n 10`, on {p0.get('date', 'the date of the pilot json')}, on a {p0.get('cores')}-core "
              f"CPU with torch capability {p0.get('cpu_capability')} shared with other jobs (1-minute load average "
              f"{_f(min(loads) if loads else None, '.1f')} to {_f(max(loads) if loads else None, '.1f')} at the "
              "pilots' ends, so they overstate the cost on free cores), before issue 24's fast formats landed: "
              "the emulated formats will cost less after it. Re-measure with `python scripts/study.py pilot "
              f"{doc.name}`.", ""]
    if doc.notes:
        L += ["## Notes", "", *[f"- {n}" for n in doc.notes], ""]
    L += ["## Commands", ""]
    for title, specs in doc.stages:
        L += [f"{title} (one line each; `hydra.run.dir` is added by the harness):", "", "```",
              *[s.command for s in specs], "```", ""]
    L += ["The claims' runs, one line each (`hydra.run.dir` is added by the harness):", "", "```"]
    L += [s.command for s in doc.specs]
    L += ["```", ""]
    return "\n".join(L)


def _f(x: float | None, spec: str) -> str:
    return "—" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, spec)


def mean_or_none(xs: list[float]) -> float | None:
    return statistics.fmean(xs) if xs else None


# ------------------------------------------------------------------------------------------ plans' claims


@dataclass(frozen=True)
class Claim:
    """One claim of a plan: ``cell`` against ``ref`` (same group, paired by seed and digest)."""

    id: str
    text: str
    kind: str  # equivalent | worse
    cell: str
    ref: str
    margin: Margin
    metric: str  # the summary's metric: ppl (lower is better) or top1 (higher is better)
    group: str = ""
    error_ratio: float | None = None  # accuracies: also judged on the error-rate ratio, within this

    @property
    def unit(self) -> str:
        return self.margin.unit(self.metric)

    @property
    def worse_sign(self) -> int:
        return -1 if self.metric in ("top1", "top5") else 1


def generic_record(spec: Spec, run_dir: Path, code: CodeState | None = None) -> dict:
    """A run's row for a plan whose claims read the summary's metrics (the part-3 plans)."""
    base, summary = base_record(spec, run_dir, code)
    r = {**base, "group": spec.group, "part": spec.part}
    if summary is None:
        return r
    scaler = next(iter((summary.get("loss_scale_state") or {}).values()), {}) or {}
    r.update(steps=summary.get("steps"), metrics=summary.get("metrics") or {}, loss_scale=summary.get("loss_scale"),
             final_loss_scale=summary.get("final_loss_scale"), skipped_steps=summary.get("skipped_steps"),
             floor_binds=scaler.get("floor_binds"), injected_overflows=scaler.get("injected_overflows"),
             wall_time_s=summary.get("wall_time_s"), pairing_digests=summary.get("pairing"),
             low_precision_flop_fraction=(summary.get("precision_plan") or {}).get("low_precision_flop_fraction"))
    return r


def _digest(r: dict) -> tuple | None:
    d = r.get("pairing_digests")
    return tuple(sorted(d.items())) if d else None


def judge_plan(recs: list[dict], claims: list[Claim], steps: dict[str, int]) -> list[dict]:
    """Every claim of a plan, paired and judged; Holm over the plan's claims, and separately over
    its error-ratio parts. ``steps``: each cell's steps, stated beside its verdict."""
    from mptrain.verdicts import holm, holm_parts, log_error_ratio

    mark_pairing(recs, _digest, lambda r: r.get("group", ""))
    out, ratios = [], []
    for c in claims:
        def obs(cell: str, c: Claim = c) -> list[Obs]:
            rows = [r for r in recs if r["cell"] == cell and r.get("group", "") == c.group]
            return observations(rows, lambda r: (r.get("metrics") or {}).get(c.metric), _digest)

        v, pairs = judge_cells(c.text, c.kind, obs(c.cell), obs(c.ref), c.margin, c.unit, c.worse_sign)
        out.append({**v.as_dict(), "id": c.id, "cell": c.cell, "ref": c.ref, "margin_text": str(c.margin),
                    "steps": steps.get(c.cell), "seeds": pairs.seeds, "left_out": pairs.unpaired,
                    "diverged_seeds": pairs.diverged})
        if c.error_ratio:
            rp = pair(obs(c.cell), obs(c.ref), log_error_ratio)
            rv = judge(f"{c.text} (error-rate ratio within x{c.error_ratio:g})", c.kind, rp.finite,
                       math.log(c.error_ratio), "log error ratio", rp.names, +1)  # type: ignore[arg-type]
            ratios.append({**rv.as_dict(), "id": c.id + "/error_ratio", "cell": c.cell, "ref": c.ref,
                           "margin_text": f"x{c.error_ratio:g}", "steps": steps.get(c.cell), "seeds": rp.seeds,
                           "ratio": [math.exp(x) if math.isfinite(x) else None for x in (rv.effect, *rv.ci95)]})
    holm_parts(out)
    for r, k in zip(ratios, holm([r["p_value"] for r in ratios]), strict=True):
        r["holm"] = bool(k and r["verdict"] != "inconclusive")
    return out + ratios


def verdict_markdown(title: str, results: dict) -> str:
    """A plan's README: every verdict with its margin, seeds and steps, then provenance."""
    f = lambda x, s="+.2f": _f(x, s)  # noqa: E731
    L = [f"# {title}", "", f"Generated by `python scripts/study.py report {results['plan']}` on {results['date']} from "
         "`results.json` (every figure below is read from it). Each verdict: the 95% t-interval of the paired "
         "(same seed, digests checked) differences against the margin (`mptrain/verdicts.py`); Holm over the "
         "plan's claims at 2.5% family-wise, and separately over its error-rate ratios.", "",
         "| claim | verdict | effect [95% CI] | margin | seeds | steps | p | survives Holm | left out |",
         "|---|---|---|---|---|---|---|---|---|"]
    for c in results["claims"]:
        lo, hi = c["ci95"]
        eff = (f"×{f(c['ratio'][0], '.2f')} [{f(c['ratio'][1], '.2f')}, {f(c['ratio'][2], '.2f')}]" if "ratio" in c
               else f"{f(c['effect'])} [{f(lo)}, {f(hi)}] {c['unit']}")
        L.append(f"| {c['id']}: {c['claim']} | **{c['verdict']}** | {eff} | ±{c['margin_text']} | {c['n_seeds']} | "
                 f"{c['steps']} | {f(c['p_value'], '.2g')} | {'yes' if c['holm'] else 'no'} | "
                 f"{len(c.get('left_out') or [])} |")
    L += cells_markdown(results)
    prov = results["provenance"]
    L += ["", "## Provenance", "", f"{prov['at_study_commit']} of {prov['runs']} runs at commit "
          f"{str(prov['study_commit'])[:12]}; not at it: {prov.get('not_at_study_commit', 0)} "
          f"({prov.get('from_uncommitted_trees', 0)} from uncommitted trees).", ""]
    return "\n".join(L)


def cells_markdown(results: dict) -> list[str]:
    """What each cell's runs did, from results.json's runs: its metrics (mean over seeds), and what
    its loss scaler did (skipped steps, final scale, injected overflows, floor binds; ranges over
    seeds), so that a control shows that the component it tests acted. Empty for plans whose runs
    lack these fields."""
    runs = [r for r in results.get("runs", []) if r.get("metrics")]
    if not runs:
        return []
    machine = results.get("machine") or {}

    def span(values: list[Any], fmt: str = "g") -> str:
        vals = sorted({v for v in values if v is not None})
        if not vals:
            return "-"
        lo, hi = format(vals[0], fmt), format(vals[-1], fmt)
        return lo if lo == hi else f"{lo} to {hi}"

    keys = sorted({k for r in runs for k in r["metrics"]})
    L = ["", "## The cells", "",
         f"Each cell over its seeds: the metrics' means, then what its loss scaler did (ranges over seeds). Machine: "
         f"torch CPU capability {machine.get('cpu_capability', '?')}, {machine.get('cores', '?')} cores, torch "
         f"{machine.get('torch', '?')}; one thread a run.", "",
         "| cell | runs | steps | " + " | ".join(keys) + " | skipped steps | final loss scale | injected overflows "
         "| floor binds |", "|---|---|---|" + "---|" * len(keys) + "---|---|---|---|"]
    cells: dict[tuple[str, str], list[dict]] = {}
    for r in runs:
        cells.setdefault((r.get("group", ""), r["cell"]), []).append(r)
    for (_, cell), rs in cells.items():
        means = [statistics.fmean(v) if (v := [r["metrics"][k] for r in rs if k in r["metrics"]]) else None
                 for k in keys]
        L.append(f"| {cell} | {len(rs)} | {span([r.get('steps') for r in rs])} | "
                 + " | ".join("-" if m is None else f"{m:.4g}" for m in means)
                 + f" | {span([r.get('skipped_steps') for r in rs])} | {span([r.get('final_loss_scale') for r in rs])}"
                 f" | {span([r.get('injected_overflows') for r in rs])} | {span([r.get('floor_binds') for r in rs])} |")
    return L


def generic_report(name: str, title: str, specs: list[Spec], claims: list[Claim], runs: Path, out: Path,
                   code: CodeState | None) -> dict:
    """results.json and README.md of a plan whose claims read the summaries' metrics."""
    import platform
    from datetime import date

    import torch

    recs = [generic_record(s, runs / s.name, code) for s in specs]
    steps = {s.cell: steps_of(s) for s in specs}
    results = {"plan": name, "date": date.today().isoformat(),
               "machine": {"cpu_capability": torch.backends.cpu.get_cpu_capability(), "torch": torch.__version__,
                           "python": platform.python_version(), "cores": os.cpu_count()},
               "claims": judge_plan(recs, claims, steps), "provenance": provenance(recs), "runs": recs}
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    (out / "README.md").write_text(verdict_markdown(title, results) + "\n")
    return results


def claim_rows(claims: list[Claim], specs: list[Spec]) -> list[dict]:
    """The plan file's claim table: each claim with its margin, seeds and steps."""
    rows = []
    for c in claims:
        seeds = sorted({s.seed for s in specs if s.cell == c.cell and s.group == c.group})
        steps = sorted({steps_of(s) for s in specs if s.cell == c.cell and s.group == c.group})
        margin = str(c.margin) + (f" and error ratio ×{c.error_ratio:g}" if c.error_ratio else "")
        rows.append({"id": c.id, "text": c.text, "kind": "parity" if c.kind == "equivalent" else "worse by more than",
                     "cell": c.cell, "ref": c.ref, "margin": margin, "unit": c.unit, "seeds": len(seeds),
                     "steps": ", ".join(map(str, steps))})
    return rows
