"""CPU: a decision read from the logits vs a constrained JSON generation of the same answer (the demo model).

Both paths ask the same question about the same support message through the model's chat template: the decision
scores the labels from one prefill (``decider(runtime).decide``); the JSON path generates ``{"team": ...}`` (or
all three answers) greedily under a JSON schema whose values are the labels (llguidance), as a provider without
logits must. A third path, ``one_token_generation``, reads the JSON path's prompt and generates one token (no
grammar): the floor any generation of that prompt costs, so the rows say how much of the JSON path is reading the
prompt (which the decision must do too) and how much is decoding. Neither path has a prefix cache across requests
(the transformers backend keeps none), and each reads its state once per request: the decision shares its prefix
across questions, the JSON generation asks every question in one prompt. Every call gets a message no call saw
before; paths interleaved (each round starts one path later); medians with min and max, and the paired ratio per
round.

    python benchmarks/cpu_decisions.py --reps 7
"""

from __future__ import annotations

import itertools
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from _common import Results, interleave, parser  # noqa: E402

TOPICS = [
    "my invoice was charged twice",
    "the app crashes on login",
    "do you offer a discount for teams",
    "the export to CSV is empty",
    "I want a refund for last month",
    "the API returns 500 errors",
    "how much does the enterprise plan cost",
    "my password reset email never came",
]
TEAMS = ("billing", "technical", "sales")
LEVELS = ("calm", "concerned", "angry")


def measure(rt: Any, results: Results, out: Path, reps: int, forwards: Callable[[], int] | None = None) -> None:
    """The rows, on a loaded runtime (the CPU demo model here, an exllamav3 model in gpu_decisions.py).

    ``forwards``: the model forwards run so far, where the caller counts them: each decision's row then says how
    many it ran.
    """
    from exllama_integrations import Grammar
    from exllama_integrations.chat.decisions import decision_messages, question_text
    from exllama_integrations.contract.decisions import Choice, DecisionRequest, Label, Noul, Score, labels
    from exllama_integrations.runtime.decisions import decider

    decide = decider(rt)
    team = Choice("team", "Which team should handle this request?", tuple(Label(t) for t in TEAMS))
    three = (
        Noul("urgent", "Is this request urgent?"),
        team,
        Score("anger", "How frustrated is the customer?", labels(*LEVELS)),
    )
    counter = itertools.count()

    def state() -> str:  # a message no call saw before
        i = next(counter)
        return f"Ticket {i}: {TOPICS[i % len(TOPICS)]} (customer #{1000 + i}). Please help."

    def schema(questions: tuple) -> dict:
        enums = {"urgent": ["yes", "no"], "team": list(TEAMS), "anger": [0, 1, 2]}
        props = {q.name: {"enum": enums[q.name]} for q in questions}
        return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}

    def by_decision(questions: tuple) -> dict[str, float]:
        before = forwards() if forwards else 0
        t0 = time.perf_counter()
        r = decide.decide(DecisionRequest(state(), questions))
        row = {"seconds": time.perf_counter() - t0, "prompt_tokens": r.prompt_tokens, "new_tokens": 0}
        if forwards:
            row["forwards"] = forwards() - before
        return row

    def by_json(questions: tuple) -> dict[str, float]:
        parts = "\n\n".join(question_text(q) for q in questions)
        ask = parts + "\n\nReply with a JSON object of the answers, keyed " + ", ".join(q.name for q in questions)
        messages = decision_messages(state(), ask)
        t0 = time.perf_counter()
        r = rt.generate(
            rt.chat_prompt(messages),
            add_special_tokens=False,
            temperature=0,
            max_new_tokens=48,
            grammar=Grammar.json_schema(schema(questions)),
        )
        took = time.perf_counter() - t0
        json.loads(r.text)  # a whole answer, or the comparison is unfair
        return {"seconds": took, "prompt_tokens": r.usage.prompt_tokens, "new_tokens": r.usage.completion_tokens}

    def by_one_token(questions: tuple) -> dict[str, float]:
        parts = "\n\n".join(question_text(q) for q in questions)
        ask = parts + "\n\nReply with a JSON object of the answers, keyed " + ", ".join(q.name for q in questions)
        prompt = rt.chat_prompt(decision_messages(state(), ask))
        t0 = time.perf_counter()
        r = rt.generate(prompt, add_special_tokens=False, temperature=0, max_new_tokens=1)
        took = time.perf_counter() - t0
        return {"seconds": took, "prompt_tokens": r.usage.prompt_tokens, "new_tokens": r.usage.completion_tokens}

    results.note(out, "model", rt.model_info().name)
    results.note(out, "backend", rt.model_info().backend)
    results.note(out, "threads", rt.model_info().details.get("threads"))
    results.note(out, "load_average_at_start", os.getloadavg())  # on a shared machine, say how busy it was
    for section, qs in (("one_choice", (team,)), ("three_questions", three)):
        interleave(
            results,
            out,
            section,
            {
                "decision": lambda qs=qs: by_decision(qs),
                "json_generation": lambda qs=qs: by_json(qs),
                "one_token_generation": lambda qs=qs: by_one_token(qs),
            },
            reps,
        )
        pairs = [("json_generation", "decision"), ("one_token_generation", "decision")]
        results.ratios(out, section, pairs, key="seconds")
        results.note(out, f"load_average_after_{section}", os.getloadavg())


def main() -> None:
    ap = parser(__doc__)
    ap.set_defaults(reps=7)
    args = ap.parse_args()
    from exllama_integrations import ExLlamaRuntime
    from exllama_integrations.demo_model import demo_model_dir

    with ExLlamaRuntime(demo_model_dir(), "transformers") as rt:
        measure(rt, Results("cpu_decisions.json"), args.out, args.reps)


if __name__ == "__main__":
    main()
