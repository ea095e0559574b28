"""The wheel ships configs/ as mptrain.configs, so a non-editable install works from any directory."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of what the build reads. Building in the checkout writes build/ and *.egg-info there,
    which two builds at once (pytest -n 8, or a pip install beside the suite) would race over."""
    dst = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, dst / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in ("mptrain", "configs"):
        shutil.copytree(ROOT / name, dst / name, ignore=ignore)
    return dst


def test_wheel_contains_every_config_and_the_console_scripts(tmp_path, source):
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path),
         str(source)],
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


def test_installed_layout_runs_from_another_directory(tmp_path, source):
    """Install the wheel's files (no deps) into a folder and run the CLI from elsewhere."""
    site = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "-q", "--target", str(site),
         str(source)],
        check=True, capture_output=True,
    )
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    # The checkout leaves the path (its mptrain must not be the one imported); the rest stays:
    # on the GPU machine Hydra and omegaconf live only in a wheel folder on PYTHONPATH.
    kept = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
            if p and Path(p).resolve() != ROOT]
    r = subprocess.run(
        [sys.executable, "-c", "import mptrain, sys; print(mptrain.__file__); sys.argv=['mptrain','--help'];"
         "from mptrain.cli import main; main()"],
        cwd=elsewhere, capture_output=True, text=True,
        env={"PYTHONPATH": os.pathsep.join([str(site), *kept]), "PATH": "/usr/bin:/bin"},
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[0].startswith(str(site))
    model_line = next(line for line in r.stdout.splitlines() if line.strip().startswith("model "))
    assert all(m in model_line for m in ("alexnet", "googlenet", "inception_v3", "resnet50*", "vgg16"))


def test_the_minimum_torch_is_the_one_readme_installs_and_ci_tests():
    pyproject = (ROOT / "pyproject.toml").read_text()
    torch_min = re.search(r'"torch>=([0-9.]+)"', pyproject).group(1)
    vision_min = re.search(r'"torchvision>=([0-9.]+)"', pyproject).group(1)
    pins = f'"torch=={torch_min}.*" "torchvision=={vision_min}.*"'
    assert f'pip install ".[test]" {pins}' in (ROOT / "README.md").read_text()
    assert f"run min_torch {pins}" in (ROOT / ".ci" / "run").read_text()
    assert "run latest_torch\n" in (ROOT / ".ci" / "run").read_text()


def _requirement(spec: str) -> tuple[str, str]:
    """(name, version specifier) of a PEP 508 requirement string, extras and markers aside."""
    from packaging.requirements import Requirement

    req = Requirement(spec)
    return req.name, str(req.specifier)


def test_the_dockerfile_installs_what_pyproject_requires():
    """The image's torch and torchvision pins, its Python and its extras, parsed from both files: a
    base image with an older torch (the Dockerfile once pinned 2.7.1 against torch>=2.11) fails."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    needs = dict(_requirement(r) for r in project["dependencies"])
    docker = (ROOT / "Dockerfile").read_text()
    base = re.search(r"^FROM python:(\d+\.\d+)", docker, re.M)
    assert base, "the Dockerfile's base is not a python:X.Y image (the torch it brings is not checked)"
    assert SpecifierSet(project["requires-python"]).contains(base.group(1) + ".0")
    install = next(line for line in docker.splitlines() if line.startswith("RUN pip install"))
    args = re.findall(r'"([^"]+)"', install)
    pins = dict(_requirement(a) for a in args if not a.startswith("."))
    for name in ("torch", "torchvision"):
        pinned = re.fullmatch(r"==(\d+\.\d+)\.\*", pins.get(name, ""))
        assert pinned, f"the Dockerfile does not pin {name}==X.Y.*: {pins.get(name)!r}"
        assert SpecifierSet(needs[name]).contains(Version(pinned.group(1) + ".0")), (name, pinned.group(0), needs[name])
    local = next(a for a in args if a.startswith("."))
    extras = re.fullmatch(r"\.\[([\w,]+)\]", local)
    assert extras and set(extras.group(1).split(",")) <= set(project["optional-dependencies"])
