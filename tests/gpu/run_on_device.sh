#!/usr/bin/env bash
# One call on the lent GPU machine (see tests/gpu/README.md): install what was carried, then run
#   tests:  the GPU test suite, output in $OUT/gpu_tests.txt
#   bench:  benchmarks/gpu_load.py, JSON in $OUT
#   spec:   benchmarks/gpu_speculative.py, JSON in $OUT
#   mtp:    benchmarks/gpu_mtp.py (MTP drafting at known acceptance), JSON in $OUT
#   pending: what the CPU side built that no GPU has proven yet (see the mode below), each step bounded in time, its
#           results in $OUT as they come (a machine taken back keeps what ran)
#   speed:  issue 53's speed rows (the captured step on a Qwen3.5-shaped hybrid, MTP at 1/16/64 jobs)
#   probe:  issue 57's invariance probe (benchmarks/gpu_invariance_probe.py): per op and for the whole step, one row
#           alone vs in 2..64 rows, unpinned and pinned, and each pin's cost; JSONL lines in $OUT as they are measured.
#           Bounded by PROBE_S (default 470 s wall) and its own --budget-s (PROBE_BUDGET_S, default 450); carry the
#           exllamav3 1.6.5 wheel and its converter's needs (marisa-trie, pyyaml, pillow) and the prebuilt extension
# Usage: bash tests/gpu/run_on_device.sh tests|bench|spec|mtp|pending|speed|probe [pytest -k / benchmark args]
set -u
source tests/gpu/device_env.sh
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch; from importlib.metadata import version as v; print('torch', torch.__version__, 'exllamav3', v('exllamav3'))" | tee -a "$OUT/gpu.txt"
case "${1:-tests}" in
  tests)
    shift || true
    python3 -m pytest -m gpu tests/gpu -v -s -p no:cacheprovider "$@" 2>&1 | tee "$OUT/gpu_tests.txt" | grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed|max logit|decode steps|close\(\)|auto cache|agrees|tokens/s|LoRA|speculative|Error" ;;
  bench)
    shift || true
    python3 benchmarks/gpu_load.py --out "$OUT" "$@" 2>&1 | tee "$OUT/gpu_load.txt" | grep -vE "^\s*$" | tail -60 ;;
  spec)
    shift || true
    python3 benchmarks/gpu_speculative.py --out "$OUT" "$@" 2>&1 | tee "$OUT/gpu_speculative.txt" | grep -vE "^\s*$" | tail -40 ;;
  pending)
    # What the CPU side built that no GPU has proven yet (session 8, 2026-12-07; issue 53 and 55), each step bounded,
    # its results in $OUT as they come: MTP with the drafter parked on the steps the rule drafts nothing on (greedy
    # tokens with drafting switched off and back on mid-generation at 1 and 16 jobs, a request's own drafted counts in
    # its usage: test_gpu_mtp), exllamav3's label scoring with the prefix read once per request (test_gpu_decisions), then
    # issue 55's GPU row first, it is short (benchmarks/gpu_decisions.py: a decision vs constrained JSON generation; carry .devcache with
    # smollm2-tokenizer/). The invariance probe (issue 57) is a call of its own: `probe`; the hybrid's EXL3 row (its
    # conversion alone takes ~90 s) one of `speed`'s: HYBRID_MODELS=hybrid-exl3.
    timeout "${TEST_S:-210}" python3 -m pytest -m gpu -v -s -p no:cacheprovider tests/gpu/test_gpu_mtp.py \
      tests/gpu/test_gpu_decisions.py 2>&1 | tee "$OUT/gpu_tests_pending.txt" | grep -E "PASSED|FAILED|ERROR|passed|failed|MTP drafting|label" | cut -c1-600
    timeout "${DECIDE_S:-60}" python3 benchmarks/gpu_decisions.py --out "$OUT" --reps 7 > "$OUT/gpu_decisions.txt" 2>&1
    grep -E "ratio|note|Error" "$OUT/gpu_decisions.txt" | cut -c1-300 | tail -12
    # MTP at 16 and 64 jobs, perfect and ~70%, 5 interleaved reps, with each section's parked / catch-up / drafting
    # steps (--no-stream: the one-stream rows met their targets in run 3, and --no-raw-batch: raw exllamav3 drafting
    # 16/64 jobs measured in run 1; `mtp` runs them all)
    timeout "${BENCH_S:-290}" python3 benchmarks/gpu_mtp.py --out "$OUT" ${MTP_ARGS:---levels perfect,mix --jobs 16,64 --reps 5 --new 64 --cache 32768 --no-served --no-stream --no-raw-batch --draft-window measured} \
      2>&1 | tee "$OUT/gpu_mtp.txt" | grep -E "ratio|met|chosen|captured steps|parked|error|Error|differ" | cut -c1-500 ;;
  speed)
    # issue 53's speed rows: the captured step on a ~1.5B Qwen3.5-shaped hybrid (raw vs fast at 1/16/64 jobs), then MTP
    timeout "${HYBRID_S:-300}" python3 benchmarks/gpu_fast_decode.py --out "$OUT" --sections bench \
      --models "${HYBRID_MODELS:-hybrid}" --reps "${REPS:-5}" --new 48 --no-sampler-alone --no-ahead-row --no-deterministic-row 2>&1 | tee "$OUT/gpu_fast_decode.txt" \
      | grep -E "ratio|note|Error|error" | cut -c1-400 | tail -30
    timeout "${BENCH_S:-250}" python3 benchmarks/gpu_mtp.py --out "$OUT" ${MTP_ARGS:---levels perfect,mix --jobs 16,64 --reps 5 --cache 32768 --no-served} \
      2>&1 | tee "$OUT/gpu_mtp.txt" | grep -vE "^\s*$" | cut -c1-400 | tail -40 ;;
  probe)
    shift || true
    timeout -k 10 "${PROBE_S:-470}" python3 benchmarks/gpu_invariance_probe.py --out "$OUT" \
      --budget-s "${PROBE_BUDGET_S:-450}" "$@" 2>&1 | tee "$OUT/gpu_invariance_probe.txt" | grep -vE "^\s*$" | cut -c1-300 | tail -120 ;;
  mtp)
    shift || true
    python3 benchmarks/gpu_mtp.py --out "$OUT" "$@" 2>&1 | tee "$OUT/gpu_mtp.txt" | grep -vE "^\s*$" | tail -60 ;;
esac
