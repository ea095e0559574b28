#!/usr/bin/env python
"""The study harness: plans of runs and claims, judged by mptrain's paired verdicts (issues 12, 18, 27).

    python scripts/study.py list                               # the plans and what each has
    python scripts/study.py run PLAN [--quick] [--jobs 2]      # its runs (stamped; current ones cached)
    python scripts/study.py run cnn_hard --stage search        # a plan's stage before its claims' runs
    python scripts/study.py run cnn_hard --stage check         # (cnn_hard: the chosen recipe on 5 seeds)
    python scripts/study.py report PLAN [--quick] [--partial]  # results.json, README, figures from the runs
    python scripts/study.py render PLAN                        # results.json's claims and the README again,
                                                               # from results.json alone (no run dirs)
    python scripts/study.py pilot PLAN                         # one short run per new cell type: its cost
    python scripts/study.py plan PLAN                          # docs/results/plans/PLAN.md: claims, commands, cost
    python scripts/study.py all [--quick]                      # run and report papers and formats

A plan (``scripts/study_plans/<plan>.py``) says which runs, which claims and which margins;
``study_plans/harness.py`` runs every plan the same way (one thread a run, stamped with its commit,
cached only while the code is the same), pairs runs by digest, and ``mptrain.verdicts`` judges each
claim, as ``mptrain-report --verdicts`` does for any sweep. Runs go under the git-ignored
``runs/study/<plan>/``; a full report writes docs/results (papers), docs/results/formats (formats).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from study_plans import NAMES, load  # noqa: E402
from study_plans.harness import DOCS, RUNS, CodeState, StaleRunError, plan_markdown, run_specs  # noqa: E402

PLANS_DOCS = DOCS / "plans"


def runs_dir(plan: str, quick: bool) -> Path:
    return RUNS / plan / ("quick" if quick else "full")


def cmd_run(plan: str, quick: bool, jobs: int, rerun_stale: bool, keep_stale: bool, stage: str | None = None) -> None:
    mod = load(plan)
    code = CodeState.current()
    if code.dirty and not quick:
        raise SystemExit("uncommitted changes under mptrain/, configs/ or pyproject.toml: commit them first, so "
                         "that each run's stamp says what code trained it")
    if stage is not None and not hasattr(mod, "stage_specs"):
        raise SystemExit(f"plan {plan!r} has no stages")
    specs = mod.stage_specs(stage) if stage is not None else mod.specs(quick)
    run_specs(specs, runs_dir(plan, quick), jobs, rerun_stale or quick, keep_stale, code)
    if stage is not None and hasattr(mod, "record_stage"):  # a stage's outcome, committed beside the plan file
        mod.record_stage(stage, runs_dir(plan, quick))


def cmd_report(plan: str, quick: bool, partial: bool) -> None:
    mod = load(plan)
    if not hasattr(mod, "report"):
        raise SystemExit(f"plan {plan!r} has not been run: see docs/results/plans/{plan}.md")
    code = CodeState.current()
    runs = runs_dir(plan, quick)
    recs_out = runs / "report" if quick else mod.DOCS
    if not quick and not partial:
        missing = [s.name for s in mod.specs(False) if not (runs / s.name / "summary.json").exists()]
        if missing:
            raise SystemExit(f"{len(missing)} runs missing (e.g. {missing[0]}): run them, or pass --partial "
                             f"(the report then goes to {runs / 'report'}, never {mod.DOCS})")
    if partial and not quick:
        recs_out = runs / "report"
    res = mod.report(runs, recs_out, quick, code)
    print("\n".join(mod.summary_lines(res)))
    print(f"report in {recs_out}")


def cmd_pilot(plan: str) -> None:
    from study_plans.harness import pilot

    mod = load(plan)
    out = PLANS_DOCS / f"{plan}.pilot.json"
    result = pilot(mod.pilot_specs(), RUNS / plan, mod.PILOT_STEPS)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")
    cmd_plan(plan)


def cmd_plan(plan: str) -> None:
    mod = load(plan)
    doc = mod.plan_doc()
    pilots = PLANS_DOCS / f"{plan}.pilot.json"
    doc.pilots = json.loads(pilots.read_text()) if pilots.exists() else {}
    out = PLANS_DOCS / f"{plan}.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(plan_markdown(doc))
    print(f"wrote {out}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", choices=["list", "run", "report", "render", "pilot", "plan", "all"])
    ap.add_argument("plan", nargs="?", choices=NAMES)
    ap.add_argument("--quick", action="store_true", help="2 seeds and a fraction of the steps: a smoke run")
    ap.add_argument("--jobs", type=int, default=2, help="runs at once (each with one thread)")
    ap.add_argument("--rerun-stale", action="store_true", help="train again the cached runs of other code")
    ap.add_argument("--keep-stale", action="store_true",
                    help="keep cached runs of other code: reported stale, left out of every claim")
    ap.add_argument("--stage", default=None, help="run: a stage before the claims' runs (cnn_hard: search, check)")
    ap.add_argument("--partial", action="store_true",
                    help="report with runs missing (to runs/study/<plan>/full/report, never docs/results)")
    args = ap.parse_args(argv)
    if args.command == "list":
        for n in NAMES:
            mod = load(n)
            print(f"{n:14s} {(mod.__doc__ or '').strip().splitlines()[0]}")
        return 0
    plans = ["papers", "formats"] if args.command == "all" else [args.plan]
    if plans == [None]:
        ap.error(f"{args.command} needs a plan: one of {', '.join(NAMES)}")
    try:
        for plan in plans:
            if args.command in ("run", "all"):
                cmd_run(plan, args.quick, args.jobs, args.rerun_stale, args.keep_stale, args.stage)
            if args.command in ("report", "all"):
                cmd_report(plan, args.quick, args.partial)
            if args.command == "render":
                res = load(plan).render()
                print("\n".join(load(plan).summary_lines(res)))
            if args.command == "pilot":
                cmd_pilot(plan)
            if args.command == "plan":
                cmd_plan(plan)
    except StaleRunError as exc:
        print(f"study: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
