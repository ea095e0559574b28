#!/usr/bin/env bash
# Issue 13 on a lent GPU (device tool, one call each, < 10 min each): the input pipeline's CUDA tests,
# the loader alone per decode path, and the end-to-end target (ResNet-50 mixed at 224 px on a JPEG
# image_folder within 90% of synthetic data), both figures from one harness run.
#   run(command="bash scripts/gpu_check_data.sh loader", carry=[".whl"], timeout_s=600)  (see gpu_check.sh)
#   bash scripts/gpu_check_data.sh tests     # ~1 min
#   bash scripts/gpu_check_data.sh loader    # ~3-5 min
#   bash scripts/gpu_check_data.sh train     # ~3-5 min (writes a 3 GB JPEG tree first)
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_env.sh  # mptrain from this checkout, Hydra & co. from the carried .whl/
OUT=${OUT:-docs/benchmarks}
what=${1:-all}
case "$what" in tests|loader|train|all) ;; *) echo "usage: $0 [tests|loader|train|all]" >&2; exit 2 ;; esac
if [[ $what == tests || $what == all ]]; then
  python3 -m pytest tests/test_input_pipeline.py -m cuda -q
fi
if [[ $what == loader || $what == all ]]; then
  python3 -m mptrain.bench data --device cuda --workers 4,8,15 --decodes pil,cpu,gpu --batch-size 256 \
    --images 4096 --val-images 1024 --rounds 3 --channels-last --out "$OUT" --name data-h100-loader
fi
if [[ $what == train || $what == all ]]; then
  python3 -m mptrain.bench data --device cuda --workers 15 --decodes cpu,gpu --batch-size 256 --images 32768 \
    --val-images 512 --splits "" --channels-last --train resnet50 --train-steps 200 --train-log-every 20 \
    --train-overrides precision=mixed --out "$OUT" --name data-h100-train
fi
