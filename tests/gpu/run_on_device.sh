#!/usr/bin/env bash
# One call on the lent GPU machine (see tests/gpu/README.md): install what was carried, then run
#   tests:  the GPU test suite, output in $OUT/gpu_tests.txt
#   bench:  benchmarks/gpu_load.py, JSON in $OUT
#   spec:   benchmarks/gpu_speculative.py, JSON in $OUT
#   mtp:    benchmarks/gpu_mtp.py (MTP drafting at known acceptance), JSON in $OUT
#   pending: what the CPU side built that no GPU has proven yet (see the mode below), each step bounded in time, its
#           results in $OUT as they come (a machine taken back keeps what ran)
#   speed:  issue 53's speed rows (the captured step on a Qwen3.5-shaped hybrid, MTP at 1/16/64 jobs)
#   moe:    issue 53's MoE layers in the captured step, in one call (~450 s: run it with timeout_s 600), each step bounded
#           and its results in $OUT as they come: the Qwen3-MoE-shaped EXL3 fixture (tests/moe_models.py), greedy tokens
#           vs exllamav3's own loop at 1/16/64 jobs and the report (tests/gpu/test_gpu_fast_moe.py, with the family
#           matrix's qwen3 and qwen3_moe cases), the speed row (benchmarks/gpu_fast_decode.py --models moe). Carry .whl
#           (exllamav3 1.6.5 and its converter's needs) and .devcache (the prebuilt extension)
#   probe:  issue 57 in one call (~560 s: run it with timeout_s 600), each step bounded and its results in $OUT as
#           they come: the op-level invariance probe (benchmarks/gpu_invariance_probe.py, shortened: no step section),
#           the 1B fixture (fp16 + its 4-bit EXL3 conversion), the pinned strategy's GPU tests
#           (tests/gpu/test_gpu_pinned.py, with deterministic=True's 2048-token prefill chunks on long prompts with
#           prefix hits), its benchmark row (benchmarks/gpu_fast_decode.py --pinned-row, and the first token of a
#           3584-token prompt: default vs deterministic=True's chunks vs one page a forward). Carry the
#           exllamav3 1.6.5 wheel and its converter's needs (marisa-trie, pyyaml, pillow) and the prebuilt extension
#   swa:    issue 53's sliding-window rings in the captured step, in one call (~490 s: run it with timeout_s 600), each
#           step bounded and its results in $OUT as they come: the GPT-OSS (4-bit EXL3) and Gemma 4 (bf16) fixtures
#           (tests/ring_models.py, transformers' own classes), greedy tokens vs exllamav3's own loop at 1/8/16/64 jobs with
#           prompts that cross the ring's end while decoding, and the report (tests/gpu/test_gpu_fast_rings.py), the
#           speed row (benchmarks/gpu_fast_decode.py --models rings-gemma4). Carry .whl (exllamav3 1.6.5 and its converter's
#           needs) and .devcache (the prebuilt extension)
#   mamba:  issue 53's Mamba-2 layers in the captured step, in one call (< 480 s: run it with timeout_s 560), each step
#           bounded and its results in $OUT as they come: the Nemotron-H-shaped fixtures (tests/mamba_models.py,
#           transformers' own NemotronHForCausalLM: bf16, then its 4-bit EXL3 conversion if the step's time allows),
#           greedy tokens vs exllamav3's own loop at 1/8/16/64 jobs and the report (tests/gpu/test_gpu_fast_mamba.py, on
#           the fixtures built), the speed row (benchmarks/gpu_fast_decode.py --models mamba). Carry .whl (exllamav3
#           1.6.5 and its converter's needs) and .devcache (the prebuilt extension)
# Usage: bash tests/gpu/run_on_device.sh tests|bench|spec|mtp|pending|speed|probe|moe|swa|mamba [pytest -k / bench args]
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
    # PENDING_TESTS: the test files of this step (default: both), e.g. PENDING_TESTS=tests/gpu/test_gpu_decisions.py
    timeout "${TEST_S:-210}" python3 -m pytest -m gpu -v -s -p no:cacheprovider \
      ${PENDING_TESTS:-tests/gpu/test_gpu_mtp.py tests/gpu/test_gpu_decisions.py} 2>&1 | tee "$OUT/gpu_tests_pending.txt" | grep -E "PASSED|FAILED|ERROR|passed|failed|MTP drafting|label" | cut -c1-600
    timeout "${DECIDE_S:-60}" python3 benchmarks/gpu_decisions.py --out "$OUT" --reps 7 > "$OUT/gpu_decisions.txt" 2>&1
    grep -E "ratio|note|Error|decision:" "$OUT/gpu_decisions.txt" | cut -c1-300 | tail -14
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
    # 1. ~100 s (was 115: shortened for step 3's long-prompt test): per op (paged attention, EXL3 and fp16 GEMMs,
    #    norms) one row alone vs in 2..64 rows, unpinned, under the pinned strategy's pins (split_len=256; pad64+shape=7; fp16 pad64) and a few others, each pin's cost at
    #    1/16/64 rows -> gpu_invariance_probe.jsonl (a line per measurement), _summary.json, .txt
    shift || true
    PINS="split_len=256,split_len=512,pad64+shape=7 (the pinned strategy's),pad16+shape=2,pad64 (one bucket),pad16"
    timeout -k 10 "${PROBE_S:-100}" python3 benchmarks/gpu_invariance_probe.py --out "$OUT" --budget-s "${PROBE_BUDGET_S:-86}" \
      --sections attention,exl3_gemm,fp16_gemm,norms --no-children --section-s attention=16,exl3_gemm=40,fp16_gemm=22,norms=5 \
      --time-rows 1,16,64 --pins "$PINS" "$@" 2>&1 | tee "$OUT/gpu_invariance_probe.txt" | grep -E "^(section|held)|rror" | cut -c1-240
    # 2. ~150 s once a machine: the 1B Llama (fp16) and its 4-bit EXL3 conversion (benchmarks/_common.exl3_model)
    timeout -k 10 "${FIXTURE_S:-170}" python3 -c 'import sys; from pathlib import Path; sys.path[:0] = ["benchmarks", "tests"]
