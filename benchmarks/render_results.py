"""Turn the committed JSON results into benchmarks/results/RESULTS.md and gpu_throughput.png (runs on CPU)."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

RESULTS = Path(__file__).parent / "results"


def _speed_table(rows: list[dict]) -> list[str]:
    out = ["| path | tokens/s | time to first token (ms) | ratio |", "| --- | ---: | ---: | --- |"]
    for r in rows:
        ratio = ""
        if "ratio_vs_raw" in r:
            ratio = f"{r['ratio_vs_raw']:.3f} of raw"
        elif "ratio_vs_one_stream" in r:
            ratio = f"{r['ratio_vs_one_stream']:.2f}x one stream (aggregate)"
        out.append(f"| {r['path']} | {r['tokens_per_s']} | {r['ttft_ms']} | {ratio} |")
    return out


RUNS = {
    "gpu_load_run1.json": "run 1 (readers took one step at a time; our default prefill_cooldown was still "
    "exllamav3's 4; the prefix row's 'unshared' baseline reused its own earlier repetitions, so compare "
    "reused_ttft_s with first_ttft_s here, and see run 3)",
    "gpu_load_run2_serve.json": "run 2 (serving; readers coalesce; prefill_cooldown still exllamav3's 4 in both)",
    "gpu_load_run3.json": "run 3 (readers coalesce; prefill_cooldown 0 is our default)",
    "gpu_load_run4.json": "run 4 (single stream again; transformers baselines)",
    "gpu_load_run5_profile.json": "run 5 (profile: exllamav3's iterate() timed inside both loops; `stream_interval` "
    "1, 4, 16; ChatExLlama.batch() still LangChain's thread pool)",
    "gpu_load_run6_profile.json": "run 6 (the same profile; ChatExLlama.batch() now runs as abatch() on one event "
    "loop; the idle driver waits up to 50x `arrival_window` for a burst)",
    "gpu_load_run7_single.json": "run 7 (single stream, 7 repetitions)",
    "gpu_load_run8.json": "run 8 (whole-completion reads: invoke/generate/batch hand a caller its tokens when "
    "it ends; jobs built on the driver's thread; raw counterparts for independent callers added)",
    "gpu_load_run9.json": "run 9 (run 8, plus: steps read whole are detokenized at once; ChatExLlama.abatch and "
    "gathered agenerate announce their batch to the idle driver; paired ratios per repetition)",
    "gpu_load_run10_batch16.json": "run 10 (run 9's code, batch16 only, 8 repetitions; the announced-batch wait "
    "was capped at 0.25 s here, 0.1 s since)",
    "gpu_load_run11_warm.json": "run 11 (the code of run 10 with the driver's inbox as one class; single and "
    "batch16, 256 new tokens, 8 repetitions, each round starting one row later; rows now say where their time "
    "went: steps, ms per step inside and outside exllamav3's iterate(), GC pauses, announced-batch waits. The "
    "same prompts every repetition, as in runs 1-10, so some prefills were warm: see run 12)",
    "gpu_load_run12_warm_diagnosed.json": "run 12 (batch16 as run 11, 6 repetitions, plus when the requests "
    "reached the driver and when its first step began: all 16 of ours were in within 19 ms of the call and the "
    "first step began 9-26 ms in, so the time-to-first-token gap was that first step, exllamav3's prefill: "
    "38-131 ms for the raw loop, up to 537 ms for ours (ChatExLlama). exllamav3 reuses cached prompts, the "
    "raw generator serves one row and keeps its prompts, ours serves three and kept fewer of each; with "
    "prompts neither had seen (run 13) every row's first step took 249-608 ms. The callers64 part ran past "
    "the call's time limit and is missing)",
    "gpu_load_run13_batch16.json": "run 13 (fresh prompts, never seen by either generator, for every call of "
    "every row; batch16, 256 new tokens, 6 repetitions)",
    "gpu_load_run13_callers.json": "run 13 (fresh prompts; single and callers64, 128 new tokens, 3 repetitions)",
    "gpu_load_run14_batch16.json": "run 14 (after the contract step: one request value, the backend split by role, "
    "the runtime reading GenerationRequest values; batch16, 256 new tokens, 5 repetitions)",
    "gpu_load_run14_callers.json": "run 14 (callers64 after the contract step, 128 new tokens, 3 repetitions)",
    "gpu_load_run15_callers_before.json": "run 15, before (the code before the contract step, b073b3e, in the same "
    "GPU call as the next run: callers64, 128 new tokens, 3 repetitions)",
    "gpu_load_run15_callers_after.json": "run 15, after (the code after the contract step, in the same GPU call as "
    "the previous run: callers64, 128 new tokens, 3 repetitions)",
    "gpu_load_run16_fp16_128.json": "run 16 (2026-12-02, the engine-process code: batch16 and streams64 at 128 new "
    "tokens, 5 repetitions; paired ratios of exllamav3's iterate() time per step, its first step, and the time per "
    "step outside it; stream_interval was 1 then)",
    "gpu_load_run16_fp16_256.json": "run 16 (the same GPU call: batch16 at 256 new tokens, 5 repetitions)",
    "gpu_load_run17_exl3_128.json": "run 17 (a 1B-class Llama shape, 4-bit EXL3, `--exl3`: batch16 and streams64 at "
    "128 new tokens, 5 repetitions; stream_interval 1)",
    "gpu_load_run17_exl3_256.json": "run 17 (the same EXL3 model: batch16 at 256 new tokens, 5 repetitions)",
    "gpu_load_run18_exl3_streams64.json": 'run 18 (EXL3, streams64: the new default `stream_interval="auto"` '
    "beside `stream_interval=1`, interleaved, 5 repetitions)",
    "gpu_load_run19_exl3_streams64.json": "run 19 (2026-12-02, EXL3, streams64 at 128 new tokens, 7 repetitions: "
    '`stream_interval="auto"` (then `jobs // 16`: 4 at 64 jobs) beside fixed intervals 8 and 16; then each row '
    "once more under py-spy `--gil`, which shows the thread holding the GIL at each sample; `--exl3 --sections "
    "streams64 --intervals 8,16 --profile --reps 7`)",
    "gpu_load_run19_exl3_256.json": "run 19 (the same GPU call: EXL3, batch16 at 256 new tokens, 7 repetitions)",
    "gpu_load_run19_fp16_256.json": "run 19 (fp16 7B shape, batch16 at 256 new tokens, 5 repetitions)",
    "gpu_load_run20_exl3_streams64_auto8.json": 'run 20 (EXL3, streams64 after `"auto"` became `jobs // 8`: the '
    "default beside the old one's interval at 64 jobs, 4; 7 repetitions)",
    "gpu_load_run21_exl3_128.json": "run 21 (2026-12-02 evening, the code of run 20 (2254e91): EXL3, batch16 at 128 "
    "new tokens with the chat batch's own raw counterpart (16 raw Jobs of the template-rendered prompts), 7 "
    "repetitions; `--exl3 --sections batch16 --new 128 --reps 7`)",
    "gpu_load_run21_exl3_256.json": "run 21 (the same GPU call: EXL3, batch16 at 256 new tokens, 7 repetitions)",
    "gpu_load_run22_exl3_128.json": "run 22 (an announced batch that is all in starts at once, and `open_batch` "
    "announces itself: EXL3, batch16 at 128 new tokens, 15 repetitions)",
    "gpu_load_run22_exl3_256.json": "run 22 (the same GPU call: EXL3, batch16 at 256 new tokens, 9 repetitions)",
    "gpu_load_run23_fp16_256.json": "run 23 (the code of run 22, fp16 7B shape: batch16 at 256 new tokens, 7 "
    "repetitions)",
    "gpu_load_run23_fp16_streams64.json": "run 23 (the same GPU call: streams64 on the 7B shape at 128 new tokens, "
    '`stream_interval="auto"` (`jobs // 8`) beside `stream_interval=1`, 5 repetitions)',
    "gpu_load_run24_exl3_128.json": "run 24 (chat templates rendered on threads that outlive the event loop: EXL3, "
    "batch16 at 128 new tokens, 7 repetitions; a noisier GPU call: the raw row's tok/s 1,472 against 1,850 in "
    "run 22)",
    "gpu_load_run25_exl3_fast.json": 'run 25 (`decode="fast"` the default: the batched sampler and the captured '
    "decode step; EXL3, batch16 and callers64 at 128 new tokens, 5 repetitions, `--exl3 --sections "
    "batch16,callers64`)",
    "gpu_load_run26_exl3_batched_prefill.json": "run 26 (2026-12-04, an experiment since removed: the prompts one "
    "`iterate()` prefills run in a few batched forwards; the same rows as run 25; the time to first token did not "
    "improve: `first_step_ms` 1.203 of raw against about 1.0 without it)",
    "gpu_load_run27_exl3_fast.json": 'run 27 (2026-12-04, `decode="fast"` as it is now: the same rows as run 25, '
    "`--exl3 --sections batch16,callers64 --reps 5`)",
    "gpu_load_run28_exl3_run_ahead.json": 'run 28 (2026-12-04, `decode="fast"` running the next step ahead: the '
    "same rows as run 25 on a faster host, `--exl3 --sections batch16,callers64 --reps 5`)",
    "gpu_load_run29_exl3_prefill_copies_serialized.json": "run 29 (2026-12-04, evening: batched prefill before its "
    "last mend, the held chunks run before every page copy; the callers' prompts share a beginning, so each copies "
    "a page and the chunks ran one by one: 64 callers' TTFT 0.959 of raw's; `--exl3 --sections callers64,batch16 "
    "--reps 5`)",
    "gpu_load_run30_exl3_batched_prefill.json": 'run 30 (2026-12-04, evening: `decode="fast"` with batched prefill, '
    "a page copy from a held prompt computed in the same forward; the same rows as run 25; raw's loop slow on this "
    "host: 16 Jobs at 1011 tok/s against 1878 in run 28)",
    "gpu_load_run31_fp16_batch16.json": "run 31 (2026-12-05, on an H100 80GB HBM3, not the H200: the fp16 7B shape, "
    '`decode="fast"` with running ahead and batched prefill, batch16 at 128 new tokens beside 16 raw Jobs, 7 '
    "repetitions; `bash tests/gpu/run_on_device.sh bench --sections batch16 --reps 7`; the LlamaIndex row left out, "
    "llama-index-core was not carried)",
}
LOAD_PLOT = ("gpu_load_run13_batch16.json", "gpu_load_run13_callers.json")
"""The load runs drawn in gpu_throughput.png (the newest)."""
SPECULATIVE = {
    "gpu_speculative.json": "speculative decoding (`python benchmarks/gpu_speculative.py --reps 5`): each mode "
    "interleaved with plain decoding of the same target (layers 2-31 with zero output projections)",
    "gpu_mtp_run1_h100.json": "MTP drafting (2026-12-07, H100 80GB HBM3; `bash tests/gpu/run_on_device.sh speed`, "
    "`draft_window=\"measured\"`): a 4.8B Qwen3.5-shaped fp16 checkpoint whose MTP head drafts right ('perfect') or "
    "~70% right ('mix'), one stream and 16/64 jobs, 5 interleaved repetitions; drafting steps ran eagerly, and the "
    "undrafted steps of a drafting runtime too (the MTP head's hidden-state export was not captured); the mix 64-job "
    "row was cut by the call's time limit",
    "gpu_mtp_run2_h100.json": "MTP drafting, run 2 (2026-12-07, H100; `bash tests/gpu/run_on_device.sh mtp --levels "
    "perfect,mix --jobs 16,64 --reps 5 --cache 32768 --no-served --draft-window measured`, at 8f1c170): the drafting "
    "runtime's undrafted steps captured (1,427 replays, no capture failed), but the rule measured 0 tokens per second "
    "in every bucket of 16 rows and more (it counted emitted tokens, which exllamav3 held back while the fixture's "
    "text ended in a partial character): its choices there are ties, not measures; the mix 64-job row was cut",
    "gpu_mtp_run3_h100.json": "MTP drafting, run 3 (2026-12-07, H100; the same with `--new 48`, at 0b8c0ae: the rule "
    "measures what each job advanced): one stream 2.89x no drafting (1.06x exllamav3's own MTP loop); at 16 jobs the "
    "rule measured window 0 (the captured step) at 2,018 tok/s and window 1 at 719, tried no longer window and drafted "
    "nothing after: 0.885x [0.696..1.013] of the runtime without drafting; the session's device time ended there",
    "gpu_mtp_run4_h100.json": "MTP drafting, run 4 (session 9, 2026-12-07, H100; `bash tests/gpu/run_on_device.sh "
    "pending` at 2b534c9: `--levels perfect,mix --jobs 16,64 --reps 5 --new 64 --no-stream --no-raw-batch`): the "
    "drafter parked on the steps the rule drafts nothing on (373 parked, 1 catch-up, 5 drafting at 16 jobs): 1.031x "
    "[0.938..1.117] of the runtime without a drafter; the call's device time ended before the mix and 64-job rows",
    "gpu_mtp_run5_h100.json": "MTP drafting, run 5 (2026-12-07, H100; `bash tests/gpu/run_on_device.sh pending` at "
    "f434b02, the same options as run 4): the drafter parked, 'perfect' and 'mix' at 16 and 64 jobs, 5 interleaved "
    "repetitions; mix at 16 jobs 0.921 [0.826..1.016] of the runtime without a drafter, under the >= 1.0 target; the "
    "rule's exploring share was above its 1% cap in most buckets (the notes' `exploring_share`)",
}

VISION = {
    "gpu_vision.json": "a Gemma 3 built by transformers (text 1024 x 8 layers, a SigLIP-shaped tower 768 x 12 at "
    "448 px, 256 image tokens, bf16), 64 new tokens, a fresh 640 x 480 JPEG every repetition; ours is "
    "`ExLlamaRuntime` with `GenerationRequest(media=...)` (stream for one, `batch` for 16), raw is exllamav3's "
    "own vision component and Job as its examples/multimodal.py drives them (without our Gemma 3 image-attention "
    "fix); follow_up is a second turn about the same picture vs about a new one",
}

SERVING = {
    "gpu_serve_run1.json": "run 1: Llama-2-7B shape fp16, 64 clients (`python benchmarks/gpu_serve.py --reps 5`)",
    "gpu_serve_diagnose.json": "run 2, where the time goes: the engine process called in process, one engine at 32 "
    "clients (`--rows generate,engine_in_process,process,process_half,engines2`)",
    "gpu_serve_exl3.json": "run 3: a 1B-class Llama shape (2048 x 16 layers, GQA 16/8) quantized to 4-bit EXL3 by "
    "exllamav3's converter (`--exl3`)",
    "gpu_serve_run4_fp16_where.json": "run 4, where the served gap was (fp16 7B): whole bodies beside streams, an "
    "engine whose idle driver waits 20 ms of quiet (`arrival_window=0.02`), two engines; each row's CPU (cores) of "
    "the server, its engines and the load generator, and the GPU's busy share (nvidia-smi); then one round of "
    "each engine-process server under py-spy (`--rows generate,process,process_whole,process_window,engines2 "
    "--profile`)",
    "gpu_serve_run5_exl3_window.json": "run 5: the same on the EXL3 model (`--exl3 --rows generate,process,"
    "process_window,single`), the server's defaults still those of run 4",
    "gpu_serve_run6_exl3_defaults.json": "run 6: EXL3, the server with its new defaults (`burst_window=0.02`, "
    '`stream_interval="auto"`; `--exl3 --rows generate,process,single --option warmup=false`)',
    "gpu_serve_run7_fp16_defaults.json": "run 7: the fp16 7B shape, the server with the same defaults (`--rows "
    'generate,process,single --reps 5`; `stream_interval="auto"` was still `jobs // 16` then)',
    "gpu_serve_run8_exl3_fast.json": 'run 8 (2026-12-03): EXL3, `decode="fast"` the default, beside a server on '
    "exllamav3's own loop (`--option decode=exllamav3`: the served figure before it) and `--engines 2` "
    "(`--exl3 --rows process,process_exllamav3,engines2 --reps 7`)",
    "gpu_serve_run9_fp16_fast.json": "run 9 (2026-12-03): the same on the fp16 7B shape (`--rows "
    "process,process_exllamav3,engines2 --reps 7`)",
    "gpu_serve_run10_exl3_profile.json": 'run 10 (2026-12-04): EXL3, `decode="fast"` beside exllamav3\'s own loop, '
    "3 repetitions, then one more round of the fast server under py-spy, every thread's time and then who holds "
    "the GIL (`--exl3 --rows process,process_exllamav3 --reps 3 --profile`; the profile's shares are of a 6 s "
    "window, of which the row took about 1.6 s: `Inbox.take` is the idle rest)",
    "gpu_serve_run11_exl3_prefill.json": "run 11 (2026-12-04): EXL3, the fast server with a batched prefill (an "
    "experiment since removed), the same with `--option prefill=exllamav3` (job-by-job prefill, the code as it "
    "now stands) and exllamav3's own loop, 5 repetitions",
    "gpu_serve_run12_exl3_run_ahead.json": 'run 12 (2026-12-04): EXL3, `decode="fast"` running the next '
    "step's forward ahead of the step's bookkeeping, beside exllamav3's own loop, 5 repetitions (`--exl3 --rows "
    "process,process_exllamav3 --reps 5`)",
    "gpu_serve_run13_exl3_batched_prefill.json": 'run 13 (2026-12-04, evening): EXL3, `decode="fast"` with '
    "batched prefill (and every waiting prompt started at the next step), beside exllamav3's own loop, 5 "
    "repetitions (`--exl3 --rows process,process_exllamav3 --reps 5`)",
    "gpu_serve_run14_fp16_batched_prefill.json": 'run 14 (2026-12-05): the fp16 7B shape, `decode="fast"` with '
    "running ahead and batched prefill, beside exllamav3's own loop and `--engines 2` (`--rows "
    "process,process_exllamav3,engines2 --reps 7`)",
    "gpu_serve_run15_exl3_engines2.json": "run 15 (2026-12-05): EXL3, one fast engine beside `--engines 2` on the same "
    "GPU (`--exl3 --rows process,engines2 --reps 5`; the device time left allowed 5 repetitions and no own-loop row)",
    "gpu_serve_run16_exl3.json": 'run 16 (2026-12-05, on an H100 80GB HBM3, not the H200): EXL3, `decode="fast"` '
    "as it is now beside exllamav3's own loop, 9 repetitions (`--exl3 --rows process,process_exllamav3 --reps 9`); "
    "its last round ran at the own loop's pace (3,083 tok/s, TTFT 1.96 s; not explained), the other eight at 2.9-3.3x",
}

FAST_DECODE = {
    "gpu_fast_decode_run1_profile.json": "run 1, where a decode step of raw exllamav3 goes: its wall time, the host "
    "time inside `Model.forward`, the jobs' sampling (`Job.receive_logits`) and bookkeeping (`Job.receive_sample`), "
    "and torch.profiler's GPU-busy time over 16 steps (`--sections sampled,profile`; the sampled notes compare the "
    "batched sampler with exllamav3's ComboSampler on the same logits, 4,000 draws per setting)",
    "gpu_fast_decode_run2.json": 'run 2, `decode="fast"` (the batched sampler) beside raw exllamav3: greedy tokens '
    "for 128 steps at batch 1, 16 and 64 compared job by job (notes), the sampled check again, then 16 and 64 jobs "
    "enqueued together, 7 interleaved repetitions (`--sections greedy,sampled,bench --reps 7`)",
    "gpu_fast_decode_run3_greedy.json": 'run 3, `decode="fast"` with the captured decode step '
    "(`backends/exllamav3/decode_graphs.py`: the forward after the embedding replayed from one CUDA graph per batch "
    "shape, where exllamav3 graphs none itself): greedy tokens for 128 steps at batch 1, 16 and 64 compared job by "
    "job, and the report of which forwards were replayed (`--sections greedy`)",
    "gpu_fast_decode_run4_bench_profile.json": "run 4, the same beside raw exllamav3 and the batched sampler alone "
    "(no graphs): 1, 16 and 64 jobs enqueued together, 5 interleaved repetitions, then the profile of raw and "
    "fast steps (`--sections bench,profile --batches 1,16,64 --reps 5`)",
    "gpu_fast_decode_run5_families.json": "run 5, every family of the architecture matrix (tests/arch_models.py at "
    "the GPU width: hidden 1024, 8 layers, vocab 32000, bf16 weights, and each converted to 4-bit EXL3 by "
    "exllamav3's converter, 4 at a time): greedy tokens of exllamav3's own loop and of `decode=\"fast\"` for 128 "
    "steps at 1, 16 and 64 jobs (`--sections families --models '' --new 128`, under a 300 s limit: smollm3's "
    "EXL3 row and gemma3, mistral, phi3 were not reached, and the GPU suite compares those at 1 and 16 jobs; "
    "qwen3_moe goes through exllamav3 directly here, which reads no `num_local_experts`: our runtime maps it, "
    "and the suite's run of it passes). Each family's note also holds an `error` from the script's own summary "
    "line (`identical` read the `batched_tokens` count as a batch; fixed after the run): the rows before it are "
    "whole",
    "gpu_fast_decode_run6_bench.json": 'run 6, `decode="fast"` as it is now (the step\'s tokens read back in one '
    "copy; a lone greedy job on a step exllamav3 graphs itself left to its argmax) beside raw exllamav3, 7 "
    "interleaved repetitions (`--sections bench --batches 1,16,64 --reps 7 --no-sampler-alone`; the fp16 64-job "
    "row was cut by the call's time limit). This host ran raw exllamav3's host-bound steps 1.4-1.7x slower than "
    "run 4's did (EXL3 16 jobs 14.2 against 8.2 ms a step), the captured ones about as fast: ratios here are "
    "higher than on run 4's host",
    "gpu_fast_decode_run7_families.json": "run 7 (2026-12-04), the families run 5 did not reach, with the upstream "
    "fixes applied as the runtime does (`--sections families --models '' --families "
    "gemma3,mistral,phi3,smollm3,qwen3_moe --new 128`, under a 235 s limit): identical at 1, 16 and 64 jobs for "
    "gemma3 bf16, mistral (bf16, EXL3), phi3 bf16, qwen3_moe (bf16, EXL3) and smollm3 EXL3; gemma3's EXL3 "
    "conversion failed (the converter does not strip Gemma 3's empty key prefix, which our runtime patches at "
    "load); phi3's EXL3 row was cut by the limit (run 9)",
    "gpu_fast_decode_run8_batched_prefill.json": "run 8 (2026-12-04), greedy identity with a batched prefill "
    "(an experiment since removed: one step's prompts prefilled in 6 forwards instead of 81): 9 of 16 and 25 of "
    "64 jobs parted from exllamav3's own loop, each first parting at an exact tie of the raw loop's logits "
    "(margin 0.0); the batched GEMMs sum in another order (`--sections greedy --models exl3`)",
    "gpu_fast_decode_run9_phi3.json": "run 9 (2026-12-04), phi3 bf16 and EXL3 (`--families phi3`): identical at 1, "
    "16 and 64 jobs",
    "gpu_fast_decode_run10_run_ahead.json": "run 10 (2026-12-04), running ahead (the next step's captured forward "
    "launched as soon as a step's tokens are read back, its logits used only when the step's inputs are the same): "
    "greedy tokens for 128 steps at 1, 16 and 64 jobs, then raw exllamav3, the fast path and the fast path without "
    "running ahead at 16 and 64 jobs, 5 interleaved repetitions (`--sections greedy,bench --models exl3 --batches "
    "16,64 --reps 5 --no-sampler-alone`)",
    "gpu_fast_decode_run11_families.json": "run 11 (2026-12-04), running ahead on every family whose decode step is "
    "captured, bf16 and EXL3, the conversion now with the runtime's key fix (Gemma 3's EXL3 converts): identical at "
    "1, 16 and 64 jobs for 128 steps (`--sections families --models '' --families "
    "gemma3,llama3,mistral,phi3,smollm3,deepseek_r1_distill --new 128`)",
    "gpu_fast_decode_run12_profile.json": "run 12 (2026-12-04), the profile of raw and fast steps at 1, 16 and 64 "
    "jobs with running ahead (`--sections profile --models exl3`): at 16 jobs the GPU is busy 63% of a fast step "
    "(1.9 of 3.0 ms under the profiler), 8% of a raw one; the fast step's `forward_ms` is near zero because its "
    "forward already ran, and the wait moves into the step's read-back",
    "gpu_fast_decode_run13_prefill_profile.json": "run 13 (2026-12-04, evening), where the prefill of 64 prompts of "
    "128 tokens goes on raw exllamav3 (`--sections prefill --models exl3`, an earlier form of the section): the "
    "first `iterate()` with exllamav3's choice of GEMM and with `reconstruct` forced, with and without a synchronize "
    "after each call; the kernel tables: 426 of 454 ms of GPU time in the EXL3 GEMM kernel at 127 rows, and with "
    "reconstruct forced 178 ms of GPU time but more host time per call",
    "gpu_fast_decode_run15_h100_bench.json": "run 15 (2026-12-06, on an H100 80GB HBM3, not the H200): the fast path "
    "behind its one seam, the whole decode step captured from 1 row on, beside raw exllamav3 and "
    "`deterministic=True`, 1, 16 and 64 jobs enqueued together, 48 new tokens, 5 interleaved repetitions "
    "(`--sections bench --models exl3 --reps 5 --new 48 --no-sampler-alone --no-ahead-row`); the notes hold the "
    "device-to-device copy bandwidth and the model's weight bytes (the floor of a step)",
    "gpu_fast_decode_run16_hybrid_h100.json": "run 16 (2026-12-07, H100 80GB HBM3): the captured step over Gated "
    "DeltaNet layers (`fast_recurrent`), a ~1.5B Qwen3.5-shaped hybrid in bf16 (18 Gated DeltaNet and 6 attention "
    "layers, random weights), 16 and 64 jobs enqueued together, 32 new tokens, 5 interleaved repetitions "
    "(`--sections bench --models hybrid --reps 5 --new 32 --batches 16,64 --no-sampler-alone --no-ahead-row "
    "--no-deterministic-row`)",
    "gpu_fast_decode_run17_hybrid_h100.json": "run 17 (2026-12-07, session 8, H100 80GB HBM3): the same ~1.5B "
    "Qwen3.5-shaped bf16 hybrid at 1, 16 and 64 jobs, 48 new tokens, 5 interleaved repetitions (`bash "
    "tests/gpu/run_on_device.sh speed`); up to 8 rows the step is left to exllamav3's own per-layer graphs",
    "gpu_fast_decode_rings_run1_h100.json": "rings run 1 (2026-12-07, H100 80GB HBM3): the captured step over "
    "sliding-window rings on a Gemma 4-shaped bf16 fixture (tests/ring_models.py: hidden 1024, five local layers of "
    'window 128 to one global, random weights), raw exllamav3 vs `decode="fast"` at 1, 16 and 64 jobs, 48 new '
    "tokens, 3 interleaved repetitions (`bash tests/gpu/run_on_device.sh swa`, before the mode's default became 5)",
    "gpu_fast_decode_mamba_run1_h100.json": "Mamba run 1 (2026-12-07, H100 80GB HBM3): the captured step over Mamba-2 "
    "layers on a Nemotron-H-shaped bf16 fixture (tests/mamba_models.py: hidden 1024, 16 layers, 7 Mamba-2 mixers, "
    'random weights), every row count captured, raw exllamav3 vs `decode="fast"` at 1, 16 and 64 jobs, 48 new '
    "tokens, 3 interleaved repetitions (`bash tests/gpu/run_on_device.sh mamba`, before the mode's default became 5)",
    "gpu_fast_decode_moe_run1_h100.json": "MoE run 1 (2026-12-07, H100 80GB HBM3): the captured step over MoE layers "
    "on a Qwen3-MoE-shaped 4-bit EXL3 fixture (tests/moe_models.py: hidden 1024, 6 layers, 32 experts of width 256, "
    'top-8, random weights), captured at 1-32 rows and eager at 33-64, raw exllamav3 vs `decode="fast"` at 1, 16 '
    "and 64 jobs, 48 new tokens, 5 interleaved repetitions (`bash tests/gpu/run_on_device.sh moe`)",
    "gpu_fast_decode_run14_batched_prefill.json": "run 14 (2026-12-04, evening), batched prefill (`--sections "
    "prefill --models exl3 --reps 5 --new 128`): the first step of 64 jobs interleaved with exllamav3's job-by-job "
    "prefill (0.173 of it) and with reconstruct forced, the kernel tables, and greedy tokens against exllamav3's own "
    "loop for 128 steps at 16 and 64 jobs and 64 jobs of 64-192-token prompts, each parting with the raw model's "
    "logit margin (the first 16 of a row); padding was then refused everywhere (mended after: pages found by index "
    "after a defragmentation, and the next input exllamav3 counts in a page before the decode step allowed)",
}

INVARIANCE = {
    "gpu_invariance_run1_h100.json": "run 1 (2026-12-06, on an H100 80GB HBM3): the EXL3 1B-class model and its fp16 "
    "weights, 8 probe requests of 300 random token ids, 32 new tokens, through `ExLlamaRuntime` "
    "(`python benchmarks/gpu_invariance.py --models exl3,fp16 --new 32`)",
}
"""The invariance runs: does a request's output depend on what runs beside it (rendered as tables)."""

