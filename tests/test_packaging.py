"""The wheel ships configs/ as mptrain.configs, so a non-editable install works from any directory."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_wheel_contains_every_config_and_the_console_scripts(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path),
         str(ROOT)],
        check=True, capture_output=True,
    )
    wheel = next(tmp_path.glob("mptrain-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    configs = {p.relative_to(ROOT / "configs").as_posix() for p in (ROOT / "configs").rglob("*.yaml")}
    assert configs and {f"mptrain/configs/{c}" for c in configs} <= names
    entry_points = zipfile.ZipFile(wheel).read(
        next(n for n in names if n.endswith("entry_points.txt"))
    ).decode()
    assert "mptrain = mptrain.cli:main" in entry_points


def test_installed_layout_runs_from_another_directory(tmp_path):
    """Install the wheel's files (no deps) into a folder and run the CLI from elsewhere."""
    site = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "-q", "--target", str(site),
         str(ROOT)],
        check=True, capture_output=True,
    )
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    r = subprocess.run(
        [sys.executable, "-c", "import mptrain, sys; print(mptrain.__file__); sys.argv=['mptrain','--help'];"
         "from mptrain.cli import main; main()"],
        cwd=elsewhere, capture_output=True, text=True, env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"},
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[0].startswith(str(site))
    model_line = next(line for line in r.stdout.splitlines() if line.strip().startswith("model "))
    assert all(m in model_line for m in ("alexnet", "googlenet", "inception_v3", "resnet50*", "vgg16"))
