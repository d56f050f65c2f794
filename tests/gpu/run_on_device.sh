#!/usr/bin/env bash
# One call on the lent GPU machine (see tests/gpu/README.md): install what was carried, then run
#   tests:  the GPU test suite, output in $OUT/gpu_tests.txt
#   bench:  benchmarks/gpu_load.py, JSON in $OUT
#   spec:   benchmarks/gpu_speculative.py, JSON in $OUT
#   mtp:    benchmarks/gpu_mtp.py (MTP drafting at known acceptance), JSON in $OUT
# Usage: bash tests/gpu/run_on_device.sh tests|bench|spec|mtp [pytest -k / benchmark args]
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
  mtp)
    shift || true
    python3 benchmarks/gpu_mtp.py --out "$OUT" "$@" 2>&1 | tee "$OUT/gpu_mtp.txt" | grep -vE "^\s*$" | tail -60 ;;
esac