RAY = {
    "gpu_ray.json": "Ray Serve, 2 model replicas sharing the H200 beside a 1-replica baseline, 16 conversations "
    "with 4,000-token prefixes (`python benchmarks/gpu_ray.py`)",
    "gpu_ray_run2_load.json": "run 2 (2026-12-05, on an H100 80GB HBM3, not the H200): the fp16 7B shape, 64 "
    "streaming clients through Ray Serve's HTTP proxy on 2 replicas sharing the GPU (`num_gpus=0.33` each) beside "
    "1 replica, interleaved, 7 repetitions (`python benchmarks/gpu_ray.py --sections load --reps 7`)",
}


def _cell(v: dict) -> str:
    return f"{v['median']:.3f} [{v['min']:.3f}..{v['max']:.3f}]"


def _runs(runs: dict[str, str]) -> list[str]:
    """One table per section of each committed run file (rows: paths; cells: median [min..max])."""
    lines: list[str] = []
    for name, label in runs.items():
        path = RESULTS / name
        if not path.exists():
            continue
        data = json.loads(path.read_text())
        lines += [f"### {label}", ""]
        for section, rows in data["rows"].items():
            keys = sorted({k for r in rows.values() for k in r})
            lines += [f"{section}:", "", "| path | " + " | ".join(keys) + " |", "| --- |" + " ---: |" * len(keys)]
            for path_name, r in rows.items():
                lines.append(f"| {path_name} | " + " | ".join(_cell(r[k]) if k in r else "" for k in keys) + " |")
            lines.append("")
        for section, pairs in data.get("ratios", {}).items():
            keys = [
                k
                for k in ("tok_s", "ttft_s", "iterate_ms", "first_step_ms", "outside_ms", "step_ms")
                if any(k in v for v in pairs.values())
            ]
            lines += [
                f"{section}, paired ratios (each repetition's ours / raw, then median [min..max]):",
                "",
                "| ours / raw | " + " | ".join(keys) + " |",
                "| --- |" + " ---: |" * len(keys),
            ]
            for pair, v in pairs.items():
                cells = [_cell(v[k]) if k in v else "" for k in keys]
                lines.append(f"| {pair} | " + " | ".join(cells) + " |")
            lines.append("")
        notes = data.get("notes", {})
        lines += _families({k: v for k, v in notes.items() if k.startswith("family ")})
        plain = {
            k: v
            for k, v in notes.items()
            if k != "gpu" and not k.startswith(("profile", "family ")) and k != "placement"
        }
        if plain:
            lines += ["Notes: " + "; ".join(f"{k}: {v}" for k, v in plain.items()), ""]
        for key in (k for k in notes if k.startswith("profile")):
            lines += _profile(key, notes[key])
    return lines


