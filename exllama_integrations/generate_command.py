"""``demo`` and ``generate`` run: a prompt | llm | parser chain streamed to the terminal, then the backend and speed.

The model is loaded through LangChain's ``ExLlamaLLM`` with the command's sampling flags; the text goes to stdout, the
load line, the usage and speed line and a hint when the CPU is starved go to stderr.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

SLOW_CPU_TOKENS_PER_S = 5
"""Below this the demo model (135M) is starved of CPU (measured: 14-16 tokens/s on two free cores)."""


def llm_of(model_dir: str, args: argparse.Namespace, chat: bool) -> Any:
    """LangChain's ExLlamaLLM over ``model_dir`` with the sampling flags' settings (``chat``: through the template)."""
    from .langchain import ExLlamaLLM

    options = {"num_threads": args.threads} if args.threads else {}
    return ExLlamaLLM(
        backend_options=options,
        model_dir=model_dir,
        backend=args.backend,
        max_seq_len=args.max_seq_len,
        max_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        seed=args.seed,
        stop=args.stop,
        use_chat_template=chat,
    )


def run_chain(llm: Any, template: str, inputs: dict[str, str]) -> None:
    """Stream prompt | llm | parser to the terminal, then the backend and speed."""
    from langchain_core.callbacks import BaseCallbackHandler
    from langchain_core.output_parsers import StrOutputParser
    from langchain_core.prompts import PromptTemplate

    class Stats(BaseCallbackHandler):
        info: dict[str, Any] = {}

        def on_llm_end(self, response: Any, **kwargs: Any) -> None:
            Stats.info = response.generations[0][0].generation_info or {}

    loaded = llm.exllama_runtime.model_info()
    details = loaded.details
    threads = details.get("threads")
    where = f"{details.get('device')}, {threads} thread{'s' if threads != 1 else ''}" if threads else "GPU"
    seconds = details.get("load_seconds", 0)
    print(f"loaded {loaded.name} on {loaded.backend} ({where}) in {seconds:.1f} s", file=sys.stderr)
    chain = PromptTemplate.from_template(template) | llm | StrOutputParser()
    for piece in chain.stream(inputs, config={"callbacks": [Stats()]}):
        sys.stdout.write(piece)
        sys.stdout.flush()
    info = Stats.info
    model = llm.exllama_runtime.model_info()
    usage = info.get("usage") or {}
    tps = info.get("tokens_per_second")
    sys.stdout.write("\n\n")
    print(
        f"[backend={model.backend} model={model.name} prompt_tokens={usage.get('prompt_tokens')} "
        f"completion_tokens={usage.get('completion_tokens')} finish={info.get('native_finish_reason')} "
        f"tokens/s={tps:.1f}]"
        if tps
        else f"[backend={model.backend} model={model.name}]",
        file=sys.stderr,
    )
    if tps and model.backend == "transformers" and tps < SLOW_CPU_TOKENS_PER_S:
        print(
            f"hint: {tps:.1f} tokens/s is slow for this model on the CPU ({SLOW_CPU_TOKENS_PER_S}+ on two free cores): "
            "the machine may be busy; try --threads 1, or a GPU with backend exllamav3.",
            file=sys.stderr,
        )


__all__ = ["SLOW_CPU_TOKENS_PER_S", "llm_of", "run_chain"]
