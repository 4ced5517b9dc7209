#!/usr/bin/env bash
# Every GPU check and figure issue 11 owes, in one device call. Logs (and a summary) land in $OUT.
#
#   here, once:      bash ../shared/gpu/prepare.sh        # stages wheels + on-device.sh in .gpu/
#   on the device:   run(command="bash bench/gpu_all.sh", carry=[".gpu"])           # ~8 min
#                    run(command="bash bench/gpu_all.sh hf", carry=[".gpu"])        # HF baseline, ~6 min
#                    run(command="bash bench/gpu_all.sh host", carry=[".gpu"])      # host time per step, ~3 min
#
# Stages (default: tests kernels profile e2e): pass stage names to run a subset. Each stage has its own
# timeout, so one hang still leaves every other log. The device tool caps a call at 10 minutes.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
# shellcheck disable=SC1091
if ! source .gpu/on-device.sh >"$OUT/env.log" 2>&1; then
  cat "$OUT/env.log"; echo "on-device.sh failed: run ../shared/gpu/prepare.sh here and carry .gpu"; exit 1
fi
cat "$OUT/env.log"
stages=("$@")
[ ${#stages[@]} -eq 0 ] && stages=(tests kernels profile e2e)

stage() {  # stage NAME TIMEOUT_S COMMAND...: run, log to $OUT/NAME.log, record rc in the summary
  local name=$1 limit=$2; shift 2
  echo "=== $name: $*" | tee -a "$OUT/summary.txt"
  local t0=$SECONDS
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  echo "    rc=$rc in $((SECONDS - t0)) s" | tee -a "$OUT/summary.txt"
  tail -n 60 "$OUT/$name.log"
}

for s in "${stages[@]}"; do
  case $s in
    tests)   stage tests 240 python -m pytest -q -p no:cacheprovider -m "slow or not slow" tests/kernels tests/gpu \
               tests/engine/test_profile_run.py tests/engine/test_cuda_graph_plan.py ;;
    kernels) stage kernel_attention 150 python bench/kernel_attention.py ;;
    profile) stage gpu_profile 150 python bench/gpu_profile.py --batch 1 16 64 256 --trace "$OUT/trace"
             stage gpu_profile_unfused 90 env TANDEM_FUSED_KERNELS=0 python bench/gpu_profile.py --batch 1 64 ;;
    e2e)     stage gpu_e2e 200 python bench/gpu_e2e.py --skip-hf ;;
    hf)      stage gpu_e2e_hf 560 python bench/gpu_e2e.py --hf-batch-size 128 ;;
    host)    stage gpu_host_step 240 python bench/gpu_host_step.py --device cuda --attention-backend triton
             stage gpu_host_step_t06 240 python bench/gpu_host_step.py --device cuda --attention-backend triton \
               --temperature 0.6 ;;
    *)       echo "unknown stage $s (tests kernels profile e2e hf host)"; exit 2 ;;
  esac
done
echo; cat "$OUT/summary.txt"
