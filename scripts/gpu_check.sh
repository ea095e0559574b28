#!/usr/bin/env bash
# One-call GPU acceptance: imports, the CUDA tests beside the CPU suite, the main job, the ResNet-50
# table and the transformer's FP8 table, all inside one device command (600 s). How to run it:
#
#   bash scripts/gpu_wheels.sh                      # here, once: Hydra, omegaconf, torchao into .whl/
#   run(command="bash scripts/gpu_check.sh", carry=[".whl"], timeout_s=600)
#
# Every stage runs under min(its own cap, the time left of GPU_CHECK_BUDGET_S), so a slow stage
# costs the ones after it, never the whole call. pytest gets SIGINT at its limit (so it still
# prints its summary) and --timeout per test. Every log lands in $OUT (the device tool brings it
# back) or, elsewhere, docs/benchmarks/. Exit status 0 only when every stage that ran passed.
set -uo pipefail
cd "$(dirname "$0")/.."

BUDGET=${GPU_CHECK_BUDGET_S:-570}
OUT_DIR=${OUT:-docs/benchmarks}
mkdir -p "$OUT_DIR"
DATE=$(date -u +%Y-%m-%d)
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
case "$GPU" in
  *H200*) SLUG=h200 ;; *H100*) SLUG=h100 ;; *) SLUG=gpu ;;
esac
WORK=$(mktemp -d)
exec > >(tee "$OUT_DIR/$SLUG-$DATE-gpu-check.log") 2>&1

say() { printf '\n== [%4ds] %s\n' "$SECONDS" "$*"; }
left() { echo $((BUDGET - SECONDS)); }
cap() { local l; l=$(left); echo $(( $1 < l ? $1 : l )); }  # min(stage cap, time left)
declare -A RESULT
# stage NAME CAP CMD...: runs CMD under min(CAP, time left), SIGINT first (pytest prints its
# summary), SIGKILL 10 s later; its output lands in the check's log. (The device tool brings back
# at most 8 files: this log, the two pytest logs, the main job's summary and two benchmark pairs.)
stage() {
  local name=$1 limit; limit=$(cap "$2"); shift 2
  say "$name (limit ${limit}s)"
  if [ "$limit" -lt 20 ]; then RESULT[$name]=skipped; echo "  skipped: no time left"; return; fi
  timeout -s INT -k 10 "$limit" "$@"
  RESULT[$name]=$?
}

# The GPU machine has torch, torchvision, tensorboard, rich, pytest, pytest-xdist and
# pytest-timeout; Hydra, omegaconf and torchao come as wheels pinned to import against its torch.
source scripts/gpu_env.sh
export MPTRAIN_RUNS=$WORK/runs PYTHONUNBUFFERED=1

# 0. First: do the carried wheels import against this machine's torch? Nothing else can work if not.
stage imports 60 python3 - <<'EOF'
import platform, torch
gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "none (a dry run: the CUDA tests skip)"
print("gpu", gpu, "| python", platform.python_version(), "| torch", torch.__version__,
      "| cuda", torch.version.cuda, "| cudnn", torch.backends.cudnn.version())
import hydra, omegaconf, torchao, torchao.float8  # noqa: E401
import mptrain.engine  # noqa: F401
print("hydra", hydra.__version__, "| omegaconf", omegaconf.__version__, "| torchao", torchao.__version__)
EOF
if [ "${RESULT[imports]}" != 0 ]; then
  echo "imports failed: fix the wheels (scripts/gpu_wheels.sh) before anything else"; exit 1
fi

# 1. The CUDA tests and the CPU suite side by side: one uses the GPU, the other 8 of the 16 cores
#    (one thread each). The CPU suite runs with the GPU visible, as it would on a user's GPU box.
say "CUDA tests || CPU suite"
limit=$(cap 250)
timeout -s INT -k 10 "$limit" python3 -m pytest -m cuda -q -p no:cacheprovider -rfEs --timeout 120 \
    >"$OUT_DIR/$SLUG-$DATE-cuda-tests.log" 2>&1 &
cuda_pid=$!
OMP_NUM_THREADS=1 timeout -s INT -k 10 "$limit" python3 -m pytest -m "not cuda" -q -p no:cacheprovider -n 8 \
    -rfE --timeout 120 >"$OUT_DIR/$SLUG-$DATE-cpu-suite.log" 2>&1 &
cpu_pid=$!
wait $cuda_pid; RESULT[cuda_tests]=$?
wait $cpu_pid; RESULT[cpu_suite]=$?
echo "--- CUDA tests (exit ${RESULT[cuda_tests]})"; tail -40 "$OUT_DIR/$SLUG-$DATE-cuda-tests.log"
echo "--- CPU suite (exit ${RESULT[cpu_suite]})"; tail -25 "$OUT_DIR/$SLUG-$DATE-cpu-suite.log"

# 2. The README's main job, end to end; it passes only if it completed with a finite loss.
stage main_job 120 python3 -m mptrain model=resnet50 precision=mixed hydra.run.dir="$WORK/main"
cp "$WORK/main/summary.json" "$OUT_DIR/$SLUG-$DATE-main-job.json" 2>/dev/null
if [ "${RESULT[main_job]}" = 0 ]; then
  python3 - "$WORK/main/summary.json" <<'EOF' || RESULT[main_job]=summary
import json, math, sys
s = json.load(open(sys.argv[1]))
print("main job:", s["status"], "| final loss", s["final_loss"], "| throughput", s["throughput"], s["throughput_unit"])
assert s["status"] == "completed" and math.isfinite(s["final_loss"]), "main job did not complete with a finite loss"
EOF
fi

# 3. ResNet-50 at 224 px, batch 256, channels_last: the precisions against fp32 and the bare loop.
#    No FP8 here: torchao converts only the classifier (its plan says so), a sliver of the FLOPs.
stage bench_resnet50 150 python3 -m mptrain.bench --models resnet50 --batch-sizes 256 --image-size 224 \
    --steps 20 --window 5 --warmup 5 --precisions fp32,tf32,amp_fp16,amp_bf16,fp16_master \
    --overrides trainer.channels_last=true --out "$OUT_DIR" --name "$SLUG-$DATE-resnet50"

# 4. FP8 where it pays: the transformer LM, bf16 against torchao float8 (tensorwise and rowwise),
#    compile on. The cells record which layers converted and their share of the FLOPs.
stage bench_fp8 400 python3 -m mptrain.bench --models transformer_lm --batch-sizes 32 --steps 20 --window 5 \
    --warmup 5 --precisions amp_bf16,fp8_torchao,fp8_torchao_rowwise --overrides trainer.compile=true \
    --out "$OUT_DIR" --name "$SLUG-$DATE-transformer-fp8"

say "summary (exit status per stage; 124/130 = ran out of its time)"
echo "  (the input pipeline's GPU figures are separate calls: scripts/gpu_check_data.sh loader|train)"
status=0
for k in imports cuda_tests cpu_suite main_job bench_resnet50 bench_fp8; do
  printf '  %-15s %s\n' "$k" "${RESULT[$k]:-not run}"
  [[ ${RESULT[$k]:-} == 0 || ${RESULT[$k]:-} == skipped ]] || status=1
done
grep -hE "^(FAILED|ERROR)|passed|failed" "$OUT_DIR/$SLUG-$DATE-cuda-tests.log" "$OUT_DIR/$SLUG-$DATE-cpu-suite.log" \
    | tail -30 || true
exit $status
