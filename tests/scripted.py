"""A runtime wrapper that scripts a real model's replies: each generation held to an exact text by a grammar.

The model (a tiny random-weight family model, tests/tool_families.py) is real and so is its tokenizer; the script
only decides which tokens it writes, as a grammar over the family's own tokens, so the reply goes through the whole
spine (decoding, markup shown, stop ids, reasoning split, readers, every door) like a model's own would.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

from tool_families import FAMILIES

from exllama_integrations.contract.api import Grammar


class Scripted:
    """A runtime that holds each generation to ``reply`` (after the model's thinking, which it keeps short)."""

    def __init__(self, inner: Any, family: str) -> None:
        self._inner, self.family, self.reply = inner, family, None

    def __getattr__(self, name: str):
        return getattr(self._inner, name)

    def _script(self, request):
        if self.reply is None:
            return request
        reply = self.reply.pop(0) if isinstance(self.reply, list) else self.reply  # a list: one reply a turn
        prompt, r = request.prompt, request.reasoning
        if r is not None:  # think two tokens, then the runtime closes the block and the reply follows
            if not r.started:
                prompt = prompt + r.start + "\n"
            r = dataclasses.replace(r, started=True, budget=2)
        grammar = Grammar.lark(f"start: {exact(self._inner, reply, FAMILIES[self.family].plain)}\n")
        return dataclasses.replace(request, prompt=prompt, reasoning=r, grammar=grammar)

    def open(self, request):
        return self._inner.open(self._script(request))

    def aopen(self, request):
        return self._inner.aopen(self._script(request))


def exact(runtime: Any, text: str, plain_tokens: tuple[str, ...] = ()) -> str:
    """Lark for exactly ``text``: the family's tokens as themselves, the rest as text; a final end-of-turn left off.

    ``plain_tokens``: the family's added tokens that are not special (they show in text, as GLM's ``<arg_key>``).
    """
    tok = runtime.tokenizer
    ends = set(tok.eos_token_ids)
    names = sorted((t for t in tok._special_by_text if t), key=len, reverse=True)  # noqa: SLF001
    plain = ("<think>", "</think>", "<tool_call>", "</tool_call>", "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>")
    plain += ("<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>", *plain_tokens)
    pieces = re.split("(" + "|".join(re.escape(t) for t in [*names, *plain]) + ")", text)
    out = []
    for p in pieces:
        if not p:
            continue
        tid = tok.token_to_id(p)
        if tid is not None and (p in names or p in plain):
            if tid not in ends:
                out.append(f"<[{tid}]>")
        else:
            out.append(json.dumps(p))
    return " ".join(out)