def _families(notes: dict) -> list[str]:
    """The families section's notes as one table: per family and weights, identical jobs / jobs at each batch, and
    whether the decode forward was captured (or why it stood aside)."""
    if not notes:
        return []
    batches = sorted({k for v in notes.values() for k in v if k.startswith("batch ")}, key=lambda k: int(k.split()[1]))
    head = ["family, weights", *(f"{b}: identical jobs (tokens)" for b in batches), "captured decode step"]
    lines = ["| " + " | ".join(head) + " |", "| --- |" + " ---: |" * len(batches) + " --- |"]
    for key, v in notes.items():
        name = key.removeprefix("family ")
        if "status" in v:
            lines.append(
                f"| {name} | "
                + " | ".join(["-"] * len(batches))
                + f" | {v['status']}: {v['why'].strip().splitlines()[-1][-120:]} |"
            )
            continue
        cells = [
            f"{v[b]['identical_jobs']}/{v[b]['jobs']} ({v[b]['tokens_compared']})" if b in v else "" for b in batches
        ]
        g = v.get("graphs", {})
        graphs = f"yes, {len(g.get('shapes') or [])} shapes" if g.get("captured") else f"no: {g.get('stands_aside')}"
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {graphs} |")
    return [*lines, ""]


def _invariance() -> list[str]:
    """Per model: probes (of 8) whose tokens equal their tokens alone, in each situation, for each decode mode."""
    lines: list[str] = []
    for name, label in INVARIANCE.items():
        path = RESULTS / name
        if not path.exists():
            continue
        notes = json.loads(path.read_text())["notes"]
        lines += [f"## Invariance: {label}", ""]
        for key in (k for k in notes if k.startswith("table ")):
            table = notes[key]
            modes = list(table)
            situations = [k for k in table[modes[-1]] if k != "seconds"]
            lines += [
                f"{key[6:]}, probes of 8 equal to their tokens alone (or, `vs own loop`, to exllamav3's own "
                "loop in the same situation):",
                "",
            ]
            lines += ["| situation | " + " | ".join(modes) + " |", "| --- |" + " ---: |" * len(modes)]
            for sit in situations:
                lines.append(f"| {sit} | " + " | ".join(str(table[m].get(sit, "")) for m in modes) + " |")
            lines.append("")
    return lines


