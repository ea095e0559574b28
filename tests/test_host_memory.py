"""memory.keep_freed_host_memory: freed host memory is reused by the next allocation, not handed back
to the OS and faulted in again (the engine turns it on; trainer.keep_host_memory)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

# A process that allocates and frees what a step would, then counts the minor page faults of doing
# it again. 64 MiB: over glibc's largest default mmap threshold (32 MiB), so with the defaults every
# allocation is a fresh mapping, faulted in page by page.
CHURN = textwrap.dedent("""
    import resource, sys, torch
    from mptrain.memory import keep_freed_host_memory
    print(keep_freed_host_memory() if sys.argv[1] == "keep" else "defaults")
    def churn():
        for _ in range(10):
            a = torch.ones(16 << 20)
            b = torch.ones(1 << 18)
            del a, b
    churn()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    churn()
    print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
""")


def faults(setting: str) -> tuple[str, int]:
    out = subprocess.run([sys.executable, "-c", CHURN, setting], check=True, capture_output=True, text=True).stdout
    status, count = out.strip().splitlines()[-2:]
    return status, int(count)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt: Linux only")
def test_kept_host_memory_takes_no_page_faults_where_the_defaults_take_thousands() -> None:
    status, kept = faults("keep")
    if status != "kept":
        pytest.skip(f"not glibc here: {status}")
    _, defaults = faults("defaults")
    pages = 10 * (64 << 20) // 4096  # each 64 MiB tensor's pages, written once per allocation
    assert defaults >= pages // 2, defaults  # the defaults fault the fresh mapping in again
    assert kept < 100, kept


def host_memory_sentence(path: str = "docs/benchmarks/cpu-2026-11-26-host-memory.json") -> str:
    """The benchmark notes' sentence on keeping freed host memory, from its data."""
    d = json.loads((Path(__file__).resolve().parents[1] / path).read_text())
    rows = {r["mode"]: r for r in d["rows"]}
    for r in d["rows"]:  # the data's own arithmetic, checked
        assert abs(r["kept_vs_defaults"] - r["step_ms_kept"] / r["step_ms_defaults"]) < 1e-3
    modes = [m for m in rows if m != "fp32"]
    faults = ", ".join(f"{m} {rows[m]['faults_per_step_defaults']:.0f}" for m in modes)
    ratios = ", ".join(f"{m} {r['kept_vs_defaults']:.2f}" for m, r in rows.items())
    vs = ", ".join(f"{m} {rows[m]['vs_fp32_defaults']:.2f}× → {rows[m]['vs_fp32_kept']:.2f}×" for m in modes)
    fp32 = rows["fp32"]["faults_per_step_defaults"]
    return (f"with glibc's defaults a {d['model']} step took {fp32:.0f} page faults "
            f"in FP32 and {faults} in the emulated modes (medians of {d['rounds']} alternating processes); with freed "
            f"memory kept (`trainer.keep_host_memory`, on by default) at most "
            f"{max(r['faults_per_step_kept'] for r in rows.values()):.0f}. Step time kept / defaults: {ratios}. FP32 "
            f"gained too, so the ratios to FP32 moved little: {vs}")


def test_the_host_memory_figures_in_prose_are_their_data() -> None:
    text = " ".join((Path(__file__).resolve().parents[1] / "docs/benchmarks/README.md").read_text().split())
    assert host_memory_sentence() in text


# A malloc of its own in front of glibc's, as LD_PRELOAD puts tcmalloc or jemalloc there: it hands
# every call to glibc, so the process runs as before, but its malloc is no longer libc's.
WRAPPER = "#include <stddef.h>\nvoid *__libc_malloc(size_t);\nvoid *malloc(size_t n) { return __libc_malloc(n); }\n"


@pytest.mark.skipif(not sys.platform.startswith("linux") or not shutil.which("gcc"),
                    reason="a preloaded malloc, built by gcc")
def test_a_preloaded_allocator_is_named_and_glibcs_settings_left_alone(tmp_path: Path) -> None:
    """Under LD_PRELOAD's allocator (PyTorch's CPU tuning advice: tcmalloc, jemalloc) glibc's settings
    govern nothing, so the run says which allocator serves it rather than "kept"."""
    (tmp_path / "wrap.c").write_text(WRAPPER)
    lib = tmp_path / "libwrapmalloc.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-O1", "-o", str(lib), str(tmp_path / "wrap.c")], check=True)
    # what a run reports, with trainer.keep_host_memory off and on
    code = "from mptrain.memory import host_memory; print(host_memory(False)); print(host_memory(True))"
    status = [subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True,
                             env={**os.environ, "LD_PRELOAD": preload}).stdout.split("\n")[:2]
              for preload in ("", str(lib))]  # fmt: skip
    if status[0][1] != "kept":
        pytest.skip(f"not glibc here: {status[0][1]}")
    assert status[0][0] == "glibc defaults (trainer.keep_host_memory=false)"
    assert status[1] == ["libwrapmalloc.so (preloaded)"] * 2