from _common import Results, exl3_model; print("fixture:", exl3_model(Results("gpu_fixture.json"), Path("/tmp")))' \
      2>&1 | tee "$OUT/gpu_tests_pinned.txt" | tail -2
    # 3. ~90 s: the pinned strategy's invariance table (alone == in 16 == in 64, seeded, after history, next turn);
    #    ~50 s: deterministic=True's 2048-token chunks, 2600-token probes cold == after prefix hits == in 16 == in 64
    timeout -k 10 "${TEST_S:-180}" python3 -m pytest -m gpu -v -s -p no:cacheprovider tests/gpu/test_gpu_pinned.py 2>&1 \
      | tee -a "$OUT/gpu_tests_pinned.txt" | grep -E "PASSED|FAILED|ERROR|passed|failed|^pinned,|^deterministic," | cut -c1-600
    # 4. ~90 s: its price: tok/s at 1/16/64 jobs and first-token time (3584-token prompt) beside raw, the default,
    #    rows apart and deterministic=True one page a forward (the former chunking), interleaved -> gpu_fast_decode.json
    timeout -k 10 "${BENCH_S:-110}" python3 benchmarks/gpu_fast_decode.py --out "$OUT" --sections bench --models exl3 \
      --reps 3 --new 48 --no-sampler-alone --no-ahead-row --pinned-row --first-prompt 3584 --one-page-row 2>&1 \
      | tee "$OUT/gpu_fast_decode.txt" | grep -E "ratio|rror" | cut -c1-240 ;;
  moe)
    # 1. ~100 s once a machine: build (bf16, on the GPU) and convert (exllamav3's converter, 4-bit) the fixture
    timeout -k 10 "${FIXTURE_S:-200}" python3 -c 'import sys; sys.path[:0] = ["tests", "tests/gpu"]
from moe_models import qwen3_moe_exl3; print("fixture:", *qwen3_moe_exl3())' 2>&1 | tee "$OUT/gpu_moe_fixture.txt" | tail -3
    # 2. ~90 s: greedy tokens at 1/16/64 jobs against exllamav3's own loop, which rows were captured and which ran
    #    eagerly (why), and the matrix's qwen3 (MRoPE: its text steps now captured) and qwen3_moe (bf16 experts: aside)
    timeout -k 10 "${TEST_S:-140}" python3 -m pytest -m gpu -v -s -p no:cacheprovider tests/gpu/test_gpu_fast_moe.py \
      "tests/gpu/test_gpu_fast_decode.py::test_fast_greedy_tokens_are_exllamav3s_on_every_family[qwen3]" \
      "tests/gpu/test_gpu_fast_decode.py::test_fast_greedy_tokens_are_exllamav3s_on_every_family[qwen3_moe]" 2>&1 \
      | tee "$OUT/gpu_tests_moe.txt" | grep -E "PASSED|FAILED|ERROR|passed|failed|^moe|^qwen3|Error" | cut -c1-600
    # 3. ~90 s: the speed row, raw exllamav3 vs decode="fast" at 1/16/64 jobs, interleaved -> gpu_fast_decode.json
    timeout -k 10 "${BENCH_S:-150}" python3 benchmarks/gpu_fast_decode.py --out "$OUT" --sections bench --models moe \
      --reps "${REPS:-5}" --new 48 --no-sampler-alone --no-ahead-row --no-deterministic-row 2>&1 \
      | tee "$OUT/gpu_fast_decode_moe.txt" | grep -E "ratio|rror" | cut -c1-300 ;;
  swa)
    # 1. ~150 s once a machine: build GPT-OSS (bf16, on the GPU) and convert it (exllamav3's converter, 4-bit), build
    #    Gemma 4 (bf16; the multimodal class exllamav3 reads, a tiny vision tower)
    timeout -k 10 "${FIXTURE_S:-200}" python3 -c 'import sys; sys.path[:0] = ["tests", "tests/gpu"]
