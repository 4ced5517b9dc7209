#!/usr/bin/env bash
# Every GPU check and figure issue 18 owes, in few device calls. Logs (and a summary) land in $OUT.
#
#   here, once:      bash ../shared/gpu/prepare.sh        # stages wheels + on-device.sh in .gpu/
#   on the device:   run(command="bash bench/gpu_all.sh tests", carry=[".gpu"])   # ~8 min (see below)
#                    run(command="bash bench/gpu_all.sh kernels profile e2e", carry=[".gpu"])  # ~3 min
#                    run(command="bash bench/gpu_all.sh sweep host", carry=[".gpu"])   # ~4 min
#                    run(command="bash bench/gpu_all.sh hf", carry=[".gpu"])        # HF baseline, ~6 min
#                    run(command="bash bench/gpu_all.sh owed profile host", carry=[".gpu"])  # what is owed, ~7 min
#                    run(command="bash bench/gpu_all.sh async_tests async", carry=[".gpu"])  # issue 46, ~5 min
#                    run(command="bash bench/gpu_all.sh moe", carry=[".gpu"])   # MoE kernel tests + figures, ~2 min
#                    run(command="bash bench/gpu_all.sh spec", carry=[".gpu"])  # speculative decoding, ~6 min
#                    run(command="bash bench/gpu_all.sh spec_draft", carry=[".gpu"])  # draft-model speculation, ~6 min
#                    run(command="bash bench/gpu_all.sh spec_eagle", carry=[".gpu"])  # EAGLE-3 speculation, ~5 min
#                    run(command="bash bench/gpu_all.sh pd_tests", carry=[".gpu"])  # P/D blocks on CUDA, ~2 min
#                    run(command="bash bench/gpu_all.sh swa_tests", carry=[".gpu"])  # sliding-window KV freeing + hybrid KV groups, ~3 min
#                    run(command="bash bench/gpu_all.sh lora", carry=[".gpu"])  # LoRA kernels, graphs, figures, ~4 min
#
# Measured on an H200 (2026-11-27): the kernel tests take ~20 s over 8 xdist workers; the tests that build
# an engine on CUDA are slow (one with two engines took 33 s alone; 6 of 13 ran in 200 s serially);
# kernels 18 s, profile 60 + 49 s, e2e 55 s, sweep 43 s (+ 75 s for its winner's e2e and table), host
# greedy 61 s.
# Stages (default: tests kernels profile e2e; also owed sweep hf host async async_tests moe spec spec_draft spec_eagle lora pd_tests swa_tests): pass stage names to run a subset. Each
# stage has its own timeout, so one hang still leaves every other log. The device tool caps a call at 10
# minutes and lends a session 15 minutes of device time in all: pick the stages that the session needs.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
# shellcheck disable=SC1091
if ! source .gpu/on-device.sh >"$OUT/env.log" 2>&1; then
  cat "$OUT/env.log"; echo "on-device.sh failed: run ../shared/gpu/prepare.sh here and carry .gpu"; exit 1
