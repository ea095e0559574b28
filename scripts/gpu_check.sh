#!/usr/bin/env bash
# One-call GPU acceptance: the CUDA tests, the CPU suite, the main job and the ResNet-50 benchmark
# table, in at most 9 minutes on one H100. docs/benchmarks/README.md says how to run it through the
# device tool:
#
#   bash scripts/gpu_wheels.sh                      # here, once: Hydra & co. into .whl/
#   run(command="bash scripts/gpu_check.sh", carry=[".whl"], timeout_s=600)
#
# Stages run in order of what matters most, each under its own time limit, so that a slow stage
# costs the ones after it, never the whole call; the last (compile on) gets what time is left.
# Everything lands in $OUT (the device tool brings it back) or, elsewhere, docs/benchmarks/.
set -uo pipefail
cd "$(dirname "$0")/.."

BUDGET=${GPU_CHECK_BUDGET_S:-535}
OUT_DIR=${OUT:-docs/benchmarks}
mkdir -p "$OUT_DIR"
DATE=$(date -u +%Y-%m-%d)
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
case "$GPU" in
  *H200*) SLUG=h200 ;; *H100*) SLUG=h100 ;; *) SLUG=gpu ;;
esac
LOG="$OUT_DIR/$SLUG-$DATE-gpu-check.log"
WORK=$(mktemp -d)
exec > >(tee "$LOG") 2>&1

say() { printf '\n== [%4ds] %s\n' "$SECONDS" "$*"; }
left() { echo $((BUDGET - SECONDS)); }

# The GPU machine has torch, torchvision, tensorboard, rich and pytest; the rest comes as wheels.
source scripts/gpu_env.sh
export MPTRAIN_RUNS=$WORK/runs PYTHONUNBUFFERED=1

say "device"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
python3 - <<'EOF'
import platform, torch
print("python", platform.python_version(), "| torch", torch.__version__, "| cuda", torch.version.cuda,
      "| cudnn", torch.backends.cudnn.version(), "| cpu", torch.backends.cpu.get_cpu_capability())
try:
    import torchao
    print("torchao", torchao.__version__)
except Exception as exc:  # noqa: BLE001 - report, don't stop
    print("torchao: not importable:", str(exc).splitlines()[0][:200])
EOF

declare -A RESULT

# 1. The CUDA tests and the CPU suite side by side: one uses the GPU, the other the 16 cores, and
#    neither is timed. The CPU suite runs with the GPU visible, as it would on a user's GPU box.
say "CUDA tests (pytest -m cuda) || CPU suite (pytest -m 'not cuda' -n 8)"
timeout 300 python3 -m pytest -m cuda -q -p no:cacheprovider -rfEs >"$WORK/cuda.log" 2>&1 &
cuda_pid=$!
timeout 300 python3 -m pytest -m "not cuda" -q -p no:cacheprovider -n 8 -rfE >"$WORK/cpu.log" 2>&1 &
cpu_pid=$!
wait $cuda_pid; RESULT[cuda_tests]=$?
wait $cpu_pid; RESULT[cpu_suite]=$?
echo "--- CUDA tests (exit ${RESULT[cuda_tests]})"; tail -40 "$WORK/cuda.log"
echo "--- CPU suite (exit ${RESULT[cpu_suite]})"; tail -25 "$WORK/cpu.log"

# 2. The README's main job, end to end.
say "main job: mptrain model=resnet50 precision=mixed"
timeout 150 python3 -m mptrain model=resnet50 precision=mixed hydra.run.dir="$WORK/main" 2>&1 | tail -22
RESULT[main_job]=${PIPESTATUS[0]}
cp "$WORK/main/summary.json" "$OUT_DIR/$SLUG-$DATE-main-job.json" 2>/dev/null

# 3. The benchmark table: ResNet-50, 224 px, batch 256, synthetic, channels_last, every precision,
#    engine against the bare loop. Compile off first (the targets), then on with the time left.
BENCH=(python3 -m mptrain.bench --models resnet50 --batch-sizes 256 --image-size 224 --steps 20 --window 5
       --warmup 5 --precisions fp32,tf32,amp_fp16,amp_bf16,fp16_master,fp8,fp8_torchao)
say "benchmark, compile off"
timeout 220 "${BENCH[@]}" --overrides trainer.channels_last=true --out "$OUT_DIR" --name "$SLUG-$DATE"
RESULT[bench]=$?
say "benchmark, compile on ($(left) s left)"
if [ "$(left)" -gt 60 ]; then
  timeout "$(left)" "${BENCH[@]}" --overrides trainer.channels_last=true trainer.compile=true \
      --out "$OUT_DIR" --name "$SLUG-$DATE-compile"
  RESULT[bench_compile]=$?
else
  RESULT[bench_compile]=skipped
fi

say "summary (exit status per stage; 124 = ran out of its time)"
echo "  (the input pipeline's GPU figures are separate calls: scripts/gpu_check_data.sh loader|train)"
status=0
for k in cuda_tests cpu_suite main_job bench bench_compile; do
  printf '  %-14s %s\n' "$k" "${RESULT[$k]}"
  [[ ${RESULT[$k]} == 0 || ${RESULT[$k]} == skipped ]] || status=1
done
grep -hE "^(FAILED|ERROR)|passed|failed" "$WORK/cuda.log" "$WORK/cpu.log" | tail -30 || true
exit $status  # 0: every stage that ran passed