from ring_models import FIXTURES
for name, build in sorted(FIXTURES.items()):
    try: print("fixture:", name, *build(), flush=True)
    except Exception as e: print("fixture:", name, "FAILED", type(e).__name__, str(e)[-1500:], flush=True)' \
      2>&1 | tee "$OUT/gpu_swa_fixture.txt" | grep -E "^fixture|rror" | cut -c1-600
    # 2. ~120 s: greedy tokens at 1/8/16/64 jobs against exllamav3's own loop on both, rows crossing the ring's end while
    #    decoding; the report (captured, row shifts, what ran eagerly and why)
    timeout -k 10 "${TEST_S:-140}" python3 -m pytest -m gpu -v -s -p no:cacheprovider tests/gpu/test_gpu_fast_rings.py 2>&1 \
      | tee "$OUT/gpu_tests_swa.txt" | grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed|rings|Error" | cut -c1-900
    # 3. ~120 s: the speed row, raw exllamav3 vs decode="fast" at 1/16/64 jobs on Gemma 4 (every row count captured;
    #    GPT-OSS's MoE layers keep its steps of more than 8 rows eager: RING_MODELS=rings for its row), interleaved
    timeout -k 10 "${BENCH_S:-150}" python3 benchmarks/gpu_fast_decode.py --out "$OUT" --sections bench \
      --models "${RING_MODELS:-rings-gemma4}" \
      --reps "${REPS:-5}" --new 48 --no-sampler-alone --no-ahead-row --no-deterministic-row 2>&1 \
      | tee "$OUT/gpu_fast_decode_swa.txt" | grep -E "ratio|rror" | cut -c1-300 ;;
  mamba)
    # 1. <= 150 s once a machine: build the Nemotron-H shape (bf16, on the GPU; ~30 s), then convert it (exllamav3's
    #    converter, 4-bit): a conversion cut off by the bound leaves that fixture out of steps 2 and 3
    timeout -k 10 "${FIXTURE_S:-150}" python3 -c 'import sys; sys.path[:0] = ["tests", "tests/gpu"]
from mamba_models import FIXTURES
for name in ("nemotron_h_bf16", "nemotron_h_exl3"):
    try: print("fixture:", name, *FIXTURES[name](), flush=True)
    except Exception as e: print("fixture:", name, "FAILED", type(e).__name__, str(e)[-1500:], flush=True)' \
      2>&1 | tee "$OUT/gpu_mamba_fixture.txt" | grep -E "^fixture|rror" | cut -c1-600
    BUILT=nemotron_h_bf16; [ -f /tmp/models/nemotronh-mamba-exl3/.complete ] && BUILT=$BUILT,nemotron_h_exl3
    [ -f /tmp/models/nemotronh-mamba-bf16/.complete ] || BUILT=
    echo "built: ${BUILT:-none}" | tee -a "$OUT/gpu_mamba_fixture.txt"
    # 2. <= 150 s: greedy tokens at 1/8/16/64 jobs against exllamav3's own loop on each fixture built; the report
    #    (captured, min_rows, replays, what ran eagerly and why)
    [ -n "$BUILT" ] && MAMBA_FIXTURES=$BUILT timeout -k 10 "${TEST_S:-150}" python3 -m pytest -m gpu -v -s -p no:cacheprovider \
      tests/gpu/test_gpu_fast_mamba.py 2>&1 | tee "$OUT/gpu_tests_mamba.txt" \
      | grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed|mamba|Error" | cut -c1-900
    # 3. <= 150 s: the speed row, raw exllamav3 vs decode="fast" at 1/16/64 jobs on the bf16 fixture (every row count
    #    captured; MAMBA_MODELS=mamba-exl3 for the EXL3 one, captured above 8 rows), interleaved -> gpu_fast_decode.json
    [ -n "$BUILT" ] && timeout -k 10 "${BENCH_S:-150}" python3 benchmarks/gpu_fast_decode.py --out "$OUT" --sections bench \
      --models "${MAMBA_MODELS:-mamba}" --reps "${REPS:-5}" --new 48 --no-sampler-alone --no-ahead-row \
      --no-deterministic-row 2>&1 | tee "$OUT/gpu_fast_decode_mamba.txt" | grep -E "ratio|rror" | cut -c1-300 ;;
  mtp)
    shift || true
    python3 benchmarks/gpu_mtp.py --out "$OUT" "$@" 2>&1 | tee "$OUT/gpu_mtp.txt" | grep -vE "^\s*$" | tail -60 ;;
esac
