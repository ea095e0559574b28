"""The study's plans: each module says which runs, which claims and which margins (issue 27).

``harness.py`` runs them all the same way (stamps, caching, pairing, provenance, pilots) and
mptrain.verdicts judges every claim. A plan module provides ``NAME``, ``DOCS`` (where its report
goes), ``specs(quick)``, ``report(runs, out, quick, code)``, ``render(out)`` and
``summary_lines(results)``; a plan not run yet provides ``plan_doc()`` (its plan file) and
``pilot_specs()`` (one short run per new cell type) instead of a report.
"""

from __future__ import annotations

import importlib
from types import ModuleType

NAMES = ("papers", "formats", "controls", "cnn_hard", "formats_like")


def load(name: str) -> ModuleType:
    if name not in NAMES:
        raise SystemExit(f"plan {name!r}: one of {', '.join(NAMES)}")
    return importlib.import_module(f"study_plans.{name}")
