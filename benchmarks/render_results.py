"""Turn the committed JSON results into benchmarks/results/RESULTS.md and gpu_throughput.png (runs on CPU)."""

from __future__ import annotations

import json
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


def main() -> None:
    gpu = json.loads((RESULTS / "gpu_throughput.json").read_text())
    cpu = json.loads((RESULTS / "cpu_stream_vs_generate.json").read_text())
    m = gpu["meta"]
    lines = [
        "# Benchmark results",
        "",
        f"## GPU: {m['gpu']}, torch {m['torch']}",
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
    (RESULTS / "RESULTS.md").write_text("\n".join(lines))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in gpu["rows"]]
    fig, ax = plt.subplots(figsize=(9, 4))
    names = [r["path"].replace(": ", "\n") for r in rows]
    vals = [r["tokens_per_s"] for r in rows]
    colors = ["#888" if "raw" in r["path"] or r["path"].startswith("transformers") else "#2a6" for r in rows]
    ax.barh(names, vals, color=colors)
    for i, v in enumerate(vals):
        ax.text(v, i, f" {v:.0f}", va="center", fontsize=8)
    ax.set_xlabel("tokens/s (Llama-2-7B shape, H200, greedy)")
    ax.invert_yaxis()
    ax.tick_params(axis="y", labelsize=7)
    fig.tight_layout()
    fig.savefig(RESULTS / "gpu_throughput.png", dpi=110)


if __name__ == "__main__":
    main()