fi
cat "$OUT/env.log"
git log -1 --format='commit %h %s' 2>/dev/null || true
# Compiled kernels, never the interpreter (tests/conftest.py turns it on when it sees no /dev/nvidia0).
export TRITON_INTERPRET=0
# Triton compiles are CPU-bound: spread the correctness tests over workers when pytest-xdist is there.
xdist=(); python -c "import xdist" 2>/dev/null && xdist=(-n 8)
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
    # Kernel tests in parallel; the tests that build an engine one at a time (each engine takes 90% of
    # the GPU's memory for its KV cache, as vLLM's gpu_memory_utilization does: side by side they OOM).
    tests)   stage tests_kernels 120 python -m pytest -q -p no:cacheprovider "${xdist[@]}" --timeout 120 -rfE \
               -m "slow or not slow" tests/kernels --ignore tests/kernels/test_triton_engine.py
             stage tests_engine 480 python -m pytest -q -p no:cacheprovider --timeout 120 -rfE \
               -m "slow or not slow" tests/kernels/test_triton_engine.py tests/gpu \
               tests/engine/test_profile_run.py tests/engine/test_cuda_graph_plan.py ;;
    # What the 2026-11-27 H200 session could not run natively (its device time ran out), ~3 min.
    owed)    stage tests_owed 300 python -m pytest -q -p no:cacheprovider --timeout 120 -rfE \
               "tests/gpu/test_cuda_graphs.py::test_short_rotary_cache_with_a_large_token_budget" \
               "tests/gpu/test_cuda_graphs.py::test_torch_backend_on_cuda_runs_without_graphs" \
               "tests/engine/test_profile_run.py::test_profile_run_on_the_triton_backend" \
               tests/engine/test_cuda_graph_plan.py ;;
    # The decode launch-shape sweep, then the whole engine and the table with its winner (if it won).
    sweep)   stage attention_sweep 150 python bench/kernel_attention.py --sweep --best-out "$OUT/attn_best.txt"
             best=$(cat "$OUT/attn_best.txt" 2>/dev/null)
             if [ -n "$best" ]; then
               stage gpu_e2e_best 120 env TANDEM_DECODE_ATTENTION="$best" python bench/gpu_e2e.py --skip-hf
               stage kernel_attention_best 60 env TANDEM_DECODE_ATTENTION="$best" python bench/kernel_attention.py
             fi ;;
    kernels) stage kernel_attention 120 python bench/kernel_attention.py ;;
    profile) stage gpu_profile 150 python bench/gpu_profile.py --batch 1 16 64 256 --trace "$OUT/trace"
             stage gpu_profile_unfused 90 env TANDEM_FUSED_KERNELS=0 python bench/gpu_profile.py --batch 1 64 ;;
    e2e)     stage gpu_e2e 170 python bench/gpu_e2e.py --skip-hf ;;
    hf)      stage gpu_e2e_hf 560 python bench/gpu_e2e.py --hf-batch-size 128 ;;
    # Async scheduling: token-exact against synchronous scheduling on CUDA, then e2e and the decode profile
    # with it off and on, each pair in one process (one model build, one bandwidth measurement).
    pd_tests) stage tests_pd 240 python -m pytest -q -p no:cacheprovider --timeout 200 -rfE \
               -m "slow or not slow" tests/gpu/test_kv_transfer_gpu.py ;;
    # Sliding-window KV freeing through the Triton kernels (issue 41, helper swa): exact against transformers
    # and against keeping every block.
    swa_tests) stage tests_swa 240 python -m pytest -q -p no:cacheprovider --timeout 200 -rfE \
               -m "slow or not slow" tests/gpu/test_sliding_window_gpu.py ;;
    async_tests) stage tests_async 240 python -m pytest -q -p no:cacheprovider --timeout 120 -rfE \
               -m "slow or not slow" tests/gpu/test_async_scheduling.py ;;
    async)   stage gpu_e2e_async 170 python bench/gpu_e2e.py --skip-hf --async-scheduling off on
             stage gpu_profile_async 150 python bench/gpu_profile.py --batch 1 64 256 --async-scheduling off on \
               --trace "$OUT/trace" ;;
    host)    stage gpu_host_step 90 python bench/gpu_host_step.py --device cuda --attention-backend triton
             stage gpu_host_step_t06 90 python bench/gpu_host_step.py --device cuda --attention-backend triton \
               --temperature 0.6 ;;
    # MoE (~2 min): the fused_moe kernel's tests natively and the MoE models through the Triton engine, then
    # the kernel against grouped torch GEMMs (bench/kernel_moe.py).
    moe)     stage tests_moe 75 python -m pytest -q -p no:cacheprovider --timeout 60 -rfE -m "slow or not slow" \
               tests/kernels/test_fused_moe.py "tests/kernels/test_triton_engine.py::test_triton_backend_matches_transformers[qwen3_moe]" \
               "tests/kernels/test_triton_engine.py::test_triton_backend_matches_transformers[mixtral]"
             stage kernel_moe 45 python bench/kernel_moe.py ;;
    # Speculative decoding (~6 min): ngram greedy == plain on CUDA (Triton attention for the verification
    # queries), SmolLM2 included; then on vs off at batch 1 and 32 (bench/spec_decode.py).
    spec)    stage tests_spec 300 python -m pytest -q -p no:cacheprovider --timeout 200 -rfE -m "slow or not slow" \
               tests/engine/test_spec_decode.py tests/realmodel/test_spec_decode_real.py
             stage spec_decode_b1 120 python bench/spec_decode.py --rounds 3 --dtype bfloat16
             stage spec_decode_b32 120 python bench/spec_decode.py --rounds 3 --dtype bfloat16 --batch-size 32 ;;
    # Draft-model speculation (~6 min): greedy == plain on CUDA with a draft model (its own KV cache through
    # Triton attention), the sampled chi-square, SmolLM2 with an 8-layer draft; then on vs off at batch 1
    # and 32 with a draft of SmolLM2's first 4 layers (bench/spec_decode.py --method draft_model).
    spec_draft) stage tests_spec_draft 300 python -m pytest -q -p no:cacheprovider --timeout 200 -rfE \
               -m "slow or not slow" -k "not tp2 and not tandem_serve" tests/engine/test_spec_draft_model.py \
               "tests/realmodel/test_spec_decode_real.py::test_greedy_draft_model_equals_transformers_and_plain"
             stage spec_draft_b1 120 python bench/spec_decode.py --method draft_model --rounds 3 --dtype bfloat16
             stage spec_draft_b32 120 python bench/spec_decode.py --method draft_model --rounds 3 --dtype bfloat16 \
               --batch-size 32 ;;
    # EAGLE-3 (~5 min): the head's drafts equal the torch reference on CUDA (Triton attention, fused
    # kernels), greedy == plain with random and constant heads, prefix hits, preemption; then on vs off at
    # batch 1 and 32 with a random head for SmolLM2 (bench/spec_decode.py --method eagle3: acceptance ~0,
    # so ms/step is the cost of the head's passes plus verification).
    spec_eagle) stage tests_spec_eagle 240 python -m pytest -q -p no:cacheprovider --timeout 200 -rfE \
               -m "slow or not slow" -k "not tp2 and not tandem_serve" tests/engine/test_spec_eagle3.py
             stage spec_eagle_b1 120 python bench/spec_decode.py --method eagle3 --rounds 3 --dtype bfloat16
             stage spec_eagle_b32 120 python bench/spec_decode.py --method eagle3 --rounds 3 --dtype bfloat16 \
               --batch-size 32 ;;
    # LoRA (~3 min): the kernels vs the torch reference, the PEFT oracle on CUDA with the kernels and CUDA
    # graphs, graphs vs eager with adapters swapped between replays, the kernels' bandwidth, then a decode
    # step with 0 / 1 / 8 adapters (bench/lora_step.py; both engines replay graphs).
    lora)    stage tests_lora 200 python -m pytest -q -p no:cacheprovider --timeout 120 -rfE -m "slow or not slow" \
               tests/kernels/test_lora.py tests/kernels/test_lora_slots.py tests/gpu/test_lora_gpu.py
             stage kernel_lora 60 python bench/kernel_lora.py
             stage lora_step 150 bash -c "python -m entrypoints.cli make-demo-model /tmp/smollm2 --dtype float32 && \
               python bench/lora_step.py --model /tmp/smollm2 --device cuda --dtype bfloat16 --batch 32 --rank 16 \
               --adapters 8 --rounds 5" ;;
    *)       echo "unknown stage $s (tests owed kernels sweep profile e2e hf host async async_tests moe spec spec_draft spec_eagle lora pd_tests swa_tests)"; exit 2 ;;
  esac
done
echo; cat "$OUT/summary.txt"