def _profile(key: str, processes: dict) -> list[str]:
    """A py-spy note: per process, each thread that ran, with the share of its samples in its commonest frames (a
    ``--gil`` note, whose samples are of the GIL's holder only: each thread's share of them first)."""
    gil = "--gil" in key
    how = "GIL holders only: each thread's share of" if gil else "idle samples included: share of each thread's"
    lines = [f"{key} (py-spy, 100 Hz, {how} samples, then by innermost frame):", ""]
    for proc, threads in processes.items():
        if "error" in threads:
            lines.append(f"- {proc}: {threads['error']}")
            continue
        total = sum(info.get("samples", 0) for info in threads.values()) or 1
        for thread, info in threads.items():
            leaves = info.get("leaves", {})
            if set(leaves) <= {"Poller.poll", "Popen._try_wait", "_watch_parent", "Socket.recv_multipart"}:
                continue  # a thread that only waits
            top = ", ".join(f"{name} {share:.0%}" for name, share in list(leaves.items())[:6])
            held = f" {info.get('samples', 0) / total:.0%} of the GIL:" if gil else ""
            lines.append(f"- {proc}, {thread.split(': ', 1)[-1]}:{held} {top}")
    return [*lines, ""]


def _load_sections() -> list[str]:
    """The H200 load benchmark (benchmarks/gpu_load.py): every cell is median [min..max] of interleaved runs."""
    lines = [
        "## Throughput under load, H200 (2026-12-01, `python benchmarks/gpu_load.py --sections ... --reps N`)",
        "",
        "Llama-2-7B shape, fp16, random weights, exllamav3 1.6.5, prompt ~128 tokens, greedy; 128 new tokens",
        "and 5 repetitions unless a run's title says otherwise. Each cell is the median [min..max] of the",
        "interleaved repetitions, after a warm-up. `tok_s` of a",
        "single stream is decode speed (tokens after the first over the time after the first); of a batch",
        "or callers, aggregate tokens over wall time. Raw rows drive exllamav3's own Generator/Job loop",
        "(benchmarks/_common.py); ours go through the public API.",
        "",
    ]
    lines += _runs(RUNS)
    lines += ["## Speculative decoding, H200 (2026-12-01, Llama-2-7B shape fp16, one stream, 128 new tokens)", ""]
    lines += _runs(SPECULATIVE)
    lines += ["## Images, H200 (2026-12-02, `python benchmarks/gpu_vision.py --reps 5`)", ""]
    lines += _runs(VISION)
    lines += [
        "## Serving: the engine in a thread, in a process, in two processes, H200 (2026-12-02)",
        "",
        "`benchmarks/gpu_serve.py`: 64 streaming `/v1/completions` clients from 4 client processes (their CPU is",
        "`loadgen_cores`), fresh ~128-token prompts, 128 new tokens, `ignore_eos`, beside 64 threads in process;",
        "ratios are per repetition against the first row named.",
        "",
    ]
    lines += _runs(SERVING)
    lines += [
        "## A batched sampler for exllamav3's decode step, H200 (2026-12-03, `python benchmarks/gpu_fast_decode.py`)",
        "",
        "Raw exllamav3 1.6.5 on a 1B-class Llama shape in 4-bit EXL3 (`exl3`) and the Llama-2-7B shape in fp16",
        '(`fp16`), random weights, fresh random 128-token prompts, greedy, 128 new tokens; `decode="fast"` is the',
        "same Generator with every job's token drawn in one batched pass (then `backends/exllamav3/fast_decode.py`,",
        "now `backends/exllamav3/fast/`), from run 3 on with the decode forward replayed from a CUDA graph (then",
        "`decode_graphs.py`, now `fast/graphs.py`: the whole step, 1 row and up, since run 15).",
        "",
    ]
    lines += _runs(FAST_DECODE)
    lines += _invariance()
    lines += ["## Ray Serve, prefix-aware routing, H200 (2026-12-02)", ""]
    lines += _runs(RAY)
    cpu = RESULTS / "serve_cpu.json"
    if cpu.exists():
        d = json.loads(cpu.read_text())
        lines += [
            f"## Serving on CPU ({d['model']}, {d['machine']}, `python benchmarks/{d['command']}`)",
            "",
            f"{d['new_tokens']} new tokens; {d['clients']} concurrent callers; the server is",
            "`exllama-integrations serve` in its own process on 127.0.0.1. Median [min..max] of interleaved",
            "repetitions.",
            "",
            "| path | tok/s (decode, or aggregate) | time to first token (s) |",
            "| --- | ---: | ---: |",
        ]
        for r in d["rows"]:
            tps = r.get("tok_s") or r.get("agg_tok_s")
            lines.append(f"| {r['path']} | {_cell(tps)} | {_cell(r['ttft_s']) if 'ttft_s' in r else ''} |")
        lines += ["", *(f"- {k}: {v:.3f}" for k, v in d["ratios"].items()), ""]
    return lines


