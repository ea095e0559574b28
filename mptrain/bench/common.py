"""What both benchmark harnesses (``mptrain.bench.harness``, ``mptrain.bench.data``) stamp their results with.

Its own module so that ``mptrain-bench`` can hand ``data`` to ``mptrain.bench.data`` without the two
importing each other.
"""

from __future__ import annotations

import contextlib
import os
import platform
import re
import shlex
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


def stamp(device: torch.device, argv: list[str], threads: int) -> dict[str, Any]:
    from mptrain.engine import _versions

    info: dict[str, Any] = {
        "device": device.type,
        "device_name": device_name(device),
        "versions": _versions(),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
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
        info["load_average_start"] = [round(v, 2) for v in os.getloadavg()]
    return info


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")
