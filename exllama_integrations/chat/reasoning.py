"""Reasoning models in a chat: their delimiters, whether a turn thinks, and what a turn's request says.

Decided once for every door. The delimiters come from the chat template (a template that mentions
``</think>`` writes or strips thinking blocks), or from ``reasoning_tags=(start, end)``. Whether this turn
starts inside the block is read from the generation prompt itself (the text the template adds for the
assistant's turn): a prompt that opens the block (DeepSeek-R1, forced thinking) starts as reasoning; one
that opens and closes it (Qwen3 with ``enable_thinking=False``) does not reason; otherwise the model
decides by opening the block or not. A constrained answer needs the model to think first, so with a
grammar a block the model may open is opened in the prompt (the grammar then applies after it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

from ..contract.api import Reasoning
from .formats import find_format, spelled

KNOWN_TAGS: tuple[tuple[str, str], ...] = (
    ("<think>", "</think>"),
    ("<thinking>", "</thinking>"),
    ("<seed:think>", "</seed:think>"),
    ("<|begin_of_thought|>", "<|end_of_thought|>"),
    ("◁think▷", "◁/think▷"),
    ("[THINK]", "[/THINK]"),
)
"""Delimiter pairs reasoning models use, in the order they are looked for in a chat template."""


def find_reasoning(template: str | None) -> Reasoning | None:
    """The reasoning delimiters a chat template uses, or None when it shows no sign of reasoning."""
    if not template:
        return None
    template = spelled(template)  # tokens a template builds with str.format (Hy3's), as it writes them
    family = find_format(template).thinking  # harmony's analysis channel: a pair no other template shows
    if family is not None and family[0] in template:
        return Reasoning(*family)
    for start, end in KNOWN_TAGS:
        if end in template or start in template:
            return Reasoning(start, end)
    return None


def tags_reasoning(tags: Sequence[str] | None) -> Reasoning | None:
    """``reasoning_tags=(start, end)`` as a Reasoning (None stays None)."""
    if tags is None:
        return None
    if isinstance(tags, str) or len(tags) != 2:
        from ..errors import InvalidSettingsError

        raise InvalidSettingsError("reasoning_tags must be a (start, end) pair, e.g. ('<think>', '</think>').")
    return Reasoning(str(tags[0]), str(tags[1]))


def generation_prompt(render: Callable[[bool], str], rendered: str) -> str:
    """The text the template adds for the assistant's turn: ``rendered`` less the same messages without it.

    Falls back to the prompt's last 256 characters for a template whose two renderings do not share a prefix, and
    for one whose user turn already ends with the assistant's opener (DeepSeek-V3.2 and V4 write
    ``<｜Assistant｜><think>`` there and add nothing for the generation prompt).
    """
    without = render(False)
    if rendered.startswith(without) and len(rendered) > len(without):
        return rendered[len(without) :]
    return rendered[-256:]


def turn_reasoning(reasoning: Reasoning | None, gen_prompt: str, budget: int | None) -> Reasoning | None:
    """This turn's reasoning: started if the generation prompt opens the block, None if it opens and closes it."""
    if reasoning is None:
        return None
    at = gen_prompt.rfind(reasoning.start)
    if at >= 0 and reasoning.end in gen_prompt[at:]:
        return None  # the template closed the block: this turn does not think (enable_thinking=False)
    return replace(reasoning, started=at >= 0, budget=budget)


def open_block(reasoning: Reasoning) -> tuple[str, Reasoning]:
    """Text that opens the block at the end of the prompt, and the reasoning as started."""
    return reasoning.start + "\n", replace(reasoning, started=True)


__all__ = ["KNOWN_TAGS", "find_reasoning", "generation_prompt", "open_block", "tags_reasoning", "turn_reasoning"]