def render() -> str:
    """RESULTS.md's text, made from the committed JSON alone (a test checks the committed file is this)."""
    gpu = json.loads((RESULTS / "gpu_throughput.json").read_text())
    cpu = json.loads((RESULTS / "cpu_stream_vs_generate.json").read_text())
    m = gpu["meta"]
    lines = [
        "# Benchmark results",
        "",
        *_load_sections(),
        f"## GPU, single streams by backend (2026-11-30): {m['gpu']}, torch {m['torch']}",
        "",
        f"Llama-2-7B shape (hidden {m['shape']['hidden']}, {m['shape']['layers']} layers, "
        f"vocab {m['shape']['vocab']}), "
        f"random weights, prompt {m['prompt_tokens']} tokens, {m['new_tokens']} new tokens, greedy, batch 1, "
        f"median of {m['reps']} interleaved runs. Made by `python benchmarks/gpu_throughput.py` on the lent H200.",
        "",
        *([f"Runs: {m['runs']}.", ""] if "runs" in m else []),
    ]
    lines += _speed_table(gpu["rows"])
    hf = next(r for r in gpu["rows"] if r["path"].startswith("transformers"))
    best = max((r for r in gpu["rows"] if "ExLlamaLLM" in r["path"]), key=lambda r: r["tokens_per_s"])
    lines += [
        "",
        f"Best single-stream path through ExLlamaLLM ({best['path']}): "
        f"{best['tokens_per_s'] / hf['tokens_per_s']:.1f}x transformers fp16 generate() in the same run.",
        "",
    ]
    lines += ["Targets (issue #3), this run:", ""]
    for r in gpu["rows"]:
        if "ratio_vs_raw" in r:
            ok = "met" if r["ratio_vs_raw"] >= 0.97 else "MISSED"
            lines.append(f"- {r['path']} >= 0.97 of raw: {r['ratio_vs_raw']:.3f}, {ok}")
        elif "ratio_vs_one_stream" in r:
            ok = "met" if r["ratio_vs_one_stream"] >= 8 else "MISSED"
            lines.append(f"- {r['path']} >= 8x one stream: {r['ratio_vs_one_stream']:.2f}x, {ok}")
    x = best["tokens_per_s"] / hf["tokens_per_s"]
    lines += [f"- best 4-bit path >= 15x transformers fp16: {x:.1f}x, {'met' if x >= 15 else 'MISSED'}", ""]
    profiled = [r for r in gpu["rows"] if "profile" in r and "error" not in r["profile"]]
    if profiled:
        lines += [
            "### Where a token's time goes (torch.profiler, CUDA activity, 64 new tokens)",
            "",
            "GPU busy = the sum of kernel times per token. A path whose wall time per token is far above its GPU "
            "busy time waits on the host (Python, kernel launches); one close to it waits on the GPU. "
            "Weight bytes / GPU busy time is the effective weight bandwidth (H200 HBM3e: 4.8 TB/s).",
            "",
            "| path | wall ms/token (timed run) | GPU busy ms/token | GPU busy share | kernels/token "
            "| weight GB/s while busy | top kernel (ms/token) |",
            "| --- | ---: | ---: | ---: | ---: | ---: | --- |",
        ]
        for r in profiled:
            p = r["profile"]
            wall = 1000 / r["tokens_per_s"]
            busy = p["gpu_busy_ms_per_token"]
            top = p["top_kernels_ms_per_token"][0]
            name = top[0].split("(")[0].replace("void ", "")[:48]
            bw = r.get("weight_bytes", 0) / (busy / 1000) / 1e9
            lines.append(
                f"| {r['path']} | {wall:.2f} | {busy:.2f} | {busy / wall:.0%} | {p['kernels_per_token']:.0f} "
                f"| {bw:.0f} | `{name}` {top[1]:.2f} |"
            )
        lines.append("")
    for extra in sorted(RESULTS.glob("gpu_throughput_*.json")):
        e = json.loads(extra.read_text())
        lines += [f"### {extra.stem}", "", f"{e['meta'].get('runs', '')}.", ""]
        lines += _speed_table(e["rows"])
        lines.append("")
    lines += [
        "## CPU: ExLlamaLLM.stream() vs transformers generate()",
        "",
        f"{cpu['model']}, {cpu['machine']}, torch {cpu['torch']}, prompt {cpu['prompt_tokens']} tokens, "
        f"{cpu['new_tokens']} new tokens, median of {cpu['reps']}. "
        "Made by `python benchmarks/cpu_stream_vs_generate.py`.",
        "",
        "| path | tokens/s |",
        "| --- | ---: |",
        f"| transformers generate() | {cpu['transformers_generate_tps']} |",
        f"| ExLlamaLLM.stream() | {cpu['exllamallm_stream_tps']} |",
        f"| ratio | {cpu['ratio']} |",
        "",
    ]
    gcp = RESULTS / "cpu_gc_pause.json"
    if gcp.exists():
        d = json.loads(gcp.read_text())
        lines += [
            f"## CPU: one full garbage collection in a serving process ({d['machine']}, `{d['command']}`)",
            "",
            "The demo model, torch, LangChain and LlamaIndex loaded, one chat answered; `gc.collect(2)` timed with",
            "nothing frozen and after `gc.freeze()`, interleaved. No generation in the process advances meanwhile.",
            "",
            "| heap | objects a collection scans | full collection (ms) |",
            "| --- | ---: | ---: |",
        ]
        for k, r in d["rows"]["full collection"].items():
            lines.append(f"| {k} | {r['objects_scanned']} | {_cell(r['ms'])} |")
        lines.append("")
    emb = RESULTS / "cpu_embeddings.json"
    if emb.exists():
        d = json.loads(emb.read_text())
        lines += [
            f"## Embeddings per second: EmbeddingRuntime vs sentence-transformers ({d['model']}, {d['device']})",
            "",
            f"{d['machine']}, torch {d['torch']}, `{d['command']}`. Both in one process with the same threads, their "
            "order alternating each repetition; batch 1 is one text per call, batch 64 one call of 64 texts. "
            f"Their vectors: cosine >= {d['min_cosine_to_sentence_transformers']}.",
            "",
            "| batch | ours (texts/s) | sentence-transformers (texts/s) | ours / theirs (paired) |",
            "| --- | ---: | ---: | ---: |",
        ]
        for k, r in d["rows"].items():
            cells = [_cell(v) for v in r.values()]
            lines.append(f"| {k} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    (RESULTS / "RESULTS.md").write_text(render())
    gpu = json.loads((RESULTS / "gpu_throughput.json").read_text())

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in gpu["rows"]]
    panels: list[tuple[str, list[str], list[dict]]] = []
    loads = [RESULTS / f for f in LOAD_PLOT if (RESULTS / f).exists()]
    if loads:  # under load, through the public API beside raw exllamav3 (medians, min..max)
        named = [
            (f"{sec}: {name}", r["tok_s"])
            for f in loads
            for sec, paths in json.loads(f.read_text())["rows"].items()
            if sec != "single"
            for name, r in paths.items()
        ]
        title = "tokens/s under load (run 13, fresh prompts: median, min..max), 7B shape, H200"
        panels.append((title, *map(list, zip(*named))))
    spec_path = RESULTS / "gpu_speculative.json"
    if spec_path.exists():  # speculative decoding: each mode beside plain decoding
        spec = json.loads(spec_path.read_text())["rows"]
        named = [
            (f"{mode.split(':')[0].split(' (')[0]}: {name}", r["tok_s"])
            for mode, paths in spec.items()
            for name, r in paths.items()
        ]
        panels.append(
            ("tokens/s, one stream, speculative decoding (median, min..max), 7B shape, H200", *map(list, zip(*named)))
        )
    fig, axes = plt.subplots(1 + len(panels), 1, figsize=(9, 4 + 4 * len(panels)), squeeze=False)
    ax = axes[0][0]
    names = [r["path"].replace(": ", "\n") for r in rows]
    vals = [r["tokens_per_s"] for r in rows]
    colors = ["#888" if "raw" in r["path"] or r["path"].startswith("transformers") else "#2a6" for r in rows]
    ax.barh(names, vals, color=colors)
    for i, v in enumerate(vals):
        ax.text(v, i, f" {v:.0f}", va="center", fontsize=8)
    ax.set_xlabel("tokens/s (Llama-2-7B shape, H200, greedy)")
    ax.invert_yaxis()
    ax.tick_params(axis="y", labelsize=7)
    for (title, labels, cells), row in zip(panels, axes[1:]):
        med = [c["median"] for c in cells]
        err = [[c["median"] - c["min"] for c in cells], [c["max"] - c["median"] for c in cells]]
        wrapped = ["\n".join(textwrap.wrap(x, 56)) for x in labels]
        row[0].barh(wrapped, med, xerr=err, color=["#888" if "raw" in x else "#2a6" for x in labels], capsize=2)
        row[0].set_xlabel(title)
        row[0].invert_yaxis()
        row[0].tick_params(axis="y", labelsize=6)
    fig.tight_layout()
    fig.savefig(RESULTS / "gpu_throughput.png", dpi=110)


if __name__ == "__main__":
    main()
