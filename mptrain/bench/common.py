"""What both benchmark harnesses (``mptrain.bench.harness``, ``mptrain.bench.data``) stamp their results with.

Its own module so that ``mptrain-bench`` can hand ``data`` to ``mptrain.bench.data`` without the two
importing each other.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import re
import shlex
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "cpu"


def code_commit() -> str | None:
    """The commit of the mptrain checkout that runs (``-dirty`` with uncommitted changes to it), or
    None outside a git checkout (an installed wheel): a figure names the code that measured it."""
    root = Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, timeout=10)
        if head.returncode != 0:
            return None
        changed = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--", "mptrain"],
                                 capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head.stdout.strip() + ("-dirty" if changed else "")


def stamp(device: torch.device, argv: list[str], threads: int) -> dict[str, Any]:
    from mptrain.engine import versions

    info: dict[str, Any] = {
        "device": device.type,
        "device_name": device_name(device),
        "versions": versions(),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "commit": code_commit(),
        "command": shlex.join(["mptrain-bench", *argv]),
        "torch_threads": threads,
        "cpu_count": os.cpu_count(),
        "host": platform.node(),
        "platform": platform.platform(),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info["cuda_capability"] = f"{props.major}.{props.minor}"
        info["device_memory_bytes"] = props.total_memory
    if hasattr(os, "getloadavg"):
        info["load_average_start"] = load_averages()
    return info


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def load_averages() -> list[float]:
    """The 1, 5 and 15 minute load averages, rounded: what a CPU benchmark states beside its figures."""
    return [round(v, 2) for v in os.getloadavg()] if hasattr(os, "getloadavg") else []


def write_report(out: Path, name: str, result: dict[str, Any], markdown: str) -> None:
    """A benchmark script's result as ``name``.json and its table as ``name``.md, under ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / f"{name}.md").write_text(markdown)


def cpu_script_stamp(script: str, argv: list[str] | None) -> dict[str, Any]:
    """The stamp of a CPU benchmark script run as ``python scripts/<script> <argv>``, on one torch
    thread (it sets that): the interleaved side-by-side measurements the issues ask for."""
    argv = sys.argv[1:] if argv is None else argv
    torch.set_num_threads(1)
    info = stamp(torch.device("cpu"), argv, 1)
    info["command"] = f"python scripts/{script} " + " ".join(argv)
    info["cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    return info


def cpu_header(info: dict[str, Any], title: str, *lines: str) -> list[str]:
    """The head of a CPU benchmark script's markdown: the machine, the versions, the date and the
    load at start and end, the command, then ``lines`` (its model, its method)."""
    return [
        f"# {title}",
        "",
        f"- device: {info['device_name']}, torch CPU capability `{info['cpu_capability']}`, one torch thread",
        f"- versions: torch {info['versions']['torch']}, Python {info['versions']['python']}",
        f"- date: {info['date']}; load average at start {' / '.join(map(str, info['load_average_start']))}, "
        f"at end {' / '.join(map(str, info['load_average_end']))}",
        f"- command: `{info['command']}`",
        *lines,
        "",
    ]
