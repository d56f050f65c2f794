"""GPU: a decision read from the logits vs a constrained JSON generation of the same answer, on exllamav3.

The rows and their method are cpu_decisions.py's (the same questions, prompts, schema and interleaving; a state no
call saw before), on a model exllamav3 loads: a 1B-class Llama shape (hidden 2048, 16 layers, GQA 16/8, fp16) with
random weights and SmolLM2-135M-Instruct's real tokenizer and chat template, so that the JSON answer takes as many
tokens as a real model's would (a fixture tokenizer of bytes would lengthen it and flatter the decision). The
weights are random (no checkpoint can be fetched on the GPU machine), which costs nothing here: the grammar holds
the JSON path to the schema's values, and both paths' work does not depend on what the weights say. The decision
path is exllamav3's paged scorer (``backends/exllamav3/decision_plan.py``: the prefix's full pages once, each
question's prompt by pages after them, its labels' rest fused into its last forward where few and small), and each
decision's row says how many model forwards it ran (``forwards``: ``Model.forward`` calls counted while it runs,
nothing else running); the JSON path is exllamav3's generator under llguidance. The tokenizer files are carried in
``.devcache/smollm2-tokenizer/`` (copy them from the demo model: ``exllama-integrations prepare-demo`` prints its
directory).

    python benchmarks/gpu_decisions.py --reps 7
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))
from _common import Results, parser  # noqa: E402
from cpu_decisions import measure  # noqa: E402

TOKENIZER = Path(__file__).parent.parent / ".devcache" / "smollm2-tokenizer"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


def fixture(path: Path) -> Path:
    """The model directory: random 1B-class Llama weights, SmolLM2's tokenizer files (vocab 49152, bos 1, eos 2)."""
    from fixture_models import Shape, make_llama

    if not (path / ".complete").exists():
        shape = Shape(hidden=2048, layers=16, heads=16, kv_heads=8, inter=5632, vocab=49152, context=4096)
        make_llama(path, shape, seed=11)
        for name in TOKENIZER_FILES:
            shutil.copy(TOKENIZER / name, path / name)
        (path / ".complete").write_text("1")
    return path


def main() -> None:
    ap = parser(__doc__)
    ap.set_defaults(reps=7)
    ap.add_argument("--model-dir", type=Path, default=Path("/tmp/models/llama1b-smollm2-tokenizer"))
    args = ap.parse_args()
    import torch

    from exllama_integrations import ExLlamaRuntime

    results = Results("gpu_decisions.json")
    results.note(args.out, "gpu", torch.cuda.get_device_name())
    results.note(args.out, "shape", "Llama hidden 2048, 16 layers, 16/8 heads, inter 5632, fp16, random weights")
    with ExLlamaRuntime(str(fixture(args.model_dir)), "exllamav3", max_seq_len=4096) as rt:
        model = rt.diagnostics()["model"]
        inner, calls = model.forward, [0]

        def counted(*a: Any, **k: Any) -> Any:
            calls[0] += 1
            return inner(*a, **k)

        model.forward = counted  # (the runtime, and its wraps, end with the block)
        measure(rt, results, args.out, args.reps, forwards=lambda: calls[0])


if __name__ == "__main__":
    main()
