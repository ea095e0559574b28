#!/usr/bin/env bash
# Fetch, on a machine with PyPI, the wheels that the GPU machine lacks (it has torch 2.11,
# torchvision 0.26, tensorboard, rich, pytest, pytest-xdist, pytest-timeout, scikit-learn and
# matplotlib, but no Hydra), into .whl/ (git-ignored), for the device tool to carry. Python 3.12
# there; all of these are pure Python except torchao (abi3). The pins are what README's install on
# torch 2.11 resolves to (pip install ".[test]" "torch==2.11.*" "torchvision==0.26.*"), the suite's
# versions there, and none imports the deprecated pkg_resources (submitit 1.5.3 did; 1.5.4 does
# not). torchao 0.18 is the first for torch 2.11. gpu_check.sh imports them all as its first stage.
# antlr4-python3-runtime 4.9.3 (pinned by omegaconf) ships as an sdist only, so its wheel is built here.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .whl && mkdir -p .whl
plat=(--platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${plat[@]}" \
    -d .whl "hydra-core==1.3.8" "omegaconf==2.3.1" "submitit==1.5.4" "hydra-submitit-launcher==1.2.0" \
    "torchao==0.18.0"
python3 -m pip wheel -q --no-deps -w .whl "antlr4-python3-runtime==4.9.3"
ls -la .whl
